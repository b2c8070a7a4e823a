"""A name dropped in one shard and created in another: the shard whose create arrives first waits.

Names are one SQLite namespace per node, each shard's log is applied on its own (``rlog.schema``,
``name_held_elsewhere``; ``rlog.store``, ``Store.name_waits``)."""

from __future__ import annotations

import pytest
from mnesite.rlog.messages import Message, typed_body
from mnesite.rlog.schema import NameHeld, define_table, name_held_elsewhere
from mnesite.rlog.store import EntryApplyError, Store, StoreError
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ZERO_KEY,
    CreateIndexOp,
    DropIndexOp,
    DropTableOp,
    TxKey,
    WriteOp,
    make_entry,
)

pytestmark = pytest.mark.timeout(30)

X_OF_A = define_table("x", "k", [["k", "INTEGER"], ["v", "TEXT"]], "a")
X_OF_B = define_table("X", "id", [["id", "TEXT"], ["n", "INTEGER"]], "b")  # another letter case, other columns
T_OF_A = define_table("ta", "k", [["k", "INTEGER"], ["v", "TEXT"]], "a")
T_OF_B = define_table("tb", "k", [["k", "INTEGER"], ["w", "TEXT"]], "b")


def chain(shard: str, ops_list: list[list]) -> list:
    key, digest, entries = ZERO_KEY, GENESIS_DIGEST, []
    for counter, ops in enumerate(ops_list, 1):
        entry = make_entry(shard, TxKey(1, counter), key, digest, ops, request_id=f"{shard}{counter}")
        entries.append(entry)
        key, digest = entry.tx_key, entry.digest
    return entries


# (shard a's entries: the last one drops the name; shard b's: they create it and use it)
TABLE_NAME = (
    [[X_OF_A.to_op()], [WriteOp("x", {"k": 1, "v": "a"})], [DropTableOp("x", "a")]],
    [[X_OF_B.to_op()], [WriteOp("X", {"id": "one", "n": 1})]],
)
INDEX_NAME = (
    [[T_OF_A.to_op(), CreateIndexOp("ix", "ta", "a", ("v",))], [DropIndexOp("ix", "ta", "a")]],
    [[T_OF_B.to_op()], [CreateIndexOp("IX", "tb", "b", ("w",))], [WriteOp("tb", {"k": 1, "w": "b"})]],
)


def test_the_rule_names_a_holder_of_another_shard_only() -> None:
    catalog = {"x": X_OF_A, "ta": T_OF_A.changed_by(CreateIndexOp("ix", "ta", "a", ("v",)))}
    assert name_held_elsewhere(catalog, "b", [X_OF_B.to_op()]) == NameHeld("X", "x", "a")
    index = CreateIndexOp("Ix", "tb", "b", ("w",))
    assert name_held_elsewhere(catalog, "b", [T_OF_B.to_op(), index]) == NameHeld("Ix", "ta", "a", "ix")
    # A table named as another shard's index, an index named as another shard's table.
    assert name_held_elsewhere(catalog, "b", [define_table("IX", "k", [], "b").to_op()]) == NameHeld(
        "IX", "ta", "a", "ix"
    )
    assert name_held_elsewhere(catalog, "b", [CreateIndexOp("x", "tb", "b", ("w",))]) == NameHeld("x", "x", "a")
    # The same shard's names are its sequencer's to check (the check_ rules): no wait.
    assert name_held_elsewhere(catalog, "a", [X_OF_A.to_op(), CreateIndexOp("ix", "ta", "a", ("v",))]) is None
    assert name_held_elsewhere(catalog, "b", [T_OF_B.to_op(), WriteOp("tb", {"k": 1}), DropTableOp("x", "b")]) is None


def open_store(tmp_path, name: str) -> Store:
    store = Store(str(tmp_path / f"{name}.db"), synchronous="NORMAL")
    with store.write_transaction():
        store.ensure_shard("a", 1)
        store.ensure_shard("b", 1)
    return store


FOLLOWER_MEMBERS = ("core1", "core2", "core3")


def two_shard_follower(node) -> dict:
    """Shards ``a`` and ``b`` opened on a follower core driven by hand (``follower_by_hand``): their drivers."""
    drivers = {}
    for shard in ("a", "b"):
        node.store.ensure_shard(shard, 0)
        drivers[shard] = node._open_shard(shard)
    return drivers


def append_by_hand(node, driver, entries: list, after) -> None:
    """The sequencer core2's append of ``entries`` after entry ``after`` (None: the first), applied
    as the follower gathers its commits (``entries`` end at the commit key)."""
    from mnesite.core.consensus import AppendRequest, MessageReceived

    previous = (ZERO_KEY, GENESIS_DIGEST) if after is None else (after.tx_key, after.digest)
    request = AppendRequest(1, *previous, entries[-1].tx_key, FOLLOWER_MEMBERS, tuple(entries))
    node._step(driver, MessageReceived("core2", request))
    node._apply_gathered(driver)


def apply_b(store: Store, entries: list, path: str) -> None:
    """Shard b's entries arrive: as a core applies them (from its tail or read back) or a replicant."""
    with store.write_transaction():
        if path == "replicant":
            store.log_and_apply_verified(entries, 0)
        else:
            store.append_entries(entries, 0)
            store.apply_committed("b", entries[-1].tx_key, entries if path == "held" else ())


