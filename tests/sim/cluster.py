"""A deterministic simulation of core nodes running ``core.consensus.ShardConsensus``.

Theory of operation
-------------------
Everything comes from one ``random.Random(seed)``: fault injection, message delays, client writes
and the random source of every state machine. Time is a fake clock advanced in ``tick_ms`` steps.

* Network: every message goes through the wire codec (``core.consensus_wire`` and msgpack), then
  is dropped, duplicated or delayed (which reorders); partitions cut directed links.
* Storage: what a node persisted (``PersistState``, ``PersistEntries``, ``TruncateLog`` and the
  applied key from ``Commit``) lives in its ``SimNode``; a crash throws the state machine away and a
  restart rebuilds it from there. A crash may hit in the middle of a step's effects. The cluster
  version its applied state records lives there too (``SimNode.cluster_version``, production's
  store's): the sequencer packs writes by it, and its snapshot offers carry it, as production's do.
* Applying: every core's Commit goes through production's ``core.rules.FollowerApply`` and
  ``GATHER_THROUGH``. In ``GatheringSimulation`` and its disk and replicant kin
  (``follower_apply_delay_ms``: production's default) a follower gathers the commits it hears and
  applies them together: once the delay ends, when a commit carries more than rows, before any other
  effect of its machine, before a snapshot offer, and at once while a client's write or a held
  guard waits on it; what it gathered is in memory (a crash or a full disk forgets it; the restart
  applies again from the log). The other simulations
  run with a delay of 0 (every commit applied at once), which their fixed-seed scenarios assume.
* Pauses: a paused node neither ticks nor receives (its messages wait), then resumes with stale state.
* Clients send writes to the node they believe is the sequencer; a follower forwards them once to
  the sequencer it knows and relays the answer, and every answer comes from production's
  ``core.outcome`` rules (``CommitWaiters`` at the sequencer, ``ForwardedRequests`` at the
  follower: outcome unknown when its sequencer changes or does not answer in time); every
  acknowledgement is checked against the committed log. They also send reads and
  guarded transactions through the network (so a paused node answers them late, after whatever
  reached it first): ``local`` reads, ``linearizable`` reads (served as production serves them: at
  the sequencer, only when ``ShardConsensus.read_index`` allows) and compare-and-set transactions
  whose guard is evaluated against the applied state plus ``core.guard_tail.GuardTail``, the
  production rule for when a failed guard may be told. A client that hears nothing re-sends its
  guarded write, with the same request id, while its failure is held at the sequencer (now and then,
  once per request): production's ``CoreNode._resent_held_failure`` (``GuardTail.resent``, the
  tail's rule 3) lets the held failure answer it. No request id of a guarded write is answered twice
  (a failed guard told, or its write acknowledged: ``_guard_answered``).
* History check (``_record_read``). The simulator knows the committed log (entries in the order
  they were first committed anywhere, as each Commit effect is executed). Every answered read and
  failed guard must return the row after some committed prefix that includes every write
  acknowledged before the request began and every prefix a linearizable read of that key answered
  before it began, and that had committed when the answer was given. Local reads only need some
  committed prefix, and the one the node applied (``_record_local_read``): a node whose rows an
  abandoned install deleted answers from what is left of them. Where a simulation can bound how far a
  core that can follow lags (``_local_read_lag_ms_max``: none under faults, which hold a correct core
  back as long as they last), a local read must also reflect every entry committed that long before
  it began: a core stuck at an entry it refused, which stops while the others go on, breaks it.
  Which cores answer local reads is production's ``core.rules.not_serving_reason``.

Every core is honest, so a ``ProtocolViolation`` fails the run (a check of a peer's message that
misjudges honest traffic), except a message from outside the membership (``NOT_A_MEMBER``: a removed
or left-out core's messages in flight). Checks run after every step (see ``_check_node``) and at the
end, after healing everything and running until the cluster is quiet. A violation raises
``SimulationFailure`` naming the seed and the command that replays it.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import os
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
from mnesite.core import rules
from mnesite.core.consensus import (
    NOT_A_MEMBER,
    BatchEnded,
    Commit,
    ConsensusConfig,
    ConsensusInvariantError,
    Effect,
    FeedRequested,
    ForceStartRequested,
    MessageReceived,
    PeerMessage,
    Persisted,
    PersistedState,
    PersistEntries,
    PersistState,
    ProposalCommitted,
    ProposalFailed,
    ProposalRejected,
    Proposed,
    ProposedBatch,
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
from mnesite.core.guard_tail import GUARD_ANSWER, GuardTail
from mnesite.core.outcome import (
    Acknowledged,
    CommitWaiters,
    ForwardedRequests,
    Outcome,
    OutcomeUnknown,
)
from mnesite.core.recovery import (
    recovered_generations,
    recovered_members,
    recovered_vote_floors,
    recovery_shortfall,
)
from mnesite.core.snapshot import (
    SnapshotOffer,
    accept_offer,
    exclusion_after_install,
    reads_forced_offer,
    snapshot_request_due,
    state_after_install,
)
from mnesite.core.transaction import GuardFailed, evaluate, parse_transaction
from mnesite.core.versions import UNSPOKEN_CLUSTER_VERSION, cluster_version_of
from mnesite.rlog import retention
from mnesite.rlog.config import Limits
from mnesite.rlog.errors import RequestError
from mnesite.rlog.messages import typed_body
from mnesite.rlog.schema import TableSchema, define_table
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, DeleteOp, DropTableOp, Entry, Op, TxKey, WriteOp
from mnesite.rlog.versions import THIS_RELEASE, Announcement

SHARD = "main"
TRACE_LINES_MAX = 80
WRITES_MAX = 400
READS_MAX = 800
# Few keys, so that reads, guards and writes of the same row interleave often.
READ_KEYS = 4
READ_TABLE = "t"
CATALOG: dict[str, TableSchema] = {READ_TABLE: define_table(READ_TABLE, "k", [["k", "INTEGER"], ["v", "INTEGER"]])}
CLIENT = "client"
SNAPSHOT_REQUEST = "snapshot_request"  # the frame a core whose rows are lost sends its sequencer
RETENTION_INTERVAL_MS = 100
TRANSACTION_OPS_MAX = 16
# Production's core/node.py FORWARD_TIMEOUT_MS and FORWARDED_MAX, scaled to the simulated timeouts.
FORWARD_TIMEOUT_MS = 1000
FORWARDED_MAX = 64
# A client that hears nothing about its write for this long, or hears "outcome unknown", resends it
# with the same request id (production's Client does, up to its retries), at most this many times.
CLIENT_RETRY_MS = 1500
# Each tick, the chance that the client of a failed guard held at the sequencer re-sends it (once).
GUARD_RESEND_PROBABILITY = 0.3
CLIENT_RETRIES_MAX = 3
# A core on an empty database that heard too few peers asks again after this long (production: a
# probe of up to recovery_timeout_ms, RECOVERY_ROUNDS_MAX times, then it does not start).
RECOVERY_RETRY_MS = 200
Row = dict[str, Any] | None


def replay_command(seed: int, test_file: str = "tests/test_simulation.py") -> str:
    """The command that replays ``seed``: the pytest test that runs it now, by its node id (a fixed
    scenario has no ``seed_N`` id for ``-k`` to find), else the seed's test in ``test_file``."""
    node_id = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    target = f"'{node_id}'" if node_id else f"{test_file} -k 'seed_{seed}'"
    return f"MNESITE_SIM_SEED={seed} .venv/bin/pytest {target}"


class SimulationFailure(AssertionError):
    """An invariant broke; the message names the seed and how to replay it."""


