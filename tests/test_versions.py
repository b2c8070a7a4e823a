"""Versions (issue 23): announcements, refusals, the cluster version rule, and storage formats.

The real-process tests with release 0.1.0 are in tests/test_upgrade.py; the cluster version rule
under the simulator's faults is in tests/sim/versions.py (run here by seed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import apsw
import msgspec
import pytest
from mnesite.core.consensus_wire import CONSENSUS_WIRE_VERSION
from mnesite.core.versions import (
    ANNOUNCEMENT_FRESH_MS,
    PeerAccepted,
    PeerRefused,
    PeerVersions,
    cluster_version_of,
    cluster_version_to_propose,
    member_refusal,
    watch_protocol_refusal,
)
from mnesite.core.watch import WatchRefusedError, check_watch_request
from mnesite.rlog import messages
from mnesite.rlog.backup import BACKUP_META, BackupError, restore
from mnesite.rlog.messages import PROTOCOL_VERSION
from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION, journal_answer, unreadable_log
from mnesite.rlog.store import FORMAT_VERSION, Store, StoreError
from mnesite.rlog.types import ClusterVersionOp, Entry, TxKey, decode_op, make_entry, pack_ops
from mnesite.rlog.versions import (
    CLUSTER_VERSION_HIGHEST,
    CLUSTER_VERSIONS,
    RELEASE_0_1_0,
    SPEAK_ONLY_ENV,
    THIS_RELEASE,
    Announcement,
    announcement_of,
    can_speak,
    incompatibility,
    local_announcement,
    log_readable,
    replication_protocol_for,
    storage_refusal,
)

from mnesite import __version__
from tests.sim.cluster import SimulationFailure
from tests.sim.versions import rolled_back_while_down, run_versions_seed

NEWER = Announcement("9.0.0", (3, 3))


def test_the_release_has_one_source_and_the_table_names_the_wire_this_tree_speaks() -> None:
    from importlib.metadata import version

    assert version("mnesite") == __version__ == THIS_RELEASE.software
    top = CLUSTER_VERSIONS[CLUSTER_VERSION_HIGHEST]
    # Bumping a wire version without a new row in CLUSTER_VERSIONS fails here.
    assert (top.client, top.consensus, top.replication) == (
        PROTOCOL_VERSION,
        CONSENSUS_WIRE_VERSION,
        REPLICATION_PROTOCOL_VERSION,
    )
    # Release 0.1.0's row is its wire, and a new database starts in its storage format.
    assert CLUSTER_VERSIONS[1].storage == FORMAT_VERSION == 1 and CLUSTER_VERSIONS[1].replication == 1
    assert THIS_RELEASE.protocols() == {"client": [1, 1], "consensus": [2, 2], "replication": [1, 2], "storage": [1, 2]}


def test_the_announcement_comes_from_the_answer_and_silence_means_release_0_1_0() -> None:
    assert announcement_of({"node": "core1", "shards": {}}) == RELEASE_0_1_0
    assert announcement_of({"versions": THIS_RELEASE.to_wire()}) == THIS_RELEASE
    for bad in (
        "text",
        {"versions": []},
        {"versions": {"software": "x", "cluster_versions": [2, 1]}},
        {"versions": {"software": "x", "cluster_versions": [0, 1]}},
        {"versions": {"software": "x", "cluster_versions": [1, True]}},
        {"versions": {"software": "x" * 65, "cluster_versions": [1, 1]}},
        {"versions": {"software": "x", "cluster_versions": [1, 10**9]}},
    ):
        assert announcement_of(bad) is None, bad


def test_a_release_name_that_would_forge_log_lines_is_refused() -> None:
    """A peer's release name goes into one log line ("core core4 refused: ... it speaks release X") and
    into status: a newline in it wrote a second, forged line. Only the characters of a version are taken."""
    for software in ("0.2.0\n2026-01-01 ERROR mnesite: forged", "0.2.0\r", "0.2 0", "\x1b[31m0.2.0", "0.2.0\u2028"):
        assert announcement_of({"versions": {"software": software, "cluster_versions": [1, 2]}}) is None, software
    for software in ("0.1.0", "0.2.0.dev0", "1.0.0rc1+local.7", "2.0_post-1"):
        assert announcement_of({"versions": {"software": software, "cluster_versions": [1, 2]}}).software == software


def test_only_the_test_switch_builds_a_node_that_speaks_a_newer_version_only() -> None:
    assert local_announcement({}) == THIS_RELEASE
    only = local_announcement({SPEAK_ONLY_ENV: "3"})
    assert only.cluster_versions == (3, 3) and only.protocols()["consensus"] == [3, 3]
    with pytest.raises(ValueError, match=SPEAK_ONLY_ENV):
        local_announcement({SPEAK_ONLY_ENV: "-1"})
    assert can_speak(THIS_RELEASE, RELEASE_0_1_0) and not can_speak(THIS_RELEASE, only)
    assert "cluster versions 3" in incompatibility(THIS_RELEASE, only)


def test_a_peer_that_cannot_be_spoken_with_is_refused_once_and_accepted_again_when_it_can() -> None:
    peers = PeerVersions(THIS_RELEASE)
    assert peers.heard("core4", {"versions": NEWER.to_wire()}, 0) == [PeerRefused("core4", peers.refusal("core4"))]
    assert peers.refuses("core4") and peers.refused() == ["core4"]
    assert peers.heard("core4", {"versions": NEWER.to_wire()}, 2000) == []  # logged once
    assert peers.heard("core4", {"garbage": True, "versions": 7}, 4000) == []  # malformed: ignored
    assert peers.refuses("core4")
    assert peers.heard("core4", {}, 6000) == [PeerAccepted("core4", RELEASE_0_1_0)]  # back on 0.1.0
    assert not peers.refuses("core4") and peers.status()["core4"]["announced"] is False


def _peers(**announcements: Announcement) -> PeerVersions:
    peers = PeerVersions(THIS_RELEASE)
    for name, announcement in announcements.items():
        peers.heard(name, {"versions": announcement.to_wire()} if announcement.announced else {}, 0)
    return peers


def test_the_cluster_version_moves_only_when_every_member_speaks_it() -> None:
    members = ("core1", "core2", "core3")

    def propose(peers: PeerVersions, current: int = 1, settled: bool = True, now_ms: int = 0) -> int | None:
        return cluster_version_to_propose(current, members, peers, "core1", settled, now_ms)

    assert propose(_peers(core2=RELEASE_0_1_0, core3=RELEASE_0_1_0)) is None
    assert propose(_peers(core2=THIS_RELEASE, core3=RELEASE_0_1_0)) is None  # the last core is not upgraded
    assert propose(_peers(core2=THIS_RELEASE)) is None  # core3 never answered
    upgraded = _peers(core2=THIS_RELEASE, core3=THIS_RELEASE)
    assert propose(upgraded) == 2
    assert propose(upgraded, current=2) is None  # forward only, and once
    assert propose(upgraded, settled=False) is None  # not while a membership change is in flight
    assert propose(upgraded, now_ms=ANNOUNCEMENT_FRESH_MS) == 2  # heard within the window
    assert propose(upgraded, now_ms=ANNOUNCEMENT_FRESH_MS + 1) is None  # a member not heard lately
    assert propose(_peers(core2=THIS_RELEASE, core3=NEWER)) is None  # they share no version above 1


def test_a_replicant_names_the_protocol_both_speak_and_follows_only_a_log_it_reads() -> None:
    assert replication_protocol_for(None, THIS_RELEASE) == 1
    assert replication_protocol_for(RELEASE_0_1_0, THIS_RELEASE) == 1
    assert replication_protocol_for(THIS_RELEASE, THIS_RELEASE) == 2
    assert replication_protocol_for(THIS_RELEASE, RELEASE_0_1_0) == 1
    answer = {"shards": {"default": {"committed": [1, 5], "hears_sequencer": True, "agents": 0}}}
    assert journal_answer(answer, "default") is not None  # a 0.1.0 core's log: cluster version 1
    answer["shards"]["default"]["cluster_version"] = 2
    assert journal_answer(answer, "default") is not None
    assert journal_answer(answer, "default", RELEASE_0_1_0) is None
    assert not log_readable(3, THIS_RELEASE) and not log_readable("2", THIS_RELEASE)
    # A core this replicant shares no cluster version with never qualifies, nor a malformed announcement.
    assert journal_answer({**answer, "versions": NEWER.to_wire()}, "default") is None
    assert journal_answer({**answer, "versions": {"software": 7}}, "default") is None


def test_a_replicant_says_why_it_cannot_follow_a_core_that_answered() -> None:
    answer = {"shards": {"default": {"committed": [1, 5], "hears_sequencer": True, "agents": 0, "cluster_version": 2}}}
    assert unreadable_log(answer, "default", THIS_RELEASE) is None
    assert unreadable_log({}, "default", THIS_RELEASE) is None  # no answer about the shard: nothing to say
    at_2 = unreadable_log(answer, "default", RELEASE_0_1_0)
    assert at_2 is not None and "at cluster version 2" in at_2 and "upgrade this replicant" in at_2
    newer = unreadable_log({**answer, "versions": NEWER.to_wire()}, "default", THIS_RELEASE)
    assert newer is not None and "release 9.0.0" in newer and "cannot speak with it" in newer


def test_a_core_serves_a_watch_only_with_a_protocol_that_reads_its_log() -> None:
    assert watch_protocol_refusal(1, 1, THIS_RELEASE) is None
    assert watch_protocol_refusal(2, 1, THIS_RELEASE) is None
    assert "upgrade the replicant" in watch_protocol_refusal(1, 2, THIS_RELEASE)
    assert "not supported" in watch_protocol_refusal(3, 1, THIS_RELEASE)
    check_watch_request(1, "w", "core1", cluster_version=1)
    with pytest.raises(WatchRefusedError) as refused:
        check_watch_request(1, "w", "core1", cluster_version=2)
    assert refused.value.code == "incompatible_protocol"


def test_the_cluster_version_entry_is_an_op_on_the_wire_and_in_the_log() -> None:
    op = ClusterVersionOp("default", 2)
    assert decode_op(msgspec.to_builtins(op)) == op
    assert messages.decode_ops(pack_ops((op,))) == (op,)
    entry = make_entry("default", TxKey(1, 2), TxKey(1, 1), bytes(32), (op,))
    assert (
        cluster_version_of(entry) == 2
        and cluster_version_of(Entry("default", TxKey(1, 1), TxKey(0, 0), b"", ())) is None
    )
    with pytest.raises(messages.MessageError):
        messages.decode_ops(pack_ops((ClusterVersionOp("default", 0),)))


def _store_with_a_row(path: Path) -> Store:
    store = Store(str(path), synchronous="NORMAL")
    with store.write_transaction():
        store.connection.execute("INSERT INTO _mnesite_meta VALUES ('note', 'kept')")
    return store


def test_the_storage_format_moves_with_the_cluster_version_entry_in_the_same_transaction(tmp_path: Path) -> None:
    path = tmp_path / "mnesite.db"
    store = _store_with_a_row(path)
    assert store.storage_format() == FORMAT_VERSION == 1 and store.cluster_version("default") == 1
    # A crash before the apply's commit: nothing moved (one transaction, rolled back).
    with pytest.raises(RuntimeError), store.write_transaction():
        store.apply_ops((ClusterVersionOp("default", 2),))
        raise RuntimeError("crash before commit")
    assert store.storage_format() == 1 and store.cluster_version("default") == 1
    with store.write_transaction():
        store.apply_ops((ClusterVersionOp("default", 2),))
    assert store.storage_format() == 2 and store.cluster_version("default") == 2
    store.close()
    # This release reads it; a deliberately older reader (format 1 only) refuses it with one error.
    reopened = Store(str(path), synchronous="NORMAL")
    assert reopened.meta("note") == "kept" and reopened.storage_format() == 2
    reopened.close()
    with pytest.raises(
        StoreError, match=r"written by a newer mnesite release \(storage format 2; .* reads formats 1\)"
    ):
        Store(str(path), synchronous="NORMAL", formats_read=(1,))
    assert storage_refusal("x", "p") == "p: not a mnesite database of a known storage format (found 'x')"


def test_one_shards_entry_moves_the_whole_directory_while_another_shard_stays_at_1(tmp_path: Path) -> None:
    # Why docs/operations/upgrades.md names the storage format, not a core's (lowest) cluster version,
    # as the condition of a roll back.
    store = _store_with_a_row(tmp_path / "mnesite.db")
    with store.write_transaction():
        store.apply_ops((ClusterVersionOp("other", 2),))
    assert store.cluster_version("default") == 1 and store.storage_format() == 2
    store.close()


def test_a_backup_carries_its_format_and_a_newer_one_is_refused_by_restore(tmp_path: Path) -> None:
    path = tmp_path / "backup.db"
    store = _store_with_a_row(path)
    with store.write_transaction():
        store.set_meta(BACKUP_META, json.dumps({"node": "core1", "storage_format": 3}))
        store.set_meta("format_version", 3)  # a newer release's
    store.close()
    with pytest.raises(BackupError, match="written by a newer mnesite release"):
        restore(str(path), str(tmp_path / "restored"), "core")
    assert not os.path.exists(tmp_path / "restored" / "mnesite.db")  # nothing left behind
    connection = apsw.Connection(str(path))
    assert connection.execute("SELECT value FROM _mnesite_meta WHERE name = 'format_version'").fetchone()[0] == 3


def test_metrics_show_incompatible_peers_and_the_cluster_version() -> None:
    from mnesite.rlog.metrics import NodeMetrics

    peers = _peers(core2=THIS_RELEASE, core4=NEWER)
    metrics = NodeMetrics("core1", "core")
    metrics.refresh(0, {"node": "core1", "peer_versions": peers.status(), "cluster_version": 2})
    text = metrics.text().decode()
    assert 'mnesite_peer_incompatible{peer="core4"} 1.0' in text
    assert 'mnesite_peer_incompatible{peer="core2"} 0.0' in text
    assert "mnesite_cluster_version 2.0" in text


@pytest.mark.parametrize(("seed", "cores"), [*((seed, 3) for seed in range(8)), (100, 5), (101, 5)])
def test_simulated_rolling_upgrades_move_the_cluster_version_only_when_every_member_speaks_it(
    seed: int, cores: int
) -> None:
    simulation = run_versions_seed(seed, cores)
    assert simulation.moves_committed >= 1, simulation.summary()


def test_the_simulator_catches_a_cluster_version_moved_before_every_member_speaks_it(monkeypatch) -> None:
    """Mutation: a rule that moves as soon as this core (not every member) speaks the newer version."""
    import mnesite.core.versions as core_versions

    def eager(current, members, peers, own_name, settled, now_ms):
        return peers.own.cluster_versions[1] if current < peers.own.cluster_versions[1] else None

    monkeypatch.setattr(core_versions, "cluster_version_to_propose", eager)
    # The first to notice is usually a core of release 0.1.0 refusing the entry (the follower's own check).
    with pytest.raises(
        SimulationFailure, match="does not speak cluster version|cannot read|cannot speak it|before the last core"
    ):
        run_versions_seed(0)


@pytest.mark.parametrize("seed", range(4))
def test_a_member_rolled_back_while_down_is_not_counted_on_its_announcement_heard_before(seed: int) -> None:
    """The scenario's checks hold the rule: no cluster version while that member's announcement is
    stale, nor once it is heard on 0.1.0; it moves once that member is upgraded again."""
    simulation = rolled_back_while_down(seed)
    assert simulation.moves_committed == 1, simulation.summary()
    assert set(simulation.cluster_versions().values()) == {THIS_RELEASE.cluster_versions[1]}


def test_the_simulator_catches_a_stale_announcement_counted(monkeypatch) -> None:
    """Mutation: an announcement counts however long ago it was heard (no freshness window): the
    sequencer appends the cluster version while the rolled-back member is down, on its way back on
    a release that cannot read it."""
    import mnesite.core.versions as core_versions

    monkeypatch.setattr(core_versions, "ANNOUNCEMENT_FRESH_MS", 10**12)
    with pytest.raises(SimulationFailure, match=r"cluster version 2 committed at .* while \['core\d'\] cannot speak"):
        rolled_back_while_down(0)


def test_status_text_names_each_peer_release_and_the_incompatible_ones() -> None:
    from mnesite.cli.main import describe_versions

    peers = _peers(core2=RELEASE_0_1_0, core4=NEWER)
    status = {
        "versions": THIS_RELEASE.to_wire(),
        "cluster_version": 1,
        "storage_format": 1,
        "peer_versions": peers.status(),
    }
    first, core2, core4 = describe_versions(status)
    assert first == f"release {__version__}, cluster versions 1..2; cluster version 1, storage format 1"
    assert core2 == "  core2: release 0.1.0, cluster versions 1 (inferred: it announces no versions)"
    assert core4.startswith("  core4: release 9.0.0, cluster versions 3: INCOMPATIBLE, refused: it speaks")
    assert describe_versions({"node": "core1"}) == ["release 0.1.0 (it announces no versions; cluster version 1)"]
    # The cluster id the node names ([cluster] cluster_id), on its own line's end; none named: nothing said.
    named = {**status, "versions": {**THIS_RELEASE.to_wire(), "cluster_id": "0123456789abcdef" * 2}}
    assert describe_versions(named)[0] == f"{first}; cluster id {'0123456789abcdef' * 2}"
    assert "cluster id" not in "".join(describe_versions(status))


def test_a_core_that_cannot_be_spoken_with_is_not_added_to_the_membership(thread_node) -> None:
    from mnesite.rlog.client import MnesiteError

    with thread_node.client() as client:
        client.create_table("t", "id", [("id", "INTEGER")])
        assert client.status()["versions"] == THIS_RELEASE.to_wire()
        # What the probe of core9 would have heard (the node's loop reads it on the next request).
        thread_node.node.peer_versions.heard("core9", {"versions": NEWER.to_wire()}, 0)
        with pytest.raises(MnesiteError) as refused:
            client.change_membership("default", "add", "core9", "tcp://127.0.0.1:9")
        assert refused.value.code == "incompatible_version" and "cluster versions 3" in str(refused.value)
        assert client.members()["shards"]["default"]["members"] == ["core1"]
        assert client.status()["peer_versions"]["core9"]["compatible"] is False


def test_a_core_that_cannot_read_the_shards_cluster_version_is_not_made_a_member() -> None:
    peers = PeerVersions(THIS_RELEASE)
    assert member_refusal(peers, "core4", 2) is None  # not heard yet: caught up as a learner first
    peers.heard("core4", {}, 0)  # release 0.1.0: it shares cluster version 1 with this core
    assert peers.refusal("core4") is None
    assert member_refusal(peers, "core4", 1) is None
    refused = member_refusal(peers, "core4", 2)
    assert refused is not None and "release 0.1.0" in refused and "cluster version 2" in refused
    peers.heard("core9", {"versions": NEWER.to_wire()}, 0)  # shares no version at all
    assert member_refusal(peers, "core9", 1) == peers.refusal("core9")


def test_a_release_0_1_0_core_is_not_added_to_a_shard_at_cluster_version_2(thread_node) -> None:
    from mnesite.rlog.client import MnesiteError

    from tests.conftest import wait_until

    with thread_node.client() as client:
        client.create_table("t", "id", [("id", "INTEGER")])
        # One member, of this release: the shard moves to this release's highest cluster version.
        wait_until(lambda: client.status()["cluster_version"] == 2, 10, "the shard to move to cluster version 2")
        # What the probe of core4, of release 0.1.0, would have heard (an answer without versions).
        thread_node.node.peer_versions.heard("core4", {}, 0)
        assert client.status()["peer_versions"]["core4"]["compatible"] is True  # it shares version 1
        with pytest.raises(MnesiteError) as refused:
            client.change_membership("default", "add", "core4", "tcp://127.0.0.1:9")
        assert refused.value.code == "incompatible_version"
        assert "release 0.1.0" in str(refused.value) and "cluster version 2" in str(refused.value)
        assert client.members()["shards"]["default"]["members"] == ["core1"]


@pytest.fixture
def probing_often(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A node whose versions turn comes every 100 ms, not every 2 s (it checks its learner then)."""
    from mnesite.core import node as node_module

    from tests.conftest import ThreadNode

    monkeypatch.setattr(node_module, "VERSIONS_PROBE_INTERVAL_MS", 100)
    node = ThreadNode(tmp_path / "data")
    try:
        yield node
    finally:
        node.stop()


