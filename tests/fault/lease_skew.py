"""What the read lease assumes about clocks, shown on real processes with libfaketime.

    .venv/bin/python -m tests.fault.lease_skew --trials 5            # core1 at x0.2, then at x1

The sequencer answers a ``linearizable`` read alone while a majority answered its appends within
``election_timeout_ms_min / 2`` *by its own clock*; a follower refuses to help elect another
sequencer for ``election_timeout_ms_min`` after it heard this one, *by the follower's clock*. The
lease is therefore safe only while no follower's clock runs more than twice as fast as the
sequencer's. This script breaks that assumption on purpose and shows the consequence:

1. core1 runs under libfaketime at ``--rate`` (0.2: its clock runs at a fifth of real speed) and
   is made sequencer (core2 and core3 start with a 20 s election timeout, so only core1 can win;
   then each is restarted with the normal timeout, one at a time, so core1 keeps its majority);
2. a writer writes unique values through core2; core1 is SIGSTOPped for ``--pause-s`` (by default
   90% of its lease in real time: with the default 800 ms minimum election timeout and 0.2x, 1.8 s real,
   0.36 s on core1's clock, less than its 0.4 s lease, and more than the followers' 0.8 s
   stickiness), so core2 and core3 elect a new sequencer and commit writes meanwhile; during the
   pause, clients already connected to core1 keep sending it ``linearizable`` reads;
3. after SIGCONT, core1 answers the queued reads before it hears of the new generation, if it still
   believes its lease; the per-key checker decides whether the history is linearizable.

The same trial with core1 at the real clock rate (``--rate 1``) is the baseline: its lease has expired
after the pause, so it must refuse those reads. Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.config import Timing

from tests.conftest import Cluster, NodeProcess, wait_until
from tests.fault.checker import OK, READ, UNKNOWN, WRITE, Operation, Verdict, check_key
from tests.fault.history import COLUMNS, TABLE, row_value
from tests.fault.nemesis import faketime_library

LEASE_MS = Timing().election_timeout_ms_min // 2  # the sequencer's lease by its own clock
PAUSE_SHARE_OF_LEASE = 0.9
SLOW_ELECTION = "[cluster]\nelection_timeout_ms_min = 20000\nelection_timeout_ms_max = 30000\n"
READ_INTERVAL_S = 0.02
CLIENT_TIMEOUT_MS = 3000


def generations(cluster: Cluster) -> dict[str, int]:
    found = {}
    for name in cluster.names:
        status = cluster.status(name, timeout_ms=2000)
        if status and "default" in status["shards"]:
            found[name] = status["shards"]["default"]["generation"]
    return found


class Trial:
    """One cluster, one pause of the sequencer core1, and the history of key 0 around it."""

    def __init__(self, root: Path, processes: list[NodeProcess], rate: float) -> None:
        self.cluster = Cluster(root, processes)
        self.rate = rate
        self.history: list[Operation] = []
        self.lock = threading.Lock()
        self.served_by_core1_after_resume = 0
        self.refused = 0

    def _configure(self, name: str, slow: bool) -> None:
        path = self.cluster.root / f"{name}.toml"
        text = path.read_text().replace(SLOW_ELECTION, "[cluster]\n")
        path.write_text(text.replace("[cluster]\n", SLOW_ELECTION) if slow else text)

    def make_core1_sequencer(self) -> None:
        cluster = self.cluster
        env = None
        if self.rate != 1:
            env = {"LD_PRELOAD": faketime_library(), "FAKETIME": f"+0 x{self.rate:g}"}
        for name in ("core2", "core3"):
            self._configure(name, slow=True)
        cluster.nodes["core1"].start(cluster.endpoints["core1"], env=env)
        cluster.start("core2")
        cluster.start("core3")
        # The shard's consensus starts with its first table; only core1 can win that first election.
        with cluster.client("core1", timeout_ms=10000, retries=5) as client:
            client.create_table(TABLE, "id", COLUMNS)
        wait_until(lambda: (cluster.sequencer() or ("",))[0] == "core1", 60, "core1 to become sequencer", 0.1)
        for name in ("core2", "core3"):
            self._configure(name, slow=False)
            cluster.nodes[name].kill()
            cluster.start(name)
            cluster.wait_converged(cluster.names, timeout_s=60)
        if (cluster.sequencer() or ("",))[0] != "core1":
            raise RuntimeError("core1 lost the sequencer role while the others restarted")

    def _write(self, client: Client, value: int) -> None:
        invoked = time.monotonic()
        try:
            client.put(TABLE, {"id": 0, "value": value})
        except MnesiteError:
            self._record(Operation(0, 0, WRITE, UNKNOWN, invoked, math.inf, value))
            return
        self._record(Operation(0, 0, WRITE, OK, invoked, time.monotonic(), value))

    def _read(self, process: int, client: Client, resumed: threading.Event) -> None:
        invoked = time.monotonic()
        try:
            with client:
                row = client.get(TABLE, 0, consistency="linearizable")
        except MnesiteError:
            with self.lock:
                self.refused += 1
            return
        self._record(Operation(process, 0, READ, OK, invoked, time.monotonic(), row_value(row)))
        if resumed.is_set():
            with self.lock:
                self.served_by_core1_after_resume += 1

    def _record(self, operation: Operation) -> None:
        with self.lock:
            self.history.append(operation)

    def run(self, pause_s: float) -> Verdict:
        cluster = self.cluster
        self.make_core1_sequencer()
        stopping = threading.Event()
        resumed = threading.Event()

        def writer() -> None:
            value = 0
            with cluster.client("core2", timeout_ms=500, retries=0) as client:
                while not stopping.is_set():
                    value += 1
                    self._write(client, value)

        writer_thread = threading.Thread(target=writer, daemon=True)
        writer_thread.start()
        wait_until(lambda: len(self.history) >= 20, 30, "writes before the pause")
        # Readers connect before the pause, as clients already talking to the sequencer would: a
        # connection opened during the pause would only complete its handshake after the peers'
        # queued messages were read, and so could never be answered first.
        pool = []
        for _ in range(int(pause_s / READ_INTERVAL_S) + 1):
            client = cluster.client("core1", timeout_ms=CLIENT_TIMEOUT_MS, retries=0)
            client.status()
            pool.append(client)
        readers = []
        cluster.nodes["core1"].signal(signal.SIGSTOP)
        paused_until = time.monotonic() + pause_s
        process = 1
        while time.monotonic() < paused_until and pool:
            reader = threading.Thread(target=self._read, args=(process, pool.pop(), resumed), daemon=True)
            reader.start()
            readers.append(reader)
            process += 1
            time.sleep(READ_INTERVAL_S)  # a new read every 20 ms: the pause is the clock being tested
        resumed.set()
        cluster.nodes["core1"].signal(signal.SIGCONT)
        for reader in readers:
            reader.join(CLIENT_TIMEOUT_MS / 1000 + 5)
        for client in pool:
            client.close()
        stopping.set()
        writer_thread.join(10)
        result = check_key(0, self.history)
        paused_at = paused_until - pause_s
        acknowledged_in_pause = sum(
            op.kind == WRITE and op.status == OK and paused_at <= op.completed_s <= paused_until for op in self.history
        )
        generation = max(generations(cluster).values())
        print(
            f"rate x{self.rate:g}: {len(readers)} reads sent to core1 during the pause, "
            f"{self.served_by_core1_after_resume} answered after SIGCONT, {self.refused} refused; "
            f"{acknowledged_in_pause} writes acknowledged by another sequencer during the pause; generation now "
            f"{generation}; history of key 0: {result.verdict.value}"
        )
        if result.verdict is not Verdict.LINEARIZABLE:
            print(result.report(around=10))
        return result.verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--rate", type=float, action="append", help="core1 clock rate (repeatable)")
    parser.add_argument("--pause-s", type=float, help="default: 90%% of the lease in real time at the slowest rate")
    arguments = parser.parse_args(argv)
    if faketime_library() is None:
        print("libfaketime is not installed (make faketime): cannot skew a clock", file=sys.stderr)
        return 2
    rates = arguments.rate or [0.2, 1.0]
    # One pause for every rate, so that the real-clock trials are the baseline of the skewed ones.
    pause_s = arguments.pause_s or PAUSE_SHARE_OF_LEASE * LEASE_MS / 1000 / min(rates)
    verdicts: dict[float, list[Verdict]] = {}
    for rate in rates:
        for _ in range(arguments.trials):
            processes: list[NodeProcess] = []
            with tempfile.TemporaryDirectory(prefix="mnesite-lease-") as root:
                try:
                    verdicts.setdefault(rate, []).append(Trial(Path(root), processes, rate).run(pause_s))
                except (AssertionError, RuntimeError, MnesiteError) as error:
                    # Making a slow-clocked core sequencer can fail on a busy machine: say so, go on.
                    print(f"rate x{rate:g}: trial not run, its set-up failed: {error}")
                finally:
                    for node in processes:
                        node.signal(signal.SIGCONT)
                        node.kill()
    for rate, found in verdicts.items():
        violations = sum(verdict is Verdict.VIOLATION for verdict in found)
        print(f"core1 clock x{rate:g}: {violations} of {len(found)} trials not linearizable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
