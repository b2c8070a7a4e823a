"""Unit tests of the full-disk and failed-disk rules (rlog.disk), in the pure machines and the driver.

Real processes on size-limited file systems and a failing fsync: tests/test_disk_cluster.py.
"""

from __future__ import annotations

import errno
from pathlib import Path

import apsw
import pytest
from mnesite.core.consensus import (
    REJECT_DISK_FULL,
    PersistEntries,
    PreVoteRequest,
    ProposalFailed,
    ProposalRejected,
    Proposed,
    Role,
    RoleChanged,
    Send,
    VoteRequest,
)
from mnesite.rlog.client import MnesiteError
from mnesite.rlog.disk import (
    ERROR_DISK_FULL,
    DiskFreed,
    DiskFull,
    DiskHealth,
    StorageFailedError,
    StorageFault,
)
from mnesite.rlog.errors import RequestError
from mnesite.rlog.replication import (
    ApplyEntries,
    CommittedReceived,
    FetchCommitted,
    Mode,
    ProbeJournals,
    SendWatch,
    Ticked,
    WatchAccepted,
)
from mnesite.rlog.store import Store, read_fault, storage_fault
from mnesite.rlog.types import TxKey, WriteOp

from tests.conftest import (
    ThreadNode,
    commit_table_t,
    core_with_table,
    create_table_t,
    free_port,
    node_config,
    wait_until,
)
from tests.test_consensus import Harness, append, chain, of_type, sends
from tests.test_replica import HISTORY, ages, at, bootstrap, bootstrapped, connect, of, push, replica

# ---------------------------------------------------------------- classification


@pytest.mark.parametrize(
    ("error", "fault"),
    [
        (apsw.FullError("database or disk is full"), StorageFault.FULL),
        (OSError(errno.ENOSPC, "No space left on device"), StorageFault.FULL),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), StorageFault.FULL),
        (apsw.IOError("disk I/O error"), StorageFault.FAILED),
        (OSError(errno.EIO, "Input/output error"), StorageFault.FAILED),
        (StorageFailedError("fdatasync failed"), StorageFault.FAILED),
        # What the disk handed back is not what was written, or the file system went read-only.
        (apsw.CorruptError("database disk image is malformed"), StorageFault.FAILED),
        (apsw.NotADBError("file is not a database"), StorageFault.FAILED),
        (apsw.ReadOnlyError("attempt to write a readonly database"), StorageFault.FAILED),
        (apsw.ConstraintError("UNIQUE"), None),
        (ValueError("not the disk's"), None),
    ],
)
def test_a_write_error_is_full_failed_or_not_the_disks(error: BaseException, fault: StorageFault | None) -> None:
    assert storage_fault(error) is fault


def _io_error(extended: int) -> apsw.IOError:
    """An ``apsw.IOError`` as SQLite raises it: its extended result code set, no errno of its own."""
    error = apsw.IOError("disk I/O error")
    error.extendedresult = extended
    return error


@pytest.mark.parametrize(
    ("error", "system_errno", "fault"),
    [
        # SQLite turns only ENOSPC from a write into SQLITE_FULL; a quota's EDQUOT is SQLITE_IOERR_WRITE.
        (_io_error(apsw.SQLITE_IOERR_WRITE), errno.EDQUOT, StorageFault.FULL),
        (_io_error(apsw.SQLITE_IOERR_WRITE), errno.ENOSPC, StorageFault.FULL),  # SQLite's preallocation
        (_io_error(apsw.SQLITE_IOERR_WRITE), errno.EIO, StorageFault.FAILED),
        (_io_error(apsw.SQLITE_IOERR_WRITE), errno.EROFS, StorageFault.FAILED),
        (_io_error(apsw.SQLITE_IOERR_WRITE), 0, StorageFault.FAILED),  # no errno: what was written is unknown
        # A sync is never a full disk, whatever its errno: the kernel may have dropped the pages.
        (_io_error(apsw.SQLITE_IOERR_FSYNC), errno.ENOSPC, StorageFault.FAILED),
        (_io_error(apsw.SQLITE_IOERR_FSYNC), errno.EDQUOT, StorageFault.FAILED),
        # Not I/O errors: the errno SQLite kept from an earlier one says nothing about them.
        (apsw.FullError("database or disk is full"), errno.EIO, StorageFault.FULL),
        (apsw.ConstraintError("UNIQUE"), errno.EDQUOT, None),
        # The file system's own errors: read-only (as SQLITE_READONLY) is a failed disk; a permission
        # or anything else is no disk fault, so the node stops on it as an unexpected error.
        (OSError(errno.EROFS, "Read-only file system"), 0, StorageFault.FAILED),
        (OSError(errno.EACCES, "Permission denied"), 0, None),
        (OSError(errno.EPERM, "Operation not permitted"), 0, None),
        (apsw.CantOpenError("unable to open database file"), errno.EACCES, None),
    ],
    ids=[
        "write-edquot",
        "write-enospc",
        "write-eio",
        "write-erofs",
        "write-no-errno",
        "fsync-enospc",
        "fsync-edquot",
        "full",
        "constraint",
        "os-erofs",
        "os-eacces",
        "os-eperm",
        "cantopen",
    ],
)
def test_an_io_error_is_full_only_for_a_write_refused_for_space_or_quota(
    error: BaseException, system_errno: int, fault: StorageFault | None
) -> None:
    """Regression: ``storage_fault`` could not see the errno behind SQLite's ``SQLITE_IOERR_WRITE`` (SQLite
    keeps it on the connection, ``sqlite3_system_errno``), so a quota-refused write stopped the node as a
    failed disk (exit status 4) where docs/operations/faults.md promises the full-disk state."""
    assert storage_fault(error, system_errno) is fault


class _QuotaVFS(apsw.VFS):
    """SQLite's own unix VFS, whose writes fail while ``over_quota`` as a file system's quota refuses
    them: ``write`` answers ``EDQUOT``, which SQLite reports as ``SQLITE_IOERR_WRITE`` (only ENOSPC
    becomes SQLITE_FULL) and keeps as the connection's ``system_errno``."""

    def __init__(self) -> None:
        self.over_quota = False
        super().__init__("mnesite-test-quota", "unix", makedefault=True)

    def xOpen(self, name, flags):  # noqa: N802 (apsw's name)
        return _QuotaFile(self, name, flags)

    def xGetLastError(self):  # noqa: N802
        return (errno.EDQUOT, "Disk quota exceeded") if self.over_quota else (0, "")


class _QuotaFile(apsw.VFSFile):
    def __init__(self, vfs: _QuotaVFS, name, flags) -> None:
        self.quota_vfs = vfs
        super().__init__("unix", name, flags)

    def xWrite(self, data, offset) -> None:  # noqa: N802
        if self.quota_vfs.over_quota:
            raise _io_error(apsw.SQLITE_IOERR_WRITE)
        super().xWrite(data, offset)


@pytest.fixture
def quota_vfs():
    """Every database opened meanwhile (the node's store, its checkpointer's) goes through ``_QuotaVFS``."""
    vfs = _QuotaVFS()
    try:
        yield vfs
    finally:
        vfs.unregister()


