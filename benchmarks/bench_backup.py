"""Online backup of a core under writes, with same-run baselines.

    .venv/bin/python benchmarks/bench_backup.py [--rows 200000] [--writers 2] [--seconds 5] [--json]

One core process on 127.0.0.1 (``synchronous = "NORMAL"``) is loaded with ``--rows`` rows of about
100 bytes (transactions of 1,000 rows). Then ``--writers`` clients write one row per transaction:
first for ``--seconds`` alone (the baseline write rate), then while ``mnesite backup`` copies the
node's database. Reported: the backup's seconds and MB/s, a raw copy of the same database file
(``shutil.copyfile``, not consistent: the I/O baseline) in the same run, the write rate during the
backup as a fraction of the baseline, and the largest write latency during each phase.

Not a test: it asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mnesite.rlog.client import Client  # noqa: E402

from benchmarks.bench_commit import free_endpoint, machine, wait_listening  # noqa: E402

ROW_VALUE = "v" * 90


class Writers:
    """Threads writing one row per transaction; rate and worst latency per phase."""

    def __init__(self, endpoint: str, count: int) -> None:
        self.endpoint = endpoint
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.writes = 0
        self.latency_max_s = 0.0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def _run(self, worker: int) -> None:
        row_id = 10_000_000 * (worker + 1)
        with Client(self.endpoint, timeout_ms=10_000) as client:
            while not self.stop_event.is_set():
                began = time.monotonic()
                client.put("kv", {"id": row_id, "value": ROW_VALUE})
                took = time.monotonic() - began
                row_id += 1
                with self.lock:
                    self.writes += 1
                    self.latency_max_s = max(self.latency_max_s, took)

    def phase(self) -> tuple[int, float]:
        """Writes and worst latency since the last call."""
        with self.lock:
            result = (self.writes, self.latency_max_s)
            self.writes, self.latency_max_s = 0, 0.0
        return result

    def start(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="mnesite-bench-backup-"))
    endpoint = free_endpoint()
    config = directory / "core1.toml"
    config.write_text(
        f'[node]\nname = "core1"\ndata_dir = "{directory / "core1"}"\nlisten = "{endpoint}"\n'
        '[storage]\nsynchronous = "NORMAL"\n'
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "mnesite.cli", "start", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        wait_listening([endpoint])
        with Client(endpoint, timeout_ms=3000, retries=30) as client:
            client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
            for start in range(0, arguments.rows, 1000):
                ops = [
                    {"op": "write", "table": "kv", "row": {"id": i, "value": ROW_VALUE}}
                    for i in range(start, start + 1000)
                ]
                client.transact(ops)
        database = directory / "core1" / "mnesite.db"
        began = time.monotonic()
        shutil.copyfile(database, directory / "raw-copy.db")
        raw_copy_s = time.monotonic() - began
        writers = Writers(endpoint, arguments.writers).start()
        time.sleep(arguments.seconds)
        baseline_writes, baseline_latency_max_s = writers.phase()
        began = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "mnesite.cli", "backup", str(directory / "backup.db"), "--node", endpoint, "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        )
        backup_s = time.monotonic() - began
        during_writes, during_latency_max_s = writers.phase()
        writers.stop()
    finally:
        process.kill()
        process.wait(30)
    answer = json.loads(result.stdout)
    size_mb = (directory / "backup.db").stat().st_size / 1e6
    shutil.rmtree(directory)
    report = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": arguments.rows,
        "database_mb": round(size_mb, 1),
        "backup_seconds": round(backup_s, 2),
        "backup_mb_per_s": round(size_mb / backup_s, 1),
        "node_copy_seconds": answer["seconds"],
        "raw_copy_seconds": round(raw_copy_s, 3),
        "backup_x_raw_copy": round(backup_s / raw_copy_s, 1),
        "node_copy_x_raw_copy": round(answer["seconds"] / raw_copy_s, 1),
        "writes_per_s_baseline": round(baseline_writes / arguments.seconds, 1),
        "writes_per_s_during_backup": round(during_writes / backup_s, 1),
        "write_rate_ratio": round((during_writes / backup_s) / max(1e-9, baseline_writes / arguments.seconds), 2),
        "write_latency_max_s_baseline": round(baseline_latency_max_s, 3),
        "write_latency_max_s_during_backup": round(during_latency_max_s, 3),
    }
    print(json.dumps(report, indent=None if arguments.json else 2))


if __name__ == "__main__":
    main()
