"""The core node driver: zmq in front, apsw behind, one ``ShardConsensus`` per shard in between.

Theory of operation
-------------------
One thread owns the sockets, the database and the state machines, so nothing here needs a lock.
Each turn of the loop:

1. ticks every shard whose consensus deadline has passed;
2. drains up to ``group_commit_max`` frames: peer messages are stepped into their shard's
   consensus; reads are answered from the applied state; writes are turned into result ops
   (guards evaluated against the applied state *plus* the shard's unapplied tail, see
   ``core.guard_tail``; a failed guard is answered only from committed state) and proposed at the
   sequencer, or forwarded to it from any other core; once the input is drained, ``BatchEnded``
   sends the turn's new entries to each follower in one append;
3. executes the effects of every step as it happens, inside ONE open SQLite write transaction
   (the log view reads through the same connection, so it sees them at once), and queues every
   outgoing frame: peer sends and client replies alike;
4. commits that transaction (one fsync for the whole turn: group commit), and only then sends
   the queued frames. Persist-before-send (DESIGN, etcd's rule) holds for the whole batch. A turn
   that only applied committed entries commits without an fsync (``begin(durable=False)``): those
   entries are durable in the log already, and a restart applies again what a power failure took.
   Committed entries are applied from the in-memory unapplied tail, not read back from SQLite.
   Two kinds of frame go out at once instead, before the turn's commit. A sequencer's appends
   (``Send.before_persisted``), so that the followers' fsyncs overlap ours; after the commit
   ``Persisted`` lets each sequencer count its own entries (Raft thesis 10.2.1), and what that
   commits is applied in one more, fsync-less, commit before the queued frames are sent. And a
   write's acknowledgement, as its entry commits (just before the apply of the same step): the
   entry is durable on a majority through earlier commits, so the turn's own commit cannot make
   the answer false.

If the SQLite commit fails the state machines already believe the effects were durable, so the
only safe continuation rebuilds them from disk. For a full disk (``rlog.disk``) that happens in
process (``disk_filled``): the turn is rolled back, none of its frames is sent, the old machines
step ``DiskFull`` (a sequencer steps down and its clients are told the outcome is unknown), and
new ones are built from disk and told ``DiskFull`` too; writes are refused with ``disk_full``
until a probe writes again (``disk_freed``). Any other storage failure stops the process, and a
restart rebuilds them. A ``ConsensusInvariantError`` (a peer's append would replace a committed
entry) stops the shard, not the process (``_stop_shard``): its machine is stepped no more, and the
node serves its other shards.

Writes at a core that is not the sequencer are forwarded (once: a forwarded request is never
forwarded again) to the sequencer it knows; the answer is relayed. Requests carry a request id
that makes a retry idempotent: an id found in the rlog is answered with its tx key once committed.

A core whose database is new asks its peers for their generations before it takes part
(Eventuate's disaster recovery: the clock must not restart in the past); see ``recover_generations``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import apsw
import msgspec
import zmq
from mnesite.bootstrap import read_service
from mnesite.bootstrap.copy import CopyFailed, batch_from_answer, copy_schema_ops, rows_refusal, tables_from_answer
from mnesite.bootstrap.serve import read_batch
from mnesite.core import rules
from mnesite.core.agent import AgentConfig
from mnesite.core.agent_server import AgentServer
from mnesite.core.consensus import (
    REJECT_NOT_SEQUENCER,
    REJECT_TOO_LARGE,
    BatchEnded,
    Commit,
    ConsensusConfig,
    ConsensusConfigError,
    ConsensusInvariantError,
    Excluded,
    FeedRequested,
    ForceStarted,
    ForceStartRefused,
    ForceStartRequested,
    LearnerRefused,
    MembershipChangeRequested,
    MessageReceived,
    Persisted,
    PersistedState,
    PersistEntries,
    PersistState,
    ProposalCommitted,
    ProposalFailed,
    ProposalRejected,
    Proposed,
    ProtocolViolation,
    Role,
    RoleChanged,
    Send,
    ShardConsensus,
    SnapshotNeeded,
    SnapshotRequested,
    Ticked,
    TruncateLog,
)
from mnesite.core.consensus_wire import message_from_wire, message_to_wire
from mnesite.core.guard_tail import GUARD_ANSWER, GUARD_HELD, GuardTail
from mnesite.core.membership import ALREADY_DONE, membership_of
from mnesite.core.outcome import (
    REASON_SENT_AGAIN,
    Acknowledged,
    CommitWaiters,
    ForwardedRequests,
    Outcome,
    OutcomeUnknown,
)
from mnesite.core.recent import RecentBudget, RecentEntries
from mnesite.core.recovery import (
    ANSWERED_WHILE_RECOVERING,
    RecoveryProgress,
    reached_generations,
    reached_last_keys,
    recovered_generations,
    recovered_members,
    recovered_vote_floors,
    recovering_refusal,
    recovery_answer,
    recovery_shortfall,
    refusal_notes,
    unrecovered_start,
    vote_recovered,
    well_formed_answers,
)
from mnesite.core.snapshot import (
    BeginInstall,
    CopiesServed,
    FenceReached,
    FinishInstall,
    InstallAbandoned,
    InstallMode,
    SnapshotInstall,
    SnapshotOffer,
    accept_offer,
    exclusion_after_install,
    offer_due,
    reads_copy_sender,
    reads_forced_offer,
    reads_snapshot_request,
    snapshot_request_due,
    state_after_install,
)
from mnesite.core.transaction import GuardFailed, evaluate
from mnesite.core.versions import (
    PEERS_MAX,
    UNSPOKEN_CLUSTER_VERSION,
    VERSIONS_PROBE_INTERVAL_MS,
    ClusterVersionProposals,
    PeerRefused,
    PeerVersions,
    cluster_version_of,
    member_refusal,
)
from mnesite.core.watch import WatchRefusedError
from mnesite.rlog import messages, range_requests, replication
from mnesite.rlog.backup import BACKUP_KINDS, RESTORED_META
from mnesite.rlog.config import Config, ConfigError
from mnesite.rlog.data_dir import DataDirectoryLock
from mnesite.rlog.disk import DiskFreed, DiskFull, StorageFailedError
from mnesite.rlog.limits import FRAME_ENVELOPE_BYTES, SHARDS_MAX
from mnesite.rlog.messages import Message, MessageError
from mnesite.rlog.process_signals import ProcessSignals
from mnesite.rlog.query import CheckedQuery, QueryRequest
from mnesite.rlog.retention import keep_from_match_keys
from mnesite.rlog.roles import PEER_REQUESTS_OUTSTANDING_MIN, WRITE_KINDS
from mnesite.rlog.schema import (
    SchemaError,
    TableSchema,
)
from mnesite.rlog.security import NodeSecurity
from mnesite.rlog.send_queue import CORE_TRACKED_BYTES_MIN
from mnesite.rlog.server import (
    STOPPING,
    UNANSWERED_KINDS,
    Deferred,
    NodeServer,
    OverloadedError,
    RequestError,
    StoppedWhileStarting,
    monotonic_ms,
    relayed,
    request_id_of,
)
from mnesite.rlog.store import ShardPosition, Store, StoreError, read_fault, storage_fault
from mnesite.rlog.types import (
    ROW_OPS,
    ZERO_KEY,
    ClusterVersionOp,
    Entry,
    MembersOp,
    PackedEntry,
    TxKey,
    new_request_id,
    read_targets,
)
from mnesite.rlog.versions import local_announcement

log = logging.getLogger("mnesite.core")

READ_KINDS = frozenset(
    {
        "get",
        "scan",
        "count",
        "bootstrap_batch",
        "status",
        "list_tables",
        "rlog_tail",
        "rlog_entries",
        "journal",
        *range_requests.KINDS,
    }
)
QUERY_KINDS = frozenset({"query", "query_page", "query_close"})
POLL_INTERVAL_MS_MAX = 50
FORWARD_TIMEOUT_MS = 5000
# Requests forwarded and not answered yet; the sequencer holds as many of a peer's connection.
FORWARDED_MAX = PEER_REQUESTS_OUTSTANDING_MIN
WAITERS_MAX = 100_000
# Meta key prefix (+ shard) of a rebuilt core's vote floor, "generation,counter" (``recover_generations``).
VOTE_FLOOR_META = "vote_floor:"
# ``status``'s verdict of an exclusion persisted before a restart (the journals were compared when told).
RESTARTED_VERDICT = "told before this core restarted (its log then said how the journals compare)"
# Journal probes a core on an empty database makes (each up to recovery_timeout_ms) before it gives up.
RECOVERY_ROUNDS_MAX = 10
# How often a recovering core, answering status (``_recovery_wait``), looks whether its probe's answers are in.
RECOVERY_POLL_INTERVAL_MS = 20
PEER_SEND_QUEUE_MAX = 1000
# Bytes an agent pushes before its replicant's first acknowledgement (a larger entry goes alone): a
# live replicant acknowledges within a round trip and gets its whole window then, while a flood of
# watches naming endpoints where nothing listens costs little memory and little work each.
PROBATION_BYTES_MAX = 64 * 1024
# An agent whose replicant acknowledged nothing yet stops after this long (instead of the 10 s
# ack timeout): a live replica acknowledges within a round trip, and one that hears nothing for its
# failure_timeout_ms (3 s by default) watches again anyway. Dead watches then cost 3 s each.
PROBATION_TIMEOUT_MS = 3000
DEALERS_MAX = 1000  # sockets to peers (replicant endpoints are bounded by [limits] watches_max)
STATUS_COUNT_INTERVAL_MS = 1000
# Snapshot install (core.snapshot): rows asked per batch (the serving core also bounds it in bytes)
# and how long an answer may take before the install is abandoned (the sequencer offers again).
INSTALL_BATCH_ROWS_MAX = 10_000
PROGRESS_LOG_INTERVAL_MS = 5000  # bootstrap and install progress lines in the log, per shard
INSTALL_REQUEST_TIMEOUT_MS = 10_000
FORCE_START_PROBE_TIMEOUT_MS = 1000  # how long a force-start waits for each member's journal
# Core endpoints a node keeps (its config's and those learned from membership entries and peers).
MEMBERS_LEARNED_MAX = 64
VERSIONS_PROBE_PREFIX = "versions-"  # request ids of the journal probes of core.versions


# What ``_read`` returns for a read it will answer later (a ``count``: ``NodeServer.count_later``).
HELD = object()


class StoreLogView:
    """``core.consensus.LogView`` over the store, for one shard (reads see the open transaction).

    Entries of the unapplied tail are served from memory: the sequencer sends them to followers
    right after appending them, and reading them back from SQLite would cost more than the append.
    So are the entries persisted last (``core.recent``), which a lazy follower is fed after they
    were applied and left the tail.
    """

    def __init__(
        self, store: Store, shard: str, tail: GuardTail[HeldFailure], recent: RecentEntries | None = None
    ) -> None:
        self.store = store
        self.shard = shard
        self.tail = tail
        self.recent = recent if recent is not None else RecentEntries()

    def last_key(self) -> TxKey:
        return self.store.last_entry(self.shard)[0]

    def digest_at(self, key: TxKey) -> bytes | None:
        return self.store.digest_at(self.shard, key)

    def entries_after(self, key: TxKey, limit: int) -> list[Entry]:
        cached = self.tail.covering(key, limit)
        if cached is not None:
            return cached
        recent = self.recent.after(key, limit)
        if recent is not None:
            return recent
        return self.store.entries_after(self.shard, key, limit)

    def trimmed_key(self) -> TxKey:
        return self.store.trimmed(self.shard)[0]

    def count_after(self, key: TxKey, up_to: TxKey, limit: int) -> int:
        return self.store.count_between(self.shard, key, up_to, limit)


class AgentStoreLogView:
    """``core.agent.AgentLogView`` over a shard's ``StoreLogView``: what an agent reads from SQLite
    comes packed (``PackedEntry``: the ops go out as stored, never decoded and encoded again);
    the unapplied tail it may reach is served from memory as the consensus view serves it."""

    def __init__(self, view: StoreLogView) -> None:
        self.view = view

    def entries_after(self, key: TxKey, limit: int) -> list[Entry] | list[PackedEntry]:
        cached = self.view.tail.covering(key, limit)
        if cached is not None:
            return cached
        return self.view.store.packed_entries_after(self.view.shard, key, limit)

    def trimmed_key(self) -> TxKey:
        return self.view.trimmed_key()

    def count_after(self, key: TxKey, up_to: TxKey, limit: int) -> int:
        return self.view.count_after(key, up_to, limit)


@dataclass
class ShardDriver:
    shard: str
    consensus: ShardConsensus
    log_view: StoreLogView
    tail: GuardTail[HeldFailure] = field(default_factory=GuardTail)
    # Clients waiting for their entry to commit, and what they are told (core.outcome).
    waiters: CommitWaiters[list[bytes]] = field(default_factory=CommitWaiters)
    # The highest generation persisted here, and how many times it grew since this process started
    # (elections seen: a stable cluster keeps this at the elections of its start-up).
    generation: int = 0
    elections: int = 0
    # Writes without guards admitted in this loop turn and not proposed yet (``core.rules.HeldWrites``):
    # proposed together at the end of the turn's input or before any other event of this shard, so
    # the log order is their arrival order. Bounded by WAITERS_MAX with the waiters.
    held: rules.HeldWrites[tuple[list[bytes], Message]] = field(default_factory=rules.HeldWrites)
    # Commits this core heard as a follower and applies together (``core.rules.FollowerApply``).
    apply: rules.FollowerApply = field(default_factory=lambda: rules.FollowerApply(0))
    # The consensus's ``stuck_reason`` the log last said (logged once when it appears and when it goes).
    stuck_logged: str | None = None


@dataclass
class QueryIndexGather:
    """A linearizable query's read indexes, one per shard it reads; answered at most once."""

    envelope: list[bytes]
    message: Message
    request: QueryRequest
    checked: CheckedQuery
    shards: tuple[str, ...]
    targets: dict[str, TxKey]
    keys: dict[str, TxKey] = field(default_factory=dict)
    answered: bool = False


@dataclass(frozen=True)
class ForwardedRead:
    """The payload of a read this core forwarded to a shard's sequencer (a linearizable read, a
    ``read_index``): the client's envelope and request id. A read changes nothing, so one the sequencer
    does not answer is ``no_sequencer`` (the client may ask another node), never ``outcome_unknown``.

    It is forwarded under a request id of its own (``_forward``), as a query's read index is: answers
    are matched by request id, and the client's, global but chosen by clients, may be another client's
    too; the sequencer's answer then went to whichever of them forwarded it last."""

    envelope: list[bytes]
    request_id: str


@dataclass(frozen=True)
class QueryIndexAsk:
    """The payload of a read_index this core asked a shard's sequencer for, for a query."""

    gather: QueryIndexGather
    shard: str


@dataclass(frozen=True)
class HeldFailure:
    """A failed guard waiting until the entries it observed commit (``core.guard_tail``)."""

    envelope: list[bytes] | None
    request_id: str
    failure: GuardFailed


def consensus_config_of(config: Config) -> ConsensusConfig:
    """The consensus machine's settings from the node's ``[cluster]`` timing and ``[limits]``. An
    append (and a push) is one frame the receiving core (or replicant) decodes within its own
    ``frame_bytes_max``: its entries' bytes are bounded below that, room left for the message around
    them, and so is one entry's (a larger write is refused ``too_large`` instead of never reaching a
    follower)."""
    room = config.limits.frame_bytes_max - FRAME_ENVELOPE_BYTES
    return ConsensusConfig(
        election_timeout_ms_min=config.timing.election_timeout_ms_min,
        election_timeout_ms_max=config.timing.election_timeout_ms_max,
        heartbeat_interval_ms=config.timing.heartbeat_interval_ms,
        lazy_feed_interval_ms=config.timing.lazy_feed_interval_ms,
        append_bytes_max=min(ConsensusConfig.append_bytes_max, room),
        entry_bytes_max=room,
    )


