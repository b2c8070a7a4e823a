"""Progress of long work: bootstrap and snapshot install progress in the text `status`."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from mnesite.cli.main import describe_copy, main
from mnesite.rlog.client import Client


def test_copy_progress_names_rows_of_the_total_rate_and_eta() -> None:
    text = describe_copy({"rows": 250, "rows_expected": 1000, "rows_per_s": 125.0, "eta_ms": 6000})
    assert text == "250 of about 1000 rows (25%), 125 rows/s, ETA 6 s"
    assert "ETA unknown" in describe_copy({"rows": 0, "rows_expected": 0, "rows_per_s": 0, "eta_ms": None})
    # Tables whose count is not known yet: the rows counted so far are no total to show a percent of.
    text = describe_copy({"rows": 250, "rows_expected": 250, "rows_per_s": 125.0, "eta_ms": None})
    assert text == "250 of about 250 rows, 125 rows/s, ETA unknown"


def test_text_status_of_a_bootstrapping_replicant_shows_its_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    shard = {
        "mode": "bootstrap",
        "upstream": "core1",
        "applied": [0, 0],
        "digest": "00" * 32,
        "lag_entries": None,
        "bootstraps": 1,
        "resumes": 0,
        "rows_copied": 250,
        "entries_buffered": 3,
        "copy": {"rows": 250, "rows_expected": 1000, "rows_per_s": 125.0, "eta_ms": 6000},
    }
    answer = {"node": "replicant1", "role": "replicant", "security": {"curve": False}, "shards": {"default": shard}}
    monkeypatch.setattr(Client, "status", lambda self: answer)
    result = CliRunner().invoke(main, ["status", "--node", "tcp://127.0.0.1:9"])
    assert result.exit_code == 0, result.output
    assert "bootstrap of default: 250 of about 1000 rows (25%), 125 rows/s, ETA 6 s" in result.stdout
    shard["mode"] = "normal"
    result = CliRunner().invoke(main, ["status", "--node", "tcp://127.0.0.1:9"])
    assert "bootstrap of" not in result.stdout


def test_text_status_warns_of_a_bootstrap_begun_again_because_the_copy_outlasted_retention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sizing trap (``replicant.replica``) was visible only in ``--json``'s ``last_error``: the text
    status showed one more bootstrap, like any other. It now says so, with what to raise."""
    why = "bootstrapping from core1 at (1, 90) again: ... Raise the cores' [rlog] retention_entries_max ..."
    shard = {
        "mode": "bootstrap",
        "upstream": "core1",
        "applied": [0, 0],
        "digest": None,
        "lag_entries": None,
        "bootstraps": 3,
        "bootstraps_outrun": 2,
        "resumes": 0,
        "rows_copied": 250,
        "entries_buffered": 3,
        "last_error": why,
    }
    answer = {"node": "replicant1", "role": "replicant", "security": {"curve": False}, "shards": {"default": shard}}
    monkeypatch.setattr(Client, "status", lambda self: answer)
    result = CliRunner().invoke(main, ["status", "--node", "tcp://127.0.0.1:9"])
    assert result.exit_code == 0, result.output
    warning = "WARNING: shard default: 2 bootstrap(s) so far began again because a copy outlasted retention"
    assert f"{warning}; last_error: {why}" in result.stdout
    assert result.stdout.count(why) == 1  # not again as the shard's last_error line
    # The trap is behind it (a finished copy clears last_error): the count stays in --json, the warning goes.
    shard["mode"], shard["last_error"] = "normal", None
    result = CliRunner().invoke(main, ["status", "--node", "tcp://127.0.0.1:9"])
    assert "WARNING" not in result.stdout


def test_text_status_of_a_replicant_shows_each_shards_last_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a replicant shard's ``last_error`` (a full disk, no core to follow, a full spill) was
    shown only by ``--json``; the text status showed the shard's row as if all were well. It is now one
    warning line per shard that has one."""
    shards = {
        name: {
            "mode": "normal",
            "upstream": "core1",
            "applied": [1, 5],
            "digest": "00" * 32,
            "lag_entries": 0,
            "bootstraps": 1,
            "resumes": 0,
            "rows_copied": 0,
            "entries_buffered": 0,
            "last_error": error,
        }
        for name, error in [("default", None), ("orders", "the disk is full (disk I/O error): applying nothing")]
    }
    answer = {"node": "replicant1", "role": "replicant", "security": {"curve": False}, "shards": shards}
    monkeypatch.setattr(Client, "status", lambda self: answer)
    result = CliRunner().invoke(main, ["status", "--node", "tcp://127.0.0.1:9"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    assert warnings == ["WARNING: shard orders: last_error: the disk is full (disk I/O error): applying nothing"]
