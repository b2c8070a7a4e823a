"""The core simulation (``cluster.py``) plus replicants: agents on the cores, replicas on the replicants.

Theory of operation
-------------------
``ReplicantSimulation`` extends ``Simulation``: the cores run the same consensus machines, and the
simulator also plays the drivers of the replication protocol, from the same ``random.Random(seed)``.

* Cores. Besides their log, cores keep applied tables (updated at every ``Commit``, copied with a
  snapshot). Their agent server answers journal probes (committed key, whether the core hears the
  sequencer, live agents), refuses a watch of another protocol version or from beyond its committed
  key, resumes when its log holds ``from_key`` with ``from_digest`` (``LogView.digest_at``) and
  bootstraps otherwise, with K0 = its committed key. It answers table batches with *dirty reads* of
  its current tables, which may be ahead of K0: the replay must heal that. Watches, agents and their
  pushes are production's ``core.agent_server.AgentServer`` (one per core, built again when the core
  restarts or installs a snapshot): the watch rules, supersession, the memory budget and the push
  frames are its own. Every replication message travels as a frame of the real codec
  (``rlog.messages``): a replicant's requests (``journal``, ``watch``, ``list_tables``,
  ``bootstrap_batch``, ``read_index``) and ``push_ack``, the cores' replies and pushes. Answers are
  matched by request id and read with production's parsers of untrusted answers (``watch_accepted``,
  ``journal_answer``, ``tables_from_answer``, ``batch_from_answer``, ``messages.ReadIndexAnswer``);
  pushes become replica events through ``replicant.replica.push_received``. Pushes of superseded
  agents still in flight are the zombies the replicas must fence.
* Replicants run one ``replicant.replica.ShardReplica``; what they persist (applied key and digest,
  tables, spill, counters) survives a crash, the state machine does not. A crash may hit in the
  middle of a step's effects.
* Network. Replication messages share the faults of the core network (loss, duplication, delays
  that reorder) plus their own partitions between replicants and cores; requests to a core that is
  down fail at once. After healing, replication links deliver in order (as a TCP connection would).
* Client writes update and delete a small key space of two tables, so that dirty reads differ
  from K0 and the replay has something to heal.
* Client linearizable reads at replicants take production's path: the replicant learns the
  committed key from the sequencer (``ShardConsensus.read_index``, through the simulated network),
  waits until it has applied that key in NORMAL mode, and answers; the base simulation checks the
  answer against the committed history (the row at the replicant's applied key).

Checks after every replicant step: the applied key never decreases and every applied entry's
``prev`` is the previous applied key (spill replay included); the digest at the applied key is the
cores' committed digest there; an applied push came from the agent whose watch the replica accepted
last; the machine and its persisted state agree. Agents are checked to push only committed entries
and to keep their window. At the end, after healing and running until quiet, every replica is
NORMAL at the cores' commit key with the sequencer's tables.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from mnesite.bootstrap.copy import CopyFailed, batch_from_answer, tables_from_answer
from mnesite.bootstrap.serve import read_batch
from mnesite.core import rules
from mnesite.core.agent import AgentConfig
from mnesite.core.agent_server import AgentServer
from mnesite.core.consensus import Commit, Effect, Role
from mnesite.core.watch import WatchRefusedError
from mnesite.replicant.reads import ReadIndexGather, WaitingReads
from mnesite.replicant.replica import ReplicaConfig, ShardReplica, ack_body, push_received, watch_accepted
from mnesite.replicant.upstream import write_target
from mnesite.rlog import messages, types
from mnesite.rlog import replication as p
from mnesite.rlog.config import Limits
from mnesite.rlog.errors import OverloadedError, RequestError
from mnesite.rlog.schema import TableSchema, define_table
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ZERO_KEY,
    AddColumnOp,
    CreateIndexOp,
    DeleteOp,
    DropIndexOp,
    DropTableOp,
    Entry,
    Op,
    TxKey,
    WriteOp,
    WriteRows,
)

from tests.sim.cluster import READ_KEYS, READ_TABLE, SHARD, ClientRequest, SimNode, Simulation
from tests.sim.cluster import replay_command as cluster_replay_command

TABLES = ("t", "u")
KEY_COLUMN = "k"
KEYS_PER_TABLE = 12
# Now and then a transaction is a table drop (the simulated tables are emptied, like a drop and re-create).
DROP_TABLE_PROBABILITY = 0.03
# Index and column changes ride the log like table drops (their digests must agree everywhere).
SCHEMA_CHANGE_PROBABILITY = 0.03
# A bootstrap batch's byte bound (production: frame_bytes_max / 2): small, so that it cuts batches too.
BATCH_BYTES_MAX = 200
CONVERGENCE_MS_MAX = 30_000
# A replicant's linearizable read waits at most this long for its applied key (production: READ_WAIT_MS_MAX).
READ_WAIT_MS_MAX = 2000
WAITING_READS_MAX = 64
WATCHES_MAX = 8  # per core (production: [limits] watches_max)
# What a replicant asks a core, and what for (production: replicant/node.py ``Pending.purpose``).
REQUEST_KINDS = {"journal": "probe", "watch": "watch", "list_tables": "tables", "bootstrap_batch": "batch"}
REQUEST_KINDS["read_index"] = "fence"
PENDING_MAX = 1000  # request ids a simulated replicant remembers
FRAME_BYTES_MAX = Limits.frame_bytes_max


def replay_command(seed: int) -> str:
    return cluster_replay_command(seed, "tests/test_replicant_simulation.py")


Tables = dict[str, dict[Any, dict[str, Any]]]


class _TablesView:
    """The store interface ``bootstrap.serve.read_batch`` reads, over a simulated core's tables."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables

    def count_rows(self, table: TableSchema, limit: int | None = None) -> int:
        rows = len(self.tables.get(table.name, {}))
        return rows if limit is None else min(rows, limit)

    def scan(self, table: TableSchema, after: Any, limit: int) -> list[dict[str, Any]]:
        rows = self.tables.get(table.name, {})
        keys = sorted(key for key in rows if after is None or key > after)
        return [dict(rows[key]) for key in keys[:limit]]


