"""Range requests: SQLite hashes key ranges of a table itself, for a live node and for a file.

Theory of operation
-------------------
Comparing replicas must not ship rows that are equal. These functions run next to the data,
on an apsw connection to a mnesite database, and answer three questions about one table:

* ``range_digest``: for each key range ``(low, high]`` (``None``: unbounded) its row count, its
  digest and, on request, split keys cutting it into about ``split_parts`` equal parts;
* ``key_boundaries``: evenly spaced keys cutting a key range into about ``parts`` ranges;
* ``row_digests``: ``[key, row digest]`` for the rows of one range, in key order (``more``: the
  limit cut it; ask again after the last key).

SQLite builds each row's canonical text natively (``rlog.range_digest.row_text_sql``) and
Python feeds the texts of a range, one row at a time, to one hash (``range_hasher``): memory
holds one row text whatever the range holds, and a million rows cost about a second. (A
``group_concat`` of the range hashed at once took about two thirds of that time, but held the
whole range's text, up to SQLite's 1 GB value, on the node's loop thread.)

The same functions serve a live node (``answer``, wired into ``core.node`` for the request
kinds in ``KINDS``) and the Spark side's file replicas (``spark.replica``), so a node and a
file holding the same rows give the same digests.

Consistency. Every answer reads its data and the shard's applied tx key and digest inside one
``SAVEPOINT``: outside a transaction that is a deferred read transaction, so all the statements
see one snapshot; inside the node's open write transaction of a turn it nests without
committing anything, and the reads see that transaction's state, where data and applied
position always agree (they are applied together, DESIGN invariant 4). ``BEGIN``/``COMMIT``
are never issued on the node's connection.

Bounds. A node answers on its serving thread, so each answer is bounded: at most
``RANGES_MAX`` ranges, ``rows_max = scan_rows_max * DIGEST_ROWS_PER_SCAN_ROW`` rows and
``text_bytes_max = frame_bytes_max * DIGEST_ROWS_PER_SCAN_ROW`` bytes of row text hashed (a
hashed row costs the node about a tenth of a shipped one), ``row_digests`` at most ``rows_max``
rows and about ``text_bytes_max`` bytes of their row texts (at least one row; ``more`` says a row
follows), ``key_boundaries`` at most ``PARTS_MAX`` parts spaced over at most
``scan_rows_max * BOUNDARY_KEYS_PER_SCAN_ROW`` keys from the low end. When the row or the byte
budget runs out, ``range_digest`` answers the ranges it finished (``more`` is true) and the caller
asks again from the next range; a single range over the budget is answered with ``digest`` null
and ``rows`` its row count (a lower bound when over the row budget) and, on request, split keys,
which the compare job treats as "differs" and cuts smaller (or, at ``leaf_rows_max`` rows or
fewer, compares row by row with ``row_digests``, whose pages the byte budget cuts). A file
replica's digests have no budget; their memory is one row text too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import apsw
from mnesite.rlog.range_digest import (
    SQL_FEATURES_CHECK,
    range_hasher,
    row_text_sql,
    text_row_digest,
)
from mnesite.rlog.schema import SchemaError, TableSchema, check_key
from mnesite.rlog.types import TxKey

RANGES_MAX = 10_000  # ranges per range_digest request
PARTS_MAX = 65_536  # parts per key_boundaries request, and split_parts per range
DIGEST_ROWS_PER_SCAN_ROW = 10  # rows a request may hash per row a scan page may ship
BOUNDARY_KEYS_PER_SCAN_ROW = 100  # keys key_boundaries may walk per row a scan page may ship
_SAVEPOINT = "mnesite_range_read"
_ANY = object

# kind -> {field: (python types, required)}
KINDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "range_digest": {
        "table": ((str,), True),
        "ranges": ((list,), True),
        "split_parts": ((int,), False),
        "split_rows_min": ((int,), False),
    },
    "key_boundaries": {
        "table": ((str,), True),
        "parts": ((int,), True),
        "low": ((_ANY,), False),
        "high": ((_ANY,), False),
    },
    "row_digests": {
        "table": ((str,), True),
        "low": ((_ANY,), False),
        "high": ((_ANY,), False),
        "limit": ((int,), False),
    },
}


class SqlFeaturesError(RuntimeError):
    """This SQLite lacks a function the row text needs, or its quote() does not round-trip."""


@dataclass(frozen=True)
class RangeAnswer:
    """One range's row count and digest (``digest`` None: over the budget, ``rows`` a lower bound)."""

    rows: int
    digest: bytes | None
    split_keys: tuple[Any, ...] = ()


