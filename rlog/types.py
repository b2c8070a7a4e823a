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
import ipaddress
import itertools
import posixpath
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, NamedTuple, Union

import msgspec
from mnesite.rlog.limits import FRAME_BYTES_MAX_BOUNDS
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

    def __str__(self) -> str:
        return f"({self.generation}, {self.counter})"


ZERO_KEY = TxKey(0, 0)


def new_request_id() -> str:
    """A fresh request id: 12 hex digits of the wall clock in ms, then 80 random bits (32 characters).

    Ids made later sort after earlier ones, so every core's request-id index of the log takes new
    ids at its end: with random ids (uuid4) each write dirtied its own index page, about one 4 KiB
    WAL frame per write to write and checkpoint on each core. The random part keeps ids unique; a
    clock that steps back only costs that locality, never correctness (any string is a valid id).
    """
    return f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(10)}"


Scalar = None | int | float | str | bytes


# A replicant builds a WriteOp per row it applies: a Struct is built in C (0.1 us; a frozen
# dataclass's __init__ cost 0.8 us, more than SQLite's upsert of the row).
class WriteOp(Struct, frozen=True, gc=False):
    """The full row of ``table`` after the transaction (all declared columns)."""

    table: str
    row: dict[str, Any]


WAIT_MS_MAX = 600_000  # the longest a node holds a read for its key (a client asks at most this)
# A replicant's [limits] frame_bytes_max, told in its watch (rlog.messages) so that its core's agent pushes
# within it (core.agent, "Frame limit"); sent with replication protocol 2 only, since release 0.1.0 refuses
# a field it does not know (rlog.versions.watch_tells_frame_bytes_max). None: not told.
FrameBytes = Annotated[int, Meta(ge=FRAME_BYTES_MAX_BOUNDS[0], le=FRAME_BYTES_MAX_BOUNDS[1])] | None

# --- op codec ---
# An op is packed as the msgpack array [tag, field...] (on the wire, in the log, in digests): the op types
# are those arrays (tagged array_like Structs declaring the wire's bounds); a WriteOp packs as a WriteRow.
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


# --- end op codec ---
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


class WriteRows(_Op, frozen=True, tag="r", gc=False):
    """Full rows of ``table``, each a tuple in ``columns`` order (sorted and unique). On the wire and in the
    log from cluster version 2 on, an entry of two or more writes of one table with the same columns and
    nothing else (a bulk write): the column names packed once, not per row (``pack_ops`` with ``runs``).
    A replicant keeps it as decoded (``decode_ops`` with ``runs``): one ``executemany`` binds the tuples,
    without a dict and a ``WriteOp`` per row; everyone else reads a ``WriteOp`` a row."""

    table: RowName
    columns: Annotated[tuple[RowName, ...], Meta(min_length=1, max_length=ROW_COLUMNS_MAX)]
    rows: Annotated[list[tuple[Any, ...]], Meta(min_length=2, max_length=OPS_MAX)]

    def writes(self) -> tuple[WriteOp, ...]:
        """The run as the writes it packs, a ``WriteOp`` a row (each row a value a column: checked when received)."""
        repeat = itertools.repeat
        return tuple(map(WriteOp, repeat(self.table), map(dict, map(zip, repeat(self.columns), self.rows))))


