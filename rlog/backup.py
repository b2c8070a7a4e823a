"""Online backup of a running node and restore into a new data directory.

Theory of operation
-------------------
A backup must be one consistent state of the database, and the node must keep serving while it
is taken. The node's database is in WAL mode, where a reader never blocks a writer. So the backup
opens its own read-only connection and starts a read transaction on the node's loop thread, at
the moment the request is accepted: that pins one snapshot, the state after the last transaction
the node committed. A background thread then copies that snapshot with SQLite's online backup API
(apsw ``Connection.backup``) in steps of ``step_pages`` pages; because its connection holds the
read transaction across steps, the node's later commits neither restart the copy nor show up in
it. The node's loop never waits for the copy (it only answers "running" with the pages copied);
the cost is that the WAL cannot be checkpointed past the pinned snapshot until the copy ends.

Everything a node knows is in that one database file, so the snapshot carries each shard's
applied tx key and digest in the same transaction as the rows (DESIGN invariant 4). The copy is
written to ``FILE.partial``, switched to a rollback journal (one self-contained file), given a
``backup`` record in ``_mnesite_meta`` (node, role, time, and per shard the applied tx key, digest
and generation) and linked to ``FILE`` (never replacing a file made there meanwhile), then ``FILE.partial``
is removed: a file named ``FILE`` is always a complete backup.

``restore`` seeds a new data directory from a backup: the copy is checked first (SQLite's integrity
check and each shard's digest chain: a bit flipped on a disk or in a copy is refused, not started
on), then drops what is not part of the
committed state (entries after the applied key, which a core may not have seen committed; a
replicant's spill) and the counters of the node it came from. A replicant started there sends
``watch(shard, applied key, digest)`` like after a restart and resumes from the rlog without a
bootstrap while the cores still retain that key. A core started there first asks its peers for
the generations in use (as a core with an empty database does), so that it never votes twice in a
generation it may have voted in with the state the backup lost.

A restore of a large backup reads it twice (the copy, then the checks), which takes minutes: it works
in steps (``RestoreSteps``: pages per copy step, SQLite steps between two calls of the integrity check's
progress handler, entries per batch of the chain check) and passes an event to ``progress`` after
each, the caller paces what it shows. Those steps are also where Ctrl-C stops it: SQLite's integrity
check runs in C, so without a progress handler a KeyboardInterrupt would wait for its end; the handler
is a Python call, where the interrupt is raised, and it aborts the check. Whatever the phase, the
restore then removes ``mnesite.db.partial``: a restore that did not end leaves no ``mnesite.db``.

The request is answered by ``decide`` (pure): one backup at a time per node; asking again with the
same path reports its progress, so the client polls with the same request until it is done.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import apsw
from mnesite.rlog.limits import BACKUP_CHUNK_BYTES_MAX
from mnesite.rlog.messages import BACKUP_PATH_CHARS_MAX, BACKUP_PATH_PATTERN
from mnesite.rlog.security import PUBLIC_SUFFIX, SECRET_SUFFIX
from mnesite.rlog.store import fsync_directory
from mnesite.rlog.types import TxKey
from mnesite.rlog.versions import SOFTWARE_VERSION, STORAGE_FORMATS_READ

# The requests a node answers with ``NodeServer.backup_request``: start or poll a backup, read it.
BACKUP_KINDS = frozenset({"backup", "backup_read"})
DATABASE_FILE_NAME = "mnesite.db"
PARTIAL_SUFFIX = ".partial"
# An absolute path of plain characters: never relative to the node's working directory, no "..".
PATH_CHARS_MAX = BACKUP_PATH_CHARS_MAX
PATH_PATTERN = re.compile(BACKUP_PATH_PATTERN)
# Pages copied per step. 256 pages of 4 KiB are 1 MiB: a step takes milliseconds, and the copy
# thread yields the GIL and the database between steps so the node's loop is never starved.
STEP_PAGES_DEFAULT = 256
STEP_PAGES_MAX = 1_000_000
# How long a shutdown waits for a cancelled copy to stop (it stops between two steps).
CANCEL_TIMEOUT_S = 30.0
# Problems of a damaged backup's integrity check named in restore's error (SQLite stops there).
INTEGRITY_PROBLEMS_MAX = 3
# Bytes of a backup sent in one ``backup_read`` answer, at most, and at most a quarter of the node's
# frame_bytes_max (``chunk_bytes_max``): the read is one ``pread`` on the node's loop thread, and a
# megabyte takes about a millisecond from the page cache.
CHUNK_BYTES_MAX = BACKUP_CHUNK_BYTES_MAX
CHUNK_FRAME_SHARE = 4


@dataclass(frozen=True)
class RestoreSteps:
    """How much ``restore`` does between two progress events (and two chances for Ctrl-C to stop it)."""

    # Pages of the backup copied per step: 256 pages of 4 KiB are 1 MiB, milliseconds of work.
    copy_pages: int = STEP_PAGES_DEFAULT
    # SQLite steps (virtual machine instructions, b-tree cells checked) between two calls of the
    # integrity check's progress handler: about a millisecond of work, so Ctrl-C stops it at once.
    check_sqlite_steps: int = 100_000
    # rlog entries read and chained per batch of the digest chain's check.
    chain_entries: int = 1000

    def __post_init__(self) -> None:
        # A step of 0 would copy nothing (a loop without end), switch the progress handler off (no
        # Ctrl-C inside the check) or read no entries; -1 would copy the whole file in one step.
        if not 1 <= self.copy_pages <= STEP_PAGES_MAX or self.check_sqlite_steps < 1 or self.chain_entries < 1:
            raise ValueError(f"restore steps must be positive (copy_pages at most {STEP_PAGES_MAX}): {self}")


RESTORE_STEPS = RestoreSteps()


@dataclass(frozen=True)
class RestorePagesCopied:
    """A step of the copy of the backup into ``mnesite.db.partial`` ended."""

    pages_copied: int
    pages_total: int


@dataclass(frozen=True)
class RestoreIntegrityChecking:
    """SQLite's integrity check of the copy (``pages_total`` pages) is under way, ``sqlite_steps`` steps in."""

    sqlite_steps: int
    pages_total: int


