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
  A database restored from a backup is judged the same way (``vote_recovered``): its vote in the
  peers' generation counts as cast unless the backup records one there.
  It also lost entries it held, and an entry is committed once a majority holds it: with an empty
  log it would count any candidate up to date and could elect one without such an entry, which
  then truncates it from the others (an acknowledged write lost to one lost disk).
  ``recovered_vote_floors`` names, per shard, the highest log key the peers report; until its own
  log reaches it the core grants a (pre-)vote only to a candidate at or past it, and does not
  campaign (``PersistedState.vote_floor``). The floor holds only if the answers include a core that holds
  each such entry (``n - majority + 1`` of the other members would do: any majority that held an
  entry has one of them among those), and the recovered generation only if they include the
  candidate of every vote this core cast: a candidate cut off before it won may be the only core
  that knows of the vote. So ``recovery_shortfall`` asks for every other member, and until all
  answered the core does not start. A floor above every log left (the peer that reported it is gone
  for good) keeps this core from electing anyone without it: a forced start then decides.
* New cluster or history? A core that reaches no core that saw an election (none answers, or only
  cores that never heard a sequencer) cannot tell itself from a core of a new cluster, whose cores
  all start empty: it recovers nothing (no answer, or none with a generation: nothing to wait
  for). The operator's word tells them apart: ``[cluster] initial_cluster_state = "existing"``
  (etcd's initial-cluster-state) makes ``recovery_shortfall`` ask for every other member even
  then; without it the driver logs that it starts as a core of a new cluster, unless a peer refused
  its connection (its key not yet in their authorized_keys, the usual slip when a core is added with
  ``[security]``, or their connections_max): then it cannot know, and says what to fix instead
  (``unrecovered_start``).
* Membership (``core.membership``): a core that joins a running cluster (or is rebuilt) starts
  with the membership its peers report, not its config's ``core_nodes``. ``recovered_members``
  takes, per shard, the members the answer with the highest generation reports, and as the
  cluster's membership the one of the highest generation overall; a malformed list is ignored.
* A forced start (``ShardConsensus`` decides): ``reached_generations`` and ``reached_last_keys``
  turn the answers into the ``(peer, generation)`` and ``(peer, last key)`` pairs of its
  ``ForceStartRequested`` event.

While it recovers, the core answers ``status`` and nothing else (``ANSWERED_WHILE_RECOVERING``): the driver
keeps a ``RecoveryProgress`` (the round, the members asked, the answers so far) and ``recovery_answer``
turns it into ``status``'s ``recovery`` section (``rlog.messages.RecoveryAnswer``): what the core waits
for, and why. A member that refused this core's connection at its handshake
(``RecoveryProgress.refusals``, from the probe's client: this core's key not in that member's
authorized_keys, or that member at its connections_max) will not answer until that is fixed:
``refusal_note`` says what to do, in the ``reason`` and in the error the core gives up with
(``refusal_notes``). Every other request is refused ``not_ready`` (``recovering_refusal``): its state is not
decided yet (a ``journal`` answer in particular would count for another rebuilt core as a member's,
which it cannot vouch for), and a client asks another core.

A peer's answer is untrusted input like any other frame. ``well_formed_answers`` keeps only the
answers that state every generation as an integer in [0, ``GENERATION_MAX``], the bound a consensus
message's generation is held to too (one malformed generation drops the whole answer: that peer
counts as not reached), and a shard name that is not a valid name is
ignored (it never becomes a row of this core's database).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mnesite.core.consensus import GENERATION_MAX
from mnesite.core.membership import valid_members
from mnesite.rlog.errors import REFUSED_FULL, REFUSED_KEY
from mnesite.rlog.schema import SchemaError, check_name
from mnesite.rlog.status import RecoveryAnswer
from mnesite.rlog.types import ZERO_KEY, TxKey


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


def vote_recovered(own_generation: int, own_voted_for: str | None, recovered_generation: int) -> bool:
    """Whether a core rebuilt on an empty database, or restored from a backup, persists the
    ``recovered_generation`` of a shard with its vote cast (for itself); False: it keeps its own state.

    Its own state may be older than votes it cast (a backup holds what was persisted when it was
    taken). Past its own generation, any vote may have been cast. At its own generation too, unless
    the state records one: a core adopts a generation (no vote) before it votes in it, so a backup
    taken in between holds no vote where a vote was cast; a restored core that kept that state
    could vote in the generation again, for another candidate (two sequencers of one generation).
    A vote on record is the only one it could have cast there."""
    if recovered_generation != own_generation:
        return recovered_generation > own_generation
    return own_voted_for is None


def journal_key(value: Any) -> TxKey | None:
    """A log key of a peer's journal answer (``[generation, counter]``), or None if malformed."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    generation, counter = value
    for part in (generation, counter):
        if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part <= GENERATION_MAX:
            return None
    return TxKey(generation, counter)


def recovered_vote_floors(answers: Mapping[str, Any]) -> dict[str, TxKey]:
    """Vote floors after a lost disk: for each validly named shard, the highest log key (``last``,
    or ``committed`` if higher) any well-formed answer reports. An entry is committed once a
    majority holds it, and this core may have been one of them: until its own log reaches what its
    peers' logs held, it counts a candidate up to date only at this key (``ShardConsensus``). A
    malformed key is left out (that peer then adds nothing to the floor); no answer: no floor."""
    floors: dict[str, TxKey] = {}
    for journal in well_formed_answers(answers).values():
        for shard, age in journal["shards"].items():
            try:
                check_name("shard", shard)
            except SchemaError:
                continue
            if not isinstance(age, dict):
                continue
            for key in (journal_key(age.get("last")), journal_key(age.get("committed"))):
                if key is not None and key > floors.get(shard, ZERO_KEY):
                    floors[shard] = key
    return floors


def recovery_shortfall(answers: Mapping[str, Any], members: tuple[str, ...], name: str, existing: bool = False) -> int:
    """How many more members must answer before a core rebuilt on an empty database may take part
    (0: enough). Every other member, once any well-formed answer shows a generation in use or the
    operator declared the cluster ``existing`` (``[cluster] initial_cluster_state``); nothing for a
    new cluster (no generation in use, not declared existing: its cores all start empty) or when
    ``name`` is not a member (a learner never votes).

    Why every one: the vote this core cast before its loss lives on only at the candidate it voted
    for, which may have heard from no other core since (a candidate cut off, its campaign not yet
    won). Without that candidate's answer the recovered generation can be below the one it voted
    in; it would vote in it again, for another core, and the candidate could still win it with the
    lost vote: two sequencers of one generation (``test_simulation.py``, 5 cores). n - majority + 1
    answers are enough for the vote floor (any majority that committed an entry has one of them
    among those), not for the votes."""
    if name not in members:
        return 0
    usable = well_formed_answers(answers)
    history = any(journal_generation(journal, shard) > 0 for journal in usable.values() for shard in journal["shards"])
    if not history and not existing:
        return 0
    heard = sum(1 for peer in usable if peer in members and peer != name)
    return max(0, len(members) - 1 - heard)


def reached_generations(answers: Mapping[str, Any], shard: str) -> tuple[tuple[str, int], ...]:
    """The ``(peer, generation)`` pairs a forced start of ``shard`` is told, peers in name order."""
    return tuple((peer, journal_generation(journal, shard)) for peer, journal in sorted(answers.items()))


def reached_last_keys(answers: Mapping[str, Any], shard: str) -> tuple[tuple[str, TxKey], ...]:
    """The ``(peer, last log key)`` pairs a forced start of ``shard`` is told, peers in name order:
    only the peers whose answer gives a well-formed last key for the shard (one that does not
    holds nothing there that the forced start could weigh)."""
    keys = []
    for peer, journal in sorted(well_formed_answers(answers).items()):
        age = journal["shards"].get(shard)
        key = journal_key(age.get("last")) if isinstance(age, dict) else None
        if key is not None:
            keys.append((peer, key))
    return tuple(keys)


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


def refusal_note(peer: str, why: str | None, name: str) -> str | None:
    """What to do about member ``peer`` that refused core ``name``'s connection, ``why`` (``REFUSED_KEY``,
    ``REFUSED_FULL``; None: it did not refuse it), or None."""
    if why == REFUSED_KEY:
        return (
            f"{peer} refused this core's key: authorize it there (copy the public key file of {name}'s [security] "
            f"client_key into {peer}'s authorized_keys) and send {peer} SIGHUP"
        )
    if why == REFUSED_FULL:
        return f"{peer} refused this core's connection: it holds its [limits] connections_max connections"
    return None


def refusal_notes(silent: Iterable[str], refusals: Mapping[str, str], name: str) -> list[str]:
    """``refusal_note`` of each member of ``silent`` that refused core ``name``'s connection, in name order."""
    notes = (refusal_note(peer, refusals.get(peer), name) for peer in sorted(silent))
    return [note for note in notes if note is not None]


