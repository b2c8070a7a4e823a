"""The rlog vocabulary: tx keys, ops, entries and the rolling digest.

Theory of operation
-------------------
An *entry* is one committed transaction of one shard. Its ops are results, not
commands: a ``WriteOp`` carries the full row as it is after the transaction, a
``DeleteOp`` the key that no longer exists, a ``CreateTableOp`` the full table
definition, a ``DropTableOp`` the table (of its shard) that no longer exists, a
``MembersOp`` the shard's core membership from then on (no table changes), a
``CreateIndexOp``/``DropIndexOp`` a secondary index that exists (or no longer exists)
from then on, an ``AddColumnOp`` a nullable column the table has from then on.
Replaying an entry therefore needs no access to earlier state, which is what lets
a replica heal a dirty-read copy by replay (DESIGN, bootstrap).

Entries are chained: every entry names the tx key of its predecessor (``prev``)
and carries ``digest(n) = BLAKE2b(digest(n-1) + canonical(entry n))``. Two nodes
with the same digest at the same tx key have applied identical histories.

``canonical`` is msgpack over plain lists with row columns sorted by name, so the
bytes do not depend on dict ordering or on the Python process.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple, Union

import msgspec
from msgspec import Meta, Struct

DIGEST_BYTES = 32
GENESIS_DIGEST = bytes(DIGEST_BYTES)


# A tx key's parts: generations and counters stay below 2**63 (SQLite's INTEGER). The bounds are
# declared here so that the wire schema (``rlog.messages``) decodes a tx key straight into ``TxKey``.
TxKeyPart = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class TxKey(NamedTuple):
    """Position of a transaction in its shard's rlog, ordered as a tuple."""

    generation: TxKeyPart
    counter: TxKeyPart

    def to_wire(self) -> list[int]:
        return [self.generation, self.counter]

    def __str__(self) -> str:
        return f"({self.generation}, {self.counter})"


ZERO_KEY = TxKey(0, 0)

Scalar = None | int | float | str | bytes


# A replicant builds a WriteOp per row it applies: a Struct is built in C (0.1 us; a frozen
# dataclass's __init__ cost 0.8 us, more than SQLite's upsert of the row).
class WriteOp(Struct, frozen=True, gc=False):
    """The full row of ``table`` after the transaction (all declared columns)."""

    table: str
    row: dict[str, Any]


# -- the op codec: an op is packed as the msgpack array [tag, field...] (on the wire, in the log, in digests);
# the op types are those arrays (tagged array_like Structs declaring the wire's bounds); a WriteOp packs as a WriteRow.
NAME_CHARS_MAX = 64  # tables, columns, shards, nodes
NAME_PATTERN = r"^[A-Za-z0-9_.\-]+\Z"  # the one name rule of the wire (rlog.schema is stricter for SQLite)
ENDPOINT_CHARS_MAX = 255
# tcp://host:port (a host name, IPv4 or bracketed IPv6 address); ipc:// for tests.
ENDPOINT_PATTERN = r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}|ipc://[A-Za-z0-9_./\-]+)\Z"
OPS_MAX = 100_000  # ops in one entry or transaction on the wire
COLUMNS_MAX, INDEX_COLUMNS_MAX, ROW_COLUMNS_MAX = 200, 16, 1000
MEMBERS_OP_MAX = 15  # core.membership.MEMBERS_MAX (rlog imports nothing of core; a test keeps them equal)
Name = Annotated[str, Meta(min_length=1, max_length=NAME_CHARS_MAX, pattern=NAME_PATTERN)]
# A row's names: their pattern is checked once per distinct name (a regex per column cost more than the decode).
RowName = Annotated[str, Meta(min_length=1, max_length=NAME_CHARS_MAX)]
ColumnType = Annotated[str, Meta(min_length=1, max_length=16)]
Column = tuple[Name, ColumnType]


