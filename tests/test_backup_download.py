"""``mnesite backup FILE --download LOCAL`` (cli/backup.py) and the ``backup_read`` request it sends
(rlog.backup.read_chunk): a node sends down only its own finished backup, in chunks within a frame, and
the command keeps LOCAL only once complete and checked as ``restore`` checks a backup."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.rlog import backup, messages
from mnesite.rlog.backup import BackupJob, chunk_bytes_max
from mnesite.rlog.client import Client
from mnesite.rlog.errors import RequestError
from mnesite.rlog.limits import BACKUP_CHUNK_BYTES_MAX
from mnesite.rlog.roles import RoleTable

from tests.conftest import ThreadNode, close_offline, offline_replicant
from tests.test_backup import _write_rows, hold_copy_between_steps
from tests.test_cli_interrupt import AnsweringNode

CHUNK_BYTES = 4096  # the tests' bound: a backup of a few pages takes several chunks
DONE = {"state": "done", "pages_copied": 10, "pages_total": 10, "seconds": 1.5, "shards": {}}


def _read(node, path: str, offset: int = 0) -> dict:
    """The node's answer to ``backup_read(path, offset)``, as its loop answers it."""
    body = messages.typed_body("backup_read", {"path": path, "offset": offset})
    return node.backup_request(messages.Message("backup_read", "r1", body), lambda: None).body.result


def test_backup_read_is_an_admin_request_of_a_bounded_shape() -> None:
    table = RoleTable({"admin": ["ops"], "writer": ["app"], "reader": ["dash"], "core": ["core1"]})
    assert table.refusal("ops", "backup_read") is None
    for principal in ("app", "dash", "core1", "stranger"):
        assert table.refusal(principal, "backup_read") is not None
    for body in ({"path": "/b.db", "offset": -1}, {"path": "b.db", "offset": 0}, {"path": "/a;b", "offset": 0}):
        with pytest.raises(messages.MessageError):
            messages.typed_body("backup_read", body)
    assert chunk_bytes_max(64 * 1024) == 16 * 1024  # a quarter of the smallest frame_bytes_max
    assert chunk_bytes_max(256 * 1024 * 1024) == BACKUP_CHUNK_BYTES_MAX


