"""The answers of the admin calls (``status``, ``members``, ``rlog_tail``, ``rlog_entries``, ``journal``,
``force_start``, ``membership_change``, ``stop``, ``backup``, ``backup_read``) and of the range requests
(``range_digest``, ``key_boundaries``, ``row_digests``) as the client checks them (``Client.status`` and the others):
untrusted input, like every answer (``messages.Answer``: unknown fields allowed, a newer release may
add some).

Each type holds the fields the client's callers read, with the types they read them as: what
``mnesite status``, ``cluster members``, ``rlog tail``, ``journal show``, ``cluster add-core``,
``backup``, the compare job (``spark.replica``) and a core probing its peers (``CoreNode.probe_peers``)
index must be there, what they look up with a default may be absent. An answer that does not fit
is ``bad_answer`` (``client.checked``), never a KeyError or TypeError out of a caller, nor a value of
another type handed on as the node's. The caller still gets the answer as it came (a dict, every
field of it): what the commands print, ``--json`` included, does not depend on these types.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from mnesite.rlog.limits import BACKUP_CHUNK_BYTES_MAX
from mnesite.rlog.messages import Answer, JournalShardAnswer, NonNegative
from mnesite.rlog.types import TxKey
from mnesite.rlog.versions import CLUSTER_ID_PATTERN
from msgspec import Meta

Count = NonNegative
# A number a command prints as one (a rate, an ETA): an integer or a float.
Number = int | float
# msgspec searches a pattern: anchored at the start here, as ``re.match`` is where the node checks it.
ClusterId = Annotated[str, Meta(pattern="^" + CLUSTER_ID_PATTERN.pattern)]


# -- status (``NodeServer.status`` of a core or a replicant) ----------------------------------------


class CopyProgress(Answer, frozen=True, kw_only=True):
    """A replicant's bootstrap copy, or the rows part of a core's snapshot install."""

    rows: Count
    rows_expected: Count | None = None
    rows_per_s: Number | None = None
    eta_ms: Number | None = None


class InstallProgress(CopyProgress, frozen=True, kw_only=True):
    source: str = msgspec.field(name="from")
    # Absent from the answers of nodes before it was added.
    read_fence_error: str | None = None


class FollowerStatus(Answer, frozen=True, kw_only=True):
    match: TxKey
    lag_entries: int | None = None
    lazy: bool = False


class Exclusion(Answer, frozen=True, kw_only=True):
    by: str
    generation: int
    members: list[str]
    verdict: str


class PendingRemoval(Answer, frozen=True, kw_only=True):
    """A removal waiting for the set it leaves to answer (``core.consensus.PendingRemoval``)."""

    name: str
    waiting_ms: Count
    answered: list[str]
    needed: Count
    timeout_ms: Count


class CoreShardStatus(Answer, frozen=True, kw_only=True):
    role: str
    generation: int
    sequencer: str | None
    applied: TxKey
    committed: TxKey
    last: TxKey
    digest: str
    members: list[str]
    committed_members: list[str] | None = None
    learner: str | None = None
    # Absent from the answers of nodes before it was added.
    removal: PendingRemoval | None = None
    followers: dict[str, FollowerStatus] | None = None
    excluded: Exclusion | None = None
    serving: bool = True
    not_serving_reason: str | None = None
    vote_floor: TxKey | None = None
    install: InstallProgress | None = None
    rlog: dict[str, Any] = {}


class ReplicantShardStatus(Answer, frozen=True, kw_only=True):
    mode: str
    upstream: str | None
    applied: TxKey
    digest: str | None
    lag_entries: int | None
    bootstraps: Count
    resumes: Count
    rows_copied: Count
    entries_buffered: Count
    copy: CopyProgress | None = None
    bootstraps_outrun: Count | None = None
    last_error: str | None = None
    read_fence_error: str | None = None


class HandshakesFailed(Answer, frozen=True, kw_only=True):
    auth: Count
    protocol: Count
    no_detail: Count


class SecurityStatus(Answer, frozen=True, kw_only=True):
    """``curve`` off: nothing else is read; on: the counts ``mnesite status`` prints."""

    curve: bool = False
    insecure: bool = False
    authorized_keys: Count | None = None
    handshakes_failed: HandshakesFailed | None = None
    refused_role: Count | None = None
    refused_sender: Count | None = None

    def __post_init__(self) -> None:
        counts = (self.authorized_keys, self.handshakes_failed, self.refused_role, self.refused_sender)
        if self.curve and None in counts:
            raise ValueError("security with curve lacks its counts")


class Versions(Answer, frozen=True, kw_only=True):
    """A node's announcement (``rlog.versions``), or a peer's as the node saw it."""

    software: str | None = None
    cluster_versions: tuple[int, int] | None = None
    announced: bool = True
    refused: str | None = None
    # Absent when the node names no cluster (``[cluster] cluster_id``), or is of a release before it.
    cluster_id: ClusterId | None = None


class BackupStatus(Answer, frozen=True, kw_only=True):
    path: str
    state: str
    pages_copied: Count
    pages_total: Count


class BackupFailure(Answer, frozen=True, kw_only=True):
    path: str
    failed_at: str
    error: str | None


class BackupScheduleStatus(Answer, frozen=True, kw_only=True):
    """``[backup]``'s schedule (``rlog.backup_schedule.BackupSchedule.status``)."""

    directory: str
    interval_s: Count
    keep: Count
    next_due_in_ms: Count
    waiting: str | None = None
    last_path: str | None = None
    last_state: str | None = None
    last_error: str | None = None
    last_success_at_s: Number | None = None
    files_kept: list[str] = []
    files_removed: Count = 0


