"""The hops of one write through three cores, timed: where a 1-client write's latency goes.

    .venv/bin/python benchmarks/trace_write.py [--seconds 8] [--json]

Starts three cores (``bench_commit.start_nodes``) through ``trace_hook.py``, which records when each
core polls, dispatches a message, proposes, appends, commits, fsyncs, applies and sends (one
monotonic clock for the machine), drives one client writing one 100-byte row per transaction at the
sequencer, stops the cores and lines their events up per write: for each write the sequencer
received, the time of each hop after it (the sequencer's append leaving, each follower's append
received, fsync and acknowledgement, the first acknowledgement back, the apply, the reply, the
next write). Prints the median and 90th percentile of each, and the median gap from the hop before.
The wrappers cost about a microsecond each: compare hops with each other, not with ``bench_peers``.
Not a test: timing depends on the machine and its load.
"""

from __future__ import annotations

import argparse
import bisect
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import bench_node, machine, start_nodes, stop_nodes  # noqa: E402

HOOK = Path(__file__).resolve().parent / "trace_hook.py"
Event = tuple[str, int, int, Any]


class Trace:
    """One core's events in start order, searchable by time."""

    def __init__(self, path: Path) -> None:
        self.events: list[Event] = sorted((tuple(json.loads(line)) for line in path.open()), key=lambda e: e[1])
        self.starts = [event[1] for event in self.events]

    def first(self, after_ns: int, before_ns: int, name: str, tag: Any = ...) -> Event | None:
        """The first ``name`` event (with ``tag``, if given) starting in [after_ns, before_ns)."""
        index = bisect.bisect_left(self.starts, after_ns)
        while index < len(self.events) and self.events[index][1] < before_ns:
            event = self.events[index]
            if event[0] == name and (tag is ... or event[3] == tag):
                return event
            index += 1
        return None


def hops(sequencer: Trace, followers: list[Trace]) -> dict[str, list[float]]:
    """Per hop, its time after the sequencer received the write (us), for the writes of the middle 80%."""
    writes = [e for e in sequencer.events if e[0] == "_dispatch" and e[3] == "transact"]
    found: dict[str, list[float]] = {}

    def note(hop: str, event: Event | None, at: int, t0: int) -> None:
        if event is not None:
            found.setdefault(hop, []).append((event[at] - t0) / 1000)

    cut = len(writes) // 10
    middle = writes[cut : len(writes) - cut]
    for write, next_write in zip(middle, middle[1:], strict=False):
        t0, t1 = write[1], next_write[1]
        sent = sequencer.first(t0, t1, "send_frames")
        fsync = sequencer.first(t0, t1, "fdatasync")
        ack = sequencer.first(t0, t1, "_dispatch", "peer")
        applied = sequencer.first(t0, t1, "apply_committed")
        apply_commit = sequencer.first(t0, t1, "commit", False)
        if None in (sent, fsync, ack, applied, apply_commit):
            continue  # a write whose hops another event (an election, a checkpoint) interleaved
        note("sequencer: append sent", sent, 1, t0)
        note("sequencer: fsync begins", fsync, 1, t0)
        note("sequencer: fsync ends", fsync, 2, t0)
        for number, follower in enumerate(followers, 1):
            received = follower.first(t0, t1, "_dispatch", "peer")
            if received is None:
                continue
            follower_fsync = follower.first(received[1], t1, "fdatasync")
            note(f"follower {number}: append received", received, 1, t0)
            if number == 1:  # what the first one does before its fsync
                note("follower 1: entry logged", follower.first(received[1], t1, "append_entries"), 2, t0)
                note("follower 1: previous entry applied", follower.first(received[1], t1, "apply_committed"), 2, t0)
                note("follower 1: commit begins", follower.first(received[1], t1, "commit", True), 1, t0)
            note(f"follower {number}: fsync begins", follower_fsync, 1, t0)
            note(f"follower {number}: fsync ends", follower_fsync, 2, t0)
            if follower_fsync is not None:
                note(f"follower {number}: ack sent", follower.first(follower_fsync[2], t1, "send_frames"), 1, t0)
        note("sequencer: first ack received", ack, 1, t0)
        note("sequencer: entry applied", applied, 2, t0)
        note("sequencer: apply committed", apply_commit, 2, t0)
        # The reply leaves as its entry commits, before the apply and its commit (NodeServer.reply).
        note("sequencer: reply sent", sequencer.first(ack[1], t1, "send_frames"), 1, t0)
        found.setdefault("sequencer: next write received", []).append((t1 - t0) / 1000)
    return found


def table(found: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows, previous = [], 0.0
    for hop, values in sorted(found.items(), key=lambda item: statistics.median(item[1])):
        ordered = sorted(values)
        median = statistics.median(ordered)
        p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
        rows.append(
            {"hop": hop, "median_us": median, "p90_us": p90, "gap_us": median - previous, "writes": len(values)}
        )
        previous = median
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", action="store_true", help="print the hops as JSON")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="mnesite-trace-"))
    processes, endpoint, keys = start_nodes(
        directory,
        "FULL",
        3,
        False,
        launcher=(str(HOOK),),
        environment={"MNESITE_TRACE_OUT": str(directory / "{name}.trace")},
    )
    try:
        result = bench_node(endpoint, 1, args.seconds, "3 cores", keys)
    finally:
        stop_nodes(processes)
    try:
        traces = [Trace(path) for path in sorted(directory.glob("*.trace"))]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if len(traces) != 3:
        raise SystemExit(f"expected the traces of 3 cores, found {len(traces)}")
    # The sequencer is the core that dispatched the client's writes.
    sequencer = max(traces, key=lambda t: sum(1 for e in t.events if e[0] == "_dispatch" and e[3] == "transact"))
    rows = table(hops(sequencer, [t for t in traces if t is not sequencer]))
    if args.json:
        print(json.dumps({"machine": machine(), "client": result, "hops": rows}, indent=1))
        return
    print(f"{machine()}; 1 client: {result['commits_per_s']} writes/s, p50 {result['p50_ms']} ms (traced)\n")
    print("| hop (after the sequencer received the write) | median us | p90 us | gap from the hop before | writes |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['hop']} | {row['median_us']:.0f} | {row['p90_us']:.0f} | {row['gap_us']:.0f} | {row['writes']} |"
        )


if __name__ == "__main__":
    main()
