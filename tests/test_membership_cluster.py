"""Real processes: membership changes on a running cluster (issue 14, ``core.membership``).

A 3-core cluster grows to 4 and shrinks back to 3 under writes with no acknowledged write lost, and
a core removed and re-added converges (equal digest at equal tx key)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.rlog.client import MnesiteError

from tests.conftest import Cluster, NodeProcess, free_port, wait_until
from tests.test_cluster import Load, check_agreement, create_table

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def cluster_cli(cluster: Cluster, through: str, *args: str) -> dict:
    runner = CliRunner()
    result = runner.invoke(
        main,
        [*args, "--node", cluster.endpoints[through], "--timeout-ms", "60000", "--json", *cluster.cli_keys()],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def shard_members(cluster: Cluster, name: str) -> list[str] | None:
    status = cluster.status(name)
    info = status["shards"].get("default") if status else None
    return info["members"] if info else None


def _three_cores_with_rows(
    tmp_path: Path, node_processes: list[NodeProcess], rows: int = 50, secure: bool = False
) -> Cluster:
    """Three cores with table kv holding ``rows`` rows."""
    cluster = Cluster(tmp_path, node_processes, size=3, secure=secure)
    cluster.start_all()
    create_table(cluster)
    with cluster.client("core1", retries=5) as client:
        for i in range(rows):
            client.put("kv", {"id": i, "value": "before"})
    return cluster


def _start_core4(cluster: Cluster) -> None:
    """Start core4 on an empty data directory and wait until it learned the members (core1-3)."""
    cluster.names.append("core4")
    cluster.endpoints["core4"] = f"tcp://127.0.0.1:{free_port()}"
    cluster._write_config("core4", "core")
    cluster.start("core4")
    wait_until(lambda: shard_members(cluster, "core4") == ["core1", "core2", "core3"], 20, "core4 to learn members")


def test_grow_to_four_shrink_to_three_and_re_add_under_writes(tmp_path: Path, node_processes: list[NodeProcess]):
    # Insecure: with [security] the new core's key must also be authorized on every core (README).
    cluster = Cluster(tmp_path, node_processes, size=3, secure=False)
    cluster.start_all()
    create_table(cluster)
    load = Load(cluster, ["core1", "core2"]).start()
    load.wait_for(100)

    # A fourth core, started with an empty data directory: it learns the membership from its peers
    # and is a learner (no vote) until the add entry reaches it.
    _start_core4(cluster)
    added = cluster_cli(cluster, "core1", "cluster", "add-core", "core4", cluster.endpoints["core4"])
    assert added["members"]["shards"]["default"]["members"] == ["core1", "core2", "core3", "core4"]
    wait_until(lambda: shard_members(cluster, "core4") == ["core1", "core2", "core3", "core4"], 20, "core4 a voter")
    load.wait_for(100)

    # Shrink back to three: core3 leaves; writes keep being acknowledged by {core1, core2, core4}.
    cluster_cli(cluster, "core2", "cluster", "remove-core", "core3")
    for name in ("core1", "core2", "core4"):
        wait_until(lambda name=name: shard_members(cluster, name) == ["core1", "core2", "core4"], 20, f"{name}")
    load.wait_for(100)
    members = cluster_cli(cluster, "core4", "cluster", "members")
    assert members["members"] == ["core1", "core2", "core4"]

    # The removed core (still running, its log intact) is added again and converges.
    cluster_cli(cluster, "core1", "cluster", "add-core", "core3", cluster.endpoints["core3"])
    load.wait_for(100)
    acknowledged = load.stop()
    check_agreement(cluster, ["core1", "core2", "core3", "core4"], acknowledged)
    assert shard_members(cluster, "core3") == ["core1", "core2", "core3", "core4"]


def test_a_core_left_out_by_a_forced_start_rejoins_through_add_core(tmp_path: Path, node_processes: list[NodeProcess]):
    cluster = _three_cores_with_rows(tmp_path, node_processes)
    cluster.wait_converged(cluster.names)
    for name in ("core2", "core3"):
        cluster.nodes[name].kill()
    wait_until(lambda: cluster.client("core1", timeout_ms=1000).journal()["reachable_peers"] == [], 10, "core1 alone")
    forced = CliRunner().invoke(
        main, ["journal", "force-start", "--yes", "--node", cluster.endpoints["core1"], "--json"]
    )
    assert forced.exit_code == 0, forced.output
    with cluster.client("core1", timeout_ms=3000, retries=3) as client:
        for i in range(50, 80):
            client.put("kv", {"id": i, "value": "after force"})
    cluster.start("core2")
    wait_until(
        lambda: ((cluster.status("core2") or {}).get("shards", {}).get("default") or {}).get("excluded") is not None,
        20,
        "core2 to learn that it was left out",
    )
    cluster_cli(cluster, "core1", "cluster", "add-core", "core2", cluster.endpoints["core2"])
    position = cluster.wait_converged(["core1", "core2"])
    status = cluster.status("core2")["shards"]["default"]
    assert status["excluded"] is None and status["members"] == ["core1", "core2"]
    # It takes part again: a write through it commits (core1 and core2 are both voters now) and both
    # hold all 81 rows at an equal digest.
    with cluster.client("core2", timeout_ms=5000, retries=3) as client:
        client.put("kv", {"id": 1000, "value": "after rejoin"})
    assert cluster.wait_converged(["core1", "core2"])["applied"] > position["applied"]
    for name in ("core1", "core2"):
        with cluster.client(name) as client:
            assert len(list(client.scan("kv"))) == 81


def test_a_new_core_behind_the_trimmed_log_catches_up_by_snapshot_before_it_is_added(
    tmp_path: Path, node_processes: list[NodeProcess]
):
    cluster = Cluster(tmp_path, node_processes, size=3, secure=False)
    cluster.extend_core_configs("[rlog]\nretention_entries_max = 50\n")
    cluster.start_all()
    create_table(cluster)
    load = Load(cluster, ["core1", "core2", "core3"]).start()
    load.wait_for(300)

    # Every core runs retention on its own timer, so each must have trimmed: had only core1 (a
    # follower) trimmed, a sequencer still holding its first entries would feed core4 from the log
    # and no snapshot would be needed (a CI run on 2026-12-02 saw exactly that).
    def trimmed(name: str) -> bool:
        status = cluster.status(name) or {}
        first = status.get("shards", {}).get("default", {}).get("rlog", {}).get("first")
        return (first or [0, 0]) > [1, 1]

    wait_until(lambda: all(trimmed(name) for name in ("core1", "core2", "core3")), 30, "the cores to trim their rlog")
    cluster.names.append("core4")
    cluster.endpoints["core4"] = f"tcp://127.0.0.1:{free_port()}"
    cluster._write_config("core4", "core")
    config = cluster.root / "core4.toml"
    config.write_text(config.read_text() + "[rlog]\nretention_entries_max = 50\n")
    cluster.start("core4")
    wait_until(lambda: shard_members(cluster, "core4") == ["core1", "core2", "core3"], 20, "core4 to learn members")
    cluster_cli(cluster, "core3", "cluster", "add-core", "core4", cluster.endpoints["core4"])
    load.wait_for(100)
    acknowledged = load.stop()
    check_agreement(cluster, cluster.names, acknowledged)
    log_text = (cluster.root / "core4.log").read_text()
    assert "installing a snapshot" in log_text and "snapshot installed" in log_text
    assert shard_members(cluster, "core4") == ["core1", "core2", "core3", "core4"]


def test_with_security_a_new_core_is_authorized_by_key_and_sighup_then_added(
    tmp_path: Path, node_processes: list[NodeProcess]
):
    """The README's procedure: the new core's public key goes into every core's authorized_keys
    directory and its name under [security.roles] core, SIGHUP, then add-core."""
    import shutil
    import signal

    from mnesite.rlog.security import generate_keys

    cluster = _three_cores_with_rows(tmp_path, node_processes, rows=30, secure=True)
    generate_keys("core4", str(cluster.keys_dir))
    shutil.copy(cluster.keys_dir / "core4.key", cluster.authorized_dir)
    old_roles = 'core = ["core1", "core2", "core3"]'
    new_roles = 'core = ["core1", "core2", "core3", "core4"]'
    for name in ("core1", "core2", "core3"):
        config = cluster.root / f"{name}.toml"
        assert old_roles in config.read_text()
        config.write_text(config.read_text().replace(old_roles, new_roles))
        cluster.nodes[name].signal(signal.SIGHUP)
    for name in ("core1", "core2", "core3"):
        wait_until(
            lambda name=name: "SIGHUP: reloaded" in (cluster.root / f"{name}.log").read_text(), 10, f"{name} reload"
        )
    _start_core4(cluster)
    added = cluster_cli(cluster, "core2", "cluster", "add-core", "core4", cluster.endpoints["core4"])
    assert added["members"]["shards"]["default"]["members"] == ["core1", "core2", "core3", "core4"]
    with cluster.client("core4", retries=3) as client:
        client.put("kv", {"id": 100, "value": "through core4"})
    cluster.wait_converged(cluster.names)
    # A writer may not change the membership (admin only).
    with cluster.client("core1", principal="app") as client, pytest.raises(MnesiteError) as refused:
        client.change_membership("default", "remove", "core4")
    assert getattr(refused.value, "code", None) == "forbidden", refused.value
    assert shard_members(cluster, "core1") == ["core1", "core2", "core3", "core4"]


def test_a_dead_core_is_replaced_by_remove_then_add_and_the_sequencer_can_remove_itself(
    tmp_path: Path, node_processes: list[NodeProcess]
):
    cluster = Cluster(tmp_path, node_processes, size=3, secure=False)
    cluster.start_all()
    create_table(cluster)
    sequencer, _ = cluster.sequencer()
    dead = next(name for name in cluster.names if name != sequencer)
    alive = [name for name in cluster.names if name != dead]
    load = Load(cluster, alive).start()
    load.wait_for(100)
    cluster.nodes[dead].kill()
    load.wait_for(100)
    cluster_cli(cluster, alive[0], "cluster", "remove-core", dead)
    cluster.names.append("core4")
    cluster.endpoints["core4"] = f"tcp://127.0.0.1:{free_port()}"
    cluster._write_config("core4", "core")
    cluster.start("core4")
    cluster_cli(cluster, alive[1], "cluster", "add-core", "core4", cluster.endpoints["core4"])
    members = sorted([*alive, "core4"])
    wait_until(lambda: shard_members(cluster, "core4") == members, 20, "core4 a voter")
    load.wait_for(100)
    # The sequencer removes itself: it steps down once the entry commits and the two others elect one.
    sequencer, _ = cluster.sequencer(among=members)
    cluster_cli(cluster, sequencer, "cluster", "remove-core", sequencer)
    remaining = [name for name in members if name != sequencer]
    wait_until(lambda: cluster.sequencer(among=remaining) is not None, 20, "a sequencer among the remaining cores")
    load.through = remaining
    load.wait_for(100)
    acknowledged = load.stop()
    check_agreement(cluster, remaining, acknowledged)
    assert shard_members(cluster, remaining[0]) == remaining


def test_a_replicant_applies_membership_entries_and_keeps_serving(tmp_path: Path, node_processes: list[NodeProcess]):
    """A replicant applies a membership entry like any other (its set-based apply skips it: no
    table changes) and keeps up with the writes after it."""
    cluster = Cluster(tmp_path, node_processes, size=3, secure=False)
    cluster.start_all()
    create_table(cluster)
    cluster.add_replicant("replicant1")
    cluster.start("replicant1")

    def replicant_shard() -> dict:
        return ((cluster.status("replicant1") or {}).get("shards", {}).get("default")) or {}

    wait_until(lambda: replicant_shard().get("mode") == "normal", 60, "replicant1 to be normal")
    load = Load(cluster, ["core1", "core2"]).start()
    load.wait_for(50)
    cluster_cli(cluster, "core1", "cluster", "remove-core", "core3")
    load.wait_for(50)
    acknowledged = load.stop()
    remaining = ["core1", "core2"]
    # Compared with the cores' position as it is when the replicant has it: the sequencer may append
    # a cluster version entry after the membership change, after the load (the replicant resuming on
    # another core then gets both in one push, never stopping at the position before it).
    cluster.wait_replicants_converged(remaining, ["replicant1"], timeout_s=30)
    assert replicant_shard()["mode"] == "normal"
    check_agreement(cluster, remaining, acknowledged)


@pytest.mark.timeout(120)
def test_a_kept_core_that_gets_the_forced_start_by_snapshot_is_forced_and_tells_a_core_left_out(
    tmp_path: Path, node_processes: list[NodeProcess]
):
    """A forced start keeps three of six cores; one of them (``rebuilt``) loses its disk and gets the
    forced start's entry only inside a snapshot (the forced core trimmed its log past it). The offer's
    ``forced`` field makes it forced (``core.snapshot.state_after_install``): with the two others gone,
    it alone tells a core the forced start left out that it was excluded. Without the field it stayed
    unforced and answered nobody."""
    cluster = Cluster(tmp_path, node_processes, size=6, secure=False)
    cluster.extend_core_configs("[rlog]\nretention_entries_max = 10\nretention_interval_ms = 100\n")
    cluster.start_all()
    create_table(cluster)
    # Quiet first: the cluster version entry of the start is in, so no core is ahead of another.
    wait_until(lambda: {(cluster.status(n) or {}).get("cluster_version") for n in cluster.names} == {2}, 30, "v2")
    cluster.wait_converged(cluster.names)
    wait_until(lambda: cluster.sequencer() is not None, 20, "a sequencer")
    forced_core, _ = cluster.sequencer()
    kept, rebuilt, left_out, *gone = [name for name in cluster.names if name != forced_core]
    for name in (left_out, *gone):
        cluster.nodes[name].kill()
    cluster.wait_converged([forced_core, kept, rebuilt])
    forced = cluster_cli(cluster, forced_core, "journal", "force-start", "--yes")
    assert forced["members"] == sorted([forced_core, kept, rebuilt])
    generation = forced["shards"]["default"]["generation"]

    # The rebuilt core's disk is lost; the forced core and the kept one commit past the forced start's
    # entry (the first of its generation) and trim it away.
    cluster.nodes[rebuilt].kill()
    shutil.rmtree(cluster.data_dir(rebuilt))
    with cluster.client(forced_core, timeout_ms=5000, retries=3) as client:
        for i in range(30):
            client.put("kv", {"id": i, "value": "after force"})

    def trimmed_past_the_forced_entry() -> bool:
        first = cluster.status(forced_core)["shards"]["default"]["rlog"]["first"]
        return first is not None and tuple(first) > (generation, 1)

    wait_until(trimmed_past_the_forced_entry, 20, "the forced core to trim its forced start's entry")
    cluster.start(rebuilt)
    cluster.wait_converged([forced_core, kept, rebuilt])
    assert "snapshot installed" in (cluster.root / f"{rebuilt}.log").read_text()
    status = cluster.status(rebuilt)["shards"]["default"]
    assert status["members"] == sorted([forced_core, kept, rebuilt])
    assert status["forced"] is True, status

    # The forced core and the kept one go at once (no election among the members records the forced
    # membership again): only the rebuilt core is left to tell a core the forced start left out.
    cluster.nodes[forced_core].kill()
    cluster.nodes[kept].kill()
    cluster.start(left_out)
    wait_until(
        lambda: ((cluster.status(left_out) or {}).get("shards", {}).get("default") or {}).get("excluded") is not None,
        20,
        f"{left_out} to learn that it was left out",
    )
    assert cluster.status(left_out)["shards"]["default"]["excluded"]["by"] == rebuilt


def test_add_core_finishes_after_its_sequencer_is_killed_while_the_learner_catches_up(
    tmp_path: Path, node_processes: list[NodeProcess]
):
    """The sequencer, catching core4 up as a learner (core4 paused: the catch-up cannot end), is
    killed: `cluster add-core` hears neither the change nor `members` from it, asks the other cores
    who the new sequencer is and asks it the change anew, which catches core4 up and adds it (exit 0)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    cluster = _three_cores_with_rows(tmp_path, node_processes)
    _start_core4(cluster)
    sequencer, _ = cluster.sequencer(among=["core1", "core2", "core3"])
    through = next(name for name in ("core1", "core2", "core3") if name != sequencer)
    cluster.nodes["core4"].signal(signal.SIGSTOP)
    command = [sys.executable, "-m", "mnesite.cli", "cluster", "add-core", "core4", cluster.endpoints["core4"]]
    command += ["--node", cluster.endpoints[through], "--timeout-ms", "2000", *cluster.cli_keys()]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as adding:
        try:

            def learning() -> bool:
                with cluster.client(sequencer, timeout_ms=1000) as client:
                    return client.members()["shards"]["default"]["learner"] == "core4"

            wait_until(learning, 20, f"{sequencer} to catch core4 up as a learner")
            cluster.nodes[sequencer].kill()
            cluster.nodes["core4"].signal(signal.SIGCONT)
            stdout, stderr = adding.communicate(timeout=90)
        finally:
            cluster.nodes["core4"].signal(signal.SIGCONT)
            if adding.poll() is None:
                adding.kill()
    assert adding.returncode == 0, (stdout, stderr)
    assert f"the sequencer {sequencer} fell silent" in stderr and "asking the change anew" in stderr, stderr
    survivors = [name for name in ("core1", "core2", "core3") if name != sequencer]
    want = sorted(["core1", "core2", "core3", "core4"])
    for name in [*survivors, "core4"]:
        wait_until(lambda name=name: shard_members(cluster, name) == want, 20, f"{name} to hold core4 a member")