@pytest.mark.parametrize("path", ["held", "read back", "replicant"])
@pytest.mark.parametrize("ops_of", [TABLE_NAME, INDEX_NAME], ids=["table", "index"])
def test_a_create_applied_before_the_other_shard_s_drop_waits_then_follows_it(tmp_path, path, ops_of) -> None:
    a_entries, b_entries = chain("a", ops_of[0]), chain("b", ops_of[1])
    # A node that applies the shards in commit order: the reference.
    expected = open_store(tmp_path, "expected")
    with expected.write_transaction():
        expected.log_and_apply_verified(a_entries, 0)
        expected.log_and_apply_verified(b_entries, 0)
    store = open_store(tmp_path, "store")
    with store.write_transaction():
        store.log_and_apply_verified(a_entries[:-1], 0)  # shard a holds the name
    apply_b(store, b_entries, path)
    waiting_at = 1 if ops_of is INDEX_NAME else 0  # the index's entry follows its table's
    wait = store.name_waits["b"]
    assert (wait.tx_key, wait.request_id, wait.held.holder_shard) == (
        b_entries[waiting_at].tx_key,
        f"b{waiting_at + 1}",
        "a",
    )
    assert store.shard("b").applied == (b_entries[waiting_at - 1].tx_key if waiting_at else ZERO_KEY)
    assert store.last_entry("b")[0] == b_entries[-1].tx_key, "the waiting entries stay in the log"
    assert store.name_waits_due() == []
    with store.write_transaction():
        store.log_and_apply_verified(a_entries[-1:], 0)  # shard a's drop: the name is free
        assert store.name_waits_due() == ["b"]
        store.apply_committed("b", b_entries[-1].tx_key)
    assert store.name_waits == {}
    assert store.catalog() == expected.catalog()
    assert store.shards() == expected.shards()
    for table in expected.catalog().values():
        assert store.scan(table, None, 10) == expected.scan(table, None, 10)
    store.close()
    expected.close()


def test_a_name_held_by_the_same_shard_stays_an_error(tmp_path) -> None:
    store = open_store(tmp_path, "store")
    entries = chain("b", [[T_OF_B.to_op()], [define_table("TB", "k", [], "b").to_op()]])
    with pytest.raises(EntryApplyError, match="already exists"), store.write_transaction():
        store.append_entries(entries, 0)
        store.apply_committed("b", entries[-1].tx_key, entries)
    with pytest.raises(StoreError, match="already exists"), store.write_transaction():
        store.log_and_apply_verified(entries, 0)
    assert store.name_waits == {}
    store.close()


def follow(node, shard: str):
    """A replica of ``shard`` at a replicant driven by hand, resumed from the start on ``core1``."""
    from mnesite.rlog import replication as p

    replica = node._open_replica(shard)
    start = replica.status()
    node._step(replica, p.Ticked())
    node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 9), True, 1)),)))
    accepted = p.WatchAccepted(
        "core1", f"agent-{shard}", "resume", start.applied_key, start.applied_digest, replica.watch_id
    )
    node._step(replica, accepted)
    assert replica.mode is p.Mode.NORMAL
    return replica


def push(node, replica, entries: list) -> None:
    from mnesite.rlog import replication as p

    node.begin()
    node._step(replica, p.PushReceived("core1", f"agent-{replica.shard}", tuple(entries), entries[-1].tx_key, True))
    node.flush()


def test_a_replicant_that_hears_the_create_before_the_drop_keeps_running_and_converges(tmp_path, caplog) -> None:
    """Shard b's create of ``X`` reaches the replicant before shard a's drop of ``x`` (the agents of two
    shards push independently): it used to stop with ``EntryApplyError``. Shard b waits, visibly (its
    status, a warning, read-your-writes of b's entries not served), shard a goes on, and a's drop
    lets b's entries follow in the same turn; across a restart too."""
    from tests.conftest import replicant_by_hand
    from tests.test_replicant_node import _unconnected_dealer

    a_entries, b_entries = chain("a", TABLE_NAME[0]), chain("b", TABLE_NAME[1])
    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica_a, replica_b = follow(node, "a"), follow(node, "b")
        push(node, replica_a, a_entries[:2])
        push(node, replica_b, b_entries[:1])
        wait = node.status()["shards"]["b"]["name_wait"]
        assert wait is not None and (wait["tx_key"], wait["name"], wait["held_by"], wait["held_by_shard"]) == (
            [1, 1],
            "X",
            "x",
            "a",
        )
        assert "drop it in shard a" in wait["remedy"]
        assert any("creates 'X', held here by table 'x' of shard a" in r.getMessage() for r in caplog.records)
        push(node, replica_b, b_entries[1:])  # logged behind the waiting entry
        assert node.store.shard("b").applied == ZERO_KEY and replica_b.applied_key == b_entries[-1].tx_key
        assert not node._readable_at("b", b_entries[-1].tx_key), "read-your-writes past the wait is not served"
        assert node._readable_at("a", a_entries[1].tx_key)
    # A restart while b waits: the replica goes on from what its log holds.
    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica_b = node.replicas["b"]
        assert replica_b.applied_key == b_entries[-1].tx_key and "b" in node.store.name_waits
        replica_a = follow(node, "a")
        push(node, replica_a, a_entries[2:])  # a's drop: b's entries follow at once
        assert node.status()["shards"]["b"]["name_wait"] is None
        assert node.store.shard("b").applied == b_entries[-1].tx_key
        table = node.store.catalog()["X"]
        assert table.shard == "b" and node.store.scan(table, None, 10) == [{"id": "one", "n": 1}]
        assert "x" not in node.store.catalog() and node.store.name_waits == {}


