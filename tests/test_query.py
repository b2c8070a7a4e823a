"""Read-only SQL queries (rlog.query): what SQLite refuses, pages, snapshots, the budget; then through a
node (Client.query, the DB-API connection, pandas.read_sql, ``mnesite query``)."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import select
import socket
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.rlog import query as q
from mnesite.rlog.client import Client, InvalidRequest, RemoteError, Unavailable
from mnesite.rlog.store import Store
from mnesite.rlog.types import TxKey

from tests.conftest import ThreadNode, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

RUNAWAY_CTE = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"

# Each refused by SQLite (authorizer or read-only verdict), with the words the one-line error holds.
HOSTILE = [
    ("INSERT INTO users VALUES (100, 'eve', 1)", "INSERT is not allowed"),
    ("UPDATE users SET karma = 0", "UPDATE is not allowed"),
    ("DELETE FROM users", "DELETE is not allowed"),
    ("DROP TABLE users", "not allowed"),
    ("CREATE TABLE evil(a)", "not allowed"),
    ("CREATE TEMP TABLE evil(a)", "not allowed"),
    ("CREATE INDEX evil ON users(name)", "not allowed"),
    ("ALTER TABLE users ADD COLUMN evil", "not allowed"),
    ("ATTACH DATABASE '/tmp/evil.db' AS evil", "ATTACH is not allowed"),
    ("PRAGMA writable_schema=1", "PRAGMA is not allowed"),
    ("PRAGMA journal_mode=DELETE", "PRAGMA is not allowed"),
    ("SELECT load_extension('/tmp/evil.so')", "load_extension is not allowed"),
    ("SELECT * FROM _mnesite_rlog", "'_mnesite_rlog' is not a user table"),
    ("SELECT * FROM _mnesite_shards", "'_mnesite_shards' is not a user table"),
    ("SELECT u.name FROM users u JOIN _mnesite_tables t ON t.name = u.name", "'_mnesite_tables' is not a user"),
    ("SELECT * FROM sqlite_schema", "'sqlite_master' is not a user table"),
    ("SELECT * FROM dbstat", "'dbstat' is not a user table"),
    ("SELECT * FROM pragma_table_info('_mnesite_rlog')", "'pragma_table_info' is not a user table"),
    ("SELECT 1; SELECT 2", "holds more"),
    ("SELECT 1; DELETE FROM users", "not allowed"),
    ("SELECT * FROM users; -- fine\nUPDATE users SET karma = 0", "not allowed"),
    ("BEGIN", "TRANSACTION is not allowed"),
    ("SAVEPOINT x", "not allowed"),
    ("VACUUM", "not read-only"),
    ("REINDEX", "not allowed"),
    ("ANALYZE", "not allowed"),
]


def _database(path: Path, rows: int = 100) -> Store:
    store = Store(str(path))
    with store.write_transaction():
        store.ensure_shard("default", 1)
        store.connection.execute("CREATE TABLE users(id INTEGER PRIMARY KEY, name TEXT, karma INTEGER) STRICT")
        store.connection.executemany(
            "INSERT INTO users VALUES (?, ?, ?)", [(i, f"user{i}", i % 20) for i in range(rows)]
        )
    return store


def _file_digest(path: Path) -> str:
    """The database's contents as SQLite sees them (every table, the internal ones too)."""
    connection = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    text = []
    for (name,) in connection.execute("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name"):
        text.append(name + repr(list(connection.execute(f'SELECT * FROM "{name}" ORDER BY 1'))))
    text.append(repr(list(connection.execute("SELECT type, name, sql FROM sqlite_schema ORDER BY name"))))
    connection.close()
    return hashlib.sha256("\n".join(text).encode()).hexdigest()


@pytest.fixture
def store(tmp_path: Path):
    store = _database(tmp_path / "node.db")
    yield store
    store.close()


@pytest.fixture
def runner(store: Store):
    runner = q.QueryRunner(
        store.path, q.QueryLimits(ms_max=500, page_rows_max=1000), lambda: int(time.monotonic() * 1000)
    )
    yield runner
    runner.stop()


def _finished(runner: q.QueryRunner, timeout_s: float = 10) -> q.Finished:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = runner.finished()
        if done:
            assert len(done) == 1
            return done[0]
        time.sleep(0.002)
    raise AssertionError("no page finished in time")


def _start(runner: q.QueryRunner, sql: str, params=(), targets=None, page_rows: int = 1000) -> q.Finished:
    checked = runner.check(sql, tuple(params), ["users"])
    runner.start(q.WaitingQuery("client", checked, ("default",), targets or {}, page_rows, 0))
    return _finished(runner)


def _all_rows(runner: q.QueryRunner, sql: str, params=(), page_rows: int = 1000) -> tuple[list, int]:
    finished = _start(runner, sql, params, page_rows=page_rows)
    assert finished.error is None, finished.error
    rows, pages = list(finished.result["rows"]), 1
    while finished.result["cursor"] is not None:
        runner.next_page("client", finished.result["cursor"], page_rows)
        finished = _finished(runner)
        assert finished.error is None, finished.error
        rows += finished.result["rows"]
        pages += 1
    return rows, pages


def _read_on(runner: q.QueryRunner, cursor: str | None, page_rows: int) -> list:
    """The rows of the pages after the one that answered ``cursor`` (None: there are none), ``page_rows``
    a page; every page must succeed."""
    rows: list = []
    while cursor is not None:
        runner.next_page("client", cursor, page_rows)
        page = _finished(runner)
        assert page.error is None, page.error
        rows, cursor = rows + page.result["rows"], page.result["cursor"]
    return rows


@contextlib.contextmanager
def _runner_over(path: Path, limits: q.QueryLimits, names: list[str] | None = None) -> Iterator[q.QueryRunner]:
    """A runner with ``limits`` (on the monotonic clock) over a new database at ``path`` whose users
    hold a row ``(i, names[i], 0)`` for each name (none: no rows); runner and store closed after."""
    store = _database(path, rows=0)
    if names:
        with store.write_transaction():
            store.connection.executemany("INSERT INTO users VALUES (?, ?, 0)", list(enumerate(names)))
    runner = q.QueryRunner(store.path, limits, q_clock)
    try:
        yield runner
    finally:
        runner.stop()
        store.close()


# -- what SQLite refuses ------------------------------------------------------------------------


@pytest.mark.parametrize(("sql", "words"), HOSTILE)
def test_hostile_sql_is_refused_by_sqlite_at_prepare_and_changes_nothing(store: Store, sql: str, words: str) -> None:
    before = _file_digest(Path(store.path))
    connection = q.open_connection(store.path, 1 << 20)
    with pytest.raises(q.QueryRefused) as refused:
        q.check_query(connection, ["users"], sql, ())
    connection.close()
    assert refused.value.code == "query_refused"
    assert words in str(refused.value) and "\n" not in str(refused.value)
    assert _file_digest(Path(store.path)) == before


def test_the_run_enforces_the_same_rules_as_the_check(store: Store, runner: q.QueryRunner) -> None:
    """A statement that got past a check (here: built by hand) is refused again by the run's authorizer."""
    before = _file_digest(Path(store.path))
    forged = q.CheckedQuery("SELECT * FROM _mnesite_rlog", (), frozenset())
    runner.start(q.WaitingQuery("client", forged, (), {}, 10, 0))
    finished = _finished(runner)
    assert finished.error is not None and finished.error.code == "query_refused"
    forged = q.CheckedQuery("DELETE FROM users", (), frozenset({"users"}))
    runner.start(q.WaitingQuery("client", forged, (), {}, 10, 0))
    finished = _finished(runner)
    assert finished.error is not None and finished.error.code == "query_refused"
    assert _file_digest(Path(store.path)) == before


@pytest.mark.parametrize(
    ("sql", "params", "words"),
    [
        ("SELEC 1", (), "syntax error"),
        ("SELECT nope FROM users", (), "no such column"),
        ("SELECT ?", (), "uses 1 and there are 0 supplied"),
        ("SELECT ?", (1, 2), "uses 1 and there are 2 supplied"),
        ("   -- nothing", (), "holds no statement"),
        # apsw raises ValueError (not an apsw.Error) for SQL text holding a NUL: it killed a replicant
        # in the fuzz campaign of 2026-11-25 (fifth session).
        ("SELECT 1\x00", (), "NUL character"),
        ("SELECT \x00 * FROM users", (), "NUL character"),
    ],
)
def test_sql_sqlite_cannot_prepare_is_a_bad_query(store: Store, sql: str, params: tuple, words: str) -> None:
    connection = q.open_connection(store.path, 1 << 20)
    with pytest.raises(q.BadQuery) as bad:
        q.check_query(connection, ["users"], sql, params)
    connection.close()
    assert bad.value.code == "bad_query" and words in str(bad.value)


def test_a_table_the_catalog_does_not_hold_is_an_unknown_table_naming_it(store: Store) -> None:
    connection = q.open_connection(store.path, 1 << 20)
    with pytest.raises(q.UnknownQueryTable) as unknown:
        q.check_query(connection, ["users"], "SELECT * FROM users JOIN nope USING (id)", ())
    connection.close()
    assert unknown.value.code == "unknown_table" and "unknown table 'nope'" in str(unknown.value)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM users WHERE karma > ?",
        "SELECT karma, count(*), sum(id), group_concat(name) FROM users GROUP BY karma ORDER BY karma",
        "WITH top AS (SELECT * FROM users WHERE karma > 15) SELECT a.name, b.name FROM top a JOIN users b "
        "ON b.karma = a.karma - 10 ORDER BY a.id, b.id",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 50) SELECT count(*) FROM r",
        "SELECT value FROM json_each('[1, 2, 3]')",
        "SELECT 1; -- a trailing comment is not a statement",
    ],
)
def test_read_only_statements_return_what_sqlite_returns(store: Store, runner: q.QueryRunner, sql: str) -> None:
    params = (10,) if "?" in sql else ()
    expected = [list(row) for row in store.connection.execute(sql.split(";")[0], params)]
    rows, _ = _all_rows(runner, sql, params, page_rows=7)
    assert rows == expected and rows


def test_the_tables_a_query_reads_are_known_for_consistency(store: Store) -> None:
    connection = q.open_connection(store.path, 1 << 20)
    checked = q.check_query(connection, ["users", "other"], "SELECT count(*) FROM users u JOIN users v USING (id)", ())
    assert checked.tables == frozenset({"users"})
    assert q.check_query(connection, ["users"], "SELECT 1", ()).tables == frozenset()
    connection.close()


# -- pages, snapshots, cursors, budget ----------------------------------------------------------


