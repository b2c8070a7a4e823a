"""The retention floor: which prefix of a shard's rlog may be removed now (a pure rule).

Theory of operation
-------------------
A shard's rlog is kept so that followers and replicants can catch up from it (resume instead of
a snapshot or a bootstrap), but it must not grow without bound. ``retention_floor`` names the
newest key whose entry, and every entry before it, may be removed now; the store then deletes
them and records that key and its digest as the *trimmed* position (an append after it can still
be checked, and a watch from it still resumes).

The rule, one sentence per bound:

1. The count bound is hard: the newest ``entries_max`` entries are kept, the older ones may go
   (a follower further behind is sent a snapshot, a replicant bootstraps).
2. The age bound (``before_ms``: entries appended before it may go) waits for the followers and
   for the replicants being served: it never removes the entry a follower or a live agent still
   needs, i.e. the one after ``keep_from`` (the lowest of the match keys the sequencer knows and of
   the keys the core's live agents had acknowledged, ``keep_from_match_keys``). An agent whose
   replicant stops acknowledging is stopped after its ack timeout, so it cannot pin the log for
   long; and the count bound still caps the log whatever the agents need. Without this, a
   replicant's bootstrap under writes on a busy machine (its acknowledgements slowed by the copy)
   lost the entries after K0 to the age bound and had to start the copy again.
3. Nothing that is not applied is ever removed: applying reads the entries from the log.
4. The newest entry is always kept: it carries the digest a watcher resumes from.
5. Retention only moves forward: a floor at or below the trimmed key removes nothing.

Production runs this over the SQLite store (``rlog.store.Store.trim``) at cores and replicants; the
simulator (``tests/sim/cluster.py``) runs it over its in-memory log, at every core, and checks
that no node is ever missing an entry it still has to apply.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from mnesite.rlog.types import ZERO_KEY, TxKey


class RetentionView(Protocol):
    """What the rule reads from one shard's persisted rlog."""

    def last_key(self) -> TxKey:
        """The newest entry's key (the trimmed key if the log holds none)."""
        ...

    def trimmed_key(self) -> TxKey:
        """The key of the last entry removed so far (``ZERO_KEY`` if none)."""
        ...

    def key_before(self, key: TxKey) -> TxKey | None:
        """The newest key held that is lower than ``key``; None if there is none."""
        ...

    def newest_key_at(self, offset: int) -> TxKey | None:
        """The key of the entry with ``offset`` newer entries after it; None if the log holds fewer."""
        ...

    def newest_appended_before(self, before_ms: int) -> TxKey | None:
        """The newest key appended before ``before_ms``; None if there is none."""
        ...


def keep_from_match_keys(match_keys: Iterable[TxKey], agent_acked_keys: Iterable[TxKey] = ()) -> TxKey | None:
    """The age bound waits for the follower furthest behind, as far as the sequencer knows, and for
    the live agent furthest behind (the key its replicant last acknowledged)."""
    return min([*match_keys, *agent_acked_keys], default=None)


def retention_floor(
    view: RetentionView,
    entries_max: int,
    before_ms: int | None,
    applied_key: TxKey,
    keep_from: TxKey | None = None,
) -> TxKey | None:
    """The newest key that may be removed with everything before it, or None (remove nothing).

    ``entries_max`` entries are kept (at least one); ``before_ms`` (None: no age bound) lets older
    entries go unless ``keep_from`` still needs them; nothing after ``applied_key`` goes.
    """
    candidates: list[TxKey] = []
    kept_oldest = view.newest_key_at(max(entries_max, 1) - 1)
    if kept_oldest is not None:
        by_count = view.key_before(kept_oldest)
        if by_count is not None:
            candidates.append(by_count)
    if before_ms is not None:
        by_age = view.newest_appended_before(before_ms)
        if by_age is not None:
            if keep_from is not None:
                by_age = min(by_age, view.key_before(keep_from) or ZERO_KEY)
            candidates.append(by_age)
    if not candidates:
        return None
    floor = min(max(candidates), applied_key)
    last_key = view.last_key()
    if floor >= last_key:
        floor = view.key_before(last_key) or ZERO_KEY
    if floor <= view.trimmed_key():
        return None
    return floor
