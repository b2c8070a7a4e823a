"""The nemesis's network faults, and what a run's history says about each of them.

Theory of operation. With a ``tests.fault.netns.Network`` (each node in a namespace of its own) the
nemesis (``tests.fault.nemesis``) can inject these faults; each is held 2.5 to 6 s, then healed:

* ``partition_sequencer``: the sequencer alone on one side, every other node (cores and replicants)
  on the other. Clients attached to it keep sending it writes while the majority elects another.
* ``partition_split``: a random core alone against the other two; each replicant joins a random side.
* ``partition_one_way``: one core cannot send to the other cores, or cannot hear from them (the
  other direction still carries packets: what arrives of a connection is delivered, its replies are
  not). Half of the time that core is the sequencer.
* ``partition_bridge``: two cores cannot reach each other; the third (the bridge) reaches both.
* ``partition_replicant``: a replicant cut from every core, both ways; clients still reach it.
* ``flapping_links``: for the hold, every 0.2 to 1 s either a random split (as ``partition_split``)
  or all links healed.
* ``slow_link``: the links between the sequencer and one follower delayed 50, 200 or 500 ms each
  way (a user-space proxy: ``tests.fault.slow_link``).

Each fault's record names its ``minority`` (nodes cut from a majority of cores for the whole hold)
and its ``majority`` (nodes through which writes can still commit). ``figures`` reads the recorded
history against the records: per kind, how many writes were acknowledged through majority nodes and
through minority nodes while the fault held (the latter must be none: a write invoked after the cut
on the minority side cannot reach a majority before the heal), how many operations failed on the
minority side, and the failover time (cut to the first write acknowledged after it). That is how a
run shows that its partitions were real, and what they cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tests.fault.checker import CAS, OK, READ, WRITE, Operation

if TYPE_CHECKING:
    from tests.fault.nemesis import FaultRecord, Nemesis

PARTITION_FAULTS = (
    "partition_sequencer",
    "partition_split",
    "partition_one_way",
    "partition_bridge",
    "partition_replicant",
    "flapping_links",
    "slow_link",
)
# Faults whose record has a fixed minority: writes invoked there after the cut cannot be acknowledged
# before the heal, and the minority's clients must see failures.
MINORITY_FAULTS = ("partition_sequencer", "partition_split", "partition_one_way", "partition_replicant")
HOLD_S_MIN = 2.5
HOLD_S_MAX = 6.0
FLAP_S_MIN = 0.2
FLAP_S_MAX = 1.0
SLOW_LINK_DELAYS_MS = (50, 200, 500)
# A read the minority answers this long after the cut would outlive every lease (election_timeout_ms_min
# / 2 = 400 ms by default) and every request already in flight: counted, and reported as a problem.
MINORITY_READ_GRACE_S = 1.5


def port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _random_split(nemesis: Nemesis) -> tuple[list[str], list[str]]:
    """(minority, majority): a random core alone, each replicant on a random side."""
    cores = nemesis.cluster.names
    alone = nemesis.rng.choice(cores)
    minority, majority = [alone], [core for core in cores if core != alone]
    for replicant in nemesis.replicants:
        (minority if nemesis.rng.random() < 0.5 else majority).append(replicant)
    return minority, majority


def inject(nemesis: Nemesis, fault: str, record: FaultRecord) -> None:
    """Inject ``fault`` through ``nemesis.network``, hold it, heal it; fill in ``record``."""
    network = nemesis.network
    assert network is not None
    rng = nemesis.rng
    cores = nemesis.cluster.names
    everyone = cores + nemesis.replicants
    sequencer = nemesis._sequencer()
    if fault == "partition_sequencer":
        record.minority = [sequencer]
        record.majority = [name for name in everyone if name != sequencer]
        network.partition(record.minority, record.majority)
    elif fault == "partition_split":
        record.minority, record.majority = _random_split(nemesis)
        network.partition(record.minority, record.majority)
    elif fault == "partition_one_way":
        core = sequencer if rng.random() < 0.5 else rng.choice(cores)
        others = [name for name in cores if name != core]
        sends = rng.random() < 0.5
        for other in others:
            network.cut(core, other) if sends else network.cut(other, core)
        record.minority, record.majority = [core], others
        record.note = f"{core} cannot {'send to' if sends else 'hear from'} the other cores"
    elif fault == "partition_bridge":
        a, bridge, c = rng.sample(cores, 3)
        network.partition([a], [c])
        record.majority = [bridge]
        record.note = f"bridge {bridge}; {a} and {c} cut from each other"
    elif fault == "partition_replicant":
        replicant = rng.choice(nemesis.replicants)
        record.minority, record.majority = [replicant], list(cores)
        network.partition([replicant], cores)
    elif fault == "flapping_links":
        record.cut_s = nemesis.clock()
        hold_s = rng.uniform(HOLD_S_MIN, HOLD_S_MAX)
        flaps = 0
        while nemesis.clock() - record.cut_s < hold_s and not nemesis.stopping.is_set():
            network.heal()
            if rng.random() < 0.7:
                network.partition(*_random_split(nemesis))
            flaps += 1
            nemesis.stopping.wait(rng.uniform(FLAP_S_MIN, FLAP_S_MAX))
        network.heal()
        record.healed_s = nemesis.clock()
        record.hold_s = record.healed_s - record.cut_s
        record.targets = list(everyone)
        record.note = f"{flaps} flaps"
        return
    elif fault == "slow_link":
        follower = rng.choice([core for core in cores if core != sequencer])
        delay_ms = rng.choice(SLOW_LINK_DELAYS_MS)
        endpoints = nemesis.cluster.endpoints
        network.slow(sequencer, follower, port(endpoints[follower]), delay_ms)
        network.slow(follower, sequencer, port(endpoints[sequencer]), delay_ms)
        record.majority = list(cores)
        record.note = f"{sequencer} <-> {follower} delayed {delay_ms} ms each way"
    else:
        raise ValueError(f"unknown network fault {fault!r}")
    record.targets = record.minority or record.majority
    record.cut_s = nemesis.clock()
    try:
        record.hold_s = nemesis._hold(HOLD_S_MIN, HOLD_S_MAX)
    finally:
        record.healing_s = nemesis.clock()
        network.heal()
        record.healed_s = nemesis.clock()


# -- what the history says about each fault ---------------------------------------------------------


@dataclass
class KindFigures:
    """One fault kind over a run. ``failover_s``: per fault, cut to the first write acknowledged after it
    (None: none was acknowledged during the hold)."""

    kind: str
    injected: int = 0
    held_s: float = 0.0
    majority_acks: int = 0
    minority_acks: int = 0
    minority_failures: int = 0
    minority_late_reads: int = 0
    failover_s: list[float | None] = field(default_factory=list)

    def failover_summary(self) -> str:
        known = [s for s in self.failover_s if s is not None]
        if not known:
            return "no write acknowledged during any hold"
        text = f"median {statistics.median(known):.3f} s, max {max(known):.3f} s"
        missing = len(self.failover_s) - len(known)
        return text + (f", {missing} holds without an acknowledged write" if missing else "")

    def as_dict(self) -> dict:
        return {
            "injected": self.injected,
            "held_s": round(self.held_s, 1),
            "majority_acks": self.majority_acks,
            "minority_acks": self.minority_acks,
            "minority_failures": self.minority_failures,
            "minority_late_reads": self.minority_late_reads,
            "failover_s": [None if s is None else round(s, 3) for s in self.failover_s],
        }


@dataclass(frozen=True)
class Refusal:
    """An operation that ended in an error: refused (not in the history: it did nothing) or of unknown
    outcome (in the history, without a completion time); ``completed_s``: when the client gave up."""

    process: int
    kind: str
    invoked_s: float
    completed_s: float
    code: str


def figures(
    records: Iterable[FaultRecord],
    history: list[Operation],
    refusals: list[Refusal],
    client_nodes: list[str],
) -> dict[str, KindFigures]:
    """Per network fault kind: the figures above (pure: reads only its arguments)."""
    result: dict[str, KindFigures] = {}
    acknowledged = sorted(
        (op for op in history if op.kind in (WRITE, CAS) and op.status == OK and op.process >= 0),
        key=lambda op: op.completed_s,
    )
    for record in records:
        if record.fault not in PARTITION_FAULTS or record.cut_s is None or record.healed_s is None:
            continue
        kind = result.setdefault(record.fault, KindFigures(record.fault))
        cut_s, healed_s = record.cut_s, record.healed_s
        # The minority is cut from cut_s until the heal begins (its links return one by one after).
        cut_until_s = record.healing_s if record.healing_s is not None else healed_s
        kind.injected += 1
        kind.held_s += healed_s - cut_s
        minority, majority = set(record.minority), set(record.majority)
        first_s = None
        for op in acknowledged:
            if op.invoked_s < cut_s or op.completed_s > healed_s:
                continue
            node = client_nodes[op.process]
            if first_s is None:
                first_s = op.completed_s - cut_s
            kind.majority_acks += node in majority
            kind.minority_acks += node in minority and op.completed_s < cut_until_s
        kind.failover_s.append(first_s)
        if not minority:
            continue
        for op in history:
            if op.process < 0 or client_nodes[op.process] not in minority or op.kind != READ:
                continue
            if cut_s + MINORITY_READ_GRACE_S <= op.invoked_s and op.completed_s < cut_until_s:
                kind.minority_late_reads += 1
        for refusal in refusals:
            if client_nodes[refusal.process] in minority and cut_s <= refusal.completed_s < cut_until_s:
                kind.minority_failures += 1
    return result


def problems(kinds: dict[str, KindFigures], expected: Iterable[str]) -> list[str]:
    """What shows a partition run did not partition, or that a minority acted as a majority."""
    found = []
    for name in expected:
        kind = kinds.get(name)
        if kind is None or kind.injected == 0:
            found.append(f"{name}: never injected")
            continue
        if kind.minority_acks:
            found.append(f"{name}: {kind.minority_acks} writes acknowledged on the minority side during the cut")
        if kind.minority_late_reads:
            found.append(
                f"{name}: {kind.minority_late_reads} linearizable reads answered on the minority side "
                f"more than {MINORITY_READ_GRACE_S} s into the cut"
            )
        if name in MINORITY_FAULTS and kind.minority_failures == 0:
            found.append(f"{name}: no operation failed on the minority side (was anything cut?)")
        if kind.majority_acks == 0 and name != "flapping_links":
            found.append(f"{name}: no write acknowledged on the majority side during any hold")
    return found
