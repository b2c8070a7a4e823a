"""``bootstrap.fence``: the read fence after a bootstrap, shared by replicas and a core's snapshot install."""

from __future__ import annotations

from mnesite.bootstrap.fence import ReadFence
from mnesite.rlog.types import TxKey


def test_reads_wait_for_the_committed_key_known_after_the_copy():
    fence = ReadFence(fenced=False, ask_interval_ms=100)
    assert not fence.should_ask(0)  # no fence, nothing to ask
    fence.fence()
    assert fence.should_ask(0) and not fence.should_ask(50)  # asked once per interval
    assert fence.question == 1
    assert not fence.committed_received(TxKey(1, 9), applied_key=TxKey(1, 5), question=1)
    assert fence.fenced and fence.fence_key == TxKey(1, 9)
    assert not fence.reached(TxKey(1, 8))
    assert fence.reached(TxKey(1, 9)) and not fence.fenced
    assert not fence.reached(TxKey(1, 10))  # reported once


def test_a_lost_or_empty_answer_is_asked_again_and_the_first_key_answered_stays_the_fence():
    fence = ReadFence(fenced=True, ask_interval_ms=100)  # a restart while fenced
    assert fence.next_ask_ms(7) == 7 and fence.should_ask(7)
    assert not fence.should_ask(106) and fence.should_ask(107)  # the answer was lost
    assert not fence.committed_received(None, TxKey(1, 1), 2)  # no quorum: ask again at once
    assert fence.should_ask(108)
    fence.committed_received(TxKey(1, 5), TxKey(1, 1), 3)
    assert fence.next_ask_ms(200) is None  # known: nothing more to ask
    assert not fence.committed_received(TxKey(1, 50), TxKey(1, 1), 3)  # not asked: ignored
    assert fence.fence_key == TxKey(1, 5)


def test_an_answer_to_a_forgotten_question_is_ignored():
    fence = ReadFence(fenced=True, ask_interval_ms=100)
    fence.should_ask(0)
    fence.forget_question()  # the replica changed upstream
    assert not fence.committed_received(TxKey(1, 1), TxKey(1, 1), 1)
    assert fence.fenced and fence.fence_key is None
    # A fence already reached when the answer arrives clears at the answer.
    fence.should_ask(1)
    assert fence.committed_received(TxKey(1, 1), TxKey(1, 3), 2) and not fence.fenced


def test_only_the_answer_to_the_question_asked_last_counts_across_copies():
    """Regression: a late answer to a question of an earlier copy was taken for the current copy's
    (its committed key may be from before this copy ended: reads of its dirty rows served)."""
    fence = ReadFence(fenced=False, ask_interval_ms=100)
    fence.fence()  # copy 1 done
    assert fence.should_ask(0) and fence.question == 1
    fence.fence()  # copy 1 abandoned, copy 2 done: asked anew
    assert fence.should_ask(10) and fence.question == 2
    assert not fence.committed_received(TxKey(1, 3), TxKey(1, 9), 1), "question 1's answer opened copy 2's fence"
    assert not fence.committed_received(None, TxKey(1, 9), 1)  # nor does its timeout end question 2
    assert fence.fenced and fence.fence_key is None and fence.asked_ms == 10
    assert not fence.committed_received(TxKey(1, 12), TxKey(1, 9), 2)
    assert fence.fence_key == TxKey(1, 12) and fence.reached(TxKey(1, 12))


def test_a_question_not_sent_keeps_why_and_is_asked_again_at_its_interval_not_at_once():
    """The owner could not send it (its table of pending requests full): nothing will answer it."""
    fence = ReadFence(fenced=True, ask_interval_ms=100)
    assert fence.should_ask(10) and fence.question == 1
    fence.unsent(1, "overloaded: the pending requests are full")
    assert fence.error == "overloaded: the pending requests are full"
    assert fence.next_ask_ms(20) == 110 and not fence.should_ask(20)  # what kept it may keep the next
    fence.unsent(0, "an earlier question's")  # not the question asked last: ignored
    assert fence.error == "overloaded: the pending requests are full"
    assert fence.should_ask(110)
    assert fence.committed_received(TxKey(1, 3), TxKey(1, 3), 2) and fence.error is None
