"""``core.outcome``: what a client is told about its write, and when a core forwards it."""

from __future__ import annotations

from mnesite.core.outcome import (
    REASON_FORWARD_TIMEOUT,
    REASON_OTHER_ENTRY,
    REASON_SENT_AGAIN,
    REASON_TRUNCATED,
    Acknowledged,
    CommitWaiters,
    ForwardedRequests,
    OutcomeUnknown,
    Unsent,
    forward_target,
)
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, Entry, TxKey


def entry(counter: int, request_id: str | None) -> Entry:
    return Entry("s", TxKey(1, counter), TxKey(1, counter - 1), GENESIS_DIGEST, (), request_id)


def test_a_waiter_is_acknowledged_only_by_its_own_entry():
    waiters: CommitWaiters[str] = CommitWaiters()
    assert waiters.answer_now(TxKey(1, 1), "a", ZERO_KEY) is None
    waiters.wait(TxKey(1, 1), "a", "client-a")
    waiters.wait(TxKey(1, 2), "b", "client-b")
    assert len(waiters) == 2
    answers = waiters.committed([entry(1, "a"), entry(2, "someone else")])
    assert answers == [
        ("client-a", Acknowledged("a", TxKey(1, 1))),
        ("client-b", OutcomeUnknown("b", REASON_OTHER_ENTRY)),
    ]
    assert len(waiters) == 0


def test_a_resend_waiting_for_its_uncommitted_entry_is_acknowledged_as_a_duplicate():
    waiters: CommitWaiters[str] = CommitWaiters()
    waiters.wait(TxKey(1, 1), "a", "first attempt")
    waiters.wait(TxKey(1, 1), "a", "resend", duplicate=True)
    assert waiters.committed([entry(1, "a")]) == [
        ("first attempt", Acknowledged("a", TxKey(1, 1))),
        ("resend", Acknowledged("a", TxKey(1, 1), True)),
    ]


def test_a_truncation_tells_every_waiter_above_it_that_the_outcome_is_unknown():
    waiters: CommitWaiters[str] = CommitWaiters()
    for counter in (1, 2, 3):
        waiters.wait(TxKey(1, counter), f"r{counter}", f"c{counter}")
    assert waiters.truncated(TxKey(1, 1)) == [
        ("c2", OutcomeUnknown("r2", REASON_TRUNCATED)),
        ("c3", OutcomeUnknown("r3", REASON_TRUNCATED)),
    ]
    # The one below the truncation still waits, and is acknowledged when it commits.
    assert waiters.committed([entry(1, "r1")]) == [("c1", Acknowledged("r1", TxKey(1, 1)))]


def test_an_applied_key_is_answered_at_once_and_a_failed_proposal_is_unknown():
    waiters: CommitWaiters[str] = CommitWaiters()
    assert waiters.answer_now(TxKey(1, 2), "a", TxKey(1, 5), duplicate=True) == Acknowledged("a", TxKey(1, 2), True)
    assert waiters.answer_now(TxKey(1, 6), "b", TxKey(1, 5)) is None
    waiters.wait(TxKey(1, 6), "b", "d")
    assert waiters.failed(TxKey(1, 6), "lost leadership") == [("d", OutcomeUnknown("b", "lost leadership"))]
    waiters.wait(TxKey(1, 7), "e", "f")
    assert waiters.abandoned("snapshot") == [("f", OutcomeUnknown("e", "snapshot"))]
    assert len(waiters) == 0


def test_a_request_is_forwarded_once_and_only_to_another_known_sequencer():
    assert forward_target("core2", "core1", already_forwarded=False) == "core2"
    assert forward_target("core2", "core1", already_forwarded=True) is None
    assert forward_target(None, "core1", already_forwarded=False) is None
    assert forward_target("core1", "core1", already_forwarded=False) is None


def test_forwarded_requests_are_told_when_their_sequencer_is_replaced_or_silent():
    forwarded: ForwardedRequests[str] = ForwardedRequests(forwarded_max=2, timeout_ms=100)
    forwarded.forwarded("a", "ca", "s", "core2", now_ms=0)
    forwarded.forwarded("b", "cb", "t", "core2", now_ms=50)
    assert forwarded.full()
    # Still following core2 in shard s: nothing to tell.
    assert forwarded.sequencer_changed("s", "core2") == []
    assert forwarded.sequencer_changed("s", "core3") == [("ca", OutcomeUnknown("a", "sequencer core2 was replaced"))]
    assert forwarded.expired(149) == []
    assert forwarded.expired(150) == [("cb", OutcomeUnknown("b", REASON_FORWARD_TIMEOUT))]
    assert len(forwarded) == 0
    forwarded.forwarded("c", "cc", "s", "core3", now_ms=0)
    assert forwarded.answered("c") == "cc"
    assert forwarded.answered("c") is None  # a late duplicate answer: nobody waits for it


