"""The linearizability checker on hand-made histories: it must fail each doctored one and pass the
legal ones, including overlapping operations and operations of unknown outcome."""

from __future__ import annotations

import math
import random

import pytest

from tests.fault.checker import CAS, FAIL, OK, READ, UNKNOWN, WRITE, Operation, Verdict, check_history, check_key

pytestmark = pytest.mark.timeout(60)


def op(process, kind, invoked, completed, value=None, expected=None, status=OK, key=1) -> Operation:
    if status == UNKNOWN:
        completed = math.inf
    return Operation(process, key, kind, status, invoked, completed, value, expected)


def verdict(history: list[Operation], steps_max: int = 100_000) -> Verdict:
    """The checker's verdict; the search alone must reach the same one as search plus pre-check."""
    found = check_key(1, history, steps_max=steps_max).verdict
    searched = check_key(1, history, steps_max=steps_max, search_only=True).verdict
    if found is not Verdict.UNDETERMINED and searched is not Verdict.UNDETERMINED:
        assert found is searched, f"the pre-check says {found}, the search {searched}"
    return found


# -- histories it must reject ---------------------------------------------------------------------


def test_a_read_of_a_value_never_written_is_a_violation() -> None:
    history = [op(0, WRITE, 0, 1, value=10), op(1, READ, 2, 3, value=99)]
    assert verdict(history) is Verdict.VIOLATION


def test_a_stale_read_is_a_violation() -> None:
    # 20 overwrote 10 and was acknowledged before the read began; the read still returned 10.
    history = [op(0, WRITE, 0, 1, value=10), op(0, WRITE, 2, 3, value=20), op(1, READ, 4, 5, value=10)]
    assert verdict(history) is Verdict.VIOLATION


def test_a_lost_acknowledged_write_is_a_violation() -> None:
    # 30 was acknowledged, nothing overwrote it, yet the reads after it see the register empty.
    history = [op(0, WRITE, 0, 1, value=30), op(1, READ, 2, 3, value=None), op(2, READ, 4, 5, value=None)]
    assert verdict(history) is Verdict.VIOLATION


def test_two_successful_cas_from_the_same_state_are_a_violation() -> None:
    history = [
        op(0, WRITE, 0, 1, value=10),
        op(1, CAS, 2, 5, value=11, expected=10),
        op(2, CAS, 3, 6, value=12, expected=10),
    ]
    assert verdict(history) is Verdict.VIOLATION


def test_a_failed_cas_reporting_an_uncommitted_row_is_a_violation() -> None:
    # Anomaly 1 of issue 9: the failed guard reported 40, a read right after it returned 60,
    # and 40's write completed only later: 40 was visible before it could have taken effect.
    history = [
        op(0, WRITE, 0.0, 0.01, value=60),
        op(1, WRITE, 0.0477, 0.0814, value=40),
        Operation(2, 1, CAS, FAIL, 0.0653, 0.0657, value=40, expected=60),
        op(2, READ, 0.0660, 0.0663, value=60),
    ]
    assert verdict(history) is Verdict.VIOLATION


def test_a_failed_cas_that_found_its_own_expectation_is_a_violation() -> None:
    history = [op(0, WRITE, 0, 1, value=10), Operation(1, 1, CAS, FAIL, 2, 3, value=10, expected=10)]
    assert verdict(history) is Verdict.VIOLATION


def test_a_read_before_the_write_was_invoked_is_a_violation() -> None:
    history = [op(1, READ, 0, 1, value=10), op(0, WRITE, 2, 3, value=10)]
    assert verdict(history) is Verdict.VIOLATION


def test_an_unknown_write_cannot_explain_a_read_that_completed_before_it_began() -> None:
    history = [op(1, READ, 0, 1, value=10), op(0, WRITE, 2, None, value=10, status=UNKNOWN)]
    assert verdict(history) is Verdict.VIOLATION


def test_the_report_names_the_key_and_the_operations_that_could_not_be_placed() -> None:
    history = [op(0, WRITE, 0, 1, value=10), op(0, WRITE, 2, 3, value=20), op(1, READ, 4, 5, value=10)]
    result = check_key(1, history)
    text = result.report()
    assert "key 1: violation" in text and "read -> 10" in text


# -- histories it must accept ---------------------------------------------------------------------


