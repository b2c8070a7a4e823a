"""``benchmarks/floor_node.py``: the floor's answer means what bench_peers says it means.

floor-3 is the baseline that mnesite-3's replication is measured against: if its leader answered
before a follower had the write on disk, the floor would be lower than any replicated write can be,
and every ratio against it would flatter the floor.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import apsw
import pytest
import zmq

from tests.conftest import REPO, free_port, load_benchmark, wait_until

pytestmark = pytest.mark.timeout(60)

SCRIPT = REPO / "benchmarks" / "floor_node.py"


def start(role: list[str], port: int, database: Path) -> subprocess.Popen:
    command = [sys.executable, str(SCRIPT), *role, "--port", str(port), "--db", str(database)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stored(database: Path) -> set[bytes]:
    """``rows``, or none before the node created its database."""
    try:
        return rows(database)
    except apsw.Error:
        return set()


def rows(database: Path) -> set[bytes]:
    connection = apsw.Connection(str(database), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return {key for (key,) in connection.execute("SELECT key FROM kv")}
    finally:
        connection.close()


@contextlib.contextmanager
def floor_run() -> Iterator[tuple[list[subprocess.Popen], Callable[[int], zmq.Socket]]]:
    """A list to put the floor processes a test starts in, and a DEALER connected to a port; at exit every
    process is killed and zmq closed, also when the test fails."""
    processes: list[subprocess.Popen] = []
    context = zmq.Context()

    def dealer(port: int) -> zmq.Socket:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{port}")
        return socket

    try:
        yield processes, dealer
    finally:
        context.destroy(linger=0)
        for process in processes:
            process.kill()
            process.wait(10)


def test_the_leader_answers_only_once_a_follower_has_the_write_on_disk(tmp_path: Path) -> None:
    leader_port, follower_port, absent_port = free_port(), free_port(), free_port()
    with floor_run() as (processes, dealer):
        processes.append(
            start(["--role", "leader", "--peers", f"{follower_port},{absent_port}"], leader_port, tmp_path / "l.db")
        )
        client = dealer(leader_port)
        client.send_multipart([b"k1", b"v" * 100])
        # No follower runs: the leader has the write on its own disk only, and must not answer (an
        # answer that did not wait for a follower would come within a few milliseconds of that write).
        wait_until(lambda: stored(tmp_path / "l.db") == {b"k1"}, 10, "the leader to store the write")
        assert client.poll(300) == 0
        processes.append(start(["--role", "follower", "--leader", str(leader_port)], follower_port, tmp_path / "f.db"))
        # The follower receives the append its DEALER queued (zmq reconnects), stores it, acknowledges.
        assert client.poll(30_000) == zmq.POLLIN
        assert client.recv_multipart() == [b"ok"]
        assert rows(tmp_path / "f.db") == {b"k1"}
        for number in range(20):
            client.send_multipart([b"k%d" % (number + 2), b"v"])
            assert client.poll(10_000) == zmq.POLLIN
            assert client.recv_multipart() == [b"ok"]
        expected = {b"k%d" % n for n in range(1, 22)}
        assert rows(tmp_path / "l.db") == expected
        assert rows(tmp_path / "f.db") == expected


def test_the_second_follower_is_fed_lazily_and_its_acknowledgement_counts(tmp_path: Path) -> None:
    """floor-3 mirrors mnesite's thrifty replication: the leader sends each turn to its first follower
    and feeds the second what accumulated every ``--lazy-feed-ms``. With the first follower absent, a
    write is answered only once the lazy feed reached the second one and it acknowledged: the feed
    happens, and it carries every write since the last."""
    leader_port, absent_port, lazy_port = free_port(), free_port(), free_port()
    with floor_run() as (processes, dealer):
        processes.append(start(["--role", "follower", "--leader", str(leader_port)], lazy_port, tmp_path / "f.db"))
        leader = ["--role", "leader", "--peers", f"{absent_port},{lazy_port}", "--lazy-feed-ms", "50"]
        processes.append(start(leader, leader_port, tmp_path / "l.db"))
        client = dealer(leader_port)
        for number in range(5):
            client.send_multipart([b"k%d" % number, b"v"])
        answers = 0
        while answers < 5:
            assert client.poll(30_000) == zmq.POLLIN, f"{answers} of 5 writes answered"
            assert client.recv_multipart() == [b"ok"]
            answers += 1
        assert rows(tmp_path / "f.db") == {b"k%d" % n for n in range(5)}


def test_a_logged_floor_keeps_a_log_row_and_a_digest_chain_per_write(tmp_path: Path) -> None:
    """``--log``: each write is also a log row (its position, its key as the request id, the chained
    digest), continued across a restart from the last row on disk."""
    import hashlib

    port = free_port()
    database = tmp_path / "s.db"
    context = zmq.Context()
    try:
        for run in range(2):
            process = start(["--role", "single", "--log"], port, database)
            try:
                client = context.socket(zmq.DEALER)
                client.setsockopt(zmq.LINGER, 0)
                client.connect(f"tcp://127.0.0.1:{port}")
                for number in range(3):
                    client.send_multipart([b"r%d-%d" % (run, number), b"v%d" % number])
                    assert client.poll(30_000) == zmq.POLLIN
                    assert client.recv_multipart() == [b"ok"]
                client.close()
            finally:
                process.kill()
                process.wait(10)
    finally:
        context.destroy(linger=0)
    connection = apsw.Connection(str(database), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        logged = list(connection.execute("SELECT position, request_id, digest, value FROM log ORDER BY position"))
    finally:
        connection.close()
    assert [row[0] for row in logged] == [1, 2, 3, 4, 5, 6]
    digest = bytes(32)
    for _, key, stored_digest, value in logged:
        digest = hashlib.blake2b(digest + key + value, digest_size=32).digest()
        assert stored_digest == digest
    assert [row[1] for row in logged] == [b"r0-0", b"r0-1", b"r0-2", b"r1-0", b"r1-1", b"r1-2"]


@pytest.fixture
def single(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, zmq.Socket]]:
    """A floor-1 node and a client's DEALER connected to it; both stopped after the test."""
    port = free_port()
    process = start(["--role", "single"], port, tmp_path / "s.db")
    context = zmq.Context()
    try:
        client = context.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(f"tcp://127.0.0.1:{port}")
        yield process, client
    finally:
        context.destroy(linger=0)
        process.kill()
        process.wait(10)


