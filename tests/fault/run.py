"""One fault run: a real cluster, the history recorder, the nemesis, then the checks.

    python -m tests.fault.run --seed 7 --duration-s 300          # what ``make fault-test`` runs
    python -m tests.fault.run --faults partitions --schedule rounds   # ``make partition-test`` (root)

Steps: start 3 cores and 2 replicants (real processes on 127.0.0.1, free ports; with a network fault
among ``--faults``, each node in a network namespace of its own: ``tests.fault.netns``); create the table
``registers``; run the client threads (half on cores, half on replicants) and the nemesis for the
duration; stop the nemesis, heal every node (SIGCONT, restart what is down, real clocks, every link); stop the
clients; then check

1. convergence: every node applied the same tx key with the same digest, and holds the same rows;
2. no lost acknowledged write: every write or CAS a node acknowledged is in the rlog at the tx key it
   was acknowledged with, and each key's row is the last write of it in log order;
3. linearizability per key of the recorded history (``checker``), after one final ``linearizable``
   read per key, so that a write lost at the very end shows up as well;
4. for network faults, that they were real (``partitions.problems``): every kind injected, no write
   acknowledged on a minority side during a cut, failures seen there, writes acknowledged on the
   majority side.

A failing run prints the seed, the command that replays it and the offending histories.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mnesite.rlog.client import MnesiteError

from tests.conftest import Cluster, NodeProcess, wait_until
from tests.fault import netns, partitions
from tests.fault.checker import OK, READ, KeyResult, Operation, Verdict, check_history
from tests.fault.history import COLUMNS, TABLE, Recorder, row_value
from tests.fault.nemesis import ALL_FAULTS, FAULTS, SCHEDULES, FaultRecord, Nemesis
from tests.fault.netns import Network
from tests.fault.partitions import PARTITION_FAULTS

SHARD = "default"
RLOG_PAGE_ENTRIES = 1000
# The checks need every entry of the run in the rlog: retention must not trim during a run.
CORE_CONFIG_EXTRA = "[rlog]\nretention_entries_max = 100000000\n"
CONVERGENCE_TIMEOUT_S = 120


@dataclass
class RunSettings:
    seed: int
    duration_s: float
    clients: int = 10
    keys: int = 10
    replicants: int = 2
    faults: tuple[str, ...] = FAULTS
    client_timeout_ms: int = 1000
    steps_max: int | None = None  # the checker's budget per key; None: its default per operation
    schedule: str = "random"  # nemesis.SCHEDULES

    @property
    def network_faults(self) -> tuple[str, ...]:
        return tuple(fault for fault in self.faults if fault in PARTITION_FAULTS)

    def node_names(self) -> list[str]:
        return [f"core{i}" for i in range(1, 4)] + [f"replicant{i}" for i in range(1, self.replicants + 1)]

    def replay_command(self) -> str:
        faults = ",".join(self.faults) if self.faults else "none"
        return (
            f".venv/bin/python -m tests.fault.run --seed {self.seed} --duration-s {self.duration_s:g} "
            f"--clients {self.clients} --keys {self.keys} --faults {shlex.quote(faults)} --schedule {self.schedule}"
        )


@dataclass
class RunResult:
    settings: RunSettings
    history: list[Operation]
    key_results: list[KeyResult]
    lost_writes: list[str]
    divergence: list[str]
    counts: dict[str, int]
    errors: dict[str, int]
    faults: list[str]
    skipped: list[str]
    generation_final: int | None
    position: dict = field(default_factory=dict)
    check_s: float = 0.0
    records: list[FaultRecord] = field(default_factory=list)
    network_kinds: dict[str, partitions.KindFigures] = field(default_factory=dict)

    @property
    def network_problems(self) -> list[str]:
        return partitions.problems(self.network_kinds, self.settings.network_faults)

    @property
    def violations(self) -> list[KeyResult]:
        return [r for r in self.key_results if r.verdict is Verdict.VIOLATION]

    @property
    def undetermined(self) -> list[KeyResult]:
        return [r for r in self.key_results if r.verdict is Verdict.UNDETERMINED]

    @property
    def passed(self) -> bool:
        return not (
            self.violations or self.undetermined or self.lost_writes or self.divergence or self.network_problems
        )

    def acknowledged_writes(self) -> int:
        return sum(n for name, n in self.counts.items() if name in ("write ok", "cas ok"))

    def summary(self) -> str:
        lines = [
            f"seed {self.settings.seed}, {self.settings.duration_s:g} s, {self.settings.clients} clients, "
            f"{self.settings.keys} keys: {'PASS' if self.passed else 'FAIL'}",
            f"  operations: {len(self.history)} ({', '.join(f'{k} {v}' for k, v in sorted(self.counts.items()))})",
            f"  acknowledged writes (write ok + cas ok): {self.acknowledged_writes()}",
            f"  client errors: {dict(sorted(self.errors.items()))}",
            f"  faults injected: {len(self.faults)}; final generation {self.generation_final}; "
            f"converged at {self.position.get('applied')}",
            f"  linearizability: {len(self.key_results) - len(self.violations) - len(self.undetermined)} keys "
            f"linearizable, {len(self.violations)} violations, {len(self.undetermined)} undetermined "
            f"(checked in {self.check_s:.1f} s)",
            f"  lost acknowledged writes: {len(self.lost_writes)}; divergence: {len(self.divergence)}",
        ]
        lines += [f"  skipped fault {reason}" for reason in self.skipped]
        for name, kind in sorted(self.network_kinds.items()):
            lines.append(
                f"  {name}: {kind.injected} injected, {kind.held_s:.0f} s held; writes acknowledged on the majority "
                f"side {kind.majority_acks}, on the minority side {kind.minority_acks}; minority failures "
                f"{kind.minority_failures}; failover {kind.failover_summary()}"
            )
        lines += [f"  network problem: {problem}" for problem in self.network_problems]
        return "\n".join(lines)

    def failure_report(self) -> str:
        lines = [self.summary(), f"replay: {self.settings.replay_command()}", "faults:"]
        lines += [f"  {fault}" for fault in self.faults]
        lines += [f"lost: {lost}" for lost in self.lost_writes[:50]]
        lines += [f"divergence: {item}" for item in self.divergence[:50]]
        for result in self.violations + self.undetermined:
            lines.append(result.report())
        return "\n".join(lines)


class RunFailed(Exception):
    """The cluster did not converge or answer after the faults were healed."""


def start_cluster(
    root: Path, processes: list[NodeProcess], replicants: int, network: Network | None = None
) -> tuple[Cluster, list[str]]:
    # Nodes in namespaces listen on non-loopback addresses, which a node allows only with [security].
    cluster = Cluster(root, processes, secure=True if network else None, placement=network)
    cluster.extend_core_configs(CORE_CONFIG_EXTRA)
    cluster.start_all()
    with cluster.client(cluster.names[0], timeout_ms=5000, retries=5) as client:
        client.create_table(TABLE, "id", COLUMNS)
    names = [f"replicant{i}" for i in range(1, replicants + 1)]
    for name in names:
        cluster.add_replicant(name)
        cluster.start(name)
    for name in names:
        wait_until(
            lambda name=name: ((cluster.status(name) or {}).get("shards", {}).get(SHARD) or {}).get("mode") == "normal",
            60,
            f"{name} to serve reads",
            interval_s=0.1,
        )
    return cluster, names


def client_nodes(cluster: Cluster, replicants: list[str], clients: int) -> list[str]:
    """Half the clients on cores (round robin), half on replicants."""
    on_cores = (clients + 1) // 2
    nodes = [cluster.names[i % len(cluster.names)] for i in range(on_cores)]
    targets = replicants or cluster.names
    return nodes + [targets[i % len(targets)] for i in range(clients - on_cores)]


def final_reads(cluster: Cluster, keys: int, history: list[Operation]) -> None:
    """One ``linearizable`` read per key after the run, recorded like the clients' reads."""
    with cluster.client(cluster.names[0], timeout_ms=5000, retries=5) as client:
        for key in range(keys):
            invoked = time.monotonic()
            value = row_value(client.get(TABLE, key, consistency="linearizable"))
            history.append(Operation(-1, key, READ, OK, invoked, time.monotonic(), value))


