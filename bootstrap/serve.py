"""The serving side of a bootstrap: key-ordered dirty-read batches of one table, bounded in rows and bytes.

Theory of operation
-------------------
A node that copies a shard (a replicant today) asks its upstream core for the rows of each table in
key order, one batch at a time, each batch strictly after the last key it received
(``bootstrap_batch``). The reads are dirty: they see the core's applied state at the moment of each
batch, not one snapshot. That is safe because the copier also receives every entry after K0 (the
committed key when its watch was accepted) and replays them over the copy: entries carry results,
so the replay leaves exactly the state at its last key (``replicant.replica``, BOOTSTRAP and
LOCAL_REPLAY).

A batch holds at most ``rows_max`` rows and about ``bytes_max`` bytes (estimated by
``rlog.types.row_size_bytes``; at least one row, so a table of rows larger than that still
progresses), so one answer always fits in a frame, whatever the row size, and the core spends a
bounded time on it in one loop turn: rows are read in chunks sized by the rows seen so far (the
first chunk one row, each next at most twice the rows taken and about what the bytes left hold), so
a batch of large rows reads about the rows it answers, not ``READ_ROWS_STEP`` rows. ``done`` says
the table is exhausted: with a byte bound, a short batch does not mean the end. The first batch of
a table (``after`` None) also says how many rows the table holds then (``rows_total``), for the
copier's progress and ETA. SQLite counts by reading the whole table, here on the core's loop, so it
counts at most ``ROWS_TOTAL_COUNTED_MAX`` rows (tens of milliseconds): a larger table's total is
not known (None), and the copy shows its rows and rate without an ETA (DESIGN invariant 11: a
bootstrap never holds the loop for seconds).
"""

from __future__ import annotations

from typing import Any

import msgpack
from mnesite.rlog.schema import TableSchema
from mnesite.rlog.types import row_size_bytes

# The most rows a first batch counts for ``rows_total`` (a larger table's total is None).
ROWS_TOTAL_COUNTED_MAX = 500_000
# Rows read from SQLite per step while filling a batch, at most: bounds the rows read past the byte limit.
READ_ROWS_STEP = 256


def read_batch(
    store: Any, table: TableSchema, after: Any, rows_max: int, bytes_max: int, rows_total: bool = True
) -> dict[str, Any]:
    """``{"rows": [...], "done": bool}``: rows of ``table`` after ``after`` (None: from the start);
    ``rows_total`` False: the first batch does not count the table's rows (a scan page)."""
    if rows_max < 1 or bytes_max < 1:
        raise ValueError("rows_max and bytes_max must be positive")
    answer: dict[str, Any] = {"rows": [], "done": False}
    if after is None and rows_total:
        counted = store.count_rows(table, ROWS_TOTAL_COUNTED_MAX + 1)
        answer["rows_total"] = counted if counted <= ROWS_TOTAL_COUNTED_MAX else None
    rows: list[dict[str, Any]] = answer["rows"]
    size = 0
    cursor_after = after
    # The largest mean row size of the chunks read so far (0: none read yet).
    row_bytes_estimate = 0
    while len(rows) < rows_max:
        # Each read is sized by what is known of the rows: the first takes one row, the next at most
        # twice the rows taken so far and about as many as the bytes left hold (judging by the rows
        # seen), so a table of large rows is not read READ_ROWS_STEP rows a batch to answer a few.
        step = min(READ_ROWS_STEP, rows_max - len(rows), 2 * len(rows) or 1)
        if row_bytes_estimate:
            step = min(step, (bytes_max - size) // row_bytes_estimate + 1)
        read = store.scan(table, cursor_after, step)
        # Measured a chunk at a time (msgpack is C); row by row only for the chunk that crosses the limit.
        chunk_bytes = len(msgpack.packb(read, use_bin_type=True))
        if read:
            row_bytes_estimate = max(row_bytes_estimate, -(-chunk_bytes // len(read)))
        if rows and size + chunk_bytes > bytes_max:
            for row in read:
                row_bytes = row_size_bytes(row)
                if size + row_bytes > bytes_max:
                    return answer
                rows.append(row)
                size += row_bytes
            return answer
        if not rows and chunk_bytes > bytes_max:
            # The first chunk alone is too large: keep what fits, and at least its first row.
            for row in read:
                row_bytes = row_size_bytes(row)
                if rows and size + row_bytes > bytes_max:
                    return answer
                rows.append(row)
                size += row_bytes
            answer["done"] = len(read) < step and len(rows) == len(read)
            return answer
        rows.extend(read)
        size += chunk_bytes
        if len(read) < step:
            answer["done"] = True
            return answer
        cursor_after = rows[-1][table.key_column]
    return answer
