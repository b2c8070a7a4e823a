"""Nothing of the README before the docs site was lost: its text was moved, not deleted.

The README of commit ``OLD_README_COMMIT`` (1,115 lines, before issue 25 split it) is cut into
paragraphs, list items, table rows and code lines; each must appear in the README.md, a page of
docs/, CHANGELOG.md or a file a page includes, as they were at ``MOVED_AT_COMMIT`` (the split's
last commit): later commits may rewrite what the code no longer does. Links are compared by their text (their targets
changed with the move) and whitespace is collapsed. Headings are not compared: pages renamed them.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import REPO

OLD_README_COMMIT = "4c12a49"
MOVED_AT_COMMIT = "752f139"
INCLUDED = ["spark/README.md", "spark/BENCHMARK.md", "benchmarks/PROFILE.md"]


def git(*arguments: str) -> str:
    try:
        answer = subprocess.run(["git", *arguments], cwd=REPO, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if answer.returncode != 0:
        pytest.skip(f"git {' '.join(arguments)} failed (a shallow clone?): {answer.stderr.strip()}")
    return answer.stdout


def old_readme() -> str:
    return git("show", f"{OLD_README_COMMIT}:README.md")


def normalise(text: str) -> str:
    text = re.sub(r"\[([^\]]+)\]\([^)\s]+\)", r"\1", text)  # a link by its text
    return " ".join(text.split())


def units(markdown: str) -> Iterator[str]:
    """Paragraphs, list items, table rows and code lines of a Markdown text (headings left out)."""
    paragraph: list[str] = []
    in_code = False
    for line in [*markdown.splitlines(), ""]:
        stripped = line.strip()
        if stripped.startswith("```"):
            yield from _flush(paragraph)
            in_code = not in_code
            continue
        if in_code:
            if stripped:
                yield stripped
            continue
        starts_unit = not stripped or stripped.startswith(("#", "|", "* ", "- "))
        if starts_unit:
            yield from _flush(paragraph)
        if stripped.startswith("|") and not re.fullmatch(r"[|\s:-]+", stripped):
            yield stripped
        elif stripped and not stripped.startswith("#") and not stripped.startswith("|"):
            paragraph.append(stripped)


def _flush(paragraph: list[str]) -> Iterator[str]:
    if paragraph:
        yield " ".join(paragraph)
        paragraph.clear()


def corpus() -> str:
    pages = [
        path for path in git("ls-tree", "-r", "--name-only", MOVED_AT_COMMIT, "docs").split() if path.endswith(".md")
    ]
    paths = ["README.md", "CHANGELOG.md", *pages, *INCLUDED]
    return "\n".join(normalise(git("show", f"{MOVED_AT_COMMIT}:{path}")) for path in paths)


def lost(old: str, new: str) -> list[str]:
    return [unit for unit in units(old) if normalise(unit) not in new]


def test_every_paragraph_row_and_code_line_of_the_old_readme_is_still_somewhere() -> None:
    old = old_readme()
    assert len(list(units(old))) > 300  # the old README is read, not skipped
    missing = lost(old, corpus())
    assert missing == [], f"{len(missing)} pieces of the old README are nowhere now, e.g. {missing[:3]}"


def test_a_deleted_paragraph_is_caught() -> None:
    old = "# t\n\nOne paragraph\nover two lines.\n\n| a | b |\n| --- | --- |\n| x | [y](#y) |\n\n```sh\nls\n```\n"
    assert lost(old, normalise("| a | b | One paragraph over two lines. | x | y | ls")) == []
    assert lost(old, normalise("| a | b | One paragraph over two. | x | y | ls")) == ["One paragraph over two lines."]