def test_a_learner_the_probes_find_on_release_0_1_0_ends_its_change_at_once(probing_often) -> None:
    import concurrent.futures

    from mnesite.rlog.client import MnesiteError

    from tests.conftest import wait_until

    thread_node = probing_often
    with thread_node.client() as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        client.create_table("t", "id", [("id", "INTEGER")])
        wait_until(lambda: client.status()["cluster_version"] == 2, 10, "the shard to move to cluster version 2")

        def add() -> dict:
            with thread_node.client() as adding:
                return adding.change_membership("default", "add", "core4", "tcp://127.0.0.1:9")

        # Not heard before: core4 is caught up as a learner (its endpoint answers nothing).
        change = pool.submit(add)
        learner = lambda: client.members()["shards"]["default"]["learner"]  # noqa: E731
        wait_until(lambda: learner() == "core4", 10, "core4 to be the shard's learner")
        # Then a probe hears it: release 0.1.0, which cannot read the shard at cluster version 2.
        thread_node.node.peer_versions.heard("core4", {}, 0)
        with pytest.raises(MnesiteError) as refused:
            change.result(timeout=30)
        assert refused.value.code == "incompatible_version"
        assert learner() is None and client.members()["shards"]["default"]["members"] == ["core1"]


def test_a_proposal_is_not_repeated_while_in_flight_and_is_retried_when_lost() -> None:
    from mnesite.core.versions import CLUSTER_VERSION_RETRY_MS, ClusterVersionProposals

    members = ("core1", "core2")
    peers = _peers(core2=THIS_RELEASE)
    proposals = ClusterVersionProposals()

    def due(current: int, now_ms: int, committed: tuple[str, ...] = members) -> int | None:
        peers.heard("core2", {"versions": THIS_RELEASE.to_wire()}, now_ms)  # heard afresh
        return proposals.due("default", current, members, committed, None, peers, "core1", now_ms)

    assert due(1, 0, committed=("core1",)) is None  # a membership change is in flight
    assert due(1, 10) == 2
    assert due(1, 20) is None  # in flight
    assert due(1, 10 + CLUSTER_VERSION_RETRY_MS) == 2  # lost with a deposed sequencer's tail: again
    assert due(2, 20 + CLUSTER_VERSION_RETRY_MS) is None  # recorded: done


