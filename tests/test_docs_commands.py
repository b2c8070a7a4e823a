"""The shell blocks of README.md and the tutorial, run against real nodes: a documented command that
stops working fails here.

A block runs when the line before its ```sh fence is ``<!-- docs-test: run -->`` (or
``<!-- docs-test: with make-run -->``: a core with sample data is serving first, as ``make run``
does, and ``MNESITE_NODE`` names it). The blocks of one page run in order, in one temporary
directory, with what a reader on one machine would change:

* every ``HOST:PORT`` in the page's blocks becomes ``127.0.0.1:FREE_PORT`` (one free port per
  distinct address, the same in every block), so the three hosts of the tutorial run on loopback;
* ``/var/lib/mnesite`` becomes a folder of the temporary directory;
* a line ``mnesite start ... &`` is started by this test in its own process group (its output in a
  log file), and the test waits until the node's ``listen`` address accepts connections: what a
  reader does by starting nodes in other terminals before going on.

Every other line runs in ``bash -euo pipefail`` with a deadline. Every process started is killed
(SIGKILL of its process group) when the page ends, also when it fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

MARKER = re.compile(r"^<!-- docs-test: (run|with make-run) -->$")
ADDRESS = re.compile(r"(?<![\d.])(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}):(\d{2,5})\b")
START_LINE = re.compile(r"^mnesite start (?P<arguments>.*?)\s*&\s*$")
BLOCK_TIMEOUT_S = 90
NODE_START_TIMEOUT_S = 30
PAGES = {"readme": REPO / "README.md", "tutorial": REPO / "docs" / "tutorial.md"}


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the fence in the page, for failure messages
    mode: str  # "run" or "with make-run"
    text: str


def marked_blocks(page: Path) -> list[Block]:
    """The ```sh blocks of ``page`` whose preceding line is a docs-test marker, in page order."""
    lines = page.read_text().splitlines()
    blocks = []
    for index, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if match is None:
            continue
        fence = index + 1
        if fence >= len(lines) or lines[fence].strip() != "```sh":
            raise AssertionError(f"{page.name}:{index + 1}: a docs-test marker must be followed by a ```sh block")
        end = next((j for j in range(fence + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{page.name}:{fence + 1}: the ```sh block is not closed")
        blocks.append(Block(fence + 1, match.group(1), "\n".join(lines[fence + 1 : end]) + "\n"))
    return blocks


class PageRun:
    """One page's blocks in one directory, with its nodes; ``close`` kills everything it started."""

    def __init__(self, page: Path, root: Path) -> None:
        self.page = page
        self.root = root
        self.ports: dict[str, int] = {}
        self.processes: list[tuple[subprocess.Popen, Path]] = []
        self.make_run_endpoint: str | None = None
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("MNESITE_")}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"

    def localise(self, text: str) -> str:
        def to_loopback(match: re.Match[str]) -> str:
            address = match.group(0)
            if address not in self.ports:
                self.ports[address] = free_port()
            return f"127.0.0.1:{self.ports[address]}"

        text = ADDRESS.sub(to_loopback, text)
        return text.replace("/var/lib/mnesite", str(self.root / "var" / "lib" / "mnesite"))

    def run_block(self, block: Block) -> None:
        env = dict(self.env)
        if block.mode == "with make-run":
            env["MNESITE_NODE"] = self.serve_sample_data()
        script: list[str] = []
        for line in self.localise(block.text).splitlines():
            start = START_LINE.match(line)
            if start is None:
                script.append(line)
                continue
            self.run_script("\n".join(script), env, block)
            script = []
            self.start_node(shlex.split(start.group("arguments")), block)
        self.run_script("\n".join(script), env, block)

    def run_script(self, script: str, env: dict[str, str], block: Block) -> None:
        if not script.strip():
            return
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=self.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            self.fail(block, script, f"did not finish within {BLOCK_TIMEOUT_S} s", output)
        finally:
            _kill_group(process)  # whatever the block left running in the background
        if process.returncode != 0:
            self.fail(block, script, f"exited with {process.returncode}", output)

    def start_node(self, arguments: list[str], block: Block) -> None:
        config_path = self.root / arguments[arguments.index("--config") + 1]
        listen = tomllib.loads(config_path.read_text())["node"]["listen"]
        log_path = self.root / f"node-{len(self.processes)}.out"
        self.spawn(["mnesite", "start", *arguments], log_path)
        host, port = listen.removeprefix("tcp://").rsplit(":", 1)
        self.await_listening(host, int(port), f"mnesite start {' '.join(arguments)} (page line {block.line})")

    def serve_sample_data(self) -> str:
        """What ``make run`` serves (``mnesite start --sample-data``), on a free port."""
        if self.make_run_endpoint is None:
            port = free_port()
            config = self.root / "make-run.toml"
            config.write_text(
                f'[node]\nname = "core1"\ndata_dir = "make-run-data"\nlisten = "tcp://127.0.0.1:{port}"\n'
            )
            self.spawn(["mnesite", "start", "--sample-data", "--config", str(config)], self.root / "make-run.out")
            self.await_listening("127.0.0.1", port, "make run")
            self.make_run_endpoint = f"tcp://127.0.0.1:{port}"
        return self.make_run_endpoint

    def spawn(self, command: list[str], log_path: Path) -> None:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                command,
                cwd=self.root,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append((process, log_path))

    def await_listening(self, host: str, port: int, what: str) -> None:
        process, log_path = self.processes[-1]
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise AssertionError(f"{what} exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what} did not listen within {NODE_START_TIMEOUT_S} s") from None
                time.sleep(0.05)

    def fail(self, block: Block, script: str, why: str, output: bytes) -> None:
        logs = "".join(
            f"\n--- {path.name} ---\n{path.read_text(errors='replace')[-1500:]}" for _, path in self.processes
        )
        raise AssertionError(
            f"{self.page.name}: the block at line {block.line} {why}\n--- script ---\n{script}\n"
            f"--- output ---\n{output.decode(errors='replace')[-4000:]}{logs}"
        )

    def close(self) -> None:
        for process, _ in self.processes:
            _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def run_page(page: Path, root: Path) -> None:
    blocks = marked_blocks(page)
    run = PageRun(page, root)
    try:
        for block in blocks:
            run.run_block(block)
    finally:
        run.close()


def test_the_pages_mark_their_command_blocks() -> None:
    """A marker that disappears (or a block that loses its fence) would silently test nothing."""
    readme, tutorial = marked_blocks(PAGES["readme"]), marked_blocks(PAGES["tutorial"])
    assert [block.mode for block in readme][:1] == ["with make-run"]  # the quick start
    assert len(readme) >= 4 and len(tutorial) >= 12
    assert any("mnesite start" in block.text for block in readme)
    assert any("keys generate" in block.text for block in tutorial)


def test_localise_gives_each_address_one_free_loopback_port(tmp_path: Path) -> None:
    run = PageRun(PAGES["tutorial"], tmp_path)
    text = run.localise('listen = "tcp://10.0.0.1:7400"\n"10.0.0.2:7400" tcp://10.0.0.1:7400 /var/lib/mnesite/core1')
    assert "10.0.0." not in text and text.endswith(f" {tmp_path}/var/lib/mnesite/core1")
    first, second = run.ports["10.0.0.1:7400"], run.ports["10.0.0.2:7400"]
    assert first != second and text.count(f"127.0.0.1:{first}") == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_readme_command_blocks_run_against_real_nodes(tmp_path: Path) -> None:
    run_page(PAGES["readme"], tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tutorial_command_blocks_run_against_real_nodes(tmp_path: Path) -> None:
    run_page(PAGES["tutorial"], tmp_path)
