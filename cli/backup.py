"""``mnesite backup`` and ``mnesite restore``: thin commands over ``rlog.backup``.

Theory of operation
-------------------
``backup FILE --node ENDPOINT`` asks the node to copy its database to FILE *on the node's host*
(the node writes it; FILE is made absolute here) and then polls the node with the same request
until the copy is done, failed, or ``--wait-ms`` has passed. With ``--download LOCAL`` it then reads
that file from the node (``backup_read``, a chunk per request, in order) into ``LOCAL.partial`` on
this host, syncs it, checks it as ``restore`` checks a backup (``rlog.backup.check_backup``) and gives
it its name: a file named LOCAL is always a complete, checked backup. ``restore FILE --data-dir DIR`` runs
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
    PARTIAL_SUFFIX,
    BackupError,
    RestoreChainVerified,
    RestoreFinished,
    RestoreIntegrityChecking,
    RestorePagesCopied,
    RestoreProgress,
    check_backup,
    publish,
    read_record,
    restore,
)
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.store import fsync_directory

POLL_INTERVAL_S = 0.2
WAIT_MS_DEFAULT = 3_600_000
MIB = 1024 * 1024


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
@click.option(
    "--download",
    metavar="LOCAL",
    type=click.Path(dir_okay=False),
    help="Then copy the backup down to LOCAL on this host and check it; LOCAL must not exist.",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@node_options
@json_option
def backup(file, wait_ms, download, quiet, endpoint, timeout_ms, as_json) -> None:
    """Write a consistent copy of the running node at --node to FILE, on the node's host. Needs the admin role
    and exactly one --node (a backup never fails over to another node).

    \b
    The node keeps serving: it copies the state of the moment it accepted the request, page by
    page, in a background thread. FILE records each shard's applied tx key and digest; it must not
    exist. Restore it with `mnesite restore FILE --data-dir DIR`. When --wait-ms passes, or on Ctrl-C,
    the command stops waiting (exit 1) and the node goes on copying: poll with the same FILE, or watch
    it in `mnesite status`; only stopping the node cancels it.
    With --download LOCAL, the finished FILE is then copied down to LOCAL on this host (through
    LOCAL.partial, in chunks) and checked as restore checks a backup; a failed check or Ctrl-C
    leaves no LOCAL nor LOCAL.partial (exit 1), and FILE stays on the node's host.
    """
    # The node writes FILE on its own host: never fail over to another node (and another host) when
    # the one named does not answer, as a read would.
    endpoint = single_endpoint(endpoint, "backup")
    path = os.path.abspath(file)
    local = None if download is None else _download_target(download)
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
    if local is not None:
        with client_for(endpoint, timeout_ms) as client:
            result = {**result, "download": download_backup(client, path, local, quiet)}
    if as_json:
        emit_json(result)
    else:
        click.echo(f"backup {path}: {result['pages_total']} pages in {result['seconds']} s")
        click.echo(f"shards: {_describe_shards(result['shards']) or 'none'}")
        if local is not None:
            click.echo(f"downloaded to {local}: {result['download']['bytes']} bytes, checked")


def _download_target(download: str) -> str:
    """LOCAL made absolute, refused before anything is asked of the node if it (or LOCAL.partial)
    exists or its directory does not: a download never overwrites a file."""
    local = os.path.abspath(download)
    if os.path.lexists(local) or os.path.lexists(local + PARTIAL_SUFFIX):
        fail(f"{local} (or {local}{PARTIAL_SUFFIX}) exists; a backup never overwrites a file")
    if not os.path.isdir(os.path.dirname(local)):
        fail(f"{os.path.dirname(local)}: no such directory")
    return local


def download_backup(client: Client, path: str, local: str, quiet: bool) -> dict:
    """Copy the node's finished backup at ``path`` to ``local`` on this host (``--download``): the chunks in
    order into ``local.partial``, its size checked, synced, checked as ``restore`` checks a backup, then
    named ``local``. Fails (exit 1) leaving neither file on any error or Ctrl-C."""
    partial = local + PARTIAL_SUFFIX
    lines = None if quiet else ProgressLines(PROGRESS_INTERVAL_S)
    started_s = time.monotonic()
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fail(f"{partial} exists (made meanwhile); a backup never overwrites a file")
    created = True  # ``partial`` is this command's to remove
    try:
        with os.fdopen(fd, "wb") as out:
            size = _receive(client, path, out, lines)
            out.flush()
            os.fsync(out.fileno())
        try:
            entries_verified = check_backup(partial, None if lines is None else _check_progress_lines(lines))
            publish(partial, local)
        except BackupError as error:
            fail(f"the download of {path} to {local} is refused: {error}; nothing was kept")
        created = False
        fsync_directory(os.path.dirname(local))
    except KeyboardInterrupt:
        if not created:
            fail(f"backup download interrupted once done: {local} holds the checked backup")
        os.unlink(partial)
        created = False
        fail(
            f"backup download interrupted: {partial} was removed; the backup stays at {path} on the node's host "
            "(run the same command again to download it)"
        )
    finally:
        if created:
            os.unlink(partial)
    seconds = round(time.monotonic() - started_s, 3)
    return {"path": local, "bytes": size, "seconds": seconds, "entries_verified": entries_verified}


def _receive(client: Client, path: str, out, lines: ProgressLines | None) -> int:
    """Append the chunks of the node's backup at ``path`` to ``out``, in order; returns its size."""
    offset, size = 0, None
    while True:
        try:
            chunk = client.backup_read(path, offset)
        except MnesiteError as error:
            if error.code == "unknown_kind":
                fail(
                    f"the node runs an older release that cannot send a backup down (it does not know "
                    f"backup_read): copy {path} from its host yourself"
                )
            fail(f"download of {path} failed: {error}")
        data, size = chunk["data"], size if size is not None else chunk["size"]
        if chunk["size"] != size or offset + len(data) > size or (not data and not chunk["end"]):
            fail(f"download of {path} failed: the node sent a chunk that does not fit the file ({size} bytes)")
        out.write(data)
        offset += len(data)
        if lines is not None:
            lines.show(functools.partial(describe_download_progress, offset, size), final=chunk["end"])
        if chunk["end"]:
            break
    if offset != size:
        fail(f"download of {path} failed: {offset} bytes received of {size}")
    return size


def describe_download_progress(received: int, size: int) -> str:
    """One stderr line of a ``--download``: the MiB received so far."""
    return f"backup: downloaded {received / MIB:.1f} of {size / MIB:.1f} MiB"


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


def _check_progress_lines(lines: ProgressLines) -> Callable[[RestoreProgress], None]:
    """The check of a download (``check_backup``) on stderr, paced as its download was: a large file's
    check reads it all, which takes minutes, and must not look like a hang."""
    return lambda event: lines.show(lambda: describe_restore_progress(event, "backup"))


def describe_restore_progress(event: RestoreProgress, command: str = "restore") -> str:
    """One stderr line for an event of ``rlog.backup.restore`` (or of ``check_backup``, for ``command``)."""
    if isinstance(event, RestorePagesCopied):
        return f"{command}: {event.pages_copied} of {event.pages_total} pages copied"
    if isinstance(event, RestoreIntegrityChecking):
        return f"{command}: integrity check of {event.pages_total} pages, {event.sqlite_steps} SQLite steps in"
    if isinstance(event, RestoreChainVerified):
        figures = describe_chain_batch(event.shard, event.entries_verified, event.tx_key, event.applied)
        return f"{command}: digest chains: {figures}"
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
