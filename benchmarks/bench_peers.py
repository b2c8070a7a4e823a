"""mnesite beside peer systems: one Python load generator, the same writes, ratios from the same round.

    .venv/bin/python benchmarks/bench_peers.py [--seconds 5] [--slices 5] [--warm-up 2] [--clients 1,16,64]
        [--rounds 3] [--systems mnesite-3,mnesite-1,etcd,redis,rqlite,dqlite,floor-3,floor-1,floor-3-log,floor-1-log]
        [--baseline TREE] [--json]
        [--output FILE.json]   (the report as JSON, and its chart beside it as FILE.png)

Every system gets the same load: N concurrent clients (threads spread over up to four client
processes, so that the client side's GIL is not the bottleneck), each writing one 100-byte value
under a fresh key per request and waiting for the acknowledgement, for ``--seconds`` per point. The
client processes start once per client count and keep a connection to every system (``ClientPool``);
each point is cut into ``--slices`` slices and the systems take turns slice by slice
(``measure_point``), so that systems compared are measured a second apart, on the same machine: this
machine's speed moves within seconds, and 5-s points taken one after the other gave per-round ratios
from 0.42x to 0.66x where slices give 0.52x to 0.57x (summed CPU a write against ``--baseline``,
2026-11-28). Before the first round each system gets ``--warm-up`` seconds of load at each client
count, not counted. Ratios are taken between systems *within a round* (the median of the per-round ratios is
reported). Issue 21's acceptance lines follow the table, each ratio per
round with how many rounds met its target (``acceptance_lines``; ``lines`` in the JSON). Each system's
row also gives its load generator's CPU per write, the whole machine's and how many CPUs were busy, in the
same slices; from them ``single_core_line_needs`` models what 0.75x the single core asks of the three
cores' summed CPU per write (``single_core_line_needs`` in the JSON). All nodes run on 127.0.0.1 of this
one machine.

What an acknowledgement means (durability), per system:

* ``mnesite-3``: three core processes, ``synchronous=FULL``; the clients talk to the sequencer; an
  ack means the entry is fsynced on a majority (two of three) and applied at the sequencer.
* ``mnesite-1``: one core, ``synchronous=FULL``: fsynced on its one disk.
* ``mnesite-3-baseline`` (with ``--baseline TREE``): mnesite-3 run from another commit's source tree
  (``git archive main | tar -x -C TREE``), to measure before and after a change in the same run.
* ``etcd``: three members (Debian package ``etcd-server``); ``PUT`` through the v3 JSON gateway over
  HTTP keep-alive; an ack means the WAL entry is fdatasynced on a majority.
* ``redis``: a primary with ``appendonly yes`` + ``appendfsync always`` and one replica (Debian
  ``redis-server``); each request is ``SET`` then ``WAIT 1 1000`` in one round trip; an ack means the
  primary fsynced its AOF and the replica *received* the write (not fsynced on the replica).
* ``floor-1``, ``floor-3``: ``floor_node.py``'s bare processes,
  the least a durable (floor-1) or majority-replicated (floor-3) write costs with mnesite's own stack
  (CPython, pyzmq, apsw, one process per node): no checks, no log, no apply; floor-3's leader feeds
  its second follower lazily, as mnesite's sequencer does (since 2026-12-03; both eagerly before).
  mnesite's figures over the floor's are what its cores add; the floor's 3-over-1 ratios say what
  the stack allows, and ``single_core_line_needs`` / ``one_client_line_needs`` set them beside each line.
* ``floor-1-log``, ``floor-3-log``: the same processes with ``--log``: each node also keeps a log row
  per write (under a request-id index) and a digest chain, as a replica of mnesite's design must.
* ``rqlite``, ``dqlite``: not packaged in Debian 12 and not servers on PyPI (the PyPI packages are
  clients); skipped with a message when no ``rqlited`` / dqlite server binary is found.

Missing servers are installed with ``apt-get install`` when the script runs as root; a peer that
cannot be installed is skipped with a clear message. Python clients for peers come from the
``bench`` extra (``pip install -e '.[bench]'``). Not a test: it asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import CLIENT_PROCESSES_MAX, REPO, Writer, cpu_seconds, machine, percentile, start_nodes  # noqa: E402

VALUE = "x" * 100
STARTUP_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 30
SLICES = 5  # turns per point and system (--slices)
WARM_UP_S = 2.0  # per system and client count, before the first round (--warm-up)

DURABILITY = {
    "mnesite-3": "majority fsync (2 of 3), applied at the sequencer",
    "mnesite-3-baseline": "the same, measured with the --baseline tree's code",
    "mnesite-1-baseline": "the same as mnesite-1, with the --baseline tree's code",
    "mnesite-1": "fsync on its one disk",
    "etcd": "WAL fdatasync on a majority (2 of 3)",
    "redis": "primary AOF fsync (appendfsync always) + WAIT 1 (one replica received it, no fsync there)",
    "rqlite": "raft log on a majority",
    "dqlite": "raft log on a majority",
    "floor-1": "fsync on its one disk (benchmarks/floor_node.py: no checks, no log, no apply)",
    "floor-3": "fsync on a majority (2 of 3), the second follower fed lazily (benchmarks/floor_node.py: no "
    "checks, no log, no apply)",
    "floor-1-log": "as floor-1, with a log row (request-id index) and a digest chain per write (--log)",
    "floor-3-log": "as floor-3, with a log row (request-id index) and a digest chain per write on each node (--log)",
}
SYSTEMS = (
    "mnesite-3",
    "mnesite-1",
    "etcd",
    "redis",
    "rqlite",
    "dqlite",
    "floor-3",
    "floor-1",
    "floor-3-log",
    "floor-1-log",
)


class Skipped(Exception):
    """A peer that cannot run here; the message says why."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ensure_binary(binary: str, package: str) -> str:
    """The path of ``binary``, installing Debian ``package`` if it is missing (as root only)."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Skipped(f"{binary} not found and apt-get cannot install {package} here (not root or not Debian)")
    print(f"installing {package} with apt-get ...", file=sys.stderr)
    environment = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    result = subprocess.run(install, env=environment, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update"], env=environment, capture_output=True, timeout=600)
        result = subprocess.run(install, env=environment, capture_output=True, text=True, timeout=600)
    found = shutil.which(binary)
    if not found:
        raise Skipped(f"apt-get could not install {package}: {result.stderr.strip().splitlines()[-1:]}")
    return found


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise Skipped(f"{what} did not come up within {timeout_s:g} s")


# ---------------------------------------------------------------- the clients (in client processes)


def _mnesite_writer(spec: dict) -> tuple[Callable[[str], None], Callable[[], None]]:
    from mnesite.rlog.client import Client

    client = Client(spec["endpoint"], timeout_ms=REQUEST_TIMEOUT_S * 1000)
    counter = iter(range(10**12))

    def write(key: str) -> None:
        client.put("bench", {"id": spec["key_base"] + next(counter), "payload": VALUE})

    return write, client.close


def _etcd_writer(spec: dict) -> tuple[Callable[[str], None], Callable[[], None]]:
    connection = http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=REQUEST_TIMEOUT_S)
    value = base64.b64encode(VALUE.encode()).decode()

    def put(body: str) -> http.client.HTTPResponse:
        connection.request("POST", "/v3/kv/put", body, {"Content-Type": "application/json"})
        return connection.getresponse()

    def write(key: str) -> None:
        body = json.dumps({"key": base64.b64encode(key.encode()).decode(), "value": value})
        try:
            response = put(body)
        except ConnectionError:  # http.client.RemoteDisconnected is one
            # A keep-alive connection idle while other systems had their slices, closed by the
            # server: open it again once (a PUT of the same key and value is idempotent).
            connection.close()
            response = put(body)
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"etcd answered {response.status}: {payload[:200]!r}")

    return write, connection.close


def _redis_writer(spec: dict) -> tuple[Callable[[str], None], Callable[[], None]]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=spec["port"], socket_timeout=REQUEST_TIMEOUT_S)

    def write(key: str) -> None:
        pipeline = client.pipeline(transaction=False)
        pipeline.set(key, VALUE)
        pipeline.execute_command("WAIT", 1, 1000)
        _, replicas = pipeline.execute()
        if replicas < 1:
            raise RuntimeError("WAIT 1 timed out: the replica did not acknowledge")

    return write, client.close


def _floor_writer(spec: dict) -> tuple[Callable[[str], None], Callable[[], None]]:
    import zmq

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, REQUEST_TIMEOUT_S * 1000)
    dealer.connect(spec["endpoint"])
    value = VALUE.encode()

    def write(key: str) -> None:
        dealer.send_multipart([key.encode(), value])
        if dealer.recv_multipart() != [b"ok"]:
            raise RuntimeError("the floor node answered something other than ok")

    def close() -> None:
        context.destroy(linger=0)

    return write, close


WRITERS = {"mnesite": _mnesite_writer, "etcd": _etcd_writer, "redis": _redis_writer, "floor": _floor_writer}


def run_slice(writers: list[Writer], counters: list[int], worker: int, seconds: float) -> tuple:
    """One slice: each thread writes with its writer for ``seconds``; ``counters`` (a thread's requests so
    far, for this system) keep every key fresh across slices. Returns the writes acknowledged, their
    latencies in ms and the errors that ended a thread's slice (one per such thread)."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds
    begun = counters[:]

    def run(thread: int) -> None:
        write, own = writers[thread][0], []
        try:
            while time.perf_counter() < deadline:
                began = time.perf_counter()
                write(f"bench/{worker}/{thread}/{counters[thread]}")
                own.append((time.perf_counter() - began) * 1000)
                counters[thread] += 1
        except Exception as error:  # a failing system ends this thread's slice; the report says so
            with lock:
                errors.append(f"{type(error).__name__}: {error}")
        with lock:
            latencies.extend(own)

    pool = [threading.Thread(target=run, args=(thread,)) for thread in range(len(writers))]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return sum(now - then for now, then in zip(counters, begun, strict=True)), latencies, errors


