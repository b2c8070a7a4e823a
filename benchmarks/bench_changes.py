"""Changefeed throughput (changes/s) and lag at half the maximum write rate (3 real cores on 127.0.0.1).

    .venv/bin/python benchmarks/bench_changes.py [--writers 4] [--measure-s 10] [--run-s 20] [--json]

1. Maximum write rate: ``--writers`` writer threads (one client each, spread over the cores) put rows
   as fast as they are acknowledged for ``--measure-s`` seconds.
2. Lag: the writers are paced at half that rate for ``--run-s`` seconds while a consumer follows
   ``mnesite changes`` at a follower core (``Client.changes(follow=True)``). A change's lag is the time
   from its write's acknowledgement to the consumer receiving its record (0 when the record came first);
   p50/p99/max over every write of the run. Every acknowledged write must reach the consumer.
3. Catch-up throughput: a fresh consumer reads the whole log from the start (no follow), changes/s.

Writers and consumers run in this one process (threads): on a small machine they share its CPUs with
the cores, so the figures are a floor. Not a test: it prints figures and fails only if an acknowledged
write never reaches the consumer.
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

from tests.conftest import Cluster  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


class Writers:
    """Writer threads putting new rows; ``rate_per_s`` None: as fast as acknowledged."""

    def __init__(self, cluster: Cluster, count: int, first_id: int, rate_per_s: float | None) -> None:
        self.cluster = cluster
        self.count = count
        self.next_id = first_id
        self.rate_per_s = rate_per_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acknowledged: dict[int, float] = {}  # row id -> acknowledgement time (monotonic s)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def _id(self) -> int:
        with self.lock:
            self.next_id += 1
            return self.next_id

    def _run(self, index: int) -> None:
        name = self.cluster.names[index % len(self.cluster.names)]
        interval_s = self.count / self.rate_per_s if self.rate_per_s else 0.0
        next_s = time.monotonic()
        with self.cluster.client(name, timeout_ms=5000, retries=3) as client:
            while not self.stop.is_set():
                if interval_s:
                    next_s += interval_s
                    delay_s = next_s - time.monotonic()
                    if delay_s > 0:
                        self.stop.wait(delay_s)  # pacing, not awaiting a condition
                row_id = self._id()
                try:
                    client.put("items", {"id": row_id, "name": f"row{row_id}"})
                except MnesiteError:
                    continue
                self.acknowledged[row_id] = time.monotonic()

    def run_for(self, seconds: float) -> float:
        """Run for ``seconds``; return acknowledged writes per second."""
        began = time.monotonic()
        for thread in self.threads:
            thread.start()
        self.stop.wait(seconds)
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        return len(self.acknowledged) / (time.monotonic() - began)


def run(writers_count: int, measure_s: float, run_s: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix="mnesite-changes-"))
    processes: list = []
    cluster = Cluster(root, processes)
    result: dict = {"writers": writers_count, "measured_under_load": True}
    try:
        cluster.start_all()
        with cluster.client("core1", timeout_ms=10_000, retries=5) as client:
            client.create_table("items", "id", [("id", "INTEGER"), ("name", "TEXT")])
        max_rate = Writers(cluster, writers_count, 0, None).run_for(measure_s)
        result["max_writes_per_s"] = round(max_rate)
        with cluster.client("core1", timeout_ms=5000) as client:
            status = client.status()["shards"]["default"]
            start_key = tuple(status["applied"])
            sequencer = status["sequencer"]
        follower = next(name for name in cluster.names if name != sequencer)
        received: dict[int, float] = {}
        stop = threading.Event()

        def consume() -> None:
            with cluster.client(follower, timeout_ms=5000, retries=3) as consumer:
                for record in consumer.changes(["items"], after_tx_key=start_key, follow=True, wait_ms=200):
                    if record["kind"] == "change" and record["op"] == "write":
                        received.setdefault(record["key"], time.monotonic())
                    if stop.is_set():
                        return

        consumer_thread = threading.Thread(target=consume, daemon=True)
        consumer_thread.start()
        paced = Writers(cluster, writers_count, 10_000_000, max_rate / 2)
        result["paced_writes_per_s"] = round(paced.run_for(run_s))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not set(paced.acknowledged) <= set(received):
            time.sleep(0.05)  # the consumer catching up: bounded by the deadline above
        missing = set(paced.acknowledged) - set(received)
        stop.set()
        lags_ms = [max(0.0, (received[i] - at) * 1000) for i, at in paced.acknowledged.items() if i in received]
        result["lag_ms"] = {
            "changes": len(lags_ms),
            "p50": round(statistics.median(lags_ms), 1) if lags_ms else None,
            "p99": round(percentile(lags_ms, 0.99), 1),
            "max": round(max(lags_ms), 1) if lags_ms else None,
        }
        result["missing"] = len(missing)
        result["consumer_node"] = follower
        with cluster.client(follower, timeout_ms=10_000, retries=3) as consumer:
            began = time.monotonic()
            count = sum(1 for record in consumer.changes(["items"]) if record["kind"] == "change")
            elapsed = time.monotonic() - began
        result["catch_up"] = {"changes": count, "seconds": round(elapsed, 2), "changes_per_s": round(count / elapsed)}
    finally:
        for process in processes:
            process.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--measure-s", type=float, default=10)
    parser.add_argument("--run-s", type=float, default=20)
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    result = run(arguments.writers, arguments.measure_s, arguments.run_s)
    if arguments.json:
        print(json.dumps(result))
    else:
        print(f"max write rate        {result['max_writes_per_s']} writes/s ({arguments.writers} writers)")
        print(f"paced at half         {result['paced_writes_per_s']} writes/s for {arguments.run_s:g} s")
        lag = result["lag_ms"]
        print(f"changefeed lag        p50 {lag['p50']} ms, p99 {lag['p99']} ms, max {lag['max']} ms ({lag['changes']})")
        catch_up = result["catch_up"]
        print(f"catch-up throughput   {catch_up['changes_per_s']} changes/s ({catch_up['changes']} changes)")
        print(f"missing               {result['missing']} acknowledged writes never received")
    if result["missing"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
