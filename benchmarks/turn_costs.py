"""A write's CPU by core and thread, and the loop turns it costs, at each client count.

    .venv/bin/python benchmarks/turn_costs.py [--cores 3] [--clients 1,8,64] [--seconds 8] [--json]

For each client count: starts the cores (``bench_commit.start_nodes``), drives the clients at the
sequencer (one 100-byte row per transaction, as ``bench_peers``), and over the middle half of the run
reads each core's threads from ``/proc`` (user and system CPU, voluntary and involuntary context
switches) and each core's ``status`` (its commits, the shard's applied key). Reports, per core and
per thread, the CPU each write costs, and per core the commits (one a loop turn that wrote) and
context switches each write costs, with the whole machine's CPU in use over the same window.

What it shows (``benchmarks/PROFILE.md``): how much of a write's CPU is a turn's fixed cost, paid
again by every turn however few writes it carries, against what each write adds; with two client
counts above one, it fits both per role (``turn_and_write_costs``). Not a test: the
figures depend on the machine and its load; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import bench_node, machine, start_nodes, stop_nodes  # noqa: E402
from mnesite.rlog.client import Client  # noqa: E402

TICKS_S = os.sysconf("SC_CLK_TCK")
_SWITCHES = re.compile(r"^(voluntary|nonvoluntary)_ctxt_switches:\s+(\d+)$", re.MULTILINE)


@dataclass(frozen=True)
class ThreadSample:
    name: str
    user_s: float
    system_s: float
    voluntary: int
    involuntary: int


@dataclass(frozen=True)
class CoreSample:
    """One core's threads (by thread id) and status figures at one instant."""

    threads: dict[int, ThreadSample]
    role: str
    commits: int
    applied_counter: int


def read_threads(pid: int) -> dict[int, ThreadSample]:
    """The threads of process ``pid`` now (a thread that ends while it is read is left out)."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        switches = dict((kind, int(count)) for kind, count in _SWITCHES.findall(status))
        threads[int(tid)] = ThreadSample(
            name, int(fields[11]) / TICKS_S, int(fields[12]) / TICKS_S, switches["voluntary"], switches["nonvoluntary"]
        )
    return threads


def machine_busy_s() -> float:
    """CPU seconds the machine's CPUs ran something since boot (``/proc/stat``: user, nice, system, irq
    and softirq; not idle, iowait, or steal, the hypervisor's time given to other machines)."""
    user, nice, system, _idle, _iowait, irq, softirq = (
        int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]
    )
    return (user + nice + system + irq + softirq) / TICKS_S


def per_write(before: dict[str, CoreSample], after: dict[str, CoreSample], writes: int) -> list[dict[str, Any]]:
    """Each core's CPU per write by thread (us), and its commits and context switches per write,
    between two samples; a thread that used under half a microsecond a write is left out of the CPU."""
    if writes <= 0:
        raise ValueError("no write was applied between the two samples")
    rows = []
    for name in sorted(after):
        start, end = before[name], after[name]
        threads = []
        switches = 0
        for tid, thread in end.threads.items():
            first = start.threads.get(tid)
            if first is None:
                continue  # started in between: its CPU is not all in the window
            user_us = (thread.user_s - first.user_s) * 1e6 / writes
            system_us = (thread.system_s - first.system_s) * 1e6 / writes
            switches += (thread.voluntary - first.voluntary) + (thread.involuntary - first.involuntary)
            if user_us + system_us >= 0.5:  # a thread that did nothing in the window (a query worker)
                threads.append({"thread": thread.name, "user_us": round(user_us, 1), "system_us": round(system_us, 1)})
        rows.append(
            {
                "core": name,
                "role": end.role,
                "cpu_us": round(sum(t["user_us"] + t["system_us"] for t in threads), 1),
                "commits": round((end.commits - start.commits) / writes, 3),
                "switches": round(switches / writes, 3),
                "threads": sorted(threads, key=lambda t: -(t["user_us"] + t["system_us"])),
            }
        )
    return rows


