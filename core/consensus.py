"""Per-shard sequencer election and quorum replication among core nodes (a pure Raft core).

Theory of operation
-------------------
Every core node runs one ``ShardConsensus`` per shard. It is a pure state machine: it never
touches a socket, a file or a clock. The driver feeds it events through ``step(event, now_ms)``
and executes the effects it returns.

* Roles. A core is a FOLLOWER, a CANDIDATE or the SEQUENCER (Raft's leader) of its shard. The
  *generation* is Raft's term: it grows by one at each election and is persisted (together with the
  vote) before it is used in any message.
* Election. A follower that hears nothing from a sequencer for a randomised election timeout
  (``election_timeout_ms_min..max``) persists generation g+1 and its vote for itself, then asks the
  other members for their vote. A member grants at most one vote per generation (persisted before the
  reply is sent), and only to a candidate whose last appended tx key is at least its own. A candidate
  with the votes of a majority becomes sequencer.
* Vote floor (``PersistedState.vote_floor``). A core rebuilt on an empty disk lost entries that may
  be committed because it held them; ``core.recovery`` gives it the highest log key its peers held
  when it recovered. Until its own log reaches that key, it counts a candidate up to date only at
  or past it, and it does not campaign (its vote for itself would not be judged by the floor).
* Pre-vote (Raft thesis 9.6). Before it bumps the generation, a follower whose election timeout
  expired asks the others whether they *would* vote for it in g+1 (``PreVoteRequest``); nobody
  persists or adopts anything for a pre-vote. Only with a majority of would-be votes does it start
  the real election. So a core that was paused, restarted or partitioned, and cannot win, never
  raises the generation and never deposes a healthy sequencer.
* Stickiness (thesis 4.2.3). A core that heard the current sequencer within
  ``election_timeout_ms_min`` (or is the sequencer) refuses pre-votes and ignores vote requests,
  without adopting their generation. This is also what makes the read lease below safe; for the
  same reason a core that (re)starts behaves as if it had just heard a sequencer.
* Election timer. It is reset when this core starts a (pre-)election, grants a vote, or hears the
  sequencer of its generation; never by a refused vote or by merely adopting a higher generation
  (else a candidate that cannot win would keep the one that can from ever timing out).
* Replication. The sequencer assigns tx keys ``(generation, counter)``; the counter restarts at 1 in
  each generation, so tx keys ordered as tuples are Raft's (term, index) order. Its first entry in a
  generation has no ops (Raft's no-op): once it commits, every earlier entry is settled. Entries are
  chained by digest (``rlog.types.make_entry``). Each append carries the previous tx key and its
  digest; a follower accepts it only if its own log has that key with that digest, truncates a
  conflicting *uncommitted* tail, and never a committed entry (``ConsensusInvariantError``). An
  entry of a later generation than its append is refused (Raft: no entry's term exceeds its
  leader's): a protocol violation, unanswered. So is an entry that records a cluster version this
  core does not speak (``own_versions``; ``core.versions``, "A follower's own check"), but the
  entries of the append before it are taken (and answered) as an append of those alone would be;
  it leaves the follower unable to go on past them (``stuck_reason``: the driver serves no read of
  the shard) until its log passes that key. A follower that refuses a mismatch
  says where it stands (last and committed keys); the sequencer resumes there, and ignores an
  answer whose committed key its own log does not hold. An answer to the sequencer's probe that
  acknowledges less than the probe carried is such a refusal (``_refused_probe``): until the next
  heartbeat, which probes again (the follower may have been upgraded since) with the refused entry
  alone, that follower is sent no entries, so that a stuck follower costs one entry resent a
  heartbeat interval, not an append a round trip.
* Batches. The proposals of one driver turn are appended one entry each, but sent only at
  ``BatchEnded``: every caught-up follower then gets them in one append (cut by
  ``entries_per_append_max`` and ``append_bytes_max``), with up to ``appends_in_flight_max`` appends
  unanswered per follower (pipelining; one while probing). Followers that are behind get entries
  from the log as their replies arrive; heartbeats resend what was not acknowledged. A membership
  entry is batched like any proposal, but in force from when it is appended (``core.membership``):
  the batch goes to the new set's voters.
* Lazy followers (thrifty replication). A commit waits for a majority only, so with more voting
  followers than that needs, the sequencer sends each batch at once only to the *eager* ones, as
  many as the commit counts (a majority, less the sequencer itself when it votes): the non-probing
  voters that answer, the eager ones before the lazy ones, then by match key (``_choose_lazy``). The
  others are *lazy*: they are fed what accumulated (``_feed``) at most every ``lazy_feed_interval_ms``
  (capped at the heartbeat interval; 0 turns this off), and an answer sends them more at once only
  while they are a full append or more behind (catching up). A batch with an entry that is more
  than rows (a table, an index, a membership) goes to every follower at once. A lazy follower
  therefore takes one append, one fsync and one loop turn for many of the sequencer's turns: at one
  client its CPU a write falls to a sixth, and the machine the other two share is quieter. If an
  eager follower stops answering, the lazy one's next feed still commits everything up to it (the
  commit is delayed by at most the interval), and once its appends went unanswered for an interval
  a lazy one that answers takes its place. Laziness changes when entries are sent, never which: the
  commit rule, the lease and elections are untouched. A lazy follower applies, answers reads waiting
  for a key and pushes to its replicants up to an interval later than an eager one; but a core that
  asks for a read index (a linearizable query or a replicant's read, which then waits to apply that
  key) makes the driver step ``FeedRequested``, and the lazy followers are fed at once.
* Commit. An entry is committed when a majority of the voters of the latest membership in the log
  (the sequencer counts when it is one of them) have persisted it and it belongs to the current
  generation; earlier entries commit with it (Raft, section 5.4.2).
  Followers learn the commit key from appends. When the commit key moves and a follower that has
  the committed entries was not told it, the sequencer tells it within ``commit_notice_delay_ms``
  (at most half a heartbeat interval): with the next batch if one goes out by then, else with an
  empty append (a commit notice, at most one per follower), so followers apply, answer reads
  waiting for a key and push to their replicants without waiting for the next heartbeat. Under
  load the next turn's batch carries it, and the follower applies in the transaction that appends.
  Only a reply that acknowledges new entries frees a place among the appends in flight. A follower
  leaves a commit notice unanswered when it answered an append of this generation less than half a
  heartbeat interval ago (``_notice_quiet_ms``): the answer would acknowledge nothing, and the one
  before fed the lease a moment ago. Every other append is answered (entries, failures, heartbeats).
* Heartbeats go to a follower that was not sent an append with entries, or not heard, within the
  last heartbeat interval (``_fed_by_appends``): under load, the appends do their work.
* Resends. A heartbeat resends the entries in flight to a follower (from its match key) only when
  none was acknowledged for a heartbeat interval (``_answering``): a lost append is found either
  so or by the failed answer to the next one. Meanwhile the heartbeat is an empty append at the
  follower's match key, and the follower does not decode, check and skip entries it already has.
* Appends before the sequencer's fsync (thesis 10.2.1). The sequencer's appends are marked
  ``Send.before_persisted``: the driver may send them before its own commit, so the followers'
  fsyncs overlap the sequencer's. The sequencer therefore counts itself toward a majority only up
  to what the driver reported durable with ``Persisted``. Appends are never marked so while a
  ``PersistState`` of this machine is not durable (a force start's generation must be durable
  before any core hears of it).
* Linearizable reads (thesis 6.4, ``read_index``). The sequencer may answer a linearizable read,
  a read-index request or a failed guard only (1) once an entry of its own generation has committed
  (before that its committed key may be behind what the previous sequencer acknowledged) and (2)
  while it holds a lease: a majority (counting itself) answered one of *this generation's* appends
  that it sent within the last ``election_timeout_ms_min / 2`` (appends carry their send time,
  replies echo it). Each of them heard this sequencer after that send, so by stickiness none will
  vote for another one before an election timeout has passed since: no newer committed key can
  exist. This assumes clocks that run at similar rates (half an election timeout is the margin),
  not bounded message delays. Any other frame (a vote, a pre-vote, another shard's traffic) says
  nothing about this generation and does not count.
* Fencing. Messages of a stale generation are refused and answered with the current generation, so
  a paused-and-resumed sequencer learns it was replaced. A sequencer that has not heard from a
  majority within ``election_timeout_ms_min`` steps down and fails its pending proposals.
* Force start. When a majority is gone for good, an operator can make one core sequencer of a new
  generation with a reduced membership (``ForceStartRequested``). See ``_force_start`` for what may be lost.
  The driver first asks every member for its generation; the members that answered are *reached*.
  A force start is refused (``ForceStartRefused``) while this core reaches a majority of the current
  members: then an election can pick a sequencer and nothing needs to be lost, and forcing would
  leave out cores that are alive, and while a reached member's log is ahead of this core's (its
  last key is later: forcing it instead loses nothing that forcing this core would keep). The forced
  generation is above every generation a reached member has seen, so every reached member follows
  the forced sequencer. The forced generation's first entry records the reduced membership
  (``membership.forced_start_entry``): every member holding it committed is *forced* (persisted), as
  the forced core is from the start, and so is a member that installs a snapshot past it (the offer
  says so: ``core.snapshot.state_after_install``), so the cores left out are still told once the
  forced core is gone. A forced member elected later records the forced membership again in its first
  entry (``membership.elected_first_ops``): a member that learned it only from appends (the forced
  start's entry was lost with the forced core's undurable tail) is forced once that entry commits.
  A forced core that hears from a core outside its (reduced) membership answers with an
  ``ExclusionNotice`` (at most once per ``EXCLUSION_NOTICE_INTERVAL_MS`` per core), unless its log goes
  past this core's committed key: a core added since, whose add entry has not reached this core
  (``membership.heard_after_forced_start``, ``_heeds_outsider``); a core told that
  a forced membership left it out steps down, fails its pending writes, and stops taking part,
  unless the notice shows its sender behind it (a core added back ignores a member that has not
  persisted the entry adding it: ``_on_exclusion``). The exclusion is persisted
  (``PersistedState.excluded_generation``): restarted, the core would otherwise follow again, serving
  local reads of a state that no longer moves until a member of the forced generation told it again.
  Safety holds as long as fewer than a majority of the old members that were left out ever come
  back (they must be rebuilt first): left-out cores alone cannot form a quorum of the old membership,
  and reached cores ignore them. A left-out core rejoins through an ordinary membership change
  (``core.membership``): the forced sequencer replicates to it as a learner, and the entry that adds
  it ends its exclusion. If its log holds committed entries the forced sequencer lacks, the append
  would replace them and ``ConsensusInvariantError`` stops the shard there: rebuild it (empty data
  directory) and add it again.
* Membership changes: see ``core.membership`` (one core at a time, through the log). A learner the
  driver's version probes find unable to read the shard's log is dropped at once (``LearnerRefused``).
* Full disk (``rlog.disk``). The driver steps ``DiskFull`` when a write failed for want of space
  (after rebuilding the machine from disk: what the failed turn did is gone) and ``DiskFreed`` once a
  probe wrote durably again. Meanwhile this core can persist nothing, so it takes no part that
  would need it: a sequencer steps down (its pending proposals fail with ``disk_full``: their
  entries may still commit elsewhere) so that the majority elects another; proposals, membership
  changes and force starts are refused; peer messages are dropped unanswered (acknowledging an
  append would count entries it could not persist toward a commit; granting a vote or adopting a
  generation must be persisted first); and it never (pre-)campaigns, so it is not elected while
  full. To the others it looks like a core that is down. Once freed it follows again, and may
  campaign after a fresh election timeout.

Driver contract
---------------
1. Build the machine from what is persisted: ``PersistedState`` (generation, vote, members, forced,
   vote floor, exclusion),
   the log (through a ``LogView``) and the committed (= applied) key. Anything not persisted is lost.
2. Call ``step`` with a non-decreasing ``now_ms`` from a monotonic clock. Deliver ``Ticked`` at least
   every ``heartbeat_interval_ms / 2`` (``next_deadline_ms()`` says when the next one matters).
3. Execute the returned effects *in list order*, all of them, before the next ``step``:
   ``PersistState``, ``PersistEntries`` and ``TruncateLog`` must be durable (fsync) before any later
   effect runs (except a ``Send`` marked ``before_persisted``, below); this is how "persist, then
   send" is guaranteed. The ``LogView`` must reflect every
   executed effect. ``Send`` is fire-and-forget (loss, duplication and reordering are tolerated).
   ``Commit(up_to)`` means: apply, in tx-key order, every persisted entry up to ``up_to`` and record
   the applied key in the same SQLite transaction. ``ProposalCommitted`` comes after the ``Commit``
   that covers it: answer the client once that entry is applied. Step ``BatchEnded`` once the
   turn's proposals are in (before the turn's commit); without it, entries go at the next reply
   or heartbeat only. A ``Send`` marked ``before_persisted`` may be sent before the pending
   persistence effects are durable (every other one only after); step ``Persisted`` once they
   are, or the sequencer never counts its own entries.
4. ``ProposalRejected`` (nothing was written; forward to ``sequencer`` or answer ``reason``) and
   ``ProposalFailed`` (the outcome is unknown: the entry may still commit under a later sequencer,
   so answer the client with that reason; a retry with the same request id is the client's way to
   find out). ``SnapshotNeeded`` asks the driver to recover that follower by snapshot (step
   ``SnapshotRequested`` when a follower asks for one: ``core.snapshot``).
   ``RoleChanged``, ``ForceStarted`` and ``ProtocolViolation`` are for logs and metrics.
5. ``ConsensusInvariantError`` means a safety rule would be broken (for example truncating a
   committed entry): stop serving the shard and alert the operator; never catch and continue.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mnesite.core import membership
from mnesite.core.membership import MEMBERS_MAX, membership_changes
from mnesite.core.versions import first_unspoken, unspoken_entry
from mnesite.rlog.disk import ERROR_DISK_FULL, DiskFreed, DiskFull
from mnesite.rlog.limits import require_positive_ints
from mnesite.rlog.replication import Ticked
from mnesite.rlog.types import ROW_OPS, ZERO_KEY, Entry, MembersOp, Op, TxKey, chain_break, make_entry
from mnesite.rlog.versions import THIS_RELEASE, Announcement
from msgspec import Struct

# Generations are persisted as SQLite integers and a campaign adds one: stay below 2**63 - 1.
GENERATION_MAX = 2**63 - 2
EXCLUSION_NOTICE_INTERVAL_MS = 1000  # how often a left-out core is told at most
# The violation a message from outside the membership is (also from an honest core that was removed
# or left out, while its messages are in flight: the simulator tells it from the others by this).
NOT_A_MEMBER = "not a member of"

REJECT_NOT_SEQUENCER = "not_sequencer"
REJECT_BUSY = "busy"
REJECT_TOO_MANY_OPS = "too_many_ops"
REJECT_TOO_LARGE = "too_large"
REJECT_DISK_FULL = ERROR_DISK_FULL


class ConsensusInvariantError(RuntimeError):
    """A safety rule of the protocol would be broken; the shard must stop."""


class ConsensusConfigError(ValueError):
    """A configuration or construction argument is invalid."""


class Role(enum.Enum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    SEQUENCER = "sequencer"


@dataclass(frozen=True)
class ConsensusConfig:
    election_timeout_ms_min: int = 800
    election_timeout_ms_max: int = 1600
    heartbeat_interval_ms: int = 100
    # Entries in one append message; bounds message size and the work of one step.
    entries_per_append_max: int = 64
    # Bytes of entries in one append (``Entry.size_bytes``; an entry larger than this goes
    # alone): 64 entries of 1,000 rows would otherwise exceed a follower's frame_bytes_max.
    append_bytes_max: int = 512 * 1024
    # Bytes of one proposed entry (``Entry.size_bytes``), at most: an entry goes to the followers in an
    # append (and to replicants in a push), one frame that must stay within their frame_bytes_max with
    # the message around it. A larger one would be refused by every follower, at every resend: the
    # shard could commit nothing after it. The node derives it from frame_bytes_max (core.node).
    entry_bytes_max: int = 4 * 1024 * 1024 - 4096
    # Appends carrying entries sent to one follower and not yet answered (pipelining depth).
    appends_in_flight_max: int = 4
    # Proposals accepted by the sequencer and not yet committed; bounds the uncommitted tail.
    pending_proposals_max: int = 1024
    ops_per_entry_max: int = 10_000
    # A peer's message may raise our generation by at most this much: generations grow by one per
    # election, so a larger jump is a hostile or broken peer (and 2**63-1 would overflow SQLite).
    generation_jump_max: int = 1_000_000
    # How long a move of the commit key may wait for an append that carries it before the sequencer
    # sends a commit notice (at most half a heartbeat interval: ``ShardConsensus._notice_delay_ms``).
    commit_notice_delay_ms: int = 10
    # How long a core being added may take to catch up (as a learner) before the change is refused.
    learner_catch_up_ms_max: int = 600_000
    # How often a lazy follower is fed what accumulated for it ("Lazy followers" above; capped at the
    # heartbeat interval); 0: every follower is sent every batch at once.
    lazy_feed_interval_ms: int = 20

    def __post_init__(self) -> None:
        require_positive_ints(self, ConsensusConfigError, zero_allowed=("lazy_feed_interval_ms",))
        if self.election_timeout_ms_max < self.election_timeout_ms_min:
            raise ConsensusConfigError("election_timeout_ms_max must be >= election_timeout_ms_min")
        # Followers must hear several heartbeats per election timeout, or they would campaign
        # against a healthy sequencer whenever one heartbeat is lost.
        if self.heartbeat_interval_ms * 2 > self.election_timeout_ms_min:
            raise ConsensusConfigError("heartbeat_interval_ms must be at most half of election_timeout_ms_min")


class LogView(Protocol):
    """Read-only view of this node's persisted log of one shard (driver: SQLite; simulator: memory).

    Retention may remove old committed entries; ``trimmed_key`` is the key of the last removed entry
    (ZERO_KEY when nothing was removed) and ``digest_at`` must still answer for it.
    """

    def last_key(self) -> TxKey:
        """Tx key of the last persisted entry (ZERO_KEY for an empty log)."""
        ...

    def digest_at(self, key: TxKey) -> bytes | None:
        """Digest after the entry at ``key`` (GENESIS_DIGEST for ZERO_KEY); None if there is no such entry."""
        ...

    def entries_after(self, key: TxKey, limit: int) -> Sequence[Entry]:
        """At most ``limit`` entries with tx key > ``key``, in order."""
        ...

    def trimmed_key(self) -> TxKey:
        """Key of the last entry removed by retention; ZERO_KEY if none was removed."""
        ...


@dataclass(frozen=True)
class PersistedState:
    """What a core must persist (and fsync) for one shard before acting on it."""

    generation: int
    voted_for: str | None
    members: tuple[str, ...]
    forced: bool = False
    # A core rebuilt on an empty database (``core.recovery``): the highest log key its peers reported
    # when it recovered. It stands in for the log the core lost when it judges a candidate's log.
    vote_floor: TxKey = ZERO_KEY
    # The forced generation that left this core out of the shard (``ExclusionNotice``; None: not left
    # out). Persisted, so that a restart does not make it a follower again that serves local reads of a
    # state that no longer moves; cleared only by the entry that adds it back (``_note_changes``).
    excluded_generation: int | None = None


@dataclass(frozen=True)
class JournalAge:
    """ARTEMIS-3340: how far this node's journal has reached."""

    generation: int
    committed_key: TxKey
    last_key: TxKey


