"""The I/O skeleton both node drivers share: a zmq ROUTER in front, one SQLite write transaction
per loop turn, and an outbox that is sent only after that transaction commits.

Theory of operation
-------------------
A driver (``core.node.CoreNode``, ``replicant.node.ReplicantNode``) owns one thread. Each turn it
executes the effects of its state machines inside one open SQLite transaction (``begin``) and
queues every frame it wants to send (``reply``, ``queue``). ``flush`` commits (one fsync for the
whole turn: group commit) and only then sends, so nothing is ever said about a state that a crash
could still undo (persist, then send). Sends never block: a full queue drops the frame, which every
protocol here tolerates (requests are retried, pushes re-sent).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq
from mnesite.rlog import codec
from mnesite.rlog.codec import CodecError, Message
from mnesite.rlog.config import Config
from mnesite.rlog.store import Store

log = logging.getLogger("mnesite.server")

# zmq disconnects peers whose message exceeds this many times frame_bytes_max; frames between
# frame_bytes_max and this bound still get a clear frame_too_large reply.
SOCKET_MESSAGE_FACTOR = 4
ROUTER_QUEUE_MAX = 10_000
# Frames (and bytes, times turn_bytes_max) kept for later turns, as a multiple of group_commit_max.
BACKLOG_FACTOR = 4


def monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


def request_id_of(frame: bytes) -> str:
    """Best effort: echo the request id of a frame that could not be decoded, so the client can match it."""
    try:
        value = msgpack.unpackb(frame, raw=False, ext_hook=lambda code, data: None)
        if isinstance(value, list) and len(value) == 4 and isinstance(value[2], str) and 0 < len(value[2]) <= 64:
            return value[2]
    except Exception:  # garbage: there is no request id to echo
        pass
    return "?"


class NodeServer:
    """Sockets, the per-turn transaction and the outbox; subclasses implement ``run_turn``."""

    role = "node"

    def __init__(self, config: Config, store: Store) -> None:
        self.config = config
        self.store = store
        self.context: zmq.Context | None = None
        self.socket: zmq.Socket | None = None
        self.dealers: dict[str, zmq.Socket] = {}
        self.stopping = threading.Event()
        self.commits = 0
        self._outbox: list[tuple[zmq.Socket | None, list[bytes], Message]] = []
        self._in_transaction = False
        # Frames received but left for a later turn (see receive_frames).
        self._backlog: deque[tuple[list[bytes], bytes]] = deque()

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, ROUTER_QUEUE_MAX)
        self.socket.setsockopt(zmq.SNDHWM, ROUTER_QUEUE_MAX)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.frame_bytes_max * SOCKET_MESSAGE_FACTOR)
        self.socket.bind(self.config.listen)

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stopping.set())

    def run_turn(self) -> None:
        raise NotImplementedError

    def serve_forever(self) -> None:
        if self.socket is None:
            self.bind()
        log.info(
            "%s %s serving on %s, data in %s", self.role, self.config.name, self.config.listen, self.config.data_dir
        )
        try:
            while not self.stopping.is_set():
                self.run_turn()
        finally:
            self.close()

    def close(self) -> None:
        for socket in self.dealers.values():
            socket.close(0)
        self.dealers = {}
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None
        if self.context is not None:
            self.context.term()
            self.context = None
        self.store.close()

    def dealer(self, endpoint: str, queue_max: int, dealers_max: int) -> zmq.Socket | None:
        """The DEALER connected to ``endpoint`` (made on first use; None past ``dealers_max``)."""
        socket = self.dealers.get(endpoint)
        if socket is None:
            if self.context is None or len(self.dealers) >= dealers_max:
                return None
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, queue_max)
            socket.setsockopt(zmq.RCVHWM, queue_max)
            socket.connect(endpoint)
            self.dealers[endpoint] = socket
        return socket

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        poller = zmq.Poller()
        if self.socket is not None:
            poller.register(self.socket, zmq.POLLIN)
        for socket in self.dealers.values():
            poller.register(socket, zmq.POLLIN)
        return dict(poller.poll(timeout_ms))

    def receive_frames(
        self, clock_ms: Callable[[], int], urgent: Callable[[bytes], bool] | None = None
    ) -> Iterator[tuple[list[bytes], bytes]]:
        """The (envelope, frame) pairs to handle in this loop turn, urgent ones first.

        DESIGN invariant 11: a long run of large transactions, pushes or catch-up reads must never
        delay what keeps the quorum alive. Each turn takes up to ``group_commit_max`` new frames off
        the socket (cheap: nothing is decoded), after the frames left over from earlier turns. The
        ``urgent`` ones (a core's peer messages: heartbeats, appends, votes) are all handled now;
        the others in arrival order until ``turn_ms_max`` of handling or ``turn_bytes_max`` bytes,
        and the rest wait in a backlog for the next turn, which the driver starts by handling input
        and only then firing timers. The backlog holds at most ``4 * group_commit_max`` frames and
        ``4 * turn_bytes_max`` bytes: a frame beyond that is answered ``overloaded`` and dropped
        (clients retry with the same request id; an agent re-sends after a lost acknowledgement).
        Frames without an envelope (not from a ROUTER peer we can answer) are skipped.
        """
        limits = self.config.limits
        frames = list(self._backlog)
        self._backlog.clear()
        for _ in range(limits.group_commit_max):
            if self.socket is None:
                break
            try:
                parts = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(parts) >= 2:
                frames.append((parts[:-1], parts[-1]))
        if urgent is not None:
            # Stable: urgent frames first, each group in arrival order.
            frames.sort(key=lambda pair: not urgent(pair[1]))
        started_ms = clock_ms()
        handled_bytes = 0
        backlog_bytes = 0
        for pair in frames:
            is_urgent = urgent is not None and urgent(pair[1])
            over_budget = handled_bytes >= limits.turn_bytes_max or clock_ms() - started_ms >= limits.turn_ms_max
            if is_urgent or not over_budget:
                handled_bytes += len(pair[1])
                yield pair
            elif (
                len(self._backlog) < BACKLOG_FACTOR * limits.group_commit_max
                and backlog_bytes + len(pair[1]) <= BACKLOG_FACTOR * limits.turn_bytes_max
            ):
                self._backlog.append(pair)
                backlog_bytes += len(pair[1])
            else:
                self.reply(pair[0], codec.error(request_id_of(pair[1]), "overloaded", f"{self.config.name} is busy"))

    def has_backlog(self) -> bool:
        return bool(self._backlog)

    # -- the turn's transaction and outbox ---------------------------------------------------

    def begin(self) -> None:
        """Open the turn's write transaction if it is not open yet."""
        if not self._in_transaction:
            self.store.connection.execute("BEGIN IMMEDIATE")
            self._in_transaction = True

    def reply(self, envelope: list[bytes] | None, message: Message) -> None:
        """Queue an answer to the ROUTER peer ``envelope`` (None: nobody to answer)."""
        if envelope is not None:
            self._outbox.append((None, envelope, message))

    def queue(self, socket: zmq.Socket, message: Message) -> None:
        """Queue a frame for a DEALER socket."""
        self._outbox.append((socket, [], message))

    def before_send(self) -> None:
        """Hook: queue more frames after the commit and before the sends (for example agent pushes)."""

    def flush(self) -> None:
        """Commit the open transaction (one fsync), then send everything queued behind it."""
        if self._in_transaction:
            self.store.connection.execute("COMMIT")
            self._in_transaction = False
            self.commits += 1
        self.before_send()
        outbox, self._outbox = self._outbox, []
        for socket, envelope, message in outbox:
            target = socket if socket is not None else self.socket
            if target is None:
                continue
            try:
                frame = codec.encode(message)
            except CodecError as error:
                frame = codec.encode(codec.error(message.request_id, "internal", f"reply not encodable: {error}"))
            try:
                target.send_multipart([*envelope, frame], zmq.NOBLOCK)
            except zmq.Again:
                log.debug("send queue full: a message was dropped")