def unrecovered_start(
    answered: Iterable[str], silent: Iterable[str], refusals: Mapping[str, str], name: str
) -> tuple[bool, str]:
    """What core ``name`` on an empty database logs (warn?, message) when no peer reports a generation
    in use and the cluster is not declared existing, so that it starts with nothing recovered:
    ``answered``, the peers whose answers it had; ``silent``, those that gave none; ``refusals``, the
    peers that refused its connection at their handshake, and why (``REFUSED_KEY``, ``REFUSED_FULL``).

    With no refusal it is a core of a new cluster, or a rebuilt one that reached no core that saw an
    election (the operator tells which). A silent peer that refused it is neither: it never answered
    whether the cluster has history (a core being added whose key is not authorized yet), so the
    message names each refusal and what to do, and not "a new cluster"."""
    heard = sorted(answered)
    notes = refusal_notes(silent, refusals, name)
    if not notes:
        return False, (
            f"empty database: no peer reports a generation in use (answers from {heard}): starting as a core of a "
            "new cluster; if this core was rebuilt in a running cluster, stop it and start it again with "
            '[cluster] initial_cluster_state = "existing"'
        )
    return True, (
        f"empty database: peers refused this core's connection, so it cannot tell whether the cluster has "
        f"history (answers from {heard}, none reporting a generation in use): {'; '.join(notes)}. It starts with "
        "nothing recovered and dials them again by itself: a core being added needs no restart (`cluster add-core` "
        "adds it once they take it); a core rebuilt in a running cluster must be stopped and started again with "
        '[cluster] initial_cluster_state = "existing" once they do'
    )


