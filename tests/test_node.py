"""A core node over real zmq sockets (served from a thread): writes, reads, guards, bad input, group commit."""

from __future__ import annotations

import contextlib
import json
import select
import socket as socket_module
import threading
import time

import msgpack
import pytest
import zmq
from mnesite.core.node import CoreNode
from mnesite.rlog import messages
from mnesite.rlog.client import (
    Client,
    GuardFailed,
    InvalidRequest,
    MnesiteError,
    OutcomeUnknown,
    RemoteError,
    Unavailable,
    UnknownTable,
)
from mnesite.rlog.messages import Message
from mnesite.rlog.types import TxKey

from tests.conftest import (
    RouterNode,
    ScriptedNode,
    ThreadNode,
    core_with_table,
    forwarding_core,
    free_port,
    node_config,
    run_turns_until,
    wait_until,
    watch_body,
)

pytestmark = pytest.mark.timeout(60)

USERS_COLUMNS = [("id", "INTEGER"), ("name", "TEXT"), ("score", "REAL")]


@pytest.fixture
def client(thread_node: ThreadNode):
    with thread_node.client(timeout_ms=5000) as client:
        client.create_table("users", "id", USERS_COLUMNS)
        yield client


def raw_call(endpoint: str, frame: bytes, timeout_ms: int = 5000) -> Message:
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send(frame)
        if not socket.poll(timeout_ms):
            raise AssertionError("no answer")
        return messages.decode(socket.recv())
    finally:
        socket.close(0)


def test_put_get_delete_scan(client: Client) -> None:
    first = client.put("users", {"id": 1, "name": "ada"})
    second = client.put("users", {"id": 2, "name": "grace", "score": 3})
    assert second > first and second.generation == first.generation
    assert client.get("users", 2) == {"id": 2, "name": "grace", "score": 3.0}
    assert client.delete("users", 1) > second
    assert client.get("users", 1) is None
    for start in range(3, 2503, 100):  # rows for three pages, 100 to a transaction: 25 round trips, not 2,500
        client.transact([{"op": "write", "table": "users", "row": {"id": i}} for i in range(start, start + 100)])
    rows = list(client.scan("users", page_rows=1000))
    assert [row["id"] for row in rows] == list(range(2, 2503))
    assert client.scan_page("users", after=2500, limit=10) == [
        {"id": 2501, "name": None, "score": None},
        {"id": 2502, "name": None, "score": None},
    ]


def test_transaction_is_all_or_nothing_and_guards_are_checked(client: Client) -> None:
    client.put("users", {"id": 1, "name": "ada"})
    with client.transaction() as tx:
        tx.require("users", 1, equals={"id": 1, "name": "ada"})
        tx.require("users", 2, equals=None)
        tx.put("users", {"id": 2, "name": "grace"})
        tx.delete("users", 1)
    assert tx.tx_key is not None
    assert client.get("users", 1) is None and client.get("users", 2)["name"] == "grace"
    applied_before = client.status()["shards"]["default"]["applied"]
    with pytest.raises(GuardFailed, match=r"guard 0 failed: users\[2\] should be absent") as info:
        client.transact(
            [{"op": "write", "table": "users", "row": {"id": 3}}], [{"table": "users", "key": 2, "equals": None}]
        )
    assert info.value.detail["actual"] == {"id": 2, "name": "grace", "score": None}
    assert client.get("users", 3) is None
    assert client.status()["shards"]["default"]["applied"] == applied_before
    with pytest.raises(RuntimeError), client.transaction() as tx:
        tx.put("users", {"id": 4})
        raise RuntimeError("the block failed: nothing is sent")
    assert client.get("users", 4) is None


def test_a_retried_request_is_applied_once(client: Client) -> None:
    body = {"ops": [{"op": "write", "table": "users", "row": {"id": 7, "name": "once"}}]}
    first = client.call("transact", body, request_id="retry-me")
    second = client.call("transact", body, request_id="retry-me")
    assert first["tx_key"] == second["tx_key"] and second["duplicate"] is True
    entries = client.rlog_tail("default", 100)
    assert sum(1 for e in entries if e["request_id"] == "retry-me") == 1


@pytest.mark.parametrize(
    "kind, body",
    [
        ("create_table", {"table": "retried", "key": "id", "columns": [["id", "INTEGER"]]}),
        ("drop_table", {"table": "users"}),
        ("create_index", {"table": "users", "index": "users_by_name", "columns": ["name"]}),
        ("add_column", {"table": "users", "column": "karma", "type": "INTEGER"}),
    ],
)
def test_a_retried_schema_change_is_answered_from_the_log(client: Client, kind: str, body: dict) -> None:
    # A client that heard no answer resends with the same id: the retry must get the first
    # attempt's key, not "table_exists"/"unknown_table" from checking the change against the
    # catalog the first attempt already changed (core.rules: a retry is routed by its entry).
    first = client.call(kind, body, request_id=f"retry-{kind}")
    second = client.call(kind, body, request_id=f"retry-{kind}")
    assert second["tx_key"] == first["tx_key"] and second["duplicate"] is True
    entries = client.rlog_tail("default", 100)
    assert sum(1 for e in entries if e["request_id"] == f"retry-{kind}") == 1