def wait_all_converged(cluster: Cluster, replicants: list[str]) -> dict:
    """Cores converged, then every replicant at the cores' applied key and digest."""
    position = cluster.wait_converged(cluster.names, timeout_s=CONVERGENCE_TIMEOUT_S)

    def replicants_caught_up() -> bool:
        for name in replicants:
            info = ((cluster.status(name) or {}).get("shards") or {}).get(SHARD) or {}
            if info.get("mode") != "normal" or tuple(info.get("applied", ())) != position["applied"]:
                return False
        return True

    wait_until(replicants_caught_up, CONVERGENCE_TIMEOUT_S, "replicants to reach the cores' position", 0.1)
    return position


def check_convergence(cluster: Cluster, names: list[str], position: dict) -> list[str]:
    problems = []
    rows_by_node = {}
    for name in names:
        info = cluster.status(name, timeout_ms=5000)["shards"][SHARD]
        if (tuple(info["applied"]), info["digest"]) != (position["applied"], position["digest"]):
            problems.append(f"{name} at {info['applied']} digest {info['digest']}, expected {position}")
        with cluster.client(name, timeout_ms=5000) as client:
            rows_by_node[name] = list(client.scan(TABLE))
    reference = rows_by_node[names[0]]
    for name in names[1:]:
        if rows_by_node[name] != reference:
            problems.append(f"{name}'s rows differ from {names[0]}'s")
    return problems


