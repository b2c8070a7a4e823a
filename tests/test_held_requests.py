"""Requests held for a later answer: one per request id and connection, a query's resend, a forward
that could not be sent (a core driven by hand: the test steps its driver)."""

from __future__ import annotations

import pytest
from mnesite.core.versions import PeerRecord
from mnesite.rlog import messages
from mnesite.rlog.errors import RequestError
from mnesite.rlog.messages import Message

from tests.conftest import (
    ThreadNode,
    close_offline,
    core_with_table,
    forwarding_core,
    offline_replicant,
    run_turns_until,
)
from tests.test_replicant_node import _queueing_dealer

pytestmark = pytest.mark.timeout(60)


def _changes(request_id: str, after: list[int]) -> Message:
    body = {"positions": [{"shard": "default", "after": after}], "wait_ms": 60_000}
    return Message("changes", request_id, messages.typed_body("changes", body))


def _query(request_id: str, sql: str, **fields: object) -> Message:
    return Message("query", request_id, messages.typed_body("query", {"sql": sql, "params": [], **fields}))


def _answers(node, envelope: list[bytes]) -> list[Message]:
    return [m for _s, to, m in node._outbox if to == envelope]


def _recorded(node) -> list[tuple[list[bytes], Message]]:
    """Every answer the node gives from now on (a turn sends, and empties, its outbox)."""
    seen: list[tuple[list[bytes], Message]] = []
    reply = node.reply

    def recording(envelope, message, now=False):
        seen.append((envelope, message))
        reply(envelope, message, now)

    node.reply = recording
    return seen


def test_a_read_held_under_an_id_is_not_held_again_by_a_resend_on_its_connection(tmp_path) -> None:
    """A changefeed long poll held under request id c-1 was held again, and again, when its connection
    re-sent c-1: ``hold`` counted the id once, so one connection could fill ``changes_waiting_max`` (the
    node's, shared by every consumer) with one id. The resend is refused now, the held one still waits,
    and another connection (a client that reconnected) may use the id."""
    with core_with_table(tmp_path / "data") as node:
        applied = list(node.store.shard("default").applied)
        node._dispatch([b"a"], _changes("c-1", applied))
        assert len(node.waiting_changes) == 1
        for _ in range(3):
            with pytest.raises(RequestError) as refused:
                node._dispatch([b"a"], _changes("c-1", applied))
            assert refused.value.code == "bad_request"
            assert "c-1" in str(refused.value) and "already" in str(refused.value)
        assert len(node.waiting_changes) == 1
        node._dispatch([b"b"], _changes("c-1", applied))
        assert len(node.waiting_changes) == 2
        # The request it refused is not the held one's answer: that one is still owed to [b"a"].
        assert set(node.outstanding) == {b"a", b"b"}


def test_a_query_held_under_an_id_is_not_held_again_by_a_resend_on_its_connection(tmp_path) -> None:
    with core_with_table(tmp_path / "data") as node:
        later = [node.store.shard("default").applied.generation + 5, 1]
        node._dispatch([b"a"], _query("q-1", "SELECT id FROM t", min_key=later, wait_ms=60_000))
        with pytest.raises(RequestError, match="q-1"):
            node._dispatch([b"a"], _query("q-1", "SELECT id FROM t", min_key=later, wait_ms=60_000))
        assert len(node.waiting_queries) == 1


def test_a_query_sent_again_on_another_connection_closes_the_earlier_cursor(tmp_path) -> None:
    """A client that heard nothing re-sends its query with the same id on a new connection. The first
    run's page went to the connection the client had dropped, and its cursor stayed open, holding a
    snapshot and one of ``query_cursors_max``, until ``query_idle_ms_max``. The resend closes it."""
    with core_with_table(tmp_path / "data") as node:
        for i in range(3):
            row = {"ops": [{"op": "write", "table": "t", "row": {"id": i}}]}
            node._dispatch([b"w"], Message("transact", f"w-{i}", messages.typed_body("transact", row)))
        run_turns_until(node, lambda: b"w" not in node.outstanding, "the writes' commit")  # answered at once
        seen = _recorded(node)
        pages = {}

        def page_of(envelope: bytes) -> bool:
            pages.update({to[0]: m for to, m in seen if m.request_id == "q-1"})
            return envelope in pages

        node._dispatch([b"a"], _query("q-1", "SELECT id FROM t ORDER BY id", page_rows=1))
        run_turns_until(node, lambda: page_of(b"a"), "the first page")
        assert pages[b"a"].body.result["cursor"] is not None
        assert node.queries.open_cursors() == 1
        node._dispatch([b"b"], _query("q-1", "SELECT id FROM t ORDER BY id", page_rows=1))
        run_turns_until(node, lambda: page_of(b"b"), "the resend's first page")
        assert pages[b"b"].body.result["rows"] == [[0]]
        assert node.queries.open_cursors() == 1


