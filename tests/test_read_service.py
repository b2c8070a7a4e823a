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