# The requests a core answers while it recovers: read-only and about this core alone. ``members``,
# ``journal``, ``list_tables`` and the rlog reads would answer from a state recovery is about to decide.
ANSWERED_WHILE_RECOVERING = frozenset({"status"})


@dataclass
class RecoveryProgress:
    """Where a core's start-up recovery stands (the driver's, updated as it goes; ``recovery_answer``)."""

    name: str
    members: tuple[str, ...]  # the membership the core starts with (its peers' answers may replace it)
    existing: bool  # ``[cluster] initial_cluster_state = "existing"``
    started_ms: int
    rounds_max: int
    round_timeout_ms: int
    round: int = 0
    # "asking": a round's journal requests are out; "waiting": the round is answered (or timed out) short
    # of what is needed, and the next one starts once the round's time is up.
    phase: Literal["asking", "waiting"] = "asking"
    asked: tuple[str, ...] = ()
    # The round's answers so far (a probe's threads add to it: read it through a copy).
    answers: Mapping[str, Any] = field(default_factory=dict)
    # The round's members that refused this core's connection, and why (REFUSED_KEY, REFUSED_FULL).
    refusals: Mapping[str, str] = field(default_factory=dict)


def recovery_answer(progress: RecoveryProgress, now_ms: int) -> RecoveryAnswer:
    """``status``'s ``recovery`` section: the members whose answers the core still needs and why, as
    ``recovery_shortfall`` decides from the answers so far. Until an answer shows a generation in use
    (or the cluster is declared existing) the need is not known (``needed`` None): the core waits for
    the members it asked, whose answers say whether the cluster has history."""
    usable = well_formed_answers(dict(progress.answers))
    members = recovered_members(usable)[1] or progress.members
    history = any(journal_generation(journal, shard) > 0 for journal in usable.values() for shard in journal["shards"])
    answered = sorted(usable)
    if progress.existing or history:
        needed: int | None = recovery_shortfall(usable, members, progress.name, progress.existing)
        waiting_for = sorted(set(members) - set(usable) - {progress.name})
        why = (
            "every other member must answer before this core may vote (it may have voted, and held entries, "
            f"before its database was lost or restored): {needed} not yet"
        )
    else:
        needed = None
        waiting_for = sorted(set(progress.asked) - set(usable))
        why = "asking its peers whether the cluster has history (a generation in use)"
    notes = refusal_notes(waiting_for, dict(progress.refusals), progress.name)
    if notes:
        why = f"{why}; {'; '.join(notes)}"
    when = (
        f"round {progress.round} of {progress.rounds_max}"
        if progress.phase == "asking"
        else f"asking again in round {progress.round + 1} of {progress.rounds_max}"
    )
    return RecoveryAnswer(
        phase=progress.phase,
        round=progress.round,
        rounds_max=progress.rounds_max,
        elapsed_ms=max(0, now_ms - progress.started_ms),
        round_timeout_ms=progress.round_timeout_ms,
        asked=sorted(progress.asked),
        answered=answered,
        waiting_for=waiting_for,
        needed=needed,
        existing=progress.existing,
        reason=f"{why}; {when}",
    )


def recovering_refusal(name: str, answer: RecoveryAnswer) -> str:
    """The ``not_ready`` message of a request a recovering core does not answer."""
    waiting = f", waiting for {', '.join(answer.waiting_for)}" if answer.waiting_for else ""
    return (
        f"core {name} is recovering at start-up (an empty or restored database) and answers only status until "
        f"it is done{waiting}: {answer.reason}; ask another core"
    )
