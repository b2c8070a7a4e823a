"""A PEP 249 (DB-API 2.0) read-only connection to a mnesite node, over ``Client.query`` (rlog.query).

    import mnesite.dbapi

    connection = mnesite.dbapi.connect("tcp://127.0.0.1:7400", consistency="linearizable")
    cursor = connection.cursor()
    cursor.execute("SELECT name, karma FROM users WHERE karma > ?", (10,))
    cursor.fetchall()

    import pandas
    frame = pandas.read_sql("SELECT * FROM users", connection)

Read-only: the node refuses any statement that would write (``NotSupportedError``), so ``commit``
and ``rollback`` have nothing to do. ``paramstyle`` is ``qmark``. Each ``execute`` runs one
statement at the node; its rows arrive page by page as they are fetched (one snapshot of the node
for all of them), so ``fetchmany`` over a large result holds one page at a time. A connection is one
``Client``: do not share it between threads (``threadsafety`` 1).

Time: a call that talks to the node ends within its deadline, ``timeout_ms × (retries + 1)`` of
``connect`` (``timeout_ms`` with the default ``retries`` 0), whatever the node does (a hung node
included: then ``OperationalError``). ``execute`` spends it on freeing the cursor's unfinished
result at the node, then on the statement (each of its ``retries + 1`` attempts gets an equal part
of what is left, at most ``timeout_ms``); a fetch that needs a page and a cursor's ``close`` get
``timeout_ms`` (a page request is never re-sent); a connection's ``close``, ``timeout_ms`` for all
its cursors.
"""

from __future__ import annotations

import datetime
import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mnesite.rlog.client import QUERY_TIMEOUT_MS, Client, KeyPair, MnesiteError, QueryResult, query_params
from mnesite.rlog.types import TxKey

apilevel = "2.0"
threadsafety = 1
paramstyle = "qmark"

# PEP 249's type constructors. A value binds as the client sends it: bytes as a BLOB. A date, time or
# timestamp (these constructors' or any other) binds as the ISO 8601 text its ``isoformat()`` writes
# (``2026-01-02``, ``03:04:05``, ``2026-01-02T03:04:05``), which SQLite's date and time functions read;
# the client itself refuses them (``Client.query``). Any other value the client refuses (a Decimal, a
# UUID) is a ``ProgrammingError`` naming the parameter, as sqlite3 refuses what it cannot bind.
Date = datetime.date
Time = datetime.time
Timestamp = datetime.datetime
Binary = bytes


def _bound(value: Any) -> Any:
    """A parameter as the client sends it: a date, time or timestamp as its ISO 8601 text."""
    return value.isoformat() if isinstance(value, (datetime.date, datetime.time)) else value


def DateFromTicks(ticks: float) -> datetime.date:  # noqa: N802 (the names PEP 249 requires)
    return Date(*time.localtime(ticks)[:3])


def TimeFromTicks(ticks: float) -> datetime.time:  # noqa: N802
    return Time(*time.localtime(ticks)[3:6])


def TimestampFromTicks(ticks: float) -> datetime.datetime:  # noqa: N802
    return Timestamp(*time.localtime(ticks)[:6])


class _TypeObject:
    """A PEP 249 type object: equal to each type code it names. ``description`` holds no type code
    (None: a column of a query has no declared type), so none of these equals one there."""

    def __init__(self, *type_codes: str) -> None:
        self.type_codes = frozenset(type_codes)

    def __eq__(self, other: object) -> bool:
        return other in self.type_codes

    def __hash__(self) -> int:
        return hash(self.type_codes)


STRING = _TypeObject("TEXT")
BINARY = _TypeObject("BLOB")
NUMBER = _TypeObject("INTEGER", "REAL")
DATETIME = _TypeObject()
ROWID = _TypeObject("INTEGER")


class Warning(Exception):  # noqa: A001 (the name PEP 249 requires)
    pass


