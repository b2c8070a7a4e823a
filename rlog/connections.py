"""Bound the connections a node's listen socket holds open ([limits] connections_max).

Theory of operation
-------------------
zmq accepts every TCP connection that reaches a bound ROUTER; each costs the node a file descriptor
and a receive queue (``requests_queued_max`` frames). A client that opens connections in a loop would
exhaust the node's descriptors (then SQLite cannot open a file and the node fails) or its memory.
zmq has no connection limit of its own, and the node must never close a descriptor zmq owns (the
number is reused at once, by SQLite perhaps). So the node refuses through zmq itself:

* A monitor of the listen socket counts the connections open: ``EVENT_ACCEPTED`` carries the new
  connection's descriptor, ``EVENT_DISCONNECTED`` the descriptor of one that closed, whether its
  handshake succeeded, failed or was refused (checked by experiment with libzmq 4.3.5;
  ``EVENT_HANDSHAKE_SUCCEEDED`` carries no descriptor, only 0, so the count is of descriptors,
  connections still in their handshake included).
* The listen socket has a ZAP domain, so zmq asks the ZAP handler about every connection's
  handshake, with the NULL mechanism too. The handler (the node's one per zmq context: with
  ``[security]`` the same one checks the key) asks ``admits``; a connection refused gets ZAP status
  ``REFUSED_STATUS``: zmq sends the client an ERROR and closes the connection. A client's monitor
  sees ``EVENT_HANDSHAKE_FAILED_AUTH`` with that status, which is how ``rlog.client.Client`` tells a
  full node from a refused key (400).

The monitor's thread and the ZAP handler's thread share the count under one lock. zmq emits a
connection's accept before its handshake can reach the handler, but the monitor's thread may not
have read it yet (Python's threads take turns): before each decision the handler wakes the monitor's
thread and waits (at most ``CATCH_UP_MS``) until it has read every event queued, the accept of the
connection asking among them. So the bound holds but for connections whose accept zmq had not yet
queued when the monitor was drained, that is, accepted at the same instant as the decision: at most
one each; and for any the handler let in after ``CATCH_UP_MS`` ran out (the monitor's thread stalled).
The count leans the other way too: connections still in their handshake (one that will be refused,
a silent one until zmq's handshake interval closes it) take places.

A refused zmq DEALER does not reconnect by itself (libzmq takes the refusal for a protocol error
and ends the connection's session for good; checked with libzmq 4.3.5): a ``Client`` closes its
socket and tells its caller, or moves to another endpoint. A node's own DEALERs (a core's toward its
peers, a replicant's toward the cores; not a core's toward replicant endpoints, up to ``watches_max``
of them: their socket is closed when the agent stops for want of acknowledgements, and the replicant's
next watch dials anew) each have a monitor of
``DEALER_EVENTS``; ``NodeServer.reconnect_refused`` reads them at most every
``MONITOR_READ_INTERVAL_MS`` (never on every turn of the write path), and ``RefusedDealers`` says when
each DEALER refused is dialled again: one refused with ``REFUSED_STATUS`` (the other node was full)
after ``redial_delay_ms``, one refused for its key (``KEY_REFUSED_STATUS``, ``[security]``: the key is
not in the other node's authorized_keys, yet or any more) after the slower ``key_redial_delay_ms``,
so that a key authorized later (the other node's SIGHUP) is used without a restart of this node. Both
back-offs grow with the refusals in a row, which a completed handshake resets. Dialling again is
``disconnect(endpoint)`` and ``connect(endpoint)`` on the same socket: the socket, its place in the
loop's poller and its send-queue ledger stay (``rlog.send_queue``: the frames zmq held for the ended
session were let go of with it). The node that refuses a key only counts it (``handshakes_failed``,
``refused_unknown_key``; pyzmq's lines are at debug level), so a key refused every
``KEY_REDIAL_DELAY_MS_MAX`` costs its log nothing; the node refused warns, at most once a second.
A monitor costs two zmq sockets (libzmq's end and the node's), so the node's zmq context is allowed
``sockets_needed`` sockets rather than zmq's default of 1023.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import threading
from typing import Any

import zmq
import zmq.utils.z85
from mnesite.rlog.config import ConfigError
from mnesite.rlog.errors import REFUSED_FULL, REFUSED_KEY
from mnesite.rlog.security import (
    HANDSHAKE_FAILURES,
    REFUSED_STATUS,
    ZAP_DOMAIN,
    NodeSecurity,
)
from mnesite.rlog.throttle import ThrottledLog
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("mnesite.connections")

MONITOR_POLL_MS = 200
# How long a decision waits for the monitor's thread to read the events queued (``ListenGuard.catch_up``).
CATCH_UP_MS = 100
MONITOR_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# Descriptors a node needs besides its listen socket's connections: SQLite's files (the database,
# its WAL and shared memory, for the writer, the checkpointer and each query thread; temporary files
# of sorts), the data directory's lock, logs, the metrics endpoint and its clients, zmq's own (its
# I/O thread's poller, a mailbox per socket), Python's. Measured: a core serving queries holds under
# 100 beside its connections; this leaves room.
FILES_RESERVED = 256
# Each DEALER a node opens (to a peer core, a core, a replicant's endpoint) costs its connection's
# descriptor and its zmq mailbox, and its monitor's two PAIR sockets a mailbox each.
FILES_PER_DEALER = 4
# zmq sockets: each DEALER with its monitor's two PAIRs; besides them the listen socket, its monitor
# (two), the monitor's wake-up pair, the ZAP handler's (three): 64 leaves room. zmq's default, 1023,
# is the least a node is allowed (``sockets_needed``).
SOCKETS_PER_DEALER = 3
SOCKETS_RESERVED = 64
SOCKETS_DEFAULT = 1023
# What a node's own DEALER's monitor reports: a refusal (the ZAP status is the event's value) and a
# handshake completed (the refusals in a row start over).
DEALER_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED
# How often the node's loop reads its DEALERs' monitors (``NodeServer.reconnect_refused``): a
# refusal is acted on within this, plus its back-off.
MONITOR_READ_INTERVAL_MS = 250
# The back-off of a refused DEALER (``redial_delay_ms``): dialled again this long after its first
# refusal, twice as long after each further refusal in a row, at most REDIAL_DELAY_MS_MAX. A full
# node is not dialled more than about once every 4 s by each refused DEALER, and one that has a
# place again is reached within 4 s (plus MONITOR_READ_INTERVAL_MS).
REDIAL_DELAY_MS_MIN = 250
REDIAL_DELAY_MS_MAX = 4000
# The back-off of a DEALER refused for its key (``key_redial_delay_ms``): the operator authorizes it
# and sends the other node SIGHUP, which takes a while, so it is slower; a key authorized is used
# within KEY_REDIAL_DELAY_MS_MAX (plus MONITOR_READ_INTERVAL_MS) of the reload.
KEY_REDIAL_DELAY_MS_MIN = 1000
KEY_REDIAL_DELAY_MS_MAX = 30_000


def admits(others_open: int, open_max: int, exempt: bool) -> bool:
    """Whether a connection whose handshake reached the ZAP handler is let in: ``others_open``
    connections besides it are open on the listen socket, ``connections_max`` is ``open_max``.
    ``exempt``: a peer core's key (with ``[security]``), never refused for the count: a flood of
    clients must not cut the cluster apart (its connections still take places from clients)."""
    return exempt or others_open < open_max


def files_needed(connections_max: int, dealers_max: int) -> int:
    """The file descriptors a node may need at once: its listen socket's connections, the DEALERs it
    may open and ``FILES_RESERVED``."""
    return connections_max + FILES_PER_DEALER * dealers_max + FILES_RESERVED


def soft_limit_for(needed: int, soft: int, hard: int) -> int | None:
    """The soft ``RLIMIT_NOFILE`` to set for ``needed`` descriptors: ``soft`` if enough, else
    ``needed`` if the hard limit allows it; None if not even the hard limit does."""
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard == resource.RLIM_INFINITY or hard >= needed:
        return needed
    return None


def sockets_needed(dealers_max: int) -> int:
    """The zmq sockets a node's context may hold at once (``zmq.MAX_SOCKETS``): ``dealers_max`` DEALERs
    with their monitors, and ``SOCKETS_RESERVED``; never fewer than zmq's default."""
    return max(SOCKETS_DEFAULT, SOCKETS_RESERVED + SOCKETS_PER_DEALER * dealers_max)


