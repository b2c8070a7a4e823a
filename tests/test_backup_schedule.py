"""Scheduled backups (``[backup]``, rlog.backup_schedule): the pure rules with a fake clock and fake
listings, the config section, the driver on a core and on a replicant stepped by hand, a real node
process taking backups every second (``MNESITE_TEST_BACKUP_INTERVAL_S_MIN``) that keeps only ``keep``
of them, a real replicant doing so with its core's rows once it caught up, and one started before
any core that takes no empty backup meanwhile. Names of a second already taken get ``-N``."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from mnesite.cli.main import describe_backup_schedule, main
from mnesite.rlog import backup_schedule
from mnesite.rlog.backup import BackupJob, check_backup, read_record
from mnesite.rlog.backup_schedule import (
    INTERVAL_S_MIN,
    INTERVAL_S_MIN_ENV,
    NAME_ATTEMPTS_MAX,
    BackupSchedule,
    due,
    file_name,
    file_pattern,
    free_file_name,
    interval_s_min,
    no_committed_state,
    to_prune,
)
from mnesite.rlog.config import ConfigError, config_keys, keys_needing_restart, parse_config
from mnesite.rlog.replication import Mode
from mnesite.rlog.types import ZERO_KEY, TxKey

from tests.conftest import (
    Cluster,
    NodeProcess,
    core_with_table,
    free_port,
    node_config,
    replicant_by_hand,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

# 2026-12-04 03:15:00 UTC
STAMP_S = 1_796_354_100


def test_a_backup_is_named_from_its_node_and_the_utc_time_and_only_its_own_names_match() -> None:
    assert file_name("core1", STAMP_S) == "core1-20261204T031500Z.db"
    pattern = file_pattern("core1")
    assert pattern.match("core1-20261204T031500Z.db")
    for other in (
        "core1-20261204T031500Z.db.partial",  # a copy under way
        "core1-x-20261204T031500Z.db",  # node core1-x's
        "xcore1-20261204T031500Z.db",
        "core1-20261204T031500Z.db.bak",
        "core1-2026-12-04.db",  # an operator's own backup
        "core2-20261204T031500Z.db",
    ):
        assert not pattern.match(other), other
    # A node name with a regular expression's characters means itself.
    assert not file_pattern("core.1").match("coreX1-20261204T031500Z.db")


def test_pruning_removes_only_this_nodes_oldest_scheduled_backups_beyond_keep() -> None:
    ours = [file_name("core1", STAMP_S + 3600 * hour) for hour in range(5)]
    others = ["notes.txt", "core2-20261204T031500Z.db", f"{ours[0]}.partial", "core1-x-20261204T031500Z.db"]
    listing = [ours[3], *others, ours[0], ours[4], ours[1], ours[2]]
    assert to_prune(listing, "core1", 2, ours[4]) == ours[:3]
    assert to_prune(listing, "core1", 1, ours[4]) == ours[:4]
    assert to_prune(listing, "core1", 5, ours[4]) == []
    assert to_prune(listing, "core1", 9, ours[4]) == []
    # A wall clock set back: the file just written has the oldest name, and is kept all the same.
    assert to_prune(listing, "core1", 2, ours[0]) == ours[1:4]
    assert to_prune([], "core1", 1, ours[0]) == []
    with pytest.raises(ValueError):
        to_prune(listing, "core1", 0, ours[4])


def test_a_second_backup_named_for_a_taken_second_gets_a_numbered_name_that_sorts_after_it() -> None:
    """A clock set back, or an operator's backup to the schedule's name: the name of that second is
    taken, and the backup takes the first free ``-N`` name of it instead of failing, never the file."""
    first = file_name("core1", STAMP_S)
    assert file_name("core1", STAMP_S, 2) == "core1-20261204T031500Z-2.db"
    pattern = file_pattern("core1")
    for name in (first, file_name("core1", STAMP_S, 2), file_name("core1", STAMP_S, NAME_ATTEMPTS_MAX)):
        assert pattern.match(name), name
    for other in ("core1-20261204T031500Z-.db", "core1-20261204T031500Z-02.db", "core1-20261204T031500Z-x.db"):
        assert not pattern.match(other), other
    taken = {first, file_name("core1", STAMP_S, 2)}
    assert free_file_name("core1", STAMP_S, lambda name: False) == first
    assert free_file_name("core1", STAMP_S, taken.__contains__) == file_name("core1", STAMP_S, 3)
    assert free_file_name("core1", STAMP_S, lambda name: True) is None  # every name taken: the caller says so
    # Pruned by time, then by number: -10 is newer than -2 although it sorts before it as a string.
    later = file_name("core1", STAMP_S + 1)
    names = [file_name("core1", STAMP_S, 10), first, later, file_name("core1", STAMP_S, 2)]
    assert to_prune(names, "core1", 2, later) == [first, file_name("core1", STAMP_S, 2)]
    assert to_prune(names, "core1", 1, file_name("core1", STAMP_S, 10)) == [
        first,
        file_name("core1", STAMP_S, 2),
        later,
    ]


def test_a_node_holds_a_committed_state_once_it_has_a_shard_and_each_applied_an_entry() -> None:
    """A node without a shard (a replicant that reached no core, a core before the first table) or with a
    shard that applied nothing yet (discovered, or recovered from the peers, and not followed) would back
    up an empty database: its scheduled backup waits, and says why."""
    waiting = no_committed_state({})
    assert waiting is not None and waiting.startswith("no shard yet"), waiting
    waiting = no_committed_state({"default": TxKey(1, 3), "s2": ZERO_KEY})
    assert waiting is not None and waiting.startswith("shard s2 has applied no entry yet"), waiting
    assert no_committed_state({"default": TxKey(1, 3), "s2": TxKey(2, 1)}) is None


def test_one_is_due_an_interval_after_the_start_then_after_each_start_and_never_while_one_runs() -> None:
    assert due(1000, 1000, backup_running=False)
    assert not due(999, 1000, backup_running=False)
    assert not due(5000, 1000, backup_running=True)
    schedule = BackupSchedule("/b", 60, 2, "core1", started_ms=10_000)
    assert schedule.status(10_000)["next_due_in_ms"] == 60_000
    assert not schedule.is_due(69_999, False) and schedule.is_due(70_000, False)
    assert not schedule.is_due(75_000, True)  # another backup runs: it waits for it
    # Started late: the next is an interval after it.
    schedule.started(90_000, schedule.path(STAMP_S, lambda path: False))
    assert schedule.status(90_000)["last_path"] == "/b/core1-20261204T031500Z.db"
    assert not schedule.is_due(149_999, False) and schedule.is_due(150_000, False)
    # Found due long after (the node was busy): one backup, not one per interval missed.
    schedule.started(1_000_000, "/b/x")
    assert schedule.next_due_ms == 1_060_000
    schedule.ended("done", None, 123.5, ["a", "b"])
    status = schedule.status(1_000_000)
    assert (status["last_state"], status["last_success_at_s"], status["files_kept"]) == ("done", 123.5, ["a", "b"])
    schedule.started(1_060_000, "/b/y")
    schedule.ended("failed", "disk full", 130.0, None)
    status = schedule.status(1_060_000)
    assert (status["last_state"], status["last_error"], status["last_success_at_s"]) == ("failed", "disk full", 123.5)
    assert status["files_kept"] == ["a", "b"]


def test_the_backup_section_is_validated_and_needs_a_restart_to_change(tmp_path: Path) -> None:
    def backup(**values: object):
        return parse_config({"backup": values}).backup

    assert parse_config({}).backup.interval_s == 0  # absent: off
    assert backup(directory="/var/backups/", interval_s=3600, keep=3) == type(backup())("/var/backups", 3600, 3)
    assert backup(directory="/var/backups", interval_s=0).interval_s == 0
    for values, message in (
        ({"interval_s": 3600}, "directory is required"),
        ({"directory": "backups", "interval_s": 3600}, "absolute path"),
        ({"directory": "/var/../etc", "interval_s": 3600}, "absolute path"),
        ({"directory": "/var/back ups", "interval_s": 3600}, "absolute path"),
        ({"directory": "/b", "interval_s": INTERVAL_S_MIN - 1}, f"0 \\(off\\) or an integer in {INTERVAL_S_MIN}"),
        ({"directory": "/b", "interval_s": True}, "interval_s"),
        ({"directory": "/b", "interval_s": 60, "keep": 0}, "keep must be an integer in 1.."),
        ({"directory": "/b", "every": 60}, "unknown key \\[backup\\].every"),
    ):
        with pytest.raises(ConfigError, match=message):
            backup(**values)
    with pytest.raises(ConfigError, match="\\[backup\\] must be a table"):
        parse_config({"backup": 3})
    running = parse_config({"backup": {"directory": "/b", "interval_s": 3600}})
    assert config_keys(running)["[backup].interval_s"] == 3600
    changed = parse_config({"backup": {"directory": "/c", "interval_s": 7200, "keep": 2}})
    assert keys_needing_restart(running, changed) == ["[backup].directory", "[backup].interval_s", "[backup].keep"]


def test_only_tests_lower_the_least_interval_and_only_below_the_usual_one() -> None:
    assert interval_s_min({}) == INTERVAL_S_MIN
    assert interval_s_min({INTERVAL_S_MIN_ENV: "1"}) == 1
    for value in ("0", "-1", "x", str(INTERVAL_S_MIN * 10), ""):
        assert interval_s_min({INTERVAL_S_MIN_ENV: value}) == INTERVAL_S_MIN, value


def test_a_node_refuses_to_start_on_a_backup_directory_it_cannot_use(tmp_path: Path) -> None:
    from mnesite.core.node import CoreNode

    missing = tmp_path / "missing"
    config = node_config(tmp_path / "d", free_port(), extra={"backup": {"directory": str(missing), "interval_s": 60}})
    with pytest.raises(ConfigError, match=f"\\[backup\\].directory {missing}: no such directory"):
        CoreNode(config)
    missing.mkdir()
    CoreNode(config).close()  # it starts once the directory exists
    if os.geteuid() != 0:  # root writes anywhere
        missing.chmod(0o500)
        try:
            with pytest.raises(ConfigError, match="not writable"):
                CoreNode(config)
        finally:
            missing.chmod(0o700)


def test_a_core_takes_no_scheduled_backup_before_it_holds_a_shard_past_its_start(tmp_path: Path) -> None:
    """A core of a new cluster before its first table holds no shard; one rebuilt or added on an empty
    disk holds the shards its peers named (``recover_generations``) at the zero key until it catches
    up. Either would back up an empty database: its due backup waits, saying why."""
    from mnesite.core.node import CoreNode

    directory = tmp_path / "backups"
    directory.mkdir()
    config = node_config(tmp_path / "d", free_port(), extra={"backup": {"directory": str(directory), "interval_s": 60}})
    node = CoreNode(config)
    try:
        schedule = node.backup_schedule
        schedule.next_due_ms = 0  # the interval passed
        node.run_backup_schedule(node._backup_not_ready)
        assert node.backup_job is None and os.listdir(directory) == []
        waiting = node.backup_status()["backup_schedule"]["waiting"]
        assert waiting.startswith("no shard yet"), waiting
        with node.store.write_transaction():  # as ``recover_generations`` does with the shards its peers name
            node.store.ensure_shard("default", 1)
        node._open_shard("default")
        node.run_backup_schedule(node._backup_not_ready)
        assert node.backup_job is None and os.listdir(directory) == []
        waiting = node.backup_status()["backup_schedule"]["waiting"]
        assert waiting.startswith("shard default has applied no entry yet"), waiting
    finally:
        node.close()


def _hold_finish(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every backup's copy before its last step until the returned event is set (at most 30 s)."""
    release = threading.Event()
    finish = BackupJob._finish

    def held(job: BackupJob, target: object) -> None:
        release.wait(30)
        finish(job, target)

    monkeypatch.setattr(BackupJob, "_finish", held)
    return release


