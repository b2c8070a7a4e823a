"""Shared fixtures: free ports, an in-process node, and real node processes that are always killed."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from mnesite.core.node import CoreNode
from mnesite.rlog import messages
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.config import parse_config

from tests.spark_fixtures import spark_session  # noqa: F401  (the one SparkSession of the test run)

if TYPE_CHECKING:
    from mnesite.replicant.replica import ReplicaConfig

REPO = Path(__file__).resolve().parent.parent


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (scripts, not a package: their directory goes on
    ``sys.path`` for their own imports of each other); loaded once per test run."""
    if name in sys.modules:
        return sys.modules[name]
    directory = str(REPO / "benchmarks")
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def simulation_seeds(ci_seeds: int, count_variable: str, fast_seeds: int) -> list:
    """The seeds a simulation's seed test runs, as pytest parameters with ids ``seed_N``: only
    ``MNESITE_SIM_SEED`` when it is set (a replay), else seeds 0 up to ``count_variable``'s value or
    ``ci_seeds``. The seeds from ``fast_seeds`` on are marked deep: CI runs them all, the developers'
    fast lane (``make test-fast``) runs the first ``fast_seeds``, a sample of every simulation."""
    if os.environ.get("MNESITE_SIM_SEED"):
        return [pytest.param(int(os.environ["MNESITE_SIM_SEED"]), id=f"seed_{os.environ['MNESITE_SIM_SEED']}")]
    seeds = range(int(os.environ.get(count_variable, ci_seeds)))
    return [
        pytest.param(seed, id=f"seed_{seed}", marks=[pytest.mark.deep] if seed >= fast_seeds else []) for seed in seeds
    ]


def seed_ranges(seed_count: int, fast_seeds: int) -> list:
    """Seeds 0 to ``seed_count`` - 1 as two parameters of a test that runs a range of seeds and checks their
    sum: the first ``fast_seeds`` (the fast lane's sample), and the others, marked deep (CI runs both)."""
    return [
        pytest.param(range(fast_seeds), id=f"seeds_0-{fast_seeds - 1}"),
        pytest.param(range(fast_seeds, seed_count), id=f"seeds_{fast_seeds}-{seed_count - 1}", marks=pytest.mark.deep),
    ]


# The share of a property test's examples that the fast lane runs (``examples_by_lane``).
FAST_EXAMPLES_SHARE = 4