def test_pages_are_bounded_by_rows_and_by_bytes(tmp_path: Path) -> None:
    limits = q.QueryLimits(ms_max=5000, page_rows_max=1000, page_bytes_max=50_000)
    with _runner_over(tmp_path / "big.db", limits, ["x" * 10_000] * 100) as runner:
        rows, pages = _all_rows(runner, "SELECT * FROM users ORDER BY id", page_rows=1000)
        assert [row[0] for row in rows] == list(range(100))
        assert pages >= 100 * 10_000 // 60_000  # about 5 rows per page, not one page of 100
        rows, pages = _all_rows(runner, "SELECT id FROM users ORDER BY id", page_rows=30)
        assert len(rows) == 100 and pages == 4
        # No single value may exceed page_bytes_max (SQLITE_LIMIT_LENGTH): bounded memory per value.
        finished = _start(runner, "SELECT zeroblob(1000000)")
        assert finished.error is not None and "too big" in str(finished.error)


def test_one_row_of_many_columns_holds_at_most_row_pages_pages_of_values(tmp_path: Path) -> None:
    """apsw builds a whole row before it can be measured: SELECT zeroblob(N), ... over hundreds of
    columns held hundreds of values of page_bytes_max each in a worker (200 x 1 MB raised its peak by
    383 MB). Past ROW_PAGES columns the bound per value is page_bytes_max shared among the columns."""
    page = 20_000
    with _runner_over(tmp_path / "wide.db", q.QueryLimits(ms_max=5000, page_bytes_max=page)) as runner:
        assert q.row_value_bytes_max(page, 1) == q.row_value_bytes_max(page, q.ROW_PAGES) == page
        assert q.row_value_bytes_max(page, 200) == q.ROW_PAGES * page // 200
        wide = q.row_value_bytes_max(page, 200)

        def blobs(columns: int, size: int) -> str:
            return "SELECT " + ", ".join(f"zeroblob({size}) AS c{i}" for i in range(columns))

        # Few columns: each value may fill a page, as before.
        rows, _pages = _all_rows(runner, blobs(q.ROW_PAGES, page))
        assert len(rows) == 1 and [len(value) for value in rows[0]] == [page] * q.ROW_PAGES
        # Many columns: values up to the shared bound pass, one byte more is refused with the bound named.
        rows, _pages = _all_rows(runner, blobs(200, wide))
        assert [len(value) for value in rows[0]] == [wide] * 200
        finished = _start(runner, blobs(200, wide + 1))
        assert finished.error is not None and finished.error.code == "query_failed"
        assert "too big" in str(finished.error) and f"more than {wide} bytes" in str(finished.error)
        assert "200 columns" in str(finished.error)
        # The bound is per statement: a narrow query on the same runner gets the whole page again.
        rows, _pages = _all_rows(runner, blobs(1, page))
        assert len(rows[0][0]) == page
        assert runner.open_cursors() == 0


def test_all_pages_come_from_one_snapshot(store: Store, runner: q.QueryRunner) -> None:
    first = _start(runner, "SELECT id FROM users ORDER BY id", page_rows=10)
    assert first.result["cursor"] is not None
    with store.write_transaction():
        store.connection.execute("DELETE FROM users")
        store.connection.execute("UPDATE _mnesite_shards SET applied_counter = 99")
    rows = list(first.result["rows"])
    cursor = first.result["cursor"]
    while cursor is not None:
        runner.next_page("client", cursor, 10)
        finished = _finished(runner)
        rows += finished.result["rows"]
        cursor = finished.result["cursor"]
    assert [row[0] for row in rows] == list(range(100))
    assert first.result["positions"] == {"default": [0, 0]}
    assert _start(runner, "SELECT count(*) FROM users").result == {
        "columns": ["count(*)"],
        "rows": [[0]],
        "cursor": None,
        "positions": {"default": [0, 99]},
    }


def test_a_snapshot_behind_its_target_waits_instead_of_answering(store: Store, runner: q.QueryRunner) -> None:
    finished = _start(runner, "SELECT count(*) FROM users", targets={"default": TxKey(1, 5)})
    assert finished.behind is not None and finished.result is None and finished.error is None
    assert runner.open_cursors() == 0
    with store.write_transaction():
        store.connection.execute("UPDATE _mnesite_shards SET applied_generation = 1, applied_counter = 5")
    finished = _start(runner, "SELECT count(*) FROM users", targets={"default": TxKey(1, 5)})
    assert finished.result["rows"] == [[100]] and finished.result["positions"] == {"default": [1, 5]}


def test_waiting_queries_start_when_every_shard_reached_its_key_and_expire() -> None:
    waiting = q.WaitingQueries(waiting_max=2)
    checked = q.CheckedQuery("SELECT 1", (), frozenset())
    both = q.WaitingQuery("a", checked, ("s1", "s2"), {"s1": TxKey(1, 3), "s2": TxKey(1, 1)}, 10, 1000)
    late = q.WaitingQuery("b", checked, ("s1",), {"s1": TxKey(9, 9)}, 10, 500)
    waiting.add(both)
    waiting.add(late)
    with pytest.raises(q.QueryOverloaded):
        waiting.add(q.WaitingQuery("c", checked, (), {}, 10, 0))
    applied = {"s1": TxKey(1, 3), "s2": TxKey(1, 0)}
    assert waiting.ready(lambda shard, key: applied[shard] >= key) == []
    applied["s2"] = TxKey(1, 1)
    assert waiting.ready(lambda shard, key: applied[shard] >= key) == [both]
    assert waiting.expired(499) == [] and waiting.expired(500) == [late] and len(waiting) == 0


def test_a_runaway_recursive_cte_is_stopped_by_its_budget(runner: q.QueryRunner) -> None:
    started = time.monotonic()
    finished = _start(runner, RUNAWAY_CTE)
    elapsed_s = time.monotonic() - started
    assert finished.error is not None and finished.error.code == "query_budget"
    assert "500 ms" in str(finished.error)
    assert 0.45 <= elapsed_s < 1.5
    assert runner.open_cursors() == 0 and runner.statistics()["budget_stops"] == 1


# A function call runs in C to its end, with no progress check inside: these cost the product of their
# arguments' lengths in SQLite's own code (a trim of 200,000 characters by a set of 20,000 took about 5 s,
# of 1 MiB by 80,000 about two minutes; a LIKE of a 50,000-byte pattern over 1 MiB about 40 s).
QUADRATIC_TRIM = (
    "SELECT length({}(replace(hex(zeroblob(100000)), '0', 'a'), replace(hex(zeroblob(10000)), '0', 'b') || 'a'))"
)


@pytest.mark.parametrize("function", ["trim", "ltrim", "rtrim"])
def test_a_trim_by_a_long_set_of_characters_ends_within_the_budget(runner: q.QueryRunner, function: str) -> None:
    started = time.monotonic()
    finished = _start(runner, QUADRATIC_TRIM.format(function))
    assert finished.error is None, finished.error
    assert finished.result["rows"] == [[0]]
    assert time.monotonic() - started < 1.0


def test_a_like_or_glob_pattern_longer_than_its_bound_fails_its_query(runner: q.QueryRunner) -> None:
    bound = q.LIKE_PATTERN_BYTES_MAX
    for operator, anything in (("LIKE", "%"), ("GLOB", "*")):
        sql = f"SELECT count(*) FROM users WHERE name {operator} ?"
        assert _start(runner, sql, [anything * bound]).result["rows"] == [[100]]
        finished = _start(runner, sql, [anything * (bound + 1)])
        assert finished.error is not None and finished.error.code == "query_failed"
        assert "pattern too complex" in str(finished.error)
    assert runner.open_cursors() == 0


@pytest.mark.parametrize(
    "call",
    [
        "trim('  xxhixx  ', ' x')",
        "ltrim('xxhi', 'x')",
        "rtrim('hixx', 'x')",
        "trim(NULL, 'x')",
        "trim('a', NULL)",
        "trim(12300, '0')",
        "ltrim(1.5, '1')",
        "trim(1e20, '1')",
        "rtrim(1.0, '0')",
        "ltrim(-0.0, '-')",
        "trim(x'616263', 'a')",
        "trim('abc', '')",
        "trim('', 'x')",
        "trim('ééaé', 'é')",
        "trim('€x€', '€')",
        "trim('aXbXa', 'ab')",
        "typeof(trim(5, '5'))",
        # SQLite reads the set of characters up to its first NUL (a C string); the text itself whole.
        "trim('abc', char(0) || 'a')",
        "ltrim('aabca', 'a' || char(0) || 'b')",
        "rtrim('ab' || char(0) || 'b', 'b' || char(0))",
        "hex(trim(x'610062', x'610062'))",
        "trim('ab', x'6100ff')",
        "trim('  a  ')",
        "ltrim('  a  ')",
    ],
)
def test_the_query_connections_trim_returns_what_sqlite_returns(store: Store, call: str) -> None:
    connection = q.open_connection(store.path, 1 << 20)
    plain = apsw.Connection(":memory:")
    ours, sqlite = (c.execute(f"SELECT {call}").fetchone()[0] for c in (connection, plain))
    connection.close()
    plain.close()
    assert (type(ours), ours) == (type(sqlite), sqlite)


# -- the stop flag (QueryRunner.stop): the node is shutting down ------------------------------------

# Far above what a stop may take: a statement that runs until this budget was not stopped.
STOP_BUDGET_MS = 20_000


def _stopping_runner(store: Store, threads: int = q.QUERY_THREADS) -> q.QueryRunner:
    return q.QueryRunner(
        store.path, q.QueryLimits(ms_max=STOP_BUDGET_MS), lambda: int(time.monotonic() * 1000), threads=threads
    )


def _submit(runner: q.QueryRunner, sql: str) -> None:
    runner.start(q.WaitingQuery("client-" + sql[:8], runner.check(sql, (), ["users"]), ("default",), {}, 1000, 0))


def _running(runner: q.QueryRunner) -> bool:
    # A worker opened the statement's connection: it is running (or about to step), past the job's start.
    with runner._lock:
        return any(cursor.connection is not None for cursor in runner._cursors.values())


def test_a_running_statement_stops_at_its_next_progress_check_once_the_runner_is_stopping(store: Store) -> None:
    """The flag alone (no interrupt): the progress handler reads it, so the statement ends within
    ``PROGRESS_STEPS`` VM steps and is answered ``stopping``, not run until its budget."""
    runner = _stopping_runner(store)
    try:
        _submit(runner, RUNAWAY_CTE)
        wait_until(lambda: _running(runner), 5, "the statement running on a worker")
        runner._stopping = True  # what stop() sets first, here without its interrupt
        started = time.monotonic()
        finished = _finished(runner, timeout_s=3)
        assert time.monotonic() - started < 1.0
    finally:
        runner.stop()
    assert finished.error is not None and finished.error.code == "stopping", finished.error
    assert finished.result is None and runner.statistics()["budget_stops"] == 0