@pytest.mark.timeout(60)
def test_a_turn_whose_write_a_quota_refused_fills_the_disk_and_does_not_stop_the_node(
    tmp_path: Path, monkeypatch, quota_vfs: _QuotaVFS
) -> None:
    """Regression: a real SQLite commit refused by a quota (``SQLITE_IOERR_WRITE``, errno ``EDQUOT``) stopped
    the node for a failed disk (``StorageFailedError``). It is a full disk (``Store.fault`` reads the errno
    SQLite kept): the turn is rolled back, writes are refused ``disk_full``, and a probe resumes the node
    once the quota allows writes again."""
    with core_with_table(tmp_path / "data") as node:
        store = node.store

        def run_turn() -> None:
            store.connection.execute("BEGIN IMMEDIATE")
            store.connection.execute("INSERT INTO _mnesite_meta(name, value) VALUES ('big', zeroblob(65536))")
            store.commit()

        monkeypatch.setattr(node, "run_turn", run_turn)
        quota_vfs.over_quota = True
        node.turn()  # raised StorageFailedError before
        assert node.disk.full and "disk I/O error" in node.disk.error
        assert not node.stop_reason.startswith("the disk failed")
        assert store.meta("big", None) is None, "the refused turn was rolled back"
        with pytest.raises(RequestError) as refused:
            node.refuse_if_disk_full()
        assert refused.value.code == ERROR_DISK_FULL
        quota_vfs.over_quota = False
        node.disk.next_probe_ms = 0  # the probe is due now, not a probe interval later
        monkeypatch.setattr(node, "run_turn", lambda: None)
        node.turn()
        assert not node.disk.full


@pytest.mark.parametrize(
    ("error", "fault"),
    [
        (apsw.CorruptError("database disk image is malformed"), StorageFault.FAILED),
        (apsw.NotADBError("file is not a database"), StorageFault.FAILED),
        (apsw.IOError("disk I/O error"), StorageFault.FAILED),
        # A query's sort that spilled to a full disk fails the query, not the node.
        (apsw.FullError("database or disk is full"), None),
        # A query's connection is read-only by design: its refusal to write is not the disk's.
        (apsw.ReadOnlyError("attempt to write a readonly database"), None),
        (apsw.SQLError("near 'SELEC': syntax error"), None),
        (apsw.InterruptError("interrupted"), None),
    ],
)
def test_a_query_read_error_is_the_disks_only_when_the_database_or_disk_failed(
    error: BaseException, fault: StorageFault | None
) -> None:
    assert read_fault(error) is fault


def test_sqlite_full_from_a_real_database_is_a_full_disk_and_rolls_back(tmp_path: Path) -> None:
    """max_page_count makes SQLite answer SQLITE_FULL exactly as a full file system does."""
    store = Store(str(tmp_path / "db"), synchronous="NORMAL")
    try:
        store.connection.execute("CREATE TABLE big(x BLOB)")
        pages = store.connection.execute("PRAGMA page_count").fetchone()[0]
        store.connection.execute(f"PRAGMA max_page_count = {pages + 8}")
        store.connection.execute("BEGIN IMMEDIATE")
        with pytest.raises(apsw.Error) as raised:
            for _ in range(64):
                store.connection.execute("INSERT INTO big VALUES (zeroblob(4096))")
            store.commit()
        assert storage_fault(raised.value) is StorageFault.FULL
        store.rollback()
        assert store.connection.execute("SELECT count(*) FROM big").fetchone() == (0,)
        with pytest.raises(apsw.FullError):
            store.probe_space()  # 256 KiB do not fit in 8 pages: still full
        store.connection.execute("PRAGMA max_page_count = 1000000")
        store.probe_space()  # space again: the probe writes durably and removes what it wrote
        assert store.meta("disk_probe", None) is None
    finally:
        store.close()


def test_a_probe_finds_the_disk_full_while_the_file_system_has_no_room_for_it(tmp_path: Path, monkeypatch) -> None:
    """SQLite can commit over a WAL a checkpoint emptied with no byte free on the file system: the probe
    asks the file system first, so a node does not resume to fill again at once."""
    import os
    from types import SimpleNamespace

    from mnesite.rlog.disk import PROBE_BYTES

    store = Store(str(tmp_path / "db"), synchronous="NORMAL")
    real_statvfs = os.statvfs
    try:
        for free_blocks, full in ((PROBE_BYTES // 4096 - 1, True), (PROBE_BYTES // 4096, False)):
            fake = SimpleNamespace(f_bfree=free_blocks, f_bavail=free_blocks, f_frsize=4096)
            monkeypatch.setattr(os, "statvfs", lambda path, fake=fake: fake)
            if full:
                with pytest.raises(OSError) as raised:
                    store.probe_space()
                assert storage_fault(raised.value) is StorageFault.FULL and "still full" in str(raised.value)
            else:
                store.probe_space()
            assert store.meta("disk_probe", None) is None
        monkeypatch.setattr(os, "statvfs", real_statvfs)
        store.probe_space()  # this machine's own file system
    finally:
        store.close()


def test_a_full_disk_while_applying_is_the_disks_error_not_the_entrys(tmp_path: Path) -> None:
    """Or the node would stop saying a committed entry "cannot be applied on this node"."""
    from mnesite.rlog.store import EntryApplyError
    from mnesite.rlog.types import CreateTableOp, WriteOp, make_entry

    store = Store(str(tmp_path / "db"), synchronous="NORMAL")
    try:
        with store.write_transaction():
            store.ensure_shard("default", 0)
            store.apply_ops((CreateTableOp("big", "default", "id", (("id", "INTEGER"), ("v", "BLOB"))),))
        position = store.shard("default")
        ops = tuple(WriteOp("big", {"id": i, "v": b"x" * 4096}) for i in range(64))
        entry = make_entry("default", TxKey(1, 1), position.applied, position.digest, ops, "big")
        with store.write_transaction():
            store.append_entries((entry,), 0, chain_verified=True)
        pages = store.connection.execute("PRAGMA page_count").fetchone()[0]
        store.connection.execute(f"PRAGMA max_page_count = {pages + 4}")
        store.connection.execute("BEGIN IMMEDIATE")
        with pytest.raises(apsw.FullError) as raised:
            store.apply_committed("default", TxKey(1, 1))
        assert not isinstance(raised.value, EntryApplyError)
        store.rollback()
    finally:
        store.close()


def test_a_database_that_cannot_be_opened_for_want_of_space_is_not_called_foreign(tmp_path: Path, monkeypatch) -> None:
    from mnesite.rlog.store import StoreError

    def full(*args, **kwargs):
        raise apsw.FullError("database or disk is full")

    monkeypatch.setattr(apsw, "Connection", full)
    with pytest.raises(StoreError, match="the disk is full") as raised:
        Store(str(tmp_path / "db"))
    assert "not a mnesite database" not in str(raised.value)


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (apsw.CorruptError("database disk image is malformed"), "the database is damaged"),
        (apsw.ReadOnlyError("attempt to write a readonly database"), "cannot be written"),
        (apsw.IOError("disk I/O error"), "the disk failed"),
    ],
    ids=["corrupt", "readonly", "io"],
)
def test_a_database_that_cannot_be_opened_for_its_disk_says_so_and_not_foreign(
    tmp_path: Path, monkeypatch, error: BaseException, said: str
) -> None:
    """A malformed image, or a file system mounted read-only, at the open is not "not a mnesite
    database" (which sends an operator to check the data directory's path): the error says what the
    disk did and names the file. A file that is no database at all still is "not a mnesite database"."""
    from mnesite.rlog.store import StoreError

    (tmp_path / "junk.db").write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a mnesite database"):
        Store(str(tmp_path / "junk.db"))

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(apsw, "Connection", failing)
    with pytest.raises(StoreError, match=said) as raised:
        Store(str(tmp_path / "db"))
    message = str(raised.value)
    assert "not a mnesite database" not in message and str(tmp_path / "db") in message and str(error) in message


