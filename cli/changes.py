"""``mnesite changes``: a thin command over ``Client.changes`` (rlog.changes builds the pages at the node).

One line per record as it arrives: ``--json`` prints JSON lines (one record each, BLOBs as
``{"base64": ...}``); otherwise ``TX_KEY SHARD TABLE OP KEY ROW``. The command ends once it has every
change the node applied, or with ``--follow`` keeps waiting for more (Ctrl-C ends it, exit 0); the last
line of a run that ends, also by Ctrl-C, names the position to resume from with ``--from`` (on stderr, in
both output modes); one that ends with an error names it on the line before the error. A shard the
run stopped inside a copy of has no such position: the line says so (drop its tables, start it again).
"""

from __future__ import annotations

from typing import Any

import click
from mnesite.cli.main import (
    EXIT_OUTCOME_UNKNOWN,
    client_for,
    display_text,
    fail,
    json_option,
    json_text,
    node_options,
    parse_tx_key,
    run,
)
from mnesite.rlog.client import CHANGES_WAIT_MS, MnesiteError, OutcomeUnknown


def parse_from(values: tuple[str, ...]) -> Any:
    """``--from G,C`` (every shard of the tables) or ``--from SHARD:G,C`` (repeat per shard)."""
    if not values:
        return None
    if len(values) == 1 and ":" not in values[0]:
        return parse_tx_key(values[0])
    positions = {}
    for value in values:
        shard, separator, key = value.partition(":")
        if not separator or not shard:
            raise click.BadParameter(f"{value!r}: with several --from, each is SHARD:G,C")
        positions[shard] = parse_tx_key(key)
    return positions


def describe(record: dict[str, Any]) -> str:
    """One record as one line: its key and row as JSON (which escapes every control character), its
    names through ``display_text``, as a text table shows them."""
    kind = record["kind"]
    tx_key = record.get("tx_key")
    key_text = f"({tx_key[0]}, {tx_key[1]})" if tx_key is not None else "-"
    shard = display_text(str(record["shard"]))
    if kind == "snapshot_begin":
        tables = display_text(" ".join(record["tables"]))
        return f"{key_text} {shard} snapshot_begin {tables}: {display_text(str(record['reason']))}"
    if kind == "snapshot_end":
        return f"{key_text} {shard} snapshot_end"
    row = record.get("row") if record.get("row") is not None else record.get("definition")
    row_text = json_text(row) if row is not None else ""
    op = display_text(record["op"] if kind == "change" else f"snapshot:{record['op']}")
    key = json_text(record.get("key"))
    return f"{key_text} {shard} {display_text(str(record['table']))} {op} {key} {row_text}".rstrip()


@click.command("changes")
@click.argument("tables", nargs=-1, metavar="[TABLE]...")
@click.option(
    "--from",
    "from_keys",
    multiple=True,
    metavar="G,C",
    help="Start strictly after this tx key (SHARD:G,C per shard, repeatable). Default: the log's start.",
)
@click.option("--follow", is_flag=True, help="Keep waiting for new changes instead of ending when caught up.")
@node_options
@json_option
def changes(tables, from_keys, follow, endpoint, timeout_ms, as_json) -> None:
    """Print every committed change of TABLEs (none: every table) in log order, from a core or replicant.

    Each record has its tx key, shard, table, op (write, delete, create_table, drop_table, add_column),
    key and the full row written. A position the node's log no longer holds (trimmed) first gets a copy
    of the tables at one tx key: snapshot_begin, snapshot rows, snapshot_end, then the changes after it.
    Give several --node to move to the next node from the last position if one stops answering, or,
    without --follow, cannot move a copy for 10 pages (no such shard, or behind it and not moving); once
    every node could not, the run ends with changes_stalled.
    """
    after = parse_from(from_keys)
    with client_for(endpoint, timeout_ms, retries=1) as client:
        feed = run(lambda: client.changes(list(tables), after, follow=follow, wait_ms=CHANGES_WAIT_MS))
        ended = "caught up"
        try:
            for record in iter(feed):
                if as_json:
                    click.echo(json_text(record))
                else:
                    click.echo(describe(record))
        except KeyboardInterrupt:
            # Ctrl-C is how --follow ends (like rlog tail --follow): a clean exit that still says where
            # to resume, which is what a follower needs most.
            ended = "stopped"
        except MnesiteError as error:
            # The node stopped answering (or refused): where to resume is what the caller needs next,
            # and a feed of some tables cannot rebuild it from the records it printed.
            if feed.position or _copying(feed):
                click.echo(_resume_line("stopped", feed), err=True)
            fail(str(error), EXIT_OUTCOME_UNKNOWN if isinstance(error, OutcomeUnknown) else 1)
        click.echo(_resume_line(ended, feed), err=True)


def _copying(feed: Any) -> list[str]:
    """The shards the feed stopped inside a copy of (after a snapshot_begin, before its snapshot_end)."""
    return [position["shard"] for position in feed.cursor if position.get("phase", "live") != "live"]


def _resume_line(ended: str, feed: Any) -> str:
    # One --from per shard: the line is given back as printed, and a second SHARD:G,C after one --from
    # would be taken for a TABLE.
    positions = " ".join(f"--from {shard}:{key[0]},{key[1]}" for shard, key in sorted(feed.position.items()))
    line = f"{ended}; resume with {positions}" if positions else ended
    copying = _copying(feed)
    if copying:
        # A copy's progress is no tx key (--from cannot give it back), and the key before the copy is
        # no place to resume: the snapshot_begin printed said to drop the tables, and a node that
        # still holds that key would answer it with changes on top of them. Said, not left out silently.
        line += (
            f"; shard {', '.join(copying)} stopped inside a copy (a snapshot_begin without its snapshot_end): "
            "drop what you hold of its tables; given no --from, it starts again from the log's start"
        )
    return line


def register(main: click.Group) -> None:
    main.add_command(changes)
