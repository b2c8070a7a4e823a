"""``mnesite import`` and ``export``: rows between a table and a JSON lines or CSV file, in bounded pieces.

Theory of operation
-------------------
Neither direction holds more than one batch (import) or one page (export) in memory, whatever the
file's or the table's size. Import reads the file line by line, turns each line into a full row of
the table (CSV cells converted to the declared column type, strictly, an empty cell null but in a TEXT
column, where it is the empty text, a BLOB cell hex or ``X''`` for the empty BLOB, and an ANY
column's cells text; JSON values as they are, of their column's type, a BLOB as ``{"base64": ...}``
or hex) and refuses a line that does not fit, naming it:
``line 7: ...``. Rows go to the node in transactions of ``batch_rows`` rows through the normal
write path (each all or nothing, replicated like any write); an error the node answers names the
lines of the batch it refused and says how many rows were imported before it. A batch also ends
before its request would outgrow the client's ``frame_bytes_max`` (with room for the envelope): wide
rows go in smaller transactions rather than in one the client must refuse to send. A batch whose
outcome is unknown is reported as such (the caller exits 3): it is never re-sent silently. A Ctrl-C
says the rows committed and the lines of a batch sent and not answered (outcome unknown, exit 3), and
an export's the rows written; both show their progress through ``cli.progress.ProgressLines``.

sqlite-utils' readers (``rows_from_file``) skip blank lines and hide the CSV reader, so they cannot
name the line of an error; the readers here are plain ``csv`` and ``json`` with line numbers.
Export writes through ``csv.DictWriter`` and ``json_text`` (what every ``--json`` writes), one row at a time.

What CSV carries back: JSON lines give every value back exactly; CSV every value but two kinds. A
BLOB is hex, the empty BLOB ``X''`` (its hex, nothing, is the empty cell of a null). In a TEXT column
a null comes back as the empty text: Python 3.11's csv reader reads an empty cell and a quoted ``""``
alike, and any other word for null (``\\N``, ``NULL``) is a text that a CSV of an earlier release
may hold, which would import as null from then on. An ANY column keeps no storage class: its cells
come back as TEXT as the CSV writes them (an integer's digits, a REAL as Python's ``str``, a BLOB's
hex), an empty one as null.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import IO, Any

import msgspec
from mnesite.cli.main import INTEGER_KEY, base64_blob, json_text
from mnesite.cli.progress import ProgressLines
from mnesite.rlog.client import Client, MnesiteError, OutcomeUnknown
from mnesite.rlog.messages import NOT_UTF8, scalars_refusal

LINE_CHARS_MAX = 16 * 1024 * 1024  # a longer line is refused after reading at most this much of it
# The share of the client's frame_bytes_max a batch's ops may fill: the rest is the request's envelope.
BATCH_FRAME_SHARE = 0.9
BYTE_ORDER_MARK = "\ufeff"  # skipped at the start of a file (and of stdin)
# How ``import`` decodes FILE (``bounded_lines``): bytes that are not UTF-8 become U+DC80..U+DCFF.
FILE_ERRORS = "surrogateescape"
NOT_UTF8_BYTE = re.compile("[\udc80-\udcff]")
csv.field_size_limit(LINE_CHARS_MAX)
# A CSV cell of an INTEGER column is read as a KEY argument is (``INTEGER_KEY``: ASCII digits, a
# leading minus); one of a REAL column is a decimal number as export writes it (an optional minus,
# digits with an optional fraction, an optional exponent) or ``inf``/``-inf`` (export's infinity).
# Python's int() and float() also read "1_000", " 12 ", "+5", other scripts' digits ("٣"), "nan" and
# "infinity": a mistyped cell, even a key's, was written as another number (another row).
REAL_CELL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|-?inf")
# What a JSON value of a column of each type may be (bool is not a number here, as the node says).
_JSON_KINDS: dict[str, tuple[type, ...]] = {"INTEGER": (int,), "REAL": (int, float), "TEXT": (str,)}
# An empty BLOB in a CSV cell of a BLOB column: its hex is nothing, the empty cell of a null, and an
# empty BLOB came back as null. SQLite's literal of the empty BLOB; import reads it in either case
# (``x''`` too). No file of an earlier release holds it: their import refused it (not hex).
EMPTY_BLOB_CELL = "X''"


class ImportFailed(Exception):
    def __init__(self, message: str, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown


@dataclass(frozen=True)
class Imported:
    """How far an import got: replaced whole, in one assignment, so that a Ctrl-C sees either the
    state before a step or the state after it, never half of it."""

    rows: int = 0
    transactions: int = 0
    last_line: int = 0  # the line of the last row imported (committed)
    # The lines of the batch sent and not answered yet ("lines 7-9"), None between transactions.
    in_flight: str | None = None


def interrupted_import(imported: Imported, table: str) -> ImportFailed:
    """What a Ctrl-C during an import says: the rows committed and, if a batch was sent and not
    answered, that its outcome is unknown (``outcome_unknown``: exit 3). It is never re-sent here."""
    done = "no row was imported"
    if imported.transactions:
        figures = f"{imported.rows} rows in {imported.transactions} transactions"
        done = f"{figures} were imported (through line {imported.last_line})"
    rest = f"the rows after line {imported.last_line}" if imported.transactions else "the file"
    if imported.in_flight is None:
        return ImportFailed(f"import interrupted: {done}, none was in flight; import {rest} to finish")
    return ImportFailed(
        f"import interrupted: {done}; the transaction of {imported.in_flight} was sent and not answered: "
        f"outcome unknown, it may or may not have been imported (it was not sent again); check its rows "
        f"with `mnesite get {table} KEY`, then import {rest} (a row imported twice keeps the file's values)",
        outcome_unknown=True,
    )


def file_name(file: IO[str]) -> str:
    """What a message calls ``file``: its path, or ``<stdin>`` (a stream click re-wrapped to decode it
    as ``FILE_ERRORS`` says may have no name)."""
    return str(getattr(file, "name", "<stdin>"))


def format_of(name: str) -> str:
    """The format a file name implies: ``.csv`` is CSV, everything else (``.jsonl``, stdin) JSON lines."""
    return "csv" if str(name).lower().endswith(".csv") else "jsonl"


def _blob(value: Any, where: str) -> bytes:
    try:
        blob = base64_blob(value)
    except ValueError as error:
        raise ImportFailed(f"{where}: {error}") from None
    if blob is not None:
        return blob
    if isinstance(value, str):
        try:
            return bytes.fromhex(value)
        except ValueError:
            raise ImportFailed(f'{where}: a BLOB is given as hex or {{"base64": ...}}') from None
    raise ImportFailed(f'{where}: a BLOB is given as hex or {{"base64": ...}}')


def _to_cell(value: Any, column_type: str) -> Any:
    """A value as ``write_rows`` puts it in a CSV cell of a ``column_type`` column: a BLOB as hex, an
    empty BLOB of a BLOB column as ``EMPTY_BLOB_CELL`` (its hex, nothing, is the empty cell of a null)."""
    if not isinstance(value, bytes):
        return value
    return EMPTY_BLOB_CELL if value == b"" and column_type == "BLOB" else value.hex()


def _from_cell(text: str, column_type: str, where: str) -> Any:
    """A CSV cell as a value of ``column_type`` (the table's declared type); an empty cell is null, but
    in a TEXT column it is the empty text (CSV cannot tell them apart) and an ANY column's cells stay text.
    A BLOB cell is hex, or ``X''`` (``x''``) for the empty BLOB."""
    if column_type == "BLOB" and text in (EMPTY_BLOB_CELL, EMPTY_BLOB_CELL.lower()):
        return b""
    if text == "" and column_type != "TEXT":
        return None
    if column_type == "INTEGER":
        if INTEGER_KEY.fullmatch(text) is None:
            raise ImportFailed(f"{where}: {text[:40]!r} is not INTEGER (ASCII digits, a leading - if negative)")
        try:
            return int(text)
        except ValueError:  # more digits than Python converts (4,300): far outside SQLite's 64 bits anyway
            raise ImportFailed(f"{where}: an integer of {len(text)} digits is outside SQLite's 64-bit range") from None
    if column_type == "REAL":
        if REAL_CELL.fullmatch(text) is None:
            raise ImportFailed(f"{where}: {text[:40]!r} is not REAL (a decimal number such as -1.5 or 2e-3, or inf)")
        return float(text)
    if column_type == "BLOB":
        return _blob(text, where)
    return text


def _check_row(row: dict[str, Any], schema: dict[str, Any], line: int) -> dict[str, Any]:
    types = dict((name, kind) for name, kind in schema["columns"])
    unknown = [name for name in row if name not in types]
    if unknown:
        raise ImportFailed(f"line {line}: {schema['table']} has no column {unknown[0][:64]!r}")
    if row.get(schema["key"]) is None:
        raise ImportFailed(f"line {line}: the key column {schema['key']!r} is missing or null")
    for name, value in row.items():
        if types[name] == "BLOB" and value is not None and not isinstance(value, bytes):
            row[name] = _blob(value, f"line {line}: column {name!r}")
        elif (
            (kinds := _JSON_KINDS.get(types[name]))
            and isinstance(value, (int, float, str))  # a scalar: any other value is refused below
            and (type(value) is bool or not isinstance(value, kinds))
        ):
            # The node refuses it too (no conversion: "12" is no INTEGER), but a file's check pass
            # finds it before any batch is written.
            raise ImportFailed(f"line {line}: column {name!r}: {types[name]} column, got {json_text(value)[:40]}")
        elif isinstance(value, dict):
            # A BLOB in a column of another type (ANY: any storage class) is {"base64": ...} too, as
            # export writes it and as put and tx take it; any other object is refused below.
            try:
                blob = base64_blob(value)
            except ValueError as error:
                raise ImportFailed(f"line {line}: column {name!r}: {error}") from None
            row[name] = value if blob is None else blob
    # A value the client would refuse unsent, or that msgpack cannot hold at all (an integer past 2**64,
    # a lone surrogate from a JSON "\ud800"): found here, so by the check pass before anything is written.
    if scalars_refusal(values := list(row.values())) is not None or not _encodable(values):
        for name, value in row.items():
            if (refusal := _value_refusal(value)) is not None:
                raise ImportFailed(f"line {line}: column {name!r}: {refusal}")
    return row


def _encodable(values: list[Any]) -> bool:
    try:
        msgspec.msgpack.encode(values)
    except UnicodeEncodeError:
        return False
    return True


def _value_refusal(value: Any) -> str | None:
    if isinstance(value, str) and not _encodable([value]):
        return NOT_UTF8
    return scalars_refusal((value,))


def bounded_lines(file: IO[str]) -> Iterator[str]:
    """The lines of ``file``, each read with a bound: a line longer than ``LINE_CHARS_MAX`` is refused.
    A byte order mark opening the file is dropped.

    ``file`` is decoded with ``errors="surrogateescape"`` (``FILE_ERRORS``): a byte that is not UTF-8
    arrives as a lone surrogate of U+DC80..U+DCFF, which no UTF-8 text can hold, and is refused here
    naming the file, its line and its byte offset. Decoded strictly, the decoder raised in the middle
    of a read, with an offset into its own buffer, and the import ended in ``unexpected
    UnicodeDecodeError``. The offset counts the bytes of the lines before (their UTF-8 length)."""
    line_number = 0
    offset = 0  # bytes of the file before this line
    while True:
        text = file.readline(LINE_CHARS_MAX + 1)
        if not text:
            return
        line_number += 1
        if len(text) > LINE_CHARS_MAX:
            raise ImportFailed(f"line {line_number}: longer than {LINE_CHARS_MAX} characters")
        if text.isascii():
            size = len(text)
        else:
            undecoded = NOT_UTF8_BYTE.search(text)
            if undecoded is not None:
                at = offset + len(text[: undecoded.start()].encode("utf-8", FILE_ERRORS))
                byte = ord(undecoded.group()) - 0xDC00  # surrogateescape's mapping back to the byte
                raise ImportFailed(
                    f"{file_name(file)}: line {line_number}, byte {at}: not UTF-8 text "
                    f"(byte 0x{byte:02x}); save the file as UTF-8"
                )
            size = len(text.encode("utf-8"))
        offset += size
        if line_number == 1 and text.startswith(BYTE_ORDER_MARK):
            text = text[1:]  # not data: Excel's "CSV UTF-8" and Windows tools open a file with it
        yield text


def read_rows(file: IO[str], file_format: str, schema: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` for every row of ``file``; raises ``ImportFailed`` naming the line."""
    if file_format == "csv":
        reader = csv.DictReader(bounded_lines(file))
        types = dict((name, kind) for name, kind in schema["columns"])
        try:
            # The header first: a column it names wrongly is its line's error, also with no row after it.
            for name in reader.fieldnames or ():
                if name not in types:
                    raise ImportFailed(f"line {reader.line_num}: {schema['table']} has no column {name[:64]!r}")
            for record in reader:
                line = reader.line_num
                if None in record:
                    raise ImportFailed(f"line {line}: more cells than the header has columns")
                row = {}
                for name, text in record.items():
                    row[name] = None if text is None else _from_cell(text, types[name], f"line {line}: {name}")
                if row.get(schema["key"]) is None and types[schema["key"]] == "BLOB" and record[schema["key"]] == "":
                    row[schema["key"]] = b""  # a key is never null: its empty cell is the empty BLOB export wrote
                yield line, _check_row(row, schema, line)
        except csv.Error as error:
            raise ImportFailed(f"line {reader.line_num}: {error}") from None
        return
    for line, text in enumerate(bounded_lines(file), start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            raise ImportFailed(f"line {line}: not valid JSON: {error.msg} (column {error.colno})") from None
        if not isinstance(row, dict):
            raise ImportFailed(f"line {line}: must be a JSON object (one row per line)")
        yield line, _check_row(row, schema, line)


def import_rows(
    client: Client,
    table: str,
    rows: Iterator[tuple[int, dict[str, Any]]],
    batch_rows: int,
    progress: ProgressLines | None = None,
) -> Imported:
    """Write ``rows`` in transactions of at most ``batch_rows`` rows, each small enough to send; raise
    ``ImportFailed`` on the first refusal. A row too large to send even alone is refused naming its line.
    A Ctrl-C (KeyboardInterrupt) is an ``ImportFailed`` saying how far it got (``interrupted_import``).

    ``progress`` shows a line after a transaction (paced), and after the last."""
    imported = Imported()
    batch: list[tuple[int, dict[str, Any]]] = []
    batch_bytes = [0]
    bytes_max = int(client.frame_bytes_max * BATCH_FRAME_SHARE)

    def show(last: bool) -> None:
        if progress is not None:
            figures = f"{imported.rows} rows in {imported.transactions} transactions (line {imported.last_line})"
            progress.show(lambda: f"import: {figures}", final=last)

    def send() -> None:
        """The batch as one transaction."""
        nonlocal imported
        lines = f"lines {batch[0][0]}-{batch[-1][0]}" if len(batch) > 1 else f"line {batch[0][0]}"
        before = f"{imported.rows} rows in {imported.transactions} transactions were imported before"
        done = Imported(imported.rows + len(batch), imported.transactions + 1, batch[-1][0])
        imported = replace(imported, in_flight=lines)
        try:
            client.transact([write for _, write in batch])
        except OutcomeUnknown as error:
            raise ImportFailed(f"{lines}: {error}; {before}", outcome_unknown=True) from None
        except MnesiteError as error:
            raise ImportFailed(f"{lines}: {error}; {before}") from None
        # A Ctrl-C before this assignment reports the batch as in flight although it committed: the
        # safe side (checked, never taken for lost).
        imported = done
        batch.clear()
        batch_bytes[0] = 0

    rows = iter(rows)
    try:
        while True:
            try:
                line, row = next(rows)
            except StopIteration:
                break
            except ImportFailed as error:  # a line refused while reading (stdin has no check pass)
                if not imported.transactions:
                    raise
                before = f"{imported.rows} rows in {imported.transactions} transactions were imported before"
                raise ImportFailed(f"{error}; {before}") from None
            write = {"op": "write", "table": table, "row": row}
            size = len(msgspec.msgpack.encode(write))
            if batch and batch_bytes[0] + size > bytes_max:
                send()
                show(last=False)
            batch.append((line, write))
            batch_bytes[0] += size
            if len(batch) >= batch_rows:
                send()
                show(last=False)
        if batch:
            send()
        if imported.transactions:
            show(last=True)  # inside: a Ctrl-C as it is written (a blocked stderr) says the rows imported
    except KeyboardInterrupt:
        raise interrupted_import(imported, table) from None
    return imported


@dataclass
class Exported:
    rows: int = 0
    # Columns some row held that the CSV header, written from the schema at the start, does not name:
    # added to the table during the export (``table add-column``).
    columns_left_out: list[str] = field(default_factory=list)


def left_out_notice(table: str, schema: dict[str, Any], left_out: list[str]) -> str:
    """What an export says when a column added to ``table`` during it is not in its CSV."""
    many = len(left_out) > 1
    header = ", ".join(name for name, _ in schema["columns"])
    return (
        f"export: {table} gained the column{'s' if many else ''} {', '.join(left_out)} during the export; "
        f"this CSV has the columns of its header ({header}): export again to include {'them' if many else 'it'}"
    )


class ExportInterrupted(Exception):
    """A Ctrl-C during ``write_rows``: ``rows`` were written before it."""

    def __init__(self, rows: int) -> None:
        super().__init__(f"export interrupted after {rows} rows")
        self.rows = rows


def write_rows(
    output: IO[str],
    file_format: str,
    schema: dict[str, Any],
    pages: Iterator[list[dict[str, Any]]],
    progress: ProgressLines | None = None,
) -> Exported:
    """Write the rows of ``pages``, one page at a time.

    A CSV has the columns of ``schema``, its header: a column added to the table meanwhile is left out
    of every row (a row cannot add a cell the header lacks) and named in ``columns_left_out``, so the
    file stays a CSV that ``import`` reads. JSON lines write each row whole.
    ``progress`` shows a line after a page (paced), and one at the end. A Ctrl-C (KeyboardInterrupt)
    is an ``ExportInterrupted`` with the rows written."""
    exported = Exported()
    try:
        _write_pages(output, file_format, schema, pages, progress, exported)
        if progress is not None:  # inside: a Ctrl-C as it is written (a blocked stderr) says the rows written
            progress.show(lambda: f"export: {exported.rows} rows, done", final=True)
    except KeyboardInterrupt:
        raise ExportInterrupted(exported.rows) from None
    return exported


def _write_pages(
    output: IO[str],
    file_format: str,
    schema: dict[str, Any],
    pages: Iterator[list[dict[str, Any]]],
    progress: ProgressLines | None,
    exported: Exported,
) -> None:
    """``write_rows``' loop; ``exported.rows`` counts each row once written (a CSV's one by one)."""
    writer = None
    if file_format == "csv":
        header = [name for name, _ in schema["columns"]]
        types = dict(schema["columns"])
        known = set(header)  # the header's columns, then those already named as left out
        writer = csv.DictWriter(output, fieldnames=header, extrasaction="ignore", lineterminator="\n")
        # csv quotes a field holding a character of its line terminator, "\n": a text with a lone "\r"
        # would go unquoted and end its row when read back. A row holding one has every field quoted.
        quoted = csv.DictWriter(
            output, fieldnames=header, extrasaction="ignore", lineterminator="\n", quoting=csv.QUOTE_ALL
        )
        writer.writeheader()
    for page in pages:
        if writer is not None:
            for row in page:
                new = row.keys() - known
                if new:
                    exported.columns_left_out += sorted(new)
                    known |= new
                cells = {name: _to_cell(value, types.get(name, "ANY")) for name, value in row.items()}
                carriage_return = any(isinstance(value, str) and "\r" in value for value in cells.values())
                (quoted if carriage_return else writer).writerow(cells)
                exported.rows += 1
        else:
            # Row by row, as for CSV: a Ctrl-C in a write that blocks (a full pipe took part of a page)
            # finds every row before it counted, not the page's first rows uncounted.
            for row in page:
                output.write(json_text(row) + "\n")
                exported.rows += 1
        if progress is not None and page:
            progress.show(lambda page=page: f"export: {exported.rows} rows (key {json_text(page[-1][schema['key']])})")
