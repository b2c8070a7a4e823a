"""The replicant node's own rules, without processes: held reads (``replicant.reads``: a read that
must see a key waits for the table that key's write created, instead of answering ``unknown_table``
before the create is applied) and dropped outgoing frames (counted, shown, logged)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from mnesite.replicant.reads import (
    GATHER_DONE,
    GATHER_FAILED,
    GATHER_WAITING,
    ReadIndexGather,
    WaitingRead,
    WaitingReads,
    shards_to_wait_on,
)
from mnesite.rlog import messages
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.errors import OverloadedError
from mnesite.rlog.messages import Message, MessageError, typed_body
from mnesite.rlog.schema import TableSchema
from mnesite.rlog.types import TxKey

from tests.conftest import ThreadNode, free_port, replicant_by_hand, thread_replicant, wait_until

pytestmark = pytest.mark.timeout(10)


@dataclass
class FakeReplica:
    applied: TxKey
    serving: bool = True

    def readable_at(self, key: TxKey) -> bool:
        return self.serving and self.applied >= key


class Held:
    """A held read with the driver's view of tables and replicas (what ``WaitingReads.ready`` is given)."""

    def __init__(self, table: str, targets: dict[str, TxKey]) -> None:
        self.read = WaitingRead("client", table, targets, deadline_ms=1_000)

    def ready(self, catalog: dict[str, TableSchema], replicas: dict[str, FakeReplica]) -> bool:
        table = catalog.get(self.read.table)
        return self.read.is_ready(
            table.shard if table else None,
            lambda shard, key: shard in replicas and replicas[shard].readable_at(key),
        )

    def describe(self) -> str:
        return self.read.describe()


def held(table: str, targets: dict[str, TxKey]) -> Held:
    return Held(table, targets)


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


def test_a_table_that_appears_in_a_shard_with_no_key_to_reach_is_answered_at_once() -> None:
    """Read-your-writes names a key per shard (``min_keys``): a read of a table not known yet waits on
    the shards the client wrote to; if the table turns out to be in another one, nothing holds it."""
    read = held("late", {"other": TxKey(3, 7)})
    replicas = {"default": FakeReplica(TxKey(1, 1)), "other": FakeReplica(TxKey(1, 1))}
    assert not read.ready({}, replicas)  # unknown: the client's write in "other" may have created it
    assert read.ready({"late": LATE}, replicas)  # it is in "default", where the client wrote nothing
    replicas["default"].serving = False
    assert not read.ready({"late": LATE}, replicas)  # still only once its shard serves reads


def test_a_known_table_waits_for_its_shard_only() -> None:
    read = held("late", {"default": TxKey(2, 1)})
    replicas = {"default": FakeReplica(TxKey(1, 99))}
    assert not read.ready({"late": LATE}, replicas)
    replicas["default"].applied = TxKey(2, 1)
    assert read.ready({"late": LATE}, replicas)
    assert read.describe() == "shard default did not reach (2, 1)"


def test_which_shards_a_read_waits_on() -> None:
    assert shards_to_wait_on("a", True, ["a", "b"]) == ["a"]
    assert shards_to_wait_on(None, True, ["b", "a"]) == ["a", "b"]  # unknown table, must see a key
    assert shards_to_wait_on(None, False, ["a"]) is None  # a local read of an unknown table: refused
    assert shards_to_wait_on(None, True, []) is None  # nothing replicated: nothing to wait for


def test_held_reads_are_bounded_answered_when_ready_and_expire() -> None:
    reads: WaitingReads[str] = WaitingReads(2)
    reads.hold("r1", "late", {"default": TxKey(1, 5)}, deadline_ms=100)
    reads.hold("r2", "late", {"default": TxKey(1, 9)}, deadline_ms=200)
    with pytest.raises(OverloadedError):
        reads.hold("r3", "late", {"default": TxKey(1, 1)}, deadline_ms=300)
    applied = {"default": TxKey(1, 6)}
    ready = reads.ready(lambda table: "default", lambda shard, key: applied[shard] >= key)
    assert [read.payload for read in ready] == ["r1"] and len(reads) == 1
    assert reads.expired(199) == [] and [read.payload for read in reads.expired(200)] == ["r2"]
    assert len(reads) == 0


def test_held_reads_that_become_ready_together_are_taken_out_in_one_pass() -> None:
    """``ready`` took the ready reads out with ``read not in ready``: every held read compared (a
    dataclass ``==``, down to its envelope and message) with every ready one. WAITING_READS_MAX
    (10,000) read-your-writes reads released by one push took about 30 s of the replicant's loop
    turn, in which it read no push, heartbeat or request. The reads are never compared now."""
    from mnesite.replicant.node import WAITING_READS_MAX

    class Payload:
        def __eq__(self, other: object) -> bool:
            raise AssertionError("held reads are compared")

        __hash__ = object.__hash__

    reads: WaitingReads[Payload] = WaitingReads(WAITING_READS_MAX)
    for i in range(WAITING_READS_MAX):
        reads.hold(Payload(), "t", {"default": TxKey(1, 5 + i % 2)}, deadline_ms=1_000)
    ready = reads.ready(lambda table: "default", lambda shard, key: key <= TxKey(1, 5))
    assert len(ready) == WAITING_READS_MAX // 2 and len(reads) == WAITING_READS_MAX // 2
    assert all(read.targets["default"] == TxKey(1, 6) for read in reads.reads)


def test_a_read_index_gather_waits_for_every_shard_and_decides_once() -> None:
    gather = ReadIndexGather(("a", "b"))
    assert gather.arrived("a", TxKey(1, 3)) == GATHER_WAITING
    assert gather.arrived("b", TxKey(2, 1)) == {"a": TxKey(1, 3), "b": TxKey(2, 1)}
    assert gather.arrived("b", TxKey(2, 2)) == GATHER_DONE  # a late duplicate changes nothing
    failed = ReadIndexGather(("a", "b"))
    assert failed.arrived("a", None) == GATHER_FAILED
    assert failed.arrived("b", TxKey(1, 1)) == GATHER_DONE  # refused once, never answered later


def test_dropped_outgoing_frames_are_counted_and_logged_a_line_a_second_the_last_burst_too(tmp_path, caplog) -> None:
    """zmq drops a frame when the receiver's queue is full; a dropped push costs a replicant a resync,
    so an operator must see it: counted in ``status`` (``sends_dropped``), at most a line a second.
    Regression: the frames dropped after the last line were never logged if no other frame was
    dropped after them; the node's next turn once that second is over says them (``warnings``)."""
    import logging

    ack = Message("push_ack", "a1", {"shard": "default", "agent": "a1", "applied": [1, 1]})
    line = (
        "dropped an outgoing frame (push_ack: the receiver's queue is full; %d so far): peers re-send, a "
        "replicant resynchronises after a dropped push"
    )

    def dropped() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.getMessage().startswith("dropped")]

    # ``full``: a send raises zmq.Again, as a full queue's does.
    with replicant_by_hand(tmp_path / "r") as node, _unconnected_dealer() as full:
        now = [0]
        node.warnings.clock = lambda: now[0]
        caplog.set_level(logging.WARNING, logger="mnesite.server")
        for _ in range(1000):
            node.queue(full, ack)
        node.flush()
        assert node.sends_dropped == 1000 and node.status()["sends_dropped"] == 1000
        assert dropped() == [line % 1]
        node.send_now(full, ack)  # a frame sent at once (a sequencer's append before its fsync): the same
        assert node.sends_dropped == 1001 and dropped() == [line % 1]
        # Turns of the node's loop (``turn``), nothing else arriving nor dropped: the burst is said once
        # its second is over.
        node.run_turn = lambda: None
        now[0] = 999
        node.turn()
        assert dropped() == [line % 1]
        now[0] = 1000
        node.turn()
        assert dropped()[1:] == [line % 1001 + " (and 999 more like it in the last 1000 ms)"]
        now[0] = 5000
        node.turn()
        assert len(dropped()) == 2, "nothing left to say"
        # A flood of three seconds, a frame every 10 ms: a line a second, each counting the rest.
        for now[0] in range(5000, 8000, 10):
            node.queue(full, ack)
            node.flush()
        assert dropped()[2:] == [
            line % 1002,
            line % 1102 + " (and 99 more like it in the last 1000 ms)",
            line % 1202 + " (and 99 more like it in the last 1000 ms)",
        ]


def test_protocol_violations_of_any_senders_log_a_line_a_second(tmp_path, caplog) -> None:
    """Every violation is counted; the log says at most a line a second of them whatever the sender
    (one reason, the sender named in the line: ``NodeServer.protocol_violation``), then the last one
    left out, with the count of the others, once the second is over."""
    import logging

    with replicant_by_hand(tmp_path / "r") as node:
        now = [0]
        node.warnings.clock = lambda: now[0]
        caplog.set_level(logging.WARNING, logger="mnesite.server")
        for sent in range(1000):
            node.protocol_violation(f"core{sent}", "shard default: a second sequencer in generation 3")
        assert node.protocol_violations == 1000
        assert [record.getMessage() for record in caplog.records] == [
            "protocol violation by core0: shard default: a second sequencer in generation 3 (1 so far)"
        ]
        assert len(node.warnings._reasons) == 1, "one reason, however many senders"
        now[0] = 1000
        node.warnings.flush()
        assert [record.getMessage() for record in caplog.records][1:] == [
            "protocol violation by core999: shard default: a second sequencer in generation 3 (1000 so far) "
            "(and 998 more like it in the last 1000 ms)"
        ]


# -- issue 20's three bugs found by reading: each test fails on the code before the fix ----------


def fence_question(replica) -> int:
    """The number of the read-fence question ``replica`` asked last (``FetchCommitted.question``)."""
    return replica._fence.question


def _linearizable_read_pending(node, request_id: str):
    from mnesite.replicant.node import Pending

    message = Message("get", request_id, typed_body("get", {"table": "t", "key": 1, "consistency": "linearizable"}))
    detail = {"envelope": [b"client"], "message": message, "shard": "default", "gather": ReadIndexGather(("default",))}
    return Pending("read_index", "core1", 0, "default", detail)


def _answers_to_the_client(node) -> list[Message]:
    return [message for _socket, envelope, message in node._outbox if envelope == [b"client"]]


def test_a_linearizable_read_whose_read_index_times_out_is_answered_with_the_clients_request_id(tmp_path) -> None:
    """It was answered with the replicant's own read_index request id (which the client does not
    accept, so it waited out its whole timeout) and with outcome_unknown, which a read never is."""
    with replicant_by_hand(tmp_path / "r") as node:
        node.pending["replicant-internal-1"] = _linearizable_read_pending(node, "client-7")
        node._expire(1)
        (answer,) = _answers_to_the_client(node)
        assert answer.request_id == "client-7"
        assert answer.kind == "error" and answer.body.code == "no_sequencer", answer


