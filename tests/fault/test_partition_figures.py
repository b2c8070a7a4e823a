"""What a run's history says about its network faults (``partitions.figures`` and ``problems``): fast,
no processes. A minority that acknowledged, a kind never injected, a cut that failed nothing: each
must be reported."""

from __future__ import annotations

import math

import pytest

from tests.fault.checker import CAS, OK, READ, UNKNOWN, WRITE, Operation
from tests.fault.nemesis import FaultRecord
from tests.fault.partitions import Refusal, figures, problems

pytestmark = pytest.mark.timeout(30)

CLIENT_NODES = ["core1", "core2", "core3", "replicant1"]  # process i is attached to CLIENT_NODES[i]


def sequencer_cut(cut_s: float = 10.0, healed_s: float = 15.0) -> FaultRecord:
    record = FaultRecord("partition_sequencer", ["core1"], cut_s - 0.01, healed_s - cut_s, 1)
    record.cut_s, record.healed_s = cut_s, healed_s
    record.minority, record.majority = ["core1"], ["core2", "core3", "replicant1"]
    return record


def healthy_history() -> tuple[list[Operation], list[Refusal]]:
    history = [
        Operation(1, 1, WRITE, OK, 9.0, 9.1, 100),  # before the cut: counts for nothing
        Operation(0, 1, WRITE, UNKNOWN, 10.2, math.inf, 101),  # the minority could not commit
        Operation(1, 1, WRITE, OK, 10.3, 11.2, 102),  # the majority, after its election
        Operation(3, 1, CAS, OK, 11.5, 11.6, 103, 102),
        Operation(0, 1, READ, OK, 10.05, 10.1, 100),  # within the lease's grace: allowed
    ]
    refusals = [Refusal(0, WRITE, 10.2, 12.2, "outcome_unknown"), Refusal(0, READ, 12.3, 13.3, "unavailable")]
    return history, refusals


def test_a_real_partition_gives_majority_acknowledgements_minority_failures_and_a_failover_time() -> None:
    history, refusals = healthy_history()
    kinds = figures([sequencer_cut()], history, refusals, CLIENT_NODES)
    kind = kinds["partition_sequencer"]
    assert (kind.injected, kind.majority_acks, kind.minority_acks, kind.minority_failures) == (1, 2, 0, 2)
    assert kind.failover_s == [pytest.approx(1.2)]
    assert problems(kinds, ["partition_sequencer"]) == []


def test_a_minority_that_acknowledged_or_answered_late_reads_is_a_problem() -> None:
    history, refusals = healthy_history()
    history.append(Operation(0, 2, WRITE, OK, 12.0, 12.5, 200))
    history.append(Operation(0, 2, READ, OK, 12.0, 12.1, 200))  # 2 s into the cut
    found = problems(figures([sequencer_cut()], history, refusals, CLIENT_NODES), ["partition_sequencer"])
    assert any("1 writes acknowledged on the minority side" in p for p in found), found
    assert any("1 linearizable reads answered on the minority side" in p for p in found), found


def test_a_cut_that_failed_nothing_and_a_kind_never_injected_are_problems() -> None:
    history, _ = healthy_history()
    found = problems(figures([sequencer_cut()], history, [], CLIENT_NODES), ["partition_sequencer", "slow_link"])
    assert "slow_link: never injected" in found
    assert any("no operation failed on the minority side" in p for p in found), found


def test_no_write_acknowledged_on_the_majority_side_is_a_problem() -> None:
    _, refusals = healthy_history()
    found = problems(figures([sequencer_cut()], [], refusals, CLIENT_NODES), ["partition_sequencer"])
    assert any("no write acknowledged on the majority side" in p for p in found), found
    assert figures([sequencer_cut()], [], refusals, CLIENT_NODES)["partition_sequencer"].failover_s == [None]


def test_process_faults_and_unhealed_records_are_left_out() -> None:
    history, refusals = healthy_history()
    unhealed = sequencer_cut()
    unhealed.healed_s = None
    kill = FaultRecord("kill_sequencer", ["core1"], 10.0, 2.0, 1)
    assert figures([kill, unhealed], history, refusals, CLIENT_NODES) == {}


def test_what_completes_while_the_links_are_being_restored_is_not_charged_to_the_minority() -> None:
    """The heal restores one route at a time: a minority write acknowledged after the heal began may
    have crossed a restored link, so the minority checks end when the heal begins (2026-11-25: a
    partition run charged the minority one such write)."""
    history, refusals = healthy_history()
    record = sequencer_cut()
    record.healing_s = 14.9
    history.append(Operation(0, 2, WRITE, OK, 14.5, 14.95, 200))  # completed while healing
    assert problems(figures([record], history, refusals, CLIENT_NODES), ["partition_sequencer"]) == []
    history.append(Operation(0, 3, WRITE, OK, 14.5, 14.8, 300))  # completed before the heal began
    found = problems(figures([record], history, refusals, CLIENT_NODES), ["partition_sequencer"])
    assert any("1 writes acknowledged on the minority side" in p for p in found), found
