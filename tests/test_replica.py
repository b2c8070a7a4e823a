"""replicant.replica.ShardReplica, sentence by sentence of its theory of operation."""

from __future__ import annotations

import random

import pytest
from mnesite.replicant.replica import ReplicaConfig, ReplicaConfigError, ShardReplica, SpillBudget
from mnesite.rlog.replication import (
    UNKNOWN_DIGEST,
    ApplyBatch,
    ApplyEntries,
    BatchReceived,
    CommittedReceived,
    FetchBatch,
    FetchCommitted,
    FetchTables,
    JournalAnswer,
    JournalsReceived,
    Mode,
    ModeChanged,
    ProbeJournals,
    PushReceived,
    ReadFenceChanged,
    ReplaySpill,
    RequestFailed,
    ResetShard,
    SendAck,
    SendReject,
    SendWatch,
    SpillEntries,
    TablesReceived,
    Ticked,
    WatchAccepted,
    WatchRefused,
)
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, ClusterVersionOp, Entry, TxKey, WriteOp, make_entry
from mnesite.rlog.versions import THIS_RELEASE

SHARD = "main"
CORES = ("core0", "core1", "core2")


def chain(count: int, after: Entry | None = None, generation: int = 1, value: str = "v") -> list[Entry]:
    prev = after.tx_key if after else ZERO_KEY
    digest = after.digest if after else GENESIS_DIGEST
    start = prev.counter + 1 if after is not None and prev.generation == generation else 1
    entries = []
    for counter in range(start, start + count):
        entry = make_entry(SHARD, TxKey(generation, counter), prev, digest, (WriteOp("t", {"k": counter, "v": value}),))
        entries.append(entry)
        prev, digest = entry.tx_key, entry.digest
    return entries


HISTORY = chain(30)


def at(key_counter: int) -> tuple[TxKey, bytes]:
    if key_counter == 0:
        return ZERO_KEY, GENESIS_DIGEST
    entry = HISTORY[key_counter - 1]
    return entry.tx_key, entry.digest


def replica(applied: int = 0, now_ms: int = 0, seed: int = 0, **config) -> ShardReplica:
    key, digest = at(applied)
    return ShardReplica(SHARD, "rep0", CORES, key, digest, ReplicaConfig(**config), random.Random(seed), now_ms)


def ages(committed: int = 30, **overrides) -> JournalsReceived:
    values = {core: JournalAnswer(at(committed)[0], True, 0) for core in CORES}
    values.update(overrides)
    return JournalsReceived(tuple(values.items()))


def test_a_replica_says_why_no_core_qualifies_when_the_cores_answered_with_logs_it_cannot_read() -> None:
    machine = replica()
    assert of(machine.step(Ticked(), 0), ProbeJournals)
    why = "its log of shard s is at cluster version 3, which this replicant cannot read"
    unreadable = tuple((core, why) for core in CORES[1:])
    machine.step(JournalsReceived(tuple((core, None) for core in CORES), unreadable), 0)
    error = machine.status().last_error
    assert f"{CORES[0]} did not answer" in error
    assert all(f"{core} answered, but {why}" in error and f"{core} did not answer" not in error for core in CORES[1:])


def of(effects, kind) -> list:
    return [effect for effect in effects if isinstance(effect, kind)]


def push(entries, agent="a1", core="core0", committed: int = 30, hears=True) -> PushReceived:
    return PushReceived(core, agent, tuple(entries), at(committed)[0], hears)


def connect(machine: ShardReplica, now_ms: int = 0, core: str = "core0", agent: str = "a1") -> list:
    """Probe, choose ``core`` (others behind), and accept a resume watch."""
    assert of(machine.step(Ticked(), now_ms), ProbeJournals)
    journals = JournalsReceived(tuple((c, JournalAnswer(at(30)[0], True, 0) if c == core else None) for c in CORES))
    effects = machine.step(journals, now_ms)
    assert effects == [SendWatch(core, machine.applied_key, machine.applied_digest, machine.watch_id)]
    accepted = WatchAccepted(core, agent, "resume", machine.applied_key, machine.applied_digest, machine.watch_id)
    return machine.step(accepted, now_ms)


def bootstrap(machine: ShardReplica, k0: int = 10, now_ms: int = 0, core: str = "core0", agent: str = "a1") -> list:
    machine.step(Ticked(), now_ms)
    journals = JournalsReceived(tuple((c, JournalAnswer(at(30)[0], True, 0) if c == core else None) for c in CORES))
    machine.step(journals, now_ms)
    key, digest = at(k0)
    return machine.step(WatchAccepted(core, agent, "bootstrap", key, digest, machine.watch_id), now_ms)


# ---------------------------------------------------------------- finding an upstream


@pytest.mark.timeout(10)
def test_it_starts_disconnected_and_probes_every_core_on_the_first_tick():
    machine = replica()
    assert machine.mode is Mode.DISCONNECTED
    assert machine.step(Ticked(), 0) == [ProbeJournals(CORES)]
    assert machine.step(Ticked(), 1) == []  # one probe at a time


@pytest.mark.timeout(10)
def test_it_never_watches_a_core_behind_its_applied_key():
    machine = replica(applied=20)
    machine.step(Ticked(), 0)
    journals = ages(core0=JournalAnswer(at(19)[0], True, 0), core1=JournalAnswer(at(25)[0], True, 50), core2=None)
    assert machine.step(journals, 0) == [SendWatch("core1", at(20)[0], at(20)[1], machine.watch_id)]


@pytest.mark.timeout(10)
def test_when_no_core_qualifies_it_waits_retry_interval_ms_and_probes_again():
    machine = replica(applied=20, retry_interval_ms=100)
    machine.step(Ticked(), 0)
    effects = machine.step(ages(committed=5, core2=None), 0)
    assert effects == []
    status = machine.status()
    assert "no core qualifies" in status.last_error and "core0 is behind" in status.last_error
    assert "core2 did not answer" in status.last_error
    assert 100 <= machine.next_deadline_ms() <= 150
    assert machine.step(Ticked(), 99) == []
    assert machine.step(Ticked(), machine.next_deadline_ms()) == [ProbeJournals(CORES)]


@pytest.mark.timeout(10)
def test_an_unanswered_probe_gives_up_after_probe_timeout_ms_plus_failure_timeout_ms():
    machine = replica(failure_timeout_ms=1000, probe_timeout_ms=500)
    machine.step(Ticked(), 0)
    assert machine.step(Ticked(), 1499) == []
    machine.step(Ticked(), 1500)
    assert "no answer to the journals request" in machine.status().last_error


@pytest.mark.timeout(10)
def test_a_resume_goes_normal_counts_a_resume_and_serves_from_its_prefix():
    machine = replica(applied=5)
    effects = connect(machine)
    assert effects == [ModeChanged(Mode.NORMAL, "core0", "resumed from (1, 5) on core0")]
    status = machine.status()
    assert (status.mode, status.upstream, status.agent_id, status.resumes, status.bootstraps) == (
        Mode.NORMAL,
        "core0",
        "a1",
        1,
        0,
    )


