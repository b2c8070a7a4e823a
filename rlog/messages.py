"""The wire schema: one frozen msgspec ``Struct`` per message kind, decoded once at the socket.

Theory of operation
-------------------
Every byte from a socket is untrusted, a peer core's included. ``rlog.codec`` splits a frame into
``[version, kind, request_id, body]`` and decodes the body straight into its kind's ``Struct``
(``SCHEMAS[kind].decoder``): msgspec parses the msgpack and checks every declared type, range,
length and pattern in C, refuses unknown fields, and builds the frozen typed value that drivers and
state machines read from then on. Nothing after that point checks a shape again.

What msgspec cannot declare is checked by the body's ``verify``, which ``decode_body`` runs:

* SQLite values (``Scalar``): null, bool, a 64-bit integer, a float that is not NaN, text or bytes.
  msgspec does not allow ``str`` and ``bytes`` in one union, so a scalar is declared ``Any`` and its
  type is checked by ``scalars_refusal`` (set-based, at C speed for whole rows at once).
* Free values (a reply's ``result``, an error's ``detail``, a consensus message, a range list): any
  value without extension types, at most ``depth_max`` deep and ``items_max`` items, walked with an
  explicit stack (``free_value_refusal``), so a hostile ``[[[[...]]]]`` never reaches recursion.

An entry travels as ``WireEntry`` with its ops still packed (the bytes the digest covers and the log
stores); ``decode_entry`` decodes them, once the receiver wants the entry, into the tagged op types
of ``WIRE_OPS`` and requires the canonical packing, so a digest over the bytes is the digest of the
ops. A refusal raises ``MessageError`` (a ``ValueError``) naming the field path and the expected
shape, never the offending value, so an error message is bounded whatever was sent.

The client checks what it sends by the same types (``codec.encode(..., check=True)``), so it
refuses what a node would refuse. Checks against the *receiver's state* (replies about entries never
sent, a second sequencer in one generation) cannot live here: they are in the state machines.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgpack
import msgspec
from mnesite.rlog.types import (
    DIGEST_BYTES,
    AddColumnOp,
    ClusterVersionOp,
    CreateIndexOp,
    CreateTableOp,
    DeleteOp,
    DropIndexOp,
    DropTableOp,
    Entry,
    MembersOp,
    Op,
    TxKey,
    WriteOp,
    remember_packed,
)
from msgspec import Meta, Struct

# SQLite's INTEGER range; tx key parts and generations stay below 2**63 as well (``TxKey``).
INTEGER_MIN = -(2**63)
INTEGER_MAX = 2**63 - 1
NAME_CHARS_MAX = 64  # tables, columns, shards, node names
ENDPOINT_CHARS_MAX = 255
AGENT_ID_CHARS_MAX = 64
REQUEST_ID_CHARS_MAX = 64
MESSAGE_CHARS_MAX = 4096  # an error reply's message
OPS_MAX = 100_000  # ops or guards in one transaction on the wire (the node's transaction_ops_max is lower)
COLUMNS_MAX = 200
INDEX_COLUMNS_MAX = 16  # columns of one secondary index
ROW_COLUMNS_MAX = 1000
MEMBERS_MAX = 64
# Voters in one membership entry: core.membership.MEMBERS_MAX (rlog imports nothing of core; a test
# keeps the two equal), so that no entry a core accepts names a membership it cannot start with.
MEMBERS_OP_MAX = 15
PUSH_ENTRIES_MAX = 4096
RANGES_MAX = 10_000
FREE_VALUE_DEPTH_MAX = 32  # a reply's result or an error's detail
FREE_VALUE_ITEMS_MAX = 16 * 1024 * 1024  # above what a frame_bytes_max frame can hold
WAIT_MS_MAX = 600_000
BACKUP_PATH_CHARS_MAX = 1024
AGENTS_COUNT_MAX = 2**31  # a core's agent count beyond this is not believed
QUERY_SQL_CHARS_MAX = 100_000  # one query's SQL text (rlog.query)
QUERY_PARAMS_MAX = 999  # bound parameters of one query
QUERY_CURSOR_CHARS_MAX = 64  # a query cursor's token
CHANGES_TABLES_MAX = 1000  # tables one changefeed request names
CHANGES_SHARDS_MAX = 1000  # shard positions one changefeed request carries (a node has at most 1000 shards)

# The one rule for a name on the wire (tables, columns, shards, nodes, agents). The table schema
# (``rlog.schema``) is stricter for what may become a SQLite identifier.
NAME_PATTERN = r"^[A-Za-z0-9_.\-]+$"
# tcp://host:port with a host name, an IPv4 address or a bracketed IPv6 address; ipc:// for tests.
ENDPOINT_PATTERN = r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}|ipc://[A-Za-z0-9_./\-]+)$"
# An absolute path of plain characters (rlog.backup checks it again, with the file system).
BACKUP_PATH_PATTERN = r"^/[A-Za-z0-9_./\-]*$"
_NAME = re.compile(NAME_PATTERN)
_ENDPOINT = re.compile(ENDPOINT_PATTERN)

Name = Annotated[str, Meta(min_length=1, max_length=NAME_CHARS_MAX, pattern=NAME_PATTERN)]
Endpoint = Annotated[str, Meta(min_length=1, max_length=ENDPOINT_CHARS_MAX, pattern=ENDPOINT_PATTERN)]
RequestId = Annotated[str, Meta(min_length=1, max_length=REQUEST_ID_CHARS_MAX)]
Digest = Annotated[bytes, Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]
DigestOrEmpty = Annotated[bytes, Meta(max_length=DIGEST_BYTES)]
Integer = Annotated[int, Meta(ge=INTEGER_MIN, le=INTEGER_MAX)]
NonNegative = Annotated[int, Meta(ge=0, le=INTEGER_MAX)]
Consistency = Literal["local", "read-your-writes", "linearizable"]
WaitMs = Annotated[int, Meta(ge=0, le=WAIT_MS_MAX)]
Text = Annotated[str, Meta(max_length=MESSAGE_CHARS_MAX)]
# A SQLite value: checked by ``scalars_refusal`` in the owner's ``verify`` (see above).
Scalar = Any
Row = Annotated[dict[Name, Any], Meta(max_length=ROW_COLUMNS_MAX)]


NOT_UTF8 = "holds a string that is not UTF-8"


class MessageError(ValueError):
    """A message's contents do not fit its kind's schema. ``code`` is the error code to answer with."""

    def __init__(self, path: str, expected: str, code: str = "bad_request") -> None:
        super().__init__(f"{path}: {expected}")
        self.path = path
        self.code = code


# -- what msgspec cannot declare ---------------------------------------------------------------

_SCALAR_TYPES = frozenset((type(None), bool, int, float, str, bytes))
SCALAR_EXPECTED = "must be null, a 64-bit integer, a float, a string or bytes"


def scalars_refusal(values: Any) -> str | None:
    """None if every value is a SQLite scalar; else why not. Set-based: a row costs a few C loops."""
    values = values if isinstance(values, (list, tuple)) else list(values)
    kinds = set(map(type, values))
    if not kinds <= _SCALAR_TYPES:
        return SCALAR_EXPECTED
    # msgpack holds no integer below -2**63, so only the top of SQLite's range can be passed.
    if int in kinds and max(value for value in values if type(value) is int) > INTEGER_MAX:
        return "integer is outside SQLite's 64-bit range"
    if float in kinds and any(value != value for value in values if type(value) is float):
        return "NaN cannot be stored"
    return None


def _require_scalars(values: Any, path: str) -> None:
    refusal = scalars_refusal(values)
    if refusal is not None:
        raise MessageError(path, refusal)


_WIRE_SCALAR_TYPES = frozenset((type(None), bool, int, float, str, bytes))


def free_value_refusal(value: Any, depth_max: int, items_max: int = FREE_VALUE_ITEMS_MAX) -> str | None:
    """None if ``value`` is a plain wire value at most ``depth_max`` deep and ``items_max`` items.

    Walked with an explicit stack, never recursively, so no depth can exhaust Python's stack.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    items = 0
    while stack:
        current, depth = stack.pop()
        items += 1
        if type(current) is list and depth + 1 < depth_max and _flat_rows(current):
            # A list of rows (dicts of scalars): counted at C speed, no trip through the stack.
            items += len(current) + 2 * sum(map(len, current))
        elif isinstance(current, (list, tuple, dict)):
            if depth >= depth_max:
                return f"is nested deeper than {depth_max} levels"
            children = list(current.keys()) + list(current.values()) if isinstance(current, dict) else current
            # Plain scalars are counted without a trip through the stack, all at once when a
            # container holds nothing else (a bootstrap batch is tens of thousands of such rows).
            if all(map(_WIRE_SCALAR_TYPES.__contains__, map(type, children))):
                items += len(children)
            else:
                for child in children:
                    if type(child) in _WIRE_SCALAR_TYPES:
                        items += 1
                    else:
                        stack.append((child, depth + 1))
        elif type(current) not in _WIRE_SCALAR_TYPES:
            return f"holds a {type(current).__name__}, which is not a wire value"
        if items > items_max:
            return f"holds more than {items_max} items"
    return None