def examples_by_lane(max_examples: int, *strategies, **named_strategies) -> Callable:
    """``@given(*strategies, **named_strategies)`` with ``max_examples`` examples in CI's deep run, and a
    ``FAST_EXAMPLES_SHARE``-th of them in the fast lane (like ``simulation_seeds``, a sample): the test
    runs as ``[fast]`` and ``[deep]`` (marked deep). Its ``@example`` decorators go below this one."""

    def decorate(test: Callable) -> Callable:
        counts = {"fast": max(1, max_examples // FAST_EXAMPLES_SHARE), "deep": max_examples}
        lanes = {
            lane: settings(max_examples=n, deadline=None)(given(*strategies, **named_strategies)(test))
            for lane, n in counts.items()
        }

        @pytest.mark.parametrize("lane", ["fast", pytest.param("deep", marks=pytest.mark.deep)])
        def run(lane: str) -> None:
            lanes[lane]()

        run.__name__, run.__qualname__, run.__doc__ = test.__name__, test.__qualname__, test.__doc__
        return run

    return decorate


def _listen_ports() -> range:
    """Ports for the nodes' listening sockets: outside the kernel's ephemeral range. A port the kernel
    picked for ``bind(0)`` lies in that range, so between the pick and a node's bind (seconds later,
    for a node started after the others) the kernel could hand it out as the source port of one of
    the many outbound connections of the test's nodes: the node then fails with EADDRINUSE."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(10_000, low) if low - 10_000 >= 2_000 else range(high + 1, 65_536)


_PORTS = _listen_ports()
_PORTS_GIVEN: set[int] = set()  # never the same port twice in one test run (a node may not have bound it yet)


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range, not given before in this run."""
    rng = random.Random()
    for _ in range(1_000):
        port = rng.choice(_PORTS)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS}")


def watch_body(replicant: str, endpoint: str, shard: str = "default", **extra: object) -> dict[str, object]:
    """A replicant's ``watch`` from the start of ``shard``'s log, pushes to ``endpoint``."""
    from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION
    from mnesite.rlog.types import GENESIS_DIGEST

    return {
        "shard": shard,
        "replicant": replicant,
        "endpoint": endpoint,
        "from": [0, 0],
        "from_digest": GENESIS_DIGEST,
        "protocol": REPLICATION_PROTOCOL_VERSION,
        **extra,
    }


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Poll ``condition`` until it holds; fail the test with ``what`` when ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def logged_op_tags(data_dir: Path, shard: str, key: tuple[int, int]) -> list[str] | None:
    """The op tags (``w``, ``r``, ...) of the entry at ``key`` in a node's log, read-only beside the running
    node: how the entry was packed. None if the node has not logged it."""
    uri = f"file:{data_dir / 'mnesite.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=10)) as connection:
        query = "SELECT ops FROM _mnesite_rlog WHERE shard = ? AND generation = ? AND counter = ?"
        row = connection.execute(query, (shard, *key)).fetchone()
    return None if row is None else [op[0] for op in msgpack.unpackb(row[0])]


@contextlib.contextmanager
def thread_replicant(
    data_dir: Path, core_endpoint: str, limits: dict | None = None, replica_config: ReplicaConfig | None = None
) -> Iterator[str]:
    """A replicant of the core at ``core_endpoint``, served by a thread of this process; yields its
    endpoint and stops it after the block, also when the block fails. ``limits``: its [limits] section;
    ``replica_config``: its shards' ``ReplicaConfig`` (a shorter failure timeout), else the node's own."""
    import threading

    from mnesite.replicant.node import ReplicantNode
    from mnesite.rlog.config import parse_config

    port = free_port()
    replicant = ReplicantNode(
        parse_config(
            {
                "node": {"name": "replicant1", "role": "replicant", "data_dir": str(data_dir),
                         "listen": f"tcp://127.0.0.1:{port}"},
                "cluster": {"core_nodes": {"core1": core_endpoint}},
                "storage": {"synchronous": "NORMAL"},
                "limits": limits or {},
            }
        ),
        replica_config=replica_config,
    )  # fmt: skip
    replicant.bind()
    thread = threading.Thread(target=replicant.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        replicant.request_stop("the test ended")
        thread.join(timeout=10)


def offline_replicant(data_dir: Path, limits: dict | None = None, extra: dict | None = None):
    """A ReplicantNode that is never bound nor served (its rules called directly); the caller closes
    it (``close_offline``). ``limits``: its [limits] section; ``extra``: other sections (``[backup]``).
    ``replicant_by_hand`` closes it for you."""
    from mnesite.replicant.node import ReplicantNode

    return ReplicantNode(
        parse_config(
            {
                "node": {"name": "replicant1", "role": "replicant", "data_dir": str(data_dir),
                         "listen": "tcp://127.0.0.1:1"},
                "cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:2"}},
                "limits": limits or {},
                **(extra or {}),
            }
        )
    )  # fmt: skip


def close_offline(node) -> None:
    """Close an ``offline_replicant``: the zmq sockets the test gave it (``socket``, ``core_sockets``;
    a stand-in object is only dropped), its store and its data directory's lock."""
    for opened in [node.socket, *node.core_sockets.values()]:
        if isinstance(opened, zmq.Socket):
            opened.close(0)
    node.socket = None
    node.core_sockets = {}
    node.store.close()
    node.data_dir_lock.release()


@contextlib.contextmanager
def replicant_by_hand(data_dir: Path, limits: dict | None = None, extra: dict | None = None) -> Iterator:
    """An ``offline_replicant`` (the test calls its rules), closed after the block, also when it fails."""
    node = offline_replicant(data_dir, limits, extra)
    try:
        yield node
    finally:
        close_offline(node)


# The election timeouts of a core of an in-process cluster (node_config) when its test sets none of
# the consensus timings: production's 800-1600 ms made every such test wait about 1.2 s for its first
# sequencer, and as long again after each stop of one. Three heartbeats (100 ms) still fit in the least.
TEST_ELECTION_TIMEOUT_MS = (300, 600)
CONSENSUS_TIMINGS = ("election_timeout_ms_min", "election_timeout_ms_max", "heartbeat_interval_ms")


