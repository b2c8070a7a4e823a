"""Real processes, 3 cores + 2 replicants: queries over two shards (rlog.query), their consistency,
hostile SQL, a runaway statement under load, and a 1,000,000-row result with the memory it costs.

Figures are printed (``-s`` shows them) and bounded by assertions."""

from __future__ import annotations

import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mnesite.rlog.client import RemoteError

from tests.conftest import REPO, Cluster, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

REPLICANTS = ["replicant1", "replicant2"]
QUERY_MS_MAX = 2000
USERS = 1000
POSTS = 3000
JOIN = (
    "SELECT u.id, u.name, count(p.id) AS posts, sum(length(p.title)) AS chars FROM users u "
    "JOIN posts p ON p.author = u.id WHERE u.karma >= ? GROUP BY u.id ORDER BY posts DESC, u.id"
)
AGGREGATES = [
    ("SELECT karma, count(*), min(id), max(id), avg(id), group_concat(name, '|') FROM users GROUP BY karma", ()),
    (JOIN, (7,)),
    ("SELECT count(*) FROM posts p LEFT JOIN users u ON u.id = p.author WHERE u.id IS NULL", ()),
    (
        "WITH busy AS (SELECT author, count(*) AS n FROM posts GROUP BY author HAVING n > 2) "
        "SELECT u.name, b.n FROM busy b JOIN users u ON u.id = b.author ORDER BY b.n DESC, u.name LIMIT 50",
        (),
    ),
]


def _modes(cluster: Cluster, name: str) -> dict[str, str]:
    status = cluster.status(name)
    return {shard: info.get("mode", "") for shard, info in (status or {}).get("shards", {}).items()}


@pytest.fixture(scope="module")
def loaded_once(module_cluster: Cluster) -> Cluster:
    """The cluster and its rows, loaded once for the module: the tests read them, and what they write
    is rows of their own (ids from 10,000) that no other test counts."""
    cluster = module_cluster
    cluster.extend_core_configs(f"[limits]\nquery_ms_max = {QUERY_MS_MAX}\n")
    cluster.start_all()
    with cluster.client("core1", timeout_ms=5000, retries=5) as client:
        client.create_table("users", "id", [("id", "INTEGER"), ("name", "TEXT"), ("karma", "INTEGER")])
        client.create_table("posts", "id", [("id", "INTEGER"), ("author", "INTEGER"), ("title", "TEXT")], "content")
        for start in range(0, USERS, 500):
            with client.transaction() as tx:
                for i in range(start, start + 500):
                    tx.put("users", {"id": i, "name": f"user{i:04d}", "karma": i % 13})
        for start in range(0, POSTS, 500):
            with client.transaction() as tx:
                for i in range(start, start + 500):
                    tx.put("posts", {"id": i, "author": (i * 7) % (USERS + 100), "title": "t" * (i % 40)})
    for name in REPLICANTS:
        cluster.add_replicant(name)
        cluster.start(name)
    for name in REPLICANTS:
        wait_until(lambda n=name: _modes(cluster, n) == {"default": "normal", "content": "normal"}, 90, f"{name}")
    for shard in ("default", "content"):
        applied = cluster.wait_converged(cluster.names, shard=shard, timeout_s=60)["applied"]
        for name in REPLICANTS:
            wait_until(
                lambda n=name, s=shard, a=applied: tuple((cluster.status(n) or {})["shards"][s]["applied"]) == a,
                60,
                f"{name} to apply {applied} in {shard}",
            )
    return cluster


@pytest.fixture
def loaded(loaded_once: Cluster) -> Cluster:
    """The module's cluster once every replicant applied what the cores converged on, in both shards:
    what an earlier test wrote has reached every node before this test reads."""
    for shard in ("default", "content"):
        loaded_once.wait_replicants_converged(loaded_once.names, REPLICANTS, shard=shard)
    return loaded_once


def _sqlite_rows(cluster: Cluster, name: str, sql: str, params: tuple) -> list[tuple]:
    connection = sqlite3.connect(f"file:{cluster.data_dir(name) / 'mnesite.db'}?mode=ro", uri=True)
    try:
        return [tuple(row) for row in connection.execute(sql, params)]
    finally:
        connection.close()