def test_a_malformed_database_while_applying_is_the_disks_error_not_the_entrys(tmp_path: Path) -> None:
    """A real malformed image (a table's pages overwritten behind SQLite's back): applying an entry to
    it fails with SQLite's ``CorruptError``, which is the disk's (the node stops for a failed disk,
    exit status 4), not ``EntryApplyError`` (the entry's fault: "cannot be applied on this node")."""
    from mnesite.rlog.store import EntryApplyError
    from mnesite.rlog.types import CreateTableOp, WriteOp, make_entry

    path = str(tmp_path / "db")
    store = Store(path, synchronous="NORMAL")
    with store.write_transaction():
        store.ensure_shard("default", 0)
        store.apply_ops((CreateTableOp("big", "default", "id", (("id", "INTEGER"), ("v", "BLOB"))),))
        store.apply_ops(tuple(WriteOp("big", {"id": i, "v": b"x" * 512}) for i in range(400)))
    root = store.connection.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'big'").fetchone()[0]
    page_bytes = store.connection.execute("PRAGMA page_size").fetchone()[0]
    store.close()  # checkpoints the WAL into the file
    with open(path, "r+b") as file:
        file.seek((root - 1) * page_bytes)
        file.write(b"\xff" * page_bytes)  # the table's root page: not a B-tree page any more
    store = Store(path, synchronous="NORMAL")
    try:
        position = store.shard("default")
        entry = make_entry("default", TxKey(1, 1), position.applied, position.digest, (WriteOp("big", {"id": 1}),), "w")
        store.connection.execute("BEGIN IMMEDIATE")
        with pytest.raises(apsw.Error) as raised:
            store.append_entries((entry,), 0, chain_verified=True)
            store.apply_committed("default", TxKey(1, 1))
        assert not isinstance(raised.value, EntryApplyError), raised.value
        assert storage_fault(raised.value) is StorageFault.FAILED
        store.rollback()
    finally:
        store.close()


@pytest.mark.parametrize(
    "error",
    [
        apsw.CorruptError("database disk image is malformed"),
        apsw.NotADBError("file is not a database"),
        apsw.ReadOnlyError("attempt to write a readonly database"),
    ],
    ids=["corrupt", "notadb", "readonly"],
)
def test_a_turn_the_database_fails_as_malformed_or_read_only_stops_the_node_for_the_disk(
    tmp_path: Path, monkeypatch, error: BaseException
) -> None:
    """Regression: SQLite's ``CorruptError``, ``NotADBError`` (the file's header no longer says SQLite)
    and ``ReadOnlyError`` (the file system went read-only) were not the disk's (``storage_fault``), so a
    turn that met them ended the node as a generic crash: a traceback and exit status 1. The node stops
    as for a failed disk now (``StorageFailedError``: one log line, exit status 4), naming the file and
    the error, the turn rolled back."""
    with core_with_table(tmp_path / "data") as node:

        def run_turn() -> None:
            raise error

        monkeypatch.setattr(node, "run_turn", run_turn)
        with pytest.raises(StorageFailedError) as raised:
            node.turn()
        said = f"{node.store.path}: {type(error).__name__}: {error}"
        assert str(raised.value) == said
        assert node.stop_reason == f"the disk failed: {said}"


def test_a_query_that_meets_a_malformed_database_stops_the_node_for_the_disk(tmp_path: Path) -> None:
    """Regression: a query whose own read met a malformed database (``CorruptError``) was answered
    ``query_failed`` and the core went on serving from the damaged file. The query's worker hands the
    error to the loop now (``rlog.query.Finished.failed``), which stops the node as for any failed
    disk: ``StorageFailedError`` naming the file and SQLite's error (exit status 4), no answer sent."""
    import time

    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message

    from tests.test_query import _damage_table

    with core_with_table(tmp_path / "data") as node:
        with node.store.write_transaction():
            node.store.apply_ops(tuple(WriteOp("t", {"id": i, "v": "x" * 200}) for i in range(200)))
        _damage_table(Path(node.store.path), "t")
        query = Message("query", "q-1", messages.typed_body("query", {"sql": "SELECT * FROM t"}))
        node._dispatch_read([b"client"], query)
        deadline_s = time.monotonic() + 10
        with pytest.raises(StorageFailedError) as raised:
            while time.monotonic() < deadline_s:
                node.turn()
        assert str(raised.value).startswith(f"{node.store.path}: CorruptError: "), raised.value
        assert node.stop_reason == f"the disk failed: {raised.value}"
        assert not [m for _s, to, m in node._outbox if to == [b"client"]], "not answered query_failed"
        assert node.answer_at_stop() == 1  # held: ``stopping`` as the node stops, its client asks another


def test_a_read_that_meets_a_malformed_database_stops_the_node_for_the_disk(tmp_path: Path) -> None:
    """Regression: a ``get`` or ``scan`` on the core's own store that met a malformed database
    (``CorruptError``) was answered ``internal`` and the core went on serving from the damaged file,
    while a query that met it stopped the node. A read's disk fault (``rlog.store.read_fault``) now
    leaves the turn, which stops the node as for any failed disk: ``StorageFailedError`` naming the
    file (exit status 4), the read not answered ``internal``."""
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message

    from tests.test_query import _damage_table

    for kind, body in (("scan", {"table": "t"}), ("get", {"table": "t", "key": 150})):
        with core_with_table(tmp_path / kind) as node:
            with node.store.write_transaction():
                node.store.apply_ops(tuple(WriteOp("t", {"id": i, "v": "x" * 200}) for i in range(200)))
            _damage_table(Path(node.store.path), "t")
            read = Message(kind, f"{kind}-1", messages.typed_body(kind, body))
            node._backlog.append(([b"client"], messages.encode(read), ""))
            with pytest.raises(StorageFailedError) as raised:
                node.turn()
            assert str(raised.value).startswith(f"{node.store.path}: CorruptError: "), raised.value
            assert node.stop_reason == f"the disk failed: {raised.value}"
            answers = [m for _s, to, m in node._outbox if to == [b"client"]]
            assert all(m.kind != "error" or m.body.get("code") != "internal" for m in answers), answers