def test_a_follower_never_takes_a_cluster_version_it_does_not_speak() -> None:
    """Regression: a follower persisted (and then applied) a cluster version entry, or installed a
    snapshot offer at a cluster version, without checking that it speaks that version itself: only
    the sequencer's rule (every member announced it) kept a core from running a version it cannot
    read, so a member rolled back after the probes, or a broken sequencer, moved it anyway (and the
    storage format with it: the core then refused its own data directory). The follower's own rule
    (``core.versions.unspoken_cluster_version``) refuses such an entry as a protocol violation,
    persisting nothing from it on (the entries before it are taken), and such a snapshot offer."""
    import dataclasses
    import random

    from mnesite.core.consensus import (
        AppendRequest,
        ConsensusConfig,
        MessageReceived,
        PersistedState,
        PersistEntries,
        ProtocolViolation,
        ShardConsensus,
    )
    from mnesite.core.snapshot import SnapshotOffer, accept_offer
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, make_entry

    from tests.sim import MemoryLog

    first = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, ())
    moved = make_entry("s", TxKey(1, 2), first.tx_key, first.digest, (ClusterVersionOp("s", 2),))
    append = AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, ("a", "b", "c"), (first, moved))

    def follower(speaks: Announcement) -> tuple[ShardConsensus, list]:
        state = PersistedState(1, None, ("a", "b", "c"))
        machine = ShardConsensus(
            "s", "b", MemoryLog(), state, ZERO_KEY, ConsensusConfig(), random.Random(1), 0, own_versions=speaks
        )
        return machine, machine.step(MessageReceived("a", append), 0)

    _, effects = follower(Announcement("0.2.0", (1, 1)))
    assert [e.entries for e in effects if isinstance(e, PersistEntries)] == [(first,)], effects
    (violation,) = [e for e in effects if isinstance(e, ProtocolViolation)]
    assert violation.sender == "a"
    assert "entry (1, 2)" in violation.reason and "does not speak cluster version 2" in violation.reason
    _, effects = follower(THIS_RELEASE)
    (persisted,) = [e for e in effects if isinstance(e, PersistEntries)]
    assert persisted.entries == (first, moved)

    offer = SnapshotOffer("a", 3, TxKey(3, 50), b"d" * 32, cluster_version=THIS_RELEASE.cluster_versions[1] + 1)
    refused = accept_offer(offer, 3, "a", TxKey(2, 9), False, own=THIS_RELEASE)
    assert refused is not None and "does not speak cluster version" in refused
    assert (
        accept_offer(dataclasses.replace(offer, cluster_version=2), 3, "a", TxKey(2, 9), False, own=THIS_RELEASE)
        is None
    )


