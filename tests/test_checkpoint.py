"""WAL checkpoints run off the commit path, and the WAL stays bounded if they fall behind (rlog.checkpoint)."""

from __future__ import annotations

import time

import pytest
from mnesite.rlog.checkpoint import WalCheckpointer
from mnesite.rlog.store import Store

pytestmark = pytest.mark.timeout(60)

ROW = "x" * 3000  # about one page per row


def fill(store: Store, first: int, count: int) -> None:
    for number in range(first, first + count):
        store.connection.execute("BEGIN IMMEDIATE")
        store.connection.execute("INSERT INTO rows VALUES (?, ?)", (number, ROW))
        store.commit(durable=True)


def open_store(path, background: int, inline: int) -> tuple[Store, list[int]]:
    store = Store(str(path), synchronous="FULL")
    assert store.checkpointer is not None
    store.checkpointer.pages_background = background
    store.checkpointer.pages_inline = inline
    seen: list[int] = []
    on_wal = store.checkpointer.on_wal
    store.checkpointer.on_wal = lambda pages: (seen.append(pages), on_wal(pages))[1]
    with store.write_transaction():
        store.connection.execute("CREATE TABLE rows (id INTEGER PRIMARY KEY, value TEXT)")
    return store, seen


def test_checkpoints_run_in_the_background_and_a_commit_only_finishes_them(tmp_path) -> None:
    store, seen = open_store(tmp_path / "db", background=50, inline=100_000)
    try:
        assert store.connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        fill(store, 0, 200)
        checkpointer = store.checkpointer
        deadline = time.monotonic() + 30
        while checkpointer.background == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checkpointer.background >= 1 and checkpointer.running and checkpointer.failures == 0
        # A commit finishes the background checkpoint and the WAL starts over: without that it would
        # only grow (3 pages a commit), however often the thread checkpointed.
        written = 200
        while not (checkpointer.inline >= 1 and seen[-1] < 100) and time.monotonic() < deadline:
            fill(store, written, 50)
            written += 50
        assert checkpointer.inline >= 1 and seen[-1] < 100, (checkpointer.inline, seen[-1])
        assert checkpointer.status()["forced"] == 0 and checkpointer.status()["thread"] is True
        assert max(seen) < 50 * 3 * 20  # bounded long before 20 rounds of 50 commits could add up
    finally:
        store.close()
    assert not checkpointer.running  # close stops the thread
    reopened = Store(str(tmp_path / "db"), create=False)
    try:
        assert reopened.connection.execute("SELECT count(*), sum(id) FROM rows").fetchone() == (
            written,
            sum(range(written)),
        )
    finally:
        reopened.close()


def test_a_stalled_checkpointer_cannot_let_the_wal_grow_past_the_inline_bound(tmp_path, monkeypatch) -> None:
    """The thread never runs (a slow disk, a reader holding the WAL): commits checkpoint themselves."""
    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)
    store, seen = open_store(tmp_path / "db", background=10, inline=40)
    try:
        fill(store, 0, 300)
        assert store.checkpointer.inline >= 5 and store.checkpointer.background == 0
        assert store.checkpointer.status()["forced"] == store.checkpointer.inline  # each one forced by the bound
        pages_per_commit = 4  # the row's page, its index/table pages and the commit's frame
        assert max(seen) <= 40 + pages_per_commit
        assert store.connection.execute("SELECT count(*) FROM rows").fetchone() == (300,)
    finally:
        store.close()


def test_without_a_thread_to_be_had_commits_succeed_and_checkpoint_inline(tmp_path, monkeypatch) -> None:
    def no_thread(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(WalCheckpointer, "_start", no_thread)
    store, seen = open_store(tmp_path / "db", background=10, inline=1000)
    try:
        fill(store, 0, 100)
        # As SQLite's own autocheckpoint: inline at the background threshold, never near the bound.
        assert store.checkpointer.inline >= 5 and store.checkpointer.forced == 0 and max(seen) < 20
        assert store.connection.execute("SELECT count(*) FROM rows").fetchone() == (100,)
    finally:
        store.close()


def test_an_inline_checkpoint_without_space_never_fails_the_commit(tmp_path, monkeypatch) -> None:
    import apsw

    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)
    store, seen = open_store(tmp_path / "db", background=10, inline=20)

    class Broken:
        system_errno = 0  # what SQLite kept of the OS error (none for SQLITE_FULL)

        def wal_checkpoint(self, mode):
            raise apsw.FullError("database or disk is full")

    try:
        fill(store, 0, 20)
        store.checkpointer.inline_due = True
        store.checkpointer.checkpoint_inline(Broken())
        assert store.checkpointer.failures == 1 and not store.checkpointer.inline_due
        fill(store, 20, 20)  # and the store goes on committing, and checkpointing
        assert store.connection.execute("SELECT count(*) FROM rows").fetchone() == (40,)
    finally:
        store.close()


