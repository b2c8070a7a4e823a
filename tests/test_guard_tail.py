"""Unit tests of core.guard_tail: a failed guard is told only from committed state."""

from __future__ import annotations

import pytest
from mnesite.core.guard_tail import GUARD_ANSWER, GUARD_HELD, GUARD_RETRY, GuardTail
from mnesite.rlog.schema import define_table
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ZERO_KEY,
    AddColumnOp,
    DeleteOp,
    DropTableOp,
    TxKey,
    WriteOp,
    make_entry,
)

pytestmark = pytest.mark.timeout(10)

TABLE = define_table("t", "k", [["k", "INTEGER"], ["v", "INTEGER"]], "s")
CATALOG = {"t": TABLE}
FIRST = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (WriteOp("t", {"k": 1, "v": 10}),), "w1")
SECOND = make_entry("s", TxKey(1, 2), FIRST.tx_key, FIRST.digest, (DeleteOp("t", 1),), "w2")


def test_the_tail_gives_each_row_its_future_value():
    tail: GuardTail[str] = GuardTail(CATALOG)
    assert tail.row("t", 1) == (False, None) and tail.last_key() is None
    tail.add((FIRST,))
    assert tail.row("t", 1) == (True, {"k": 1, "v": 10})
    tail.add((SECOND,))
    assert tail.row("t", 1) == (True, None) and tail.last_key() == TxKey(1, 2)


def test_a_failure_against_committed_state_is_answered_at_once_only_with_a_read_index():
    tail: GuardTail[str] = GuardTail(CATALOG)
    assert tail.failed("a", ZERO_KEY, read_index=ZERO_KEY, now_ms=0) == GUARD_ANSWER
    assert tail.failed("b", ZERO_KEY, read_index=None, now_ms=0) == GUARD_RETRY
    assert tail.held_count() == 0


def test_a_failure_that_observed_the_uncommitted_tail_waits_until_it_commits():
    tail: GuardTail[str] = GuardTail(CATALOG)
    tail.add((FIRST, SECOND))
    assert tail.failed("a", ZERO_KEY, read_index=ZERO_KEY, now_ms=0) == GUARD_HELD
    assert tail.committed(TxKey(1, 1), CATALOG, read_index=TxKey(1, 1)) == []
    assert tail.row("t", 1) == (True, None), "the uncommitted delete still counts for new guards"
    assert tail.committed(TxKey(1, 2), CATALOG, read_index=TxKey(1, 2)) == [("a", GUARD_ANSWER)]
    assert tail.held_count() == 0 and tail.last_key() is None


def test_a_released_failure_without_a_read_index_is_told_to_retry():
    tail: GuardTail[str] = GuardTail(CATALOG)
    tail.add((FIRST,))
    tail.failed("a", ZERO_KEY, read_index=None, now_ms=0)
    assert tail.committed(TxKey(1, 1), CATALOG, read_index=None) == [("a", GUARD_RETRY)]


def test_a_failure_whose_observed_entries_are_truncated_is_evaluated_again():
    tail: GuardTail[str] = GuardTail(CATALOG)
    tail.add((FIRST,))
    tail.failed("a", ZERO_KEY, read_index=ZERO_KEY, now_ms=0)
    tail.add((SECOND,))
    tail.failed("b", ZERO_KEY, read_index=ZERO_KEY, now_ms=0)
    assert tail.truncated(TxKey(1, 1), CATALOG) == ["b"]
    assert tail.row("t", 1) == (True, {"k": 1, "v": 10})
    assert tail.committed(TxKey(1, 1), CATALOG, read_index=TxKey(1, 1)) == [("a", GUARD_ANSWER)]


def test_held_failures_are_handed_back_when_the_tail_is_replaced():
    """A rebuild from disk (a full disk) or a snapshot install gives the shard a new tail: its held
    failures are handed back once, to be told to retry (they were dropped unanswered)."""
    tail: GuardTail[str] = GuardTail(CATALOG)
    tail.add((FIRST,))
    assert tail.failed("a", ZERO_KEY, read_index=ZERO_KEY, now_ms=0) == GUARD_HELD
    assert tail.abandoned() == ["a"]
    assert tail.held_count() == 0 and tail.abandoned() == []


def test_held_failures_are_bounded_in_number_and_time():
    tail: GuardTail[str] = GuardTail(CATALOG, failures_held_max=1, hold_ms_max=100)
    tail.add((FIRST,))
    assert tail.failed("a", ZERO_KEY, read_index=ZERO_KEY, now_ms=0) == GUARD_HELD
    assert tail.failed("b", ZERO_KEY, read_index=ZERO_KEY, now_ms=0) == GUARD_RETRY
    assert tail.expired(99) == []
    assert tail.expired(100) == ["a"] and tail.held_count() == 0


def test_a_guard_reads_a_row_absent_once_the_tail_drops_its_table():
    """A row only in the applied store is gone once the unapplied tail drops its table (a guard that
    read the applied row there answered a value no committed prefix holds: the simulator caught it)."""
    tail: GuardTail[str] = GuardTail(CATALOG)
    applied = {"k": 2, "v": 49}
    assert tail.read("t", 2, lambda: applied) == applied
    tail.add((make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (DropTableOp("t", "s"),)),))
    assert tail.read("t", 2, lambda: applied) is None
    assert tail.row("t", 2) == (False, None), "the tail's own index does not hold the applied row"


def test_a_column_the_tail_adds_is_null_in_rows_written_before_it_applied_or_in_the_tail():
    """The apply's ``ALTER TABLE ... ADD COLUMN`` leaves the new column null in every row there: a guard
    read through the tail sees each row so, whether the tail wrote it before the column was added or
    it is applied (read with the table as applied). A row lacking the column failed a guard naming it
    null, and passed one naming what SQLite read for a column it did not have yet."""
    add = make_entry("s", TxKey(1, 2), FIRST.tx_key, FIRST.digest, (AddColumnOp("t", "s", "w", "TEXT"),), "a1")
    tail: GuardTail[str] = GuardTail(CATALOG)
    tail.add((FIRST, add))
    assert tail.read("t", 1, lambda: None) == {"k": 1, "v": 10, "w": None}
    assert tail.read("t", 2, lambda: {"k": 2, "v": 20}) == {"k": 2, "v": 20, "w": None}
    assert tail.read("t", 3, lambda: None) is None
    assert tail.catalog_over(CATALOG)["t"].column_types["w"] == "TEXT"
