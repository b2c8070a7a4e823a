"""Deterministic simulation of full disks among the other faults (see tests/sim/disk.py).

CI runs ``CI_SEEDS`` seeds, ``make test-fast`` the first ``FAST_SEEDS`` (the others are marked deep).
Replay one seed with ``MNESITE_SIM_SEED=12 .venv/bin/pytest tests/test_disk_simulation.py -k seed_12``;
run more locally with ``MNESITE_DISK_SIM_SEEDS=2000``.
"""

from __future__ import annotations

import pytest
from mnesite.core.consensus import Role, ShardConsensus

from tests.conftest import simulation_seeds
from tests.sim.disk import DiskFullSimulation, run_disk_seed

CI_SEEDS = 80
FAST_SEEDS = 20  # the developers' fast lane runs these; the others are marked deep


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_DISK_SIM_SEEDS", FAST_SEEDS))
def test_seed(seed: int) -> None:
    simulation = run_disk_seed(seed)
    assert simulation.result is not None and simulation.result.committed_entries >= 4


@pytest.mark.timeout(60)
def test_the_seeds_fill_disks_and_fail_writing_steps() -> None:
    """Or the seeds above checked nothing of rlog.disk."""
    simulations = [run_disk_seed(seed) for seed in range(20)]
    assert sum(s.fills for s in simulations) >= 20
    assert sum(s.failed_steps for s in simulations) >= 10


def _quiet(seed: int) -> DiskFullSimulation:
    simulation = DiskFullSimulation(seed, 3, fill_probability=0.0, all_fill_probability=0.0)
    simulation._heal()  # no other fault: only the disks chosen below
    simulation.run_until_quiet()
    return simulation


def _writes_acknowledged(simulation: DiskFullSimulation, target: str, writes: int, duration_ms: int) -> int:
    end_ms = simulation.now_ms + duration_ms
    sent: list[str] = []
    while simulation.now_ms < end_ms:
        if len(sent) < writes and simulation.now_ms % 50 == 0:
            simulation.write(target)
            sent.append(f"w{simulation.write_count}")
        simulation.advance()
    # Only these writes: an earlier one resent by its client may be acknowledged meanwhile too.
    return sum(request_id in simulation.acknowledged for request_id in sent)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(5))
def test_a_full_sequencer_steps_down_and_the_majority_keeps_acknowledging(seed: int) -> None:
    simulation = _quiet(seed)
    old = simulation.run_until_quiet()
    assert old.machine is not None
    generation = old.machine.generation
    simulation.fill(old.name, 60_000)
    simulation.write(old.name)  # its entry's step meets the full disk
    for _ in range(100):
        simulation.advance()
    assert old.machine is not None and old.machine.disk_full and old.machine.role is Role.FOLLOWER
    others = [node for node in simulation.nodes.values() if node.name != old.name]
    new = next(node for node in others if node.machine is not None and node.machine.role is Role.SEQUENCER)
    assert new.machine is not None and new.machine.generation > generation
    assert _writes_acknowledged(simulation, new.name, 10, 2000) == 10
    # Never elected while full, however long it lasts.
    assert old.machine.role is Role.FOLLOWER
    assert all(holder != old.name for g, holder in simulation.sequencer_of_generation.items() if g > generation)
    simulation.full_until_ms[old.name] = simulation.now_ms
    final = simulation.run_until_quiet()
    simulation.final_check(final)
    assert old.applied_key == final.applied_key, "once freed it caught up"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(5))
def test_a_full_follower_takes_no_part_and_the_majority_keeps_acknowledging(seed: int) -> None:
    simulation = _quiet(seed)
    sequencer = simulation.run_until_quiet()
    follower = next(node for node in simulation.nodes.values() if node.name != sequencer.name)
    simulation.fill(follower.name, 60_000)
    assert _writes_acknowledged(simulation, sequencer.name, 10, 2000) == 10
    assert follower.machine is not None and follower.machine.disk_full
    held = follower.log.last_key()
    assert held < sequencer.log.last_key(), "it persisted nothing while full"
    simulation.full_until_ms[follower.name] = simulation.now_ms
    final = simulation.run_until_quiet()
    simulation.final_check(final)
    assert final.name == sequencer.name, "a full follower deposes nobody"


@pytest.mark.timeout(60)
def test_without_the_full_disk_rule_full_cores_keep_campaigning_into_their_full_disks(monkeypatch) -> None:
    """Mutation: DiskFull changes nothing in the machine. Every core's disk is full: with the rule
    they stay quiet until freed; without it they keep (pre-)voting and campaigning, and each
    campaign's write meets the full disk again."""

    def failed_steps(seed: int) -> int:
        simulation = _quiet(seed)
        sequencer = simulation.run_until_quiet()
        for name in simulation.nodes:
            simulation.fill(name, 60_000)
        simulation.write(sequencer.name)
        for _ in range(300):
            simulation.advance()
        return simulation.failed_steps

    with_rule = [failed_steps(seed) for seed in range(3)]
    monkeypatch.setattr(ShardConsensus, "_on_disk_full", lambda self, event: None)
    without_rule = [failed_steps(seed) for seed in range(3)]
    assert max(with_rule) <= 3, with_rule  # one failing step per core, then quiet
    assert min(without_rule) > 5 * max(with_rule), (with_rule, without_rule)