def test_a_follower_core_that_hears_the_create_before_the_drop_keeps_running_and_converges(tmp_path, caplog) -> None:
    """A follower core hears shard b's create of ``X`` (and b's next writes) before shard a's drop of
    ``x``: the shards' sequencers append independently. It used to stop with ``EntryApplyError``; shard
    b waits (status, reads that must see b's entries refused ``not_applied``), shard a goes on, and a's
    drop lets b's entries follow in the same step: the node ends in the state the sequencers have."""
    from mnesite.cli.main import describe_name_wait

    from tests.conftest import follower_by_hand

    a_entries, b_entries = chain("a", TABLE_NAME[0]), chain("b", TABLE_NAME[1])
    b_entries += chain("b", [*TABLE_NAME[1], [WriteOp("X", {"id": "two", "n": 2})]])[2:]

    with follower_by_hand(tmp_path / "data") as (node, _):

        def append(driver, entries: list, after) -> None:
            append_by_hand(node, driver, entries, after)

        drivers = two_shard_follower(node)
        append(drivers["a"], a_entries[:2], None)
        append(drivers["b"], b_entries[:2], None)
        append(drivers["b"], b_entries[2:], b_entries[1])  # a later commit while it waits
        assert (
            node.store.shard("b").applied == ZERO_KEY and drivers["b"].consensus.committed_key == b_entries[-1].tx_key
        )
        wait = node.status()["shards"]["b"]["name_wait"]
        assert wait is not None and (wait["tx_key"], wait["held_by"], wait["held_by_shard"]) == ([1, 1], "x", "a")
        assert node.status()["shards"]["a"]["name_wait"] is None
        assert describe_name_wait("b", node.status()["shards"]["b"]).startswith("WARNING: shard b: applying waits")
        warned = [r for r in caplog.records if "held here by table 'x' of shard a" in r.getMessage()]
        assert len(warned) == 1, "one line while it waits (throttled), not one per commit"
        get = {"table": "x", "key": 1, "min_key": list(a_entries[1].tx_key)}
        assert node._read([b"c1"], Message("get", "r1", typed_body("get", get))) == {"k": 1, "v": "a"}
        append(drivers["a"], a_entries[2:], a_entries[1])  # a's drop: b's entries follow at once
        assert node.status()["shards"]["b"]["name_wait"] is None
        assert node.store.shard("b").applied == b_entries[-1].tx_key
        table = node.store.catalog()["X"]
        assert "x" not in node.store.catalog() and table == X_OF_B
        assert node.store.scan(table, None, 10) == [{"id": "one", "n": 1}, {"id": "two", "n": 2}]
        get = {"table": "X", "key": "two", "min_key": list(b_entries[-1].tx_key)}
        assert node._read([b"c1"], Message("get", "r2", typed_body("get", get))) == {"id": "two", "n": 2}
        assert not node.stopped


def test_the_status_text_names_a_waiting_shard_and_what_to_do() -> None:
    from mnesite.cli.main import describe_name_wait

    held = {"tx_key": [1, 4], "name": "X", "held_by": "x", "held_by_shard": "a", "remedy": "drop it in shard a"}
    assert describe_name_wait("b", {"name_wait": held}) == (
        "WARNING: shard b: applying waits at entry (1, 4): it creates 'X', held here by 'x' of shard a; "
        "drop it in shard a"
    )
    assert describe_name_wait("b", {"name_wait": None}) is None


def test_a_copy_that_creates_a_name_another_shard_holds_is_refused_and_asked_again() -> None:
    """A snapshot install's or a bootstrap's table list (shard b's ``X``, ``tb`` with index ``IX``)
    meets a name shard a still holds here: it is refused (``CopyFailed``: the install or bootstrap is
    asked again) instead of raising out of the node's turn; with the names free it is the ops it was."""
    from mnesite.bootstrap.copy import CopyFailed, copy_schema_ops
    from mnesite.rlog.schema import shard_schema_ops_toward

    with_index = T_OF_B.changed_by(CreateIndexOp("IX", "tb", "b", ("w",)))
    held = {"x": X_OF_A, "ta": T_OF_A.changed_by(CreateIndexOp("ix", "ta", "a", ("v",)))}
    with pytest.raises(CopyFailed, match="creates 'X', held here by table 'x' of shard a"):
        copy_schema_ops(held, "b", (X_OF_B,))
    with pytest.raises(CopyFailed, match="creates 'IX', held here by index 'ix' of 'ta' of shard a"):
        copy_schema_ops(held, "b", (with_index,))
    free = {"ta": T_OF_A}
    ops = copy_schema_ops(free, "b", (X_OF_B, with_index))
    assert ops == shard_schema_ops_toward(free, "b", (X_OF_B, with_index))


