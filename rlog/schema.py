"""Table definitions and row validation (pure: no SQLite here).

User tables are SQLite ``STRICT`` tables with one declared key column. Every value a
client sends is checked here before it reaches SQLite, so that a wrong type or an
unknown column gets a clear one-line error naming the column, and nothing changes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mnesite.rlog.types import AddColumnOp, CreateIndexOp, CreateTableOp, DropIndexOp, DropTableOp

COLUMN_TYPES = ("INTEGER", "REAL", "TEXT", "BLOB", "ANY")
KEY_TYPES = ("INTEGER", "TEXT", "BLOB")
NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}\Z")
RESERVED_PREFIX = "_mnesite"
SQLITE_RESERVED_PREFIX = "sqlite_"  # SQLite refuses to create objects whose names start with it
DEFAULT_SHARD = "default"
COLUMNS_MAX = 200
INDEX_COLUMNS_MAX = 16
INDEXES_MAX = 64  # secondary indexes of one table
INTEGER_MIN = -(2**63)
INTEGER_MAX = 2**63 - 1


class SchemaError(ValueError):
    """A table definition, a row or a key does not fit the schema. ``code`` names the kind."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_name(kind: str, name: Any) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise SchemaError("bad_request", f"invalid {kind} name {name!r}: use letters, digits and _, at most 63")
    for prefix in (RESERVED_PREFIX, SQLITE_RESERVED_PREFIX):
        if name.lower().startswith(prefix):
            raise SchemaError("bad_request", f"invalid {kind} name {name!r}: the prefix {prefix} is reserved")
    return name


def find_table(catalog: dict[str, TableSchema], name: str) -> TableSchema | None:
    """The table SQLite would consider the same as ``name``: SQLite's table names are case-insensitive."""
    table = catalog.get(name)
    if table is not None:
        return table
    folded = name.lower()
    return next((t for n, t in catalog.items() if n.lower() == folded), None)


def find_index(catalog: dict[str, TableSchema], name: str) -> tuple[TableSchema, IndexSchema] | None:
    """The table and index SQLite would consider named ``name`` (index names are case-insensitive and
    global: one namespace with the tables)."""
    folded = name.lower()
    for table in catalog.values():
        for index in table.indexes:
            if index.name.lower() == folded:
                return table, index
    return None


def check_creatable(catalog: dict[str, TableSchema], op: CreateTableOp) -> bool:
    """The one rule for creating a table, used before proposing and when applying a committed entry.

    Returns False when the same definition exists already (applying it again changes nothing);
    raises ``SchemaError`` when the definition is invalid or its name is taken in any letter case.
    """
    TableSchema.from_op(op)  # names, reserved prefixes, types, key column
    taken = find_index(catalog, op.table)
    if taken is not None:
        raise SchemaError("table_exists", f"{op.table!r} is the name of index {taken[1].name!r} of {taken[0].name!r}")
    existing = find_table(catalog, op.table)
    if existing is None:
        return True
    if existing.to_op() == op:
        return False
    raise SchemaError(
        "table_exists", f"table {op.table!r} already exists (as {existing.name!r} in shard {existing.shard!r})"
    )


@dataclass(frozen=True)
class NameHeld:
    """A committed entry's new name held, in this node's catalog, by another shard's table or index."""

    name: str  # as the entry's op spells it
    holder: str  # the table that holds it, or whose index it is
    holder_shard: str
    index: str | None = None  # the holding index's name when an index holds it


def _holder_of(catalog: dict[str, TableSchema], name: str) -> NameHeld | None:
    """What holds ``name`` in any letter case: a table, or an index (one namespace with the tables)."""
    table = find_table(catalog, name)
    if table is not None:
        return NameHeld(name, table.name, table.shard)
    found = find_index(catalog, name)
    if found is not None:
        return NameHeld(name, found[0].name, found[0].shard, found[1].name)
    return None


