"""core.agent.Agent, sentence by sentence of its theory of operation."""

from __future__ import annotations

from collections import deque

import msgpack
import pytest
from mnesite.core.agent import STOPPED_TRIMMED, Agent, AgentConfig, AgentConfigError
from mnesite.rlog.messages import typed_body
from mnesite.rlog.replication import (
    AckReceived,
    AgentMode,
    AgentStopped,
    CommittedAdvanced,
    Push,
    PushesDropped,
    RejectReceived,
    Ticked,
)
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, TxKey, WriteOp, make_entry

from tests.sim import MemoryLog

SHARD = "main"


def build_log(count: int, generation: int = 1) -> MemoryLog:
    log = MemoryLog()
    prev, digest = ZERO_KEY, GENESIS_DIGEST
    for counter in range(1, count + 1):
        entry = make_entry(SHARD, TxKey(generation, counter), prev, digest, (WriteOp("t", {"k": counter}),))
        log.append((entry,))
        prev, digest = entry.tx_key, entry.digest
    return log


def agent(log: MemoryLog, start: TxKey = ZERO_KEY, now_ms: int = 0, **config) -> Agent:
    return Agent("agent-1", SHARD, "rep0", start, log, AgentConfig(**config), now_ms)


def pushes(effects) -> list[Push]:
    return [effect for effect in effects if isinstance(effect, Push)]


def pushed_keys(effects) -> list[TxKey]:
    return [entry.tx_key for push in pushes(effects) for entry in push.entries]


@pytest.mark.timeout(10)
def test_only_committed_entries_are_pushed_even_if_the_log_holds_an_uncommitted_tail():
    log = build_log(10)
    machine = agent(log)
    effects = machine.step(CommittedAdvanced(TxKey(1, 6), True), 0)
    # The first read takes five entries; the sixth, a partial push, waits for their acknowledgement.
    effects += machine.step(AckReceived(TxKey(1, 5)), 0)
    assert pushed_keys(effects) == [TxKey(1, n) for n in range(1, 7)]
    assert all(push.committed_key == TxKey(1, 6) and push.hears_sequencer for push in pushes(effects))
    machine.step(AckReceived(TxKey(1, 6)), 1)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 8), True), 1)) == [TxKey(1, 7), TxKey(1, 8)]


@pytest.mark.timeout(10)
def test_a_push_holds_at_most_push_entries_max_entries_and_they_follow_each_other():
    machine = agent(build_log(20), push_entries_max=3, pushes_in_flight_max=10)
    effects = machine.step(CommittedAdvanced(TxKey(1, 20), True), 0)
    effects += machine.step(AckReceived(TxKey(1, 18)), 1)  # the partial push of the last two waited for it
    assert [len(push.entries) for push in pushes(effects)] == [3, 3, 3, 3, 3, 3, 2]
    entries = [entry for push in pushes(effects) for entry in push.entries]
    assert entries[0].prev == ZERO_KEY
    assert all(b.prev == a.tx_key for a, b in zip(entries, entries[1:], strict=False))


@pytest.mark.timeout(10)
def test_never_more_than_window_entries_max_unacknowledged_and_an_ack_opens_the_window():
    machine = agent(build_log(50), window_entries_max=8, push_entries_max=5)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 50), True), 0)) == [TxKey(1, n) for n in range(1, 9)]
    assert machine.status().unacknowledged_entries == 8
    assert pushed_keys(machine.step(Ticked(), 10)) == []
    effects = machine.step(AckReceived(TxKey(1, 3)), 20)
    assert pushed_keys(effects) == [TxKey(1, n) for n in range(9, 12)]
    assert machine.status().unacknowledged_entries == 8
    assert machine.status().acked_key == TxKey(1, 3)


@pytest.mark.timeout(10)
def test_an_idle_agent_heartbeats_every_heartbeat_interval_ms():
    machine = agent(build_log(2), heartbeat_interval_ms=100)
    machine.step(CommittedAdvanced(TxKey(1, 2), True), 0)
    machine.step(AckReceived(TxKey(1, 2)), 5)
    assert machine.step(Ticked(), 99) == []
    assert machine.next_deadline_ms() == 100
    assert machine.step(Ticked(), 100) == [Push((), TxKey(1, 2), True)]
    assert machine.step(Ticked(), 150) == []
    assert machine.step(Ticked(), 200) == [Push((), TxKey(1, 2), True)]


@pytest.mark.timeout(10)
def test_the_first_tick_sends_a_heartbeat_so_that_the_replica_hears_the_new_agent_at_once():
    machine = agent(build_log(0), start=ZERO_KEY)
    assert machine.step(Ticked(), 0) == [Push((), ZERO_KEY, False)]


@pytest.mark.timeout(10)
def test_a_change_of_hears_sequencer_is_sent_at_once():
    machine = agent(build_log(3))
    machine.step(CommittedAdvanced(TxKey(1, 3), True), 0)
    machine.step(AckReceived(TxKey(1, 3)), 1)
    assert machine.step(CommittedAdvanced(TxKey(1, 3), False), 2) == [Push((), TxKey(1, 3), False)]
    assert machine.step(CommittedAdvanced(TxKey(1, 3), False), 3) == []


@pytest.mark.timeout(10)
def test_a_lower_committed_key_is_ignored():
    machine = agent(build_log(5))
    machine.step(CommittedAdvanced(TxKey(1, 5), True), 0)
    machine.step(CommittedAdvanced(TxKey(1, 2), True), 1)
    assert machine.status().committed_key == TxKey(1, 5)


@pytest.mark.timeout(10)
def test_a_position_trimmed_from_the_log_stops_the_agent_for_a_bootstrap():
    log = build_log(10)
    log.trim_to(TxKey(1, 4))
    machine = agent(log, start=TxKey(1, 2))
    effects = machine.step(CommittedAdvanced(TxKey(1, 10), True), 0)
    assert effects == [AgentStopped(STOPPED_TRIMMED)]
    assert machine.stopped and machine.status().mode is AgentMode.STOPPED
    assert machine.step(Ticked(), 1000) == []