def test_with_security_a_new_core_started_before_its_key_is_authorized_is_added_after_the_sighup(
    tmp_path: Path, node_processes: list[NodeProcess]
):
    """The forgiving order: core4 starts first, refused by every core for its key; its key is then
    authorized (SIGHUP) and add-core adds it, without a restart of core4 (it dials the cores again:
    ``NodeServer.reconnect_refused``)."""
    import signal

    from mnesite.rlog.security import generate_keys

    cluster = _three_cores_with_rows(tmp_path, node_processes, rows=30, secure=True)
    generate_keys("core4", str(cluster.keys_dir))
    cluster.names.append("core4")
    cluster.endpoints["core4"] = f"tcp://127.0.0.1:{free_port()}"
    cluster._write_config("core4", "core")
    cluster.start("core4")

    def refused_keys() -> int:
        return sum(
            ((cluster.status(name) or {}).get("security") or {}).get("handshakes_failed", {}).get("auth", 0)
            for name in ("core1", "core2", "core3")
        )

    wait_until(lambda: refused_keys() >= 3, 30, "the cores to refuse core4's key")
    # Its start-up recovery heard no core: the log says they refused its key, not that it is a new cluster's.
    log_text = (cluster.root / "core4.log").read_text()
    assert "peers refused this core's connection, so it cannot tell whether the cluster has history" in log_text
    assert "core1 refused this core's key" in log_text and "starting as a core of a new cluster" not in log_text
    shutil.copy(cluster.keys_dir / "core4.key", cluster.authorized_dir)
    old_roles = 'core = ["core1", "core2", "core3"]'
    new_roles = 'core = ["core1", "core2", "core3", "core4"]'
    for name in ("core1", "core2", "core3"):
        config = cluster.root / f"{name}.toml"
        config.write_text(config.read_text().replace(old_roles, new_roles))
        cluster.nodes[name].signal(signal.SIGHUP)
    for name in ("core1", "core2", "core3"):
        wait_until(
            lambda name=name: "SIGHUP: reloaded" in (cluster.root / f"{name}.log").read_text(), 10, f"{name} reload"
        )
    added = cluster_cli(cluster, "core2", "cluster", "add-core", "core4", cluster.endpoints["core4"])
    assert added["members"]["shards"]["default"]["members"] == ["core1", "core2", "core3", "core4"]
    with cluster.client("core4", retries=3) as client:
        client.put("kv", {"id": 100, "value": "through core4"})
    cluster.wait_converged(cluster.names)
    assert cluster.status("core4")["connections"]["redials_refused_key"] >= 1
    assert "refused this node's key" in (cluster.root / "core4.log").read_text()