def name_held_elsewhere(catalog: dict[str, TableSchema], shard: str, ops: Sequence[Any]) -> NameHeld | None:
    """The one rule for a committed entry of ``shard`` that creates a name another shard holds here,
    run by every apply path before the entry (``Store``): not None means the shard's apply waits at the
    entry (it and the shard's later entries stay committed but unapplied) instead of failing.

    Names are one SQLite namespace per node, but each shard has its own log, applied independently: a
    table (or index) dropped in shard A and then created in shard B may reach a node in the other
    order. B's sequencer checked the name against its own applied catalog (``check_creatable``), so a
    create waits only for a drop that committed before it was proposed: the waits follow commit order
    and cannot form a cycle, and once A's drop applies the create applies too (the driver retries a
    waiting shard once an apply lets its name go). Two shards creating one name at about
    the same time (each sequencer's check passed) leave a wait that only a drop of one of them ends.

    A name that the same shard holds is no wait: the shard's sequencer checked it, so the ``check_``
    rules decide (a replay changes nothing, anything else is a broken log). Other shards' names do not
    change while one shard's entries apply, so the catalog before a run of entries decides for all.
    """
    for op in ops:
        if isinstance(op, CreateTableOp):
            name = op.table
        elif isinstance(op, CreateIndexOp):
            name = op.index
        else:
            continue
        held = holder_elsewhere(catalog, shard, name)
        if held is not None:
            return held
    return None


def holder_elsewhere(catalog: dict[str, TableSchema], shard: str, name: str) -> NameHeld | None:
    """What of another shard than ``shard`` holds ``name`` here (``name_held_elsewhere``'s test of one name)."""
    held = _holder_of(catalog, name)
    return held if held is not None and held.holder_shard != shard else None


@dataclass(frozen=True)
class Lifetime:
    """A name a shard's op creates while another shard holds it at this node, from that create to the
    op that ends it in the same shard: for a table, its drop; for an index, its drop or its table's."""

    name: str  # folded (SQLite's names are case-insensitive)
    table: str  # folded: the table itself, or the index's table
    index: bool
    key_column: str | None  # a table's: the changefeed keys its writes with it (``Store.key_column_at``)

    @staticmethod
    def of(op: CreateTableOp | CreateIndexOp) -> Lifetime:
        if isinstance(op, CreateTableOp):
            return Lifetime(op.table.lower(), op.table.lower(), False, op.key_column)
        return Lifetime(op.index.lower(), op.table.lower(), True, None)

    def covers(self, op: Any) -> bool:
        """Whether ``op`` is one of this lifetime's: every op on the table, or the index's create and drop."""
        if self.index:
            return type(op) in (CreateIndexOp, DropIndexOp) and op.index.lower() == self.name
        table = getattr(op, "table", None)  # every op on a table names it; membership and version ops none
        return table is not None and table.lower() == self.name

    def ended_by(self, op: Any) -> bool:
        if type(op) is DropTableOp:
            return op.table.lower() == self.table
        return self.index and type(op) is DropIndexOp and op.index.lower() == self.name


@dataclass(frozen=True)
class LifetimeSkip:
    """What ``lifetime_end`` found: apply the entries from the waiting one through ``end`` with ``ops``
    (one tuple per entry, the lifetimes' ops left out); ``dropped`` are the tables whose skipped drop
    the store records as it records an applied one: (index of the entry, table as dropped, key column)."""

    end: int
    ops: tuple[tuple[Any, ...], ...]
    dropped: tuple[tuple[int, str, str], ...]


def _created_name(op: Any) -> str | None:
    if isinstance(op, CreateTableOp):
        return op.table
    if isinstance(op, CreateIndexOp):
        return op.index
    return None


def lifetime_end(
    catalog: dict[str, TableSchema], shard: str, entries: Sequence[Any], start: int
) -> LifetimeSkip | NameHeld:
    """``entries[start]``, a committed entry of ``shard``, creates a name another shard holds here
    (``name_held_elsewhere``): the span to apply instead of waiting, or the name whose lifetime is
    not closed yet (the shard waits, until another shard lets that name go or a drop commits).

    ``entries`` must be committed entries only, in order: an uncommitted drop may be truncated, and
    the name would then be the shard's for good. Among them, the first op of ``shard`` that ends the
    name it creates (``Lifetime``) closes its lifetime: the span runs from ``entries[start]`` through
    the entry of that op, with every op of the lifetime left out (``Lifetime.covers``) and the others
    applied as usual. A name created again inside the span while another shard holds it opens a
    lifetime of its own, which the span must close too (or the shard waits for that name).

    Why it is safe: the other shard holds the name here only because this node applied its create
    first, and its sequencer checked the name against its own catalog, where this shard's drop had
    applied (so the drop came first in causal order), or both shards created it at about the same
    time and an operator dropped it in this one (the documented remedy). Either way the lifetime left
    out ends within the span: applying the span leaves the state commit order leaves (this shard's
    table or index is gone after its drop, the other shard keeps the name), and the span is applied
    whole, so the applied key never stops inside a lifetime (a restart meets its create again).
    Meanwhile a node shows the lifetime's writes only as their entries in the log (and changefeed):
    reads of the name see the other shard's table, as they would once the drop applied.
    """
    active: list[Lifetime] = []
    held: dict[Lifetime, NameHeld] = {}
    kept_ops: list[tuple[Any, ...]] = []
    dropped: list[tuple[int, str, str]] = []
    for index in range(start, len(entries)):
        kept = []
        for op in entries[index].ops:
            ended = [lifetime for lifetime in active if lifetime.ended_by(op)]
            covering = next((lifetime for lifetime in active if lifetime.covers(op)), None)
            name = _created_name(op) if covering is None else None
            if covering is not None:
                if type(op) is DropTableOp and covering.key_column is not None:
                    dropped.append((index, op.table, covering.key_column))
            elif name is not None and (holder := holder_elsewhere(catalog, shard, name)) is not None:
                active.append(Lifetime.of(op))
                held[active[-1]] = holder
            else:
                kept.append(op)
            for lifetime in ended:
                active.remove(lifetime)
        kept_ops.append(tuple(kept))
        if not active:
            return LifetimeSkip(index, tuple(kept_ops), tuple(dropped))
    return held[active[0]]


