"""The fault test's network layer on its own: it says why it cannot run, cuts one direction of a link,
slows a link, and removes what a killed run left behind. Root only (skipped with the reason otherwise),
except the first test; the others start processes in namespaces and are marked slow."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault import netns
from tests.fault.netns import Network

pytestmark = pytest.mark.timeout(60)

SERVER = "import socket,sys\ns=socket.create_server((sys.argv[1],7000))\nprint('up',flush=True)\nwhile True:\n c,_=s.accept();c.sendall(b'hi');c.close()\n"  # noqa: E501
PROBE = "import socket,sys\ntry:\n c=socket.create_connection((sys.argv[1],7000),timeout=1);print(c.recv(2).decode())\nexcept OSError as e:print('cut',e)\n"  # noqa: E501


def test_without_root_or_iproute2_it_says_why(monkeypatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "need root" in netns.unavailable()
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert "iproute2" in netns.unavailable()


@pytest.fixture
def network(tmp_path: Path) -> Iterator[Network]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    made = Network.create(["a", "b"], tmp_path)
    server = subprocess.Popen(
        [*made.command_prefix("b"), sys.executable, "-c", SERVER, made.host("b")], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout.readline() == b"up\n"
        yield made
    finally:
        server.kill()
        server.wait(10)
        made.close()


def probe(network: Network, source: str | None) -> tuple[str, float]:
    """Connect from ``source``'s namespace (None: the test's own) to b's server: its answer and the time."""
    prefix = network.command_prefix(source) if source else []
    started = time.monotonic()
    out = subprocess.run([*prefix, sys.executable, "-c", PROBE, network.host("b")], capture_output=True, timeout=20)
    return out.stdout.decode().strip(), time.monotonic() - started


@pytest.mark.slow
def test_a_cut_drops_one_direction_and_heals(network: Network) -> None:
    assert probe(network, "a")[0] == "hi"
    network.cut("a", "b")
    assert probe(network, "a")[0].startswith("cut")
    assert probe(network, None)[0] == "hi", "the test's clients are never cut"
    network.heal()
    assert probe(network, "a")[0] == "hi"
    network.cut("b", "a")  # b cannot answer a: no connection either (TCP needs both directions)
    assert probe(network, "a")[0].startswith("cut")
    network.heal()
    assert network.cuts == set() and probe(network, "a")[0] == "hi"


@pytest.mark.slow
def test_a_slow_link_delays_and_heals(network: Network) -> None:
    direct = min(probe(network, "a")[1] for _ in range(2))
    network.slow("a", "b", 7000, 400)
    answer, slowed = probe(network, "a")
    assert answer == "hi" and slowed >= direct + 0.35, (direct, slowed)
    network.heal()
    assert network.slow_links == [] and probe(network, "a")[1] < direct + 0.3


@pytest.mark.slow
def test_leftovers_of_a_dead_run_are_removed_and_a_live_runs_are_kept(network: Network) -> None:
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = f"{netns.PREFIX_BASE}{finished.pid}-core1"
    netns.ip("netns", "add", dead)
    try:
        removed = netns.remove_leftovers()
        assert dead in removed
        assert network.namespace("a") not in removed
        assert dead not in netns.ip("netns", "list").stdout
    finally:
        netns.ip("netns", "delete", dead, check=False)
