"""Real processes on full and failing disks (rlog.disk, issue 24).

* Full: each node's data directory is its own tmpfs with ``size=``; a filler file takes every free
  byte under writes, and deleting it frees the space. Needs root (``mount``): skipped, saying why,
  where it fails.
* Failing fsync: ``tests/failsync.c``, an LD_PRELOAD shim built here with gcc (skipped without it),
  makes fsync/fdatasync return EIO once a trigger file exists; it is loaded into every core, and
  the test creates the trigger of one of them.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mnesite.rlog.client import MnesiteError

from tests.conftest import Cluster, wait_until
from tests.test_cluster import Load, check_agreement, create_table, rows
from tests.test_replicants import shard_status, wait_normal, wait_replicant_caught_up

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TMPFS_BYTES = 48 * 1024 * 1024
PROBE_INTERVAL_MS = 200
PADDING_BYTES = 4096  # per row: the WAL outgrows its reused space within seconds of writes
SHIM_SOURCE = Path(__file__).parent / "failsync.c"
EXIT_STORAGE_FAILED = 4  # cli.main.EXIT_STORAGE_FAILED


class Mounts:
    """tmpfs mounts made by a test; unmounted at teardown (after the node processes are killed)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def tmpfs(self, path: Path, size_bytes: int = TMPFS_BYTES) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs at {path} (needs root): {result.stderr.strip()}")
        self.paths.append(path)
        return path

    def unmount_all(self) -> None:
        for path in reversed(self.paths):
            if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
        self.paths = []


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    made = Mounts()
    try:
        yield made
    finally:
        made.unmount_all()


def fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s file system with a filler file; delete it to free them."""
    filler = directory / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk_bytes in (1 << 20, 1 << 16, 1 << 12, 1 << 9):
            chunk = b"\0" * chunk_bytes
            while True:
                try:
                    os.write(descriptor, chunk)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(descriptor)
    return filler


def configure(cluster: Cluster, names: list[str], synchronous: str = "NORMAL") -> None:
    for name in names:
        config = cluster.nodes[name].config_path
        config.write_text(
            config.read_text().replace(
                'synchronous = "NORMAL"',
                f'synchronous = "{synchronous}"\ndisk_probe_interval_ms = {PROBE_INTERVAL_MS}',
            )
        )


def disk(cluster: Cluster, name: str) -> dict:
    status = cluster.status(name)
    return status["disk"] if status else {}


def log_lines(cluster: Cluster, name: str, text: str) -> int:
    return sum(1 for line in cluster.nodes[name].log_path.read_text().splitlines() if text in line)


def check_full_node(cluster: Cluster, name: str, present_id: int) -> None:
    """What a full node does: refuses writes with disk_full, serves reads, says so once in its log."""
    with cluster.client(name, timeout_ms=3000, retries=0) as client:
        with pytest.raises(MnesiteError) as refused:
            client.put("kv", {"id": -1, "value": "refused"})
        assert refused.value.code == "disk_full", refused.value
        assert client.get("kv", present_id) is not None, "a full node keeps serving reads"
    info = disk(cluster, name)
    assert info["state"] == "full" and info["writes_refused"] >= 1 and info["error"]
    assert log_lines(cluster, name, "the disk is full (") == info["fills"], "one log line per episode, no flood"


def free_and_wait(cluster: Cluster, name: str, filler: Path) -> None:
    filler.unlink()
    wait_until(lambda: disk(cluster, name).get("state") == "ok", 30, f"{name} to find space again")
    assert log_lines(cluster, name, "the disk takes writes again") >= 1


def start_on_tmpfs(cluster: Cluster, mounts: Mounts, names: list[str]) -> None:
    for name in names:
        mounts.tmpfs(cluster.data_dir(name))
    configure(cluster, cluster.names)
    cluster.start_all()
    create_table(cluster)


def test_a_follower_whose_disk_fills_refuses_writes_serves_reads_and_resumes(mounts: Mounts, cluster: Cluster) -> None:
    start_on_tmpfs(cluster, mounts, cluster.names)
    load = Load(cluster, cluster.names, writers=3, padding_bytes=PADDING_BYTES).start()
    load.wait_for(100)
    sequencer, generation = cluster.sequencer() or (None, None)
    follower = next(name for name in cluster.names if name != sequencer)
    present_id = next(iter(load.acknowledged))
    wait_until(lambda: present_id in rows(cluster, follower), 20, f"{follower} to apply a write")
    filler = fill(cluster.data_dir(follower))
    wait_until(lambda: disk(cluster, follower).get("state") == "full", 60, f"{follower}'s disk to be found full")
    check_full_node(cluster, follower, present_id)
    # The majority goes on without it, under the same sequencer.
    load.wait_for(200)
    assert cluster.sequencer() == (sequencer, generation)
    assert shard_status(cluster, follower)["disk_full"] is True
    free_and_wait(cluster, follower, filler)
    load.wait_for(100)
    acknowledged = load.stop()
    check_agreement(cluster, cluster.names, acknowledged)


def test_a_sequencer_whose_disk_fills_steps_down_and_the_majority_keeps_serving(
    mounts: Mounts, cluster: Cluster
) -> None:
    start_on_tmpfs(cluster, mounts, cluster.names)
    load = Load(cluster, cluster.names, writers=3, padding_bytes=PADDING_BYTES).start()
    load.wait_for(100)
    old, old_generation = cluster.sequencer() or (None, None)
    assert old is not None
    others = [name for name in cluster.names if name != old]
    present_id = next(iter(load.acknowledged))
    filler = fill(cluster.data_dir(old))
    started = time.monotonic()
    wait_until(lambda: disk(cluster, old).get("state") == "full", 60, f"sequencer {old}'s disk to be found full")
    wait_until(lambda: cluster.sequencer(among=others) is not None, 30, "a sequencer among the others")
    failover_s = time.monotonic() - started
    new, new_generation = cluster.sequencer(among=others)
    assert new_generation > old_generation
    assert shard_status(cluster, old)["role"] != "sequencer"
    check_full_node(cluster, old, present_id)
    load.wait_for(200)
    # While full it is never elected again, though it is the longest-lived candidate.
    assert cluster.sequencer(among=[old]) is None
    free_and_wait(cluster, old, filler)
    load.wait_for(100)
    acknowledged = load.stop()
    position = check_agreement(cluster, cluster.names, acknowledged)
    print(f"sequencer full: failover to {new} in {failover_s:.1f} s; {len(acknowledged)} acknowledged, at {position}")


def test_a_replicant_whose_disk_fills_stops_applying_serves_reads_and_resumes(mounts: Mounts, cluster: Cluster) -> None:
    configure(cluster, cluster.names)
    cluster.start_all()
    create_table(cluster)
    cluster.add_replicant("replicant1")
    mounts.tmpfs(cluster.data_dir("replicant1"))
    configure(cluster, ["replicant1"])
    cluster.start("replicant1")
    wait_normal(cluster, "replicant1")
    load = Load(cluster, cluster.names, writers=3, padding_bytes=PADDING_BYTES).start()
    load.wait_for(100)
    present_id = next(iter(load.acknowledged))
    wait_until(lambda: present_id in rows(cluster, "replicant1"), 20, "the replicant to apply a write")
    filler = fill(cluster.data_dir("replicant1"))
    wait_until(lambda: disk(cluster, "replicant1").get("state") == "full", 60, "the replicant's disk to be full")
    check_full_node(cluster, "replicant1", present_id)
    held = shard_status(cluster, "replicant1")
    assert held["mode"] == "normal" and held["serving"] and held["disk_full"]
    # Its position stays put (nothing applied, nothing skipped) while the cores go on.
    load.wait_for(200)
    still = shard_status(cluster, "replicant1")
    assert (still["applied"], still["digest"]) == (held["applied"], held["digest"])
    core_applied = shard_status(cluster, cluster.names[0])["applied"]
    assert core_applied > held["applied"]
    with cluster.client("replicant1") as client:
        try:
            count = client.count("kv")
        except MnesiteError as error:  # say why it stopped serving: its disk record and its log's tail
            log_tail = cluster.nodes["replicant1"].log_path.read_text().splitlines()[-15:]
            raise AssertionError(f"{error}; disk {disk(cluster, 'replicant1')}; log tail {log_tail}") from error
        assert count == len(rows(cluster, "replicant1")), "local reads of what it holds"
    free_and_wait(cluster, "replicant1", filler)
    acknowledged = load.stop()
    applied, digest = wait_replicant_caught_up(cluster, ["replicant1"])
    status = shard_status(cluster, "replicant1")
    assert status["digest"] == digest
    assert status["bootstraps"] == held["bootstraps"] and status["resumes"] > held["resumes"], "resumed, no re-copy"
    replicant_rows = rows(cluster, "replicant1")
    assert not set(acknowledged) - set(replicant_rows)
    assert replicant_rows == rows(cluster, cluster.names[0])


# ---------------------------------------------------------------- failing fsync


@pytest.fixture
def failsync(tmp_path: Path) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc) to build the failing-fsync shim tests/failsync.c")
    library = tmp_path / "failsync.so"
    result = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SHIM_SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        pytest.skip(f"the failing-fsync shim did not build: {result.stderr.strip()[:500]}")
    return library


def start_with_shim(cluster: Cluster, library: Path, root: Path) -> dict[str, Path]:
    """Every core with the shim (synchronous FULL: a durable commit fsyncs its WAL); one trigger each."""
    configure(cluster, cluster.names, synchronous="FULL")
    triggers = {name: root / f"{name}.failsync" for name in cluster.names}
    for name in cluster.names:
        environment = {"LD_PRELOAD": str(library), "MNESITE_FAILSYNC_TRIGGER": str(triggers[name])}
        cluster.nodes[name].start(cluster.endpoints[name], env=environment)
    create_table(cluster)
    return triggers


def fail_fsync_and_recover(cluster: Cluster, name: str, trigger: Path, load: Load) -> None:
    """Make ``name``'s fsyncs fail under writes: it must stop with a clear error and exit status; then
    restart it without the shim and check that the cluster lost nothing acknowledged."""
    trigger.touch()
    node = cluster.nodes[name]
    process = node.process
    assert process is not None
    wait_until(lambda: process.poll() is not None, 30, f"{name} to stop after its fsync failed")
    assert process.returncode == EXIT_STORAGE_FAILED, process.returncode
    output = node.log_path.read_text()
    assert "node stopped: the disk failed" in output, output[-2000:]
    assert "Input/output error" in output or "disk I/O error" in output, output[-2000:]
    assert "shut down (the disk failed" in output
    # The shim failed the call (not something else), and the node did not retry it in a loop.
    failed_calls = len(Path(f"{trigger}.count").read_text().splitlines())
    assert 1 <= failed_calls <= 3, failed_calls
    others = [other for other in cluster.names if other != name]
    wait_until(lambda: cluster.sequencer(among=others) is not None, 30, "a sequencer among the others")
    load.wait_for(100)
    trigger.unlink()
    node.process = None
    cluster.start(name)  # without the shim: it recovers from its log and its peers
    load.wait_for(100)


@pytest.mark.parametrize("role", ["follower", "sequencer"])
def test_a_core_whose_fsync_fails_stops_and_recovers_without_losing_anything(
    tmp_path: Path, failsync: Path, cluster: Cluster, role: str
) -> None:
    triggers = start_with_shim(cluster, failsync, tmp_path)
    load = Load(cluster, cluster.names, writers=3).start()
    load.wait_for(100)
    sequencer, generation = cluster.sequencer() or (None, None)
    assert sequencer is not None
    target = sequencer if role == "sequencer" else next(name for name in cluster.names if name != sequencer)
    fail_fsync_and_recover(cluster, target, triggers[target], load)
    acknowledged = load.stop()
    check_agreement(cluster, cluster.names, acknowledged)
    if role == "sequencer":
        assert max(key[0] for key in acknowledged.values()) > generation, "writes went on under a new sequencer"
