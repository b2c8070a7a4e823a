"""The nemesis: injects one fault at a time into a real cluster, chosen by a seeded ``random.Random``.

Faults (each is injected, held for a random time, then healed, before the next one starts):

* ``kill_sequencer``, ``kill_core``, ``kill_two_cores``: kill -9, then restart on the same data
  directory (disks kept; two cores down is a lost majority for the hold time);
* ``pause_sequencer``, ``pause_follower``, ``pause_replicant``: SIGSTOP, then SIGCONT;
* ``restart_replicant``: kill -9 and restart a replicant;
* ``lose_disk``: kill -9 a core, empty its data directory (a lost disk, a rebuilt core) and start it
  with ``initial_cluster_state = "existing"``, as the docs tell operators (``core.recovery``: it
  waits for every other member, learns the generations and its vote floor, then catches up); the
  fault ends once its log reaches what the others held when it started, so that two disks are never
  lost before the first caught up (a majority protocol does not survive two lost copies at once);
* ``clock_skew``: restart one core under libfaketime with its clock running ``rate`` times as fast
  as the others' (0.25 to 4), for a longer hold, then restart it with the real clock. Every clock the
  node reads and every timer it waits on run at that rate, so this is a true clock-rate difference.
  It is skipped, with a message, when libfaketime is not installed (``make fault-test`` installs it).

With a ``network`` (``tests.fault.netns.Network``: every node in a namespace of its own) the network
faults of ``tests.fault.partitions`` join them (``PARTITION_FAULTS``: partitions of several shapes,
flapping links, slow links); without one they are skipped with a message.

Faults are chosen at random (``schedule="random"``) or in shuffled rounds in which each fault comes
once (``schedule="rounds"``: a short run still meets every kind).

Every fault is logged with its start time, its target, the hold and the highest generation seen
before and after, which is how the test shows what a fault cost in elections.
"""

from __future__ import annotations

import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import Cluster
from tests.fault.netns import Network
from tests.fault.partitions import PARTITION_FAULTS
from tests.fault.partitions import inject as inject_network_fault

FAKETIME_LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)
FAULTS = (
    "kill_sequencer",
    "kill_core",
    "kill_two_cores",
    "pause_sequencer",
    "pause_follower",
    "pause_replicant",
    "restart_replicant",
    "clock_skew",
    "lose_disk",
)
CLOCK_RATES = (0.25, 0.5, 2.0, 4.0)
CATCH_UP_TIMEOUT_S = 60.0  # a rebuilt core's catch-up after a lost disk (its table is small in a fault run)
HOLD_S_MIN = 0.5
HOLD_S_MAX = 4.0
CLOCK_SKEW_HOLD_S_MIN = 5.0
CLOCK_SKEW_HOLD_S_MAX = 10.0
QUIET_S_MIN = 1.0
QUIET_S_MAX = 3.0
FAULTS_MAX = 10_000
ALL_FAULTS = FAULTS + PARTITION_FAULTS
SCHEDULES = ("random", "rounds")


def faketime_library() -> str | None:
    for path in FAKETIME_LIBRARIES:
        if Path(path).exists():
            return path
    return None


@dataclass
class FaultRecord:
    fault: str
    targets: list[str]
    started_s: float
    hold_s: float
    generation_before: int | None
    generation_after: int | None = None
    note: str = ""
    # Network faults: when the cut was in place and when it was healed (time.monotonic), the nodes cut
    # from a majority of cores (minority) and those through which writes can still commit (majority).
    cut_s: float | None = None
    healed_s: float | None = None
    # When the heal began: links come back one route at a time from then on, so what completes after
    # it may have crossed a restored link (the minority checks end here, not at healed_s).
    healing_s: float | None = None
    minority: list[str] = field(default_factory=list)
    majority: list[str] = field(default_factory=list)

    def describe(self, origin_s: float) -> str:
        sides = f" minority {','.join(self.minority) or '-'} | majority {','.join(self.majority) or '-'}"
        return (
            f"{self.started_s - origin_s:7.2f}s {self.fault:<17} {','.join(self.targets):<20} hold {self.hold_s:4.1f}s "
            f"generation {self.generation_before} -> {self.generation_after}{' ' + self.note if self.note else ''}"
            f"{sides if self.minority or self.majority else ''}"
        )