def test_a_core_restarted_on_a_release_that_does_not_speak_its_logged_cluster_version_refuses_to_start() -> None:
    """Regression: a core that persisted a cluster version entry, then was rolled back to a release
    that does not speak that version, applied the entry once it committed (and moved its storage
    format beyond what it reads: it then refused its own directory at the next start). Its consensus
    now refuses to open such a log, in words the node's start reports (a ``StoreError``)."""
    import random

    from mnesite.core.consensus import ConsensusConfig, ConsensusConfigError, PersistedState, ShardConsensus
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY

    from tests.sim import MemoryLog

    first = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, ())
    moved = make_entry("s", TxKey(1, 2), first.tx_key, first.digest, (ClusterVersionOp("s", 2),))
    log = MemoryLog()
    log.append((first, moved))
    state = PersistedState(1, None, ("a", "b", "c"))

    def start(speaks: Announcement, committed: TxKey) -> ShardConsensus:
        return ShardConsensus(
            "s", "b", log, state, committed, ConsensusConfig(), random.Random(1), 0, own_versions=speaks
        )

    with pytest.raises(ConsensusConfigError, match=r"entry \(1, 2\): this core does not speak cluster version 2"):
        start(Announcement("0.2.0", (1, 1)), first.tx_key)
    assert start(THIS_RELEASE, first.tx_key).last_key == moved.tx_key