def _flat_rows(values: list[Any]) -> bool:
    """Whether ``values`` is a non-empty list of dicts whose keys and values are all plain scalars."""
    if not values or set(map(type, values)) != {dict}:
        return False
    scalar = _WIRE_SCALAR_TYPES.__contains__
    return all(map(scalar, map(type, itertools.chain.from_iterable(values)))) and all(
        map(scalar, map(type, itertools.chain.from_iterable(map(dict.values, values))))
    )


def _require_free(value: Any, path: str, depth_max: int) -> None:
    refusal = free_value_refusal(value, depth_max)
    if refusal is not None:
        raise MessageError(path, refusal)


# -- shared shapes -----------------------------------------------------------------------------


class Body(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A message body: a msgpack map with exactly the declared fields.

    ``verify`` checks what msgspec cannot declare (scalars, free values); ``decode_body`` runs it
    after decoding. A sender building a body in Python does not pay for it.
    """

    def verify(self) -> None:
        """Raise ``MessageError`` naming the field if a value msgspec let through is not allowed."""


class ReadOptions(Body, frozen=True, kw_only=True):
    """The options every read takes (see README, consistency levels)."""

    consistency: Consistency = "local"
    min_key: TxKey | None = None
    wait_ms: WaitMs | None = None
    forwarded: bool = False


class WriteRequest(Body, frozen=True, kw_only=True, tag_field="op", tag="write"):
    table: Name
    row: Row


class DeleteRequest(Body, frozen=True, kw_only=True, tag_field="op", tag="delete"):
    table: Name
    key: Scalar


class Guard(Body, frozen=True, kw_only=True):
    """etcd-style compare: the row at ``key`` equals ``equals``, or is absent when it is null."""

    table: Name
    key: Scalar
    equals: Row | None = None


ColumnType = Annotated[str, Meta(min_length=1, max_length=16)]
Column = tuple[Name, ColumnType]


class WireEntry(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """An entry on the wire (``rlog.types.entry_to_wire``): its ops are the packed bytes."""

    shard: Name
    tx_key: TxKey
    prev: TxKey
    digest: Digest
    ops: bytes
    request_id: RequestId | None


# -- the kinds ---------------------------------------------------------------------------------


class Transact(Body, frozen=True, kw_only=True):
    ops: Annotated[list[WriteRequest | DeleteRequest], Meta(max_length=OPS_MAX)]
    guards: Annotated[list[Guard], Meta(max_length=OPS_MAX)] = []
    forwarded: bool = False

    def verify(self) -> None:
        # Every value of every op and guard in one set-based check (a row costs a few C loops).
        values: list[Any] = []
        for op in self.ops:
            if type(op) is WriteRequest:
                values.extend(op.row.values())
            else:
                values.append(op.key)
        for guard in self.guards:
            values.append(guard.key)
            if guard.equals is not None:
                values.extend(guard.equals.values())
        if scalars_refusal(values) is not None:
            self._name_the_refused_value()

    def _name_the_refused_value(self) -> None:
        """The error path only: find the first value the set-based check refused, by its path."""
        for index, op in enumerate(self.ops):
            if type(op) is WriteRequest:
                for column, value in op.row.items():
                    _require_scalars((value,), f"ops[{index}].row.{column}")
            else:
                _require_scalars((op.key,), f"ops[{index}].key")
        for index, guard in enumerate(self.guards):
            _require_scalars((guard.key,), f"guards[{index}].key")
            for column, value in (guard.equals or {}).items():
                _require_scalars((value,), f"guards[{index}].equals.{column}")


class CreateTable(Body, frozen=True, kw_only=True):
    table: Name
    key: Name
    columns: Annotated[list[Column], Meta(max_length=COLUMNS_MAX)]
    shard: Name | None = None
    forwarded: bool = False


class DropTable(Body, frozen=True, kw_only=True):
    table: Name
    forwarded: bool = False


class CreateIndex(Body, frozen=True, kw_only=True):
    index: Name
    table: Name
    columns: Annotated[list[Name], Meta(min_length=1, max_length=INDEX_COLUMNS_MAX)]
    forwarded: bool = False


class DropIndex(Body, frozen=True, kw_only=True):
    index: Name
    forwarded: bool = False


class AddColumn(Body, frozen=True, kw_only=True):
    table: Name
    column: Name
    type: ColumnType
    forwarded: bool = False


class Query(ReadOptions, frozen=True, kw_only=True):
    sql: Annotated[str, Meta(min_length=1, max_length=QUERY_SQL_CHARS_MAX)]
    params: Annotated[list[Scalar], Meta(max_length=QUERY_PARAMS_MAX)] = []
    page_rows: Integer | None = None

    def verify(self) -> None:
        _require_scalars(self.params, "params")


QueryCursor = Annotated[str, Meta(min_length=1, max_length=QUERY_CURSOR_CHARS_MAX, pattern=NAME_PATTERN)]


class QueryPage(Body, frozen=True, kw_only=True):
    cursor: QueryCursor
    page_rows: Integer | None = None


class QueryClose(Body, frozen=True, kw_only=True):
    cursor: QueryCursor


class ChangesPosition(Body, frozen=True, kw_only=True):
    """Where one shard of a changefeed stands (``rlog.changes``): the client keeps it and sends it back.

    ``phase`` ``live``: every change up to ``after`` was delivered. ``copy``: a snapshot replaying
    from ``after`` is copying ``table``, its rows up to key ``table_after`` delivered (null: none
    yet). ``replay``: the snapshot's copy is done; entries after ``after`` up to ``replay_to`` are
    being delivered, then ``snapshot_end`` at ``replay_to``.
    """

    shard: Name
    after: TxKey
    phase: Literal["live", "copy", "replay"] = "live"
    table: Name | None = None
    table_after: Scalar = None
    replay_to: TxKey | None = None

    def verify(self) -> None:
        _require_scalars((self.table_after,), "table_after")


class Changes(Body, frozen=True, kw_only=True):
    """One page of a changefeed (``rlog.changes``): the changes after ``positions`` of ``tables``
    (none named: every table), held up to ``wait_ms`` while there is none."""

    tables: Annotated[list[Name], Meta(max_length=CHANGES_TABLES_MAX)] = []
    positions: Annotated[list[ChangesPosition], Meta(max_length=CHANGES_SHARDS_MAX)] = []
    page_records: Annotated[int, Meta(ge=1, le=INTEGER_MAX)] | None = None
    wait_ms: WaitMs | None = None

    def verify(self) -> None:
        for index, position in enumerate(self.positions):
            try:
                position.verify()
            except MessageError as error:
                raise MessageError(f"positions[{index}].{error.path}", str(error).partition(": ")[2]) from None


class Empty(Body, frozen=True, kw_only=True):
    """A request with no fields (status, list_tables, stop, journal, force_start, members)."""


class Get(ReadOptions, frozen=True, kw_only=True):
    table: Name
    key: Scalar

    def verify(self) -> None:
        _require_scalars((self.key,), "key")


class Scan(ReadOptions, frozen=True, kw_only=True):
    table: Name
    after: Scalar = None
    limit: Integer | None = None

    def verify(self) -> None:
        _require_scalars((self.after,), "after")


class Count(ReadOptions, frozen=True, kw_only=True):
    table: Name


class ReadIndex(Body, frozen=True, kw_only=True):
    shard: Name
    forwarded: bool = False


class MembershipChange(Body, frozen=True, kw_only=True):
    shard: Name
    action: Literal["add", "remove"]
    name: Name
    endpoint: Endpoint | None = None
    forwarded: bool = False


class Backup(Body, frozen=True, kw_only=True):
    path: Annotated[str, Meta(min_length=2, max_length=BACKUP_PATH_CHARS_MAX, pattern=BACKUP_PATH_PATTERN)]


class RlogTail(Body, frozen=True, kw_only=True):
    shard: Name
    count: Integer | None = None


class RlogEntries(Body, frozen=True, kw_only=True):
    shard: Name
    after: TxKey | None = None
    limit: Integer | None = None


class Watch(Body, frozen=True, kw_only=True):
    shard: Name
    replicant: Name
    endpoint: Endpoint
    from_: TxKey = msgspec.field(name="from")
    from_digest: DigestOrEmpty
    protocol: Annotated[int, Meta(ge=0, le=2**31)]
    # chosen by the replica; the answer and every push of the new agent repeat it
    watch_id: Annotated[str, Meta(max_length=64)] = ""


class Push(Body, frozen=True, kw_only=True):
    shard: Name
    agent: Annotated[str, Meta(min_length=1, max_length=AGENT_ID_CHARS_MAX, pattern=NAME_PATTERN)]
    core: Name
    entries: Annotated[list[WireEntry], Meta(max_length=PUSH_ENTRIES_MAX)]
    committed: TxKey
    hears_sequencer: bool
    # the answer to the watch that created the agent (a push may overtake that answer)
    watch: Any = None

    def verify(self) -> None:
        _require_free(self.watch, "watch", 3)


class PushAck(Body, frozen=True, kw_only=True):
    shard: Name
    agent: Annotated[str, Meta(min_length=1, max_length=AGENT_ID_CHARS_MAX, pattern=NAME_PATTERN)]
    applied: TxKey
    rejected: Text | None = None


class BootstrapBatch(Body, frozen=True, kw_only=True):
    table: Name
    limit: Integer
    after: Scalar = None
    bytes_max: Annotated[int, Meta(ge=1, le=2**31)] | None = None

    def verify(self) -> None:
        _require_scalars((self.after,), "after")


class SnapshotOffer(Body, frozen=True, kw_only=True):
    shard: Name
    sender: Name
    generation: NonNegative
    key: TxKey
    digest: DigestOrEmpty
    # the sequencer's committed membership at key (core.membership)
    members: Annotated[list[Name], Meta(max_length=MEMBERS_OP_MAX)] = []
    # the shard's cluster version at key (core.versions); left out at 1, so release 0.1.0 never sees it
    cluster_version: Annotated[int, Meta(ge=1, le=1000)] = 1


class Peer(Body, frozen=True, kw_only=True):
    shard: Name
    sender: Name
    # one ``core.consensus_wire`` message, left as its msgpack bytes here and decoded once, by its
    # kind's type, by ``core.consensus_wire.message_from_wire`` (no walk of it as a free value first)
    message: msgspec.Raw


class RangeDigest(Body, frozen=True, kw_only=True):
    table: Name
    ranges: Annotated[list[Any], Meta(min_length=1, max_length=RANGES_MAX)]
    split_parts: Integer | None = None
    split_rows_min: Integer | None = None

    def verify(self) -> None:
        _require_free(self.ranges, "ranges", 3)


class KeyBoundaries(Body, frozen=True, kw_only=True):
    table: Name
    parts: Integer
    low: Scalar = None
    high: Scalar = None

    def verify(self) -> None:
        _require_scalars((self.low, self.high), "range")


class RowDigests(Body, frozen=True, kw_only=True):
    table: Name
    low: Scalar = None
    high: Scalar = None
    limit: Integer | None = None

    def verify(self) -> None:
        _require_scalars((self.low, self.high), "range")


class Reply(Body, frozen=True, kw_only=True):
    result: Any = None

    def verify(self) -> None:
        _require_free(self.result, "result", FREE_VALUE_DEPTH_MAX)


class Error(Body, frozen=True, kw_only=True):
    code: Annotated[str, Meta(min_length=1, max_length=64)]
    message: Annotated[str, Meta(max_length=MESSAGE_CHARS_MAX * 4)]
    detail: Any = None

    def verify(self) -> None:
        _require_free(self.detail, "detail", FREE_VALUE_DEPTH_MAX)


# -- the schema: one entry per kind ------------------------------------------------------------


def _refuse_ext(code: int, data: memoryview) -> Any:
    raise MessageError("", f"msgpack extension type {code} is not allowed", "bad_frame")


@dataclass(frozen=True)
class KindSchema:
    """Everything known about one message kind: its body type and what it is for."""

    kind: str
    purpose: str
    body: type[Body]
    reply: bool = False  # a reply kind (answers, not requests)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decoder", msgspec.msgpack.Decoder(self.body, ext_hook=_refuse_ext))


_SCHEMA_LIST = [
    # client requests
    KindSchema("transact", "a transaction: guards and ops over one shard", Transact),
    KindSchema("create_table", "create a table", CreateTable),
    KindSchema("drop_table", "drop a table and its rows (a replicated schema change, like create_table)", DropTable),
    KindSchema(
        "create_index",
        "create a secondary index of a table (a replicated schema change, like create_table)",
        CreateIndex,
    ),
    KindSchema("drop_index", "drop a secondary index (a replicated schema change)", DropIndex),
    KindSchema(
        "add_column",
        "add a nullable column to a table (a replicated schema change; existing rows hold null)",
        AddColumn,
    ),
    KindSchema("list_tables", "the catalog", Empty),
    KindSchema("get", "one row by key", Get),
    KindSchema("scan", "a page of rows in key order", Scan),
    KindSchema("count", "the number of rows of a table, counted by SQLite", Count),
    # read-only SQL (rlog.query): the first page of a statement's rows, then the next pages by cursor
    KindSchema(
        "query", "a read-only SQL statement and its bound parameters; answered with its first page of rows", Query
    ),
    KindSchema("query_page", "the next page of a query's rows, by the cursor its previous page named", QueryPage),
    KindSchema("query_close", "close a query's cursor before its last page (the node frees its snapshot)", QueryClose),
    # the changefeed (rlog.changes): a page of committed changes after the client's positions
    KindSchema(
        "changes",
        "a changefeed page: the committed changes of some tables after per-shard positions (a copy when trimmed)",
        Changes,
    ),
    KindSchema("status", "the node's status", Empty),
    # admin: the node finishes its loop turn, logs a shutdown line and exits (cli ``stop``)
    KindSchema("stop", "operator: shut this node down cleanly", Empty),
    KindSchema("read_index", "the committed key, confirmed by the sequencer", ReadIndex),
    KindSchema("journal", "the node's journal age per shard", Empty),
    KindSchema("force_start", "operator: force this core to become sequencer", Empty),
    KindSchema(
        "membership_change",
        "operator: add or remove one core in one shard (core.membership), at its sequencer",
        MembershipChange,
    ),
    KindSchema("members", "the cluster's and each shard's core membership as this core sees it", Empty),
    KindSchema(
        "backup", "operator: copy this node's database to a file on its host (rlog.backup); again to poll", Backup
    ),
    KindSchema("rlog_tail", "the newest entries of a shard", RlogTail),
    KindSchema("rlog_entries", "entries after a key", RlogEntries),
    # replication
    KindSchema("watch", "replicant -> core: start watching a shard", Watch),
    KindSchema("push", "core agent -> replicant: committed entries (none: a heartbeat)", Push),
    KindSchema("push_ack", "replicant -> core agent: applied key, or why the push was rejected", PushAck),
    KindSchema(
        "bootstrap_batch",
        "a bootstrap's key-ordered dirty-read batch of one table (bootstrap.serve), answered {rows, done}",
        BootstrapBatch,
    ),
    KindSchema(
        "snapshot_offer",
        "sequencer -> a follower behind its trimmed log: install a snapshot at this key (core.snapshot)",
        SnapshotOffer,
    ),
    # consensus
    KindSchema(
        "peer",
        "between cores: one consensus message of one shard, exclusion notices included (core.consensus_wire)",
        Peer,
    ),
    # range requests (rlog.range_requests)
    KindSchema("range_digest", "row counts and digests of key ranges", RangeDigest),
    KindSchema("key_boundaries", "keys splitting a range into parts", KeyBoundaries),
    KindSchema("row_digests", "per-row digests of a range", RowDigests),
    # replies
    KindSchema("reply", "an answer", Reply, reply=True),
    KindSchema("error", "a refusal", Error, reply=True),
]

SCHEMAS: dict[str, KindSchema] = {schema.kind: schema for schema in _SCHEMA_LIST}
REQUEST_KINDS = frozenset(kind for kind, schema in SCHEMAS.items() if not schema.reply)


def refusal_code(text: str) -> str:
    """``bad_frame`` for a value of the wrong type or a missing/unknown field; ``bad_request`` for a
    value of the right type out of its range, length, pattern or choices."""
    if text.startswith(("Object missing required field", "Object contains unknown field")):
        return "bad_frame"
    if text.startswith("Expected `") and ", got `" in text:
        return "bad_frame"
    return "bad_request"


def body_error(kind: str, error: msgspec.ValidationError | msgspec.DecodeError) -> MessageError:
    """A ``MessageError`` of msgspec's, with msgspec's ``$`` path replaced by the kind."""
    if not isinstance(error, msgspec.ValidationError):  # a DecodeError that is not a ValidationError
        return MessageError(kind, "malformed msgpack body", "bad_frame")
    message, _, path = str(error).partition(" - at `$")
    return MessageError(kind + path.rstrip("`"), message[:300], refusal_code(message))


def decode_body(kind: str, body: bytes | memoryview) -> Body:
    """Decode and check ``body`` (msgpack bytes) as ``kind``'s type; raises ``MessageError``."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise MessageError("kind", "is not a known message kind", "unknown_kind")
    try:
        value: Body = schema.decoder.decode(body)  # type: ignore[attr-defined]
        value.verify()
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise body_error(kind, error) from None
    except UnicodeDecodeError:
        # msgspec raises it (not a DecodeError) for a msgpack string that is not UTF-8.
        raise MessageError(kind, NOT_UTF8, "bad_frame") from None
    except RecursionError:
        raise MessageError(_deep_field(kind, body), "is nested deeper than the decoder allows", "bad_frame") from None
    except MessageError as error:
        path = f"{kind}.{error.path}" if error.path else kind
        raise MessageError(path, str(error).partition(": ")[2], error.code) from None
    return value


def _deep_field(kind: str, body: bytes | memoryview) -> str:
    """The path of the field holding the value too deep for msgspec (an error path only): the body
    is unpacked by msgpack (which does not recurse in Python) and walked with an explicit stack."""
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=lambda code, data: None)
    except Exception:  # garbage beside the depth: the kind is all that can be named
        return kind
    stack: list[tuple[Any, str, int]] = [(value, kind, 0)]
    while stack:
        current, path, depth = stack.pop()
        if depth > FREE_VALUE_DEPTH_MAX:
            return path
        if isinstance(current, dict):
            for key, item in current.items():
                stack.append((item, f"{path}.{str(key)[:NAME_CHARS_MAX]}", depth + 1))
        elif isinstance(current, list):
            # Indices are named only between fields (ops[0].key); a chain of lists is one field.
            for index, item in enumerate(current):
                inner = f"{path}[{index}]" if isinstance(item, dict) else path
                stack.append((item, inner, depth + 1))
    return kind