def test_concurrent_overlapping_operations_may_take_effect_in_either_order() -> None:
    # The two writes overlap; reads overlapping them may see either order, and both reads agree on one.
    history = [
        op(0, WRITE, 0, 10, value=10),
        op(1, WRITE, 1, 9, value=20),
        op(2, READ, 2, 3, value=20),
        op(3, READ, 4, 11, value=10),
        op(2, READ, 12, 13, value=10),
    ]
    assert verdict(history) is Verdict.LINEARIZABLE


def test_a_read_overlapping_a_write_may_see_the_old_or_the_new_value() -> None:
    for seen in (None, 10):
        assert verdict([op(0, WRITE, 0, 10, value=10), op(1, READ, 1, 2, value=seen)]) is Verdict.LINEARIZABLE


def test_an_unknown_write_may_take_effect_long_after_the_client_gave_up() -> None:
    history = [
        op(0, WRITE, 0, None, value=10, status=UNKNOWN),
        op(1, READ, 5, 6, value=None),
        op(1, READ, 7, 8, value=10),
        op(1, READ, 9, 10, value=10),
    ]
    assert verdict(history) is Verdict.LINEARIZABLE


def test_an_unknown_write_may_never_take_effect() -> None:
    history = [op(0, WRITE, 0, None, value=10, status=UNKNOWN), op(1, READ, 5, 6, value=None)]
    assert verdict(history) is Verdict.LINEARIZABLE


def test_an_unknown_cas_takes_effect_only_where_its_guard_held() -> None:
    history = [
        op(0, WRITE, 0, 1, value=10),
        op(1, CAS, 2, None, value=11, expected=10, status=UNKNOWN),
        op(2, READ, 3, 4, value=11),
    ]
    assert verdict(history) is Verdict.LINEARIZABLE
    history[0] = op(0, WRITE, 0, 1, value=12)  # the guard can never have held: 11 appears from nowhere
    assert verdict(history) is Verdict.VIOLATION


def test_a_chain_of_cas_and_failed_cas_is_linearizable() -> None:
    history = [
        op(0, WRITE, 0, 1, value=10),
        op(1, CAS, 2, 4, value=11, expected=10),
        Operation(2, 1, CAS, FAIL, 3, 5, value=11, expected=10),
        op(0, READ, 6, 7, value=11),
    ]
    assert verdict(history) is Verdict.LINEARIZABLE


def test_keys_are_checked_independently_with_their_initial_values() -> None:
    history = [
        op(0, READ, 0, 1, value=5, key=1),
        op(0, WRITE, 2, 3, value=7, key=2),
        op(1, READ, 4, 5, value=7, key=2),
    ]
    results = check_history(history, initial={1: 5})
    assert [(r.key, r.verdict) for r in results] == [(1, Verdict.LINEARIZABLE), (2, Verdict.LINEARIZABLE)]
    assert check_history(history)[0].verdict is Verdict.VIOLATION  # key 1 was never 5 from empty


def test_a_search_that_exceeds_its_budget_is_undetermined_not_a_pass() -> None:
    # Many concurrent writes, then two CAS that both succeed from value 1: a violation that the
    # search can only prove by trying every order, which a tiny budget does not allow.
    history = [op(i, WRITE, 0, 100, value=i + 1) for i in range(12)]
    history += [op(98, CAS, 101, 102, value=1001, expected=1), op(99, CAS, 101, 102, value=1002, expected=1)]
    assert check_key(1, history, steps_max=50).verdict is Verdict.UNDETERMINED
    assert check_key(1, history, steps_max=10_000_000).verdict is Verdict.VIOLATION


def test_a_burst_of_concurrent_stale_reads_is_caught_without_exhausting_the_search() -> None:
    # A paused node answers 90 queued reads at once; one of them began after 20 had overwritten 10.
    history = [op(0, WRITE, 0, 1, value=10), op(0, WRITE, 2, 3, value=20)]
    history += [op(i, READ, 1.5 + i * 0.01, 10, value=10 if i % 2 else 20) for i in range(1, 90)]
    history.append(op(90, READ, 3.5, 10, value=10))
    result = check_key(1, history, steps_max=1000)
    assert result.verdict is Verdict.VIOLATION and len(result.stale) == 1
    assert "written by" in result.report()
    assert check_key(1, history, steps_max=1000, search_only=True).verdict is not Verdict.LINEARIZABLE