def test_a_follower_stuck_at_an_unspoken_cluster_version_says_why_and_resumes_past_it() -> None:
    """Regression: a follower that refused an append holding a cluster version it does not speak never
    advanced, yet nothing of its state said so: its driver kept serving local reads from an ever older
    state, and ``status`` did not say why. Its consensus now keeps why (``stuck_reason``: the entry, the
    version, and to upgrade it), which the driver turns into the shard's ``not_serving_reason``, and
    forgets it once the log it follows moved past that entry (a sequencer whose log replaced it)."""
    import random

    from mnesite.core.consensus import AppendRequest, ConsensusConfig, MessageReceived, PersistedState, ShardConsensus
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY

    from tests.sim import MemoryLog

    first = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, ())
    moved = make_entry("s", TxKey(1, 2), first.tx_key, first.digest, (ClusterVersionOp("s", 2),))
    members = ("a", "b", "c")
    machine = ShardConsensus(
        "s",
        "b",
        MemoryLog(),
        PersistedState(1, None, members),
        ZERO_KEY,
        ConsensusConfig(),
        random.Random(1),
        0,
        own_versions=Announcement("0.2.0", (1, 1)),
    )
    assert machine.stuck_reason is None
    machine.step(MessageReceived("a", AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, members, (first,))), 0)
    assert machine.stuck_reason is None
    machine.step(MessageReceived("a", AppendRequest(1, first.tx_key, first.digest, ZERO_KEY, members, (moved,))), 1)
    reason = machine.stuck_reason
    assert reason is not None
    assert "(1, 2)" in reason and "cluster version 2" in reason and "restart it on a release" in reason
    # A heartbeat at its last key changes nothing: it is still stuck.
    machine.step(MessageReceived("a", AppendRequest(1, first.tx_key, first.digest, ZERO_KEY, members)), 2)
    assert machine.stuck_reason == reason
    # A sequencer of generation 2 whose log replaced the entry: the follower goes on, and serves again.
    other = make_entry("s", TxKey(2, 1), first.tx_key, first.digest, ())
    machine.step(MessageReceived("c", AppendRequest(2, first.tx_key, first.digest, ZERO_KEY, members, (other,))), 3)
    assert machine.last_key == other.tx_key and machine.stuck_reason is None