def test_inline_checkpoint_failures_log_a_line_a_second_and_the_nodes_turn_says_the_last_burst(
    tmp_path, monkeypatch, caplog
) -> None:
    """A full disk fails the inline checkpoint of every commit at a threshold: every one counted, a line
    a second in the log. Regression: the failures after the last line were never logged if no other
    came (space freed meanwhile); the node's next turn once that second is over says them."""
    import logging

    import apsw

    from tests.conftest import replicant_by_hand

    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)
    with replicant_by_hand(tmp_path / "r") as node:
        checkpointer = node.store.checkpointer
        now = [0]
        checkpointer.warnings.clock = lambda: now[0]
        node.run_turn = lambda: None  # the loop's turns (``turn``), nothing arriving

        class Broken:
            system_errno = 0

            def wal_checkpoint(self, mode):
                raise apsw.FullError("database or disk is full")

        def failed() -> list[str]:
            return [record.getMessage() for record in caplog.records if "WAL checkpoint failed" in record.getMessage()]

        line = f"{checkpointer.path}: WAL checkpoint failed: database or disk is full (%d failures so far)"
        caplog.set_level(logging.WARNING, logger="mnesite.rlog.checkpoint")
        for now[0] in range(0, 3000, 10):  # three seconds of commits at a threshold
            checkpointer.checkpoint_inline(Broken())
        assert checkpointer.failures == 300
        assert failed() == [
            line % 1,
            line % 101 + " (and 99 more like it in the last 1000 ms)",
            line % 201 + " (and 99 more like it in the last 1000 ms)",
        ]
        now[0] = 2999  # the last line's second (from 2000) is not over
        node.turn()
        assert len(failed()) == 3
        now[0] = 3000
        node.turn()
        assert failed()[3:] == [line % 300 + " (and 98 more like it in the last 1000 ms)"]


def test_an_inline_checkpoint_with_an_io_error_is_never_retried(tmp_path, monkeypatch) -> None:
    """rlog.disk: a failed sync of the database file may have lost pages; the commit raises, the node stops."""
    import apsw
    from mnesite.rlog.disk import StorageFailedError

    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)
    store, seen = open_store(tmp_path / "db", background=10, inline=20)

    class Broken:
        system_errno = 0

        def wal_checkpoint(self, mode):
            raise apsw.IOError("disk I/O error")

    try:
        store.checkpointer.inline_due = True
        with pytest.raises(StorageFailedError, match="disk I/O error"):
            store.checkpointer.checkpoint_inline(Broken())
    finally:
        store.close()


def test_an_inline_checkpoint_whose_write_a_quota_refused_is_retried_not_fatal(tmp_path, monkeypatch) -> None:
    """Regression: SQLite reports a write refused for a quota (``EDQUOT``) as ``SQLITE_IOERR_WRITE``, not
    ``SQLITE_FULL``; the checkpointer took it for a failed disk and the node stopped (exit status 4).
    With the errno SQLite kept for it (``system_errno``), it is a full disk: counted, retried later."""
    import errno

    import apsw

    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)
    store, seen = open_store(tmp_path / "db", background=10, inline=20)

    class OverQuota:
        system_errno = errno.EDQUOT

        def wal_checkpoint(self, mode):
            error = apsw.IOError("disk I/O error")
            error.extendedresult = apsw.SQLITE_IOERR_WRITE
            raise error

    try:
        store.checkpointer.inline_due = True
        store.checkpointer.checkpoint_inline(OverQuota())  # raised StorageFailedError before
        assert store.checkpointer.failures == 1 and store.checkpointer.fatal is None
    finally:
        store.close()


