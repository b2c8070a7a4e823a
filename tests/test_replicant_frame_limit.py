"""A replicant whose ``[limits] frame_bytes_max`` is below its cores' (``core.agent``, "Frame limit").

A core bounded its pushes by its own limits only (half its own ``frame_bytes_max``, 256 KiB by
default): a replicant set to 64 KiB refused a catch-up's pushes unread, the agent resent them for
ever, and the replicant never caught up, saying nothing. A replicant of protocol 2 tells its limit
in its watch; the agent pushes within it, and an entry that cannot fit even alone is refused with a
reason the replicant shows, instead of being pushed in a loop.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mnesite.core.agent import Agent, AgentConfig, push_bytes_bound, unpushable_entry
from mnesite.replicant.replica import ReplicaConfig
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.limits import FRAME_ENVELOPE_BYTES
from mnesite.rlog.replication import AgentStopped, CommittedAdvanced, Push
from mnesite.rlog.types import ZERO_KEY, TxKey

from tests.conftest import ThreadNode, thread_replicant, wait_until

REPLICANT_FRAME_BYTES_MAX = 64 * 1024
ROW_TEXT_CHARS = 40_000  # entries of about 40 KB: six of them are one push of a core's default bound


@contextlib.contextmanager
def _replicant_and_its_core(tmp_path: Path) -> Iterator[tuple[Any, Any, Any]]:
    """A replicant by hand whose frame_bytes_max is REPLICANT_FRAME_BYTES_MAX, its core1 a ROUTER the
    test answers from by hand, reached through ``upstream``: ``(node, core, upstream)``."""
    import zmq

    from tests.conftest import replicant_by_hand

    context = zmq.Context.instance()
    core = context.socket(zmq.ROUTER)
    core.setsockopt(zmq.LINGER, 0)
    upstream = context.socket(zmq.DEALER)
    upstream.setsockopt(zmq.LINGER, 0)
    try:
        upstream.connect(f"tcp://127.0.0.1:{core.bind_to_random_port('tcp://127.0.0.1')}")
        with replicant_by_hand(tmp_path / "r", {"frame_bytes_max": REPLICANT_FRAME_BYTES_MAX}) as node:
            node.core_sockets = {"core1": upstream}
            yield node, core, upstream
    finally:
        upstream.close(0)
        core.close(0)


def test_the_push_bound_is_the_cores_and_half_the_replicants_frame() -> None:
    assert push_bytes_bound(256 * 1024, None) == 256 * 1024  # not told (protocol 1): the core's own
    assert push_bytes_bound(256 * 1024, 64 * 1024) == 32 * 1024
    assert push_bytes_bound(256 * 1024, 8 * 1024 * 1024) == 256 * 1024


def test_an_entry_is_unpushable_only_when_it_and_a_push_envelope_exceed_the_replicants_frame() -> None:
    room = REPLICANT_FRAME_BYTES_MAX - FRAME_ENVELOPE_BYTES
    fits = unpushable_entry("default", TxKey(1, 7), room, "replicant1", REPLICANT_FRAME_BYTES_MAX)
    assert fits is None
    assert unpushable_entry("default", TxKey(1, 7), 10 * room, "replicant1", None) is None  # not told
    refusal = unpushable_entry("default", TxKey(1, 7), room + 1, "replicant1", REPLICANT_FRAME_BYTES_MAX)
    assert refusal is not None
    for said in ("(1, 7)", f"{room + 1} bytes", "replicant1", "frame_bytes_max is 65536", f"at least {65536 + 1}"):
        assert said in refusal, (said, refusal)


class _Log:
    """An ``AgentLogView`` over a list of entries of sizes given (what the agent reads of them)."""

    def __init__(self, sizes: list[int]) -> None:
        from mnesite.rlog.types import Entry, WriteOp

        self.entries = []
        prev = ZERO_KEY
        for counter, size in enumerate(sizes, 1):
            key = TxKey(1, counter)
            entry = Entry("default", key, prev, b"\0" * 32, (WriteOp("t", {"id": counter, "v": "x" * size}),))
            self.entries.append(entry)
            prev = key

    def entries_after(self, key: TxKey, limit: int) -> list:
        return [entry for entry in self.entries if entry.tx_key > key][:limit]

    def trimmed_key(self) -> TxKey:
        return ZERO_KEY

    def count_after(self, key: TxKey, up_to: TxKey, limit: int) -> int:
        return min(limit, sum(1 for entry in self.entries if key < entry.tx_key <= up_to))


def test_an_agent_pushes_within_the_replicants_frame_and_stops_before_an_entry_that_cannot_fit() -> None:
    log = _Log([ROW_TEXT_CHARS] * 6 + [REPLICANT_FRAME_BYTES_MAX] + [10])
    agent = Agent("a", "default", "replicant1", ZERO_KEY, log, AgentConfig(), 0, None, REPLICANT_FRAME_BYTES_MAX)
    effects = agent.step(CommittedAdvanced(log.entries[-1].tx_key, True), 0)
    pushes = [effect for effect in effects if isinstance(effect, Push) and effect.entries]
    assert [len(push.entries) for push in pushes] == [1] * 6  # each ~40 KB entry alone: two exceed 32 KiB
    assert all(push.size_bytes <= REPLICANT_FRAME_BYTES_MAX - FRAME_ENVELOPE_BYTES for push in pushes)
    assert effects[-1] == AgentStopped(agent.entry_refusal)  # before entry 7, never pushed
    assert agent.entry_refusal is not None and "entry (1, 7)" in agent.entry_refusal
    assert agent.status().sent_key == TxKey(1, 6)


@pytest.mark.timeout(60)
def test_a_replicant_with_a_smaller_frame_bytes_max_catches_up_and_shows_why_an_entry_never_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    core = ThreadNode(tmp_path / "core")
    try:
        with core.client(timeout_ms=5000) as writer:
            writer.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
            for row in range(6):  # written before the replicant starts: its catch-up batches them
                writer.put("t", {"id": row, "v": "x" * ROW_TEXT_CHARS})
            limits = {"frame_bytes_max": REPLICANT_FRAME_BYTES_MAX}
            # The refused entry shows once the replicant, pushed nothing more, watches again: after its
            # failure timeout, 0.5 s here rather than 3 s.
            quick = ReplicaConfig(failure_timeout_ms=500, probe_timeout_ms=250)
            with (
                thread_replicant(tmp_path / "r", core.endpoint, limits, quick) as endpoint,
                Client(endpoint, timeout_ms=1000, retries=1) as reader,
            ):

                def caught_up() -> bool:
                    try:
                        return reader.get("t", 5) is not None
                    except MnesiteError:  # unknown_table, not_ready: not there yet
                        return False

                wait_until(caught_up, 20, "the replicant to apply the 40 KB entries")
                large = writer.put("t", {"id": 99, "v": "y" * REPLICANT_FRAME_BYTES_MAX})

                def last_error() -> str:
                    return reader.status()["shards"]["default"]["last_error"] or ""

                wait_until(lambda: "too_large" in last_error(), 20, "the replicant to show the refused entry")
                error = last_error()
                assert f"entry {tuple(large)}" in error and "frame_bytes_max is 65536" in error, error
                assert "raise frame_bytes_max on the replicant" in error, error
                said = [r.getMessage() for r in caplog.records if r.name == "mnesite.replicant"]
                assert any("watch refused by core1: too_large: entry" in line for line in said), said
    finally:
        core.stop()


def test_a_bootstrap_batch_is_asked_within_the_replicants_frame_and_an_answer_above_it_fails_at_once(
    tmp_path: Path,
) -> None:
    """A batch was asked with no ``bytes_max``: the core filled it to half its own frame (2 MiB), the
    replicant dropped the answer unread (``frame_too_large``) and waited its timeout, again and again.
    It asks for half its own frame now, and an answer above its frame (a core's row larger than that)
    fails the batch at once, naming the limit, instead of silently at its timeout."""
    from mnesite.rlog import messages
    from mnesite.rlog import replication as p

    with _replicant_and_its_core(tmp_path) as (node, core, upstream):
        replica = node._open_replica("default")
        node._execute(replica, p.FetchBatch("core1", "t", None, 10_000))
        assert core.poll(5000), "the batch request was not sent"
        *envelope, frame = core.recv_multipart()
        request = messages.decode(frame)
        assert request.body.bytes_max == REPLICANT_FRAME_BYTES_MAX // 2
        [(request_id, pending)] = node.pending.items()
        rows = [{"id": 1, "v": "z" * REPLICANT_FRAME_BYTES_MAX}]  # one row: a core sends it whatever the bound
        answer = messages.reply(request.request_id, {"rows": rows, "done": True})
        core.send_multipart([*envelope, messages.encode(answer)])
        assert upstream.poll(5000), "the answer did not come"
        node._receive_answers("core1", upstream)
        assert request_id not in node.pending
        [(shard, failed)] = node._requests_failed
        assert shard == "default" and failed.core == "core1" and failed.watch_id == pending.watch_id
        assert "exceeds frame_bytes_max 65536" in failed.reason, failed.reason


def test_a_watch_tells_the_frame_limit_only_to_a_core_that_reads_the_field(tmp_path: Path) -> None:
    """Release 0.1.0 refuses a watch with a field it does not know (``bad_frame``): the limit goes only
    in a watch of protocol 2, which names a core of a release that reads it; a core that has not told
    its release (0.1.0's silence) is sent the watch of before, and serves by its own bounds."""
    from mnesite.rlog import messages
    from mnesite.rlog import replication as p
    from mnesite.rlog.versions import THIS_RELEASE

    from tests.conftest import replicant_by_hand

    with replicant_by_hand(tmp_path / "r", {"frame_bytes_max": REPLICANT_FRAME_BYTES_MAX}) as node:
        node.core_sockets = {"core1": object()}  # only queued to here, never sent on
        replica = node._open_replica("default")
        node._execute(replica, p.SendWatch("core1", ZERO_KEY, b"", "w1"))
        node.core_versions["core1"] = THIS_RELEASE
        node._execute(replica, p.SendWatch("core1", ZERO_KEY, b"", "w2"))
        to_old, to_new = [message.body for _s, _e, message in node._outbox if message.kind == "watch"]
        node._outbox.clear()
    assert to_old["protocol"] == 1 and "frame_bytes_max" not in to_old
    assert to_new["protocol"] == 2 and to_new["frame_bytes_max"] == REPLICANT_FRAME_BYTES_MAX
    assert messages.typed_body("watch", to_new).frame_bytes_max == REPLICANT_FRAME_BYTES_MAX
    assert messages.typed_body("watch", to_old).frame_bytes_max is None  # an older replicant's: not told


@pytest.mark.parametrize(
    ("kind", "body", "code"),
    [
        ("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}, "outcome_unknown"),
        ("get", {"table": "later", "key": 1, "consistency": "linearizable"}, "no_sequencer"),
    ],
)
def test_a_clients_request_whose_core_answer_is_above_the_replicants_frame_is_answered_at_once(
    tmp_path: Path, kind: str, body: dict, code: str
) -> None:
    """A forwarded write's or a read index's answer above the replicant's frame_bytes_max was dropped
    unread and the client answered only at the request's timeout (10 s for a write), while the
    replicant's own requests failed at once. It is answered at once now, naming the limit: a write
    outcome_unknown (the core may have committed it; the client asks again with the same id), a read
    no_sequencer (a read changes nothing)."""
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message, typed_body

    with _replicant_and_its_core(tmp_path) as (node, core, upstream):
        node._open_replica("default")
        node._dispatch([b"client"], Message(kind, "c-1", typed_body(kind, body)))
        assert core.poll(5000), "the request was not sent"
        *envelope, frame = core.recv_multipart()
        request = messages.decode(frame)
        answer = messages.reply(request.request_id, {"padding": "z" * REPLICANT_FRAME_BYTES_MAX})
        core.send_multipart([*envelope, messages.encode(answer)])
        assert upstream.poll(5000), "the answer did not come"
        node._receive_answers("core1", upstream)
        answers = [m for _s, to, m in node._outbox if to == [b"client"]]
        assert [(m.request_id, m.kind, m.body.code) for m in answers] == [("c-1", "error", code)]
        said = answers[0].body.message
        assert "answer of core core1 was too large" in said and "exceeds frame_bytes_max 65536" in said, said
        assert node.pending == {} and b"client" not in node.outstanding


def test_a_core_logs_its_too_large_refusal_of_a_watch_and_its_status_shows_each_agents_frame_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the replicant said why its watch was refused ``too_large``: the core's log was silent, and
    the core's status did not show the frame limit each replicant told it. The core logs the refusal
    (throttled: the replicant watches again by its failover rule), naming the agent, the entry's key,
    its size and the replicant's frame_bytes_max; each agent's status shows its replicant's limit."""
    import logging

    from mnesite.cli.main import describe_agents
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.messages import Message, typed_body

    from tests.conftest import core_with_table, run_turns_until, watch_body

    with core_with_table(tmp_path / "data") as node:
        before = node.store.shard("default")
        row = {"id": 1, "v": "y" * REPLICANT_FRAME_BYTES_MAX}
        write = typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": row}]})
        node._dispatch([b"writer"], Message("transact", "w-1", write))
        run_turns_until(node, lambda: node.store.shard("default").applied > before.applied, "the write's apply")
        large = node.store.shard("default").applied
        start = {"from": list(before.applied), "from_digest": before.digest}
        small = watch_body("replicant1", "tcp://127.0.0.1:1", frame_bytes_max=REPLICANT_FRAME_BYTES_MAX, **start)
        with caplog.at_level(logging.WARNING, logger="mnesite.core"), pytest.raises(RequestError) as refused:
            node._watch(typed_body("watch", small))
        assert refused.value.code == "too_large"
        [said] = [r.getMessage() for r in caplog.records if r.name == "mnesite.core" and "replicant1" in r.getMessage()]
        assert "refused replicant replicant1's watch (agent core1-" in said, said
        assert f"entry {tuple(large)}" in said and "frame_bytes_max is 65536" in said, said
        size = re.search(r"is (\d+) bytes: a push of it would not fit", said)
        assert size is not None and int(size.group(1)) > REPLICANT_FRAME_BYTES_MAX, said
        told = 8 * 1024 * 1024
        node._watch(typed_body("watch", watch_body("replicant2", "tcp://127.0.0.1:2", frame_bytes_max=told)))
        node._watch(typed_body("watch", watch_body("replicant3", "tcp://127.0.0.1:3")))
        agents = {agent["replicant"]: agent for agent in node.status()["agents"]}
        assert agents["replicant2"]["frame_bytes_max"] == told
        assert agents["replicant3"]["frame_bytes_max"] is None  # not told (as by a replicant of protocol 1)
        lines = describe_agents({"agents": [agents["replicant2"], agents["replicant3"]]})
        assert lines[0].endswith(f"acknowledgements refused, frame_bytes_max {told}"), lines
        assert lines[1].endswith("acknowledgements refused, frame_bytes_max not told"), lines


def test_a_core_logs_an_agent_that_stops_part_way_at_an_entry_too_large_for_its_replicant(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that pushed some entries and then stopped before one its replicant's frame cannot hold
    was silent at the core: only the replicant's next watch, refused ``too_large``, was logged. The
    core logs the stop once (throttled), naming the shard, the agent, the replicant, the key pushed up
    to and the refusal (the entry's key, its size, the replicant's frame_bytes_max); a watch refused at
    once for such an entry is said as the watch's refusal only, not as an agent that stopped."""
    import logging

    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.messages import Message, typed_body

    from tests.conftest import core_with_table, run_turns_until, watch_body

    def write(node: Any, request_id: str, text: str) -> Any:
        before = node.store.shard("default").applied
        body = typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1, "v": text}}]})
        node._dispatch([b"writer"], Message("transact", request_id, body))
        run_turns_until(node, lambda: node.store.shard("default").applied > before, f"the apply of {request_id}")
        return node.store.shard("default")  # its position: applied key and digest

    def stops_said() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name == "mnesite.core" and "stopped pushing" in r.getMessage()
        ]

    with core_with_table(tmp_path / "data") as node, caplog.at_level(logging.WARNING, logger="mnesite.core"):
        start = node.store.shard("default")
        small = write(node, "w-1", "x")
        large = write(node, "w-2", "y" * REPLICANT_FRAME_BYTES_MAX)
        told = {"from": list(start.applied), "from_digest": start.digest, "frame_bytes_max": REPLICANT_FRAME_BYTES_MAX}
        answer = node._watch(typed_body("watch", watch_body("replicant1", "tcp://127.0.0.1:1", **told)))
        # One push in flight at a time: the replicant reads the first (the small entry) and acknowledges
        # it, echoing its token; the agent's next push would be the large entry.
        [push] = [message for _, message in node.agent_server.drain() if message.kind == "push"]
        assert node.agent_server.watches[answer["agent"]].agent.status().sent_key == small.applied
        ack = {
            "shard": "default",
            "agent": answer["agent"],
            "applied": list(small.applied),
            "token": push.body["token"],
        }
        node.agent_server.acknowledged(typed_body("push_ack", ack), node.clock_ms())
        # Its next push is due once push_delay_ms_max has passed since the first: it stops then, forgotten.
        run_turns_until(node, lambda: answer["agent"] not in node.agent_server.watches, "the agent's stop")
        node.run_turn()
        [said] = stops_said()
        assert f"agent {answer['agent']} stopped pushing to replicant replicant1 after {tuple(small.applied)}" in said
        assert (
            said.startswith("shard default: ")
            and f"entry {tuple(large.applied)} of shard default is " in said
            and "frame_bytes_max is 65536" in said
        ), said
        # The replicant watches again from what it applied: refused at once, said as that refusal.
        caplog.clear()
        after = {**told, "from": list(small.applied), "from_digest": small.digest}
        with pytest.raises(RequestError) as refused:
            node._watch(typed_body("watch", watch_body("replicant1", "tcp://127.0.0.1:1", **after)))
        node.run_turn()
        node.warnings.flush(final=True)  # what the throttle held back, said now
        assert refused.value.code == "too_large" and stops_said() == []
        assert any("refused replicant replicant1's watch" in r.getMessage() for r in caplog.records)