def rlog_writes(cluster: Cluster) -> list[tuple[tuple[int, int], int, int | None]]:
    """(tx key, register key, value or None for a delete) of every op on the table, in log order."""
    writes = []
    after: list[int] = [0, 0]
    with cluster.client(cluster.names[0], timeout_ms=10000) as client:
        while page := client.rlog_entries(SHARD, after, RLOG_PAGE_ENTRIES):
            for entry in page:
                for op in entry["ops"]:
                    if op.get("table") != TABLE:
                        continue
                    if op["op"] == "write":
                        writes.append((tuple(entry["tx_key"]), op["row"]["id"], op["row"]["value"]))
                    elif op["op"] == "delete":
                        writes.append((tuple(entry["tx_key"]), op["key"], None))
            after = page[-1]["tx_key"]
    return writes


def check_lost_writes(cluster: Cluster, acknowledged: dict[int, tuple[int, int]]) -> list[str]:
    writes = rlog_writes(cluster)
    logged = {value: tx_key for tx_key, _, value in writes if value is not None}
    if any(later[0] < earlier[0] for earlier, later in zip(writes, writes[1:], strict=False)):
        return ["the rlog is not in tx-key order"]
    lost = []
    for value, tx_key in sorted(acknowledged.items()):
        if value not in logged:
            lost.append(f"value {value} acknowledged at {tx_key} is not in the rlog")
        elif logged[value] != tx_key:
            lost.append(f"value {value} acknowledged at {tx_key} is in the rlog at {logged[value]}")
    final: dict[int, int | None] = {}
    for _, key, value in writes:
        final[key] = value
    with cluster.client(cluster.names[0], timeout_ms=10000) as client:
        rows = {row["id"]: row["value"] for row in client.scan(TABLE)}
    if rows != {key: value for key, value in final.items() if value is not None}:
        lost.append(f"the table {rows} is not the rlog's last write per key {final}")
    return lost


def execute(
    root: Path, processes: list[NodeProcess], settings: RunSettings, network: Network | None = None
) -> RunResult:
    """Run once; every process started is in ``processes`` (the caller kills them, then closes ``network``).

    ``network``: the namespaces of ``settings.node_names()``, needed by network faults."""
    if settings.network_faults and network is None:
        raise ValueError(f"network faults {settings.network_faults} need a Network")
    cluster, replicants = start_cluster(root, processes, settings.replicants, network)
    attached = client_nodes(cluster, replicants, settings.clients)
    connect = [
        functools.partial(cluster.client, name, timeout_ms=settings.client_timeout_ms, retries=1) for name in attached
    ]
    recorder = Recorder(connect, settings.keys, settings.seed)
    nemesis = Nemesis(cluster, replicants, settings.seed, settings.faults, network, settings.schedule)
    origin = time.monotonic()
    recorder.start()
    if settings.faults:
        nemesis.start()
    try:
        time.sleep(settings.duration_s)  # the run's length: nothing to await but the clock
    finally:
        try:
            if settings.faults:
                nemesis.stop()
        finally:
            nemesis.heal()
            recorder.stop()
    try:
        position = wait_all_converged(cluster, replicants)
        history = list(recorder.history)
        final_reads(cluster, settings.keys, history)
        divergence = check_convergence(cluster, cluster.names + replicants, position)
        lost = check_lost_writes(cluster, recorder.acknowledged)
    except (AssertionError, MnesiteError) as error:
        # No convergence (or no answer) after healing is a failure of the run: say how to replay it,
        # and what the clients saw until then (often the cause: a write acknowledged and then lost).
        faults = "\n".join(f"  {record.describe(origin)}" for record in nemesis.log)
        seen = [
            r
            for r in check_history(list(recorder.history), steps_max=settings.steps_max)
            if r.verdict is not Verdict.LINEARIZABLE
        ]
        verdicts = "\n".join(result.report(around=10) for result in seen) or "every key linearizable"
        raise RunFailed(
            f"{error}\nreplay: {settings.replay_command()}\nfaults:\n{faults}\nthe history until then: {verdicts}"
        ) from error
    started = time.monotonic()
    key_results = check_history(history, steps_max=settings.steps_max)
    network_kinds = partitions.figures(nemesis.log, history, recorder.refusals, attached)
    return RunResult(
        settings,
        history,
        key_results,
        lost,
        divergence,
        dict(recorder.counts),
        dict(recorder.errors),
        [record.describe(origin) for record in nemesis.log],
        nemesis.skipped,
        nemesis.generation(),
        position,
        time.monotonic() - started,
        list(nemesis.log),
        network_kinds,
    )


