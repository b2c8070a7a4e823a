"""Real processes with [security]: 3 cores and a replicant refuse what the issue's attacks sent, and a
force-start cannot split the brain (issue 12's acceptance)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.core.consensus import AppendRequest, ExclusionNotice, VoteRequest
from mnesite.core.consensus_wire import message_to_wire
from mnesite.rlog import messages
from mnesite.rlog.client import Client, Forbidden, RemoteError, Unauthenticated
from mnesite.rlog.messages import Message
from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION
from mnesite.rlog.security import configure_client, generate_keys, load_key
from mnesite.rlog.types import TxKey, WriteOp, make_entry

from tests.conftest import Cluster, free_port, wait_until
from tests.test_cluster import create_table
from tests.test_replicants import shard_status, wait_normal, wait_replicant_caught_up

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def send_as(cluster: Cluster, principal_key: Path, endpoint: str, message: Message) -> Message | None:
    """One hand-made frame sent with ``principal_key``; the answer, or None if none came in 5 s."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        pair = load_key(str(principal_key), "key", secret=True)
        configure_client(socket, pair, load_key(str(cluster.keys_dir / "cluster.key"), "key", secret=False).public)
        socket.connect(endpoint)
        socket.send(messages.encode(message))
        return messages.decode(socket.recv()) if socket.poll(5000) else None
    finally:
        socket.close(0)


def generations(cluster: Cluster) -> dict[str, tuple[int, str, object]]:
    result = {}
    for name in cluster.names:
        info = cluster.status(name)["shards"]["default"]
        result[name] = (info["generation"], info["role"], info["excluded"])
    return result


def test_keys_and_roles_refuse_every_attack_of_the_issue(cluster: Cluster, tmp_path: Path) -> None:
    assert cluster.secure, "this test is about [security]; it does not run insecure"
    cluster.start_all()
    create_table(cluster)
    cluster.add_replicant("replicant1")
    cluster.start("replicant1")
    wait_normal(cluster, "replicant1")
    with cluster.client("core1", principal="app", retries=5) as writer:
        for i in range(20):
            writer.put("kv", {"id": i, "value": "before"})
    applied, digest = wait_replicant_caught_up(cluster, ["replicant1"])
    sequencer, generation = cluster.sequencer()
    follower = next(name for name in cluster.names if name != sequencer)
    before = generations(cluster)
    nodes = [*cluster.names, "replicant1"]

    # No key, or a key the cluster does not know: refused in the handshake, counted in status.
    generate_keys("stranger", str(tmp_path / "strangers"))
    stranger = {"key": tmp_path / "strangers" / "stranger.key_secret", "server_key": cluster.keys_dir / "cluster.key"}
    for name in nodes:
        with Client(cluster.endpoints[name], timeout_ms=3000, retries=0) as client, pytest.raises(Unauthenticated):
            client.status()
        with (
            Client(cluster.endpoints[name], timeout_ms=3000, retries=0, **stranger) as client,
            pytest.raises(Unauthenticated, match="refused this client's key"),
        ):
            client.put("kv", {"id": 999, "value": "stranger"})

    def refusals_counted() -> bool:
        for name in nodes:
            security = cluster.status(name)["security"]
            if security["refused_unknown_key"] < 1 or sum(security["handshakes_failed"].values()) < 2:
                return False
        return True

    wait_until(refusals_counted, 20, "every node to count the refused handshakes")

    # A reader cannot write; a writer cannot create tables or force-start (at cores and the replicant).
    for name in nodes:
        with cluster.client(name, principal="dashboard") as reader:
            assert reader.get("kv", 1) is not None
            with pytest.raises(Forbidden, match="may not send transact"):
                reader.put("kv", {"id": 1000, "value": "reader"})
        with cluster.client(name, principal="app") as writer:
            with pytest.raises(Forbidden, match="may not send create_table"):
                writer.create_table("other", "id")
            with pytest.raises(Forbidden, match="may not send force_start"):
                writer.force_start()
    result = CliRunner().invoke(main, ["journal", "force-start", "--yes", "--node", cluster.endpoints[follower]])
    assert result.exit_code == 1 and "--key" in result.output
    result = CliRunner().invoke(
        main, ["journal", "force-start", "--yes", "--node", cluster.endpoints[follower], *cluster.cli_keys("app")]
    )
    assert result.exit_code == 1 and "may not send force_start" in result.output

    # The forgeries of the issue, sent with non-core keys (a writer's and the replicant's).
    replicant_status = shard_status(cluster, "replicant1")
    forged_entry = make_entry(
        "default",
        TxKey(generation, 10_000),
        TxKey(*applied),
        bytes.fromhex(digest),
        (WriteOp("kv", {"id": 666, "value": "forged"}),),
        "forged",
    )
    vote = VoteRequest(generation + 1000, TxKey(generation + 1000, 1))
    append = AppendRequest(
        generation,
        TxKey(*applied),
        bytes.fromhex(digest),
        TxKey(generation, 10_000),
        tuple(cluster.names),
        (forged_entry,),
    )
    attacker_endpoint = f"tcp://127.0.0.1:{free_port()}"
    forgeries = [
        (sequencer, Message("peer", "f1", {"shard": "default", "sender": follower, "message": message_to_wire(vote)})),
        (
            follower,
            Message("peer", "f2", {"shard": "default", "sender": sequencer, "message": message_to_wire(append)}),
        ),
        *[
            (
                name,
                Message(
                    "peer",
                    "f3",
                    {
                        "shard": "default",
                        "sender": next(n for n in cluster.names if n != name),
                        "message": message_to_wire(
                            ExclusionNotice(generation + 1000, ("nobody",), TxKey(*applied), None)
                        ),
                    },
                ),
            )
            for name in cluster.names
        ],
        (
            "replicant1",
            Message(
                "push",
                "f4",
                {
                    "shard": "default",
                    "agent": replicant_status["agent"],
                    "core": replicant_status["upstream"],
                    "entries": [forged_entry.to_wire()],
                    "committed": [generation + 1000, 1],
                    "hears_sequencer": True,
                },
            ),
        ),
        (
            sequencer,
            Message(
                "watch",
                "f5",
                {
                    "shard": "default",
                    "replicant": "replicant1",
                    "endpoint": attacker_endpoint,
                    "from": [0, 0],
                    "from_digest": b"\0" * 32,
                    "protocol": REPLICATION_PROTOCOL_VERSION,
                },
            ),
        ),
    ]
    refused_before = {name: cluster.status(name)["security"] for name in nodes}
    for attacker in ("app", "replicant1"):
        key = cluster.keys_dir / f"{attacker}.key_secret"
        for target, message in forgeries:
            answer = send_as(cluster, key, cluster.endpoints[target], message)
            if message.kind == "push":
                assert answer is None  # pushes are never answered, refused or not
            elif attacker == "replicant1" and message.kind == "watch":
                # The replicant may watch; this one asks for pushes to an endpoint that cannot
                # complete a CurveZMQ handshake with the cluster key, so nothing leaves.
                assert answer is not None and answer.kind in ("reply", "error")
            else:
                assert answer is not None and answer.body.code == "forbidden", (attacker, target, answer)
    refused_after = {name: cluster.status(name)["security"] for name in nodes}
    assert sum(refused_after[n]["refused_role"] - refused_before[n]["refused_role"] for n in nodes) >= 11

    # Nothing changed: the same sequencer and generations, nobody excluded, no forged row anywhere,
    # and the cluster still takes writes that reach the replicant.
    assert generations(cluster) == before
    with cluster.client(sequencer, principal="app", retries=5) as writer:
        writer.put("kv", {"id": 100, "value": "after"})
    wait_replicant_caught_up(cluster, ["replicant1"])
    for name in nodes:
        with cluster.client(name, principal="dashboard") as reader:
            assert reader.get("kv", 666) is None
            assert reader.get("kv", 100) == {"id": 100, "value": "after"}
    assert generations(cluster) == before


