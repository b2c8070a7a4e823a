"""A node's process stops cleanly on SIGTERM or Ctrl-C at any point of its life (``rlog.process_signals``).

A core's start-up recovery (``core.recovery``) runs before the node exists and may last minutes: a
stop then ends it within a recovery poll interval, closes what is open and exits as a normal stop
does (before: the handlers were installed once the node was constructed, and the signal's default
action killed the process at once, with no line saying why). And a handler only records the signal:
one that took a lock (the query runner's, which the loop holds a moment every turn) waited forever
for its own thread when the signal came in that moment, and the process ignored every later SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.core.node import CoreNode
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.data_dir import DataDirectoryLock
from mnesite.rlog.process_signals import ProcessSignals
from mnesite.rlog.server import StoppedWhileStarting

from tests.conftest import REPO, NodeProcess, free_port, node_config, wait_until

pytestmark = pytest.mark.timeout(60)

# A normal stop's exit status (``mnesite start``: the loop left, the node closed).
STOPPED_EXIT_CODE = 0
# A recovering core looks at a stop at least this often (core.node.RECOVERY_POLL_INTERVAL_MS is 20):
# the rest is the interpreter's exit, on a machine shared with other tests.
STOP_TIME_S_MAX = 5.0


def child_environment() -> dict[str, str]:
    """This tree importable, after whatever the test run put first (not from the repository's
    directory: its ``mnesite/`` holds no subpackage, and they would then come from the installed copy)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(REPO)))))


def status_shows_recovery(endpoint: str) -> bool:
    """Whether the core at ``endpoint`` answers ``status`` with its start-up recovery section."""
    try:
        with Client(endpoint, timeout_ms=200, retries=0) as client:
            return client.status().get("recovery") is not None
    except MnesiteError:
        return False


def recovering_core(tmp_path: Path, node_processes: list[NodeProcess]) -> tuple[NodeProcess, str]:
    """A core on an empty database in a cluster declared existing, whose one peer is not there: it
    asks that peer every ``recovery_timeout_ms`` for ten rounds. Returned once ``status`` shows it
    recovering."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    absent = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "core1.toml"
    config.write_text(
        f'[node]\nname = "core1"\ndata_dir = "{tmp_path / "core1"}"\nlisten = "{endpoint}"\n'
        '[storage]\nsynchronous = "NORMAL"\n'
        f'[cluster]\ncore_nodes = {{ core1 = "{endpoint}", core2 = "{absent}" }}\n'
        'initial_cluster_state = "existing"\nrecovery_timeout_ms = 1000\n'
    )
    node = NodeProcess(config, tmp_path / "core1.log")
    node_processes.append(node)
    with open(node.log_path, "ab") as log:
        node.process = subprocess.Popen(
            [sys.executable, "-m", "mnesite.cli", "start", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
            env=child_environment(),
            start_new_session=True,
        )

    def recovering() -> bool:
        assert node.process is not None and node.process.poll() is None, node.log_path.read_text()[-2000:]
        return status_shows_recovery(endpoint)

    wait_until(recovering, 20, "the core to answer status while it recovers")
    return node, endpoint


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_during_the_start_up_recovery_ends_it_and_exits_as_a_normal_stop(
    tmp_path: Path, node_processes: list[NodeProcess], signum: signal.Signals
) -> None:
    node, _ = recovering_core(tmp_path, node_processes)
    assert node.process is not None
    sent_s = time.monotonic()
    node.signal(signum)
    returncode = node.process.wait(timeout=20)
    stopped_s = time.monotonic() - sent_s
    log = node.log_path.read_text()
    assert returncode == STOPPED_EXIT_CODE, log[-2000:]
    assert stopped_s < STOP_TIME_S_MAX, (stopped_s, log[-2000:])
    name = signal.Signals(signum).name
    assert f"core core1 shut down ({name}, during its start-up recovery, round " in log, log[-2000:]
    node.process = None


def test_a_stop_signal_that_comes_while_the_loop_holds_the_query_runner_s_lock_stops_the_node(
    tmp_path: Path,
) -> None:
    """The SIGTERM handler's moment is reproduced: the signal is raised while the loop's thread holds
    the lock it takes each turn (``QueryRunner.expire``). Before, the handler waited for that lock
    for ever (``QueryRunner.wake``): the node never stopped (found by ``benchmarks/cpu_by_function.py``,
    a core killed by hand after SIGTERM)."""
    port = free_port()
    script = (
        "import logging, signal\n"
        "from pathlib import Path\n"
        "from mnesite.core.node import CoreNode\n"
        "from tests.conftest import node_config\n"
        "logging.basicConfig(level='INFO')\n"
        f"node = CoreNode(node_config(Path({str(tmp_path / 'core1')!r}), {port}))\n"
        "node.bind()\n"
        "node.install_signal_handlers()\n"
        "with node.queries._lock:\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "node.serve_forever()\n"
    )
    try:
        finished = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            env=child_environment(),
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"the node did not stop: {hung.stderr}") from None
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "core core1 shut down (SIGTERM)" in finished.stderr, finished.stderr[-2000:]


def test_a_start_that_fails_gives_the_signals_back_to_the_process_s_handlers(tmp_path: Path) -> None:
    """``mnesite start`` takes SIGTERM, SIGINT and SIGHUP before it constructs the node; a process that
    goes on after a failed start (here the test's, through CliRunner) keeps its own."""
    config = tmp_path / "bad.toml"
    config.write_text('[node]\nrole = "leader"\n')
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    result = CliRunner().invoke(main, ["start", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert {number: signal.getsignal(number) for number in handlers} == handlers
    assert signal.set_wakeup_fd(wakeup_fd) == wakeup_fd


def test_a_core_stopped_during_its_recovery_gives_back_its_data_directory_and_its_port(tmp_path: Path) -> None:
    """In process: the constructor raises ``StoppedWhileStarting`` once a handler recorded a stop (set
    here by hand), having closed its store, the data directory's lock and its socket."""
    port = free_port()
    absent = f"tcp://127.0.0.1:{free_port()}"
    endpoint = f"tcp://127.0.0.1:{port}"
    cluster = {"core_nodes": {"core1": endpoint, "core2": absent}, "initial_cluster_state": "existing"}
    config = node_config(tmp_path / "core1", port, extra={"cluster": cluster})
    signals = ProcessSignals()  # not installed: the test records the stop as the handler would
    outcome: list[object] = []

    def construct() -> None:
        try:
            outcome.append(CoreNode(config, signals=signals))
        except BaseException as error:
            outcome.append(error)

    constructing = threading.Thread(target=construct, daemon=True)
    constructing.start()
    try:

        def recovering() -> bool:
            assert not outcome, outcome
            return status_shows_recovery(endpoint)

        wait_until(recovering, 10, "the core to answer status while it recovers")
        signals.stop_signal = "SIGTERM"
        constructing.join(timeout=5)
        assert outcome and isinstance(outcome[0], StoppedWhileStarting), outcome
        assert str(outcome[0]).startswith("SIGTERM, during its start-up recovery, round ")
        store, lock = DataDirectoryLock.acquire_and_open(
            config.data_dir, config.name, config.database_path, config.synchronous
        )
        store.close()
        lock.release()
        router = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            router.bind(endpoint)
        finally:
            router.close(0)
    finally:
        signals.stop_signal = "SIGTERM"
        constructing.join(timeout=5)
        signals.uninstall()