def test_a_core_refusing_a_read_index_is_passed_on_with_its_detail(tmp_path) -> None:
    with replicant_by_hand(tmp_path / "r") as node:
        pending = _linearizable_read_pending(node, "client-8")
        refusal = messages.error("replicant-internal-2", "no_sequencer", "election", {"sequencer": "core2"})
        node._on_answer(pending, refusal)
        (answer,) = _answers_to_the_client(node)
        assert (answer.request_id, answer.body.code, answer.body.detail) == (
            "client-8",
            "no_sequencer",
            refusal.body.detail,
        )


def test_a_malformed_list_tables_answer_fails_the_copy_and_not_the_loop_turn(tmp_path) -> None:
    from mnesite.replicant.node import Pending

    with replicant_by_hand(tmp_path / "r") as node:
        node._open_replica("default")
        for result in (
            ["not a table"],
            [{"table": "t"}],
            [{"table": 5, "key": "k", "columns": [], "shard": "default"}],
            7,
        ):
            # Each used to raise out of the turn (AttributeError, KeyError, SchemaError) for a list.
            node._on_answer(Pending("tables", "core1", 0, "default"), messages.reply("q", result))
        assert node.store.catalog() == {}, "nothing of a malformed answer was applied"


def test_the_acknowledgements_of_one_turn_go_out_once_per_agent_with_the_newest_applied_key(tmp_path) -> None:
    """Each push applied is acknowledged by the replica; the driver sends one push_ack per agent and
    turn, after the turn's commit, carrying the last applied key (it says all the earlier ones said)."""
    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        replica = node._open_replica("default")
        upstream = object()  # stands for core1's socket: only queued to, never sent on here
        node.core_sockets = {"core1": upstream}
        for agent, counter in (("core1-a", 2), ("core1-a", 5), ("core1-b", 3), ("core1-a", 7)):
            node._execute(replica, p.SendAck("core1", agent, TxKey(1, counter)))
        assert not [m for _s, _e, m in node._outbox if m.kind == "push_ack"], "nothing before the commit"
        node.before_send()
        acks = [(socket, message.body) for socket, _e, message in node._outbox if message.kind == "push_ack"]
        assert acks == [
            (upstream, {"shard": "default", "agent": "core1-a", "applied": [1, 7]}),
            (upstream, {"shard": "default", "agent": "core1-b", "applied": [1, 3]}),
        ]
        node._outbox.clear()
        node.before_send()
        assert node._outbox == []  # sent once


def test_the_collector_is_paused_while_a_push_is_handled_and_restored_after(tmp_path, monkeypatch) -> None:
    """A push's decoded rows live through its apply; with the cyclic collector on they are promoted
    until a full collection walks the heap (benchmarks/PROFILE.md). The driver pauses it for the push
    and restores it, also when the push fails, and keeps a collector someone else paused, paused."""
    import gc

    from mnesite.replicant.node import ReplicantNode
    from mnesite.rlog.server import collector_paused

    seen: list[bool] = []

    def on_push(self: ReplicantNode, body: object) -> None:
        seen.append(gc.isenabled())
        if body == "fails":
            raise MessageError("a push that fails")

    monkeypatch.setattr(ReplicantNode, "_on_push", on_push)
    with replicant_by_hand(tmp_path / "r") as node:
        assert gc.isenabled()
        node._dispatch([], Message("push", "p", "ok"))
        assert seen == [False] and gc.isenabled()
        with pytest.raises(MessageError):
            node._dispatch([], Message("push", "p", "fails"))
        assert seen == [False, False] and gc.isenabled()
        gc.disable()
        try:
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # paused by the caller: left paused
        finally:
            gc.enable()


def test_a_bootstrap_keeps_the_applied_key_on_disk_as_a_floor_across_a_restart_and_a_full_disk(tmp_path) -> None:
    """ResetShard's contract (rlog.replication): the driver keeps the applied key and persists the
    unknown digest. The store reset the position to genesis instead, so a replicant restarted during
    a bootstrap (or told DiskFull, which adopts the position on disk) forgot its floor: it could watch
    a core behind what it had applied, and with the genesis digest a core that never trimmed let it
    resume from [0, 0] over the half-copied tables and the spill of the aborted bootstrap."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.disk import DiskFull
    from mnesite.rlog.schema import define_table
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, WriteOp, make_entry

    table = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])
    entries = [make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [table.to_op()])]
    for counter in (2, 3):
        last = entries[-1]
        entries.append(
            make_entry("default", TxKey(1, counter), last.tx_key, last.digest, [WriteOp("t", {"k": counter})])
        )
    data_dir = tmp_path / "r"
    with replicant_by_hand(data_dir) as node:
        replica = node._open_replica("default")
        node._execute(replica, p.ApplyEntries(tuple(entries)))
        node.flush()
        floor = TxKey(1, 3)
        # A bootstrap begins: fenced, reset; a batch and a pushed entry are written, then the disk fills.
        for effect in (p.ReadFenceChanged(True), p.ResetShard()):
            node._execute(replica, effect)
        node._execute(replica, p.ApplyBatch("t", ({"k": 9, "v": "dirty"},)))
        node._execute(replica, p.SpillEntries((make_entry("default", TxKey(1, 11), TxKey(1, 10), b"\x01" * 32, []),)))
        node.flush()
        position = node.store.shard("default")
        assert (position.applied, position.digest) == (floor, p.UNKNOWN_DIGEST)
        assert node.store.verify_chain("default") == floor  # `mnesite check` still reads the position
        fresh = node._open_replica("default")
        full = DiskFull("disk full", position.applied, position.digest, True, 1, node.store.spilled_bytes("default"))
        fresh.step(full, node.clock_ms())
        assert (fresh.applied_key, fresh.applied_digest) == (floor, p.UNKNOWN_DIGEST)
    with replicant_by_hand(data_dir) as node:  # restarted in the middle of the bootstrap
        replica = node.replicas["default"]
        assert (replica.applied_key, replica.applied_digest) == (floor, p.UNKNOWN_DIGEST)
        assert replica.read_fenced
        # It never watches a core behind its floor, and asks for a bootstrap (the unknown digest).
        replica.step(p.Ticked(), replica.next_deadline_ms())
        behind = p.JournalAnswer(TxKey(1, 2), True, 0)
        assert replica.step(p.JournalsReceived((("core1", behind),)), node.clock_ms()) == []


def _unconnected_dealer():
    """A real DEALER that reaches no one (``IMMEDIATE``): what the driver sends on it is dropped as a
    full queue's would be (``zmq.Again``). A stand-in object must never reach ``send_frames``: pyzmq's
    compiled send does not check its receiver's type and reads the object as a socket (it crashed
    this file's test process, once in about a dozen runs under load)."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    return socket


def _queueing_dealer(sndhwm: int = 1000):
    """A real DEALER connected to a free port where nobody listens: it queues what is sent to it (no
    ``IMMEDIATE``), as the replicant's core sockets do while their core is away, up to ``sndhwm``
    frames (0: no bound)."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, sndhwm)
    socket.connect(f"tcp://127.0.0.1:{free_port()}")
    return socket


def test_a_full_disk_that_rolls_back_the_turn_that_opened_the_read_fence_fences_reads_again(tmp_path) -> None:
    """After a bootstrap the replica serves nothing until its applied key reaches the read fence. If
    the turn that reached it is rolled back for want of space, the disk holds an earlier position,
    over rows the replay has not healed yet, and still says 'fenced'; the replica took back the
    position (DiskFull) but kept its fence open, so it served those dirty rows as a committed state."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.schema import define_table
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, WriteOp, make_entry

    table = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])
    history = [make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [table.to_op()])]
    for counter in range(2, 7):
        last = history[-1]
        op = WriteOp("t", {"k": counter, "v": f"at {counter}"})
        history.append(make_entry("default", TxKey(1, counter), last.tx_key, last.digest, [op]))
    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica = node._open_replica("default")
        node._execute(replica, p.ApplyEntries((history[0],)))  # the table, and the position K0
        node.flush()
        k0, d0 = history[0].tx_key, history[0].digest
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 6), True, 0)),)))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", k0, d0, replica.watch_id))
        node._step(replica, p.TablesReceived("core1", ("t",), ("k",)))
        # The dirty read saw the write of entry 6.
        node._step(replica, p.BatchReceived("core1", "t", None, ({"k": 6, "v": "at 6"},), True))
        assert replica.mode is p.Mode.NORMAL and replica.read_fenced
        node.flush()
        # The read fence: (1, 6).
        node._step(replica, p.CommittedReceived("core1", TxKey(1, 6), fence_question(replica)))
        node.flush()
        assert not replica.readable()
        # One turn applies up to the fence (reads would open), then its commit fails: disk full.
        node._step(replica, p.PushReceived("core1", "a1", tuple(history[1:6]), TxKey(1, 6), True))
        assert replica.readable() and replica.applied_key == TxKey(1, 6)
        node.abandon_turn()
        node.disk.filled("database or disk is full", node.clock_ms())
        node.disk_filled()
        assert node.store.shard("default").applied == k0  # rolled back: the row of 6, not yet healed
        assert node.store.read_row(node.store.catalog()["t"], 6) == {"k": 6, "v": "at 6"}
        assert replica.applied_key == k0
        assert not replica.readable(), "a dirty copy at (1, 1) is served as if it were the committed state there"
        with pytest.raises(Exception, match="not_ready|cannot serve"):
            node._serving("default")


