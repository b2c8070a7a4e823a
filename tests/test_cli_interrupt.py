"""Ctrl-C in the long commands (import, export, backup, cluster add-core / remove-core) says what happened.

Each command runs as a real process against a node of this test that holds one answer; once the
node has read that request the test sends the process a real SIGINT, then checks the one ``Error:``
line, the exit status and the requests the node read (nothing sent again). Before, every one of them
ended in click's ``Error: aborted``, exit 1, whatever was under way or committed."""

from __future__ import annotations

import io
import json
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.rlog import messages

from tests.conftest import RouterNode, ctrl_c_at_the_final_progress_line, wait_until

pytestmark = pytest.mark.timeout(60)

HELD = object()  # an answer never sent: the node took the request and has not answered it yet
# The command in a process where Ctrl-C raises KeyboardInterrupt even if the test runner ignores
# SIGINT (a child inherits an ignored signal), with a progress line per step.
COMMAND = (
    "import signal, sys\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "from mnesite.cli import progress\n"
    "progress.PROGRESS_INTERVAL_S = 0\n"
    "from mnesite.cli.main import main\n"
    "main(sys.argv[1:], prog_name='mnesite')\n"
)
ITEMS = {"table": "items", "shard": "default", "key": "id", "columns": [["id", "INTEGER"], ["name", "TEXT"]]}


class AnsweringNode(RouterNode):
    """A ROUTER that answers each request with ``answer(request, n)`` (n: its rank among the requests
    of its kind, from 1): a reply of that result, that message if it is one (an error), or never if it
    is ``HELD``; ``requests`` holds every request it read."""

    def __init__(self, answer: Callable[[messages.Message, int], Any]) -> None:
        self.answer = answer
        self.requests: list[messages.Message] = []
        super().__init__()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            received = self.receive_message()
            if received is None:
                continue
            envelope, request = received
            self.requests.append(request)
            result = self.answer(request, len(self.of_kind(request.kind)))
            if isinstance(result, messages.Message):
                self.send(envelope, result)
            elif result is not HELD:
                self.send(envelope, messages.reply(request.request_id, result))

    def of_kind(self, kind: str) -> list[messages.Message]:
        return [request for request in list(self.requests) if request.kind == kind]


