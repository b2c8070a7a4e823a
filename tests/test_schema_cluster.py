"""Real processes, 3 cores + replicants: secondary indexes and added columns through the rlog while
writers run. Every core and replicant ends with the same catalog, the same SQLite indexes and rows, and
the same digest; a replicant that bootstraps afterwards too; no acknowledged write is lost."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from mnesite.rlog.client import MnesiteError

from tests.conftest import Cluster, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROWS = 6000
STEP_ROWS = 500  # small steps: the online build (rlog.store) takes many turns on every node
LIMITS = f"[limits]\nindex_build_step_rows_max = {STEP_ROWS}\n"


def _start_replicant(cluster: Cluster, name: str) -> None:
    cluster.add_replicant(name)
    config = cluster.root / f"{name}.toml"
    config.write_text(config.read_text() + LIMITS)
    cluster.start(name)


def _normal(cluster: Cluster, name: str) -> bool:
    status = cluster.status(name)
    return bool(status) and (status["shards"].get("default") or {}).get("mode") == "normal"


def _physical_schema(cluster: Cluster, name: str) -> tuple:
    """The user table's columns and its indexes' columns as SQLite has them on ``name``'s file."""
    connection = sqlite3.connect(f"file:{cluster.data_dir(name) / 'mnesite.db'}?mode=ro", uri=True)
    try:
        columns = [row[1:3] for row in connection.execute("PRAGMA table_info(items)")]
        indexes = sorted(
            tuple(row[2] for row in connection.execute(f'PRAGMA index_info("{index[1]}")'))
            for index in connection.execute("PRAGMA index_list(items)")
            if index[3] == "c"  # made by CREATE INDEX (not the key's own)
        )
        rows = connection.execute("SELECT count(*), total(id), total(karma) FROM items").fetchone()
        return tuple(columns), tuple(indexes), rows
    finally:
        connection.close()


def test_indexes_and_columns_change_online_and_every_node_ends_the_same(cluster: Cluster) -> None:
    cluster.extend_core_configs(LIMITS)
    cluster.start_all()
    with cluster.client("core1", timeout_ms=10_000, retries=5) as client:
        client.create_table("items", "id", [("id", "INTEGER"), ("karma", "INTEGER"), ("name", "TEXT")])
        for first in range(0, ROWS, 1000):
            with client.transaction() as tx:
                for key in range(first, first + 1000):
                    tx.put("items", {"id": key, "karma": key % 97, "name": f"item {key}"})
    _start_replicant(cluster, "replicant1")
    wait_until(lambda: _normal(cluster, "replicant1"), 90, "replicant1 to serve")

    acknowledged: dict[int, str] = {}
    stop = threading.Event()
    errors: list[str] = []
    lock = threading.Lock()

    def write(number: int, node: str) -> None:
        key = ROWS + number
        with cluster.client(node, principal="app", timeout_ms=10_000, retries=5) as client:
            while not stop.is_set():
                try:
                    client.put("items", {"id": key, "karma": key % 97, "name": f"w{key}"})
                except MnesiteError as error:
                    if error.code == "unknown_column":  # not expected: the row names known columns only
                        errors.append(str(error))
                    continue
                with lock:
                    acknowledged[key] = f"w{key}"
                key += 3

    writers = [
        threading.Thread(target=write, args=(n, node)) for n, node in enumerate(["core1", "core2", "replicant1"])
    ]
    for thread in writers:
        thread.start()
    try:
        wait_until(lambda: len(acknowledged) >= 30, 60, "writers to start")
        # Through a replicant (forwarded to the sequencer, admin's principal kept) and through cores.
        with cluster.client("replicant1", timeout_ms=10_000, retries=5) as client:
            client.create_index("items", ["karma"], name="items_by_karma")
        with cluster.client("core3", timeout_ms=10_000, retries=5) as client:
            client.add_column("items", "email", "TEXT")
            client.create_index("items", ["name", "karma"], name="items_by_name")
            tx_key = client.put("items", {"id": -1, "karma": 1, "name": "with email", "email": "e@x"})
            client.drop_index("items_by_karma")
            client.create_index("items", ["email"], name="items_by_email")
        wait_until(lambda: len(acknowledged) >= 200, 120, "writes during the builds")
    finally:
        stop.set()
        for thread in writers:
            thread.join()
    assert not errors

    _start_replicant(cluster, "replicant2")  # bootstraps from a core: tables, indexes, rows
    names = [*cluster.names, "replicant1", "replicant2"]
    wait_until(lambda: _normal(cluster, "replicant2"), 90, "replicant2 to serve")
    position = cluster.wait_replicants_converged(cluster.names, ["replicant1", "replicant2"], timeout_s=60)
    wait_until(lambda: all(not (cluster.status(n) or {"index_builds": 1})["index_builds"] for n in names), 120,
               "every build to finish")  # fmt: skip

    expected_catalog = None
    expected_physical = None
    for name in names:
        with cluster.client(name) as client:
            table = client.table("items")
            assert table.get("indexes") == [
                {"name": "items_by_email", "columns": ["email"]},
                {"name": "items_by_name", "columns": ["name", "karma"]},
            ], name
            assert table["columns"][-1] == ["email", "TEXT"]
            assert client.get("items", -1)["email"] == "e@x"
            assert list(client.query("SELECT count(*) FROM items WHERE id >= ?", [ROWS])) == [(len(acknowledged),)]
            present = {row[0] for row in client.query("SELECT id FROM items WHERE id >= ?", [ROWS])}
            assert present == set(acknowledged), f"{name} lost acknowledged writes"
            assert (cluster.status(name) or {})["shards"]["default"]["digest"] == position["digest"]
        expected_catalog = expected_catalog or table
        assert table == expected_catalog
        physical = _physical_schema(cluster, name)
        expected_physical = expected_physical or physical
        assert physical == expected_physical, name
    assert expected_physical[1] == (("email",), ("name", "karma"))
    assert tx_key <= position["applied"]
