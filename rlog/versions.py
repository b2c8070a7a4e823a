"""What a node speaks: its release, the cluster versions it reads and writes, and a peer's announcement.

Theory of operation
-------------------
A **cluster version** is one integer that names, for every protocol a node speaks, the version the
nodes of a cluster at that cluster version write (``CLUSTER_VERSIONS``): the client frames
(``rlog.messages.PROTOCOL_VERSION``), the consensus messages between cores
(``core.consensus_wire.CONSENSUS_WIRE_VERSION``), the replication protocol a replicant's watch names
(``rlog.replication.REPLICATION_PROTOCOL_VERSION``) and the storage format of a data directory
(``rlog.store`` ``format_version``; a backup file and a replicant's spill live in that database and
carry it too). Cluster version 1 is release 0.1.0's wire, byte for byte; 2 adds the cluster version
entry of the log (``rlog.types.ClusterVersionOp``), which 0.1.0 cannot decode.

A node speaks a range of cluster versions (``Announcement.cluster_versions``): this release reads and
writes 1 and 2. It announces the range, its release and the protocol ranges derived from it as the
``versions`` field of its ``journal`` and ``status`` answers: a field of a free-form reply, which every
earlier release already ignores, so the announcement itself is never something a peer cannot read.
Release 0.1.0 announces nothing: a peer whose answer has no ``versions`` is taken for 0.1.0
(``RELEASE_0_1_0``, cluster version 1 only). What a node writes to a peer is decided by the cluster
version its cores agreed on through their log (``core.versions``), which is at most what every member
speaks; until it moves, a node of this release speaks 0.1.0's wire to everyone.

Two nodes can speak with each other when their ranges overlap (``can_speak``) and they do not belong to
two clusters: a node whose configuration or data directory names a **cluster id** (``[cluster]
cluster_id``, kept in the store, ``rlog.store.Store.claim_cluster_id``) announces it, and two nodes that
both announce one must announce the same. A node that announces none (release 0.1.0 and 0.2.0, or a
cluster that sets none) is not checked. A node that cannot speak with a peer refuses it (one log line,
shown in ``status`` and ``journal``).

Everything here is pure; ``local_announcement`` reads one environment variable, the test-only
``MNESITE_TEST_CLUSTER_VERSION_ONLY``, which builds a node that speaks only the given (newer) cluster
version, so that a test can show how a cluster refuses a node it cannot speak with.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mnesite.rlog.types import ROW_OPS, ClusterVersionOp, Entry

from mnesite import __version__ as SOFTWARE_VERSION

# The test-only switch (see the theory of operation); never set it on a production node.
SPEAK_ONLY_ENV = "MNESITE_TEST_CLUSTER_VERSION_ONLY"
SOFTWARE_CHARS_MAX = 64
# The characters of a release name (PEP 440 and local versions): a peer's name goes into log lines and
# status, so a newline or an escape sequence in it must not get there (it would forge a log line).
SOFTWARE_PATTERN = re.compile(rf"[0-9A-Za-z.+_\-]{{1,{SOFTWARE_CHARS_MAX}}}\Z")
CLUSTER_VERSION_MAX = 1000  # far above any release; bounds what a peer's answer may claim
PROTOCOL_NAMES = ("client", "consensus", "replication", "storage")
CLUSTER_ID_PATTERN = re.compile(r"[0-9a-f]{32}\Z")  # 128 bits in lowercase hex ([cluster] cluster_id)


@dataclass(frozen=True)
class Protocols:
    """The protocol versions written at one cluster version."""

    client: int
    consensus: int
    replication: int
    storage: int


CLUSTER_VERSIONS: dict[int, Protocols] = {
    # Release 0.1.0, the first: it knows nothing of versions and refuses unknown fields and kinds.
    1: Protocols(client=1, consensus=2, replication=1, storage=1),
    # Release 0.2.0: the log may hold a cluster version entry, and a write run (``packs_runs``); a
    # replicant that reads it watches with replication protocol 2; a data directory that applied one
    # has storage format 2.
    2: Protocols(client=1, consensus=2, replication=2, storage=2),
}
CLUSTER_VERSION_HIGHEST = max(CLUSTER_VERSIONS)


def protocols_at(cluster_version: int) -> Protocols:
    """The protocols of ``cluster_version``; one above this release's table is a newer release's, whose
    numbers this release cannot know: they are taken one higher per version (never equal to ours)."""
    known = CLUSTER_VERSIONS.get(cluster_version)
    if known is not None:
        return known
    top = CLUSTER_VERSIONS[CLUSTER_VERSION_HIGHEST]
    step = cluster_version - CLUSTER_VERSION_HIGHEST
    return Protocols(top.client + step, top.consensus + step, top.replication + step, top.storage + step)


@dataclass(frozen=True)
class Announcement:
    """What one node speaks: its release and the cluster versions it reads and writes (lowest, highest).

    ``announced`` is False for a peer that said nothing (release 0.1.0, taken from its silence);
    ``cluster_id``: the cluster the node belongs to, None if it names none (not checked)."""

    software: str
    cluster_versions: tuple[int, int]
    announced: bool = True
    cluster_id: str | None = None

    def protocols(self) -> dict[str, list[int]]:
        """Each protocol's [lowest, highest] version this node reads and writes."""
        low, high = protocols_at(self.cluster_versions[0]), protocols_at(self.cluster_versions[1])
        return {name: [getattr(low, name), getattr(high, name)] for name in PROTOCOL_NAMES}

    def speaks(self, cluster_version: int) -> bool:
        return self.cluster_versions[0] <= cluster_version <= self.cluster_versions[1]

    def to_wire(self) -> dict[str, Any]:
        wire = {"software": self.software, "cluster_versions": [*self.cluster_versions], "protocols": self.protocols()}
        return wire if self.cluster_id is None else {**wire, "cluster_id": self.cluster_id}

    def describe(self) -> str:
        low, high = self.cluster_versions
        versions = str(low) if low == high else f"{low}..{high}"
        said = "" if self.announced else ", inferred: it announces no versions"
        return f"release {self.software}, cluster versions {versions}{said}"