@dataclass
class Nemesis:
    cluster: Cluster
    replicants: list[str]
    seed: int
    faults: tuple[str, ...] = FAULTS
    network: Network | None = None
    schedule: str = "random"
    log: list[FaultRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        self.rng = random.Random(self.seed)
        self.stopping = threading.Event()
        self.clock = time.monotonic
        self._round: list[str] = []
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self.failure: BaseException | None = None
        self._faketime = faketime_library()
        if "clock_skew" in self.faults and self._faketime is None:
            self.skipped.append("clock_skew: libfaketime is not installed (apt-get install -y faketime)")
            self.faults = tuple(f for f in self.faults if f != "clock_skew")
        if self.network is None and any(f in PARTITION_FAULTS for f in self.faults):
            self.skipped.append("network faults: the nodes do not run in network namespaces of their own")
            self.faults = tuple(f for f in self.faults if f not in PARTITION_FAULTS)

    def start(self) -> Nemesis:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60) -> None:
        """Stop after healing the fault under way; raise what went wrong in the nemesis, if anything."""
        self.stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the nemesis did not stop within {timeout_s} s")
        if self.failure is not None:
            raise RuntimeError(f"the nemesis failed: {self.failure!r}") from self.failure

    def _run(self) -> None:
        try:
            while not self.stopping.is_set() and len(self.log) < FAULTS_MAX:
                if self.stopping.wait(self.rng.uniform(QUIET_S_MIN, QUIET_S_MAX)):
                    return
                self.inject(self._next_fault())
        except BaseException as error:  # reported by stop(); the run's final checks still heal the cluster
            self.failure = error

    # -- helpers ---------------------------------------------------------------------------------

    def _next_fault(self) -> str:
        if self.schedule == "random":
            return self.rng.choice(self.faults)
        if not self._round:
            self._round = list(self.faults)
            self.rng.shuffle(self._round)
        return self._round.pop()

    def generation(self) -> int | None:
        generations = []
        for name in self.cluster.names:
            status = self.cluster.status(name, timeout_ms=300)
            if status and "default" in status["shards"]:
                generations.append(status["shards"]["default"]["generation"])
        return max(generations) if generations else None

    def _sequencer(self) -> str:
        found = self.cluster.sequencer()
        return found[0] if found else self.rng.choice(self.cluster.names)

    def _hold(self, low_s: float = HOLD_S_MIN, high_s: float = HOLD_S_MAX) -> float:
        hold_s = self.rng.uniform(low_s, high_s)
        # The hold ends early only when the run stops; the fault is healed either way.
        self.stopping.wait(hold_s)
        return hold_s

    def _kill(self, name: str) -> None:
        self.cluster.nodes[name].kill()

    def _restart(self, name: str, env: dict[str, str] | None = None) -> None:
        self.cluster.nodes[name].start(self.cluster.endpoints[name], timeout_s=60, env=env)

    # -- faults ----------------------------------------------------------------------------------

    def inject(self, fault: str) -> FaultRecord:
        record = FaultRecord(fault, [], time.monotonic(), 0.0, self.generation())
        self.log.append(record)
        cores = self.cluster.names
        if fault in PARTITION_FAULTS:
            inject_network_fault(self, fault, record)
        elif fault in ("kill_sequencer", "kill_core", "kill_two_cores"):
            if fault == "kill_sequencer":
                record.targets = [self._sequencer()]
            else:
                record.targets = self.rng.sample(cores, 2 if fault == "kill_two_cores" else 1)
            for name in record.targets:
                self._kill(name)
            record.hold_s = self._hold()
            for name in record.targets:
                self._restart(name)
        elif fault in ("pause_sequencer", "pause_follower", "pause_replicant"):
            if fault == "pause_sequencer":
                name = self._sequencer()
            elif fault == "pause_follower":
                sequencer = self._sequencer()
                name = self.rng.choice([core for core in cores if core != sequencer])
            else:
                name = self.rng.choice(self.replicants)
            record.targets = [name]
            self.cluster.nodes[name].signal(signal.SIGSTOP)
            try:
                record.hold_s = self._hold()
            finally:
                self.cluster.nodes[name].signal(signal.SIGCONT)
        elif fault == "restart_replicant":
            name = self.rng.choice(self.replicants)
            record.targets = [name]
            self._kill(name)
            record.hold_s = self._hold()
            self._restart(name)
        elif fault == "lose_disk":
            name = self.rng.choice(cores)
            record.targets = [name]
            self._kill(name)
            record.hold_s = self._hold()
            self._lose_disk(name)
            self._restart(name)
            record.note = self._await_caught_up(name)
        elif fault == "clock_skew":
            name = self.rng.choice(cores)
            rate = self.rng.choice(CLOCK_RATES)
            record.targets = [name]
            record.note = f"clock x{rate}"
            self._kill(name)
            self._restart(name, env={"LD_PRELOAD": self._faketime, "FAKETIME": f"+0 x{rate}"})
            record.hold_s = self._hold(CLOCK_SKEW_HOLD_S_MIN, CLOCK_SKEW_HOLD_S_MAX)
            self._kill(name)
            self._restart(name)
        else:
            raise ValueError(f"unknown fault {fault!r}")
        record.generation_after = self.generation()
        return record

    def _lose_disk(self, name: str) -> None:
        shutil.rmtree(self.cluster.data_dir(name), ignore_errors=True)
        config = self.cluster.root / f"{name}.toml"
        text = config.read_text()
        if "initial_cluster_state" not in text:
            config.write_text(text.replace("[cluster]\n", '[cluster]\ninitial_cluster_state = "existing"\n', 1))

    def _await_caught_up(self, name: str) -> str:
        """Wait until the rebuilt core's log reaches the highest log key the others held once it was
        up (at or past its vote floor); raise if it does not within CATCH_UP_TIMEOUT_S."""
        others = [core for core in self.cluster.names if core != name]
        target: tuple[int, int] = (0, 0)
        for core in others:
            status = self.cluster.status(core, timeout_ms=1000)
            if status and "default" in status["shards"]:
                target = max(target, tuple(status["shards"]["default"]["last"]))
        started = time.monotonic()
        deadline = started + CATCH_UP_TIMEOUT_S
        while time.monotonic() < deadline and not self.stopping.is_set():
            status = self.cluster.status(name, timeout_ms=1000)
            shard = status["shards"].get("default") if status else None
            if shard is not None and tuple(shard["last"]) >= target:
                return f"caught up past {list(target)} in {time.monotonic() - started:.1f} s"
            time.sleep(0.2)
        if self.stopping.is_set():
            return f"the run stopped before it caught up past {list(target)}"
        raise RuntimeError(
            f"{name}, rebuilt on an empty disk, did not reach {list(target)} within {CATCH_UP_TIMEOUT_S} s"
        )

    def heal(self) -> None:
        """Make every node run again with the real clock and all links (called after the nemesis stopped)."""
        if self.network is not None:
            self.network.heal()
        for name, node in self.cluster.nodes.items():
            node.signal(signal.SIGCONT)
            if node.process is None or node.process.poll() is not None:
                node.process = None
                self._restart(name)