def test_a_new_data_directory_is_made_durable_in_its_parent(tmp_path: Path, monkeypatch) -> None:
    """Regression: the data directory was made (``os.makedirs``) and never its parent synced, so a power
    loss could lose the directory's entry, and with it every commit synced under it. The parent of
    each directory made is fsynced once at creation; an existing directory costs no fsync."""
    import os

    from mnesite.rlog.data_dir import DataDirectoryLock

    synced: list[tuple[int, int]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        status = os.fstat(fd)
        synced.append((status.st_dev, status.st_ino))
        real_fsync(fd)

    def identity(path: Path) -> tuple[int, int]:
        status = path.stat()
        return status.st_dev, status.st_ino

    monkeypatch.setattr(os, "fsync", fsync)
    data = tmp_path / "disks" / "node1" / "data"
    DataDirectoryLock.acquire(str(data), "core1", str(data / "mnesite.db")).release()
    for parent in (tmp_path, tmp_path / "disks", tmp_path / "disks" / "node1"):
        assert identity(parent) in synced, f"{parent} holds a new directory's entry and was not synced"
    synced.clear()
    DataDirectoryLock.acquire(str(data), "core1", str(data / "mnesite.db")).release()
    assert synced == [], "an existing data directory is not synced again"


def test_a_data_directory_lock_that_fails_for_another_reason_leaks_no_descriptor(tmp_path: Path, monkeypatch) -> None:
    """Regression: only "held by another process" (``BlockingIOError``) closed the lock file on the way
    out; any other failure of ``flock`` (``ENOLCK``: a data directory on NFS without its lock daemon)
    left the descriptor open, in a process that goes on (a node served from a thread, a test)."""
    import contextlib
    import os

    from mnesite.rlog import data_dir as data_dir_module

    def flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setattr(data_dir_module.fcntl, "flock", flock)
    with pytest.raises(OSError, match="No locks available"):
        data_dir_module.DataDirectoryLock.acquire(str(data), "core1", str(data / "mnesite.db"))
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert str(data / "LOCK") not in held, "the lock file's descriptor was left open"


# ---------------------------------------------------------------- DiskHealth


def test_a_full_disk_is_logged_once_probed_at_the_interval_and_freed_by_a_probe() -> None:
    health = DiskHealth(probe_interval_ms=500)
    assert health.refusal() is None and not health.probe_due(10_000)
    assert health.filled("database or disk is full", 1000) is True
    # Further failures in the same episode say nothing new (one log line, not a flood).
    assert health.filled("database or disk is full", 1100) is False
    assert not health.probe_due(1499) and health.probe_due(1500)
    health.probe_failed("still full", 1500)
    assert not health.probe_due(1999) and health.probe_due(2000)
    refusal = health.refusal()
    assert refusal is not None and "still full" in refusal
    status = health.status(2100)
    assert status["state"] == "full" and status["full_for_ms"] == 1100 and status["writes_refused"] == 1
    assert health.freed(2100) == 1100
    assert health.refusal() is None and health.status(2200)["state"] == "ok" and health.fills == 1


def test_failures_while_full_never_put_the_probe_off() -> None:
    """Regression: every failure while full (``filled``: a turn that fails again, an index build's step,
    a peer's message) moved the probe one interval on, so a core whose turns kept failing at least once
    an interval never probed, and never resumed by itself (lock-ups before). The probe keeps its own
    schedule: one interval after the episode's first failure, then one after each failed probe."""
    interval_ms = 500
    health = DiskHealth(probe_interval_ms=interval_ms)
    now_ms = 1000
    assert health.filled("database or disk is full", now_ms) is True
    probes = []
    # A fake clock: a turn every 10 ms for 5 s, every one of which fails for want of space.
    for now_ms in range(1000, 6000, 10):
        if health.probe_due(now_ms):
            probes.append(now_ms)
            health.probe_failed("database or disk is full", now_ms)
        assert health.filled("database or disk is full", now_ms) is False
    assert probes == list(range(1500, 6000, interval_ms)), probes
    assert health.probes_failed == len(probes) and health.fills == 1


# ---------------------------------------------------------------- consensus: step down, take no part


def test_a_sequencer_whose_disk_is_full_steps_down_and_fails_its_pending_proposals() -> None:
    harness = Harness()
    harness.elect()
    harness.step(Proposed((WriteOp("t", {"k": 1}),), "w1"))
    effects = harness.step(DiskFull("database or disk is full"))
    assert harness.machine.role is Role.FOLLOWER and harness.machine.disk_full
    (failed,) = of_type(effects, ProposalFailed)
    assert failed.request_id == "w1" and failed.reason.startswith(REJECT_DISK_FULL)
    assert of_type(effects, RoleChanged) == [RoleChanged(Role.FOLLOWER, harness.machine.generation, None)]
    # A proposal while full is refused with the one error code, nothing written.
    assert harness.step(Proposed((), "w2")) == [ProposalRejected("w2", ERROR_DISK_FULL, None)]


def test_a_full_core_never_campaigns_and_is_not_elected_until_freed() -> None:
    harness = Harness()
    harness.step(DiskFull("full"))
    # Long past every election timeout: no pre-vote, no generation bump, nothing persisted.
    for now_ms in range(0, 20_000, 100):
        assert harness.step(Ticked(), now_ms) == []
    assert harness.machine.generation == 0 and harness.machine.role is Role.FOLLOWER
    assert harness.machine.next_deadline_ms() > harness.now_ms  # never a deadline in the past (no spinning)
    harness.step(DiskFreed(), 20_000)
    effects = harness.step(Ticked(), harness.machine.next_deadline_ms())
    assert sends(effects, PreVoteRequest), "once freed it campaigns again"


def test_a_full_follower_neither_votes_nor_acknowledges_entries_it_could_not_persist() -> None:
    harness = Harness(name="b")
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness.receive("a", append(1, None, entries[:1]))
    harness.step(DiskFull("full"), 10)
    # An append with a new entry: it would have to persist it first, so it does not answer at all
    # (a success would count an entry it does not hold toward a commit).
    effects = harness.receive("a", append(1, entries[0], entries[1:], commit_key=TxKey(1, 1)), 20)
    assert effects == [] and harness.machine.last_key == TxKey(1, 1)
    # Votes and pre-votes of a higher generation: granting or adopting must be persisted first.
    assert harness.receive("c", PreVoteRequest(2, TxKey(1, 2)), 5000) == []
    assert harness.receive("c", VoteRequest(2, TxKey(1, 2)), 5000) == []
    assert harness.machine.generation == 1 and harness.state.voted_for is None
    # Freed: the next append is persisted and acknowledged as usual.
    harness.step(DiskFreed(), 5100)
    effects = harness.receive("a", append(1, entries[0], entries[1:], commit_key=TxKey(1, 1)), 5200)
    assert of_type(effects, PersistEntries) and [m.success for _, m in sends(effects, type(effects[-1].message))]


def test_a_full_disk_is_what_keeps_a_follower_from_acknowledging() -> None:
    """The same append to a healthy follower is persisted and acknowledged (the test above would fail
    if the DiskFull rule were gone)."""
    harness = Harness(name="b")
    entries = chain([TxKey(1, 1), TxKey(1, 2)])
    harness.receive("a", append(1, None, entries[:1]))
    effects = harness.receive("a", append(1, entries[0], entries[1:], commit_key=TxKey(1, 1)), 20)
    assert of_type(effects, PersistEntries)
    assert any(isinstance(e, Send) and getattr(e.message, "success", False) for e in effects)


# ---------------------------------------------------------------- replica: stop applying, keep serving


def test_a_full_replica_keeps_its_position_serves_reads_applies_nothing_and_resumes() -> None:
    machine = replica(applied=5)
    connect(machine)
    effects = machine.step(push(HISTORY[5:8]), 10)
    assert of(effects, ApplyEntries) and machine.applied_key == at(8)[0]
    # The turn that applied them failed for want of space: the disk still holds (1, 5).
    machine.step(DiskFull("full", *at(5), spilled=0, spilled_bytes=0), 11)
    assert machine.applied_key == at(5)[0] and machine.applied_digest == at(5)[1]
    assert machine.readable() and machine.mode is Mode.NORMAL and machine.status().disk_full
    # Later pushes (past a gap now) are neither applied, acknowledged nor rejected.
    assert machine.step(push(HISTORY[8:10]), 12) == []
    # Nor does the upstream's silence make it give up its reads while full, and it never spins.
    assert machine.step(Ticked(), 60_000) == [] and machine.mode is Mode.NORMAL
    assert machine.next_deadline_ms() > 60_000
    machine.step(DiskFreed(), 60_001)
    assert machine.mode is Mode.DISCONNECTED and not machine.status().disk_full
    assert of(machine.step(Ticked(), 60_001), ProbeJournals), "it resynchronises at once"
    (watch,) = of(machine.step(ages(), 60_002), SendWatch)
    assert (watch.from_key, watch.from_digest) == at(5), "from the position the disk holds: no gap"


def test_without_the_full_disk_rule_the_next_push_follows_a_key_the_disk_does_not_hold() -> None:
    """What DiskFull prevents: a replica that kept its in-memory key would apply past the disk's."""
    machine = replica(applied=5)
    connect(machine)
    machine.step(push(HISTORY[5:8]), 10)
    (applied,) = of(machine.step(push(HISTORY[8:10]), 12), ApplyEntries)
    assert applied.entries[0].prev == at(8)[0]


def test_a_bootstrapping_replica_whose_disk_fills_disconnects_and_waits() -> None:
    machine = replica(applied=0)
    bootstrap(machine, k0=10)
    machine.step(DiskFull("full", *at(0), spilled=0, spilled_bytes=0), 5)
    assert machine.mode is Mode.DISCONNECTED and not machine.readable()
    assert machine.step(Ticked(), 100_000) == [], "no probe, no watch while full"


def test_a_full_disk_that_rolled_back_reaching_the_read_fence_fences_reads_again() -> None:
    """The failed turn may be the one whose applies reached the read fence of a bootstrap: the disk
    then holds an earlier position over rows not healed yet, and says the reads are fenced."""
    machine = bootstrapped(k0=10, spilled=12)
    machine.step(CommittedReceived("core0", at(14)[0], 1), 4)
    machine.step(push(HISTORY[12:14]), 5)
    assert machine.readable()
    machine.step(DiskFull("full", *at(12), read_fenced=True, spilled=0, spilled_bytes=0), 6)
    assert not machine.readable() and machine.status().read_fenced and machine.mode is Mode.NORMAL
    machine.step(DiskFreed(), 7)
    machine.step(Ticked(), 7)
    (watch,) = of(machine.step(ages(), 7), SendWatch)
    machine.step(WatchAccepted(watch.core, "a2", "resume", *at(12), machine.watch_id), 8)
    assert of(machine.step(Ticked(), 9), FetchCommitted), "it asks for a new fence key"
    assert not machine.readable()
    # A turn rolled back that did not touch the fence changes nothing of it.
    other = bootstrapped(k0=10, spilled=12)
    other.step(CommittedReceived("core0", at(12)[0], 1), 4)
    assert other.readable()
    other.step(DiskFull("full", *at(12), read_fenced=False, spilled=0, spilled_bytes=0), 5)
    assert other.readable()


def test_a_spill_that_a_full_disk_rolled_back_with_its_reset_gives_its_bytes_back() -> None:
    """Regression: the node's spill budget (``SpillBudget``) is charged as pushes are spilled and given
    back when the spill is replayed or discarded by a bootstrap's reset. When the turn that reset the
    shard for a bootstrap (and spilled the new agent's first pushes) found the disk full, the rollback
    took the reset and the spill off the disk, but the bytes stayed charged: the disk held the old
    position and its digest, so the replica resumed from it, and nothing gave them back (the node's
    spills then stopped short for good). A disk holding a known digest holds no spill of the shard
    (the reset and the replay change both in one transaction): the replica gives its spill back."""
    import random

    from mnesite.replicant.replica import ReplicaConfig, ShardReplica, SpillBudget
    from mnesite.rlog.replication import UNKNOWN_DIGEST, ResetShard

    from tests.test_replica import CORES, SHARD

    size = HISTORY[10].size_bytes
    budget = SpillBudget(10 * size)
    machine = ShardReplica(SHARD, "rep0", CORES, *at(5), ReplicaConfig(), random.Random(0), 0, spill_budget=budget)
    # One turn: the core no longer retains (1, 5) and offers a bootstrap; the new agent's pushes are spilled.
    assert of(bootstrap(machine, k0=10), ResetShard)
    machine.step(push(HISTORY[10:12]), 1)
    assert budget.used == 2 * size
    # That turn's commit found the disk full: it still holds (1, 5) with its digest, and no spill.
    machine.step(DiskFull("full", *at(5), spilled=0, spilled_bytes=0), 2)
    assert machine.mode is Mode.DISCONNECTED and budget.used == 0
    machine.step(DiskFreed(), 3)
    machine.step(Ticked(), 3)
    (watch,) = of(machine.step(ages(), 3), SendWatch)
    assert (watch.from_key, watch.from_digest) == at(5)
    machine.step(WatchAccepted(watch.core, "a2", "resume", *at(5), machine.watch_id), 4)
    assert machine.mode is Mode.NORMAL and budget.used == 0
    # A later turn of a bootstrap rolled back: the disk holds the reset (an unknown digest) and the
    # spill of the turns before; it stays charged until the next bootstrap's reset discards it.
    other = ShardReplica(SHARD, "rep0", CORES, *at(5), ReplicaConfig(), random.Random(0), 0, spill_budget=budget)
    assert of(bootstrap(other, k0=12, now_ms=5), ResetShard)
    other.step(push(HISTORY[12:14]), 6)
    other.step(DiskFull("full", at(5)[0], UNKNOWN_DIGEST, spilled=2, spilled_bytes=2 * size), 7)
    assert other.mode is Mode.DISCONNECTED and budget.used == 2 * size
    other.step(DiskFreed(), 8)
    assert of(bootstrap(other, k0=14, now_ms=8), ResetShard) and budget.used == 0


# ---------------------------------------------------------------- the driver: no acknowledgement without durability


def test_a_write_whose_commit_found_the_disk_full_is_never_acknowledged(tmp_path: Path, monkeypatch) -> None:
    node = ThreadNode(tmp_path / "data", extra={"storage": {"disk_probe_interval_ms": 50}})
    try:
        with node.client(timeout_ms=3000, retries=0) as client:
            client.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
            client.put("t", {"id": 1, "v": "before"})
            # An acknowledgement may leave before the commit of its turn (NodeServer.reply): a read is
            # served in a later turn, so once it is answered no commit of the write's turn remains.
            assert client.get("t", 1) == {"id": 1, "v": "before"}
            store = node.node.store
            real_commit = Store.commit
            full = {"on": True}

            def commit(self, durable: bool = True) -> None:
                if full["on"] and self is store:
                    raise apsw.FullError("database or disk is full")
                real_commit(self, durable)

            monkeypatch.setattr(Store, "commit", commit)
            with pytest.raises(MnesiteError) as raised:
                client.put("t", {"id": 2, "v": "not durable"})
            # The sequencer stepped down (DiskFull): its client hears "outcome unknown" (its retry met
            # the disk_full refusal, which never turns "maybe applied" into "not applied").
            assert raised.value.code == "outcome_unknown" and "the disk is full" in str(raised.value)
            with pytest.raises(MnesiteError) as refused:
                client.put("t", {"id": 3, "v": "refused"})
            assert refused.value.code == ERROR_DISK_FULL
            status = client.status()
            assert status["disk"]["state"] == "full" and status["shards"]["default"]["disk_full"]
            assert client.get("t", 1) == {"id": 1, "v": "before"}, "reads are served while full"
            full["on"] = False  # space freed: a probe writes, the node resumes by itself
            wait_until(lambda: client.status()["disk"]["state"] == "ok", 10, "the probe to find space")
            wait_until(lambda: _writable(client, 5), 10, "writes to be accepted again")
            assert client.get("t", 2) is None, "the write that was not durable did not happen"
            client.put("t", {"id": 4, "v": "after"})
            assert client.get("t", 4) == {"id": 4, "v": "after"}
    finally:
        node.stop()


def _writable(client, row_id: int) -> bool:
    try:
        client.put("t", {"id": row_id, "v": "probe"})
        return True
    except MnesiteError:
        return False


def test_a_failed_guard_held_when_the_disk_fills_is_told_to_retry(tmp_path: Path) -> None:
    """A guard that failed against an uncommitted entry waits for it to commit (core.guard_tail). The
    disk filling rebuilds the shard from disk with a new tail, and that wait was dropped unanswered:
    its client heard nothing until its own timeout. It is told to retry now, as the writes waiting for
    their commit are told their outcome."""
    from mnesite.core.node import Deferred
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message

    def request(kind: str, request_id: str, body: dict) -> Message:
        return Message(kind, request_id, messages.typed_body(kind, body))

    with core_with_table(tmp_path / "data") as node:
        driver = node.shards["default"]
        write = {"ops": [{"op": "write", "table": "t", "row": {"id": 1, "v": "a"}}]}
        node._dispatch([b"c1"], request("transact", "w1", write))
        node._propose_all()  # w1's entry is in the tail, not committed (that needs the turn's commit)
        guarded = {"guards": [{"table": "t", "key": 1, "equals": None}], **write}
        with pytest.raises(Deferred):  # the guard saw w1's row: held until w1 commits
            node._dispatch([b"c2"], request("transact", "w2", guarded))
        assert driver.tail.held_count() == 1
        node.abandon_turn()  # the turn's commit found the disk full (NodeServer.turn)
        node.disk.filled("database or disk is full", 0)
        node.disk_filled()
        answers = {m.request_id: m.body.code for _s, _to, m in node._outbox}
        assert answers == {"w1": "outcome_unknown", "w2": "no_sequencer"}


def test_answers_of_a_turn_the_disk_failed_become_outcome_unknown_not_silence(tmp_path: Path) -> None:
    """A turn whose commit found the disk full is rolled back and none of its frames leave (they may
    tell of what was not made durable). The clients answered in it were dropped with those frames:
    each waited out its own timeout before it tried again. A client's answer is now replaced by
    ``outcome_unknown`` (it retries; a write with the same request id, which the sequencer applies
    at most once); a refusal, which tells of nothing written, is kept; frames to peers still never leave."""
    from mnesite.rlog import messages

    with core_with_table(tmp_path / "data") as node:
        node.begin()  # the turn's transaction, as a turn that writes opens it
        node.reply([b"c1"], messages.reply("r1", {"row": None}))  # a read's answer, queued behind the commit
        node.reply([b"c2"], messages.error("r2", "bad_request", "no such column"))  # a refusal
        node._outbox.append((object(), [b"peer"], messages.reply("p1", {})))  # a frame to a peer
        node.abandon_turn()  # the turn's commit found the disk full (NodeServer.turn)
        answers = {m.request_id: (to, m.kind, getattr(m.body, "code", None)) for _s, to, m in node._outbox}
        assert answers == {
            "r1": ([b"c1"], "error", "outcome_unknown"),
            "r2": ([b"c2"], "error", "bad_request"),
        }
        assert node.frames_dropped_disk == 1


def test_a_shard_created_by_the_turn_the_disk_filled_is_forgotten_not_fatal(tmp_path: Path) -> None:
    """Regression: the first ``create_table`` of a shard (or a peer's first message of one) creates the
    shard in the turn's transaction. When that turn's commit found the disk full, the rollback took
    the shard from the disk but not from the driver: rebuilding it from disk (``disk_filled``) raised
    "unknown shard", out of ``NodeServer.turn``, and the node stopped instead of refusing writes."""
    from mnesite.core.node import CoreNode

    node = CoreNode(node_config(tmp_path / "data", free_port()))
    node.bind()
    try:
        create_table_t(node)
        assert "default" in node.shards  # created in the turn's transaction, not committed yet
        node.abandon_turn()  # the turn's commit found the disk full (NodeServer.turn)
        node.disk.filled("database or disk is full", 0)
        node.disk_filled()
        assert "default" not in node.shards, "the driver holds only the shards the disk holds"
        answers = {m.request_id: m.body.code for _s, _to, m in node._outbox}
        assert answers == {"t0": "outcome_unknown"}
        node.disk.freed(0)
        node.disk_freed()
        commit_table_t(node, "t1")  # the write is taken again once space is freed: the shard is created anew
    finally:
        node.close()


def test_an_install_whose_last_batch_the_disk_rolled_back_is_not_taken_as_done(tmp_path: Path) -> None:
    """Regression: the turn that applies an install's last batch also finishes the install (the log
    restarts at the offer's key, ``installing:`` is cleared) and may reach the read fence. When its
    commit found the disk full, the rows and the finish were rolled back but the install was left
    finished in memory: the shard served reads of a table missing its last batch, and never asked
    for another offer (``rows_lost`` was cleared). ``disk_filled`` now takes the install's state from
    the disk, as a restart does: rows half copied, not served, another offer asked for."""
    from mnesite.core.snapshot import SnapshotInstall, SnapshotOffer
    from mnesite.rlog.replication import BatchReceived, TablesReceived

    with core_with_table(tmp_path / "data") as node:
        applied = node.store.shard("default").applied
        offer = SnapshotOffer("core2", node.shards["default"].consensus.generation, applied, b"d" * 32)
        install = SnapshotInstall(offer, 10, 60_000, node.clock_ms())
        node.installs["default"] = install
        node._execute_install("default", install.start())  # BeginInstall: rows deleted, installing:default
        node.flush()  # that turn commits
        node._step_install("default", TablesReceived("core2", ("t",), ("id",)))
        rows = ({"id": 1, "v": "a"}, {"id": 2, "v": "b"})
        node._step_install("default", BatchReceived("core2", "t", None, rows, True))  # the last batch: done
        node.abandon_turn()  # that turn's commit found the disk full (NodeServer.turn)
        node.disk.filled("database or disk is full", 0)
        node.disk_filled()
        assert node.store.meta("installing:default") in (1, "1"), "the disk holds an install not finished"
        assert node._not_serving_reason("default") is not None, "half-copied rows are never served"
        assert "default" in node.rows_lost, "another offer is asked for"
        assert "default" not in node.installs


def test_an_index_build_waits_while_the_disk_is_full_and_the_node_keeps_answering(tmp_path: Path, monkeypatch) -> None:
    """Regression: an online index build's step (``NodeServer.build_indexes``, every 10 ms) wrote on a
    full disk too. Its turn failed again at each step (about 100 a second, each rolled back and each
    rebuilding the shards from disk), the answers queued in those turns waited for a turn that
    committed (a write's and reads' clients timed out unanswered), and each failure put the probe
    off again (``DiskHealth.filled``): no probe ever ran. The build waits while full, like retention,
    and goes on once a probe frees the disk."""
    limits = {"index_build_step_rows_max": 1}  # 100 steps of 10 ms: the build is under way when the disk fills
    node = ThreadNode(tmp_path / "data", extra={"storage": {"disk_probe_interval_ms": 100}, "limits": limits})
    try:
        with node.client(timeout_ms=3000, retries=0) as client:
            client.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
            client.transact([{"op": "write", "table": "t", "row": {"id": i, "v": f"v{i}"}} for i in range(100)])
            client.create_index("t", ["v"])
            wait_until(lambda: "building" in client.list_tables()[0], 10, "the index entry to be applied")
            store = node.node.store
            real_commit = Store.commit
            full = {"on": True}
            failed_turns = {"count": 0}

            def commit(self, durable: bool = True) -> None:
                if full["on"] and self is store:
                    failed_turns["count"] += 1
                    raise apsw.FullError("database or disk is full")
                real_commit(self, durable)

            monkeypatch.setattr(Store, "commit", commit)
            with pytest.raises(MnesiteError) as raised:
                client.put("t", {"id": 1000, "v": "not durable"})
            # The build's step may be the write that finds the disk full first (then the put is refused),
            # and either way the node answers: the client does not wait out its own timeout.
            assert raised.value.code in ("outcome_unknown", ERROR_DISK_FULL)
            assert "did not answer" not in str(raised.value), raised.value
            for _ in range(20):
                assert client.get("t", 7) == {"id": 7, "v": "v7"}, "reads are served while full"
            building = {table["table"]: table.get("building") for table in client.list_tables()}
            assert building["t"] is not None, "the build waits"
            wait_until(lambda: client.status()["disk"]["probes_failed"] >= 2, 5, "the probe to try the disk")
            assert failed_turns["count"] <= 2 + client.status()["disk"]["probes_failed"] * 2, failed_turns
            full["on"] = False  # space freed: a probe writes, the node resumes by itself
            wait_until(lambda: client.status()["disk"]["state"] == "ok", 10, "the probe to find space")
            wait_until(lambda: "building" not in client.list_tables()[0], 20, "the build to go on and finish")
            assert client.get("t", 99) == {"id": 99, "v": "v99"} and client.get("t", 1000) is None
    finally:
        node.stop()


def test_a_node_that_stops_before_a_turn_read_its_failed_checkpoint_stops_for_the_disk(tmp_path: Path) -> None:
    """A background checkpoint that failed (``WalCheckpointer.fatal``) is read at the start of each turn.
    A node asked to stop before its next turn (a stop request, SIGTERM) left its loop as if on purpose:
    "shut down (stop request)" and exit status 0, and the operator restarted it on a disk that had
    failed a sync. It stops for the disk (``StorageFailedError``: exit status 4), with what failed."""
    from mnesite.core.node import CoreNode

    node = CoreNode(node_config(tmp_path / "data", free_port()))
    node.bind()
    assert node.store.checkpointer is not None
    node.store.checkpointer.fatal = StorageFailedError("db: background WAL checkpoint failed: disk I/O error")
    node.request_stop("stop request")
    with pytest.raises(StorageFailedError, match="background WAL checkpoint failed"):
        node.serve_forever()  # closes the node on the way out
    assert node.stop_reason.startswith("the disk failed: db: background WAL checkpoint failed")


@pytest.mark.parametrize(
    "error",
    [apsw.CorruptError("database disk image is malformed"), apsw.IOError("disk I/O error")],
    ids=["corrupt", "io"],
)
def test_a_retention_that_the_database_fails_stops_the_core_for_the_disk(tmp_path: Path, monkeypatch, error) -> None:
    """Regression: a core's retention (``CoreNode._maybe_trim``) logged any SQLite error that was not
    the disk's by ``storage_fault`` ("rlog retention failed; will retry") and went on serving, every
    second, from a database that had just said its image is malformed. Whatever SQLite says there,
    the core stops as for a failed disk (``StorageFailedError``: exit status 4), its turn rolled back."""
    with core_with_table(tmp_path / "data") as node:

        def trim(*_args, **_kwargs) -> int:
            raise error

        monkeypatch.setattr(node.store, "trim", trim)
        node._next_retention_ms = 0
        with pytest.raises(StorageFailedError, match=str(error)):
            node.turn()
        assert node.stop_reason.startswith("the disk failed: ") and str(error) in node.stop_reason


def test_a_full_core_creates_no_shard_for_a_peers_message_and_does_once_space_is_freed(tmp_path: Path) -> None:
    """Regression: a peer's first message of a shard creates the shard (``CoreNode._shard_for``), which
    writes. On a full disk that turn failed and was rolled back, the shard forgotten with it
    (``disk_filled``), and the sequencer's next heartbeat of that shard (every 100 ms) did it again: a
    failed turn each time (its answers, reads included, dropped to ``outcome_unknown``, every shard
    rebuilt, every agent stopped) and the probe put off each time (``DiskHealth.filled``). A full core
    takes no part in its shards (``core.consensus``): the message is dropped, as the machine drops
    those of the shards it has, and the shard is created by a message after space is freed."""
    from mnesite.core.consensus import AppendRequest
    from mnesite.core.consensus_wire import message_to_wire
    from mnesite.core.node import CoreNode
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY

    cores = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("core1", "core2", "core3")}
    node = CoreNode(node_config(tmp_path / "data", free_port(), extra={"cluster": {"core_nodes": cores}}))
    node.bind()
    heartbeat = AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, tuple(cores))
    body = {"shard": "s2", "sender": "core2", "message": message_to_wire(heartbeat)}
    try:
        node.disk.filled("database or disk is full", 0)
        node._on_peer(Message("peer", "peer", messages.typed_body("peer", body)))
        assert "s2" not in node.shards and not node._in_transaction, "nothing written on the full disk"
        node.disk.freed(0)
        node.disk_freed()
        node._on_peer(Message("peer", "peer", messages.typed_body("peer", body)))
        assert "s2" in node.shards and node._in_transaction
        node.flush()
        assert node.store.shard("s2") is not None
    finally:
        node.close()


