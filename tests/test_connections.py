"""[limits] connections_max: the connections a node's listen socket holds open (rlog.connections)."""

from __future__ import annotations

import logging
import resource
import signal
import time
from pathlib import Path

import pytest
import zmq
from mnesite.rlog import connections
from mnesite.rlog.client import Client, MnesiteError, Unavailable
from mnesite.rlog.config import ConfigError, parse_config
from mnesite.rlog.connections import (
    KEY_REDIAL_DELAY_MS_MAX,
    KEY_REDIAL_DELAY_MS_MIN,
    REDIAL_DELAY_MS_MAX,
    REDIAL_DELAY_MS_MIN,
    REFUSED_FULL,
    REFUSED_KEY,
    RefusedDealers,
    admits,
    ensure_files,
    files_needed,
    key_redial_delay_ms,
    redial_delay_ms,
    soft_limit_for,
)
from mnesite.rlog.messages import Message

from tests.conftest import Cluster, NodeProcess, ThreadNode, free_port, replicant_by_hand, wait_until

pytestmark = pytest.mark.timeout(60)


def test_the_listen_guard_stops_at_once_when_its_monitor_has_no_event() -> None:
    """The monitor's thread saw the stop only at the end of its poll (MONITOR_POLL_MS, 200 ms): a node
    whose listen socket had no event meanwhile took up to that long to stop (every test node's stop).
    The stop now wakes it. Each guard in a context of its own, as each node has: the ZAP handler's
    inproc endpoint is one per context, and libzmq frees it only some time after the handler's stop."""
    from mnesite.rlog.connections import MONITOR_POLL_MS, ConnectionCount, ListenGuard

    for _ in range(3):
        context = zmq.Context()
        guard = ListenGuard(ConnectionCount(10), None)
        listen = context.socket(zmq.ROUTER)
        listen.setsockopt(zmq.LINGER, 0)
        stopped = False
        try:
            guard.start(context)
            guard.watch(listen)
            listen.bind("tcp://127.0.0.1:*")
            time.sleep(0.01)  # the monitor's thread is in its poll (the bind's events read)
            started = time.monotonic()
            guard.stop()
            stopped = True
            elapsed_ms = (time.monotonic() - started) * 1000
        finally:
            if not stopped:
                guard.stop()  # its threads hold sockets of the context: term() would wait for them
            listen.close(0)
            context.term()
        # Without the wake the stop takes the rest of the poll (190 ms here); with it, about 1 ms: the
        # bound leaves a loaded machine room for the thread's wake-up.
        assert elapsed_ms < MONITOR_POLL_MS * 3 / 4, f"the guard stopped after {elapsed_ms:.0f} ms"


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
        assert info.value.refused == REFUSED_FULL
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
    assert describe_connections_refused(
        {"connections": {**connections, "refused_open_max": 0, "redials_refused_key": 2}}
    ) == [
        "own connections refused by other nodes for this node's key, dialled again: 2 (add its public key to "
        "their authorized_keys and send them SIGHUP; the log names them)"
    ]
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


def test_the_redial_delay_of_a_refused_key_is_slower_and_grows_to_thirty_seconds() -> None:
    delays = [key_redial_delay_ms(refusals) for refusals in range(1, 12)]
    assert delays[:6] == [1000, 2000, 4000, 8000, 16000, 30000]
    assert (KEY_REDIAL_DELAY_MS_MIN, KEY_REDIAL_DELAY_MS_MAX) == (1000, 30_000)
    assert set(delays[5:]) == {KEY_REDIAL_DELAY_MS_MAX}
    assert key_redial_delay_ms(10**9) == KEY_REDIAL_DELAY_MS_MAX
    assert all(key_redial_delay_ms(n) >= redial_delay_ms(n) for n in range(1, 12)), "never faster than for a full node"
    with pytest.raises(ValueError):
        key_redial_delay_ms(0)


def test_a_refused_dealer_is_dialled_again_once_due_and_a_handshake_resets_its_back_off() -> None:
    refused = RefusedDealers()
    assert refused.refused("tcp://a", REFUSED_FULL, now_ms=1000) == REDIAL_DELAY_MS_MIN
    assert refused.refused_for("tcp://a") == REFUSED_FULL
    assert refused.take_due(1000 + REDIAL_DELAY_MS_MIN - 1) == []
    assert refused.waiting() == 1
    assert refused.take_due(1000 + REDIAL_DELAY_MS_MIN) == ["tcp://a"]
    assert refused.take_due(10_000) == [], "dialled once per refusal"
    assert refused.refused_for("tcp://a") == REFUSED_FULL, "refused until a handshake completes"
    assert refused.refused("tcp://a", REFUSED_FULL, now_ms=2000) == 2 * REDIAL_DELAY_MS_MIN, "refused again in a row"
    refused.take_due(5000)
    refused.connected("tcp://a")
    assert refused.refused_for("tcp://a") is None
    assert refused.refused("tcp://a", REFUSED_FULL, now_ms=6000) == REDIAL_DELAY_MS_MIN, "the back-off starts over"
    refused.forget("tcp://a")  # its DEALER closed
    assert refused.take_due(10**6) == [] and refused.waiting() == 0
    assert refused.refused_for("tcp://a") is None
    assert refused.redials == {REFUSED_FULL: 2, REFUSED_KEY: 0}


