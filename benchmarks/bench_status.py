"""What one ``status`` request costs on a core with a long rlog, beside the old per-request row count.

    .venv/bin/python benchmarks/bench_status.py --entries 100000 --requests 2000

Fills one core (in this process, on a temporary data directory) with ``--entries`` rlog entries, then
times ``--requests`` status requests over zmq, and, as the baseline measured in the same run, the
same number of calls to ``Store.rlog_statistics`` (the rlog row count that every status request ran
before issue 10; the status now runs it at most once a second).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from mnesite.core.node import CoreNode
from mnesite.rlog.client import Client
from mnesite.rlog.config import parse_config
from mnesite.rlog.store import Store
from mnesite.rlog.types import CreateTableOp, TxKey, WriteOp, make_entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=2000)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = parse_config(
            {
                "node": {"name": "core1", "data_dir": str(Path(root) / "data"), "listen": f"tcp://127.0.0.1:{port}"},
                "storage": {"synchronous": "OFF"},
                "rlog": {"retention_entries_max": arguments.entries * 2},
            }
        )
        node = CoreNode(config)
        store = node.store
        with store.write_transaction():
            store.ensure_shard("default", 0)
            position = store.shard("default")
            prev, digest = position.applied, position.digest
            entries = []
            generation = max(prev.generation, 1)
            for counter in range(prev.counter + 1, prev.counter + 1 + arguments.entries):
                op = (
                    WriteOp("t", {"k": counter}) if entries else CreateTableOp("t", "default", "k", (("k", "INTEGER"),))
                )
                entry = make_entry("default", TxKey(generation, counter), prev, digest, (op,))
                entries.append(entry)
                prev, digest = entry.tx_key, entry.digest
            store.append_entries(tuple(entries), 0, chain_verified=True)
            store.apply_committed("default", prev)
        node.close()
        node = CoreNode(config)
        node.bind()
        thread = threading.Thread(target=node.serve_forever, daemon=True)
        thread.start()
        try:
            with Client(f"tcp://127.0.0.1:{port}", timeout_ms=60_000) as client:
                client.status()
                started = time.perf_counter()
                for _ in range(arguments.requests):
                    client.status()
                status_s = time.perf_counter() - started
        finally:
            node.stopping.set()
            thread.join(30)
        baseline = Store(config.database_path)
        try:
            started = time.perf_counter()
            for _ in range(arguments.requests):
                baseline.rlog_statistics("default")
            count_s = time.perf_counter() - started
        finally:
            baseline.close()
    per_status_ms = status_s * 1000 / arguments.requests
    per_count_ms = count_s * 1000 / arguments.requests
    print(f"{arguments.entries} rlog entries, {arguments.requests} requests")
    print(f"status over zmq, now:               {status_s:.2f} s ({per_status_ms:.2f} ms each)")
    print(f"baseline, the old per-request count: {count_s:.2f} s ({per_count_ms:.2f} ms each, without zmq)")


if __name__ == "__main__":
    main()
