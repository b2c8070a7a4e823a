"""Scheduled backups (``[backup]`` in a node's config): when one is due, its file's name, which to prune.

Theory of operation
-------------------
A node with ``[backup] interval_s`` takes a backup of itself every ``interval_s`` seconds into
``directory`` on its own host, through the same ``rlog.backup.BackupJob`` as ``mnesite backup``, and
keeps its newest ``keep`` of them. This module holds the rules, with no I/O and no clock of its own
(time arrives as ``now_ms``, monotonic, and ``now_s``, the wall clock for a file's name):

1. The first backup is due ``interval_s`` after the node started; each next one ``interval_s`` after
   the last one started (``BackupSchedule.started``), never several to catch up.
2. A due backup waits while any backup runs (manual or scheduled: one at a time per node), and while
   the node is not ready for one (``not_ready``: a replicant bootstrapping, a core installing a
   snapshot) or holds no committed state yet (``no_committed_state``: no shard, or a shard that
   applied no entry: a replicant that reached no core, a core before the cluster's first table or
   recovered from its peers and not caught up; its database is empty, and such a backup, reported as
   a success, would push real ones out of ``keep``): the driver asks again at its next loop turn, so
   a refusal does not skip an interval. One that cannot start (the database cannot be read, every
   name of its second taken) counts as started and failed: the next interval tries again.
3. A backup's file is ``NODE-YYYYMMDDTHHMMSSZ.db`` (UTC, ``file_name``), its name says which node
   took it and when. Its second's name taken (a wall clock set back, an operator's backup to that
   name, a ``.partial`` copy left there), it is ``NODE-YYYYMMDDTHHMMSSZ-N.db``, the first free N from
   2 (``free_file_name``): a backup never fails for the name, nor overwrites a file. Once one is
   published, ``to_prune`` picks the files to remove from a listing of ``directory``: only the names
   of those shapes for this node (``file_pattern``; never another file, another node's, or a
   ``.partial`` copy under way), the oldest beyond ``keep`` by time and then N (``age_key``: ``-10``
   is newer than ``-2``), never the one just written (a wall clock set back must not make it look
   oldest).

The driver (``rlog.server.NodeServer.run_backup_schedule``) runs the copy and the pruning on the copy's
thread (``BackupJob``'s ``after_publish``), never on the node's loop.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mnesite.rlog.types import ZERO_KEY, TxKey

# A backup takes a database-sized copy and pins the WAL while it runs: more often than once a minute
# is a mistake, not a schedule. Tests lower it with ``INTERVAL_S_MIN_ENV`` (documented as for tests only).
INTERVAL_S_MIN = 60
INTERVAL_S_MAX = 366 * 24 * 3600
INTERVAL_S_MIN_ENV = "MNESITE_TEST_BACKUP_INTERVAL_S_MIN"
KEEP_DEFAULT = 7
KEEP_MAX = 10_000
FILE_SUFFIX = ".db"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
# Names one second may take (``free_file_name``): a backup is at least a second apart from the
# node's last one, so more than a few taken means files put there by other hands.
NAME_ATTEMPTS_MAX = 100


def interval_s_min(environ: dict[str, str] | None = None) -> int:
    """The least ``[backup] interval_s`` other than 0: ``INTERVAL_S_MIN``, or a positive integer below it from
    ``INTERVAL_S_MIN_ENV`` (for tests: a real node process taking backups every second)."""
    value = (os.environ if environ is None else environ).get(INTERVAL_S_MIN_ENV, "")
    if value.isdigit() and 1 <= int(value) < INTERVAL_S_MIN:
        return int(value)
    return INTERVAL_S_MIN


def file_name(node: str, now_s: float, attempt: int = 1) -> str:
    """The name of ``node``'s scheduled backup taken at ``now_s`` (Unix time): ``core1-20261204T031500Z.db``;
    ``attempt`` N from 2 when the names of that second before it are taken: ``core1-20261204T031500Z-2.db``."""
    if not 1 <= attempt <= NAME_ATTEMPTS_MAX:
        raise ValueError(f"attempt must be in 1..{NAME_ATTEMPTS_MAX}, got {attempt}")
    number = "" if attempt == 1 else f"-{attempt}"
    return f"{node}-{time.strftime(STAMP_FORMAT, time.gmtime(now_s))}{number}{FILE_SUFFIX}"


def file_pattern(node: str) -> re.Pattern[str]:
    """The names ``file_name`` gives ``node``'s backups, and no other: a node named ``core1-x`` has its own.
    Groups: the stamp, and the attempt's number (None for the first)."""
    return re.compile(rf"{re.escape(node)}-(\d{{8}}T\d{{6}}Z)(?:-([1-9]\d{{0,2}}))?{re.escape(FILE_SUFFIX)}\Z")