def test_the_single_node_answers_after_its_commit(tmp_path: Path, single) -> None:
    _, client = single
    client.send_multipart([b"only", b"value"])
    assert client.poll(30_000) == zmq.POLLIN
    assert client.recv_multipart() == [b"ok"]
    assert rows(tmp_path / "s.db") == {b"only"}


def test_a_leader_without_two_followers_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--role", "leader", "--port", "1", "--db", str(tmp_path / "x.db")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "two followers" in result.stderr


def test_bench_peers_reads_each_line_of_issue_21_per_round_against_its_target() -> None:
    """``bench_peers.acceptance_lines``: the same-round ratios the closing notes quote, and whether each
    round met the issue's bound (at least for rates, at most for latency and CPU)."""
    bench_peers = load_benchmark("bench_peers")

    def point(writes: float, p50: float, cpu: float | None) -> dict:
        return {"writes_per_s": writes, "p50_ms": p50, "cpu_us_per_write_sum": cpu}

    runs = {
        ("mnesite-3", 64): [point(4000, 15, 200), point(3000, 15, 260)],
        ("mnesite-1", 64): [point(5000, 9, 100), point(5000, 9, 100)],
        ("redis", 64): [point(5000, 7, 90), point(4000, 7, 90)],
        ("mnesite-3-baseline", 64): [point(2000, 25, 400), point(2000, 25, 500)],
        ("mnesite-3", 1): [point(500, 1.5, 2000), point(500, 1.9, 2000)],
        ("mnesite-1", 1): [point(1200, 0.75, 500), point(1200, 0.75, 500)],
        ("etcd", 1): [point(600, 1.6, 1800)],  # one round only: no same-round line
        ("floor-3", 64): [point(5500, 10, None), point(5000, 10, None)],
    }
    lines = {(line["line"], line["clients"]): line for line in bench_peers.acceptance_lines(runs)}
    redis = lines[("3 cores / Redis, writes/s", 64)]
    assert redis["per_round"] == [0.8, 0.75] and redis["rounds_met"] == 2 and redis["target"] == "at least 0.6x"
    single = lines[("3 cores / single core, writes/s", 64)]
    assert single["per_round"] == [0.8, 0.6] and single["rounds_met"] == 1
    latency = lines[("3 cores / single core, p50", 1)]
    assert latency["per_round"] == [2.0, 2.533] and latency["rounds_met"] == 1 and latency["target"] == "at most 2x"
    cpu = lines[("3 cores / the tree before, summed CPU a write", 64)]
    assert cpu["per_round"] == [0.5, 0.52] and cpu["rounds_met"] == 1
    floor = lines[("floor-3 / single core, writes/s", 64)]
    assert floor["per_round"] == [1.1, 1.0] and "target" not in floor
    assert ("3 cores / etcd, p50", 1) not in lines
    assert ("floor-3 / single core, p50", 1) not in lines  # floor-3 did not run at 1 client