def test_a_turn_rolled_back_for_want_of_space_acknowledges_none_of_its_applies(tmp_path) -> None:
    """A push's acknowledgement is queued after the turn's commit (``before_send``). When that commit
    found the disk full, the turn's frames were dropped but its acknowledgements were kept for the next
    turn's flush: the core heard that entries were applied which the rollback had undone (its agent
    then pushes past them, and its retention counts on them)."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.schema import define_table
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, WriteOp, make_entry

    table = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])
    history = [make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [table.to_op()])]
    for counter in range(2, 5):
        last = history[-1]
        history.append(
            make_entry("default", TxKey(1, counter), last.tx_key, last.digest, [WriteOp("t", {"k": counter})])
        )
    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica = node._open_replica("default")
        k0, d0 = history[0].tx_key, history[0].digest
        node._execute(replica, p.ApplyEntries((history[0],)))
        node.flush()
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 4), True, 0)),)))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", k0, d0, replica.watch_id))
        node._step(replica, p.TablesReceived("core1", ("t",), ("k",)))
        node._step(replica, p.BatchReceived("core1", "t", None, (), True))
        node.flush()
        node._step(replica, p.CommittedReceived("core1", TxKey(1, 4), fence_question(replica)))
        node.flush()
        node._step(replica, p.PushReceived("core1", "a1", tuple(history[1:4]), TxKey(1, 4), True))
        assert replica.applied_key == TxKey(1, 4) and node._acks  # an acknowledgement of (1, 4) waits
        node.abandon_turn()  # the turn's commit found the disk full
        node.disk.filled("database or disk is full", node.clock_ms())
        node.disk_filled()
        assert node.store.shard("default").applied == k0
        queued: list[Message] = []
        node.queue = lambda socket, message: queued.append(message)  # type: ignore[method-assign]
        node.flush()  # the next turn
        acknowledged = [message.body["applied"] for message in queued if message.kind == "push_ack"]
        assert [1, 4] not in acknowledged, "an apply the rollback undid was acknowledged"


def test_linearizable_reads_are_refused_overloaded_when_requests_pile_up_and_never_starve_the_replicas(
    tmp_path,
) -> None:
    """A linearizable read asks a core for its read index: a pending request. It was neither counted
    against its connection's requests_outstanding_max nor refused when the pending table was full:
    past 10,000 it went unsent and unanswered (the client waited out its timeout), and the replicas'
    own requests (probes, watches, bootstrap batches) found the table full of client reads and were
    dropped: a flood of reads kept the replicant from failing over or bootstrapping."""
    from mnesite.replicant.node import PENDING_REQUESTS_MAX, Pending
    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _queueing_dealer(sndhwm=0)}  # queues every read index sent
        replica = node._open_replica("default")

        def read(envelope: bytes, request_id: str) -> None:
            body = typed_body("get", {"table": "t", "key": 1, "consistency": "linearizable"})
            node._dispatch([envelope], Message("get", request_id, body))

        # One connection: at most requests_outstanding_max of its reads wait for a read index.
        limit = node.config.limits.requests_outstanding_max
        for index in range(limit):
            read(b"one", f"r{index}")
        with pytest.raises(OverloadedError):
            read(b"one", "one too many")
        assert len(node.pending) == limit
        # Many connections: client reads stop short of the whole table; the replicas keep their room.
        node.pending.clear()
        node.outstanding.clear()
        for index in range(PENDING_REQUESTS_MAX):
            try:
                read(f"c{index}".encode(), "r")
            except OverloadedError:
                break
        else:
            pytest.fail("never refused: the client reads took the whole pending table")
        with pytest.raises(OverloadedError):
            read(b"late", "r")
        before = len(node.pending)
        node._execute(replica, p.ProbeJournals(("core1",)))
        assert len(node.pending) == before + 1, "the replica's own request is still sent"
        assert all(isinstance(pending, Pending) for pending in node.pending.values())


# -- linearizable reads and queries: their read indexes are bounded and always answered once -------


def _serve(node, envelope: list[bytes], message: Message) -> None:
    """What ``_serve_waiting`` does with one decoded request: dispatch it, refuse what it raises."""
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.schema import SchemaError

    try:
        node._dispatch(envelope, message)
    except (RequestError, SchemaError, OverloadedError) as error:
        node.refuse(envelope, message.request_id, error)


def _answer_read_indexes(node, committed: TxKey) -> None:
    """The cores confirm every read_index the node asked (as ``_receive_answers`` hands them on)."""
    for request_id in [r for r, pending in node.pending.items() if pending.purpose == "read_index"]:
        node._on_answer(node.pending.pop(request_id), messages.reply(request_id, {"committed": list(committed)}))


def test_a_linearizable_read_past_requests_outstanding_max_is_refused_and_never_raises_out_of_the_turn(
    tmp_path,
) -> None:
    """Its read index was asked without holding the request; the hold came when the answer arrived,
    in ``_on_answer``, where its OverloadedError escaped the loop turn and stopped the replicant."""
    with replicant_by_hand(tmp_path / "r") as node:
        node._open_replica("default")
        node.core_sockets = {"core1": _queueing_dealer(sndhwm=0)}  # queues every read index sent
        envelope = [b"client"]
        for i in range(node.config.limits.requests_outstanding_max):
            node.hold(envelope, f"held-{i}")  # this connection's other requests awaiting answers
        body = {"table": "later", "key": 1, "consistency": "linearizable"}
        _serve(node, envelope, Message("get", "client-9", typed_body("get", body)))
        _answer_read_indexes(node, TxKey(1, 0))  # raised OverloadedError here
        answers = _answers_to_the_client(node)
        assert [(a.request_id, a.kind, a.body.code) for a in answers] == [("client-9", "error", "overloaded")]
        assert "client-9" not in node.outstanding.get(b"client", set())


def test_a_linearizable_read_whose_read_index_cannot_be_asked_is_answered_overloaded(tmp_path) -> None:
    """With the replicant's pending requests full, the read index was not sent and nothing was
    recorded: the read was never answered (the client waited out its timeout), and client reads could
    take every pending place the replicas' own requests (watch, fence, batches) need."""
    from mnesite.replicant.node import PENDING_REQUESTS_MAX, Pending

    with replicant_by_hand(tmp_path / "r") as node:
        node._open_replica("default")
        node.core_sockets = {"core1": _queueing_dealer(sndhwm=0)}  # queues every read index sent
        envelope = [b"client"]
        body = {"table": "later", "key": 1, "consistency": "linearizable"}
        asked = 0
        for i in range(PENDING_REQUESTS_MAX):
            _serve(node, [f"client-{i}".encode()], Message("get", f"r{i}", typed_body("get", body)))
            if _answers_to_the_client_of(node, f"client-{i}".encode()):
                break
            asked += 1
        assert asked < PENDING_REQUESTS_MAX, "client read indexes took every pending place"
        (refusal,) = _answers_to_the_client_of(node, f"client-{asked}".encode())
        assert (refusal.kind, refusal.body.code) == ("error", "overloaded")
        # The replica's own requests still find a place.
        room = PENDING_REQUESTS_MAX - len(node.pending)
        assert room > 0
        node._request("core1", "watch", {"shard": "default"}, Pending("watch", "core1", 0, "default"))
        assert len(node.pending) == PENDING_REQUESTS_MAX - room + 1
        _serve(node, envelope, Message("get", "client-x", typed_body("get", body)))
        (answer,) = _answers_to_the_client(node)
        assert (answer.request_id, answer.body.code) == ("client-x", "overloaded")


def _answers_to_the_client_of(node, identity: bytes) -> list[Message]:
    return [message for _socket, envelope, message in node._outbox if envelope == [identity]]


def test_a_core_that_reports_more_shards_than_a_node_may_hold_opens_no_more_than_shards_max(tmp_path) -> None:
    """A core's journal answer is untrusted input: a replicant opened a replica (its state, timers and
    requests) for every well-named shard a core said it had, so a hostile or broken core could make it
    open any number. No core holds more than SHARDS_MAX shards: a replicant opens no more either."""
    from mnesite.replicant.node import Pending
    from mnesite.rlog.limits import SHARDS_MAX

    with replicant_by_hand(tmp_path / "r") as node:
        shard = {"committed": [1, 1], "hears_sequencer": True, "agents": 0}
        result = {"shards": {f"s{index}": shard for index in range(SHARDS_MAX + 50)}}
        node._on_answer(Pending("discover", "core1", node.clock_ms() + 1000), messages.reply("d-1", result))
        assert len(node.replicas) == SHARDS_MAX
        # A later answer naming still more opens none of them.
        more = {"shards": {f"t{index}": shard for index in range(10)}}
        node._on_answer(Pending("discover", "core1", node.clock_ms() + 1000), messages.reply("d-2", more))
        assert len(node.replicas) == SHARDS_MAX