@pytest.mark.timeout(10)
def test_a_resume_at_another_key_or_digest_than_its_own_is_refused():
    for start_key, start_digest in ((at(5)[0], b"x" * 32), at(4)):
        machine = replica(applied=5)
        machine.step(Ticked(), 0)
        machine.step(ages(core1=None, core2=None), 0)
        machine.step(WatchAccepted("core0", "a1", "resume", start_key, start_digest, machine.watch_id), 0)
        assert machine.mode is Mode.DISCONNECTED and machine.status().resumes == 0
        assert "with another digest" in machine.status().last_error


@pytest.mark.timeout(10)
def test_a_watch_answer_from_a_core_it_did_not_ask_is_ignored():
    machine = replica(applied=5)
    machine.step(Ticked(), 0)
    (watch,) = machine.step(ages(core1=None, core2=None), 0)
    assert watch.core == "core0"
    assert machine.step(WatchAccepted("core1", "zz", "resume", *at(5), machine.watch_id), 1) == []
    assert machine.mode is Mode.DISCONNECTED


@pytest.mark.timeout(10)
def test_a_refused_watch_disconnects_and_retries_after_a_jittered_retry_interval():
    delays = set()
    for seed in range(20):
        machine = replica(seed=seed, retry_interval_ms=200)
        machine.step(Ticked(), 0)
        (watch,) = machine.step(ages(), 0)
        machine.step(WatchRefused(watch.core, "incompatible protocol version"), 10)
        assert machine.mode is Mode.DISCONNECTED
        assert "watch refused" in machine.status().last_error
        delays.add(machine.next_deadline_ms() - 10)
    assert all(200 <= delay <= 300 for delay in delays) and len(delays) > 1


@pytest.mark.timeout(10)
def test_a_failed_request_to_the_upstream_disconnects():
    machine = replica(applied=5)
    connect(machine)
    effects = machine.step(RequestFailed("core0", "connection reset"), 1)
    assert effects == [ModeChanged(Mode.DISCONNECTED, "core0", "request to core0 failed: connection reset")]
    assert machine.step(RequestFailed("core2", "unrelated"), 2) == []


@pytest.mark.timeout(10)
def test_a_failure_of_an_earlier_attempts_request_does_not_fail_the_next_attempt_on_the_same_core():
    """The driver expires a request by its own deadline: a batch of a bootstrap that had already
    failed (its own deadline, a refused watch) could time out after the next attempt had started on
    the same core, and failed that one too (a wasted attempt, a retry delay). A RequestFailed carries
    the attempt (watch_id) its request was sent in."""
    machine = replica(applied=0)
    bootstrap(machine, k0=10)
    first_attempt = machine.watch_id
    machine.step(RequestFailed("core0", "lost", first_attempt), 1)
    assert machine.mode is Mode.DISCONNECTED
    bootstrap(machine, k0=10, now_ms=10_000)
    assert machine.mode is Mode.BOOTSTRAP and machine.watch_id != first_attempt
    assert machine.step(RequestFailed("core0", "batch timed out", first_attempt), 10_001) == []
    assert machine.mode is Mode.BOOTSTRAP
    effects = machine.step(RequestFailed("core0", "batch timed out", machine.watch_id), 10_002)
    assert machine.mode is Mode.DISCONNECTED and of(effects, ModeChanged)


# ---------------------------------------------------------------- pushes


@pytest.mark.timeout(10)
def test_a_push_that_follows_the_applied_key_is_applied_then_acknowledged():
    machine = replica(applied=5)
    connect(machine)
    effects = machine.step(push(HISTORY[5:8]), 1)
    assert effects == [ApplyEntries(tuple(HISTORY[5:8])), SendAck("core0", "a1", at(8)[0])]
    assert (machine.applied_key, machine.applied_digest) == at(8)


def with_version(after: Entry, version: int) -> list[Entry]:
    """A cluster version entry after ``after``, then one entry of rows after it."""
    entry = make_entry(
        SHARD, TxKey(1, after.tx_key.counter + 1), after.tx_key, after.digest, (ClusterVersionOp(SHARD, version),)
    )
    return [entry, *chain(1, after=entry)]


@pytest.mark.timeout(10)
def test_a_push_up_to_a_cluster_version_it_does_not_speak_is_applied_up_to_that_entry_then_it_stops_and_says_why():
    machine = replica(applied=5)
    connect(machine)
    unspoken = with_version(HISTORY[6], THIS_RELEASE.cluster_versions[1] + 1)
    effects = machine.step(push([*HISTORY[5:7], *unspoken], committed=9), 1)
    assert effects[:3] == [
        ApplyEntries(tuple(HISTORY[5:7])),
        SendAck("core0", "a1", at(7)[0]),
        SendReject("core0", "a1", "unspoken cluster version"),
    ]
    assert (machine.applied_key, machine.applied_digest) == at(7)
    assert machine.mode is Mode.DISCONNECTED
    why = machine.status().last_error
    assert f"entry {unspoken[0].tx_key}" in why and f"cluster version {THIS_RELEASE.cluster_versions[1] + 1}" in why
    assert "restart it on a release that speaks that version" in why
    # Bootstrapping: the entries before it are spilled, nothing from it on.
    machine = replica(applied=0)
    bootstrap(machine, k0=5)
    effects = machine.step(push([*HISTORY[5:7], *unspoken], committed=9), 1)
    assert of(effects, SpillEntries) == [SpillEntries(tuple(HISTORY[5:7]))]
    assert of(effects, SendReject) == [SendReject("core0", "a1", "unspoken cluster version")]
    assert machine.mode is Mode.DISCONNECTED
    # One it speaks is applied like any other entry.
    machine = replica(applied=5)
    connect(machine)
    spoken = with_version(HISTORY[6], THIS_RELEASE.cluster_versions[1])
    effects = machine.step(push([*HISTORY[5:7], *spoken], committed=9), 1)
    assert effects == [ApplyEntries((*HISTORY[5:7], *spoken)), SendAck("core0", "a1", spoken[-1].tx_key)]


@pytest.mark.timeout(10)
def test_a_push_from_another_agent_is_rejected_and_nothing_is_applied():
    machine = replica(applied=5)
    connect(machine)
    for zombie in (push(HISTORY[5:8], agent="old"), push(HISTORY[5:8], core="core1")):
        effects = machine.step(zombie, 1)
        assert effects == [SendReject(zombie.core, zombie.agent_id, "not the watched agent")]
    assert machine.applied_key == at(5)[0]


@pytest.mark.timeout(10)
def test_takes_push_says_which_pushes_the_machine_would_read_and_unread_ones_ignore_their_entries():
    """A driver decodes a push's entries only if ``takes_push``; for any other push the machine's
    answer must not depend on the entries (so an undecoded, empty push is handled the same way)."""
    machine = replica(applied=5)
    assert not machine.takes_push("core0", "a1")  # disconnected: nothing is read
    machine.step(Ticked(), 0)
    (watch,) = machine.step(ages(core1=None, core2=None), 0)
    answer = WatchAccepted(watch.core, "a1", "resume", *at(5), machine.watch_id)
    assert machine.takes_push(watch.core, "a1", answer)  # the push carrying the watch's answer
    assert not machine.takes_push(watch.core, "a1")  # the same push without the answer is dropped
    machine.step(answer, 1)
    assert machine.takes_push("core0", "a1")
    for core, agent in (("core0", "old"), ("core1", "a1")):
        assert not machine.takes_push(core, agent)
        with_entries = replica(applied=5)
        connect(with_entries)
        assert with_entries.step(push(HISTORY[5:8], agent=agent, core=core), 2) == machine.step(
            push((), agent=agent, core=core), 2
        )
    assert machine.applied_key == at(5)[0]


