"""The agent server of a core: answers replicants' watches and drives one ``Agent`` per watch.

Theory of operation
-------------------
A replicant sends ``watch(shard, replicant, endpoint, from_key, from_digest, protocol, watch_id)``.
Whether and how it is served (protocol version, supersession, the agents one replicant may hold,
eviction of silent watches, resume or bootstrap) is decided by the pure rules of ``core.watch``;
this adapter applies them.

Every push of an agent carries the answer to the watch that created it (agent id, mode, start key
and digest, the replica's ``watch_id``): the answer goes back on the replicant's request
connection and the pushes on another one, so the first push may arrive first, and the replica
takes it as the answer instead of rejecting a new agent as a zombie.

Agent ids. An agent id is the core's name (cut to leave room) and 16 hex digits drawn from
``random_bytes``, the operating system's secure source (``secrets.token_bytes``): at most
``NAME_CHARS_MAX`` characters, the wire's name type. Unguessable: without ``[security]`` anyone who
knows an agent id can stop that agent (a ``push_ack`` rejecting it), and the ids are told to every
replicant; a Mersenne Twister's ids (``random.Random``) gave its whole state after about 312 of
them, hence every later id.

The protocol decisions live in the pure ``core.agent.Agent``; this adapter creates agents, feeds
them the shard's committed key and the replicant's acks, and turns their ``Push`` effects into
frames for the node to send. It holds no socket: the node sends what ``drain`` returns.

Endpoints. The node sends a watch's pushes through its DEALER to the watch's endpoint, the one it
also reaches a core at when the endpoint is a core's: a watch naming a core's endpoint (its own or a
peer's) is refused, or its pushes would queue in front of that core's appends and heartbeats
(DESIGN invariant 11) in a socket that is never closed for them.

Tokens. An agent of a watch naming replication protocol 2 gets a random ``token_key``
(``core.versions.watch_proves_acknowledgements``): its pushes carry a ``token`` and its
acknowledgements must echo one (``core.agent``, "Proven acknowledgements"). The key comes from
``random_bytes`` too: a secure source's outputs tell nothing of its others, so the agent ids a
replicant is told give away no key (a Mersenne Twister's would: its whole state follows from about
624 of its outputs). The simulator passes its seeded source for both. A watch's ``acknowledged``
flag, which the eviction rules read, is the agent's own: set only by an acknowledgement the agent
took. Refused ones are counted in ``acks_refused`` (``status``).

Frame limit. A watch that tells the replicant's ``frame_bytes_max`` (protocol 2) gets an agent that
pushes within it (``core.agent``, "Frame limit"). If the first entry that agent must push cannot fit
a push to that replicant at all, the watch is refused ``too_large`` with the agent's reason (the
entry's key and size, the replicant's limit, what to raise it to): the replicant shows it and
retries by its failover rule, and a push it could never read is never sent. An agent that stops so
later, part-way through its stream (the entries before that one pushed), ends like any stopped agent;
its reason is kept in ``entry_refusals`` for the node to log (``take_entry_refusals``): that replicant's
next watch is refused, but the stop itself would otherwise be said nowhere on the core.

Memory. The bytes all agents hold (pushed, not acknowledged) are accounted in one
``core.agent_budget.AgentMemoryBudget`` of ``agents_bytes_max``: after every step of an agent its
bytes are recorded, and an agent that ends is released. An agent is stepped with no push budget
while the memory budget is spent; if it then wants to push, the budget's rule names the silent
agents to evict, which this adapter stops (their frames not yet drained are dropped; the node closes
their endpoints' sockets), and the agent is ticked again to push in the room made. An agent that ends
for any reason has its endpoint's socket closed unless an agent live by the budget's rule
(``core.agent_budget``, "Silence") still uses it: zmq's queue there is then being delivered, while
the frames of a silent endpoint would stay queued with nothing counting them. A socket closed so
takes the pushes queued in it of every agent that uses its endpoint: each such agent is stepped
``PushesDropped`` and resends from its acknowledged key (``_reset_endpoint``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from mnesite.core.agent import TOKEN_KEY_BYTES, Agent, AgentConfig
from mnesite.core.agent_budget import SILENT_HEARTBEATS, AgentMemoryBudget, AgentUse, silence_began_ms
from mnesite.core.versions import watch_protocol_refusal, watch_proves_acknowledgements
from mnesite.core.watch import (
    WatchRefusedError,
    agent_to_evict,
    check_not_a_core_endpoint,
    check_replicant_watches,
    check_watch_request,
    decide_watch,
    superseded_agents,
)
from mnesite.rlog import messages
from mnesite.rlog.config import Limits
from mnesite.rlog.messages import Message
from mnesite.rlog.replication import (
    AckReceived,
    AgentStopped,
    CommittedAdvanced,
    Push,
    PushesDropped,
    RejectReceived,
    Ticked,
)
from mnesite.rlog.types import NAME_CHARS_MAX, TxKey
from mnesite.rlog.versions import THIS_RELEASE, Announcement

_ENCODER = msgspec.msgpack.Encoder()
AGENTS_MAX = 1000
AGENT_ID_RANDOM_BYTES = 8  # 64 unguessable bits in every agent id (see "Agent ids")
AGENTS_BYTES_MAX = Limits.agents_bytes_max  # the default of [limits] agents_bytes_max
REPLICANT_WATCHES_MAX = Limits.replicant_watches_max  # the default of [limits] replicant_watches_max


@dataclass
class Watch:
    agent: Agent
    endpoint: str
    replicant: str
    shard: str
    # The answer to the watch, repeated in every push (see the theory of operation).
    answer: dict[str, Any]
    protocol: int = 1  # the replication protocol its watch named (rlog.versions)

    @property
    def acknowledged(self) -> bool:
        """The replicant acknowledged at least once (with tokens: an acknowledgement that proves a read)."""
        return self.agent.acknowledged


@dataclass(frozen=True)
class EntryRefused:
    """An agent stopped before an entry its replicant's frame cannot hold (``core.agent``, "Frame
    limit"), after pushing up to ``sent``; ``refusal`` names the entry's key and size and the limit."""

    agent: str
    replicant: str
    shard: str
    sent: TxKey
    refusal: str


