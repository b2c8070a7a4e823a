"""Unit tests of core.consensus, one rule (a sentence of the Raft paper, or of the issue) per test."""

from __future__ import annotations

import dataclasses
import random

import pytest
from mnesite.core.consensus import (
    EXCLUSION_NOTICE_INTERVAL_MS,
    GENERATION_MAX,
    REJECT_BUSY,
    REJECT_NOT_SEQUENCER,
    REJECT_TOO_LARGE,
    REJECT_TOO_MANY_OPS,
    AppendReply,
    AppendRequest,
    BatchEnded,
    Commit,
    ConsensusConfig,
    ConsensusConfigError,
    ConsensusInvariantError,
    Excluded,
    ExclusionNotice,
    FeedRequested,
    ForceStarted,
    ForceStartRefused,
    ForceStartRequested,
    JournalAge,
    MessageReceived,
    Persisted,
    PersistedState,
    PersistEntries,
    PersistState,
    PreVoteReply,
    PreVoteRequest,
    ProposalCommitted,
    ProposalFailed,
    ProposalRejected,
    Proposed,
    ProposedBatch,
    ProtocolViolation,
    Role,
    RoleChanged,
    Send,
    ShardConsensus,
    SnapshotNeeded,
    Ticked,
    TruncateLog,
    VoteReply,
    VoteRequest,
)
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, CreateTableOp, Entry, MembersOp, TxKey, WriteOp, make_entry

from tests.sim import MemoryLog

pytestmark = pytest.mark.timeout(10)

CONFIG = ConsensusConfig(
    election_timeout_ms_min=100,
    election_timeout_ms_max=200,
    heartbeat_interval_ms=20,
    entries_per_append_max=3,
    appends_in_flight_max=2,
    pending_proposals_max=4,
    # Every follower is sent every batch at once here; the lazy followers have tests of their own.
    lazy_feed_interval_ms=0,
)
MEMBERS = ("a", "b", "c")
# A core refuses (pre-)votes during the first election timeout after it starts.
QUIET_AFTER_START_MS = CONFIG.election_timeout_ms_min


def chain(keys: list[TxKey], start: Entry | None = None) -> list[Entry]:
    """Entries at ``keys`` following ``start`` (or the genesis)."""
    prev, digest = (start.tx_key, start.digest) if start else (ZERO_KEY, GENESIS_DIGEST)
    entries = []
    for index, key in enumerate(keys):
        entry = make_entry("s", key, prev, digest, (WriteOp("t", {"k": index, "at": list(key)}),), f"r{key}")
        entries.append(entry)
        prev, digest = key, entry.digest
    return entries


class Harness:
    """One machine plus the minimal driver: it executes persistence effects on a MemoryLog."""

    def __init__(
        self,
        name: str = "a",
        members: tuple[str, ...] = MEMBERS,
        entries: list[Entry] | None = None,
        state: PersistedState | None = None,
        committed_key: TxKey = ZERO_KEY,
        config: ConsensusConfig = CONFIG,
        seed: int = 1,
    ) -> None:
        self.log = MemoryLog()
        self.log.append(tuple(entries or ()))
        self.state = state or PersistedState(0, None, members)
        self.machine = ShardConsensus(
            "s", name, self.log, self.state, committed_key, config, random.Random(seed), now_ms=0
        )
        self.now_ms = 0
        # Like a driver whose every step ends with its commit: Persisted follows each step that persisted.
        self.auto_persist = True

    def step(self, event, now_ms: int | None = None) -> list:
        if now_ms is not None:
            self.now_ms = now_ms
        effects = self.machine.step(event, self.now_ms)
        persisted = False
        for effect in effects:
            if isinstance(effect, PersistEntries):
                self.log.append(effect.entries)
            elif isinstance(effect, TruncateLog):
                self.log.truncate_after(effect.after_key)
            elif isinstance(effect, PersistState):
                self.state = effect.state
            persisted = persisted or isinstance(effect, (PersistEntries, TruncateLog, PersistState))
        if persisted and self.auto_persist:
            effects = effects + self.machine.step(Persisted(), self.now_ms)
        return effects

    def receive(self, sender: str, message, now_ms: int | None = None) -> list:
        return self.step(MessageReceived(sender, message), now_ms)

    def campaign(self) -> list:
        """Time out, then get every would-be vote of the pre-vote: the effects of starting the election."""
        effects = self.step(Ticked(), self.machine.next_deadline_ms())
        (request,) = {message for _, message in sends(effects, PreVoteRequest)}
        for peer in self.machine.members:
            if peer != self.machine.name and self.machine.generation < request.generation:
                effects = self.receive(peer, PreVoteReply(request.generation, True))
        return effects

    def elect(self) -> list:
        """Time out, then get every (pre-)vote: the machine becomes sequencer."""
        self.campaign()
        effects = []
        for peer in self.machine.members:
            if peer != self.machine.name:
                effects += self.receive(peer, VoteReply(self.machine.generation, True))
        assert self.machine.role is Role.SEQUENCER
        return effects

    def ack(self, peer: str, key: TxKey) -> list:
        # Answers an append sent now (the reply echoes its send time).
        message = AppendReply(self.machine.generation, True, key, key, ZERO_KEY, self.now_ms)
        return self.receive(peer, message)


def of_type(effects: list, kind: type) -> list:
    return [effect for effect in effects if isinstance(effect, kind)]


def sends(effects: list, kind: type) -> list[tuple[str, object]]:
    return [(e.to, e.message) for e in effects if isinstance(e, Send) and isinstance(e.message, kind)]


def index_of(effects: list, kind: type) -> int:
    return next(i for i, effect in enumerate(effects) if isinstance(effect, kind))


def append(generation: int, prev: Entry | None, entries: list[Entry], commit_key: TxKey = ZERO_KEY) -> AppendRequest:
    prev_key, prev_digest = (prev.tx_key, prev.digest) if prev else (ZERO_KEY, GENESIS_DIGEST)
    return AppendRequest(generation, prev_key, prev_digest, commit_key, MEMBERS, tuple(entries))


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "overrides",
    [
        {"election_timeout_ms_min": 0},
        {"election_timeout_ms_min": 300, "election_timeout_ms_max": 200},
        {"heartbeat_interval_ms": 60},
        {"entries_per_append_max": True},
        {"pending_proposals_max": -1},
    ],
)
def test_invalid_config_is_refused(overrides):
    base = {"election_timeout_ms_min": 100, "election_timeout_ms_max": 200, "heartbeat_interval_ms": 20}
    with pytest.raises(ConsensusConfigError):
        ConsensusConfig(**(base | overrides))


def test_a_core_outside_its_membership_is_a_learner_that_never_campaigns():
    # A core being added (or one removed) follows appends but never raises the generation.
    harness = Harness(name="z")
    effects = harness.step(Ticked(), 10 * CONFIG.election_timeout_ms_max)
    assert not sends(effects, PreVoteRequest) and harness.machine.generation == 0
    assert not harness.machine.voter


@pytest.mark.parametrize("kind", ["outside its membership", "left out by a forced start"])
def test_a_core_that_never_campaigns_keeps_its_next_deadline_ahead(kind):
    """Its election deadline passes and a tick changes nothing: a next deadline left in the past made
    the driver poll without waiting, a removed or left-out core spinning a CPU for as long as it ran."""
    harness = Harness(name="d") if kind == "outside its membership" else Harness()
    if kind == "left out by a forced start":
        harness.receive("b", ExclusionNotice(5, ("b", "c"), ZERO_KEY, None), now_ms=50)
        assert harness.machine.excluded
    for now_ms in (10_000, 20_000):
        assert harness.step(Ticked(), now_ms) == []
        assert harness.machine.next_deadline_ms() > now_ms


def test_time_must_not_go_backwards():
    harness = Harness()
    harness.step(Ticked(), 50)
    with pytest.raises(ValueError):
        harness.step(Ticked(), 49)


# ---------------------------------------------------------------- election


def test_nodes_start_as_followers_and_stay_quiet_before_the_election_timeout():
    harness = Harness()
    assert harness.machine.role is Role.FOLLOWER
    assert harness.step(Ticked(), CONFIG.election_timeout_ms_min - 1) == []


def test_election_timeouts_are_randomised_within_the_configured_range():
    deadlines = {Harness(seed=seed).machine.next_deadline_ms() for seed in range(30)}
    assert len(deadlines) > 5
    assert all(CONFIG.election_timeout_ms_min <= d <= CONFIG.election_timeout_ms_max for d in deadlines)


def test_a_candidate_persists_the_new_generation_and_its_vote_before_asking_for_votes():
    harness = Harness()
    effects = harness.campaign()
    assert harness.machine.role is Role.CANDIDATE
    assert effects[index_of(effects, PersistState)].state == PersistedState(1, "a", MEMBERS)
    requests = sends(effects, VoteRequest)
    assert sorted(to for to, _ in requests) == ["b", "c"]
    assert all(message == VoteRequest(1, ZERO_KEY) for _, message in requests)
    assert index_of(effects, PersistState) < index_of(effects, Send)


def test_a_candidate_that_times_out_starts_a_new_election_with_a_higher_generation():
    harness = Harness()
    harness.campaign()
    harness.campaign()
    assert harness.machine.generation == 2
    assert harness.state.generation == 2


def test_a_candidate_with_votes_from_a_majority_becomes_sequencer_and_appends_a_no_op():
    harness = Harness()
    harness.campaign()
    effects = harness.receive("b", VoteReply(1, True))
    assert harness.machine.role is Role.SEQUENCER
    assert harness.machine.sequencer == "a"
    (persisted,) = of_type(effects, PersistEntries)
    (no_op,) = persisted.entries
    assert (no_op.tx_key, no_op.prev, no_op.ops) == (TxKey(1, 1), ZERO_KEY, ())
    appends = sends(effects, AppendRequest)
    assert sorted(to for to, _ in appends) == ["b", "c"]
    assert all(message.entries == (no_op,) for _, message in appends)
    assert index_of(effects, PersistEntries) < index_of(effects, Send)


def test_refused_votes_do_not_elect():
    harness = Harness()
    harness.campaign()
    harness.receive("b", VoteReply(1, False))
    harness.receive("c", VoteReply(1, False))
    assert harness.machine.role is Role.CANDIDATE