@pytest.mark.timeout(10)
def test_a_push_while_disconnected_is_rejected():
    machine = replica(applied=5)
    assert machine.step(push(HISTORY[5:8]), 0) == [SendReject("core0", "a1", "not the watched agent")]


@pytest.mark.timeout(10)
def test_a_push_from_the_core_being_watched_before_its_answer_is_dropped_silently():
    machine = replica(applied=5)
    machine.step(Ticked(), 0)
    (watch,) = machine.step(ages(core1=None, core2=None), 0)
    assert machine.step(push(HISTORY[5:8], core=watch.core, agent="new"), 1) == []
    assert machine.applied_key == at(5)[0]


@pytest.mark.timeout(10)
def test_duplicates_at_or_below_the_applied_key_are_skipped():
    machine = replica(applied=5)
    connect(machine)
    effects = machine.step(push(HISTORY[2:7]), 1)
    assert effects == [ApplyEntries(tuple(HISTORY[5:7])), SendAck("core0", "a1", at(7)[0])]
    assert machine.step(push(HISTORY[3:7]), 2) == [SendAck("core0", "a1", at(7)[0])]


@pytest.mark.timeout(10)
def test_a_duplicate_at_the_applied_key_with_another_digest_is_divergent_history():
    machine = replica(applied=5)
    connect(machine)
    other = chain(5, value="other")
    effects = machine.step(push(other[3:5] + HISTORY[5:6]), 1)
    assert effects[0] == SendReject("core0", "a1", "digest mismatch")
    assert not of(effects, ApplyEntries)
    assert machine.mode is Mode.DISCONNECTED and "divergent history" in machine.status().last_error


@pytest.mark.timeout(10)
def test_a_new_entry_whose_digest_does_not_chain_on_the_applied_digest_is_not_applied():
    machine = replica(applied=5)
    connect(machine)
    forged = make_entry(SHARD, TxKey(1, 6), at(5)[0], b"\x01" * 32, (WriteOp("t", {"k": 6, "v": "v"}),))
    effects = machine.step(push([forged]), 1)
    assert effects[0] == SendReject("core0", "a1", "digest mismatch")
    assert not of(effects, ApplyEntries) and machine.applied_key == at(5)[0]
    assert "does not chain" in machine.status().last_error


@pytest.mark.timeout(10)
def test_a_gap_is_never_skipped_it_rejects_the_agent_and_resynchronises():
    machine = replica(applied=5)
    connect(machine)
    effects = machine.step(push(HISTORY[6:9]), 1)
    assert effects[0] == SendReject("core0", "a1", "gap")
    assert isinstance(effects[1], ModeChanged) and effects[1].mode is Mode.DISCONNECTED
    assert not of(effects, ApplyEntries) and machine.applied_key == at(5)[0]
    # It resumes from the same applied key on the next watch.
    machine.step(Ticked(), machine.next_deadline_ms())
    assert machine.step(ages(), machine.next_deadline_ms())[0].from_key == at(5)[0]


@pytest.mark.timeout(10)
def test_entries_out_of_order_or_beyond_the_committed_key_or_of_another_shard_are_refused():
    for entries, committed in (
        ([HISTORY[6], HISTORY[5]], 30),
        (HISTORY[5:8], 6),
        ([make_entry("other", TxKey(1, 6), *at(5), ())], 30),
    ):
        machine = replica(applied=5)
        connect(machine)
        effects = machine.step(push(entries, committed=committed), 1)
        assert isinstance(effects[0], SendReject) and not of(effects, ApplyEntries)
        assert machine.mode is Mode.DISCONNECTED


@pytest.mark.timeout(10)
def test_a_heartbeat_updates_the_committed_key_and_is_acknowledged():
    machine = replica(applied=5)
    connect(machine)
    assert machine.step(push([], committed=12), 100) == [SendAck("core0", "a1", at(5)[0])]
    status = machine.status()
    assert status.committed_key == at(12)[0] and status.lag_entries == 7 and status.hears_sequencer


@pytest.mark.timeout(10)
def test_without_an_upstream_the_committed_key_and_the_lag_are_unknown():
    """Regression: a disconnected replica's status kept its old upstream's committed key and lag."""
    machine = replica(applied=5, failure_timeout_ms=1000)
    connect(machine)
    machine.step(push([], committed=12), 100)
    machine.step(Ticked(), 1100)
    status = machine.status()
    assert status.mode is Mode.DISCONNECTED and status.upstream is None
    assert (status.committed_key, status.lag_entries) == (None, None)


# ---------------------------------------------------------------- failure detector and failover


@pytest.mark.timeout(10)
def test_no_push_or_heartbeat_within_failure_timeout_ms_fails_over_to_another_core_from_the_applied_key():
    machine = replica(applied=5, failure_timeout_ms=1000)
    connect(machine, core="core0")
    machine.step(push(HISTORY[5:6]), 500)
    assert machine.next_deadline_ms() == 1500
    assert machine.step(Ticked(), 1499) == []
    effects = machine.step(Ticked(), 1500)
    assert effects == [ModeChanged(Mode.DISCONNECTED, "core0", "no push or heartbeat from core0 for 1000 ms")]
    machine.step(Ticked(), machine.next_deadline_ms())
    # core0 answers too and is the least loaded, but the replica moves on to another qualifying core.
    journals = ages(core0=JournalAnswer(at(30)[0], True, 0), core1=JournalAnswer(at(30)[0], True, 5), core2=None)
    assert machine.step(journals, machine.next_deadline_ms()) == [SendWatch("core1", *at(6), machine.watch_id)]


@pytest.mark.timeout(10)
def test_failover_never_goes_to_a_core_behind_even_if_it_is_the_only_other_one():
    machine = replica(applied=5, failure_timeout_ms=1000)
    connect(machine, core="core0")
    machine.step(push(HISTORY[5:10]), 10)
    machine.step(Ticked(), 1010)
    assert machine.mode is Mode.DISCONNECTED
    machine.step(Ticked(), machine.next_deadline_ms())
    journals = ages(core0=None, core1=JournalAnswer(at(9)[0], True, 0), core2=JournalAnswer(at(3)[0], True, 0))
    assert machine.step(journals, machine.next_deadline_ms()) == []
    assert "core1 is behind" in machine.status().last_error


@pytest.mark.timeout(10)
def test_an_upstream_that_does_not_hear_the_sequencer_for_failure_timeout_ms_is_left():
    machine = replica(applied=5, failure_timeout_ms=1000)
    connect(machine)
    machine.step(push([], hears=False), 100)
    machine.step(push([], hears=False), 900)
    assert machine.mode is Mode.NORMAL
    machine.step(push([], hears=False), 1099)
    assert machine.mode is Mode.NORMAL
    effects = machine.step(Ticked(), 1100)
    assert effects == [ModeChanged(Mode.DISCONNECTED, "core0", "core0 has not heard the sequencer for 1000 ms")]


@pytest.mark.timeout(10)
def test_hearing_the_sequencer_again_resets_the_detector():
    machine = replica(applied=5, failure_timeout_ms=1000)
    connect(machine)
    machine.step(push([], hears=False), 100)
    machine.step(push([], hears=True), 900)
    machine.step(push([], hears=False), 1000)
    machine.step(Ticked(), 1500)
    assert machine.mode is Mode.NORMAL