@dataclass(frozen=True)
class ConsensusStatus:
    shard: str
    name: str
    role: Role
    generation: int
    sequencer: str | None
    voted_for: str | None
    committed_key: TxKey
    last_key: TxKey
    members: tuple[str, ...]
    forced: bool
    # For the sequencer: the last tx key each follower is known to have persisted (its lag).
    follower_match_keys: tuple[tuple[str, TxKey], ...] = ()
    pending_proposals: int = 0
    # The membership as of the committed key (``members`` is the latest in the log, committed or not).
    committed_members: tuple[str, ...] = ()
    # A core being added that is still catching up (sequencer only).
    learner: str | None = None
    # The driver said the disk is full (DiskFull): this core takes no part until DiskFreed.
    disk_full: bool = False
    # Rebuilt on an empty disk (``PersistedState.vote_floor``): until ``last_key`` reaches it, this core
    # votes only for logs at or past it and does not campaign (ZERO_KEY: no floor).
    vote_floor: TxKey = ZERO_KEY
    # The followers the sequencer feeds lazily ("Lazy followers"; sequencer only).
    lazy_followers: tuple[str, ...] = ()
    # A removal waiting for the set it leaves to answer before it is appended (sequencer only).
    removal: PendingRemoval | None = None


@dataclass(frozen=True)
class PendingRemoval:
    """A removal of ``name`` asked at ``asked_ms`` and not appended yet: it is once ``answered`` (the
    cores of the set it leaves that count, ``core.membership.removal_answers``) reach ``needed``, and
    refused ``no_quorum_after_change`` if that has not happened by ``asked_ms + timeout_ms``."""

    name: str
    asked_ms: int
    answered: tuple[str, ...]
    needed: int
    timeout_ms: int

    def to_json(self, now_ms: int) -> dict[str, Any]:
        """What ``status`` and ``cluster members`` show of it at ``now_ms``."""
        return {
            "name": self.name,
            "waiting_ms": max(0, now_ms - self.asked_ms),
            "answered": list(self.answered),
            "needed": self.needed,
            "timeout_ms": self.timeout_ms,
        }


# ---------------------------------------------------------------- peer messages


@dataclass(frozen=True)
class VoteRequest:
    generation: int
    last_key: TxKey


@dataclass(frozen=True)
class VoteReply:
    generation: int
    granted: bool


@dataclass(frozen=True)
class PreVoteRequest:
    """Would you vote for me in ``generation`` (our generation + 1)? Changes nothing at the receiver."""

    generation: int
    last_key: TxKey


@dataclass(frozen=True)
class PreVoteReply:
    """``generation`` is the one asked about when granted, the replier's own when refused."""

    generation: int
    granted: bool


@dataclass(frozen=True)
class AppendRequest:
    generation: int
    prev_key: TxKey
    prev_digest: bytes
    commit_key: TxKey
    members: tuple[str, ...]
    entries: tuple[Entry, ...] = ()
    # The sequencer's clock when it sent this append; echoed in the reply, so that the read lease
    # counts from when the follower could at the earliest have heard it, however late the reply.
    sent_ms: int = 0


@dataclass(frozen=True)
class AppendReply:
    generation: int
    success: bool
    # On success: the last key of the append, now known to match the sequencer's log.
    match_key: TxKey
    # The replier's last appended and committed keys: on failure they tell the sequencer where to resume.
    last_key: TxKey
    commit_key: TxKey
    # ``sent_ms`` of the append this answers.
    request_sent_ms: int = 0


@dataclass(frozen=True)
class ExclusionNotice:
    """To a core outside the sender's (force-reduced) membership: you were left out. ``key`` is the
    receiver's last key as the sender saw it, ``digest`` the sender's digest there (None: not held)."""

    generation: int
    members: tuple[str, ...]
    key: TxKey
    digest: bytes | None


PeerMessage = VoteRequest | VoteReply | PreVoteRequest | PreVoteReply | AppendRequest | AppendReply | ExclusionNotice

# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class MessageReceived:
    sender: str
    message: PeerMessage


class Proposed(Struct, frozen=True):
    """A client write, already turned into result ops, reached this core."""

    ops: tuple[Op, ...]
    request_id: str | None = None


@dataclass(frozen=True)
class ProposedBatch:
    """The client writes a driver took in one loop turn, in arrival order: proposed as ``Proposed``
    one after another would be, with one ``PersistEntries`` for all of them (the driver's per-write
    cost is one step, one log insert and one commit check per batch, not per write)."""

    proposals: tuple[Proposed, ...]
    # Pack each entry's runs of rows once (``rlog.types.pack_ops``): the driver's shard is at a cluster
    # version whose members all decode them (``rlog.versions.packs_runs``).
    runs: bool = False


@dataclass(frozen=True)
class BatchEnded:
    """The driver proposed every write of its loop turn: send the turn's new entries, one append
    per follower (instead of one append per entry)."""


@dataclass(frozen=True)
class Persisted:
    """The driver made every effect returned so far durable (its turn's commit and fsync are done)."""


@dataclass(frozen=True)
class SnapshotRequested:
    """``follower`` asked this core for a snapshot offer (``core.snapshot``: an install it began was
    abandoned, so its rows are half copied although this log may still retain its position)."""

    follower: str


@dataclass(frozen=True)
class FeedRequested:
    """A core asked this sequencer for a read index (a linearizable query at a follower, or a replicant's
    linearizable read), and will wait to apply that key: the lazy followers are fed now, not at their
    interval (one of them may be the asker; which one is not said)."""


@dataclass(frozen=True)
class ForceStartRequested:
    """Operator: make this core sequencer of a new generation with the members it reached.

    ``reached``: (member, highest generation it has seen) for every other core that answered the
    driver's probe just now. Cores that did not answer are left out of the new membership.
    ``last_keys``: (member, last key of its log) for those of them whose answer says it: a forced
    start is refused while one of them holds more of the log (see ``_force_start``).
    ``rows_lost``: the driver's word that this core's rows of the shard are half copied by an
    abandoned snapshot install (``core.snapshot``, "Re-offer"): refused, see ``_force_start``.
    """

    reached: tuple[tuple[str, int], ...]
    last_keys: tuple[tuple[str, TxKey], ...] = ()
    rows_lost: bool = False