def turn_and_write_costs(reports: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per role, a core's CPU per write as a cost per committing turn times its commits per write,
    plus a cost per write: a least-squares line through the cores of that role in every run with more
    than one client. A one-client run is left out: its turns that commit nothing (heartbeats, commit
    notices) weigh on each commit there. A role needs runs at two client counts or more: the cores of one
    run differ in commit rate by chance, not by load."""
    points: dict[str, list[tuple[float, float]]] = {}
    client_counts: dict[str, set[int]] = {}
    for report in reports:
        if report["clients"] > 1:
            for row in report["per_write"]:
                points.setdefault(row["role"], []).append((row["commits"], row["cpu_us"]))
                client_counts.setdefault(row["role"], set()).add(report["clients"])
    fits = {}
    for role, pairs in sorted(points.items()):
        commits, cpu = [c for c, _ in pairs], [u for _, u in pairs]
        if len(client_counts[role]) < 2 or len(set(commits)) < 2:
            continue
        per_turn, per_write = statistics.linear_regression(commits, cpu)
        fits[role] = {"per_turn_us": round(per_turn), "per_write_us": round(per_write, 1), "points": len(pairs)}
    return fits


def sample(cores: dict[str, tuple[Any, str]]) -> dict[str, CoreSample]:
    """Each core's threads and status now (``cores``: name -> its process and endpoint)."""
    samples = {}
    for name, (process, endpoint) in cores.items():
        threads = read_threads(process.pid)
        with Client(endpoint, timeout_ms=5000) as client:
            status = client.status()
        shard = status["shards"].get("default", {})
        samples[name] = CoreSample(threads, shard.get("role", "?"), status["commits"], shard.get("applied", [0, 0])[1])
    return samples


def _config_value(config: str, key: str) -> str:
    return re.search(rf'^{key} = "([^"]+)"', config, re.MULTILINE).group(1)


def measure(cores: int, clients: int, seconds: float) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="mnesite-turns-"))
    processes, endpoint, keys = start_nodes(directory, "FULL", cores, False)
    try:
        by_name = {}  # each core's name and endpoint, from the config its process was started with
        for process in processes:
            config = Path(process.args[process.args.index("--config") + 1]).read_text()
            by_name[_config_value(config, "name")] = (process, _config_value(config, "listen"))
        result: dict[str, Any] = {}
        load = threading.Thread(target=lambda: result.update(bench_node(endpoint, clients, seconds, "x", keys)))
        load.start()
        try:
            time.sleep(seconds * 0.25)
            before, busy_before, began = sample(by_name), machine_busy_s(), time.monotonic()
            time.sleep(seconds * 0.5)
            after, busy_after, ended = sample(by_name), machine_busy_s(), time.monotonic()
        finally:
            load.join(seconds + 180)
        sequencer = [name for name, core in after.items() if core.role == "sequencer"]
        if len(sequencer) != 1:
            raise SystemExit(f"expected one sequencer, found {sequencer}")
        writes = after[sequencer[0]].applied_counter - before[sequencer[0]].applied_counter
        return {
            "cores": cores,
            "clients": clients,
            "writes_per_s": round(writes / (ended - began)),
            "p50_ms": result.get("p50_ms"),
            "machine_cpus_busy": round((busy_after - busy_before) / (ended - began), 2),
            "per_write": per_write(before, after, writes),
        }
    finally:
        stop_nodes(processes)
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=3)
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    reports = [measure(args.cores, int(clients), args.seconds) for clients in args.clients.split(",")]
    fits = turn_and_write_costs(reports)
    if args.json:
        print(json.dumps({"machine": machine(), "reports": reports, "fits": fits}, indent=1))
        return
    print(machine())
    for report in reports:
        print(
            f"\n{report['cores']} cores, {report['clients']} client(s): {report['writes_per_s']} writes/s, "
            f"p50 {report['p50_ms']} ms, the machine's CPUs busy {report['machine_cpus_busy']}\n"
        )
        print(
            "| core | role | CPU us a write | commits a write | context switches a write "
            "| by thread (user + system us) |"
        )
        print("| --- | --- | ---: | ---: | ---: | --- |")
        for row in report["per_write"]:
            threads = ", ".join(f"{t['thread']} {t['user_us']:.0f} + {t['system_us']:.0f}" for t in row["threads"])
            print(
                f"| {row['core']} | {row['role']} | {row['cpu_us']:.0f} | {row['commits']:.3f} | "
                f"{row['switches']:.2f} | {threads} |"
            )
    if fits:
        print(
            "\nFitted through the runs with more than one client "
            "(CPU a write = a turn's cost x commits a write + a write's):"
        )
        for role, fit in fits.items():
            print(
                f"* {role}: {fit['per_turn_us']} us of CPU a committing turn, {fit['per_write_us']} us a write "
                f"({fit['points']} points)"
            )


if __name__ == "__main__":
    main()