@pytest.mark.timeout(10)
def test_after_a_watch_hears_sequencer_is_what_the_chosen_core_reported_until_its_first_push():
    """Regression: a watch's answer set ``hears_sequencer`` true even when the chosen core had said in
    its journal answer that it hears no sequencer (it is chosen when no core hears one): status was
    wrong until the first heartbeat, and the detector started only then."""

    def connected_to_a_deaf_core() -> tuple[ShardReplica, str]:
        machine = replica(applied=5, failure_timeout_ms=1000)
        machine.step(Ticked(), 0)
        deaf = JournalAnswer(at(30)[0], False, 0)
        (watch,) = of(machine.step(JournalsReceived(tuple((core, deaf) for core in CORES)), 0), SendWatch)
        machine.step(WatchAccepted(watch.core, "a1", "resume", *at(5), machine.watch_id), 10)
        assert machine.mode is Mode.NORMAL and not machine.status().hears_sequencer
        return machine, watch.core

    machine, core = connected_to_a_deaf_core()
    machine.step(push([], core=core, hears=True), 20)
    assert machine.status().hears_sequencer
    machine, core = connected_to_a_deaf_core()
    machine.step(push([], core=core, hears=False), 500)
    machine.step(Ticked(), 1010)  # not hearing since the watch's answer, at 10
    assert machine.status().last_error == f"{core} has not heard the sequencer for 1000 ms"


# ---------------------------------------------------------------- bootstrap


@pytest.mark.timeout(10)
def test_bootstrap_stages_run_in_order_reset_tables_batches_replay_then_normal():
    machine = replica(applied=0, batch_rows_max=2)
    effects = bootstrap(machine, k0=10)
    assert effects == [
        ModeChanged(Mode.BOOTSTRAP, "core0", "bootstrapping from core0 at (1, 10)"),
        ReadFenceChanged(True),
        ResetShard(),
        FetchTables("core0"),
    ]
    assert machine.status().bootstraps == 1 and machine.applied_digest == UNKNOWN_DIGEST
    effects = machine.step(TablesReceived("core0", ("t", "u"), ("k", "id")), 1)
    assert effects == [FetchBatch("core0", "t", None, 2)]
    rows = ({"k": 1, "v": "a"}, {"k": 2, "v": "b"})
    effects = machine.step(BatchReceived("core0", "t", None, rows, False), 2)
    assert effects == [FetchBatch("core0", "t", 2, 2), ApplyBatch("t", rows)]
    effects = machine.step(BatchReceived("core0", "t", 2, ({"k": 3, "v": "c"},), True), 3)
    assert effects == [FetchBatch("core0", "u", None, 2), ApplyBatch("t", ({"k": 3, "v": "c"},))]
    # A pushed entry during the copy is spilled and acknowledged with the spilled key.
    effects = machine.step(push(HISTORY[10:12]), 4)
    assert effects == [SpillEntries(tuple(HISTORY[10:12])), SendAck("core0", "a1", at(12)[0])]
    assert machine.applied_key == ZERO_KEY  # nothing applied yet
    effects = machine.step(BatchReceived("core0", "u", None, (), True), 5)
    assert effects == [
        ModeChanged(Mode.LOCAL_REPLAY, "core0", "tables copied; replaying 2 spilled entries"),
        ReplaySpill(*at(10)),
        ModeChanged(Mode.NORMAL, "core0", "bootstrap done at (1, 12)"),
        SendAck("core0", "a1", at(12)[0]),
        FetchCommitted("core0", 1),
    ]
    assert (machine.applied_key, machine.applied_digest) == at(12)
    status = machine.status()
    assert (status.rows_copied, status.entries_spilled, status.bootstraps, status.resumes) == (3, 2, 1, 0)
    # Then pushes apply normally from the replayed position.
    assert of(machine.step(push(HISTORY[12:13]), 6), ApplyEntries) == [ApplyEntries((HISTORY[12],))]


@pytest.mark.timeout(10)
def test_a_bootstrap_without_pushes_ends_at_k0_and_without_tables_at_once():
    machine = replica(applied=0)
    bootstrap(machine, k0=7)
    effects = machine.step(TablesReceived("core0", (), ()), 1)
    assert effects[1] == ReplaySpill(*at(7))
    assert (machine.mode, machine.applied_key, machine.applied_digest) == (Mode.NORMAL, *at(7))


@pytest.mark.timeout(10)
def test_a_bootstrap_while_holding_data_keeps_the_applied_key_as_a_floor():
    machine = replica(applied=5)
    bootstrap(machine, k0=10)
    assert machine.applied_key == at(5)[0] and machine.applied_digest == UNKNOWN_DIGEST
    machine.step(RequestFailed("core0", "gone"), 1)
    machine.step(Ticked(), machine.next_deadline_ms())
    # A core behind the floor never qualifies, and the watch asks for a bootstrap with the unknown digest.
    journals = ages(core0=JournalAnswer(at(4)[0], True, 0), core1=JournalAnswer(at(20)[0], True, 9), core2=None)
    effects = machine.step(journals, machine.next_deadline_ms())
    assert effects == [SendWatch("core1", at(5)[0], UNKNOWN_DIGEST, machine.watch_id)]


@pytest.mark.timeout(10)
def test_a_bootstrap_behind_the_applied_key_is_refused():
    machine = replica(applied=12)
    machine.step(Ticked(), 0)
    machine.step(ages(core1=None, core2=None), 0)
    machine.step(WatchAccepted("core0", "a1", "bootstrap", *at(10), machine.watch_id), 0)
    assert machine.mode is Mode.DISCONNECTED and machine.status().bootstraps == 0
    assert "behind" in machine.status().last_error


@pytest.mark.timeout(10)
def test_pushes_during_bootstrap_are_checked_for_gaps_and_digests_from_k0():
    machine = replica(applied=0)
    bootstrap(machine, k0=10)
    effects = machine.step(push(HISTORY[11:13]), 1)
    assert effects[0] == SendReject("core0", "a1", "gap") and not of(effects, SpillEntries)
    assert machine.mode is Mode.DISCONNECTED
    machine = replica(applied=0)
    bootstrap(machine, k0=10)
    forged = chain(11, value="forged")[10:11]
    effects = machine.step(push(forged), 1)
    assert effects[0] == SendReject("core0", "a1", "digest mismatch") and not of(effects, SpillEntries)