def test_a_burst_of_writes_and_resends_in_one_turn_logs_each_request_id_once(thread_node: ThreadNode, client: Client):
    """Writes without guards are proposed together at the end of the turn's input (core/node.py
    ``_propose_batch``); a resend arriving in the same turn as its original (before the original is
    proposed) must still be answered from the log: same tx key, marked duplicate, logged once."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(thread_node.endpoint)
    pairs = 40
    try:
        for number in range(pairs):
            body = {"ops": [{"op": "write", "table": "users", "row": {"id": 1000 + number, "name": f"n{number}"}}]}
            frame = messages.encode(Message("transact", f"burst-{number}", body))
            socket.send(frame)  # the original and its resend back to back, no wait between
            socket.send(frame)
        answers: dict[str, list[dict]] = {}
        deadline = time.monotonic() + 10
        while sum(len(a) for a in answers.values()) < 2 * pairs:
            assert socket.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no answer in time"
            answer = messages.decode(socket.recv())
            assert answer.kind == "reply", answer
            answers.setdefault(answer.request_id, []).append(answer.body.result)
    finally:
        socket.close(0)
    logged = [e["request_id"] for e in client.rlog_tail("default", 1000)]
    for number in range(pairs):
        first, second = answers[f"burst-{number}"]
        assert first["tx_key"] == second["tx_key"]
        assert sorted([first.get("duplicate", False), second.get("duplicate", False)]) == [False, True]
        assert logged.count(f"burst-{number}") == 1
        assert client.get("users", 1000 + number)["name"] == f"n{number}"


def test_bad_input_gets_a_clear_error_and_changes_nothing(thread_node: ThreadNode, client: Client) -> None:
    client.put("users", {"id": 1, "name": "ada"})
    before = client.status()["shards"]
    cases = [
        (b"\xc1garbage", "bad_frame"),
        (msgpack.packb([1, "transact", "r1", {"ops": "not a list"}]), "bad_frame"),
        (msgpack.packb([2, "status", "r1", {}]), "unsupported_version"),
        (msgpack.packb([1, "drop_everything", "r1", {}]), "unknown_kind"),
        (messages.encode(Message("get", "r1", {"table": "users", "key": "x" * 5_000_000})), "frame_too_large"),
        (messages.encode(Message("reply", "r1", {"result": 1})), "bad_request"),
    ]
    for frame, code in cases:
        answer = raw_call(thread_node.endpoint, frame)
        assert answer.kind == "error" and answer.body.code == code, (frame[:20], answer)
        assert answer.body.message
    with pytest.raises(UnknownTable, match="unknown table 'nope'"):
        client.put("nope", {"id": 1})
    with pytest.raises(RemoteError, match="users.name is TEXT") as info:
        client.put("users", {"id": 2, "name": 5})
    assert info.value.code == "wrong_type"
    with pytest.raises(RemoteError, match="no column 'age'"):
        client.put("users", {"id": 2, "age": 5})
    with pytest.raises(RemoteError, match="already exists"):
        client.create_table("users", "id", USERS_COLUMNS)
    with pytest.raises(MnesiteError, match="consistency: Invalid enum value 'eventually-maybe'"):
        client.get("users", 1, consistency="eventually-maybe")
    assert client.status()["shards"] == before, "bad input changed nothing"
    assert client.get("users", 1)["name"] == "ada", "the node keeps serving"


def test_concurrent_transactions_are_group_committed(thread_node: ThreadNode, client: Client) -> None:
    errors: list[BaseException] = []

    def writer(worker: int) -> None:
        try:
            with Client(thread_node.endpoint, timeout_ms=10_000) as own:
                for i in range(40):
                    own.put("users", {"id": worker * 1000 + i, "name": f"w{worker}"})
        except BaseException as error:  # reported below
            errors.append(error)

    commits_before = thread_node.node.commits
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    commits = thread_node.node.commits - commits_before
    assert len(list(client.scan("users"))) == 16 * 40
    assert commits < 16 * 40, f"{commits} commits for {16 * 40} transactions: no grouping"
    assert thread_node.node.store.verify_chain("default") == TxKey(*client.status()["shards"]["default"]["applied"])


def test_a_restart_opens_a_new_generation(tmp_path) -> None:
    first = ThreadNode(tmp_path / "data")
    try:
        with first.client() as client:
            client.create_table("kv", "k", [("k", "TEXT"), ("v", "TEXT")])
            before = client.put("kv", {"k": "a", "v": "1"})
    finally:
        first.stop()
    second = ThreadNode(tmp_path / "data")
    try:
        with second.client() as client:
            after = client.put("kv", {"k": "b", "v": "2"})
            # The restarted core elects itself in a new generation, whose first entry is its no-op.
            assert after == TxKey(before.generation + 1, 2)
            entries = client.rlog_tail("default", 10)
            assert entries[-2]["tx_key"] == [before.generation + 1, 1] and entries[-2]["ops"] == []
            assert entries[-2]["prev"] == list(before), "the chain continues across generations"
            assert client.get("kv", "a") == {"k": "a", "v": "1"}
            assert client.status()["shards"]["default"]["generation"] == before.generation + 1
    finally:
        second.stop()


def test_shards_have_their_own_rlogs(client: Client) -> None:
    client.create_table("events", "id", [("id", "TEXT")], shard="events")
    client.put("events", {"id": "e1"})
    client.put("users", {"id": 1})
    shards = client.status()["shards"]
    assert set(shards) == {"default", "events"}
    # A new shard's sequencer records the cluster version its members speak (core.versions) right away.
    ops = [[op["op"] for op in e["ops"]] for e in client.rlog_tail("events", 10)]
    assert ops == [[], ["create_table"], ["cluster_version"], ["write"]]
    with pytest.raises(RemoteError, match="within one shard"):
        client.transact(
            [
                {"op": "write", "table": "events", "row": {"id": "e2"}},
                {"op": "write", "table": "users", "row": {"id": 2}},
            ]
        )
    with pytest.raises(RemoteError, match="unknown shard"):
        client.rlog_tail("nope")


def test_a_write_without_a_definite_answer_raises_outcome_unknown_with_the_id_to_resend(
    client: Client, silent_endpoint: str
) -> None:
    ops = [{"op": "write", "table": "users", "row": {"id": 40, "name": "lost?", "score": 1.0}}]
    # The node took the write and never answered (a stopped node would be known not to have it).
    with Client(silent_endpoint, timeout_ms=100, retries=1) as silent:
        with pytest.raises(OutcomeUnknown, match="may or may not have happened") as info:
            silent.transact(ops)
        assert info.value.code == "outcome_unknown" and info.value.request_id
        with pytest.raises(Unavailable) as read_error:
            silent.get("users", 40)
        assert not isinstance(read_error.value, OutcomeUnknown)
    # Sending it again with that id applies it at most once and answers with its tx key.
    first = client.transact(ops, request_id=info.value.request_id)
    assert client.transact(ops, request_id=info.value.request_id) == first
    assert client.get("users", 40, after_tx_key=first) == {"id": 40, "name": "lost?", "score": 1.0}


@pytest.mark.parametrize("code", ["overloaded", "disk_full", "forbidden", "not_ready", "excluded"])
def test_a_write_whose_resend_is_refused_unread_after_a_silent_attempt_is_outcome_unknown(code: str) -> None:
    # The first attempt reached the node and got no answer: it may have been applied. The re-send
    # (same request id) is refused before the node looked at it (a full backlog, a full disk, a key
    # revoked meanwhile, a core restarted and catching up that does not know the table yet): that
    # says nothing of the first attempt, so the caller must hear "outcome unknown" with the id to send
    # it again, never an error it would take for "not written" (``not_ready`` was a RemoteError).
    node = ScriptedNode([None, (code, f"refused: {code}")])
    try:
        with Client(node.endpoint, timeout_ms=300, retries=1) as client, pytest.raises(OutcomeUnknown) as info:
            client.put("users", {"id": 1})
        assert code in str(info.value)
        assert len(node.requests) == 2 and set(node.requests) == {info.value.request_id}
    finally:
        node.close()


@pytest.mark.parametrize(
    "code", ["overloaded", "disk_full", "forbidden", "stopping", "no_sequencer", "not_ready", "excluded"]
)
def test_a_resend_with_an_earlier_attempt_s_id_that_gets_no_definite_answer_is_outcome_unknown(code: str) -> None:
    # transact(request_id=error.request_id) re-sends a write whose outcome was unknown: it may have been
    # applied already. A re-send refused unread (a full backlog or disk, a revoked key), answered
    # "stopping" by the last endpoint, or told "not now" until the deadline says nothing of that earlier
    # attempt. The call raised RemoteError or Unavailable, which the caller takes for "not written".
    node = ScriptedNode([(code, f"refused: {code}")] * 20)
    try:
        with Client(node.endpoint, timeout_ms=100, retries=1) as client, pytest.raises(OutcomeUnknown) as info:
            client.transact([{"op": "write", "table": "users", "row": {"id": 1}}], request_id="earlier-attempt")
        assert code in str(info.value) and info.value.request_id == "earlier-attempt"
        assert set(node.requests) == {"earlier-attempt"}
    finally:
        node.close()


def test_a_resend_with_an_earlier_attempt_s_id_to_a_node_now_unreachable_is_outcome_unknown() -> None:
    # No connection completes: this attempt surely did not happen, but the earlier one may have.
    with socket_module.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: refused
        with Client(endpoint, timeout_ms=2000, retries=1) as client, pytest.raises(OutcomeUnknown) as info:
            client.transact([{"op": "write", "table": "users", "row": {"id": 1}}], request_id="earlier-attempt")
        # A read surely changed nothing: unreachable stays Unavailable.
        with Client(endpoint, timeout_ms=2000, retries=1) as client, pytest.raises(Unavailable) as read_error:
            client.get("users", 1)
    assert "unreachable" in str(info.value) and info.value.request_id == "earlier-attempt"
    assert not isinstance(read_error.value, OutcomeUnknown)


def test_a_write_whose_reconnection_is_refused_after_a_silent_attempt_is_outcome_unknown() -> None:
    # The first attempt went out over an authenticated connection and got no answer; the client's
    # reconnection for the re-send fails its handshake (the key was revoked meanwhile). That says
    # nothing of the first attempt: "outcome unknown", not "unauthenticated" (taken for "not written").
    from mnesite.rlog.security import KeyPair
    from zmq.auth.thread import ThreadAuthenticator

    class FirstHandshakeOnly:
        def __init__(self) -> None:
            self.handshakes = 0

        def callback(self, domain: str, key: bytes) -> bool:
            self.handshakes += 1
            return self.handshakes == 1

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    context = zmq.Context()
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    provider = FirstHandshakeOnly()
    authenticator.configure_curve_callback("*", credentials_provider=provider)
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.curve_server, server.curve_secretkey = True, server_secret
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        key = KeyPair(zmq.utils.z85.decode(client_public), zmq.utils.z85.decode(client_secret))
        with (
            Client(
                endpoint, timeout_ms=500, retries=1, key=key, server_key=zmq.utils.z85.decode(server_public)
            ) as client,
            pytest.raises(OutcomeUnknown) as info,
        ):
            client.put("users", {"id": 1})
        assert server.poll(0) and messages.decode(server.recv_multipart()[-1]).request_id == info.value.request_id
        assert provider.handshakes >= 2
    finally:
        server.close(0)
        authenticator.stop()
        context.term()


def test_an_answer_above_the_client_s_frame_bytes_max_is_reported_as_too_large(thread_node: ThreadNode) -> None:
    # The node caps an answer at its own frame_bytes_max; a client configured with a smaller one dropped
    # the answer and, after every retry, reported that the node "did not answer", hiding the cause. It
    # is "too_large" now, at once, which is also what lets scan() ask for smaller pages.
    with thread_node.client(timeout_ms=2000) as writer:
        writer.create_table("wide", "id", [("id", "INTEGER"), ("v", "TEXT")])
        for key in range(3):
            writer.put("wide", {"id": key, "v": "x" * 1500})
    with thread_node.client(timeout_ms=2000, frame_bytes_max=2048) as client:
        started = time.monotonic()
        with pytest.raises(RemoteError, match="above this client's frame_bytes_max 2048") as info:
            client.scan_page("wide")
        assert info.value.code == "too_large" and time.monotonic() - started < 1.5
        assert [row["id"] for row in client.scan("wide")] == [0, 1, 2]


def test_a_request_about_one_node_never_fails_over_to_another(thread_node: ThreadNode, silent_endpoint: str) -> None:
    # stop, force_start and backup act on the node they reach. A client of several endpoints moved a
    # read-like request to the next endpoint when the first was silent or down: it stopped (or forced
    # sequencer, or backed up) another node than the one meant. They need a client of one endpoint.
    with Client([silent_endpoint, thread_node.endpoint], timeout_ms=200, retries=1) as client:
        for call in (client.stop, client.force_start, lambda: client.backup("/tmp/never.backup")):
            with pytest.raises(InvalidRequest, match="exactly one endpoint"):
                call()
    with thread_node.client() as client:
        assert client.status()["node"] == "core1"
    assert thread_node.thread.is_alive() and not thread_node.node.stop_requested


def test_a_request_about_one_node_s_own_state_never_fails_over_to_another(
    thread_node: ThreadNode, silent_endpoint: str
) -> None:
    # A node's journal and status are its own; range digests, key boundaries and row digests hash its
    # own data (the compare job asks each replica). A client of several endpoints answered them from
    # the next endpoint when the first was silent: another node's journal (read as this one's by a
    # force-start decision), or a compare of one node with itself. Any node's answer is right for
    # the others (members and rlog entries name or hold the same log): those still fail over.
    with Client([silent_endpoint, thread_node.endpoint], timeout_ms=200, retries=1) as client:
        for call in (
            client.journal,
            client.status,
            lambda: client.range_digest("t", [[None, None]]),
            lambda: client.key_boundaries("t", 2),
            lambda: client.row_digests("t"),
        ):
            with pytest.raises(InvalidRequest, match="exactly one endpoint"):
                call()
        assert client.members()["node"] == "core1" and client.endpoint == thread_node.endpoint
    with thread_node.client() as client:
        assert client.journal()["node"] == client.status()["node"] == "core1"


def test_a_read_answered_outcome_unknown_moves_to_the_next_endpoint(thread_node: ThreadNode) -> None:
    # A node answers outcome_unknown to whatever a turn that failed had answered (abandon_turn), or
    # that a stop cut short (answer_at_stop), reads too. A read changes nothing: it may be asked of
    # any node. It was pinned to that node for the rest of the call, as a write that may have
    # happened is, and ended in Unavailable while the next endpoint could answer it.
    node = ScriptedNode([("outcome_unknown", "the turn that answered failed: disk I/O error")])
    try:
        with Client([node.endpoint, thread_node.endpoint], timeout_ms=1000, retries=1) as client:
            assert client.list_tables() == []
            assert client.endpoint == thread_node.endpoint
        assert len(node.requests) == 1
    finally:
        node.close()


def test_a_read_refused_not_ready_moves_to_the_next_endpoint(thread_node: ThreadNode) -> None:
    # A replicant bootstrapping (or a core installing a snapshot) refuses reads of the shard with
    # not_ready, for minutes maybe. A client of several endpoints raised it at once, though a read may
    # be asked of any node and the next endpoint could answer: it asks the next one now, and raises
    # not_ready only once every endpoint said so.
    with thread_node.client(timeout_ms=2000) as writer:
        writer.create_table("t", "id", [("id", "INTEGER")])
        writer.put("t", {"id": 1})
    bootstrapping = ScriptedNode([("not_ready", "replicant r1 cannot serve shard default yet (mode bootstrap)")])
    try:
        with Client([bootstrapping.endpoint, thread_node.endpoint], timeout_ms=2000, retries=1) as client:
            assert client.get("t", 1) == {"id": 1} and client.endpoint == thread_node.endpoint
        assert len(bootstrapping.requests) == 1
    finally:
        bootstrapping.close()
    nodes = [ScriptedNode([("not_ready", f"replicant r{i} cannot serve shard default yet")]) for i in (1, 2)]
    try:
        endpoints = [node.endpoint for node in nodes]
        with Client(endpoints, timeout_ms=2000, retries=1) as client, pytest.raises(RemoteError) as info:
            client.get("t", 1)
        assert info.value.code == "not_ready" and [len(node.requests) for node in nodes] == [1, 1]
    finally:
        for node in nodes:
            node.close()


def test_a_write_refused_not_ready_moves_to_the_next_endpoint(thread_node: ThreadNode) -> None:
    # A core catching up (rebuilt from an empty disk) refuses a write naming a table it does not know
    # yet with not_ready, before anything is logged: the next endpoint may take it.
    with thread_node.client(timeout_ms=2000) as writer:
        writer.create_table("t", "id", [("id", "INTEGER")])
    catching_up = ScriptedNode([("not_ready", "unknown table 't' at core2, which is catching up")])
    try:
        with Client([catching_up.endpoint, thread_node.endpoint], timeout_ms=2000, retries=1) as client:
            client.put("t", {"id": 7})
            assert client.endpoint == thread_node.endpoint
        assert len(catching_up.requests) == 1
        with thread_node.client() as reader:
            assert reader.get("t", 7) == {"id": 7}
    finally:
        catching_up.close()


def test_a_write_refused_at_its_first_attempt_reports_the_refusal() -> None:
    # Nothing was sent before: "overloaded" at once means surely not applied (no outcome to learn).
    node = ScriptedNode([("overloaded", "busy node")])
    try:
        with Client(node.endpoint, timeout_ms=300, retries=1) as client, pytest.raises(RemoteError) as info:
            client.put("users", {"id": 1})
        assert (
            "busy node" in str(info.value)
            and info.value.code == "overloaded"
            and not isinstance(info.value, OutcomeUnknown)
        )
    finally:
        node.close()


def test_send_frames_delivers_a_multipart_message_intact_and_refuses_a_full_queue() -> None:
    # The loop's sends bypass pyzmq's Python wrappers (rlog.server.send_frames): the frames, their order
    # and a frame sent without a copy must arrive as they were, and a full queue must raise, not block.
    from mnesite.rlog.server import COPY_BYTES_MIN, send_frames

    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        sender.setsockopt(zmq.SNDHWM, 2)
        receiver.setsockopt(zmq.RCVHWM, 2)
        sender.bind("inproc://send-frames")
        receiver.connect("inproc://send-frames")
        large = bytes(range(256)) * (COPY_BYTES_MIN // 256 + 1)
        send_frames(sender, [b"envelope", b"", large])
        send_frames(sender, [b"alone"])
        assert receiver.recv_multipart() == [b"envelope", b"", large]
        assert receiver.recv_multipart() == [b"alone"]
        with pytest.raises(zmq.Again):  # nobody reads: the queue fills within its high-water marks
            for _ in range(100):
                send_frames(sender, [b"x"])
        # Anything but a socket is refused before the compiled send, which would read it as one (a
        # test's stand-in object crashed the test process that way, now and then).
        with pytest.raises(TypeError, match="needs a zmq socket"):
            send_frames(object(), [b"x"])
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()


def test_a_turn_commits_the_entries_it_appended_before_its_bookkeeping(thread_node: ThreadNode, client: Client):
    """core/node.py ``run_turn``: the entries a turn's input appended are committed (``flush_durable``)
    before the turn serves queries and runs its timers, so that an acknowledgement (here the
    sequencer's own count, then the client's answer) does not wait for that bookkeeping. At
    ``serve_queries`` no transaction holding a durable write may still be open."""
    node = thread_node.node
    seen: list[tuple[bool, bool, int]] = []
    serve_queries = node.serve_queries

    def recording(*args, **kwargs):
        seen.append((node._in_transaction, node._durable, node.durable_commits))
        return serve_queries(*args, **kwargs)

    node.serve_queries = recording
    try:
        before = len(seen)
        for number in range(20):
            client.put("users", {"id": 5000 + number, "name": "early"})
        # The last write's answer may reach us before its turn's serve_queries: one more turn after it.
        assert client.get("users", 5019)["name"] == "early"
    finally:
        del node.serve_queries
    calls = seen[before:]
    assert calls, "serve_queries was not called in the write's turns"
    assert not [call for call in calls if call[0] and call[1]], "a durable write was still uncommitted"
    # The twenty writes were committed durably, each before a serve_queries of its own turn.
    assert calls[-1][2] - calls[0][2] >= 19


@pytest.mark.parametrize(
    ("kind", "body", "code"),
    [
        ("get", {"table": "t", "key": 1, "consistency": "linearizable"}, "no_sequencer"),
        ("read_index", {"shard": "default"}, "no_sequencer"),
        ("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}, "outcome_unknown"),
        # A membership change changes the cluster like a write: the sequencer may be catching the
        # core up (minutes) and commit it later; "no_sequencer" said nothing had been started.
        ("membership_change", {"shard": "default", "action": "remove", "name": "core2"}, "outcome_unknown"),
    ],
)
def test_a_forwarded_request_that_expires_is_outcome_unknown_only_for_a_write(
    tmp_path, kind: str, body: dict, code: str
) -> None:
    """A follower core forwards a linearizable read (and a write) to the sequencer; when no answer came
    in time it answered outcome_unknown for both. For a read that says a write may have happened: the
    client then kept to this node (it never re-sends an unknown outcome elsewhere) and a caller was told
    a read's outcome is unknown. A read changes nothing: no_sequencer, and the client fails over. An
    answer that does come is still relayed to the client as it is."""
    with forwarding_core(tmp_path / "data") as node:  # its driver called directly; core2 is known
        envelope = [b"client"]
        message = Message(kind, "r-1", messages.typed_body(kind, body))
        node._forward(envelope, message, "default", "core2")
        node._tell_outcomes(node.forwarded.expired(node.clock_ms() + 10**9))
        answers = [m for _s, to, m in node._outbox if to == envelope]
        assert [(m.request_id, m.kind, m.body.code) for m in answers] == [("r-1", "error", code)]
        assert b"client" not in node.outstanding
        # An answer from the sequencer is relayed to the client unchanged.
        node._outbox.clear()
        node._forward(envelope, Message(kind, "r-2", messages.typed_body(kind, body)), "default", "core2")
        forward = [m for _s, to, m in node._outbox if not to][-1]  # a read's: under an id of its own
        waiting = node.forwarded.answered(forward.request_id)
        assert waiting is not None
        node._relay(waiting, messages.reply(forward.request_id, {"committed": [1, 2]}))
        answers = [m for _s, to, m in node._outbox if to == envelope]
        assert [(m.request_id, m.kind, m.body.result) for m in answers] == [("r-2", "reply", {"committed": [1, 2]})]


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}),
        ("get", {"table": "t", "key": 1, "consistency": "linearizable"}),
    ],
)
def test_a_sequencer_s_stopping_answer_is_relayed_as_no_sequencer(tmp_path, kind: str, body: dict) -> None:
    """A follower relayed the stopping sequencer's "stopping" (it did nothing with the request) as it
    was. The client takes "stopping" for the node it asked: it never asked that follower again in the
    call, and a client of that one endpoint gave up at once (Unavailable) instead of retrying while a
    new sequencer was elected (a rolling restart). It is "no_sequencer" now, which the client retries."""
    with forwarding_core(tmp_path / "data") as node:  # its driver called directly; core2 is known
        node._outbox.clear()
        node._forward([b"client"], Message(kind, "r-1", messages.typed_body(kind, body)), "default", "core2")
        forward = [m for _s, to, m in node._outbox if not to][-1]  # a read's: under an id of its own
        stopping = messages.error(forward.request_id, "stopping", "core core2 is shutting down")
        node._relay(node.forwarded.answered(forward.request_id), stopping)
        answers = [m for _s, to, m in node._outbox if to == [b"client"]]
        assert [(m.request_id, m.body.code) for m in answers] == [("r-1", "no_sequencer")]
        assert "core core2 is shutting down" in answers[0].body.message
        assert b"client" not in node.outstanding


def test_a_write_forwarded_again_on_a_new_connection_frees_the_earlier_connections_place(tmp_path) -> None:
    """A client that hears nothing closes its socket and resends the same request id on a new one. The
    follower forwarded both under one id: the earlier connection was never answered and its place among
    requests_outstanding_max stayed held for good (one more leaked per such resend). It is told
    outcome_unknown now; the sequencer's answer goes to the resend."""
    with forwarding_core(tmp_path / "data") as node:  # its driver called directly; core2 is known
        body = messages.typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]})
        node._forward([b"first"], Message("transact", "w-1", body), "default", "core2")
        node._forward([b"second"], Message("transact", "w-1", body), "default", "core2")
        assert b"first" not in node.outstanding
        answers = [(to, m.kind, m.body.code) for _s, to, m in node._outbox if to]  # not the forwards
        assert answers == [([b"first"], "error", "outcome_unknown")]
        node._relay(node.forwarded.answered("w-1"), messages.reply("w-1", {"tx_key": [1, 2]}))
        assert node.outstanding == {}