class _Op(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    pass


class WriteRow(_Op, frozen=True, tag="w", gc=False):
    """A ``WriteOp`` as packed: its row as ``[column, value]`` pairs, columns sorted and unique."""

    table: RowName
    row: Annotated[list[tuple[RowName, Any]], Meta(max_length=ROW_COLUMNS_MAX)]


# -- the other ops ---------------------------------------------------------------------------------


class DeleteOp(_Op, frozen=True, tag="d", gc=False):
    """``key`` of ``table`` no longer exists after the transaction."""

    table: RowName
    key: Any


class CreateTableOp(_Op, frozen=True, tag="c"):
    """A table definition; ``columns`` is ``((name, type), ...)`` in declared order."""

    table: Name
    shard: Name
    key_column: Name
    columns: Annotated[tuple[Column, ...], Meta(max_length=COLUMNS_MAX)]


class DropTableOp(_Op, frozen=True, tag="x"):
    """``table`` of ``shard`` and its rows no longer exist after the transaction."""

    table: Name
    shard: Name


class MembersOp(_Op, frozen=True, tag="m"):
    """The shard's core membership from this entry on (``core.membership``): sorted voter names.

    ``added`` and ``endpoint`` name the core this change adds and where it listens (empty when it
    adds none), so that every core learns a new peer's endpoint from the log. Changes no table.
    """

    members: Annotated[tuple[Name, ...], Meta(max_length=MEMBERS_OP_MAX)]
    added: Annotated[str, Meta(max_length=NAME_CHARS_MAX, pattern=r"^[A-Za-z0-9_.\-]*\Z")] = ""  # a name, or empty
    endpoint: Annotated[str, Meta(max_length=ENDPOINT_CHARS_MAX, pattern=f"^\\Z|{ENDPOINT_PATTERN}")] = ""


class CreateIndexOp(_Op, frozen=True, tag="i"):
    """Secondary index ``index`` of ``table`` (of ``shard``) over ``columns``, in that order, exists."""

    index: Name
    table: Name
    shard: Name
    columns: Annotated[tuple[Name, ...], Meta(min_length=1, max_length=INDEX_COLUMNS_MAX)]


class DropIndexOp(_Op, frozen=True, tag="j"):
    """Secondary index ``index`` of ``table`` (of ``shard``) no longer exists."""

    index: Name
    table: Name
    shard: Name


class AddColumnOp(_Op, frozen=True, tag="a"):
    """``table`` (of ``shard``) has the nullable column ``column`` from now on (older rows: null)."""

    table: Name
    shard: Name
    column: Name
    column_type: ColumnType


class ClusterVersionOp(_Op, frozen=True, tag="v"):
    """The cores of ``shard`` speak ``cluster_version`` from this entry on (``core.versions``): every
    member announced it. Changes no table; moves the storage format with it (``rlog.versions``).
    Release 0.1.0 cannot decode it, so it is appended only once no 0.1.0 core is a member."""

    shard: Name
    cluster_version: Annotated[int, Meta(ge=1, le=1000)]


Op = (
    WriteOp
    | DeleteOp
    | CreateTableOp
    | DropTableOp
    | MembersOp
    | CreateIndexOp
    | DropIndexOp
    | AddColumnOp
    | ClusterVersionOp
)
SCHEMA_OPS = (CreateTableOp, DropTableOp, CreateIndexOp, DropIndexOp, AddColumnOp)


@dataclass(frozen=True, slots=True)  # slots: built once per write on every core, its fields read many times
class Entry:
    """One rlog record."""

    shard: str
    tx_key: TxKey
    prev: TxKey
    digest: bytes
    ops: tuple[Op, ...]
    request_id: str | None = None


class OpDecodeError(ValueError):
    """Encoded ops that are not what ``pack_ops`` makes."""


WireOp = Union[(WriteRow, DeleteOp, MembersOp, ClusterVersionOp, *SCHEMA_OPS)]  # noqa: UP007 (the ops as packed)
_ENCODER, _UNPACKER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[WireOp])


def _packable(op: Op) -> Any:
    # Pairs as tuples (the same msgpack array); sorting the items is the cheapest canonical order.
    return ("w", op.table, sorted(op.row.items())) if type(op) is WriteOp else op


def encode_op(op: Op) -> list[Any]:
    """The op's array as plain values (``pack_ops`` packs them)."""
    return list(msgspec.to_builtins(_packable(op), builtin_types=(bytes,)))