class Error(Exception):
    """Base of the errors below; ``code`` is the node's error code when it answered one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class InterfaceError(Error):
    pass


class DatabaseError(Error):
    pass


class DataError(DatabaseError):
    pass


class OperationalError(DatabaseError):
    pass


class IntegrityError(DatabaseError):
    pass


class InternalError(DatabaseError):
    pass


class ProgrammingError(DatabaseError):
    pass


class NotSupportedError(DatabaseError):
    pass


# The node's error codes (and the client's for them) -> the PEP 249 class a caller catches; any other
# code is a bare DatabaseError. PEP 249: DataError for the data, ProgrammingError for the request,
# NotSupportedError for what the node does not do, OperationalError for the node's state.
_ERRORS: dict[str, type[Error]] = {
    "query_failed": DataError,  # SQLite failed the statement's run (a value Python cannot hold)
    "too_large": DataError,  # a parameter, or one row of the result, larger than a frame
    "frame_too_large": DataError,
    "bad_query": ProgrammingError,
    "bad_request": ProgrammingError,  # a parameter the wire has no type for is refused unsent
    "bad_frame": ProgrammingError,
    "unknown_table": ProgrammingError,
    "unknown_shard": ProgrammingError,
    "query_refused": NotSupportedError,
    "unknown_kind": NotSupportedError,  # a node of an older release, or not its protocol version
    "unsupported_version": NotSupportedError,
    "query_budget": OperationalError,
    "overloaded": OperationalError,
    "timeout": OperationalError,
    "unavailable": OperationalError,
    "outcome_unknown": OperationalError,
    "no_sequencer": OperationalError,
    "busy": OperationalError,
    "not_applied": OperationalError,
    "stopping": OperationalError,
    "not_ready": OperationalError,
    "query_cursor_unknown": OperationalError,
    "query_cursor_busy": OperationalError,  # its previous page is still being read (a fetch that timed out)
    "sent_again": OperationalError,  # a resend of the statement took its place
    "bad_answer": OperationalError,
    "forbidden": OperationalError,
    "unauthenticated": OperationalError,
    "internal": InternalError,  # serving the request failed at the node (a bug there, not the statement)
}


def _translated(error: MnesiteError) -> Error:
    return _ERRORS.get(error.code, DatabaseError)(str(error), error.code)


def connect(
    endpoint: str | Sequence[str] | None = None,
    *,
    consistency: str = "local",
    after_tx_key: TxKey | Sequence[int] | Mapping[str, TxKey | Sequence[int]] | None = None,
    timeout_ms: int = QUERY_TIMEOUT_MS,
    retries: int = 0,
    page_rows: int | None = None,
    key: str | os.PathLike[str] | KeyPair | None = None,
    server_key: str | os.PathLike[str] | bytes | None = None,
    follow_key_links: bool = False,
) -> Connection:
    """A read-only connection. ``consistency`` (``local``, ``read-your-writes``, ``linearizable``) and
    ``after_tx_key`` (one key for every shard read, or ``{shard: key}`` such as a ``Client``'s
    ``last_tx_keys``, each waited for in its shard) apply to every statement (change them on the
    connection); ``page_rows``: rows
    per page fetched (default: the node's ``query_page_rows_max``). ``key``, ``server_key`` and
    ``follow_key_links``: as ``Client`` takes them.

    ``timeout_ms`` and ``retries``: as ``Client`` takes them (an attempt with no answer within
    ``timeout_ms`` is sent again, with the same request id, up to ``retries`` times, at the next
    endpoint if there are several); a call's deadline is ``timeout_ms × (retries + 1)`` (the module's
    docstring says how a call spends it). A value the client refuses is an ``InterfaceError``."""
    try:
        client = Client(
            endpoint,
            timeout_ms=timeout_ms,
            retries=retries,
            key=key,
            server_key=server_key,
            follow_key_links=follow_key_links,
        )
    except MnesiteError as error:
        raise InterfaceError(str(error), error.code) from None
    after: TxKey | dict[str, TxKey] | None = None
    if isinstance(after_tx_key, Mapping):  # {shard: key}, such as a Client's last_tx_keys: each in its own shard
        after = {str(shard): TxKey(*shard_key) for shard, shard_key in after_tx_key.items()}
    elif after_tx_key is not None:
        after = TxKey(*after_tx_key)
    return Connection(client, consistency, after, page_rows)


class Connection:
    def __init__(
        self, client: Client, consistency: str, after_tx_key: TxKey | dict[str, TxKey] | None, page_rows: int | None
    ) -> None:
        self.client: Client | None = client
        self.consistency = consistency
        self.after_tx_key = after_tx_key
        self.page_rows = page_rows
        # Closed with the connection: each may hold a cursor (a read snapshot) at the node.
        self._cursors: weakref.WeakSet[Cursor] = weakref.WeakSet()
        # PEP 249's optional extension: the exception classes as attributes of the connection.
        for error in (Warning, Error, InterfaceError, DatabaseError, DataError, OperationalError):
            setattr(self, error.__name__, error)
        for error in (IntegrityError, InternalError, ProgrammingError, NotSupportedError):
            setattr(self, error.__name__, error)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every cursor (the node frees their unfinished results), then the connection.

        One timeout for all of them, not one per cursor: once the node leaves a close unanswered, or
        the time is spent, the other cursors are only forgotten here (the node expires them after
        its ``query_idle_ms_max``)."""
        if self.client is not None:
            deadline = time.monotonic() + self.client.timeout_ms / 1000
            answering = True
            for cursor in list(self._cursors):
                left_ms = int((deadline - time.monotonic()) * 1000) if answering else 0
                answering = cursor._close(max(0, left_ms)) and left_ms > 0
            self.client.close()
            self.client = None

    def commit(self) -> None:
        """Nothing to commit: the connection only reads."""
        self._open_client()

    def rollback(self) -> None:
        """Nothing to roll back: the connection only reads."""
        self._open_client()

    def cursor(self) -> Cursor:
        self._open_client()
        cursor = Cursor(self)
        self._cursors.add(cursor)
        return cursor

    def _open_client(self) -> Client:
        if self.client is None:
            raise InterfaceError("the connection is closed")
        return self.client


