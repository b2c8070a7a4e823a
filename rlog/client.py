"""The Python client: talks to any mnesite node over zmq (DEALER to the node's ROUTER).

    from mnesite.rlog.client import Client

    with Client("tcp://127.0.0.1:7400") as client:
        client.create_table("users", key="id", columns=[("id", "INTEGER"), ("name", "TEXT")])
        tx_key = client.put("users", {"id": 1, "name": "ada"})
        client.get("users", 1)                       # {'id': 1, 'name': 'ada'}
        with client.transaction() as tx:             # all or nothing
            tx.require("users", 1, equals={"id": 1, "name": "ada"})
            tx.put("users", {"id": 1, "name": "ada lovelace"})
            tx.delete("users", 2)
        for row in client.scan("users"):
            ...

Every request carries a fresh request id. A request that gets no answer within
``timeout_ms`` is re-sent with the *same* id up to ``retries`` times (the node applies a
write only once per id, while the sequencer's rlog holds the id's entry: not after retention
trimmed it, nor on a sequencer whose log a snapshot install emptied). A write that still has
no definite answer raises ``OutcomeUnknown``: it may or may not have happened;
``error.request_id`` is the id to send it again with (``transact(..., request_id=...)``), which
answers with its tx key if it did happen and applies it otherwise (a re-send that gets no definite
answer is ``OutcomeUnknown`` again: the earlier attempt may have happened). A read or a write that
was surely not applied raises ``Unavailable``.

Read-your-writes across clients: pass the tx key a write returned as ``after_tx_key=`` to ``get``
or ``scan`` (or the writer's ``last_tx_keys``, its last key per shard); the node answers once it has
applied that key (each key in its own shard). A client object is not thread-safe;
use one per thread.

A cluster with ``[security]`` needs ``key=`` (the caller's ``NAME.key_secret`` file, made by
``mnesite keys generate``) and ``server_key=`` (the cluster's public ``.key`` file): the client then
speaks CurveZMQ. A node that refuses the key, or a client without keys talking to a secure node (or
the reverse), fails the handshake; the client sees that at once and raises ``Unauthenticated``
instead of waiting for an answer that cannot come. A role that may not send a request gets
``Forbidden``.
"""

from __future__ import annotations

import ipaddress
import os
import socket as socket_module
import threading
import time
from collections.abc import Iterator, Mapping, Sequence, Set
from typing import Any, NoReturn

import msgspec
import zmq
from mnesite.rlog import admin_answers, messages
from mnesite.rlog.changes import COPY_STALL_PAGES_MAX, copy_stalled, copy_start, position_to_wire
from mnesite.rlog.config import DEFAULT_LISTEN
from mnesite.rlog.disk import ERROR_DISK_FULL
from mnesite.rlog.errors import REFUSED_FULL, REFUSED_KEY
from mnesite.rlog.messages import Answer, Message, MessageError, NonNegative, answer_as, body_error, typed_body
from mnesite.rlog.roles import WRITE_KINDS
from mnesite.rlog.security import (
    FOLLOW_LINKS_CLIENT,
    HANDSHAKE_FAILURES,
    REFUSED_STATUS,
    KeyPair,
    SecurityError,
    configure_client,
    load_key,
)
from mnesite.rlog.status import RecoveryAnswer
from mnesite.rlog.types import WAIT_MS_MAX, TxKey, new_request_id
from zmq.utils.monitor import recv_monitor_message

SCAN_PAGE_ROWS = 1000
# How long a following changefeed asks the node to hold a page while there is no change (long poll).
CHANGES_WAIT_MS = 1000
# How long one page of a query may take to arrive: above a node's default query_ms_max (10 s).
QUERY_TIMEOUT_MS = 30_000
# Answers that mean "not now": retried with the same request id, which keeps writes idempotent.
RETRIABLE_CODES = frozenset({"no_sequencer", "outcome_unknown", "busy", "not_applied"})
# The node is shutting down and did nothing with the request (a write it may have logged is answered
# ``outcome_unknown`` instead): asked again at once at the next endpoint, never at that node again in
# this call (it is closing its socket); with no endpoint left, the call ends with this code.
STOPPING_CODE = "stopping"
# A read refused by a node that cannot serve its shard yet (a replicant bootstrapping, a core installing
# a snapshot), maybe for minutes: asked again at once at the next endpoint, which may serve it; the call
# ends with this code once every endpoint said so (or could not be reached).
NOT_READY_CODE = "not_ready"
# The shards whose last write a client keeps for read-your-writes (the wire's bound on ``min_keys``).
MIN_KEYS_MAX = 1000
# A key a read must see: one tx key for every shard the read reads, or one per shard ({shard: key}).
AfterKey = TxKey | tuple[int, int] | Mapping[str, TxKey | tuple[int, int]] | None
# Answers a node gives before it looks at the request (its backlog or outstanding requests are full,
# its disk is full, a reload revoked the caller's key or role, it is catching up and does not know the
# table or cannot serve the shard yet, a forced start left it out of the shard): they say nothing of an
# earlier attempt of the same write, which the sequencer (of the forced generation too) may have
# committed, so after one that may have been applied they end in ``OutcomeUnknown``.
REFUSED_UNREAD_CODES = frozenset({ERROR_DISK_FULL, "overloaded", "forbidden", NOT_READY_CODE, "excluded"})
# Requests about the node they reach, not the cluster: never moved to another endpoint, whose answer
# would be taken for this node's. They act on it (stop, force_start, backup) or read its file
# (backup_read); they ask for its own
# state (its journal age, read to decide a force start; its status); they hash its own data (range
# requests: the compare job asks each replica, and another node's answer would compare it with
# itself); a query's pages (the cursor lives on the node that answered the first one, QueryResult).
# The rest may move: any node's answer is right (reads, members and rlog entries name or hold the
# shard's one log, changes pages resume from positions any node serves).
NODE_KINDS = frozenset(
    {
        "stop",
        "force_start",
        "backup",
        "backup_read",
        "journal",
        "status",
        "range_digest",
        "key_boundaries",
        "row_digests",
        "query_page",
        "query_close",
    }
)
# A read that must see a key (``after_tx_key``, read-your-writes) asks the node to wait for it less than
# an attempt's timeout, by a tenth of it and at most this: a replicant holds the read that long, then
# answers ``timeout`` naming the key, and that answer must come while the client still listens, not
# after it gave the attempt up as silent (it then said "did not answer", after every retry).
READ_WAIT_MARGIN_MS_MAX = 500
# Requests that change the cluster's state through the log, each applied at most once per request id:
# the writes, and a membership change (a members entry). After silence they may have happened: the
# call ends in ``OutcomeUnknown`` and never moves to another endpoint.
CHANGING_KINDS = WRITE_KINDS | {"membership_change"}
RETRY_BACKOFF_S_MIN = 0.02
# Small enough that a client notices a new sequencer within 0.1 s of its election.
RETRY_BACKOFF_S_MAX = 0.1


class MnesiteError(Exception):
    """Base of every error the client raises; ``code`` is the node's error code."""

    code = "error"
    # Why the node refused this client's connection at its handshake, if it did: ``REFUSED_KEY`` (its
    # key is not in the node's authorized_keys) or ``REFUSED_FULL`` (the node holds connections_max).
    refused: str | None = None

    def __init__(self, message: str, code: str | None = None, detail: Any = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.detail = detail


class Unavailable(MnesiteError):
    code = "unavailable"
    # True when the call ended in silence after its request left: a request that is not applied at most
    # once per id (``force_start``) may then have happened, and must not be sent again blindly.
    sent = False


class OutcomeUnknown(Unavailable):
    """A write got no definite answer in time: it may or may not have happened.

    Send it again with ``request_id`` to learn its outcome (applied at most once).
    """

    code = "outcome_unknown"

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message, "outcome_unknown")
        self.request_id = request_id

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (an error a worker process raises reaches its parent so) with the arguments this
        # ``__init__`` takes: the exception's args hold the message alone.
        return (type(self), (str(self), self.request_id), self.__dict__)


class GuardFailed(MnesiteError):
    code = "guard_failed"


class UnknownTable(MnesiteError):
    code = "unknown_table"


class Unauthenticated(MnesiteError):
    """The node refused this client's key, or the client and the node disagree on CurveZMQ."""

    code = "unauthenticated"


class Forbidden(MnesiteError):
    """The node knows this client's key, but its roles may not send the request."""

    code = "forbidden"


class RemoteError(MnesiteError):
    """Any other error answered by the node."""


class InvalidRequest(RemoteError):
    """Refused before sending, as a node would refuse it: it breaks its kind's schema (``rlog.messages``)
    or exceeds ``frame_bytes_max``."""

    code = "bad_request"