def empty_tables() -> Tables:
    return {table: {} for table in TABLES}


def apply_ops(tables: Tables, entry: Entry) -> None:
    for op in entry.ops:
        if isinstance(op, WriteOp):
            tables.setdefault(op.table, {})[op.row[KEY_COLUMN]] = dict(op.row)
        elif isinstance(op, DeleteOp):
            tables.setdefault(op.table, {}).pop(op.key, None)
        elif isinstance(op, WriteRows):  # a run of one table's rows, as a replicant decodes a push
            for row in map(dict, map(zip, itertools.repeat(op.columns), op.rows)):
                tables.setdefault(op.table, {})[row[KEY_COLUMN]] = row
        elif isinstance(op, DropTableOp):
            tables[op.table] = {}  # the simulated tables come back empty at their next write
        elif not isinstance(op, types.SCHEMA_OPS + (types.MembersOp, types.ClusterVersionOp)):
            raise AssertionError(f"the simulated tables cannot apply {type(op).__name__}")  # a new kind: model it


@dataclass
class SimReplicant:
    name: str
    # Persisted.
    applied_key: TxKey = ZERO_KEY
    applied_digest: bytes = GENESIS_DIGEST
    tables: Tables = field(default_factory=empty_tables)
    spill: list[Entry] = field(default_factory=list)
    bootstraps: int = 0
    resumes: int = 0
    read_fenced: bool = False
    # Process state.
    machine: ShardReplica | None = None
    down_until_ms: int = 0
    crash_in_next_step: bool = False
    probe_answers: dict[str, p.JournalAnswer | None] | None = None
    probe_deadline_ms: int = 0
    # Requests sent: request id -> (purpose, detail), as production's driver keeps them (lost in a crash).
    pending: dict[str, tuple[str, Any]] = field(default_factory=dict)
    requests_sent: int = 0
    # Checker state: the agent of the last watch this replica accepted, and the highest applied key.
    accepted: tuple[str, str] | None = None
    applied_key_max: TxKey = ZERO_KEY


@dataclass
class ReplicantSimulationResult:
    seed: int
    core_count: int
    replicant_count: int
    committed_entries: int
    bootstraps: int
    resumes: int
    entries_applied: int
    rows_copied: int
    pushes_rejected: int
    replicant_crashes: int
    runs_pushed: int
    final_time_ms: int


