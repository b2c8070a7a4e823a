"""The typed message layer: one schema entry per message kind, checked before anything acts on a message.

Theory of operation
-------------------
Every byte from a socket is untrusted, a peer core's included. ``rlog.codec`` turns a frame into
``[version, kind, request_id, body]``; this module then checks the body against the one schema
entry of its kind (``SCHEMAS``): which fields exist, which are required, and for each field its
type, its range (generations and counters below 2**63, integers within SQLite's 64-bit range),
its length (characters, bytes, items) and its allowed values. Nothing in a schema nests without a
bound: rows and keys hold scalars only, lists have an item maximum, and the few free-form values
(a reply's ``result``, an error's ``detail``) are walked iteratively with a depth maximum, so a
hostile ``[[[[...]]]]`` is refused by its depth and never reaches ``repr`` or recursion.

A checked body becomes a frozen dataclass (``Message.fields``), one class per kind, generated from
the schema entry (tx keys as ``TxKey``); the plain ``body`` dict stays available, checked.
A refusal raises ``MessageError`` (a ``CodecError``) whose message names the field path, for
example ``transact.ops[3].row.name``, and the expected shape; it never prints the offending value,
only its type, so an error message is bounded whatever was sent.

The client runs the same check before it sends (``codec.encode``), so it refuses what a node would
refuse. Checks against the *receiver's state* (replies about entries never sent, a second sequencer
in one generation, absurd generation jumps) cannot live here: they are in the state machines, which
count them as protocol violations.

Each kind has exactly one ``KindSchema``, so a later rule per kind (for example the roles allowed to
send it) joins that entry rather than a second table.
"""

from __future__ import annotations

import dataclasses
import itertools
import keyword
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mnesite.rlog.types import (
    DIGEST_BYTES,
    DeleteOp,
    Entry,
    Op,
    OpDecodeError,
    TxKey,
    WriteOp,
    entry_from_unpacked,
    unpack_wire_ops,
)

# SQLite's INTEGER range; tx key parts and generations stay below 2**63 as well.
INTEGER_MIN = -(2**63)
INTEGER_MAX = 2**63 - 1
TX_KEY_PART_MAX = 2**63 - 1
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
LIMIT_MAX = 2**31
QUERY_SQL_CHARS_MAX = 100_000  # one query's SQL text (rlog.query)
QUERY_PARAMS_MAX = 999  # bound parameters of one query
QUERY_CURSOR_CHARS_MAX = 64  # a query cursor's token

# Exact types (no subclasses) of the scalars msgpack decodes; ``FreeValue`` counts them without a stack trip.
_WIRE_SCALAR_TYPES = frozenset((type(None), bool, int, float, str, bytes))
# An absolute path of plain characters (rlog.backup checks it again, with the file system).
BACKUP_PATH_CHARS_MAX = 1024
BACKUP_PATH = re.compile(r"^/[A-Za-z0-9_./\-]*$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
# tcp://host:port with a host name, an IPv4 address or a bracketed IPv6 address; ipc:// for tests.
_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}|ipc://[A-Za-z0-9_./\-]+)$")


class MessageError(ValueError):
    """A message's contents do not fit its kind's schema. ``code`` is the error code to answer with."""

    def __init__(self, path: str, expected: str, code: str = "bad_request") -> None:
        super().__init__(f"{path}: {expected}")
        self.path = path
        self.code = code


def _kind_of(value: Any) -> str:
    return type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- field specs -------------------------------------------------------------------------------


class Spec:
    """One field's shape. ``check`` returns the value (normalised) or raises ``MessageError``."""

    description = "a value"

    def check(self, value: Any, path: str) -> Any:
        raise NotImplementedError

    def refuse(self, value: Any, path: str, code: str = "bad_request") -> MessageError:
        return MessageError(path, f"must be {self.description}, got {_kind_of(value)}", code)