def test_stop_interrupts_a_running_statement_and_a_job_queued_before_it_never_starts(store: Store) -> None:
    """One worker runs a runaway statement; a second query waits in the queue behind it. ``stop``
    returns within ``STOP_WAIT_S``: the running statement is answered ``stopping`` (not the budget's
    ``query_budget``), and the queued one, which would answer at once, is answered ``stopping``
    without running (no page made)."""
    runner = _stopping_runner(store, threads=1)
    _submit(runner, RUNAWAY_CTE)
    wait_until(lambda: _running(runner), 5, "the statement running on the worker")
    _submit(runner, "SELECT count(*) FROM users")  # queued: the only worker is busy
    started = time.monotonic()
    runner.stop()
    assert time.monotonic() - started < q.STOP_WAIT_S
    # stop() waited for the worker, which answered both: their outcomes are all there (the wakeup pipe is closed).
    finished = runner.finished(drain=False)
    assert [(f.payload, f.error.code if f.error else None, f.result) for f in finished] == [
        ("client-WITH REC", "stopping", None),
        ("client-SELECT c", "stopping", None),
    ]
    assert runner.statistics()["pages"] == 0 and runner.statistics()["budget_stops"] == 0


def test_a_second_stop_closes_no_file_the_process_opened_since(store: Store) -> None:
    """``stop`` closes the wakeup pipe once: the freed numbers go to the next file the process opens
    (here another pipe), which a second ``stop`` (or a drain, or a late worker's wake-up) must not touch."""
    runner = _stopping_runner(store, threads=1)
    numbers = {runner._wake_read, runner._wake_write}
    runner.stop()
    read_fd, write_fd = os.pipe()
    try:
        assert {read_fd, write_fd} == numbers, "the process reuses the lowest free numbers"
        runner.stop()
        assert runner.finished() == []  # a drain of the closed pipe reads nothing
        os.write(write_fd, b"y")
        assert os.read(read_fd, 1) == b"y"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_the_budget_counts_sqlite_time_over_all_pages(tmp_path: Path) -> None:
    with _runner_over(tmp_path / "node.db", q.QueryLimits(ms_max=300, page_rows_max=1000)) as runner:
        # Each row costs SQLite work (200,000 rows: about 20 ms on a quiet machine, so about 15 pages);
        # the client takes its time between pages, which is not counted.
        slow = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT n FROM r WHERE n % 200000 = 0"
        started = time.monotonic()
        finished = _start(runner, slow, page_rows=1)
        pages = 1
        while finished.error is None:
            time.sleep(0.05)
            runner.next_page("client", finished.result["cursor"], 1)
            finished = _finished(runner)
            pages += 1
        # Stopped only once SQLite itself spent 300 ms, though the client's pauses took longer than that.
        assert finished.error.code == "query_budget" and pages > 1
        assert time.monotonic() - started > 0.3 + pages * 0.05 - 0.05


# 100 rows of 200,000 bytes each: about 20 MB to sort, ten times SQLite's cache (2 MB), so it spills.
LARGE_ROWS = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < ?) "
LARGE_SORT = LARGE_ROWS + "SELECT i, length(zeroblob(200000)) FROM r ORDER BY i DESC, zeroblob(200000)"


def _temp_bytes_on_disk() -> int:
    """The bytes of SQLite's temporary files this process holds open: deleted from their directory
    at once, they are found by their descriptors (``etilqs_*``, or ``#INODE`` once deleted)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor among them)
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.endswith(" (deleted)") and os.path.basename(link).startswith(("etilqs_", "#")):
                total += os.stat(f"/proc/self/fd/{fd}").st_size
    return total


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the process's descriptors (Linux)")
@pytest.mark.parametrize(
    "sql",
    [
        LARGE_SORT,
        LARGE_ROWS + "SELECT count(*) FROM (SELECT i, zeroblob(200000) AS b FROM r GROUP BY i, b)",
    ],
)
def test_a_query_whose_sort_would_pass_query_temp_bytes_max_fails_and_never_holds_more(tmp_path: Path, sql: str):
    """Regression: SQLite's temporary files (a sort or grouping larger than its cache) were bounded by
    nothing but the query's time budget: about 1.5-3 GB per query, kept while its cursor stayed open,
    16 cursors filling the disk. The query connections' VFS counts their bytes: a query whose files
    would pass query_temp_bytes_max fails with the bound's name, and never held more than it."""
    bound = 4 * 1024 * 1024
    limits = q.QueryLimits(ms_max=10_000, temp_bytes_max=bound, temp_bytes_total_max=64 * 1024 * 1024)
    with _runner_over(tmp_path / "node.db", limits) as runner:
        checked = runner.check(sql, (100,), ["users"])
        runner.start(q.WaitingQuery("client", checked, ("default",), {}, 1, 0))
        finished = _finished(runner)
        assert finished.error is not None and finished.error.code == "query_failed", finished
        assert "temporary storage" in str(finished.error) and "query_temp_bytes_max" in str(finished.error)
        assert 0 < runner.temp_space.high_water <= bound
        assert runner.temp_space.used == 0 and runner.open_cursors() == 0 and _temp_bytes_on_disk() == 0
        # A sort within the bound still spills and answers, in order.
        first = _start(runner, LARGE_SORT, (15,), page_rows=5)
        assert first.error is None and 0 < runner.temp_space.used <= bound, first  # it spilled
        rows = first.result["rows"] + _read_on(runner, first.result["cursor"], 5)
        assert rows == [[i, 200_000] for i in range(15, 0, -1)]
        assert runner.temp_space.high_water <= bound and runner.temp_space.used == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the process's descriptors (Linux)")
def test_the_temporary_files_held_by_open_cursors_are_bounded_per_node(tmp_path: Path) -> None:
    """An open cursor keeps its sort's files (until it is read to the end, closed or expired): the
    node's queries together hold at most query_temp_bytes_total_max on disk; the query that would
    pass it fails, the one holding its files reads on."""
    total = 20 * 1024 * 1024
    limits = q.QueryLimits(ms_max=10_000, temp_bytes_max=16 * 1024 * 1024, temp_bytes_total_max=total)
    with _runner_over(tmp_path / "node.db", limits) as runner:
        held = _start(runner, LARGE_SORT, (60,), page_rows=1)  # about 12 MB spilled, kept by its cursor
        assert held.error is None and held.result["rows"] == [[60, 200_000]], held
        on_disk = _temp_bytes_on_disk()
        assert 8 * 1024 * 1024 < on_disk <= runner.temp_space.used <= total
        refused = _start(runner, LARGE_SORT, (60,), page_rows=1)
        assert refused.error is not None and refused.error.code == "query_failed", refused
        assert "query_temp_bytes_total_max" in str(refused.error)
        assert runner.temp_space.high_water <= total and _temp_bytes_on_disk() == on_disk
        rows = _read_on(runner, held.result["cursor"], 20)
        assert rows == [[i, 200_000] for i in range(59, 0, -1)]
        assert runner.temp_space.used == 0 and _temp_bytes_on_disk() == 0


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT CAST(x'ff' AS TEXT)",  # text that is not UTF-8: apsw raises UnicodeDecodeError
        "SELECT char(55296)",  # a lone surrogate, encoded by SQLite
        "SELECT id, CASE WHEN id = 50 THEN CAST(x'c0' AS TEXT) ELSE name END FROM users",  # mid-result
    ],
)
def test_a_value_python_cannot_hold_fails_its_query_and_the_workers_keep_serving(
    runner: q.QueryRunner, sql: str
) -> None:
    """apsw raises more than apsw.Error while it converts a row: a UnicodeDecodeError escaped the
    worker thread, which died with its cursor busy; the query was never answered, and once both
    threads had died no query ran on the node again."""
    for _ in range(q.QUERY_THREADS + 1):
        finished = _start(runner, sql, page_rows=10)
        while finished.error is None and finished.result["cursor"] is not None:
            runner.next_page("client", finished.result["cursor"], 10)
            finished = _finished(runner, timeout_s=5)
        assert finished.error is not None and finished.error.code == "query_failed", finished
        assert "UTF-8" in str(finished.error)
        assert runner.open_cursors() == 0
    rows, _pages = _all_rows(runner, "SELECT count(*) FROM users")
    assert rows == [[100]]


def _damage_table(path: Path, table: str) -> None:
    """Overwrite ``table``'s root page in the file, behind SQLite's back (its WAL checkpointed first):
    no longer a B-tree page, so reading the table fails with SQLite's ``CorruptError``."""
    connection = apsw.Connection(str(path))
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    root = connection.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?", (table,)).fetchone()[0]
    page_bytes = connection.execute("PRAGMA page_size").fetchone()[0]
    connection.close()
    with open(path, "r+b") as file:
        file.seek((root - 1) * page_bytes)
        file.write(b"\xff" * page_bytes)


def test_a_query_that_reads_a_damaged_database_hands_the_disk_error_to_the_driver(tmp_path: Path) -> None:
    """Regression: a query's read that met a malformed database (SQLite's ``CorruptError``; so too
    ``NotADBError`` and I/O errors) was answered to its client as a query error (``query_failed``),
    and the node went on serving from the damaged file, where a write meeting the same error stops it
    as a failed disk (``rlog.store.storage_fault``). The page is no answer now: ``Finished.failed``
    holds SQLite's error, which the driver raises on its loop (the node stops, exit status 4). The
    query's own errors stay its answers."""
    store = _database(tmp_path / "node.db", rows=2000)
    try:
        _damage_table(tmp_path / "node.db", "users")
        runner = q.QueryRunner(store.path, q.QueryLimits(ms_max=500), lambda: int(time.monotonic() * 1000))
        try:
            finished = _start(runner, "SELECT * FROM users")
            assert finished.error is None and finished.result is None, finished
            assert isinstance(finished.failed, apsw.CorruptError), finished
            assert runner.open_cursors() == 0
            with pytest.raises(q.BadQuery):
                runner.check("SELEC 1", (), ["users"])  # the query's own: answered as before
            finished = _start(runner, "SELECT abs(-9223372036854775808)")  # integer overflow: a run-time error
            assert finished.failed is None and finished.error is not None, finished
            assert finished.error.code == "query_failed", finished
        finally:
            runner.stop()
    finally:
        store.close()