def test_the_driver_waits_for_a_ready_node_and_a_running_backup_then_prunes_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stepped by hand: a due backup refused for a node not ready is retried at the next check, waits
    while a manual backup copies, runs through ``BackupJob``, and its end removes only this node's
    oldest scheduled backups beyond ``keep``. The manual backup's command, polling after the
    scheduled one began, is still told its own backup is done (not refused: a node's last backup)."""
    directory = tmp_path / "backups"
    directory.mkdir()
    old = [file_name("core1", STAMP_S - 86400 * day) for day in (3, 2, 1)]
    untouched = ["notes.txt", "core2-20200101T000000Z.db", f"{old[0]}.partial", "core1-x-20200101T000000Z.db"]
    for name in [*old, *untouched]:
        (directory / name).write_text("not a backup")
    (directory / file_name("core1", STAMP_S - 86400 * 9)).mkdir()  # a directory of a matching name: left alone
    extra = {"backup": {"directory": str(directory), "interval_s": 60, "keep": 2}}
    with core_with_table(tmp_path / "d", extra=extra) as node:
        schedule = node.backup_schedule
        assert schedule is not None
        node.run_backup_schedule(lambda: None)
        assert node.backup_job is None  # not due before an interval passed
        schedule.next_due_ms = 0  # the interval passed
        node.run_backup_schedule(lambda: "shard default: installing a snapshot")
        assert node.backup_job is None
        assert node.backup_status()["backup_schedule"]["waiting"] == "shard default: installing a snapshot"

        release = _hold_finish(monkeypatch)
        manual = str(tmp_path / "manual.db")
        assert node.answer_backup(SimpleNamespace(path=manual), None)["state"] == "running"
        node.run_backup_schedule(lambda: None)
        assert node.backup_job is not None and node.backup_job.path == manual  # it waits for the manual one
        release.set()
        assert node.backup_job.wait(30)

        node.run_backup_schedule(lambda: None)  # the node is ready now: the due backup starts
        job = node.backup_job
        assert job is not None and os.path.dirname(job.path) == str(directory)
        assert file_pattern("core1").match(os.path.basename(job.path))
        assert node.answer_backup(SimpleNamespace(path=manual), None)["state"] == "done"
        assert job.wait(30) and job.state == "done", job.error
        node.run_backup_schedule(lambda: None)
        status = node.backup_status()["backup_schedule"]
        assert (status["last_path"], status["last_state"], status["waiting"]) == (job.path, "done", None)
        assert status["files_kept"] == [old[2], os.path.basename(job.path)] and status["files_removed"] == 2
        assert status["next_due_in_ms"] > 50_000
        left = sorted(os.listdir(directory))
        assert left == sorted([old[2], os.path.basename(job.path), *untouched, file_name("core1", STAMP_S - 86400 * 9)])
        assert read_record(job.path)["node"] == "core1"


def test_a_scheduled_backup_that_fails_is_recorded_as_a_manual_one_is_and_retried_at_the_next_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "backups"
    directory.mkdir()
    extra = {"backup": {"directory": str(directory), "interval_s": 60, "keep": 1}}

    def disk_full(job: BackupJob, target: object) -> None:
        raise OSError("No space left on device")

    with core_with_table(tmp_path / "d", extra=extra) as node:
        schedule = node.backup_schedule
        monkeypatch.setattr(BackupJob, "_finish", disk_full)
        schedule.next_due_ms = 0
        node.run_backup_schedule(lambda: None)
        job = node.backup_job
        assert job is not None and job.wait(30) and job.state == "failed"
        node.run_backup_schedule(lambda: None)
        status = node.backup_status()
        assert status["backup_failed"]["path"] == job.path and "No space left" in status["backup_failed"]["error"]
        assert status["backup_schedule"]["last_state"] == "failed" and status["backup_schedule"]["next_due_in_ms"] > 0
        assert os.listdir(directory) == []
        monkeypatch.undo()
        schedule.next_due_ms = 0  # the next interval: it tries again
        node.run_backup_schedule(lambda: None)
        assert node.backup_job is not job and node.backup_job.wait(30) and node.backup_job.state == "done"
        node.run_backup_schedule(lambda: None)
        assert node.backup_status()["backup_failed"] is None


def _stamped_at(monkeypatch: pytest.MonkeyPatch, now_s: float) -> None:
    """Every scheduled backup named as if taken at ``now_s`` (a clock that stands still, or set back)."""
    name = backup_schedule.file_name
    monkeypatch.setattr(backup_schedule, "file_name", lambda node, _now_s, attempt=1: name(node, now_s, attempt))


def test_a_scheduled_backup_whose_name_is_taken_takes_the_next_free_one_and_never_touches_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names have a resolution of one second: a wall clock set back, or an operator's backup to the
    schedule's name, finds the name of that second taken. The backup is then named ``-N`` (the first
    free one), is kept and pruned in its order, and leaves the file there (and a ``.partial`` one) as it
    was; only when every name of that second is taken does it fail, saying so."""
    directory = tmp_path / "backups"
    directory.mkdir()
    extra = {"backup": {"directory": str(directory), "interval_s": 60, "keep": 3}}
    taken, partial = file_name("core1", STAMP_S), f"{file_name('core1', STAMP_S, 2)}.partial"
    (directory / partial).write_text("a copy left behind by a crash")
    with core_with_table(tmp_path / "d", extra=extra) as node:
        schedule = node.backup_schedule
        _stamped_at(monkeypatch, STAMP_S)
        manual = node.answer_backup(SimpleNamespace(path=str(directory / taken)), None)  # to the schedule's name
        assert node.backup_job is not None and node.backup_job.wait(30) and node.backup_job.state == "done", manual
        before = (directory / taken).read_bytes()
        written = []
        for _ in range(3):
            schedule.next_due_ms = 0
            node.run_backup_schedule(lambda: None)
            job = node.backup_job
            assert job is not None and job.wait(30) and job.state == "done", job.error
            written.append(os.path.basename(job.path))
            node.run_backup_schedule(lambda: None)
            if len(written) == 1:
                assert (directory / taken).read_bytes() == before  # the operator's backup as it was written
        assert written == [file_name("core1", STAMP_S, attempt) for attempt in (3, 4, 5)]
        status = node.backup_status()
        assert status["backup_failed"] is None and status["backup_schedule"]["last_state"] == "done"
        # keep 3 of the four: the oldest (the operator's, first in that second) pruned, never overwritten before.
        assert status["backup_schedule"]["files_kept"] == written and status["backup_schedule"]["files_removed"] == 1
        assert sorted(os.listdir(directory)) == sorted([*written, partial])
        assert read_record(str(directory / written[0]))["node"] == "core1"
        # Every name of that second taken: the backup fails at its start, and says what to do.
        monkeypatch.setattr(backup_schedule, "NAME_ATTEMPTS_MAX", 5)
        (directory / taken).write_text("an operator's file")
        schedule.next_due_ms = 0
        node.run_backup_schedule(lambda: None)
        status = node.backup_status()
        error = status["backup_failed"]["error"]
        assert "every other name of its second" in error and "are taken: move the files" in error
        assert status["backup_schedule"]["last_state"] == "failed"
        assert sorted(os.listdir(directory)) == sorted([*written, partial, taken])
        assert (directory / taken).read_text() == "an operator's file"


@pytest.mark.slow  # it starts real node processes (seconds each): the slow lane runs it
@pytest.mark.timeout(120)
def test_a_node_process_takes_backups_on_schedule_keeps_only_keep_and_one_restores(
    tmp_path: Path, node_processes: list[NodeProcess]
) -> None:
    directory = tmp_path / "backups"
    directory.mkdir()
    untouched = {"notes.txt": "mine", "core2-20200101T000000Z.db": "core2's", "core1-2026-01-01.db": "by hand"}
    for name, text in untouched.items():
        (directory / name).write_text(text)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "core1.toml"
    config.write_text(
        f'[node]\nname = "core1"\ndata_dir = "{tmp_path / "core1"}"\nlisten = "{endpoint}"\n'
        '[storage]\nsynchronous = "NORMAL"\n'
        f'[backup]\ndirectory = "{directory}"\ninterval_s = 1\nkeep = 2\n'
    )
    node = NodeProcess(config, tmp_path / "core1.log")
    node_processes.append(node)
    node.start(endpoint, env={INTERVAL_S_MIN_ENV: "1"})
    runner = CliRunner()
    assert (
        runner.invoke(
            main, ["table", "create", "kv", "--key-column", "id", "--column", "id:INTEGER", "--node", endpoint]
        ).exit_code
        == 0
    )

    def schedule() -> dict:
        result = runner.invoke(main, ["status", "--json", "--node", endpoint])
        return json.loads(result.stdout)["backup_schedule"]

    wait_until(lambda: schedule()["files_removed"] >= 2 and schedule()["last_state"] == "done", 60, "pruned backups")
    status = schedule()
    ours = sorted(name for name in os.listdir(directory) if file_pattern("core1").match(name))
    assert len(ours) == 2 and status["keep"] == 2 and status["interval_s"] == 1
    assert {name: (directory / name).read_text() for name in untouched} == untouched
    assert check_backup(str(directory / ours[-1])) >= 1
    restored = runner.invoke(main, ["restore", str(directory / ours[0]), "--data-dir", str(tmp_path / "r"), "--quiet"])
    assert restored.exit_code == 0, restored.output
    text = runner.invoke(main, ["status", "--node", endpoint]).output
    assert f"scheduled backups every 1 s into {directory}, 2 of 2 kept, next in " in text


def test_a_replicant_takes_no_scheduled_backup_while_a_shard_bootstraps_and_takes_it_once_caught_up(
    tmp_path: Path,
) -> None:
    """The replicant's loop passes ``_backup_not_ready`` to the driver: a due backup waits, with the
    reason in ``status``, while the replicant has no shard (it reached no core yet: its database is
    empty), while its shard applied nothing yet, while a shard bootstraps or is read fenced, and starts
    once it is none of these."""
    directory = tmp_path / "backups"
    directory.mkdir()
    extra = {"backup": {"directory": str(directory), "interval_s": 60, "keep": 1}}
    with replicant_by_hand(tmp_path / "r", extra=extra) as node:
        schedule = node.backup_schedule
        assert schedule is not None
        schedule.next_due_ms = 0  # the interval passed
        assert node.replicas == {}  # a fresh replicant, no core reached
        node.run_backup_schedule(node._backup_not_ready)
        assert node.backup_job is None and os.listdir(directory) == []
        waiting = node.backup_status()["backup_schedule"]["waiting"]
        assert waiting.startswith("no shard yet"), waiting
        node._open_replica("default")  # discovered from a core, not followed yet: applied nothing
        node.flush()
        node.run_backup_schedule(node._backup_not_ready)
        assert node.backup_job is None and os.listdir(directory) == []
        waiting = node.backup_status()["backup_schedule"]["waiting"]
        assert waiting.startswith("shard default has applied no entry yet"), waiting
        with node.store.write_transaction():  # as if it had followed the shard past its bootstrap
            node.store.connection.execute(
                "UPDATE _mnesite_shards SET applied_generation = 1, applied_counter = 5 WHERE shard = 'default'"
            )
        for mode, fenced in ((Mode.BOOTSTRAP, False), (Mode.LOCAL_REPLAY, False), (Mode.NORMAL, True)):
            shard = SimpleNamespace(mode=mode, read_fenced=fenced)
            node.replicas = {"default": SimpleNamespace(status=lambda shard=shard: shard)}
            node.run_backup_schedule(node._backup_not_ready)
            assert node.backup_job is None and os.listdir(directory) == []
            waiting = node.backup_status()["backup_schedule"]["waiting"]
            assert waiting.startswith("shard default is bootstrapping"), waiting
        caught_up = SimpleNamespace(mode=Mode.NORMAL, read_fenced=False)
        node.replicas = {"default": SimpleNamespace(status=lambda: caught_up)}
        node.run_backup_schedule(node._backup_not_ready)
        job = node.backup_job
        assert job is not None and job.wait(30) and job.state == "done", job and job.error
        node.run_backup_schedule(node._backup_not_ready)
        status = node.backup_status()["backup_schedule"]
        assert (status["last_state"], status["waiting"]) == ("done", None)
        assert status["files_kept"] == [os.path.basename(job.path)]
        assert read_record(job.path)["role"] == "replicant"


def _backup_rows(path: Path) -> dict[int, str]:
    """The rows of table kv in the backup file at ``path``, read-only."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as connection:
        return dict(connection.execute("SELECT id, value FROM kv"))


