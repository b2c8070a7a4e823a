"""The wire: a frame is the msgpack array ``[version, kind, request_id, body]`` (``request_id`` pairs a
reply with its request and makes a retried write idempotent); ``body`` is decoded once, straight into its
kind's frozen msgspec ``Struct`` (``SCHEMAS``), whose declared types, ranges, lengths and patterns msgspec
checks in C. What it cannot declare has a type checked by the decoders' ``dec_hook``: ``Scalar`` (one
SQLite value: msgspec allows no union of str and bytes) and ``_free`` (bounded depth); a transaction's
values are checked at once (``Transact``), an entry's packed ops when wanted (``decode_ops``). Decoding
raises ``MessageError`` only, naming the field path, never the value. Rules against the receiver's state
live in the state machines.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import re
from typing import Annotated, Any, Literal

import msgpack
import msgspec
from mnesite.rlog import types
from mnesite.rlog.types import ENDPOINT_PATTERN, NAME_CHARS_MAX, NAME_PATTERN, MembersOp, Name, TxKey, WriteOp, WriteRow
from msgspec import Meta, Struct

PROTOCOL_VERSION, FRAME_BYTES_MAX_DEFAULT = 1, 4 * 1024 * 1024
INTEGER_MIN, INTEGER_MAX = -(2**63), 2**63 - 1  # SQLite's INTEGER
REQUEST_ID_CHARS_MAX, MESSAGE_CHARS_MAX, RANGES_MAX, BACKUP_PATH_CHARS_MAX = 64, 4096, 10_000, 1024
FREE_VALUE_DEPTH_MAX = 32  # a reply's result or an error's detail
FREE_VALUE_ITEMS_MAX = 16 * 1024 * 1024  # above what a default frame_bytes_max frame can hold
QUERY_SQL_CHARS_MAX, QUERY_PARAMS_MAX = 100_000, 999
BACKUP_PATH_PATTERN = r"^/[A-Za-z0-9_./\-]*\Z"  # backup, backup_read (rlog.roles): absolute, plain characters
_NAME = re.compile(NAME_PATTERN)

Endpoint = Annotated[str, Meta(min_length=1, max_length=types.ENDPOINT_CHARS_MAX, pattern=ENDPOINT_PATTERN)]
Digest = Annotated[bytes, Meta(min_length=types.DIGEST_BYTES, max_length=types.DIGEST_BYTES)]
DigestOrEmpty = Annotated[bytes, Meta(max_length=types.DIGEST_BYTES)]
Integer = Annotated[int, Meta(ge=INTEGER_MIN, le=INTEGER_MAX)]
NonNegative = Annotated[int, Meta(ge=0, le=INTEGER_MAX)]
Consistency = Literal["local", "read-your-writes", "linearizable"]
WaitMs = Annotated[int, Meta(ge=0, le=types.WAIT_MS_MAX)]
Row = Annotated[dict[Name, Any], Meta(max_length=1000)]
NOT_UTF8 = "holds a string that is not UTF-8"


class MessageError(ValueError):
    """A frame or body that does not fit the wire; ``code``: the error to answer with."""

    def __init__(self, message: str, code: str = "bad_frame") -> None:
        super().__init__(message)
        self.code = code


# -- what msgspec cannot declare -----------------------------------------------------------------

_SCALARS = frozenset((type(None), bool, int, float, str, bytes))


def scalars_refusal(values: list[Any] | tuple[Any, ...], width: int = 0) -> str | None:
    """None if every value is a SQLite scalar, else why (set-based). ``width``: rows of that many values, by column."""
    if width:  # a type set and a max a column (benchmarks/PROFILE.md)
        slices = (values[column::width] for column in range(width))  # made only here: 0.45 us of a 0.88 us check
        if all((kinds := set(map(type, c))) <= _PLAIN or kinds == _INT and max(c) <= INTEGER_MAX for c in slices):
            return None
    # A few values (a one-row entry): a loop costs less than the C loops' setups below (NaN is not <=).
    if len(values) <= 8 and all(type(v) in _PLAIN or type(v) in (int, float) and v <= INTEGER_MAX for v in values):
        return None
    kinds = set(each := list(map(type, values)))  # each value's type; a client's: an enum of int or str, a bytearray
    if not all(kind in _SCALARS or issubclass(kind, (int, str, bytearray, memoryview)) for kind in kinds):
        return "must be null, a bool, an integer in SQLite's 64-bit range, a float, a string or bytes"
    # msgpack holds no integer below -2**63: only the top of SQLite's range can be passed (ints picked in C).
    if int in kinds and max(itertools.compress(values, map(operator.is_, each, itertools.repeat(int)))) > INTEGER_MAX:
        return "integer is outside SQLite's 64-bit range"
    if float in kinds and any(value != value for value in values if type(value) is float):
        return "NaN cannot be stored"
    return None


def free_value_refusal(value: Any, depth_max: int, items_max: int = FREE_VALUE_ITEMS_MAX) -> str | None:
    """None if ``value`` is a plain wire value at most ``depth_max`` deep and ``items_max`` items. Walked
    with an explicit stack; containers of scalars, and lists of such rows, are counted at C speed."""
    stack, items, scalar = [(value, 1)], 0, _SCALARS.__contains__
    while stack:
        current, depth = stack.pop()
        items += 1
        if type(current) is list and depth + 1 < depth_max and _flat_rows(current):
            items += len(current) + 2 * sum(map(len, current))
        elif isinstance(current, (list, tuple, dict)):
            if depth >= depth_max:
                return f"is nested deeper than {depth_max} levels"
            children = list(current.keys()) + list(current.values()) if isinstance(current, dict) else current
            items += sum(plain := list(map(scalar, map(type, children))))  # the others are walked
            stack.extend((child, depth + 1) for child, is_plain in zip(children, plain, strict=True) if not is_plain)
        elif not scalar(type(current)):
            return f"holds a {type(current).__name__}, which is not a wire value"
        if items > items_max:
            return f"holds more than {items_max} items"
    return None


def _flat_rows(values: list[Any]) -> bool:
    """Whether ``values`` is a non-empty list of dicts whose keys and values are all plain scalars."""
    if not values or set(map(type, values)) != {dict}:
        return False
    scalar, chain = _SCALARS.__contains__, itertools.chain.from_iterable
    return all(map(scalar, map(type, chain(values)))) and all(map(scalar, map(type, chain(map(dict.values, values)))))


class _Checked(type):
    """A field type msgspec decodes as any msgpack value, then hands to ``_check`` (the decoders' dec_hook)
    with the value to refuse; msgspec then asks if the value is an instance, which what passed is."""

    def __instancecheck__(cls, value: Any) -> bool:
        return True


def _check(field_type: Any, value: Any) -> Any:  # a ValueError: msgspec refuses the body, naming the path
    if (refusal := field_type.refusal(value)) is not None:
        raise ValueError(refusal)
    return value


def _free(depth_max: int) -> Any:  # a free value, at most depth_max levels deep
    return _Checked(f"Free{depth_max}", (), {"refusal": staticmethod(lambda v: free_value_refusal(v, depth_max))})


def _scalar_refusal(value: Any) -> str | None:  # scalars_refusal of one value, its common kinds without sets
    plain = type(value) in _PLAIN or type(value) is int and value <= INTEGER_MAX
    return None if plain else scalars_refusal((value,))


_PLAIN, _INT = frozenset((type(None), bool, str, bytes)), frozenset((int,))  # SQLite stores these whatever their value
Scalar = _Checked("Scalar", (), {"refusal": staticmethod(_scalar_refusal)})  # one SQLite value

# -- the bodies: (field, type[, default]) per field ----------------------------------------------


class Body(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A message body: a msgpack map with exactly the declared fields."""


KindSchema = collections.namedtuple("KindSchema", "body decoder")  # a kind's body type and its decoder
SCHEMAS: dict[str, KindSchema] = {}


def refuse_ext(code: int, data: memoryview) -> Any:
    raise MessageError(f"msgpack extension type {code} is not allowed")


def _body(name: str, *fields: Any, base: Any = Body, **options: Any) -> Any:
    return msgspec.defstruct(name, fields, bases=(base,), module=__name__, kw_only=True, **options)


def _kind(kind: str, *fields: Any, body: Any = None, **options: Any) -> Any:
    """Declare ``kind`` in ``SCHEMAS``: its body type is ``body`` or one of ``fields`` (``_body``)."""
    body = body or _body(kind.title().replace("_", ""), *fields, **options)
    SCHEMAS[kind] = KindSchema(body, msgspec.msgpack.Decoder(body, ext_hook=refuse_ext, dec_hook=_check))
    return body


# fmt: off
TABLE, SHARD, SENDER, LIMIT = ("table", Name), ("shard", Name), ("sender", Name), ("limit", Integer | None, None)
FORWARDED = ("forwarded", bool, False)  # sent on by the node that received it, not by a client
RANGE = (("low", Scalar, None), ("high", Scalar, None))
Empty = _body("Empty")
MinKeys = Annotated[dict[Name, TxKey], Meta(max_length=1000)]  # per shard, the client's last write there
ReadOptions = _body("ReadOptions", ("consistency", Consistency, "local"), ("min_key", TxKey | None, None),
                    ("min_keys", MinKeys | None, None), ("wait_ms", WaitMs | None, None), FORWARDED)  # every read's
WriteRequest = _body("WriteRequest", TABLE, ("row", Row), tag_field="op", tag="write")
DeleteRequest = _body("DeleteRequest", TABLE, ("key", Any), tag_field="op", tag="delete")
# etcd-style compare: the row at key equals ``equals``, or is absent when it is null
Guard = _body("Guard", TABLE, ("key", Any), ("equals", Row | None, None))
# where one shard of a changefeed stands (rlog.changes): the client keeps it and sends it back
PHASE = ("phase", Literal["live", "copy", "replay"], "live")
ChangesPosition = _body("ChangesPosition", SHARD, ("after", TxKey), PHASE, ("table", Name | None, None),
                        ("table_after", Scalar, None), ("replay_to", TxKey | None, None),
                        ("records_after", Annotated[int, Meta(ge=1, le=types.OPS_MAX)] | None, None))
RequestId = Annotated[str, Meta(min_length=1, max_length=REQUEST_ID_CHARS_MAX)] | None
WireEntry = msgspec.defstruct(  # Entry.to_wire, ops still packed; shard not matched: receivers refuse one not theirs
    "WireEntry", (("shard", types.RowName), ("tx_key", TxKey), ("prev", TxKey), ("digest", Digest), ("ops", bytes),
                  ("request_id", RequestId)), module=__name__, frozen=True, array_like=True, forbid_unknown_fields=True)
# fmt: on


class _Refused(Exception):
    """A value ``Transact`` refuses: not a ValueError, so that msgspec lets it through with its path."""


class Transact(Body, frozen=True, kw_only=True):
    ops: Annotated[list[WriteRequest | DeleteRequest], Meta(max_length=types.OPS_MAX)]
    guards: Annotated[list[Guard], Meta(max_length=types.OPS_MAX)] = []
    forwarded: bool = False

    def __post_init__(self) -> None:  # msgspec calls it once decoded: all values of all ops and guards at once
        values: list[Any] = []
        for op in self.ops:
            values.extend(op.row.values()) if type(op) is WriteRequest else values.append(op.key)
        for guard in self.guards:
            values.extend(guard.equals.values()) if guard.equals else None
            values.append(guard.key)
        if scalars_refusal(values) is None:
            return
        for field, items in (("ops", self.ops), ("guards", self.guards)):  # where the refused value is
            for index, item in enumerate(items):
                for name, value in msgspec.structs.asdict(item).items():
                    for column, scalar in value.items() if type(value) is dict else [(None, value)]:
                        if (refusal := scalars_refusal((scalar,))) is not None:
                            raise _Refused(f"{field}[{index}].{name}" + (f".{column}" if column else ""), refusal)


# fmt: off
# client requests; the schema changes are replicated like create_table
_kind("transact", body=Transact)
Columns = Annotated[list[types.Column], Meta(max_length=types.COLUMNS_MAX)]
_kind("create_table", TABLE, ("key", Name), ("columns", Columns), ("shard", Name | None, None), FORWARDED)
_kind("drop_table", TABLE, FORWARDED)
IndexColumns = Annotated[list[Name], Meta(min_length=1, max_length=types.INDEX_COLUMNS_MAX)]
_kind("create_index", ("index", Name), TABLE, ("columns", IndexColumns), FORWARDED)
_kind("drop_index", ("index", Name), FORWARDED)
_kind("add_column", TABLE, ("column", Name), ("type", types.ColumnType), FORWARDED)
_kind("get", TABLE, ("key", Scalar), base=ReadOptions)
_kind("scan", TABLE, ("after", Scalar, None), LIMIT, base=ReadOptions)
_kind("count", TABLE, base=ReadOptions)
# read-only SQL (rlog.query): the first page of a statement's rows, then the next pages by cursor
Sql = Annotated[str, Meta(min_length=1, max_length=QUERY_SQL_CHARS_MAX)]
Params = Annotated[list[Scalar], Meta(max_length=QUERY_PARAMS_MAX)]
_kind("query", ("sql", Sql), ("params", Params, []), ("page_rows", Integer | None, None), base=ReadOptions)
_kind("query_page", ("cursor", Name), ("page_rows", Integer | None, None))
_kind("query_close", ("cursor", Name))  # the node frees the query's snapshot
# a changefeed page (rlog.changes): changes after positions; a node has at most 1000 shards
Changes = _kind("changes", ("tables", Annotated[list[Name], Meta(max_length=1000)], []),
                ("positions", Annotated[list[ChangesPosition], Meta(max_length=1000)], []),
                ("page_records", Annotated[int, Meta(ge=1, le=INTEGER_MAX)] | None, None),
                ("wait_ms", WaitMs | None, None))
_kind("read_index", SHARD, FORWARDED)  # the committed key, confirmed by the sequencer
# operator: add or remove one core of a shard (core.membership)
_kind("membership_change", SHARD, ("action", Literal["add", "remove"]), ("name", Name),
      ("endpoint", Endpoint | None, None), FORWARDED)
BackupPath = Annotated[str, Meta(min_length=2, max_length=BACKUP_PATH_CHARS_MAX, pattern=BACKUP_PATH_PATTERN)]
Backup, _ = _kind("backup", ("path", BackupPath)), _kind("backup_read", ("path", BackupPath), ("offset", NonNegative))
_kind("rlog_tail", SHARD, ("count", Integer | None, None))
_kind("rlog_entries", SHARD, ("after", TxKey | None, None), LIMIT)
# stop: the node finishes its loop turn, logs a shutdown line and exits; force_start: become sequencer
for _empty in ("list_tables", "status", "stop", "journal", "force_start", "members"):
    _kind(_empty, body=Empty)
# replication: a replicant's watch (watch_id: the replica's, repeated by the answer and pushes), an agent's push (no
# entries: a heartbeat; watch: the answer, which it may overtake; token: core.agent's), the push_ack (echoing a token)
WATCH_ID, FRAME_MAX = ("watch_id", Annotated[str, Meta(max_length=64)], ""), ("frame_bytes_max", types.FrameBytes, None)
Watch = _kind("watch", SHARD, ("replicant", Name), ("endpoint", Endpoint), ("from_", TxKey, msgspec.field(name="from")),
              ("from_digest", DigestOrEmpty), ("protocol", Annotated[int, Meta(ge=0, le=2**31)]), WATCH_ID, FRAME_MAX)
Entries = Annotated[list[WireEntry], Meta(max_length=4096)]
TOKEN = ("token", Annotated[bytes, Meta(max_length=32)] | None, None)  # protocol 2 only (never to release 0.1.0)
Push = _kind("push", SHARD, ("agent", Name), ("core", Name), ("entries", Entries), ("committed", TxKey),
             ("hears_sequencer", bool), ("watch", _free(3), None), TOKEN)
Rejected = Annotated[str, Meta(max_length=MESSAGE_CHARS_MAX)] | None
PushAck = _kind("push_ack", SHARD, ("agent", Name), ("applied", TxKey), ("rejected", Rejected, None), TOKEN)
BytesMax, INSTALLER = Annotated[int, Meta(ge=1, le=2**31)] | None, ("sender", Name | None, None)  # core.snapshot
_kind("bootstrap_batch", TABLE, ("limit", Integer), ("after", Scalar, None), ("bytes_max", BytesMax, None), INSTALLER)
# sequencer -> a follower behind its trimmed log (core.snapshot), the membership at key; version 1 left out (0.1.0)
Members = Annotated[list[Name], Meta(max_length=types.MEMBERS_OP_MAX)]
ClusterVersion, FORCED = Annotated[int, Meta(ge=1, le=1000)], ("forced", bool, False)  # sent only true, never to 0.1.0
SnapshotOffer = _kind("snapshot_offer", SHARD, SENDER, ("generation", NonNegative), ("key", TxKey), FORCED,
                      ("digest", DigestOrEmpty), ("members", Members, []), ("cluster_version", ClusterVersion, 1))
SnapshotRequest = _kind("snapshot_request", SHARD, SENDER)  # rows lost: offer me one (core.snapshot, "Re-offer")
# between cores: one consensus message, decoded once by its kind's type (core.consensus_wire)
_kind("peer", SHARD, SENDER, ("message", msgspec.Raw))
# range requests (rlog.range_requests)
Ranges = Annotated[list[_free(2)], Meta(min_length=1, max_length=RANGES_MAX)]
_kind("range_digest", TABLE, ("ranges", Ranges), ("split_parts", Integer | None, None),
      ("split_rows_min", Integer | None, None))
_kind("key_boundaries", TABLE, ("parts", Integer), *RANGE)
_kind("row_digests", TABLE, *RANGE, LIMIT)
# replies
FreeValue = _free(FREE_VALUE_DEPTH_MAX)
Reply = _kind("reply", ("result", FreeValue, None))
Code, Text = Annotated[str, Meta(min_length=1, max_length=64)], Annotated[str, Meta(max_length=MESSAGE_CHARS_MAX * 4)]
Error = _kind("error", ("code", Code), ("message", Text), ("detail", FreeValue, None))
# fmt: on


def body_error(kind: str, error: msgspec.ValidationError | msgspec.DecodeError) -> MessageError:
    """msgspec's refusal, its ``$`` path replaced by the kind: ``bad_frame`` for a wrong type or a
    missing or unknown field, ``bad_request`` for a value out of its range, length or choices."""
    if not isinstance(error, msgspec.ValidationError):  # a DecodeError that is not a ValidationError
        return MessageError(f"{kind}: malformed msgpack body")
    message, _, path = str(error).partition(" - at `$")
    shape = message.startswith(("Object missing required field", "Object contains unknown field"))
    shape = shape or (message.startswith("Expected `") and ", got `" in message)
    return MessageError(f"{kind}{path.rstrip('`')}: {message[:300]}", "bad_frame" if shape else "bad_request")


def decode_body(kind: str, body: Any) -> Body:
    """``body`` (msgpack bytes, or a value msgpack cannot hold) as ``kind``'s type; raises ``MessageError``."""
    if isinstance(body, (bytes, memoryview, msgspec.Raw)):
        return typed(kind, SCHEMAS[kind].decoder.decode, body)
    return typed(kind, functools.partial(msgspec.convert, type=SCHEMAS[kind].body, dec_hook=_check), body)


def typed(kind: str, decode: Any, data: Any) -> Any:
    """``decode(data)``; whatever msgspec (or a type's own check) refuses as ``MessageError`` naming ``kind``."""
    try:
        return decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise body_error(kind, error) from None
    except _Refused as error:
        raise MessageError(f"{kind}.{error.args[0]}: {error.args[1]}", "bad_request") from None
    except UnicodeDecodeError:  # msgspec raises it, not a DecodeError, for a string that is not UTF-8
        raise MessageError(f"{kind}: {NOT_UTF8}") from None
    except RecursionError:  # decode names the field of a frame this deep
        raise MessageError(f"{kind}: is nested deeper than the decoder allows") from None
    except MessageError as error:  # an extension type
        raise MessageError(f"{kind}: {error}") from None


def typed_body(kind: str, fields: dict[str, Any]) -> Body:
    """``kind``'s body from a plain dict, checked as a received one (in-process callers, tests)."""
    return decode_body(kind, _ENCODER.encode(fields))


# -- frames ----------------------------------------------------------------------------------------


class Message(Struct, frozen=True):
    """``body``: its kind's Struct once decoded; a sender may give a dict (checked only if asked).
    A Struct, not a dataclass: two are made for each write a core serves, and a frozen dataclass's
    ``__init__`` costs about 0.4 us more (benchmarks/PROFILE.md, twenty-seventh session)."""

    kind: str
    request_id: str
    body: Any = msgspec.field(default_factory=dict)


_HEADER = msgspec.msgpack.Decoder(tuple[Any, Any, Any, msgspec.Raw], ext_hook=refuse_ext)
_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Message, check: bool = False) -> bytes:
    """Encode a message; raises ``MessageError`` if it cannot be represented, or, with ``check``
    (clients), if the receiver's schema would refuse it. The values given are checked, not the bytes:
    msgspec writes a Decimal, a date or a UUID as text, which a receiver would take for a string."""
    if check:
        check_header(message.kind, message.request_id)
        decode_body(message.kind, message.body)
    try:
        body = _ENCODER.encode(message.body)
    except (TypeError, ValueError, OverflowError) as error:
        raise MessageError(f"cannot encode {message.kind}: {error}") from None
    return _ENCODER.encode((PROTOCOL_VERSION, message.kind, message.request_id, msgspec.Raw(body)))


