"""The fault run's command line: the replay command names the seed and the faults, and bad fault
names are refused (fast: no processes)."""

from __future__ import annotations

import argparse
import math

import pytest

from tests.fault.checker import CAS, OK, READ, UNKNOWN, WRITE, Operation, check_history
from tests.fault.nemesis import FAULTS
from tests.fault.run import RunResult, RunSettings, parse_faults

pytestmark = pytest.mark.timeout(30)


def test_fault_names_are_checked_and_none_means_no_fault() -> None:
    assert parse_faults("none") == ()
    assert parse_faults("kill_sequencer, pause_follower") == ("kill_sequencer", "pause_follower")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown faults"):
        parse_faults("kill_sequencer,unplug_the_rack")


def test_a_failing_run_prints_its_seed_the_replay_command_and_the_history() -> None:
    settings = RunSettings(seed=4242, duration_s=60, faults=FAULTS)
    history = [
        Operation(0, 3, WRITE, OK, 0.0, 1.0, 10),
        Operation(0, 3, WRITE, OK, 2.0, 3.0, 20),
        Operation(1, 3, READ, OK, 4.0, 5.0, 10),
        Operation(2, 3, CAS, UNKNOWN, 6.0, math.inf, 30, 20),
    ]
    result = RunResult(settings, history, check_history(history), [], [], {"write ok": 2}, {}, [], [], 3)
    assert not result.passed
    report = result.failure_report()
    assert "seed 4242" in report and "FAIL" in report
    assert "python -m tests.fault.run --seed 4242 --duration-s 60" in report
    assert "key 3: violation" in report and "read -> 10" in report


def test_fault_groups_expand_and_network_faults_are_named_in_the_replay_command() -> None:
    from tests.fault.partitions import PARTITION_FAULTS

    assert parse_faults("partitions") == PARTITION_FAULTS
    assert parse_faults("processes,slow_link") == (*FAULTS, "slow_link")
    settings = RunSettings(seed=9, duration_s=300, faults=parse_faults("partitions"), schedule="rounds")
    assert settings.network_faults == PARTITION_FAULTS
    assert settings.node_names() == ["core1", "core2", "core3", "replicant1", "replicant2"]
    assert "--faults partition_sequencer,partition_split" in settings.replay_command()
    assert settings.replay_command().endswith("--schedule rounds")