def test_a_single_member_elects_itself_and_commits_its_no_op_at_once():
    harness = Harness(members=("a",))
    effects = harness.step(Ticked(), harness.machine.next_deadline_ms())
    assert harness.machine.role is Role.SEQUENCER
    assert Commit(TxKey(1, 1)) in effects


def test_a_single_member_does_not_wait_an_election_timeout():
    harness = Harness(members=("a",))
    assert harness.machine.next_deadline_ms() == 0
    harness.step(Ticked(), 0)
    assert harness.machine.role is Role.SEQUENCER
    three = Harness(members=("a", "b", "c"))
    assert three.machine.next_deadline_ms() >= CONFIG.election_timeout_ms_min


def test_a_vote_is_persisted_before_the_reply_and_granted_at_most_once_per_generation():
    harness = Harness()
    effects = harness.receive("b", VoteRequest(1, ZERO_KEY), now_ms=QUIET_AFTER_START_MS)
    assert of_type(effects[: index_of(effects, Send)], PersistState)[-1].state == PersistedState(1, "b", MEMBERS)
    assert sends(effects, VoteReply) == [("b", VoteReply(1, True))]
    assert sends(harness.receive("c", VoteRequest(1, ZERO_KEY)), VoteReply) == [("c", VoteReply(1, False))]
    # A duplicate request from the same candidate gets the same answer, without persisting again.
    again = harness.receive("b", VoteRequest(1, ZERO_KEY))
    assert sends(again, VoteReply) == [("b", VoteReply(1, True))]
    assert of_type(again, PersistState) == []


def test_a_vote_goes_only_to_a_candidate_whose_last_appended_key_is_at_least_ours():
    entries = chain([TxKey(1, 1), TxKey(1, 2), TxKey(2, 1)])
    # Committed only up to (1, 1): the voting rule must look at the last appended key.
    harness = Harness(entries=entries, state=PersistedState(2, None, MEMBERS), committed_key=TxKey(1, 1))
    refused = harness.receive("b", VoteRequest(3, TxKey(1, 9)), now_ms=QUIET_AFTER_START_MS)
    assert sends(refused, VoteReply) == [("b", VoteReply(3, False))]
    assert harness.machine.generation == 3  # the higher generation is adopted anyway
    granted = harness.receive("c", VoteRequest(4, TxKey(2, 1)))
    assert sends(granted, VoteReply) == [("c", VoteReply(4, True))]
    granted_longer = Harness(entries=entries).receive("c", VoteRequest(3, TxKey(3, 1)), now_ms=QUIET_AFTER_START_MS)
    assert sends(granted_longer, VoteReply) == [("c", VoteReply(3, True))]


def test_a_vote_request_of_a_stale_generation_is_refused_with_the_current_generation():
    harness = Harness(state=PersistedState(5, None, MEMBERS))
    effects = harness.receive("b", VoteRequest(4, TxKey(9, 9)))
    assert sends(effects, VoteReply) == [("b", VoteReply(5, False))]
    assert of_type(effects, PersistState) == []


def test_a_candidate_that_hears_a_sequencer_of_its_generation_becomes_follower():
    harness = Harness()
    harness.campaign()
    harness.receive("b", append(1, None, []))
    assert harness.machine.role is Role.FOLLOWER
    assert harness.machine.sequencer == "b"


def test_a_sequencer_that_sees_a_higher_generation_steps_down_and_fails_its_pending_proposals():
    harness = Harness()
    harness.elect()
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    effects = harness.receive("b", VoteReply(7, False))
    assert harness.machine.role is Role.FOLLOWER
    assert harness.state.generation == 7
    (failed,) = of_type(effects, ProposalFailed)
    assert failed.request_id == "w1" and "generation 7" in failed.reason


def test_replies_from_non_members_are_ignored():
    harness = Harness()
    harness.campaign()
    for reply in (VoteReply(9, True), PreVoteReply(9, False)):
        effects = harness.receive("zombie", reply)
        assert of_type(effects, ProtocolViolation) and harness.machine.generation == 1
    assert harness.machine.role is Role.CANDIDATE


def test_vote_requests_from_non_members_are_answered_by_the_log_and_stickiness_rules():
    """Thesis 4.2.3: a core added by an entry this core has not stored yet may need its vote. The
    log check keeps it safe, the stickiness and pre-vote guards keep a removed core from disrupting."""
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS))
    harness.receive("b", append(1, entries[-1], []), now_ms=10)
    refused = harness.receive("d", PreVoteRequest(2, TxKey(1, 3)))
    assert sends(refused, PreVoteReply) == [("d", PreVoteReply(1, False))]  # b is heard
    refused = harness.receive("d", VoteRequest(2, TxKey(1, 3)))
    assert sends(refused, VoteReply) == [("d", VoteReply(1, False))] and harness.machine.sequencer == "b"
    harness.step(Ticked(), 10 + CONFIG.election_timeout_ms_min)
    behind = harness.receive("d", PreVoteRequest(2, TxKey(1, 1)))
    assert sends(behind, PreVoteReply) == [("d", PreVoteReply(1, False))]
    assert sends(harness.receive("d", PreVoteRequest(2, TxKey(1, 3))), PreVoteReply) == [("d", PreVoteReply(2, True))]
    granted = harness.receive("d", VoteRequest(2, TxKey(1, 3)))
    assert sends(granted, VoteReply) == [("d", VoteReply(2, True))] and harness.state.voted_for == "d"


# ---------------------------------------------------------------- replication at the sequencer


def test_proposals_at_a_follower_are_rejected_with_the_known_sequencer():
    harness = Harness()
    effects = harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    assert effects == [ProposalRejected("w1", REJECT_NOT_SEQUENCER, None)]
    harness.receive("b", append(1, None, []))
    assert harness.step(Proposed((), "w2")) == [ProposalRejected("w2", REJECT_NOT_SEQUENCER, "b")]


def test_the_sequencer_assigns_the_next_key_persists_then_sends_and_commits_on_a_majority():
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    effects = harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    (persisted,) = of_type(effects, PersistEntries)
    entry = persisted.entries[0]
    assert entry.tx_key == TxKey(1, 2) and entry.prev == TxKey(1, 1) and entry.request_id == "w1"
    # The turn's entries go together, at BatchEnded (b hears the commit of (1, 1) meanwhile).
    assert [m.entries for _, m in sends(effects, AppendRequest) if m.entries] == []
    effects = harness.step(BatchEnded())
    assert [(to, m.entries) for to, m in sends(effects, AppendRequest) if m.entries] == [("b", (entry,))]
    assert of_type(effects, Commit) == []
    # b (no longer probing) was sent (1, 2); its acknowledgement makes a majority with the sequencer.
    committed = harness.ack("b", TxKey(1, 2))
    assert committed == [Commit(TxKey(1, 2)), ProposalCommitted("w1", TxKey(1, 2))]
    assert harness.machine.committed_key == TxKey(1, 2)


def test_a_follower_hears_a_new_commit_key_within_the_notice_delay_not_at_the_next_write():
    """A commit made by a reply is told to every follower holding the committed entries within
    commit_notice_delay_ms (an empty append when no batch carried it), once; a follower that was
    not sent them (probing) is not told."""
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))  # b is caught up; c never answered: it is still probing
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    harness.step(BatchEnded())
    committed = harness.ack("b", TxKey(1, 2))
    assert of_type(committed, Commit) == [Commit(TxKey(1, 2))]
    assert sends(harness.step(BatchEnded()), AppendRequest) == []  # no batch: the notice waits
    due_ms = harness.machine.next_deadline_ms()
    assert due_ms == harness.now_ms + CONFIG.commit_notice_delay_ms
    assert sends(harness.step(Ticked(), due_ms - 1), AppendRequest) == []
    notices = sends(harness.step(Ticked(), due_ms), AppendRequest)
    assert [(to, m.entries, m.prev_key, m.commit_key) for to, m in notices] == [("b", (), TxKey(1, 2), TxKey(1, 2))]
    assert sends(harness.step(BatchEnded()), AppendRequest) == []  # told once
    assert sends(harness.step(Ticked(), due_ms + 1), AppendRequest) == []
    # The follower's side: the empty append makes it apply up to the commit key at once.
    follower = Harness(name="b", entries=chain([TxKey(1, 1), TxKey(1, 2)]), committed_key=TxKey(1, 1))
    follower.step(Ticked(), 1)
    prev = follower.log.entries_after(TxKey(1, 1), 1)[0]
    effects = follower.receive("a", append(1, prev, [], commit_key=TxKey(1, 2)))
    assert of_type(effects, Commit) == [Commit(TxKey(1, 2))]


def test_a_batch_within_the_notice_delay_carries_the_commit_key_and_no_notice_follows():
    """Under load the next turn's batch tells the commit key: the follower applies it in the turn
    that appends, and no commit notice costs it a turn of its own."""
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.ack("c", TxKey(1, 1))
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    harness.step(BatchEnded())
    harness.ack("b", TxKey(1, 2))
    assert sends(harness.step(BatchEnded()), AppendRequest) == []
    due_ms = harness.machine.next_deadline_ms()
    harness.step(Proposed((WriteOp("t", {"k": 2}),), "w2"), due_ms - 1)
    batch = sends(harness.step(BatchEnded()), AppendRequest)
    assert sorted((to, m.commit_key, len(m.entries)) for to, m in batch) == [
        ("b", TxKey(1, 2), 1),
        ("c", TxKey(1, 2), 1),
    ]
    assert sends(harness.step(Ticked(), due_ms), AppendRequest) == []