def test_a_long_sequential_history_of_random_legal_operations_passes_quickly() -> None:
    rng = random.Random(7)
    state, history, now = None, [], 0.0
    for index in range(5000):
        choice = rng.random()
        if choice < 0.4:
            history.append(op(index % 5, READ, now, now + 0.5, value=state))
        elif choice < 0.7:
            state = index + 1
            history.append(op(index % 5, WRITE, now, now + 0.5, value=state))
        else:
            guess = state if rng.random() < 0.5 else -1
            if guess == state:
                history.append(op(index % 5, CAS, now, now + 0.5, value=index + 1, expected=guess))
                state = index + 1
            else:
                history.append(Operation(index % 5, 1, CAS, FAIL, now, now + 0.5, value=state, expected=guess))
        now += 1
    result = check_key(1, history)
    assert result.verdict is Verdict.LINEARIZABLE and result.steps < 100_000


def simulated_concurrent_history(rng: random.Random, processes: int, operations: int) -> list[Operation]:
    """A legal history: each operation takes effect at a random instant inside its interval."""
    clocks = [0.0] * processes
    planned = []
    for index in range(operations):
        process = index % processes
        invoked = clocks[process] + rng.uniform(0, 0.5)
        completed = invoked + rng.uniform(0.1, 3.0)
        clocks[process] = completed
        planned.append((rng.uniform(invoked, completed), process, invoked, completed, index, rng.random()))
    state, history = None, []
    for _, process, invoked, completed, index, choice in sorted(planned):
        if choice < 0.4:
            history.append(op(process, READ, invoked, completed, value=state))
        elif choice < 0.7:
            state = index + 1
            history.append(op(process, WRITE, invoked, completed, value=state))
        elif choice < 0.9:
            history.append(op(process, CAS, invoked, completed, value=index + 1, expected=state))
            state = index + 1
        else:
            history.append(Operation(process, 1, CAS, FAIL, invoked, completed, value=state, expected=-2))
    return history


def test_a_long_concurrent_legal_history_passes_within_its_budget() -> None:
    history = simulated_concurrent_history(random.Random(11), processes=10, operations=2000)
    result = check_key(1, history)
    assert result.verdict is Verdict.LINEARIZABLE, result.report()


def test_the_search_reports_the_longest_prefix_it_could_place() -> None:
    history = [op(0, WRITE, 0, 1, value=10), op(1, CAS, 2, 5, value=11, expected=10)]
    history.append(op(2, CAS, 3, 6, value=12, expected=10))
    result = check_key(1, history, search_only=True)
    assert result.verdict is Verdict.VIOLATION and len(result.linearized_max) == 2
    assert "could not be placed" in result.report() and "cas 10 -> 12" in result.report()


# -- partition-shaped histories: what a minority sequencer that still acknowledged would leave -----------


def test_a_minority_sequencer_acknowledging_beside_a_new_majority_is_a_violation() -> None:
    # Split brain: process 0 writes through the old sequencer cut off at t=10, process 1 through the
    # majority's new one. Both sides acknowledge CAS from 10, and the minority's reader still sees 10
    # after the majority's 20 was acknowledged.
    before = [op(0, WRITE, 0, 1, value=10), op(1, READ, 2, 3, value=10)]
    majority = [op(1, CAS, 11, 12, value=20, expected=10), op(1, READ, 13, 14, value=20)]
    assert verdict(before + majority) is Verdict.LINEARIZABLE
    minority_cas = op(0, CAS, 12.5, 13, value=30, expected=10)  # invoked after 20 was acknowledged
    assert verdict(before + majority + [minority_cas]) is Verdict.VIOLATION
    minority_read = op(0, READ, 12.5, 13, value=10)
    assert verdict(before + majority + [minority_read]) is Verdict.VIOLATION


def test_a_minority_write_of_unknown_outcome_that_never_took_effect_is_legal() -> None:
    # What a correct cluster leaves: the old sequencer could not answer (unknown); the majority went on.
    history = [
        op(0, WRITE, 0, 1, value=10),
        op(0, WRITE, 11, None, value=30, status=UNKNOWN),
        op(1, CAS, 11.5, 12, value=20, expected=10),
        op(1, READ, 13, 14, value=20),
        op(2, READ, 20, 21, value=20),
    ]
    assert verdict(history) is Verdict.LINEARIZABLE
