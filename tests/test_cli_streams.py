"""What the commands that stream their output (``scan``, ``export``, ``query``, ``changes``) leave on
stdout when they fail: nothing when the failure comes before the first row, and an exit status other
than 0 with the error on stderr when the connection is lost after rows were printed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.rlog.client import Client

from tests.conftest import ThreadNode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mnesite(thread_node: ThreadNode):
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, [*args, "--node", thread_node.endpoint], catch_exceptions=False)

    created = invoke("table", "create", "items", "--key-column", "id", "--column", "id:INTEGER",
                     "--column", "name:TEXT")  # fmt: skip
    assert created.exit_code == 0, created.output
    with thread_node.client() as client:
        client.transact([{"op": "write", "table": "items", "row": {"id": i, "name": f"n{i}"}} for i in range(5)])
    return invoke


# A tx key no write has reached: a read that waits for it is answered ``timeout`` before any row.
NEVER_REACHED = ("--after", "999,1", "--timeout-ms", "300")


@pytest.mark.parametrize(
    "args",
    [
        ("scan", "items", "--json", "--from", "abc"),
        ("scan", "items", "--json", "--from", "1_000"),
        ("scan", "items", "--json", *NEVER_REACHED),
        ("scan", "items", "--json", "--from", "2", *NEVER_REACHED),
        ("scan", "items", *NEVER_REACHED),
        ("export", "items", "--format", "csv", *NEVER_REACHED),
        ("export", "items", *NEVER_REACHED),
        ("query", "SELECT * FROM items", "--json", *NEVER_REACHED),
        ("query", "SELECT * FROM nope", "--json"),
        ("get", "items", "abc", "--json"),
        ("changes", "nope", "--json"),
    ],
    ids=lambda value: " ".join(value),
)
def test_a_command_refused_before_its_first_row_writes_nothing_to_stdout(mnesite, args: tuple[str, ...]) -> None:
    """``scan --json --from abc`` wrote ``[`` before parsing the key, inside the generator of rows, and
    then the error: a pipe got broken JSON (``jq`` failed on it) rather than nothing. A CSV export
    refused at its first page had written the header. Every check, and the first page, come first."""
    result = mnesite(*args)
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr


def test_a_query_after_a_key_never_reached_answers_timeout_within_its_timeout_ms(mnesite) -> None:
    """``query`` pages with the 30 s query timeout (a statement may work that long), and the wait for
    the ``--after`` key was cut from it: the node held the query for its 10 s cap on the wait, where
    ``scan`` and ``export`` answered ``timeout`` after their --timeout-ms (0.3 s here)."""
    started = time.monotonic()
    result = mnesite("query", "SELECT * FROM items", *NEVER_REACHED)
    elapsed = time.monotonic() - started
    assert result.exit_code == 1 and "(999, 1)" in result.stderr, result.output
    assert elapsed < 2.0, f"answered after {elapsed:.1f} s"


def test_an_export_refused_at_its_first_page_creates_no_file(mnesite, tmp_path: Path) -> None:
    """The header was written (and the file created) before the first page was asked for."""
    output = tmp_path / "items.csv"
    result = mnesite("export", "items", "--format", "csv", "--output", str(output), *NEVER_REACHED)
    assert result.exit_code == 1 and result.stderr.startswith("Error: "), result.output
    assert not output.exists()


def _lose_the_node_before_request(monkeypatch: pytest.MonkeyPatch, node: ThreadNode, kind: str, number: int) -> None:
    """Stop ``node`` just before the ``number``-th request of ``kind`` leaves: the connection is lost
    mid-stream, after the rows of the earlier requests were printed."""
    call = Client.call
    sent = [0]

    def losing(self: Client, asked: str, *args: Any, **kwargs: Any) -> Any:
        if asked == kind:
            sent[0] += 1
            if sent[0] == number:
                node.stop()
        return call(self, asked, *args, **kwargs)

    monkeypatch.setattr(Client, "call", losing)


@pytest.mark.parametrize(
    ("args", "kind", "printed"),
    [
        (("scan", "items", "--json", "--page-rows", "2"), "scan", '[{"id": 0, "name": "n0"},\n{"id": 1, "name": "n1"}'),
        (("scan", "items", "--page-rows", "2"), "scan", "id  name\n0   n0\n1   n1\n"),
        (("export", "items", "--format", "csv", "--page-rows", "2", "--quiet"), "scan", "id,name\n0,n0\n1,n1\n"),
        (
            ("export", "items", "--page-rows", "2", "--quiet"),
            "scan",
            '{"id": 0, "name": "n0"}\n{"id": 1, "name": "n1"}\n',
        ),
        (
            ("query", "SELECT id FROM items ORDER BY id", "--json", "--page-rows", "2"),
            "query_page",
            '{"columns": ["id"], "positions": POSITIONS, "rows": [[0],\n[1]',
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else None,
)
def test_a_stream_cut_after_rows_were_printed_exits_1_with_the_error_on_stderr(
    mnesite, thread_node: ThreadNode, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], kind: str, printed: str
) -> None:
    with thread_node.client() as client:
        positions = {shard: list(key) for shard, key in client.query("SELECT id FROM items LIMIT 1").positions.items()}
    # A query's first page comes with its answer: the first query_page request asks for the second.
    _lose_the_node_before_request(monkeypatch, thread_node, kind, 1 if kind == "query_page" else 2)
    result = mnesite(*args, "--timeout-ms", "1000")
    printed = printed.replace("POSITIONS", json.dumps(positions))
    assert result.exit_code == 1, result.output
    assert result.stdout == printed
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr


def test_a_changefeed_cut_after_records_were_printed_exits_1_with_the_error_on_stderr(
    mnesite, thread_node: ThreadNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lose_the_node_before_request(monkeypatch, thread_node, "changes", 2)
    result = mnesite("changes", "items", "--json", "--timeout-ms", "1000")
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [record["key"] for record in records if record["op"] == "write"] == list(range(5))
    resume, error = result.stderr.splitlines()
    assert resume.startswith("stopped; resume with --from default:") and error.startswith("Error: ")
