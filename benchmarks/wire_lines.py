"""Raw line counts of the wire layer (issue 20: at most half of the about 1,300 lines it had when filed).

    .venv/bin/python benchmarks/wire_lines.py [--json]

The wire layer is ``rlog/messages.py`` (frames and the message schema), ``core/consensus_wire.py`` and
the op codec of ``rlog/types.py``: the lines between each ``# --- op codec ---`` marker and the next
``# --- end op codec ---`` (the wire's bounds and name rule, the ops' packed form, packing and unpacking
of ops and entries), without the blank lines next to the markers. Lines as ``wc -l`` counts them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHOLE_FILES = ("rlog/messages.py", "core/consensus_wire.py")
OP_CODEC_FILE, BEGIN, END = "rlog/types.py", "# --- op codec ---", "# --- end op codec ---"
WIRE_LINES_TARGET = 650  # issue 20: at most half of the about 1,300 lines of when it was filed
WIRE_LINES_MAX = 650  # issue 20's target, held by tests/test_wire_lines.py: lower it as the layer shrinks


def marked_lines(lines: list[str]) -> int:
    """The lines inside the ``BEGIN``/``END`` marker pairs, less the blank lines next to a marker."""
    total, region = 0, None
    for line in lines:
        if line.strip() == BEGIN and region is None:
            region = []
        elif line.strip() == END and region is not None:
            total += len("\n".join(region).strip("\n").splitlines())
            region = None
        elif region is not None:
            region.append(line)
    if region is not None:
        raise ValueError(f"{OP_CODEC_FILE}: {BEGIN!r} without {END!r}")
    return total


def wire_lines(repo: Path = REPO) -> dict[str, int]:
    """Per part of the wire layer, its raw line count, and ``total``."""
    counts = {name: len((repo / name).read_text().splitlines()) for name in WHOLE_FILES}
    counts[f"{OP_CODEC_FILE} (op codec)"] = marked_lines((repo / OP_CODEC_FILE).read_text().splitlines())
    counts["total"] = sum(counts.values())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    counts = wire_lines()
    if parser.parse_args().json:
        print(json.dumps(counts))
        return
    for name, count in counts.items():
        print(f"{count:6d}  {name}")
    print(f"target {WIRE_LINES_TARGET} (issue 20), ceiling {WIRE_LINES_MAX} (tests/test_wire_lines.py)")


if __name__ == "__main__":
    main()