@dataclass(frozen=True)
class MembershipChangeRequested:
    """Operator: add (after it caught up as a learner) or remove one core (``core.membership``).

    Answered like a proposal: ``ProposalCommitted`` once the membership entry committed,
    ``ProposalRejected`` (nothing written; ``membership.ALREADY_DONE`` reasons mean it already holds)
    or ``ProposalFailed``.
    """

    name: str
    add: bool
    endpoint: str = ""
    request_id: str | None = None


@dataclass(frozen=True)
class LearnerRefused:
    """The driver's probes found that ``name``, the learner of a change, cannot read the shard's log
    (``core.versions.member_refusal``: ``reason``): the change is refused now (``ProposalRejected``
    with ``membership.REJECT_INCOMPATIBLE_VERSION``) and the learner is sent nothing more, instead of
    a log it cannot decode until the catch-up deadline. Any other name: nothing happens."""

    name: str
    reason: str


Event = (
    Ticked
    | MessageReceived
    | Proposed
    | ProposedBatch
    | BatchEnded
    | Persisted
    | SnapshotRequested
    | FeedRequested
    | ForceStartRequested
    | MembershipChangeRequested
    | LearnerRefused
    | DiskFull
    | DiskFreed
)

# ---------------------------------------------------------------- effects


@dataclass(frozen=True)
class PersistState:
    state: PersistedState


@dataclass(frozen=True)
class PersistEntries:
    """Append these entries (contiguous, following the current last key) to the log."""

    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class TruncateLog:
    """Remove every entry with a tx key greater than ``after_key`` (all uncommitted)."""

    after_key: TxKey


@dataclass(frozen=True)
class Send:
    to: str
    message: PeerMessage
    # True: an append of this sequencer that may go out before the driver's pending writes are
    # durable (Raft thesis 10.2.1); the sequencer counts itself only at ``Persisted``. Never set
    # while a PersistState of this machine is not durable yet (an append would announce a
    # generation that a crash could still take back).
    before_persisted: bool = False


@dataclass(frozen=True)
class Commit:
    """Apply, in order, every persisted entry up to and including ``up_to``."""

    up_to: TxKey


class ProposalCommitted(Struct, frozen=True):
    request_id: str | None
    tx_key: TxKey


@dataclass(frozen=True)
class ProposalRejected:
    """Nothing was written. ``sequencer`` is the sequencer this node knows of (or None)."""

    request_id: str | None
    reason: str
    sequencer: str | None


@dataclass(frozen=True)
class ProposalFailed:
    """The sequencer stepped down before the entry committed; it may still commit later."""

    request_id: str | None
    tx_key: TxKey
    reason: str


@dataclass(frozen=True)
class SnapshotNeeded:
    """``follower`` needs entries after ``follower_key``, older than this log retains, or (``requested``)
    it asked for an offer (``SnapshotRequested``)."""

    follower: str
    follower_key: TxKey
    trimmed_key: TxKey
    requested: bool = False


@dataclass(frozen=True)
class RoleChanged:
    role: Role
    generation: int
    sequencer: str | None


@dataclass(frozen=True)
class ForceStarted:
    generation: int
    members: tuple[str, ...]
    last_key: TxKey
    committed_key: TxKey


@dataclass(frozen=True)
class ForceStartRefused:
    """Nothing changed: ``reason`` says why (for example: a majority is reachable)."""

    reason: str
    reached: tuple[str, ...]
    members: tuple[str, ...]


@dataclass(frozen=True)
class Excluded:
    """This core accepted that a forced start left it out: it takes no part in the shard any more.
    ``key`` and ``digest`` are the notice's, for comparing journals."""

    sender: str
    generation: int
    members: tuple[str, ...]
    key: TxKey
    digest: bytes | None


@dataclass(frozen=True)
class ProtocolViolation:
    sender: str
    reason: str


Effect = (
    PersistState
    | PersistEntries
    | TruncateLog
    | Send
    | Commit
    | ProposalCommitted
    | ProposalRejected
    | ProposalFailed
    | SnapshotNeeded
    | RoleChanged
    | ForceStarted
    | ForceStartRefused
    | Excluded
    | ProtocolViolation
)


# How many probes a sequencer remembers per follower (``_Progress.probes``). A heartbeat resends an
# unanswered probe, so when a round trip takes longer than a heartbeat interval the answer to a probe
# comes after later ones were sent: a few cover a round trip of a few heartbeat intervals.
PROBES_REMEMBERED = 4


@dataclass
class _Progress:
    """The sequencer's view of one follower."""

    match_key: TxKey = ZERO_KEY
    # Entries after sent_key are the next to send. While probing, sent_key is a guess.
    sent_key: TxKey = ZERO_KEY
    probing: bool = True
    in_flight: int = 0
    last_heard_ms: int = 0
    # Whether this follower answered since this progress was made: last_heard_ms starts at the
    # election (self-fencing gives every peer a timeout to answer), which is no proof it is up.
    answered: bool = False
    # When this follower last answered an append of this generation: what the read lease counts.
    lease_heard_ms: int | None = None
    snapshot_requested_ms: int | None = None
    # The highest key any append to this follower ended at (in this generation): a success reply
    # can acknowledge nothing beyond it.
    sent_key_max: TxKey = ZERO_KEY
    # The highest commit key any append told this follower (see _tell_commit).
    told_commit_key: TxKey = ZERO_KEY
    # Since when the appends in flight wait for an answer that acknowledges entries: the send of the
    # first of them, moved on by each reply that acknowledges new entries. A heartbeat resends what
    # is in flight only once this is a heartbeat interval old (see _on_tick).
    waiting_since_ms: int = 0
    # When an append with entries was last sent to this follower (see _fed_by_appends).
    appended_ms: int | None = None
    # The last probes with entries sent to this follower (at most PROBES_REMEMBERED), each as its
    # ``sent_ms`` and its last key: an answer to one of them can show a refusal (see _refused_probe).
    probes: tuple[tuple[int, TxKey], ...] = ()
    # When an empty append (a heartbeat, a commit notice) was last sent to this follower: an answer
    # to one sent in the ms of a probe could pass for the probe's (see _refused_probe).
    empty_sent_ms: int | None = None
    # Whether the follower's answer to such a probe refused an entry of it, and no answer since
    # acknowledged more: it is probed again only at each heartbeat.
    refused: bool = False
    # When this follower, while lazy, was last fed (or a feed was tried: one that sent nothing, as
    # for a follower past the log's trimmed key, is not tried again before the interval is over).
    fed_ms: int | None = None


@dataclass
class _Learner:
    """A core the sequencer is bringing up to date before the entry that adds it (``core.membership``)."""

    name: str
    endpoint: str
    request_id: str | None
    started_ms: int


@dataclass(slots=True)
class _Removal:
    """A removal the sequencer appends once a majority of the set it leaves answered an append sent
    since ``asked_ms`` (``core.membership.removal_heard``), or refuses after an election timeout."""

    name: str
    request_id: str | None
    asked_ms: int


