"""[limits] connections_max: the connections a node's listen socket holds open (rlog.connections)."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import pytest
from mnesite.rlog import connections
from mnesite.rlog.client import Client, MnesiteError, Unavailable
from mnesite.rlog.config import ConfigError, parse_config
from mnesite.rlog.connections import admits, ensure_files, files_needed, soft_limit_for

from tests.conftest import ThreadNode, wait_until

pytestmark = pytest.mark.timeout(60)


def test_the_decision_admits_below_the_bound_and_a_peer_core_always() -> None:
    assert admits(others_open=0, open_max=1, exempt=False)
    assert admits(others_open=2, open_max=3, exempt=False)
    assert not admits(others_open=3, open_max=3, exempt=False)
    assert not admits(others_open=7, open_max=3, exempt=False)  # overshot (handshakes at one instant)
    assert admits(others_open=3, open_max=3, exempt=True)
    assert admits(others_open=7, open_max=3, exempt=True)


@pytest.mark.parametrize("value", [0, -1, 1_000_001, "many", 2.5, True])
def test_the_config_refuses_a_connections_max_out_of_bounds(value: object) -> None:
    with pytest.raises(ConfigError, match=r"\[limits\]\.connections_max must be an integer in 1\.\.1000000"):
        parse_config({"limits": {"connections_max": value}})


def test_the_config_takes_connections_max_with_a_default() -> None:
    assert parse_config({}).limits.connections_max == 1024
    assert parse_config({"limits": {"connections_max": 3}}).limits.connections_max == 3


def test_the_soft_file_limit_is_raised_within_the_hard_one() -> None:
    assert soft_limit_for(needed=500, soft=1024, hard=4096) == 1024  # enough already
    assert soft_limit_for(needed=2000, soft=1024, hard=4096) == 2000
    assert soft_limit_for(needed=2000, soft=1024, hard=resource.RLIM_INFINITY) == 2000
    assert soft_limit_for(needed=5000, soft=1024, hard=4096) is None


def test_a_node_raises_its_soft_file_limit_or_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(connections.resource, "setrlimit", lambda _which, limits: set_to.append(limits))
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _which: (1024, 1_000_000))
    ensure_files(connections_max=4000, dealers_max=10)
    assert set_to == [(files_needed(4000, 10), 1_000_000)]
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _which: (1024, 2048))
    needed = files_needed(4000, 10)
    with pytest.raises(ConfigError) as info:
        ensure_files(connections_max=4000, dealers_max=10)
    text = str(info.value)
    assert f"connections_max = 4000 needs up to {needed} open files" in text
    assert "may open 2048 (RLIMIT_NOFILE hard limit)" in text
    assert "lower connections_max or raise the limit" in text
    assert len(set_to) == 1


def _served(client: Client) -> bool:
    try:
        client.status()
        return True
    except Unavailable:
        return False


def test_a_node_refuses_connections_past_connections_max(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = ThreadNode(tmp_path / "data", extra={"limits": {"connections_max": 3}})
    clients = [node.client(timeout_ms=2000, retries=0) for _ in range(3)]
    try:
        for client in clients:
            assert client.status()["node"] == "core1"  # each holds its connection open
        with (
            caplog.at_level(logging.WARNING, logger="mnesite.connections"),
            node.client(timeout_ms=2000) as fourth,
            pytest.raises(Unavailable) as info,
        ):
            fourth.status()
        assert "refused the connection: it holds its connections_max connections" in str(info.value)
        assert "raise [limits] connections_max" in str(info.value)
        assert "refused a connection: 3 are open, [limits] connections_max is 3" in caplog.text
        connections_now = clients[0].status()["connections"]
        assert connections_now["open_max"] == 3
        assert connections_now["refused_open_max"] >= 1
        # The refused connection is closed by zmq after its handshake: seen by the monitor a moment later.
        wait_until(lambda: clients[0].status()["connections"]["open"] == 3, 10, "the refused connection's close")
        clients.pop(1).close()
        with node.client(timeout_ms=2000, retries=0) as later:
            # The node sees the close through its monitor: a moment later a new client takes the place.
            wait_until(lambda: _served(later), 10, "a new client to be served once one of the three closed")
    finally:
        for client in clients:
            client.close()
        node.stop()


def test_a_refused_connection_is_not_taken_for_a_refused_key(tmp_path: Path) -> None:
    node = ThreadNode(tmp_path / "data", extra={"limits": {"connections_max": 1}})
    try:
        with node.client(timeout_ms=2000) as first, node.client(timeout_ms=2000) as second:
            first.status()
            with pytest.raises(MnesiteError) as info:
                second.status()
            assert type(info.value) is Unavailable and info.value.code == "unavailable"
            assert "is the node running" not in str(info.value)
    finally:
        node.stop()


def test_status_text_names_the_connections_refused() -> None:
    from mnesite.cli.main import describe_connections_refused

    connections = {"open": 2, "open_max": 3, "refused_open_max": 5}
    assert describe_connections_refused({"connections": connections}) == (
        "connections refused: 5 (connections_max 3 reached; 2 open now)"
    )
    assert describe_connections_refused({"connections": {**connections, "refused_open_max": 0}}) is None
    assert describe_connections_refused({"connections": {"waiting": 0}}) is None, "a release without the bound"