def _doubling_delay_ms(refusals: int, least_ms: int, most_ms: int) -> int:
    """``least_ms`` after the first refusal in a row, doubled at each further one, at most ``most_ms``."""
    if refusals < 1:
        raise ValueError(f"refusals must be at least 1, got {refusals}")
    doublings = min(refusals - 1, most_ms.bit_length())  # no huge shift for a long refusal
    return min(least_ms << doublings, most_ms)


def redial_delay_ms(refusals: int) -> int:
    """How long after the ``refusals``-th refusal in a row (1, 2, ...) of a node's own DEALER for the
    other node's ``connections_max`` it is dialled again: ``REDIAL_DELAY_MS_MIN`` doubled at each
    further refusal, at most ``REDIAL_DELAY_MS_MAX``."""
    return _doubling_delay_ms(refusals, REDIAL_DELAY_MS_MIN, REDIAL_DELAY_MS_MAX)


def key_redial_delay_ms(refusals: int) -> int:
    """How long after the ``refusals``-th refusal in a row (1, 2, ...) of a node's own DEALER for its
    key it is dialled again: ``KEY_REDIAL_DELAY_MS_MIN`` doubled at each further refusal, at most
    ``KEY_REDIAL_DELAY_MS_MAX``."""
    return _doubling_delay_ms(refusals, KEY_REDIAL_DELAY_MS_MIN, KEY_REDIAL_DELAY_MS_MAX)


