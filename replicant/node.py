"""The replicant node driver: zmq in front, apsw behind, one ``ShardReplica`` per shard in between.

Theory of operation
-------------------
A replicant serves reads from its own SQLite copy and never originates a write: writes are
forwarded to a core (which forwards them to the sequencer) and come back through the rlog like any
other entry (invariant 7). One thread owns the sockets, the database and the state machines.

The protocol decisions are the pure ``replicant.replica.ShardReplica``'s; this driver executes its
effects. Requests to cores (journal probes, watch, list_tables, scan batches, forwarded writes) are
asynchronous: a DEALER per core, a table of pending requests with deadlines, answers delivered to
the machine as events. The table is bounded (``PENDING_REQUESTS_MAX``, clients' requests half of it
at most): a request of the replicas' own that finds it full is not sent, and the replica is told in
the same turn that it failed, and why (``_not_sent``), instead of waiting for its failure timeout.
Pushes arrive on the node's ROUTER from the agent's DEALER and are answered with one-way
``push_ack`` frames.

Effects that change the database run inside one open SQLite transaction per loop turn; frames are
sent only after it commits, so an acknowledged applied key is always durable (invariant 4). A turn
that fails for want of space is rolled back unsent (``rlog.server``); each replica is then told
``DiskFull`` with the position on disk (``disk_filled``): it applies nothing and keeps serving reads
until a probe writes again (``disk_freed``); writes are refused with ``disk_full`` meanwhile.

Shards are discovered from the cores' journals: every shard a core reports gets a replica.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import zmq
from mnesite.bootstrap import read_service
from mnesite.bootstrap.copy import CopyFailed, batch_from_answer, copy_schema_ops, rows_refusal, tables_from_answer
from mnesite.bootstrap.serve import read_batch
from mnesite.replicant.reads import (
    GATHER_FAILED,
    ReadIndexGather,
    WaitingReads,
    check_client_requests_room,
    shards_to_wait_on,
)
from mnesite.replicant.replica import (
    ReplicaConfig,
    ShardReplica,
    SpillBudget,
    ack_body,
    push_received,
    watch_accepted,
)
from mnesite.replicant.upstream import write_target
from mnesite.rlog import messages
from mnesite.rlog import replication as p
from mnesite.rlog.backup import BACKUP_KINDS
from mnesite.rlog.config import Config, ConfigError, is_wildcard
from mnesite.rlog.data_dir import DataDirectoryLock
from mnesite.rlog.disk import DiskFreed, DiskFull
from mnesite.rlog.limits import SHARDS_MAX
from mnesite.rlog.messages import Message, MessageError
from mnesite.rlog.process_signals import ProcessSignals
from mnesite.rlog.roles import WRITE_KINDS
from mnesite.rlog.schema import SchemaError, TableSchema, check_name
from mnesite.rlog.server import (
    NodeServer,
    OverloadedError,
    RequestError,
    collector_paused,
    relayed,
    request_id_of,
)
from mnesite.rlog.store import Store, StoreError
from mnesite.rlog.throttle import monotonic_ms
from mnesite.rlog.types import (
    TxKey,
    new_request_id,
    read_targets,
)
from mnesite.rlog.versions import (
    Announcement,
    announcement_of,
    incompatibility,
    local_announcement,
    replication_protocol_for,
    watch_tells_frame_bytes_max,
)

log = logging.getLogger("mnesite.replicant")
# Forwarded to a core: replicants never originate writes (DESIGN invariant 7), schema changes included.

POLL_INTERVAL_MS_MAX = 50
DISCOVERY_INTERVAL_MS = 1000
REQUEST_TIMEOUT_MS = 3000
FORWARD_TIMEOUT_MS = 10_000
PENDING_REQUESTS_MAX = 10_000
WAITING_READS_MAX = 10_000
READ_WAIT_MS_MAX = 10_000
CORE_QUEUE_MAX = 1000
# Frames sent at once toward a core (forwarded writes, bootstrap batch requests, read indexes) from
# rlog.send_queue's TRACKED_BYTES_MIN are tracked, bounded in bytes by core_queue_bytes_max
# (``NodeServer.send_bounded``); smaller ones only by zmq's count, CORE_QUEUE_MAX of them: 4 MiB per core.
PROGRESS_LOG_INTERVAL_MS = 5000
# A core a send failed to (no connection, its queue full) is skipped for a client's request (a forwarded
# write, a read index) this long when another core can take it (``upstream.write_target``).
SEND_FAILED_AVOID_MS = 1000
# No answer from any core for this long: the replicant says so in its log (at most once per this
# interval) and in status, instead of answering "unknown table" without a word.
NO_CORE_WARNING_MS = 5000


@dataclass
class Pending:
    """A request this replicant sent to a core, waiting for its answer."""

    purpose: str  # probe | discover | watch | tables | batch | forward
    core: str
    deadline_ms: int
    shard: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    watch_id: str | None = None  # watch, tables, batch: the replica's attempt (RequestFailed.watch_id)
    probe_id: int = 0  # probe: the probe that asked (``Probe.probe_id``)
    question: int = 0  # fence: the read fence's question it asks (``FetchCommitted.question``)


@dataclass
class Probe:
    """Journal answers being collected for one shard's ``ProbeJournals``."""

    cores: tuple[str, ...]
    answers: dict[str, p.JournalAnswer | None]
    deadline_ms: int
    # Which of the node's probes this is: an answer counts only in the probe that asked (a request
    # outlives a probe that timed out, and its late answer must not end the shard's next probe).
    probe_id: int = 0
    # Cores that answered with a log this replicant cannot read, and why (``rlog.replication.unreadable_log``).
    unreadable: dict[str, str] = field(default_factory=dict)
    # Cores never asked: the request could not be sent (``ReplicantNode._not_sent``), and why.
    unsent: dict[str, str] = field(default_factory=dict)
    # Cores that answered with an error (``forbidden``, ``stopping``): its code and message.
    refused: dict[str, str] = field(default_factory=dict)