@dataclass(frozen=True)
class RestoreChainVerified:
    """A batch of ``shard``'s rlog was found on the digest chain, up to ``tx_key`` (the check ends at ``applied``);
    ``entries_verified`` counts the entries of every shard checked so far."""

    shard: str
    entries_verified: int
    tx_key: TxKey
    applied: TxKey


@dataclass(frozen=True)
class RestoreFinished:
    """``mnesite.db`` is in place: the restore is done."""

    pages_total: int
    entries_verified: int
    seconds: float


RestoreProgress = RestorePagesCopied | RestoreIntegrityChecking | RestoreChainVerified | RestoreFinished
BACKUP_META = "backup"
RESTORED_META = "restored"
# Meta entries that describe the node a backup was taken on, not the data: a restored node starts afresh.
NODE_META_PREFIXES = ("bootstraps:", "resumes:", "bootstraps_outrun:")


class BackupError(RuntimeError):
    """A backup or restore cannot be done; the message says why, for an operator."""


def check_path(path: str) -> str:
    """The backup path a request may name: absolute, plain characters, no ``..``, not a key file's
    name (``NAME.key``, ``NAME.key_secret``), not existing yet."""
    if not isinstance(path, str) or not 1 < len(path) <= PATH_CHARS_MAX or not PATH_PATTERN.match(path):
        raise BackupError("the backup path must be absolute and made of letters, digits, '_', '.', '-' and '/'")
    if ".." in path.split("/"):
        raise BackupError("the backup path must not contain '..'")
    if path.lower().endswith((PUBLIC_SUFFIX, SECRET_SUFFIX)):
        # A backup is the node's own file, holding rows any writer chose: named NAME.key in an
        # authorized_keys directory, a row's "public-key = ..." line made it a principal's key (or a
        # file too large for one stopped every reload, keeping the keys an operator meant to revoke).
        raise BackupError(
            f"the backup path must not end in {PUBLIC_SUFFIX} or {SECRET_SUFFIX}: those are key files' names "
            "(a backup in an authorized_keys directory would be read as a key); name it FILE.db"
        )
    if not os.path.isdir(os.path.dirname(path)):
        raise BackupError(f"{os.path.dirname(path)}: no such directory on the node's host")
    return path


