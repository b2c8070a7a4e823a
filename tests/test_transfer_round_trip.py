"""``export`` then ``import`` gives back what export wrote: random rows of every column type, through
JSON lines exactly, through CSV exactly but for what CSV cannot carry (``csv_carries``, as
docs/reference/cli.md says it), compared by stored value and SQLite storage class (``typeof``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from mnesite.cli.main import main

from tests.conftest import ThreadNode

pytestmark = pytest.mark.timeout(120)

COLUMN_TYPES = ("INTEGER", "REAL", "TEXT", "BLOB", "ANY")
ROWS = 150
# Characters a TEXT is drawn from: CSV's own (comma, quote, line ends), every C0 control, DEL, C1's
# NEL, the line separator, a byte order mark, non-ASCII of one to four UTF-8 bytes, and the words
# some CSV dialects take for null or an empty BLOB.
TEXT_PIECES = [
    *(chr(code) for code in range(0x20)),
    ",", '"', "'", " ", "\r\n", "\x7f", "\x85", "\u2028", "\ufeff", "é", "中", "😀", "a", "Z", "0", "-",
    "\\N", "NULL", "X''", "inf", "1.5",
]  # fmt: skip


def random_value(rng: random.Random, column_type: str) -> Any:
    if column_type == "ANY":
        column_type = rng.choice(("INTEGER", "REAL", "TEXT", "BLOB"))
    if rng.random() < 0.15:
        return None
    if column_type == "INTEGER":
        return rng.choice((0, -1, 1, 2**63 - 1, -(2**63), rng.randint(-(2**63), 2**63 - 1), rng.randint(-999, 999)))
    if column_type == "REAL":
        special = (0.0, -0.0, 3.0, 1e300, -5e-324, 0.1, float("inf"), float("-inf"))
        return rng.choice((*special, rng.uniform(-1e6, 1e6), rng.random() * 10.0 ** rng.randint(-300, 300)))
    if column_type == "TEXT":
        return "" if rng.random() < 0.2 else "".join(rng.choices(TEXT_PIECES, k=rng.randint(1, 12)))
    return b"" if rng.random() < 0.2 else rng.randbytes(rng.randint(1, 24))


def random_key(rng: random.Random, key_type: str, index: int) -> Any:
    """A key of ``key_type``, unique by its index (the first key is the type's empty value, if any)."""
    if key_type == "INTEGER":
        return index * 2**50 - 2**62
    if key_type == "TEXT":
        return f"{index:04d}" + "".join(rng.choices(TEXT_PIECES, k=rng.randint(0, 6))) if index else ""
    return index.to_bytes(2, "big") + rng.randbytes(rng.randint(0, 6)) if index else b""


def csv_carries(value: Any, column_type: str) -> Any:
    """What CSV gives back of ``value`` in a ``column_type`` column (docs/reference/cli.md, ``export``):
    a null in a TEXT column comes back as the empty text; an ANY column's values as TEXT, as the CSV
    writes them (a REAL as Python's ``str``, a BLOB as hex), an empty text or BLOB there as null."""
    if column_type == "TEXT" and value is None:
        return ""
    if column_type != "ANY" or value is None:
        return value
    text = value.hex() if isinstance(value, bytes) else str(value)
    return text or None


def stored(client: Any, table: str, columns: list[tuple[str, str]]) -> list[list[tuple[str, Any]]]:
    """Every row of ``table`` in key order, each value with its storage class (SQLite's ``typeof``)."""
    names = [name for name, _ in columns]
    selected = ", ".join(f'typeof("{name}"), "{name}"' for name in names)
    with client.query(f'SELECT {selected} FROM "{table}" ORDER BY "{names[0]}"') as result:
        return [[(row[i].upper(), row[i + 1]) for i in range(0, len(row), 2)] for row in result]


def exact(row: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """A stored row compared exactly: ``repr`` tells 1.0 from 1, and -0.0 from 0.0, where ``==`` does not."""
    return [(storage_class, repr(value)) for storage_class, value in row]


def as_stored(value: Any) -> tuple[str, Any]:
    """``value`` with the storage class SQLite gives it."""
    return {type(None): "NULL", int: "INTEGER", float: "REAL", str: "TEXT", bytes: "BLOB"}[type(value)], value


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("key_type", ["INTEGER", "TEXT", "BLOB"])
def test_random_rows_come_back_from_json_lines_exactly_and_from_csv_but_for_what_csv_cannot_carry(
    thread_node: ThreadNode, tmp_path: Path, key_type: str, seed: int
) -> None:
    """An empty BLOB exported to CSV as an empty cell, the cell of a null: it came back as null."""
    rng = random.Random(f"{key_type}-{seed}")
    columns = [("k", key_type), *((f"c_{kind.lower()}_{n}", kind) for kind in COLUMN_TYPES for n in range(2))]
    runner = CliRunner()

    def mnesite(*args: str) -> str:
        result = runner.invoke(main, [*args, "--node", thread_node.endpoint], catch_exceptions=False)
        assert result.exit_code == 0, (args, result.output)
        return result.stdout

    def create(table: str) -> None:
        mnesite("table", "create", table, "--key-column", "k", *(f"--column={n}:{t}" for n, t in columns))

    create("source")
    rows = [
        {"k": random_key(rng, key_type, index), **{name: random_value(rng, kind) for name, kind in columns[1:]}}
        for index in range(ROWS)
    ]
    with thread_node.client() as client:
        for low in range(0, ROWS, 50):
            client.transact([{"op": "write", "table": "source", "row": row} for row in rows[low : low + 50]])
        source = stored(client, "source", columns)
    assert len(source) == ROWS
    through_csv = [
        [as_stored(csv_carries(value, kind)) for (_, value), (_, kind) in zip(row, columns, strict=True)]
        for row in source
    ]
    for file_format, expected in (("jsonl", source), ("csv", through_csv)):
        exported = tmp_path / f"source.{file_format}"
        mnesite("export", "source", "--format", file_format, "--output", str(exported), "--page-rows", "40")
        create(f"copy_{file_format}")
        imported = json.loads(mnesite("import", f"copy_{file_format}", str(exported), "--json", "--quiet"))
        assert imported["rows"] == ROWS
        with thread_node.client() as client:
            copy = stored(client, f"copy_{file_format}", columns)
        assert len(copy) == ROWS
        for number, (got, wanted) in enumerate(zip(copy, expected, strict=True)):
            assert exact(got) == exact(wanted), (f"seed {key_type}-{seed}, {file_format}, row {number}", columns)


def test_a_csv_of_the_previous_release_imports_as_it_did_and_x_quotes_is_the_empty_blob(
    thread_node: ThreadNode, tmp_path: Path
) -> None:
    """The previous release wrote an empty BLOB as an empty cell, read back as null (but in the key,
    which is never null); export writes it ``X''`` now. A file of that release imports as before: an
    empty cell is null (the empty text in a TEXT column, the empty BLOB in a BLOB key)."""
    runner = CliRunner()

    def mnesite(*args: str) -> Any:
        return runner.invoke(main, [*args, "--node", thread_node.endpoint], catch_exceptions=False)

    for table in ("items", "copy"):
        created = mnesite("table", "create", table, "--key-column", "k", "--column", "k:BLOB",
                          "--column", "t:TEXT", "--column", "b:BLOB", "--column", "a:ANY")  # fmt: skip
        assert created.exit_code == 0, created.output
    old = tmp_path / "old.csv"
    old.write_text("k,t,b,a\n,,,\n01,X'',00ff,X''\n02,x,X'',5\n03,,x'',\n")
    assert mnesite("import", "items", str(old), "--quiet").exit_code == 0
    with thread_node.client() as client:
        assert list(client.scan("items")) == [
            {"k": b"", "t": "", "b": None, "a": None},
            {"k": b"\x01", "t": "X''", "b": b"\x00\xff", "a": "X''"},
            {"k": b"\x02", "t": "x", "b": b"", "a": "5"},
            {"k": b"\x03", "t": "", "b": b"", "a": None},
        ]
    exported = tmp_path / "items.csv"
    assert mnesite("export", "items", "--format", "csv", "--output", str(exported)).exit_code == 0
    assert exported.read_text() == "k,t,b,a\nX'',,,\n01,X'',00ff,X''\n02,x,X'',5\n03,,X'',\n"
    assert mnesite("import", "copy", str(exported), "--quiet").exit_code == 0
    with thread_node.client() as client:
        assert list(client.scan("copy")) == list(client.scan("items"))