def test_bench_peers_models_what_the_single_core_line_asks_of_the_cores_cpu() -> None:
    """``bench_peers.single_core_line_needs``: per round, the summed CPU a write at which mnesite-3 would
    reach 0.75x the single core's writes/s with the machine as busy and the rest of its CPU a write as
    it was (writes/s = busy CPUs / the machine's CPU a write)."""
    bench_peers = load_benchmark("bench_peers")

    def point(writes: float, cpu: float, machine: float | None, busy: float | None, per_process=None) -> dict:
        return {
            "writes_per_s": writes,
            "cpu_us_per_write_sum": cpu,
            "cpu_us_per_write": per_process or [cpu],
            "machine_cpu_us_per_write": machine,
            "cpus_busy": busy,
        }

    runs = {
        # 1.8 CPUs / (0.75 * 9,000 writes/s) = 266.7 us a write for the machine, of which 140 are not the cores'.
        ("mnesite-3", 64): [point(5000, 220, 360, 1.8), point(5000, 220, None, None)],
        ("mnesite-1", 64): [point(9000, 90, 200, 1.8), point(9000, 90, 200, 1.8)],
        ("floor-3", 64): [point(8000, 110, 220, 1.7, [60, 25, 25]), point(8000, 110, 220, 1.7, [60, 25, 25])],
    }
    needs = bench_peers.single_core_line_needs(runs)
    assert len(needs) == 1  # the second round has no machine figures: left out, not guessed
    assert needs[0]["needed_cpu_us_per_write_sum"] == 126.7
    assert needs[0]["rest_cpu_us_per_write"] == 140 and needs[0]["mnesite_3_cpu_us_per_write_sum"] == 220
    assert needs[0]["floor_3_cpu_us_per_write"] == [60, 25, 25]
    assert "floor_3_plus_single_work_us" not in needs[0]  # floor-1 did not run: no sum of parts
    assert "needed_with_single_load_us" not in needs[0]  # no load generator figures: nothing guessed
    runs[("mnesite-3", 64)][0]["load_cpu_us_per_write"] = 90
    runs[("mnesite-1", 64)][0]["load_cpu_us_per_write"] = 70
    # The load generator 20 us a write cheaper beside the three cores: 20 us more for the cores.
    assert bench_peers.single_core_line_needs(runs)[0]["needed_with_single_load_us"] == 146.7
    assert bench_peers.single_core_line_needs({("mnesite-3", 64): runs[("mnesite-3", 64)]}) == []
    # With floor-1 in the same rounds: floor-3's 110 plus the single core's 90 over floor-1's 35.
    runs[("floor-1", 64)] = [point(15000, 35, 90, 1.7), point(15000, 35, 90, 1.7)]
    [need] = bench_peers.single_core_line_needs(runs)
    assert need["floor_3_plus_single_work_us"] == 165
    assert "floor_3_log_plus_single_work_us" not in need
    # The floors that keep a log: floor-3-log's 130 plus the single core's 90 over floor-1-log's 45.
    runs[("floor-3-log", 64)] = [point(7000, 130, 240, 1.7), point(7000, 130, 240, 1.7)]
    runs[("floor-1-log", 64)] = [point(13000, 45, 100, 1.7), point(13000, 45, 100, 1.7)]
    [need] = bench_peers.single_core_line_needs(runs)
    assert need["floor_3_plus_single_work_us"] == 165 and need["floor_3_log_plus_single_work_us"] == 175


