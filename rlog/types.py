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
from typing import Annotated, Any, NamedTuple

import msgpack
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


# The two per-row op kinds are frozen msgspec Structs, not dataclasses: a replicant builds one per
# row it applies, and a frozen dataclass's __init__ (0.8 us) cost more than SQLite's upsert of the
# row; a Struct is built in C (0.1 us). Same fields, equality and immutability.
class WriteOp(Struct, frozen=True, gc=False):
    """The full row of ``table`` after the transaction (all declared columns)."""

    table: str
    row: dict[str, Any]


class DeleteOp(Struct, frozen=True, gc=False):
    """``key`` of ``table`` no longer exists after the transaction."""

    table: str
    key: Any


@dataclass(frozen=True)
class CreateTableOp:
    """A table definition; ``columns`` is ``((name, type), ...)`` in declared order."""

    table: str
    shard: str
    key_column: str
    columns: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MembersOp:
    """The shard's core membership from this entry on (``core.membership``): sorted voter names.

    ``added`` and ``endpoint`` name the core this change adds and where it listens (empty when the
    change removes one or only records the membership, as a forced start does), so that every core
    learns a new peer's endpoint from the log. Applying it changes no table.
    """

    members: tuple[str, ...]
    added: str = ""
    endpoint: str = ""


@dataclass(frozen=True)
class DropTableOp:
    """``table`` of ``shard`` and its rows no longer exist after the transaction."""

    table: str
    shard: str


@dataclass(frozen=True)
class CreateIndexOp:
    """Secondary index ``index`` of ``table`` (of ``shard``) over ``columns``, in that order, exists."""

    index: str
    table: str
    shard: str
    columns: tuple[str, ...]


@dataclass(frozen=True)
class DropIndexOp:
    """Secondary index ``index`` of ``table`` (of ``shard``) no longer exists."""

    index: str
    table: str
    shard: str


@dataclass(frozen=True)
class AddColumnOp:
    """``table`` (of ``shard``) has the nullable column ``column`` of ``column_type`` from now on;
    rows written before hold null there."""

    table: str
    shard: str
    column: str
    column_type: str


@dataclass(frozen=True)
class ClusterVersionOp:
    """The cores of ``shard`` speak ``cluster_version`` from this entry on (``core.versions``): every
    member announced it. Applying it changes no table; it records the version and moves the data
    directory's storage format with it (``rlog.versions``). Release 0.1.0 cannot decode it, so it is
    only ever appended once no 0.1.0 core is a member."""

    shard: str
    cluster_version: int


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


@dataclass(frozen=True)
class Entry:
    """One rlog record."""

    shard: str
    tx_key: TxKey
    prev: TxKey
    digest: bytes
    ops: tuple[Op, ...]
    request_id: str | None = None


def encode_op(op: Op) -> list[Any]:
    """Canonical, self-describing list form of an op (used on the wire, on disk and in digests)."""
    if isinstance(op, WriteOp):
        # Pairs as tuples: msgpack writes a tuple as the same array as a list, and sorting the
        # items (names are unique, so values are never compared) is the cheapest canonical order.
        return ["w", op.table, sorted(op.row.items())]
    if isinstance(op, DeleteOp):
        return ["d", op.table, op.key]
    if isinstance(op, CreateTableOp):
        return ["c", op.table, op.shard, op.key_column, [list(c) for c in op.columns]]
    if isinstance(op, MembersOp):
        return ["m", list(op.members), op.added, op.endpoint]
    if isinstance(op, DropTableOp):
        return ["x", op.table, op.shard]
    if isinstance(op, CreateIndexOp):
        return ["i", op.index, op.table, op.shard, list(op.columns)]
    if isinstance(op, DropIndexOp):
        return ["j", op.index, op.table, op.shard]
    if isinstance(op, AddColumnOp):
        return ["a", op.table, op.shard, op.column, op.column_type]
    if isinstance(op, ClusterVersionOp):
        return ["v", op.shard, op.cluster_version]
    raise TypeError(f"not an op: {op!r}")