def test_a_query_sent_again_on_another_connection_while_it_waits_replaces_it(tmp_path) -> None:
    """Still waiting for its shard: the earlier one is answered at once (its connection's place is
    given back) and only the resend waits."""
    with core_with_table(tmp_path / "data") as node:
        later = [node.store.shard("default").applied.generation + 5, 1]
        node._dispatch([b"a"], _query("q-1", "SELECT id FROM t", min_key=later, wait_ms=60_000))
        node._dispatch([b"b"], _query("q-1", "SELECT id FROM t", min_key=later, wait_ms=60_000))
        assert len(node.waiting_queries) == 1
        assert [(m.request_id, m.body.code) for m in _answers(node, [b"a"])] == [("q-1", "sent_again")]
        assert set(node.outstanding) == {b"b"}


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}),
        ("get", {"table": "t", "key": 1, "consistency": "linearizable"}),
        ("membership_change", {"shard": "default", "action": "remove", "name": "core3"}),
    ],
)
def test_a_forward_that_could_not_be_sent_is_answered_at_once(tmp_path, kind: str, body: dict) -> None:
    """A request forwarded to a sequencer that ``_send_peer`` dropped (no endpoint known, no dealer, a
    peer whose versions this core refuses) was held all the same, and its client waited the forward's
    5 s to hear ``outcome_unknown``, though no core ever saw it. It is refused ``no_sequencer`` at once
    now: nothing was sent, nothing is held, and the client retries."""
    thread_node = ThreadNode(tmp_path / "data")
    thread_node.stop()  # its driver called directly: no thread may touch the node meanwhile
    node = thread_node.node
    message = Message(kind, "r-1", messages.typed_body(kind, body))
    with pytest.raises(RequestError) as refused:
        node._forward([b"client"], message, "default", "core2")  # no endpoint known for core2
    assert refused.value.code == "no_sequencer"
    assert "nothing was sent" in str(refused.value)
    assert len(node.forwarded) == 0
    assert node.outstanding == {}


def test_a_forward_to_a_peer_this_core_refuses_is_answered_at_once(tmp_path) -> None:
    with forwarding_core(tmp_path / "data") as node:
        versions = node.peer_versions
        versions.peers["core2"] = PeerRecord(versions.own, 0, "it speaks protocol 99")
        kind, body = "transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}
        with pytest.raises(RequestError, match="no_sequencer|nothing was sent"):
            node._forward([b"client"], Message(kind, "r-1", messages.typed_body(kind, body)), "default", "core2")
        assert len(node.forwarded) == 0 and node.outstanding == {}
        # A peer it can reach: forwarded and held.
        node._forward([b"client"], Message(kind, "r-2", messages.typed_body(kind, body)), "default", "core3")
        assert len(node.forwarded) == 1 and set(node.outstanding) == {b"client"}


def test_a_replicant_s_read_held_under_an_id_is_not_held_again_by_a_resend_on_its_connection(tmp_path) -> None:
    """A linearizable read waits at a replicant for its read index from a core: the same id re-sent on
    its connection asked the core again, one more pending request each time."""
    node = offline_replicant(tmp_path / "r")
    try:
        node._open_replica("default")
        node.core_sockets = {"core1": _queueing_dealer()}  # no peer: zmq queues what is sent
        body = messages.typed_body("get", {"table": "later", "key": 1, "consistency": "linearizable"})
        node._dispatch([b"a"], Message("get", "g-1", body))
        asked = [r for r, pending in node.pending.items() if pending.purpose == "read_index"]
        assert len(asked) == 1
        with pytest.raises(RequestError, match="g-1"):
            node._dispatch([b"a"], Message("get", "g-1", body))
        assert [r for r, pending in node.pending.items() if pending.purpose == "read_index"] == asked
        node._dispatch([b"b"], Message("get", "g-1", body))  # another connection: its own request
        assert len([r for r, pending in node.pending.items() if pending.purpose == "read_index"]) == 2
    finally:
        node._outbox.clear()
        close_offline(node)


def test_a_linearizable_query_whose_read_index_could_not_be_sent_is_answered_at_once(tmp_path) -> None:
    """A linearizable query asks its shard's sequencer for a read index: one ``_send_peer`` dropped
    (here a peer whose versions this core refuses) waited 5 s to be answered ``no_sequencer``."""
    from mnesite.core import rules
    from mnesite.rlog.query import QueryRequest

    with forwarding_core(tmp_path / "data") as node:
        versions = node.peer_versions
        versions.peers["core2"] = PeerRecord(versions.own, 0, "it speaks protocol 99")
        request = QueryRequest("SELECT 1", (), 10, "linearizable", None, 1000)
        node.query_received = lambda message: (request, None, ("default",))  # a query of shard default
        node._check_serving = lambda shard: None
        node._view = lambda driver: rules.ShardView(driver.shard, False, "core2")  # core2 is its sequencer
        seen = _recorded(node)
        node._query([b"c"], _query("q-1", "SELECT 1", consistency="linearizable"))
        assert [(to, m.request_id, m.body.code) for to, m in seen] == [([b"c"], "q-1", "no_sequencer")]
        assert "nothing was sent" in seen[0][1].body.message
        assert len(node.forwarded) == 0 and node.outstanding == {}


