"""The cluster id (``[cluster] cluster_id``, ``rlog.versions``): kept by the data directory, announced in
``journal`` and ``status``, and a peer core or an upstream core of another cluster refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from mnesite.core.consensus import AppendRequest
from mnesite.core.consensus_wire import message_to_wire
from mnesite.core.node import CoreNode
from mnesite.core.versions import PeerRefused, PeerVersions
from mnesite.rlog import messages
from mnesite.rlog.backup import restore
from mnesite.rlog.client import MnesiteError
from mnesite.rlog.config import ConfigError
from mnesite.rlog.messages import Message
from mnesite.rlog.replication import journal_answer, unreadable_log
from mnesite.rlog.store import Store, StoreError
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY
from mnesite.rlog.versions import THIS_RELEASE, announcement_of, incompatibility, local_announcement

from tests.conftest import Cluster, free_port, node_config, wait_until

X, Y = "0123456789abcdef" * 2, "fedcba9876543210" * 2


def answer_of(cluster_id: str | None, shards: dict | None = None) -> dict:
    """A journal answer of this release naming ``cluster_id`` (None: naming none, as a release before it)."""
    return {"versions": local_announcement({}, cluster_id).to_wire(), "shards": shards or {}}


@pytest.mark.parametrize(
    "cluster_id", [X.upper(), X[:-1], X + "0", "g" * 32, 7, ["a"], " " + X[1:], X[:-1] + "\n", bytes.fromhex(X)]
)
def test_a_malformed_cluster_id_makes_the_announcement_malformed(cluster_id) -> None:
    answer = answer_of(None)
    answer["versions"]["cluster_id"] = cluster_id
    assert announcement_of(answer) is None  # as if the peer had not answered: never trusted, never shown


def test_an_announced_cluster_id_is_read_and_absent_means_unknown() -> None:
    assert announcement_of(answer_of(X)).cluster_id == X
    assert announcement_of(answer_of(None)).cluster_id is None
    assert "cluster_id" not in THIS_RELEASE.to_wire(), "a node naming no cluster says nothing new"


@pytest.mark.parametrize(("own", "peer"), [(X, Y), (Y, X)])
def test_a_peer_of_another_cluster_is_refused_naming_both_ids(own: str, peer: str) -> None:
    versions = PeerVersions(local_announcement({}, own))
    notices = versions.heard("core2", answer_of(peer), 0)
    assert notices == [PeerRefused("core2", f"it belongs to cluster {peer}, this node to cluster {own}")]
    assert versions.refuses("core2") and versions.heard("core2", answer_of(peer), 10) == [], "logged once"
    # The same cluster, or a peer naming none (a release before it, a cluster that sets none): spoken to.
    for answer in (answer_of(own), answer_of(None), {"shards": {}}):
        assert incompatibility(local_announcement({}, own), announcement_of(answer)) is None
    assert incompatibility(local_announcement({}), announcement_of(answer_of(peer))) is None


def test_a_core_holds_an_unheard_peers_messages_only_while_it_names_a_cluster_id() -> None:
    assert PeerVersions(local_announcement({}, X)).holds("core2")
    assert not PeerVersions(local_announcement({})).holds("core2")
    heard = PeerVersions(local_announcement({}, X))
    heard.heard("core2", answer_of(None), 0)
    assert not heard.holds("core2") and not heard.refuses("core2")


def _heartbeat(node: CoreNode, shard: str, sender: str) -> None:
    heartbeat = AppendRequest(1, ZERO_KEY, GENESIS_DIGEST, ZERO_KEY, tuple(sorted(node.endpoints)))
    body = {"shard": shard, "sender": sender, "message": message_to_wire(heartbeat)}
    node._on_peer(Message("peer", "peer", messages.typed_body("peer", body)))


def _probe_answer(node: CoreNode, peer: str, answer: dict) -> None:
    request_id = f"versions-test-{peer}"
    node._versions_probes[request_id] = peer
    node._on_versions_answer(Message("reply", request_id, messages.typed_body("reply", {"result": answer})))


def test_a_core_acts_on_no_peer_message_of_another_cluster(tmp_path: Path, caplog) -> None:
    """A peer's first message of a shard creates the shard here (``CoreNode._shard_for``): the test's
    sign that the message was acted on. core2 announces another cluster, core3 this one, core4 none."""
    cores = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("core1", "core2", "core3", "core4")}
    extra = {"cluster": {"core_nodes": cores, "cluster_id": X}}
    node = CoreNode(node_config(tmp_path / "data", free_port(), extra=extra))
    node.bind()
    try:
        assert node.status()["versions"]["cluster_id"] == X
        _heartbeat(node, "s2", "core2")
        assert "s2" not in node.shards, "a peer not heard yet may be another cluster's"
        _probe_answer(node, "core2", answer_of(Y))
        _heartbeat(node, "s2", "core2")
        assert "s2" not in node.shards and node.peer_frames_refused == 2
        refused = node.status()["peer_versions"]["core2"]["refused"]
        assert refused == f"it belongs to cluster {Y}, this node to cluster {X}"
        assert [r.getMessage() for r in caplog.records if "core core2 refused" in r.getMessage()] == [
            f"core core2 refused: this core cannot speak with it: {refused}"
        ]
        _probe_answer(node, "core3", answer_of(X))
        _heartbeat(node, "s3", "core3")
        _probe_answer(node, "core4", answer_of(None))
        _heartbeat(node, "s4", "core4")
        assert {"s3", "s4"} <= set(node.shards), "the same cluster's, and one naming none, are spoken to"
    finally:
        node.close()


def test_a_data_directory_keeps_its_cluster_id_and_a_restore_of_another_clusters_backup_is_refused(
    tmp_path: Path,
) -> None:
    cores = {"core1": f"tcp://127.0.0.1:{free_port()}"}

    def start(data_dir: Path, cluster_id: str | None) -> CoreNode:
        extra = {"cluster": {"core_nodes": cores} | ({"cluster_id": cluster_id} if cluster_id else {})}
        return CoreNode(node_config(data_dir, free_port(), extra=extra))

    node = start(tmp_path / "x", X)  # a new data directory records the configured id
    node.close()
    node = start(tmp_path / "x", None)  # a config naming none: the directory's is announced
    try:
        assert node.versions.cluster_id == X and node.journal()["versions"]["cluster_id"] == X
        backup = tmp_path / "x.backup"
        node.answer_backup(messages.typed_body("backup", {"path": str(backup)}), None)
        assert node.backup_job.wait(30) and node.backup_job.state == "done", node.backup_job.status()
    finally:
        node.close()
    restore(str(backup), str(tmp_path / "y"), "core")
    with pytest.raises(StoreError, match=f"belongs to cluster {X}, but \\[cluster\\] cluster_id is {Y}"):
        start(tmp_path / "y", Y)
    node = start(tmp_path / "y", X)  # its own cluster's config starts it (the lock was given back)
    node.close()
    old = Store(str(tmp_path / "old.db"))  # a directory of a release before the id adopts the configured one
    try:
        assert old.claim_cluster_id(None) is None and old.claim_cluster_id(Y) == Y and old.claim_cluster_id(None) == Y
    finally:
        old.close()


def test_a_replicant_follows_no_core_of_another_cluster() -> None:
    shard = {"default": {"committed": [1, 5], "hears_sequencer": True, "agents": 0}}
    own = local_announcement({}, X)
    assert journal_answer(answer_of(Y, shard), "default", own) is None
    assert unreadable_log(answer_of(Y, shard), "default", own) == (
        f"this replicant cannot speak with it: it belongs to cluster {Y}, this node to cluster {X}"
    )
    for answer in (answer_of(X, shard), answer_of(None, shard)):
        assert journal_answer(answer, "default", own) is not None


@pytest.mark.parametrize("cluster_id", [X.upper(), "abc", 12])
def test_the_config_refuses_a_malformed_cluster_id(tmp_path: Path, cluster_id) -> None:
    with pytest.raises(ConfigError, match="cluster_id must be 32 lowercase hex digits"):
        node_config(tmp_path, free_port(), extra={"cluster": {"cluster_id": cluster_id}})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_core_process_configured_with_another_cluster_id_is_refused_and_counts_in_no_quorum(
    cluster: Cluster,
) -> None:
    """Real processes: core1 and core2 name cluster X, core3 (in the same ``core_nodes``) names Y.
    Each side refuses the other's frames and says why in ``status`` and its log; core3 holds none of
    the shard, and once core2 is killed, core1 cannot commit: core3 was never part of the quorum."""
    own = {"core1": X, "core2": X, "core3": Y}
    for name, cluster_id in own.items():
        config = cluster.root / f"{name}.toml"
        config.write_text(config.read_text().replace("[cluster]\n", f'[cluster]\ncluster_id = "{cluster_id}"\n', 1))
    cluster.start_all()
    with cluster.client("core1", timeout_ms=20_000) as client:
        client.create_table("t", "id", [("id", "INTEGER")])
        client.put("t", {"id": 1})
    for name, peer in (("core1", "core3"), ("core2", "core3"), ("core3", "core1"), ("core3", "core2")):
        why = f"it belongs to cluster {own[peer]}, this node to cluster {own[name]}"

        def refused(name: str = name, peer: str = peer, why: str = why) -> bool:
            status = cluster.status(name)
            return status is not None and (status["peer_versions"].get(peer) or {}).get("refused") == why

        wait_until(refused, 20, f"{name} to refuse {peer}")
        assert f"core {peer} refused: this core cannot speak with it: {why}" in cluster.nodes[name].log_path.read_text()
    assert "default" not in cluster.status("core3")["shards"], "core3 acted on no frame of the others"
    sequencer, _ = cluster.sequencer(among=["core1", "core2"])
    assert cluster.status(sequencer)["shards"]["default"]["followers"]["core3"]["match"] == [0, 0]
    cluster.nodes["core2"].kill()

    def no_sequencer() -> bool:
        status = cluster.status("core1")
        return status is not None and status["shards"]["default"]["sequencer"] is None

    wait_until(no_sequencer, 20, "core1 to have no sequencer once core2 is gone")
    committed = cluster.status("core1")["shards"]["default"]["committed"]
    with cluster.client("core1", timeout_ms=2000, retries=0) as client, pytest.raises(MnesiteError):
        client.put("t", {"id": 2})
    assert cluster.status("core1")["shards"]["default"]["committed"] == committed
