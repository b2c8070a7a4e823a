"""Commit throughput and latency of a single core, beside raw apsw measured in the same run.

    .venv/bin/python benchmarks/bench_commit.py [--seconds 5] [--clients 1,16,64] [--synchronous FULL]
        [--security off|on|both] [--repeat N] [--json]

* Baseline: raw apsw on the same disk, WAL mode, the same ``synchronous`` level, one row per
  transaction (BEGIN; INSERT; COMMIT), one writer: the machine's durable-commit limit.
* mnesite single core: a real ``mnesite start`` process; N concurrent clients (threads spread over up to
  four client processes, so the client side's GIL is not the bottleneck) each put one row per
  transaction for ``--seconds``; every put is a full round trip and waits for its commit.

* mnesite 3 cores: three real core processes on 127.0.0.1 (a quorum of two must persist every
  entry before it commits); the clients talk to the elected sequencer.
* ``--security on`` / ``both`` (the default): the same runs with ``[security]`` (CurveZMQ on every
  socket, ZAP, roles); the clients use an admin key. ``both`` measures off and on in the same run
  and reports the ratio of each secured run to the same run without security. The two clusters run
  side by side and are measured alternately, ``--repeat`` times each (the median is reported).

Reports commits/s, p50/p99 latency in ms and the ratio to the baseline. Not a test: it
asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mnesite.rlog.client import Client  # noqa: E402

CLIENT_PROCESSES_MAX = 4
SECURE_SUFFIX = ", CurveZMQ"


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, int(fraction * len(sorted_values)))
    return sorted_values[index]


def summarise(name: str, clients: int, count: int, seconds: float, latencies_ms: list[float]) -> dict:
    latencies_ms.sort()
    return {
        "name": name,
        "clients": clients,
        "commits": count,
        "seconds": round(seconds, 3),
        "commits_per_s": round(count / seconds, 1),
        "p50_ms": round(percentile(latencies_ms, 0.50), 3),
        "p99_ms": round(percentile(latencies_ms, 0.99), 3),
    }


def bench_raw_apsw(directory: Path, seconds: float, synchronous: str) -> dict:
    import apsw

    connection = apsw.Connection(str(directory / "raw.db"))
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA synchronous={synchronous}")
    connection.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, payload TEXT) STRICT")
    latencies = []
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    i = 0
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("INSERT INTO t VALUES (?, ?)", (i, "x" * 100))
        connection.execute("COMMIT")
        latencies.append((time.perf_counter() - began) * 1000)
        i += 1
    elapsed = time.perf_counter() - start
    connection.close()
    return summarise("raw apsw (1 writer)", 1, i, elapsed, latencies)


Writer = tuple[Callable[[str], None], Callable[[], None]]


def run_writers(make_writer: Callable[[int], Writer], threads: int, worker: int, seconds: float) -> tuple:
    """``threads`` threads of client process ``worker``, each writing with its own
    ``make_writer(thread)`` (a ``write(key)`` and a ``close``) for ``seconds``; returns the writes
    acknowledged, their latencies in ms and the errors that ended a thread (one per such thread)."""
    import threading

    latencies: list[float] = []
    counts = [0] * threads
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def run(thread: int) -> None:
        own: list[float] = []
        i = 0
        close: Callable[[], None] | None = None
        try:
            write, close = make_writer(thread)
            while time.perf_counter() < deadline:
                began = time.perf_counter()
                write(f"bench/{worker}/{thread}/{i}")
                own.append((time.perf_counter() - began) * 1000)
                i += 1
        except Exception as error:  # a failing system ends this client; the report says so
            with lock:
                errors.append(f"{type(error).__name__}: {error}")
        finally:
            if close is not None:
                close()
        with lock:
            latencies.extend(own)
            counts[thread] = i

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return sum(counts), latencies, errors


def _client_process(endpoint: str, threads: int, worker: int, seconds: float, keys: dict, queue) -> None:
    def make_writer(thread: int) -> Writer:
        client = Client(endpoint, timeout_ms=30_000, **keys)
        ids = itertools.count((worker * 1000 + thread) * 10_000_000)

        def write(key: str) -> None:
            client.put("bench", {"id": next(ids), "payload": "x" * 100})

        return write, client.close

    count, latencies, errors = run_writers(make_writer, threads, worker, seconds)
    for error in errors:
        print(f"client error: {error}", file=sys.stderr)
    queue.put((count, latencies))


def bench_node(endpoint: str, clients: int, seconds: float, name: str, keys: dict) -> dict:
    processes = min(clients, CLIENT_PROCESSES_MAX)
    per_process = [clients // processes + (1 if p < clients % processes else 0) for p in range(processes)]
    queue = multiprocessing.get_context("spawn").Queue()
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=_client_process, args=(endpoint, threads, p, seconds, keys, queue))
        for p, threads in enumerate(per_process)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=seconds + 120) for _ in workers]
    for worker in workers:
        worker.join(30)
    count = sum(r[0] for r in results)
    latencies = [x for r in results for x in r[1]]
    # Every client process measures the same window of `seconds` from its own start.
    return summarise(name, clients, count, seconds, latencies)


def wait_listening(endpoints: list[str], timeout_s: float = 30.0, process: object | None = None) -> None:
    """Wait until every ``tcp://host:port`` endpoint accepts TCP connections (a node just started).

    The client fails fast on a refused connection (it tells a user at once that nothing listens), so a
    benchmark that starts its own nodes waits for their sockets first, with a deadline."""
    import socket

    deadline = time.monotonic() + timeout_s
    for endpoint in endpoints:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    break
            except OSError:
                if time.monotonic() >= deadline:
                    raise SystemExit(f"{endpoint} did not accept connections within {timeout_s} s") from None
                time.sleep(0.05)


def free_endpoint() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def make_keys(directory: Path, cores: int) -> dict:
    """Key pairs for the cluster, every core and the bench client (admin); the client's Client kwargs."""
    from mnesite.rlog.security import generate_keys

    keys, authorized = directory / "keys", directory / "authorized"
    authorized.mkdir(exist_ok=True)
    for name in ["cluster", "bench", *[f"core{i}" for i in range(1, cores + 1)]]:
        if not (keys / f"{name}.key").exists():
            generate_keys(name, str(keys))
            shutil.copy(keys / f"{name}.key", authorized)
    return {"key": str(keys / "bench.key_secret"), "server_key": str(keys / "cluster.key")}