def test_a_follower_leaves_a_commit_notice_unanswered_just_after_an_answer():
    """A commit notice within half a heartbeat interval of the follower's last answer goes
    unanswered (its answer would acknowledge nothing); later, and any append with entries or
    without a new commit key (a heartbeat), is answered."""
    entries = chain([TxKey(1, 1), TxKey(1, 2), TxKey(1, 3)])
    follower = Harness(name="b", entries=entries[:1], committed_key=TxKey(1, 1))
    follower.step(Ticked(), 1)
    answered = sends(follower.receive("a", append(1, entries[0], [entries[1]], commit_key=TxKey(1, 1)), 5), AppendReply)
    assert [m.match_key for _, m in answered] == [TxKey(1, 2)]
    notice = append(1, entries[1], [], commit_key=TxKey(1, 2))
    effects = follower.receive("a", notice, 5 + CONFIG.heartbeat_interval_ms // 2 - 1)
    assert of_type(effects, Commit) == [Commit(TxKey(1, 2))]
    assert sends(effects, AppendReply) == []
    heartbeat = append(1, entries[1], [], commit_key=TxKey(1, 2))
    assert len(sends(follower.receive("a", heartbeat), AppendReply)) == 1  # told nothing new: answered
    follower.receive("a", append(1, entries[1], [entries[2]], commit_key=TxKey(1, 2)))
    late = follower.now_ms + CONFIG.heartbeat_interval_ms // 2
    effects = follower.receive("a", append(1, entries[2], [], commit_key=TxKey(1, 3)), late)
    assert of_type(effects, Commit) == [Commit(TxKey(1, 3))]
    assert len(sends(effects, AppendReply)) == 1  # half a heartbeat interval since the last answer


def next_heartbeat(harness: Harness) -> int:
    """Tick a sequencer millisecond by millisecond until it sends heartbeats; return that time."""
    for now_ms in range(harness.now_ms + 1, harness.now_ms + 2 * CONFIG.heartbeat_interval_ms):
        if sends(harness.step(Ticked(), now_ms), AppendRequest):
            return now_ms
    raise AssertionError("no heartbeat within two heartbeat intervals")


def test_a_heartbeat_resends_appends_in_flight_only_once_unanswered_for_an_interval():
    """While a follower acknowledges, a heartbeat is an empty append at its match key (it does not
    make the follower decode and skip the entries in flight again); after a heartbeat interval
    without an acknowledgement, the heartbeat resends from the match key (an append was lost)."""
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.ack("c", TxKey(1, 1))
    heartbeat_ms = next_heartbeat(harness)
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"), heartbeat_ms + 1)
    sent_ms = harness.now_ms
    assert len(sends(harness.step(BatchEnded()), AppendRequest)) == 2
    heartbeats = sends(harness.step(Ticked(), heartbeat_ms + CONFIG.heartbeat_interval_ms), AppendRequest)
    assert sorted((to, m.prev_key, m.entries) for to, m in heartbeats) == [
        ("b", TxKey(1, 1), ()),
        ("c", TxKey(1, 1), ()),
    ]
    # b and c keep silent: at the next heartbeat the append is given up as lost.
    resent = sends(harness.step(Ticked(), heartbeat_ms + 2 * CONFIG.heartbeat_interval_ms), AppendRequest)
    assert harness.now_ms - sent_ms >= CONFIG.heartbeat_interval_ms
    assert sorted((to, m.prev_key, [e.tx_key for e in m.entries]) for to, m in resent) == [
        ("b", TxKey(1, 1), [TxKey(1, 2)]),
        ("c", TxKey(1, 1), [TxKey(1, 2)]),
    ]


def test_a_reply_to_an_empty_append_does_not_free_a_place_in_flight():
    """appends_in_flight_max bounds what a follower has unanswered: answers to commit notices or
    heartbeats (they acknowledge nothing new) must not let a further append go."""
    harness = Harness(config=dataclasses.replace(CONFIG, appends_in_flight_max=2))
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.ack("c", TxKey(1, 1))
    for number in range(2):
        harness.step(Proposed((WriteOp("t", {"k": number}),), f"w{number}"))
        assert [to for to, m in sends(harness.step(BatchEnded()), AppendRequest) if m.entries] == ["b", "c"]
    # b answers an empty append (nothing new acknowledged): both appends are still unanswered.
    harness.ack("b", TxKey(1, 1))
    harness.step(Proposed((WriteOp("t", {"k": 2}),), "w2"))
    assert [to for to, m in sends(harness.step(BatchEnded()), AppendRequest) if m.entries] == []
    # b answers the first append: one place is free, and the entry that waited goes to b.
    effects = harness.ack("b", TxKey(1, 2))
    assert [(to, [e.tx_key for e in m.entries]) for to, m in sends(effects, AppendRequest) if m.entries] == [
        ("b", [TxKey(1, 4)])
    ]


def test_a_turn_of_proposals_travels_in_one_append_per_follower():
    """Sixteen proposals of one loop turn: no append until BatchEnded, then one append per
    caught-up follower carrying all of them (not one append, and one round, per entry)."""
    harness = Harness(config=dataclasses.replace(CONFIG, entries_per_append_max=64, pending_proposals_max=64))
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.ack("c", TxKey(1, 1))
    proposed = []
    for number in range(16):
        effects = harness.step(Proposed((WriteOp("t", {"k": number}),), f"w{number}"))
        assert [m for _, m in sends(effects, AppendRequest) if m.entries] == []
        proposed.extend(of_type(effects, PersistEntries)[0].entries)
    appends = sends(harness.step(BatchEnded()), AppendRequest)
    assert sorted(to for to, _ in appends) == ["b", "c"]
    for _, message in appends:
        assert message.entries == tuple(proposed) and message.prev_key == TxKey(1, 1)
    assert harness.step(BatchEnded()) == []  # sent once
    committed = harness.ack("b", TxKey(1, 17))
    assert committed[0] == Commit(TxKey(1, 17)) and len(of_type(committed, ProposalCommitted)) == 16


def test_a_batch_of_proposals_is_logged_in_one_persist_and_equals_proposing_them_one_by_one():
    """ProposedBatch (the driver's turn of writes without guards): the same entries, keys, digests
    and refusals as one Proposed per write, in one PersistEntries; a refusal leaves the others."""
    config = dataclasses.replace(CONFIG, entries_per_append_max=64, pending_proposals_max=5, ops_per_entry_max=2)
    proposals = [Proposed((WriteOp("t", {"k": n}),) * (3 if n == 2 else 1), f"w{n}") for n in range(7)]
    one_by_one, batched = Harness(config=config), Harness(config=config)
    for harness in (one_by_one, batched):
        harness.elect()
        harness.ack("b", TxKey(1, 1))
    single_effects = [effect for proposal in proposals for effect in one_by_one.step(proposal)]
    batch_effects = batched.step(ProposedBatch(tuple(proposals)))
    persists = of_type(batch_effects, PersistEntries)
    assert len(persists) == 1
    assert persists[0].entries == tuple(e for p in of_type(single_effects, PersistEntries) for e in p.entries)
    assert [e.request_id for e in persists[0].entries] == ["w0", "w1", "w3", "w4", "w5"]
    rejected = of_type(batch_effects, ProposalRejected)
    assert rejected == of_type(single_effects, ProposalRejected)
    assert [(r.request_id, r.reason) for r in rejected] == [
        ("w2", REJECT_TOO_MANY_OPS),
        ("w6", REJECT_BUSY),
    ]
    assert sends(one_by_one.step(BatchEnded()), AppendRequest) == sends(batched.step(BatchEnded()), AppendRequest)
    follower = Harness(name="b", config=config)
    assert of_type(follower.step(ProposedBatch(tuple(proposals[:2]))), ProposalRejected) == [
        ProposalRejected("w0", REJECT_NOT_SEQUENCER, None),
        ProposalRejected("w1", REJECT_NOT_SEQUENCER, None),
    ]


@pytest.mark.parametrize("batched", [False, True])
def test_an_entry_over_entry_bytes_max_is_refused_and_the_log_goes_on_without_it(batched: bool):
    """An append carrying an entry larger than a follower's frame_bytes_max was refused by every
    follower at every resend (frame_too_large): the sequencer fenced itself and the shard committed
    nothing more. Such a proposal is refused instead, before it takes a key."""
    config = dataclasses.replace(CONFIG, entries_per_append_max=64, entry_bytes_max=2000)
    harness = Harness(config=config)
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    proposals = [Proposed((WriteOp("t", {"k": n, "v": "x" * (3000 if n == 1 else 10)}),), f"w{n}") for n in range(3)]
    effects = (
        harness.step(ProposedBatch(tuple(proposals)))
        if batched
        else [effect for proposal in proposals for effect in harness.step(proposal)]
    )
    assert of_type(effects, ProposalRejected) == [ProposalRejected("w1", REJECT_TOO_LARGE, "a")]
    logged = [entry for persist in of_type(effects, PersistEntries) for entry in persist.entries]
    assert [(entry.request_id, entry.tx_key) for entry in logged] == [("w0", TxKey(1, 2)), ("w2", TxKey(1, 3))]
    assert all(entry.size_bytes <= config.entry_bytes_max for entry in logged)
    appends = sends(harness.step(BatchEnded()), AppendRequest)
    appended = [entry.request_id for _, message in appends for entry in message.entries]
    assert appended == ["w0", "w2"]
    committed = harness.ack("b", TxKey(1, 3))
    assert [effect.request_id for effect in of_type(committed, ProposalCommitted)] == ["w0", "w2"]


def test_a_batch_is_cut_by_entries_per_append_max_and_appends_in_flight_max():
    config = dataclasses.replace(CONFIG, entries_per_append_max=4, appends_in_flight_max=2, pending_proposals_max=64)
    harness = Harness(config=config)
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    for number in range(10):
        harness.step(Proposed((), f"w{number}"))
    to_b = [m for to, m in sends(harness.step(BatchEnded()), AppendRequest) if to == "b"]
    # Two appends of four entries in flight; the last two entries wait for a reply.
    assert [[e.tx_key.counter for e in m.entries] for m in to_b] == [[2, 3, 4, 5], [6, 7, 8, 9]]
    follow_up = [m for to, m in sends(harness.ack("b", TxKey(1, 5)), AppendRequest) if to == "b"]
    assert [e.tx_key.counter for e in follow_up[0].entries] == [10, 11]


def test_a_sequencer_that_steps_down_before_batch_end_sends_nothing():
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.step(Proposed((), "w1"))
    harness.receive("b", VoteReply(7, False))  # a higher generation: step down
    assert sends(harness.step(BatchEnded()), AppendRequest) == []


def test_the_sequencer_counts_itself_only_once_its_own_append_is_durable():
    """Thesis 10.2.1: appends go out before the sequencer's own write is durable (``before_persisted``),
    and until ``Persisted`` the sequencer is not one of the majority: one follower is not enough."""
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.auto_persist = False
    harness.step(Proposed((), "w1"))
    appends = of_type(harness.step(BatchEnded()), Send)
    assert appends and all(effect.before_persisted for effect in appends)
    assert of_type(harness.ack("b", TxKey(1, 2)), Commit) == []  # b alone is not a majority of three
    assert harness.step(Persisted())[:2] == [Commit(TxKey(1, 2)), ProposalCommitted("w1", TxKey(1, 2))]


def test_appends_after_a_state_change_wait_for_it_to_be_durable():
    """A force start persists a new generation: its appends must not announce that generation before
    it is durable (a crash could take it back and let another core be sequencer of it)."""
    members = ("a", "b", "c", "d", "e")
    harness = Harness(members=members, state=PersistedState(3, None, members))
    harness.auto_persist = False
    effects = harness.step(ForceStartRequested((("b", 3),)))
    assert of_type(effects, PersistState) and of_type(effects, Send)
    assert not any(effect.before_persisted for effect in of_type(effects, Send))
    harness.step(Persisted())
    harness.step(Proposed((), "w1"))
    assert all(effect.before_persisted for effect in of_type(harness.step(BatchEnded()), Send))


def test_the_counter_restarts_at_one_in_each_generation():
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(entries=entries, state=PersistedState(4, None, MEMBERS))
    effects = harness.elect()
    assert of_type(effects, PersistEntries)[0].entries[0].tx_key == TxKey(5, 1)


def test_entries_of_an_earlier_generation_are_not_committed_by_counting_replicas():
    old = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(entries=old, state=PersistedState(2, None, MEMBERS), committed_key=TxKey(1, 1))
    harness.elect()  # generation 3, no-op at (3, 1)
    effects = harness.ack("b", TxKey(1, 2))  # a majority holds (1, 2), but it is of generation 1
    assert of_type(effects, Commit) == []
    assert harness.ack("b", TxKey(3, 1))[0] == Commit(TxKey(3, 1))


def test_a_full_proposal_queue_rejects_with_busy():
    harness = Harness()
    harness.elect()
    for number in range(CONFIG.pending_proposals_max):
        harness.step(Proposed((), f"w{number}"))
    assert harness.step(Proposed((), "late")) == [ProposalRejected("late", REJECT_BUSY, "a")]


def test_catch_up_appends_are_batched_up_to_entries_per_append_max():
    entries = chain([TxKey(1, n) for n in range(1, 8)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS))
    harness.elect()
    # b has nothing: it rejects the first probe and the sequencer resumes from b's last key.
    effects = harness.receive("b", AppendReply(2, False, ZERO_KEY, ZERO_KEY, ZERO_KEY))
    ((_, message),) = sends(effects, AppendRequest)
    assert message.prev_key == ZERO_KEY
    assert [e.tx_key for e in message.entries] == [TxKey(1, 1), TxKey(1, 2), TxKey(1, 3)]


def test_a_follower_behind_the_retained_log_needs_a_snapshot():
    entries = chain([TxKey(1, n) for n in range(1, 6)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS), committed_key=TxKey(1, 5))
    harness.log.trim_to(TxKey(1, 3))
    harness.elect()
    effects = harness.receive("b", AppendReply(2, False, ZERO_KEY, TxKey(1, 1), TxKey(1, 1)))
    assert of_type(effects, SnapshotNeeded) == [SnapshotNeeded("b", TxKey(1, 1), TxKey(1, 3))]
    assert sends(effects, AppendRequest) == []


@pytest.mark.parametrize(
    ("last_key", "commit_key"),
    [
        (TxKey(5, 9), TxKey(5, 9)),  # beyond the sequencer's log
        (TxKey(1, 1), TxKey(1, 2)),  # a commit key beyond the replier's own last key
    ],
)
def test_a_failed_append_reply_with_a_commit_key_the_sequencer_lacks_is_ignored(last_key, commit_key):
    """A follower resumes at its commit key, which every sequencer's log holds: one the log lacks is a
    hostile or broken peer, and must not make a heartbeat find no entry to send from (which raised
    ConsensusInvariantError and stopped the sequencer's node)."""
    harness = Harness(entries=chain([TxKey(1, 1)]), state=PersistedState(1, None, MEMBERS), committed_key=TxKey(1, 1))
    harness.elect()
    effects = harness.receive("b", AppendReply(2, False, ZERO_KEY, last_key, commit_key, harness.now_ms))
    assert [v.sender for v in of_type(effects, ProtocolViolation)] == ["b"]
    assert sends(effects, AppendRequest) == []
    for _ in range(3):  # heartbeats to b go on from where it was (before the fix: raised here)
        harness.ack("c", TxKey(2, 1))
        next_heartbeat(harness)
    harness.ack("b", TxKey(2, 1))
    assert harness.machine.role is Role.SEQUENCER
    assert dict(harness.machine.status().follower_match_keys)["b"] == TxKey(2, 1)


def test_the_sequencer_fences_itself_without_a_majority_and_fails_pending_proposals():
    harness = Harness()
    harness.elect()
    start = harness.now_ms
    harness.step(Proposed((), "w1"))
    harness.ack("b", TxKey(1, 1))  # b answers once; then silence from everyone
    harness.step(Ticked(), start + CONFIG.election_timeout_ms_min - 1)
    assert harness.machine.role is Role.SEQUENCER
    effects = harness.step(Ticked(), start + CONFIG.election_timeout_ms_min)
    assert harness.machine.role is Role.FOLLOWER
    (failed,) = of_type(effects, ProposalFailed)
    assert failed.request_id == "w1" and "fenced itself" in failed.reason
    assert of_type(harness.step(Proposed((), "w2")), ProposalRejected)[0].reason == REJECT_NOT_SEQUENCER


def test_no_heartbeat_goes_to_a_follower_fed_by_appends():
    """A follower that was sent entries and answered within the last heartbeat interval needs no
    heartbeat (the appends reset its election timer and feed the lease); one that did not answer
    gets one."""
    harness = Harness()
    harness.elect()
    heartbeat_ms = next_heartbeat(harness)
    harness.ack("b", TxKey(1, 1))
    harness.ack("c", TxKey(1, 1))
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"), heartbeat_ms + 1)
    assert len(sends(harness.step(BatchEnded()), AppendRequest)) == 2
    harness.ack("b", TxKey(1, 2))  # c does not answer
    harness.step(BatchEnded())
    while harness.machine.next_deadline_ms() < heartbeat_ms + CONFIG.heartbeat_interval_ms:
        harness.step(Ticked(), harness.machine.next_deadline_ms())  # the commit notices of (1, 2)
    effects = harness.step(Ticked(), heartbeat_ms + CONFIG.heartbeat_interval_ms)
    assert [(to, m.entries) for to, m in sends(effects, AppendRequest)] == [("c", ())]


def test_heartbeats_resend_unacknowledged_entries():
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.ack("c", TxKey(1, 1))
    harness.step(Proposed((), "w1"))  # suppose this append to b is lost
    resent, start_ms = {}, harness.now_ms
    while not resent.get("b", AppendRequest(0, ZERO_KEY, b"", ZERO_KEY, ())).entries:
        # The commit notice of (1, 1) first, then the heartbeat.
        assert harness.now_ms < start_ms + CONFIG.heartbeat_interval_ms
        resent = dict(sends(harness.step(Ticked(), harness.machine.next_deadline_ms()), AppendRequest))
    assert [e.tx_key for e in resent["b"].entries] == [TxKey(1, 2)]


def test_status_and_journal_age_report_the_sequencer_view():
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    status = harness.machine.status()
    assert status.role is Role.SEQUENCER and status.sequencer == "a" and status.generation == 1
    assert dict(status.follower_match_keys) == {"b": TxKey(1, 1), "c": ZERO_KEY}
    assert harness.machine.journal_age() == JournalAge(1, TxKey(1, 1), TxKey(1, 1))


# ---------------------------------------------------------------- replication at a follower


def test_a_follower_rejects_appends_of_a_stale_generation_and_persists_nothing():
    harness = Harness(state=PersistedState(3, None, MEMBERS))
    effects = harness.receive("b", append(2, None, chain([TxKey(2, 1)])))
    assert of_type(effects, PersistEntries) == []
    ((_, reply),) = sends(effects, AppendReply)
    assert reply.generation == 3 and not reply.success


def test_a_follower_accepts_only_if_prev_key_and_prev_digest_match():
    entries = chain([TxKey(1, 1), TxKey(1, 2), TxKey(1, 3)])
    harness = Harness(entries=entries[:1])
    missing = harness.receive("b", append(1, entries[1], entries[2:]))
    assert not sends(missing, AppendReply)[0][1].success
    forged = AppendRequest(1, TxKey(1, 1), bytes(32), ZERO_KEY, MEMBERS, tuple(entries[1:]))
    assert not sends(harness.receive("b", forged), AppendReply)[0][1].success
    accepted = harness.receive("b", append(1, entries[0], entries[1:]))
    assert sends(accepted, AppendReply)[0][1] == AppendReply(1, True, TxKey(1, 3), TxKey(1, 3), ZERO_KEY)
    assert harness.log.last_key() == TxKey(1, 3)


def test_a_follower_truncates_a_conflicting_uncommitted_tail():
    common = chain([TxKey(1, 1)])
    stale_tail = chain([TxKey(1, 2), TxKey(1, 3)], start=common[0])
    harness = Harness(entries=common + stale_tail, state=PersistedState(1, None, MEMBERS), committed_key=TxKey(1, 1))
    new_tail = chain([TxKey(2, 1)], start=common[0])
    effects = harness.receive("b", append(2, common[0], new_tail))
    assert TruncateLog(TxKey(1, 1)) in effects
    assert index_of(effects, TruncateLog) < index_of(effects, PersistEntries) < index_of(effects, Send)
    assert harness.log.keys == [TxKey(1, 1), TxKey(2, 1)]


def test_a_follower_never_truncates_a_committed_entry():
    common = chain([TxKey(1, 1)])
    committed = chain([TxKey(1, 2)], start=common[0])
    harness = Harness(entries=common + committed, state=PersistedState(1, None, MEMBERS), committed_key=TxKey(1, 2))
    with pytest.raises(ConsensusInvariantError):
        harness.receive("b", append(2, common[0], chain([TxKey(2, 1)], start=common[0])))


def test_a_reordered_older_append_does_not_truncate_matching_entries():
    entries = chain([TxKey(1, 1), TxKey(1, 2), TxKey(1, 3)])
    harness = Harness()
    harness.receive("b", append(1, None, entries))
    effects = harness.receive("b", append(1, None, entries[:1]))
    assert of_type(effects, TruncateLog) == [] and of_type(effects, PersistEntries) == []
    assert sends(effects, AppendReply)[0][1].match_key == TxKey(1, 1)
    assert harness.log.last_key() == TxKey(1, 3)


def test_a_follower_commits_up_to_the_smaller_of_the_sequencer_commit_and_the_verified_entries():
    entries = chain([TxKey(1, 1), TxKey(1, 2), TxKey(1, 3)])
    harness = Harness()
    effects = harness.receive("b", append(1, None, entries[:2], commit_key=TxKey(1, 3)))
    assert of_type(effects, Commit) == [Commit(TxKey(1, 2))]
    assert index_of(effects, PersistEntries) < index_of(effects, Commit)
    effects = harness.receive("b", append(1, entries[1], entries[2:], commit_key=TxKey(1, 2)))
    assert of_type(effects, Commit) == []


def test_a_follower_refuses_a_broken_digest_chain():
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    tampered = Entry("s", TxKey(1, 2), TxKey(1, 1), entries[1].digest, (WriteOp("t", {"k": "evil"}),), "r")
    harness = Harness()
    effects = harness.receive("b", append(1, None, [entries[0], tampered]))
    assert of_type(effects, ProtocolViolation) and of_type(effects, PersistEntries) == []


def test_a_follower_refuses_an_entry_of_another_shard():
    # The wire bounds an entry's shard but does not match its name: the machine refuses any not its own.
    first = chain([TxKey(1, 1)])[0]
    for shard in ("other", "not a name!"):
        stranger = make_entry(shard, TxKey(1, 2), first.tx_key, first.digest, (WriteOp("t", {"k": 1}),), "r")
        harness = Harness()
        effects = harness.receive("b", append(1, None, [first, stranger]))
        assert of_type(effects, ProtocolViolation) and of_type(effects, PersistEntries) == []


def test_a_follower_refuses_an_entry_of_a_later_generation_than_its_append():
    """Entries in a log never have a generation above their sequencer's: one that did would leave
    this core, once elected, unable to append (its first key would go back: make_entry raised)."""
    harness = Harness(name="b")
    effects = harness.receive("a", append(1, None, chain([TxKey(3, 1)])), now_ms=QUIET_AFTER_START_MS)
    assert [v.sender for v in of_type(effects, ProtocolViolation)] == ["a"]
    assert of_type(effects, PersistEntries) == [] and harness.machine.last_key == ZERO_KEY
    harness.campaign()
    for peer in ("a", "c"):
        harness.receive(peer, VoteReply(harness.machine.generation, True))
    assert harness.machine.role is Role.SEQUENCER


def test_a_follower_adopts_the_membership_of_a_force_started_sequencer():
    harness = Harness(name="b")
    message = AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, ("a", "b"), ())
    effects = harness.receive("a", message)
    assert harness.machine.members == ("a", "b")
    assert of_type(effects, PersistState)[-1].state.members == ("a", "b")