REDIAL_DELAYS = {REFUSED_FULL: redial_delay_ms, REFUSED_KEY: key_redial_delay_ms}


class RefusedDealers:
    """A node's own DEALERs refused by another node, by endpoint: for its ``connections_max``
    (``REFUSED_FULL``) or for this node's key (``REFUSED_KEY``); their refusals in a row and when each
    is dialled again (pure: the driver reads the monitors, dials and counts;
    ``NodeServer.reconnect_refused``). One entry per endpoint the node holds a DEALER for."""

    def __init__(self) -> None:
        # endpoint -> (why, refusals for that reason since its last completed handshake): refused until then
        self._refusals: dict[str, tuple[str, int]] = {}
        self._due_ms: dict[str, tuple[int, str]] = {}  # endpoint -> when it is dialled again, and why
        # DEALERs dialled again after a refusal since the node started, by why (REFUSED_FULL, REFUSED_KEY)
        self.redials = {REFUSED_FULL: 0, REFUSED_KEY: 0}

    def refused(self, endpoint: str, why: str, now_ms: int) -> int:
        """The DEALER toward ``endpoint`` was refused, ``why``: it is dialled again after the delay
        returned (a refusal for another reason than the last starts its back-off over)."""
        last_why, refusals = self._refusals.get(endpoint, (why, 0))
        refusals = refusals + 1 if last_why == why else 1
        self._refusals[endpoint] = (why, refusals)
        delay_ms = REDIAL_DELAYS[why](refusals)
        self._due_ms[endpoint] = (now_ms + delay_ms, why)
        return delay_ms

    def connected(self, endpoint: str) -> None:
        """Its handshake completed: a later refusal starts the back-off over."""
        self._refusals.pop(endpoint, None)

    def refused_for(self, endpoint: str) -> str | None:
        """Why the DEALER toward ``endpoint`` was refused at its last handshake (dialled again or not
        since, none completed since); None if it was not."""
        refusal = self._refusals.get(endpoint)
        return refusal[0] if refusal is not None else None

    def forget(self, endpoint: str) -> None:
        """Its DEALER was closed: nothing is dialled again."""
        self._refusals.pop(endpoint, None)
        self._due_ms.pop(endpoint, None)

    def take_due(self, now_ms: int) -> list[str]:
        """The endpoints to dial again now (counted as dialled: the caller dials each)."""
        due = [(endpoint, why) for endpoint, (due_ms, why) in self._due_ms.items() if due_ms <= now_ms]
        for endpoint, why in due:
            del self._due_ms[endpoint]
            self.redials[why] += 1
        return [endpoint for endpoint, _ in due]

    def waiting(self) -> int:
        """DEALERs refused and not dialled again yet."""
        return len(self._due_ms)


