"""Read-only SQL queries over a node's user tables: checking, running and paging (no zmq here).

Theory of operation
-------------------
A query is one SQL statement and its bound parameters. SQLite decides what it may do, never a
parser of ours:

1. **Check** (``check_query``, on the node's loop thread, a prepare only). The statement is
   prepared on a read-only connection whose authorizer (``ReadOnlyGuard``) allows exactly: SELECT,
   recursive CTEs, functions other than ``DENIED_FUNCTIONS``, and reading columns of the user's
   tables (the catalog) and of the ``json_each``/``json_tree`` table functions. Everything else is
   denied at prepare time: writes, DDL, ATTACH/DETACH, every PRAGMA, transactions, savepoints,
   ``load_extension``, and reading any other table (mnesite's ``_mnesite_*`` tables, ``sqlite_schema``,
   ``dbstat``). An exec tracer aborts before the first step and records SQLite's own verdicts:
   ``is_readonly`` must be true, and the text after the statement must hold no other statement
   (SQLite prepares what is left; only comments and whitespace may remain). The check also yields
   the user tables the statement reads, from which the driver knows the shards to wait for.
2. **Consistency** is the driver's: it waits until each shard the query reads has reached its
   target key (``WaitingQueries``), then starts the query.
3. **Run** (``QueryRunner``, on a worker thread: the node's loop never runs SQL of a query). Each
   query gets its own read-only connection, so each holds its own snapshot: ``BEGIN``, then the
   positions of its shards are read (the snapshot starts there), then the statement runs again under
   the same authorizer and exec tracer (a statement that changed between check and run is refused),
   in that snapshot. If a shard's position in the snapshot is behind its target (the node applied it in
   a turn it has not committed yet), the run answers ``QueryBehind`` and the driver waits again. A
   query waits for a worker, so its shards may stop serving before its snapshot is taken (a core's
   snapshot install, a replicant's bootstrap: the rows go, the applied key stays), which the snapshot
   cannot tell: the driver notes it (``note_unserved``, every turn, for each query started whose
   first page is not back), and such a first page is not answered: the query waits for its shards
   to serve again and runs again (``WaitingQueries.ready`` starts a query only while every shard it
   reads serves).
4. **Pages.** A page ends at ``page_rows`` rows or ``page_bytes_max`` bytes of values, and before a row
   that would take its answer past ``answer_bytes_max`` (a frame less its envelope; the row opens the
   next page): a page holds whole rows, and one row may hold many pages' worth of values (5. below).
   A row too large for an answer on its own fails the query, which frees its cursor. A query with
   more rows keeps its connection and statement (a *cursor*, named by an unguessable token) for the
   next page: the node's memory holds one page per cursor, whatever the result's size, and all pages
   come from one snapshot. At most ``cursors_max`` cursors exist per node, at most
   ``cursors_per_connection_max`` of them for one client connection (``WaitingQuery.client``), so that
   one connection cannot take them all; one not asked for its next page within ``idle_ms_max`` of its
   last page being done is closed.
5. **Budget.** A progress handler stops a statement once its SQLite time, summed over its pages,
   reaches ``ms_max`` (``query_budget``). ``SQLITE_LIMIT_LENGTH`` bounds any one value (and any
   intermediate string such as a ``group_concat``) to ``page_bytes_max``; and, because apsw builds
   a whole row before any of it can be measured, a result of more than ``ROW_PAGES`` columns gets
   a smaller bound per value (``row_value_bytes_max``), so that reading one row never holds more
   than ``ROW_PAGES`` pages' worth of values, however many columns a SELECT makes up. A function
   call is not interrupted, so the functions SQLite runs in time quadratic in their arguments are
   bounded: ``LIKE_PATTERN_BYTES_MAX`` for LIKE/GLOB, and linear replacements of two-argument
   ``trim``/``ltrim``/``rtrim``.
6. **Temporary storage.** A statement that sorts or groups more than SQLite's cache holds writes
   SQLite's temporary files (the sorter's runs, ephemeral tables). The query connections open their
   files through ``QUERY_VFS``, which hands the database's own files to the operating system's VFS as they are
   and counts the bytes of every temporary file (its size: the end of its furthest write, less a
   truncation) against the query's ``TempBudget`` (``temp_bytes_max``) and the node's ``TempSpace``
   (``temp_bytes_total_max``, every query's together): a write past either fails with SQLITE_FULL and
   the query with ``query_failed`` naming the bound. The bytes are given back when the file closes
   (the query's cursor closes, or expires).

Errors carry a code for the wire: ``query_refused`` (not read-only, or not allowed), ``bad_query``
(SQLite cannot prepare it: syntax, unknown column, wrong number of parameters), ``query_budget``,
``unknown_table`` (it names a table the node's catalog does not hold), ``query_failed`` (a run-time
SQLite error), ``query_cursor_unknown`` (expired, closed or never existed),
``overloaded`` (``cursors_max`` or ``cursors_per_connection_max`` reached, said which).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import apsw
from mnesite.rlog.messages import FRAME_BYTES_MAX_DEFAULT
from mnesite.rlog.messages import QUERY_PARAMS_MAX as PARAMS_MAX
from mnesite.rlog.messages import QUERY_SQL_CHARS_MAX as SQL_CHARS_MAX
from mnesite.rlog.store import read_fault
from mnesite.rlog.types import ZERO_KEY, TxKey, tx_key_from_wire

CONSISTENCY_LEVELS = ("local", "read-your-writes", "linearizable")
CURSOR_TOKEN_CHARS = 32
# A progress handler call every this many SQLite VM steps: often enough to stop a runaway statement
# within a millisecond, rarely enough to cost nothing measurable.
PROGRESS_STEPS = 10_000
# Worker threads running queries (SQLite releases the GIL while it steps): two runaway statements
# delay other queries, never the node's loop.
QUERY_THREADS = 2
# How long a stopping node waits for its query workers, all together, once their statements are interrupted.
STOP_WAIT_S = 1.0
# A result row is read whole (apsw converts every column before returning it), so the values of one
# row together are bounded to this many pages (page_bytes_max each): SELECT zeroblob(N), ... repeated
# over up to 2,000 columns would otherwise hold 2,000 values of page_bytes_max each in one worker.
ROW_PAGES = 16
# The bytes of a query answer that are not its rows, columns or positions: the frame's version, kind
# and request id (at most 64 characters), the field names and the cursor token. What is left of a
# frame is a page's ``answer_bytes_max``.
ANSWER_ENVELOPE_BYTES = 512
# msgpack's header of one value (a string, a BLOB) or list, at most: added to the value's own bytes.
VALUE_HEADER_BYTES = 5
WAITING_QUERIES_MAX = 10_000
# Table-valued functions whose "columns" a query may read (pure functions of their arguments).
ALLOWED_TABLE_FUNCTIONS = frozenset({"json_each", "json_tree"})
DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "sqlite_offset"})
# The longest LIKE or GLOB pattern, in bytes (SQLITE_LIMIT_LIKE_PATTERN_LENGTH; SQLite's default is
# 50,000). A match runs in C without a progress check and costs up to the value's length times the
# pattern's: 50,000 bytes over a 1 MiB value held one query worker for about 40 s, past any budget;
# 1,000 bytes keeps one match under a second.
LIKE_PATTERN_BYTES_MAX = 1000

# SQLite's temporary files, by the flags its xOpen is given: the sorter's runs (TEMP_JOURNAL), the
# ephemeral tables of DISTINCT, GROUP BY, IN and materialized subqueries (TRANSIENT_DB), the temp schema
# (TEMP_DB) and statement journals (SUBJOURNAL). Every other file (the database, its WAL) is the node's.
TEMP_OPEN_FLAGS = (
    apsw.SQLITE_OPEN_TEMP_JOURNAL
    | apsw.SQLITE_OPEN_TRANSIENT_DB
    | apsw.SQLITE_OPEN_TEMP_DB
    | apsw.SQLITE_OPEN_SUBJOURNAL
)
# The VFS of the query connections (``QueryVFS``), registered once per process.
QUERY_VFS = "mnesite-query"

_ALLOWED_ACTIONS = frozenset({apsw.SQLITE_SELECT, apsw.SQLITE_RECURSIVE})


class QueryError(Exception):
    """A query was refused or stopped; ``code`` is the error code answered on the wire."""

    code = "query_failed"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class QueryRefused(QueryError):
    code = "query_refused"


class BadQuery(QueryError):
    code = "bad_query"


class UnknownQueryTable(BadQuery):
    """A statement names a table this node's catalog does not hold (a replicant may not have learnt
    it yet): the same ``unknown_table`` code as a ``get`` of an unknown table."""

    code = "unknown_table"


class QueryBudgetExceeded(QueryError):
    code = "query_budget"


class CursorUnknown(QueryError):
    code = "query_cursor_unknown"


class QueryOverloaded(QueryError):
    code = "overloaded"


@dataclass(frozen=True)
class QueryLimits:
    ms_max: int = 10_000
    page_rows_max: int = 1000
    page_bytes_max: int = 1024 * 1024
    cursors_max: int = 16
    cursors_per_connection_max: int = 8
    idle_ms_max: int = 30_000
    # The bytes one page's answer may hold (its rows, columns and positions): a frame less its
    # envelope. A page ends before a row that would pass it, whatever ``page_bytes_max`` allows.
    answer_bytes_max: int = FRAME_BYTES_MAX_DEFAULT - ANSWER_ENVELOPE_BYTES
    # The bytes of temporary files one query may hold (its sorts and groupings spilled to disk), and
    # all the node's queries together.
    temp_bytes_max: int = 256 * 1024 * 1024
    temp_bytes_total_max: int = 1024 * 1024 * 1024

    @classmethod
    def from_config(cls, limits: Any) -> QueryLimits:
        """From ``[limits]``: a page's values stay within a quarter of a frame, whatever is configured,
        and a page's answer within a frame (``answer_bytes_max``)."""
        return cls(
            ms_max=limits.query_ms_max,
            page_rows_max=limits.query_page_rows_max,
            page_bytes_max=max(1, min(limits.query_page_bytes_max, limits.frame_bytes_max // 4)),
            cursors_max=limits.query_cursors_max,
            cursors_per_connection_max=limits.query_cursors_per_connection_max,
            idle_ms_max=limits.query_idle_ms_max,
            answer_bytes_max=max(1, limits.frame_bytes_max - ANSWER_ENVELOPE_BYTES),
            temp_bytes_max=limits.query_temp_bytes_max,
            temp_bytes_total_max=limits.query_temp_bytes_total_max,
        )


@dataclass(frozen=True)
class CheckedQuery:
    """A statement SQLite found read-only and allowed, and the user tables it reads."""

    statement: str
    params: tuple[Any, ...]
    tables: frozenset[str]


class ReadOnlyGuard:
    """The authorizer: allow-list of actions, the user's tables by name; the first denial is kept."""

    def __init__(self, user_tables: Iterable[str], stored: frozenset[str]) -> None:
        self.user_tables = frozenset(user_tables)
        self.stored = stored
        self.tables_read: set[str] = set()
        self.denied: str | None = None

    def __call__(self, action: int, third: str | None, fourth: str | None, database: str | None, _via: Any) -> int:
        reason = self._reason(action, third, fourth, database)
        if reason is None:
            return apsw.SQLITE_OK
        if self.denied is None:
            self.denied = reason
        return apsw.SQLITE_DENY

    def _reason(self, action: int, third: str | None, fourth: str | None, database: str | None) -> str | None:
        if action in _ALLOWED_ACTIONS:
            return None
        if action == apsw.SQLITE_FUNCTION:
            name = (fourth or "").lower()
            return f"the function {name} is not allowed in a query" if name in DENIED_FUNCTIONS else None
        if action == apsw.SQLITE_READ:
            table = third or ""
            if database not in (None, "main"):
                return f"reading database {database!r} is not allowed in a query"
            if table in self.user_tables:
                self.tables_read.add(table)
                return None
            if table in ALLOWED_TABLE_FUNCTIONS:
                return None
            if table.lower() in self.stored or table.lower().startswith(("pragma_", "sqlite_", "_mnesite")):
                return f"{table!r} is not a user table (only the catalog's tables may be queried)"
            # Neither stored nor a module: the name of a CTE or subquery of the statement itself.
            return None
        name = apsw.mapping_authorizer_function.get(action, str(action)).removeprefix("SQLITE_")
        return f"{name} is not allowed in a query (queries are read-only)"


def stored_names(connection: apsw.Connection) -> frozenset[str]:
    """Lower-cased names SQLite could resolve to stored data: every table, view and index of the
    schema, and every virtual table module (eponymous ones such as ``dbstat`` are read by name)."""
    names = {row[0].lower() for row in connection.execute("SELECT name FROM sqlite_schema")}
    names.update(row[0].lower() for row in connection.execute("PRAGMA module_list"))
    names.update(("sqlite_schema", "sqlite_master", "sqlite_temp_schema", "sqlite_temp_master"))
    return frozenset(names)


def open_connection(path: str, value_bytes_max: int, vfs: str | None = None) -> apsw.Connection:
    """A read-only connection to the node's database for queries: no extension loading, no
    statement cache (every prepare meets the authorizer), bounded values, no attached databases.
    ``vfs``: ``QUERY_VFS`` for a connection that runs statements (its temporary files are counted)."""
    connection = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY, statementcachesize=0, vfs=vfs)
    connection.set_busy_timeout(1000)
    connection.limit(apsw.SQLITE_LIMIT_LENGTH, value_bytes_max)
    connection.limit(apsw.SQLITE_LIMIT_SQL_LENGTH, SQL_CHARS_MAX * 4)
    connection.limit(apsw.SQLITE_LIMIT_ATTACHED, 0)
    connection.limit(apsw.SQLITE_LIMIT_VARIABLE_NUMBER, PARAMS_MAX)
    connection.limit(apsw.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, LIKE_PATTERN_BYTES_MAX)
    connection.config(apsw.SQLITE_DBCONFIG_DEFENSIVE, 1)
    connection.config(apsw.SQLITE_DBCONFIG_TRUSTED_SCHEMA, 0)
    for name, left, right in (("trim", True, True), ("ltrim", True, False), ("rtrim", False, True)):
        connection.create_scalar_function(name, _trim_function(left, right), 2, deterministic=True)
    return connection


# -- temporary storage: the bytes of SQLite's temporary files, per query and per node -------------


class TempSpace:
    """The bytes of temporary files all the queries of one node hold (one per ``QueryRunner``).

    Shared by the query threads and the loop (a cursor closed there closes its files): ``lock``
    guards it and every ``TempBudget`` of it."""

    def __init__(self, total_max: int) -> None:
        self.total_max = total_max
        self.used = 0
        self.high_water = 0  # the most ``used`` has been
        self.lock = threading.Lock()


class TempBudget:
    """One query's temporary files: at most ``bytes_max`` bytes, and the node's ``space`` to share.
    ``exceeded``: the bound a write would have passed (the query's error names it)."""

    def __init__(self, space: TempSpace, bytes_max: int) -> None:
        self.space = space
        self.bytes_max = bytes_max
        self.used = 0
        self.exceeded: str | None = None

    def take(self, count: int) -> None:
        """Count ``count`` more bytes, or raise ``apsw.FullError`` (SQLITE_FULL) past a bound."""
        space = self.space
        with space.lock:
            if self.used + count > self.bytes_max:
                self.exceeded = "query_temp_bytes_max"
            elif space.used + count > space.total_max:
                self.exceeded = "query_temp_bytes_total_max"
            else:
                self.used += count
                space.used += count
                space.high_water = max(space.high_water, space.used)
                return
        raise apsw.FullError(f"temporary storage past {self.exceeded}")

    def give(self, count: int) -> None:
        with self.space.lock:
            self.used -= count
            self.space.used -= count


# The budget of the query a thread is running (``QueryRunner._page_of`` sets it around SQLite's calls):
# a temporary file is counted against the budget of the query that opened it, for as long as it is open.
_running = threading.local()
# A temporary file opened on a thread that runs no query (none should be) may hold nothing.
_NO_TEMP = TempBudget(TempSpace(0), 0)
# The operating system's VFS, named: "" (the default VFS) would follow whatever VFS is the default when a
# file opens. A VFS registered as the default and unregistered later (tests do, to fail writes) can
# leave this one the default, whose files would then open through itself without end (RecursionError).
OS_VFS = "win32" if os.name == "nt" else "unix"


class _TempFile(apsw.VFSFile):
    """A temporary file of ``OS_VFS`` whose size (the end of its furthest write, less a
    truncation) is counted against ``budget`` before each write that grows it."""

    def __init__(self, name: Any, flags: list[int], budget: TempBudget) -> None:
        super().__init__(OS_VFS, name, flags)
        self._budget = budget
        self._size = 0

    def xWrite(self, data: Any, offset: int) -> None:  # noqa: N802 (apsw's method names)
        end = offset + len(data)
        if end > self._size:
            self._budget.take(end - self._size)
            self._size = end
        super().xWrite(data, offset)

    def xTruncate(self, newsize: int) -> None:  # noqa: N802
        super().xTruncate(newsize)
        if newsize < self._size:
            self._budget.give(self._size - newsize)
            self._size = newsize

    def xClose(self) -> None:  # noqa: N802
        try:
            super().xClose()
        finally:
            size, self._size = self._size, 0
            self._budget.give(size)


class _DatabaseFile(apsw.VFSFile):
    """The database's file as ``OS_VFS`` opens it. One difference: apsw raises the error of a
    lock SQLite tries and does without (a read-only connection's EXCLUSIVE lock as it closes, to
    checkpoint the WAL: the read-only descriptor cannot take it) from the next call, where SQLite
    itself ignores it; it is answered busy, which is what SQLite makes of it."""

    def xLock(self, level: int) -> None:  # noqa: N802
        try:
            super().xLock(level)
        except apsw.IOError:
            if level != apsw.SQLITE_LOCK_EXCLUSIVE:
                raise
            raise apsw.BusyError("the query connection is read-only") from None


class QueryVFS(apsw.VFS):
    """The operating system's VFS (``OS_VFS``) with SQLite's temporary files counted
    (``TEMP_OPEN_FLAGS``: ``_TempFile``). The database's files are ``OS_VFS``'s, but each of their
    calls (about one per page read) is a Python call under the GIL: apsw has no way to hand a file
    over untouched.

    Measured and not adopted (``benchmarks/bench_query.py``, 2026-12-03): opening only an empty main
    database through this VFS and attaching the node's read-only through the default VFS keeps the
    counting (SQLite opens a statement's temporary files through the main database's VFS, whichever
    database it reads) and the page reads out of Python, but over 100,000 rows of about 100 bytes it
    took 0.975-0.978x this layout's CPU for a full scan read page by page, 0.95x for a GROUP BY, and
    1.03-1.07x for a one-row lookup (each query opens a connection, and the ATTACH costs more than its
    few page reads): under the 5% on the scan that would pay for a second schema name (``main.t`` no
    longer the node's table)."""

    def __init__(self) -> None:
        super().__init__(QUERY_VFS, base=OS_VFS)

    def xOpen(self, name: Any, flags: list[int]) -> apsw.VFSFile:  # noqa: N802
        if flags[0] & TEMP_OPEN_FLAGS:
            return _TempFile(name, flags, getattr(_running, "budget", None) or _NO_TEMP)
        if flags[0] & apsw.SQLITE_OPEN_MAIN_DB:
            return _DatabaseFile(OS_VFS, name, flags)
        return apsw.VFSFile(OS_VFS, name, flags)


_query_vfs: QueryVFS | None = None
_query_vfs_lock = threading.Lock()


def query_vfs() -> str:
    """The name of the query connections' VFS, registered on first use (kept for the process)."""
    global _query_vfs
    with _query_vfs_lock:
        if _query_vfs is None:
            _query_vfs = QueryVFS()
    return QUERY_VFS


# SQLite's trim(X, Y) compares every character of X it strips with every character of Y, in C and
# without a progress check: 1 MiB of X and 80,000 characters of Y held a query worker for about two
# minutes. The query connections replace the two-argument forms (the one-argument forms strip spaces
# only) by these, linear in X and Y, with SQLite's results.
_text_of_real = threading.local()


def _as_text(value: int | float | str | bytes) -> str:
    """``value`` as the TEXT SQLite's ``sqlite3_value_text`` makes of it."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8")  # a BLOB's bytes as text; not UTF-8: the query fails (UnicodeDecodeError)
    if isinstance(value, int):
        return str(value)
    connection = getattr(_text_of_real, "connection", None)
    if connection is None:  # SQLite's own rendering of a REAL (1.0, 1.0e+20), on this thread's connection
        connection = _text_of_real.connection = apsw.Connection(":memory:")
    return connection.execute("SELECT CAST(? AS TEXT)", (value,)).fetchone()[0]


def _trim_function(left: bool, right: bool) -> Callable[[Any, Any], str | None]:
    def trim(value: Any, characters: Any) -> str | None:
        if value is None or characters is None:
            return None
        # SQLite reads the set as a C string: up to its first NUL (the text ``value`` whole).
        if isinstance(characters, (str, bytes)):
            characters = characters.split("\x00" if isinstance(characters, str) else b"\x00", 1)[0]
        text, strip = _as_text(value), frozenset(_as_text(characters))
        start, end = 0, len(text)
        if left:
            while start < end and text[start] in strip:
                start += 1
        if right:
            while end > start and text[end - 1] in strip:
                end -= 1
        return text[start:end]

    return trim


def row_value_bytes_max(page_bytes_max: int, columns: int) -> int:
    """The bound on one value of a result with ``columns`` columns: ``page_bytes_max``, shared out
    among the columns once there are more than ``ROW_PAGES`` (a row then holds at most
    ``ROW_PAGES * page_bytes_max`` bytes of values while it is read)."""
    return max(1, min(page_bytes_max, ROW_PAGES * page_bytes_max // max(1, columns)))


def check_query(
    connection: apsw.Connection, user_tables: Iterable[str], sql: str, params: tuple[Any, ...]
) -> CheckedQuery:
    """Prepare ``sql`` (nothing runs) and return it checked; raise ``QueryRefused`` or ``BadQuery``, or
    SQLite's own error for a damaged database or an I/O error (``rlog.store.read_fault``: the disk's)."""
    if len(sql) > SQL_CHARS_MAX:
        raise BadQuery(f"the query is {len(sql)} characters; at most {SQL_CHARS_MAX}")
    if len(params) > PARAMS_MAX:
        raise BadQuery(f"{len(params)} parameters; at most {PARAMS_MAX}")
    if "\x00" in sql:  # apsw refuses it with a ValueError, which no caller expects from a prepare
        raise BadQuery(f"the query holds a NUL character (at {sql.index(chr(0))})")
    connection.authorizer = None
    guard = ReadOnlyGuard(user_tables, stored_names(connection))
    connection.authorizer = guard
    try:
        statements = _prepared_statements(connection, sql, params, guard)
    finally:
        connection.authorizer = None
    with_code = [(text, readonly) for text, readonly, has_code in statements if has_code]
    if not with_code:
        raise BadQuery("the query holds no statement")
    if len(with_code) > 1:
        raise QueryRefused("a query is one statement; this one holds more")
    statement, readonly = with_code[0]
    if not readonly:
        raise QueryRefused("the statement is not read-only (SQLite says it may write)")
    return CheckedQuery(statement, params, frozenset(guard.tables_read))


def _prepared_statements(
    connection: apsw.Connection, sql: str, params: tuple[Any, ...], guard: ReadOnlyGuard
) -> list[tuple[str, bool, bool]]:
    """(text, read-only, has code) of each statement of ``sql``, by preparing each (none runs).

    The exec tracer sees each statement before its first step and aborts it; SQLite then prepares
    the text that follows (apsw's multi-statement execution), which is how a second statement is
    found without parsing anything ourselves.
    """
    found: list[tuple[str, bool, bool]] = []

    def tracer(cursor: apsw.Cursor, text: str, _bindings: Any) -> bool:
        found.append((text, cursor.is_readonly, cursor.has_vdbe))
        return False

    cursor = connection.cursor()
    cursor.exec_trace = tracer
    remaining, bindings = sql, params
    # Each round consumes one statement's text (at least one character), so the rounds are bounded.
    while remaining and sum(has_code for _, _, has_code in found) < 2:
        before = len(found)
        try:
            cursor.execute(remaining, bindings)
        except apsw.ExecTraceAbort:
            pass
        except apsw.Error as error:
            if read_fault(error) is not None:
                raise  # the database is damaged, not the query: the driver stops for a failed disk
            if guard.denied is not None:
                raise QueryRefused(guard.denied) from None
            if found:
                raise QueryRefused("a query is one statement; this one holds more") from None
            if isinstance(error, apsw.BindingsError):
                raise BadQuery(f"parameters: {error}") from None
            message = _sqlite_message(error)
            if message.startswith(NO_SUCH_TABLE):
                name = message[len(NO_SUCH_TABLE) :]
                raise UnknownQueryTable(f"unknown table {name!r} (no such table in this node's catalog)") from None
            raise BadQuery(message) from None
        if len(found) == before or not found[-1][0]:
            break  # nothing left that SQLite would prepare
        remaining = remaining[len(found[-1][0]) :]
        bindings = None  # a further statement with parameters fails to bind: refused above
    cursor.close()
    return found


NO_SUCH_TABLE = "no such table: "  # SQLite's words when a statement names a table that does not exist


def _sqlite_message(error: BaseException) -> str:
    text = str(error)
    # apsw prefixes "SQLError: "; the SQLite message is what the user needs.
    return text.split(": ", 1)[1] if ": " in text and text.split(": ", 1)[0].endswith("Error") else text


def _value_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value) if value.isascii() else 4 * len(value)
    if isinstance(value, bytes):
        return len(value)
    return 9


def _row_bytes(row: list[Any]) -> int:
    """A row's bytes in an answer, at most: its values, each one's header and the list's."""
    return VALUE_HEADER_BYTES * (len(row) + 1) + sum(map(_value_bytes, row))


# -- waiting for consistency ---------------------------------------------------------------------


@dataclass
class WaitingQuery:
    """A checked query held until each shard it reads has applied its target key."""

    payload: Any
    query: CheckedQuery
    shards: tuple[str, ...]
    targets: dict[str, TxKey]
    page_rows: int
    deadline_ms: int
    # Set by ``note_unserved``: a shard it reads stopped serving after it started, so the snapshot
    # of its first page may hold no committed state.
    unserved: bool = False
    # The client's request id: a query sent again with it replaces this one (``withdraw``); None: never.
    request_id: str | None = None
    # The client connection it came over (its routing id): its cursors count toward that connection's
    # share, ``cursors_per_connection_max``. None: toward the node's bound only.
    client: bytes | None = None

    def describe(self) -> str:
        reasons = [f"shard {shard} did not reach {key}" for shard, key in sorted(self.targets.items())]
        reasons += [f"shard {shard} did not serve" for shard in self.shards if shard not in self.targets]
        return ", ".join(reasons)

    def ready(self, reached: Callable[[str, TxKey], bool]) -> bool:
        """Every shard it reads serves and has reached its target (a shard without one: any key)."""
        shards = set(self.shards) | set(self.targets)
        return all(reached(shard, self.targets.get(shard, ZERO_KEY)) for shard in shards)


def note_unserved(started: Iterable[WaitingQuery], reached: Callable[[str, TxKey], bool]) -> None:
    """Mark the queries started whose first page is not back and one of whose shards serves no read
    now (``reached`` at any key is false): their snapshot may be taken after it stopped serving."""
    for waiting in started:
        if not waiting.unserved and not all(reached(shard, ZERO_KEY) for shard in waiting.shards):
            waiting.unserved = True


class WaitingQueries:
    """Queries waiting for their shards (pure: the driver says which shard reached which key)."""

    def __init__(self, waiting_max: int = WAITING_QUERIES_MAX) -> None:
        self.waiting_max = waiting_max
        self._waiting: list[WaitingQuery] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, waiting: WaitingQuery) -> None:
        if len(self._waiting) >= self.waiting_max:
            raise QueryOverloaded(f"{self.waiting_max} queries are waiting for their shards; retry later")
        self._waiting.append(waiting)

    def ready(self, reached: Callable[[str, TxKey], bool]) -> list[WaitingQuery]:
        ready = [waiting for waiting in self._waiting if waiting.ready(reached)]
        for waiting in ready:
            self._waiting.remove(waiting)
        return ready

    def withdraw(self, request_id: str) -> list[WaitingQuery]:
        """The queries waiting under ``request_id``, taken out (a resend of it replaces them)."""
        earlier = [w for w in self._waiting if w.request_id == request_id]
        for waiting in earlier:
            self._waiting.remove(waiting)
        return earlier

    def expired(self, now_ms: int) -> list[WaitingQuery]:
        late = [w for w in self._waiting if w.deadline_ms <= now_ms]
        for waiting in late:
            self._waiting.remove(waiting)
        return late