def test_writes_whose_batch_found_the_disk_full_while_appending_are_answered(tmp_path: Path, monkeypatch) -> None:
    """A turn's writes without guards are held and proposed together (``core.rules.HeldWrites``). When
    appending their entries found the disk full (SQLite writes a large transaction's pages before its
    commit), the turn was rolled back and ``disk_filled`` answered the writes still held, but those the
    failed batch had taken from the hold were in no hold and no waiter any more: never answered until
    the node stopped (each client waited out its timeout), their connections' places held for good.
    They are told ``outcome_unknown`` now, as the writes waiting for their commit are."""
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message

    with core_with_table(tmp_path / "data") as node:
        for number in (1, 2):
            body = messages.typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": number}}]})
            node._dispatch([b"c%d" % number], Message("transact", f"w{number}", body))
        assert len(node.shards["default"].held) == 2

        def full(*_args, **_kwargs) -> None:
            raise apsw.FullError("database or disk is full")

        monkeypatch.setattr(node.store, "append_entries", full)
        with pytest.raises(apsw.FullError):
            node._propose_all()  # the end of the turn's input (``_serve_waiting``)
        monkeypatch.undo()
        node.abandon_turn("database or disk is full")  # NodeServer.turn
        node.disk.filled("database or disk is full", 0)
        node.disk_filled()
        answers = {m.request_id: (to, m.body.code) for _s, to, m in node._outbox}
        assert answers == {"w1": ([b"c1"], "outcome_unknown"), "w2": ([b"c2"], "outcome_unknown")}
        assert node.outstanding == {}, "every connection's place is given back"
        assert node.store.find_request("w1") is None and node.store.find_request("w2") is None