def test_a_request_of_an_earlier_bootstrap_attempt_expiring_does_not_fail_the_next_attempt(tmp_path) -> None:
    """The driver's pending list_tables of a failed attempt expired after the next attempt began on
    the same core, and its RequestFailed failed that attempt too. The driver now passes the attempt
    (the replica's watch_id when the request was sent), and the replica drops a stale one."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica = node._open_replica("default")
        committed = p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 5), True, 0)),))

        def bootstrap_attempt(at_ms: int) -> None:
            now[0] = at_ms
            replica.step(p.Ticked(), at_ms)
            replica.step(committed, at_ms)
            accepted = p.WatchAccepted("core1", "a1", "bootstrap", ZERO_KEY, GENESIS_DIGEST, replica.watch_id)
            for effect in replica.step(accepted, at_ms):
                node._execute(replica, effect)  # ResetShard, then FetchTables: a pending list_tables

        base = node.clock_ms()  # the replica was opened on the node's clock, which the test now moves
        now = [base]
        node.clock_ms = lambda: now[0]
        bootstrap_attempt(base)
        first_attempt = replica.watch_id
        (stale,) = [pending for pending in node.pending.values() if pending.purpose == "tables"]
        assert stale.watch_id == first_attempt
        replica.step(p.RequestFailed("core1", "refused", first_attempt), base + 1)
        assert replica.mode is p.Mode.DISCONNECTED
        bootstrap_attempt(base + 60_000)
        assert replica.mode is p.Mode.BOOTSTRAP and replica.watch_id != first_attempt
        stale.deadline_ms = 0
        node.pending = {"stale": stale}
        now[0] = base + 60_001
        node._expire(now[0])
        assert replica.mode is p.Mode.BOOTSTRAP, replica.status().last_error


def test_a_write_forwarded_again_on_a_new_connection_frees_the_earlier_connections_place(tmp_path) -> None:
    """A client that hears nothing resends the same request id on a new connection. The replicant's
    pending forward was replaced silently: the earlier connection was never answered and its place
    among requests_outstanding_max stayed held for good (the forward's timeout, 10 s, outlasts the
    client's). It is told outcome_unknown now (core.outcome rule 4); the core's answer goes to the resend."""
    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _queueing_dealer()}
        body = typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]})
        node._forward([b"first"], Message("transact", "w-1", body))
        node._forward([b"second"], Message("transact", "w-1", body))
        assert b"first" not in node.outstanding and set(node.outstanding[b"second"]) == {"w-1"}
        answers = [(to, m.kind, m.body.code) for _s, to, m in node._outbox if to in ([b"first"], [b"second"])]
        assert answers == [([b"first"], "error", "outcome_unknown")]
        assert [pending.detail["envelope"] for pending in node.pending.values()] == [[b"second"]]


@pytest.mark.parametrize(
    ("kind", "body", "purpose"),
    [
        ("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}, "forward"),
        ("get", {"table": "later", "key": 1, "consistency": "linearizable"}, "read_index"),
    ],
)
def test_a_request_that_could_not_be_sent_to_a_core_is_answered_at_once(tmp_path, kind, body, purpose) -> None:
    """Regression: a replicant queued a write for its core without checking that it could be sent;
    one dropped at the send (its queue to the core full, or a failed socket) was answered only when
    its forward timed out, 10 s later, as outcome_unknown. It is sent at once now, and one that could
    not be sent is answered no_sequencer, nothing was sent, as a core answers a write it cannot send
    to its sequencer; nothing stays pending or held. One that went out waits for the core's answer.
    A linearizable read's read index went the same way (queued unchecked, answered at its timeout)
    until the twenty-sixth session."""
    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}  # every send to it is dropped (zmq.Again)
        node._open_replica("default")
        node._dispatch([b"client"], Message(kind, "r-1", typed_body(kind, body)))
        answers = [
            (m.request_id, m.kind, m.body.code, m.body.message) for _s, to, m in node._outbox if to == [b"client"]
        ]
        assert len(answers) == 1 and answers[0][:3] == ("r-1", "error", "no_sequencer"), answers
        assert "core core1 cannot be reached" in answers[0][3] and "nothing was sent" in answers[0][3]
        assert node.pending == {} and b"client" not in node.outstanding
        node.core_sockets["core1"].close(0)
        node.core_sockets["core1"] = _queueing_dealer()  # no peer yet: zmq queues what is sent
        node._dispatch([b"client"], Message(kind, "r-2", typed_body(kind, body)))
        assert [pending.purpose for pending in node.pending.values()] == [purpose]
        assert set(node.outstanding[b"client"]) == {"r-2"}


def test_a_table_list_of_an_earlier_bootstrap_changes_no_table_definition(tmp_path) -> None:
    """A bootstrap takes the tables as its core lists them (``schema_ops_toward``: indexes created and
    dropped), and the replay from K0 brings only later changes. A table list asked by a failed
    bootstrap, answered once the next one on the same core had taken its own, dropped an index that
    list no longer knew of, created before K0, so nothing would create it again."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.schema import IndexSchema, define_table

    now = [1_000]
    with replicant_by_hand(tmp_path / "r") as node:
        node.clock_ms = lambda: now[0]
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica = node._open_replica("default")

        def bootstrap() -> Any:
            node._step(replica, p.Ticked())
            node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 6), True, 0)),)))
            node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id))
            asked = [pending for pending in node.pending.values() if pending.purpose == "tables"]
            return asked[-1]

        def answer(pending: Any, tables: list[TableSchema]) -> None:
            request_id = next(rid for rid, one in node.pending.items() if one is pending)
            del node.pending[request_id]
            reply = messages.decode(messages.encode(messages.reply(request_id, [t.to_json() for t in tables])))
            node._on_answer(pending, reply)

        earlier = bootstrap()
        node._step(replica, p.RequestFailed("core1", "the agent went silent", replica.watch_id))
        assert replica.mode is p.Mode.DISCONNECTED
        now[0] += 60_000
        current = bootstrap()
        assert current.watch_id == replica.watch_id != earlier.watch_id
        plain = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])
        indexed = TableSchema(plain.name, plain.shard, plain.key_column, plain.columns, (IndexSchema("by_v", ("v",)),))
        answer(current, [indexed])
        assert node.store.catalog()["t"].indexes == indexed.indexes
        answer(earlier, [plain])  # read before this bootstrap's K0, when by_v did not exist yet
        assert node.store.catalog()["t"].indexes == indexed.indexes, "a stale table list dropped an index"


def test_status_says_the_digest_is_unknown_while_a_bootstrap_has_reset_the_shard(tmp_path) -> None:
    """From a bootstrap's reset until its replay the replica's digest is unknown (``UNKNOWN_DIGEST``):
    its rows are being copied. ``status`` showed the genesis digest at the applied key instead, a
    position no core ever had, as if the replica held a divergent history."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.types import GENESIS_DIGEST

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        replica = node._open_replica("default")
        assert node.status()["shards"]["default"]["digest"] == GENESIS_DIGEST.hex()  # a fresh shard: genesis
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 6), True, 0)),)))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id))
        assert replica.applied_digest == p.UNKNOWN_DIGEST
        assert node.status()["shards"]["default"]["digest"] is None
        assert node.status()["shards"]["default"]["hears_sequencer"] is True  # as core1's journal answer said


def test_a_core_s_stopping_answer_is_relayed_as_no_sequencer(tmp_path) -> None:
    """The replicant relayed a stopping core's "stopping" (it did nothing with the request) as it was:
    the client took it for the replicant's own shutdown, never asked it again in the call, and a client
    of that one endpoint gave up at once instead of retrying (the replicant asks another core next)."""
    from mnesite.replicant.node import Pending

    with replicant_by_hand(tmp_path / "r") as node:
        stopping = messages.error("w-1", "stopping", "core core1 is shutting down")
        node._on_answer(Pending("forward", "core1", 0, detail={"envelope": [b"client"]}), stopping)
        node._on_answer(_linearizable_read_pending(node, "client-9"), messages.error("ri-1", "stopping", "gone"))
        answers = _answers_to_the_client(node)
        assert [(m.request_id, m.body.code) for m in answers] == [("w-1", "no_sequencer"), ("client-9", "no_sequencer")]


@contextlib.contextmanager
def replicant_serving_t(tmp_path: Path) -> Iterator[tuple[str, str, Client]]:
    """A core (a thread) with table t holding row 1 and a replicant of it (a thread) once it serves t:
    yields the core's endpoint, the replicant's and a client of it (1 s timeout, 1 retry); stops both after."""
    core = ThreadNode(tmp_path / "core")
    try:
        with core.client(timeout_ms=3000) as writer:
            writer.create_table("t", "id", [("id", "INTEGER")])
            writer.put("t", {"id": 1})
        with (
            thread_replicant(tmp_path / "r", core.endpoint) as endpoint,
            Client(endpoint, timeout_ms=1000, retries=1) as client,
        ):

            def serves() -> bool:
                try:
                    return client.get("t", 1) == {"id": 1}
                except MnesiteError:  # unknown_table, not_ready: not copied yet
                    return False

            wait_until(serves, 15, "the replicant to serve table t")
            yield core.endpoint, endpoint, client
    finally:
        core.stop()


@pytest.mark.timeout(30)
def test_a_read_waiting_for_a_key_the_replicant_never_reaches_gets_its_timeout_answer(tmp_path) -> None:
    """A replicant holds a read that must see a key (``after_tx_key``, read-your-writes) for the
    ``wait_ms`` it carries, then answers ``timeout`` naming the key. The client asked for a wait as long
    as its own attempt's timeout: that answer always came after the client had given the attempt up as
    silent; it re-sent the read and, after every retry, said the node "did not answer" (3x the timeout
    by default). It now asks for a shorter wait and hears the replicant's answer."""
    from mnesite.rlog.client import RemoteError, Unavailable

    with replicant_serving_t(tmp_path) as (_, _, client):
        with pytest.raises(RemoteError) as info:
            client.get("t", 1, after_tx_key=TxKey(99, 1))
        assert not isinstance(info.value, Unavailable), info.value
        assert info.value.code == "timeout" and "(99, 1)" in str(info.value).replace("[99, 1]", "(99, 1)")


def test_a_replicant_whose_cores_answer_with_logs_it_cannot_read_says_so_not_that_they_are_silent(tmp_path) -> None:
    """Its status said "core1 did not answer" of a core that answered with a log at a cluster version
    this replicant does not read (rlog.versions): the operator looked for a network fault instead of
    upgrading the replicant. The probe now keeps why (rlog.replication.unreadable_log)."""
    from mnesite.replicant.node import Pending, Probe
    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        shard = {"committed": [1, 1], "hears_sequencer": True, "agents": 0}
        node._on_answer(
            Pending("discover", "core1", node.clock_ms() + 1000), messages.reply("d", {"shards": {"s": shard}})
        )
        replica = node.replicas["s"]
        # It probes the cores' journals (the machine's effect; the driver's probe, without a socket).
        (probe,) = [e for e in replica.step(p.Ticked(), node.clock_ms()) if isinstance(e, p.ProbeJournals)]
        node.probes["s"] = Probe(probe.cores, {}, node.clock_ms() + 1000)
        newer = {"shards": {"s": {**shard, "cluster_version": 3}}}
        node._on_answer(Pending("probe", "core1", node.clock_ms() + 1000, "s"), messages.reply("j", newer))
        error = replica.status().last_error
        assert "core1 did not answer" not in error
        assert "core1 answered, but its log of shard s is at cluster version 3" in error


def test_a_journal_answer_to_an_earlier_probe_is_not_counted_in_a_later_one(tmp_path) -> None:
    """Regression: a probe that timed out left its journal requests pending (a request lives
    ``REQUEST_TIMEOUT_MS``, a probe ``probe_timeout_ms``), and a late answer to one was counted in the
    shard's next probe: that probe could end on it, with what the core said before the replica gave up
    on it (its committed key, whether it heard the sequencer then). Each answer now counts only in the
    probe that asked (``Pending.probe_id``)."""
    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        base = node.clock_ms()
        now = [base]
        node.clock_ms = lambda: now[0]
        replica = node._open_replica("default")

        def probe(at_ms: int) -> Any:
            now[0] = at_ms
            node._step(replica, p.Ticked())
            (asked,) = [pending for pending in node.pending.values() if pending.purpose == "probe"]
            return asked

        stale = probe(base)
        now[0] = node.probes["default"].deadline_ms
        node._expire(now[0])  # the probe gives up on core1; its request is still pending
        assert "default" not in node.probes and "core1 did not answer" in replica.status().last_error
        node.pending = {}
        fresh = probe(node.clock_ms() + 60_000)
        assert "default" in node.probes
        earlier = {"shards": {"default": {"committed": [1, 4], "hears_sequencer": True, "agents": 0, "generation": 1}}}
        node._on_answer(stale, messages.reply("stale", earlier))
        assert node.probes["default"].answers == {}, "the earlier probe's answer is not this probe's"
        assert replica.watch_id is None
        later = {"shards": {"default": {"committed": [1, 9], "hears_sequencer": True, "agents": 0, "generation": 1}}}
        node._on_answer(fresh, messages.reply("fresh", later))
        assert "default" not in node.probes and replica.watch_id is not None  # this probe's answer: a watch