def node_config(data_dir: Path, port: int, name: str = "core1", extra: dict | None = None):
    data = {
        "node": {"name": name, "role": "core", "data_dir": str(data_dir), "listen": f"tcp://127.0.0.1:{port}"},
        "storage": {"synchronous": "NORMAL"},
    }
    for section, values in (extra or {}).items():
        data.setdefault(section, {}).update(values)
    cluster = data.get("cluster", {})
    if len(cluster.get("core_nodes", {})) > 1 and not any(key in cluster for key in CONSENSUS_TIMINGS):
        cluster["election_timeout_ms_min"], cluster["election_timeout_ms_max"] = TEST_ELECTION_TIMEOUT_MS
    return parse_config(data)


@contextlib.contextmanager
def follower_by_hand(data_dir: Path) -> Iterator[tuple[CoreNode, object]]:
    """``core1`` of three cores, not served (the test steps its rules; its socket is bound, as by the
    start-up recovery of an empty database), with the ``default`` shard open and its turn's transaction
    begun: ``(node, driver)``; closed after the block."""
    cores = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("core1", "core2", "core3")}
    node = CoreNode(node_config(data_dir, free_port(), extra={"cluster": {"core_nodes": cores}}))
    try:
        node.begin()
        node.store.ensure_shard("default", 0)
        yield node, node._open_shard("default")
    finally:
        node.close()


def changes_of_default(request_id: str, after) -> messages.Message:
    """A ``changes`` request of every table of shard ``default`` after ``after`` that waits a minute."""
    body = {"positions": [{"shard": "default", "after": list(after)}], "wait_ms": 60_000}
    return messages.Message("changes", request_id, messages.typed_body("changes", body))


def queued_to(node, envelope: list[bytes]) -> list[messages.Message]:
    """The messages a node driven by hand queued for ``envelope`` and has not sent (its outbox)."""
    return [message for _socket, to, message in node._outbox if to == envelope]


TABLE_T = {"table": "t", "key": "id", "columns": [["id", "INTEGER"], ["v", "TEXT"]]}


def create_table_t(node: CoreNode, request_id: str = "t0") -> None:
    """Dispatch ``create_table t (id, v)`` to a core driven by hand (answered to envelope ``c0``)."""
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message

    node._dispatch([b"c0"], Message("create_table", request_id, messages.typed_body("create_table", TABLE_T)))


