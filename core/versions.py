"""What each peer core speaks, which peers this core refuses, and when the cluster version moves (pure).

Theory of operation
-------------------
Every ``VERSIONS_PROBE_INTERVAL_MS`` a core asks each peer for its ``journal``, a request every
release answers, and hands the answer to ``PeerVersions.heard``: the answer's ``versions`` field is
the peer's announcement (``rlog.versions``; none at all means release 0.1.0). A peer that has not
answered yet is *unknown*: it is spoken to in cluster version 1, release 0.1.0's wire, which every
release of this project reads, so a core never waits for a probe before taking part in elections.

* **Refusal.** A peer whose cluster versions do not overlap this core's, or that announces another
  cluster id than this core's (``rlog.versions``), is *incompatible*: its peer messages (consensus
  messages, snapshot offers and requests) are dropped and nothing is sent to it. While this core names a
  cluster id, the messages of a peer not heard yet are dropped too (``holds``): it may be another
  cluster's, and its first answer (a probe goes out at the start) settles it. The first time,
  ``heard`` returns the one log line to write (``PeerRefused``); it is not repeated while the peer
  stays incompatible, and a peer that comes back compatible (restarted on a release that overlaps) is
  accepted again with a line saying so.
  ``status`` and ``journal`` list every peer's announcement and whether it is refused.

* **Cluster version.** Each shard records its cluster version in its log (``ClusterVersionOp``),
  like a membership change (``core.membership``): ``cluster_version_to_propose`` lets the sequencer
  append the entry for version V only when every member of the shard (this core included) announced
  V, i.e. V is the highest every member speaks, above the shard's current one; never while a member
  is unknown, speaks only less, or has not answered within ``ANNOUNCEMENT_FRESH_MS`` (a member that is
  down may be coming back on an older release). It moves forward only: nothing proposes a lower
  version, and a core rolled back to a release that does not speak the recorded version cannot read
  the log any more (its storage format moved too, and it refuses the directory). Until then a member
  can be rolled back (while another member still runs the older release, the version cannot move).
  ``ClusterVersionProposals`` keeps a proposal from being repeated while it is in flight, and retries
  one lost with a deposed sequencer's uncommitted tail. Replicants of release 0.1.0 cannot read the
  entry: a core stops their agents when it applies (``watch_protocol_refusal``), and the upgrade
  procedure upgrades replicants before the last core.

* **A follower's own check.** The sequencer's rule is not the only guard: a member can be rolled back
  after the probes heard it (the procedure forbids it; an operator may not know), and a broken or
  hostile sequencer may append anything. So a core never takes its shard's log to a cluster version
  it does not speak itself (``unspoken_cluster_version``): its consensus refuses such an entry of an
  append as a protocol violation (``first_unspoken``: the entries before it are taken, as an append of
  those alone would be, with their commit and the answer; nothing from it on is persisted; the driver
  logs it once a second with the count; ``core.consensus``), and it refuses
  a snapshot offer at such a version (``core.snapshot.accept_offer``, logged the same way). It
  stays a member at the entry before, like a core cut off from its sequencer: it keeps hearing
  heartbeats (so it starts no election), acknowledges nothing beyond, and cannot be elected past a
  committed entry it lacks. Its state no longer advances while the others' does, so it serves no read
  of the shard: its consensus keeps why (``ShardConsensus.stuck_reason``, until its log passes the
  refused key), and the driver answers reads ``not_ready`` with that reason (``status``'s
  ``not_serving_reason``) and logs it once; it tells replicants it follows no sequencer
  (``ShardConsensus.follows_sequencer``), so they move to another core. Restarted on a release
  that speaks the version, it takes the entry, catches up and serves again; nothing is lost,
  because the majority that committed the entry holds it. Stopping the shard instead would take
  the same core out of the quorum for no gain.
  A core whose log already holds such an entry (persisted before it was rolled back) does not start:
  its consensus refuses to open the log (``ConsensusConfigError``, which the node reports as a
  ``StoreError`` naming the entry and the version), as a newer storage format is refused; applying
  the entry would have moved the storage format beyond what the release reads.

The sequencer asks after every probe round and in the turn a shard is created (so that on a cluster
that starts on this release the entry lands right after the shard's first entries, not at a random
later point). The simulator (``tests/sim/versions.py``) and the unit tests run these functions;
``core.node`` only sends the probes, feeds the answers in and executes the decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mnesite.rlog.types import Entry
from mnesite.rlog.versions import UNSPOKEN_VERSION, Announcement, announcement_of, incompatibility, protocols_at
from mnesite.rlog.versions import cluster_version_of as cluster_version_of
from mnesite.rlog.versions import first_unspoken as first_unspoken_index
from mnesite.rlog.versions import unspoken_cluster_version as unspoken_cluster_version

VERSIONS_PROBE_INTERVAL_MS = 2000
# A cluster version entry proposed but not applied yet is proposed again after this long (the
# proposal may have died with a deposed sequencer's uncommitted tail).
CLUSTER_VERSION_RETRY_MS = 10_000
# A member's announcement counts for a cluster version move only if heard this recently (two probes).
ANNOUNCEMENT_FRESH_MS = 2 * VERSIONS_PROBE_INTERVAL_MS
PEERS_MAX = 64  # = core.node.MEMBERS_LEARNED_MAX: peers tracked beyond it are not probed


@dataclass(frozen=True)
class PeerRefused:
    """Log once: this core cannot speak with ``peer``."""

    peer: str
    reason: str


@dataclass(frozen=True)
class PeerAccepted:
    """Log once: a peer refused before speaks a cluster version this core speaks again."""

    peer: str
    announcement: Announcement


@dataclass
class PeerRecord:
    announcement: Announcement
    heard_ms: int
    refused_reason: str | None = None


@dataclass
class PeerVersions:
    """This core's view of what its peers speak (see the theory of operation)."""

    own: Announcement
    peers: dict[str, PeerRecord] = field(default_factory=dict)

    def heard(self, peer: str, answer: Any, now_ms: int) -> list[PeerRefused | PeerAccepted]:
        """A peer's ``journal`` answer (untrusted); returns the lines to log (at most one)."""
        announcement = announcement_of(answer)
        if announcement is None:
            return []  # malformed: as if it had not answered
        if peer not in self.peers and len(self.peers) >= PEERS_MAX:
            return []
        previous = self.peers.get(peer)
        reason = incompatibility(self.own, announcement)
        self.peers[peer] = PeerRecord(announcement, now_ms, reason)
        was_refused = previous is not None and previous.refused_reason is not None
        if reason is not None and not was_refused:
            return [PeerRefused(peer, reason)]
        if reason is None and was_refused:
            return [PeerAccepted(peer, announcement)]
        return []

    def refuses(self, peer: str) -> bool:
        record = self.peers.get(peer)
        return record is not None and record.refused_reason is not None

    def holds(self, peer: str) -> bool:
        """Whether ``peer``'s messages wait for its first announcement: this core names a cluster id
        (``rlog.versions``) and has not heard whether the peer belongs to another cluster. Not once no
        peer more can be recorded (``PEERS_MAX``): it would never be heard."""
        return self.own.cluster_id is not None and peer not in self.peers and len(self.peers) < PEERS_MAX

    def announcement(self, peer: str) -> Announcement | None:
        record = self.peers.get(peer)
        return record.announcement if record is not None else None

    def refusal(self, peer: str) -> str | None:
        record = self.peers.get(peer)
        return record.refused_reason if record is not None else None

    def refused(self) -> list[str]:
        return sorted(peer for peer, record in self.peers.items() if record.refused_reason is not None)

    def status(self) -> dict[str, Any]:
        """Per peer: its announcement, whether it was inferred (0.1.0) and why it is refused, if it is."""
        return {
            peer: {
                **record.announcement.to_wire(),
                "announced": record.announcement.announced,
                "compatible": record.refused_reason is None,
                "refused": record.refused_reason,
                "heard_ms": record.heard_ms,
            }
            for peer, record in sorted(self.peers.items())
        }