def free_file_name(node: str, now_s: float, taken: Callable[[str], bool]) -> str | None:
    """The first of ``node``'s names for the second ``now_s`` that ``taken`` (a name's file, or its
    ``.partial`` copy, exists) says is free; None when all ``NAME_ATTEMPTS_MAX`` are taken."""
    for attempt in range(1, NAME_ATTEMPTS_MAX + 1):
        name = file_name(node, now_s, attempt)
        if not taken(name):
            return name
    return None


def age_key(pattern: re.Pattern[str], name: str) -> tuple[str, int]:
    """What orders a node's backups (a name ``pattern`` matches) from oldest: the stamp (one width: it
    sorts by time as text), then the attempt's number as a number (``-10`` after ``-2``)."""
    match = pattern.match(name)
    if match is None:
        raise ValueError(f"{name} is not a scheduled backup's name")
    return match.group(1), int(match.group(2) or 1)


def to_prune(names: Iterable[str], node: str, keep: int, just_written: str) -> list[str]:
    """The names among ``names`` (a listing of the directory) to remove once ``just_written`` is published,
    oldest first: ``node``'s scheduled backups beyond the newest ``keep``, ``just_written`` counted and kept."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    pattern = file_pattern(node)

    def age(name: str) -> tuple[str, int]:
        return age_key(pattern, name)

    older = sorted((name for name in set(names) if pattern.match(name) and name != just_written), key=age, reverse=True)
    return sorted(older[keep - 1 :], key=age)


def no_committed_state(applied: Mapping[str, TxKey]) -> str | None:
    """Why a node whose shards have applied up to ``applied`` (shard -> applied key) holds no committed
    state to back up yet (None: it does). No shard: its database holds no table of the cluster's (a
    replicant that has not learned its shards from a core, a core before the cluster's first table).
    A shard at the zero key: created here (discovered, recovered from the peers) and followed to no
    entry yet, its rows empty; every shard's log starts with its sequencer's entry, so a shard followed
    past its start is past the zero key."""
    if not applied:
        return (
            "no shard yet: this node holds none of the cluster's data (a replicant that has not followed a core's "
            "shard, a core before the first table); the backup starts once it does"
        )
    for shard, key in sorted(applied.items()):
        if key == ZERO_KEY:
            return (
                f"shard {shard} has applied no entry yet (this node has not caught up with its cores): its rows "
                "are not a committed state of the cluster yet"
            )
    return None


def due(now_ms: int, next_due_ms: int, backup_running: bool) -> bool:
    """Whether a scheduled backup starts now: its time has come and no backup runs."""
    return now_ms >= next_due_ms and not backup_running


@dataclass
class ScheduledResult:
    """The last scheduled backup: its path, its state (running, done, failed) and what became of it."""

    path: str
    state: str = "running"
    error: str | None = None
    finished_at_s: float | None = None


class BackupSchedule:
    """A node's schedule: when the next backup is due, the last one's outcome, the files kept (no I/O)."""

    def __init__(self, directory: str, interval_s: int, keep: int, node: str, started_ms: int) -> None:
        if interval_s < 1 or keep < 1:
            raise ValueError(f"a schedule needs interval_s and keep of at least 1, got {interval_s} and {keep}")
        self.directory = directory
        self.interval_ms = interval_s * 1000
        self.keep = keep
        self.node = node
        self.next_due_ms = started_ms + self.interval_ms
        self.last: ScheduledResult | None = None
        self.last_success_s: float | None = None
        self.files_kept: list[str] = []
        self.files_removed = 0
        self.waiting: str | None = None  # why a due backup has not started (the node is not ready)

    def path(self, now_s: float, taken: Callable[[str], bool]) -> str | None:
        """The path of a backup taken at ``now_s``: its second's first free name (``free_file_name``;
        ``taken``: whether a path is taken), or None when every one is."""
        name = free_file_name(self.node, now_s, lambda name: taken(os.path.join(self.directory, name)))
        return None if name is None else os.path.join(self.directory, name)

    def names_taken(self, now_s: float) -> tuple[str, str]:
        """The path and the error of a backup at ``now_s`` for which ``path`` found no free name."""
        first = os.path.join(self.directory, file_name(self.node, now_s))
        return first, (
            f"{first} and every other name of its second (-2 to -{NAME_ATTEMPTS_MAX}, or their .partial copies) "
            f"are taken: move the files that are not this node's scheduled backups out of {self.directory}"
        )

    def is_due(self, now_ms: int, backup_running: bool) -> bool:
        return due(now_ms, self.next_due_ms, backup_running)

    def started(self, now_ms: int, path: str) -> None:
        self.next_due_ms = now_ms + self.interval_ms
        self.last = ScheduledResult(path)
        self.waiting = None

    def ended(self, state: str, error: str | None, finished_at_s: float, files_kept: list[str] | None) -> None:
        """The last backup ``started`` is done or failed; ``files_kept``: the listing after pruning (done)."""
        if self.last is None:
            raise RuntimeError("a scheduled backup ended that never started")
        self.last.state, self.last.error, self.last.finished_at_s = state, error, finished_at_s
        if state == "done":
            self.last_success_s = finished_at_s
        if files_kept is not None:
            self.files_kept = files_kept

    def status(self, now_ms: int) -> dict[str, Any]:
        last = self.last
        return {
            "directory": self.directory,
            "interval_s": self.interval_ms // 1000,
            "keep": self.keep,
            "next_due_in_ms": max(0, self.next_due_ms - now_ms),
            "waiting": self.waiting,
            "last_path": None if last is None else last.path,
            "last_state": None if last is None else last.state,
            "last_error": None if last is None else last.error,
            "last_success_at_s": None if self.last_success_s is None else round(self.last_success_s, 3),
            "files_kept": list(self.files_kept),
            "files_removed": self.files_removed,
        }


def prune(directory: str, node: str, keep: int, just_written: str) -> tuple[list[str], int]:
    """Remove ``node``'s scheduled backups in ``directory`` beyond the newest ``keep`` (``to_prune``): runs on
    the backup's copy thread once ``just_written`` (a path) is published. Returns the names kept and the
    count removed. Only regular files are listed: a directory or a link of a matching name is left alone."""
    with os.scandir(directory) as entries:
        names = [entry.name for entry in entries if entry.is_file(follow_symlinks=False)]
    removed = 0
    for name in to_prune(names, node, keep, os.path.basename(just_written)):
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except FileNotFoundError:  # removed meanwhile (an operator archiving it): what was asked
            pass
    pattern = file_pattern(node)
    kept = [name for name in names if pattern.match(name) and os.path.lexists(os.path.join(directory, name))]
    return sorted(kept, key=lambda name: age_key(pattern, name)), removed


def directory_problem(directory: str) -> str | None:
    """Why ``[backup] directory`` cannot take backups (checked once, at the node's start), or None."""
    if not os.path.isdir(directory):
        return f"[backup].directory {directory}: no such directory on this node's host"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"[backup].directory {directory}: not writable by this node's user"
    return None
