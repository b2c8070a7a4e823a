"""What the CLI writes for values JSON cannot spell, what it binds for a ``--param``, and what a long
export says while it runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from mnesite.cli.main import json_text, main

from tests.conftest import ThreadNode

pytestmark = pytest.mark.timeout(60)


def strict_json(text: str) -> Any:
    """``text`` as JSON, refusing the words ``Infinity``, ``-Infinity`` and ``NaN`` that Python's json
    writes and reads but no JSON parser must (RFC 8259; jq, JavaScript's JSON.parse refuse them)."""

    def refuse(word: str) -> Any:
        raise ValueError(f"{word} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def mnesite(thread_node: ThreadNode):
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None):
        return runner.invoke(main, [*args, "--node", thread_node.endpoint], input=input, catch_exceptions=False)

    created = invoke("table", "create", "items", "--key-column", "id", "--column", "id:INTEGER",
                     "--column", "price:REAL")  # fmt: skip
    assert created.exit_code == 0, created.output
    return invoke


def test_compare_writes_an_infinity_in_its_samples_as_json_parsers_read_it() -> None:
    """``compare --json`` (and the readable report, whose cells are JSON) wrote a sampled infinite REAL
    with ``json.dumps``, as ``Infinity``, which is not JSON: jq refused the whole report. It writes
    ``9.0e+999``, as ``mnesite get --json`` does (``rlog.json_text``, which both import)."""
    from mnesite.spark.cli import render_report
    from mnesite.spark.compare import CompareReport, PairTableResult, report_json

    pair = PairTableResult("items", "a", "b")
    pair.counts["different"] = 1
    left, right = {"id": 1, "price": math.inf, "blob": b"\x01"}, {"id": 1, "price": -math.inf, "blob": b"\x01"}
    pair.samples["different"].append({"key": 1, "left": left, "right": right})
    report = CompareReport([], {}, tables=["items"], rows={"items": {"a": 1, "b": 1}}, pairs=[pair])
    sample = strict_json(report_json(report))["pairs"][0]["samples"]["different"][0]
    assert sample["left"] == {"id": 1, "price": math.inf, "blob": {"hex": "01"}}
    assert sample["right"]["price"] == -math.inf and '\n  "status": "diverged",' in report_json(report)
    assert 'left {"id": 1, "price": 9.0e+999, "blob": {"hex": "01"}}' in render_report(report)


def test_json_text_writes_valid_json_for_non_finite_floats_whatever_the_options() -> None:
    from mnesite.rlog.json_text import json_text as rlog_json_text

    value = {"a": [math.inf, -math.inf, math.nan, 1.5, "Infinity", "9.0e+999"], math.inf: (1, None)}
    text = rlog_json_text(value, indent=2)
    assert strict_json(text) == {"a": [math.inf, -math.inf, None, 1.5, "Infinity", "9.0e+999"], "9.0e+999": [1, None]}
    assert text.startswith('{\n  "a": [\n    9.0e+999,\n    -9.0e+999,\n    null,')
    assert rlog_json_text({"b": b"x", "é": 1e999}, default=lambda v: [math.inf], ensure_ascii=False) == (
        '{"b": [9.0e+999], "é": 9.0e+999}'
    )
    assert json_text(math.inf) == "9.0e+999" and json_text([b"\x00"]) == '[{"base64": "AA=="}]'


@pytest.mark.parametrize("command", [("get", "items", "1"), ("scan", "items"), ("count", "items"),
                                     ("query", "SELECT 1"), ("export", "items")])  # fmt: skip
def test_read_your_writes_without_after_says_it_reads_as_local(mnesite, command: tuple[str, ...]) -> None:
    """A command has no earlier write of its own, so ``--consistency read-your-writes`` without
    ``--after`` waited for nothing: it read exactly as ``local``, silently. It says so on stderr (the
    command still runs); with ``--after``, or another level, nothing is said."""
    warning = "Warning: --consistency read-your-writes without --after reads as local does"
    alone = mnesite(*command, "--consistency", "read-your-writes")
    assert alone.exit_code in (0, 1) and alone.stderr.startswith(warning), alone.output
    assert "give --after G,C" in alone.stderr
    assert "Warning" not in mnesite(*command, "--after", "0,0", "--consistency", "read-your-writes").stderr
    assert "Warning" not in mnesite(*command, "--consistency", "local").stderr


def test_an_infinite_real_is_written_as_a_json_number_by_every_json_output(
    mnesite, thread_node: ThreadNode, tmp_path: Path
) -> None:
    """A REAL column holds an infinity (SQLite stores 1e999 so; ``put`` takes ``1e999``), and every
    ``--json`` output and JSON lines export wrote it as Python's ``Infinity``, which is not JSON: jq
    and every other parser refused the whole document. It is written as SQLite's json() writes it,
    ``9.0e+999``, a JSON number that parsers read back as infinity (import too)."""
    assert mnesite("put", "items", '{"id": 1, "price": 1e999}').exit_code == 0
    assert mnesite("put", "items", '{"id": 2, "price": -1e999}').exit_code == 0
    assert mnesite("put", "items", '{"id": 3, "price": 2.5}').exit_code == 0
    rows = [{"id": 1, "price": math.inf}, {"id": 2, "price": -math.inf}, {"id": 3, "price": 2.5}]

    assert mnesite("get", "items", "1", "--json").stdout == '{"id": 1, "price": 9.0e+999}\n'
    assert strict_json(mnesite("get", "items", "1", "--json").stdout) == rows[0]
    assert strict_json(mnesite("get", "items", "2").stdout) == rows[1]  # the text form prints the row as JSON too
    assert strict_json(mnesite("scan", "items", "--json").stdout) == rows
    query = mnesite("query", "SELECT id, price, -1e999 FROM items ORDER BY id", "--json")
    assert strict_json(query.stdout)["rows"] == [[row["id"], row["price"], -math.inf] for row in rows]
    changes = mnesite("changes", "items", "--json").stdout.splitlines()
    assert [strict_json(line)["row"] for line in changes[1:]] == rows  # after the create_table record
    tail = strict_json(mnesite("rlog", "tail", "default", "-n", "3", "--json").stdout)
    assert [entry["ops"][0]["row"] for entry in tail] == rows

    exported = tmp_path / "items.jsonl"
    assert mnesite("export", "items", "--output", str(exported)).exit_code == 0
    assert [strict_json(line) for line in exported.read_text().splitlines()] == rows
    created = mnesite("table", "create", "copy", "--key-column", "id", "--column", "id:INTEGER",
                      "--column", "price:REAL")  # fmt: skip
    assert created.exit_code == 0
    assert mnesite("import", "copy", str(exported)).exit_code == 0
    with thread_node.client() as client:
        assert list(client.scan("copy")) == rows


def test_json_text_writes_blobs_and_non_finite_floats_as_json_in_one_document() -> None:
    value = {"raw": b"\x00", "values": [math.inf, -math.inf, math.nan, 1.5], "name": "Infinity"}
    text = json_text(value)
    assert text == '{"raw": {"base64": "AA=="}, "values": [9.0e+999, -9.0e+999, null, 1.5], "name": "Infinity"}'
    assert strict_json(text)["values"][:2] == [math.inf, -math.inf]
    assert json_text([1, "a", None]) == json.dumps([1, "a", None])  # the common case: json's own text


def test_a_param_that_is_not_json_is_text_even_when_python_reads_it_as_a_number(mnesite) -> None:
    """``--param`` binds "JSON if it parses, else the text": Python's json also reads ``NaN``,
    ``Infinity`` and ``-Infinity``, which are not JSON, so ``--param NaN`` was refused ("NaN cannot be
    stored") and ``--param Infinity`` bound a REAL where the text was meant (a name, a title)."""
    result = mnesite(
        "query", "SELECT ?, typeof(?), ?, ?, typeof(?)", "--json",
        "--param", "NaN", "--param", "Infinity", "--param", "-Infinity", "--param", "1e999", "--param", "1e999",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert strict_json(result.stdout)["rows"] == [["NaN", "text", "-Infinity", math.inf, "real"]]


def test_an_import_reads_a_file_that_opens_with_a_byte_order_mark(
    mnesite, thread_node: ThreadNode, tmp_path: Path
) -> None:
    """A CSV saved by Excel ("CSV UTF-8") or a Windows tool opens with a UTF-8 byte order mark: the
    import read it as part of the first column's name and refused the file ("items has no column
    '\\ufeffid'", naming line 2), and a JSON lines file so was "not valid JSON" at line 1. The mark is
    not data: it is skipped, from a file as from stdin."""
    bom = "\ufeff"
    csv_file = tmp_path / "excel.csv"
    csv_file.write_bytes((bom + "id,price\r\n1,1.5\r\n2,2.5\r\n").encode())
    result = mnesite("import", "items", str(csv_file))
    assert result.exit_code == 0, result.output
    lines = tmp_path / "rows.jsonl"
    lines.write_bytes((bom + '{"id": 3, "price": 3.5}\n').encode())
    assert mnesite("import", "items", str(lines)).exit_code == 0
    piped = mnesite("import", "items", "-", input=bom + '{"id": 4, "price": 4.5}\n')
    assert piped.exit_code == 0, piped.output
    with thread_node.client() as client:
        assert list(client.scan("items")) == [{"id": i, "price": i + 0.5} for i in range(1, 5)]


def test_an_import_of_a_file_that_is_not_utf8_names_the_file_line_and_byte_and_writes_nothing(
    mnesite, thread_node: ThreadNode, tmp_path: Path
) -> None:
    """A file in another encoding (Latin-1 from an old export, a binary file given by mistake) failed in
    the middle of reading with ``unexpected UnicodeDecodeError`` naming neither the file nor the line.
    It is bad input like a malformed line: one ``Error:`` line naming the file, the line and the byte
    offset of the first byte that is not UTF-8, exit 1, and nothing written."""
    good = b'{"id": 1, "price": 1.5}\n{"id": 2, "price": 2.5}\n'
    bad = b'{"id": 3, "note": "caf' + b"\xe9" + b'"}\n'
    cases = {
        "rows.jsonl": (good + bad, 3, len(good) + len('{"id": 3, "note": "caf')),
        "rows.csv": (b"id,price\n1,1.5\n2,2.\xff5\n", 3, len(b"id,price\n1,1.5\n2,2.")),
        # A byte order mark counts in the offset (it is bytes of the file), then a truncated sequence.
        "bom.csv": (b"\xef\xbb\xbfid,price\n\xe2\x82\n", 2, 3 + len(b"id,price\n")),
    }
    for name, (content, line, offset) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        result = mnesite("import", "items", str(path))
        expected = f"Error: {path}: line {line}, byte {offset}: not UTF-8 text"
        assert result.exit_code == 1 and result.output.startswith(expected), (name, result.output)
        assert len(result.output.splitlines()) == 1 and "unexpected" not in result.output, result.output
    piped = CliRunner().invoke(
        main, ["import", "items", "-", "--node", thread_node.endpoint], input=good + bad, catch_exceptions=False
    )
    expected = f"Error: <stdin>: line 3, byte {len(good) + 22}: not UTF-8 text (byte 0xe9)"
    assert piped.exit_code == 1 and piped.output.startswith(expected), piped.output
    with thread_node.client() as client:  # refused by the check pass (CliRunner's stdin is seekable)
        assert client.count("items") == 0


def test_a_csv_header_naming_an_unknown_column_is_refused_at_line_1(mnesite, tmp_path: Path) -> None:
    """The header was checked only with each row: the error named line 2 (the first row) for a column
    of line 1, and a header-only file with a wrong column imported nothing and exited 0."""
    for content in ("id,hue\n1,red\n", "id,hue\n"):
        path = tmp_path / "items.csv"
        path.write_text(content)
        result = mnesite("import", "items", str(path))
        assert result.exit_code == 1, (content, result.output)
        assert result.output == "Error: line 1: items has no column 'hue'\n", content


def test_an_export_shows_its_progress_on_stderr_unless_quiet(
    mnesite, thread_node: ThreadNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long export printed nothing until it ended (import, backup and compare show their progress):
    an operator could not tell a slow export of a large table from a stuck one. It says how far it
    got on stderr, about once a second, and how many rows it wrote; the rows alone go to the output."""
    from mnesite.cli import progress

    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)  # a line per page, here
    with thread_node.client() as client:
        client.transact([{"op": "write", "table": "items", "row": {"id": i, "price": 0.5}} for i in range(25)])
    result = mnesite("export", "items", "--page-rows", "10")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == list(range(25))
    assert result.stderr.splitlines() == [
        "export: 10 rows (key 9)",
        "export: 20 rows (key 19)",
        "export: 25 rows (key 24)",
        "export: 25 rows, done",
    ]
    csv_file = tmp_path / "items.csv"
    quiet = mnesite("export", "items", "--format", "csv", "--output", str(csv_file), "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output
    assert len(csv_file.read_text().splitlines()) == 26


def test_put_and_tx_write_a_blob_given_as_get_prints_it(mnesite, thread_node: ThreadNode) -> None:
    """``get``, ``scan`` and ``export`` print a BLOB as ``{"base64": ...}`` and ``import`` reads it so,
    but ``put`` and ``tx`` refused that form ("must be null, a 64-bit integer, a float, a string or
    bytes"), and JSON has no other: no BLOB could be written, nor a row read with ``get --json`` be
    written back. They take it now, in rows, keys and guards."""
    created = mnesite("table", "create", "files", "--key-column", "digest", "--column", "digest:BLOB",
                      "--column", "body:BLOB", "--column", "name:TEXT")  # fmt: skip
    assert created.exit_code == 0, created.output
    row = '{"digest": {"base64": "AP8="}, "body": {"base64": "aGVsbG8="}, "name": "hello"}'
    put = mnesite("put", "files", row)
    assert put.exit_code == 0, put.output
    with thread_node.client() as client:
        assert client.get("files", b"\x00\xff") == {"digest": b"\x00\xff", "body": b"hello", "name": "hello"}
    got = mnesite("get", "files", "00ff", "--json")
    assert json.loads(got.stdout) == json.loads(row)
    assert mnesite("put", "files", got.stdout).exit_code == 0  # what get printed is a row put takes

    transaction = {
        "guards": [{"table": "files", "key": {"base64": "AP8="}, "equals": json.loads(row)}],
        "ops": [
            {"op": "delete", "table": "files", "key": {"base64": "AP8="}},
            {"op": "write", "table": "files", "row": {"digest": {"base64": "AQ=="}, "body": None, "name": "x"}},
        ],
    }
    applied = mnesite("tx", "-", input=json.dumps(transaction))
    assert applied.exit_code == 0, applied.output
    with thread_node.client() as client:
        assert list(client.scan("files")) == [{"digest": b"\x01", "body": None, "name": "x"}]

    bad = mnesite("put", "files", '{"digest": {"base64": "not base64!"}, "body": null, "name": "x"}')
    assert bad.exit_code == 1 and bad.output.startswith("Error: ROW_JSON: column 'digest': "), bad.output


def test_tx_reads_its_file_with_a_bound(mnesite, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tx`` read FILE whole before looking at it: ``mnesite tx -`` fed a large file by mistake (a dump,
    /dev/zero) held all of it in memory. It reads at most ``TX_CHARS_MAX`` characters (far above what
    a transaction that fits a frame spells) and refuses a longer file."""
    import mnesite.cli.main as cli_main

    monkeypatch.setattr(cli_main, "TX_CHARS_MAX", 200, raising=False)
    small = {"ops": [{"op": "write", "table": "items", "row": {"id": 1, "price": 0.5}}]}
    assert mnesite("tx", "-", input=json.dumps(small)).exit_code == 0
    large = {"ops": [{"op": "write", "table": "items", "row": {"id": i, "price": 0.5}} for i in range(10)]}
    result = mnesite("tx", "-", input=json.dumps(large))
    assert result.exit_code == 1
    assert result.output == "Error: the transaction is longer than 200 characters; nothing was sent\n"


def test_scan_with_a_limit_asks_the_node_for_no_more_rows_than_it_prints(
    mnesite, thread_node: ThreadNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scan --limit 3`` asked the node for a whole page (1,000 rows by default, up to 10,000 with
    --page-rows), read, sent and decoded them, and printed 3."""
    from mnesite.rlog.client import Client

    with thread_node.client() as client:
        client.transact([{"op": "write", "table": "items", "row": {"id": i, "price": 0.5}} for i in range(50)])
    asked: list[int] = []
    scan_page = Client.scan_page

    def recorded(self, table, after=None, limit=1000, *args, **kwargs):
        asked.append(limit)
        return scan_page(self, table, after, limit, *args, **kwargs)

    monkeypatch.setattr(Client, "scan_page", recorded)
    result = mnesite("scan", "items", "--limit", "3", "--json")
    assert [row["id"] for row in json.loads(result.stdout)] == [0, 1, 2]
    assert asked == [3]
    asked.clear()
    from_key = mnesite("scan", "items", "--from", "10", "--limit", "3", "--page-rows", "2", "--json")
    assert [row["id"] for row in json.loads(from_key.stdout)] == [10, 11, 12]
    assert asked == [2]  # the first row is the get of --from; then at most the 2 rows still wanted


def test_a_table_shows_a_blob_as_the_hex_get_takes(mnesite, thread_node: ThreadNode) -> None:
    """``scan`` and ``query`` printed a BLOB as Python's ``b'\\x00\\xff'``: not what ``get``, ``delete``
    and ``scan --from`` take for a BLOB key (hex), nor anything a shell user can pass back."""
    created = mnesite("table", "create", "files", "--key-column", "digest", "--column", "digest:BLOB",
                      "--column", "name:TEXT")  # fmt: skip
    assert created.exit_code == 0, created.output
    with thread_node.client() as client:
        client.put("files", {"digest": b"\x00\xff", "name": "a"})
    assert mnesite("scan", "files").stdout.splitlines() == ["digest  name", "00ff    a"]
    assert mnesite("query", "SELECT digest FROM files").stdout.splitlines() == ["digest", "00ff"]
    assert json.loads(mnesite("get", "files", "00ff").stdout) == {"digest": {"base64": "AP8="}, "name": "a"}


def test_rlog_tail_shows_a_blob_delete_key_as_the_hex_delete_takes(mnesite, thread_node: ThreadNode) -> None:
    """``rlog tail`` printed a delete of a BLOB key as Python's ``b'\\x00\\xff'``, while ``scan``,
    ``query`` and ``get`` print a BLOB as the hex that ``delete`` takes (``cli.main._cell``)."""
    created = mnesite("table", "create", "files", "--key-column", "digest", "--column", "digest:BLOB")
    assert created.exit_code == 0, created.output
    with thread_node.client() as client:
        client.put("files", {"digest": b"\x00\xff"})
        client.delete("files", b"\x00\xff")
        client.put("items", {"id": 7})
        client.delete("items", 7)
    text = mnesite("rlog", "tail", "default", "-n", "3").stdout
    assert "delete files 00ff" in text and "b'" not in text, text
    assert "delete items 7" in text, text


def test_a_csv_export_finishes_with_its_columns_when_the_table_gains_one_mid_export(
    mnesite, thread_node: ThreadNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column added to the table while a CSV export ran made ``csv.DictWriter`` raise on the first row
    that held it: a traceback and a CSV cut short. The export finishes with the columns of its header
    and says on stderr (even with --quiet) which column it left out and how to get it."""
    from mnesite.rlog.client import Client

    with thread_node.client() as client:
        client.transact([{"op": "write", "table": "items", "row": {"id": i, "price": 0.5}} for i in range(6)])
    scan_page = Client.scan_page
    pages: list[int] = []

    def page_then_add_a_column(self: Client, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        pages.append(len(pages))
        if len(pages) == 2:  # between the first page and the second
            with thread_node.client() as admin:
                admin.add_column("items", "colour", "TEXT")
                admin.put("items", {"id": 5, "price": 0.5, "colour": "red"})
        return scan_page(self, *args, **kwargs)

    monkeypatch.setattr(Client, "scan_page", page_then_add_a_column)
    exported = tmp_path / "items.csv"
    result = mnesite("export", "items", "--format", "csv", "--output", str(exported), "--page-rows", "2", "--quiet")
    assert result.exit_code == 0, result.output
    assert exported.read_text().splitlines() == ["id,price", *(f"{i},0.5" for i in range(6))]
    assert result.stderr == (
        "export: items gained the column colour during the export; this CSV has the columns of its "
        "header (id, price): export again to include it\n"
    )


# A value written to forge a second row and to reach the terminal: a newline with a fake row after it,
# a tab, a carriage return, ESC's colour sequence, NUL, the 8-bit CSI, DEL, a line separator and a
# right-to-left override.
HOSTILE = "ok\n2   forged\tcell\r\x1b[31mred\x1b[0m\x00\x9b\x7f\u2028\u202eevil"
HOSTILE_SHOWN = r"ok\n2   forged\tcell\r\x1b[31mred\x1b[0m\x00\x9b\x7f\u2028\u202eevil"


def _terminal_safe(text: str) -> bool:
    """No character a terminal acts on but the line ends (C0, DEL, C1, U+2028/9, bidi overrides)."""
    return not any(
        (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029\u202a\u202b\u202c\u202d\u202e"
        for c in text
    )


def test_a_text_table_shows_control_characters_escaped_one_row_a_line(mnesite, thread_node: ThreadNode) -> None:
    """``scan`` and ``query`` printed a TEXT value as it is: a newline forged a row of its own, and ESC,
    NUL, the 8-bit CSI reached the operator's terminal (click strips ANSI only when not on a terminal:
    ``color=True`` here is a terminal). The text form escapes them as Python writes them, a backslash
    doubled (as a BLOB is shown as hex); ``--json`` stays exact."""
    created = mnesite("table", "create", "notes", "--key-column", "id", "--column", "id:INTEGER",
                      "--column", "body:TEXT")  # fmt: skip
    assert created.exit_code == 0, created.output
    with thread_node.client() as client:
        client.put("notes", {"id": 1, "body": HOSTILE})
        client.put("notes", {"id": 3, "body": "C:\\temp\\n"})  # a backslash and an n: not a newline
        client.put("items", {"id": 4})
        client.delete("items", 4)
    runner = CliRunner()

    def terminal(*args: str) -> str:
        result = runner.invoke(main, [*args, "--node", thread_node.endpoint], color=True, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.stdout

    scanned = terminal("scan", "notes")
    assert scanned.splitlines() == ["id  body", f"1   {HOSTILE_SHOWN}", "3   C:\\\\temp\\\\n"], scanned
    queried = terminal("query", 'SELECT body AS "b\nx", id FROM notes WHERE id = ?', "--param", "1")
    assert queried.splitlines() == [f"b\\nx{' ' * (len(HOSTILE_SHOWN) - 4)}  id", f"{HOSTILE_SHOWN}  1"], queried
    changes = terminal("changes", "notes")
    tail = terminal("rlog", "tail", "default", "-n", "4")
    for text in (scanned, queried, changes, tail, terminal("get", "notes", "1"), terminal("table", "list")):
        assert _terminal_safe(text), repr(text)
    assert len(changes.splitlines()) == 3  # the table's creation and two writes, one line each
    # --json: the exact values.
    assert json.loads(terminal("scan", "notes", "--json"))[0]["body"] == HOSTILE
    assert json.loads(terminal("query", "SELECT body FROM notes", "--json"))["rows"][0] == [HOSTILE]
    assert json.loads(terminal("get", "notes", "1", "--json"))["body"] == HOSTILE


def test_display_text_escapes_what_a_terminal_acts_on_and_nothing_else() -> None:
    from mnesite.cli.main import display_text

    assert display_text("plain é 中 ✓ \u200d") == "plain é 中 ✓ \u200d"  # printable text, a ZWJ kept
    assert display_text(HOSTILE) == HOSTILE_SHOWN
    assert display_text("\\") == "\\\\" and display_text("\x85\u2029\ud800\u2066") == r"\x85\u2029\ud800\u2066"
    assert all(_terminal_safe(display_text(chr(code))) for code in range(0x3000))
