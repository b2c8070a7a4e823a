"""The watch rules of a core (pure): whether and how a replicant's watch is served.

Theory of operation
-------------------
A replicant sends ``watch(shard, replicant, endpoint, from_key, from_digest, protocol, watch_id)``.
``core.agent_server`` (the adapter that creates agents) asks these functions, in this order:

1. ``check_watch_request``: a watch naming a replication protocol that cannot read the shard's log at
   its cluster version is refused (``incompatible_protocol``, ``core.versions``), and so is a
   ``watch_id`` that is not a short string. ``check_not_a_core_endpoint``: a watch naming a core's
   endpoint (``core.agent_server``, "Endpoints") is refused, compared by ``rlog.types.endpoint_identity``
   so that the same endpoint spelt another way (``localhost`` for ``127.0.0.1``, a port with a
   leading zero, an upper-case host) is refused too.
2. ``decide_watch``, the resume-or-bootstrap rule: a core whose committed key is behind
   ``from_key`` refuses (the replica must never move backwards); if this core's rlog still holds
   ``from_key`` (not trimmed) with that digest, the new agent resumes from it (no copy); otherwise
   the answer is ``bootstrap`` from K0, this core's committed key now, and the replicant copies the
   tables while the agent pushes the entries after K0. It is asked before the rules that end
   agents: a watch refused as behind is not served, so it evicts nobody.
3. ``superseded_agents``: a newer watch of the same replicant and shard replaces the older agents
   (their pushes would be rejected by the replica anyway: they carry the old agent id).
4. ``check_replicant_watches``: one replicant holds at most ``replicant_watches_max`` agents of this
   core (after rule 3, so a watch again of a shard it holds is served); past it the watch is refused
   (``overloaded``). With security on a watch's replicant is its key's principal (``rlog.roles``), so
   one key cannot take every agent slot of ``watches_max`` and starve the other replicants; its own
   agents are not evicted for it either (a replicant follows one agent per shard, so the bound must be
   at least the number of shards a replicant follows).
5. ``agent_to_evict``: at ``watches_max`` agents, the agent silent for longest makes room, by the
   memory budget's liveness rule (``core.agent_budget``, "Silence": no progress within two heartbeat
   intervals; a replicant that never acknowledged is silent since its watch, one that acknowledged
   and then went silent since its last progress); with none silent, the watch is refused
   (``overloaded``), so silent watches can never keep a real replicant out, and a live one is never
   evicted for a new watch.

The simulator (``tests/sim/replicants.py``) runs every rule through production's ``AgentServer``
for every watch; the pushes of superseded agents still in flight are the zombies its replicas fence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mnesite.core.agent_budget import AgentUse, silence_began_ms
from mnesite.core.versions import watch_protocol_refusal
from mnesite.rlog.replication import UNKNOWN_DIGEST
from mnesite.rlog.types import TxKey, endpoint_identity
from mnesite.rlog.versions import THIS_RELEASE, Announcement

WATCH_ID_CHARACTERS_MAX = 64


class WatchRefusedError(Exception):
    """A watch the core will not serve; ``code`` is the error code the replicant is told; ``agent``: the
    agent created for it and stopped before its first push (``too_large``), else None."""

    def __init__(self, code: str, message: str, agent: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.agent = agent


def check_watch_request(
    protocol: Any, watch_id: Any, core_name: str, cluster_version: int = 1, own: Announcement = THIS_RELEASE
) -> None:
    """Rule 1 (raises ``WatchRefusedError``): the replicant must read the shard's log at its
    ``cluster_version`` (``core.versions.watch_protocol_refusal``)."""
    refusal = watch_protocol_refusal(protocol, cluster_version, own) if type(protocol) is int else "not an integer"
    if refusal is not None:
        raise WatchRefusedError("incompatible_protocol", f"core {core_name}: {refusal}")
    if not isinstance(watch_id, str) or len(watch_id) > WATCH_ID_CHARACTERS_MAX:
        raise WatchRefusedError(
            "bad_request", f"watch_id must be a string of at most {WATCH_ID_CHARACTERS_MAX} characters"
        )


def check_not_a_core_endpoint(endpoint: str, core_endpoints: Mapping[str, str]) -> None:
    """Rule 1 (raises ``WatchRefusedError``): ``endpoint`` is none of ``core_endpoints`` (by name), by
    identity and not by spelling: a string comparison let ``tcp://localhost:P`` through for a core at
    ``tcp://127.0.0.1:P``, and that core got the pushes after all."""
    identity = endpoint_identity(endpoint)
    core = next((name for name, known in core_endpoints.items() if endpoint_identity(known) == identity), None)
    if core is not None:
        raise WatchRefusedError(
            "bad_request", f"the watch names the endpoint of core {core} ({endpoint}), not a replicant's"
        )


def superseded_agents(watches: Iterable[tuple[str, str, str]], replicant: str, shard: str) -> list[str]:
    """Rule 3: the agents (of ``(agent id, replicant, shard)``) a new watch of ``replicant`` replaces."""
    return [agent_id for agent_id, owner, watched in watches if (owner, watched) == (replicant, shard)]


def check_replicant_watches(owners: Iterable[str], replicant: str, replicant_watches_max: int, core_name: str) -> None:
    """Rule 4 (raises ``WatchRefusedError``): over the replicants of the agents left after rule 3,
    ``replicant`` may hold one more agent only while it holds fewer than ``replicant_watches_max``."""
    held = sum(1 for owner in owners if owner == replicant)
    if held >= replicant_watches_max:
        raise WatchRefusedError(
            "overloaded",
            f"core {core_name}: replicant {replicant} holds {held} watches of this core already "
            f"([limits] replicant_watches_max = {replicant_watches_max})",
        )


def agent_to_evict(
    watches: Iterable[AgentUse], watches_max: int, core_name: str, now_ms: int, silent_ms: int
) -> str | None:
    """Rule 5: over the agents in age order, the one to evict for a new watch (None: there is room),
    the longest silent (the oldest of those silent as long); raises ``WatchRefusedError`` when
    every agent is live."""
    watches = list(watches)
    if len(watches) < watches_max:
        return None
    silent = [
        (began, age, agent.agent_id)
        for age, agent in enumerate(watches)
        if (began := silence_began_ms(agent, now_ms, silent_ms)) is not None
    ]
    if not silent:
        raise WatchRefusedError(
            "overloaded", f"core {core_name} serves {watches_max} agents already, every one of them live"
        )
    return min(silent)[2]


def decide_watch(
    from_key: TxKey,
    from_digest: bytes,
    trimmed_key: TxKey,
    committed_key: TxKey,
    committed_digest: bytes,
    digest_at: Callable[[TxKey], bytes | None],
    core_name: str,
) -> tuple[str, TxKey, bytes]:
    """Rule 2: ``(mode, start key, start digest)``, or ``WatchRefusedError``.

    Resume only from a key this core still retains (not trimmed) and has committed, with the same
    digest there: then the replica's history is a prefix of this core's. A core behind the
    replica refuses: answering ``bootstrap`` at a lower K0 would move the replica backwards.
    """
    if from_key > committed_key:
        raise WatchRefusedError(
            "behind", f"core {core_name} has committed only up to {committed_key}, behind {from_key}"
        )
    if trimmed_key <= from_key and from_digest != UNKNOWN_DIGEST and digest_at(from_key) == from_digest:
        return "resume", from_key, from_digest
    return "bootstrap", committed_key, committed_digest