def test_a_forward_dropped_at_send_is_answered_in_the_same_flush_not_at_its_timeout(tmp_path, monkeypatch) -> None:
    """Regression: a forward whose frame was dropped at send (the sequencer's send queue full) was only
    counted (``sends_dropped``): its client waited the forward's timeout (5 s) to hear
    ``outcome_unknown`` for a write that never left this core, ``no_sequencer`` for a read. Nothing
    reached the sequencer, so both are answered ``no_sequencer`` in the flush that dropped the frame,
    as when the forward cannot be sent at all (``CoreNode._unsent``); a write whose earlier forward of
    the same id was sent (rule 4) hears ``outcome_unknown``, since that one may have reached it."""
    from mnesite.rlog import server

    router_frames: list[list[bytes]] = []
    real_send_frames = server.send_frames

    def send_frames(socket, frames):
        if socket.type == zmq.DEALER:
            raise zmq.Again()  # the peer's queue is full
        router_frames.append(frames)
        real_send_frames(socket, frames)

    write = messages.typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]})
    read = messages.typed_body("get", {"table": "t", "key": 1, "consistency": "linearizable"})
    with forwarding_core(tmp_path / "data") as node:  # its driver called directly; core2 is known
        node._outbox.clear()
        node._forward([b"writer"], Message("transact", "w-1", write), "default", "core2")
        node._forward([b"reader"], Message("get", "r-1", read), "default", "core2")
        monkeypatch.setattr(server, "send_frames", send_frames)
        node.flush()
        answers = {bytes(frames[0]): messages.decode(frames[-1]) for frames in router_frames}
        assert {to: (m.request_id, m.kind, m.body.code) for to, m in answers.items()} == {
            b"writer": ("w-1", "error", "no_sequencer"),
            b"reader": ("r-1", "error", "no_sequencer"),
        }
        assert "core2" in answers[b"writer"].body.message and "nothing was sent" in answers[b"writer"].body.message
        assert len(node.forwarded) == 0 and node.outstanding == {} and node._outbox == []
        # A resend of a write whose first forward was sent: that one may have reached the sequencer.
        monkeypatch.setattr(server, "send_frames", real_send_frames)
        node._forward([b"writer"], Message("transact", "w-2", write), "default", "core2")
        node.flush()
        monkeypatch.setattr(server, "send_frames", send_frames)
        router_frames.clear()
        node._forward([b"again"], Message("transact", "w-2", write), "default", "core2")
        node.flush()
        answers = {bytes(frames[0]): messages.decode(frames[-1]) for frames in router_frames}
        assert {to: (m.request_id, m.body.code) for to, m in answers.items()} == {
            b"writer": ("w-2", "outcome_unknown"),  # replaced by the resend (rule 4)
            b"again": ("w-2", "outcome_unknown"),
        }


