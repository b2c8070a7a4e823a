"""Membership changes through the log (issue 14, ``core.membership``): the pure rule, the wire
form of a membership entry, and the simulator under faults with a mutation it must catch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgpack
import msgspec
import pytest
from mnesite.core import membership
from mnesite.core.consensus import (
    REJECT_NOT_SEQUENCER,
    AppendReply,
    AppendRequest,
    BatchEnded,
    Commit,
    ExclusionNotice,
    ForceStarted,
    ForceStartRequested,
    LearnerRefused,
    MembershipChangeRequested,
    PendingRemoval,
    Persisted,
    PersistEntries,
    PersistState,
    PreVoteRequest,
    ProposalCommitted,
    ProposalFailed,
    ProposalRejected,
    Proposed,
    Role,
    RoleChanged,
    ShardConsensus,
    Ticked,
    TruncateLog,
    VoteRequest,
)
from mnesite.core.snapshot import SnapshotOffer, exclusion_after_install, reads_forced_offer, state_after_install
from mnesite.rlog.messages import MessageError, decode_ops, typed_body
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    MEMBERS_OP_MAX,
    ZERO_KEY,
    MembersOp,
    TxKey,
    WriteOp,
    decode_op,
    make_entry,
)

from tests.conftest import ScriptedNode, simulation_seeds
from tests.sim import SimulationFailure
from tests.sim.membership import MembershipSimulation, run_membership_seed
from tests.test_consensus import CONFIG, Harness, chain, of_type, sends

CI_SEEDS = 40
FAST_SEEDS = 10  # the developers' fast lane runs these; the others are marked deep


class TurnHarness(Harness):
    """The harness as the driver's loop turn (core/node.py ``run_turn``, tests/sim/cluster.py): the
    event, then ``BatchEnded`` at a sequencer (the turn's appends go out, before they are durable
    here), then ``Persisted`` once the turn's commit made its writes durable."""

    def step(self, event, now_ms: int | None = None) -> list:
        auto_persist, self.auto_persist = self.auto_persist, False
        try:
            effects = super().step(event, now_ms)
            if self.machine.role is Role.SEQUENCER:
                effects = effects + super().step(BatchEnded())
        finally:
            self.auto_persist = auto_persist
        persisted = any(isinstance(effect, (PersistEntries, TruncateLog, PersistState)) for effect in effects)
        if persisted and self.auto_persist and self.machine.role is Role.SEQUENCER:
            effects = effects + self.machine.step(Persisted(), self.now_ms)
        return effects


def _elected() -> Harness:
    """``a`` is sequencer of {a, b, c} and its no-op (1, 1) committed (acknowledged by b)."""
    harness = TurnHarness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    assert harness.machine.committed_key == TxKey(1, 1)
    return harness


def _membership_entries(effects: list) -> list:
    return [e for p in of_type(effects, PersistEntries) for e in p.entries if membership.membership_of(e)]


def _remove(harness: Harness, name: str, request_id: str, answering: tuple[str, ...] = ("b",), key=None) -> list:
    """Ask ``harness``'s sequencer to remove ``name``: nothing is appended until a majority of the set it
    leaves answered an append sent since (``membership.removal_heard``); here ``answering`` acknowledge
    ``key`` (the no-op by default) after the heartbeat the request brought forward. All the effects."""
    # A millisecond after the no-op's acknowledgement: what answered before does not count.
    effects = harness.step(MembershipChangeRequested(name, add=False, request_id=request_id), harness.now_ms + 1)
    assert not _membership_entries(effects)
    harness.step(Ticked())
    effects = []
    for peer in answering:
        effects += harness.ack(peer, key or TxKey(1, 1))
    return effects


# ---------------------------------------------------------------- the pure rule


def test_one_change_at_a_time_and_only_adjacent_sets():
    members = ("a", "b", "c")
    assert membership.change_refusal(members, "d", True, False, True) is None
    assert membership.change_refusal(members, "d", True, True, True) == membership.REJECT_CHANGE_IN_FLIGHT
    assert membership.change_refusal(members, "d", True, False, False) == membership.REJECT_NOT_SETTLED
    assert membership.change_refusal(members, "a", True, False, True) == membership.REJECT_ALREADY_MEMBER
    assert membership.change_refusal(members, "z", False, False, True) == membership.REJECT_NOT_MEMBER
    assert membership.change_refusal(("a",), "a", False, False, True) == membership.REJECT_LAST_MEMBER
    full = tuple(f"n{i}" for i in range(membership.MEMBERS_MAX))
    assert membership.change_refusal(full, "x", True, False, True) == membership.REJECT_TOO_MANY_MEMBERS
    assert membership.changed_members(members, "d", True) == ("a", "b", "c", "d")
    assert membership.changed_members(members, "b", False) == ("a", "c")


def test_a_removal_is_in_force_as_soon_as_the_sequencer_persists_it():
    harness = _elected()
    effects = _remove(harness, "c", "m1")
    (entry,) = _membership_entries(effects)
    assert membership.membership_of(entry) == ("a", "b")
    assert harness.machine.members == ("a", "b") and harness.machine.committed_members == ("a", "b", "c")
    # c gets no append any more (the turn's batch goes to b only); the entry commits with b (a
    # majority of {a, b}), not with c.
    assert [to for to, message in sends(effects, AppendRequest) if message.entries] == ["b"]
    assert all(to != "c" for to, _ in sends(effects, AppendRequest))
    assert not of_type(harness.ack("c", entry.tx_key), Commit)
    effects = harness.ack("b", entry.tx_key)
    assert of_type(effects, ProposalCommitted) == [ProposalCommitted("m1", entry.tx_key)]
    # Committed: persisted as the membership a restart starts from.
    assert harness.state.members == ("a", "b") and harness.machine.committed_members == ("a", "b")


def _only_the_silent_core_can_be_removed(harness: Harness) -> None:
    """Sequencer a of {a, b, c}, with c silent: a removal of b, or of a itself, is refused (no quorum
    after it) and appends nothing; a removal of c is appended and {a, b} is in force."""
    assert harness.machine.role is Role.SEQUENCER
    for request_id, name in (("m1", "b"), ("m2", "a")):
        effects = harness.step(MembershipChangeRequested(name, add=False, request_id=request_id))
        assert of_type(effects, ProposalRejected) == [
            ProposalRejected(request_id, membership.REJECT_NO_QUORUM_AFTER, "a")
        ]
        assert not _membership_entries(effects) and harness.machine.members == ("a", "b", "c")
    # Removing the silent core is how it is replaced: {a, b} is heard whole.
    effects = _remove(harness, "c", "m3")
    assert harness.machine.members == ("a", "b") and _membership_entries(effects)


def test_a_removal_is_refused_while_the_sequencer_hears_no_majority_of_the_set_it_leaves():
    """{a, b, c} with c silent for an election timeout: removing b (or a itself) leaves a set whose
    majority needs c; appended, it was in force at once, never committed, and nobody could be elected."""
    assert membership.quorum_refusal(("a", "c"), {"a", "b"}) == membership.REJECT_NO_QUORUM_AFTER
    assert membership.quorum_refusal(("b", "c"), {"b"}) == membership.REJECT_NO_QUORUM_AFTER
    assert membership.quorum_refusal(("a", "b"), {"a", "b"}) is None  # removing the silent core itself
    assert membership.quorum_refusal(("a", "b", "c", "d"), {"a", "b"}, added="d") is None  # the learner counts
    harness = _elected()
    now = harness.now_ms
    silent_until = now + CONFIG.election_timeout_ms_min + CONFIG.heartbeat_interval_ms
    while now < silent_until:
        now += CONFIG.heartbeat_interval_ms
        harness.ack("b", TxKey(1, 1))
        harness.step(Ticked(), now)  # c says nothing
    _only_the_silent_core_can_be_removed(harness)


def test_a_removal_waits_for_answers_since_the_request_and_is_refused_if_the_set_it_leaves_is_not_heard():
    """{a, b, c}, c answered a moment ago and then died: heard within an election timeout, it passed
    the request's check, and removing b (or a) was appended: {a, c} (or {b, c}) in force, never
    committed, nobody could be elected. Now the removal waits for answers to appends sent since the
    request, and is refused an election timeout later; the cluster keeps its sequencer."""
    harness = _elected()
    for request_id, name in (("m1", "b"), ("m2", "a")):
        harness.ack("c", TxKey(1, 1))  # c is up...
        harness.step(Ticked(), harness.now_ms + 1)  # ...and dies here, a moment before the request
        effects = harness.step(MembershipChangeRequested(name, add=False, request_id=request_id))
        assert not of_type(effects, ProposalRejected)  # c was heard within an election timeout
        assert not _membership_entries(effects)
        asked_ms, effects = harness.now_ms, []
        while harness.now_ms < asked_ms + CONFIG.election_timeout_ms_min:
            effects += harness.step(
                Ticked(), min(harness.now_ms + CONFIG.heartbeat_interval_ms, asked_ms + CONFIG.election_timeout_ms_min)
            )
            effects += harness.ack("b", TxKey(1, 1))  # b keeps answering, c never does
            if name == "b":
                assert not _membership_entries(effects)
        assert of_type(effects, ProposalRejected) == [
            ProposalRejected(request_id, membership.REJECT_NO_QUORUM_AFTER, "a")
        ]
        assert not _membership_entries(effects) and harness.machine.members == ("a", "b", "c")
        assert harness.machine.role is Role.SEQUENCER
    effects = _remove(harness, "c", "m3")  # the dead core itself: {a, b} answers
    assert harness.machine.members == ("a", "b") and _membership_entries(effects)


def test_status_shows_a_removal_waiting_for_answers_until_it_is_appended_or_refused():
    """A removal waits, before it is appended, for a majority of the set it leaves to answer, or an
    election timeout and is refused: ``status`` showed nothing of it meanwhile. It shows the name,
    when it was asked, the cores that count so far, how many are needed and the timeout."""
    harness = _elected()
    assert harness.machine.status().removal is None
    harness.ack("c", TxKey(1, 1))  # c passes the request's check, then never answers again
    asked_ms = harness.now_ms + 1
    harness.step(MembershipChangeRequested("b", add=False, request_id="m1"), asked_ms)
    waiting = PendingRemoval("b", asked_ms, ("a",), 2, CONFIG.election_timeout_ms_min)
    assert harness.machine.status().removal == waiting
    harness.step(Ticked(), asked_ms + CONFIG.heartbeat_interval_ms)
    harness.ack("b", TxKey(1, 1))  # the core removed answers: it is not in the set it leaves
    assert harness.machine.status().removal == waiting
    assert waiting.to_json(asked_ms + 30) == {
        "name": "b",
        "waiting_ms": 30,
        "answered": ["a"],
        "needed": 2,
        "timeout_ms": CONFIG.election_timeout_ms_min,
    }
    effects = harness.step(Ticked(), asked_ms + CONFIG.election_timeout_ms_min)
    assert of_type(effects, ProposalRejected) == [ProposalRejected("m1", membership.REJECT_NO_QUORUM_AFTER, "a")]
    assert harness.machine.status().removal is None
    asked_ms = harness.now_ms + 1
    harness.step(MembershipChangeRequested("c", add=False, request_id="m2"), asked_ms)
    assert harness.machine.status().removal == PendingRemoval("c", asked_ms, ("a",), 2, CONFIG.election_timeout_ms_min)
    harness.step(Ticked())
    assert _membership_entries(harness.ack("b", TxKey(1, 1)))  # b answered an append sent since
    assert harness.machine.status().removal is None and harness.machine.members == ("a", "b")