@pytest.mark.timeout(10)
def test_the_spill_is_bounded_then_the_agent_is_released_and_the_replica_resynchronises_after_replay():
    machine = replica(applied=0, spill_entries_max=3, failure_timeout_ms=1000)
    bootstrap(machine, k0=10)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 1)
    assert machine.step(push(HISTORY[10:12]), 2) == [
        SpillEntries(tuple(HISTORY[10:12])),
        SendAck("core0", "a1", at(12)[0]),
    ]
    effects = machine.step(push(HISTORY[12:15]), 3)
    assert effects == [SpillEntries((HISTORY[12],)), SendReject("core0", "a1", "resynchronise")]
    assert "spill full" in machine.status().last_error and "released" in machine.status().last_error
    assert machine.step(push(HISTORY[13:16]), 4) == []  # in flight from the released agent: dropped
    assert machine.step(push([]), 5) == []
    assert machine.status().entries_spilled == 3
    # The released agent's silence fails nothing; only the copy's own request deadline counts.
    assert machine.next_deadline_ms() == 1 + 1000
    assert machine.step(Ticked(), 1000) == [] and machine.mode is Mode.BOOTSTRAP
    effects = machine.step(BatchReceived("core0", "t", None, (), True), 1000)
    assert effects[1] == ReplaySpill(*at(10))
    assert not of(effects, SendAck) and not of(effects, SendReject)
    assert machine.mode is Mode.DISCONNECTED and machine.applied_key == at(13)[0]
    assert machine.status().bootstraps == 1 and machine.status().bootstrap_failures_in_a_row == 0
    assert machine.step(Ticked(), 1000) == [ProbeJournals(CORES)]


@pytest.mark.timeout(10)
def test_the_spill_is_bounded_in_bytes_too():
    """The spill is on disk, one per bootstrapping shard: bounded by count only, 100,000 entries of up
    to a frame each (4 MiB) could take hundreds of GB. spill_bytes_max bounds it like the count."""
    size = HISTORY[10].size_bytes
    machine = replica(applied=0, spill_bytes_max=2 * size + size // 2)
    bootstrap(machine, k0=10)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 1)
    effects = machine.step(push(HISTORY[10:14]), 2)
    assert effects == [SpillEntries(tuple(HISTORY[10:12])), SendReject("core0", "a1", "resynchronise")]
    assert "spill full" in machine.status().last_error and "spill_bytes_max" in machine.status().last_error
    assert machine.step(push(HISTORY[12:14]), 3) == []
    effects = machine.step(BatchReceived("core0", "t", None, (), True), 4)
    assert effects[1] == ReplaySpill(*at(10)) and machine.applied_key == at(12)[0]
    # A new bootstrap starts with an empty spill.
    machine = replica(applied=0, spill_bytes_max=2 * size)
    bootstrap(machine, k0=10)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 1)
    assert machine.step(push(HISTORY[10:11]), 2) == [SpillEntries((HISTORY[10],)), SendAck("core0", "a1", at(11)[0])]


@pytest.mark.timeout(10)
def test_the_spills_of_all_a_nodes_shards_share_one_byte_budget():
    """spill_bytes_max bounded each shard's spill alone: a replicant's first start bootstraps every
    shard at once (up to SHARDS_MAX), so the node's disk could take a thousand times the bound. One
    SpillBudget per node: a shard finding no room releases its agent as when its own spill is full,
    and a spill gives its bytes back when it is replayed or discarded by a new bootstrap."""
    size = HISTORY[10].size_bytes
    budget = SpillBudget(3 * size)
    config = ReplicaConfig(spill_bytes_max=3 * size)

    def sharing() -> ShardReplica:
        # Two machines of one shard stand for two shards of one node: only the budget joins them.
        key, digest = at(0)
        return ShardReplica(SHARD, "rep0", CORES, key, digest, config, random.Random(0), 0, spill_budget=budget)

    first, second = sharing(), sharing()
    for machine in (first, second):
        bootstrap(machine, k0=10)
        machine.step(TablesReceived("core0", ("t",), ("k",)), 1)
    assert first.step(push(HISTORY[10:12]), 2) == [
        SpillEntries(tuple(HISTORY[10:12])),
        SendAck("core0", "a1", at(12)[0]),
    ]
    assert budget.used == 2 * size
    # The second shard's own spill is empty, but the node's budget has room for one entry only.
    effects = second.step(push(HISTORY[10:12]), 2)
    assert effects == [SpillEntries((HISTORY[10],)), SendReject("core0", "a1", "resynchronise")]
    assert "the node's spills" in second.status().last_error and budget.used == 3 * size
    # The first shard's copy ends: its spill is replayed and its bytes are given back.
    effects = first.step(BatchReceived("core0", "t", None, (), True), 3)
    assert of(effects, ReplaySpill) and budget.used == size
    # A new bootstrap of the second shard discards its spill (ResetShard) and gives its bytes back.
    effects = second.step(BatchReceived("core0", "t", None, (), True), 4)
    assert of(effects, ReplaySpill) and budget.used == 0 and second.mode is Mode.DISCONNECTED
    bootstrap(second, k0=11, now_ms=5)
    second.step(TablesReceived("core0", ("t",), ("k",)), 5)
    assert second.step(push(HISTORY[11:13]), 6) == [
        SpillEntries(tuple(HISTORY[11:13])),
        SendAck("core0", "a1", at(13)[0]),
    ]
    # The copy fails (its batch unanswered): the spill stays on disk, and charged, until a new
    # bootstrap resets the shard.
    second.step(Ticked(), 6 + config.failure_timeout_ms + 1)
    assert second.mode is Mode.DISCONNECTED and budget.used == 2 * size
    effects = bootstrap(second, k0=13, now_ms=20_000)
    assert of(effects, ResetShard) and second.mode is Mode.BOOTSTRAP and budget.used == 0


@pytest.mark.timeout(10)
def test_stale_or_mismatched_batches_are_ignored_and_oversized_ones_fail_the_bootstrap():
    machine = replica(applied=0, batch_rows_max=2)
    bootstrap(machine, k0=10)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 1)
    assert machine.step(BatchReceived("core0", "t", 5, ({"k": 6},), False), 2) == []
    assert machine.step(BatchReceived("core1", "t", None, ({"k": 6},), False), 2) == []
    machine.step(BatchReceived("core0", "t", None, ({"k": 1}, {"k": 2}, {"k": 3}), False), 3)
    assert machine.mode is Mode.DISCONNECTED and "batch_rows_max" in machine.status().last_error


@pytest.mark.timeout(10)
def test_a_table_list_or_batch_of_an_earlier_bootstrap_on_the_same_core_is_not_copied():
    """A copy's rows must be read after its K0 was fixed: a row read before it misses the entries up
    to K0, which the replay (from K0) never applies. A failed bootstrap's answers may still arrive
    once the next bootstrap on the same core waits for the same request (the first batch of a
    table asks the same ``after``): they carry the attempt (watch_id) they were asked in."""
    machine = replica(applied=0)
    bootstrap(machine, k0=10)
    first_attempt = machine.watch_id
    assert of(machine.step(TablesReceived("core0", ("t",), ("k",), first_attempt), 1), FetchBatch)
    machine.step(push(chain(1, HISTORY[12])), 2)  # a gap: this bootstrap fails
    assert machine.mode is Mode.DISCONNECTED
    bootstrap(machine, k0=20, now_ms=10_000)
    second_attempt = machine.watch_id
    assert machine.mode is Mode.BOOTSTRAP and second_attempt != first_attempt
    # The first attempt's table list, read before K0 = 20: no copy starts from it.
    assert machine.step(TablesReceived("core0", ("t",), ("k",), first_attempt), 10_001) == []
    assert of(machine.step(TablesReceived("core0", ("t",), ("k",), second_attempt), 10_002), FetchBatch)
    # The first attempt's first batch answers the same request (t, after None) but is not applied.
    stale = BatchReceived("core0", "t", None, ({"k": 1, "v": "before K0"},), True, watch_id=first_attempt)
    assert machine.step(stale, 10_003) == []
    assert machine.mode is Mode.BOOTSTRAP
    fresh = BatchReceived("core0", "t", None, ({"k": 1, "v": "v"},), True, watch_id=second_attempt)
    effects = machine.step(fresh, 10_004)
    assert ApplyBatch("t", ({"k": 1, "v": "v"},)) in effects and machine.mode is Mode.NORMAL