def _op(op: Any) -> Op:
    if type(op) is WriteRow:
        if len(row := dict(op.row)) != len(op.row) or list(row) != sorted(row):
            raise OpDecodeError("write op columns must be sorted and unique")
        return WriteOp(op.table, row)
    return op


def decode_op(value: Any) -> Op:
    """Inverse of ``encode_op``; raises ``OpDecodeError`` on anything else."""
    try:
        return _op(msgspec.convert(value, WireOp))
    except (msgspec.ValidationError, RecursionError) as error:
        raise OpDecodeError(f"malformed op: {str(error)[:200]}") from None


# The last ops packed, by identity (an entry's ops are packed for its digest and again when logged); each
# item holds its ops tuple (immutable), so an id is never reused while it is cached. Bounded in items and bytes.
_PACKED_OPS: dict[int, tuple[tuple[Op, ...], bytes]] = {}
_PACKED_OPS_ITEMS_MAX, _PACKED_OPS_BYTES_MAX = 512, 32 * 1024 * 1024
_packed_ops_bytes = 0
_packed_ops_lock = threading.Lock()


def pack_ops(ops: tuple[Op, ...] | list[Op]) -> bytes:
    cached = _PACKED_OPS.get(id(ops))
    if cached is not None and cached[0] is ops:
        return cached[1]
    packed = _ENCODER.encode([_packable(op) for op in ops])
    if isinstance(ops, tuple):
        remember_packed(ops, packed)
    return packed


def remember_packed(ops: tuple[Op, ...], packed: bytes) -> None:
    """Record that ``packed`` is ``pack_ops(ops)`` (the caller made sure of it)."""
    global _packed_ops_bytes
    if len(packed) > _PACKED_OPS_BYTES_MAX // 4:
        return
    with _packed_ops_lock:
        previous = _PACKED_OPS.pop(id(ops), None)
        if previous is not None:
            _packed_ops_bytes -= len(previous[1])
        _PACKED_OPS[id(ops)] = (ops, packed)
        _packed_ops_bytes += len(packed)
        while len(_PACKED_OPS) > _PACKED_OPS_ITEMS_MAX or _packed_ops_bytes > _PACKED_OPS_BYTES_MAX:
            _packed_ops_bytes -= len(_PACKED_OPS.pop(next(iter(_PACKED_OPS)))[1])


def unpack_ops(blob: bytes) -> tuple[Op, ...]:
    """The ops of a stored ``pack_ops`` blob (trusted: no wire rules; ``rlog.messages.decode_ops``)."""
    try:
        return tuple(map(_op, _UNPACKER.decode(blob)))
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise OpDecodeError(f"entry ops do not decode: {str(error)[:200]}") from None


def entry_to_wire(entry: Entry) -> list[Any]:
    """``[shard, tx_key, prev, digest, packed_ops, request_id]``: ops as the bytes the digest covers."""
    return [entry.shard, list(entry.tx_key), list(entry.prev), entry.digest, pack_ops(entry.ops), entry.request_id]


def entry_from_wire(value: Any) -> Entry:
    """The entry of an ``entry_to_wire`` list this node wrote (the store's spill); raises ``OpDecodeError``."""
    try:
        shard, key, prev, digest, packed, request_id = msgspec.convert(value, _EntryList)
    except (msgspec.ValidationError, RecursionError):
        raise OpDecodeError("entry must be [shard, tx_key, prev, digest, packed ops, request_id]") from None
    remember_packed(ops := unpack_ops(packed), packed)
    return Entry(shard, key, prev, digest, ops, request_id)


_EntryList = tuple[str, TxKey, TxKey, bytes, bytes, str | None]


def tx_key_from_wire(value: Any) -> TxKey:
    try:
        return msgspec.convert(value, TxKey)
    except (msgspec.ValidationError, RecursionError):
        raise OpDecodeError("tx key must be [generation, counter] of non-negative integers") from None


