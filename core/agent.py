"""The core-side pusher of one replicant's watch of one shard (Mria's agent, with catch-up from the rlog).

Theory of operation
-------------------
When a replica's watch is accepted, the core's agent server builds one ``Agent`` with a unique
agent id and the key the replica already has (``start_key``: the replica's applied key on a resume,
K0, the core's committed key, on a bootstrap). The agent pushes every *committed* entry after
``start_key`` to the replicant, in key order, and nothing else. It is a pure state machine: it reads
the persisted log through an ``AgentLogView`` and never touches a socket, a file or a clock.

* One read path. Every entry the agent pushes is read from the persisted log, in key order,
  starting right after the last key it pushed (``sent_key``). Catching up from an old position and
  following live commits are the same loop, so at the switchover from one to the other there is
  never a gap nor a duplicate: the next entry is always the one whose ``prev`` is ``sent_key``.
  The modes are what an operator sees of that loop: CATCHUP while more than ``switchover_entries``
  committed entries lie ahead, SWITCHOVER when fewer do, NORMAL once it has pushed up to the
  committed key; they only move forward. STOPPED is final.
* Only committed entries. The agent knows the committed key from ``CommittedAdvanced`` (the driver
  steps it at every commit) and never pushes past it, even if the log holds an uncommitted tail.
* Window. At most ``window_entries_max`` pushed entries, and at most ``window_bytes_max`` bytes of
  them, are unacknowledged; the replica acknowledges with its applied (or spilled) key. A replica
  that stops acknowledging (its spill is full) makes the window fill, which stops the pushes: that
  is the backpressure. Until the replicant's first acknowledgement the window is only
  ``probation_bytes_max`` bytes (64 KiB on a core): a watch naming an endpoint where nothing
  listens then costs about one push, not a window (zmq keeps what it was handed for a dead
  endpoint until the socket closes). One push holds at most ``push_entries_max`` entries and
  ``push_bytes_max`` bytes (an entry larger than that goes alone), so a push never exceeds the
  replicant's frame limit with large transactions (see "Frame limit").
* Frame limit. A replicant reads no frame above its own ``frame_bytes_max``, which may be smaller
  than the core's. A replicant of protocol 2 tells it in its watch (``rlog.messages.Watch``); the
  agent then pushes at most ``push_bytes_bound`` bytes of entries a push (half the replicant's limit,
  if that is below ``push_bytes_max``), and never pushes an entry that does not fit the replicant's
  frame even alone (``unpushable_entry``: its size and the push's envelope above the limit): a push
  the replicant refuses unread would be resent for ever, and the replicant would never learn why.
  It stops instead, with that refusal as its reason (``entry_refusal``), before the entry: the
  entries before it are pushed first. The agent server refuses a watch whose agent stops so at once
  (``too_large``, naming the entry's key and size, the replicant's limit and the limit that would
  do); a replicant whose agent stopped later (which the core logs: ``AgentServer.entry_refusals``)
  notices the silence, watches again from its applied key, and is refused so. A replicant that told
  nothing (protocol 1, release 0.1.0) is pushed as before: by the core's own bounds.
* Pushes in flight. A push with entries is in flight until an acknowledgement covers its last key.
  A partial push (fewer than ``push_entries_max`` entries and ``push_bytes_max`` bytes, judged by
  the entry sizes seen so far) goes only while fewer than ``pushes_in_flight_max`` pushes are in
  flight; otherwise it waits for an acknowledgement and then carries every entry committed
  meanwhile. A full push goes whenever the window has room, so a catch-up keeps streaming. Under
  load a replicant therefore gets fewer, fuller pushes (its cost, and the core's, is per push: a
  wake-up, a frame, a transaction, an acknowledgement), and when idle a commit is pushed at once. A
  lost acknowledgement holds a partial push until the heartbeat's acknowledgement, at most
  ``heartbeat_interval_ms`` later.
* Push delay. A partial push also waits until ``push_delay_ms_max`` has passed since the previous
  push with entries (0: it never waits for that). The acknowledgement of a push usually comes back
  long before the next commit, so the pushes in flight alone leave about one push per commit; this
  delay makes the commits of the next ``push_delay_ms_max`` ride in one push, which costs the
  replicant one wake-up, one transaction and one acknowledgement instead of one each per commit. A
  commit after a quiet spell still goes at once, and an entry waits at most ``push_delay_ms_max``
  for this rule: what it adds to a replicant's lag is bounded by it. The agents of a shard are
  stepped by the same commits, so they wait in step, and the core pushes to all of them in one
  loop turn (each run of entries encoded once).
* Paced by acknowledgements. One step pushes at most ``step_bytes_max`` bytes (or less: the driver
  may pass a smaller budget for a step, down to 0, when its loop turn has spent its budget for all
  agents): an acknowledgement (or a commit, or a tick) lets the next ones go. Catching up from far
  behind is therefore a stream of bounded pushes interleaved with the core's other work, never one
  long burst that would delay the core's heartbeats and appends (DESIGN invariant 11).
  ``next_deadline_ms()`` is ``now`` while the window has room and committed entries wait, so the
  driver keeps the stream going at its own pace. Entries are read from the log in reads sized by
  the entry sizes seen so far, each at most twice as many as the last push (or the push being
  filled) held, so a log of large entries is never read far beyond one push; a push reads again
  until it is full or holds every committed entry.
* Retransmission. An acknowledgement that does not advance while entries are unacknowledged means
  the replica lost a push (a replica acknowledges every push and heartbeat with its position), if
  the oldest push not acknowledged went out at least ``heartbeat_interval_ms`` ago (a younger one may
  just be overtaken by the ack of a heartbeat sent before it; a lost last push is followed by a
  heartbeat that long after it): the agent resends from the acknowledged key, at most once per
  ``heartbeat_interval_ms``, and with tokens only once the acknowledgement proves a push sent after
  the oldest one in flight (see "Proven acknowledgements"). The replica skips the duplicates. A loss
  the driver knows of needs no such proof: ``PushesDropped`` (it closed the socket to the replicant's
  endpoint, with what was queued there) makes the agent resend from the acknowledged key at once,
  and, with tokens, up to the highest key it pushed before without the waits of "Pushes in flight"
  and "Push delay": the replica may hold keys of pushes it read before the drop whose acknowledgement has not
  come, and only pushes sent after the drop can prove them now (see "Proven acknowledgements").
* Proven acknowledgements. The window and the node's memory budget (``core.agent_budget``) free
  a push's bytes when it is acknowledged; so does the retransmission rule resend. But a push the
  replicant has not read still sits in zmq's send queue on this core, so an acknowledgement of keys
  it never read (a hostile or broken replicant) would let the core queue any number of bytes while
  its budget counts none, and on a slow link a resend would pile a second copy behind the first.
  So an agent built with a ``token_key`` (the driver gives one to replicants of replication
  protocol 2; release 0.1.0's protocol 1 cannot read the field and is served as before: its
  acknowledgements are trusted) gives every push, heartbeats too, a *token*: its push sequence
  number and a keyed hash of it (unguessable without the key, so only read pushes can be echoed).
  The replica echoes the token of the last push it read in each acknowledgement; the pushes reach
  it in order on one connection, so a valid token of push ``n`` proves every push up to ``n`` left
  this core's queue. An acknowledgement with no valid token, or naming a key beyond the last key
  of the pushes it proves (``proven_key``), is refused: counted (``acks_refused``) and otherwise
  ignored, not even taken as a sign of life, so a replicant that lies holds its window (which the
  budget counts) until its acknowledgement timeout stops it. A resend happens only when the
  acknowledgement proves a push sent after the oldest push in flight: the replica read past it
  and does not have it, so it was lost, not still queued. Every push with entries is remembered
  (sequence number, last key) until proven, at most ``2 * window_entries_max`` of them (the
  oldest forgotten first: the later ones prove higher keys anyway). ``PushesDropped`` forgets
  them all: the pushes before it went out on a connection that is gone, so a push sent after it
  does not follow them in one stream, and its token must not prove their keys (a replicant would
  acknowledge keys it never received, and the agent never send them again). After a drop a token
  proves what the pushes since the drop carried, and what was proven before it (at least the
  acknowledged key); an acknowledgement echoing the token of a push sent before the drop proves
  only the latter.
* Read lag. An acknowledgement shows the replicant is alive, not that it keeps up: one that reads
  its queue slowly acknowledges every push it reads, each proving a push sent long ago, while the
  pushes behind it wait in zmq's send queue on this core and the agent holds its window (and the
  retention floor its acknowledged key). So an agent with tokens also measures how long the oldest
  push not proven read (heartbeats too) has waited since it was sent, and stops when that reaches
  the acknowledgement timeout (below): the replicant read no push within ``ack_timeout_ms`` of its
  sending. A catch-up on a slow link keeps going: its replica reads every push within the link's
  delay and so proves recent pushes. (A push waits behind what the agents pushing to the same
  endpoint hold unacknowledged, a window each, so a link must carry ``window_bytes_max`` per shard
  it catches up within ``ack_timeout_ms``: about 0.8 MiB/s by default; a slower one needs a
  longer timeout, ``[limits] ack_timeout_ms``, or a smaller window.) The agent remembers the send
  time of the pushes not proven read, one record per send time (``2 * window_entries_max`` at
  most; past that a push counts as sent with the last one recorded, which judges no more
  leniently). Pushes the driver dropped (``PushesDropped``) can never be read and are not waited
  for. A replicant of protocol 1 proves nothing it read: only the time of its last
  acknowledgement counts for it.
* Heartbeats. A push without entries, carrying the committed key and whether the core hears the
  sequencer, goes out whenever nothing was pushed for ``heartbeat_interval_ms``, and at once when
  ``hears_sequencer`` changes; the replica's failure detector lives on them.
* Stopping. The agent stops, for good, when the replica rejects it (it is not the watched agent any
  more, or the replica saw a gap), when the entry it must push next was trimmed from the log
  ("position trimmed: bootstrap needed"; the replica will re-bootstrap), when the log does not
  continue where it should, or when the replicant acknowledged nothing for ``ack_timeout_ms``
  (``probation_timeout_ms`` before its first acknowledgement: a live replica acknowledges within a
  round trip, and watches again when it hears nothing for its own failure timeout anyway), or read
  no push within that acknowledgement timeout of its sending (see "Read lag"), or made no progress
  for that long: no acknowledgement advanced the acknowledged key or found nothing unacknowledged
  (``last_progress_ms``). A replica that reads every push but acknowledges the same old key would
  otherwise have the window resent at each heartbeat's acknowledgement, for ever (see
  "Retransmission"); a caught-up one acknowledges each heartbeat with nothing unacknowledged, and a
  slow catch-up advances its key within the timeout.

Driver contract
---------------
1. Build the agent when a watch is accepted, then at once step ``CommittedAdvanced`` with the core's
   committed key and whether it hears the sequencer; step it again at every commit and whenever
   that flag changes. Keys lower than the last one given are ignored.
2. Deliver ``Ticked`` at least every ``heartbeat_interval_ms / 2`` (``next_deadline_ms()`` says when
   the next one matters), and ``AckReceived`` / ``RejectReceived`` for the replicant's answers
   addressed to this agent id. ``now_ms`` never decreases.
3. ``Push`` is fire-and-forget to the replicant, tagged with the agent id. ``AgentStopped`` means:
   forget this agent (and tell nobody: the replica's failure detector notices). A driver that drops
   pushes it was given and the agent may not know lost (it closes the endpoint's socket with its
   queue) steps ``PushesDropped``.
4. The ``AgentLogView`` must reflect the core's persisted log. If the log is replaced wholesale (a
   snapshot is installed), stop every agent of the shard: their positions mean nothing there.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mnesite.rlog.limits import FRAME_ENVELOPE_BYTES, require_positive_ints
from mnesite.rlog.replication import (
    AckReceived,
    AgentMode,
    AgentStopped,
    CommittedAdvanced,
    Push,
    PushesDropped,
    RejectReceived,
    Ticked,
)
from mnesite.rlog.types import Entry, PackedEntry, TxKey

STOPPED_TRIMMED = "position trimmed: bootstrap needed"
# A push's token (see "Proven acknowledgements"): its sequence number, then a keyed hash of it.
TOKEN_SEQUENCE_BYTES = 8
TOKEN_HASH_BYTES = 8
TOKEN_KEY_BYTES = 16

AgentEvent = Ticked | CommittedAdvanced | AckReceived | RejectReceived | PushesDropped
AgentEffect = Push | AgentStopped


def push_bytes_bound(push_bytes_max: int, frame_bytes_max: int | None) -> int:
    """The bytes of entries one push to a replicant holds at most (see "Frame limit"): the core's
    ``push_bytes_max``, and half the replicant's ``frame_bytes_max`` if it told it (None: it did not)."""
    if frame_bytes_max is None:
        return push_bytes_max
    return max(1, min(push_bytes_max, frame_bytes_max // 2))


def unpushable_entry(
    shard: str, tx_key: TxKey, size_bytes: int, replicant: str, frame_bytes_max: int | None
) -> str | None:
    """Why the entry at ``tx_key`` of ``size_bytes`` (``Entry.size_bytes``) can never be pushed to a
    replicant whose frames are at most ``frame_bytes_max`` (None: it did not tell; nothing is refused),
    even alone: the push's envelope around it would take it past that. None if it fits."""
    if frame_bytes_max is None or size_bytes <= frame_bytes_max - FRAME_ENVELOPE_BYTES:
        return None
    return (
        f"entry {tuple(tx_key)} of shard {shard} is {size_bytes} bytes: a push of it would not fit in a frame "
        f"of replicant {replicant}, whose [limits] frame_bytes_max is {frame_bytes_max} (entries of up to "
        f"{frame_bytes_max - FRAME_ENVELOPE_BYTES} bytes fit); raise frame_bytes_max on the replicant to at "
        f"least {size_bytes + FRAME_ENVELOPE_BYTES} (the cores' own, or more) and restart it"
    )


class AgentConfigError(ValueError):
    """A configuration or construction argument is invalid."""


class AgentLogView(Protocol):
    """Read-only view of the core's persisted log of the agent's shard."""

    def entries_after(self, key: TxKey, limit: int) -> Sequence[Entry | PackedEntry]:
        """At most ``limit`` entries with tx key > ``key``, in order (packed: ops as stored, not decoded)."""
        ...

    def trimmed_key(self) -> TxKey:
        """Key of the last entry removed by retention; ZERO_KEY if none was removed."""
        ...

    def count_after(self, key: TxKey, up_to: TxKey, limit: int) -> int:
        """How many entries have a tx key in (``key``, ``up_to``], counted up to ``limit``."""
        ...


@dataclass(frozen=True)
class AgentConfig:
    # Pushed entries not yet acknowledged; bounds what is in flight to one replicant.
    window_entries_max: int = 1000
    # Pushed bytes not yet acknowledged (``size_bytes`` of the entries).
    window_bytes_max: int = 8 * 1024 * 1024
    # The window in bytes before the replicant's first acknowledgement (it has not shown it is alive).
    probation_bytes_max: int = 8 * 1024 * 1024
    # Entries and bytes in one push; bounds the size of one message (under the replicant's frame_bytes_max).
    push_entries_max: int = 256
    push_bytes_max: int = 256 * 1024
    # Pushes with entries not yet acknowledged past which a partial push waits (see "Pushes in flight").
    pushes_in_flight_max: int = 1
    # A partial push waits this long after the previous push with entries (see "Push delay"); 0: never.
    push_delay_ms_max: int = 0
    # Bytes pushed in one step at most: bounds the work one event costs the core's loop.
    step_bytes_max: int = 256 * 1024
    heartbeat_interval_ms: int = 500
    # Committed entries ahead below which the mode is SWITCHOVER.
    switchover_entries: int = 1000
    # No acknowledgement or no progress for this long, or a push unread this long after its sending, stops it.
    ack_timeout_ms: int = 10_000
    # No first acknowledgement for this long stops the agent (at most ack_timeout_ms).
    probation_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        require_positive_ints(self, AgentConfigError, zero_allowed=("push_delay_ms_max",))  # 0: no push delay
        if self.push_delay_ms_max >= self.heartbeat_interval_ms:
            raise AgentConfigError("push_delay_ms_max must be shorter than heartbeat_interval_ms")
        if self.ack_timeout_ms <= self.heartbeat_interval_ms:
            raise AgentConfigError("ack_timeout_ms must be longer than heartbeat_interval_ms")
        if self.probation_timeout_ms <= self.heartbeat_interval_ms:
            raise AgentConfigError("probation_timeout_ms must be longer than heartbeat_interval_ms")


@dataclass(frozen=True)
class AgentStatus:
    agent_id: str
    replicant: str
    shard: str
    mode: AgentMode
    sent_key: TxKey
    acked_key: TxKey
    committed_key: TxKey
    # Committed entries not yet acknowledged; None when the keys are of different generations.
    lag_entries: int | None
    unacknowledged_entries: int
    stop_reason: str | None
    unacknowledged_bytes: int = 0
    # Acknowledgements refused: no valid token, or keys beyond the pushes it proves.
    acks_refused: int = 0


class Agent:
    """Pushes the committed entries of one shard to one replicant's watch."""

    def __init__(
        self,
        agent_id: str,
        shard: str,
        replicant: str,
        start_key: TxKey,
        log: AgentLogView,
        config: AgentConfig,
        now_ms: int,
        token_key: bytes | None = None,
        frame_bytes_max: int | None = None,
    ) -> None:
        """``token_key``: the secret of this agent's push tokens (see "Proven acknowledgements"); None:
        its pushes carry none and acknowledgements are trusted (a replicant of protocol 1).
        ``frame_bytes_max``: the replicant's, told in its watch (see "Frame limit"); None: not told."""
        if not agent_id:
            raise AgentConfigError("agent_id must not be empty")
        if token_key is not None and len(token_key) != TOKEN_KEY_BYTES:
            raise AgentConfigError(f"token_key must be {TOKEN_KEY_BYTES} bytes")
        self._token_key = token_key
        # The sequence number of the last push, and what the replicant proved it read: the highest
        # key of the pushes up to the one whose token it echoed; (sequence number, last key) of each
        # push with entries not proven yet, in order (at most _proofs_max).
        self._push_sequence = 0
        self._proven_key = start_key
        self._proofs: deque[tuple[int, TxKey]] = deque()
        self._proofs_max = 2 * config.window_entries_max
        # After PushesDropped: the highest key pushed before it, which the agent pushes again without
        # the partial-push waits (see "Retransmission"); None when no such resend is under way.
        self._resend_until: TxKey | None = None
        # The last push the replicant proved it read (in an acknowledgement the agent took), and the
        # send time of the pushes after it: (sequence number, send time) of the first push sent at
        # each time, in order, at most _proofs_max of them (see "Read lag").
        self._read_sequence = 0
        self._send_times: deque[tuple[int, int]] = deque()
        self.acks_refused = 0
        self.agent_id = agent_id
        self.shard = shard
        self.replicant = replicant
        self.config = config
        self.frame_bytes_max = frame_bytes_max
        # Bytes of entries in one push (see "Frame limit"), and why the agent stopped before an entry
        # that does not fit the replicant's frame (None: it did not).
        self._push_bytes_max = push_bytes_bound(config.push_bytes_max, frame_bytes_max)
        self.entry_refusal: str | None = None
        self._log = log
        self._now_ms = now_ms
        self._mode = AgentMode.CATCHUP
        self._sent_key = start_key
        self._acked_key = start_key
        self._pushed_max_key = start_key
        # (key, estimated bytes) pushed and not yet acknowledged, in order; this is the window.
        self._unacknowledged: deque[tuple[TxKey, int]] = deque()
        self._unacknowledged_bytes = 0
        # The last key, send time and sequence number of each push with entries not yet acknowledged,
        # in order (see "Pushes in flight" and "Retransmission"); at most window_entries_max of them
        # (a push holds at least one entry of the window).
        self._pushes_in_flight: deque[tuple[TxKey, int, int]] = deque()
        # Entries read per log read: sized from the entries seen so far (the first read takes five).
        self._entry_bytes_estimate = max(1, self._push_bytes_max // 4)
        # Entries in the last push: a read takes at most twice as many, so that a log whose first
        # entries are tiny (a no-op, a table creation) and the next ones large is not read far
        # beyond one push on the strength of the tiny ones.
        self._entries_pushed_last = config.push_entries_max
        self._committed_key = start_key
        self._hears_sequencer = False
        self._last_push_ms: int | None = None
        self._last_entries_push_ms: int | None = None  # the previous push with entries (see "Push delay")
        self._last_ack_ms = now_ms
        # The last acknowledgement that showed progress: it advanced, or found nothing unacknowledged.
        self._last_progress_ms = now_ms
        self._acknowledged = False  # the replicant acknowledged at least once: the whole window opens
        self._mode_counted_at = start_key  # sent_key when entries ahead were last counted
        self._last_rewind_ms: int | None = None
        self._stop_reason: str | None = None
        self._out: list[AgentEffect] = []
        self._step_bytes_max = config.step_bytes_max

    # ------------------------------------------------------------ queries

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    @property
    def mode(self) -> AgentMode:
        return self._mode

    def status(self) -> AgentStatus:
        lag = None
        if self._committed_key.generation == self._acked_key.generation:
            lag = self._committed_key.counter - self._acked_key.counter
        return AgentStatus(
            agent_id=self.agent_id,
            replicant=self.replicant,
            shard=self.shard,
            mode=self._mode,
            sent_key=self._sent_key,
            acked_key=self._acked_key,
            committed_key=self._committed_key,
            lag_entries=lag,
            unacknowledged_entries=len(self._unacknowledged),
            stop_reason=self._stop_reason,
            unacknowledged_bytes=self._unacknowledged_bytes,
            acks_refused=self.acks_refused,
        )

    @property
    def unacknowledged_bytes(self) -> int:
        """Bytes pushed and not acknowledged: what this agent holds of the node's memory budget."""
        return self._unacknowledged_bytes

    @property
    def acknowledged(self) -> bool:
        """The replicant acknowledged at least once (with a token that proves it, when the agent has tokens)."""
        return self._acknowledged

    @property
    def last_ack_ms(self) -> int:
        """When the replicant last acknowledged (the agent's creation until it does)."""
        return self._last_ack_ms

    @property
    def last_progress_ms(self) -> int:
        """When the replicant last showed progress (the agent's creation until it does): an acknowledgement
        taken that advanced the acknowledged key, or that found nothing unacknowledged (a caught-up
        replica acknowledges each heartbeat with the key it has). One that re-acknowledges an old key
        while pushes wait is no progress: the memory budget's liveness (``core.agent_budget``), and
        none for ``ack_timeout_ms`` stops the agent (see "Stopping")."""
        return self._last_progress_ms

    @property
    def wants_to_push(self) -> bool:
        """Committed entries wait and the window has room: a step with a push budget would push."""
        return self._can_push()

    def next_deadline_ms(self, push_room: bool = True) -> int:
        """The earliest time at which a ``Ticked`` may change something; ``push_room=False``: the driver
        has no room for a push now (its memory budget is spent), so only heartbeats and the
        acknowledgement timeout are due (a freed budget makes the agent due again)."""
        if self.stopped:
            return self._now_ms + self._ack_timeout_ms()
        if self._last_push_ms is None or (push_room and self._can_push()):
            return self._now_ms
        # Progress is an acknowledgement: it is never later than the last one, so it is due first.
        deadline = min(
            self._last_push_ms + self.config.heartbeat_interval_ms, self._last_progress_ms + self._ack_timeout_ms()
        )
        unread_since_ms = self._oldest_unread_push_ms()
        if unread_since_ms is not None:
            deadline = min(deadline, unread_since_ms + self._ack_timeout_ms())
        delayed_until = self._partial_push_delayed_until()
        if push_room and delayed_until is not None and self._can_push(ignore_delay=True):
            deadline = min(deadline, delayed_until)
        return deadline

    # ------------------------------------------------------------ the entry point

    def step(self, event: AgentEvent, now_ms: int, push_bytes_max: int | None = None) -> list[AgentEffect]:
        """Step one event; ``push_bytes_max`` lowers ``step_bytes_max`` for this step (0: push nothing,
        the driver's budget for this loop turn is spent; the event is still taken into account)."""
        if now_ms < self._now_ms:
            raise ValueError(f"time went backwards: {now_ms} < {self._now_ms}")
        self._now_ms = now_ms
        self._step_bytes_max = self.config.step_bytes_max
        if push_bytes_max is not None:
            self._step_bytes_max = max(0, min(push_bytes_max, self.config.step_bytes_max))
        self._out = []
        if self.stopped:
            return []
        if isinstance(event, Ticked):
            self._on_tick()
        elif isinstance(event, CommittedAdvanced):
            self._on_committed(event)
        elif isinstance(event, AckReceived):
            self._on_ack(event.applied_key, event.token)
        elif isinstance(event, RejectReceived):
            self._stop(f"rejected by the replicant: {event.reason}")
        elif isinstance(event, PushesDropped):
            self._resend_from_acknowledged()
            # What was pushed so far can no longer be read: the read lag is measured from the next push.
            self._read(self._push_sequence)
            # Nor proven by a later push's token: the pushes after the drop do not follow them on one
            # connection (see "Proven acknowledgements"). What was proven already stays proven.
            self._proofs.clear()
            # The replica may hold keys up to the highest pushed (read before the drop, acknowledgement
            # not come yet): pushed again at once, or a partial push waiting for the acknowledgement of
            # a full one would wait until the ack timeout stops the agent, each acknowledgement naming
            # a key no push since proves (refused). Without tokens its acknowledgements are taken.
            if self._token_key is not None and self._pushed_max_key > self._sent_key:
                self._resend_until = self._pushed_max_key
            self._pump()
        else:
            raise TypeError(f"not an agent event: {event!r}")
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ events

    def _on_tick(self) -> None:
        if self._now_ms - self._last_ack_ms >= self._ack_timeout_ms():
            self._stop(
                f"replicant acknowledged nothing for {self._ack_timeout_ms()} ms "
                f"({len(self._unacknowledged)} entries unacknowledged)"
            )
            return
        unread_since_ms = self._oldest_unread_push_ms()
        if unread_since_ms is not None and self._now_ms - unread_since_ms >= self._ack_timeout_ms():
            self._stop(
                f"replicant read no push for {self._ack_timeout_ms()} ms after it was sent "
                f"({self._push_sequence - self._read_sequence} pushes unread, "
                f"{len(self._unacknowledged)} entries unacknowledged)"
            )
            return
        if self._now_ms - self._last_progress_ms >= self._ack_timeout_ms():
            # It acknowledges, but an old key while entries wait: each heartbeat's acknowledgement
            # would resend the window, for ever (see "Stopping").
            self._stop(
                f"replicant made no progress for {self._ack_timeout_ms()} ms (it acknowledges "
                f"{self._acked_key} again while {len(self._unacknowledged)} entries are unacknowledged)"
            )
            return
        self._pump()
        if not self.stopped and (
            self._last_push_ms is None or self._now_ms - self._last_push_ms >= self.config.heartbeat_interval_ms
        ):
            self._push(())

    def _on_committed(self, event: CommittedAdvanced) -> None:
        flag_changed = event.hears_sequencer != self._hears_sequencer
        self._hears_sequencer = event.hears_sequencer
        if event.committed_key > self._committed_key:
            self._committed_key = event.committed_key
        pushed = self._pump()
        if flag_changed and not pushed and not self.stopped:
            self._push(())

    def _on_ack(self, key: TxKey, token: bytes | None) -> None:
        proven_sequence = None
        if self._token_key is not None:
            proven_sequence = self._proven_sequence(token)
            if proven_sequence is None or key > self._prove(proven_sequence):
                # It proves no push read, or claims keys beyond those it proves: the bytes may still
                # sit in zmq here (see "Proven acknowledgements"). Refused, and not a sign of life.
                self.acks_refused += 1
                return
        self._last_ack_ms = self._now_ms
        self._acknowledged = True
        if key > self._acked_key or not self._unacknowledged:
            self._last_progress_ms = self._now_ms
        if proven_sequence is not None and proven_sequence > self._read_sequence:
            self._read(proven_sequence)
        if key > self._acked_key:
            if key > self._pushed_max_key:
                # Acknowledging what was never pushed: a confused or foreign replica.
                self._stop(f"replicant acknowledged {key}, beyond the last pushed key {self._pushed_max_key}")
                return
            self._acked_key = key
            # After a resend the replica may acknowledge a push sent before it: it has up to ``key``.
            self._sent_key = max(self._sent_key, key)
            while self._unacknowledged and self._unacknowledged[0][0] <= key:
                self._unacknowledged_bytes -= self._unacknowledged.popleft()[1]
            while self._pushes_in_flight and self._pushes_in_flight[0][0] <= key:
                self._pushes_in_flight.popleft()
        elif (
            self._pushes_in_flight
            and self._now_ms - self._pushes_in_flight[0][1] >= self.config.heartbeat_interval_ms
            # With tokens: only once the replica proved it read a push sent after the oldest one in
            # flight (that one was lost, not still queued: no second copy behind the first).
            and (proven_sequence is None or proven_sequence > self._pushes_in_flight[0][2])
            and (
                self._last_rewind_ms is None or self._now_ms - self._last_rewind_ms >= self.config.heartbeat_interval_ms
            )
        ):
            # The replica is at acked_key and did not get what followed: resend from there. Only once
            # the oldest push not acknowledged went out a heartbeat interval ago: a younger one may
            # simply be overtaken by the ack of a heartbeat sent before it, while a lost push is
            # noticed by the ack of the heartbeat that follows it (sent a heartbeat interval after
            # the last push).
            self._last_rewind_ms = self._now_ms
            self._resend_from_acknowledged()
        self._pump()

    def _resend_from_acknowledged(self) -> None:
        """What was pushed after the acknowledged key is lost: the window empties and the next push
        follows the acknowledged key (the replica skips what it may hold already)."""
        self._sent_key = self._acked_key
        self._unacknowledged.clear()
        self._unacknowledged_bytes = 0
        self._pushes_in_flight.clear()

    # ------------------------------------------------------------ pushing

    def _stop(self, reason: str) -> None:
        self._stop_reason = reason
        self._mode = AgentMode.STOPPED
        self._out.append(AgentStopped(reason))

    def _push(self, entries: tuple[Entry | PackedEntry, ...], size_bytes: int = 0) -> None:
        self._push_sequence += 1
        token = None
        if self._token_key is not None:
            token = self._push_sequence.to_bytes(TOKEN_SEQUENCE_BYTES, "big") + self._token_hash(self._push_sequence)
            if entries:
                if len(self._proofs) >= self._proofs_max:
                    self._proofs.popleft()
                self._proofs.append((self._push_sequence, entries[-1].tx_key))
            # One record per send time; past the bound a push counts as sent when the last one
            # recorded was (earlier, so the read lag is judged no more leniently).
            times = self._send_times
            if (not times or times[-1][1] != self._now_ms) and len(times) < self._proofs_max:
                times.append((self._push_sequence, self._now_ms))
        self._out.append(Push(entries, self._committed_key, self._hears_sequencer, size_bytes, token))
        self._last_push_ms = self._now_ms
        if entries:
            self._last_entries_push_ms = self._now_ms

    def _token_hash(self, sequence: int) -> bytes:
        return hashlib.blake2b(
            sequence.to_bytes(TOKEN_SEQUENCE_BYTES, "big"), key=self._token_key or b"", digest_size=TOKEN_HASH_BYTES
        ).digest()

    def _proven_sequence(self, token: bytes | None) -> int | None:
        """The sequence number of the push whose token ``token`` is (untrusted bytes); None if it is none."""
        if token is None or len(token) != TOKEN_SEQUENCE_BYTES + TOKEN_HASH_BYTES:
            return None
        sequence = int.from_bytes(token[:TOKEN_SEQUENCE_BYTES], "big")
        if not 1 <= sequence <= self._push_sequence:
            return None
        if not hmac.compare_digest(token[TOKEN_SEQUENCE_BYTES:], self._token_hash(sequence)):
            return None
        return sequence

    def _read(self, sequence: int) -> None:
        """The pushes up to ``sequence`` were read (or can never be): forget their send times."""
        self._read_sequence = sequence
        if sequence >= self._push_sequence:
            self._send_times.clear()
            return
        # The first record left is the one of the push after ``sequence``: its send time is its own.
        while len(self._send_times) > 1 and self._send_times[1][0] <= sequence + 1:
            self._send_times.popleft()

    def _oldest_unread_push_ms(self) -> int | None:
        """When the oldest push not proven read was sent; None if every push was, or without tokens."""
        if not self._send_times:
            return None
        return self._send_times[0][1]

    def _prove(self, sequence: int) -> TxKey:
        """The replica read every push up to ``sequence``: the highest key it may hold now."""
        while self._proofs and self._proofs[0][0] <= sequence:
            self._proven_key = max(self._proven_key, self._proofs.popleft()[1])
        return self._proven_key

    def _ack_timeout_ms(self) -> int:
        if self._acknowledged:
            return self.config.ack_timeout_ms
        return min(self.config.ack_timeout_ms, self.config.probation_timeout_ms)

    def _window_bytes_max(self) -> int:
        if self._acknowledged:
            return self.config.window_bytes_max
        return min(self.config.window_bytes_max, self.config.probation_bytes_max)

    def _can_push(self, ignore_delay: bool = False) -> bool:
        """Committed entries wait, the window has room for at least one more, and the pushes in flight
        and the push delay let the next one go (``ignore_delay``: all of that but the push delay)."""
        return (
            not self.stopped
            and self._sent_key < self._committed_key
            and len(self._unacknowledged) < self.config.window_entries_max
            and self._unacknowledged_bytes < self._window_bytes_max()
            and (
                (
                    len(self._pushes_in_flight) < self.config.pushes_in_flight_max
                    and (ignore_delay or self._partial_push_delayed_until() is None)
                )
                or self._full_push_waits()
                or self._resending_dropped()
            )
        )

    def _resending_dropped(self) -> bool:
        """Keys pushed before a ``PushesDropped`` are not pushed again yet (see "Retransmission")."""
        return self._resend_until is not None and self._sent_key < self._resend_until

    def _partial_push_delayed_until(self) -> int | None:
        """When the push delay lets a partial push go, if that is later than now (see "Push delay")."""
        if self._last_entries_push_ms is None:
            return None
        due = self._last_entries_push_ms + self.config.push_delay_ms_max
        return due if due > self._now_ms else None

    def _full_push_waits(self) -> bool:
        """Enough committed entries wait to fill a push (see "Pushes in flight"). Judged without
        reading the log: by count within a generation and the largest entry of the last push; across
        generations the count would read the log, so the push goes (a rare moment, after an election)."""
        if self._sent_key.generation != self._committed_key.generation:
            return True
        waiting = self._committed_key.counter - self._sent_key.counter
        return waiting >= self.config.push_entries_max or waiting * self._entry_bytes_estimate >= self._push_bytes_max

    def _pump(self) -> bool:
        """Push committed entries after ``sent_key`` while the window has room, up to ``step_bytes_max``
        bytes in this step; True if any was pushed.

        The driver steps the agent again when the replicant acknowledges, when a commit arrives, or at
        the next tick, which is due at once while ``_can_push()`` (see "Paced by acknowledgements").
        """
        pushed_bytes = 0
        # Every round pushes at least one entry (or stops the agent), so the window bounds the loop.
        while self._can_push() and pushed_bytes < self._step_bytes_max:
            size = self._push_next()
            if size is None:
                break
            pushed_bytes += size
        if self._resend_until is not None and self._sent_key >= self._resend_until:
            self._resend_until = None  # the resend after a drop is done (or acknowledged): the usual waits
        self._update_mode()
        return pushed_bytes > 0

    def _push_next(self) -> int | None:
        """Push one message after ``sent_key``; its bytes, or None if the agent stopped."""
        if self._sent_key < self._log.trimmed_key():
            self._stop(STOPPED_TRIMMED)
            return None
        room_entries = min(self.config.push_entries_max, self.config.window_entries_max - len(self._unacknowledged))
        room_bytes = min(self._push_bytes_max, self._window_bytes_max() - self._unacknowledged_bytes)
        batch: list[tuple[Entry | PackedEntry, int]] = []
        batch_bytes = 0
        # Read in chunks until the push is full or every committed entry is in: each chunk about as
        # many entries as fit in what is left of room_bytes (judging by the entries seen so far), and
        # at most twice as many as the last push held (the first chunk) or as this push holds so
        # far. A push after a push delay that follows single-entry pushes still carries every entry.
        while len(batch) < room_entries:
            after = batch[-1][0].tx_key if batch else self._sent_key
            read_limit = max(
                1,
                min(
                    room_entries - len(batch),
                    (room_bytes - batch_bytes) // self._entry_bytes_estimate + 1,
                    2 * (len(batch) or self._entries_pushed_last),
                ),
            )
            read = [
                entry for entry in self._log.entries_after(after, read_limit) if entry.tx_key <= self._committed_key
            ]
            if not batch and (not read or read[0].prev != self._sent_key):
                self._stop(
                    f"the log does not continue after {self._sent_key} up to the committed key {self._committed_key}"
                )
                return None
            full = False
            for entry in read:
                if batch and entry.prev != batch[-1][0].tx_key:
                    self._stop(f"the log is not contiguous at {entry.tx_key}")
                    return None
                size = entry.size_bytes
                if batch and batch_bytes + size > room_bytes:
                    full = True  # the first entry always goes, alone if it is larger than a push
                    break
                refusal = unpushable_entry(self.shard, entry.tx_key, size, self.replicant, self.frame_bytes_max)
                if refusal is not None:
                    if batch:
                        full = True  # the entries before it go; the next push stops here
                        break
                    self.entry_refusal = refusal
                    self._stop(refusal)
                    return None
                batch.append((entry, size))
                batch_bytes += size
            self._entry_bytes_estimate = max(1, max(size for _, size in batch))
            if full or len(read) < read_limit or batch[-1][0].tx_key >= self._committed_key:
                break
        self._entries_pushed_last = len(batch)
        self._push(tuple(entry for entry, _ in batch), batch_bytes)
        self._unacknowledged.extend((entry.tx_key, size) for entry, size in batch)
        self._unacknowledged_bytes += batch_bytes
        self._sent_key = batch[-1][0].tx_key
        self._pushes_in_flight.append((self._sent_key, self._now_ms, self._push_sequence))
        self._pushed_max_key = max(self._pushed_max_key, self._sent_key)
        return batch_bytes

    def _update_mode(self) -> None:
        if self._mode in (AgentMode.NORMAL, AgentMode.STOPPED):
            return
        if self._sent_key >= self._committed_key:
            self._mode = AgentMode.NORMAL
        elif self._mode is AgentMode.CATCHUP and self._sent_key != self._mode_counted_at:
            # Counted only once a push moved sent_key (a commit alone only adds entries ahead): a
            # new watch, or an agent waiting for its window or the node's memory budget, is stepped
            # often without pushing, and a count across generations reads the log.
            self._mode_counted_at = self._sent_key
            if self._entries_ahead() <= self.config.switchover_entries:
                self._mode = AgentMode.SWITCHOVER

    def _entries_ahead(self) -> int:
        """Committed entries after ``sent_key``, counted up to ``switchover_entries + 1``."""
        if self._sent_key.generation == self._committed_key.generation:
            return self._committed_key.counter - self._sent_key.counter
        # Counted, not read: reading up to switchover_entries large entries at every push would
        # cost more than the pushes.
        return self._log.count_after(self._sent_key, self._committed_key, self.config.switchover_entries + 1)