_ERRORS = {"guard_failed": GuardFailed, "unknown_table": UnknownTable, "forbidden": Forbidden}
_HANDSHAKE_EVENTS = 0
for _event in HANDSHAKE_FAILURES:
    _HANDSHAKE_EVENTS |= _event
# A connection attempt that failed (refused, or closed) before any connection completed.
_CONNECT_FAILED_EVENTS = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
UNREACHABLE_HINT = "is the node running? check --node"
ENDPOINTS_MAX = 64  # endpoints one client fails over between


# The answers the client reads fields of, as it reads them (``messages.Answer``: unknown fields allowed).
# An answer that does not fit is ``bad_answer`` (a node of another protocol, a bug, not a mnesite node),
# never a KeyError or TypeError out of the client; the rows themselves are checked by ``_rows``.
class _WrittenAnswer(Answer, frozen=True, kw_only=True):
    tx_key: TxKey
    shard: str | None = None


class _CountAnswer(Answer, frozen=True, kw_only=True):
    rows: NonNegative


class _TableAnswer(Answer, frozen=True, kw_only=True):
    table: str
    shard: str
    key: str
    columns: list[tuple[str, str]]


class _QueryPageAnswer(Answer, frozen=True, kw_only=True):
    rows: list[Any]
    cursor: str | None = None


class _QueryAnswer(_QueryPageAnswer, frozen=True, kw_only=True):
    columns: list[str]
    positions: dict[str, TxKey] = {}


# A changefeed page's records as the feed reads them (``ChangeFeed.__iter__``, ``copy_start``); the caller
# gets each record as it came, every other field unchecked (rows are the caller's to read).
class _ChangeRecord(Answer, frozen=True, kw_only=True, tag_field="kind", tag="change"):
    shard: str
    tx_key: TxKey


class _SnapshotBeginRecord(Answer, frozen=True, kw_only=True, tag_field="kind", tag="snapshot_begin"):
    shard: str
    tx_key: TxKey
    tables: list[str]


class _SnapshotRecord(Answer, frozen=True, kw_only=True, tag_field="kind", tag="snapshot"):
    shard: str
    tx_key: TxKey | None = None  # a copied row has none; an entry healing the copy has its own


class _SnapshotEndRecord(Answer, frozen=True, kw_only=True, tag_field="kind", tag="snapshot_end"):
    shard: str
    tx_key: TxKey


class _ChangesAnswer(Answer, frozen=True, kw_only=True):
    records: list[_ChangeRecord | _SnapshotBeginRecord | _SnapshotRecord | _SnapshotEndRecord]
    positions: list[Any]  # checked by the very schema the node checks them with when they come back
    applied: dict[str, TxKey]


def bad_answer(kind: str, what: str) -> MnesiteError:
    return MnesiteError(f"malformed {kind} answer: {what}", "bad_answer")


def checked(kind: str, result: Any, answer_type: Any) -> Any:
    """``result`` as ``answer_type``; ``bad_answer`` if it does not fit."""
    try:
        return msgspec.convert(result, answer_type)
    except (msgspec.ValidationError, RecursionError) as error:
        # where it does not fit, as a refused request is told (the field path, never the value)
        where = body_error(kind, error) if isinstance(error, msgspec.ValidationError) else f"{kind}: nested too deep"
        raise bad_answer(kind, f"not a {getattr(answer_type, '__name__', answer_type)!s} ({where})") from None


def _rows(kind: str, rows: list[Any], row_type: type) -> None:
    """Every row of an answer is a ``row_type`` (a dict for get and scan, a list for a query's page)."""
    for row in rows:
        if not isinstance(row, row_type):
            raise bad_answer(kind, f"a row is a {type(row).__name__}, not a {row_type.__name__}")


class _NotSent(Exception):
    """The request never left this client: no connection to the node completed (``IMMEDIATE``
    sockets queue nothing before that), so it is known not to have happened anywhere."""

    hint = UNREACHABLE_HINT


class _Full(_NotSent):
    """The node refused the connection at its handshake: it holds ``[limits] connections_max``."""

    hint = "retry later, close idle clients, or raise [limits] connections_max on that node"


def _check_setting(name: str, value: Any, low: int) -> None:
    """Refuse a timeout or a count a call cannot use, before anything is sent: a timeout of 0 said "no
    connection completed in time; is the node running?" of a node that was up, and a text one raised
    TypeError from inside the call."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise MnesiteError(f"{name} must be an integer of at least {low}, got {value!r}", "bad_request")


def read_wait_ms(timeout_ms: int) -> int:
    """How long a node may hold a read for its keys within an attempt of ``timeout_ms``: the attempt less
    a margin, so that the node's ``timeout`` answer arrives before the client gives up on the call (a
    wait longer than ``WAIT_MS_MAX`` would be refused by the node: it is cut to that)."""
    return max(0, min(timeout_ms - min(READ_WAIT_MARGIN_MS_MAX, timeout_ms // 10), WAIT_MS_MAX))


def default_endpoint() -> str:
    return os.environ.get("MNESITE_NODE") or DEFAULT_LISTEN


def default_index_name(table: str, columns: Sequence[str]) -> str:
    """``TABLE_COLUMN_..._idx``, cut to the 63 characters a name may have."""
    return "_".join((table, *columns))[:59] + "_idx"


def parse_endpoints(endpoints: str | Sequence[str] | None) -> list[str]:
    """``tcp://a:1,tcp://b:2`` or a list of such strings as a list of endpoints, in order, without repeats."""
    if endpoints is None:
        endpoints = default_endpoint()
    if isinstance(endpoints, str):
        endpoints = [endpoints]
    parsed: list[str] = []
    for item in endpoints:
        for endpoint in item.split(","):
            endpoint = endpoint.strip()
            if endpoint and endpoint not in parsed:
                parsed.append(endpoint)
    if not parsed:
        raise MnesiteError("no endpoint given", "bad_request")
    if len(parsed) > ENDPOINTS_MAX:
        raise MnesiteError(f"at most {ENDPOINTS_MAX} endpoints, got {len(parsed)}", "bad_request")
    return parsed


