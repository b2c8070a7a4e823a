"""``benchmarks/turn_costs.py`` turns two samples of the cores' threads into a write's costs."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.timeout(30)

turn_costs = load_benchmark("turn_costs")

Thread, Core = turn_costs.ThreadSample, turn_costs.CoreSample


def test_a_write_s_costs_are_the_differences_between_the_samples_divided_by_the_writes() -> None:
    before = {
        "core1": Core(
            {10: Thread("python", 1.0, 0.5, 100, 10), 11: Thread("ZMQbg/IO/0", 0.2, 0.3, 50, 5)}, "sequencer", 40, 1000
        ),
        "core2": Core({20: Thread("python", 2.0, 1.0, 7, 0), 21: Thread("idle", 0.0, 0.0, 0, 0)}, "follower", 30, 1000),
    }
    after = {
        "core1": Core(
            {
                10: Thread("python", 1.4, 0.6, 300, 30),
                11: Thread("ZMQbg/IO/0", 0.25, 0.45, 150, 5),
                12: Thread("new", 9.0, 9.0, 9, 9),  # started in between: left out
            },
            "sequencer",
            240,
            5000,
        ),
        "core2": Core(
            {20: Thread("python", 2.2, 1.04, 47, 0), 21: Thread("idle", 0.0, 0.0, 4, 0)}, "follower", 130, 1000
        ),
    }
    rows = {row["core"]: row for row in turn_costs.per_write(before, after, writes=4000)}
    sequencer, follower = rows["core1"], rows["core2"]
    assert sequencer["role"] == "sequencer"
    # 0.4 s user + 0.1 s system over 4,000 writes: 100 + 25 us; the I/O thread 12.5 + 37.5 us.
    assert sequencer["threads"] == [
        {"thread": "python", "user_us": 100.0, "system_us": 25.0},
        {"thread": "ZMQbg/IO/0", "user_us": 12.5, "system_us": 37.5},
    ]
    assert sequencer["cpu_us"] == 175.0
    assert sequencer["commits"] == 0.05  # 200 commits over 4,000 writes
    assert sequencer["switches"] == 0.08  # (200 + 20 + 100) switches over 4,000 writes
    # A thread that used no CPU in the window is left out; its switches still count.
    assert follower["threads"] == [{"thread": "python", "user_us": 50.0, "system_us": 10.0}]
    assert follower["commits"] == 0.025
    assert follower["switches"] == 0.011


def test_no_write_between_the_samples_is_refused() -> None:
    sample = {"core1": Core({}, "sequencer", 0, 7)}
    with pytest.raises(ValueError, match="no write"):
        turn_costs.per_write(sample, sample, writes=0)


def test_the_threads_of_a_process_are_read_with_their_cpu_and_switches() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="waiter")
    worker.start()
    try:
        began = time.process_time()
        while time.process_time() - began < 0.05:  # CPU for the main thread to show
            pass
        threads = turn_costs.read_threads(os.getpid())
    finally:
        stop.set()
        worker.join(5)
    assert threading.main_thread().native_id in threads
    main = threads[threading.main_thread().native_id]
    assert main.user_s + main.system_s > 0
    assert worker.native_id in threads
    assert all(thread.voluntary >= 0 and thread.involuntary >= 0 for thread in threads.values())
    assert turn_costs.machine_busy_s() > 0


def _report(clients: int, rows: list[tuple[str, float, float]]) -> dict:
    return {"clients": clients, "per_write": [{"role": r, "commits": c, "cpu_us": u} for r, c, u in rows]}


def test_a_turn_s_cost_and_a_write_s_are_fitted_per_role_from_the_runs_with_several_clients() -> None:
    # A follower: 400 us a committing turn and 30 a write; a sequencer: 500 and 90.
    reports = [
        _report(1, [("follower", 1.0, 900.0), ("sequencer", 2.0, 2000.0)]),  # left out: one client
        _report(8, [("follower", 0.3, 150.0), ("follower", 0.3, 150.0), ("sequencer", 0.4, 290.0)]),
        _report(64, [("follower", 0.05, 50.0), ("follower", 0.05, 50.0), ("sequencer", 0.06, 120.0)]),
    ]
    fits = turn_costs.turn_and_write_costs(reports)
    assert fits["follower"] == {"per_turn_us": 400, "per_write_us": 30.0, "points": 4}
    assert fits["sequencer"] == {"per_turn_us": 500, "per_write_us": 90.0, "points": 2}


def test_no_fit_for_a_role_seen_at_one_commit_rate_only() -> None:
    reports = [_report(1, [("sequencer", 2.0, 900.0)]), _report(64, [("sequencer", 0.1, 100.0)])]
    assert turn_costs.turn_and_write_costs(reports) == {}


def test_no_fit_from_the_cores_of_a_single_run() -> None:
    # Two followers of one run differ in commit rate by chance: a line through them means nothing.
    reports = [_report(2, [("follower", 0.841, 460.0), ("follower", 0.85, 432.0), ("sequencer", 1.47, 700.0)])]
    assert turn_costs.turn_and_write_costs(reports) == {}