@dataclass(frozen=True)
class Text(Spec):
    chars_max: int
    chars_min: int = 0
    pattern: re.Pattern[str] | None = None
    choices: tuple[str, ...] = ()

    @property
    def description(self) -> str:  # type: ignore[override]
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return f"a string of {self.chars_min}..{self.chars_max} characters"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, str):
            raise self.refuse(value, path, "bad_frame")
        if not self.chars_min <= len(value) <= self.chars_max:
            raise MessageError(path, f"must be {self.chars_min}..{self.chars_max} characters, got {len(value)}")
        if self.choices and value not in self.choices:
            raise MessageError(path, f"must be {self.description}")
        if self.pattern is not None and not self.pattern.match(value):
            raise MessageError(path, "has characters or a form that are not allowed")
        return value


@dataclass(frozen=True)
class Integer(Spec):
    minimum: int = INTEGER_MIN
    maximum: int = INTEGER_MAX

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"an integer in {self.minimum}..{self.maximum}"

    def check(self, value: Any, path: str) -> Any:
        if not _is_int(value):
            raise self.refuse(value, path, "bad_frame")
        if not self.minimum <= value <= self.maximum:
            raise MessageError(path, f"must be {self.description}")
        return value


@dataclass(frozen=True)
class Flag(Spec):
    description = "a boolean"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, bool):
            raise self.refuse(value, path, "bad_frame")
        return value


@dataclass(frozen=True)
class Blob(Spec):
    bytes_max: int
    bytes_exact: int | None = None

    @property
    def description(self) -> str:  # type: ignore[override]
        if self.bytes_exact is not None:
            return f"{self.bytes_exact} bytes"
        return f"at most {self.bytes_max} bytes"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, bytes):
            raise self.refuse(value, path, "bad_frame")
        if len(value) > self.bytes_max or (self.bytes_exact is not None and len(value) != self.bytes_exact):
            raise MessageError(path, f"must be {self.description}, got {len(value)}")
        return value


@dataclass(frozen=True)
class TxKeySpec(Spec):
    description = "a tx key [generation, counter] of integers in 0..2**63-1"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise self.refuse(value, path)
        for part in value:
            if not _is_int(part) or not 0 <= part <= TX_KEY_PART_MAX:
                raise MessageError(path, f"must be {self.description}")
        return TxKey(value[0], value[1])


@dataclass(frozen=True)
class Scalar(Spec):
    """A value a SQLite column can hold: null, a 64-bit integer, a float, a string or bytes.

    Booleans pass here: the table schema refuses them with a message that names the column.
    """

    description = "null, a 64-bit integer, a float, a string or bytes"

    def check(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str, bytes)):
            return value
        if isinstance(value, int):
            if not INTEGER_MIN <= value <= INTEGER_MAX:
                raise MessageError(path, "integer is outside SQLite's 64-bit range")
            return value
        if isinstance(value, float):
            if math.isnan(value):
                raise MessageError(path, "NaN cannot be stored")
            return value
        raise self.refuse(value, path)


@dataclass(frozen=True)
class Nullable(Spec):
    inner: Spec

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"null or {self.inner.description}"

    def check(self, value: Any, path: str) -> Any:
        return None if value is None else self.inner.check(value, path)


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    items_max: int
    items_min: int = 0

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"a list of {self.items_min}..{self.items_max} items"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, (list, tuple)):
            raise self.refuse(value, path, "bad_frame")
        if not self.items_min <= len(value) <= self.items_max:
            raise MessageError(path, f"must be {self.description}, got {len(value)}")
        return [self.item.check(item, f"{path}[{index}]") for index, item in enumerate(value)]


@dataclass(frozen=True)
class Pair(Spec):
    first: Spec
    second: Spec

    description = "a pair [a, b]"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise self.refuse(value, path)
        return [self.first.check(value[0], f"{path}[0]"), self.second.check(value[1], f"{path}[1]")]


