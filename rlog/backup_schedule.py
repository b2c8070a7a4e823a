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
   snapshot): the driver asks again at its next loop turn, so a refusal does not skip an interval.
   One that cannot start (its file exists, the database cannot be read) counts as started and failed:
   the next interval tries again.
3. A backup's file is ``NODE-YYYYMMDDTHHMMSSZ.db`` (UTC, ``file_name``): it sorts by time, and its
   name says which node took it. Once one is published, ``to_prune`` picks the files to remove from a
   listing of ``directory``: only the names of that exact shape for this node (``file_pattern``; never
   another file, another node's, or a ``.partial`` copy under way), the oldest beyond ``keep``, never
   the one just written (a wall clock set back must not make it look oldest).

The driver (``rlog.server.NodeServer.run_backup_schedule``) runs the copy and the pruning on the copy's
thread (``BackupJob``'s ``after_publish``), never on the node's loop.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# A backup takes a database-sized copy and pins the WAL while it runs: more often than once a minute
# is a mistake, not a schedule. Tests lower it with ``INTERVAL_S_MIN_ENV`` (documented as for tests only).
INTERVAL_S_MIN = 60
INTERVAL_S_MAX = 366 * 24 * 3600
INTERVAL_S_MIN_ENV = "MNESITE_TEST_BACKUP_INTERVAL_S_MIN"
KEEP_DEFAULT = 7
KEEP_MAX = 10_000
FILE_SUFFIX = ".db"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"


def interval_s_min(environ: dict[str, str] | None = None) -> int:
    """The least ``[backup] interval_s`` other than 0: ``INTERVAL_S_MIN``, or a positive integer below it from
    ``INTERVAL_S_MIN_ENV`` (for tests: a real node process taking backups every second)."""
    value = (os.environ if environ is None else environ).get(INTERVAL_S_MIN_ENV, "")
    if value.isdigit() and 1 <= int(value) < INTERVAL_S_MIN:
        return int(value)
    return INTERVAL_S_MIN


def file_name(node: str, now_s: float) -> str:
    """The name of ``node``'s scheduled backup taken at ``now_s`` (Unix time): ``core1-20261204T031500Z.db``."""
    return f"{node}-{time.strftime(STAMP_FORMAT, time.gmtime(now_s))}{FILE_SUFFIX}"


def file_pattern(node: str) -> re.Pattern[str]:
    """The names ``file_name`` gives ``node``'s backups, and no other: a node named ``core1-x`` has its own."""
    return re.compile(rf"{re.escape(node)}-\d{{8}}T\d{{6}}Z{re.escape(FILE_SUFFIX)}\Z")


def to_prune(names: Iterable[str], node: str, keep: int, just_written: str) -> list[str]:
    """The names among ``names`` (a listing of the directory) to remove once ``just_written`` is published,
    oldest first: ``node``'s scheduled backups beyond the newest ``keep``, ``just_written`` counted and kept."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    pattern = file_pattern(node)
    # The stamps have one width: the names of one node sort by time.
    older = sorted((name for name in set(names) if pattern.match(name) and name != just_written), reverse=True)
    return sorted(older[keep - 1 :])


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

    def path(self, now_s: float) -> str:
        return os.path.join(self.directory, file_name(self.node, now_s))

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
    kept = sorted(name for name in names if pattern.match(name) and os.path.lexists(os.path.join(directory, name)))
    return kept, removed


def directory_problem(directory: str) -> str | None:
    """Why ``[backup] directory`` cannot take backups (checked once, at the node's start), or None."""
    if not os.path.isdir(directory):
        return f"[backup].directory {directory}: no such directory on this node's host"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"[backup].directory {directory}: not writable by this node's user"
    return None
