"""A table a core does not know is answered ``unknown_table`` only while its catalog is complete
(``core.rules.catalog_incomplete``): a core behind its recovery's vote floor, or not serving a shard,
answers ``not_ready``. The fault test counted "unknown_table" answers from cores rebuilt after a lost
disk, for the table every client used."""

from __future__ import annotations

from pathlib import Path

import pytest
from mnesite.core import rules
from mnesite.core.node import VOTE_FLOOR_META
from mnesite.rlog.client import MnesiteError
from mnesite.rlog.store import Store
from mnesite.rlog.types import ZERO_KEY, TxKey

from tests.conftest import ThreadNode


def test_the_rule_names_the_first_shard_that_keeps_the_catalog_incomplete():
    assert rules.catalog_incomplete([]) is None
    assert rules.catalog_incomplete([("default", None, TxKey(2, 5), ZERO_KEY)]) is None
    assert rules.catalog_incomplete([("default", None, TxKey(2, 5), TxKey(2, 5))]) is None  # at its floor
    assert rules.catalog_incomplete([("default", None, None, TxKey(2, 5))]) is None  # no position: no rows
    behind = rules.catalog_incomplete([("a", None, TxKey(2, 5), ZERO_KEY), ("b", None, TxKey(1, 9), TxKey(2, 1))])
    assert behind is not None and "shard b is recovering from an empty disk" in behind
    installing = rules.catalog_incomplete([("a", "installing a snapshot at (3, 1)", TxKey(2, 5), ZERO_KEY)])
    assert installing == "shard a: installing a snapshot at (3, 1)"


def answer_code(call) -> str:
    with pytest.raises(MnesiteError) as raised:
        call()
    return raised.value.code


def test_a_core_below_its_recovery_floor_answers_not_ready_for_a_table_it_does_not_know(tmp_path: Path):
    """Gets, writes, SQL queries and changefeeds alike: each path that names a table asks the same rule."""
    data = tmp_path / "data"
    node = ThreadNode(data)
    with node.client(timeout_ms=2000, retries=0) as client:
        client.create_table("known", "id", [("id", "INTEGER")])
        # A complete catalog: an unknown table is unknown.
        assert answer_code(lambda: client.get("missing", 1)) == "unknown_table"
        assert answer_code(lambda: client.put("missing", {"id": 1})) == "unknown_table"
        assert answer_code(lambda: list(client.query("SELECT * FROM missing"))) == "unknown_table"
        assert answer_code(lambda: list(client.changes(["missing"]))) == "unknown_table"
        applied = node.node.store.shard("default").applied
    node.stop()
    # As a core rebuilt from an empty disk finds it: its peers held the log up to a later key.
    store = Store(str(data / "mnesite.db"))
    try:
        with store.write_transaction():
            store.set_meta(VOTE_FLOOR_META + "default", f"{applied.generation + 5},1")
    finally:
        store.close()
    node = ThreadNode(data)
    try:
        with node.client(timeout_ms=2000, retries=0) as client:
            assert list(client.scan("known")) == []  # what it knows, it serves
            assert list(client.query("SELECT count(*) FROM known")) == [(0,)]
            calls = (
                lambda: client.get("missing", 1),
                lambda: client.put("missing", {"id": 1}),
                lambda: list(client.query("SELECT * FROM missing")),
                lambda: list(client.changes(["missing"])),
            )
            for call in calls:
                with pytest.raises(MnesiteError) as raised:
                    call()
                assert raised.value.code == "not_ready", raised.value
                assert "recovering from an empty disk" in str(raised.value)
    finally:
        node.stop()