@dataclass(frozen=True)
class Row(Spec):
    """A map from column name to scalar."""

    columns_max: int = ROW_COLUMNS_MAX

    description = "an object of column name to scalar"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise self.refuse(value, path)
        if len(value) > self.columns_max:
            raise MessageError(path, f"must have at most {self.columns_max} columns, got {len(value)}")
        checked = {}
        for column, item in value.items():
            COLUMN_NAME.check(column, f"{path}.<column>")
            checked[column] = SCALAR.check(item, f"{path}.{column}")
        return checked


@dataclass(frozen=True)
class Record(Spec):
    """A map with named fields: ``fields`` maps a name to ``(spec, required)``; other names are refused."""

    fields: tuple[tuple[str, Spec, bool], ...]

    description = "an object"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise self.refuse(value, path)
        return check_fields(self.fields, value, path)


@dataclass(frozen=True)
class FreeValue(Spec):
    """Any msgpack value without extension types, at most ``depth_max`` deep and ``items_max`` items.

    Walked with an explicit stack, never recursively, so no depth can exhaust Python's stack.
    """

    depth_max: int = FREE_VALUE_DEPTH_MAX
    items_max: int = FREE_VALUE_ITEMS_MAX

    description = "a bounded value"

    def check(self, value: Any, path: str) -> Any:
        stack: list[tuple[Any, int]] = [(value, 1)]
        items = 0
        while stack:
            current, depth = stack.pop()
            items += 1
            if type(current) is list and depth + 1 < self.depth_max and _flat_rows(current):
                # A list of rows (dicts of scalars): counted at C speed, no trip through the stack.
                items += len(current) + 2 * sum(map(len, current))
            elif isinstance(current, (list, tuple, dict)):
                if depth >= self.depth_max:
                    raise MessageError(path, f"is nested deeper than {self.depth_max} levels")
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
            elif not (current is None or isinstance(current, (bool, int, float, str, bytes))):
                raise MessageError(path, f"holds a {_kind_of(current)}, which is not a wire value")
            if items > self.items_max:
                raise MessageError(path, f"holds more than {self.items_max} items")
        return value


def _flat_rows(values: list[Any]) -> bool:
    """Whether ``values`` is a non-empty list of dicts whose keys and values are all plain scalars."""
    if not values or set(map(type, values)) != {dict}:
        return False
    scalar = _WIRE_SCALAR_TYPES.__contains__
    return all(map(scalar, map(type, itertools.chain.from_iterable(values)))) and all(
        map(scalar, map(type, itertools.chain.from_iterable(map(dict.values, values))))
    )


def check_fields(fields: tuple[tuple[str, Spec, bool], ...], body: dict[Any, Any], path: str) -> dict[str, Any]:
    known = {name for name, _, _ in fields}
    for name in body:
        if name not in known:
            shown = name[:40] if isinstance(name, str) else f"<{_kind_of(name)}>"
            raise MessageError(f"{path}.{shown}", "is not a field of this message", "bad_frame")
    checked: dict[str, Any] = {}
    for name, spec, required in fields:
        if name not in body:
            if required:
                raise MessageError(f"{path}.{name}", "is missing", "bad_frame")
            continue
        checked[name] = spec.check(body[name], f"{path}.{name}")
    return checked


# -- shared field shapes -----------------------------------------------------------------------

COLUMN_NAME = Text(NAME_CHARS_MAX, 1)
NAME = Text(NAME_CHARS_MAX, 1, _NAME)
ENDPOINT = Text(ENDPOINT_CHARS_MAX, 1, _ENDPOINT)
AGENT_ID = Text(AGENT_ID_CHARS_MAX, 1, _NAME)
TX_KEY = TxKeySpec()
DIGEST = Blob(DIGEST_BYTES, DIGEST_BYTES)
SCALAR = Scalar()
CONSISTENCY = Text(32, 1, choices=("local", "read-your-writes", "linearizable"))
WAIT_MS = Integer(0, WAIT_MS_MAX)
LIMIT = Integer(INTEGER_MIN, INTEGER_MAX)  # the node checks its own configured range and names it
OPTIONAL_FORWARDED = ("forwarded", Flag(), False)

