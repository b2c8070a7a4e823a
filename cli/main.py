"""The ``mnesite`` command: thin click commands over the client and the node driver."""

from __future__ import annotations

import base64
import binascii
import gc
import itertools
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import click
from mnesite.core.membership import (
    CHANGE_STALL_MS,
    SEQUENCER_POLL_MS,
    SEQUENCER_REASKS_MAX,
    SEQUENCER_WAIT_MS,
    UNREACHABLE_CODE,
    AfterSilence,
    after_change_failure,
    after_silence,
    change_wait,
)
from mnesite.rlog.client import (
    MIN_KEYS_MAX,
    SCAN_PAGE_ROWS,
    AfterKey,
    Client,
    GuardFailed,
    MnesiteError,
    OutcomeUnknown,
    Unavailable,
    default_endpoint,
    default_index_name,
    parse_endpoints,
)
from mnesite.rlog.config import NODE_NAME_PATTERN as NAME_PATTERN
from mnesite.rlog.config import ConfigError, load_config
from mnesite.rlog.json_text import json_text as rlog_json_text
from mnesite.rlog.messages import FRAME_BYTES_MAX_DEFAULT
from mnesite.rlog.process_signals import ProcessSignals
from mnesite.rlog.security import FOLLOW_KEY_LINKS_HELP
from mnesite.rlog.types import TxKey

from mnesite import __version__

TIMEOUT_MS_DEFAULT = 5000
FOLLOW_INTERVAL_MS = 500
FOLLOW_BATCH_MAX = 1000  # entries per rlog_entries request (the node's maximum)
SCAN_PAGE_ROWS_MAX = 10_000  # the node's default scan_rows_max: a larger page is refused
IMPORT_BATCH_ROWS = 500
# Rows per import transaction; the node refuses more than its transaction_ops_max (1,000 by default).
IMPORT_BATCH_ROWS_MAX = 10_000
# The longest transaction FILE ``tx`` reads: a transaction's JSON is longer than its request's frame
# (at most frame_bytes_max, 4 MiB by default), but not four times; a longer file is refused unsent.
TX_CHARS_MAX = 4 * FRAME_BYTES_MAX_DEFAULT
# Exit status of a write whose outcome is unknown (it may or may not have happened), distinct from 1.
EXIT_OUTCOME_UNKNOWN = 3
# Exit status of a node that stopped because its disk failed a write or an fsync (rlog.disk).
EXIT_STORAGE_FAILED = 4
# Exit status of `cluster add-core`/`remove-core` interrupted (Ctrl-C) at its final `members` read,
# every shard changed: distinct from 1 (nothing or part changed) and 3 (a change's outcome unknown).
EXIT_CHANGED_MEMBERS_UNREAD = 5


def fail(message: str, exit_code: int = 1) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    sys.exit(exit_code)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def base64_blob(value: Any) -> bytes | None:
    """The bytes of a BLOB given as JSON output writes one, ``{"base64": ...}`` (JSON has no bytes);
    None for any other value. Raises ``ValueError`` if the text is not base64."""
    if isinstance(value, dict) and set(value) == {"base64"} and isinstance(value["base64"], str):
        try:
            return base64.b64decode(value["base64"], validate=True)
        except binascii.Error:
            raise ValueError("is not valid base64") from None
    return None


def with_blob(value: Any, where: str) -> Any:
    """``value``, or its bytes if it is a BLOB as ``{"base64": ...}``; an invalid one fails, naming ``where``."""
    try:
        blob = base64_blob(value)
    except ValueError as error:
        fail(f"{where}: {error}")
    return value if blob is None else blob


def row_with_blobs(row: Any, where: str) -> Any:
    """A row (a JSON object) with its ``{"base64": ...}`` values as bytes; anything else unchanged (the
    client's schema check refuses it with its own words)."""
    if not isinstance(row, dict):
        return row
    return {name: with_blob(value, f"{where}: column {name!r}") for name, value in row.items()}


def json_text(value: Any) -> str:
    """``value`` as JSON text, BLOBs as ``{"base64": ...}``: what every ``--json`` output and JSON lines
    export writes; an infinity as ``9.0e+999``, which JSON parsers read back (``rlog.json_text``)."""
    return rlog_json_text(value, default=_json_default)


def emit_json(value: Any) -> None:
    click.echo(json_text(value))


def _remember(context: click.Context, parameter: click.Parameter, value: Any) -> Any:
    # --key, --server-key and --follow-key-links are read by client_for, so that every command takes them unchanged.
    context.meta[f"mnesite.{parameter.name}"] = value
    return value


def node_options(function: Callable[..., Any]) -> Callable[..., Any]:
    function = click.option(
        "--follow-key-links",
        "follow_key_links",
        envvar="MNESITE_FOLLOW_KEY_LINKS",
        is_flag=True,
        default=False,
        expose_value=False,
        callback=_remember,
        help=FOLLOW_KEY_LINKS_HELP,
    )(function)
    function = click.option(
        "--server-key",
        "server_key_file",
        envvar="MNESITE_SERVER_KEY",
        type=click.Path(dir_okay=False),
        default=None,
        expose_value=False,
        callback=_remember,
        help="The cluster's public key file (NAME.key) for CurveZMQ ($MNESITE_SERVER_KEY).",
    )(function)
    function = click.option(
        "--key",
        "key_file",
        envvar="MNESITE_KEY",
        type=click.Path(dir_okay=False),
        default=None,
        expose_value=False,
        callback=_remember,
        help="Your secret key file (NAME.key_secret) for CurveZMQ ($MNESITE_KEY).",
    )(function)
    function = click.option(
        "--timeout-ms",
        type=click.IntRange(1, 3_600_000),
        default=TIMEOUT_MS_DEFAULT,
        show_default=True,
        help="How long to wait for each answer from the node.",
    )(function)
    function = click.option(
        "--node",
        "endpoint",
        multiple=True,
        metavar="ENDPOINT",
        help="Node to talk to (default: $MNESITE_NODE, then tcp://127.0.0.1:7400). Repeat it or separate "
        "endpoints by commas to fail over between nodes (never for a write whose outcome is unknown).",
    )(function)
    return function