def test_a_bootstrap_takes_the_shard_s_tables_as_listed_even_after_a_drop_or_a_re_creation(tmp_path) -> None:
    """A replicant away long enough to bootstrap may find a table of its shard dropped on the cores,
    or dropped and created again with another key. The bootstrap only added the listed columns and
    indexes to the tables it held: a dropped table stayed (empty, readable, and no entry after K0
    would ever drop it), and a re-created one kept its old key column: its copied rows were stored
    under keys SQLite made up (an INTEGER key; a TEXT one failed the copy, NOT NULL, at every
    attempt) and a read by their real key found nothing, while the cores had them."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.schema import define_table

    with replicant_by_hand(tmp_path / "r") as node:
        node.clock_ms = lambda: 1_000
        node.core_sockets = {"core1": _queueing_dealer()}  # no peer yet: zmq queues what is sent
        old = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])
        gone = define_table("gone", "k", [["k", "INTEGER"]])
        with node.store.write_transaction():
            node.store.apply_ops((old.to_op(), gone.to_op()))
            node.store.write_rows("t", [{"k": 1, "v": "old"}])
        replica = node._open_replica("default")
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 6), True, 0)),)))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id))
        (asked,) = [pending for pending in node.pending.values() if pending.purpose == "tables"]
        request_id = next(rid for rid, one in node.pending.items() if one is asked)
        del node.pending[request_id]
        created_again = define_table("t", "id", [["id", "TEXT"], ["w", "BLOB"]])
        node._on_answer(asked, messages.reply(request_id, [created_again.to_json()]))
        assert node.store.catalog() == {"t": created_again}
        node.flush()
        (batch,) = [pending for pending in node.pending.values() if pending.purpose == "batch"]
        request_id = next(rid for rid, one in node.pending.items() if one is batch)
        del node.pending[request_id]
        answer = {"rows": [{"id": "a", "w": b"\x00"}], "done": True, "rows_total": 1}
        node._on_answer(batch, messages.reply(request_id, answer))
        node.flush()
        assert replica.mode is p.Mode.NORMAL, replica.status().last_error
        assert node.store.read_row(node.store.catalog()["t"], "a") == {"id": "a", "w": b"\x00"}


@pytest.mark.parametrize("request_kind", ["journal", "watch", "list_tables", "bootstrap_batch"])
def test_a_replica_s_request_the_full_pending_table_drops_fails_at_once_saying_why(tmp_path, request_kind) -> None:
    """Regression: with PENDING_REQUESTS_MAX requests pending, ``_request`` dropped a request with a log
    line and said it was sent: the replica waited for an answer that could not come (a watch, a table
    list, a bootstrap batch: its failure timeout; a probe: the probe's) and its status told nothing.
    The replica is told now, this turn: the request failed, and why."""
    from mnesite.replicant.node import PENDING_REQUESTS_MAX, Pending
    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _queueing_dealer()}  # no peer yet: zmq queues what is sent
        replica = node._open_replica("default")
        steps = [
            ("journal", p.Ticked()),
            ("watch", p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 6), True, 0)),))),
            ("list_tables", None),  # the watch's answer, made once its watch_id is known
            ("bootstrap_batch", p.TablesReceived("core1", ("t",), ("k",))),
        ]
        for kind, event in steps:
            if kind == request_kind:
                far = node.clock_ms() + 60_000
                for index in range(PENDING_REQUESTS_MAX - len(node.pending)):
                    node.pending[f"other-{index}"] = Pending("discover", "core1", far)
            if event is None:
                event = p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id)
            node._step(replica, event)
            if kind == request_kind:
                break
        assert len(node.pending) == PENDING_REQUESTS_MAX, "the request was not dropped: the test is stale"
        # It no longer says "sent" (None) for what it dropped: a client's read index is refused overloaded.
        dropped = node._request("core1", "journal", {}, Pending("discover", "core1", 0))
        assert isinstance(dropped, OverloadedError)
        node._expire(node.clock_ms())  # this turn's timers: nothing of the node's own has expired
        if request_kind == "journal":
            assert "default" not in node.probes, "the probe waited for answers to requests never sent"
            error = replica.status().last_error or ""
            assert error.startswith("no core qualifies")
            # What happened, not "core1 did not answer": it was never asked.
            assert "core1 was not asked (" in error and "journal to core1 not sent" in error, error
            return
        assert replica.mode is p.Mode.DISCONNECTED and not replica.waits_for_watch_answer
        error = replica.status().last_error or ""
        assert f"requests to the cores are pending at replicant1 (PENDING_REQUESTS_MAX {PENDING_REQUESTS_MAX})" in error
        assert f"{request_kind} to core1 not sent" in error


def _watching(node, committed: TxKey):
    """The replica of shard default on an offline ``node``, its watch sent to core1 (committed at
    ``committed``), over a socket that queues what is sent (no peer yet)."""
    from mnesite.rlog import replication as p

    node.core_sockets = {"core1": _queueing_dealer()}
    replica = node._open_replica("default")
    node._step(replica, p.Ticked())
    node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(committed, True, 0)),)))
    return replica


def test_a_bootstrap_batch_whose_send_fails_fails_at_once_saying_why(tmp_path) -> None:
    """Regression: a bootstrap batch is sent at once (``_request(..., at_once=True)``); when that send
    failed (the core's queue full, no connection), its pending entry stayed and the copy waited out
    REQUEST_TIMEOUT_MS (3 s) for an answer that could not come, while the full-pending-table case
    already failed at once. The replica is now told in this turn, with the reason, and fails over."""
    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        replica = _watching(node, TxKey(1, 6))
        accepted = p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id)
        node._step(replica, accepted)
        node.core_sockets["core1"].close(0)
        node.core_sockets["core1"] = _unconnected_dealer()  # a send raises zmq.Again, as a full queue's does
        node._step(replica, p.TablesReceived("core1", ("t",), ("k",)))  # asks the first batch: not sent
        assert not any(pending.purpose == "batch" for pending in node.pending.values()), "waits for no answer"
        node._expire(node.clock_ms())  # this turn's timers, not REQUEST_TIMEOUT_MS later
        assert replica.mode is p.Mode.DISCONNECTED
        error = replica.status().last_error or ""
        assert "request to core1 failed" in error and "its queue is full" in error, error


def test_a_probe_dropped_at_send_ends_at_once_and_says_it_was_not_sent(tmp_path) -> None:
    """Regression: a probe's journal request dropped at the turn's send (the core's queue full) waited
    out the probe's timeout, and ``last_error`` then said "core1 did not answer" although nothing was
    asked; the reason was only in the rate-limited "dropped N outgoing frame(s)" log line. The probe
    now ends in the next turn's timers and ``last_error`` says the request was not sent, and why."""
    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}  # a send raises zmq.Again, as a full queue's does
        replica = node._open_replica("default")
        node._step(replica, p.Ticked())  # ProbeJournals: one journal request, queued for the turn's send
        assert "default" in node.probes
        node.flush()  # dropped at send
        assert not any(pending.purpose == "probe" for pending in node.pending.values()), "waits for no answer"
        node._expire(node.clock_ms())  # the next turn's timers, not probe_timeout_ms later
        assert "default" not in node.probes, "the probe waited for an answer to a request never sent"
        error = replica.status().last_error or ""
        assert "core1 was not asked (journal to core1 not sent: the receiver's queue is full)" in error, error
        assert "did not answer" not in error


def test_a_bootstrap_restarted_because_the_copy_outlasted_retention_is_logged_once_counted_and_kept(
    tmp_path, caplog
) -> None:
    """The sizing trap (``replicant.replica``): a copy whose full spill's last key the cores trimmed
    before it finished starts again, for ever under sustained writes, and looked like any bootstrap in
    the log and in ``status``. The driver now logs the restart once as a warning naming what to raise,
    shows ``bootstraps_outrun`` in ``status`` and persists it like ``bootstraps``."""
    import logging

    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        replica = _watching(node, TxKey(1, 30))
        replica._resuming_after_full_spill = TxKey(1, 3)  # the last copy's spill filled there (test_replica)
        with caplog.at_level(logging.INFO, logger="mnesite.replicant"):
            node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 30), b"d" * 32, replica.watch_id))
            node._step(replica, p.Ticked())
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "no longer holds (1, 3)" in warnings[0] and "retention_entries_max" in warnings[0]
        shard = node.status()["shards"]["default"]
        assert shard["bootstraps_outrun"] == 1 and "retention_entries_max" in shard["last_error"]
        node.flush()
        del node.replicas["default"]
        assert node._open_replica("default").status().bootstraps_outrun == 1, "not kept across a restart"


