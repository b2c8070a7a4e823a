"""The WAL's space reserved ahead of its frames (rlog.wal_reserve): a durable commit then syncs a WAL
that does not grow, SQLite still reads exactly its frames (after a close and after a crash), and a
nearly full disk or a failing file never fails a commit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mnesite.rlog import wal_reserve
from mnesite.rlog.disk import StorageFailedError
from mnesite.rlog.store import Store
from mnesite.rlog.wal_reserve import AHEAD_BYTES, LOW_WATER_BYTES, START_BYTES, extension_target, frames_end

pytestmark = pytest.mark.timeout(60)
ROW_BYTES = 3000  # one row a commit: about one 4 KiB frame of the table, and the frames of its b-tree


def _store(path: Path) -> Store:
    store = Store(str(path))
    store.connection.execute("CREATE TABLE IF NOT EXISTS t(k INTEGER PRIMARY KEY, v BLOB)")
    return store


def _write(store: Store, first: int, count: int) -> None:
    for key in range(first, first + count):
        store.connection.execute("BEGIN IMMEDIATE")
        store.connection.execute("INSERT INTO t VALUES (?, ?)", (key, os.urandom(ROW_BYTES)))
        store.commit(durable=True)


def _await(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _wal_pages(store: Store) -> int:
    # wal_checkpoint(PASSIVE) on a store whose reader holds nothing copies the frames; its first
    # number is the WAL's frames either way. Used only where the WAL's length is what is asked.
    return store.connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]


def test_the_rule_extends_only_past_the_start_and_near_the_reserved_end_and_never_past_the_limit() -> None:
    limit = 40 << 20
    assert extension_target(START_BYTES - 1, 0, limit) is None  # a small WAL: no thread, no zeros
    assert extension_target(START_BYTES, 0, limit) == START_BYTES + AHEAD_BYTES
    end = 10 << 20
    assert extension_target(end, end + LOW_WATER_BYTES, limit) is None  # reserved far enough ahead
    assert extension_target(end, end + LOW_WATER_BYTES - 1, limit) == end + AHEAD_BYTES
    assert extension_target(limit - 1, limit - 2, limit) == limit  # bounded by the limit
    assert extension_target(limit, limit, limit) is None
    assert frames_end(0, 4096) == 32 and frames_end(2, 4096) == 32 + 2 * (24 + 4096)


def test_a_durable_commit_syncs_a_wal_that_space_was_reserved_for_ahead(tmp_path: Path) -> None:
    """The point of it: past START_BYTES the file is longer than its frames, so commits write over
    reserved blocks and the file's size (what a growing sync must also make durable) stays put."""
    store = _store(tmp_path / "s.db")
    try:
        reserve = store.wal_reserve
        assert reserve is not None
        key = 0
        while reserve.target <= reserve.reserved:  # commits until an extension is asked for
            assert key < 2000, "no reservation asked for"
            _write(store, key, 1)
            key += 1
        assert reserve.frames_end >= START_BYTES
        _await(lambda: reserve.reserved >= reserve.target, "the reservation asked for")
        wal = Path(str(tmp_path / "s.db") + "-wal")
        size = wal.stat().st_size
        assert size == reserve.reserved >= reserve.frames_end + AHEAD_BYTES - LOW_WATER_BYTES
        extensions = reserve.extensions
        _write(store, key, 20)  # about 250 KiB of frames: far below AHEAD_BYTES - LOW_WATER_BYTES
        assert wal.stat().st_size == size  # the commits' frames went into the reserved space
        assert reserve.frames_end < size and reserve.extensions == extensions
        assert reserve.status()["failures"] == 0
    finally:
        store.close()
    reopened = _store(tmp_path / "s.db")
    try:
        assert reopened.connection.execute("SELECT count(*) FROM t").fetchone()[0] == key + 20
        assert reopened.connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        reopened.close()


CRASHER = """
import os, sys, time
from mnesite.rlog.disk import StorageFailedError
from mnesite.rlog.store import Store
store = Store(sys.argv[1])
store.connection.execute("CREATE TABLE IF NOT EXISTS t(k INTEGER PRIMARY KEY, v BLOB)")
for key in range(int(sys.argv[2])):
    store.connection.execute("BEGIN IMMEDIATE")
    store.connection.execute("INSERT INTO t VALUES (?, ?)", (key, os.urandom(3000)))
    store.commit(durable=True)
deadline = time.monotonic() + 20
while store.wal_reserve.extensions < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
print(store.wal_reserve.extensions, flush=True)
os._exit(0)  # no close: the WAL stays, zeros past its frames, as after a crash
"""


