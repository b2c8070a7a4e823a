"""One replica as the Spark side sees it: a node's SQLite file (read-only) or a live node.

Theory of operation
-------------------
The data source and the compare job never write. A *file replica* is a node's
``mnesite.db`` opened read-only with apsw; every method runs in its own read transaction,
so a file that a running node keeps writing gives each call a consistent snapshot, but
not one snapshot across calls. A *node replica* talks to a live node through
``rlog.client.Client`` with the same batched dirty-read protocol bootstrap uses
(``scan_page(after=key)``), so its reads are dirty; the compare job accounts for that by
reporting keys touched between two replicas' applied tx keys as in flight.

Both kinds answer the same questions: the catalog, each shard's applied position, the
rows of a key range ``(low, high]`` in key order, split keys for balanced key ranges, and
the rlog entries after a tx key. Every failure becomes ``ReplicaError`` with one line
naming the replica, so that the CLI can print it and exit 2 without a traceback.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import apsw
from mnesite.rlog import range_requests
from mnesite.rlog.range_requests import RangeAnswer
from mnesite.rlog.schema import TableSchema
from mnesite.rlog.store import quote
from mnesite.rlog.types import (
    AddColumnOp,
    CreateTableOp,
    DeleteOp,
    DropTableOp,
    Op,
    OpDecodeError,
    TxKey,
    WriteOp,
    decode_op,
    tx_key_from_wire,
    unpack_ops,
)
from mnesite.rlog.versions import storage_refusal

DATABASE_FILE_NAME = "mnesite.db"
NODE_SCHEME = "tcp://"
BATCH_ROWS_MAX = 1000  # rows per read from a file cursor window or per scan_page request
NODE_TIMEOUT_MS = 5000
ENTRIES_BATCH_MAX = 1000
NODE_RANGES_PER_REQUEST_MAX = 2000  # ranges per range_digest request (keeps answers well under a frame)
NODE_SPLIT_RANGES_PER_REQUEST_MAX = 200  # the same when split keys are asked for too
ROW_DIGESTS_PAGE_MAX = 10_000  # row digests a file replica reads per statement
READ_ROWS_KEYS_MAX = 100_000  # keys one read_rows call may ask for (samples ask for a few)


class ReplicaError(RuntimeError):
    """A replica cannot be opened or read; the message is one line naming the replica."""


@dataclass(frozen=True)
class ReplicaSpec:
    """Where a replica is: ``kind`` is ``"file"`` (``location`` is the database file) or ``"node"``."""

    kind: str
    location: str
    label: str
    # For a node of a cluster with [security]: the caller's secret key file and the cluster's public key file,
    # and whether they may be symbolic links (followed and checked: ``Client(follow_key_links=True)``).
    key: str | None = None
    server_key: str | None = None
    follow_key_links: bool = False

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "location": self.location, "label": self.label}


@dataclass(frozen=True)
class ShardApplied:
    shard: str
    applied: TxKey
    digest: str  # hex; "" when the node does not know it (a replicant during a bootstrap)


@dataclass(frozen=True)
class RlogEntry:
    """The parts of an rlog entry the compare job needs: its keys, digest, touched row keys and tables."""

    tx_key: TxKey
    prev: TxKey
    digest: str
    touched: tuple[tuple[str, Any], ...]  # (table, key) pairs written or deleted
    tables_changed: tuple[tuple[str, str], ...] = ()  # (table, "created" or "dropped"), in op order
    columns_added: tuple[tuple[str, str], ...] = ()  # (table, column) of each add_column, in op order


def parse_replica(
    text: str, key: str | None = None, server_key: str | None = None, follow_key_links: bool = False
) -> ReplicaSpec:
    """``tcp://host:port`` is a live node (read with ``key`` and ``server_key`` if given, followed through
    symbolic links with ``follow_key_links``); anything else is a data directory or a ``mnesite.db`` file."""
    if text.startswith(NODE_SCHEME):
        if len(text) == len(NODE_SCHEME):
            raise ReplicaError(f"{text}: a node endpoint needs a host and a port, e.g. tcp://127.0.0.1:7400")
        return ReplicaSpec("node", text, text, key, server_key, follow_key_links)
    path = os.path.abspath(text)
    if os.path.isdir(path):
        path = os.path.join(path, DATABASE_FILE_NAME)
        if not os.path.isfile(path):
            raise ReplicaError(f"{text}: directory has no {DATABASE_FILE_NAME}; is it a mnesite data directory?")
    elif not os.path.isfile(path):
        raise ReplicaError(f"{text}: no such file or directory")
    return ReplicaSpec("file", path, text)


def open_replica(spec: ReplicaSpec, timeout_ms: int = NODE_TIMEOUT_MS) -> Replica:
    if spec.kind == "file":
        return FileReplica(spec)
    if spec.kind == "node":
        return NodeReplica(spec, timeout_ms)
    raise ReplicaError(f"{spec.label}: unknown replica kind {spec.kind!r}")


class Replica(ABC):
    """Interface shared by file and node replicas (see the module docstring)."""

    spec: ReplicaSpec

    @abstractmethod
    def catalog(self) -> dict[str, TableSchema]:
        raise NotImplementedError

    @abstractmethod
    def applied(self) -> dict[str, ShardApplied]:
        raise NotImplementedError

    @abstractmethod
    def iter_rows(
        self, table: TableSchema, low: Any, high: Any, batch_rows_max: int = BATCH_ROWS_MAX
    ) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        """``(key, values in declared order)`` for keys in ``(low, high]``, in key order."""
        raise NotImplementedError

    def split_keys(self, table: TableSchema, parts: int) -> list[Any]:
        """Up to ``parts - 1`` increasing keys cutting the table into near-equal key ranges."""
        if parts < 2:
            return []
        return self.key_boundaries(table, parts)[1]

    @abstractmethod
    def key_boundaries(
        self, table: TableSchema, parts: int, low: Any = None, high: Any = None
    ) -> tuple[int, list[Any]]:
        """``(rows, keys)``: the rows of ``(low, high]`` (a lower bound on a node past its bound) and
        up to ``parts - 1`` increasing keys strictly inside cutting it into near-equal ranges."""
        raise NotImplementedError

    @abstractmethod
    def range_digests(
        self, table: TableSchema, ranges: list[tuple[Any, Any]], split_parts: int = 0, split_rows_min: int = 0
    ) -> list[RangeAnswer]:
        """One ``RangeAnswer`` per range, in order (see ``rlog.range_requests``)."""
        raise NotImplementedError

    @abstractmethod
    def row_digests(self, table: TableSchema, low: Any, high: Any) -> Iterator[tuple[Any, bytes]]:
        """``(key, row digest)`` of every row of ``(low, high]`` in key order."""
        raise NotImplementedError

    @abstractmethod
    def read_rows(self, table: TableSchema, keys: list[Any]) -> dict[Any, tuple[Any, ...]]:
        """Values in declared order of the rows with ``keys`` (at most ``READ_ROWS_KEYS_MAX``)."""
        raise NotImplementedError

    @abstractmethod
    def entries_after(self, shard: str, after: TxKey, limit: int) -> list[RlogEntry]:
        raise NotImplementedError

    @abstractmethod
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def table(self, name: str) -> TableSchema:
        table = self.catalog().get(name)
        if table is None:
            raise ReplicaError(f"{self.spec.label}: unknown table {name!r}")
        return table

    def _resolve_touched(self, ops: tuple[Op, ...]) -> tuple[tuple[str, Any], ...]:
        catalog = self.catalog()
        touched: list[tuple[str, Any]] = []
        for op in ops:
            if isinstance(op, WriteOp):
                table = catalog.get(op.table)
                if table is not None:
                    touched.append((op.table, op.row.get(table.key_column)))
            elif isinstance(op, DeleteOp):
                touched.append((op.table, op.key))
        return tuple(touched)


def columns_added(ops: tuple[Op, ...]) -> tuple[tuple[str, str], ...]:
    """``(table, column)`` for the ops that add a column, in order."""
    return tuple((op.table, op.column) for op in ops if isinstance(op, AddColumnOp))


def tables_changed(ops: tuple[Op, ...]) -> tuple[tuple[str, str], ...]:
    """``(table, "created" or "dropped")`` for the ops that create or drop a table, in order."""
    changes: list[tuple[str, str]] = []
    for op in ops:
        if isinstance(op, CreateTableOp):
            changes.append((op.table, "created"))
        elif isinstance(op, DropTableOp):
            changes.append((op.table, "dropped"))
    return tuple(changes)


class FileReplica(Replica):
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        try:
            self.connection = apsw.Connection(spec.location, flags=apsw.SQLITE_OPEN_READONLY)
            self.connection.set_busy_timeout(NODE_TIMEOUT_MS)
            row = self.connection.execute("SELECT value FROM _mnesite_meta WHERE name = 'format_version'").fetchone()
        except apsw.Error as error:
            raise ReplicaError(f"{spec.label}: not a mnesite database ({_first_line(error)})") from None
        refusal = storage_refusal(row[0] if row else None, spec.label)
        if refusal is not None:
            raise ReplicaError(refusal)
        self._catalog: dict[str, TableSchema] | None = None
        self._features_checked = False

    def _execute(self, sql: str, bindings: tuple[Any, ...] = ()) -> apsw.Cursor:
        try:
            return self.connection.execute(sql, bindings)
        except apsw.Error as error:
            raise ReplicaError(f"{self.spec.label}: read failed ({_first_line(error)})") from None

    def catalog(self) -> dict[str, TableSchema]:
        if self._catalog is None:
            catalog = {}
            for name, shard, key_column, columns in self._execute(
                "SELECT name, shard, key_column, columns FROM _mnesite_tables ORDER BY name"
            ):
                catalog[name] = TableSchema(name, shard, key_column, tuple((c[0], c[1]) for c in json.loads(columns)))
            self._catalog = catalog
        return self._catalog

    def applied(self) -> dict[str, ShardApplied]:
        return {
            shard: ShardApplied(shard, TxKey(generation, counter), digest.hex())
            for shard, generation, counter, digest in self._execute(
                "SELECT shard, applied_generation, applied_counter, applied_digest FROM _mnesite_shards ORDER BY shard"
            )
        }

    def iter_rows(
        self, table: TableSchema, low: Any, high: Any, batch_rows_max: int = BATCH_ROWS_MAX
    ) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        columns = ", ".join(quote(name) for name, _ in table.columns)
        key = quote(table.key_column)
        key_index = [name for name, _ in table.columns].index(table.key_column)
        conditions, bindings = [], []
        if low is not None:
            conditions.append(f"{key} > ?")
            bindings.append(low)
        if high is not None:
            conditions.append(f"{key} <= ?")
            bindings.append(high)
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        # One statement, one read transaction: the range is read from one snapshot. The cursor
        # streams, so memory stays at one row; batch_rows_max does not apply to files.
        sql = f"SELECT {columns} FROM {quote(table.name)}{where} ORDER BY {key}"
        for values in self._execute(sql, tuple(bindings)):
            yield values[key_index], tuple(values)

    def row_count(self, table: TableSchema) -> int:
        return self._execute(f"SELECT count(*) FROM {quote(table.name)}").fetchone()[0]

    def _read(self, function: Any, *args: Any) -> Any:
        """``function(connection, *args)`` in one read snapshot; SQLite errors become ``ReplicaError``."""
        try:
            if not self._features_checked:
                range_requests.check_sql_features(self.connection)
                self._features_checked = True
            with range_requests.read_snapshot(self.connection):
                return function(self.connection, *args)
        except (apsw.Error, range_requests.SqlFeaturesError) as error:
            raise ReplicaError(f"{self.spec.label}: read failed ({_first_line(error)})") from None

    def key_boundaries(
        self, table: TableSchema, parts: int, low: Any = None, high: Any = None
    ) -> tuple[int, list[Any]]:
        return self._read(range_requests.key_boundaries, table, parts, low, high)

    def range_digests(
        self, table: TableSchema, ranges: list[tuple[Any, Any]], split_parts: int = 0, split_rows_min: int = 0
    ) -> list[RangeAnswer]:
        return self._read(range_requests.range_digests, table, ranges, split_parts, split_rows_min)

    def row_digests(self, table: TableSchema, low: Any, high: Any) -> Iterator[tuple[Any, bytes]]:
        after = low  # pages of ROW_DIGESTS_PAGE_MAX rows: memory stays bounded whatever the range holds
        while True:
            page = self._read(range_requests.row_digests, table, after, high, ROW_DIGESTS_PAGE_MAX)
            yield from page
            if len(page) < ROW_DIGESTS_PAGE_MAX:
                return
            after = page[-1][0]

    def read_rows(self, table: TableSchema, keys: list[Any]) -> dict[Any, tuple[Any, ...]]:
        if len(keys) > READ_ROWS_KEYS_MAX:
            raise ReplicaError(f"{self.spec.label}: at most {READ_ROWS_KEYS_MAX} keys per read")
        return self._read(range_requests.read_rows, table, keys)

    def entries_after(self, shard: str, after: TxKey, limit: int) -> list[RlogEntry]:
        entries = []
        for generation, counter, prev_generation, prev_counter, digest, ops in self._execute(
            "SELECT generation, counter, prev_generation, prev_counter, digest, ops FROM _mnesite_rlog "
            "WHERE shard = ? AND (generation, counter) > (?, ?) ORDER BY generation, counter LIMIT ?",
            (shard, after.generation, after.counter, limit),
        ):
            try:
                decoded = unpack_ops(ops)
            except (OpDecodeError, ValueError) as error:
                raise ReplicaError(f"{self.spec.label}: undecodable rlog entry ({error})") from None
            entries.append(
                RlogEntry(
                    TxKey(generation, counter),
                    TxKey(prev_generation, prev_counter),
                    digest.hex(),
                    self._resolve_touched(decoded),
                    tables_changed(decoded),
                    columns_added(decoded),
                )
            )
        return entries

    def close(self) -> None:
        self.connection.close()


class NodeReplica(Replica):
    """A live node read through ``rlog.client.Client`` (imported lazily: files need no client)."""

    def __init__(self, spec: ReplicaSpec, timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        self.spec = spec
        try:
            from mnesite.rlog.client import Client, MnesiteError
        except ImportError as error:
            raise ReplicaError(f"{spec.label}: the node client is not available ({error})") from None
        self._error_type = MnesiteError
        try:
            self.client = Client(
                spec.location,
                timeout_ms=timeout_ms,
                key=spec.key,
                server_key=spec.server_key,
                follow_key_links=spec.follow_key_links,
            )
        except MnesiteError as error:
            raise ReplicaError(f"{spec.label}: {_first_line(error)}") from None
        self._catalog: dict[str, TableSchema] | None = None
        self._status: dict[str, Any] | None = None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except self._error_type as error:
            raise ReplicaError(f"{self.spec.label}: {method} failed: {_first_line(error)}") from None

    def catalog(self) -> dict[str, TableSchema]:
        if self._catalog is None:
            catalog = {}
            for item in self._call("list_tables"):
                columns = tuple((c[0], c[1]) for c in item["columns"])
                catalog[item["table"]] = TableSchema(item["table"], item["shard"], item["key"], columns)
            self._catalog = catalog
        return self._catalog

    def applied(self) -> dict[str, ShardApplied]:
        # Client.status checked the answer (``rlog.admin_answers``): every shard has its applied tx
        # key and its digest, a text (or, a replicant's, null from a bootstrap's reset until its
        # replay: unknown, "").
        result = {}
        for shard, facts in sorted(self._call("status")["shards"].items()):
            result[shard] = ShardApplied(shard, tx_key_from_wire(facts["applied"]), facts.get("digest") or "")
        return result

    def iter_rows(
        self, table: TableSchema, low: Any, high: Any, batch_rows_max: int = BATCH_ROWS_MAX
    ) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        names = [name for name, _ in table.columns]
        # Client.scan pages from ``low`` and asks for fewer rows when a page exceeds the node's frame
        # (``too_large``): big rows are read, a page at a time, where one scan_page failed.
        rows = self.client.scan(table.name, low, batch_rows_max)
        try:
            for row in rows:
                key = row[table.key_column]
                if high is not None and key > high:
                    return
                yield key, tuple(row.get(name) for name in names)
        except self._error_type as error:
            raise ReplicaError(f"{self.spec.label}: scan failed: {_first_line(error)}") from None
        finally:
            rows.close()

    def key_boundaries(
        self, table: TableSchema, parts: int, low: Any = None, high: Any = None
    ) -> tuple[int, list[Any]]:
        # A node cuts a range into at most PARTS_MAX parts per answer (more is a bad request). The
        # client checked the answer's shape (``admin_answers.KeyBoundaries``: a malformed one fails _call).
        answer = self._call("key_boundaries", table.name, min(parts, range_requests.PARTS_MAX), low=low, high=high)
        return answer["rows"], answer["keys"]

    def range_digests(
        self, table: TableSchema, ranges: list[tuple[Any, Any]], split_parts: int = 0, split_rows_min: int = 0
    ) -> list[RangeAnswer]:
        # The node hashes; only digests come back. It answers fewer ranges than asked when its
        # row budget runs out: ask again from the first unanswered one.
        per_request = NODE_SPLIT_RANGES_PER_REQUEST_MAX if split_parts >= 2 else NODE_RANGES_PER_REQUEST_MAX
        answers: list[RangeAnswer] = []
        while len(answers) < len(ranges):
            batch = [[low, high] for low, high in ranges[len(answers) : len(answers) + per_request]]
            # The client checked each range's shape (``admin_answers.RangeDigest``: a count, a digest
            # in bytes or null, a list of split keys), not how many ranges came: that is checked here.
            answer = self._call(
                "range_digest", table.name, batch, split_parts=split_parts, split_rows_min=split_rows_min
            )
            items = [RangeAnswer(item["rows"], item["digest"], tuple(item["split_keys"])) for item in answer["ranges"]]
            if not items or len(items) > len(batch):
                raise ReplicaError(f"{self.spec.label}: range_digest answered {len(items)} of {len(batch)} ranges")
            answers.extend(items)
        return answers

    def row_digests(self, table: TableSchema, low: Any, high: Any) -> Iterator[tuple[Any, bytes]]:
        after = low
        while True:
            # No limit: the node answers as many rows as its budget allows and says whether there are more.
            # The client checked the shape (``admin_answers.RowDigests``: [key, digest in bytes] pairs).
            answer = self._call("row_digests", table.name, low=after, high=high)
            page = [(key, digest) for key, digest in answer["rows"]]
            yield from page
            if not answer["more"] or not page:
                return
            after = page[-1][0]

    def read_rows(self, table: TableSchema, keys: list[Any]) -> dict[Any, tuple[Any, ...]]:
        if len(keys) > READ_ROWS_KEYS_MAX:
            raise ReplicaError(f"{self.spec.label}: at most {READ_ROWS_KEYS_MAX} keys per read")
        names = [name for name, _ in table.columns]
        found = {}
        for key in keys:
            row = self._call("get", table.name, key)
            if row is not None:
                found[key] = tuple(row.get(name) for name in names)
        return found

    def entries_after(self, shard: str, after: TxKey, limit: int) -> list[RlogEntry]:
        entries = []
        for item in self._call("rlog_entries", shard, after=list(after), limit=limit):
            # The client checked each entry's shape (``admin_answers.RlogEntry``: tx keys, a digest text,
            # ops) but of an op only its kind: the rest of each op is read, and refused, here.
            try:
                ops = tuple(op for op in map(_op_from_client, item["ops"]) if op is not None)
            except (OpDecodeError, KeyError, TypeError) as error:
                raise ReplicaError(f"{self.spec.label}: malformed rlog entry ({error})") from None
            entries.append(
                RlogEntry(
                    tx_key_from_wire(item["tx_key"]),
                    tx_key_from_wire(item["prev"]),
                    item["digest"],
                    self._resolve_touched(ops),
                    tables_changed(ops),
                    columns_added(ops),
                )
            )
        return entries

    def close(self) -> None:
        self.client.close()


# Ops that touch no row key a compare can name: a membership entry, the cores' cluster version entry, an
# index's creation or removal (as a file replica's entries read them: only writes and deletes touch keys).
# A table created or dropped in flight, or a column added, is reported as such (``tables_changed``,
# ``columns_added``).
NO_ROW_OPS = frozenset({"members", "cluster_version", "create_index", "drop_index"})


def _op_from_client(value: Any) -> Op | None:
    """Ops as clients see them (``rlog.types.op_to_json`` objects) or in their canonical list form;
    None for an op that changes no row (``NO_ROW_OPS``)."""
    if isinstance(value, dict):
        kind = value.get("op")
        if kind in NO_ROW_OPS:
            return None
        if kind == "write" and isinstance(value.get("row"), dict):
            return WriteOp(str(value["table"]), value["row"])
        if kind == "delete":
            return DeleteOp(str(value["table"]), value.get("key"))
        if kind == "drop_table":
            return DropTableOp(str(value["table"]), str(value["shard"]))
        if kind == "add_column":
            return AddColumnOp(str(value["table"]), str(value["shard"]), str(value["column"]), str(value["type"]))
        if kind == "create_table":
            return CreateTableOp(
                str(value["table"]), str(value["shard"]), str(value["key"]), tuple(tuple(c) for c in value["columns"])
            )
        raise OpDecodeError(f"unknown op {kind!r}")
    return decode_op(value)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