@pytest.mark.parametrize(
    "value",
    [
        "text",  # the table was dropped and created again with v TEXT after it was listed
        [1, 2],
        {"a": 1},
        2**63,  # msgpack carries it; a 64-bit INTEGER does not
    ],
)
def test_a_bootstrap_batch_row_the_listed_table_cannot_hold_fails_the_copy_not_the_node(tmp_path, value) -> None:
    """A batch's rows are untrusted, and an honest core sends rows of the table as it is at the batch:
    one dropped and created again with other column types after ``list_tables`` sends values the
    listed (STRICT) table refuses. ``ApplyBatch`` raised out of the loop turn (ConstraintError,
    TypeError, OverflowError) and the replicant process died; the copy now fails, saying why, and
    begins again (its next table list is the new one)."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.schema import define_table

    with replicant_by_hand(tmp_path / "r") as node:
        replica = _watching(node, TxKey(1, 6))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id))

        def answer(purpose: str, result: Any) -> None:
            (request_id,) = [rid for rid, pending in node.pending.items() if pending.purpose == purpose]
            node._on_answer(node.pending.pop(request_id), messages.reply(request_id, result))

        answer("tables", [define_table("t", "k", [["k", "INTEGER"], ["v", "INTEGER"]]).to_json()])
        answer("batch", {"rows": [{"k": 1, "v": 2}, {"k": 2, "v": value}], "done": True, "rows_total": 2})
        assert replica.mode is p.Mode.DISCONNECTED
        error = replica.status().last_error or ""
        assert "t.v" in error, error
        assert replica.status().read_fenced, "nothing of the failed copy is served"


@pytest.mark.timeout(60)
def test_cluster_members_at_a_replicant_says_it_has_none_and_names_the_core_it_watches(tmp_path) -> None:
    """Regression: ``cluster members`` at a replicant's endpoint answered ``bad_request: members is
    not a request``, which says neither that the node is a replicant nor which core to ask. It is
    now the wrong-role answer (``not_a_core``, exit 1) naming the core the replicant watches."""
    from click.testing import CliRunner
    from mnesite.cli.main import main

    with replicant_serving_t(tmp_path) as (core_endpoint, endpoint, client):
        with pytest.raises(MnesiteError) as refused:
            client.members()
        assert refused.value.code == "not_a_core"
        shown = CliRunner().invoke(main, ["cluster", "members", "--node", endpoint])
        assert shown.exit_code == 1, shown.output
        assert "replicant1 is a replicant: it has no membership" in shown.stderr
        assert f"it watches core core1 ({core_endpoint})" in shown.stderr
        assert f"mnesite cluster members --node {core_endpoint}" in shown.stderr


@pytest.mark.timeout(10)
def test_pushes_from_anyone_log_a_line_per_second_per_reason_not_a_line_each(tmp_path, caplog) -> None:
    """Regression: without [security] anyone who reaches a replicant's endpoint can send it pushes, and
    each one from an unknown core, or malformed, or rejected, logged a line of its own: a log flood."""
    import logging

    with replicant_by_hand(tmp_path / "r") as node:
        node._open_replica("default")
        # core1's socket, never connected: what a turn sends to it waits in its queue.
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        node.core_sockets = {"core1": dealer}
        now = [0]
        node.warnings.clock = lambda: now[0]  # the node's one ThrottledLog, which its turn flushes
        push = {"shard": "default", "agent": "x", "entries": [], "committed": [0, 0], "hears_sequencer": True}
        caplog.set_level(logging.INFO, logger="mnesite.replicant")
        for sent in range(1000):
            node._on_push(typed_body("push", {**push, "core": f"intruder{sent}"}))
            node._on_push(typed_body("push", {**push, "core": "core1", "agent": f"core1-{sent}"}))  # no such watch
        lines = [record.getMessage() for record in caplog.records]
        assert len(lines) == 2, lines
        assert {record.name for record in caplog.records} == {"mnesite.replicant"}  # said as a replicant's
        assert lines[0] == "push from unknown core 'intruder0' ignored"
        assert lines[1].startswith("shard default: rejected a push of agent core1-0 from core1: not the watched")
        assert node.pushes_rejected == {"default": 1000}, "every rejection is still counted"
        caplog.clear()
        now[0] = 1000  # a second later: one line again per reason, with the count of those left out
        node._on_push(typed_body("push", {**push, "core": "intruder"}))
        (line,) = [record.getMessage() for record in caplog.records]
        assert line == "push from unknown core 'intruder' ignored (and 999 more like it in the last 1000 ms)"
        # A final burst, and no line of its reason after it: the node's loop says it once its second is over.
        caplog.clear()
        for sent in range(5):
            node._on_push(typed_body("push", {**push, "core": f"late{sent}"}))
        assert caplog.records == []
        # Turns of the node's loop, nothing else arriving.
        node.socket = zmq.Context.instance().socket(zmq.ROUTER)  # never bound: nothing arrives (poll below)
        node.socket.setsockopt(zmq.LINGER, 0)
        node.poll = lambda timeout: {}

        def pushes() -> list[str]:
            said = [record.getMessage() for record in caplog.records]
            return [line for line in said if "push from" in line or "a push of" in line]

        now[0] = 1999
        node.turn()  # the rejections' second (from 0) is over, not the unknown cores' (from 1000)
        assert pushes() == [
            "shard default: rejected a push of agent core1-999 from core1: not the watched agent "
            "(and 998 more like it in the last 1999 ms)",
        ]
        now[0] = 2000
        node.turn()
        assert pushes()[1:] == ["push from unknown core 'late4' ignored (and 4 more like it in the last 1000 ms)"]


def test_a_throttled_log_says_a_final_bursts_count_at_the_next_flush_and_keeps_no_quiet_reason() -> None:
    """``ThrottledLog`` told the lines it left out only with the next line of their reason: a burst's
    last second was never said if none came. ``flush`` (each turn of the node's loop) logs the last
    line left out with the count of the others once the interval is over, and forgets quiet reasons."""
    import logging

    from mnesite.rlog.throttle import ThrottledLog

    logged: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logger = logging.getLogger("tests.throttled")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = Recorder()
    logger.addHandler(handler)
    try:
        now = [0]
        throttled = ThrottledLog(logger, interval_ms=1000, clock=lambda: now[0])
        throttled.flush()  # nothing to say
        throttled.log("a", logging.INFO, "a %d", 0)
        throttled.log("b", logging.INFO, "b %d", 0)
        for number in range(1, 4):
            now[0] = number * 100
            throttled.log("a", logging.INFO, "a %d", number)
        assert logged == ["a 0", "b 0"]
        now[0] = 999
        throttled.flush()  # the interval is not over
        assert logged == ["a 0", "b 0"]
        now[0] = 1000
        throttled.flush()
        assert logged == ["a 0", "b 0", "a 3 (and 2 more like it in the last 1000 ms)"]
        assert set(throttled._reasons) == {"a"}, "b had nothing left out: forgotten"
        # The line flush logged counts as that reason's line: the next within the interval waits.
        now[0] = 1500
        throttled.log("a", logging.INFO, "a %d", 4)
        now[0] = 2000
        throttled.flush()
        assert logged[3:] == ["a 4"]  # one left out: said alone
        now[0] = 3000
        throttled.flush()
        assert throttled._reasons == {} and throttled._flush_at_ms is None, "quiet: nothing kept"
        throttled.flush()
        assert len(logged) == 4
        # Without flush, the next line still says the count, as before.
        throttled.log("a", logging.INFO, "a %d", 5)
        now[0] = 3100
        throttled.log("a", logging.INFO, "a %d", 6)
        now[0] = 4100
        throttled.log("a", logging.INFO, "a %d", 7)
        assert logged[4:] == ["a 5", "a 7 (and 1 more like it in the last 1100 ms)"]
    finally:
        logger.removeHandler(handler)


def _changes_request(request_id: str, wait_ms: int) -> Message:
    body = {"positions": [{"shard": "default", "after": [0, 0]}], "wait_ms": wait_ms}
    return Message("changes", request_id, typed_body("changes", body))


def test_a_changefeed_request_held_at_a_replicant_is_answered_as_soon_as_a_bootstrap_of_its_shard_begins(
    tmp_path,
) -> None:
    """A ``changes`` request held at a replicant (caught up, waiting for its shard to move) waited out
    its whole ``wait_ms`` when the replicant began a new bootstrap of the shard: the bootstrap keeps
    the applied key (a floor), so nothing woke it, although nothing could come of the shard until the
    copy was done (and then from a new log start). It is now answered in the turn the bootstrap
    begins, with what a request asked at that moment gets (``not_ready``), so its consumer can go on
    at another node. A failover that only disconnects the shard (it resumes, most often) keeps it held."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.types import GENESIS_DIGEST

    with replicant_by_hand(tmp_path / "r") as node:
        clock = [node.clock_ms()]
        node.clock_ms = lambda: clock[0]
        replica = _watching(node, TxKey(0, 0))
        node._step(replica, p.WatchAccepted("core1", "a1", "resume", TxKey(0, 0), GENESIS_DIGEST, replica.watch_id))
        assert replica.readable()
        _serve(node, [b"client"], _changes_request("held-1", wait_ms=60_000))
        node.serve_changes()
        assert node.changes_statistics()["held"] == 1 and not _answers_to_the_client(node)
        # Its upstream fails: disconnected, the shard is not served, but a resume is likely: still held.
        node._step(replica, p.RequestFailed("core1", "gone", replica.watch_id))
        assert replica.mode is p.Mode.DISCONNECTED
        node.serve_changes()
        assert node.changes_statistics()["held"] == 1 and not _answers_to_the_client(node)
        # The next watch is answered with a bootstrap: answered in this turn, not 60 s later.
        clock[0] = replica.next_deadline_ms()
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 6), True, 0)),)))
        node._step(replica, p.WatchAccepted("core1", "a2", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id))
        assert replica.mode is p.Mode.BOOTSTRAP
        node.serve_changes()
        (answer,) = _answers_to_the_client(node)
        assert node.changes_statistics()["held"] == 0
        # The same answer as a request asked now.
        _serve(node, [b"other"], _changes_request("asked-now", wait_ms=60_000))
        (now,) = _answers_to_the_client_of(node, b"other")
        assert (answer.request_id, answer.kind) == ("held-1", "error")
        assert now.body.code == "not_ready"
        assert (answer.body.code, answer.body.message) == (now.body.code, now.body.message)
        assert "mode bootstrap" in answer.body.message


class _Spilling:
    """A replicant's shard ``default`` driven through bootstraps that spill ``history`` (``K0`` its first
    entry, committed its last), with a clock the test sets, across restarts of one data directory."""

    def __init__(self, data_dir: Path, entries: int = 6) -> None:
        from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, make_entry

        self.data_dir = data_dir
        self.history = [make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [])]
        for counter in range(2, entries + 1):
            last = self.history[-1]
            self.history.append(make_entry("default", TxKey(1, counter), last.tx_key, last.digest, []))
        self.committed = self.history[-1].tx_key
        self.clock = [0]

    @contextlib.contextmanager
    def start(self, limits: dict | None = None) -> Iterator[Any]:
        """The replicant (re)started on the data directory, its clock the test's; closed after the block."""
        with replicant_by_hand(self.data_dir, limits) as node:
            self.clock[0] = node.clock_ms()
            node.clock_ms = lambda: self.clock[0]
            yield node

    def bootstrap(self, node, agent: str):
        from mnesite.rlog import replication as p

        replica = node.replicas["default"]
        if replica.mode is not p.Mode.DISCONNECTED:
            replica = _watching(node, self.committed)
        else:  # disconnected: its next probe and watch
            self.clock[0] = replica.next_deadline_ms()
            node._step(replica, p.Ticked())
            node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(self.committed, True, 0)),)))
        k0 = self.history[0]
        node._step(replica, p.WatchAccepted("core1", agent, "bootstrap", k0.tx_key, k0.digest, replica.watch_id))
        assert replica.mode is p.Mode.BOOTSTRAP
        return replica

    def push(self, node, agent: str, entries) -> None:
        from mnesite.rlog import replication as p

        node._step(node.replicas["default"], p.PushReceived("core1", agent, tuple(entries), self.committed, True))