class OpDecodeError(ValueError):
    """An encoded op does not have the shape ``encode_op`` produces."""


def decode_op(value: Any) -> Op:
    """Inverse of ``encode_op``; raises ``OpDecodeError`` on anything else."""
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise OpDecodeError("op must be a non-empty list starting with its kind")
    kind = value[0]
    if kind == "w" and len(value) == 3 and isinstance(value[1], str) and isinstance(value[2], list):
        pairs = value[2]
        previous = None
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                raise OpDecodeError("write op row must be a list of [column, value] pairs")
            # Canonical form (encode_op): columns sorted, each once; the digest is over that form.
            if previous is not None and not previous < pair[0]:
                raise OpDecodeError("write op columns must be sorted and unique")
            previous = pair[0]
        return WriteOp(value[1], dict(pairs))
    if kind == "d" and len(value) == 3 and isinstance(value[1], str):
        return DeleteOp(value[1], value[2])
    if kind == "c" and len(value) == 5 and all(isinstance(v, str) for v in value[1:4]) and isinstance(value[4], list):
        columns = []
        for column in value[4]:
            if not isinstance(column, list) or len(column) != 2 or not all(isinstance(c, str) for c in column):
                raise OpDecodeError("create op columns must be [name, type] pairs")
            columns.append((column[0], column[1]))
        return CreateTableOp(value[1], value[2], value[3], tuple(columns))
    if (
        kind == "m"
        and len(value) == 4
        and isinstance(value[1], list)
        and all(isinstance(name, str) for name in value[1])
        and isinstance(value[2], str)
        and isinstance(value[3], str)
    ):
        return MembersOp(tuple(value[1]), value[2], value[3])
    if kind == "x" and len(value) == 3 and isinstance(value[1], str) and isinstance(value[2], str):
        return DropTableOp(value[1], value[2])
    if (
        kind == "i"
        and len(value) == 5
        and all(isinstance(v, str) for v in value[1:4])
        and isinstance(value[4], list)
        and all(isinstance(column, str) for column in value[4])
    ):
        return CreateIndexOp(value[1], value[2], value[3], tuple(value[4]))
    if kind == "j" and len(value) == 4 and all(isinstance(v, str) for v in value[1:]):
        return DropIndexOp(value[1], value[2], value[3])
    if kind == "a" and len(value) == 5 and all(isinstance(v, str) for v in value[1:]):
        return AddColumnOp(value[1], value[2], value[3], value[4])
    if kind == "v" and len(value) == 3 and isinstance(value[1], str) and type(value[2]) is int and value[2] > 0:
        return ClusterVersionOp(value[1], value[2])
    raise OpDecodeError(f"malformed op of kind {kind!r}")


# The last ops packed, by identity: an entry's ops are packed for its digest and again when it is
# logged (a replicant checks the digest in its state machine, then its store logs the entry), and
# for large entries packing was the largest cost of applying them. A memo of a pure function:
# each item holds its ops tuple, so an id is never reused while it is cached. Bounded in items and
# bytes; only tuples (immutable) are cached.
_PACKED_OPS: dict[int, tuple[tuple[Op, ...], bytes]] = {}
_PACKED_OPS_ITEMS_MAX = 512
_PACKED_OPS_BYTES_MAX = 32 * 1024 * 1024
_packed_ops_bytes = 0
_packed_ops_lock = threading.Lock()


def pack_ops(ops: tuple[Op, ...] | list[Op]) -> bytes:
    cached = _PACKED_OPS.get(id(ops))
    if cached is not None and cached[0] is ops:
        return cached[1]
    packed = msgpack.packb([encode_op(op) for op in ops], use_bin_type=True)
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
    """The ops of a stored ``pack_ops`` blob, decoded."""
    return tuple(decode_op(v) for v in unpack_wire_ops(blob))


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
    hasher.update(msgpack.packb([shard, list(tx_key), list(prev), request_id], use_bin_type=True)[1:])
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


