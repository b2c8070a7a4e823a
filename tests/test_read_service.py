"""bootstrap.read_service.answer_read: the reads a core or replicant answers from its own store."""

from __future__ import annotations

import pytest
from mnesite.bootstrap.read_service import answer_read
from mnesite.rlog.messages import decode_body
from mnesite.rlog.schema import define_table
from mnesite.rlog.store import Store
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, TxKey, WriteOp, make_entry

pytestmark = pytest.mark.timeout(30)

TABLE = define_table("t", "k", [["k", "INTEGER"], ["v", "BLOB"]])
FRAME_BYTES_MAX = 1_000_000


def build_store(path, applied: int, appended: int, value_bytes: int = 10) -> Store:
    """A shard whose log holds ``appended`` entries after its first, of which ``applied`` are applied
    (the rest: a core's uncommitted tail, which a new sequencer may replace)."""
    store = Store(str(path), synchronous="NORMAL")
    with store.write_transaction():
        store.ensure_shard("default", 1)
        entry = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [TABLE.to_op()])
        store.append_entry(entry, 0)
        store.apply_entry(entry)
        for counter in range(2, appended + 2):
            entry = make_entry(
                "default",
                TxKey(1, counter),
                entry.tx_key,
                entry.digest,
                [WriteOp("t", {"k": counter, "v": bytes(value_bytes)})],
            )
            store.append_entry(entry, 0)
            if counter <= applied + 1:
                store.apply_entry(entry)
    return store


def read(store: Store, kind: str, **body) -> list[dict]:
    return answer_read(store, kind, decode_body(kind, {"shard": "default", **body}), None, 10_000, FRAME_BYTES_MAX)


def test_rlog_reads_return_only_applied_entries_never_an_uncommitted_tail(tmp_path) -> None:
    """Regression: ``rlog_entries`` and ``rlog_tail`` read the persisted log to its end, so a core
    showed the entries of its uncommitted tail (``mnesite rlog tail --follow`` printed them), which a
    new sequencer may truncate and replace with others at the same keys."""
    store = build_store(tmp_path / "mnesite.db", applied=3, appended=6)
    try:
        assert store.shard("default").applied == TxKey(1, 4)
        assert [entry["tx_key"] for entry in read(store, "rlog_entries", after=[1, 2])] == [[1, 3], [1, 4]]
        assert [entry["tx_key"] for entry in read(store, "rlog_tail", count=2)] == [[1, 3], [1, 4]]
        assert read(store, "rlog_entries", after=[1, 4]) == []
    finally:
        store.close()


class CountingStore:
    """A store that counts the entries its log reads return (what a read costs the node's loop turn)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.entries_read = 0

    def shard(self, shard):
        return self.store.shard(shard)

    def entries_after(self, *args, **kwargs):
        entries = self.store.entries_after(*args, **kwargs)
        self.entries_read += len(entries)
        return entries

    def tail(self, *args, **kwargs):
        entries = self.store.tail(*args, **kwargs)
        self.entries_read += len(entries)
        return entries


def test_rlog_reads_are_bounded_in_bytes_and_read_about_the_entries_they_answer(tmp_path) -> None:
    """Regression: ``rlog_entries`` and ``rlog_tail`` read (and decoded) up to 1,000 entries whatever
    their size: a log of 1 MB transactions cost a node about 1 GB and its loop turn per request, for an
    answer above frame_bytes_max. An answer now holds about half a frame (at least one entry): the
    CLI's follow and the compare's in-flight reads ask again after the last entry."""
    store = build_store(tmp_path / "mnesite.db", applied=300, appended=300, value_bytes=20_000)
    counting = CountingStore(store)
    try:
        answered = read(counting, "rlog_entries", after=[1, 1], limit=1000)
        keys = [entry["tx_key"][1] for entry in answered]
        assert keys == list(range(2, 2 + len(keys))) and 10 < len(keys) < 30
        assert counting.entries_read <= 2 * len(keys) + 2
        counting.entries_read = 0
        tail = [entry["tx_key"][1] for entry in read(counting, "rlog_tail", count=1000)]
        assert tail == list(range(302 - len(tail), 302)) and 10 < len(tail) < 30
        assert counting.entries_read <= 2 * len(tail) + 2
        # A single entry larger than the bound still goes, alone.
        one = answer_read(
            store, "rlog_entries", decode_body("rlog_entries", {"shard": "default", "after": [1, 1]}), None, 10, 1000
        )
        assert [entry["tx_key"] for entry in one] == [[1, 2]]
    finally:
        store.close()


def test_a_bootstrap_batch_above_this_node_s_scan_rows_max_is_answered_with_fewer_rows(tmp_path) -> None:
    """A copier asks for batches of its own size (10,000 rows: a replicant's ``batch_rows_max``, a core's
    install) whatever the core's ``scan_rows_max``. A core configured below that refused every batch
    (``bad_request``): each bootstrap and snapshot install from it failed at its first batch and
    started again, for ever. A batch may hold fewer rows than asked (``done`` says the end), so the
    core answers at most its own bound, and the copy goes on."""
    from mnesite.bootstrap.copy import TableCopy
    from mnesite.rlog.replication import ApplyBatch, BatchReceived, FetchBatch, TablesReceived

    store = build_store(tmp_path / "mnesite.db", applied=25, appended=25)
    try:
        copy = TableCopy("core1", batch_rows_max=10_000, now_ms=0)
        effects = copy.on_tables(TablesReceived("core1", ("t",), ("k",)))
        copied = []
        while not copy.done:
            (fetch,) = [effect for effect in effects if isinstance(effect, FetchBatch)]
            body = {"table": fetch.table, "limit": fetch.limit}
            if fetch.after is not None:
                body["after"] = fetch.after
            answer = answer_read(store, "bootstrap_batch", decode_body("bootstrap_batch", body), TABLE, 10, 100_000)
            assert len(answer["rows"]) <= 10
            batch = BatchReceived("core1", "t", fetch.after, tuple(answer["rows"]), answer["done"])
            effects = copy.on_batch(batch)
            copied += [row["k"] for effect in effects if isinstance(effect, ApplyBatch) for row in effect.rows]
        assert copied == list(range(2, 27))
    finally:
        store.close()