def test_entries_buffered_is_what_the_shard_s_spill_holds_across_bootstraps_a_replay_and_a_restart(tmp_path) -> None:
    """``status``'s ``entries_buffered`` was the entries spilled since the process started: 0 after a
    restart in the middle of a bootstrap while the spill on disk held its entries, still the replayed
    entries once the copy was done, and a second bootstrap's count added to the first's. It is now
    what the shard's spill holds. A bootstrap interrupted by a restart is not resumed (the digest is
    unknown: the core's rule answers bootstrap): the next bootstrap starts over, and its reset deletes
    the spill the interrupted one left, which is counted until then."""
    from mnesite.core.watch import decide_watch
    from mnesite.rlog import replication as p
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY

    spilling = _Spilling(tmp_path / "r")
    history, committed = spilling.history, spilling.committed

    def buffered(node) -> tuple[int, int]:
        """``status``'s figure, and the entries the shard's spill holds on disk."""
        return node.status()["shards"]["default"]["entries_buffered"], node.store.spilled("default")

    with spilling.start() as node:
        node.core_sockets = {"core1": _queueing_dealer()}
        node._open_replica("default")
        replica = spilling.bootstrap(node, "a1")
        spilling.push(node, "a1", history[1:3])
        assert buffered(node) == (2, 2)
        node._step(replica, p.RequestFailed("core1", "gone", replica.watch_id))
        assert buffered(node) == (2, 2)  # the failed bootstrap's spill stays until the next one's reset
        spilling.bootstrap(node, "a2")
        assert buffered(node) == (0, 0)
        spilling.push(node, "a2", history[1:2])
        assert buffered(node) == (1, 1)
        node.flush()
    with spilling.start() as node:  # restarted in the middle of the bootstrap
        assert buffered(node) == (1, 1)
        replica = node.replicas["default"]
        # Not resumed: a watch from the unknown digest is answered bootstrap, even by a core holding the key.
        assert replica.applied_digest == p.UNKNOWN_DIGEST
        digests = {ZERO_KEY: GENESIS_DIGEST, **{entry.tx_key: entry.digest for entry in history}}
        mode, _, _ = decide_watch(
            replica.applied_key, replica.applied_digest, ZERO_KEY, committed, history[-1].digest, digests.get, "c"
        )
        assert mode == "bootstrap"
        node.core_sockets = {"core1": _queueing_dealer()}
        replica = spilling.bootstrap(node, "a3")
        assert buffered(node) == (0, 0)  # starts over: the reset deleted the interrupted bootstrap's spill
        spilling.push(node, "a3", history[1:4])
        assert buffered(node) == (3, 3)
        node._step(replica, p.TablesReceived("core1", (), (), replica.watch_id))  # the copy is done: replayed
        assert replica.mode is p.Mode.NORMAL and replica.applied_key == TxKey(1, 4)
        assert buffered(node) == (0, 0)


def test_a_spill_left_by_a_bootstrap_a_restart_interrupted_is_charged_to_the_node_s_spill_budget(tmp_path) -> None:
    """The spill an unfinished bootstrap leaves on disk stays there until the next bootstrap's reset
    deletes it. In the process that spilled it, its bytes stay charged to the node's ``SpillBudget``
    until then; after a restart they were not charged at all, so the node's other shards could spill
    a whole ``spill_bytes_max`` on top of it: more disk than configured. They are charged at the start
    now (their bytes as stored), and given back by the reset that deletes them."""
    spilling = _Spilling(tmp_path / "r")
    with spilling.start() as node:
        node.core_sockets = {"core1": _queueing_dealer()}
        node._open_replica("default")
        spilling.bootstrap(node, "a1")
        spilling.push(node, "a1", spilling.history[1:5])
        assert node.spill_budget.used > 0
        node.flush()
    with spilling.start() as node:  # restarted in the middle of the bootstrap
        on_disk = node.store.spilled_bytes("default")
        assert node.store.spilled("default") == 4 and on_disk > 0
        assert node.spill_budget.used == on_disk
        node.core_sockets = {"core1": _queueing_dealer()}
        spilling.bootstrap(node, "a2")  # its reset deletes the old spill: its bytes go back
        assert node.store.spilled_bytes("default") == 0 and node.spill_budget.used == 0
        spilling.push(node, "a2", spilling.history[1:2])
        assert node.spill_budget.used == spilling.history[1].size_bytes


def test_a_full_disk_that_rolls_back_a_bootstrap_s_reset_leaves_the_old_spill_counted_and_charged(
    tmp_path, monkeypatch
) -> None:
    """A bootstrap's reset (``ResetShard``) deletes the spill an unfinished bootstrap left, and the
    replica stops counting it and gives its bytes back to the node's ``SpillBudget`` in the same step.
    When that turn's commit found the disk full, the rollback put the old spill back on disk, but the
    replica still counted 0 entries (``entries_buffered``) and charged none of its bytes, until the
    next bootstrap's reset: the node's other shards could spill that much more than
    ``spill_bytes_max``. The replica now takes the spill on disk as it takes the position there."""
    import apsw
    from mnesite.rlog import replication as p
    from mnesite.rlog.store import Store

    spilling = _Spilling(tmp_path / "r")
    with spilling.start() as node:
        node.core_sockets = {"core1": _queueing_dealer()}
        node._open_replica("default")
        replica = spilling.bootstrap(node, "a1")
        spilling.push(node, "a1", spilling.history[1:4])
        node._step(replica, p.RequestFailed("core1", "gone", replica.watch_id))  # its spill stays
        node.flush()
        assert node.store.spilled("default") == 3

        def full(store: Store, durable: bool = True) -> None:
            raise apsw.FullError("database or disk is full")

        with monkeypatch.context() as patched:
            # One turn: the next bootstrap begins (its reset deletes the spill), and its commit fails.
            patched.setattr(node, "run_turn", lambda: (spilling.bootstrap(node, "a2"), node.flush()))
            patched.setattr(Store, "commit", full)
            node.turn()
        assert node.disk.full and replica.mode is p.Mode.DISCONNECTED
        assert node.store.spilled("default") == 3, "the rollback left the old spill on disk"
        assert node.status()["shards"]["default"]["entries_buffered"] == 3
        assert node.spill_budget.used == node.store.spilled_bytes("default") > 0
        # Space is back: the next bootstrap's reset deletes that spill and gives its bytes back.
        node.disk.freed(node.clock_ms())
        node.disk_freed()
        spilling.bootstrap(node, "a3")
        assert node.store.spilled("default") == 0 and node.spill_budget.used == 0
        assert node.status()["shards"]["default"]["entries_buffered"] == 0


def test_a_table_list_whose_names_collide_fails_the_bootstrap_not_the_node(tmp_path) -> None:
    """A core's table list is untrusted: each table was checked alone, so a list naming one index on two
    tables, or a table like another table's index or like another table in another letter case, passed,
    and its schema ops raised a ``StoreError`` out of the replicant's turn. It is now a malformed list:
    the bootstrap gives up on that core, and no table changed."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.schema import IndexSchema, define_table

    plain = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])
    other = define_table("u", "k", [["k", "INTEGER"], ["v", "TEXT"]])
    ix = (IndexSchema("ix", ("v",)),)
    collisions = (
        [TableSchema("t", "default", "k", plain.columns, ix), TableSchema("u", "default", "k", other.columns, ix)],
        [TableSchema("t", "default", "k", plain.columns, ix), define_table("IX", "k", [["k", "TEXT"]])],
        [plain, define_table("T", "k", [["k", "TEXT"]])],
        [plain, plain],
    )
    for number, listed in enumerate(collisions):
        with replicant_by_hand(tmp_path / f"r{number}") as node:
            node.core_sockets = {"core1": _unconnected_dealer()}
            replica = node._open_replica("default")
            node._step(replica, p.Ticked())
            node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 6), True, 0)),)))
            node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id))
            request_id, pending = next((rid, one) for rid, one in node.pending.items() if one.purpose == "tables")
            del node.pending[request_id]
            node._on_answer(
                pending, messages.decode(messages.encode(messages.reply(request_id, [t.to_json() for t in listed])))
            )
            assert replica.mode is p.Mode.DISCONNECTED, listed
            assert "malformed table list" in replica.status().last_error
            assert node.store.catalog() == {}


def test_a_replica_forgotten_with_a_rolled_back_turn_gives_its_spill_bytes_back(tmp_path, monkeypatch) -> None:
    """A full disk rolls back the turn that created a shard's replica (``disk_filled``): the replica is
    dropped and found again later. What its spill charged went with it, and the node's ``SpillBudget``
    (which outlives it) kept counting those bytes for good, leaving every later spill that much less.
    A spill in the turn that opened the shard is unlikely (a bootstrap takes round trips), so the
    charge is made here by hand; the budget must be whole again after the rollback."""
    import apsw
    from mnesite.rlog.store import Store

    def full(store: Store, durable: bool = True) -> None:
        raise apsw.FullError("database or disk is full")

    def run_turn() -> None:  # the turn opens the shard's replica, which spills 512 bytes
        node.begin()
        replica = node._open_replica("fresh")
        assert node.spill_budget.take(512)
        replica._spilled_bytes = 512
        node.flush()

    with replicant_by_hand(tmp_path / "r") as node:
        with monkeypatch.context() as patched:
            patched.setattr(node, "run_turn", run_turn)
            patched.setattr(Store, "commit", full)
            node.turn()
        assert node.disk.full and node.store.shard("fresh") is None, "the turn was rolled back"
        assert "fresh" not in node.replicas
        assert node.spill_budget.used == 0


def test_a_core_refusing_the_journal_request_is_said_in_status_and_the_log_not_taken_for_silence(
    tmp_path, caplog
) -> None:
    """A core that answers ``journal`` with an error (``forbidden``: the replicant's key lacks the
    replicant role; ``stopping``) was taken for one that did not answer: the status said "core1 did
    not answer", and a fresh replicant whose discovery every core refused logged nothing and showed no
    shard, while ``no_core_reached`` stayed null (the cores did answer). The refusal is now said in
    the probe's status and in a (throttled) warning line, for discovery too."""
    from mnesite.replicant.node import Pending, Probe
    from mnesite.rlog import replication as p

    refused = "replicant1 (no role) may not send journal; it needs one of: admin, core, replicant"
    with replicant_by_hand(tmp_path / "r") as node, caplog.at_level("WARNING", logger="mnesite.replicant"):
        node._on_answer(Pending("discover", "core1", node.clock_ms() + 1000), messages.error("d", "forbidden", refused))
        assert node.replicas == {} and node.no_core_reached() is None
        assert any("core1 refused this replicant's journal request" in r.getMessage() for r in caplog.records)
        assert any(refused in r.getMessage() for r in caplog.records)
        replica = node._open_replica("s")
        (probe,) = [e for e in replica.step(p.Ticked(), node.clock_ms()) if isinstance(e, p.ProbeJournals)]
        node.probes["s"] = Probe(probe.cores, {}, node.clock_ms() + 1000)
        asked = Pending("probe", "core1", node.clock_ms() + 1000, "s")
        node._on_answer(asked, messages.error("j", "forbidden", refused))
        error = replica.status().last_error
        assert "core1 did not answer" not in error
        assert f"core1 refused the journal request: forbidden: {refused}" in error