# ---------------------------------------------------------------- restart and force start


def test_after_a_restart_a_core_does_not_vote_twice_in_a_generation():
    harness = Harness()
    harness.receive("b", VoteRequest(1, ZERO_KEY), now_ms=QUIET_AFTER_START_MS)
    restarted = Harness(state=harness.state, entries=harness.log.entries)
    answer = restarted.receive("c", VoteRequest(1, ZERO_KEY), now_ms=QUIET_AFTER_START_MS)
    assert sends(answer, VoteReply) == [("c", VoteReply(1, False))]


def test_a_core_votes_for_nobody_during_the_first_election_timeout_after_it_starts():
    """It may have answered a sequencer's append just before it stopped; that sequencer's lease counts on it."""
    harness = Harness()
    assert sends(harness.receive("b", PreVoteRequest(1, ZERO_KEY)), PreVoteReply) == [("b", PreVoteReply(0, False))]
    assert sends(harness.receive("b", VoteRequest(1, ZERO_KEY)), VoteReply) == [("b", VoteReply(0, False))]
    assert harness.machine.generation == 0
    granted = harness.receive("b", VoteRequest(1, ZERO_KEY), now_ms=QUIET_AFTER_START_MS)
    assert sends(granted, VoteReply) == [("b", VoteReply(1, True))]