@pytest.mark.timeout(10)
def test_a_position_at_the_trimmed_key_is_still_served():
    log = build_log(10)
    log.trim_to(TxKey(1, 4))
    machine = agent(log, start=TxKey(1, 4))
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 6), True), 0)) == [TxKey(1, 5), TxKey(1, 6)]


@pytest.mark.timeout(10)
def test_a_resend_below_the_trimmed_key_stops_the_agent():
    log = build_log(10)
    machine = agent(log, heartbeat_interval_ms=100)
    machine.step(CommittedAdvanced(TxKey(1, 10), True), 0)
    machine.step(AckReceived(TxKey(1, 2)), 1)
    log.trim_to(TxKey(1, 5))
    # The replica says it is still at (1, 2): the entries it lacks are gone.
    assert machine.step(AckReceived(TxKey(1, 2)), 200) == [AgentStopped(STOPPED_TRIMMED)]


@pytest.mark.timeout(10)
def test_a_rejected_agent_stops_and_pushes_nothing_more():
    machine = agent(build_log(5))
    effects = machine.step(RejectReceived("not the watched agent"), 0)
    assert effects == [AgentStopped("rejected by the replicant: not the watched agent")]
    assert machine.step(CommittedAdvanced(TxKey(1, 5), True), 1) == []
    assert machine.step(Ticked(), 10_000) == []


@pytest.mark.timeout(10)
def test_an_ack_beyond_anything_pushed_stops_the_agent():
    machine = agent(build_log(5))
    machine.step(CommittedAdvanced(TxKey(1, 2), True), 0)
    effects = machine.step(AckReceived(TxKey(1, 4)), 1)
    assert len(effects) == 1 and isinstance(effects[0], AgentStopped)
    assert "beyond the last pushed key" in effects[0].reason


@pytest.mark.timeout(10)
def test_an_ack_that_does_not_advance_resends_from_the_acknowledged_key_at_most_once_per_interval():
    machine = agent(build_log(6), heartbeat_interval_ms=100)
    machine.step(CommittedAdvanced(TxKey(1, 6), True), 0)
    machine.step(AckReceived(TxKey(1, 2)), 10)
    # Soon after the push, an ack that does not advance may answer an earlier push or heartbeat.
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 2)), 20)) == []
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 2)), 100)) == [TxKey(1, n) for n in range(3, 7)]
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 2)), 110)) == []
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 2)), 200)) == [TxKey(1, n) for n in range(3, 7)]
    # A late ack of a push sent before the resend is accepted.
    machine.step(AckReceived(TxKey(1, 6)), 210)
    assert machine.status().acked_key == TxKey(1, 6) and machine.status().unacknowledged_entries == 0


@pytest.mark.timeout(10)
def test_the_late_ack_of_a_heartbeat_sent_before_a_push_does_not_resend_it():
    """Regression: a replica acknowledges every push and heartbeat with its position, so the ack of a
    heartbeat can arrive just after the agent pushed new entries; it did not advance, and the agent
    took it for a lost push and pushed the same entries again (a duplicate on the wire and a
    window's bytes the node's budget no longer counted)."""
    machine = agent(build_log(3), heartbeat_interval_ms=100)
    assert [push.entries for push in pushes(machine.step(CommittedAdvanced(ZERO_KEY, True), 0))] == [()]
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 2), True), 10)) == [TxKey(1, 1), TxKey(1, 2)]
    assert pushed_keys(machine.step(AckReceived(ZERO_KEY), 11)) == []  # the heartbeat's ack
    assert machine.status().unacknowledged_entries == 2
    # The push's own ack comes next; a push really lost is resent at the heartbeat's ack after it.
    machine.step(AckReceived(TxKey(1, 2)), 12)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 3), True), 20)) == [TxKey(1, 3)]
    assert [push.entries for push in pushes(machine.step(Ticked(), 120))] == [()]
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 2)), 121)) == [TxKey(1, 3)]


@pytest.mark.timeout(10)
def test_pushes_the_driver_dropped_are_resent_from_the_acknowledged_key_at_once():
    """The driver closed the socket to the replicant's endpoint, and with it every push queued there:
    the window empties and the agent pushes again after the acknowledged key, without waiting for a
    heartbeat's acknowledgement to show the loss."""
    machine = agent(build_log(10), push_entries_max=4, pushes_in_flight_max=10)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 10), True), 0)) == [TxKey(1, n) for n in range(1, 11)]
    machine.step(AckReceived(TxKey(1, 4)), 1)
    effects = machine.step(PushesDropped(), 2, push_bytes_max=0)
    assert effects == [] and machine.status().unacknowledged_entries == 0 and machine.unacknowledged_bytes == 0
    assert machine.wants_to_push and machine.next_deadline_ms() == 2
    assert pushed_keys(machine.step(Ticked(), 2)) == [TxKey(1, n) for n in range(5, 11)]
    assert machine.status().acked_key == TxKey(1, 4) and machine.status().unacknowledged_entries == 6


@pytest.mark.timeout(10)
def test_no_ack_for_ack_timeout_ms_stops_the_agent():
    machine = agent(
        build_log(5), window_entries_max=2, push_entries_max=1, ack_timeout_ms=1000, heartbeat_interval_ms=100
    )
    machine.step(CommittedAdvanced(TxKey(1, 5), True), 0)
    machine.step(AckReceived(TxKey(1, 1)), 500)
    assert not any(isinstance(e, AgentStopped) for e in machine.step(Ticked(), 1499))
    effects = machine.step(Ticked(), 1500)
    assert len(effects) == 1 and isinstance(effects[0], AgentStopped)
    assert "acknowledged nothing for 1000 ms" in effects[0].reason and "2 entries" in effects[0].reason


