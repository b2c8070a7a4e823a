"""CI's `make test` runs pytest twice (the fast lane's tests and the deep ones on two worker processes, then
the slow and Spark tests serially): between them the two runs must select every test once, whatever its
markers. The developers' `make test-fast` is CI's first run without the tests marked deep."""

from __future__ import annotations

import importlib
import itertools
import os
import re
import tomllib

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)


def recipe(target: str) -> str:
    """The recipe lines of ``target`` in the Makefile."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(f"{target}:"))
    return "\n".join(itertools.takewhile(lambda line: line.startswith("\t"), lines[start + 1 :]))


def marker_expressions(target: str) -> list[str]:
    return re.findall(r'pytest -m "([^"]+)"', recipe(target))


def registered_markers() -> list[str]:
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return [marker.split(":")[0] for marker in settings["markers"]]


def selects(expression: str, markers: dict[str, bool]) -> bool:
    """Whether ``-m expression`` selects a test carrying the markers set true (names, and, or, not)."""
    if not set(re.findall(r"\w+", expression)) <= {*markers, "and", "or", "not"}:
        raise AssertionError(f"{expression!r} names a marker pyproject.toml does not register")
    return eval(expression, {"__builtins__": {}}, markers)  # names and boolean operators only, checked above


def test_ci_runs_every_test_once_in_one_of_its_two_pytest_runs() -> None:
    lanes = marker_expressions("test")
    assert len(lanes) == 2, recipe("test")
    names = registered_markers()
    for values in itertools.product([False, True], repeat=len(names)):
        markers = dict(zip(names, values, strict=True))
        chosen = [lane for lane in lanes if selects(lane, markers)]
        assert len(chosen) == 1, f"a test marked {markers} is run by {chosen} of {lanes}"


def test_the_first_ci_run_is_on_two_workers_and_the_second_is_serial() -> None:
    fast, slow = marker_expressions("test")
    runs = {
        expression: line for line in recipe("test").splitlines() for expression in re.findall(r'-m "([^"]+)"', line)
    }
    assert "-n 2" in runs[fast] and "-n" not in runs[slow].replace(f'-m "{slow}"', "")
    assert "-n 2" in recipe("test-fast")


def test_the_fast_lane_is_the_first_ci_run_without_the_deep_tests() -> None:
    """CI's first run (two workers) runs the deep tests; `make test-fast` runs the rest of that run."""
    ci_fast, _ = marker_expressions("test")
    (developers,) = marker_expressions("test-fast")
    names = registered_markers()
    assert "deep" in names
    for values in itertools.product([False, True], repeat=len(names)):
        markers = dict(zip(names, values, strict=True))
        if markers["deep"]:
            assert not selects(developers, markers), f"the fast lane runs a test marked {markers}"
            if not markers["slow"] and not markers["spark"]:
                assert selects(ci_fast, markers), f"CI's two-worker run leaves out a test marked {markers}"
        else:
            assert selects(developers, markers) == selects(ci_fast, markers), markers


@pytest.mark.parametrize(
    ("family", "seed_test"),
    [
        ("test_simulation", "test_seed"),
        ("test_replicant_simulation", "test_seed"),
        ("test_disk_simulation", "test_seed"),
        ("test_lost_disk_simulation", "test_seed"),
        ("test_names_simulation", "test_seed"),
        ("test_membership", "test_membership_changes_under_faults"),
    ],
)
def test_the_fast_lane_runs_a_sample_of_each_simulations_seeds_and_ci_all_of_them(family: str, seed_test: str) -> None:
    """Each simulation's seed test runs seeds 0 to CI_SEEDS - 1; from FAST_SEEDS on they are marked deep."""
    if os.environ.get("MNESITE_SIM_SEED") or any(name.endswith("SIM_SEEDS") for name in os.environ):
        pytest.skip("the seeds are chosen by the environment")
    module = importlib.import_module(f"tests.{family}")
    (parametrize,) = [mark for mark in getattr(module, seed_test).pytestmark if mark.name == "parametrize"]
    params = parametrize.args[1]
    assert [param.values[0] for param in params] == list(range(module.CI_SEEDS))
    assert all(mark.name == "deep" for param in params for mark in param.marks)
    deep = [param.values[0] for param in params if param.marks]
    assert 0 < module.FAST_SEEDS < module.CI_SEEDS and deep == list(range(module.FAST_SEEDS, module.CI_SEEDS))


@pytest.mark.parametrize(
    ("family", "seed_test", "seed_count"),
    [
        ("test_follower_apply", "test_followers_gathering_commits_keep_every_invariant_of_the_simulator", 24),
        ("test_follower_apply", "test_followers_gathering_commits_on_full_disks_keep_every_invariant", 24),
        ("test_follower_apply", "test_replicants_of_followers_gathering_commits_keep_every_invariant", 24),
        ("test_simulation", "test_seeds_whose_first_installs_are_abandoned_heal", 40),
    ],
)
def test_the_fast_lane_runs_the_first_seeds_of_a_seed_range_test_and_ci_all_of_them(
    family: str, seed_test: str, seed_count: int
) -> None:
    module = importlib.import_module(f"tests.{family}")
    (parametrize,) = [mark for mark in getattr(module, seed_test).pytestmark if mark.name == "parametrize"]
    fast, deep = parametrize.args[1]
    assert not fast.marks and [mark.name for mark in deep.marks] == ["deep"]
    assert len(fast.values[0]) > 0 and [*fast.values[0], *deep.values[0]] == list(range(seed_count))


def test_no_mutation_test_is_deep() -> None:
    """The fast lane runs every test that breaks a rule on purpose and requires the simulator to catch it."""
    deep_tests = [
        name
        for path in sorted((REPO / "tests").glob("test_*.py"))
        for name in re.findall(r"@pytest\.mark\.deep\b[^\n]*\n(?:@[^\n]*\n)*def (\w+)", path.read_text())
    ]
    assert deep_tests, "no test is marked deep"
    assert not [name for name in deep_tests if "catches" in name], deep_tests


@pytest.mark.parametrize(
    ("family", "property_test"),
    [
        ("test_codec", "test_arbitrary_bytes_only_raise_codec_error"),
        ("test_consensus_wire", "test_mutated_valid_messages_decode_or_raise_codec_error"),
    ],
)
def test_the_fast_lane_runs_a_share_of_a_property_tests_examples_and_ci_all_of_them(
    family: str, property_test: str
) -> None:
    """``examples_by_lane``: the test's ``[fast]`` run is unmarked and its ``[deep]`` run marked deep."""
    module = importlib.import_module(f"tests.{family}")
    (parametrize,) = [mark for mark in getattr(module, property_test).pytestmark if mark.name == "parametrize"]
    fast, deep = parametrize.args[1]
    assert fast == "fast" and deep.values == ("deep",) and [mark.name for mark in deep.marks] == ["deep"]