def test_a_cursor_is_idle_from_when_its_page_was_done_not_from_when_it_was_asked(store: Store) -> None:
    """The idle time was counted from the page's request: a page whose run (or wait for a worker)
    took longer than query_idle_ms_max left a cursor expired the moment it was answered, and the
    client's next page was query_cursor_unknown."""
    idle_ms = 100
    runner = q.QueryRunner(store.path, q.QueryLimits(ms_max=10_000, idle_ms_max=idle_ms), q_clock)
    try:
        # Its first row is 5,000,000 rows in: about 0.5 s here, and far above idle_ms on any machine
        # (1,000,000 took 98 ms on a quiet one, below the 100 ms the test needs); its second is the next.
        slow = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT n FROM r WHERE n >= 5e6 LIMIT 2"
        asked = q_clock()
        finished = _start(runner, slow, page_rows=1)
        assert finished.error is None and finished.result["cursor"], finished
        assert q_clock() - asked > idle_ms, "the page must take longer than query_idle_ms_max"
        runner.expire(q_clock())  # the driver's next turn, as the page is answered
        runner.next_page("client", finished.result["cursor"], 1)  # raised CursorUnknown
        finished = _finished(runner)
        assert finished.error is None and finished.result["rows"] == [[5_000_001]]
    finally:
        runner.stop()


def q_clock() -> int:
    return int(time.monotonic() * 1000)


def test_cursors_are_bounded_in_count_expire_when_idle_and_close(store: Store) -> None:
    now = [0]
    runner = q.QueryRunner(store.path, q.QueryLimits(cursors_max=2, idle_ms_max=1000), lambda: now[0])
    try:
        first = _start(runner, "SELECT id FROM users", page_rows=1)
        second = _start(runner, "SELECT id FROM users", page_rows=1)
        assert first.result["cursor"] and second.result["cursor"] and runner.open_cursors() == 2
        with pytest.raises(q.QueryOverloaded):
            _start(runner, "SELECT id FROM users", page_rows=1)
        assert runner.close(first.result["cursor"]) and not runner.close(first.result["cursor"])
        with pytest.raises(q.CursorUnknown):
            runner.next_page("client", first.result["cursor"], 1)
        now[0] = 999
        runner.expire(now[0])
        assert runner.open_cursors() == 1
        now[0] = 1000
        runner.expire(now[0])
        assert runner.open_cursors() == 0 and runner.statistics()["expired"] == 1
        with pytest.raises(q.CursorUnknown):
            runner.next_page("client", second.result["cursor"], 1)
    finally:
        runner.stop()


def test_one_connection_holds_at_most_its_share_of_the_cursors_and_is_told_which_bound(store: Store) -> None:
    """``query_cursors_max`` bounded the cursors of a node, not of a connection: one client connection
    could hold all 16 and every other client got ``overloaded``. A connection holds at most
    ``cursors_per_connection_max``; its refusal names that bound, the node's names the node's."""
    now = [0]
    limits = q.QueryLimits(cursors_max=4, cursors_per_connection_max=2, idle_ms_max=1000)
    runner = q.QueryRunner(store.path, limits, lambda: now[0])

    def start(client: bytes | None) -> q.Finished:
        checked = runner.check("SELECT id FROM users", (), ["users"])
        runner.start(q.WaitingQuery("payload", checked, ("default",), {}, 1, 0, client=client))
        finished = _finished(runner)
        assert finished.result["cursor"] is not None
        return finished

    try:
        a = [start(b"a"), start(b"a")]
        with pytest.raises(q.QueryOverloaded, match=r"^2 queries of this connection are open on this node "
                           r"\(query_cursors_per_connection_max 2\)"):  # fmt: skip
            start(b"a")
        b = start(b"b")  # another connection is served
        start(None)  # one of no connection counts toward the node's bound only
        with pytest.raises(q.QueryOverloaded, match=r"^4 queries are open on this node \(query_cursors_max 4\)"):
            start(b"c")
        with pytest.raises(q.QueryOverloaded, match="query_cursors_per_connection_max 2"):
            start(b"a")  # its own share first
        assert runner.close(a[0].result["cursor"])  # a closed cursor frees its connection's share
        a.append(start(b"a"))
        assert runner._client_cursors == {b"a": 2, b"b": 1}
        now[0] = 1000
        runner.expire(now[0])  # expired: their shares go, nothing is kept for a connection without one
        assert runner.open_cursors() == 0 and runner._client_cursors == {}
        assert b.result["cursor"] and start(b"c") and start(b"c")
    finally:
        runner.stop()
    assert runner._client_cursors == {}


def test_query_cursors_per_connection_max_is_half_of_query_cursors_max_unless_given_and_at_most_it() -> None:
    from mnesite.rlog.config import ConfigError, parse_config

    base = {"node": {"name": "core1", "data_dir": "/tmp/x"}}
    assert parse_config(base).limits.query_cursors_per_connection_max == 8
    assert q.QueryLimits.from_config(parse_config(base).limits).cursors_per_connection_max == 8
    assert parse_config({**base, "limits": {"query_cursors_max": 100}}).limits.query_cursors_per_connection_max == 50
    assert parse_config({**base, "limits": {"query_cursors_max": 1}}).limits.query_cursors_per_connection_max == 1
    given = {"query_cursors_max": 16, "query_cursors_per_connection_max": 16}
    assert parse_config({**base, "limits": given}).limits.query_cursors_per_connection_max == 16
    with pytest.raises(ConfigError, match="query_cursors_per_connection_max"):
        parse_config({**base, "limits": {"query_cursors_per_connection_max": 0}})
    with pytest.raises(ConfigError, match=r"query_cursors_per_connection_max must be at most \[limits\].query_c"):
        parse_config({**base, "limits": {"query_cursors_per_connection_max": 17}})


# -- through a node -----------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path):
    node = ThreadNode(tmp_path / "data", extra={"limits": {"query_ms_max": 500}})
    with node.client() as client:
        client.create_table("users", key="id", columns=[("id", "INTEGER"), ("name", "TEXT"), ("karma", "INTEGER")])
        client.create_table("posts", key="id", columns=[("id", "INTEGER"), ("author", "INTEGER"), ("title", "TEXT")])
        with client.transaction() as tx:
            for i in range(200):
                tx.put("users", {"id": i, "name": f"user{i}", "karma": i % 20})
        with client.transaction() as tx:
            for i in range(300):
                tx.put("posts", {"id": i, "author": i % 50, "title": f"post {i}"})
    try:
        yield node
    finally:
        node.stop()


