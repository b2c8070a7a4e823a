"""A write's CPU by function of each core's loop, per write and per loop turn.

    .venv/bin/python benchmarks/cpu_by_function.py [--cores 3] [--clients 64] [--seconds 8] [--top 20] [--json]

Starts the cores under ``cpu_hook.py`` (``bench_commit.start_nodes``), warms them up with 3 s of
the load, starts the counts again (SIGUSR1), drives ``--clients`` clients at the sequencer for
``--seconds`` (one 100-byte row per transaction, as ``bench_peers``) and stops the cores. For each
core: its loop turns per write, the CPU of a turn, and the wrapped methods (``cpu_hook.WRAPPED``)
that cost most, by their exclusive CPU (without the wrapped calls made inside them; what they call
unwrapped is theirs), per write and per turn, with their calls per turn. ``CoreNode.run_turn``'s
exclusive time is the turn's own body and everything it calls that is not wrapped.

What py-spy cannot give: exact CPU of short methods on the loop's thread, separated from the
waiting (``benchmarks/PROFILE.md``, seventeenth session). Each wrapped call costs about a
microsecond of its own, counted in its method's figures. Not a test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import bench_node, machine, start_nodes, stop_nodes  # noqa: E402

HOOK = Path(__file__).resolve().parent / "cpu_hook.py"
WARM_UP_S = 3.0
# How long the cores may take to write the warm-up's counts after SIGUSR1 (a loop turn each).
RESTART_WAIT_S_MAX = 10.0
TURN = "CoreNode.run_turn"


def core_report(counts: dict[str, dict[str, int]], writes: float, top: int) -> dict[str, Any]:
    """One core's counts (``cpu_hook.Accounting.snapshot``) per write and per turn, costliest first."""
    turns = counts["calls"].get(TURN, 0)
    rows = [
        {
            "function": label,
            "us_per_write": round(spent / writes / 1000, 2) if writes else None,
            "us_per_turn": round(spent / turns / 1000, 1) if turns else None,
            "calls_per_turn": round(counts["calls"][label] / turns, 2) if turns else None,
        }
        for label, spent in sorted(counts["exclusive"].items(), key=lambda item: -item[1])[:top]
    ]
    turn_ns = counts["inclusive"].get(TURN, 0)
    return {
        "turns_per_write": round(turns / writes, 4) if writes else None,
        "us_per_write": round(turn_ns / writes / 1000, 1) if writes else None,
        "us_per_turn": round(turn_ns / turns / 1000, 1) if turns else None,
        "functions": rows,
    }


def core_names(processes: list[Any]) -> list[str]:
    """The core each of ``start_nodes``' processes runs, from its config's name ("3-core1.toml": core1)."""
    configs = [Path(process.args[process.args.index("--config") + 1]) for process in processes]
    return [config.stem.rsplit("-", 1)[-1] for config in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="mnesite-cpu-"))
    try:
        processes, endpoint, keys = start_nodes(
            directory,
            "FULL",
            args.cores,
            False,
            launcher=(str(HOOK),),
            environment={"MNESITE_CPU_OUT": str(directory / "{name}.cpu.json")},
        )
        try:
            bench_node(endpoint, args.clients, WARM_UP_S, "warm-up", keys)
            for process in processes:
                os.kill(process.pid, signal.SIGUSR1)
            # The counts start again before the measured load: each core's next turn writes the
            # warm-up's (cpu_hook.Dumps), the first file its counts make.
            written = [directory / f"{name}.cpu.json" for name in core_names(processes)]
            deadline_s = time.monotonic() + RESTART_WAIT_S_MAX
            while not all(path.exists() for path in written):
                if time.monotonic() > deadline_s:
                    raise SystemExit(f"the cores did not start their counts again within {RESTART_WAIT_S_MAX} s")
                time.sleep(0.01)
            result = bench_node(endpoint, args.clients, args.seconds, f"{args.cores} cores", keys)
        finally:
            stop_nodes(processes)  # each core writes its counts at exit
        writes = result["commits_per_s"] * args.seconds
        # start_nodes puts the sequencer first: report the cores in that order.
        names = core_names(processes)
        cores = {
            name: core_report(json.loads((directory / f"{name}.cpu.json").read_text()), writes, args.top)
            for name in names
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report = {"machine": machine(), "clients": args.clients, "client": result, "cores": cores}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{machine()}; {args.clients} client(s): {result['commits_per_s']} writes/s, p50 {result['p50_ms']} ms\n")
    for number, (name, core) in enumerate(cores.items()):
        role = "sequencer" if number == 0 else "follower"
        print(
            f"{name} ({role}): {core['turns_per_write']} turns a write, {core['us_per_turn']} us of CPU a turn, "
            f"{core['us_per_write']} us a write\n"
        )
        print("| function (exclusive CPU) | us a write | us a turn | calls a turn |")
        print("| --- | ---: | ---: | ---: |")
        for row in core["functions"]:
            print(f"| {row['function']} | {row['us_per_write']} | {row['us_per_turn']} | {row['calls_per_turn']} |")
        print()


if __name__ == "__main__":
    main()
