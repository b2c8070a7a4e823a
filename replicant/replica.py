"""The replicant side of one shard's replication: find an upstream core, bootstrap or resume, apply pushes.

Theory of operation
-------------------
A replicant node runs one ``ShardReplica`` per shard. It is a pure state machine: the driver feeds
it events through ``step(event, now_ms)`` and executes the effects it returns, in order. Its modes
(``rlog.replication.Mode``) are Mria's:

* DISCONNECTED. Every ``retry_interval_ms`` (plus random jitter) it probes every core's journal age
  (``ProbeJournals``), chooses an upstream with ``replicant.upstream.choose_upstream`` (never a core
  whose committed key is behind the applied key: no time travel, invariant 5; preferably one that
  hears the sequencer; spread by agent count) and sends ``watch(applied key, applied digest)``.
  The data it holds is a consistent prefix of the shard's history, but it serves no read until it
  is NORMAL again (``readable``: reads answer ``not_ready``, as docs/concepts/guarantees.md says).
* NORMAL, after a ``resume`` answer (the core retains the applied key with that digest). Each push
  of the watched agent is applied only where it continues the applied key: entries at or below it
  are duplicates and skipped (the one at the applied key must have the applied digest), the first
  new entry must have ``prev == applied key`` and every new entry must extend the digest chain;
  then ``ApplyEntries`` and ``SendAck`` with the new applied key. A gap is never skipped: the agent
  is rejected and the replica goes DISCONNECTED to resynchronise by a new watch. A digest that
  does not chain means divergent history: nothing is applied, DISCONNECTED with that reason (the
  next watch from the same key and digest is answered ``bootstrap``). An entry that records a cluster
  version the replica's release does not speak (``speaks``; ``rlog.versions.first_unspoken``) is not
  applied (nor spilled): the entries before it are, then the agent is rejected and the replica goes
  DISCONNECTED with the reason, as a core refuses such an append.
* BOOTSTRAP, after a ``bootstrap`` answer with K0 (the core's committed key). The shard is reset
  (``ResetShard``: the applied key stays as a floor, the digest becomes ``UNKNOWN_DIGEST``), then
  the tables are copied in key-ordered batches of ``batch_rows_max`` rows (``FetchTables``, then
  ``FetchBatch``/``ApplyBatch`` table after table; an answer to a request of an earlier attempt,
  told by its ``watch_id``, is ignored: it was read before this K0, and the replay from K0 would
  not heal it). The agent pushes entries after K0 meanwhile; they
  are checked exactly like normal pushes (from K0, then from the last spilled key), spilled
  (``SpillEntries``) and acknowledged with the spilled key. Once ``spill_entries_max`` entries are
  spilled, or the node's ``SpillBudget`` (``spill_bytes_max`` bytes of spilled entries for all the
  shards of a node together: a replicant's first start bootstraps every shard at once) has no room
  for the next, it releases the agent (``SendReject(..., "resynchronise")``: the core frees its window)
  and takes no more pushes; ``last_error`` says so. The copy goes on, however long it takes: the
  failure detector then watches only the copy's requests, not the released agent's silence (a
  stalled agent would stop for want of acknowledgements after its ack timeout, and the replica,
  hearing nothing, would fail the bootstrap and start over, forever if copies outlast that).
* LOCAL_REPLAY, when every table is copied: ``ReplaySpill`` sets the position to K0 and applies the
  spilled entries. Because entries carry results (full rows, deleted keys), this heals whatever the
  dirty reads saw. The applied key becomes the last spilled key, then the replica is NORMAL. If
  the spill was full (the agent was released), it resynchronises at once (DISCONNECTED, then a
  watch that resumes from the applied key).
* Sizing trap. That resume needs a core that still holds the spill's last key. A copy that outlasts
  another ``retention_entries_max`` writes on the cores after the spill filled finds it trimmed:
  the watch is answered bootstrap and the copy starts again, for ever under sustained writes. Each
  such restart is counted (``bootstraps_outrun``, persisted like ``bootstraps``) and said once, in
  ``last_error`` and in a ``ModeChanged`` with ``warning``: the copy is slower than the cores'
  retention; raise their ``retention_entries_max``, or the replicant's spill budget (its ``[limits]``
  ``spill_entries_max`` and ``spill_bytes_max``) so that a spill holds a whole copy's writes. The
  protocol is unchanged.
* Read fence. The copied rows were read dirty: they may hold writes of entries after the applied
  key. After a bootstrap the replica therefore asks its upstream for the shard's committed key as
  the sequencer confirms it with a quorum (``FetchCommitted``, asked after the last batch was
  received, so that key is at least any key whose writes a batch saw) and serves no read of any
  kind (``readable()`` is False) until the applied key reaches it. Reaching the key clears the
  fence, whatever applied it; a failed or unanswered request is asked again (after
  ``failure_timeout_ms`` at most; of the new upstream after a failover). The fence lives in memory: see the README.
* Fencing (invariant 6). A push from anything but the watched agent of the upstream is answered
  ``SendReject(..., "not the watched agent")`` and never applied. Every push carries the answer to
  the watch that created its agent, with the replica's ``watch_id``: a push of the new agent that
  overtakes the answer (they travel on different connections) stands for it, so a new agent is
  never taken for a zombie. (While a watch is outstanding, other pushes from the core it went to
  are dropped without an answer.)
* Full disk (``rlog.disk``). The driver steps ``DiskFull`` with the position its disk still holds
  (the failed turn's applies were rolled back), whether its reads are fenced there and the shard's
  spill there (entries, bytes as stored), and ``DiskFreed`` once a probe wrote again. The replica
  adopts that position, that spill (counted and charged to the node's budget as the disk holds it:
  a rolled-back bootstrap reset leaves the earlier spill there), and the fence if the failed turn
  had reached it (it asks for a fence key again once resynchronised), and takes nothing from anyone
  while full: pushes are dropped unacknowledged (the agent's window fills and it stops:
  backpressure, no gap), answers and timers are ignored. A NORMAL replica stays NORMAL, so it keeps
  serving reads of what it holds; a read that needs a newer key waits and times out as usual. Any
  other mode goes DISCONNECTED. Once freed it resynchronises at once: DISCONNECTED, then a watch
  from its applied key (a resume).
* Failure detector. No push or heartbeat from the watched agent for ``failure_timeout_ms`` (unless
  the full spill released it), or an
  upstream that has not heard the sequencer for ``failure_timeout_ms``, or a request (watch, tables,
  batch) unanswered for ``failure_timeout_ms`` (a probe: ``probe_timeout_ms`` more), makes the
  replica DISCONNECTED; it fails over to another core when one qualifies, resuming from its applied
  key. ``RequestFailed`` from the upstream and ``WatchRefused`` do the same. After
  ``bootstrap_attempts_max`` consecutive failed bootstraps it says so in ``last_error`` and
  retries only every ``failure_timeout_ms``.

Driver contract
---------------
1. Build the replica from what is persisted: the applied key and digest (``UNKNOWN_DIGEST`` after a
   ``ResetShard``), the ``bootstraps``/``resumes``/``bootstraps_outrun`` counters, the read fence
   flag and the entries in the shard's spill (``status().entries_buffered``) and their bytes as
   stored (charged to the node's ``SpillBudget`` until a reset deletes them). Deliver ``Ticked`` at
   least every ``retry_interval_ms / 2`` (``next_deadline_ms()`` says when the next one matters);
   ``now_ms`` never decreases.
2. Execute the effects in list order. ``ApplyEntries`` applies the entries and records the new
   applied key and digest in one SQLite transaction (invariant 4). ``ResetShard`` deletes the
   shard's rows and spill and persists ``UNKNOWN_DIGEST`` (keeping the applied key). ``ApplyBatch``
   writes full rows; ``SpillEntries`` appends to the persisted spill; ``ReplaySpill`` sets the
   position to K0, applies the spill in order (position and data in the same transactions) and
   empties it; ``ReadFenceChanged`` persists its flag. All of these are durable before the next
   effect runs: a ``SendAck`` comes after what it acknowledges.
3. ``ProbeJournals``: ask every listed core for its journal age of the shard and step one
   ``JournalsReceived`` after at most ``probe_timeout_ms`` (``None`` for a core that did not answer).
   ``SendWatch``/``FetchTables``/``FetchBatch``: step the answer (``WatchAccepted``, ``WatchRefused``,
   ``TablesReceived``, ``BatchReceived``) or ``RequestFailed``, the last three with the ``watch_id``
   the replica had when the request was sent; apply a table list's definitions only if
   ``takes_tables`` says so. Sends are fire-and-forget.
4. ``ModeChanged`` is for logs and metrics. The read path asks ``readable()``: NORMAL and past the
   read fence of the last bootstrap; never in BOOTSTRAP or LOCAL_REPLAY.
5. ``FetchCommitted``: step ``CommittedReceived`` with the core's committed key, or with None when
   the request failed or timed out, and why (``status().read_fence_error``); ``FenceQuestionUnsent``
   when it could not be sent (the driver's pending requests full), and why.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mnesite.bootstrap.copy import CopyFailed, TableCopy
from mnesite.bootstrap.fence import ReadFence
from mnesite.replicant.upstream import choose_upstream
from mnesite.rlog import messages
from mnesite.rlog.disk import DiskFreed, DiskFull
from mnesite.rlog.limits import require_positive_ints
from mnesite.rlog.replication import (
    UNKNOWN_DIGEST,
    ApplyBatch,
    ApplyEntries,
    BatchReceived,
    CommittedReceived,
    FenceQuestionUnsent,
    FetchBatch,
    FetchCommitted,
    FetchTables,
    JournalAnswer,
    JournalsReceived,
    Mode,
    ModeChanged,
    ProbeJournals,
    PushReceived,
    ReadFenceChanged,
    ReplaySpill,
    RequestFailed,
    ResetShard,
    SendAck,
    SendReject,
    SendWatch,
    SpillEntries,
    TablesReceived,
    Ticked,
    WatchAccepted,
    WatchRefused,
)
from mnesite.rlog.types import Entry, TxKey, chain_break
from mnesite.rlog.versions import THIS_RELEASE, Announcement, first_unspoken, unspoken_cluster_version

REJECT_NOT_WATCHED = "not the watched agent"
REJECT_GAP = "gap"
REJECT_DIGEST = "digest mismatch"
REJECT_RESYNCHRONISE = "resynchronise"
REJECT_UNSPOKEN = "unspoken cluster version"
CORES_MAX = 64

ReplicaEvent = (
    Ticked
    | JournalsReceived
    | WatchAccepted
    | WatchRefused
    | PushReceived
    | TablesReceived
    | BatchReceived
    | CommittedReceived
    | FenceQuestionUnsent
    | RequestFailed
    | DiskFull
    | DiskFreed
)
ReplicaEffect = (
    ProbeJournals
    | SendWatch
    | ApplyEntries
    | ResetShard
    | FetchTables
    | FetchBatch
    | ApplyBatch
    | SpillEntries
    | ReplaySpill
    | SendAck
    | SendReject
    | ModeChanged
    | FetchCommitted
    | ReadFenceChanged
)


class ReplicaConfigError(ValueError):
    """A configuration or construction argument is invalid."""


@dataclass(frozen=True)
class ReplicaConfig:
    # No push or heartbeat from the upstream for this long (or an upstream that does not hear the
    # sequencer for this long, or a request unanswered for this long) means it failed.
    failure_timeout_ms: int = 3000
    # How long the driver waits for journal answers after ``ProbeJournals`` (informational here).
    probe_timeout_ms: int = 1000
    # Wait after a failed attempt before probing again (plus up to half of it as random jitter).
    retry_interval_ms: int = 200
    # Rows asked for in one ``FetchBatch`` (the core also bounds a batch in bytes: bootstrap.serve).
    batch_rows_max: int = 10_000
    # Entries spilled during one bootstrap; then the agent is released until the copy is done.
    spill_entries_max: int = 100_000
    # Bytes of spilled entries (``Entry.size_bytes``: an entry may be as large as a frame) for all
    # the shards of a node together (``SpillBudget``).
    spill_bytes_max: int = 1024 * 1024 * 1024
    # Consecutive failed bootstraps after which retries slow down to one per failure_timeout_ms.
    bootstrap_attempts_max: int = 3

    def __post_init__(self) -> None:
        require_positive_ints(self, ReplicaConfigError)
        if self.probe_timeout_ms > self.failure_timeout_ms:
            raise ReplicaConfigError("probe_timeout_ms must not exceed failure_timeout_ms")


@dataclass(frozen=True)
class ReplicaStatus:
    shard: str
    mode: Mode
    upstream: str | None
    agent_id: str | None
    applied_key: TxKey
    applied_digest: bytes
    # The upstream's committed key, as last heard from it (None without an upstream: unknown).
    committed_key: TxKey | None
    # committed_key.counter - applied_key.counter when both are of one generation, else None.
    lag_entries: int | None
    bootstraps: int
    resumes: int
    rows_copied: int
    entries_spilled: int  # since the replica was built, over all its bootstraps
    last_error: str | None
    hears_sequencer: bool = False
    bootstrap_failures_in_a_row: int = 0
    # Reads are served (NORMAL and past the read fence).
    readable: bool = False
    # Progress of the current (or last) copy.
    copy_rows: int = 0
    copy_rows_expected: int = 0
    copy_bytes: int = 0
    copy_rows_per_s: float = 0.0
    copy_eta_ms: int | None = None
    # After a bootstrap: the key the applied key must reach before reads (None: being asked).
    read_fence: TxKey | None = None
    # While fenced: why the last ask for the fence key got none (the upstream's refusal, or no answer).
    read_fence_error: str | None = None
    read_fenced: bool = False
    # DiskFull until DiskFreed: nothing is applied (see "Full disk").
    disk_full: bool = False
    # Bootstraps begun again because the last copy outlasted the cores' retention ("Sizing trap").
    bootstraps_outrun: int = 0
    # Entries in the shard's spill now (``spilled``): those of the bootstrap in progress, or of one
    # that did not finish (failed, or the replicant restarted) until the next bootstrap's reset.
    entries_buffered: int = 0


class _Waiting(enum.Enum):
    NOTHING = "nothing"
    JOURNALS = "journals"
    WATCH = "watch"
    TABLES = "tables"
    BATCH = "batch"


class _Invalid(Exception):
    """A push cannot be applied; ``reject`` is what the agent is told, ``reason`` what the status says."""

    def __init__(self, reject: str, reason: str) -> None:
        super().__init__(reason)
        self.reject = reject
        self.reason = reason


class SpillBudget:
    """The bytes of spilled entries a node holds, over all its bootstrapping shards (each spill is on
    disk until its replay). One object is shared by a node's replicas; a replica charges what it
    spills, and the spill it finds on disk at the start, and gives it back when its spill is replayed
    or discarded by a new bootstrap."""

    def __init__(self, bytes_max: int) -> None:
        if bytes_max < 1:
            raise ReplicaConfigError(f"spill_bytes_max must be a positive integer, got {bytes_max!r}")
        self.bytes_max = bytes_max
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used + size > self.bytes_max:
            return False
        self.used += size
        return True

    def give_back(self, size: int) -> None:
        # Checked always (not an ``assert``, which ``python -O`` drops): a budget that went below zero
        # would let the node spill more than ``spill_bytes_max`` from then on, silently.
        if size < 0 or size > self.used:
            raise ValueError(f"a spill gave back {size} bytes of {self.used} taken (spill accounting is wrong)")
        self.used -= size

    def charge(self, size: int) -> None:
        """Charge a spill already on disk (one left by a bootstrap a restart interrupted), even past
        ``bytes_max``: it is there whatever the budget says, and the spills after it get that much less."""
        if size < 0:
            raise ValueError(f"a spill on disk cannot hold {size} bytes")
        self.used += size


class ShardReplica:
    """Replication state of one shard on one replicant node."""

    def __init__(
        self,
        shard: str,
        name: str,
        cores: tuple[str, ...],
        applied_key: TxKey,
        applied_digest: bytes,
        config: ReplicaConfig,
        rng: random.Random,
        now_ms: int,
        bootstraps: int = 0,
        resumes: int = 0,
        read_fenced: bool = False,
        spill_budget: SpillBudget | None = None,
        speaks: Announcement = THIS_RELEASE,
        bootstraps_outrun: int = 0,
        spilled: int = 0,
        spilled_bytes: int = 0,
    ) -> None:
        if not shard or not name:
            raise ReplicaConfigError("shard and name must not be empty")
        cores = tuple(cores)
        if not cores or len(set(cores)) != len(cores) or len(cores) > CORES_MAX:
            raise ReplicaConfigError(f"cores must be 1 to {CORES_MAX} distinct names, got {cores!r}")
        if not isinstance(applied_digest, bytes):
            raise ReplicaConfigError("applied_digest must be bytes")
        if min(bootstraps, resumes, bootstraps_outrun, spilled, spilled_bytes) < 0:
            raise ReplicaConfigError("counters must not be negative")
        self.shard = shard
        self.name = name
        self.cores = cores
        self.config = config
        self.speaks = speaks
        self._rng = rng
        self._now_ms = now_ms
        self._mode = Mode.DISCONNECTED
        self._applied_key = applied_key
        self._applied_digest = applied_digest
        self._upstream: str | None = None
        self._agent_id: str | None = None
        self._committed_key: TxKey | None = None
        self._hears_sequencer = False
        self._not_hearing_since_ms: int | None = None
        self._last_heard_ms = now_ms
        self._waiting = _Waiting.NOTHING
        self._watch_id: str | None = None
        self._request_core: str | None = None
        # Whether the core the outstanding watch went to said, in its journal answer, that it hears
        # the sequencer: what ``hears_sequencer`` is from the watch's answer until its first push.
        self._request_core_hears_sequencer = False
        self._request_deadline_ms = now_ms
        self._next_probe_ms = now_ms
        self._failed_core: str | None = None
        self._bootstraps = bootstraps
        self._resumes = resumes
        self._bootstraps_outrun = bootstraps_outrun
        # The key a bootstrap whose spill filled resumes from, until a watch is answered ("Sizing trap").
        self._resuming_after_full_spill: TxKey | None = None
        # Set while a bootstrap that the trap restarted runs: said again when its spill fills.
        self._outrun: str | None = None
        self._rows_copied = 0
        self._entries_spilled = 0
        self._bootstrap_failures = 0
        self._last_error: str | None = None
        # Bootstrap progress.
        self._start_key = applied_key
        self._start_digest = applied_digest
        # The copy of the current (or last) bootstrap.
        self._copy: TableCopy | None = None
        self._spill_key = applied_key
        self._spill_digest = applied_digest
        # Entries in the shard's spill: on disk at the start, those of a bootstrap that did not finish
        # (never replayed: a restarted replica's digest is unknown, so its next watch bootstraps, and
        # that reset deletes them). Their bytes are charged to the node's budget until then, as a
        # failed bootstrap's are in the process that spilled them.
        self._spilled = spilled
        # The token of the last push of the watched agent read: every acknowledgement echoes it, which
        # proves to the agent that this replica read its pushes up to that one (core.agent).
        self._push_token: bytes | None = None
        self._spill_budget = spill_budget if spill_budget is not None else SpillBudget(config.spill_bytes_max)
        self._spill_budget.charge(spilled_bytes)
        self._spilled_bytes = spilled_bytes
        self._spill_full = False
        # Read fence after a bootstrap (see the theory of operation).
        self._fence = ReadFence(read_fenced, config.failure_timeout_ms)
        self._out: list[ReplicaEffect] = []
        self._disk_full = False

    # ------------------------------------------------------------ queries

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def applied_key(self) -> TxKey:
        return self._applied_key

    @property
    def applied_digest(self) -> bytes:
        return self._applied_digest

    @property
    def upstream(self) -> str | None:
        return self._upstream

    @property
    def agent_id(self) -> str | None:
        return self._agent_id

    @property
    def watch_id(self) -> str | None:
        """The id of the last watch sent."""
        return self._watch_id

    def readable(self) -> bool:
        """Reads of every kind may be served: NORMAL, and the read fence of the last bootstrap is reached."""
        return self._mode is Mode.NORMAL and not self._fence.fenced

    @property
    def read_fenced(self) -> bool:
        """Reads are fenced until the replay of the last bootstrap reaches its read fence (``status``'s
        ``read_fenced``, without building the whole status: a driver asks at every apply)."""
        return self._fence.fenced

    @property
    def waits_for_watch_answer(self) -> bool:
        """A watch is outstanding: a push may carry its answer (see ``push_received``)."""
        return self._waiting is _Waiting.WATCH

    def readable_at(self, min_key: TxKey) -> bool:
        """A read that must see ``min_key`` (a linearizable read's read index, a client's ``min_key``)
        may be answered now: ``readable`` (checked again when it is answered: a bootstrap may have
        begun while it waited) and ``min_key`` applied."""
        return self.readable() and self._applied_key >= min_key

    def status(self) -> ReplicaStatus:
        copy = self._copy
        rate, eta = copy.progress(self._now_ms) if copy is not None else (0.0, None)
        if self._mode is not Mode.BOOTSTRAP:
            eta = None
        lag = None
        if self._committed_key is not None and self._committed_key.generation == self._applied_key.generation:
            lag = self._committed_key.counter - self._applied_key.counter
        return ReplicaStatus(
            shard=self.shard,
            mode=self._mode,
            upstream=self._upstream,
            agent_id=self._agent_id,
            applied_key=self._applied_key,
            applied_digest=self._applied_digest,
            committed_key=self._committed_key,
            lag_entries=lag,
            bootstraps=self._bootstraps,
            resumes=self._resumes,
            rows_copied=self._rows_copied,
            copy_rows=copy.rows if copy is not None else 0,
            copy_rows_expected=copy.rows_expected if copy is not None else 0,
            copy_bytes=copy.bytes if copy is not None else 0,
            copy_rows_per_s=rate,
            copy_eta_ms=eta,
            entries_spilled=self._entries_spilled,
            entries_buffered=self._spilled,
            last_error=self._last_error,
            hears_sequencer=self._hears_sequencer,
            bootstrap_failures_in_a_row=self._bootstrap_failures,
            readable=self.readable(),
            read_fence=self._fence.fence_key,
            read_fence_error=self._fence.error if self._fence.fenced else None,
            read_fenced=self._fence.fenced,
            disk_full=self._disk_full,
            bootstraps_outrun=self._bootstraps_outrun,
        )

    def next_deadline_ms(self) -> int:
        """The earliest time at which a ``Ticked`` may change something."""
        if self._disk_full:
            # Ticks change nothing until DiskFreed; a deadline in the past would spin the driver.
            return self._now_ms + self.config.failure_timeout_ms
        deadlines = []
        if self._waiting is not _Waiting.NOTHING:
            deadlines.append(self._request_deadline_ms)
        if self._mode is Mode.DISCONNECTED:
            if self._waiting is _Waiting.NOTHING:
                deadlines.append(self._next_probe_ms)
        elif not self._agent_released():
            deadlines.append(self._last_heard_ms + self.config.failure_timeout_ms)
            ask_ms = self._fence.next_ask_ms(self._now_ms)
            if ask_ms is not None:
                deadlines.append(ask_ms)
            if self._not_hearing_since_ms is not None:
                deadlines.append(self._not_hearing_since_ms + self.config.failure_timeout_ms)
        return min(deadlines, default=self._now_ms + self.config.failure_timeout_ms)

    def _agent_released(self) -> bool:
        """The full spill released the agent: until the copy is done, its silence is no failure."""
        return self._mode is Mode.BOOTSTRAP and self._spill_full

    # ------------------------------------------------------------ the entry point

    def step(self, event: ReplicaEvent, now_ms: int) -> list[ReplicaEffect]:
        if now_ms < self._now_ms:
            raise ValueError(f"time went backwards: {now_ms} < {self._now_ms}")
        self._now_ms = now_ms
        self._out = []
        if isinstance(event, DiskFull):
            self._on_disk_full(event)
        elif isinstance(event, DiskFreed):
            self._on_disk_freed()
        elif self._disk_full:
            pass  # nothing can be applied or persisted: take nothing (see "Full disk")
        elif isinstance(event, Ticked):
            self._on_tick()
        elif isinstance(event, JournalsReceived):
            self._on_journals(event)
        elif isinstance(event, WatchAccepted):
            self._on_watch_accepted(event)
        elif isinstance(event, WatchRefused):
            if self._waiting is _Waiting.WATCH and event.core == self._request_core:
                self._fail(f"watch refused by {event.core}: {event.reason}")
        elif isinstance(event, PushReceived):
            self._on_push(event)
        elif isinstance(event, TablesReceived):
            self._on_tables(event)
        elif isinstance(event, BatchReceived):
            self._on_batch(event)
        elif isinstance(event, RequestFailed):
            self._on_request_failed(event)
        elif isinstance(event, CommittedReceived):
            self._on_committed_received(event)
        elif isinstance(event, FenceQuestionUnsent):
            if event.core == self._upstream:
                self._fence.unsent(event.question, event.reason)
        else:
            raise TypeError(f"not a replica event: {event!r}")
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ modes and failures

    def _set_mode(self, mode: Mode, reason: str, warning: bool = False) -> None:
        if mode is not self._mode:
            self._mode = mode
            self._out.append(ModeChanged(mode, self._upstream, reason, warning))

    def _request(self, waiting: _Waiting, core: str | None) -> None:
        self._waiting = waiting
        self._request_core = core
        self._request_deadline_ms = self._now_ms + self.config.failure_timeout_ms
        if waiting is _Waiting.JOURNALS:
            # The driver answers after at most probe_timeout_ms; this only guards against a lost answer.
            self._request_deadline_ms += self.config.probe_timeout_ms

    def _retry_delay_ms(self) -> int:
        if self._bootstrap_failures >= self.config.bootstrap_attempts_max:
            return self.config.failure_timeout_ms
        interval = self.config.retry_interval_ms
        return interval + self._rng.randint(0, interval // 2)

    def _fail(self, reason: str, delay_ms: int | None = None) -> None:
        """Give up on the current attempt or upstream: DISCONNECTED, probe again later."""
        if self._mode is Mode.BOOTSTRAP:
            self._bootstrap_failures += 1
        failed = self._upstream or self._request_core
        if failed is not None:
            self._failed_core = failed
        if self._bootstrap_failures >= self.config.bootstrap_attempts_max:
            reason = (
                f"bootstrap failed {self._bootstrap_failures} times in a row (last: {reason}); "
                f"retrying every {self.config.failure_timeout_ms} ms"
            )
        self._last_error = reason
        self._set_mode(Mode.DISCONNECTED, reason)
        self._upstream = None
        self._agent_id = None
        self._push_token = None
        self._committed_key = None  # the old upstream's: unknown until the next one says it
        self._hears_sequencer = False
        self._not_hearing_since_ms = None
        self._waiting = _Waiting.NOTHING
        self._request_core = None
        self._fence.forget_question()  # an answer from the old upstream is ignored; ask the next one
        self._next_probe_ms = self._now_ms + (self._retry_delay_ms() if delay_ms is None else delay_ms)

    def _on_tick(self) -> None:
        now = self._now_ms
        timeout = self.config.failure_timeout_ms
        if self._waiting is not _Waiting.NOTHING and now >= self._request_deadline_ms:
            self._fail(f"no answer to the {self._waiting.value} request from {self._request_core or 'the cores'}")
            return
        if self._mode is Mode.DISCONNECTED:
            if self._waiting is _Waiting.NOTHING and now >= self._next_probe_ms:
                self._out.append(ProbeJournals(self.cores))
                self._request(_Waiting.JOURNALS, None)
            return
        if self._agent_released():
            return  # the copy's requests have their own deadline (above)
        if now - self._last_heard_ms >= timeout:
            self._fail(f"no push or heartbeat from {self._upstream} for {timeout} ms")
        elif self._not_hearing_since_ms is not None and now - self._not_hearing_since_ms >= timeout:
            self._fail(f"{self._upstream} has not heard the sequencer for {timeout} ms")
        else:
            self._ask_fence()

    def _on_disk_full(self, event: DiskFull) -> None:
        if event.applied_key is None or event.applied_digest is None:
            raise ValueError("DiskFull for a replica needs the position the disk holds")
        if event.spilled is None or event.spilled_bytes is None:
            raise ValueError("DiskFull for a replica needs the spill the disk holds")
        self._disk_full = True
        self._applied_key, self._applied_digest = event.applied_key, event.applied_digest
        # The spill on disk, which the replica counts and charges from now on, in place of its own
        # count: a rolled-back bootstrap reset left the earlier spill there (counted as discarded, it
        # would be charged nowhere until the next reset), a rolled-back SpillEntries took its
        # entries off, and a rolled-back replay left the spill whole. A known digest comes with no
        # spill (the reset and the replay change both in one transaction): kept charged, its bytes
        # would stay so for good, since the replica resumes from that digest and no reset discards them.
        self._spill_budget.give_back(self._spilled_bytes)
        self._spill_budget.charge(event.spilled_bytes)
        self._spilled, self._spilled_bytes = event.spilled, event.spilled_bytes
        if event.read_fenced and not self._fence.fenced:
            # The rolled-back turn reached the read fence: the rows on disk are not healed yet.
            self._fence.fence()
        self._last_error = f"the disk is full ({event.error}): applying nothing until space is freed"
        if self._mode is not Mode.NORMAL:
            self._fail(self._last_error)

    def _on_disk_freed(self) -> None:
        if not self._disk_full:
            return
        self._disk_full = False
        # The agent saw no acknowledgement for a while and may have pushed past what was applied:
        # resume from the applied key under a new watch rather than meet a gap.
        self._fail(f"the disk was full: resynchronising from {self._applied_key}", delay_ms=0)

    def _on_request_failed(self, event: RequestFailed) -> None:
        if not self._of_this_attempt(event.watch_id):
            return  # a request of an earlier attempt: it must not fail this one on the same core
        waiting_on_it = self._waiting is not _Waiting.NOTHING and event.core == self._request_core
        if waiting_on_it or (self._upstream is not None and event.core == self._upstream):
            self._fail(f"request to {event.core} failed: {event.reason}")

    # ------------------------------------------------------------ choosing an upstream

    def _on_journals(self, event: JournalsReceived) -> None:
        if self._mode is not Mode.DISCONNECTED or self._waiting is not _Waiting.JOURNALS:
            return
        ages: dict[str, JournalAnswer | None] = {core: None for core in self.cores}
        for core, age in event.ages:
            if core in ages:
                ages[core] = age
        core = None
        if self._failed_core is not None:
            core = choose_upstream(ages, self._applied_key, self._rng, frozenset({self._failed_core}))
        if core is None:
            core = choose_upstream(ages, self._applied_key, self._rng)
        if core is None:
            self._waiting = _Waiting.NOTHING
            unreadable, unsent, refused = dict(event.unreadable), dict(event.unsent), dict(event.refused)
            self._last_error = f"no core qualifies as upstream at applied key {self._applied_key}: " + ", ".join(
                self._describe(name, age, unreadable.get(name), unsent.get(name), refused.get(name))
                for name, age in sorted(ages.items())
            )
            self._next_probe_ms = self._now_ms + self._retry_delay_ms()
            return
        self._watch_id = f"{self._rng.getrandbits(64):016x}"
        chosen = ages[core]
        self._request_core_hears_sequencer = chosen is not None and chosen.hears_sequencer
        self._out.append(SendWatch(core, self._applied_key, self._applied_digest, self._watch_id))
        self._request(_Waiting.WATCH, core)

    def _describe(
        self,
        core: str,
        age: JournalAnswer | None,
        unreadable: str | None = None,
        unsent: str | None = None,
        refused: str | None = None,
    ) -> str:
        if age is None and unsent is not None:
            return f"{core} was not asked ({unsent})"
        if age is None and refused is not None:
            return f"{core} refused the journal request: {refused}"
        if age is None:
            return f"{core} did not answer" if unreadable is None else f"{core} answered, but {unreadable}"
        if age.committed_key < self._applied_key:
            return f"{core} is behind at {age.committed_key}"
        return f"{core} at {age.committed_key}"

    def _on_watch_accepted(self, event: WatchAccepted) -> None:
        if self._waiting is not _Waiting.WATCH or event.core != self._request_core:
            return  # a late or duplicated answer to an earlier watch
        if event.watch_id != self._watch_id:
            return  # the answer to an earlier watch sent to the same core
        if event.mode == "resume":
            if (
                event.start_key != self._applied_key
                or event.start_digest != self._applied_digest
                or self._applied_digest == UNKNOWN_DIGEST
            ):
                self._fail(
                    f"{event.core} resumed at {event.start_key}, but this replica is at {self._applied_key} "
                    "with another digest"
                )
                return
            self._connect(event)
            self._resumes += 1
            self._resuming_after_full_spill, self._outrun = None, None
            self._last_error = None
            self._set_mode(Mode.NORMAL, f"resumed from {self._applied_key} on {event.core}")
        elif event.mode == "bootstrap":
            if event.start_key < self._applied_key:
                self._fail(f"{event.core} offered a bootstrap at {event.start_key}, behind {self._applied_key}")
                return
            self._connect(event)
            self._bootstraps += 1
            reason, self._outrun = f"bootstrapping from {event.core} at {event.start_key}", None
            if self._resuming_after_full_spill is not None:
                self._bootstraps_outrun += 1
                self._outrun = self._outrun_reason(event.core, self._resuming_after_full_spill)
                reason = self._last_error = f"{reason} again: {self._outrun}"
            self._resuming_after_full_spill = None
            self._set_mode(Mode.BOOTSTRAP, reason, warning=self._outrun is not None)
            # Fenced before the reset: a crash between the two must not leave dirty rows readable.
            self._out.append(ReadFenceChanged(True))
            self._out.append(ResetShard())
            self._applied_digest = UNKNOWN_DIGEST
            self._fence.fence()
            self._start_key, self._start_digest = event.start_key, event.start_digest
            self._spill_key, self._spill_digest = event.start_key, event.start_digest
            self._discard_spill()  # ResetShard empties the shard's spill on disk
            self._spill_full = False
            self._copy = None
            self._out.append(FetchTables(event.core))
            self._request(_Waiting.TABLES, event.core)
        else:
            self._fail(f"{event.core} answered the watch with the unknown mode {event.mode!r}")

    def _outrun_reason(self, core: str, resume_key: TxKey) -> str:
        """Why a bootstrap begins again ("Sizing trap"), and what to raise."""
        return (
            f"{core} no longer holds {resume_key}, where the last copy's full spill ended: the copy "
            "took longer than the cores' retention of the writes made meanwhile (restart "
            f"{self._bootstraps_outrun} for this reason, bootstraps_outrun; under sustained writes it "
            "repeats). Raise the cores' [rlog] retention_entries_max above the writes the shard takes "
            f"during one copy, or this replicant's spill above them (the spill holds {self.config.spill_entries_max} "
            f"entries of a shard and {self.config.spill_bytes_max} bytes for the node: [limits] "
            "spill_entries_max, spill_bytes_max)"
        )

    def _connect(self, event: WatchAccepted) -> None:
        self._upstream = event.core
        self._agent_id = event.agent_id
        self._push_token = None
        self._waiting = _Waiting.NOTHING
        self._request_core = None
        self._failed_core = None
        self._last_heard_ms = self._now_ms
        # As its journal answer said (a core that hears none is chosen when no core hears one), not
        # taken for granted: the first push says it again.
        self._hears_sequencer = self._request_core_hears_sequencer
        self._not_hearing_since_ms = None if self._hears_sequencer else self._now_ms
        self._committed_key = max(event.start_key, self._applied_key)

    # ------------------------------------------------------------ bootstrap

    def takes_tables(self, core: str, watch_id: str | None) -> bool:
        """Whether a table list from ``core``, asked in the attempt ``watch_id``, answers the request
        outstanding (the driver applies its table definitions only then)."""
        return (
            self._mode is Mode.BOOTSTRAP
            and self._waiting is _Waiting.TABLES
            and core == self._upstream
            and self._of_this_attempt(watch_id)
        )

    def _of_this_attempt(self, watch_id: str | None) -> bool:
        """An answer (or failure) of a request sent in the attempt ``watch_id`` concerns the current
        attempt (None: not tied to one). A late answer of a failed bootstrap on the same core may match
        the next one's request: its rows were read before the next K0, so the replay from K0 would
        not heal them (entries up to K0 are never applied over the copy)."""
        return watch_id is None or watch_id == self._watch_id

    def _on_tables(self, event: TablesReceived) -> None:
        if not self.takes_tables(event.core, event.watch_id):
            return
        self._copy = TableCopy(event.core, self.config.batch_rows_max, self._now_ms)
        self._run_copy(lambda copy: copy.on_tables(event))

    def _on_batch(self, event: BatchReceived) -> None:
        copy = self._copy
        if self._mode is not Mode.BOOTSTRAP or self._waiting is not _Waiting.BATCH or copy is None:
            return
        if event.core != self._upstream or not self._of_this_attempt(event.watch_id) or not copy.answers(event):
            return  # an answer to a request this replica no longer waits for (or of an earlier attempt)
        self._run_copy(lambda copy: copy.on_batch(event))

    def _run_copy(self, step: Callable[[TableCopy], list]) -> None:
        """One step of the copy loop (bootstrap.copy): its effects, then the next request or the replay."""
        copy = self._copy
        if copy is None:
            return
        rows_before = copy.rows
        try:
            effects = step(copy)
        except CopyFailed as failed:
            self._fail(str(failed))
            return
        self._rows_copied += copy.rows - rows_before
        self._out.extend(effects)
        if copy.done:
            self._finish_copy()
        else:
            self._request(_Waiting.BATCH, self._upstream)

    def _finish_copy(self) -> None:
        self._waiting = _Waiting.NOTHING
        self._set_mode(Mode.LOCAL_REPLAY, f"tables copied; replaying {self._spilled} spilled entries")
        self._out.append(ReplaySpill(self._start_key, self._start_digest))
        self._applied_key, self._applied_digest = self._spill_key, self._spill_digest
        self._discard_spill()  # ReplaySpill applies the spill and empties it
        self._bootstrap_failures = 0
        self._last_error = None
        self._set_mode(Mode.NORMAL, f"bootstrap done at {self._applied_key}")
        if self._spill_full:
            # The agent was released when the spill filled; a new watch resumes exactly at the applied key.
            self._resuming_after_full_spill = self._applied_key
            self._fail(f"the spill was full; resuming from {self._applied_key}", delay_ms=0)
            return
        if self._upstream is not None and self._agent_id is not None:
            self._out.append(SendAck(self._upstream, self._agent_id, self._applied_key, self._push_token))
        self._ask_fence()

    # ------------------------------------------------------------ pushes

    def takes_push(self, core: str, agent_id: str, accepted: WatchAccepted | None = None) -> bool:
        """Whether a push of ``agent_id`` from ``core`` would be read (its entries looked at) if it
        arrived now: the watched agent's, or one whose agent the outstanding watch's answer names.
        For anything else ``PushReceived`` only rejects or ignores it, whatever its entries, so a
        driver need not decode them (``replicant.node``)."""
        return self._answers_watch(core, agent_id, accepted) or self._watched(core, agent_id)

    def _watched(self, core: str, agent_id: str) -> bool:
        return self._mode in (Mode.NORMAL, Mode.BOOTSTRAP) and core == self._upstream and agent_id == self._agent_id

    def _answers_watch(self, core: str, agent_id: str, accepted: WatchAccepted | None) -> bool:
        return (
            accepted is not None
            and self._waiting is _Waiting.WATCH
            and (accepted.core, accepted.agent_id) == (core, agent_id)
        )

    def _on_push(self, event: PushReceived) -> None:
        accepted = event.accepted
        if self._answers_watch(event.core, event.agent_id, accepted):
            # The first push of the agent this watch created overtook the answer: it carries the
            # answer, so take it as such (ignored unless it answers the outstanding watch).
            self._on_watch_accepted(accepted)
        watched = self._watched(event.core, event.agent_id)
        if not watched:
            if self._waiting is _Waiting.WATCH and event.core == self._request_core:
                return  # maybe the agent this watch creates, ahead of its WatchAccepted
            self._out.append(SendReject(event.core, event.agent_id, REJECT_NOT_WATCHED))
            return
        self._last_heard_ms = self._now_ms
        self._push_token = event.token
        if self._committed_key is None or event.committed_key > self._committed_key:
            self._committed_key = event.committed_key
        self._hears_sequencer = event.hears_sequencer
        if event.hears_sequencer:
            self._not_hearing_since_ms = None
        elif self._not_hearing_since_ms is None:
            self._not_hearing_since_ms = self._now_ms
        if self._mode is Mode.BOOTSTRAP and self._spill_full:
            return  # the released agent's pushes still in flight: the replica resumes after the copy
        bootstrapping = self._mode is Mode.BOOTSTRAP
        key, digest = (
            (self._spill_key, self._spill_digest) if bootstrapping else (self._applied_key, self._applied_digest)
        )
        try:
            new = self._new_entries(event, key, digest)
        except _Invalid as invalid:
            self._out.append(SendReject(event.core, event.agent_id, invalid.reject))
            self._fail(invalid.reason)
            return
        unspoken = first_unspoken(new, self.speaks)
        refused = None
        if unspoken is not None:
            # A core pushes such an entry only to a replicant that speaks it (``watch_protocol_refusal``);
            # one that does anyway (broken, or this replicant was rolled back) must not move the shard
            # to a version its release cannot read (the storage format would move too): the replica
            # takes the entries before it, then stops there and says why, as a core does. Its next
            # watch goes only to a core whose log it reads (``log_readable``).
            index, version = unspoken
            why = unspoken_cluster_version(version, self.speaks, "replicant")
            refused = f"{event.core} pushed entry {new[index].tx_key}, refused: {why}"
            new = new[:index]
        if bootstrapping:
            self._spill(event, new)
        else:
            if new:
                self._out.append(ApplyEntries(new))
                self._applied_key, self._applied_digest = new[-1].tx_key, new[-1].digest
                self._check_fence()
            self._out.append(SendAck(event.core, event.agent_id, self._applied_key, self._push_token))
        if refused is not None:
            self._out.append(SendReject(event.core, event.agent_id, REJECT_UNSPOKEN))
            self._fail(refused)

    def _new_entries(self, event: PushReceived, key: TxKey, digest: bytes) -> tuple[Entry, ...]:
        """The entries of ``event`` after ``key``, checked to continue it; raises ``_Invalid``."""
        new: list[Entry] = []
        chain_key, chain_digest = key, digest
        previous: TxKey | None = None
        for entry in event.entries:
            if entry.shard != self.shard:
                raise _Invalid("wrong shard", f"{event.core} pushed an entry of shard {entry.shard!r}")
            if previous is not None and entry.tx_key <= previous:
                raise _Invalid("out of order", f"{event.core} pushed {entry.tx_key} after {previous}")
            previous = entry.tx_key
            if entry.tx_key > event.committed_key:
                raise _Invalid(
                    "not committed",
                    f"{event.core} pushed {entry.tx_key}, beyond its committed key {event.committed_key}",
                )
            if entry.tx_key <= key:
                if entry.tx_key == key and entry.digest != digest:
                    raise _Invalid(
                        REJECT_DIGEST, f"divergent history: {event.core} has another digest at {key} than this replica"
                    )
                continue  # a duplicate of an entry already applied (or spilled)
            if entry.prev != chain_key:
                if not new:
                    raise _Invalid(
                        REJECT_GAP, f"gap: {event.core} pushed {entry.tx_key} after {entry.prev}, expected after {key}"
                    )
                raise _Invalid("out of order", f"{event.core} pushed {entry.tx_key} after {entry.prev}")
            if chain_break(chain_key, chain_digest, entry) is not None:
                raise _Invalid(
                    REJECT_DIGEST,
                    f"divergent history: the digest of {entry.tx_key} from {event.core} does not chain on {chain_key}",
                )
            new.append(entry)
            chain_key, chain_digest = entry.tx_key, entry.digest
        return tuple(new)

    def _spill(self, event: PushReceived, new: tuple[Entry, ...]) -> None:
        if new:
            taken: list[Entry] = []
            for entry in new[: self.config.spill_entries_max - self._spilled]:
                size = entry.size_bytes
                if not self._spill_budget.take(size):
                    break
                taken.append(entry)
                self._spilled_bytes += size
            if taken:
                self._out.append(SpillEntries(tuple(taken)))
                self._spilled += len(taken)
                self._entries_spilled += len(taken)
                self._spill_key, self._spill_digest = taken[-1].tx_key, taken[-1].digest
            if len(taken) < len(new) or self._spilled >= self.config.spill_entries_max:
                # Release the agent rather than stall it: a stalled one stops for want of
                # acknowledgements, and its silence would fail the copy (see BOOTSTRAP).
                self._spill_full = True
                self._last_error = (
                    f"spill full ({self._spilled} entries, {self._spilled_bytes} bytes; the node's spills "
                    f"{self._spill_budget.used} bytes; [limits] spill_entries_max, spill_bytes_max): agent released "
                    f"until the copy is done, then resuming from {self._spill_key}"
                )
                if self._outrun is not None:
                    self._last_error += f"; this bootstrap began again because {self._outrun}"
                self._out.append(SendReject(event.core, event.agent_id, REJECT_RESYNCHRONISE))
                return
        self._out.append(SendAck(event.core, event.agent_id, self._spill_key, self._push_token))

    def forget(self) -> None:
        """The driver drops this replica (its shard's turn was rolled back before the shard was on disk):
        what its spill charged goes back to the node's budget, which outlives it."""
        self._discard_spill()

    def _discard_spill(self) -> None:
        self._spill_budget.give_back(self._spilled_bytes)
        self._spilled = 0
        self._spilled_bytes = 0

    # ------------------------------------------------------------ the read fence

    def _ask_fence(self) -> None:
        # bootstrap.fence decides when (once per failure_timeout_ms until answered); the replica asks
        # only its upstream, in NORMAL mode.
        if self._upstream is None or self._mode is not Mode.NORMAL:
            return
        if self._fence.should_ask(self._now_ms):
            self._out.append(FetchCommitted(self._upstream, self._fence.question))

    def _on_committed_received(self, event: CommittedReceived) -> None:
        if event.core != self._upstream:
            return  # an answer from an upstream this replica left
        if self._fence.committed_received(event.committed_key, self._applied_key, event.question, event.error):
            self._out.append(ReadFenceChanged(False))

    def _check_fence(self) -> None:
        if self._fence.reached(self._applied_key):
            self._out.append(ReadFenceChanged(False))


def watch_accepted(core: str, answer: Any) -> WatchAccepted | None:
    """The watch answer ``answer`` from ``core`` (a reply, or repeated in a push); None if malformed."""
    accepted = messages.answer_as(answer, messages.WatchAnswer)
    if accepted is None:
        return None
    return WatchAccepted(core, accepted.agent, accepted.mode, accepted.start, accepted.start_digest, accepted.watch_id)


def push_received(replica: ShardReplica, body: messages.Push) -> PushReceived:
    """The ``PushReceived`` event of a decoded push (driver and simulator alike); raises ``MessageError``
    for malformed entries. The answer to the watch that created the agent rides along: the replica
    takes it for the answer if this push overtook it ("Fencing"). A push the replica will refuse unread
    (a superseded agent's) is not decoded: the per-row work is spent only on pushes that may apply."""
    # Only an outstanding watch takes an answer (``_answers_watch``): otherwise it is not converted.
    accepted = watch_accepted(body.core, body.watch) if replica.waits_for_watch_answer else None
    entries: tuple[Entry, ...] = ()
    if replica.takes_push(body.core, body.agent, accepted):
        # An entry of one table's rows is decoded as one run (``WriteRows``): its rows bound as decoded.
        entries = tuple(messages.decode_entry(entry, runs=True) for entry in body.entries)
    return PushReceived(body.core, body.agent, entries, body.committed, body.hears_sequencer, accepted, body.token)


def ack_body(shard: str, ack: SendAck) -> dict[str, Any]:
    """The ``push_ack`` body of ``ack`` (driver and simulator alike): the token only when the push
    carried one, so that a core of release 0.1.0, which sends none, never sees the field."""
    body: dict[str, Any] = {"shard": shard, "agent": ack.agent_id, "applied": list(ack.applied_key)}
    if ack.token is not None:
        body["token"] = ack.token
    return body
