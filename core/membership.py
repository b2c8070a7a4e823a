"""Membership changes of a shard's cores, one core at a time (Raft thesis, section 4.1).

Theory of operation
-------------------
A shard's voters are recorded in its rlog: an entry whose ops hold one ``MembersOp`` names the
whole new set. The config's ``core_nodes`` only seeds a new cluster (and a shard created later
starts with the membership the core last applied). Every core uses the LATEST membership entry in
its log, committed or not, for its quorums and elections, from the moment it persists the entry
(the sequencer: from when it appends it, before the turn's batch goes out); a truncated entry takes
its membership with it.

Safety comes from changing one voter at a time: any majority of the old set and any majority of
the new set (one more or one fewer) share a core, so two sequencers can never be elected in one
generation from the two sets, and an entry committed under one set is held by a majority the next
election must hear. That argument holds only between two ADJACENT sets, hence the rules below
(``change_refusal``):

* one change in flight: a new change only once the previous membership entry has committed (and a
  core added is not still catching up as a learner);
* a new sequencer first commits an entry of its own generation (its no-op) before it changes the
  membership (the thesis' fix: an uncommitted change of a deposed sequencer may otherwise be
  overwritten after a conflicting change committed);
* the set stays within 1..``MEMBERS_MAX`` cores;
* a removal only while the sequencer hears a majority of the set it leaves (``quorum_refusal``): the
  new set is in force from its entry on, so removing a live core (or the sequencer itself) while
  another is down left a set whose majority is down, and the change never committed, nobody could be
  elected, and no change could undo it (two of three cores up, and no sequencer until a force start).
  "Hears" is checked twice: at the request, the cores heard within an election timeout (a quick
  refusal); then the removal waits until a majority of the set it leaves answered an append sent
  since the request (``removal_heard``; a heartbeat goes out at once) and is refused if that takes an
  election timeout. Without the second check a core that died less than an election timeout before
  the request still counted as up.

A core to be added first catches up as a *learner*: the sequencer replicates to it (through the
snapshot path if its log is behind the retained entries) without counting it in any quorum; only
when it holds the sequencer's committed key is the add entry appended. So a slow new core never
stalls commits. A core outside the membership that hears no sequencer for an election timeout
follows none (``ShardConsensus.follows_sequencer``), as a voter does from its pre-vote on: its
replicants move away from its stale log. A core answers the (pre-)vote requests of cores outside its
membership by the same rules as its members' (thesis 4.2.3): a core just added may need the vote of
a member that has not stored the entry adding it, the log check keeps that safe, and a core that
hears the sequencer refuses, so a removed core cannot disrupt. A core removed stops voting when it persists the entry;
a sequencer that removed itself keeps serving without counting itself until the entry commits,
then steps down.

Membership is per shard, like everything the consensus decides: each shard's quorums come from its
own log, which is what keeps them consistent. The cluster-wide change (``cluster add-core``) is the
same change proposed to every shard in turn; a half-done change is visible in ``cluster members``
and is finished by running the command again (an add of a member or a remove of a non-member is
answered as done).

Waiting for a change (``cluster add-core``): a learner's catch-up of a large log (or a snapshot)
takes longer than any one answer may, so the command's wait is not one request's timeout.
``change_wait`` decides, from what the sequencer's ``members`` shows each time the change request
went unanswered, whether to go on waiting: while the change moves (the learner's matched key, the
members, and the rows the sequencer served of the learner's snapshot install: its matched key
moves only at the install's end, ``core.snapshot`` "Progress at the sequencer") the operator waits; a
change that has not moved for ``CHANGE_STALL_MS`` ends the wait
as "still under way" (the change itself goes on, and ends at ``learner_catch_up_ms_max`` at the
latest), which is not "no answer". An ``already_member`` / ``not_member`` answer is read from the
latest membership entry, committed or not, so the command waits the same way until the committed
membership shows the change. A sequencer silent to both the change and ``members`` (crashed or
paused) is not the end either: ``after_silence`` decides, from the sequencer the other cores name,
whether to ask the change anew of another one, send the silent one the same request id again, or
leave the outcome unknown. A sequencer no connection reaches (its process gone: nothing was asked of
it) is waited out the same way (``after_change_failure``): the view that named it may come from a core
that has not noticed yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mnesite.rlog.types import ROW_OPS, Entry, MembersOp, TxKey

MEMBERS_MAX = 15
# How long ``cluster add-core`` / ``remove-core`` waits for a change that stopped moving before it
# says the change is still under way (a snapshot install moves the learner's key only at its end,
# its copy moves ``learner_copy``).
CHANGE_STALL_MS = 60_000
# Answers to a change request that say it reached a core that is not (or no longer) the shard's
# sequencer and that nothing was written for it: ``core.consensus.REJECT_NOT_SEQUENCER`` (a sequencer
# that stepped down or lost its leadership while its learner caught up or its removal waited, or a
# machine that is not the sequencer), and ``no_sequencer`` (``core.rules.route_write``: a core that
# knows none to forward to, an election under way). ``cluster add-core`` / ``remove-core`` ask the
# change anew of the sequencer ``members`` names then, at most ``SEQUENCER_REASKS_MAX`` times per
# shard, waiting up to ``SEQUENCER_WAIT_MS`` for one to be named (elections take an election timeout
# of 0.8-1.6 s by default, a few of them after split votes). An ``outcome_unknown`` is not one of
# them: that change may be under way, and ``after_silence`` decides what follows it. A sequencer
# whose own generation has not committed yet (``REJECT_NOT_SETTLED``) is asked again every
# ``SEQUENCER_POLL_MS`` for up to ``SEQUENCER_WAIT_MS``: its first entry commits within a round trip.
SEQUENCER_MOVED_CODES = frozenset({"not_sequencer", "no_sequencer"})
# What a client says of a core no connection reached (its process gone, its host down) when nothing
# was sent (``rlog.client.Unavailable``; a request that left and went unanswered is ``outcome_unknown``).
UNREACHABLE_CODE = "unavailable"
SEQUENCER_REASKS_MAX = 3
SEQUENCER_WAIT_MS = 15_000
SEQUENCER_POLL_MS = 200

REJECT_CHANGE_IN_FLIGHT = "membership_change_in_flight"
REJECT_NOT_SETTLED = "sequencer_not_settled"
REJECT_ALREADY_MEMBER = "already_member"
REJECT_NOT_MEMBER = "not_member"
REJECT_TOO_MANY_MEMBERS = "too_many_members"
REJECT_LAST_MEMBER = "last_member"
REJECT_CATCH_UP_TIMEOUT = "catch_up_timeout"
# The sequencer does not hear a majority of the membership the change would leave (``quorum_refusal``).
REJECT_NO_QUORUM_AFTER = "no_quorum_after_change"
# The core being added cannot read the shard's log (core.versions.member_refusal): the operator's
# `cluster add-core` is refused with the same code before it starts, when the probes heard the core.
REJECT_INCOMPATIBLE_VERSION = "incompatible_version"
# Answers that mean "the membership already is what was asked": a retried change reports success.
ALREADY_DONE = frozenset({REJECT_ALREADY_MEMBER, REJECT_NOT_MEMBER})


def change_refusal(
    members: tuple[str, ...],
    name: str,
    add: bool,
    change_in_flight: bool,
    own_generation_committed: bool,
) -> str | None:
    """Why the sequencer may not start this change now (None: it may)."""
    if add and name in members:
        return REJECT_ALREADY_MEMBER
    if not add and name not in members:
        return REJECT_NOT_MEMBER
    if change_in_flight:
        return REJECT_CHANGE_IN_FLIGHT
    if not own_generation_committed:
        return REJECT_NOT_SETTLED
    if add and len(members) + 1 > MEMBERS_MAX:
        return REJECT_TOO_MANY_MEMBERS
    if not add and len(members) == 1:
        return REJECT_LAST_MEMBER
    return None


def quorum_refusal(new_members: tuple[str, ...], heard: Iterable[str], added: str | None = None) -> str | None:
    """Why the sequencer may not append a change to ``new_members`` now (None: it may): it hears
    (``heard``: itself when it is a voter, and the followers that answered it within an election
    timeout; not, as its self-fencing does, a peer given a timeout since the election to answer)
    fewer than a majority of the new set. The entry is in force from
    when it is appended, so it would never commit, the sequencer would fence itself, and no core
    could be elected under the new set until the cores it needs came back: a removal asked while
    another core is down (etcd's strict reconfiguration check). ``added``, a core being added, is
    counted as heard: its entry is appended only once it answered (caught up as a learner)."""
    reachable = set(heard) | ({added} if added else set())
    if len(reachable & set(new_members)) < majority(new_members):
        return REJECT_NO_QUORUM_AFTER
    return None


def majority(members: tuple[str, ...]) -> int:
    """How many of ``members`` are a majority of them."""
    return len(members) // 2 + 1


def removal_answers(
    new_members: tuple[str, ...], sequencer: str | None, answered_ms: Mapping[str, int | None], asked_ms: int
) -> tuple[str, ...]:
    """The cores of ``new_members`` that count for a removal asked at ``asked_ms``, sorted: the
    sequencer (``sequencer``, its name while it is a voter, else None) and the peers that answered an
    append it sent at or after ``asked_ms`` (``answered_ms``: per peer, when it sent the latest append
    the peer answered)."""
    heard = {peer for peer, sent_ms in answered_ms.items() if sent_ms is not None and sent_ms >= asked_ms}
    if sequencer is not None:
        heard.add(sequencer)
    return tuple(sorted(heard & set(new_members)))


def removal_heard(
    new_members: tuple[str, ...], sequencer: str | None, answered_ms: Mapping[str, int | None], asked_ms: int
) -> bool:
    """Whether a removal asked at ``asked_ms`` may be appended: its ``removal_answers`` are a majority
    of ``new_members``. ``quorum_refusal`` at the request counts a core heard within an election
    timeout, so also one that died just before it; this counts only cores up since."""
    return len(removal_answers(new_members, sequencer, answered_ms, asked_ms)) >= majority(new_members)


def changed_members(members: tuple[str, ...], name: str, add: bool) -> tuple[str, ...]:
    """The set after adding or removing ``name``: always adjacent to ``members``."""
    return tuple(sorted({*members, name} if add else set(members) - {name}))


def membership_of(entry: Entry) -> tuple[str, ...] | None:
    """The membership an entry records (its last ``MembersOp``), or None for an ordinary entry."""
    found = None
    for op in entry.ops:
        if isinstance(op, MembersOp):
            found = tuple(sorted(set(op.members)))
    return found


def membership_changes(entries: Iterable[Entry]) -> list[tuple[TxKey, tuple[str, ...]]]:
    """(tx key, membership) of every membership entry among ``entries``, in order."""
    changes = []
    for entry in entries:
        if ROW_OPS.issuperset(map(type, entry.ops)):
            continue  # the common entry: rows only
        members = membership_of(entry)
        if members is not None:
            changes.append((entry.tx_key, members))
    return changes


def forced_start_entry(key: TxKey) -> bool:
    """Whether the membership entry at ``key`` is a forced start's (``ShardConsensus._force_start``):
    the first entry of its generation. An elected sequencer's first entry is its no-op (no ops), and it
    changes the membership only once that entry committed (``change_refusal``), so only a forced start
    puts a membership there, or an elected sequencer whose committed membership is a forced start's
    (recorded again, unchanged: ``elected_first_ops``). Every member of the forced generation learns from it, once it is
    committed, that the generation is forced, and tells the cores it left out (not only the forced
    core, which may die before a left-out core comes back)."""
    return key.counter == 1


def elected_first_ops(
    forced: bool, change_in_flight: bool, committed_members: tuple[str, ...]
) -> tuple[MembersOp, ...]:
    """The ops of an elected sequencer's first entry: none (its no-op), or, when its committed
    membership is a forced start's and no change is in flight, that membership again, unchanged.

    Committed, it is a forced start's entry (``forced_start_entry``): every member holding it is
    forced. A member may hold the forced membership committed without the forced start's entry: the
    forced core crashed before that entry was durable (its forced state was), no member got it, and
    the forced core, elected again, told its members the committed membership in its appends only
    (``ShardConsensus._adopt_committed_members``, which cannot say it is forced). Without this entry
    such a member, once the forced core is gone, never tells the cores left out."""
    if not forced or change_in_flight:
        return ()
    return (MembersOp(committed_members),)


def heard_after_forced_start(last_key: TxKey, committed_key: TxKey) -> bool:
    """Whether a member of a forced generation answers the (pre-)vote request of a core outside its
    membership whose log ends at ``last_key`` (it tells the others they were left out instead).

    ``committed_key`` is this member's: at or after the forced start entry, which it holds committed
    (the forced core: once that entry commits; until then, stickiness refuses everyone anyway). A
    log that goes past it holds entries of the forced generation or later: a core added after the
    forced start whose add entry has not reached this member (it may need this member's vote, as any
    added core: thesis 4.2.3), and the log check keeps the answer safe. A core the forced start left
    out stopped at a generation the forced one is above (the forced core reached no majority of the
    old membership, so no later sequencer of it was elected without it), so it is still told: only
    a left-out majority that was alive and elected a sequencer in a generation as high (the split
    brain a forced start assumes away: such cores must be rebuilt first) would be heard."""
    return last_key > committed_key


def valid_members(members: tuple[str, ...]) -> bool:
    """A membership a log may carry: 1..MEMBERS_MAX distinct names."""
    return 1 <= len(members) <= MEMBERS_MAX and len(set(members)) == len(members)


@dataclass(frozen=True)
class ChangeWait:
    """``change_wait``'s answer: ``state`` is ``done`` (the shard's committed membership is the one
    asked for: send the request again to get its answer), ``unanswered`` (done, and the request
    sent again since went unanswered for ``stall_ms``), ``waiting`` (under way and moving, or
    moved within ``stall_ms``) or ``stalled`` (nothing moved for ``stall_ms``); ``seen`` and
    ``since_ms`` are what to pass back next time (``seen`` is ``()`` once done)."""

    state: str
    seen: tuple[Any, ...]
    since_ms: int


def _copy_served(copy: Any) -> tuple[Any, Any]:
    """The rows and batches of a ``learner_copy`` (a sequencer of an earlier release shows none)."""
    if not isinstance(copy, Mapping):
        return (None, None)
    return (copy.get("rows"), copy.get("batches"))


def change_wait(
    info: Mapping[str, Any],
    name: str,
    add: bool,
    seen: tuple[Any, ...] | None,
    since_ms: int,
    now_ms: int,
    stall_ms: int = CHANGE_STALL_MS,
) -> ChangeWait:
    """Whether an operator's change of one shard, whose request went unanswered, is worth waiting for.

    ``info``: the shard's entry of the sequencer's ``members`` answer (``members``,
    ``committed_members``, ``learner``, ``learner_match``, ``learner_copy``); ``seen``/``since_ms``:
    the previous answer's (None at first). Any difference in the membership, the learner, its
    matched key or the rows and batches of its snapshot copy (not the age of its last batch, which
    changes at every answer) is progress; becoming done is too, but staying done is not: the answer
    a resend gets then is immediate, and a sequencer that never gives it must not be waited for
    without end."""
    committed = set(info.get("committed_members") or ())
    if (name in committed) == add:
        if seen != ():
            return ChangeWait("done", (), now_ms)
        return ChangeWait("unanswered" if now_ms - since_ms >= stall_ms else "done", (), since_ms)
    now_seen = (
        tuple(info.get("members") or ()),
        tuple(sorted(committed)),
        info.get("learner"),
        tuple(info.get("learner_match") or ()),
        _copy_served(info.get("learner_copy")),
    )
    if seen is None or now_seen != seen:
        return ChangeWait("waiting", now_seen, now_ms)
    return ChangeWait("stalled" if now_ms - since_ms >= stall_ms else "waiting", now_seen, since_ms)


def after_change_failure(code: str, refused: str | None) -> str:
    """Where an operator's change of one shard goes after the core it was asked at failed with
    ``code`` (``refused``: why that core refused the connection at its handshake, if it did):

    * ``silent``: no answer after the request left (``outcome_unknown``): it may be under way, and
      ``after_silence`` decides what follows;
    * ``unreachable``: no connection reached the core (``UNREACHABLE_CODE``), so nothing was asked and
      nothing changed: a sequencer that died, or one the view names that died since (a core that has not
      noticed yet names it for an election timeout). ``after_silence`` decides as for a silent one,
      except that whatever is asked next is a new request;
    * ``moved``: nothing written, the request reached a core that is not the sequencer
      (``SEQUENCER_MOVED_CODES``);
    * ``settling``: a sequencer whose generation has not committed yet (``REJECT_NOT_SETTLED``);
    * ``fail``: anything else, the shard's failure. So is a connection refused for this operator's key
      or the core's connections_max: waiting for another sequencer would not change that."""
    if code == "outcome_unknown":
        return "silent"
    if code == UNREACHABLE_CODE:
        return "unreachable" if refused is None else "fail"
    if code in SEQUENCER_MOVED_CODES:
        return "moved"
    if code == REJECT_NOT_SETTLED:
        return "settling"
    return "fail"