# -- entries: packed ops decoded once the receiver wants them ------------------------------------


# Names in ops are declared without their pattern: a regular expression per column of every row
# cost more than the rest of the decode. ``decode_ops`` checks each distinct name once instead
# (``_names_refusal``), against the same rule.
_OpName = Annotated[str, Meta(min_length=1, max_length=NAME_CHARS_MAX)]


class _WriteWire(Struct, frozen=True, array_like=True, tag="w", gc=False):
    table: _OpName
    row: Annotated[list[tuple[_OpName, Any]], Meta(max_length=ROW_COLUMNS_MAX)]


class _DeleteWire(Struct, frozen=True, array_like=True, tag="d", gc=False):
    table: _OpName
    key: Any


class _CreateWire(Struct, frozen=True, array_like=True, tag="c"):
    table: Name
    shard: Name
    key: Name
    columns: Annotated[list[Column], Meta(max_length=COLUMNS_MAX)]


class _DropWire(Struct, frozen=True, array_like=True, tag="x"):
    table: Name
    shard: Name


class _CreateIndexWire(Struct, frozen=True, array_like=True, tag="i"):
    index: Name
    table: Name
    shard: Name
    columns: Annotated[list[Name], Meta(min_length=1, max_length=INDEX_COLUMNS_MAX)]


