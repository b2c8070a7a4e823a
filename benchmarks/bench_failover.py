"""Failover time and pause tolerance of a 3-core cluster (real processes on 127.0.0.1).

    .venv/bin/python benchmarks/bench_failover.py [--kills 20] [--election-timeout-ms 800,1600]

* Failover: the sequencer is killed with kill -9 right after an acknowledged write; a client of
  another core then puts a row (retrying ``no_sequencer`` and ``outcome_unknown`` with the same
  request id, as every client does) and the time from the kill to the acknowledgement is recorded.
  The killed core is restarted and the cluster converges before the next kill.
* Pause: a follower is stopped (SIGSTOP) for ``--pause-s`` seconds and resumed; the sequencer and
  its generation must be the same three seconds later (pre-vote and stickiness).

Reports the median and maximum over the kills. Not a test: it asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mnesite.rlog.client import Client  # noqa: E402

from tests.conftest import Cluster, wait_until  # noqa: E402


def measure(election_timeout_ms: tuple[int, int], kills: int, pause_s: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix="mnesite-failover-"))
    processes: list = []
    cluster = Cluster(root, processes)
    timing = f"election_timeout_ms_min = {election_timeout_ms[0]}\nelection_timeout_ms_max = {election_timeout_ms[1]}\n"
    for name in cluster.names:
        path = root / f"{name}.toml"
        path.write_text(path.read_text().replace("[cluster]\n", "[cluster]\n" + timing))
    seconds: list[float] = []
    try:
        cluster.start_all()
        with cluster.client("core1", timeout_ms=10_000) as client:
            client.create_table("t", key="k", columns=[("k", "INTEGER"), ("v", "INTEGER")])
        for kill in range(kills):
            wait_until(lambda: cluster.sequencer() is not None, 30, "a sequencer")
            sequencer = cluster.sequencer()
            assert sequencer is not None
            name = sequencer[0]
            other = next(n for n in cluster.names if n != name)
            with cluster.client(other, timeout_ms=10_000) as client:
                client.put("t", {"k": 0, "v": kill})
            cluster.nodes[name].kill()
            killed = time.monotonic()
            with Client(cluster.endpoints[other], timeout_ms=10_000, retries=3) as client:
                client.put("t", {"k": 1, "v": kill})
            seconds.append(time.monotonic() - killed)
            cluster.start(name)
            cluster.wait_converged(cluster.names, timeout_s=60)
        before = cluster.sequencer()
        assert before is not None
        follower = next(n for n in cluster.names if n != before[0])
        cluster.nodes[follower].signal(signal.SIGSTOP)
        time.sleep(pause_s)
        cluster.nodes[follower].signal(signal.SIGCONT)
        time.sleep(3)
        after = cluster.sequencer()
    finally:
        for process in processes:
            process.signal(signal.SIGCONT)
            process.kill()
    return {
        "election_timeout_ms": list(election_timeout_ms),
        "kills": kills,
        "first_write_after_kill_s_median": round(statistics.median(seconds), 2),
        "first_write_after_kill_s_max": round(max(seconds), 2),
        "first_write_after_kill_s": sorted(round(s, 2) for s in seconds),
        "follower_paused_s": pause_s,
        "new_generation_after_pause": after != before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--pause-s", type=float, default=4.0)
    parser.add_argument("--election-timeout-ms", default="800,1600", help="MIN,MAX (the defaults of the config)")
    arguments = parser.parse_args()
    low, high = (int(part) for part in arguments.election_timeout_ms.split(","))
    print(measure((low, high), arguments.kills, arguments.pause_s), flush=True)


if __name__ == "__main__":
    main()