def test_thresholds_must_be_ordered() -> None:
    with pytest.raises(ValueError):
        WalCheckpointer("unused", "2", pages_background=100, pages_inline=10)


def fail_background_checkpoints(monkeypatch) -> None:
    """The checkpointer threads started from now on checkpoint on a connection whose checkpoints fail
    with an I/O error (a failed fsync of the database file)."""
    import apsw
    from mnesite.rlog import checkpoint

    class FailingConnection:
        system_errno = 0

        def __init__(self, *args, **kwargs) -> None:
            pass

        def execute(self, sql: str) -> None:
            pass

        def wal_checkpoint(self, mode: int) -> None:
            raise apsw.IOError("disk I/O error")

        def close(self) -> None:
            pass

    class ApswWithFailingConnections:
        Connection = FailingConnection

        def __getattr__(self, name: str):
            return getattr(apsw, name)

    monkeypatch.setattr(checkpoint, "apsw", ApswWithFailingConnections())


def test_after_a_background_checkpoint_failed_no_checkpoint_runs_at_the_bound_nor_at_the_close(
    tmp_path, monkeypatch
) -> None:
    """rlog.disk: after a failed sync of the database file, a second checkpoint may sync "successfully"
    over pages the kernel dropped, and the WAL then starts over without them. The thread never retries;
    neither do the commits that reach the inline bound (the commit raises, the node stops) nor the
    checkpoint SQLite runs when the store closes (a node may stop before its next turn reads ``fatal``):
    the WAL keeps every commit, and a restart recovers from it."""
    from mnesite.rlog.disk import StorageFailedError

    fail_background_checkpoints(monkeypatch)
    store, seen = open_store(tmp_path / "db", background=10, inline=40)
    checkpointer = store.checkpointer
    try:
        fill(store, 0, 5)  # past pages_background: the thread starts, fails its checkpoint and ends
        assert checkpointer._thread is not None
        checkpointer._thread.join(10)
        assert isinstance(checkpointer.fatal, StorageFailedError) and checkpointer.failures == 1
        assert checkpointer.background == 0 and not checkpointer.running
        with pytest.raises(StorageFailedError, match="background WAL checkpoint failed"):
            fill(store, 5, 100)  # reaches the inline bound (40 pages)
        assert checkpointer.inline == 0 and seen[-1] >= 40
    finally:
        store.close()
    wal = tmp_path / "db-wal"
    assert wal.exists() and wal.stat().st_size > 0, "nothing was checkpointed, at the close neither"
    reopened = Store(str(tmp_path / "db"), create=False)
    try:
        (rows,) = reopened.connection.execute("SELECT count(*) FROM rows").fetchone()
        assert rows >= 6  # every commit made before the bound raised
    finally:
        reopened.close()


def test_after_a_background_checkpoint_emptied_the_wal_the_next_one_is_the_thread_s_again(
    tmp_path, monkeypatch
) -> None:
    """A commit finishes a background checkpoint inline only because one racing the writer leaves the
    frames committed meanwhile, and then the WAL never starts over. A background checkpoint that left
    nothing (the writer was idle, or it ran again on the young WAL of a wake-up set while it ran: both
    seen under bursts of writes) still marked itself to be finished, the WAL started over by itself,
    and the mark stayed: the commit that next crossed ``pages_background`` checkpointed the whole WAL
    inline (32 MiB at the defaults, with the database's sync) instead of waking the thread, at every
    other crossing."""
    import apsw

    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)  # the test runs the thread's steps
    store, seen = open_store(tmp_path / "db", background=50, inline=100_000)
    checkpointer = store.checkpointer
    thread_connection = apsw.Connection(str(tmp_path / "db"))
    thread_connection.execute("PRAGMA synchronous=NORMAL")  # as the thread's: it reads the WAL from then on
    try:
        fill(store, 0, 20)  # crosses 50 pages: the commits at or above it wake the thread
        assert seen[-1] >= 50 and checkpointer.inline == 0
        assert checkpointer._checkpoint_in_background(thread_connection)  # the writer idle: all copied
        fill(store, 20, 1)
        assert seen[-1] < 50  # the WAL started over by itself: nothing to finish
        assert checkpointer._checkpoint_in_background(thread_connection)  # a wake-up set meanwhile
        written = 21
        while seen[-1] < 50:
            fill(store, written, 1)
            written += 1
        assert checkpointer.inline == 0, f"a commit checkpointed a WAL of {seen[-1]} pages inline"
        assert checkpointer.background == 2
    finally:
        thread_connection.close()
        store.close()