def _cluster_with_a_scheduled_replicant(tmp_path: Path, node_processes: list[NodeProcess]) -> tuple[Cluster, Path]:
    """One core (not started) and replicant1, whose config backs it up every second into the returned
    directory, keeping 2."""
    cluster = Cluster(tmp_path, node_processes, size=1)
    directory = tmp_path / "backups"
    directory.mkdir()
    cluster.add_replicant("replicant1")
    config = tmp_path / "replicant1.toml"
    config.write_text(config.read_text() + f'[backup]\ndirectory = "{directory}"\ninterval_s = 1\nkeep = 2\n')
    return cluster, directory


@pytest.mark.slow  # it starts real node processes (seconds each): the slow lane runs it
@pytest.mark.timeout(120)
def test_a_replicant_process_takes_backups_of_its_rows_on_schedule_and_keeps_only_keep(
    tmp_path: Path, node_processes: list[NodeProcess]
) -> None:
    cluster, directory = _cluster_with_a_scheduled_replicant(tmp_path, node_processes)
    cluster.start("core1")
    written = {row_id: f"v{row_id}" for row_id in range(50)}
    with cluster.client("core1", retries=5) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        for row_id, value in written.items():
            client.put("kv", {"id": row_id, "value": value})
    cluster.nodes["replicant1"].start(cluster.endpoints["replicant1"], env={INTERVAL_S_MIN_ENV: "1"})
    position = cluster.wait_replicants_converged(["core1"], ["replicant1"])

    def schedule() -> dict:
        return cluster.status("replicant1")["backup_schedule"]

    def pruned_after_catching_up() -> bool:
        status = schedule()
        if status["last_state"] != "done" or status["files_removed"] < 2:
            return False
        applied = read_record(status["last_path"])["shards"]["default"]["applied"]
        return tuple(applied) >= position["applied"]

    wait_until(pruned_after_catching_up, 60, "a pruned backup taken after replicant1 caught up", interval_s=0.2)
    status = schedule()
    ours = sorted(name for name in os.listdir(directory) if file_pattern("replicant1").match(name))
    assert len(ours) == 2 and status["keep"] == 2 and sorted(status["files_kept"]) == ours
    newest = status["last_path"]
    assert os.path.basename(newest) in ours and read_record(newest)["role"] == "replicant"
    assert check_backup(newest) >= len(written)
    assert _backup_rows(Path(newest)) == written