def _node_rows(node: ThreadNode, sql: str, params=()) -> list[tuple]:
    connection = apsw.Connection(str(Path(node.node.config.database_path)), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return [tuple(row) for row in connection.execute(sql, params)]
    finally:
        connection.close()


def test_client_query_returns_what_sqlite_returns_on_the_node_file(node: ThreadNode) -> None:
    sql = (
        "SELECT u.name, count(p.id) AS posts, max(p.title) FROM users u JOIN posts p ON p.author = u.id "
        "WHERE u.karma > ? GROUP BY u.id ORDER BY posts DESC, u.name"
    )
    with node.client() as client:
        result = client.query(sql, [5], page_rows=7)
        rows = list(result)
        assert result.columns == ["name", "posts", "max(p.title)"] and result.pages > 1
        assert rows == _node_rows(node, sql, (5,)) and rows
        tx_key = client.put("users", {"id": 1000, "name": "new", "karma": 19})
        seen = client.query("SELECT name FROM users WHERE id = ?", [1000], consistency="read-your-writes")
        assert list(seen) == [("new",)] and seen.positions["default"] >= tx_key
        assert list(client.query("SELECT count(*) FROM users", consistency="linearizable")) == [(201,)]
        assert list(client.query("SELECT count(*) FROM users", after_tx_key=tx_key)) == [(201,)]


def test_hostile_sql_through_the_wire_is_one_error_and_changes_nothing(node: ThreadNode) -> None:
    path = Path(node.node.config.database_path)
    with node.client() as client:
        before = _node_rows(node, "SELECT * FROM users ORDER BY id")
        for sql, words in HOSTILE:
            with pytest.raises(RemoteError) as refused:
                client.query(sql)
            assert refused.value.code == "query_refused", sql
            assert words in str(refused.value) and "\n" not in str(refused.value)
        assert _node_rows(node, "SELECT * FROM users ORDER BY id") == before
        assert not (path.parent / "evil.db").exists()
        assert client.status()["queries"]["refused"] == len(HOSTILE)
        # Parameters are bound, never interpolated: a "value" full of SQL is only a value.
        assert list(client.query("SELECT count(*) FROM users WHERE name = ?", ["x'; DELETE FROM users; --"])) == [(0,)]
        assert _node_rows(node, "SELECT count(*) FROM users") == [(200,)]


def test_a_runaway_query_is_stopped_while_the_node_serves_reads_and_writes(node: ThreadNode) -> None:
    latencies_ms: list[float] = []
    outcome: dict = {}

    def runaway() -> None:
        with node.client(timeout_ms=10_000) as client:
            started = time.monotonic()
            try:
                client.query(RUNAWAY_CTE)
            except RemoteError as error:
                outcome["error"] = error
            outcome["elapsed_s"] = time.monotonic() - started

    thread = threading.Thread(target=runaway)
    with node.client() as client:
        thread.start()
        wait_s = time.monotonic() + 5
        while client.status()["queries"]["queries"] < 1 and time.monotonic() < wait_s:
            time.sleep(0.005)
        index = 0
        while thread.is_alive():
            started = time.monotonic()
            client.put("users", {"id": 5000 + index, "name": "during", "karma": 1})
            assert client.get("users", 5000 + index)["name"] == "during"
            latencies_ms.append((time.monotonic() - started) * 1000)
            index += 1
        thread.join()
    assert outcome["error"].code == "query_budget"
    assert outcome["elapsed_s"] < 2
    assert len(latencies_ms) >= 5, latencies_ms
    # Served all along: no put+get waited for the runaway statement (its budget is 500 ms).
    assert max(latencies_ms) < 250, latencies_ms


def test_a_dbapi_connection_takes_a_key_per_shard_as_a_client_keeps_them(node: ThreadNode) -> None:
    """``connect(after_tx_key=client.last_tx_keys)``: each key waited for in its own shard. It unpacked
    the dict's keys as a tx key (one shard: a TypeError, not a DB-API error; two: a key of two names)."""
    import mnesite.dbapi as dbapi

    with node.client() as client:
        client.put("users", {"id": 5000, "name": "late", "karma": 1})
        keys = dict(client.last_tx_keys)
    assert list(keys) == ["default"]
    with dbapi.connect(node.endpoint, consistency="read-your-writes", after_tx_key=keys) as connection:
        cursor = connection.cursor()
        cursor.execute("SELECT name FROM users WHERE id = ?", (5000,))
        assert cursor.fetchall() == [("late",)]
    # A key the node has not applied, named with its shard: waited for, then an OperationalError.
    far = {"default": (keys["default"].generation + 1000, 1)}
    with (
        dbapi.connect(node.endpoint, after_tx_key=far, timeout_ms=300) as connection,
        pytest.raises(dbapi.OperationalError),
    ):
        connection.cursor().execute("SELECT count(*) FROM users")


def test_dbapi_connection_and_pandas_read_sql(node: ThreadNode) -> None:
    import mnesite.dbapi as dbapi

    assert (dbapi.apilevel, dbapi.paramstyle, dbapi.threadsafety) == ("2.0", "qmark", 1)
    with dbapi.connect(node.endpoint, consistency="linearizable", page_rows=16) as connection:
        cursor = connection.cursor()
        cursor.execute("SELECT id, name FROM users WHERE karma = ? ORDER BY id", (3,))
        assert [d[0] for d in cursor.description] == ["id", "name"]
        assert cursor.fetchone() == (3, "user3")
        assert cursor.fetchmany(2) == [(23, "user23"), (43, "user43")]
        assert cursor.fetchall() == [(i, f"user{i}") for i in range(63, 200, 20)]
        assert cursor.fetchone() is None
        cursor.execute("SELECT id FROM users ORDER BY id")
        assert [row[0] for row in cursor] == list(range(200))  # 13 pages of 16
        with pytest.raises(dbapi.NotSupportedError):
            cursor.execute("DELETE FROM users")
        with pytest.raises(dbapi.ProgrammingError):
            cursor.execute("SELECT nope FROM users")
        with pytest.raises(dbapi.OperationalError):
            cursor.execute(RUNAWAY_CTE)
        assert issubclass(dbapi.NotSupportedError, dbapi.DatabaseError) and issubclass(dbapi.DatabaseError, dbapi.Error)
        connection.commit()
        pandas = pytest.importorskip("pandas")
        with pytest.warns(UserWarning, match="SQLAlchemy"):  # pandas' note on any DBAPI2 but sqlite3
            frame = pandas.read_sql(
                "SELECT karma, count(*) AS users FROM users GROUP BY karma ORDER BY karma", connection
            )
        assert list(frame.columns) == ["karma", "users"]
        assert frame.to_dict("list") == {"karma": list(range(20)), "users": [10] * 20}
        with pytest.warns(UserWarning, match="SQLAlchemy"):
            frame = pandas.read_sql("SELECT * FROM users WHERE id < ?", connection, params=[3])
        assert frame.to_dict("records") == [{"id": i, "name": f"user{i}", "karma": i} for i in range(3)]
    with pytest.raises(dbapi.InterfaceError):
        connection.cursor()


def test_a_query_that_must_see_a_key_is_held_at_the_node_less_than_its_own_timeout(node: ThreadNode) -> None:
    """The node was asked to hold a query for its key as long as the client's timeout allows, not the
    query's own ``timeout_ms``: a query given less time than the client (a caller's short deadline) gave
    up on a node that was alive and about to answer, said "did not answer" and re-sent it; one given
    more (the 30 s default) had the node answer ``timeout`` long before the caller stopped waiting."""
    far = TxKey(1, 10**9)  # never applied here: the node answers ``timeout`` naming it
    with node.client(timeout_ms=1500, retries=1) as client:
        started = time.monotonic()
        with pytest.raises(RemoteError) as refused:
            client.query("SELECT count(*) FROM users", after_tx_key=far, timeout_ms=600)
        assert refused.value.code == "timeout" and str(tuple(far)) in str(refused.value)
        assert time.monotonic() - started < 1.0  # one attempt, answered inside it
        started = time.monotonic()
        with pytest.raises(RemoteError) as refused:
            client.query("SELECT count(*) FROM users", after_tx_key=far, timeout_ms=2200)
        assert refused.value.code == "timeout"
        # Held about 1.98 s, as long as this query allows; for the client's 1.5 s it would be held 1.35 s.
        assert time.monotonic() - started > 1.5


def test_a_query_sends_the_wait_for_its_key_it_is_given_apart_from_its_page_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``mnesite query --after G,C --timeout-ms 300`` pages with the 30 s query timeout, and the wait
    for the key was cut from that page timeout: the node held it for its 10 s cap (``scan`` waited
    0.27 s). ``wait_ms`` is now the query's own, derived from ``timeout_ms`` only when not given."""
    from mnesite.rlog.client import MnesiteError, read_wait_ms

    sent: list[tuple[dict[str, Any], int | None]] = []

    def recording(self: Client, kind: str, body: dict[str, Any], *args: Any, timeout_ms: int | None = None, **kw: Any):
        sent.append((dict(body), timeout_ms))
        raise RemoteError("timeout", "recorded, not sent")

    monkeypatch.setattr(Client, "call", recording)
    far = TxKey(1, 10**9)
    client = Client("tcp://127.0.0.1:9", timeout_ms=300)
    try:
        for wait_ms in (270, 0, None):
            with pytest.raises(RemoteError):
                client.query("SELECT 1", after_tx_key=far, timeout_ms=30_000, wait_ms=wait_ms)
        assert [(body["wait_ms"], timeout) for body, timeout in sent] == [
            (270, 30_000),
            (0, 30_000),
            (read_wait_ms(30_000), 30_000),  # as before: the page timeout less a margin
        ]
        assert read_wait_ms(300) == 270 and read_wait_ms(30_000) == 29_500
        with pytest.raises(MnesiteError, match="at most 270, or a longer timeout_ms"):
            client.query("SELECT 1", after_tx_key=far, timeout_ms=300, wait_ms=300)
        with pytest.raises(MnesiteError, match="wait_ms must be an integer of at least 0"):
            client.query("SELECT 1", after_tx_key=far, wait_ms=-1)
        assert len(sent) == 3  # refused unsent
    finally:
        client.close()


def test_a_node_internal_error_is_a_dbapi_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node answers ``internal`` when serving a request failed on its side (``CoreNode``, a reply it
    could not encode): the DB-API raised the bare ``DatabaseError`` where PEP 249 names
    ``InternalError`` ("the database encounters an internal error")."""
    import mnesite.dbapi as dbapi

    def failed(*args, **kwargs):
        raise RemoteError("query failed: RuntimeError: boom", "internal")

    monkeypatch.setattr(Client, "query", failed)
    with dbapi.connect("tcp://127.0.0.1:1") as connection, pytest.raises(dbapi.InternalError) as raised:
        connection.cursor().execute("SELECT 1")
    assert raised.value.code == "internal" and isinstance(raised.value, dbapi.DatabaseError)


# Every code a read-only statement may be answered with (by the node, or by the client for it), and
# the PEP 249 class it is.
DBAPI_ERRORS = {
    "too_large": "DataError",  # a parameter or a row larger than a frame
    "frame_too_large": "DataError",
    "query_failed": "DataError",
    "bad_query": "ProgrammingError",
    "bad_request": "ProgrammingError",
    "bad_frame": "ProgrammingError",
    "unknown_table": "ProgrammingError",
    "unknown_shard": "ProgrammingError",
    "query_refused": "NotSupportedError",
    "unknown_kind": "NotSupportedError",  # a node of a release that does not speak the request
    "unsupported_version": "NotSupportedError",
    "query_budget": "OperationalError",
    "unavailable": "OperationalError",
    "outcome_unknown": "OperationalError",
    "no_sequencer": "OperationalError",
    "stopping": "OperationalError",
    "not_ready": "OperationalError",
    "forbidden": "OperationalError",
    "unauthenticated": "OperationalError",
    "query_cursor_busy": "OperationalError",
    "query_cursor_unknown": "OperationalError",
    "sent_again": "OperationalError",
    "overloaded": "OperationalError",
    "timeout": "OperationalError",
    "busy": "OperationalError",
    "not_applied": "OperationalError",
    "bad_answer": "OperationalError",
    "internal": "InternalError",
}


@pytest.mark.parametrize(("code", "expected"), DBAPI_ERRORS.items())
def test_every_code_a_query_may_get_is_the_pep_249_class_it_belongs_in(code: str, expected: str) -> None:
    """``too_large``, ``query_cursor_busy``, ``sent_again``, ``bad_frame``, ``unknown_kind`` ... were a bare
    ``DatabaseError``, which says nothing a caller can act on (PEP 249: ``DataError`` for the data,
    ``ProgrammingError`` for the request, ``OperationalError`` for the node's state)."""
    from mnesite.rlog import dbapi

    error = dbapi._translated(RemoteError("refused", code))
    assert type(error).__name__ == expected and error.code == code and isinstance(error, dbapi.DatabaseError)
    documented = (Path(__file__).resolve().parent.parent / "docs" / "concepts" / "queries.md").read_text()
    assert f"`{code}`" in documented and set(dbapi._ERRORS) == set(DBAPI_ERRORS)  # the DB-API section's table


def test_dbapi_has_the_type_constructors_and_objects_pep_249_requires(node: ThreadNode) -> None:
    """PEP 249 requires ``Binary``, ``Date``, ``Time``, ``Timestamp``, their ``*FromTicks`` forms and the
    type objects ``STRING``, ``BINARY``, ``NUMBER``, ``DATETIME``, ``ROWID``: the module had none, so
    ``dbapi.Binary(data)`` (how portable code binds bytes) was an AttributeError. Dates bind as SQLite's
    date functions read them (ISO 8601 text), as sqlite3's adapters did."""
    import datetime
    import decimal

    import mnesite.dbapi as dbapi

    with dbapi.connect(node.endpoint) as connection:
        cursor = connection.cursor()
        blob, day = dbapi.Binary(b"\x00\xff"), dbapi.Date(2026, 1, 2)
        at = (dbapi.Time(3, 4, 5), dbapi.Timestamp(2026, 1, 2, 3, 4, 5))
        cursor.execute("SELECT ?, typeof(?), ?, date(?, '+1 day'), ?, ?", (blob, blob, day, day, *at))
        assert cursor.fetchall() == [
            (b"\x00\xff", "blob", "2026-01-02", "2026-01-03", "03:04:05", "2026-01-02T03:04:05")
        ]
        # A value the wire has no type for is refused before it is sent, naming the parameter (it went as
        # text: Decimal("1.10") compared as the string "1.10"); any date or datetime binds as above.
        with pytest.raises(dbapi.ProgrammingError, match=r"query.params\[1\]: must be null, a bool"):
            cursor.execute("SELECT ?, ?", (1, decimal.Decimal("1.10")))
        cursor.execute("SELECT ?", (datetime.datetime(2026, 1, 2, 3, 4, 5, 6),))
        assert cursor.fetchall() == [("2026-01-02T03:04:05.000006",)]
    ticks = datetime.datetime(2026, 1, 2, 3, 4, 5).timestamp()
    assert dbapi.DateFromTicks(ticks) == datetime.date(2026, 1, 2)
    assert dbapi.TimeFromTicks(ticks) == datetime.time(3, 4, 5)
    assert dbapi.TimestampFromTicks(ticks) == datetime.datetime(2026, 1, 2, 3, 4, 5)
    assert dbapi.STRING == "TEXT" and dbapi.BINARY == "BLOB" and dbapi.ROWID == "INTEGER"
    assert dbapi.NUMBER == "INTEGER" and dbapi.NUMBER == "REAL" and dbapi.NUMBER != "TEXT"
    assert dbapi.DATETIME != "TEXT" and dbapi.STRING != None  # noqa: E711 (a type code may be None)


@pytest.mark.parametrize(
    "params", [types.MappingProxyType({"name": "user7"}), collections.ChainMap({"name": "user7"}), {"user7", "user8"}]
)
def test_parameters_in_no_order_of_their_own_are_refused_not_bound_as_keys(node: ThreadNode, params: Any) -> None:
    """Parameters were bound from ``list(params)``: a mapping other than a dict bound its keys (the
    statement ran with ``'name'`` for its ``?`` and answered no row, as if none matched), a set its
    members in whatever order the set iterates. A ``?`` takes the values in order: refused unsent, as
    sqlite3 refuses them (``ProgrammingError``, or ``NotSupportedError`` for a mapping: qmark)."""
    import mnesite.dbapi as dbapi

    sql = "SELECT id FROM users WHERE name = ?" + (" OR name = ?" if isinstance(params, set) else "")
    with node.client() as client, pytest.raises(InvalidRequest, match="not sent: query.params: ") as refused:
        client.query(sql, params)
    assert refused.value.code == "bad_request"
    expected = dbapi.ProgrammingError if isinstance(params, set) else dbapi.NotSupportedError
    with dbapi.connect(node.endpoint) as connection, pytest.raises(expected):
        connection.cursor().execute(sql, params)
    with node.client() as client:  # a sequence still binds in order
        sql = "SELECT id, ? FROM users WHERE name = ?"
        assert list(client.query(sql, ("first", "user7"))) == [(7, "first")]


def test_dbapi_fetchmany_of_a_negative_size_fetches_every_row_left_as_sqlite3_does(node: ThreadNode) -> None:
    """``fetchmany(-1)`` (or an ``arraysize`` below 0) answered ``[]``, which reads as the end of the
    result: a loop ``while rows := cursor.fetchmany(size)`` stopped with every row unread. sqlite3
    answers every row left."""
    import mnesite.dbapi as dbapi

    with dbapi.connect(node.endpoint, page_rows=16) as connection:
        cursor = connection.cursor()
        cursor.execute("SELECT id FROM users ORDER BY id")
        assert cursor.fetchone() == (0,)
        assert cursor.fetchmany(-1) == [(i,) for i in range(1, 200)]
        assert cursor.fetchmany(-1) == [] and cursor.fetchmany(0) == []
        cursor.execute("SELECT id FROM users WHERE id < 40 ORDER BY id")
        cursor.arraysize = -1
        assert cursor.fetchmany() == [(i,) for i in range(40)]


def test_a_result_whose_page_failed_does_not_end_as_if_every_row_was_read(node: ThreadNode) -> None:
    """A page request that fails frees the node's cursor (a page is never re-sent), so the rest of the
    result is lost. The next fetch answered None, as at the end of a complete result: a caller that
    caught the error (a timeout, an OperationalError) and fetched again got a short result and no sign
    of it. Every later fetch raises the error again."""
    import mnesite.dbapi as dbapi

    # Ids 0..19 read as text, then a TEXT value that is not UTF-8: the second page of 16 fails.
    sql = "SELECT CASE WHEN id < 20 THEN CAST(id AS TEXT) ELSE CAST(x'ff' AS TEXT) END FROM users ORDER BY id"
    with node.client() as client:
        result = client.query(sql, page_rows=16)
        assert len(result.fetch_page()) == 16
        for _ in range(2):
            with pytest.raises(RemoteError, match="not UTF-8") as failed:
                result.fetch_page()
            assert failed.value.code == "query_failed"
    with dbapi.connect(node.endpoint, page_rows=16) as connection:
        cursor = connection.cursor()
        cursor.execute(sql)
        assert cursor.fetchmany(16) == [(str(i),) for i in range(16)]
        with pytest.raises(dbapi.DataError):
            cursor.fetchall()
        with pytest.raises(dbapi.DataError):
            cursor.fetchone()
        cursor.execute("SELECT 1")  # a new statement starts afresh
        assert cursor.fetchall() == [(1,)]
    assert node.node.queries.open_cursors() == 0


def test_closing_a_dbapi_connection_frees_its_cursors_at_the_node_and_they_are_unusable(node: ThreadNode) -> None:
    """Closing the connection closed its zmq socket only: the node kept each unfinished result's
    cursor (its read snapshot, and one of query_cursors_max places) until query_idle_ms_max, and the
    Python cursor went on fetching pages over a new socket. PEP 249: once closed, the connection and
    its cursors raise on use."""
    import mnesite.dbapi as dbapi

    connection = dbapi.connect(node.endpoint, page_rows=16)
    cursors = [connection.cursor() for _ in range(2)]
    for cursor in cursors:
        cursor.execute("SELECT id FROM users ORDER BY id")
        assert cursor.fetchone() == (0,)
    assert node.node.queries.open_cursors() == 2
    connection.close()
    assert node.node.queries.open_cursors() == 0  # query_close is answered before close() returns
    for cursor in cursors:
        with pytest.raises(dbapi.InterfaceError):
            cursor.fetchone()
        with pytest.raises(dbapi.InterfaceError):
            cursor.execute("SELECT 1")
    connection.close()  # twice: nothing more to do


def test_cli_query(node: ThreadNode) -> None:
    runner = CliRunner()

    def mnesite(*args: str):
        return runner.invoke(main, [*args, "--node", node.endpoint], catch_exceptions=False)

    table = mnesite("query", "SELECT id, name FROM users WHERE karma = ? AND id < ? ORDER BY id", "--param", "1",
                    "--param", "50")  # fmt: skip
    assert table.exit_code == 0, table.output
    assert table.output.splitlines() == ["id  name", "1   user1", "21  user21", "41  user41"]
    paged = mnesite("query", "SELECT id FROM users ORDER BY id", "--page-rows", "7", "--json")
    document = json.loads(paged.output)
    assert document["columns"] == ["id"] and document["rows"] == [[i] for i in range(200)]
    assert document["positions"]["default"][1] > 0
    duplicate = mnesite("query", "SELECT a.id, b.id FROM users a JOIN users b ON b.id = a.id + 1 WHERE a.id = 0")
    assert duplicate.output.splitlines() == ["id  id:2", "0   1"]
    text = mnesite("query", "SELECT name FROM users WHERE name = ?", "--param", "user7", "--consistency",
                   "linearizable")  # fmt: skip
    assert text.output.splitlines() == ["name", "user7"]
    empty = mnesite("query", "SELECT id FROM users WHERE id < 0")
    assert empty.exit_code == 0 and empty.output.splitlines() == ["id"]
    refused = mnesite("query", "DROP TABLE users")
    assert refused.exit_code == 1
    assert refused.output.count("\n") == 1 and refused.output.startswith("Error: ") and "not allowed" in refused.output
    bad = mnesite("query", "SELECT 1", "--after", "nonsense")
    assert bad.exit_code == 1 and "tx key" in bad.output
    assert mnesite("query", "SELECT count(*) FROM users", "--after", "1,1").output.splitlines() == ["count(*)", "200"]


def test_cli_query_table_whose_rows_fill_their_last_page(node: ThreadNode) -> None:
    """A result of a whole number of pages ends with an empty page (the node learns there is no next
    row only when asked for it): the table output took its header off that empty page's text, which
    has no row, and failed with an IndexError after printing every row."""
    runner = CliRunner()
    result = runner.invoke(main, ["query", "SELECT id FROM users WHERE id < 4 ORDER BY id", "--page-rows", "2",
                                  "--node", node.endpoint])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["id", "0", "1", "2", "3"]


def test_cli_query_without_page_rows_at_a_node_of_a_lower_query_page_rows_max(tmp_path: Path) -> None:
    """``mnesite query`` asked for 1,000 rows a page unless told otherwise: at a node whose operator set
    ``query_page_rows_max`` below that, every query without ``--page-rows`` was refused (``page_rows must
    be 1..10``). Without the option it asks for the node's own page size, as ``Client.query`` does."""
    node = ThreadNode(tmp_path / "data", extra={"limits": {"query_page_rows_max": 10}})
    try:
        with node.client() as client:
            client.create_table("users", key="id", columns=[("id", "INTEGER")])
            with client.transaction() as tx:
                for i in range(25):
                    tx.put("users", {"id": i})
        result = CliRunner().invoke(main, ["query", "SELECT id FROM users ORDER BY id", "--json", "--node",
                                           node.endpoint])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["rows"] == [[i] for i in range(25)]
    finally:
        node.stop()


@pytest.mark.timeout(30)
def test_closing_a_dbapi_connection_to_a_hung_node_takes_one_timeout_not_one_per_cursor(silent_endpoint: str) -> None:
    """Each cursor's query_close waited the client's whole timeout: a connection with N unfinished
    results to a hung node took N timeouts to close. Now one timeout for all; once the node leaves a
    close unanswered the other cursors are only forgotten here (the node expires them by itself)."""
    from mnesite.rlog.client import QueryResult

    import mnesite.dbapi as dbapi

    timeout_ms = 600
    connection = dbapi.connect(silent_endpoint, timeout_ms=timeout_ms)
    client = connection.client
    cursors = [connection.cursor() for _ in range(4)]
    for number, cursor in enumerate(cursors):
        # An unfinished result as a node's first page leaves it: rows and a cursor token.
        first = {"columns": ["id"], "rows": [[number]], "cursor": f"token{number}"}
        cursor._result = QueryResult(client, first, None, timeout_ms)
        assert cursor.fetchone() == (number,)
    started = time.monotonic()
    connection.close()
    elapsed_s = time.monotonic() - started
    assert timeout_ms / 1000 * 0.9 <= elapsed_s < timeout_ms / 1000 * 2, elapsed_s  # four closes took 2.4 s
    for cursor in cursors:
        with pytest.raises(dbapi.InterfaceError):
            cursor.fetchone()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retries", [0, 1])
def test_a_dbapi_execute_at_a_hung_node_ends_at_its_deadline(silent_endpoint: str, retries: int) -> None:
    """``execute`` used the client's default of 2 re-sends, each with the whole timeout: a hung node
    cost 3 x ``timeout_ms`` per call, and ``connect`` took no ``retries`` to say otherwise. The
    deadline is ``timeout_ms x (retries + 1)``: ``timeout_ms`` by default."""
    import mnesite.dbapi as dbapi

    timeout_ms = 500
    arguments = {} if retries == 0 else {"retries": retries}
    with dbapi.connect(silent_endpoint, timeout_ms=timeout_ms, **arguments) as connection:
        assert connection.client.retries == retries
        started = time.monotonic()
        with pytest.raises(dbapi.OperationalError) as raised:
            connection.cursor().execute("SELECT 1")
        elapsed_s = time.monotonic() - started
        connection.close()  # nothing left to free: no wait
    deadline_s = timeout_ms * (retries + 1) / 1000
    assert raised.value.code == "unavailable" and f"({retries + 1} attempts" in str(raised.value)
    assert deadline_s * 0.9 <= elapsed_s < deadline_s + timeout_ms / 1000 * 0.8, elapsed_s  # was 1.5 s at 0


@pytest.fixture
def full_backlog_endpoint(silent_endpoint: str) -> Iterator[str]:
    """A hung node whose listening socket accepts nothing more: it accepted one connection (relayed
    to ``silent_endpoint``, which takes requests and never answers), and its accept queue is full,
    so a new connection neither completes nor is refused (the kernel drops its SYN)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    listener.settimeout(0.05)
    host, port = listener.getsockname()
    upstream_port = int(silent_endpoint.rpartition(":")[2])
    stopping = threading.Event()
    opened: list[socket.socket] = [listener]

    def relay() -> None:
        while not stopping.is_set():
            try:
                accepted, _ = listener.accept()
                break
            except TimeoutError:
                continue
        else:
            return
        # The accept queue's one place (a backlog of 0): from now on a connection attempt hangs.
        opened.append(socket.create_connection((host, port), timeout=5))
        upstream = socket.create_connection(("127.0.0.1", upstream_port), timeout=5)
        opened.extend([accepted, upstream])
        ends = {accepted: upstream, upstream: accepted}
        while not stopping.is_set():
            readable, _, _ = select.select(list(ends), [], [], 0.05)
            for end in readable:
                data = end.recv(1 << 16)
                if not data:
                    return
                ends[end].sendall(data)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        yield f"tcp://{host}:{port}"
    finally:
        stopping.set()
        thread.join(timeout=5)
        for opened_socket in opened:
            opened_socket.close()


@pytest.mark.timeout(30)
def test_a_dbapi_execute_at_a_hung_node_that_accepts_no_connection_ends_at_its_deadline(
    full_backlog_endpoint: str,
) -> None:
    """Once a node left the call unanswered, the client checked whether anything accepts connections
    there (to say "unreachable") with a TCP connection of its own, waiting up to 1 s: at a hung node
    whose accept queue is full that wait came on top of the call's deadline (1.3 s for 0.3 s), and
    ended in "unreachable" of a node that had taken the request. The check now gets what is left of
    the deadline, and a check that cannot tell by then says nothing."""
    import mnesite.dbapi as dbapi

    timeout_ms = 300
    with dbapi.connect(full_backlog_endpoint, timeout_ms=timeout_ms) as connection:
        started = time.monotonic()
        with pytest.raises(dbapi.OperationalError) as raised:
            connection.cursor().execute("SELECT 1")
        elapsed_s = time.monotonic() - started
    assert raised.value.code == "unavailable" and "did not answer query within" in str(raised.value)
    assert "unreachable" not in str(raised.value)
    assert timeout_ms / 1000 * 0.9 <= elapsed_s < timeout_ms / 1000 + 0.25, elapsed_s


@pytest.mark.timeout(10)
def test_the_did_not_answer_check_tells_a_dead_local_node_even_at_the_deadline() -> None:
    """A silent call's last attempt waits until its deadline, so the check had no time left at all and
    said nothing of a node that had died (7 of 10 calls at a local dead node): it gets at least
    ``WHY_SILENT_S_MIN``, which a refusal needs far less of."""
    from mnesite.rlog.client import WHY_SILENT_S_MIN, _why_silent

    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    assert _why_silent(endpoint, started - 1.0) == "; nothing accepts connections there: unreachable"
    assert time.monotonic() - started < WHY_SILENT_S_MIN + 0.5


@pytest.fixture
def hanging_resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """``socket.getaddrinfo`` hangs on ``hangs.test`` (until the test ends) and says ``dead.test`` is
    127.0.0.1 at a port nothing listens on; every other name it looks up as usual."""
    real = socket.getaddrinfo
    released = threading.Event()
    dead_port = free_port()
    asked: list[str] = []

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(host)
        if host == "hangs.test":
            released.wait(10)
        if host in ("hangs.test", "dead.test"):
            return real("127.0.0.1", dead_port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield {"asked": asked, "dead_port": dead_port}
    released.set()


@pytest.mark.timeout(20)
def test_the_did_not_answer_check_ends_within_the_deadline_when_the_resolver_hangs(
    hanging_resolver: dict[str, Any],
) -> None:
    """The check looked the node's host name up with ``socket.getaddrinfo`` before its own timeout
    began: a resolver that hangs held the call that long past its deadline. A name is now looked up in
    a thread joined with what is left of the deadline, and the check says nothing if it did not finish;
    a name looked up in time, an IP literal and ``localhost`` are still told unreachable."""
    from mnesite.rlog.client import WHY_SILENT_LOOKUPS_MAX, WHY_SILENT_S_MIN, _why_silent

    started = time.monotonic()
    assert _why_silent("tcp://hangs.test:7400", started + 0.2) == ""
    assert time.monotonic() - started < 0.2 + 0.3
    unreachable = "; nothing accepts connections there: unreachable"
    assert _why_silent("tcp://dead.test:7400", time.monotonic() + 2.0) == unreachable
    dead_port = hanging_resolver["dead_port"]
    asked_before = len(hanging_resolver["asked"])
    for host in ("127.0.0.1", "localhost", "[::1]"):
        assert _why_silent(f"tcp://{host}:{dead_port}", time.monotonic() + 2.0) == unreachable, host
    # The literals and localhost were not looked up by name (getaddrinfo of a literal only parses it).
    assert hanging_resolver["asked"][asked_before:] == ["127.0.0.1", "127.0.0.1", "::1"]
    # Lookups that hang keep their threads: past WHY_SILENT_LOOKUPS_MAX of them the check starts none.
    for _ in range(WHY_SILENT_LOOKUPS_MAX):
        _why_silent("tcp://hangs.test:7400", time.monotonic())
    asked_before = len(hanging_resolver["asked"])
    started = time.monotonic()
    assert _why_silent("tcp://dead.test:7400", started + 2.0) == ""
    assert time.monotonic() - started < WHY_SILENT_S_MIN
    assert "dead.test" not in hanging_resolver["asked"][asked_before:]


@pytest.mark.timeout(30)
def test_a_dbapi_execute_frees_the_previous_result_within_the_same_deadline(silent_endpoint: str) -> None:
    """``execute`` first frees the cursor's unfinished result at the node (query_close), which had a
    timeout of its own before the statement's attempts: a hung node cost one more ``timeout_ms``."""
    from mnesite.rlog.client import QueryResult

    import mnesite.dbapi as dbapi

    timeout_ms = 500
    connection = dbapi.connect(silent_endpoint, timeout_ms=timeout_ms)
    cursor = connection.cursor()
    cursor._result = QueryResult(connection.client, {"columns": ["id"], "rows": [[1]], "cursor": "token"}, None, 500)
    assert cursor.fetchone() == (1,)
    started = time.monotonic()
    with pytest.raises(dbapi.OperationalError, match="took this call's whole deadline") as raised:
        cursor.execute("SELECT 1")
    elapsed_s = time.monotonic() - started
    connection.close()
    assert raised.value.code == "unavailable"
    assert timeout_ms / 1000 * 0.9 <= elapsed_s < timeout_ms / 1000 * 1.8, elapsed_s  # was 2 s


def test_a_linearizable_query_whose_sequencer_does_not_answer_is_a_read_refused_not_an_unknown_outcome(
    tmp_path: Path,
) -> None:
    """A query asks a shard's sequencer for its read index; when that forward expired, the core
    answered outcome_unknown, which says a write may have happened: the client then never moved to
    another node (it may not re-send a write elsewhere) and the caller was told a read's outcome is
    unknown. A read changes nothing: no_sequencer, as a replicant answers (issue 20)."""
    from mnesite.core.node import QueryIndexAsk, QueryIndexGather
    from mnesite.core.outcome import OutcomeUnknown
    from mnesite.rlog.messages import Message, typed_body

    thread_node = ThreadNode(tmp_path / "data")
    thread_node.stop()  # its rules called directly: no thread may touch the node meanwhile
    node = thread_node.node
    message = Message("query", "client-3", typed_body("query", {"sql": "SELECT 1", "consistency": "linearizable"}))
    gather = QueryIndexGather([b"client"], message, None, None, ("default",), {})
    node.hold([b"client"], "client-3")
    node._tell_outcomes([(QueryIndexAsk(gather, "default"), OutcomeUnknown("forwarded-1", "no answer in time"))])
    answers = [m for _s, envelope, m in node._outbox if envelope == [b"client"]]
    assert [(m.request_id, m.kind, m.body.code) for m in answers] == [("client-3", "error", "no_sequencer")]
    assert b"client" not in node.outstanding


def test_the_pages_of_a_query_come_from_the_node_that_answered_its_first_page(node: ThreadNode, tmp_path: Path):
    # The cursor is the answering node's. A client of several endpoints that moved to another one
    # (a failover of any request in between) sent the page requests there: query_cursor_unknown, or
    # another node's rows. The pages stay with the first page's node; its loss is said plainly.
    other = ThreadNode(tmp_path / "other")
    try:
        with other.client() as writer:
            writer.create_table("users", key="id", columns=[("id", "INTEGER"), ("name", "TEXT"), ("karma", "INTEGER")])
        sql = "SELECT id FROM users ORDER BY id"
        with Client([node.endpoint, other.endpoint], timeout_ms=2000) as client:
            result = client.query(sql, page_rows=50)
            client._next_endpoint()  # what a failover of another request does to the client
            assert client.endpoint == other.endpoint
            assert list(result) == _node_rows(node, sql) and result.pages == 5
            assert client.endpoint == other.endpoint and list(client.query(sql)) == []
            client._next_endpoint()
            result = client.query(sql, page_rows=50)
            client._next_endpoint()
            with result:  # the close goes to the node that holds the cursor
                assert len(result.fetch_page()) == 50
            client._next_endpoint()
            result = client.query(sql, page_rows=50)
            assert len(result.fetch_page()) == 50
        node.stop()
        with pytest.raises(Unavailable, match=f"{node.endpoint}.*holds this query's cursor"):
            result.fetch_page()
    finally:
        other.stop()


def test_a_page_never_outgrows_a_frame_and_a_row_too_big_for_one_frees_its_cursor(tmp_path: Path) -> None:
    # A page ends once its values reach query_page_bytes_max (a quarter of a frame), but one row may
    # hold up to 16 pages of values: a page whose last row was large, or a lone large row, made an
    # answer above frame_bytes_max. The node then answered ``too_large`` ("ask for fewer rows", which
    # cannot help) while the cursor of that page stayed open, unknown to the client, until
    # query_idle_ms_max: 16 such queries refused every query and count for 30 s (query_cursors_max).
    limits = {"frame_bytes_max": 65536, "query_page_bytes_max": 16384}
    node = ThreadNode(tmp_path / "data", extra={"limits": limits})
    try:
        with node.client() as client:
            # Row 0 holds 15,000 bytes (the page goes on), row 1 holds 60,000: together above a frame.
            wide = ", ".join(f"CASE WHEN n = 1 THEN zeroblob(15000) END AS b{i}" for i in range(3))
            sql = f"SELECT n, zeroblob(15000) AS a, {wide} FROM (SELECT 0 AS n UNION ALL SELECT 1 AS n)"
            result = client.query(sql)
            rows = list(result)
            assert [row[0] for row in rows] == [0, 1] and result.pages >= 2
            assert [len(value or b"") for value in rows[1][1:]] == [15000] * 4
            # A row alone above a frame fails its query with its reason, and frees its cursor at once.
            huge = "SELECT " + ", ".join(f"zeroblob(16000) AS b{i}" for i in range(5))
            with pytest.raises(RemoteError) as failed:
                client.query(huge)
            assert failed.value.code == "query_failed", failed.value
            assert "frame_bytes_max" in str(failed.value) and "fewer rows" not in str(failed.value)
            assert client.status()["queries"]["open"] == 0
    finally:
        node.stop()


def test_a_row_its_page_cannot_hold_opens_the_next_page_none_lost_none_repeated(tmp_path: Path) -> None:
    sizes = [(i * 7919) % 19_000 + 100 for i in range(60)]
    limits = q.QueryLimits(ms_max=5000, page_bytes_max=20_000, answer_bytes_max=30_000)
    with _runner_over(tmp_path / "sizes.db", limits, ["x" * n for n in sizes]) as runner:
        for page_rows in (1, 3, 1000):
            finished = _start(runner, "SELECT id, name FROM users ORDER BY id", page_rows=page_rows)
            rows, pages = [], []
            while True:
                assert finished.error is None, finished.error
                page = finished.result["rows"]
                rows += page
                pages.append(page)
                # What a page's answer holds (the columns' names and the positions too) stays within the bound.
                assert sum(map(q._row_bytes, page)) + q._row_bytes(["id", "name"]) < 30_000
                if finished.result["cursor"] is None:
                    break
                runner.next_page("client", finished.result["cursor"], page_rows)
                finished = _finished(runner)
            assert [row[0] for row in rows] == list(range(60)), page_rows
            assert [len(row[1]) for row in rows] == sizes
            assert page_rows == 1 or any(len(page) > 1 for page in pages)
        assert runner.open_cursors() == 0


def test_a_query_whose_shard_stopped_serving_before_its_snapshot_runs_again_once_it_serves(node: ThreadNode) -> None:
    """A query is checked while its shards serve, then waits for a query worker (both may be busy
    with other statements for up to query_ms_max). If its shard stopped serving meanwhile (a core's
    snapshot install deleted its rows, a replicant's bootstrap did; the applied key stays), the
    snapshot the worker took held no committed state, yet its page was answered: here an empty table
    at the applied key. Now a first page whose shard stopped serving after the query started is not
    answered: the query waits for the shard to serve again and runs again (within its wait)."""
    from mnesite.core.node import CoreNode
    from mnesite.rlog.messages import Message, typed_body

    from tests.conftest import node_config

    node.stop()  # the node fixture's data (200 users), opened again without its loop
    core = CoreNode(node_config(Path(node.node.config.data_dir), node.port))  # its rules called from this thread
    release = threading.Event()
    opened = core.queries._open

    def open_when_released(cursor):  # the worker takes its snapshot only once the test says so
        assert release.wait(10)
        opened(cursor)

    core.queries._open = open_when_released
    try:
        envelope = [b"client"]
        message = Message("query", "q-1", typed_body("query", {"sql": "SELECT count(*) FROM users"}))
        core._query(envelope, message)
        core.serve_queries(core._query_shard_reached)  # started: a worker holds it, not opened yet
        assert core.queries.open_cursors() == 1
        # A snapshot install starts: the shard serves no read, its rows are deleted, its applied key stays.
        users = list(core.store.connection.execute("SELECT id, name, karma FROM users"))
        core.not_serving["default"] = "installing a snapshot"
        core.begin()
        core.store.clear_rows("default")
        core._commit()
        release.set()

        def answers() -> list:
            core.serve_queries(core._query_shard_reached)
            return [m for _s, to, m in core._outbox if to == envelope]

        wait_until(lambda: core.queries.open_cursors() == 0, 10, "the first page done")
        assert answers() == []  # not the empty table: the query waits for the shard
        # The install ends: the rows are back and the shard serves again; the query runs again.
        core.begin()
        core.store.connection.executemany("INSERT INTO users VALUES (?, ?, ?)", users)
        core._commit()
        del core.not_serving["default"]
        wait_until(lambda: answers() != [], 10, "the query answered")
        (answer,) = answers()
        assert answer.kind == "reply" and answer.body.result["rows"] == [[200]], answer
    finally:
        core.close()


def test_a_query_starts_only_while_its_shards_serve_and_a_start_is_noted_unserved() -> None:
    serving = {"default": True, "other": True}

    def reached(shard: str, key: TxKey) -> bool:
        return serving[shard] and key <= TxKey(1, 5)

    waiting = q.WaitingQueries()
    local = q.WaitingQuery("local", None, ("default", "other"), {}, 10, 1000)
    pinned = q.WaitingQuery("pinned", None, ("default",), {"default": TxKey(1, 5)}, 10, 1000)
    serving["other"] = False
    waiting.add(local)
    waiting.add(pinned)
    assert waiting.ready(reached) == [pinned] and "shard other did not serve" in local.describe()
    serving["other"] = True
    assert waiting.ready(reached) == [local]
    q.note_unserved([local, pinned], reached)
    assert not local.unserved and not pinned.unserved
    serving["other"] = False
    q.note_unserved([local, pinned], reached)
    assert local.unserved and not pinned.unserved


def test_a_query_of_wait_ms_0_is_answered_with_what_the_node_has_now_not_timed_out(node: ThreadNode) -> None:
    """``wait_ms`` bounds how long a query waits for its shards to reach their keys: 0 is "do not
    wait". A query held for a turn was timed out before it was looked at (the deadline, now, was
    checked before the shards), so every wait_ms 0 query was ``timeout``, also one with nothing to
    wait for; a client with a short timeout sends 0 too (``Client._consistency``)."""
    with node.client(timeout_ms=5000) as client:
        tx_key = client.put("users", {"id": 5000, "name": "new", "karma": 1})
        sql = "SELECT count(*) FROM users"
        for body in ({}, {"min_key": list(tx_key)}, {"consistency": "read-your-writes", "min_key": list(tx_key)}):
            answer = client.call("query", {"sql": sql, "wait_ms": 0, **body})
            assert answer["rows"] == [[201]], body
        # A key not reached: no wait, the timeout at once, naming it.
        far = [1, 10**9]
        started = time.monotonic()
        with pytest.raises(RemoteError) as refused:
            client.call("query", {"sql": sql, "wait_ms": 0, "min_key": far}, retries=0)
        assert refused.value.code == "timeout" and str(tuple(far)) in str(refused.value)
        assert time.monotonic() - started < 2.0


def test_a_node_keeps_cursors_for_other_connections_when_one_holds_its_share(tmp_path: Path) -> None:
    """Through a node: a client connection holding ``query_cursors_per_connection_max`` open queries is
    refused its next (``overloaded``, naming that bound); another client's query is still answered."""
    limits = {"query_cursors_max": 4, "query_cursors_per_connection_max": 2}
    node = ThreadNode(tmp_path / "data", extra={"limits": limits})
    try:
        with node.client() as greedy, node.client() as other:
            greedy.create_table("users", key="id", columns=[("id", "INTEGER")])
            with greedy.transaction() as tx:
                for i in range(5):
                    tx.put("users", {"id": i})
            held = [greedy.query("SELECT id FROM users", page_rows=1) for _ in range(2)]
            with pytest.raises(RemoteError) as refused:
                greedy.query("SELECT id FROM users", page_rows=1)
            assert refused.value.code == "overloaded"
            assert "queries of this connection are open on this node (query_cursors_per_connection_max 2)" in str(
                refused.value
            )
            assert [row[0] for row in other.query("SELECT id FROM users", page_rows=1)] == [0, 1, 2, 3, 4]
            assert other.count("users") == 5
            assert [list(result) for result in held] == [[(i,) for i in range(5)]] * 2  # read to the end: freed
            assert len(list(greedy.query("SELECT id FROM users", page_rows=1))) == 5
    finally:
        node.stop()


def test_query_files_open_through_the_os_vfs_whatever_vfs_is_the_default(tmp_path: Path) -> None:
    """Regression: the query VFS opened its files through "" (the default VFS, whichever it is then).
    A VFS made the default and unregistered later (test_disk's quota VFS) left the query VFS the
    default: its files then opened through itself without end, a RecursionError in every later query
    of the process (test_disk.py failed 29 tests when run alone). They open through ``OS_VFS`` now."""
    store = _database(tmp_path / "db", rows=3)
    store.close()
    opened: list[str] = []

    class Spy(apsw.VFS):
        def __init__(self) -> None:
            super().__init__("mnesite-test-spy", q.OS_VFS, makedefault=True)

        def xOpen(self, name, flags):  # noqa: N802 (apsw's name)
            opened.append(str(name))
            return apsw.VFSFile(q.OS_VFS, name, flags)

    spy = Spy()
    try:
        connection = q.open_connection(str(tmp_path / "db"), 1 << 20, q.query_vfs())  # a runner's connection
        try:
            assert connection.execute("SELECT count(*) FROM users ORDER BY name").fetchall() == [(3,)]
        finally:
            connection.close()
    finally:
        spy.unregister()
    assert opened == [], "a query connection's file went through the default VFS"