RELEASE_0_1_0 = Announcement("0.1.0", (1, 1), announced=False)
THIS_RELEASE = Announcement(SOFTWARE_VERSION, (min(CLUSTER_VERSIONS), CLUSTER_VERSION_HIGHEST))


def local_announcement(environ: Mapping[str, str] | None = None, cluster_id: str | None = None) -> Announcement:
    """This node's announcement (the one place ``MNESITE_TEST_CLUSTER_VERSION_ONLY`` is read), naming
    ``cluster_id`` (``rlog.store.Store.claim_cluster_id``) if given."""
    environ = os.environ if environ is None else environ
    only = environ.get(SPEAK_ONLY_ENV, "").strip()
    if only:
        if not only.isdigit() or not 1 <= int(only) <= CLUSTER_VERSION_MAX:
            raise ValueError(f"{SPEAK_ONLY_ENV} must be a cluster version 1..{CLUSTER_VERSION_MAX}, not {only!r:.20}")
        return Announcement(SOFTWARE_VERSION, (int(only), int(only)), cluster_id=cluster_id)
    return THIS_RELEASE if cluster_id is None else replace(THIS_RELEASE, cluster_id=cluster_id)


def announcement_of(answer: Any) -> Announcement | None:
    """The announcement in a peer's ``journal`` or ``status`` answer (untrusted: never raises).

    An answer without ``versions`` is release 0.1.0's; a malformed ``versions`` gives None (the peer is
    not known yet, as if it had not answered)."""
    if not isinstance(answer, dict):
        return None
    versions = answer.get("versions")
    if versions is None:
        return RELEASE_0_1_0
    if not isinstance(versions, dict):
        return None
    software, span = versions.get("software"), versions.get("cluster_versions")
    if not isinstance(software, str) or not SOFTWARE_PATTERN.match(software):
        return None
    if not isinstance(span, list) or len(span) != 2:
        return None
    if not all(type(v) is int and 1 <= v <= CLUSTER_VERSION_MAX for v in span) or span[0] > span[1]:
        return None
    cluster_id = versions.get("cluster_id")  # absent: a release before it, or a cluster that names none
    if cluster_id is not None and (type(cluster_id) is not str or not CLUSTER_ID_PATTERN.match(cluster_id)):
        return None
    return Announcement(software, (span[0], span[1]), cluster_id=cluster_id)


def other_cluster(own: Announcement, peer: Announcement) -> str | None:
    """Why ``peer`` belongs to another cluster than this node (None: it does not, or one of them names none)."""
    if own.cluster_id is None or peer.cluster_id is None or own.cluster_id == peer.cluster_id:
        return None
    return f"it belongs to cluster {peer.cluster_id}, this node to cluster {own.cluster_id}"


def can_speak(own: Announcement, peer: Announcement) -> bool:
    """Whether two nodes share a cluster version (their ranges overlap) and are not of two clusters."""
    (low, high), (peer_low, peer_high) = own.cluster_versions, peer.cluster_versions
    return low <= peer_high and peer_low <= high and other_cluster(own, peer) is None