def entry_digest(
    prev_digest: bytes,
    shard: str,
    tx_key: TxKey,
    prev: TxKey,
    ops: tuple[Op, ...] | list[Op],
    request_id: str | None,
) -> bytes:
    """digest(n) = BLAKE2b(digest(n-1) + canonical(entry n)).

    canonical(entry) is the msgpack array ``[shard, tx_key, prev, request_id, ops]``, built here
    from its parts (a 5-array header, then each element packed) so that the packed ops are the
    ones ``pack_ops`` returns and remembers for the log.
    """
    hasher = hashlib.blake2b(prev_digest, digest_size=DIGEST_BYTES)
    hasher.update(_ENTRY_ARRAY_HEADER)
    # msgspec packs these (str, non-negative ints, None) as msgpack does with use_bin_type, the same
    # bytes (tests/test_types.py holds them to msgpack's), without building a Packer per entry.
    hasher.update(_ENCODER.encode((shard, tx_key, prev, request_id))[1:])
    hasher.update(pack_ops(ops))
    return hasher.digest()


# msgpack's header of a 5-element array (fixarray); the 4-array header of the first four is cut off.
_ENTRY_ARRAY_HEADER = b"\x95"


CHAIN_LINK = "link"  # the entry names another predecessor
CHAIN_ORDER = "order"  # the entry's key does not move past its predecessor's
CHAIN_DIGEST = "digest"  # the entry's digest is not digest(predecessor's digest + entry)


def chain_break(prev_key: TxKey, prev_digest: bytes, entry: Entry) -> str | None:
    """The one digest-chain check: None if ``entry`` follows the entry at ``prev_key`` whose digest
    is ``prev_digest``; else which link breaks (``CHAIN_LINK``, ``CHAIN_ORDER`` or ``CHAIN_DIGEST``).

    Everyone who takes entries from elsewhere runs it (a follower's append, a replica's push, the
    store's append, apply and ``verify_chain``), so the chain means the same thing everywhere.
    """
    if entry.prev != prev_key:
        return CHAIN_LINK
    if not entry.tx_key > prev_key:
        return CHAIN_ORDER
    expected = entry_digest(prev_digest, entry.shard, entry.tx_key, entry.prev, entry.ops, entry.request_id)
    return None if entry.digest == expected else CHAIN_DIGEST


def make_entry(
    shard: str,
    tx_key: TxKey,
    prev: TxKey,
    prev_digest: bytes,
    ops: tuple[Op, ...] | list[Op],
    request_id: str | None = None,
) -> Entry:
    """Build the entry that follows ``prev`` (whose digest is ``prev_digest``)."""
    if not tx_key > prev:
        raise ValueError(f"tx key {tx_key} does not follow {prev}")
    ops = tuple(ops)
    return Entry(shard, tx_key, prev, entry_digest(prev_digest, shard, tx_key, prev, ops, request_id), ops, request_id)


# Per-entry bytes on the wire besides the ops: shard, two keys, digest, request id and framing.
ENTRY_OVERHEAD_BYTES = 128


def _value_size_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8")) + 5
    if isinstance(value, bytes):
        return len(value) + 5
    return 9  # int, float, bool, None: at most 9 bytes in msgpack


def row_size_bytes(row: dict[str, Any]) -> int:
    """An upper estimate of a row's msgpack size (see ``entry_size_bytes``)."""
    return 8 + sum(len(name.encode()) + 8 + _value_size_bytes(value) for name, value in row.items())


