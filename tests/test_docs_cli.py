"""The command-line reference (docs/reference/cli.md) names every command and every option.

The page is rendered here as mkdocs renders it (Python-Markdown with the mkdocs-click directive the
page holds), and the click tree of ``mnesite.cli.main:main`` is walked: each command must have its
own section, and each of its options and arguments must appear in that section. A page that lists
commands by hand (or a directive restricted to some commands) fails as soon as a command is added
without being documented. The hand-kept table of commands at the top of the page must name only
commands that exist. And every ``mnesite ...`` line of README and the pages (code blocks and inline
code) names commands and options that exist.
"""

from __future__ import annotations

import html
import re
import shlex
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


# A shell word that ends the command (a pipe, a redirection, a background or a comment).
SHELL_END = re.compile(r"^(?:\||&|&&|\|\||;|[0-9]?>.*|<.*|\$\(.*)$")
NEGATIVE = re.compile(r"-\d+")  # a negative key (``mnesite get items -5``), not an option


def command_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line, command)`` of every ``mnesite ...`` in a page: lines of its code blocks and inline code
    spans (a usage line's ``[--x]``, ``A|B`` and ``...`` reduced to the words they hold)."""
    for block in re.finditer(r"```(?:sh|bash|console|shell)?\n(.*?)```", text, re.DOTALL):
        first = text.count("\n", 0, block.start()) + 2
        for offset, line in enumerate(block.group(1).splitlines()):
            line = line.strip().removeprefix("$ ")
            if line.startswith("mnesite "):
                yield first + offset, line.replace("\\", "")
    for span in re.finditer(r"`(mnesite [^`]+)`", text):
        usage = re.sub(r"\[([^\]]*)\]", r"\1", span.group(1)).replace("\\|", " ").replace("|", " ").replace("...", " ")
        yield text.count("\n", 0, span.start()) + 1, usage


def misnamed(line: str) -> str | None:
    """What ``line`` names that the click tree lacks: a command, or an option of its command."""
    try:
        words = shlex.split(line, comments=True)[1:]
    except ValueError:  # an unbalanced quote in prose: not a command line
        return None
    words = words[: next((i for i, word in enumerate(words) if SHELL_END.match(word)), len(words))]
    command: click.Command = main
    path = ["mnesite"]
    while isinstance(command, click.Group) and words and words[0] in command.commands:
        command = command.commands[words[0]]
        path.append(words.pop(0))
    if isinstance(command, click.Group) and words and not words[0].startswith("-") and words[0] != "COMMAND":
        return f"{' '.join(path)} has no command {words[0]!r}"
    options = {name for p in command.params if isinstance(p, click.Option) for name in (*p.opts, *p.secondary_opts)}
    for word in words:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if name.startswith("-") and name != "-" and not NEGATIVE.fullmatch(name) and name not in options | {"--help"}:
            return f"{' '.join(path)} has no option {name}"
    return None


def test_every_command_line_of_the_docs_names_commands_and_options_that_exist() -> None:
    """A command the pages show (``mnesite force-start`` for ``mnesite journal force-start``, an option
    renamed) fails when a reader runs it; the slow tests run README's and the tutorial's blocks only."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [(page, number, line) for page in pages for number, line in command_lines(page.read_text())]
    assert len(found) >= 150, len(found)  # the pages are read, not skipped
    wrong = [
        f"{page.relative_to(REPO)}:{number}: {why}: {line}"
        for page, number, line in found
        if (why := misnamed(line)) is not None
    ]
    assert wrong == []


def test_a_command_or_option_that_does_not_exist_is_caught() -> None:
    assert misnamed("mnesite journal force-start --yes --node tcp://10.0.0.1:7400") is None
    assert misnamed("mnesite get items -5 --json | jq .") is None
    assert misnamed("mnesite force-start --yes") == "mnesite has no command 'force-start'"
    assert misnamed("mnesite scan users --page-size 10") == "mnesite scan has no option --page-size"
