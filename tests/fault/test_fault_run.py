"""The short fixed-seed fault run of CI: 3 cores and 2 replicants as real processes, 10 clients, the
nemesis at a fixed seed; then convergence, no lost acknowledged write and per-key linearizability.
``make fault-test`` runs the long version (``tests/fault/run.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fault.run import RunSettings, execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SEED = int(os.environ.get("MNESITE_FAULT_SEED", "20261122"))
DURATION_S = float(os.environ.get("MNESITE_FAULT_DURATION_S", "45"))


def test_a_short_fault_run_is_linearizable_converges_and_loses_nothing(tmp_path: Path, node_processes) -> None:
    settings = RunSettings(seed=SEED, duration_s=DURATION_S)
    result = execute(tmp_path, node_processes, settings)
    print(result.summary())
    if not result.passed:
        pytest.fail(result.failure_report(), pytrace=False)
    # A green run must have exercised something: faults happened and writes were acknowledged through them.
    assert len(result.faults) >= 3, result.summary()
    assert result.acknowledged_writes() >= 500, result.summary()


def test_lost_disks_under_load_lose_no_acknowledged_write(tmp_path: Path, node_processes) -> None:
    """Cores rebuilt on empty disks (``lose_disk``: declared ``initial_cluster_state = "existing"``),
    between sequencer kills, under the same clients and checks: every acknowledged write survives,
    every key stays linearizable, and each rebuilt core catches up."""
    settings = RunSettings(seed=SEED, duration_s=25, faults=("lose_disk", "kill_sequencer"), schedule="rounds")
    result = execute(tmp_path, node_processes, settings)
    print(result.summary())
    if not result.passed:
        pytest.fail(result.failure_report(), pytrace=False)
    rebuilt = [record for record in result.records if record.fault == "lose_disk"]
    assert rebuilt and all("caught up" in record.note or "run stopped" in record.note for record in rebuilt)
    assert any("caught up past" in record.note for record in rebuilt), result.summary()
    assert result.acknowledged_writes() >= 300, result.summary()