def test_a_dealer_refused_for_its_key_is_dialled_again_on_its_own_back_off_and_counted_apart() -> None:
    refused = RefusedDealers()
    assert refused.refused("tcp://a", REFUSED_KEY, now_ms=0) == KEY_REDIAL_DELAY_MS_MIN
    assert refused.refused("tcp://b", REFUSED_FULL, now_ms=0) == REDIAL_DELAY_MS_MIN
    assert refused.refused_for("tcp://a") == REFUSED_KEY
    assert refused.take_due(KEY_REDIAL_DELAY_MS_MIN - 1) == ["tcp://b"]
    assert refused.take_due(KEY_REDIAL_DELAY_MS_MIN) == ["tcp://a"]
    assert refused.refused("tcp://a", REFUSED_KEY, now_ms=2000) == 2 * KEY_REDIAL_DELAY_MS_MIN
    refused.take_due(10_000)
    # Authorized (the other node's SIGHUP), then full: the back-off of the new reason starts at its least.
    assert refused.refused("tcp://a", REFUSED_FULL, now_ms=20_000) == REDIAL_DELAY_MS_MIN
    assert refused.refused_for("tcp://a") == REFUSED_FULL
    refused.take_due(30_000)
    assert refused.redials == {REFUSED_FULL: 2, REFUSED_KEY: 2}


def test_frames_dropped_toward_a_node_that_refused_this_one_are_counted_as_such(tmp_path: Path) -> None:
    """Not as ``zmq`` ("the receiver's queue is full"): nothing can reach a node that refused the
    connection, so its queue fills whatever the receiver does."""
    ack = Message("push_ack", "a1", {"shard": "default", "agent": "a1", "applied": [1, 1]})
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: IMMEDIATE drops every frame at once
    with replicant_by_hand(tmp_path / "r") as node:
        node.context = zmq.Context()
        try:
            socket = node.dealer(endpoint, queue_max=10, dealers_max=10, immediate=True)
            node.send_now(socket, ack)
            node.refused_dealers.refused(endpoint, REFUSED_KEY, now_ms=0)  # as its monitor tells
            unsent = []
            node.frame_unsent = lambda message, why: unsent.append(why)
            node.send_now(socket, ack)
            node.send_now(socket, ack)
            status = node.status()
            assert status["sends_dropped_by"]["zmq"] == 1
            assert status["sends_dropped_by"]["refused_connection"] == 2
            assert status["sends_dropped"] == 3
            assert unsent == [f"{endpoint} refused this node's key (not in its authorized_keys)"] * 2
            node.refused_dealers.connected(endpoint)  # let in (a handshake completed), then gone again
            node.send_now(socket, ack)
            assert node.status()["sends_dropped_by"]["zmq"] == 2
        finally:
            node.close_dealer(endpoint)
            node.context.term()
            node.context = None


@pytest.mark.slow  # it starts real node processes (seconds each): the slow lane runs it
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
        wait_until(
            lambda: _connections(cluster, "replicant1").get("redials_refused", 0) >= 1,
            20,
            "the replicant to dial core1 again",
        )
    finally:
        for client in flood:
            client.close()

    # Served through core1 (the replicant asks it for the read's fence): its connection is back.
    wait_until(
        lambda: _linearizable_read(cluster) == {"id": 1, "value": "one"}, 30, "the replicant to reach core1 again"
    )


def _linearizable_read(cluster: Cluster) -> dict | None:
    """Row 1 of kv read on replicant1, linearizable: served through core1 (the replicant asks it for
    the read's fence), so only while its connection to core1 is up; None if not served."""
    try:
        with cluster.client("replicant1", timeout_ms=1000, retries=0) as client:
            return client.get("kv", 1, consistency="linearizable")
    except MnesiteError:
        return None


@pytest.mark.slow  # it starts real node processes (seconds each): the slow lane runs it
@pytest.mark.timeout(120)
def test_a_replicant_started_before_its_key_is_authorized_connects_once_it_is_without_a_restart(
    tmp_path: Path, node_processes: list[NodeProcess]
) -> None:
    """zmq never dials a connection refused for its key again by itself: the replicant dials its DEALER
    toward the core again (``NodeServer.reconnect_refused``), so the core's SIGHUP that authorizes the
    key is enough."""
    cluster = Cluster(tmp_path, node_processes, size=1, secure=True)
    cluster.add_replicant("replicant1")
    authorized = cluster.authorized_dir / "replicant1.key"
    not_yet = tmp_path / "replicant1.key"
    authorized.rename(not_yet)  # the operator has not authorized it yet
    cluster.start("core1")
    with cluster.client("core1") as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        client.put("kv", {"id": 1, "value": "one"})
    cluster.start("replicant1")  # it answers on its own listen socket; its DEALER toward core1 is refused

    def core_refused_keys() -> int:
        return ((cluster.status("core1") or {}).get("security") or {}).get("handshakes_failed", {}).get("auth", 0)

    wait_until(lambda: core_refused_keys() >= 1, 20, "core1 to refuse the replicant's key")
    wait_until(lambda: _connections(cluster, "replicant1").get("redials_refused_key", 0) >= 1, 20, "a re-dial")
    assert core_refused_keys() >= 2, "refused again at the re-dial"
    replicant_log = (tmp_path / "replicant1.log").read_text()
    assert f"{cluster.endpoints['core1']} refused this node's key" in replicant_log
    assert "send that node SIGHUP" in replicant_log

    not_yet.rename(authorized)
    cluster.nodes["core1"].signal(signal.SIGHUP)
    wait_until(lambda: "SIGHUP: reloaded" in (tmp_path / "core1.log").read_text(), 10, "core1 to reload")

    # Served through core1 (the replicant asks it for the read's fence): within the key's back-off (at
    # most 30 s; a few seconds here, the refusals in a row being few).
    wait_until(lambda: _linearizable_read(cluster) == {"id": 1, "value": "one"}, 40, "the replicant to reach core1")
    assert _connections(cluster, "replicant1")["redials_refused"] == 0, "none counted for connections_max"


def _connections(cluster: Cluster, name: str) -> dict:
    return (cluster.status(name) or {}).get("connections") or {}