def run_turns_until(node, condition: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    """Run turns of a node driven by hand (bound, not served) until ``condition`` holds; fail the test
    with ``what`` when ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s of turns waiting for {what}")
        node.run_turn()


def commit_table_t(node: CoreNode, request_id: str = "t0") -> None:
    """``create_table_t`` at a bound core of one driven by hand, then its turns until ``t`` is
    committed (it elects itself first)."""
    create_table_t(node, request_id)
    run_turns_until(node, lambda: node.store.catalog().get("t") is not None, "table t's commit")


@contextlib.contextmanager
def core_with_table(data_dir: Path, extra: dict | None = None) -> Iterator[CoreNode]:
    """A bound single core, not served (the test steps its driver), whose table ``t`` (id, v) is
    committed (it elected itself) and whose outbox is empty; closed after the block. ``extra``: config
    sections to add, as ``node_config`` takes them."""
    node = CoreNode(node_config(data_dir, free_port(), extra=extra))
    node.bind()
    try:
        commit_table_t(node)
        node._outbox.clear()
        yield node
    finally:
        node.close()


@contextlib.contextmanager
def forwarding_core(data_dir: Path) -> Iterator[CoreNode]:
    """``core1`` of three cores, bound but not served (the test steps its driver), with the ``default``
    shard open: a request it forwards to ``core2`` or ``core3`` is sent (queued on a dealer)."""
    cores = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("core1", "core2", "core3")}
    node = CoreNode(node_config(data_dir, free_port(), extra={"cluster": {"core_nodes": cores}}))
    node.bind()
    try:
        node.begin()
        node.store.ensure_shard("default", 0)
        node._open_shard("default")
        yield node
    finally:
        node.close()


class ServedCore:
    """A core node bound and served from a daemon thread of the test process until ``stop``."""

    def __init__(self, node: CoreNode) -> None:
        self.node = node
        self.node.bind()
        self.thread = threading.Thread(target=self.node.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.node.request_stop("stopped by its owner")  # wakes its loop at once
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            raise AssertionError("node thread did not stop within 10 s")


class ThreadNode(ServedCore):
    """A core node served from a thread of the test process (fast; for protocol and CLI tests)."""

    def __init__(self, data_dir: Path, extra: dict | None = None, port: int | None = None, name: str = "core1") -> None:
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        super().__init__(CoreNode(node_config(data_dir, self.port, name, extra=extra)))

    def client(self, **kwargs) -> Client:
        return Client(self.endpoint, **kwargs)


@pytest.fixture
def thread_node(tmp_path: Path) -> Iterator[ThreadNode]:
    node = ThreadNode(tmp_path / "data")
    try:
        yield node
    finally:
        node.stop()


class NodeProcess:
    """A real ``mnesite start`` process in its own process group; ``kill`` is kill -9.

    ``client_keys`` (``key=``, ``server_key=``) are what the readiness probe speaks with."""

    def __init__(
        self,
        config_path: Path,
        log_path: Path,
        client_keys: dict | None = None,
        command_prefix: list[str] | None = None,
    ) -> None:
        """``command_prefix``: what the node's command runs under (``ip netns exec NS``: in a namespace)."""
        self.config_path = config_path
        self.log_path = log_path
        self.client_keys = client_keys or {}
        self.command_prefix = command_prefix or []
        self.process: subprocess.Popen | None = None
        # The interpreter of another installed release (tests/test_upgrade.py): it runs from its own
        # venv, without this tree on its path. None: this tree's, as everywhere else.
        self.python: str | None = None

    def start(self, endpoint: str, timeout_s: float = 20, env: dict[str, str] | None = None) -> None:
        """Start the node (``env``: extra environment, e.g. libfaketime's) and wait until it answers."""
        self.launch(env)
        self.wait_ready(endpoint, timeout_s)

    def launch(self, env: dict[str, str] | None = None) -> None:
        """Start the node's process and return at once (``wait_ready`` waits until it answers)."""
        env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
        if self.python is not None:
            env.pop("PYTHONPATH")
        python = self.python or sys.executable
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self.command_prefix, python, "-m", "mnesite.cli", "start", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO if self.python is None else self.log_path.parent,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, endpoint: str, timeout_s: float = 20) -> None:
        """Wait until the launched node answers a status request at ``endpoint`` and is not recovering
        (a core answers status while its start-up recovery asks its peers, ``core.recovery``); fail if
        it exits."""

        def ready() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"node exited with {self.process.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with Client(endpoint, timeout_ms=200, retries=0, **self.client_keys) as client:
                    return client.status().get("recovery") is None
            except MnesiteError:
                return False

        wait_until(ready, timeout_s, f"node at {endpoint} to answer")

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signum)

    def stop(self, timeout_s: float = 20) -> None:
        """SIGTERM (a clean shutdown, as ``mnesite stop`` does) and wait for the process to exit."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        self.process.wait(timeout=timeout_s)
        self.process = None

    def kill(self) -> None:
        """kill -9 the node and wait for it to be gone."""
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None


def start_core_process(
    directory: Path, node_processes: list[NodeProcess], data_dir: str | None = None
) -> tuple[NodeProcess, str, Path]:
    """One core started with ``mnesite start`` from ``directory/core1.toml`` (``node_processes`` kills it
    at teardown): the process, its endpoint and its config file."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = directory / "core1.toml"
    config.write_text(
        f'[node]\nname = "core1"\ndata_dir = "{data_dir or directory / "core1"}"\nlisten = "{endpoint}"\n'
        '[storage]\nsynchronous = "NORMAL"\n'
    )
    node = NodeProcess(config, directory / "core1.log")
    node_processes.append(node)
    node.start(endpoint)
    return node, endpoint, config