def test_a_reader_holding_the_wal_does_not_make_every_commit_checkpoint(tmp_path, monkeypatch) -> None:
    """Regression: while a reader holds a snapshot (a backup's read transaction, a long query), the WAL
    cannot start over; past ``pages_inline`` every commit then ran a forced inline checkpoint that
    copied nothing new, a cost on each commit, each one counted ``forced`` ("the thread cannot keep
    up"). An inline checkpoint that cannot copy the whole WAL is counted ``pinned``, and no commit
    checkpoints again until the WAL grew ``pages_background`` more pages (or started over); once the
    reader is gone, the next such checkpoint copies it all and the WAL starts over."""
    import apsw

    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)  # the thread never runs
    store, seen = open_store(tmp_path / "db", background=30, inline=40)
    checkpointer = store.checkpointer
    reader = apsw.Connection(str(tmp_path / "db"))
    try:
        fill(store, 0, 5)  # below both thresholds
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM rows").fetchone() == (5,)  # its snapshot, held
        fill(store, 5, 315)
        assert max(seen) >= 40 + 300, "the WAL could not start over under the reader"
        rounds_max = (max(seen) - 40) // 30 + 2  # one checkpoint per pages_background pages grown
        assert 1 <= checkpointer.inline <= rounds_max, (checkpointer.inline, rounds_max)
        assert checkpointer.status()["pinned"] == checkpointer.inline and checkpointer.forced == 0
        reader.execute("COMMIT")  # the reader is gone
        pinned = checkpointer.pinned
        fill(store, 320, 30)
        assert checkpointer.pinned == pinned and checkpointer.forced >= 1, checkpointer.status()
        assert min(seen[-30:]) < 40 and max(seen[-10:]) <= 40 + 4, "the WAL started over, bounded again"
        assert store.connection.execute("SELECT count(*) FROM rows").fetchone() == (350,)
    finally:
        reader.close()
        store.close()


@pytest.mark.parametrize("failing", ["wal", "inline"])
def test_a_store_whose_sync_failed_closes_without_a_checkpoint(tmp_path, monkeypatch, failing) -> None:
    """Regression: only the node's loop marked the disk failed (``NodeServer.turn`` -> ``Store.disk_failed``).
    A caller that closed the store after its commit raised ``StorageFailedError`` (a core whose start
    failed, ``_start_core`` -> ``close``; a restore) had SQLite checkpoint at the close: the pages whose
    sync failed copied into the database file and the WAL started over. The store marks itself failed
    now, for the commit's own sync of the WAL and for an inline checkpoint's failure alike."""
    import errno
    import os

    import apsw
    from mnesite.rlog import store as store_module
    from mnesite.rlog.disk import StorageFailedError

    monkeypatch.setattr(WalCheckpointer, "_start", lambda self: None)
    store, seen = open_store(tmp_path / "db", background=10, inline=20)
    try:
        fill(store, 0, 3)
        if failing == "wal":

            def fdatasync(fd: int) -> None:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

            monkeypatch.setattr(store_module.os, "fdatasync", fdatasync)
        else:

            def wal_checkpoint(self, connection) -> None:
                raise StorageFailedError(f"{self.path}: WAL checkpoint failed: disk I/O error")

            # What ``checkpoint_inline`` raises for a checkpoint's I/O error (its own test: above).
            monkeypatch.setattr(WalCheckpointer, "checkpoint_inline", wal_checkpoint)
            store.checkpointer.inline_due = True
        with pytest.raises(StorageFailedError):
            fill(store, 3, 1)
    finally:
        monkeypatch.undo()  # the close's own calls are the real ones
        store.close()
    wal = tmp_path / "db-wal"
    assert wal.exists() and wal.stat().st_size > 0, "SQLite checkpointed at the close (and removed the WAL)"
    with apsw.Connection(str(tmp_path / "db")) as reopened:  # the WAL is recovered at the next open
        assert reopened.execute("SELECT count(*) FROM rows").fetchone()[0] >= 3