def test_the_probe_of_a_replica_dropped_with_a_rolled_back_turn_does_not_keep_the_loop_spinning(
    tmp_path, monkeypatch
) -> None:
    """The turn that discovers a shard also has its new replica probe the cores' journals. A full disk
    rolls that turn back (``disk_filled``) and drops the replica, but its ``Probe`` stayed: ``_expire``
    ends only the probes of replicas it knows, so that one was never ended, and its deadline, past,
    made every later loop turn poll with no timeout (a busy loop, for as long as the disk stayed full
    and the shard was not discovered again). The probe goes with its replica."""
    import apsw
    from mnesite.rlog import replication as p
    from mnesite.rlog.store import Store

    def full(store: Store, durable: bool = True) -> None:
        raise apsw.FullError("database or disk is full")

    def run_turn() -> None:  # the turn opens the shard's replica, which probes at once
        node.begin()
        replica = node._open_replica("fresh")
        node._step(replica, p.Ticked())
        assert "fresh" in node.probes
        node.flush()

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        with monkeypatch.context() as patched:
            patched.setattr(node, "run_turn", run_turn)
            patched.setattr(Store, "commit", full)
            node.turn()
        assert node.disk.full and "fresh" not in node.replicas, "the turn was rolled back"
        later = node.clock_ms() + 60_000
        node._expire(later)
        # What run_turn waits for: a deadline in the past would make it poll with timeout 0, every turn.
        assert [probe.deadline_ms for probe in node.probes.values() if probe.deadline_ms <= later] == []


@pytest.mark.parametrize(
    ("kind", "result", "said"),
    [
        ("error", ("not_ready", "core1 cannot serve shard default yet: installing"), "not_ready: core1 cannot serve"),
        ("reply", {"rows": "not a list", "done": True}, "malformed bootstrap_batch answer"),
    ],
)
def test_a_failed_bootstrap_batch_says_the_core_s_error_or_that_its_answer_was_malformed(
    tmp_path, kind, result, said
) -> None:
    """The status of a copy whose batch a core refused said ``bootstrap batch failed: Error(code=...,
    message=..., detail=None)`` (the typed body's repr), and of one whose answer did not decode
    ``bootstrap batch failed: None``: nothing said that the core's answer was malformed. It now says
    ``CODE: message`` as for a refused table list, or that the answer was malformed."""
    from mnesite.rlog import replication as p
    from mnesite.rlog.schema import define_table

    with replicant_by_hand(tmp_path / "r") as node:
        replica = _watching(node, TxKey(1, 6))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 6), b"d" * 32, replica.watch_id))

        def answer(purpose: str, message: Message) -> None:
            (request_id,) = [rid for rid, pending in node.pending.items() if pending.purpose == purpose]
            node._on_answer(node.pending.pop(request_id), message)

        answer("tables", messages.reply("t", [define_table("t", "k", [["k", "INTEGER"]]).to_json()]))
        answer("batch", messages.error("b", *result) if kind == "error" else messages.reply("b", result))
        assert replica.mode is p.Mode.DISCONNECTED
        error = replica.status().last_error or ""
        assert said in error and "None" not in error and "Error(" not in error, error


def test_a_read_fence_whose_key_the_upstream_keeps_refusing_says_why_in_status_and_the_log(tmp_path, caplog) -> None:
    """Regression: an upstream that kept refusing the fence's read_index (no_sequencer, not_ready) left
    the replica read-fenced with read_fence null, no last_error and no log line: CommittedReceived
    carried no reason. Status says why now (read_fence_error) and a throttled warning says it too."""
    import logging

    from mnesite.rlog import replication as p

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _unconnected_dealer()}
        node.warnings.clock = lambda: 0  # one second that never ends: one line, the rest counted
        caplog.set_level(logging.WARNING, logger="mnesite.replicant")
        replica = node._open_replica("default")
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 4), True, 0)),)))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 1), b"d" * 32, replica.watch_id))
        node._step(replica, p.TablesReceived("core1", (), ()))
        assert replica.mode is p.Mode.NORMAL and replica.read_fenced

        def refuse_the_fence(code: str) -> None:
            [(request_id, pending)] = [(r, one) for r, one in node.pending.items() if one.purpose == "fence"]
            del node.pending[request_id]
            node._on_answer(pending, messages.error(request_id, code, "the sequencer is being elected"))

        refuse_the_fence("no_sequencer")
        shard = node.status()["shards"]["default"]
        assert shard["read_fence"] is None and shard["read_fenced"]
        assert shard["read_fence_error"] == "core1 refused read_index: no_sequencer: the sequencer is being elected"
        node._step(replica, p.Ticked())  # a refused question is asked again at once
        refuse_the_fence("not_ready")
        assert node.status()["shards"]["default"]["read_fence_error"].startswith("core1 refused read_index: not_ready")
        said = [r.getMessage() for r in caplog.records if "reads stay fenced" in r.getMessage()]
        assert said == [
            "shard default: reads stay fenced after its bootstrap, the committed key not told: "
            "core1 refused read_index: no_sequencer: the sequencer is being elected"
        ]
        node._step(replica, p.Ticked())
        [pending] = [one for one in node.pending.values() if one.purpose == "fence"]
        node._fence_answered(pending, TxKey(1, 1), None)
        assert replica.readable() and node.status()["shards"]["default"]["read_fence_error"] is None


def test_a_read_fence_question_the_full_pending_table_kept_back_says_why_and_reads_are_refused_saying_it(
    tmp_path, caplog
) -> None:
    """Regression: a fence question that the full table of pending requests kept back was dropped with
    no reason: the replica's status had no read_fence_error, and a read was refused not_ready with
    nothing on why the fence key was not known. The replica keeps why now (overloaded, what is full),
    the log says it, a read's refusal ends with it and ``retry later``, and the question is asked again
    at its interval, not in every turn the table stays full."""
    import logging

    from mnesite.replicant.node import PENDING_REQUESTS_MAX, Pending
    from mnesite.rlog import replication as p
    from mnesite.rlog.errors import RequestError

    with replicant_by_hand(tmp_path / "r") as node:
        node.core_sockets = {"core1": _queueing_dealer()}
        caplog.set_level(logging.WARNING, logger="mnesite.replicant")
        replica = node._open_replica("default")
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 4), True, 0)),)))
        node._step(replica, p.WatchAccepted("core1", "a1", "bootstrap", TxKey(1, 1), b"d" * 32, replica.watch_id))
        far = node.clock_ms() + 60_000
        for index in range(PENDING_REQUESTS_MAX - len(node.pending)):
            node.pending[f"other-{index}"] = Pending("discover", "core1", far)
        node._step(replica, p.TablesReceived("core1", (), ()))  # the copy is done: the fence question
        assert replica.mode is p.Mode.NORMAL and replica.read_fenced
        assert not [one for one in node.pending.values() if one.purpose == "fence"], "the test is stale"
        node._expire(node.clock_ms())
        error = node.status()["shards"]["default"]["read_fence_error"] or ""
        assert error.startswith("overloaded: ") and f"(PENDING_REQUESTS_MAX {PENDING_REQUESTS_MAX})" in error, error
        assert "read_index to core1 not sent" in error, error
        said = [r.getMessage() for r in caplog.records if "reads stay fenced" in r.getMessage()]
        assert said and said[0].endswith(error), said
        with pytest.raises(RequestError) as refused:
            node._serving("default")
        assert refused.value.code == "not_ready"
        assert f"not told at the last ask: {error}; retry later" in str(refused.value), refused.value
        assert replica.next_deadline_ms() > node.clock_ms(), "asked again at once, in every turn while full"


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}),
        ("get", {"table": "later", "key": 1, "consistency": "linearizable"}),
    ],
)
def test_a_clients_request_goes_to_another_core_when_the_watched_one_cannot_take_it(tmp_path, kind, body) -> None:
    """Regression: a forwarded write (or a read index) went to the watched core whatever its state, and
    was refused no_sequencer, nothing sent, for every request while that core's queue held
    core_queue_bytes_max or its sends failed, although another core could take it. It goes to another
    core now; it is refused only when no core takes it, naming each."""
    from mnesite.rlog import replication as p

    @dataclass
    class Held:
        done: bool = False

    with replicant_by_hand(tmp_path / "r", {"core_queue_bytes_max": 65536}) as node:
        node.cores = ("core1", "core2")
        node.core_sockets = {"core1": _queueing_dealer(), "core2": _queueing_dealer()}
        replica = node._open_replica("default")
        node._step(replica, p.Ticked())
        node._step(replica, p.JournalsReceived((("core1", p.JournalAnswer(TxKey(1, 1), True, 0)),)))
        at = (replica.applied_key, replica.applied_digest)
        node._step(replica, p.WatchAccepted("core1", "a1", "resume", *at, replica.watch_id))
        assert replica.upstream == "core1"

        def ask(request_id: str) -> list[tuple[str, str]]:
            node._dispatch([b"client"], Message(kind, request_id, typed_body(kind, body)))
            return [(m.body.code, m.body.message) for _s, to, m in node._outbox if to == [b"client"]]

        def asked_of() -> list[str]:
            return [pending.core for pending in node.pending.values() if pending.purpose in ("forward", "read_index")]

        held = Held()
        node.peer_queues.sent("core1", held, 65536)  # core1 holds core_queue_bytes_max: it does not read
        assert ask("r-1") == [] and asked_of() == ["core2"]
        assert node.peer_queues.refused == {}, "core1 was not even tried"
        held.done = True  # core1 read it; then its sends fail (its connection is gone)
        node.core_sockets["core1"].close(0)
        node.core_sockets["core1"] = _unconnected_dealer()
        assert ask("r-2") == [] and asked_of() == ["core2", "core2"]
        node.core_sockets["core2"].close(0)
        node.core_sockets["core2"] = _unconnected_dealer()  # no core takes it now
        [(code, message)] = ask("r-3")
        assert code == "no_sequencer" and "nothing was sent" in message, message
        assert "core core1: " in message and "core core2: " in message, message
        assert asked_of() == ["core2", "core2"]