def test_the_loop_does_not_wait_on_a_machine_it_does_not_tick(tmp_path) -> None:
    """A shard whose rows a snapshot is replacing is not ticked (it does not campaign meanwhile). Its
    machine's deadline counted for the poll all the same: once passed, the loop polled without waiting
    and spun a CPU for the whole install."""
    node = CoreNode(node_config(tmp_path / "data", free_port()))
    node.bind()
    try:
        driver = node._shard_for("default", create=True)
        node.not_serving["default"] = "installing a snapshot at (1, 1)"
        timeouts: list[int] = []
        poll = node.poll
        node.poll = lambda timeout_ms: (timeouts.append(timeout_ms), poll(timeout_ms))[1]
        passed_ms = driver.consensus.next_deadline_ms() + 1
        while node.clock_ms() < passed_ms + 200:
            node.run_turn()
        assert len(timeouts) < 20 and min(timeouts[1:]) > 0, timeouts
    finally:
        node.close()


def _sequencer_of_one(tmp_path):
    """A bound core of one, not served (the test calls its rules), sequencer of ``default`` with its
    no-op committed; the caller closes it."""
    node = CoreNode(node_config(tmp_path / "data", free_port()))
    node.bind()
    driver = node._shard_for("default", create=True)

    def no_op_committed() -> bool:  # one core: it elects itself and commits its no-op
        return driver.consensus.committed_key.generation == driver.consensus.generation

    run_turns_until(node, no_op_committed, "its no-op's commit")
    return node, driver


def _add_core9(request_id: str = "m-1") -> Message:
    """An operator's request to add core9 to ``default`` (its learner never answers unless told to)."""
    body = {"shard": "default", "action": "add", "name": "core9", "endpoint": "tcp://127.0.0.1:9"}
    return Message("membership_change", request_id, messages.typed_body("membership_change", body))


def test_a_membership_change_requested_again_on_a_new_connection_frees_the_earlier_connections_place(
    tmp_path,
) -> None:
    """An add waits while its core catches up as a learner (minutes, at most learner_catch_up_ms_max);
    a client that heard nothing asks again with the same request id on a new connection. The earlier
    connection was never answered and its place among requests_outstanding_max stayed held for good."""
    node, driver = _sequencer_of_one(tmp_path)
    try:
        node._outbox.clear()
        request = _add_core9()
        node._membership_change([b"first"], request)
        node._membership_change([b"second"], request)
        assert driver.consensus.status().learner == "core9"
        assert b"first" not in node.outstanding and set(node.outstanding[b"second"]) == {"m-1"}
        answers = [(to, m.kind, m.body.code) for _s, to, m in node._outbox if to]  # not the forwards
        assert answers == [([b"first"], "error", "outcome_unknown")]
    finally:
        node.close()


