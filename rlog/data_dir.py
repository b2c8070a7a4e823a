"""A node's data directory: one process at a time, readable by its owner only.

Theory of operation
-------------------
Two processes on one data directory would both append to one rlog and one of them would die later
with a confusing error. So a node takes an exclusive ``flock`` on ``data_dir/LOCK`` before it opens
the database and keeps it until it stops; the kernel releases it when the process dies, so a crash
never leaves a stale lock. The lock file records the node's name and process id, and a second
process refuses to start with an error that names them.

The data is the database's: the directory is made 0700 and a new database file 0600 before SQLite
opens it (SQLite gives its -wal and -shm files the database file's mode), whatever the umask. An
existing database file is narrowed to 0600 (with its -wal and -shm) by the store once it has read it
as a store and before it opens the WAL for writing: a file it refuses, another application's, is
left exactly as it was, mode included.

A directory made here is made durable at once: its parent is fsynced (each new one's, when several
levels are made), so that a power loss cannot take the directory's entry, and every commit under it,
away. The store syncs the data directory itself, which holds the database's entry (``rlog.store``).
"""

from __future__ import annotations

import fcntl
import os

from mnesite.rlog.store import Store, fsync_directory

LOCK_FILE = "LOCK"
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
LOCK_RECORD_BYTES_MAX = 256


def _make_directory_durably(data_dir: str) -> None:
    """Create ``data_dir`` (and its missing parents, 0700) if needed, and fsync the parent of each
    directory made here, once: a new directory's entry is in its parent, which a power loss can lose
    with everything under it, though every commit was synced (the store syncs the data directory
    itself, ``rlog.store``, never its parent). An existing directory costs no fsync."""
    made = []
    path = os.path.abspath(data_dir)
    while not os.path.isdir(path):
        made.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not made:
        return
    os.makedirs(data_dir, mode=DIRECTORY_MODE, exist_ok=True)
    for directory in reversed(made):  # the outermost first: its entry holds the others'
        fsync_directory(os.path.dirname(directory))


class DataDirectoryInUse(RuntimeError):
    """Another process holds this data directory."""


class DataDirectoryLock:
    def __init__(self, data_dir: str, fd: int) -> None:
        self.data_dir = data_dir
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: str, node_name: str, database_path: str | None = None) -> DataDirectoryLock:
        """Create the directory (0700) if needed and lock it for ``node_name``; raise ``DataDirectoryInUse``."""
        _make_directory_durably(data_dir)
        os.chmod(data_dir, DIRECTORY_MODE)
        path = os.path.join(data_dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        # One block from the lock on: a Ctrl-C raised as ``flock`` returns (a signal's handler runs as a
        # call ends) must not leave the directory locked by a descriptor nothing closes.
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, LOCK_RECORD_BYTES_MAX, 0).decode("utf-8", "replace").strip()
                raise DataDirectoryInUse(
                    f"data directory {data_dir} is in use by {holder or 'another process'}; stop that node first "
                    f"(two processes on one data directory would corrupt its rlog)"
                ) from None
            os.fchmod(fd, FILE_MODE)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"node {node_name} (pid {os.getpid()})\n".encode(), 0)
            if database_path is not None:
                # Created 0600 before SQLite opens it. An existing one is left as it is: the store
                # narrows it once it is known to be a store (``Store(file_mode=...)``), since a file
                # it refuses (another application's) must keep its mode.
                os.close(os.open(database_path, os.O_RDWR | os.O_CREAT, FILE_MODE))
            # Made inside: a Ctrl-C as the object is made (a Python call) would leave the descriptor open.
            return cls(data_dir, fd)
        except BaseException:
            # A process that goes on after this failure (in use, not lockable: ENOLCK on NFS without its
            # lock daemon, a Ctrl-C) must not keep the lock file open, nor the directory locked by itself.
            os.close(fd)
            raise

    @classmethod
    def acquire_and_open(
        cls, data_dir: str, node_name: str, database_path: str, synchronous: str
    ) -> tuple[Store, DataDirectoryLock]:
        """The node's ``rlog.store.Store`` opened under the lock (both returned); a database that does
        not open gives the lock back before the error leaves (a process may go on after it)."""
        lock = cls.acquire(data_dir, node_name, database_path)
        try:
            return Store(database_path, synchronous=synchronous, file_mode=FILE_MODE), lock
        except BaseException:
            lock.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None
