"""What a core learns from its peers' journal answers (pure): generation recovery and force-start input.

Theory of operation
-------------------
A core's driver asks every other member for its journal (``journal``: per shard the generation,
committed and last keys) in two situations, and only asks: the decisions are here.

* Generation recovery after a lost disk (Eventuate's disaster recovery: a clock must not restart
  in the past). A core whose database is empty may have lost one that voted. For every shard any
  peer knows, ``recovered_generations`` names the highest generation in use; the driver persists
  it with this core's vote already cast (for itself), so the core never grants a vote in a
  generation it may have voted in before the loss, and then catches up like a follower far behind.
  No answer (a new cluster) recovers nothing.
* Membership (``core.membership``): a core that joins a running cluster (or is rebuilt) starts
  with the membership its peers report, not its config's ``core_nodes``. ``recovered_members``
  takes, per shard, the members the answer with the highest generation reports, and as the
  cluster's membership the one of the highest generation overall; a malformed list is ignored.
* A forced start (``ShardConsensus`` decides): ``reached_generations`` turns the answers into the
  ``(peer, generation)`` pairs of its ``ForceStartRequested`` event.

A peer's answer is untrusted input like any other frame. ``well_formed_answers`` keeps only the
answers that state every generation as an integer in [0, ``GENERATION_MAX``], the bound a consensus
message's generation is held to too (one malformed generation drops the whole answer: that peer
counts as not reached), and a shard name that is not a valid name is
ignored (it never becomes a row of this core's database).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mnesite.core.consensus import GENERATION_MAX
from mnesite.core.membership import valid_members
from mnesite.rlog.schema import SchemaError, check_name


def journal_generation(journal: Mapping[str, Any], shard: str) -> int:
    """The generation a peer's journal answer gives for ``shard``: 0 if the peer does not know the
    shard, -1 if the answer is malformed there."""
    age = journal["shards"].get(shard)
    if age is None:
        return 0
    generation = age.get("generation") if isinstance(age, dict) else None
    # At most GENERATION_MAX, as in a consensus message: a campaign adds one to what is recovered, and
    # 2**63 - 1 + 1 is beyond SQLite's integers (the core then failed at each election, restart or not).
    if not isinstance(generation, int) or isinstance(generation, bool) or not 0 <= generation <= GENERATION_MAX:
        return -1
    return generation


def well_formed_answers(answers: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The journal answers that may be used; a peer whose answer is malformed counts as not reached."""
    return {
        peer: answer
        for peer, answer in answers.items()
        if isinstance(answer, dict)
        and isinstance(answer.get("shards"), dict)
        and all(journal_generation(answer, shard) >= 0 for shard in answer["shards"])
    }


def recovered_generations(answers: Mapping[str, Any]) -> dict[str, int]:
    """Generation recovery: for each validly named shard any well-formed answer knows, the highest
    generation in use. Empty when no peer answered (a new cluster: nothing to recover)."""
    generations: dict[str, int] = {}
    for journal in well_formed_answers(answers).values():
        for shard in journal["shards"]:
            try:
                check_name("shard", shard)
            except SchemaError:
                continue
            generations[shard] = max(generations.get(shard, 0), journal_generation(journal, shard))
    return generations


def reached_generations(answers: Mapping[str, Any], shard: str) -> tuple[tuple[str, int], ...]:
    """The ``(peer, generation)`` pairs a forced start of ``shard`` is told, peers in name order."""
    return tuple((peer, journal_generation(journal, shard)) for peer, journal in sorted(answers.items()))


def answer_members(value: Any) -> tuple[str, ...] | None:
    """A peer's members list, if it is a valid membership of valid names (untrusted input)."""
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        return None
    members = tuple(sorted(set(value)))
    try:
        for name in members:
            check_name("core", name)
    except SchemaError:
        return None
    return members if valid_members(members) else None


def recovered_members(
    answers: Mapping[str, Any],
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...] | None]:
    """(shard -> members, the cluster's members) as the peers with the highest generation report them."""
    best: dict[str, tuple[int, tuple[str, ...]]] = {}
    cluster: tuple[int, tuple[str, ...]] | None = None
    for journal in well_formed_answers(answers).values():
        for shard, age in journal["shards"].items():
            members = answer_members(age.get("members")) if isinstance(age, dict) else None
            if members is None:
                continue
            generation = journal_generation(journal, shard)
            if shard not in best or generation > best[shard][0]:
                best[shard] = (generation, members)
            if cluster is None or generation > cluster[0]:
                cluster = (generation, members)
    return {shard: members for shard, (_, members) in best.items()}, cluster[1] if cluster else None