@pytest.mark.timeout(10)
def test_modes_go_catchup_then_switchover_then_normal_without_gap_or_duplicate():
    machine = agent(build_log(40), window_entries_max=10, push_entries_max=10, switchover_entries=15)
    assert machine.mode is AgentMode.CATCHUP
    keys = pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 40), True), 0))
    assert machine.mode is AgentMode.CATCHUP  # 30 entries ahead
    keys += pushed_keys(machine.step(AckReceived(TxKey(1, 10)), 1))
    assert machine.mode is AgentMode.CATCHUP  # 20 ahead
    keys += pushed_keys(machine.step(AckReceived(TxKey(1, 20)), 2))
    assert machine.mode is AgentMode.SWITCHOVER  # 10 ahead
    keys += pushed_keys(machine.step(AckReceived(TxKey(1, 30)), 3))
    assert machine.mode is AgentMode.NORMAL
    assert keys == [TxKey(1, n) for n in range(1, 41)]
    # Modes only move forward: new commits do not send it back to catch-up.
    machine.step(CommittedAdvanced(TxKey(1, 40), True), 4)
    assert machine.mode is AgentMode.NORMAL


@pytest.mark.timeout(10)
def test_switchover_across_generations_counts_the_entries_in_the_log():
    log = build_log(3)
    prev = log.entries[-1]
    for counter in range(1, 4):
        entry = make_entry(SHARD, TxKey(2, counter), prev.tx_key, prev.digest, ())
        log.append((entry,))
        prev = entry
    machine = agent(log, window_entries_max=2, push_entries_max=2, switchover_entries=3)
    machine.step(CommittedAdvanced(TxKey(2, 3), True), 0)
    assert machine.status().sent_key == TxKey(1, 2) and machine.mode is AgentMode.CATCHUP  # 4 ahead
    machine.step(AckReceived(TxKey(1, 1)), 1)
    assert machine.status().sent_key == TxKey(1, 3) and machine.mode is AgentMode.SWITCHOVER  # 3 ahead
    assert machine.status().lag_entries is None


@pytest.mark.timeout(10)
def test_a_log_that_does_not_continue_at_the_position_stops_the_agent():
    machine = agent(build_log(3), start=TxKey(1, 3))
    effects = machine.step(CommittedAdvanced(TxKey(1, 5), True), 0)
    assert len(effects) == 1 and isinstance(effects[0], AgentStopped)
    assert "does not continue after (1, 3)" in effects[0].reason


@pytest.mark.timeout(10)
def test_status_reports_the_lag_and_time_never_goes_backwards():
    machine = agent(build_log(10))
    machine.step(CommittedAdvanced(TxKey(1, 10), True), 5)
    machine.step(AckReceived(TxKey(1, 5)), 6)  # the first push held five; the acknowledgement lets the rest go
    status = machine.status()
    assert (status.sent_key, status.acked_key, status.lag_entries) == (TxKey(1, 10), TxKey(1, 5), 5)
    assert (status.agent_id, status.replicant, status.shard) == ("agent-1", "rep0", SHARD)
    with pytest.raises(ValueError, match="time went backwards"):
        machine.step(Ticked(), 5)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad",
    [{"window_entries_max": 0}, {"push_entries_max": -1}, {"heartbeat_interval_ms": True}, {"ack_timeout_ms": 100}],
)
def test_invalid_config_is_refused(bad):
    with pytest.raises(AgentConfigError):
        AgentConfig(**{"heartbeat_interval_ms": 500, **bad})


def build_large_log(count: int, value_bytes: int) -> MemoryLog:
    log = MemoryLog()
    prev, digest = ZERO_KEY, GENESIS_DIGEST
    for counter in range(1, count + 1):
        entry = make_entry(
            SHARD, TxKey(1, counter), prev, digest, (WriteOp("t", {"k": counter, "v": "x" * value_bytes}),)
        )
        log.append((entry,))
        prev, digest = entry.tx_key, entry.digest
    return log


@pytest.mark.timeout(10)
def test_a_push_holds_at_most_push_bytes_max_bytes_on_the_wire_and_a_large_entry_goes_alone():
    machine = agent(
        build_large_log(30, 1000),
        push_bytes_max=5000,
        window_bytes_max=100_000,
        step_bytes_max=100_000,
        pushes_in_flight_max=10,
    )
    effects = machine.step(CommittedAdvanced(TxKey(1, 30), True), 0)
    effects += machine.step(AckReceived(machine.status().sent_key), 1)  # the partial last push waited for it
    sizes = [len(msgpack.packb([e.to_wire() for e in push.entries])) for push in pushes(effects)]
    assert pushed_keys(effects) == [TxKey(1, n) for n in range(1, 31)]
    assert all(size <= 5000 for size in sizes) and max(len(push.entries) for push in pushes(effects)) == 4
    alone = agent(build_large_log(3, 10_000), push_bytes_max=5000, window_bytes_max=100_000, step_bytes_max=100_000)
    assert [len(push.entries) for push in pushes(alone.step(CommittedAdvanced(TxKey(1, 3), True), 0))] == [1, 1, 1]


@pytest.mark.timeout(10)
def test_the_window_is_bounded_in_bytes_and_acknowledgements_pace_the_catch_up():
    machine = agent(
        build_large_log(100, 1000),
        push_bytes_max=3000,
        window_bytes_max=10_000,
        step_bytes_max=100_000,
        pushes_in_flight_max=10,
    )
    first = pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 100), True), 0))
    assert first == [TxKey(1, n) for n in range(1, 10)]  # 9 entries of about 1.1 KB: the window is full
    assert machine.status().unacknowledged_bytes >= 10_000 - 1200
    assert pushed_keys(machine.step(Ticked(), 1)) == []  # nothing more until the replicant acknowledges
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 4)), 2))[0] == TxKey(1, 10)


