"""The receiving side's copy loop: a shard's tables, table by table, in key-ordered batches.

Theory of operation
-------------------
A ``TableCopy`` copies the tables of one shard from one core, for whoever bootstraps: a replicant's
``ShardReplica`` and a core that installs a snapshot after its peers trimmed what it needed. It is
pure: it is given the table list (``TablesReceived``) and each batch (``BatchReceived``) and returns
the effects to execute, ``FetchBatch`` (ask the core for the next batch: ``bootstrap.serve`` on the
other side) and ``ApplyBatch`` (write the rows), the request before the write of the batch that
answered the previous one, so that reading and writing overlap. A batch is accepted only if it answers the request
outstanding (same core, table and ``after``), holds at most ``batch_rows_max`` rows, every row has
the table's key column, holds a row unless it is ``done`` (the table's end), and its last key comes
after ``after`` in SQLite's key order (``sqlite_key_order``: a core cannot send the copy back and
forth for ever); anything else raises
``CopyFailed`` (the owner gives up on that core) or is ignored as a stale answer. One batch is outstanding at a time, so
memory and the core's work are bounded by one batch. ``done`` is true once every table is copied.

The copied rows are dirty reads: the owner makes them consistent by applying every entry after K0
(see ``replicant.replica``: spill and replay; a core: its log from K0 on) and serves no read until
its applied key reaches the committed key known after the copy (the read fence).
"""

from __future__ import annotations

import operator

from mnesite.rlog.messages import BatchAnswer, answer_as
from mnesite.rlog.replication import ApplyBatch, BatchReceived, FetchBatch, TablesReceived
from mnesite.rlog.schema import (
    INTEGER_MAX,
    INTEGER_MIN,
    SchemaError,
    TableSchema,
    check_one_catalog,
    name_held_elsewhere,
    shard_schema_ops_toward,
    table_from_json,
)
from mnesite.rlog.types import row_size_bytes

CopyEffect = FetchBatch | ApplyBatch


class CopyFailed(Exception):
    """The core sent something a copy cannot use; the message says what."""


def tables_from_answer(result: object, shard: str) -> tuple[TableSchema, ...]:
    """The tables of ``shard`` in a core's ``list_tables`` answer, each definition checked (the
    answer is untrusted); raises ``CopyFailed`` naming what is malformed."""
    if not isinstance(result, list):
        raise CopyFailed(f"list_tables answered {type(result).__name__}, not a list")
    try:
        tables = [table_from_json(t) for t in result]
        check_one_catalog(tables)  # each alone is not enough: applied together, their names must not meet
    except (SchemaError, KeyError, TypeError) as failure:
        raise CopyFailed(f"malformed table list: {failure}") from None
    return tuple(table for table in tables if table.shard == shard)


def copy_schema_ops(catalog: dict[str, TableSchema], shard: str, listed: tuple[TableSchema, ...]) -> tuple:
    """The ops that make the copy's tables of ``shard`` the ``listed`` ones (``shard_schema_ops_toward``);
    ``CopyFailed`` when one creates a name another shard's table or index holds here (the rule of every
    apply, ``name_held_elsewhere``): that shard's drop of it has not been applied here yet. The copy is
    refused, nothing changed, and asked again (an install's next offer, a bootstrap's next attempt),
    by when the drop has been applied; a name both shards created waits as their entries do."""
    ops = shard_schema_ops_toward(catalog, shard, listed)
    held = name_held_elsewhere(catalog, shard, ops)
    if held is not None:
        holder = f"table {held.holder!r}" if held.index is None else f"index {held.index!r} of {held.holder!r}"
        raise CopyFailed(
            f"the copy creates {held.name!r}, held here by {holder} of shard {held.holder_shard}: "
            f"copying again once shard {held.holder_shard} drops it"
        )
    return ops


def batch_from_answer(
    core: str, table: str, after: object, result: object, size_bytes: int | None = None, watch_id: str | None = None
) -> BatchReceived | None:
    """The ``bootstrap_batch`` answer ``result`` (of ``size_bytes`` on the wire, if known) to a request
    sent in the replica's attempt ``watch_id`` as a ``BatchReceived``; None if it is malformed."""
    batch = answer_as(result, BatchAnswer)
    if batch is None:
        return None
    return BatchReceived(core, table, after, tuple(batch.rows), batch.done, batch.rows_total, size_bytes, watch_id)


# The Python types a STRICT column of each type is given by SQLite (what a core's batch holds): a value of
# another type (or no SQLite value at all: a list, a map) is refused by ``rows_refusal``.
_STORED_TYPES = {
    "INTEGER": frozenset((int, type(None))),
    "REAL": frozenset((float, int, type(None))),
    "TEXT": frozenset((str, type(None))),
    "BLOB": frozenset((bytes, type(None))),
    "ANY": frozenset((int, float, str, bytes, type(None))),
}


def rows_refusal(table: TableSchema, rows: tuple[dict, ...] | list[dict]) -> str | None:
    """Why the copy's ``table`` (as listed) cannot hold a batch's ``rows``, or None. The rows are
    untrusted, and an honest core sends the table as it is at the batch: one dropped and created
    again with other column types after it was listed sends values SQLite would refuse in the
    middle of the write, out of the owner's loop turn. Checked a column at a time, before the owner
    takes the batch (``BatchAnswer`` made every row a map)."""
    for name, column_type in table.columns:
        values = list(map(operator.methodcaller("get", name), rows))
        kinds = set(map(type, values))
        stored = _STORED_TYPES.get(column_type, frozenset())
        if not kinds <= stored:
            wrong = ", ".join(sorted(kind.__name__ for kind in kinds - stored))
            return f"{table.name}.{name} is {column_type}, the batch holds {wrong}"
        if int in kinds:
            ints = [value for value in values if type(value) is int]
            if min(ints) < INTEGER_MIN or max(ints) > INTEGER_MAX:
                return f"{table.name}.{name} holds an integer out of 64-bit range"
        if name == table.key_column and type(None) in kinds:
            return f"{table.name}.{name} is the key and cannot be null"
    return None