class MemoryLog:
    """The simulator's ``LogView`` and ``rlog.retention.RetentionView``: a persisted log in memory."""

    def __init__(self, trimmed_key: TxKey = ZERO_KEY, trimmed_digest: bytes = GENESIS_DIGEST) -> None:
        self.entries: list[Entry] = []
        self.keys: list[TxKey] = []
        # When each entry was persisted (simulated time): the age bound of retention reads it.
        self.appended_ms: list[int] = []
        self._trimmed_key = trimmed_key
        self._trimmed_digest = trimmed_digest
        # request id -> key of the entry carrying it (production: the rlog's request_id column).
        self.request_keys: dict[str, TxKey] = {}

    # LogView
    def last_key(self) -> TxKey:
        return self.keys[-1] if self.keys else self._trimmed_key

    def digest_at(self, key: TxKey) -> bytes | None:
        if key == self._trimmed_key:
            return self._trimmed_digest
        position = bisect.bisect_left(self.keys, key)
        if position < len(self.keys) and self.keys[position] == key:
            return self.entries[position].digest
        return None

    def entries_after(self, key: TxKey, limit: int) -> list[Entry]:
        position = bisect.bisect_right(self.keys, key)
        return self.entries[position : position + limit]

    def trimmed_key(self) -> TxKey:
        return self._trimmed_key

    def count_after(self, key: TxKey, up_to: TxKey, limit: int) -> int:
        return min(limit, max(0, bisect.bisect_right(self.keys, up_to) - bisect.bisect_right(self.keys, key)))

    # RetentionView
    def key_before(self, key: TxKey) -> TxKey | None:
        position = bisect.bisect_left(self.keys, key)
        return self.keys[position - 1] if position > 0 else None

    def newest_key_at(self, offset: int) -> TxKey | None:
        return self.keys[-1 - offset] if 0 <= offset < len(self.keys) else None

    def newest_appended_before(self, before_ms: int) -> TxKey | None:
        # Appended times never decrease along the log (one clock per node).
        position = bisect.bisect_left(self.appended_ms, before_ms)
        return self.keys[position - 1] if position > 0 else None

    # storage operations, as a driver would run them
    def entry_at(self, key: TxKey) -> Entry | None:
        position = bisect.bisect_left(self.keys, key)
        if position < len(self.keys) and self.keys[position] == key:
            return self.entries[position]
        return None

    def append(self, entries: tuple[Entry, ...], appended_ms: int = 0) -> None:
        for entry in entries:
            if entry.prev != self.last_key():
                raise SimulationFailure(
                    f"append of {entry.tx_key} after {entry.prev} but the log ends at {self.last_key()}"
                )
            self.entries.append(entry)
            self.keys.append(entry.tx_key)
            if entry.request_id is not None:
                self.request_keys.setdefault(entry.request_id, entry.tx_key)
            self.appended_ms.append(max(appended_ms, self.appended_ms[-1] if self.appended_ms else 0))

    def find_request(self, request_id: str) -> TxKey | None:
        """The key of the retained entry carrying ``request_id`` (production: ``Store.find_request``)."""
        return self.request_keys.get(request_id)

    def _forget_requests(self, entries: list[Entry]) -> None:
        for entry in entries:
            if entry.request_id is not None and self.request_keys.get(entry.request_id) == entry.tx_key:
                del self.request_keys[entry.request_id]

    def truncate_after(self, key: TxKey) -> None:
        position = bisect.bisect_right(self.keys, key)
        self._forget_requests(self.entries[position:])
        del self.entries[position:]
        del self.keys[position:]
        del self.appended_ms[position:]

    def restarted_at(self, key: TxKey, digest: bytes) -> MemoryLog:
        """A snapshot install ends (production: ``Store.restart_log_at``): the log keeps its entries
        after ``key`` when it holds ``key`` with ``digest`` (the same history), else it is emptied."""
        if self.digest_at(key) == digest:
            self.trim_to(key)
            return self
        return MemoryLog(key, digest)

    def trim_to(self, key: TxKey) -> None:
        digest = self.digest_at(key)
        if digest is None:
            raise SimulationFailure(f"cannot trim to {key}: not in the log")
        position = bisect.bisect_right(self.keys, key)
        self._forget_requests(self.entries[:position])
        del self.entries[:position]
        del self.keys[:position]
        del self.appended_ms[:position]
        self._trimmed_key, self._trimmed_digest = key, digest


@dataclass(frozen=True)
class ClientRequest:
    """A client read (``local``, ``linearizable``) or compare-and-set (``guard``) of one row."""

    kind: str
    key: int
    number: int
    started_ms: int
    # Commit position of the last write acknowledged before the request began.
    acknowledged_position: int
    expected: Row = None
    forwarded: bool = False
    # For a replicant's linearizable read (kind ``read_index``): the replicant that serves it.
    replicant: str | None = None
    # A write forwarded by core ``origin`` to the sequencer (kind ``write``: its ``ops``), and the
    # sequencer's answer relayed back to ``origin`` (kind ``relay``: its ``outcome``; None: an error).
    origin: str | None = None
    ops: tuple[Op, ...] = ()
    outcome: Outcome | None = None


@dataclass
class SimNode:
    name: str
    state: PersistedState
    log: MemoryLog = field(default_factory=MemoryLog)
    applied_key: TxKey = ZERO_KEY
    applied_digest: bytes = GENESIS_DIGEST
    machine: ShardConsensus | None = None
    down_until_ms: int = 0
    paused_until_ms: int = 0
    crash_in_next_step: bool = False
    # The last key of the log that is durable: a sequencer's own entries become durable only at
    # the driver's next commit (Persisted); a crash before it loses them (its appends may be out).
    durable_key: TxKey = ZERO_KEY
    persisting_key: TxKey | None = None  # the log's last key when the driver's last commit began
    # Writes proposed here waiting for their entry to commit (production's core.outcome rule; in
    # memory, lost in a crash: those clients get no answer).
    waiters: CommitWaiters[str] = field(default_factory=CommitWaiters)
    # Writes this core forwarded to the sequencer (production's core.outcome rule; lost in a crash).
    forwarded: ForwardedRequests[str] = field(
        default_factory=lambda: ForwardedRequests(FORWARDED_MAX, FORWARD_TIMEOUT_MS)
    )
    # The driver's retention timer (production: [rlog] retention_interval_ms).
    next_retention_ms: int = 0
    # The driver's in-memory guard tail (lost in a crash, rebuilt from the log at a restart).
    tail: GuardTail[tuple[ClientRequest, Row]] = field(default_factory=lambda: GuardTail(CATALOG))
    # Writes without guards taken since the driver last stepped this node, proposed together as one
    # ``ProposedBatch`` before its next event: production's ``core.rules.HeldWrites``, each with
    # where its answer goes. Lost in a crash, as production's are.
    held: rules.HeldWrites[str] = field(default_factory=rules.HeldWrites)
    # Commits heard as a follower and not applied yet (production's ``core.rules.FollowerApply``;
    # in memory, lost in a crash). Made by ``_start`` with the simulation's delay.
    apply: rules.FollowerApply = field(default_factory=lambda: rules.FollowerApply(0))
    # An install began (its rows deleted) and was abandoned: persisted (production's ``installing:``
    # meta), so a restart keeps it. Such a core serves no local read and does not tick its machine
    # (production's ``CoreNode._ticked``), and asks for an offer (``core.snapshot``, "Re-offer").
    rows_lost: bool = False
    snapshot_asked_ms: int | None = None  # when it last asked (in memory)
    # Its disk was replaced by an empty one (``Simulation.lose_disk``): before it starts it recovers
    # from its peers' journals as production's ``CoreNode.recover_generations`` does.
    disk_lost: bool = False
    # The cluster version its applied state records (production's ``Store.cluster_version``, persisted
    # with the applied key; 1 on an empty store): moved forward by an applied cluster version entry and
    # by a snapshot install (to the offer's). The sequencer packs by it, and its snapshot offers carry it.
    cluster_version: int = 1


@dataclass
class SimulationResult:
    seed: int
    core_count: int
    committed_entries: int
    acknowledged_writes: int
    elections: int
    crashes: int
    pauses: int
    snapshots: int
    final_time_ms: int
    reads_checked: int = 0
    guard_failures_checked: int = 0
    entries_trimmed: int = 0
    # Guarded writes re-sent while their failure was held, and how many of those were answered.
    guard_resends: int = 0
    guard_resends_answered: int = 0


@dataclass
class _Faults:
    drop_probability: float
    duplicate_probability: float
    delay_ms_max: int
    partition_probability: float
    heal_probability: float
    crash_probability: float
    pause_probability: float
    # Retention (rlog.retention, as cores run it): newest entries kept, age bound (0: none).
    retention_entries_max: int
    retention_age_ms_max: int
    write_probability: float
    read_probability: float = 0.0