def test_a_removal_right_after_an_election_counts_only_the_cores_that_answered():
    """{a, b, c} with c down: a, just elected with b's vote, commits its no-op with b and is asked,
    within an election timeout of its election, to remove b (or itself). Every peer's progress starts
    as heard at the election (so self-fencing gives them a timeout to answer): c, which never
    answered, was counted, the removal was appended, and {a, c} could neither commit nor elect."""
    harness = _elected()  # c never answers
    _only_the_silent_core_can_be_removed(harness)


def test_a_membership_entry_is_batched_and_the_sequencer_counts_itself_only_once_durable():
    """Batched commit path (thesis 10.2.1): the removal goes out at BatchEnded, before the
    sequencer's own fsync; b's acknowledgement alone is no majority of {a, b} until Persisted."""
    harness = _elected()
    harness.auto_persist = False
    request = MembershipChangeRequested("c", add=False, request_id="m1")
    assert not _membership_entries(Harness.step(harness, request, harness.now_ms + 1))
    effects = harness.ack("b", TxKey(1, 1))  # b answered an append sent since: {a, b} is heard
    (entry,) = _membership_entries(effects)
    assert harness.machine.members == ("a", "b")  # in force at once
    # Appended as b's acknowledgement is handled, it goes to b at once or with the turn's batch.
    batch = sends(effects + Harness.step(harness, BatchEnded()), AppendRequest)
    assert [(to, message.entries) for to, message in batch if message.entries] == [("b", (entry,))]
    assert not of_type(harness.ack("b", entry.tx_key), Commit)
    effects = Harness.step(harness, Persisted())
    assert of_type(effects, ProposalCommitted) == [ProposalCommitted("m1", entry.tx_key)]
    assert harness.machine.committed_members == ("a", "b")


def test_a_second_change_is_refused_until_the_first_commits():
    harness = _elected()
    harness.step(MembershipChangeRequested("c", add=False, request_id="m1"))
    effects = harness.step(MembershipChangeRequested("d", add=True, request_id="m2"))
    assert of_type(effects, ProposalRejected) == [ProposalRejected("m2", membership.REJECT_CHANGE_IN_FLIGHT, "a")]
    assert not _membership_entries(effects)


def test_a_new_sequencer_changes_nothing_before_its_no_op_commits():
    harness = TurnHarness()
    harness.elect()
    effects = harness.step(MembershipChangeRequested("c", add=False, request_id="m1"))
    assert of_type(effects, ProposalRejected)[0].reason == membership.REJECT_NOT_SETTLED


def test_a_core_is_added_only_after_it_caught_up_as_a_learner():
    harness = _elected()
    effects = harness.step(MembershipChangeRequested("d", add=True, endpoint="tcp://127.0.0.1:7", request_id="m1"))
    # The learner is replicated to, but the membership is unchanged and nothing is appended.
    assert [to for to, _ in sends(effects, AppendRequest)] == ["d"]
    assert harness.machine.members == ("a", "b", "c") and not _membership_entries(effects)
    assert harness.machine.status().learner == "d"
    # The learner answers that it lacks everything: still no add entry.
    reply = AppendReply(1, False, ZERO_KEY, ZERO_KEY, ZERO_KEY, harness.now_ms)
    assert not _membership_entries(harness.receive("d", reply))
    # Once it holds the committed key, the add entry is appended (with its endpoint) and in force.
    effects = harness.ack("d", TxKey(1, 1))
    (entry,) = _membership_entries(effects)
    (op,) = entry.ops
    assert op == MembersOp(("a", "b", "c", "d"), "d", "tcp://127.0.0.1:7")
    assert harness.machine.members == ("a", "b", "c", "d")
    # Four voters: a and b alone (2) are no majority.
    assert not of_type(harness.ack("b", entry.tx_key), Commit)
    assert of_type(harness.ack("d", entry.tx_key), ProposalCommitted)


def test_a_learner_that_never_catches_up_is_refused_after_the_deadline():
    harness = TurnHarness(config=dataclasses.replace(CONFIG, learner_catch_up_ms_max=500))
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.step(MembershipChangeRequested("d", add=True, request_id="m1"))
    refusals = []
    now = harness.now_ms
    while now < 1000 and not refusals:
        now += CONFIG.heartbeat_interval_ms
        harness.ack("b", TxKey(1, 1))  # a majority keeps answering: the sequencer does not fence itself
        refusals = of_type(harness.step(Ticked(), now), ProposalRejected)
    assert refusals == [ProposalRejected("m1", membership.REJECT_CATCH_UP_TIMEOUT, "a")]
    assert harness.machine.members == ("a", "b", "c") and harness.machine.status().learner is None


def test_a_learner_the_probes_find_unable_to_read_the_shard_is_refused_at_once_and_sent_nothing_more():
    harness = TurnHarness()
    harness.elect()
    harness.ack("b", TxKey(1, 1))
    harness.step(MembershipChangeRequested("d", add=True, endpoint="tcp://127.0.0.1:7", request_id="m1"))
    assert harness.machine.status().learner == "d"
    # Another core's learner, or none at all: nothing happens.
    assert harness.step(LearnerRefused("e", "it speaks release 0.1.0")) == []
    effects = harness.step(LearnerRefused("d", "it speaks release 0.1.0"))
    assert of_type(effects, ProposalRejected) == [ProposalRejected("m1", membership.REJECT_INCOMPATIBLE_VERSION, "a")]
    assert harness.machine.status().learner is None and harness.machine.members == ("a", "b", "c")
    # Nothing more is sent to it: heartbeats go to the members only.
    now = harness.now_ms
    for _ in range(5):
        now += CONFIG.heartbeat_interval_ms
        harness.ack("b", TxKey(1, 1))  # a majority keeps answering: the sequencer does not fence itself
        assert "d" not in [to for to, _ in sends(harness.step(Ticked(), now), AppendRequest)]
    # A change can be asked again (the core may come back on a release that reads the shard).
    harness.step(MembershipChangeRequested("d", add=True, endpoint="tcp://127.0.0.1:7", request_id="m2"))
    assert harness.machine.status().learner == "d"


def test_a_follower_uses_an_uncommitted_membership_entry_and_drops_it_with_a_truncation():
    follower = Harness(name="b")
    (first,) = chain([TxKey(1, 1)])
    change = make_entry("s", TxKey(1, 2), first.tx_key, first.digest, (MembersOp(("a", "b")),))
    follower.receive("a", AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, ("a", "b", "c"), (first,)))
    follower.receive("a", AppendRequest(1, first.tx_key, first.digest, first.tx_key, ("a", "b", "c"), (change,)))
    assert follower.machine.members == ("a", "b") and follower.machine.committed_members == ("a", "b", "c")
    # A new sequencer (c, generation 2) replaces the uncommitted tail: the old membership is back.
    (other,) = chain([TxKey(2, 1)], first)
    follower.receive("c", AppendRequest(2, first.tx_key, first.digest, first.tx_key, ("a", "b", "c"), (other,)))
    assert follower.machine.members == ("a", "b", "c")


def test_a_core_outside_the_membership_forgets_a_sequencer_it_no_longer_hears():
    """A learner (here: one whose add was refused with ``catch_up_timeout``, or whose sequencer was
    deposed) never campaigns, so it never reached the pre-vote where a voter forgets a sequencer it
    no longer hears: it went on saying it follows one (what its journal and agents tell replicants,
    ``follows_sequencer``) and forwarding writes there, however stale its log grew."""
    learner = Harness(name="d")
    (first,) = chain([TxKey(1, 1)])
    learner.receive("a", AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, first.tx_key, ("a", "b", "c"), (first,)), 10)
    assert not learner.machine.voter and learner.machine.sequencer == "a" and learner.machine.follows_sequencer
    # Heartbeats keep it following...
    now = 10
    for _ in range(20):
        now += CONFIG.heartbeat_interval_ms
        beat = AppendRequest(1, first.tx_key, first.digest, first.tx_key, ("a", "b", "c"), ())
        learner.receive("a", beat, now)
        assert learner.step(Ticked(), now) == [] and learner.machine.follows_sequencer
    # ...until the sequencer stops replicating to it: after an election timeout it follows nobody,
    # and still never campaigns.
    effects = learner.step(Ticked(), now + CONFIG.election_timeout_ms_max)
    assert of_type(effects, RoleChanged) == [RoleChanged(Role.FOLLOWER, 1, None)]
    assert learner.machine.sequencer is None and not learner.machine.follows_sequencer
    assert not sends(effects, PreVoteRequest) and learner.machine.generation == 1
    later = learner.step(Ticked(), now + 10 * CONFIG.election_timeout_ms_max)
    assert not sends(later, PreVoteRequest) and not of_type(later, RoleChanged)
    # Heard again (added after all): it follows at once.
    learner.receive("a", beat, now + 10 * CONFIG.election_timeout_ms_max)
    assert learner.machine.sequencer == "a" and learner.machine.follows_sequencer


def test_a_restarted_core_reads_its_membership_from_the_log():
    (first,) = chain([TxKey(1, 1)])
    change = make_entry("s", TxKey(1, 2), first.tx_key, first.digest, (MembersOp(("a", "b", "c", "d")),))
    harness = Harness(name="d", entries=[first, change], committed_key=first.tx_key)
    assert harness.machine.members == ("a", "b", "c", "d") and harness.machine.voter


def test_a_sequencer_that_removes_itself_steps_down_once_the_removal_commits():
    harness = _elected()
    harness.ack("c", TxKey(1, 1))
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    # The write before the removal commits with b and c, whose answers (to an append sent since the
    # request) let the removal be appended: the sequencer keeps serving (its removal is not committed
    # yet), and does not fail the removal.
    effects = _remove(harness, "a", "m1", ("b", "c"), TxKey(1, 2))
    (entry,) = _membership_entries(effects)
    assert harness.machine.role is Role.SEQUENCER and not harness.machine.voter
    assert of_type(effects, ProposalCommitted) == [ProposalCommitted("w1", TxKey(1, 2))]
    assert harness.machine.role is Role.SEQUENCER and not of_type(effects, ProposalFailed)
    # It does not count itself: b alone is not a majority of {b, c}.
    assert not of_type(harness.ack("b", entry.tx_key), Commit)
    effects = harness.ack("c", entry.tx_key)
    assert of_type(effects, ProposalCommitted) and harness.machine.role is Role.FOLLOWER
    assert harness.state.members == ("b", "c")


# ---------------------------------------------------------------- the wire form


def check_wire_op(op, path):
    """The wire's rules for one op: decode it as the only op of an entry's packed ops."""
    decode_ops(msgpack.packb([op], use_bin_type=True))


def test_a_membership_op_round_trips_and_the_typed_layer_refuses_malformed_ones():
    op = MembersOp(("a", "b"), "b", "tcp://127.0.0.1:9")
    assert decode_op(msgspec.to_builtins(op)) == op
    check_wire_op(msgspec.to_builtins(op), "op")
    check_wire_op(msgspec.to_builtins(MembersOp(("a",))), "op")
    for bad in (
        ["m", "a", "", ""],
        ["m", ["a"], "b"],
        ["m", ["bad name!"], "", ""],
        ["m", [f"n{i}" for i in range(100)], "", ""],
        ["m", ["a"], "b", "not an endpoint"],
    ):
        with pytest.raises(MessageError):
            check_wire_op(bad, "op")
    entry = make_entry("s", TxKey(1, 1), ZERO_KEY, bytes(32), (op,))
    msgpack.packb(entry.to_wire())
    # No entry a core accepts may name a membership a core cannot start with.
    assert MEMBERS_OP_MAX == membership.MEMBERS_MAX
    with pytest.raises(MessageError):
        check_wire_op(["m", [f"n{i}" for i in range(membership.MEMBERS_MAX + 1)], "", ""], "op")