class RouterNode:
    """A ROUTER on 127.0.0.1 that a daemon thread serves with ``_serve`` (a subclass's) until ``close``.

    A subclass sets what ``_serve`` reads before calling ``__init__``: the thread starts in it."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        raise NotImplementedError

    def receive(self) -> tuple[list[bytes], str] | None:
        """The next request's envelope and request id, or None when none arrived within 20 ms."""
        received = self.receive_message()
        return None if received is None else (received[0], received[1].request_id)

    def receive_message(self) -> tuple[list[bytes], messages.Message] | None:
        """The next request's envelope and message, or None when none arrived within 20 ms."""
        if not self.socket.poll(20):
            return None
        *envelope, frame = self.socket.recv_multipart()
        return envelope, messages.decode(frame)

    def send(self, envelope: list[bytes], message: messages.Message) -> None:
        """Send ``message`` back along ``envelope``."""
        self.socket.send_multipart([*envelope, messages.encode(message)])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.socket.close(0)  # a second close does nothing


class ScriptedNode(RouterNode):
    """A ROUTER on 127.0.0.1 that answers the n-th request it receives with ``answers[n]`` (code,
    message; None: no answer, a node that took the request and went silent), from a thread;
    ``requests`` holds the ids of every request it read.

    ``then_gone``: after its last answer the node is gone, as a stopping one is: it closes once one
    more request arrives (read, never answered) or ``STOP_GRACE_S`` passed, and nothing accepts
    connections there any more. Closed right after its answer, the answer was lost now and then (as
    production's stop found: it lingers ``rlog.server.STOP_GRACE_MS``)."""

    STOP_GRACE_S = 0.2

    def __init__(self, answers: list[tuple[str, str] | None], then_gone: bool = False) -> None:
        self.answers = answers
        self.then_gone = then_gone
        self.requests: list[str] = []
        super().__init__()

    def _serve(self) -> None:
        grace_ends_s: float | None = None
        while not self.stopping.is_set() and (grace_ends_s is None or time.monotonic() < grace_ends_s):
            received = self.receive()
            if received is None:
                continue
            envelope, request_id = received
            self.requests.append(request_id)
            if len(self.requests) > len(self.answers):
                break  # gone: this one is never answered
            answer = self.answers[len(self.requests) - 1]
            if answer is not None:
                code, text = answer
                self.send(envelope, messages.error(request_id, code, text))
            if len(self.requests) == len(self.answers):
                if not self.then_gone:
                    return  # the socket stays open, unread, until close()
                grace_ends_s = time.monotonic() + self.STOP_GRACE_S
        self.socket.close(0)


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An endpoint that accepts connections and takes requests but never answers (a hung node)."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        socket.close(0)


@contextlib.contextmanager
def _killed_at_exit() -> Iterator[list[NodeProcess]]:
    """A list to collect NodeProcess objects in; every one is killed at exit, also on an exception."""
    processes: list[NodeProcess] = []
    try:
        yield processes
    finally:
        for process in processes:
            try:
                process.signal(signal.SIGCONT)
                process.kill()
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


@pytest.fixture
def node_processes() -> Iterator[list[NodeProcess]]:
    """Collects NodeProcess objects; every one is killed at teardown, also when the test fails."""
    with _killed_at_exit() as processes:
        yield processes


# Tests run the real-process cluster with [security] unless this is set (to run them insecure).
INSECURE_ENV = "MNESITE_TEST_INSECURE"
REPLICANT_NAMES = ("replicant1", "replicant2", "replicant3")
CLIENT_PRINCIPALS = {"admin": "ops", "writer": "app", "reader": "dashboard"}


class Loopback:
    """Where the nodes of a ``Cluster`` run: all on 127.0.0.1, in the test's own network namespace."""

    def host(self, name: str) -> str:
        return "127.0.0.1"

    def command_prefix(self, name: str) -> list[str]:
        return []


