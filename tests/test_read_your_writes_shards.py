"""Read-your-writes across shards (``rlog.types.read_targets``). A tx key orders one shard's log only:
a client's read-your-writes read of a table in shard B waited for the client's last write in shard A
to be applied in shard B, a key B's log may never reach, and failed after its whole wait (``not
applied``, ``did not reach``). A write's answer now names its shard, the client keeps its last key
per shard (``Client.last_tx_keys``) and sends them as ``min_keys``; each shard a read reads waits for
its own key only."""

from __future__ import annotations

from pathlib import Path

import pytest
from mnesite.rlog.types import TxKey, read_targets

from tests.conftest import ThreadNode, thread_replicant, wait_until

pytestmark = pytest.mark.timeout(60)

A1, A9, B2 = TxKey(1, 1), TxKey(1, 9), TxKey(1, 2)


def test_each_shard_waits_for_its_own_key_and_a_key_given_for_all() -> None:
    assert read_targets(["a", "b"], None, None) == {}
    assert read_targets(["b"], None, {"a": A9}) == {}  # a key of another shard holds nothing back
    assert read_targets(["a", "b"], None, {"a": A9, "b": B2}) == {"a": A9, "b": B2}
    assert read_targets(["a", "b"], A1, None) == {"a": A1, "b": A1}  # one key for every shard read
    assert read_targets(["a", "b"], B2, {"a": A9}) == {"a": A9, "b": B2}  # the later of the two
    assert read_targets([], A1, {"a": A9}) == {}


def two_shards(client) -> None:
    """Table ``b`` in shard default, written once; table ``a`` in shard s1, written past b's key."""
    client.create_table("a", "id", [("id", "INTEGER")], shard="s1")
    client.create_table("b", "id", [("id", "INTEGER"), ("v", "TEXT")])
    client.put("b", {"id": 1, "v": "one"})
    for i in range(30):
        client.put("a", {"id": i})


def test_a_read_your_writes_read_of_another_shard_is_answered_at_once(tmp_path: Path) -> None:
    node = ThreadNode(tmp_path / "data")
    try:
        with node.client(timeout_ms=3000, retries=0) as client:
            two_shards(client)
            keys = client.last_tx_keys
            assert set(keys) == {"s1", "default"} and keys["s1"] > keys["default"]
            assert client.last_tx_key == keys["s1"]
            ryw = "read-your-writes"
            assert client.get("b", 1, consistency=ryw) == {"id": 1, "v": "one"}
            assert list(client.scan("b", consistency=ryw)) == [{"id": 1, "v": "one"}]
            assert client.count("b", consistency=ryw) == 1
            assert list(client.query("SELECT v FROM b", consistency=ryw)) == [("one",)]
            # A query over both shards waits for each one's key, and sees both writes.
            rows = client.query("SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM b)", consistency=ryw)
            assert list(rows) == [(30, 1)]
            # Another client reads these writes through the per-shard keys.
            with node.client(timeout_ms=3000, retries=0) as other:
                assert other.get("b", 1, after_tx_key=keys) == {"id": 1, "v": "one"}
                assert other.count("a", after_tx_key=keys) == 30
    finally:
        node.stop()


def test_a_replicant_holds_a_read_for_its_own_shards_key_only(tmp_path: Path) -> None:
    from mnesite.rlog.client import Client, MnesiteError

    core = ThreadNode(tmp_path / "core")
    try:
        with core.client(timeout_ms=3000) as writer:
            two_shards(writer)
            keys = dict(writer.last_tx_keys)
        with (
            thread_replicant(tmp_path / "r", core.endpoint) as endpoint,
            Client(endpoint, timeout_ms=2000, retries=1) as client,
        ):

            def serves() -> bool:
                try:
                    return client.count("a") == 30 and client.count("b") == 1
                except MnesiteError:  # unknown_table, not_ready: not copied yet
                    return False

            wait_until(serves, 15, "the replicant to serve tables a and b")
            # The writer's key in s1 is past anything shard default's log holds: only default's counts.
            assert keys["s1"] > keys["default"]
            assert client.get("b", 1, after_tx_key=keys) == {"id": 1, "v": "one"}
            assert list(client.query("SELECT v FROM b", after_tx_key=keys)) == [("one",)]
            # A key of its own shard that it has not reached still holds the read (then timeout): a
            # client of 0.5 s, whose read is held 0.45 s, not the 1.8 s the reader's would be.
            later = {"default": TxKey(keys["default"].generation + 50, 1)}
            with Client(endpoint, timeout_ms=500, retries=0) as quick, pytest.raises(MnesiteError) as info:
                quick.get("b", 1, after_tx_key=later)
            assert info.value.code == "timeout", info.value
    finally:
        core.stop()


def test_a_client_keeps_the_last_key_of_at_most_as_many_shards_as_a_read_may_name() -> None:
    from mnesite.rlog import messages
    from mnesite.rlog.client import MIN_KEYS_MAX, Client, MnesiteError

    client = Client("tcp://127.0.0.1:9", timeout_ms=100)
    try:
        for index in range(MIN_KEYS_MAX + 1):
            client._wrote({"tx_key": [1, index + 1], "shard": f"s{index}"})
        client._wrote({"tx_key": [1, 1], "shard": "s1"})  # an older answer keeps the later key, and the place
        assert len(client.last_tx_keys) == MIN_KEYS_MAX and "s0" not in client.last_tx_keys
        assert client.last_tx_keys["s1"] == TxKey(1, 2) and list(client.last_tx_keys)[-1] == "s1"
        body = client._consistency({"table": "t", "key": 1}, "read-your-writes")
        assert len(body["min_keys"]) == MIN_KEYS_MAX and "min_key" not in body and body["wait_ms"] > 0
        decoded = messages.SCHEMAS["get"].decoder.decode(messages.msgspec.msgpack.encode(body))
        assert len(decoded.min_keys) == MIN_KEYS_MAX
        body["min_keys"]["one too many"] = [1, 1]
        with pytest.raises(messages.msgspec.ValidationError):
            messages.SCHEMAS["get"].decoder.decode(messages.msgspec.msgpack.encode(body))
        too_many = {f"other{index}": TxKey(1, 1) for index in range(2)}  # beside the client's own 1,000
        with pytest.raises(MnesiteError, match="at most 1000 shards"):
            client._consistency({"table": "t", "key": 1}, "read-your-writes", too_many)
        # A node of an earlier release names no shard: its write is waited for in every shard read.
        client._wrote({"tx_key": [7, 3]})
        body = client._consistency({"table": "t", "key": 1}, "read-your-writes")
        assert body["min_key"] == [7, 3] and len(body["min_keys"]) == MIN_KEYS_MAX
    finally:
        client.close()