def json_option(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(function)


def client_for(endpoint: str | tuple[str, ...] | None, timeout_ms: int, retries: int = 1) -> Client:
    """A client for this command's --node (one or several endpoints), with its --key, --server-key and
    --follow-key-links."""
    meta = click.get_current_context().meta
    try:
        return Client(
            endpoint or default_endpoint(),
            timeout_ms=timeout_ms,
            retries=retries,
            key=meta.get("mnesite.key_file"),
            server_key=meta.get("mnesite.server_key_file"),
            follow_key_links=bool(meta.get("mnesite.follow_key_links")),
        )
    except MnesiteError as error:
        fail(str(error))


def single_endpoint(endpoint: tuple[str, ...], command: str) -> str:
    """The one --node an operator command acts on (it must never fail over to another node)."""
    try:
        endpoints = parse_endpoints(list(endpoint)) if endpoint else []
    except MnesiteError as error:
        fail(str(error))
    if len(endpoints) != 1:
        fail(f"{command} needs exactly one explicit --node ENDPOINT")
    return endpoints[0]


def node_endpoints(endpoint: tuple[str, ...]) -> list[str]:
    """This command's --node endpoints, or the default one(s)."""
    try:
        return parse_endpoints(list(endpoint) if endpoint else None)
    except MnesiteError as error:
        fail(str(error))


def one_node(endpoint: tuple[str, ...], command: str) -> str:
    """The one node a command reports on (its own state: another node's answer would be taken for
    it, so it never fails over); unlike ``single_endpoint``, the default endpoint will do."""
    endpoints = node_endpoints(endpoint)
    if len(endpoints) != 1:
        fail(f"{command} shows one node's own state: give exactly one --node ENDPOINT, not {len(endpoints)}")
    return endpoints[0]


def run(call: Callable[[], Any]) -> Any:
    """Run a client call; any mnesite error becomes one line on stderr and exit 1."""
    try:
        return call()
    except OutcomeUnknown as error:
        fail(str(error), EXIT_OUTCOME_UNKNOWN)
    except MnesiteError as error:
        fail(str(error))


# A tx key as typed: two runs of ASCII digits and a comma, spaces around it (``(G, C)`` as ``put`` and
# ``tx`` print it, ``[G, C]`` as ``--json`` does). Python's int() also read "1_000", "+5", other
# scripts' digits and spaces inside a part: a mistyped key waited for another position.
TX_KEY = re.compile(r"([0-9]+) *, *([0-9]+)")
TX_KEY_PART_MAX = 2**63 - 1  # SQLite's (and the wire's) 64-bit signed integer


def parse_tx_key(text: str) -> TxKey:
    """``G,C`` (or ``(G, C)`` as ``put`` and ``tx`` print it, ``[G, C]`` as ``--json`` does) as a tx key:
    each part ASCII digits (no sign, ``_``, ``+`` or other scripts' digits)."""
    inner = text.strip(" ")
    if inner[:1] + inner[-1:] in ("()", "[]"):
        inner = inner[1:-1].strip(" ")
    match = TX_KEY.fullmatch(inner)
    if match is None:
        raise click.BadParameter(
            f"{text[:40]!r} is not a tx key GENERATION,COUNTER: two ASCII digit runs (for example 3,17)"
        )
    if any(len(part) > 19 or int(part) > TX_KEY_PART_MAX for part in match.groups()):
        raise click.BadParameter(f"{text[:40]!r}: a tx key part is at most {TX_KEY_PART_MAX}")
    return TxKey(int(match.group(1)), int(match.group(2)))


def parse_after(values: tuple[str, ...]) -> TxKey | dict[str, TxKey] | None:
    """``--after`` given ``values`` times: none (None), one ``G,C`` (that key, waited for in every shard
    read), or ``SHARD=G,C`` once per shard (each key waited for in its own shard only: a tx key orders
    one shard's log, so a key of another shard's write is no position in the shard read)."""
    if not values:
        return None
    qualified = ["=" in value for value in values]
    if not any(qualified):
        if len(values) > 1:
            raise click.BadParameter("give one G,C (for every shard read), or SHARD=G,C once per shard")
        return parse_tx_key(values[0])
    if not all(qualified):
        raise click.BadParameter("give either one G,C or SHARD=G,C per shard, not both")
    keys: dict[str, TxKey] = {}
    for value in values:
        shard, _, key = value.partition("=")
        shard = shard.strip()
        if not shard:
            raise click.BadParameter(f"{value!r}: no shard before '=' (SHARD=G,C)")
        if shard in keys:
            raise click.BadParameter(f"shard {shard!r} is given twice")
        keys[shard] = parse_tx_key(key)
    if len(keys) > MIN_KEYS_MAX:  # the wire's bound: said here, not by the node as a refused frame
        raise click.BadParameter(f"at most {MIN_KEYS_MAX} shards")
    return keys


def read_option(context: click.Context, parameter: click.Parameter, value: Any) -> Any:
    """``--consistency`` and ``--after``: once both are known (click processes one, then the other), a
    read-your-writes without ``--after`` is said to read as local: a command has no earlier write of its
    own to wait for (a ``Client`` waits for its own last write, which the command's client has none of)."""
    if parameter.name == "after_tx_key":
        value = parse_after(value or ())
    given = {**context.params, parameter.name: value}
    if given.get("consistency") == "read-your-writes" and "after_tx_key" in given and given["after_tx_key"] is None:
        click.echo(
            "Warning: --consistency read-your-writes without --after reads as local does (this command "
            "wrote nothing before it); give --after G,C, the tx key put or tx printed",
            err=True,
        )
    return value


AFTER = click.option(
    "--after",
    "after_tx_key",
    metavar="[SHARD=]G,C",
    multiple=True,
    callback=read_option,
    help="Read your writes: answer only once the node has applied this tx key (as put/tx print it): "
    "G,C in every shard read, or SHARD=G,C (repeat per shard; put/tx --json name the shard) in that shard only.",
)


def written(client: Any, tx_key: TxKey, **extra: Any) -> dict[str, Any]:
    """A write's ``--json`` answer: its tx key and, when the node named it, its shard (for ``--after``)."""
    answer: dict[str, Any] = {**extra, "tx_key": list(tx_key)}
    if client.last_shard is not None:
        answer["shard"] = client.last_shard
    return answer


def parse_json_argument(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        fail(f"{what} is not valid JSON: {error}")


# An INTEGER key as typed: ASCII digits, a leading minus for a negative one; nothing else. Python's
# int() also reads "1_000", " 12 ", "+5" and other scripts' digits ("٣"): a key typed wrong read or
# wrote another row. ``[0-9]``, not ``\d``, which matches every script's digits.
INTEGER_KEY = re.compile(r"-?[0-9]+")


def parse_key(client: Client, table: str, text: str) -> Any:
    """Turn a KEY argument into the table's key type: an INTEGER key is ASCII digits with an optional
    leading ``-`` (nothing else: no ``+``, ``_``, spaces or other scripts' digits), a BLOB key is hex,
    a TEXT key is the argument as given."""
    schema = run(lambda: client.table(table))
    key_type = dict((name, kind) for name, kind in schema["columns"])[schema["key"]]
    if key_type == "INTEGER":
        if INTEGER_KEY.fullmatch(text) is None:
            fail(
                f"{table}.{schema['key']} is INTEGER; {text!r} is not an integer "
                "(give ASCII digits, with a leading - for a negative key)"
            )
        try:
            return int(text)
        except ValueError:  # more digits than Python converts (4,300): far outside SQLite's 64 bits anyway
            fail(f"{table}.{schema['key']} is INTEGER; a key of {len(text)} digits is outside SQLite's 64-bit range")
    if key_type == "BLOB":
        try:
            return bytes.fromhex(text)
        except ValueError:
            fail(f"{table}.{schema['key']} is BLOB; give the key as hex")
    return text


# Characters a text table shows escaped: control characters (C0, DEL, C1: newlines, tabs, carriage
# returns, NUL, ESC and the 8-bit CSI that start terminal sequences), the line and paragraph
# separators, the bidirectional controls that reorder what a terminal shows, lone surrogates, and the
# backslash itself (doubled), so that an escape reads back unambiguously.
_UNSAFE = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _SHORT_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def display_text(text: str) -> str:
    """``text`` as a text table shows it: one line, nothing a terminal acts on. A control character is
    escaped as Python writes it (``\\n``, ``\\t``, ``\\r``, ``\\x1b``, ``\\x00``, ``\\u2028``) and a
    backslash is doubled; ``--json`` output is exact."""
    return _UNSAFE.sub(_escape, text)


def _cell(value: Any) -> str:
    """A value in a text table: a BLOB as hex, what get, delete and scan --from take for a BLOB key;
    text with its control characters escaped (``display_text``)."""
    if value is None:
        return ""
    return value.hex() if isinstance(value, bytes) else display_text(str(value))


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Rows as a text table, one line per row (cells and column names through ``display_text``)."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    columns = [display_text(c) for c in columns]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


# A negative integer as a word of the command line: an argument, though it starts like an option.
NEGATIVE_INTEGER = re.compile(r"-[0-9]+")
NEGATIVE_ARGUMENT_HINT = "a negative number meant as an argument goes after --, as in: mnesite COMMAND ... -- -5"


class KeyCommand(click.Command):
    """A command with a KEY argument that takes a negative integer key as typed, ``mnesite get t -5``.

    Click reads every word starting with ``-`` where an option may stand as an option, and refused
    ``-5`` (``No such option``) unless it followed ``--``. Here such a word that is a minus and ASCII
    digits is an argument: no option is spelled so, every other word is parsed as before, and a word
    an option takes as its value stays that value (``--timeout-ms -5`` is refused by its range).
    Click's public API only: the words are reordered before click parses them (``parse_args``).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, negative_integers_as_arguments(self.get_params(ctx), args))


def negative_integers_as_arguments(params: list[click.Parameter], args: list[str]) -> list[str]:
    """``args`` with the options (each with the words it takes as values) first, in their order, then
    ``--`` and the arguments in theirs, if a word that is a minus and ASCII digits stands where click
    would read an option; otherwise ``args`` unchanged. The options of ``params`` are flags, counts or
    take a fixed number of values (``nargs``), as in click: a value may be joined to its option
    (``--timeout-ms=5``, ``-t5``, a short option last in a group ``-vt5``), or be the next words
    whatever they look like. An unknown option takes no value here, and click refuses it as before."""
    long_values: dict[str, int] = {}  # an option's spelling -> the words it takes as values
    short_values: dict[str, int] = {}
    for param in params:
        if isinstance(param, click.Option):
            taken = 0 if param.is_flag or param.count else param.nargs
            for spelling in (*param.opts, *param.secondary_opts):
                is_short = len(spelling) == 2 and spelling[0] != spelling[1]
                (short_values if is_short else long_values)[spelling] = taken
    options: list[str] = []
    arguments: list[str] = []
    moved = False  # a negative integer stood where click would read an option
    index = 0
    while index < len(args):
        word = args[index]
        index += 1
        if word == "--":
            arguments += args[index:]
            break
        if NEGATIVE_INTEGER.fullmatch(word):
            arguments.append(word)
            moved = True
            continue
        if not word.startswith("-") or word == "-":
            arguments.append(word)
            continue
        taken = _values_taken(word, long_values, short_values)
        options += args[index - 1 : index + taken]
        index += taken
        if index > len(args):
            # The last option lacks a value: click refuses it first, whatever the arguments are.
            return options if moved else args
    return [*options, "--", *arguments] if moved else args


def _values_taken(word: str, long_values: dict[str, int], short_values: dict[str, int]) -> int:
    """How many of the words after option ``word`` click takes as its values (see above)."""
    spelling, joined, _ = word.partition("=")
    if spelling in long_values:
        return max(long_values[spelling] - bool(joined), 0)
    if word.startswith("--"):
        return 0  # unknown: refused
    for position, letter in enumerate(word[1:], start=2):
        taken = short_values.get(f"-{letter}")
        if taken is None:
            return 0  # unknown: refused
        if taken:
            return max(taken - bool(word[position:]), 0)
    return 0


class MnesiteGroup(click.Group):
    """Click with the README's one convention: every error is one ``Error:`` line on stderr and exit 1.

    Usage errors (a missing argument, an unknown option) follow it too, instead of click's usage block
    and exit 2, and no exception ever reaches the user as a traceback (``MNESITE_DEBUG=1`` shows it).
    """

    # A command whose exit statuses mean something else sets ``failure_exit_code`` on itself: ``mnesite
    # compare`` exits 1 for "diverged", so its usage errors and unexpected failures exit 2 ("could not
    # compare"), never a 1 that a script would read as divergence.
    _failure_exit_code = 1

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        self._failure_exit_code = getattr(command, "failure_exit_code", 1)
        return name, command, rest

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        self._failure_exit_code = 1
        try:
            result = super().main(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError as error:
            click.echo(error.format_message(), err=True)  # bare `mnesite`: the help text, as before
            sys.exit(0)
        except click.UsageError as error:
            command = error.ctx.command_path if error.ctx is not None else "mnesite"
            hint = ""
            if isinstance(error, click.NoSuchOption) and NEGATIVE_INTEGER.fullmatch(error.option_name):
                hint = f"; {NEGATIVE_ARGUMENT_HINT}"
            fail(f"{error.format_message()} (see '{command} --help'{hint})", self._failure_exit_code)
        except click.ClickException as error:
            fail(error.format_message(), self._failure_exit_code)
        except click.Abort:
            fail("aborted", self._failure_exit_code)
        except Exception as error:
            if os.environ.get("MNESITE_DEBUG"):
                raise
            fail(
                f"unexpected {type(error).__name__}: {str(error)[:300]} (MNESITE_DEBUG=1 shows the traceback)",
                self._failure_exit_code,
            )
        if isinstance(result, int) and result != 0:
            sys.exit(result)  # click.Exit from --help / --version in non-standalone mode
        return result


@click.group(cls=MnesiteGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="mnesite")
def main() -> None:
    """mnesite: a replicated SQLite database with a globally ordered transaction log (rlog)."""


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Node config (TOML).")
@click.option("--sample-data", is_flag=True, help="Create a small sample table if it does not exist yet.")
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
    default="INFO",
    show_default=True,
    help="Lowest level of the log lines written.",
)
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append the log to this file instead of stderr (errors at start-up still go to stderr).",
)
def start(config_path: str | None, sample_data: bool, log_level: str, log_file: str | None) -> None:
    """Run a node in the foreground until SIGTERM, Ctrl-C or `mnesite stop`.

    Without --config: a single core named core1 on tcp://127.0.0.1:7400 with its data in ./mnesite-data.
    The log ends with a line "... shut down (REASON)" when the node stops cleanly.
    A full disk does not stop it (writes are refused with disk_full until space is freed); a disk
    that fails a write or an fsync does: exit status 4, and a restart recovers from the log.
    """
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if log_file is not None:
        try:
            handler = logging.FileHandler(log_file, encoding="utf-8")  # appends
        except OSError as error:
            fail(f"cannot open --log-file {log_file}: {error.strerror}")
    logging.basicConfig(level=log_level, format=log_format, handlers=[handler])
    # Before the node exists: a core's start-up recovery runs in its constructor, for minutes if its
    # peers are away, and a SIGTERM or Ctrl-C then ends it as a stop (rlog.process_signals).
    signals = ProcessSignals()
    signals.install()
    try:
        serve_node(config_path, sample_data, signals)
    finally:
        # As they were: a process that goes on (a test's CliRunner) keeps its own handlers.
        signals.uninstall()


def serve_node(config_path: str | None, sample_data: bool, signals: ProcessSignals) -> None:
    """``start``'s node: constructed, bound and served until it stops; ``signals`` are installed already."""
    from mnesite.rlog.data_dir import DataDirectoryInUse
    from mnesite.rlog.disk import StorageFailedError
    from mnesite.rlog.server import StoppedWhileStarting
    from mnesite.rlog.store import EntryApplyError, StoreError

    try:
        config = load_config(config_path)
        if config.role == "replicant":
            from mnesite.replicant.node import ReplicantNode

            node = ReplicantNode(config, signals=signals)
        else:
            from mnesite.core.node import CoreNode

            node = CoreNode(config, signals=signals)
        node.bind()
    except StoppedWhileStarting:
        return  # stopped as asked, closed, its "shut down" line logged: a normal stop's exit status
    except (ConfigError, StoreError, DataDirectoryInUse) as error:
        fail(str(error))
    except Exception as error:  # zmq bind errors and the like: one line, not a traceback
        fail(f"cannot start: {type(error).__name__}: {error}")
    if sample_data and config.role == "core":
        load_sample_data(node)
    # What starting made (modules, types, the node's state) lives as long as the process: frozen out
    # of the cyclic collector, a full collection walks only what the loop made since. Under load a
    # core's full collections took 22-45 ms of its loop, frozen 0.6-5 ms (benchmarks/PROFILE.md).
    # The price: an object made while starting that later ends in a reference cycle is never
    # reclaimed (at most the start-up heap, a few MB, once). Here and not in serve_forever: a node
    # served from a thread must not freeze its host's heap.
    gc.freeze()
    try:
        node.serve_forever()
    except EntryApplyError as error:
        # A committed entry this node cannot apply: stop once, naming the entry (never a traceback loop).
        logging.getLogger("mnesite").critical("stopping: %s", error)
        fail(f"node stopped: {error}")
    except StorageFailedError as error:
        # rlog.disk: a failed fsync or write is never retried; a restart recovers from the log.
        logging.getLogger("mnesite").critical("stopping: the disk failed: %s", error)
        fail(
            f"node stopped: the disk failed: {error}. Nothing of the failed turn was acknowledged; check the "
            "disk, then restart the node: it recovers from its log and its peers",
            exit_code=EXIT_STORAGE_FAILED,
        )


def load_sample_data(node: Any) -> None:
    from mnesite.rlog import messages
    from mnesite.rlog.messages import Message

    def typed(message: Message) -> Message:
        # What the node would have received: the body decoded into its kind's type.
        return messages.decode(messages.encode(message))

    if "sample_users" in node.store.catalog():
        return
    create = typed(
        Message(
            "create_table",
            "sample-create",
            {"table": "sample_users", "key": "id", "columns": [["id", "INTEGER"], ["name", "TEXT"], ["karma", "REAL"]]},
        )
    )
    names = ["ada", "grace", "edsger", "barbara", "leslie", "donald", "margaret", "ken"]
    rows = [
        typed(
            Message(
                "transact",
                f"sample-row-{i}",
                {
                    "ops": [
                        {"op": "write", "table": "sample_users", "row": {"id": i, "name": n, "karma": float(i * 10)}}
                    ]
                },
            )
        )
        for i, n in enumerate(names, start=1)
    ]
    node.commit_batch([(None, create)])
    node.commit_batch([(None, row) for row in rows])


@main.group()
def table() -> None:
    """Create, list, describe, change and drop tables."""


COLUMN_TYPE_NAMES = ("INTEGER", "REAL", "TEXT", "BLOB", "ANY")


def parse_column(text: str, what: str = "--column") -> tuple[str, str]:
    name, sep, column_type = text.partition(":")
    if not sep or not name or column_type.upper() not in COLUMN_TYPE_NAMES:
        fail(f"{what} {text!r} must be NAME:TYPE with TYPE one of {', '.join(COLUMN_TYPE_NAMES)}")
    return name, column_type.upper()


@table.command("create")
@click.argument("table_name", metavar="TABLE")
@click.option("--key-column", "key_column", required=True, metavar="COLUMN", help="Key column (TEXT unless declared).")
@click.option(
    "--column", "columns", multiple=True, metavar="NAME:TYPE", help="Column; TYPE: INTEGER REAL TEXT BLOB ANY."
)
@click.option("--shard", default=None, help="Shard of the table (default: default).")
@node_options
@json_option
def table_create(table_name, key_column, columns, shard, endpoint, timeout_ms, as_json) -> None:
    """Create TABLE with its key column and declared columns."""
    parsed = [parse_column(c) for c in columns]
    with client_for(endpoint, timeout_ms) as client:
        tx_key = run(lambda: client.create_table(table_name, key_column, parsed, shard))
    if as_json:
        emit_json(written(client, tx_key))
    else:
        click.echo(f"created {table_name} at tx key {tuple(tx_key)}")


@table.command("list")
@node_options
@json_option
def table_list(endpoint, timeout_ms, as_json) -> None:
    """List tables with their shard, key and columns."""
    with client_for(endpoint, timeout_ms) as client:
        tables = run(client.list_tables)
    if as_json:
        emit_json(tables)
        return
    rows = [
        {
            "table": t["table"],
            "shard": t["shard"],
            "key": t["key"],
            "columns": ", ".join(f"{n}:{k}" for n, k in t["columns"]),
        }
        for t in tables
    ]
    click.echo(format_table(rows, ["table", "shard", "key", "columns"]))


@table.command("drop")
@click.argument("table_name", metavar="TABLE")
@node_options
@json_option
def table_drop(table_name, endpoint, timeout_ms, as_json) -> None:
    """Drop TABLE and all its rows on every core and replicant (through the rlog; admin role).

    Prints the tx key; exits 3 if the outcome is unknown (the drop may or may not have happened).
    """
    with client_for(endpoint, timeout_ms) as client:
        tx_key = run(lambda: client.drop_table(table_name))
    emit_json(written(client, tx_key)) if as_json else click.echo(f"dropped {table_name} at tx key {tuple(tx_key)}")


@table.command("describe")
@click.argument("table_name", metavar="TABLE")
@node_options
@json_option
def table_describe(table_name, endpoint, timeout_ms, as_json) -> None:
    """Show TABLE's shard, key column and columns with their types, then its secondary indexes.

    --json: as table list gives one table, with building (an online index build's progress) while one runs.
    """
    with client_for(endpoint, timeout_ms) as client:
        schema = run(lambda: client.table(table_name))
    if as_json:
        emit_json(schema)
        return
    click.echo(f"table {schema['table']} (shard {schema['shard']}, key {schema['key']})")
    rows = [{"column": n, "type": k, "key": "key" if n == schema["key"] else ""} for n, k in schema["columns"]]
    click.echo(format_table(rows, ["column", "type", "key"]))
    indexes = [{"index": i["name"], "columns": ", ".join(i["columns"])} for i in schema.get("indexes", [])]
    if indexes:
        click.echo("")
        click.echo(format_table(indexes, ["index", "columns"]))


@table.command("add-column")
@click.argument("table_name", metavar="TABLE")
@click.argument("column", metavar="NAME:TYPE")
@node_options
@json_option
def table_add_column(table_name, column, endpoint, timeout_ms, as_json) -> None:
    """Add a nullable column NAME:TYPE to TABLE on every core and replicant (through the rlog; admin role).

    Rows written before hold null there. TYPE: INTEGER REAL TEXT BLOB ANY. Prints the tx key.
    """
    name, column_type = parse_column(column, "NAME:TYPE")
    with client_for(endpoint, timeout_ms) as client:
        tx_key = run(lambda: client.add_column(table_name, name, column_type))
    if as_json:
        emit_json(written(client, tx_key))
    else:
        click.echo(f"added {name} {column_type} to {table_name} at tx key {tuple(tx_key)}")


@main.group()
def index() -> None:
    """Create and drop secondary indexes (replicated like tables; table describe shows them)."""


@index.command("create")
@click.argument("table_name", metavar="TABLE")
@click.argument("columns", metavar="COLUMN...", nargs=-1, required=True)
@click.option("--name", default=None, help="Index name (default: TABLE_COLUMN..._idx).")
@node_options
@json_option
def index_create(table_name, columns, name, endpoint, timeout_ms, as_json) -> None:
    """Create a secondary index of TABLE over COLUMN... on every core and replicant (admin role).

    Prints the index name and the tx key; queries (mnesite query) use it where SQLite's planner finds it useful.
    """
    index_name = name or default_index_name(table_name, columns)
    with client_for(endpoint, timeout_ms) as client:
        tx_key = run(lambda: client.create_index(table_name, list(columns), index_name))
    if as_json:
        emit_json(written(client, tx_key, index=index_name))
    else:
        click.echo(f"created index {index_name} on {table_name} ({', '.join(columns)}) at tx key {tuple(tx_key)}")


@index.command("drop")
@click.argument("name", metavar="NAME")
@node_options
@json_option
def index_drop(name, endpoint, timeout_ms, as_json) -> None:
    """Drop the secondary index NAME on every core and replicant (admin role). Prints the tx key."""
    with client_for(endpoint, timeout_ms) as client:
        tx_key = run(lambda: client.drop_index(name))
    emit_json(written(client, tx_key)) if as_json else click.echo(f"dropped index {name} at tx key {tuple(tx_key)}")


@main.command()
@click.argument("table_name", metavar="TABLE")
@click.argument("row_json", metavar="ROW_JSON")
@node_options
@json_option
def put(table_name, row_json, endpoint, timeout_ms, as_json) -> None:
    """Write a full row (a JSON object) into TABLE; prints the tx key (pass it to get/scan --after).

    A BLOB value is {"base64": ...}, as get --json prints it.

    If no definite answer comes in time (after one retry with the same request id) it exits 3:
    the write may or may not have happened.
    """
    row = parse_json_argument(row_json, "ROW_JSON")
    if not isinstance(row, dict):
        fail("ROW_JSON must be a JSON object")
    row = row_with_blobs(row, "ROW_JSON")
    with client_for(endpoint, timeout_ms) as client:
        tx_key = run(lambda: client.put(table_name, row))
    emit_json(written(client, tx_key)) if as_json else click.echo(f"{tuple(tx_key)}")


CONSISTENCY = click.option(
    "--consistency",
    type=click.Choice(["local", "read-your-writes", "linearizable"]),
    default="local",
    show_default=True,
    callback=read_option,
    help="Read consistency (read-your-writes waits for --after: without it, it reads as local, with a warning).",
)


@main.command(cls=KeyCommand)
@click.argument("table_name", metavar="TABLE")
@click.argument("key")
@CONSISTENCY
@AFTER
@node_options
@json_option
def get(table_name, key, consistency, after_tx_key, endpoint, timeout_ms, as_json) -> None:
    """Print the row of TABLE at KEY as JSON; if there is none: exit 1, or with --json print null and exit 0.

    KEY: an INTEGER key is ASCII digits with an optional leading - (-5 needs no --), a BLOB key hex.
    """
    with client_for(endpoint, timeout_ms) as client:
        row = run(lambda: client.get(table_name, parse_key(client, table_name, key), consistency, after_tx_key))
    if as_json:
        emit_json(row)
    elif row is None:
        fail(f"{table_name}: no row at key {key!r}")
    else:
        click.echo(json_text(row))


@main.command(cls=KeyCommand)
@click.argument("table_name", metavar="TABLE")
@click.argument("key")
@node_options
@json_option
def delete(table_name, key, endpoint, timeout_ms, as_json) -> None:
    """Delete the row of TABLE at KEY; prints the tx key.

    KEY: an INTEGER key is ASCII digits with an optional leading - (-5 needs no --), a BLOB key hex.
    """
    with client_for(endpoint, timeout_ms) as client:
        tx_key = run(lambda: client.delete(table_name, parse_key(client, table_name, key)))
    emit_json(written(client, tx_key)) if as_json else click.echo(f"{tuple(tx_key)}")


@main.command()
@click.argument("table_name", metavar="TABLE")
@click.option("--from", "from_key", metavar="KEY", default=None, help="Start at this key (included).")
@click.option("--limit", type=click.IntRange(1, None), default=None, help="At most this many rows.")
@click.option(
    "--page-rows",
    type=click.IntRange(1, SCAN_PAGE_ROWS_MAX),
    default=SCAN_PAGE_ROWS,
    show_default=True,
    help="Rows fetched per request (the CLI holds one page at a time).",
)
@CONSISTENCY
@AFTER
@node_options
@json_option
def scan(table_name, from_key, limit, page_rows, consistency, after_tx_key, endpoint, timeout_ms, as_json) -> None:
    """Print the rows of TABLE in key order, page by page as they arrive (memory: one page).

    --json prints one JSON array, written row by row. Nothing is printed before the first row is read:
    a scan refused at once leaves stdout empty; one cut short later exits 1 after the rows printed.
    """
    with client_for(endpoint, timeout_ms) as client:
        schema = run(lambda: client.table(table_name))
        columns = [name for name, _ in schema["columns"]]
        start = None if from_key is None else parse_key(client, table_name, from_key)
        # The first row before the first byte: a read refused at once leaves nothing on stdout (with
        # --json it had left "[", which no JSON parser reads).
        rows = started(stream_rows(client, table_name, start, page_rows, consistency, after_tx_key, limit))
        if as_json:
            click.echo("[", nl=False)
            for index, row in enumerate(rows):
                click.echo(("" if index == 0 else ",\n") + json_text(row), nl=False)
            click.echo("]")
            return
        header = True
        for page in pages_of(rows, page_rows):
            # Widths per page: a streamed table cannot know the widest cell of pages not read yet.
            text = format_table(page, columns)
            click.echo(text if header else text.split("\n", 1)[1])
            header = False
        if header:
            click.echo(format_table([], columns))


def stream_rows(
    client: Client,
    table_name: str,
    from_key: Any,
    page_rows: int,
    consistency: str,
    after_tx_key: AfterKey,
    limit: int | None,
) -> Iterator[dict[str, Any]]:
    """TABLE's rows in key order from ``from_key`` (included; a key of the table's key type, as
    ``parse_key`` gives it), fetched page by page, at most ``limit``."""
    after = None
    emitted = 0
    if from_key is not None:
        first = client.get(table_name, from_key, consistency, after_tx_key)
        if first is not None:
            yield first
            emitted += 1
        after = from_key
    if limit is not None and emitted >= limit:
        return
    if limit is not None:
        page_rows = min(page_rows, limit - emitted)  # no row asked of the node that is not printed
    for row in client.scan(table_name, after, page_rows, consistency, after_tx_key):
        yield row
        emitted += 1
        if limit is not None and emitted >= limit:
            return


def pages_of(rows: Iterator[dict[str, Any]], page_rows: int) -> Iterator[list[dict[str, Any]]]:
    page: list[dict[str, Any]] = []
    for row in rows:
        page.append(row)
        if len(page) >= page_rows:
            yield page
            page = []
    if page:
        yield page


def run_iterator(items: Iterator[Any]) -> Iterator[Any]:
    """Iterate, turning a mnesite error on the way into one ``Error:`` line (rows printed so far stay)."""
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except OutcomeUnknown as error:
            fail(str(error), EXIT_OUTCOME_UNKNOWN)
        except MnesiteError as error:
            fail(str(error))
        yield item


def started(items: Iterator[Any]) -> Iterator[Any]:
    """``items`` through ``run_iterator``, its first item already fetched: a command calls it before it
    writes anything, so that a stream refused before its first item (an unknown table, a read refused
    or timed out) fails with stdout empty. A failure after that is one ``Error:`` line and exit 1 (3
    if an outcome is unknown), the items printed before it staying on stdout."""
    items = run_iterator(items)
    for first in items:
        return itertools.chain((first,), items)
    return iter(())


@main.command()
@click.argument("table_name", metavar="TABLE")
@CONSISTENCY
@AFTER
@node_options
@json_option
def count(table_name, consistency, after_tx_key, endpoint, timeout_ms, as_json) -> None:
    """Print the number of rows of TABLE (counted by the node; no row is sent)."""
    with client_for(endpoint, timeout_ms) as client:
        rows = run(lambda: client.count(table_name, consistency, after_tx_key))
    emit_json({"table": table_name, "rows": rows}) if as_json else click.echo(rows)


@main.command()
@click.argument("file", type=click.File("r"))
@node_options
@json_option
def tx(file, endpoint, timeout_ms, as_json) -> None:
    """Run the transaction in FILE ('-' for stdin), all or nothing.

    \b
    FILE holds JSON: {"guards": [{"table", "key", "equals": row-or-null}],
                      "ops": [{"op": "write", "table", "row"} | {"op": "delete", "table", "key"}]}
    A BLOB (in a row, a key or a guard) is {"base64": ...}, as get --json prints it.
    A failed guard exits 1 and says which guard failed. Prints the tx key (for get/scan --after);
    exits 3 if the outcome is unknown (the transaction may or may not have happened).
    """
    text = file.read(TX_CHARS_MAX + 1)
    if len(text) > TX_CHARS_MAX:
        fail(f"the transaction is longer than {TX_CHARS_MAX} characters; nothing was sent")
    request = parse_json_argument(text, "the transaction")
    if not isinstance(request, dict) or set(request) - {"guards", "ops"} or "ops" not in request:
        fail('the transaction must be an object {"guards": [...], "ops": [...]}')
    request = transaction_with_blobs(request)
    with client_for(endpoint, timeout_ms) as client:
        try:
            tx_key = client.transact(request["ops"], request.get("guards") or [])
        except GuardFailed as error:
            fail(str(error))
        except OutcomeUnknown as error:
            fail(str(error), EXIT_OUTCOME_UNKNOWN)
        except MnesiteError as error:
            fail(str(error))
    emit_json(written(client, tx_key)) if as_json else click.echo(f"{tuple(tx_key)}")


def transaction_with_blobs(request: dict[str, Any]) -> dict[str, Any]:
    """``tx``'s request with the BLOBs of its rows, keys and guards given as ``{"base64": ...}`` as bytes."""
    for part, fields in (("ops", ("row", "key")), ("guards", ("equals", "key"))):
        items = request.get(part)
        if not isinstance(items, list):
            continue
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            for field in fields:
                if field in item:
                    where = f"{part}[{index}].{field}"
                    convert = row_with_blobs if field in ("row", "equals") else with_blob
                    item[field] = convert(item[field], where)
    return request


@main.command("import")
@click.argument("table_name", metavar="TABLE")
# Not strict: a byte that is not UTF-8 is refused by ``transfer.bounded_lines``, naming its line and offset.
@click.argument("file", type=click.File("r", encoding="utf-8", errors="surrogateescape"))
@click.option(
    "--format", "file_format", type=click.Choice(["jsonl", "csv"]), default=None, help="Default: from FILE's suffix."
)
@click.option(
    "--batch-rows",
    type=click.IntRange(1, IMPORT_BATCH_ROWS_MAX),
    default=IMPORT_BATCH_ROWS,
    show_default=True,
    help="Rows per transaction (keep it at most the node's transaction_ops_max).",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@node_options
@json_option
def import_rows(table_name, file, file_format, batch_rows, quiet, endpoint, timeout_ms, as_json) -> None:
    """Write the rows of FILE ('-': stdin) into TABLE: JSON lines (one object per line) or CSV with a header.

    \b
    Rows are written in transactions of --batch-rows rows (each all or nothing; fewer when the rows
    are wide, so that a transaction stays under the frame size), so memory stays bounded whatever the
    file's size. A regular FILE is read twice: first checked against TABLE's columns (an error
    names the line and nothing is written), then imported. CSV cells are converted to the column's
    type; an empty cell is null (in a TEXT column: the empty text; an ANY column's cells stay text);
    a BLOB cell is hex, X'' the empty BLOB. JSON lines keep every value as it is. FILE is UTF-8: a
    byte order mark opening it (Excel's "CSV UTF-8") is skipped, and a byte that is not UTF-8 is an
    error naming its line and byte offset. Progress goes to stderr (about once a second) unless --quiet.
    Ctrl-C says the rows imported; a transaction sent and not answered is named, never sent again, and
    exits 3 (outcome unknown), otherwise 1.
    """
    from mnesite.cli import progress, transfer

    file_format = file_format or transfer.format_of(transfer.file_name(file))
    # Lines untranslated (what csv needs): "\r\n" or "\r" inside a quoted CSV cell is the cell's text.
    file.reconfigure(newline="")
    with client_for(endpoint, timeout_ms) as client:
        try:
            schema = run(lambda: client.table(table_name))
            if file.seekable():
                for _ in transfer.read_rows(file, file_format, schema):
                    pass  # the check pass: a malformed line stops the import before anything is written
                file.seek(0)
            imported = transfer.import_rows(
                client,
                table_name,
                transfer.read_rows(file, file_format, schema),
                batch_rows,
                None if quiet else progress.ProgressLines(progress.PROGRESS_INTERVAL_S),
            )
        except transfer.ImportFailed as error:
            fail(str(error), EXIT_OUTCOME_UNKNOWN if error.outcome_unknown else 1)
        except KeyboardInterrupt:  # before the first transaction (import_rows says how far it got)
            fail(str(transfer.interrupted_import(transfer.Imported(), table_name)))
    if as_json:
        emit_json({"table": table_name, "rows": imported.rows, "transactions": imported.transactions})
    else:
        click.echo(f"imported {imported.rows} rows into {table_name} in {imported.transactions} transactions")


@main.command("export")
@click.argument("table_name", metavar="TABLE")
@click.option("--format", "file_format", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option("--output", "-o", type=click.File("w", encoding="utf-8"), default="-", help="Default: stdout.")
@click.option("--page-rows", type=click.IntRange(1, SCAN_PAGE_ROWS_MAX), default=SCAN_PAGE_ROWS, show_default=True)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@CONSISTENCY
@AFTER
@node_options
def export_rows(
    table_name, file_format, output, page_rows, quiet, consistency, after_tx_key, endpoint, timeout_ms
) -> None:
    """Write TABLE's rows in key order as JSON lines or CSV (with a header), page by page.

    BLOB values are {"base64": ...} in JSON lines and hex in CSV, X'' for the empty BLOB (what
    `import` reads back). JSON lines give every value back; CSV does not keep two: a null in a TEXT
    column comes back as the empty text (an empty cell is both), and an ANY column's values as text
    (an empty one as null).
    Progress goes to stderr (about once a second, then the rows written) unless --quiet. A column
    added to TABLE during a CSV export is left out (the header is written first): a line on stderr
    names it, even with --quiet. Ctrl-C says how many rows the (incomplete) output holds, exit 1;
    before the first row, that the output was not created (a FILE that existed keeps what it held).
    """
    from mnesite.cli import progress, transfer

    with client_for(endpoint, timeout_ms) as client:
        try:
            schema = run(lambda: client.table(table_name))
            rows = client.scan(table_name, None, page_rows, consistency, after_tx_key)
            lines = None if quiet else progress.ProgressLines(progress.PROGRESS_INTERVAL_S)
            # The first page before the CSV header (and before --output is created): a read refused at
            # once leaves no output behind.
            pages = started(pages_of(rows, page_rows))
            left_out = transfer.write_rows(output, file_format, schema, pages, lines).columns_left_out
        except transfer.ExportInterrupted as interrupted:
            name = "stdout" if output.name == "<stdout>" else output.name
            rows_written = interrupted.rows
            fail(f"export interrupted: {rows_written} rows were written to {name}, which is incomplete: export again")
        except KeyboardInterrupt:  # before write_rows: --output, opened at its first write, was not
            if output.name == "<stdout>":
                fail("export interrupted before the first row: nothing was written to stdout")
            if os.path.lexists(output.name):
                fail(f"export interrupted before the first row: {output.name} was not opened (it holds what it held)")
            fail(f"export interrupted before the first row: {output.name} was not created")
        if left_out:
            click.echo(transfer.left_out_notice(table_name, schema, left_out), err=True)


@main.command()
@node_options
@json_option
def stop(endpoint, timeout_ms, as_json) -> None:
    """Shut down the node at --node cleanly (admin role): it answers, logs a shutdown line and exits."""
    endpoint = single_endpoint(endpoint, "stop")
    with client_for(endpoint, timeout_ms, retries=0) as client:
        result = run(client.stop)
    emit_json(result) if as_json else click.echo(f"{result['node']} is stopping")


def describe_security(security: dict[str, Any]) -> str:
    if not security.get("curve"):
        return "security: OFF" + (" ([security] insecure = true)" if security.get("insecure") else " (loopback only)")
    failed = security["handshakes_failed"]
    return (
        f"security: CurveZMQ, {security['authorized_keys']} authorized keys; refused: "
        f"{failed['auth']} unknown keys, {failed['protocol'] + failed['no_detail']} other failed handshakes, "
        f"{security['refused_role']} by role, {security['refused_sender']} forged senders"
    )


def describe_copy(copy: dict[str, Any]) -> str:
    """A bootstrap's or snapshot install's progress: rows of the total, rate and ETA."""
    eta = f"{copy['eta_ms'] / 1000:.0f} s" if copy.get("eta_ms") is not None else "unknown"
    total = copy.get("rows_expected") or 0
    # No ETA: some table's row count is not known yet (it comes with its first batch), so no percent.
    percent = f" ({100 * copy['rows'] / total:.0f}%)" if total and copy.get("eta_ms") is not None else ""
    return f"{copy['rows']} of about {total} rows{percent}, {copy.get('rows_per_s') or 0:.0f} rows/s, ETA {eta}"


def describe_backup_schedule(schedule: dict) -> str:
    """``status``'s line for ``[backup]``'s schedule: when the next is due and what the last one did."""
    line = (
        f"scheduled backups every {schedule['interval_s']} s into {schedule['directory']}, "
        f"{len(schedule['files_kept'])} of {schedule['keep']} kept, next in {schedule['next_due_in_ms'] / 1000:.0f} s"
    )
    if schedule.get("waiting"):
        line += f" (due, waiting: {schedule['waiting']})"
    if schedule.get("last_path"):
        line += f"; last {schedule['last_path']}: {schedule['last_state']}"
        if schedule.get("last_error"):
            line += f" ({schedule['last_error']})"
    return line


@main.command()
@node_options
@json_option
def status(endpoint, timeout_ms, as_json) -> None:
    """Show the node's role and, per shard, its generation, applied tx key and digest.

    A core recovering at start-up from its peers shows that instead: the round, the peers asked,
    those that answered and those it waits for."""
    with client_for(one_node(endpoint, "status"), timeout_ms) as client:
        result = run(client.status)
    if as_json:
        emit_json(result)
        return
    click.echo(f"node {result['node']} ({result['role']})")
    for line in describe_versions(result):
        click.echo(line)
    click.echo(describe_security(result.get("security") or {}))
    backup = result.get("backup")
    if backup is not None:
        click.echo(
            f"backup to {backup['path']}: {backup['state']}, {backup['pages_copied']} of {backup['pages_total']} pages"
        )
    failed = result.get("backup_failed")
    if failed is not None:
        click.echo(f"last backup FAILED: {failed['path']} at {failed['failed_at']}: {failed['error']}")
    schedule = result.get("backup_schedule")
    if schedule is not None:
        click.echo(describe_backup_schedule(schedule))
    if result.get("no_core_reached"):
        click.echo(f"WARNING: {result['no_core_reached']}")
    dropped_line = describe_sends_dropped(result)
    if dropped_line:
        click.echo(dropped_line)
    for line in describe_connections_refused(result):
        click.echo(line)
    for line in describe_core_queues(result):
        click.echo(line)
    if result.get("recovery") is not None:
        for line in describe_recovery(result["recovery"]):
            click.echo(line)
        return
    if not result["shards"]:
        # A fresh cluster elects no sequencer until a shard exists: shards appear with their first table.
        click.echo("no shard yet: a shard (and its sequencer) appears with its first table (mnesite table create)")
        return
    if result["role"] == "replicant":
        rows = [replica_row(shard, info) for shard, info in result["shards"].items()]
        columns = ["shard", "mode", "upstream", "hears sequencer", "applied", "digest", "lag", "bootstraps"]
        click.echo(format_table(rows, [*columns, "resumes", "rows copied", "buffered"]))
        for shard, info in result["shards"].items():
            fence_line = describe_read_fence_error(shard, info)
            if fence_line:
                click.echo(fence_line)
            if info["mode"] == "bootstrap" and info.get("copy"):
                click.echo(f"bootstrap of {shard}: {describe_copy(info['copy'])}")
            if info["mode"] == "bootstrap" and info.get("bootstraps_outrun"):
                # The sizing trap (replicant.replica): last_error says what to raise.
                click.echo(
                    f"WARNING: shard {shard}: {info['bootstraps_outrun']} bootstrap(s) so far began again because "
                    f"a copy outlasted retention; last_error: {info.get('last_error')}"
                )
            elif info.get("last_error"):  # a full disk, no core to follow, a full spill (replicant.replica)
                click.echo(f"WARNING: shard {shard}: last_error: {info['last_error']}")
            name_wait_line = describe_name_wait(shard, info)
            if name_wait_line:
                click.echo(name_wait_line)
        return
    rows = [
        {
            "shard": shard,
            "role": info["role"],
            "generation": info["generation"],
            "sequencer": info["sequencer"] or "-",
            "applied": tuple(info["applied"]),
            "committed": tuple(info["committed"]),
            "last": tuple(info["last"]),
            "digest": info["digest"][:16],
            "rlog entries": info.get("rlog", {}).get("entries", ""),
        }
        for shard, info in result["shards"].items()
    ]
    columns = ["shard", "role", "generation", "sequencer", "applied", "committed", "last", "digest"]
    click.echo(format_table(rows, [*columns, "rlog entries"]))
    for shard, info in result["shards"].items():
        click.echo(f"{shard}: members {_describe_members(info)}")
        if info.get("learner"):
            click.echo(f"{shard}: learner {info['learner']} (catching up before the entry that adds it)")
        if info.get("removal"):
            click.echo(f"{shard}: {describe_removal(info['removal'])}")
        for peer, follower in sorted((info.get("followers") or {}).items()):
            click.echo(describe_follower(shard, peer, follower))
        exclusion = describe_exclusion(shard, info)
        if exclusion:
            click.echo(exclusion)
        if not info.get("serving", True):
            click.echo(f"{shard}: not serving: {info.get('not_serving_reason')}")
        floor_line = describe_vote_floor(shard, info)
        if floor_line:
            click.echo(floor_line)
        name_wait_line = describe_name_wait(shard, info)
        if name_wait_line:
            click.echo(name_wait_line)
    for shard, info in result["shards"].items():
        if info.get("install"):
            click.echo(f"snapshot install of {shard} from {info['install']['from']}: {describe_copy(info['install'])}")
    for line in describe_agents(result):
        click.echo(line)


def replica_row(shard: str, info: dict[str, Any]) -> dict[str, Any]:
    """A replicant's shard in ``mnesite status``'s table. ``hears sequencer``: whether its upstream
    hears the shard's sequencer (its journal answer, then its pushes), yes or no; ``-`` without an
    upstream (nothing is known then)."""
    hears = "-" if not info["upstream"] else "yes" if info.get("hears_sequencer") else "no"
    return {
        "shard": shard,
        "mode": info["mode"],
        "upstream": info["upstream"] or "-",
        "hears sequencer": hears,
        "applied": tuple(info["applied"]),
        "digest": (info["digest"] or "unknown")[:16],
        "lag": "" if info["lag_entries"] is None else info["lag_entries"],
        "bootstraps": info["bootstraps"],
        "resumes": info["resumes"],
        "rows copied": info["rows_copied"],
        "buffered": info["entries_buffered"],
    }


def describe_read_fence_error(shard: str, info: dict[str, Any]) -> str | None:
    """A replicant's shard whose reads stay fenced after its bootstrap because the committed key it
    needs was not told at its last ask (``read_fence_error``: the upstream's refusal, no answer, or
    the question not sent); None when there is no such error."""
    error = info.get("read_fence_error")
    if not error:
        return None
    return f"WARNING: shard {shard}: reads stay fenced after its bootstrap, the committed key not told: {error}"


def describe_recovery(recovery: dict[str, Any]) -> list[str]:
    """A core recovering at start-up (``core.recovery``; checked by ``Client.status``): how long, which
    round, the peers asked, those that answered, those it waits for and why."""
    asking = "asking its peers for their journals" if recovery["phase"] == "asking" else "waiting to ask again"
    lines = [
        f"RECOVERING at start-up for {recovery['elapsed_ms'] / 1000:.1f} s (an empty or restored database): "
        f"round {recovery['round']} of {recovery['rounds_max']}, {asking} "
        f"(recovery_timeout_ms {recovery['round_timeout_ms']} a round)",
        f"  asked: {', '.join(recovery['asked']) or '-'}; answered: {', '.join(recovery['answered']) or '-'}; "
        f"waiting for: {', '.join(recovery['waiting_for']) or '-'}",
        f"  {recovery['reason']}",
        "  it answers only status until it is done (every other request: not_ready); its shards open then",
    ]
    return lines


def describe_follower(shard: str, peer: str, follower: dict) -> str:
    """A sequencer's line for one follower; a lazy one (core.consensus, "Lazy followers") is fed every
    lazy_feed_interval_ms, not with every batch: a lag of up to that long is by design, not a fault."""
    lazy = " (lazy: fed every lazy_feed_interval_ms)" if follower.get("lazy") else ""
    return f"{shard}: follower {peer} matched {tuple(follower['match'])}, lag {follower['lag_entries']}{lazy}"


def describe_name_wait(shard: str, info: dict[str, Any]) -> str | None:
    """A shard whose apply waits at an entry creating a name another shard holds on the node
    (docs: A name across shards): which entry, the name, its holder, and what to do."""
    wait = info.get("name_wait")
    if not wait:
        return None
    return (
        f"WARNING: shard {shard}: applying waits at entry {tuple(wait['tx_key'])}: it creates {wait['name']!r}, "
        f"held here by {wait['held_by']!r} of shard {wait['held_by_shard']}; {wait['remedy']}"
    )


def describe_removal(removal: dict[str, Any]) -> str:
    """A removal the sequencer appends once a majority of the set it leaves answered an append sent
    since the request (``core.membership.removal_heard``), or refuses after ``timeout_ms``."""
    answered = ", ".join(removal["answered"]) or "none"
    return (
        f"removing {removal['name']}: waiting {removal['waiting_ms']} ms for the cores it leaves to answer "
        f"({len(removal['answered'])} of {removal['needed']} needed: {answered}); "
        f"refused no_quorum_after_change after {removal['timeout_ms']} ms"
    )


def describe_exclusion(shard: str, info: dict[str, Any]) -> str | None:
    """A core a forced start left out of the shard (docs: Force start): who forced it, in which
    generation and with which members, how its journal compares with the forced core's, and what to do.
    A core restarted since it was told knows only the generation (``by`` and ``members`` are null)."""
    excluded = info.get("excluded")
    if not excluded:
        return None
    by = f" of {excluded['by']}" if excluded.get("by") else ""
    members = f", members {', '.join(excluded['members'])}" if excluded.get("members") else ""
    return (
        f"{shard}: EXCLUDED by a forced start{by} (generation {excluded['generation']}{members}): "
        f"{excluded['verdict']}; it serves no write nor read of the shard: rebuild it (empty data directory), "
        "then cluster add-core"
    )


def describe_vote_floor(shard: str, info: dict[str, Any]) -> str | None:
    """A core rebuilt on an empty disk while its log is below its vote floor (``core.recovery``): it
    may lack entries committed because it held them before, so it votes only for logs that reach the
    floor, and no other core's disk should be replaced until it passes (None: no floor, or passed)."""
    floor = tuple(info.get("vote_floor") or (0, 0))
    last = tuple(info.get("last") or (0, 0))
    if floor == (0, 0) or last >= floor:
        return None
    return (
        f"{shard}: REBUILT, catching up: log at {last}, below its vote floor {floor}; it votes only for logs "
        "that reach the floor and does not campaign; rebuild no other core until it passes"
    )


def describe_agents(status: dict[str, Any]) -> list[str]:
    """A core's agents in ``mnesite status``: their memory budget, then one line per agent. The refused
    acknowledgements (no proof of a push read, or keys beyond it) are a broken or hostile replicant's."""
    lines = []
    budget = status.get("agent_budget")
    if budget is not None:
        lines.append(
            f"agents: {len(status.get('agents', []))}, holding {budget['used_bytes']} of {budget['bytes_max']} "
            f"bytes (agents_bytes_max), {budget['evicted_agents']} evicted for that budget, "
            f"{budget.get('acks_refused', 0)} acknowledgements refused"
        )
    for agent in status.get("agents", []):
        # The replicant's frame limit, told in its watch (protocol 2): pushes to it fit half of it.
        frame = agent.get("frame_bytes_max")
        limit = f"frame_bytes_max {frame}" if frame is not None else "frame_bytes_max not told"
        lines.append(
            f"agent {agent['agent']} -> {agent['replicant']} ({agent['shard']}, {agent['mode']}): "
            f"acked {tuple(agent['acked'])}, lag {agent['lag_entries']}, "
            f"{agent.get('acks_refused', 0)} acknowledgements refused, {limit}"
        )
    return lines


@main.group()
def rlog() -> None:
    """Inspect a shard's replication log."""


@rlog.command("tail")
@click.argument("shard")
@click.option("-n", "count", type=click.IntRange(1, 1000), default=10, show_default=True, help="Entries to show.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new entries until Ctrl-C (exit 0).")
@click.option(
    "--interval-ms",
    type=click.IntRange(10, 60_000),
    default=FOLLOW_INTERVAL_MS,
    show_default=True,
    help="With --follow: pause between polls when nothing new arrived.",
)
@node_options
@json_option
def rlog_tail(shard, count, follow, interval_ms, endpoint, timeout_ms, as_json) -> None:
    """Show the last entries of SHARD's rlog; with --follow, then every new entry as it commits.

    --json prints a JSON array; with --follow, one JSON object per line. Entries the node trimmed
    from its log before --follow read them are not shown: a line on stderr names them.
    """
    with client_for(endpoint, timeout_ms) as client:
        entries = run(lambda: client.rlog_tail(shard, count))
        if as_json and not follow:
            emit_json(entries)
            return
        for entry in entries:
            print_entry(entry, as_json)
        if not follow:
            return
        last = entries[-1]["tx_key"] if entries else None  # None: nothing shown yet, from the log's start
        try:
            while True:
                # Each poll is one request under --timeout-ms: a node that goes away ends the command.
                batch = run(lambda after=last or [0, 0]: client.rlog_entries(shard, after, FOLLOW_BATCH_MAX))
                if batch and last is not None and batch[0]["prev"] != last:
                    # The node answers the entries it holds after ``last``: those between were trimmed
                    # from its log (retention, a snapshot) before this follower read them.
                    gap = f"entries after {tuple(last)} up to {tuple(batch[0]['prev'])} are not in the node's log"
                    click.echo(f"{gap} any more (trimmed before they were read): not shown", err=True)
                for entry in batch:
                    print_entry(entry, as_json)
                if batch:
                    last = batch[-1]["tx_key"]
                else:
                    # Only an empty page says the node had nothing more: a page is bounded in bytes
                    # too (half a frame), so a short one may just be a page of large entries.
                    time.sleep(interval_ms / 1000)
        except KeyboardInterrupt:
            return  # Ctrl-C is how --follow ends: a clean exit


def print_entry(entry: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(entry)
        return
    ops = "; ".join(_describe_op(op) for op in entry["ops"]) or "(no ops)"
    click.echo(f"{tuple(entry['tx_key'])} <- {tuple(entry['prev'])} {entry['digest'][:16]} {ops}")


def _journal_members(age: dict[str, Any]) -> str:
    """A journal's committed membership of a shard; ``*`` adds a change only in the log (not committed)."""
    members = ",".join(age.get("members", []))
    pending = age.get("pending_members")
    return f"{members} (*{','.join(pending)})" if pending else members


def _describe_members(info: dict[str, Any]) -> str:
    """A shard's latest membership in the log; ``*`` marks a change not committed yet."""
    members = ", ".join(info["members"]) or "-"
    committed = info.get("committed_members")
    if committed is not None and committed != info["members"]:
        members += f"* (not committed yet; committed: {', '.join(committed) or '-'})"
    return members


def _describe_op(op: dict[str, Any]) -> str:
    if op["op"] == "write":
        return f"write {op['table']} {json_text(op['row'])}"
    if op["op"] == "delete":
        return f"delete {op['table']} {_cell(op['key'])}"
    if op["op"] == "members":
        added = f" (adds {op['added']} at {op['endpoint']})" if op["added"] else ""
        return f"members {', '.join(op['members'])}{added}"
    if op["op"] == "drop_table":
        return f"drop_table {op['table']} (shard {op['shard']})"
    if op["op"] == "create_index":
        return f"create_index {op['index']} on {op['table']} ({', '.join(op['columns'])})"
    if op["op"] == "drop_index":
        return f"drop_index {op['index']} on {op['table']}"
    if op["op"] == "add_column":
        return f"add_column {op['table']}.{op['column']} {op['type']}"
    if op["op"] == "cluster_version":
        return f"cluster_version {op['cluster_version']} (shard {op['shard']})"
    return f"create_table {op['table']} (shard {op['shard']}, key {op['key']})"


@rlog.command("verify")
@click.argument("data_dir", metavar="DATA_DIR|BACKUP", type=click.Path(exists=True))
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@json_option
def rlog_verify(data_dir, quiet, as_json) -> None:
    """Check offline that DATA_DIR's rlog (or a backup file's) is one unbroken digest chain ending at each
    shard's applied key. Read-only: it writes nothing there, not even a WAL checkpoint.

    \b
    The entries verified show on stderr (about once a second, then a line when done) unless --quiet;
    stdout is only the result. Ctrl-C stops it at once (exit 1).
    """
    import os

    from mnesite.cli.progress import PROGRESS_INTERVAL_S, ProgressLines, describe_chain_batch
    from mnesite.rlog.store import Store, StoreError

    is_file = os.path.isfile(data_dir)
    path = data_dir if is_file else os.path.join(data_dir, "mnesite.db")
    started_s = time.monotonic()
    lines = None if quiet else ProgressLines(PROGRESS_INTERVAL_S)
    entries_verified = 0

    def chained(shard: str, entries: int, tx_key: TxKey, applied: TxKey) -> None:
        nonlocal entries_verified
        entries_verified = entries
        if lines is not None:
            lines.show(lambda: f"rlog verify: {describe_chain_batch(shard, entries, tx_key, applied)}")

    try:
        # Read-only, a data directory too: no WAL pragma, no checkpointer, and no checkpoint at the
        # close (a read-write last close would move a stopped node's WAL into its database file).
        store = Store(path, create=False, readonly=True)
        try:
            result = store.verify_chains(chained)
        finally:
            store.close()
    except StoreError as error:
        fail(str(error))
    except KeyboardInterrupt:
        fail(f"rlog verify interrupted after {entries_verified} entries verified: the rest was not checked")
    if lines is not None:
        seconds = round(time.monotonic() - started_s, 3)
        try:  # a Ctrl-C as it is written (a blocked stderr) comes once every chain was checked
            lines.show(lambda: f"rlog verify: done in {seconds} s: {entries_verified} entries verified", final=True)
        except KeyboardInterrupt:
            fail(
                f"rlog verify interrupted once done: {entries_verified} entries verified, every digest chain "
                "unbroken (the result was not printed)"
            )
    if as_json:
        emit_json({"shards": {s: {"applied": k, "ok": True} for s, k in result.items()}})
    else:
        for shard, key in result.items():
            click.echo(f"{shard}: ok, applied {tuple(key)}")


@main.group()
def journal() -> None:
    """Inspect journal ages and, when a majority of cores is gone for good, force-start a core."""


def majority_age(keys: list[list[int] | None], cores: int) -> list[int] | None:
    """The committed tx key that a majority of ``cores`` has reached (None if no majority answered)."""
    known = sorted((tuple(k) for k in keys if k is not None), reverse=True)
    majority = cores // 2 + 1
    return list(known[majority - 1]) if len(known) >= majority else None


def collect_journals(endpoint: Any, timeout_ms: int) -> tuple[dict[str, Any], dict[str, dict | None]]:
    """The journal of the first core of ``endpoint`` (one or several --node) that answers, and of
    every core it names (None: did not answer)."""
    endpoints = node_endpoints(endpoint if isinstance(endpoint, tuple) else (endpoint,))
    for index, one in enumerate(endpoints):
        # A journal is one core's own (the client never fails it over): ask each --node in turn; the
        # answer names its core, and each core's journal is shown under its own name.
        with client_for(one, timeout_ms) as client:
            if index == len(endpoints) - 1:
                first = run(client.journal)
                break
            try:
                first = client.journal()
                break
            except Unavailable:
                continue
    journals: dict[str, dict | None] = {}
    for name, core_endpoint in sorted(first["core_nodes"].items()):
        if name == first["node"]:
            journals[name] = first
            continue
        try:
            with client_for(core_endpoint, min(timeout_ms, 2000), retries=0) as other:
                journals[name] = other.journal()
        except MnesiteError:
            journals[name] = None
    return first, journals


def force_start_losses(node: str, journals: dict[str, dict | None]) -> list[str]:
    """What forcing ``node`` may lose, per shard: its last key against what the reachable cores hold,
    and the cores it cannot reach, whose writes after its last key it would never see."""
    own = journals[node] or {"shards": {}}
    unreachable = sorted(name for name, answer in journals.items() if answer is None)
    lines = []
    shards = sorted({shard for answer in journals.values() if answer for shard in answer["shards"]})
    for shard in shards:
        age = own["shards"].get(shard)
        last = tuple(age["last"]) if age else (0, 0)
        ahead = {
            name: tuple(answer["shards"][shard]["last"])
            for name, answer in sorted(journals.items())
            if answer and name != node and shard in answer["shards"] and tuple(answer["shards"][shard]["last"]) > last
        }
        line = f"{shard}: {node} has the log up to {last}"
        if ahead:
            # The core refuses then (ShardConsensus._force_start): its entries after `last` would be replaced.
            held = ", ".join(f"{name} {key}" for name, key in ahead.items())
            line += (
                f"; reachable cores hold more: {held} (refused here: force-start {max(ahead, key=ahead.get)} instead)"
            )
        if unreachable:
            line += f"; anything {', '.join(unreachable)} committed after {last} would be lost"
        if not ahead and not unreachable:
            line += "; every core answered and none is ahead"
        lines.append(line)
    if not shards:
        lines.append(f"{node} holds no shard yet: nothing to lose")
    return lines


def describe_sends_dropped(status: dict[str, Any]) -> str | None:
    """The node's outgoing frames not sent since it started (``sends_dropped``), by reason; None if none."""
    total = status.get("sends_dropped") or 0
    if not total:
        return None
    by = status.get("sends_dropped_by") or {}
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(by.items()) if count)
    return f"sends dropped: {total}" + (f" ({reasons})" if reasons else "")


def describe_connections_refused(status: dict[str, Any]) -> list[str]:
    """The connections the node refused for ``[limits] connections_max`` since it started, and its own
    connections that other nodes refused (for theirs, or for this node's key) and it dialled again;
    nothing for none (or a release without the bound)."""
    connections = status.get("connections") or {}
    lines = []
    refused = connections.get("refused_open_max") or 0
    if refused:
        lines.append(
            f"connections refused: {refused} (connections_max {connections.get('open_max')} reached; "
            f"{connections.get('open')} open now)"
        )
    redials = connections.get("redials_refused") or 0
    if redials:
        lines.append(f"own connections refused by other nodes for their connections_max, dialled again: {redials}")
    redials_key = connections.get("redials_refused_key") or 0
    if redials_key:
        lines.append(
            f"own connections refused by other nodes for this node's key, dialled again: {redials_key} (add its "
            "public key to their authorized_keys and send them SIGHUP; the log names them)"
        )
    return lines


def describe_core_queues(status: dict[str, Any]) -> list[str]:
    """The cores (a replicant's, or a core's peers) toward which zmq holds bytes, or that had sends
    refused for ``core_queue_bytes_max`` (``core_queues``); nothing for a core that holds and refused nothing."""
    lines = []
    for core, queue in sorted((status.get("core_queues") or {}).items()):
        if queue.get("bytes") or queue.get("refused"):
            lines.append(
                f"core {core}: {queue.get('bytes', 0)} bytes queued toward it, not taken yet "
                f"({queue.get('frames', 0)} frames); {queue.get('refused', 0)} sends refused for core_queue_bytes_max"
            )
    return lines


def describe_versions(status: dict[str, Any]) -> list[str]:
    """What a node's status says of versions (rlog.versions) and of the cluster id it names, one line
    for it and one per peer."""
    versions = status.get("versions")
    if versions is None:
        return ["release 0.1.0 (it announces no versions; cluster version 1)"]

    def spoken(info: dict[str, Any]) -> str:
        low, high = info.get("cluster_versions") or [1, 1]
        return f"release {info.get('software')}, cluster versions {low if low == high else f'{low}..{high}'}"

    lines = [f"{spoken(versions)}"]
    if "cluster_version" in status:
        lines[0] += f"; cluster version {status['cluster_version']}, storage format {status.get('storage_format')}"
    if versions.get("cluster_id"):  # [cluster] cluster_id: absent when the node names none
        lines[0] += f"; cluster id {versions['cluster_id']}"
    peers = status.get("peer_versions") or status.get("core_versions") or {}
    for peer, info in sorted(peers.items()):
        said = "" if info.get("announced", True) else " (inferred: it announces no versions)"
        refused = f": INCOMPATIBLE, refused: {info['refused']}" if info.get("refused") else ""
        lines.append(f"  {peer}: {spoken(info)}{said}{refused}")
    return lines


@journal.command("show")
@node_options
@json_option
def journal_show(endpoint, timeout_ms, as_json) -> None:
    """Show every core's journal age per shard (generation, committed and last tx keys) and the
    age a majority of cores has reached."""
    first, journals = collect_journals(endpoint, timeout_ms)
    cores = first["core_nodes"]
    shards = sorted({s for j in journals.values() if j for s in j["shards"]})
    result = {"cores": {}, "majority": {}}
    for name, answer in journals.items():
        result["cores"][name] = {"endpoint": cores[name], "reachable": answer is not None}
        if answer is not None:
            result["cores"][name]["shards"] = answer["shards"]
            # rlog.versions: what the core speaks (release 0.1.0 announces nothing) and whom it refuses
            versions = answer.get("versions") or {"software": "0.1.0", "cluster_versions": [1, 1]}
            peers = answer.get("peer_versions") or {}
            result["cores"][name]["versions"] = versions
            result["cores"][name]["cluster_version"] = answer.get("cluster_version", 1)
            result["cores"][name]["refuses"] = {
                peer: info.get("refused") for peer, info in sorted(peers.items()) if info.get("refused")
            }
    for shard in shards:
        keys = [j["shards"].get(shard, {}).get("committed") if j else None for j in journals.values()]
        result["majority"][shard] = majority_age(keys, len(cores))
    if as_json:
        emit_json(result)
        return
    rows = []
    for name, info in result["cores"].items():
        if not info["reachable"]:
            rows.append({"core": name, "shard": "-", "generation": "unreachable"})
            continue
        for shard, age in sorted(info["shards"].items()):
            rows.append(
                {
                    "core": name,
                    "shard": shard,
                    "generation": age["generation"],
                    "committed": tuple(age["committed"]),
                    "last": tuple(age["last"]),
                    "members": _journal_members(age),
                    "forced": "FORCED" if age["forced"] else "",
                    "release": info["versions"].get("software"),
                    "cluster_version": age.get("cluster_version", 1),
                }
            )
    columns = ["core", "shard", "generation", "committed", "last", "members", "forced", "release", "cluster_version"]
    click.echo(format_table(rows, columns))
    for name, info in result["cores"].items():
        for peer, reason in info.get("refuses", {}).items():
            click.echo(f"{name} refuses {peer} (incompatible): {reason}")
    for shard, key in result["majority"].items():
        reached = tuple(key) if key is not None else "unknown: no majority of cores answered"
        click.echo(f"majority of {len(cores)} cores has committed {shard} up to {reached}")


@journal.command("force-start")
@click.option("--yes", is_flag=True, help="Confirm: you accept that writes may be lost.")
@node_options
@json_option
def journal_force_start(yes, endpoint, timeout_ms, as_json) -> None:
    """Make the core at --node sequencer of every shard with the cores it can reach, opening a new
    generation, when a majority of cores is gone for good. Needs the admin role.

    The core first asks every member for its journal; it refuses while a majority answers (an
    election will choose a sequencer without losing anything) and says which members it reached,
    and while a member it reached holds more of a shard's log (force-start that member instead).

    \b
    What may be lost: writes that the lost majority committed but this core never received, and the
    lost cores themselves, which must be rebuilt before they rejoin. Run `mnesite journal show` first
    and pick the core with the most advanced journal.
    """
    endpoint = single_endpoint(endpoint, "force-start")
    if not yes:
        # Say what this core may lose before anything is forced: its journal against its peers'.
        first, journals = collect_journals(endpoint, timeout_ms)
        for line in force_start_losses(first["node"], journals):
            click.echo(line, err=True)
        fail(f"not forced: rerun with --yes to force-start {first['node']} and accept these losses")
    # Sent once: the core answers only after its probe of the members (up to about 2 s), and a
    # re-send on silence is a second force start, refused by the reduced membership the first one
    # set, which hid that the first happened.
    with client_for(endpoint, timeout_ms, retries=0) as client:
        try:
            result = client.force_start()
        except Unavailable as error:
            if not error.sent:
                fail(str(error))  # never sent: nothing was forced
            fail(
                f"{error}; the force start may have happened: run `mnesite journal show` (its FORCED column) "
                "before running it again, with a --timeout-ms of at least 5000",
                EXIT_OUTCOME_UNKNOWN,
            )
        except MnesiteError as error:
            fail(str(error))
    if as_json:
        emit_json(result)
        return
    click.echo(f"FORCE-STARTED {result['node']} with members {', '.join(result['members'])}", err=True)
    click.echo(f"left out: {', '.join(result['left_out']) or 'nobody'}; may lose: {result['may_lose']}", err=True)
    for shard, info in result["shards"].items():
        click.echo(f"{shard}: generation {info['generation']}, last {tuple(info['last'])}")


@main.group()
def cluster() -> None:
    """Change the set of cores, one core at a time (the membership lives in each shard's rlog)."""


@dataclass
class _Talk:
    """Whom a core change (``_change_every_shard``) talks to, for what a Ctrl-C says: ``asked_at``, the
    endpoint the current shard's change was last asked at (None: not asked yet); ``core`` and
    ``endpoint``, the core whose answer the command waits for now, or waited for last (a change, or a
    ``members`` read: after a silence, of cores other than the --node one)."""

    core: str
    endpoint: str
    asked_at: str | None = None

    def talking(self, core: str, endpoint: str) -> None:
        self.core, self.endpoint = core, endpoint

    def asking(self, core: str, endpoint: str) -> None:
        self.talking(core, endpoint)
        self.asked_at = endpoint


class ChangeUnderWay(MnesiteError):
    """A membership change the sequencer is still making (its learner catching up) that has not
    moved for ``CHANGE_STALL_MS``: not refused, not done, and not silence. Also a change the
    sequencer's ``members`` shows done whose request it has not answered for as long."""

    code = "change_under_way"


def _change_shard(
    client: Client,
    shard: str,
    action: str,
    name: str,
    core_endpoint: str | None,
    clock_ms: Callable[[], int] = lambda: int(time.monotonic() * 1000),
    asking: Callable[[], None] = lambda: None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Change one shard at its sequencer (``client``) and wait for the answer as long as the change
    moves (``core.membership.change_wait``): a learner's catch-up outlasts any one answer. Each
    request left unanswered within --timeout-ms is followed by a ``members`` request: no answer to
    that either is ``OutcomeUnknown`` (the node is silent); a change that stopped moving is
    ``ChangeUnderWay``, and so is a change done whose resends the sequencer has not answered for as
    long; otherwise the same request id is sent again, which the sequencer answers when the change
    is (or was) done.

    An ``unchanged`` answer (``already_member`` / ``not_member``) says the latest membership entry
    of the sequencer's log has the change, committed or not (a half-done run's, or a crashed
    sequencer's entry a new one holds): it is the change done only once ``members`` shows the
    shard's committed membership with it, waited for as a learner is (progress on stderr,
    ``ChangeUnderWay`` after ``CHANGE_STALL_MS`` without any).

    The first attempt is a new request (``request_id`` None): ``Client.call`` takes a given id for
    an earlier attempt's, and would turn a first request refused unread (``forbidden``,
    ``overloaded``, ``disk_full``) or never sent (no node listening) into ``OutcomeUnknown``. Only
    the id of an attempt that went unanswered (``OutcomeUnknown.request_id``) is sent again, here or
    given by the caller for a sequencer silent before. ``asking`` is called as the change is first
    asked (from then on a Ctrl-C leaves a change that may be under way)."""
    seen, since_ms = None, clock_ms()
    answered: dict[str, Any] | None = None  # an ``unchanged`` answer, waiting for its commit
    asking()
    while True:
        if answered is None:
            try:
                answer = client.change_membership(shard, action, name, core_endpoint, request_id)
            except OutcomeUnknown as silence:
                why = str(silence)
                request_id = silence.request_id
            else:
                if "unchanged" not in answer:
                    return answer
                answered, seen, since_ms = answer, None, clock_ms()
                why = f"{client.endpoint} answered {answer['unchanged']} in shard {shard}"
        try:
            view = client.members()
        except MnesiteError as error:
            raise OutcomeUnknown(f"{why}; and no answer to `members` either ({error})", request_id or "") from None
        info = view.get("shards", {}).get(shard, {})
        wait = change_wait(info, name, action == "add", seen, since_ms, clock_ms())
        if answered is not None and wait.state == "done":
            return answered
        if wait.state == "unanswered":
            members = ", ".join(info.get("committed_members") or ())
            raise ChangeUnderWay(
                f"shard {shard}'s committed members are what was asked ({members}), but {client.endpoint} has not "
                f"answered the change for {CHANGE_STALL_MS // 1000} s; check with "
                f"`mnesite cluster members --node {client.endpoint}`, and run this command again to finish"
            )
        if wait.state == "stalled":
            raise ChangeUnderWay(
                f"the change of shard {shard} is still under way, with no progress for {CHANGE_STALL_MS // 1000} s "
                f"({_change_progress(info, name)}); {_change_goes_on(client.endpoint)}"
            )
        if wait.seen != seen and wait.state == "waiting":
            click.echo(f"{shard}: {_change_progress(info, name)}", err=True)
        seen, since_ms = wait.seen, wait.since_ms
        if answered is not None:
            time.sleep(SEQUENCER_POLL_MS / 1000)


def _change_at_sequencer(
    client: Client,
    timeout_ms: int,
    home: str,
    view: dict[str, Any],
    shard: str,
    action: str,
    name: str,
    core_endpoint: str | None,
    talk: _Talk,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Change ``shard`` at its sequencer as ``view`` (a ``members`` answer) names it: straight there,
    since catching up a new core may take longer than a forwarded request may wait; through
    ``client`` (the --node one, core ``home``) when that is the sequencer or none is named. Returns
    the answer and the last view used (the next shard starts from it).

    An answer that says the request reached a core that is not (or no longer) the sequencer and that
    nothing was written for it (``SEQUENCER_MOVED_CODES``: the sequencer stepped down or lost its
    leadership while its learner caught up, an election under way) is not the shard's failure: the
    change is asked anew (a new request) of the sequencer ``client``'s ``members`` names then
    (``_await_sequencer``). A sequencer silent to the change and to ``members`` (``OutcomeUnknown``:
    it crashed, or was paused) is followed by ``_await_after_silence``: the change is asked anew of
    another sequencer the cores name, or its request id sent again to the silent one if it answers
    again, or the outcome stays unknown. A sequencer no connection reaches (``UNREACHABLE_CODE``: it
    died, and the view naming it may be a core's that has not noticed yet) is waited out the same way,
    each ask then a new request (nothing was sent to it), and is "nothing changed" if none is named in
    time. They count toward ``SEQUENCER_REASKS_MAX`` and are said on stderr. A sequencer whose
    generation has not committed yet (``sequencer_not_settled``) is asked again every
    ``SEQUENCER_POLL_MS`` for up to ``SEQUENCER_WAIT_MS``. ``core.membership.after_change_failure``
    decides which. ``talk`` follows the cores the command talks to (``_Talk``)."""
    retries, request_id, settling_until = 0, None, None
    silence: OutcomeUnknown | None = None  # this shard's last silence: a later give-up is an outcome unknown
    while True:
        sequencer = view["shards"][shard]["sequencer"]
        endpoint = view["endpoints"].get(sequencer) if sequencer else None
        asked = home if endpoint is None or sequencer == home else sequencer
        try:
            if asked == home:
                here = partial(talk.asking, home, client.endpoint)
                answer = _change_shard(client, shard, action, name, core_endpoint, asking=here, request_id=request_id)
                return answer, view
            with client_for(endpoint, timeout_ms) as there:
                there_asking = partial(talk.asking, asked, endpoint)
                answer = _change_shard(
                    there, shard, action, name, core_endpoint, asking=there_asking, request_id=request_id
                )
                return answer, view
        except MnesiteError as error:
            failure = after_change_failure(error.code, error.refused)
            if failure in ("silent", "unreachable"):
                if isinstance(error, OutcomeUnknown):
                    silence = error
                step, view = _await_after_silence(
                    client, timeout_ms, home, view, shard, asked, error, silence, retries, talk
                )
                retries += 1
                if step.action == "resend" and failure == "silent":
                    request_id = error.request_id or None
                    said = f"{asked} answers again: sending it the same request again"
                elif step.action == "resend":
                    request_id = None  # nothing reached it: a new request
                    said = f"{asked} answers again: asking it the change"
                elif failure == "silent":
                    request_id = None
                    said = (
                        f"the sequencer {asked} fell silent ({error}); asking the change anew of its sequencer now, "
                        f"{step.sequencer}"
                    )
                else:
                    request_id = None
                    said = (
                        f"the sequencer {asked} is unreachable ({error}): nothing was asked there; asking the change "
                        f"of its sequencer now, {step.sequencer}"
                    )
                click.echo(f"{shard}: {said} (retry {retries} of {SEQUENCER_REASKS_MAX})", err=True)
                continue
            request_id = None  # whatever is asked next is a new request: nothing was written for this one
            if failure == "settling":
                settling_until = settling_until or time.monotonic() + SEQUENCER_WAIT_MS / 1000
                if time.monotonic() >= settling_until:
                    raise MnesiteError(
                        f"shard {shard}'s sequencer {asked} did not settle (commit an entry of its generation) within "
                        f"{SEQUENCER_WAIT_MS // 1000} s ({error}); nothing was changed in shard {shard}: run this "
                        "command again",
                        error.code,
                    ) from None
                time.sleep(SEQUENCER_POLL_MS / 1000)
                continue
            if failure != "moved":
                raise
            if retries == SEQUENCER_REASKS_MAX:
                raise MnesiteError(
                    f"shard {shard}'s sequencer changed {retries + 1} times while its change was asked, the last "
                    f"answer: {error}; nothing was changed in shard {shard}: run this command again",
                    error.code,
                ) from None
            retries += 1
            view = _await_sequencer(client, timeout_ms, home, view, shard, str(error), talk)
            now = view["shards"][shard]["sequencer"]
            click.echo(
                f"{shard}: the sequencer changed ({error}); asking the change anew of its sequencer now, {now} "
                f"(retry {retries} of {SEQUENCER_REASKS_MAX})",
                err=True,
            )


def _await_after_silence(
    client: Client,
    timeout_ms: int,
    home: str,
    view: dict[str, Any],
    shard: str,
    silent: str,
    failure: MnesiteError,
    silence: OutcomeUnknown | None,
    retries: int,
    talk: _Talk | None = None,
) -> tuple[AfterSilence, dict[str, Any]]:
    """What follows the silence of ``silent``, the core the change of ``shard`` was asked at
    (``core.membership.after_silence``), and the ``members`` answer that decided it: the cores of
    ``view`` (``client`` for ``home``) are asked ``members`` in turn, each within --timeout-ms and the
    silent one last, every ``SEQUENCER_POLL_MS`` until one names another sequencer or the silent one
    answers again, for at most ``SEQUENCER_WAIT_MS``. Else the outcome is unknown (``OutcomeUnknown``,
    with what was seen) if a change of this shard went unanswered (``silence``, the last one: also
    before a re-ask that reached no core); if none did (``failure``, the core unreachable: nothing was
    sent), nothing was changed, and the error says so."""
    order = sorted(core for core in {*view["endpoints"], home} if core != silent) + [silent]
    views: dict[str, dict[str, Any]] = {}  # each core's latest answer
    seen: dict[str, str] = {}  # what each core answered, for the message
    started = time.monotonic()

    def named() -> dict[str, str | None]:
        return {core: answer["shards"].get(shard, {}).get("sequencer") for core, answer in views.items()}

    step = after_silence(silent, {}, 0, retries)
    while step.action == "wait":
        for core, answer in _members_in_turn(client, timeout_ms, home, view, order, talk):
            if isinstance(answer, MnesiteError):
                views.pop(core, None)
                seen[core] = f"no answer ({answer.code})"
            else:
                views[core] = answer
                seen[core] = f"names {named()[core] or 'no sequencer'}"
            step = after_silence(silent, named(), int((time.monotonic() - started) * 1000), retries)
            if step.action != "wait":
                break
        else:
            time.sleep(SEQUENCER_POLL_MS / 1000)
    if step.action == "give_up":
        if retries >= SEQUENCER_REASKS_MAX:
            bound = f"the change was asked again {retries} times after a silence or an unreachable sequencer"
        else:
            bound = f"no core named another sequencer of shard {shard} within {SEQUENCER_WAIT_MS // 1000} s"
        cores = "; ".join(f"{core} {what}" for core, what in sorted(seen.items()))
        said = f"{bound}{f' ({cores})' if cores else ''}"
        if silence is not None:
            then = "" if failure is silence else f"; then {failure}"
            raise OutcomeUnknown(f"{silence}{then}; {said}", silence.request_id)
        raise MnesiteError(
            f"shard {shard}'s sequencer {silent} is unreachable ({failure}); {said}; nothing was changed in shard "
            f"{shard}: run this command again once `mnesite cluster members` names a sequencer that is up",
            UNREACHABLE_CODE,
        )
    return step, next(answer for core, answer in sorted(views.items()) if named()[core] == step.sequencer)


def _members_in_turn(
    client: Client, timeout_ms: int, home: str, view: dict[str, Any], order: list[str], talk: _Talk | None = None
) -> Iterator[tuple[str, dict[str, Any] | MnesiteError]]:
    """Each core of ``order`` with its ``members`` answer, or the error it gave, asked in that order:
    ``home`` (the --node core) through ``client``, the others at the endpoints ``view`` names, each
    within --timeout-ms and never retried; ``talk`` is told of each core as it is asked."""
    for core in order:
        if talk is not None:
            talk.talking(core, client.endpoint if core == home else view["endpoints"][core])
        try:
            if core == home:
                answer = client.members()
            else:
                with client_for(view["endpoints"][core], timeout_ms, retries=0) as other:
                    answer = other.members()
        except MnesiteError as error:
            yield core, error
        else:
            yield core, answer


def _members_read(
    client: Client, timeout_ms: int, home: str, view: dict[str, Any], talk: _Talk | None = None
) -> dict[str, Any]:
    """``members`` of the --node core (``home``, through ``client``) or, when it does not answer,
    of the first of the other cores ``view`` names that does, said on stderr; when none answers, the
    --node core's error is raised."""
    others = sorted(core for core in view["endpoints"] if core != home)
    unanswered: MnesiteError | None = None
    for core, answer in _members_in_turn(client, timeout_ms, home, view, [home, *others], talk):
        if not isinstance(answer, MnesiteError):
            if unanswered is not None:
                said = f"the --node core {home} did not answer ({unanswered})"
                click.echo(f"`members` read from {core}: {said}", err=True)
            return answer
        unanswered = unanswered or answer
    assert unanswered is not None
    raise unanswered


def _await_sequencer(
    client: Client, timeout_ms: int, home: str, view: dict[str, Any], shard: str, why: str, talk: _Talk | None = None
) -> dict[str, Any]:
    """The ``members`` answer (``_members_read``: the --node core's, else another core's of those
    ``view`` names) once it names a sequencer of ``shard`` (an election may be under way), polled for
    at most ``SEQUENCER_WAIT_MS``; else a ``no_sequencer`` error that says nothing was changed in that
    shard (``why``: the answer that sent the command here)."""
    deadline = time.monotonic() + SEQUENCER_WAIT_MS / 1000
    while True:
        try:
            answer = _members_read(client, timeout_ms, home, view, talk)
        except MnesiteError as error:
            last = f"`members` at {client.endpoint} failed: {error}"
        else:
            view = answer
            if view["shards"].get(shard, {}).get("sequencer"):
                return view
            last = f"{view['node']} knows no sequencer of shard {shard}"
        if time.monotonic() >= deadline:
            raise MnesiteError(
                f"shard {shard}'s sequencer changed ({why}) and no sequencer was known within "
                f"{SEQUENCER_WAIT_MS // 1000} s ({last}); nothing was changed in shard {shard}: run this command "
                f"again once `mnesite cluster members --node {client.endpoint}` names one",
                "no_sequencer",
            )
        time.sleep(SEQUENCER_POLL_MS / 1000)


def _change_goes_on(endpoint: str) -> str:
    """What to do about a change this command stopped waiting for (stalled, or a Ctrl-C)."""
    return (
        f"it goes on without this command: watch it with `mnesite cluster members --node {endpoint}`, "
        "and run this command again to wait for it"
    )


def _interrupted_at(talk: _Talk, shard: str) -> str:
    """What a Ctrl-C while ``shard``'s change was asked leaves, and what to check next. Waiting for
    the core the change was asked at: that core shows it. Reading another core's ``members`` (the one
    asked fell silent, answered that it is not the sequencer, or was unreachable): that core is the
    one to ask which sequencer the cores name now, and whether the shard shows the change."""
    said = "its change was asked and may be under way at the cluster"
    if talk.endpoint == talk.asked_at:
        return f"{said}; {_change_goes_on(talk.endpoint)}"
    return (
        f"{said} (asked at {talk.asked_at}, which did not give the answer; the command was asking {talk.core} at "
        f"{talk.endpoint} for the sequencer now); it goes on without this command: check with `mnesite cluster "
        f"members --node {talk.endpoint}` which sequencer shard {shard} has and whether its members show the "
        "change, and run this command again to finish"
    )


def _change_progress(info: dict[str, Any], name: str) -> str:
    if info.get("learner") == name:
        match = tuple(info["learner_match"]) if info.get("learner_match") else "nothing yet"
        committed = tuple(info["committed"]) if info.get("committed") else "?"
        copy = info.get("learner_copy")
        # A snapshot install moves the matched key only at its end: its copy is the progress meanwhile.
        copying = (
            f"; snapshot install: {copy['rows']:,} rows copied in {copy['batches']:,} batches, "
            f"the last {copy['last_batch_age_ms'] / 1000:.0f} s ago"
            if copy
            else ""
        )
        return f"{name} catching up as a learner: at {match} of {committed}{copying}"
    return f"waiting for the entry that changes the members ({', '.join(info.get('members') or ())})"


def _change_every_shard(endpoint: str | None, timeout_ms: int, action: str, name: str, core_endpoint: str | None):
    """Propose the change to every shard in turn; each is answered once its entry committed. The
    first shard that fails ends the run: the result says which shards changed (``shards``), which
    failed and why (``failed``) and which were not tried (``not_tried``)."""
    with client_for(endpoint, timeout_ms) as client:
        try:
            view = run(client.members)
        except KeyboardInterrupt:  # nothing is asked before this view: exit 1, as before a shard's change
            fail(f"{action} {name} interrupted before any change was asked: nothing was changed")
        if not view["shards"]:
            fail("the cluster has no shard yet: create a table first, then change its cores")
        home = view["node"]  # the --node core's name: a later view may be another core's
        talk = _Talk(home, client.endpoint)
        results: dict[str, Any] = {}
        failed: dict[str, dict[str, str]] = {}
        shards = sorted(view["shards"].items())
        for shard, _ in shards:
            talk.asked_at = None
            try:
                results[shard], view = _change_at_sequencer(
                    client, timeout_ms, home, view, shard, action, name, core_endpoint, talk
                )
            except MnesiteError as error:
                failed[shard] = {"code": error.code, "message": str(error)}
                break
            except KeyboardInterrupt:
                changed = ", ".join(sorted(results)) or "none"
                # Before its change was asked (while connecting to its sequencer, say) the shard is not tried.
                left = ", ".join(
                    other for other, _ in shards if other not in results and (other != shard or talk.asked_at is None)
                )
                if talk.asked_at is None:
                    fail(
                        f"{action} {name} interrupted before shard {shard}'s change was asked; run this command "
                        f"again to finish; changed: {changed}; not tried: {left}"
                    )
                fail(
                    f"{action} {name} interrupted while waiting for shard {shard}: {_interrupted_at(talk, shard)}; "
                    f"changed: {changed}; not tried: {left or 'none'}"
                )
        result = {"action": action, "core": name, "shards": results}
        if failed:
            result["failed"] = failed
            result["not_tried"] = [shard for shard, _ in shards if shard not in results and shard not in failed]
        try:
            result["members"] = _members_read(client, timeout_ms, home, view, talk)
        except MnesiteError:
            if not failed:
                raise
            result["members"] = None  # the failure's report matters more than the view after it
        except KeyboardInterrupt:
            if not failed:
                # The read goes on to the other cores when the --node one does not answer: name the one asked.
                read = "" if talk.core == home else f" (of {talk.core}: the --node core {home} did not answer)"
                fail(
                    f"{action} {name} interrupted at the final read of the membership, after every shard changed "
                    f"({', '.join(sorted(results))}): the change is done, only that read{read} was interrupted; "
                    f"check with `mnesite cluster members --node {talk.endpoint}`",
                    EXIT_CHANGED_MEMBERS_UNREAD,
                )
            result["members"] = None  # as above: the failure's report matters more than the view after it
        return result


@cluster.command("add-core")
@click.argument("name")
@click.argument("core_endpoint", metavar="ENDPOINT")
@node_options
@json_option
def cluster_add_core(name, core_endpoint, endpoint, timeout_ms, as_json) -> None:
    """Add core NAME, listening at ENDPOINT, to every shard. Needs the admin role.

    \b
    Start the new core first (its core_nodes list the running cores and itself; with [security]
    its key is in every core's authorized_keys and NAME under [security.roles] core, then SIGHUP).
    With an empty data directory it learns the membership from its peers and catches up as a
    learner (by snapshot if the cores trimmed their rlog); only then is the entry that adds it
    appended, and it votes once that entry is in its log. Run again to finish a change that stopped
    half-way: shards where NAME is already a member answer "already_member".

    \b
    The command waits as long as the catch-up makes progress (shown on stderr: the learner's key,
    and the rows of a snapshot install copied so far), whatever --timeout-ms (each answer's). A
    catch-up with no progress for 60 s exits 3 saying the change is still under way; a node that
    does not answer exits 3 too. Ctrl-C while it waits leaves the change asked, which may be under
    way at the cluster, and says so (before it is asked, that it was not), exit 1; Ctrl-C at the
    final read of the membership, every shard changed, says the change is done (check with
    `mnesite cluster members`), exit 5. When a shard fails, the shards changed before it and those
    not tried are named, and the command exits 1 (3 if the outcome is unknown).

    \b
    A sequencer that steps down while its learner catches up drops it (`not_sequencer`; during an
    election a core answers `no_sequencer`): nothing was changed, and the command says so, waits up
    to 15 s for `members` to name a sequencer and asks it anew, up to 3 times per shard. A sequencer
    that falls silent while asked (crashed, paused) may have made the change: the command asks the
    other cores' `members` for up to 15 s and asks the change anew of another sequencer they name
    (safe: it answers already_member if the silent one's entry reached it), or sends the same
    request again to the silent one if it answers again (counted in the same 3 per shard); if
    neither happens the outcome is unknown, exit 3. A sequencer no connection reaches (dead, though a
    core that has not noticed still names it) is waited out the same way, exit 1 if none is named
    (nothing was changed). A Ctrl-C names the core the command was asking then. A new sequencer
    not settled yet (`sequencer_not_settled`) is asked again for up to 15 s. An `already_member` / `not_member`
    answer is the shard done once `members` shows its committed membership with the change, waited
    for (and shown) as a catch-up is. When the --node core does not answer `members` (the wait for
    a sequencer, the final read), the other cores are asked, and stderr names the one that answered.
    """
    result = run(lambda: _change_every_shard(endpoint, timeout_ms, "add", name, core_endpoint))
    _print_change(result, as_json)


@cluster.command("remove-core")
@click.argument("name")
@node_options
@json_option
def cluster_remove_core(name, endpoint, timeout_ms, as_json) -> None:
    """Remove core NAME from every shard (to replace a dead core: remove it, then add-core the new
    one). Needs the admin role. A sequencer that removes itself steps down once the entry commits.
    When a shard fails, the shards changed before it and those not tried are named, and the command
    exits 1 (3 if the outcome is unknown). Ctrl-C behaves as for add-core: at the final read of the
    membership, every shard changed, it says the change is done (check with `mnesite cluster
    members`), exit 5. A change of sequencer while it waits is handled as for add-core."""
    result = run(lambda: _change_every_shard(endpoint, timeout_ms, "remove", name, None))
    _print_change(result, as_json)


def _print_change(result: dict[str, Any], as_json: bool) -> None:
    failed = result.get("failed", {})
    if as_json:
        emit_json(result)
    else:
        for shard, answer in sorted(result["shards"].items()):
            if "unchanged" in answer:
                click.echo(f"{shard}: unchanged ({answer['unchanged']})")
            else:
                click.echo(f"{shard}: {result['action']} {result['core']} committed at {tuple(answer['tx_key'])}")
        for shard, error in failed.items():
            click.echo(f"{shard}: NOT CHANGED ({error['code']}: the error below)")
        for shard in result.get("not_tried", []):
            click.echo(f"{shard}: NOT CHANGED: not tried")
        if result["members"] is not None:
            click.echo(f"members: {', '.join(result['members']['members'])}")
    if failed:
        # A half-done change is no success, whatever the output format: name what is left to do.
        shard, error = next(iter(failed.items()))
        changed = ", ".join(sorted(result["shards"])) or "none"
        left = ", ".join([shard, *result.get("not_tried", [])])
        unknown = error["code"] in (OutcomeUnknown.code, ChangeUnderWay.code)
        fail(
            f"{result['action']} {result['core']} stopped at shard {shard}: {error['message']}; changed: {changed}; "
            f"not changed: {left}; run the command again to finish",
            EXIT_OUTCOME_UNKNOWN if unknown else 1,
        )


@cluster.command("members")
@node_options
@json_option
def cluster_members(endpoint, timeout_ms, as_json) -> None:
    """Show the cores of the cluster and of each shard (latest membership in the log, committed
    or not; a learner is a core being added that is still catching up; a removal waits for the
    cores it leaves to answer before it is appended)."""
    with client_for(endpoint, timeout_ms) as client:
        result = run(client.members)
    if as_json:
        emit_json(result)
        return
    click.echo(f"members (as {result['node']} sees them): {', '.join(result['members'])}")
    rows = [
        {"core": name, "endpoint": address, "member": "yes" if name in result["members"] else "no"}
        for name, address in result["endpoints"].items()
    ]
    click.echo(format_table(rows, ["core", "endpoint", "member"]))
    for shard, info in result["shards"].items():
        pending = "" if info["members"] == info["committed_members"] else " (change not committed yet)"
        learner = f", learner {info['learner']}" if info["learner"] else ""
        click.echo(f"{shard}: {', '.join(info['members'])}{pending}{learner}; sequencer {info['sequencer']}")
        if info.get("removal"):
            click.echo(f"{shard}: {describe_removal(info['removal'])}")


@main.group()
def keys() -> None:
    """CurveZMQ keys for the [security] section."""


@keys.command("generate")
@click.argument("name")
@click.option(
    "--dir", "directory", type=click.Path(file_okay=False), default="keys", show_default=True, help="Where to write."
)
@json_option
def keys_generate(name: str, directory: str, as_json: bool) -> None:
    """Write DIR/NAME.key (the public key, shared) and DIR/NAME.key_secret (the secret, mode 0600).

    \b
    NAME is the principal: put NAME.key in every node's authorized_keys directory and NAME in
    [security.roles]. Make one key pair for the cluster (server_key, same file on every node), one
    per node (client_key) and one per user or application (--key).
    """
    from mnesite.rlog.security import SecurityError, generate_keys

    if not NAME_PATTERN.match(name):
        fail(f"NAME must be 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    try:
        public_path, secret_path = generate_keys(name, directory)
    except (SecurityError, OSError) as error:
        fail(str(error))
    if as_json:
        emit_json({"name": name, "public": public_path, "secret": secret_path})
        return
    click.echo(f"public key {public_path}\nsecret key {secret_path} (mode 0600: keep it on the machine that uses it)")


def _register_optional_commands() -> None:
    from mnesite.cli.backup import register
    from mnesite.cli.changes import register as register_changes
    from mnesite.cli.query import register as register_query

    register(main)
    register_query(main)
    register_changes(main)
    try:
        from mnesite.spark.cli import compare
    except ImportError:
        return
    main.add_command(compare)


_register_optional_commands()