def entry_to_wire(entry: Entry) -> list[Any]:
    """``[shard, tx_key, prev, digest, packed_ops, request_id]``.

    The ops travel as ``pack_ops`` bytes, the very bytes the digest covers and the log stores: a
    sender packs them once (a sequencer already did, for the digest; an agent pushes the stored
    bytes), and a receiver checks the digest over the bytes it got, decodes them once, and logs
    them without packing again. ``entry_from_wire`` refuses bytes that are not the canonical
    packing of the ops they hold, so a digest over them always is the digest of those ops.
    """
    return [entry.shard, list(entry.tx_key), list(entry.prev), entry.digest, pack_ops(entry.ops), entry.request_id]


def _no_ext(code: int, data: bytes) -> Any:
    raise OpDecodeError(f"msgpack extension type {code} is not allowed in ops")


def unpack_wire_ops(packed: Any) -> list[Any]:
    """The ops of a wire entry unpacked (plain msgpack values, lists for arrays); nothing else decoded.

    Raises ``OpDecodeError`` on anything but bytes holding one msgpack array without extension types.
    """
    if not isinstance(packed, bytes):
        raise OpDecodeError("entry ops must be packed bytes")
    try:
        value = msgpack.unpackb(packed, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
    except OpDecodeError:
        raise
    except Exception as error:  # msgpack raises many types for garbage; all mean the same here.
        raise OpDecodeError(f"entry ops are not msgpack: {type(error).__name__}") from None
    if not isinstance(value, list):
        raise OpDecodeError("entry ops must be a list")
    return value


def entry_from_unpacked(value: Any, ops: list[Any], decoded: tuple[Op, ...] | None = None) -> Entry:
    """The entry of wire form ``value`` whose ops ``unpack_wire_ops`` gave as ``ops``; ``decoded``:
    the caller's ``decode_op`` of each of them, if it made them already (``rlog.messages``).

    Raises ``OpDecodeError`` on any malformation, and when the packed bytes are not the canonical
    packing of the ops (``pack_ops`` of the decoded ops would differ): the digest is over them.
    """
    if not isinstance(value, list) or len(value) != 6:
        raise OpDecodeError("entry must be a list of 6 fields")
    shard, key, prev, digest, packed, request_id = value
    if not isinstance(shard, str) or not isinstance(digest, bytes) or not isinstance(packed, bytes):
        raise OpDecodeError("entry fields have wrong types")
    if request_id is not None and not isinstance(request_id, str):
        raise OpDecodeError("entry request id must be a string or nil")
    if decoded is None:
        decoded = tuple(decode_op(o) for o in ops)
    # decode_op checked the shapes and the column order; packing the plain values again (at C speed)
    # shows the bytes used the canonical msgpack forms (smallest ints, str for text, float64...).
    if msgpack.packb(ops, use_bin_type=True) != packed:
        raise OpDecodeError("entry ops are not in canonical form")
    remember_packed(decoded, packed)
    return Entry(shard, tx_key_from_wire(key), tx_key_from_wire(prev), digest, decoded, request_id)


def entry_from_wire(value: Any) -> Entry:
    """Decode an entry (``entry_to_wire`` form); raises ``OpDecodeError`` on any malformation.

    Shapes only: a receiver runs the typed layer's checks first (``rlog.messages.decode_entry``)."""
    if not isinstance(value, list) or len(value) != 6:
        raise OpDecodeError("entry must be a list of 6 fields")
    return entry_from_unpacked(value, unpack_wire_ops(value[4]))


def tx_key_from_wire(value: Any) -> TxKey:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        # Never format the value itself: a hostile one may be nested too deep for repr.
        got = type(value).__name__
        raise OpDecodeError(f"tx key must be [generation, counter] of non-negative integers, got {got}")
    return TxKey(value[0], value[1])


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
