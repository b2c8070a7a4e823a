"""A core's window of the entries it persisted last, served to its followers from memory.

Theory of operation
-------------------
A sequencer sends followers entries through ``core.consensus.LogView.entries_after``. The unapplied
tail (``core.guard_tail``) is in memory, but a follower fed lazily (``core.consensus``, "Lazy
followers") is sent entries that the eager follower's answer committed and this core applied since:
they left the tail, and each feed read up to ``entries_per_append_max`` of them back from SQLite and
decoded them again (about 220 us of the sequencer's CPU a feed at 64 clients, a twentieth of its CPU a
write; ``benchmarks/PROFILE.md``, twenty-ninth session). The window keeps the entries this core
persisted last, as they were persisted, so that such a feed is a slice of a list.

Rules, all in ``RecentEntries``:

* **One run of the log.** Entries are added as the driver persists them (``PersistEntries``), and
  each persist continues the log's end; a persist that does not continue the window's last key (the
  log was changed some way the window was not told of) empties it first. ``truncated`` drops the
  entries after a truncation's key (``TruncateLog``). So whatever the window answers is the log.
* **Only what it holds.** ``after`` answers None for a key outside the window: the caller reads
  the store, as before.
* **Bounded in entries and bytes, per shard and per node.** A shard keeps at most
  ``RECENT_ENTRIES_MAX`` entries and ``RECENT_BYTES_MAX`` bytes; all shards' windows of a node share a
  ``RecentBudget`` (``RECENT_NODE_ENTRIES_MAX``, ``RECENT_NODE_BYTES_MAX``: a node may have a
  thousand shards). The window that adds gives way: it drops its own oldest entries until both its
  bounds and the node's hold (down to three quarters of its own bound, so that a full window does
  not drop entries at every add), none if it must. Bytes are counted as the entries' wire size
  (``ENTRY_OVERHEAD_BYTES`` and the packed ops).
* **Gone with its driver.** A shard's driver rebuilt from disk (a start, a snapshot install, a full
  disk) gets a new, empty window; ``clear`` gives the old one's share back to the node's budget.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from mnesite.rlog.types import ENTRY_OVERHEAD_BYTES, Entry, TxKey

# A lazy follower is fed what built up in lazy_feed_interval_ms (20 ms: about 200 entries at 10,000
# writes/s), 64 entries an append (entries_per_append_max); 1,024 covers it with room.
RECENT_ENTRIES_MAX = 1024
RECENT_BYTES_MAX = 1024 * 1024
RECENT_NODE_ENTRIES_MAX = 16 * 1024
RECENT_NODE_BYTES_MAX = 16 * 1024 * 1024


def entry_bytes(entry: Entry) -> int:
    """What an entry counts against the bounds: its packed ops and an entry's overhead. Not
    ``Entry.size_bytes``, which encodes the shard and request id again: this runs for every write a
    sequencer persists, and the bound needs the ops' size, not the last few bytes."""
    return ENTRY_OVERHEAD_BYTES + len(entry.packed)


def _bytes_of(entries: Sequence[Entry]) -> int:
    """``entry_bytes`` summed, without a call per entry (a sequencer adds every write's entry)."""
    return ENTRY_OVERHEAD_BYTES * len(entries) + sum([len(entry.packed) for entry in entries])


class RecentBudget:
    """What all of a node's windows hold together, and the most they may."""

    def __init__(self, entries_max: int = RECENT_NODE_ENTRIES_MAX, bytes_max: int = RECENT_NODE_BYTES_MAX) -> None:
        self.entries_max = entries_max
        self.bytes_max = bytes_max
        self.entries = 0
        self.bytes = 0


class RecentEntries:
    """One shard's window: the last entries persisted, in log order (see the module's theory)."""

    def __init__(
        self,
        budget: RecentBudget | None = None,
        entries_max: int = RECENT_ENTRIES_MAX,
        bytes_max: int = RECENT_BYTES_MAX,
    ) -> None:
        self.budget = budget if budget is not None else RecentBudget()
        self.entries_max = entries_max
        self.bytes_max = bytes_max
        self.entries: list[Entry] = []
        self.keys: list[TxKey] = []
        self.bytes = 0

    def add(self, entries: Sequence[Entry]) -> None:
        """Entries just persisted at the log's end."""
        if not entries:
            return
        if self.keys and entries[0].prev != self.keys[-1]:
            self.clear()  # not a continuation of the window: it would no longer be one run of the log
        size = _bytes_of(entries)
        self.entries.extend(entries)
        self.keys.extend([entry.tx_key for entry in entries])
        self.bytes += size
        budget = self.budget
        budget.entries += len(entries)
        budget.bytes += size
        if (
            len(self.entries) > self.entries_max
            or self.bytes > self.bytes_max
            or budget.entries > budget.entries_max
            or budget.bytes > budget.bytes_max
        ):
            self._shrink()

    def truncated(self, after_key: TxKey) -> None:
        """The log's entries after ``after_key`` are gone."""
        keep = bisect.bisect_right(self.keys, after_key)
        self._drop(keep, len(self.entries))

    def after(self, key: TxKey, limit: int) -> list[Entry] | None:
        """Up to ``limit`` entries after ``key``, or None when the window does not hold what follows it."""
        if not self.entries or not self.entries[0].prev <= key <= self.keys[-1]:
            return None
        start = bisect.bisect_right(self.keys, key)
        return self.entries[start : start + limit]

    def clear(self) -> None:
        self._drop(0, len(self.entries))

    def _shrink(self) -> None:
        """Past a bound: drop the oldest entries, down to three quarters of this window's bound (so
        that a full window does not drop entries at every add) and within the node's."""
        budget = self.budget
        count, size = len(self.entries), self.bytes
        over_entries = max(
            count - self.entries_max * 3 // 4 if count > self.entries_max else 0,
            budget.entries - budget.entries_max,
        )
        over_bytes = max(
            size - self.bytes_max * 3 // 4 if size > self.bytes_max else 0,
            budget.bytes - budget.bytes_max,
        )
        drop = 0
        freed = 0
        while drop < count and (drop < over_entries or freed < over_bytes):
            freed += entry_bytes(self.entries[drop])
            drop += 1
        self._drop(0, drop)

    def _drop(self, start: int, end: int) -> None:
        """Forget the entries in ``[start, end)`` (a prefix or a suffix) and give their share back."""
        if start >= end:
            return
        size = _bytes_of(self.entries[start:end])
        del self.entries[start:end]
        del self.keys[start:end]
        self.bytes -= size
        self.budget.entries -= end - start
        self.budget.bytes -= size
