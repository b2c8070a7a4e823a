"""Draw the benchmark charts of the docs site from the tables of docs/benchmarks/index.md.

The tables are the record (each names its date, machine and commit); the charts are drawn from
them at every docs build (mkdocs_hooks.py, or ``python benchmarks/charts.py``), so a chart cannot
disagree with its table. A table that is missing or changed its header fails loudly.

    .venv/bin/python benchmarks/charts.py [--page docs/benchmarks/index.md] [--out docs/benchmarks/charts]

``draw_peers_report`` draws one ``bench_peers.py`` run from its JSON report (``--output``).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks" / "index.md"
OUT = REPO / "docs" / "benchmarks" / "charts"


def table(text: str, header_start: list[str]) -> list[dict[str, str]]:
    """The rows of the first Markdown table whose header begins with ``header_start``, as dicts."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        cells = _cells(line)
        if cells[: len(header_start)] == header_start:
            rows = []
            for row_line in lines[index + 2 :]:
                if not row_line.startswith("|"):
                    break
                rows.append(dict(zip(cells, _cells(row_line), strict=True)))
            return rows
    raise ValueError(f"no table with the header {header_start} in the benchmarks page")


def _cells(line: str) -> list[str]:
    if not line.startswith("|"):
        return []
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def number(cell: str) -> float:
    match = re.match(r"[\d,.]+", cell.replace("**", ""))
    if match is None:
        raise ValueError(f"not a number: {cell!r}")
    return float(match.group(0).replace(",", ""))


def series(rows: list[dict[str, str]], name: str, x: str, y: str) -> dict[str, list[tuple[float, float]]]:
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        lines[row[name]].append((number(row[x]), number(row[y])))
    return lines


def draw(lines: dict[str, list[tuple[float, float]]], title: str, ylabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    for label, points in lines.items():
        xs, ys = zip(*sorted(points), strict=True)
        if len(xs) == 1:
            axes.axhline(ys[0], linestyle="--", linewidth=1, label=label, color="grey")
        else:
            axes.plot(xs, ys, marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_xticks([1, 16, 64], labels=["1", "16", "64"])
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)


def draw_peers_report(report: dict, path: Path) -> None:
    """The chart of one ``bench_peers`` report (its JSON): writes/s, p50/p99 latency and server CPU
    per write, each by client count and system, in three panels (``make bench-peers`` writes it
    beside the JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems: dict[str, list[dict]] = defaultdict(list)
    for row in report["results"]:
        systems[row["system"]].append(row)
    figure, (rate, latency, cpu) = plt.subplots(1, 3, figsize=(15, 4.5), dpi=100)
    for index, (name, rows) in enumerate(systems.items()):
        rows = sorted(rows, key=lambda row: row["clients"])
        clients = [row["clients"] for row in rows]
        color = f"C{index % 10}"
        rate.plot(clients, [row["writes_per_s"] for row in rows], marker="o", color=color, label=name)
        latency.plot(clients, [row["p50_ms"] for row in rows], marker="o", color=color, label=f"{name} p50")
        latency.plot(clients, [row["p99_ms"] for row in rows], marker="x", linestyle="--", color=color, label="p99")
        points = [(c, row["cpu_us_per_write_sum"]) for c, row in zip(clients, rows, strict=True)]
        points = [(c, value) for c, value in points if value is not None]
        if points:
            cpu.plot(*zip(*points, strict=True), marker="o", color=color, label=name)
    ticks = sorted({row["clients"] for row in report["results"]})
    for axes, ylabel in (
        (rate, "acknowledged writes/s (median of rounds)"),
        (latency, "latency ms (p50 solid, p99 dashed)"),
        (cpu, "server CPU us per write (all its processes)"),
    ):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, labels=[str(tick) for tick in ticks])
        axes.set_xlabel("concurrent clients")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    latency.set_yscale("log")
    cpu.set_yscale("log")
    figure.suptitle(
        f"bench_peers {report['date']}, {report['machine']}, {report['seconds']:g} s per point, "
        f"{report['rounds']} rounds",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--out", type=Path, default=OUT)
    options = parser.parse_args(argv)
    text = options.page.read_text()
    commit = table(text, ["run", "clients", "commits/s"])
    draw(
        series(commit, "run", "clients", "commits/s"),
        "One 100-byte row per transaction, synchronous=FULL (2026-11-21, 2 CPUs, quiet machine)",
        "commits/s",
        options.out / "commit.png",
    )
    peers = table(text, ["system", "clients", "writes/s (median of 3)"])
    draw(
        series(peers, "system", "clients", "writes/s (median of 3)"),
        "Acknowledged writes against peer systems (2026-11-23, 2 CPUs, quiet machine)",
        "writes/s (median of 3 rounds)",
        options.out / "peers.png",
    )


if __name__ == "__main__":
    main()
