"""Issue 24, first part, on real processes: one memory budget for every replicant stream of a core.

A core holds about 10 MB of log and two live replicants apply its writes; then 256 ``watch``
requests from ``[0, 0]`` (genesis digest: the agent resumes from the start of the log and would push
all of it) name endpoints where nothing listens. The core's RSS must grow by at most 32 MB, and the
live replicants' replication lag (a write acknowledged at the core, then a read at the replicant
with ``after_tx_key``, which the replicant holds until it has applied the write, as
benchmarks/bench_catchup.py measures it) keeps its p99 under 50 ms meanwhile.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import zmq
from mnesite.rlog import messages
from mnesite.rlog.client import MnesiteError
from mnesite.rlog.messages import Message
from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION
from mnesite.rlog.types import GENESIS_DIGEST

from tests.conftest import Cluster, free_port, wait_until
from tests.fuzz.runner import rss_kb

pytestmark = pytest.mark.slow

LOG_BYTES = 10 * 1024 * 1024
ROW_BYTES = 10 * 1024
ROWS_PER_TRANSACTION = 10
DEAD_WATCHES = 256
RSS_GROWTH_MB_MAX = 32
LAG_P99_MS_MAX = 50
# After the last dead watch, the window watched for RSS and lag: the agents of dead endpoints would
# push (and zmq would queue) for their whole ack_timeout_ms (10 s) without the budget; 6 s of it is
# far more than the 1,700 MB the issue saw needed.
OBSERVE_AFTER_S = 6.0
PROBE_INTERVAL_S = 0.02
BASELINE_S = 3.0


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def shard_of(cluster: Cluster, name: str) -> dict:
    status = cluster.status(name) or {}
    return (status.get("shards") or {}).get("default") or {}


def write_log(cluster: Cluster, total_bytes: int) -> tuple[int, int]:
    """Write about ``total_bytes`` of rows through the client; the last tx key."""
    key = (0, 0)
    with cluster.client("core1", timeout_ms=10_000) as client:
        client.create_table("blob", "id", [("id", "INTEGER"), ("data", "TEXT")])
        for transaction in range(total_bytes // (ROW_BYTES * ROWS_PER_TRANSACTION)):
            ops = [
                {"op": "write", "table": "blob", "row": {"id": transaction * ROWS_PER_TRANSACTION + n,
                                                         "data": f"{transaction:08d}" * (ROW_BYTES // 8)}}
                for n in range(ROWS_PER_TRANSACTION)
            ]  # fmt: skip
            key = tuple(client.transact(ops))
        client.create_table("probe", "id", [("id", "INTEGER"), ("replicant", "TEXT")])
    return key


def start_replicants(cluster: Cluster, names: list[str], applied: tuple[int, int]) -> None:
    for name in names:
        cluster.add_replicant(name)
        cluster.start(name)
    for name in names:
        wait_until(
            lambda name=name: (
                shard_of(cluster, name).get("mode") == "normal"
                and tuple(shard_of(cluster, name).get("applied", (0, 0))) >= applied
            ),
            90,
            f"{name} to apply the log and serve reads",
            interval_s=0.2,
        )


class LagProbe:
    """One thread per replicant: write a row at the core, then read it at the replicant with
    ``after_tx_key`` = the write's key; lag = acknowledgement to answer (bench_catchup's measure)."""

    def __init__(self, cluster: Cluster, replicants: list[str]) -> None:
        self.cluster = cluster
        self.stop_event = threading.Event()
        self.recording = threading.Event()
        self.lags_ms: dict[str, list[float]] = {name: [] for name in replicants}
        self.errors: dict[str, list[str]] = {name: [] for name in replicants}
        self.rounds = {name: 0 for name in replicants}
        self.threads = [
            threading.Thread(target=self._run, args=(index, name), daemon=True) for index, name in enumerate(replicants)
        ]

    def _run(self, index: int, name: str) -> None:
        row_id = index * 10**7
        with self.cluster.client("core1", timeout_ms=5000) as core, self.cluster.client(name, timeout_ms=5000) as probe:
            while not self.stop_event.is_set():
                row_id += 1
                try:
                    key = core.put("probe", {"id": row_id, "replicant": name})
                    acknowledged_s = time.monotonic()
                    row = probe.get("probe", row_id, after_tx_key=key)
                    lag_ms = (time.monotonic() - acknowledged_s) * 1000
                    if row != {"id": row_id, "replicant": name}:
                        raise AssertionError(f"{name} answered {row!r} for row {row_id}")
                except (MnesiteError, AssertionError) as error:
                    if self.recording.is_set():
                        self.errors[name].append(str(error))
                    continue
                self.rounds[name] += 1
                if self.recording.is_set():
                    self.lags_ms[name].append(lag_ms)
                time.sleep(PROBE_INTERVAL_S)

    def start(self) -> LagProbe:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(15)


class RssSampler:
    """The peak VmRSS of a process, sampled every 20 ms from a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kb = rss_kb(pid)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_event.wait(0.02):
            try:
                self.peak_kb = max(self.peak_kb, rss_kb(self.pid))
            except (OSError, AssertionError):
                return  # the process is gone: the test fails on its own

    def start(self) -> RssSampler:
        self.thread.start()
        return self

    def stop(self) -> int:
        self.stop_event.set()
        self.thread.join(5)
        return self.peak_kb