@pytest.mark.timeout(10)
def test_a_row_without_its_key_column_or_a_malformed_table_list_fails_the_bootstrap():
    machine = replica(applied=0)
    bootstrap(machine)
    machine.step(TablesReceived("core0", ("t",), ()), 1)
    assert machine.mode is Mode.DISCONNECTED and "malformed table list" in machine.status().last_error
    machine = replica(applied=0)
    bootstrap(machine)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 1)
    machine.step(BatchReceived("core0", "t", None, ({"id": 1},), False), 2)
    assert "without its key column" in machine.status().last_error


@pytest.mark.timeout(10)
def test_an_unanswered_batch_fails_the_bootstrap_after_failure_timeout_ms():
    machine = replica(applied=0, failure_timeout_ms=1000)
    bootstrap(machine)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 0)
    machine.step(push([]), 999)  # heartbeats keep the upstream alive, but the batch never comes
    machine.step(Ticked(), 1000)
    assert machine.mode is Mode.DISCONNECTED and "no answer to the batch request" in machine.status().last_error


@pytest.mark.timeout(10)
def test_after_bootstrap_attempts_max_failures_it_says_so_and_retries_only_every_failure_timeout_ms():
    machine = replica(applied=0, bootstrap_attempts_max=2, failure_timeout_ms=1000, retry_interval_ms=100)
    now = 0
    for attempt in range(1, 4):
        now = max(now, machine.next_deadline_ms())
        bootstrap(machine, now_ms=now)
        now += 1
        machine.step(RequestFailed("core0", "lost"), now)
        status = machine.status()
        assert status.bootstraps == attempt and status.bootstrap_failures_in_a_row == attempt
        if attempt < 2:
            assert machine.next_deadline_ms() - now <= 150
        else:
            assert machine.next_deadline_ms() - now == 1000
            assert f"bootstrap failed {attempt} times in a row" in status.last_error
            assert "retrying every 1000 ms" in status.last_error
    # A successful bootstrap resets the count.
    bootstrap(machine, now_ms=machine.next_deadline_ms())
    machine.step(TablesReceived("core0", (), ()), machine.next_deadline_ms())
    assert machine.status().bootstrap_failures_in_a_row == 0 and machine.status().last_error is None


@pytest.mark.timeout(10)
def test_counters_start_from_the_persisted_ones():
    machine = ShardReplica(SHARD, "rep0", CORES, *at(5), ReplicaConfig(), random.Random(0), 0, bootstraps=4, resumes=7)
    connect(machine)
    assert (machine.status().bootstraps, machine.status().resumes) == (4, 8)


@pytest.mark.timeout(10)
def test_every_mode_change_is_reported():
    machine = replica(applied=0)
    changes = of(bootstrap(machine), ModeChanged)
    changes += of(machine.step(TablesReceived("core0", (), ()), 1), ModeChanged)
    changes += of(machine.step(Ticked(), 10_000), ModeChanged)
    assert [change.mode for change in changes] == [Mode.BOOTSTRAP, Mode.LOCAL_REPLAY, Mode.NORMAL, Mode.DISCONNECTED]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad",
    [{"failure_timeout_ms": 0}, {"batch_rows_max": -1}, {"spill_entries_max": 1.5}, {"probe_timeout_ms": 3001}],
)
def test_invalid_config_is_refused(bad):
    with pytest.raises(ReplicaConfigError):
        ReplicaConfig(**bad)


@pytest.mark.timeout(10)
def test_invalid_construction_and_time_going_backwards_are_refused():
    with pytest.raises(ReplicaConfigError):
        ShardReplica(SHARD, "rep0", (), ZERO_KEY, GENESIS_DIGEST, ReplicaConfig(), random.Random(0), 0)
    with pytest.raises(ReplicaConfigError):
        ShardReplica(SHARD, "rep0", ("a", "a"), ZERO_KEY, GENESIS_DIGEST, ReplicaConfig(), random.Random(0), 0)
    machine = replica(now_ms=10)
    with pytest.raises(ValueError, match="time went backwards"):
        machine.step(Ticked(), 9)


# ---------------------------------------------------------------- the read fence after a bootstrap


def bootstrapped(k0: int = 10, spilled: int = 12) -> ShardReplica:
    """A replica that has just finished a bootstrap at ``k0`` with entries up to ``spilled`` spilled."""
    machine = replica(applied=0)
    bootstrap(machine, k0=k0)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 1)
    if spilled > k0:
        machine.step(push(HISTORY[k0:spilled]), 2)
    effects = machine.step(BatchReceived("core0", "t", None, ({"k": 1, "v": "dirty"},), True), 3)
    assert FetchCommitted("core0", 1) in effects and machine.mode is Mode.NORMAL
    return machine


@pytest.mark.timeout(10)
def test_no_read_is_served_after_a_bootstrap_until_the_applied_key_reaches_the_committed_key():
    machine = bootstrapped()
    assert not machine.readable() and machine.status().read_fenced
    machine.step(CommittedReceived("core0", at(14)[0], 1), 4)
    assert not machine.readable() and machine.status().read_fence == at(14)[0]
    machine.step(push(HISTORY[12:13]), 5)
    assert not machine.readable()  # (1, 13): not there yet
    assert ReadFenceChanged(False) in machine.step(push(HISTORY[13:14]), 6)
    assert machine.readable(), "reaching the key clears the fence, without any read"
    assert machine.status().read_fence is None and not machine.status().read_fenced


@pytest.mark.timeout(10)
def test_a_fence_already_reached_clears_at_the_answer():
    machine = bootstrapped()
    machine.step(CommittedReceived("core0", at(12)[0], 1), 4)
    assert machine.readable()


@pytest.mark.timeout(10)
def test_an_unanswered_fence_request_is_asked_again_and_answers_of_another_core_are_ignored():
    machine = bootstrapped()
    machine.step(CommittedReceived("core1", at(12)[0], 1), 4)  # not the upstream
    assert not machine.readable()
    assert machine.step(Ticked(), 5) == []  # still waiting for core0's answer
    machine.step(CommittedReceived("core0", None, 1), 6)  # failed
    assert FetchCommitted("core0", 2) in machine.step(Ticked(), 7)
    machine.step(push([], committed=12), 2000)
    assert FetchCommitted("core0", 3) in machine.step(Ticked(), 3007), "a lost answer is asked for again"
    machine.step(CommittedReceived("core0", at(12)[0], 2), 3008)  # the lost answer, late: stale
    assert not machine.readable()
    machine.step(CommittedReceived("core0", at(12)[0], 3), 3009)
    assert machine.readable()


