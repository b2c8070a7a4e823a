"""``mnesite query``: a thin command over ``Client.query`` (rlog.query runs the statement at the node).

Rows are printed page by page as they arrive: the command holds one page at a time, however many
rows the statement returns. ``--json`` prints one object ``{"columns", "positions", "rows"}``,
written row by row (rows are arrays, in column order, since a statement may repeat a column name).
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

import click
from mnesite.cli.main import (
    AFTER,
    CONSISTENCY,
    client_for,
    format_table,
    json_option,
    json_text,
    node_options,
    run,
    run_iterator,
)
from mnesite.rlog.client import QUERY_TIMEOUT_MS, read_wait_ms

PAGE_ROWS_MAX = 1_000_000  # the node refuses more than its query_page_rows_max (1,000 by default)


def _not_json(word: str) -> NoReturn:
    raise ValueError(f"{word} is not JSON")


def parse_param(text: str) -> Any:
    """A parameter as JSON when it is JSON (``10``, ``2.5``, ``null``, ``"10"``), else the text itself.

    Python's json also reads ``NaN``, ``Infinity`` and ``-Infinity``, which are not JSON: they are text."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError:  # json.JSONDecodeError, or a word of Python's json that JSON lacks
        return text
    if isinstance(value, (list, dict)):
        raise click.BadParameter(f"{text!r}: a parameter is one value (number, string or null)")
    return value


@click.command("query")
@click.argument("sql", metavar="SQL")
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="VALUE",
    help="Bind the next ? of SQL (repeat in order). JSON if it parses (10, 2.5, null, '\"10\"'), else text.",
)
@click.option(
    "--page-rows",
    type=click.IntRange(1, PAGE_ROWS_MAX),
    default=None,
    # Not a fixed number: a node refuses more than its query_page_rows_max, which its operator may lower.
    help="Rows per page fetched from the node (at most, and by default, its query_page_rows_max: 1000 unless set).",
)
@CONSISTENCY
@AFTER
@node_options
@json_option
def query(sql, params, page_rows, consistency, after_tx_key, endpoint, timeout_ms, as_json) -> None:
    """Run one read-only SQL statement (SELECT or WITH) over the user's tables at a core or replicant.

    SQLite itself refuses anything that is not read-only (writes, DDL, ATTACH, PRAGMA, load_extension)
    and any table that is not in the catalog, before anything runs. The node stops a statement that
    spends its query_ms_max of SQLite time. Each page waits up to 30 s or --timeout-ms, the longer;
    the wait for an --after or read-your-writes key follows --timeout-ms (then: timeout).
    """
    values = [parse_param(text) for text in params]
    with client_for(endpoint, timeout_ms, retries=0) as client:
        result = run(
            lambda: client.query(
                sql,
                values,
                consistency,
                after_tx_key,
                page_rows=page_rows,
                # A page may run longer than --timeout-ms (a statement's own work), but the wait for
                # an --after or read-your-writes key follows --timeout-ms, as for get and scan: a key
                # never reached answers timeout then, not after the node's 10 s cap on the wait.
                timeout_ms=max(timeout_ms, QUERY_TIMEOUT_MS),
                wait_ms=read_wait_ms(timeout_ms),
            )
        )
        with result:
            pages = run_iterator(iter(result.fetch_page, None))
            if as_json:
                positions = {shard: list(key) for shard, key in result.positions.items()}
                head = json.dumps({"columns": result.columns, "positions": positions})
                click.echo(head[:-1] + ', "rows": [', nl=False)
                separator = ""
                for page in pages:
                    # One write per page: a million rows cost a thousand writes, not a million.
                    if page:
                        text = ",\n".join(json_text(list(row)) for row in page)
                        click.echo(separator + text, nl=False)
                        separator = ",\n"
                click.echo("]}")
                return
            names = display_names(result.columns)
            header = True
            for page in pages:
                if not page:
                    # A result of whole pages ends with an empty one (the node finds no next row only
                    # when asked): nothing to print, and its text has no line under its header.
                    continue
                # Widths per page, like scan: a streamed table cannot know the widest cell of later pages.
                text = format_table([dict(zip(names, row, strict=True)) for row in page], names)
                click.echo(text if header else text.split("\n", 1)[1])
                header = False
            if header:
                click.echo(format_table([], names))


def display_names(columns: list[str]) -> list[str]:
    """Column names made unique for a table (``SELECT a.id, b.id`` shows ``id`` and ``id:2``)."""
    names: list[str] = []
    for column in columns:
        name, number = column, 1
        while name in names:
            number += 1
            name = f"{column}:{number}"
        names.append(name)
    return names


def register(main: click.Group) -> None:
    main.add_command(query)