def security_toml(directory: Path, name: str, cores: int) -> str:
    core_names = ", ".join(f'"core{i}"' for i in range(1, cores + 1))
    return (
        f'[security]\nserver_key = "{directory / "keys" / "cluster.key_secret"}"\n'
        f'client_key = "{directory / "keys" / f"{name}.key_secret"}"\n'
        f'authorized_keys = "{directory / "authorized"}"\n'
        f'[security.roles]\ncore = [{core_names}]\nadmin = ["bench"]\n'
    )


def start_nodes(
    directory: Path,
    synchronous: str,
    cores: int,
    secure: bool,
    pythonpath: str = str(REPO),
    launcher: tuple[str, ...] = ("-m", "mnesite.cli"),
    environment: dict[str, str] | None = None,
) -> tuple[list[subprocess.Popen], str, dict]:
    """Start ``cores`` core processes; create the bench table; return them, the sequencer's endpoint
    and the client's key arguments. ``pythonpath``: where the cores import ``mnesite`` from (another
    version's package directory, to measure a baseline in the same run). ``launcher``: what Python
    runs, given the CLI's arguments (``trace_write.py`` runs its tracing hook); ``environment``: more
    variables for the cores (``{name}`` in a value becomes the core's name)."""
    endpoints = {f"core{i}": free_endpoint() for i in range(1, cores + 1)}
    core_nodes = ", ".join(f'{name} = "{endpoint}"' for name, endpoint in endpoints.items())
    keys = make_keys(directory, cores) if secure else {}
    label = f"{cores}{'-secure' if secure else ''}"
    processes = []
    for name, endpoint in endpoints.items():
        config = directory / f"{label}-{name}.toml"
        config.write_text(
            f'[node]\nname = "{name}"\ndata_dir = "{directory / f"{label}-{name}"}"\nlisten = "{endpoint}"\n'
            f"[cluster]\ncore_nodes = {{ {core_nodes} }}\n"
            f'[storage]\nsynchronous = "{synchronous}"\n' + (security_toml(directory, name, cores) if secure else "")
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, *launcher, "start", "--config", str(config), "--log-level", "WARNING"],
                # ``python -m`` puts the working directory first on sys.path: in the repository
                # that is its own ``mnesite`` package, which would shadow a baseline's PYTHONPATH.
                cwd=REPO if pythonpath == str(REPO) else pythonpath,
                env=dict(
                    os.environ,
                    PYTHONPATH=pythonpath,
                    **{key: value.format(name=name) for key, value in (environment or {}).items()},
                ),
                start_new_session=True,
                stderr=subprocess.DEVNULL,
            )
        )
    wait_listening(list(endpoints.values()))
    first = next(iter(endpoints.values()))
    with Client(first, timeout_ms=2000, retries=15, **keys) as client:
        client.create_table("bench", "id", [("id", "INTEGER"), ("payload", "TEXT")])
    for endpoint in endpoints.values():
        with Client(endpoint, timeout_ms=2000, **keys) as client:
            if client.status()["shards"]["default"]["role"] == "sequencer":
                # The sequencer's process first (bench_peers reports CPU per process in this order).
                index = list(endpoints.values()).index(endpoint)
                processes.insert(0, processes.pop(index))
                return processes, endpoint, keys
    raise SystemExit("no sequencer after the table was created")