def test_a_request_forwarded_again_while_pending_tells_the_earlier_one():
    """A client that heard nothing resends the same request id on a new connection: the sequencer's
    one answer goes to the newest, and the earlier (its connection's place held) is told at once
    instead of never."""
    forwarded: ForwardedRequests[str] = ForwardedRequests(forwarded_max=2, timeout_ms=100)
    assert forwarded.forwarded("a", "first", "s", "core2", now_ms=0) == []
    assert forwarded.forwarded("a", "second", "s", "core2", now_ms=60) == [
        ("first", OutcomeUnknown("a", REASON_SENT_AGAIN))
    ]
    assert len(forwarded) == 1
    assert forwarded.expired(100) == []  # the resend's own deadline counts
    assert forwarded.answered("a") == "second"


def test_a_forward_dropped_at_send_is_answered_at_once_as_nothing_reached_unless_it_replaced_one():
    """Rule 5: a forward whose frame never left the core is taken out now (not at its timeout); nothing
    reached the sequencer unless it replaced an earlier forward of its id (rule 4), which may have."""
    forwarded: ForwardedRequests[str] = ForwardedRequests(forwarded_max=4, timeout_ms=100)
    forwarded.forwarded("a", "first", "s", "core2", now_ms=0)
    assert forwarded.unsent("a") == Unsent("first", "s", "core2", may_have_reached=False)
    assert forwarded.unsent("a") is None and len(forwarded) == 0  # answered once
    forwarded.forwarded("b", "first", "s", "core2", now_ms=0)
    forwarded.forwarded("b", "second", "s", "core2", now_ms=10)
    assert forwarded.unsent("b") == Unsent("second", "s", "core2", may_have_reached=True)
    assert forwarded.expired(10**6) == []


def test_held_writes_are_proposed_as_one_batch_in_arrival_order_and_each_finds_its_outcome():
    """``core.rules.HeldWrites`` and ``batch_outcomes``: the driver and the simulator hold a turn's
    writes without guards and propose them in one ``ProposedBatch``; each then waits for the entry
    carrying its request id, or hears the machine's refusal."""
    from mnesite.core.consensus import PersistEntries, ProposalRejected, Proposed, ProposedBatch
    from mnesite.core.rules import HeldWrites, batch_outcomes, holds_write
    from mnesite.core.transaction import Guard, Transaction

    plain = Transaction("default", (), ())
    guarded = Transaction("default", (Guard("kv", 1, None),), ())
    assert holds_write(plain) and not holds_write(guarded) and not holds_write(None)  # None: a schema change

    held: HeldWrites[str] = HeldWrites()
    assert not held
    for request_id in ("a", "b", "c"):
        held.hold(Proposed((), request_id), f"client-{request_id}")
    assert len(held) == 3 and held.holds("b") and not held.holds("d")
    batch, contexts = held.take()
    assert batch == ProposedBatch((Proposed((), "a"), Proposed((), "b"), Proposed((), "c")))
    assert contexts == [("a", "client-a"), ("b", "client-b"), ("c", "client-c")]
    assert not held and not held.holds("b")  # taken once: a resend of "b" is answered from the log now

    refusal = ProposalRejected("c", "too_large", None)
    keys, refused = batch_outcomes([PersistEntries((entry(7, "a"), entry(8, None), entry(9, "b"))), refusal])
    assert keys == {"a": TxKey(1, 7), "b": TxKey(1, 9)} and refused == {"c": refusal}


def test_resends_of_one_connection_waiting_under_one_id_are_bounded():
    from mnesite.core.outcome import RESENDS_WAITING_MAX

    waiters: CommitWaiters[str] = CommitWaiters()
    assert waiters.wait(TxKey(1, 1), "a", "connection")
    added = [waiters.wait(TxKey(1, 1), "a", "connection", duplicate=True) for _ in range(3 * RESENDS_WAITING_MAX)]
    assert added.count(True) == RESENDS_WAITING_MAX - 1 and len(waiters) == RESENDS_WAITING_MAX
    # Another connection's resend of the same id, and the first one's other ids, still wait.
    assert waiters.wait(TxKey(1, 1), "a", "other connection", duplicate=True)
    assert waiters.wait(TxKey(1, 1), "b", "connection", duplicate=True)
    answers = waiters.committed([entry(1, "a")])
    assert len(answers) == RESENDS_WAITING_MAX + 2
    assert answers[0] == ("connection", Acknowledged("a", TxKey(1, 1)))
    assert answers[-1] == ("connection", OutcomeUnknown("b", REASON_OTHER_ENTRY))
