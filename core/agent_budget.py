"""One memory budget for every replicant stream of a node (pure): the bytes all agents hold together,
and which agents to evict when a push does not fit.

Theory of operation
-------------------
An agent (``core.agent``) holds the bytes it pushed and its replicant has not acknowledged (its
window): those frames sit in the node's outbox, in zmq's send queue to the replicant's endpoint, or
on the wire. A zmq DEALER to an endpoint where nothing listens keeps every frame handed to it until
the socket closes, so ``watches_max`` agents of ``window_bytes_max`` each could hold gigabytes (issue
24: 256 watches of a 10 MB log grew a core by 1,703 MB). The budget bounds them together:
``agents_bytes_max`` bytes for all the agents of a node.

* Accounting. ``AgentMemoryBudget.held`` records an agent's unacknowledged bytes after every step
  of it (a push adds, an acknowledgement or a resend frees), ``release`` forgets an agent that ended
  (stopped, superseded, evicted, its shard's log replaced). ``used_bytes`` is their sum.
* Admission. An agent may push while ``used_bytes < bytes_max``, like its own window: the push that
  crosses the bound goes whole, so the use exceeds ``bytes_max`` by at most one push.
* Silence. An agent is *live* when its replicant has shown progress within ``silent_ms``: an
  acknowledgement that advanced its acknowledged key, or that found nothing unacknowledged
  (``core.agent.Agent.last_progress_ms``; a live replica acknowledges every push and every heartbeat,
  and heartbeats go out every ``heartbeat_interval_ms``). Otherwise it is *silent*: it never
  acknowledged (a dead or fake endpoint, or a replicant still connecting), it stopped acknowledging,
  or its acknowledgements arrive but never advance while pushes wait (a replica stuck re-acknowledging
  an old key: were their arrival a sign of life, its window would hold the budget for good). Its
  silence began at its last progress, or at its creation if there was none. The same rule decides
  whether an agent that ends leaves its endpoint's socket open (``core.agent_server``, "Memory"): only
  for a live agent, whose queue is being delivered; and which agent a new watch evicts at
  ``watches_max`` (``core.watch`` rule 5).
* Eviction (``agents_to_evict``). When an agent wants to push and the budget is spent, silent agents
  that hold bytes are evicted, the longest silent first, until the use is under ``bytes_max``. Live
  agents are never evicted: a live replicant is unharmed by any number of silent ones. A silent
  agent that asks may only evict agents silent for longer than itself, so a flood of new watches
  evicts the oldest first and never the newest. If all the candidates together cannot make room,
  none is evicted (they would die for nothing): the agent waits, and its replicant's acknowledgements
  make the room (backpressure shared by all agents).
* The agent's own probation (``core.agent``: a small window, and a short timeout, until the first
  acknowledgement) keeps what each silent watch takes small; the budget bounds their sum.
* The accounting is only as good as the acknowledgements: bytes an acknowledgement frees must have
  left zmq's queue. A replicant of replication protocol 2 must prove it read the pushes it
  acknowledges (``core.agent``, "Proven acknowledgements"): an acknowledgement that does not frees
  nothing and does not make its agent live. A replicant of protocol 1 (release 0.1.0, served only
  while a shard is at cluster version 1) is trusted.
* The driver (``core.agent_server``) executes an eviction: it stops the agent, drops its frames not
  yet handed to zmq, and the node closes the endpoint's DEALER with linger 0, which drops what zmq
  still queues. A replicant that was alive after all notices the missing pushes and heartbeats
  (its ``failure_timeout_ms``), watches again and resumes from its applied key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A live replica acknowledges every heartbeat: two heartbeat intervals without progress make an agent silent.
SILENT_HEARTBEATS = 2


class AgentBudgetError(ValueError):
    """An invalid budget argument."""


@dataclass(frozen=True)
class AgentUse:
    """What the eviction rule knows of one agent."""

    agent_id: str
    held_bytes: int
    # The replicant's last progress (see "Silence"), or the agent's creation when it showed none.
    last_progress_ms: int
    acknowledged: bool


def silence_began_ms(agent: AgentUse, now_ms: int, silent_ms: int) -> int | None:
    """When ``agent``'s silence began; None while it is live."""
    if agent.acknowledged and now_ms - agent.last_progress_ms < silent_ms:
        return None
    return agent.last_progress_ms


def agents_to_evict(
    agents: Iterable[AgentUse], requester: AgentUse, used_bytes: int, bytes_max: int, now_ms: int, silent_ms: int
) -> list[str]:
    """The agents to evict so that ``requester`` may push (see the theory of operation); [] when there
    is room already, or when the silent agents together cannot make it."""
    if used_bytes < bytes_max:
        return []
    requester_silent_since = silence_began_ms(requester, now_ms, silent_ms)
    candidates = []
    for agent in agents:
        if agent.agent_id == requester.agent_id or agent.held_bytes <= 0:
            continue
        began = silence_began_ms(agent, now_ms, silent_ms)
        if began is None:
            continue  # live: never evicted
        if requester_silent_since is not None and began >= requester_silent_since:
            continue  # a silent requester evicts only agents silent for longer than itself
        candidates.append((began, agent.agent_id, agent.held_bytes))
    candidates.sort()
    evicted = []
    for _, agent_id, held_bytes in candidates:
        evicted.append(agent_id)
        used_bytes -= held_bytes
        if used_bytes < bytes_max:
            return evicted
    return []


class AgentMemoryBudget:
    """The accounting: bytes held per agent, their sum, and the count of agents evicted for the budget."""

    def __init__(self, bytes_max: int, silent_ms: int) -> None:
        if bytes_max <= 0 or silent_ms <= 0:
            raise AgentBudgetError("bytes_max and silent_ms must be positive")
        self.bytes_max = bytes_max
        self.silent_ms = silent_ms
        self.used_bytes = 0
        self.evicted_agents = 0
        self._held: dict[str, int] = {}

    def has_room(self) -> bool:
        return self.used_bytes < self.bytes_max

    def held_bytes(self, agent_id: str) -> int:
        return self._held.get(agent_id, 0)

    def held(self, agent_id: str, held_bytes: int) -> None:
        """``agent_id`` holds ``held_bytes`` now (after a step of it)."""
        if held_bytes < 0:
            raise AgentBudgetError(f"agent {agent_id} cannot hold {held_bytes} bytes")
        self.used_bytes += held_bytes - self._held.get(agent_id, 0)
        self._held[agent_id] = held_bytes

    def release(self, agent_id: str) -> int:
        """``agent_id`` ended: its bytes are free (the driver dropped its frames). Returns them."""
        freed = self._held.pop(agent_id, 0)
        self.used_bytes -= freed
        return freed

    def evict_for(self, agents: Iterable[AgentUse], requester: AgentUse, now_ms: int) -> list[str]:
        """The agents to evict for ``requester`` (released and counted here; the driver stops them)."""
        evicted = agents_to_evict(agents, requester, self.used_bytes, self.bytes_max, now_ms, self.silent_ms)
        for agent_id in evicted:
            self.release(agent_id)
        self.evicted_agents += len(evicted)
        return evicted

    def status(self) -> dict[str, int]:
        return {"used_bytes": self.used_bytes, "bytes_max": self.bytes_max, "evicted_agents": self.evicted_agents}