class Client:
    """A connection to one mnesite node (or several, with failover); see the module docstring.

    Use it as a context manager, or call ``close``. Not thread-safe: one per thread."""

    def __init__(
        self,
        endpoint: str | Sequence[str] | None = None,
        timeout_ms: int = 5000,
        retries: int = 2,
        key: str | os.PathLike[str] | KeyPair | None = None,
        server_key: str | os.PathLike[str] | bytes | None = None,
        frame_bytes_max: int = messages.FRAME_BYTES_MAX_DEFAULT,
        follow_key_links: bool = False,
    ) -> None:
        """``key``: the caller's secret key file (or a loaded ``KeyPair``); ``server_key``: the
        cluster's public key file (or the raw 32-byte key), which others must not be able to write
        (it says which server to trust). Give both, or neither (no CurveZMQ). ``follow_key_links``:
        key files that are symbolic links (a Kubernetes secret volume) are followed, every link and
        directory on the way checked; off, they are refused.
        ``frame_bytes_max``: requests above it are refused before sending; an answer above it raises
        ``RemoteError`` ``too_large`` (``scan`` then asks for smaller pages).

        ``endpoint``: one endpoint, several separated by commas, or a list. The client talks to one
        at a time and moves to the next (failover) only when the outcome of the request is known:
        a request that never left (no connection completed), any read, or a write the node answered
        with "not now" before the client lost track of it. A write sent and not answered stays with
        its node and ends in ``OutcomeUnknown``: it is never sent silently to another node."""
        _check_setting("timeout_ms", timeout_ms, 1)
        _check_setting("retries", retries, 0)
        _check_setting("frame_bytes_max", frame_bytes_max, 1)
        self.endpoints = parse_endpoints(endpoint)
        self.endpoint = self.endpoints[0]
        self.timeout_ms = timeout_ms
        self.retries = retries
        self.frame_bytes_max = frame_bytes_max
        self.last_tx_key: TxKey | None = None
        # The shard of the last acknowledged write, when its answer named one (``mnesite put --json``).
        self.last_shard: str | None = None
        # Per shard, this client's last write there: what its read-your-writes reads wait for (a tx key
        # orders one shard's log only). Pass it as another client's ``after_tx_key`` to read these writes.
        self.last_tx_keys: dict[str, TxKey] = {}
        # The last write a node of an earlier release acknowledged (its answer names no shard): waited
        # for in every shard a read reads, as before.
        self._unsharded_key: TxKey | None = None
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._curve: tuple[KeyPair, bytes] | None = None
        if (key is None) != (server_key is None):
            raise MnesiteError("give both key= and server_key=, or neither", "bad_request")
        if key is not None and server_key is not None:
            try:
                follow = (follow_key_links, FOLLOW_LINKS_CLIENT)
                own = key if isinstance(key, KeyPair) else load_key(os.fspath(key), "key", True, *follow)
                server = (
                    server_key
                    if isinstance(server_key, bytes)
                    else load_key(os.fspath(server_key), "server_key", False, *follow).public
                )
            except SecurityError as error:
                raise MnesiteError(str(error), "bad_request") from None
            self._curve = (own, server)

    def __enter__(self) -> Client:
        return self

    def pinned(self) -> Client:
        """A client of this client's current endpoint alone, with its keys and limits: for requests
        that must reach that node and no other (``NODE_KINDS``). Close it after use."""
        key, server_key = self._curve if self._curve is not None else (None, None)
        return Client(
            self.endpoint,
            timeout_ms=self.timeout_ms,
            retries=self.retries,
            key=key,
            server_key=server_key,
            frame_bytes_max=self.frame_bytes_max,
        )

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.disable_monitor()
            self._socket.close(0)
            self._socket = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            # Queue nothing before a connection completes: a frame that could not be sent is then
            # known never to have reached the node, which is what makes failover safe for writes.
            socket.setsockopt(zmq.IMMEDIATE, 1)
            if self._curve is not None:
                configure_client(socket, *self._curve)
            # Handshake failures are how a refused key shows, a failed connect how a stopped node
            # shows; watch for them rather than time out.
            self._monitor = socket.get_monitor_socket(_HANDSHAKE_EVENTS | _CONNECT_FAILED_EVENTS)
            try:
                socket.connect(self.endpoint)
            except zmq.ZMQError as error:
                socket.disable_monitor()
                socket.close(0)
                self._monitor.close(0)
                self._monitor = None
                raise MnesiteError(f"invalid endpoint {self.endpoint!r}: {error}", "bad_request") from None
            self._socket = socket
        return self._socket

    def _send(self, frame: bytes, deadline: float) -> zmq.Socket:
        """Send ``frame`` once a connection is ready; raise ``_NotSent`` if none completes in time."""
        socket = self._connect()
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                self.close()
                raise _NotSent(f"no connection to {self.endpoint} completed in time")
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLOUT)
            if self._monitor is not None:
                poller.register(self._monitor, zmq.POLLIN)
            ready = dict(poller.poll(remaining_ms))
            if self._monitor is not None and self._monitor in ready:
                event = recv_monitor_message(self._monitor)
                self._handshake_failed(event)
                if event["event"] & _CONNECT_FAILED_EVENTS and socket not in ready:
                    self.close()
                    raise _NotSent(f"node {self.endpoint} is unreachable: nothing accepts connections there")
            if socket in ready:
                try:
                    socket.send(frame, zmq.NOBLOCK)
                    return socket
                except zmq.Again:
                    continue  # the connection went away between the poll and the send

    def call(
        self,
        kind: str,
        body: dict[str, Any] | None = None,
        request_id: str | None = None,
        *,
        timeout_ms: int | None = None,
        retries: int | None = None,
    ) -> Any:
        """Send one request and return the reply's result; raise ``MnesiteError`` on an error reply.

        No answer within ``timeout_ms``, or an answer that says "try again" (no sequencer during an
        election, outcome unknown after a failover), re-sends the same request id, up to ``retries``
        more times for silence and until ``timeout_ms * (retries + 1)`` in all. ``timeout_ms`` and
        ``retries`` default to the client's.

        ``request_id``: a write's given id is taken for an earlier attempt's (``OutcomeUnknown.request_id``),
        which may have been applied: a call that gets no definite answer then ends in ``OutcomeUnknown``,
        never in an error that says nothing was written (unreachable, refused unread, ``stopping``).
        """
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        retries = self.retries if retries is None else retries
        _check_setting("timeout_ms", timeout_ms, 1)
        _check_setting("retries", retries, 0)
        if kind in NODE_KINDS and len(self.endpoints) > 1:
            # Failover would carry it to another node than the one meant (as the CLI's one --node).
            raise InvalidRequest(
                f"not sent: {kind} is about the node it reaches; use a Client of exactly one endpoint", "bad_request"
            )
        message = Message(kind, request_id or new_request_id(), body or {})
        try:
            frame = messages.encode(message, check=True)
        except MessageError as error:
            # The same schema a node checks: refuse here, before anything is sent.
            raise InvalidRequest(f"not sent: {error}", "bad_request") from None
        if len(frame) > self.frame_bytes_max:
            raise InvalidRequest(
                f"not sent: the {kind} request is {len(frame)} bytes, above frame_bytes_max {self.frame_bytes_max}",
                "too_large",
            )
        deadline = time.monotonic() + timeout_ms * (retries + 1) / 1000
        silent_attempts = 0
        backoff_s = RETRY_BACKOFF_S_MIN
        last_reason = f"did not answer {kind} within {timeout_ms} ms"
        # A write whose request went unanswered, or was answered "outcome unknown", may have been
        # applied: from then on, giving up means telling the caller so, and it never moves to
        # another endpoint.
        maybe_applied = False
        # The first answer that said so (``outcome_unknown``: the node's reason, such as its shutdown):
        # whatever ends the call later (the node gone, silent, stopping), the caller hears it first.
        unknown_answer: str | None = None
        is_write = kind in CHANGING_KINDS
        # A write sent again with an earlier attempt's id: that attempt may have been applied whatever
        # becomes of this call's own attempts (which alone decide whether it may move to another endpoint:
        # the sequencer applies an id at most once, whichever node it came through).
        sent_before = is_write and request_id is not None
        # Endpoints that refused a connection in this call, or answered that they are stopping: once
        # all did, the caller is told at once.
        unreachable: list[str] = []
        # Of those, the ones that refused it for their connections_max (``_Full``).
        full: set[str] = set()
        # Endpoints that answered this read ``not_ready`` in this call.
        not_ready: set[str] = set()
        while True:
            try:
                socket = self._send(frame, min(deadline, time.monotonic() + timeout_ms / 1000))
            except _NotSent as error:
                unreachable.append(self.endpoint)
                if isinstance(error, _Full):
                    full.add(self.endpoint)
                # A write that may already have happened at this node is never sent to another one.
                tried_all = len(set(unreachable)) >= len(self.endpoints)
                if tried_all or maybe_applied or time.monotonic() >= deadline:
                    reason = self._unreachable(error, tried_all, full)
                    unknown = maybe_applied or sent_before
                    # Every endpoint tried refused it for its connections_max: the caller may say so.
                    refused = REFUSED_FULL if tried_all and full >= set(self.endpoints) else None
                    self._give_up(
                        kind, message.request_id, unknown, reason, "unavailable", unknown_answer, refused=refused
                    )
                self._next_endpoint()
                continue
            except Unauthenticated as error:
                # The reconnection for a re-send failed its handshake (a key revoked meanwhile): that
                # says nothing of an earlier attempt, which may have been applied.
                if maybe_applied or sent_before:
                    self._give_up(kind, message.request_id, True, str(error), error.code, unknown_answer)
                raise
            try:
                answer = self._await(socket, message.request_id, deadline, timeout_ms)
            except Unauthenticated as error:
                # This attempt left over an authenticated connection before a reconnection failed.
                if is_write:
                    self._give_up(kind, message.request_id, True, str(error), error.code, unknown_answer)
                raise
            if answer is None:
                # Drop the socket: whatever it still queues must not reach the node later.
                self.close()
                silent_attempts += 1
                maybe_applied = maybe_applied or is_write
                if silent_attempts > retries or time.monotonic() >= deadline:
                    reason = (
                        f"node {self.endpoint} did not answer {kind} within {timeout_ms} ms "
                        f"({silent_attempts} attempts{_why_silent(self.endpoint, deadline)})"
                    )
                    self._give_up(kind, message.request_id, maybe_applied, reason, "unavailable", unknown_answer, True)
                if not maybe_applied:
                    self._next_endpoint()  # a read: any other node may answer it
                continue
            if answer.kind == "error" and answer.body.code == STOPPING_CODE:
                # Moved on at once, on a fresh socket: the stopping node reads nothing more.
                unreachable.append(self.endpoint)
                self.close()
                exhausted = len(set(unreachable)) >= len(self.endpoints) or time.monotonic() >= deadline
                if exhausted or maybe_applied:
                    # An earlier attempt of a write may have happened there: that stays its outcome.
                    reason = f"node {self.endpoint}: {answer.body.message}"
                    unknown = maybe_applied or sent_before
                    self._give_up(kind, message.request_id, unknown, reason, STOPPING_CODE, unknown_answer)
                self._next_endpoint()
                continue
            if answer.kind == "error" and answer.body.code == NOT_READY_CODE and not maybe_applied:
                # A read, or a write refused before anything was logged (a core catching up that does
                # not know its table yet): another node may serve it now.
                not_ready.add(self.endpoint)
                if len(not_ready | set(unreachable)) < len(self.endpoints) and time.monotonic() < deadline:
                    self._next_endpoint()
                    continue
            if answer.kind == "error" and (answer.body.code in RETRIABLE_CODES or _recovering(answer)):
                last_reason = answer.body.message
                if answer.body.code == "outcome_unknown" and is_write:
                    # A read told so (its node's turn failed, or a stop cut it short) changed nothing:
                    # "not now", and any node may answer it.
                    maybe_applied = True
                    unknown_answer = unknown_answer or f"node {self.endpoint}: {last_reason}"
                if time.monotonic() + backoff_s < deadline:
                    time.sleep(backoff_s)  # an election or failover is under way: give it time
                    backoff_s = min(backoff_s * 2, RETRY_BACKOFF_S_MAX)
                    if not maybe_applied:
                        self._next_endpoint()  # nothing happened there: another node may do better
                    continue
                reason = f"node {self.endpoint}: {last_reason}"
                unknown = maybe_applied or sent_before
                self._give_up(kind, message.request_id, unknown, reason, answer.body.code, unknown_answer)
            break
        if answer.kind == "error":
            code = answer.body.code
            if code in REFUSED_UNREAD_CODES and (maybe_applied or sent_before):
                # This attempt was refused unread, but an earlier one may have happened: the caller
                # must not take the refusal for "nothing was written".
                reason = f"node {self.endpoint}: {answer.body.message}"
                self._give_up(kind, message.request_id, True, reason, code, unknown_answer)
            raise _ERRORS.get(code, RemoteError)(answer.body.message, code, answer.body.detail)
        return answer.body.result

    def _next_endpoint(self) -> None:
        """Fail over: the next endpoint in the list, on a fresh socket."""
        if len(self.endpoints) > 1:
            self.close()
            self.endpoint = self.endpoints[(self.endpoints.index(self.endpoint) + 1) % len(self.endpoints)]

    def _unreachable(self, error: _NotSent, tried_all: bool, full: set[str]) -> str:
        """Why the call ends at an endpoint no connection reached: that node, or every endpoint
        when all were tried (a write that may have happened is never tried elsewhere); ``full``: those
        that refused the connection for their ``connections_max``."""
        if len(self.endpoints) == 1 or not tried_all:
            return f"{error}; {error.hint}"
        if full >= set(self.endpoints):
            return (
                f"every node of {', '.join(self.endpoints)} refused the connection: each holds its "
                "connections_max connections; retry later, close idle clients, or raise [limits] "
                "connections_max on those nodes"
            )
        if full:
            return (
                f"none of {', '.join(self.endpoints)} accepts connections: "
                f"{', '.join(e for e in self.endpoints if e in full)} refused it (it holds its connections_max "
                "connections); are the others running? check --node"
            )
        return f"none of {', '.join(self.endpoints)} accepts connections; are the nodes running? check --node"

    def _give_up(
        self,
        kind: str,
        request_id: str,
        maybe_applied: bool,
        reason: str,
        code: str,
        unknown_answer: str | None = None,
        sent: bool = False,
        refused: str | None = None,
    ) -> NoReturn:
        """End the call. ``unknown_answer``: a node's earlier ``outcome_unknown`` answer, named before
        ``reason`` (what ended the call): why the write may have happened is what the caller needs.
        ``sent``: the last attempt left and was not answered (``Unavailable.sent``); ``refused``: why
        every endpoint refused the connection (``MnesiteError.refused``)."""
        if kind in CHANGING_KINDS and maybe_applied:
            if unknown_answer is not None and unknown_answer != reason:
                reason = f"{unknown_answer}; then {reason}"
            raise OutcomeUnknown(
                f"outcome unknown: the {kind} may or may not have happened ({reason}); "
                f"send it again with request id {request_id} to learn its outcome",
                request_id,
            )
        error = Unavailable(reason, code)
        error.sent, error.refused = sent, refused
        raise error

    def _await(self, socket: zmq.Socket, request_id: str, overall_deadline: float, timeout_ms: int) -> Message | None:
        deadline = min(time.monotonic() + timeout_ms / 1000, overall_deadline)
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            if self._monitor is not None:
                poller.register(self._monitor, zmq.POLLIN)
            ready = dict(poller.poll(remaining_ms))
            if not ready:
                return None
            if self._monitor is not None and self._monitor in ready:
                # A dropped connection is not an answer: zmq reconnects, and silence decides; a
                # reconnection refused for connections_max will bring no answer (the socket is closed).
                try:
                    self._handshake_failed(recv_monitor_message(self._monitor))
                except _Full:
                    return None
            if socket not in ready:
                continue
            frame = socket.recv()
            try:
                answer = messages.decode(frame, self.frame_bytes_max)
            except MessageError as error:
                # The node's header-only reader (imported here: the client needs the node loop only then).
                from mnesite.rlog.server import request_id_of

                if error.code == "frame_too_large" and request_id_of(frame) == request_id:
                    # Our answer, above our own bound (the node caps it at its own): say so, never
                    # "did not answer" after every retry; scan() then asks for smaller pages.
                    return messages.error(
                        request_id,
                        "too_large",
                        f"the answer is {len(frame)} bytes, above this client's frame_bytes_max "
                        f"{self.frame_bytes_max}; ask for fewer rows or raise frame_bytes_max",
                    )
                continue  # not ours to understand; keep waiting for our answer
            if answer.request_id in (request_id, "?") and answer.kind in ("reply", "error"):
                return answer

    def _handshake_failed(self, event: dict[str, Any]) -> None:
        reason = HANDSHAKE_FAILURES.get(event["event"])
        if reason is None:
            return
        self.close()
        if reason == "auth" and event["value"] == REFUSED_STATUS:
            # Nothing was sent over it (IMMEDIATE), and another node may take the request.
            raise _Full(f"node {self.endpoint} refused the connection: it holds its connections_max connections")
        if reason == "auth":
            error = Unauthenticated(f"node {self.endpoint} refused this client's key (it is not in authorized_keys)")
            error.refused = REFUSED_KEY
            raise error
        hint = (
            "the node may require CurveZMQ: give --key and --server-key (key= and server_key=)"
            if self._curve is None
            else "check --server-key (the cluster's public key) and whether the node uses [security]"
        )
        raise Unauthenticated(f"security handshake with {self.endpoint} failed ({reason}); {hint}")

    # -- writes ------------------------------------------------------------------------------

    def transact(
        self, ops: list[dict[str, Any]], guards: list[dict[str, Any]] | None = None, request_id: str | None = None
    ) -> TxKey:
        """Run one transaction: ``ops`` of ``{"op": "write", "table", "row"}`` / ``{"op": "delete", "table", "key"}``,
        ``guards`` of ``{"table", "key", "equals": row-or-None}``. Returns its tx key.

        ``request_id``: the id of an earlier attempt whose outcome was unknown (``OutcomeUnknown``);
        the node answers with that attempt's tx key if it was applied, and applies it otherwise."""
        body: dict[str, Any] = {"ops": ops}
        if guards:
            body["guards"] = guards
        result = self.call("transact", body, request_id)
        return self._wrote(result)

    def put(self, table: str, row: dict[str, Any]) -> TxKey:
        """Write a full row (insert or replace by its key); returns the write's tx key."""
        return self.transact([{"op": "write", "table": table, "row": row}])

    def delete(self, table: str, key: Any) -> TxKey:
        """Delete the row with this key (nothing to delete is not an error); returns the tx key."""
        return self.transact([{"op": "delete", "table": table, "key": key}])

    def transaction(self) -> Transaction:
        """A transaction built with ``require``, ``put`` and ``delete``, sent when its block ends cleanly."""
        return Transaction(self)

    def create_table(
        self, table: str, key: str, columns: list[tuple[str, str]] | None = None, shard: str | None = None
    ) -> TxKey:
        """Create a STRICT table with key column ``key`` and ``columns`` of (name, type) in ``shard``
        (default ``default``); types INTEGER, REAL, TEXT, BLOB, ANY. Returns the tx key."""
        body: dict[str, Any] = {"table": table, "key": key, "columns": [list(c) for c in columns or []]}
        if shard is not None:
            body["shard"] = shard
        result = self.call("create_table", body)
        return self._wrote(result)

    def drop_table(self, table: str) -> TxKey:
        """Drop ``table`` and its rows on every node (a replicated schema change; admin role)."""
        return self._schema_change("drop_table", {"table": table})

    def create_index(self, table: str, columns: Sequence[str], name: str | None = None) -> TxKey:
        """Create a secondary index of ``table`` over ``columns`` on every node (a replicated schema
        change; admin role). ``name``: default ``TABLE_COLUMN_..._idx``."""
        index = name or default_index_name(table, columns)
        return self._schema_change("create_index", {"index": index, "table": table, "columns": list(columns)})

    def drop_index(self, name: str) -> TxKey:
        """Drop the secondary index ``name`` on every node (a replicated schema change; admin role)."""
        return self._schema_change("drop_index", {"index": name})

    def add_column(self, table: str, column: str, column_type: str) -> TxKey:
        """Add a nullable column to ``table`` on every node; existing rows hold null (admin role)."""
        return self._schema_change("add_column", {"table": table, "column": column, "type": column_type})

    def _schema_change(self, kind: str, body: dict[str, Any]) -> TxKey:
        result = self.call(kind, body)
        return self._wrote(result)

    def _wrote(self, result: dict[str, Any]) -> TxKey:
        """Note an acknowledged write's tx key, in its shard when the answer names it."""
        answer = checked("write", result, _WrittenAnswer)
        key = TxKey(*answer.tx_key)
        self.last_tx_key = key
        shard = answer.shard
        self.last_shard = shard if isinstance(shard, str) else None
        if isinstance(shard, str):
            earlier = self.last_tx_keys.pop(shard, None)
            self.last_tx_keys[shard] = key if earlier is None else max(earlier, key)
            if len(self.last_tx_keys) > MIN_KEYS_MAX:  # the shard written longest ago goes (the wire's bound)
                del self.last_tx_keys[next(iter(self.last_tx_keys))]
        else:
            self._unsharded_key = key if self._unsharded_key is None else max(self._unsharded_key, key)
        return key

    # -- reads -------------------------------------------------------------------------------

    def get(
        self, table: str, key: Any, consistency: str = "local", after_tx_key: AfterKey = None
    ) -> dict[str, Any] | None:
        """``consistency``: ``local`` (what this node has applied), ``read-your-writes`` (this client's
        last write in the table's shard is applied first: ``last_tx_keys``), or ``linearizable``.
        ``after_tx_key``: answer only once the node has applied that tx key (a write of another client
        or process): a ``TxKey`` waited for in the shard read, or a dict ``{shard: key}`` (such as
        another client's ``last_tx_keys``), each key waited for in its own shard."""
        row = self.call("get", self._consistency({"table": table, "key": key}, consistency, after_tx_key))
        if row is not None:
            _rows("get", [row], dict)
        return row

    def _consistency(
        self,
        body: dict[str, Any],
        consistency: str,
        after_tx_key: AfterKey = None,
        timeout_ms: int | None = None,
        wait_ms: int | None = None,
    ) -> dict[str, Any]:
        """``timeout_ms``: the call's attempt timeout, when not the client's (a query's). ``wait_ms``: how
        long the node may hold the read for its keys (None: ``read_wait_ms`` of the attempt timeout).

        The keys a read must see go as ``min_keys`` (per shard: the node waits in each shard it reads
        for that shard's key only, ``rlog.types.read_targets``) and ``min_key`` (a key given for every
        shard read: ``after_tx_key`` as one key, or a write a node of an earlier release acknowledged
        without naming its shard)."""
        body["consistency"] = consistency
        min_key: TxKey | None = None
        min_keys: dict[str, TxKey] = {}
        if isinstance(after_tx_key, Mapping):
            min_keys = {str(shard): TxKey(*key) for shard, key in after_tx_key.items()}
        elif after_tx_key is not None:
            min_key = TxKey(*after_tx_key)
        if consistency == "read-your-writes":
            for shard, key in self.last_tx_keys.items():
                min_keys[shard] = max(key, min_keys.get(shard, key))
            if self._unsharded_key is not None:
                min_key = self._unsharded_key if min_key is None else max(min_key, self._unsharded_key)
        if len(min_keys) > MIN_KEYS_MAX:  # a node would refuse the frame: say why, unsent
            raise MnesiteError(f"a read may name the keys of at most {MIN_KEYS_MAX} shards", "bad_request")
        if min_keys:
            body["min_keys"] = {shard: list(key) for shard, key in min_keys.items()}
        if min_key is not None:
            body["min_key"] = list(min_key)
        if min_key is not None or min_keys:
            if wait_ms is None:
                wait_ms = read_wait_ms(self.timeout_ms if timeout_ms is None else timeout_ms)
            body["wait_ms"] = wait_ms
        return body

    def scan_page(
        self,
        table: str,
        after: Any = None,
        limit: int = SCAN_PAGE_ROWS,
        consistency: str = "local",
        after_tx_key: AfterKey = None,
    ) -> list[dict[str, Any]]:
        """Rows strictly after key ``after`` (None: from the start), in key order, at most ``limit``."""
        body: dict[str, Any] = {"table": table, "limit": limit}
        if after is not None:
            body["after"] = after
        page = self.call("scan", self._consistency(body, consistency, after_tx_key))
        if not isinstance(page, list):
            raise bad_answer("scan", f"a {type(page).__name__}, not a list of rows")
        _rows("scan", page, dict)
        return page

    def scan(
        self,
        table: str,
        after: Any = None,
        page_rows: int = SCAN_PAGE_ROWS,
        consistency: str = "local",
        after_tx_key: AfterKey = None,
    ) -> Iterator[dict[str, Any]]:
        """Every row after ``after`` in key order, fetched in pages of ``page_rows``."""
        key_column = None
        while True:
            try:
                page = self.scan_page(table, after, page_rows, consistency, after_tx_key)
            except RemoteError as error:
                if error.code != "too_large" or page_rows == 1:
                    raise
                page_rows = max(1, page_rows // 2)  # the page exceeds a frame: ask for fewer rows
                continue
            yield from page
            if len(page) < page_rows:
                return
            if key_column is None:
                key_column = self.table(table)["key"]
            if key_column not in page[-1]:
                raise bad_answer("scan", f"a row without its key column {key_column!r}")
            after = page[-1][key_column]

    def query(
        self,
        sql: str,
        params: Sequence[Any] = (),
        consistency: str = "local",
        after_tx_key: AfterKey = None,
        page_rows: int | None = None,
        timeout_ms: int = QUERY_TIMEOUT_MS,
        wait_ms: int | None = None,
    ) -> QueryResult:
        """Run one read-only SQL statement (``?`` parameters bound from ``params``, in order: a mapping or
        a set is refused unsent, ``InvalidRequest``) at the node.

        Returns a ``QueryResult``: ``columns``, and the rows as tuples when iterated, fetched from the
        node page by page (``page_rows`` each, at most the node's ``query_page_rows_max``). All pages
        come from one snapshot of the node. ``consistency`` and ``after_tx_key`` as for ``get``: the node
        waits until every shard the statement reads has reached the key, for up to ``wait_ms`` (None:
        ``timeout_ms`` less a margin), then answers ``timeout``. ``timeout_ms``: how long one page may
        take (the node stops a query at its ``query_ms_max`` of SQLite time). A ``wait_ms`` shorter than
        ``timeout_ms`` gives up soon on a key never reached while a long statement may still run.
        """
        _check_setting("timeout_ms", timeout_ms, 1)  # before the wait for a key is cut from it
        if wait_ms is not None:
            _check_setting("wait_ms", wait_ms, 0)
            if wait_ms > read_wait_ms(timeout_ms):
                # The page's call would give up before the node's timeout answer could come back.
                raise MnesiteError(
                    f"wait_ms {wait_ms} leaves no time for the answer within timeout_ms {timeout_ms}: "
                    f"give at most {read_wait_ms(timeout_ms)}, or a longer timeout_ms",
                    "bad_request",
                )
        body: dict[str, Any] = {"sql": sql, "params": query_params(params)}
        if page_rows is not None:
            body["page_rows"] = page_rows
        body = self._consistency(body, consistency, after_tx_key, timeout_ms, wait_ms)
        first = self.call("query", body, timeout_ms=timeout_ms)
        checked("query", first, _QueryAnswer)
        _rows("query", first["rows"], list)
        return QueryResult(self, first, page_rows, timeout_ms)

    def changes(
        self,
        tables: Sequence[str] | None = None,
        after_tx_key: Any = None,
        *,
        follow: bool = False,
        wait_ms: int = CHANGES_WAIT_MS,
        page_records: int | None = None,
    ) -> ChangeFeed:
        """The changefeed of ``tables`` (None: every table): an iterator of change records, in log order
        per shard (``rlog.changes`` says what each record holds).

        ``after_tx_key``: start strictly after this tx key: a ``TxKey`` (or ``(g, c)``) for every shard
        of the tables, a dict ``{shard: key}``, or a ``ChangeFeed.cursor`` saved from an earlier feed;
        None starts at the beginning of the log. A position the node's log no longer holds gets a copy
        of the tables first (``snapshot_begin``, ``snapshot`` rows, ``snapshot_end``). Without
        ``follow`` the iterator ends once it has every change the node has applied; with it, it waits
        for more (each page held up to ``wait_ms`` at the node). Pages move to the client's next
        endpoint when a node stops answering, from the last position received: no gap, no repeat; so
        does a feed not following that stalls inside a copy (``ChangeFeed``), until every endpoint did.
        """
        names = list(tables or ())
        return ChangeFeed(self, names, self._changes_positions(names, after_tx_key), follow, wait_ms, page_records)

    def _changes_positions(self, tables: list[str], after: Any) -> list[dict[str, Any]]:
        """The wire positions a changefeed starts from (see ``changes``)."""
        if after is None or (isinstance(after, list) and not after):
            return []  # the log's start (an empty saved cursor: a feed from the start that had not moved)
        if isinstance(after, dict):
            return [{"shard": shard, "after": list(TxKey(*key))} for shard, key in sorted(after.items())]
        if isinstance(after, (list, tuple)) and after and isinstance(after[0], dict):
            return [dict(position) for position in after]  # a saved cursor
        key = TxKey(*after)
        catalog = self.list_tables()
        known = {table["table"]: table["shard"] for table in catalog}
        shards = {known[name] for name in tables if name in known} if tables else set(known.values())
        return [{"shard": shard, "after": list(key)} for shard in sorted(shards)]

    def count(self, table: str, consistency: str = "local", after_tx_key: AfterKey = None) -> int:
        """The number of rows of ``table``, counted by the node (no row is shipped)."""
        answer = self.call("count", self._consistency({"table": table}, consistency, after_tx_key))
        return checked("count", answer, _CountAnswer).rows

    def table(self, name: str) -> dict[str, Any]:
        """One table's description (shard, key column, columns) as ``list_tables`` gives it."""
        for table in self.list_tables():
            if table["table"] == name:
                return table
        raise UnknownTable(f"unknown table {name!r}", "unknown_table")

    def list_tables(self) -> list[dict[str, Any]]:
        """Every table with its shard, key column and columns."""
        tables = self.call("list_tables")
        checked("list_tables", tables, list[_TableAnswer])
        return tables

    def status(self) -> dict[str, Any]:
        """The node's status: what ``mnesite status --json`` prints. Checked (``rlog.admin_answers``):
        a malformed answer raises ``MnesiteError`` ``bad_answer``. A core recovering at start-up adds
        its ``recovery`` section (``RecoveryAnswer``; its shards are not open yet)."""
        result = self.call("status")
        head = checked("status", result, admin_answers.NodeStatus)
        checked("status", result, admin_answers.status_type(head.role))
        if result.get("recovery") is not None:
            checked("status", result["recovery"], RecoveryAnswer)
        return result

    def journal(self) -> dict[str, Any]:
        """This core's journal age per shard: generation, committed and last tx keys, members, forced
        (checked as ``status``)."""
        return self._checked("journal", self.call("journal"), admin_answers.Journal)

    def force_start(self) -> dict[str, Any]:
        """Operator: make this core sequencer of every shard with the cores it can reach. May lose data.
        The answer is checked as ``status``'s."""
        return self._checked("force_start", self.call("force_start"), admin_answers.ForceStart)

    def members(self) -> dict[str, Any]:
        """The cluster's and each shard's core membership, as the node sees it (checked as ``status``)."""
        return self._checked("members", self.call("members"), admin_answers.Membership)

    def change_membership(
        self, shard: str, action: str, name: str, endpoint: str | None = None, request_id: str | None = None
    ) -> dict[str, Any]:
        """Operator: add (``action="add"``, with its endpoint) or remove one core in one shard.
        ``request_id``: an earlier attempt's, to go on waiting for it (the sequencer answers the
        retry of a change still catching up, or the change it committed). The answer (its committed
        ``tx_key``, or ``unchanged`` and why) is checked as ``status``'s."""
        body: dict[str, Any] = {"shard": shard, "action": action, "name": name}
        if endpoint is not None:
            body["endpoint"] = endpoint
        result = self.call("membership_change", body, request_id)
        return self._checked("membership_change", result, admin_answers.MembershipChange)

    def stop(self) -> dict[str, Any]:
        """Operator (admin role): the node answers (its name; checked as ``status``), logs a shutdown
        line and exits."""
        return self._checked("stop", self.call("stop"), admin_answers.Stopping)

    def backup(self, path: str) -> dict[str, Any]:
        """Operator: start a backup of the node's database to ``path`` on the node's host, or report
        the one under way to that path (``state`` running, done or failed; rlog.backup). Checked as
        ``status``."""
        return self._checked("backup", self.call("backup", {"path": path}), admin_answers.BackupAnswer)

    def backup_read(self, path: str, offset: int) -> dict[str, Any]:
        """Operator: bytes of the node's own finished backup at ``path`` from ``offset`` (``data``, at most
        ``limits.BACKUP_CHUNK_BYTES_MAX``), the file's ``size`` and whether they reach its ``end``. Checked
        as ``status``."""
        chunk = checked(
            "backup_read", self.call("backup_read", {"path": path, "offset": offset}), admin_answers.BackupChunk
        )
        # As checked, not as it came: msgspec takes base64 text for bytes, which a file is not written with.
        return {"data": chunk.data, "size": chunk.size, "end": chunk.end}

    def rlog_tail(self, shard: str, count: int = 10) -> list[dict[str, Any]]:
        """The last ``count`` committed entries of the shard's rlog (tx key, previous key, digest, ops,
        request id): those the node has applied (checked as ``status``)."""
        entries = self.call("rlog_tail", {"shard": shard, "count": count})
        return self._checked("rlog_tail", entries, admin_answers.RlogEntries)

    def rlog_entries(self, shard: str, after: list[int] | TxKey = (0, 0), limit: int = 1000) -> list[dict[str, Any]]:
        """Up to ``limit`` committed entries of the shard's rlog after tx key ``after``, in order (checked
        as ``status``)."""
        entries = self.call("rlog_entries", {"shard": shard, "after": list(after), "limit": limit})
        return self._checked("rlog_entries", entries, admin_answers.RlogEntries)

    # -- range requests (rlog.range_requests): the node hashes key ranges itself -------------

    def range_digest(
        self, table: str, ranges: list[list[Any]], split_parts: int = 0, split_rows_min: int = 0
    ) -> dict[str, Any]:
        """Row count and digest of each ``[low, high]`` range (``(low, high]``, None: unbounded). Every
        range answer is checked as ``status``'s (``admin_answers.RangePosition`` and its kinds)."""
        body = {"table": table, "ranges": ranges, "split_parts": split_parts, "split_rows_min": split_rows_min}
        return self._checked("range_digest", self.call("range_digest", body), admin_answers.RangeDigests)

    def key_boundaries(self, table: str, parts: int, low: Any = None, high: Any = None) -> dict[str, Any]:
        """Rows of ``(low, high]`` and up to ``parts - 1`` keys cutting it into near-equal ranges."""
        result = self.call("key_boundaries", {"table": table, "parts": parts, "low": low, "high": high})
        return self._checked("key_boundaries", result, admin_answers.KeyBoundaries)

    def row_digests(self, table: str, low: Any = None, high: Any = None, limit: int | None = None) -> dict[str, Any]:
        """``[key, row digest]`` of the first ``limit`` rows of ``(low, high]`` in key order."""
        body: dict[str, Any] = {"table": table, "low": low, "high": high}
        if limit is not None:
            body["limit"] = limit
        return self._checked("row_digests", self.call("row_digests", body), admin_answers.RowDigests)

    @staticmethod
    def _checked(kind: str, result: Any, answer_type: Any) -> Any:
        """``result`` as it came, once it fits ``answer_type`` (``bad_answer`` if not)."""
        checked(kind, result, answer_type)
        return result


def query_params(params: Any) -> list[Any]:
    """A query's parameters as they go, in order; a mapping or a set is refused unsent (``InvalidRequest``):
    each ``?`` takes the next value, and a mapping's own order is its keys', a set has none."""
    if isinstance(params, (Mapping, Set)):
        raise InvalidRequest(
            f"not sent: query.params: a {type(params).__name__} has no order of values for the ? "
            "placeholders: give a sequence (a list or a tuple)",
            "bad_request",
        )
    return list(params)


class QueryResult:
    """The rows of one query, fetched page by page from the node that answered its first page.

    Iterate it for the rows (tuples, in the statement's order). The node holds the statement open
    between pages (one snapshot for all of them) for at most its ``query_idle_ms_max``; ``close()``
    (or leaving a ``with`` block) frees it before the last page. A page request is never re-sent:
    a lost page would skip rows, so silence raises ``Unavailable`` instead. The cursor is that
    node's: page requests go there even after the client failed over to another endpoint, and if
    that node is gone the rest of the result is lost (``Unavailable`` says so: run the query again).
    """

    def __init__(self, client: Client, first: dict[str, Any], page_rows: int | None, timeout_ms: int) -> None:
        self.client = client
        # The node that answered the first page: it alone holds the cursor.
        self.endpoint = client.endpoint
        self.columns: list[str] = list(first["columns"])
        # shard -> the tx key the snapshot holds: the result reflects exactly those entries.
        self.positions: dict[str, TxKey] = {s: TxKey(*k) for s, k in first.get("positions", {}).items()}
        self._page: list[list[Any]] | None = first["rows"]
        self._cursor: str | None = first.get("cursor")
        self._page_rows = page_rows
        # How long each later page may take (the query's ``timeout_ms``; the DB-API sets its connection's).
        self.page_timeout_ms = timeout_ms
        # A client of ``endpoint`` alone, made when the client has several (it fails over between them).
        self._node_client: Client | None = None
        if self._cursor is not None and len(client.endpoints) > 1:
            self._node_client = client.pinned()
        # A page request that failed: the node's cursor is gone (or out of reach) and the rows after it
        # lost; every later fetch raises it again instead of answering None, the end of a whole result.
        self._lost: MnesiteError | None = None
        self.pages = 1

    def __enter__(self) -> QueryResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        while True:
            page = self.fetch_page()
            if page is None:
                return
            yield from page

    def _call(self, kind: str, body: dict[str, Any], timeout_ms: int | None) -> Any:
        """``kind`` sent to the node that holds the cursor, and to no other."""
        client = self._node_client or self.client
        try:
            return client.call(kind, body, timeout_ms=timeout_ms, retries=0)
        except OutcomeUnknown:
            raise
        except Unavailable as error:
            raise Unavailable(
                f"node {self.endpoint} holds this query's cursor and did not answer ({error}); "
                "the rest of the result is lost there: run the query again",
                error.code,
            ) from None

    def _forget(self) -> None:
        self._cursor = None
        if self._node_client is not None:
            self._node_client.close()
            self._node_client = None

    def fetch_page(self) -> list[tuple[Any, ...]] | None:
        """The next page of rows (None once every row was fetched)."""
        if self._page is not None:
            page, self._page = self._page, None
            return [tuple(row) for row in page]
        if self._lost is not None:
            raise self._lost
        if self._cursor is None:
            return None
        body: dict[str, Any] = {"cursor": self._cursor}
        if self._page_rows is not None:
            body["page_rows"] = self._page_rows
        try:
            answer = self._call("query_page", body, self.page_timeout_ms)
            checked("query_page", answer, _QueryPageAnswer)
            _rows("query_page", answer["rows"], list)
        except MnesiteError as error:
            self._forget()
            self._lost = error
            raise
        self._cursor = answer.get("cursor")
        if self._cursor is None:
            self._forget()
        self.pages += 1
        return [tuple(row) for row in answer["rows"]]

    def close(self, timeout_ms: int | None = None) -> bool:
        """Free the node's cursor if rows are left (best effort: it also expires by itself, after the
        node's ``query_idle_ms_max``). ``timeout_ms`` 0 only forgets it here. False if the node was
        asked and did not answer within ``timeout_ms`` (the client's timeout by default)."""
        cursor, self._page = self._cursor, None
        try:
            if cursor is None or timeout_ms == 0:
                return True
            try:
                self._call("query_close", {"cursor": cursor}, timeout_ms)
            except Unavailable:
                return False
            except MnesiteError:
                pass  # answered: already expired, or refused; either way nothing is left to free
            return True
        finally:
            self._forget()


class ChangeFeed:
    """The records of a changefeed (``Client.changes``), fetched page by page.

    ``cursor`` is where the feed stands, per shard: pass it as ``after_tx_key`` to resume (on any
    node). It moves as a record is handed over, to just after it when the record ends its entry (the
    records of one entry share a ``tx_key``) or a copy (``snapshot_end``): a consumer that saves it once
    it applied a record resumes with the next one, and one that stops inside an entry resumes at that
    entry's start. Through an entry whose records are more bytes than a page holds it moves page by
    page (``records_after``). At a ``snapshot_begin`` it moves to the copy's start, and inside the copy
    page by page: a resume from it goes on with the copy, never back before it. ``position`` is the last
    tx key delivered per shard outside a copy (a shard inside one has none). A feed that is not following
    ends only outside a copy. Inside one, a node that has no such shard or does not move toward the copy
    for ``COPY_STALL_PAGES_MAX`` pages in a row is left for the client's next endpoint, from the same
    positions; once every endpoint was left so with no progress in between (each tried once), the feed
    ends with ``MnesiteError`` (``changes_stalled``) naming them.
    ``applied`` is the answering node's applied key per shard (how far
    behind the feed is). The answers are checked: a malformed page raises ``MnesiteError``.
    """

    def __init__(
        self,
        client: Client,
        tables: list[str],
        positions: list[dict[str, Any]],
        follow: bool,
        wait_ms: int,
        page_records: int | None,
    ) -> None:
        self.client = client
        self.tables = tables
        self.follow = follow
        self.wait_ms = wait_ms
        self.page_records = page_records
        self._positions: dict[str, dict[str, Any]] = {position["shard"]: position for position in positions}
        self.applied: dict[str, TxKey] = {}
        self.pages_fetched = 0
        self._stalled_pages = 0  # empty pages in a row inside a copy from a node that does not move to it
        # The endpoints this stall moved the feed to or off, each with why it could not move the copy:
        # each is tried at most once until the feed moves again, so stalled nodes are not asked in turn
        # forever (the client's own failover may carry a page back to one already tried).
        self._stall_tried: dict[str, str] = {}

    @property
    def cursor(self) -> list[dict[str, Any]]:
        return [dict(position) for _, position in sorted(self._positions.items())]

    @property
    def position(self) -> dict[str, TxKey]:
        return {
            shard: TxKey(*position["after"])
            for shard, position in self._positions.items()
            if position.get("phase", "live") == "live"
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            records, positions = self.fetch_page()
            # The cursor moves as a record is handed over, to the position after it when that is a
            # whole entry's end (or a copy's): a consumer that saves ``cursor`` once it applied the
            # record resumes with the next one. Inside an entry it stays at the entry's start.
            for record, following in zip(records, _next_of_shard(records), strict=True):
                shard = record["shard"]
                if following is None:
                    if shard in positions:  # all of the page's records of the shard
                        self._positions[shard] = positions[shard]
                elif record["kind"] == "snapshot_end" or (
                    record["kind"] == "change" and following["tx_key"] != record["tx_key"]
                ):
                    self._positions[shard] = {"shard": shard, "after": list(record["tx_key"])}
                elif record["kind"] == "snapshot_begin":
                    # The consumer drops what it holds of the tables: from now on a resume goes on with
                    # the copy (its rows again, full rows: harmless), never back to the position before
                    # it, which a node that has not trimmed it would answer with changes on top of
                    # the emptied tables.
                    self._positions[shard] = position_to_wire(copy_start(record))
                yield record
            self._positions = positions
            if self._caught_up(records) and not self.follow:
                return

    def pages(self) -> Iterator[list[dict[str, Any]]]:
        """The records page by page (a page may be empty while following): for consumers that
        apply and save their position a page at a time (``cursor`` moves when a page is yielded)."""
        while True:
            records, positions = self.fetch_page()
            self._positions = positions
            yield records
            if self._caught_up(records) and not self.follow:
                return

    def _caught_up(self, records: list[dict[str, Any]]) -> bool:
        """No record in the last page, and every shard at the answering node's applied key, outside a
        copy: an empty page inside one (a node behind the copy's start or end, after a failover) is
        no end, or the feed would end holding part of the tables, with no ``snapshot_end``."""
        return (
            not records
            and not self._inside_copy()
            and all(
                TxKey(*position["after"]) >= self.applied.get(shard, TxKey(0, 0))
                for shard, position in self._positions.items()
            )
        )

    def _inside_copy(self) -> bool:
        return any(position.get("phase", "live") != "live" for position in self._positions.values())

    def fetch_page(self) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """One page: its records and the positions after it (the feed's cursor moves on iteration)."""
        body: dict[str, Any] = {"positions": self.cursor}
        if self.tables:
            body["tables"] = self.tables
        if self.page_records is not None:
            body["page_records"] = self.page_records
        # Inside a copy the feed is not done even when it is not following (``_caught_up``): a page held
        # until the node moves, rather than asked again at once of a node behind the copy.
        wait_ms = self.wait_ms if self.follow or self._inside_copy() else 0
        if wait_ms:
            body["wait_ms"] = wait_ms
        answer = self.client.call("changes", body, timeout_ms=self.client.timeout_ms + wait_ms)
        records, positions, applied = _changes_page(answer)
        if records or _places(positions) != _places(self._positions):
            self._stall_tried.clear()  # the feed moved: a later stall may try every endpoint again
        stalled = None if records or self.follow else copy_stalled(positions.values(), self.applied, applied)
        self._stalled_pages = self._stalled_pages + 1 if stalled else 0
        self.applied = applied
        if stalled and self._stalled_pages >= COPY_STALL_PAGES_MAX:
            # Waiting longer for a node that does not move is a feed that never ends (not following).
            self._leave_stalled_node(f"{stalled} ({self._stalled_pages} pages)")
        self.pages_fetched += 1
        return records, positions

    def _leave_stalled_node(self, why: str) -> None:
        """Go on at the client's next endpoint not tried in this stall, as a ``not_ready`` answer moves
        a call (``Client._next_endpoint``), from the same positions: another node (a core, a replicant
        that has the shard or is not cut off) may move the copy. Every endpoint tried: ``changes_stalled``."""
        client = self.client
        self._stall_tried[client.endpoint] = why
        self._stalled_pages = 0
        for _ in client.endpoints:
            if client.endpoint not in self._stall_tried:
                # Marked now: should the client's failover carry the feed off it, it is not tried again.
                self._stall_tried[client.endpoint] = "left before it served a page (silent, stopping or not ready)"
                return
            client._next_endpoint()
        if len(client.endpoints) == 1:
            raise MnesiteError(f"{why}: stopped inside a copy", "changes_stalled")
        tried = "; ".join(f"{endpoint}: {reason}" for endpoint, reason in self._stall_tried.items())
        raise MnesiteError(f"stopped inside a copy that no endpoint moves ({tried})", "changes_stalled")


def _next_of_shard(records: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """For each record, the next record of its shard in ``records`` (None for its shard's last)."""
    following: list[dict[str, Any] | None] = [None] * len(records)
    later: dict[str, dict[str, Any]] = {}
    for index in range(len(records) - 1, -1, -1):
        following[index] = later.get(records[index]["shard"])
        later[records[index]["shard"]] = records[index]
    return following


def _places(positions: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """Where each shard's wire position stands, whatever its form (a field left out or given as its
    default, a key as a list or a ``TxKey``): two that compare equal are the same place in the feed."""
    return {
        shard: (
            position.get("phase", "live"),
            tuple(position["after"]),
            position.get("table"),
            position.get("table_after"),
            position.get("records_after"),
            tuple(position.get("replay_to") or ()),
        )
        for shard, position in positions.items()
    }


def _changes_page(answer: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, TxKey]]:
    """A ``changes`` answer checked: records, positions by shard (as sent back), applied keys."""
    page = answer_as(answer, _ChangesAnswer)
    if page is None:
        raise bad_answer("changes", "not a page of change records, positions and applied keys")
    try:
        typed_body("changes", {"positions": page.positions})
    except MessageError as error:
        raise bad_answer("changes", str(error)) from None
    records: list[dict[str, Any]] = answer["records"]
    for record, checked_record in zip(records, page.records, strict=True):
        record["tx_key"] = checked_record.tx_key
    positions = {position["shard"]: position for position in page.positions}
    return records, positions, dict(page.applied)


# The least time the "did not answer" check has (``_why_silent``): a call may end this much after its deadline.
WHY_SILENT_S_MIN = 0.05
# Host name lookups of the "did not answer" check still running in their threads (a resolver that hangs
# keeps its thread until the resolver gives up): past this many, the check gives up at once with no hint.
WHY_SILENT_LOOKUPS_MAX = 4
_why_silent_lookups = threading.BoundedSemaphore(WHY_SILENT_LOOKUPS_MAX)


def _recovering(answer: Message) -> bool:
    """Whether ``answer`` is a core's ``not_ready`` while it recovers at start-up (its ``detail`` holds
    the ``recovery`` section): nothing was done, and the core serves once its peers answered, so the call
    asks again within its deadline, as during an election. A script that starts a cluster and at once
    creates a table was refused at the first core to answer (before the core answered ``status`` during
    its recovery, nothing listened there, and the call waited for the connection)."""
    detail = answer.body.detail
    return answer.body.code == NOT_READY_CODE and isinstance(detail, dict) and "recovery" in detail


def _why_silent(endpoint: str, deadline: float) -> str:
    """Tell an unreachable node from one that is up but silent (a write's outcome: ``OutcomeUnknown``)
    with a TCP connection, within what is left of the call's ``deadline`` (``time.monotonic()``) and at
    least ``WHY_SILENT_S_MIN``: a silent call's last attempt waits until the deadline, and a dead node's
    refusal (well under a millisecond on a LAN) must still be told. One that neither completes nor is
    refused by then (a hung node's full accept queue, dropped packets), or whose host name is not looked
    up by then (a resolver that hangs), says nothing."""
    if not endpoint.startswith("tcp://"):
        return ""
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    try:
        found = _address_of(host.strip("[]"), int(port), deadline)
        if found is None:
            return ""
        family, kind, protocol, _, address = found
        with socket_module.socket(family, kind, protocol) as probe:
            probe.settimeout(max(deadline - time.monotonic(), WHY_SILENT_S_MIN))
            probe.connect(address)
    except TimeoutError:
        return ""
    except (OSError, ValueError):
        return "; nothing accepts connections there: unreachable"
    return ""


def _address_of(host: str, port: int, deadline: float) -> tuple[Any, ...] | None:
    """The first TCP address of ``host`` (``socket.getaddrinfo``'s row), or None when its lookup did not
    finish within what is left of ``deadline`` (at least ``WHY_SILENT_S_MIN``). An IP literal and
    ``localhost`` (the IPv4 loopback, as zmq connects without IPv6) need no lookup; any other name is
    looked up in a daemon thread, since a resolver that hangs blocked the call many seconds past its
    deadline. A lookup error raises ``socket.gaierror`` (an ``OSError``)."""
    if host.lower() == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        flags = socket_module.AI_NUMERICHOST
        return socket_module.getaddrinfo(host, port, type=socket_module.SOCK_STREAM, flags=flags)[0]
    if not _why_silent_lookups.acquire(blocking=False):
        return None
    found: list[Any] = []

    def look_up() -> None:
        try:
            found.append(socket_module.getaddrinfo(host, port, type=socket_module.SOCK_STREAM)[0])
        except OSError as error:
            found.append(error)
        finally:
            _why_silent_lookups.release()

    lookup = threading.Thread(target=look_up, name="mnesite-why-silent-lookup", daemon=True)
    lookup.start()
    lookup.join(max(deadline - time.monotonic(), WHY_SILENT_S_MIN))
    if not found:
        return None
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


class Transaction:
    """Collects guards and ops; sends them as one transaction when the ``with`` block ends cleanly."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.guards: list[dict[str, Any]] = []
        self.ops: list[dict[str, Any]] = []
        self.tx_key: TxKey | None = None

    def require(self, table: str, key: Any, equals: dict[str, Any] | None) -> Transaction:
        """Guard: the row at ``key`` must equal ``equals`` (a full row), or be absent if ``equals`` is None."""
        self.guards.append({"table": table, "key": key, "equals": equals})
        return self

    def put(self, table: str, row: dict[str, Any]) -> Transaction:
        """Add the write of a full row."""
        self.ops.append({"op": "write", "table": table, "row": row})
        return self

    def delete(self, table: str, key: Any) -> Transaction:
        """Add the delete of the row with this key."""
        self.ops.append({"op": "delete", "table": table, "key": key})
        return self

    def commit(self) -> TxKey:
        """Send the guards and ops as one transaction (all or nothing); returns its tx key."""
        self.tx_key = self.client.transact(self.ops, self.guards)
        return self.tx_key

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