def _get(request_id: str, key: int) -> bytes:
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message

    return messages.encode(Message("get", request_id, messages.typed_body("get", {"table": "t", "key": key})))


def _failing_on(node, method: str, request_id: str, error: BaseException, monkeypatch) -> None:
    """``node.<method>(envelope, message)`` raises ``error`` for ``request_id`` (the disk fails it)."""
    original = getattr(node, method)

    def failing(envelope, message, *args):
        if message.request_id == request_id:
            raise error
        return original(envelope, message, *args)

    monkeypatch.setattr(node, method, failing)


def test_frames_read_in_a_turn_the_disk_failed_are_answered_at_the_stop(tmp_path: Path, monkeypatch) -> None:
    """Regression: a turn takes its frames off the socket first and handles them one by one. When the
    disk failed the handling of one (a read meeting an I/O error), the node stopped, and that frame and
    the frames read after it were neither handled nor in the backlog a stop answers: each client waited
    out its whole timeout. Each is answered ``stopping`` now (nothing was done with it)."""
    sent: list = []
    with core_with_table(tmp_path / "data") as node:
        _failing_on(node, "_read", "g1", apsw.IOError("disk I/O error"), monkeypatch)
        for request_id in ("g1", "g2", "g3"):
            node._backlog.append(([request_id.encode()], _get(request_id, 1), ""))
        with pytest.raises(StorageFailedError):
            node.turn()
        monkeypatch.setattr(node, "_send_queued", lambda socket, to, message: sent.append((to, message)))
        node.answer_at_stop()
    answers = {to[0]: (m.request_id, m.kind, m.body.code) for to, m in sent}
    assert answers == {
        b"g1": ("g1", "error", "stopping"),
        b"g2": ("g2", "error", "stopping"),
        b"g3": ("g3", "error", "stopping"),
    }