def may_end_lifetime(ops: Sequence[Any]) -> bool:
    """Whether ``ops`` can end a lifetime (``Lifetime.ended_by``): a waiting shard's new committed
    entries are worth a look ahead again only then (``Store.name_wait_may_end``)."""
    return any(type(op) in (DropTableOp, DropIndexOp) for op in ops)


def check_droppable(catalog: dict[str, TableSchema], op: DropTableOp) -> bool:
    """The one rule for dropping a table, used before proposing and when applying a committed entry.

    The name must be the table's exact name (no case folding: dropping is not a guess) and the shard
    its shard. Returns False when no table of any letter case has that name (applying the drop again,
    or replaying it over a copy made after it, changes nothing); raises ``SchemaError`` when the name
    belongs to a table of another shard or differs in letter case.
    """
    check_name("table", op.table)
    check_name("shard", op.shard)
    existing = find_table(catalog, op.table)
    if existing is None:
        return False
    if existing.name != op.table or existing.shard != op.shard:
        raise SchemaError(
            "bad_request", f"table {op.table!r} of shard {op.shard!r} is {existing.name!r} of shard {existing.shard!r}"
        )
    return True


def _table_of_op(catalog: dict[str, TableSchema], table: str, shard: str, what: str) -> TableSchema:
    """The table a schema-change op names: its exact name (no case folding) and its shard."""
    check_name("table", table)
    check_name("shard", shard)
    existing = catalog.get(table)
    if existing is None:
        raise SchemaError("unknown_table", f"cannot {what}: unknown table {table!r}")
    if existing.shard != shard:
        raise SchemaError(
            "bad_request", f"cannot {what}: table {table!r} is of shard {existing.shard!r}, not {shard!r}"
        )
    return existing


def check_index_creatable(catalog: dict[str, TableSchema], op: CreateIndexOp) -> bool:
    """The one rule for creating a secondary index, before proposing and when applying.

    False when the same index exists already (a replay changes nothing); ``SchemaError`` when the table
    is unknown, a column is not the table's, or the name is taken by another index or any table.
    """
    check_name("index", op.index)
    table = _table_of_op(catalog, op.table, op.shard, f"create index {op.index!r}")
    if not 1 <= len(op.columns) <= INDEX_COLUMNS_MAX:
        raise SchemaError("bad_request", f"an index has 1..{INDEX_COLUMNS_MAX} columns, got {len(op.columns)}")
    types = table.column_types
    for column in op.columns:
        if column not in types:
            raise SchemaError("unknown_column", f"{table.name} has no column {column!r}")
    if len({column.lower() for column in op.columns}) != len(op.columns):
        raise SchemaError("bad_request", f"index {op.index!r} names a column twice")
    found = find_index(catalog, op.index)
    if found is not None:
        if found[0].name == op.table and found[1] == IndexSchema(op.index, op.columns):
            return False
        raise SchemaError("index_exists", f"index {found[1].name!r} already exists (on {found[0].name!r})")
    if find_table(catalog, op.index) is not None:
        raise SchemaError("index_exists", f"{op.index!r} is the name of a table")
    if len(table.indexes) >= INDEXES_MAX:
        raise SchemaError("bad_request", f"{table.name} has {INDEXES_MAX} indexes already (the most)")
    return True


