"""A node that stops answers every request it holds, before its socket closes: a write whose entry may
commit is ``outcome_unknown``, anything else ``stopping`` (the client asks another node at once).
Before, a stop dropped them all and each client waited out its whole timeout."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from mnesite.core.node import CoreNode
from mnesite.rlog import client as client_module
from mnesite.rlog import messages
from mnesite.rlog.client import Client, MnesiteError, OutcomeUnknown, Unavailable
from mnesite.rlog.messages import Message
from mnesite.rlog.types import TxKey

from tests.conftest import (
    ScriptedNode,
    ThreadNode,
    close_offline,
    free_port,
    node_config,
    offline_replicant,
    replicant_by_hand,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

CLIENT_TIMEOUT_MS = 10_000
# Well within the client's timeout: what an answer at the stop takes, not a timeout's silence.
PROMPT_S = 2.5


class Asked:
    """A request sent from a thread of its own (the client blocks until it is answered)."""

    def __init__(self, call: Any) -> None:
        self.error: BaseException | None = None
        self.result: Any = None
        self.elapsed_s = 0.0
        self._call = call
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.result = self._call()
        except BaseException as error:  # the test asserts on it
            self.error = error
        self.elapsed_s = time.monotonic() - started

    def join(self) -> None:
        self._thread.join(timeout=CLIENT_TIMEOUT_MS * 3 / 1000)
        if self._thread.is_alive():
            raise AssertionError("the request was not answered")


def held(node: CoreNode) -> bool:
    # An in-memory dict of the node (never its store) read from the test thread: only whether it is empty.
    return bool(node.outstanding)


def test_a_query_waiting_for_a_key_is_answered_stopping_when_the_node_stops(tmp_path: Path) -> None:
    node = ThreadNode(tmp_path / "data")
    try:
        with node.client(timeout_ms=CLIENT_TIMEOUT_MS) as client:
            client.create_table("users", "id", [("id", "INTEGER")])

        def ask() -> Any:
            with node.client(timeout_ms=CLIENT_TIMEOUT_MS, retries=0) as client:
                return client.query("SELECT * FROM users", after_tx_key=TxKey(99, 1), timeout_ms=CLIENT_TIMEOUT_MS)

        asked = Asked(ask)
        wait_until(lambda: held(node.node), 5, "the query held until its key is applied")
    finally:
        node.stop()
    asked.join()
    assert isinstance(asked.error, Unavailable), asked.error
    assert asked.error.code == "stopping"
    assert asked.elapsed_s < PROMPT_S, str(asked.error)


def test_a_query_running_on_a_worker_is_interrupted_and_answered_when_the_node_stops(tmp_path: Path) -> None:
    # A statement that runs until its budget (20 s here) unless interrupted.
    node = ThreadNode(tmp_path / "data", extra={"limits": {"query_ms_max": 20_000}})
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    try:

        def ask() -> Any:
            with node.client(timeout_ms=CLIENT_TIMEOUT_MS, retries=0) as client:
                return client.query(endless, timeout_ms=CLIENT_TIMEOUT_MS)

        asked = Asked(ask)
        wait_until(lambda: node.node.queries.queries > 0, 5, "the query started on a worker")
    finally:
        stopping = time.monotonic()
        node.stop()
        stopped_s = time.monotonic() - stopping
    asked.join()
    assert isinstance(asked.error, Unavailable), asked.error
    assert asked.error.code == "stopping"
    assert asked.elapsed_s < PROMPT_S, str(asked.error)
    assert stopped_s < PROMPT_S  # the worker was interrupted, not waited on for its budget


def test_requests_queued_in_the_socket_are_answered_stopping(tmp_path: Path) -> None:
    """Requests the loop never read (in zmq's queue when the node stops) are answered too."""
    node = CoreNode(node_config(tmp_path / "data", free_port()))
    node.bind()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(node.config.listen)
    try:
        for request_id in ("q-1", "q-2"):
            socket.send(
                messages.encode(Message("get", request_id, messages.typed_body("get", {"table": "t", "key": 1})))
            )
        # Both frames are in the node's socket (the node is not served: this thread owns it).
        assert node.socket is not None
        wait_until(lambda: node.socket.poll(0), 5, "the requests in the node's socket")
        node.request_stop("test")
        node.serve_forever()  # stops at once: answers what it holds and closes
        answers = []
        for _ in range(2):
            assert socket.poll(5000), "no answer"
            answers.append(messages.decode(socket.recv()))
    finally:
        socket.close(0)
    assert sorted((a.request_id, a.kind, a.body.code) for a in answers) == [
        ("q-1", "error", "stopping"),
        ("q-2", "error", "stopping"),
    ]


# The first election waits the election timeout, and the sequencer keeps its role that long after it
# last heard the followers: from the followers' stop to its own, a test has its minimum (the stops, a
# request and the wait for it to be held take about 0.35 s on a loaded two-CPU machine).
ELECTION_TIMEOUT_MS = (1500, 2000)


class SequencerAlone:
    """Three cores in threads, then the followers stopped: the sequencer's writes cannot commit, and
    it keeps its role until its election timeout (``ELECTION_TIMEOUT_MS``). ``stop(name)`` stops one core."""

    names = ("core1", "core2", "core3")

    def __init__(self, tmp_path: Path) -> None:
        ports = {name: free_port() for name in self.names}
        self.cores = {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()}
        timing = {
            "core_nodes": self.cores,
            "recovery_timeout_ms": 50,
            "election_timeout_ms_min": ELECTION_TIMEOUT_MS[0],
            "election_timeout_ms_max": ELECTION_TIMEOUT_MS[1],
            "heartbeat_interval_ms": 100,
        }
        self.nodes: dict[str, CoreNode] = {}
        self.threads: dict[str, threading.Thread] = {}
        for name in self.names:
            node = CoreNode(node_config(tmp_path / name, ports[name], name=name, extra={"cluster": timing}))
            node.bind()
            self.nodes[name] = node
            self.threads[name] = threading.Thread(target=node.serve_forever, daemon=True)
            self.threads[name].start()
        self.sequencer = ""

    def __enter__(self) -> SequencerAlone:
        with Client(list(self.cores.values()), timeout_ms=15_000) as client:
            client.create_table("users", "id", [("id", "INTEGER")])
        for name in self.names:
            with Client(self.cores[name], timeout_ms=2000) as client:
                if client.status()["shards"]["default"]["role"] == "sequencer":
                    self.sequencer = name
        assert self.sequencer
        for name in self.names:
            if name != self.sequencer:
                self.stop(name)
        return self

    def stop(self, name: str) -> None:
        self.nodes[name].request_stop("stopped by its owner")
        self.threads[name].join(timeout=10)
        assert not self.threads[name].is_alive()

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            if self.threads[name].is_alive():
                self.stop(name)


def test_a_write_waiting_for_its_commit_is_outcome_unknown_when_the_sequencer_stops(tmp_path: Path) -> None:
    """Three cores; the followers stop, so the sequencer's write cannot commit; the sequencer stops
    before its election timeout would make it step down: the client hears outcome_unknown at once."""
    with SequencerAlone(tmp_path) as cluster:
        sequencer = cluster.sequencer

        def write() -> Any:
            with Client(cluster.cores[sequencer], timeout_ms=CLIENT_TIMEOUT_MS, retries=0) as client:
                return client.put("users", {"id": 1})

        asked = Asked(write)
        wait_until(lambda: held(cluster.nodes[sequencer]), 5, "the write waiting for its commit")
        cluster.stop(sequencer)
    asked.join()
    # Answered outcome_unknown at the stop (the client then tried the same request id again there, was
    # told stopping or found the node gone, and gave up at once), not after its timeout's silence.
    assert isinstance(asked.error, OutcomeUnknown), asked.error
    assert cluster.nodes[sequencer].stop_answers >= 1  # and the retry, if it came before the socket closed
    assert asked.elapsed_s < PROMPT_S, str(asked.error)


def test_resends_of_a_waiting_write_on_one_connection_wait_as_one(tmp_path: Path) -> None:
    """A connection that sent the same request id again and again while its entry could not commit
    added a commit waiter each time (its held requests counted it once): memory without bound. At
    most ``RESENDS_WAITING_MAX`` of them wait."""
    from mnesite.core.outcome import RESENDS_WAITING_MAX

    with SequencerAlone(tmp_path) as cluster:
        node = cluster.nodes[cluster.sequencer]
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(cluster.cores[cluster.sequencer])
        try:
            write = Message("transact", "resent-1", {"ops": [{"op": "write", "table": "users", "row": {"id": 1}}]})
            for _ in range(200):
                dealer.send(messages.encode(write))
            dealer.send(messages.encode(Message("status", "after-the-resends", {})))
            assert dealer.poll(10_000), "the status after the resends was not answered"
            answered = [messages.decode(dealer.recv(), 1 << 22).request_id]
            while dealer.poll(0):
                answered.append(messages.decode(dealer.recv(), 1 << 22).request_id)
            assert answered == ["after-the-resends"]  # the write waits for its commit, unanswered
            waiting = len(node.shards["default"].waiters)  # an int read from the test thread
            assert waiting == RESENDS_WAITING_MAX, waiting  # the write and its first resends
            cluster.stop(cluster.sequencer)  # answers the waiters: outcome_unknown
            assert dealer.poll(10_000)
            answers = [messages.decode(dealer.recv(), 1 << 22)]
            while dealer.poll(500):
                answers.append(messages.decode(dealer.recv(), 1 << 22))
            # One answer at the stop: the connection's held request (``answer_at_stop``) is one per id.
            assert [(a.request_id, a.body.code) for a in answers] == [("resent-1", "outcome_unknown")]
        finally:
            dealer.close(0)


def test_a_client_told_stopping_asks_the_next_node_at_once(tmp_path: Path) -> None:
    """A node that says ``stopping`` did nothing with the request: the client goes to the next endpoint
    without waiting; with no other endpoint, it gives up at once with the node's reason."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stopping_endpoint = f"tcp://127.0.0.1:{port}"
    done = threading.Event()

    def answer_stopping() -> None:
        while not done.is_set():
            if router.poll(20):
                *envelope, frame = router.recv_multipart()
                request_id = messages.decode(frame).request_id
                router.send_multipart(
                    [*envelope, messages.encode(messages.error(request_id, "stopping", "shutting down"))]
                )

    server = threading.Thread(target=answer_stopping, daemon=True)
    server.start()
    node = ThreadNode(tmp_path / "data")
    try:
        with node.client() as client:
            client.create_table("users", "id", [("id", "INTEGER")])
            client.put("users", {"id": 1})
        with Client([stopping_endpoint, node.endpoint], timeout_ms=CLIENT_TIMEOUT_MS) as client:
            started = time.monotonic()
            assert client.get("users", 1) == {"id": 1}
            assert time.monotonic() - started < PROMPT_S
        with Client(stopping_endpoint, timeout_ms=CLIENT_TIMEOUT_MS) as client:
            started = time.monotonic()
            with pytest.raises(MnesiteError) as raised:
                client.get("users", 1)
            assert raised.value.code == "stopping" and "shutting down" in str(raised.value)
            assert time.monotonic() - started < PROMPT_S
    finally:
        done.set()
        server.join(timeout=5)
        router.close(0)
        node.stop()


def test_a_stopping_replicant_answers_its_waiting_read_stopping_and_its_forwarded_write_outcome_unknown(
    tmp_path: Path,
) -> None:
    """A replicant holds reads waiting until it applied a key, and writes it forwarded to a core (which
    may commit them): at its stop the read is ``stopping``, the write ``outcome_unknown``."""
    with replicant_by_hand(tmp_path / "r") as node:
        sent: list[tuple[list[bytes], Message]] = []
        node._send_queued = lambda _socket, envelope, message: sent.append((envelope, message))
        body = messages.typed_body("get", {"table": "t", "key": 1, "min_key": [5, 1]})
        node._wait_for([b"reader"], Message("get", "r-1", body), {"default": TxKey(5, 1)})
        node.hold([b"writer"], "w-1")  # as ``_forward`` holds a write it sent to a core
        assert node.answer_at_stop() == 2
        assert node.answer_at_stop() == 0  # once
    assert sorted((envelope, m.request_id, m.kind, m.body.code) for envelope, m in sent) == [
        ([b"reader"], "r-1", "error", "stopping"),
        ([b"writer"], "w-1", "error", "outcome_unknown"),
    ]


# What a core that stops answers a write waiting for its commit (``core.node._outcome_unknown``).
SHUTDOWN_ANSWER = (
    "the outcome is unknown (core core1 is shutting down (SIGTERM)); retry with the same request id to learn it"
)


def _outcome_unknown_write(endpoints: list[str]) -> OutcomeUnknown:
    # A retry the gone node read and never answered ends in silence: one timeout, not more (half a
    # second: the scripted node answers the first attempt at once).
    timeout_ms = 500
    with Client(endpoints, timeout_ms=timeout_ms, retries=0) as client:
        started = time.monotonic()
        with pytest.raises(MnesiteError) as raised:
            client.put("users", {"id": 1})
        assert time.monotonic() - started < timeout_ms / 1000 + PROMPT_S, str(raised.value)
    # Never "not applied": the write may have happened at the node that answered outcome_unknown.
    assert isinstance(raised.value, OutcomeUnknown), raised.value
    assert raised.value.code == "outcome_unknown"
    return raised.value


@pytest.mark.parametrize("retry_after_close", [False, True], ids=["retry_read_then_close", "retry_after_close"])
@pytest.mark.parametrize("others", [0, 1], ids=["one_endpoint", "two_endpoints"])
def test_a_write_told_outcome_unknown_whose_node_is_then_gone_names_that_answer_first(
    silent_endpoint: str, others: int, retry_after_close: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node answered the write ``outcome_unknown`` at its stop (its reason: it is shutting down),
    then closed. The client's retry finds nothing accepting connections there (sent after the close),
    or went out just before it and is never answered (its silence ends the call, and the check of the
    endpoint finds it unreachable). The error says why the write may have happened first, then that
    the node is gone. The write stays with its node: with a second endpoint (silent: it would only
    time out), it is not sent there, nor is that node named ("none of ... accepts connections")."""
    if retry_after_close:
        monkeypatch.setattr(client_module, "RETRY_BACKOFF_S_MIN", ScriptedNode.STOP_GRACE_S * 2)
    node = ScriptedNode([("outcome_unknown", SHUTDOWN_ANSWER)], then_gone=True)
    try:
        error = _outcome_unknown_write([node.endpoint, silent_endpoint][: 1 + others])
    finally:
        node.close()
    text = str(error)
    assert node.requests == [error.request_id] * (1 if retry_after_close else 2)
    assert SHUTDOWN_ANSWER in text and f"node {node.endpoint} " in text and "unreachable" in text, text
    assert text.index(SHUTDOWN_ANSWER) < text.index("unreachable"), text
    assert silent_endpoint not in text, text


def test_a_write_told_outcome_unknown_then_stopping_names_both_answers_in_order() -> None:
    """The retry reaches the node before its socket closes and is told ``stopping`` (it did nothing
    with the retry): the first answer, which says the write may have happened, comes first."""
    stopping = "core core1 is shutting down (SIGTERM)"
    node = ScriptedNode([("outcome_unknown", SHUTDOWN_ANSWER), ("stopping", stopping)], then_gone=True)
    try:
        error = _outcome_unknown_write([node.endpoint])
    finally:
        node.close()
    text = str(error)
    assert node.requests == [error.request_id, error.request_id]
    assert f"node {node.endpoint}: {SHUTDOWN_ANSWER}; then node {node.endpoint}: {stopping}" in text, text


def test_a_stop_requested_from_another_thread_wakes_the_loop_at_once(tmp_path: Path) -> None:
    """``request_stop`` only set the stop flag: a loop waiting in its poll saw it at the poll's timeout
    (up to ``POLL_INTERVAL_MS_MAX``, 50 ms), and each node a test served from a thread took that long
    to stop. The request now also makes a file the poll waits on readable."""
    import select

    node = offline_replicant(tmp_path / "r")
    try:
        woken = lambda: select.select([node.queries.wakeup_fd], [], [], 0)[0] != []  # noqa: E731
        assert not woken()
        node.request_stop("the test ended")
        assert woken()
    finally:
        node.queries.stop()
        close_offline(node)


def test_a_stopping_node_says_the_warnings_its_throttle_left_out(tmp_path: Path, caplog) -> None:
    """Regression: the lines a ``ThrottledLog`` left out (a burst's last protocol violations, dropped
    frames, checkpoint failures) were said only by a later turn's flush, once their second was over: a
    node that stopped within that second never said them. The stop says them."""
    import logging

    node = CoreNode(node_config(tmp_path / "data", free_port()))
    node.bind()
    caplog.set_level(logging.WARNING, logger="mnesite.server")
    for _ in range(5):
        node.protocol_violation("core9", "an append of a generation it never had")
    node.request_stop("test")
    node.serve_forever()  # stops at once
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("protocol violation")]
    assert len(lines) == 2, lines
    assert lines[1].startswith("protocol violation by core9") and "(5 so far) (and 3 more like it" in lines[1], lines
