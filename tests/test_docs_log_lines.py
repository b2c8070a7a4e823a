"""The log lines and errors the operator pages quote are ones the code writes.

docs/operations/troubleshooting.md is read by the line a node logged: a row whose line the code no
longer writes, or writes in other words, sends the reader nowhere. Each line quoted in the first
column of its tables, and each log line in a fenced block of docs/operations/faults.md, is cut at what
the node fills in (``...``, the placeholders ``N``, ``S``, ``PATH`` and the like, example names and
values) and at ``: ``/``; `` (where messages are joined); every piece left must be in a string literal
of the node's or the CLI's code, with its format fields (``%s``, ``{...}``) as cuts too. (What a line
means is still the page's to get right: its "node is up" row quoted ``core core1 listens at ...``,
which a core writes when it learns *another* core's endpoint; the start-up line is ``... serving on
...``.)
"""

from __future__ import annotations

import ast
import re
from functools import cache

from tests.conftest import REPO

SOURCE_DIRS = ("core", "rlog", "replicant", "bootstrap", "cli")
TROUBLESHOOTING = REPO / "docs" / "operations" / "troubleshooting.md"
FAULTS = REPO / "docs" / "operations" / "faults.md"
# What a quoted line stands for rather than says: elisions, placeholders, tx keys, numbers, the pages'
# example names and values, and the joints between messages ("Error: " is the CLI's prefix).
CUTS = re.compile(
    r"\.\.\.|\[\.\.\.\]|\(g, c\)|\b[A-Z]\b|\b(?:NAME|FILE|PATH|DIR|MODE|REASON)\b|\[section\]\.key|\d+"
    r"|\b(?:node )?(?:core|replicant)\d\b|\bops\b|\bSIG(?:TERM|INT)\b|tcp://|\S*mnesite\.db\b|'"
    r"|Error: |: |; |who could "
)
# Values faults.md's example lines carry: an error SQLite or the kernel wrote, a path, the logger's prefix.
FAULTS_VALUES = re.compile(
    r"^(?:CRITICAL|ERROR|WARNING|INFO) mnesite(?:\.\w+)?: |\(database or disk is full\)|disk_full"
    r"|/data/core\d/\S+|\[Errno \d+\] Input/output error|\(the disk failed: fdatasync of"
)
PIECE_CHARS_MIN = 5  # shorter pieces ("(pid", "of") say nothing about the line


@cache
def code_text() -> str:
    """Every string literal of the code, format fields replaced by a NUL (no piece spans one), but a
    module-level text constant an f-string names written out (``f"this core {UNSPOKEN_VERSION}"``)."""
    modules = [ast.parse(path.read_text()) for folder in SOURCE_DIRS for path in sorted((REPO / folder).rglob("*.py"))]
    constants = {
        node.targets[0].id: node.value.value
        for module in modules
        for node in module.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }

    def part(value: ast.expr) -> str:
        if isinstance(value, ast.Constant):
            return str(value.value)
        inner = value.value if isinstance(value, ast.FormattedValue) else value
        return constants.get(inner.id, "\0") if isinstance(inner, ast.Name) else "\0"

    literals: list[str] = []
    for module in modules:
        for node in ast.walk(module):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                literals.append("".join(part(value) for value in node.values))
    return "\n".join(re.sub(r"%[-\d.]*[sdrf]|\{[^{}]*\}", "\0", literal) for literal in literals)


def pieces(line: str) -> list[str]:
    found = (piece.strip(" .,()[]") for piece in CUTS.split(line))
    return [piece for piece in found if len(piece) >= PIECE_CHARS_MIN]


def unknown_pieces(line: str, code: str) -> list[str]:
    return [piece for piece in pieces(line) if piece not in code]


def troubleshooting_lines() -> list[str]:
    lines = []
    for row in TROUBLESHOOTING.read_text().splitlines():
        if row.startswith("| `") or row.startswith("| client: `"):
            lines += re.findall(r"`([^`]+)`", row.split(" | ")[0])
    return lines


def faults_lines() -> list[str]:
    blocks = re.findall(r"```\n(.*?)```", FAULTS.read_text(), re.DOTALL)
    return [FAULTS_VALUES.sub(" ... ", line.strip()) for block in blocks for line in block.splitlines() if line.strip()]


def test_every_line_troubleshooting_quotes_is_one_the_code_writes() -> None:
    lines = troubleshooting_lines()
    assert len(lines) >= 50, len(lines)  # the tables are read, not skipped
    unknown = {line: missing for line in lines if (missing := unknown_pieces(line, code_text()))}
    assert unknown == {}, f"lines troubleshooting.md quotes that no code writes: {unknown}"


def test_every_log_line_faults_shows_is_one_the_code_writes() -> None:
    lines = faults_lines()
    assert len(lines) >= 6 and all(pieces(line) for line in lines), lines
    unknown = {line: missing for line in lines if (missing := unknown_pieces(line, code_text()))}
    assert unknown == {}, f"lines faults.md shows that no code writes: {unknown}"


def test_a_line_the_code_does_not_write_is_caught() -> None:
    code = code_text()
    assert unknown_pieces("core core1 serving on tcp://..., data in ...", code) == []
    assert unknown_pieces("core core1 listening on tcp://...", code) == ["listening on"]
    assert unknown_pieces("shard S: snapshot install abandoned at last: ...", code) == [
        "snapshot install abandoned at last"
    ]