def _pool_worker(specs: dict[str, dict], threads: int, worker: int, commands: Any, results: Any) -> None:
    """A client process of a ``ClientPool``: its threads' writers for every system, made once; then one
    slice per command ``(system, seconds)`` until ``None``."""
    writers: dict[str, list[Writer]] = {}
    try:
        try:
            for name, spec in specs.items():
                make = WRITERS[spec["kind"]]
                writers[name] = [make({**spec, "key_base": (worker * 1000 + t) * 10_000_000}) for t in range(threads)]
        except Exception as error:  # said by the parent (ClientPool), not lost with this process
            results.put(("failed", f"client process {worker} could not connect: {type(error).__name__}: {error}"))
            return
        counters = {name: [0] * threads for name in specs}
        results.put(("ready", worker))
        while (command := commands.get()) is not None:
            name, seconds = command
            results.put(run_slice(writers[name], counters[name], worker, seconds))
    finally:
        for made in writers.values():
            for _, close in made:
                close()


class ClientPool:
    """The load generator for one client count, kept alive for the whole run: ``clients`` threads spread
    over up to ``CLIENT_PROCESSES_MAX`` processes, each thread with a writer (its own connection) to
    every system. A slice (``run``) moves the load to one system without starting a process or a
    connection, so that the systems can take turns every fraction of a second (see ``main``)."""

    def __init__(self, specs: dict[str, dict], clients: int, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        processes = min(clients, CLIENT_PROCESSES_MAX)
        per_process = [clients // processes + (1 if p < clients % processes else 0) for p in range(processes)]
        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in per_process]
        self.workers = [
            context.Process(target=_pool_worker, args=(specs, threads, p, self.commands[p], self.results), daemon=True)
            for p, threads in enumerate(per_process)
        ]
        for worker in self.workers:
            worker.start()
        try:
            for _ in self.workers:
                state, detail = self.results.get(timeout=timeout_s)  # each worker has made its writers
                if state != "ready":
                    raise RuntimeError(detail)
        except BaseException:
            self.close()
            raise

    def run(self, system: str, seconds: float) -> dict:
        """Load ``system`` for ``seconds``: the writes acknowledged, their latencies (ms), the errors."""
        for commands in self.commands:
            commands.put((system, seconds))
        parts = [self.results.get(timeout=seconds + 2 * REQUEST_TIMEOUT_S) for _ in self.workers]
        return {
            "writes": sum(part[0] for part in parts),
            "latencies_ms": [x for part in parts for x in part[1]],
            "errors": [e for part in parts for e in part[2]],
        }

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        for worker in self.workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
                worker.join(10)


def machine_busy_seconds() -> float:
    """CPU time the whole machine has spent busy so far (every CPU, not idle nor waiting on I/O), from
    ``/proc/stat``."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait.
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- the systems (servers)


class System:
    name = ""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.processes: list[subprocess.Popen] = []
        self.spec: dict = {}

    def start(self) -> None:
        raise NotImplementedError

    def spawn(self, command: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.directory / log_name, "wb")  # noqa: SIM115 (closed with the process's files)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)


class Mnesite(System):
    def __init__(self, directory: Path, cores: int, baseline: Path | None = None) -> None:
        super().__init__(directory)
        self.cores = cores
        self.name = f"mnesite-{cores}" + ("-baseline" if baseline else "")
        self.baseline = baseline

    def start(self) -> None:
        pythonpath = str(REPO) if self.baseline is None else package_layout(self.baseline, self.directory)
        processes, endpoint, _ = start_nodes(self.directory, "FULL", self.cores, False, pythonpath)
        self.processes.extend(processes)
        self.spec = {"kind": "mnesite", "endpoint": endpoint}


def package_layout(tree: Path, directory: Path) -> str:
    """A directory from which ``import mnesite`` loads the source tree ``tree`` (another commit of this
    repository, e.g. ``git archive main | tar -x -C tree``): the import package ``mnesite`` with the
    top-level folders linked in as its subpackages, as the installed package maps them."""
    package = directory / "baseline-package" / "mnesite"
    package.mkdir(parents=True)
    (package / "__init__.py").symlink_to(tree / "mnesite" / "__init__.py")
    for folder in ("core", "rlog", "replicant", "bootstrap", "cli", "spark"):
        if (tree / folder).is_dir():
            (package / folder).symlink_to(tree / folder)
    return str(package.parent)


class Etcd(System):
    name = "etcd"

    def start(self) -> None:
        binary = ensure_binary("etcd", "etcd-server")
        ports = {f"etcd{i}": (free_port(), free_port()) for i in range(1, 4)}
        cluster = ",".join(f"{name}=http://127.0.0.1:{peer}" for name, (_, peer) in ports.items())
        for name, (client_port, peer_port) in ports.items():
            self.spawn(
                [
                    binary,
                    "--name",
                    name,
                    "--data-dir",
                    str(self.directory / name),
                    "--listen-client-urls",
                    f"http://127.0.0.1:{client_port}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{client_port}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{peer_port}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{peer_port}",
                    "--initial-cluster",
                    cluster,
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    f"bench-{os.getpid()}",
                ],
                f"{name}.log",
            )
        leader_port = None

        def leader_known() -> bool:
            nonlocal leader_port
            for client_port, _ in ports.values():
                connection = http.client.HTTPConnection("127.0.0.1", client_port, timeout=2)
                connection.request("POST", "/v3/maintenance/status", "{}", {"Content-Type": "application/json"})
                status = json.loads(connection.getresponse().read())
                connection.close()
                if status.get("leader") and status.get("leader") == status.get("header", {}).get("member_id"):
                    leader_port = client_port
            return leader_port is not None

        wait_until(leader_known, "etcd's leader")
        # Like mnesite's clients, which talk to the sequencer: no forwarding hop.
        self.spec = {"kind": "etcd", "port": leader_port}


class Redis(System):
    name = "redis"

    def start(self) -> None:
        binary = ensure_binary("redis-server", "redis-server")
        try:
            import redis  # noqa: F401
        except ImportError:
            raise Skipped("the Python client is missing: .venv/bin/pip install -e '.[bench]'") from None
        primary, replica = free_port(), free_port()
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        for name, port, extra in (
            ("primary", primary, []),
            ("replica", replica, ["--replicaof", "127.0.0.1", str(primary)]),
        ):
            data = self.directory / f"redis-{name}"
            data.mkdir()
            self.spawn([binary, "--port", str(port), "--dir", str(data), *common, *extra], f"redis-{name}.log")
        import redis

        def replica_linked() -> bool:
            try:
                info = redis.Redis(host="127.0.0.1", port=primary, socket_timeout=2).info("replication")
            except redis.RedisError:
                return False
            return info.get("connected_slaves", 0) >= 1 and info.get("slave0", {}).get("state") == "online"

        wait_until(replica_linked, "redis's replica link")
        self.spec = {"kind": "redis", "port": primary}


class Floor(System):
    """``floor_node.py``'s processes: the least a write costs with mnesite's stack (its docstring); with
    ``logged``, also a log row and a digest chain per write on every node (``--log``)."""

    def __init__(self, directory: Path, nodes: int, logged: bool = False) -> None:
        super().__init__(directory)
        self.nodes = nodes
        self.logged = logged
        self.name = f"floor-{nodes}" + ("-log" if logged else "")

    def start(self) -> None:
        script = [sys.executable, str(Path(__file__).resolve().parent / "floor_node.py")]
        if self.logged:
            script.append("--log")
        ports = [free_port() for _ in range(self.nodes)]
        if self.nodes == 1:
            roles = [["--role", "single"]]
        else:
            followers = ",".join(str(port) for port in ports[1:])
            roles = [["--role", "leader", "--peers", followers]]
            roles += [["--role", "follower", "--leader", str(ports[0])] for _ in ports[1:]]
        for number, (port, role) in enumerate(zip(ports, roles, strict=True)):
            database = self.directory / f"floor{number}" / "kv.db"
            self.spawn([*script, *role, "--port", str(port), "--db", str(database)], f"floor{number}.log")
        self.spec = {"kind": "floor", "endpoint": f"tcp://127.0.0.1:{ports[0]}"}
        # Ready once a write is answered (every node has bound and connected): the same path as the load's.
        write, close = _floor_writer(self.spec)
        try:
            write("floor/ready")
        except Exception as error:  # main stops a skipped system's processes
            logs = " | ".join(path.read_text()[-300:] for path in sorted(self.directory.glob("floor*.log")))
            raise Skipped(f"its first write failed ({type(error).__name__}: {error}); its logs: {logs}") from None
        finally:
            close()


class NotPackaged(System):
    def __init__(self, directory: Path, name: str, binary: str) -> None:
        super().__init__(directory)
        self.name = name
        self.binary = binary

    def start(self) -> None:
        if shutil.which(self.binary) is None:
            raise Skipped(
                f"no {self.binary} server: {self.name} is not packaged in Debian 12 and PyPI has only its clients"
            )
        raise Skipped(f"{self.binary} found, but this script does not drive {self.name} yet")


def make_system(name: str, directory: Path, baseline: Path | None) -> System:
    if name in ("mnesite-3-baseline", "mnesite-1-baseline"):
        if baseline is None:
            raise SystemExit(f"{name} needs --baseline TREE")
        return Mnesite(directory, int(name.split("-")[1]), baseline)
    if name.startswith("mnesite-"):
        return Mnesite(directory, int(name.split("-")[1]))
    if name in ("floor-1", "floor-3", "floor-1-log", "floor-3-log"):
        return Floor(directory, int(name.split("-")[1]), name.endswith("-log"))
    if name == "etcd":
        return Etcd(directory)
    if name == "redis":
        return Redis(directory)
    if name == "rqlite":
        return NotPackaged(directory, "rqlite", "rqlited")
    if name == "dqlite":
        return NotPackaged(directory, "dqlite", "dqlite-demo")
    known = (*SYSTEMS, "mnesite-3-baseline", "mnesite-1-baseline")
    raise SystemExit(f"unknown system {name!r}; known: {', '.join(known)}")


# ---------------------------------------------------------------- the run


def measure_point(systems: list[System], pool: ClientPool, seconds: float, slices: int) -> dict[str, dict]:
    """One point of a round: every system loaded for ``seconds`` by ``pool``'s clients, in ``slices``
    turns of ``seconds / slices`` each, the systems taking turns (in reverse order every other slice).
    The machine's speed moves within seconds: systems measured a fraction of a second apart see
    the same machine, so the ratios between them hold still. Per system: writes/s, p50/p99 over all
    its slices, and its server processes' CPU per write (``cpu_seconds`` around each of its slices)."""
    totals = {
        system.name: {
            "writes": 0,
            "latencies": [],
            "errors": [],
            "cpu": [0.0] * len(system.processes),
            "load_cpu": 0.0,
            "busy": 0.0,
            "wall": 0.0,
        }
        for system in systems
    }
    for number in range(slices):
        for system in systems if number % 2 == 0 else systems[::-1]:
            total = totals[system.name]
            before = cpu_seconds(system.processes)
            # The wall time spans the two reads of the machine's busy time (taken first, read last): a
            # preemption between a read of one and of the other (likely on a loaded machine) then adds
            # to both, never to the busy time alone, which would read more CPUs busy than there are.
            load_before, began = sum(cpu_seconds(pool.workers)), time.monotonic()
            busy_before = machine_busy_seconds()
            out = pool.run(system.name, seconds / slices)
            total["busy"] += machine_busy_seconds() - busy_before
            total["wall"] += time.monotonic() - began
            total["load_cpu"] += sum(cpu_seconds(pool.workers)) - load_before
            after = cpu_seconds(system.processes)
            total["cpu"] = [used + now - then for used, then, now in zip(total["cpu"], before, after, strict=True)]
            total["writes"] += out["writes"]
            total["latencies"] += out["latencies_ms"]
            total["errors"] += out["errors"]
    results = {}
    for name, total in totals.items():
        writes, latencies = total["writes"], sorted(total["latencies"])
        results[name] = {
            "writes": writes,
            "writes_per_s": round(writes / seconds, 1),
            "p50_ms": round(percentile(latencies, 0.50), 3),
            "p99_ms": round(percentile(latencies, 0.99), 3),
            "errors": total["errors"][:3],
            # Server CPU per write: each process (for mnesite the first is the sequencer) and the sum.
            "cpu_us_per_write": [round(used / writes * 1e6, 1) if writes else None for used in total["cpu"]],
            "cpu_us_per_write_sum": round(sum(total["cpu"]) / writes * 1e6, 1) if writes else None,
            # The rest of the machine's CPU in the same slices: the load generator's processes, and
            # everything busy (servers, load generator, kernel threads) per write and in CPUs.
            "load_cpu_us_per_write": round(total["load_cpu"] / writes * 1e6, 1) if writes else None,
            "machine_cpu_us_per_write": round(total["busy"] / writes * 1e6, 1) if writes else None,
            "cpus_busy": round(total["busy"] / total["wall"], 2) if total["wall"] else None,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--slices",
        type=int,
        default=SLICES,
        help="each point's seconds cut into this many slices, the systems taking turns slice by slice",
    )
    parser.add_argument(
        "--warm-up",
        type=float,
        default=WARM_UP_S,
        help="seconds of load for each system at each client count before the first round, not counted",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--baseline",
        type=lambda text: Path(text).resolve(),
        help="another commit's source tree: adds mnesite-3-baseline (run from that tree) to compare in the same run",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--output",
        type=Path,
        help="write the report as JSON to this file and its chart (charts.draw_peers_report) beside it, as .png",
    )
    args = parser.parse_args()
    if args.slices < 1 or args.rounds < 1 or args.seconds <= 0 or args.warm_up < 0:
        parser.error("--slices and --rounds must be at least 1, --seconds above 0, --warm-up at least 0")
    if args.baseline is not None and "mnesite-3-baseline" not in args.systems:
        args.systems = "mnesite-3-baseline," + args.systems
    client_counts = [int(c) for c in args.clients.split(",")]
    directory = Path(tempfile.mkdtemp(prefix="mnesite-peers-"))
    systems: list[System] = []
    skipped: dict[str, str] = {}
    # runs[(system, clients)] = one result per round
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        for name in args.systems.split(","):
            system_directory = directory / name
            system_directory.mkdir()
            system = make_system(name, system_directory, args.baseline)
            try:
                system.start()
                systems.append(system)
            except Skipped as why:
                system.stop()
                skipped[name] = str(why)
                print(f"skipping {name}: {why}", file=sys.stderr)
        specs = {system.name: system.spec for system in systems}
        pools: dict[int, ClientPool] = {}
        try:
            for clients in client_counts:
                pools[clients] = ClientPool(specs, clients)
            # A system's first seconds are not what it does in service (a WAL that grows until its first
            # checkpoint, cold caches): the first round measured them (mnesite-3 at 0.70x its later rounds).
            if args.warm_up > 0:
                for clients in client_counts:
                    for system in systems:
                        pools[clients].run(system.name, args.warm_up)
            for round_number in range(args.rounds):
                for clients in client_counts:
                    for system, result in measure_point(systems, pools[clients], args.seconds, args.slices).items():
                        result["round"] = round_number
                        runs.setdefault((system, clients), []).append(result)
                        print(f"round {round_number + 1} {system} {clients} clients: {result}", file=sys.stderr)
        finally:
            for pool in pools.values():
                pool.close()
    finally:
        for system in systems:
            system.stop()
        shutil.rmtree(directory, ignore_errors=True)
    report = summarise(runs, [s.name for s in systems], client_counts, args.rounds, skipped)
    report.update(
        {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine(),
            "seconds": args.seconds,
            "slices": args.slices,
            "warm_up_s": args.warm_up,
        }
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    if args.output is not None:
        write_report(report, args.output)


def write_report(report: dict, output: Path) -> None:
    """The report as JSON in ``output`` and its chart beside it (same name, ``.png``)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    chart = output.with_suffix(".png")
    try:
        from charts import draw_peers_report
    except ImportError as error:  # pragma: no cover - charts.py sits beside this script
        print(f"no chart: {error}", file=sys.stderr)
        return
    try:
        draw_peers_report(report, chart)
    except ImportError as error:
        print(f"no chart ({error}): install the docs extra (make docs-deps) for matplotlib", file=sys.stderr)
        return
    print(f"wrote {output} and {chart}", file=sys.stderr)


def summarise(
    runs: dict[tuple[str, int], list[dict]], names: list[str], client_counts: list[int], rounds: int, skipped: dict
) -> dict:
    rows = []
    for name in names:
        for clients in client_counts:
            samples = runs.get((name, clients), [])
            if not samples:
                continue
            row: dict[str, Any] = {
                "system": name,
                "clients": clients,
                "durability": DURABILITY[name],
                "writes_per_s": statistics.median(s["writes_per_s"] for s in samples),
                "writes_per_s_rounds": [s["writes_per_s"] for s in samples],
                "p50_ms": statistics.median(s["p50_ms"] for s in samples),
                "p99_ms": statistics.median(s["p99_ms"] for s in samples),
                "cpu_us_per_write_sum": _median_of(s["cpu_us_per_write_sum"] for s in samples),
                "cpu_us_per_write": [
                    _median_of(s["cpu_us_per_write"][i] for s in samples)
                    for i in range(len(samples[0]["cpu_us_per_write"]))
                ],
                # Per round, to take same-round ratios of CPU per write (e.g. against --baseline).
                "cpu_us_per_write_rounds": [s["cpu_us_per_write"] for s in samples],
                "load_cpu_us_per_write": _median_of(s.get("load_cpu_us_per_write") for s in samples),
                "machine_cpu_us_per_write": _median_of(s.get("machine_cpu_us_per_write") for s in samples),
                "cpus_busy": _median_of(s.get("cpus_busy") for s in samples),
                "errors": [e for s in samples for e in s["errors"]][:3],
            }
            # mnesite-3 against every other system, per round, then the median of those ratios.
            reference = runs.get(("mnesite-3", clients), [])
            if name != "mnesite-3" and len(reference) == len(samples):
                pairs = zip(reference, samples, strict=True)
                ratios = [r["writes_per_s"] / s["writes_per_s"] for r, s in pairs if s["writes_per_s"]]
                if ratios:
                    row["mnesite_3_over_this"] = round(statistics.median(ratios), 2)
            rows.append(row)
    return {
        "rounds": rounds,
        "results": rows,
        "skipped": skipped,
        "lines": acceptance_lines(runs),
        "single_core_line_needs": single_core_line_needs(runs),
        "one_client_line_needs": one_client_line_needs(runs),
    }


# The line single_core_line_needs models (one of LINES below).
SINGLE_CORE_RATE_LINE = ("3 cores / single core, writes/s", 64, "mnesite-3", "mnesite-1", "writes_per_s", "min", 0.75)
# Issue 21's acceptance lines, each a same-round ratio: (name, clients, numerator, denominator, measure, kind,
# target: the ratio's bound, "min" (at least) or "max" (at most), None for a line that is only a reading).
LINES = (
    ("3 cores / Redis, writes/s", 64, "mnesite-3", "redis", "writes_per_s", "min", 0.6),
    SINGLE_CORE_RATE_LINE,
    ("3 cores / single core, p50", 1, "mnesite-3", "mnesite-1", "p50_ms", "max", 2.0),
    ("3 cores / etcd, p50", 1, "mnesite-3", "etcd", "p50_ms", "max", 1.0),
    (
        "3 cores / the tree before, summed CPU a write",
        64,
        "mnesite-3",
        "mnesite-3-baseline",
        "cpu_us_per_write_sum",
        "max",
        0.5,
    ),
    ("floor-3 / single core, writes/s", 64, "floor-3", "mnesite-1", "writes_per_s", None, None),
    ("floor-3 / single core, p50", 1, "floor-3", "mnesite-1", "p50_ms", None, None),
)


def acceptance_lines(runs: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """Each of ``LINES`` whose two systems ran at its client count in the same rounds: its ratio per
    round and, for a line with a target, how many rounds met it (the issue asks for every round)."""
    lines = []
    for name, clients, over, under, measure, kind, target in LINES:
        tops, bottoms = runs.get((over, clients), []), runs.get((under, clients), [])
        if not tops or len(tops) != len(bottoms):
            continue
        ratios = [
            round(top[measure] / bottom[measure], 3) if top[measure] is not None and bottom[measure] else None
            for top, bottom in zip(tops, bottoms, strict=True)
        ]
        line: dict[str, Any] = {"line": name, "clients": clients, "per_round": ratios}
        if kind is not None:
            met = [r is not None and (r >= target if kind == "min" else r <= target) for r in ratios]
            line.update({"target": f"{'at least' if kind == 'min' else 'at most'} {target:g}x", "rounds_met": sum(met)})
        lines.append(line)
    return lines


def single_core_line_needs(
    runs: dict[tuple[str, int], list[dict]],
    clients: int = SINGLE_CORE_RATE_LINE[1],
    ratio: float = SINGLE_CORE_RATE_LINE[6],
) -> list[dict]:
    """Per round: the summed server CPU a write at which mnesite-3 would reach ``ratio`` times the single
    core's writes/s, beside what mnesite-3 (and floor-3, if it ran) spent.

    A model, not a measurement: the machine stays as busy as mnesite-3 kept it in that round (``cpus_busy``)
    and the rest of its CPU a write (load generator, kernel) stays what it was, so that writes/s is the busy
    CPUs over the machine's CPU a write. Where the CPUs are the bound, this is what the line asks of the cores.

    With floor-3 and floor-1 in the same rounds, also ``floor_3_plus_single_work_us``: floor-3's summed CPU a
    write plus what the single core spends over floor-1 (its own checks, log and apply, which a sequencer
    does too). A sum of measured parts, not a bound: what three cores of this stack spend before a
    follower logs, checks or applies anything, and before the sequencer keeps any consensus state. With
    floor-3-log and floor-1-log, ``floor_3_log_plus_single_work_us``: the same with the floors that keep a
    log row and a digest chain per write on every node, so that only checks, decoding, applying and
    consensus state are left out.
    """
    tops, singles = runs.get(("mnesite-3", clients), []), runs.get(("mnesite-1", clients), [])
    floors = runs.get(("floor-3", clients), [])
    if not tops or len(tops) != len(singles):
        return []
    needs = []
    for number, (top, single) in enumerate(zip(tops, singles, strict=True)):
        known = (top.get("cpus_busy"), top.get("machine_cpu_us_per_write"), top["cpu_us_per_write_sum"])
        if None in known or not single["writes_per_s"]:
            continue
        busy, machine_us, cores_us = known
        rest_us = machine_us - cores_us
        row = {
            "round": number,
            "needed_cpu_us_per_write_sum": round(busy * 1e6 / (ratio * single["writes_per_s"]) - rest_us, 1),
            "mnesite_3_cpu_us_per_write_sum": cores_us,
            "rest_cpu_us_per_write": round(rest_us, 1),
            "cpus_busy": busy,
        }
        loads = (top.get("load_cpu_us_per_write"), single.get("load_cpu_us_per_write"))
        if None not in loads and loads[0] > loads[1]:
            # The generous case: the load generator as cheap a write beside the three cores as beside the
            # single core (it runs the same client code; beside the three cores it runs colder).
            row["needed_with_single_load_us"] = round(row["needed_cpu_us_per_write_sum"] + loads[0] - loads[1], 1)
        if len(floors) == len(tops):
            row["floor_3_cpu_us_per_write"] = floors[number]["cpu_us_per_write"]
        for suffix in ("", "-log"):  # the bare floor, and the floor that keeps a log (floor_node --log)
            three, one = runs.get((f"floor-3{suffix}", clients), []), runs.get((f"floor-1{suffix}", clients), [])
            if len(three) != len(tops) or len(one) != len(tops):
                continue
            three_us, one_us = three[number]["cpu_us_per_write_sum"], one[number]["cpu_us_per_write_sum"]
            if three_us is not None and one_us is not None:
                key = f"floor_3{suffix.replace('-', '_')}_plus_single_work_us"
                row[key] = round(three_us + single["cpu_us_per_write_sum"] - one_us, 1)
        needs.append(row)
    return needs


def one_client_line_needs(runs: dict[tuple[str, int], list[dict]], ratio: float = 2.0) -> list[dict]:
    """Per round at one client: the p50 the 2x line allows (``ratio`` times the single core's), mnesite-3's,
    and floor-3's plus what the single core's own work adds to floor-1's p50 (a sum of measured parts,
    not a bound: the least a write's path on this stack takes before a follower's or the sequencer's
    replication work)."""
    systems = ("mnesite-3", "mnesite-1", "floor-3", "floor-1")
    rounds = [runs.get((name, 1), []) for name in systems]
    if not rounds[0] or any(len(r) != len(rounds[0]) for r in rounds):
        return []
    return [
        {
            "round": number,
            "allowed_p50_ms": round(ratio * single["p50_ms"], 3),
            "mnesite_3_p50_ms": top["p50_ms"],
            "floor_3_plus_single_work_ms": round(floor["p50_ms"] + single["p50_ms"] - floor_one["p50_ms"], 3),
        }
        for number, (top, single, floor, floor_one) in enumerate(zip(*rounds, strict=True))
    ]


def _median_of(values: Any) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _us(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def print_table(report: dict) -> None:
    slices = f" in {report['slices']} slices" if report.get("slices") else ""
    point = f"{report['seconds']:g} s per point{slices}"
    print(f"{report['date']}, {report['machine']}, {point}, {report['rounds']} rounds")
    print(
        "| system | clients | writes/s (median) | rounds | p50 ms | p99 ms | mnesite-3 / this (same round) "
        "| server CPU us/write: sum (per process) | load generator, machine CPU us/write | CPUs busy |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | ---: |")
    for r in report["results"]:
        per_process = ", ".join("?" if x is None else f"{x:.0f}" for x in r["cpu_us_per_write"])
        total = "?" if r["cpu_us_per_write_sum"] is None else f"{r['cpu_us_per_write_sum']:.0f}"
        print(
            f"| {r['system']} | {r['clients']} | {r['writes_per_s']:.0f} | "
            f"{', '.join(f'{x:.0f}' for x in r['writes_per_s_rounds'])} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r.get('mnesite_3_over_this', '')} | {total} ({per_process}) | "
            f"{_us(r.get('load_cpu_us_per_write'))}, {_us(r.get('machine_cpu_us_per_write'))} | "
            f"{'?' if r.get('cpus_busy') is None else format(r['cpus_busy'], '.2f')} |"
        )
    if report.get("lines"):
        print("\nsame-round ratios, per round (issue 21's lines):")
        for line in report["lines"]:
            ratios = ", ".join("?" if r is None else f"{r:.2f}" for r in line["per_round"])
            verdict = (
                f"; {line['target']}: met in {line['rounds_met']} of {len(line['per_round'])}"
                if "target" in line
                else ""
            )
            print(f"- {line['line']} at {line['clients']} client(s): {ratios}{verdict}")
    if report.get("single_core_line_needs"):
        _, clients, *_, ratio = SINGLE_CORE_RATE_LINE
        print(f"\nwhat {ratio:g}x the single core at {clients} clients asks of the 3 cores' summed CPU a write,")
        print("per round (a model: the machine as busy as mnesite-3 kept it, the load generator's and the")
        print("kernel's CPU a write unchanged):")
        for need in report["single_core_line_needs"]:
            floor = need.get("floor_3_cpu_us_per_write")
            floor_text = "" if floor is None else f"; floor-3 spent {', '.join(f'{x:.0f}' for x in floor)}"
            if "floor_3_plus_single_work_us" in need:
                floor_text += f", and with the single core's own work {need['floor_3_plus_single_work_us']:.0f}"
            if "floor_3_log_plus_single_work_us" in need:
                floor_text += f"; floor-3-log with it {need['floor_3_log_plus_single_work_us']:.0f}"
            if "needed_with_single_load_us" in need:
                floor_text += (
                    f"; at most {need['needed_with_single_load_us']:.0f} if the load generator cost a write "
                    "what it costs beside the single core"
                )
            print(
                f"- round {need['round'] + 1}: at most {need['needed_cpu_us_per_write_sum']:.0f} us, "
                f"mnesite-3 spent {need['mnesite_3_cpu_us_per_write_sum']:.0f} (the rest of the machine "
                f"{need['rest_cpu_us_per_write']:.0f} us a write, {need['cpus_busy']:.2f} CPUs busy){floor_text}"
            )
    if report.get("one_client_line_needs"):
        print("\nwhat the 2x line at 1 client allows, per round, beside floor-3's p50 plus what the single core's")
        print("own work adds to floor-1's (a sum of measured parts):")
        for need in report["one_client_line_needs"]:
            print(
                f"- round {need['round'] + 1}: at most {need['allowed_p50_ms']:.3f} ms, mnesite-3 "
                f"{need['mnesite_3_p50_ms']:.3f}, floor-3 with the single core's work "
                f"{need['floor_3_plus_single_work_ms']:.3f}"
            )
    print("\ndurability of an acknowledgement:")
    for name, what in DURABILITY.items():
        if any(r["system"] == name for r in report["results"]):
            print(f"- {name}: {what}")
    for name, why in report["skipped"].items():
        print(f"- {name}: skipped ({why})")
    errors = [(r["system"], r["clients"], r["errors"]) for r in report["results"] if r["errors"]]
    for system, clients, messages in errors:
        print(f"- errors at {system} with {clients} clients: {messages}")


if __name__ == "__main__":
    main()
