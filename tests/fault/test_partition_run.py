"""The CI-sized partition run: 3 cores and 2 replicants, each in a network namespace of its own,
10 clients, every network fault of ``tests.fault.partitions`` in shuffled rounds at a fixed seed;
then convergence, no lost acknowledged write, per-key linearizability, and proof that the faults were
real (each kind injected, no write acknowledged on a minority side during a cut, failures seen there,
writes acknowledged on the majority side). ``make partition-test`` runs the long version.

Namespaces need root and iproute2: without them these tests are skipped with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault import netns
from tests.fault.netns import Network
from tests.fault.partitions import PARTITION_FAULTS
from tests.fault.run import RunSettings, execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SEED = int(os.environ.get("MNESITE_PARTITION_SEED", "20261124"))
DURATION_S = float(os.environ.get("MNESITE_PARTITION_DURATION_S", "60"))


def network_for(settings: RunSettings, root: Path, kind: type[Network] = Network) -> Network:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here, so no partition test: {reason}")
    return kind.create(settings.node_names(), root)


@pytest.fixture
def networks() -> Iterator[list[Network]]:
    """Closed at teardown (after ``node_processes`` killed the nodes: fixtures tear down in reverse)."""
    made: list[Network] = []
    try:
        yield made
    finally:
        for network in made:
            network.close()


def test_a_short_partition_run_is_linearizable_converges_and_its_partitions_were_real(
    tmp_path: Path, networks: list[Network], node_processes
) -> None:
    settings = RunSettings(seed=SEED, duration_s=DURATION_S, faults=PARTITION_FAULTS, schedule="rounds")
    networks.append(network_for(settings, tmp_path))
    result = execute(tmp_path, node_processes, settings, networks[0])
    print(result.summary())
    if not result.passed:  # includes result.network_problems: a kind never injected, a minority that acknowledged
        pytest.fail(result.failure_report(), pytrace=False)
    assert set(result.network_kinds) == set(PARTITION_FAULTS), result.summary()
    assert result.acknowledged_writes() >= 500, result.summary()
    minority_failures = sum(kind.minority_failures for kind in result.network_kinds.values())
    assert minority_failures >= 10, result.summary()
    # The sequencer cut off: the majority elected another one within the hold.
    assert result.network_kinds["partition_sequencer"].majority_acks > 0, result.summary()


class CutNothing(Network):
    """A mutation of the network layer: every cut is a no-op, so no partition happens."""

    def cut(self, sender: str, receiver: str) -> None:
        self.cuts.add((sender, receiver))

    def restore(self, sender: str, receiver: str) -> None:
        self.cuts.discard((sender, receiver))


def test_a_run_whose_cuts_do_nothing_is_caught(tmp_path: Path, networks: list[Network], node_processes) -> None:
    """The run's own checks must notice a nemesis that does not partition (the minority side acknowledges)."""
    faults = ("partition_sequencer", "partition_replicant")
    settings = RunSettings(seed=SEED, duration_s=20, faults=faults, schedule="rounds")
    networks.append(network_for(settings, tmp_path, CutNothing))
    result = execute(tmp_path, node_processes, settings, networks[0])
    print(result.summary())
    assert not result.passed, result.summary()
    problems = "\n".join(result.network_problems)
    assert "acknowledged on the minority side" in problems, problems
    assert not result.violations and not result.lost_writes, "without partitions the cluster itself stays correct"
