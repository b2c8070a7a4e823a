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


class CountingStore:
    """A store that counts the rows its scans read (what a batch costs the core's loop turn)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.rows_read = 0

    def scan(self, table, after, limit):
        rows = self.store.scan(table, after, limit)
        self.rows_read += len(rows)
        return rows

    def count_rows(self, table, limit=None):
        self.counted = True
        return self.store.count_rows(table, limit)


LARGE = define_table("large", "k", [["k", "INTEGER"], ["v", "BLOB"]])


@pytest.fixture
def large_rows(tmp_path):
    """A store whose table ``large`` holds 300 rows of 20 KB, behind a ``CountingStore``."""
    store = Store(str(tmp_path / "large.db"), synchronous="NORMAL")
    with store.write_transaction():
        store.apply_ops((LARGE.to_op(),))
        store.apply_ops(tuple(WriteOp("large", {"k": k, "v": bytes(20_000)}) for k in range(300)))
    yield CountingStore(store)
    store.close()


def test_a_batch_of_large_rows_reads_about_the_rows_it_answers_not_a_whole_read_step(large_rows) -> None:
    """Regression: every batch read READ_ROWS_STEP (256) rows before measuring them, so a table of
    100 KB rows cost each 1 MB batch 25 MB read and packed to answer 10 rows (and a table of 4 MB
    rows 1 GB per batch of one row): a loop turn bounded by rows, not by bytes."""
    after, answered, batches = None, 0, 0
    while True:
        answer = read_batch(large_rows, LARGE, after, 10_000, 100_000)
        answered += len(answer["rows"])
        batches += 1
        assert len(msgpack.packb(answer["rows"])) <= 100_000
        if answer["done"]:
            break
        after = answer["rows"][-1]["k"]
    assert answered == 300
    # Each batch reads at most about twice the rows it answers (plus the one that crosses the bound).
    assert large_rows.rows_read <= 2 * answered + 2 * batches


def test_a_scan_over_frame_bytes_max_is_too_large_after_reading_about_a_frame_not_every_row(large_rows) -> None:
    """Regression: a scan read all its ``limit`` rows (scan_rows_max, 10,000 by default) into memory
    and encoded them before the reply was found larger than a frame and replaced by ``too_large``:
    a scan of 100 KB rows cost the node about 1 GB and its loop turn, for an error."""
    from mnesite.bootstrap.read_service import answer_read
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.messages import decode_body

    def scan(**body) -> list[int]:
        answer = answer_read(large_rows, "scan", decode_body("scan", {"table": "large", **body}), LARGE, 10_000, 10**6)
        return [row["k"] for row in answer]

    with pytest.raises(RequestError) as refused:
        scan(limit=300)
    assert refused.value.code == "too_large"
    assert large_rows.rows_read <= 2 * 1_000_000 // 20_000 + 2
    assert not hasattr(large_rows, "counted")  # a scan page does not count the table's rows
    # A scan whose answer fits a frame is answered whole, and a short page still means the end.
    assert scan(limit=40, after=100) == list(range(101, 141))
    assert scan(limit=40, after=280) == list(range(281, 300))


def test_the_first_batch_counts_at_most_rows_total_counted_max_rows(store, monkeypatch) -> None:
    """SQLite counts a table by reading it, on the core's loop: a first batch counted the whole table
    (seconds for a large one, holding every heartbeat and append). It counts up to a bound now, and a
    larger table's total is unknown (None: the copy shows rows and rate, without an ETA)."""
    import mnesite.bootstrap.serve as serve

    counted: list[int | None] = []
    count_rows = store.count_rows
    monkeypatch.setattr(store, "count_rows", lambda table, limit: counted.append(limit) or count_rows(table, limit))
    monkeypatch.setattr(serve, "ROWS_TOTAL_COUNTED_MAX", 999)
    assert read_batch(store, TABLE, None, 10, 10**6)["rows_total"] is None  # 1,000 rows: above the bound
    monkeypatch.setattr(serve, "ROWS_TOTAL_COUNTED_MAX", 1000)
    assert read_batch(store, TABLE, None, 10, 10**6)["rows_total"] == 1000
    assert counted == [1000, 1001]  # never an unbounded count