def check_index_droppable(catalog: dict[str, TableSchema], op: DropIndexOp) -> bool:
    """The one rule for dropping a secondary index: False when it does not exist (a replay); the exact
    name, table and shard otherwise."""
    check_name("index", op.index)
    found = find_index(catalog, op.index)
    if found is None:
        return False
    table, index = found
    if index.name != op.index or table.name != op.table or table.shard != op.shard:
        raise SchemaError(
            "bad_request", f"index {op.index!r} of {op.table!r} is {index.name!r} of {table.name!r} ({table.shard!r})"
        )
    return True


def check_column_addable(catalog: dict[str, TableSchema], op: AddColumnOp) -> bool:
    """The one rule for adding a column: False when the table has it already with that type (a replay)."""
    check_name("column", op.column)
    table = _table_of_op(catalog, op.table, op.shard, f"add column {op.column!r}")
    if op.column_type not in COLUMN_TYPES:
        raise SchemaError(
            "bad_request", f"column {op.column!r} has type {op.column_type!r}; use one of {', '.join(COLUMN_TYPES)}"
        )
    for name, column_type in table.columns:
        if name.lower() == op.column.lower():
            if name == op.column and column_type == op.column_type:
                return False
            raise SchemaError("column_exists", f"{table.name} has a column {name!r} ({column_type}) already")
    if len(table.columns) >= COLUMNS_MAX:
        raise SchemaError("bad_request", f"a table has at most {COLUMNS_MAX} columns")
    return True


@dataclass(frozen=True)
class IndexSchema:
    """A secondary index: its name and its columns, in order."""

    name: str
    columns: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "columns": list(self.columns)}


@dataclass(frozen=True)
class TableSchema:
    name: str
    shard: str
    key_column: str
    columns: tuple[tuple[str, str], ...]
    indexes: tuple[IndexSchema, ...] = ()

    @functools.cached_property  # read for every row checked (not a field: equality stays the columns')
    def column_types(self) -> dict[str, str]:
        return dict(self.columns)

    @functools.cached_property
    def key_type(self) -> str:
        return self.column_types[self.key_column]

    def to_op(self) -> CreateTableOp:
        return CreateTableOp(self.name, self.shard, self.key_column, self.columns)

    def index_ops(self) -> tuple[CreateIndexOp, ...]:
        """The ops that create this table's secondary indexes (after ``to_op``), as a copy needs them."""
        return tuple(CreateIndexOp(index.name, self.name, self.shard, index.columns) for index in self.indexes)

    def changed_by(self, op: AddColumnOp | CreateIndexOp | DropIndexOp) -> TableSchema:
        """This table after a schema-change op the rules above accepted."""
        if isinstance(op, AddColumnOp):
            return dataclasses.replace(self, columns=(*self.columns, (op.column, op.column_type)))
        if isinstance(op, CreateIndexOp):
            return dataclasses.replace(self, indexes=(*self.indexes, IndexSchema(op.index, op.columns)))
        return dataclasses.replace(self, indexes=tuple(i for i in self.indexes if i.name != op.index))

    @classmethod
    def from_op(cls, op: CreateTableOp) -> TableSchema:
        return define_table(op.table, op.key_column, list(op.columns), op.shard)

    def to_json(self) -> dict[str, Any]:
        described: dict[str, Any] = {
            "table": self.name,
            "shard": self.shard,
            "key": self.key_column,
            "columns": [[n, t] for n, t in self.columns],
        }
        if self.indexes:
            described["indexes"] = [index.to_json() for index in self.indexes]
        return described


