"""``benchmarks/cpu_hook.py`` counts each wrapped method's own CPU; ``cpu_by_function.py`` reports it."""

from __future__ import annotations

import importlib
import json
import signal

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.timeout(30)

cpu_hook = load_benchmark("cpu_hook")
cpu_by_function = load_benchmark("cpu_by_function")


class StepClock:
    """A clock that moves on only when told (``spend``): CPU spent at known points."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def spend(self, amount: int) -> None:
        self.now += amount


def test_a_method_s_exclusive_time_leaves_out_the_wrapped_calls_inside_it() -> None:
    clock = StepClock()
    accounting = cpu_hook.Accounting(clock)

    def inner() -> None:
        clock.spend(30)

    wrapped_inner = accounting.wrap(inner, "inner")

    def outer() -> str:
        clock.spend(5)
        wrapped_inner()
        clock.spend(7)
        wrapped_inner()
        return "done"

    wrapped_outer = accounting.wrap(outer, "outer")
    assert wrapped_outer() == "done"
    assert wrapped_outer() == "done"
    snapshot = accounting.snapshot()
    assert snapshot["inclusive"] == {"outer": 144, "inner": 120}
    assert snapshot["exclusive"] == {"outer": 24, "inner": 120}
    assert snapshot["calls"] == {"outer": 2, "inner": 4}
    accounting.clear()
    assert accounting.snapshot() == {"inclusive": {}, "exclusive": {}, "calls": {}}


def test_a_call_that_raises_is_counted_and_its_error_goes_on() -> None:
    clock = StepClock()
    accounting = cpu_hook.Accounting(clock)

    def fails() -> None:
        clock.spend(11)
        raise KeyError("x")

    with pytest.raises(KeyError):
        accounting.wrap(fails, "fails")()
    assert accounting.snapshot()["exclusive"] == {"fails": 11}


def test_every_wrapped_name_exists() -> None:
    """A method renamed in the product would leave the hook failing at a core's start."""
    for module_name, owner_name, names in cpu_hook.WRAPPED:
        owner = importlib.import_module(module_name)
        if owner_name is not None:
            owner = getattr(owner, owner_name)
        for name in names:
            assert callable(getattr(owner, name)), f"{module_name}.{owner_name}.{name}"


def test_the_report_gives_each_function_per_write_and_per_turn() -> None:
    counts = {
        "inclusive": {"CoreNode.run_turn": 4_000_000, "Store.commit": 1_000_000},
        "exclusive": {"CoreNode.run_turn": 500_000, "Store.commit": 1_000_000, "NodeServer.poll": 200_000},
        "calls": {"CoreNode.run_turn": 10, "Store.commit": 10, "NodeServer.poll": 20},
    }
    report = cpu_by_function.core_report(counts, writes=100, top=2)
    assert report["turns_per_write"] == 0.1
    assert report["us_per_write"] == 40.0
    assert report["us_per_turn"] == 400.0
    assert report["functions"] == [
        {"function": "Store.commit", "us_per_write": 10.0, "us_per_turn": 100.0, "calls_per_turn": 1.0},
        {"function": "CoreNode.run_turn", "us_per_write": 5.0, "us_per_turn": 50.0, "calls_per_turn": 1.0},
    ]


def test_sigusr1_only_records_the_request_and_the_next_turn_writes_the_counts_and_starts_them_again(tmp_path) -> None:
    """The handler (``Dumps.request``) runs wherever the loop's thread is: it writes nothing and
    clears nothing, which the loop's next turn does before any wrapped call opens."""
    clock = StepClock()
    accounting = cpu_hook.Accounting(clock)
    path = tmp_path / "core1.cpu.json"
    dumps = cpu_hook.Dumps(accounting, str(path))
    turns: list[str] = []

    def run_turn() -> None:
        clock.spend(3)
        turns.append("turned")

    turn = dumps.before_turn(accounting.wrap(run_turn, "run_turn"))
    turn()
    dumps.request(signal.SIGUSR1, None)
    assert not path.exists() and accounting.snapshot()["calls"] == {"run_turn": 1}
    turn()
    assert json.loads(path.read_text())["calls"] == {"run_turn": 1}  # the counts before the request
    assert accounting.snapshot()["calls"] == {"run_turn": 1} and turns == ["turned", "turned"]
    turn()  # no request since: nothing written
    assert json.loads(path.read_text())["calls"] == {"run_turn": 1}
    dumps.write()  # the exit's
    assert json.loads(path.read_text())["calls"] == {"run_turn": 2}
