"""Deterministic simulation of lost disks among the other faults (see tests/sim/lost_disk.py).

CI runs ``CI_SEEDS`` seeds, ``make test-fast`` the first ``FAST_SEEDS`` (the others are marked deep).
Replay one seed with ``MNESITE_SIM_SEED=12 .venv/bin/pytest tests/test_lost_disk_simulation.py -k seed_12``;
run more locally with ``MNESITE_LOST_DISK_SIM_SEEDS=2000``.
"""

from __future__ import annotations

import pytest

from tests.conftest import simulation_seeds
from tests.sim import SimulationFailure
from tests.sim.lost_disk import LostDiskSimulation, run_lost_disk_seed

CI_SEEDS = 40
FAST_SEEDS = 10  # the developers' fast lane runs these; the others are marked deep


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_LOST_DISK_SIM_SEEDS", FAST_SEEDS))
def test_seed(seed: int) -> None:
    simulation = run_lost_disk_seed(seed)
    assert simulation.result is not None and simulation.result.committed_entries >= 4


@pytest.mark.timeout(60)
def test_the_seeds_lose_disks() -> None:
    """Or the seeds above checked nothing of core.recovery."""
    simulations = [run_lost_disk_seed(seed) for seed in range(20)]
    assert sum(s.disks_lost for s in simulations) >= 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [8, 18, 146])  # of the first 200 seeds, the ones the mutation fails
def test_the_simulator_catches_a_recovery_without_the_vote_floor(monkeypatch, seed: int) -> None:
    """Mutation: recovery names no floor (the rule before it): a core without the writes the rebuilt
    core helped commit is elected and would replace them."""
    from tests.sim import cluster

    monkeypatch.setattr(cluster, "recovered_vote_floors", lambda answers: {})
    with pytest.raises(SimulationFailure, match="would replace committed entries"):
        run_lost_disk_seed(seed)


class _Undeclared(LostDiskSimulation):
    """The operator starts rebuilt cores without ``initial_cluster_state = "existing"``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rebuilt_cores_declared_existing = False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [46, 176, 240, 310])  # of the first 400 seeds, the ones the mutation fails
def test_the_simulator_catches_rebuilt_cores_not_declared_existing(monkeypatch, seed: int) -> None:
    """Mutation: a rebuilt core that reaches only cores that never saw an election takes itself for a
    core of a new cluster, forgets its votes and its floor: two sequencers of a generation, or
    committed entries replaced."""
    from tests.sim import lost_disk

    monkeypatch.setattr(lost_disk, "LostDiskSimulation", _Undeclared)
    with pytest.raises(SimulationFailure):
        run_lost_disk_seed(seed)