class ReplicantSimulation(Simulation):
    # The cores' applied state is at cluster version 2, so they pack a write of two or more rows of one
    # table as one run: pushes carry runs through the real codec, and replicants decode and apply them
    # as production's do.
    initial_cluster_version = 2

    def __init__(
        self,
        seed: int,
        core_count: int,
        replicant_count: int,
        faulty_ms: int = 3000,
        tick_ms: int = 10,
        replica_class: type[ShardReplica] = ShardReplica,
    ) -> None:
        # Set before the base constructor, which starts the cores.
        self.runs_pushed = 0  # entries pushed whose rows are packed as one run (checked: the CI seeds push some)
        # Each core's agent server (production's adapter: watches, agents, push frames).
        self.agent_servers: dict[str, AgentServer] = {}
        self.core_tables: dict[str, Tables] = {}
        super().__init__(seed, core_count, faulty_ms, tick_ms)
        rng = self.rng
        self.replica_class = replica_class
        self.replica_config = ReplicaConfig(
            failure_timeout_ms=400,
            probe_timeout_ms=60,
            retry_interval_ms=50,
            batch_rows_max=rng.choice([1, 3, 50]),
            spill_entries_max=rng.choice([2, 8, 1000]),
            # Drawn apart from the run's random stream, so that every seed's scenario stays the same.
            spill_bytes_max=random.Random(seed).choice([300, 3000, 1 << 30]),
            bootstrap_attempts_max=3,
        )
        self.agent_config = AgentConfig(
            window_entries_max=rng.choice([2, 8, 64]),
            push_entries_max=rng.choice([1, 4, 16]),
            # Partial pushes held back for a while (core.agent's "Push delay"), or never.
            push_delay_ms_max=rng.choice([0, 5, 30]),
            heartbeat_interval_ms=60,
            switchover_entries=5,
            ack_timeout_ms=1000,
        )
        self.replicant_crash_probability = rng.choice([0.0, 0.005, 0.02])
        self.replicant_partition_probability = rng.choice([0.0, 0.01, 0.03])
        self.bad_version_probability = rng.choice([0.0, 0.05])
        self.replicants = {f"rep{index}": SimReplicant(f"rep{index}") for index in range(replicant_count)}
        for replicant in self.replicants.values():
            # Replicants join at different times; some with a database of unknown position, which
            # forces a bootstrap (an untrimmed log would let a fresh replicant resume from genesis).
            replicant.down_until_ms = rng.choice([0, rng.randint(0, faulty_ms // 2)])
            if rng.random() < 0.5:
                replicant.applied_digest = p.UNKNOWN_DIGEST
        self.replication_network: list[tuple[int, int, str, str, tuple[Any, ...]]] = []
        self.replicant_cut: set[tuple[str, str]] = set()
        self.in_order = False
        # Every committed entry in key order: the reference state at any committed key.
        self.history: list[Entry] = []
        self.entries_applied = 0
        self.pushes_rejected = 0
        self.replicant_crashes = 0
        # Replicant linearizable reads told their read index, waiting to be applied: (request, key, deadline).
        # Each replicant's held linearizable reads (production's rule: replicant.reads).
        self.waiting_reads: dict[str, WaitingReads[ClientRequest]] = {}
        self.replicant_reads_checked = 0

    def _replay_command(self) -> str:
        return replay_command(self.seed)

    # ------------------------------------------------------------ cores: tables and agents

    def _write_ops(self, number: int) -> tuple[Op, ...]:
        if self.rng.random() < DROP_TABLE_PROBABILITY:
            # A schema change through the log: agents, pushes, spills and replays carry it like rows.
            return (DropTableOp(self.rng.choice(TABLES), SHARD),)
        if self.rng.random() < SCHEMA_CHANGE_PROBABILITY:
            table = self.rng.choice(TABLES)
            return (
                self.rng.choice(
                    [
                        CreateIndexOp(f"{table}_v_idx", table, SHARD, ("v",)),
                        DropIndexOp(f"{table}_v_idx", table, SHARD),
                        AddColumnOp(table, SHARD, f"c{number}", "TEXT"),
                    ]
                ),
            )
        ops: list[Op] = []
        for _ in range(self.rng.randint(1, 3)):
            table = self.rng.choice(TABLES)
            key = self.rng.randrange(KEYS_PER_TABLE)
            if self.rng.random() < 0.25:
                ops.append(DeleteOp(table, key))
            else:
                ops.append(WriteOp(table, {KEY_COLUMN: key, "v": number}))
        return tuple(ops)

    def _start(self, node: SimNode) -> None:
        super()._start(node)
        self.agent_servers.pop(node.name, None)  # a new process: a new agent server (``_server``)
        self.core_tables.setdefault(node.name, empty_tables())

    def _crash(self, node: SimNode) -> None:
        super()._crash(node)
        self.agent_servers.pop(node.name, None)  # its agents die with it

    def _install_snapshot(self, sequencer: SimNode, follower_name: str) -> None:
        before = self.snapshots
        super()._install_snapshot(sequencer, follower_name)
        if self.snapshots != before:
            self.core_tables[follower_name] = copy.deepcopy(self.core_tables[sequencer.name])

    def _execute(self, node: SimNode, effect: Effect) -> None:
        super()._execute(node, effect)
        if isinstance(effect, Commit):
            self._tell_agents(node)  # production: agent_server.committed at every Commit, applied or gathered

    def _apply_up_to(self, node: SimNode, up_to: TxKey) -> None:
        before = node.applied_key
        super()._apply_up_to(node, up_to)
        tables = self.core_tables[node.name]
        for entry in node.log.entries_after(before, len(node.log.entries)):
            if entry.tx_key > node.applied_key:
                break
            apply_ops(tables, entry)
            if not self.history or entry.tx_key > self.history[-1].tx_key:
                self.history.append(entry)

    def _hears_sequencer(self, node: SimNode) -> bool:
        # Production's rule (``CoreNode._hears_sequencer``): a stuck core follows no sequencer.
        machine = node.machine
        return machine is not None and machine.follows_sequencer

    def _server(self, node: SimNode) -> AgentServer:
        server = self.agent_servers.get(node.name)
        if server is None:
            # Agent ids and token keys come from the server's injected random source, drawn from the
            # seed's (production draws them from the operating system's secure source).
            rng = random.Random(self.rng.getrandbits(64))
            server = AgentServer(node.name, self.agent_config, watches_max=WATCHES_MAX, random_bytes=rng.randbytes)
            self.agent_servers[node.name] = server
        return server

    def _committed_key(self, node: SimNode) -> TxKey:
        """What the core knows is committed: applied, or gathered to apply (``FollowerApply``)."""
        return node.apply.up_to or node.applied_key

    def _tell_agents(self, node: SimNode) -> None:
        self._server(node).committed(SHARD, self._committed_key(node), self._hears_sequencer(node), self.now_ms)
        self._send_pushes(node)

    def _send_pushes(self, node: SimNode) -> None:
        """What the core's node does after a turn: send the frames its agent server queued (checked)."""
        server = self._server(node)
        for endpoint, message in server.drain():
            frame = messages.encode(message)
            push = messages.decode(frame, FRAME_BYTES_MAX)  # what the replicant will read, checked here too
            for entry in map(messages.decode_entry, push.body.entries):
                if entry.tx_key > self._committed_key(node) or self.committed_digest.get(entry.tx_key) != entry.digest:
                    raise self.fail(f"agent {push.body.agent} on {node.name} pushed {entry.tx_key}, not committed")
                if any(type(op) is WriteRows for op in messages.decode_ops(entry.packed, runs=True)):
                    self.runs_pushed += 1  # a bulk write packed as one run, as a replicant decodes it
            self._send_replication(node.name, endpoint.removeprefix("ipc://"), ("frame", frame))
        for agent_id, watch in server.watches.items():
            if watch.agent.status().unacknowledged_entries > self.agent_config.window_entries_max:
                raise self.fail(f"agent {agent_id} has more than window_entries_max entries unacknowledged")

    def _serve(self, node: SimNode, sender: str, message: tuple[Any, ...]) -> None:
        """The core's node: a replicant's request (a frame of the real codec) or a push_ack."""
        kind = message[0]
        if kind == "relay":
            # The answer to a read_index this core forwarded for a replicant: relayed as it came.
            _, replicant, frame = message
            self._send_replication(node.name, replicant, ("reply", frame))
            return
        if kind != "frame":
            raise self.fail(f"unknown replication message {message!r}")
        request = messages.decode(message[1], FRAME_BYTES_MAX)
        if request.kind == "push_ack":
            self._server(node).acknowledged(request.body, self.now_ms)
            self._send_pushes(node)
            return
        if request.kind not in REQUEST_KINDS:
            raise self.fail(f"{sender} sent {request.kind} on the replication link")
        if request.kind == "journal":
            agents = self._server(node).agents_of(SHARD)
            info = {
                "committed": list(node.applied_key),
                "hears_sequencer": self._hears_sequencer(node),
                "agents": agents,
            }
            reply = messages.reply(request.request_id, {"node": node.name, "shards": {SHARD: info}})
        elif request.kind == "watch":
            reply = self._on_watch(node, sender, request)
        elif request.kind == "list_tables":
            tables = [define_table(t, KEY_COLUMN, [[KEY_COLUMN, "INTEGER"], ["v", "INTEGER"]], SHARD) for t in TABLES]
            reply = messages.reply(request.request_id, [table.to_json() for table in tables])
        elif request.kind == "bootstrap_batch":
            # Production's serving rule (bootstrap.serve, bounded in rows and bytes) over this core's tables.
            body = request.body
            schema = define_table(body.table, KEY_COLUMN, [[KEY_COLUMN, "INTEGER"], ["v", "INTEGER"]])
            tables = _TablesView(self.core_tables[node.name])
            reply = messages.reply(
                request.request_id, read_batch(tables, schema, body.after, body.limit, BATCH_BYTES_MAX)
            )
        else:
            # The replicant's read fence is a read_index request, served as production serves it
            # (core.rules.fence_read): at the sequencer while ShardConsensus.read_index allows,
            # forwarded once from any other core, whose answer is relayed to the replicant.
            origin, replicant = message[2:] if len(message) == 4 else (node.name, sender)
            machine = node.machine
            view = rules.ShardView(SHARD, machine.role is Role.SEQUENCER, machine.sequencer)
            try:
                fence = rules.fence_read(view, node.name, request.body.forwarded, machine.read_index(self.now_ms))
            except RequestError as refused:
                reply = messages.error(request.request_id, refused.code, str(refused))
            else:
                if isinstance(fence, rules.Forward):
                    forwarded = messages.Message("read_index", request.request_id, {"shard": SHARD, "forwarded": True})
                    self._send_replication(
                        node.name, fence.target, ("frame", messages.encode(forwarded), origin, replicant)
                    )
                    return
                reply = messages.reply(request.request_id, {"committed": list(fence)})
            if origin != node.name:
                self._send_replication(node.name, origin, ("relay", replicant, messages.encode(reply)))
                return
        self._send_replication(node.name, sender, ("reply", messages.encode(reply)))

    def _on_watch(self, node: SimNode, sender: str, request: messages.Message) -> messages.Message:
        self._apply_gathered(node)  # production's _watch: K0 is the applied key, after what was gathered
        try:
            # Production's agent server and its watch rules (core.watch), not a copy of them.
            answer = self._server(node).watch(
                request.body,
                node.log,
                node.applied_key,
                node.applied_digest,
                node.log.digest_at,
                self._hears_sequencer(node),
                self.now_ms,
            )
        except WatchRefusedError as refused:
            return messages.error(request.request_id, refused.code, str(refused))
        self.trace.append((self.now_ms, node.name, "watch", sender, answer["mode"], answer["start"], answer["agent"]))
        self._send_pushes(node)
        return messages.reply(request.request_id, answer)

    # ------------------------------------------------------------ replicants (the driver)

    def _start_replicant(self, replicant: SimReplicant) -> None:
        replicant.machine = self.replica_class(
            SHARD,
            replicant.name,
            tuple(sorted(self.nodes)),
            replicant.applied_key,
            replicant.applied_digest,
            self.replica_config,
            random.Random(self.rng.getrandbits(64)),
            self.now_ms,
            bootstraps=replicant.bootstraps,
            resumes=replicant.resumes,
            read_fenced=replicant.read_fenced,
        )
        replicant.probe_answers = None
        replicant.accepted = None

    def _crash_replicant(self, replicant: SimReplicant) -> None:
        replicant.machine = None
        replicant.crash_in_next_step = False
        replicant.probe_answers = None
        replicant.pending.clear()  # the driver's requests die with the process
        replicant.down_until_ms = self.now_ms + self.rng.randint(20, 600)
        self.replicant_crashes += 1
        self.trace.append((self.now_ms, replicant.name, "crashed until", replicant.down_until_ms))

    def _step_replicant(self, replicant: SimReplicant, event: Any) -> None:
        machine = replicant.machine
        if machine is None:
            raise self.fail(f"stepping crashed replicant {replicant.name}")
        was_disconnected = machine.mode is p.Mode.DISCONNECTED
        was_readable = machine.readable()
        effects = machine.step(event, self.now_ms)
        # The watch answer, or a push that carried it and overtook it.
        acceptance = event if isinstance(event, p.WatchAccepted) else None
        if isinstance(event, p.PushReceived):
            acceptance = event.accepted
        connected = any(
            isinstance(effect, p.ModeChanged)
            and effect.mode in (p.Mode.NORMAL, p.Mode.BOOTSTRAP)
            and acceptance is not None
            and effect.upstream == acceptance.core
            for effect in effects
        )
        if acceptance is not None and was_disconnected and connected:
            replicant.accepted = (acceptance.core, acceptance.agent_id)
            if acceptance.mode == "resume":
                replicant.resumes += 1
        watched = (machine.upstream, machine.agent_id)
        crash_after = None
        if replicant.crash_in_next_step:
            crash_after = self.rng.randint(0, len(effects))
            effects = effects[:crash_after]
        for effect in effects:
            if isinstance(effect, p.ApplyEntries):
                if not isinstance(event, p.PushReceived):
                    raise self.fail(f"{replicant.name} applied entries on {event!r}")
                pusher = (event.core, event.agent_id)
                if pusher != watched or pusher != replicant.accepted:
                    raise self.fail(
                        f"{replicant.name} applied a push of agent {event.agent_id} on {event.core}, "
                        f"but it watches {replicant.accepted}"
                    )
            self._execute_replica(replicant, effect)
        if crash_after is not None:
            self.trace.append((self.now_ms, replicant.name, "crashed mid-step after effects", crash_after))
            self._crash_replicant(replicant)
            return
        if machine.readable() and (not was_readable or acceptance is not None):
            self._check_readable(replicant)
        self._check_replicant(replicant)

    def _request_frame(self, replicant: SimReplicant, kind: str, body: dict[str, Any], detail: Any = None) -> bytes:
        replicant.requests_sent += 1
        request_id = f"{replicant.name}-{replicant.requests_sent}"
        replicant.pending[request_id] = (REQUEST_KINDS[kind], detail)
        if len(replicant.pending) > PENDING_MAX:
            del replicant.pending[next(iter(replicant.pending))]
        return messages.encode(messages.Message(kind, request_id, body))

    def _on_reply(self, replicant: SimReplicant, core: str, frame: bytes) -> None:
        """A core's answer, read as production's driver reads it (replicant/node.py ``_on_answer``),
        with production's parsers of untrusted answers."""
        answer = messages.decode(frame, FRAME_BYTES_MAX)
        pending = replicant.pending.get(answer.request_id)
        if pending is None:
            return  # an answer to a request of the process before a crash
        purpose, detail = pending
        error = answer.body if answer.kind == "error" else None
        result = answer.body.result if answer.kind == "reply" else None
        if purpose == "probe":
            if replicant.probe_answers is not None:
                replicant.probe_answers[core] = p.journal_answer(result, SHARD)
            return
        if purpose == "watch":
            accepted = watch_accepted(core, result)
            if error is not None:
                event: Any = p.WatchRefused(core, f"{error.code}: {error.message}")
            elif accepted is None:
                raise self.fail(f"{core} answered a watch with a malformed answer {result!r}")
            else:
                event = accepted
        elif purpose == "tables":
            try:
                mine = tables_from_answer(result, SHARD)
            except CopyFailed as failure:
                raise self.fail(f"{core} answered list_tables with a malformed answer: {failure}") from None
            event = p.TablesReceived(core, tuple(t.name for t in mine), tuple(t.key_column for t in mine), detail)
        elif purpose == "batch":
            table, after, watch_id = detail
            event = batch_from_answer(core, table, after, result, watch_id=watch_id)
            if event is None:
                raise self.fail(f"{core} served a malformed bootstrap batch: {result!r}")
        else:
            fence = messages.answer_as(result, messages.ReadIndexAnswer) if error is None else None
            event = p.CommittedReceived(core, fence.committed if fence is not None else None, detail)
        self._step_replicant(replicant, event)

    def _check_readable(self, replicant: SimReplicant) -> None:
        """A replica that starts serving reads holds exactly the committed state at its applied key."""
        reference = empty_tables()
        for entry in self.history:
            if entry.tx_key > replicant.applied_key:
                break
            apply_ops(reference, entry)
        if replicant.tables != reference:
            raise self.fail(
                f"{replicant.name} serves reads at {replicant.applied_key} with tables that are not the committed "
                "state there (a dirty bootstrap copy read past the read fence)"
            )

    def _apply_entry(self, replicant: SimReplicant, entry: Entry) -> None:
        if replicant.applied_digest == p.UNKNOWN_DIGEST:
            raise self.fail(f"{replicant.name} applies {entry.tx_key} at an unknown position")
        if entry.prev != replicant.applied_key:
            raise self.fail(
                f"{replicant.name} applies {entry.tx_key} after {entry.prev}, but its applied key is "
                f"{replicant.applied_key} (a gap or a duplicate)"
            )
        if self.committed_digest.get(entry.tx_key) != entry.digest:
            raise self.fail(f"{replicant.name} applies {entry.tx_key} outside the cores' committed history")
        apply_ops(replicant.tables, entry)
        replicant.applied_key, replicant.applied_digest = entry.tx_key, entry.digest
        self.entries_applied += 1

    def _execute_replica(self, replicant: SimReplicant, effect: Any) -> None:
        name = replicant.name
        if isinstance(effect, p.ProbeJournals):
            replicant.probe_answers = {}
            replicant.probe_deadline_ms = self.now_ms + self.replica_config.probe_timeout_ms
            for core in effect.cores:
                self._send_replication(name, core, ("frame", self._request_frame(replicant, "journal", {})))
        elif isinstance(effect, p.SendWatch):
            version = p.REPLICATION_PROTOCOL_VERSION
            if self.rng.random() < self.bad_version_probability:
                version += 1  # an incompatible peer
            body = {
                "shard": SHARD,
                "replicant": name,
                "endpoint": f"ipc://{name}",
                "from": list(effect.from_key),
                "from_digest": effect.from_digest,
                "protocol": version,
                "watch_id": effect.watch_id,
            }
            self._send_request(name, effect.core, ("frame", self._request_frame(replicant, "watch", body)))
        elif isinstance(effect, p.FetchTables):
            frame = self._request_frame(replicant, "list_tables", {}, replicant.machine.watch_id)
            self._send_request(name, effect.core, ("frame", frame))
        elif isinstance(effect, p.FetchBatch):
            body = {"table": effect.table, "limit": effect.limit}
            if effect.after is not None:
                body["after"] = effect.after
            frame = self._request_frame(
                replicant, "bootstrap_batch", body, (effect.table, effect.after, replicant.machine.watch_id)
            )
            self._send_request(name, effect.core, ("frame", frame))
        elif isinstance(effect, p.FetchCommitted):
            # The question travels with the request, as production's driver keeps it (``Pending``).
            frame = self._request_frame(replicant, "read_index", {"shard": SHARD}, effect.question)
            self._send_request(name, effect.core, ("frame", frame))
        elif isinstance(effect, p.ApplyEntries):
            for entry in effect.entries:
                self._apply_entry(replicant, entry)
        elif isinstance(effect, p.ResetShard):
            replicant.tables = empty_tables()
            replicant.spill = []
            replicant.applied_digest = p.UNKNOWN_DIGEST
            replicant.bootstraps += 1
        elif isinstance(effect, p.ApplyBatch):
            for row in effect.rows:
                replicant.tables.setdefault(effect.table, {})[row[KEY_COLUMN]] = dict(row)
        elif isinstance(effect, p.SpillEntries):
            replicant.spill.extend(effect.entries)
        elif isinstance(effect, p.ReplaySpill):
            if effect.start_key < replicant.applied_key:
                raise self.fail(
                    f"{name} replays from {effect.start_key}, behind its applied key {replicant.applied_key}"
                )
            expected = GENESIS_DIGEST if effect.start_key == ZERO_KEY else self.committed_digest.get(effect.start_key)
            if expected != effect.start_digest:
                raise self.fail(f"{name} replays from {effect.start_key} with a digest the cores do not have there")
            replicant.applied_key, replicant.applied_digest = effect.start_key, effect.start_digest
            for entry in replicant.spill:
                self._apply_entry(replicant, entry)
            replicant.spill = []
        elif isinstance(effect, p.SendAck):
            body = ack_body(SHARD, effect)  # production's body: the token echoed
            self._send_replication(
                name, effect.core, ("frame", messages.encode(messages.Message("push_ack", "ack", body)))
            )
        elif isinstance(effect, p.SendReject):
            self.pushes_rejected += 1
            applied = replicant.machine.applied_key if replicant.machine is not None else replicant.applied_key
            body = {"shard": SHARD, "agent": effect.agent_id, "applied": list(applied), "rejected": effect.reason}
            self._send_replication(
                name, effect.core, ("frame", messages.encode(messages.Message("push_ack", "ack", body)))
            )
        elif isinstance(effect, p.ModeChanged):
            self.trace.append((self.now_ms, name, "mode", effect.mode.value, effect.upstream, effect.reason))
        elif isinstance(effect, p.ReadFenceChanged):
            replicant.read_fenced = effect.fenced
        else:
            raise self.fail(f"{name}: unknown replica effect {effect!r}")

    def _check_replicant(self, replicant: SimReplicant) -> None:
        machine = replicant.machine
        if replicant.applied_key < replicant.applied_key_max:
            raise self.fail(f"{replicant.name} went back from {replicant.applied_key_max} to {replicant.applied_key}")
        replicant.applied_key_max = replicant.applied_key
        known = replicant.applied_digest != p.UNKNOWN_DIGEST and replicant.applied_key != ZERO_KEY
        if known and self.committed_digest.get(replicant.applied_key) != replicant.applied_digest:
            raise self.fail(f"{replicant.name} has another digest at {replicant.applied_key} than the cores")
        if machine is not None and (machine.applied_key, machine.applied_digest) != (
            replicant.applied_key,
            replicant.applied_digest,
        ):
            raise self.fail(f"{replicant.name}: the machine's position differs from the persisted one")
        if machine is not None:
            status = machine.status()
            if (status.bootstraps, status.resumes) != (replicant.bootstraps, replicant.resumes):
                raise self.fail(
                    f"{replicant.name} counts {status.bootstraps}/{status.resumes} bootstraps/resumes, "
                    f"the driver saw {replicant.bootstraps}/{replicant.resumes}"
                )

    # ------------------------------------------------------------ the replication network

    def _send_request(self, sender: str, core: str, message: tuple[Any, ...]) -> None:
        if self.nodes[core].machine is None:
            # Connection refused: the driver learns it at once.
            failed = p.RequestFailed(core, "connection refused")
            self._enqueue(self.now_ms + 1, core, sender, ("answer", failed))
            return
        self._send_replication(sender, core, message)

    def _send_replication(self, sender: str, to: str, message: tuple[Any, ...]) -> None:
        if self.in_order:
            self._enqueue(self.now_ms + self.tick_ms, sender, to, message)
            return
        faults = self.faults
        if self.rng.random() < faults.drop_probability:
            return
        copies = 2 if self.rng.random() < faults.duplicate_probability else 1
        for _ in range(copies):
            self._enqueue(self.now_ms + self.rng.randint(1, faults.delay_ms_max), sender, to, message)

    def _enqueue(self, deliver_at: int, sender: str, to: str, message: tuple[Any, ...]) -> None:
        self.message_sequence += 1
        heapq.heappush(self.replication_network, (deliver_at, self.message_sequence, sender, to, message))

    def _deliver_replication_due(self) -> None:
        postponed = []
        while self.replication_network and self.replication_network[0][0] <= self.now_ms:
            deliver_at, sequence, sender, to, message = heapq.heappop(self.replication_network)
            if (sender, to) in self.replicant_cut or (to, sender) in self.replicant_cut:
                continue
            if to in self.nodes:
                node = self.nodes[to]
                if node.machine is None:
                    continue
                if node.paused_until_ms > self.now_ms:
                    postponed.append((node.paused_until_ms, sequence, sender, to, message))
                    continue
                self._serve(node, sender, message)
                continue
            replicant = self.replicants[to]
            if replicant.machine is None:
                continue
            kind, body = message
            if kind == "reply":
                self._on_reply(replicant, sender, body)
            elif kind == "frame":
                # A core's push, through the real codec and production's conversion to a replica event.
                push = messages.decode(body, FRAME_BYTES_MAX)
                if push.kind != "push":
                    raise self.fail(f"{sender} sent {push.kind} on the replication link")
                try:
                    event = push_received(replicant.machine, push.body)
                except messages.MessageError as error:
                    raise self.fail(f"{sender} pushed malformed entries: {error}") from None
                self._step_replicant(replicant, event)
            else:
                self._step_replicant(replicant, body)
        for item in postponed:
            heapq.heappush(self.replication_network, item)

    # ------------------------------------------------------------ time and faults

    def _client_request(self, kind: str | None = None, target: str | None = None, key: int | None = None) -> None:
        replicant = self.rng.choice(sorted(self.replicants))
        if kind is not None or self.rng.random() < 0.6:
            super()._client_request(kind, target, key)
            return
        # A linearizable read at a replicant: it asks a core (forwarded to the sequencer) for the read index.
        self.read_count += 1
        key = self.rng.randrange(READ_KEYS)
        request = ClientRequest(
            "read_index", key, self.read_count, self.now_ms, self.acknowledged_position, replicant=replicant
        )
        # Production's choice of the core to ask (replicant.upstream.write_target).
        machine = self.replicants[replicant].machine
        upstream = machine.upstream if machine is not None else None
        self._enqueue_client(write_target([upstream], tuple(sorted(self.nodes)), self.rng), request)

    def _read_index_answered(self, request: ClientRequest, read_index: TxKey) -> None:
        # Production's gather of one read index per shard (one shard here), then the held read.
        targets = ReadIndexGather((SHARD,)).arrived(SHARD, read_index)
        assert isinstance(targets, dict)
        reads = self.waiting_reads.setdefault(request.replicant or "", WaitingReads(WAITING_READS_MAX))
        with contextlib.suppress(OverloadedError):  # refused: the client retries
            reads.hold(request, READ_TABLE, targets, self.now_ms + READ_WAIT_MS_MAX)

    def _answer_waiting_reads(self) -> None:
        for name, reads in self.waiting_reads.items():
            replicant = self.replicants[name]
            machine = replicant.machine
            if machine is None:
                reads.reads.clear()  # lost with the process: the clients time out and retry
                continue
            reads.expired(self.now_ms)  # answered "timeout": the clients retry
            for read in reads.ready(lambda table: SHARD, lambda shard, key, at=machine.readable_at: at(key)):
                row = self._row_at(read.payload.key, self.commit_position[replicant.applied_key])
                self._record_read(replicant.name, read.payload, row)
                self.replicant_reads_checked += 1

    def _advance(self) -> None:
        self._resend_due()
        self._deliver_due()
        self._deliver_replication_due()
        self._answer_waiting_reads()
        self._tick_all()
        for node in self.nodes.values():
            if self._is_up(node):
                # One loop turn of the core's node: a new push budget, the committed key, due agents.
                server = self._server(node)
                server.begin_turn()
                self._tell_agents(node)
                server.tick(self.now_ms)
                self._send_pushes(node)
        self._restart_replicants_due()
        for replicant in self.replicants.values():
            if replicant.machine is None:
                continue
            if replicant.probe_answers is not None and self.now_ms >= replicant.probe_deadline_ms:
                answers = replicant.probe_answers
                replicant.probe_answers = None
                ages = tuple((core, answers.get(core)) for core in sorted(self.nodes))
                self._step_replicant(replicant, p.JournalsReceived(ages))
            if replicant.machine is not None:
                self._step_replicant(replicant, p.Ticked())
        self.now_ms += self.tick_ms

    def _restart_replicants_due(self) -> None:
        for replicant in self.replicants.values():
            if replicant.machine is None and replicant.down_until_ms <= self.now_ms:
                self._start_replicant(replicant)
                self.trace.append((self.now_ms, replicant.name, "started at", replicant.applied_key))

    def _inject_faults(self) -> None:
        super()._inject_faults()
        rng = self.rng
        names = list(self.replicants)
        if rng.random() < self.replicant_crash_probability:
            replicant = self.replicants[rng.choice(names)]
            if replicant.machine is not None:
                if rng.random() < 0.5:
                    replicant.crash_in_next_step = True
                else:
                    self._crash_replicant(replicant)
        if rng.random() < self.replicant_partition_probability:
            replicant = rng.choice(names)
            cores = rng.sample(sorted(self.nodes), rng.randint(1, len(self.nodes)))
            self.replicant_cut = {(replicant, core) for core in cores}
            self.trace.append((self.now_ms, "replicant partition", sorted(self.replicant_cut)))
        elif self.replicant_cut and rng.random() < 0.05:
            self.replicant_cut = set()
            self.trace.append((self.now_ms, "replicant partition healed"))

    def _heal(self) -> None:
        super()._heal()
        self.replicant_cut = set()
        self.in_order = True
        self.bad_version_probability = 0.0
        for replicant in self.replicants.values():
            replicant.crash_in_next_step = False
            replicant.down_until_ms = min(replicant.down_until_ms, self.now_ms)

    # ------------------------------------------------------------ the run

    def _replicas_converged(self, sequencer: SimNode) -> bool:
        for replicant in self.replicants.values():
            machine = replicant.machine
            if machine is None or not machine.readable():
                return False
            if replicant.applied_key != sequencer.applied_key:
                return False
        return True

    def run(self) -> ReplicantSimulationResult:  # type: ignore[override]
        super().run()
        deadline = self.now_ms + CONVERGENCE_MS_MAX
        while True:
            sequencer = self._run_until_quiet(20_000)
            if self._replicas_converged(sequencer):
                break
            if self.now_ms >= deadline:
                states = {
                    name: (r.machine.status() if r.machine else "down", r.applied_key)
                    for name, r in self.replicants.items()
                }
                raise self.fail(f"replicas did not converge to {sequencer.applied_key}: {states}")
            for _ in range(10):
                self._advance()
        self.final_replica_check(sequencer)
        return ReplicantSimulationResult(
            seed=self.seed,
            core_count=self.core_count,
            replicant_count=len(self.replicants),
            committed_entries=len(self.committed_digest),
            bootstraps=sum(r.bootstraps for r in self.replicants.values()),
            resumes=sum(r.resumes for r in self.replicants.values()),
            entries_applied=self.entries_applied,
            rows_copied=sum(r.machine.status().rows_copied for r in self.replicants.values() if r.machine),
            pushes_rejected=self.pushes_rejected,
            replicant_crashes=self.replicant_crashes,
            runs_pushed=self.runs_pushed,
            final_time_ms=self.now_ms,
        )

    def final_replica_check(self, sequencer: SimNode) -> None:
        expected = self.core_tables[sequencer.name]
        if sequencer.machine is None:
            raise self.fail(f"{sequencer.name} is not running")
        for name in sequencer.machine.members:
            if self.core_tables[name] != expected:
                raise self.fail(f"core {name}'s tables differ from the sequencer's")
        for replicant in self.replicants.values():
            if replicant.applied_key != sequencer.applied_key or replicant.applied_digest != sequencer.applied_digest:
                raise self.fail(f"{replicant.name} is at {replicant.applied_key}, the cores at {sequencer.applied_key}")
            if replicant.tables != expected:
                raise self.fail(f"{replicant.name}'s tables differ from the cores' at {sequencer.applied_key}")


class GatheringReplicantSimulation(ReplicantSimulation):
    """Replicants watching cores whose followers gather commits (``core.rules.FollowerApply`` at
    production's delay): agents are told of every commit, a watch takes K0 after applying what was
    gathered, and a bootstrap's dirty reads come from the applied tables."""

    follower_apply_delay_ms = Limits().follower_apply_delay_ms_max


def run_replicant_seed(
    seed: int, replica_class: type[ShardReplica] = ShardReplica, faulty_ms: int = 3000
) -> ReplicantSimulationResult:
    """Run one seed: 3 cores for even seeds, 5 for odd ones; 2 or 3 replicants."""
    core_count = 3 if seed % 2 == 0 else 5
    replicant_count = 2 + seed % 3 // 2
    return ReplicantSimulation(seed, core_count, replicant_count, faulty_ms, replica_class=replica_class).run()