def stop_nodes(processes: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """Stop what ``start_nodes`` started: SIGTERM to each node's process group (each runs in a session
    of its own), then wait for every one."""
    for process in processes:
        os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        process.wait(timeout_s)


def cpu_seconds(processes: Sequence[subprocess.Popen | multiprocessing.Process]) -> list[float]:
    """CPU time (user + system, every thread) each process (a server's, or a load generator's) has used
    so far, read from the process's CPU clock in nanoseconds. ``/proc/PID/stat`` gives the same time
    truncated to clock ticks (10 ms): on a loaded machine a load generator process can use less than a
    tick in a slice, and a slice then counted none of its CPU."""
    used = []
    for process in processes:
        try:
            used.append(time.clock_gettime(_process_cpu_clock(process.pid)))
        except (OSError, OverflowError):
            used.append(0.0)
    return used


def _process_cpu_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (all its threads), as glibc's ``clock_getcpuclockid``
    makes it: Linux encodes ``~pid << 3`` with ``CPUCLOCK_SCHED`` (2), and lets any process read it."""
    return (~pid << 3) | 2


def machine() -> str:
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {memory_gib:.0f} GiB, {platform.machine()}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--synchronous", default="FULL", choices=["OFF", "NORMAL", "FULL", "EXTRA"])
    parser.add_argument("--security", default="both", choices=["off", "on", "both"])
    parser.add_argument("--repeat", type=int, default=1, help="Runs per setting (alternating modes); median kept.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="mnesite-bench-"))
    results = []
    try:
        baseline = bench_raw_apsw(directory, args.seconds, args.synchronous)
        results.append(baseline)
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.security]
        for cores, name in ((1, "mnesite single core"), (3, "mnesite 3 cores")):
            # Both clusters run side by side and are measured alternately, each pair repeated, so a
            # machine whose load drifts during the run biases neither mode (the median is reported).
            clusters = {secure: start_nodes(directory, args.synchronous, cores, secure) for secure in modes}
            try:
                for clients in [int(c) for c in args.clients.split(",")]:
                    samples: dict[bool, list[dict]] = {secure: [] for secure in modes}
                    for _ in range(args.repeat):
                        for secure, (_, endpoint, keys) in clusters.items():
                            run_name = f"{name}{SECURE_SUFFIX if secure else ''}"
                            samples[secure].append(bench_node(endpoint, clients, args.seconds, run_name, keys))
                    for runs in samples.values():
                        runs.sort(key=lambda r: r["commits_per_s"])
                        median = dict(runs[len(runs) // 2])
                        median["commits_per_s_runs"] = [r["commits_per_s"] for r in runs]
                        results.append(median)
            finally:
                for processes, _, _ in clusters.values():
                    stop_nodes(processes, timeout_s=30)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    by_run = {(r["name"], r["clients"]): r for r in results}
    for result in results:
        result["ratio_to_raw_apsw"] = round(result["commits_per_s"] / baseline["commits_per_s"], 3)
        secure = result["name"].endswith(SECURE_SUFFIX)
        plain_name = result["name"].removesuffix(SECURE_SUFFIX)
        single = by_run.get(("mnesite single core" + (SECURE_SUFFIX if secure else ""), result["clients"]))
        if plain_name == "mnesite 3 cores" and single is not None:
            result["ratio_to_single_core"] = round(result["commits_per_s"] / single["commits_per_s"], 3)
        insecure = by_run.get((plain_name, result["clients"]))
        if secure and insecure is not None:
            result["ratio_to_insecure"] = round(result["commits_per_s"] / insecure["commits_per_s"], 3)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "synchronous": args.synchronous,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['date']}, {report['machine']}, synchronous={args.synchronous}, {args.seconds:g} s per run")
    print(f"| {'run':<32} | clients | commits/s | p50 ms | p99 ms | vs raw apsw | vs single core | vs insecure |")
    print(f"|{'-' * 34}|---------|-----------|--------|--------|-------------|----------------|-------------|")
    for r in results:
        print(
            f"| {r['name']:<32} | {r['clients']:>7} | {r['commits_per_s']:>9} | {r['p50_ms']:>6} | {r['p99_ms']:>6} "
            f"| {r['ratio_to_raw_apsw']:>11} | {r.get('ratio_to_single_core', ''):>14} "
            f"| {r.get('ratio_to_insecure', ''):>11} |"
        )


if __name__ == "__main__":
    main()