def test_joins_and_aggregates_equal_sqlite_on_every_node(loaded: Cluster) -> None:
    for name in [*loaded.names, *REPLICANTS]:
        with loaded.client(name) as client:
            for sql, params in AGGREGATES:
                result = client.query(sql, params, page_rows=97)
                rows = list(result)
                assert rows, (name, sql)
                assert rows == _sqlite_rows(loaded, name, sql, params), (name, sql)
            positions = client.query(JOIN, (7,)).positions
            assert set(positions) == {"default", "content"}  # a join over both shards, one snapshot


def test_counts_run_on_a_query_worker_at_every_node_and_equal_sqlite(loaded: Cluster) -> None:
    """A ``count`` reads the whole table: it runs as a query (``NodeServer.count_later``), never on the
    node's loop, where a large table's count held every heartbeat and append for as long (DESIGN
    invariant 11). The nodes' status counts one query per count, at every consistency level (a
    linearizable count at a follower core is counted by the sequencer it is forwarded to)."""
    everyone = [*loaded.names, *REPLICANTS]

    def queries_run() -> int:
        return sum((loaded.status(name) or {})["queries"]["queries"] for name in everyone)

    with loaded.client(loaded.names[0], retries=5) as writer:
        tx_key = writer.put("users", {"id": 20_000, "name": "counted", "karma": 1})
    for name in everyone:
        started = queries_run()
        with loaded.client(name) as client:
            counts = [
                client.count("users"),
                client.count("users", after_tx_key=tx_key),
                client.count("posts", consistency="linearizable"),
            ]
        users = _sqlite_rows(loaded, name, "SELECT count(*) FROM users", ())[0][0]
        posts = _sqlite_rows(loaded, name, "SELECT count(*) FROM posts", ())[0][0]
        # A local count may be taken before this node applied the write just acknowledged elsewhere.
        assert counts[0] in (users - 1, users) and counts[1:] == [users, posts] and users > USERS, name
        assert queries_run() == started + 3, name


def test_linearizable_and_read_your_writes_queries_at_a_replicant(loaded: Cluster) -> None:
    replicant = loaded.client("replicant1")
    try:
        for round_number in range(10):
            writer_core = loaded.names[round_number % 3]
            user_id, post_id = 10_000 + round_number, 10_000 + round_number
            with loaded.client(writer_core, retries=5) as writer:
                writer.put("users", {"id": user_id, "name": f"fresh{round_number}", "karma": 99})
                tx_key = writer.put("posts", {"id": post_id, "author": user_id, "title": "fresh"})
            # Acknowledged at another core just before: a linearizable query sees both shards' writes.
            seen = replicant.query(
                "SELECT u.name, p.title FROM users u JOIN posts p ON p.author = u.id WHERE u.id = ?",
                [user_id],
                consistency="linearizable",
            )
            assert list(seen) == [(f"fresh{round_number}", "fresh")], writer_core
            assert seen.positions["content"] >= tx_key
            with loaded.client(writer_core, retries=5) as writer:
                tx_key = writer.put("users", {"id": user_id, "name": f"renamed{round_number}", "karma": 98})
            after = replicant.query("SELECT name FROM users WHERE id = ?", [user_id], after_tx_key=tx_key)
            assert list(after) == [(f"renamed{round_number}",)]
            assert after.positions["default"] >= tx_key
    finally:
        replicant.close()


def test_linearizable_queries_at_every_core_see_writes_acknowledged_at_another(loaded: Cluster) -> None:
    """At a core, a linearizable query over two shards asks each shard's read index: its own as the
    sequencer of a shard, its sequencer's (forwarded ``read_index``) where it follows."""
    for round_number, reader_core in enumerate([*loaded.names, *loaded.names]):
        writer_core = loaded.names[(round_number + 1) % 3]
        user_id = post_id = 11_000 + round_number
        with loaded.client(writer_core, retries=5) as writer:
            writer.put("users", {"id": user_id, "name": f"core{round_number}", "karma": 7})
            tx_key = writer.put("posts", {"id": post_id, "author": user_id, "title": "core"})
        with loaded.client(reader_core, retries=5) as reader:
            seen = reader.query(
                "SELECT u.name, p.title FROM users u JOIN posts p ON p.author = u.id WHERE u.id = ?",
                [user_id],
                consistency="linearizable",
            )
            assert list(seen) == [(f"core{round_number}", "core")], (reader_core, writer_core)
            assert seen.positions["content"] >= tx_key


