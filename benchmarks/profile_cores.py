"""Where the cores spend their time under load: py-spy on the sequencer and one follower.

    .venv/bin/python benchmarks/profile_cores.py [--clients 1,64] [--seconds 8] [--top 25] [--gil]

Starts three real core processes (``bench_commit.start_nodes``), drives ``--clients`` clients
putting one 100-byte row per transaction at the sequencer, and meanwhile samples the sequencer and
one follower with ``py-spy record --format raw`` (collapsed stacks, idle frames left out). Prints,
per process and client count, the commits/s reached, the share of samples per function (inclusive:
the function or anything it called) and the hottest leaf functions (self time). py-spy comes from
the ``dev`` extra; it needs ptrace rights over the cores (root, or ``kernel.yama.ptrace_scope=0``).
``--gil`` keeps only samples that hold the GIL (py-spy's ``--gil``): Python's own work, without the
time spent blocked in C (an fsync, a poll) or waiting for a CPU, which the default samples count.
Not a test: timing depends on the machine and its load.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import bench_node, start_nodes, stop_nodes  # noqa: E402

SAMPLES_PER_S = 200


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install -e '.[dev]'")
    return found


def summarise(raw: Path, top: int) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """Total samples, the ``top`` functions by inclusive share and the ``top`` leaves by self share."""
    inclusive: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(frame) for frame in stack.split(";")]
        total += count
        for name in set(frames):
            inclusive[name] += count
        leaves[frames[-1]] += count
    if total == 0:
        return 0, [], []

    def share(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(name, 100.0 * count / total) for name, count in counter.most_common(top)]

    return total, share(inclusive), share(leaves)


def _short(frame: str) -> str:
    # py-spy frames read "function (path/to/file.py:line)": keep the function and the file's name.
    function, _, location = frame.partition(" (")
    file_name = location.rstrip(")").rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{function} ({file_name})" if file_name else function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,64")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--gil", action="store_true", help="only samples that hold the GIL (Python's own work)")
    args = parser.parse_args()
    spy = py_spy()
    directory = Path(tempfile.mkdtemp(prefix="mnesite-profile-"))
    processes, endpoint, keys = start_nodes(directory, "FULL", 3, False)
    try:
        # start_nodes returns the sequencer's process first (not in the order of the names).
        pids = {"sequencer": processes[0].pid, "follower": processes[1].pid}
        for clients in [int(c) for c in args.clients.split(",")]:
            outputs = {role: directory / f"{role}-{clients}.txt" for role in pids}
            spies = [
                subprocess.Popen(
                    [spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)), "--rate"]
                    + [str(SAMPLES_PER_S), "--format", "raw", "--output", str(outputs[role]), "--nonblocking"]
                    + (["--gil"] if args.gil else []),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for role, pid in pids.items()
            ]
            result = bench_node(endpoint, clients, args.seconds, "3 cores", keys)
            for spy_process in spies:
                spy_process.wait(args.seconds + 60)
            print(f"\n## {clients} client(s): {result.get('commits_per_s')} commits/s, p50 {result.get('p50_ms')} ms")
            for role in pids:
                total, inclusive, leaves = summarise(outputs[role], args.top)
                print(f"\n### {role} ({total} busy samples at {SAMPLES_PER_S}/s over {args.seconds:g} s)\n")
                print("| inclusive % | function |\n| ---: | --- |")
                for name, percent in inclusive:
                    print(f"| {percent:.1f} | {name} |")
                print("\n| self % | leaf function |\n| ---: | --- |")
                for name, percent in leaves:
                    print(f"| {percent:.1f} | {name} |")
    finally:
        stop_nodes(processes, timeout_s=30)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