@pytest.mark.timeout(10)
def test_a_partial_push_waits_for_the_acknowledgement_and_then_carries_every_entry_committed_meanwhile():
    machine = agent(build_log(10))
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 1), True), 0)) == [TxKey(1, 1)]  # idle: at once
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 2), True), 1)) == []
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 4), True), 2)) == []
    # Waiting for the acknowledgement is no reason to be stepped: only the heartbeat is due.
    assert machine.next_deadline_ms() == 0 + machine.config.heartbeat_interval_ms
    assert not machine.wants_to_push
    effects = machine.step(AckReceived(TxKey(1, 1)), 3)
    # One push, read in chunks of at most twice what the push holds so far (a read's rule).
    assert [len(push.entries) for push in pushes(effects)] == [3]
    assert pushed_keys(effects) == [TxKey(1, 2), TxKey(1, 3), TxKey(1, 4)]
    machine.step(AckReceived(TxKey(1, 4)), 5)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 5), True), 6)) == [TxKey(1, 5)]  # idle again


@pytest.mark.timeout(10)
def test_full_pushes_stream_with_the_window_and_partial_ones_wait_past_pushes_in_flight_max():
    machine = agent(build_log(20), push_entries_max=2, window_entries_max=6)
    effects = machine.step(CommittedAdvanced(TxKey(1, 20), True), 0)
    assert [len(push.entries) for push in pushes(effects)] == [2, 2, 2]  # the window, not the pushes in flight
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 4)), 1)) == [TxKey(1, n) for n in range(7, 11)]
    two = agent(build_log(10), pushes_in_flight_max=2)
    assert pushed_keys(two.step(CommittedAdvanced(TxKey(1, 1), True), 0)) == [TxKey(1, 1)]
    assert pushed_keys(two.step(CommittedAdvanced(TxKey(1, 2), True), 1)) == [TxKey(1, 2)]
    assert pushed_keys(two.step(CommittedAdvanced(TxKey(1, 3), True), 2)) == []
    assert pushed_keys(two.step(AckReceived(TxKey(1, 1)), 3)) == [TxKey(1, 3)]
    with pytest.raises(AgentConfigError):
        AgentConfig(pushes_in_flight_max=0)


@pytest.mark.timeout(10)
def test_a_lost_acknowledgement_holds_the_next_push_until_the_heartbeat_is_acknowledged():
    machine = agent(build_log(5), heartbeat_interval_ms=100)
    machine.step(CommittedAdvanced(TxKey(1, 1), True), 0)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 3), True), 10)) == []  # [1] in flight, its ack lost
    heartbeat = pushes(machine.step(Ticked(), 100))
    assert [push.entries for push in heartbeat] == [()]
    # The replica acknowledges the heartbeat with its applied key: the push in flight arrived.
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 1)), 101)) == [TxKey(1, 2), TxKey(1, 3)]


@pytest.mark.timeout(10)
def test_one_step_pushes_at_most_step_bytes_max_and_the_next_tick_is_due_at_once():
    machine = agent(build_large_log(100, 1000), push_bytes_max=3000, window_bytes_max=1_000_000, step_bytes_max=5000)
    effects = machine.step(CommittedAdvanced(TxKey(1, 100), True), 0)
    assert len(pushed_keys(effects)) == 6  # two pushes of three entries: 5000 bytes reached
    assert machine.next_deadline_ms() == 0
    assert pushed_keys(machine.step(Ticked(), 0))[0] == TxKey(1, 7)


def test_every_frame_the_agent_server_queues_passes_the_typed_message_layer():
    """Regression: the watch answer repeated in every push was refused by the codec's depth bound on
    encode, so cores sent ``error`` frames to replicants instead of pushes and no replicant advanced."""
    from mnesite.core.agent_server import AgentServer
    from mnesite.rlog import messages
    from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION

    log = build_log(5)
    server = AgentServer("core1")
    body = {
        "shard": SHARD,
        "replicant": "rep0",
        "endpoint": "tcp://127.0.0.1:1",
        "from": [0, 0],
        "from_digest": GENESIS_DIGEST,
        "protocol": REPLICATION_PROTOCOL_VERSION,
        "watch_id": "w" * 64,
    }
    committed = log.last_key()
    answer = server.watch(typed_body("watch", body), log, committed, log.digest_at(committed), log.digest_at, True, 0)
    assert answer["watch_id"] == "w" * 64
    server.tick(10_000)
    assert server.outbox, "the new agent pushed nothing"
    for _endpoint, message in server.outbox:
        decoded = messages.decode(messages.encode(message))
        assert decoded.kind == message.kind == "push"
        assert decoded.body.watch["watch_id"] == "w" * 64


def test_the_retention_floor_waits_for_live_agents_and_forgets_stopped_ones():
    """A bootstrapping replicant's agent starts at K0; the age bound must keep K0's successors until
    the replicant acknowledged them, or the copy under writes starts over (bootstraps 3, not 1)."""
    from mnesite.core.agent_server import AgentServer
    from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION
    from mnesite.rlog.retention import keep_from_match_keys

    log = build_log(20)
    server = AgentServer("core1")
    body = {
        "shard": SHARD,
        "replicant": "rep0",
        "endpoint": "tcp://127.0.0.1:1",
        "from": [1, 4],
        "from_digest": log.digest_at(TxKey(1, 4)),
        "protocol": REPLICATION_PROTOCOL_VERSION,
        "watch_id": "w1",
    }
    committed = log.last_key()
    answer = server.watch(typed_body("watch", body), log, committed, log.digest_at(committed), log.digest_at, True, 0)
    assert server.acked_keys(SHARD) == [TxKey(1, 4)]
    assert server.acked_keys("other") == []
    followers = [TxKey(1, 19), TxKey(1, 20)]
    assert keep_from_match_keys(followers, server.acked_keys(SHARD)) == TxKey(1, 4)
    assert keep_from_match_keys(followers) == TxKey(1, 19)
    token = server.outbox[-1][1].body["token"]  # the replica read the first push (up to 1, 9 at least)
    ack = {"shard": SHARD, "agent": answer["agent"], "applied": [1, 9], "token": token}
    server.acknowledged(typed_body("push_ack", ack), 10)
    assert server.acked_keys(SHARD) == [TxKey(1, 9)]
    server.stop_shard(SHARD)
    assert keep_from_match_keys(followers, server.acked_keys(SHARD)) == TxKey(1, 19)