class ShardConsensus:
    """Election and replication state of one shard on one core node."""

    def __init__(
        self,
        shard: str,
        name: str,
        log: LogView,
        state: PersistedState,
        committed_key: TxKey,
        config: ConsensusConfig,
        rng: random.Random,
        now_ms: int,
        own_versions: Announcement = THIS_RELEASE,
    ) -> None:
        members = tuple(sorted(set(state.members)))
        # A core outside its membership is a learner being added, or a removed core: it follows the
        # sequencer's appends but never campaigns (``core.membership``).
        if not members:
            raise ConsensusConfigError("a shard needs at least one member")
        if len(members) > MEMBERS_MAX:
            raise ConsensusConfigError(f"at most {MEMBERS_MAX} members, got {len(members)}")
        if state.generation < 0:
            raise ConsensusConfigError("generation must not be negative")
        self.shard = shard
        self.name = name
        self.config = config
        self._log = log
        self._rng = rng
        self._now_ms = now_ms
        # The cluster versions this core speaks: it persists no entry that moves the shard beyond them.
        self._own_versions = own_versions
        # The persisted membership is the one as of the committed key; membership entries after it
        # (``_changes``, read from the log below) override it: the latest one in the log counts.
        self._committed_members = members
        # The key of the membership entry ``_committed_members`` comes from (ZERO_KEY: not known here,
        # as after a restart, a snapshot or a forced start's first append).
        self._committed_members_key = ZERO_KEY
        self._changes: list[tuple[TxKey, tuple[str, ...]]] = []
        self._members = members
        self._learner: _Learner | None = None
        self._removal: _Removal | None = None
        self._forced = state.forced
        self._vote_floor = state.vote_floor
        # The forced generation that left this core out (ExclusionNotice; persisted, so a restart keeps
        # it): never campaign again until added back. None: not left out.
        self._excluded_generation = state.excluded_generation
        # Non-member -> when it was last told it is left out (bounded by MEMBERS_MAX entries).
        self._exclusion_told_ms: dict[str, int] = {}
        self._last_key = log.last_key()
        last_digest = log.digest_at(self._last_key)
        if last_digest is None:
            raise ConsensusInvariantError(f"log has no digest for its last key {self._last_key}")
        self._last_digest = last_digest
        if committed_key > self._last_key:
            raise ConsensusInvariantError(f"committed key {committed_key} is beyond the last key {self._last_key}")
        self._commit_key = committed_key
        scanned_key = committed_key
        while True:
            batch = log.entries_after(scanned_key, 1024)
            if not batch:
                break
            unspoken = unspoken_entry(batch, own_versions)
            if unspoken is not None:
                # Persisted while this core ran a release that speaks it, then rolled back: applying it
                # would move the shard (and the storage format) beyond what this release reads.
                raise ConsensusConfigError(f"the log holds {unspoken}")
            self._changes.extend(membership_changes(batch))
            scanned_key = batch[-1].tx_key
        if self._changes:
            self._members = self._changes[-1][1]
        # A generation seen in the log was in use; never go below it even if the state record lags.
        self._generation = max(state.generation, self._last_key.generation)
        self._voted_for = state.voted_for
        if self._generation != state.generation:
            # The state record lags the log (it should not): we may have voted in this generation,
            # so behave as if we voted for ourselves and never grant a vote in it.
            self._voted_for = name
        self._role = Role.FOLLOWER
        self._sequencer: str | None = None
        self._votes: set[str] = set()
        # Would-be votes of the pre-vote under way for generation + 1 (None when there is none).
        self._pre_votes: set[str] | None = None
        # When this core last heard the sequencer of its generation (stickiness, see above). A core
        # that (re)starts may have answered a sequencer's append just before it stopped, and that
        # sequencer may be counting the answer for its read lease: so it behaves as if it had heard
        # a sequencer at start, and votes for nobody else during the first election timeout.
        self._sequencer_heard_ms: int | None = now_ms if len(members) > 1 else None
        self._progress: dict[str, _Progress] = {}
        # The generation and time of this core's last successful answer to an append (see _notice_quiet_ms).
        self._answered: tuple[int, int] = (-1, now_ms)
        # Request ids of this sequencer's uncommitted proposals, in tx key order.
        self._pending: dict[TxKey, str | None] = {}
        # Entries this sequencer appended since the last BatchEnded, not sent yet (see _send_batch).
        self._batch: list[Entry] = []
        self._batch_prev_digest = self._last_digest  # the digest the batch's first entry follows
        # The last key of this core's log known durable (Persisted), and whether every PersistState
        # is: the sequencer counts itself in a majority only up to ``_durable_key``.
        self._durable_key = self._last_key
        self._state_durable = True
        self._heartbeat_due_ms = now_ms
        # When a commit notice is due (see _schedule_notice); None: none is scheduled.
        self._notice_due_ms: int | None = None
        # The followers fed lazily ("Lazy followers"; chosen by _choose_lazy while sequencer).
        self._lazy: frozenset[str] = frozenset()
        self._lazy_interval_ms = min(config.lazy_feed_interval_ms, config.heartbeat_interval_ms)
        self._election_deadline_ms = now_ms
        self._reset_election_deadline()
        self._out: list[Effect] = []
        # DiskFull until DiskFreed: nothing may be persisted (see "Full disk" above).
        self._disk_full = False
        # (key, why) of the last append entry refused for a cluster version this core does not speak,
        # until its log passes that key (see ``stuck_reason``).
        self._stuck: tuple[TxKey, str] | None = None

    # ------------------------------------------------------------ queries

    @property
    def role(self) -> Role:
        return self._role

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def sequencer(self) -> str | None:
        return self._sequencer

    @property
    def committed_key(self) -> TxKey:
        return self._commit_key

    @property
    def last_key(self) -> TxKey:
        return self._last_key

    @property
    def stuck_reason(self) -> str | None:
        """Why this follower cannot advance (None: it can): it refused the sequencer's entry at a key
        for a cluster version it does not speak (``core.versions``, "A follower's own check"). Its
        applied state stops before that entry while the others go on, so its local reads would grow
        ever staler: the driver serves none of the shard and says why. Cleared once its log passes
        that key (a sequencer whose log replaced the entry); a restart on a release that speaks the
        version starts without it."""
        return None if self._stuck is None else self._stuck[1]

    @property
    def follows_sequencer(self) -> bool:
        """Whether this core follows a sequencer of the shard, as its replicants are told (its journal's
        and its agents' ``hears_sequencer``): it knows one (itself, as sequencer) and its log can go on
        (``stuck_reason`` None). A stuck core's committed key stops while the others' goes on: its
        replicas must move to another core (``replicant.upstream``), not serve ever staler reads. The
        rule lives here so that the driver and the simulator run the same one."""
        return self._sequencer is not None and self._stuck is None

    @property
    def excluded(self) -> bool:
        """A forced start left this core out (it was told, before or since its start: persisted); it
        takes no part until added back."""
        return self._excluded_generation is not None

    @property
    def excluded_generation(self) -> int | None:
        """The forced generation that left this core out (``core.rules.not_serving_reason`` names it);
        None: not left out."""
        return self._excluded_generation

    @property
    def lazy_followers(self) -> frozenset[str]:
        """The followers this sequencer feeds lazily ("Lazy followers"); empty elsewhere."""
        return self._lazy

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    def journal_age(self) -> JournalAge:
        return JournalAge(self._generation, self._commit_key, self._last_key)

    @property
    def committed_members(self) -> tuple[str, ...]:
        return self._committed_members

    @property
    def voter(self) -> bool:
        """This core is in its latest membership: it votes, campaigns and counts in quorums."""
        return self.name in self._members

    def persisted_state(self) -> PersistedState:
        return PersistedState(
            self._generation,
            self._voted_for,
            self._committed_members,
            self._forced,
            self._vote_floor,
            self._excluded_generation,
        )

    def status(self) -> ConsensusStatus:
        matches: tuple[tuple[str, TxKey], ...] = ()
        if self._role is Role.SEQUENCER:
            matches = tuple((peer, progress.match_key) for peer, progress in sorted(self._progress.items()))
        return ConsensusStatus(
            shard=self.shard,
            name=self.name,
            role=self._role,
            generation=self._generation,
            sequencer=self._sequencer,
            voted_for=self._voted_for,
            committed_key=self._commit_key,
            last_key=self._last_key,
            members=self._members,
            forced=self._forced,
            follower_match_keys=matches,
            pending_proposals=len(self._pending),
            committed_members=self._committed_members,
            learner=self._learner.name if self._learner is not None else None,
            disk_full=self._disk_full,
            vote_floor=self._vote_floor,
            lazy_followers=tuple(sorted(self._lazy)),
            removal=self._pending_removal(),
        )

    def _pending_removal(self) -> PendingRemoval | None:
        removal = self._removal
        if removal is None or self._role is not Role.SEQUENCER:
            return None
        new_members = membership.changed_members(self._members, removal.name, add=False)
        answered = membership.removal_answers(
            new_members, self.name if self.voter else None, self._answered_ms(), removal.asked_ms
        )
        return PendingRemoval(
            removal.name,
            removal.asked_ms,
            answered,
            membership.majority(new_members),
            self.config.election_timeout_ms_min,
        )

    def read_index(self, now_ms: int) -> TxKey | None:
        """The committed key a linearizable read must wait for, or None if this core may not serve one now.

        Only the sequencer answers, only once an entry of its generation has committed, and only
        while a majority acknowledged this generation's appends within the lease (theory above).
        """
        if self._role is not Role.SEQUENCER or not self._own_generation_committed():
            return None
        lease_ms = self.config.election_timeout_ms_min // 2
        holders = int(self.voter) + sum(
            1
            for peer, progress in self._progress.items()
            if peer in self._members
            and progress.lease_heard_ms is not None
            and now_ms - progress.lease_heard_ms < lease_ms
        )
        if holders < self._majority():
            return None
        return self._commit_key

    def _own_generation_committed(self) -> bool:
        # Thesis 6.4: until its no-op commits, a new sequencer does not know the latest committed key.
        return self._commit_key.generation == self._generation

    def _counts_for_lease(self, message: PeerMessage) -> bool:
        # Only an answer to one of this generation's appends proves that the follower heard this
        # sequencer recently (and so will not vote for another one for a while).
        return isinstance(message, AppendReply) and message.generation == self._generation

    def hears_sequencer(self) -> bool:
        """Stickiness: this core is the sequencer or heard it within the minimum election timeout."""
        if self._role is Role.SEQUENCER:
            return True
        heard_ms = self._sequencer_heard_ms
        return heard_ms is not None and self._now_ms - heard_ms < self.config.election_timeout_ms_min

    def next_deadline_ms(self) -> int:
        """The earliest time at which a ``Ticked`` may change something."""
        if self._disk_full:
            # Ticks change nothing until DiskFreed; a deadline in the past would spin the driver.
            return self._now_ms + self.config.election_timeout_ms_min
        if self._role is Role.SEQUENCER:
            due_ms = self._heartbeat_due_ms
            if self._notice_due_ms is not None:
                due_ms = min(due_ms, self._notice_due_ms)
            for peer in self._lazy:
                progress = self._progress.get(peer)  # None: a member removed since the last choice
                if progress is not None and self._feedable(progress):
                    due_ms = min(due_ms, self._feed_due_ms(progress))
            if self._removal is not None:
                due_ms = min(due_ms, self._removal.asked_ms + self.config.election_timeout_ms_min)
            return due_ms
        if self.excluded or not self.voter:
            # It never campaigns (a removed core, a learner, a core a forced start left out): its
            # election deadline passes and stays passed, and the driver would poll without waiting.
            return self._now_ms + self.config.election_timeout_ms_min
        return self._election_deadline_ms

    # ------------------------------------------------------------ the entry point

    def step(self, event: Event, now_ms: int) -> list[Effect]:
        if now_ms < self._now_ms:
            raise ValueError(f"time went backwards: {now_ms} < {self._now_ms}")
        self._now_ms = now_ms
        self._out = []
        if isinstance(event, DiskFull):
            self._on_disk_full(event)
        elif isinstance(event, DiskFreed):
            self._on_disk_freed()
        elif self._disk_full:
            self._while_disk_full(event)
        elif isinstance(event, Ticked):
            self._on_tick()
        elif isinstance(event, MessageReceived):
            self._on_message(event.sender, event.message)
        elif isinstance(event, Proposed):
            self._on_proposed(event)
        elif isinstance(event, ProposedBatch):
            self._on_proposed_batch(event)
        elif isinstance(event, BatchEnded):
            self._send_batch()
            self._schedule_notice()
        elif isinstance(event, Persisted):
            self._on_persisted()
        elif isinstance(event, SnapshotRequested):
            self._on_snapshot_requested(event.follower)
        elif isinstance(event, FeedRequested):
            self._on_feed_requested()
        elif isinstance(event, ForceStartRequested):
            self._force_start(event.reached, event.last_keys, event.rows_lost)
        elif isinstance(event, MembershipChangeRequested):
            self._on_membership_change(event)
        elif isinstance(event, LearnerRefused):
            self._on_learner_refused(event.name)
        else:
            raise TypeError(f"not a consensus event: {event!r}")
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ full disk (rlog.disk)

    @property
    def disk_full(self) -> bool:
        return self._disk_full

    def _on_disk_full(self, event: DiskFull) -> None:
        self._disk_full = True
        self._pre_votes = None
        self._votes = set()
        if self._role is Role.SEQUENCER:
            # The majority keeps serving only under another sequencer: this one cannot persist an entry.
            self._step_down(f"{REJECT_DISK_FULL}: the disk of sequencer {self.name} is full ({event.error})")
        elif self._role is Role.CANDIDATE:
            self._set_role(Role.FOLLOWER, None)

    def _on_disk_freed(self) -> None:
        if not self._disk_full:
            return
        self._disk_full = False
        # It heard nothing while full: count a whole election timeout from now before campaigning,
        # so that it first hears the sequencer the others elected meanwhile.
        self._reset_election_deadline()

    def _while_disk_full(self, event: Event) -> None:
        """Everything but DiskFull/DiskFreed while full: refuse what asks for an answer, drop the rest."""
        if isinstance(event, (Proposed, MembershipChangeRequested)):
            self._out.append(ProposalRejected(event.request_id, REJECT_DISK_FULL, None))
        elif isinstance(event, ProposedBatch):
            for proposal in event.proposals:
                self._out.append(ProposalRejected(proposal.request_id, REJECT_DISK_FULL, None))
        elif isinstance(event, ForceStartRequested):
            reached = tuple(sorted(name for name, _ in event.reached))
            self._out.append(ForceStartRefused(f"the disk of {self.name} is full", reached, self._members))
        elif isinstance(event, LearnerRefused):
            self._on_learner_refused(event.name)  # nothing to persist: the change ends all the same
        elif not isinstance(event, (Ticked, MessageReceived, BatchEnded, Persisted, SnapshotRequested, FeedRequested)):
            raise TypeError(f"not a consensus event: {event!r}")

    # ------------------------------------------------------------ time

    def _majority(self) -> int:
        return len(self._members) // 2 + 1

    def _peers(self) -> list[str]:
        return [member for member in self._members if member != self.name]

    def _reset_election_deadline(self) -> None:
        timeout_ms = self._rng.randint(self.config.election_timeout_ms_min, self.config.election_timeout_ms_max)
        if self._members == (self.name,):
            # Alone, this core is its own majority: there is nobody to wait for or to collide with.
            timeout_ms = 0
        self._election_deadline_ms = self._now_ms + timeout_ms

    def _heard_voters(self, answered_only: bool = False) -> set[str]:
        """This sequencer (while a voter) and the members it heard within ``election_timeout_ms_min``
        (``answered_only``: only those that answered it, not a peer merely given time since the election)."""
        heard = {self.name} if self.voter else set()
        for peer, progress in self._progress.items():
            if answered_only and not progress.answered:
                continue
            if peer in self._members and self._now_ms - progress.last_heard_ms < self.config.election_timeout_ms_min:
                heard.add(peer)
        return heard

    def _on_tick(self) -> None:
        if self.excluded:
            return
        if self._role is Role.SEQUENCER:
            heard = len(self._heard_voters())
            if heard < self._majority():
                self._step_down(
                    f"sequencer fenced itself: heard from {heard} of {len(self._members)} members "
                    f"within {self.config.election_timeout_ms_min} ms"
                )
                return
            if self._now_ms >= self._heartbeat_due_ms:
                self._heartbeat_due_ms = self._now_ms + self.config.heartbeat_interval_ms
                for peer, progress in self._progress.items():
                    if self._fed_by_appends(progress):
                        continue  # the appends of the last interval keep it following and feed the lease
                    if self._answering(progress):
                        # Appends are in flight and their answers keep coming: resending them would
                        # only make the follower decode and skip them. An empty append where it
                        # matched keeps it following and feeds the lease.
                        match_digest = self._log.digest_at(progress.match_key)
                        if match_digest is not None:
                            self._send(peer, progress, progress.match_key, match_digest, [])
                            continue
                    if not progress.probing:
                        # Resend what was not acknowledged: appends may have been lost.
                        progress.sent_key = progress.match_key
                    progress.in_flight = 0
                    self._send_append(peer, heartbeat=True)
            self._choose_lazy()
            self._feed_lazy(at_once=False)
            if self._notice_due_ms is not None and self._now_ms >= self._notice_due_ms:
                self._notice_due_ms = None
                self._tell_commit()
            self._check_learner()
            self._check_removal()
            return
        if self._now_ms < self._election_deadline_ms:
            return
        if self.voter:
            self._pre_vote()
        elif self._sequencer is not None:
            # A core outside the membership (a learner, a removed core) never campaigns, so it never
            # reaches the pre-vote where a voter forgets a sequencer it no longer hears. It forgets it
            # here: its replicants (``follows_sequencer``) and forwarded writes must not count on a
            # sequencer that stopped replicating to it (a learner refused, or its sequencer deposed).
            self._set_role(Role.FOLLOWER, None)
            self._reset_election_deadline()

    def _answering(self, progress: _Progress) -> bool:
        """Whether a follower with appends in flight acknowledged entries within the last heartbeat
        interval (or was sent its first in-flight append within it): none of them is given up as lost yet.

        A lost append shows either as a failed answer to the next one (its previous key is missing)
        or, when nothing follows it, as a heartbeat interval without an acknowledgement: then the
        heartbeat resends from the match key."""
        return (
            not progress.probing
            and progress.in_flight > 0
            and progress.sent_key > progress.match_key
            and self._now_ms - progress.waiting_since_ms < self.config.heartbeat_interval_ms
        )

    def _fed_by_appends(self, progress: _Progress) -> bool:
        """A follower that needs no heartbeat: within the last heartbeat interval it was sent an
        append with entries (which resets its election timer as a heartbeat would) and answered
        (which feeds the lease and the step-down count), and none of its appends is stalled."""
        interval_ms = self.config.heartbeat_interval_ms
        return (
            not progress.probing
            and progress.appended_ms is not None
            and self._now_ms - progress.appended_ms < interval_ms
            and self._now_ms - progress.last_heard_ms < interval_ms
            and (progress.sent_key <= progress.match_key or self._now_ms - progress.waiting_since_ms < interval_ms)
        )

    # ------------------------------------------------------------ election

    def _persist_state(self) -> None:
        self._out.append(PersistState(self.persisted_state()))
        self._state_durable = False

    def _on_persisted(self) -> None:
        self._durable_key = self._last_key
        self._state_durable = True
        if self._role is Role.SEQUENCER:
            self._advance_commit()
            self._schedule_notice()

    def _set_role(self, role: Role, sequencer: str | None) -> None:
        if role is not Role.SEQUENCER:
            self._batch = []
            self._notice_due_ms = None
            self._lazy = frozenset()
        if role is not self._role or sequencer != self._sequencer:
            self._role = role
            self._sequencer = sequencer
            self._out.append(RoleChanged(role, self._generation, sequencer))

    def _pre_vote(self) -> None:
        """Ask whether a majority would vote for us in generation + 1, changing nothing durable."""
        self._reset_election_deadline()
        if self._role is Role.FOLLOWER:
            # We no longer hear the sequencer: stop forwarding to it (the driver tells waiting clients).
            self._set_role(Role.FOLLOWER, None)
        if self._last_key < self._vote_floor:
            # Rebuilt on an empty disk and not caught up past its vote floor: its log may lack entries
            # committed because it held them before, and its own vote would not stop it. It waits for
            # a sequencer whose log has them instead of campaigning.
            return
        self._pre_votes = {self.name}
        if len(self._pre_votes) >= self._majority():
            self._campaign()
            return
        request = PreVoteRequest(self._generation + 1, self._last_key)
        for peer in self._peers():
            self._out.append(Send(peer, request))

    def _on_pre_vote_request(self, sender: str, message: PreVoteRequest) -> None:
        granted = (
            message.generation > self._generation
            and not self.hears_sequencer()
            and self._candidate_log_is_up_to_date(message.last_key)
        )
        # Nothing is persisted and the timer is not reset: a pre-vote is only a question.
        generation = message.generation if granted else self._generation
        self._out.append(Send(sender, PreVoteReply(generation, granted)))

    def _on_pre_vote_reply(self, sender: str, message: PreVoteReply) -> None:
        if self._pre_votes is None or not message.granted or message.generation != self._generation + 1:
            return
        self._pre_votes.add(sender)
        if len(self._pre_votes & set(self._members)) >= self._majority():
            self._campaign()

    def _campaign(self) -> None:
        # The new generation and the vote are persisted before any message uses them, so a
        # restart can never vote twice in, or reuse, a generation.
        self._pre_votes = None
        self._generation += 1
        self._voted_for = self.name
        self._persist_state()
        self._votes = {self.name}
        self._set_role(Role.CANDIDATE, None)
        self._reset_election_deadline()
        if len(self._votes) >= self._majority():
            self._become_sequencer()
            return
        for peer in self._peers():
            self._out.append(Send(peer, VoteRequest(self._generation, self._last_key)))

    def _candidate_log_is_up_to_date(self, candidate_last_key: TxKey) -> bool:
        # Compare LAST APPENDED keys, not committed keys: an entry persisted on a majority is
        # committed even if nobody alive has learned that yet, and any majority of voters
        # contains one node holding it. Refusing candidates whose last appended key is
        # behind ours is what guarantees that such an entry is in the winner's log.
        # A core rebuilt on an empty database held such entries before it lost them: its
        # ``vote_floor`` (what its peers' logs held when it recovered) stands in for that log.
        return candidate_last_key >= max(self._last_key, self._vote_floor)

    def _adopt_generation(self, generation: int) -> None:
        was_sequencer = self._role is Role.SEQUENCER
        self._generation = generation
        self._voted_for = None
        self._pre_votes = None
        self._persist_state()
        if was_sequencer:
            self._fail_pending(f"sequencer superseded by generation {generation}")
            self._progress = {}
        self._set_role(Role.FOLLOWER, None)
        if was_sequencer:
            # Its election deadline is stale: start counting now. A follower or candidate keeps
            # its timer, so that a refused candidate's generation cannot postpone it forever.
            self._reset_election_deadline()

    def _on_vote_request(self, sender: str, message: VoteRequest) -> None:
        if message.generation < self._generation:
            self._out.append(Send(sender, VoteReply(self._generation, False)))
            return
        granted = self._voted_for in (None, sender) and self._candidate_log_is_up_to_date(message.last_key)
        if granted:
            if self._voted_for != sender:
                self._voted_for = sender
                self._persist_state()  # before the reply, which comes later in the list
            self._reset_election_deadline()
        self._out.append(Send(sender, VoteReply(self._generation, granted)))

    def _on_vote_reply(self, sender: str, message: VoteReply) -> None:
        if self._role is not Role.CANDIDATE or message.generation != self._generation or not message.granted:
            return
        self._votes.add(sender)
        if len(self._votes & set(self._members)) >= self._majority():
            self._become_sequencer()

    def _become_sequencer(self, first_ops: tuple[Op, ...] = ()) -> None:
        self._set_role(Role.SEQUENCER, self.name)
        self._stuck = None  # its own log is the one followed now: nothing refused is in it
        self._votes = set()
        self._progress = {
            peer: _Progress(sent_key=self._last_key, last_heard_ms=self._now_ms) for peer in self._peers()
        }
        self._heartbeat_due_ms = self._now_ms + self.config.heartbeat_interval_ms
        if not first_ops:
            first_ops = membership.elected_first_ops(self._forced, bool(self._changes), self._committed_members)
        # The no-op of this generation: committing it settles every earlier entry.
        self._append_own(first_ops, None, proposal=False)

    def _step_down(self, reason: str) -> None:
        self._fail_pending(reason)
        self._progress = {}
        self._set_role(Role.FOLLOWER, None)
        self._reset_election_deadline()

    def _fail_pending(self, reason: str) -> None:
        for key, request_id in self._pending.items():
            self._out.append(ProposalFailed(request_id, key, reason))
        self._pending = {}
        if self._learner is not None:
            # Nothing was written for a learner: the operator retries at the next sequencer.
            self._out.append(ProposalRejected(self._learner.request_id, REJECT_NOT_SEQUENCER, None))
            self._learner = None
        if self._removal is not None:
            # Nothing was written for it either.
            self._out.append(ProposalRejected(self._removal.request_id, REJECT_NOT_SEQUENCER, None))
            self._removal = None

    def _force_start(
        self,
        reached: tuple[tuple[str, int], ...],
        last_keys: tuple[tuple[str, TxKey], ...] = (),
        rows_lost: bool = False,
    ) -> None:
        """Become sequencer of a new generation with the members reached, loudly; refuse if a
        majority was reached (an election can do the job without losing anything), or if a member
        reached holds more of the log than this core (forcing that member loses less).

        What may be lost: entries that the old majority committed (and acknowledged) but no core
        reached holds; they are gone for good. Entries in this core's uncommitted tail become
        committed, even if their clients were told the outcome was unknown. Members left out are
        ignored from now on and must be rebuilt from scratch before they rejoin.

        Why a member ahead refuses it: its last key is past ours by the election's up-to-date rule
        (``_candidate_log_is_up_to_date``), so its log holds every entry committed that ours holds,
        and entries that ours lacks may be committed (a lost majority acknowledged them). Forced here,
        the new generation would replace them: that member's committed ones stop the shard on it
        (``ConsensusInvariantError``), and a forced set that needs its answers commits nothing.
        """
        generations = {name: generation for name, generation in reached if name in self._members}
        generations.pop(self.name, None)
        new_members = tuple(sorted({self.name, *generations}))
        if self.name not in self._members:
            self._out.append(ForceStartRefused(f"{self.name} is not a member", new_members, self._members))
            return
        if len(new_members) >= self._majority():
            self._out.append(
                ForceStartRefused(
                    f"{self.name} reaches {len(new_members)} of {len(self._members)} members "
                    f"({', '.join(new_members)}), a majority: an election will choose a sequencer without "
                    "losing anything, and a forced start would leave out cores that are alive",
                    new_members,
                    self._members,
                )
            )
            return
        ahead = sorted((key, name) for name, key in last_keys if name in generations and key > self._last_key)
        if ahead:
            key, name = ahead[-1]
            reason = (
                f"{name} holds the log up to {key}, {self.name} only up to {self._last_key}: force-start "
                f"{name} instead (forced here, the entries after {self._last_key} would be replaced)"
            )
            self._out.append(ForceStartRefused(reason, new_members, self._members))
            return
        if rows_lost:
            # A sequencer executes transactions and evaluates guards against its rows: half-copied
            # ones would commit wrong rows for good, and no sequencer offers itself the snapshot that
            # heals them (it campaigns for the same reason: never).
            reason = (
                f"the rows of shard {self.shard} on {self.name} are half copied by an abandoned snapshot "
                "install: force-start a core whose rows are whole"
            )
            self._out.append(ForceStartRefused(reason, new_members, self._members))
            return
        # Above every generation a reached member has seen, so each of them follows this sequencer.
        generation = max((self._generation, *generations.values())) + 1
        if generation > GENERATION_MAX:
            # A peer's journal may say GENERATION_MAX (it is checked no further): one more would be
            # persisted, and the next campaign's would overflow SQLite's integer and stop the node.
            reason = f"the new generation {generation} would pass the largest one ({GENERATION_MAX})"
            self._out.append(ForceStartRefused(reason, new_members, self._members))
            return
        if self._role is Role.SEQUENCER:
            self._fail_pending("sequencer force-started into a new generation")
        self._generation = generation
        self._voted_for = self.name
        # The operator's override: the reduced set is in force at once (committed, for this core),
        # and the forced generation's first entry records it in the log for everyone else.
        self._committed_members = new_members
        self._changes = []
        self._members = new_members
        self._forced = True
        self._persist_state()
        self._out.append(ForceStarted(self._generation, new_members, self._last_key, self._commit_key))
        self._role = Role.CANDIDATE  # so that _set_role reports the change even from SEQUENCER
        self._become_sequencer(first_ops=(MembersOp(new_members),))

    def _on_exclusion(self, sender: str, notice: ExclusionNotice) -> None:
        """A member's forced start left this core out: stop taking part.

        Believed from a member of our membership whose new membership does not include us, whatever
        its generation: a left-out core keeps campaigning alone and may have counted its generation
        past the forced one, and stopping can only cost availability, never safety. (Only an
        authenticated core can send it; the driver checks that.)
        """
        if sender not in self._members or self.name in notice.members:
            self._out.append(ProtocolViolation(sender, f"exclusion notice with members {notice.members}"))
            return
        if (
            self.name in self._members
            and notice.key < self._members_key()
            and notice.digest is not None
            and self._log.digest_at(notice.key) == notice.digest
        ):
            # Our logs agree up to the notice's key (the sender's last or committed key: its log is
            # behind ours) and the entry naming us comes after it: we were added back after a forced
            # start and the sender has not persisted that entry yet. It is behind, not we out.
            return
        if notice.generation > self._generation:
            self._adopt_generation(notice.generation)
        elif self._role is not Role.FOLLOWER or self._sequencer is not None:
            self._step_down(f"left out by a forced start of {sender} (generation {notice.generation})")
        if self._excluded_generation != notice.generation:
            # Persisted (the driver's store, the simulator's node): a restart stays out, and serves no
            # local read of the shard from its first turn (``core.rules.not_serving_reason``).
            self._excluded_generation = notice.generation
            self._persist_state()
        self._out.append(Excluded(sender, notice.generation, notice.members, notice.key, notice.digest))

    def _tell_excluded(self, sender: str, message: PeerMessage) -> None:
        """``sender`` is outside our membership (a forced start left it out): tell it, rate-limited."""
        told_ms = self._exclusion_told_ms.get(sender)
        if told_ms is not None and self._now_ms - told_ms < EXCLUSION_NOTICE_INTERVAL_MS:
            return
        if len(self._exclusion_told_ms) >= MEMBERS_MAX:
            self._exclusion_told_ms = {}
        self._exclusion_told_ms[sender] = self._now_ms
        their_key = (
            message.last_key if isinstance(message, (VoteRequest, PreVoteRequest, AppendReply)) else self._commit_key
        )
        key = min(their_key, self._last_key)
        notice = ExclusionNotice(self._generation, self._members, key, self._log.digest_at(key))
        self._out.append(Send(sender, notice))

    # ------------------------------------------------------------ messages

    def _on_message(self, sender: str, message: PeerMessage) -> None:
        peer_kinds = (VoteRequest, VoteReply, PreVoteRequest, PreVoteReply, AppendRequest, AppendReply, ExclusionNotice)
        if not isinstance(message, peer_kinds):
            raise TypeError(f"not a peer message: {message!r}")
        if (
            message.generation > self._generation + self.config.generation_jump_max
            or message.generation > GENERATION_MAX
        ):
            self._out.append(
                ProtocolViolation(
                    sender, f"generation {message.generation} jumps too far ahead of ours ({self._generation})"
                )
            )
            return
        if isinstance(message, ExclusionNotice) and sender != self.name:
            self._on_exclusion(sender, message)
            return
        if sender == self.name or (sender not in self._members and not self._heeds_outsider(sender, message)):
            self._out.append(ProtocolViolation(sender, f"{NOT_A_MEMBER} {self._members}"))
            if sender != self.name and not self.excluded and self._forced:
                # Only a forced start leaves cores out behind their back; a core outside an
                # ordinary membership (a learner, a removed core) is simply not answered.
                self._tell_excluded(sender, message)
            return
        if self._role is Role.SEQUENCER and self._counts_for_lease(message):
            progress = self._progress.get(sender)
            if progress is not None:
                # From when we sent the append it answers (never from when the answer arrived: it
                # may have waited in a queue), and never later than now, whatever the peer says.
                sent_ms = message.request_sent_ms if isinstance(message, AppendReply) else self._now_ms
                heard_ms = min(sent_ms, self._now_ms)
                if progress.lease_heard_ms is None or heard_ms > progress.lease_heard_ms:
                    progress.lease_heard_ms = heard_ms
        if isinstance(message, PreVoteRequest):
            # Its generation is a proposal, not one in use: never adopt it.
            self._on_pre_vote_request(sender, message)
            return
        if isinstance(message, PreVoteReply) and message.granted:
            self._on_pre_vote_reply(sender, message)
            return
        if isinstance(message, VoteRequest) and message.generation > self._generation and self.hears_sequencer():
            # Stickiness: we hear a sequencer, so this candidate is disruptive (it was paused or cut
            # off). Refuse without adopting its generation, which would depose our sequencer.
            self._out.append(Send(sender, VoteReply(self._generation, False)))
            return
        if message.generation > self._generation:
            self._adopt_generation(message.generation)
        if isinstance(message, PreVoteReply):
            return  # a refusal: its generation, if higher, was adopted above
        if isinstance(message, VoteRequest):
            self._on_vote_request(sender, message)
        elif isinstance(message, VoteReply):
            self._on_vote_reply(sender, message)
        elif isinstance(message, AppendRequest):
            self._on_append_request(sender, message)
        else:
            self._on_append_reply(sender, message)

    def _heeds_outsider(self, sender: str, message: PeerMessage) -> bool:
        """Replication needs no membership: a learner (or a core whose membership entry has not
        reached us yet) follows a sequencer outside the set it knows, and the sequencer hears its
        learner. Nor do vote requests (thesis 4.2.3): a core whose log holds the entry that added it
        may need the vote of a member that has not stored that entry yet, and the log check keeps
        the answer safe; a removed core cannot disrupt, as a core hearing a sequencer refuses it (the
        pre-vote and stickiness guards). Replies count only from members. After a forced start,
        outsiders are the cores it left out (their logs may hold entries the forced log lost, so the
        log check would not stop them) and are told so instead, except a candidate whose log goes
        past our committed key, a core added after the forced start (``heard_after_forced_start``),
        and its appends once it is elected."""
        if isinstance(message, AppendReply):
            return sender in self._progress
        if not isinstance(message, (AppendRequest, VoteRequest, PreVoteRequest)):
            return False
        if not self._forced:
            return True
        if isinstance(message, AppendRequest):
            # The sequencer we voted for (heard by the rule below), or one whose committed key is past ours.
            voted = sender == self._voted_for and message.generation == self._generation
            return voted or membership.heard_after_forced_start(message.commit_key, self._commit_key)
        return membership.heard_after_forced_start(message.last_key, self._commit_key)

    def _reply_append(self, sender: str, message: AppendRequest, success: bool, match_key: TxKey) -> None:
        reply = AppendReply(self._generation, success, match_key, self._last_key, self._commit_key, message.sent_ms)
        self._out.append(Send(sender, reply))

    def _on_append_request(self, sender: str, message: AppendRequest) -> None:
        if message.generation < self._generation:
            # Zombie fencing: the stale sequencer learns the current generation from the reply.
            self._reply_append(sender, message, False, ZERO_KEY)
            return
        if self._role is Role.SEQUENCER or (self._sequencer is not None and self._sequencer != sender):
            # One vote per generation allows one sequencer: a second one is a hostile or broken peer.
            # Ignore it (the first keeps its followers) and let the driver count the violation.
            self._out.append(
                ProtocolViolation(
                    sender, f"a second sequencer in generation {self._generation} (we know {self._sequencer})"
                )
            )
            return
        self._set_role(Role.FOLLOWER, sender)
        self._pre_votes = None
        self._sequencer_heard_ms = self._now_ms
        self._reset_election_deadline()
        prev_key, prev_digest = message.prev_key, message.prev_digest
        entries = list(message.entries)
        for entry in entries:
            if entry.shard != self.shard:
                self._out.append(ProtocolViolation(sender, f"entry of shard {entry.shard!r} sent to {self.shard!r}"))
                return
            if entry.tx_key.generation > message.generation:
                # A sequencer writes entries of its generation or earlier ones (Raft: terms in a log
                # never exceed the leader's). A later one would make this core's log end beyond its
                # own generation: as sequencer it could then append nothing (its keys would go back).
                self._out.append(
                    ProtocolViolation(
                        sender, f"entry {entry.tx_key} is of a later generation than its append ({message.generation})"
                    )
                )
                return
        unspoken = first_unspoken(entries, self._own_versions)
        if unspoken is not None:
            # The sequencer appends a cluster version only once every member announced it; a member
            # rolled back since, or a broken sequencer, must not move this core to a version it cannot
            # read (``core.versions``): it takes the entries before it, as an append of those alone,
            # and stays at the entry before, loudly. Its state no longer advances, so it is kept as
            # ``stuck_reason`` (the driver serves no read of the shard).
            index, reason = unspoken
            key = entries[index].tx_key
            self._stuck = (key, f"the sequencer's entry {key} was refused: {reason}")
            self._out.append(ProtocolViolation(sender, f"entry {key}: {reason}"))
            del entries[index:]
        # The last key this append verifies: the commit key and the answer go no further.
        message_last_key = entries[-1].tx_key if entries else message.prev_key
        # Entries up to our commit key are already here and final; check rather than trust.
        while entries and entries[0].tx_key <= self._commit_key:
            first = entries.pop(0)
            own = self._log.digest_at(first.tx_key)
            if own is not None and own != first.digest:
                raise ConsensusInvariantError(
                    f"sequencer {sender} sent a different entry at committed key {first.tx_key}"
                )
            prev_key, prev_digest = first.tx_key, first.digest

        if prev_key < self._commit_key:
            if entries:
                # The sequencer's log lacks our committed entry at commit_key: it must never have won.
                raise ConsensusInvariantError(
                    f"sequencer {sender} would replace committed entries after {prev_key} "
                    f"(committed {self._commit_key})"
                )
            # Everything in this append is at or below our commit key: committed, hence identical.
            own = self._log.digest_at(prev_key)
            if own is not None and own != prev_digest:
                raise ConsensusInvariantError(f"sequencer {sender} disagrees at committed key {prev_key}")
            self._reply_append(sender, message, True, message_last_key)
            return
        # The usual append continues our log's end, whose digest we hold: no read of the log.
        if prev_key == self._last_key:
            own_prev_digest: bytes | None = self._last_digest
        else:
            own_prev_digest = self._log.digest_at(prev_key) if prev_key < self._last_key else None
        if own_prev_digest != prev_digest:
            self._reply_append(sender, message, False, ZERO_KEY)
            return
        # Verify the digest chain of the new entries before persisting anything.
        chain_key, chain_digest = prev_key, prev_digest
        for entry in entries:
            if chain_break(chain_key, chain_digest, entry) is not None:
                self._out.append(ProtocolViolation(sender, f"broken digest chain at {entry.tx_key}"))
                return
            chain_key, chain_digest = entry.tx_key, entry.digest
        # Skip what we already have; the first entry that differs starts the new tail.
        first_new = 0
        while first_new < len(entries) and entries[first_new].tx_key <= self._last_key:
            if self._log.digest_at(entries[first_new].tx_key) != entries[first_new].digest:
                break
            first_new += 1
        new_entries = entries[first_new:]
        if new_entries:
            after_key = new_entries[0].prev
            if after_key != self._last_key:
                if after_key < self._commit_key:
                    raise ConsensusInvariantError(
                        f"asked to truncate after {after_key}, below the committed key {self._commit_key}"
                    )
                self._out.append(TruncateLog(after_key))
                self._durable_key = min(self._durable_key, after_key)
                self._forget_changes_after(after_key)
            self._out.append(PersistEntries(tuple(new_entries)))
            self._last_key = new_entries[-1].tx_key
            self._last_digest = new_entries[-1].digest
            self._note_changes(new_entries)
            if self._stuck is not None and self._last_key >= self._stuck[0]:
                # The log it follows no longer holds the refused entry there (the entries just
                # persisted passed the check above): it goes on again.
                self._stuck = None
        # Raft: commit up to min(sequencer's commit key, last entry this append verified).
        new_commit = min(message.commit_key, message_last_key)
        told_commit = new_commit > self._commit_key
        if told_commit:
            self._commit_key = new_commit
            self._settle_members()
            self._out.append(Commit(new_commit))
        self._adopt_committed_members(message)
        answered_generation, answered_ms = self._answered
        recently = answered_generation == self._generation and self._now_ms - answered_ms < self._notice_quiet_ms()
        if told_commit and not message.entries and recently:
            # A commit notice (``_tell_commit``) just after an answer: its answer would acknowledge
            # nothing new and feed a lease that the answer before fed a moment ago.
            return
        self._answered = (self._generation, self._now_ms)
        self._reply_append(sender, message, True, message_last_key)

    @staticmethod
    def _refused_probe(progress: _Progress, message: AppendReply) -> bool:
        """Whether a successful answer to the probe in flight acknowledges less than the probe
        carried. A follower that took the probe's previous key takes all of its entries, except when
        it refuses one (a cluster version it does not speak: ``first_unspoken``); then it takes those
        before it, answers up to there, and its log ends there. Only an answer to a probe (its
        ``sent_ms``, which no other append to it shares) tells: one to another append, reordered,
        acknowledges less for no such reason."""
        sent_ms = message.request_sent_ms
        if message.match_key != message.last_key or sent_ms == progress.empty_sent_ms:
            return False
        return any(sent_ms == probe_ms and message.match_key < last_key for probe_ms, last_key in progress.probes)

    def _notice_quiet_ms(self) -> int:
        """How soon after answering its sequencer a follower leaves a commit notice unanswered.

        Half a heartbeat interval: the sequencer still hears this follower at least as often as it
        sends heartbeats (a heartbeat that tells no new commit key is always answered), and its read
        lease (half an election timeout, at least a heartbeat interval) lags by at most this much."""
        return self.config.heartbeat_interval_ms // 2

    def _on_append_reply(self, sender: str, message: AppendReply) -> None:
        if self._role is not Role.SEQUENCER or message.generation != self._generation:
            return
        progress = self._progress.get(sender)
        if progress is None:
            return
        progress.last_heard_ms = self._now_ms
        progress.answered = True
        if message.success:
            if message.match_key > progress.sent_key_max:
                # Only a hostile or broken peer acknowledges what we never sent: ignore the reply.
                self._out.append(
                    ProtocolViolation(sender, f"acknowledged {message.match_key}, beyond what was sent to it")
                )
                return
            # Only a reply that acknowledges new entries answers an append counted in flight: one
            # to an empty append (a heartbeat, a commit notice) must not make room for another.
            advanced = message.match_key > progress.match_key
            progress.match_key = max(progress.match_key, message.match_key)
            if advanced:
                progress.waiting_since_ms = self._now_ms
            if progress.probing:
                progress.in_flight = 0  # the one probe in flight was answered
            elif advanced:
                progress.in_flight = max(0, progress.in_flight - 1)
            if advanced:
                progress.refused = False
            elif self._refused_probe(progress, message):
                progress.refused = True
            progress.probing = False
            progress.sent_key = max(progress.sent_key, progress.match_key)
            self._advance_commit()
            if self._role is not Role.SEQUENCER:
                return  # it committed its own removal and stepped down
            self._check_learner()
            self._check_removal()
            if progress.refused:
                # It refused the entry after its match key and refuses it until it is upgraded
                # (which an answer acknowledging it shows): hold it as a probe in flight at its match
                # key, which the next heartbeat resends (``_on_tick``); other answers send nothing.
                progress.probing = True
                progress.sent_key = progress.match_key
                progress.in_flight = 1
                return
        else:
            # Resume at the follower's last key if our log has it (same key means same entry),
            # otherwise at its commit key, which every sequencer's log contains.
            resume_key = message.commit_key
            if message.last_key <= self._last_key and self._log.digest_at(message.last_key) is not None:
                resume_key = message.last_key
            if message.commit_key > message.last_key or not self._holds_key(resume_key):
                # A commit key beyond the replier's own last key, or one this log lacks (beyond its
                # end, or on another branch): a hostile or broken peer, or a core holding committed
                # entries that a forced start lost. Resuming there would make the next heartbeat
                # find no entry to send from and stop this sequencer: ignore the reply instead.
                self._out.append(
                    ProtocolViolation(
                        sender,
                        f"failed append answered with commit key {message.commit_key} (last key "
                        f"{message.last_key}), which this log does not hold",
                    )
                )
                return
            if message.last_key < progress.match_key:
                # The follower lost entries it had acknowledged (its data directory was lost and it
                # is recovering): what it holds now is all it has. The commit key never goes back,
                # so lowering its match key cannot undo a commit. Use resume_key, which is in our log
                # (the follower's last key may be in a divergent tail we do not have), and accept
                # that a reordered old reply lowers it too: the next success raises it again.
                progress.match_key = resume_key
            sent_key = max(resume_key, progress.match_key)
            if (
                progress.probing
                and progress.in_flight > 0
                and sent_key == progress.sent_key
                and progress.probes
                and message.request_sent_ms < progress.probes[-1][0]
            ):
                # An append sent before the probe in flight failed (appends pipelined ahead of a
                # refusal or a loss fail one by one): that probe asks for the same, and is answered
                # or resent at the next heartbeat.
                return
            progress.sent_key = sent_key
            progress.probing = True
            # A follower that refused the last probe (an append sent before that answer fails now)
            # is probed again at the next heartbeat, not at once.
            progress.in_flight = 1 if progress.refused else 0
        in_flight_max = 1 if progress.probing else self.config.appends_in_flight_max
        if sender in self._lazy and not progress.probing and not self._catching_up(progress):
            return  # fed when its interval is over (``_on_tick``, ``_send_batch``)
        if progress.in_flight < in_flight_max and progress.sent_key < self._last_key:
            self._send_append(sender, heartbeat=False)

    # ------------------------------------------------------------ replication

    def _on_proposed(self, event: Proposed) -> None:
        if self._proposal_refused(event):
            return
        self._append_own(tuple(event.ops), event.request_id, proposal=True)

    def _proposal_refused(self, event: Proposed) -> bool:
        if self._role is not Role.SEQUENCER:
            self._out.append(ProposalRejected(event.request_id, REJECT_NOT_SEQUENCER, self._sequencer))
            return True
        if len(event.ops) > self.config.ops_per_entry_max:
            self._out.append(ProposalRejected(event.request_id, REJECT_TOO_MANY_OPS, self.name))
            return True
        if len(self._pending) >= self.config.pending_proposals_max:
            self._out.append(ProposalRejected(event.request_id, REJECT_BUSY, self.name))
            return True
        return False

    def _on_proposed_batch(self, event: ProposedBatch) -> None:
        """Each proposal as ``_on_proposed`` takes it, in order; the accepted ones' entries in one
        ``PersistEntries``, ahead of the refusals. Nothing commits between two proposals of a batch
        (a sequencer counts itself only at ``Persisted``, the followers only at their answers), so
        one commit check at the end decides what per-proposal checks would."""
        position = len(self._out)
        entries: list[Entry] = []
        for proposal in event.proposals:
            if not self._proposal_refused(proposal):
                entry = self._append_own(tuple(proposal.ops), proposal.request_id, True, True, event.runs)
                if entry is not None:  # None: refused, too large
                    entries.append(entry)
        if entries:
            self._out.insert(position, PersistEntries(tuple(entries)))
            self._advance_commit()

    def _append_own(
        self, ops: tuple[Op, ...], request_id: str | None, proposal: bool, batched: bool = False, runs: bool = False
    ) -> Entry | None:
        counter = self._last_key.counter + 1 if self._last_key.generation == self._generation else 1
        prev_key, prev_digest = self._last_key, self._last_digest
        entry = make_entry(self.shard, TxKey(self._generation, counter), prev_key, prev_digest, ops, request_id, runs)
        if proposal and entry.size_bytes > self.config.entry_bytes_max:
            self._out.append(ProposalRejected(request_id, REJECT_TOO_LARGE, self.name))
            return None
        if not batched:
            self._out.append(PersistEntries((entry,)))
        self._last_key, self._last_digest = entry.tx_key, entry.digest
        if proposal:
            self._pending[entry.tx_key] = request_id
        # A membership entry is in force from when it is appended (core.membership), before it is
        # batched: the batch goes to the new set's voters, and the commit below counts only them.
        self._note_changes([entry])
        # Proposals wait for the driver's BatchEnded, so that a turn's entries travel in one append
        # per follower; the no-op of a new generation goes at once.
        if not self._batch:
            self._batch_prev_digest = prev_digest
        self._batch.append(entry)
        if not proposal:
            self._send_batch()
        if not batched:
            self._advance_commit()
        return entry

    def _send_batch(self) -> None:
        """Send the entries appended since the last batch to every follower that is caught up.

        A follower whose last sent key is inside the batch gets the rest of it; one that is behind
        (or probing elsewhere) gets entries from the log on its next reply or heartbeat instead. The
        batch is cut by entries_per_append_max and append_bytes_max, and a follower gets at most
        appends_in_flight_max appends in flight (one while probing): the rest waits for replies.
        """
        batch, self._batch = self._batch, []
        if not batch or self._role is not Role.SEQUENCER:
            return
        self._choose_lazy()
        # An entry that is more than rows (a table, an index, a membership, a cluster version) goes to
        # every follower at once: a client told it committed may next ask any core to use it.
        at_once = bool(self._lazy) and any(type(op) not in ROW_OPS for entry in batch for op in entry.ops)
        self._feed_lazy(at_once)
        follows = {entry.prev: index for index, entry in enumerate(batch)}
        sizes: list[int] | None = None  # each entry's size, measured once for every follower
        for peer, progress in self._progress.items():
            if peer in self._lazy:
                continue  # fed above, from the log
            start = follows.get(progress.sent_key)
            in_flight_max = 1 if progress.probing else self.config.appends_in_flight_max
            while start is not None and start < len(batch) and progress.in_flight < in_flight_max:
                if sizes is None:
                    sizes = [entry.size_bytes for entry in batch]
                window = batch[start : start + self.config.entries_per_append_max]
                chunk = _bounded_in_bytes(window, self.config.append_bytes_max, sizes[start:])
                prev = batch[start - 1].digest if start else self._batch_prev_digest
                self._send(peer, progress, chunk[0].prev, prev, chunk)
                start = start + len(chunk) if not progress.probing else None

    def _choose_lazy(self) -> None:
        """Which followers are fed lazily ("Lazy followers"): the non-probing voters beyond the ones a
        commit counts. Ranked: the ones not stalled (``_stalled``) first, among them the eager ones,
        then by match key and name. So an eager follower that answers keeps its place even when a
        lazy one's answer to a feed puts it ahead for a moment (the roles would swap back and forth,
        and each swap costs a feed), and one that stops answering loses it an interval later. A
        follower that turns eager is fed at once: it may be an interval behind."""
        if not self._lazy_interval_ms or self._role is not Role.SEQUENCER:
            self._lazy = frozenset()
            return
        ready = [peer for peer, progress in self._progress.items() if peer in self._members and not progress.probing]
        eager_count = self._majority() - (1 if self.voter else 0)
        if len(ready) <= eager_count:
            lazy: frozenset[str] = frozenset()
        else:
            ready.sort()  # equals by name (a stable sort keeps this order among them below)
            ready.sort(key=self._eager_rank, reverse=True)
            lazy = frozenset(ready[eager_count:])
        for peer in self._lazy - lazy:
            progress = self._progress.get(peer)
            if progress is not None and not progress.probing:
                self._feed(peer, progress)
        self._lazy = lazy

    def _on_feed_requested(self) -> None:
        """``FeedRequested``: every lazy follower that has entries to be sent gets them now."""
        if self._role is Role.SEQUENCER:
            self._feed_lazy(at_once=True)

    def _feed_lazy(self, at_once: bool) -> None:
        """Feed each lazy follower that has entries to be sent: now (``at_once``) or once its interval is over."""
        for peer in self._lazy:
            progress = self._progress[peer]
            if self._feedable(progress) and (at_once or self._now_ms >= self._feed_due_ms(progress)):
                self._feed(peer, progress)

    def _eager_rank(self, peer: str) -> tuple[bool, bool, TxKey]:
        progress = self._progress[peer]
        return not self._stalled(progress), peer not in self._lazy, progress.match_key

    def _stalled(self, progress: _Progress) -> bool:
        """Appends in flight and none acknowledged for a lazy feed interval or more."""
        return (
            progress.in_flight > 0
            and progress.sent_key > progress.match_key
            and self._now_ms - progress.waiting_since_ms >= self._lazy_interval_ms
        )

    def _feedable(self, progress: _Progress) -> bool:
        """A lazy follower that has entries to be sent and room for an append in flight."""
        return (
            not progress.probing
            and progress.sent_key < self._last_key
            and progress.in_flight < self.config.appends_in_flight_max
        )

    def _feed_due_ms(self, progress: _Progress) -> int:
        """An interval after the follower's last append with entries or feed (now if neither)."""
        times = [ms for ms in (progress.appended_ms, progress.fed_ms) if ms is not None]
        return max(times) + self._lazy_interval_ms if times else self._now_ms

    def _catching_up(self, progress: _Progress) -> bool:
        """A full append or more behind: a lazy follower's answers are then sent more at once."""
        sent, last = progress.sent_key, self._last_key
        return sent.generation != last.generation or last.counter - sent.counter >= self.config.entries_per_append_max

    def _feed(self, peer: str, progress: _Progress) -> None:
        """Send a follower what it was not sent, from the log, in as many appends as may be in flight."""
        progress.fed_ms = self._now_ms
        while progress.in_flight < self.config.appends_in_flight_max and progress.sent_key < self._last_key:
            sent_key = progress.sent_key
            self._send_append(peer, heartbeat=False)
            if progress.sent_key == sent_key:
                return  # nothing could be sent (a snapshot is needed): tried again an interval later

    def _send(self, peer: str, progress: _Progress, prev_key: TxKey, prev_digest: bytes, entries: list[Entry]) -> None:
        message = AppendRequest(
            self._generation,
            prev_key,
            prev_digest,
            self._commit_key,
            self._committed_members,
            tuple(entries),
            self._now_ms,
        )
        self._out.append(Send(peer, message, before_persisted=self._state_durable))
        progress.sent_key_max = max(progress.sent_key_max, entries[-1].tx_key if entries else prev_key)
        # What the follower can commit from this append: its commit key, but never past the append's end.
        progress.told_commit_key = max(
            progress.told_commit_key, min(self._commit_key, entries[-1].tx_key if entries else prev_key)
        )
        if entries:
            if progress.probing:
                self._note_probe(progress, entries[-1].tx_key)
            progress.appended_ms = self._now_ms
            if progress.in_flight == 0:
                progress.waiting_since_ms = self._now_ms
            progress.in_flight += 1
            if not progress.probing:
                # While probing, sent_key stays at the probe point so that a lost probe is retried there.
                progress.sent_key = entries[-1].tx_key
        else:
            progress.empty_sent_ms = self._now_ms

    def _note_probe(self, progress: _Progress, last_key: TxKey) -> None:
        """Remember a probe with entries ending at ``last_key`` (``_refused_probe``), unless another
        append with entries went to the follower in the same ms: an answer, which names the append
        only by its ``sent_ms``, could then be to either."""
        now_ms = self._now_ms
        if progress.appended_ms == now_ms:
            progress.probes = tuple(probe for probe in progress.probes if probe[0] != now_ms)
        else:
            progress.probes = (*progress.probes[1 - PROBES_REMEMBERED :], (now_ms, last_key))

    def _needs_notice(self, progress: _Progress) -> bool:
        """A follower that was sent every committed entry but not told the commit key."""
        return (
            not progress.probing
            and progress.told_commit_key < self._commit_key
            and progress.sent_key >= self._commit_key
        )

    def _notice_delay_ms(self) -> int:
        return max(1, min(self.config.commit_notice_delay_ms, self.config.heartbeat_interval_ms // 2))

    def _schedule_notice(self) -> None:
        """At BatchEnded and Persisted: a commit key some follower has not heard is told within
        ``_notice_delay_ms``, by the next batch if one goes out by then (under load, the next
        turn's writes), else by a commit notice (``_tell_commit``, at a ``Ticked``). A follower then
        applies the commit in the same transaction as that batch instead of in a turn of its own."""
        if self._role is not Role.SEQUENCER or self._notice_due_ms is not None:
            return
        if any(self._needs_notice(progress) for progress in self._progress.values()):
            self._notice_due_ms = self._now_ms + self._notice_delay_ms()

    def _tell_commit(self) -> None:
        """Tell each follower a commit key it has not heard yet, in an empty append (at most one each).

        Followers learn the commit key from appends; without this, a follower would apply (and
        push to its replicants, and answer reads waiting for the key) only at the next write's
        append or the next heartbeat. Sent when the notice scheduled by ``_schedule_notice`` is due.
        A follower that got a batch since heard it already; one that is probing, or was not sent
        the committed entries yet, hears it with those entries.
        """
        if self._role is not Role.SEQUENCER:
            return
        for peer, progress in self._progress.items():
            if not self._needs_notice(progress):
                continue
            prev_key = progress.sent_key
            prev_digest = self._last_digest if prev_key == self._last_key else self._log.digest_at(prev_key)
            if prev_digest is not None:
                self._send(peer, progress, prev_key, prev_digest, [])

    def _send_append(self, peer: str, heartbeat: bool) -> None:
        progress = self._progress[peer]
        prev_key = progress.sent_key
        trimmed_key = self._log.trimmed_key()
        if prev_key < trimmed_key:
            last_request = progress.snapshot_requested_ms
            if last_request is None or self._now_ms - last_request >= self.config.heartbeat_interval_ms:
                progress.snapshot_requested_ms = self._now_ms
                self._out.append(SnapshotNeeded(peer, prev_key, trimmed_key))
            if heartbeat:
                # Keep the follower from campaigning, and learn where it stands once the snapshot is
                # installed: it matches our last key or answers with its own last and committed keys.
                self._send(peer, progress, self._last_key, self._last_digest, [])
            return
        prev_digest = self._log.digest_at(prev_key)
        if prev_digest is None:
            raise ConsensusInvariantError(f"sequencer has no entry at {prev_key} to send to {peer}")
        entries: list[Entry] = []
        if prev_key < self._last_key:
            # A follower that refused the entry after its match key is probed with that entry alone:
            # it would decode and drop the rest of a full append at every heartbeat while it is stuck.
            limit = 1 if progress.refused else self.config.entries_per_append_max
            entries = _bounded_in_bytes(self._log.entries_after(prev_key, limit), self.config.append_bytes_max)
        if entries or heartbeat:
            self._send(peer, progress, prev_key, prev_digest, entries)

    def _on_snapshot_requested(self, follower: str) -> None:
        """A follower asks for a snapshot offer: an install it began was abandoned (``core.snapshot``),
        and ``_send_append`` offers one only while this log is trimmed past the follower's position.
        Only the sequencer offers, only to a core it replicates to, at most once a heartbeat interval
        (as ``_send_append`` does): the offer costs the follower nothing it has not lost already, and
        it refuses one that would take anything back (``core.snapshot.accept_offer``)."""
        progress = self._progress.get(follower) if self._role is Role.SEQUENCER else None
        if progress is None:
            return
        last_request = progress.snapshot_requested_ms
        if last_request is not None and self._now_ms - last_request < self.config.heartbeat_interval_ms:
            return
        progress.snapshot_requested_ms = self._now_ms
        self._out.append(SnapshotNeeded(follower, progress.match_key, self._log.trimmed_key(), requested=True))

    def _holds_key(self, key: TxKey) -> bool:
        """Whether appends can start after ``key``: this log holds it, or retention trimmed it (the
        follower is then recovered by a snapshot, ``SnapshotNeeded``)."""
        return key < self._log.trimmed_key() or self._log.digest_at(key) is not None

    def _own_match_key(self) -> TxKey:
        """How far this sequencer's own log counts toward a majority: only what is durable."""
        return self._durable_key

    def _advance_commit(self) -> None:
        # Only voters of the latest membership count; a sequencer removing itself does not. Thesis
        # 10.2.1: this core's appends went out before they were durable here, so it counts itself
        # only up to what the driver reported durable (``Persisted``).
        matched = [p.match_key for peer, p in self._progress.items() if peer in self._members]
        if self.voter:
            matched.append(self._own_match_key())
        matched.sort(reverse=True)
        if len(matched) < self._majority():
            return
        candidate = matched[self._majority() - 1]
        # Raft's commit rule: only an entry of the current generation commits by counting replicas.
        if candidate <= self._commit_key or candidate.generation != self._generation:
            return
        self._commit_key = candidate
        self._settle_members()
        self._out.append(Commit(candidate))
        committed = [key for key in self._pending if key <= candidate]
        for key in committed:
            self._out.append(ProposalCommitted(self._pending.pop(key), key))
        if self.name not in self._committed_members:
            # Its own removal committed (not merely an earlier entry, committed by the others while
            # the removal is still in flight): the remaining members elect a sequencer among themselves.
            self._step_down(f"{self.name} was removed from the membership")

    # ------------------------------------------------------------ membership (core.membership)

    def _note_changes(self, entries: Sequence[Entry]) -> None:
        """Entries just persisted: a membership entry among them is in force from now on."""
        changes = membership_changes(entries)
        if changes:
            self._changes.extend(changes)
            self._set_members(changes[-1][1])
            if self.excluded and self.name in changes[-1][1]:
                # Left out by a forced start, then added back (``cluster add-core``): the forced
                # sequencer replicated its log to us as a learner, and its add entry names us.
                # Persisted with the entry (the same turn's transaction): a restart serves again.
                self._excluded_generation = None
                self._persist_state()

    def _forget_changes_after(self, key: TxKey) -> None:
        """The log is truncated after ``key``: its membership entries there no longer count."""
        self._changes = [change for change in self._changes if change[0] <= key]
        self._set_members(self._changes[-1][1] if self._changes else self._committed_members)

    def _settle_members(self) -> None:
        """The commit key advanced: membership entries up to it become the committed membership."""
        settled = [change for change in self._changes if change[0] <= self._commit_key]
        if not settled:
            return
        self._changes = self._changes[len(settled) :]
        key, members = settled[-1]
        self._committed_members_key = key
        # A forced start's entry makes every member that holds it committed tell the cores it left
        # out (the forced core may be gone when they come back). A membership change after it ends
        # what "forced" guards: outsiders are no longer only the cores it left out (a core being
        # added may ask a member that has not seen its entry yet), so nobody is told "excluded" any more.
        forced = membership.forced_start_entry(key)
        if members != self._committed_members or forced != self._forced:
            self._committed_members = members
            self._forced = forced
            self._persist_state()

    def _members_key(self) -> TxKey:
        """The key of the membership entry ``members`` comes from (ZERO_KEY: not known)."""
        return self._changes[-1][0] if self._changes else self._committed_members_key

    def _adopt_committed_members(self, message: AppendRequest) -> None:
        """With the sequencer's committed key, its committed membership is ours too (same committed
        prefix). This is how a core whose membership entries were trimmed away (it installed a
        snapshot), or that a forced start kept, learns the membership."""
        members = tuple(sorted(set(message.members)))
        if (
            message.commit_key != self._commit_key
            or members == self._committed_members
            or not membership.valid_members(members)
        ):
            return
        self._committed_members = members
        self._committed_members_key = ZERO_KEY  # its entry is at or before the committed key: not known
        self._persist_state()
        if not self._changes:
            self._set_members(members)

    def _set_members(self, members: tuple[str, ...]) -> None:
        if members == self._members:
            return
        self._members = members
        if self._role is not Role.SEQUENCER:
            return
        # Replicate to every voter of the new set (a learner already has its progress); a removed
        # core is no longer replicated to.
        learner = self._learner.name if self._learner is not None else None
        for peer in list(self._progress):
            if peer not in members and peer != learner:
                del self._progress[peer]
        for peer in self._peers():
            if peer not in self._progress:
                self._progress[peer] = _Progress(sent_key=self._last_key, last_heard_ms=self._now_ms)

    def _on_membership_change(self, event: MembershipChangeRequested) -> None:
        if self._role is not Role.SEQUENCER:
            self._out.append(ProposalRejected(event.request_id, REJECT_NOT_SEQUENCER, self._sequencer))
            return
        refusal = membership.change_refusal(
            self._members,
            event.name,
            event.add,
            change_in_flight=bool(self._changes) or self._learner is not None or self._removal is not None,
            own_generation_committed=self._own_generation_committed(),
        )
        if refusal is None:
            # Only a change the sequencer can commit: a set whose majority it hears (a removal while
            # another core is down would otherwise leave a set that can neither commit nor elect).
            refusal = membership.quorum_refusal(
                membership.changed_members(self._members, event.name, event.add),
                self._heard_voters(answered_only=True),
                event.name if event.add else None,
            )
        if refusal is None and len(self._pending) >= self.config.pending_proposals_max:
            refusal = REJECT_BUSY
        if refusal is not None:
            self._out.append(ProposalRejected(event.request_id, refusal, self.name))
            return
        if not event.add:
            # Heard within an election timeout is not heard now: a core that died a moment ago still
            # counts above. Appended only once a majority of the set it leaves answered an append
            # sent from now on (the next heartbeat, at once); refused after an election timeout.
            self._removal = _Removal(event.name, event.request_id, self._now_ms)
            self._heartbeat_due_ms = self._now_ms
            self._check_removal()
            return
        # Catch up first, counted in no quorum; the add entry follows once it holds our commit key.
        self._learner = _Learner(event.name, event.endpoint, event.request_id, self._now_ms)
        self._progress[event.name] = _Progress(sent_key=self._last_key, last_heard_ms=self._now_ms)
        self._send_append(event.name, heartbeat=True)

    def _check_removal(self) -> None:
        removal = self._removal
        if removal is None or self._role is not Role.SEQUENCER:
            return
        new_members = membership.changed_members(self._members, removal.name, add=False)
        answered = self._answered_ms()
        if membership.removal_heard(new_members, self.name if self.voter else None, answered, removal.asked_ms):
            self._removal = None
            self._append_own((MembersOp(new_members),), removal.request_id, proposal=True)
        elif self._now_ms - removal.asked_ms >= self.config.election_timeout_ms_min:
            self._removal = None
            self._out.append(ProposalRejected(removal.request_id, membership.REJECT_NO_QUORUM_AFTER, self.name))

    def _answered_ms(self) -> dict[str, int | None]:
        """Per peer, when the sequencer sent the latest append the peer answered."""
        return {peer: progress.lease_heard_ms for peer, progress in self._progress.items()}

    def _on_learner_refused(self, name: str) -> None:
        learner = self._learner
        if learner is None or learner.name != name:
            return
        self._learner = None
        self._progress.pop(learner.name, None)
        self._out.append(ProposalRejected(learner.request_id, membership.REJECT_INCOMPATIBLE_VERSION, self.name))

    def _check_learner(self) -> None:
        learner = self._learner
        if learner is None or self._role is not Role.SEQUENCER:
            return
        progress = self._progress.get(learner.name)
        if progress is not None and progress.match_key >= self._commit_key and self._own_generation_committed():
            self._learner = None
            new_members = membership.changed_members(self._members, learner.name, add=True)
            op = MembersOp(new_members, learner.name, learner.endpoint)
            self._append_own((op,), learner.request_id, proposal=True)
        elif self._now_ms - learner.started_ms > self.config.learner_catch_up_ms_max:
            self._learner = None
            self._progress.pop(learner.name, None)
            self._out.append(ProposalRejected(learner.request_id, membership.REJECT_CATCH_UP_TIMEOUT, self.name))


def _bounded_in_bytes(entries: Sequence[Entry], bytes_max: int, sizes: Sequence[int] | None = None) -> list[Entry]:
    """The longest prefix of ``entries`` within ``bytes_max`` bytes, and at least the first entry
    (``sizes``: their ``size_bytes``, when the caller measured them already)."""
    bounded: list[Entry] = []
    total = 0
    for index, entry in enumerate(entries):
        total += sizes[index] if sizes is not None else entry.size_bytes
        if bounded and total > bytes_max:
            break
        bounded.append(entry)
    return bounded