def test_a_membership_change_whose_append_found_the_disk_full_is_answered_and_forgotten(tmp_path, monkeypatch) -> None:
    """Regression: an add whose learner caught up is appended; when that append found the disk full,
    the turn was rolled back and the shard rebuilt (``disk_filled``), but the change stayed in
    ``pending_changes``: its client was never answered (its connection's place held) and a retry with
    its request id was taken for the pending change and never answered either, until a restart. It
    is told ``outcome_unknown``, as the writes waiting for their entries are, and forgotten: once
    space is back the change can be asked again."""
    import apsw
    from mnesite.core.consensus import AppendReply, MessageReceived, Role

    node, driver = _sequencer_of_one(tmp_path)
    try:
        node._outbox.clear()
        request = _add_core9()
        node._membership_change([b"c1"], request)
        assert driver.consensus.status().learner == "core9"

        def full(*_args, **_kwargs) -> None:
            raise apsw.FullError("database or disk is full")

        monkeypatch.setattr(node.store, "append_entries", full)
        key = driver.consensus.committed_key
        caught_up = AppendReply(driver.consensus.generation, True, key, key, key)
        with pytest.raises(apsw.FullError):
            node._step(driver, MessageReceived("core9", caught_up))  # the learner caught up: the add is appended
        monkeypatch.undo()
        node.abandon_turn("database or disk is full")  # NodeServer.turn
        node.disk.filled("database or disk is full", 0)
        node.disk_filled()
        answers = [(to, m.request_id, m.body.code) for _s, to, m in node._outbox]
        assert answers == [([b"c1"], "m-1", "outcome_unknown")], answers
        assert node.pending_changes == {} and node.outstanding == {}
        node._outbox.clear()
        node.disk.freed(0)
        node.disk_freed()
        driver = node.shards["default"]

        def sequencer_again() -> bool:  # one core: it elects itself again and commits its no-op
            consensus = driver.consensus
            return consensus.role is Role.SEQUENCER and consensus.committed_key.generation == consensus.generation

        run_turns_until(node, sequencer_again, "the core of one's re-election")
        node._membership_change([b"c2"], request)  # the client asks again: a change, not one pending
        assert driver.consensus.status().learner == "core9"
    finally:
        node.close()


def test_a_write_over_its_connections_bound_is_refused_before_it_is_proposed(tmp_path) -> None:
    """requests_outstanding_max bounds the requests of one connection that await an answer. It was
    checked once the write's entry was proposed: the write was answered "overloaded" (which says
    nothing changed) and committed all the same. It is checked first now; nothing is written."""
    from mnesite.rlog.errors import OverloadedError

    with core_with_table(tmp_path / "data", extra={"limits": {"requests_outstanding_max": 1}}) as node:
        for number in (1, 2):  # one connection, two writes in one turn (as _serve_waiting takes them)
            body = {"ops": [{"op": "write", "table": "t", "row": {"id": number, "v": "x"}}]}
            try:
                node._dispatch([b"c1"], Message("transact", f"w{number}", messages.typed_body("transact", body)))
            except OverloadedError as error:
                node.refuse([b"c1"], f"w{number}", error)
        node._propose_all()
        answers = [(m.request_id, m.kind, m.body.code) for _s, _to, m in node._outbox]
        assert answers == [("w2", "error", "overloaded")]
        assert node.store.find_request("w1") is not None
        assert node.store.find_request("w2") is None, "refused as overloaded, yet logged"


def test_an_install_request_of_an_abandoned_install_neither_feeds_nor_fails_a_later_one(tmp_path) -> None:
    """A core's snapshot-install requests were matched by shard: the late answer (or the expiry) of a
    request of an install abandoned since was taken by the next install of the same shard, and failed
    it or fed it a stale batch. Each request now names the install that asked."""

    node = CoreNode(node_config(tmp_path / "data", free_port()))  # never bound: its driver called directly
    try:
        _install_answers_of_an_abandoned_install(node)
    finally:
        node.store.close()
        node.data_dir_lock.release()


def _install_answers_of_an_abandoned_install(node: CoreNode) -> None:
    from mnesite.core.snapshot import InstallMode, SnapshotInstall, SnapshotOffer

    node.begin()
    node.store.ensure_shard("default", 0)  # an install steps only on a shard the store holds
    offer = SnapshotOffer("core2", 3, TxKey(3, 50), b"d" * 32)
    earlier, later = SnapshotInstall(offer, 2, 1000, 0), SnapshotInstall(offer, 2, 1000, 0)
    later.start()
    node.installs["default"] = later
    refused = messages.error("install-1", "not_serving", "gone")
    node._on_install_answer(("default", "tables", {}, 0, earlier), refused)
    assert node.installs.get("default") is later and later.mode is not InstallMode.ABANDONED
    node.install_requests["install-2"] = ("default", "tables", {}, 0, earlier)
    node._expire_forwarded()
    assert node.installs.get("default") is later and later.mode is not InstallMode.ABANDONED
    # The later install's own failed request still abandons it, and status says why nothing is served.
    node.not_serving["default"] = "installing a snapshot at (3, 50)"  # as BeginInstall left it
    node._on_install_answer(("default", "tables", {}, 0, later), refused)
    assert "default" not in node.installs and later.mode is InstallMode.ABANDONED
    assert "abandoned" in node.not_serving["default"] and "another offer" in node.not_serving["default"]


def test_a_watch_naming_the_endpoint_of_a_core_is_refused(thread_node: ThreadNode, client: Client):
    """Regression: the pushes of a watch go to its endpoint through the core's DEALER for it, and a
    core's peers are reached through the DEALER of their endpoint: a watch naming a core's endpoint
    put its pushes (a window of them per watch, again at every new watch) in the queue of that
    core's appends and heartbeats (DESIGN invariant 11), whose socket is never closed for it."""

    def watch(endpoint: str) -> object:
        return client.call("watch", watch_body("rep1", endpoint))

    with pytest.raises(MnesiteError) as refused:
        watch(thread_node.endpoint)
    assert refused.value.code == "bad_request" and "endpoint of core core1" in str(refused.value)
    assert thread_node.node.agent_server.agents_of() == 0
    assert watch(f"tcp://127.0.0.1:{thread_node.port + 1}")["mode"] == "resume"


def test_a_watch_naming_a_cores_endpoint_spelt_another_way_is_refused(thread_node: ThreadNode, client: Client):
    """Regression: the check above compared endpoints as strings, so ``tcp://localhost:PORT`` (or
    ``tcp://LocalHost.:PORT``, ``tcp://[::1]:PORT``) passed for a core at ``tcp://127.0.0.1:PORT`` and
    its pushes went to that core after all (``rlog.types.endpoint_identity``)."""
    port = thread_node.port
    for alias in (
        f"tcp://localhost:{port}",
        f"tcp://LocalHost.:{port}",
        f"tcp://[::1]:{port}",
        f"tcp://0.0.0.0:{port}",
    ):
        with pytest.raises(MnesiteError) as refused:
            client.call("watch", watch_body("rep1", alias))
        assert refused.value.code == "bad_request" and "endpoint of core core1" in str(refused.value), alias
    assert thread_node.node.agent_server.agents_of() == 0
    assert client.call("watch", watch_body("rep1", f"tcp://localhost:{port + 1}"))["mode"] == "resume"


def test_a_count_runs_on_a_query_worker_or_on_the_loop_for_a_table_not_committed_yet(tmp_path) -> None:
    """A ``count`` reads the whole table, so it runs on a query worker (``NodeServer.count_later``)
    and is answered from there. A table this turn created is not in the workers' snapshots yet: its
    count is taken on the loop (at most a turn's rows), not refused as unknown."""
    from mnesite.core.node import HELD
    from mnesite.rlog.types import CreateTableOp, WriteOp

    node, driver = _sequencer_of_one(tmp_path)
    try:
        columns = (("id", "INTEGER"), ("v", "TEXT"))
        node.begin()
        node.store.apply_ops_batched([CreateTableOp("t", "default", "id", columns), WriteOp("t", {"id": 1, "v": "a"})])
        count = Message("count", "c-1", messages.typed_body("count", {"table": "t"}))
        assert node._read([b"client"], count) == {"rows": 1}  # the turn's transaction holds the table
        node.flush()
        assert node._read([b"client"], count) is HELD and set(node.outstanding[b"client"]) == {"c-1"}
        deadline = time.monotonic() + 10
        while not any(message.request_id == "c-1" for _s, _to, message in node._outbox):
            assert time.monotonic() < deadline, "the count was not answered"
            select.select([node.queries.wakeup_fd], [], [], 0.05)  # a worker writes it when done
            node.serve_queries(node._query_shard_reached)
        [(to, answer)] = [(to, m) for _s, to, m in node._outbox if m.request_id == "c-1"]
        assert to == [b"client"] and answer.kind == "reply" and answer.body.result == {"rows": 1}
        assert node.queries.statistics()["queries"] == 1
    finally:
        node.close()


@pytest.mark.timeout(60)
def test_a_force_start_refused_in_one_shard_says_which_shards_it_forced(tmp_path, monkeypatch) -> None:
    """Each shard's machine decides for itself: one may be forced while another refuses (its rows
    half copied, a member reached ahead of this core, a majority reached in a membership that a
    half-done change left different). The refusal said only "force-start refused" and the refused
    shards' reasons, so the operator took it that nothing was forced, while the other shards ran in
    a forced generation with the other cores left out."""
    from mnesite.rlog.errors import RequestError

    from tests.conftest import follower_by_hand

    with follower_by_hand(tmp_path / "data") as (node, driver):
        node.store.ensure_shard("other", 0)
        other = node._open_shard("other")
        node.rows_lost.add("other")  # as an abandoned install leaves it
        monkeypatch.setattr(node, "probe_peers", lambda timeout_ms: {})  # no other core answers
        with pytest.raises(RequestError) as refused:
            node.force_start()
        assert refused.value.code == "force_start_refused"
        assert driver.consensus.sequencer == "core1" and other.consensus.sequencer is None
        message = str(refused.value)
        assert "shard other: " in message and "half copied" in message
        assert "FORCED shard default (generation 1, members core1" in message


