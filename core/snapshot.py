"""Snapshot install: a follower core whose needed entries its peers trimmed rebuilds itself from the sequencer.

Theory of operation
-------------------
When the sequencer's consensus finds a follower behind its trimmed key (``SnapshotNeeded``), the
sequencer offers a snapshot: ``snapshot_offer(shard, generation, key, digest)`` with its applied key
K0 and digest. The follower accepts an offer only from the sequencer it knows for that shard, in its
own generation, for a key beyond its applied key, at a cluster version it speaks (``core.versions``),
and only one install per shard at a time (``accept_offer``). The install is the one bootstrap path
(``bootstrap``), the same a replicant takes:

1. ``BeginInstall``: persist that an install is under way (a crash in the middle restarts it, and
   the shard serves no read and does not campaign meanwhile) and delete the shard's rows; the log
   and the position stay as they are until the copy is done.
2. ``FetchTables``, then ``bootstrap.copy.TableCopy``: key-ordered dirty-read batches of every table
   of the shard from the sequencer (``bootstrap.serve`` on its side).
3. ``FinishInstall``: in one transaction, the shard's log restarts at K0 (empty, trimmed at K0 with
   digest D0), its applied key and digest become K0 and D0, and the committed membership and forced
   flag become the offer's (``state_after_install``: the membership entries up to K0 are not copied);
   the driver then rebuilds the shard's consensus from what is persisted. The sequencer's appends
   continue from K0; entries are results, so applying them heals whatever the dirty reads saw.
4. The read fence (the rule the replicant follows): ``FetchCommitted`` asks the sequencer's
   quorum-confirmed committed key after the copy; no read is served until the applied key reaches it.

Anything that fails (an answer missing for ``request_timeout_ms``, a malformed batch, another
sequencer) abandons the install (``InstallAbandoned``), and so does a restart in the middle.

Re-offer. An abandoned install leaves the shard's rows half copied (``BeginInstall`` deleted them)
while its log and position are whole: the core keeps acknowledging appends, but serves no read of
the shard and does not campaign. The sequencer's own rule offers a snapshot only while its log is
trimmed past the follower's position, which a new sequencer (or the same one, after the follower
caught up by appends) may never be. So the follower asks: while its rows are lost and no install
is under way, it sends its known sequencer a ``snapshot_request(shard, sender)`` at most every
``SNAPSHOT_REQUEST_INTERVAL_MS`` (``snapshot_request_due``); the sequencer's consensus turns it into
``SnapshotNeeded`` for that follower even though it retains the position
(``core.consensus.SnapshotRequested``), and the offer follows as any other. The follower takes an
offer at its applied key or beyond while its rows are lost (``accept_offer``: nothing to replay
then, but the copy heals the rows); never one behind it. ``FinishInstall`` keeps the log's entries
after the offer's key when the log holds that key with the offer's digest (the same history, Raft's
rule for snapshots): entries this core acknowledged are never dropped. A release that does not know
``snapshot_request`` (0.1.0, which announces no versions) is never sent one: such a sequencer offers
only while it has trimmed, as before.

Progress at the sequencer. A learner's matched key moves only when its install ends, and a large
shard's copy takes minutes: ``cluster add-core`` would see no progress for all that time. So the
installing core names itself in each ``bootstrap_batch`` it asks (``sender``; only of a sequencer
that announces its versions: 0.1.0 refuses the field, ``reads_copy_sender``), and the sequencer
counts what it served it (``CopiesServed``): rows, batches and when the last was served. The
``members`` answer shows the learner's count (``learner_copy``), and ``core.membership.change_wait``
takes a change in it for progress.

The state machine is pure: the driver executes the effects in order and feeds the answers back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mnesite.bootstrap.copy import CopyFailed, TableCopy
from mnesite.bootstrap.fence import ReadFence
from mnesite.core.membership import valid_members
from mnesite.core.versions import unspoken_cluster_version
from mnesite.rlog.replication import (
    ApplyBatch,
    BatchReceived,
    CommittedReceived,
    FetchBatch,
    FetchCommitted,
    FetchTables,
    RequestFailed,
    TablesReceived,
    Ticked,
)
from mnesite.rlog.types import TxKey
from mnesite.rlog.versions import THIS_RELEASE, Announcement


@dataclass(frozen=True)
class SnapshotOffer:
    sequencer: str
    generation: int
    key: TxKey
    digest: bytes
    # The sequencer's committed membership at ``key`` (core.membership): the membership entries up
    # to it are not copied, so the offer carries what they decided (as Raft's snapshots do).
    members: tuple[str, ...] = ()
    # The cluster version the sequencer's copied state is at (``rlog.store``; 1 before any entry).
    cluster_version: int = 1
    # Whether ``members`` comes from a forced start's entry (``ShardConsensus`` "Force start"): the
    # entry is not copied either, and a member that installs past it is forced as one that appended it.
    forced: bool = False


@dataclass(frozen=True)
class BeginInstall:
    key: TxKey
    digest: bytes


@dataclass(frozen=True)
class FinishInstall:
    key: TxKey
    digest: bytes


@dataclass(frozen=True)
class FenceReached:
    """The applied key reached the read fence: reads are served again."""


@dataclass(frozen=True)
class InstallAbandoned:
    reason: str


InstallEvent = TablesReceived | BatchReceived | CommittedReceived | RequestFailed | Ticked
InstallEffect = (
    BeginInstall
    | FetchTables
    | FetchBatch
    | ApplyBatch
    | FinishInstall
    | FetchCommitted
    | FenceReached
    | InstallAbandoned
)


class InstallMode(enum.Enum):
    LISTING = "listing"
    COPYING = "copying"
    FENCED = "fenced"  # installed; reads wait for the applied key to reach the fence
    DONE = "done"
    ABANDONED = "abandoned"


def state_after_install(offer: SnapshotOffer, members: tuple[str, ...], forced: bool) -> tuple[tuple[str, ...], bool]:
    """The committed membership and forced flag (``PersistedState``) a follower persists with an
    installed snapshot: the offer's, when it names a membership (an offer from before membership
    changes names none: keep ours). So a member is forced alike whether the forced start's entry
    reached it by append (``ShardConsensus._settle_members``) or inside a snapshot."""
    offered = tuple(sorted(set(offer.members)))
    if len(offered) != len(offer.members) or not valid_members(offered):
        return members, forced
    return offered, offer.forced


def exclusion_after_install(offer: SnapshotOffer, name: str, excluded_generation: int | None) -> int | None:
    """The exclusion (``PersistedState.excluded_generation``) a follower ``name`` persists with an installed
    snapshot. A membership committed at a key of the forced generation or later descends from the forced
    start's, which left ``name`` out: when it names ``name``, the entry that added it back is among those
    the snapshot stands for, and the exclusion ends as it ends when that entry is appended
    (``ShardConsensus._note_changes``). Otherwise it stays (an offer naming no membership says nothing)."""
    if excluded_generation is None or offer.key.generation < excluded_generation:
        return excluded_generation
    return None if name in offer.members else excluded_generation


def reads_forced_offer(follower: Announcement | None) -> bool:
    """Whether a follower that announced ``follower`` reads an offer's ``forced`` field: every release
    that announces its versions does; 0.1.0 announces none and refuses the field (it keeps its flag)."""
    return follower is not None and follower.announced


def accept_offer(
    offer: SnapshotOffer,
    generation: int,
    sequencer: str | None,
    applied_key: TxKey,
    installing: bool,
    own: Announcement = THIS_RELEASE,
    rows_lost: bool = False,
) -> str | None:
    """None if the follower takes ``offer``; otherwise why not (a reason that begins with
    ``core.versions.UNSPOKEN_CLUSTER_VERSION`` is a protocol violation: ``own`` does not speak the
    offer's cluster version, which the sequencer's rule should have prevented).

    ``rows_lost``: an install began and was abandoned (see "Re-offer"): an offer at the applied key
    heals the rows too. An offer behind the applied key is never taken (the applied state would go back)."""
    if installing:
        return "an install is already under way"
    if offer.generation != generation or offer.sequencer != sequencer:
        return f"offered by {offer.sequencer} in generation {offer.generation}, not the known sequencer {sequencer}"
    if offer.key < applied_key or (offer.key == applied_key and not rows_lost):
        return f"offered key {offer.key} is not beyond the applied key {applied_key}"
    return unspoken_cluster_version(offer.cluster_version, own)


# How often a follower whose rows an abandoned install deleted asks its sequencer for an offer (see
# "Re-offer"): an install takes far longer, and a lost request is simply asked again.
SNAPSHOT_REQUEST_INTERVAL_MS = 1000


def snapshot_request_due(
    rows_lost: bool,
    install_under_way: bool,
    sequencer: str | None,
    own_name: str,
    asked_ms: int | None,
    now_ms: int,
    interval_ms: int = SNAPSHOT_REQUEST_INTERVAL_MS,
) -> bool:
    """Whether a follower asks its known ``sequencer`` for a snapshot offer now (see "Re-offer"):
    its rows are lost, no install is under way (or fenced), it knows a sequencer other than itself,
    and it did not ask within ``interval_ms`` (``asked_ms``: when it last asked, None: never)."""
    if not rows_lost or install_under_way or sequencer is None or sequencer == own_name:
        return False
    return asked_ms is None or now_ms - asked_ms >= interval_ms


def reads_snapshot_request(sequencer: Announcement | None) -> bool:
    """Whether a sequencer that announced ``sequencer`` knows ``snapshot_request``: every release that
    announces its versions does; 0.1.0 announces none (and one not heard yet is not asked)."""
    return sequencer is not None and sequencer.announced


def reads_copy_sender(sequencer: Announcement | None) -> bool:
    """Whether a sequencer that announced ``sequencer`` reads a ``bootstrap_batch``'s ``sender``: every
    release that announces its versions does; 0.1.0 announces none and refuses the field (one not heard
    yet is not sent it either: its batches are then not counted, as before)."""
    return sequencer is not None and sequencer.announced


@dataclass
class CopyServed:
    """What the sequencer served of one core's snapshot install of one shard."""

    rows: int = 0
    batches: int = 0
    last_batch_ms: int = 0
    # The table whose first batch began the count: its first batch asked again begins a new install.
    first_table: str | None = None