def test_a_snapshot_carries_the_committed_membership():
    offer = SnapshotOffer("a", 3, TxKey(3, 9), bytes(32), ("a", "b", "d"))
    assert state_after_install(offer, ("a", "b", "c"), False)[0] == ("a", "b", "d")
    # An offer naming none (or a malformed set) keeps the follower's own.
    assert state_after_install(SnapshotOffer("a", 3, TxKey(3, 9), bytes(32)), ("a", "b"), False)[0] == ("a", "b")
    assert state_after_install(SnapshotOffer("a", 3, TxKey(3, 9), bytes(32), ("a", "a")), ("a", "b"), False)[0] == (
        "a",
        "b",
    )


def test_a_snapshot_whose_membership_adds_a_left_out_core_back_ends_its_exclusion():
    """The exclusion is persisted (``PersistedState.excluded_generation``): a left-out core that gets
    the entry adding it back inside a snapshot (trimmed at its sequencer) must end it there, as an
    append of that entry ends it, or it would stay out, added back, until rebuilt. A membership of the
    forced generation or later that names it says so; one that does not, or an older one, does not."""
    added = SnapshotOffer("a", 5, TxKey(5, 9), bytes(32), ("a", "b", "c"))
    assert exclusion_after_install(added, "c", 5) is None
    assert exclusion_after_install(SnapshotOffer("a", 5, TxKey(5, 9), bytes(32), ("a", "b")), "c", 5) == 5
    assert exclusion_after_install(SnapshotOffer("a", 5, TxKey(4, 9), bytes(32), ("a", "b", "c")), "c", 5) == 5
    assert exclusion_after_install(SnapshotOffer("a", 5, TxKey(5, 9), bytes(32)), "c", 5) == 5, "no membership named"
    assert exclusion_after_install(added, "c", None) is None


def test_a_snapshot_carries_whether_its_membership_is_a_forced_starts():
    forced = SnapshotOffer("a", 3, TxKey(3, 9), bytes(32), ("a", "b"), forced=True)
    assert state_after_install(forced, ("a", "b", "c"), False) == (("a", "b"), True)
    # A later membership change settled it: the installing core is forced no more.
    assert state_after_install(SnapshotOffer("a", 3, TxKey(3, 9), bytes(32), ("a", "b")), ("a", "b"), True) == (
        ("a", "b"),
        False,
    )
    # An offer naming no membership (release 0.1.0) keeps both of the follower's own.
    assert state_after_install(SnapshotOffer("a", 3, TxKey(3, 9), bytes(32)), ("a", "b"), True) == (("a", "b"), True)
    # On the wire: the field is optional (0.1.0 never sends it) and typed.
    body = {"shard": "s", "sender": "a", "generation": 3, "key": [3, 9], "digest": bytes(32), "members": ["a"]}
    assert typed_body("snapshot_offer", body).forced is False
    assert typed_body("snapshot_offer", {**body, "forced": True}).forced is True
    with pytest.raises(MessageError):
        typed_body("snapshot_offer", {**body, "forced": "yes"})
    assert not reads_forced_offer(None)


# ---------------------------------------------------------------- the simulator


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_SIM_SEEDS", FAST_SEEDS))
def test_membership_changes_under_faults(seed):
    simulation = run_membership_seed(seed, 3 if seed % 2 == 0 else 5)
    assert simulation.result is not None and simulation.result.committed_entries >= 4


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_deadline_left_in_the_past(monkeypatch):
    """A core outside the membership never campaigns: its election deadline passes for good. Giving
    it as the next deadline (as before) makes the driver's poll spin; the simulator catches it."""
    monkeypatch.setattr(
        ShardConsensus,
        "next_deadline_ms",
        lambda self: self._heartbeat_due_ms if self.role is Role.SEQUENCER else self._election_deadline_ms,
    )
    with pytest.raises(SimulationFailure, match="next deadline stays passed after a tick"):
        run_membership_seed(0, 3)


@pytest.mark.timeout(120)
def test_the_seeds_change_the_membership_for_real():
    """The seeds above must exercise commits of adds and removes, or they check nothing new."""
    committed = sum(run_membership_seed(seed, 3 if seed % 2 == 0 else 5).changes_committed for seed in range(10))
    assert committed >= 5


def _settled(seed: int, cores: int) -> tuple[MembershipSimulation, str, list[str]]:
    """``cores`` cores (and the spares), no faults and no changes of the simulation's own, run until
    quiet: the simulation, its sequencer and the other cores, sorted."""
    simulation = MembershipSimulation(seed, cores, faulty_ms=0, change_probability=0.0)
    simulation._heal()
    sequencer = simulation.run_until_quiet().name
    return simulation, sequencer, sorted(n for n in simulation.nodes if n.startswith("core") and n != sequencer)


def _cut_between(left: set[str], right: set[str]) -> set[tuple[str, str]]:
    """What ``simulation.cut`` holds to drop every message between a node of ``left`` and one of ``right``."""
    return {(p, q) for p in left for q in right} | {(q, p) for p in left for q in right}


def _writes_then_time(simulation: MembershipSimulation, sequencer: str, writes: int) -> MembershipSimulation:
    """``writes`` writes at ``sequencer``, then 200 steps of the simulation: the tail of the
    changes-in-flight scenarios below."""
    for _ in range(writes):
        simulation.write(sequencer)
    for _ in range(200):
        simulation.advance()
    return simulation


def _two_removals_in_flight(seed: int) -> MembershipSimulation:
    """5 cores, no faults: the sequencer S is asked to remove Y; once it appended that removal, S and A
    are cut off from X, Y and Z (the entry reaches none of them) and S is asked to remove Z, and takes
    writes; then time passes. (Cut off before the first removal, S would refuse both: a removal waits
    for a majority of the set it leaves to answer, ``membership.removal_heard``.)"""
    simulation, sequencer, (a, x, y, z) = _settled(seed, 5)
    simulation.change(sequencer, y, add=False)
    machine = simulation.nodes[sequencer].machine
    deadline_ms = simulation.now_ms + 10 * simulation.config.election_timeout_ms_max
    while y in machine.members:
        if simulation.now_ms >= deadline_ms:
            raise simulation.fail(f"{sequencer} did not append the removal of {y} by t={deadline_ms}")
        simulation.advance()
    simulation.cut = _cut_between({sequencer, a}, {x, y, z})
    simulation.change(sequencer, z, add=False)
    return _writes_then_time(simulation, sequencer, 5)


@pytest.mark.timeout(60)
def test_two_removals_cut_off_from_the_majority_lose_nothing():
    simulation = _two_removals_in_flight(seed=3)
    assert simulation.changes_refused.get(membership.REJECT_CHANGE_IN_FLIGHT) == 1
    simulation.cut = set()
    simulation.final_check(simulation.run_until_quiet())


@pytest.mark.timeout(60)
def test_the_simulator_catches_two_changes_in_flight(monkeypatch):
    """Mutation: without the one-change-at-a-time rule, {S, A} commit under the 3-core set while
    {X, Y, Z} are a majority of the 5-core set they still use: two committed histories."""
    real = membership.change_refusal

    def broken(members, name, add, change_in_flight, own_generation_committed):
        return real(members, name, add, False, own_generation_committed)

    monkeypatch.setattr(membership, "change_refusal", broken)
    with pytest.raises(
        SimulationFailure, match="(?s)seed 3 .*(commits|two sequencers|acknowledged).*test_membership.py"
    ):
        _two_removals_in_flight(seed=3)


def _remove_while_another_is_down(
    seed: int, remove_self: bool, just_died: bool = False
) -> tuple[MembershipSimulation, str, str]:
    """3 cores, no faults: B is lost (down for two election timeouts, or ``just_died``: for two
    heartbeat intervals, so that S still heard it within an election timeout), then the operator asks
    the sequencer S to remove A, or itself. Returns the simulation, S and B."""
    simulation, s, (a, b) = _settled(seed, 3)
    for _ in range(3):
        simulation.write(s)
    simulation.run_until_quiet()
    simulation.lose_for_good([b])
    config = simulation.config
    down_ms = 2 * config.heartbeat_interval_ms if just_died else 2 * config.election_timeout_ms_max
    assert not just_died or down_ms < config.election_timeout_ms_min
    down_until_ms = simulation.now_ms + down_ms
    while simulation.now_ms < down_until_ms:
        simulation.advance()
    simulation.change(s, s if remove_self else a, add=False)
    return simulation, s, b