@pytest.mark.timeout(60)
def test_a_force_start_reports_as_members_only_the_members_it_kept(tmp_path, monkeypatch) -> None:
    """The probe asks every core whose endpoint this core knows, and endpoints are never forgotten: a
    removed core still running answers it. The machine keeps only members; the answer (``members``,
    what the CLI prints after FORCE-STARTED) named every core that answered."""
    from tests.conftest import follower_by_hand

    with follower_by_hand(tmp_path / "data") as (node, driver):
        removed = {"shards": {"default": {"generation": 0, "last": [0, 0]}}}
        monkeypatch.setattr(node, "probe_peers", lambda timeout_ms: {"core9": removed})
        result = node.force_start()
        assert driver.consensus.members == ("core1",)
        assert result["members"] == ["core1"] and result["shards"]["default"]["members"] == ["core1"]
        assert result["left_out"] == ["core2", "core3"] and result["reached"] == ["core9"]


def test_a_membership_change_that_gets_no_answer_is_outcome_unknown_and_never_moves() -> None:
    # A membership change is logged like a write (the sequencer applies its request id once). Silence
    # ended in Unavailable, which says it was not applied, and a client of several endpoints moved it
    # to the next one after its first silent attempt.
    silent, other = ScriptedNode([None] * 5), ScriptedNode([None] * 5)
    try:
        endpoints = [silent.endpoint, other.endpoint]
        with Client(endpoints, timeout_ms=100, retries=1) as client, pytest.raises(OutcomeUnknown) as info:
            client.change_membership("default", "remove", "core2")
        assert "membership_change" in str(info.value)
        assert len(silent.requests) == 2 and other.requests == []  # asked again where it may have happened
    finally:
        silent.close()
        other.close()


def test_a_read_after_a_key_with_a_long_timeout_asks_for_the_longest_wait_a_node_allows(
    thread_node: ThreadNode, client: Client
) -> None:
    # A timeout above 667 s made the wait asked for pass the schema's 600,000 ms: refused before sending.
    tx_key = client.put("users", {"id": 7, "name": "ada"})
    with Client(thread_node.endpoint, timeout_ms=900_000) as patient:
        assert patient.get("users", 7, after_tx_key=tx_key)["name"] == "ada"


def _dispatch_and_answer(node: CoreNode, envelope: bytes, kind: str, request_id: str, body: dict) -> None:
    """Dispatch a request to a core driven by hand, refusing it as ``_serve_waiting`` would."""
    from mnesite.core.node import Deferred
    from mnesite.rlog.errors import OverloadedError, RequestError
    from mnesite.rlog.schema import SchemaError

    try:
        node._dispatch([envelope], Message(kind, request_id, messages.typed_body(kind, body)))
    except Deferred:
        pass
    except (RequestError, SchemaError, OverloadedError) as error:
        node.refuse([envelope], request_id, error)


def test_a_guard_on_an_applied_row_while_an_added_column_is_uncommitted_reads_it_with_that_column_null(
    tmp_path,
) -> None:
    """A guard is evaluated against the applied state plus the unapplied tail, with the catalog as the
    tail leaves it. With an ``add_column`` not applied yet, a guard on a row already applied read it
    with that catalog: SQLite took the quoted name of the column it does not have yet for a string,
    so the guard saw the row with ``w = "w"``, a value it never has: a guard naming that passed (and
    wrote), one naming the row as it will be (``w`` null) failed. A row the tail wrote before the
    column was added lacked it, and failed the same guard. Both now read the row as the apply will
    leave it: the added column null."""
    with core_with_table(tmp_path / "data") as node:
        write_1 = {"ops": [{"op": "write", "table": "t", "row": {"id": 1, "v": "a"}}]}
        _dispatch_and_answer(node, b"c1", "transact", "w1", write_1)
        node._propose_all()  # a write without guards is held for the turn's batch
        # One core: it commits and applies w1.
        run_turns_until(
            node, lambda: node.store.shard("default").applied >= node.store.find_request("w1")[1], "w1's apply"
        )
        node._outbox.clear()
        told: dict[str, tuple[str, object]] = {}
        reply = node.reply
        node.reply = lambda envelope, message, now=False: (
            told.setdefault(message.request_id, (message.kind, getattr(message.body, "code", None))),
            reply(envelope, message, now),
        )
        # One turn: a write of row 2, the column added, then guards naming each row with the column null.
        write_2 = {"ops": [{"op": "write", "table": "t", "row": {"id": 2, "v": "b"}}]}
        _dispatch_and_answer(node, b"c2", "transact", "w2", write_2)
        _dispatch_and_answer(node, b"c3", "add_column", "a1", {"table": "t", "column": "w", "type": "TEXT"})
        phantom = {"guards": [{"table": "t", "key": 1, "equals": {"id": 1, "v": "a", "w": "w"}}], **write_1}
        _dispatch_and_answer(node, b"c5", "transact", "g0", phantom)
        assert node.store.find_request("g0") is None, "a guard passed on a value the row never has"
        driver = node.shards["default"]
        assert driver.tail.held_count() == 1  # failed against the uncommitted tail: told once it commits
        for number, v in ((1, "a"), (2, "b")):
            guarded = {
                "guards": [{"table": "t", "key": number, "equals": {"id": number, "v": v, "w": None}}],
                "ops": [{"op": "write", "table": "t", "row": {"id": number, "v": v, "w": "x"}}],
            }
            _dispatch_and_answer(node, b"c4", "transact", f"g{number}", guarded)
        node._propose_all()
        assert [request_id for request_id, (kind, _) in told.items() if kind == "error"] == []
        assert node.store.find_request("g1") is not None and node.store.find_request("g2") is not None
        run_turns_until(
            node, lambda: node.store.shard("default").applied >= node.store.find_request("g2")[1], "g2's apply"
        )
        assert told.get("g0") == ("error", "guard_failed"), told
        table = node.store.catalog()["t"]
        assert node.store.read_row(table, 1) == {"id": 1, "v": "a", "w": "x"}
        assert node.store.read_row(table, 2) == {"id": 2, "v": "b", "w": "x"}


def test_an_append_that_would_replace_a_committed_entry_stops_the_shard_not_the_node(tmp_path) -> None:
    """``ConsensusInvariantError`` (a peer's append would replace an entry this core holds committed: a
    core left out by a forced start whose journal diverges, or a broken peer) means "stop serving the
    shard and alert the operator" (core.consensus, driver contract 5; docs: Force start). It went out
    of the loop turn and stopped the node, every shard with it, and again at each restart as the
    sequencer's next append came. The shard stops now, loudly: its machine is never stepped again in
    this process, it serves no read (``not_serving_reason`` says why), takes no write (``no_sequencer``:
    the client asks another core) and is not ticked; the node serves its other shards."""
    from mnesite.core.consensus import AppendRequest, MessageReceived
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.schema import define_table
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, make_entry

    from tests.conftest import follower_by_hand

    members = ("core1", "core2", "core3")
    with follower_by_hand(tmp_path / "data") as (node, driver):
        table = define_table("t", "id", [["id", "INTEGER"]], "default")
        first = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (table.to_op(),), "a")
        second = make_entry("default", TxKey(1, 2), first.tx_key, first.digest, (), "b")
        committed = AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, second.tx_key, members, (first, second))
        node._step(driver, MessageReceived("core2", committed))
        assert driver.consensus.committed_key == second.tx_key
        other = make_entry("default", TxKey(1, 2), first.tx_key, first.digest, (), "other")
        diverging = AppendRequest(2, first.tx_key, first.digest, other.tx_key, members, (other,))
        assert node._step(driver, MessageReceived("core3", diverging)) == []
        reason = node._not_serving_reason("default")
        assert reason is not None and "different entry at committed key (1, 2)" in reason
        assert not node._ticked(driver)
        assert node._step(driver, MessageReceived("core2", committed)) == [], "its machine is stepped no more"
        view = node._view(driver)
        assert not view.is_sequencer and view.sequencer is None
        write = {"ops": [{"op": "write", "table": "t", "row": {"id": 1}}]}
        with pytest.raises(RequestError) as refused:
            node._write([b"c1"], Message("transact", "w1", messages.typed_body("transact", write)))
        assert refused.value.code == "no_sequencer"
        shard_status = node.status()["shards"]["default"]
        assert shard_status["serving"] is False and "different entry" in shard_status["not_serving_reason"]
        assert node.journal()["shards"]["default"]["hears_sequencer"] is False
        with pytest.raises(RequestError) as forced:
            node.force_start()  # its machine would not step: it must not be reported forced
        assert "stopped on this core" in forced.value.detail["refused"]["default"]