def test_after_a_crash_sqlite_recovers_exactly_the_committed_frames_from_a_reserved_wal(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    done = subprocess.run(
        [sys.executable, "-c", CRASHER, str(path), "500"], capture_output=True, text=True, timeout=60, check=True
    )
    assert int(done.stdout.strip()) >= 1  # the WAL it left had space reserved past its frames
    wal = Path(str(path) + "-wal")
    assert wal.stat().st_size > frames_end(500, 4096)
    store = _store(path)
    try:
        assert store.connection.execute("SELECT count(*), min(k), max(k) FROM t").fetchone() == (500, 0, 499)
        assert store.connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        _write(store, 500, 5)  # and it writes on, over the zeros
        assert store.connection.execute("SELECT count(*) FROM t").fetchone()[0] == 505
    finally:
        store.close()


def test_a_nearly_full_disk_gets_no_reservation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wal_reserve, "FREE_BYTES_MIN", 1 << 62)  # more than any disk has free
    store = _store(tmp_path / "f.db")
    try:
        reserve = store.wal_reserve
        assert reserve is not None
        _write(store, 0, 400)
        _await(lambda: reserve.declined >= 1, "the thread's look at the disk")
        assert reserve.extensions == 0 and reserve.reserved == 0
        wal = Path(str(tmp_path / "f.db") + "-wal")
        assert wal.stat().st_size <= frames_end(_wal_pages(store), 4096)  # nothing past the frames
    finally:
        store.close()


def test_a_reservation_that_fails_ends_reserving_and_never_fails_a_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(tmp_path / "e.db")
    try:
        reserve = store.wal_reserve
        assert reserve is not None
        reserve.wal_path = str(tmp_path / "gone" / "e.db-wal")  # the thread's open fails: ENOENT
        _write(store, 0, 400)
        _await(lambda: reserve.failures == 1, "the failure to be counted")
        assert reserve.extensions == 0
        assert "no more WAL space reserved ahead" in caplog.text
        _write(store, 400, 300)  # commits go on, and no thread is started again
        assert reserve.failures == 1
        assert store.connection.execute("SELECT count(*) FROM t").fetchone()[0] == 700
    finally:
        store.close()


def test_a_store_below_full_synchronous_or_read_only_reserves_nothing(tmp_path: Path) -> None:
    normal = Store(str(tmp_path / "n.db"), synchronous="NORMAL")
    try:
        assert normal.wal_reserve is None  # its WAL is not synced at each commit: nothing to gain
    finally:
        normal.close()


def test_a_failed_reservation_sync_cannot_hide_the_error_from_the_next_durable_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux reports a writeback error once to each descriptor open on the file (errseq): one opened
    after another descriptor's fsync saw it is never told. The thread's fdatasync also writes back the
    frames of commits that did not sync (``durable=False``): if it fails, those pages may be dropped,
    and the store's own descriptor must still hear of it at its next durable commit, or that commit
    is acknowledged over a hole in the WAL. Emulated here as the kernel does it (``errseq_sample``
    at open, ``errseq_check_and_advance`` at sync)."""
    path = str(tmp_path / "x.db")
    wal = path + "-wal"
    real_open, real_fdatasync = os.open, os.fdatasync
    state = {"error": 0, "seen": False}
    samples: dict[int, int] = {}

    def errseq_open(name, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        fd = real_open(name, flags, *args, **kwargs)
        if os.fspath(name) == wal:
            samples[fd] = state["error"] if state["seen"] else 0  # an unseen error is reported to it
        return fd

    def errseq_fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        if fd not in samples:
            return
        if threading.current_thread().name == "mnesite-wal-reserve" and state["error"] == 0:
            state["error"], state["seen"] = 1, False  # the writeback failed: its pages dropped, marked clean
        if samples[fd] != state["error"]:
            samples[fd], state["seen"] = state["error"], True
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "open", errseq_open)
    monkeypatch.setattr(os, "fdatasync", errseq_fdatasync)
    store = _store(Path(path))
    try:
        reserve = store.wal_reserve
        assert reserve is not None
        reserve.free_bytes_min = 0  # whatever the test's file system has free
        key = 0
        while reserve.target <= reserve.reserved:  # commits that do not sync, until an extension is due
            assert key < 2000, "no reservation asked for"
            store.connection.execute("BEGIN IMMEDIATE")
            store.connection.execute("INSERT INTO t VALUES (?, ?)", (key, os.urandom(ROW_BYTES)))
            store.commit(durable=False)
            key += 1
        _await(lambda: reserve.failures == 1, "the reservation's sync to fail")
        store.connection.execute("BEGIN IMMEDIATE")
        store.connection.execute("INSERT INTO t VALUES (?, ?)", (key, b"acknowledged"))
        with pytest.raises(StorageFailedError, match="fdatasync"):
            store.commit(durable=True)
    finally:
        store.disk_failed()
        store.close()


def test_a_reservation_thread_that_cannot_start_never_fails_a_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the thread is started from SQLite's WAL hook, inside the COMMIT. Where no thread
    could be had (a pids limit: "can't start new thread") the error left the hook, and a COMMIT that
    had succeeded raised it: the node stopped with a traceback, its commit not synced."""
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "mnesite-wal-reserve":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    store = _store(tmp_path / "t.db")
    try:
        reserve = store.wal_reserve
        assert reserve is not None
        _write(store, 0, 400)  # past START_BYTES: the thread is asked for
        assert reserve.failures == 1 and reserve.extensions == 0
        assert "no WAL space reserved ahead (can't start new thread)" in caplog.text
        _write(store, 400, 100)  # and not asked for again
        assert reserve.failures == 1
        assert store.connection.execute("SELECT count(*) FROM t").fetchone()[0] == 500
    finally:
        store.close()
