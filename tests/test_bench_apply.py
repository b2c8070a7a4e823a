"""``benchmarks/bench_catchup.py``'s apply phase measures a replicant's real apply path, push by push.

The issue-21 line "replicant apply at least 0.5x raw apsw" is read from this phase: a change of the
replicant's decode, replica or store that broke the harness (or made it apply nothing) must fail here,
not give a figure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.timeout(60)

bench_catchup = load_benchmark("bench_catchup")


def test_a_round_applies_every_row_through_the_replicant_and_times_both_sides(tmp_path: Path) -> None:
    replicant_s, raw_s, entries = bench_catchup.apply_round(tmp_path, 2_000, 100, 5)
    assert entries == 21  # the table's entry and 20 entries of 100 rows
    assert replicant_s > 0 and raw_s > 0
    # Both databases hold the rows (ReplicantApply.close checked the replicant's; here the raw one's).
    import apsw

    raw = apsw.Connection(str(tmp_path / "raw-upsert.db"))
    assert raw.execute("SELECT count(*), min(id), max(id) FROM kv").fetchone() == (2_000, 0, 1_999)
    raw.close()


def test_a_replicant_that_applies_nothing_is_reported_not_timed(tmp_path: Path, monkeypatch) -> None:
    from mnesite.replicant.node import ReplicantNode

    monkeypatch.setattr(ReplicantNode, "apply_entries", staticmethod(lambda store, entries, healing=False: None))
    with pytest.raises(SystemExit, match="applied up to"):
        bench_catchup.apply_round(tmp_path, 1_000, 100, 5)


def test_a_failing_push_shows_its_own_error(tmp_path: Path, monkeypatch) -> None:
    from mnesite.replicant.node import ReplicantNode

    def broken(store, entries, healing=False):
        raise RuntimeError("the store refused the push")

    monkeypatch.setattr(ReplicantNode, "apply_entries", staticmethod(broken))
    with pytest.raises(RuntimeError, match="the store refused the push"):
        bench_catchup.apply_round(tmp_path, 1_000, 100, 5)