@pytest.mark.timeout(10)
def test_a_partial_push_waits_push_delay_ms_max_after_the_previous_push_and_then_carries_every_commit_since():
    machine = agent(build_log(10), push_delay_ms_max=20)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 1), True), 0)) == [TxKey(1, 1)]  # quiet: at once
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 1)), 2)) == []  # acknowledged, but the delay runs
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 2), True), 5)) == []
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 4), True), 12)) == []
    # The driver is told when the delay ends (the delay, not the heartbeat), and not before.
    assert machine.next_deadline_ms() == 20
    assert not machine.wants_to_push
    assert pushed_keys(machine.step(Ticked(), 19)) == []
    effects = machine.step(Ticked(), 20)
    assert [push.entries[0].tx_key for push in pushes(effects)] == [TxKey(1, 2)]
    assert pushed_keys(effects) == [TxKey(1, 2), TxKey(1, 3), TxKey(1, 4)]  # one push, in order, no gap
    # Without the acknowledgement the next partial push waits past the delay too (pushes in flight).
    machine.step(CommittedAdvanced(TxKey(1, 5), True), 30)
    assert pushed_keys(machine.step(Ticked(), 45)) == []
    assert machine.next_deadline_ms() == 20 + machine.config.heartbeat_interval_ms
    assert pushed_keys(machine.step(AckReceived(TxKey(1, 4)), 46)) == [TxKey(1, 5)]
    # A commit after a quiet spell goes at once.
    machine.step(AckReceived(TxKey(1, 5)), 47)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 6), True), 200)) == [TxKey(1, 6)]


@pytest.mark.timeout(10)
def test_a_full_push_does_not_wait_for_the_push_delay_so_a_catch_up_keeps_streaming():
    machine = agent(build_log(30), push_delay_ms_max=50, push_entries_max=5, window_entries_max=100)
    effects = machine.step(CommittedAdvanced(TxKey(1, 30), True), 0)
    # The first read takes five entries (a full push); then full pushes go, the window has room.
    assert pushed_keys(effects) == [TxKey(1, n) for n in range(1, 31)]
    assert [len(push.entries) for push in pushes(effects)] == [5] * 6


@pytest.mark.timeout(10)
def test_the_push_delay_is_zero_or_more_and_shorter_than_the_heartbeat_interval():
    assert AgentConfig(push_delay_ms_max=0).push_delay_ms_max == 0
    for bad in (-1, True, 1.5, 500, 600):
        with pytest.raises(AgentConfigError):
            AgentConfig(heartbeat_interval_ms=500, push_delay_ms_max=bad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(40))
def test_delayed_pushes_never_skip_or_reorder_entries_and_an_entry_waits_at_most_the_delay(seed: int) -> None:
    """Random commits, acknowledgements (some lost) and ticks at the agent's deadlines, as the driver
    steps it: every pushed run continues the previous one, in order, and when no acknowledgement is
    lost no committed entry waits in the agent longer than push_delay_ms_max (or than an
    acknowledgement's round trip, if that is longer)."""
    import random

    rng = random.Random(seed)
    delay_ms = rng.choice([1, 7, 20, 50])
    ack_ms_max = 3
    count = 200
    machine = agent(build_log(count), push_delay_ms_max=delay_ms, push_entries_max=rng.choice([4, 256]))
    lossy = rng.random() < 0.5
    now, committed, last_pushed = 0, 0, ZERO_KEY
    next_commit_ms = 0
    committed_at: dict[int, int] = {}
    pending_acks: list[tuple[int, TxKey]] = []
    waited_ms_max = 0
    # The new agent's first heartbeat, acknowledged at once (a late acknowledgement of it would make
    # the agent resend what it pushed meanwhile: "Retransmission", not this rule).
    assert pushes(machine.step(Ticked(), 0)) == [Push((), ZERO_KEY, False)]
    machine.step(AckReceived(ZERO_KEY), 0)
    while last_pushed < TxKey(1, count):
        # The next event: a commit, an acknowledgement or the agent's deadline, whichever is first.
        candidates = [machine.next_deadline_ms(), *(due for due, _ in pending_acks)]
        if committed < count:
            candidates.append(next_commit_ms)
        now = max(now, min(candidates))
        events = []
        if committed < count and now >= next_commit_ms:
            committed = min(count, committed + rng.choice([1, 1, 2, 9]))
            for counter in range(len(committed_at) + 1, committed + 1):
                committed_at[counter] = now
            events.append(CommittedAdvanced(TxKey(1, committed), True))
            next_commit_ms = now + rng.choice([0, 1, 2, 5, 13, 80])
        events += [AckReceived(key) for due, key in pending_acks if due <= now]
        pending_acks = [(due, key) for due, key in pending_acks if due > now]
        if now >= machine.next_deadline_ms():
            events.append(Ticked())
        for event in events:
            for push in pushes(machine.step(event, now)):
                acknowledged = last_pushed
                if push.entries:
                    # Contiguous with what was pushed before: a resend starts at or before it, never after.
                    assert push.entries[0].prev <= last_pushed
                    for before, after in zip(push.entries, push.entries[1:], strict=False):
                        assert after.prev == before.tx_key
                    if push.entries[0].prev == last_pushed:
                        for entry in push.entries:
                            waited_ms_max = max(waited_ms_max, now - committed_at[entry.tx_key.counter])
                    last_pushed = acknowledged = max(last_pushed, push.entries[-1].tx_key)
                if not (lossy and rng.random() < 0.1):
                    # In order, like one connection delivers them: never before the previous one.
                    due = max([now + rng.randint(0, ack_ms_max), *(due for due, _ in pending_acks[-1:])])
                    pending_acks.append((due, acknowledged))
        assert not machine.stopped and now < 100_000
    if not lossy:
        assert waited_ms_max <= max(delay_ms, ack_ms_max)


