"""``core.rules.not_serving_reason``: whether a core serves local reads of a shard, and why not.

The driver (``CoreNode._not_serving_reason``) and the simulator's local-read gate both run it; the
simulator's check that it matters is in ``tests/test_simulation.py``."""

from __future__ import annotations

from mnesite.core import rules
from mnesite.rlog.types import TxKey

STUCK = "the sequencer's entry (2, 7) was refused: this core does not speak cluster version 9"


def test_a_core_with_whole_rows_an_install_left_alone_and_a_log_it_follows_serves():
    assert rules.not_serving_reason(None, False, None, TxKey(2, 6)) is None
    assert rules.not_serving_reason(None, False, None, None) is None


def test_an_install_says_why_in_its_own_words():
    for said in ("installing a snapshot at (3, 40)", "replaying after a snapshot install"):
        assert rules.not_serving_reason(said, False, None, TxKey(2, 6)) == said
    # Its words are the more precise ones: they win over the rows it deleted and over a stuck log.
    abandoned = (
        "a snapshot install was abandoned (no answer; the shard's rows are half copied); "
        "asking the sequencer for another offer"
    )
    assert rules.not_serving_reason(abandoned, True, STUCK, TxKey(2, 6)) == abandoned


def test_rows_an_install_deleted_are_not_served_even_when_the_install_said_nothing():
    # The simulator's case: its installs are one step, so only the half-copied rows remain to say it.
    assert rules.not_serving_reason(None, True, None, TxKey(2, 6)) == rules.ROWS_LOST_REASON
    assert "half copied" in rules.ROWS_LOST_REASON
    # Half-copied rows are the first thing to mend: a stuck log is said once they are whole.
    assert rules.not_serving_reason(None, True, STUCK, TxKey(2, 6)) == rules.ROWS_LOST_REASON


def test_a_core_stuck_at_a_refused_entry_says_where_its_applied_state_stopped():
    assert rules.not_serving_reason(None, False, STUCK, TxKey(2, 6)) == f"stopped at (2, 6): {STUCK}"
    assert rules.not_serving_reason(None, False, STUCK, None) == f"stopped: {STUCK}"


def test_a_core_a_forced_start_left_out_serves_no_read_and_says_what_to_do():
    """Left out, its applied state no longer moves while the forced generation's goes on (and its
    journal may diverge from it): its local reads, queries and changefeed pages would be ever staler,
    with no lag to show it (no sequencer counts it as a follower). ``not_ready`` sends the client on."""
    reason = rules.not_serving_reason(None, False, None, TxKey(2, 6), excluded_generation=4)
    assert reason is not None
    assert "left out of the shard by a forced start (generation 4)" in reason
    assert "applied state stopped at (2, 6)" in reason and "cluster add-core" in reason
    assert rules.not_serving_reason(None, False, None, None, excluded_generation=4) is not None
    # Being left out is the thing to mend (a rebuild mends the rows and the log too); an install's
    # own words (a core added back catching up by snapshot) stay the more precise ones.
    assert rules.not_serving_reason(None, True, STUCK, TxKey(2, 6), excluded_generation=4) == reason
    assert rules.not_serving_reason("installing a snapshot", True, None, None, excluded_generation=4) == (
        "installing a snapshot"
    )