def test_a_sequencer_whose_apply_waits_refuses_a_linearizable_read_it_has_not_applied(tmp_path) -> None:
    """A sequencer answers a linearizable read from its applied state, which is its committed state
    unless its apply waits at a name (a follower that waited and was then elected; two creates of one
    name): then the read is refused ``not_applied`` (the client retries) rather than answered stale."""
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.store import NameWait

    from tests.conftest import core_with_table, queued_to, run_turns_until

    with core_with_table(tmp_path / "data") as node:
        driver = node.shards["default"]
        applied = node.store.shard("default").applied
        # As if the next entry created a name another shard holds here (no sequencer proposes that).
        held = NameHeld("u", "u", "other")
        node.store.name_waits["default"] = NameWait(
            "default", TxKey(applied.generation, applied.counter + 1), "w1", held, 0, applied
        )
        write = {"ops": [{"op": "write", "table": "t", "row": {"id": 1, "v": "a"}}]}
        node._write([b"c1"], Message("transact", "w1", typed_body("transact", write)))
        run_turns_until(node, lambda: driver.consensus.committed_key > applied, "the write's commit")
        assert node.store.shard("default").applied == applied
        get = {"table": "t", "key": 1, "consistency": "linearizable"}
        with pytest.raises(RequestError) as refused:
            node._linearizable([b"c2"], Message("get", "r1", typed_body("get", get)))
        assert refused.value.code == "not_applied"
        del node.store.name_waits["default"]
        node._apply_up_to(driver, driver.consensus.committed_key)
        node._linearizable([b"c2"], Message("get", "r2", typed_body("get", get)))
        (answer,) = [m for m in queued_to(node, [b"c2"]) if m.request_id == "r2"]
        assert answer.body.result == {"id": 1, "v": "a"}, "answered once applied"


def test_a_tail_past_its_bound_keeps_a_prefix_reads_the_rest_back_and_refuses_writes() -> None:
    """``GuardTail``'s bound (entries and bytes): past it only rows-only entries leave memory, the
    driver reads them back from the log (``refill_after``), and the sequencer refuses writes."""
    from mnesite.core.guard_tail import GuardTail

    rows = [[WriteOp("X", {"id": str(i), "n": i})] for i in range(40)]
    log = chain("b", [[X_OF_B.to_op()], *rows[:19], [T_OF_B.to_op()], *rows[19:]])  # a schema change at 20
    tail: GuardTail[str] = GuardTail({}, entries_max=5, bytes_max=10**6)
    for entry in log:
        tail.add((entry,))
    assert len(tail.entries) == 5 and tail.keys == [e.tx_key for e in log[:5]]
    assert tail.spilled_after == log[4].tx_key and [e.tx_key for e in tail.spilled_schema] == [log[20].tx_key]
    assert tail.refuses_writes() and set(tail.catalog_over({})) == {"X", "tb"}, "schema past the bound seen"
    assert tail.covering(log[1].tx_key, 2) == log[2:4] and tail.covering(log[3].tx_key, 5) is None
    small = GuardTail[str]({}, entries_max=100, bytes_max=3 * log[1].size_bytes)
    small.add(tuple(log[1:10]))
    assert len(small.entries) == 3 and small.bytes <= small.bytes_max
    # Applied as far as the log goes in steps: refilled from the log until it is complete again.
    while tail.entries or not tail.complete:
        reached = tail.keys[-1] if tail.entries else log[-1].tx_key
        tail.committed(reached, {}, None)
        if (after := tail.refill_after()) is not None:
            tail.refilled([e for e in log if e.tx_key > after][:5], log[-1].tx_key)
        assert len(tail.entries) <= 5
    assert tail.complete and not tail.refuses_writes() and tail.spilled_schema == []
    # A truncation within what was not kept leaves it incomplete; before the kept end, complete.
    for entry in log[:8]:
        tail.add((entry,))
    tail.truncated(log[6].tx_key, {})
    assert not tail.complete and tail.spilled_after == log[4].tx_key
    tail.truncated(log[3].tx_key, {})
    assert tail.complete and tail.keys == [e.tx_key for e in log[:4]]


def test_a_follower_whose_shard_waits_keeps_its_tail_within_the_bound_and_converges(tmp_path) -> None:
    """A follower core whose shard b waits at a name while b's sequencer commits many more entries than
    the tail's bound: the tail keeps a prefix (entries and bytes within the bound), the others are
    read back from the log to serve them, and once a's drop applies b applies everything."""
    from mnesite.core.node import AgentStoreLogView

    from tests.conftest import follower_by_hand

    writes = [[WriteOp("X", {"id": str(i), "n": i})] for i in range(60)]
    a_entries, b_entries = chain("a", TABLE_NAME[0]), chain("b", [TABLE_NAME[1][0], *writes])

    with follower_by_hand(tmp_path / "data") as (node, _):

        def append(driver, entries: list, after) -> None:
            append_by_hand(node, driver, entries, after)

        drivers = two_shard_follower(node)
        tail = drivers["b"].tail
        tail.entries_max, tail.bytes_max = 8, 8 * b_entries[-1].size_bytes
        append(drivers["a"], a_entries[:2], None)
        for index in range(0, len(b_entries), 4):  # one commit after another while b waits
            append(drivers["b"], b_entries[index : index + 4], b_entries[index - 1] if index else None)
            assert len(tail.entries) <= 8 and tail.bytes <= tail.bytes_max
        assert "b" in node.store.name_waits and drivers["b"].consensus.committed_key == b_entries[-1].tx_key
        assert not tail.complete
        # Served to a follower or an agent all the same: from the log past the tail.
        view = drivers["b"].log_view
        assert [e.tx_key for e in view.entries_after(b_entries[2].tx_key, 100)] == [e.tx_key for e in b_entries[3:]]
        served = AgentStoreLogView(view).entries_after(b_entries[5].tx_key, 100)
        assert [e.tx_key for e in served] == [e.tx_key for e in b_entries[6:]]
        append(drivers["a"], a_entries[2:], a_entries[1])  # a's drop: b's entries follow
        assert node.store.name_waits == {} and node.store.shard("b").applied == b_entries[-1].tx_key
        assert tail.complete and tail.entries == []
        assert len(node.store.scan(node.store.catalog()["X"], None, 100)) == 60
        assert not node.stopped


