"""``mnesite backup`` and ``mnesite restore``: thin commands over ``rlog.backup``.

Theory of operation
-------------------
``backup FILE --node ENDPOINT`` asks the node to copy its database to FILE *on the node's host*
(the node writes it; FILE is made absolute here) and then polls the node with the same request
until the copy is done, failed, or ``--wait-ms`` has passed. ``restore FILE --data-dir DIR`` runs
offline, on the machine of the new node: it seeds DIR from the backup (see ``rlog.backup``). Both
show their progress on stderr through ``cli.progress.ProgressLines`` (as ``import`` does): a line at
most every ``PROGRESS_INTERVAL_S``, and a final one; stdout is only the result, which scripts read.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import click
from mnesite.cli.main import client_for, emit_json, fail, json_option, node_options, run, single_endpoint
from mnesite.cli.progress import PROGRESS_INTERVAL_S, ProgressLines, describe_chain_batch
from mnesite.rlog.backup import (
    DATABASE_FILE_NAME,
    BackupError,
    RestoreChainVerified,
    RestoreFinished,
    RestoreIntegrityChecking,
    RestorePagesCopied,
    RestoreProgress,
    read_record,
    restore,
)

POLL_INTERVAL_S = 0.2
WAIT_MS_DEFAULT = 3_600_000


def _describe_shards(shards: dict) -> str:
    parts = [f"{shard} at {tuple(info['applied'])} digest {info['digest'][:16]}" for shard, info in shards.items()]
    return ", ".join(parts)


def _still_running(path: str, endpoint: str, waited: str = "") -> str:
    """What ``backup`` says when it stops waiting for a copy that the node goes on with."""
    return (
        f"the backup to {path} is still running{waited} (it goes on; poll with the same FILE, "
        f"or watch it with `mnesite status --node {endpoint}`)"
    )


@click.command("backup")
@click.argument("file", metavar="FILE")
@click.option(
    "--wait-ms",
    type=click.IntRange(1, 86_400_000),
    default=WAIT_MS_DEFAULT,
    show_default=True,
    help="How long to wait for the copy to finish.",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@node_options
@json_option
def backup(file, wait_ms, quiet, endpoint, timeout_ms, as_json) -> None:
    """Write a consistent copy of the running node at --node to FILE, on the node's host. Needs the admin role
    and exactly one --node (a backup never fails over to another node).

    \b
    The node keeps serving: it copies the state of the moment it accepted the request, page by
    page, in a background thread. FILE records each shard's applied tx key and digest; it must not
    exist. Restore it with `mnesite restore FILE --data-dir DIR`. When --wait-ms passes, or on Ctrl-C,
    the command stops waiting (exit 1) and the node goes on copying: poll with the same FILE, or watch
    it in `mnesite status`; only stopping the node cancels it.
    """
    # The node writes FILE on its own host: never fail over to another node (and another host) when
    # the one named does not answer, as a read would.
    endpoint = single_endpoint(endpoint, "backup")
    path = os.path.abspath(file)
    deadline = time.monotonic() + wait_ms / 1000
    lines = None if quiet else ProgressLines(PROGRESS_INTERVAL_S)
    answered = False  # the node took the request: a copy is (or was) under way at it
    with client_for(endpoint, timeout_ms) as client:
        try:
            while True:
                result = run(lambda: client.backup(path))
                answered = True
                if result["state"] != "running":
                    break
                if time.monotonic() >= deadline:
                    fail(_still_running(path, endpoint, f" after {wait_ms} ms"))
                if lines is not None and result["pages_total"]:
                    lines.show(functools.partial(describe_backup_progress, result))
                time.sleep(POLL_INTERVAL_S)
            if lines is not None and result["state"] == "done":
                lines.show(functools.partial(describe_backup_progress, result), final=True)
        except KeyboardInterrupt:
            if answered and result["state"] == "done":  # at the final progress line (a blocked stderr)
                fail(f"backup interrupted once done: {path} holds the backup (the result was not printed)")
            if not answered:
                fail(
                    f"backup interrupted before the node answered: it may be copying to {path}; "
                    f"check with `mnesite status --node {endpoint}`"
                )
            fail(
                f"backup interrupted: {_still_running(path, endpoint)}; only stopping the node cancels it "
                f"(`mnesite stop --node {endpoint}`: it removes {path}.partial)"
            )
    if result["state"] == "failed":
        fail(f"backup to {path} failed: {result['error']}")
    if as_json:
        emit_json(result)
    else:
        click.echo(f"backup {path}: {result['pages_total']} pages in {result['seconds']} s")
        click.echo(f"shards: {_describe_shards(result['shards']) or 'none'}")


def describe_backup_progress(answer: dict) -> str:
    """One stderr line for a ``backup`` answer: the pages copied so far, or the final line once done."""
    if answer["state"] == "done":
        return f"backup: done in {answer['seconds']} s: {answer['pages_total']} pages copied"
    return f"backup: {answer['pages_copied']} of {answer['pages_total']} pages copied"


@click.command("restore")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--data-dir", required=True, type=click.Path(file_okay=False), help="The new node's data directory.")
@click.option(
    "--role",
    type=click.Choice(["replicant", "core"]),
    default="replicant",
    show_default=True,
    help="The role of the node that will start on DIR.",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@json_option
def restore_command(file, data_dir, role, quiet, as_json) -> None:
    """Seed DATA_DIR for a new node from the backup FILE; the node then resumes from the rlog.

    \b
    Run it on the new node's machine, before its first start. A replicant started on DATA_DIR
    resumes from the backup's tx keys without a bootstrap while the cores still retain them (else
    it bootstraps). A core first learns the generations in use from its peers.
    The copy, its integrity check and its digest chains' check show their progress on stderr
    (about once a second, then a line when done) unless --quiet. Ctrl-C stops it in any phase
    and leaves no database in DATA_DIR; once the database is in place (at the last line), it says
    the restore completed.
    """
    database_path = os.path.join(data_dir, DATABASE_FILE_NAME)
    refused = os.path.lexists(database_path)  # restore refuses a directory that has a database
    try:
        result = restore(os.path.abspath(file), data_dir, role, None if quiet else _restore_progress_lines())
    except BackupError as error:
        fail(str(error))
    except KeyboardInterrupt:
        if refused:
            raise  # interrupted before it was refused: say no more
        if os.path.lexists(database_path):
            # Interrupted once the complete copy was renamed into place (the last progress line, a
            # blocked stderr, is written after): the restore completed.
            fail(
                f"restore interrupted once it completed: {data_dir} holds the restored database, "
                f"ready for a {role} to start on it"
            )
        fail(f"restore interrupted: nothing was restored into {data_dir}")
    if as_json:
        emit_json(result)
    else:
        click.echo(f"restored {file} (taken on {result['node']} at {result['taken_at']}) into {data_dir} as a {role}")
        click.echo(f"shards: {_describe_shards(result['shards']) or 'none'}")


def _restore_progress_lines() -> Callable[[RestoreProgress], None]:
    """Restore's progress on stderr: a line at most every ``PROGRESS_INTERVAL_S``, and the final one."""
    lines = ProgressLines(PROGRESS_INTERVAL_S)
    return lambda event: lines.show(lambda: describe_restore_progress(event), isinstance(event, RestoreFinished))


def describe_restore_progress(event: RestoreProgress) -> str:
    """One stderr line for an event of ``rlog.backup.restore``."""
    if isinstance(event, RestorePagesCopied):
        return f"restore: {event.pages_copied} of {event.pages_total} pages copied"
    if isinstance(event, RestoreIntegrityChecking):
        return f"restore: integrity check of {event.pages_total} pages, {event.sqlite_steps} SQLite steps in"
    if isinstance(event, RestoreChainVerified):
        figures = describe_chain_batch(event.shard, event.entries_verified, event.tx_key, event.applied)
        return f"restore: digest chains: {figures}"
    return (
        f"restore: done in {event.seconds} s: {event.pages_total} pages copied and checked, "
        f"{event.entries_verified} entries of the digest chains verified"
    )


def backup_info(path: str) -> dict:
    """The backup record of FILE (for ``rlog verify``)."""
    try:
        return read_record(path)
    except BackupError as error:
        fail(str(error))


def register(main: click.Group) -> None:
    main.add_command(backup)
    main.add_command(restore_command, "restore")