TOKEN_KEY = bytes(range(16))


def proving_agent(log: MemoryLog, start: TxKey = ZERO_KEY, **config) -> Agent:
    """An agent of a replicant of replication protocol 2: its acknowledgements must prove what was read."""
    return Agent("agent-1", SHARD, "rep0", start, log, AgentConfig(**config), 0, token_key=TOKEN_KEY)


@pytest.mark.timeout(10)
def test_an_acknowledgement_must_echo_a_pushed_token_and_claim_no_key_beyond_the_pushes_it_proves():
    """A push the replicant has not read still sits in zmq's queue on the core: an acknowledgement that
    does not prove it read the push must not free its bytes (nor open the window, nor count as life)."""
    machine = proving_agent(build_log(9), push_entries_max=3, pushes_in_flight_max=10)
    sent = pushes(machine.step(CommittedAdvanced(TxKey(1, 9), True), 0))
    assert [push.entries[-1].tx_key for push in sent] == [TxKey(1, 3), TxKey(1, 6), TxKey(1, 9)]
    tokens = [push.token for push in sent]
    assert all(token is not None for token in tokens) and len(set(tokens)) == 3
    held = machine.unacknowledged_bytes
    forged = tokens[1][:8] + bytes(8)  # push 2's sequence number, not its hash
    for lie in [
        AckReceived(TxKey(1, 9)),  # no token: proves nothing
        AckReceived(TxKey(1, 9), forged),
        AckReceived(TxKey(1, 9), (99).to_bytes(8, "big") + tokens[0][8:]),  # a push never sent
        AckReceived(TxKey(1, 4), tokens[0]),  # push 1 proves up to (1, 3) only
    ]:
        assert machine.step(lie, 1) == []
    status = machine.status()
    assert status.acks_refused == 4 and status.acked_key == ZERO_KEY and machine.unacknowledged_bytes == held
    assert not machine.acknowledged, "a refused acknowledgement is no sign of life"
    machine.step(AckReceived(TxKey(1, 3), tokens[0]), 2)
    assert machine.status().acked_key == TxKey(1, 3) and machine.acknowledged
    machine.step(AckReceived(TxKey(1, 9), tokens[2]), 3)  # push 3 proves pushes 1 to 3
    assert machine.status().acked_key == TxKey(1, 9) and machine.unacknowledged_bytes == 0
    assert machine.status().acks_refused == 4
    # Heartbeats carry tokens too; a replicant of protocol 1 gets none and is trusted as before.
    assert pushes(machine.step(Ticked(), 600))[0].token is not None
    old = agent(build_log(3))
    assert all(push.token is None for push in pushes(old.step(CommittedAdvanced(TxKey(1, 3), True), 0)))
    old.step(AckReceived(TxKey(1, 3)), 1)
    assert old.status().acked_key == TxKey(1, 3) and old.status().acks_refused == 0


@pytest.mark.timeout(10)
def test_a_resend_waits_for_proof_that_the_push_was_lost_not_still_queued():
    """On a slow link the first copy of a push may still sit in zmq when an acknowledgement that does
    not advance arrives: resending then piles a second copy behind the first. Only an acknowledgement
    proving a push sent after it (the replica read past it) shows it was lost."""
    machine = proving_agent(build_log(2), heartbeat_interval_ms=100)
    heartbeat = pushes(machine.step(CommittedAdvanced(ZERO_KEY, True), 0))[0]
    assert heartbeat.entries == ()
    machine.step(AckReceived(ZERO_KEY, heartbeat.token), 1)
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 2), True), 10)) == [TxKey(1, 1), TxKey(1, 2)]
    # Long after the push, acknowledgements that prove only the heartbeat before it: still queued.
    assert pushed_keys(machine.step(AckReceived(ZERO_KEY, heartbeat.token), 200)) == []
    assert pushed_keys(machine.step(AckReceived(ZERO_KEY, heartbeat.token), 400)) == []
    assert machine.status().unacknowledged_entries == 2
    # The heartbeat after the push is read and the position did not move: the push was lost.
    later = [push for push in pushes(machine.step(Ticked(), 400)) if not push.entries]
    assert later, "a heartbeat is due a heartbeat interval after the push"
    assert pushed_keys(machine.step(AckReceived(ZERO_KEY, later[0].token), 401)) == [TxKey(1, 1), TxKey(1, 2)]


def read_over_a_link(
    machine: Agent, log: MemoryLog, read_ms, until_ms: int, apply_every_ms: int | None = 0
) -> tuple[TxKey, int | None, str]:
    """Drive ``machine`` (ticked when due) with a replica that reads each push, in order, at
    ``read_ms(send_ms, previous_read_ms)`` and acknowledges it at once with its applied key and the
    push's token. It applies what it read at once (``apply_every_ms`` 0), one entry every
    ``apply_every_ms``, or nothing (None: stuck at its first key), skipping duplicates. Returns the
    replica's applied key, when the agent stopped (None: it did not) and why."""
    queue: deque[tuple[int, Push]] = deque()
    received: dict[TxKey, TxKey] = {}  # prev -> key of each entry read
    applied, previous_read_ms, next_apply_ms = ZERO_KEY, 0, 0

    def apply(now_ms: int) -> None:
        nonlocal applied, next_apply_ms
        while apply_every_ms is not None and now_ms >= next_apply_ms and applied in received:
            applied, next_apply_ms = received[applied], now_ms + apply_every_ms

    def run(effects, now_ms):
        for effect in effects:
            if isinstance(effect, AgentStopped):
                return effect.reason
            queue.append((now_ms, effect))
        return None

    stopped = run(machine.step(CommittedAdvanced(log.last_key(), True), 0), 0)
    for now in range(0, until_ms, 10):
        while stopped is None and queue and read_ms(queue[0][0], previous_read_ms) <= now:
            send_ms, push = queue.popleft()
            previous_read_ms = read_ms(send_ms, previous_read_ms)
            for entry in push.entries:
                received.setdefault(entry.prev, entry.tx_key)
            apply(now)
            stopped = run(machine.step(AckReceived(applied, push.token), now), now)
        apply(now)
        if stopped is None and now >= machine.next_deadline_ms():
            stopped = run(machine.step(Ticked(), now), now)
        if stopped is not None:
            return applied, now, stopped
    return applied, None, ""