def test_a_core_stuck_at_an_unspoken_cluster_version_serves_no_read_and_status_says_why(
    tmp_path, monkeypatch, caplog
) -> None:
    """Regression: a core that refused its sequencer's cluster version entry (it does not speak the
    version) stopped advancing but kept answering local reads from its ever older state, and ``status``
    did not say why. It now refuses reads of the shard (``not_ready``) with a ``not_serving_reason``
    naming the entry, the version and the upgrade; restarted (its consensus rebuilt), it serves again."""
    from mnesite.core.consensus import AppendRequest, MessageReceived
    from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY

    from tests.conftest import follower_by_hand

    monkeypatch.setenv(SPEAK_ONLY_ENV, "1")  # this core speaks cluster version 1 only
    with follower_by_hand(tmp_path / "data") as (node, driver):
        assert node.status()["shards"]["default"]["not_serving_reason"] is None
        first = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, ())
        moved = make_entry("default", TxKey(1, 2), first.tx_key, first.digest, (ClusterVersionOp("default", 2),))
        members = ("core1", "core2", "core3")
        stuck = MessageReceived("core2", AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, members, (first, moved)))
        told: list[bool] = []
        monkeypatch.setattr(node.agent_server, "committed", lambda shard, key, hears, now: told.append(hears))
        with caplog.at_level("ERROR", logger="mnesite"):
            for _ in range(3):  # the sequencer sends it again and again: one line says why
                node._step(driver, stuck)
        # Its replicas' agents hear that it follows no sequencer now: they move to another core.
        assert told[-1] is False and node.journal()["shards"]["default"]["hears_sequencer"] is False
        assert len([r for r in caplog.records if "serving no read of the shard" in r.getMessage()]) == 1
        reason = node.status()["shards"]["default"]["not_serving_reason"]
        assert reason is not None and "(1, 2)" in reason and "cluster version 2" in reason
        assert "restart it on a release that speaks that version" in reason
        assert node.status()["shards"]["default"]["serving"] is False
        with pytest.raises(Exception, match="cannot serve shard default yet") as refused:
            node._check_serving("default")
        assert getattr(refused.value, "code", None) == "not_ready"
        node._open_shard("default")  # as a restart rebuilds it (on a release that speaks the version)
        assert node.status()["shards"]["default"]["serving"] is True
        node._check_serving("default")