# -- SQL helpers -------------------------------------------------------------------------------


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _condition(table: TableSchema, low: Any, high: Any) -> tuple[str, tuple[Any, ...]]:
    key = _quote(table.key_column)
    conditions, bindings = [], []
    if low is not None:
        conditions.append(f"{key} > ?")
        bindings.append(low)
    if high is not None:
        conditions.append(f"{key} <= ?")
        bindings.append(high)
    return (" WHERE " + " AND ".join(conditions)) if conditions else "", tuple(bindings)


def check_sql_features(connection: apsw.Connection) -> None:
    try:
        row = connection.execute(SQL_FEATURES_CHECK).fetchone()
    except apsw.Error as error:
        raise SqlFeaturesError(f"SQLite {apsw.sqlite_lib_version()} cannot build row texts ({error})") from None
    if not row or row[0] != 1:
        raise SqlFeaturesError(f"SQLite {apsw.sqlite_lib_version()} quote() does not round-trip reals")


@contextlib.contextmanager
def read_snapshot(connection: apsw.Connection) -> Iterator[None]:
    """One consistent read of several statements, also inside an open write transaction (see above)."""
    connection.execute(f"SAVEPOINT {_SAVEPOINT}")
    try:
        yield
    finally:
        connection.execute(f"RELEASE {_SAVEPOINT}")


def applied_position(connection: apsw.Connection, shard: str) -> tuple[TxKey, bytes]:
    row = connection.execute(
        "SELECT applied_generation, applied_counter, applied_digest FROM _mnesite_shards WHERE shard = ?", (shard,)
    ).fetchone()
    if row is None:
        return TxKey(0, 0), b""
    return TxKey(row[0], row[1]), bytes(row[2])


# -- the three questions ------------------------------------------------------------------------


def range_digests(
    connection: apsw.Connection,
    table: TableSchema,
    ranges: Sequence[tuple[Any, Any]],
    split_parts: int = 0,
    split_rows_min: int = 0,
    rows_max: int | None = None,
    text_bytes_max: int | None = None,
) -> list[RangeAnswer]:
    """Answers for ``ranges`` in order; fewer than asked when ``rows_max`` or ``text_bytes_max``
    (bytes of row text hashed) runs out (see above)."""
    text = row_text_sql(table.columns)
    name = _quote(table.name)
    answers: list[RangeAnswer] = []
    rows_used = text_bytes_used = 0
    cursor = connection.cursor()
    for low, high in ranges:
        where, bindings = _condition(table, low, high)
        # The row count first: the digest hashes it before the row texts, and a range over the row
        # budget is known without building any row text.
        if rows_max is None:
            rows = cursor.execute(f"SELECT count(*) FROM {name}{where}", bindings).fetchone()[0]
        else:
            rows = cursor.execute(
                f"SELECT count(*) FROM (SELECT 1 FROM {name}{where} LIMIT ?)", (*bindings, rows_max - rows_used + 1)
            ).fetchone()[0]
        digest, text_bytes = None, 0
        if rows_max is None or rows <= rows_max - rows_used:
            text_bytes_left = None if text_bytes_max is None else text_bytes_max - text_bytes_used
            # In key order: a table with a TEXT key keeps a rowid, and a plain scan of an unbounded
            # range returns its rows in the order they were written, which differs between replicas.
            sql = f"SELECT {text} FROM {name}{where} ORDER BY {_quote(table.key_column)}"
            digest, text_bytes = _hash_range(connection, sql, bindings, rows, text_bytes_left)
        if digest is None:  # over the row or the byte budget
            if answers:
                break  # the budget is spent: the caller asks again from this range
            over = _split_keys(connection, table, low, high, rows, split_parts, rows_max) if split_parts else ()
            answers.append(RangeAnswer(rows, None, over))
            break
        rows_used += rows
        text_bytes_used += text_bytes
        splits: tuple[Any, ...] = ()
        if split_parts >= 2 and rows > split_rows_min:
            splits = _split_keys(connection, table, low, high, rows, split_parts, rows_max)
        answers.append(RangeAnswer(rows, digest, splits))
    return answers


