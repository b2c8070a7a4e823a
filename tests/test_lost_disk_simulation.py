"""Deterministic simulation of lost disks among the other faults (see tests/sim/lost_disk.py).

Replay one seed with ``MNESITE_SIM_SEED=12 .venv/bin/pytest tests/test_lost_disk_simulation.py -k seed_12``;
run more locally with ``MNESITE_LOST_DISK_SIM_SEEDS=2000``.
"""

from __future__ import annotations

import os

import pytest

from tests.sim import SimulationFailure
from tests.sim.lost_disk import run_lost_disk_seed

CI_SEEDS = 40


def _seeds() -> list[int]:
    if os.environ.get("MNESITE_SIM_SEED"):
        return [int(os.environ["MNESITE_SIM_SEED"])]
    return list(range(int(os.environ.get("MNESITE_LOST_DISK_SIM_SEEDS", CI_SEEDS))))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _seeds(), ids=lambda seed: f"seed_{seed}")
def test_seed(seed: int) -> None:
    simulation = run_lost_disk_seed(seed)
    assert simulation.result is not None and simulation.result.committed_entries >= 4


@pytest.mark.timeout(60)
def test_the_seeds_lose_disks() -> None:
    """Or the seeds above checked nothing of core.recovery."""
    simulations = [run_lost_disk_seed(seed) for seed in range(20)]
    assert sum(s.disks_lost for s in simulations) >= 10


@pytest.mark.timeout(120)
def test_the_simulator_catches_a_recovery_without_the_vote_floor(monkeypatch) -> None:
    """Mutation: recovery names no floor (the rule before it). Some seed loses an acknowledged write."""
    from tests.sim import cluster

    monkeypatch.setattr(cluster, "recovered_vote_floors", lambda answers: {})
    with pytest.raises(SimulationFailure):
        for seed in range(200):
            run_lost_disk_seed(seed)
