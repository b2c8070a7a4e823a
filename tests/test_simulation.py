"""Deterministic simulation of 3- and 5-core clusters under faults (see tests/sim/cluster.py).

CI runs ``CI_SEEDS`` seeds (even seeds: 3 cores, odd seeds: 5 cores). Replay one seed with
``MNESITE_SIM_SEED=123 .venv/bin/pytest tests/test_simulation.py -k seed_123``; run more locally
with ``MNESITE_SIM_SEEDS=5000``.
"""

from __future__ import annotations

import os

import pytest
from mnesite.core.consensus import ShardConsensus

from tests.sim import Simulation, SimulationFailure, run_seed
from tests.sim.cluster import replay_command

CI_SEEDS = 240


def _seeds() -> list[int]:
    if os.environ.get("MNESITE_SIM_SEED"):
        return [int(os.environ["MNESITE_SIM_SEED"])]
    return list(range(int(os.environ.get("MNESITE_SIM_SEEDS", CI_SEEDS))))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _seeds(), ids=lambda seed: f"seed_{seed}")
def test_seed(seed):
    result = run_seed(seed)
    # Every run must commit something after healing, or it checked nothing.
    assert result.committed_entries >= 4


@pytest.mark.timeout(30)
def test_the_same_seed_replays_the_same_run():
    assert run_seed(7) == run_seed(7)


def _first_failure(seed_count: int) -> tuple[int, SimulationFailure] | None:
    for seed in range(seed_count):
        try:
            run_seed(seed)
        except SimulationFailure as failure:
            return seed, failure
    return None


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_broken_voting_rule(monkeypatch):
    """Granting every vote lets a stale candidate win and overwrite committed entries."""
    monkeypatch.setattr(ShardConsensus, "_candidate_log_is_up_to_date", lambda self, candidate_last_key: True)
    found = _first_failure(CI_SEEDS)
    assert found is not None, f"no violation caught in {CI_SEEDS} seeds with a broken voting rule"
    seed, failure = found
    assert f"seed {seed} " in str(failure)
    assert replay_command(seed) in str(failure)


@pytest.mark.timeout(60)
def test_the_simulator_checkers_catch_a_quorum_that_is_too_small(monkeypatch):
    """With one vote/ack short of a majority, the simulator's own checks (not the machine's) fire."""
    monkeypatch.setattr(ShardConsensus, "_majority", lambda self: max(1, len(self.members) // 2))
    found = _first_failure(CI_SEEDS)
    assert found is not None, f"no violation caught in {CI_SEEDS} seeds with a too small quorum"
    assert "ConsensusInvariantError" not in str(found[1]).splitlines()[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("core_count", [3, 5])
def test_force_start_after_the_majority_is_lost_for_good_keeps_every_acknowledged_write(core_count):
    for seed in range(10):
        simulation = Simulation(seed, core_count)
        sequencer = simulation.run_until_quiet()
        for _ in range(5):
            simulation.write(sequencer.name)
        simulation.run_until_quiet()
        acknowledged = dict(simulation.acknowledged)
        assert len(acknowledged) == 5
        # The cluster was quiet, so every survivor holds every committed entry: nothing is lost.
        names = sorted(simulation.nodes)
        survivors = names[: core_count // 2]
        simulation.lose_for_good(names[core_count // 2 :])
        simulation.force_start(survivors[0], tuple(survivors))
        simulation.write(survivors[0])
        sequencer = simulation.run_until_quiet()
        assert sequencer.name == survivors[0] and sequencer.state.forced
        assert sequencer.machine is not None and sequencer.machine.members == tuple(survivors)
        assert len(simulation.acknowledged) == 6
        assert acknowledged.items() <= simulation.acknowledged.items()
        simulation.final_check(sequencer)
