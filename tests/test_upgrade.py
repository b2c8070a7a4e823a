"""Release 0.1.0 and this tree in one cluster (issue 23): a rolling upgrade under writes, a roll back,
and data directories across releases.

The previous release is the tagged ``v0.1.0``, commit ``RELEASE_0_1_0_COMMIT`` of main's history. A
fresh clone may lack tags, so the tree is taken by commit (``git archive``) and, when the tag exists,
checked to be the tag's. It is installed into a venv of its own without touching the network: the
venv reads its dependencies from this tree's venv (a ``.pth`` line naming its site-packages, whose own
``.pth`` files, the editable install of this tree among them, are not processed) and pip installs the
exported tree with ``--no-deps --no-index --no-build-isolation``. That takes 2-3 s (``setup_s``).
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import pytest
from mnesite.rlog.types import TxKey
from mnesite.rlog.versions import SPEAK_ONLY_ENV

from tests.conftest import REPO, Cluster, NodeProcess, logged_op_tags, wait_until
from tests.fault.checker import Verdict, check_history
from tests.fault.history import COLUMNS, TABLE, Recorder
from tests.fault.run import (
    CORE_CONFIG_EXTRA,
    SHARD,
    check_convergence,
    check_lost_writes,
    final_reads,
    wait_all_converged,
)

RELEASE_0_1_0_TAG = "v0.1.0"
RELEASE_0_1_0_COMMIT = "3f4dcd03de2ebb3d68c3225d3fde0d29f663591a"
INSTALL_TIMEOUT_S = 120
STEP_TIMEOUT_S = 60
# What a node logs when it was sent something it cannot read (rlog.server, core.watch, rlog.messages).
UNREADABLE_SIGNS = ("protocol violation", "malformed", "incompatible_protocol", "unsupported", "unknown_kind")


def without_this_tree() -> dict[str, str]:
    """The environment for another release's interpreter: without PYTHONPATH, which may name this tree
    (the Spark tests set it for their workers), so that its own installed package is the one imported."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def install_release(commit: str, root: Path) -> Path:
    """This repository's tree at ``commit`` installed into ``root/venv``; its python."""
    tag = subprocess.run(
        ["git", "rev-parse", "-q", "--verify", f"{RELEASE_0_1_0_TAG}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if tag.returncode == 0 and commit == RELEASE_0_1_0_COMMIT:
        assert tag.stdout.strip() == commit, f"tag {RELEASE_0_1_0_TAG} is {tag.stdout.strip()}, not {commit}"
    present = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, timeout=30)
    if present.returncode != 0:
        pytest.fail(f"commit {commit} (release 0.1.0) is not in this clone: a shallow clone? git fetch --unshallow")
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, timeout=60, check=True)
    source = root / "src"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(source, filter="data")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    # The dependencies (and setuptools, to build the tree) come from this tree's venv: offline and fast.
    Path(purelib, "mnesite-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
        + ["--no-build-isolation", "--disable-pip-version-check", str(source)],
        check=True,
        capture_output=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    return python


@pytest.fixture(scope="module")
def release_0_1_0(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """(python of release 0.1.0, seconds its installation took)."""
    started = time.monotonic()
    python = install_release(RELEASE_0_1_0_COMMIT, tmp_path_factory.mktemp("release-0.1.0"))
    version = subprocess.run(
        [str(python), "-m", "mnesite.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=python.parent,
        env=without_this_tree(),
    )
    assert "0.1.0" in version.stdout, version.stdout + version.stderr
    return python, time.monotonic() - started


def _cluster_version(status: dict | None) -> int | None:
    """A core's cluster version from its status (release 0.1.0 reports none: it is at 1)."""
    if status is None:
        return None
    return status.get("cluster_version", 1)


def _restart(cluster: Cluster, name: str, python: Path | None) -> float:
    """Stop ``name`` cleanly and start it on ``python`` (None: this tree); the seconds it took."""
    started = time.monotonic()
    node = cluster.nodes[name]
    node.stop()
    node.python = str(python) if python is not None else None
    cluster.start(name)
    return time.monotonic() - started


def _wait_serving(cluster: Cluster, name: str, replicant: bool) -> None:
    def serving() -> bool:
        info = ((cluster.status(name) or {}).get("shards") or {}).get(SHARD) or {}
        return info.get("mode") == "normal" if replicant else info.get("serving") is True

    wait_until(serving, STEP_TIMEOUT_S, f"{name} to serve again", interval_s=0.1)


def _node_metrics(status: dict) -> str:
    """The Prometheus text of a node's status, as its metrics endpoint serves it."""
    from mnesite.rlog.metrics import NodeMetrics

    metrics = NodeMetrics(status["node"], status["role"])
    metrics.refresh(0, status)
    return metrics.text().decode()


BULK_ROWS = 20


def _software(status: dict | None) -> str:
    return ((status or {}).get("versions") or {}).get("software", "0.1.0")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rolling_upgrade_from_0_1_0_under_writes_with_a_roll_back(
    tmp_path: Path, node_processes: list[NodeProcess], release_0_1_0: tuple[Path, float]
) -> None:
    old_python, setup_s = release_0_1_0
    timings: dict[str, float] = {"setup_s": round(setup_s, 1)}
    began = time.monotonic()
    cluster = Cluster(tmp_path, node_processes)
    cluster.extend_core_configs(CORE_CONFIG_EXTRA)
    replicants = ["replicant1", "replicant2"]
    for name in replicants:
        cluster.add_replicant(name)
    for node in cluster.nodes.values():
        node.python = str(old_python)
    cluster.start_all()
    with cluster.client(cluster.names[0], timeout_ms=5000, retries=5) as client:
        client.create_table(TABLE, "id", COLUMNS)
    for name in replicants:
        cluster.start(name)
    for name in replicants:
        _wait_serving(cluster, name, replicant=True)
    assert all(_software(cluster.status(name)) == "0.1.0" for name in cluster.nodes)
    timings["old_cluster_up_s"] = round(time.monotonic() - began, 1)

    # Three writers, one per core (a writer whose core is restarting pauses and tries again).
    connect = [functools.partial(cluster.client, name, timeout_ms=2000, retries=1) for name in cluster.names]
    recorder = Recorder(connect, keys=5, seed=23)
    wait_until(lambda: cluster.sequencer() is not None, STEP_TIMEOUT_S, "a sequencer")
    sequencer, generation_before = cluster.sequencer()
    followers = [name for name in cluster.names if name != sequencer]
    recorder.start()
    try:

        def acknowledged_more(count: int = 20) -> None:
            target = len(recorder.acknowledged) + count
            wait_until(lambda: len(recorder.acknowledged) >= target, STEP_TIMEOUT_S, f"{count} more writes")

        def cluster_versions() -> set[int | None]:
            return {_cluster_version(cluster.status(name)) for name in cluster.names}

        acknowledged_more()
        bulk_keys = []  # bulk writes: packed a row at a time while a member speaks only 1, as one run after

        def bulk_write() -> TxKey:
            first = 1000 + BULK_ROWS * len(bulk_keys)  # above the recorder's keys
            ops = [{"op": "write", "table": TABLE, "row": {"id": first + i, "value": i}} for i in range(BULK_ROWS)]
            with cluster.client(cluster.names[len(bulk_keys) % 3], timeout_ms=5000, retries=5) as client:
                bulk_keys.append(client.transact(ops))
            return bulk_keys[-1]

        # The documented order (docs/operations/upgrades.md): replicants, followers, the sequencer last.
        steps: list[tuple[str, Path | None, str]] = [
            *((name, None, "upgrade") for name in replicants),
            (followers[0], None, "upgrade"),
            (followers[0], old_python, "roll back"),
            (followers[0], None, "upgrade again"),
            (followers[1], None, "upgrade"),
        ]
        for name, python, what in steps:
            timings[f"{what} {name}_s"] = round(_restart(cluster, name, python), 1)
            _wait_serving(cluster, name, replicant=name in replicants)
            acknowledged_more()
            # The cluster version waits for the last core: a member still speaks only 1.
            assert cluster_versions() == {1}, f"after {what} of {name}: {cluster_versions()}"
            bulk_write()
        status = cluster.status(followers[0])
        assert _software(status) != "0.1.0" and status["peer_versions"][sequencer]["software"] == "0.1.0"
        assert status["peer_versions"][sequencer]["announced"] is False
        timings[f"upgrade {sequencer} (sequencer)_s"] = round(_restart(cluster, sequencer, None), 1)
        _wait_serving(cluster, sequencer, replicant=False)
        moved = time.monotonic()
        wait_until(lambda: cluster_versions() == {2}, STEP_TIMEOUT_S, "the cluster version to move to 2", 0.1)
        timings["cluster_version_moved_after_s"] = round(time.monotonic() - moved, 1)
        bulk_write()
        acknowledged_more()
    finally:
        recorder.stop()
    assert not recorder.failures, recorder.failures

    # At most one election for the one sequencer restart (followers' restarts cause none).
    _, generation_after = cluster.sequencer() or (None, None)
    assert generation_after is not None and generation_after - generation_before <= 1, (
        generation_before,
        generation_after,
    )
    # An older release refuses the newer data directory with one clear error, and changes nothing (a
    # follower of now: the restarted sequencer's election may have made one of the others sequencer).
    new_sequencer, _ = cluster.sequencer()
    follower = next(name for name in cluster.names if name != new_sequencer)
    cluster.nodes[follower].stop()
    cluster.nodes[follower].python = str(old_python)
    with pytest.raises(AssertionError, match="node exited"):
        cluster.start(follower)
    assert "not a mnesite database of format 1 (found 2)" in cluster.nodes[follower].log_path.read_text()
    cluster.nodes[follower].python = None
    cluster.start(follower)

    position = wait_all_converged(cluster, replicants)
    history = list(recorder.history)
    final_reads(cluster, 5, history)
    results = check_history(history, steps_max=2_000_000)
    assert all(result.verdict is Verdict.LINEARIZABLE for result in results), [
        result.report(around=5) for result in results if result.verdict is not Verdict.LINEARIZABLE
    ]
    assert check_lost_writes(cluster, recorder.acknowledged) == []
    assert check_convergence(cluster, cluster.names + replicants, position) == []
    for name in cluster.nodes:
        status = cluster.status(name)
        assert _software(status) != "0.1.0", name
        if name in cluster.names:
            assert status["storage_format"] == 2 and status["shards"][SHARD]["cluster_version"] == 2
    # Bulk writes were packed a row at a time while release 0.1.0 had to read them, as one run after.
    packing = [logged_op_tags(cluster.data_dir(cluster.names[0]), SHARD, key) for key in bulk_keys]
    assert packing == [["w"] * BULK_ROWS] * (len(bulk_keys) - 1) + [["r"]], packing
    for name in cluster.names + replicants:
        with cluster.client(name, timeout_ms=5000, retries=5) as client:
            assert client.count(TABLE) >= BULK_ROWS * len(bulk_keys), name
    # Nothing any node was sent was something it could not read: no refusals of frames, watches or entries.
    for name, node in cluster.nodes.items():
        text = node.log_path.read_text()
        for sign in UNREADABLE_SIGNS:
            assert sign not in text, f"{name}'s log: {sign}"
    timings["total_s"] = round(time.monotonic() - began, 1)
    timings["acknowledged_writes"] = len(recorder.acknowledged)
    timings["generations"] = generation_after - generation_before
    print(f"rolling upgrade timings: {timings}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_directory_of_0_1_0_opens_in_this_release(
    tmp_path: Path, node_processes: list[NodeProcess], release_0_1_0: tuple[Path, float]
) -> None:
    """A data directory written by release 0.1.0 starts on this release as it is (format 1) and keeps
    its rows; it moves to format 2 only with the cluster version (a one-core cluster moves at once)."""
    old_python, _ = release_0_1_0
    cluster = Cluster(tmp_path, node_processes, size=1)
    node = cluster.nodes["core1"]
    node.python = str(old_python)
    cluster.start("core1")
    with cluster.client("core1") as client:
        client.create_table(TABLE, "id", COLUMNS)
        for key in range(10):
            client.put(TABLE, {"id": key, "value": key * 7})
        old_position = client.status()["shards"][SHARD]
    node.stop()
    node.python = None
    cluster.start("core1")
    with cluster.client("core1") as client:
        assert [row["value"] for row in client.scan(TABLE)] == [key * 7 for key in range(10)]
        wait_until(lambda: _cluster_version(cluster.status("core1")) == 2, 30, "the one core's cluster version")
        status = client.status()
        assert status["storage_format"] == 2 and status["versions"]["software"] != "0.1.0"
        entries = client.rlog_entries(SHARD, old_position["applied"], 10)
        assert [op["op"] for entry in entries for op in entry["ops"]] == ["cluster_version"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_core_of_an_incompatible_version_is_refused_logged_once_and_the_cluster_keeps_serving(
    tmp_path: Path, node_processes: list[NodeProcess]
) -> None:
    """core4 is built to speak only cluster version 3 (``MNESITE_TEST_CLUSTER_VERSION_ONLY``): the three
    others refuse it (one log line each), show it in ``status``, ``journal show`` and metrics, and keep
    serving with their majority of the four."""
    cluster = Cluster(tmp_path, node_processes, size=4)
    for name in cluster.names[:3]:
        cluster.start(name)
    with cluster.client("core1", timeout_ms=5000, retries=5) as client:
        client.create_table(TABLE, "id", COLUMNS)
        client.put(TABLE, {"id": 1, "value": 1})
    cluster.nodes["core4"].start(cluster.endpoints["core4"], env={SPEAK_ONLY_ENV: "3"})

    def refused_by(name: str) -> dict | None:
        return ((cluster.status(name) or {}).get("peer_versions") or {}).get("core4")

    for name in cluster.names[:3]:
        wait_until(lambda name=name: (refused_by(name) or {}).get("compatible") is False, 30, f"{name} to refuse core4")
    first = refused_by("core1")
    assert "cluster versions 3" in first["refused"] and first["cluster_versions"] == [3, 3]
    # Probes go on (a refused core may come back on a release that overlaps); the line is not repeated.
    wait_until(lambda: refused_by("core1")["heard_ms"] >= first["heard_ms"] + 2 * 2000, 30, "two more probes")
    for name in cluster.names[:3]:
        assert cluster.nodes[name].log_path.read_text().count("core core4 refused") == 1, name
    # A replicant of this release follows the three and refuses core4 the same way (one line).
    cluster.add_replicant("replicant1")
    cluster.start("replicant1")
    _wait_serving(cluster, "replicant1", replicant=True)
    wait_until(
        lambda: ((cluster.status("replicant1") or {}).get("core_versions") or {}).get("core4", {}).get("refused"),
        30,
        "replicant1 to hear core4",
    )
    replicant = cluster.status("replicant1")
    assert replicant["shards"][SHARD]["upstream"] in cluster.names[:3]
    assert cluster.nodes["replicant1"].log_path.read_text().count("core core4: refused") == 1
    own = cluster.status("core4")
    assert own["versions"]["cluster_versions"] == [3, 3]
    assert {peer for peer, info in own["peer_versions"].items() if not info["compatible"]} == {
        "core1",
        "core2",
        "core3",
    }
    # The cluster keeps serving, and its cluster version waits: core4 is a member that speaks no version of theirs.
    with cluster.client("core2", timeout_ms=5000, retries=5) as client:
        for key in range(2, 12):
            client.put(TABLE, {"id": key, "value": key})
        # Read-your-writes: core2 follows the sequencer and applies the last write when it hears the
        # commit key (a commit notice may wait up to 10 ms for a batch); a local read may come first.
        assert client.count(TABLE, consistency="read-your-writes") == 11
    position = cluster.wait_converged(cluster.names[:3])
    assert position["applied"] is not None
    assert all(cluster.status(name)["cluster_version"] == 1 for name in cluster.names[:3])
    shown = subprocess.run(
        [sys.executable, "-m", "mnesite.cli", "journal", "show", "--node", cluster.endpoints["core1"]]
        + cluster.cli_keys(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert shown.returncode == 0, shown.stderr
    assert "core1 refuses core4 (incompatible)" in shown.stdout
    status_text = subprocess.run(
        [sys.executable, "-m", "mnesite.cli", "status", "--node", cluster.endpoints["core2"]] + cluster.cli_keys(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert "core4: release" in status_text.stdout and "INCOMPATIBLE, refused" in status_text.stdout
    metrics = _node_metrics(cluster.status("core1"))
    lines = [line for line in metrics.splitlines() if line.startswith("mnesite_peer_incompatible{")]
    assert [line.rsplit(" ", 1)[1] for line in lines if 'peer="core4"' in line] == ["1.0"], lines
    assert [line.rsplit(" ", 1)[1] for line in lines if 'peer="core2"' in line] == ["0.0"], lines


OLD_SPILL_SCRIPT = """
import json, sys
from mnesite.rlog.store import Store
from mnesite.rlog.types import CreateTableOp, TxKey, WriteOp, make_entry

store = Store(sys.argv[1], synchronous="NORMAL")
start_key, start_digest = TxKey(1, 5), bytes(range(32))
with store.write_transaction():
    store.ensure_shard("default", 1)
    store.apply_ops((CreateTableOp("kv", "default", "id", (("id", "INTEGER"), ("v", "TEXT"))),))
    first = make_entry("default", TxKey(1, 6), start_key, start_digest, (WriteOp("kv", {"id": 1, "v": "a"}),), "r1")
    second = make_entry("default", TxKey(1, 7), first.tx_key, first.digest, (WriteOp("kv", {"id": 2, "v": "b"}),))
    store.spill([first, second])
store.close()
print(json.dumps({"digest": second.digest.hex()}))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_spill_written_by_0_1_0_is_replayed_by_this_release(
    tmp_path: Path, release_0_1_0: tuple[Path, float]
) -> None:
    """A replicant stopped mid-bootstrap on release 0.1.0 and started on this one replays its spill."""
    from mnesite.rlog.store import Store
    from mnesite.rlog.types import TxKey

    old_python, _ = release_0_1_0
    path = tmp_path / "mnesite.db"
    written = subprocess.run(
        [str(old_python), "-c", OLD_SPILL_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=without_this_tree(),
    )
    assert written.returncode == 0, written.stderr
    store = Store(str(path), synchronous="NORMAL")
    try:
        assert store.storage_format() == 1 and store.spilled("default") == 2
        with store.write_transaction():
            last = store.replay_spill("default", TxKey(1, 5), bytes(range(32)), 0)
        assert last == TxKey(1, 7) and store.shard("default").digest.hex() == json.loads(written.stdout)["digest"]
        rows = list(store.connection.execute("SELECT id, v FROM kv ORDER BY id"))
        assert rows == [(1, "a"), (2, "b")] and store.spilled("default") == 0
    finally:
        store.close()