def test_a_sequencer_whose_shard_waits_refuses_writes_past_the_tail_s_bound_then_converges(tmp_path) -> None:
    """A sequencer whose apply waits (as with two creates of one name) while clients write on: its
    tail stops at the bound, the writes past it are refused ``overloaded`` (nothing written: a guard
    could not see the entries past it), and once the wait ends everything applies."""
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.store import NameWait

    from tests.conftest import core_with_table, run_turns_until

    with core_with_table(tmp_path / "data") as node:
        driver = node.shards["default"]
        driver.tail.entries_max = 5
        applied = node.store.shard("default").applied
        held = NameHeld("u", "u", "other")
        node.store.name_waits["default"] = NameWait(
            "default", TxKey(applied.generation, applied.counter + 1), "w0", held, 0, applied
        )
        refused = []
        for i in range(20):
            write = {"ops": [{"op": "write", "table": "t", "row": {"id": i, "v": "a"}}]}
            try:
                node._write([b"c1"], Message("transact", f"w{i}", typed_body("transact", write)))
            except RequestError as error:
                refused.append(error)
            run_turns_until(node, lambda: not driver.held and driver.consensus.committed_key.counter > 0, "commit")
            assert len(driver.tail.entries) <= 5
        assert len(refused) == 15 and {error.code for error in refused} == {"overloaded"}
        assert "its apply waits" in str(refused[0]) and "nothing was written" in str(refused[0])
        run_turns_until(node, lambda: driver.consensus.committed_key == driver.tail.keys[-1], "the commits")
        assert node.store.shard("default").applied == applied
        del node.store.name_waits["default"]
        node._apply_up_to(driver, driver.consensus.committed_key)
        assert node.store.shard("default").applied == driver.consensus.committed_key and driver.tail.entries == []
        assert len(node.store.scan(node.store.catalog()["t"], None, 100)) == 5


def test_the_unapplied_tail_s_bounds_are_limits_keys_that_refuse_writes_once_the_tail_is_full(tmp_path) -> None:
    """The tail's bounds were constants (10,000 entries, 64 MiB): they are ``[limits]``
    ``unapplied_tail_entries_max`` and ``unapplied_tail_bytes_max``, bounded, read at a restart only, and
    reach every shard's tail. A sequencer whose apply waits refuses writes ``overloaded`` once its tail
    holds ``unapplied_tail_bytes_max`` (here 1 MiB: four writes of 300 KiB), then applies what it took."""
    from mnesite.rlog.config import ConfigError, keys_needing_restart, parse_config
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.store import NameWait

    from tests.conftest import core_with_table, run_turns_until

    default = parse_config({}).limits
    assert (default.unapplied_tail_entries_max, default.unapplied_tail_bytes_max) == (10_000, 64 * 1024**2)
    for key, bad, bounds in [
        ("unapplied_tail_entries_max", 99, r"100\.\.10000000"),
        ("unapplied_tail_entries_max", 10**7 + 1, r"100\.\.10000000"),
        ("unapplied_tail_bytes_max", 1024**2 - 1, r"1048576\.\.68719476736"),
        ("unapplied_tail_bytes_max", "64MiB", r"1048576\.\.68719476736"),
    ]:
        with pytest.raises(ConfigError, match=rf"\[limits\]\.{key} must be an integer in {bounds}"):
            parse_config({"limits": {key: bad}})
    smaller = parse_config({"limits": {"unapplied_tail_entries_max": 100}})
    assert keys_needing_restart(parse_config({}), smaller) == ["[limits].unapplied_tail_entries_max"]

    limits = {"unapplied_tail_entries_max": 500, "unapplied_tail_bytes_max": 1024**2}
    with core_with_table(tmp_path / "data", extra={"limits": limits}) as node:
        driver = node.shards["default"]
        assert (driver.tail.entries_max, driver.tail.bytes_max) == (500, 1024**2)
        applied = node.store.shard("default").applied
        held = NameHeld("u", "u", "other")  # as if the next entry created a name another shard holds here
        node.store.name_waits["default"] = NameWait(
            "default", TxKey(applied.generation, applied.counter + 1), "w0", held, 0, applied
        )
        refused = []
        for i in range(8):
            write = {"ops": [{"op": "write", "table": "t", "row": {"id": i, "v": "v" * 300_000}}]}
            try:
                node._write([b"c1"], Message("transact", f"w{i}", typed_body("transact", write)))
            except RequestError as error:
                refused.append(error)
            run_turns_until(node, lambda: not driver.held and driver.consensus.committed_key > applied, "commit")
        assert [error.code for error in refused] == ["overloaded"] * 4, "the fifth write on found the tail full"
        assert "at the bound of 500 entries and 1048576 bytes" in str(refused[0])
        assert node.store.shard("default").applied == applied
        del node.store.name_waits["default"]
        node._apply_up_to(driver, driver.consensus.committed_key)
        assert len(node.store.scan(node.store.catalog()["t"], None, 100)) == 4


