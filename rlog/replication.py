"""Events and effects of the replication protocol between a core's agents and a replicant's replicas.

This module is the contract between the pure state machines (``replicant.replica.ShardReplica``
on the replicant, ``core.agent.Agent`` on the core) and their drivers. It holds data only.

The flow, per shard (Mria's agent server / agent / replica / bootstrapper, with catch-up from the
persisted rlog that Mria never had):

1. The replica probes every core's journal age (``ProbeJournals`` -> ``JournalsReceived``) and picks
   an upstream whose committed key is at least its own applied key and that hears the sequencer,
   spreading over cores by agent count with randomness (``replicant.upstream``).
2. It sends ``watch(shard, from_key, from_digest, watch_id)`` (``SendWatch``). The core's agent server
   answers (and every push of the agent it creates repeats that answer, so that a push overtaking
   the answer is not taken for a zombie's):
   * ``resume``: it retains ``from_key`` with that digest; an agent pushes entries after it;
   * ``bootstrap``: it does not; an agent pushes entries after ``start_key`` (K0, the core's
     committed key when the watch arrived) while the replica copies the tables in key-ordered
     dirty-read batches (``FetchBatch``), spilling the pushed entries to disk (``SpillEntries``);
     once the copy is done it sets its position to K0 and replays the spill (``ReplaySpill``);
   * a refusal (incompatible protocol version, unknown shard, a committed key behind ``from_key``).
3. Pushes carry the agent id; the replica applies only pushes of the agent it watches and only the
   entry that follows its applied key. It acknowledges with its applied (or spilled) key; the agent
   keeps at most ``window_entries_max`` entries unacknowledged.
4. Idle agents send heartbeats with the core's committed key and whether the core hears the
   sequencer. No push or heartbeat within ``failure_timeout_ms``, or a core that no longer hears the
   sequencer, makes the replica fail over: back to step 1, resuming from its applied key.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mnesite.rlog.messages import JournalShardAnswer, answer_as
from mnesite.rlog.types import Entry, PackedEntry, TxKey
from mnesite.rlog.versions import (
    THIS_RELEASE,
    Announcement,
    announcement_of,
    can_speak,
    incompatibility,
    log_readable,
)

# The highest replication protocol this release speaks (rlog.versions: 1 is release 0.1.0's; 2 reads
# cluster version entries). A replicant names the one it shares with each core (replication_protocol_for).
REPLICATION_PROTOCOL_VERSION = 2

# The applied digest a replica's driver persists after ``ResetShard``: no core holds an entry with
# this digest, so a watch from it is always answered ``bootstrap``, even after a crash mid-copy.
UNKNOWN_DIGEST = b""


class Mode(enum.Enum):
    DISCONNECTED = "disconnected"
    BOOTSTRAP = "bootstrap"
    LOCAL_REPLAY = "local_replay"
    NORMAL = "normal"


class AgentMode(enum.Enum):
    CATCHUP = "catchup"
    SWITCHOVER = "switchover"
    NORMAL = "normal"
    STOPPED = "stopped"


@dataclass(frozen=True)
class JournalAnswer:
    """What a core's ``journal`` answer told a replica about one shard (not DESIGN's journal age,
    ``core.consensus.JournalAge``, which is a core's own generation and keys)."""

    committed_key: TxKey
    hears_sequencer: bool
    agents: int


def _journal_verdict(result: object, shard: str, own: Announcement) -> tuple[JournalShardAnswer | None, str | None]:
    """A core's ``journal`` reply about ``shard``, for ``journal_answer`` and ``unreadable_log``: the
    shard's answer if this replicant may follow that core for it (else None), and why not when the
    reason is versions (else None: a malformed reply, or a shard the core does not know)."""
    announcement = announcement_of(result)
    if announcement is None:
        return None, None  # a malformed announcement
    if not can_speak(own, announcement):
        return None, f"this replicant cannot speak with it: {incompatibility(own, announcement)}"
    shards = result.get("shards") if isinstance(result, dict) else None
    info = answer_as(shards.get(shard), JournalShardAnswer) if isinstance(shards, dict) else None
    if info is None:
        return None, None
    if not log_readable(info.cluster_version, own):
        return None, (
            f"its log of shard {shard} is at cluster version {info.cluster_version}, which this replicant "
            f"({own.describe()}) cannot read: upgrade this replicant"
        )
    return info, None