# -- running -------------------------------------------------------------------------------------


class QueryBehind(Exception):
    """The run's snapshot has not reached a target yet (the node has not committed its turn)."""


@dataclass
class Finished:
    """A job's outcome for the driver: a page (``result``), or an error, or ``behind``; ``first``: the
    query, when this page is its first (its snapshot was taken for it)."""

    payload: Any
    result: dict[str, Any] | None = None
    error: QueryError | None = None
    behind: WaitingQuery | None = None
    first: WaitingQuery | None = None
    # The disk's error a read of the query met (``rlog.store.read_fault``: a malformed database, an
    # I/O error): not the query's, and not answered; the driver stops the node as for a failed disk.
    failed: BaseException | None = None


@dataclass
class _Cursor:
    token: str
    waiting: WaitingQuery  # the query, its shards and targets (given back to wait again if behind)
    last_used_ms: int
    payload: Any = None
    page_rows: int = 0
    busy: bool = False
    closed: bool = False
    spent_ms: float = 0.0
    deadline_s: float = 0.0
    connection: apsw.Connection | None = None
    cursor: apsw.Cursor | None = None
    columns: list[str] = field(default_factory=list)
    positions: dict[str, list[int]] = field(default_factory=dict)
    value_bytes_max: int = 0  # SQLITE_LIMIT_LENGTH for this cursor's statement (row_value_bytes_max)
    # A row read for a page its answer could not hold (answer_bytes_max): the next page's first row.
    carried: list[Any] | None = None
    first: bool = True  # its first page is not done yet
    temp: TempBudget | None = None  # its temporary files' bytes (set by ``QueryRunner.start``)


