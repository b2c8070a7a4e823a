"""The wire layer's line count (``benchmarks/wire_lines.py``) cannot silently grow back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parent.parent
wire_lines = load_benchmark("wire_lines")


def test_the_wire_layer_stays_under_its_ceiling() -> None:
    counts = wire_lines.wire_lines(REPO)
    assert counts["total"] == sum(count for name, count in counts.items() if name != "total")
    assert counts["rlog/types.py (op codec)"] > 50  # the markers are in place around the op codec
    assert counts["total"] <= wire_lines.WIRE_LINES_MAX, counts
    assert wire_lines.WIRE_LINES_MAX <= wire_lines.WIRE_LINES_TARGET  # issue 20: half of the about 1,300 lines


def test_marked_lines_counts_only_inside_the_markers() -> None:
    lines = ["a", wire_lines.BEGIN, "", "b", "# why", "", wire_lines.END, "c", wire_lines.BEGIN, "d", wire_lines.END]
    assert wire_lines.marked_lines(lines) == 3
    with pytest.raises(ValueError):
        wire_lines.marked_lines([wire_lines.BEGIN, "a"])