@pytest.mark.slow  # it starts real node processes (seconds each): the slow lane runs it
@pytest.mark.timeout(120)
def test_a_replicant_process_that_reached_no_core_takes_no_empty_backup_and_says_why(
    tmp_path: Path, node_processes: list[NodeProcess]
) -> None:
    """A replicant started with an empty data directory before any core: its due backups wait (an
    empty database is no backup of the cluster, and with ``keep`` it would push real ones out), with
    ``waiting`` saying why, until it follows its core's shard; every backup it then takes holds a shard
    past its start, and the last one the core's rows."""
    cluster, directory = _cluster_with_a_scheduled_replicant(tmp_path, node_processes)
    cluster.nodes["replicant1"].start(cluster.endpoints["replicant1"], env={INTERVAL_S_MIN_ENV: "1"})

    def schedule() -> dict:
        return cluster.status("replicant1")["backup_schedule"]

    def waits_for_a_shard() -> bool:
        status = schedule()
        return status["next_due_in_ms"] == 0 and (status["waiting"] or "").startswith("no shard yet")

    wait_until(waits_for_a_shard, 30, "replicant1's due backup to wait for a shard", interval_s=0.1)
    status = schedule()
    assert status["last_path"] is None and os.listdir(directory) == [], status
    assert "(due, waiting: no shard yet: " in describe_backup_schedule(status)  # the status's text form

    cluster.start("core1")
    written = {row_id: f"v{row_id}" for row_id in range(20)}
    with cluster.client("core1", retries=5) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        for row_id, value in written.items():
            client.put("kv", {"id": row_id, "value": value})
    position = cluster.wait_replicants_converged(["core1"], ["replicant1"])

    def caught_up_backup() -> bool:
        status = schedule()
        if status["last_state"] != "done":
            return False
        return tuple(read_record(status["last_path"])["shards"]["default"]["applied"]) >= position["applied"]

    wait_until(caught_up_backup, 60, "a backup taken after replicant1 caught up", interval_s=0.2)
    last = schedule()["last_path"]
    cluster.nodes["replicant1"].stop()  # no backup taken or pruned while its files are read
    assert _backup_rows(Path(last)) == written
    for name in os.listdir(directory):
        if file_pattern("replicant1").match(name):
            shards = read_record(str(directory / name))["shards"]
            assert shards and all(tuple(shard["applied"]) > (0, 0) for shard in shards.values()), (name, shards)