def _interrupted(
    node: AnsweringNode,
    arguments: list[str],
    held: Callable[[subprocess.Popen], bool],
    cwd: Path,
    stdin: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``mnesite ARGUMENTS --node NODE``, send it SIGINT once ``held(process)``, and return how it
    ended. ``stdin``: written to its standard input, which stays open (a pipe still being written)."""
    process = subprocess.Popen(
        [sys.executable, "-c", COMMAND, *arguments, "--node", node.endpoint, "--timeout-ms", "60000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,  # not the checkout's folder: its mnesite/ would be imported instead of the installed package
    )
    try:
        if stdin is not None:
            process.stdin.write(stdin)
            process.stdin.flush()
        wait_until(lambda: held(process), 30, f"the held request of {arguments}")
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait(timeout=10)
        node.close()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _last_error(stderr: str) -> str:
    lines = stderr.splitlines()
    assert lines and lines[-1].startswith("Error: ") and "Traceback" not in stderr, stderr
    return lines[-1]


def _import_answers(held_transaction: int) -> Callable[[messages.Message, int], Any]:
    def answer(request: messages.Message, n: int) -> Any:
        if request.kind == "list_tables":
            return [ITEMS]
        if request.kind == "transact":
            return HELD if n == held_transaction else {"tx_key": [1, n], "shard": "default"}
        raise AssertionError(f"unexpected {request.kind}")

    return answer


def _rows(count: int) -> str:
    return "".join(json.dumps({"id": i, "name": f"n{i}"}) + "\n" for i in range(1, count + 1))


def test_ctrl_c_with_a_transaction_in_flight_says_its_outcome_is_unknown_and_exits_3(tmp_path: Path) -> None:
    """Ctrl-C while the second batch was sent and not answered: the import says the rows committed,
    that batch's lines with "outcome unknown" and how to check and go on, exits 3, and never sends it again."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(_rows(30))
    node = AnsweringNode(_import_answers(held_transaction=2))
    ended = _interrupted(
        node,
        ["import", "items", str(rows), "--batch-rows", "10"],
        lambda process: len(node.of_kind("transact")) == 2,
        tmp_path,
    )
    assert ended.returncode == 3 and ended.stdout == "", ended.stderr
    assert _last_error(ended.stderr) == (
        "Error: import interrupted: 10 rows in 1 transactions were imported (through line 10); the transaction "
        "of lines 11-20 was sent and not answered: outcome unknown, it may or may not have been imported (it was "
        "not sent again); check its rows with `mnesite get items KEY`, then import the rows after line 10 (a row "
        "imported twice keeps the file's values)"
    )
    transactions = node.of_kind("transact")
    assert len(transactions) == 2 and transactions[0].request_id != transactions[1].request_id, transactions


def test_ctrl_c_between_transactions_says_the_rows_imported_and_exits_1(tmp_path: Path) -> None:
    """Ctrl-C while the import waits for more lines from a pipe, its first batch committed: nothing is
    in flight, so it says the rows imported and where to go on from, and exits 1."""
    node = AnsweringNode(_import_answers(held_transaction=0))
    progress_line = "import: 10 rows in 1 transactions (line 10)"
    stderr_seen: list[str] = []

    def waiting_for_lines(process: subprocess.Popen) -> bool:
        # Its progress line is written once the batch's answer was taken: the import then reads stdin.
        if select.select([process.stderr], [], [], 0)[0]:
            stderr_seen.append(process.stderr.readline().rstrip("\n"))
        return progress_line in stderr_seen

    ended = _interrupted(node, ["import", "items", "-", "--batch-rows", "10"], waiting_for_lines, tmp_path, _rows(10))
    stderr = "\n".join(stderr_seen) + "\n" + ended.stderr
    assert ended.returncode == 1 and ended.stdout == "", stderr
    assert _last_error(stderr) == (
        "Error: import interrupted: 10 rows in 1 transactions were imported (through line 10), none was in "
        "flight; import the rows after line 10 to finish"
    )
    assert len(node.of_kind("transact")) == 1


def test_ctrl_c_during_an_export_says_the_rows_written_to_the_incomplete_file(tmp_path: Path) -> None:
    """Ctrl-C while the third page is asked for: two pages (20 rows) are in --output, and it says so."""

    def answer(request: messages.Message, n: int) -> Any:
        if request.kind == "list_tables":
            return [ITEMS]
        if request.kind == "scan":
            after = request.body.after or 0
            return HELD if n == 3 else [{"id": i, "name": f"n{i}"} for i in range(after + 1, after + 11)]
        raise AssertionError(f"unexpected {request.kind}")

    output = tmp_path / "items.jsonl"
    node = AnsweringNode(answer)
    ended = _interrupted(
        node,
        ["export", "items", "--page-rows", "10", "--output", str(output)],
        lambda process: len(node.of_kind("scan")) == 3,
        tmp_path,
    )
    assert ended.returncode == 1, ended.stderr
    assert _last_error(ended.stderr) == (
        f"Error: export interrupted: 20 rows were written to {output}, which is incomplete: export again"
    )
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == list(range(1, 21))


def test_ctrl_c_during_a_backup_download_removes_the_partial_file(tmp_path: Path) -> None:
    """Ctrl-C while ``backup --download`` waits for a chunk: LOCAL.partial is removed, the line says so
    and that the backup stays on the node's host; nothing is asked again."""
    done = {"state": "done", "pages_copied": 10, "pages_total": 10, "seconds": 1.5, "shards": {}}
    chunk = {"data": b"x" * 10, "size": 100, "end": False}
    node = AnsweringNode(lambda request, n: done if request.kind == "backup" else chunk if n == 1 else HELD)
    path, local = "/backups/core1.db", tmp_path / "local.db"
    arguments = ["backup", path, "--download", str(local)]
    ended = _interrupted(node, arguments, lambda process: len(node.of_kind("backup_read")) == 2, tmp_path)
    assert ended.returncode == 1, ended.stderr
    assert _last_error(ended.stderr) == (
        f"Error: backup download interrupted: {local}.partial was removed; the backup stays at {path} on the "
        "node's host (run the same command again to download it)"
    )
    assert "backup: downloaded 0.0 of 0.0 MiB" in ended.stderr  # the first chunk was written
    assert not local.exists() and not Path(f"{local}.partial").exists()
    assert [request.kind for request in node.requests] == ["backup", "backup_read", "backup_read"]


@pytest.mark.parametrize("answered", [True, False])
def test_ctrl_c_during_a_backup_says_the_node_goes_on_copying(tmp_path: Path, answered: bool) -> None:
    """Ctrl-C while the command polls a copy the node is making: the copy goes on at the node, and the
    line says how to watch it and what cancels it; before the node's first answer, that it may be copying."""
    running = {"state": "running", "pages_copied": 1, "pages_total": 10}
    node = AnsweringNode(lambda request, n: running if answered else HELD)
    path = "/backups/core1.db"
    polls = 2 if answered else 1
    ended = _interrupted(node, ["backup", path], lambda process: len(node.of_kind("backup")) >= polls, tmp_path)
    assert ended.returncode == 1, ended.stderr
    endpoint = node.endpoint
    if answered:
        expected = (
            f"Error: backup interrupted: the backup to {path} is still running (it goes on; poll with the same "
            f"FILE, or watch it with `mnesite status --node {endpoint}`); only stopping the node cancels it "
            f"(`mnesite stop --node {endpoint}`: it removes {path}.partial)"
        )
    else:
        expected = (
            f"Error: backup interrupted before the node answered: it may be copying to {path}; "
            f"check with `mnesite status --node {endpoint}`"
        )
    assert _last_error(ended.stderr) == expected
    assert {request.kind for request in node.requests} == {"backup"}


# A shard's membership as a core answers ``members`` (the client checks the answer: ``rlog.admin_answers``).
_MEMBERSHIP = {"members": ["core1"], "committed_members": ["core1"], "learner": None, "generation": 1}


@pytest.mark.parametrize("command", [["add-core", "core4", "tcp://127.0.0.1:7499"], ["remove-core", "core4"]])
def test_ctrl_c_while_a_core_change_waits_says_it_may_go_on_at_the_cluster(tmp_path: Path, command: list[str]) -> None:
    """Ctrl-C while shard b's change is unanswered (a changed, c not tried): the change may go on at the
    cluster (the request left; whether the node took it is unknown), the line says how to watch it and
    what was changed, and no other change is sent."""
    view = {
        "node": "core1",
        "endpoints": {},
        "members": ["core1"],
        "shards": {shard: {"sequencer": "core1", **_MEMBERSHIP} for shard in ("a", "b", "c")},
    }

    def answer(request: messages.Message, n: int) -> Any:
        if request.kind == "members":
            return view
        if request.kind == "membership_change":
            return HELD if request.body.shard == "b" else {"tx_key": [1, 5], "shard": request.body.shard}
        raise AssertionError(f"unexpected {request.kind}")

    node = AnsweringNode(answer)
    ended = _interrupted(
        node, ["cluster", *command], lambda process: len(node.of_kind("membership_change")) == 2, tmp_path
    )
    assert ended.returncode == 1, ended.stderr
    action = command[0].split("-")[0]
    assert _last_error(ended.stderr) == (
        f"Error: {action} core4 interrupted while waiting for shard b: its change was asked and may be under way "
        "at the cluster; it goes on without this command: watch it with "
        f"`mnesite cluster members --node {node.endpoint}`, and run this command again to wait for it; "
        "changed: a; not tried: c"
    )
    assert [request.body.shard for request in node.of_kind("membership_change")] == ["a", "b"]


@pytest.mark.parametrize("command", [["add-core", "core4", "tcp://127.0.0.1:7499"], ["remove-core", "core4"]])
def test_ctrl_c_at_a_core_change_s_final_members_read_says_every_shard_changed(
    tmp_path: Path, command: list[str]
) -> None:
    """Regression: Ctrl-C at the final ``members`` read, every shard changed, ended in click's
    ``Error: aborted`` (exit 1), which read as if nothing had happened. It says the change is done and
    only that read was interrupted, with the command to check, exit 5; no change is sent again."""
    view = {
        "node": "core1",
        "endpoints": {},
        "members": ["core1"],
        "shards": {shard: {"sequencer": "core1", **_MEMBERSHIP} for shard in ("a", "b")},
    }

    def answer(request: messages.Message, n: int) -> Any:
        if request.kind == "members":
            return view if n == 1 else HELD
        if request.kind == "membership_change":
            return {"tx_key": [1, 5], "shard": request.body.shard}
        raise AssertionError(f"unexpected {request.kind}")

    node = AnsweringNode(answer)
    ended = _interrupted(node, ["cluster", *command], lambda process: len(node.of_kind("members")) == 2, tmp_path)
    assert ended.returncode == 5, ended.stderr
    action = command[0].split("-")[0]
    assert _last_error(ended.stderr) == (
        f"Error: {action} core4 interrupted at the final read of the membership, after every shard changed (a, b): "
        f"the change is done, only that read was interrupted; check with `mnesite cluster members --node "
        f"{node.endpoint}`"
    )
    assert [request.body.shard for request in node.of_kind("membership_change")] == ["a", "b"]


def test_ctrl_c_at_an_import_s_last_progress_line_says_every_row_was_imported(tmp_path: Path, monkeypatch) -> None:
    """The final line was written outside the block that turns a Ctrl-C into how far the import got:
    the interrupt reached the command's own handler, for a Ctrl-C before the first transaction, which
    said "no row was imported ... import the file to finish" of 30 rows committed."""
    ctrl_c_at_the_final_progress_line(monkeypatch)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(_rows(30))
    node = AnsweringNode(_import_answers(held_transaction=0))
    try:
        result = CliRunner().invoke(main, ["import", "items", str(rows), "--batch-rows", "10", "--node", node.endpoint])
    finally:
        node.close()
    assert result.exit_code == 1, result.output
    assert _last_error(result.stderr) == (
        "Error: import interrupted: 30 rows in 3 transactions were imported (through line 30), none was in "
        "flight; import the rows after line 30 to finish"
    )
    assert len(node.of_kind("transact")) == 3


def test_ctrl_c_at_an_export_s_last_progress_line_says_every_row_was_written(tmp_path: Path, monkeypatch) -> None:
    """As for import: the final line was outside ``write_rows``' block, so the command said that 0
    rows were written of the 20 in the file."""
    ctrl_c_at_the_final_progress_line(monkeypatch)

    def answer(request: messages.Message, n: int) -> Any:
        if request.kind == "list_tables":
            return [ITEMS]
        if request.kind == "scan":
            after = request.body.after or 0
            return [{"id": i, "name": f"n{i}"} for i in range(after + 1, min(after + 10, 20) + 1)]
        raise AssertionError(f"unexpected {request.kind}")

    output = tmp_path / "items.jsonl"
    node = AnsweringNode(answer)
    try:
        arguments = ["export", "items", "--page-rows", "10", "--output", str(output), "--node", node.endpoint]
        result = CliRunner().invoke(main, arguments)
    finally:
        node.close()
    assert result.exit_code == 1, result.output
    assert _last_error(result.stderr) == (
        f"Error: export interrupted: 20 rows were written to {output}, which is incomplete: export again"
    )
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == list(range(1, 21))


class _BlockedOutput(io.StringIO):
    """An output that takes ``capacity`` characters, then blocks: a write that reaches it keeps what
    fits, and the Ctrl-C that comes while it blocks is raised from it (as from a full pipe's EINTR)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def write(self, text: str) -> int:
        room = self.capacity - self.tell()
        super().write(text[:room])
        if len(text) > room:
            raise KeyboardInterrupt
        return len(text)


@pytest.mark.parametrize("file_format", ["jsonl", "csv"])
def test_ctrl_c_in_an_export_s_write_counts_the_rows_the_output_holds(file_format: str) -> None:
    """JSON lines wrote a page at a time and counted it once written: a Ctrl-C as a page's write
    blocked (a full pipe that took part of it) said "10 rows" of an output holding 14 whole rows.
    Rows are now written and counted one by one, as for CSV."""
    from mnesite.cli import transfer

    rows = [{"id": i, "name": f"n{i}"} for i in range(1, 31)]
    header = "id,name\n" if file_format == "csv" else ""
    lines = [header] + [
        (f"{row['id']},{row['name']}\n" if file_format == "csv" else json.dumps(row) + "\n") for row in rows
    ]
    capacity = len("".join(lines[:15])) + 3  # the header, rows 1 to 14 and part of row 15
    output = _BlockedOutput(capacity)
    pages = iter([rows[:10], rows[10:20], rows[20:]])
    with pytest.raises(transfer.ExportInterrupted) as interrupted:
        transfer.write_rows(output, file_format, {"key": "id", "columns": ITEMS["columns"]}, pages)
    assert output.getvalue() == "".join(lines)[:capacity]
    assert interrupted.value.rows == 14


@pytest.mark.parametrize("existed", [False, True])
def test_ctrl_c_before_an_export_s_first_page_says_the_output_file_was_not_written(
    tmp_path: Path, existed: bool
) -> None:
    """Ctrl-C while the first page is asked for: --output (opened at its first write) was never
    created, or an existing file never opened, yet it said "0 rows were written to FILE, which is
    incomplete". It now says which; a file that was there keeps what it held."""

    def answer(request: messages.Message, n: int) -> Any:
        if request.kind == "list_tables":
            return [ITEMS]
        if request.kind == "scan":
            return HELD
        raise AssertionError(f"unexpected {request.kind}")

    output = tmp_path / "items.jsonl"
    if existed:
        output.write_text("an earlier export\n")
    node = AnsweringNode(answer)
    ended = _interrupted(
        node, ["export", "items", "--output", str(output)], lambda process: len(node.of_kind("scan")) == 1, tmp_path
    )
    assert ended.returncode == 1 and ended.stdout == "", ended.stderr
    if existed:
        assert _last_error(ended.stderr) == (
            f"Error: export interrupted before the first row: {output} was not opened (it holds what it held)"
        )
        assert output.read_text() == "an earlier export\n"
    else:
        assert _last_error(ended.stderr) == f"Error: export interrupted before the first row: {output} was not created"
        assert not output.exists()


@pytest.mark.parametrize(
    ("command", "first", "expected"),
    [
        (
            ["import", "items", "rows.jsonl"],
            "list_tables",
            "import interrupted: no row was imported, none was in flight; import the file to finish",
        ),
        (
            ["cluster", "add-core", "core4", "tcp://127.0.0.1:7499"],
            "members",
            "add core4 interrupted before any change was asked: nothing was changed",
        ),
        (
            ["cluster", "remove-core", "core4"],
            "members",
            "remove core4 interrupted before any change was asked: nothing was changed",
        ),
    ],
)
def test_ctrl_c_at_a_command_s_first_request_says_nothing_was_written_or_changed(
    tmp_path: Path, command: list[str], first: str, expected: str
) -> None:
    """Regression: Ctrl-C while the first request (import's table lookup, cluster's ``members``) was
    unanswered ended a core change in click's generic ``Error: aborted``, where a later Ctrl-C says
    what happened. It says that nothing was written or changed, exit 1 as the later cases with
    nothing in flight, and no other request is sent."""
    (tmp_path / "rows.jsonl").write_text(_rows(3))
    node = AnsweringNode(lambda request, n: HELD)
    ended = _interrupted(node, command, lambda process: len(node.requests) == 1, tmp_path)
    assert ended.returncode == 1, ended.stderr
    assert _last_error(ended.stderr) == f"Error: {expected}"
    assert [request.kind for request in node.requests] == [first]


@pytest.mark.parametrize("command", [["add-core", "core4", "tcp://127.0.0.1:7499"], ["remove-core", "core4"]])
def test_ctrl_c_before_a_core_change_is_asked_says_nothing_is_under_way(
    tmp_path: Path, monkeypatch, command: list[str]
) -> None:
    """Ctrl-C while connecting to shard b's sequencer (a changed): b's change was never asked, yet
    the line said "its change is under way at the cluster". It now says b was not asked."""
    from mnesite.cli import main as cli_main

    sequencer_endpoint = "tcp://127.0.0.1:1"
    view = {
        "node": "core1",
        "endpoints": {"core2": sequencer_endpoint},
        "members": ["core1", "core2"],
        "shards": {shard: {"sequencer": "core1" if shard == "a" else "core2", **_MEMBERSHIP} for shard in "abc"},
    }

    def answer(request: messages.Message, n: int) -> Any:
        if request.kind == "members":
            return view
        if request.kind == "membership_change":
            return {"tx_key": [1, 5], "shard": request.body.shard}
        raise AssertionError(f"unexpected {request.kind}")

    def client_for(endpoint: Any, *args: Any, **kwargs: Any) -> Any:
        if endpoint == sequencer_endpoint:
            raise KeyboardInterrupt  # as it connects
        return client_for_node(endpoint, *args, **kwargs)

    client_for_node = cli_main.client_for
    monkeypatch.setattr(cli_main, "client_for", client_for)
    node = AnsweringNode(answer)
    try:
        result = CliRunner().invoke(main, ["cluster", *command, "--node", node.endpoint])
    finally:
        node.close()
    assert result.exit_code == 1, result.output
    action = command[0].split("-")[0]
    assert _last_error(result.stderr) == (
        f"Error: {action} core4 interrupted before shard b's change was asked; run this command again to finish; "
        "changed: a; not tried: b, c"
    )
    assert [request.body.shard for request in node.of_kind("membership_change")] == ["a"]