def test_a_restart_never_reuses_a_generation_seen_in_the_log():
    entries = chain([TxKey(4, 1)])
    harness = Harness(entries=entries, state=PersistedState(2, None, MEMBERS))
    assert harness.machine.generation == 4
    assert sends(harness.receive("c", VoteRequest(4, TxKey(9, 9))), VoteReply) == [("c", VoteReply(4, False))]
    harness.campaign()
    assert harness.state.generation == 5


FIVE = ("a", "b", "c", "d", "e")


def test_force_start_opens_a_generation_above_every_reached_one_with_the_reached_members():
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(members=FIVE, entries=entries, state=PersistedState(1, "b", FIVE), committed_key=TxKey(1, 1))
    # b has seen generation 7 (it campaigned while cut off): the forced generation must be above it.
    effects = harness.step(ForceStartRequested((("b", 7),)))
    assert effects[0] == PersistState(PersistedState(8, "a", ("a", "b"), forced=True))
    assert of_type(effects, ForceStarted) == [ForceStarted(8, ("a", "b"), TxKey(1, 2), TxKey(1, 1))]
    assert harness.machine.role is Role.SEQUENCER and harness.machine.status().forced
    assert [to for to, _ in sends(effects, AppendRequest)] == ["b"]
    assert harness.ack("b", TxKey(8, 1))[0] == Commit(TxKey(8, 1))


@pytest.mark.parametrize("forced", [False, True])
def test_an_elected_sequencer_of_a_forced_membership_records_it_again_in_its_first_entry(forced):
    """``membership.elected_first_ops`` through the machine: elected in a cluster whose committed
    membership is a forced start's, the sequencer's first entry is that membership again (a forced
    start's entry once committed: every member holding it is forced); otherwise its no-op."""
    members = ("a", "b")
    entries = chain([TxKey(3, 1), TxKey(3, 2)])
    state = PersistedState(3, None, members, forced=forced)
    harness = Harness(members=members, entries=entries, state=state, committed_key=TxKey(3, 2))
    effects = harness.elect()
    first = [entry for effect in of_type(effects, PersistEntries) for entry in effect.entries][0]
    assert first.tx_key == TxKey(harness.machine.generation, 1)
    assert first.ops == ((MembersOp(members),) if forced else ())


@pytest.mark.parametrize("reached", [(("b", 1),), (("b", 1), ("c", 1)), (("b", 0), ("b", 0))])
def test_force_start_is_refused_while_a_majority_of_members_is_reached(reached):
    harness = Harness()
    harness.elect()  # a healthy sequencer: forcing it would only lose the followers
    generation = harness.machine.generation
    effects = harness.step(ForceStartRequested(reached))
    [refused] = of_type(effects, ForceStartRefused)
    assert "majority" in refused.reason and set(refused.reached) >= {"a", "b"} and refused.members == MEMBERS
    assert effects == [refused]  # nothing persisted, nothing sent
    assert harness.machine.generation == generation and harness.machine.members == MEMBERS


def test_force_start_is_refused_while_a_reached_member_holds_more_of_the_log():
    """Five cores: b, c and d committed (1, 2) and (1, 3) while a was cut off; then c, d and e are
    lost for good. Forced at a, the new generation would be built on a log that lacks those
    acknowledged entries although b, reached, holds them: b could not follow it (its committed
    entries would be replaced: ``ConsensusInvariantError`` stops the shard there) and the forced pair
    {a, b} could then commit nothing. Forcing b instead loses nothing that forcing a would keep."""
    entries = chain([TxKey(1, 1), TxKey(1, 2), TxKey(1, 3)])
    state = PersistedState(1, None, FIVE)
    a = Harness(members=FIVE, entries=entries[:1], state=state, committed_key=TxKey(1, 1))
    effects = a.step(ForceStartRequested((("b", 1),), last_keys=(("b", TxKey(1, 3)),)))
    [refused] = of_type(effects, ForceStartRefused)
    assert "b holds the log up to (1, 3)" in refused.reason and "force-start b" in refused.reason
    assert effects == [refused]  # nothing persisted, nothing sent
    assert a.machine.generation == 1 and a.machine.members == FIVE and a.machine.role is Role.FOLLOWER
    # A longer log of an earlier generation is not ahead (the up-to-date rule of an election): a
    # core whose last entry is of a later generation holds every entry committed before it.
    later = Harness(
        members=FIVE, entries=[entries[0], *chain([TxKey(2, 1)], entries[0])], state=PersistedState(2, None, FIVE)
    )
    effects = later.step(ForceStartRequested((("b", 1),), last_keys=(("b", TxKey(1, 3)),)))
    assert of_type(effects, ForceStarted)
    # b, the most advanced, is forced and a follows it: every entry is kept.
    b = Harness(name="b", members=FIVE, entries=entries, state=state, committed_key=TxKey(1, 3))
    effects = b.step(ForceStartRequested((("a", 1), ("z", 1)), last_keys=(("a", TxKey(1, 1)), ("z", TxKey(9, 9)))))
    [forced] = of_type(effects, ForceStarted)
    assert forced.members == ("a", "b") and forced.last_key == TxKey(1, 3)
    requests = sends(effects, AppendRequest)
    assert [to for to, _ in requests] == ["a"]
    for _ in range(3):  # a lacks (1, 2): it says so, and b resends from where a stands
        replies = [reply for _, request in requests for reply in sends(a.receive("b", request), AppendReply)]
        requests = [sent for _, reply in replies for sent in sends(b.receive("a", reply), AppendRequest)]
    assert a.machine.last_key == b.machine.committed_key == TxKey(2, 1)
    assert [entry.tx_key for entry in a.log.entries] == [TxKey(1, 1), TxKey(1, 2), TxKey(1, 3), TxKey(2, 1)]


def test_force_start_is_refused_when_its_generation_would_pass_the_largest():
    """A reached peer's journal may report ``GENERATION_MAX`` (hostile, or a long-lived bug): a forced
    generation above it would be persisted, and the next campaign's would overflow the node's store."""
    harness = Harness(members=FIVE, state=PersistedState(3, None, FIVE))
    effects = harness.step(ForceStartRequested((("b", GENERATION_MAX),)))
    [refused] = of_type(effects, ForceStartRefused)
    assert "largest" in refused.reason and refused.reached == ("a", "b")
    assert effects == [refused]  # nothing persisted, nothing sent
    assert harness.machine.generation == 3 and harness.machine.members == FIVE
    effects = harness.step(ForceStartRequested((("b", GENERATION_MAX - 1),)))  # the last generation allowed
    assert of_type(effects, ForceStarted)[0].generation == GENERATION_MAX