@pytest.mark.timeout(60)
def test_a_node_sends_only_its_own_finished_backup_while_it_is_the_file_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``backup_read`` must never read another file of the node's host: a path that is not the node's
    last backup, a backup still copying, and its file once replaced, changed or gone are refused."""
    node = offline_replicant(tmp_path / "r")
    target = tmp_path / "r.backup"
    try:
        with pytest.raises(RequestError, match="not this node's last backup \\(no backup\\)"):
            _read(node, str(target))
        released = threading.Event()
        copying, release = hold_copy_between_steps(monkeypatch, released.is_set)
        node.backup_job = BackupJob(node.store.path, str(target), "replicant1", "replicant", step_pages=1)
        assert copying.wait(30)
        with pytest.raises(RequestError, match="is running: only a finished backup is sent") as info:
            _read(node, str(target))
        assert info.value.code == "backup_refused"
        released.set()
        release()
        assert node.backup_job.wait(30) and node.backup_job.state == "done", node.backup_job.error
        whole = target.read_bytes()
        answer = _read(node, str(target))
        assert answer == {"data": whole, "size": len(whole), "end": True}
        for other in (node.store.path, "/etc/passwd", f"{target}.partial", f"{tmp_path}/../r.backup"):
            with pytest.raises(RequestError, match="not this node's last backup"):
                _read(node, other)
        # The same bytes under the same name, but another file (a copy moved into place).
        shutil.copyfile(target, tmp_path / "copy")
        os.replace(tmp_path / "copy", target)
        with pytest.raises(RequestError, match="changed or was replaced since the backup finished"):
            _read(node, str(target))
        target.unlink()
        target.symlink_to(tmp_path / "r" / "mnesite.db")  # a link to another file is never followed
        with pytest.raises(RequestError, match="gone or unreadable since the backup finished"):
            _read(node, str(target))
        target.unlink()
        with pytest.raises(RequestError, match="gone or unreadable since the backup finished"):
            _read(node, str(target))
    finally:
        close_offline(node)


def test_a_backup_changed_in_place_is_refused(tmp_path: Path) -> None:
    node = offline_replicant(tmp_path / "r")
    target = tmp_path / "r.backup"
    try:
        node.backup_job = BackupJob(node.store.path, str(target), "replicant1", "replicant")
        assert node.backup_job.wait(30) and node.backup_job.state == "done", node.backup_job.error
        with open(target, "ab") as appended:
            appended.write(b"x")
        with pytest.raises(RequestError, match="changed or was replaced"):
            _read(node, str(target))
    finally:
        close_offline(node)


def test_a_backup_is_read_in_chunks_of_the_bound_and_the_last_one_says_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backup, "CHUNK_BYTES_MAX", CHUNK_BYTES)
    node = offline_replicant(tmp_path / "r")
    target = tmp_path / "r.backup"
    try:
        node.backup_job = BackupJob(node.store.path, str(target), "replicant1", "replicant")
        assert node.backup_job.wait(30) and node.backup_job.state == "done", node.backup_job.error
        whole = target.read_bytes()
        assert len(whole) > 2 * CHUNK_BYTES
        first = _read(node, str(target))
        assert first == {"data": whole[:CHUNK_BYTES], "size": len(whole), "end": False}
        assert _read(node, str(target), CHUNK_BYTES)["data"] == whole[CHUNK_BYTES : 2 * CHUNK_BYTES]
        last = _read(node, str(target), len(whole) - 10)
        assert last == {"data": whole[-10:], "size": len(whole), "end": True}
        assert _read(node, str(target), len(whole)) == {"data": b"", "size": len(whole), "end": True}
        with pytest.raises(RequestError, match="past the end"):
            _read(node, str(target), len(whole) + 1)
    finally:
        close_offline(node)


def _backed_up_node(tmp_path: Path) -> ThreadNode:
    node = ThreadNode(tmp_path / "data")
    with node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
    _write_rows(node, 50)
    return node


def test_backup_download_copies_the_backup_in_chunks_into_a_file_restore_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mnesite.cli import backup as cli_backup

    monkeypatch.setattr(backup, "CHUNK_BYTES_MAX", CHUNK_BYTES)
    monkeypatch.setattr(cli_backup, "PROGRESS_INTERVAL_S", 0)
    reads: list[int] = []
    real_read = Client.backup_read

    def counted(self: Client, path: str, offset: int) -> dict:
        reads.append(offset)
        return real_read(self, path, offset)

    monkeypatch.setattr(Client, "backup_read", counted)
    node = _backed_up_node(tmp_path)
    remote, local = tmp_path / "node.backup", tmp_path / "here" / "local.backup"
    local.parent.mkdir()
    try:
        result = CliRunner().invoke(main, ["backup", str(remote), "--download", str(local), "--node", node.endpoint])
        assert result.exit_code == 0, result.output
        size = remote.stat().st_size
        assert local.read_bytes() == remote.read_bytes() and not Path(f"{local}.partial").exists()
        assert reads == list(range(0, size, CHUNK_BYTES))  # in order, each chunk once
        assert result.stdout.splitlines()[-1] == f"downloaded to {local}: {size} bytes, checked"
        progress = [line for line in result.stderr.splitlines() if line.startswith("backup: downloaded")]
        mib = f"{size / 2**20:.1f}"
        assert len(progress) == len(reads) and progress[-1] == f"backup: downloaded {mib} of {mib} MiB"
        # Its check, which reads the whole file again, says how far it got too (paced as the download is).
        assert result.stderr.splitlines()[-1].startswith("backup: digest chains: "), result.stderr
        again = CliRunner().invoke(
            main, ["backup", str(remote), "--download", str(tmp_path / "json.backup"), "--node", node.endpoint,
                   "--json", "--quiet"]
        )  # fmt: skip
        assert again.exit_code == 0 and again.stderr == "", again.output
        download = json.loads(again.stdout)["download"]
        assert download["path"] == str(tmp_path / "json.backup") and download["bytes"] == size
    finally:
        node.stop()
    restored = CliRunner().invoke(main, ["restore", str(local), "--data-dir", str(tmp_path / "new"), "--quiet"])
    assert restored.exit_code == 0, restored.output


def test_a_corrupted_chunk_fails_the_download_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backup, "CHUNK_BYTES_MAX", CHUNK_BYTES)
    real_read = Client.backup_read

    def corrupted(self: Client, path: str, offset: int) -> dict:
        chunk = real_read(self, path, offset)
        if offset == 4 * CHUNK_BYTES:  # a whole page of the b-trees, zeroed on the way
            chunk = {**chunk, "data": bytes(len(chunk["data"]))}
        return chunk

    monkeypatch.setattr(Client, "backup_read", corrupted)
    node = _backed_up_node(tmp_path)
    local = tmp_path / "local.backup"
    try:
        result = CliRunner().invoke(
            main, ["backup", str(tmp_path / "node.backup"), "--download", str(local), "--node", node.endpoint]
        )
    finally:
        node.stop()
    assert result.exit_code == 1, result.output
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"Error: the download of {tmp_path / 'node.backup'} to {local} is refused: "), last
    assert "the backup is damaged" in last and last.endswith("nothing was kept")
    assert not local.exists() and not Path(f"{local}.partial").exists()


@pytest.mark.parametrize("taken", ["", ".partial"])
def test_a_download_never_overwrites_a_local_file_and_asks_nothing_of_the_node(
    thread_node: ThreadNode, tmp_path: Path, taken: str
) -> None:
    local = tmp_path / "local.backup"
    Path(f"{local}{taken}").write_text("mine")
    result = CliRunner().invoke(
        main, ["backup", str(tmp_path / "node.backup"), "--download", str(local), "--node", thread_node.endpoint]
    )
    assert result.exit_code == 1
    assert result.stderr == f"Error: {local} (or {local}.partial) exists; a backup never overwrites a file\n"
    assert Path(f"{local}{taken}").read_text() == "mine"
    with thread_node.client(timeout_ms=5000) as client:
        assert client.status()["backup"] is None  # the node was never asked
    assert not (tmp_path / "node.backup").exists()


def test_a_node_of_an_older_release_is_named_as_such(tmp_path: Path) -> None:
    def answer(request: messages.Message, n: int) -> object:
        if request.kind == "backup_read":  # what a node that does not know the kind answers
            return messages.error(request.request_id, "unknown_kind", "unknown message kind 'backup_read'")
        return DONE

    node = AnsweringNode(answer)
    local = tmp_path / "local.backup"
    try:
        result = CliRunner().invoke(
            main, ["backup", "/backups/b.db", "--download", str(local), "--node", node.endpoint, "--quiet"]
        )
    finally:
        node.close()
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: the node runs an older release that cannot send a backup down (it does not know backup_read): "
        "copy /backups/b.db from its host yourself\n"
    )
    assert not local.exists() and not Path(f"{local}.partial").exists()
    assert [request.kind for request in node.requests] == ["backup", "backup_read"]
