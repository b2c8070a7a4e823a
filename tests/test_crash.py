"""Real processes: kill -9 a core while clients write; after restart nothing acknowledged is lost
and the rlog, its digests and the data agree (DESIGN invariants 1 and 4)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.store import Store
from mnesite.rlog.types import ZERO_KEY

from tests.conftest import NodeProcess, free_port, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def write_config(path: Path, data_dir: Path, port: int) -> None:
    path.write_text(
        f'[node]\nname = "core1"\nrole = "core"\ndata_dir = "{data_dir}"\nlisten = "tcp://127.0.0.1:{port}"\n'
        '[storage]\nsynchronous = "FULL"\n'
        "[rlog]\nretention_entries_max = 1000000\n"
    )


def replay_rlog(store: Store, shard: str, scratch: Path) -> dict[str, list[dict]]:
    """Apply every retained entry, in order, to an empty database; return its tables' rows."""
    replica = Store(str(scratch), synchronous="OFF")
    with replica.write_transaction():
        replica.ensure_shard(shard, 1)
        after = ZERO_KEY
        while batch := store.entries_after(shard, after, 1000):
            for entry in batch:
                replica.apply_entry(entry)
            after = batch[-1].tx_key
    tables = {name: replica.scan(table, None, 10**9) for name, table in replica.catalog().items()}
    position = replica.shard(shard)
    replica.close()
    return tables, position


@pytest.mark.parametrize("round_", range(2))
def test_kill_9_under_writes_loses_nothing_acknowledged(tmp_path: Path, node_processes, round_: int) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    data_dir = tmp_path / "data"
    config = tmp_path / "core1.toml"
    write_config(config, data_dir, port)
    node = NodeProcess(config, tmp_path / "core1.log")
    node_processes.append(node)
    node.start(endpoint)
    with Client(endpoint) as client:
        client.create_table("acks", "id", [("id", "INTEGER"), ("writer", "INTEGER"), ("payload", "TEXT")])

    acknowledged: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def writer(worker: int) -> None:
        with Client(endpoint, timeout_ms=1000, retries=0) as own:
            i = 0
            while not stop.is_set():
                row_id = worker * 1_000_000 + i
                try:
                    own.put("acks", {"id": row_id, "writer": worker, "payload": "x" * 100})
                except MnesiteError:
                    return  # the node is gone: this write's outcome is unknown, never counted
                with lock:
                    acknowledged.append(row_id)
                i += 1

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(8)]
    for thread in threads:
        thread.start()
    target = 300 + 200 * round_
    wait_until(lambda: len(acknowledged) >= target, 60, f"{target} acknowledged writes")
    node.kill()
    stop.set()
    for thread in threads:
        thread.join(10)
    with lock:
        seen = set(acknowledged)

    node.start(endpoint)
    with Client(endpoint) as client:
        present = {row["id"] for row in client.scan("acks")}
        # The restarted core elects itself in a new generation before it accepts writes.
        after_restart = client.put("acks", {"id": -1, "writer": -1})
        status = client.status()["shards"]["default"]
    missing = seen - present
    assert not missing, f"{len(missing)} acknowledged writes lost, e.g. {sorted(missing)[:5]}"
    node.kill()

    store = Store(str(data_dir / "mnesite.db"), create=False)
    try:
        applied = store.verify_chain("default")
        assert list(applied) == status["applied"]
        tables, position = replay_rlog(store, "default", tmp_path / "replay.db")
        assert (position.applied, position.digest.hex()) == (applied, status["digest"])
        live = store.scan(store.catalog()["acks"], None, 10**9)
        assert tables["acks"] == live, "data differs from a replay of the rlog"
        assert after_restart == applied and applied.counter == 2, "a new generation: its no-op, then our write"
    finally:
        store.close()