def test_force_start_ignores_answers_from_cores_that_are_not_members():
    harness = Harness(members=FIVE, state=PersistedState(3, None, FIVE))
    effects = harness.step(ForceStartRequested((("b", 3), ("z", 99), ("y", 99))))
    assert of_type(effects, ForceStarted)[0].members == ("a", "b")
    assert harness.machine.generation == 4


def notice(generation: int, members: tuple[str, ...]) -> ExclusionNotice:
    return ExclusionNotice(generation, members, ZERO_KEY, None)


def test_a_core_told_of_a_newer_forced_generation_steps_down_fails_its_writes_and_stays_out():
    harness = Harness()
    harness.elect()
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    generation = harness.machine.generation
    for sender, members in (("b", ("a", "b")), ("z", ("z",))):
        assert of_type(harness.receive(sender, notice(generation + 5, members)), ProtocolViolation)
        assert harness.machine.role is Role.SEQUENCER and harness.machine.generation == generation
    effects = harness.receive("b", notice(generation + 5, ("b",)))
    assert harness.machine.role is Role.FOLLOWER and harness.machine.generation == generation + 5
    assert [f.request_id for f in of_type(effects, ProposalFailed)] == ["w1"]
    assert of_type(effects, Excluded) == [Excluded("b", generation + 5, ("b",), ZERO_KEY, None)]
    # It never campaigns again (it must be rebuilt before it rejoins).
    assert harness.step(Ticked(), harness.now_ms + 10 * CONFIG.election_timeout_ms_max) == []


def test_a_core_that_campaigned_past_the_forced_generation_still_stops_when_told():
    harness = Harness()
    for _ in range(3):
        harness.campaign()  # pre-votes granted each time: a candidate of generation 3 in the end
    effects = harness.receive("b", notice(2, ("b", "c")))
    assert of_type(effects, Excluded) and harness.machine.generation == 3
    assert harness.machine.role is Role.FOLLOWER
    assert harness.step(Ticked(), harness.now_ms + 10 * CONFIG.election_timeout_ms_max) == []


def test_a_forced_sequencer_tells_a_left_out_core_at_most_once_per_interval():
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS), committed_key=TxKey(1, 2))
    harness.step(ForceStartRequested(()))  # alone: members ("a",), generation 2
    effects = harness.receive("c", VoteRequest(7, TxKey(1, 1)), now_ms=10)
    [(to, told)] = sends(effects, ExclusionNotice)
    assert to == "c" and told == ExclusionNotice(2, ("a",), TxKey(1, 1), entries[0].digest)
    assert harness.machine.generation == 2  # a non-member's generation is not adopted
    assert not sends(harness.receive("c", VoteRequest(8, TxKey(1, 1)), now_ms=500), ExclusionNotice)
    later = 10 + EXCLUSION_NOTICE_INTERVAL_MS
    assert sends(
        harness.receive("c", AppendReply(8, False, ZERO_KEY, TxKey(9, 9), ZERO_KEY), now_ms=later), ExclusionNotice
    )
    assert sends(harness.receive("b", VoteRequest(7, TxKey(1, 1)), now_ms=later), ExclusionNotice)


def _forced_pair() -> tuple[Harness, Harness, list[Entry]]:
    """Five cores; ``a`` force-started with ``b`` (c, d and e not reached), and b holds the forced
    generation's entry committed: (a, b, the entries both held before)."""
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    a, b = (
        Harness(name, members=FIVE, entries=entries, state=PersistedState(1, None, FIVE), committed_key=TxKey(1, 2))
        for name in ("a", "b")
    )
    requests = sends(a.step(ForceStartRequested((("b", 1),), last_keys=(("b", TxKey(1, 2)),))), AppendRequest)
    for _ in range(3):  # the forced entry, b's answer, and the commit notice a heartbeat carries
        replies = [reply for _, request in requests for reply in sends(b.receive("a", request), AppendReply)]
        requests = [sent for _, reply in replies for sent in sends(a.receive("b", reply), AppendRequest)]
        requests += sends(a.step(Ticked(), a.now_ms + CONFIG.heartbeat_interval_ms), AppendRequest)
    assert b.machine.committed_key == TxKey(2, 1) and b.machine.committed_members == ("a", "b")
    return a, b, entries


def test_every_member_of_a_forced_generation_tells_a_left_out_core_also_after_a_restart():
    """Only the forced core told a left-out core that it was left out: once it died, a left-out core
    that came back kept campaigning, unanswered, and kept serving its stale log, though the other
    member of the forced generation heard it. The forced generation's first entry records the forced
    membership: each member, once it is committed, tells a left-out core, and persists it."""
    _, b, entries = _forced_pair()
    assert b.machine.status().forced and b.state.forced
    effects = b.receive("c", PreVoteRequest(2, TxKey(1, 2)), now_ms=b.now_ms + 10)
    [(to, told)] = sends(effects, ExclusionNotice)
    assert to == "c" and told == ExclusionNotice(2, ("a", "b"), TxKey(1, 2), entries[1].digest)
    restarted = Harness("b", entries=b.log.entries, state=b.state, committed_key=b.machine.committed_key)
    assert sends(restarted.receive("c", VoteRequest(3, TxKey(1, 2)), now_ms=10), ExclusionNotice)


def test_a_core_added_back_ignores_a_notice_from_a_member_that_has_not_heard_of_its_add_yet():
    """A member of the forced generation that has not persisted the entry adding a left-out core back
    still sees it outside its membership: its notice (at its own last key, a key of our log with the
    same digest, before the entry that names us) says it is behind, not that we are out."""
    a, b, _ = _forced_pair()
    c = Harness("c", members=FIVE, entries=list(a.log.entries), state=PersistedState(2, None, FIVE))
    forced_digest = a.log.digest_at(TxKey(2, 1))
    add = make_entry("s", TxKey(2, 2), TxKey(2, 1), forced_digest, (MembersOp(("a", "b", "c"), "c"),), "m")
    c.receive("a", AppendRequest(2, TxKey(2, 1), forced_digest, TxKey(2, 1), ("a", "b"), (add,)))
    assert c.machine.members == ("a", "b", "c")
    behind = ExclusionNotice(2, ("a", "b"), TxKey(2, 1), b.log.digest_at(TxKey(2, 1)))
    assert not of_type(c.receive("b", behind), Excluded) and not c.machine.excluded
    # A notice at a key where our logs differ (or at our last key) is believed.
    diverged = ExclusionNotice(2, ("a", "b"), TxKey(2, 1), b"x" * 32)
    assert of_type(c.receive("b", diverged), Excluded) and c.machine.excluded


def test_a_left_out_core_stays_out_across_a_restart_until_the_entry_that_adds_it_back():
    """The exclusion lived only in the machine: restarted, a left-out core was a follower again (its
    driver served local reads of a state that no longer moves) until a member of the forced generation
    told it again. It is persisted with the consensus state, so a machine built from that state is out
    from its first turn; the entry that adds it back ends it, and that is persisted too."""
    a, _, entries = _forced_pair()
    c = Harness(
        "c", members=FIVE, entries=list(entries), state=PersistedState(1, None, FIVE), committed_key=TxKey(1, 2)
    )
    effects = c.receive("a", ExclusionNotice(2, ("a", "b"), TxKey(1, 2), entries[1].digest))
    assert of_type(effects, Excluded) and c.state.excluded_generation == 2
    assert index_of(effects, PersistState) < index_of(effects, Excluded)

    restarted = Harness("c", members=FIVE, entries=list(c.log.entries), state=c.state, committed_key=TxKey(1, 2))
    assert restarted.machine.excluded and restarted.machine.excluded_generation == 2
    assert restarted.step(Ticked(), 10 * CONFIG.election_timeout_ms_max) == [], "it never campaigns"

    # cluster add-core: a replicates its log to c as a learner (c stays out), then the entry adding c.
    forced = next(entry for entry in a.log.entries if entry.tx_key == TxKey(2, 1))
    restarted.receive("a", AppendRequest(2, TxKey(1, 2), entries[1].digest, forced.tx_key, ("a", "b"), (forced,)))
    assert restarted.machine.excluded and restarted.state.excluded_generation == 2
    add = make_entry("s", TxKey(2, 2), forced.tx_key, forced.digest, (MembersOp(("a", "b", "c"), "c"),), "m")
    effects = restarted.receive("a", AppendRequest(2, forced.tx_key, forced.digest, forced.tx_key, ("a", "b"), (add,)))
    assert not restarted.machine.excluded and restarted.machine.excluded_generation is None
    assert index_of(effects, PersistEntries) < index_of(effects, PersistState)
    assert restarted.state.excluded_generation is None
    again = Harness("c", entries=list(restarted.log.entries), state=restarted.state, committed_key=forced.tx_key)
    assert not again.machine.excluded


def test_a_follower_waiting_for_a_snapshot_still_gets_heartbeats_and_is_found_again_after_it():
    entries = chain([TxKey(1, n) for n in range(1, 6)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS), committed_key=TxKey(1, 5))
    harness.log.trim_to(TxKey(1, 3))
    harness.elect()
    harness.receive("b", AppendReply(2, False, ZERO_KEY, TxKey(1, 1), TxKey(1, 1)))
    heartbeat = harness.step(Ticked(), harness.machine.next_deadline_ms())
    beat = dict(sends(heartbeat, AppendRequest))["b"]
    assert beat.prev_key == TxKey(2, 1) and beat.entries == ()
    # b installed a snapshot at (1, 5): it rejects the beat, and the sequencer resumes from there.
    resumed = harness.receive("b", AppendReply(2, False, ZERO_KEY, TxKey(1, 5), TxKey(1, 5)))
    ((_, message),) = sends(resumed, AppendRequest)
    assert message.prev_key == TxKey(1, 5) and [e.tx_key for e in message.entries] == [TxKey(2, 1)]


# ---------------------------------------------------------------- pre-vote and stickiness (thesis 9.6, 4.2.3)