def changes_page(node, request_id: str, after: dict, wait_ms: int = 0, tables: tuple = ()) -> dict:
    """A changefeed page of ``tables`` (none: every table) from ``after`` (shard: key) at a node driven
    by hand, or {} while the request is held."""
    from tests.conftest import queued_to

    positions = [{"shard": shard, "after": list(key)} for shard, key in after.items()]
    body = {"positions": positions, "wait_ms": wait_ms, "tables": list(tables)}
    node._dispatch_read([request_id.encode()], Message("changes", request_id, typed_body("changes", body)))
    answers = [m for m in queued_to(node, [request_id.encode()]) if m.request_id == request_id]
    assert len(answers) <= 1 and all(m.kind == "reply" for m in answers), answers
    return answers[0].body.result if answers else {}


def changes_of(page: dict, shard: str) -> list[tuple]:
    return [(r["tx_key"], r["op"], r["table"]) for r in page["records"] if r["shard"] == shard]


def test_a_replicant_s_changefeed_serves_a_waiting_shard_only_up_to_what_it_applied(tmp_path) -> None:
    """A replicant logs the entries of a shard whose apply waits at a name (its replica's key moves on)
    but applies none: its changefeed serves a shard up to the store's applied key (``StoreFeedReader``),
    so a consumer never sees a change it cannot then read. A request held on the shard is not woken by
    entries logged behind the wait; once the wait ends, it gets them and the table holds them."""
    from tests.conftest import queued_to, replicant_by_hand
    from tests.test_replicant_node import _unconnected_dealer

    a_entries, b_entries = chain("a", TABLE_NAME[0]), chain("b", TABLE_NAME[1])
    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica_a, replica_b = follow(node, "a"), follow(node, "b")
        push(node, replica_a, a_entries[:2])
        push(node, replica_b, b_entries[:1])  # waits at its create of X
        held = changes_page(node, "held", {"b": ZERO_KEY}, wait_ms=60_000, tables=("X",))
        assert held == {} and node.changes_statistics()["held"] == 1
        push(node, replica_b, b_entries[1:])  # logged behind the waiting entry
        assert replica_b.applied_key == b_entries[-1].tx_key and node.store.shard("b").applied == ZERO_KEY
        node.serve_changes()
        assert not queued_to(node, [b"held"]), "entries logged behind a wait wake no held request"
        page = changes_page(node, "now", {"a": ZERO_KEY, "b": ZERO_KEY})
        assert changes_of(page, "b") == [] and page["applied"]["b"] == [0, 0]
        assert changes_of(page, "a") == [([1, 1], "create_table", "x"), ([1, 2], "write", "x")]
        push(node, replica_a, a_entries[2:])  # a's drop: b's entries apply
        node.serve_changes()
        (answer,) = [m for m in queued_to(node, [b"held"]) if m.request_id == "held"]
        assert changes_of(answer.body.result, "b") == [([1, 1], "create_table", "X"), ([1, 2], "write", "X")]
        assert node.store.scan(node.store.catalog()["X"], None, 10) == [{"id": "one", "n": 1}]


def test_a_core_s_changefeed_serves_a_waiting_shard_only_up_to_what_it_applied(tmp_path) -> None:
    """As at a replicant: a follower core whose shard b waits at a name holds b's commits after the
    wait (committed key past the applied one, in its log) but serves b's changes up to its applied key
    only, and a request held on b gets them once a's drop lets them apply."""

    from tests.conftest import follower_by_hand, queued_to

    a_entries, b_entries = chain("a", TABLE_NAME[0]), chain("b", TABLE_NAME[1])

    with follower_by_hand(tmp_path / "data") as (node, _):

        def append(driver, entries: list, after) -> None:
            append_by_hand(node, driver, entries, after)

        drivers = two_shard_follower(node)
        append(drivers["a"], a_entries[:2], None)
        append(drivers["b"], b_entries[:1], None)  # waits at its create of X
        held = changes_page(node, "held", {"b": ZERO_KEY}, wait_ms=60_000, tables=("X",))
        assert held == {} and node.changes_statistics()["held"] == 1
        append(drivers["b"], b_entries[1:], b_entries[0])  # committed and logged behind the wait
        assert drivers["b"].consensus.committed_key == b_entries[-1].tx_key
        assert node.store.shard("b").applied == ZERO_KEY
        node.serve_changes()
        assert not queued_to(node, [b"held"]), "entries committed behind a wait wake no held request"
        page = changes_page(node, "now", {"b": ZERO_KEY}, tables=("X",))
        assert changes_of(page, "b") == [] and page["applied"]["b"] == [0, 0]
        append(drivers["a"], a_entries[2:], a_entries[1])  # a's drop: b's entries apply
        node.serve_changes()
        (answer,) = [m for m in queued_to(node, [b"held"]) if m.request_id == "held"]
        assert changes_of(answer.body.result, "b") == [([1, 1], "create_table", "X"), ([1, 2], "write", "X")]
        assert node.store.scan(node.store.catalog()["X"], None, 10) == [{"id": "one", "n": 1}]