@pytest.mark.timeout(10)
def test_a_late_answer_to_an_earlier_copys_fence_question_does_not_open_the_next_copys_fence():
    """Regression: an answer was taken for whatever question was outstanding. Copy 1 ends and asks
    (question 1); the replica loses its upstream before the answer comes, bootstraps again from the
    same core and asks again (question 2); question 1's answer, late, carries a committed key from
    before copy 2 ended, which copy 2's applied key already passes: taken as copy 2's fence key, it
    served copy 2's dirty rows at once."""
    machine = bootstrapped()  # question 1 asked; applied (1, 12)
    machine.step(push(HISTORY[20:22]), 4)  # a gap: the replica leaves core0's agent
    assert machine.mode is Mode.DISCONNECTED
    assert of(machine.step(Ticked(), 2000), ProbeJournals)
    journals = JournalsReceived(tuple((c, JournalAnswer(at(30)[0], True, 0) if c == "core0" else None) for c in CORES))
    machine.step(journals, 2000)
    key, digest = at(20)
    machine.step(WatchAccepted("core0", "a2", "bootstrap", key, digest, machine.watch_id), 2000)
    machine.step(TablesReceived("core0", ("t",), ("k",), machine.watch_id), 2001)
    effects = machine.step(
        BatchReceived("core0", "t", None, ({"k": 1, "v": "dirty"},), True, watch_id=machine.watch_id), 2002
    )
    assert FetchCommitted("core0", 2) in effects and machine.applied_key == at(20)[0]
    machine.step(CommittedReceived("core0", at(12)[0], 1), 2003)  # question 1's answer, late
    assert not machine.readable() and machine.status().read_fence is None, "a stale answer opened the fence"
    assert ReadFenceChanged(False) not in machine.step(CommittedReceived("core0", at(22)[0], 2), 2004)
    assert machine.status().read_fence == at(22)[0] and not machine.readable()
    assert ReadFenceChanged(False) in machine.step(push(HISTORY[20:22], agent="a2"), 2005)
    assert machine.readable()


@pytest.mark.timeout(10)
def test_a_resumed_replica_without_bootstrap_is_readable_at_once():
    machine = replica(applied=5)
    connect(machine)
    assert machine.readable() and not machine.status().read_fenced


@pytest.mark.timeout(10)
def test_a_replica_restarted_while_fenced_stays_fenced_and_asks_again():
    key, digest = at(12)
    machine = ShardReplica(SHARD, "rep0", CORES, key, digest, ReplicaConfig(), random.Random(0), 0, read_fenced=True)
    connect(machine)
    assert machine.mode is Mode.NORMAL and not machine.readable()
    assert FetchCommitted("core0", 1) in machine.step(Ticked(), 1)
    assert ReadFenceChanged(False) in machine.step(CommittedReceived("core0", at(12)[0], 1), 2)
    assert machine.readable()


# ---------------------------------------------------------------- a push that overtakes the watch answer


def watching(machine: ShardReplica, core: str = "core0") -> str:
    machine.step(Ticked(), 0)
    journals = JournalsReceived(tuple((c, JournalAnswer(at(30)[0], True, 0) if c == core else None) for c in CORES))
    assert of(machine.step(journals, 0), SendWatch)
    return machine.watch_id


@pytest.mark.timeout(10)
def test_a_push_that_overtakes_the_watch_answer_is_taken_as_the_answer_and_applied():
    machine = replica(applied=5)
    watch_id = watching(machine)
    accepted = WatchAccepted("core0", "a1", "resume", *at(5), watch_id)
    early = PushReceived("core0", "a1", tuple(HISTORY[5:7]), at(30)[0], True, accepted)
    effects = machine.step(early, 1)
    assert ApplyEntries(tuple(HISTORY[5:7])) in effects and SendAck("core0", "a1", at(7)[0]) in effects
    assert machine.mode is Mode.NORMAL and machine.agent_id == "a1" and machine.status().resumes == 1
    assert machine.step(accepted, 2) == []  # the answer itself arrives late: nothing happens twice
    assert machine.status().resumes == 1 and machine.status().applied_key == at(7)[0]


@pytest.mark.timeout(10)
def test_a_push_carrying_the_answer_to_an_older_watch_is_not_taken_as_the_answer():
    machine = replica(applied=5)
    watching(machine)
    stale = WatchAccepted("core0", "a0", "resume", *at(5), "an-older-watch")
    effects = machine.step(PushReceived("core0", "a0", tuple(HISTORY[5:7]), at(30)[0], True, stale), 1)
    assert effects == [] and machine.mode is Mode.DISCONNECTED and machine.agent_id is None
    assert machine.step(stale, 2) == [] and machine.mode is Mode.DISCONNECTED
    # A push whose answer names another agent than its sender is not taken either.
    forged = WatchAccepted("core0", "a9", "resume", *at(5), machine.watch_id)
    assert machine.step(PushReceived("core0", "a1", (), at(30)[0], True, forged), 3) == []
    assert machine.mode is Mode.DISCONNECTED


@pytest.mark.timeout(10)
def test_bootstrap_progress_counts_rows_bytes_rate_and_eta():
    machine = replica(applied=0, batch_rows_max=2)
    bootstrap(machine, k0=10)
    machine.step(TablesReceived("core0", ("t",), ("k",)), 0)
    rows = ({"k": 1, "v": "a"}, {"k": 2, "v": "b"})
    machine.step(BatchReceived("core0", "t", None, rows, False, rows_total=6), 1000)
    status = machine.status()
    assert (status.copy_rows, status.copy_rows_expected, status.copy_rows_per_s) == (2, 6, 2.0)
    assert status.copy_bytes > 0 and status.copy_eta_ms == 2000  # 4 rows to go at 2 rows/s


@pytest.mark.timeout(10)
def test_a_waiting_read_is_answered_only_when_readable_and_its_key_is_applied():
    machine = bootstrapped()
    # Applied (1, 12) but fenced: a read at an applied key still waits for the fence.
    assert not machine.readable_at(at(5)[0])
    machine.step(CommittedReceived("core0", at(12)[0], 1), 4)
    assert machine.readable_at(at(12)[0]) and not machine.readable_at(at(13)[0])


@pytest.mark.timeout(10)
def test_a_pushed_entry_of_one_tables_rows_is_decoded_as_one_run_and_still_chains():
    """``push_received`` (driver and simulator) keeps a bulk write packed as one ``WriteRows`` (cluster
    version 2) as it is: what the replicant's apply binds without a dict and a WriteOp per row; the digest
    chain the machine checks is the packed bytes', so the run is applied like any entry."""
    from mnesite.replicant.replica import push_received
    from mnesite.rlog import messages
    from mnesite.rlog.types import WriteRows

    rows = tuple(WriteOp("t", {"k": k, "v": "x"}) for k in range(3))
    entry = make_entry(SHARD, TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, rows, runs=True)
    body = messages.typed_body(
        "push",
        {
            "shard": SHARD,
            "agent": "a1",
            "core": "core0",
            "entries": [entry.to_wire()],
            "committed": [1, 1],
            "hears_sequencer": True,
        },
    )
    machine = replica()
    connect(machine)
    received = push_received(machine, body)
    assert received.entries[0].ops == (WriteRows("t", ("k", "v"), [(0, "x"), (1, "x"), (2, "x")]),)
    assert received.entries[0].packed == entry.packed
    (applied,) = of(machine.step(received, 1), ApplyEntries)
    assert applied.entries == received.entries and machine.applied_key == TxKey(1, 1)