def entry_size_bytes(entry: Entry) -> int:
    """An upper estimate of the entry's msgpack size, for byte limits on messages and windows.

    Walking the ops is far cheaper than encoding them, and the estimate never falls below the
    encoded size (every scalar is counted at its largest msgpack header), so a message built under
    a byte limit by this measure stays under it on the wire.
    """
    size = ENTRY_OVERHEAD_BYTES + len(entry.shard.encode()) + len((entry.request_id or "").encode())
    for op in entry.ops:
        if isinstance(op, WriteOp):
            size += 8 + len(op.table.encode()) + row_size_bytes(op.row)
        elif isinstance(op, DeleteOp):
            size += 8 + len(op.table.encode()) + _value_size_bytes(op.key)
        elif isinstance(op, ClusterVersionOp):
            size += 32 + len(op.shard.encode())
        elif isinstance(op, MembersOp):
            size += 16 + len(op.added.encode()) + len(op.endpoint.encode())
            size += sum(len(name.encode()) + 5 for name in op.members)
        elif isinstance(op, (DropTableOp, CreateIndexOp, DropIndexOp, AddColumnOp)):
            size += 64 + sum(len(part.encode()) + 5 for part in encode_op(op)[1:] if isinstance(part, str))
            size += sum(len(column.encode()) + 5 for column in getattr(op, "columns", ()))
        else:
            size += 64 + len(op.table.encode()) + len(op.shard.encode())
            size += sum(len(name.encode()) + len(kind.encode()) + 8 for name, kind in op.columns)
    return size


@dataclass(frozen=True)
class PackedEntry:
    """An rlog record as read from the store for pushing, its ops still in their stored msgpack form.

    A core's agent only forwards entries: decoding every op into a ``WriteOp`` and encoding it
    again for the wire cost it more than everything else it does (profiled under a catch-up of
    100 KB entries). The stored form is the wire form (``pack_ops`` of ``encode_op``), so the ops
    go out as they were persisted, and the size bound is exact for them.
    """

    shard: str
    tx_key: TxKey
    prev: TxKey
    digest: bytes
    packed_ops: bytes
    request_id: str | None = None

    @property
    def size_bytes(self) -> int:
        """An upper bound of the entry's size on the wire (see ``entry_size_bytes``)."""
        return (
            ENTRY_OVERHEAD_BYTES
            + len(self.shard.encode())
            + len((self.request_id or "").encode())
            + len(self.packed_ops)
        )

    def to_wire(self) -> list[Any]:
        """``entry_to_wire`` of the entry: the stored ops go out as they are."""
        return [self.shard, list(self.tx_key), list(self.prev), self.digest, self.packed_ops, self.request_id]


def wire_size_bytes(entry: Entry | PackedEntry) -> int:
    """``entry_size_bytes`` of an ``Entry``, or the packed size of a ``PackedEntry``."""
    return entry.size_bytes if isinstance(entry, PackedEntry) else entry_size_bytes(entry)


def to_wire(entry: Entry | PackedEntry) -> list[Any]:
    return entry.to_wire() if isinstance(entry, PackedEntry) else entry_to_wire(entry)


def op_to_json(op: Op) -> dict[str, Any]:
    """Readable form of an op, as ``rlog tail --json`` and clients show it."""
    if isinstance(op, WriteOp):
        return {"op": "write", "table": op.table, "row": op.row}
    if isinstance(op, DeleteOp):
        return {"op": "delete", "table": op.table, "key": op.key}
    if isinstance(op, MembersOp):
        return {"op": "members", "members": list(op.members), "added": op.added, "endpoint": op.endpoint}
    if isinstance(op, DropTableOp):
        return {"op": "drop_table", "table": op.table, "shard": op.shard}
    if isinstance(op, CreateIndexOp):
        return {
            "op": "create_index",
            "index": op.index,
            "table": op.table,
            "shard": op.shard,
            "columns": list(op.columns),
        }
    if isinstance(op, DropIndexOp):
        return {"op": "drop_index", "index": op.index, "table": op.table, "shard": op.shard}
    if isinstance(op, AddColumnOp):
        return {"op": "add_column", "table": op.table, "shard": op.shard, "column": op.column, "type": op.column_type}
    if isinstance(op, ClusterVersionOp):
        return {"op": "cluster_version", "shard": op.shard, "cluster_version": op.cluster_version}
    return {
        "op": "create_table",
        "table": op.table,
        "shard": op.shard,
        "key": op.key_column,
        "columns": [list(c) for c in op.columns],
    }


def entry_to_json(entry: Entry) -> dict[str, Any]:
    return {
        "shard": entry.shard,
        "tx_key": list(entry.tx_key),
        "prev": list(entry.prev),
        "digest": entry.digest.hex(),
        "request_id": entry.request_id,
        "ops": [op_to_json(op) for op in entry.ops],
    }
