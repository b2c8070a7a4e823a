"""The I/O skeleton both node drivers share: a zmq ROUTER in front, one SQLite write transaction
per loop turn, and an outbox that is sent only after that transaction commits.

Theory of operation
-------------------
A driver (``core.node.CoreNode``, ``replicant.node.ReplicantNode``) owns one thread. Each turn it
executes the effects of its state machines inside one open SQLite transaction (``begin``) and
queues every frame it wants to send (``reply``, ``queue``). ``flush`` commits (one fsync for the
whole turn: group commit) and only then sends, so nothing is ever said about a state that a crash
could still undo (persist, then send). Sends never block: a full queue drops the frame, which every
protocol here tolerates (requests are retried, pushes re-sent). Two hooks refine this: ``send_now``
sends what a state machine marked as allowed before persistence (a sequencer's appends), and
``after_commit`` runs once the turn's writes are durable; what it writes goes in one more commit.
A turn whose writes a restart redoes anyway (``begin(durable=False)``) commits without an fsync.

A turn that the disk fails (``turn``, ``rlog.disk``) is rolled back and none of its queued frames is
sent. Every client frame it read is answered all the same: a request whose handling it cut short is
told ``cut_answer``'s error, and the frames it had not reached go back to the backlog (``frames_cut``),
handled by the next turn or answered ``stopping`` at a stop. A full disk then puts the node in the
disk-full state (the subclass rebuilds its state machines from disk in ``disk_filled`` and refuses
writes) until a probe every ``disk_probe_interval_ms`` writes durably again (``disk_freed``); an I/O
error stops the node.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import msgspec
import zmq
import zmq.backend
from mnesite.rlog import messages
from mnesite.rlog.backup import (
    PARTIAL_SUFFIX,
    BackupError,
    BackupJob,
    chunk_bytes_max,
    decide,
    failure_record,
    read_chunk,
)
from mnesite.rlog.backup_schedule import BackupSchedule, directory_problem, no_committed_state, prune
from mnesite.rlog.changes import ChangesError, Page, PageLimits, build_page, keep_holding, worth_a_page
from mnesite.rlog.config import Config, ConfigError, is_loopback, keys_needing_restart, load_config
from mnesite.rlog.connections import (
    DEALER_EVENTS,
    MONITOR_READ_INTERVAL_MS,
    REFUSED_FULL,
    REFUSED_KEY,
    ConnectionCount,
    ListenGuard,
    RefusedDealers,
    ensure_files,
    sockets_needed,
)
from mnesite.rlog.data_dir import DataDirectoryLock
from mnesite.rlog.disk import ERROR_DISK_FULL, DiskHealth, StorageFailedError, StorageFault
from mnesite.rlog.errors import OverloadedError, RequestError  # noqa: F401 (RequestError re-exported)
from mnesite.rlog.messages import Message, MessageError
from mnesite.rlog.metrics import MetricsServer, NodeMetrics, start_metrics
from mnesite.rlog.process_signals import ProcessSignals
from mnesite.rlog.query import (
    QUERY_WAIT_MS_DEFAULT,
    CheckedQuery,
    QueryError,
    QueryLimits,
    QueryRequest,
    QueryRunner,
    WaitingQueries,
    WaitingQuery,
    note_unserved,
    page_request,
    query_request,
    shards_of,
)
from mnesite.rlog.roles import PEER_REQUESTS_OUTSTANDING_MIN, WRITE_KINDS, peer_connection, sender_mismatch
from mnesite.rlog.schema import SchemaError, TableSchema
from mnesite.rlog.security import REFUSAL_REASONS, REVOKED, NodeSecurity, SecurityError
from mnesite.rlog.send_queue import TRACKED_BYTES_MIN, PeerQueues
from mnesite.rlog.store import Store, quote
from mnesite.rlog.throttle import ThrottledLog, monotonic_ms
from mnesite.rlog.types import Entry, TxKey
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("mnesite.server")
# How long a stopping node waits for the answers of a ``stop`` request, and of the requests it held
# (``NodeServer.answer_at_stop``), to leave its socket.
STOP_REPLY_LINGER_MS = 1000
# The error code of a request a stopping node answers without having acted on it: ask another node.
STOPPING = "stopping"
# Requests not read yet that a stopping node answers (the rest of its socket's queue is dropped).
STOP_QUEUED_ANSWERS_MAX = 10_000
STOP_GRACE_MS = 200  # how long a node keeps serving after it answered a stop request

# zmq disconnects peers whose message exceeds this many times frame_bytes_max; frames between
# frame_bytes_max and this bound still get a clear frame_too_large reply.
SOCKET_MESSAGE_FACTOR = 4
# A request is a few parts (the ROUTER's identity, a REQ client's empty delimiter, a proxy's hops, the
# frame). zmq bounds each part's size, not their number, and queues a whole message before its first part
# can be read: a message of more parts is refused, its parts beyond these never held, and the rest of it
# is read off at most DISCARD_PARTS_PER_TURN a loop turn, so that a million-part message neither grows
# the node's memory by a list of its parts nor stops the loop's timers while it is read.
MESSAGE_PARTS_MAX = 16
# The parts before the frame are routing ids (zmq's are at most 255 bytes) and a REQ client's empty
# delimiter. They are held in the backlog beside the frame and echoed in the answer, and the backlog's
# and the turn's byte bounds count frames only: a longer part is refused, so neither is a way around them.
ENVELOPE_PART_BYTES_MAX = 255
DISCARD_PARTS_PER_TURN = 10_000
ROUTER_QUEUE_MAX = 10_000
# Frames (and bytes, times turn_bytes_max) kept for later turns, as a multiple of group_commit_max.
BACKLOG_FACTOR = 4
# Connections of peers (``roles.peer_connection``: cores and replicants forwarding their clients'
# requests) with requests waiting, past ``connections_waiting_max``: a flood of client connections must
# not get a sequencer to refuse every forwarded write. Far above any cluster's cores and replicants.
PEER_CONNECTIONS_RESERVED = 1024
# At most one step of online index builds per this interval: a step costs about 5 ms per 1,000 rows
# here, so the builds take at most a third of a loop's time and writes keep most of it.
INDEX_BUILD_INTERVAL_MS = 10
HELD_TIMES_MAX = 100_000  # arrival times of held writes kept for the commit latency histogram

# pyzmq's compiled send and recv, called with plain int flags: its Python send_multipart and
# recv_multipart cost 4x and 2x as much per message (flag enums, a wrapper per frame), about 13 us a
# write on the sequencer. Frames from COPY_BYTES_MIN go out without a copy (zmq keeps the bytes).
_SOCKET = zmq.backend.Socket  # the compiled class pyzmq's Socket derives from
_SEND = _SOCKET.send
_NOBLOCK, _NOBLOCK_MORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.RCVMORE)
COPY_BYTES_MIN = 64 * 1024


def send_frames(socket: zmq.Socket, frames: list[bytes]) -> None:
    """Send one multipart message without blocking (raises ``zmq.Again`` when the queue is full)."""
    if not isinstance(socket, _SOCKET):
        # The compiled send does not check its receiver's type: it would read any object as a socket.
        raise TypeError(f"send_frames needs a zmq socket, not {type(socket).__name__}")
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        _SEND(socket, frame, _NOBLOCK_MORE if index < last else _NOBLOCK, len(frame) < COPY_BYTES_MIN)


def send_tracked(socket: zmq.Socket, frames: list[bytes]) -> zmq.MessageTracker:
    """``send_frames`` for a message whose last frame is large: sent without a copy, and tracked: the
    tracker is done once zmq let go of the frame (handed it to the kernel, or dropped its connection)."""
    if not isinstance(socket, _SOCKET):
        raise TypeError(f"send_tracked needs a zmq socket, not {type(socket).__name__}")
    for frame in frames[:-1]:
        _SEND(socket, frame, _NOBLOCK_MORE, True)
    return _SEND(socket, frames[-1], _NOBLOCK, False, True)


# Connections with unread large answers at which ``UnreadAnswers`` first looks at them all (then at twice
# as many as it kept): the bookkeeping of the connections that read is given back without a look per send.
UNREAD_SWEEP_CONNECTIONS_MIN = 64


class UnreadAnswers:
    """The large answers (from ``COPY_BYTES_MIN``, sent without a copy) that zmq still holds for each
    connection, in bytes: zmq's own bound (``replies_queued_max``, its send high-water mark) counts
    frames, so a client that asks for large answers and reads none made the node hold up to that many
    frames of ``frame_bytes_max``. Past ``bytes_max`` for a connection, its next large answer is
    refused (``refusal``) until zmq let go of some (the client read them, or left). A connection
    holding nothing is always sent one, whatever its size. Small answers are not tracked (the copy
    zmq makes of them is bounded by the count): nothing is added to a write's answer."""

    def __init__(self, bytes_max: int) -> None:
        self.bytes_max = bytes_max
        self.refused = 0  # answers refused for the bytes their connection did not read
        self._held: dict[bytes, list[tuple[zmq.MessageTracker, int]]] = {}
        self._sweep_at = UNREAD_SWEEP_CONNECTIONS_MIN

    def held_bytes(self, connection: bytes) -> int:
        """The bytes zmq still holds of the large answers to ``connection`` (forgetting those it let go)."""
        held = self._held.get(connection)
        if held is None:
            return 0
        held[:] = [(tracker, size) for tracker, size in held if not tracker.done]
        if not held:
            del self._held[connection]
            return 0
        return sum(size for _, size in held)

    def refusal(self, connection: bytes, size: int) -> str | None:
        """Why a large answer of ``size`` bytes to ``connection`` is refused now (counted); None: send it."""
        held = self.held_bytes(connection)
        if held == 0 or held + size <= self.bytes_max:
            return None
        self.refused += 1
        return (
            f"{held} bytes of earlier answers to this connection are not read yet, and this one has {size} "
            f"(replies_queued_bytes_max {self.bytes_max}); read the answers, then ask again"
        )

    def sent(self, connection: bytes, tracker: zmq.MessageTracker, size: int) -> None:
        """Track a large answer just sent to ``connection``."""
        held = self._held.get(connection)
        if held is None:
            if len(self._held) >= self._sweep_at:
                for other in list(self._held):
                    self.held_bytes(other)
                self._sweep_at = max(UNREAD_SWEEP_CONNECTIONS_MIN, 2 * len(self._held))
            held = self._held[connection] = []
        held.append((tracker, size))


# ``NodeServer._handling`` outside a frame's dispatch: a request held then has no principal to check.
NOT_HANDLING = ("", "")
# A held read's answer after a reload removed its sender's key or role (``NodeServer._revoked_since``).
REVOKED_HELD = (
    "the key or role that sent this request was removed by a reload while it waited; ask again with an authorized key"
)

# A changefeed page's bytes, at most this share of frame_bytes_max (records are estimated, the frame is not).
CHANGES_FRAME_SHARE = 4
# How long a caught-up changefeed request is held at most when it does not say (``changes`` wait_ms).
CHANGES_WAIT_MS_DEFAULT = 0

# What a driver passes to read one key-ordered batch of a table (``bootstrap.serve.read_batch``):
# ``(store, table, after, rows_max, bytes_max, rows_total=...)``.
TableBatch = Callable[..., dict[str, Any]]


class Deferred(Exception):
    """The request will be answered later (when its entry commits, or by the sequencer)."""


class HeldRequest(NamedTuple):
    """A request held for a later answer (``NodeServer.hold``): where its answer goes, and whether a
    stop answers it ``outcome_unknown`` (it may change the database) or ``stopping``. ``principal``
    and ``kind``: who sent it, and what (with [security]): a read answered after a reload that removed
    that key or role is answered ``forbidden`` instead (``reply``)."""

    envelope: list[bytes]
    changes: bool
    principal: str = ""
    kind: str = ""
    reloads: int = 0  # ``NodeSecurity.reloads`` when it was held: a later reload's revocations refuse it


class CountRead(NamedTuple):
    """A ``count`` read run as a query (``NodeServer.count_later``): answered ``{"rows": n}``, not as a page.
    Unpacks as a query's payload does, ``(envelope, request_id)``."""

    envelope: list[bytes]
    request_id: str