def send_dead_watches(endpoint: str, count: int) -> int:
    """``count`` watches from [0, 0] with the genesis digest (the agent resumes from the start of the
    log) to endpoints where nothing listens; how many were answered."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    answered = 0
    try:
        for index in range(count):
            body = {
                "shard": "default",
                "replicant": f"ghost{index}",
                "endpoint": f"tcp://127.0.0.1:{free_port()}",  # nobody listens there
                "from": [0, 0],
                "from_digest": GENESIS_DIGEST,
                # What a replicant of this release names once the cluster version moved (issue 23).
                "protocol": REPLICATION_PROTOCOL_VERSION,
            }
            socket.send(messages.encode(Message("watch", f"w{index}", body)))
            if socket.poll(5000):
                answer = messages.decode(socket.recv())
                answered += answer.kind == "reply"
    finally:
        socket.close(0)
    return answered


def lag_figures(lags_ms: dict[str, list[float]]) -> dict[str, tuple[int, float, float]]:
    """Per replicant: (samples, p50 ms, p99 ms, the three worst ms)."""
    return {
        name: (
            len(values),
            round(percentile(values, 0.5), 1),
            round(percentile(values, 0.99), 1),
            [round(value) for value in sorted(values)[-3:]],
        )
        for name, values in lags_ms.items()
        if values
    }


# About 30 s here (a 10 MB log written and copied to two replicants, 3 s of baseline, 256 watches,
# 6 s observed); 120 s leaves room for a loaded machine.
@pytest.mark.timeout(120)
def test_256_dead_watches_against_a_10_mb_log_cost_at_most_32_mb_and_live_replicants_keep_their_lag(
    tmp_path: Path, node_processes
) -> None:
    cluster = Cluster(tmp_path, node_processes, size=1, secure=False)  # raw zmq watches, no CurveZMQ
    # Pushes at once: the push delay adds up to push_delay_ms_max to every lag on purpose (core.agent's
    # "Push delay"); what is measured here is what the dead watches cost the live replicants.
    cluster.extend_core_configs("[limits]\npush_delay_ms_max = 0\n")
    cluster.start_all()
    applied = write_log(cluster, LOG_BYTES)
    start_replicants(cluster, ["replicant1", "replicant2"], applied)
    probe = LagProbe(cluster, ["replicant1", "replicant2"]).start()
    try:
        # The first rounds (connections being made) are not recorded.
        wait_until(lambda: min(probe.rounds.values()) >= 20, 30, "the lag probes to run")
        # A baseline without dead watches, for scale in the report (the machine's own noise).
        probe.recording.set()
        time.sleep(BASELINE_S)
        probe.recording.clear()
        baseline = lag_figures(probe.lags_ms)
        for values in probe.lags_ms.values():
            values.clear()
        pid = cluster.nodes["core1"].process.pid
        rss_before_kb = rss_kb(pid)
        sampler = RssSampler(pid).start()
        probe.recording.set()
        began = time.monotonic()
        answered = send_dead_watches(cluster.endpoints["core1"], DEAD_WATCHES)
        flood_s = time.monotonic() - began
        deadline = time.monotonic() + OBSERVE_AFTER_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
        peak_kb = sampler.stop()
        probe.recording.clear()
        status = cluster.status("core1", timeout_ms=5000)
    finally:
        probe.stop()
    grown_mb = (peak_kb - rss_before_kb) / 1024
    lags = lag_figures(probe.lags_ms)
    print(
        f"\n{DEAD_WATCHES} dead watches against a 10 MB log (sent in {flood_s:.1f} s): core RSS "
        f"{rss_before_kb // 1024} MB -> peak {peak_kb // 1024} MB (+{grown_mb:.1f} MB); lag (samples, p50 ms, "
        f"p99 ms, worst ms) {lags}, baseline before the watches {baseline}; budget {(status or {}).get('agent_budget')}"
    )
    assert answered == DEAD_WATCHES
    assert grown_mb <= RSS_GROWTH_MB_MAX, f"core RSS grew by {grown_mb:.1f} MB"
    for name in ("replicant1", "replicant2"):
        assert not probe.errors[name], probe.errors[name][:3]
        samples, _, p99, _ = lags[name]
        assert samples >= 100, f"{name}: only {samples} lag samples"
        assert p99 < LAG_P99_MS_MAX, f"{name}: lag p99 {p99} ms (baseline {baseline.get(name)})"
    assert status is not None
    budget = status["agent_budget"]
    assert budget["bytes_max"] == 16 * 1024 * 1024  # the default of [limits] agents_bytes_max
    assert budget["evicted_agents"] > 0, "256 dead watches of a 10 MB log never spent the budget"
    assert budget["used_bytes"] <= budget["bytes_max"] + 256 * 1024  # one push beyond, at most
    # The live replicants' agents were never evicted: each is still the one its replicant watches.
    agents = {agent["replicant"]: agent for agent in status["agents"]}
    assert {"replicant1", "replicant2"} <= set(agents)
    for name in ("replicant1", "replicant2"):
        assert shard_of(cluster, name).get("resumes") == 1 and shard_of(cluster, name).get("bootstraps") == 0


@pytest.mark.timeout(120)  # about 20 s here
def test_a_replicant_evicted_for_the_budget_while_paused_watches_again_and_resumes(tmp_path: Path, node_processes):
    """replicant2 is paused (SIGSTOP) while writes go on: its agent fills the budget (64 KiB here)
    with pushes it does not acknowledge, and once silent it is evicted for replicant1, which keeps
    applying. After SIGCONT, replicant2 misses its agent's heartbeats, watches again and resumes from
    its applied key (no bootstrap), then applies what it missed."""
    cluster = Cluster(tmp_path, node_processes, size=1)
    cluster.extend_core_configs("[limits]\nagents_bytes_max = 65536\n")
    cluster.start_all()
    with cluster.client("core1") as client:
        client.create_table("blob", "id", [("id", "INTEGER"), ("data", "TEXT")])
        applied = tuple(client.put("blob", {"id": 0, "data": "start"}))
    start_replicants(cluster, ["replicant1", "replicant2"], applied)
    before = shard_of(cluster, "replicant2")
    cluster.nodes["replicant2"].signal(signal.SIGSTOP)
    try:
        row_id = 0

        def evicted() -> bool:
            nonlocal row_id
            row_id += 1
            with cluster.client("core1") as client:
                client.put("blob", {"id": row_id, "data": "x" * 16_384})
            status = cluster.status("core1") or {}
            replicants = {agent["replicant"] for agent in status.get("agents", [])}
            return status.get("agent_budget", {}).get("evicted_agents", 0) >= 1 and "replicant2" not in replicants

        # Within ack_timeout_ms (10 s): the agent goes for the budget, not for its silence's length.
        wait_until(evicted, 8, "replicant2's agent to be evicted for the budget", interval_s=0.1)
        with cluster.client("core1") as client:
            last = tuple(client.put("blob", {"id": 10**6, "data": "while paused"}))
        wait_until(
            lambda: tuple(shard_of(cluster, "replicant1").get("applied", (0, 0))) >= last,
            10,
            "replicant1 (live) to apply every write meanwhile",
        )
    finally:
        cluster.nodes["replicant2"].signal(signal.SIGCONT)
    wait_until(
        lambda: (
            shard_of(cluster, "replicant2").get("mode") == "normal"
            and tuple(shard_of(cluster, "replicant2").get("applied", (0, 0))) >= last
        ),
        30,
        "replicant2 to watch again and apply what it missed",
        interval_s=0.2,
    )
    after = shard_of(cluster, "replicant2")
    assert after["resumes"] == before["resumes"] + 1 and after["bootstraps"] == before["bootstraps"]
    with cluster.client("replicant2") as client:
        assert client.get("blob", 10**6) == {"id": 10**6, "data": "while paused"}