def test_a_waiting_shard_is_tried_again_only_once_what_held_its_name_no_longer_does(tmp_path) -> None:
    """A waiting shard was tried again (its entries read from the log, or from the tail) after every
    schema change of another shard, to find the same wait again while its name stayed held. It is due
    only once what held the name lets it go; a change that leaves it held brings the wait up to date
    instead (a third shard that took the name over is the holder shown)."""
    x_of_c = define_table("x", "k", [["k", "INTEGER"]], "c")
    a_entries, b_entries = chain("a", TABLE_NAME[0]), chain("b", TABLE_NAME[1])
    c_entries = chain("c", [[define_table("other", "k", [["k", "INTEGER"]], "c").to_op()], [x_of_c.to_op()]])
    store = open_store(tmp_path, "store")
    with store.write_transaction():
        store.ensure_shard("c", 1)
        store.log_and_apply_verified(a_entries[:-1], 0)  # shard a holds x
        store.log_and_apply_verified(b_entries, 0)  # b's create of X waits
        store.log_and_apply_verified(c_entries[:1], 0)  # another shard's schema change, x still held
        assert store.name_waits_due() == [], "x is still held by a's table: no try"
        assert store.name_wait_due("b") is False
        store.log_and_apply_verified(c_entries[1:], 0)  # c's create of x waits too
        assert set(store.name_waits) == {"b", "c"} and store.name_waits_due() == []
        store.log_and_apply_verified(a_entries[-1:], 0)  # a's drop: the name is free
        assert store.name_waits_due() == ["b", "c"]
        store.apply_committed("c", c_entries[-1].tx_key)  # c applies its x first
        assert store.name_waits_due() == [], "x is held again, by c's table now"
        wait = store.name_waits["b"]
        assert (wait.tx_key, wait.held) == (b_entries[0].tx_key, NameHeld("X", "x", "c"))
        c_drop = chain("c", [*(list(entry.ops) for entry in c_entries), [DropTableOp("x", "c")]])[2:]
        store.log_and_apply_verified(c_drop, 0)
        assert store.name_waits_due() == ["b"]  # the remedy: drop the one of the shard not kept
        store.apply_committed("b", b_entries[-1].tx_key)
    assert store.name_waits == {} and store.shard("b").applied == b_entries[-1].tx_key
    assert store.scan(store.catalog()["X"], None, 10) == [{"id": "one", "n": 1}]
    store.close()


# -- a lifetime skipped: shard a's name taken by b's later create, applied here first ----------------


def apply_a(store: Store, entries: list, path: str, committed=None) -> None:
    """Shard a's entries arrive (as ``apply_b``); a core applies up to ``committed`` (all by default)."""
    with store.write_transaction():
        if path == "replicant":
            store.log_and_apply_verified(entries, 0)
            return
        store.append_entries(entries, 0)
        up_to = committed if committed is not None else entries[-1].tx_key
        if store.name_wait_may_end("a", up_to, entries if path == "held" else ()):
            held = store.entries_after("a", store.shard("a").applied, 100) if path == "held" else ()
            store.apply_committed("a", up_to, held)


def same_as_commit_order(store: Store, a_entries: list, b_entries: list, tmp_path) -> None:
    expected = open_store(tmp_path, "expected")
    with expected.write_transaction():
        expected.log_and_apply_verified(a_entries, 0)
        expected.log_and_apply_verified(b_entries, 0)
    assert store.name_waits == {}
    assert store.catalog() == expected.catalog()
    assert store.shards() == expected.shards()
    for table in expected.catalog().values():
        assert store.scan(table, None, 10) == expected.scan(table, None, 10)
    expected.close()


@pytest.mark.parametrize("path", ["held", "read back", "replicant"])
@pytest.mark.parametrize("ops_of", [TABLE_NAME, INDEX_NAME], ids=["table", "index"])
def test_a_create_whose_name_a_later_create_took_here_skips_its_lifetime(tmp_path, path, ops_of) -> None:
    """The known gap at its smallest (and for an index name): b's later create applied first keeps
    the name; a's create, use and drop of it are skipped, its other ops applied; the log stays whole."""
    b_entries, a_entries = chain("b", ops_of[1]), chain("a", ops_of[0])
    store = open_store(tmp_path, "store")
    apply_b(store, b_entries, path)
    apply_a(store, a_entries, path)
    same_as_commit_order(store, a_entries, b_entries, tmp_path)
    assert store.entries_after("a", ZERO_KEY, 10) == a_entries, "the log keeps the skipped ops"
    if ops_of is TABLE_NAME:
        assert store.key_column_at("a", "x", a_entries[1].tx_key) == "k", "the changefeed's key of a's writes"
    store.close()