@dataclass(frozen=True)
class AfterSilence:
    """``after_silence``'s answer: ``action`` is ``reask`` (ask the change of ``sequencer`` as a new
    request), ``resend`` (send the silent sequencer the same request id again), ``wait`` (ask the
    cores again in ``SEQUENCER_POLL_MS``) or ``give_up`` (the outcome stays unknown)."""

    action: str
    sequencer: str | None = None


def after_silence(
    silent: str,
    named: Mapping[str, str | None],
    waited_ms: int,
    retries: int,
    wait_ms: int = SEQUENCER_WAIT_MS,
    retries_max: int = SEQUENCER_REASKS_MAX,
) -> AfterSilence:
    """What an operator's change of one shard does after the sequencer it asked (``silent``) left
    both the change and ``members`` unanswered (it crashed, or was paused), given the sequencer of
    the shard each core that answered ``members`` since names (``named``: core -> sequencer or None),
    ``waited_ms`` since the silence and the ``retries`` already made in that shard.

    A change is idempotent in its result, so a sequencer other than the silent one is asked it as a
    new request: if the silent one's entry survives in its log it answers ``already_member`` /
    ``not_member`` (every core uses the latest membership entry of its log, and a new sequencer
    commits what it holds with its first entry); if it was lost, the change is made anew. The one
    named by most cores is asked (a core that has not heard the election yet names the old one, or an
    older one, whose ``not_sequencer`` sends the command on). The silent core answering again and
    naming itself (a pause that ended) is sent the same request id. Nobody naming another sequencer
    within ``wait_ms`` leaves the outcome unknown, and so does a ``retries_max``-th retry."""
    if retries >= retries_max:
        return AfterSilence("give_up")
    counts: dict[str, int] = {}
    for sequencer in named.values():
        if sequencer and sequencer != silent:
            counts[sequencer] = counts.get(sequencer, 0) + 1
    if counts:
        return AfterSilence("reask", min(counts, key=lambda sequencer: (-counts[sequencer], sequencer)))
    if named.get(silent) == silent:
        return AfterSilence("resend", silent)
    return AfterSilence("give_up" if waited_ms >= wait_ms else "wait")
