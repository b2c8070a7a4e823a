"""An index created online on a large table while writers run, and an indexed lookup against the same
query without the index, in one run (3 real cores on 127.0.0.1).

    .venv/bin/python benchmarks/bench_index.py [--rows 1000000] [--writers 3] [--window-s 5]

1. Loads ``--rows`` rows into ``items(id, karma, name)`` through the cluster (1,000-row transactions).
2. Times ``--lookups`` lookups ``SELECT count(*), sum(id) FROM items WHERE karma = ?`` (no index: a scan).
3. Starts ``--writers`` writers, one client each, on different cores (a new row per put), and records
   each acknowledged write's latency: a window of ``--window-s`` before, then ``mnesite index create``
   on ``karma``, the time until every core reports its build done (``status.index_builds`` empty), and
   a window after.
4. Checks that every acknowledged write is on every core, then times the same lookups with the index.

Not a test: it prints figures and fails only if an acknowledged write is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mnesite.rlog.client import MnesiteError  # noqa: E402

from tests.conftest import Cluster, wait_until  # noqa: E402

LOAD_BATCH_ROWS = 1000
KARMAS = 10_000  # distinct karma values: a lookup finds about rows / KARMAS rows


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def summary(latencies_ms: list[float]) -> dict:
    if not latencies_ms:
        return {"writes": 0}
    return {
        "writes": len(latencies_ms),
        "p50_ms": round(statistics.median(latencies_ms), 1),
        "p99_ms": round(percentile(latencies_ms, 0.99), 1),
        "max_ms": round(max(latencies_ms), 1),
    }


class Writers:
    """``count`` writer threads, each on its own core, appending (phase, latency) per acknowledged put."""

    def __init__(self, cluster: Cluster, count: int, first_id: int) -> None:
        self.cluster = cluster
        self.count = count
        self.first_id = first_id
        self.phase = "before"
        self.stop = threading.Event()
        self.latencies: dict[str, list[float]] = {"before": [], "during": [], "after": []}
        self.acknowledged: list[int] = []
        self.failures = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(n,)) for n in range(count)]

    def start(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def _run(self, number: int) -> None:
        name = self.cluster.names[number % len(self.cluster.names)]
        key = self.first_id + number
        with self.cluster.client(name, timeout_ms=10_000, retries=5) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                phase = self.phase
                try:
                    client.put("items", {"id": key, "karma": key % KARMAS, "name": f"w{key}"})
                except MnesiteError:
                    with self.lock:
                        self.failures += 1
                    continue
                with self.lock:
                    self.latencies[phase].append((time.monotonic() - started) * 1000)
                    self.acknowledged.append(key)
                key += self.count

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def load(cluster: Cluster, rows: int) -> float:
    started = time.monotonic()
    with cluster.client("core1", timeout_ms=30_000, retries=5) as client:
        for first in range(0, rows, LOAD_BATCH_ROWS):
            with client.transaction() as tx:
                for key in range(first, min(rows, first + LOAD_BATCH_ROWS)):
                    tx.put("items", {"id": key, "karma": key % KARMAS, "name": f"item {key}"})
    return time.monotonic() - started


def lookups(cluster: Cluster, count: int) -> dict:
    seconds = []
    with cluster.client("core1", timeout_ms=60_000) as client:
        for number in range(count):
            started = time.monotonic()
            rows = list(client.query("SELECT count(*), sum(id) FROM items WHERE karma = ?", [number * 7 % KARMAS]))
            seconds.append(time.monotonic() - started)
            assert rows and rows[0][0] > 0
    return {"lookups": count, "median_ms": round(statistics.median(seconds) * 1000, 2), "p99_ms": round(
        percentile(seconds, 0.99) * 1000, 2)}  # fmt: skip


def builds_done(cluster: Cluster) -> bool:
    for name in cluster.names:
        status = cluster.status(name, timeout_ms=5000)
        if status is None or status.get("index_builds"):
            return False
    return True


def run(rows: int, writers_count: int, window_s: float, lookup_count: int, step_rows: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="mnesite-index-"))
    processes: list = []
    cluster = Cluster(root, processes)
    cluster.extend_core_configs(f"[limits]\nindex_build_step_rows_max = {step_rows}\n")
    result: dict = {"rows": rows, "writers": writers_count, "index_build_step_rows_max": step_rows}
    try:
        cluster.start_all()
        with cluster.client("core1", timeout_ms=10_000, retries=5) as client:
            client.create_table("items", "id", [("id", "INTEGER"), ("karma", "INTEGER"), ("name", "TEXT")])
        result["load_s"] = round(load(cluster, rows), 1)
        cluster.wait_converged(cluster.names, timeout_s=300)
        result["lookup_without_index"] = lookups(cluster, lookup_count)
        writers = Writers(cluster, writers_count, rows).start()
        time.sleep(window_s)  # the measuring window before the index
        writers.phase = "during"
        started = time.monotonic()
        with cluster.client("core2", timeout_ms=30_000, retries=5) as client:
            client.create_index("items", ["karma"], name="items_by_karma")
        result["create_index_acknowledged_s"] = round(time.monotonic() - started, 2)
        wait_until(lambda: builds_done(cluster), 600, "every core to build the index", interval_s=0.2)
        result["built_on_every_core_s"] = round(time.monotonic() - started, 1)
        writers.phase = "after"
        time.sleep(window_s)  # the measuring window after the index
        writers.finish()
        result["writes"] = {phase: summary(values) for phase, values in writers.latencies.items()}
        result["write_failures"] = writers.failures
        cluster.wait_converged(cluster.names, timeout_s=120)
        acknowledged = sorted(writers.acknowledged)
        for name in cluster.names:
            with cluster.client(name, timeout_ms=60_000) as client:
                present = {row[0] for row in client.query("SELECT id FROM items WHERE id >= ?", [rows])}
            missing = set(acknowledged) - present
            if missing:
                raise SystemExit(f"{name} lacks {len(missing)} acknowledged writes, e.g. {sorted(missing)[:5]}")
        result["acknowledged_writes_checked_on_every_core"] = len(acknowledged)
        result["lookup_with_index"] = lookups(cluster, lookup_count)
        return result
    finally:
        for process in processes:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--lookups", type=int, default=20)
    parser.add_argument("--step-rows", type=int, default=1000, help="index_build_step_rows_max of the cores")
    arguments = parser.parse_args()
    print(json.dumps(run(arguments.rows, arguments.writers, arguments.window_s, arguments.lookups,
                         arguments.step_rows), indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