def decode(frame: bytes, frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT) -> Message:
    """Decode one frame. Anything malformed raises ``MessageError``, nothing else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise MessageError("frame must be bytes")
    if len(frame) > frame_bytes_max:
        raise MessageError(f"frame of {len(frame)} bytes exceeds frame_bytes_max {frame_bytes_max}", "frame_too_large")
    deep = False
    try:
        version, kind, request_id, body = _HEADER.decode(frame)
    except msgspec.ValidationError:
        raise MessageError("frame must be [version, kind, request_id, body]") from None
    except msgspec.DecodeError as error:
        raise MessageError(f"malformed msgpack frame: {type(error).__name__}") from None
    except UnicodeDecodeError:  # msgspec raises it, not a DecodeError, for a string that is not UTF-8
        raise MessageError("malformed msgpack frame: a string is not UTF-8") from None
    except RecursionError:  # deeper than msgspec recurses: unpacked by msgpack (in C) to name the field
        try:
            version, kind, request_id, body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception as error:  # garbage, or not 4 items (msgpack raises many types): all the same here
            raise MessageError(f"malformed msgpack frame: {type(error).__name__}") from None
        deep = True
    if type(version) is not int:
        raise MessageError("protocol version must be an integer")
    if version != PROTOCOL_VERSION:
        message = f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})"
        raise MessageError(message, "unsupported_version")
    check_header(kind, request_id)
    if deep:  # typed from the unpacked body: a field's type refuses the deep value, naming its path
        decode_body(kind, body)
        raise MessageError(f"{kind}: is nested deeper than the decoder allows")
    return Message(kind, request_id, decode_body(kind, body))


def check_header(kind: Any, request_id: Any) -> None:
    if type(kind) is not str:
        raise MessageError("message kind must be a string")
    if kind not in SCHEMAS:
        raise MessageError(f"unknown message kind {kind!r:.40}", "unknown_kind")
    if type(request_id) is not str or not 0 < len(request_id) <= REQUEST_ID_CHARS_MAX:
        raise MessageError(f"request_id must be a string of 1..{REQUEST_ID_CHARS_MAX} characters")


def reply(request_id: str, result: Any = None) -> Message:
    return Message("reply", request_id, Reply(result=result))


def error(request_id: str, code: str, message: str, detail: Any = None) -> Message:
    return Message("error", request_id, Error(code=code, message=message, detail=detail))


# -- entries: packed ops decoded once the receiver wants them --------------------------------------

_NAMES_CHECKED: set[str] = set()  # names found valid, bounded (each at most NAME_CHARS_MAX characters)
_OPS = Annotated[list[types.WireOp], Meta(max_length=types.OPS_MAX)]
_OPS_DECODER = msgspec.msgpack.Decoder(_OPS, ext_hook=refuse_ext)
_ROW_PAIRS_OF, _TABLE_OF, _KEY_OF = operator.attrgetter("row"), operator.attrgetter("table"), operator.attrgetter("key")
UNSORTED = "ops: write op columns must be sorted and unique, and a run of writes its entry's only op"


def decode_ops(packed: bytes, runs: bool = False) -> tuple[types.Op, ...]:
    """The ops of an entry's packed bytes, checked by the wire's rules and required to be their canonical
    packing (``rlog.types.pack_ops``, which the digest covers); raises ``MessageError`` naming what is wrong.
    ``runs`` (a replicant's): a bulk write's ``WriteRows`` stays one, bound as decoded (else a WriteOp a row)."""
    wire = typed("ops", _OPS_DECODER.decode, packed)
    if len(wire) == 1 and type(run := wire[0]) is types.WriteRows:  # a bulk write (cluster version 2)
        if list(run.columns) != sorted({*run.columns}) or {*map(len, run.rows)} != {len(run.columns)}:
            raise MessageError("ops: a write run's columns must be sorted and unique, with a value each in every row")
        names, values, width = {run.table, *run.columns}, [*itertools.chain.from_iterable(run.rows)], len(run.columns)
        ops = (run,) if runs else run.writes()
    elif len(wire) == 1 and type(wire[0]) is WriteRow:  # the commonest entry (a follower's per write): no C loops
        row = dict(wire[0].row)
        if len(row) != len(wire[0].row) or list(row) != sorted(row):
            raise MessageError(UNSORTED)
        names, values, ops, width = {wire[0].table, *row}, list(row.values()), (WriteOp(wire[0].table, row),), 0
    else:  # set-based: each per-row step is one C loop over the entry's rows
        kinds, rows, chain = set(map(type, wire)), None, itertools.chain.from_iterable
        writes = wire if kinds == {WriteRow} else [op for op in wire if type(op) is WriteRow]
        deletes = [op for op in wire if type(op) is types.DeleteOp] if types.DeleteOp in kinds else ()
        flat = list(chain(chain(pair_lists := list(map(_ROW_PAIRS_OF, writes)))))  # column, value, column, ...
        column_lists: Any = [[*(dict(pair_lists[0]) if pair_lists else ())]]  # the common entry: all rows have these
        if not (set(map(len, pair_lists)) <= {len(first := column_lists[0])} and flat[0::2] == first * len(writes)):
            rows = list(map(dict, pair_lists))  # several column lists, or a repeated one (a shorter dict)
            column_lists = set(map(tuple, rows)) if list(map(len, rows)) == list(map(len, pair_lists)) else None
        if column_lists is None or types.WriteRows in kinds or any(list(c) != sorted(c) for c in column_lists):
            raise MessageError(UNSORTED)  # a run of writes (WriteRows) is packed only as its entry's one op
        if types.MembersOp in kinds and any(bool(m.added) != bool(m.endpoint) for m in wire if type(m) is MembersOp):
            raise MessageError("ops: members op: added and endpoint must be both set or both empty")
        names = {*map(_TABLE_OF, writes), *map(_TABLE_OF, deletes), *chain(column_lists)}
        values = [*flat[1::2], *map(_KEY_OF, deletes)]
        width = len(first) if rows is None and not deletes else 0  # values laid out row by row, by ``first``
        if writes is wire or not writes:
            ops = tuple(map(WriteOp, map(_TABLE_OF, writes), rows or map(dict, pair_lists))) if writes else tuple(wire)
        else:  # writes among other ops: the others stay as decoded, in their places
            row_of = dict(zip(map(id, writes), rows or map(dict, pair_lists), strict=True))
            ops = tuple(WriteOp(op.table, row_of[id(op)]) if type(op) is WriteRow else op for op in wire)
    for name in () if _NAMES_CHECKED.issuperset(names) else names - _NAMES_CHECKED:  # each distinct name once
        if not _NAME.match(name):
            raise MessageError(f"ops: name {name[:NAME_CHARS_MAX]!r} has characters that are not allowed")
        if len(_NAMES_CHECKED) < 4096:
            _NAMES_CHECKED.add(name)
    if (refusal := scalars_refusal(values, width)) is not None:
        raise MessageError(f"ops: {refusal}")
    if _ENCODER.encode(wire) != packed:  # packing the decoded values again, at C speed
        raise MessageError("ops: entry ops are not in canonical form")
    return ops


def decode_entry(value: Any, runs: bool = False) -> types.Entry:
    """A ``WireEntry``'s ``Entry``, its ops decoded now (a push refused anyway costs no per-row work)."""
    ops = decode_ops(value.ops, runs)  # checked canonical: the packed bytes are what ``pack_ops(ops)`` makes
    return types.Entry(value.shard, value.tx_key, value.prev, value.digest, ops, value.request_id, value.ops)


class Answer(Struct, frozen=True, kw_only=True):
    """A reply's ``result`` as the node that asked reads it (``answer_as``): untrusted, None when malformed;
    unknown fields allowed (a newer release may add some: an older one still reads what it knows)."""


_answer = functools.partial(_body, base=Answer)
# fmt: off
ReadIndexAnswer = _answer("ReadIndexAnswer", ("committed", TxKey))  # confirmed by the sequencer's quorum
WatchAnswer = _answer("WatchAnswer", ("agent", Name), ("mode", Literal["resume", "bootstrap"]), ("start", TxKey),
                      ("start_digest", DigestOrEmpty), WATCH_ID)
# cluster_version: absent from release 0.1.0's answers, version 1 (rlog.versions)
JournalShardAnswer = _answer("JournalShardAnswer", ("committed", TxKey), ("hears_sequencer", bool),
                             ("agents", Annotated[int, Meta(ge=0, lt=2**31)]), ("cluster_version", Any, None))
# a bootstrap_batch answer (bootstrap.serve): rows in key order, whether the table is done
BatchRows = Annotated[list[dict[str, Any]], Meta(max_length=1_000_000)]
BatchAnswer = _answer("BatchAnswer", ("rows", BatchRows), ("done", bool), ("rows_total", NonNegative | None, None))
# fmt: on


def answer_as(result: Any, answer_type: type[Any]) -> Any:
    """``result`` as ``answer_type``, or None if it does not fit (never raises on untrusted input)."""
    try:
        return msgspec.convert(result, answer_type)
    except (msgspec.ValidationError, RecursionError):
        return None
