"""The digest chain: equal digests mean identical histories; any change shows."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ZERO_KEY,
    DeleteOp,
    Entry,
    TxKey,
    WriteOp,
    entry_digest,
    make_entry,
    pack_ops,
)

pytestmark = pytest.mark.timeout(30)
EMPTY = pack_ops([])


def chain(ops_list, shard="default"):
    entries = []
    prev, digest = ZERO_KEY, GENESIS_DIGEST
    for counter, ops in enumerate(ops_list, start=1):
        entry = make_entry(shard, TxKey(1, counter), prev, digest, ops)
        entries.append(entry)
        prev, digest = entry.tx_key, entry.digest
    return entries


def test_digest_covers_the_whole_history() -> None:
    a = chain([[WriteOp("t", {"k": 1})], [WriteOp("t", {"k": 2})], [DeleteOp("t", 1)]])
    b = chain([[WriteOp("t", {"k": 1})], [WriteOp("t", {"k": 3})], [DeleteOp("t", 1)]])
    assert a[0].digest == b[0].digest
    assert a[1].digest != b[1].digest
    # The third entries are identical, yet their digests differ: they cover what came before.
    assert a[2].ops == b[2].ops and a[2].digest != b[2].digest


def test_digest_does_not_depend_on_column_order() -> None:
    one = entry_digest(GENESIS_DIGEST, "s", TxKey(1, 1), ZERO_KEY, pack_ops([WriteOp("t", {"a": 1, "b": 2})]), None)
    two = entry_digest(GENESIS_DIGEST, "s", TxKey(1, 1), ZERO_KEY, pack_ops([WriteOp("t", {"b": 2, "a": 1})]), None)
    assert one == two


def test_digest_covers_key_shard_and_request_id() -> None:
    base = entry_digest(GENESIS_DIGEST, "s", TxKey(1, 1), ZERO_KEY, EMPTY, None)
    assert base != entry_digest(GENESIS_DIGEST, "s", TxKey(2, 1), ZERO_KEY, EMPTY, None)
    assert base != entry_digest(GENESIS_DIGEST, "other", TxKey(1, 1), ZERO_KEY, EMPTY, None)
    assert base != entry_digest(GENESIS_DIGEST, "s", TxKey(1, 1), ZERO_KEY, EMPTY, "r")


def test_tx_keys_order_by_generation_then_counter() -> None:
    assert TxKey(1, 99) < TxKey(2, 1) < TxKey(2, 2)
    with pytest.raises(ValueError, match="does not follow"):
        make_entry("s", TxKey(1, 1), TxKey(1, 1), GENESIS_DIGEST, [])


def test_the_digest_is_blake2b_of_the_entry_array_over_the_ops_an_entry_carries_packed() -> None:
    import hashlib

    import msgpack
    from mnesite.rlog import types

    for count in range(1, 100):
        ops = tuple(types.WriteOp("t", {"v": "x" * (count % 7), "k": count}) for _ in range(count % 5))
        encoded = [["w", "t", [["k", count], ["v", "x" * (count % 7)]]] for _ in ops]
        body = msgpack.packb(["s", [1, count], [1, 0], None if count % 2 else "r", encoded], use_bin_type=True)
        expected = hashlib.blake2b(b"d" * 32 + body, digest_size=types.DIGEST_BYTES).digest()
        key = types.TxKey(1, count)
        request_id = None if count % 2 else "r"
        assert types.entry_digest(b"d" * 32, "s", key, types.TxKey(1, 0), pack_ops(ops), request_id) == expected
        assert types.pack_ops(ops) == msgpack.packb(encoded, use_bin_type=True)
        assert types.pack_ops(list(ops)) == types.pack_ops(ops)
        # Every way an entry is built carries the same packing of its ops, which its digest covers.
        made = make_entry("s", key, types.TxKey(1, 0), b"d" * 32, ops, request_id)
        assert made.digest == expected and made.packed == msgpack.packb(encoded, use_bin_type=True)
        assert Entry("s", key, types.TxKey(1, 0), expected, ops, request_id) == made  # packed from its ops
        assert types.entry_from_wire(made.to_wire()) == made
        assert made.size_bytes >= len(msgpack.packb(made.to_wire(), use_bin_type=True))


def test_the_one_chain_check_names_the_broken_link():
    from mnesite.rlog.types import CHAIN_DIGEST, CHAIN_LINK, CHAIN_ORDER, chain_break, make_entry

    first = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [WriteOp("t", {"a": 1})], "r1")
    second = make_entry("s", TxKey(1, 2), first.tx_key, first.digest, [], None)
    assert chain_break(ZERO_KEY, GENESIS_DIGEST, first) is None
    assert chain_break(first.tx_key, first.digest, second) is None
    assert chain_break(ZERO_KEY, GENESIS_DIGEST, second) == CHAIN_LINK
    assert chain_break(first.tx_key, bytes(32), second) == CHAIN_DIGEST  # another history before it
    tampered = Entry(second.shard, second.tx_key, second.prev, second.digest, (WriteOp("t", {"a": 2}),))
    assert chain_break(first.tx_key, first.digest, tampered) == CHAIN_DIGEST
    backwards = msgspec.structs.replace(second, tx_key=TxKey(1, 1))
    assert chain_break(first.tx_key, first.digest, backwards) == CHAIN_ORDER
    # Counters are consecutive within a generation, and a later generation starts at 1 (rlog.types.next_key):
    # what lets the store count a generation's entries from its first and last key.
    for key, verdict in (
        ((1, 2), None),
        ((1, 3), CHAIN_ORDER),
        ((3, 1), None),
        ((3, 2), CHAIN_ORDER),
    ):
        entry = make_entry("s", TxKey(*key), first.tx_key, first.digest, [], None)
        assert chain_break(first.tx_key, first.digest, entry) == verdict, key
    older = msgspec.structs.replace(second, tx_key=TxKey(0, 9))  # make_entry refuses to build it
    assert chain_break(first.tx_key, first.digest, older) == CHAIN_ORDER


def test_the_digest_header_is_msgpacks_bytes_at_every_size_boundary() -> None:
    # entry_digest packs [shard, tx_key, prev, request_id] with msgspec: the bytes (hence every digest
    # in every log) must stay msgpack's, at each boundary where msgpack changes an int's or a str's form.
    import hashlib

    import msgpack
    from mnesite.rlog import types

    parts = [0, 1, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**63 - 1]
    names = ["s", "x" * 31, "x" * 32, "é" * 20, "x" * 255, "x" * 256, "x" * 2**16]
    for count, (part, name) in enumerate(itertools.product(parts, names)):
        request_id = (None, "", "r", "q" * 64)[count % 4]
        key, prev = types.TxKey(part, parts[count % len(parts)]), types.TxKey(count, part)
        body = msgpack.packb([name, list(key), list(prev), request_id, []], use_bin_type=True)
        expected = hashlib.blake2b(b"p" * 16 + body, digest_size=types.DIGEST_BYTES).digest()
        assert types.entry_digest(b"p" * 16, name, key, prev, pack_ops(()), request_id) == expected


def test_request_ids_are_unique_and_sort_in_the_order_they_were_made(monkeypatch) -> None:
    # The log's request-id index takes new ids at its end only if later ids sort after earlier ones.
    from mnesite.rlog import types

    clock = iter(range(1_700_000_000_000_000_000, 1_700_000_100_000_000_000, 1_000_000))
    monkeypatch.setattr(types.time, "time_ns", lambda: next(clock))
    made = [types.new_request_id() for _ in range(1000)]
    assert made == sorted(made) and len(set(made)) == len(made)
    assert all(len(request_id) == 32 for request_id in made)


def test_every_op_of_the_log_has_a_client_form_and_a_replicants_run_has_none() -> None:
    from mnesite.rlog.types import ClusterVersionOp, CreateTableOp, DeleteOp, MembersOp, WriteRows, op_to_json

    ops = (
        WriteOp("t", {"a": 1}),
        DeleteOp("t", 1),
        MembersOp(("a",), "", ""),
        ClusterVersionOp("s", 2),
        CreateTableOp("t", "s", "a", (("a", "INTEGER"),)),
    )
    assert [op_to_json(op)["op"] for op in ops] == ["write", "delete", "members", "cluster_version", "create_table"]
    with pytest.raises(TypeError, match="WriteRows has no client form"):  # it used to fall into create_table's
        op_to_json(WriteRows("t", ("a",), [(1,)]))