class _DropIndexWire(Struct, frozen=True, array_like=True, tag="j"):
    index: Name
    table: Name
    shard: Name


class _AddColumnWire(Struct, frozen=True, array_like=True, tag="a"):
    table: Name
    shard: Name
    column: Name
    column_type: ColumnType


class _MembersWire(Struct, frozen=True, array_like=True, tag="m"):
    # A membership entry (core.membership): voter names, the added core and its endpoint (both
    # empty when the change adds none).
    members: Annotated[list[Name], Meta(max_length=MEMBERS_OP_MAX)]
    added: Annotated[str, Meta(max_length=NAME_CHARS_MAX)]
    endpoint: Annotated[str, Meta(max_length=ENDPOINT_CHARS_MAX)]

    def __post_init__(self) -> None:
        if (self.added or self.endpoint) and not (_NAME.match(self.added) and _ENDPOINT.match(self.endpoint)):
            raise ValueError("members op: added must be a name and endpoint an endpoint, or both empty")


class _ClusterVersionWire(Struct, frozen=True, array_like=True, tag="v"):
    # A cluster version entry (core.versions); release 0.1.0 refuses the tag, and is never sent one.
    shard: Name
    cluster_version: Annotated[int, Meta(ge=1, le=1000)]


# Names found valid by the rule; bounded (names are at most NAME_CHARS_MAX characters).
_NAMES_CHECKED: set[str] = set()
_NAMES_CHECKED_MAX = 4096


