"""The core-side pusher of one replicant's watch of one shard (Mria's agent, with catch-up from the rlog).

Theory of operation
-------------------
When a replica's watch is accepted, the core's RLOG server builds one ``Agent`` with a unique
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
* Window. At most ``window_entries_max`` pushed entries are unacknowledged; the replica acknowledges
  with its applied (or spilled) key. A replica that stops acknowledging (its spill is full) makes the
  window fill, which stops the pushes: that is the backpressure.
* Retransmission. An acknowledgement that does not advance while entries are unacknowledged means
  the replica lost a push (a replica acknowledges every push and heartbeat with its position): the
  agent resends from the acknowledged key, at most once per ``heartbeat_interval_ms``. The replica
  skips the duplicates.
* Heartbeats. A push without entries, carrying the committed key and whether the core hears the
  sequencer, goes out whenever nothing was pushed for ``heartbeat_interval_ms``, and at once when
  ``hears_sequencer`` changes; the replica's failure detector lives on them.
* Stopping. The agent stops, for good, when the replica rejects it (it is not the watched agent any
  more, or the replica saw a gap), when the entry it must push next was trimmed from the log
  ("position trimmed: bootstrap needed"; the replica will re-bootstrap), when the log does not
  continue where it should, or when the replicant acknowledged nothing for ``ack_timeout_ms``.

Driver contract
---------------
1. Build the agent when a watch is accepted, then at once step ``CommittedAdvanced`` with the core's
   committed key and whether it hears the sequencer; step it again at every commit and whenever
   that flag changes. Keys lower than the last one given are ignored.
2. Deliver ``Ticked`` at least every ``heartbeat_interval_ms / 2`` (``next_deadline_ms()`` says when
   the next one matters), and ``AckReceived`` / ``RejectReceived`` for the replicant's answers
   addressed to this agent id. ``now_ms`` never decreases.
3. ``Push`` is fire-and-forget to the replicant, tagged with the agent id. ``AgentStopped`` means:
   forget this agent (and tell nobody: the replica's failure detector notices).
4. The ``AgentLogView`` must reflect the core's persisted log. If the log is replaced wholesale (a
   snapshot is installed), stop every agent of the shard: their positions mean nothing there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mnesite.rlog.limits import require_positive_ints
from mnesite.rlog.replication import (
    AckReceived,
    AgentMode,
    AgentStopped,
    CommittedAdvanced,
    Push,
    RejectReceived,
    Ticked,
)
from mnesite.rlog.types import Entry, TxKey

STOPPED_TRIMMED = "position trimmed: bootstrap needed"

AgentEvent = Ticked | CommittedAdvanced | AckReceived | RejectReceived
AgentEffect = Push | AgentStopped


class AgentConfigError(ValueError):
    """A configuration or construction argument is invalid."""


class AgentLogView(Protocol):
    """Read-only view of the core's persisted log of the agent's shard."""

    def entries_after(self, key: TxKey, limit: int) -> Sequence[Entry]:
        """At most ``limit`` entries with tx key > ``key``, in order."""
        ...

    def trimmed_key(self) -> TxKey:
        """Key of the last entry removed by retention; ZERO_KEY if none was removed."""
        ...


@dataclass(frozen=True)
class AgentConfig:
    # Pushed entries not yet acknowledged; bounds what is in flight to one replicant.
    window_entries_max: int = 1000
    # Entries in one push; bounds the size of one message.
    push_entries_max: int = 256
    heartbeat_interval_ms: int = 500
    # Committed entries ahead below which the mode is SWITCHOVER.
    switchover_entries: int = 1000
    # No acknowledgement for this long stops the agent.
    ack_timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        require_positive_ints(self, AgentConfigError)
        if self.ack_timeout_ms <= self.heartbeat_interval_ms:
            raise AgentConfigError("ack_timeout_ms must be longer than heartbeat_interval_ms")


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
    ) -> None:
        if not agent_id:
            raise AgentConfigError("agent_id must not be empty")
        self.agent_id = agent_id
        self.shard = shard
        self.replicant = replicant
        self.config = config
        self._log = log
        self._now_ms = now_ms
        self._mode = AgentMode.CATCHUP
        self._sent_key = start_key
        self._acked_key = start_key
        self._pushed_max_key = start_key
        # Keys pushed and not yet acknowledged, in order; its length is the window.
        self._unacknowledged: deque[TxKey] = deque()
        self._committed_key = start_key
        self._hears_sequencer = False
        self._last_push_ms: int | None = None
        self._last_ack_ms = now_ms
        self._last_rewind_ms: int | None = None
        self._stop_reason: str | None = None
        self._out: list[AgentEffect] = []

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
        )

    def next_deadline_ms(self) -> int:
        """The earliest time at which a ``Ticked`` may change something."""
        if self.stopped:
            return self._now_ms + self.config.ack_timeout_ms
        if self._last_push_ms is None:
            return self._now_ms
        return min(
            self._last_push_ms + self.config.heartbeat_interval_ms, self._last_ack_ms + self.config.ack_timeout_ms
        )

    # ------------------------------------------------------------ the entry point

    def step(self, event: AgentEvent, now_ms: int) -> list[AgentEffect]:
        if now_ms < self._now_ms:
            raise ValueError(f"time went backwards: {now_ms} < {self._now_ms}")
        self._now_ms = now_ms
        self._out = []
        if self.stopped:
            return []
        if isinstance(event, Ticked):
            self._on_tick()
        elif isinstance(event, CommittedAdvanced):
            self._on_committed(event)
        elif isinstance(event, AckReceived):
            self._on_ack(event.applied_key)
        elif isinstance(event, RejectReceived):
            self._stop(f"rejected by the replicant: {event.reason}")
        else:
            raise TypeError(f"not an agent event: {event!r}")
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ events

    def _on_tick(self) -> None:
        if self._now_ms - self._last_ack_ms >= self.config.ack_timeout_ms:
            self._stop(
                f"replicant acknowledged nothing for {self.config.ack_timeout_ms} ms "
                f"({len(self._unacknowledged)} entries unacknowledged)"
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

    def _on_ack(self, key: TxKey) -> None:
        self._last_ack_ms = self._now_ms
        if key > self._acked_key:
            if key > self._pushed_max_key:
                # Acknowledging what was never pushed: a confused or foreign replica.
                self._stop(f"replicant acknowledged {key}, beyond the last pushed key {self._pushed_max_key}")
                return
            self._acked_key = key
            # After a resend the replica may acknowledge a push sent before it: it has up to ``key``.
            self._sent_key = max(self._sent_key, key)
            while self._unacknowledged and self._unacknowledged[0] <= key:
                self._unacknowledged.popleft()
        elif self._unacknowledged and (
            self._last_rewind_ms is None or self._now_ms - self._last_rewind_ms >= self.config.heartbeat_interval_ms
        ):
            # The replica is at acked_key and did not get what followed: resend from there.
            self._last_rewind_ms = self._now_ms
            self._sent_key = self._acked_key
            self._unacknowledged.clear()
        self._pump()

    # ------------------------------------------------------------ pushing

    def _stop(self, reason: str) -> None:
        self._stop_reason = reason
        self._mode = AgentMode.STOPPED
        self._out.append(AgentStopped(reason))

    def _push(self, entries: tuple[Entry, ...]) -> None:
        self._out.append(Push(entries, self._committed_key, self._hears_sequencer))
        self._last_push_ms = self._now_ms

    def _pump(self) -> bool:
        """Push committed entries after ``sent_key`` while the window has room; True if any was pushed."""
        pushed = False
        # Each round pushes at least one entry into the window, so this loop is bounded by it.
        while (
            not self.stopped
            and self._sent_key < self._committed_key
            and len(self._unacknowledged) < self.config.window_entries_max
        ):
            if self._sent_key < self._log.trimmed_key():
                self._stop(STOPPED_TRIMMED)
                break
            room = min(self.config.push_entries_max, self.config.window_entries_max - len(self._unacknowledged))
            batch = tuple(
                entry for entry in self._log.entries_after(self._sent_key, room) if entry.tx_key <= self._committed_key
            )
            if not batch or batch[0].prev != self._sent_key:
                self._stop(
                    f"the log does not continue after {self._sent_key} up to the committed key {self._committed_key}"
                )
                break
            for previous, entry in zip(batch, batch[1:], strict=False):
                if entry.prev != previous.tx_key:
                    self._stop(f"the log is not contiguous at {entry.tx_key}")
                    return pushed
            self._push(batch)
            self._unacknowledged.extend(entry.tx_key for entry in batch)
            self._sent_key = batch[-1].tx_key
            self._pushed_max_key = max(self._pushed_max_key, self._sent_key)
            pushed = True
        self._update_mode()
        return pushed

    def _update_mode(self) -> None:
        if self._mode in (AgentMode.NORMAL, AgentMode.STOPPED):
            return
        if self._sent_key >= self._committed_key:
            self._mode = AgentMode.NORMAL
        elif self._mode is AgentMode.CATCHUP and self._entries_ahead() <= self.config.switchover_entries:
            self._mode = AgentMode.SWITCHOVER

    def _entries_ahead(self) -> int:
        """Committed entries after ``sent_key``, counted up to ``switchover_entries + 1``."""
        if self._sent_key.generation == self._committed_key.generation:
            return self._committed_key.counter - self._sent_key.counter
        limit = self.config.switchover_entries + 1
        return sum(1 for entry in self._log.entries_after(self._sent_key, limit) if entry.tx_key <= self._committed_key)