OP = Record(
    (
        ("op", Text(16, 1, choices=("write", "delete")), True),
        ("table", NAME, True),
        ("row", Row(), False),
        ("key", SCALAR, False),
    )
)
GUARD = Record((("table", NAME, True), ("key", SCALAR, True), ("equals", Nullable(Row()), False)))
COLUMN = Pair(NAME, Text(16, 1))
# An entry on the wire (``rlog.types.entry_to_wire``): its ops are packed bytes, checked op by op
# when they are decoded (``decode_entry``), once the receiver wants the entry.
WIRE_OP = FreeValue(depth_max=4)


@dataclass(frozen=True)
class _Entry(Spec):
    description = "an entry [shard, tx_key, prev, digest, ops, request_id]"

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, (list, tuple)) or len(value) != 6:
            raise self.refuse(value, path)
        NAME.check(value[0], f"{path}.shard")
        TX_KEY.check(value[1], f"{path}.tx_key")
        TX_KEY.check(value[2], f"{path}.prev")
        DIGEST.check(value[3], f"{path}.digest")
        if not isinstance(value[4], bytes):
            raise MessageError(f"{path}.ops", "must be the packed ops (bytes)")
        Nullable(Text(REQUEST_ID_CHARS_MAX, 1)).check(value[5], f"{path}.request_id")
        return list(value)


def decode_entry(value: list[Any], path: str) -> Entry:
    """The ``Entry`` of a wire entry ``ENTRY_WIRE`` accepted: its packed ops unpacked (no extension
    types), checked op by op by the same rules as any op on the wire, required to be the canonical
    packing (so the digest over those bytes is the digest of the ops), and decoded.

    Deferred from the message check so that a push a replicant refuses anyway (a superseded agent's)
    costs no per-row work. Raises ``MessageError`` naming what is wrong.
    """
    try:
        ops = unpack_wire_ops(value[4])
    except OpDecodeError as error:
        raise MessageError(f"{path}.ops", str(error)) from None
    decoded = _decode_plain_ops(ops)
    if decoded is not None:
        try:
            return entry_from_unpacked(list(value), ops, decoded)
        except OpDecodeError as error:
            raise MessageError(path, str(error)) from None
    if not _wire_ops_well_formed(ops):
        # The checks that name what is wrong (and refuse it); the fast path only says yes.
        checked = ListOf(WIRE_OP, OPS_MAX).check(ops, f"{path}.ops")
        for index, op in enumerate(checked):
            _check_wire_op(op, f"{path}.ops[{index}]")
    try:
        return entry_from_unpacked(list(value), ops)
    except OpDecodeError as error:
        raise MessageError(path, str(error)) from None


# Names (tables, columns) already found valid by ``NAME``; bounded, names are at most NAME_CHARS_MAX.
_NAMES_CHECKED: set[str] = set()
_NAMES_CHECKED_MAX = 4096


def _name_well_formed(name: Any) -> bool:
    if type(name) is not str:
        return False
    if name in _NAMES_CHECKED:
        return True
    try:
        NAME.check(name, "")
    except MessageError:
        return False
    if len(_NAMES_CHECKED) < _NAMES_CHECKED_MAX:
        _NAMES_CHECKED.add(name)
    return True


def _scalar_well_formed(value: Any) -> bool:
    kind = type(value)
    if kind is str or kind is bytes or value is None or kind is bool:
        return True
    if kind is int:
        return INTEGER_MIN <= value <= INTEGER_MAX
    if kind is float:
        return not math.isnan(value)
    return False


