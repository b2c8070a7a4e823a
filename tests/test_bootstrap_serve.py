"""bootstrap.serve.read_batch: key order, strictly after, bounded in rows and in bytes, explicit done."""

from __future__ import annotations

import msgpack
import pytest
from mnesite.bootstrap.serve import read_batch
from mnesite.rlog.schema import define_table
from mnesite.rlog.store import Store
from mnesite.rlog.types import WriteOp

pytestmark = pytest.mark.timeout(30)

TABLE = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])


@pytest.fixture
def store(tmp_path):
    store = Store(str(tmp_path / "mnesite.db"), synchronous="NORMAL")
    with store.write_transaction():
        store.apply_ops((TABLE.to_op(),))
        store.apply_ops(tuple(WriteOp("t", {"k": k, "v": "x" * (10 if k % 2 else 1000)}) for k in range(1000)))
    yield store
    store.close()


def copy_all(store: Store, rows_max: int, bytes_max: int) -> list[list[dict]]:
    batches, after = [], None
    for _ in range(10_000):
        answer = read_batch(store, TABLE, after, rows_max, bytes_max)
        batches.append(answer["rows"])
        if answer["done"]:
            return batches
        after = answer["rows"][-1]["k"]
    raise AssertionError("the copy did not end")


def test_batches_cover_every_row_once_in_key_order_within_rows_and_bytes(store) -> None:
    batches = copy_all(store, rows_max=300, bytes_max=10**9)
    assert [row["k"] for batch in batches for row in batch] == list(range(1000))
    assert max(len(batch) for batch in batches) == 300
    batches = copy_all(store, rows_max=10_000, bytes_max=20_000)
    assert [row["k"] for batch in batches for row in batch] == list(range(1000))
    assert all(len(msgpack.packb(batch)) <= 20_000 for batch in batches)
    assert len(batches) >= 27  # about 545 KB in all: the byte bound cut the batches, not the row bound


def test_a_row_larger_than_bytes_max_goes_alone_and_an_empty_table_is_done(store) -> None:
    answer = read_batch(store, TABLE, None, 10, 100)
    assert [row["k"] for row in answer["rows"]] == [0] and not answer["done"]
    assert answer["rows_total"] == 1000  # the first batch of a table says how many rows it holds
    assert read_batch(store, TABLE, 999, 10, 100) == {"rows": [], "done": True}
    with pytest.raises(ValueError):
        read_batch(store, TABLE, None, 0, 100)
