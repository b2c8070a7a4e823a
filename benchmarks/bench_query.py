"""Queries through the query path (``rlog.query.QueryRunner``) as the product opens its connections
(the node's database as the main database, through ``QueryVFS``: every page read a Python call)
against the node's database attached read-only, through the default VFS, to an empty main database
opened through ``QueryVFS`` (its temporary files still counted, its page reads without Python), in one
run. The attached layout is built here: it was measured, and not adopted (docs/benchmarks).

    .venv/bin/python benchmarks/bench_query.py [--rows 100000] [--value-bytes 90] [--lookups 2000] [--rounds 5] [--json]

A database of ``--rows`` rows ``items(id INTEGER PRIMARY KEY, name TEXT, karma INTEGER)``, each name
``--value-bytes`` long (about 100 bytes a row, as in ``bench_backup.py``), is made in a temporary
directory. Each round times, for each layout in turn (alternating which goes first):

* ``scan``: ``SELECT * FROM items`` read page by page (1,000 rows a page) to its end;
* ``aggregate``: ``SELECT karma, count(*), sum(id) FROM items GROUP BY karma`` (rows read in C);
* ``lookups``: ``--lookups`` queries ``SELECT * FROM items WHERE id = ?``, one after the other, each
  checked, run on its own connection and answered.

One query thread, nothing else running in the process: the figures are the median of the rounds, in
wall-clock seconds and in the process's CPU seconds (steadier on a shared machine), and the median of
each round's ratio attached / main (below 1: the attached layout is faster). The store's pages are
read through the VFS once per query (each query opens its own connection), so the gain grows with the
bytes a query reads. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import apsw  # noqa: E402
from mnesite.rlog import query as q  # noqa: E402
from mnesite.rlog.store import Store  # noqa: E402

LOAD_BATCH_ROWS = 10_000
KARMAS = 100
PAGE_ROWS = 1000


def make_database(path: Path, rows: int, value_bytes: int) -> None:
    store = Store(str(path))
    try:
        with store.write_transaction():
            store.ensure_shard("default", 1)
            store.connection.execute("CREATE TABLE items(id INTEGER PRIMARY KEY, name TEXT, karma INTEGER) STRICT")
        for first in range(0, rows, LOAD_BATCH_ROWS):
            with store.write_transaction():
                store.connection.executemany(
                    "INSERT INTO items VALUES (?, ?, ?)",
                    (
                        (i, f"{i:08d}".ljust(value_bytes, "n"), i % KARMAS)
                        for i in range(first, min(rows, first + LOAD_BATCH_ROWS))
                    ),
                )
    finally:
        store.close()


# The attached layout's name for the node's database on a query connection.
STORE_SCHEMA = "store"


def _attached_connection(path: str, value_bytes_max: int, vfs: str | None = None) -> apsw.Connection:
    """The product's query connection opened on an empty in-memory database (through ``vfs``, as the
    product opens the node's), the node's database attached to it read-only through the default VFS:
    every setting is the product's, SQLite opens the temporary files through the main database's VFS,
    and reads the attached database's pages without Python."""
    connection = _product_opener(":memory:", value_bytes_max, vfs)
    uri = f"file:{urllib.parse.quote(path)}?mode=ro&vfs={apsw.vfs_names()[0]}"
    connection.limit(apsw.SQLITE_LIMIT_ATTACHED, 1)
    connection.execute(f"ATTACH ? AS {STORE_SCHEMA}", (uri,))
    connection.limit(apsw.SQLITE_LIMIT_ATTACHED, 0)
    return connection


def _attached_stored_names(connection: apsw.Connection) -> frozenset[str]:
    """The product's names (main's schema, empty here; modules), and the attached database's tables."""
    names = {row[0].lower() for row in connection.execute(f"SELECT name FROM {STORE_SCHEMA}.sqlite_schema")}
    return _product_stored_names(connection) | names


class _AttachedGuard(q.ReadOnlyGuard):
    """The product's authorizer, a read of the attached database taken as one of main."""

    def _reason(self, action: int, third: str | None, fourth: str | None, database: str | None) -> str | None:
        return super()._reason(action, third, fourth, "main" if database == STORE_SCHEMA else database)


_product_opener, _product_stored_names, _product_guard = q.open_connection, q.stored_names, q.ReadOnlyGuard


@contextmanager
def layout(name: str) -> Iterator[None]:
    """``main``: the product as it is (the node's database opened as main through the query VFS);
    ``attached``: the same query path with the connections, names and authorizer above."""
    if name == "main":
        yield
        return
    q.open_connection, q.stored_names, q.ReadOnlyGuard = _attached_connection, _attached_stored_names, _AttachedGuard
    try:
        yield
    finally:
        q.open_connection, q.stored_names, q.ReadOnlyGuard = _product_opener, _product_stored_names, _product_guard