class CoreNode(NodeServer):
    role = "core"

    def __init__(
        self,
        config: Config,
        clock_ms: Callable[[], int] = monotonic_ms,
        rng: random.Random | None = None,
        consensus_config: ConsensusConfig | None = None,
        signals: ProcessSignals | None = None,
    ) -> None:
        """``signals``: the process's stop and reload signals (``mnesite start``), looked at during the
        start-up recovery too: a stop ends it (``StoppedWhileStarting``)."""
        if config.role != "core":
            raise ConfigError(f"[node].role is {config.role!r}, not core")
        self.clock_ms = clock_ms
        self.rng = rng or random.Random()
        self.consensus_config = consensus_config or consensus_config_of(config)
        store, data_dir_lock = DataDirectoryLock.acquire_and_open(
            config.data_dir, config.name, config.database_path, config.synchronous
        )
        super().__init__(config, store, data_dir_lock, signals)
        # Toward its peers only frames sent without a copy anyway are tracked: appends are on the write path.
        self.tracked_bytes_min = CORE_TRACKED_BYTES_MIN
        try:
            self._start_core(config)
        except StoppedWhileStarting as stopped:
            self.close()
            # As ``serve_forever``'s last line: the operator's proof that the core stopped on purpose, and when.
            log.info("%s %s shut down (%s)", self.role, config.name, stopped)
            raise
        except BaseException:
            # A start that fails once the data directory is locked (a rebuilt core whose peers did not all
            # answer) gives the lock, the store and the query threads back: the process may go on.
            self.close()
            raise

    def _start_core(self, config: Config) -> None:
        """The rest of ``__init__``, once the store is open and the data directory locked."""
        # The cluster's membership (core.membership): the config's core_nodes seed it; after that it
        # is the membership last applied from any shard's log, and it seeds shards created later.
        # Endpoints of cores added later are learned from their membership entries.
        self.members = tuple(json.loads(self.store.meta("cluster_members", "null")) or sorted(config.core_nodes))
        self.endpoints: dict[str, str] = {**config.core_nodes, **json.loads(self.store.meta("core_endpoints", "{}"))}
        # request id -> (shard, envelope) of a membership change not yet in the log (learner stage).
        self.pending_changes: dict[str, tuple[str, list[bytes]]] = {}
        self.shards: dict[str, ShardDriver] = {}
        # Payloads: a client's envelope (its request is relayed), or a QueryIndexAsk (rlog.query).
        self.forwarded: ForwardedRequests[Any] = ForwardedRequests(FORWARDED_MAX, FORWARD_TIMEOUT_MS)
        # shard -> why this core was left out by a forced start (it then stops campaigning there)
        self.excluded: dict[str, dict[str, Any]] = {}
        # shard -> the ConsensusInvariantError that stopped it here (``_stop_shard``): until a restart its
        # machine is stepped no more, and the shard serves nothing (the node serves its other shards).
        self.stopped: dict[str, str] = {}
        self._retrying_name_waits = False  # inside _apply_name_waits: an apply does not start another loop
        # What the shards' windows of entries persisted last hold together (core.recent).
        self.recent_budget = RecentBudget()
        limits = config.limits
        # A push is one frame: never more than half of frame_bytes_max, whatever push_bytes_max says.
        push_bytes_max = max(1, min(limits.push_bytes_max, limits.frame_bytes_max // 2))
        agent_config = AgentConfig(
            push_bytes_max=push_bytes_max,
            window_bytes_max=limits.window_bytes_max,
            # What a watch may cost until its replicant first acknowledges (core.agent's probation).
            probation_bytes_max=min(push_bytes_max, PROBATION_BYTES_MAX),
            probation_timeout_ms=PROBATION_TIMEOUT_MS,
            step_bytes_max=push_bytes_max,
            push_delay_ms_max=limits.push_delay_ms_max,
            ack_timeout_ms=limits.ack_timeout_ms,
        )
        self.agent_server = AgentServer(
            config.name,
            agent_config,
            watches_max=limits.watches_max,
            agents_bytes_max=limits.agents_bytes_max,
            versions=local_announcement(cluster_id=self.store.claim_cluster_id(config.cluster_id)),
            replicant_watches_max=limits.replicant_watches_max,
        )
        # Snapshot installs per shard (core.snapshot), their requests to the sequencer, and the
        # shards that serve no read (install under way or its read fence not reached yet).
        self.installs: dict[str, SnapshotInstall] = {}
        # request id -> (shard, purpose, detail, deadline, the install that asked): an answer or an
        # expiry concerns only that install, not a later one of the same shard.
        self.install_requests: dict[str, tuple[str, str, dict[str, Any], int, SnapshotInstall | None]] = {}
        # What this core, as sequencer, served of each core's install (what `cluster add-core` sees move).
        self.copies_served = CopiesServed(INSTALL_REQUEST_TIMEOUT_MS)
        self.not_serving: dict[str, str] = {}
        # Shards whose rows an install deleted and no install has copied since (the ``installing:``
        # meta), and when this core last asked its sequencer for an offer (core.snapshot, "Re-offer").
        self.rows_lost: set[str] = set()
        self.snapshot_asked_ms: dict[str, int] = {}
        self.last_heard_ms: dict[str, int] = {}
        # What this core and its peers speak, and the cluster version entries proposed (core.versions).
        self.versions = self.agent_server.versions
        self.peer_versions = PeerVersions(self.versions)
        self.peer_frames_refused = 0
        self._next_versions_probe_ms = 0
        self._versions_check_due = False
        self._versions_probes: dict[str, str] = {}  # request id -> peer, of the last probe round
        self.cluster_version_proposals = ClusterVersionProposals()
        self._next_progress_log_ms: dict[str, int] = {}
        self.transactions = 0
        self._next_retention_ms = 0
        self._status_counts: dict[Any, tuple[int, Any]] = {}
        # A database restored from a backup (rlog.backup) may be older than votes this core cast:
        # it learns the generations in use like a core whose database was lost.
        restored = bool(self.store.meta(RESTORED_META))
        # The progress of the start-up recovery while it lasts (``status`` answers it).
        self.recovery: RecoveryProgress | None = None
        if (restored or not self.store.shards()) and len(self.members) > 1:
            # Bound first: status is answered while the peers are asked, maybe for minutes (core.recovery).
            self._bind_socket()
            log.info(
                "core %s answers status on %s while it recovers from its peers (every other request: not_ready)",
                self.config.name,
                self.config.listen,
            )
            self.recover_generations()
        if restored:
            with self.store.write_transaction():
                self.store.set_meta(RESTORED_META, "")
        for shard in self.store.shards():
            self._open_shard(shard)
            self._install_state_from_disk(shard)

    def _install_state_from_disk(self, shard: str) -> None:
        """The shard's snapshot install as the disk records it (``core.snapshot``), at a start or once a
        full disk rolled a turn back (``disk_filled``): rows half copied by an install that did not
        finish (another offer is asked for), or installed and not yet at the read fence. An install
        under way in memory is dropped (its answers are ignored): what it copied may be rolled back."""
        self.installs.pop(shard, None)
        self.rows_lost.discard(shard)
        self.not_serving.pop(shard, None)
        if int(self.store.meta(f"installing:{shard}", 0)):
            self.rows_lost.add(shard)
            self.not_serving[shard] = (
                "a snapshot install was interrupted (the shard's rows are half copied); asking the sequencer "
                "for another offer"
            )
        elif int(self.store.meta(f"read_fenced:{shard}", 0)):
            self.not_serving[shard] = "replaying after a snapshot install"
            sequencer = next((m for m in self.members if m != self.config.name), self.config.name)
            self.installs[shard] = SnapshotInstall.fenced(sequencer, INSTALL_REQUEST_TIMEOUT_MS, self.clock_ms())

    def recover_generations(self, timeout_ms: int | None = None) -> dict[str, int]:
        """A core with an empty database may have lost one that voted: learn the generations in use.

        It asks every peer for its journal and persists what ``core.recovery.recovered_generations``
        decides from the answers, with its vote already cast (for itself), and its vote floor. In a
        cluster with history (an answer shows a generation) or one declared ``existing``
        (``[cluster] initial_cluster_state``) every other member must answer (``recovery_shortfall``):
        it asks up to ``RECOVERY_ROUNDS_MAX`` times (each round also the members whose endpoints the
        last round's answers reported), then raises. If no peer answers and the cluster is
        not declared existing (a new cluster), nothing changes.
        """
        if timeout_ms is None:
            timeout_ms = self.config.timing.recovery_timeout_ms
        existing = self.config.initial_cluster_state == "existing"
        progress = RecoveryProgress(
            self.config.name, self.members, existing, self.clock_ms(), RECOVERY_ROUNDS_MAX, timeout_ms
        )
        self.recovery = progress
        try:
            return self._recover_generations(progress, timeout_ms, existing)
        finally:
            self.recovery = None

    def _recover_generations(self, progress: RecoveryProgress, timeout_ms: int, existing: bool) -> dict[str, int]:
        """``recover_generations``' work; ``progress`` says where it stands (``status`` answers it)."""
        round_ends_s = time.monotonic()
        for attempt in range(1, RECOVERY_ROUNDS_MAX + 1):
            # A round lasts timeout_ms even when it ended at once (every silent peer refused the
            # connection: still starting, as in a whole cluster's restart): ten rounds in a few
            # milliseconds gave up before a peer's listen could come up.
            self._recovery_wait(round_ends_s)
            round_ends_s = time.monotonic() + timeout_ms / 1000
            progress.round, progress.phase, progress.answers = attempt, "asking", {}
            answers = self.probe_peers(timeout_ms)
            progress.phase, progress.answers = "waiting", answers
            # ``core_nodes`` only seeds a cluster: a member added since is known by the endpoint its add
            # entry carried. Learned from this round's answers, it is asked in the next round.
            for journal in answers.values():
                self._learn_endpoints(journal.get("core_nodes"))
            # A core added to a running cluster (or one being rebuilt) starts with the members the peers
            # know, not its config's core_nodes: outside them it is a learner until an add entry names it.
            members, cluster = recovered_members(answers)
            missing = recovery_shortfall(answers, cluster or self.members, self.config.name, existing)
            if missing == 0:
                break
            silent = sorted(set(cluster or self.members) - set(well_formed_answers(answers)) - {self.config.name})
            # A member that refused this core's key or was full never answers until that is fixed: say so.
            refused = "".join(f"; {note}" for note in refusal_notes(silent, dict(progress.refusals), self.config.name))
            log.warning(
                "empty database in a running cluster: every other member must answer before this core may vote "
                "(it may have voted, and held entries, before its loss); %d not yet: %s (answers from %s)%s; "
                "asking again (%d of %d)",
                missing,
                silent,
                sorted(answers),
                refused,
                attempt,
                RECOVERY_ROUNDS_MAX,
            )
        else:
            raise StoreError(
                f"empty database in a running cluster: every other member must answer before this core may take "
                f"part; {missing} did not: {silent} (heard {sorted(answers)}){refused}; start it again once they are "
                "reachable, or remove the ones gone for good (cluster remove-core), or remove this core and add it "
                "back (docs: Membership)"
            )
        generations = recovered_generations(answers)
        floors = recovered_vote_floors(answers)
        if not any(generations.values()) and existing:
            log.info("empty database: every other member answered and none saw an election: nothing to recover")
        elif not any(generations.values()):
            # A core of a new cluster, or a rebuilt one that reached no core that saw an election: it
            # cannot tell which, and starts with nothing to recover unless the operator said which
            # ([cluster] initial_cluster_state; docs: Troubleshooting). A peer that refused its connection
            # (its key, their connections_max) said nothing either way: the log names it, not a new cluster.
            silent = set(progress.asked) - set(answers)
            warn, said = unrecovered_start(answers, silent, dict(progress.refusals), self.config.name)
            log.log(logging.WARNING if warn else logging.INFO, "%s", said)
        if generations:
            with self.store.write_transaction():
                for shard, generation in generations.items():
                    self.store.ensure_shard(shard, 0)
                    own_generation, voted_for, own_members, forced = self.store.consensus_state(shard)
                    if not vote_recovered(own_generation, voted_for, generation):
                        continue  # a restored shard past the generation the peers know, or its vote there on record
                    if generation == own_generation:  # restored at the peers' generation: only the vote is new
                        shard_members = own_members or members.get(shard, self.members)
                    else:
                        shard_members, forced = members.get(shard, self.members), False
                    self.store.persist_consensus_state(shard, generation, self.config.name, shard_members, forced)
                for shard, floor in floors.items():
                    self.store.ensure_shard(shard, 0)
                    if floor > self._vote_floor(shard):
                        self.store.set_meta(VOTE_FLOOR_META + shard, f"{floor.generation},{floor.counter}")
                if cluster is not None:
                    self._set_cluster_members(cluster)
            log.warning(
                "empty database: recovering from peers at generations %s; voting only for logs at or past %s",
                generations,
                {shard: tuple(floor) for shard, floor in floors.items()},
            )
        return generations

    def _recovery_wait(self, deadline_s: float, done: Callable[[], bool] = lambda: False) -> None:
        """Until ``time.monotonic()`` reaches ``deadline_s`` or ``done()``: answer the requests that
        arrive while the core recovers (``_answer_while_recovering``), looking at ``done`` at least every
        ``RECOVERY_POLL_INTERVAL_MS``. Unbound (a test calls ``recover_generations``), it only waits."""
        while not done():
            self._stop_if_requested_while_recovering()
            remaining_ms = int((deadline_s - time.monotonic()) * 1000) + 1
            if remaining_ms <= 0:
                return
            step_ms = min(remaining_ms, RECOVERY_POLL_INTERVAL_MS)
            if self.socket is None:
                time.sleep(step_ms / 1000)
            elif self.socket.poll(step_ms):
                self._answer_while_recovering()

    def _stop_if_requested_while_recovering(self) -> None:
        """Raise ``StoppedWhileStarting`` if a stop was asked (a signal, ``request_stop``): the recovery
        ends within a ``RECOVERY_POLL_INTERVAL_MS``, and the start with it (``__init__`` closes)."""
        self.take_signals()
        if self.stopping.is_set() and self.recovery is not None:
            raise StoppedWhileStarting(
                f"{self.stop_reason}, during its start-up recovery, round {self.recovery.round} of "
                f"{self.recovery.rounds_max}"
            )

    def _answer_while_recovering(self) -> None:
        """Answer what waits on the socket (at most ``group_commit_max`` frames) while the core recovers
        (``core.recovery``): ``status`` with its ``recovery`` section, a kind nobody answers (a peer's
        consensus message, a push, ...) dropped as by a core that is down (its protocol re-sends it),
        anything else refused ``not_ready``. Nothing is held, forwarded or acted on: the answers go out at
        once (no turn, no transaction)."""
        if self.recovery is None:
            raise RuntimeError("_answer_while_recovering outside a start-up recovery")
        for _ in range(self.config.limits.group_commit_max):
            try:
                received = self.receive()
            except zmq.Again:
                return
            if received is None:
                continue
            envelope, frame, principal = received
            try:
                message = messages.decode(frame, self.config.limits.frame_bytes_max)
            except MessageError as error:
                self.malformed_frame()
                self._send_queued(None, envelope, messages.error(request_id_of(frame), error.code, str(error)))
                continue
            answer = self.refusal(principal, message)
            if message.kind in UNANSWERED_KINDS:
                continue
            if answer is None:
                recovery = recovery_answer(self.recovery, self.clock_ms())
                section = msgspec.to_builtins(recovery)
                if message.kind in ANSWERED_WHILE_RECOVERING:
                    answer = messages.reply(message.request_id, {**self.status(), "recovery": section})
                else:
                    refusal = recovering_refusal(self.config.name, recovery)
                    answer = messages.error(message.request_id, "not_ready", refusal, {"recovery": section})
            self._send_queued(None, envelope, answer)

    def _vote_floor(self, shard: str) -> TxKey:
        """The shard's vote floor persisted by ``recover_generations`` (ZERO_KEY: none)."""
        value = self.store.meta(VOTE_FLOOR_META + shard)
        if not value:
            return ZERO_KEY
        generation, counter = (int(part) for part in str(value).split(","))
        return TxKey(generation, counter)

    def _learn_endpoints(self, endpoints: Any) -> None:
        """Peer endpoints from a peer's journal answer (untrusted: names and endpoints are checked)."""
        if not isinstance(endpoints, dict):
            return
        for name, endpoint in list(endpoints.items())[:MEMBERS_LEARNED_MAX]:
            if not (messages.answer_as(name, messages.Name) and messages.answer_as(endpoint, messages.Endpoint)):
                continue
            if name not in self.endpoints:
                self._learn_endpoint(name, endpoint)

    def _learn_endpoint(self, name: str, endpoint: str) -> None:
        if self.endpoints.get(name) == endpoint or name == self.config.name:
            return
        if len(self.endpoints) >= MEMBERS_LEARNED_MAX and name not in self.endpoints:
            log.warning("not learning endpoint %s of core %s: %d endpoints known", endpoint, name, len(self.endpoints))
            return
        self.endpoints[name] = endpoint
        learned = {n: e for n, e in self.endpoints.items() if self.config.core_nodes.get(n) != e}
        self.store.set_meta("core_endpoints", json.dumps(learned, sort_keys=True))
        log.info("core %s listens at %s", name, endpoint)

    def _set_cluster_members(self, members: tuple[str, ...]) -> None:
        if members != self.members:
            self.members = members
            self.store.set_meta("cluster_members", json.dumps(list(members)))
            log.warning("cluster membership: %s", ", ".join(members))

    def peer_client(self, peer: str, timeout_ms: int) -> Any:
        """A one-shot client to core ``peer``, speaking with this node's own key when secure."""
        from mnesite.rlog.client import Client

        endpoint = self.endpoints[peer]
        if self.security is None:
            return Client(endpoint, timeout_ms=timeout_ms, retries=0)
        return Client(
            endpoint, timeout_ms=timeout_ms, retries=0, key=self.security.client, server_key=self.security.server.public
        )

    # -- shards ------------------------------------------------------------------------------

    def _open_shard(self, shard: str) -> ShardDriver:
        generation, voted_for, members, forced = self.store.consensus_state(shard)
        state = PersistedState(
            generation,
            voted_for,
            members or self.members,
            forced,
            self._vote_floor(shard),
            self.store.excluded_generation(shard),
        )
        position = self.store.shard(shard)
        if position is None:
            raise StoreError(f"unknown shard {shard}")
        limits = self.config.limits
        tail: GuardTail[HeldFailure] = GuardTail(
            self.store.catalog(),
            limits.guard_failures_held_max,
            limits.guard_hold_ms_max,
            limits.unapplied_tail_entries_max,
            limits.unapplied_tail_bytes_max,
        )
        # Read in batches: the tail keeps what its bound allows (and the schema changes past it).
        after = position.applied
        while batch := self.store.entries_after(shard, after, 1000):
            tail.add(batch)
            after = batch[-1].tx_key
        previous = self.shards.get(shard)
        if previous is not None:  # rebuilt from disk: its window's share goes back to the node
            previous.log_view.recent.clear()
        log_view = StoreLogView(self.store, shard, tail, RecentEntries(self.recent_budget))
        try:
            consensus = ShardConsensus(
                shard,
                self.config.name,
                log_view,
                state,
                position.applied,
                self.consensus_config,
                random.Random(self.rng.random()),
                self.clock_ms(),
                own_versions=self.versions,
            )
        except ConsensusConfigError as error:
            # A log this release cannot follow (core.versions): refused like a newer storage format.
            raise StoreError(f"shard {shard}: {error}") from None
        driver = ShardDriver(
            shard, consensus, log_view, tail, generation=generation,
            apply=rules.FollowerApply(self.config.limits.follower_apply_delay_ms_max),
        )  # fmt: skip
        self.shards[shard] = driver
        self._exclusion_from_disk(shard, consensus.excluded_generation)
        return driver

    def _exclusion_from_disk(self, shard: str, generation: int | None) -> None:
        """The exclusion the shard's machine was built with (persisted: ``PersistedState.excluded_generation``),
        at a start or a rebuild from disk: ``excluded`` says it. Who told, with which members and how the
        journals compared was logged when it was told; a restart keeps only the generation."""
        if generation is None:
            if self.excluded.pop(shard, None) is not None:
                log.warning(
                    "shard %s: its data directory records no exclusion by a forced start any more (an installed "
                    "snapshot added it back, or the turn that recorded it was rolled back): it takes part again",
                    shard,
                )
            return
        known = self.excluded.get(shard)
        if known is not None and known["generation"] == generation:
            return
        self.excluded[shard] = {"by": None, "generation": generation, "members": None, "verdict": RESTARTED_VERDICT}
        log.error(
            "shard %s: this core was left out of the cluster by a forced start (generation %d), told before it "
            "restarted. It takes no part in the shard nor serves its reads: rebuild it from a member's data "
            "directory, then cluster add-core.",
            shard,
            generation,
        )

    def _shard_for(self, shard: str, create: bool) -> ShardDriver | None:
        """The shard's driver; ``create``: made (persisted) if the node has none, except on a full disk
        (None: a full core takes no part, ``rlog.disk``; a client's write was refused before). Creating
        it there failed the turn again at each heartbeat of the shard and put the probe off each time."""
        driver = self.shards.get(shard)
        if driver is None and create and not self.disk.full:
            if len(self.shards) >= SHARDS_MAX:
                raise RequestError("too_large", f"at most {SHARDS_MAX} shards")
            self.begin()
            self.store.ensure_shard(shard, 0)
            driver = self._open_shard(shard)
            self._step(driver, Ticked())
            self._versions_check_due = True
        return driver

    # -- the loop ----------------------------------------------------------------------------

    def run_turn(self) -> None:
        if self.socket is None:
            raise RuntimeError("socket not bound")
        # First, before the turn writes: what the schedule judges (the shards' modes, their applied keys)
        # is then what is committed, the state a backup's snapshot holds (``NodeServer.run_backup_schedule``).
        self.run_backup_schedule(self._backup_not_ready)
        self.agent_server.begin_turn()
        # Only the machines this loop ticks: a deadline of one it does not tick passes and stays
        # passed, and the poll below would never wait (a CPU spun for the whole snapshot install).
        deadlines = [d.consensus.next_deadline_ms() for d in self.shards.values() if self._ticked(d)]
        deadlines += [key for d in self.shards.values() if (key := d.apply.deadline_ms()) is not None]
        agents_deadline = self.agent_server.next_deadline_ms()
        if agents_deadline is not None:
            deadlines.append(agents_deadline)
        timeout = POLL_INTERVAL_MS_MAX
        if deadlines or self.has_backlog():
            timeout = 0 if self.has_backlog() else max(0, min(timeout, min(deadlines) - self.clock_ms()))
        ready = self.poll(timeout)
        began_ms = self.clock_ms()
        # Input first, timers after (DESIGN invariant 11): after a long turn, the heartbeats waiting
        # in the socket are handled (peer frames first: receive_frames) before an election timer can
        # fire, so a busy core does not campaign against a healthy sequencer.
        if self.socket in ready or self.has_backlog():
            self._serve_waiting()
        for dealer in list(self.dealers.values()):
            if dealer in ready:
                self._relay_forwarded(dealer)
        # The input's entries leave for the followers, and are committed, before the turn's
        # bookkeeping: a follower's acknowledgement, and the sequencer's Persisted, do not wait for
        # queries, the changefeed, index builds, versions, expiries and timers (about 50 us of a
        # follower's turn at one client; 3 cores' 1-client p50 1.85 -> 1.62 ms: benchmarks/PROFILE.md).
        # What that bookkeeping writes or proposes goes in the turn's final flush, as before.
        self._end_batches()
        self._apply_due()  # the gathered commits due now, or waited for by what this turn serves
        self.flush_durable()
        self.serve_queries(self._query_shard_reached)
        self.serve_changes()
        self.build_indexes()
        self._versions_turn()
        self._end_batches()
        self._expire_forwarded()
        self._expire_held_guard_failures()
        now = self.clock_ms()
        input_ms = now - began_ms
        for driver in list(self.shards.values()):
            if self._ticked(driver) and now >= driver.consensus.next_deadline_ms():
                self._step(driver, Ticked())
        for shard in list(self.installs):
            self._step_install(shard, Ticked())
        self._ask_for_snapshots()
        # The shard ticks above may have stepped agents with a later clock reading (a commit feeds
        # them its time): read the clock again, never hand an agent an earlier one.
        self.agent_server.tick(self.clock_ms())
        timers_ms = self.clock_ms() - now
        self.flush()
        self._maybe_trim()
        turn_ms = self.clock_ms() - began_ms
        if turn_ms >= self.consensus_config.election_timeout_ms_min // 2:
            # Visible before it costs an election: a turn this long delays heartbeats and votes.
            log.warning(
                "slow loop turn: %d ms (input %d ms, timers and agents %d ms, commit and sends %d ms)",
                turn_ms,
                input_ms,
                timers_ms,
                turn_ms - input_ms - timers_ms,
            )

    def _ticked(self, driver: ShardDriver) -> bool:
        """Whether the loop ticks this shard's machine: not while its rows are being replaced by a
        snapshot (it does not campaign meanwhile), nor once a forced start left this core out."""
        shard = driver.shard
        installing = shard in self.not_serving and shard not in self._installed_shards()
        return not installing and not driver.consensus.excluded and shard not in self.stopped

    def disk_filled(self) -> None:
        """A turn failed for want of space and was rolled back (``NodeServer.turn``, ``rlog.disk``).

        The machines believe that turn's effects are durable: each first steps ``DiskFull`` (a
        sequencer steps down; its proposals fail and their clients hear "outcome unknown"), then it
        is rebuilt from disk as a restart would and told ``DiskFull`` again. Agents are stopped:
        they may have been told of a commit that was rolled back (their replicants watch again).
        A membership change not in the log yet is told ``outcome_unknown`` and forgotten, as a write
        waiting for its entry is: the rebuilt machine knows nothing of it, and once space is back it
        can be asked again. A shard the turn created (its first table, a peer's first message of it)
        is forgotten with the rollback, and a snapshot install takes its state from the disk as at a
        start: the batch (and the finish) of the turn were rolled back with it."""
        error = self.disk.error
        on_disk = self.store.shards()
        for driver in self.shards.values():
            _, held = driver.held.take()
            for request_id, (envelope, _) in held:  # never proposed: nothing was logged
                self.reply(envelope, messages.error(request_id, "disk_full", f"disk_full: {error}"))
        for shard, driver in list(self.shards.items()):
            # What it gathered is forgotten as a restart forgets it: nothing is applied on a full disk
            # now, and the rebuilt shard applies from its log what it learns is committed again.
            driver.apply.take()
            self._step(driver, DiskFull(error))
            self._tell_outcomes(driver.waiters.abandoned(f"disk_full: {error}"))
            # A change whose entry the failed turn was appending (its learner caught up) is in no
            # waiter yet; one still at its learner stage was refused by the step down just above.
            self._abandon_pending_changes(shard, f"disk_full: {error}")
            self._abandon_held_guard_failures(driver, f"disk_full: {error}")
            self.agent_server.stop_shard(shard)
            if shard not in on_disk:
                driver.log_view.recent.clear()
                del self.shards[shard]
                continue
            self._step(self._open_shard(shard), DiskFull(error))
            self._install_state_from_disk(shard)

    def answer_held_at_stop(self, reason: str) -> None:
        """What a stop can answer better than ``hold`` recorded (``NodeServer.answer_at_stop`` answers
        the rest): a write not proposed yet (a turn cut short) and a failed guard held until the
        entries it observed commit wrote nothing: ``stopping``, the client asks another core."""
        for driver in self.shards.values():
            _, held = driver.held.take()
            for request_id, (envelope, _) in held:
                self.reply(envelope, messages.error(request_id, STOPPING, reason))
            for failure in driver.tail.abandoned():
                self.reply(failure.envelope, messages.error(failure.request_id, STOPPING, reason))

    def urgent(self, frame: bytes, principal: str) -> bool:
        """A peer message (``is_peer_frame``) from a core: with [security], from a key with the core
        role. The look at the frame's first bytes is all a client needs to forge; without the
        principal's check, any writer or replicant could have all its frames handled first and
        outside the turn's budget (DESIGN invariant 11)."""
        if not is_peer_frame(frame):
            return False
        return self.security is None or "core" in self.security.roles.roles_of(principal)

    def security_reloaded(self, security: NodeSecurity) -> None:
        """A watch is checked once, when it arrives, and its agent pushes on this core's own connection:
        without this, a replicant whose key or role the reload revoked kept receiving every commit until
        its agent's window filled or its acknowledgements timed out."""
        # Every agent was set up before this reload: a replicant whose key it replaced stops too (its
        # watch came from the old key; the new one watches again).
        before = security.reloads - 1
        stopped = self.agent_server.stop_replicants(lambda replicant: security.allows(replicant, "watch", before))
        if stopped:
            log.warning("SIGHUP: stopped the agents of %s: no longer allowed to watch", ", ".join(stopped))

    def disk_freed(self) -> None:
        for driver in list(self.shards.values()):
            self._step(driver, DiskFreed())

    def _end_batches(self) -> None:
        """The writes proposed in this turn go to the followers together: one append per follower."""
        for driver in list(self.shards.values()):
            if driver.consensus.role is Role.SEQUENCER:
                self._step(driver, BatchEnded())

    def _serve_waiting(self) -> None:
        self.serve_frames()
        self._propose_all()

    def _dispatch(self, envelope: list[bytes], message: Message, principal: str = "") -> None:
        if message.kind == "peer":
            self._on_peer(message)
        elif message.kind == "snapshot_offer":
            self._on_snapshot_offer(message.body)
        elif message.kind == "snapshot_request":
            self._on_snapshot_request(message.body)
        elif message.kind == "watch":
            self.reply(envelope, messages.reply(message.request_id, self._watch(message.body)))
        elif message.kind == "push_ack":
            watch = self.agent_server.watches.get(message.body.agent)
            replicant = watch.replicant if watch is not None else None
            if not rules.ack_sender_allowed(self.security is not None, replicant, principal):
                self.security.refused_sender += 1
                return
            self.agent_server.acknowledged(message.body, self.clock_ms())
        elif message.kind == "force_start":
            self.reply(envelope, messages.reply(message.request_id, self.force_start()))
        elif message.kind == "membership_change":
            self._membership_change(envelope, message)
        elif message.kind == "members":
            self.reply(envelope, messages.reply(message.request_id, self.membership()))
        elif message.kind == "stop":
            self.reply(envelope, messages.reply(message.request_id, self.stop_request(principal)))
        elif message.kind in BACKUP_KINDS:
            self.reply(envelope, self.backup_request(message, self._backup_not_ready))
        elif message.kind in WRITE_KINDS:
            self.refuse_if_disk_full()
            self._write(envelope, message)
        else:
            self.refuse_held_again(envelope, message)
            self._dispatch_read(envelope, message)

    def _dispatch_read(self, envelope: list[bytes], message: Message) -> None:
        """A query, a changefeed page or a read (its id not held on its connection already)."""
        if message.kind in QUERY_KINDS:
            self._query(envelope, message)
        elif message.kind == "changes":
            self.changes_request(envelope, message, self._check_serving, read_batch)
        elif message.kind == "read_index" or getattr(message.body, "consistency", None) == "linearizable":
            self._linearizable(envelope, message)
        elif message.kind in READ_KINDS:
            try:
                result = self._read(envelope, message)
            except (RequestError, SchemaError, OverloadedError):
                raise
            except Exception as error:  # a read must never take the node down; say what failed
                if read_fault(error) is not None:
                    # A malformed image or an I/O error is the disk's, not the read's: the turn stops
                    # the node as for any failed disk (``NodeServer.turn``), as a query's read does.
                    raise
                log.exception("read %s failed", message.kind)
                raise RequestError("internal", f"{message.kind} failed: {type(error).__name__}: {error}") from None
            if result is not HELD:
                self.reply(envelope, messages.reply(message.request_id, result))
        else:
            raise RequestError("bad_request", f"{message.kind} is a reply kind")

    # -- effects -----------------------------------------------------------------------------

    def _step(self, driver: ShardDriver, event: Any) -> list[Any]:
        if driver.held:
            self._propose_batch(driver)  # the writes that arrived before this event go first
        if driver.shard in self.stopped:
            return []
        try:
            effects = driver.consensus.step(event, self.clock_ms())
        except ConsensusInvariantError as error:
            # Raised before any effect of this step ran (a peer's append would replace a committed
            # entry, or a broken peer): the machine is not trusted again (driver contract 5).
            self._stop_shard(driver, str(error))
            return []
        for effect in effects:
            self._execute(driver, effect)
        if driver.consensus.stuck_reason != driver.stuck_logged:
            self._log_stuck(driver)
            # The agents' pushes say whether this core follows the sequencer: tell them now, since
            # a stuck shard's commits, which carry it otherwise, stop.
            consensus = driver.consensus
            self.agent_server.committed(
                driver.shard, consensus.committed_key, self._hears_sequencer(driver), self.clock_ms()
            )
        return effects

    def _stop_shard(self, driver: ShardDriver, reason: str) -> None:
        """Stop serving ``driver``'s shard on this core until a restart, loudly (core.consensus, driver
        contract 5), and tell whoever waits on it: a write waiting for its entry (it may commit through
        the other cores) and a request forwarded for it (to the sequencer) hear ``outcome_unknown`` (a
        read ``no_sequencer``), a held failed guard to retry, a membership change ``outcome_unknown``;
        its agents stop (their replicants watch another core). The node serves its other shards."""
        shard = driver.shard
        self.stopped[shard] = reason
        log.error(
            "shard %s: STOPPED on this core: %s. It serves nothing here until a restart; if it stops again, "
            "rebuild this core from a member's data directory (docs: Force start)",
            shard,
            reason,
        )
        self._tell_outcomes(driver.waiters.abandoned(f"shard {shard} stopped on {self.config.name}"))
        self._abandon_held_guard_failures(driver, f"shard {shard} stopped on {self.config.name}")
        self._tell_outcomes(self.forwarded.sequencer_changed(shard, None))
        self._abandon_pending_changes(shard, f"shard {shard} stopped on {self.config.name}")
        self.agent_server.stop_shard(shard)

    def _abandon_pending_changes(self, shard: str, reason: str) -> None:
        """Tell each membership change of ``shard`` not yet in the log ``outcome_unknown`` and forget it:
        its machine no longer tracks it (a stopped shard, one rebuilt after a full disk), so nothing
        would ever answer it, and a retry with its request id would be taken for it (``StillPending``)."""
        for request_id, (pending_shard, envelope) in list(self.pending_changes.items()):
            if pending_shard == shard:
                del self.pending_changes[request_id]
                self.reply(envelope, _outcome_unknown(request_id, reason))

    def _log_stuck(self, driver: ShardDriver) -> None:
        """Once when the shard's consensus cannot go on past an entry (``stuck_reason``), once when it can."""
        reason = driver.consensus.stuck_reason
        driver.stuck_logged = reason
        if reason is not None:
            log.error("shard %s: %s; serving no read of the shard until then", driver.shard, reason)
        else:
            log.warning("shard %s: the log moved past the refused entry; serving reads again", driver.shard)

    def _not_serving_reason(self, shard: str) -> str | None:
        """Why this core serves no read of ``shard`` now (None: it serves): ``core.rules.not_serving_reason``
        over its install's words (``not_serving``), ``rows_lost``, its consensus's ``stuck_reason``, the
        forced start that left it out (``excluded``) and its applied key."""
        driver = self.shards.get(shard)
        stuck_reason = driver.consensus.stuck_reason if driver is not None else None
        stuck_reason = self.stopped.get(shard, stuck_reason)
        excluded_generation = driver.consensus.excluded_generation if driver is not None else None
        # The applied key is said only with a stuck log or an exclusion: no store read on the common path
        # (every read asks).
        said_at = stuck_reason is not None or excluded_generation is not None
        position = self.store.shard(shard) if said_at else None
        applied = position.applied if position is not None else None
        install_reason = self.not_serving.get(shard)
        install = self.installs.get(shard)
        if install_reason is not None and install is not None:
            # Under way or fenced: which snapshot, how far, and why its fence key is not known yet.
            install_reason = install.not_serving_reason() or install_reason
        return rules.not_serving_reason(
            install_reason, shard in self.rows_lost, stuck_reason, applied, excluded_generation
        )

    def _execute(self, driver: ShardDriver, effect: Any) -> None:
        shard = driver.shard
        if type(effect) is ProposalCommitted:  # one per write, tested first
            return  # answered through the waiters when the Commit effect is executed
        if driver.apply.up_to is not None and type(effect) not in rules.GATHER_THROUGH:
            self._apply_gathered(driver)  # a role change, a truncation, an install: on the applied state
        if isinstance(effect, PersistState):
            self.begin()
            state = effect.state
            self.store.persist_consensus_state(shard, state.generation, state.voted_for, state.members, state.forced)
            self.store.persist_excluded_generation(shard, state.excluded_generation)
            if state.generation > driver.generation:
                driver.generation = state.generation
                driver.elections += 1
        elif isinstance(effect, PersistEntries):
            self.begin()
            self.store.append_entries(effect.entries, int(time.time() * 1000), chain_verified=True)
            driver.tail.add(effect.entries)
            if driver.consensus.role is Role.SEQUENCER:  # only a sequencer sends entries
                driver.log_view.recent.add(effect.entries)
            self._note_membership_entries(driver, effect.entries)
        elif isinstance(effect, TruncateLog):
            self.begin()
            removed = self.store.truncate_after(shard, effect.after_key)
            driver.log_view.recent.truncated(effect.after_key)
            log.warning("shard %s: truncated %d uncommitted entries after %s", shard, removed, effect.after_key)
            for held in driver.tail.truncated(effect.after_key, self.store.catalog()):
                self._answer_guard_failure(held, answer=False, reason="the entries it observed were replaced")
            self._tell_outcomes(driver.waiters.truncated(effect.after_key))
        elif isinstance(effect, Commit):
            # Writes are told as their entries commit, before the apply (which follows in this same
            # step, so no read served here misses them): about 40 us sooner at 1 client (rules.commit_heard).
            following = driver.consensus.role is Role.FOLLOWER and driver.shard not in self.not_serving
            _, told, up_to = rules.commit_heard(
                driver.apply,
                driver.waiters,
                driver.tail.keys,
                driver.tail.entries,
                effect.up_to,
                following,
                lambda: self._applied_waited_on(driver),
                self.clock_ms(),
            )
            self._tell_outcomes(told, driver.shard)
            if up_to is not None:
                self._apply_up_to(driver, up_to)
            self.agent_server.committed(shard, effect.up_to, self._hears_sequencer(driver), self.clock_ms())
        elif isinstance(effect, Send):
            frame_body = {"shard": shard, "sender": self.config.name, "message": message_to_wire(effect.message)}
            self._send_peer(effect.to, Message("peer", "peer", frame_body), now=effect.before_persisted)
        elif isinstance(effect, ProposalFailed):
            self._tell_outcomes(driver.waiters.failed(effect.tx_key, effect.reason))
        elif isinstance(effect, ProposalRejected):
            # A write's rejection is handled by the caller of Proposed, which still holds the envelope;
            # a membership change may be refused later (its learner never caught up).
            pending = self.pending_changes.pop(effect.request_id or "", None)
            if pending is not None:
                self._answer_refused_change(driver, pending[1], effect)
        elif isinstance(effect, RoleChanged):
            # Requests forwarded to a sequencer we no longer follow would wait for FORWARD_TIMEOUT_MS
            # (it may be dead): tell their clients now, so that they retry with the same request id.
            self._tell_outcomes(self.forwarded.sequencer_changed(shard, effect.sequencer))
            # A new sequencer checks the cluster version in this turn, not at the next probe round.
            self._versions_check_due = self._versions_check_due or effect.role is Role.SEQUENCER
            position = self.store.shard(shard)
            if position is not None:
                self.agent_server.committed(shard, position.applied, effect.sequencer is not None, self.clock_ms())
            log.info(
                "shard %s: %s in generation %d (sequencer %s)",
                shard,
                effect.role.value,
                effect.generation,
                effect.sequencer,
            )
        elif isinstance(effect, ForceStarted):
            log.warning(
                "shard %s: FORCE-STARTED generation %d with members %s at %s (committed %s)",
                shard,
                effect.generation,
                ", ".join(effect.members),
                effect.last_key,
                effect.committed_key,
            )
        elif isinstance(effect, SnapshotNeeded):
            # The follower rebuilds itself from this core (core.snapshot): offer it our applied key,
            # only while it answers (offers queued for a core that is down would all arrive stale).
            position = self.store.shard(shard)
            recently = offer_due(
                self.last_heard_ms.get(effect.follower),
                self.clock_ms(),
                self.consensus_config.election_timeout_ms_min,
            )
            if position is not None and effect.follower in self.endpoints and recently:
                if effect.requested:
                    log.info(
                        "shard %s: follower %s asked for a snapshot (an install of its was abandoned): offering "
                        "one at %s",
                        shard,
                        effect.follower,
                        position.applied,
                    )
                else:
                    log.info(
                        "shard %s: follower %s needs entries after %s, older than this rlog retains (%s): "
                        "offering a snapshot at %s",
                        shard,
                        effect.follower,
                        effect.follower_key,
                        effect.trimmed_key,
                        position.applied,
                    )
                body = {
                    "shard": shard,
                    "sender": self.config.name,
                    "generation": driver.consensus.generation,
                    "key": list(position.applied),
                    "digest": position.digest,
                    "members": list(driver.consensus.committed_members),
                }
                # Only above 1: a field a follower of release 0.1.0 would refuse is never sent to one.
                if self.store.cluster_version(shard) > 1:
                    body["cluster_version"] = self.store.cluster_version(shard)
                # Only when forced, and only to a follower that reads the field (never to 0.1.0).
                follower_versions = self.peer_versions.announcement(effect.follower)
                if driver.consensus.status().forced and reads_forced_offer(follower_versions):
                    body["forced"] = True
                self._send_peer(effect.follower, Message("snapshot_offer", "snapshot", body))
        elif isinstance(effect, ForceStartRefused):
            log.warning("shard %s: force start refused: %s", shard, effect.reason)
        elif isinstance(effect, Excluded):
            self._record_exclusion(shard, effect)
        elif isinstance(effect, ProtocolViolation):
            self.protocol_violation(effect.sender, f"shard {shard}: {effect.reason}")
        else:
            raise TypeError(f"unknown effect {effect!r}")

    def before_send(self) -> None:
        # Agent pushes carry committed entries only: queue them once the turn's commit is done.
        limits = self.config.limits
        peers = set(self.endpoints.values())
        for endpoint in self.agent_server.endpoints_to_reset():
            # An agent ended and no live one uses its endpoint: what zmq still queues there
            # is dropped with the socket (core.agent_server's _forget); a new agent's pushes below
            # open a new one.
            if endpoint not in peers:
                self.close_dealer(endpoint)
        for refused in self.agent_server.take_entry_refusals():
            # Its replicant's next watch is refused too_large and that is logged; the stop is said here,
            # once per agent (throttled: a replicant watches again by its failover rule).
            self.warnings.log(
                "agent stopped: too_large",
                logging.WARNING,
                "shard %s: agent %s stopped pushing to replicant %s after %s: %s",
                refused.shard,
                refused.agent,
                refused.replicant,
                tuple(refused.sent),
                refused.refusal,
                logger=log,
            )
        for endpoint, message in self.agent_server.drain():
            # Not IMMEDIATE: the first pushes of a new agent go out while the connection (and its
            # CurveZMQ handshake) is still being made; dropping them made every new agent's stream
            # start with a gap, and the replica resynchronised forever. A dead endpoint holds at most
            # push_queue_max frames, and only until its agent stops for want of acknowledgements
            # (its socket is then closed with LINGER 0).
            replicant_socket = self.dealer(
                endpoint, limits.push_queue_max, len(self.endpoints) + limits.watches_max, monitored=False
            )
            if replicant_socket is not None:
                self.queue(replicant_socket, message)
        # Close the sockets of endpoints no agent pushes to any more (stopped, superseded, evicted),
        # except those a frame of this turn is still queued for: they close at a later turn.
        in_use = self.agent_server.endpoints()
        queued = {id(socket) for socket, _, _ in self._outbox if socket is not None}
        for endpoint, socket in list(self.dealers.items()):
            if endpoint not in in_use and endpoint not in peers and id(socket) not in queued:
                self.close_dealer(endpoint)

    def _linearizable(self, envelope: list[bytes], message: Message) -> None:
        """Answer at the sequencer when ``ShardConsensus.read_index`` allows it; elsewhere forward to it
        (the rule: ``core.rules.fence_read``; the lease rule lives in the consensus machine)."""
        shard = message.body.shard if message.kind == "read_index" else self._table(message.body.table).shard
        driver = self.shards.get(shard)
        if driver is None:
            raise RequestError("unknown_shard", f"unknown shard {shard!r}")
        read_index = driver.consensus.read_index(self.clock_ms())
        fence = rules.fence_read(self._view(driver), self.config.name, message.body.forwarded, read_index)
        if isinstance(fence, rules.Forward):
            self._forward(envelope, message, shard, fence.target)
            return
        if rules.read_index_feeds_lazy_followers(message.kind, message.body.forwarded):
            self._step(driver, FeedRequested())
        if message.kind != "read_index" and shard in self.store.name_waits:
            # The applied state stops before a waiting entry (Store.name_waits): the read must reflect
            # the read index; the client retries (bounded by its timeout) until the wait ends.
            rules.check_applied(self.config.name, fence, self._shard(shard).applied)
        result: Any = {"committed": list(fence)} if message.kind == "read_index" else self._read(envelope, message)
        if result is not HELD:
            self.reply(envelope, messages.reply(message.request_id, result))

    def _backup_not_ready(self) -> str | None:
        """Why a backup taken now would not hold a committed state of every shard (None: it would)."""
        if self.not_serving:
            shard, reason = next(iter(sorted(self.not_serving.items())))
            return f"shard {shard}: {reason}"
        return None

    def _applied_waited_on(self, driver: ShardDriver) -> bool:
        """Whether anything here waits for this core's applied state of ``driver``'s shard: a client's
        write or a held guard, a query (rlog.query) or a changefeed request (rlog.changes)."""
        return rules.applied_waited_on(
            len(driver.waiters), driver.tail.held_count(), len(self.waiting_queries), len(self.waiting_changes)
        )

    def _apply_gathered(self, driver: ShardDriver) -> None:
        """Apply now whatever commits ``driver``'s shard gathered (a reader waits, or the state must be current)."""
        up_to = driver.apply.take()
        if up_to is not None:
            self._apply_up_to(driver, up_to)

    def _apply_due(self) -> None:
        """Once a turn, after its input: apply the gathered commits whose time has come or that someone waits for."""
        for driver in self.shards.values():
            if driver.apply.up_to is not None:
                up_to = driver.apply.due(self.clock_ms(), self._applied_waited_on(driver))
                if up_to is not None:
                    self._apply_up_to(driver, up_to)
        if self.store.name_waits:
            self._apply_name_waits()  # a catalog changed otherwise than by an apply (a snapshot's copy)

    def _apply_up_to(self, driver: ShardDriver, up_to: TxKey) -> None:
        shard = driver.shard
        if not self.store.name_wait_may_end(shard, up_to, driver.tail.entries):
            # It waits at a name another shard holds still, and no new commit may end the name's
            # lifetime in this shard (Store.name_wait_may_end).
            return
        # Applying needs no fsync of its own: the entries are durable in the log already, and a
        # restart applies again whatever a power failure took (the applied key moves with the rows).
        self.begin(durable=False)
        # A shard not serving yet is catching up over a snapshot's dirty copy: healing (Store.apply_ops).
        healing = shard in self.not_serving
        applied = self.store.apply_committed(shard, up_to, driver.tail.entries, healing=healing)
        if shard in self.store.name_waits:
            # Applied only up to the entry before the one that waits: the tail keeps it and what follows.
            self._warn_name_wait(shard)
            reached = applied[-1].tx_key if applied else None
        else:
            reached = up_to
        read_index = driver.consensus.read_index(self.clock_ms())
        released = driver.tail.committed(reached, self.store.catalog(), read_index) if reached is not None else []
        for held, verdict in released:
            self._answer_guard_failure(held, verdict == GUARD_ANSWER, "no majority lease when it could be told")
        if (refill_after := driver.tail.refill_after()) is not None:
            # Entries past the tail's bound (core.guard_tail): read back from the log as room is made.
            room = driver.tail.entries_max - len(driver.tail.entries)
            driver.tail.refilled(self.store.entries_after(shard, refill_after, room), self.store.last_entry(shard)[0])
        self.transactions += len(applied)
        for entry in applied:
            if ROW_OPS.issuperset(map(type, entry.ops)):
                continue  # the common entry: rows only, no membership or cluster version
            applied_members = membership_of(entry)
            if applied_members is not None:
                self._set_cluster_members(applied_members)
            if cluster_version_of(entry) is not None:
                self._cluster_version_applied(shard)
        self._tell_outcomes(driver.waiters.committed(applied), driver.shard)
        if self.store.name_waits and not self._retrying_name_waits:
            self._apply_name_waits()

    def _apply_name_waits(self) -> None:
        """Apply again, up to their committed key, the shards whose apply waited at a name another shard
        held, once an apply let the name go (``Store.name_waits_due``): a drop of shard A applied
        lets shard B's create of the name follow in the same turn. Each try applies or records its wait
        at the current catalog, so the loop ends; waits follow commit order (``name_held_elsewhere``)."""
        self._retrying_name_waits = True
        try:
            while due := [shard for shard in self.store.name_waits_due() if shard in self.shards]:
                for shard in due:
                    driver = self.shards[shard]
                    driver.apply.take()  # what it gathered is applied too: up to the committed key
                    self._apply_up_to(driver, driver.consensus.committed_key)
        finally:
            self._retrying_name_waits = False

    def _warn_name_wait(self, shard: str) -> None:
        wait = self.store.name_waits.get(shard)
        if wait is not None:
            self.warnings.log(f"name wait {shard}", logging.WARNING, "%s", wait.describe(), logger=log)

    def _hears_sequencer(self, driver: ShardDriver) -> bool:
        """What this core's journal and agents tell replicants: the consensus's rule
        (``ShardConsensus.follows_sequencer``, which the simulator runs too); never for a stopped shard."""
        return driver.consensus.follows_sequencer and driver.shard not in self.stopped

    def _watch(self, body: messages.Watch) -> dict[str, Any]:
        driver = self.shards.get(body.shard)
        if driver is not None:
            self._apply_gathered(driver)  # K0 is the applied key: the replica starts from the newest one
        position = self.store.shard(body.shard)
        if driver is None or position is None:
            raise RequestError("unknown_shard", f"unknown shard {body.shard!r}")
        if body.shard in self.stopped:
            self._check_serving(body.shard)  # its reason, as a read hears it
        try:
            return self.agent_server.watch(
                body,
                AgentStoreLogView(driver.log_view),
                position.applied,
                position.digest,
                lambda key: self.store.digest_at(driver.shard, key),
                self._hears_sequencer(driver),
                self.clock_ms(),
                self.store.cluster_version(driver.shard),
                self.endpoints,
            )
        except WatchRefusedError as error:
            if error.code == "too_large":
                # The replicant logs it too, but the core's operator must see which replicant cannot
                # read which entry (a replicant watches again by its failover rule: throttled).
                self.warnings.log(
                    "watch refused: too_large",
                    logging.WARNING,
                    "shard %s: refused replicant %s's watch (agent %s stopped before its first push): %s",
                    body.shard,
                    body.replicant,
                    error.agent,
                    error,
                    logger=log,
                )
            raise RequestError(error.code, str(error)) from None

    # -- snapshot install (core.snapshot) -------------------------------------------------------

    def _installed_shards(self) -> set[str]:
        """Shards whose install copied everything (their consensus runs again; reads wait for the fence)."""
        return {shard for shard, install in self.installs.items() if install.mode is InstallMode.FENCED}

    def shards_not_serving_changes(self, followed: Collection[str]) -> Collection[str]:
        """Of ``followed``, the shards this core serves no read of now (``_not_serving_reason``; a ``changes`` request
        on one is refused ``not_ready``): a snapshot install's, from ``BeginInstall`` (their rows
        deleted) until the read fence, across a restart; rows an abandoned install left half copied
        (``rows_lost``); a log stuck at an entry it refused (``stuck_reason``); a shard stopped here
        until a restart (``stopped``); a forced start left this core out of it (``excluded``). A
        changefeed request held on one is answered at once with what a request asked then gets."""
        # The one rule that refuses new requests, so that a held one is never told otherwise.
        return {shard for shard in followed if self._not_serving_reason(shard) is not None}

    def _check_serving(self, shard: str) -> None:
        reason = self._not_serving_reason(shard)
        if reason is not None:
            raise RequestError("not_ready", f"{self.config.name} cannot serve shard {shard} yet: {reason}")

    def _on_snapshot_offer(self, body: messages.SnapshotOffer) -> None:
        shard = body.shard
        driver = self.shards.get(shard)
        position = self.store.shard(shard)
        if driver is None or position is None or body.sender not in self.endpoints or shard in self.stopped:
            return
        if self._shut_out(body.sender):
            return
        if driver.apply.up_to is not None:
            # The offer is judged against (and an install replaces) the applied state: what this core
            # gathered first, so that nothing gathered is left to apply over the copied tables.
            self._apply_gathered(driver)
            position = self.store.shard(shard) or position
        offer = SnapshotOffer(
            body.sender, body.generation, body.key, body.digest, tuple(body.members), body.cluster_version, body.forced
        )
        install = self.installs.get(shard)
        installing = install is not None and install.mode in (InstallMode.LISTING, InstallMode.COPYING)
        refused = accept_offer(
            offer,
            driver.consensus.generation,
            driver.consensus.sequencer,
            position.applied,
            installing,
            self.versions,
            rows_lost=shard in self.rows_lost,
        )
        if refused is not None and refused.startswith(UNSPOKEN_CLUSTER_VERSION):
            self.protocol_violation(body.sender, f"shard {shard}: snapshot offer at {offer.key}: {refused}")
            return
        if refused is not None:
            log.debug("shard %s: snapshot offer refused: %s", shard, refused)
            return
        if shard in self.rows_lost:
            log.warning(
                "shard %s: its rows are half copied by an abandoned install; installing a snapshot at %s from %s",
                shard,
                offer.key,
                offer.sequencer,
            )
        else:
            log.warning(
                "shard %s: the peers trimmed the entries after %s; installing a snapshot at %s from %s",
                shard,
                position.applied,
                offer.key,
                offer.sequencer,
            )
        install = SnapshotInstall(offer, INSTALL_BATCH_ROWS_MAX, INSTALL_REQUEST_TIMEOUT_MS, self.clock_ms())
        self.installs[shard] = install
        self._execute_install(shard, install.start())

    def _on_snapshot_request(self, body: messages.SnapshotRequest) -> None:
        """A follower whose rows an abandoned install deleted asks for an offer: the sequencer's
        consensus decides (``SnapshotRequested``: only the sequencer, only to a core it replicates to)."""
        driver = self.shards.get(body.shard)
        if driver is None or body.sender not in self.endpoints or body.sender == self.config.name:
            return
        if self._shut_out(body.sender):
            return
        self._step(driver, SnapshotRequested(body.sender))

    def _shut_out(self, sender: str) -> bool:
        """Whether a peer's consensus message or snapshot offer or request is dropped unread (counted): the
        peer is refused (core.versions: a cluster version it does not share, or another cluster's id), or
        this core names a cluster id and has not heard the peer's yet (it may be another cluster's)."""
        if not self.peer_versions.refuses(sender) and not self.peer_versions.holds(sender):
            return False
        self.peer_frames_refused += 1  # refused with one log line when its versions were heard
        return True

    def _ask_for_snapshots(self) -> None:
        """Each shard whose rows an abandoned install deleted asks its sequencer for an offer, now and
        then (``core.snapshot.snapshot_request_due``): the sequencer's own rule offers one only while it
        has trimmed past this core's position, which it may never be (core.snapshot, "Re-offer")."""
        now = self.clock_ms()
        for shard in sorted(self.rows_lost):
            driver = self.shards.get(shard)
            if driver is None:
                continue
            sequencer = driver.consensus.sequencer
            asked_ms = self.snapshot_asked_ms.get(shard)
            if not snapshot_request_due(True, shard in self.installs, sequencer, self.config.name, asked_ms, now):
                continue
            self.snapshot_asked_ms[shard] = now
            if sequencer is not None and reads_snapshot_request(self.peer_versions.announcement(sequencer)):
                body = {"shard": shard, "sender": self.config.name}
                self._send_peer(sequencer, Message("snapshot_request", "snapshot", body))

    def _step_install(self, shard: str, event: Any) -> None:
        install = self.installs.get(shard)
        if install is not None and shard in self.shards:
            self._apply_gathered(self.shards[shard])
        position = self.store.shard(shard)
        if install is None or position is None:
            return
        self._execute_install(shard, install.step(event, position.applied, self.clock_ms()))
        if install.mode in (InstallMode.DONE, InstallMode.ABANDONED):
            # Not there any more when a step of the same install ended it first: a core that is the
            # sequencer answers its own fence question (``FetchCommitted``) inside the step that asked.
            if self.installs.get(shard) is install:
                del self.installs[shard]
        else:
            self._log_install_progress(shard, install)

    def _log_install_progress(self, shard: str, install: SnapshotInstall) -> None:
        """At most every PROGRESS_LOG_INTERVAL_MS while a snapshot is copied: rows, total, rate and ETA."""
        now = self.clock_ms()
        if not install.copy.rows or now < self._next_progress_log_ms.get(shard, 0):
            return
        self._next_progress_log_ms[shard] = now + PROGRESS_LOG_INTERVAL_MS
        rate, eta_ms = install.copy.progress(now)
        log.info(
            "shard %s: snapshot install copied %d of about %d rows, %.0f rows/s, ETA %s",
            shard,
            install.copy.rows,
            install.copy.rows_expected,
            rate,
            f"{eta_ms / 1000:.0f} s" if eta_ms is not None else "unknown",
        )

    def _install_request(self, shard: str, core: str, kind: str, body: dict[str, Any], detail: dict[str, Any]) -> None:
        request_id = f"install-{self.rng.getrandbits(64):016x}"
        purpose = {"list_tables": "tables", "bootstrap_batch": "batch", "read_index": "fence"}[kind]
        deadline_ms = self.clock_ms() + INSTALL_REQUEST_TIMEOUT_MS
        self.install_requests[request_id] = (shard, purpose, detail, deadline_ms, self.installs.get(shard))
        self._send_peer(core, Message(kind, request_id, body))

    def _execute_install(self, shard: str, effects: list[Any]) -> None:
        for effect in effects:
            if isinstance(effect, BeginInstall):
                self.begin()
                self.store.set_meta(f"installing:{shard}", 1)
                self.store.clear_rows(shard)
                self.rows_lost.add(shard)
                self.not_serving[shard] = f"installing a snapshot at {effect.key}"
            elif isinstance(effect, replication.FetchTables):
                self._install_request(shard, effect.core, "list_tables", {}, {})
            elif isinstance(effect, replication.FetchBatch):
                body: dict[str, Any] = {"table": effect.table, "limit": effect.limit}
                if effect.after is not None:
                    body["after"] = effect.after
                if reads_copy_sender(self.peer_versions.announcement(effect.core)):
                    body["sender"] = self.config.name  # counted by the sequencer (core.snapshot.CopiesServed)
                detail = {"table": effect.table, "after": effect.after}
                self._install_request(shard, effect.core, "bootstrap_batch", body, detail)
            elif isinstance(effect, replication.ApplyBatch):
                self.begin()
                self.store.write_rows(effect.table, effect.rows)
            elif isinstance(effect, FinishInstall):
                self.begin()
                self.store.restart_log_at(shard, effect.key, effect.digest)
                generation, voted_for, members, forced = self.store.consensus_state(shard)
                offer = self.installs[shard].offer
                members, forced = state_after_install(offer, members or self.members, forced)
                self.store.persist_consensus_state(shard, generation, voted_for, members, forced)
                excluded = self.store.excluded_generation(shard)
                self.store.persist_excluded_generation(
                    shard, exclusion_after_install(offer, self.config.name, excluded)
                )
                self.store.set_meta(f"installing:{shard}", 0)
                self.rows_lost.discard(shard)
                self.store.set_meta(f"read_fenced:{shard}", 1)
                # The copied tables are at the offer's cluster version: record it (and the storage format).
                self.store.apply_ops((ClusterVersionOp(shard, self.installs[shard].offer.cluster_version),))
                self.not_serving[shard] = "replaying after a snapshot install"
                # Agents' positions mean nothing in the new log (core.agent, driver contract 4).
                self.agent_server.stop_shard(shard)
                self._tell_outcomes(self.shards[shard].waiters.abandoned("this core installed a snapshot"))
                self._abandon_held_guard_failures(self.shards[shard], "this core installed a snapshot")
                self._open_shard(shard)
                log.warning("shard %s: snapshot installed at %s; catching up from the log", shard, effect.key)
            elif isinstance(effect, replication.FetchCommitted):
                driver = self.shards[shard]
                core = driver.consensus.sequencer or effect.core
                if core == self.config.name:
                    committed = driver.consensus.committed_key
                    self._step_install(shard, replication.CommittedReceived(core, committed, effect.question))
                else:
                    detail = {"question": effect.question, "core": core}
                    self._install_request(shard, core, "read_index", {"shard": shard}, detail)
            elif isinstance(effect, FenceReached):
                self.begin()
                self.store.set_meta(f"read_fenced:{shard}", 0)
                self.not_serving.pop(shard, None)
                log.info("shard %s: the snapshot's read fence is reached; serving reads", shard)
            elif isinstance(effect, InstallAbandoned):
                log.warning("shard %s: snapshot install abandoned: %s", shard, effect.reason)
                if shard in self.not_serving:  # the rows are half copied: say why nothing is served
                    self.not_serving[shard] = (
                        f"a snapshot install was abandoned ({effect.reason}; the shard's rows are half copied); "
                        "asking the sequencer for another offer"
                    )
            else:
                raise TypeError(f"unknown install effect {effect!r}")

    def _on_install_answer(
        self, pending: tuple[str, str, dict[str, Any], int, SnapshotInstall | None], answer: Message
    ) -> None:
        shard, purpose, detail, _, asking = pending
        install = self.installs.get(shard)
        if install is None or install is not asking:
            return  # the answer of an install abandoned since (or done): a later one did not ask it
        core = install.offer.sequencer
        error = answer.body if answer.kind == "error" else None
        result = answer.body.result if answer.kind == "reply" else None
        if purpose == "fence":
            answered = messages.answer_as(result, messages.ReadIndexAnswer) if error is None else None
            committed = answered.committed if answered is not None else None
            asked = detail.get("core", core)
            why = None
            if error is not None:
                why = f"{asked} refused read_index: {error.code}: {error.message}"
            elif committed is None:
                why = f"{asked} answered read_index with a malformed answer"
            self._step_install(shard, replication.CommittedReceived(core, committed, detail["question"], why))
        elif purpose == "tables":
            try:
                if error is not None:
                    raise CopyFailed(f"list_tables failed: {error.code}: {error.message}")
                mine = tables_from_answer(result, shard)
                ops = copy_schema_ops(self.store.catalog(), shard, mine)
            except CopyFailed as failure:
                self._step_install(shard, replication.RequestFailed(core, str(failure)))
                return
            self.begin()
            self.store.apply_ops(ops)
            names = tuple(table.name for table in mine)
            keys = tuple(table.key_column for table in mine)
            self._step_install(shard, replication.TablesReceived(core, names, keys))
        else:
            batch = batch_from_answer(core, detail["table"], detail["after"], result)
            if error is not None or batch is None:
                self._step_install(shard, replication.RequestFailed(core, f"bootstrap batch failed: {error}"))
                return
            # Checked before the install writes them, as a replicant's copy does: a row the listed
            # (STRICT) table refuses raised out of the turn, and the turn's failure stopped this core.
            table = self.store.catalog().get(detail["table"])
            refused = rows_refusal(table, batch.rows) if table is not None else None
            if refused is not None:
                self._step_install(shard, replication.RequestFailed(core, f"bootstrap batch refused: {refused}"))
                return
            self._step_install(shard, batch)

    def _peer_socket(self, peer: str, probe: bool = False) -> zmq.Socket | None:
        """The dealer to send ``peer`` a message on; None: nothing can be sent to it now (no endpoint
        known, no dealer left, or a peer this core cannot speak with, which is sent nothing but the probe)."""
        if self.peer_versions.refuses(peer) and not probe:
            return None
        endpoint = self.endpoints.get(peer)
        socket = self.dealer(endpoint, PEER_SEND_QUEUE_MAX, DEALERS_MAX) if endpoint else None
        if socket is not None and self.peer_sockets.get(id(socket)) != peer:
            # What zmq holds toward a peer is bounded in bytes too (core_queue_bytes_max): past it, a
            # forwarded write is answered no_sequencer (``frame_unsent``), a consensus message dropped.
            self.bound_sends(socket, peer)
        return socket

    def _send_peer(self, peer: str, message: Message, now: bool = False, probe: bool = False) -> None:
        socket = self._peer_socket(peer, probe)
        if socket is None:
            return
        if now:
            # A sequencer's append may precede its own fsync (the machine counts itself only at
            # Persisted): the followers' fsyncs then overlap ours instead of following it.
            self.send_now(socket, message)
        else:
            self.queue(socket, message)

    def after_commit(self) -> None:
        # The turn's commit (and fsync) is done: each sequencer may now count its own entries.
        for driver in list(self.shards.values()):
            if driver.consensus.role is Role.SEQUENCER:
                self._step(driver, Persisted())

    def _on_peer(self, message: Message) -> None:
        body = message.body
        sender, shard = body.sender, body.shard
        if sender not in self.endpoints or sender == self.config.name:
            raise RequestError("bad_request", f"peer {sender!r} is not a core of this cluster")
        if self._shut_out(sender):
            return
        try:
            peer_message = message_from_wire(body.message)
        except MessageError as error:
            self.protocol_violation(sender, f"malformed consensus message: {error}")
            return
        self.last_heard_ms[sender] = self.clock_ms()
        driver = self._shard_for(shard, create=True)
        if driver is None:
            return
        # Non-members too: the consensus machine tells a core left out by a forced start. A core
        # left out still follows appends: the forced sequencer reaches it when it is added again.
        self._step(driver, MessageReceived(sender, peer_message))
        if shard in self.excluded and not driver.consensus.excluded:
            log.warning("shard %s: added back to the cluster by %s after a forced start left it out", shard, sender)
            del self.excluded[shard]

    def _record_exclusion(self, shard: str, effect: Excluded) -> None:
        """The machine accepted that a forced start left us out: say how our journal compares."""
        verdict = rules.journal_verdict(effect.key, self.store.digest_at(shard, effect.key), effect.digest)
        self.excluded[shard] = {
            "by": effect.sender,
            "generation": effect.generation,
            "members": list(effect.members),
            "verdict": verdict,
        }
        log.error(
            "shard %s: this core was left out of the cluster by a forced start (generation %d, members %s, told by "
            "%s); %s. It no longer takes part in the shard nor serves its reads: rebuild it from a member's data "
            "directory.",
            shard,
            effect.generation,
            ", ".join(effect.members),
            effect.sender,
            verdict,
        )

    # -- writes ------------------------------------------------------------------------------

    def _view(self, driver: ShardDriver) -> rules.ShardView:
        if driver.shard in self.stopped:
            return rules.ShardView(driver.shard, False, None)  # writes and fenced reads: ``no_sequencer``
        consensus = driver.consensus
        return rules.ShardView(driver.shard, consensus.role is Role.SEQUENCER, consensus.sequencer, consensus.excluded)

    def _write(self, envelope: list[bytes], message: Message) -> None:
        """A client's write, as the rule-book (``core.rules``) routes it: a retry answered from the log,
        forwarded to the sequencer, or admitted, evaluated and proposed here."""
        if any(driver.held.holds(message.request_id) for driver in self.shards.values()):
            self._propose_all()  # a resend of a write this turn holds: answered from the log below
        earlier = self.store.find_request(message.request_id)
        admitted = None
        if earlier is None:
            # Every shard's unapplied tail over the committed catalog: built once, for admission and guards.
            catalog = self._catalog_with_tails()
            try:
                admitted = rules.admit_write(
                    message.kind, message.body, catalog, self.config.limits.transaction_ops_max
                )
            except (RequestError, SchemaError) as error:
                if error.code == "unknown_table":
                    raise self.unknown_table(str(error)) from None
                raise
        shard = earlier[0] if earlier is not None else admitted.shard
        driver = self._shard_for(shard, create=message.kind == "create_table")
        if driver is None:
            raise RequestError("unknown_table", "unknown table")
        route = rules.route_write(
            self._view(driver), self.config.name, message.body.forwarded, earlier[1] if earlier else None
        )
        if isinstance(route, rules.Forward):
            self._forward(envelope, message, driver.shard, route.target)
            return
        self.begin()
        if isinstance(route, rules.AwaitCommit):
            self._await_commit(driver, route.tx_key, envelope, message.request_id, duplicate=True)
            return
        if len(driver.waiters) + len(driver.held) >= WAITERS_MAX:
            raise RequestError("overloaded", f"{WAITERS_MAX} requests are waiting for commits; retry later")
        if driver.tail.refuses_writes():
            raise RequestError("overloaded", self._tail_full_text(driver))
        # The connection's bound (requests_outstanding_max) is checked now, while nothing is written:
        # checked once the entry is proposed (``_await_commit``), its "overloaded" (which says nothing
        # changed) went to a write that then committed. Every answer below gives the place back.
        self.hold(envelope, message.request_id)
        ops = admitted.ops
        transaction = admitted.transaction
        if rules.holds_write(transaction):
            # Nothing to read: proposed with the turn's other such writes (``_propose_batch``).
            driver.held.hold(Proposed(transaction.ops, message.request_id), (envelope, message))
            return
        if driver.held:
            self._propose_batch(driver)  # a guard reads what the writes before it in this turn wrote
        if transaction is not None:
            if driver.tail.held_count() and self._resent_held_failure(driver, envelope, message.request_id):
                raise Deferred()  # a guarded write sent again: its held failure answers it (guard_tail rule 3)

            def read_row(table: TableSchema, key: Any) -> dict[str, Any] | None:
                def applied() -> dict[str, Any] | None:
                    # Read with the table as applied: ``table`` is as the tail leaves it, and SQLite
                    # read a column the tail adds (not there yet) as its quoted name, a string.
                    applied_table = self.store.catalog().get(table.name)
                    if applied_table is None:
                        return None  # created in the unapplied tail: no rows applied yet
                    return self.store.read_row(applied_table, key)

                return driver.tail.read(table.name, key, applied)

            outcome = evaluate(transaction, catalog, read_row)
            if isinstance(outcome, GuardFailed):
                # A failed guard is a read: told only from committed state (core.guard_tail).
                held = HeldFailure(envelope, message.request_id, outcome)
                now = self.clock_ms()
                consensus = driver.consensus
                verdict = driver.tail.failed(held, consensus.committed_key, consensus.read_index(now), now)
                if verdict == GUARD_HELD:
                    raise Deferred()
                self._answer_guard_failure(held, verdict == GUARD_ANSWER, "no majority lease")
                return
            ops = outcome
        # A guarded write or a schema change: proposed now, so that what follows in this turn (a
        # guard, an admission) sees it in the tail.
        driver.held.hold(Proposed(ops, message.request_id), (envelope, message))
        self._propose_batch(driver)

    def _tail_full_text(self, driver: ShardDriver) -> str:
        """Why a write to a shard whose unapplied tail is at its bound is refused (core.guard_tail)."""
        tail = driver.tail
        wait = self.store.name_waits.get(driver.shard)
        why = f"its apply waits: {wait.describe()}" if wait is not None else "its committed entries are not applied yet"
        return (
            f"shard {driver.shard} has {len(tail.entries)} entries ({tail.bytes} bytes) or more unapplied here, "
            f"at the bound of {tail.entries_max} entries and {tail.bytes_max} bytes ({why}); "
            "nothing was written, retry later"
        )

    def _propose_all(self) -> None:
        for driver in list(self.shards.values()):
            if driver.held:
                self._propose_batch(driver)

    def _propose_batch(self, driver: ShardDriver) -> None:
        """Propose the writes ``_write`` held in this turn, in arrival order, in one step; each
        client then waits for its entry (or hears why it was refused, or is forwarded)."""
        batch, held = driver.held.take(self.store.cluster_version(driver.shard))
        try:
            self.begin()
            effects = self._step(driver, batch)
        except BaseException:
            # The turn fails (a full disk rolls it back, ``disk_filled``; anything else stops the node):
            # these writes are in no hold and no waiter any more, and nothing else would answer them.
            for request_id, (envelope, _) in held:
                self.reply(envelope, _outcome_unknown(request_id, "the turn that proposed it failed"))
            raise
        keys, refused = rules.batch_outcomes(effects)
        for request_id, (envelope, message) in held:
            try:
                key = keys.get(request_id)
                if key is not None:
                    self._await_commit(driver, key, envelope, request_id, duplicate=False)
                    continue
                rejected = refused.get(request_id)
                if rejected is None:
                    raise RequestError("internal", "the proposal produced no entry")
                if rejected.reason == REJECT_NOT_SEQUENCER:
                    route = rules.route_write(self._view(driver), self.config.name, message.body.forwarded, None)
                    if isinstance(route, rules.Forward):
                        self._forward(envelope, message, driver.shard, route.target)
                        continue
                if rejected.reason == REJECT_TOO_LARGE:
                    raise RequestError(REJECT_TOO_LARGE, self._too_large_entry())
                raise RequestError(rejected.reason, f"the sequencer refused the transaction: {rejected.reason}")
            except (RequestError, OverloadedError) as error:  # answered here: outside _serve_waiting's dispatch
                self.refuse(envelope, request_id, error)

    def _too_large_entry(self) -> str:
        return (
            f"the transaction's log entry would be over {self.consensus_config.entry_bytes_max} bytes, more than "
            f"an append to the other cores carries within frame_bytes_max {self.config.limits.frame_bytes_max}; "
            "write it in smaller transactions"
        )

    def _answer_guard_failure(self, held: HeldFailure, answer: bool, reason: str) -> None:
        code, text, detail = rules.guard_failure_answer(held.failure, answer, reason)
        self.reply(held.envelope, messages.error(held.request_id, code, text, detail))

    def _resent_held_failure(self, driver: ShardDriver, envelope: list[bytes], request_id: str) -> bool:
        """Whether ``request_id`` is a failed guard ``driver``'s tail holds (``core.guard_tail``, rule
        3): the resend takes its place, and an earlier request on another connection is told now, or
        its connection's place (``hold``) would wait for an answer that goes to the resend."""
        earlier = driver.tail.resent(
            lambda held: held.request_id == request_id, lambda held: replace(held, envelope=envelope)
        )
        if earlier is None:
            return False
        if earlier.envelope != envelope:
            self.reply(earlier.envelope, _outcome_unknown(request_id, REASON_SENT_AGAIN))
        return True

    def _abandon_held_guard_failures(self, driver: ShardDriver, reason: str) -> None:
        """The shard's tail is about to be rebuilt (``_open_shard``): its held failed guards are told
        to retry now; the new tail knows nothing of them, and they were never answered."""
        for held in driver.tail.abandoned():
            self._answer_guard_failure(held, answer=False, reason=reason)

    def _expire_held_guard_failures(self) -> None:
        now = self.clock_ms()
        for driver in self.shards.values():
            for held in driver.tail.expired(now):
                self._answer_guard_failure(held, answer=False, reason="the entries it observed did not commit in time")

    def _await_commit(
        self, driver: ShardDriver, tx_key: TxKey, envelope: list[bytes], request_id: str, duplicate: bool
    ) -> None:
        applied_key = ZERO_KEY  # an entry just proposed is not applied before its commit
        if duplicate:
            position = self.store.shard(driver.shard)
            applied_key = position.applied if position is not None else ZERO_KEY
        answer = driver.waiters.answer_now(tx_key, request_id, applied_key, duplicate)
        if answer is not None:
            self._tell_outcomes([(envelope, answer)], driver.shard)
            return
        if duplicate and len(driver.waiters) + len(driver.held) >= WAITERS_MAX:
            # Its entry is in the log and may commit: "overloaded" would say it changed nothing.
            self.reply(envelope, _outcome_unknown(request_id, f"{WAITERS_MAX} requests are waiting for commits"))
            return
        try:
            self.hold(envelope, request_id)  # taken at admission for a new write (``_write``)
        except OverloadedError:
            # Its entry is in the log and may commit: "overloaded" would say it changed nothing.
            self.reply(envelope, _outcome_unknown(request_id, "too many requests of this connection wait"))
            return
        driver.waiters.wait(tx_key, request_id, envelope, duplicate)  # False: its resends are answered already

    def _tell_outcomes(self, outcomes: list[tuple[Any, Outcome]], shard: str | None = None) -> None:
        """``shard``: the shard whose writes these are; an acknowledged write's answer names it, so that
        a client's read-your-writes waits for its last key in the shard it reads (``read_targets``)."""
        for envelope, outcome in outcomes:
            if isinstance(envelope, QueryIndexAsk):
                # A query's read index: a read changes nothing, so its outcome is never unknown (and a
                # client told outcome_unknown keeps to this node, as for a write it may not re-send).
                reason = outcome.reason if isinstance(outcome, OutcomeUnknown) else "the sequencer did not answer"
                self._query_index_failed(envelope.gather, "no_sequencer", reason)
            elif isinstance(envelope, ForwardedRead):
                reason = outcome.reason if isinstance(outcome, OutcomeUnknown) else "the sequencer did not answer"
                self.reply(envelope.envelope, messages.error(envelope.request_id, "no_sequencer", reason))
            elif isinstance(outcome, Acknowledged):
                result: dict[str, Any] = {"tx_key": list(outcome.tx_key)}
                if shard is not None:
                    result["shard"] = shard
                if outcome.duplicate:
                    result["duplicate"] = True
                # At once, not behind the turn's commit: the entry is committed, durable on a majority
                # in earlier turns; this turn's commit only makes the apply durable, which a restart
                # redoes (measured: 80-100 us off a 1-client write's path, benchmarks/PROFILE.md).
                self.reply(envelope, messages.reply(outcome.request_id, result), now=True)
            else:
                self.reply(envelope, _outcome_unknown(outcome.request_id, outcome.reason))

    def _catalog_with_tails(self) -> dict[str, TableSchema]:
        """The catalog once every shard's unapplied tail is applied (tables created and dropped there)."""
        catalog = self.store.catalog()
        for driver in self.shards.values():
            catalog = driver.tail.catalog_over(catalog)
        return catalog

    def _forward(self, envelope: list[bytes], message: Message, shard: str, target: str) -> None:
        """Send a request, marked forwarded, to the sequencer ``target`` (``core.rules`` chose it); its
        answer is relayed to the client (``_relay_forwarded``) or expires: as outcome unknown for a write,
        ``no_sequencer`` for a read (``ForwardedRead``). A write goes under the client's request id (the
        sequencer applies an id once); a read under one of its own, which only this connection's read has."""
        if self.forwarded.full():
            raise RequestError("overloaded", f"{FORWARDED_MAX} forwarded requests pending; retry later")
        socket = self._peer_socket(target)
        if socket is None:
            # No core sees it: not held for the forward's timeout to say its outcome is unknown.
            raise RequestError("no_sequencer", f"shard {shard}: {self._unsent(target)}")
        # A write's silence leaves its outcome unknown, and so does a membership change's (the
        # sequencer may be catching a core up for minutes, then commit it); a read's only says the
        # sequencer did not answer.
        changes = message.kind in WRITE_KINDS or message.kind == "membership_change"
        self.hold(envelope, message.request_id, changes)
        if changes:
            payload, request_id = envelope, message.request_id
        else:
            payload, request_id = ForwardedRead(envelope, message.request_id), new_request_id()
        replaced = self.forwarded.forwarded(request_id, payload, shard, target, self.clock_ms())
        if replaced:
            # A resend of a request still pending (core.outcome rule 4): the earlier is told now, or
            # its connection's place (``hold``) would never be given back.
            self._tell_outcomes(replaced)
            self.hold(envelope, message.request_id, changes)  # still held if that was this same connection
        forwarded = msgspec.structs.replace(message.body, forwarded=True)
        self.queue(socket, Message(message.kind, request_id, forwarded))

    def _unsent(self, peer: str) -> str:
        """Why a request for ``peer`` (the sequencer) was not sent (``_peer_socket`` gave no socket)."""
        if self.peer_versions.refuses(peer):
            why = f"this core does not speak with it ({self.peer_versions.refusal(peer)})"
        elif peer not in self.endpoints:
            why = "this core knows no endpoint of it"
        else:
            why = f"this core has no connection left to open to it ({DEALERS_MAX} peers connected)"
        return self._unreachable(peer, why)

    def _unreachable(self, peer: str, why: str, sent: str = "nothing was sent") -> str:
        """The answer's text for a request that could not reach ``peer``, its shard's sequencer."""
        return f"its sequencer {peer} cannot be reached from {self.config.name}: {why}; {sent}"

    def frame_unsent(self, message: Message, why: str) -> None:
        """A forward's frame was dropped at send (``why``: the sequencer's send queue is full): nothing
        reached the sequencer, so its client is answered now, as when it could not be sent at all
        (``_unsent``: ``no_sequencer``), not ``outcome_unknown`` at the forward's timeout
        (``core.outcome`` forwarding rule 5)."""
        if not getattr(message.body, "forwarded", False):
            return
        unsent = self.forwarded.unsent(message.request_id)
        if unsent is None:
            return
        sent = "an earlier forward of it may have reached it" if unsent.may_have_reached else "nothing was sent"
        reason = f"shard {unsent.shard}: {self._unreachable(unsent.sequencer, why, sent)}"
        if unsent.may_have_reached or isinstance(unsent.payload, (QueryIndexAsk, ForwardedRead)):
            # A read's is no_sequencer there too; a write's earlier forward may have reached it.
            self._tell_outcomes([(unsent.payload, OutcomeUnknown(message.request_id, reason))])
        else:
            self.reply(unsent.payload, messages.error(message.request_id, "no_sequencer", reason))

    def _relay_forwarded(self, socket: zmq.Socket) -> None:
        for _ in range(self.config.limits.group_commit_max):
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                answer = messages.decode(frame, self.config.limits.frame_bytes_max)
            except MessageError:
                continue
            waiting = self.forwarded.answered(answer.request_id)
            if waiting is not None:
                self._relay(waiting, answer)
            elif answer.request_id in self.install_requests:
                self._on_install_answer(self.install_requests.pop(answer.request_id), answer)
            elif answer.request_id.startswith(VERSIONS_PROBE_PREFIX):
                self._on_versions_answer(answer)

    def _relay(self, waiting: Any, answer: Message) -> None:
        """The sequencer's ``answer`` to a request this core forwarded, to whoever waits for it."""
        answer = relayed(answer)
        if isinstance(waiting, QueryIndexAsk):
            self._query_index_answered(waiting, answer)
        elif isinstance(waiting, ForwardedRead):
            self.reply(waiting.envelope, msgspec.structs.replace(answer, request_id=waiting.request_id))
        else:
            self.reply(waiting, answer)

    def _expire_forwarded(self) -> None:
        now = self.clock_ms()
        for request_id in [r for r, pending in self.install_requests.items() if pending[3] <= now]:
            shard, purpose, detail, _, asking = self.install_requests.pop(request_id)
            install = self.installs.get(shard)
            if install is None or install is not asking:
                continue  # a request of an install abandoned since: it must not fail a later one
            core = install.offer.sequencer
            if purpose == "fence":
                why = f"{detail.get('core', core)} did not answer read_index in time"
                self._step_install(shard, replication.CommittedReceived(core, None, detail["question"], why))
            else:
                self._step_install(shard, replication.RequestFailed(core, f"{purpose} timed out"))
        self._tell_outcomes(self.forwarded.expired(now))

    # -- versions (core.versions) ----------------------------------------------------------------

    def _versions_turn(self) -> None:
        """Every VERSIONS_PROBE_INTERVAL_MS: ask each peer what it speaks; as a sequencer, append the
        cluster version entry once every member speaks a newer one (core.versions decides)."""
        now = self.clock_ms()
        if now >= self._next_versions_probe_ms:
            self._next_versions_probe_ms = now + VERSIONS_PROBE_INTERVAL_MS
            # Request ids name the round and the peer's place in it (a name may be as long as a request id).
            self._versions_probes = {}
            peers = [peer for peer in sorted(self.endpoints) if peer != self.config.name][:PEERS_MAX]
            for index, peer in enumerate(peers):
                request_id = f"{VERSIONS_PROBE_PREFIX}{now}-{index}"
                self._versions_probes[request_id] = peer
                # journal: a request every release answers; refused peers are asked too (they may
                # come back on a release this core speaks).
                self._send_peer(peer, Message("journal", request_id, {}), probe=True)
        elif not self._versions_check_due:
            return
        # A new shard is checked in the turn that created it: its entry lands right after its first ones.
        self._versions_check_due = False
        for shard, driver in self.shards.items():
            status = driver.consensus.status()
            if status.role is not Role.SEQUENCER:
                continue
            if status.learner is not None:
                # A core being added that the probes found unable to read the shard's log: refused now.
                refused = member_refusal(self.peer_versions, status.learner, self.store.cluster_version(shard))
                if refused is not None:
                    log.warning("shard %s: core %s is not added: %s", shard, status.learner, refused)
                    self._step(driver, LearnerRefused(status.learner, refused))
                continue  # a change in flight: the cluster version waits for it
            target = self.cluster_version_proposals.due(
                shard,
                self.store.cluster_version(shard),
                status.members,
                status.committed_members,
                status.learner,
                self.peer_versions,
                self.config.name,
                now,
            )
            if target is not None:
                self.begin()
                request_id = f"cluster-version-{target}-{self.rng.getrandbits(32):08x}"
                self._step(driver, Proposed((ClusterVersionOp(shard, target),), request_id))
                log.info("shard %s: every member speaks cluster version %d: proposing it", shard, target)

    def _on_versions_answer(self, answer: Message) -> None:
        peer = self._versions_probes.pop(answer.request_id, None)  # a late answer of an older round is dropped
        if peer is None or peer not in self.endpoints or answer.kind != "reply":
            return
        self._versions_check_due = True  # what a member speaks may allow a proposal now
        for notice in self.peer_versions.heard(peer, answer.body.result, self.clock_ms()):
            if isinstance(notice, PeerRefused):
                log.warning("core %s refused: this core cannot speak with it: %s", peer, notice.reason)
            else:
                log.warning("core %s accepted again: it speaks %s", peer, notice.announcement.describe())

    def _cluster_version_applied(self, shard: str) -> None:
        """A cluster version entry applied: replicants that cannot read the log from here on lose their agents."""
        version = self.store.cluster_version(shard)
        log.warning("shard %s: cluster version %d (storage format %d)", shard, version, self.store.storage_format())
        self.agent_server.stop_unreadable(shard, version, self.versions)

    def _versions_status(self) -> dict[str, Any]:
        versions = [self.store.cluster_version(shard) for shard in self.shards]
        return {
            "versions": self.versions.to_wire(),
            # the lowest of the shards' (each moves through its own log); 1 before any shard
            "cluster_version": min(versions, default=1),
            "storage_format": self.store.storage_format(),
            "peer_versions": self.peer_versions.status(),
        }

    # -- membership changes (core.membership) ----------------------------------------------------

    def _membership_change(self, envelope: list[bytes], message: Message) -> None:
        """Operator: add or remove one core in one shard, at its sequencer (forwarded there)."""
        body = message.body
        driver = self.shards.get(body.shard)
        if driver is None:
            raise RequestError("unknown_shard", f"unknown shard {body.shard!r}")
        forward = rules.route_write(self._view(driver), self.config.name, body.forwarded, None)
        if isinstance(forward, rules.Forward):
            self._forward(envelope, message, driver.shard, forward.target)
            return
        self.begin()
        earlier = self.store.find_request(message.request_id)
        route = rules.admit_membership_change(
            body.action == "add",
            body.name,
            body.endpoint,
            self.endpoints.get(body.name),
            message.request_id,
            self.pending_changes,
            earlier[1] if earlier is not None else None,
            MEMBERS_LEARNED_MAX,
            member_refusal(self.peer_versions, body.name, self.store.cluster_version(driver.shard)),
        )
        if isinstance(route, rules.AwaitCommit):
            # A retry of a change already in the log: answered when (or since) it committed.
            self._await_commit(driver, route.tx_key, envelope, message.request_id, duplicate=True)
            return
        # A new change, or a client's retry while its core is still catching up (answer the retry).
        self.hold(envelope, message.request_id)
        replaced = self.pending_changes.get(message.request_id)
        if replaced is not None and replaced[1] != envelope:
            # The retry came on another connection (a client that heard nothing reconnects): tell the
            # earlier one now, or its connection's place (``hold``) is never given back.
            reason = "the change was requested again; the answer goes to the newest request"
            self.reply(replaced[1], _outcome_unknown(message.request_id, reason))
        self.pending_changes[message.request_id] = (driver.shard, envelope)
        if isinstance(route, rules.RequestChange):
            consensus = driver.consensus
            if route.endpoint and body.name not in consensus.members and body.name != consensus.status().learner:
                # The sequencer replicates to the learner before any entry names its endpoint. Not for
                # a member or the learner already being caught up: the machine refuses that add
                # (``already_member``, ``membership_change_in_flight``), and the endpoint given would
                # have replaced (and persisted over) the one this core sends its appends to.
                self._learn_endpoint(body.name, route.endpoint)
            add = body.action == "add"
            self._step(driver, MembershipChangeRequested(body.name, add, route.endpoint, message.request_id))

    def _note_membership_entries(self, driver: ShardDriver, entries: tuple[Entry, ...]) -> None:
        """Persisted entries: learn added cores' endpoints; a pending change now waits for its commit."""
        for entry in entries:
            for op in entry.ops:
                if isinstance(op, MembersOp) and op.added:
                    self._learn_endpoint(op.added, op.endpoint)
            pending = (
                self.pending_changes.pop(entry.request_id, None) if entry.request_id and self.pending_changes else None
            )
            if pending is not None:
                driver.waiters.wait(entry.tx_key, entry.request_id or "", pending[1])

    def _answer_refused_change(self, driver: ShardDriver, envelope: list[bytes], effect: ProposalRejected) -> None:
        request_id = effect.request_id or ""
        if effect.reason in ALREADY_DONE:
            # A retried (or half-done cluster-wide) change: the membership already is what was asked.
            result = {"shard": driver.shard, "members": list(driver.consensus.members), "unchanged": effect.reason}
            self.reply(envelope, messages.reply(request_id, result))
            return
        sequencer = f" (sequencer: {effect.sequencer})" if effect.sequencer else ""
        self.reply(
            envelope,
            messages.error(
                request_id,
                effect.reason,
                f"membership change refused in shard {driver.shard}: {effect.reason}{sequencer}",
            ),
        )

    def membership(self) -> dict[str, Any]:
        """``cluster members``: the cluster view and each shard's membership as this core sees it."""
        shards = {}
        for shard, driver in sorted(self.shards.items()):
            status = driver.consensus.status()
            shards[shard] = {
                "members": list(status.members),
                "committed_members": list(status.committed_members),
                "learner": status.learner,
                # How far the learner has caught up (known at the sequencer only), against the
                # committed key it must reach: what `cluster add-core` shows while it waits.
                "learner_match": next(
                    (list(key) for peer, key in status.follower_match_keys if peer == status.learner), None
                ),
                # What the sequencer served of the learner's snapshot install: it moves while the
                # copy does, when the matched key moves only at the install's end.
                "learner_copy": self.copies_served.shown(shard, *self._installing_cores(shard), self.clock_ms()),
                "removal": status.removal.to_json(self.clock_ms()) if status.removal is not None else None,
                "committed": list(status.committed_key),
                "sequencer": status.sequencer,
                "generation": status.generation,
                "voter": driver.consensus.voter,
            }
        return {
            "node": self.config.name,
            "members": list(self.members),
            "endpoints": dict(sorted(self.endpoints.items())),
            "shards": shards,
        }

    def force_start(self) -> dict[str, Any]:
        """Operator: become sequencer of every shard with the cores that answer now, loudly.

        The consensus machine refuses (``ForceStartRefused``) while a majority answers; this driver
        only asks every member for its journal (the probe) and reports what the machine decided.
        """
        journals = self.probe_peers(FORCE_START_PROBE_TIMEOUT_MS)
        reached_names = sorted(journals)
        result: dict[str, Any] = {}
        refusals: dict[str, str] = {}
        for driver in self.shards.values():
            if driver.shard in self.stopped:
                refusals[driver.shard] = f"stopped on this core: {self.stopped[driver.shard]}"
                continue
            reached = reached_generations(journals, driver.shard)
            last_keys = reached_last_keys(journals, driver.shard)
            request = ForceStartRequested(reached, last_keys, rows_lost=driver.shard in self.rows_lost)
            effects = self._step(driver, request)
            for effect in effects:
                if isinstance(effect, ForceStartRefused):
                    refusals[driver.shard] = effect.reason
            if driver.shard not in refusals:
                members = driver.consensus.members
                result[driver.shard] = {
                    "generation": driver.consensus.generation,
                    "members": list(members),
                    "left_out": [m for m in self.members if m not in members],
                    "last": list(driver.consensus.last_key),
                    "committed": list(driver.consensus.committed_key),
                }
        if refusals:
            # Each shard's machine decides for itself: the shards it forced are forced for good, and
            # the operator must hear so, not only that others refused.
            forced = "".join(
                f"; FORCED shard {shard} (generation {info['generation']}, members {', '.join(info['members'])}, "
                f"left out {', '.join(info['left_out']) or 'nobody'})"
                for shard, info in sorted(result.items())
            )
            if forced:
                log.warning("FORCE START by operator, in part: %s; refused: %s", result, refusals)
            raise RequestError(
                "force_start_refused",
                f"force-start refused: {self.config.name} reached {', '.join(reached_names) or 'no other core'}; "
                + "; ".join(f"shard {shard}: {reason}" for shard, reason in sorted(refusals.items()))
                + forced,
                {"reached": reached_names, "refused": refusals, "forced": result},
            )
        left_out = [m for m in self.members if m != self.config.name and m not in journals]
        may_lose = (
            f"writes that {', '.join(left_out)} committed but {self.config.name} never received are lost; "
            f"{', '.join(left_out)} must be rebuilt from a member's data directory before rejoining"
            if left_out
            else "nothing: every member answered"
        )
        log.warning("FORCE START by operator: %s; may lose: %s", result, may_lose)
        # The members kept (a core reached may be no member: a removed core still answers the probe).
        kept = sorted({self.config.name}.union(*(info["members"] for info in result.values())))
        return {
            "node": self.config.name,
            "members": kept,
            "reached": reached_names,
            "left_out": left_out,
            "may_lose": may_lose,
            "shards": result,
        }

    def probe_peers(self, timeout_ms: int) -> dict[str, dict[str, Any]]:
        """Ask every other member for its journal, all at once; the answers of those that answered
        within ``timeout_ms``. Blocks the loop for at most about ``timeout_ms``."""
        from mnesite.rlog.client import MnesiteError

        answers: dict[str, dict[str, Any]] = {}
        refusals: dict[str, str] = {}  # the peers that refused this core's connection, and why
        peers = [peer for peer in self.endpoints if peer != self.config.name]
        if self.recovery is not None:  # what status says while the answers come in
            self.recovery.asked, self.recovery.answers, self.recovery.refusals = tuple(peers), answers, refusals

        def ask(peer: str) -> None:
            try:
                with self.peer_client(peer, timeout_ms) as client:
                    answers[peer] = client.journal()
            except MnesiteError as error:
                if error.refused is not None:  # this core's key, or the peer's connections_max
                    refusals[peer] = error.refused

        threads = [threading.Thread(target=ask, args=(peer,), daemon=True) for peer in peers]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_ms / 1000 + 1
        if self.recovery is not None:  # a start-up recovery answers status meanwhile
            self._recovery_wait(deadline, lambda: not any(thread.is_alive() for thread in threads))
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        # A peer's answer is untrusted too: one that does not say its generations counts as not reached.
        return well_formed_answers(dict(answers))

    def reachable_peers(self) -> list[str]:
        """Peers heard from within an election timeout: the ones a forced start keeps as members."""
        now = self.clock_ms()
        window_ms = self.consensus_config.election_timeout_ms_max
        return sorted(peer for peer, heard_ms in self.last_heard_ms.items() if now - heard_ms <= window_ms)

    def _maybe_trim(self) -> None:
        now = int(time.time() * 1000)
        if now < self._next_retention_ms or self.disk.full:
            return
        self._next_retention_ms = now + self.config.retention.retention_interval_ms
        retention = self.config.retention
        before_ms = now - retention.retention_age_ms_max if retention.retention_age_ms_max else None
        try:
            self.begin()
            for shard, driver in self.shards.items():
                status = driver.consensus.status()
                keep_from = keep_from_match_keys(
                    (key for _, key in status.follower_match_keys), self.agent_server.acked_keys(shard)
                )
                self.store.trim(shard, retention.retention_entries_max, before_ms, keep_from)
            self.flush()
        except apsw.Error as error:
            if storage_fault(error) is not None:
                raise  # the disk's, handled by NodeServer.turn (rlog.disk)
            # Retention's statements are fixed: SQLite refusing them says the database is not what
            # this core wrote (a malformed image, a read that failed as corruption). Logged and tried
            # again every second, the core went on serving from it; it stops as for a failed disk.
            raise StorageFailedError(f"rlog retention failed: {type(error).__name__}: {error}") from error

    # -- read-only SQL queries (rlog.query; the paging and waiting are NodeServer's) -----------

    def _query(self, envelope: list[bytes], message: Message) -> None:
        if message.kind != "query":
            self.query_cursor_request(envelope, message)
            return
        request, checked, shards = self.query_received(message)
        for shard in shards:
            self._check_serving(shard)
        targets = read_targets(shards, request.min_key, request.min_keys)
        if request.consistency != "linearizable" or not shards:
            self.query_wait(envelope, message, request, checked, shards, targets)
            return
        # Linearizable: each shard's committed key, confirmed by its sequencer (read_index), which
        # may be this core or another one; the query waits until this core has applied every key.
        drivers = {shard: self.shards.get(shard) for shard in shards}
        unknown = [shard for shard, driver in drivers.items() if driver is None]
        if unknown:  # before anything is held or forwarded: this refusal is the request's one answer
            raise RequestError("unknown_shard", f"unknown shard {unknown[0]!r}")
        gather = QueryIndexGather(envelope, message, request, checked, shards, targets)
        self.hold(envelope, message.request_id, changes=False)
        for shard, driver in drivers.items():
            # The rule a linearizable read follows (``rules.fence_read``): this core's read index as
            # sequencer, or its sequencer's, asked with a fresh request id (it replaces nothing).
            try:
                fence = rules.fence_read(
                    self._view(driver), self.config.name, False, driver.consensus.read_index(self.clock_ms())
                )
                if isinstance(fence, rules.Forward) and self.forwarded.full():
                    raise RequestError("no_sequencer", f"shard {shard}: too many requests forwarded now")
                if isinstance(fence, rules.Forward) and self._peer_socket(fence.target) is None:
                    raise RequestError("no_sequencer", f"shard {shard}: {self._unsent(fence.target)}")
            except RequestError as error:
                self._query_index_failed(gather, error.code, str(error))
                return
            if not isinstance(fence, rules.Forward):
                gather.keys[shard] = fence
                continue
            request_id = new_request_id()
            self.forwarded.forwarded(request_id, QueryIndexAsk(gather, shard), shard, fence.target, self.clock_ms())
            self._send_peer(fence.target, Message("read_index", request_id, {"shard": shard, "forwarded": True}))
        self._query_index_complete(gather)

    def _query_index_answered(self, ask: QueryIndexAsk, answer: Message) -> None:
        answered = messages.answer_as(answer.body.result, messages.ReadIndexAnswer) if answer.kind == "reply" else None
        key = answered.committed if answered is not None else None
        if key is None:
            code = answer.body.code if answer.kind == "error" else "bad_answer"
            reason = answer.body.message if answer.kind == "error" else "malformed read_index answer"
            self._query_index_failed(ask.gather, code, reason)
            return
        ask.gather.keys[ask.shard] = key
        self._query_index_complete(ask.gather)

    def _query_index_complete(self, gather: QueryIndexGather) -> None:
        if gather.answered or len(gather.keys) < len(gather.shards):
            return
        gather.answered = True
        targets = {shard: max(key, gather.targets.get(shard, ZERO_KEY)) for shard, key in gather.keys.items()}
        try:
            self.query_wait(gather.envelope, gather.message, gather.request, gather.checked, gather.shards, targets)
        except RequestError as error:
            self.refuse(gather.envelope, gather.message.request_id, error)

    def _query_index_failed(self, gather: QueryIndexGather, code: str, reason: str) -> None:
        if not gather.answered:
            gather.answered = True
            self.reply(gather.envelope, messages.error(gather.message.request_id, code, reason))

    def _query_shard_reached(self, shard: str, key: TxKey) -> bool:
        position = self.store.shard(shard)
        return position is not None and position.applied >= key and self._not_serving_reason(shard) is None

    # -- reads -------------------------------------------------------------------------------

    def _table(self, name: str) -> TableSchema:
        table = self.store.catalog().get(name)
        if table is None:
            raise self.unknown_table(f"unknown table {name!r}")
        return table

    def unknown_table(self, message: str) -> RequestError:
        """The answer to a request naming a table this core's catalog lacks: ``unknown_table``, unless
        the catalog may lack it only because this core is behind (``rules.catalog_incomplete``): a core
        rebuilt from an empty disk said "unknown table" of the cluster's tables until it caught up. The
        gets, scans, writes, SQL queries and changefeeds of an unknown table all come here."""
        reason = rules.catalog_incomplete(
            (shard, self._not_serving_reason(shard), self._applied_or_none(shard), self._vote_floor(shard))
            for shard in sorted(self.shards)
        )
        if reason is not None:
            return RequestError("not_ready", f"{message} at {self.config.name}, which is catching up: {reason}")
        return RequestError("unknown_table", message)

    def _applied_or_none(self, shard: str) -> TxKey | None:
        position = self.store.shard(shard)
        return position.applied if position is not None else None

    def _check_consistency(self, message: Message, table: TableSchema) -> None:
        # The client retries (bounded by its timeout) until this core has applied it.
        position = self.store.shard(table.shard)
        driver = self.shards.get(table.shard)
        min_key = read_targets((table.shard,), message.body.min_key, message.body.min_keys).get(table.shard)
        behind = min_key is not None and (position is None or position.applied < min_key)
        if behind and driver is not None and driver.apply.up_to is not None:
            self._apply_gathered(driver)  # the key may be among the commits this follower gathered
            position = self.store.shard(table.shard)
        rules.check_applied(self.config.name, min_key, position.applied if position else None)

    def _read(self, envelope: list[bytes], message: Message) -> Any:
        """A read at this core: its table's shard must be serving, and a read that must see a key
        is refused until this core applied it; the answer is the shared read service's. ``HELD``: it
        is answered later (a ``count``, run on a query worker: ``NodeServer.count_later``)."""
        body, kind = message.body, message.kind
        if kind == "status":
            return self.status()
        if kind == "journal":
            return self.journal()
        table = None
        if kind in read_service.TABLE_KINDS:
            table = self._table(body.table)
            self._check_serving(table.shard)
            if kind in ("get", "scan", "count"):
                self._check_consistency(message, table)
            if kind == "count":
                applied = self._shard(table.shard).applied
                if self.count_later(envelope, message.request_id, table, applied, body.forwarded):
                    return HELD
        limits = self.config.limits
        answer = read_service.answer_read(self.store, kind, body, table, limits.scan_rows_max, limits.frame_bytes_max)
        if kind == "bootstrap_batch" and body.sender is not None and table is not None:
            first_batch = body.after is None
            self._count_copy_served(table.shard, body.sender, table.name, first_batch, len(answer["rows"]))
        return answer

    def _installing_cores(self, shard: str) -> tuple[str | None, tuple[str, ...]]:
        """The learner and members of ``shard`` whose installs this core counts: none unless it is the
        shard's sequencer (``core.snapshot.CopiesServed``)."""
        driver = self.shards.get(shard)
        if driver is None or driver.consensus.role is not Role.SEQUENCER:
            return None, ()
        status = driver.consensus.status()
        return status.learner, tuple(status.members)

    def _count_copy_served(self, shard: str, core: str, table: str, first_batch: bool, rows: int) -> None:
        learner, members = self._installing_cores(shard)
        self.copies_served.served(shard, core, table, first_batch, rows, self.clock_ms(), learner, members)

    def _shard(self, shard: str) -> ShardPosition:
        position = self.store.shard(shard)
        if position is None:
            raise RequestError("unknown_shard", f"unknown shard {shard!r}")
        return position

    def journal(self) -> dict[str, Any]:
        """This core's journal age per shard (ARTEMIS-3340): generation, committed and last keys."""
        shards = {}
        for shard, driver in self.shards.items():
            age = driver.consensus.journal_age()
            status = driver.consensus.status()
            shards[shard] = {
                "generation": age.generation,
                "committed": list(age.committed_key),
                "last": list(age.last_key),
                "digest": self.store.digest_at(shard, age.committed_key).hex()
                if self.store.digest_at(shard, age.committed_key)
                else None,
                "forced": status.forced,
                # The committed membership: a change only in the log may still be truncated away, and
                # what a rebuilt core recovers (core.recovery.recovered_members) and operators read
                # must not. The change in the log, if any, is reported apart.
                "members": list(status.committed_members),
                "pending_members": list(status.members) if status.members != status.committed_members else None,
                "hears_sequencer": self._hears_sequencer(driver),
                "agents": self.agent_server.agents_of(shard),
                "cluster_version": self.store.cluster_version(shard),
            }
        return {
            "node": self.config.name,
            "core_nodes": self.endpoints,
            "members": list(self.members),
            "reachable_peers": self.reachable_peers(),
            "shards": shards,
            # This core's announcement (rlog.versions; release 0.1.0 answers without it) and its peers'.
            **self._versions_status(),
        }

    def status(self) -> dict[str, Any]:
        shards = {}
        positions = self.store.shards()
        for shard, driver in self.shards.items():
            position = positions[shard]
            status = driver.consensus.status()
            entry: dict[str, Any] = {
                "applied": list(position.applied),
                "digest": position.digest.hex(),
                "generation": status.generation,
                "elections": driver.elections,
                "role": status.role.value,
                "sequencer": status.sequencer,
                "committed": list(status.committed_key),
                # Heard committed, not applied yet: a follower gathers commits (core.rules.FollowerApply).
                "gathered_entries": driver.apply.entries,
                "last": list(status.last_key),
                # A core rebuilt on an empty disk (core.recovery): below this key it votes only for logs
                # that reach it and does not campaign; another core's disk should not be replaced before.
                "vote_floor": list(status.vote_floor),
                "members": list(status.members),
                "committed_members": list(status.committed_members),
                "learner": status.learner,
                # A removal waiting for the set it leaves to answer (sequencer only; core.membership).
                "removal": status.removal.to_json(self.clock_ms()) if status.removal is not None else None,
                "forced": status.forced,
                "excluded": self.excluded.get(shard),
                "rlog": self._rlog_statistics(shard),
                "serving": self._not_serving_reason(shard) is None,
                "disk_full": status.disk_full,
                "not_serving_reason": self._not_serving_reason(shard),
                "cluster_version": self.store.cluster_version(shard),
                # Applying waits at an entry creating a name another shard holds here (Store.name_waits).
                "name_wait": wait.to_json() if (wait := self.store.name_waits.get(shard)) is not None else None,
            }
            install = self.installs.get(shard)
            if install is not None:
                rate, eta = install.copy.progress(self.clock_ms())
                entry["install"] = {
                    "mode": install.mode.value,
                    "key": list(install.offer.key),
                    "from": install.offer.sequencer,
                    "rows": install.copy.rows,
                    "rows_expected": install.copy.rows_expected,
                    "bytes": install.copy.bytes,
                    "rows_per_s": rate,
                    "eta_ms": eta,
                    "read_fence": list(install.fence_key) if install.fence_key else None,
                    # why the fence key was not told at the last ask (a refusal, no answer), while fenced
                    "read_fence_error": install.read_fence_error,
                }
            if status.role is Role.SEQUENCER:
                entry["followers"] = {
                    peer: {
                        "match": list(key),
                        "lag_entries": self._lag(shard, key, status.last_key),
                        "lazy": peer in status.lazy_followers,
                    }
                    for peer, key in status.follower_match_keys
                }
            shards[shard] = entry
        return {
            "node": self.config.name,
            "role": self.config.role,
            "listen": self.config.listen,
            "data_dir": self.config.data_dir,
            "core_nodes": self.endpoints,
            "members": list(self.members),
            "commits": self.commits,
            "durable_commits": self.durable_commits,
            "sends_dropped": sum(self.sends_dropped_by().values()),
            "sends_dropped_by": self.sends_dropped_by(),
            "connections": self.connections_status(),
            "collector": self.collector_status(),
            "wal_checkpoints": self.store.checkpointer.status() if self.store.checkpointer else None,
            "wal_reserve": self.store.wal_reserve.status() if self.store.wal_reserve else None,
            "disk": {**self.disk.status(self.clock_ms()), "frames_dropped": self.frames_dropped_disk},
            # read-only SQL queries (rlog.query): cursors open, queries, pages, refused, budget stops, expired
            "queries": self.queries.statistics(),
            "changes": self.changes_statistics(),
            # online index builds (rlog.store): per table, rows copied so far and the indexes being built
            "index_builds": self.store.index_build_status(),
            "transactions": self.transactions,
            "protocol_violations": self.protocol_violations,
            "agents": self.agent_server.status(),
            "agent_budget": {**self.agent_server.budget.status(), "acks_refused": self.agent_server.acks_refused},
            "security": self.security_status(),
            **self.backup_status(),
            **self._versions_status(),
            "peer_frames_refused": self.peer_frames_refused,
            # per peer core: bytes and frames zmq holds toward it, sends refused for core_queue_bytes_max
            "core_queues": self.peer_queues.status(tuple(peer for peer in self.endpoints if peer != self.config.name)),
            "shards": shards,
        }

    def _rlog_statistics(self, shard: str) -> dict[str, Any]:
        """The shard's rlog size, counted at most once per STATUS_COUNT_INTERVAL_MS: ``status`` must cost
        O(shards), not a count of the rlog per request (2,000 status requests starved every client)."""
        now = self.clock_ms()
        cached = self._status_counts.get(shard)
        if cached is None or now - cached[0] >= STATUS_COUNT_INTERVAL_MS:
            cached = (now, self.store.rlog_statistics(shard))
            self._status_counts[shard] = cached
        return cached[1]

    def _lag(self, shard: str, match: TxKey, last: TxKey) -> int:
        if match.generation == last.generation:
            return max(0, last.counter - match.counter)  # counters of one generation have no gaps
        cache_key = (shard, match, last)
        cached = self._status_counts.get(cache_key)
        now = self.clock_ms()
        if cached is not None and now - cached[0] < STATUS_COUNT_INTERVAL_MS:
            return cached[1]
        if len(self._status_counts) > SHARDS_MAX * 4:
            self._status_counts.clear()
        count = self.store.count_between(shard, match, last, 10**12)
        self._status_counts[cache_key] = (now, count)
        return count

    # -- local helpers for tools -------------------------------------------------------------

    def commit_batch(self, writes: list[tuple[Any, Message]]) -> None:
        """Propose writes directly (used by ``start --sample-data``); answers are dropped."""
        for _, message in writes:
            with contextlib.suppress(Deferred, RequestError, SchemaError):
                self._write(None, message)  # type: ignore[arg-type]
        self._end_batches()
        self.flush()


# The msgpack prefix of a "peer" frame: [version 1, "peer", ...]. A cheap look, not a decode: the
# frame is decoded and checked like any other; a forged prefix buys a place in the queue only to a
# key with the core role (``CoreNode.urgent``).
_PEER_FRAME_PREFIX = b"\x94\x01\xa4peer"


def is_peer_frame(frame: bytes) -> bool:
    """A consensus message between cores (handled before anything else in a loop turn)."""
    return frame.startswith(_PEER_FRAME_PREFIX)


def _outcome_unknown(request_id: str, reason: str) -> Message:
    return messages.error(
        request_id,
        "outcome_unknown",
        f"the outcome is unknown ({reason}); retry with the same request id to learn it",
    )
