"""The site's home page (docs/index.md) and README say the same about what runs and when to pick mnesite,
and the throughput they quote is the one README's Figures measured: both went stale before (the home page
still said "not SQL" after read-only queries landed, and both quoted 1,400-2,000 writes/s long after the
figures said over 4,000)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")


def section(text: str, begin: str, end: str) -> str:
    """The text from ``begin`` up to ``end``, links reduced to their words, whitespace collapsed."""
    body = text[text.index(begin) : text.index(end, text.index(begin))]
    return " ".join(LINK.sub(r"\1", body).split())


def summaries(path: Path) -> tuple[str, str]:
    text = path.read_text()
    return (
        section(text, "What runs today:", "## When to pick it"),
        section(text, "## When to pick it", "\n## "),
    )


def test_home_page_and_readme_say_the_same() -> None:
    readme, home = summaries(ROOT / "README.md"), summaries(ROOT / "docs" / "index.md")
    assert home[0] == readme[0]
    assert home[1] == readme[1]


def quoted_rate(text: str) -> int:
    found = re.search(r"about ([\d,]+) writes/s on 3 cores of a 2-CPU machine at 64 clients", text)
    assert found is not None, "the throughput quote is gone or reworded: keep this test in step"
    return int(found.group(1).replace(",", ""))


def test_quoted_throughput_is_the_measured_one() -> None:
    readme = (ROOT / "README.md").read_text()
    measured = re.search(r"\* 3 cores at 64 clients: ([\d,]+) writes/s", readme)
    assert measured is not None, "README's Figures no longer state the 64-client rate: keep this test in step"
    rate = int(measured.group(1).replace(",", ""))
    for text in (readme, (ROOT / "docs" / "index.md").read_text()):
        assert abs(quoted_rate(text) - rate) <= 0.1 * rate, (quoted_rate(text), rate)