class Simulation:
    # How long a follower may gather commits (production's [limits] follower_apply_delay_ms_max);
    # 0: every commit applied at once (see the theory of operation).
    follower_apply_delay_ms = 0
    # The cluster version every core's applied state is at when the run begins (``SimNode.cluster_version``),
    # as if the entry that moved the cluster there had committed, and been trimmed, before: from 2 on a
    # bulk write packs as one run of rows (rlog.versions.packs_runs).
    initial_cluster_version = 1
    # The first this many snapshot installs the followers take are abandoned half way (their rows
    # deleted, the copy cut by a timeout or a restart); 0: every install completes.
    installs_abandoned_max = 0

    # The sequencer's lazy feed interval (core.consensus, "Lazy followers"); None: drawn by the seed.
    lazy_feed_interval_ms: int | None = None

    def __init__(self, seed: int, core_count: int, faulty_ms: int = 3000, tick_ms: int = 10) -> None:
        self.seed = seed
        self.applies_gathered = 0  # applies of gathered commits whose time came (FollowerApply.due)
        self.rng = random.Random(seed)
        self.core_count = core_count
        self.faulty_ms = faulty_ms
        self.tick_ms = tick_ms
        self.now_ms = 0
        self.config = ConsensusConfig(
            election_timeout_ms_min=150,
            election_timeout_ms_max=300,
            heartbeat_interval_ms=30,
            entries_per_append_max=self.rng.choice([1, 4, 16]),
            appends_in_flight_max=self.rng.choice([1, 3]),
            pending_proposals_max=32,
            # 0: every follower fed every batch; else lazy followers, fed every 5 ms or every
            # heartbeat interval (30 ms, the cap) while the eager ones carry the commits. Drawn from
            # a generator of its own, so that every other draw of a seed stays what it was.
            lazy_feed_interval_ms=random.Random(f"lazy-{seed}").choice([0, 5, 30])
            if self.lazy_feed_interval_ms is None
            else self.lazy_feed_interval_ms,
        )
        rng = self.rng
        self.faults = _Faults(
            drop_probability=rng.choice([0.0, 0.05, 0.2]),
            duplicate_probability=rng.choice([0.0, 0.05]),
            delay_ms_max=rng.choice([2, 20, 60]),
            partition_probability=rng.choice([0.0, 0.01, 0.03]),
            heal_probability=0.03,
            crash_probability=rng.choice([0.0, 0.01, 0.02]),
            pause_probability=rng.choice([0.0, 0.01]),
            retention_entries_max=rng.choice([10**9, 4, 16]),
            retention_age_ms_max=rng.choice([0, 0, 200]),
            write_probability=rng.choice([0.2, 0.5]),
            read_probability=rng.choice([0.3, 0.6]),
        )
        members = tuple(f"core{index}" for index in range(core_count))
        self.nodes = {
            name: SimNode(name, PersistedState(0, None, members), cluster_version=self.initial_cluster_version)
            for name in members
        }
        for node in self.nodes.values():
            self._start(node)
        self.network: list[tuple[int, int, str, str, Any]] = []
        self.message_sequence = 0
        self.cut: set[tuple[str, str]] = set()
        self.trace: deque[tuple[Any, ...]] = deque(maxlen=TRACE_LINES_MAX)
        # Checker state.
        self.sequencer_of_generation: dict[int, str] = {}
        self.digest_ever_persisted: dict[TxKey, bytes] = {}
        self.committed_digest: dict[TxKey, bytes] = {}
        self.committed_request_id: dict[TxKey, str | None] = {}
        self.committed_last_key = ZERO_KEY
        self.acknowledged: dict[str, TxKey] = {}
        # Client writes not acknowledged yet: request id -> (request, when to resend, resends so far).
        self.unanswered: dict[str, tuple[ClientRequest, int, int]] = {}
        self.resends = 0
        self.resends_answered_from_log = 0
        # Exactly once: request id -> the key it committed at. A request id may commit again only if
        # the sequencer that proposed it again no longer retained its first entry (``_propose``).
        self.committed_key_of_request: dict[str, TxKey] = {}
        self.reproposed_after_trim: set[str] = set()
        self.client_belief: str | None = None
        self.write_count = 0
        self.crashes = 0
        self.disks_lost = 0
        self.pauses = 0
        self.snapshots = 0
        self.installs_abandoned = 0
        self.entries_trimmed = 0
        self.lost_for_good: set[str] = set()
        # Whether the operator starts a rebuilt core with initial_cluster_state = "existing", as the
        # docs say (``_recover``); a mutation test turns it off.
        self.rebuilt_cores_declared_existing = True
        # The committed log as the simulator knows it, for the history check of reads.
        self.commit_position: dict[TxKey, int] = {ZERO_KEY: 0}
        self.commit_count = 0
        self.committed_ms: list[int] = []  # when each position of the committed log first committed
        self.row_positions: dict[int, list[int]] = defaultdict(list)
        self.row_values: dict[int, list[Row]] = defaultdict(list)
        self.acknowledged_position = 0
        # key -> [(answered_ms, prefix position)] of linearizable answers: later ones may not go back.
        self.answered_prefixes: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.last_seen: dict[int, Row] = {}
        self.read_count = 0
        self.reads_checked = 0
        self.local_reads_answered: dict[str, int] = defaultdict(int)  # per node
        self.guard_failures_checked = 0
        # The clients' re-sends of held failed guards draw from a source of their own, so that the
        # runs of every seed are otherwise the ones they were without them.
        self.guard_resend_rng = random.Random(seed + 1_000_003)
        self.guards_resent: set[int] = set()
        self.guard_resends_answered = 0
        # The answers each guarded write's request id got (failed guard told, write acknowledged).
        self.guard_answers: dict[str, list[str]] = {}

    # ------------------------------------------------------------ failures

    def fail(self, what: str) -> SimulationFailure:
        lines = "\n".join(f"  t={line[0]} " + " ".join(str(part) for part in line[1:]) for line in self.trace)
        return SimulationFailure(
            f"simulation seed {self.seed} ({self.core_count} cores) failed at t={self.now_ms} ms: {what}\n"
            f"replay with: {self._replay_command()}\n"
            f"last events:\n{lines}"
        )

    def _replay_command(self) -> str:
        return replay_command(self.seed)

    # ------------------------------------------------------------ node lifecycle

    def _start(self, node: SimNode) -> None:
        node.durable_key = node.log.last_key()
        node.snapshot_asked_ms = None
        node.persisting_key = None
        node.tail = GuardTail(CATALOG)
        node.apply = rules.FollowerApply(self.follower_apply_delay_ms)  # a driver's own memory
        node.tail.add(tuple(node.log.entries_after(node.applied_key, len(node.log.entries))))
        node.machine = ShardConsensus(
            SHARD,
            node.name,
            node.log,
            node.state,
            node.applied_key,
            self.config,
            random.Random(self.rng.getrandbits(64)),
            self.now_ms,
            own_versions=self._speaks(node),
        )

    def _speaks(self, node: SimNode) -> Announcement:
        """What ``node``'s release speaks (production: ``rlog.versions.local_announcement``)."""
        return THIS_RELEASE

    def _crash(self, node: SimNode) -> None:
        self._lose_undurable(node)
        node.machine = None
        node.held = rules.HeldWrites()
        node.waiters = CommitWaiters()
        node.forwarded = ForwardedRequests(FORWARDED_MAX, FORWARD_TIMEOUT_MS)
        node.crash_in_next_step = False
        node.paused_until_ms = 0
        node.down_until_ms = self.now_ms + self.rng.randint(20, 600)
        self.crashes += 1
        self.trace.append((self.now_ms, node.name, "crashed until", node.down_until_ms))

    def _lose_undurable(self, node: SimNode) -> None:
        """What the driver's open transaction held is gone (a crash, or a commit that failed)."""
        if node.log.last_key() > node.durable_key:
            # The sequencer's entries since its last Persisted were not durable: gone, and with them
            # whatever the same (uncommitted) driver turn applied.
            self.trace.append((self.now_ms, node.name, "crash loses entries after", node.durable_key))
            node.log.truncate_after(node.durable_key)
            if node.applied_key > node.durable_key:
                digest = node.log.digest_at(node.durable_key)
                if digest is None:
                    raise self.fail(f"{node.name} applied {node.applied_key} beyond its durable log")
                node.applied_key, node.applied_digest = node.durable_key, digest

    def _is_up(self, node: SimNode) -> bool:
        return node.machine is not None and node.paused_until_ms <= self.now_ms

    def _step(self, node: SimNode, event: Any) -> list[Effect]:
        """Step ``node``'s machine and execute its effects; the effects executed (all, unless it crashed)."""
        machine = node.machine
        if machine is None:
            raise self.fail(f"stepping crashed node {node.name}")
        if not self._propose_held_first(node, event):
            return []
        machine = node.machine
        try:
            effects = machine.step(event, self.now_ms)
        except ConsensusInvariantError as error:
            raise self.fail(f"{node.name} raised ConsensusInvariantError: {error}") from error
        crash_after = None
        if node.crash_in_next_step:
            crash_after = self.rng.randint(0, len(effects))
            effects = effects[:crash_after]
        for effect in effects:
            self._execute(node, effect)
        if crash_after is not None:
            self.trace.append((self.now_ms, node.name, "crashed mid-step after effects", crash_after))
            self._crash(node)
        self._check_node(node)
        return effects

    def _propose_held_first(self, node: SimNode, event: Any) -> bool:
        """Production's driver proposes a turn's held writes before any other event of the shard. Not
        before Persisted: in this model Persisted reports the previous turn's commit, which did not
        hold them (production's turn proposes them before its commit, never after). False if the node
        crashed in that step."""
        if node.held and node.machine is not None and not isinstance(event, (ProposedBatch, Persisted)):
            self._propose_held(node)
        return node.machine is not None

    def _propose(
        self, node: SimNode, ops: tuple[Op, ...], request_id: str, client: str = CLIENT, held: bool = False
    ) -> None:
        """A write at the sequencer, as production's driver takes it (core/node.py ``_write``):
        propose, then wait for the entry carrying the request id to commit. ``client``: where the
        answer goes (the client, or the core that forwarded the write). ``held``: a write without
        guards, held with the others of this turn and proposed with them (``_propose_held``)."""
        first = self.committed_key_of_request.get(request_id)
        if first is not None and first <= node.log.trimmed_key():
            # Production's limit: a request id is remembered while its entry is retained.
            self.reproposed_after_trim.add(request_id)
        if held:
            node.held.hold(Proposed(ops, request_id), client)
            return
        self._await_entries(node, self._step(node, Proposed(ops, request_id)), {request_id: client})

    def _propose_held(self, node: SimNode) -> None:
        """Production's ``CoreNode._propose_batch``: the held writes in one ``ProposedBatch``."""
        batch, held = node.held.take(node.cluster_version)
        self._await_entries(node, self._step(node, batch), dict(held))

    def _await_entries(self, node: SimNode, effects: list[Effect], clients: dict[str, str]) -> None:
        """Production's ``CoreNode._propose_batch``: each proposed write waits for its entry (one the
        machine refused is not answered here: the client retries)."""
        if node.machine is None:
            return  # it crashed in that step: its waiters are gone
        keys, _ = rules.batch_outcomes(effects)
        for request_id, client in clients.items():
            key = keys.get(request_id)
            if key is None:
                continue
            answer = node.waiters.answer_now(key, request_id, node.applied_key)
            if answer is not None:
                self._tell(node, answer, client)
            else:
                node.waiters.wait(key, request_id, client)

    def _tell(self, node: SimNode, outcome: Outcome | None, client: str = CLIENT) -> None:
        """A write's outcome leaves ``node``: an acknowledgement must name where it committed. It
        reaches the client directly, or through the core that forwarded the write (``relay``)."""
        committed_here = isinstance(outcome, Acknowledged) and (
            outcome.tx_key <= self._commit_point(node)
            and self.committed_request_id.get(outcome.tx_key) == outcome.request_id
        )
        if isinstance(outcome, Acknowledged) and not committed_here:
            raise self.fail(f"{outcome.request_id} acknowledged at {outcome.tx_key} but not committed there")
        if client != CLIENT and outcome is not None:
            relay = ClientRequest("relay", 0, 0, self.now_ms, self.acknowledged_position, outcome=outcome)
            self._enqueue_client(client, relay)
            return
        self._client_told(node, outcome)

    @staticmethod
    def _commit_point(node: SimNode) -> TxKey:
        """How far ``node`` knows its log committed: its machine's commit point, or what it applied."""
        machine = node.machine
        return node.applied_key if machine is None else max(node.applied_key, machine.committed_key)

    def _client_told(self, node: SimNode, outcome: Outcome | None) -> None:
        if isinstance(outcome, Acknowledged):
            if outcome.request_id.startswith("c"):
                self._guard_answered(outcome.request_id, f"written at {outcome.tx_key}")
            earlier = self.acknowledged.get(outcome.request_id)
            if earlier not in (None, outcome.tx_key) and outcome.request_id not in self.reproposed_after_trim:
                raise self.fail(f"{outcome.request_id} acknowledged at {earlier} and again at {outcome.tx_key}")
            self.acknowledged[outcome.request_id] = outcome.tx_key
            self.resends_answered_from_log += outcome.duplicate
            self.unanswered.pop(outcome.request_id, None)
            self.acknowledged_position = max(self.acknowledged_position, self.commit_position[outcome.tx_key])
        elif isinstance(outcome, OutcomeUnknown):
            self.trace.append((self.now_ms, node.name, "outcome unknown", outcome.request_id, outcome.reason))
            waiting = self.unanswered.get(outcome.request_id)
            if waiting is not None:  # the client resends soon, with the same request id
                self.unanswered[outcome.request_id] = (waiting[0], self.now_ms + 50, waiting[2])

    def _guard_answered(self, request_id: str, answer: str) -> None:
        """A guarded write's request id is answered (its guard failed, or its write committed): once."""
        answers = self.guard_answers.setdefault(request_id, [])
        answers.append(answer)
        if len(answers) > 1:
            raise self.fail(f"request {request_id} answered twice: {'; '.join(answers)}")
        self.guard_resends_answered += int(request_id[1:]) in self.guards_resent

    def _resend_held_guards(self) -> None:
        """The client of a failed guard held at the sequencer heard nothing and re-sends it, with the
        same request id, straight to that sequencer (production's client re-sends after silence): at
        most once per request, here while the failure is still held there. Between turns, when the
        sequencer holds no write of its own turn (so that the re-send proposes none early)."""
        for node in self.nodes.values():
            machine = node.machine
            if not self._is_up(node) or machine is None or machine.role is not Role.SEQUENCER or node.held:
                continue
            for request, _ in node.tail.held_tokens():
                if request.number in self.guards_resent or self.guard_resend_rng.random() >= GUARD_RESEND_PROBABILITY:
                    continue
                self.guards_resent.add(request.number)
                self.trace.append((self.now_ms, node.name, "client resends guard", request.number))
                self._serve_client(node, dataclasses.replace(request, forwarded=False))

    # ------------------------------------------------------------ effects (the driver)

    def _execute(self, node: SimNode, effect: Effect) -> None:
        if node.apply.up_to is not None and type(effect) not in rules.GATHER_THROUGH | {ProposalCommitted}:
            self._apply_gathered(node)  # production's driver: any other effect sees the applied state
        if isinstance(effect, Send):
            self._send(node.name, effect.to, effect.message)
        elif isinstance(effect, ProtocolViolation):
            # Every core here is honest: a violation is a check that misjudges honest traffic (lost,
            # duplicated, reordered or late), except a core's messages that reach a membership that
            # no longer has it (removed, or left out by a forced start).
            if not effect.reason.startswith(NOT_A_MEMBER):
                raise self.fail(f"{node.name}: protocol violation by {effect.sender}: {effect.reason}")
        elif isinstance(effect, PersistEntries):
            for entry in effect.entries:
                seen = self.digest_ever_persisted.setdefault(entry.tx_key, entry.digest)
                if seen != entry.digest:
                    raise self.fail(f"two different entries persisted at {entry.tx_key} (prefix consistency)")
            node.log.append(effect.entries, self.now_ms)
            node.tail.add(effect.entries)
            if node.machine is None or node.machine.role is not Role.SEQUENCER:
                # A follower's entries are durable before any of its replies leaves (persist, then send).
                node.durable_key = node.log.last_key()
        elif isinstance(effect, PersistState):
            if effect.state.generation < node.state.generation:
                raise self.fail(f"{node.name} persisted generation {effect.state.generation} < {node.state.generation}")
            node.state = effect.state
        elif isinstance(effect, TruncateLog):
            if effect.after_key < node.applied_key:
                raise self.fail(f"{node.name} truncates after {effect.after_key}, below applied {node.applied_key}")
            self.trace.append((self.now_ms, node.name, "truncate after", effect.after_key))
            node.log.truncate_after(effect.after_key)
            node.durable_key = node.log.last_key()
            for client, outcome in node.waiters.truncated(effect.after_key):
                self._tell(node, outcome, client)
            # Failed guards that observed the removed entries get no answer: their clients retry.
            node.tail.truncated(effect.after_key, CATALOG)
        elif isinstance(effect, Commit):
            # Production's order (core.rules.commit_heard): the writes whose entries commit are told
            # first, then the apply, now or gathered. The history learns the entries as they commit,
            # so that each acknowledgement is checked against it when told.
            following = node.machine is not None and node.machine.role is Role.FOLLOWER
            new, told, up_to = rules.commit_heard(
                node.apply,
                node.waiters,
                node.tail.keys,
                node.tail.entries,
                effect.up_to,
                following,
                lambda: self._applied_waited_on(node),
                self.now_ms,
            )
            for entry in new:
                self._record_committed(node, entry)
            for client, outcome in told:
                self._tell(node, outcome, client)
            if up_to is not None:
                self._apply_up_to(node, up_to)
        elif isinstance(effect, ProposalCommitted):
            # Production answers clients through the waiters (``_tell``); this effect is only checked.
            if effect.request_id is None:
                raise self.fail("a committed proposal without request id")
            if effect.tx_key > node.applied_key or self.committed_request_id.get(effect.tx_key) != effect.request_id:
                raise self.fail(f"{effect.request_id} reported committed at {effect.tx_key} but not committed there")
        elif isinstance(effect, ProposalRejected):
            if effect.sequencer is not None:
                self.client_belief = effect.sequencer
        elif isinstance(effect, SnapshotNeeded):
            self._install_snapshot(node, effect.follower)
        elif isinstance(effect, ProposalFailed):
            self.trace.append((self.now_ms, node.name, "proposal failed", effect.request_id, effect.reason))
            for client, outcome in node.waiters.failed(effect.tx_key, effect.reason):
                self._tell(node, outcome, client)
        elif isinstance(effect, RoleChanged):
            # Production tells the clients of writes forwarded to a sequencer it no longer follows.
            self.trace.append((self.now_ms, node.name, effect))
            for _, outcome in node.forwarded.sequencer_changed(SHARD, effect.sequencer):
                self._client_told(node, outcome)
        else:
            self.trace.append((self.now_ms, node.name, effect))

    def _applied_waited_on(self, node: SimNode) -> bool:
        """Production's rule (``core.rules.applied_waited_on``): a client's write or a held guard waits
        for the apply (the simulator has no queries, changefeeds or reads that wait for a key at a core)."""
        return rules.applied_waited_on(len(node.waiters), node.tail.held_count(), 0, 0)

    def _apply_gathered(self, node: SimNode) -> None:
        up_to = node.apply.take()
        if up_to is not None:
            self._apply_up_to(node, up_to)

    def _apply_up_to(self, node: SimNode, up_to: TxKey) -> None:
        for client, outcome in node.waiters.committed(self._apply(node, up_to)):
            self._tell(node, outcome, client)
        machine = node.machine
        read_index = machine.read_index(self.now_ms) if machine is not None else None
        for (request, row), verdict in node.tail.committed(up_to, CATALOG, read_index):
            if verdict == GUARD_ANSWER:
                self._record_read(node.name, request, row)

    def _record_committed(self, node: SimNode, entry: Entry) -> None:
        """``node`` commits ``entry``: the committed history learns it (the first time any node commits
        its key) or checks it is the same entry."""
        known = self.committed_digest.get(entry.tx_key)
        if known is None:
            if entry.prev != self.committed_last_key:
                raise self.fail(
                    f"{node.name} commits {entry.tx_key} after {entry.prev}, "
                    f"but the committed history ends at {self.committed_last_key}"
                )
            self.committed_digest[entry.tx_key] = entry.digest
            self.committed_request_id[entry.tx_key] = entry.request_id
            self._check_once(entry)
            self.committed_last_key = entry.tx_key
            self._remember_committed(entry)
        elif known != entry.digest:
            raise self.fail(f"{node.name} commits a different entry at {entry.tx_key}")

    def _apply(self, node: SimNode, up_to: TxKey) -> list[Entry]:
        """Apply the committed entries up to ``up_to``; the entries applied."""
        applied: list[Entry] = []
        if up_to <= node.applied_key:
            raise self.fail(f"{node.name} asked to apply up to {up_to}, already applied {node.applied_key}")
        for entry in node.log.entries_after(node.applied_key, len(node.log.entries)):
            if entry.tx_key > up_to:
                break
            if entry.prev != node.applied_key:
                raise self.fail(f"{node.name} applies {entry.tx_key} after {entry.prev} but applied {node.applied_key}")
            self._record_committed(node, entry)  # entries not in the tail at their commit (read back from the log)
            node.applied_key, node.applied_digest = entry.tx_key, entry.digest
            version = cluster_version_of(entry)
            if version is not None:  # recorded with the position, forward only (production's store)
                node.cluster_version = max(node.cluster_version, version)
            applied.append(entry)
        if node.applied_key != up_to:
            raise self.fail(f"{node.name} asked to apply up to {up_to} but its log reaches only {node.applied_key}")
        self.trace.append((self.now_ms, node.name, "applied", up_to))
        return applied

    def _check_once(self, entry: Entry) -> None:
        """A resent request id takes effect once (core.rules: a retry is answered from the log)."""
        request_id = entry.request_id
        if request_id is None:
            return
        first = self.committed_key_of_request.setdefault(request_id, entry.tx_key)
        if first != entry.tx_key and request_id not in self.reproposed_after_trim:
            raise self.fail(f"request {request_id} committed at {first} and again at {entry.tx_key}")

    def _install_snapshot(self, sequencer: SimNode, follower_name: str) -> None:
        follower = self.nodes[follower_name]
        if not self._is_up(follower) or sequencer.machine is None or follower.machine is None:
            return
        if (sequencer.name, follower_name) in self.cut or (follower_name, sequencer.name) in self.cut:
            return  # the offer and the copy travel over the network like any frame
        # Production's offer rule (core.snapshot): the follower takes an offer only from the
        # sequencer it knows, in its generation, beyond its applied key. The copy itself (the
        # driver's job there) is modelled as a consistent copy of the sequencer's applied state.
        self._apply_gathered(follower)  # production's _on_snapshot_offer: the offer meets the applied state
        offer = SnapshotOffer(
            sequencer.name,
            sequencer.machine.generation,
            sequencer.applied_key,
            sequencer.applied_digest,
            sequencer.machine.committed_members,
            sequencer.cluster_version,  # production's: what the sequencer's store recorded as applied
            # Production's: sent only to a follower that reads the field.
            sequencer.machine.status().forced and reads_forced_offer(self._speaks(follower)),
        )
        machine = follower.machine
        refused = accept_offer(
            offer,
            machine.generation,
            machine.sequencer,
            follower.applied_key,
            False,
            self._speaks(follower),
            rows_lost=follower.rows_lost,
        )
        if refused is not None and refused.startswith(UNSPOKEN_CLUSTER_VERSION):
            self._offer_unspoken(follower, sequencer, refused)
            return
        if refused is not None:
            return
        if not self._speaks(follower).speaks(offer.cluster_version):
            raise self.fail(
                f"{follower.name} of release {self._speaks(follower).software} took a snapshot offer at cluster "
                f"version {offer.cluster_version}, which it cannot read"
            )
        if self.installs_abandoned < self.installs_abandoned_max:
            self.abandon_install(follower_name)
            return
        # The driver copies the sequencer's applied tables; the follower's log restarts there.
        for client, outcome in follower.waiters.abandoned("this core installed a snapshot"):
            self._tell(follower, outcome, client)
        follower.log = follower.log.restarted_at(sequencer.applied_key, sequencer.applied_digest)
        follower.applied_key, follower.applied_digest = sequencer.applied_key, sequencer.applied_digest
        follower.rows_lost = False
        # The copied tables are at the offer's cluster version: the driver records it (forward only).
        follower.cluster_version = max(follower.cluster_version, offer.cluster_version)
        # The driver persists the offer's membership with the copied tables (core.snapshot).
        members, forced = state_after_install(offer, follower.state.members, follower.state.forced)
        excluded = exclusion_after_install(offer, follower.name, follower.state.excluded_generation)
        follower.state = dataclasses.replace(
            follower.state, members=members, forced=forced, excluded_generation=excluded
        )
        self.snapshots += 1
        self.trace.append((self.now_ms, follower.name, "installed snapshot at", follower.applied_key))
        self._start(follower)

    def _offer_unspoken(self, follower: SimNode, sequencer: SimNode, refused: str) -> None:
        """``follower`` refused an offer at a cluster version its release does not speak (production
        counts a protocol violation). Every core here is honest: the sequencer's rule should have kept
        the version where all speak it."""
        raise self.fail(f"{follower.name}: snapshot offer by {sequencer.name}: {refused}")

    def abandon_install(self, name: str) -> None:
        """An install ``name`` began is abandoned half way: BeginInstall deleted its rows (persisted),
        its log and position stay (production's ``_execute_install``), and the copy went no further."""
        self.installs_abandoned += 1
        self.nodes[name].rows_lost = True
        self.trace.append((self.now_ms, name, "snapshot install abandoned: rows half copied"))

    def _ask_for_snapshot(self, node: SimNode) -> None:
        """Production's driver (``CoreNode._ask_for_snapshots``): the pure rule decides when to ask."""
        machine = node.machine
        if machine is None:
            return
        if snapshot_request_due(
            node.rows_lost, False, machine.sequencer, node.name, node.snapshot_asked_ms, self.now_ms
        ):
            node.snapshot_asked_ms = self.now_ms
            if machine.sequencer is not None:
                self._send(node.name, machine.sequencer, SNAPSHOT_REQUEST)

    def _remember_committed(self, entry: Entry) -> None:
        self.commit_count += 1
        self.commit_position[entry.tx_key] = self.commit_count
        self.committed_ms.append(self.now_ms)
        for op in entry.ops:
            if isinstance(op, WriteOp) and op.table == READ_TABLE and isinstance(op.row.get("k"), int):
                changed = [(op.row["k"], op.row)]
            elif isinstance(op, DeleteOp) and op.table == READ_TABLE and isinstance(op.key, int):
                changed = [(op.key, None)]
            elif isinstance(op, DropTableOp) and op.table == READ_TABLE:
                changed = [(key, None) for key in self.row_positions]  # every row goes with the table
            else:
                continue
            for key, row in changed:
                self.row_positions[key].append(self.commit_count)
                self.row_values[key].append(row)

    def _row_at(self, key: int, position: int) -> Row:
        """The row ``key`` after the first ``position`` committed entries."""
        index = bisect.bisect_right(self.row_positions[key], position)
        return self.row_values[key][index - 1] if index else None

    # ------------------------------------------------------------ client reads and guards

    def _client_request(self, kind: str | None = None, target: str | None = None, key: int | None = None) -> None:
        if self.read_count >= READS_MAX:
            return
        rng = self.rng
        kind = kind or rng.choice(["linearizable", "linearizable", "guard", "guard", "local"])
        key = rng.randrange(READ_KEYS) if key is None else key
        if target is None:
            target = self.client_belief if rng.random() < 0.8 and self.client_belief else None
            target = target or rng.choice(list(self.nodes))
        self.read_count += 1
        # A compare-and-set expects the row this client saw last (often stale, so guards fail).
        expected = self.last_seen.get(key) if rng.random() < 0.7 else {"k": key, "v": -1}
        request = ClientRequest(kind, key, self.read_count, self.now_ms, self.acknowledged_position, expected)
        self._enqueue_client(target, request)

    def _enqueue_client(self, target: str, request: ClientRequest) -> None:
        self.message_sequence += 1
        deliver_at = self.now_ms + self.rng.randint(1, self.faults.delay_ms_max)
        heapq.heappush(self.network, (deliver_at, self.message_sequence, CLIENT, target, request))

    def _serve_client(self, node: SimNode, request: ClientRequest) -> None:
        """What the production driver does with a read or a guarded transaction (core/node.py)."""
        machine = node.machine
        if machine is None:
            return
        if request.kind == "relay":
            # The sequencer's answer to a write this core forwarded: relayed if the client still waits.
            outcome = request.outcome
            if outcome is not None and node.forwarded.answered(outcome.request_id) is not None:
                self._client_told(node, outcome)
            return
        if request.kind == "write":
            self._write_at(node, request)
            return
        if request.kind == "guard" and node.held:
            # Production's guarded write: the writes held before it are proposed first, and its guard
            # reads what they wrote (the tail) or, once applied, the store.
            self._propose_held(node)
            machine = node.machine
            if machine is None:
                return
        applied_row = self._row_at(request.key, self.commit_position[node.applied_key])
        if request.kind == "local":
            # Production's gate (CoreNode._not_serving_reason): its installs are one step here, so
            # they say nothing; half-copied rows, a forced start that left it out or a log it cannot
            # follow answer not_ready (the client retries).
            excluded = machine.excluded_generation
            served = rules.not_serving_reason(None, node.rows_lost, machine.stuck_reason, node.applied_key, excluded)
            if served is None:
                self._record_local_read(node, request, applied_row)
            return
        # Production's read fence (core.rules.fence_read): forwarded once to the sequencer this node
        # knows; answered there only while ShardConsensus.read_index allows; otherwise refused
        # (the client retries). A guarded write takes the same way to the sequencer.
        read_index = machine.read_index(self.now_ms)
        view = rules.ShardView(SHARD, machine.role is Role.SEQUENCER, machine.sequencer)
        try:
            fence = rules.fence_read(view, node.name, request.forwarded, read_index)
        except RequestError:
            fence = None
        if isinstance(fence, rules.Forward):
            self._enqueue_client(fence.target, dataclasses.replace(request, forwarded=True))
            return
        if machine.role is not Role.SEQUENCER:
            return
        if request.kind == "linearizable":
            if fence is not None:
                self._record_read(node.name, request, applied_row)
            return
        if request.kind == "read_index":
            if fence is not None:
                if rules.read_index_feeds_lazy_followers(request.kind, request.forwarded):
                    self._step(node, FeedRequested())
                self._read_index_answered(request, fence)
            return
        # Production's transaction rules (core.transaction), the guard read through the unapplied tail
        # first, as core/node.py ``_write`` reads it.
        request_body = typed_body(
            "transact",
            {
                "guards": [{"table": READ_TABLE, "key": request.key, "equals": request.expected}],
                "ops": [{"op": "write", "table": READ_TABLE, "row": {"k": request.key, "v": 100_000 + request.number}}],
            },
        )
        transaction = parse_transaction(request_body, CATALOG, TRANSACTION_OPS_MAX)
        if node.tail.held_count() and node.tail.resent(
            lambda held: held[0].number == request.number, lambda held: held
        ):
            return  # production's _resent_held_failure: its held failure answers it (guard_tail rule 3)

        def read_row(table: TableSchema, key: Any) -> Row:
            row = node.tail.read(table.name, key, lambda: applied_row)
            # The rows here hold the key and v only: a column added through the log (the replicant
            # scenarios' AddColumnOp) is null in each, which the tail says (core.guard_tail) and the
            # committed history, written with writes of k and v, does not.
            if row is None:
                return None
            return {column: value for column, value in row.items() if column in ("k", "v") or value is not None}

        outcome = evaluate(transaction, CATALOG, read_row)
        if not isinstance(outcome, GuardFailed):
            if self.write_count < WRITES_MAX:
                self.write_count += 1
                self._propose(node, outcome, f"c{request.number}")
            return
        row = outcome.actual
        verdict = node.tail.failed((request, row), machine.committed_key, read_index, self.now_ms)
        if verdict == GUARD_ANSWER:
            self._record_read(node.name, request, row)

    def _read_index_answered(self, request: ClientRequest, read_index: TxKey) -> None:
        """The sequencer told a replicant the key its linearizable read must wait for (a hook)."""
        raise self.fail(f"read_index answered for {request} without replicants")

    def _record_local_read(self, node: SimNode, request: ClientRequest, applied_row: Row) -> None:
        """A local read answers from the node's rows, which hold its applied state, except after an
        abandoned install: that deleted them and copied none (``abandon_install``)."""
        row = None if node.rows_lost else applied_row
        if row != applied_row:
            raise self.fail(
                f"local read of key {request.key} at {node.name} returned {row}, but it applied {applied_row} "
                f"by {node.applied_key}: its rows are half copied by an abandoned snapshot install"
            )
        self._record_read(node.name, request, row)

    def _local_read_lag_ms_max(self) -> int | None:
        """How long after an entry commits every core that answers local reads reflects it (a hook;
        None: no bound, as under faults: a partition or a pause holds a correct core back as long as
        it lasts, and a local read promises only some committed prefix)."""
        return None

    def _lag_ms_without_faults(self) -> int:
        """The bound of ``_local_read_lag_ms_max`` for a scenario with no fault and writes far enough
        apart that none waits behind another: an entry committed at t reaches a follower that can
        follow by t + 3 delays (its append may wait for one in flight, answered within a round trip,
        then travels), and so does the commit key (in that append, or in a commit notice sent within
        a heartbeat interval); it applies within its gathering delay, and each step of the driver
        takes up to a tick."""
        return (
            self.config.heartbeat_interval_ms
            + 3 * self.faults.delay_ms_max
            + self.follower_apply_delay_ms
            + 3 * self.tick_ms
        )

    def _record_read(self, where: str, request: ClientRequest, row: Row) -> None:
        """Check an answer against the committed history (see the theory of operation)."""
        key = request.key
        floor = 0
        since = "acknowledged writes and earlier reads"
        if request.kind != "local":
            floor = request.acknowledged_position
            for answered_ms, position in self.answered_prefixes[key]:
                if answered_ms < request.started_ms:
                    floor = max(floor, position)
        elif (lag_ms := self._local_read_lag_ms_max()) is not None:
            # Staleness: what committed more than the bound before the read began must show.
            floor = bisect.bisect_right(self.committed_ms, request.started_ms - lag_ms)
            since = f"committed by t={request.started_ms - lag_ms}: local reads lag at most {lag_ms} ms"
        position = next((p for p in range(floor, self.commit_count + 1) if self._row_at(key, p) == row), None)
        what = {"guard": "failed guard", "read_index": "replicant linearizable read"}.get(
            request.kind, f"{request.kind} read"
        )
        self.trace.append((self.now_ms, where, what, key, row, "floor", floor))
        if position is None:
            raise self.fail(
                f"{what} of key {key} at {where} (began t={request.started_ms}) returned {row}, "
                f"which no committed prefix from position {floor} ({since}) "
                f"to {self.commit_count} (committed when it answered) holds"
            )
        self.local_reads_answered[where] += request.kind == "local"
        if request.kind == "guard":
            self._guard_answered(f"c{request.number}", f"guard failed at {where} (row {row})")
        if request.kind != "local":
            self.answered_prefixes[key].append((self.now_ms, position))
            self.reads_checked += request.kind in ("linearizable", "read_index")
            self.guard_failures_checked += request.kind == "guard"
        self.last_seen[key] = row

    # ------------------------------------------------------------ checks

    def _check_node(self, node: SimNode) -> None:
        machine = node.machine
        if machine is not None and machine.role is Role.SEQUENCER:
            holder = self.sequencer_of_generation.setdefault(machine.generation, node.name)
            if holder != node.name:
                raise self.fail(f"two sequencers in generation {machine.generation}: {holder} and {node.name}")
        # Committed entries never change or disappear: the digest chain makes one comparison enough.
        if node.log.digest_at(node.applied_key) != node.applied_digest:
            raise self.fail(f"{node.name} lost or changed its applied entry {node.applied_key}")
        if node.applied_key != ZERO_KEY and self.committed_digest.get(node.applied_key) != node.applied_digest:
            raise self.fail(f"{node.name} applied {node.applied_key} outside the committed history")
        # Applied up to the commit key, or gathered exactly up to it (FollowerApply), never beyond.
        reached = node.apply.up_to or node.applied_key
        if machine is not None and machine.committed_key != reached:
            applied, gathered = node.applied_key, node.apply.up_to
            raise self.fail(
                f"{node.name} machine commit {machine.committed_key} != applied {applied} (gathered {gathered})"
            )
        if node.apply.up_to is not None and node.apply.up_to <= node.applied_key:
            raise self.fail(f"{node.name} gathered {node.apply.up_to}, already applied {node.applied_key}")

    # ------------------------------------------------------------ network

    def _send(self, sender: str, to: str, message: PeerMessage | str) -> None:
        # A snapshot request is a frame of its own kind (``snapshot_request``), not a consensus message.
        frame = message if message == SNAPSHOT_REQUEST else msgpack.packb(message_to_wire(message), use_bin_type=True)
        faults = self.faults
        if self.rng.random() < faults.drop_probability:
            return
        copies = 2 if self.rng.random() < faults.duplicate_probability else 1
        for _ in range(copies):
            self.message_sequence += 1
            deliver_at = self.now_ms + self.rng.randint(1, faults.delay_ms_max)
            heapq.heappush(self.network, (deliver_at, self.message_sequence, sender, to, frame))

    def _deliver_due(self) -> None:
        postponed = []
        while self.network and self.network[0][0] <= self.now_ms:
            deliver_at, sequence, sender, to, frame = heapq.heappop(self.network)
            node = self.nodes[to]
            if node.machine is None or (sender, to) in self.cut:
                continue
            if node.paused_until_ms > self.now_ms:
                postponed.append((node.paused_until_ms, sequence, sender, to, frame))
                continue
            if sender == CLIENT:
                self._serve_client(node, frame)
                continue
            if frame == SNAPSHOT_REQUEST:  # production's CoreNode._on_snapshot_request
                self._step(node, SnapshotRequested(sender))
                continue
            message = message_from_wire(frame)  # the packed bytes, as a node decodes them
            self._step(node, MessageReceived(sender, message))
        for item in postponed:
            heapq.heappush(self.network, item)

    # ------------------------------------------------------------ faults and clients

    def _inject_faults(self) -> None:
        rng, faults = self.rng, self.faults
        names = list(self.nodes)
        if rng.random() < faults.partition_probability:
            self.cut = set()
            kind = rng.choice(["isolate", "split", "one-way"])
            if kind == "one-way":
                a, b = rng.sample(names, 2)
                self.cut.add((a, b))
            else:
                group = {rng.choice(names)} if kind == "isolate" else set(rng.sample(names, len(names) // 2))
                self.cut = {(a, b) for a in names for b in names if (a in group) != (b in group)}
            self.trace.append((self.now_ms, "partition", kind, sorted(self.cut)))
        elif self.cut and rng.random() < faults.heal_probability:
            self.cut = set()
            self.trace.append((self.now_ms, "healed"))
        if rng.random() < faults.crash_probability:
            node = self.nodes[rng.choice(names)]
            if node.machine is not None:
                if rng.random() < 0.5:
                    node.crash_in_next_step = True
                else:
                    self._crash(node)
        if rng.random() < faults.pause_probability:
            node = self.nodes[rng.choice(names)]
            if self._is_up(node):
                node.paused_until_ms = self.now_ms + rng.randint(100, 900)
                self.pauses += 1
                self.trace.append((self.now_ms, node.name, "paused until", node.paused_until_ms))

    def lose_disk(self, name: str) -> None:
        """``name`` crashes and its disk is replaced by an empty one (its log, votes and rows are gone);
        it restarts at the next step on an empty database, recovering first (``_recover``)."""
        node = self.nodes[name]
        if node.machine is not None:
            self._crash(node)
        node.log = MemoryLog()
        node.applied_key, node.applied_digest = ZERO_KEY, GENESIS_DIGEST
        node.durable_key, node.rows_lost = ZERO_KEY, False
        node.cluster_version = 1  # an empty store's
        node.state = PersistedState(0, None, node.state.members)
        node.disk_lost = True
        node.down_until_ms = self.now_ms
        self.disks_lost += 1
        self.trace.append((self.now_ms, name, "lost its disk"))

    def _recover(self, node: SimNode) -> bool:
        """Production's ``CoreNode.recover_generations`` on the journals of the cores ``node`` reaches
        now, with ``core.recovery``'s rules; False while too few answered (it asks again later)."""
        answers = {}
        for other in self.nodes.values():
            machine = other.machine
            if other.name == node.name or machine is None or not self._is_up(other):
                continue
            if (node.name, other.name) in self.cut or (other.name, node.name) in self.cut:
                continue
            age = machine.journal_age()
            shard = {"generation": age.generation, "committed": list(age.committed_key), "last": list(age.last_key)}
            answers[other.name] = {"shards": {SHARD: {**shard, "members": list(machine.members)}}}
        _, cluster = recovered_members(answers)
        members = cluster or node.state.members
        # The operator's part (docs: Membership): a rebuilt core is started with initial_cluster_state
        # "existing", so it waits for every other member even when those it reaches never saw an
        # election (a core cannot tell that from a new cluster by itself).
        if recovery_shortfall(answers, members, node.name, existing=self.rebuilt_cores_declared_existing):
            node.down_until_ms = self.now_ms + RECOVERY_RETRY_MS
            self.trace.append((self.now_ms, node.name, "recovery heard too few cores", sorted(answers)))
            return False
        generation = recovered_generations(answers).get(SHARD, 0)
        if generation > 0:
            floor = recovered_vote_floors(answers).get(SHARD, ZERO_KEY)
            node.state = PersistedState(generation, node.name, members, vote_floor=floor)
            self.trace.append((self.now_ms, node.name, "recovered generation", generation, "vote floor", floor))
        node.disk_lost = False
        return True

    def _restart_due(self) -> None:
        for node in self.nodes.values():
            if node.machine is None and node.down_until_ms <= self.now_ms and node.name not in self.lost_for_good:
                if node.disk_lost and not self._recover(node):
                    continue
                self._start(node)
                self.trace.append((self.now_ms, node.name, "restarted at generation", node.state.generation))

    def _client_write(self, target: str | None = None) -> None:
        if self.write_count >= WRITES_MAX:
            return
        if target is None:
            target = self.client_belief if self.rng.random() < 0.8 and self.client_belief else None
            target = target or self.rng.choice(list(self.nodes))
        node = self.nodes[target]
        if not self._is_up(node):
            self.client_belief = None
            return
        self.write_count += 1
        request = ClientRequest(
            "write", 0, self.write_count, self.now_ms, self.acknowledged_position, ops=self._write_ops(self.write_count)
        )
        self.unanswered[f"w{request.number}"] = (request, self.now_ms + CLIENT_RETRY_MS, 0)
        self._write_at(node, request)

    def _resend_due(self) -> None:
        """Clients resend unanswered writes with the same request id, to the core they believe leads."""
        for request_id, (request, resend_ms, resends) in list(self.unanswered.items()):
            if resend_ms > self.now_ms:
                continue
            if resends >= CLIENT_RETRIES_MAX:
                del self.unanswered[request_id]  # the client gives up: outcome unknown to its caller
                continue
            self.unanswered[request_id] = (request, self.now_ms + CLIENT_RETRY_MS, resends + 1)
            target = self.client_belief or self.rng.choice(list(self.nodes))
            node = self.nodes[target]
            if self._is_up(node):
                self.resends += 1
                self.trace.append((self.now_ms, target, "client resends", request_id))
                self._write_at(node, dataclasses.replace(request, started_ms=self.now_ms))
            else:
                self.client_belief = None

    def _write_at(self, node: SimNode, request: ClientRequest) -> None:
        """A write reaches ``node``: production's rule-book (``core.rules.route_write``) answers a
        resent request id from the log, proposes a new one at the sequencer, forwards it once to the
        sequencer this core knows, or refuses it (the client retries)."""
        machine = node.machine
        if machine is None:
            return
        request_id = f"w{request.number}"
        client = request.origin or CLIENT
        if node.held.holds(request_id):
            self._propose_held(node)  # production: a resend of a held write is answered from the log
            machine = node.machine
            if machine is None:
                return
        view = rules.ShardView(SHARD, machine.role is Role.SEQUENCER, machine.sequencer)
        try:
            route = rules.route_write(view, node.name, request.origin is not None, node.log.find_request(request_id))
        except RequestError:
            if request.origin is None:
                self.client_belief = None  # no_sequencer: the client tries another core next time
            return  # a forwarded write is not forwarded again; its origin's wait expires
        if isinstance(route, rules.Propose):
            self._propose(node, request.ops, request_id, client, held=True)
        elif isinstance(route, rules.AwaitCommit):
            answer = node.waiters.answer_now(route.tx_key, request_id, node.applied_key, route.duplicate)
            if answer is not None:
                self._tell(node, answer, client)
            else:
                node.waiters.wait(route.tx_key, request_id, client, route.duplicate)
        elif not node.forwarded.full():  # full: overloaded, the client retries
            for _, outcome in node.forwarded.forwarded(request_id, CLIENT, SHARD, route.target, self.now_ms):
                self._client_told(node, outcome)
            self._enqueue_client(route.target, dataclasses.replace(request, origin=node.name, forwarded=True))

    def _write_ops(self, number: int) -> tuple[Op, ...]:
        """The ops of client write ``number`` (a hook: the replicant simulation writes richer ones)."""
        return (WriteOp(READ_TABLE, {"k": number % READ_KEYS, "v": number}),)

    def _end_batches(self) -> None:
        """The production driver's end of a loop turn: the writes proposed since go out together
        (before they are durable here), then the turn's commit makes them durable (Persisted)."""
        for node in self.nodes.values():
            if not self._is_up(node) or node.machine is None or node.machine.role is not Role.SEQUENCER:
                continue
            # The commit of the previous turn is done: what the log held then is durable now. The
            # fsync takes a tick, so the appends of a turn are out (and may be answered) before it.
            if node.persisting_key is not None and node.persisting_key > node.durable_key:
                node.durable_key = node.persisting_key
                self._step(node, Persisted())
            if node.machine is not None:
                self._step(node, BatchEnded())
                node.persisting_key = node.log.last_key()

    def _expire_forwarded(self) -> None:
        for node in self.nodes.values():
            if self._is_up(node):
                for _, outcome in node.forwarded.expired(self.now_ms):
                    self._client_told(node, outcome)

    def _tick_all(self) -> None:
        for node in self.nodes.values():
            if self._is_up(node):
                if node.rows_lost:
                    self._ask_for_snapshot(node)  # and its machine is not ticked: it does not campaign
                else:
                    self._step(node, Ticked())
                if node.machine is not None and node.machine.next_deadline_ms() <= self.now_ms and not node.rows_lost:
                    # The driver polls until the earliest deadline: one a tick left in the past spins it.
                    raise self.fail(f"{node.name}'s next deadline stays passed after a tick")
                if node.machine is not None and node.apply.up_to is not None:  # production's _apply_due
                    up_to = node.apply.due(self.now_ms, self._applied_waited_on(node))
                    if up_to is not None:
                        self.applies_gathered += 1
                        self._apply_up_to(node, up_to)
                    elif self.now_ms - node.apply.since_ms >= self.follower_apply_delay_ms:
                        raise self.fail(f"{node.name} holds commits gathered at t={node.apply.since_ms} past the delay")
                # Held failed guards whose tail is stuck: the driver tells them to retry.
                node.tail.expired(self.now_ms)

    def _advance(self) -> None:
        self._resend_due()
        self._deliver_due()
        self._end_batches()
        self._resend_held_guards()
        self._tick_all()
        self._expire_forwarded()
        self._retain_due()
        self.now_ms += self.tick_ms

    def _retain_due(self) -> None:
        """What a core's retention timer does (core/node.py ``_maybe_trim``), with production's rule."""
        faults = self.faults
        for node in self.nodes.values():
            machine = node.machine
            if not self._is_up(node) or machine is None or self.now_ms < node.next_retention_ms:
                continue
            node.next_retention_ms = self.now_ms + RETENTION_INTERVAL_MS
            age_ms_max = faults.retention_age_ms_max
            floor = retention.retention_floor(
                node.log,
                faults.retention_entries_max,
                self.now_ms - age_ms_max if age_ms_max else None,
                node.applied_key,
                retention.keep_from_match_keys(key for _, key in machine.status().follower_match_keys),
            )
            if floor is not None:
                self.trace.append((self.now_ms, node.name, "trimmed through", floor))
                before = len(node.log.keys)
                node.log.trim_to(floor)
                self.entries_trimmed += before - len(node.log.keys)
                # Retention's turn ends with a durable commit, after which the driver tells a
                # sequencer Persisted: a later crash never reverts applied entries below the trim.
                node.durable_key = node.log.last_key()
                if machine.role is Role.SEQUENCER:
                    self._step(node, Persisted())
                self._check_node(node)

    # ------------------------------------------------------------ the run

    def _quiet_sequencer(self) -> SimNode | None:
        """The sequencer if every node is up, agrees on it, and has applied everything it has."""
        sequencers = [n for n in self.nodes.values() if n.machine is not None and n.machine.role is Role.SEQUENCER]
        if len(sequencers) != 1:
            return None
        sequencer = sequencers[0]
        machine = sequencer.machine
        if machine is None or machine.committed_key != machine.last_key:
            return None
        for node in self._members_of(machine):
            if node.machine is None or node.machine.generation != machine.generation:
                return None
            if node.applied_key != machine.committed_key or node.log.last_key() != machine.last_key:
                return None
            if node.rows_lost:
                return None  # it serves no read until an install heals it
        return sequencer

    def _members_of(self, machine: ShardConsensus) -> list[SimNode]:
        return [self.nodes[name] for name in machine.members]

    def lose_for_good(self, names: list[str]) -> None:
        """These nodes (and their disks) are gone: they never restart."""
        for name in names:
            self.lost_for_good.add(name)
            self.nodes[name].machine = None
            self.trace.append((self.now_ms, name, "lost for good"))

    def reached_by(self, name: str) -> tuple[tuple[str, int], ...]:
        """What a force-start probe from ``name`` gets: every other core that is up, not paused and
        connected both ways, with its generation (the network model, not a protocol rule)."""
        return tuple(
            (other.name, other.machine.generation)
            for other in self.nodes.values()
            if other.name != name
            and self._is_up(other)
            and other.machine is not None
            and (name, other.name) not in self.cut
            and (other.name, name) not in self.cut
        )

    def force_start(self, name: str) -> list[Effect]:
        """The operator force-starts ``name``; its machine decides (and may refuse). Returns its effects."""
        node = self.nodes[name]
        if node.machine is None:
            raise self.fail(f"force start at crashed node {name}")
        reached = self.reached_by(name)
        # What each reached core's journal answer says of its log (production: ``reached_last_keys``).
        last_keys = tuple((other, self.nodes[other].machine.last_key) for other, _ in reached)
        self.trace.append((self.now_ms, name, "force start requested, reached", reached, last_keys))
        request = ForceStartRequested(reached, last_keys, rows_lost=node.rows_lost)
        effects = node.machine.step(request, self.now_ms)
        for effect in effects:
            self._execute(node, effect)
        self._check_node(node)
        return effects

    def write(self, target: str) -> None:
        self._client_write(target)

    def read(self, target: str, key: int, kind: str = "linearizable") -> None:
        """A client sends a read (or a compare-and-set) of ``key`` to ``target``."""
        self._client_request(kind, target, key)

    def advance(self) -> None:
        self._advance()

    def run_until_quiet(self, limit_ms: int = 20_000) -> SimNode:
        return self._run_until_quiet(limit_ms)

    def _run_until_quiet(self, limit_ms: int) -> SimNode:
        # Quiet means: the same sequencer, everyone caught up, for longer than any election timeout
        # (a sequencer that looks quiet may be about to fence itself after a long pause).
        deadline = self.now_ms + limit_ms
        quiet_since: tuple[int, str, int] | None = None
        while self.now_ms < deadline:
            self._restart_due()
            self._advance()
            sequencer = self._quiet_sequencer()
            if sequencer is None or sequencer.machine is None:
                quiet_since = None
                continue
            current = (sequencer.machine.generation, sequencer.name)
            if quiet_since is None or quiet_since[1:] != current:
                quiet_since = (self.now_ms, *current)
            elif self.now_ms - quiet_since[0] > self.config.election_timeout_ms_max:
                return sequencer
        lost = [name for name, node in self.nodes.items() if node.rows_lost]
        if lost:
            raise self.fail(
                f"the healed cluster did not converge within {limit_ms} ms: the rows of {', '.join(lost)} are "
                "still half copied by an abandoned snapshot install (no read served)"
            )
        raise self.fail(f"the healed cluster did not converge within {limit_ms} ms")

    def run(self) -> SimulationResult:
        while self.now_ms < self.faulty_ms:
            self._inject_faults()
            self._restart_due()
            if self.rng.random() < self.faults.write_probability:
                self._client_write()
            if self.rng.random() < self.faults.read_probability:
                self._client_request()
            self._advance()
        self._heal()
        sequencer = self._run_until_quiet(20_000)
        # Liveness after healing: new writes are acknowledged.
        before = len(self.acknowledged)
        for _ in range(3):
            self._client_write(sequencer.name)
            self._client_request("linearizable", sequencer.name)
        sequencer = self._run_until_quiet(20_000)
        if len(self.acknowledged) < before + 3 and self.write_count < WRITES_MAX:
            raise self.fail("writes at the healed sequencer were not acknowledged")
        self.final_check(sequencer)
        return SimulationResult(
            seed=self.seed,
            core_count=self.core_count,
            committed_entries=len(self.committed_digest),
            acknowledged_writes=len(self.acknowledged),
            elections=len(self.sequencer_of_generation),
            crashes=self.crashes,
            pauses=self.pauses,
            snapshots=self.snapshots,
            final_time_ms=self.now_ms,
            reads_checked=self.reads_checked,
            guard_failures_checked=self.guard_failures_checked,
            entries_trimmed=self.entries_trimmed,
            guard_resends=len(self.guards_resent),
            guard_resends_answered=self.guard_resends_answered,
        )

    def _heal(self) -> None:
        """No more faults, everyone up and resumed (a hook: subclasses heal what they add)."""
        self.cut = set()
        for node in self.nodes.values():
            node.crash_in_next_step = False
            node.paused_until_ms = min(node.paused_until_ms, self.now_ms)
            node.down_until_ms = min(node.down_until_ms, self.now_ms)
        # Faults and load stop. Retention is not a fault, and this is deliberate: from here on it keeps
        # one entry (``retention_floor`` keeps at least one) and no age bound, so the quiet phase trims
        # as far as the rule allows (a core that lags then needs a snapshot offer). A scenario that
        # needs the log kept sets retention again after healing.
        self.faults = _Faults(
            drop_probability=0.0,
            duplicate_probability=0.0,
            delay_ms_max=self.faults.delay_ms_max,
            partition_probability=0.0,
            heal_probability=0.0,
            crash_probability=0.0,
            pause_probability=0.0,
            retention_entries_max=0,
            retention_age_ms_max=0,
            write_probability=0.0,
        )

    def final_check(self, sequencer: SimNode) -> None:
        if sequencer.machine is None:
            raise self.fail(f"{sequencer.name} is not running")
        members = self._members_of(sequencer.machine)
        commit_key = sequencer.applied_key
        for node in members:
            if node.rows_lost:
                raise self.fail(
                    f"{node.name}'s rows are still half copied by an abandoned snapshot install: it serves no read"
                )
            if node.applied_key != commit_key or node.applied_digest != sequencer.applied_digest:
                raise self.fail(f"{node.name} applied {node.applied_key}, the sequencer {commit_key}")
            if node.log.digest_at(commit_key) != sequencer.applied_digest:
                raise self.fail(f"{node.name} log differs at the commit key {commit_key}")
        # Every acknowledged write is in the (single) committed history every node applied.
        for request_id, key in self.acknowledged.items():
            if key > commit_key or self.committed_request_id.get(key) != request_id:
                raise self.fail(f"acknowledged write {request_id} at {key} is missing")
            for node in members:
                entry = node.log.entry_at(key)
                if entry is not None and entry.request_id != request_id:
                    raise self.fail(f"{node.name} holds another entry than {request_id} at {key}")


class GatheringSimulation(Simulation):
    """The core simulation whose followers gather commits at production's default delay."""

    follower_apply_delay_ms = Limits().follower_apply_delay_ms_max


def run_seed(seed: int, core_count: int | None = None, faulty_ms: int = 3000) -> SimulationResult:
    """Run one seed; 3 cores for even seeds and 5 for odd ones unless ``core_count`` is given."""
    if core_count is None:
        core_count = 3 if seed % 2 == 0 else 5
    return Simulation(seed, core_count, faulty_ms).run()