class AgentServer:
    def __init__(
        self,
        core_name: str,
        config: AgentConfig | None = None,
        watches_max: int = AGENTS_MAX,
        agents_bytes_max: int = AGENTS_BYTES_MAX,
        versions: Announcement = THIS_RELEASE,
        replicant_watches_max: int = REPLICANT_WATCHES_MAX,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        """``random_bytes(n)``: ``n`` unguessable bytes, for agent ids and token keys (see "Agent ids" and
        "Tokens": a secure source, whose outputs a replicant sees tell nothing of the others)."""
        self.core_name = core_name
        self.random_bytes = random_bytes
        self.versions = versions
        self.watches_max = watches_max
        self.replicant_watches_max = replicant_watches_max
        self.config = config or AgentConfig()
        self.budget = AgentMemoryBudget(agents_bytes_max, SILENT_HEARTBEATS * self.config.heartbeat_interval_ms)
        # Agents that want to push but found the memory budget spent and nobody to evict.
        self._waiting: set[str] = set()
        # Endpoints whose socket the node must close now (see ``_forget``); taken by ``endpoints_to_reset``.
        self._reset: set[str] = set()
        # The latest time any entry point was given: an agent stepped outside one (``_forget``) gets it.
        self._now_ms = 0
        self.watches: dict[str, Watch] = {}
        self.outbox: list[tuple[str, Message]] = []
        # Acknowledgements refused by agents since the start: they proved no push read, or claimed
        # keys beyond those they proved (core.agent, "Proven acknowledgements").
        self.acks_refused = 0
        # Agents stopped part-way through their stream at an entry too large for their replicant, since
        # the node last took them: one each (an agent stops once), at most an agent per watch served.
        self.entry_refusals: list[EntryRefused] = []
        # Bytes all agents may push in one loop turn (the driver calls ``begin_turn``): serving
        # replicants costs the core's loop a bounded time per turn, whatever the acknowledgements.
        self.turn_push_bytes_max = self.config.step_bytes_max
        self._turn_pushed_bytes = 0
        # The agents of one shard whose replicants keep up push the same entries after a commit:
        # each run of entries is encoded once per loop turn and its msgpack bytes are spliced into
        # every push that carries it (``msgspec.Raw``: the frame's bytes are what encoding the list
        # would give). Keyed by shard, first entry's prev, last entry's key and count: committed
        # entries never change at their keys. Cleared every turn (at most a turn's pushed bytes)
        # and when a shard's log is replaced.
        self._encoded_entries: dict[tuple[str, TxKey, TxKey, int], msgspec.Raw] = {}

    def begin_turn(self) -> None:
        self._turn_pushed_bytes = 0
        self._encoded_entries.clear()

    def watch(
        self,
        body: messages.Watch,
        log_view: Any,
        committed_key: TxKey,
        committed_digest: bytes,
        digest_at: Any,
        hears_sequencer: bool,
        now_ms: int,
        cluster_version: int = 1,
        core_endpoints: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Create an agent for a replicant's watch; return the answer (raises ``WatchRefusedError``).
        ``core_endpoints``: the cores' endpoints by name, which no watch may name (see "Endpoints" above)."""
        self._now_ms = max(self._now_ms, now_ms)
        watch_id = body.watch_id
        check_watch_request(body.protocol, watch_id, self.core_name, cluster_version, self.versions)
        check_not_a_core_endpoint(body.endpoint, core_endpoints or {})
        # Before any agent ends for this watch: one refused as behind evicts nobody (core.watch, rule 2).
        mode, start_key, start_digest = decide_watch(
            body.from_,
            body.from_digest,
            log_view.trimmed_key(),
            committed_key,
            committed_digest,
            digest_at,
            self.core_name,
        )
        owners = [(a, w.replicant, w.shard) for a, w in self.watches.items()]
        for agent_id in superseded_agents(owners, body.replicant, body.shard):
            self._forget(agent_id, drop_frames=True)
        check_replicant_watches(
            (w.replicant for w in self.watches.values()), body.replicant, self.replicant_watches_max, self.core_name
        )
        evicted = agent_to_evict(self._uses(), self.watches_max, self.core_name, now_ms, self.budget.silent_ms)
        if evicted is not None:
            self._forget(evicted, drop_frames=True)
        agent_id = f"{self.core_name[: NAME_CHARS_MAX - 1 - 2 * AGENT_ID_RANDOM_BYTES]}-"
        agent_id += self.random_bytes(AGENT_ID_RANDOM_BYTES).hex()
        # A replicant that echoes tokens must prove what it read (core.agent, "Proven acknowledgements").
        token_key = self.random_bytes(TOKEN_KEY_BYTES) if watch_proves_acknowledgements(body.protocol) else None
        # Told by a replicant of protocol 2: its pushes fit its frames (core.agent, "Frame limit").
        frame_bytes_max = body.frame_bytes_max
        agent = Agent(
            agent_id, body.shard, body.replicant, start_key, log_view, self.config, now_ms, token_key, frame_bytes_max
        )
        answer = {
            "agent": agent_id,
            "mode": mode,
            "start": list(start_key),
            "start_digest": start_digest,
            "committed": list(committed_key),
            "watch_id": watch_id,
        }
        self.watches[agent_id] = Watch(agent, body.endpoint, body.replicant, body.shard, answer, protocol=body.protocol)
        self._step(agent_id, CommittedAdvanced(committed_key, hears_sequencer), now_ms)
        if agent.entry_refusal is not None and agent.status().sent_key == start_key:
            # The first entry it must push does not fit the replicant's frame (core.agent, "Frame
            # limit"): refused, so that the replicant says why instead of waiting for pushes. The agent
            # stopped, and is forgotten already; a heartbeat it queued must not answer the watch.
            self.outbox = [(to, message) for to, message in self.outbox if message.body["agent"] != agent_id]
            # The node says this one as the watch's refusal, not as an agent that stopped.
            self.entry_refusals = [refused for refused in self.entry_refusals if refused.agent != agent_id]
            raise WatchRefusedError("too_large", agent.entry_refusal, agent=agent_id)
        return answer

    def acknowledged(self, body: messages.PushAck, now_ms: int) -> None:
        """A replicant's push_ack: its applied key, or a rejection reason."""
        agent_id = body.agent
        watch = self.watches.get(agent_id)
        if watch is None or watch.shard != body.shard:
            return  # a stopped or superseded agent (or a wrong shard): nothing to do
        if body.rejected:
            self._step(agent_id, RejectReceived(body.rejected), now_ms)
            return
        refused_before = watch.agent.acks_refused
        # Only an acknowledgement the agent took (with tokens: one that proves what it read) shows
        # that the endpoint is alive, and only one that shows progress keeps it live (Watch.acknowledged,
        # Agent.last_progress_ms).
        self._step(agent_id, AckReceived(body.applied, body.token), now_ms)
        self.acks_refused += watch.agent.acks_refused - refused_before

    def committed(self, shard: str, committed_key: TxKey, hears_sequencer: bool, now_ms: int) -> None:
        for agent_id, watch in list(self.watches.items()):
            if watch.shard == shard:
                self._step(agent_id, CommittedAdvanced(committed_key, hears_sequencer), now_ms)

    def tick(self, now_ms: int) -> None:
        for agent_id, watch in list(self.watches.items()):
            if now_ms >= watch.agent.next_deadline_ms(self._push_room(agent_id)):
                self._step(agent_id, Ticked(), now_ms)

    def next_deadline_ms(self) -> int | None:
        return min((w.agent.next_deadline_ms(self._push_room(a)) for a, w in self.watches.items()), default=None)

    def _push_room(self, agent_id: str) -> bool:
        """False for an agent that waits for the memory budget: it found no room and nobody to evict.
        Such an agent is not due for its pushes (ticking it would only spin the node's loop); an
        acknowledgement or an agent's end that frees bytes makes it due again, and its heartbeat
        deadline retries the eviction (an agent turns silent with time)."""
        return agent_id not in self._waiting or self.budget.has_room()

    def _step(self, agent_id: str, event: Any, now_ms: int) -> None:
        watch = self.watches.get(agent_id)
        if watch is None:
            return
        self._now_ms = max(self._now_ms, now_ms)
        turn_bytes = max(0, self.turn_push_bytes_max - self._turn_pushed_bytes)
        room = self.budget.has_room()
        self._execute(agent_id, watch, watch.agent.step(event, now_ms, self._push_bytes(turn_bytes)))
        self._waiting.discard(agent_id)
        # Without a push budget left in this loop turn, an agent that wants to push is due at the next turn.
        if room or agent_id not in self.watches or turn_bytes == 0 or not watch.agent.wants_to_push:
            return
        # The agent wants to push and the memory budget is spent (perhaps by this event): evict
        # silent agents for it if the rule allows, then let it push in the room made.
        for evicted in self.budget.evict_for(self._uses(), self._use(agent_id, watch), now_ms):
            self._forget(evicted, drop_frames=True)
        if self.budget.has_room():
            self._execute(agent_id, watch, watch.agent.step(Ticked(), now_ms, self._push_bytes(turn_bytes)))
        else:
            self._waiting.add(agent_id)

    def _push_bytes(self, turn_bytes: int) -> int:
        """What one step may push: the loop turn's budget left, and the memory budget's room (a step
        pushes whole pushes: the last one may cross the bound, by one push at most)."""
        return max(0, min(turn_bytes, self.budget.bytes_max - self.budget.used_bytes))

    def _use(self, agent_id: str, watch: Watch) -> AgentUse:
        return AgentUse(agent_id, self.budget.held_bytes(agent_id), watch.agent.last_progress_ms, watch.acknowledged)

    def _live(self, agent_id: str, watch: Watch) -> bool:
        """The agent's replicant made progress lately (``core.agent_budget``, "Silence")."""
        return silence_began_ms(self._use(agent_id, watch), self._now_ms, self.budget.silent_ms) is None

    def _uses(self) -> list[AgentUse]:
        return [self._use(agent_id, watch) for agent_id, watch in self.watches.items()]

    def _forget(self, agent_id: str, drop_frames: bool = False) -> None:
        """The agent ended (stopped, superseded, evicted): free its bytes; ``drop_frames``: also its
        frames not yet drained. The node closes its endpoint's socket once no agent uses it."""
        watch = self.watches.pop(agent_id, None)
        if watch is None:
            return
        self.budget.release(agent_id)
        self._waiting.discard(agent_id)
        # Its bytes left the budget, but zmq may still hold its frames for the endpoint: unless a
        # live agent (by the budget's rule: its replicant made progress within two heartbeats, so the
        # endpoint's queue is being delivered) still uses that endpoint, the node closes its socket
        # now (linger 0), and the frames go with it. Without this, a replicant name watched again and
        # again naming a dead endpoint, or a replicant that acknowledged once and then stopped
        # reading, would pile up pushes the budget no longer counts in one socket kept open.
        if not any(w.endpoint == watch.endpoint and self._live(a, w) for a, w in self.watches.items()):
            self._reset_endpoint(watch.endpoint)
        if drop_frames:
            self.outbox = [
                (endpoint, message) for endpoint, message in self.outbox if message.body["agent"] != agent_id
            ]

    def _reset_endpoint(self, endpoint: str) -> None:
        """The node closes ``endpoint``'s socket, and what zmq queues there goes with it: the pushes
        the other agents that use it (none live) handed over in earlier turns too. Their frames
        not yet drained are dropped with them, and they resend from their acknowledged key (``core.agent``,
        "Retransmission"), at their next step: otherwise their replicant's next push would follow a gap."""
        self._reset.add(endpoint)
        resending = {agent_id for agent_id, watch in self.watches.items() if watch.endpoint == endpoint}
        if not resending:
            return
        self.outbox = [(to, message) for to, message in self.outbox if message.body["agent"] not in resending]
        for agent_id in resending:
            watch = self.watches[agent_id]
            self._execute(agent_id, watch, watch.agent.step(PushesDropped(), self._now_ms, push_bytes_max=0))

    def _execute(self, agent_id: str, watch: Watch, effects: list[Any]) -> None:
        """Turn an agent's effects into frames; record the bytes it holds now."""
        for effect in effects:
            if isinstance(effect, Push):
                self._turn_pushed_bytes += effect.size_bytes
                body = {
                    "shard": watch.shard,
                    "agent": agent_id,
                    "core": self.core_name,
                    "entries": self._entries_on_wire(watch.shard, effect.entries),
                    "committed": list(effect.committed_key),
                    "hears_sequencer": effect.hears_sequencer,
                    "watch": watch.answer,
                }
                if effect.token is not None:  # never for a replicant of protocol 1, which cannot read it
                    body["token"] = effect.token
                self.outbox.append((watch.endpoint, Message("push", agent_id[:64], body)))
            elif isinstance(effect, AgentStopped):
                if watch.agent.entry_refusal is not None:
                    sent = watch.agent.status().sent_key
                    self.entry_refusals.append(
                        EntryRefused(agent_id, watch.replicant, watch.shard, sent, watch.agent.entry_refusal)
                    )
                self._forget(agent_id)
                return
        self.budget.held(agent_id, watch.agent.unacknowledged_bytes)

    def _entries_on_wire(self, shard: str, entries: tuple[Any, ...]) -> msgspec.Raw | list[Any]:
        """The push's ``entries`` field: encoded once per turn for every agent that pushes them."""
        if not entries:
            return []
        key = (shard, entries[0].prev, entries[-1].tx_key, len(entries))
        encoded = self._encoded_entries.get(key)
        if encoded is None:
            encoded = msgspec.Raw(_ENCODER.encode([entry.to_wire() for entry in entries]))
            self._encoded_entries[key] = encoded
        return encoded

    def endpoints(self) -> set[str]:
        return {watch.endpoint for watch in self.watches.values()}

    def endpoints_to_reset(self) -> set[str]:
        """Endpoints whose socket the node closes before this turn's pushes (made again on demand)."""
        reset, self._reset = self._reset, set()
        return reset

    def drain(self) -> list[tuple[str, Message]]:
        outbox, self.outbox = self.outbox, []
        return outbox

    def take_entry_refusals(self) -> list[EntryRefused]:
        """The agents stopped at an entry too large for their replicant since the last call (see "Frame limit")."""
        refusals, self.entry_refusals = self.entry_refusals, []
        return refusals

    def stop_unreadable(self, shard: str, cluster_version: int, own: Announcement) -> None:
        """The shard's log moved to ``cluster_version``: stop the agents whose replicant cannot read it
        (``core.versions.watch_protocol_refusal``); their replicants watch again, and are refused or
        served with the protocol that reads it."""
        for agent_id, watch in list(self.watches.items()):
            if watch.shard == shard and watch_protocol_refusal(watch.protocol, cluster_version, own) is not None:
                self._forget(agent_id, drop_frames=True)

    def stop_replicants(self, may_watch: Callable[[str], bool]) -> list[str]:
        """Forget every agent whose replicant ``may_watch`` refuses now (its key or role was revoked);
        return those replicants' names, sorted."""
        stopped = {w.replicant for w in self.watches.values() if not may_watch(w.replicant)}
        for agent_id in [a for a, w in self.watches.items() if w.replicant in stopped]:
            self._forget(agent_id, drop_frames=True)
        return sorted(stopped)

    def stop_shard(self, shard: str) -> None:
        """Forget every agent of ``shard`` (its log was replaced: their positions mean nothing there)."""
        for agent_id in [a for a, w in self.watches.items() if w.shard == shard]:
            self._forget(agent_id, drop_frames=True)
        self._encoded_entries.clear()

    def acked_keys(self, shard: str) -> list[TxKey]:
        """What each live agent of ``shard`` knows its replicant holds (the retention floor waits for it)."""
        return [watch.agent.status().acked_key for watch in self.watches.values() if watch.shard == shard]

    def agents_of(self, shard: str | None = None) -> int:
        return sum(1 for w in self.watches.values() if shard is None or w.shard == shard)

    def status(self) -> list[dict[str, Any]]:
        result = []
        for agent_id, watch in sorted(self.watches.items()):
            status = watch.agent.status()
            result.append(
                {
                    "agent": agent_id,
                    "replicant": watch.replicant,
                    "shard": watch.shard,
                    "mode": status.mode.value,
                    "sent": list(status.sent_key),
                    "acked": list(status.acked_key),
                    "lag_entries": status.lag_entries,
                    "unacknowledged_entries": status.unacknowledged_entries,
                    "unacknowledged_bytes": status.unacknowledged_bytes,
                    "acks_refused": status.acks_refused,
                    # The replicant's, told in its watch (protocol 2): its pushes fit half of it (None: not told).
                    "frame_bytes_max": watch.agent.frame_bytes_max,
                }
            )
        return result
