"""Benchmark: ``compare`` on two 1,000,000-row replicas with 0.1% differences, against alternatives.

Theory of operation
-------------------
Builds two replicas in a temporary directory: the table is created through ``Store.apply_ops``
(so the catalog is mnesite's own), rows are bulk-inserted with apsw (replaying a million rlog
entries would measure the store, not the comparison). The copy then gets 0.1% of its rows
changed, deleted or added. Measured in one run, on one machine:

* ``compare (with start-up)``: ``spark.compare.compare`` building and stopping its own local session;
* ``compare (first on session)``: the job on a session that is already running and has run one
  trivial job (so its Python workers exist), as a long-lived driver would have;
* ``compare (repeated)``: the best of ``--repeat`` further runs on that session;
* ``sqlite attach join``: both files ATTACHed to one SQLite connection, joined both ways on the key;
* ``spark full row join``: both tables read through the ``mnesite`` data source and full-outer-joined
  on the key in Spark, every row shipped (``--skip-full-join`` leaves it out).

Every method must find the same numbers of differences; the script fails otherwise. Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_compare.py [--rows 1000000] [--master local[*]] \
        [--repeat 3] [--skip-full-join]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

import apsw
from mnesite.rlog.store import Store
from mnesite.rlog.types import CreateTableOp

ROWS_DEFAULT = 1_000_000
DIFFERENCE_RATIO = 0.001
INSERT_BATCH_ROWS = 50_000


def build_replicas(directory: str, rows: int, seed: int) -> dict[str, int]:
    """Two replica directories ``a`` and ``b``; returns the differences made in ``b``."""
    primary = os.path.join(directory, "a")
    os.makedirs(primary)
    store = Store(os.path.join(primary, "mnesite.db"), synchronous="OFF")
    with store.write_transaction():
        store.apply_ops(
            (
                CreateTableOp(
                    "items",
                    "default",
                    "id",
                    (("id", "INTEGER"), ("name", "TEXT"), ("score", "REAL"), ("payload", "BLOB")),
                ),
            )
        )
    generator = random.Random(seed)
    connection = store.connection
    for start in range(0, rows, INSERT_BATCH_ROWS):
        with store.write_transaction():
            connection.executemany(
                "INSERT INTO items VALUES (?, ?, ?, ?)",
                (
                    (key * 2, f"item {key}", generator.random(), generator.randbytes(16))
                    for key in range(start, min(start + INSERT_BATCH_ROWS, rows))
                ),
            )
    store.close()
    copy = os.path.join(directory, "b")
    os.makedirs(copy)
    shutil.copyfile(os.path.join(primary, "mnesite.db"), os.path.join(copy, "mnesite.db"))
    changes = max(3, int(rows * DIFFERENCE_RATIO))
    keys = generator.sample(range(rows), changes)
    third = changes // 3
    changed, deleted, added = keys[:third], keys[third : 2 * third], keys[2 * third :]
    connection = apsw.Connection(os.path.join(copy, "mnesite.db"))
    with connection:
        connection.executemany("UPDATE items SET name = 'changed' WHERE id = ?", ((k * 2,) for k in changed))
        connection.executemany("DELETE FROM items WHERE id = ?", ((k * 2,) for k in deleted))
        # Odd keys do not exist on the primary.
        connection.executemany("INSERT INTO items VALUES (?, 'added', 0.5, NULL)", ((k * 2 + 1,) for k in added))
    connection.close()
    return {"different": len(changed), "missing_on_right": len(deleted), "missing_on_left": len(added)}


def sqlite_attach_join(directory: str) -> dict[str, int]:
    connection = apsw.Connection(":memory:")
    connection.execute("ATTACH ? AS a", (os.path.join(directory, "a", "mnesite.db"),))
    connection.execute("ATTACH ? AS b", (os.path.join(directory, "b", "mnesite.db"),))
    different = connection.execute(
        "SELECT count(*) FROM a.items x JOIN b.items y ON x.id = y.id "
        "WHERE x.name IS NOT y.name OR x.score IS NOT y.score OR x.payload IS NOT y.payload"
    ).fetchone()[0]
    missing_on_right = connection.execute(
        "SELECT count(*) FROM a.items x WHERE NOT EXISTS (SELECT 1 FROM b.items y WHERE y.id = x.id)"
    ).fetchone()[0]
    missing_on_left = connection.execute(
        "SELECT count(*) FROM b.items y WHERE NOT EXISTS (SELECT 1 FROM a.items x WHERE x.id = y.id)"
    ).fetchone()[0]
    connection.close()
    return {"different": different, "missing_on_right": missing_on_right, "missing_on_left": missing_on_left}


def spark_full_join(session: Any, directory: str, partitions: int) -> dict[str, int]:
    from pyspark.sql import functions as F

    def load(name: str) -> Any:
        frame = (
            session.read.format("mnesite")
            .option("path", os.path.join(directory, name))
            .option("table", "items")
            .option("partitions", str(partitions))
            .load()
        )
        return frame.select([F.col(c).alias(f"{name}_{c}") for c in frame.columns])

    left, right = load("a"), load("b")
    joined = left.join(right, left["a_id"] == right["b_id"], "full_outer")
    counts = joined.select(
        F.sum(F.when(F.col("b_id").isNull(), 1).otherwise(0)).alias("missing_on_right"),
        F.sum(F.when(F.col("a_id").isNull(), 1).otherwise(0)).alias("missing_on_left"),
        F.sum(
            F.when(
                F.col("a_id").isNotNull()
                & F.col("b_id").isNotNull()
                & ~(
                    F.col("a_name").eqNullSafe(F.col("b_name"))
                    & F.col("a_score").eqNullSafe(F.col("b_score"))
                    & F.col("a_payload").eqNullSafe(F.col("b_payload"))
                ),
                1,
            ).otherwise(0)
        ).alias("different"),
    ).collect()[0]
    return {name: int(counts[name]) for name in ("different", "missing_on_right", "missing_on_left")}


def report_counts(report: Any) -> dict[str, int]:
    (pair,) = report.pairs
    return {name: pair.counts[name] for name in ("different", "missing_on_right", "missing_on_left")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=ROWS_DEFAULT)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="repeated warm compares (the best is reported)")
    parser.add_argument("--skip-full-join", action="store_true", help="leave out the Spark full row join")
    arguments = parser.parse_args()
    if arguments.rows < 3 or arguments.repeat < 1:
        parser.error("--rows must be at least 3 and --repeat at least 1")

    from mnesite.spark.compare import CompareOptions, compare
    from mnesite.spark.session import build_session

    progress = lambda message: print(f"  compare: {message}", file=sys.stderr)  # noqa: E731
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mnesite-bench-") as directory:
        started = time.monotonic()
        expected = build_replicas(directory, arguments.rows, arguments.seed)
        print(
            f"built two replicas of {arguments.rows} rows in {time.monotonic() - started:.1f} s: {expected}",
            file=sys.stderr,
        )
        replicas = [os.path.join(directory, "a"), os.path.join(directory, "b")]
        options = CompareOptions(master=arguments.master)

        def measure(name: str, run: Any) -> None:
            started = time.monotonic()
            counts = run()
            seconds = round(time.monotonic() - started, 2)
            print(f"{name}: {seconds} s {counts}", file=sys.stderr)
            if name not in results or seconds < results[name]["seconds"]:  # measured again: keep the best
                results[name] = {"seconds": seconds, "counts": counts}
            if counts != expected:
                raise SystemExit(f"{name} found {counts}, expected {expected}")

        measure("compare (with start-up)", lambda: report_counts(compare(replicas, options, progress=progress)))
        session = build_session(arguments.master)
        started = time.monotonic()
        context = session.sparkContext
        context.parallelize(range(context.defaultParallelism), context.defaultParallelism).map(abs).collect()
        print(f"session warm-up job (starts the Python workers): {time.monotonic() - started:.2f} s", file=sys.stderr)
        statistics: dict[str, Any] = {}

        def warm() -> dict[str, int]:
            report = compare(replicas, options, session=session, progress=progress)
            statistics.clear()
            statistics.update(report.statistics)
            return report_counts(report)

        measure("compare (first on session)", warm)
        measure("sqlite attach join", lambda: sqlite_attach_join(directory))
        for _ in range(arguments.repeat):
            measure("compare (repeated)", warm)
        measure("sqlite attach join", lambda: sqlite_attach_join(directory))  # again, after the compares
        if not arguments.skip_full_join:
            parallelism = session.sparkContext.defaultParallelism
            measure("spark full row join", lambda: spark_full_join(session, directory, parallelism * 2))
        session.stop()

    baseline = results["sqlite attach join"]["seconds"]  # the better of its two runs
    summary = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "rows": arguments.rows,
        "differences": expected,
        "master": arguments.master,
        "compare_statistics": statistics,
        "results": {
            name: {**value, "ratio_to_sqlite": round(value["seconds"] / baseline, 2) if baseline else None}
            for name, value in results.items()
        },
    }
    print(f"{'method':<26} {'seconds':>9} {'x sqlite':>9}")
    for name, value in summary["results"].items():
        print(f"{name:<26} {value['seconds']:>9.2f} {value['ratio_to_sqlite']:>9.2f}")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