def _names_refusal(names: Any) -> str | None:
    """None if every name in ``names`` follows the name rule; checked once per distinct name."""
    if _NAMES_CHECKED.issuperset(names):
        return None
    for name in set(names) - _NAMES_CHECKED:
        if not _NAME.match(name):
            return f"name {name[:NAME_CHARS_MAX]!r} has characters that are not allowed"
        if len(_NAMES_CHECKED) < _NAMES_CHECKED_MAX:
            _NAMES_CHECKED.add(name)
    return None


_WireOp = (
    _WriteWire
    | _DeleteWire
    | _CreateWire
    | _DropWire
    | _MembersWire
    | _CreateIndexWire
    | _DropIndexWire
    | _AddColumnWire
    | _ClusterVersionWire
)
_OPS_DECODER = msgspec.msgpack.Decoder(Annotated[list[_WireOp], Meta(max_length=OPS_MAX)], ext_hook=_refuse_ext)
_OPS_ENCODER = msgspec.msgpack.Encoder()


def decode_ops(packed: bytes) -> tuple[Op, ...]:
    """The ops of an entry's packed bytes, checked by the wire's rules and required to be their
    canonical packing (``rlog.types.pack_ops``): columns sorted and unique, smallest integer forms,
    float64, text as str. Raises ``MessageError`` naming what is wrong."""
    try:
        wire = _OPS_DECODER.decode(packed)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise body_error("ops", error) from None
    except UnicodeDecodeError:
        raise MessageError("ops", NOT_UTF8) from None
    except RecursionError:
        raise MessageError("ops", "are nested too deep") from None
    values: list[Any] = []
    names: set[str] = set()
    # The rows of an entry mostly share a few column lists: each distinct one is checked once
    # (sorted, which with the length check makes each column appear once) and its names go to the
    # name rule once.
    column_lists: set[tuple[str, ...]] = set()
    ops: list[Op] = []
    for op in wire:
        if type(op) is _WriteWire:
            row = dict(op.row)
            columns = tuple(row)
            # Canonical: columns sorted and each once (the digest covers this form).
            if len(columns) != len(op.row):
                raise MessageError("ops", "write op columns must be sorted and unique")
            if columns not in column_lists:
                if list(columns) != sorted(columns):
                    raise MessageError("ops", "write op columns must be sorted and unique")
                column_lists.add(columns)
                names.update(columns)
            names.add(op.table)
            values.extend(row.values())
            ops.append(WriteOp(op.table, row))
        elif type(op) is _DeleteWire:
            names.add(op.table)
            values.append(op.key)
            ops.append(DeleteOp(op.table, op.key))
        elif type(op) is _CreateWire:
            ops.append(CreateTableOp(op.table, op.shard, op.key, tuple(op.columns)))
        elif type(op) is _DropWire:
            ops.append(DropTableOp(op.table, op.shard))
        elif type(op) is _MembersWire:
            ops.append(MembersOp(tuple(op.members), op.added, op.endpoint))
        elif type(op) is _CreateIndexWire:
            ops.append(CreateIndexOp(op.index, op.table, op.shard, tuple(op.columns)))
        elif type(op) is _DropIndexWire:
            ops.append(DropIndexOp(op.index, op.table, op.shard))
        elif type(op) is _ClusterVersionWire:
            ops.append(ClusterVersionOp(op.shard, op.cluster_version))
        else:
            ops.append(AddColumnOp(op.table, op.shard, op.column, op.column_type))
    refusal = _names_refusal(names)
    if refusal is not None:
        raise MessageError("ops", refusal)
    refusal = scalars_refusal(values)
    if refusal is not None:
        raise MessageError("ops", refusal)
    # Packing the decoded values again (at C speed) shows the bytes used the canonical forms.
    if _OPS_ENCODER.encode(wire) != packed:
        raise MessageError("ops", "entry ops are not in canonical form")
    decoded = tuple(ops)
    remember_packed(decoded, packed)
    return decoded