@pytest.mark.timeout(60)
def test_the_replicant_simulator_tells_agents_a_stuck_core_follows_no_sequencer() -> None:
    """Regression: whether a core follows its sequencer, which its journal and its agents' pushes tell
    replicants (``hears_sequencer``), was decided in the driver (``CoreNode._hears_sequencer``), so the
    simulator kept its own copy without the stuck rule: its replicants went on hearing that a core stuck
    at an unspoken cluster version followed the sequencer, and no seed checked that they move away. The
    rule is now the consensus's own (``ShardConsensus.follows_sequencer``), run by both."""
    from mnesite.core.consensus import AppendRequest, MessageReceived

    from tests.sim.cluster import SHARD
    from tests.sim.replicants import ReplicantSimulation

    sim = ReplicantSimulation(1, 3, 1)
    sim._heal()
    sequencer = sim.run_until_quiet()
    follower = next(node for node in sim.nodes.values() if node is not sequencer)
    machine = follower.machine
    assert machine is not None and sim._hears_sequencer(follower)
    last_key = machine.last_key
    unspoken = make_entry(
        SHARD,
        TxKey(last_key.generation, last_key.counter + 1),
        last_key,
        follower.log.digest_at(last_key),
        (ClusterVersionOp(SHARD, 1000),),
    )
    append = AppendRequest(
        machine.generation,
        last_key,
        follower.log.digest_at(last_key),
        machine.committed_key,
        tuple(sorted(sim.nodes)),
        (unspoken,),
    )
    machine.step(MessageReceived(sequencer.name, append), sim.now_ms)
    assert machine.stuck_reason is not None and machine.sequencer == sequencer.name
    assert not sim._hears_sequencer(follower), "production's rule: a stuck core follows no sequencer"
    # Nor does it answer local reads (production: not_ready, ``CoreNode._not_serving_reason``).
    answered = sim.local_reads_answered[follower.name]
    sim.read(follower.name, 0, kind="local")
    for _ in range(10):
        sim.advance()
    assert machine.stuck_reason is not None and sim.local_reads_answered[follower.name] == answered
