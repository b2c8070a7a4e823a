"""The changefeed: every committed change of some tables, in log order, page by page (pure; no I/O).

Theory of operation
-------------------
A consumer reads a changefeed from any node, core or replicant, with ``changes`` requests. The node
keeps **nothing** per consumer between pages: the request carries the consumer's position, one
``ChangesPosition`` per shard, and the answer carries the next positions. A consumer can therefore
resume anywhere, on any node, from the last positions it received (failover included), and a slow
consumer costs a node nothing while it is not asking; each page is bounded in records and bytes
(``changes_page_records_max``, ``changes_page_bytes_max``), so the pull is the flow control: one
page per consumer in flight at most, of at most those bounds.

Order. Within a shard, records come in tx-key order (the rlog's), and a position moves only past
whole entries, so resuming strictly after the last tx key delivered neither repeats nor skips a
change (an entry's ops travel in one page). An entry whose records are more bytes than a page holds
(they could outgrow a frame) goes over several pages, each alone: the position between them stays
before the entry and counts its records delivered (``records_after``). Across shards there is no order:
a page holds each shard's next changes side by side (each shard a fair share of the page), and the
resume position is the vector of per-shard positions.

Records (plain dicts, so they go on the wire as they are):

* ``change``: ``shard``, ``tx_key``, ``table``, ``op`` (``write``, ``delete``, ``create_table``,
  ``drop_table``, ``add_column``), ``key`` and ``row`` (the full row written; null for a delete).
  A write is the whole row after the transaction (entries carry results), so a consumer that
  applies changes in order holds exactly the table.
* ``snapshot_begin`` (``shard``, ``tables``, ``tx_key`` K0, ``reason``): the shard's position is
  no longer in this node's log (trimmed), so the consumer was **behind**, or it is not in this node's
  history at all (the log does not chain from it: a force-start discarded the entries the consumer
  read, or they came from another history); it receives a copy of the shard's requested tables
  instead. It must drop what it holds of them.
* ``snapshot`` (``shard``, ``table``, ``op``, ``key``, ``row``, ``tx_key``): one row of the copy,
  then the entries after K0 that heal it (``op`` write or delete, ``tx_key`` set).
* ``snapshot_end`` (``shard``, ``tx_key`` K1): the consumer now holds the tables exactly as they
  were at K1; ``change`` records after K1 follow.

The copy reuses the bootstrap's serving side (``bootstrap.serve.read_batch``, passed in by the
driver as ``FeedReader.table_batch``: rlog imports nothing above it): key-ordered dirty-read batches
of each table, table by table (by name), then the entries from K0 to the applied key K1 found when
the copy ended. Entries are results, so replaying them over the dirty reads leaves exactly the
state at K1, as for a replicant's bootstrap. If K0 itself is trimmed before the replay reaches it,
the copy cannot be healed: the snapshot starts again (a new ``snapshot_begin`` saying so).

The position is checked against the log, not trusted: every entry names the key before it
(``prev``), so the first entry read after a position must name that position. A key is made once,
by its generation's one sequencer, and generations only grow, so a key the log does not chain from
is not in this history; serving the entries after it would leave the consumer holding changes that
no longer happened. That costs no read of its own.

A node serves entries up to its **applied** key only: every applied entry is committed, on a
replicant as on a core, so no consumer ever sees a change that a failover could undo, and a consumer
that reads a table after a change finds it there. The applied key is the store's, not how far the
log goes: a shard whose apply waits at a name another shard holds (``Store.name_waits``) logs
committed entries it does not apply, and they are served once the wait ends. A position
beyond the node's applied key (a consumer moving to a node that is behind) gets empty pages until
the node catches up.

Driver contract (``rlog.server.NodeServer.changes_request`` and ``serve_changes``): decode the
request, call ``build_page`` inside the turn (the reads see the applied state), answer the page
unless ``keep_holding`` says to hold it (nothing for this feed yet and ``wait_ms`` not over); page a
held request again when ``worth_a_page`` says so (a shard it follows moved, a new shard appeared, a
shard it follows stopped being served here for a while (``NodeServer.shards_not_serving_changes``),
or its wait ended), from the positions its last page reached (a held page holds no record, so
nothing is skipped; paged from the request's own positions, every turn re-read all the entries
since, up to 2,000 per shard).
Held requests are bounded by ``changes_waiting_max``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mnesite.rlog.messages import ChangesPosition
from mnesite.rlog.schema import SchemaError, TableSchema, check_key
from mnesite.rlog.types import (
    AddColumnOp,
    CreateTableOp,
    DeleteOp,
    DropTableOp,
    Entry,
    TxKey,
    WriteOp,
    row_size_bytes,
)
from msgspec.structs import replace

# Entries read from the log per step while filling a page; with table filters most may hold nothing
# for the consumer, so a page also stops after ENTRIES_SCANNED_MAX entries of one shard (all its
# phases together: a live position, or a replay and the live entries after it).
ENTRIES_STEP = 256
ENTRIES_SCANNED_MAX = 2000
# A record's bytes beyond its row: the field names and the small values (an estimate, for the bound).
RECORD_OVERHEAD_BYTES = 64
RECORD_KINDS = ("change", "snapshot_begin", "snapshot", "snapshot_end")


class ChangesError(Exception):
    """A changefeed request that cannot be served; ``code`` is the error code to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class FeedReader(Protocol):
    """What ``build_page`` reads from the node (the store, and the bootstrap's batch reader)."""

    def catalog(self) -> Mapping[str, TableSchema]: ...

    def shard_names(self) -> Iterable[str]: ...

    def applied(self, shard: str) -> TxKey | None: ...

    def trimmed(self, shard: str) -> TxKey: ...

    def key_column_at(self, shard: str, table: str, tx_key: TxKey) -> str | None: ...

    def entries_after(self, shard: str, after: TxKey, limit: int, up_to: TxKey) -> list[Entry]: ...

    def table_batch(self, table: TableSchema, after: Any, rows_max: int, bytes_max: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PageLimits:
    records_max: int
    bytes_max: int

    def __post_init__(self) -> None:
        if self.records_max < 1 or self.bytes_max < 1:
            raise ValueError("records_max and bytes_max must be positive")


@dataclass
class Page:
    """One answer: the records, each shard's next position, and each shard's applied key here."""

    records: list[dict[str, Any]] = field(default_factory=list)
    positions: list[ChangesPosition] = field(default_factory=list)
    applied: dict[str, TxKey] = field(default_factory=dict)
    bytes: int = 0

    @property
    def caught_up(self) -> bool:
        """No record, and no shard can move before this node applies more: worth waiting for."""
        return not self.records and all(
            position.after >= self.applied.get(position.shard, position.after) for position in self.positions
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "positions": [position_to_wire(position) for position in self.positions],
            "applied": {shard: list(key) for shard, key in self.applied.items()},
        }


def position_to_wire(position: ChangesPosition) -> dict[str, Any]:
    wire: dict[str, Any] = {"shard": position.shard, "after": list(position.after)}
    if position.phase != "live":
        wire["phase"] = position.phase
    if position.table is not None:
        wire["table"] = position.table
        wire["table_after"] = position.table_after
    if position.records_after is not None:
        wire["records_after"] = position.records_after
    if position.replay_to is not None:
        wire["replay_to"] = list(position.replay_to)
    return wire


def live(shard: str, after: TxKey) -> ChangesPosition:
    return ChangesPosition(shard=shard, after=TxKey(*after))


def copy_start(snapshot_begin: Mapping[str, Any]) -> ChangesPosition:
    """The position a ``snapshot_begin`` record starts: its first table from the start (none: the
    replay), K0 its key. The node moves a page's position there, and a consumer's cursor moves there
    as the record is handed over (``rlog.client.ChangeFeed``): once a consumer has dropped what it held
    of the tables, no resume may go back to the position before the copy, which another node may
    still hold (cores trim each by itself) and would answer with changes on top of emptied tables."""
    shard, tables, k0 = snapshot_begin["shard"], snapshot_begin["tables"], TxKey(*snapshot_begin["tx_key"])
    if not tables:
        return ChangesPosition(shard=shard, after=k0, phase="replay", replay_to=k0)
    return ChangesPosition(shard=shard, after=k0, phase="copy", table=tables[0], replay_to=k0)


# Empty pages in a row that a feed not following takes, inside a copy, from a node that does not
# move toward it (``copy_stalled``), before it gives up: it waits for a node that moves, never forever.
COPY_STALL_PAGES_MAX = 10


def copy_stalled(
    positions: Iterable[Mapping[str, Any]], applied_then: Mapping[str, TxKey], applied_now: Mapping[str, TxKey]
) -> str | None:
    """Why the node that answered an empty page cannot move a copy (wire ``positions``), or None: it
    has no such shard, or its applied key is behind where the copy goes on and did not move since
    the page before (``applied_then``)."""
    for position in positions:
        phase, shard = position.get("phase", "live"), position["shard"]
        if phase == "live":
            continue
        now = applied_now.get(shard)
        if now is None:
            return f"shard {shard}: the node has no such shard, inside a copy"
        target = TxKey(*(position["after"] if phase == "copy" else position["replay_to"]))
        if now < target and now == applied_then.get(shard):
            return f"shard {shard}: the node's applied key {now} is behind the copy's {target} and does not move"
    return None


def feed_shards(
    tables: Iterable[str],
    positions: Iterable[ChangesPosition],
    catalog: Mapping[str, TableSchema],
    shards: Iterable[str],
) -> list[str]:
    """The shards a feed follows, sorted: those of the named tables (every shard when none is named)
    and those it already has positions for. A named table that does not exist is an error only while
    the feed has no position yet (later it may have been dropped, which the feed itself reports)."""
    tables = list(tables)
    known = {position.shard for position in positions}
    if not tables:
        return sorted(known | set(shards))
    named = set(known)
    for table in tables:
        schema = catalog.get(table)
        if schema is not None:
            named.add(schema.shard)
        elif not known:
            raise ChangesError("unknown_table", f"unknown table {table!r}")
    return sorted(named)


def build_page(
    reader: FeedReader,
    tables: Iterable[str],
    positions: Iterable[ChangesPosition],
    limits: PageLimits,
) -> Page:
    """The next page after ``positions`` for ``tables`` (none: every table); raises ``ChangesError``."""
    positions = list(positions)
    by_shard: dict[str, ChangesPosition] = {}
    for position in positions:
        if position.shard in by_shard:
            raise ChangesError("bad_request", f"shard {position.shard!r} has two positions")
        _check_position(position)
        by_shard[position.shard] = position
    wanted = frozenset(tables)
    catalog = reader.catalog()
    shards = feed_shards(wanted, positions, catalog, reader.shard_names())
    page = Page()
    share_records = max(1, limits.records_max // max(1, len(shards)))
    share_bytes = max(1, limits.bytes_max // max(1, len(shards)))
    for shard in shards:
        applied = reader.applied(shard)
        position = by_shard.get(shard) or live(shard, TxKey(0, 0))
        if applied is None:  # a shard this node does not have (yet): nothing to say about it
            page.positions.append(position)
            continue
        page.applied[shard] = applied
        budget = _Budget(share_records, share_bytes)
        step = _ShardFeed(reader, catalog, wanted, shard, applied, budget)
        page.positions.append(step.run(position))
        page.records.extend(step.records)
        page.bytes += budget.bytes
    return page


def keep_holding(page: Page, now_ms: int, deadline_ms: int) -> bool:
    """Whether a request whose page is ``page`` is held rather than answered: nothing for it yet
    (another table moved, or a shard is still behind its position) and its wait is not over."""
    return page.caught_up and now_ms < deadline_ms


def worth_a_page(
    applied_then: Mapping[str, TxKey],
    applied_now: Mapping[str, TxKey],
    now_ms: int,
    deadline_ms: int,
    shards_then: Collection[str] | None = None,
    shards_not_serving: Collection[str] = (),
) -> bool:
    """Whether a held request's page is built again: a shard it follows moved, a shard the node did
    not have when the page was built (``shards_then``) appeared (a feed of every table follows it,
    and a position can name a shard the node had not opened yet), a shard it follows is one the
    node refuses changes of now and will not serve soon (``shards_not_serving``: a replicant's
    bootstrap reset its rows and log, a core's snapshot install deleted its rows, a core's log of
    the shard is stuck or stopped; nothing comes of it until that is over, so the request gets at
    once what one asked now gets, ``not_ready``, and its consumer may go on at another node), or its
    wait ended."""
    if now_ms >= deadline_ms:
        return True
    if any(shard in applied_then for shard in shards_not_serving):
        return True
    if shards_then is not None and any(shard not in shards_then for shard in applied_now):
        return True
    return any(shard in applied_now and applied_now[shard] > key for shard, key in applied_then.items())


def _check_position(position: ChangesPosition) -> None:
    """The shape rules a schema cannot say: which fields each phase has."""
    if position.phase == "copy" and position.table is None:
        raise ChangesError("bad_request", f"shard {position.shard!r}: a copy position names its table")
    if position.phase != "copy" and (position.table is not None or position.table_after is not None):
        raise ChangesError("bad_request", f"shard {position.shard!r}: only a copy position names a table")
    if position.phase != "live" and (position.replay_to is None or position.replay_to < position.after):
        raise ChangesError("bad_request", f"shard {position.shard!r}: a snapshot position needs replay_to >= after")
    if position.phase == "live" and position.replay_to is not None:
        raise ChangesError("bad_request", f"shard {position.shard!r}: a live position has no replay_to")
    if position.phase == "copy" and position.records_after is not None:
        raise ChangesError("bad_request", f"shard {position.shard!r}: a copy position has no records_after")


@dataclass
class _Budget:
    records_max: int
    bytes_max: int
    records: int = 0
    bytes: int = 0

    @property
    def spent(self) -> bool:
        return self.records >= self.records_max or self.bytes >= self.bytes_max

    def fits(self, records: int, size: int) -> bool:
        """Whether a group of records fits; the first group of a page always does (it goes alone)."""
        if self.records == 0:
            return True
        return self.records + records <= self.records_max and self.bytes + size <= self.bytes_max

    def take(self, records: int, size: int) -> None:
        self.records += records
        self.bytes += size


class _ShardFeed:
    """One shard's part of one page: moves its position through live, copy and replay."""

    def __init__(
        self,
        reader: FeedReader,
        catalog: Mapping[str, TableSchema],
        wanted: frozenset[str],
        shard: str,
        applied: TxKey,
        budget: _Budget,
    ) -> None:
        self.reader = reader
        self.catalog = catalog
        self.wanted = wanted
        self.shard = shard
        self.applied = applied
        self.budget = budget
        self.trimmed = reader.trimmed(shard)
        self.records: list[dict[str, Any]] = []
        # Key columns of the tables this page's entries write: from a ``CreateTableOp`` read in the page,
        # else asked of the reader at the first write of the table in the page (``_key_column``).
        self.key_columns: dict[str, str | None] = {}
        self.snapshots = 0
        self.scanned = 0  # entries read for this page (ENTRIES_SCANNED_MAX)
        # Why the position is not in this node's history (``_entries`` found the log not chaining from it).
        self.not_in_history: str | None = None

    def run(self, position: ChangesPosition) -> ChangesPosition:
        """Move ``position`` as far as the budget allows; each turn moves it or ends the shard's part."""
        while not self.budget.spent:
            if position.after < self.trimmed or self.not_in_history is not None:
                # A snapshot restarts at most twice per page (a log trimmed faster than a page is read).
                if self.snapshots >= 2:
                    return position
                position = self._begin_snapshot(position)
                continue
            if position.phase == "live":
                moved = self._entries(position, self.applied, "change")
            elif position.phase == "copy":
                # A node behind the snapshot's start cannot give rows the replay from there heals.
                moved = position if self.applied < position.after else self._copy(position)
            else:
                replay_to = position.replay_to or position.after
                moved = self._entries(position, min(replay_to, self.applied), "snapshot")
                if self.not_in_history is None and moved.after >= replay_to:
                    self._emit({"kind": "snapshot_end", "shard": self.shard, "tx_key": list(replay_to)}, 0)
                    moved = live(self.shard, replay_to)
            if moved == position and self.not_in_history is None:
                return position
            position = moved
        return position

    # -- snapshot -----------------------------------------------------------------------------

    def _tables(self) -> list[TableSchema]:
        return sorted(
            (t for t in self.catalog.values() if t.shard == self.shard and (not self.wanted or t.name in self.wanted)),
            key=lambda table: table.name,
        )

    def _begin_snapshot(self, position: ChangesPosition) -> ChangesPosition:
        self.snapshots += 1
        tables = self._tables()
        if self.not_in_history is not None:
            reason, self.not_in_history = self.not_in_history, None
        elif position.phase == "live":
            reason = (
                f"position {TxKey(*position.after)} of shard {self.shard} is no longer in this node's log "
                f"(trimmed through {self.trimmed}): the consumer fell behind"
            )
        else:
            reason = f"the snapshot's start {TxKey(*position.after)} was trimmed before its copy was healed"
        reason += f"; sending a copy of the tables at {self.applied}, then the changes after it"
        record = {
            "kind": "snapshot_begin",
            "shard": self.shard,
            "tables": [table.name for table in tables],
            "tx_key": list(self.applied),
            "reason": reason,
        }
        self._emit(record, 0)
        return copy_start(record)

    def _copy(self, position: ChangesPosition) -> ChangesPosition:
        table = self.catalog.get(position.table or "")
        if table is None or table.shard != self.shard:
            # Dropped while copied: its drop is among the entries the replay delivers.
            return self._next_table(_seen(position, self.applied))
        after = position.table_after
        if after is not None:
            try:  # the client's value: the same check as a bootstrap batch's ``after``
                after = check_key(table, after)
            except SchemaError as error:
                raise ChangesError("bad_request", f"shard {self.shard!r}: table_after: {error}") from None
        rows_max = max(1, self.budget.records_max - self.budget.records)
        bytes_max = max(1, self.budget.bytes_max - self.budget.bytes)
        batch = self.reader.table_batch(table, after, rows_max, bytes_max)
        rows = batch["rows"]
        for row in rows:
            key = row[table.key_column]
            record = {"kind": "snapshot", "shard": self.shard, "table": table.name, "op": "write", "key": key}
            record["row"] = row
            record["tx_key"] = None
            self._emit(record, row_size_bytes(row))
        # The replay must reach at least every applied key a batch was read at (the consumer may
        # move to another node during the copy).
        position = _seen(position, self.applied)
        if batch["done"] or not rows:
            return self._next_table(position)
        return replace(position, table_after=rows[-1][table.key_column])

    def _next_table(self, position: ChangesPosition) -> ChangesPosition:
        later = [table for table in self._tables() if table.name > (position.table or "")]
        if later:
            return replace(position, table=later[0].name, table_after=None)
        # The copy is done: heal it with the entries up to what this node has applied now.
        replay_to = max(position.replay_to or position.after, self.applied)
        return ChangesPosition(shard=self.shard, after=position.after, phase="replay", replay_to=replay_to)

    # -- entries ------------------------------------------------------------------------------

    def _entries(self, position: ChangesPosition, up_to: TxKey, kind: str) -> ChangesPosition:
        """Records of the entries after the position up to ``up_to``, whole entries, within budget; an
        entry whose records alone exceed the page's bytes goes over several pages (``records_after``)."""
        after = TxKey(*position.after)
        skip = position.records_after or 0  # records of the entry after ``after`` already delivered
        while not self.budget.spent and after < up_to and self.scanned < ENTRIES_SCANNED_MAX:
            step = min(ENTRIES_STEP, ENTRIES_SCANNED_MAX - self.scanned)
            entries = self.reader.entries_after(self.shard, after, step, up_to)
            if not entries:
                break
            if entries[0].prev != after:
                # The log does not chain from the position: the consumer's key is not in this node's
                # history (a force-start discarded it, or it came from another history), and the
                # entries after it here would skip or contradict what the consumer holds.
                self.not_in_history = (
                    f"position {after} of shard {self.shard} is not in this node's history (its log goes from "
                    f"{entries[0].prev} to {entries[0].tx_key}): the entries the consumer read up to it were "
                    "discarded (a force-start) or came from another history"
                )
                return position
            self.scanned += len(entries)
            for entry in entries:
                records, sizes = self._records_of(entry, kind)
                if skip > len(records):
                    raise ChangesError("bad_request", f"shard {self.shard!r}: records_after past entry {entry.tx_key}")
                records, sizes = records[skip:], sizes[skip:]
                size = sum(sizes)
                if not self.budget.fits(len(records), size):
                    return _moved(position, after, skip)
                taken = len(records)
                if self.budget.records == 0 and size > self.budget.bytes_max:
                    # Larger than a page alone (it could outgrow a frame): what the page holds, one at least.
                    fitting = itertools.takewhile(self.budget.bytes_max.__ge__, itertools.accumulate(sizes))
                    taken = max(1, sum(1 for _ in fitting))
                self.records.extend(records[:taken])
                self.budget.take(taken, sum(sizes[:taken]))
                if taken < len(records):
                    return _moved(position, after, skip + taken)
                after, skip = entry.tx_key, 0
                if self.budget.spent:
                    break
        return _moved(position, after, skip)

    def _key_column(self, table: str, tx_key: TxKey) -> str | None:
        """The key column of the table the entry at ``tx_key`` writes. Not the catalog's: that is the
        table of this name made last, and a table dropped after this entry and made again keyed on
        another column gave the old table's writes the new column's value as their key. The reader
        knows each drop's key column (``Store.key_column_at``); asked once per table and page, since
        the table of a name can change within the page only by a ``CreateTableOp`` read in it."""
        if table not in self.key_columns:
            self.key_columns[table] = self.reader.key_column_at(self.shard, table, tx_key)
        return self.key_columns[table]

    def _records_of(self, entry: Entry, kind: str) -> tuple[list[dict[str, Any]], list[int]]:
        """The entry's records for this feed and each one's size (its row's bytes and the overhead)."""
        records: list[dict[str, Any]] = []
        sizes: list[int] = []
        tx_key = list(entry.tx_key)
        for op in entry.ops:
            if isinstance(op, CreateTableOp):
                self.key_columns[op.table] = op.key_column
            table = getattr(op, "table", None)
            if table is None or (self.wanted and table not in self.wanted):
                continue
            record: dict[str, Any] = {"kind": kind, "shard": self.shard, "tx_key": tx_key, "table": table}
            size = RECORD_OVERHEAD_BYTES
            if isinstance(op, WriteOp):
                column = self._key_column(table, entry.tx_key)
                record.update(op="write", key=op.row.get(column) if column else None, row=op.row)
                size += row_size_bytes(op.row)
            elif isinstance(op, DeleteOp):
                record.update(op="delete", key=op.key, row=None)
                size += row_size_bytes({"key": op.key})
            elif isinstance(op, CreateTableOp):
                definition = {"key": op.key_column, "columns": [list(column) for column in op.columns]}
                record.update(op="create_table", key=None, row=None, definition=definition)
            elif isinstance(op, DropTableOp):
                record.update(op="drop_table", key=None, row=None)
            elif isinstance(op, AddColumnOp):
                record.update(op="add_column", key=None, row=None, definition={op.column: op.column_type})
            else:
                continue  # index changes change no row
            records.append(record)
            sizes.append(size)
        return records, sizes

    def _emit(self, record: dict[str, Any], size: int) -> None:
        self.records.append(record)
        self.budget.take(1, size + RECORD_OVERHEAD_BYTES)


def _seen(position: ChangesPosition, applied: TxKey) -> ChangesPosition:
    """A copy position whose replay must reach ``applied`` too."""
    return replace(position, replay_to=max(position.replay_to or position.after, applied))


def _moved(position: ChangesPosition, after: TxKey, records_after: int = 0) -> ChangesPosition:
    """``position`` moved to ``after`` (and ``records_after`` records into the entry after it)."""
    if after == position.after and (records_after or None) == position.records_after:
        return position
    return replace(position, after=after, records_after=records_after or None)