def _hash_range(
    connection: apsw.Connection, sql: str, bindings: tuple[Any, ...], rows: int, text_bytes_max: int | None
) -> tuple[bytes | None, int]:
    """``(digest, bytes of row text)`` of the ``rows`` rows ``sql`` selects the row texts of, in its
    order (key order); digest None once the texts pass ``text_bytes_max``, where the scan stops.

    One row text at a time goes from SQLite to the hash: a range of wide rows never sits whole in
    memory (a ``group_concat`` of it could reach SQLite's 1 GB value, on the node's loop thread).
    The texts are hashed in key order, the order the digest is defined with (``rlog.range_digest``).
    ``LIMIT rows``: in the read snapshot the range holds
    exactly the rows counted."""
    hasher = range_hasher(rows)
    update = hasher.update  # the loop runs once per row: keep it to a few operations
    text_bytes, text_bytes_limit = 0, math.inf if text_bytes_max is None else text_bytes_max
    cursor = connection.cursor()
    try:
        for (row_text,) in cursor.execute(f"{sql} LIMIT ?", (*bindings, rows)):
            text_bytes += len(row_text)
            if text_bytes > text_bytes_limit:
                return None, text_bytes
            update(row_text)
    finally:
        cursor.close(True)  # an unfinished scan is reset at once, not left open in the read snapshot
    return hasher.digest(), text_bytes


def _split_keys(
    connection: apsw.Connection, table: TableSchema, low: Any, high: Any, rows: int, parts: int, keys_max: int | None
) -> tuple[Any, ...]:
    """At most ``parts - 1`` increasing keys strictly inside the range, cutting its first rows evenly."""
    scanned = rows if keys_max is None else min(rows, keys_max)
    if parts < 2 or scanned < 2:
        return ()
    step = max(1, math.ceil(scanned / parts))
    key = _quote(table.key_column)
    # A chain of "the step-th key after the last one": SQLite walks the key index, Python sees one key per part.
    found: list[Any] = []
    last = low
    cursor = connection.cursor()
    for _ in range(step, min(scanned, rows - 1) + 1, step):
        if len(found) >= parts - 1:
            break
        where, bindings = _condition(table, last, high)
        row = cursor.execute(
            f"SELECT {key} FROM {_quote(table.name)}{where} ORDER BY {key} LIMIT 1 OFFSET ?", (*bindings, step - 1)
        ).fetchone()
        if row is None:
            break
        found.append(row[0])
        last = row[0]
    return tuple(found)


def key_boundaries(
    connection: apsw.Connection,
    table: TableSchema,
    parts: int,
    low: Any = None,
    high: Any = None,
    keys_max: int | None = None,
) -> tuple[int, list[Any]]:
    """``(rows, keys)``: rows in the range (at most ``keys_max + 1`` counted) and its split keys."""
    where, bindings = _condition(table, low, high)
    name = _quote(table.name)
    if keys_max is None:
        rows = connection.execute(f"SELECT count(*) FROM {name}{where}", bindings).fetchone()[0]
    else:
        rows = connection.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM {name}{where} LIMIT ?)", (*bindings, keys_max + 1)
        ).fetchone()[0]
    return rows, list(_split_keys(connection, table, low, high, rows, parts, keys_max))


def row_digests(
    connection: apsw.Connection, table: TableSchema, low: Any, high: Any, limit: int, text_bytes_max: int | None = None
) -> list[tuple[Any, bytes]]:
    """``(key, row digest)`` of the first ``limit`` rows of ``(low, high]`` in key order; with
    ``text_bytes_max``, only until their row texts reach that many bytes (at least one row)."""
    key = _quote(table.key_column)
    where, bindings = _condition(table, low, high)
    cursor = connection.execute(
        f"SELECT {key}, {row_text_sql(table.columns)} FROM {_quote(table.name)}{where} ORDER BY {key} LIMIT ?",
        (*bindings, limit),
    )
    if text_bytes_max is None:
        return [(row_key, text_row_digest(text)) for row_key, text in cursor]
    digests, text_bytes = [], 0
    for row_key, text in cursor:
        digests.append((row_key, text_row_digest(text)))
        text_bytes += len(text)
        if text_bytes >= text_bytes_max:
            break
    return digests


def read_rows(connection: apsw.Connection, table: TableSchema, keys: Sequence[Any]) -> dict[Any, tuple[Any, ...]]:
    """Values in declared order of the rows with ``keys`` (absent keys are left out)."""
    columns = ", ".join(_quote(name) for name, _ in table.columns)
    key_index = [name for name, _ in table.columns].index(table.key_column)
    found: dict[Any, tuple[Any, ...]] = {}
    sql = f"SELECT {columns} FROM {_quote(table.name)} WHERE {_quote(table.key_column)} = ?"
    for key in keys:
        for values in connection.execute(sql, (key,)):
            found[values[key_index]] = tuple(values)
    return found


# -- node requests ------------------------------------------------------------------------------


def _table(store: Any, name: str) -> TableSchema:
    table = store.catalog().get(name)
    if table is None:
        raise SchemaError("unknown_table", f"unknown table {name!r}")
    return table