class CopiesServed:
    """The sequencer's count of what it served of each core's snapshot install, per shard (see
    "Progress at the sequencer"). Pure: the driver passes the time and the shard's membership.

    Bounded: a count exists only for a core that was the shard's learner or one of its members when
    a batch was served to it, and ``served`` and ``shown`` drop (for their shard) the count of a
    core that is neither any more (none at all where this core is not the sequencer: the driver
    passes no members then), and that of a member served nothing for ``idle_ms`` (its install ended
    or was abandoned: an installing core waits no longer than that for a batch). The learner's count
    stays while it is the learner: it is what ``cluster add-core`` shows, and a count that stops is
    how it sees a stalled copy."""

    def __init__(self, idle_ms: int) -> None:
        if idle_ms < 1:
            raise ValueError("idle_ms must be positive")
        self.idle_ms = idle_ms
        self._shards: dict[str, dict[str, CopyServed]] = {}

    def served(
        self,
        shard: str,
        core: str,
        table: str,
        first_batch: bool,
        rows: int,
        now_ms: int,
        learner: str | None,
        members: tuple[str, ...],
    ) -> None:
        """One batch of ``rows`` rows of ``table`` served to ``core`` (``first_batch``: the table's first,
        asked from its start); counted only for the shard's learner or one of its ``members``."""
        self._keep(shard, learner, members, now_ms)
        if core != learner and core not in members:
            return
        copy = self._shards.setdefault(shard, {}).setdefault(core, CopyServed())
        if first_batch and copy.first_table == table:
            copy.rows = copy.batches = 0  # the install began again
        if copy.first_table is None:
            copy.first_table = table
        copy.rows += rows
        copy.batches += 1
        copy.last_batch_ms = now_ms

    def shown(self, shard: str, learner: str | None, members: tuple[str, ...], now_ms: int) -> dict[str, int] | None:
        """The learner's count as ``members`` shows it (``learner_copy``; None: nothing served to it)."""
        self._keep(shard, learner, members, now_ms)
        copy = self._shards.get(shard, {}).get(learner) if learner is not None else None
        if copy is None:
            return None
        return {"rows": copy.rows, "batches": copy.batches, "last_batch_age_ms": max(0, now_ms - copy.last_batch_ms)}

    def _keep(self, shard: str, learner: str | None, members: tuple[str, ...], now_ms: int) -> None:
        copies = self._shards.get(shard)
        if copies is None:
            return
        for core, copy in list(copies.items()):
            if core == learner:
                continue
            if core not in members or now_ms - copy.last_batch_ms >= self.idle_ms:
                del copies[core]
        if not copies:
            del self._shards[shard]