def test_bench_peers_sets_the_one_client_line_beside_the_floor_plus_the_single_cores_work() -> None:
    """``bench_peers.one_client_line_needs``: per round, 2x the single core's p50, mnesite-3's, and floor-3's
    plus what the single core's own work adds to floor-1's; nothing unless all four ran in every round."""
    bench_peers = load_benchmark("bench_peers")
    runs = {
        ("mnesite-3", 1): [{"p50_ms": 1.3}, {"p50_ms": 1.2}],
        ("mnesite-1", 1): [{"p50_ms": 0.55}, {"p50_ms": 0.5}],
        ("floor-3", 1): [{"p50_ms": 0.6}, {"p50_ms": 0.65}],
        ("floor-1", 1): [{"p50_ms": 0.3}, {"p50_ms": 0.25}],
    }
    needs = bench_peers.one_client_line_needs(runs)
    assert [n["allowed_p50_ms"] for n in needs] == [1.1, 1.0]
    assert [n["mnesite_3_p50_ms"] for n in needs] == [1.3, 1.2]
    assert [n["floor_3_plus_single_work_ms"] for n in needs] == [0.85, 0.9]
    runs[("floor-1", 1)] = runs[("floor-1", 1)][:1]
    assert bench_peers.one_client_line_needs(runs) == []


def test_the_floor_drops_frames_that_are_not_its_own_and_keeps_answering(tmp_path: Path, single) -> None:
    process, client = single
    for junk in ([b"one part"], [b"a", b"b", b"c"], [b"ack", b"x"]):
        client.send_multipart(junk)
    client.send_multipart([b"after", b"junk"])
    assert client.poll(30_000) == zmq.POLLIN
    assert client.recv_multipart() == [b"ok"]
    assert rows(tmp_path / "s.db") == {b"after"}
    assert process.poll() is None


def test_a_client_pool_moves_its_load_slice_by_slice_with_a_fresh_key_per_write(tmp_path: Path) -> None:
    """``bench_peers.measure_point``: the clients keep their connections from slice to slice, every write
    is acknowledged under a key never written before (the floor replaces a key written twice), and the
    CPU of the system's processes is counted over its slices."""
    bench_peers = load_benchmark("bench_peers")
    system = bench_peers.Floor(tmp_path, 1)
    pool = None
    try:
        system.start()
        pool = bench_peers.ClientPool({system.name: system.spec}, 3)
        results = [bench_peers.measure_point([system], pool, 0.6, 3)[system.name] for _ in range(2)]
    finally:
        if pool is not None:
            pool.close()
        system.stop()
    assert [result["errors"] for result in results] == [[], []]
    assert all(result["writes"] > 0 and result["cpu_us_per_write_sum"] > 0 for result in results)
    # The load generator's processes and the whole machine were counted over the same slices: the
    # machine's CPU a write holds at least the server's and the load generator's.
    for result in results:
        assert result["load_cpu_us_per_write"] > 0 and 0 < result["cpus_busy"] <= (os.cpu_count() or 1) + 0.1
        # /proc/stat samples the CPUs at each tick while a process's time is counted as it runs: over
        # this point's 1.2 s the machine's figure can read 10% low (seen once in about 10 runs at 0.9x).
        counted = result["cpu_us_per_write_sum"] + result["load_cpu_us_per_write"]
        assert result["machine_cpu_us_per_write"] >= 0.7 * counted
    # Six slices over two points, three clients: one row per write, plus the write that found the node ready.
    assert len(rows(tmp_path / "floor0" / "kv.db")) == sum(result["writes"] for result in results) + 1


@pytest.mark.parametrize("benchmark", ["bench_peers", "bench_catchup"])
def test_a_process_cpu_time_is_counted_below_a_clock_tick(benchmark: str) -> None:
    """``cpu_seconds`` (``bench_commit``, which both benchmarks that count a process's CPU use) reads it to
    the microsecond: on a loaded machine a load generator process can use less than a 10 ms clock tick in
    a slice (``/proc/PID/stat``'s unit), and a slice counted none of its CPU (``load_cpu_us_per_write``
    read 0). ``bench_catchup`` counted the cores' and replicants' CPU in ticks until the twenty-first
    session."""
    module = load_benchmark(benchmark)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print(time.process_time(), flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        reported = float(child.stdout.readline())  # the child now waits on its stdin, using no CPU
        [counted] = module.cpu_seconds([child])
        # Clock ticks truncate: the child's time read in ticks is below what it reported itself.
        assert reported <= counted < reported + 0.05
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_client_pool_that_cannot_connect_says_why() -> None:
    bench_peers = load_benchmark("bench_peers")
    with pytest.raises(RuntimeError, match="could not connect: KeyError"):
        bench_peers.ClientPool({"nothing": {"kind": "no such kind"}}, 2)
