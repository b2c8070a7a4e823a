"""Space for the WAL reserved ahead of its frames, off the loop: a durable commit's fsync then writes
over blocks the ``-wal`` file has already, instead of growing it.

Why. A commit appends frames to the WAL, and at ``synchronous=FULL`` the store then fdatasyncs the
``-wal`` file (``Store.commit``). While the file grows, that sync must also make its new size
durable: on ext4 a journal commit, which one file system's writers take in turn. Once the file
is as long as the frames it will hold, the sync writes the data alone. Measured on this 2-CPU
machine (2026-12-02, a 4 KiB write and its fdatasync): 203 against 134 us alone, and 325 against 214 us
with three such writers on the one disk, as three cores on one machine are. A WAL grows for its first
``pages_background`` frames (about 32 MiB, ``rlog.checkpoint``) after every start: tens of seconds
under load, and hours of a light one, in which every commit paid for the growing sync.

How. After each commit SQLite's WAL hook says how many frames the WAL holds (``on_wal``, on the
committing thread). Once the frames pass ``START_BYTES`` and come within ``LOW_WATER_BYTES`` of the
space reserved, a thread of its own appends zeros to the file up to ``AHEAD_BYTES`` past the
frames (never past ``limit_bytes``: about the size the WAL reaches anyway before the background
checkpoint starts it over), then fdatasyncs the file: the slow, growing sync happens there and
not in a commit.

* The zeros can never land on a frame. The file is opened ``O_APPEND``: each write goes to the
  file's end as it is at that moment, atomically, so a frame SQLite wrote meanwhile (the thread
  races the loop) is always before it; SQLite's later frames overwrite the zeros.
* SQLite ignores what lies past its frames: a WAL is read up to the first frame whose salt and
  checksum do not follow from the header. Zeros never do. This is also what a WAL that started
  over looks like: it keeps its length, and its old frames lie past the new ones.
* It never takes the disk's last space. An extension is made only while ``FREE_BYTES_MIN`` would
  stay free beside it (``os.statvfs``): a nearly full disk, and every small test file system, gets
  no reservation. It only takes space the WAL would take anyway; once the WAL restarts, the file
  keeps the space until the store closes.
* It never fails a commit: it is a speed-up. A write or a sync that fails (a full disk, a file gone)
  ends the reservations of this store with one warning (``failures``). A real disk fault still
  surfaces where it did: SQLite's writes and the loop's own fdatasync report it (Linux reports a
  writeback error to every descriptor open on the file, so this thread's sync does not consume it;
  the store opens its descriptor when it opens, before any commit can start this thread).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

WAL_HEADER_BYTES = 32  # SQLite's WAL header, before the first frame
FRAME_HEADER_BYTES = 24  # before each frame's page
START_BYTES = 1 << 20  # a WAL shorter than this is left alone: a small store never starts the thread
AHEAD_BYTES = 4 << 20  # an extension reserves this far past the frames' end
LOW_WATER_BYTES = 2 << 20  # ... once the frames come this close to the reserved end
WRITE_BYTES = 1 << 20  # zeros per write
FREE_BYTES_MIN = 256 << 20  # left free on the file system beside an extension, or no extension
STOP_TIMEOUT_S = 30.0
_ZEROS = bytes(WRITE_BYTES)


def frames_end(pages: int, page_size: int) -> int:
    """Where the WAL's frames end, in bytes, when it holds ``pages`` frames of ``page_size``."""
    return WAL_HEADER_BYTES + pages * (FRAME_HEADER_BYTES + page_size)


def extension_target(end: int, reserved: int, limit: int) -> int | None:
    """The size to extend the WAL to, its frames ending at ``end`` with ``reserved`` bytes known to
    be in the file (None: no extension now). Pure: the rule ``WalReserve.on_wal`` applies."""
    if end < START_BYTES or end + LOW_WATER_BYTES <= reserved:
        return None
    target = min(limit, end + AHEAD_BYTES)
    return target if target > reserved else None


class WalReserve:
    """Reserves space for one ``-wal`` file ahead of its frames (see the module's docstring)."""

    def __init__(self, wal_path: str, page_size: int, limit_bytes: int) -> None:
        self.wal_path = wal_path
        self.page_size = page_size
        self.limit_bytes = limit_bytes
        self.free_bytes_min = FREE_BYTES_MIN
        self.reserved = 0  # bytes the file is known to hold, synced (set by the thread)
        self.extensions = 0
        self.declined = 0  # extensions not made: the disk had less than free_bytes_min beside them
        self.failures = 0
        self.frames_end = 0  # where the WAL's frames ended after the last commit
        self.target = 0  # the size the loop asked for last (read by the thread)
        self._failed = False
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def on_wal(self, pages: int) -> None:
        """The committing connection's WAL hook: the WAL holds ``pages`` frames. Cheap: one
        comparison on most commits; wakes the thread when an extension is due."""
        self.frames_end = end = frames_end(pages, self.page_size)
        if self._failed or self._stopping.is_set():
            return
        target = extension_target(end, max(self.reserved, self.target), self.limit_bytes)
        if target is None:
            return
        self.target = target
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="mnesite-wal-reserve", daemon=True)
            try:
                thread.start()
            except RuntimeError as error:
                # No thread to be had (a pids limit): raised here, in SQLite's WAL hook, it made the
                # COMMIT that had just succeeded look failed. Never fail a commit for a speed-up.
                self.failures += 1
                self._failed = True
                log.warning("%s: no WAL space reserved ahead (%s); commits sync a growing WAL", self.wal_path, error)
                return
            self._thread = thread
        self._wake.set()

    def stop(self) -> None:
        """End the thread (before the store's connection closes: SQLite may delete the file then)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("%s: the WAL reservation thread did not stop within %.0f s", self.wal_path, STOP_TIMEOUT_S)

    def status(self) -> dict[str, int]:
        return {
            "reserved_bytes": self.reserved,
            "extensions": self.extensions,
            "declined": self.declined,
            "failures": self.failures,
        }

    def _run(self) -> None:
        fd: int | None = None
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopping.is_set():
                    return
                if fd is None:
                    # Not O_CREAT: the file is SQLite's, there since its first frame; gone means closed.
                    fd = os.open(self.wal_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                self._extend(fd, self.target)
        except OSError as error:
            self.failures += 1
            self._failed = True
            log.warning(
                "%s: no more WAL space reserved ahead (%s); commits sync a growing WAL, as without it",
                self.wal_path,
                error,
            )
        finally:
            if fd is not None:
                os.close(fd)

    def _extend(self, fd: int, target: int) -> None:
        size = os.fstat(fd).st_size
        if size >= target:
            self.reserved = size
            return
        stats = os.statvfs(self.wal_path)
        if stats.f_bavail * stats.f_frsize - (target - size) < self.free_bytes_min:
            self.declined += 1
            return  # nearly full: the space is the data's (asked again once the frames near the target)
        while size < target and not self._stopping.is_set():
            os.write(fd, _ZEROS[: min(WRITE_BYTES, target - size)])  # O_APPEND: at the end as it is now
            size = os.fstat(fd).st_size
        os.fdatasync(fd)
        self.extensions += 1
        self.reserved = size
