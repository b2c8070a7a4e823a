"""Shared fixtures: free ports, an in-process node, and real node processes that are always killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.node import CoreNode
from rlog.client import Client, MnesiteError
from rlog.config import parse_config

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Poll ``condition`` until it holds; fail the test with ``what`` when ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def node_config(data_dir: Path, port: int, name: str = "core1", extra: dict | None = None):
    data = {
        "node": {"name": name, "role": "core", "data_dir": str(data_dir), "listen": f"tcp://127.0.0.1:{port}"},
        "storage": {"synchronous": "NORMAL"},
    }
    for section, values in (extra or {}).items():
        data.setdefault(section, {}).update(values)
    return parse_config(data)


class ThreadNode:
    """A core node served from a thread of the test process (fast; for protocol and CLI tests)."""

    def __init__(self, data_dir: Path, extra: dict | None = None) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.node = CoreNode(node_config(data_dir, self.port, extra=extra))
        self.node.bind()
        self.thread = threading.Thread(target=self.node.serve_forever, daemon=True)
        self.thread.start()

    def client(self, **kwargs) -> Client:
        return Client(self.endpoint, **kwargs)

    def stop(self) -> None:
        self.node.stopping.set()
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            raise AssertionError("node thread did not stop within 10 s")


@pytest.fixture
def thread_node(tmp_path: Path) -> Iterator[ThreadNode]:
    node = ThreadNode(tmp_path / "data")
    try:
        yield node
    finally:
        node.stop()


class NodeProcess:
    """A real ``mnesite start`` process in its own process group; ``kill`` is kill -9."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, endpoint: str, timeout_s: float = 20) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cli", "start", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )

        def ready() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"node exited with {self.process.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with Client(endpoint, timeout_ms=200, retries=0) as client:
                    client.status()
                return True
            except MnesiteError:
                return False

        wait_until(ready, timeout_s, f"node at {endpoint} to answer")

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """kill -9 the node and wait for it to be gone."""
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None


@pytest.fixture
def node_processes() -> Iterator[list[NodeProcess]]:
    """Collects NodeProcess objects; every one is killed at teardown, also when the test fails."""
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
