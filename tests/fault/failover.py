"""Measures what a sequencer failure and a paused follower cost, on real processes (3 cores).

    .venv/bin/python -m tests.fault.failover --kills 20 --pauses 5

Sequencer kills: for each trial, with all three cores up and converged, kill -9 the sequencer and
then write through the two surviving cores, alternately, with a short client timeout, until one
write is acknowledged. The figure is the time from the kill to that acknowledgement (a majority is
up the whole time). Then the killed core restarts and the cores converge before the next trial.

Follower pauses: with a sequencer in place, SIGSTOP a follower for ``--pause-s`` (4 s), SIGCONT it,
keep writing for ``--observe-s`` more, and report whether any core moved to a new generation.

Figures are printed (and written as JSON with ``--json``); nothing here asserts a target.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mnesite.rlog.client import MnesiteError

from tests.conftest import Cluster, NodeProcess, wait_until

TABLE = "probes"
PROBE_TIMEOUT_MS = 100  # the resolution of the measurement while no sequencer answers
FIRST_WRITE_TIMEOUT_S = 60
SEQUENCER_TIMEOUT_S = 60


def generations(cluster: Cluster, names: list[str]) -> dict[str, int]:
    found = {}
    for name in names:
        status = cluster.status(name, timeout_ms=500)
        if status and "default" in status["shards"]:
            found[name] = status["shards"]["default"]["generation"]
    return found


def first_write_after(cluster: Cluster, survivors: list[str], killed_at: float, counter: list[int]) -> float:
    """Seconds from ``killed_at`` to the first write acknowledged through one of ``survivors``."""
    clients = [cluster.client(name, timeout_ms=PROBE_TIMEOUT_MS, retries=0) for name in survivors]
    try:
        attempt = 0
        while time.monotonic() - killed_at < FIRST_WRITE_TIMEOUT_S:
            client = clients[attempt % len(clients)]
            attempt += 1
            counter[0] += 1
            try:
                client.put(TABLE, {"id": counter[0], "note": "probe"})
            except MnesiteError:
                client.close()  # a fresh socket: nothing queued for a dead peer is re-sent later
                continue
            return time.monotonic() - killed_at
        raise RuntimeError(f"no write acknowledged within {FIRST_WRITE_TIMEOUT_S} s of the kill")
    finally:
        for client in clients:
            client.close()


def wait_sequencer(cluster: Cluster) -> tuple[str, int]:
    found: dict[str, tuple[str, int] | None] = {}

    def elected() -> bool:
        found["sequencer"] = cluster.sequencer()
        return found["sequencer"] is not None

    wait_until(elected, SEQUENCER_TIMEOUT_S, "a sequencer")
    return found["sequencer"]


def measure_kills(cluster: Cluster, kills: int, counter: list[int]) -> list[float]:
    samples = []
    for trial in range(kills):
        cluster.wait_converged(cluster.names, timeout_s=60)
        sequencer, generation = wait_sequencer(cluster)
        survivors = [name for name in cluster.names if name != sequencer]
        killed_at = time.monotonic()
        cluster.nodes[sequencer].kill()
        sample = first_write_after(cluster, survivors, killed_at, counter)
        samples.append(sample)
        print(f"kill {trial + 1}: sequencer {sequencer} (generation {generation}): first write after {sample:.3f} s")
        cluster.start(sequencer)
    return samples


def measure_pauses(cluster: Cluster, pauses: int, pause_s: float, observe_s: float, counter: list[int]) -> list[dict]:
    trials = []
    for trial in range(pauses):
        cluster.wait_converged(cluster.names, timeout_s=60)
        sequencer, _ = wait_sequencer(cluster)
        follower = next(name for name in cluster.names if name != sequencer)
        before = generations(cluster, cluster.names)
        cluster.nodes[follower].signal(signal.SIGSTOP)
        try:
            with cluster.client(sequencer, timeout_ms=2000) as client:
                paused_until = time.monotonic() + pause_s
                while time.monotonic() < paused_until:  # writes go on while the follower is paused
                    counter[0] += 1
                    client.put(TABLE, {"id": counter[0], "note": "during pause"})
        finally:
            cluster.nodes[follower].signal(signal.SIGCONT)
        write_failures = 0
        with cluster.client(sequencer, timeout_ms=2000, retries=0) as client:
            observe_until = time.monotonic() + observe_s
            while time.monotonic() < observe_until:
                counter[0] += 1
                try:
                    client.put(TABLE, {"id": counter[0], "note": "after pause"})
                except MnesiteError:
                    write_failures += 1
        after = generations(cluster, cluster.names)
        new_generation = max(after.values()) > max(before.values())
        trials.append(
            {"follower": follower, "sequencer": sequencer, "before": before, "after": after,
             "new_generation": new_generation, "write_failures_after": write_failures}
        )  # fmt: skip
        print(
            f"pause {trial + 1}: {follower} stopped {pause_s:g} s (sequencer {sequencer}): generations {before} -> "
            f"{after}{' NEW GENERATION' if new_generation else ''}; failed writes after resume: {write_failures}"
        )
    return trials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--pauses", type=int, default=5)
    parser.add_argument("--pause-s", type=float, default=4.0)
    parser.add_argument("--observe-s", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args(argv)
    processes: list[NodeProcess] = []
    with tempfile.TemporaryDirectory(prefix="mnesite-failover-") as root:
        try:
            cluster = Cluster(Path(root), processes)
            cluster.start_all()
            with cluster.client(cluster.names[0], timeout_ms=5000, retries=5) as client:
                client.create_table(TABLE, "id", [("id", "INTEGER"), ("note", "TEXT")])
            counter = [0]
            samples = measure_kills(cluster, arguments.kills, counter)
            trials = measure_pauses(cluster, arguments.pauses, arguments.pause_s, arguments.observe_s, counter)
        finally:
            for process in processes:
                process.signal(signal.SIGCONT)
                process.kill()
    figures = {
        "kills": len(samples),
        "first_write_s_median": statistics.median(samples) if samples else None,
        "first_write_s_max": max(samples) if samples else None,
        "first_write_s": [round(s, 3) for s in samples],
        "pauses": len(trials),
        "pauses_with_new_generation": sum(t["new_generation"] for t in trials),
        "pause_trials": trials,
    }
    print(
        f"sequencer kills: {figures['kills']}, first write after the kill: median "
        f"{figures['first_write_s_median']:.3f} s, max {figures['first_write_s_max']:.3f} s"
        if samples
        else "sequencer kills: none"
    )
    print(f"follower pauses of {arguments.pause_s:g} s: {figures['pauses_with_new_generation']} of {len(trials)} "
          "caused a new generation")  # fmt: skip
    if arguments.json:
        arguments.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