def test_frames_read_in_a_turn_the_disk_filled_are_answered_not_dropped(tmp_path: Path, monkeypatch) -> None:
    """Regression: a turn the disk filled while handling one of its frames (a peer's append, a push, a
    write) is rolled back and the node serves on; that frame and the frames read after it were dropped
    unanswered. The frame whose handling failed is answered ``outcome_unknown`` (the client asks again),
    and the frames after it are handled in the next turn (a read is served on a full disk)."""
    with core_with_table(tmp_path / "data") as node:
        _failing_on(node, "_dispatch", "g1", apsw.FullError("database or disk is full"), monkeypatch)
        for request_id in ("g1", "g2", "g3"):
            node._backlog.append(([request_id.encode()], _get(request_id, 1), ""))
        node.turn()
        assert node.disk.full
        answers = {to[0]: (m.kind, getattr(m.body, "code", None)) for _s, to, m in node._outbox}
        assert answers == {b"g1": ("error", "outcome_unknown")}, answers
        sent: list = []
        monkeypatch.setattr(node, "_send_queued", lambda socket, to, message: sent.append((to, message)))
        node.turn()  # the next turn handles the frames the failed one did not reach
        answers = {to[0]: m.kind for to, m in sent}
        assert answers == {b"g1": "error", b"g2": "reply", b"g3": "reply"}, answers