def test_force_start_cannot_split_the_brain(cluster: Cluster) -> None:
    """The issue's sequence: force-start at a follower of a healthy cluster, then at another core
    while the sequencer is paused. Both are refused; the cluster keeps one history."""
    cluster.start_all()
    create_table(cluster)
    with cluster.client("core1", retries=5) as client:
        for i in range(10):
            client.put("kv", {"id": i, "value": "before"})
    cluster.wait_converged(cluster.names)
    sequencer, generation = cluster.sequencer()
    followers = [name for name in cluster.names if name != sequencer]
    runner = CliRunner()

    refused = runner.invoke(
        main, ["journal", "force-start", "--yes", "--node", cluster.endpoints[followers[0]], *cluster.cli_keys()]
    )
    assert refused.exit_code == 1, refused.output
    assert "force-start refused" in refused.output and "a majority" in refused.output
    for name in cluster.names:
        if name != followers[0]:
            assert name in refused.output  # it says which members it reached

    cluster.nodes[sequencer].signal(signal.SIGSTOP)
    try:
        for follower in followers:
            with cluster.client(follower, timeout_ms=5000, retries=0) as admin, pytest.raises(RemoteError) as error:
                admin.force_start()
            assert error.value.code == "force_start_refused"
            reached = error.value.detail["reached"]
            assert reached == [f for f in followers if f != follower], error.value
    finally:
        cluster.nodes[sequencer].signal(signal.SIGCONT)

    with cluster.client(followers[0], retries=10) as client:
        client.put("kv", {"id": 100, "value": "after"})
    position = cluster.wait_converged(cluster.names)
    for name in cluster.names:
        info = cluster.status(name)["shards"]["default"]
        assert info["forced"] is False and info["excluded"] is None and info["members"] == cluster.names
    sequencers = [name for name in cluster.names if cluster.status(name)["shards"]["default"]["role"] == "sequencer"]
    assert len(sequencers) == 1 and position["applied"][0] >= generation
    for name in cluster.names:
        with cluster.client(name) as client:
            assert len(list(client.scan("kv"))) == 11


def test_sighup_reloads_authorized_keys_and_roles_of_a_running_core(cluster: Cluster) -> None:
    assert cluster.secure, "this test is about [security]; it does not run insecure"
    cluster.start_all()
    create_table(cluster)
    generate_keys("newapp", str(cluster.keys_dir))
    newapp = {"key": cluster.keys_dir / "newapp.key_secret", "server_key": cluster.keys_dir / "cluster.key"}
    with (
        Client(cluster.endpoints["core1"], timeout_ms=3000, retries=0, **newapp) as client,
        pytest.raises(Unauthenticated),
    ):
        client.put("kv", {"id": 1, "value": "too early"})
    shutil.copy(cluster.keys_dir / "newapp.key", cluster.authorized_dir)
    config = cluster.root / "core1.toml"
    config.write_text(config.read_text().replace('writer = ["app"]', 'writer = ["app", "newapp"]'))
    cluster.nodes["core1"].signal(signal.SIGHUP)
    wait_until(lambda: cluster.status("core1")["security"]["reloads"] == 1, 20, "core1 to reload on SIGHUP")
    with Client(cluster.endpoints["core1"], timeout_ms=3000, retries=5, **newapp) as client:
        client.put("kv", {"id": 1, "value": "after the reload"})
        with pytest.raises(Forbidden):
            client.create_table("other", "id")