def _applied_two_entries_and_holds_a_changefeed(node, driver, second_ops=(), tables=()) -> tuple:
    """``core1`` of ``follower_by_hand`` applies two committed entries from ``core2`` (table ``t``'s
    creation, then ``second_ops``) and holds a ``changes`` request of shard ``default`` (of ``tables``;
    none: of every table, so of every shard) caught up at the second (envelope ``held``, id
    ``held-1``): ``(first, second)``."""
    from mnesite.core.consensus import AppendRequest, MessageReceived
    from mnesite.rlog.schema import define_table
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, make_entry

    from tests.conftest import changes_of_default, queued_to

    members = ("core1", "core2", "core3")
    table = define_table("t", "id", [["id", "INTEGER"]], "default")
    first = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (table.to_op(),), "a")
    second = make_entry("default", TxKey(1, 2), first.tx_key, first.digest, tuple(second_ops), "b")
    append = AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, second.tx_key, members, (first, second))
    node._step(driver, MessageReceived("core2", append))
    node._apply_gathered(driver)
    assert node.store.shard("default").applied == second.tx_key
    request = changes_of_default("held-1", second.tx_key)
    if tables:
        body = {"tables": list(tables), "positions": [{"shard": "default", "after": list(second.tx_key)}]}
        request = Message("changes", "held-1", messages.typed_body("changes", {**body, "wait_ms": 60_000}))
    node._dispatch([b"held"], request)
    node.serve_changes()
    assert node.changes_statistics()["held"] == 1 and not queued_to(node, [b"held"])
    return first, second


@pytest.mark.parametrize("state", ["stuck", "stopped"])
def test_a_changefeed_request_held_at_a_core_is_answered_as_soon_as_its_shard_s_log_is_stuck_or_stopped(
    tmp_path, monkeypatch, state
) -> None:
    """A ``changes`` request held at a core (caught up, waiting for its shard to move) waited out its
    whole ``wait_ms`` when the core's log of that shard got stuck (it refused an entry of a cluster
    version it does not speak) or the shard stopped on it (a peer's append would replace a committed
    entry): the applied key no longer moves, so nothing woke it, although a request asked meanwhile
    is refused at once (``not_ready``). It is now answered in that turn, with that same answer."""
    from mnesite.core.consensus import AppendRequest, MessageReceived
    from mnesite.rlog.errors import RequestError
    from mnesite.rlog.types import ClusterVersionOp, make_entry
    from mnesite.rlog.versions import SPEAK_ONLY_ENV

    from tests.conftest import changes_of_default, follower_by_hand, queued_to

    monkeypatch.setenv(SPEAK_ONLY_ENV, "1")  # this core speaks cluster version 1 only
    members = ("core1", "core2", "core3")
    with follower_by_hand(tmp_path / "data") as (node, driver):
        first, second = _applied_two_entries_and_holds_a_changefeed(node, driver)
        applied = second.tx_key
        if state == "stuck":
            moved = make_entry("default", TxKey(1, 3), second.tx_key, second.digest, (ClusterVersionOp("default", 2),))
            append = AppendRequest(1, second.tx_key, second.digest, second.tx_key, members, (moved,))
            node._step(driver, MessageReceived("core2", append))
            assert driver.consensus.stuck_reason is not None and "default" not in node.stopped
        else:
            other = make_entry("default", TxKey(1, 2), first.tx_key, first.digest, (), "other")
            node._step(
                driver,
                MessageReceived("core3", AppendRequest(2, first.tx_key, first.digest, other.tx_key, members, (other,))),
            )
            assert "default" in node.stopped
        assert node.store.shard("default").applied == applied  # nothing moved
        node.serve_changes()
        (answer,) = queued_to(node, [b"held"])
        assert node.changes_statistics()["held"] == 0
        with pytest.raises(RequestError) as now:  # what a request asked now gets
            node._dispatch([b"now"], changes_of_default("asked-now", applied))
        assert (answer.request_id, answer.kind, answer.body.code) == ("held-1", "error", "not_ready")
        assert answer.body.message == str(now.value)


def test_a_turn_asks_whether_shards_serve_changes_only_of_the_shards_held_requests_follow(
    tmp_path, monkeypatch
) -> None:
    """``CoreNode.shards_not_serving_changes`` judged every shard the core knows, each turn a changefeed
    request was held: a turn's cost grew with the node's shards, not with what was held. It is asked
    about the held requests' shards only, and still answers one whose shard stopped serving at once."""
    from tests.conftest import follower_by_hand, queued_to

    with follower_by_hand(tmp_path / "data") as (node, driver):
        for index in range(20):  # shards no held request follows
            node.store.ensure_shard(f"other{index}", 0)
            node._open_shard(f"other{index}")
        _applied_two_entries_and_holds_a_changefeed(node, driver, tables=["t"])  # follows shard default only
        asked: list[str] = []
        judge = node._not_serving_reason
        monkeypatch.setattr(node, "_not_serving_reason", lambda shard: asked.append(shard) or judge(shard))
        node.serve_changes()
        assert asked == ["default"] and node.changes_statistics()["held"] == 1
        node.rows_lost.add("default")
        node.serve_changes()
        (answer,) = queued_to(node, [b"held"])
        assert (answer.kind, answer.body.code) == ("error", "not_ready")


def test_an_add_of_a_member_at_another_endpoint_changes_nothing(tmp_path) -> None:
    """``cluster add-core`` of a core that is already a member is answered ``already_member`` (a
    retry finishing a half-done change): it must leave the member's endpoint alone. The sequencer
    learned (and persisted) the endpoint given before the machine refused the change, so a mistyped
    one cut the member off: its appends went to the new endpoint, and with two cores no write committed."""
    ports = {name: free_port() for name in ("core1", "core2")}
    cores = {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()}
    nodes = [
        ThreadNode(tmp_path / name, {"cluster": {"core_nodes": cores}}, port=ports[name], name=name) for name in cores
    ]
    try:
        with Client(list(cores.values()), timeout_ms=5000, retries=5) as client:
            client.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
            sequencer = client.members()["shards"]["default"]["sequencer"]
        member = next(name for name in cores if name != sequencer)
        with Client(cores[sequencer], timeout_ms=5000) as client:
            answer = client.change_membership("default", "add", member, f"tcp://127.0.0.1:{free_port()}")
            assert answer["unchanged"] == "already_member"
            assert client.members()["endpoints"][member] == cores[member]
        with Client(cores[sequencer], timeout_ms=3000, retries=0) as client:
            client.put("t", {"id": 1, "v": "both cores still commit"})
    finally:
        for node in nodes:
            node.stop()


def test_a_core_a_forced_start_left_out_serves_no_read_of_the_shard(tmp_path) -> None:
    """A core told that a forced start left it out of a shard refused writes for it, but still served
    its gets, scans, SQL queries and changefeed pages (a held one waited on) from an applied state
    that no longer moves, with no lag anywhere to say so: a client reading ``local`` there read frozen,
    possibly diverged, rows for as long as the core ran. Every read of the shard is ``not_ready`` now
    (the client asks another node), a held changefeed request is answered so at once, and ``status``
    says why."""
    from mnesite.core.consensus import ExclusionNotice, MessageReceived
    from mnesite.rlog.types import WriteOp

    from tests.conftest import follower_by_hand, queued_to

    with follower_by_hand(tmp_path / "data") as (node, driver):
        _, second = _applied_two_entries_and_holds_a_changefeed(node, driver, (WriteOp("t", {"id": 1}),))
        applied = second.tx_key
        assert node._not_serving_reason("default") is None

        notice = ExclusionNotice(3, ("core2",), second.tx_key, second.digest)
        node._step(driver, MessageReceived("core2", notice))
        assert driver.consensus.excluded and node.excluded["default"]["generation"] == 3
        node.serve_changes()
        (answer,) = queued_to(node, [b"held"])
        assert (answer.kind, answer.body.code) == ("error", "not_ready")
        assert "forced start (generation 3)" in answer.body.message

        _refuses_every_read_of_default_as_left_out(node, applied, 3)
        assert node.status()["shards"]["default"]["excluded"]["by"] == "core2"


LOCAL_READS_OF_T = {"get": {"table": "t", "key": 1}, "scan": {"table": "t"}, "query": {"sql": "SELECT id FROM t"}}


def _refuses_every_read_of_default_as_left_out(node, applied, generation: int) -> None:
    """``node`` answers every read of shard ``default`` (get, scan, query, a changefeed page, a table it
    does not know) ``not_ready``, naming the forced start; its ``status`` and ``journal`` say it is out."""
    from mnesite.rlog.errors import RequestError

    from tests.conftest import changes_of_default

    for kind, body in LOCAL_READS_OF_T.items():
        with pytest.raises(RequestError) as refused:
            node._dispatch([b"c1"], Message(kind, f"r-{kind}", messages.typed_body(kind, body)))
        assert refused.value.code == "not_ready", kind
        assert f"left out of the shard by a forced start (generation {generation})" in str(refused.value), kind
    with pytest.raises(RequestError) as refused:
        node._dispatch([b"c1"], changes_of_default("asked-now", applied))
    assert refused.value.code == "not_ready"
    with pytest.raises(RequestError) as unknown:  # it cannot know the forced generation's tables
        node._dispatch([b"c1"], Message("get", "r-u", messages.typed_body("get", {"table": "u", "key": 1})))
    assert unknown.value.code == "not_ready"

    shard_status = node.status()["shards"]["default"]
    assert shard_status["excluded"]["generation"] == generation and shard_status["serving"] is False
    assert f"forced start (generation {generation})" in shard_status["not_serving_reason"]
    assert node.journal()["shards"]["default"]["hears_sequencer"] is False


