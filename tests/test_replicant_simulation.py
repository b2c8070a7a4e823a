"""Deterministic simulation of cores with replicants under faults (see tests/sim/replicants.py).

CI runs ``CI_SEEDS`` seeds (even seeds: 3 cores, odd seeds: 5 cores; 2 or 3 replicants), ``make
test-fast`` the first ``FAST_SEEDS`` (the others are marked deep). Replay one
seed with ``MNESITE_SIM_SEED=123 .venv/bin/pytest tests/test_replicant_simulation.py -k seed_123``;
run more locally with ``MNESITE_SIM_SEEDS=5000``.
"""

from __future__ import annotations

import dataclasses

import pytest
from mnesite.core import agent_server, watch
from mnesite.replicant import reads
from mnesite.replicant.replica import ShardReplica
from mnesite.rlog.replication import Mode, PushReceived
from mnesite.rlog.types import Entry, TxKey

from tests.conftest import simulation_seeds
from tests.sim.cluster import SimulationFailure
from tests.sim.replicants import ReplicantSimulation, replay_command, run_replicant_seed

CI_SEEDS = 120
FAST_SEEDS = 30  # the developers' fast lane runs these; the others are marked deep


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_SIM_SEEDS", FAST_SEEDS))
def test_seed(seed):
    result = run_replicant_seed(seed)
    # Every run must commit something and connect every replicant at least once, or it checked nothing.
    assert result.committed_entries >= 4
    assert result.bootstraps + result.resumes >= result.replicant_count


@pytest.mark.deep  # over CI's seeds, most of them deep
@pytest.mark.timeout(60)
def test_the_ci_seeds_cover_bootstraps_with_dirty_copies_resumes_rejections_and_crashes():
    totals = {"bootstraps": 0, "resumes": 0, "rows_copied": 0, "pushes_rejected": 0, "replicant_crashes": 0}
    totals["runs_pushed"] = 0  # bulk writes packed as one run of rows (cluster version 2), decoded by replicants
    for seed in range(0, CI_SEEDS, 4):
        result = run_replicant_seed(seed)
        for name in totals:
            totals[name] += getattr(result, name)
    assert all(value > 0 for value in totals.values()), totals


@pytest.mark.timeout(30)
def test_the_same_seed_replays_the_same_run():
    assert run_replicant_seed(7) == run_replicant_seed(7)


def _first_failure(replica_class: type[ShardReplica]) -> tuple[int, SimulationFailure] | None:
    for seed in range(CI_SEEDS):
        try:
            run_replicant_seed(seed, replica_class=replica_class)
        except SimulationFailure as failure:
            return seed, failure
    return None


class _AcceptsAnyAgent(ShardReplica):
    """Broken fencing: a push from any agent is taken as one from the watched agent (and read: the
    driver decodes the entries of any push the replica takes, ``replicant.replica.push_received``)."""

    def takes_push(self, core, agent_id, accepted=None) -> bool:
        return True

    def _on_push(self, event: PushReceived) -> None:
        if self._mode in (Mode.NORMAL, Mode.BOOTSTRAP) and self._upstream is not None and self._agent_id is not None:
            event = dataclasses.replace(event, core=self._upstream, agent_id=self._agent_id)
        super()._on_push(event)


class _TrustsPushes(ShardReplica):
    """Broken contiguity: every entry after the position is taken, without the prev and digest checks."""

    def _new_entries(self, event: PushReceived, key: TxKey, digest: bytes) -> tuple[Entry, ...]:
        return tuple(entry for entry in event.entries if entry.tx_key > key)


class _NoReadFence(ShardReplica):
    """Broken read fence: reads are served as soon as the replay ends, dirty copy or not."""

    def readable(self) -> bool:
        return self._mode is Mode.NORMAL


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "broken", [_AcceptsAnyAgent, _TrustsPushes, _NoReadFence], ids=lambda cls: cls.__name__.strip("_")
)
def test_the_simulator_catches_a_broken_replica(broken):
    found = _first_failure(broken)
    assert found is not None, f"no violation caught in {CI_SEEDS} seeds with {broken.__name__}"
    seed, failure = found
    assert f"seed {seed} " in str(failure)
    assert replay_command(seed) in str(failure)
    print(f"{broken.__name__} caught at seed {seed}: {str(failure).splitlines()[0]}")


@pytest.mark.timeout(60)
def test_replicants_serve_linearizable_reads_that_the_history_check_accepts():
    checked = 0
    for seed in range(4):
        simulation = ReplicantSimulation(seed, 3 if seed % 2 == 0 else 5, 2)
        simulation.run()
        checked += simulation.replicant_reads_checked
    assert checked > 0


def _resume_without_the_digest_check(
    from_key, from_digest, trimmed_key, committed_key, committed_digest, digest_at, core
):
    """Mutation of the resume rule: resume from any retained committed key, whatever digest the replica has
    there (a replicant whose database position is unknown is told to resume from genesis)."""
    if from_key <= committed_key and trimmed_key <= from_key and digest_at(from_key) is not None:
        return "resume", from_key, digest_at(from_key)
    return _DECIDE_WATCH(from_key, from_digest, trimmed_key, committed_key, committed_digest, digest_at, core)


_DECIDE_WATCH = watch.decide_watch
RESUME_SEED = 2


@pytest.mark.timeout(120)
def test_the_simulator_catches_a_resume_rule_without_the_digest_check(monkeypatch):
    result = run_replicant_seed(RESUME_SEED)  # the real rule passes this seed, with resumes
    assert result.resumes > 0
    # The simulator's cores run production's agent server: mutate the rule where it calls it.
    monkeypatch.setattr(agent_server, "decide_watch", _resume_without_the_digest_check)
    # The replica refuses a resume at its key with another digest (defence in depth), so the wrong
    # answer shows as replicas that never converge: the simulator's end check catches it.
    with pytest.raises(SimulationFailure, match=f"seed {RESUME_SEED} .*replicas did not converge"):
        run_replicant_seed(RESUME_SEED)


HELD_READ_SEEDS = (1, 4, 6)  # seeds whose draws give the mutation a linearizable read to spoil


@pytest.mark.timeout(120)
def test_the_simulator_catches_a_held_read_answered_before_its_replica_reached_the_read_index(monkeypatch):
    """replicant.reads: a linearizable read at a replicant waits until the replica is readable at the
    read index its sequencer confirmed. Answered at once instead, it returns stale rows."""
    for seed in HELD_READ_SEEDS:
        run_replicant_seed(seed)  # the real rule passes these seeds
    monkeypatch.setattr(reads.WaitingRead, "is_ready", lambda self, table_shard, readable: True)
    for seed in HELD_READ_SEEDS:
        with pytest.raises(SimulationFailure, match=f"seed {seed} .*replicant linearizable read"):
            run_replicant_seed(seed)