@dataclass(frozen=True)
class FileIdentity:
    """What tells a file apart from another one, or from itself once changed: its device and inode (a
    file renamed or linked into its place has others), its size and its modification time."""

    device: int
    inode: int
    size: int
    modified_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> FileIdentity:
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def chunk_bytes_max(frame_bytes_max: int) -> int:
    """The bytes of a ``backup_read`` answer's chunk: well within one frame of ``frame_bytes_max``."""
    return max(1, min(CHUNK_BYTES_MAX, frame_bytes_max // CHUNK_FRAME_SHARE))


def read_chunk(job: BackupJob | None, path: str, offset: int, bytes_max: int) -> dict[str, Any]:
    """The ``backup_read`` request: up to ``bytes_max`` bytes of the backup file at ``path`` from ``offset``,
    the file's size and whether they reach its end. Raises ``BackupError`` saying why it is refused.

    A node sends only its own last backup (``job``, what ``status`` shows), once it is done, and only
    while the file at its path is the one it wrote (``BackupJob.published``): any other path, or a
    file changed, replaced or removed since, is refused, so this request never reads another file of
    the node's host. It runs on the node's loop thread: one open that never blocks or follows a link,
    one ``fstat`` and one bounded ``pread``."""
    if job is None or job.path != path:
        last = "no backup" if job is None else f"its last backup is {job.path}"
        raise BackupError(
            f"{path} is not this node's last backup ({last}): a node sends only the file of its own last backup"
        )
    if job.state != "done" or job.published is None:
        raise BackupError(f"the backup to {path} is {job.state}: only a finished backup is sent")
    try:
        # O_NONBLOCK: a FIFO put at the path must not hold the loop in open(); O_NOFOLLOW: nor a link be read.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise BackupError(f"{path} is gone or unreadable since the backup finished ({error.strerror})") from None
    try:
        identity = FileIdentity.of(os.fstat(fd))
        if identity != job.published:
            raise BackupError(
                f"{path} changed or was replaced since the backup finished (not the file this node wrote): "
                "take a new backup"
            )
        if offset > identity.size:
            raise BackupError(f"offset {offset} is past the end of {path} ({identity.size} bytes)")
        data = os.pread(fd, min(bytes_max, identity.size - offset), offset)
    finally:
        os.close(fd)
    return {"data": data, "size": identity.size, "end": offset + len(data) >= identity.size}


@dataclass(frozen=True)
class JobView:
    """What ``decide`` needs to know of the current backup job."""

    path: str
    running: bool
    moved_away: bool = False  # done, and its file is no longer at its path


def decide(current: JobView | None, requested_path: str) -> str:
    """``start`` a new backup, ``report`` the current one, or ``busy`` (another one runs)."""
    if current is not None and current.path == requested_path and not current.moved_away:
        # A finished backup whose file was moved away (archived) is not what a new request for
        # its path asks about: reporting it would say "done" and write nothing.
        return "report"
    if current is not None and current.running:
        return "busy"
    return "start"


def positions(connection: apsw.Connection) -> dict[str, dict[str, Any]]:
    """Per shard: applied tx key, its digest (hex) and generation, as stored in ``connection``'s database."""
    return {
        shard: {"applied": [applied_generation, applied_counter], "digest": digest.hex(), "generation": generation}
        for shard, generation, applied_generation, applied_counter, digest in connection.execute(
            "SELECT shard, generation, applied_generation, applied_counter, applied_digest "
            "FROM _mnesite_shards ORDER BY shard"
        )
    }


class BackupJob:
    """One backup of ``source_path`` into ``path``, copied by a thread from a snapshot pinned at start."""

    def __init__(
        self,
        source_path: str,
        path: str,
        node: str,
        role: str,
        step_pages: int = STEP_PAGES_DEFAULT,
        after_publish: Callable[[], Any] | None = None,
    ) -> None:
        """``after_publish``: called on the copy's thread once the file is published, before the job is done
        (a scheduled backup prunes the older ones there, off the node's loop); its result is kept in
        ``after_publish_result``, an error it raises in ``after_publish_error`` (the backup is done anyway)."""
        self.path = check_path(path)
        if os.path.lexists(path) or os.path.lexists(path + PARTIAL_SUFFIX):
            raise BackupError(f"{path} (or {path}{PARTIAL_SUFFIX}) exists; a backup never overwrites a file")
        if not 1 <= step_pages <= STEP_PAGES_MAX:
            raise BackupError(f"step_pages must be 1..{STEP_PAGES_MAX}")
        self.node = node
        self.role = role
        self.step_pages = step_pages
        self.state = "running"
        self.error: str | None = None
        self.pages_total = 0
        self.pages_remaining = 0
        self.started_s = time.time()
        self.finished_s: float | None = None
        self.record: dict[str, Any] | None = None
        # The published file as it was once done (``read_chunk`` sends it only while it is still that file).
        self.published: FileIdentity | None = None
        self._after_publish = after_publish
        self.after_publish_result: Any = None
        self.after_publish_error: str | None = None
        self._cancelled: str | None = None
        # Pin the snapshot now, on the caller's (the node loop's) thread: the backup is the state
        # after the last transaction the node committed before it accepted the request.
        self._source = apsw.Connection(source_path, flags=apsw.SQLITE_OPEN_READONLY)
        try:
            self._source.set_busy_timeout(5000)
            self._source.execute("BEGIN")
            self.positions = positions(self._source)  # the first read starts the read transaction
        except apsw.Error as error:
            self._source.close()
            raise BackupError(f"cannot read the database: {error}") from None
        self._thread = threading.Thread(target=self._run, name="mnesite-backup", daemon=True)
        self._thread.start()

    @property
    def view(self) -> JobView:
        return JobView(self.path, self.state == "running", self.state == "done" and not os.path.lexists(self.path))

    def _run(self) -> None:
        partial = self.path + PARTIAL_SUFFIX
        created = False  # FILE.partial is this job's to remove only once its exclusive create succeeded
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never follows or reuses a file
            created = True
            os.close(fd)
            target = apsw.Connection(partial)
            try:
                with target.backup("main", self._source, "main") as copy:
                    while not copy.done:
                        if self._cancelled is not None:
                            raise BackupError(f"cancelled: {self._cancelled}")
                        copy.step(self.step_pages)
                        self.pages_total, self.pages_remaining = copy.page_count, copy.remaining
                        time.sleep(0)  # let the node's loop take the GIL between steps
                self._source.execute("COMMIT")
                self._finish(target)
            finally:
                target.close()
            publish(partial, self.path)
            fsync_directory(os.path.dirname(self.path))
            self.published = FileIdentity.of(os.lstat(self.path))
            if self._after_publish is not None:
                try:
                    self.after_publish_result = self._after_publish()
                except Exception as error:  # the backup itself is complete: it is done, and says what failed after
                    self.after_publish_error = f"{type(error).__name__}: {str(error)[:300]}"
            self.state = "done"
        except Exception as error:  # reported to the client that polls; the node goes on serving
            self.error = f"{type(error).__name__}: {str(error)[:300]}"
            self.state = "failed"
            if created and os.path.exists(partial):
                os.unlink(partial)
        finally:
            self._source.close()
            self.finished_s = time.time()

    def _finish(self, target: apsw.Connection) -> None:
        target.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no -wal beside it
        record = {
            "node": self.node,
            "role": self.role,
            "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_s)),
            "shards": positions(target),
            # The release that wrote it and the storage format it holds (rlog.versions): a release that
            # does not read that format refuses to restore it (rlog.store), with one clear error.
            "software": SOFTWARE_VERSION,
            "storage_format": target.execute(
                "SELECT value FROM _mnesite_meta WHERE name = 'format_version'"
            ).fetchone()[0],
        }
        if record["shards"] != self.positions:
            raise BackupError("the copy does not hold the snapshot it started from")
        with target:
            target.execute(
                "INSERT OR REPLACE INTO _mnesite_meta(name, value) VALUES (?, ?)", (BACKUP_META, json.dumps(record))
            )
        self.record = record

    def failure(self) -> dict[str, Any] | None:
        """What ``status`` keeps of this job once it failed (``backup_failed``), None unless it failed."""
        if self.state != "failed":
            return None
        failed_s = self.finished_s or time.time()  # the thread sets ``state`` just before ``finished_s``
        return failure_record(self.path, self.error, failed_s)

    def status(self) -> dict[str, Any]:
        copied = self.pages_total - self.pages_remaining
        return {
            "path": self.path,
            "state": self.state,
            "error": self.error,
            "pages_copied": copied,
            "pages_total": self.pages_total,
            "seconds": round((self.finished_s or time.time()) - self.started_s, 3),
            "shards": self.positions,
        }

    def cancel(self, reason: str, timeout_s: float = CANCEL_TIMEOUT_S) -> bool:
        """Stop the copy between two steps (the node shuts down): the job fails with ``cancelled:
        reason`` and removes its ``.partial`` file, so asking again with the same path starts over.
        True once the copy thread has ended (within ``timeout_s``)."""
        self._cancelled = reason
        return self.wait(timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """For tests and shutdown: True once the copy thread has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def failure_record(path: str, error: str | None, failed_s: float) -> dict[str, Any]:
    """``status``'s ``backup_failed``: a backup to ``path`` that failed at ``failed_s`` (Unix time) with ``error``."""
    return {
        "path": path,
        "error": error,
        "failed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(failed_s)),
        "failed_at_s": round(failed_s, 3),
    }


def publish(partial: str, path: str) -> None:
    """Give the finished copy its name, never replacing a file made at ``path`` while it was copied
    (checked free at the start only): a hard link fails if the name exists, where a rename replaces it."""
    taken = BackupError(f"{path} exists (made while the backup was copied); a backup never overwrites a file")
    try:
        os.link(partial, path)
    except FileExistsError:
        raise taken from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A file system without hard links: the name is checked again just before the rename.
        if os.path.lexists(path):
            raise taken from None
        os.rename(partial, path)
        return
    os.unlink(partial)


def read_record(path: str) -> dict[str, Any]:
    """The ``backup`` record of a backup file; BackupError if ``path`` is not a complete backup."""
    if not os.path.isfile(path):
        raise BackupError(f"{path}: no such file")
    try:
        connection = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
        try:
            row = connection.execute("SELECT value FROM _mnesite_meta WHERE name = ?", (BACKUP_META,)).fetchone()
        finally:
            connection.close()
    except apsw.Error as error:
        raise BackupError(f"{path}: not a mnesite backup ({error})") from None
    if row is None:
        raise BackupError(f"{path}: a mnesite database but not a backup (no backup record)")
    why = record_damage(row[0])
    if why is not None:  # a damaged or crafted file: one clear error, not a traceback where it is shown
        raise BackupError(f"{path}: its backup record is damaged ({why})")
    return json.loads(row[0])


def record_damage(text: Any) -> str | None:
    """What is wrong with a backup record's stored text (``_finish`` writes it), or None: the fields that
    ``restore``, ``rlog verify`` and the CLI's lines read, each of its type."""
    try:
        record = json.loads(text)
    except (TypeError, ValueError) as error:
        return f"not JSON: {error}"
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("storage_format") not in (None, *STORAGE_FORMATS_READ):
        return None  # a format this release does not read: ``restore`` refuses it as such, a clearer error
    for field in ("node", "taken_at"):
        if not isinstance(record.get(field), str):
            return f"{field!r} is not a string"
    shards = record.get("shards")
    if not isinstance(shards, dict):
        return "'shards' is not an object"
    for shard, position in shards.items():
        applied = position.get("applied") if isinstance(position, dict) else None
        if (
            not isinstance(applied, list)
            or len(applied) != 2
            or not all(type(part) is int for part in applied)
            or not isinstance(position.get("digest"), str)
        ):
            return f"shard {shard!r} has no applied key [generation, counter] and digest"
    return None


def restore(
    path: str,
    data_dir: str,
    role: str,
    progress: Callable[[RestoreProgress], None] | None = None,
    steps: RestoreSteps | None = None,
) -> dict[str, Any]:
    """Seed ``data_dir`` (new or empty of a database) for a ``role`` node from the backup at ``path``.

    Returns the backup record with what was dropped. The caller holds no lock; this takes the data
    directory's lock so that a node cannot be running there meanwhile. ``progress`` gets an event
    after each step of ``steps`` (``RESTORE_STEPS`` by default) and a ``RestoreFinished`` at the end.
    """
    from mnesite.rlog.data_dir import DataDirectoryInUse, DataDirectoryLock
    from mnesite.rlog.store import Store, StoreError

    if role not in ("core", "replicant"):
        raise BackupError("role must be core or replicant")
    steps = steps or RESTORE_STEPS
    # Called even when nobody listens: the integrity check's progress handler is where Ctrl-C reaches it.
    report = progress or (lambda event: None)
    started_s = time.monotonic()
    record = read_record(path)
    database_path = os.path.join(data_dir, DATABASE_FILE_NAME)
    if os.path.lexists(database_path):
        raise BackupError(f"{database_path} exists; restore seeds a new data directory only")
    # Built as DIR/mnesite.db.partial and renamed once complete: a restore killed midway must leave no
    # mnesite.db, since a copy whose tail is not dropped nor marked ``restored`` would start a core
    # that skips learning the generations in use. What a killed restore left is ours (under the lock).
    partial = database_path + PARTIAL_SUFFIX
    lock = None
    # The lock is taken inside the block that releases it: a Ctrl-C right after ``acquire`` returned
    # (before a block begun after it) would leave a process that goes on holding the directory.
    try:
        try:
            lock = DataDirectoryLock.acquire(data_dir, f"restore of {os.path.basename(path)}")
        except DataDirectoryInUse as error:
            raise BackupError(str(error)) from None
        if os.path.lexists(database_path):
            raise BackupError(f"{database_path} exists; restore seeds a new data directory only")
        _remove_database_files(partial)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        source = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
        try:
            # Opened inside: a target that does not open must not leave the source open.
            target = apsw.Connection(partial)
            try:
                pages_total = _copy(source, target, steps.copy_pages, report)
            finally:
                target.close()
        finally:
            source.close()
        try:
            store = Store(partial, create=False)
        except StoreError as error:
            raise BackupError(str(error).replace(partial, path)) from None  # the backup is what is refused
        dropped = {}
        try:
            why, entries_verified = _damage(store, pages_total, steps, report)
            if why is not None:
                # A bit flipped by a disk or a copy leaves the record readable and the file open: a node
                # started on it would fail its first read of the rows, or resume from a log that no
                # longer chains to its applied digest.
                raise BackupError(f"{path}: the backup is damaged ({why}); nothing was restored: use another backup")
            with store.write_transaction():
                for name in [row[0] for row in store.connection.execute("SELECT name FROM _mnesite_meta")]:
                    if name.startswith("installing:") and int(store.meta(name, 0)):
                        raise BackupError(f"{path} was taken during a snapshot install ({name}); use another backup")
                    if name.startswith(NODE_META_PREFIXES):
                        store.connection.execute("DELETE FROM _mnesite_meta WHERE name = ?", (name,))
                for shard, position in store.shards().items():
                    # Entries after the applied key may never have committed: a restored node gets them
                    # again from the cores if they did.
                    dropped[shard] = store.truncate_after(shard, position.applied)
                    store.connection.execute("DELETE FROM _mnesite_spill WHERE shard = ?", (shard,))
                store.set_meta(RESTORED_META, json.dumps({"from": record, "role": role}))
        finally:
            store.close()
        # One self-contained file to rename: no -wal of the partial name left beside it.
        connection = apsw.Connection(partial)
        try:
            connection.execute("PRAGMA journal_mode=DELETE")
        finally:
            connection.close()
        # A -wal or -journal left by a mnesite.db deleted before would be replayed into the new one.
        for suffix in ("-journal", "-wal", "-shm"):
            if os.path.lexists(database_path + suffix):
                os.unlink(database_path + suffix)
        os.rename(partial, database_path)
        fsync_directory(data_dir)
    except BaseException:  # KeyboardInterrupt too: Ctrl-C in any phase leaves no partial copy behind
        if lock is not None:  # else the partial copy is another restore's, which holds the lock
            _remove_database_files(partial)
        raise
    finally:
        if lock is not None:
            lock.release()
    report(RestoreFinished(pages_total, entries_verified, round(time.monotonic() - started_s, 3)))
    return {**record, "restored_as": role, "entries_dropped": dropped}


def _copy(
    source: apsw.Connection, target: apsw.Connection, step_pages: int, report: Callable[[RestoreProgress], None]
) -> int:
    """Copy the database of ``source`` into ``target`` in steps of ``step_pages`` pages; returns its pages."""
    with target.backup("main", source, "main") as copy:
        while not copy.done:
            copy.step(step_pages)
            report(RestorePagesCopied(copy.page_count - copy.remaining, copy.page_count))
        return copy.page_count


def check_backup(
    path: str, progress: Callable[[RestoreProgress], None] | None = None, steps: RestoreSteps | None = None
) -> int:
    """Check the backup file at ``path`` as ``restore`` checks its copy (``_damage``), read-only; returns the
    rlog entries verified. Raises ``BackupError`` if it is not a backup or is damaged."""
    from mnesite.rlog.store import Store, StoreError

    read_record(path)
    try:
        store = Store(path, create=False, readonly=True)
    except StoreError as error:
        raise BackupError(str(error)) from None
    try:
        pages_total = store.connection.execute("PRAGMA page_count").fetchone()[0]
        why, entries_verified = _damage(store, pages_total, steps or RESTORE_STEPS, progress or (lambda event: None))
    finally:
        store.close()
    if why is not None:
        raise BackupError(f"{path}: the backup is damaged ({why})")
    return entries_verified


def _damage(
    store: Any, pages_total: int, steps: RestoreSteps, report: Callable[[RestoreProgress], None]
) -> tuple[str | None, int]:
    """What is wrong with the copy of a backup, or None, and the rlog entries verified: SQLite's
    ``integrity_check`` (pages, b-trees, indexes against their tables) and, per shard, the digest chain
    of its rlog up to the applied key (``Store.verify_chains``, what ``mnesite rlog verify`` checks)."""
    from mnesite.rlog.store import StoreError

    calls = [0]
    entries_verified = [0]

    def checking() -> bool:
        calls[0] += 1
        report(RestoreIntegrityChecking(calls[0] * steps.check_sqlite_steps, pages_total))
        return False  # go on; Ctrl-C raises KeyboardInterrupt here, which aborts the check

    try:
        store.connection.set_progress_handler(checking, steps.check_sqlite_steps)
        try:
            problems = [row[0] for row in store.connection.execute(f"PRAGMA integrity_check({INTEGRITY_PROBLEMS_MAX})")]
        finally:
            store.connection.set_progress_handler(None)
        if problems != ["ok"]:
            return "; ".join(problems)[:300], entries_verified[0]

        def chained(shard: str, entries: int, tx_key: TxKey, applied: TxKey) -> None:
            entries_verified[0] = entries
            report(RestoreChainVerified(shard, entries, tx_key, applied))

        store.verify_chains(chained, steps.chain_entries)
    except (apsw.Error, StoreError) as error:
        return str(error)[:300], entries_verified[0]
    return None, entries_verified[0]


def _remove_database_files(database_path: str) -> None:
    """Remove a database and SQLite's files beside it (one no connection has open)."""
    for suffix in ("", "-journal", "-wal", "-shm"):
        if os.path.lexists(database_path + suffix):
            os.unlink(database_path + suffix)