# How a refusal of ``unspoken_cluster_version`` begins (a driver logs it as a protocol violation).
UNSPOKEN_CLUSTER_VERSION = f"this core {UNSPOKEN_VERSION}"


def unspoken_entry(entries: Sequence[Entry], own: Announcement) -> str | None:
    """Why this core must not persist ``entries``: one records a cluster version it does not speak (None: none does)."""
    found = first_unspoken(entries, own)
    return None if found is None else f"entry {entries[found[0]].tx_key}: {found[1]}"


def first_unspoken(entries: Sequence[Entry], own: Announcement) -> tuple[int, str] | None:
    """The index of the first of ``entries`` that records a cluster version this core does not speak,
    and why (None: none does). The entries before it are this core's to take."""
    found = first_unspoken_index(entries, own)
    if found is None:
        return None
    index, version = found
    return index, unspoken_cluster_version(version, own) or ""


def highest_common_version(
    own: Announcement, members: Iterable[str], peers: PeerVersions, own_name: str, now_ms: int
) -> int | None:
    """The highest cluster version every member speaks (None: a member is unknown, was not heard
    within ``ANNOUNCEMENT_FRESH_MS``, or they share none). A member that stopped answering may be
    restarting on another release: what it said before does not count."""
    low, high = own.cluster_versions
    for member in members:
        if member == own_name:
            continue
        record = peers.peers.get(member)
        if record is None or now_ms - record.heard_ms > ANNOUNCEMENT_FRESH_MS:
            return None
        announcement = record.announcement
        low, high = max(low, announcement.cluster_versions[0]), min(high, announcement.cluster_versions[1])
    return high if low <= high else None