def test_a_follower_that_times_out_first_asks_for_pre_votes_and_persists_nothing():
    harness = Harness(state=PersistedState(3, None, MEMBERS))
    effects = harness.step(Ticked(), harness.machine.next_deadline_ms())
    assert sorted(sends(effects, PreVoteRequest)) == [
        ("b", PreVoteRequest(4, ZERO_KEY)),
        ("c", PreVoteRequest(4, ZERO_KEY)),
    ]
    assert of_type(effects, PersistState) == [] and sends(effects, VoteRequest) == []
    assert harness.machine.generation == 3 and harness.machine.role is Role.FOLLOWER


def test_only_a_majority_of_pre_votes_starts_the_real_election():
    harness = Harness()
    harness.step(Ticked(), harness.machine.next_deadline_ms())
    assert harness.receive("b", PreVoteReply(0, False)) == []
    assert harness.receive("c", PreVoteReply(2, True)) == []  # not the generation asked about
    effects = harness.receive("c", PreVoteReply(1, True))
    assert harness.machine.role is Role.CANDIDATE and harness.state.generation == 1
    assert sorted(sends(effects, VoteRequest)) == [("b", VoteRequest(1, ZERO_KEY)), ("c", VoteRequest(1, ZERO_KEY))]


def test_a_pre_vote_is_granted_without_persisting_or_adopting_anything():
    harness = Harness(state=PersistedState(2, None, MEMBERS))
    deadline = harness.machine.next_deadline_ms()
    effects = harness.receive("b", PreVoteRequest(3, ZERO_KEY), now_ms=QUIET_AFTER_START_MS)
    assert sends(effects, PreVoteReply) == [("b", PreVoteReply(3, True))]
    assert of_type(effects, PersistState) == []
    assert harness.machine.generation == 2 and harness.machine.next_deadline_ms() == deadline


def test_a_pre_vote_is_refused_to_a_candidate_whose_log_is_behind():
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS))
    assert sends(harness.receive("b", PreVoteRequest(2, TxKey(1, 1))), PreVoteReply) == [("b", PreVoteReply(1, False))]


def test_a_core_that_hears_its_sequencer_refuses_pre_votes_and_ignores_vote_requests():
    """A paused, restarted or partitioned core cannot depose a healthy sequencer (thesis 4.2.3)."""
    harness = Harness()
    harness.receive("b", append(1, None, []), now_ms=10)
    refused = harness.receive("c", PreVoteRequest(2, TxKey(9, 9)), now_ms=10 + CONFIG.election_timeout_ms_min - 1)
    assert sends(refused, PreVoteReply) == [("c", PreVoteReply(1, False))]
    ignored = harness.receive("c", VoteRequest(5, TxKey(9, 9)))
    assert sends(ignored, VoteReply) == [("c", VoteReply(1, False))]
    assert of_type(ignored, PersistState) == []
    assert harness.machine.generation == 1 and harness.machine.sequencer == "b"
    # Once the sequencer was not heard for the minimum election timeout, the vote is granted.
    harness.step(Ticked(), 10 + CONFIG.election_timeout_ms_min)
    granted = harness.receive("c", VoteRequest(5, TxKey(9, 9)))
    assert sends(granted, VoteReply) == [("c", VoteReply(5, True))]


def test_the_sequencer_ignores_vote_requests_while_it_leads():
    harness = Harness()
    harness.elect()
    effects = harness.receive("b", VoteRequest(7, TxKey(9, 9)))
    assert sends(effects, VoteReply) == [("b", VoteReply(1, False))]
    assert harness.machine.role is Role.SEQUENCER and harness.machine.generation == 1


def test_a_refused_vote_does_not_reset_the_election_timer():
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS))
    deadline = harness.machine.next_deadline_ms()
    refused = harness.receive("b", VoteRequest(2, TxKey(1, 1)), now_ms=deadline - 1)
    assert sends(refused, VoteReply) == [("b", VoteReply(2, False))]
    assert harness.machine.next_deadline_ms() == deadline
    # The core with the longer log times out as planned and can win.
    assert sends(harness.step(Ticked(), deadline), PreVoteRequest)


def test_a_refused_pre_vote_of_a_higher_generation_is_adopted():
    harness = Harness()
    harness.step(Ticked(), harness.machine.next_deadline_ms())
    harness.receive("b", PreVoteReply(6, False))
    assert harness.machine.generation == 6 and harness.state.generation == 6


# ---------------------------------------------------------------- linearizable reads (thesis 6.4)


def test_a_new_sequencer_serves_no_read_before_an_entry_of_its_generation_commits():
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness = Harness(entries=entries, state=PersistedState(1, None, MEMBERS), committed_key=TxKey(1, 1))
    harness.elect()
    harness.receive("b", AppendReply(2, False, ZERO_KEY, TxKey(1, 1), TxKey(1, 1)))
    # b answered this generation (the lease holds), but the no-op (2, 1) has not committed yet:
    # (1, 2) may have been acknowledged by the previous sequencer, and our committed key is (1, 1).
    assert harness.machine.read_index(harness.now_ms) is None
    harness.ack("b", TxKey(2, 1))
    assert harness.machine.read_index(harness.now_ms) == TxKey(2, 1)


def test_the_read_lease_lasts_half_an_election_timeout_after_the_acknowledgements():
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    acknowledged_ms = harness.now_ms
    lease_ms = CONFIG.election_timeout_ms_min // 2
    assert harness.machine.read_index(acknowledged_ms + lease_ms - 1) == TxKey(1, 1)
    assert harness.machine.read_index(acknowledged_ms + lease_ms) is None


def test_the_read_lease_counts_only_answers_to_this_generations_appends():
    harness = Harness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    later = harness.now_ms + CONFIG.election_timeout_ms_min // 2
    harness.step(Ticked(), later)
    # Frames that say nothing about this generation's appends: a stale reply, a pre-vote, a vote.
    harness.receive("b", AppendReply(0, True, ZERO_KEY, ZERO_KEY, ZERO_KEY))
    harness.receive("c", PreVoteRequest(2, ZERO_KEY))
    harness.receive("c", VoteReply(1, True))
    assert harness.machine.read_index(later) is None
    harness.receive("c", AppendReply(1, True, TxKey(1, 1), TxKey(1, 1), ZERO_KEY, later))
    assert harness.machine.read_index(later) == TxKey(1, 1)


def test_the_read_lease_counts_from_when_the_answered_append_was_sent_not_when_the_answer_arrived():
    harness = Harness()
    harness.elect()
    sent_ms = harness.now_ms
    harness.step(Ticked(), sent_ms + CONFIG.election_timeout_ms_min)
    # An answer that waited in a queue (or a paused sequencer's inbox) proves nothing recent.
    harness.receive("b", AppendReply(1, True, TxKey(1, 1), TxKey(1, 1), ZERO_KEY, sent_ms))
    assert harness.machine.read_index(harness.now_ms) is None
    # A peer cannot stretch the lease by echoing a time in the future either.
    harness.receive("b", AppendReply(1, True, TxKey(1, 1), TxKey(1, 1), ZERO_KEY, 10**9))
    assert harness.machine.read_index(harness.now_ms + CONFIG.election_timeout_ms_min // 2) is None


def test_appends_carry_their_send_time_and_replies_echo_it():
    harness = Harness()
    effects = harness.elect()
    assert all(message.sent_ms == harness.now_ms for _, message in sends(effects, AppendRequest))
    follower = Harness(name="b")
    reply = follower.receive("a", AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, MEMBERS, (), 1234))
    assert [message.request_sent_ms for _, message in sends(reply, AppendReply)] == [1234]


def test_only_the_sequencer_serves_linearizable_reads():
    harness = Harness()
    harness.receive("b", append(1, None, []))
    assert harness.machine.read_index(harness.now_ms) is None


def test_a_follower_whose_election_timeout_expires_stops_naming_its_sequencer():
    harness = Harness()
    harness.receive("b", append(1, None, []))
    effects = harness.step(Ticked(), harness.machine.next_deadline_ms())
    assert harness.machine.sequencer is None and RoleChanged(Role.FOLLOWER, 1, None) in effects
    assert sends(effects, PreVoteRequest)


def test_a_sequencer_that_retains_the_followers_position_offers_a_snapshot_when_asked():
    """Regression: a sequencer offered a snapshot only while its log was trimmed past a follower's
    position, so a follower whose install was abandoned (its rows half copied) under a sequencer that
    retains its position never got another offer. Asked (``SnapshotRequested``), the sequencer now
    offers one at most once a heartbeat interval; a follower, or a sequencer asked by a core it does
    not replicate to, offers nothing."""
    from mnesite.core.consensus import SnapshotRequested

    harness = Harness("a")
    assert of_type(harness.step(SnapshotRequested("b")), SnapshotNeeded) == []  # not the sequencer
    harness.elect()
    assert harness.log.trimmed_key() == ZERO_KEY  # it retains everything
    asked_ms = harness.now_ms
    effects = harness.step(SnapshotRequested("b"), asked_ms)
    assert of_type(effects, SnapshotNeeded) == [SnapshotNeeded("b", ZERO_KEY, ZERO_KEY, requested=True)]
    assert of_type(harness.step(SnapshotRequested("b"), asked_ms + 1), SnapshotNeeded) == []  # rate-limited
    later = asked_ms + CONFIG.heartbeat_interval_ms
    assert len(of_type(harness.step(SnapshotRequested("b"), later), SnapshotNeeded)) == 1
    assert of_type(harness.step(SnapshotRequested("z"), later), SnapshotNeeded) == []  # not a follower of it