@pytest.mark.timeout(60)
@pytest.mark.parametrize("just_died", [False, True])
@pytest.mark.parametrize("remove_self", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_removal_while_another_core_is_down_is_refused_and_the_cluster_keeps_its_sequencer(
    seed, remove_self, just_died
):
    """Two of three cores up, a majority: removing one of them (or the sequencer itself) left a set
    that needs the lost core (the entry is in force at once): it never committed, the sequencer fenced
    itself, nobody was ever elected again, and no change could undo it (a force start only). Refused,
    the sequencer keeps serving; removing the lost core instead commits (the replace path).
    ``just_died``: the lost core died less than an election timeout before the request, so the
    sequencer still counted it as heard; only the wait for answers since the request refuses it."""
    simulation, s, b = _remove_while_another_is_down(seed, remove_self, just_died)
    later_ms = simulation.now_ms + 3 * simulation.config.election_timeout_ms_max
    while simulation.now_ms < later_ms:  # past the self-fencing of a sequencer stuck on the change
        simulation.advance()
    _elect_one_of(simulation, *sorted(n for n in simulation.nodes if n.startswith("core") and n != b))
    assert simulation.changes_refused == {"no_quorum_after_change": 1}
    sequencer = simulation.nodes[s]
    while sequencer.machine.role is not Role.SEQUENCER:
        simulation.advance()
    simulation.change(s, b, add=False)
    deadline_ms = simulation.now_ms + 10 * simulation.config.election_timeout_ms_max
    while simulation.changes_committed < 1 and simulation.now_ms < deadline_ms:
        simulation.advance()
    assert simulation.changes_committed == 1 and b not in sequencer.machine.committed_members
    simulation.write(s)
    simulation.final_check(simulation.run_until_quiet())


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_removal_appended_without_answers_since_the_request(monkeypatch):
    """Mutation: a removal appended as soon as it passes the request's check (a core heard within an
    election timeout counts, so one that died a moment ago does): nobody is elected again."""
    monkeypatch.setattr(membership, "removal_heard", lambda *_: True)
    with pytest.raises(SimulationFailure, match="(?s)seed 0 .*no sequencer elected.*test_membership.py"):
        test_a_removal_while_another_core_is_down_is_refused_and_the_cluster_keeps_its_sequencer(0, False, True)


def _add_cut_off_from_the_old_majority(seed: int) -> MembershipSimulation:
    """3 cores and a spare, no faults: the sequencer S and the spare are cut off from A and B, then S
    is asked to add the spare (it catches up within S's last election timeout), and takes writes."""
    simulation, sequencer, (a, b) = _settled(seed, 3)
    simulation.cut = _cut_between({sequencer, "spare0"}, {a, b})
    simulation.change(sequencer, "spare0", add=True)
    return _writes_then_time(simulation, sequencer, 3)


@pytest.mark.timeout(60)
def test_an_add_cut_off_from_the_old_majority_commits_nothing():
    simulation = _add_cut_off_from_the_old_majority(seed=5)
    assert "spare0" in simulation.nodes["spare0"].machine.members  # the add entry reached the spare
    simulation.cut = set()
    simulation.final_check(simulation.run_until_quiet())


@pytest.mark.timeout(60)
def test_the_simulator_catches_counting_the_old_membership_quorum(monkeypatch):
    """Mutation: a sequencer counting the committed (old) membership's majority commits the add with
    itself and the new core while the two others, a majority of the old set, elect another."""
    monkeypatch.setattr(ShardConsensus, "_majority", lambda self: len(self.committed_members) // 2 + 1)
    with pytest.raises(SimulationFailure, match="(?s)seed 5 .*(commits|two sequencers|acknowledged)"):
        _add_cut_off_from_the_old_majority(seed=5)


def _add_committed_without_the_old_member(seed: int) -> tuple[MembershipSimulation, str, str, str]:
    """2 cores and a spare, no faults: the sequencer S is asked to add the spare D; once S appended
    the entry it is cut off from the other member C, commits the add with D (2 of {S, C, D}), and
    is lost for good. C never stored the entry: its membership is still {S, C}. Then D must be
    elected within 10 election timeouts. Returns the simulation, S, C and D."""
    simulation, s, (c,) = _settled(seed, 2)
    sequencer, d = simulation.nodes[s], "spare0"
    for _ in range(3):
        simulation.write(s)
    simulation.run_until_quiet()
    simulation.change(s, d, add=True)
    while d not in sequencer.machine.members:
        simulation.advance()
    # Its appends of the entry to C are in flight: the cut drops them when they arrive.
    simulation.cut = {(s, c), (c, s)}
    entry_key = sequencer.machine.last_key
    while sequencer.machine.committed_key < entry_key:
        simulation.advance()
    assert d in simulation.nodes[d].machine.members and d not in simulation.nodes[c].machine.members
    simulation.lose_for_good([s])
    _elect_one_of(simulation, c, d)
    return simulation, s, c, d


def _elect_one_of(simulation: MembershipSimulation, first: str, second: str) -> str:
    """Advance until ``first`` or ``second`` is sequencer (its name), failing after 10 election timeouts."""
    deadline_ms = simulation.now_ms + 10 * simulation.config.election_timeout_ms_max
    while True:
        for name in (first, second):
            if simulation.nodes[name].machine.role is Role.SEQUENCER:
                return name
        if simulation.now_ms >= deadline_ms:
            raise simulation.fail(f"no sequencer elected among {first} and {second} by t={deadline_ms}")
        simulation.advance()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_SIM_SEEDS", FAST_SEEDS))
def test_a_member_votes_for_a_core_added_by_an_entry_it_has_not_stored(seed):
    """C does not know D is a member, but D's log holds the committed entry that made it one: C must
    answer D's pre-vote and vote (thesis 4.2.3), or neither is ever elected (D needs C's vote, and
    C's own campaign asks only S). Then the operator removes S and nothing acknowledged is lost."""
    simulation, s, c, d = _add_committed_without_the_old_member(seed)
    new = simulation.nodes[d].machine
    while new.committed_key.generation < new.generation:  # its no-op first (``REJECT_NOT_SETTLED``)
        simulation.advance()
    simulation.change(d, s, add=False)
    sequencer = simulation.run_until_quiet()
    assert sequencer.machine.members == (c, d) == simulation.nodes[c].machine.members
    assert simulation.changes_committed == 2 and len(simulation.acknowledged) == 3
    simulation.final_check(sequencer)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_member_that_drops_vote_requests_from_cores_it_does_not_know(monkeypatch):
    """Mutation: the old rule (only appends heeded from outside the membership) leaves C and D
    unable to elect anyone after the sequencer that added D died."""

    def old_rule(self, sender, message):
        if isinstance(message, AppendReply):
            return sender in self._progress
        return isinstance(message, AppendRequest) and not self._forced

    monkeypatch.setattr(ShardConsensus, "_heeds_outsider", old_rule)
    with pytest.raises(SimulationFailure, match="seed 1 .*no sequencer elected among core0 and spare0"):
        _add_committed_without_the_old_member(seed=1)


def _add_after_a_forced_start_without_the_kept_member(seed: int) -> tuple[MembershipSimulation, str, str, str]:
    """Five cores and a spare, no faults: three cores are lost for good and the operator force-starts
    F, which reaches R (forced set {F, R}). Once F's forced entry committed, F adds the spare D; once
    F appended the entry it is cut off from R, commits the add with D (2 of {D, F, R}) and is lost
    for good. R never stored the entry: D is outside its (forced) membership. A sequencer must be
    elected among R and D within 10 election timeouts. Returns the simulation, F, R and the elected core."""
    simulation = MembershipSimulation(seed, 5, faulty_ms=0, change_probability=0.0)
    simulation._heal()
    sequencer = simulation.run_until_quiet()
    for _ in range(3):
        simulation.write(sequencer.name)
    simulation.run_until_quiet()
    f, r, *lost = sorted(name for name in simulation.nodes if name.startswith("core"))
    d = "spare0"
    simulation.lose_for_good(lost)
    [forced] = [effect for effect in simulation.force_start(f) if isinstance(effect, ForceStarted)]
    assert forced.members == (f, r)
    forcer = simulation.nodes[f].machine
    while forcer.committed_key < TxKey(forced.generation, 1):
        simulation.advance()
    simulation.change(f, d, add=True)
    while d not in forcer.members:
        simulation.advance()
    simulation.cut = {(f, r), (r, f)}
    entry_key = forcer.last_key
    while forcer.committed_key < entry_key:
        simulation.advance()
    kept = simulation.nodes[r].machine
    assert d in simulation.nodes[d].machine.members and d not in kept.members and kept.status().forced
    simulation.lose_for_good([f])
    return simulation, f, r, _elect_one_of(simulation, r, d)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_SIM_SEEDS", FAST_SEEDS))
def test_a_forced_member_votes_for_a_core_added_by_an_entry_it_has_not_stored(seed):
    """As above, after a forced start: R (forced) must hear the vote requests of D, added after the
    forced start, or neither is ever elected. Then the operator removes F and nothing acknowledged
    is lost."""
    simulation, f, r, elected = _add_after_a_forced_start_without_the_kept_member(seed)
    new = simulation.nodes[elected]
    while new.machine.committed_key.generation < new.machine.generation:  # its no-op first
        simulation.advance()
    simulation.change(new.name, f, add=False)
    sequencer = simulation.run_until_quiet()
    assert sequencer.machine.members == (r, "spare0") == simulation.nodes[r].machine.members
    assert not sequencer.machine.status().forced
    simulation.final_check(sequencer)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_forced_member_that_drops_vote_requests_from_cores_added_after_it(monkeypatch):
    """Mutation: the old rule (a forced member heeds no core outside its membership) leaves R and D
    unable to elect anyone after the forced core that added D died."""

    def old_rule(self, sender, message):
        if isinstance(message, AppendReply):
            return sender in self._progress
        return isinstance(message, (AppendRequest, VoteRequest, PreVoteRequest)) and not self._forced

    monkeypatch.setattr(ShardConsensus, "_heeds_outsider", old_rule)
    with pytest.raises(SimulationFailure, match="seed 0 .*no sequencer elected among core1 and spare0"):
        _add_after_a_forced_start_without_the_kept_member(seed=0)


def test_a_committed_membership_change_after_a_forced_start_ends_exclusion_notices():
    harness = TurnHarness()
    effects = harness.step(ForceStartRequested(()), 10)
    assert harness.machine.status().forced and harness.machine.members == ("a",)
    # A core outside the forced set is told it was left out...
    effects = harness.receive("b", PreVoteRequest(9, TxKey(1, 1)))
    assert [type(m).__name__ for _, m in sends(effects, ExclusionNotice)] == ["ExclusionNotice"]
    # ...until the forced core adds a core back (here: d, caught up as a learner) and that commits.
    harness.step(MembershipChangeRequested("d", add=True, request_id="m1"))
    effects = harness.ack("d", harness.machine.last_key)
    (entry,) = _membership_entries(effects)
    effects = harness.ack("d", entry.tx_key)
    assert of_type(effects, ProposalCommitted) and not harness.machine.status().forced
    effects = harness.receive("c", PreVoteRequest(9, TxKey(1, 1)), harness.now_ms + 2000)
    assert not sends(effects, ExclusionNotice)


# ---------------------------------------------------------------- the CLI on one node


@pytest.mark.timeout(60)
def test_cluster_commands_on_a_single_core(thread_node):
    from click.testing import CliRunner
    from mnesite.cli.main import main

    runner = CliRunner()
    node = ["--node", thread_node.endpoint]
    refused = runner.invoke(main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:1", *node])
    assert refused.exit_code == 1 and "create a table first" in refused.output
    with thread_node.client(timeout_ms=5000) as client:
        client.create_table("t", "k", [("k", "INTEGER")])
    shown = runner.invoke(main, ["cluster", "members", "--json", *node])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["shards"]["default"]["members"] == ["core1"]
    # What add-core shows while it waits: the learner's matched key (none here) against the committed key.
    assert json.loads(shown.output)["shards"]["default"]["learner_match"] is None
    assert len(json.loads(shown.output)["shards"]["default"]["committed"]) == 2
    # Removing a core that is no member is answered as done; removing the last member is refused.
    gone = runner.invoke(main, ["cluster", "remove-core", "core9", "--json", *node])
    assert gone.exit_code == 0 and json.loads(gone.output)["shards"]["default"]["unchanged"] == "not_member"
    last = runner.invoke(main, ["cluster", "remove-core", "core1", *node])
    assert last.exit_code == 1 and "last_member" in last.output
    status = runner.invoke(main, ["status", *node])
    assert status.exit_code == 0 and "members" in status.output and "core1" in status.output
    # rlog tail shows a membership entry (the single core's no-op carries none: seed it by hand).
    from mnesite.cli.main import _describe_op
    from mnesite.rlog.types import op_to_json

    shown_op = _describe_op(op_to_json(MembersOp(("a", "b"), "b", "tcp://127.0.0.1:9")))
    assert shown_op == "members a, b (adds b at tcp://127.0.0.1:9)"


def test_the_typed_layer_refuses_malformed_membership_requests():
    from mnesite.rlog import messages

    good = {"shard": "default", "action": "add", "name": "core4", "endpoint": "tcp://127.0.0.1:7404"}
    assert messages.decode(messages.encode(messages.Message("membership_change", "r1", good))).body == typed_body(
        "membership_change", good
    )
    for bad in (
        {**good, "action": "drop"},
        {**good, "name": "core 4"},
        {**good, "endpoint": "http://example.com"},
        {**good, "shard": "x" * 500},
        {"shard": "default", "name": "core4"},
        {**good, "members": ["core1"]},
    ):
        with pytest.raises(messages.MessageError):
            messages.decode(messages.encode(messages.Message("membership_change", "r1", bad)))
    offer = {"shard": "s", "sender": "a", "generation": 1, "key": [1, 1], "digest": bytes(32)}
    for members in (["a"] * 16, ["bad name!"], "a"):
        with pytest.raises(messages.MessageError):
            messages.decode(messages.encode(messages.Message("snapshot_offer", "r1", {**offer, "members": members})))


def test_a_journal_reports_the_committed_membership_and_a_change_in_the_log_apart(tmp_path) -> None:
    """The ``journal`` answer (``cluster journal``; what a rebuilt core learns its membership from,
    ``core.recovery.recovered_members``) gave a shard's latest membership in the log, a change not
    committed yet included: a removal that a truncation may still take away was reported, and taken
    by a rebuilt core, as the membership. It gives the committed membership now, and a change in the
    log apart (``pending_members``)."""
    from mnesite.core.consensus import AppendRequest, MessageReceived
    from mnesite.core.recovery import recovered_members
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, MembersOp, make_entry

    from tests.conftest import follower_by_hand

    members = ("core1", "core2", "core3")
    with follower_by_hand(tmp_path / "data") as (node, driver):
        first = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (), "a")
        removal = make_entry("default", TxKey(1, 2), first.tx_key, first.digest, (MembersOp(("core1", "core2")),), "b")
        append = AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, first.tx_key, members, (first, removal))
        node._step(driver, MessageReceived("core2", append))
        assert driver.consensus.committed_key == first.tx_key and driver.consensus.members == ("core1", "core2")
        age = node.journal()["shards"]["default"]
        assert age["members"] == list(members), "the removal is not committed"
        assert age["pending_members"] == ["core1", "core2"]
        assert recovered_members({"core1": node.journal()})[0] == {"default": members}
        # Once it commits, it is the membership, and nothing is pending.
        notice = AppendRequest(1, removal.tx_key, removal.digest, removal.tx_key, ("core1", "core2"))
        node._step(driver, MessageReceived("core2", notice))
        age = node.journal()["shards"]["default"]
        assert (age["members"], age["pending_members"]) == (["core1", "core2"], None)


def test_a_core_s_status_and_members_show_a_removal_waiting_for_answers(tmp_path) -> None:
    """A sequencer waiting for the set a removal leaves to answer before it appends it said nothing of
    it in ``status`` or ``cluster members``: an operator saw no change under way. Both show it now
    (``removal``, typed in ``CoreShardStatus`` and ``ShardMembership``; a line in the text forms),
    until it is appended."""
    from mnesite.cli.main import describe_removal
    from mnesite.core.consensus import MessageReceived, PreVoteReply, VoteReply
    from mnesite.rlog.admin_answers import CoreStatus, Membership
    from mnesite.rlog.client import checked

    from tests.conftest import follower_by_hand

    with follower_by_hand(tmp_path / "data") as (node, driver):
        now_ms = [node.clock_ms()]
        node.clock_ms = lambda: now_ms[0]

        def at(step_ms: int, event) -> None:
            now_ms[0] += step_ms
            node._step(driver, event)

        # core1 is elected with core2's votes, and core2 acknowledges its no-op.
        at(10 * driver.consensus.config.election_timeout_ms_max, Ticked())
        at(1, MessageReceived("core2", PreVoteReply(1, True)))
        at(1, MessageReceived("core2", VoteReply(1, True)))
        assert driver.consensus.role is Role.SEQUENCER
        at(0, Persisted())  # the turn's commit made its no-op durable here
        no_op = driver.consensus.last_key
        at(1, MessageReceived("core2", AppendReply(1, True, no_op, no_op, ZERO_KEY, now_ms[0])))
        assert driver.consensus.committed_key == no_op
        assert node.status()["shards"]["default"]["removal"] is None
        at(1, MembershipChangeRequested("core3", add=False, request_id="m1"))
        asked_ms = now_ms[0]
        now_ms[0] += 40
        timeout_ms = driver.consensus.config.election_timeout_ms_min
        waiting = {"name": "core3", "waiting_ms": 40, "answered": ["core1"], "needed": 2, "timeout_ms": timeout_ms}
        status = node.status()
        assert status["shards"]["default"]["removal"] == waiting
        assert checked("status", status, CoreStatus).shards["default"].removal.needed == 2
        members = node.membership()
        assert members["shards"]["default"]["removal"] == waiting
        assert checked("members", members, Membership).shards["default"].removal.name == "core3"
        assert describe_removal(waiting) == (
            "removing core3: waiting 40 ms for the cores it leaves to answer (1 of 2 needed: core1); "
            f"refused no_quorum_after_change after {timeout_ms} ms"
        )
        # core2 answers an append sent since the request: the removal is appended, and shown no more.
        at(0, MessageReceived("core2", AppendReply(1, True, no_op, no_op, ZERO_KEY, asked_ms)))
        assert driver.consensus.members == ("core1", "core2")
        assert node.status()["shards"]["default"]["removal"] is None
        assert node.membership()["shards"]["default"]["removal"] is None


# ---------------------------------------------------------------- waiting for a change (cluster add-core)


def test_a_change_is_waited_for_while_it_moves_and_called_stalled_only_when_it_stops():
    learner = {"members": ["a"], "committed_members": ["a"], "learner": "d", "learner_match": [1, 5]}
    first = membership.change_wait(learner, "d", True, None, 0, 0, stall_ms=1000)
    assert first.state == "waiting"
    # Still at (1, 5) after 999 ms: waiting; after 1000 ms with nothing moved: stalled.
    assert membership.change_wait(learner, "d", True, first.seen, first.since_ms, 999, 1000).state == "waiting"
    assert membership.change_wait(learner, "d", True, first.seen, first.since_ms, 1000, 1000).state == "stalled"
    # The learner's key moved: waiting again, the stall counted from now.
    moved = membership.change_wait({**learner, "learner_match": [1, 9]}, "d", True, first.seen, 0, 5000, 1000)
    assert (moved.state, moved.since_ms) == ("waiting", 5000)
    # Committed: done (and a removal is done once the name left the committed members).
    added = {"members": ["a", "d"], "committed_members": ["a", "d"], "learner": None}
    assert membership.change_wait(added, "d", True, moved.seen, 0, 9000, 1000).state == "done"
    assert membership.change_wait(learner, "x", False, None, 0, 0, 1000).state == "done"


def test_a_learner_s_snapshot_copy_that_moves_is_waited_for_and_one_that_stops_is_stalled():
    """Regression: a learner installing a snapshot has the same matched key until the install ends,
    and ``change_wait`` took only that key (and the members) for progress: an install of over
    ``CHANGE_STALL_MS`` was called stalled while its copy moved all along. The rows and batches the
    sequencer served it (``learner_copy``) are progress too; the age of its last batch is not."""
    stall_ms = membership.CHANGE_STALL_MS
    learner = {"members": ["a"], "committed_members": ["a"], "learner": "d", "learner_match": [1, 5]}

    def copying(rows: int, batches: int, age_ms: int = 0) -> dict:
        return {**learner, "learner_copy": {"rows": rows, "batches": batches, "last_batch_age_ms": age_ms}}

    wait = membership.change_wait(copying(10_000, 1), "d", True, None, 0, 0)
    # Five minutes of copying, a batch every 50 s: waited for all along, the stall counted from each batch.
    for minute in range(1, 6):
        now_ms = minute * 50_000
        moved = copying(10_000 * (minute + 1), minute + 1)
        wait = membership.change_wait(moved, "d", True, wait.seen, wait.since_ms, now_ms)
        assert (wait.state, wait.since_ms) == ("waiting", now_ms)
    assert wait.since_ms > stall_ms
    # The copy stopped: only its last batch's age grows. Stalled once nothing moved for CHANGE_STALL_MS.
    last_ms = 250_000
    for age_ms, state in ((stall_ms - 1, "waiting"), (stall_ms, "stalled")):
        stopped = copying(60_000, 6, age_ms=age_ms)
        assert membership.change_wait(stopped, "d", True, wait.seen, wait.since_ms, last_ms + age_ms).state == state
    # The count appearing (a sequencer that served the learner's first batch) is progress too.
    first = membership.change_wait(learner, "d", True, None, 0, 0)
    assert membership.change_wait(copying(0, 1), "d", True, first.seen, 0, stall_ms).state == "waiting"


class _FakeCore:
    """A sequencer as ``cluster add-core`` / ``remove-core`` sees it: ``outcomes`` per shard is what
    each ``membership_change`` does in turn (an exception raised, or a result returned); ``views``
    the shard info its ``members`` shows after each unanswered one; every call advances ``clock``."""

    endpoint = "tcp://127.0.0.1:7400"

    def __init__(self, shards, outcomes, views=(), clock=None):
        self.shards, self.outcomes, self.views, self.clock = shards, outcomes, list(views), clock
        self.asked: list[tuple[str, str | None]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def members(self):
        info = self.views.pop(0) if self.views else {"members": ["core1"], "committed_members": ["core1"]}
        shard_info = {shard: {"sequencer": "core1", "learner": None, **info} for shard in self.shards}
        return {"node": "core1", "members": ["core1"], "endpoints": {"core1": self.endpoint}, "shards": shard_info}

    def change_membership(self, shard, action, name, endpoint=None, request_id=None):
        self.asked.append((shard, request_id))
        if self.clock is not None:
            self.clock.now += 10.0  # a --timeout-ms of 5000, sent twice
        outcome = self.outcomes[shard].pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


class _Clock:
    """The CLI's ``time``: a sleep advances it."""

    now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _cli_with(monkeypatch, core):
    from mnesite.cli import main as cli

    monkeypatch.setattr(cli, "client_for", lambda *args, **kwargs: core)
    return cli


def _learner_at(match: list[int], **more) -> dict:
    """A shard's ``members`` entry while learner core2 catches up, at ``match`` of (1, 900)."""
    learning = {"members": ["core1"], "committed_members": ["core1"], "learner": "core2"}
    return {**learning, "learner_match": match, "committed": [1, 900], **more}


@pytest.mark.timeout(30)
def test_add_core_waits_through_a_catch_up_that_outlasts_its_timeout_and_shows_progress(monkeypatch):
    """Regression: each membership_change waits --timeout-ms (5 s by default, sent twice), and a
    learner catching up a large log takes minutes: the command exited 3 (outcome unknown) as if the
    cluster were down. It now goes on waiting (the same request id again) while the learner moves."""
    from click.testing import CliRunner
    from mnesite.rlog.client import OutcomeUnknown

    clock = _Clock()
    silence = OutcomeUnknown("outcome unknown: node tcp://127.0.0.1:7400 did not answer", "r")
    catching_up = [_learner_at([1, n]) for n in (100, 400, 800)]
    answer = {"shard": "default", "members": ["core1", "core2"], "tx_key": [1, 901]}
    core = _FakeCore(["default"], {"default": [silence, silence, silence, answer]}, catching_up, clock)
    cli = _cli_with(monkeypatch, core)
    monkeypatch.setattr(cli, "time", clock)
    done = CliRunner().invoke(cli.main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401"])
    assert done.exit_code == 0, done.output
    assert "default: add core2 committed at (1, 901)" in done.stdout
    assert "core2 catching up as a learner: at (1, 400) of (1, 900)" in done.stderr
    # One change: a new request, then the id its silence named (OutcomeUnknown.request_id) again.
    assert [request_id for _, request_id in core.asked] == [None, "r", "r", "r"]


@pytest.mark.timeout(30)
def test_add_core_waits_through_a_snapshot_install_that_outlasts_the_stall_time_and_shows_its_rows(monkeypatch):
    """Regression: a learner's matched key moves only at the end of its snapshot install, so an install
    of over 60 s ended `cluster add-core` with exit 3 "still under way" while its copy moved. The copy
    the sequencer serves (``learner_copy``) is progress, and the progress line shows its rows."""
    from click.testing import CliRunner
    from mnesite.rlog.client import OutcomeUnknown

    clock = _Clock()
    silence = OutcomeUnknown("outcome unknown: node tcp://127.0.0.1:7400 did not answer", "r")
    copies = ({"rows": 10_000 * n, "batches": n, "last_batch_age_ms": 200} for n in range(1, 10))
    installing = [_learner_at([1, 5], learner_copy=copy) for copy in copies]
    answer = {"shard": "default", "members": ["core1", "core2"], "tx_key": [1, 901]}

    class Slow(_FakeCore):
        def members(self):
            self.clock.now += 20.0  # each view 30 s after the one before: 270 s of copying in all
            return super().members()

    core = Slow(["default"], {"default": [silence] * 9 + [answer]}, installing, clock)
    cli = _cli_with(monkeypatch, core)
    monkeypatch.setattr(cli, "time", clock)
    done = CliRunner().invoke(cli.main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401"])
    assert done.exit_code == 0, done.output
    assert clock.now >= 270
    assert "default: add core2 committed at (1, 901)" in done.stdout
    shown = "core2 catching up as a learner: at (1, 5) of (1, 900); snapshot install: 90,000 rows copied"
    assert f"{shown} in 9 batches, the last 0 s ago" in done.stderr


@pytest.mark.timeout(30)
def test_add_core_tells_a_stalled_catch_up_from_silence(monkeypatch):
    from click.testing import CliRunner
    from mnesite.rlog.client import OutcomeUnknown

    clock = _Clock()
    silence = OutcomeUnknown("outcome unknown: node tcp://127.0.0.1:7400 did not answer", "r")
    stuck = {"members": ["core1"], "committed_members": ["core1"], "learner": "core2", "learner_match": [1, 5]}
    core = _FakeCore(["default"], {"default": [silence] * 20}, [stuck] * 20, clock)
    cli = _cli_with(monkeypatch, core)
    monkeypatch.setattr(cli, "time", clock)
    stalled = CliRunner().invoke(cli.main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401"])
    assert stalled.exit_code == 3, stalled.output
    assert "still under way, with no progress for 60 s" in stalled.stderr
    assert "mnesite cluster members --node tcp://127.0.0.1:7400" in stalled.stderr

    # The sequencer silent to `members` too: no answer, said so.
    class Silent(_FakeCore):
        def members(self):
            if self.asked:
                raise OutcomeUnknown("node tcp://127.0.0.1:7400 did not answer", "m")
            return super().members()

    cli = _cli_with(monkeypatch, Silent(["default"], {"default": [silence]}, clock=clock))
    gone = CliRunner().invoke(cli.main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401"])
    assert gone.exit_code == 3 and "no answer to `members` either" in gone.stderr
    assert "still under way" not in gone.stderr


@pytest.mark.timeout(30)
def test_a_change_that_fails_part_way_names_the_shards_changed_and_not(monkeypatch):
    """Regression: the first shard that failed ended the command with its error alone (exit 1): the
    shards already changed, and those not tried, were not said, nor in --json."""
    from click.testing import CliRunner
    from mnesite.rlog.client import RemoteError

    def core():
        refused = RemoteError(
            "membership change refused in shard b: membership_change_in_flight", "membership_change_in_flight"
        )
        return _FakeCore(
            ["a", "b", "c"],
            {"a": [{"shard": "a", "members": ["core1", "core2"], "tx_key": [1, 7]}], "b": [refused], "c": []},
        )

    cli = _cli_with(monkeypatch, core())
    text = CliRunner().invoke(cli.main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401"])
    assert text.exit_code == 1, text.output
    assert "a: add core2 committed at (1, 7)" in text.stdout
    assert "b: NOT CHANGED (membership_change_in_flight" in text.stdout and "c: NOT CHANGED: not tried" in text.stdout
    assert "stopped at shard b: membership change refused" in text.stderr
    assert "changed: a; not changed: b, c" in text.stderr
    cli = _cli_with(monkeypatch, core())
    shown = CliRunner().invoke(cli.main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401", "--json"])
    assert shown.exit_code == 1, shown.output
    result = json.loads(shown.stdout)
    assert list(result["shards"]) == ["a"] and result["not_tried"] == ["c"]
    assert result["failed"]["b"]["code"] == "membership_change_in_flight"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", ["forbidden", "overloaded", "disk_full"])
def test_a_change_refused_at_its_first_attempt_is_that_refusal_not_an_outcome_unknown(code):
    """Regression: ``_change_shard`` sent its very first attempt with a request id of its own, which
    ``Client.call`` takes for a resend of an earlier attempt (``sent_before``): a first request
    refused unread (an operator without the admin role, a full backlog or disk) came back as
    ``OutcomeUnknown``, and the command asked ``members`` and sent it again and again until it said
    the change was "still under way" (exit 3) when nothing had been asked of the cluster at all. The
    first attempt is a new request: its refusal is the answer; only a silent one is sent again."""
    from mnesite.cli.main import _change_shard
    from mnesite.rlog.client import Client, MnesiteError, OutcomeUnknown

    node = ScriptedNode([(code, f"refused: {code}")] * 5)
    try:
        with Client(node.endpoint, timeout_ms=300, retries=1) as client, pytest.raises(MnesiteError) as info:
            _change_shard(client, "default", "add", "core2", "tcp://127.0.0.1:7401")
        assert info.value.code == code and not isinstance(info.value, OutcomeUnknown), info.value
        assert len(node.requests) == 1, node.requests  # asked once: no members, no resend
    finally:
        node.close()


@pytest.mark.timeout(30)
def test_a_change_whose_first_attempt_reaches_no_node_is_unavailable_not_an_outcome_unknown():
    """The same: nothing was sent, so nothing may have happened (exit 1, not 3)."""
    import socket as socket_module

    from mnesite.cli.main import _change_shard
    from mnesite.rlog.client import Client, OutcomeUnknown, Unavailable

    with socket_module.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: refused
        with Client(endpoint, timeout_ms=2000, retries=1) as client, pytest.raises(Unavailable) as info:
            _change_shard(client, "default", "add", "core2", "tcp://127.0.0.1:7401")
    assert not isinstance(info.value, OutcomeUnknown), info.value
    # What `cluster add-core` then does: wait for the cores to name another sequencer (nothing was asked).
    assert membership.after_change_failure(info.value.code, info.value.refused) == "unreachable"


@pytest.mark.timeout(30)
def test_add_core_stops_waiting_for_an_answer_the_sequencer_never_gives_once_the_change_is_done(monkeypatch):
    """Regression: once ``members`` showed the change committed (``done``), every unanswered resend
    restarted the stall clock (``change_wait`` answered ``done`` with ``since_ms`` now): a sequencer
    that answers ``members`` but never the change request (it forwards it to a core it cannot reach,
    say) kept the command resending for ever. A done change left unanswered for ``CHANGE_STALL_MS``
    ends the wait too (exit 3), saying the members are what was asked."""
    from click.testing import CliRunner
    from mnesite.rlog.client import OutcomeUnknown

    assert membership.change_wait({"committed_members": ["a", "d"]}, "d", True, (), 0, 999, 1000).state == "done"
    assert membership.change_wait({"committed_members": ["a", "d"]}, "d", True, (), 0, 1000, 1000).state == (
        "unanswered"
    )
    clock = _Clock()
    silence = OutcomeUnknown("outcome unknown: node tcp://127.0.0.1:7400 did not answer", "r")
    done = {"members": ["core1", "core2"], "committed_members": ["core1", "core2"], "learner": None}
    core = _FakeCore(["default"], {"default": [silence] * 20}, [done] * 20, clock)
    cli = _cli_with(monkeypatch, core)
    monkeypatch.setattr(cli, "time", clock)
    result = CliRunner().invoke(cli.main, ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401"])
    assert result.exit_code == 3, result.output
    assert "members are what was asked (core1, core2)" in result.stderr, result.stderr
    assert len(core.asked) < 20


class _Seat:
    """One core ``cluster add-core`` may reach, at ``endpoint``: ``sequencers`` is in turn what its
    ``members`` answers show of shard default (the last one repeated): the sequencer's name (or None),
    a dict over the shard's entry, or an exception raised (a silent core); ``outcomes`` what each
    ``membership_change`` asked of it does (an exception raised, or a result returned)."""

    endpoints = {"core1": "tcp://127.0.0.1:7400", "core3": "tcp://127.0.0.1:7403", "core5": "tcp://127.0.0.1:7405"}

    def __init__(self, name, sequencers, outcomes=()):
        self.name, self.endpoint = name, self.endpoints[name]
        self.sequencers, self.outcomes = list(sequencers), list(outcomes)
        self.asked: list[str | None] = []
        self.viewed = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def members(self):
        self.viewed += 1
        sequencer = self.sequencers.pop(0) if len(self.sequencers) > 1 else self.sequencers[0]
        if isinstance(sequencer, Exception):
            raise sequencer
        shard = {"sequencer": sequencer, "learner": None, "members": ["core1"], "committed_members": ["core1"]}
        if isinstance(sequencer, dict):
            shard.update(sequencer)
        return {"node": self.name, "members": ["core1"], "endpoints": self.endpoints, "shards": {"default": shard}}

    def change_membership(self, shard, action, name, endpoint=None, request_id=None):
        self.asked.append(request_id)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def _cli_reaching(monkeypatch, *seats):
    """The CLI with ``client_for`` giving the seat at each endpoint (nothing listens at the others)
    and a clock that a sleep advances."""
    from mnesite.cli import main as cli
    from mnesite.rlog.client import Unavailable

    at = {seat.endpoint: seat for seat in seats}

    def client_for(endpoint, *args, **kwargs):
        endpoint = endpoint[0] if isinstance(endpoint, tuple) else endpoint  # --node: a tuple
        if endpoint not in at:
            raise Unavailable(f"node {endpoint} is unreachable: nothing accepts connections there")
        return at[endpoint]

    monkeypatch.setattr(cli, "client_for", client_for)
    clock = _Clock()
    monkeypatch.setattr(cli, "time", clock)
    return cli, clock


def _add_core2(cli, node):
    from click.testing import CliRunner

    command = ["cluster", "add-core", "core2", "tcp://127.0.0.1:7401", "--node", node.endpoint]
    return CliRunner().invoke(cli.main, command)


def _not_sequencer():
    from mnesite.rlog.client import RemoteError, Unavailable

    return [
        RemoteError(
            f"membership change refused in shard default: {REJECT_NOT_SEQUENCER} (sequencer: core3)",
            REJECT_NOT_SEQUENCER,
        ),
        # What a client is told once a core that knows no sequencer answered every retry so.
        Unavailable("node tcp://127.0.0.1:7400: shard default has no sequencer reachable", "no_sequencer"),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("refusal", range(2))
def test_add_core_asks_the_new_sequencer_when_the_sequencer_changes_under_it(monkeypatch, refusal):
    """Regression: a sequencer that stepped down (or lost its leadership) while its learner caught up
    answers ``not_sequencer`` (nothing was written: a new sequencer drops the learner), and a core that
    knows no sequencer ``no_sequencer``: the command failed for that shard (exit 1) and the operator
    had to run it again. It now reads ``members`` again, waits for a sequencer to be named (an election
    under way) and asks the change of it as a new request, saying so on stderr."""

    old = _Seat("core1", ["core1", None, None, "core3"], [_not_sequencer()[refusal]])
    answer = {"shard": "default", "members": ["core1", "core2"], "tx_key": [2, 4]}
    new = _Seat("core3", ["core3"], [answer])
    cli, clock = _cli_reaching(monkeypatch, old, new)
    done = _add_core2(cli, old)
    assert done.exit_code == 0, done.output
    assert "default: add core2 committed at (2, 4)" in done.stdout
    assert "default: the sequencer changed" in done.stderr and "its sequencer now, core3 (retry 1 of 3)" in done.stderr
    assert old.asked == [None] and new.asked == [None]  # each a new request
    assert old.viewed == 5 and 0 < clock.now < 1  # polled through the election (two views naming none)


@pytest.mark.timeout(30)
def test_add_core_never_asks_anew_a_change_whose_outcome_is_unknown(monkeypatch):
    """The new sequencer's silence (``OutcomeUnknown``) may be a change under way: only its request id
    is sent again (here its ``members`` is silent too: exit 3), never a new request, anywhere."""
    from mnesite.rlog.client import OutcomeUnknown

    class Silent(_Seat):
        def members(self):
            raise OutcomeUnknown("node tcp://127.0.0.1:7403 did not answer", "m")

    old = _Seat("core1", ["core1", "core3"], [_not_sequencer()[0]])
    new = Silent("core3", ["core3"], [OutcomeUnknown("outcome unknown: node tcp://127.0.0.1:7403 did not answer", "r")])
    cli, _ = _cli_reaching(monkeypatch, old, new)
    result = _add_core2(cli, old)
    assert result.exit_code == 3, result.output
    assert "no answer to `members` either" in result.stderr
    assert old.asked == [None] and new.asked == [None]


@pytest.mark.timeout(30)
def test_add_core_gives_up_within_its_bound_when_no_sequencer_appears_or_each_steps_down(monkeypatch):
    """No sequencer named for ``SEQUENCER_WAIT_MS`` (an election that does not end): exit 1, saying
    nothing was changed and to run the command again; the same after ``SEQUENCER_REASKS_MAX``
    sequencers that each answered ``not_sequencer``."""

    old = _Seat("core1", ["core1", None], [_not_sequencer()[0]])
    cli, clock = _cli_reaching(monkeypatch, old)
    result = _add_core2(cli, old)
    assert result.exit_code == 1, result.output
    waited_s = membership.SEQUENCER_WAIT_MS / 1000
    assert f"no sequencer was known within {waited_s:.0f} s (core1 knows no sequencer of" in result.stderr
    assert "nothing was changed in shard default: run this command again" in result.stderr
    assert waited_s <= clock.now <= waited_s + 1 and old.asked == [None]

    refusals = [_not_sequencer()[0] for _ in range(membership.SEQUENCER_REASKS_MAX + 1)]
    old = _Seat("core1", ["core1", "core3", "core1", "core3"], refusals[::2])
    new = _Seat("core3", ["core3"], refusals[1::2])
    cli, _ = _cli_reaching(monkeypatch, old, new)
    result = _add_core2(cli, old)
    assert result.exit_code == 1, result.output
    assert f"sequencer changed {membership.SEQUENCER_REASKS_MAX + 1} times" in result.stderr
    assert "run this command again" in result.stderr
    assert old.asked == [None, None] and new.asked == [None, None]
    # The bounds --help and docs/operations/membership.md state.
    doc = (Path(__file__).parents[1] / "docs" / "operations" / "membership.md").read_text()
    for text in (cli.cluster_add_core.help, doc):
        text = " ".join(text.split())
        assert f"up to {waited_s:.0f} s for" in text, text
        assert f"up to {membership.SEQUENCER_REASKS_MAX} times per shard" in text, text


def test_the_answer_of_a_sequencer_that_stepped_down_is_one_the_command_asks_anew_after():
    assert REJECT_NOT_SEQUENCER in membership.SEQUENCER_MOVED_CODES
    assert "outcome_unknown" not in membership.SEQUENCER_MOVED_CODES


# ---------------------------------------------------------------- a sequencer that falls silent (cluster add-core)


def test_after_a_silent_sequencer_another_named_one_is_asked_anew_the_silent_one_answering_is_resent():
    after = membership.after_silence
    # Nobody names another sequencer: wait, then give up after SEQUENCER_WAIT_MS.
    assert after("core3", {}, 0, 0).action == "wait"
    assert after("core3", {"core1": "core3", "core2": None}, 14_999, 0).action == "wait"
    assert after("core3", {"core1": "core3"}, membership.SEQUENCER_WAIT_MS, 0).action == "give_up"
    # Another sequencer named (the one most cores name): asked anew, even after the wait.
    assert after("core3", {"core1": "core5"}, 0, 0) == membership.AfterSilence("reask", "core5")
    named = {"core1": "core5", "core2": "core4", "core4": "core4", "core3": "core3"}
    assert after("core3", named, 20_000, 2) == membership.AfterSilence("reask", "core4")
    # The silent core answers again and names itself (a pause that ended): the same request id again.
    assert after("core3", {"core1": "core3", "core3": "core3"}, 0, 0) == membership.AfterSilence("resend", "core3")
    # It answers but names none (it stepped down, an election under way): wait for the election.
    assert after("core3", {"core3": None}, 0, 0).action == "wait"
    # Bounded: the SEQUENCER_REASKS_MAX-th retry gives up whatever is named.
    assert after("core3", {"core1": "core5"}, 0, membership.SEQUENCER_REASKS_MAX).action == "give_up"


def _silent(endpoint: str):
    from mnesite.rlog.client import OutcomeUnknown

    return OutcomeUnknown(f"outcome unknown: node {endpoint} did not answer membership_change", "r")


def _deaf(endpoint: str):
    from mnesite.rlog.client import Unavailable

    return Unavailable(f"node {endpoint} did not answer members within 5000 ms")


@pytest.mark.timeout(30)
def test_add_core_asks_the_change_anew_of_the_sequencer_elected_after_the_old_one_fell_silent(monkeypatch):
    """Regression: a sequencer that crashed (or was paused) while asked left the command with
    ``OutcomeUnknown`` (exit 3, "run it again"), though the cores elect another within seconds and
    asking the change of it is safe (a change is idempotent in its result). The command now asks the
    other cores' ``members`` until one names another sequencer, and asks the change of it anew."""
    endpoints = _Seat.endpoints
    node = _Seat("core1", ["core3", "core3", None, "core5"])  # the --node core: an election, then core5
    old = _Seat("core3", [_deaf(endpoints["core3"])], [_silent(endpoints["core3"])])
    answer = {"shard": "default", "members": ["core1", "core2", "core5"], "tx_key": [3, 2]}
    new = _Seat("core5", ["core3", None, "core5"], [answer])
    cli, clock = _cli_reaching(monkeypatch, node, old, new)
    done = _add_core2(cli, node)
    assert done.exit_code == 0, done.output
    assert "default: add core2 committed at (3, 2)" in done.stdout
    assert "default: the sequencer core3 fell silent (outcome unknown" in done.stderr
    assert "asking the change anew of its sequencer now, core5 (retry 1 of 3)" in done.stderr
    assert old.asked == [None] and new.asked == [None]  # a new request at the new sequencer
    assert 0 < clock.now < 1  # polled through the election


@pytest.mark.timeout(30)
def test_add_core_resends_the_same_request_to_a_silent_sequencer_that_answers_again(monkeypatch):
    """A paused sequencer that answers again, still named by the cores, is sent the same request id
    (its change may be under way there), not a new request."""
    endpoints = _Seat.endpoints
    node = _Seat("core1", ["core3"])
    answer = {"shard": "default", "members": ["core1", "core2"], "tx_key": [1, 9]}
    old = _Seat("core3", [_deaf(endpoints["core3"]), _deaf(endpoints["core3"]), "core3"])
    old.outcomes = [_silent(endpoints["core3"]), answer]
    cli, _ = _cli_reaching(monkeypatch, node, old)
    done = _add_core2(cli, node)
    assert done.exit_code == 0, done.output
    assert "default: core3 answers again: sending it the same request again (retry 1 of 3)" in done.stderr
    assert old.asked == [None, "r"]


@pytest.mark.timeout(30)
def test_add_core_keeps_the_outcome_unknown_when_no_other_sequencer_is_named_in_time(monkeypatch):
    """Nobody names another sequencer within ``SEQUENCER_WAIT_MS`` (the silent one still named, an
    election that does not end): exit 3 as before, saying what the cores answered; and a sequencer
    that falls silent again after each retry ends it after ``SEQUENCER_REASKS_MAX`` retries."""
    endpoints = _Seat.endpoints
    node = _Seat("core1", ["core3"])
    old = _Seat("core3", [_deaf(endpoints["core3"])], [_silent(endpoints["core3"])])
    cli, clock = _cli_reaching(monkeypatch, node, old)
    result = _add_core2(cli, node)
    assert result.exit_code == 3, result.output
    waited_s = membership.SEQUENCER_WAIT_MS / 1000
    assert "no answer to `members` either" in result.stderr
    assert f"no core named another sequencer of shard default within {waited_s:.0f} s" in result.stderr
    assert "core1 names core3; core3 no answer (unavailable); core5 no answer (unavailable)" in result.stderr
    assert waited_s <= clock.now <= waited_s + 1 and old.asked == [None]

    # Each retry's sequencer falls silent too: given up after SEQUENCER_REASKS_MAX retries.
    node = _Seat("core1", ["core3", "core5"] * 3)  # each election elects the other one
    old = _Seat("core3", [_deaf(endpoints["core3"])], [_silent(endpoints["core3"])] * 9)
    new = _Seat("core5", [_deaf(endpoints["core5"])], [_silent(endpoints["core5"])] * 9)
    cli, _ = _cli_reaching(monkeypatch, node, old, new)
    result = _add_core2(cli, node)
    assert result.exit_code == 3, result.output
    assert f"asked again {membership.SEQUENCER_REASKS_MAX} times after a silence" in result.stderr
    assert len(old.asked) + len(new.asked) == membership.SEQUENCER_REASKS_MAX + 1


@pytest.mark.timeout(30)
def test_add_core_reads_another_core_when_the_node_core_was_the_sequencer_and_fell_silent(monkeypatch):
    """Regression: with the sequencer named as --node (the common case) and silent after the change
    was asked, the command asked the change anew of the new sequencer, then read the final membership
    of the --node core only: exit 1 (its silence) though the change went through. That read now goes
    on to the other cores the last view named, and says which one answered."""
    endpoints = _Seat.endpoints
    node = _Seat("core1", ["core1", _deaf(endpoints["core1"])], [_silent(endpoints["core1"])])
    witness = _Seat("core3", ["core5"])
    answer = {"shard": "default", "members": ["core1", "core2", "core3", "core5"], "tx_key": [3, 2]}
    new = _Seat("core5", ["core5"], [answer])
    cli, _ = _cli_reaching(monkeypatch, node, witness, new)
    done = _add_core2(cli, node)
    assert done.exit_code == 0, done.output
    assert "default: add core2 committed at (3, 2)" in done.stdout and "members: core1" in done.stdout
    assert "the sequencer core1 fell silent" in done.stderr and "sequencer now, core5 (retry 1 of 3)" in done.stderr
    assert "`members` read from core3: the --node core core1 did not answer (node tcp://127.0.0.1:7400" in done.stderr
    assert node.asked == [None] and new.asked == [None]
    assert witness.viewed == 2 and new.viewed == 0  # once after the silence, once for the final read


@pytest.mark.timeout(30)
def test_add_core_waits_for_a_sequencer_in_another_cores_view_when_the_node_core_falls_silent(monkeypatch):
    """Regression: after a ``not_sequencer`` answer the command waited for a sequencer in the --node
    core's ``members`` only, which failed (exit 1) when that core was the sequencer that stepped down
    and then died. The other cores the last view named are asked when it does not answer."""
    endpoints = _Seat.endpoints
    node = _Seat("core1", ["core1", _deaf(endpoints["core1"])], [_not_sequencer()[0]])
    witness = _Seat("core3", [None, "core5"])  # an election, then core5
    answer = {"shard": "default", "members": ["core1", "core2", "core3", "core5"], "tx_key": [3, 2]}
    new = _Seat("core5", ["core5"], [answer])
    cli, clock = _cli_reaching(monkeypatch, node, witness, new)
    done = _add_core2(cli, node)
    assert done.exit_code == 0, done.output
    assert "default: add core2 committed at (3, 2)" in done.stdout
    assert "default: the sequencer changed" in done.stderr and "sequencer now, core5 (retry 1 of 3)" in done.stderr
    assert "`members` read from core3: the --node core core1 did not answer" in done.stderr
    assert node.asked == [None] and new.asked == [None] and new.viewed == 0
    assert witness.viewed == 3 and 0 < clock.now < 1  # two polls through the election, the final read


def _unreachable(endpoint: str):
    from mnesite.rlog.client import Unavailable

    # What a Client says of a core whose process is gone: nothing was sent (not an outcome unknown).
    return Unavailable(f"node {endpoint} is unreachable: nothing accepts connections there; is the node running?")


@pytest.mark.timeout(30)
def test_add_core_waits_for_a_live_sequencer_when_the_view_names_the_dead_node_core(monkeypatch):
    """Regression: the --node core (core1) died; the next view came from another core (core3) that
    had not noticed yet and still named core1 the sequencer. The change asked of core1 found nothing
    listening (``unavailable``: nothing sent, so nothing changed), and the command failed the shard
    (exit 1) instead of waiting, as it does for a sequencer that fell silent, for a view that names a
    live sequencer. It now waits (bounded by ``SEQUENCER_WAIT_MS``) and asks the change of core5."""
    endpoints = _Seat.endpoints
    node = _Seat("core1", ["core3", _deaf(endpoints["core1"])], [_unreachable(endpoints["core1"])])
    old = _Seat("core3", ["core1", "core1", "core5"], [_not_sequencer()[0]])  # stale, then the election's end
    answer = {"shard": "default", "members": ["core1", "core2", "core3", "core5"], "tx_key": [3, 2]}
    new = _Seat("core5", [_deaf(endpoints["core5"]), "core5"], [answer])  # busy electing: one poll more
    cli, clock = _cli_reaching(monkeypatch, node, old, new)
    done = _add_core2(cli, node)
    assert done.exit_code == 0, done.output
    assert "default: add core2 committed at (3, 2)" in done.stdout
    assert "default: the sequencer core1 is unreachable (node tcp://127.0.0.1:7400 is unreachable" in done.stderr
    assert "nothing was asked there; asking the change of its sequencer now, core5 (retry 2 of 3)" in done.stderr
    assert node.asked == [None] and old.asked == [None] and new.asked == [None]  # each a new request
    assert 0 < clock.now < 1

    # Nobody names another sequencer in time: exit 1 (nothing was changed), not 3, and said so.
    node = _Seat("core1", ["core1", _deaf(endpoints["core1"])], [_unreachable(endpoints["core1"])])
    old = _Seat("core3", ["core1"])
    cli, clock = _cli_reaching(monkeypatch, node, old)
    result = _add_core2(cli, node)
    assert result.exit_code == 1, result.output
    waited_s = membership.SEQUENCER_WAIT_MS / 1000
    assert "sequencer core1 is unreachable" in result.stderr
    assert f"no core named another sequencer of shard default within {waited_s:.0f} s" in result.stderr
    assert "nothing was changed in shard default" in result.stderr
    assert waited_s <= clock.now <= waited_s + 1 and node.asked == [None]


class _Interrupting(_Seat):
    """A core whose ``members`` is interrupted (Ctrl-C) once it has answered ``answered`` times."""

    def __init__(self, name, sequencers, outcomes=(), answered=0):
        super().__init__(name, sequencers, outcomes)
        self.answered = answered

    def members(self):
        if self.viewed >= self.answered:
            self.viewed += 1
            raise KeyboardInterrupt
        return super().members()


@pytest.mark.timeout(30)
def test_ctrl_c_names_the_core_the_command_was_asking_not_the_node_core(monkeypatch):
    """Regression: a Ctrl-C after the --node core fell silent (the sequencer the change was asked
    at), while the command asked another core's ``members`` which sequencer the cores name now, said
    "watch it with `mnesite cluster members --node` <the silent --node core>"; and one at the final
    read, answered by another core since the --node core did not, said to check with the --node
    core. Each now names the core the command was asking and what to check there."""
    endpoints = _Seat.endpoints
    node = _Seat("core1", ["core1", _deaf(endpoints["core1"])], [_silent(endpoints["core1"])])
    witness = _Interrupting("core3", ["core1"])
    cli, _ = _cli_reaching(monkeypatch, node, witness)
    result = _add_core2(cli, node)
    assert result.exit_code == 1, result.output
    error = result.stderr.splitlines()[-1]
    assert error.startswith("Error: add core2 interrupted while waiting for shard default: its change was asked")
    assert f"(asked at {endpoints['core1']}, which did not give the answer; the command was asking core3 at" in error
    assert f"check with `mnesite cluster members --node {endpoints['core3']}` which sequencer shard default" in error
    assert f"--node {endpoints['core1']}" not in error
    assert node.asked == [None] and witness.viewed == 1

    answer = {"shard": "default", "members": ["core1", "core2"], "tx_key": [1, 4]}
    node = _Seat("core1", ["core1", _deaf(endpoints["core1"])], [answer])
    witness = _Interrupting("core3", ["core1"])
    cli, _ = _cli_reaching(monkeypatch, node, witness)
    result = _add_core2(cli, node)
    assert result.exit_code == 5, result.output
    error = result.stderr.splitlines()[-1]
    assert "only that read (of core3: the --node core core1 did not answer) was interrupted" in error
    assert error.endswith(f"check with `mnesite cluster members --node {endpoints['core3']}`")


def test_a_change_that_reached_no_core_waits_for_another_sequencer_as_after_a_silence():
    """The rule (pure): which failure of an asked change sends the command where."""
    after = membership.after_change_failure
    assert after("outcome_unknown", None) == "silent"
    assert after("unavailable", None) == "unreachable"  # nothing sent: nothing changed
    assert after("unavailable", "key") == "fail" and after("unavailable", "connections_max") == "fail"
    assert after(REJECT_NOT_SEQUENCER, None) == "moved" and after("no_sequencer", None) == "moved"
    assert after(membership.REJECT_NOT_SETTLED, None) == "settling"
    assert after(membership.REJECT_CHANGE_IN_FLIGHT, None) == "fail" and after("forbidden", None) == "fail"


@pytest.mark.timeout(30)
def test_add_core_fails_as_before_when_no_core_answers_members(monkeypatch):
    """Every core silent: the final read after every shard changed fails with the --node core's
    error (exit 1, as before), and so does the wait for a sequencer after ``not_sequencer`` (exit 1
    after ``SEQUENCER_WAIT_MS``), each core asked once per round."""
    endpoints = _Seat.endpoints
    answer = {"shard": "default", "members": ["core1", "core2"], "tx_key": [1, 4]}
    deaf = [_Seat(name, [_deaf(endpoints[name])]) for name in ("core3", "core5")]
    node = _Seat("core1", ["core1", _deaf(endpoints["core1"])], [answer])
    cli, _ = _cli_reaching(monkeypatch, node, *deaf)
    result = _add_core2(cli, node)
    assert result.exit_code == 1, result.output
    assert "node tcp://127.0.0.1:7400 did not answer members within 5000 ms" in result.stderr
    assert [seat.viewed for seat in (node, *deaf)] == [2, 1, 1]

    deaf = [_Seat(name, [_deaf(endpoints[name])]) for name in ("core3", "core5")]
    node = _Seat("core1", ["core1", _deaf(endpoints["core1"])], [_not_sequencer()[0]])
    cli, clock = _cli_reaching(monkeypatch, node, *deaf)
    result = _add_core2(cli, node)
    assert result.exit_code == 1, result.output
    waited_s = membership.SEQUENCER_WAIT_MS / 1000
    assert f"no sequencer was known within {waited_s:.0f} s (`members` at tcp://127.0.0.1:7400 failed" in result.stderr
    assert waited_s <= clock.now <= waited_s + 1
    rounds = node.viewed - 1
    assert rounds > 1 and [seat.viewed for seat in deaf] == [rounds, rounds]


@pytest.mark.timeout(30)
def test_add_core_takes_already_member_for_done_only_once_the_committed_membership_shows_it(monkeypatch):
    """Regression: ``already_member`` / ``not_member`` say the LATEST membership entry of the
    sequencer's log has the change, committed or not (after a re-ask, a crashed sequencer's entry the
    new one holds; on a plain rerun, a half-done run's), and the command said the shard was changed
    at once. It now waits, showing it, until ``members`` shows the committed membership with it;
    and it is still under way (exit 3) if that does not move for ``CHANGE_STALL_MS``."""
    endpoints = _Seat.endpoints
    added = ["core1", "core2", "core5"]
    uncommitted = {"sequencer": "core5", "members": added, "committed_members": ["core1", "core5"]}
    committed = {**uncommitted, "committed_members": added}
    unchanged = {"shard": "default", "members": ["core1", "core2", "core5"], "unchanged": "already_member"}
    node = _Seat("core1", ["core3", "core5"])
    old = _Seat("core3", [_deaf(endpoints["core3"])], [_silent(endpoints["core3"])])
    new = _Seat("core5", [uncommitted, uncommitted, uncommitted, committed], [unchanged])
    cli, clock = _cli_reaching(monkeypatch, node, old, new)
    done = _add_core2(cli, node)
    assert done.exit_code == 0, done.output
    assert "default: unchanged (already_member)" in done.stdout
    assert "default: waiting for the entry that changes the members (core1, core2, core5)" in done.stderr
    assert new.viewed == 4 and new.asked == [None]

    # The same rule without a re-ask: a plain rerun answered already_member.
    clock = _Clock()
    plain = {"members": ["core1", "core2"], "committed_members": ["core1"]}
    views = [plain, plain, {**plain, "committed_members": ["core1", "core2"]}]
    core = _FakeCore(["default"], {"default": [unchanged]}, views, clock)
    cli = _cli_with(monkeypatch, core)
    monkeypatch.setattr(cli, "time", clock)
    done = _add_core2(cli, core)
    assert done.exit_code == 0, done.output
    assert "default: unchanged (already_member)" in done.stdout and core.views == []
    # Never committed: still under way after CHANGE_STALL_MS, not done.
    stall_s = membership.CHANGE_STALL_MS / 1000
    core = _FakeCore(["default"], {"default": [unchanged]}, [plain] * int(stall_s / 0.2 + 10), clock)
    cli = _cli_with(monkeypatch, core)
    result = _add_core2(cli, core)
    assert result.exit_code == 3, result.output
    assert f"still under way, with no progress for {stall_s:.0f} s" in result.stderr


@pytest.mark.timeout(30)
def test_add_core_asks_again_a_sequencer_not_settled_yet(monkeypatch):
    """Regression: a new sequencer whose generation has not committed yet refuses a change with
    ``sequencer_not_settled``, which ended the command (exit 1) though it only means "in a moment".
    The command asks again every ``SEQUENCER_POLL_MS`` for up to ``SEQUENCER_WAIT_MS``."""
    from mnesite.rlog.client import RemoteError

    def not_settled():
        return RemoteError(
            f"membership change refused in shard default: {membership.REJECT_NOT_SETTLED}",
            membership.REJECT_NOT_SETTLED,
        )

    answer = {"shard": "default", "members": ["core1", "core2"], "tx_key": [2, 3]}
    clock = _Clock()
    core = _FakeCore(["default"], {"default": [not_settled(), not_settled(), answer]}, clock=clock)
    cli = _cli_with(monkeypatch, core)
    monkeypatch.setattr(cli, "time", clock)
    done = _add_core2(cli, core)
    assert done.exit_code == 0, done.output
    assert "default: add core2 committed at (2, 3)" in done.stdout
    assert core.asked == [("default", None)] * 3  # each a new request: nothing was written for a refusal
    # Bounded: never settled within SEQUENCER_WAIT_MS, nothing changed (exit 1).
    core = _FakeCore(["default"], {"default": [not_settled() for _ in range(200)]}, clock=clock)
    cli = _cli_with(monkeypatch, core)
    result = _add_core2(cli, core)
    assert result.exit_code == 1, result.output
    waited_s = membership.SEQUENCER_WAIT_MS / 1000
    assert f"did not settle (commit an entry of its generation) within {waited_s:.0f} s" in result.stderr
    assert "nothing was changed in shard default" in result.stderr