def journal_answer(result: object, shard: str, own: Announcement = THIS_RELEASE) -> JournalAnswer | None:
    """What a core's ``journal`` reply ``result`` says about ``shard``; None if it does not know the
    shard or the answer is malformed there (the reply is untrusted input: it never raises), and None
    for a core this replicant (speaking ``own``) shares no cluster version with, or whose log of the
    shard is at a cluster version it cannot read: a replicant follows only a core whose log it reads
    (``rlog.versions``; ``unreadable_log`` says why, for the replica's status)."""
    info, _ = _journal_verdict(result, shard, own)
    return None if info is None else JournalAnswer(info.committed, info.hears_sequencer, info.agents)


def unreadable_log(result: object, shard: str, own: Announcement = THIS_RELEASE) -> str | None:
    """Why a core that answered is not followed for ``shard`` because of versions (None: not for that):
    ``journal_answer``'s two refusals in words, so that a replica's status does not say that a core
    which answered "did not answer" (``JournalsReceived.unreadable``)."""
    return _journal_verdict(result, shard, own)[1]


# ---------------------------------------------------------------- replica events


@dataclass(frozen=True)
class Ticked:
    """Time passed; ``now_ms`` is given to ``step``. The one tick event of every pure machine
    (``core.consensus`` re-exports it), so that a driver never has to tell two apart."""


@dataclass(frozen=True)
class JournalsReceived:
    """Answers to ``ProbeJournals``; ``None`` for a core that did not answer in time, or whose answer
    cannot be followed: ``unreadable`` names those that answered with a log this replicant cannot
    read, and why (``unreadable_log``), ``unsent`` those never asked because the request could not be
    sent, and why, ``refused`` those that answered the request with an error (its code and message:
    ``forbidden`` for a key without the replicant role, ``stopping``); all for the status."""

    ages: tuple[tuple[str, JournalAnswer | None], ...]
    unreadable: tuple[tuple[str, str], ...] = ()
    unsent: tuple[tuple[str, str], ...] = ()
    refused: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WatchAccepted:
    core: str
    agent_id: str
    mode: str  # "resume" | "bootstrap"
    start_key: TxKey  # resume: the replica's from_key; bootstrap: K0
    start_digest: bytes
    # The id the replica gave its watch (``SendWatch.watch_id``): an answer to an older watch is ignored.
    watch_id: str = ""


@dataclass(frozen=True)
class WatchRefused:
    core: str
    reason: str


@dataclass(frozen=True)
class PushReceived:
    core: str
    agent_id: str
    entries: tuple[Entry, ...]
    committed_key: TxKey
    hears_sequencer: bool
    # The answer to the watch that created this agent. Every push carries it, so a push that
    # overtakes the answer (they travel on different connections) is taken as that answer.
    accepted: WatchAccepted | None = None
    # The push's token (opaque), echoed by the acknowledgement that follows it; None: the core sent none.
    token: bytes | None = None


@dataclass(frozen=True)
class BatchReceived:
    """Rows of ``table`` in key order strictly after ``after``; ``done`` when the table is exhausted."""

    core: str
    table: str
    after: object
    rows: tuple[dict, ...]
    done: bool
    # The table's row count when the first batch was read (None: not known); for progress only.
    rows_total: int | None = None
    # The answer's size as received (None: estimate it from the rows); for progress only.
    size_bytes: int | None = None
    # The replica's attempt the request was sent in (``ShardReplica.watch_id``; None: not tied to
    # one, a core's snapshot install): a batch of an earlier attempt was read before this one's K0.
    watch_id: str | None = None


@dataclass(frozen=True)
class TablesReceived:
    """The shard's tables on the upstream (names in key order of copy); answer to ``FetchTables``.

    ``keys[i]`` is the key column of ``tables[i]``: the replica resumes the copy of a table after
    the key of the last row it received.
    """

    core: str
    tables: tuple[str, ...]
    keys: tuple[str, ...] = ()
    # As ``BatchReceived.watch_id``: the table list of an earlier attempt is not this one's.
    watch_id: str | None = None


@dataclass(frozen=True)
class CommittedReceived:
    """Answer to ``FetchCommitted``: the core's committed key, or None if it did not answer.
    ``question``: the ``FetchCommitted.question`` it answers (``bootstrap.fence``, rule 2);
    ``error``: with None, why (the core's refusal, code and message, or that it did not answer)."""

    core: str
    committed_key: TxKey | None
    question: int
    error: str | None = None


@dataclass(frozen=True)
class FenceQuestionUnsent:
    """``FetchCommitted`` was not sent (``reason``: the driver's table of pending requests was full, or
    the send failed): nothing will answer ``question``. It is asked again at its interval, not at once
    (a driver still full would refuse it again in every turn)."""

    core: str
    question: int
    reason: str