def _wire_ops_well_formed(ops: Any) -> bool:
    """True only if every op is a write or delete ``ListOf(WIRE_OP)`` and ``_check_wire_op`` accept.

    The same rules without building a path string per value: a push of 1,000-row entries holds
    millions of values, and checking them the generic way cost more than applying them. False
    sends the value through the generic checks, which refuse it with the path of what is wrong
    (and create ops, which are rare, always go that way).
    """
    if not isinstance(ops, (list, tuple)) or len(ops) > OPS_MAX:
        return False
    for op in ops:
        if not isinstance(op, (list, tuple)) or len(op) != 3 or not _name_well_formed(op[1]):
            return False
        kind = op[0]
        if kind == "d" and type(kind) is str:
            if not _scalar_well_formed(op[2]):
                return False
            continue
        row = op[2]
        if kind != "w" or type(kind) is not str or not isinstance(row, (list, tuple)) or len(row) > ROW_COLUMNS_MAX:
            return False
        for pair in row:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                return False
            column, item = pair
            if not (column in _NAMES_CHECKED if type(column) is str else False) and not _name_well_formed(column):
                return False
            if not _scalar_well_formed(item):
                return False
    return True


def _decode_plain_ops(ops: list[Any]) -> tuple[Op, ...] | None:
    """Writes and deletes in canonical form, checked and decoded in one pass; None for anything else.

    What ``_wire_ops_well_formed`` and ``rlog.types.decode_op`` do one after the other (same rules,
    plus the columns of a row sorted and unique), fused: a 1,000-row entry's values are walked once.
    None sends the ops through those two (which name what is wrong, and decode create, drop and
    membership ops), so this may only return ops both would have accepted.
    """
    if len(ops) > OPS_MAX:
        return None
    decoded: list[Op] = []
    names = _NAMES_CHECKED
    for op in ops:
        if type(op) is not list or len(op) != 3:
            return None
        kind, table, row = op
        if not (table in names if type(table) is str else False) and not _name_well_formed(table):
            return None
        if kind == "d" and type(kind) is str:
            if not _scalar_well_formed(row):
                return None
            decoded.append(DeleteOp(table, row))
            continue
        if kind != "w" or type(kind) is not str or type(row) is not list or len(row) > ROW_COLUMNS_MAX:
            return None
        previous = None
        for pair in row:
            if type(pair) is not list or len(pair) != 2:
                return None
            column, item = pair
            if not (column in names if type(column) is str else False) and not _name_well_formed(column):
                return None
            if previous is not None and not previous < column:
                return None
            previous = column
            item_type = type(item)
            if item_type is int:
                if not INTEGER_MIN <= item <= INTEGER_MAX:
                    return None
            elif item_type is float:
                if item != item:  # NaN
                    return None
            elif not (item_type is str or item_type is bytes or item is None or item_type is bool):
                return None
        decoded.append(WriteOp(table, dict(row)))
    return tuple(decoded)


