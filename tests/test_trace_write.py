"""``benchmarks/trace_write.py`` lines up each write's hops from the cores' traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.timeout(30)

trace_write = load_benchmark("trace_write")

US = 1000  # ns


def write_trace(path: Path, events: list[tuple]) -> Path:
    path.write_text("".join(json.dumps(event) + "\n" for event in events))
    return path


def test_each_write_s_hops_are_measured_from_when_the_sequencer_received_it(tmp_path: Path) -> None:
    sequencer, followers = [], [[], []]
    for write in range(20):
        t0 = 1_000_000 + write * 2000 * US
        sequencer += [
            ("_dispatch", t0, t0 + 20 * US, "transact"),
            ("send_frames", t0 + 100 * US, t0 + 110 * US, 300),
            ("fdatasync", t0 + 200 * US, t0 + 600 * US, None),
            ("_dispatch", t0 + 1000 * US, t0 + 1010 * US, "peer"),
            ("apply_committed", t0 + 1050 * US, t0 + 1100 * US, None),
            ("commit", t0 + 1150 * US, t0 + 1200 * US, False),
            ("send_frames", t0 + 1250 * US, t0 + 1260 * US, 60),
        ]
        if write == 12:
            sequencer = [e for e in sequencer if not (e[0] == "_dispatch" and e[3] == "peer" and e[1] > t0)]
        for number, follower in enumerate(followers):
            shift = t0 + number * 50 * US
            follower += [
                ("_dispatch", shift + 300 * US, shift + 320 * US, "peer"),
                ("append_entries", shift + 330 * US, shift + 350 * US, None),
                ("apply_committed", shift + 360 * US, shift + 400 * US, None),
                ("commit", shift + 450 * US, shift + 900 * US, True),
                ("fdatasync", shift + 500 * US, shift + 900 * US, None),
                ("send_frames", shift + 950 * US, shift + 960 * US, 80),
            ]
    traces = [trace_write.Trace(write_trace(tmp_path / "seq.trace", sequencer))]
    traces += [trace_write.Trace(write_trace(tmp_path / f"f{n}.trace", f)) for n, f in enumerate(followers)]
    rows = {row["hop"]: row for row in trace_write.table(trace_write.hops(traces[0], traces[1:]))}
    assert rows["sequencer: append sent"]["median_us"] == 100
    assert rows["sequencer: fsync ends"]["median_us"] == 600
    assert rows["follower 1: append received"]["median_us"] == 300
    assert rows["follower 1: previous entry applied"]["median_us"] == 400
    assert rows["follower 1: fsync ends"]["median_us"] == 900
    assert rows["follower 2: ack sent"]["median_us"] == 1000
    assert rows["sequencer: reply sent"]["median_us"] == 1250
    assert rows["sequencer: next write received"]["median_us"] == 2000
    # The middle 80% of 20 writes (16: 15 with a next write), less the one whose acknowledgement is missing.
    assert rows["sequencer: reply sent"]["writes"] == 14
    assert rows["sequencer: append sent"]["gap_us"] == 100
    medians = [row["median_us"] for row in rows.values()]
    assert medians == sorted(medians)