def cluster_version_to_propose(
    current: int, members: Iterable[str], peers: PeerVersions, own_name: str, membership_settled: bool, now_ms: int
) -> int | None:
    """The cluster version the sequencer appends now, or None.

    ``membership_settled``: no membership change is in flight (a core being added or removed would
    make "every member" ambiguous for the length of the change)."""
    if not membership_settled:
        return None
    target = highest_common_version(peers.own, members, peers, own_name, now_ms)
    if target is None or target <= current:
        return None
    return target


def member_refusal(peers: PeerVersions, peer: str, cluster_version: int) -> str | None:
    """Why ``peer`` must not be added to a shard at ``cluster_version`` (None: it may, or it has not
    been heard yet, and is caught up as a learner first): this core cannot speak with it at all, or
    it does not speak the shard's cluster version. Sharing version 1 is not enough once the shard
    moved to 2: the log it would be sent holds the cluster version entry, and the runs written
    since, which release 0.1.0 cannot decode; the version never moves back for it."""
    record = peers.peers.get(peer)
    if record is None or record.refused_reason is not None:
        return None if record is None else record.refused_reason
    if record.announcement.speaks(cluster_version):
        return None
    return (
        f"it speaks {record.announcement.describe()}; the shard is at cluster version {cluster_version}, "
        "whose log it cannot read: upgrade it first"
    )


def watch_protocol_refusal(protocol: int, cluster_version: int, own: Announcement) -> str | None:
    """Why a replicant's watch naming replication ``protocol`` is refused by a core whose shard is at
    ``cluster_version`` (None: it is served). A replicant follows only a core whose log it can read:
    its protocol must be the one of a cluster version it reads at least as high as the shard's."""
    readable = [
        version
        for version in range(own.cluster_versions[0], own.cluster_versions[1] + 1)
        if protocols_at(version).replication == protocol
    ]
    if not readable:
        low, high = (protocols_at(v).replication for v in own.cluster_versions)
        return f"replication protocol {protocol} is not supported (this core speaks {low}..{high})"
    if max(readable) < cluster_version:
        return (
            f"replication protocol {protocol} cannot read this shard's log at cluster version {cluster_version}: "
            "upgrade the replicant"
        )
    return None


def watch_proves_acknowledgements(protocol: int) -> bool:
    """Whether the agent of a watch naming replication ``protocol`` gives its pushes tokens and takes
    only acknowledgements that echo one (``core.agent``, "Proven acknowledgements"): from protocol 2
    on. Release 0.1.0 (protocol 1) refuses a push with the unknown field, so its acknowledgements are
    trusted as before; a shard at cluster version 2 refuses protocol 1 watches (above), so once the
    cores' upgrade is done every agent takes proven acknowledgements only."""
    return protocol >= 2


@dataclass
class ClusterVersionProposals:
    """The sequencer's side of the rule, per shard: what to propose now, and not again while in flight.

    A proposal is in flight until the shard's recorded version reaches it, or for
    ``CLUSTER_VERSION_RETRY_MS`` (it may have been lost with a deposed sequencer's uncommitted tail)."""

    proposed: dict[str, tuple[int, int]] = field(default_factory=dict)  # shard -> (version, retry at ms)

    def due(
        self,
        shard: str,
        current: int,
        members: tuple[str, ...],
        committed_members: tuple[str, ...],
        learner: Any,
        peers: PeerVersions,
        own_name: str,
        now_ms: int,
    ) -> int | None:
        """The version to propose for ``shard`` now (recorded as in flight), or None."""
        in_flight = self.proposed.get(shard)
        if in_flight is not None and in_flight[0] > current and now_ms < in_flight[1]:
            return None
        settled = members == committed_members and not learner
        target = cluster_version_to_propose(current, members, peers, own_name, settled, now_ms)
        if target is not None:
            self.proposed[shard] = (target, now_ms + CLUSTER_VERSION_RETRY_MS)
        return target