def _check_wire_op(op: Any, path: str) -> None:
    """An op in ``rlog.types.encode_op`` form: scalars only in rows and keys."""
    if not isinstance(op, list) or not op or op[0] not in ("w", "d", "c", "x", "m", "i", "j", "a"):
        raise MessageError(path, "must be an op ['w'|'d'|'c'|'x'|'m'|'i'|'j'|'a', ...]")
    if op[0] == "w":
        if len(op) != 3:
            raise MessageError(path, "write op must be ['w', table, [[column, value]...]]")
        NAME.check(op[1], f"{path}.table")
        ListOf(Pair(NAME, SCALAR), ROW_COLUMNS_MAX).check(op[2], f"{path}.row")
    elif op[0] == "m":
        # A membership entry (core.membership): voter names, the added core and its endpoint.
        if len(op) != 4:
            raise MessageError(path, "members op must be ['m', [name...], added, endpoint]")
        ListOf(NAME, MEMBERS_OP_MAX).check(op[1], f"{path}.members")
        if op[2] != "" or op[3] != "":
            NAME.check(op[2], f"{path}.added")
            ENDPOINT.check(op[3], f"{path}.endpoint")
    elif op[0] == "x":
        if len(op) != 3:
            raise MessageError(path, "drop op must be ['x', table, shard]")
        NAME.check(op[1], f"{path}.table")
        NAME.check(op[2], f"{path}.shard")
    elif op[0] == "i":
        if len(op) != 5:
            raise MessageError(path, "create index op must be ['i', index, table, shard, [column...]]")
        NAME.check(op[1], f"{path}.index")
        NAME.check(op[2], f"{path}.table")
        NAME.check(op[3], f"{path}.shard")
        ListOf(NAME, INDEX_COLUMNS_MAX, 1).check(op[4], f"{path}.columns")
    elif op[0] == "j":
        if len(op) != 4:
            raise MessageError(path, "drop index op must be ['j', index, table, shard]")
        NAME.check(op[1], f"{path}.index")
        NAME.check(op[2], f"{path}.table")
        NAME.check(op[3], f"{path}.shard")
    elif op[0] == "a":
        if len(op) != 5:
            raise MessageError(path, "add column op must be ['a', table, shard, column, type]")
        NAME.check(op[1], f"{path}.table")
        NAME.check(op[2], f"{path}.shard")
        NAME.check(op[3], f"{path}.column")
        Text(16, 1).check(op[4], f"{path}.type")
    elif op[0] == "d":
        if len(op) != 3:
            raise MessageError(path, "delete op must be ['d', table, key]")
        NAME.check(op[1], f"{path}.table")
        SCALAR.check(op[2], f"{path}.key")
    else:
        if len(op) != 5:
            raise MessageError(path, "create op must be ['c', table, shard, key, columns]")
        NAME.check(op[1], f"{path}.table")
        NAME.check(op[2], f"{path}.shard")
        NAME.check(op[3], f"{path}.key")
        ListOf(COLUMN, COLUMNS_MAX).check(op[4], f"{path}.columns")


ENTRY_WIRE = _Entry()
RANGE_BOUND = SCALAR


# -- the schema: one entry per kind ------------------------------------------------------------


@dataclass(frozen=True)
class KindSchema:
    """Everything known about one message kind: its fields and what it is for."""

    kind: str
    purpose: str
    fields: tuple[tuple[str, Spec, bool], ...]
    reply: bool = False  # a reply kind (answers, not requests)
    fields_class: type | None = None


def _attribute(name: str) -> str:
    """The dataclass attribute of a wire field: ``from`` is a Python keyword, so it is ``from_``."""
    return f"{name}_" if keyword.iskeyword(name) else name


def _kind(kind: str, purpose: str, *fields: tuple[str, Spec, bool], reply: bool = False) -> KindSchema:
    class_name = "".join(part.capitalize() for part in kind.split("_")) + "Fields"
    fields_class = dataclasses.make_dataclass(
        class_name,
        [(_attribute(name), Any, dataclasses.field(default=None)) for name, _, _ in fields],
        frozen=True,
    )
    fields_class.__module__ = __name__
    return KindSchema(kind, purpose, tuple(fields), reply, fields_class)


_READ_OPTIONS = (
    OPTIONAL_FORWARDED,
    ("consistency", CONSISTENCY, False),
    ("min_key", TX_KEY, False),
    ("wait_ms", WAIT_MS, False),
)