class QueryRunner:
    """Runs checked queries on worker threads; the driver's loop submits and collects (``finished``).

    Thread rules: ``_cursors`` and ``_done`` are shared and guarded by ``_lock`` (the loop may look
    whether ``_done`` is empty without it: a deque's length is read atomically); a cursor's SQLite
    objects are used by one thread at a time (``busy`` is set by the loop before a job is queued and
    cleared by the worker when it is done). The worker writes a byte to ``wakeup_fd`` when a job is
    done, so a driver polling that descriptor wakes at once.
    """

    def __init__(
        self, path: str, limits: QueryLimits, clock_ms: Callable[[], int], threads: int = QUERY_THREADS
    ) -> None:
        self.path = path
        self.limits = limits
        self.clock_ms = clock_ms
        self.threads_max = threads
        self._threads: list[threading.Thread] = []
        self._jobs: queue.Queue[_Cursor | None] = queue.Queue()
        self._lock = threading.Lock()
        self._cursors: dict[str, _Cursor] = {}
        # client connection -> its open cursors (``WaitingQuery.client``); only connections with one.
        self._client_cursors: dict[bytes, int] = {}
        # request id -> the token of the cursor its query opened (a query sent again closes it: ``withdraw``)
        self._cursor_of: dict[str, str] = {}
        self._done: collections.deque[Finished] = collections.deque()
        self._checker: apsw.Connection | None = None
        self.temp_space = TempSpace(limits.temp_bytes_total_max)
        self._vfs = query_vfs()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        # Set by ``stop`` (under ``_lock``) once the pipe is closed: its numbers may then belong to
        # any file the process opens next, so a late worker must not write to them, nor a second
        # ``stop`` close them again.
        self._pipe_closed = False
        # Set by ``stop``: a statement running stops at its next progress check, a job queued does not start.
        self._stopping = False
        self.queries = 0
        self.pages = 0
        self.refused = 0
        self.budget_stops = 0
        self.expired = 0

    @property
    def wakeup_fd(self) -> int:
        return self._wake_read

    def wake(self) -> None:
        """Make ``wakeup_fd`` readable: the node's loop leaves its poll at once (a page is done, or a
        stop was requested from another thread)."""
        # A full pipe means the loop has a wake-up pending already. A closed one (a worker that
        # outlived ``stop``) is not written: its number may be another file's by now.
        with self._lock, contextlib.suppress(BlockingIOError, OSError):
            if not self._pipe_closed:
                os.write(self._wake_write, b"x")

    def check(self, sql: str, params: tuple[Any, ...], user_tables: Iterable[str]) -> CheckedQuery:
        """Check on the caller's thread (a prepare; nothing runs)."""
        if self._checker is None:
            self._checker = open_connection(self.path, self.limits.page_bytes_max)
        try:
            return check_query(self._checker, user_tables, sql, params)
        except QueryRefused:
            self.refused += 1
            raise

    def open_cursors(self) -> int:
        with self._lock:
            return len(self._cursors)

    def start(self, waiting: WaitingQuery) -> None:
        """Run a query whose shards reached their targets; its first page arrives through ``finished``."""
        client = waiting.client
        with self._lock:
            held = self._client_cursors.get(client, 0) if client is not None else 0
            if held >= self.limits.cursors_per_connection_max:
                raise QueryOverloaded(
                    f"{held} queries of this connection are open on this node (query_cursors_per_connection_max "
                    f"{self.limits.cursors_per_connection_max}); read them to the end or retry later"
                )
            if len(self._cursors) >= self.limits.cursors_max:
                raise QueryOverloaded(
                    f"{len(self._cursors)} queries are open on this node (query_cursors_max "
                    f"{self.limits.cursors_max}); read them to the end or retry later"
                )
            token = secrets.token_hex(CURSOR_TOKEN_CHARS // 2)
            cursor = _Cursor(
                token,
                waiting,
                self.clock_ms(),
                payload=waiting.payload,
                page_rows=waiting.page_rows,
                busy=True,
                temp=TempBudget(self.temp_space, self.limits.temp_bytes_max),
            )
            self._cursors[token] = cursor
            if client is not None:
                self._client_cursors[client] = held + 1
            if waiting.request_id is not None:
                self._cursor_of[waiting.request_id] = token
        self.queries += 1
        self._submit(cursor)

    def next_page(self, payload: Any, token: str, page_rows: int) -> None:
        with self._lock:
            cursor = self._cursors.get(token)
            if cursor is None or cursor.closed:
                raise CursorUnknown(
                    "no such query cursor here (it finished, expired, was closed, or is on another node)"
                )
            if cursor.busy:
                raise QueryError("this cursor is already fetching a page", "query_cursor_busy")
            cursor.busy = True
            cursor.payload = payload
            cursor.page_rows = page_rows
            cursor.last_used_ms = self.clock_ms()
        self._submit(cursor)

    def close(self, token: str) -> bool:
        """Close a cursor (the client stopped reading). False if there is none by that token."""
        with self._lock:
            cursor = self._cursors.get(token)
            if cursor is None:
                return False
            cursor.closed = True
            if cursor.busy:
                return True  # the worker closes it when its page is done
            self._forget(cursor)
        _close_sqlite(cursor)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Close the cursor a query of ``request_id`` opened, if it is still open: the client sent that
        query again (it heard nothing, often on a new connection), and the earlier run's pages go to a
        connection it no longer reads. A page being read is still answered, to that connection."""
        with self._lock:
            token = self._cursor_of.get(request_id)
        return token is not None and self.close(token)

    def _forget(self, cursor: _Cursor) -> None:
        """Take ``cursor`` out of the runner (under ``_lock``); the caller closes its SQLite objects."""
        if self._cursors.pop(cursor.token, None) is not None and (client := cursor.waiting.client) is not None:
            held = self._client_cursors.pop(client, 0) - 1
            if held > 0:
                self._client_cursors[client] = held
        request_id = cursor.waiting.request_id
        if request_id is not None and self._cursor_of.get(request_id) == cursor.token:
            del self._cursor_of[request_id]

    def expire(self, now_ms: int) -> None:
        """Close cursors not asked for a page within ``idle_ms_max``."""
        late = []
        with self._lock:
            for cursor in list(self._cursors.values()):
                if not cursor.busy and now_ms - cursor.last_used_ms >= self.limits.idle_ms_max:
                    late.append(cursor)
                    self._forget(cursor)
        for cursor in late:
            self.expired += 1
            _close_sqlite(cursor)

    def finished(self, drain: bool = True) -> list[Finished]:
        """The pages finished since the last call. ``drain``: the wakeup pipe is readable (the loop's
        poll said so), empty it; reading an empty pipe every turn cost an exception per turn."""
        if drain and not self._pipe_closed:
            try:
                while os.read(self._wake_read, 4096):
                    pass
            except BlockingIOError:
                pass
        if not self._done:  # a worker appends before it writes the wakeup byte: checked again next turn
            return []
        with self._lock:
            done = list(self._done)
            self._done.clear()
        return done

    def statistics(self) -> dict[str, Any]:
        return {
            "open": self.open_cursors(),
            "queries": self.queries,
            "pages": self.pages,
            "refused": self.refused,
            "budget_stops": self.budget_stops,
            "expired": self.expired,
        }

    def stop(self) -> None:
        """Stop the workers (the node is shutting down): a statement still running is interrupted, by
        ``interrupt`` and at its next progress check (one that was opening its connection, past the
        interrupt, too), and a job queued does not start; each worker is waited for at most
        ``STOP_WAIT_S`` (a daemon thread that still runs then does not keep the process)."""
        self._stopping = True
        with self._lock:
            running = [cursor.connection for cursor in self._cursors.values() if cursor.busy and cursor.connection]
        for connection in running:
            with contextlib.suppress(apsw.Error):  # it may have finished and closed meanwhile
                connection.interrupt()  # SQLite allows it from any thread
        for _ in self._threads:
            self._jobs.put(None)
        deadline_s = time.monotonic() + STOP_WAIT_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline_s - time.monotonic()))
        with self._lock:
            cursors = list(self._cursors.values())
            self._cursors.clear()
            self._client_cursors.clear()
            self._cursor_of.clear()
        for cursor in cursors:
            if not cursor.busy:
                _close_sqlite(cursor)
        if self._checker is not None:
            self._checker.close(True)
            self._checker = None
        with self._lock:
            closing, self._pipe_closed = not self._pipe_closed, True
        if closing:
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)

    # -- worker side -------------------------------------------------------------------------

    def _submit(self, cursor: _Cursor) -> None:
        if len(self._threads) < self.threads_max:
            thread = threading.Thread(target=self._work, name=f"mnesite-query-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._jobs.put(cursor)

    def _work(self) -> None:
        while True:
            cursor = self._jobs.get()
            if cursor is None:
                return
            finished = self._page(cursor)
            with self._lock:
                cursor.busy = False
                cursor.last_used_ms = self.clock_ms()  # idle from now: the client is just being answered
                keep = finished.result is not None and finished.result.get("cursor") and not cursor.closed
                if not keep:
                    self._forget(cursor)
                self._done.append(finished)
            if not keep:
                _close_sqlite(cursor)
            self.wake()

    def _page(self, cursor: _Cursor) -> Finished:
        finished = self._page_of(cursor)
        finished.first = cursor.waiting if cursor.first else None
        cursor.first = False
        return finished

    def _page_of(self, cursor: _Cursor) -> Finished:
        if self._stopping:  # queued before the stop: its client is answered by the node's stop
            return Finished(cursor.payload, error=QueryError("the node is shutting down", "stopping"))
        started_s = time.monotonic()
        cursor.deadline_s = started_s + max(0.0, self.limits.ms_max - cursor.spent_ms) / 1000
        _running.budget = cursor.temp
        try:
            if cursor.connection is None:
                self._open(cursor)
            rows = self._rows(cursor)
        except QueryBehind:
            return Finished(cursor.payload, behind=cursor.waiting)
        except QueryError as error:
            if isinstance(error, QueryRefused):
                self.refused += 1
            return Finished(cursor.payload, error=error)
        except Exception as error:  # anything else apsw raises: answered, and the worker thread lives on
            cursor.cursor = None
            if read_fault(error) is not None:
                return Finished(cursor.payload, failed=error)
            return Finished(cursor.payload, error=QueryError(f"the query failed: {type(error).__name__}: {error}"))
        finally:
            _running.budget = None
            cursor.spent_ms += (time.monotonic() - started_s) * 1000
        self.pages += 1
        more = cursor.cursor is not None
        return Finished(
            cursor.payload,
            result={
                "columns": cursor.columns,
                "rows": rows,
                "cursor": cursor.token if more else None,
                "positions": cursor.positions,
            },
        )

    def _open(self, cursor: _Cursor) -> None:
        query = cursor.waiting.query
        try:
            connection = open_connection(self.path, self.limits.page_bytes_max, self._vfs)
        except apsw.Error as error:
            if read_fault(error) is not None:
                raise
            raise QueryError(f"cannot open the database for a query: {error}") from None
        cursor.connection = connection
        # The snapshot: it starts at the first read below and lasts until the cursor closes.
        connection.execute("BEGIN")
        positions = {}
        for shard in cursor.waiting.shards:
            row = connection.execute(
                "SELECT applied_generation, applied_counter FROM _mnesite_shards WHERE shard = ?", (shard,)
            ).fetchone()
            positions[shard] = TxKey(row[0], row[1]) if row else TxKey(0, 0)
        for shard, target in cursor.waiting.targets.items():
            if positions.get(shard, TxKey(0, 0)) < target:
                raise QueryBehind()
        cursor.positions = {shard: list(key) for shard, key in positions.items()}
        guard = ReadOnlyGuard(query.tables, stored_names(connection))
        connection.authorizer = guard

        def over_budget() -> bool:
            return self._stopping or time.monotonic() >= cursor.deadline_s

        connection.set_progress_handler(over_budget, PROGRESS_STEPS)

        def tracer(statement: apsw.Cursor, text: str, _bindings: Any) -> bool:
            if text != query.statement or not statement.is_readonly:
                return False
            cursor.columns = [column[0] for column in statement.get_description()]
            # Before the first step: the bound applies to every value this statement makes.
            cursor.value_bytes_max = row_value_bytes_max(self.limits.page_bytes_max, len(cursor.columns))
            connection.limit(apsw.SQLITE_LIMIT_LENGTH, cursor.value_bytes_max)
            return True

        sqlite_cursor = connection.cursor()
        sqlite_cursor.exec_trace = tracer
        cursor.cursor = sqlite_cursor
        try:
            sqlite_cursor.execute(query.statement, query.params)
        except apsw.ExecTraceAbort:
            raise QueryRefused("the statement changed between its check and its run; send it again") from None
        except apsw.Error as error:
            if read_fault(error) is not None:
                raise
            if guard.denied is not None:
                raise QueryRefused(guard.denied) from None
            raise self._run_error(error, cursor) from None

    def _rows(self, cursor: _Cursor) -> list[list[Any]]:
        rows: list[list[Any]] = []
        size = 0
        bytes_max = self.limits.page_bytes_max
        sqlite_cursor = cursor.cursor
        if sqlite_cursor is None:
            return rows
        # Every page's answer carries the column names and the positions besides its rows.
        positions_bytes = sum(_value_bytes(shard) + 2 * 9 + 3 * VALUE_HEADER_BYTES for shard in cursor.positions)
        answer_max = self.limits.answer_bytes_max - _row_bytes(cursor.columns) - positions_bytes
        try:
            while len(rows) < cursor.page_rows and size < bytes_max:
                row = cursor.carried if cursor.carried is not None else list(next(sqlite_cursor))
                cursor.carried = None
                row_bytes = _row_bytes(row)
                if size + row_bytes > answer_max:
                    if rows:  # the page is full: the row opens the next one
                        cursor.carried = row
                        break
                    cursor.cursor = None
                    raise QueryError(
                        f"the query failed: a row of its result is about {row_bytes} bytes, more than one answer "
                        f"holds ({max(0, answer_max)} bytes of a frame, frame_bytes_max); select fewer or smaller "
                        "columns"
                    )
                rows.append(row)
                size += row_bytes
        except StopIteration:
            cursor.cursor = None
        except (apsw.Error, UnicodeDecodeError) as error:  # apsw converts a row's TEXT from UTF-8
            cursor.cursor = None
            if read_fault(error) is not None:
                raise
            raise self._run_error(error, cursor) from None
        return rows

    def _run_error(self, error: BaseException, cursor: _Cursor) -> QueryError:
        if isinstance(error, UnicodeDecodeError):
            return QueryError(
                f"the query failed: a TEXT value of its result is not UTF-8 ({error.reason} at byte {error.start}); "
                "select it CAST AS BLOB"
            )
        if isinstance(error, apsw.InterruptError) and self._stopping:
            return QueryError("the node is shutting down", "stopping")
        if isinstance(error, apsw.InterruptError):
            self.budget_stops += 1
            return QueryBudgetExceeded(
                f"the query was stopped after {self.limits.ms_max} ms of SQLite time (query_ms_max)"
            )
        temp = cursor.temp
        if isinstance(error, apsw.FullError) and temp is not None and temp.exceeded is not None:
            if temp.exceeded == "query_temp_bytes_max":
                return QueryError(
                    "the query failed: its temporary storage (a sort or grouping larger than memory, spilled to "
                    f"disk) would pass {temp.bytes_max} bytes (query_temp_bytes_max); sort or group fewer or "
                    "smaller values"
                )
            return QueryError(
                f"the query failed: the node's queries together would hold more than {temp.space.total_max} bytes "
                "of temporary storage (query_temp_bytes_total_max); retry later, or sort or group fewer or smaller "
                "values"
            )
        if isinstance(error, apsw.TooBigError):
            bound = cursor.value_bytes_max or self.limits.page_bytes_max
            shared = (
                f", query_page_bytes_max {self.limits.page_bytes_max} shared among its {len(cursor.columns)} "
                f"columns beyond {ROW_PAGES}"
                if bound < self.limits.page_bytes_max
                else " (query_page_bytes_max)"
            )
            what = "a value (or a row to sort) of its result"
            return QueryError(f"the query failed: {what} is too big: more than {bound} bytes{shared}")
        return QueryError(f"the query failed: {_sqlite_message(error)}")


def _close_sqlite(cursor: _Cursor) -> None:
    connection, cursor.connection, cursor.cursor, cursor.carried = cursor.connection, None, None, None
    if connection is not None:
        connection.close(True)


def shards_of(tables: Iterable[str], catalog: Mapping[str, Any]) -> tuple[str, ...]:
    """The shards of the user tables a query reads (sorted, without repeats)."""
    return tuple(sorted({catalog[name].shard for name in tables if name in catalog}))


# -- requests: the one place a query request's fields are read ------------------------------------

QUERY_WAIT_MS_DEFAULT = 10_000  # how long a query waits for its shards when the request says nothing


@dataclass(frozen=True)
class QueryRequest:
    sql: str
    params: tuple[Any, ...]
    page_rows: int
    consistency: str
    min_key: TxKey | None
    wait_ms: int
    min_keys: dict[str, TxKey] | None = None  # per shard (read-your-writes: ``rlog.types.read_targets``)


def query_request(fields: Any, page_rows_max: int) -> QueryRequest:
    """A ``query`` message's fields (``rlog.messages`` checked their shapes), with the node's bounds."""
    page_rows = fields.page_rows if fields.page_rows is not None else page_rows_max
    if not 0 < page_rows <= page_rows_max:
        raise QueryError(f"page_rows must be 1..{page_rows_max} (query_page_rows_max)", "bad_request")
    consistency = fields.consistency or "local"
    if consistency not in CONSISTENCY_LEVELS:
        raise QueryError(f"consistency must be one of {', '.join(CONSISTENCY_LEVELS)}", "bad_request")
    min_key = tx_key_from_wire(fields.min_key) if fields.min_key is not None else None
    min_keys = {shard: tx_key_from_wire(key) for shard, key in fields.min_keys.items()} if fields.min_keys else None
    wait_ms = QUERY_WAIT_MS_DEFAULT if fields.wait_ms is None else min(fields.wait_ms, QUERY_WAIT_MS_DEFAULT)
    return QueryRequest(fields.sql, tuple(fields.params or ()), page_rows, consistency, min_key, wait_ms, min_keys)


def page_request(fields: Any, page_rows_max: int) -> tuple[str, int]:
    """A ``query_page`` (or ``query_close``: no page_rows) message's cursor and page size."""
    page_rows = getattr(fields, "page_rows", None)
    page_rows = page_rows if page_rows is not None else page_rows_max
    if not 0 < page_rows <= page_rows_max:
        raise QueryError(f"page_rows must be 1..{page_rows_max} (query_page_rows_max)", "bad_request")
    return fields.cursor, page_rows