def _transact(request_id: str, row: dict, guards: list | None = None) -> Message:
    body = {"ops": [{"op": "write", "table": "t", "row": row}], **({"guards": guards} if guards else {})}
    return Message("transact", request_id, messages.typed_body("transact", body))


@pytest.mark.parametrize("resent_on", [b"a", b"b"])
def test_a_write_whose_failed_guard_is_held_is_not_evaluated_again_when_sent_again(tmp_path, resent_on) -> None:
    """A failed guard that observed an uncommitted entry is held until that entry commits. Its request
    sent again meanwhile was evaluated again and held again: two answers to one request id, and a retry
    evaluated once the row had changed back could pass and be written while the held one still said the
    guard failed. The held failure answers the resend now, once; an earlier connection that is not the
    resend's is told at once that the answer goes to the newest (core.guard_tail, rule 4)."""
    from mnesite.core.node import Deferred

    with core_with_table(tmp_path / "data") as node:
        seen = _recorded(node)
        node._dispatch([b"w"], _transact("w-1", {"id": 1, "v": "x"}))  # in the tail, not committed
        guarded = _transact("g-1", {"id": 2, "v": "y"}, [{"table": "t", "key": 1, "equals": None}])
        with pytest.raises(Deferred):
            node._dispatch([b"a"], guarded)  # fails against w-1's uncommitted row: held
        with pytest.raises(Deferred):
            node._dispatch([resent_on], guarded)
        driver = node.shards["default"]
        assert driver.tail.held_count() == 1
        run_turns_until(node, lambda: driver.tail.held_count() == 0, "the held failure's answer")
        told = [(to, m.body.code) for to, m in seen if m.request_id == "g-1"]
        if resent_on == b"a":
            assert told == [([b"a"], "guard_failed")]
        else:
            assert told == [([b"a"], "outcome_unknown"), ([b"b"], "guard_failed")]
        assert node.store.find_request("g-1") is None
        assert b"a" not in node.outstanding and b"b" not in node.outstanding


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("get", {"table": "t", "key": 1, "consistency": "linearizable"}),
        ("read_index", {"shard": "default"}),
    ],
)
def test_a_forwarded_read_s_answer_goes_to_the_connection_that_sent_it(tmp_path, kind: str, body: dict) -> None:
    """A follower forwarded reads under their clients' request ids and matched the sequencer's answers
    by id only: two clients using one id (ids are global) replaced each other, and the answer to one
    client's read went to the other. A read is forwarded under an id of its own now (as a query's
    read index is), and its answer goes back, under the client's id, to the connection that sent it."""
    with forwarding_core(tmp_path / "data") as node:
        message = Message(kind, "r-1", messages.typed_body(kind, body))
        node._forward([b"a"], message, "default", "core2")
        node._forward([b"b"], message, "default", "core2")
        forwards = [m for _s, to, m in node._outbox if not to]
        assert len(forwards) == 2 and len({m.request_id for m in forwards} | {"r-1"}) == 3
        assert all(m.body.forwarded for m in forwards)
        assert not [m for _s, to, m in node._outbox if to]  # nobody told anything yet
        node._outbox.clear()
        for forward, whose in ((forwards[1], "b's"), (forwards[0], "a's")):  # b's answer comes first
            node._relay(node.forwarded.answered(forward.request_id), messages.reply(forward.request_id, whose))
        answers = [(to, m.request_id, m.body.result) for _s, to, m in node._outbox]
        assert answers == [([b"b"], "r-1", "b's"), ([b"a"], "r-1", "a's")]
        assert node.outstanding == {}
        # Unanswered in time: told no_sequencer under its own id.
        node._forward([b"c"], message, "default", "core2")
        node._tell_outcomes(node.forwarded.expired(node.clock_ms() + 10**9))
        assert [(to, m.request_id, m.body.code) for _s, to, m in node._outbox if to == [b"c"]] == [
            ([b"c"], "r-1", "no_sequencer")
        ]


def test_a_sequencer_answering_a_forwarded_read_index_feeds_its_lazy_followers(tmp_path, monkeypatch) -> None:
    """The asking core waits to apply the key it is told (a linearizable query, a replicant's read): the
    driver steps ``FeedRequested`` as it answers, so a lazy follower is fed at once (core.consensus)."""
    from mnesite.core.consensus import ShardConsensus

    steps: list[str] = []
    monkeypatch.setattr(ShardConsensus, "_on_feed_requested", lambda self: steps.append(self.shard))
    with core_with_table(tmp_path / "data") as node:
        node._dispatch([b"a"], Message("read_index", "r-1", messages.typed_body("read_index", {"shard": "default"})))
        assert steps == [], "asked by a client of this core: nobody waits to apply"
        forwarded = {"shard": "default", "forwarded": True}
        node._dispatch([b"b"], Message("read_index", "r-2", messages.typed_body("read_index", forwarded)))
        assert steps == ["default"]
        answers = [(to, m.request_id) for _s, to, m in node._outbox if m.kind == "reply"]
        assert answers == [([b"a"], "r-1"), ([b"b"], "r-2")]
