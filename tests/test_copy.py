"""The bootstrap copy's rule (``bootstrap.copy.TableCopy``): a core's batch must move the copy forward in
the table's key order, as SQLite orders keys (NULL < numbers < TEXT < BLOB; TEXT by its UTF-8 bytes), or the
copy fails and the owner starts again from another core. A core's answers are untrusted input: a batch
that only checked "the last key differs from the previous one" let a hostile or broken core send keys
that go back and forth, and the copy never ended."""

from __future__ import annotations

import pytest
from mnesite.bootstrap.copy import CopyFailed, TableCopy
from mnesite.rlog.replication import BatchReceived, TablesReceived


def copy_after(first_batch: list) -> TableCopy:
    copy = TableCopy("core1", batch_rows_max=10, now_ms=0)
    copy.on_tables(TablesReceived("core1", ("t",), ("k",)))
    copy.on_batch(BatchReceived("core1", "t", None, tuple({"k": k} for k in first_batch), False))
    return copy


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ([1, 2, 3], [4]),
        ([1, 2, 3], [3.5]),  # numbers compare as numbers, integer or real
        ([1, 2, 3], ["a"]),  # every number sorts before every TEXT
        (["a", "b"], ["b\u00e9"]),  # TEXT by its UTF-8 bytes
        (["y", "z"], [b"\x00"]),  # every TEXT sorts before every BLOB
        ([b"\x01"], [b"\x01\x00"]),
    ],
)
def test_a_batch_that_moves_forward_in_sqlite_key_order_is_taken(first: list, then: list) -> None:
    copy = copy_after(first)
    effects = copy.on_batch(BatchReceived("core1", "t", first[-1], tuple({"k": k} for k in then), False))
    assert copy.after == then[-1] and effects


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ([1, 2, 3], [3]),  # the same key again
        ([1, 2, 3], [2]),  # back: the copy would ask for rows after 2, then after 3, forever
        ([5, 6], [4.5]),
        (["b"], [7]),  # a number after TEXT goes back
        ([b"\x02"], ["z"]),  # TEXT after BLOB goes back
    ],
)
def test_a_batch_that_does_not_move_forward_fails_the_copy(first: list, then: list) -> None:
    copy = copy_after(first)
    with pytest.raises(CopyFailed, match="does not advance"):
        copy.on_batch(BatchReceived("core1", "t", first[-1], tuple({"k": k} for k in then), False))


def test_a_key_sqlite_cannot_hold_fails_the_copy() -> None:
    copy = copy_after([1])
    with pytest.raises(CopyFailed, match="key"):
        copy.on_batch(BatchReceived("core1", "t", 1, ({"k": [2]},), False))


def test_no_eta_before_every_table_s_row_count_is_known() -> None:
    """A table's row count comes with its first batch, so while the first of two tables was copied the
    ETA was that of the first alone: 'ETA 1 s' with a whole second table still to copy, and 'ETA 0 s'
    between the two tables. It is unknown until every table's count is (then: rows of all of them)."""
    copy = TableCopy("core1", batch_rows_max=10, now_ms=0)
    copy.on_tables(TablesReceived("core1", ("a", "b"), ("k", "k")))
    copy.on_batch(BatchReceived("core1", "a", None, tuple({"k": k} for k in range(10)), False, rows_total=20))
    assert copy.progress(1_000) == (10.0, None)
    copy.on_batch(BatchReceived("core1", "a", 9, tuple({"k": k} for k in range(10, 20)), True))
    assert copy.progress(2_000) == (10.0, None)
    copy.on_batch(BatchReceived("core1", "b", None, tuple({"k": k} for k in range(10)), False, rows_total=1000))
    assert copy.rows_expected == 1020 and copy.progress(3_000) == (10.0, 99_000)
    # A table too large to count (None) leaves the ETA unknown to the end.
    uncounted = TableCopy("core1", batch_rows_max=10, now_ms=0)
    uncounted.on_tables(TablesReceived("core1", ("a", "b"), ("k", "k")))
    uncounted.on_batch(BatchReceived("core1", "a", None, ({"k": 1},), True, rows_total=None))
    uncounted.on_batch(BatchReceived("core1", "b", None, ({"k": 1},), False, rows_total=2))
    assert uncounted.progress(1_000) == (2.0, None)


def test_an_empty_batch_that_is_not_done_fails_the_copy() -> None:
    """Regression: an empty batch with ``done`` false moved the copy on to the next table, so a faulty
    core could make a copy skip the rest of a table (its rows never copied, the replica serving without
    them). A correct core answers an exhausted table with ``done`` (``bootstrap.serve.read_batch``);
    anything else is that core's protocol error: the copy fails and the owner starts again."""
    for first in ([], [1, 2]):
        copy = TableCopy("core1", batch_rows_max=10, now_ms=0)
        copy.on_tables(TablesReceived("core1", ("t", "u"), ("k", "k")))
        if first:
            copy.on_batch(BatchReceived("core1", "t", None, tuple({"k": k} for k in first), False))
        after = first[-1] if first else None
        with pytest.raises(CopyFailed, match="empty batch of t"):
            copy.on_batch(BatchReceived("core1", "t", after, (), False))
        assert copy.tables[copy.table_index] == "t", "the copy did not move on to the next table"
    done = TableCopy("core1", batch_rows_max=10, now_ms=0)
    done.on_tables(TablesReceived("core1", ("t", "u"), ("k", "k")))
    assert done.on_batch(BatchReceived("core1", "t", None, (), True)) == [done._next()[0]]
    assert done.tables[done.table_index] == "u", "an empty table's batch is done and moves on"