def run_and_clean_up(root: Path, settings: RunSettings) -> RunResult:
    processes: list[NodeProcess] = []
    network = Network.create(settings.node_names(), root) if settings.network_faults else None
    try:
        return execute(root, processes, settings, network)
    finally:
        for process in processes:
            try:
                process.signal(signal.SIGCONT)  # a stopped process must run to die
                process.kill()
            except Exception as error:  # keep killing the others
                print(f"could not kill {process.config_path}: {error!r}", file=sys.stderr)
        if network is not None:
            network.close()


def parse_faults(text: str) -> tuple[str, ...]:
    """Comma-separated fault names; ``none``, ``processes`` (the default set) and ``partitions`` (every
    network fault) name groups."""
    if text in ("", "none"):
        return ()
    groups = {"processes": FAULTS, "partitions": PARTITION_FAULTS}
    faults: list[str] = []
    for part in (part.strip() for part in text.split(",")):
        for fault in groups.get(part, (part,) if part else ()):
            if fault not in faults:
                faults.append(fault)
    unknown = set(faults) - set(ALL_FAULTS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown faults {sorted(unknown)}; known: {', '.join(ALL_FAULTS)} (groups: processes, partitions)"
        )
    return tuple(faults)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=300)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument(
        "--faults",
        type=parse_faults,
        default=FAULTS,
        help="comma-separated fault names or groups ('processes', the default; 'partitions', which needs root "
        "for network namespaces), or 'none'",
    )
    parser.add_argument(
        "--schedule", choices=SCHEDULES, default="random", help="faults at random, or in shuffled rounds of each"
    )
    parser.add_argument("--steps-max", type=int, help="checker search budget per key (default: 1000 per operation)")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep it (logs, data)")
    parser.add_argument("--json", type=Path, help="also write the summary figures to this file")
    parser.add_argument("--history", type=Path, help="also write every recorded operation, one JSON object a line")
    arguments = parser.parse_args(argv)
    settings = RunSettings(
        arguments.seed,
        arguments.duration_s,
        arguments.clients,
        arguments.keys,
        faults=arguments.faults,
        steps_max=arguments.steps_max,
        schedule=arguments.schedule,
    )
    print(f"fault run: {settings.replay_command()}", flush=True)
    if settings.network_faults and (reason := netns.unavailable()) is not None:
        print(f"cannot run network faults {', '.join(settings.network_faults)}: {reason}", file=sys.stderr)
        return 2
    if arguments.keep:
        arguments.keep.mkdir(parents=True, exist_ok=True)
        result = run_and_clean_up(arguments.keep, settings)
    else:
        with tempfile.TemporaryDirectory(prefix="mnesite-fault-") as root:
            result = run_and_clean_up(Path(root), settings)
    if result.passed:
        print(result.summary() + "\nfaults:\n" + "\n".join(f"  {fault}" for fault in result.faults))
    else:
        print(result.failure_report())
    if arguments.history:
        with open(arguments.history, "w") as out:
            for operation in result.history:
                out.write(json.dumps(dataclasses.asdict(operation)) + "\n")  # inf is written as Infinity
    if arguments.json:
        arguments.json.write_text(
            json.dumps(
                {
                    "seed": settings.seed,
                    "duration_s": settings.duration_s,
                    "passed": result.passed,
                    "operations": len(result.history),
                    "counts": result.counts,
                    "acknowledged_writes": result.acknowledged_writes(),
                    "violations": [r.key for r in result.violations],
                    "undetermined": [r.key for r in result.undetermined],
                    "lost_writes": len(result.lost_writes),
                    "divergence": result.divergence,
                    "faults": result.faults,
                    "generation_final": result.generation_final,
                    "network_faults": {name: kind.as_dict() for name, kind in result.network_kinds.items()},
                    "network_problems": result.network_problems,
                },
                indent=2,
            )
        )
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