@dataclass(frozen=True)
class RequestFailed:
    """A request to ``core`` (watch, fetch) got no answer or an error. ``watch_id``: the replica's
    attempt the request was sent in (``ShardReplica.watch_id``); a failure of an earlier attempt's
    request (expired or answered late, after that attempt had already failed) changes nothing."""

    core: str
    reason: str
    watch_id: str | None = None


# ---------------------------------------------------------------- replica effects


@dataclass(frozen=True)
class ProbeJournals:
    cores: tuple[str, ...]


@dataclass(frozen=True)
class FetchCommitted:
    """Ask ``core`` for its committed key (the read fence after a bootstrap); step ``CommittedReceived``
    with the same ``question`` (the driver keeps it with the request: an answer of an earlier question
    must not be taken for this one's)."""

    core: str
    question: int


@dataclass(frozen=True)
class SendWatch:
    core: str
    from_key: TxKey
    from_digest: bytes
    # Chosen by the replica (from its injected random source); the answer and every push of the
    # agent it creates carry it back.
    watch_id: str


@dataclass(frozen=True)
class ApplyEntries:
    """Apply in one SQLite transaction with the new applied key and digest (invariant 4)."""

    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class ResetShard:
    """Bootstrap starts: delete the shard's rows and spill; the position becomes unknown.

    The driver keeps the applied key (a floor: the replica never watches a core behind it, even
    after a restart) and persists ``UNKNOWN_DIGEST`` as the applied digest, in one transaction.
    """


@dataclass(frozen=True)
class FetchTables:
    core: str


@dataclass(frozen=True)
class FetchBatch:
    core: str
    table: str
    after: object
    limit: int


@dataclass(frozen=True)
class ApplyBatch:
    """Write these dirty-read rows (full rows) of ``table``."""

    table: str
    rows: tuple[dict, ...]


@dataclass(frozen=True)
class SpillEntries:
    """Persist pushed entries to the spill (bounded by ``spill_entries_max``)."""

    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class ReplaySpill:
    """Set the position to ``start_key``/``start_digest`` (K0), then apply the spilled entries in order."""

    start_key: TxKey
    start_digest: bytes


@dataclass(frozen=True)
class SendAck:
    core: str
    agent_id: str
    applied_key: TxKey
    # The token of the last push of this agent the replica read (None: none carried one).
    token: bytes | None = None


@dataclass(frozen=True)
class SendReject:
    core: str
    agent_id: str
    reason: str


@dataclass(frozen=True)
class ModeChanged:
    mode: Mode
    upstream: str | None
    reason: str
    # The reason calls for an operator (a driver logs it as a warning): a bootstrap restarted
    # because its copy outlasted the cores' retention (``ShardReplica``'s "Sizing trap").
    warning: bool = False


@dataclass(frozen=True)
class ReadFenceChanged:
    """Persist whether reads are fenced (after a bootstrap, until the applied key reaches the fence)."""

    fenced: bool


# ---------------------------------------------------------------- agent events (core side)


@dataclass(frozen=True)
class CommittedAdvanced:
    """The core's committed key of the agent's shard, and whether it hears the sequencer."""

    committed_key: TxKey
    hears_sequencer: bool


@dataclass(frozen=True)
class AckReceived:
    applied_key: TxKey
    # The token of the last push the replicant read, echoed (None: an acknowledgement without one,
    # as replication protocol 1 sends; see core.agent, "Proven acknowledgements").
    token: bytes | None = None


@dataclass(frozen=True)
class RejectReceived:
    reason: str


@dataclass(frozen=True)
class PushesDropped:
    """The driver dropped every push of the agent still queued (it closed the socket to the
    replicant's endpoint): what was not acknowledged must go again (see ``core.agent``, "Retransmission")."""


# ---------------------------------------------------------------- agent effects


@dataclass(frozen=True)
class Push:
    """Send committed ``entries`` (empty: a heartbeat) to the replicant."""

    entries: tuple[Entry | PackedEntry, ...]
    committed_key: TxKey
    hears_sequencer: bool
    # The entries' estimated bytes (``size_bytes``), for the driver's budget per loop turn.
    size_bytes: int = 0
    # The push's token, which the replica echoes in its acknowledgement (None: not sent; core.agent).
    token: bytes | None = None


@dataclass(frozen=True)
class AgentStopped:
    reason: str