def ensure_files(connections_max: int, dealers_max: int) -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to what the node may need (``files_needed``), or
    raise ``ConfigError`` naming both numbers: a node that runs out of descriptors mid-flight fails
    (SQLite cannot open a file), which is what connections_max is there to prevent."""
    needed = files_needed(connections_max, dealers_max)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft_limit_for(needed, soft, hard)
    if target is not None and target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return
        except (OSError, ValueError):
            target = None  # a system cap below the hard limit (macOS: kern.maxfilesperproc)
    if target is None:
        raise ConfigError(
            f"[limits] connections_max = {connections_max} needs up to {needed} open files (with "
            f"{needed - connections_max} for the node's own files and connections), but this process may "
            f"open {hard} (RLIMIT_NOFILE hard limit); lower connections_max or raise the limit "
            f"(ulimit -n, systemd LimitNOFILE=)"
        )


class ConnectionCount:
    """The listen socket's open connections (their descriptors), its bound and the refusals; shared by
    the monitor's thread, the ZAP handler's and the node's (``status``), under ``lock``."""

    def __init__(self, open_max: int) -> None:
        self.open_max = open_max
        self.lock = threading.Lock()
        self._open: set[int] = set()
        self.refused = 0
        # At most a line a second, with the count of those left out; the node's loop flushes it.
        self.warnings = ThrottledLog(log)

    def accepted(self, descriptor: int) -> None:
        with self.lock:
            self._open.add(descriptor)

    def disconnected(self, descriptor: int) -> None:
        with self.lock:
            self._open.discard(descriptor)

    def admit(self, exempt: bool) -> bool:
        """Decide for a connection in its handshake (one of the open ones: its accept came first)."""
        with self.lock:
            others = max(len(self._open) - 1, 0)
            if admits(others, self.open_max, exempt):
                return True
            self.refused += 1
            self.warnings.log(
                "connections_max",
                logging.WARNING,
                "refused a connection: %d are open, [limits] connections_max is %d (%d refused so far)",
                others,
                self.open_max,
                self.refused,
            )
            return False

    def flush_warnings(self) -> None:
        with self.lock:
            self.warnings.flush()

    def status(self) -> dict[str, int]:
        with self.lock:
            return {"open": len(self._open), "open_max": self.open_max, "refused_open_max": self.refused}


class _Authenticator(ThreadAuthenticator):
    """The node's ZAP handler: ``connections_max`` first, then (with ``[security]``) the key."""

    def __init__(self, context: zmq.Context, guard: ListenGuard) -> None:
        super().__init__(context, log=logging.getLogger("mnesite.zap"))
        self.guard = guard
        self.count = guard.count
        self.security = guard.security

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 6:
            self.guard.catch_up()
        if len(msg) >= 6 and not self.count.admit(self._exempt(msg[5], msg[6:])):
            self._send_zap_reply(msg[1], str(REFUSED_STATUS).encode(), b"connections_max")
            return
        await super().handle_zap_message(msg)

    def _exempt(self, mechanism: bytes, credentials: list[bytes]) -> bool:
        """A peer core's authorized key (principals in the ``core`` role)."""
        if self.security is None or mechanism != b"CURVE" or len(credentials) != 1:
            return False
        principal = self.security.authorized.get(zmq.utils.z85.encode(credentials[0]), "")
        return bool(principal) and "core" in self.security.roles.roles_of(principal)

    def curve_user_id(self, client_public_key: bytes) -> str:
        # The key itself, not its principal: the node maps it at every frame (``principal_of``), so a
        # reload that removes or replaces the key applies to connections already open.
        return zmq.utils.z85.encode(client_public_key).decode("ascii")