def define_table(name: Any, key_column: Any, columns: Any, shard: Any = DEFAULT_SHARD) -> TableSchema:
    """Validate a table definition. ``columns`` is a list of ``(name, type)``; the key may be among them."""
    check_name("table", name)
    check_name("column", key_column)
    check_name("shard", shard)
    if not isinstance(columns, (list, tuple)):
        raise SchemaError("bad_request", "columns must be a list of [name, type]")
    declared: list[tuple[str, str]] = []
    seen: set[str] = set()
    for column in columns:
        if not isinstance(column, (list, tuple)) or len(column) != 2:
            raise SchemaError("bad_request", f"column {column!r} must be [name, type]")
        column_name, column_type = column
        check_name("column", column_name)
        if not isinstance(column_type, str) or column_type.upper() not in COLUMN_TYPES:
            raise SchemaError(
                "bad_request", f"column {column_name!r} has type {column_type!r}; use one of {', '.join(COLUMN_TYPES)}"
            )
        if column_name.lower() in seen:
            raise SchemaError("bad_request", f"column {column_name!r} is declared twice")
        seen.add(column_name.lower())
        declared.append((column_name, column_type.upper()))
    if key_column.lower() not in seen:
        # An undeclared key column defaults to TEXT and comes first.
        declared.insert(0, (key_column, "TEXT"))
    key_type = dict(declared).get(key_column)
    if key_type is None:
        raise SchemaError("bad_request", f"key column {key_column!r} differs in case from its declaration")
    if key_type not in KEY_TYPES:
        raise SchemaError("bad_request", f"key column {key_column!r} must be INTEGER, TEXT or BLOB, not {key_type}")
    if len(declared) > COLUMNS_MAX:
        raise SchemaError("bad_request", f"a table has at most {COLUMNS_MAX} columns")
    return TableSchema(name, shard, key_column, tuple(declared))


def table_from_json(value: Any) -> TableSchema:
    """A table of a ``list_tables`` answer (another node's: untrusted), checked like a definition;
    raises ``SchemaError`` (or ``KeyError``/``TypeError`` on a malformed answer)."""
    table = define_table(value["table"], value["key"], value["columns"], value["shard"])
    indexes = value.get("indexes", [])
    if not isinstance(indexes, list) or len(indexes) > INDEXES_MAX:
        raise SchemaError("bad_request", f"indexes of {table.name!r} must be a list of at most {INDEXES_MAX}")
    catalog = {table.name: table}
    for index in indexes:
        op = CreateIndexOp(index["name"], table.name, table.shard, tuple(index["columns"]))
        if check_index_creatable(catalog, op):
            catalog[table.name] = catalog[table.name].changed_by(op)
    return catalog[table.name]


def check_one_catalog(tables: Sequence[TableSchema]) -> None:
    """Raise ``SchemaError`` when ``tables``, each valid alone (``table_from_json``), cannot be one
    catalog: a table listed twice, or a name taken by another table or index in any letter case (the
    rules of ``check_creatable`` and ``check_index_creatable``, which applying them would meet)."""
    catalog: dict[str, TableSchema] = {}
    for table in tables:
        if not check_creatable(catalog, table.to_op()):
            raise SchemaError("table_exists", f"table {table.name!r} is listed twice")
        catalog[table.name] = dataclasses.replace(table, indexes=())
        for op in table.index_ops():
            check_index_creatable(catalog, op)
            catalog[table.name] = catalog[table.name].changed_by(op)


def schema_ops_toward(local: TableSchema | None, listed: TableSchema) -> tuple[Any, ...]:
    """The ops that make a copy's table (``local``; None: it has none) the ``listed`` one: a bootstrap
    or snapshot install takes the tables as a core lists them, and the replay from its start key only
    brings the changes made after that. Columns are only ever added; indexes are created and dropped."""
    if local is None:
        return (listed.to_op(), *listed.index_ops())
    have = {name for name, _ in local.columns}
    ops: list[Any] = [
        AddColumnOp(listed.name, listed.shard, name, column_type)
        for name, column_type in listed.columns
        if name not in have
    ]
    wanted = {index.name: index for index in listed.indexes}
    ops += [DropIndexOp(i.name, local.name, local.shard) for i in local.indexes if wanted.get(i.name) != i]
    current = set(local.indexes)
    ops += [op for op in listed.index_ops() if IndexSchema(op.index, op.columns) not in current]
    return tuple(ops)