@pytest.mark.timeout(10)
def test_a_copy_that_outlasts_the_agents_ack_timeout_after_the_spill_filled_still_completes():
    """Default timeouts, a real agent (core.agent) coupled to the replica. Once the spill was full the
    replica acknowledged nothing, not even heartbeats, so the agent stopped after its ack_timeout_ms
    (10 s), the replica heard nothing for failure_timeout_ms (3 s) and failed the bootstrap: a copy
    lasting longer than that after the spill filled (a large table under writes) never completed,
    it started over from scratch every time."""
    from mnesite.core.agent import Agent, AgentConfig
    from mnesite.rlog.replication import AckReceived, CommittedAdvanced, Push, RejectReceived

    from tests.sim import MemoryLog

    log = MemoryLog()
    log.append(tuple(HISTORY))
    machine = replica(applied=0, spill_entries_max=3)
    bootstrap(machine, k0=10)
    agent = Agent("a1", SHARD, "rep0", at(10)[0], log, AgentConfig(), 0)
    replica_effects: list = list(machine.step(TablesReceived("core0", ("t",), ("k",)), 0))
    agent_effects: list = list(agent.step(CommittedAdvanced(at(30)[0], True), 0))
    copy_ms, now = 20_000, 0
    seen: list = []
    while now <= 30_000 and not of(seen, ReplaySpill):
        # Route until quiet: pushes to the replica, its acknowledgements and rejections to the agent.
        while agent_effects or replica_effects:
            for effect in agent_effects:
                if isinstance(effect, Push):
                    received = PushReceived("core0", "a1", tuple(effect.entries), effect.committed_key, True)
                    replica_effects += machine.step(received, now)
            agent_effects = []
            for effect in replica_effects:
                seen.append(effect)
                if isinstance(effect, SendAck) and effect.agent_id == "a1":
                    agent_effects += agent.step(AckReceived(effect.applied_key), now)
                elif isinstance(effect, SendReject) and effect.agent_id == "a1":
                    agent_effects += agent.step(RejectReceived(effect.reason), now)
            replica_effects = []
        now += 100
        agent_effects += agent.step(Ticked(), now)
        replica_effects += machine.step(Ticked(), now)
        # The core answers the batch outstanding once a second: one row each, the last after copy_ms.
        fetches = of(seen, FetchBatch)
        if now % 1000 == 0 and fetches and machine.mode is Mode.BOOTSTRAP:
            fetch = fetches[-1]
            row = {"k": now, "v": "dirty"}
            replica_effects += machine.step(BatchReceived("core0", "t", fetch.after, (row,), now >= copy_ms), now)
    assert of(seen, ReplaySpill) == [ReplaySpill(*at(10))], of(seen, ModeChanged)
    assert agent.stopped  # released when the spill filled: the core holds no window for it
    status = machine.status()
    assert (status.bootstraps, status.bootstrap_failures_in_a_row, status.entries_spilled) == (1, 0, 3)
    assert machine.applied_key == at(13)[0]
    # Then it resumes from what it replayed, under a new watch.
    machine.step(Ticked(), now)
    effects = machine.step(ages(), now)
    (watch,) = of(effects, SendWatch)
    assert (watch.from_key, watch.from_digest) == at(13)


def test_a_spill_budget_refuses_to_give_back_more_than_it_took() -> None:
    """An accounting error is loud, also under ``python -O`` (an ``assert`` was: the budget then went
    below zero and let the node spill more than ``spill_bytes_max``)."""
    budget = SpillBudget(100)
    assert budget.take(60)
    with pytest.raises(ValueError, match="gave back 61 bytes of 60"):
        budget.give_back(61)
    with pytest.raises(ValueError, match="gave back -1 bytes"):
        budget.give_back(-1)
    assert budget.used == 60
    budget.give_back(60)
    assert budget.used == 0 and budget.take(100)


@pytest.mark.timeout(10)
def test_every_acknowledgement_echoes_the_token_of_the_last_push_read_and_only_to_a_core_that_sent_one():
    """The token proves to the agent that this replica read its pushes up to that one (core.agent,
    "Proven acknowledgements"); a core of release 0.1.0 sends none and must get no unknown field."""
    from mnesite.replicant.replica import ack_body

    machine = replica(applied=5)
    connect(machine)
    tokened = PushReceived("core0", "a1", tuple(HISTORY[5:7]), at(30)[0], True, None, b"t1")
    assert of(machine.step(tokened, 1), SendAck) == [SendAck("core0", "a1", at(7)[0], b"t1")]
    heartbeat = PushReceived("core0", "a1", (), at(30)[0], True, None, b"t2")
    assert of(machine.step(heartbeat, 2), SendAck) == [SendAck("core0", "a1", at(7)[0], b"t2")]
    assert ack_body(SHARD, SendAck("core0", "a1", at(7)[0], b"t2"))["token"] == b"t2"
    assert "token" not in ack_body(SHARD, of(machine.step(push(HISTORY[7:8]), 3), SendAck)[0])


@pytest.mark.timeout(10)
def test_a_bootstrap_restarted_because_the_copy_outlasted_retention_is_counted_and_says_what_to_raise():
    """Sizing trap: a copy whose spill filled resumes from the spill's last key once done; if the cores
    trimmed that key meanwhile (the copy outlasted another retention_entries_max writes) the watch is
    answered bootstrap, and under sustained writes that repeats for ever, each attempt looking like a
    fresh bootstrap. Each such restart is now counted (``bootstraps_outrun``), and ``last_error`` and
    one warning-level ModeChanged per restart say why and which settings to raise."""
    machine = replica(applied=0, spill_entries_max=3)
    bootstrap(machine, k0=10)
    now, core, agent = 0, "core0", "a1"
    for restart, (k0, next_k0) in enumerate(((10, 20), (20, 26)), start=1):
        machine.step(TablesReceived(core, ("t",), ("k",)), now + 1)
        machine.step(push(HISTORY[k0 : k0 + 3], agent, core), now + 2)  # the spill is full: agent released
        machine.step(BatchReceived(core, "t", None, (), True), now + 3)
        assert machine.mode is Mode.DISCONNECTED and machine.applied_key == at(k0 + 3)[0]
        now += 10_000
        assert machine.step(Ticked(), now) == [ProbeJournals(CORES)]
        (watch,) = of(machine.step(ages(), now), SendWatch)
        core, agent = watch.core, f"a{restart + 1}"
        # The cores trimmed the spill's last key meanwhile: the resume is answered bootstrap.
        effects = machine.step(WatchAccepted(core, agent, "bootstrap", *at(next_k0), machine.watch_id), now)
        (changed,) = of(effects, ModeChanged)
        assert machine.mode is Mode.BOOTSTRAP and changed.warning
        status = machine.status()
        assert status.bootstraps == restart + 1 and status.bootstraps_outrun == restart
        for text in (
            f"no longer holds {at(k0 + 3)[0]}",
            "retention_entries_max",
            "the spill holds 3 entries",
            "[limits] spill_entries_max",
        ):
            assert text in status.last_error and text in changed.reason, (text, status.last_error)
        assert not of(machine.step(Ticked(), now + 1), ModeChanged)  # said once per restart, not per turn
    # A copy whose spill did not fill ends the trap: done, NORMAL, the count kept.
    machine.step(TablesReceived(core, ("t",), ("k",)), now + 1)
    machine.step(BatchReceived(core, "t", None, (), True), now + 3)
    assert machine.mode is Mode.NORMAL and machine.status().bootstraps_outrun == 2
