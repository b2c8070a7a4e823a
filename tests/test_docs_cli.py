"""The command-line reference (docs/reference/cli.md) names every command and every option.

The page is rendered here as mkdocs renders it (Python-Markdown with the mkdocs-click directive the
page holds), and the click tree of ``mnesite.cli.main:main`` is walked: each command must have its
own section, and each of its options and arguments must appear in that section. A page that lists
commands by hand (or a directive restricted to some commands) fails as soon as a command is added
without being documented. The hand-kept table of commands at the top of the page must name only
commands that exist.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator

import click
import pytest
from mnesite.cli.main import main

from tests.conftest import REPO

PAGE = REPO / "docs" / "reference" / "cli.md"
GENERATED_FROM = "Commands and options"  # the heading under which the generated reference starts
HEADING = re.compile(r"<h([1-6])[^>]*>(.*?)</h\1>", re.DOTALL)


def rendered_page() -> str:
    markdown = pytest.importorskip("markdown", reason="the docs tools: pip install -e '.[docs]' (make docs)")
    pytest.importorskip("mkdocs_click", reason="the docs tools: pip install -e '.[docs]' (make docs)")
    return markdown.markdown(PAGE.read_text(), extensions=["mkdocs-click", "tables", "attr_list", "toc"])


def sections(page_html: str) -> dict[str, str]:
    """Command path ("mnesite table create") -> the HTML of its section, from the generated part."""
    headings = list(HEADING.finditer(page_html))
    start = next((i for i, h in enumerate(headings) if _text(h.group(2)) == GENERATED_FROM), None)
    assert start is not None, f"{PAGE.name} has no '{GENERATED_FROM}' heading"
    base_level = int(headings[start].group(1))
    found: dict[str, str] = {}
    path: list[tuple[int, str]] = []
    for index in range(start + 1, len(headings)):
        heading = headings[index]
        level = int(heading.group(1))
        if level <= base_level:
            break
        path = [(lvl, name) for lvl, name in path if lvl < level] + [(level, _text(heading.group(2)))]
        end = headings[index + 1].start() if index + 1 < len(headings) else len(page_html)
        found[" ".join(name for _, name in path)] = html.unescape(page_html[heading.end() : end])
    return found


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()


def commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from commands(sub, f"{path} {name}")


def undocumented(root: click.Command, page_html: str) -> list[str]:
    """Every command path and "path option" of ``root`` that the rendered page does not document."""
    documented = sections(page_html)
    missing = []
    for path, command in commands(root, "mnesite"):
        section = documented.get(path)
        if section is None:
            missing.append(path)
            continue
        for parameter in command.params:
            if getattr(parameter, "hidden", False):
                continue
            if isinstance(parameter, click.Argument):
                names = [parameter.make_metavar(click.Context(command))]
            else:
                names = [*parameter.opts, *parameter.secondary_opts]
            missing += [
                f"{path} {name}" for name in names if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", section)
            ]
    return missing


def test_every_command_and_option_is_in_the_reference() -> None:
    assert undocumented(main, rendered_page()) == []


def test_a_command_or_option_added_without_docs_is_caught() -> None:
    """The check itself: a command and an option the page was not rendered with are reported."""
    page_html = rendered_page()
    put = main.commands["put"]
    widened_put = click.Command("put", params=[*put.params, click.Option(["--wibble"])], callback=put.callback)
    extended = click.Group(
        "mnesite",
        commands={**main.commands, "put": widened_put, "frobnicate": click.Command("frobnicate", params=[])},
    )
    assert undocumented(extended, page_html) == ["mnesite frobnicate", "mnesite put --wibble"]


def test_the_command_table_names_only_commands_that_exist() -> None:
    paths = {path for path, _ in commands(main, "mnesite")}
    table_rows = re.findall(r"^\| `(mnesite [a-z -]+?)(?: [A-Z\[-].*?)?` \|", PAGE.read_text(), re.MULTILINE)
    assert len(table_rows) >= 20
    named = {" ".join(row.split()) for row in table_rows}
    assert named - paths == set()