_KEY_RANKS = {type(None): 0, bool: 1, int: 1, float: 1, str: 2, bytes: 3}


def sqlite_key_order(key: object) -> tuple[int, object] | None:
    """``key``'s place in SQLite's order of a key column (BINARY collation: NULL < numbers < TEXT <
    BLOB, numbers by value, TEXT by its UTF-8 bytes, which Python's order of code points matches);
    None for a value SQLite cannot hold."""
    rank = _KEY_RANKS.get(type(key))
    return None if rank is None else (rank, 0 if key is None else key)


class TableCopy:
    """One copy of a shard's tables from ``core``."""

    def __init__(self, core: str, batch_rows_max: int, now_ms: int) -> None:
        if batch_rows_max < 1:
            raise ValueError("batch_rows_max must be positive")
        self.core = core
        self.batch_rows_max = batch_rows_max
        self.started_ms = now_ms
        self.tables: tuple[str, ...] = ()
        self.keys: tuple[str, ...] = ()
        self.listed = False
        self.table_index = 0
        self.after: object = None
        self.rows = 0
        self.bytes = 0
        # Sum of the tables' row counts when their first batch was read (progress only), and how
        # many tables counted: a table's count comes with its first batch (None: too large to count).
        self.rows_expected = 0
        self.tables_counted = 0

    @property
    def done(self) -> bool:
        return self.listed and self.table_index >= len(self.tables)

    def progress(self, now_ms: int) -> tuple[float, int | None]:
        """(rows per second, estimated ms to go or None: not before every table's row count is known,
        or the ETA of the tables counted so far would read as the copy's)."""
        rate = self.rows * 1000 / max(1, now_ms - self.started_ms)
        eta = None
        counted = self.listed and self.tables_counted == len(self.tables)
        if counted and not self.done and rate > 0 and self.rows_expected >= self.rows:
            eta = int((self.rows_expected - self.rows) / rate * 1000)
        return round(rate, 1), eta

    def on_tables(self, event: TablesReceived) -> list[CopyEffect]:
        """The shard's tables on the core: start the copy (raises ``CopyFailed``)."""
        if len(event.keys) != len(event.tables) or len(set(event.tables)) != len(event.tables):
            raise CopyFailed(f"{event.core} sent a malformed table list (tables {event.tables!r}, keys {event.keys!r})")
        self.tables, self.keys = tuple(event.tables), tuple(event.keys)
        self.listed = True
        self.table_index = 0
        self.after = None
        return self._next()

    def answers(self, event: BatchReceived) -> bool:
        """Whether ``event`` answers the batch request outstanding (else it is a stale answer)."""
        return (
            self.listed
            and not self.done
            and event.core == self.core
            and event.table == self.tables[self.table_index]
            and event.after == self.after
        )

    def on_batch(self, event: BatchReceived) -> list[CopyEffect]:
        """Apply a batch that ``answers`` the request and ask for the next (raises ``CopyFailed``)."""
        if not self.answers(event):
            return []
        if len(event.rows) > self.batch_rows_max:
            raise CopyFailed(f"{event.core} sent {len(event.rows)} rows, more than batch_rows_max")
        key_column = self.keys[self.table_index]
        for row in event.rows:
            if not isinstance(row, dict) or key_column not in row:
                raise CopyFailed(f"{event.core} sent a row of {event.table} without its key column {key_column!r}")
        if not event.rows and not event.done:
            # A table's end is said by ``done`` (``bootstrap.serve``): an empty batch that is not done
            # would move the copy on to the next table and leave the rest of this one uncopied.
            raise CopyFailed(f"{event.core} sent an empty batch of {event.table} that is not done")
        effects: list[CopyEffect] = []
        if event.rows:
            last = sqlite_key_order(event.rows[-1][key_column])
            if last is None:
                raise CopyFailed(f"{event.core} sent a row of {event.table} whose key SQLite cannot hold")
            # Forward in the table's key order, or the copy could go back and forth for ever.
            if self.after is not None and not last > sqlite_key_order(self.after):  # type: ignore[operator]
                raise CopyFailed(
                    f"{event.core} sent a batch of {event.table} that does not advance past {self.after!r}"
                )
            effects.append(ApplyBatch(event.table, tuple(event.rows)))
            self.rows += len(event.rows)
            # The wire size when the driver measured it: estimating it row by row cost as much as
            # writing the rows.
            size = event.size_bytes
            self.bytes += size if size is not None and size >= 0 else sum(map(row_size_bytes, event.rows))
        if event.after is None and event.rows_total is not None and event.rows_total >= 0:
            self.rows_expected += event.rows_total
            self.tables_counted += 1
        if event.done:
            self.table_index += 1
            self.after = None
        else:
            self.after = event.rows[-1][key_column]
        # The next request first: a driver that sends it at once has the core read the next batch
        # while this one is written (the request reveals nothing that must be persisted first).
        return self._next() + effects

    def _next(self) -> list[CopyEffect]:
        if self.done:
            return []
        return [FetchBatch(self.core, self.tables[self.table_index], self.after, self.batch_rows_max)]