Op = (
    WriteOp
    | WriteRows
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
# The ops that only change rows: an entry of nothing else (``ROW_OPS.issuperset(map(type, entry.ops))``, one
# C loop) records no membership, cluster version or schema change, which spares the per-op scans for those.
ROW_OPS = frozenset((WriteOp, WriteRows, DeleteOp))


class Entry(Struct, frozen=True, gc=False):
    """One rlog record. ``packed`` is its ops' canonical packing (``pack_ops``): what the digest
    covers, the log stores and the wire carries, made once (by ``make_entry``, or received and
    checked by ``rlog.messages.decode_ops``, or read from the log) and never again. A Struct is
    built in C: every core builds one per write, a follower one per received entry."""

    shard: str
    tx_key: TxKey
    prev: TxKey
    digest: bytes
    ops: tuple[Op, ...]
    request_id: str | None = None
    packed: bytes = b""

    def __post_init__(self) -> None:
        if not self.packed:  # built from its ops alone (tests, tools): pack them
            msgspec.structs.force_setattr(self, "packed", pack_ops(self.ops))

    @property
    def size_bytes(self) -> int:
        """The entry's size on the wire, bounded above (``ENTRY_OVERHEAD_BYTES`` for all but the ops)."""
        request_id_bytes = len(self.request_id.encode()) if self.request_id else 0
        return ENTRY_OVERHEAD_BYTES + len(self.shard.encode()) + request_id_bytes + len(self.packed)

    # --- op codec ---
    def to_wire(self) -> list[Any]:
        """``[shard, tx_key, prev, digest, packed_ops, request_id]``: ops as the bytes the digest covers."""
        return [self.shard, list(self.tx_key), list(self.prev), self.digest, self.packed, self.request_id]

    # --- end op codec ---


# --- op codec ---
class OpDecodeError(ValueError):
    """Encoded ops that are not what ``pack_ops`` makes."""


WireOp = Union[(WriteRow, WriteRows, DeleteOp, MembersOp, ClusterVersionOp, *SCHEMA_OPS)]  # noqa: UP007 (the ops as packed)
_ENCODER, _UNPACKER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[WireOp])


def _decoded(decode: Any, value: Any, refusal: str) -> Any:
    """``decode(value)``, or ``OpDecodeError(refusal)`` (its ``{}``: why msgspec refused)."""
    try:
        return decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise OpDecodeError(refusal.format(str(error)[:200])) from None


def _packable(op: Op) -> Any:
    # Pairs as tuples (the same msgpack array); sorting the items is the cheapest canonical order.
    return ("w", op.table, sorted(op.row.items())) if type(op) is WriteOp else op


def _op(op: Any) -> Op:
    if type(op) is WriteRow:
        if len(row := dict(op.row)) != len(op.row) or list(row) != sorted(row):
            raise OpDecodeError("write op columns must be sorted and unique")
        return WriteOp(op.table, row)
    return op


def decode_op(value: Any) -> Op:
    """An op from its packed array as plain values; raises ``OpDecodeError`` on anything else."""
    return _op(_decoded(lambda v: msgspec.convert(v, WireOp), value, "malformed op: {}"))


def pack_ops(ops: tuple[Op, ...] | list[Op], runs: bool = False) -> bytes:
    """``runs`` (cluster version 2, ``rlog.versions.packs_runs``): a bulk write packs as one ``WriteRows``."""
    if runs and len(ops) > 1 and {*map(type, ops)} == {WriteOp} and len({op.table for op in ops}) == 1:
        rows, columns = [op.row for op in ops], tuple(sorted(ops[0].row))
        if {*map(len, rows)} == {len(columns)} and set().union(*rows) == {*columns}:  # each row has these columns
            by_row = zip(*[[row[column] for row in rows] for column in columns], strict=True)
            return _ENCODER.encode([WriteRows(ops[0].table, columns, [*by_row])])
    return _ENCODER.encode([_packable(op) for op in ops])


def unpack_ops(blob: bytes) -> tuple[Op, ...]:
    """A stored ``pack_ops`` blob's ops, a ``WriteRows`` as a ``WriteOp`` a row (trusted: checked when received)."""
    ops = _decoded(_UNPACKER.decode, blob, "entry ops do not decode: {}")
    return ops[0].writes() if len(ops) == 1 and type(ops[0]) is WriteRows else tuple(map(_op, ops))


def entry_from_wire(value: Any) -> Entry:
    """The entry of an ``Entry.to_wire`` list this node wrote (the store's spill); raises ``OpDecodeError``."""
    refusal = "entry must be [shard, tx_key, prev, digest, packed ops, request_id]"
    shard, key, prev, digest, packed, request_id = _decoded(lambda v: msgspec.convert(v, _EntryList), value, refusal)
    return Entry(shard, key, prev, digest, unpack_ops(packed), request_id, packed)


_EntryList = tuple[str, TxKey, TxKey, bytes, bytes, str | None]