# A count's one row and the end of its statement, read in one page (so no cursor stays open).
COUNT_PAGE_ROWS = 2


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off while a bounded piece of work runs that makes, and frees itself,
    many container objects: a replicant's push (a list and two tuples per row as decoded, a tuple per
    row as applied; a push is at most ``frame_bytes_max``). With the collector on, those objects,
    alive for the whole push, survive young collections and are promoted until a full collection walks
    the heap: 0.3-0.4 us per row applied, about 14% of the replicant's apply (benchmarks/PROFILE.md).
    The caller leaves the block once the push's objects are freed (refcounting frees them; none is a
    cycle), so the collection that follows finds nothing of them. Nested use keeps the outer pause."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# A frame's four items with the body left undecoded: msgspec walks past it without building it.
_FRAME_HEADER = msgspec.msgpack.Decoder(tuple[Any, Any, Any, msgspec.Raw])


def request_id_of(frame: bytes) -> str:
    """Best effort: echo the request id of a frame that could not be decoded, so the client can match it.

    Only the header is decoded: a refusal (a frame too large, malformed, or beyond a full backlog) must
    not cost the loop what handling the frame would (unpacking a 2 MB body took 140 ms and 28 MB)."""
    try:
        request_id = _FRAME_HEADER.decode(frame)[2]
    except Exception:  # garbage: there is no request id to echo
        return "?"
    if type(request_id) is str and 0 < len(request_id) <= messages.REQUEST_ID_CHARS_MAX:
        return request_id
    return "?"


# Kinds no node answers (a peer's consensus message, a snapshot's offer or request, an agent's push and its
# acknowledgement): a frame of them cut short by a failed turn is re-sent by its protocol, never told.
UNANSWERED_KINDS = frozenset({"peer", "snapshot_offer", "snapshot_request", "push", "push_ack"})


def cut_answer(frame: bytes, reason: str, stopping: bool) -> Message | None:
    """The answer to a request whose handling a failed turn cut short, before it was answered or held
    (``NodeServer.frames_cut``): nothing it did was committed (the turn was rolled back) and nothing
    was forwarded. A stopping node says ``stopping`` (the client asks another node at once), or
    ``outcome_unknown`` for a write (never wrong, and what a stop tells a write it cut); a node that
    serves on (the disk filled) says ``outcome_unknown`` (asked again, here or elsewhere), as
    ``abandon_turn`` tells the answers of that turn. None for a kind nobody answers."""
    try:
        kind = _FRAME_HEADER.decode(frame)[1]
    except Exception:  # garbage is refused before its handling: not cut short
        return None
    if kind in UNANSWERED_KINDS:
        return None
    code = STOPPING if stopping and kind not in WRITE_KINDS else "outcome_unknown"
    return messages.error(request_id_of(frame), code, f"the turn that handled it failed: {reason}")


def relayed(answer: Message) -> Message:
    """The answer of the node a request was forwarded to (a core's sequencer, a replicant's core), as
    this node's own answer to its client. ``stopping`` there says that *upstream* node is going away
    and did nothing with the request; a client takes ``stopping`` for the node it asked (it never asks
    it again in the call, and gives up at once with no other endpoint): relayed, it is
    ``no_sequencer``, which the client retries while another sequencer is elected or chosen."""
    if answer.kind == "error" and answer.body.code == STOPPING:
        upstream = f"the node it was forwarded to is shutting down and did nothing with it: {answer.body.message}"
        return messages.error(answer.request_id, "no_sequencer", upstream, answer.body.detail)
    return answer


class StoppedWhileStarting(Exception):
    """A stop (a signal, ``request_stop``) came while the node was starting (a core's start-up recovery):
    the node closed what it had opened and logged its ``shut down`` line; the message is that reason."""