# Shard a: a lifetime of x that also writes its own table ta, in the entries that create and drop x.
WITH_ANOTHER_TABLE = [
    [T_OF_A.to_op(), X_OF_A.to_op(), WriteOp("ta", {"k": 1, "v": "one"})],
    [WriteOp("x", {"k": 1, "v": "a"}), WriteOp("ta", {"k": 2, "v": "two"})],
    [DropTableOp("x", "a"), WriteOp("ta", {"k": 3, "v": "three"})],
]


@pytest.mark.parametrize("path", ["held", "read back", "replicant"])
def test_a_skipped_lifetime_applies_the_ops_on_other_tables_of_its_entries(tmp_path, path) -> None:
    b_entries, a_entries = chain("b", TABLE_NAME[1]), chain("a", WITH_ANOTHER_TABLE)
    store = open_store(tmp_path, "store")
    apply_b(store, b_entries, path)
    apply_a(store, a_entries, path)
    same_as_commit_order(store, a_entries, b_entries, tmp_path)
    assert [row["k"] for row in store.scan(store.catalog()["ta"], None, 10)] == [1, 2, 3]
    store.close()


@pytest.mark.parametrize("path", ["held", "read back", "replicant"])
def test_a_lifetime_waits_until_its_drop_commits_and_across_a_restart(tmp_path, path) -> None:
    """Until the drop is committed the create waits (an uncommitted drop may be truncated); a restart
    meanwhile loses the wait and finds it again; the drop's commit ends it."""
    b_entries, a_entries = chain("b", TABLE_NAME[1]), chain("a", TABLE_NAME[0])
    store = open_store(tmp_path, "store")
    apply_b(store, b_entries, path)
    if path == "replicant":  # a replicant is given committed entries only: the drop comes later
        apply_a(store, a_entries[:2], path)
    else:  # a core logs the drop, committed only up to the write
        apply_a(store, a_entries, path, committed=a_entries[1].tx_key)
    assert store.name_waits["a"].tx_key == a_entries[0].tx_key
    assert store.shard("a").applied == ZERO_KEY
    store.close()
    store = Store(str(tmp_path / "store.db"), synchronous="NORMAL")
    with store.write_transaction():
        store.apply_committed("a", a_entries[1].tx_key)  # a restart applies what it knows committed
    assert store.name_waits["a"].tx_key == a_entries[0].tx_key
    if path == "replicant":
        apply_a(store, a_entries[2:], path)
    else:
        with store.write_transaction():
            assert store.name_wait_may_end("a", a_entries[2].tx_key)
            store.apply_committed("a", a_entries[2].tx_key)
    same_as_commit_order(store, a_entries, b_entries, tmp_path)
    store.close()


@pytest.mark.parametrize("path", ["read back", "replicant"])
def test_a_lifetime_longer_than_the_look_ahead_waits_and_reads_no_more_of_the_log(tmp_path, path, monkeypatch) -> None:
    """Looking for the end of a name's lifetime read the shard's log from the waiting entry up to the
    committed key into memory, however long: it reads at most ``LOOK_AHEAD_ENTRIES_MAX`` entries (and
    bytes) past a batch, and a lifetime that ends further on is not skipped, the shard waits."""
    import mnesite.rlog.store as store_module

    monkeypatch.setattr(store_module, "LOOK_AHEAD_ENTRIES_MAX", 3)
    monkeypatch.setattr(store_module, "READ_BATCH_ENTRIES", 2)
    writes = [[WriteOp("x", {"k": k, "v": "a"})] for k in range(1, 5)]
    a_entries = chain("a", [TABLE_NAME[0][0], *writes, TABLE_NAME[0][-1]])  # create, 4 writes, drop
    b_entries = chain("b", TABLE_NAME[1])
    store = open_store(tmp_path, "store")
    apply_b(store, b_entries, path)
    apply_a(store, a_entries[:2], path)  # the create and a write: it waits, its end not committed yet
    assert store.name_waits["a"].tx_key == a_entries[0].tx_key
    read: list[int] = []
    entries_after = store.entries_after

    def counted(*args, **kwargs):
        batch = entries_after(*args, **kwargs)
        read.append(len(batch))
        return batch

    monkeypatch.setattr(store, "entries_after", counted)
    apply_a(store, a_entries[2:], path)  # the drop commits, 6 entries after the create: out of reach
    assert store.name_waits["a"].tx_key == a_entries[0].tx_key and store.shard("a").applied == ZERO_KEY
    assert sum(read[-2:]) <= 4, read  # the retry read two batches of two, and no more
    monkeypatch.setattr(store_module, "LOOK_AHEAD_ENTRIES_MAX", 10)  # within reach: skipped
    with store.write_transaction():
        # Cut at its bound: later commits do not try it again (each try would read the bound again).
        assert store.name_wait_may_end("a", a_entries[-1].tx_key) is False
        assert "beyond what a node reads ahead" in store.name_waits["a"].describe()
        store.name_waits.pop("a")  # as after a restart: the wait is in memory only
        store.apply_committed("a", a_entries[-1].tx_key)
    same_as_commit_order(store, a_entries, b_entries, tmp_path)
    store.close()
