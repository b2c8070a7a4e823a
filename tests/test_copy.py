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