def test_a_core_a_forced_start_left_out_stays_out_after_a_restart_until_it_is_added_back(tmp_path) -> None:
    """The exclusion lived only in memory: restarted, the left-out core was a follower again that hears
    no sequencer, and served gets, scans, queries and changefeed pages of a state that no longer moves
    (its journal may even diverge from the forced history) until a member of the forced generation told
    it again. It is persisted: from its first turn after the restart it refuses them as before, and
    does not campaign; the entry that adds it back ends it, durably too."""
    from mnesite.core.consensus import AppendRequest, ExclusionNotice, MessageReceived
    from mnesite.core.consensus_wire import message_to_wire
    from mnesite.rlog.types import MembersOp, WriteOp, make_entry

    from tests.conftest import follower_by_hand, queued_to

    data_dir = tmp_path / "data"
    with follower_by_hand(data_dir) as (node, driver):
        _, second = _applied_two_entries_and_holds_a_changefeed(node, driver, (WriteOp("t", {"id": 1}),))
        node._step(driver, MessageReceived("core2", ExclusionNotice(3, ("core2",), second.tx_key, second.digest)))
        assert driver.consensus.excluded
        node._commit()  # the turn's commit: what a node that stops after it keeps

    with follower_by_hand(data_dir) as (node, driver):
        assert driver.consensus.excluded_generation == 3 and not node._ticked(driver), "out from the first turn"
        _refuses_every_read_of_default_as_left_out(node, second.tx_key, 3)
        assert node.status()["shards"]["default"]["excluded"]["by"] is None, "who told it is not persisted"
        # cluster add-core at the forced sequencer: its forced entry, then the one that adds this core.
        forced = make_entry("default", TxKey(3, 1), second.tx_key, second.digest, (MembersOp(("core2",)),), "f")
        add = make_entry(
            "default",
            TxKey(3, 2),
            forced.tx_key,
            forced.digest,
            (MembersOp(("core1", "core2"), "core1", node.endpoints["core1"]),),
        )
        append = AppendRequest(3, second.tx_key, second.digest, add.tx_key, ("core2",), (forced, add))
        body = {"shard": "default", "sender": "core2", "message": message_to_wire(append)}
        node._on_peer(Message("peer", "peer", messages.typed_body("peer", body)))
        node._apply_gathered(driver)
        assert not driver.consensus.excluded and node.status()["shards"]["default"]["excluded"] is None
        node._commit()

    with follower_by_hand(data_dir) as (node, driver):
        assert not driver.consensus.excluded and node._ticked(driver)
        assert node.store.shard("default").applied == TxKey(3, 2)
        assert node._not_serving_reason("default") is None
        get = Message("get", "r-get", messages.typed_body("get", LOCAL_READS_OF_T["get"]))
        node._dispatch([b"c1"], get)
        (answer,) = queued_to(node, [b"c1"])
        assert (answer.kind, answer.body.result) == ("reply", {"id": 1}), answer
        assert not node.status()["shards"]["default"]["excluded"]


class _PeerJournal:
    """A core's stand-in on a ROUTER: silent until ``answering`` is set, then it answers every request
    with an empty journal (a member of a cluster that never elected anyone)."""

    def __init__(self) -> None:
        from tests.conftest import RouterNode

        self.answering = threading.Event()
        peer = self

        class Router(RouterNode):
            def _serve(self) -> None:
                while not self.stopping.is_set():
                    received = self.receive_message()
                    if received is not None and peer.answering.is_set():
                        self.send(received[0], messages.reply(received[1].request_id, peer.journal))

        self.router = Router()
        self.endpoint = self.router.endpoint
        # What a core answers (the client checks it: ``Client.journal``), with no shard.
        self.journal = {"node": "core2", "core_nodes": {"core2": self.endpoint}, "reachable_peers": [], "shards": {}}


class _RecoveringThenServing(RouterNode):
    """A core that answers the first ``refusals`` requests as a core recovering at start-up does
    (``not_ready`` with its ``recovery`` section), then a put's answer."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.requests: list[str] = []
        super().__init__()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            received = self.receive()
            if received is None:
                continue
            envelope, request_id = received
            self.requests.append(request_id)
            if len(self.requests) <= self.refusals:
                section = {"phase": "asking", "round": 1, "waiting_for": ["core2"]}
                refusal = "core core1 is recovering at start-up ...; ask another core"
                self.send(envelope, messages.error(request_id, "not_ready", refusal, {"recovery": section}))
            else:
                self.send(envelope, messages.reply(request_id, {"tx_key": [1, 1]}))


@pytest.mark.timeout(30)
def test_a_call_to_a_core_recovering_at_start_up_asks_again_until_it_serves() -> None:
    """A script that starts a cluster and at once creates a table was refused ``not_ready`` by the first
    core to answer while it recovered (since it answers ``status`` then; before, nothing listened and
    the call waited for its connection): the call now asks again with its backoff, within its deadline,
    with the same request id (nothing was done). A ``not_ready`` of anything else ends the call as before."""
    node = _RecoveringThenServing(refusals=3)
    try:
        with Client(node.endpoint, timeout_ms=2000, retries=0) as client:
            assert client.put("t", {"id": 1}) == TxKey(1, 1)
        assert len(node.requests) == 4 and len(set(node.requests)) == 1
    finally:
        node.close()
    plain = ScriptedNode([("not_ready", "replicant r3 cannot serve shard default yet")] * 5)
    try:
        with Client(plain.endpoint, timeout_ms=2000, retries=0) as client, pytest.raises(RemoteError) as refused:
            client.get("t", 1)
        assert refused.value.code == "not_ready" and len(plain.requests) == 1
    finally:
        plain.close()


def test_a_recovering_core_answers_status_and_refuses_the_rest_until_its_peers_answer(tmp_path):
    """A core on an empty database, declared ``existing``, waits at start-up until every other member
    answered its journal probe. Its socket is bound meanwhile: ``status`` answers the node's identity
    and a ``recovery`` section (round, peers asked and answered, whom it waits for), ``mnesite status``
    prints it, and a write is refused ``not_ready`` naming the recovery (before: nothing listened, every
    request went unanswered until the recovery ended or gave up). Once the peer answers, the start ends
    and status is the normal answer."""
    from click.testing import CliRunner
    from mnesite.cli.main import main

    peer = _PeerJournal()
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    cluster = {"core_nodes": {"core1": endpoint, "core2": peer.endpoint}, "initial_cluster_state": "existing"}
    config = node_config(tmp_path / "data", port, extra={"cluster": {**cluster, "recovery_timeout_ms": 1000}})
    started: list[CoreNode | BaseException] = []

    def construct() -> None:
        try:
            started.append(CoreNode(config))
        except BaseException as error:
            started.append(error)

    constructing = threading.Thread(target=construct, daemon=True)
    constructing.start()
    node = None
    try:
        with Client(endpoint, timeout_ms=300, retries=0) as client:
            answers: list[dict] = []

            def answered() -> bool:
                assert not started, f"the start ended before status was answered: {started}"
                with contextlib.suppress(Unavailable):
                    answers.append(client.status())
                return bool(answers)

            wait_until(answered, 10, "status answered while the core recovers")
            status = answers[0]
            recovering_status, recovery = status, status["recovery"]
            assert status["node"] == "core1" and status["role"] == "core" and status["shards"] == {}
            assert recovery["waiting_for"] == ["core2"] and recovery["needed"] == 1 and recovery["existing"]
            assert recovery["asked"] == ["core2"] and recovery["answered"] == [] and recovery["round"] >= 1
            # Asked again within the call's deadline (``rlog.client._recovering``), then refused saying why.
            with pytest.raises(Unavailable) as refused:
                client.create_table("t", "id", [("id", "INTEGER")])
            assert refused.value.code == "not_ready", refused.value
            assert "recovering at start-up" in str(refused.value) and "core2" in str(refused.value)
        printed = CliRunner().invoke(main, ["status", "--node", endpoint])
        assert printed.exit_code == 0, printed.output
        assert "RECOVERING at start-up" in printed.output and "waiting for: core2" in printed.output
        assert "no shard yet" not in printed.output
        printed = CliRunner().invoke(main, ["status", "--json", "--node", endpoint])
        assert printed.exit_code == 0 and json.loads(printed.output)["recovery"]["waiting_for"] == ["core2"]
        peer.answering.set()
        constructing.join(timeout=15)
        assert started and isinstance(started[0], CoreNode), started
        node = started[0]
        serving = threading.Thread(target=node.serve_forever, daemon=True)
        serving.start()
        with Client(endpoint, timeout_ms=3000, retries=2) as client:
            status = client.status()
        assert "recovery" not in status and status["node"] == "core1"
        # Every field of the normal answer is in the recovering one: a client that reads them (an older
        # one too, which knows no recovery section) reads a recovering core's answer as well.
        assert set(status) <= set(recovering_status) - {"recovery"}
    finally:
        if node is not None:
            node.request_stop("test over")
            serving.join(timeout=10)
        peer.router.close()
        constructing.join(timeout=15)