@pytest.mark.timeout(10)
def test_a_replicant_that_reads_no_push_for_ack_timeout_ms_after_it_was_sent_stops_its_agent():
    """A replicant reading its queue slowly acknowledges every push it reads, each proving a push sent
    long ago, while the pushes behind it wait in zmq on the core and the agent holds its window: its
    acknowledgements must not keep it live. The oldest push not proven read times out."""
    log = build_log(200)
    machine = proving_agent(
        log, window_entries_max=10, push_entries_max=5, heartbeat_interval_ms=100, ack_timeout_ms=1000
    )
    # One push read every 300 ms, while a heartbeat is queued every 100 ms: the queue only grows.
    applied, stopped_ms, reason = read_over_a_link(machine, log, lambda sent, last: max(sent, last + 300), 10_000)
    assert stopped_ms is not None, "acknowledging every 300 ms kept a replicant that falls ever further behind live"
    assert "read no push for 1000 ms after it was sent" in reason
    assert stopped_ms <= 3_000 and applied < TxKey(1, 200)


@pytest.mark.timeout(10)
def test_a_catch_up_over_a_slow_link_proves_recent_pushes_and_keeps_going():
    """A replica behind a slow link reads every push some time after it was sent, but that time stays
    under ack_timeout_ms: it proves recent pushes, and its catch-up goes on for many timeouts."""
    log = build_log(300)
    machine = proving_agent(
        log, window_entries_max=10, push_entries_max=5, heartbeat_interval_ms=100, ack_timeout_ms=1000
    )
    applied, stopped_ms, reason = read_over_a_link(machine, log, lambda sent, last: max(sent + 900, last), 60_000)
    assert stopped_ms is None, reason
    assert applied == TxKey(1, 300)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("dropped", [False, True])
def test_pushes_the_driver_dropped_can_never_be_read_and_are_not_waited_for(dropped):
    machine = proving_agent(build_log(3), heartbeat_interval_ms=100, ack_timeout_ms=1000)
    first = pushes(machine.step(CommittedAdvanced(TxKey(1, 3), True), 0))
    machine.step(AckReceived(TxKey(1, 3), first[-1].token), 0)
    heartbeats = [push for now in range(100, 900, 100) for push in pushes(machine.step(Ticked(), now))]
    machine.step(AckReceived(TxKey(1, 3), heartbeats[0].token), 800)  # read the heartbeat of 100 ms only
    if dropped:
        machine.step(PushesDropped(), 850)  # the driver closed the socket: the heartbeats queued there are gone
    machine.step(Ticked(), 900)
    effects = machine.step(Ticked(), 1200)
    if not dropped:
        # The heartbeat of 200 ms waits unread for 1000 ms, though the replicant acknowledged at 800 ms.
        assert len(effects) == 1 and "read no push for 1000 ms after it was sent" in effects[0].reason
        return
    assert not any(isinstance(effect, AgentStopped) for effect in effects)
    # The acknowledgement timeout still holds: nothing acknowledged since 800 ms.
    effects = machine.step(Ticked(), 1800)
    assert len(effects) == 1 and "acknowledged nothing for 1000 ms" in effects[0].reason


@pytest.mark.timeout(10)
def test_after_pushes_dropped_a_token_proves_only_what_the_pushes_since_carried():
    """Regression: the proofs of the pushes the driver dropped stayed, so the token of a push sent after
    the drop (carrying fewer keys) proved the higher last key of a dropped push that never arrived: a
    replicant acknowledged keys it never received, and the agent never pushed them again."""
    machine = proving_agent(build_log(20), push_entries_max=10, pushes_in_flight_max=10)
    dropped = pushes(machine.step(CommittedAdvanced(TxKey(1, 20), True), 0))
    assert [push.entries[-1].tx_key for push in dropped] == [TxKey(1, 10), TxKey(1, 20)]
    machine.step(PushesDropped(), 1, push_bytes_max=0)  # neither push arrived
    resent = pushes(machine.step(Ticked(), 2, push_bytes_max=1))  # one push in this step
    assert [push.entries[-1].tx_key for push in resent] == [TxKey(1, 10)]
    assert machine.step(AckReceived(TxKey(1, 20), resent[0].token), 3) == []
    status = machine.status()
    assert status.acks_refused == 1 and status.acked_key == ZERO_KEY and not machine.acknowledged
    # A dropped push's own token proves no more: it can never be read.
    machine.step(AckReceived(TxKey(1, 20), dropped[-1].token), 3)
    assert machine.status().acks_refused == 2 and machine.status().acked_key == ZERO_KEY
    machine.step(AckReceived(TxKey(1, 10), resent[0].token), 4)
    assert machine.status().acked_key == TxKey(1, 10) and machine.status().acks_refused == 2
    # Proven before the drop stays proven.
    machine = proving_agent(build_log(20), push_entries_max=10, pushes_in_flight_max=10)
    first = pushes(machine.step(CommittedAdvanced(TxKey(1, 20), True), 0))
    machine.step(AckReceived(TxKey(1, 5), first[-1].token), 1)  # read both, applied five entries
    machine.step(PushesDropped(), 2, push_bytes_max=0)
    heartbeat = pushes(machine.step(Ticked(), 600, push_bytes_max=0))
    assert heartbeat and heartbeat[0].entries == ()
    machine.step(AckReceived(TxKey(1, 20), heartbeat[0].token), 601)
    assert machine.status().acked_key == TxKey(1, 20) and machine.status().acks_refused == 0


