"""Shared Spark fixture and replica builders for the Spark tests.

One SparkSession per test session (local[2], no UI, 4 shuffle partitions): starting a JVM
costs seconds, so every Spark test module imports ``spark_session`` from here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from mnesite.rlog.store import Store
from mnesite.rlog.types import CreateTableOp, DeleteOp, Op, TxKey, WriteOp, make_entry

SHARD = "default"


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Any]:
    from mnesite.spark.session import SparkUnavailableError, build_session

    try:
        session = build_session("local[2]", app_name="mnesite-tests", shuffle_partitions=4)
    except SparkUnavailableError as error:
        pytest.skip(str(error))
    try:
        yield session
    finally:
        session.stop()


def commit(store: Store, ops: Sequence[Op], shard: str = SHARD) -> TxKey:
    """Append and apply one entry with ``ops`` after the shard's applied key, as a core would."""
    with store.write_transaction():
        position = store.ensure_shard(shard, 1)
        tx_key = TxKey(1, position.applied.counter + 1)
        entry = make_entry(shard, tx_key, position.applied, position.digest, tuple(ops))
        store.append_entry(entry, 0)
        store.apply_entry(entry)
    return tx_key


def create_store(directory: Path) -> Store:
    directory.mkdir(parents=True, exist_ok=True)
    return Store(str(directory / "mnesite.db"), synchronous="OFF")


def create_table(store: Store, table: str, key: str, columns: Sequence[tuple[str, str]], shard: str = SHARD) -> None:
    commit(store, [CreateTableOp(table, shard, key, tuple(columns))], shard)


def write_rows(store: Store, table: str, rows: Sequence[dict[str, Any]], batch_rows: int = 500) -> None:
    for start in range(0, len(rows), batch_rows):
        commit(store, [WriteOp(table, row) for row in rows[start : start + batch_rows]])


def delete_keys(store: Store, table: str, keys: Sequence[Any]) -> None:
    commit(store, [DeleteOp(table, key) for key in keys])


def copy_replica(source: Path, target: Path) -> Path:
    """Copy a closed replica's data directory (its WAL was checkpointed when the store closed)."""
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "mnesite.db", target / "mnesite.db")
    if os.path.exists(source / "mnesite.db-wal"):
        raise AssertionError("copy a replica only after closing its store")
    return target