class Cursor:
    arraysize = 1

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.description: tuple[tuple[str, None, None, None, None, None, None], ...] | None = None
        self.rowcount = -1
        self._result: QueryResult | None = None
        self._page: list[tuple[Any, ...]] = []
        self._closed = False

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        while True:
            row = self.fetchone()
            if row is None:
                return
            yield row

    def execute(self, operation: str, parameters: Sequence[Any] | None = None) -> Cursor:
        if self._closed:
            raise InterfaceError("the cursor is closed")
        if isinstance(parameters, Mapping):
            raise NotSupportedError("paramstyle is qmark: give the parameters as a sequence")
        client = self.connection._open_client()
        # One deadline for the whole call (the module's docstring): freeing the unfinished result of the
        # previous statement and every attempt of this one each had the full timeout of their own.
        deadline = time.monotonic() + client.timeout_ms * (client.retries + 1) / 1000
        previous = self._result.endpoint if self._result is not None else None
        self._finish(client.timeout_ms)
        left_ms = int((deadline - time.monotonic()) * 1000)
        attempt_ms = min(client.timeout_ms, left_ms // (client.retries + 1))
        if attempt_ms < 1:
            raise OperationalError(
                f"not sent: freeing the previous result at node {previous} took this call's whole deadline "
                f"({client.timeout_ms * (client.retries + 1)} ms)",
                "unavailable",
            )
        try:
            self._result = client.query(
                operation,
                [_bound(value) for value in query_params(parameters or ())],
                self.connection.consistency,
                self.connection.after_tx_key,
                page_rows=self.connection.page_rows,
                timeout_ms=attempt_ms,
            )
        except MnesiteError as error:
            raise _translated(error) from None
        self._result.page_timeout_ms = client.timeout_ms  # each page its own call (``_take``)
        self.description = tuple((name, None, None, None, None, None, None) for name in self._result.columns)
        return self

    def executemany(self, operation: str, seq_of_parameters: Sequence[Sequence[Any]]) -> None:
        raise NotSupportedError("the connection is read-only: executemany has nothing to do")

    def fetchone(self) -> tuple[Any, ...] | None:
        rows = self._take(1)
        return rows[0] if rows else None

    def fetchmany(self, size: int | None = None) -> list[tuple[Any, ...]]:
        """``size`` rows (default ``arraysize``); below 0: every row left, as sqlite3 answers."""
        count = self.arraysize if size is None else size
        return self._take(None if count < 0 else count)

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._take(None)

    def _take(self, count: int | None) -> list[tuple[Any, ...]]:
        if self._closed:
            raise InterfaceError("the cursor is closed")
        if self._result is None:
            raise ProgrammingError("no statement was executed")
        rows: list[tuple[Any, ...]] = []
        while count is None or len(rows) < count:
            if not self._page:
                try:
                    page = self._result.fetch_page()
                except MnesiteError as error:
                    raise _translated(error) from None
                if page is None:
                    break
                self._page = page
                continue
            wanted = len(self._page) if count is None else count - len(rows)
            rows.extend(self._page[:wanted])
            del self._page[:wanted]
        return rows

    def _finish(self, timeout_ms: int | None = None) -> bool:
        answered = self._result.close(timeout_ms) if self._result is not None else True
        self._result, self._page, self.description = None, [], None
        return answered

    def close(self) -> None:
        self._close(None)

    def _close(self, timeout_ms: int | None) -> bool:
        """Close with ``timeout_ms`` for the node's answer (0: do not ask it); False if unanswered."""
        answered = self._finish(timeout_ms)
        self._closed = True
        return answered

    def setinputsizes(self, sizes: Any) -> None:
        pass

    def setoutputsize(self, size: Any, column: Any = None) -> None:
        pass