class AgentStatus(Answer, frozen=True, kw_only=True):
    agent: str
    replicant: str
    shard: str
    mode: str
    acked: TxKey
    lag_entries: int | None
    acks_refused: Count = 0
    # The replicant's, told in its watch: None when it told none (or the core is of a release before it).
    frame_bytes_max: Count | None = None


class AgentBudget(Answer, frozen=True, kw_only=True):
    used_bytes: Count
    bytes_max: Count
    evicted_agents: Count
    acks_refused: Count = 0


class NodeStatus(Answer, frozen=True, kw_only=True):
    """What both roles answer; ``shards`` is checked by the role's own type (``status_type``)."""

    node: str
    role: str
    shards: dict[str, Any]
    security: SecurityStatus | None = None
    backup: BackupStatus | None = None
    backup_failed: BackupFailure | None = None
    backup_schedule: BackupScheduleStatus | None = None
    versions: Versions | None = None
    peer_versions: dict[str, Versions] | None = None
    core_versions: dict[str, Versions] | None = None
    no_core_reached: str | None = None
    # Outgoing frames not sent, by reason (zmq, core_queue_bytes_max); absent from older nodes' answers.
    sends_dropped: Count | None = None
    sends_dropped_by: dict[str, Count] | None = None


class CoreStatus(NodeStatus, frozen=True, kw_only=True):
    shards: dict[str, CoreShardStatus]
    agents: list[AgentStatus] = []
    agent_budget: AgentBudget | None = None


class ReplicantStatus(NodeStatus, frozen=True, kw_only=True):
    shards: dict[str, ReplicantShardStatus]


def status_type(role: str) -> type[NodeStatus]:
    """The type a status answer of ``role`` is checked as: a replicant's, or else a core's (as ``mnesite
    status`` reads every other role)."""
    return ReplicantStatus if role == "replicant" else CoreStatus


# -- members (``CoreNode.membership``) --------------------------------------------------------------


class LearnerCopy(Answer, frozen=True, kw_only=True):
    """What the sequencer served of its learner's snapshot install (``core.snapshot.CopiesServed``)."""

    rows: Count
    batches: Count
    last_batch_age_ms: Count


class ShardMembership(Answer, frozen=True, kw_only=True):
    members: list[str]
    committed_members: list[str]
    learner: str | None
    sequencer: str | None
    generation: int
    learner_match: TxKey | None = None
    committed: TxKey | None = None
    # Absent from the answers of nodes before they were added.
    learner_copy: LearnerCopy | None = None
    removal: PendingRemoval | None = None


class Membership(Answer, frozen=True, kw_only=True):
    node: str
    members: list[str]
    endpoints: dict[str, str]
    shards: dict[str, ShardMembership]


# -- rlog entries (``rlog.types.entry_to_json``) ----------------------------------------------------


class EntryOp(Answer, frozen=True, kw_only=True):
    op: str


class RlogEntry(Answer, frozen=True, kw_only=True):
    tx_key: TxKey
    prev: TxKey
    digest: str
    ops: list[EntryOp]
    shard: str | None = None
    request_id: str | None = None


RlogEntries = list[RlogEntry]


# -- journal (``CoreNode.journal``): ``journal show``, ``journal force-start``, ``probe_peers`` ----------


