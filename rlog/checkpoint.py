"""WAL checkpoints off the commit path: a background thread with a connection of its own.

In WAL mode every commit appends pages to the ``-wal`` file; a *checkpoint* copies them back into
the database file and syncs it, after which the WAL starts over. SQLite's default runs it inside the
commit that crosses 1,000 WAL pages: that one commit in a few hundred paid several milliseconds
(measured: the replicant-lag p99 fell from 11-13 ms to 3.5-5.3 ms without it), and so did every
write waiting on it.

Here the committing connection runs with ``wal_autocheckpoint = 0`` and a WAL hook (called after
each commit with the WAL's size in pages):

* at ``pages_background`` pages or more it wakes the checkpointer thread, which runs a PASSIVE
  checkpoint on its own connection: the bulk of the work (copying the pages, syncing the database)
  never blocks the writer, and apsw releases the GIL while SQLite works, so the loop goes on;
* once such a checkpoint has completed, the next commit finishes it inline: a PASSIVE checkpoint
  of the few pages committed meanwhile. The WAL can only start over when a checkpoint has copied
  *all* of it, which a background checkpoint racing a busy writer never does; one that did (the
  writer idle) leaves nothing to finish: a commit below ``pages_background`` (the WAL started over)
  forgets it, and the next crossing wakes the thread again;
* at ``pages_inline`` pages or more (the thread fell behind: a slow disk, a long reader) the
  committing connection checkpoints whatever is left itself, so the WAL stays bounded whatever the
  thread does;
* but while a reader holds a snapshot (a backup's read transaction, a long query), no checkpoint can
  copy what came after it, and the WAL cannot start over: each commit past a threshold would run a
  checkpoint that copies nothing new. So an inline checkpoint that could not copy the whole WAL is
  counted ``pinned`` (not ``forced``: the thread is not behind), and no commit checkpoints, nor wakes
  the thread, until the WAL has moved on: grown ``pages_background`` more pages (then one checkpoint
  tries again: the reader may be gone) or started over.

The thread starts at the first wake-up (a store that never writes much has none) and stops at
``close``; if no thread (or no connection for it) can be had, commits checkpoint at
``pages_background`` as SQLite's default does, and a commit never fails for its checkpoint. A
checkpoint that fails for want of space is logged and retried at the next wake-up, at most once per
``RETRY_S`` (an inline one at the next commit at a threshold, logged at most a line per ``RETRY_S``
with the count of those left out: ``warnings``, which the node's loop flushes); the inline bound
still holds meanwhile. A checkpoint that fails with an I/O error (a
failed fsync of the database file) is never retried (``rlog.disk``): the thread stops and records
it in ``fatal``, which the node's loop turns into a stop; an inline one raises
``StorageFailedError`` from the commit. After either, no checkpoint runs again: a commit that
reaches ``pages_inline`` raises ``fatal`` instead, and the store closes without SQLite's
checkpoint (``Store.close``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import apsw
from mnesite.rlog.disk import StorageFailedError, StorageFault
from mnesite.rlog.throttle import ThrottledLog

log = logging.getLogger(__name__)

# The thread is woken at 8,000 pages (about 32 MiB), not SQLite's 1,000: a page that commits rewrite
# over and over (a key range's last leaf, the log's newest pages) is copied once per checkpoint, so
# fewer checkpoints copy fewer pages. Measured (benchmarks/PROFILE.md, 2026-11-27): a follower's CPU
# per write at 64 clients 0.93-0.95x of 1,000's, the sequencer's 0.96-0.97x (12 alternated rounds);
# a follower-shaped store alone 27 against 29-31 us a write, its commits' p99 0.8 against 2.2-2.5 ms
# (fewer finishing checkpoints), the p999 4-6 against 3.5 ms.
WAL_PAGES_BACKGROUND = 8000
WAL_PAGES_INLINE = 16_000  # about 64 MiB of 4 KiB pages
RETRY_S = 1.0
STOP_TIMEOUT_S = 30.0


class WalCheckpointer:
    """Background checkpoints of one database file (see the module's docstring)."""

    def __init__(
        self,
        path: str,
        synchronous: str,
        pages_background: int = WAL_PAGES_BACKGROUND,
        pages_inline: int = WAL_PAGES_INLINE,
        fault_of: Callable[[BaseException, int], StorageFault | None] = lambda error, system_errno: None,
    ) -> None:
        if not 0 < pages_background <= pages_inline:
            raise ValueError("need 0 < pages_background <= pages_inline")
        self.path = path
        self.synchronous = synchronous
        self.pages_background = pages_background
        self.pages_inline = pages_inline
        # What a checkpoint's error says about the disk, given the OS error its connection kept
        # (``rlog.store.storage_fault``: a write refused for a quota is a full disk, retried).
        self.fault_of = fault_of
        # A background checkpoint's I/O error: the node must stop (read by the node's loop).
        self.fatal: StorageFailedError | None = None
        self.background = 0  # checkpoints the thread ran
        self.inline = 0  # checkpoints the committing connection ran (finishing or forced)
        self.forced = 0  # of which forced: the WAL reached pages_inline (the thread fell behind)
        self.pinned = 0  # inline checkpoints a reader's snapshot kept from copying the whole WAL
        # The WAL's pages when an inline checkpoint could not copy it all (a reader holds it): no
        # commit checkpoints until it has grown pages_background more (or started over).
        self._pinned_pages: int | None = None
        self.failures = 0
        self.inline_due = False
        self._forced_due = False
        # A background checkpoint completed since the last inline one: the next commit finishes it.
        self._backfilled = False
        # No thread could be had (or open its connection): commits checkpoint at pages_background,
        # as SQLite's own autocheckpoint does.
        self._no_thread = False
        # The inline checkpoint's failures (one can come with every commit while the disk is full): at
        # most a line a second, with the count left out; the node's loop flushes it every turn.
        self.warnings = ThrottledLog(log, interval_ms=int(RETRY_S * 1000))
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def on_wal(self, pages: int) -> None:
        """The committing connection's WAL hook: the WAL holds ``pages`` pages after a commit."""
        if pages >= self.pages_inline:
            if self._pinned_pages is not None and self._still_pinned(self._pinned_pages, pages):
                return
            self.inline_due = self._forced_due = True
        elif pages >= self.pages_background:
            if self._pinned_pages is not None and self._still_pinned(self._pinned_pages, pages):
                return
            if self._backfilled or self._no_thread:
                self._backfilled = False
                self.inline_due = True
            else:
                try:
                    self._start()
                except RuntimeError as error:  # no thread to be had: never fail the commit for it
                    log.warning("%s: no background WAL checkpoints (%s); commits checkpoint inline", self.path, error)
                    self._no_thread = self.inline_due = True
                    return
                self._wake.set()
        elif self._backfilled:
            # Below the threshold the WAL has started over (it only grows until then): nothing is left
            # to finish. Kept, the mark of a checkpoint that copied it all (the writer idle, or a run
            # again on the young WAL of a wake-up set while it ran) had the commit that next crossed
            # the threshold checkpoint the whole WAL inline instead of waking the thread.
            self._backfilled = False

    def _still_pinned(self, pinned_pages: int, pages: int) -> bool:
        """Whether the WAL of ``pages`` is still where an inline checkpoint found it held by a reader
        at ``pinned_pages`` (see the module's docstring); forgets that once it moved on."""
        if pinned_pages <= pages < pinned_pages + self.pages_background:
            return True
        self._pinned_pages = None
        return False

    def checkpoint_inline(self, connection: apsw.Connection) -> None:
        """Run by the committing connection after its commit when ``inline_due``. Never once a
        background checkpoint failed with an I/O error (``fatal``): a second sync of the database file
        may succeed over pages the kernel dropped, and the WAL then start over without them."""
        if self.fatal is not None:
            raise StorageFailedError(f"{self.fatal} (no checkpoint runs after it)")
        try:
            wal_pages, copied_pages = connection.wal_checkpoint(mode=apsw.SQLITE_CHECKPOINT_PASSIVE)
        except apsw.BusyError:
            return  # the thread is checkpointing right now: try again after the next commit
        except apsw.Error as error:
            if self.fault_of(error, connection.system_errno) is StorageFault.FAILED:
                raise StorageFailedError(f"{self.path}: WAL checkpoint failed: {error}") from error
            # The commit itself succeeded: never report it failed for its checkpoint. The next
            # commit at or above a threshold tries again; the log says so at most every RETRY_S.
            self.failures += 1
            self.inline_due = False
            self.warnings.log(
                "inline checkpoint failed",
                logging.WARNING,
                "%s: WAL checkpoint failed: %s (%d failures so far)",
                self.path,
                error,
                self.failures,
            )
            return
        self.inline_due = False
        self.inline += 1
        forced, self._forced_due = self._forced_due, False
        if copied_pages < wal_pages:
            # Only a reader's snapshot stops the writer's own PASSIVE checkpoint short: what it did not
            # copy, no checkpoint can until the reader ends.
            self._pinned_pages = wal_pages
            self.pinned += 1
        elif forced:
            self.forced += 1

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(STOP_TIMEOUT_S)
            if thread.is_alive():
                log.warning("%s: the WAL checkpointer did not stop within %.0f s", self.path, STOP_TIMEOUT_S)

    def status(self) -> dict[str, int | bool]:
        """For ``status``: a growing ``forced`` means the background thread cannot keep up."""
        return {
            "background": self.background,
            "inline": self.inline,
            "forced": self.forced,
            "pinned": self.pinned,
            "failures": self.failures,
            "thread": self.running,
        }

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stopping.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="mnesite-wal-checkpoint", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            connection = apsw.Connection(self.path, flags=apsw.SQLITE_OPEN_READWRITE)
            # The same durability as the writer's: a checkpoint at NORMAL or above syncs the database.
            connection.execute(f"PRAGMA synchronous={self.synchronous}")
        except apsw.Error as error:
            self.failures += 1
            log.warning("%s: no background WAL checkpoints (%s); commits checkpoint inline", self.path, error)
            self._no_thread = True
            return
        try:
            while not self._stopping.is_set():
                self._wake.wait()
                self._wake.clear()
                if self._stopping.is_set() or not self._checkpoint_in_background(connection):
                    break
        finally:
            connection.close()

    def _checkpoint_in_background(self, connection: apsw.Connection) -> bool:
        """One checkpoint of the thread (woken by ``on_wal``) on its ``connection``; False: the thread ends."""
        try:
            connection.wal_checkpoint(mode=apsw.SQLITE_CHECKPOINT_PASSIVE)
            self.background += 1
            self._backfilled = True
        except apsw.BusyError:
            pass  # a commit is finishing a checkpoint right now: not a failure
        except apsw.Error as error:
            self.failures += 1
            if self.fault_of(error, connection.system_errno) is StorageFault.FAILED:
                # Never retried: a second sync may succeed over pages the kernel dropped.
                self.fatal = StorageFailedError(f"{self.path}: background WAL checkpoint failed: {error}")
                log.error("%s (not retried: the node stops)", self.fatal)
                return False
            log.warning("%s: background WAL checkpoint failed: %s (retrying)", self.path, error)
            self._stopping.wait(RETRY_S)
        return True