_SCHEMA_LIST = [
    # client requests
    _kind(
        "transact",
        "a transaction: guards and ops over one shard",
        ("guards", ListOf(GUARD, OPS_MAX), False),
        ("ops", ListOf(OP, OPS_MAX), True),
        OPTIONAL_FORWARDED,
    ),
    _kind(
        "create_table",
        "create a table",
        ("table", NAME, True),
        ("key", NAME, True),
        ("columns", ListOf(COLUMN, COLUMNS_MAX), True),
        ("shard", NAME, False),
        OPTIONAL_FORWARDED,
    ),
    _kind(
        "drop_table",
        "drop a table and its rows (a replicated schema change, like create_table)",
        ("table", NAME, True),
        OPTIONAL_FORWARDED,
    ),
    _kind(
        "create_index",
        "create a secondary index of a table (a replicated schema change, like create_table)",
        ("index", NAME, True),
        ("table", NAME, True),
        ("columns", ListOf(NAME, INDEX_COLUMNS_MAX, 1), True),
        OPTIONAL_FORWARDED,
    ),
    _kind(
        "drop_index", "drop a secondary index (a replicated schema change)", ("index", NAME, True), OPTIONAL_FORWARDED
    ),
    _kind(
        "add_column",
        "add a nullable column to a table (a replicated schema change; existing rows hold null)",
        ("table", NAME, True),
        ("column", NAME, True),
        ("type", Text(16, 1), True),
        OPTIONAL_FORWARDED,
    ),
    _kind("list_tables", "the catalog"),
    _kind("get", "one row by key", ("table", NAME, True), ("key", SCALAR, True), *_READ_OPTIONS),
    _kind(
        "scan",
        "a page of rows in key order",
        ("table", NAME, True),
        ("after", SCALAR, False),
        ("limit", LIMIT, False),
        *_READ_OPTIONS,
    ),
    _kind("count", "the number of rows of a table, counted by SQLite", ("table", NAME, True), *_READ_OPTIONS),
    # read-only SQL (rlog.query): the first page of a statement's rows, then the next pages by cursor
    _kind(
        "query",
        "a read-only SQL statement and its bound parameters; answered with its first page of rows",
        ("sql", Text(QUERY_SQL_CHARS_MAX, 1), True),
        ("params", ListOf(SCALAR, QUERY_PARAMS_MAX), False),
        ("page_rows", LIMIT, False),
        *_READ_OPTIONS,
    ),
    _kind(
        "query_page",
        "the next page of a query's rows, by the cursor its previous page named",
        ("cursor", Text(QUERY_CURSOR_CHARS_MAX, 1, _NAME), True),
        ("page_rows", LIMIT, False),
    ),
    _kind(
        "query_close",
        "close a query's cursor before its last page (the node frees its snapshot)",
        ("cursor", Text(QUERY_CURSOR_CHARS_MAX, 1, _NAME), True),
    ),
    _kind("status", "the node's status"),
    # admin: the node finishes its loop turn, logs a shutdown line and exits (cli ``stop``)
    _kind("stop", "operator: shut this node down cleanly"),
    _kind("read_index", "the committed key, confirmed by the sequencer", ("shard", NAME, True), OPTIONAL_FORWARDED),
    _kind("journal", "the node's journal age per shard"),
    _kind("force_start", "operator: force this core to become sequencer"),
    _kind(
        "membership_change",
        "operator: add or remove one core in one shard (core.membership), at its sequencer",
        ("shard", NAME, True),
        ("action", Text(8, 1, choices=("add", "remove")), True),
        ("name", NAME, True),
        ("endpoint", ENDPOINT, False),
        OPTIONAL_FORWARDED,
    ),
    _kind("members", "the cluster's and each shard's core membership as this core sees it"),
    _kind(
        "backup",
        "operator: copy this node's database to a file on its host (rlog.backup); again to poll",
        ("path", Text(BACKUP_PATH_CHARS_MAX, 2, BACKUP_PATH), True),
    ),
    _kind("rlog_tail", "the newest entries of a shard", ("shard", NAME, True), ("count", LIMIT, False)),
    _kind(
        "rlog_entries",
        "entries after a key",
        ("shard", NAME, True),
        ("after", TX_KEY, False),
        ("limit", LIMIT, False),
    ),
    # replication
    _kind(
        "watch",
        "replicant -> core: start watching a shard",
        ("shard", NAME, True),
        ("replicant", NAME, True),
        ("endpoint", ENDPOINT, True),
        ("from", TX_KEY, True),
        ("from_digest", Blob(DIGEST_BYTES), True),
        ("protocol", Integer(0, 2**31), True),
        # chosen by the replica; the answer and every push of the new agent repeat it
        ("watch_id", Text(64), False),
    ),
    _kind(
        "push",
        "core agent -> replicant: committed entries (none: a heartbeat)",
        ("shard", NAME, True),
        ("agent", AGENT_ID, True),
        ("core", NAME, True),
        ("entries", ListOf(ENTRY_WIRE, PUSH_ENTRIES_MAX), True),
        ("committed", TX_KEY, True),
        ("hears_sequencer", Flag(), True),
        # the answer to the watch that created the agent (a push may overtake that answer)
        ("watch", FreeValue(depth_max=3), False),
    ),
    _kind(
        "push_ack",
        "replicant -> core agent: applied key, or why the push was rejected",
        ("shard", NAME, True),
        ("agent", AGENT_ID, True),
        ("applied", TX_KEY, True),
        ("rejected", Text(MESSAGE_CHARS_MAX), False),
    ),
    _kind(
        "bootstrap_batch",
        "a bootstrap's key-ordered dirty-read batch of one table (bootstrap.serve), answered {rows, done}",
        ("table", NAME, True),
        ("after", SCALAR, False),
        ("limit", LIMIT, True),
        ("bytes_max", Integer(1, 2**31), False),
    ),
    _kind(
        "snapshot_offer",
        "sequencer -> a follower behind its trimmed log: install a snapshot at this key (core.snapshot)",
        ("shard", NAME, True),
        ("sender", NAME, True),
        ("generation", Integer(0, 2**63 - 1), True),
        ("key", TX_KEY, True),
        ("digest", Blob(DIGEST_BYTES), True),
        # the sequencer's committed membership at key (core.membership)
        ("members", ListOf(NAME, MEMBERS_OP_MAX), False),
    ),
    # consensus
    _kind(
        "peer",
        "between cores: one consensus message of one shard, exclusion notices included (core.consensus_wire)",
        ("shard", NAME, True),
        ("sender", NAME, True),
        ("message", ListOf(FreeValue(depth_max=8), 16, 2), True),
    ),
    # range requests (rlog.range_requests)
    _kind(
        "range_digest",
        "row counts and digests of key ranges",
        ("table", NAME, True),
        ("ranges", ListOf(FreeValue(depth_max=2), RANGES_MAX, 1), True),
        ("split_parts", LIMIT, False),
        ("split_rows_min", LIMIT, False),
    ),
    _kind(
        "key_boundaries",
        "keys splitting a range into parts",
        ("table", NAME, True),
        ("parts", LIMIT, True),
        ("low", RANGE_BOUND, False),
        ("high", RANGE_BOUND, False),
    ),
    _kind(
        "row_digests",
        "per-row digests of a range",
        ("table", NAME, True),
        ("low", RANGE_BOUND, False),
        ("high", RANGE_BOUND, False),
        ("limit", LIMIT, False),
    ),
    # replies
    _kind("reply", "an answer", ("result", FreeValue(), False), reply=True),
    _kind(
        "error",
        "a refusal",
        ("code", Text(64, 1), True),
        ("message", Text(MESSAGE_CHARS_MAX * 4), True),
        ("detail", FreeValue(), False),
        reply=True,
    ),
]

SCHEMAS: dict[str, KindSchema] = {schema.kind: schema for schema in _SCHEMA_LIST}
REQUEST_KINDS = frozenset(kind for kind, schema in SCHEMAS.items() if not schema.reply)


def check_body(kind: str, body: Any) -> tuple[dict[str, Any], Any]:
    """Check ``body`` against ``kind``'s schema; return the normalised body and its frozen dataclass."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise MessageError("kind", "is not a known message kind", "unknown_kind")
    if not isinstance(body, dict):
        raise MessageError(f"{kind}", "body must be a map", "bad_frame")
    checked = check_fields(schema.fields, body, kind)
    fields_class: Callable[..., Any] = schema.fields_class  # type: ignore[assignment]
    # The body itself is returned unchanged: it has been checked field by field.
    return body, fields_class(**{_attribute(name): value for name, value in checked.items()})