def incompatibility(own: Announcement, peer: Announcement) -> str | None:
    """Why this node cannot speak with ``peer`` (None: it can), in words for the one log line."""
    if can_speak(own, peer):
        return None
    return other_cluster(own, peer) or f"it speaks {peer.describe()}; this node speaks {own.describe()}"


# -- replication: what a replicant's watch names, and which logs it can follow ------------------------


def replication_protocol_for(core: Announcement | None, own: Announcement) -> int:
    """The replication protocol a replicant's watch names to a core: that of the highest cluster
    version both speak (a core that announced nothing is release 0.1.0: protocol 1)."""
    core = core or RELEASE_0_1_0
    common = min(own.cluster_versions[1], core.cluster_versions[1])
    return protocols_at(max(common, own.cluster_versions[0])).replication


def watch_tells_frame_bytes_max(protocol: int) -> bool:
    """Whether a replicant's watch naming replication ``protocol`` tells the core its ``frame_bytes_max``
    (``rlog.messages.Watch``), so that the core's agent bounds its pushes by it (``core.agent``, "Frame
    limit"): from protocol 2 on, which only a core of release 0.2.0 or later is sent. Release 0.1.0 refuses
    a watch with a field it does not know (``bad_frame``), so it is not told, and serves as before."""
    return protocol >= 2


def log_readable(cluster_version: Any, own: Announcement) -> bool:
    """Whether a replicant speaking ``own`` can read a shard's log at ``cluster_version`` (an answer
    without one is release 0.1.0's log: version 1). A replicant follows only a core whose log it reads."""
    if cluster_version is None:
        cluster_version = 1
    return type(cluster_version) is int and own.speaks(cluster_version)


# -- the log's cluster version entries, and the follower's own check ------------------------------


def cluster_version_of(entry: Entry) -> int | None:
    """The cluster version an entry records (its ``ClusterVersionOp``), or None for any other entry."""
    found = None
    for op in entry.ops:
        if isinstance(op, ClusterVersionOp):
            found = op.cluster_version
    return found


def first_unspoken(entries: Sequence[Entry], own: Announcement) -> tuple[int, int] | None:
    """The index in ``entries`` of the first that records a cluster version ``own`` does not speak, and
    that version (None: none does). A node never takes a shard's log to such a version, whatever sent
    it (a core's consensus, ``core.versions``; a replicant's replica, ``replicant.replica``): applying
    it would move the shard, and the storage format, beyond what its release reads."""
    for index, entry in enumerate(entries):
        if ROW_OPS.issuperset(map(type, entry.ops)):
            continue  # the common entry: rows only
        version = cluster_version_of(entry)
        if version is not None and not own.speaks(version):
            return index, version
    return None


def unspoken_cluster_version(cluster_version: int, own: Announcement, role: str = "core") -> str | None:
    """Why a ``role`` node speaking ``own`` must not take its shard's log to ``cluster_version`` (None:
    it speaks it), in words for its log line and ``status``."""
    if own.speaks(cluster_version):
        return None
    return (
        f"this {role} {UNSPOKEN_VERSION} {cluster_version} ({own.describe()}), so it does not take "
        "the shard's log there: restart it on a release that speaks that version"
    )


# How the reason of ``unspoken_cluster_version`` goes on after "this core" or "this replicant".
UNSPOKEN_VERSION = "does not speak cluster version"


# -- storage: the format version of a data directory, a backup file and a spill -------------------

STORAGE_FORMATS_READ = (1, 2)  # this release opens both; 1 is release 0.1.0's


def storage_refusal(found: Any, path: str, formats_read: tuple[int, ...] = STORAGE_FORMATS_READ) -> str | None:
    """Why a database of format ``found`` must not be opened by a release reading ``formats_read``
    (None: it may). A newer format is refused in words an operator can act on, never misread."""
    if type(found) is int and found in formats_read:
        return None
    if type(found) is int and found > max(formats_read):
        return (
            f"{path}: written by a newer mnesite release (storage format {found}; release {SOFTWARE_VERSION} "
            f"reads formats {', '.join(map(str, formats_read))}): start it with that release or a later one"
        )
    return f"{path}: not a mnesite database of a known storage format (found {found!r:.40})"


def packs_runs(cluster_version: int) -> bool:
    """Whether a sequencer at ``cluster_version`` packs a transaction's runs of writes of one table with the
    same columns as one op, its column names once (``rlog.types.WriteRows``): from 2 on; release 0.1.0,
    which speaks only 1, cannot decode that op, and a shard moves to 2 only once every member speaks it."""
    return cluster_version >= 2


def storage_format_of(cluster_version: int) -> int:
    """The storage format a data directory has once it applied ``cluster_version``'s entry."""
    return protocols_at(cluster_version).storage
