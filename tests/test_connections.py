"""[limits] connections_max: the connections a node's listen socket holds open (rlog.connections)."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import pytest
from mnesite.rlog import connections
from mnesite.rlog.client import Client, MnesiteError, Unavailable
from mnesite.rlog.config import ConfigError, parse_config
from mnesite.rlog.connections import (
    REDIAL_DELAY_MS_MAX,
    REDIAL_DELAY_MS_MIN,
    RefusedDealers,
    admits,
    ensure_files,
    files_needed,
    redial_delay_ms,
    soft_limit_for,
)

from tests.conftest import Cluster, NodeProcess, ThreadNode, wait_until

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


def test_a_client_told_every_node_is_full_says_so(tmp_path: Path) -> None:
    nodes = [
        ThreadNode(tmp_path / name, extra={"limits": {"connections_max": 1}}, name=name) for name in ("core1", "core2")
    ]
    holders = [node.client(timeout_ms=2000, retries=0) for node in nodes]
    endpoints = [node.endpoint for node in nodes]
    try:
        for holder in holders:
            holder.status()  # each node's one place is taken
        with Client(endpoints, timeout_ms=2000) as late, pytest.raises(Unavailable) as info:
            late.get("kv", 1)  # refused at the connection, before any table is looked for
        assert str(info.value) == (
            f"every node of {', '.join(endpoints)} refused the connection: each holds its connections_max "
            "connections; retry later, close idle clients, or raise [limits] connections_max on those nodes"
        )
    finally:
        for holder in holders:
            holder.close()
        for node in nodes:
            node.stop()


def test_status_text_names_the_connections_refused() -> None:
    from mnesite.cli.main import describe_connections_refused

    connections = {"open": 2, "open_max": 3, "refused_open_max": 5, "redials_refused": 0}
    assert describe_connections_refused({"connections": connections}) == [
        "connections refused: 5 (connections_max 3 reached; 2 open now)"
    ]
    assert describe_connections_refused({"connections": {**connections, "refused_open_max": 0}}) == []
    assert describe_connections_refused(
        {"connections": {**connections, "refused_open_max": 0, "redials_refused": 4}}
    ) == ["own connections refused by other nodes for their connections_max, dialled again: 4"]
    assert describe_connections_refused({"connections": {"waiting": 0}}) == [], "a release without the bound"


def test_the_redial_delay_grows_from_its_least_to_its_most() -> None:
    delays = [redial_delay_ms(refusals) for refusals in range(1, 12)]
    assert delays[0] == REDIAL_DELAY_MS_MIN
    assert delays[1] == 2 * REDIAL_DELAY_MS_MIN
    assert delays == sorted(delays), "it never shrinks while the refusals go on"
    assert delays[-1] == REDIAL_DELAY_MS_MAX
    assert redial_delay_ms(10**9) == REDIAL_DELAY_MS_MAX  # no huge shift after a long refusal
    with pytest.raises(ValueError):
        redial_delay_ms(0)


def test_a_refused_dealer_is_dialled_again_once_due_and_a_handshake_resets_its_back_off() -> None:
    refused = RefusedDealers()
    assert refused.refused("tcp://a", now_ms=1000) == REDIAL_DELAY_MS_MIN
    assert refused.take_due(1000 + REDIAL_DELAY_MS_MIN - 1) == []
    assert refused.waiting() == 1
    assert refused.take_due(1000 + REDIAL_DELAY_MS_MIN) == ["tcp://a"]
    assert refused.take_due(10_000) == [], "dialled once per refusal"
    assert refused.refused("tcp://a", now_ms=2000) == 2 * REDIAL_DELAY_MS_MIN, "refused again in a row"
    refused.take_due(5000)
    refused.connected("tcp://a")
    assert refused.refused("tcp://a", now_ms=6000) == REDIAL_DELAY_MS_MIN, "the back-off starts over"
    refused.forget("tcp://a")  # its DEALER closed
    assert refused.take_due(10**6) == [] and refused.waiting() == 0
    assert refused.redials == 2


@pytest.mark.timeout(120)
def test_a_replicant_refused_for_a_cores_connections_max_connects_once_a_place_is_free(
    tmp_path: Path, node_processes: list[NodeProcess]
) -> None:
    """zmq never dials a refused connection again by itself: the replicant's own DEALER toward the core
    must be dialled again by the replicant (``NodeServer.reconnect_refused``) once the flood is over."""
    cluster = Cluster(tmp_path, node_processes, size=1, secure=False)
    cluster.extend_core_configs("[limits]\nconnections_max = 2\n")
    cluster.add_replicant("replicant1")
    cluster.start("core1")
    flood = [cluster.client("core1", retries=0) for _ in range(2)]
    try:
        flood[0].create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        flood[0].put("kv", {"id": 1, "value": "one"})
        flood[1].status()  # both places of the core are taken
        cluster.start("replicant1")  # it answers on its own listen socket; its DEALER toward core1 is refused
        wait_until(
            lambda: flood[0].status()["connections"]["refused_open_max"] >= 1, 20, "core1 to refuse the replicant"
        )
        # Refused again at each re-dial while the flood holds. (A refusal whose connection zmq saw closed
        # before the refusal reached it is a dropped connection, which zmq dials again by itself.)
        wait_until(lambda: _redials_refused(cluster, "replicant1") >= 1, 20, "the replicant to dial core1 again")
    finally:
        for client in flood:
            client.close()

    def linearizable_read() -> dict | None:
        try:
            with cluster.client("replicant1", timeout_ms=1000, retries=0) as client:
                return client.get("kv", 1, consistency="linearizable")
        except MnesiteError:
            return None

    # Served through core1 (the replicant asks it for the read's fence): its connection is back.
    wait_until(lambda: linearizable_read() == {"id": 1, "value": "one"}, 30, "the replicant to reach core1 again")


def _redials_refused(cluster: Cluster, name: str) -> int:
    status = cluster.status(name)
    return status["connections"]["redials_refused"] if status else 0