def tx_key_from_wire(value: Any) -> TxKey:
    refusal = "tx key must be [generation, counter] of non-negative integers"
    return _decoded(lambda v: msgspec.convert(v, TxKey), value, refusal)


# --- end op codec ---


def entry_digest(
    prev_digest: bytes,
    shard: str,
    tx_key: TxKey,
    prev: TxKey,
    packed_ops: bytes,
    request_id: str | None,
) -> bytes:
    """digest(n) = BLAKE2b(digest(n-1) + canonical(entry n)).

    canonical(entry) is the msgpack array ``[shard, tx_key, prev, request_id, ops]``, built here
    from its parts (a 5-array header, then each element packed) so that the ops are hashed as the
    bytes the entry carries (``pack_ops``, ``Entry.packed``), not packed again.
    """
    # msgspec packs these (str, non-negative ints, None) as msgpack does with use_bin_type, the same
    # bytes (tests/test_types.py holds them to msgpack's), without building a Packer per entry. One
    # call hashes the concatenation: the same bytes as updating part by part, in one C call.
    header = _ENCODER.encode((shard, tx_key, prev, request_id))[1:]
    return hashlib.blake2b(
        b"".join((prev_digest, _ENTRY_ARRAY_HEADER, header, packed_ops)), digest_size=DIGEST_BYTES
    ).digest()


# msgpack's header of a 5-element array (fixarray); the 4-array header of the first four is cut off.
_ENTRY_ARRAY_HEADER = b"\x95"


CHAIN_LINK = "link"  # the entry names another predecessor
CHAIN_ORDER = "order"  # the entry's key does not move past its predecessor's
CHAIN_DIGEST = "digest"  # the entry's digest is not digest(predecessor's digest + entry)


def next_key(prev_key: TxKey, generation: int) -> TxKey | None:
    """The key the entry after ``prev_key`` has when written by the sequencer of ``generation``: the
    next counter of the same generation, or counter 1 of a later one (``core.consensus``); None for an
    older generation. So a log's counters are consecutive within each generation, which lets the
    store count a generation's entries from its first and last key (``Store._newest_key_at``)."""
    if generation == prev_key.generation:
        return TxKey(generation, prev_key.counter + 1)
    return TxKey(generation, 1) if generation > prev_key.generation else None


def read_targets(
    shards: Iterable[str], min_key: TxKey | None, min_keys: Mapping[str, TxKey] | None
) -> dict[str, TxKey]:
    """Read-your-writes: the key each of ``shards`` must have applied before a read of it is answered.

    A tx key orders one shard's log only, so a client names its last write's key per shard
    (``min_keys``): a read of another shard must not wait for it (that shard's log may never reach
    it, and the read would time out). ``min_key`` is a key the client gave for every shard the read
    reads (``after_tx_key`` / ``--after``). A shard gets the later of the two; a shard with neither is
    absent (nothing to wait for). The rule of cores and replicants alike."""
    targets: dict[str, TxKey] = {}
    for shard in shards:
        own = min_keys.get(shard) if min_keys else None
        key = own if min_key is None else (min_key if own is None else max(min_key, own))
        if key is not None:
            targets[shard] = key
    return targets


def chain_break(prev_key: TxKey, prev_digest: bytes, entry: Entry) -> str | None:
    """The one digest-chain check: None if ``entry`` follows the entry at ``prev_key`` whose digest
    is ``prev_digest``; else which link breaks (``CHAIN_LINK``, ``CHAIN_ORDER`` or ``CHAIN_DIGEST``).

    Everyone who takes entries from elsewhere runs it (a follower's append, a replica's push, the
    store's append, apply and ``verify_chain``), so the chain means the same thing everywhere.
    """
    if entry.prev != prev_key:
        return CHAIN_LINK
    if entry.tx_key != next_key(prev_key, entry.tx_key.generation):
        return CHAIN_ORDER
    expected = entry_digest(prev_digest, entry.shard, entry.tx_key, entry.prev, entry.packed, entry.request_id)
    return None if entry.digest == expected else CHAIN_DIGEST