class ReplicantNode(NodeServer):
    role = "replicant"

    def __init__(
        self,
        config: Config,
        clock_ms: Callable[[], int] = monotonic_ms,
        rng: random.Random | None = None,
        replica_config: ReplicaConfig | None = None,
        signals: ProcessSignals | None = None,
    ) -> None:
        """``signals``: the process's stop and reload signals (``mnesite start``); a stop before the loop
        runs is taken at its first iteration (a replicant's bootstrap runs in the loop)."""
        if config.role != "replicant":
            raise ConfigError(f"[node].role is {config.role!r}, not replicant")
        if is_wildcard(config.listen):  # parse_config refuses it; a Config built in code as well
            raise ConfigError("[node].listen of a replicant must name its host: cores push to that address")
        self.clock_ms = clock_ms
        self.rng = rng or random.Random()
        self.replica_config = replica_config or ReplicaConfig(
            spill_entries_max=config.limits.spill_entries_max, spill_bytes_max=config.limits.spill_bytes_max
        )
        # One budget for the spills of all this node's shards (a first start bootstraps them all at once).
        self.spill_budget = SpillBudget(self.replica_config.spill_bytes_max)
        self.cores = tuple(sorted(config.core_nodes))
        store, data_dir_lock = DataDirectoryLock.acquire_and_open(
            config.data_dir, config.name, config.database_path, config.synchronous
        )
        super().__init__(config, store, data_dir_lock, signals)
        try:
            cluster_id = store.claim_cluster_id(config.cluster_id)
        except StoreError:
            self.close()  # the lock and the store given back, as a core's failed start does
            raise
        self.replicas: dict[str, ShardReplica] = {}
        self.core_sockets: dict[str, zmq.Socket] = {}
        # Bytes sent toward each core that zmq may still hold (a core away or not reading), bounded.
        self._send_failed_ms: dict[str, int] = {}  # per core, when a send at once to it last failed
        self.pending: dict[str, Pending] = {}
        self.probes: dict[str, Probe] = {}
        self.probes_sent = 0  # numbers each probe (``Probe.probe_id``)
        # Failures of the replicas' own requests that were not sent (``_not_sent``), for this turn's
        # ``_expire``: as many as the requests dropped in one turn, emptied every turn.
        self._requests_failed: list[tuple[str, p.RequestFailed | p.FenceQuestionUnsent]] = []
        self.waiting_reads: WaitingReads[tuple[list[bytes], Message]] = WaitingReads(WAITING_READS_MAX)
        self.pushes_rejected: dict[str, int] = {}
        # Acknowledgements of this turn, one per (core, shard, agent): the last says all the earlier
        # ones said (an applied key only grows under one agent), so only it is sent (before_send).
        self._acks: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._next_discovery_ms = 0
        self._next_progress_log_ms: dict[str, int] = {}
        self._next_retention_ms = 0
        self._discovery_turn = 0
        self._core_heard_ms = self.clock_ms()  # last answer or push from any core (start-up counts)
        self._no_core_logged_ms: int | None = None
        # What this node and each core speak (rlog.versions), from the cores' journal answers.
        self.versions = local_announcement(cluster_id=cluster_id)
        self.core_versions: dict[str, Announcement] = {}
        for shard in self.store.shards():
            self._open_replica(shard)

    def _note_versions(self, core: str, answer: Any) -> None:
        """Record what a core's journal answer announces (whom it follows is ``journal_answer``'s rule);
        a core it cannot speak with is logged once, when the core's announcement changes."""
        announcement = announcement_of(answer)
        if announcement is None or core not in self.config.core_nodes or self.core_versions.get(core) == announcement:
            return
        reason = incompatibility(self.versions, announcement)
        if reason is not None:
            log.warning("core %s: refused, this replicant cannot speak with it: %s", core, reason)
        self.core_versions[core] = announcement

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> None:
        super().bind()
        try:
            for core in self.cores:
                socket = self.dealer(self.config.core_nodes[core], CORE_QUEUE_MAX, len(self.cores))
                if socket is None:
                    raise RuntimeError(f"no socket for core {core}")
                # Only what is sent at once (``_send_at_once``) is bounded: copy_threshold 0 for its trackers.
                socket.copy_threshold = 0
                self.core_sockets[core] = socket
        except BaseException:
            # As a failed base bind does: nothing this process opened stays open (the store, the
            # data directory's lock, zmq), so it could open a node on that directory again.
            self.close()
            raise

    def close(self) -> None:
        self.core_sockets = {}
        super().close()

    def _open_replica(self, shard: str) -> ShardReplica:
        position = self.store.shard(shard)
        if position is None:
            self.begin()
            position = self.store.ensure_shard(shard, 0)
        logged_key, logged_digest = self._logged_end(shard, position.applied, position.digest)
        replica = ShardReplica(
            shard,
            self.config.name,
            self.cores,
            logged_key,
            logged_digest,
            self.replica_config,
            random.Random(self.rng.random()),
            self.clock_ms(),
            bootstraps=int(self.store.meta(f"bootstraps:{shard}", 0)),
            resumes=int(self.store.meta(f"resumes:{shard}", 0)),
            bootstraps_outrun=int(self.store.meta(f"bootstraps_outrun:{shard}", 0)),
            read_fenced=bool(int(self.store.meta(f"read_fenced:{shard}", 0))),
            spill_budget=self.spill_budget,
            speaks=self.versions,
            spilled=self.store.spilled(shard),
            spilled_bytes=self.store.spilled_bytes(shard),
        )
        self.replicas[shard] = replica
        return replica

    # -- the loop ----------------------------------------------------------------------------

    def run_turn(self) -> None:
        if self.socket is None:
            raise RuntimeError("socket not bound")
        # First, before the turn writes: what the schedule judges (the shards' modes, their applied keys)
        # is then what is committed, the state a backup's snapshot holds (``NodeServer.run_backup_schedule``).
        self.run_backup_schedule(self._backup_not_ready)
        deadlines = [r.next_deadline_ms() for r in self.replicas.values()]
        deadlines += [pr.deadline_ms for pr in self.probes.values()]
        timeout = POLL_INTERVAL_MS_MAX
        if self.has_backlog() or self._requests_failed:
            timeout = 0
        elif deadlines:
            timeout = max(0, min(timeout, min(deadlines) - self.clock_ms()))
        ready = self.poll(timeout)
        # Answers first: a watch answer and the new agent's first push travel on different
        # connections (the replica also takes a push carrying the answer as the answer).
        for core, socket in self.core_sockets.items():
            if socket in ready:
                self._receive_answers(core, socket)
        if self.socket in ready or self.has_backlog():
            self._serve_waiting()
        # Timers after input: pushes that waited in the socket during a long turn count as heard.
        now = self.clock_ms()
        for replica in list(self.replicas.values()):
            if now >= replica.next_deadline_ms():
                self._step(replica, p.Ticked())
        self._discover(now)
        self._expire(now)
        self._warn_if_no_core(now)
        self._answer_waiting_reads()
        self.serve_queries(self._query_shard_reached)
        self.serve_changes()
        self.build_indexes()
        self._maybe_trim()
        self.flush()

    def shards_not_serving_changes(self, followed: Collection[str]) -> list[str]:
        """Of ``followed``, the shards a bootstrap reset (``ResetShard``) and whose copy is not done and
        healed yet: read fenced (``ShardReplica.read_fenced``), from the bootstrap's start, across a
        restart, until the replay reaches the fence. A shard only disconnected (failing over, most often
        to resume) is not among them, although a request asked meanwhile is refused: a changefeed
        request held on it gets its page once pushes come again."""
        return [shard for shard in followed if shard in self.replicas and self.replicas[shard].read_fenced]

    def _maybe_trim(self) -> None:
        """Retention of the replicant's own rlog, by count and age like on a core."""
        now = int(time.time() * 1000)
        if now < self._next_retention_ms or self.disk.full:
            return
        self._next_retention_ms = now + self.config.retention.retention_interval_ms
        retention = self.config.retention
        before_ms = now - retention.retention_age_ms_max if retention.retention_age_ms_max else None
        self.begin()
        for shard in self.replicas:
            self.store.trim(shard, retention.retention_entries_max, before_ms)

    def _request(
        self, core: str, kind: str, body: dict[str, Any], pending: Pending, at_once: bool = False
    ) -> RequestError | OverloadedError | None:
        """Ask ``core``; ``at_once``: send now, not after the turn's commit (for a request that
        reveals nothing this node must persist first: the next bootstrap batch, which the core then
        reads while this node writes the previous one). Returns why nothing was sent,
        as the error a client's request is refused with, else None: ``overloaded`` when
        ``PENDING_REQUESTS_MAX`` requests are pending (whoever waits on it is told, ``_not_sent``),
        ``no_sequencer`` when an ``at_once`` send failed (whoever waits on it is told as well)."""
        if len(self.pending) >= PENDING_REQUESTS_MAX:
            full = OverloadedError(
                f"{len(self.pending)} requests to the cores are pending at {self.config.name} "
                f"(PENDING_REQUESTS_MAX {PENDING_REQUESTS_MAX}); {kind} to {core} not sent"
            )
            self.warnings.log("requests pending full", logging.WARNING, "%s", str(full))
            self._not_sent(pending, f"overloaded: {full}")
            return full
        request_id = new_request_id()
        self.pending[request_id] = pending
        message = Message(kind, request_id, body)
        if not at_once:
            self.queue(self.core_sockets[core], message)
            return None
        unsent = self._send_at_once(core, message)
        if unsent is None:
            return None
        log.debug("%s to %s not sent: %s", kind, core, unsent)
        del self.pending[request_id]  # nothing was sent: no answer can come
        # A bootstrap batch fails in this turn, as when the full table kept it (``_not_sent``): the
        # copy asks another core (or again), not after REQUEST_TIMEOUT_MS for a lost request.
        self._not_sent(pending, f"{kind} to {core} not sent: {unsent}")
        return self._unreachable(core, unsent)

    def _send_to_a_core(self, upstreams: list[str | None], message: Message) -> str | RequestError:
        """Send a client's request (a forwarded write, a read index) at once to the core ``write_target``
        chooses, skipping the cores that cannot take it now (``core_queue_bytes_max`` held toward it, a
        send to it failed in the last SEND_FAILED_AVOID_MS) and, when a send fails, choosing again
        without that core. The core it went to, else (no core took it) the refusal: ``no_sequencer``,
        nothing was sent. At most one try per core."""
        now = self.clock_ms()
        failed_since_ms = now - SEND_FAILED_AVOID_MS
        unavailable = {
            core
            for core in self.cores
            if self.peer_queues.full(core) or self._send_failed_ms.get(core, failed_since_ms) > failed_since_ms
        }
        tried: dict[str, str] = {}
        while True:
            core = write_target(upstreams, self.cores, self.rng, frozenset(unavailable | tried.keys()))
            if core in tried:
                break
            unsent = self._send_at_once(core, message)
            if unsent is None:
                return core
            tried[core] = unsent
        if len(tried) == 1:
            return self._unreachable(*next(iter(tried.items())))
        each = "; ".join(f"core {core}: {why}" for core, why in tried.items())
        why = f"no core can be reached from {self.config.name} ({each}); nothing was sent"
        return RequestError("no_sequencer", why)

    def _unreachable(self, core: str, unsent: str) -> RequestError:
        """A client's request that could not be sent to ``core`` (``unsent`` says why): refused
        ``no_sequencer``, nothing was sent, as a core answers a write it cannot send to its sequencer."""
        why = f"core {core} cannot be reached from {self.config.name}: {unsent}; nothing was sent"
        return RequestError("no_sequencer", why)

    def _not_sent(self, pending: Pending, why: str) -> None:
        """Tell whoever waits on ``pending``, which the full table or a failed send kept from being
        sent (or whose answer was too large to read, ``_answer_too_large``): a replica's watch, table
        list or bootstrap batch fails in this turn's ``_expire`` (``RequestFailed``, with ``why`` for
        its status; it fails over or retries as after a failed request); a probe takes the core for
        silent and ends there once no other core is left to answer. A client's read index is refused
        by its caller. A fence question and a discovery are asked again at their own interval (a
        fence answered None would be asked again at once, every turn it stays full); the fence's replica
        keeps why (``FenceQuestionUnsent``: its status and the reads it refuses say it)."""
        if pending.purpose in ("watch", "tables", "batch") and pending.shard is not None:
            self._requests_failed.append((pending.shard, p.RequestFailed(pending.core, why, pending.watch_id)))
        elif pending.purpose == "fence" and pending.shard in self.replicas:
            # Stepped in this turn's ``_expire`` (not inside the step whose effect asked it).
            self._requests_failed.append((pending.shard, p.FenceQuestionUnsent(pending.core, pending.question, why)))
            self._warn_fence_unconfirmed(self.replicas[pending.shard], why)
        elif pending.purpose == "probe":
            probe = self.probes.get(pending.shard or "")
            if probe is not None and probe.probe_id == pending.probe_id:
                probe.answers[pending.core] = None
                probe.unsent[pending.core] = why  # for the status: not "did not answer"
                if set(probe.answers) >= set(probe.cores):
                    probe.deadline_ms = self.clock_ms()  # nothing to wait for: ends in this turn's _expire

    def frame_unsent(self, message: Message, why: str) -> None:
        """A request to a core was dropped at the turn's send (``why``: its queue is full): nothing of
        it left, so whoever waits on it is told now (``_not_sent``), not at its timeout; a probe's
        status then says the core was not asked, and why, not that it did not answer."""
        pending = self.pending.get(message.request_id)
        if pending is None or pending.purpose in ("forward", "read_index"):
            return  # not a request of ours (an acknowledgement); a client's is sent at once, never queued
        del self.pending[message.request_id]
        self._not_sent(pending, f"{message.kind} to {pending.core} not sent: {why}")

    def _send_at_once(self, core: str, message: Message) -> str | None:
        """Send ``message`` to ``core`` now, not after the turn's commit; None once sent, else why
        nothing was sent (no socket for it, core_queue_bytes_max of earlier frames still queued toward
        it, its queue is full, the socket failed)."""
        try:
            frame = messages.encode(message)
        except MessageError as error:
            return str(error)  # the message's fault, not the core's
        unsent = self._send_frame_at_once(core, frame)
        if unsent is not None:
            self._send_failed_ms[core] = self.clock_ms()  # skipped for clients' requests a moment
        return unsent

    def _send_frame_at_once(self, core: str, frame: bytes) -> str | None:
        """``_send_at_once`` of an encoded frame."""
        socket = self.core_sockets.get(core)
        if socket is None:
            return "this replicant has no connection to it"
        try:
            return self.send_bounded(core, socket, frame)
        except zmq.Again:
            return "its queue is full (the core is away or does not read)"
        except zmq.ZMQError as error:
            return str(error)

    # -- full disk (rlog.disk) ----------------------------------------------------------------

    def abandon_turn(self, reason: str = "the disk failed") -> None:
        # The turn's acknowledgements wait for its commit outside the outbox (``before_send``): they
        # acknowledge applies the rollback undid, and must leave no more than its peer frames.
        super().abandon_turn(reason)
        self._acks = {}

    def _logged_end(self, shard: str, applied: TxKey, digest: bytes) -> tuple[TxKey, bytes]:
        """Where the replica of ``shard`` goes on from: the applied key, or, when the store logged
        committed entries past it (its apply waited at a name another shard held: ``Store.name_waits``,
        lost at a restart), the log's end, once those entries are applied as far as they go now."""
        logged_key, logged_digest = self.store.last_entry(shard)
        if logged_key <= applied:
            return applied, digest
        if not self.disk.full:
            self.begin()
            self.store.apply_committed(shard, logged_key, healing=bool(int(self.store.meta(f"read_fenced:{shard}", 0))))
            self._warn_name_wait(shard)
        return logged_key, logged_digest

    def _apply_name_waits(self) -> None:
        """Apply again, up to their log's end (all committed here), the shards whose apply waited at a
        name another shard held, once an apply let the name go (``Store.name_waits_due``). Each try either
        applies or records the wait again at the current catalog: the loop ends."""
        while due := self.store.name_waits_due():
            for shard in due:
                replica = self.replicas.get(shard)
                self.begin()
                self.store.apply_committed(
                    shard, self.store.last_entry(shard)[0], healing=replica is not None and replica.read_fenced
                )
                self._warn_name_wait(shard)

    def _warn_name_wait(self, shard: str) -> None:
        wait = self.store.name_waits.get(shard)
        if wait is not None:
            self.warnings.log(f"name wait {shard}", logging.WARNING, "%s", wait.describe(), logger=log)

    def _name_wait_status(self, shard: str) -> dict[str, Any] | None:
        wait = self.store.name_waits.get(shard)
        if wait is None:
            return None
        position = self.store.shard(shard)
        return {**wait.to_json(), "store_applied": list(position.applied) if position is not None else None}

    def _readable_at(self, shard: str, key: TxKey) -> bool:
        """Whether the replica of ``shard`` serves a read that must see ``key``: readable there, and the
        store applied it (a waiting apply, ``Store.name_waits``, stays behind what the replica logged)."""
        replica = self.replicas.get(shard)
        if replica is None or not replica.readable_at(key):
            return False
        wait = self.store.name_waits.get(shard)
        return wait is None or key < wait.tx_key

    def disk_filled(self) -> None:
        """The turn was rolled back: each replica takes back the position and the spill on disk and
        applies nothing."""
        for shard, replica in list(self.replicas.items()):
            position = self.store.shard(shard)
            if position is None:
                replica.forget()  # its spill's bytes go back to the node's budget
                del self.replicas[shard]  # created in the rolled-back turn: discovered again later
                # Its probe too: ``_expire`` ends only the probes of known replicas, and this one's
                # deadline, once past, would make every turn poll without waiting (a busy loop).
                self.probes.pop(shard, None)
                continue
            fenced = bool(int(self.store.meta(f"read_fenced:{shard}", 0)))
            spilled, spilled_bytes = self.store.spilled(shard), self.store.spilled_bytes(shard)
            logged_key, logged_digest = self._logged_end(shard, position.applied, position.digest)
            full = DiskFull(self.disk.error, logged_key, logged_digest, fenced, spilled, spilled_bytes)
            self._step(replica, full)

    def disk_freed(self) -> None:
        for replica in list(self.replicas.values()):
            self._step(replica, DiskFreed())

    # -- machine effects ---------------------------------------------------------------------

    def before_send(self) -> None:
        """The turn's acknowledgements, after its commit (they follow what they acknowledge)."""
        acks, self._acks = self._acks, {}
        for (core, _, _), body in acks.items():
            self.queue(self.core_sockets[core], Message("push_ack", "ack", body))

    def _step(self, replica: ShardReplica, event: Any) -> None:
        for effect in replica.step(event, self.clock_ms()):
            self._execute(replica, effect)
        if self.store.name_waits:
            self._warn_name_wait(replica.shard)
            self._apply_name_waits()

    def _execute(self, replica: ShardReplica, effect: Any) -> None:
        shard = replica.shard
        now = self.clock_ms()
        if isinstance(effect, p.ProbeJournals):
            self.probes_sent += 1
            probe = Probe(effect.cores, {}, now + self.replica_config.probe_timeout_ms, self.probes_sent)
            self.probes[shard] = probe
            for core in effect.cores:
                pending = Pending("probe", core, now + REQUEST_TIMEOUT_MS, shard, probe_id=probe.probe_id)
                self._request(core, "journal", {}, pending)
        elif isinstance(effect, p.SendWatch):
            # the protocol both speak (rlog.versions): a core of release 0.1.0 reads only 1
            protocol = replication_protocol_for(self.core_versions.get(effect.core), self.versions)
            body = {
                "shard": shard,
                "replicant": self.config.name,
                "endpoint": self.config.listen,
                "from": list(effect.from_key),
                "from_digest": effect.from_digest,
                "protocol": protocol,
                "watch_id": effect.watch_id,
            }
            if watch_tells_frame_bytes_max(protocol):  # the agent pushes within it (core.agent, "Frame limit")
                body["frame_bytes_max"] = self.config.limits.frame_bytes_max
            pending = Pending("watch", effect.core, now + REQUEST_TIMEOUT_MS, shard, watch_id=effect.watch_id)
            self._request(effect.core, "watch", body, pending)
        elif isinstance(effect, p.ApplyEntries):
            self.begin()
            # Until its read fence opens, a replica is still healing its bootstrap copy (Store.apply_ops).
            healing = self.replicas[shard].read_fenced if shard in self.replicas else False
            self.apply_entries(self.store, effect.entries, healing)
        elif isinstance(effect, p.ResetShard):
            self.begin()
            self.store.reset_shard(shard)
        elif isinstance(effect, p.FetchTables):
            pending = Pending("tables", effect.core, now + REQUEST_TIMEOUT_MS, shard, watch_id=replica.watch_id)
            self._request(effect.core, "list_tables", {}, pending)
        elif isinstance(effect, p.FetchBatch):
            # A batch within this replicant's frames, as the core bounds it within its own (release
            # 0.1.0 reads the field too): an answer above frame_bytes_max would be dropped unread.
            body: dict[str, Any] = {"table": effect.table, "limit": effect.limit, "bytes_max": self._batch_bytes_max()}
            if effect.after is not None:
                body["after"] = effect.after
            detail = {"table": effect.table, "after": effect.after, "limit": effect.limit}
            pending = Pending("batch", effect.core, now + REQUEST_TIMEOUT_MS, shard, detail, replica.watch_id)
            self._request(effect.core, "bootstrap_batch", body, pending, at_once=True)
        elif isinstance(effect, p.ApplyBatch):
            self.begin()
            self.store.write_rows(effect.table, effect.rows)
        elif isinstance(effect, p.SpillEntries):
            self.begin()
            self.store.spill(effect.entries)
        elif isinstance(effect, p.ReplaySpill):
            self.begin()
            self.store.replay_spill(shard, effect.start_key, effect.start_digest, int(time.time() * 1000))
        elif isinstance(effect, p.SendAck):
            # The turn's last acknowledgement of an agent wins: its key and the token of the last push read.
            self._acks[(effect.core, shard, effect.agent_id)] = ack_body(shard, effect)
        elif isinstance(effect, p.SendReject):
            self.pushes_rejected[shard] = self.pushes_rejected.get(shard, 0) + 1
            self.warnings.log(
                f"push rejected: {effect.reason}",  # one of the replica's few REJECT_ reasons
                logging.INFO,
                "shard %s: rejected a push of agent %s from %s: %s",
                shard,
                effect.agent_id,
                effect.core,
                effect.reason,
                logger=log,
            )
            body = {"shard": shard, "agent": effect.agent_id, "applied": list(replica.applied_key)}
            body["rejected"] = effect.reason
            self.queue(self.core_sockets[effect.core], Message("push_ack", "ack", body))
        elif isinstance(effect, p.FetchCommitted):
            # read_index: the sequencer's quorum-confirmed committed key, at least any key a batch saw.
            pending = Pending("fence", effect.core, now + REQUEST_TIMEOUT_MS, shard, question=effect.question)
            self._request(effect.core, "read_index", {"shard": shard}, pending)
        elif isinstance(effect, p.ReadFenceChanged):
            self.begin()
            self.store.set_meta(f"read_fenced:{shard}", int(effect.fenced))
            log.info(
                "shard %s: reads %s",
                shard,
                "fenced until the replay reaches the committed key" if effect.fenced else "served again",
            )
        elif isinstance(effect, p.ModeChanged):
            # A warning (a bootstrap begun again for want of retention) is said once, at the mode change.
            level = logging.WARNING if effect.warning else logging.INFO
            log.log(level, "shard %s: %s (upstream %s): %s", shard, effect.mode.value, effect.upstream, effect.reason)
            if self.disk.full:
                return  # only counters for the status: persisted at the next change
            status = replica.status()
            self.begin()
            self.store.set_meta(f"bootstraps:{shard}", status.bootstraps)
            self.store.set_meta(f"resumes:{shard}", status.resumes)
            self.store.set_meta(f"bootstraps_outrun:{shard}", status.bootstraps_outrun)
        else:
            raise TypeError(f"unknown effect {effect!r}")

    @staticmethod
    def apply_entries(store: Store, entries: tuple[Any, ...], healing: bool = False) -> None:
        """``ApplyEntries``, inside the caller's transaction (also what benchmarks/bench_catchup.py times).

        The replica verified the digest chain before emitting the effect; the store checks the links.
        ``healing``: the replay over a bootstrap copy, before the read fence opens (Store.apply_ops).
        """
        store.log_and_apply_verified(entries, int(time.time() * 1000), healing)

    # -- answers from cores ------------------------------------------------------------------

    def _receive_answers(self, core: str, socket: zmq.Socket) -> None:
        for _ in range(self.config.limits.group_commit_max):
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                answer = messages.decode(frame, self.config.limits.frame_bytes_max)
            except MessageError as error:
                if error.code == "frame_too_large":
                    self._answer_too_large(core, frame, str(error))
                continue
            self._core_heard_ms = self.clock_ms()
            pending = self.pending.pop(answer.request_id, None)
            if pending is None:
                continue  # late answer to a request we gave up on
            self._on_answer(pending, answer, len(frame))

    def _answer_too_large(self, core: str, frame: bytes, error: str) -> None:
        """An answer above this replicant's ``frame_bytes_max`` (a core with a larger one, or of a
        release that does not bound its answers by it): dropped unread, said (throttled), and the
        request it answers fails now with why (``_not_sent``), not silently at its timeout; a client's
        forwarded write is answered ``outcome_unknown`` at once (the core may have committed it), a
        read whose read index it answers is refused at once."""
        self.warnings.log(
            "answer too large",
            logging.WARNING,
            "an answer from core %s was dropped: %s; raise [limits] frame_bytes_max on this replicant",
            core,
            error,
            logger=log,
        )
        request_id = request_id_of(frame)
        pending = self.pending.get(request_id)
        if pending is None or pending.core != core:
            return  # a late answer to a request given up on, or not this core's
        del self.pending[request_id]
        why = f"the answer of core {core} was too large for replicant {self.config.name} and dropped: {error}"
        if pending.purpose == "forward":
            # The core may have committed the write (its answer says so, unread): the client asks
            # again with the same request id (core.outcome), which is idempotent.
            self.reply(pending.detail["envelope"], messages.error(request_id, "outcome_unknown", why))
        elif pending.purpose == "read_index":
            self._refuse_read(pending, why)  # a read changes nothing: its outcome is never unknown
        else:
            self._not_sent(pending, why)

    def _refuse_read(self, pending: Pending, why: str) -> None:
        """Refuse the linearizable read whose read index ``pending`` asked (``no_sequencer``, with the
        client's request id: not the one this replicant gave its read_index request), unless answered
        already: its gather decides once."""
        if pending.detail["gather"].arrived(pending.detail["shard"], None) != GATHER_FAILED:
            return
        client_request_id = pending.detail["message"].request_id
        self.reply(pending.detail["envelope"], messages.error(client_request_id, "no_sequencer", why))

    def _batch_bytes_max(self) -> int:
        """The bytes of rows a bootstrap batch may hold: half of this replicant's frame, as a core bounds
        its own batches (``bootstrap.read_service``), so that the answer fits whichever limit is lower."""
        return max(1, self.config.limits.frame_bytes_max // 2)

    def _on_answer(self, pending: Pending, answer: Message, frame_bytes: int | None = None) -> None:
        if pending.purpose in ("forward", "read_index"):
            answer = relayed(answer)  # a client's request: the core's answer becomes this node's
        error = answer.body if answer.kind == "error" else None
        result = answer.body.result if answer.kind == "reply" else None
        if pending.purpose == "forward":
            self.reply(pending.detail["envelope"], answer)
            return
        if pending.purpose == "read_index":
            envelope, message, gather = pending.detail["envelope"], pending.detail["message"], pending.detail["gather"]
            answered = messages.answer_as(result, messages.ReadIndexAnswer) if error is None else None
            committed = answered.committed if answered is not None else None
            step = gather.arrived(pending.detail["shard"], committed)
            if step == GATHER_FAILED:
                self.reply(
                    envelope,
                    messages.error(
                        message.request_id,
                        error.code if error else "bad_answer",
                        error.message if error else "malformed read_index answer",
                        error.detail if error else None,
                    ),
                )
            elif isinstance(step, dict):
                self._wait_for(envelope, message, step)
            return
        if pending.purpose == "fence":
            answered = messages.answer_as(result, messages.ReadIndexAnswer) if error is None else None
            committed = answered.committed if answered is not None else None
            why = None
            if error is not None:
                why = f"{pending.core} refused read_index: {error.code}: {error.message}"
            elif committed is None:
                why = f"{pending.core} answered read_index with a malformed answer"
            self._fence_answered(pending, committed, why)
            return
        if pending.purpose in ("discover", "probe") and error is not None:
            # Not silence: the core answered, and why it refused is what the operator needs (a key
            # without the replicant role is refused every probe and discovery, and follows nothing).
            self.warnings.log(
                f"journal refused by {pending.core}",  # one line a second per core, whatever the words
                logging.WARNING,
                "core %s refused this replicant's journal request: %s: %.300s",
                pending.core,
                error.code,
                error.message,
                logger=log,
            )
        if pending.purpose == "discover":
            # A core's answer is untrusted input: only well-named shards it states an answer for.
            shards = result.get("shards") if isinstance(result, dict) else None
            for shard in shards if isinstance(shards, dict) else ():
                if (
                    shard not in self.replicas
                    and _valid_shard_name(shard)
                    and p.journal_answer(result, shard, self.versions)
                ):
                    if len(self.replicas) >= SHARDS_MAX:  # no core holds more: a core's answer is untrusted
                        too_many = f"{pending.core} reports over {SHARDS_MAX} shards"
                        self.warnings.log("too many shards", logging.WARNING, "%s; following the first ones", too_many)
                        break
                    self._open_replica(shard)
            return
        replica = self.replicas.get(pending.shard or "")
        if replica is None:
            return
        if pending.purpose == "probe":
            probe = self.probes.get(replica.shard)
            if probe is None or probe.probe_id != pending.probe_id:
                return  # an answer to a probe that ended (timed out): not this one's
            self._note_versions(pending.core, result)
            probe.answers[pending.core] = p.journal_answer(result, replica.shard, self.versions)
            unreadable = p.unreadable_log(result, replica.shard, self.versions)
            if unreadable is not None:
                probe.unreadable[pending.core] = unreadable
            if error is not None:
                probe.refused[pending.core] = f"{error.code}: {error.message}"
            if set(probe.answers) >= set(probe.cores):
                self._finish_probe(replica)
        elif pending.purpose == "watch":
            if error is not None:
                # Said (throttled: the replica retries at its pace) as well as shown in its last_error.
                self.warnings.log(
                    "watch refused",
                    logging.WARNING,
                    "shard %s: watch refused by %s: %s: %.1000s",
                    replica.shard,
                    pending.core,
                    error.code,
                    error.message,
                    logger=log,
                )
                self._step(replica, p.WatchRefused(pending.core, f"{error.code}: {error.message}"))
                return
            accepted = watch_accepted(pending.core, result)
            if accepted is None:
                self._step(replica, p.RequestFailed(pending.core, "malformed watch answer", pending.watch_id))
                return
            self._step(replica, accepted)
        elif pending.purpose == "tables":
            if self.disk.full:
                return  # a bootstrap's answer: the replica takes nothing while full, it asks again later
            if not replica.takes_tables(pending.core, pending.watch_id):
                return  # stale (an earlier attempt's): its definitions may be older than the ones held
            try:
                if error is not None:
                    raise CopyFailed(f"list_tables failed: {error.code}: {error.message}")
                mine = tables_from_answer(result, replica.shard)
                ops = copy_schema_ops(self.store.catalog(), replica.shard, mine)
            except CopyFailed as failure:
                self._step(replica, p.RequestFailed(pending.core, str(failure), pending.watch_id))
                return
            self.begin()
            self.store.apply_ops(ops)
            names, keys = tuple(t.name for t in mine), tuple(t.key_column for t in mine)
            self._step(replica, p.TablesReceived(pending.core, names, keys, pending.watch_id))
        elif pending.purpose == "batch":
            detail = pending.detail
            after = detail["after"]
            batch = batch_from_answer(pending.core, detail["table"], after, result, frame_bytes, pending.watch_id)
            if error is not None or batch is None:
                # The core's words (as for a table list), not the typed body's repr, nor "None".
                why = f"{error.code}: {error.message}" if error is not None else "malformed bootstrap_batch answer"
                self._step(replica, p.RequestFailed(pending.core, f"bootstrap batch failed: {why}", pending.watch_id))
                return
            # Checked before the replica takes it: a row SQLite refuses raised out of the turn (the
            # process died), and a failed write is too late for the batch that ends the copy (the
            # replica replays its spill in the same step).
            table = self.store.catalog().get(detail["table"])
            refused = rows_refusal(table, batch.rows) if table is not None else None
            if refused is not None:
                why = f"bootstrap batch refused: {refused}"
                self._step(replica, p.RequestFailed(pending.core, why, pending.watch_id))
                return
            self._step(replica, batch)
            self._log_progress(replica)

    def _fence_answered(self, pending: Pending, committed: TxKey | None, why: str | None) -> None:
        """The answer to a read fence's question (``FetchCommitted``): the committed key, or None and why,
        which the replica's status shows (``read_fence_error``) and the log says (throttled: it is asked
        again every failure_timeout_ms for as long as its upstream refuses)."""
        replica = self.replicas.get(pending.shard or "")
        if replica is None:
            return
        self._step(replica, p.CommittedReceived(pending.core, committed, pending.question, why))
        if why is not None:
            self._warn_fence_unconfirmed(replica, why)

    def _warn_fence_unconfirmed(self, replica: ShardReplica, why: str) -> None:
        """A throttled warning: the replica's reads stay fenced, its fence key not told, and ``why``."""
        if replica.read_fenced:
            self.warnings.log(
                f"read fence unconfirmed {replica.shard}",  # bounded: one per shard
                logging.WARNING,
                "shard %s: reads stay fenced after its bootstrap, the committed key not told: %.300s",
                replica.shard,
                why,
                logger=log,
            )

    def _log_progress(self, replica: ShardReplica) -> None:
        """At most every PROGRESS_LOG_INTERVAL_MS while copying: rows, bytes, rate and ETA."""
        now = self.clock_ms()
        if replica.mode is not p.Mode.BOOTSTRAP or now < self._next_progress_log_ms.get(replica.shard, 0):
            return
        self._next_progress_log_ms[replica.shard] = now + PROGRESS_LOG_INTERVAL_MS
        status = replica.status()
        eta = f"{status.copy_eta_ms / 1000:.0f} s" if status.copy_eta_ms is not None else "unknown"
        log.info(
            "shard %s: bootstrap copied %d of about %d rows, %.1f MB, %.0f rows/s, ETA %s",
            replica.shard,
            status.copy_rows,
            status.copy_rows_expected,
            status.copy_bytes / 1e6,
            status.copy_rows_per_s,
            eta,
        )

    def _finish_probe(self, replica: ShardReplica) -> None:
        probe = self.probes.pop(replica.shard, None)
        if probe is None:
            return
        ages = tuple((core, probe.answers.get(core)) for core in probe.cores)
        unreadable, unsent = tuple(sorted(probe.unreadable.items())), tuple(sorted(probe.unsent.items()))
        self._step(replica, p.JournalsReceived(ages, unreadable, unsent, tuple(sorted(probe.refused.items()))))

    def _expire(self, now: int) -> None:
        failed, self._requests_failed = self._requests_failed, []
        for shard, event in failed:  # requests not sent (``_not_sent``): failed (a fence: told) at once
            if shard in self.replicas:
                self._step(self.replicas[shard], event)
        for request_id in [r for r, pending in self.pending.items() if pending.deadline_ms <= now]:
            pending = self.pending.pop(request_id)
            if pending.purpose == "read_index":
                self._refuse_read(
                    pending, f"core {pending.core} did not confirm the committed key of shard {pending.shard} in time"
                )
            elif pending.purpose == "forward":
                self.reply(
                    pending.detail["envelope"],
                    messages.error(request_id, "outcome_unknown", f"core {pending.core} did not answer in time"),
                )
            elif pending.purpose == "fence":
                self._fence_answered(pending, None, f"{pending.core} did not answer read_index in time")
            elif pending.purpose in ("watch", "tables", "batch") and pending.shard in self.replicas:
                failed = p.RequestFailed(pending.core, f"{pending.purpose} timed out", pending.watch_id)
                self._step(self.replicas[pending.shard], failed)
        for shard in [s for s, probe in self.probes.items() if probe.deadline_ms <= now]:
            if shard in self.replicas:
                self._finish_probe(self.replicas[shard])
        for read in self.waiting_reads.expired(now):
            envelope, message = read.payload
            self.reply(envelope, messages.error(message.request_id, "timeout", read.describe()))

    def no_core_reached(self) -> str | None:
        """Why this replicant serves nothing, if no core has answered it for ``NO_CORE_WARNING_MS``."""
        silent_ms = self.clock_ms() - self._core_heard_ms
        if silent_ms < NO_CORE_WARNING_MS:
            return None
        endpoints = ", ".join(f"{name} {self.config.core_nodes[name]}" for name in self.cores)
        return (
            f"no core has answered for {silent_ms // 1000} s (core_nodes: {endpoints}); "
            "are the cores running, and is [cluster] core_nodes right?"
        )

    def _warn_if_no_core(self, now: int) -> None:
        if self._no_core_logged_ms is not None and now - self._no_core_logged_ms < NO_CORE_WARNING_MS:
            return
        reason = self.no_core_reached()
        if reason is not None:
            self._no_core_logged_ms = now
            log.warning("replicant %s reaches no core: %s", self.config.name, reason)

    def _discover(self, now: int) -> None:
        """Ask one core (round robin) which shards exist, so that new shards get a replica."""
        if now < self._next_discovery_ms or not self.cores or self.disk.full:
            return
        self._next_discovery_ms = now + DISCOVERY_INTERVAL_MS
        core = self.cores[self._discovery_turn % len(self.cores)]
        self._discovery_turn += 1
        self._request(core, "journal", {}, Pending("discover", core, now + REQUEST_TIMEOUT_MS))

    # -- requests from clients and agents ----------------------------------------------------

    def _serve_waiting(self) -> None:
        self.serve_frames()

    def _dispatch(self, envelope: list[bytes], message: Message, principal: str = "") -> None:
        body = message.body
        if message.kind == "push":
            with collector_paused():  # left once _on_push's locals (the decoded rows) are freed
                self._on_push(body)
        elif message.kind in WRITE_KINDS:
            # Its write would come back through the rlog, which this replicant cannot apply now.
            self.refuse_if_disk_full()
            self._forward(envelope, message)
        elif message.kind == "status":
            self.reply(envelope, messages.reply(message.request_id, self.status()))
        elif message.kind == "stop":
            self.reply(envelope, messages.reply(message.request_id, self.stop_request(principal)))
        else:
            self.refuse_held_again(envelope, message)
            self._dispatch_read(envelope, message)

    def _dispatch_read(self, envelope: list[bytes], message: Message) -> None:
        """A read, a query, a changefeed page or a backup (its id not held on its connection already)."""
        body = message.body
        if message.kind in ("get", "scan", "count"):
            self._read(envelope, message)
        elif message.kind == "query":
            self._query(envelope, message)
        elif message.kind in ("query_page", "query_close"):
            self.query_cursor_request(envelope, message)
        elif message.kind == "changes":
            self.changes_request(envelope, message, self._serving, read_batch)
        elif message.kind in read_service.KINDS and message.kind != "bootstrap_batch":  # cores serve bootstraps
            # Range requests, the catalog and this replicant's own rlog (what it applied, as far as it
            # retains it): answered now, whatever the read's consistency.
            table = None
            if message.kind in read_service.TABLE_KINDS:
                table = self._table(body.table)
                self._serving(table.shard)
            self.reply(envelope, messages.reply(message.request_id, self._read_now(table, message)))
        elif message.kind in BACKUP_KINDS:
            self.reply(envelope, self.backup_request(message, self._backup_not_ready))
        elif message.kind == "members":
            raise RequestError("not_a_core", self._no_membership())
        elif message.kind in ("journal", "watch", "force_start", "peer", "read_index"):
            raise RequestError("not_a_core", f"{self.config.name} is a replicant; send {message.kind} to a core")
        else:
            raise RequestError("bad_request", f"{message.kind} is not a request")

    def _no_membership(self) -> str:
        """The answer to ``members`` (``cluster members`` at a replicant's endpoint): a replicant is in no
        membership, so say so and name the core to ask, the one it watches (what an operator who
        asked the wrong node needs next), or, watching none now, the cores its config names."""
        watched = sorted({replica.upstream for replica in self.replicas.values() if replica.upstream is not None})
        if watched:
            core = watched[0]
            where = f"it watches core {core} ({self.config.core_nodes[core]})"
            ask = f"mnesite cluster members --node {self.config.core_nodes[core]}"
        else:
            cores = ", ".join(f"{name} ({self.config.core_nodes[name]})" for name in self.cores)
            where, ask = f"it watches no core now; its cores: {cores}", "mnesite cluster members --node CORE"
        return f"{self.config.name} is a replicant: it has no membership, only cores do; {where}; ask a core: {ask}"

    def _backup_not_ready(self) -> str | None:
        """Why a backup taken now would not hold a committed state of every shard (None: it would)."""
        for shard, replica in sorted(self.replicas.items()):
            status = replica.status()
            if status.mode in (p.Mode.BOOTSTRAP, p.Mode.LOCAL_REPLAY) or status.read_fenced:
                # A bootstrap's dirty-read copy is consistent only once the replay passed the read fence.
                return f"shard {shard} is bootstrapping ({status.mode.value}): its rows are not a committed state yet"
        return None

    def _on_push(self, body: messages.Push) -> None:
        replica = self.replicas.get(body.shard)
        if replica is None:
            return
        if body.core not in self.core_sockets:
            self.warnings.log(
                "push: unknown core", logging.WARNING, "push from unknown core %.64r ignored", body.core, logger=log
            )
            return
        try:
            push = push_received(replica, body)
        except messages.MessageError as error:
            self.warnings.log(
                "push: malformed", logging.WARNING, "malformed push from %.64s: %.300s", body.core, error, logger=log
            )
            return
        self._core_heard_ms = self.clock_ms()
        self._step(replica, push)

    def _serving(self, shard: str) -> ShardReplica:
        """The shard's replica if it serves reads (every kind: get, scan, range requests); else not_ready.

        The replica decides (``ShardReplica.readable``): NORMAL, and past the read fence of its last
        bootstrap.
        """
        replica = self.replicas.get(shard)
        if replica is not None and replica.readable():
            return replica
        if replica is None:
            detail = "shard unknown"
        else:
            status = replica.status()
            detail = f"mode {status.mode.value}, rows copied {status.rows_copied}"
            detail += f", entries buffered {status.entries_buffered}, applied {status.applied_key}"
            if status.read_fenced:
                fence = status.read_fence or "the committed key being asked for"
                detail += f", replaying after its bootstrap up to {fence}"
                if status.read_fence_error:  # why that key is not known yet (read_fence_error)
                    detail += f"; that key was not told at the last ask: {status.read_fence_error}"
            detail += "; retry later"
        raise RequestError("not_ready", f"replicant {self.config.name} cannot serve shard {shard} yet ({detail})")

    def _forward(self, envelope: list[bytes], message: Message) -> None:
        """Writes never originate here: send them to a core, which orders them through the sequencer.

        Sent at once (it reveals nothing this node must persist first), so that one that could not
        be sent is answered now, ``no_sequencer`` with nothing sent, as a core answers a write it
        cannot send to its sequencer (``CoreNode._unsent``), not as outcome unknown at its timeout."""
        now = self.clock_ms()
        check_client_requests_room(len(self.pending), 1, PENDING_REQUESTS_MAX)
        self.hold(envelope, message.request_id)  # bounded per client connection (requests_outstanding_max)
        core = self._send_to_a_core([r.upstream for r in self.replicas.values()], message)
        if isinstance(core, RequestError):
            # Answered now, which gives the hold back; an earlier send of this request id, still
            # pending, keeps waiting for its own answer.
            self.refuse(envelope, message.request_id, core)
            return
        earlier = self.pending.get(message.request_id)  # the words of core.outcome's rule 4 (a layer above)
        if earlier is not None and earlier.purpose == "forward":
            # core.outcome rule 4: a client that heard nothing resends the same request id, often on a
            # new connection; the core's one answer goes to the newest, and the earlier one would
            # otherwise wait for ever, holding its connection's place (requests_outstanding_max).
            del self.pending[message.request_id]
            self.reply(
                earlier.detail["envelope"],
                messages.error(
                    message.request_id, "outcome_unknown", "the request was sent again; the answer goes to the newest"
                ),
            )
            self.hold(envelope, message.request_id)  # still held if that was this same connection
        self.pending[message.request_id] = Pending(
            "forward", core, now + FORWARD_TIMEOUT_MS, detail={"envelope": envelope}
        )

    def _table(self, name: Any) -> TableSchema:
        table = self.store.catalog().get(name) if isinstance(name, str) else None
        if table is None:
            raise self.unknown_table(f"unknown table {name!r}")
        return table

    def unknown_table(self, message: str) -> RequestError:
        # A replicant cut off from every core knows no table: say why, not only "unknown" (reads,
        # queries and changefeeds alike).
        lonely = self.no_core_reached()
        hint = f" (replicant {self.config.name}: {lonely})" if lonely else ""
        return RequestError("unknown_table", f"{message}{hint}")

    def _read(self, envelope: list[bytes], message: Message) -> None:
        body = message.body
        fresh = body.consistency == "linearizable" or body.min_key is not None or bool(body.min_keys)
        table = self.store.catalog().get(body.table)
        if table is not None:
            self._serving(table.shard)
        # A read that must see a key may name a table that key's write created (the held-read
        # rule, replicant.reads): it waits rather than answer unknown_table too early.
        shards = shards_to_wait_on(table.shard if table else None, fresh, self.replicas)
        if shards is None:
            table = self._table(body.table)  # raises unknown_table, with why if no core is reached
        if body.consistency == "linearizable":
            self._ask_read_indexes(envelope, message, shards)
            return
        targets = read_targets(shards or (), body.min_key, body.min_keys)
        if targets:
            self._wait_for(envelope, message, targets)
            return
        if table is None:  # none of the keys it must see is of a shard it could be in: it does not exist
            table = self._table(body.table)
        self._answer_read(envelope, message, table)

    def _answer_read(self, envelope: list[bytes], message: Message, table: TableSchema | None) -> None:
        """Answer a read whose shard is readable now; a ``count`` runs on a query worker instead, from
        the key applied now (``NodeServer.count_later``: never a whole table read on the loop)."""
        replica = self.replicas.get(table.shard) if table is not None else None
        if (
            message.kind == "count"
            and replica is not None
            and self.count_later(envelope, message.request_id, table, replica.applied_key)
        ):
            return
        self.reply(envelope, messages.reply(message.request_id, self._read_now(table, message)))

    def _ask_read_indexes(self, envelope: list[bytes], message: Message, shards: list[str] | tuple[str, ...]) -> None:
        """Learn each shard's committed key from its sequencer (quorum-confirmed); ``_wait_for`` follows.
        The request is held from here (bounded per connection) and answered exactly once: refused now,
        or by the gather's failure, its expiry or ``_wait_for``."""
        check_client_requests_room(len(self.pending), len(shards), PENDING_REQUESTS_MAX)
        self.hold(envelope, message.request_id, changes=False)  # may refuse (overloaded): then nothing is asked
        gather = ReadIndexGather(tuple(shards))
        for shard in shards:
            # Sent at once (a read persists nothing first), so that one that could not be sent fails
            # the read now, no_sequencer with nothing sent, as a forward does (``_forward``), not at
            # its timeout; the room for its pending entry was checked above.
            request = Message("read_index", new_request_id(), {"shard": shard})
            core = self._send_to_a_core([self.replicas[shard].upstream], request)
            if isinstance(core, RequestError):
                gather.arrived(shard, None)  # the read is refused once; no other shard is asked
                self.refuse(envelope, message.request_id, core)
                return
            detail = {"envelope": envelope, "message": message, "shard": shard, "gather": gather}
            self.pending[request.request_id] = Pending(
                "read_index", core, self.clock_ms() + REQUEST_TIMEOUT_MS, shard, detail
            )

    def _query(self, envelope: list[bytes], message: Message, index_keys: dict[str, TxKey] | None = None) -> None:
        """A query (rlog.query): checked, then held until each shard it reads reached its target.

        Linearizable: each shard's read index comes from its sequencer like a linearizable read's
        (``_read``'s gather); the query is checked again once they are all in (``index_keys``).
        """
        request, checked, shards = self.query_received(message)
        for shard in shards:
            self._serving(shard)
        targets = read_targets(shards, request.min_key, request.min_keys)
        if request.consistency == "linearizable" and shards and index_keys is None:
            self._ask_read_indexes(envelope, message, shards)
            return
        for shard, key in (index_keys or {}).items():
            targets[shard] = max(key, targets.get(shard, key))
        self.query_wait(envelope, message, request, checked, shards, targets)

    def _query_shard_reached(self, shard: str, key: TxKey) -> bool:
        return self._readable_at(shard, key)

    def _wait_for(self, envelope: list[bytes], message: Message, targets: dict[str, TxKey]) -> None:
        """Answer the read once every target shard has applied its key (bounded wait and count).

        Called from ``_on_answer`` too (the read indexes arrived), outside ``_serve_waiting``'s
        dispatch: a refusal is answered here, never raised out of the loop turn."""
        try:
            if message.kind == "query":
                self._query(envelope, message, targets)
                return
            wait_ms = READ_WAIT_MS_MAX if message.body.wait_ms is None else min(READ_WAIT_MS_MAX, message.body.wait_ms)
            if len(self.waiting_reads) >= WAITING_READS_MAX:
                raise OverloadedError("too many reads waiting")
            self.hold(envelope, message.request_id, changes=False)  # may refuse (overloaded): then nothing waits
            self.waiting_reads.hold((envelope, message), message.body.table, targets, self.clock_ms() + wait_ms)
        except (RequestError, SchemaError, OverloadedError) as error:
            self.refuse(envelope, message.request_id, error)

    def _read_now(self, table: TableSchema | None, message: Message) -> Any:
        limits = self.config.limits
        return read_service.answer_read(
            self.store, message.kind, message.body, table, limits.scan_rows_max, limits.frame_bytes_max
        )

    def _answer_waiting_reads(self) -> None:
        if not self.waiting_reads:
            return
        catalog = self.store.catalog()

        def shard_of(name: str) -> str | None:
            table = catalog.get(name)
            return table.shard if table is not None else None

        for read in self.waiting_reads.ready(shard_of, self._readable_at):
            envelope, message = read.payload
            try:
                self._answer_read(envelope, message, self._table(message.body.table))
            except (RequestError, SchemaError, OverloadedError) as error:
                self.refuse(envelope, message.request_id, error)

    def status(self) -> dict[str, Any]:
        shards = {}
        for shard, replica in sorted(self.replicas.items()):
            status = replica.status()
            shards[shard] = {
                "mode": status.mode.value,
                "upstream": status.upstream,
                "agent": status.agent_id,
                "applied": list(status.applied_key),
                # None while unknown: from a bootstrap's reset until its replay (p.UNKNOWN_DIGEST).
                "digest": status.applied_digest.hex() if status.applied_digest != p.UNKNOWN_DIGEST else None,
                "committed": list(status.committed_key) if status.committed_key else None,
                # whether the upstream hears the sequencer: its journal answer, then its pushes
                "hears_sequencer": status.hears_sequencer,
                "lag_entries": status.lag_entries,
                "bootstraps": status.bootstraps,
                # of them, begun again because the last copy outlasted the cores' retention
                "bootstraps_outrun": status.bootstraps_outrun,
                "resumes": status.resumes,
                "rows_copied": status.rows_copied,
                "copy": {
                    "rows": status.copy_rows,
                    "rows_expected": status.copy_rows_expected,
                    "bytes": status.copy_bytes,
                    "rows_per_s": status.copy_rows_per_s,
                    "eta_ms": status.copy_eta_ms,
                },
                "entries_buffered": status.entries_buffered,
                "last_error": status.last_error,
                "pushes_rejected": self.pushes_rejected.get(shard, 0),
                "serving": status.readable,
                "read_fenced": status.read_fenced,
                "read_fence": list(status.read_fence) if status.read_fence else None,
                # why the fence key was not told at the last ask (the upstream's refusal), while fenced
                "read_fence_error": status.read_fence_error,
                "disk_full": status.disk_full,
                # Applying waits at an entry creating a name another shard holds here (Store.name_waits):
                # ``applied`` is what the replica logged; the store applied up to the entry before it.
                "name_wait": self._name_wait_status(shard),
            }
        return {
            "node": self.config.name,
            "role": "replicant",
            "listen": self.config.listen,
            "data_dir": self.config.data_dir,
            "core_nodes": self.config.core_nodes,
            "security": self.security_status(),
            "no_core_reached": self.no_core_reached(),
            "sends_dropped": sum(self.sends_dropped_by().values()),
            "sends_dropped_by": self.sends_dropped_by(),
            # per core: bytes and frames sent toward it that zmq may still hold, frames refused for
            # core_queue_bytes_max (rlog.send_queue)
            "core_queues": self.peer_queues.status(self.cores),
            "connections": self.connections_status(),
            "collector": self.collector_status(),
            # SQLite transactions committed: about one per loop turn that applied pushes (the cost of
            # a replicant is per turn; writes applied per commit is how well pushes are batched)
            "commits": self.commits,
            "wal_checkpoints": self.store.checkpointer.status() if self.store.checkpointer else None,
            "wal_reserve": self.store.wal_reserve.status() if self.store.wal_reserve else None,
            "disk": {**self.disk.status(self.clock_ms()), "frames_dropped": self.frames_dropped_disk},
            # read-only SQL queries (rlog.query): cursors open, queries, pages, refused, budget stops, expired
            "queries": self.queries.statistics(),
            "changes": self.changes_statistics(),
            # online index builds (rlog.store): per table, rows copied so far and the indexes being built
            "index_builds": self.store.index_build_status(),
            **self.backup_status(),
            "versions": self.versions.to_wire(),
            "core_versions": {
                core: {**a.to_wire(), "announced": a.announced, "refused": incompatibility(self.versions, a)}
                for core, a in sorted(self.core_versions.items())
            },
            "shards": shards,
        }


def _valid_shard_name(shard: Any) -> bool:
    try:
        check_name("shard", shard)
    except SchemaError:
        return False
    return True
