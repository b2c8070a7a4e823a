"""Spark on a real cluster: a standalone master and one worker on 127.0.0.1, started with the
``spark-class`` launcher that pyspark ships, run ``mnesite compare --master spark://...`` on two
replicas of 100,000 rows; the report equals the local run's, and the worker's executor ran the
tasks that read the replicas (its own log in the worker's work directory says so)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port, wait_until
from tests.spark_fixtures import copy_replica, create_store, create_table, write_rows

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(480)]

ROWS = 100_000


def spark_class() -> str:
    import pyspark

    path = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    if not os.access(path, os.X_OK):
        pytest.skip(f"pyspark ships no executable spark-class at {path}")
    return path


def daemon_environment() -> dict[str, str]:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_NO_DAEMONIZE="1")
    env.pop("SPARK_SUBMIT_OPTS", None)  # the driver's quiet log settings; the daemons log as usual
    return env


class Standalone:
    """A master and one worker, each a process group killed at the end (also on failure)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port, self.web_port = free_port(), free_port()
        self.work_dir = root / "worker-work"
        self.processes: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _start(self, name: str, arguments: list[str]) -> None:
        with open(self.root / f"{name}.log", "ab") as log:
            self.processes.append(
                subprocess.Popen(
                    [spark_class(), *arguments],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=daemon_environment(),
                    start_new_session=True,
                )
            )

    def master_state(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/json/", timeout=2) as answer:
                return json.loads(answer.read())
        except OSError:
            return {}

    def start(self) -> None:
        master = "org.apache.spark.deploy.master.Master"
        self._start(
            "master", [master, "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.web_port)]
        )
        wait_until(lambda: self._alive() and self.master_state().get("status") == "ALIVE", 120, "the master", 0.5)
        self._start(
            "worker",
            [
                "org.apache.spark.deploy.worker.Worker",
                "--host", "127.0.0.1",
                "--port", str(free_port()),
                "--webui-port", str(free_port()),
                "--cores", "2",
                "--memory", "2g",
                "--work-dir", str(self.work_dir),
                self.url,
            ],
        )  # fmt: skip
        wait_until(lambda: self._alive() and self.master_state().get("aliveworkers") == 1, 120, "the worker", 0.5)

    def _alive(self) -> bool:
        for process in self.processes:
            if process.poll() is not None:
                logs = "".join(
                    (self.root / f"{n}.log").read_text()[-1500:]
                    for n in ("master", "worker")
                    if (self.root / f"{n}.log").exists()
                )
                raise AssertionError(f"a Spark daemon exited with {process.returncode}: {logs}")
        return True

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def build_replicas(root: Path) -> tuple[Path, Path]:
    store = create_store(root / "a")
    create_table(store, "items", "id", [("id", "INTEGER"), ("name", "TEXT"), ("weight", "REAL")])
    write_rows(store, "items", [{"id": key, "name": f"item-{key}", "weight": key / 7} for key in range(ROWS)], 5000)
    store.close()
    copy_replica(root / "a", root / "b")
    import apsw

    connection = apsw.Connection(str(root / "b" / "mnesite.db"))  # two differences behind mnesite's back
    with connection:
        connection.execute("UPDATE items SET name = 'changed' WHERE id = 4242")
        connection.execute("DELETE FROM items WHERE id = 77777")
    connection.close()
    return root / "a", root / "b"


def comparable(report: dict[str, Any]) -> dict[str, Any]:
    """A report without its timings (which differ from run to run)."""
    return {key: value for key, value in report.items() if key != "statistics"}


def test_compare_on_a_standalone_cluster_equals_the_local_run(spark_session: Any, tmp_path: Path) -> None:
    from mnesite.spark.compare import EXIT_DIVERGED, CompareOptions, compare, report_json

    left, right = build_replicas(tmp_path)
    local = json.loads(report_json(compare([str(left), str(right)], CompareOptions(), session=spark_session)))
    assert local["status"] == "diverged"
    cluster = Standalone(tmp_path)
    try:
        cluster.start()
        env = dict(os.environ, PYTHONPATH=str(REPO), SPARK_LOCAL_IP="127.0.0.1")
        result = subprocess.run(
            [sys.executable, "-m", "mnesite.cli", "compare", "--master", cluster.url, "--json", str(left), str(right)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=360,
        )
        apps = cluster.master_state().get("completedapps", []) + cluster.master_state().get("activeapps", [])
    finally:
        cluster.stop()
    assert result.returncode == EXIT_DIVERGED, result.stderr[-3000:]
    remote = json.loads(result.stdout)
    assert comparable(remote) == comparable(local)
    (pair,) = remote["pairs"]
    assert pair["counts"]["different"] == 1 and pair["counts"]["missing_on_right"] == 1
    assert "compare: starting Spark (spark://127.0.0.1" in result.stderr and "compare: Spark started" in result.stderr
    # The application ran on the master, and its tasks on the worker's executor, which read the replicas.
    assert [app["name"] for app in apps] == ["mnesite-compare"]
    executor_logs = list(self_work.glob("app-*/*/stderr")) if (self_work := cluster.work_dir).exists() else []
    assert executor_logs, f"no executor ran in the worker's work directory {cluster.work_dir}"
    finished = sum(log.read_text().count("Finished task") for log in executor_logs)
    assert finished >= 2, f"the worker's executor finished {finished} tasks"


@pytest.mark.timeout(240)
def test_a_master_url_nobody_answers_is_one_error_line_naming_it(tmp_path: Path) -> None:
    """A ``spark://`` master that does not answer: Spark gives up after about a minute and stops its
    context, and compare said only "Spark could not start: An error occurred while calling
    None.org.apache.spark.sql.classic.SparkSession." (neither the URL nor the cause). Now the line
    names the master and asks whether one answers there. A child process: the test session's own
    SparkSession would be reused whatever the master."""
    store = create_store(tmp_path / "a")
    create_table(store, "t", "id", [("id", "INTEGER")])
    write_rows(store, "t", [{"id": key} for key in range(10)])
    store.close()
    copy_replica(tmp_path / "a", tmp_path / "b")
    master = f"spark://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "mnesite.cli", "compare", "--quiet", "--master", master, "a", "b"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO), SPARK_LOCAL_IP="127.0.0.1"),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert master in lines[0] and "does a Spark master answer" in lines[0], lines