def make_entry(
    shard: str,
    tx_key: TxKey,
    prev: TxKey,
    prev_digest: bytes,
    ops: tuple[Op, ...] | list[Op],
    request_id: str | None = None,
    runs: bool = False,
) -> Entry:
    """Build the entry that follows ``prev`` (whose digest is ``prev_digest``); ``runs``: as ``pack_ops``."""
    if not tx_key > prev:
        raise ValueError(f"tx key {tx_key} does not follow {prev}")
    packed = pack_ops(ops, runs)
    digest = entry_digest(prev_digest, shard, tx_key, prev, packed, request_id)
    return Entry(shard, tx_key, prev, digest, tuple(ops), request_id, packed)


# Per-entry bytes on the wire besides the ops: shard, two keys, digest, request id and framing.
ENTRY_OVERHEAD_BYTES = 128


def _value_size_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8")) + 5
    if isinstance(value, bytes):
        return len(value) + 5
    return 9  # int, float, bool, None: at most 9 bytes in msgpack


def row_size_bytes(row: dict[str, Any]) -> int:
    """An upper estimate of a row's msgpack size (every scalar counted at its largest msgpack header)."""
    return 8 + sum(len(name.encode()) + 8 + _value_size_bytes(value) for name, value in row.items())


class PackedEntry(Struct, frozen=True, gc=False):
    """An rlog record as read from the store for pushing, its ops still in their stored msgpack form.

    A core's agent only forwards entries: decoding every op into a ``WriteOp`` and encoding it
    again for the wire cost it more than everything else it does (profiled under a catch-up of
    100 KB entries). The stored form is the wire form (``pack_ops``), so the ops go out as they
    were persisted: an ``Entry`` without its decoded ops, with the same size and wire form.
    """

    shard: str
    tx_key: TxKey
    prev: TxKey
    digest: bytes
    packed: bytes
    request_id: str | None = None

    size_bytes = Entry.size_bytes
    to_wire = Entry.to_wire


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
    if isinstance(op, CreateTableOp):
        return {
            "op": "create_table",
            "table": op.table,
            "shard": op.shard,
            "key": op.key_column,
            "columns": [list(c) for c in op.columns],
        }
    # A WriteRows lives only in a replicant's apply; what clients see is read back from the log.
    raise TypeError(f"{type(op).__name__} has no client form")


def entry_to_json(entry: Entry) -> dict[str, Any]:
    return {
        "shard": entry.shard,
        "tx_key": list(entry.tx_key),
        "prev": list(entry.prev),
        "digest": entry.digest.hex(),
        "request_id": entry.request_id,
        "ops": [op_to_json(op) for op in entry.ops],
    }


# The hosts a node reaches on its own machine whatever it binds: the loopback names and addresses
# (127.0.0.1, localhost, ::1) and the unspecified ones, which a connect on Linux takes as the local
# host and a bind (``*``) takes as every interface, loopback included.
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "*"})


def endpoint_identity(endpoint: str) -> str:
    """The one spelling of ``endpoint`` that equal endpoints share: compare endpoints by it, never
    as strings. A pure function of the text (no name resolution): scheme and host in lower case,
    a trailing dot or slash dropped, the port as a number, IPv6 and IPv4-mapped addresses in one
    form, ``ipc://`` paths normalised, and every host of ``_LOCAL_HOSTS`` as ``local``. Two
    endpoints with different identities may still reach one process (a host name and its address,
    another of the machine's addresses): what a string cannot tell, this cannot either."""
    scheme, separator, rest = endpoint.strip().partition("://")
    scheme, rest = scheme.lower(), rest.rstrip("/")
    if not separator or scheme != "tcp":
        return f"{scheme}{separator}{posixpath.normpath(rest) if scheme == 'ipc' and rest else rest}"
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        return f"tcp://{rest.lower()}"  # no port: nothing to normalise it by
    host = host.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        pass  # a host name
    else:
        mapped = getattr(address, "ipv4_mapped", None)
        host = str(mapped or address)
    host = "local" if host in _LOCAL_HOSTS else f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{int(port)}"