def test_hostile_sql_at_a_replicant_and_a_core_changes_nothing(loaded: Cluster) -> None:
    hostile = [
        "DELETE FROM users",
        "DROP TABLE posts",
        "ATTACH DATABASE '/tmp/evil.db' AS evil",
        "PRAGMA writable_schema=1",
        "SELECT load_extension('/tmp/evil.so')",
        "SELECT * FROM _mnesite_rlog",
        "SELECT 1; DELETE FROM users",
    ]
    before = {name: _sqlite_rows(loaded, name, "SELECT count(*), sum(karma) FROM users", ()) for name in loaded.names}
    for name in ("replicant2", "core2"):
        with loaded.client(name) as client:
            for sql in hostile:
                with pytest.raises(RemoteError) as refused:
                    client.query(sql)
                assert refused.value.code == "query_refused" and "\n" not in str(refused.value), (name, sql)
    after = {name: _sqlite_rows(loaded, name, "SELECT count(*), sum(karma) FROM users", ()) for name in loaded.names}
    assert after == before


def _latencies(loaded: Cluster, name: str, stop: threading.Event, samples: list[float], writer: int) -> None:
    with loaded.client(name, retries=5) as client:
        index = 0
        while not stop.is_set():
            started = time.monotonic()
            client.put("users", {"id": 100_000 + writer * 100_000 + index, "name": "load", "karma": 0})
            client.get("users", index % USERS)
            samples.append((time.monotonic() - started) * 1000)
            index += 1


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def test_a_runaway_query_is_stopped_while_reads_and_writes_are_served(loaded: Cluster) -> None:
    sequencer = loaded.sequencer("default")
    assert sequencer is not None
    core = sequencer[0]

    def measure(seconds: float) -> list[float]:
        samples: list[float] = []
        stop = threading.Event()
        threads = [threading.Thread(target=_latencies, args=(loaded, core, stop, samples, n)) for n in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(seconds)  # the measuring window itself, not a wait for a condition
        stop.set()
        for thread in threads:
            thread.join()
        return samples

    before = measure(2.0)
    outcome: dict = {}

    def runaway() -> None:
        with loaded.client(core, timeout_ms=30_000) as client:
            started = time.monotonic()
            try:
                client.query("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT max(n) FROM r")
            except RemoteError as error:
                outcome["code"] = error.code
            outcome["elapsed_s"] = time.monotonic() - started

    samples: list[float] = []
    stop = threading.Event()
    query = threading.Thread(target=runaway)
    query.start()
    threads = [threading.Thread(target=_latencies, args=(loaded, core, stop, samples, n + 2)) for n in range(2)]
    for thread in threads:
        thread.start()
    query.join(timeout=30)
    stop.set()
    for thread in threads:
        thread.join()
    assert outcome["code"] == "query_budget"
    assert QUERY_MS_MAX / 1000 <= outcome["elapsed_s"] < QUERY_MS_MAX / 1000 + 2
    print(
        f"\nrunaway query at {core}: stopped after {outcome['elapsed_s']:.2f} s (query_ms_max {QUERY_MS_MAX}); "
        f"put+get before: n={len(before)} p50 {statistics.median(before):.1f} ms p99 {_percentile(before, 0.99):.1f} "
        f"ms; during: n={len(samples)} p50 {statistics.median(samples):.1f} ms p99 "
        f"{_percentile(samples, 0.99):.1f} ms max {max(samples):.1f} ms"
    )
    assert len(samples) >= 20
    # Served throughout: no put+get waited for the statement's whole budget.
    assert max(samples) < QUERY_MS_MAX / 2


def _reset_peak_rss(pid: int) -> None:
    """Set the process's peak RSS (VmHWM) to its RSS now: what earlier tests made it hold is not counted."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# Runs a Python command (``-m MODULE ...`` or ``-c CODE``) and, at its exit, writes its own peak RSS
# (VmHWM, KiB) to the file named first: the peak of this process image since its exec. The kernel's
# ru_maxrss (RUSAGE_CHILDREN, wait4) also counts what the child shared with pytest when it was forked,
# so a child smaller than pytest would show pytest's size whatever it did.
_PEAK_WRAPPER = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def peak():
    with open("/proc/self/status") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(out, "w") as sink:
        sink.write(kib)
atexit.register(peak)
mode, target = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
if mode == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(target, {"__name__": "__main__"})
"""


def _run_measured(command: list[str], stdout: Any, stderr_path: Path, timeout_s: float) -> tuple[int, str, int]:
    """Run the Python ``command`` (``[python, -m|-c, ...]``) to its end: its exit code, its stderr and
    the peak RSS (KiB) of that one process image (``_PEAK_WRAPPER``)."""
    peak_path = stderr_path.with_suffix(".peak")
    with stderr_path.open("wb") as stderr:
        run = subprocess.run(
            [command[0], "-c", _PEAK_WRAPPER, str(peak_path), *command[1:]],
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
            timeout=timeout_s,
        )
    return run.returncode, stderr_path.read_text(errors="replace"), int(peak_path.read_text())


def test_a_million_row_result_streams_in_bounded_memory(loaded: Cluster, tmp_path: Path) -> None:
    # 1,000 users x 1,000 users: 1,000,000 rows of about 130 bytes (130 MB of values) from a user table.
    sql = (
        "SELECT a.id, b.id, a.name || b.name || printf('%0100d', a.id * b.id) FROM users a, users b "
        "WHERE a.id < ? AND b.id < ?"
    )
    node = "replicant1"
    pid = loaded.nodes[node].process.pid
    keys = []
    if loaded.secure:
        keys = loaded.cli_keys()
    command = [sys.executable, "-m", "mnesite.cli", "query", "--node", loaded.endpoints[node], *keys, "--json"]
    code, stderr, client_baseline_kib = _run_measured(
        [*command, "SELECT 1"], subprocess.DEVNULL, tmp_path / "baseline.err", 60
    )
    assert code == 0, stderr
    _reset_peak_rss(pid)
    node_before_kib = _rss_kib(pid)
    started = time.monotonic()
    output = tmp_path / "rows.json"
    with output.open("wb") as sink:
        code, stderr, client_peak_kib = _run_measured(
            [*command, sql, "--param", str(USERS), "--param", str(USERS)], sink, tmp_path / "query.err", 240
        )
    elapsed_s = time.monotonic() - started
    assert code == 0, stderr
    node_peak_kib = _peak_rss_kib(pid)
    with output.open("rb") as written:
        lines = sum(1 for _ in written)
    size_mb = output.stat().st_size / 1e6
    print(
        f"\n1,000,000-row query at {node}: {elapsed_s:.1f} s, {size_mb:.0f} MB of JSON; "
        f"node RSS {node_before_kib // 1024} MiB before, peak {node_peak_kib // 1024} MiB; "
        f"client peak {client_peak_kib // 1024} MiB "
        f"(`SELECT 1`: {client_baseline_kib // 1024} MiB)"
    )
    assert lines == USERS * USERS  # one row per line (the first line also holds the header)
    assert size_mb > 100
    # Memory does not grow with the result: far below the 130 MB of values, on both sides.
    assert node_peak_kib - node_before_kib < 64 * 1024
    assert client_peak_kib - client_baseline_kib < 64 * 1024


def test_the_client_measure_is_the_one_process_not_the_largest_child_reaped(tmp_path: Path) -> None:
    # A large child first: RUSAGE_CHILDREN would report its 200 MiB for every later child too.
    big = [sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])"]
    code, stderr, big_kib = _run_measured(big, subprocess.DEVNULL, tmp_path / "big.err", 60)
    assert code == 0, stderr
    assert big_kib >= 200 * 1024
    code, stderr, small_kib = _run_measured([sys.executable, "-c", "pass"], subprocess.DEVNULL, tmp_path / "s.err", 60)
    assert code == 0, stderr
    assert small_kib < 64 * 1024  # this process image alone, not pytest's size at the fork
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    code, _, _ = _run_measured(failing, subprocess.DEVNULL, tmp_path / "e.err", 60)
    assert code == 3
    code, _, cli_kib = _run_measured(
        [sys.executable, "-m", "mnesite.cli", "--help"], subprocess.DEVNULL, tmp_path / "h.err", 60
    )
    assert code == 0 and 0 < cli_kib < 200 * 1024