def run_query(runner: q.QueryRunner, sql: str, params: tuple = ()) -> int:
    """Check, run and read ``sql`` to its end; its row count."""
    checked = runner.check(sql, params, ["items"])
    runner.start(q.WaitingQuery("bench", checked, ("default",), {}, PAGE_ROWS, 0))
    rows = 0
    while True:
        finished = next_finished(runner)
        if finished.error is not None:
            raise SystemExit(f"{sql}: {finished.error}")
        rows += len(finished.result["rows"])
        token = finished.result["cursor"]
        if token is None:
            return rows
        runner.next_page("bench", token, PAGE_ROWS)


def next_finished(runner: q.QueryRunner) -> q.Finished:
    while True:
        select.select([runner.wakeup_fd], [], [], 10.0)
        done = runner.finished()
        if done:
            return done[0]


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (the process's: the query thread's, the caller waits in ``select``)."""
    started, started_cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - started, time.process_time() - started_cpu


def measure(path: str, name: str, rows: int, lookups: int, rng: random.Random) -> dict[str, tuple[float, float]]:
    ids = [rng.randrange(rows) for _ in range(lookups)]
    with layout(name):
        runner = q.QueryRunner(path, q.QueryLimits(ms_max=60_000), lambda: int(time.monotonic() * 1000), threads=1)
        try:
            run_query(runner, "SELECT count(*) FROM items")  # the page cache warm, the worker started
            scanned: list[int] = []
            figures = {
                "scan": timed(lambda: scanned.append(run_query(runner, "SELECT * FROM items"))),
                "aggregate": timed(
                    lambda: run_query(runner, "SELECT karma, count(*), sum(id) FROM items GROUP BY karma")
                ),
                "lookups": timed(lambda: [run_query(runner, "SELECT * FROM items WHERE id = ?", (i,)) for i in ids]),
            }
        finally:
            runner.stop()
    if scanned != [rows]:
        raise SystemExit(f"{name}: the scan read {scanned} rows, not {rows}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--value-bytes", type=int, default=90, help="the length of each row's name")
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    rng = random.Random(1)
    # URI file names (the attached layout's ATTACH names its VFS in one), before any connection opens.
    apsw.shutdown()
    apsw.config(apsw.SQLITE_CONFIG_URI, 1)
    apsw.initialize()
    # (layout, what) -> per round (wall, CPU) seconds
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-query-") as directory:
        path = Path(directory) / "node.db"
        make_database(path, arguments.rows, arguments.value_bytes)
        for round_number in range(arguments.rounds):
            order = ("main", "attached") if round_number % 2 == 0 else ("attached", "main")
            for name in order:
                for what, seconds in measure(str(path), name, arguments.rows, arguments.lookups, rng).items():
                    samples.setdefault((name, what), []).append(seconds)
    figures: dict[str, dict[str, float]] = {}
    for what in ("scan", "aggregate", "lookups"):
        main_runs, attached_runs = samples["main", what], samples["attached", what]
        figures[what] = {}
        for clock, label in ((0, "wall"), (1, "cpu")):
            figures[what][f"main_{label}_s"] = statistics.median(run[clock] for run in main_runs)
            figures[what][f"attached_{label}_s"] = statistics.median(run[clock] for run in attached_runs)
            # The ratio of each round's pair (both layouts measured back to back), the median of them.
            pairs = zip(attached_runs, main_runs, strict=True)
            figures[what][f"{label}_ratio"] = statistics.median(a[clock] / m[clock] for a, m in pairs)
    if arguments.json:
        print(json.dumps({"rows": arguments.rows, "value_bytes": arguments.value_bytes, "figures": figures}))
        return
    print(
        f"{arguments.rows} rows ({arguments.value_bytes}-byte names), {arguments.lookups} lookups, median of "
        f"{arguments.rounds} rounds (seconds; ratio: attached / main, per round)"
    )
    print(f"{'':10} {'main':>8} {'attached':>8} {'ratio':>6} {'CPU main':>8} {'attached':>8} {'ratio':>6}")
    for what, row in figures.items():
        print(
            f"{what:10} {row['main_wall_s']:8.4f} {row['attached_wall_s']:8.4f} {row['wall_ratio']:6.3f} "
            f"{row['main_cpu_s']:8.4f} {row['attached_cpu_s']:8.4f} {row['cpu_ratio']:6.3f}"
        )


if __name__ == "__main__":
    main()