def test_a_core_that_lost_its_log_votes_only_for_a_candidate_at_its_recovered_floor():
    """A core rebuilt on an empty database (a lost disk, ``mnesite`` docs: "rebuild it (empty data
    directory)") may have held entries that are committed because it held them: the entry at (1, 2)
    below was persisted by the sequencer and this core, a majority of three, and acknowledged. With an
    empty log it counted every candidate up to date, so the third core, which never had that entry,
    won its vote, became sequencer and truncated the entry from the old sequencer's log: an
    acknowledged write lost to one lost disk. The recovered floor (``PersistedState.vote_floor``, the
    highest log key its peers reported when it recovered) stands in for the log it lost."""
    floor = TxKey(1, 2)
    recovered = PersistedState(1, "a", MEMBERS, vote_floor=floor)
    harness = Harness(state=recovered)
    behind = harness.receive("c", VoteRequest(2, TxKey(1, 1)), now_ms=QUIET_AFTER_START_MS)
    assert sends(behind, VoteReply) == [("c", VoteReply(2, False))]
    pre_behind = Harness(state=recovered).receive("c", PreVoteRequest(2, TxKey(1, 1)), now_ms=QUIET_AFTER_START_MS)
    assert sends(pre_behind, PreVoteReply) == [("c", PreVoteReply(1, False))]
    at_floor = Harness(state=recovered).receive("b", VoteRequest(2, floor), now_ms=QUIET_AFTER_START_MS)
    assert sends(at_floor, VoteReply) == [("b", VoteReply(2, True))]
    # The floor is persisted with the rest of the state (a restart before it caught up keeps it).
    assert of_type(at_floor, PersistState)[-1].state.vote_floor == floor
    # Once its own log holds entries past the floor, its log decides, as for any core.
    caught_up = Harness(entries=chain([TxKey(1, 1), TxKey(1, 2), TxKey(1, 3)]), state=recovered)
    refused = caught_up.receive("b", VoteRequest(2, floor), now_ms=QUIET_AFTER_START_MS)
    assert sends(refused, VoteReply) == [("b", VoteReply(2, False))]


def test_a_core_below_its_vote_floor_never_campaigns():
    """Its vote for itself is not judged by the floor: a rebuilt core that campaigned while its log was
    behind it could win with the vote of a core as far behind, and truncate committed entries."""
    harness = Harness(entries=chain([TxKey(1, 1)]), state=PersistedState(1, "a", MEMBERS, vote_floor=TxKey(1, 5)))
    effects = harness.step(Ticked(), harness.machine.next_deadline_ms())
    assert sends(effects, PreVoteRequest) == [] and harness.machine.role is Role.FOLLOWER
    assert harness.machine.next_deadline_ms() > harness.now_ms  # it does not spin on a passed deadline
    caught_up = Harness(
        entries=chain([TxKey(1, 1), TxKey(1, 5)]), state=PersistedState(1, "a", MEMBERS, vote_floor=TxKey(1, 5))
    )
    effects = caught_up.step(Ticked(), caught_up.machine.next_deadline_ms())
    assert {to for to, _ in sends(effects, PreVoteRequest)} == {"b", "c"}


# ---------------------------------------------------------------- lazy followers (thrifty replication)

LAZY = dataclasses.replace(CONFIG, lazy_feed_interval_ms=10)


class LazyHarness(Harness):
    """Sequencer ``a`` whose no-op every follower acknowledged at ``base`` (its election's time, when
    every follower was last sent entries); times below are ms after ``base``."""

    def __init__(self, members: tuple[str, ...] = MEMBERS, config: ConsensusConfig = LAZY) -> None:
        super().__init__(members=members, config=config)
        self.elect()
        for peer in members[1:]:
            self.ack(peer, TxKey(1, 1))
        self.base = self.now_ms

    def propose(self, k: int, at_ms: int, ops: tuple | None = None) -> list:
        """One proposal in a turn of its own: the effects of its BatchEnded."""
        self.step(Proposed(ops or (WriteOp("t", {"k": k}),), f"w{k}"), self.base + at_ms)
        return self.step(BatchEnded())

    def tick(self, at_ms: int) -> list:
        return self.step(Ticked(), self.base + at_ms)

    def answer(self, peer: str, key: TxKey, at_ms: int) -> list:
        self.now_ms = self.base + at_ms
        return self.ack(peer, key)


def appended(effects: list) -> list[tuple[str, list[TxKey]]]:
    """The appends with entries among ``effects`` (heartbeats and commit notices left out)."""
    return sorted(
        (to, [entry.tx_key for entry in message.entries])
        for to, message in sends(effects, AppendRequest)
        if message.entries
    )


def test_a_batch_goes_at_once_only_to_the_follower_the_commit_needs():
    """Of two followers, one is eager (a commit needs the sequencer and one follower) and gets each
    batch at once; the lazy one gets what accumulated once its interval is over, in one append, and
    the tick at ``next_deadline_ms`` is what sends it. Equals rank by name: ``b`` is eager."""
    harness = LazyHarness()
    assert appended(harness.propose(2, 1)) == [("b", [TxKey(1, 2)])]
    harness.answer("b", TxKey(1, 2), 2)
    assert harness.machine.committed_key == TxKey(1, 2)  # the eager follower's answer commits
    assert appended(harness.propose(3, 3)) == [("b", [TxKey(1, 3)])]
    assert harness.machine.next_deadline_ms() == harness.base + 10
    assert appended(harness.tick(9)) == []
    assert appended(harness.tick(10)) == [("c", [TxKey(1, 2), TxKey(1, 3)])]
    # Fed: the next batch goes to b alone again.
    assert appended(harness.propose(4, 11)) == [("b", [TxKey(1, 4)])]


def test_with_the_interval_at_zero_every_follower_gets_every_batch():
    harness = LazyHarness(config=dataclasses.replace(LAZY, lazy_feed_interval_ms=0))
    assert appended(harness.propose(2, 1)) == [("b", [TxKey(1, 2)]), ("c", [TxKey(1, 2)])]


def test_an_eager_follower_that_goes_silent_is_replaced_by_the_lazy_one():
    """The lazy follower's next feed commits what the silent eager one never answered; its answer puts
    its match key past the silent one's, and from the next batch on it is the eager one."""
    harness = LazyHarness()
    harness.propose(2, 1)  # to b, which never answers again
    harness.propose(3, 2)
    assert harness.machine.committed_key == TxKey(1, 1)
    assert appended(harness.tick(10)) == [("c", [TxKey(1, 2), TxKey(1, 3)])]
    harness.answer("c", TxKey(1, 3), 11)
    assert harness.machine.committed_key == TxKey(1, 3)  # no write waited on b past the interval
    assert appended(harness.propose(4, 12)) == [("c", [TxKey(1, 4)])]  # c eager; b lazy, not due


def test_a_follower_that_turns_eager_is_fed_at_once():
    """b stops answering; once its appends went unanswered for an interval, c takes its place at the
    next batch, which sends c everything since its last feed, not only the batch."""
    harness = LazyHarness()
    harness.propose(2, 1)
    assert appended(harness.tick(10)) == [("c", [TxKey(1, 2)])]
    assert appended(harness.propose(3, 10)) == [("b", [TxKey(1, 3)])]  # b waits 9 ms: not stalled
    harness.answer("c", TxKey(1, 2), 11)
    assert appended(harness.propose(4, 12)) == [("c", [TxKey(1, 3), TxKey(1, 4)])]


def test_an_eager_follower_that_answers_keeps_its_place_when_the_lazy_one_gets_ahead():
    """At one client the lazy follower's answer to a feed often comes before the eager one's answer
    to the same write: that alone swaps nothing (each swap would cost a feed)."""
    harness = LazyHarness()
    harness.propose(2, 5)
    assert appended(harness.tick(10)) == [("c", [TxKey(1, 2)])]
    harness.answer("c", TxKey(1, 2), 11)  # c is ahead of b, which has waited 6 ms
    assert appended(harness.propose(3, 12)) == [("b", [TxKey(1, 3)])]


def test_a_lazy_follower_far_behind_is_sent_more_with_each_answer():
    """Catching up (a full append or more behind), a lazy follower's answers are sent more at once,
    as any follower's; once within an append of the end it waits for its interval again."""
    harness = LazyHarness()
    for k in range(2, 10):  # 8 entries, sent to b alone, which answers each
        harness.propose(k, 1)
        harness.answer("b", TxKey(1, k), 1)
    fed = appended(harness.tick(10))  # as many appends as may be in flight (2), 3 entries each
    assert fed == [("c", [TxKey(1, 2), TxKey(1, 3), TxKey(1, 4)]), ("c", [TxKey(1, 5), TxKey(1, 6), TxKey(1, 7)])]
    # 2 entries left, within an append of the end: the answer sends nothing more.
    assert appended(harness.answer("c", TxKey(1, 4), 11)) == []
    harness.propose(10, 12)
    harness.propose(11, 12)
    # 4 left now, a full append (3) or more: the next answer is sent more at once.
    assert appended(harness.answer("c", TxKey(1, 7), 13)) == [("c", [TxKey(1, 8), TxKey(1, 9), TxKey(1, 10)])]


def test_a_batch_with_a_table_goes_to_every_follower_at_once():
    """A client told that its table exists may next write to it through any core."""
    harness = LazyHarness()
    harness.propose(2, 1)
    create = CreateTableOp("t2", "s", "id", (("id", "INTEGER"),))
    assert appended(harness.propose(3, 2, (create,))) == [("b", [TxKey(1, 3)]), ("c", [TxKey(1, 2), TxKey(1, 3)])]


def test_five_voters_have_two_eager_and_two_lazy_followers():
    harness = LazyHarness(("a", "b", "c", "d", "e"))
    harness.propose(2, 1)  # to b and c (equals: by name)
    for peer in ("d", "e"):
        harness.answer(peer, TxKey(1, 1), 2)
    harness.answer("b", TxKey(1, 2), 2)
    harness.answer("c", TxKey(1, 2), 2)
    assert appended(harness.propose(3, 3)) == [("b", [TxKey(1, 3)]), ("c", [TxKey(1, 3)])]
    assert appended(harness.tick(10)) == [("d", [TxKey(1, 2), TxKey(1, 3)]), ("e", [TxKey(1, 2), TxKey(1, 3)])]


def test_a_read_index_asked_feeds_the_lazy_followers_at_once():
    """A core that asked for a read index waits to apply that key: a lazy follower must not make it
    wait for the rest of its interval (the driver steps ``FeedRequested`` as it answers)."""
    harness = LazyHarness()
    harness.propose(2, 1)
    harness.propose(3, 2)
    assert appended(harness.step(FeedRequested(), harness.base + 3)) == [("c", [TxKey(1, 2), TxKey(1, 3)])]
    assert appended(harness.step(FeedRequested(), harness.base + 4)) == []  # nothing more to send
    follower = Harness(name="b", config=LAZY)
    assert follower.step(FeedRequested()) == []  # only a sequencer feeds


def test_the_lazy_feed_interval_may_be_zero_but_not_negative():
    assert ConsensusConfig(lazy_feed_interval_ms=0).lazy_feed_interval_ms == 0
    with pytest.raises(ConsensusConfigError, match="lazy_feed_interval_ms"):
        ConsensusConfig(lazy_feed_interval_ms=-1)