class ListenGuard:
    """The node's ZAP handler and its listen socket's monitor thread (``count``; the security
    handshake failures, with ``[security]``)."""

    def __init__(self, count: ConnectionCount, security: NodeSecurity | None) -> None:
        self.count = count
        self.security = security
        self._authenticator: _Authenticator | None = None
        self._monitor_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # The ZAP handler's end of a pair that wakes the monitor's thread (``catch_up``), and what the
        # latter sets once it has read every event queued.
        self._wake: zmq.Socket | None = None
        self._caught_up = threading.Event()

    def start(self, context: zmq.Context) -> None:
        """Start the ZAP handler on ``context``: before the listen socket binds."""
        authenticator = _Authenticator(context, self)
        authenticator.start()
        if self.security is not None:
            authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.security.key_check())
        self._authenticator = authenticator

    def watch(self, socket: zmq.Socket) -> None:
        """Ask the ZAP handler about ``socket``'s connections (NULL mechanism too) and monitor them."""
        socket.zap_domain = ZAP_DOMAIN.encode()
        monitor = socket.get_monitor_socket(MONITOR_EVENTS)
        address = f"inproc://mnesite-monitor-wake-{id(self)}"
        woken = socket.context.socket(zmq.PAIR)
        woken.bind(address)
        self._wake = socket.context.socket(zmq.PAIR)
        self._wake.connect(address)
        self._monitor_thread = threading.Thread(target=self._watch, args=(monitor, woken), daemon=True)
        self._monitor_thread.start()

    def catch_up(self) -> None:
        """The ZAP handler's thread (which alone uses ``_wake``): wait until the monitor's thread has
        read the events queued now, at most ``CATCH_UP_MS``."""
        if self._wake is None:
            return
        self._caught_up.clear()
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # stopping
        self._caught_up.wait(CATCH_UP_MS / 1000)

    def _watch(self, monitor: zmq.Socket, woken: zmq.Socket) -> None:
        # These sockets belong to this thread alone (zmq sockets are not thread-safe).
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(woken, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(MONITOR_POLL_MS))
                if woken in ready:
                    while woken.poll(0):
                        woken.recv()
                    while monitor.poll(0):
                        self.event(recv_monitor_message(monitor))
                    self._caught_up.set()
                elif monitor in ready:
                    self.event(recv_monitor_message(monitor))
        except zmq.ZMQError:
            pass  # the context is terminating
        finally:
            monitor.close(0)
            woken.close(0)

    def event(self, event: dict[str, Any]) -> None:
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            self.count.accepted(value)
        elif kind == zmq.EVENT_DISCONNECTED:
            self.count.disconnected(value)
        elif self.security is not None and kind in HANDSHAKE_FAILURES and value != REFUSED_STATUS:
            # A connection refused for connections_max is counted there, not as a security failure.
            self.security.handshake_failed(HANDSHAKE_FAILURES[kind])

    def stop(self) -> None:
        self._stopping.set()
        if self._authenticator is not None:
            self._authenticator.stop()  # its thread ends: ``_wake`` is no longer used there
            self._authenticator = None
        if self._wake is not None:
            # Wake the monitor's thread, which saw the stop only at the end of its poll: each node's
            # stop (and each test's) waited up to MONITOR_POLL_MS more when no event came meanwhile.
            with contextlib.suppress(zmq.ZMQError):  # the thread has ended: nothing to wake
                self._wake.send(b"", zmq.NOBLOCK)
        if self._monitor_thread is not None:
            self._monitor_thread.join(timeout=2)
        if self._wake is not None:
            self._wake.close(0)
            self._wake = None
