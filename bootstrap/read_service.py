"""The read service: how a node, core or replicant, answers a read from its own store.

Both drivers resolve the table, check that its shard is serving and settle the read's consistency
(a core refuses ``not_applied``; a replicant holds the read: ``replicant.reads``), then call
``answer_read``. Every bound a read takes (rows and bytes per scan, bytes per bootstrap batch,
entries and bytes per rlog read) is checked here, once, for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mnesite.bootstrap.serve import read_batch
from mnesite.rlog import range_requests
from mnesite.rlog.errors import RequestError
from mnesite.rlog.schema import TableSchema, check_key
from mnesite.rlog.types import ZERO_KEY, Entry, TxKey, entry_to_json

RLOG_READ_MAX = 1000  # entries of one rlog_tail or rlog_entries answer
TABLE_KINDS = frozenset({"get", "scan", "count", "bootstrap_batch", *range_requests.KINDS})
KINDS = TABLE_KINDS | {"list_tables", "rlog_tail", "rlog_entries"}


def _bounded(value: int | None, default: int, value_max: int, name: str) -> int:
    value = default if value is None else value
    if not 0 < value <= value_max:
        raise RequestError("bad_request", f"{name} must be 1..{value_max}")
    return value


def _entries_within(
    read: Callable[[TxKey, int], list[Entry]], cursor: TxKey, limit: int, bytes_max: int, step: str = "tx_key"
) -> list[Entry]:
    """At most ``limit`` entries and about ``bytes_max`` bytes of them (at least one), in the order
    ``read(cursor, count)`` walks the log, the cursor moving to the last entry's ``step`` key.

    Entries may be as large as a frame: each read takes one entry first, then at most twice the
    entries taken and about as many as the bytes left hold (judging by the largest seen), so an
    answer of large entries reads about the entries it holds, never ``limit`` of them (like
    ``bootstrap.serve.read_batch``'s rows). A short answer is not the end of the log: the caller
    asks again from its last entry (an empty one is the end).
    """
    entries: list[Entry] = []
    size = largest = 0
    while len(entries) < limit and size < bytes_max:
        count = min(limit - len(entries), 2 * len(entries) or 1)
        if largest:
            count = min(count, (bytes_max - size) // largest + 1)
        chunk = read(cursor, count)
        for entry in chunk:
            if entries and size + entry.size_bytes > bytes_max:
                return entries
            entries.append(entry)
            size += entry.size_bytes
        if len(chunk) < count:
            return entries
        largest = max(largest, *(entry.size_bytes for entry in chunk))
        cursor = getattr(chunk[-1], step)
    return entries


def answer_read(
    store: Any, kind: str, body: Any, table: TableSchema | None, scan_rows_max: int, frame_bytes_max: int
) -> Any:
    """The answer to read ``kind`` (one of ``KINDS``); ``table``: the table a ``TABLE_KINDS`` read names,
    resolved by the driver. Raises ``RequestError`` (or ``SchemaError`` for a key of the wrong type)."""
    if kind in range_requests.KINDS:
        return range_requests.answer(store, kind, body, scan_rows_max, frame_bytes_max)
    if kind == "get":
        return store.read_row(table, check_key(table, body.key))
    if kind == "count":
        # SQLite counts (O(rows) in the engine, nothing shipped): the answer is one integer.
        return {"rows": store.count_rows(table)}
    if kind == "scan":
        if body.limit is not None and body.limit > scan_rows_max:
            # A page this node does not serve, like one above a frame: ``too_large``, so that a client
            # whose page size suits another node (``Client.scan``, the Spark data source's batches)
            # asks again for fewer rows instead of failing.
            above = f"limit {body.limit} is above this node's scan_rows_max {scan_rows_max}"
            raise RequestError("too_large", f"{above}; ask for fewer rows")
        limit = _bounded(body.limit, scan_rows_max, scan_rows_max, "limit")
        after = check_key(table, body.after) if body.after is not None else None
        # Read like a bootstrap batch, bounded in bytes by a frame: ``limit`` rows of large ones would
        # otherwise be read and encoded whole (a gigabyte for 10,000 rows of 100 KB) before the reply
        # is found above frame_bytes_max. A scan page cut short would read as the end of the table,
        # so a page that does not fit is ``too_large`` (what its reply would have been), and the
        # client asks for fewer rows.
        page = read_batch(store, table, after, limit, frame_bytes_max, rows_total=False)
        if len(page["rows"]) < limit and not page["done"]:
            raise RequestError(
                "too_large",
                f"{limit} rows of {table.name} are above frame_bytes_max {frame_bytes_max}; ask for fewer rows",
            )
        return page["rows"]
    if kind == "bootstrap_batch":
        # The serving side of a bootstrap (bootstrap.serve): bounded in rows and in bytes, so the
        # answer fits in a frame and costs this loop turn a bounded time. A copier asks for batches
        # of its own size (10,000 rows) whatever this node's scan_rows_max: a batch may hold fewer
        # rows than asked (``done`` tells the end), so a larger one is answered with scan_rows_max
        # rows, not refused (refused, every copy from a node set below it failed and began again).
        if body.limit is not None and body.limit < 1:
            raise RequestError("bad_request", "limit must be positive")
        limit = scan_rows_max if body.limit is None else min(body.limit, scan_rows_max)
        after = check_key(table, body.after) if body.after is not None else None
        bytes_max = frame_bytes_max // 2
        return read_batch(store, table, after, limit, min(bytes_max, body.bytes_max or bytes_max))
    if kind == "list_tables":
        return store.tables_json()
    if kind in ("rlog_tail", "rlog_entries"):
        position = store.shard(body.shard)
        if position is None:
            raise RequestError("unknown_shard", f"unknown shard {body.shard!r}")
        # Committed entries only: a node applies nothing else, while a core's log may end with an
        # uncommitted tail that a new sequencer truncates and replaces with other entries at its keys.
        applied, shard, bytes_max = position.applied, body.shard, frame_bytes_max // 2
        if kind == "rlog_tail":
            count = _bounded(body.count, 10, RLOG_READ_MAX, "count")
            # Read from the newest back: each chunk ends before the oldest entry read so far.
            newest = _entries_within(
                lambda before, n: store.tail(shard, n, up_to=before)[::-1], applied, count, bytes_max, "prev"
            )
            return [entry_to_json(entry) for entry in reversed(newest)]
        limit = _bounded(body.limit, RLOG_READ_MAX, RLOG_READ_MAX, "limit")
        entries = _entries_within(
            lambda after, n: store.entries_after(shard, after, n, up_to=applied),
            body.after or ZERO_KEY,
            limit,
            bytes_max,
        )
        return [entry_to_json(entry) for entry in entries]
    raise RequestError("bad_request", f"{kind} is not a read")
