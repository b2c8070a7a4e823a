"""The replicant's held reads (``WaitingRead``): a read that must see a key waits for the table that
key's write created, instead of answering ``unknown_table`` before the create is applied."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from mnesite.replicant.node import WaitingRead
from mnesite.rlog.codec import Message
from mnesite.rlog.schema import TableSchema
from mnesite.rlog.types import TxKey

pytestmark = pytest.mark.timeout(10)


@dataclass
class FakeReplica:
    applied: TxKey
    serving: bool = True

    def readable_at(self, key: TxKey) -> bool:
        return self.serving and self.applied >= key


def held(table: str, targets: dict[str, TxKey]) -> WaitingRead:
    message = Message("get", "r1", {"table": table, "key": 1})
    return WaitingRead([b"client"], message, targets, deadline_ms=1_000)


LATE = TableSchema("late", "default", "k", (("k", "TEXT"),))


def test_an_unknown_table_waits_until_every_shard_reached_the_key() -> None:
    read = held("late", {"default": TxKey(1, 5), "other": TxKey(1, 5)})
    replicas = {"default": FakeReplica(TxKey(1, 4)), "other": FakeReplica(TxKey(1, 9))}
    assert not read.ready({}, replicas)
    replicas["default"].applied = TxKey(1, 5)
    # Every shard reached the key and the table is still unknown: it did not exist, answer now.
    assert read.ready({}, replicas)


def test_a_table_that_appears_is_answered_when_its_own_shard_reached_the_key() -> None:
    read = held("late", {"default": TxKey(1, 5), "other": TxKey(1, 5)})
    replicas = {"default": FakeReplica(TxKey(1, 5)), "other": FakeReplica(TxKey(1, 1))}
    # "other" is behind, but the table's own shard decides once the table is known.
    assert read.ready({"late": LATE}, replicas)
    replicas["default"].serving = False  # a bootstrap began while the read waited
    assert not read.ready({"late": LATE}, replicas)


def test_a_known_table_waits_for_its_shard_only() -> None:
    read = held("late", {"default": TxKey(2, 1)})
    replicas = {"default": FakeReplica(TxKey(1, 99))}
    assert not read.ready({"late": LATE}, replicas)
    replicas["default"].applied = TxKey(2, 1)
    assert read.ready({"late": LATE}, replicas)
    assert read.describe() == "shard default did not reach (2, 1)"