@pytest.mark.timeout(10)
def test_a_replica_that_read_pushes_before_a_drop_proves_their_keys_with_the_resend():
    """A replica that read pushes just before the driver dropped the rest, its acknowledgement not come
    yet, holds keys only pushes sent after the drop can prove now: the agent pushes again up to its
    highest key at once, or the partial push would wait for an acknowledgement it must refuse."""
    machine = proving_agent(build_log(7), push_entries_max=4, heartbeat_interval_ms=100, ack_timeout_ms=1000)
    sent = pushes(machine.step(CommittedAdvanced(TxKey(1, 2), True), 0))
    sent += pushes(machine.step(CommittedAdvanced(TxKey(1, 6), True), 1))  # a full push goes at once
    sent += pushes(machine.step(CommittedAdvanced(TxKey(1, 7), True), 2))  # a partial one waits
    assert [push.entries[-1].tx_key for push in sent] == [TxKey(1, 2), TxKey(1, 6)]
    holds = TxKey(1, 6)  # the replica read both; its acknowledgement is not here when the socket closes
    machine.step(PushesDropped(), 3, push_bytes_max=0)
    resent = pushes(machine.step(Ticked(), 3))
    assert [push.entries[-1].tx_key for push in resent] == [TxKey(1, 4), TxKey(1, 7)]
    machine.step(AckReceived(holds, resent[-1].token), 4)  # one acknowledgement for the turn's reads
    assert machine.status().acked_key == holds and machine.status().acks_refused == 0
    machine.step(AckReceived(TxKey(1, 7), resent[-1].token), 5)
    assert machine.status().acked_key == TxKey(1, 7) and machine.status().unacknowledged_entries == 0
    # The resend done, a partial push waits for the pushes in flight again.
    machine = proving_agent(build_log(9), push_entries_max=4)
    machine.step(CommittedAdvanced(TxKey(1, 2), True), 0)
    machine.step(PushesDropped(), 1, push_bytes_max=0)
    assert pushed_keys(machine.step(Ticked(), 1)) == [TxKey(1, 1), TxKey(1, 2)]
    assert pushed_keys(machine.step(CommittedAdvanced(TxKey(1, 3), True), 2)) == []


def test_progress_is_an_acknowledgement_that_advances_or_finds_nothing_unacknowledged():
    """``last_progress_ms`` (the memory budget's and ``watches_max``'s liveness): an acknowledgement
    that re-acknowledges an old key while pushes wait is no progress, though it arrives."""
    machine = agent(build_log(10), push_entries_max=3, window_entries_max=3, now_ms=5)
    machine.step(CommittedAdvanced(TxKey(1, 10), True), 10)
    assert machine.last_progress_ms == 5  # its creation: no acknowledgement yet
    machine.step(AckReceived(TxKey(1, 3)), 20)
    assert machine.last_progress_ms == 20 and machine.status().unacknowledged_entries == 3
    for now_ms in (30, 40, 50):
        machine.step(AckReceived(TxKey(1, 3)), now_ms)  # stuck: the same key while three entries wait
    assert machine.last_progress_ms == 20 and machine.last_ack_ms == 50
    while machine.status().acked_key < TxKey(1, 10):
        machine.step(AckReceived(machine.status().sent_key), 60)
    machine.step(AckReceived(TxKey(1, 10)), 70)  # caught up: the same key, nothing unacknowledged
    assert machine.last_progress_ms == 70


def at_once(send_ms: int, previous_read_ms: int) -> int:
    """A replica that reads each push as soon as it is sent (``read_over_a_link``'s ``read_ms``)."""
    return max(send_ms, previous_read_ms)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("tokens", [True, False])
def test_a_replicant_that_keeps_acknowledging_an_old_key_stops_its_agent_after_ack_timeout_ms(tokens):
    """Regression: a replicant that reads every push (its tokens valid) but acknowledges the same old
    key made its agent resend its whole window every heartbeat, for ever: its acknowledgements kept the
    acknowledgement timeout from firing and it read every push in time, so only the node's memory
    budget could evict it. No progress (``last_progress_ms``) for ack_timeout_ms stops it now."""
    log = build_log(50)
    config = {"window_entries_max": 10, "push_entries_max": 5, "heartbeat_interval_ms": 100, "ack_timeout_ms": 1000}
    machine = proving_agent(log, **config) if tokens else agent(log, **config)
    applied, stopped_ms, reason = read_over_a_link(machine, log, at_once, 10_000, apply_every_ms=None)
    assert stopped_ms is not None, "an agent resent its window every heartbeat for 10 s to a stuck replicant"
    assert 1000 <= stopped_ms <= 1100 and applied == ZERO_KEY
    assert "made no progress for 1000 ms" in reason and f"acknowledges {ZERO_KEY} again" in reason
    assert machine.status().acks_refused == 0, "the acknowledgements were valid ones"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("tokens", [True, False])
def test_a_caught_up_replicant_and_a_slow_catch_up_are_never_stopped_for_want_of_progress(tokens):
    """A caught-up replica acknowledges each heartbeat with the key it has (nothing unacknowledged:
    progress), and one that applies an entry every 900 ms advances its key within every ack timeout,
    though most of its acknowledgements (of heartbeats, of resends) repeat the key."""
    config = {"window_entries_max": 10, "push_entries_max": 5, "heartbeat_interval_ms": 100, "ack_timeout_ms": 1000}
    log = build_log(3)
    machine = proving_agent(log, **config) if tokens else agent(log, **config)
    applied, stopped_ms, reason = read_over_a_link(machine, log, at_once, 20_000)
    assert stopped_ms is None, reason
    assert applied == TxKey(1, 3) and machine.mode is AgentMode.NORMAL
    log = build_log(20)
    machine = proving_agent(log, **config) if tokens else agent(log, **config)
    applied, stopped_ms, reason = read_over_a_link(machine, log, at_once, 20_000, apply_every_ms=900)
    assert stopped_ms is None, reason
    assert applied == TxKey(1, 20)