class JournalShardAge(JournalShardAnswer, frozen=True, kw_only=True):
    """One shard's journal age: what a replicant reads of it (``JournalShardAnswer``, the same type)
    and what ``journal show`` prints (``members`` and ``pending_members`` read with a default)."""

    generation: Count
    last: TxKey
    forced: bool
    members: list[str] = []
    pending_members: list[str] | None = None


class Journal(Answer, frozen=True, kw_only=True):
    node: str
    core_nodes: dict[str, str]
    reachable_peers: list[str]
    shards: dict[str, JournalShardAge]
    versions: Versions | None = None
    peer_versions: dict[str, Versions] | None = None
    cluster_version: int = 1


# -- force_start (``CoreNode.force_start``) -------------------------------------------------------


class ForcedShard(Answer, frozen=True, kw_only=True):
    generation: Count
    last: TxKey


class ForceStart(Answer, frozen=True, kw_only=True):
    node: str
    members: list[str]
    left_out: list[str]
    may_lose: str
    shards: dict[str, ForcedShard]


# -- membership_change (``CoreNode._membership_change``): ``cluster add-core`` / ``remove-core`` ------


class MembershipChange(Answer, frozen=True, kw_only=True):
    """The change's committed entry (``tx_key``), or ``unchanged`` with the reason (already done)."""

    tx_key: TxKey | msgspec.UnsetType = msgspec.UNSET
    unchanged: str | msgspec.UnsetType = msgspec.UNSET
    shard: str | None = None

    def __post_init__(self) -> None:
        if self.tx_key is msgspec.UNSET and self.unchanged is msgspec.UNSET:
            raise ValueError("a membership change answer names neither its tx key nor why it is unchanged")


# -- stop (``NodeServer.stop_request``) -------------------------------------------------------------


class Stopping(Answer, frozen=True, kw_only=True):
    node: str


# -- backup (``NodeServer.answer_backup``: ``BackupJob.status``, as ``status`` shows it too) --------


class BackupShard(Answer, frozen=True, kw_only=True):
    applied: TxKey
    digest: str


class BackupAnswer(Answer, frozen=True, kw_only=True):
    """What ``mnesite backup`` reads as the copy goes: the pages while it runs, the error once it
    failed, the time taken and each shard's position once it is done."""

    state: str
    pages_copied: Count
    pages_total: Count
    error: str | None = None
    seconds: Number | None = None
    shards: dict[str, BackupShard] | None = None

    def __post_init__(self) -> None:
        if self.state == "failed" and self.error is None:
            raise ValueError("a failed backup without its error")
        if self.state not in ("running", "failed") and (self.seconds is None or self.shards is None):
            raise ValueError(f"a backup {self.state} without its time or its shards")


class BackupChunk(Answer, frozen=True, kw_only=True):
    """A ``backup_read`` answer (``rlog.backup.read_chunk``): bytes of the backup from the offset asked,
    the file's size and whether they reach its end."""

    data: Annotated[bytes, Meta(max_length=BACKUP_CHUNK_BYTES_MAX)]
    size: Count
    end: bool


# -- range requests (``rlog.range_requests.answer``): what ``spark.replica.NodeReplica`` reads -------


class RangePosition(Answer, frozen=True, kw_only=True):
    """Where the shard stood when the node answered (every range answer says it)."""

    shard: str
    applied: TxKey
    applied_digest: str


def _digest_bytes(digest: Any) -> None:
    """A digest comes as bytes (msgpack's bin): the caller reads it as it came, and ``msgspec.convert``
    would take a base64 text for bytes too."""
    if not isinstance(digest, bytes):
        raise ValueError(f"a digest is a {type(digest).__name__}, not bytes")


class RangeDigest(Answer, frozen=True, kw_only=True):
    rows: Count
    digest: Any  # bytes; None: over the node's budget (``rows`` a lower bound)
    split_keys: list[Any]

    def __post_init__(self) -> None:
        if self.digest is not None:
            _digest_bytes(self.digest)


class RangeDigests(RangePosition, frozen=True, kw_only=True):
    ranges: list[RangeDigest]
    more: bool


class KeyBoundaries(RangePosition, frozen=True, kw_only=True):
    rows: Count
    keys: list[Any]


class RowDigests(RangePosition, frozen=True, kw_only=True):
    rows: list[tuple[Any, Any]]  # [key, row digest (bytes)]
    more: bool

    def __post_init__(self) -> None:
        for _, digest in self.rows:
            _digest_bytes(digest)
