"""The sequencer's unapplied tail as guards see it, and when a failed guard may be answered (pure).

Theory of operation
-------------------
The sequencer evaluates a transaction's guards against its applied state *plus* the entries it has
appended but not yet applied (its tail): a transaction proposed after another must see that one's
effects before either commits, or a guard could pass twice. Ops are results, so the latest op for a
key in the tail is that key's future value (``row``).

A guard that passes needs nothing more: its entry commits after the ones it observed, or not at all.
A guard that FAILS is a read, and must be linearizable like one (DESIGN invariant 10): its answer
reports the row it found, which may come from an entry that has not committed and may never commit.
So a failed guard is answered only when

1. every entry of the tail it observed has committed (``failed`` holds it until then;
   ``committed`` releases it), and
2. the sequencer may serve a linearizable read at that moment (``ShardConsensus.read_index`` is
   not None: an entry of its own generation committed and it holds the lease).

At that moment the committed state is exactly the one the guard was evaluated against (later
entries of the tail have not committed), and it includes every write acknowledged before the
request began: the answer linearizes there. If the tail is truncated (a new sequencer replaced it)
or the read condition does not hold, nothing was written, so the client is told to retry with the
same request id, and the retry is evaluated afresh by whoever is sequencer then. A held failure
that waits longer than ``guard_hold_ms_max`` gets the same answer, and at most
``guard_failures_held_max`` are held at once.

3. A request sent again while its failure is held (``resent``: a client that heard nothing re-sends
   the same request id) is not evaluated again: evaluated against a tail that moved on, the retry
   could pass and be written while the held one still answers that the guard failed, two answers
   to one request id, one of them saying nothing was written. The held failure answers the newest
   request, once; the driver tells an earlier one on another connection at once that the answer
   goes to the newest (``core.outcome``'s rule 4 of forwarding, for the same reason).

Bounded in memory
-----------------
The tail keeps at most ``entries_max`` entries and ``bytes_max`` bytes (``Entry.size_bytes``; ``[limits]``
``unapplied_tail_entries_max`` and ``unapplied_tail_bytes_max``). It is
a prefix of the log's unapplied entries; past the bound (a shard whose apply waits at a name another
shard holds, ``Store.name_waits``, while its sequencer commits on) it is *incomplete*: the entries
after ``spilled_after`` are in the log only, read back from it to serve and apply them, and the tail
is filled again from the log as its entries are applied (``refill_after``, ``refilled``). Entries
past the bound that change a schema are kept aside (``catalog_over`` needs them for every shard's
admission; a wait is about schema changes, which are few): only rows-only entries leave memory.

An incomplete tail cannot answer a guard (its rows past the bound are unknown) and the sequencer
cannot keep adding to it: ``refuses_writes`` tells the driver to refuse new writes to the shard
(``overloaded``, retryable, nothing written) while the tail is full or incomplete. A write admitted
in the same turn before the tail filled may still go past the bound: its entry is read back like
the others, and its writer is told when it applies (``core.rules.commit_heard``).

Driver contract
---------------
Call ``add`` for every ``PersistEntries``, ``committed`` for every ``Commit`` (after applying it),
``truncated`` for every ``TruncateLog``, ``refilled`` with the log's entries after ``refill_after``
(when not None) after ``committed``, ``expired`` on every turn, ``abandoned`` before the shard's
tail is rebuilt from disk or replaced by a snapshot; answer the tokens returned as
``GUARD_ANSWER`` with the guard failure and as ``GUARD_RETRY`` with a retryable error.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mnesite.rlog.schema import TableSchema
from mnesite.rlog.types import (
    ROW_OPS,
    AddColumnOp,
    CreateIndexOp,
    CreateTableOp,
    DeleteOp,
    DropIndexOp,
    DropTableOp,
    Entry,
    TxKey,
    WriteOp,
)

_TX_KEY_OF = operator.attrgetter("tx_key")

GUARD_ANSWER = "answer"
GUARD_HELD = "held"
GUARD_RETRY = "retry"
GUARD_FAILURES_HELD_MAX = 10_000
GUARD_HOLD_MS_MAX = 5_000
# Entries of the unapplied tail kept in memory (the rest read from the log), and their bytes
# (``Entry.size_bytes``): the defaults of ``[limits]`` unapplied_tail_entries_max and _bytes_max.
TAIL_ENTRIES_MAX = 10_000
TAIL_BYTES_MAX = 64 * 1024 * 1024

Token = TypeVar("Token")


@dataclass(frozen=True)
class _Held(Generic[Token]):
    token: Token
    observed_key: TxKey
    deadline_ms: int


class GuardTail(Generic[Token]):
    """Entries persisted but not applied, indexed by row, and the failed guards waiting on them."""

    def __init__(
        self,
        catalog: dict[str, TableSchema] | None = None,
        failures_held_max: int = GUARD_FAILURES_HELD_MAX,
        hold_ms_max: int = GUARD_HOLD_MS_MAX,
        entries_max: int = TAIL_ENTRIES_MAX,
        bytes_max: int = TAIL_BYTES_MAX,
    ) -> None:
        self.catalog: dict[str, TableSchema] = dict(catalog or {})
        self.failures_held_max = failures_held_max
        self.hold_ms_max = hold_ms_max
        self.entries_max = entries_max
        self.bytes_max = bytes_max
        self.entries: list[Entry] = []
        self.keys: list[TxKey] = []
        self.sizes: list[int] = []  # ``Entry.size_bytes`` of each of ``entries``, computed once
        self.bytes = 0  # of ``entries``
        # None while ``entries`` are all the unapplied entries; else the key after which the log's
        # entries are not kept (the last kept one's, or the key before the first one not kept).
        self.spilled_after: TxKey | None = None
        # The entries after ``spilled_after`` that change a schema (``catalog_over``): kept anyway.
        self.spilled_schema: list[Entry] = []
        self.rows: dict[tuple[str, Any], dict[str, Any] | None] = {}
        self.tables: dict[str, TableSchema] = {}
        # Tables the tail drops (a later create in the tail may bring the name back, empty).
        self._dropped: set[str] = set()
        # How many of ``entries`` are in rows, tables and dropped: they are indexed when a guard (or
        # a write's admission) first looks, so a follower, which never evaluates guards, never does.
        self._indexed = 0
        self._indexed_spilled = 0  # of ``spilled_schema``, indexed after ``entries``
        self._held: list[_Held[Token]] = []

    # ------------------------------------------------------------ the tail

    def add(self, entries: tuple[Entry, ...] | list[Entry]) -> None:
        """Entries appended to the log after the last one added: kept while within the bound."""
        sizes = [entry.size_bytes for entry in entries]
        if self.spilled_after is None and self._fits(len(sizes), sum(sizes)):
            self.entries.extend(entries)
            self.keys.extend(map(_TX_KEY_OF, entries))
            self.sizes.extend(sizes)
            self.bytes += sum(sizes)
            return
        for entry, size in zip(entries, sizes, strict=True):
            if self.spilled_after is None and self._fits(1, size):
                self._keep(entry, size)
                continue
            if self.spilled_after is None:
                self.spilled_after = entry.prev
            if not ROW_OPS.issuperset(map(type, entry.ops)):
                self.spilled_schema.append(entry)

    def _fits(self, count: int, size: int) -> bool:
        """Whether ``count`` more entries of ``size`` bytes together stay within the bound."""
        return len(self.entries) + count <= self.entries_max and self.bytes + size <= self.bytes_max

    def _keep(self, entry: Entry, size: int) -> None:
        self.entries.append(entry)
        self.keys.append(entry.tx_key)
        self.sizes.append(size)
        self.bytes += size

    @property
    def complete(self) -> bool:
        """Whether the tail holds every unapplied entry the log has (none past the bound)."""
        return self.spilled_after is None

    def refuses_writes(self) -> bool:
        """Whether the sequencer refuses new writes to the shard: its tail is full, or lost entries past
        its bound, so a guard could not be evaluated against all of it (module docstring)."""
        return not self.complete or len(self.entries) >= self.entries_max or self.bytes >= self.bytes_max

    def refill_after(self) -> TxKey | None:
        """The key after which the driver reads the log's entries back for ``refilled`` (None: it need not)."""
        if self.spilled_after is None or len(self.entries) >= self.entries_max or self.bytes >= self.bytes_max:
            return None
        return self.spilled_after

    def refilled(self, entries: list[Entry], log_end: TxKey) -> None:
        """The log's entries after ``refill_after()`` (some; ``log_end``: its last key): kept while they
        fit; the tail is complete again once it reaches the log's end."""
        for entry in entries:
            size = entry.size_bytes
            if self.spilled_after is None or entry.prev != self.spilled_after or not self._fits(1, size):
                break
            self._keep(entry, size)
            self.spilled_after = entry.tx_key
        if self.spilled_after is not None and self.spilled_after >= log_end:
            self.spilled_after = None
        after = self.spilled_after
        self.spilled_schema = [e for e in self.spilled_schema if after is not None and e.tx_key > after]
        self._reindex()

    def covering(self, key: TxKey, limit: int) -> list[Entry] | None:
        """Up to ``limit`` entries after ``key`` if the tail can tell them (the log's next ones), else None."""
        cached = self.entries
        if not cached or not cached[0].prev <= key <= cached[-1].tx_key:
            return None
        start = bisect.bisect_right(self.keys, key)
        if self.spilled_after is not None and start + limit > len(cached):
            return None  # the log has more after the kept ones: read it there
        return cached[start : start + limit]

    def _indexed_tail(self) -> None:
        """Index the entries added since the last look (rows, tables, dropped), then the schema
        changes past the bound (added only while incomplete: after every kept entry)."""
        if self._indexed < len(self.entries):
            for entry in self.entries[self._indexed :]:
                self._index(entry)
            self._indexed = len(self.entries)
        if self._indexed_spilled < len(self.spilled_schema):
            for entry in self.spilled_schema[self._indexed_spilled :]:
                self._index(entry)
            self._indexed_spilled = len(self.spilled_schema)

    def _reindex(self) -> None:
        self.rows, self.tables, self._dropped = {}, {}, set()
        self._indexed = self._indexed_spilled = 0

    @property
    def dropped(self) -> set[str]:
        self._indexed_tail()
        return self._dropped

    def last_key(self) -> TxKey | None:
        """The last entry a guard evaluated now observes (None when the tail is empty)."""
        return self.keys[-1] if self.keys else None

    def row(self, table: str, key: Any) -> tuple[bool, dict[str, Any] | None]:
        """(True, the row's future value) if the tail writes or deletes it, else (False, None)."""
        self._indexed_tail()
        if (table, key) in self.rows:
            return True, self.rows[(table, key)]
        return False, None

    def read(self, table: str, key: Any, read_applied: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """A guard's read: the row as the tail leaves it (its write or delete), absent if the tail
        drops the table, else the applied row (``read_applied``: read with the table as applied, the
        columns the tail adds left out). A column the tail adds is null in a row written before it,
        in the tail or applied, as the apply's ``ALTER TABLE ... ADD COLUMN`` leaves it."""
        self._indexed_tail()
        if (table, key) in self.rows:
            row = self.rows[(table, key)]
        elif table in self._dropped:
            return None  # the applied rows go with the table
        else:
            row = read_applied()
        changed = self.tables.get(table)
        if row is None or changed is None:
            return row  # the common read: a table the tail does not change
        return {name: row.get(name) for name, _ in changed.columns}

    def _index(self, entry: Entry) -> None:
        for op in entry.ops:
            if isinstance(op, WriteOp):
                schema = self.tables.get(op.table) or self.catalog.get(op.table)
                if schema is not None:
                    self.rows[(op.table, op.row[schema.key_column])] = op.row
            elif isinstance(op, DeleteOp):
                self.rows[(op.table, op.key)] = None
            elif isinstance(op, CreateTableOp):
                self.tables[op.table] = TableSchema.from_op(op)
            elif isinstance(op, (AddColumnOp, CreateIndexOp, DropIndexOp)):
                # The next transactions of the tail are checked against the changed table.
                changed = self.tables.get(op.table) or self.catalog.get(op.table)
                if changed is not None:
                    self.tables[op.table] = changed.changed_by(op)
            elif isinstance(op, DropTableOp):
                self.tables.pop(op.table, None)
                self._dropped.add(op.table)
                for row_key in [k for k in self.rows if k[0] == op.table]:
                    self.rows[row_key] = None  # the rows go with the table

    def catalog_over(self, applied: dict[str, TableSchema]) -> dict[str, TableSchema]:
        """The tables as they will be once the tail is applied over the ``applied`` catalog (that
        dict itself when the tail changes no table: as the store's, it is read, never changed)."""
        self._indexed_tail()
        if not self.tables and not self._dropped:
            return applied
        return {**{n: t for n, t in applied.items() if n not in self._dropped}, **self.tables}

    def _rebuild(self, kept: slice, catalog: dict[str, TableSchema]) -> None:
        """Keep the ``kept`` run of the entries (the ones after a commit, or before a truncation: within
        the bound, the keys in order) over ``catalog``."""
        self.catalog = dict(catalog)
        self.entries, self.keys, self.sizes = self.entries[kept], self.keys[kept], self.sizes[kept]
        self.bytes = sum(self.sizes)
        self._reindex()

    # ------------------------------------------------------------ failed guards

    def must_hold(self, observed_key: TxKey | None, committed_key: TxKey) -> bool:
        """Rule 1: a failure that observed an uncommitted entry waits until that entry commits."""
        return observed_key is not None and observed_key > committed_key

    def failed(self, token: Token, committed_key: TxKey, read_index: TxKey | None, now_ms: int) -> str:
        """A guard evaluated against the current tail failed: answer, hold or retry?"""
        observed_key = self.last_key()
        if self.must_hold(observed_key, committed_key) and observed_key is not None:
            if len(self._held) >= self.failures_held_max:
                return GUARD_RETRY
            self._held.append(_Held(token, observed_key, now_ms + self.hold_ms_max))
            return GUARD_HELD
        return GUARD_ANSWER if read_index is not None else GUARD_RETRY

    def resent(self, same: Callable[[Token], bool], renewed: Callable[[Token], Token]) -> Token | None:
        """Rule 3: the held failure ``same`` picks is the request sent again: its token becomes
        ``renewed(token)`` (its observed key and deadline stay); returns the token it replaced, None
        when none is held."""
        for index, held in enumerate(self._held):
            if same(held.token):
                self._held[index] = _Held(renewed(held.token), held.observed_key, held.deadline_ms)
                return held.token
        return None

    def committed(
        self, up_to: TxKey, catalog: dict[str, TableSchema], read_index: TxKey | None
    ) -> list[tuple[Token, str]]:
        """Entries up to ``up_to`` are applied now: forget them and release the failures they settle."""
        if self.spilled_after is not None:
            self.spilled_after = max(self.spilled_after, up_to)  # applied from the log past the kept ones
            self.spilled_schema = [entry for entry in self.spilled_schema if entry.tx_key > up_to]
        self._rebuild(slice(bisect.bisect_right(self.keys, up_to), None), catalog)
        released = [held for held in self._held if not self.must_hold(held.observed_key, up_to)]
        self._held = [held for held in self._held if self.must_hold(held.observed_key, up_to)]
        verdict = GUARD_ANSWER if read_index is not None else GUARD_RETRY
        return [(held.token, verdict) for held in released]

    def truncated(self, after_key: TxKey, catalog: dict[str, TableSchema]) -> list[Token]:
        """Entries after ``after_key`` are gone: failures that observed them must be evaluated again."""
        if self.spilled_after is not None:
            self.spilled_schema = [entry for entry in self.spilled_schema if entry.tx_key <= after_key]
            if self.spilled_after >= after_key:
                self.spilled_after = None  # what was not kept is gone: the log ends within the kept ones
        self._rebuild(slice(bisect.bisect_right(self.keys, after_key)), catalog)
        dropped = [held.token for held in self._held if held.observed_key > after_key]
        self._held = [held for held in self._held if held.observed_key <= after_key]
        return dropped

    def expired(self, now_ms: int) -> list[Token]:
        """Held failures past their deadline (the tail is stuck: no quorum); they are told to retry."""
        expired = [held.token for held in self._held if held.deadline_ms <= now_ms]
        if expired:
            self._held = [held for held in self._held if held.deadline_ms > now_ms]
        return expired

    def abandoned(self) -> list[Token]:
        """Every held failure, when the tail they wait on is replaced (the driver rebuilds the shard
        from disk, or installs a snapshot): they are told to retry, as at a truncation."""
        abandoned, self._held = [held.token for held in self._held], []
        return abandoned

    def held_count(self) -> int:
        return len(self._held)

    def held_tokens(self) -> list[Token]:
        """The held failures' tokens, oldest first (read only: the simulator's clients re-send them)."""
        return [held.token for held in self._held]