def _bound(table: TableSchema, value: Any, what: str) -> Any:
    if value is None:
        return None
    try:
        return check_key(table, value)
    except SchemaError as error:
        raise SchemaError("bad_request", f"{what}: {error}") from None


def _check_range(table: TableSchema, low: Any, high: Any, what: str) -> tuple[Any, Any]:
    low, high = _bound(table, low, f"{what} low"), _bound(table, high, f"{what} high")
    if low is not None and high is not None and not low < high:
        raise SchemaError("bad_request", f"{what}: low must be below high, got ({low!r}, {high!r}]")
    return low, high


def _int_field(body: Any, name: str, default: int, minimum: int, maximum: int) -> int:
    value = getattr(body, name)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise SchemaError("bad_request", f"{name} must be an integer in {minimum}..{maximum}")
    return value


def answer(store: Any, kind: str, body: Any, scan_rows_max: int, frame_bytes_max: int) -> dict[str, Any]:
    """Answer one range request for a node (``store`` is its ``rlog.store.Store``, ``body`` the
    request's ``rlog.messages`` body).

    Raises ``SchemaError`` with code ``unknown_table`` or ``bad_request`` on bad input, which the
    node answers as an error; nothing is written.
    """
    if kind not in KINDS:
        raise SchemaError("bad_request", f"{kind} is not a range request")
    table = _table(store, body.table)
    with _sql_errors():
        check_sql_features(store.connection)
    rows_max = scan_rows_max * DIGEST_ROWS_PER_SCAN_ROW
    text_bytes_max = frame_bytes_max * DIGEST_ROWS_PER_SCAN_ROW  # bytes of row text one answer may hash
    connection = store.connection
    if kind == "range_digest":
        ranges = body.ranges
        if not isinstance(ranges, list) or not 0 < len(ranges) <= RANGES_MAX:
            raise SchemaError("bad_request", f"ranges must be a list of 1..{RANGES_MAX} [low, high] pairs")
        checked = []
        for index, item in enumerate(ranges):
            if not isinstance(item, list) or len(item) != 2:
                raise SchemaError("bad_request", f"range {index} must be a [low, high] pair")
            checked.append(_check_range(table, item[0], item[1], f"range {index}"))
        split_parts = _int_field(body, "split_parts", 0, 0, PARTS_MAX)
        split_rows_min = _int_field(body, "split_rows_min", 0, 0, 2**62)
        with _sql_errors(), read_snapshot(connection):
            applied, digest = applied_position(connection, table.shard)
            answers = range_digests(connection, table, checked, split_parts, split_rows_min, rows_max, text_bytes_max)
        result = [{"rows": a.rows, "digest": a.digest, "split_keys": list(a.split_keys)} for a in answers]
        return {**_position(table, applied, digest), "ranges": result, "more": len(answers) < len(checked)}
    if kind == "key_boundaries":
        parts = _int_field(body, "parts", 0, 1, PARTS_MAX)
        low, high = _check_range(table, body.low, body.high, "range")
        with _sql_errors(), read_snapshot(connection):
            applied, digest = applied_position(connection, table.shard)
            rows, keys = key_boundaries(connection, table, parts, low, high, scan_rows_max * BOUNDARY_KEYS_PER_SCAN_ROW)
        return {**_position(table, applied, digest), "rows": rows, "keys": keys}
    limit = _int_field(body, "limit", rows_max, 1, rows_max)
    low, high = _check_range(table, body.low, body.high, "range")
    with _sql_errors(), read_snapshot(connection):
        applied, digest = applied_position(connection, table.shard)
        digests = row_digests(connection, table, low, high, limit + 1, text_bytes_max)
        more = len(digests) > limit
        if not more and digests:
            # Cut by the bytes of row text perhaps: whether a row follows is one step of the key index.
            where, bindings = _condition(table, digests[-1][0], high)
            more = (
                connection.execute(f"SELECT 1 FROM {_quote(table.name)}{where} LIMIT 1", bindings).fetchone()
                is not None
            )
    return {
        **_position(table, applied, digest),
        "rows": [[key, row_digest] for key, row_digest in digests[:limit]],
        "more": more,
    }


def _position(table: TableSchema, applied: TxKey, digest: bytes) -> dict[str, Any]:
    return {"shard": table.shard, "applied": list(applied), "applied_digest": digest.hex()}


@contextlib.contextmanager
def _sql_errors() -> Iterator[None]:
    try:
        yield
    except (apsw.Error, SqlFeaturesError) as error:
        raise SchemaError("internal", f"range request failed in SQLite: {error}") from None