def _receiving(node, frames: list, error: BaseException, monkeypatch) -> None:
    """``node.receive()`` gives ``frames`` (request ids of ``get`` frames), then raises ``error``."""
    waiting = [([request_id.encode()], _get(request_id, 1), "") for request_id in frames]

    def receive():
        if waiting:
            return waiting.pop(0)
        raise error

    monkeypatch.setattr(node, "receive", receive)


@pytest.mark.parametrize("failing", ["receive", "urgent_sorting", "urgent_handling"])
def test_frames_read_by_a_turn_whose_reading_raised_are_answered_at_the_stop(
    tmp_path: Path, monkeypatch, failing: str
) -> None:
    """Regression: a turn first takes its frames (the backlog's, then the socket's) and sorts them
    urgent first. When ``receive`` or ``urgent`` raised there (a zmq error while the socket closes),
    outside any frame's handling, the frames already taken were in neither the backlog nor a handling
    that ``frames_cut`` answers: each client waited out its timeout. They go back to the backlog now,
    and the stop answers each ``stopping``."""
    import zmq

    sent: list = []
    with core_with_table(tmp_path / "data") as node:
        node._backlog.append(([b"g1"], _get("g1", 1), ""))
        error = zmq.ZMQError(errno.ENOTSOCK)
        if failing == "receive":
            _receiving(node, ["g2"], error, monkeypatch)
        else:
            _receiving(node, ["g2"], zmq.Again(), monkeypatch)

            calls = []

            def urgent(frame, principal):
                calls.append(frame)
                # The sort asks of both frames (calls 1 and 2); the handling asks again (call 3).
                if len(calls) == (1 if failing == "urgent_sorting" else 3):
                    raise error
                return False

            monkeypatch.setattr(node, "urgent", urgent)
        with pytest.raises(zmq.ZMQError):
            node.turn()
        monkeypatch.setattr(node, "_send_queued", lambda socket, to, message: sent.append((to, message)))
        node.answer_at_stop()
    answers = {to[0]: (m.request_id, m.body.code) for to, m in sent}
    assert answers == {b"g1": ("g1", "stopping"), b"g2": ("g2", "stopping")}, answers


def test_frames_a_turn_the_disk_filled_gives_back_keep_the_backlogs_bound(tmp_path: Path, monkeypatch) -> None:
    """Regression: the frames a turn the disk filled had not reached all went back to the backlog
    (``frames_cut``), past its bound (``4 * group_commit_max`` frames) by up to one turn's frames.
    The backlog keeps its bound now: a frame beyond it is answered ``overloaded``, as when a turn
    leaves frames over."""
    import zmq

    with core_with_table(tmp_path / "data", {"limits": {"group_commit_max": 2}}) as node:
        bound = 4 * node.config.limits.group_commit_max
        _failing_on(node, "_dispatch", "g0", apsw.FullError("database or disk is full"), monkeypatch)
        for index in range(bound):
            node._backlog.append(([f"g{index}".encode()], _get(f"g{index}", 1), ""))
        _receiving(node, [f"g{bound}", f"g{bound + 1}"], zmq.Again(), monkeypatch)
        node.turn()
        assert node.disk.full
        assert [to[0] for to, _frame, _principal in node._backlog] == [f"g{i}".encode() for i in range(1, bound + 1)]
        answers = {to[0]: m.body.code for _s, to, m in node._outbox}
        assert answers == {b"g0": "outcome_unknown", f"g{bound + 1}".encode(): "overloaded"}, answers