def offer_due(follower_heard_ms: int | None, now_ms: int, window_ms: int) -> bool:
    """The sequencer offers a snapshot only to a follower it heard within ``window_ms`` (an election
    timeout): offers queued for a core that is down would all arrive stale."""
    return follower_heard_ms is not None and now_ms - follower_heard_ms <= window_ms


class SnapshotInstall:
    """One install of one shard on a follower core."""

    def __init__(self, offer: SnapshotOffer, batch_rows_max: int, request_timeout_ms: int, now_ms: int) -> None:
        self.offer = offer
        self.request_timeout_ms = request_timeout_ms
        self.copy = TableCopy(offer.sequencer, batch_rows_max, now_ms)
        self.mode = InstallMode.LISTING
        # The read fence after the copy: bootstrap.fence, the rule a replicant follows too.
        self._fence = ReadFence(False, request_timeout_ms)
        self.reason: str | None = None
        self._now_ms = now_ms
        self._deadline_ms = now_ms + request_timeout_ms

    @classmethod
    def fenced(cls, sequencer: str, request_timeout_ms: int, now_ms: int) -> SnapshotInstall:
        """A core restarted after ``FinishInstall`` and before its fence was reached: fence again."""
        install = cls(SnapshotOffer(sequencer, 0, TxKey(0, 0), b""), 1, request_timeout_ms, now_ms)
        install.mode = InstallMode.FENCED
        install._fence.fence()
        return install

    @property
    def fence_key(self) -> TxKey | None:
        """The committed key reads wait for (None: not known yet, or no fence)."""
        return self._fence.fence_key

    def start(self) -> list[InstallEffect]:
        return [BeginInstall(self.offer.key, self.offer.digest), FetchTables(self.offer.sequencer)]

    @property
    def read_fence_error(self) -> str | None:
        """While fenced: why the committed key was not told at the last ask (the core's refusal, no
        answer in time), else None."""
        return self._fence.error if self.mode is InstallMode.FENCED else None

    def not_serving_reason(self) -> str | None:
        """Why a read of the shard is refused while this install is under way or fenced (None: neither):
        which snapshot, from which sequencer, how far, and why the fence key is not known yet, if an
        ask failed. A restart while fenced knows neither the offer's key nor its sequencer."""
        offer = self.offer
        snapshot = f"a snapshot at {offer.key} from {offer.sequencer}" if offer.generation else "a snapshot"
        if self.mode in (InstallMode.LISTING, InstallMode.COPYING):
            return f"installing {snapshot} ({self.copy.rows} rows copied so far); retry later"
        if self.mode is not InstallMode.FENCED:
            return None
        fence = self.fence_key or "the committed key being asked for"
        why = f"; that key was not told at the last ask: {self._fence.error}" if self._fence.error else ""
        return f"replaying after installing {snapshot}, up to {fence}{why}; retry later"

    @property
    def serving(self) -> bool:
        """Reads of the shard may be served."""
        return self.mode in (InstallMode.DONE, InstallMode.ABANDONED) and self.reason is None

    def step(self, event: InstallEvent, applied_key: TxKey, now_ms: int) -> list[InstallEffect]:
        if now_ms < self._now_ms:
            raise ValueError(f"time went backwards: {now_ms} < {self._now_ms}")
        self._now_ms = now_ms
        if self.mode in (InstallMode.DONE, InstallMode.ABANDONED):
            return []
        core = self.offer.sequencer
        if isinstance(event, Ticked):
            if self.mode is InstallMode.FENCED:
                # Asked again when the answer is lost (read_index also fails without a quorum).
                if self._fence.should_ask(now_ms):
                    return [FetchCommitted(core, self._fence.question)]
                return self._check_fence(applied_key)
            if now_ms >= self._deadline_ms:
                return self._abandon(f"no answer from {core} for {self.request_timeout_ms} ms")
            return []
        if isinstance(event, RequestFailed):
            if event.core == core and self.mode is not InstallMode.FENCED:
                return self._abandon(f"request to {core} failed: {event.reason}")
            return []
        if isinstance(event, CommittedReceived):
            # Any core may answer: read_index is confirmed by the sequencer with a quorum.
            if self.mode is not InstallMode.FENCED:
                return []
            if self._fence.committed_received(event.committed_key, applied_key, event.question, event.error):
                self.mode = InstallMode.DONE
                return [FenceReached()]
            if event.committed_key is None and self._fence.should_ask(now_ms):
                return [FetchCommitted(core, self._fence.question)]  # at once: the install waits for nothing else
            return []
        try:
            if isinstance(event, TablesReceived):
                if self.mode is not InstallMode.LISTING or event.core != core:
                    return []
                self.mode = InstallMode.COPYING
                effects: list[InstallEffect] = list(self.copy.on_tables(event))
            elif isinstance(event, BatchReceived):
                if self.mode is not InstallMode.COPYING or not self.copy.answers(event):
                    return []
                effects = list(self.copy.on_batch(event))
            else:
                raise TypeError(f"not an install event: {event!r}")
        except CopyFailed as failed:
            return self._abandon(str(failed))
        self._deadline_ms = now_ms + self.request_timeout_ms
        if self.copy.done:
            self.mode = InstallMode.FENCED
            self._fence.fence()
            effects.append(FinishInstall(self.offer.key, self.offer.digest))
            if self._fence.should_ask(now_ms):
                effects.append(FetchCommitted(core, self._fence.question))

        return effects

    def _check_fence(self, applied_key: TxKey) -> list[InstallEffect]:
        if self._fence.reached(applied_key):
            self.mode = InstallMode.DONE
            return [FenceReached()]
        return []

    def _abandon(self, reason: str) -> list[InstallEffect]:
        self.mode = InstallMode.ABANDONED
        self.reason = reason
        return [InstallAbandoned(reason)]
