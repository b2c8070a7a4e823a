"""CI's `make test` runs pytest twice (the fast lane on two worker processes, then the slow and Spark
tests serially): between them the two runs must select every test once, whatever its markers."""

from __future__ import annotations

import itertools
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


def test_the_first_ci_run_is_the_fast_lane_on_two_workers_and_the_second_is_serial() -> None:
    fast, slow = marker_expressions("test")
    assert fast == marker_expressions("test-fast")[0]
    runs = {
        expression: line for line in recipe("test").splitlines() for expression in re.findall(r'-m "([^"]+)"', line)
    }
    assert "-n 2" in runs[fast] and "-n" not in runs[slow].replace(f'-m "{slow}"', "")