class NodeServer:
    """Sockets, the per-turn transaction and the outbox; subclasses implement ``run_turn``."""

    role = "node"
    clock_ms: Callable[[], int]  # the driver's clock (a subclass sets it)

    def __init__(
        self,
        config: Config,
        store: Store,
        data_dir_lock: DataDirectoryLock | None = None,
        signals: ProcessSignals | None = None,
    ) -> None:
        self.config = config
        # The process's stop and reload signals (``mnesite start`` installs them before it constructs the
        # node); None: the node stops only when asked (``request_stop``, a stop request).
        self.signals = signals
        self._reloads_taken = signals.reloads if signals is not None else 0
        self.store = store
        self.data_dir_lock = data_dir_lock
        self.context: zmq.Context | None = None
        self.socket: zmq.Socket | None = None
        self.dealers: dict[str, zmq.Socket] = {}
        # Each DEALER's monitor (``DEALER_EVENTS``), by endpoint, and those the other node refused (for
        # its connections_max or for this node's key), dialled again by ``reconnect_refused``
        # (rlog.connections); ``dealer_endpoints``: each DEALER's endpoint, by id (a send dropped toward
        # a node that refused this one is counted as such: ``_send_dealer``).
        self.dealer_monitors: dict[str, zmq.Socket] = {}
        self.dealer_endpoints: dict[int, str] = {}
        self.refused_dealers = RefusedDealers()
        self._monitors_read_ms = 0  # when ``reconnect_refused`` last read them
        self.stopping = threading.Event()
        self.stop_requested = False
        self.stop_at_ms: int | None = None  # when a stop request takes effect (after its answer left)
        self.stop_reason = "stopped by its owner"  # what the shutdown line says: a signal or a stop request
        self.commits = 0
        self.durable_commits = 0  # commits that waited for an fsync (see ``begin``)
        # Frames dropped because the receiver's zmq queue was full (or its socket gone): every protocol
        # here re-sends, but a dropped push costs a replicant a resync, so they are counted and logged.
        # ``sends_dropped_refused``: those of them toward a node that refused this node's connection
        # (its queue fills because nothing can be sent: ``sends_dropped_by``' ``refused_connection``).
        self.sends_dropped = 0
        self.sends_dropped_refused = 0
        # What peers, clients and overload can make a node say again and again (protocol violations,
        # refused requests, dropped frames, a replicant's pushes ignored or rejected): at most a line a
        # second per reason, with the count of the lines left out; ``turn`` flushes it, so a burst's
        # last lines are said too. Status and the metrics count every one.
        self.warnings = ThrottledLog(log)
        self.unread_answers = UnreadAnswers(config.limits.replies_queued_bytes_max)
        # What zmq may still hold toward each peer core, bounded in bytes per peer (rlog.send_queue);
        # ``peer_sockets``: the DEALERs whose sends it bounds (``bound_sends``), by id, and their peer.
        self.peer_queues = PeerQueues(config.limits.core_queue_bytes_max)
        self.peer_sockets: dict[int, str] = {}
        self.tracked_bytes_min = TRACKED_BYTES_MIN  # a core's is CORE_TRACKED_BYTES_MIN (rlog.send_queue)
        self._outbox: list[tuple[zmq.Socket | None, list[bytes], Message]] = []
        self._in_transaction = False
        # Whether the turn's transaction holds something that must be durable before a frame is sent.
        self._durable = False
        # Frames received but left for a later turn (see receive_frames).
        self._backlog: deque[tuple[list[bytes], bytes, str]] = deque()
        # The frames this turn read that its handling has not reached yet, and the frame whose handling
        # a failed turn cut short (``frames_cut``): answered, never dropped with the turn.
        self._turn_unreached: Iterator[tuple[list[bytes], bytes, str]] | None = None
        self._turn_frames: list[tuple[list[bytes], bytes, str]] = []  # what it iterates (``_from_peer``)
        self._cut: tuple[list[bytes], bytes] | None = None
        # The principal and kind of the frame being dispatched (``serve_frames``), for ``hold``.
        self._handling: tuple[str, str] = NOT_HANDLING
        self._discarding = False  # the socket's next parts are the rest of a refused message (see receive)
        self._poller: tuple[tuple[zmq.Socket | None, ...], zmq.Poller] | None = None  # rebuilt when the sockets change
        self._queries_woken = True  # the query runner's wakeup pipe was readable at the last poll
        self.security: NodeSecurity | None = None
        # [limits] connections_max: the listen socket's open connections, counted and bounded by the
        # ZAP handler and monitor threads of ``listen_guard`` (rlog.connections).
        self.connection_count = ConnectionCount(config.limits.connections_max)
        self.listen_guard: ListenGuard | None = None
        self.reload_requested = threading.Event()
        if config.secure and config.security is not None:
            try:
                self.security = NodeSecurity(config.security)
            except SecurityError as error:
                store.close()
                if data_dir_lock is not None:
                    data_dir_lock.release()
                raise ConfigError(str(error)) from None
            # Peers know this node by the principal of its client key: it must be this node's name.
            principal = self.security.authorized.get(self.security.client.public)
            if principal is not None and principal != config.name:
                store.close()
                if data_dir_lock is not None:
                    data_dir_lock.release()
                raise ConfigError(
                    f"[security].client_key is the key of {principal!r} in authorized_keys, not of this node "
                    f"{config.name!r}"
                )
            if principal is None:
                log.warning("[security].client_key of %s is not in its own authorized_keys", config.name)
        # connection identity -> request id -> the request held for a later answer (writes awaiting
        # commit, reads waiting for a key, queries, ...): bounded per connection, answered at a stop.
        self.outstanding: dict[bytes, dict[str, HeldRequest]] = {}
        self.stop_answers = 0  # held or queued requests answered because the node stopped
        self.connections_refused = 0  # requests refused: connections_waiting_max connections wait already
        self.protocol_violations = 0
        # Whether the disk takes writes (rlog.disk); frames dropped with turns the disk failed.
        self.disk = DiskHealth(config.disk_probe_interval_ms)
        self.frames_dropped_disk = 0
        self.backup_job: BackupJob | None = None
        # The last backup that failed (``BackupJob.failure``) until one succeeds: a failed job is
        # reported once to the command polling it and then dropped (asking again starts anew), and
        # the failure must stay visible to whatever watches ``status`` and the metrics.
        self.backup_failed: dict[str, Any] | None = None
        # The last backup an operator asked for (``mnesite backup``), while a scheduled one may have
        # replaced it as ``backup_job``: its command still polls it and may download it (``_backup_job_for``).
        self.manual_backup_job: BackupJob | None = None
        self._backup_outcome_noted: BackupJob | None = None  # the last job whose end ``_note_backup`` took
        self.scheduled_backup_job: BackupJob | None = None  # the scheduled backup running, until its end is noted
        # [backup] interval_s (rlog.backup_schedule): None when off. The directory is checked once, here.
        self.backup_schedule: BackupSchedule | None = None
        if config.backup.interval_s and config.backup.directory is not None:
            problem = directory_problem(config.backup.directory)
            if problem is not None:
                store.close()
                if data_dir_lock is not None:
                    data_dir_lock.release()
                raise ConfigError(problem)
            self.backup_schedule = BackupSchedule(
                config.backup.directory, config.backup.interval_s, config.backup.keep, config.name, monotonic_ms()
            )
        # Metrics ([metrics] listen): None when off. ``transactions`` is counted by the core's apply.
        self.metrics: NodeMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.transactions = 0
        self.malformed_frames = 0
        self._transactions_at_commit = 0
        self._held_since_s: dict[tuple[bytes, str], float] = {}
        self._turn_began_s = time.monotonic()
        # Read-only SQL queries (rlog.query): run on the runner's threads, never on this loop.
        self.queries = QueryRunner(store.path, QueryLimits.from_config(config.limits), monotonic_ms)
        self.waiting_queries = WaitingQueries()
        # Queries started whose first page is not back (at most query_cursors_max: each holds a cursor).
        self._queries_starting: dict[int, WaitingQuery] = {}
        # Changefeed requests held until a shard they follow moves (rlog.changes), oldest first.
        self.waiting_changes: list[WaitingChanges] = []
        # What the changefeed served since start (status "changes", metrics): pages answered, their records,
        # the copies of trimmed positions begun (snapshot_begin records), requests refused for want of room.
        self.changes_served = {"pages": 0, "records": 0, "snapshots": 0, "refused": 0}
        store.index_build_step_rows_max = config.limits.index_build_step_rows_max
        self._next_build_ms = 0

    def protocol_violation(self, sender: str, reason: str) -> None:
        """Count a peer's message that breaks the protocol against our state; log at most a line a second."""
        self.protocol_violations += 1
        # One reason for all senders, the sender named in the line. A reason per sender would be made of
        # a name the message carries: without [security] any peer can send any core's name, so lines per
        # sender would single out nobody, only let a peer multiply the reasons. A violation comes from a
        # stale or broken core (``CoreNode`` takes peer messages only from names it knows), rarely two at
        # once; every one is counted, and each line says the count so far and those left out since.
        self.warnings.log(
            "protocol violation",
            logging.WARNING,
            "protocol violation by %.64s: %.300s (%d so far)",
            sender,
            reason,
            self.protocol_violations,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the node's socket, unless bound already (a core answers ``status`` while it recovers at
        start-up: ``CoreNode``), and start the ``[metrics] listen`` endpoint."""
        try:
            if self.socket is None:
                self._bind_socket()
            if self.config.metrics_listen is not None and self.metrics_server is None:
                self.metrics, self.metrics_server = start_metrics(
                    self.config.metrics_listen, self.config.name, self.role, is_loopback
                )
        except BaseException:
            # A failed bind (the port is taken): the store, the data directory's lock and zmq must not
            # stay open in a process that goes on (it could not start a node on that directory again).
            self.close()
            raise

    def _bind_socket(self) -> None:
        limits = self.config.limits
        dealers_max = len(self.config.core_nodes) + limits.watches_max
        ensure_files(limits.connections_max, dealers_max)
        self.context = zmq.Context()
        # A DEALER and its monitor are three sockets: zmq's default of 1023 in all would refuse a new
        # DEALER (EMFILE) once a core pushes to a few hundred replicant endpoints. Set before the first socket.
        self.context.set(zmq.MAX_SOCKETS, sockets_needed(dealers_max))
        # The ZAP handler must be up before the server socket binds.
        self.listen_guard = ListenGuard(self.connection_count, self.security)
        self.listen_guard.start(self.context)
        if self.security is None and self.config.security is not None and self.config.security.insecure:
            log.warning(
                "%s %s runs WITHOUT authentication or encryption ([security] insecure = true): anyone who can "
                "reach %s can read and write everything",
                self.role,
                self.config.name,
                self.config.listen,
            )
        self.socket = self.context.socket(zmq.ROUTER)
        if self.security is not None:
            self.security.secure_server(self.socket)
        self.listen_guard.watch(self.socket)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, self.config.limits.requests_queued_max)
        # Answers queued per connection: a client that never reads costs at most this many frames.
        self.socket.setsockopt(zmq.SNDHWM, self.config.limits.replies_queued_max)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.frame_bytes_max * SOCKET_MESSAGE_FACTOR)
        self.socket.bind(self.config.listen)

    def install_signal_handlers(self) -> None:
        """Stop on SIGTERM and SIGINT, reload the keys on SIGHUP (``rlog.process_signals``), unless the
        node was constructed with its process's signals already (``mnesite start`` does so)."""
        if self.signals is None:
            self.signals = ProcessSignals()
            self.signals.install()
            self._poller = None  # rebuilt with the signals' wakeup pipe

    def take_signals(self) -> None:
        """Act on what a signal asked (its handler only recorded it: ``rlog.process_signals``), on the
        loop's thread: a stop, a reload of the keys."""
        if self.signals is None:
            return
        if self.signals.stop_signal is not None and not self.stopping.is_set():
            self.request_stop(self.signals.stop_signal)
        if self.signals.reloads != self._reloads_taken:
            self._reloads_taken = self.signals.reloads
            self.reload_requested.set()

    def reload_security(self) -> None:
        """SIGHUP: re-read ``authorized_keys`` and ``[security.roles]`` from the config file; keep the
        old ones (and say why) if the new ones are unusable. Any other key edited since the start is
        named in one line: it takes effect only at a restart (``keys_needing_restart``)."""
        self.reload_requested.clear()
        reloaded = None
        if self.config.source_path is not None:
            try:
                reloaded = load_config(self.config.source_path)
            except ConfigError as error:
                if self.security is None:
                    log.error("SIGHUP: the config file is unusable: %s", error)
                else:
                    log.error("SIGHUP: keeping the current keys and roles: %s", error)
                return
            restart = keys_needing_restart(self.config, reloaded)
            if restart:
                log.warning("SIGHUP: changed keys that take effect only at a restart: %s", ", ".join(restart))
        if self.security is None or reloaded is None:
            log.warning("SIGHUP: nothing to reload (no [security] keys or no config file)")
            return
        try:
            security = reloaded.security
            if security is None or not security.enabled:
                raise SecurityError("the reloaded config has no [security] keys; restart to turn security off")
            self.security.reload(security)
        except (ConfigError, SecurityError) as error:
            log.error("SIGHUP: keeping the current keys and roles: %s", error)
            return
        log.info("SIGHUP: reloaded %d authorized keys and the roles", len(self.security.authorized))
        revoked = self.security.revoked_by_last_reload()
        if revoked and self._backlog:
            # A frame read off the socket before the reload and left for a later turn was mapped to
            # its principal then: one of a key the reload removed or replaced is refused as a new
            # frame of that key would be (``refusal``: no principal), not served under the name.
            waiting = [(envelope, frame, "" if who in revoked else who) for envelope, frame, who in self._backlog]
            self._backlog.clear()
            self._backlog.extend(waiting)
        self.security_reloaded(self.security)

    def security_reloaded(self, security: NodeSecurity) -> None:
        """Hook: ``authorized_keys`` and the roles were reloaded; end what a principal they no longer
        allow set up before (``NodeSecurity.allows``). Frames are checked one by one already."""

    def receive(self) -> tuple[list[bytes], bytes, str] | None:
        """One waiting ROUTER request: (envelope, frame, principal); None when nothing waits.

        The principal is the ZAP user id of the authenticated key ("" without [security]).
        Raises ``zmq.Again`` when the queue is empty, or while the rest of a message of more than
        ``MESSAGE_PARTS_MAX`` parts is read off (that message gives ``None``, as any malformed one).
        """
        if self.socket is None:
            raise zmq.Again()
        socket = self.socket
        if self._discarding:  # the rest of a message of too many parts: some of it, then this turn ends
            for _ in range(DISCARD_PARTS_PER_TURN):
                if not socket.get(_RCVMORE):
                    self._discarding = False
                    break
                socket.recv(_NOBLOCK)
            raise zmq.Again()
        principal = ""
        if self.security is None:
            parts = [socket.recv(_NOBLOCK)]
        else:  # the authenticated key is a property of the message, read from its first frame
            first = socket.recv(_NOBLOCK, copy=False)
            principal = self.security.principal_of(first)
            parts = [first.bytes]
        while socket.get(_RCVMORE):
            if len(parts) == MESSAGE_PARTS_MAX:
                self._discarding = True  # refused: no answer can be told from which part is the frame
                self.malformed_frame()
                return None
            parts.append(socket.recv(_NOBLOCK))
        if len(parts) < 2:
            return None  # not from a ROUTER peer we can answer
        envelope = parts[:-1]
        if any(len(part) > ENVELOPE_PART_BYTES_MAX for part in envelope):
            self.malformed_frame()  # no routing id is that long: neither held nor answered
            return None
        return envelope, parts[-1], principal

    def refusal(self, principal: str, message: Message) -> Message | None:
        """The error to answer if ``principal`` may not send ``message`` (counted); None if it may."""
        if self.security is None:
            return None
        if not principal:  # authenticated at its handshake, but a reload removed its key since
            self.security.refused_unknown_key += 1
            self.warnings.log("refused: unknown key", logging.WARNING, "refused: %s", REVOKED)
            return messages.error(message.request_id, "forbidden", REVOKED)
        reason = self.security.roles.refusal(principal, message.kind)
        if reason is not None:
            self.security.refused_role += 1
            self.warnings.log("refused: role", logging.WARNING, "refused: %s", reason)
            return messages.error(message.request_id, "forbidden", reason)
        reason = sender_mismatch(principal, message.kind, message.body)
        if reason is not None:
            self.security.refused_sender += 1
            self.warnings.log("refused: sender", logging.WARNING, "refused a forged sender: %s", reason)
            return messages.error(message.request_id, "forbidden", reason)
        return None

    def backup_request(self, message: Message, not_ready: Callable[[], str | None]) -> Message:
        """The reply to a ``backup`` or ``backup_read`` request (admin only, see rlog.roles); raises
        ``RequestError`` ``backup_refused`` with the reason one is refused. ``not_ready``: the node's
        reason not to start a backup now (``answer_backup``)."""
        try:
            if message.kind == "backup_read":
                bytes_max = chunk_bytes_max(self.config.limits.frame_bytes_max)
                path = message.body.path
                result = read_chunk(self._backup_job_for(path), path, message.body.offset, bytes_max)
            else:
                result = self.answer_backup(message.body, not_ready())
        except BackupError as error:
            raise RequestError("backup_refused", str(error)) from None
        return messages.reply(message.request_id, result)

    def answer_backup(self, body: messages.Backup, not_ready: str | None) -> dict[str, Any]:
        """The ``backup`` request: start one (admin only, see rlog.roles) or report the current one.

        ``not_ready`` is the node's reason not to start one now (a shard whose rows are incomplete).
        Raises ``BackupError`` with the reason a backup cannot start.
        """
        self._note_backup()  # before the job can be replaced or dropped
        job = self._backup_job_for(body.path)
        action = decide(job.view if job is not None else None, body.path)
        running = self.backup_job if self.backup_job is not None and self.backup_job.state == "running" else None
        if action != "report" and running is not None:  # a scheduled one too
            raise BackupError(f"a backup to {running.path} is still running; one at a time")
        if action == "start":
            if not_ready is not None:
                raise BackupError(f"not now: {not_ready}")
            job = self.backup_job = self.manual_backup_job = BackupJob(
                self.store.path, body.path, self.config.name, self.role, self.config.limits.backup_step_pages_max
            )
            log.info("backup to %s started at %s", body.path, job.positions)
        if job is None:
            raise BackupError("no backup job")
        status = job.status()
        self._note_backup()
        if status["state"] == "failed":  # reported once: asking again with the same path tries again
            if self.backup_job is job:
                self.backup_job = None
            if self.manual_backup_job is job:
                self.manual_backup_job = None
        return status

    def _backup_job_for(self, path: str) -> BackupJob | None:
        """The job a request naming ``path`` asks about: the operator's last backup if it is to ``path``
        (a scheduled one started since must not make its command's poll or download fail), else the
        node's last backup."""
        manual = self.manual_backup_job
        return manual if manual is not None and manual.path == path else self.backup_job

    def run_backup_schedule(self, not_ready: Callable[[], str | None]) -> None:
        """At each loop turn: note the end of the running scheduled backup, and start the next one once it is
        due, no backup runs and ``not_ready`` (the node's reason not to take one now) says nothing. The copy
        and the pruning of older backups run on the job's thread (``rlog.backup_schedule``)."""
        schedule = self.backup_schedule
        if schedule is None:
            return
        now_ms = monotonic_ms()
        job = self.scheduled_backup_job
        if job is not None:
            if job.state == "running":
                return
            self.scheduled_backup_job = None
            self._note_backup(job)
            kept, removed = job.after_publish_result or (None, 0)
            schedule.files_removed += removed
            schedule.ended(job.state, job.error or job.after_publish_error, job.finished_s or time.time(), kept)
            if job.state == "done":
                log.info("scheduled backup to %s done; %d older one(s) removed", job.path, removed)
            else:
                log.warning("scheduled backup to %s failed: %s", job.path, job.error)
            if job.after_publish_error is not None:
                log.warning("pruning the scheduled backups after %s failed: %s", job.path, job.after_publish_error)
        if not schedule.is_due(now_ms, self.backup_job is not None and self.backup_job.state == "running"):
            return
        schedule.waiting = not_ready() or no_committed_state(
            {shard: position.applied for shard, position in self.store.shards().items()}
        )
        if schedule.waiting is not None:
            return  # asked again at the next turn: a due backup is not skipped
        now_s = time.time()
        # The name of its second, or the next free one: never a file that is there (``BackupJob`` would
        # refuse it, and the schedule would fail at each interval while a clock set back repeats seconds).
        path = schedule.path(now_s, lambda path: os.path.lexists(path) or os.path.lexists(path + PARTIAL_SUFFIX))
        taken = schedule.names_taken(now_s) if path is None else None
        if taken is not None:
            path = taken[0]
        schedule.started(now_ms, path)
        self._note_backup()  # before the last job is replaced
        try:
            if taken is not None:
                raise BackupError(taken[1])
            self.backup_job = self.scheduled_backup_job = BackupJob(
                self.store.path,
                path,
                self.config.name,
                self.role,
                self.config.limits.backup_step_pages_max,
                after_publish=lambda: prune(schedule.directory, self.config.name, schedule.keep, path),
            )
        except BackupError as error:
            self.backup_failed = failure_record(path, f"BackupError: {error}", now_s)
            schedule.ended("failed", str(error), now_s, None)
            log.warning("scheduled backup to %s failed: %s", path, error)
            return
        log.info("scheduled backup to %s started at %s", path, self.backup_job.positions)

    def _note_backup(self, job: BackupJob | None = None) -> None:
        """Keep the failure of ``job`` (the current job by default), or forget the last one once a backup succeeded."""
        job = job or self.backup_job
        if job is None:
            return
        if job.state == "running" or job is self._backup_outcome_noted:
            # Noted once: a scheduled backup that failed at its start (``run_backup_schedule``) after this
            # job was done must not be forgotten because this job is still the last one.
            return
        self._backup_outcome_noted = job
        self.backup_failed = job.failure()

    def backup_status(self) -> dict[str, Any]:
        """``status``'s ``backup`` (the current or last job) and ``backup_failed`` (the last failure,
        until a backup succeeds)."""
        self._note_backup()
        schedule = self.backup_schedule
        return {
            "backup": self.backup_job.status() if self.backup_job is not None else None,
            "backup_failed": self.backup_failed,
            "backup_schedule": schedule.status(monotonic_ms()) if schedule is not None else None,
        }

    def security_status(self) -> dict[str, Any]:
        if self.security is None:
            insecure = self.config.security is not None and self.config.security.insecure
            return {"curve": False, "insecure": insecure}
        return self.security.status()

    def run_turn(self) -> None:
        raise NotImplementedError

    def stop_request(self, principal: str) -> dict[str, Any]:
        """An admin's ``stop`` request: answered, then the node leaves its loop and logs why.

        The loop goes on for ``STOP_GRACE_MS`` so that the answer leaves while the socket is still
        open (closing a CurveZMQ socket right after the send lost the answer in tests)."""
        self.stop_requested = True
        if self.stop_at_ms is None:
            self.stop_at_ms = monotonic_ms() + STOP_GRACE_MS
            self.stop_reason = f"stop request from {principal or 'a client'}"
        return {"node": self.config.name, "stopping": True}

    def request_stop(self, reason: str) -> None:
        """Leave ``serve_forever`` after the current loop turn (answers queued in it are still sent).
        From another thread too: a loop waiting in its poll is woken. Never from a signal handler: it
        takes locks the interrupted thread may hold (``take_signals`` calls it for a signal)."""
        if not self.stopping.is_set():
            self.stop_reason = reason
        self.stopping.set()
        self.queries.wake()

    def serve_forever(self) -> None:
        if self.socket is None:
            self.bind()
        log.info(
            "%s %s serving on %s, data in %s", self.role, self.config.name, self.config.listen, self.config.data_dir
        )
        try:
            while True:
                self.take_signals()
                if self.stopping.is_set():
                    break
                if self.stop_at_ms is not None and monotonic_ms() >= self.stop_at_ms:
                    self.request_stop(self.stop_reason)
                    break
                if self.reload_requested.is_set():
                    self.reload_security()
                self.turn()
            # A background checkpoint that failed after the last turn read it (a stop came first): the
            # node stops for its disk, as that turn would have, not as if on purpose.
            self._raise_if_checkpoint_failed()
        finally:
            try:
                self.answer_at_stop()
            except Exception:  # the node still closes: its store and its data directory's lock
                log.exception("answering the held requests at the stop failed")
            # What the throttles left out of the last second, said now: no later turn will (a stop, also
            # one a failed checkpoint raised before the turn's own flush).
            self.warnings.flush(final=True)
            if self.store.checkpointer is not None:
                self.store.checkpointer.warnings.flush(final=True)
            self.close()
            # The operator's proof that the node stopped on purpose, and why (a crash logs no such line).
            log.info("%s %s shut down (%s)", self.role, self.config.name, self.stop_reason)

    def answer_at_stop(self) -> int:
        """Answer, once, every request this node holds or has queued, before its sockets close; the
        number answered. Without it a stop dropped them, and each client waited out its timeout.

        A held request is answered as ``hold`` recorded it: ``outcome_unknown`` if it may change the
        database (a write waiting for its commit or forwarded may still commit: the client retries it
        with the same request id, which the sequencer applies at most once), else ``stopping`` (a
        read, a query, a changefeed wait: the client asks another node at once). Requests not read yet
        (this loop's backlog, the socket's queue, at most ``STOP_QUEUED_ANSWERS_MAX``) were never looked
        at: ``stopping``. A turn cut short by an error may have queued answers its commit did not make
        true: they become ``outcome_unknown`` (answers queued with no write pending, such as
        ``disk_filled``'s, are sent as they are). A running query is interrupted by ``close``
        (``QueryRunner.stop``); its answer here is ``stopping``. Answers go out now (they say nothing
        about the database), and ``close`` lingers a bounded time so that zmq sends them."""
        reason = f"{self.role} {self.config.name} is shutting down ({self.stop_reason})"
        answers: list[tuple[list[bytes], Message]] = []
        cut = self._cut_answer(reason, stopping=True)
        if cut is not None:
            answers.append(cut)
        left, self._outbox = self._outbox, []
        for socket, envelope, message in left:
            if socket is not None or not envelope:
                continue  # a frame to a peer: not sent by a stopping node
            if self._in_transaction:  # a turn cut short: its answer may tell of writes not committed
                message = messages.error(message.request_id, "outcome_unknown", reason)
            answers.append((envelope, message))
        self.answer_held_at_stop(reason)
        precise, self._outbox = self._outbox, []
        answers += [(envelope, message) for socket, envelope, message in precise if socket is None and envelope]
        outstanding, self.outstanding = self.outstanding, {}
        self._held_since_s.clear()
        for held in outstanding.values():
            for request_id, request in held.items():
                code = "outcome_unknown" if request.changes else STOPPING
                answers.append((request.envelope, messages.error(request_id, code, reason)))
        self.waiting_changes.clear()
        queued = list(self._backlog)
        self._backlog.clear()
        answers += self._refuse_queued(queued, reason)
        for envelope, message in answers:
            self._send_queued(None, envelope, message)
        answered = len(answers)
        if answered:
            # As after a stop request (STOP_GRACE_MS): answers sent right before the socket closes were
            # lost in tests, linger or not. Meanwhile what arrives (a client's retry) is told too.
            grace_ends_ms = monotonic_ms() + STOP_GRACE_MS
            while self.socket is not None and answered < STOP_QUEUED_ANSWERS_MAX:
                remaining_ms = grace_ends_ms - monotonic_ms()
                if remaining_ms <= 0 or not self.socket.poll(remaining_ms):
                    break
                for envelope, message in self._refuse_queued([], reason, STOP_QUEUED_ANSWERS_MAX - answered):
                    self._send_queued(None, envelope, message)
                    answered += 1
            log.info("answered %d held or queued request(s) at the stop", answered)
        self.stop_answers += answered
        return answered

    def _refuse_queued(
        self, queued: list[tuple[list[bytes], bytes, str]], reason: str, count_max: int = STOP_QUEUED_ANSWERS_MAX
    ) -> list[tuple[list[bytes], Message]]:
        """``stopping`` for the requests ``queued`` and those waiting in the socket (not read: nothing
        was done with them), at most ``count_max`` in all."""
        while len(queued) < count_max:
            try:
                received = self.receive()
            except (zmq.Again, zmq.ZMQError):
                break
            if received is not None:
                queued.append(received)
        return [(envelope, messages.error(request_id_of(frame), STOPPING, reason)) for envelope, frame, _ in queued]

    def answer_held_at_stop(self, reason: str) -> None:
        """Hook: answer (``reply``) the held requests a driver can tell more precisely about than
        ``hold`` recorded; whatever it leaves held is answered by ``answer_at_stop``."""

    def status(self) -> dict[str, Any]:
        raise NotImplementedError

    def connections_status(self) -> dict[str, int]:
        """The client connections with requests waiting here, their bound, and the requests refused
        ``overloaded`` for the bound (``hold``) or for answers their connection did not read (``UnreadAnswers``)."""
        return {
            "waiting": len(self.outstanding),
            "waiting_max": self.config.limits.connections_waiting_max,
            "refused": self.connections_refused,
            "refused_unread": self.unread_answers.refused,
            **self.connection_count.status(),
            # This node's own connections that another node refused, dialled again: for its
            # connections_max, and for this node's key (not in its authorized_keys).
            "redials_refused": self.refused_dealers.redials[REFUSED_FULL],
            "redials_refused_key": self.refused_dealers.redials[REFUSED_KEY],
        }

    @staticmethod
    def collector_status() -> dict[str, Any]:
        """Python's cyclic collector in this process: the objects frozen out of it at start (``mnesite
        start`` freezes what starting made) and the collections of each generation so far."""
        return {
            "frozen": gc.get_freeze_count(),
            "collections": [generation["collections"] for generation in gc.get_stats()],
        }

    # -- disk faults (rlog.disk) -------------------------------------------------------------

    def turn(self) -> None:
        """One ``run_turn``, with the disk's faults handled: full -> the disk-full state, failed -> stop."""
        self._raise_if_checkpoint_failed()
        # A burst's lines left out, said once their second is over: the node's and its store's.
        self.warnings.flush()
        self.connection_count.flush_warnings()
        if self.store.checkpointer is not None:
            self.store.checkpointer.warnings.flush()
        self.reconnect_refused(monotonic_ms())
        try:
            if self.disk.probe_due(monotonic_ms()):
                self._probe_disk()
            self.run_turn()
        except Exception as error:
            fault = self.store.fault(error)  # before the rollback: SQLite keeps the write's errno till then
            if fault is None:
                raise
            self.abandon_turn(str(error))
            if fault is StorageFault.FAILED:
                self._storage_failed(error)  # the frame cut short is answered at the stop (``answer_at_stop``)
            cut = self._cut_answer(str(error), stopping=False)
            if cut is not None:
                self.reply(*cut)
            if self.disk.filled(str(error), monotonic_ms()):
                log.warning(
                    "%s %s: the disk is full (%s): refusing writes with %s, serving reads; "
                    "trying a write every %d ms, and resuming by itself once space is freed",
                    self.role,
                    self.config.name,
                    error,
                    ERROR_DISK_FULL,
                    self.disk.probe_interval_ms,
                )
            self.disk_filled()

    def _raise_if_checkpoint_failed(self) -> None:
        """Stop (``_storage_failed``) if the background WAL checkpointer failed a sync (``rlog.checkpoint``)."""
        checkpointer = self.store.checkpointer
        if checkpointer is not None and checkpointer.fatal is not None:
            self._storage_failed(checkpointer.fatal)

    def _storage_failed(self, error: BaseException) -> NoReturn:
        failed = error
        if not isinstance(error, StorageFailedError):
            # SQLite's messages name neither the file nor the error ("database disk image is malformed").
            failed = StorageFailedError(f"{self.store.path}: {type(error).__name__}: {error}")
            failed.__cause__ = error
        self.stop_reason = f"the disk failed: {failed}"
        self.store.disk_failed()
        raise failed

    def abandon_turn(self, reason: str = "the disk failed") -> None:
        """The disk failed this turn: roll back its transaction and send none of its frames as they
        are (they may acknowledge what was not made durable). A client's answer becomes
        ``outcome_unknown`` (dropped, it left the client to wait out its timeout): the client asks
        again, a write with the same request id, which the sequencer applies at most once; a refusal
        (an ``error``) tells of nothing written and is kept. Frames to peers are dropped. The answers
        leave with the next turn's frames, or at a stop (``answer_at_stop``). A driver that keeps frames
        of the turn outside the outbox (for ``before_send``) drops them too."""
        self.store.rollback()
        self._in_transaction = False
        self._durable = False
        dropped, self._outbox = self._outbox, []
        for socket, envelope, message in dropped:
            if socket is not None or not envelope:
                self.frames_dropped_disk += 1
            elif message.kind == "error":
                self._outbox.append((None, envelope, message))
            else:
                unknown = messages.error(
                    message.request_id, "outcome_unknown", f"the turn that answered failed: {reason}"
                )
                self._outbox.append((None, envelope, unknown))

    def _probe_disk(self) -> None:
        try:
            self.store.probe_space()
        except Exception as error:
            fault = self.store.fault(error)
            if fault is StorageFault.FULL:
                self.disk.probe_failed(str(error), monotonic_ms())
                return
            if fault is StorageFault.FAILED:
                self._storage_failed(error)
            raise
        full_ms = self.disk.freed(monotonic_ms())
        name = self.config.name
        log.warning("%s %s: the disk takes writes again after %d ms: accepting writes", self.role, name, full_ms)
        self.disk_freed()

    def disk_filled(self) -> None:
        """Hook: a turn failed for want of space and was rolled back; rebuild from disk, refuse writes."""

    def disk_freed(self) -> None:
        """Hook: a probe wrote durably; take part again."""

    def refuse_if_disk_full(self) -> None:
        """Raise the ``disk_full`` error for a write while the disk is full (one error for every node)."""
        refusal = self.disk.refusal()
        if refusal is not None:
            raise RequestError(ERROR_DISK_FULL, f"{self.role} {self.config.name}: {refusal}")

    def refresh_metrics(self) -> None:
        """Hand the metrics endpoint a fresh status, at most once per metrics.REFRESH_INTERVAL_MS."""
        now_ms = monotonic_ms()
        if self.metrics is not None and self.metrics.refresh_due(now_ms):
            self.metrics.refresh(now_ms, self.status())

    def malformed_frame(self) -> None:
        """Count a frame that does not decode or fit its schema (answered with an error by the caller)."""
        self.malformed_frames += 1
        if self.metrics is not None:
            self.metrics.malformed.inc()

    def close(self) -> None:
        try:
            self._close_serving()
        finally:
            # Whatever failed above or in the store's close (a disk error at its last checkpoint),
            # the data directory's lock is given back: a process that goes on could not open it again.
            try:
                self.store.close()
            finally:
                if self.data_dir_lock is not None:
                    self.data_dir_lock.release()

    def _close_serving(self) -> None:
        """Everything ``close`` stops before the store: the backup, metrics, queries, sockets, zmq."""
        if self.backup_job is not None and self.backup_job.state == "running":
            # A copy cut off by the process exit would leave FILE.partial behind, and a later backup
            # to the same path would refuse to start: stop it between two steps, it removes the file.
            log.warning("backup to %s cancelled: the node is shutting down", self.backup_job.path)
            if not self.backup_job.cancel("the node shut down"):
                log.warning("backup to %s did not stop in time; FILE.partial may remain", self.backup_job.path)
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        self.queries.stop()
        for endpoint in list(self.dealers):
            self.close_dealer(endpoint)
        if self.socket is not None:
            # A stop request's answer, and those of the requests answered at the stop (``answer_at_stop``),
            # may still sit in zmq's queue: give them a bounded time to leave.
            linger_ms = STOP_REPLY_LINGER_MS if self.stop_requested or self.stop_answers else 0
            self.socket.close(linger_ms)
            self.socket = None
        if self.listen_guard is not None:
            self.listen_guard.stop()
            self.listen_guard = None
        if self.context is not None:
            self.context.term()
            self.context = None

    def dealer(
        self, endpoint: str, queue_max: int, dealers_max: int, immediate: bool = False, monitored: bool = True
    ) -> zmq.Socket | None:
        """The DEALER connected to ``endpoint`` (made on first use; None past ``dealers_max``).

        ``immediate``: queue nothing while the connection is not up (zmq's IMMEDIATE), so a dead
        endpoint costs a socket and no memory: sends to it are dropped at once. ``monitored``: watched
        for a refusal at its handshake and dialled again (``reconnect_refused``); a core's DEALERs
        toward replicant endpoints are not (up to ``watches_max`` of them: a monitor is two more zmq
        sockets each, about 6 MB at 256 dead watches, past their memory budget's test bound).
        """
        socket = self.dealers.get(endpoint)
        if socket is None:
            if self.context is None or len(self.dealers) >= dealers_max:
                return None
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, queue_max)
            socket.setsockopt(zmq.RCVHWM, queue_max)
            socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.frame_bytes_max * SOCKET_MESSAGE_FACTOR)
            if immediate:
                socket.setsockopt(zmq.IMMEDIATE, 1)
            if self.security is not None:
                self.security.secure_client(socket)
            # Before the connection: its first handshake may be refused (rlog.connections).
            monitor = socket.get_monitor_socket(DEALER_EVENTS) if monitored else None
            try:
                socket.connect(endpoint)
            except zmq.ZMQError as error:
                # An endpoint zmq cannot parse: a socket left open here would block context teardown.
                if monitor is not None:
                    monitor.close(0)
                socket.close(0)
                log.warning("cannot connect to %.80r: %s", endpoint, error)
                return None
            self.dealers[endpoint] = socket
            if monitor is not None:
                self.dealer_monitors[endpoint] = monitor
            self.dealer_endpoints[id(socket)] = endpoint
        return socket

    def close_dealer(self, endpoint: str) -> None:
        socket = self.dealers.pop(endpoint, None)
        monitor = self.dealer_monitors.pop(endpoint, None)
        self.refused_dealers.forget(endpoint)
        if monitor is not None:
            monitor.close(0)
        if socket is not None:
            # zmq lets go of its frames: their trackers are done, the peer's ledger needs no reset.
            self.peer_sockets.pop(id(socket), None)
            self.dealer_endpoints.pop(id(socket), None)
            socket.close(0)

    def reconnect_refused(self, now_ms: int) -> None:
        """Dial again, after a back-off, each DEALER of this node that another node refused, for its
        ``connections_max`` or for this node's key (zmq would never dial it again: rlog.connections).
        The monitors are read at most every ``MONITOR_READ_INTERVAL_MS``: a clock read and a comparison
        on other turns."""
        if now_ms - self._monitors_read_ms < MONITOR_READ_INTERVAL_MS:
            return
        self._monitors_read_ms = now_ms
        for endpoint, monitor in self.dealer_monitors.items():
            while monitor.poll(0):
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.refused_dealers.connected(endpoint)
                    continue
                why = REFUSAL_REASONS.get(event["value"])
                if why is not None:
                    self._warn_refused(endpoint, why, self.refused_dealers.refused(endpoint, why, now_ms))
        for endpoint in self.refused_dealers.take_due(now_ms):
            socket = self.dealers[endpoint]
            with contextlib.suppress(zmq.ZMQError):
                # zmq keeps the endpoint of the ended session (checked with libzmq 4.3.5); were it gone
                # already, connecting is what matters.
                socket.disconnect(endpoint)
            socket.connect(endpoint)

    def _warn_refused(self, endpoint: str, why: str, delay_ms: int) -> None:
        """Say (at most once a second for each ``why``) that ``endpoint`` refused this node's DEALER."""
        redials = self.refused_dealers.redials[why]
        if why == REFUSED_FULL:
            self.warnings.log(
                "connection refused for connections_max",
                logging.WARNING,
                "%.80s refused this node's connection: it holds its [limits] connections_max "
                "connections; dialling it again in %d ms (%d dialled again so far)",
                endpoint,
                delay_ms,
                redials,
            )
            return
        public = self.security.client.public.decode("ascii") if self.security is not None else "?"
        self.warnings.log(
            "connection refused for its key",
            logging.WARNING,
            "%.80s refused this node's key %s (the public half of [security] client_key): it is not in that "
            "node's authorized_keys; copy this node's public key file there and send that node SIGHUP "
            "(kill -HUP), no restart of this node needed; dialling it again in %d ms (%d dialled again so far)",
            endpoint,
            public,
            delay_ms,
            redials,
        )

    def bound_sends(self, socket: zmq.Socket, peer: str) -> None:
        """Bound in bytes what ``socket`` (a DEALER toward the peer core ``peer``) holds: every frame
        queued for it (``queue``, ``send_now``) is sent by ``send_bounded``."""
        # pyzmq copies a frame sent without a copy below this, and its tracker is done at once: the
        # frames PeerQueues counts would leave its ledger unsent.
        socket.copy_threshold = 0
        self.peer_sockets[id(socket)] = peer

    def send_bounded(self, peer: str, socket: zmq.Socket, frame: bytes) -> str | None:
        """Send ``frame`` toward the peer core ``peer`` unless ``core_queue_bytes_max`` of earlier frames
        are still queued toward it (``peer_queues``): None once sent, else why not (counted, and said in
        a warning at most once a second per peer). Raises what zmq raises (``zmq.Again``: its queue is full)."""
        refusal = self.peer_queues.refusal(peer, len(frame))
        if refusal is not None:
            self.warnings.log(
                f"peer queue full {peer}",
                logging.WARNING,
                "core %s: %s; what is sent to it is refused until it reads (a forwarded write: no_sequencer, "
                "nothing sent; consensus messages are sent again later)",
                peer,
                refusal,
                logger=log,
            )
            return refusal
        if len(frame) < self.tracked_bytes_min:
            send_frames(socket, [frame])
        else:
            self.peer_queues.sent(peer, send_tracked(socket, [frame]), len(frame))
        return None

    # -- requests held for a later answer ----------------------------------------------------

    def hold(self, envelope: list[bytes] | None, request_id: str, changes: bool = True) -> None:
        """Count a request that will be answered later; refuse past ``requests_outstanding_max`` per
        connection, and a connection with nothing waiting yet past ``connections_waiting_max`` per node,
        or a peer's (a core or replicant forwarding for its clients: ``_from_peer``) only past
        ``PEER_CONNECTIONS_RESERVED`` more, so that a flood of clients does not refuse what peers forward.
        A peer's connection holds at least ``PEER_REQUESTS_OUTSTANDING_MIN`` requests, what a core
        forwards at once; whether it is a peer's is looked at only once the bound is reached.

        ``changes``: what a stop answers it (``answer_at_stop``). True (a write, or anything that may
        change the database once it was looked at): ``outcome_unknown``, never an answer that says it
        failed when it may still commit. False (a read, a query, a changefeed page): ``stopping``, and
        the client asks another node. True is the default because it is never wrong, only less helpful.
        """
        if envelope is None:
            return
        held = self.outstanding.get(envelope[0])
        if held is None:
            connections_max = self.config.limits.connections_waiting_max
            waiting = len(self.outstanding)
            if waiting >= connections_max and (
                waiting >= connections_max + PEER_CONNECTIONS_RESERVED or not self._from_peer(envelope)
            ):
                self.connections_refused += 1
                raise OverloadedError(
                    f"{len(self.outstanding)} connections have requests waiting for an answer here "
                    f"(connections_waiting_max {connections_max}); retry later"
                )
            held = self.outstanding[envelope[0]] = {}
        requests_max = self.config.limits.requests_outstanding_max
        if (
            request_id not in held
            and len(held) >= requests_max
            and (len(held) >= PEER_REQUESTS_OUTSTANDING_MIN or not self._from_peer(envelope))
        ):
            raise OverloadedError(
                f"{len(held)} requests of this connection are outstanding (requests_outstanding_max "
                f"{requests_max}, a peer's at least {PEER_REQUESTS_OUTSTANDING_MIN}); read the answers first"
            )
        reloads = self.security.reloads if self.security is not None else 0
        held[request_id] = HeldRequest(envelope, changes, *self._handling, reloads)
        if self.metrics is not None and len(self._held_since_s) < HELD_TIMES_MAX:
            self._held_since_s[(envelope[0], request_id)] = time.monotonic()

    def _from_peer(self, envelope: list[bytes]) -> bool:
        """Whether the frame being handled (the one ``receive_frames`` yielded last) came over
        ``envelope``'s connection from a peer (``roles.peer_connection``). Asked by ``hold`` only
        at ``connections_waiting_max`` or ``requests_outstanding_max``: the frame is found by the
        turn's iterator's position, and nothing is kept per frame."""
        unreached, frames = self._turn_unreached, self._turn_frames
        if unreached is None:
            return False  # not within a turn's frames: a request held later is not a frame's
        index = len(frames) - operator.length_hint(unreached) - 1
        if not 0 <= index < len(frames) or frames[index][0] != envelope:
            return False
        _envelope, frame, principal = frames[index]
        if self.security is not None:
            return peer_connection(True, self.security.roles.roles_of(principal), False)
        try:
            message = messages.decode(frame, self.config.limits.frame_bytes_max)
        except MessageError:
            return False
        return peer_connection(False, frozenset(), getattr(message.body, "forwarded", False) is True)

    def refuse_held_again(self, envelope: list[bytes], message: Message) -> None:
        """Refuse a read (a changefeed page, a query or its page, a read that waits for a key) whose
        request id this connection waits on already; the driver asks before it handles the read.

        ``hold`` counts an id once per connection, and that is all it can do: each waiting place (the
        changefeed's, the query waits and workers, a replicant's waiting reads) would take the resend
        as one more request, bounded only by the node-wide limits. The newer one is refused, not the
        older answered: the older is where it waits and answers under the id in its time, and taking it
        out of every one of those places would cost each of them a search. The Python client never
        re-sends on the connection it waits on (silence drops its socket), so this answers only a
        client that reused an id whose answer it is owed. A request a core forwarded is not refused:
        a core of an earlier release forwards a read under its client's id, re-sends a client's resend
        on its one connection, and relays the first answer to the newest client (``core.outcome``,
        rule 4). Writes are not asked: a resend of a write is answered from the log, at most
        ``RESENDS_WAITING_MAX`` per connection and id (``core.outcome``), or by its held failed guard
        (``core.guard_tail``, rule 3)."""
        held = self.outstanding.get(envelope[0])
        if held is None or message.request_id not in held or getattr(message.body, "forwarded", False):
            return
        raise RequestError(
            "bad_request",
            f"request {message.request_id} of this connection is held already, waiting for its answer; "
            "wait for that answer, or send a new request with a new request id",
        )

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        sockets = (self.socket, *self.dealers.values())
        if self._poller is None or self._poller[0] != sockets:
            poller = zmq.Poller()
            for socket in sockets:
                if socket is not None:
                    poller.register(socket, zmq.POLLIN)
            # A query page finished on a runner thread wakes the loop at once; so does a signal.
            poller.register(self.queries.wakeup_fd, zmq.POLLIN)
            if self.signals is not None:
                poller.register(self.signals.wakeup_fd, zmq.POLLIN)
            self._poller = (sockets, poller)
        poller = self._poller[1]
        if self.store.index_builds():
            # The next step of an online index build is due then: the loop turns by that time.
            timeout_ms = max(0, min(timeout_ms, self._next_build_ms - monotonic_ms()))
        ready = dict(poller.poll(timeout_ms))
        self._queries_woken = self.queries.wakeup_fd in ready
        if self.signals is not None and self.signals.wakeup_fd in ready:
            self.signals.drain()  # what the signal asked is taken at the loop's next iteration
        return ready

    def urgent(self, frame: bytes, principal: str) -> bool:
        """Hook: whether ``frame`` from ``principal`` is handled first and outside the turn's budget
        (``receive_frames``); a core's peer messages are (``CoreNode.urgent``), nothing else is."""
        return False

    def receive_frames(self, clock_ms: Callable[[], int]) -> Iterator[tuple[list[bytes], bytes, str]]:
        """The (envelope, frame, principal) triples to handle in this loop turn, urgent ones first.

        DESIGN invariant 11: a long run of large transactions, pushes or catch-up reads must never
        delay what keeps the quorum alive. Each turn takes up to ``group_commit_max`` new frames off
        the socket (``receive``: nothing is decoded), after the frames left over from earlier turns.
        The ``urgent`` ones (a core's peer messages: heartbeats, appends, votes) are all handled
        now; the others in arrival order until ``turn_ms_max`` of handling or ``turn_bytes_max``
        bytes, and the rest wait in a backlog for the next turn, which the driver starts by handling
        input and only then firing timers. The backlog holds at most ``4 * group_commit_max`` frames
        and ``4 * turn_bytes_max`` bytes: a frame beyond that is answered ``overloaded`` and dropped
        (clients retry with the same request id; an agent re-sends after a lost acknowledgement).
        """
        self._turn_began_s = time.monotonic()
        limits = self.config.limits
        frames = list(self._backlog)
        self._backlog.clear()
        try:  # no cost unless it raises (Python 3.11's exception tables)
            for _ in range(limits.group_commit_max):
                try:
                    received = self.receive()
                except zmq.Again:
                    break
                if received is not None:
                    frames.append(received)
            # Stable: urgent frames first, each group in arrival order.
            frames.sort(key=lambda triple: not self.urgent(triple[1], triple[2]))
        except BaseException:  # a zmq error while the socket closes: what was read is not dropped
            self._return_to_backlog(frames)
            raise
        started_ms = clock_ms()
        handled_bytes = 0
        backlog_bytes = 0
        # What a failed turn has not reached (``frames_cut``): the iterator's rest, no work per frame.
        self._turn_frames = frames
        unreached = self._turn_unreached = iter(frames)
        for triple in unreached:
            frame = triple[1]
            try:
                is_urgent = self.urgent(frame, triple[2])
            except BaseException:
                self._turn_unreached = None
                self._return_to_backlog([triple, *unreached])
                raise
            over_budget = handled_bytes >= limits.turn_bytes_max or clock_ms() - started_ms >= limits.turn_ms_max
            if is_urgent or not over_budget:
                handled_bytes += len(frame)
                yield triple
            elif (
                len(self._backlog) < BACKLOG_FACTOR * limits.group_commit_max
                and backlog_bytes + len(frame) <= BACKLOG_FACTOR * limits.turn_bytes_max
            ):
                self._backlog.append(triple)
                backlog_bytes += len(frame)
            else:
                self._refuse_busy(triple[0], frame)
        self._turn_unreached = None  # the turn's frames are done with (``_from_peer``)
        self._turn_frames = []

    def _refuse_busy(self, envelope: list[bytes], frame: bytes) -> None:
        """Answer ``overloaded`` a frame the backlog has no room for (``receive_frames``)."""
        self.reply(envelope, messages.error(request_id_of(frame), "overloaded", f"{self.config.name} is busy"))

    def _return_to_backlog(self, triples: Iterable[tuple[list[bytes], bytes, str]]) -> None:
        """Frames read but not handled, put back in the backlog within its bound (``receive_frames``);
        one beyond it is answered ``overloaded``. Only on the way out of a failed turn: nothing per frame."""
        limits = self.config.limits
        count_max = BACKLOG_FACTOR * limits.group_commit_max
        bytes_max = BACKLOG_FACTOR * limits.turn_bytes_max
        backlog_bytes = sum(len(frame) for _envelope, frame, _principal in self._backlog)
        for triple in triples:
            frame = triple[1]
            if len(self._backlog) < count_max and backlog_bytes + len(frame) <= bytes_max:
                self._backlog.append(triple)
                backlog_bytes += len(frame)
            else:
                self._refuse_busy(triple[0], frame)

    def has_backlog(self) -> bool:
        return bool(self._backlog)

    def serve_frames(self) -> None:
        """Handle this turn's frames (``receive_frames``): decode each, refuse it if its principal may
        not send it (``refusal``; a push is never answered), else ``_dispatch`` it; a refused request
        (``RequestError``, ``SchemaError``, ``OverloadedError``) is answered with its error."""
        if self.socket is None:
            return
        for envelope, frame, principal in self.receive_frames(self.clock_ms):
            try:  # no cost per frame unless it raises (Python 3.11's exception tables)
                try:
                    message = messages.decode(frame, self.config.limits.frame_bytes_max)
                except MessageError as error:
                    self.malformed_frame()
                    self.refuse(envelope, request_id_of(frame), error)
                    continue
                refused = self.refusal(principal, message)
                if refused is not None:
                    if message.kind != "push":  # pushes are never answered
                        self.reply(envelope, refused)
                    continue
                self._handling = (principal, message.kind)  # what ``hold`` records of a held request
                try:
                    self._dispatch(envelope, message, principal)
                except Deferred:
                    pass
                except (RequestError, SchemaError, OverloadedError) as error:
                    self.refuse(envelope, message.request_id, error)
                finally:
                    self._handling = NOT_HANDLING
            except BaseException:
                self.frames_cut(envelope, frame)  # the turn fails: this frame and the unreached ones are answered
                raise

    def _dispatch(self, envelope: list[bytes], message: Message, principal: str = "") -> None:
        raise NotImplementedError

    def frames_cut(self, envelope: list[bytes] | None, frame: bytes) -> None:
        """The handling of ``frame`` (from ``receive_frames``) raised: a disk fault, or a bug. Without
        this, that frame and those the turn had read but not reached yet were dropped with the turn,
        and each client waited out its timeout. The unreached frames go back to the backlog, within its
        bound (``_return_to_backlog``: one beyond it is answered ``overloaded``): a turn the disk
        filled handles them next, a stop answers them ``stopping``. ``frame`` is answered by ``turn``
        or ``answer_at_stop`` (``cut_answer``) unless its handling answered or held it already.
        Called by a driver's loop only on the way out of a failed turn: nothing per frame."""
        if envelope is not None:
            self._cut = (envelope, frame)
        if self._turn_unreached is not None:
            unreached, self._turn_unreached = self._turn_unreached, None
            self._turn_frames = []
            self._return_to_backlog(unreached)

    def _cut_answer(self, reason: str, stopping: bool) -> tuple[list[bytes], Message] | None:
        """The answer owed to the frame a failed turn cut short (``frames_cut``), once; None if it is
        owed none: nobody answers its kind, it is held (its holder answers), or it is answered already."""
        cut, self._cut = self._cut, None
        if cut is None:
            return None
        envelope, frame = cut
        answer = cut_answer(frame, reason, stopping)
        if answer is None or answer.request_id in self.outstanding.get(envelope[0], ()):
            return None
        for socket, to, message in self._outbox:
            if socket is None and to == envelope and message.request_id == answer.request_id:
                return None
        return envelope, answer

    # -- the turn's transaction and outbox ---------------------------------------------------

    def begin(self, durable: bool = True) -> None:
        """Open the turn's write transaction if it is not open yet.

        ``durable=False``: what the caller writes may be lost in a power failure without harm (a
        restart redoes it, like applying entries that are durable in the log already); the turn's
        commit then skips its fsync unless another write of the same turn asked for durability.
        """
        if not self._in_transaction:
            self.store.connection.execute("BEGIN IMMEDIATE")
            self._in_transaction = True
        self._durable = self._durable or durable

    # -- read-only SQL queries (rlog.query) ---------------------------------------------------

    def query_received(self, message: Message) -> tuple[QueryRequest, CheckedQuery, tuple[str, ...]]:
        """A ``query``: its fields, the statement checked by SQLite (a prepare), the shards it reads."""
        try:
            request = query_request(message.body, self.queries.limits.page_rows_max)
            catalog = self.store.catalog()
            checked = self.queries.check(request.sql, request.params, catalog)
        except QueryError as error:
            if error.code == "unknown_table":
                raise self.unknown_table(str(error)) from None
            raise RequestError(error.code, str(error)) from None
        return request, checked, shards_of(checked.tables, catalog)

    def unknown_table(self, message: str) -> RequestError:
        """The answer to a request (a read, a query, a changefeed) naming a table this node's catalog
        lacks. A core overrides it: while it is catching up, its catalog may lack a table the cluster
        has, and it says ``not_ready`` (ask again, or another node) instead."""
        return RequestError("unknown_table", message)

    def query_wait(
        self,
        envelope: list[bytes],
        message: Message,
        request: QueryRequest,
        checked: CheckedQuery,
        shards: tuple[str, ...],
        targets: dict[str, Any],
    ) -> None:
        """Hold a checked query until each shard reaches its target (``serve_queries`` starts it).

        A query of the same request id still waiting or with a cursor open is the client's earlier
        attempt (it heard nothing and sent the query again, often on a new connection): it is taken out
        and answered ``sent_again``, and its cursor closed, instead of holding a place and a snapshot
        until its wait ends or ``query_idle_ms_max`` for a connection that no longer reads it."""
        request_id = message.request_id
        self.hold(envelope, request_id, changes=False)
        for earlier in self.waiting_queries.withdraw(request_id):
            told = messages.error(request_id, "sent_again", "the query was sent again; the answer goes to the newest")
            self.reply(earlier.payload[0], told)
        self.queries.withdraw(request_id)
        waiting = WaitingQuery(
            (envelope, request_id),
            checked,
            shards,
            targets,
            request.page_rows,
            monotonic_ms() + request.wait_ms,
            request_id=request_id,
            client=envelope[0],
        )
        try:
            self.waiting_queries.add(waiting)
        except QueryError as error:
            raise RequestError(error.code, str(error)) from None

    def count_later(
        self, envelope: list[bytes], request_id: str, table: TableSchema, target: TxKey, forwarded: bool = False
    ) -> bool:
        """Run a ``count`` of ``table`` on a query worker once its shard reached ``target`` (the key this
        node had applied when the read was checked), and answer it from there (``serve_queries``).

        SQLite counts a table by reading all of it: tens of milliseconds a million rows when cached,
        seconds for a large table read from disk. On the loop that would hold every heartbeat and
        append for as long (DESIGN invariant 11); a query worker has its own snapshot, the query
        budget (``query_ms_max``) and the cursor bound. False: the statement cannot be checked now (the
        table was created in this turn, which is not committed): the caller counts on the loop, a table
        that new holding at most a turn's rows. ``forwarded``: a peer's (a core forwarding its clients'
        linearizable counts), whose connection's cursors count toward the node's bound only."""
        try:
            checked = self.queries.check(f"SELECT count(*) FROM {quote(table.name)}", (), self.store.catalog())
        except QueryError:
            return False
        self.hold(envelope, request_id, changes=False)
        payload, deadline_ms = CountRead(envelope, request_id), monotonic_ms() + QUERY_WAIT_MS_DEFAULT
        waiting = WaitingQuery(
            payload,
            checked,
            (table.shard,),
            {table.shard: target},
            COUNT_PAGE_ROWS,
            deadline_ms,
            client=None if forwarded else envelope[0],
        )
        try:
            self.waiting_queries.add(waiting)
        except QueryError as error:
            raise RequestError(error.code, str(error)) from None
        return True

    def _counted(self, page: dict[str, Any]) -> int:
        """The row count a ``count`` query's page holds (``SELECT count(*)``: one row, one column)."""
        if page["cursor"] is not None:  # not expected (the page reads past the one row): never left open
            self.queries.close(page["cursor"])
        return page["rows"][0][0]

    def query_cursor_request(self, envelope: list[bytes], message: Message) -> None:
        """``query_page`` (the next page comes through ``serve_queries``) or ``query_close``."""
        try:
            cursor, page_rows = page_request(message.body, self.queries.limits.page_rows_max)
            if message.kind == "query_close":
                self.reply(envelope, messages.reply(message.request_id, {"closed": self.queries.close(cursor)}))
                return
            self.hold(envelope, message.request_id, changes=False)
            self.queries.next_page((envelope, message.request_id), cursor, page_rows)
        except QueryError as error:
            raise RequestError(error.code, str(error)) from None

    def serve_queries(self, reached: Callable[[str, Any], bool]) -> None:
        """Once per turn: start the queries whose shards ``reached`` their targets, answer finished
        pages, and time out waits and idle cursors."""
        now = monotonic_ms()
        # Before the pages are collected: a shard that stopped serving before a worker took a first
        # page's snapshot is noted in this turn or an earlier one (it serves again turns later).
        note_unserved(self._queries_starting.values(), reached)
        # The ready ones first: a wait ends when its shards reach their keys or its deadline passes,
        # whichever comes first, and a query whose shards are there is answered even if its deadline is
        # now too. Expired first, a query of wait_ms 0 ("do not wait", docs/concepts/queries.md) timed
        # out on its first turn, also one with nothing to wait for.
        for waiting in self.waiting_queries.ready(reached):
            try:
                self.queries.start(waiting)
            except QueryError as error:
                envelope, request_id = waiting.payload
                self.refuse(envelope, request_id, error)
            else:
                self._queries_starting[id(waiting)] = waiting
        for waiting in self.waiting_queries.expired(now):
            envelope, request_id = waiting.payload
            self.reply(envelope, messages.error(request_id, "timeout", f"query not started: {waiting.describe()}"))
        for finished in self.queries.finished(drain=self._queries_woken):
            if finished.failed is not None:
                # A query's read met a damaged database or an I/O error (``rlog.store.read_fault``):
                # raised here, on the loop, the node stops as for any failed disk (``turn``).
                raise finished.failed
            envelope, request_id = finished.payload
            again = finished.behind
            if finished.first is not None:
                self._queries_starting.pop(id(finished.first), None)
                if finished.first.unserved and again is None:
                    # Its snapshot may hold no committed state: not answered, run again once it serves.
                    if finished.result is not None and finished.result["cursor"] is not None:
                        self.queries.close(finished.result["cursor"])
                    again, finished.first.unserved = finished.first, False
            if again is not None:
                # The snapshot missed a key this node applied in a turn not committed then, or its
                # shard stopped serving before it was taken: wait again.
                try:
                    self.waiting_queries.add(again)
                except QueryError as error:
                    self.refuse(envelope, request_id, error)
            elif finished.error is not None:
                self.reply(envelope, messages.error(request_id, finished.error.code, str(finished.error)))
            elif isinstance(finished.payload, CountRead):
                self.reply(envelope, messages.reply(request_id, {"rows": self._counted(finished.result)}))
            else:
                self.reply(envelope, messages.reply(request_id, finished.result))
        self.queries.expire(now)

    # -- the changefeed (rlog.changes; the node keeps nothing per consumer between pages) ---------

    def changes_request(
        self, envelope: list[bytes], message: Message, serving: Callable[[str], Any], table_batch: TableBatch
    ) -> None:
        """Answer a ``changes`` request with its next page, or hold it (a caught-up page, ``wait_ms``)
        until a shard it follows moves; ``serving`` raises ``RequestError`` for a shard not served now."""
        body: messages.Changes = message.body
        page = self._changes_page(body, body.positions, serving, table_batch)
        wait_ms = CHANGES_WAIT_MS_DEFAULT if body.wait_ms is None else body.wait_ms
        now_ms = monotonic_ms()
        deadline_ms = now_ms + wait_ms
        if not keep_holding(page, now_ms, deadline_ms):
            self._answer_changes(envelope, message.request_id, page)
            return
        waiting_max = self.config.limits.changes_waiting_max
        if len(self.waiting_changes) >= waiting_max:
            self.changes_served["refused"] += 1
            raise OverloadedError(f"{waiting_max} changefeed requests are waiting here (changes_waiting_max)")
        self.hold(envelope, message.request_id, changes=False)
        shards = frozenset(self.store.shards())
        self.waiting_changes.append(
            WaitingChanges(
                envelope, message, serving, table_batch, dict(page.applied), deadline_ms, page.positions, shards
            )
        )

    def _changes_page(
        self,
        body: messages.Changes,
        positions: list[messages.ChangesPosition],
        serving: Callable[[str], Any],
        table_batch: TableBatch,
    ) -> Page:
        limits = self.config.limits
        records_max = limits.changes_page_records_max
        if body.page_records is not None:
            records_max = min(records_max, body.page_records)
        bytes_max = max(1, min(limits.changes_page_bytes_max, limits.frame_bytes_max // CHANGES_FRAME_SHARE))
        reader = StoreFeedReader(self.store, table_batch)
        try:
            page = build_page(reader, body.tables, positions, PageLimits(records_max, bytes_max))
        except ChangesError as error:
            if error.code == "unknown_table":
                raise self.unknown_table(str(error)) from None
            raise RequestError(error.code, str(error)) from None
        for shard in page.applied:
            serving(shard)
        return page

    def serve_changes(self) -> None:
        """Once per turn: answer the held changefeed requests whose shards moved, or whose wait ended."""
        if not self.waiting_changes:
            return
        now = monotonic_ms()
        positions = self.store.shards()
        # Asked of the shards the held requests follow only: a turn costs what is held, not the node's shards.
        followed = {shard for held in self.waiting_changes for shard in held.applied}
        not_serving = self.shards_not_serving_changes(followed)
        for waiting in list(self.waiting_changes):
            applied = {shard: position.applied for shard, position in positions.items()}
            if not worth_a_page(waiting.applied, applied, now, waiting.deadline_ms, waiting.shards, not_serving):
                continue
            request_id = waiting.message.request_id
            try:
                page = self._changes_page(waiting.message.body, waiting.positions, waiting.serving, waiting.table_batch)
            except RequestError as error:
                self.waiting_changes.remove(waiting)
                self.refuse(waiting.envelope, request_id, error)
                continue
            if keep_holding(page, now, waiting.deadline_ms):
                # Paged again from here: what this page passed holds nothing for the request.
                waiting.applied, waiting.positions = dict(page.applied), page.positions
                waiting.shards = frozenset(positions)  # a new shard wakes a held request once
                continue
            self.waiting_changes.remove(waiting)
            self._answer_changes(waiting.envelope, request_id, page)

    def shards_not_serving_changes(self, followed: Collection[str]) -> Collection[str]:
        """Hook: of ``followed`` (the shards held changefeed requests follow: a turn asks about no other,
        so its cost does not grow with the node's shards), those whose ``changes`` this node refuses now
        (``not_ready``) and will not serve soon: a core's snapshot install, its rows lost, its log stuck
        or stopped; a replicant's bootstrap until its copy is healed. A held changefeed request following
        one is answered at once (``rlog.changes.worth_a_page``) with what a request asked then gets, not
        at the end of its wait. A shard refused only briefly may be left out (a replicant failing over,
        most often to resume): a request held on it waits for its next page."""
        return ()

    def _answer_changes(self, envelope: list[bytes], request_id: str, page: Page) -> None:
        served = self.changes_served
        served["pages"] += 1
        served["records"] += len(page.records)
        served["snapshots"] += sum(1 for record in page.records if record["kind"] == "snapshot_begin")
        self.reply(envelope, messages.reply(request_id, page.to_wire()))

    def changes_statistics(self) -> dict[str, int]:
        """The changefeed's figures for ``status``: served since start, and the requests held now."""
        return {**self.changes_served, "held": len(self.waiting_changes)}

    def build_indexes(self) -> None:
        """The next step of each online index build (rlog.store), at most every ``INDEX_BUILD_INTERVAL_MS``.
        A step is local work a restart redoes from its persisted progress: the turn's commit needs no fsync.
        None while the disk is full (``rlog.disk``): a step writes, so each one failed its turn again (every
        10 ms: the answers of those turns waited, clients timed out) and put the probe off (``DiskHealth.filled``)."""
        now_ms = monotonic_ms()
        if not self.store.index_builds() or now_ms < self._next_build_ms or self.disk.full:
            return
        self._next_build_ms = now_ms + INDEX_BUILD_INTERVAL_MS
        self.begin(durable=False)
        for table in self.store.index_build_step():
            log.info("indexes of table %s built", table)

    def reply(self, envelope: list[bytes] | None, message: Message, now: bool = False) -> None:
        """Queue an answer to the ROUTER peer ``envelope`` (None: nobody to answer).

        ``now``: send it at once, before the turn's commit, instead of behind it. Only for an answer
        whose truth does not hang on this turn's writes: a write's acknowledgement (its entry is
        committed, so durable on a majority of cores in earlier turns' commits, whatever becomes of
        this turn's; ``core.outcome``). Nothing reads this node's applied state before the turn's
        commit that could miss the write: the loop serves every later request after it, and a query
        runner whose snapshot missed a key applied in an uncommitted turn waits again (``serve_queries``).
        """
        if envelope is not None:
            if self.metrics is not None:
                # A write that was not held is answered in the turn that received it.
                since = self._held_since_s.pop((envelope[0], message.request_id), self._turn_began_s)
                result = message.body.result if message.kind == "reply" else None
                if since is not None and isinstance(result, dict) and "tx_key" in result:
                    self.metrics.acknowledged(time.monotonic() - since)
            held = self.outstanding.get(envelope[0])
            if held is not None:
                request = held.pop(message.request_id, None)
                if not held:
                    del self.outstanding[envelope[0]]
                if request is not None and request.principal and not request.changes and message.kind != "error":
                    message = self._revoked_since(request, message)
            if now:
                self._send_queued(None, envelope, message)
            else:
                self._outbox.append((None, envelope, message))

    def _revoked_since(self, request: HeldRequest, message: Message) -> Message:
        """``message``, or ``forbidden`` if a reload since ``request`` was held removed (or replaced) its
        sender's key or the role that allowed it: a read waiting for a key, a changefeed or a query waiting for
        its shards would otherwise carry data to a key that "stops working at the reload"
        (docs/operations/security.md). A write's outcome is told as it is: it was allowed when sent."""
        security = self.security
        if security is None or security.allows(request.principal, request.kind, request.reloads):
            return message
        principal = request.principal
        if security.revoked_at.get(principal, 0) > request.reloads or principal not in security.authorized.values():
            security.refused_unknown_key += 1  # its key was removed, or replaced by a new key of the principal
        else:
            security.refused_role += 1  # its key stays, its role no longer allows the kind
        return messages.error(message.request_id, "forbidden", REVOKED_HELD)

    def refuse(self, envelope: list[bytes] | None, request_id: str, error: Exception) -> None:
        """Answer a refused request: an error with a ``code`` (``RequestError`` with its detail,
        ``SchemaError``, ``QueryError``, ``MessageError``) or an ``OverloadedError`` (code ``overloaded``);
        the one place these become an ``error`` answer."""
        code = "overloaded" if isinstance(error, OverloadedError) else getattr(error, "code", "internal")
        self.reply(envelope, messages.error(request_id, code, str(error), getattr(error, "detail", None)))

    def queue(self, socket: zmq.Socket, message: Message) -> None:
        """Queue a frame for a DEALER socket."""
        self._outbox.append((socket, [], message))

    def before_send(self) -> None:
        """Hook: queue more frames after the commit and before the sends (for example agent pushes)."""

    def after_commit(self) -> None:
        """Hook: the turn's writes are durable now; anything it writes goes in one more commit."""

    def send_now(self, socket: zmq.Socket, message: Message) -> None:
        """Send a frame to a DEALER socket at once, before the turn's commit: only for what may be
        said before the turn's writes are durable (a sequencer's appends, Raft thesis 10.2.1)."""
        try:
            frame = messages.encode(message)
        except MessageError as error:
            # As in flush: a message of ours that our own typed layer refuses is a bug here.
            log.error("dropped an outgoing %s that does not encode: %s", message.kind, error)
            return
        self._send_dealer(socket, message, frame)

    def _send_dealer(self, socket: zmq.Socket, message: Message, frame: bytes) -> None:
        """Send ``message``'s ``frame`` on a DEALER: within its peer's bound if it has one (``bound_sends``);
        a frame not sent is counted and ``frame_unsent`` told."""
        try:
            peer = self.peer_sockets.get(id(socket))
            if peer is None:
                send_frames(socket, [frame])
                return
            refusal = self.send_bounded(peer, socket, frame)
            if refusal is not None:
                self.frame_unsent(message, refusal)
        except zmq.Again:
            refusal = self._refusal_toward(socket)
            self._dropped(message.kind, refusal or "the receiver's queue is full", refused=refusal is not None)
            self.frame_unsent(message, refusal or "the receiver's queue is full")
        except zmq.ZMQError as error:
            # A socket closed meanwhile (its endpoint no longer used): every protocol here re-sends.
            self._dropped(message.kind, str(error))
            self.frame_unsent(message, str(error))

    def _send_queued(self, socket: zmq.Socket | None, envelope: list[bytes], message: Message) -> None:
        """Send one frame of the outbox (``socket`` None: an answer through the ROUTER socket)."""
        target = socket if socket is not None else self.socket
        if target is None:
            return
        try:
            frame = messages.encode(message)
        except MessageError as error:
            if socket is not None:
                # A message of ours to a peer or replicant that our own typed layer refuses is a bug
                # here: say so in the log, and never send the peer an ``error`` it did not ask for.
                log.error("dropped an outgoing %s that does not encode: %s", message.kind, error)
                return
            frame = messages.encode(messages.error(message.request_id, "internal", f"reply not encodable: {error}"))
        if socket is not None:
            self._send_dealer(socket, message, frame)
            return
        if len(frame) > self.config.limits.frame_bytes_max:
            # The client would drop a frame above its limit and report silence: say why instead.
            frame = messages.encode(
                messages.error(
                    message.request_id,
                    "too_large",
                    f"the answer is {len(frame)} bytes, above frame_bytes_max "
                    f"{self.config.limits.frame_bytes_max}; ask for fewer rows",
                )
            )
        tracked = len(frame) >= COPY_BYTES_MIN
        if tracked:
            # Bounded in bytes per connection (UnreadAnswers), beside zmq's bound in frames.
            refusal = self.unread_answers.refusal(envelope[0], len(frame))
            if refusal is not None:
                frame = messages.encode(messages.error(message.request_id, "overloaded", refusal))
                tracked = False
        try:
            # A large frame goes without a copy (send_frames): copying a 256 KiB push cost about a
            # millisecond of the loop (fresh pages), and held each frame twice until zmq had sent it.
            if tracked:
                self.unread_answers.sent(envelope[0], send_tracked(target, [*envelope, frame]), len(frame))
            else:
                send_frames(target, [*envelope, frame])
        except zmq.ZMQError as error:
            # zmq.Again too: an answer to a client whose queue is full is dropped (the client retries).
            self._dropped(message.kind, "the receiver's queue is full" if isinstance(error, zmq.Again) else str(error))

    def _refusal_toward(self, socket: zmq.Socket) -> str | None:
        """Why the node at the other end of ``socket`` (a DEALER of this node's) refused its connection
        at its last handshake (nothing can reach it: what is sent fills the queue); None if it did not."""
        endpoint = self.dealer_endpoints.get(id(socket))
        why = self.refused_dealers.refused_for(endpoint) if endpoint is not None else None
        if why == REFUSED_KEY:
            return f"{endpoint:.80} refused this node's key (not in its authorized_keys)"
        if why == REFUSED_FULL:
            return f"{endpoint:.80} refused this node's connection (it holds its connections_max connections)"
        return None

    def frame_unsent(self, message: Message, why: str) -> None:
        """Hook: a frame to another node (a DEALER's) was dropped at send, ``why``; nothing of it left
        this node. A driver answers at once whoever waits for that frame's answer (a forwarded
        request: ``CoreNode``); an answer it queues (``reply``) leaves in the same ``flush``."""

    def sends_dropped_by(self) -> dict[str, int]:
        """``status``'s outgoing frames not sent, by reason (their sum is its ``sends_dropped``): those zmq
        dropped (``zmq``: the receiver's queue full, a socket error; ``refused_connection``: toward a node that
        refused this node's connection, for its key or its connections_max, until it is let in) and
        those refused for ``core_queue_bytes_max`` (``core_queues``' ``refused`` per core, summed). A
        frame is counted once: a refused one never reaches zmq."""
        return {
            "zmq": self.sends_dropped - self.sends_dropped_refused,
            "refused_connection": self.sends_dropped_refused,
            "core_queue_bytes_max": sum(self.peer_queues.refused.values()),
        }

    def _dropped(self, kind: str, why: str, refused: bool = False) -> None:
        """Count a dropped outgoing frame (``refused``: toward a node that refused this node's
        connection); a warning at most a line a second (``warnings``)."""
        self.sends_dropped += 1
        if refused:
            self.sends_dropped_refused += 1
        self.warnings.log(
            "outgoing frame dropped",
            logging.WARNING,
            "dropped an outgoing frame (%s: %s; %d so far): peers re-send, a replicant resynchronises after a "
            "dropped push",
            kind,
            why,
            self.sends_dropped,
        )

    def flush_durable(self) -> None:
        """``flush`` now if the turn wrote something that must be durable (appended entries, a vote):
        what waits on that fsync (an acknowledgement, the sequencer's own count) need not wait for
        the rest of the turn. A turn that wrote nothing, or only an apply, commits at its end."""
        if self._in_transaction and self._durable:
            self.flush()

    def _commit(self) -> None:
        """COMMIT the open transaction (an fsync if durable), counted in status and in the metrics."""
        began_s = time.monotonic()
        durable, self._durable = self._durable, False
        self.store.commit(durable)
        self._in_transaction = False
        self.commits += 1
        self.durable_commits += durable
        if self.metrics is not None:
            seconds = time.monotonic() - began_s
            self.metrics.committed(seconds, self.transactions - self._transactions_at_commit, durable)
            self._transactions_at_commit = self.transactions

    def flush(self) -> None:
        """Commit the open transaction (one fsync), then send everything queued behind it."""
        if self._in_transaction:
            self._commit()
            self.after_commit()
            if self._in_transaction:
                self._commit()
        self.before_send()
        outbox, self._outbox = self._outbox, []
        for socket, envelope, message in outbox:
            self._send_queued(socket, envelope, message)
        if self._outbox:
            # Answers ``frame_unsent`` queued for frames just dropped: now, not a turn later. They go
            # to clients (the ROUTER), whose drops call no hook, so one more round empties the outbox.
            outbox, self._outbox = self._outbox, []
            for socket, envelope, message in outbox:
                self._send_queued(socket, envelope, message)
        if self.metrics is not None:
            self.refresh_metrics()


@dataclass(slots=True)
class WaitingChanges:
    """A held ``changes`` request: answered once a shard passes ``applied`` or at ``deadline_ms``;
    ``positions``: where its last page ended (a held page has no record), where the next one starts."""

    envelope: list[bytes]
    message: Message
    serving: Callable[[str], Any]
    table_batch: TableBatch
    applied: dict[str, TxKey]
    deadline_ms: int
    positions: list[messages.ChangesPosition]
    shards: frozenset[str]  # the node's shards when the last page was built


class StoreFeedReader:
    """``rlog.changes.FeedReader`` over the node's store (read in the turn's transaction)."""

    def __init__(self, store: Store, table_batch: TableBatch) -> None:
        self.store = store
        self._table_batch = table_batch
        self._positions = store.shards()

    def catalog(self) -> dict[str, TableSchema]:
        return self.store.catalog()

    def shard_names(self) -> list[str]:
        return list(self._positions)

    def applied(self, shard: str) -> TxKey | None:
        position = self._positions.get(shard)
        return position.applied if position is not None else None

    def trimmed(self, shard: str) -> TxKey:
        return self.store.trimmed(shard)[0]

    def entries_after(self, shard: str, after: TxKey, limit: int, up_to: TxKey) -> list[Entry]:
        return self.store.entries_after(shard, after, limit, up_to)

    def key_column_at(self, shard: str, table: str, tx_key: TxKey) -> str | None:
        return self.store.key_column_at(shard, table, tx_key)

    def table_batch(self, table: TableSchema, after: Any, rows_max: int, bytes_max: int) -> dict[str, Any]:
        # Not ``rows_total``: a bootstrap's first batch counts the table (up to 500,001 rows, tens of
        # ms in the loop) for its progress; a page must cost its rows only, and the feed has no use for it.
        return self._table_batch(self.store, table, after, rows_max, bytes_max, rows_total=False)
