"""Backup and restore (rlog.backup, cli/backup.py): the request's rules, a backup of a node under
writes, offline checks of the file, and the acceptance test with real processes (a backup restored
into a replicant that resumes from the rlog with 0 rows re-copied and ends equal to the cores)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apsw
import pytest
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.rlog import messages
from mnesite.rlog.backup import BackupError, JobView, check_path, decide, read_record, restore
from mnesite.rlog.client import MnesiteError
from mnesite.rlog.roles import RoleTable
from mnesite.rlog.store import Store
from mnesite.rlog.types import GENESIS_DIGEST, CreateTableOp, Entry, TxKey, WriteOp, make_entry

from tests.conftest import (
    Cluster,
    ThreadNode,
    close_offline,
    ctrl_c_at_the_final_progress_line,
    free_port,
    offline_replicant,
    wait_until,
)
from tests.test_cluster import Load, create_table, rows


def test_one_backup_at_a_time_and_the_same_path_reports_progress() -> None:
    assert decide(None, "/b/x") == "start"
    assert decide(JobView("/b/x", running=True), "/b/x") == "report"
    assert decide(JobView("/b/x", running=False), "/b/x") == "report"  # a finished job answers its result
    assert decide(JobView("/b/x", running=True), "/b/y") == "busy"
    assert decide(JobView("/b/x", running=False), "/b/y") == "start"
    assert decide(JobView("/b/x", running=False, moved_away=True), "/b/x") == "start"  # archived: a new one


def test_backup_paths_are_absolute_plain_and_never_climb(tmp_path: Path) -> None:
    for path in ("relative/file", "/", f"{tmp_path}/../x", f"{tmp_path}/a b", f"{tmp_path}/nodir/file"):
        with pytest.raises(BackupError):
            check_path(path)
    assert check_path(f"{tmp_path}/backup.db") == f"{tmp_path}/backup.db"
    for name in ("app.key", "app.key_secret", "APP.KEY"):  # a key file's name (test_security has why)
        with pytest.raises(BackupError, match="must not end in .key or .key_secret"):
            check_path(f"{tmp_path}/{name}")
    assert check_path(f"{tmp_path}/app.key.db") == f"{tmp_path}/app.key.db"
    # The wire schema refuses what is not an absolute plain path before the node looks at it.
    for path in ("x", "../../etc/passwd", "/a;b"):
        with pytest.raises(messages.MessageError):
            messages.typed_body("backup", {"path": path})
    messages.typed_body("backup", {"path": "/tmp/b.db"})


def test_only_admins_may_ask_for_a_backup() -> None:
    table = RoleTable({"admin": ["ops"], "writer": ["app"], "reader": ["dash"], "core": ["core1"]})
    assert table.refusal("ops", "backup") is None
    for principal in ("app", "dash", "core1", "stranger"):
        assert table.refusal(principal, "backup") is not None


def _write_rows(node: ThreadNode, count: int, start: int = 0) -> None:
    with node.client(timeout_ms=5000) as client:
        for row_id in range(start, start + count):
            client.put("kv", {"id": row_id, "value": f"v{row_id}"})


def test_a_backup_under_writes_is_a_consistent_verified_file(thread_node: ThreadNode, tmp_path: Path) -> None:
    with thread_node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    _write_rows(thread_node, 300)
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        with thread_node.client(timeout_ms=5000) as client:
            row_id = 10_000
            while not stop.is_set():
                client.put("kv", {"id": row_id, "value": "during"})
                written.append(row_id)
                row_id += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(written) >= 20, 30, "writes before the backup")
        backup = tmp_path / "node.backup"
        result = CliRunner().invoke(main, ["backup", str(backup), "--node", thread_node.endpoint, "--json"])
        assert result.exit_code == 0, result.output
        written_at_end = len(written)
    finally:
        stop.set()
        thread.join(10)
    answer = json.loads(result.stdout)
    assert answer["state"] == "done" and answer["pages_copied"] == answer["pages_total"] > 0
    record = read_record(str(backup))
    assert record["node"] == "core1" and record["role"] == "core"
    assert record["shards"] == answer["shards"]
    # The file holds exactly the state at its recorded position: rows, tx key and digest agree.
    store = Store(str(backup), create=False, readonly=True)
    try:
        position = store.shard("default")
        assert list(position.applied) == record["shards"]["default"]["applied"]
        assert position.digest.hex() == record["shards"]["default"]["digest"]
        assert store.verify_chain("default") == position.applied
        count = store.count_rows(store.catalog()["kv"])
    finally:
        store.close()
    assert 300 < count < 300 + written_at_end + 2  # some writes before, not those after it
    assert not Path(f"{backup}-wal").exists()  # one self-contained file
    verify = CliRunner().invoke(main, ["rlog", "verify", str(backup), "--json"])
    assert verify.exit_code == 0, verify.output
    assert json.loads(verify.stdout)["shards"]["default"]["applied"] == record["shards"]["default"]["applied"]
    # A backup never overwrites a file, and the node kept serving meanwhile and after.
    again = CliRunner().invoke(main, ["backup", str(tmp_path / "other"), "--node", thread_node.endpoint])
    assert again.exit_code == 0, again.output
    refused = CliRunner().invoke(main, ["backup", str(tmp_path / "other"), "--node", thread_node.endpoint])
    assert refused.exit_code == 0  # the same path reports the finished job
    third = CliRunner().invoke(main, ["backup", str(backup), "--node", thread_node.endpoint])
    assert third.exit_code == 1 and third.stderr.startswith("Error:") and "never overwrites" in third.stderr
    _write_rows(thread_node, 5, start=50_000)
    with thread_node.client(timeout_ms=5000) as client:
        assert client.status()["backup"]["state"] == "done"  # status shows the last backup
    text = CliRunner().invoke(main, ["status", "--node", thread_node.endpoint])
    assert f"backup to {tmp_path / 'other'}: done" in text.stdout


def _create_table_kv(store: Store) -> Entry:
    """In ``store``'s write transaction: shard default (generation 1) and its first entry, appended and
    applied, which creates table kv (id INTEGER key, value TEXT); returns that entry."""
    store.ensure_shard("default", 1)
    create = make_entry(
        "default",
        TxKey(1, 1),
        TxKey(0, 0),
        GENESIS_DIGEST,
        (CreateTableOp("kv", "default", "id", (("id", "INTEGER"), ("value", "TEXT"))),),
        None,
    )
    store.append_entry(create, 0)
    store.apply_entry(create)
    return create


def test_restore_keeps_the_committed_state_and_drops_the_uncommitted_tail(tmp_path: Path) -> None:
    source = tmp_path / "source.db"
    store = Store(str(source))
    with store.write_transaction():
        create = _create_table_kv(store)
        committed = make_entry(
            "default", TxKey(1, 2), create.tx_key, create.digest, (WriteOp("kv", {"id": 1, "value": "a"}),), None
        )
        store.append_entry(committed, 0)
        store.apply_entry(committed)
        tail = make_entry(
            "default", TxKey(1, 3), committed.tx_key, committed.digest, (WriteOp("kv", {"id": 2, "value": "b"}),), None
        )
        store.append_entry(tail, 0)  # appended, never applied: not known to be committed
        store.set_meta("bootstraps:default", 4)
        store.set_meta("backup", json.dumps({"node": "core9", "role": "core", "taken_at": "t", "shards": {}}))
    store.close()
    with pytest.raises(BackupError, match="no such file"):
        restore(str(tmp_path / "missing.db"), str(tmp_path / "x"), "replicant")
    Store(str(tmp_path / "plain.db")).close()
    with pytest.raises(BackupError, match="not a backup"):
        restore(str(tmp_path / "plain.db"), str(tmp_path / "x"), "replicant")
    # A damaged (or crafted) record is one clear error, before anything is written; it was a
    # JSONDecodeError or, at the CLI's line, a KeyError with a traceback.
    for damaged in ("{not json", "[]", '{"node": "core9", "shards": {}}', '{"node": "n", "taken_at": "t"}',
                    '{"node": "n", "taken_at": "t", "shards": {"default": {"applied": [1]}}}'):  # fmt: skip
        crafted = Store(str(tmp_path / "crafted.db"))
        crafted.set_meta("backup", damaged)
        crafted.close()
        with pytest.raises(BackupError, match="backup record is damaged"):
            restore(str(tmp_path / "crafted.db"), str(tmp_path / "y"), "replicant")
        assert not (tmp_path / "y" / "mnesite.db").exists()
        cli = CliRunner().invoke(main, ["restore", str(tmp_path / "crafted.db"), "--data-dir", str(tmp_path / "y")])
        assert cli.exit_code == 1 and "backup record is damaged" in cli.output, cli.output
        os.unlink(tmp_path / "crafted.db")
    result = restore(str(source), str(tmp_path / "new"), "replicant")
    assert result["entries_dropped"] == {"default": 1}
    restored = Store(str(tmp_path / "new" / "mnesite.db"), create=False)
    try:
        assert restored.shard("default").applied == TxKey(1, 2)
        assert restored.last_entry_key("default") == TxKey(1, 2)
        assert restored.meta("bootstraps:default") is None
        assert restored.read_row(restored.catalog()["kv"], 1) == {"id": 1, "value": "a"}
    finally:
        restored.close()
    with pytest.raises(BackupError, match="exists"):
        restore(str(source), str(tmp_path / "new"), "replicant")


def backup_under_writes(cluster: Cluster, tmp_path: Path, writes: int) -> tuple[Load, Path, dict]:
    """Start the cores and a load, and back up core1 with the CLI after ``writes`` writes."""
    cluster.start_all()
    create_table(cluster)
    load = Load(cluster, cluster.names, writers=2).start()
    load.wait_for(writes)
    backup = tmp_path / "core1.backup"
    result = CliRunner().invoke(
        main, ["backup", str(backup), "--node", cluster.endpoints["core1"], "--json", *cluster.cli_keys()]
    )
    assert result.exit_code == 0, result.output
    return load, backup, json.loads(result.stdout)["shards"]["default"]


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_backup_under_writes_restores_into_a_replicant_that_resumes_without_a_bootstrap(
    cluster: Cluster, spark_session, tmp_path: Path
) -> None:
    from mnesite.spark.compare import EXIT_EQUAL, CompareOptions, compare

    load, backup, backed_up = backup_under_writes(cluster, tmp_path, 200)
    load.wait_for(200)  # the log moves on past the backup: the replicant must resume from it
    cluster.add_replicant("replicant1")
    restored = CliRunner().invoke(main, ["restore", str(backup), "--data-dir", str(cluster.data_dir("replicant1"))])
    assert restored.exit_code == 0, restored.output
    cluster.start("replicant1")

    def caught_up() -> bool:
        status = cluster.status("replicant1")
        info = (status or {}).get("shards", {}).get("default", {})
        return info.get("mode") == "normal" and tuple(info["applied"]) > tuple(backed_up["applied"])

    wait_until(caught_up, 60, "replicant1 to resume past the backup's position", interval_s=0.1)
    acknowledged = load.stop()
    position = cluster.wait_replicants_converged(cluster.names, ["replicant1"])
    info = cluster.status("replicant1")["shards"]["default"]
    assert info["bootstraps"] == 0 and info["rows_copied"] == 0 and info["resumes"] >= 1, info
    assert info["digest"] == position["digest"]
    core_rows = rows(cluster, "core1")
    assert not set(acknowledged) - set(core_rows)
    assert rows(cluster, "replicant1") == core_rows
    report = compare(
        [cluster.endpoints["core1"], cluster.endpoints["replicant1"]],
        CompareOptions(tables=("kv",), **cluster.keys()),
        session=spark_session,
    )
    assert report.exit_status == EXIT_EQUAL, report.to_json()
    # A replicant in normal mode can be backed up too; the file records its position.
    replicant_backup = tmp_path / "replicant1.backup"
    taken = CliRunner().invoke(
        main, ["backup", str(replicant_backup), "--node", cluster.endpoints["replicant1"], *cluster.cli_keys()]
    )
    assert taken.exit_code == 0, taken.output
    record = read_record(str(replicant_backup))
    assert record["role"] == "replicant" and tuple(record["shards"]["default"]["applied"]) == position["applied"]
    # A writer may not take backups (admin only).
    with cluster.client("core1", principal="app") as client, pytest.raises(MnesiteError, match="may not send backup"):
        client.backup(str(tmp_path / "by-a-writer"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_core_whose_data_is_lost_is_restored_from_another_cores_backup_and_converges(
    cluster: Cluster, tmp_path: Path
) -> None:
    load, backup, backed_up = backup_under_writes(cluster, tmp_path, 150)
    # core3 loses its disk; it comes back from core1's backup while the writes go on.
    cluster.nodes["core3"].kill()
    shutil.rmtree(cluster.data_dir("core3"))
    load.wait_for(150)
    restored = CliRunner().invoke(
        main, ["restore", str(backup), "--data-dir", str(cluster.data_dir("core3")), "--role", "core", "--json"]
    )
    assert restored.exit_code == 0, restored.output
    cluster.start("core3")
    load.wait_for(100)
    acknowledged = load.stop()
    position = cluster.wait_converged(cluster.names, timeout_s=60)
    assert position["applied"] > tuple(backed_up["applied"])
    info = cluster.status("core3")["shards"]["default"]
    # It learnt the generation in use from its peers before taking part, and holds every acknowledged write.
    assert info["generation"] >= backed_up["generation"]
    core3_rows = rows(cluster, "core3")
    assert not set(acknowledged) - set(core3_rows)
    assert core3_rows == rows(cluster, "core1")


def test_a_failed_backup_is_reported_leaves_no_file_and_can_be_retried(
    thread_node: ThreadNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mnesite.rlog.backup import BackupJob

    with thread_node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    _write_rows(thread_node, 10)
    target = tmp_path / "retry.backup"

    def disk_full(self: BackupJob, connection: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(BackupJob, "_finish", disk_full)
    failed = CliRunner().invoke(main, ["backup", str(target), "--node", thread_node.endpoint])
    last_line = failed.stderr.strip().splitlines()[-1]
    assert failed.exit_code == 1 and last_line.startswith("Error: backup to") and "No space left" in last_line
    assert not target.exists() and not Path(f"{target}.partial").exists()
    monkeypatch.undo()
    retried = CliRunner().invoke(main, ["backup", str(target), "--node", thread_node.endpoint, "--json"])
    assert retried.exit_code == 0, retried.output
    assert (
        read_record(str(target))["shards"]["default"]["applied"]
        == json.loads(retried.stdout)["shards"]["default"]["applied"]
    )


def test_a_failed_backup_stays_in_the_status_until_a_backup_succeeds(
    thread_node: ThreadNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed backup is reported once to the command that polls it, and then the node forgot it:
    ``status`` (and so the metrics) said nothing had failed, so a nightly backup failing for want of
    space went unseen by whatever watches the node. The last failure stays (``backup_failed``: path,
    error, when) until a later backup succeeds; a retry of the same path still starts anew."""
    from mnesite.rlog.backup import BackupJob

    with thread_node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        assert client.status()["backup_failed"] is None
    _write_rows(thread_node, 5)

    def disk_full(self: BackupJob, connection: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(BackupJob, "_finish", disk_full)
    for name in ("first.backup", "second.backup"):  # the latest failure is the one shown
        failed = CliRunner().invoke(main, ["backup", str(tmp_path / name), "--node", thread_node.endpoint])
        assert failed.exit_code == 1, failed.output
    with thread_node.client(timeout_ms=5000) as client:
        status = client.status()
    assert status["backup"] is None  # reported once: the job itself is gone
    failure = status["backup_failed"]
    assert failure["path"] == str(tmp_path / "second.backup") and "No space left" in failure["error"]
    assert failure["failed_at"].endswith("Z") and failure["failed_at_s"] > 0
    shown = CliRunner().invoke(main, ["status", "--node", thread_node.endpoint])
    assert f"last backup FAILED: {tmp_path / 'second.backup'} at {failure['failed_at']}: " in shown.output
    monkeypatch.undo()
    done = CliRunner().invoke(main, ["backup", str(tmp_path / "second.backup"), "--node", thread_node.endpoint])
    assert done.exit_code == 0, done.output
    with thread_node.client(timeout_ms=5000) as client:
        status = client.status()
    assert status["backup"]["state"] == "done" and status["backup_failed"] is None
    assert "FAILED" not in CliRunner().invoke(main, ["status", "--node", thread_node.endpoint]).output


def test_no_backup_while_a_shard_holds_no_committed_state(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from mnesite.core.node import CoreNode
    from mnesite.rlog import replication

    replicant = offline_replicant(tmp_path / "r")
    core = ThreadNode(tmp_path / "c")
    try:
        for mode, fenced in ((replication.Mode.BOOTSTRAP, False), (replication.Mode.LOCAL_REPLAY, False),
                             (replication.Mode.NORMAL, True)):  # fmt: skip
            status = SimpleNamespace(mode=mode, read_fenced=fenced)
            replicant.replicas = {"default": SimpleNamespace(status=lambda status=status: status)}
            with pytest.raises(BackupError, match="not now: shard default is bootstrapping"):
                replicant.answer_backup(
                    messages.typed_body("backup", {"path": str(tmp_path / "r.backup")}), replicant._backup_not_ready()
                )
        status = SimpleNamespace(mode=replication.Mode.NORMAL, read_fenced=False)
        replicant.replicas = {"default": SimpleNamespace(status=lambda: status)}
        assert replicant._backup_not_ready() is None
        node: CoreNode = core.node
        node.not_serving["default"] = "a snapshot install was interrupted"
        with pytest.raises(BackupError, match="not now: shard default: a snapshot install"):
            node.answer_backup(
                messages.typed_body("backup", {"path": str(tmp_path / "c.backup")}), node._backup_not_ready()
            )
        assert not (tmp_path / "c.backup").exists() and not (tmp_path / "r.backup").exists()
    finally:
        core.stop()
        close_offline(replicant)


def test_backup_step_pages_max_is_a_bounded_limit_and_one_page_steps_still_finish(tmp_path: Path) -> None:
    from mnesite.rlog.config import ConfigError, parse_config

    base = {"node": {"name": "core1", "data_dir": str(tmp_path / "x")}}
    assert parse_config(base).limits.backup_step_pages_max == 256
    for bad in (0, 1_000_001, "1"):
        with pytest.raises(ConfigError, match="backup_step_pages_max"):
            parse_config({**base, "limits": {"backup_step_pages_max": bad}})
    node = ThreadNode(tmp_path / "data", extra={"limits": {"backup_step_pages_max": 1}})
    try:
        with node.client(timeout_ms=5000) as client:
            client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        _write_rows(node, 20)
        assert node.node.config.limits.backup_step_pages_max == 1
        result = CliRunner().invoke(main, ["backup", str(tmp_path / "b"), "--node", node.endpoint, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["pages_total"] > 1
        with node.client(timeout_ms=5000) as client:
            applied = client.status()["shards"]["default"]["applied"]  # nothing wrote since the backup
        assert read_record(str(tmp_path / "b"))["shards"]["default"]["applied"] == applied
    finally:
        node.stop()


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_compare_takes_a_backup_file_as_a_replica(spark_session, tmp_path: Path) -> None:
    from mnesite.rlog.backup import BackupJob
    from mnesite.spark.compare import EXIT_EQUAL, CompareOptions, compare

    from tests.spark_fixtures import create_store, write_rows
    from tests.spark_fixtures import create_table as create_fixture_table

    store = create_store(tmp_path / "node")
    create_fixture_table(store, "kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    write_rows(store, "kv", [{"id": key, "value": f"v{key}"} for key in range(2000)])
    job = BackupJob(str(tmp_path / "node" / "mnesite.db"), str(tmp_path / "node.backup"), "core1", "core")
    assert job.wait(60) and job.state == "done", job.error
    report = compare([str(tmp_path / "node.backup"), str(tmp_path / "node")], CompareOptions(), session=spark_session)
    assert report.exit_status == EXIT_EQUAL, report.to_json()
    write_rows(store, "kv", [{"id": 5, "value": "changed after the backup"}])
    store.close()
    report = compare([str(tmp_path / "node.backup"), str(tmp_path / "node")], CompareOptions(), session=spark_session)
    # The node moved on after the backup: the changed key is in flight between the two positions.
    (pair,) = report.pairs
    assert report.exit_status == EXIT_EQUAL and pair.counts["in_flight"] == 1 and pair.counts["different"] == 0


def hold_copy_between_steps(monkeypatch, cancelled):
    """Hold a backup's copy thread after each step until ``cancelled()`` (at most 30 s), so that a
    shutdown meets the copy under way. Returns the event set once the copy is held, and a function
    that lets copies run freely again."""
    import threading
    import time

    from mnesite.rlog import backup

    copying = threading.Event()
    real_sleep = time.sleep

    def between_steps(seconds: float) -> None:
        copying.set()
        deadline = time.monotonic() + 30
        while not cancelled() and time.monotonic() < deadline:
            real_sleep(0.001)

    monkeypatch.setattr(backup.time, "sleep", between_steps)
    return copying, lambda: monkeypatch.setattr(backup.time, "sleep", real_sleep)


@pytest.mark.timeout(60)
def test_a_backup_cancelled_by_shutdown_fails_cleanly_and_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    """A node that shuts down during a backup stops the copy between two steps: the job says why,
    FILE.partial is removed, and a backup to the same path can be asked for again."""
    from mnesite.rlog.backup import PARTIAL_SUFFIX, BackupJob

    from tests.spark_fixtures import create_store, write_rows
    from tests.spark_fixtures import create_table as create_fixture_table

    store = create_store(tmp_path / "node")
    create_fixture_table(store, "kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    write_rows(store, "kv", [{"id": key, "value": "v" * 500} for key in range(1000)])
    source, target = str(tmp_path / "node" / "mnesite.db"), tmp_path / "node.backup"
    jobs: list[BackupJob] = []
    copying, release = hold_copy_between_steps(monkeypatch, lambda: bool(jobs and jobs[0]._cancelled))
    jobs.append(BackupJob(source, str(target), "core1", "core", step_pages=1))
    job = jobs[0]
    assert copying.wait(30)  # the copy is under way: it stopped between two steps
    assert job.cancel("the node shut down") and job.state == "failed"
    assert job.error == "BackupError: cancelled: the node shut down" and 0 < job.pages_remaining < job.pages_total
    assert not target.exists() and not Path(str(target) + PARTIAL_SUFFIX).exists()
    release()
    again = BackupJob(source, str(target), "core1", "core")
    assert again.wait(60) and again.state == "done", again.error
    store.close()


def test_a_backup_never_replaces_a_file_made_at_its_path_while_it_copied(tmp_path: Path, monkeypatch) -> None:
    """The path is checked free when the backup starts, but the copy takes a while: a file made at
    that path meanwhile (another tool, an operator) must survive, and the backup fail saying why."""
    from mnesite.rlog import backup as backup_module
    from mnesite.rlog.backup import PARTIAL_SUFFIX, BackupJob

    from tests.spark_fixtures import create_store, write_rows
    from tests.spark_fixtures import create_table as create_fixture_table

    store = create_store(tmp_path / "node")
    create_fixture_table(store, "kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    write_rows(store, "kv", [{"id": key, "value": "v"} for key in range(10)])
    target = tmp_path / "node.backup"
    real_finish = BackupJob._finish

    def finish_while_a_file_appears(job: BackupJob, connection) -> None:
        real_finish(job, connection)
        target.write_text("someone else's file")

    monkeypatch.setattr(backup_module.BackupJob, "_finish", finish_while_a_file_appears)
    job = BackupJob(str(tmp_path / "node" / "mnesite.db"), str(target), "core1", "core")
    assert job.wait(60) and job.state == "failed"
    assert "exists" in job.error and str(target) in job.error
    assert target.read_text() == "someone else's file"
    assert not Path(str(target) + PARTIAL_SUFFIX).exists()
    store.close()


def test_a_backup_that_finds_its_partial_file_taken_leaves_that_file_alone(tmp_path: Path, monkeypatch) -> None:
    """Two backups to one path: the second passes the start's check before the first creates
    FILE.partial, then its exclusive create fails. Its cleanup removed FILE.partial, the first's copy."""
    from mnesite.rlog import backup as backup_module
    from mnesite.rlog.backup import PARTIAL_SUFFIX, BackupJob

    from tests.spark_fixtures import create_store

    store = create_store(tmp_path / "node")
    target = tmp_path / "node.backup"
    partial = Path(str(target) + PARTIAL_SUFFIX)
    partial.write_text("the other backup's copy")
    real_lexists = backup_module.os.path.lexists

    def checked_before_it_existed(path) -> bool:
        return False if str(path).startswith(str(target)) else real_lexists(path)

    monkeypatch.setattr(backup_module.os.path, "lexists", checked_before_it_existed)
    job = BackupJob(str(tmp_path / "node" / "mnesite.db"), str(target), "core1", "core")
    assert job.wait(60) and job.state == "failed"
    assert "FileExistsError" in job.error, job.error
    assert partial.read_text() == "the other backup's copy"
    store.close()


@pytest.mark.timeout(60)
def test_closing_a_node_cancels_its_running_backup(tmp_path: Path, monkeypatch) -> None:
    from mnesite.rlog.backup import PARTIAL_SUFFIX, BackupJob

    from tests.conftest import offline_replicant

    node = offline_replicant(tmp_path / "r")
    copying, _ = hold_copy_between_steps(monkeypatch, lambda: bool(node.backup_job and node.backup_job._cancelled))
    target = tmp_path / "r.backup"
    node.backup_job = BackupJob(node.store.path, str(target), "replicant1", "replicant", step_pages=1)
    assert copying.wait(30)
    node.close()
    assert node.backup_job.state == "failed" and node.backup_job.error == "BackupError: cancelled: the node shut down"
    assert not target.exists() and not Path(str(target) + PARTIAL_SUFFIX).exists()


def test_a_backup_acts_on_one_named_node_and_never_fails_over(thread_node: ThreadNode, tmp_path: Path) -> None:
    """A backup is written on the host of the node that takes it: with a list of endpoints (--node a,b
    or $MNESITE_NODE as the README exports it) a first node that does not answer must not turn the
    backup into one of another node, on another host, under the same name."""
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there: the first node is down
    backup = tmp_path / "core-a.backup"
    listed = CliRunner().invoke(main, ["backup", str(backup), "--node", f"{dead},{thread_node.endpoint}"])
    assert listed.exit_code == 1 and "backup needs exactly one explicit --node" in listed.stderr, listed.output
    from_env = CliRunner(env={"MNESITE_NODE": f"{dead},{thread_node.endpoint}"}).invoke(main, ["backup", str(backup)])
    assert from_env.exit_code == 1 and "backup needs exactly one explicit --node" in from_env.stderr
    assert not backup.exists()
    with thread_node.client(timeout_ms=5000) as client:
        assert client.status()["backup"] is None  # the node that answered was never asked


def test_a_restore_whose_target_does_not_open_closes_its_source(tmp_path: Path, monkeypatch) -> None:
    # The backup file was opened, then opening the new database failed: the backup's connection
    # stayed open (a descriptor and SQLite's lock on the file) in a process that goes on.
    import apsw

    source = tmp_path / "source.db"
    store = Store(str(source))
    with store.write_transaction():
        store.set_meta("backup", json.dumps({"node": "core9", "role": "core", "taken_at": "t", "shards": {}}))
    store.close()
    target = str(tmp_path / "new" / "mnesite.db.partial")
    real_connection = apsw.Connection
    opened: list[apsw.Connection] = []

    def connection(path: str, *args, **kwargs) -> apsw.Connection:
        if path == target:
            raise apsw.CantOpenError("unable to open database file")
        opened.append(real_connection(path, *args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(apsw, "Connection", connection)
    with pytest.raises(apsw.CantOpenError):
        restore(str(source), str(tmp_path / "new"), "replicant")
    monkeypatch.undo()
    assert len(opened) == 2  # the record's read, then the copy's source
    for opened_connection in opened:
        with pytest.raises(apsw.ConnectionClosedError):
            opened_connection.execute("SELECT 1")
    assert not (tmp_path / "new" / "mnesite.db").exists()


def test_a_published_backup_syncs_its_directory_as_the_store_does(tmp_path: Path, monkeypatch) -> None:
    """Regression: the backup synced the directory holding the new file through its own near copy of
    ``rlog.store.fsync_directory`` that opened it without ``O_DIRECTORY`` (a path that was no
    directory would have been synced as a file). It uses the store's, which opens it as a directory."""
    import os

    from mnesite.rlog.backup import BackupJob

    from tests.spark_fixtures import create_store

    store = create_store(tmp_path / "node")
    target = tmp_path / "node.backup"
    real_open = os.open
    directory_opens: list[int] = []

    def recording_open(path, flags, *args, **kwargs):
        if os.fspath(path) == str(tmp_path):
            directory_opens.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    job = BackupJob(str(tmp_path / "node" / "mnesite.db"), str(target), "core1", "core")
    assert job.wait(60) and job.state == "done", job.error
    monkeypatch.undo()
    store.close()
    assert directory_opens, "the backup's directory was synced"
    assert all(flags & os.O_DIRECTORY for flags in directory_opens), directory_opens


@pytest.mark.timeout(60)
def test_a_restore_killed_before_its_changes_commit_leaves_no_database_a_node_would_start_on(tmp_path: Path) -> None:
    """Regression: restore copied the backup straight to DIR/mnesite.db and then dropped the uncommitted
    tail and marked it ``restored``. A restore killed in between (SIGKILL, power loss) left a full
    mnesite.db without the mark: a core started there skipped learning the generations in use (it
    could vote twice in one) and kept the source's tail, and restore refused the directory (exists)."""
    import os
    import subprocess
    import sys

    source = tmp_path / "source.db"
    store = Store(str(source))
    with store.write_transaction():
        store.ensure_shard("default", 1)
        store.set_meta("backup", json.dumps({"node": "core9", "role": "core", "taken_at": "t", "shards": {}}))
    store.close()
    data_dir = tmp_path / "new"
    killed = (
        "import os, sys\n"
        "from mnesite.rlog import backup, store\n"
        "store.Store.truncate_after = lambda *args: os._exit(9)  # killed once the copy is made\n"
        "backup.restore(sys.argv[1], sys.argv[2], 'core')\n"
    )
    process = subprocess.run([sys.executable, "-c", killed, str(source), str(data_dir)], timeout=30)
    assert process.returncode == 9
    assert not (data_dir / "mnesite.db").exists()
    result = restore(str(source), str(data_dir), "core")  # the killed restore's leftovers are not in the way
    assert result["restored_as"] == "core"
    restored = Store(str(data_dir / "mnesite.db"), create=False)
    try:
        assert json.loads(restored.meta("restored"))["role"] == "core"
    finally:
        restored.close()
    assert not [name for name in os.listdir(data_dir) if name.startswith("mnesite.db.partial")]


def test_the_same_path_after_its_backup_was_moved_away_takes_a_new_backup(
    thread_node: ThreadNode, tmp_path: Path
) -> None:
    """Regression: a finished backup answered every later request with its path, even once its file had
    been moved away (a nightly job that archives FILE and asks for FILE again): the command printed
    the old result and exited 0, and no backup was written."""
    with thread_node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    _write_rows(thread_node, 5)
    backup = tmp_path / "nightly.backup"
    first = CliRunner().invoke(main, ["backup", str(backup), "--node", thread_node.endpoint, "--json"])
    assert first.exit_code == 0, first.output
    backup.rename(tmp_path / "archived.backup")
    _write_rows(thread_node, 5, start=100)
    second = CliRunner().invoke(main, ["backup", str(backup), "--node", thread_node.endpoint, "--json"])
    assert second.exit_code == 0, second.output
    assert backup.exists()
    applied = read_record(str(backup))["shards"]["default"]["applied"]
    assert applied == json.loads(second.stdout)["shards"]["default"]["applied"]
    assert applied > json.loads(first.stdout)["shards"]["default"]["applied"]


def test_restore_drops_every_counter_of_the_node_the_backup_came_from(tmp_path: Path) -> None:
    """Regression: restore dropped ``bootstraps:`` and ``resumes:`` but kept ``bootstraps_outrun:`` (a
    replicant's count of bootstraps outrun by the cores' trimming), so a replicant restored from
    another replicant's backup showed that node's count in its own ``status`` from its first start."""
    source = tmp_path / "replicant.backup"
    store = Store(str(source))
    with store.write_transaction():
        store.ensure_shard("default", 1)
        for name in ("bootstraps:default", "resumes:default", "bootstraps_outrun:default"):
            store.set_meta(name, 3)
        store.set_meta("backup", json.dumps({"node": "replicant9", "role": "replicant", "taken_at": "t", "shards": {}}))
    store.close()
    restore(str(source), str(tmp_path / "new"), "replicant")
    restored = Store(str(tmp_path / "new" / "mnesite.db"), create=False)
    try:
        kept = [name for (name,) in restored.connection.execute("SELECT name FROM _mnesite_meta")]
    finally:
        restored.close()
    assert not [name for name in kept if name.startswith(("bootstraps", "resumes"))], kept


def _backup_file_with_rows(path: Path, rows_count: int) -> None:
    """A backup file (rollback journal, a ``backup`` record) of one shard with a table of ``rows_count`` rows."""
    store = Store(str(path))
    with store.write_transaction():
        entry = _create_table_kv(store)
        for row_id in range(rows_count):
            ops = (WriteOp("kv", {"id": row_id, "value": f"needle-{row_id:04d}-" + "x" * 300}),)
            entry = make_entry("default", TxKey(1, entry.tx_key.counter + 1), entry.tx_key, entry.digest, ops, None)
            store.append_entry(entry, 0)
            store.apply_entry(entry)
        position = store.shard("default")
        record = {
            "node": "core9",
            "role": "core",
            "taken_at": "t",
            "shards": {
                "default": {"applied": list(position.applied), "digest": position.digest.hex(), "generation": 1}
            },
        }
        store.set_meta("backup", json.dumps(record))
    store.close()
    connection = apsw.Connection(str(path))
    connection.execute("PRAGMA journal_mode=DELETE")
    connection.close()


def test_a_damaged_backup_is_refused_and_restores_nothing(tmp_path: Path) -> None:
    """Regression: restore checked only the backup record, so a backup with a flipped bit (a bad disk, a
    copy gone wrong) seeded a data directory whose table SQLite called malformed on the node's first
    read, or whose rlog no longer chained to its applied digest; a replicant started there resumed from
    it and served those rows. Restore now checks the copy (SQLite's integrity check, each shard's digest
    chain) before it names it mnesite.db."""
    good = tmp_path / "good.backup"
    _backup_file_with_rows(good, 200)
    assert restore(str(good), str(tmp_path / "fine"), "replicant")["entries_dropped"] == {"default": 0}
    data = good.read_bytes()
    # A bit flipped in one value (its row and its logged op): every page still parses.
    assert data.count(b"needle-0100-") == 2
    flipped = tmp_path / "flipped.backup"
    flipped.write_bytes(data.replace(b"needle-0100-", b"Needle-0100-"))
    # A page of the table zeroed: SQLite's structure is broken where nothing of the restore reads.
    connection = apsw.Connection(str(good), flags=apsw.SQLITE_OPEN_READONLY)
    page_size = connection.execute("PRAGMA page_size").fetchone()[0]
    root = connection.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'kv'").fetchone()[0]
    connection.close()
    zeroed = tmp_path / "zeroed.backup"
    start = (root - 1) * page_size
    zeroed.write_bytes(data[:start] + bytes(page_size) + data[start + page_size :])
    for damaged in (flipped, zeroed):
        assert read_record(str(damaged))["node"] == "core9"  # the record alone looks fine
        target = tmp_path / f"from-{damaged.stem}"
        with pytest.raises(BackupError, match="is damaged"):
            restore(str(damaged), str(target), "replicant")
        assert not (target / "mnesite.db").exists() and not (target / "mnesite.db.partial").exists()
        cli = CliRunner().invoke(main, ["restore", str(damaged), "--data-dir", str(target)])
        assert cli.exit_code == 1 and cli.stderr.startswith("Error:") and "is damaged" in cli.stderr, cli.output
        assert "Traceback" not in cli.output


# Steps small enough that a backup of 300 rows (about 75 pages) takes several of each phase.
_SMALL_RESTORE_STEPS = {"copy_pages": 8, "check_sqlite_steps": 500, "chain_entries": 50}


# Restore's progress lines on stderr, by phase, each with the figure that grows (one regex group).
_RESTORE_LINES = {
    "copy": r"^restore: (\d+) of \d+ pages copied$",
    "integrity": r"^restore: integrity check of \d+ pages, (\d+) SQLite steps in$",
    "chains": r"^restore: digest chains: (\d+) entries verified \(shard default at \(1, \d+\), applied \(1, 301\)\)$",
    "done": r"^restore: done in [0-9.]+ s: (\d+) pages copied and checked, 301 entries of the digest chains verified$",
}


def _restore_progress(lines: list[str]) -> list[tuple[str, int]]:
    """(phase, figure) of each of restore's progress lines; fails on a line of no known form."""
    import re

    shown = []
    for line in lines:
        matches = [(phase, re.match(pattern, line)) for phase, pattern in _RESTORE_LINES.items()]
        found = [(phase, int(match.group(1))) for phase, match in matches if match]
        assert len(found) == 1, line
        shown += found
    return shown


def test_restore_shows_the_progress_of_each_phase_on_stderr_and_keeps_stdout(tmp_path: Path, monkeypatch) -> None:
    """Regression: a restore (a copy, SQLite's integrity check, the digest chains' check: each reads the
    whole backup, minutes for gigabytes) printed nothing until it ended, so a working restore looked
    like a hung one. It now says how far each phase got on stderr, paced, and ends with a line."""
    from mnesite.cli import backup as cli_backup
    from mnesite.rlog import backup as rlog_backup

    source = tmp_path / "rows.backup"
    _backup_file_with_rows(source, 300)
    monkeypatch.setattr(rlog_backup, "RESTORE_STEPS", rlog_backup.RestoreSteps(**_SMALL_RESTORE_STEPS))
    monkeypatch.setattr(cli_backup, "PROGRESS_INTERVAL_S", 0)  # every step's line
    result = CliRunner().invoke(main, ["restore", str(source), "--data-dir", str(tmp_path / "new")])
    assert result.exit_code == 0, result.output
    # stdout is the result only, as before: scripts read it.
    digest = read_record(str(source))["shards"]["default"]["digest"][:16]
    assert result.stdout.splitlines() == [
        f"restored {source} (taken on core9 at t) into {tmp_path / 'new'} as a replicant",
        f"shards: default at (1, 301) digest {digest}",
    ]
    shown = _restore_progress(result.stderr.splitlines())
    phases = [phase for phase, _ in shown]
    assert [phase for index, phase in enumerate(phases) if phases.index(phase) == index] == list(_RESTORE_LINES)
    assert phases == sorted(phases, key=list(_RESTORE_LINES).index), phases  # each phase once, in order
    for phase in ("copy", "integrity", "chains"):
        figures = [figure for shown_phase, figure in shown if shown_phase == phase]
        assert len(figures) >= 3 and figures == sorted(set(figures)), (phase, figures)
    pages_total = shown[-1][1]
    assert phases[-1] == "done" and phases.count("done") == 1
    assert [figure for phase, figure in shown if phase == "copy"][-1] == pages_total
    assert [figure for phase, figure in shown if phase == "chains"][-1] == 301  # the table's creation, 300 writes
    quiet = CliRunner().invoke(main, ["restore", str(source), "--data-dir", str(tmp_path / "other"), "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == result.stdout.replace("new", "other")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("phase", "quiet"),
    [
        ("RestorePagesCopied", False),
        ("RestoreIntegrityChecking", False),
        ("RestoreChainVerified", False),
        ("RestoreIntegrityChecking", True),  # no progress shown: the check's progress handler runs all the same
    ],
)
def test_ctrl_c_in_any_phase_of_a_restore_stops_it_and_leaves_nothing_a_node_would_start_on(
    tmp_path: Path, phase: str, quiet: bool
) -> None:
    """Ctrl-C (a real SIGINT) during the copy, SQLite's integrity check (it runs in C: only its progress
    handler lets the interrupt in before it ends) or the digest chains' check stops the restore there,
    says so, and leaves no mnesite.db nor partial copy; a restore into the same directory then works."""
    import subprocess
    import sys

    source = tmp_path / "rows.backup"
    _backup_file_with_rows(source, 300)
    data_dir = tmp_path / "new"
    # The operator's Ctrl-C comes once the phase's second step ended (its first step's line was shown).
    interrupted = (
        "import os, signal, sys\n"
        "from mnesite.cli.main import main\n"
        "from mnesite.rlog import backup as rlog_backup\n"
        f"rlog_backup.RESTORE_STEPS = rlog_backup.RestoreSteps(**{_SMALL_RESTORE_STEPS!r})\n"
        "import mnesite.cli.backup\n"
        "mnesite.cli.backup.PROGRESS_INTERVAL_S = 0\n"
        "Step = getattr(rlog_backup, sys.argv[3])\n"
        "class Interrupting(Step):\n"
        "    made = 0\n"
        "    def __init__(self, *args):\n"
        "        super().__init__(*args)\n"
        "        Interrupting.made += 1\n"
        "        if Interrupting.made == 2:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "setattr(rlog_backup, sys.argv[3], Interrupting)\n"
        "main(['restore', sys.argv[1], '--data-dir', sys.argv[2], *sys.argv[4:]])\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", interrupted, str(source), str(data_dir), phase, *(["--quiet"] if quiet else [])],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,  # not the checkout's folder: its mnesite/ would be imported instead of the installed package
    )
    assert process.returncode == 1, process.stderr
    lines = process.stderr.splitlines()
    assert lines[-1] == f"Error: restore interrupted: nothing was restored into {data_dir}", lines
    if quiet:
        assert lines == lines[-1:]
    else:  # stopped in that phase: its first step was the last line shown
        first_line = {
            "RestorePagesCopied": "restore: 8 of ",
            "RestoreIntegrityChecking": "restore: integrity check of ",
            "RestoreChainVerified": "restore: digest chains: 50 entries verified",
        }[phase]
        assert lines[-2].startswith(first_line) and len(_restore_progress(lines[:-1])) == len(lines) - 1, lines
        assert not [line for line in lines if line.startswith(first_line)][1:], lines
    assert not [name for name in os.listdir(data_dir) if name.startswith("mnesite.db")], os.listdir(data_dir)
    assert restore(str(source), str(data_dir), "replicant")["restored_as"] == "replicant"  # the lock was released


def test_restore_steps_are_positive() -> None:
    from mnesite.rlog.backup import RestoreSteps

    for steps in ({"copy_pages": 0}, {"copy_pages": -1}, {"check_sqlite_steps": 0}, {"chain_entries": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            RestoreSteps(**steps)
    assert RestoreSteps(copy_pages=1, check_sqlite_steps=1, chain_entries=1).copy_pages == 1


def _interrupt_at(code: Any, line_events: int, armed: Callable[[Any], bool]) -> Callable[..., Any]:
    """A ``sys.settrace`` function that raises KeyboardInterrupt (as a Ctrl-C does) in a frame of ``code``
    at its ``line_events``-th line once ``armed(frame)``; a ``line_events`` of 0 raises at the call itself.

    A ``try:`` line is never counted: an exception a trace function raises there skips the handlers of
    the block it opens and of those around it (CPython 3.11), where a signal is never raised (it is, at
    a call or a loop's jump back, each inside the handlers' span)."""
    import linecache

    seen = [0]

    def local(frame: Any, event: str, argument: Any) -> Any:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and line != "try:" and armed(frame):
            seen[0] += 1
            if seen[0] == line_events:
                raise KeyboardInterrupt
        return local

    def tracer(frame: Any, event: str, argument: Any) -> Any:
        if frame.f_code is not code:
            return None
        if line_events == 0:
            raise KeyboardInterrupt
        return local(frame, event, argument)

    return tracer


def _directory_lock_is_free(data_dir: Path) -> bool:
    from mnesite.rlog.data_dir import DataDirectoryInUse, DataDirectoryLock

    try:
        DataDirectoryLock.acquire(str(data_dir), "test").release()
    except DataDirectoryInUse:
        return False
    return True


def test_ctrl_c_at_any_line_of_a_restore_once_it_holds_the_lock_releases_it(tmp_path: Path) -> None:
    """Regression: restore took the data directory's lock before the block whose ``finally`` releases it,
    so a Ctrl-C landing in between (a line later) left a process that went on (a test, a library caller)
    holding the directory: a node could not start there until it exited. The interrupt is injected at
    each line of restore in turn, from the first one after the lock was taken, until restore ends
    (except in the cleanup itself, which a second Ctrl-C may cut short like any)."""
    import inspect
    import sys

    from mnesite.rlog import backup as rlog_backup

    source_lines, first = inspect.getsourcelines(rlog_backup.restore)
    # Its cleanup: from its handler of any exception to the lock's release.
    cleanup = [
        first + index
        for index, text in enumerate(source_lines)
        if text.strip().startswith("except BaseException:") or text.strip() == "lock.release()"
    ]
    assert len(cleanup) == 2, cleanup

    def armed(frame: Any) -> bool:
        return frame.f_locals.get("lock") is not None and not cleanup[0] <= frame.f_lineno <= cleanup[-1]

    source = tmp_path / "rows.backup"
    _backup_file_with_rows(source, 3)
    for line_events in range(1, 1000):
        data_dir = tmp_path / f"new{line_events}"
        sys.settrace(_interrupt_at(rlog_backup.restore.__code__, line_events, armed))
        try:
            restore(str(source), str(data_dir), "replicant")
        except KeyboardInterrupt:
            pass
        else:
            break  # it ended before that line
        finally:
            sys.settrace(None)
        assert _directory_lock_is_free(data_dir), line_events
        # Interrupted before the rename: nothing; after it (a done restore): the database alone.
        assert sorted(name for name in os.listdir(data_dir) if name.startswith("mnesite.db")) in ([], ["mnesite.db"])
    assert line_events > 20, line_events  # several phases were interrupted, not only the first line


def test_ctrl_c_as_the_data_directory_lock_is_made_leaves_it_free(tmp_path: Path) -> None:
    """Regression: ``DataDirectoryLock.acquire`` made its object after the block that closes the locked
    descriptor on an error: a Ctrl-C as the object was made left the directory locked by the process."""
    import sys

    from mnesite.rlog.data_dir import DataDirectoryLock

    sys.settrace(_interrupt_at(DataDirectoryLock.__init__.__code__, 0, lambda frame: True))
    try:
        with pytest.raises(KeyboardInterrupt):
            DataDirectoryLock.acquire(str(tmp_path / "data"), "test")
    finally:
        sys.settrace(None)
    assert _directory_lock_is_free(tmp_path / "data")


def test_ctrl_c_as_the_data_directory_lock_is_taken_leaves_it_free(tmp_path: Path, monkeypatch) -> None:
    """Regression: the block around ``flock`` closed the descriptor on ``BlockingIOError`` and ``OSError``
    only: a Ctrl-C raised as ``flock`` returned (a signal's handler runs as a call ends) left the
    directory locked by a descriptor nothing would close, in a process that goes on (a test, a library
    caller of ``restore``): no node could start there until it exited."""
    import fcntl

    from mnesite.rlog import data_dir as data_dir_module

    flock = fcntl.flock

    def flock_then_ctrl_c(fd: int, operation: int) -> None:
        flock(fd, operation)
        raise KeyboardInterrupt

    monkeypatch.setattr(data_dir_module.fcntl, "flock", flock_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        data_dir_module.DataDirectoryLock.acquire(str(tmp_path / "data"), "test")
    monkeypatch.undo()
    assert _directory_lock_is_free(tmp_path / "data")


_VERIFY_LINE = r"^rlog verify: (\d+) entries verified \(shard default at \(1, (\d+)\), applied \(1, 301\)\)$"


def test_rlog_verify_shows_the_entries_verified_on_stderr_and_keeps_stdout(tmp_path: Path, monkeypatch) -> None:
    """Regression: ``rlog verify`` read a whole log (minutes for a large store) and said nothing until it
    ended. It now shows the entries verified on stderr, paced as restore's, then a final line; stdout
    (which scripts read) is as before, and --quiet shows nothing."""
    import re

    from mnesite.cli import progress
    from mnesite.rlog import store as rlog_store

    backup = tmp_path / "rows.backup"
    _backup_file_with_rows(backup, 300)
    monkeypatch.setattr(rlog_store, "VERIFY_BATCH_ENTRIES", 50)  # 301 entries: 7 batches
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0)  # every batch's line
    result = CliRunner().invoke(main, ["rlog", "verify", str(backup)])
    assert result.exit_code == 0, result.output
    assert result.stdout == "default: ok, applied (1, 301)\n"
    *batches, done = result.stderr.splitlines()
    figures = [[int(figure) for figure in re.match(_VERIFY_LINE, line).groups()] for line in batches]
    assert figures == [[50, 50], [100, 100], [150, 150], [200, 200], [250, 250], [300, 300], [301, 301]], batches
    assert re.fullmatch(r"rlog verify: done in [0-9.]+ s: 301 entries verified", done), done
    quiet = CliRunner().invoke(main, ["rlog", "verify", str(backup), "--quiet", "--json"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output
    assert json.loads(quiet.stdout) == {"shards": {"default": {"applied": [1, 301], "ok": True}}}
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 3600)  # paced: only the final line
    paced = CliRunner().invoke(main, ["rlog", "verify", str(backup)])
    assert paced.exit_code == 0, paced.output
    assert re.fullmatch(r"rlog verify: done in [0-9.]+ s: 301 entries verified\n", paced.stderr), paced.stderr


@pytest.mark.timeout(60)
def test_ctrl_c_stops_rlog_verify_at_once_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C (a real SIGINT, here as the third batch of entries is read) stops ``rlog verify`` there: no
    further batch is checked, one ``Error:`` line says how far it got, no traceback, exit 1."""
    import subprocess
    import sys

    backup = tmp_path / "rows.backup"
    _backup_file_with_rows(backup, 300)
    interrupted = (
        "import os, signal, sys\n"
        "from mnesite.cli.main import main\n"
        "from mnesite.cli import progress\n"
        "from mnesite.rlog import store\n"
        "store.VERIFY_BATCH_ENTRIES = 50\n"
        "progress.PROGRESS_INTERVAL_S = 0\n"
        "entries_after = store.Store.entries_after\n"
        "calls = []\n"
        "def interrupting(self, *args):\n"
        "    calls.append(args)\n"
        "    if len(calls) == 3:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return entries_after(self, *args)\n"
        "store.Store.entries_after = interrupting\n"
        "main(['rlog', 'verify', sys.argv[1]])\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", interrupted, str(backup)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,  # not the checkout's folder: its mnesite/ would be imported instead of the installed package
    )
    assert process.returncode == 1 and process.stdout == "", process.stderr
    assert process.stderr.splitlines() == [
        "rlog verify: 50 entries verified (shard default at (1, 50), applied (1, 301))",
        "rlog verify: 100 entries verified (shard default at (1, 100), applied (1, 301))",
        "Error: rlog verify interrupted after 100 entries verified: the rest was not checked",
    ], process.stderr


def test_ctrl_c_at_rlog_verify_s_last_progress_line_says_every_entry_was_verified(tmp_path: Path, monkeypatch) -> None:
    """The final line was written outside the block that turns a Ctrl-C into one ``Error:`` line: the
    interrupt ended in click's ``Error: aborted``, which told nothing of the 301 entries verified."""
    ctrl_c_at_the_final_progress_line(monkeypatch)
    backup = tmp_path / "rows.backup"
    _backup_file_with_rows(backup, 300)
    result = CliRunner().invoke(main, ["rlog", "verify", str(backup)])
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.splitlines() == [
        "Error: rlog verify interrupted once done: 301 entries verified, every digest chain unbroken "
        "(the result was not printed)"
    ]


def test_ctrl_c_at_restore_s_last_progress_line_says_the_restore_completed(tmp_path: Path, monkeypatch) -> None:
    """The ``RestoreFinished`` line is reported after the database is in place, outside the block that
    turns a Ctrl-C into how far the restore got: the command ended in click's ``Error: aborted``. It
    now says that the restore completed (a node can start on the directory)."""
    ctrl_c_at_the_final_progress_line(monkeypatch)
    source = tmp_path / "rows.backup"
    _backup_file_with_rows(source, 30)
    data_dir = tmp_path / "new"
    result = CliRunner().invoke(main, ["restore", str(source), "--data-dir", str(data_dir)])
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.splitlines() == [
        f"Error: restore interrupted once it completed: {data_dir} holds the restored database, "
        "ready for a replicant to start on it"
    ]
    store = Store(str(data_dir / "mnesite.db"), create=False)
    try:
        assert store.connection.execute("SELECT count(*) FROM kv").fetchone()[0] == 30
    finally:
        store.close()


def _answered_backup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interval_s: float, *options: str) -> Any:
    """``mnesite backup`` against a node whose copy runs for three polls (pages not counted yet, 5 and 10 of 10
    copied), then is done."""
    from mnesite.cli import backup as cli_backup

    from tests.test_cli_interrupt import AnsweringNode

    figures = ((0, 0), (5, 10), (10, 10))
    running = [{"state": "running", "pages_copied": copied, "pages_total": total} for copied, total in figures]
    done = {"state": "done", "pages_copied": 10, "pages_total": 10, "seconds": 1.5, "shards": {}}
    node = AnsweringNode(lambda request, n: running[n - 1] if n <= len(running) else done)
    monkeypatch.setattr(cli_backup, "PROGRESS_INTERVAL_S", interval_s)
    monkeypatch.setattr(cli_backup, "POLL_INTERVAL_S", 0)
    try:
        return CliRunner().invoke(main, ["backup", str(tmp_path / "b.db"), "--node", node.endpoint, *options])
    finally:
        node.close()


def test_backup_progress_lines_are_paced_like_the_other_commands_and_end_with_a_final_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: backup paced its progress lines itself (a line at the first poll, none at the end),
    unlike restore, rlog verify, import and export (``cli.progress.ProgressLines``: a line at most every
    interval, then a final ``done`` line). It shows them as they do; stdout is the result only."""
    every = _answered_backup(tmp_path, monkeypatch, 0)
    assert every.exit_code == 0, every.output
    assert every.stderr.splitlines() == [
        "backup: 5 of 10 pages copied",  # nothing to say before the node counted the pages
        "backup: 10 of 10 pages copied",
        "backup: done in 1.5 s: 10 pages copied",
    ]
    assert every.stdout.splitlines() == [f"backup {tmp_path / 'b.db'}: 10 pages in 1.5 s", "shards: none"]
    paced = _answered_backup(tmp_path, monkeypatch, 3600)
    assert paced.exit_code == 0 and paced.stderr == "backup: done in 1.5 s: 10 pages copied\n", paced.stderr
    quiet = _answered_backup(tmp_path, monkeypatch, 0, "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == every.stdout


def test_ctrl_c_at_a_backup_s_final_progress_line_says_the_backup_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C as backup writes its final line (a blocked stderr): the copy is complete; the line must
    not say it is still running, nor that only stopping the node cancels it."""
    ctrl_c_at_the_final_progress_line(monkeypatch)
    result = _answered_backup(tmp_path, monkeypatch, 0)
    assert result.exit_code == 1, result.output
    path = tmp_path / "b.db"
    assert result.stderr.splitlines()[-1] == (
        f"Error: backup interrupted once done: {path} holds the backup (the result was not printed)"
    )