class Cluster:
    """``size`` real core processes sharing one ``core_nodes`` table, on 127.0.0.1 unless ``placement``
    (``host(name)``, ``command_prefix(name)``: ``tests.fault.netns.Network``) puts each node elsewhere.

    Secure by default (``secure=None`` follows ``$MNESITE_TEST_INSECURE``): the fixture generates a
    cluster key, one key per core, per replicant and per client principal (``ops`` admin, ``app``
    writer, ``dashboard`` reader) and configures ``[security]``; clients made here speak as ``ops``.
    """

    def __init__(
        self,
        root: Path,
        processes: list[NodeProcess],
        size: int = 3,
        secure: bool | None = None,
        placement: Loopback | None = None,
    ) -> None:
        self.root = root
        self.placement = placement or Loopback()
        self.names = [f"core{i}" for i in range(1, size + 1)]
        self.endpoints = {name: self._endpoint(name) for name in self.names}
        self.nodes: dict[str, NodeProcess] = {}
        self._processes = processes
        self.secure = not os.environ.get(INSECURE_ENV) if secure is None else secure
        self.keys_dir = root / "keys"
        self.authorized_dir = root / "authorized_keys"
        if self.secure:
            self._generate_keys([*self.names, *REPLICANT_NAMES, *CLIENT_PRINCIPALS.values()])
        for name in self.names:
            self._write_config(name, "core")

    def _endpoint(self, name: str) -> str:
        # A port free on 127.0.0.1 here; in a namespace of its own every port is free anyway.
        return f"tcp://{self.placement.host(name)}:{free_port()}"

    def _generate_keys(self, principals: list[str]) -> None:
        from mnesite.rlog.security import generate_keys

        self.authorized_dir.mkdir()
        generate_keys("cluster", str(self.keys_dir))
        for principal in principals:
            generate_keys(principal, str(self.keys_dir))
            shutil.copy(self.keys_dir / f"{principal}.key", self.authorized_dir)

    def keys(self, principal: str = "ops") -> dict:
        """``key=`` and ``server_key=`` for a ``Client`` speaking as ``principal`` ({} when insecure)."""
        if not self.secure:
            return {}
        return {"key": str(self.keys_dir / f"{principal}.key_secret"), "server_key": str(self.keys_dir / "cluster.key")}

    def cli_keys(self, principal: str = "ops") -> list[str]:
        """``--key FILE --server-key FILE`` for CLI commands speaking as ``principal``."""
        keys = self.keys(principal)
        return ["--key", keys["key"], "--server-key", keys["server_key"]] if keys else []

    def security_toml(self, name: str) -> str:
        if not self.secure:
            return ""
        roles = {"core": self.names, "replicant": list(REPLICANT_NAMES)}
        roles.update({role: [principal] for role, principal in CLIENT_PRINCIPALS.items()})
        return (
            f'[security]\nserver_key = "{self.keys_dir / "cluster.key_secret"}"\n'
            f'client_key = "{self.keys_dir / f"{name}.key_secret"}"\n'
            f'authorized_keys = "{self.authorized_dir}"\n'
            "[security.roles]\n"
            + "".join(f"{role} = {principals!r}\n".replace("'", '"') for role, principals in roles.items())
        )

    def _write_config(self, name: str, role: str) -> None:
        core_nodes = ", ".join(f'{core} = "{self.endpoints[core]}"' for core in self.names)
        config = self.root / f"{name}.toml"
        config.write_text(
            f'[node]\nname = "{name}"\nrole = "{role}"\ndata_dir = "{self.data_dir(name)}"\n'
            f'listen = "{self.endpoints[name]}"\n'
            f"[cluster]\ncore_nodes = {{ {core_nodes} }}\n"
            '[storage]\nsynchronous = "NORMAL"\n' + self.security_toml(name)
        )
        self.nodes[name] = NodeProcess(
            config, self.root / f"{name}.log", self.keys(), self.placement.command_prefix(name)
        )
        self._processes.append(self.nodes[name])

    def extend_core_configs(self, toml: str) -> None:
        """Append TOML sections (for example ``[rlog]`` limits) to every core's config before it starts."""
        for name in self.names:
            config = self.root / f"{name}.toml"
            config.write_text(config.read_text() + toml)

    def add_replicant(self, name: str) -> None:
        """Configure (not start) a replicant that watches this cluster's cores."""
        if self.secure and name not in REPLICANT_NAMES:
            raise ValueError(f"secure clusters have keys for {REPLICANT_NAMES} only")
        self.endpoints[name] = self._endpoint(name)
        self._write_config(name, "replicant")

    def data_dir(self, name: str) -> Path:
        return self.root / name

    def start(self, name: str) -> None:
        self.nodes[name].start(self.endpoints[name])

    def start_all(self) -> None:
        """Launch every core at once (as an operator boots a cluster), then wait until each answers."""
        for name in self.names:
            self.nodes[name].launch()
        for name in self.names:
            self.nodes[name].wait_ready(self.endpoints[name])

    def client(self, name: str, principal: str = "ops", **kwargs) -> Client:
        kwargs.setdefault("timeout_ms", 3000)
        return Client(self.endpoints[name], **self.keys(principal), **kwargs)

    def status(self, name: str, timeout_ms: int = 1000) -> dict | None:
        try:
            with Client(self.endpoints[name], timeout_ms=timeout_ms, retries=0, **self.keys()) as client:
                return client.status()
        except MnesiteError:
            return None

    def sequencer(self, shard: str = "default", among: list[str] | None = None) -> tuple[str, int] | None:
        """(name, generation) of a core that reports itself sequencer of ``shard``, if any."""
        for name in among or self.names:
            status = self.status(name)
            info = status["shards"].get(shard) if status else None
            if info and info["role"] == "sequencer":
                return name, info["generation"]
        return None

    def wait_converged(self, names: list[str], shard: str = "default", timeout_s: float = 30) -> dict:
        """Wait until ``names`` have applied the same tx key with the same digest; return that position."""
        result: dict = {}

        def converged() -> bool:
            positions = []
            for name in names:
                status = self.status(name)
                if status is None or shard not in status["shards"]:
                    return False
                info = status["shards"][shard]
                positions.append((tuple(info["applied"]), info["digest"], tuple(info["last"])))
            if len(set(positions)) == 1 and positions[0][0] == positions[0][2]:
                result["applied"], result["digest"] = positions[0][0], positions[0][1]
                return True
            return False

        wait_until(converged, timeout_s, f"{names} to converge on shard {shard}", interval_s=0.1)
        return result

    def wait_replicants_converged(
        self, cores: list[str], replicants: list[str], shard: str = "default", timeout_s: float = 60
    ) -> dict:
        """Wait until ``replicants`` have applied the position ``cores`` converged on, with its digest;
        return that position. The cores' position is read again at every poll: the cores may append
        entries of their own after the clients stop (a cluster version entry proposed once every
        member's announcement is heard, seconds after a start or a membership change), so a position
        read once may be passed over by a replicant that receives the next entries in the same push."""
        result: dict = {}

        def caught_up() -> bool:
            try:
                position = self.wait_converged(cores, shard, timeout_s=1)
            except AssertionError:
                return False
            for name in replicants:
                status = self.status(name)
                info = (status or {}).get("shards", {}).get(shard) or {}
                if (tuple(info.get("applied", ())), info.get("digest")) != (position["applied"], position["digest"]):
                    return False
            result.update(position)
            return True

        wait_until(caught_up, timeout_s, f"{replicants} to apply what {cores} converged on", interval_s=0.1)
        return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    """Keep each phase's report on the test item, so that a fixture's teardown knows the test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


NODE_LOG_TAIL_BYTES = 4000


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path, node_processes: list[NodeProcess]) -> Iterator[Cluster]:
    """A ``Cluster``; when the test fails, the end of each node's log is printed (a CI failure of a
    real-process test said only what the test waited for, and CI keeps no temporary directory)."""
    cluster = Cluster(tmp_path, node_processes)
    yield cluster
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for name, node in sorted(cluster.nodes.items()):
            if node.log_path.exists():
                with open(node.log_path, "rb") as log:
                    log.seek(max(0, node.log_path.stat().st_size - NODE_LOG_TAIL_BYTES))
                    tail = log.read().decode(errors="replace")
                print(f"--- the end of {name}'s log ({node.log_path}) ---\n{tail}")


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A ``Cluster`` shared by the tests of one module (its processes are killed after the module's
    last test): for tests that only read what a costly setup loaded, or write rows of their own that
    no other test of the module counts."""
    with _killed_at_exit() as processes:
        yield Cluster(tmp_path_factory.mktemp("cluster"), processes)


def ctrl_c_at_the_final_progress_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C as a command writes its last progress line (a stderr that blocks: a paused terminal,
    a full pipe), its work all done."""
    from mnesite.cli import progress

    def show(self: progress.ProgressLines, describe: Callable[[], str], final: bool = False) -> None:
        if final:
            raise KeyboardInterrupt

    monkeypatch.setattr(progress.ProgressLines, "show", show)