def shard_schema_ops_toward(
    catalog: dict[str, TableSchema], shard: str, listed: Sequence[TableSchema]
) -> tuple[Any, ...]:
    """The ops that make a copy's tables of ``shard`` (in ``catalog``) the ``listed`` ones, as a core
    lists them to a bootstrap or a snapshot install (which deleted the copy's rows of the shard first).

    A table of the shard the core does not list was dropped meanwhile: it is dropped (no entry after
    the copy's start key would drop it). A listed table the copy holds under the same name as another
    table (another key column, a column the listed one lacks or declares with another type: it was
    dropped and created again meanwhile, since columns are only ever added) is dropped and created as
    listed; its old key would otherwise stay the key of the copied rows. Every other table is brought
    to its listed definition by ``schema_ops_toward``. Every drop (of a table, then of an index) comes
    before every creation: a name may come back in another letter case, and index names are one
    namespace with the tables' (an index dropped from one table and made on another, or a table made
    under the name of a dropped index, would otherwise meet its old holder when the listed order
    reaches the new one first)."""
    wanted = {table.name: table for table in listed}
    dropped = [
        DropTableOp(name, shard)
        for name, local in catalog.items()
        if local.shard == shard and (name not in wanted or not _same_table(local, wanted[name]))
    ]
    gone = {op.table for op in dropped}
    ops: list[Any] = list(dropped)
    for table in listed:
        ops += schema_ops_toward(None if table.name in gone else catalog.get(table.name), table)
    return tuple(sorted(ops, key=lambda op: _COPY_OP_PHASES[type(op)]))  # stable: each phase keeps its order


# The order of the phases of ``shard_schema_ops_toward``'s ops: drops, then the tables, then their indexes.
_COPY_OP_PHASES = {DropTableOp: 0, DropIndexOp: 1, CreateTableOp: 2, AddColumnOp: 2, CreateIndexOp: 3}


def _same_table(local: TableSchema, listed: TableSchema) -> bool:
    """Whether ``listed`` can be ``local`` with columns added (and indexes changed), not a table made anew."""
    types = listed.column_types
    return local.key_column == listed.key_column and all(types.get(name) == kind for name, kind in local.columns)


# The value types a column type takes as they are (a bool is not an int here: type() is exact).
_AS_IS = {"TEXT": str, "BLOB": bytes, "ANY": str}


def check_value(table: TableSchema, column: str, column_type: str, value: Any) -> Any:
    """Return ``value`` normalised for ``column_type`` or raise ``SchemaError('wrong_type')``."""
    if value is None or type(value) is _AS_IS.get(column_type):
        return value
    if type(value) is int and column_type in ("INTEGER", "ANY") and INTEGER_MIN <= value <= INTEGER_MAX:
        return value
    where = f"{table.name}.{column}"
    if isinstance(value, bool):
        raise SchemaError("wrong_type", f"{where} is {column_type}; booleans are not stored, use 0 or 1")
    if column_type == "INTEGER":
        if isinstance(value, int) and INTEGER_MIN <= value <= INTEGER_MAX:
            return value
        raise SchemaError("wrong_type", f"{where} is INTEGER (64-bit), got {type(value).__name__} {value!r:.60}")
    if column_type == "REAL":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            result = float(value)
            if math.isnan(result):
                raise SchemaError("wrong_type", f"{where} is REAL; NaN cannot be stored")
            return result
        raise SchemaError("wrong_type", f"{where} is REAL, got {type(value).__name__} {value!r:.60}")
    if column_type == "TEXT":
        if isinstance(value, str):
            return value
        raise SchemaError("wrong_type", f"{where} is TEXT, got {type(value).__name__} {value!r:.60}")
    if column_type == "BLOB":
        if isinstance(value, bytes):
            return value
        raise SchemaError("wrong_type", f"{where} is BLOB, got {type(value).__name__} {value!r:.60}")
    # ANY: any scalar SQLite can hold.
    if isinstance(value, (int, float, str, bytes)):
        if isinstance(value, int) and not INTEGER_MIN <= value <= INTEGER_MAX:
            raise SchemaError("wrong_type", f"{where}: integer out of 64-bit range")
        if isinstance(value, float) and math.isnan(value):
            raise SchemaError("wrong_type", f"{where}: NaN cannot be stored")
        return value
    raise SchemaError("wrong_type", f"{where} holds scalars only, got {type(value).__name__}")


def check_key(table: TableSchema, key: Any) -> Any:
    if key is None:
        raise SchemaError("wrong_type", f"{table.name}.{table.key_column} is the key and cannot be null")
    return check_value(table, table.key_column, table.key_type, key)


def check_row(table: TableSchema, row: Any) -> dict[str, Any]:
    """Validate a client row and return the full row: every declared column, missing ones as null."""
    if not isinstance(row, dict):
        raise SchemaError("wrong_type", f"a row of {table.name} must be an object, got {type(row).__name__}")
    types = table.column_types
    for column in row:
        if column not in types:
            raise SchemaError("unknown_column", f"{table.name} has no column {column!r}")
    full = {name: check_value(table, name, column_type, row.get(name)) for name, column_type in table.columns}
    if full[table.key_column] is None:
        check_key(table, None)  # its refusal
    return full
