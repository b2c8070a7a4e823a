"""``mnesite compare``: a thin click command over ``spark.compare.compare``.

Theory of operation
-------------------
The command parses its arguments, runs the compare job with progress lines on stderr, and
prints the report as a readable table (or JSON with ``--json``) on stdout. Exit status: 0 the
replicas are equal (differences only in flight), 1 they diverged, 2 they could not be
compared; in that last case stderr gets one line starting with ``Error:`` (like every mnesite
command) and no traceback. ``--quiet`` silences the progress lines and the JVM's start-up lines.
The main CLI registers it with ``main.add_command(compare)``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import click
from mnesite.rlog.json_text import json_text
from mnesite.rlog.security import FOLLOW_KEY_LINKS_HELP
from mnesite.spark.compare import (
    CATEGORIES,
    EXIT_ERROR,
    SAMPLE_MAX_LIMIT,
    TIMEOUT_MS_LIMIT,
    CompareError,
    CompareOptions,
    CompareReport,
    json_default,
    report_json,
)
from mnesite.spark.compare import (
    compare as run_compare,
)
from mnesite.spark.replica import NODE_TIMEOUT_MS
from mnesite.spark.session import quiet_stderr

VALUE_WIDTH_MAX = 60  # characters of a row shown per cell in the readable output


def _render_value(value: Any) -> str:
    text = json_text(value, default=json_default, ensure_ascii=False)
    return text if len(text) <= VALUE_WIDTH_MAX else text[: VALUE_WIDTH_MAX - 3] + "..."


def render_report(report: CompareReport) -> str:
    """The readable form of a report (what ``mnesite compare`` prints without ``--json``)."""
    lines = ["replicas:"]
    for label, shards in report.applied.items():
        applied = ", ".join(f"{shard} at {position.applied}" for shard, position in shards.items()) or "no shards"
        lines.append(f"  {label}: {applied}")
    for span in report.in_flight_spans:
        state = "complete" if span.complete else f"incomplete: {span.reason}"
        lines.append(
            f"  shard {span.shard}: {span.ahead} is ahead, {span.entries} entries in flight "
            f"between {span.behind_key} and {span.ahead_key} ({state})"
        )
    for item in report.histories_diverged:
        lines.append(
            f"  shard {item['shard']}: {item['left']} and {item['right']} applied {tuple(item['applied'])} "
            f"with different digests: histories diverged"
        )
    for table, lacking in report.tables_missing.items():
        lines.append(f"table {table}: missing on {', '.join(lacking)}")
    for table, lacking in report.tables_in_flight.items():
        lines.append(f"table {table}: missing on {', '.join(lacking)}, created or dropped in flight (not compared)")
    for table, lacking_columns in report.columns_in_flight.items():
        for label, columns in lacking_columns.items():
            lines.append(
                f"table {table}: column(s) {', '.join(columns)} missing on {label}, added in flight (not compared)"
            )
    for table, behind in report.tables_recreated_in_flight.items():
        lines.append(
            f"table {table}: dropped and created again in flight with another declaration, the old one still "
            f"on {', '.join(behind)} (not compared)"
        )
    for table in report.tables_mismatched:
        lines.append(f"table {table}: declared differently on the replicas")
    header = f"{'table':<20} {'left':<20} {'right':<20} {'rows':>21} {'miss.left':>9} {'miss.right':>10} "
    header += f"{'different':>9} {'in_flight':>9}  status"
    if report.pairs:
        lines.append(header)
    for pair in report.pairs:
        rows = f"{report.rows[pair.table][pair.left]}/{report.rows[pair.table][pair.right]}"
        counts = pair.counts
        lines.append(
            f"{pair.table:<20} {pair.left:<20} {pair.right:<20} {rows:>21} {counts['missing_on_left']:>9} "
            f"{counts['missing_on_right']:>10} {counts['different']:>9} {counts['in_flight']:>9}  "
            f"{'DIVERGED' if pair.diverged else 'equal'}"
        )
    for pair in report.pairs:
        for category in (*CATEGORIES, "in_flight"):
            samples = pair.samples[category]
            if not samples:
                continue
            shown = f"{len(samples)} of {pair.counts[category]}"
            lines.append(f"{pair.table} {category} ({pair.left} vs {pair.right}, {shown}):")
            for sample in samples:
                lines.append(
                    f"  key {_render_value(sample['key'])}: left {_render_value(sample['left'])}"
                    f" | right {_render_value(sample['right'])}"
                )
    lines.append(f"result: {'DIVERGED' if report.diverged else 'equal'}")
    return "\n".join(lines)


def _file_option(flag: str, envvar: str, text: str) -> Any:
    """``--key`` / ``--server-key`` (the same flags and variables as every ``mnesite`` node command, as is
    ``--follow-key-links``)."""
    dest = flag.removeprefix("--").replace("-", "_") + "_file"
    return click.option(flag, dest, envvar=envvar, type=click.Path(dir_okay=False), help=f"{text} (${envvar}).")


@click.command("compare")
@click.argument("replicas", nargs=-1, required=True)
@click.option("--table", "tables", multiple=True, help="Table to compare (repeatable); default: all tables.")
@click.option("--master", default="local[*]", show_default=True, help="Spark master URL.")
@click.option(
    "--sample",
    "sample_max",
    default=10,
    show_default=True,
    type=click.IntRange(0, SAMPLE_MAX_LIMIT),
    help="Keys shown per kind of difference, per table and pair.",
)
@click.option(
    "--timeout-ms",
    default=NODE_TIMEOUT_MS,
    show_default=True,
    type=click.IntRange(1, TIMEOUT_MS_LIMIT),
    help="Timeout of each request to a tcp:// node.",
)
@_file_option("--key", "MNESITE_KEY", "Your secret key file for tcp:// nodes of a cluster with [security]")
@_file_option("--server-key", "MNESITE_SERVER_KEY", "The cluster's public key file for tcp:// nodes")
@click.option(
    "--follow-key-links", envvar="MNESITE_FOLLOW_KEY_LINKS", is_flag=True, default=False, help=FOLLOW_KEY_LINKS_HELP
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", is_flag=True, help="No progress lines and no JVM start-up lines on stderr.")
def compare(
    replicas: tuple[str, ...],
    tables: tuple[str, ...],
    master: str,
    sample_max: int,
    timeout_ms: int,
    key_file: str | None,
    server_key_file: str | None,
    follow_key_links: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Compare REPLICAS (data directories, mnesite.db or backup files, or tcp:// node endpoints) with Spark.

    Exit status: 0 equal, 1 diverged, 2 could not compare.
    """
    if len(replicas) < 2:
        click.echo("Error: compare needs at least two replicas", err=True)
        sys.exit(EXIT_ERROR)

    def progress(message: str) -> None:
        if not quiet:
            click.echo(f"compare: {message}", err=True)

    try:
        options = CompareOptions(
            tables=tables,
            master=master,
            sample_max=sample_max,
            timeout_ms=timeout_ms,
            key=key_file,
            server_key=server_key_file,
            follow_key_links=follow_key_links,
        )
        with quiet_stderr() if quiet else contextlib.nullcontext():
            report = run_compare(list(replicas), options, progress=progress)
    except CompareError as error:
        click.echo(f"Error: {error}", err=True)
        sys.exit(EXIT_ERROR)
    click.echo(report_json(report) if as_json else render_report(report))
    sys.exit(report.exit_status)


# Read by the mnesite group (cli.main.MnesiteGroup): a usage error or an unexpected failure of compare
# exits 2, "could not compare"; its 1 means "diverged".
compare.failure_exit_code = EXIT_ERROR  # type: ignore[attr-defined]