def decode_entry(value: WireEntry) -> Entry:
    """The ``Entry`` of a checked ``WireEntry``, its packed ops decoded (``decode_ops``).

    Deferred from the message check so that a push a replicant refuses anyway (a superseded agent's)
    costs no per-row work. Raises ``MessageError`` naming what is wrong.
    """
    return Entry(value.shard, value.tx_key, value.prev, value.digest, decode_ops(value.ops), value.request_id)


def decode_entries(values: list[WireEntry]) -> tuple[Entry, ...]:
    return tuple(decode_entry(value) for value in values)


def wire_entry(value: Any) -> WireEntry:
    """A ``WireEntry`` of a plain list (``entry_to_wire``), checked; raises ``MessageError``."""
    try:
        return msgspec.convert(value, WireEntry)
    except msgspec.ValidationError as error:
        raise body_error("entry", error) from None


def check_name(value: Any) -> bool:
    """Whether ``value`` is a name by the wire's one rule."""
    return type(value) is str and 0 < len(value) <= NAME_CHARS_MAX and _NAME.match(value) is not None


def check_endpoint(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= ENDPOINT_CHARS_MAX and _ENDPOINT.match(value) is not None


def typed_body(kind: str, fields: dict[str, Any]) -> Body:
    """``kind``'s body from a plain dict of its wire fields, checked as a received one would be
    (for in-process callers and tests that build requests by hand)."""
    return decode_body(kind, _OPS_ENCODER.encode(fields))


# -- answers: the result of a request as the node that asked reads it -------------------------------
# A reply's ``result`` is untrusted like any frame. A node that reads another's answer converts it to
# the answer's type (``answer_as``): bounded, typed, None when malformed. Unknown fields are allowed:
# a newer release may add some, and an older one must still read what it knows.


class Answer(Struct, frozen=True, kw_only=True):
    """The result of a request, read by the node that asked."""


class ReadIndexAnswer(Answer, frozen=True, kw_only=True):
    committed: TxKey  # the shard's committed key, confirmed by its sequencer's quorum


class WatchAnswer(Answer, frozen=True, kw_only=True):
    agent: Annotated[str, Meta(min_length=1, max_length=AGENT_ID_CHARS_MAX, pattern=NAME_PATTERN)]
    mode: Literal["resume", "bootstrap"]
    start: TxKey
    start_digest: DigestOrEmpty
    watch_id: Annotated[str, Meta(max_length=64)] = ""


class JournalShardAnswer(Answer, frozen=True, kw_only=True):
    committed: TxKey
    hears_sequencer: bool
    agents: Annotated[int, Meta(ge=0, lt=AGENTS_COUNT_MAX)]
    # the shard's cluster version (rlog.versions; absent from release 0.1.0's answers: version 1)
    cluster_version: Any = None


class BatchAnswer(Answer, frozen=True, kw_only=True):
    """A ``bootstrap_batch`` answer (``bootstrap.serve``): rows in key order, whether the table is done."""

    rows: Annotated[list[dict[str, Any]], Meta(max_length=1_000_000)]
    done: bool
    rows_total: NonNegative | None = None


def answer_as(result: Any, answer_type: type[Any]) -> Any:
    """``result`` as ``answer_type``, or None if it does not fit (never raises on untrusted input)."""
    try:
        return msgspec.convert(result, answer_type)
    except (msgspec.ValidationError, RecursionError):
        return None
