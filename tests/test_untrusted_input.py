"""Issue 10's reproductions, one test each: hostile contents get a clear error, change nothing, and the
node keeps serving. Unit level against a thread node (``tests/conftest.py``) and the pure machines."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import enum
import fractions
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from mnesite.core.consensus import (
    GENERATION_MAX,
    AppendReply,
    PersistState,
    ProtocolViolation,
    Role,
    VoteRequest,
)
from mnesite.rlog import messages, server
from mnesite.rlog.client import Client, InvalidRequest, RemoteError
from mnesite.rlog.messages import Message, MessageError
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, TxKey, WriteOp

from tests.conftest import ThreadNode, free_port, node_config, wait_until
from tests.test_consensus import Harness, append, chain, of_type

pytestmark = pytest.mark.timeout(60)

DEPTH = 1010  # the nesting: about 1 KB of msgpack


class Nested:
    """Stands for ``[[[...[]...]]]`` of ``depth`` levels; msgpack-python refuses to pack more than
    511 levels, so ``raw_frame`` splices the bytes in by hand, as an attacker would."""

    def __init__(self, depth: int = DEPTH) -> None:
        self.depth = depth
        self.marker = f"@nested-{depth}@"

    def packed(self) -> bytes:
        return b"\x91" * self.depth + b"\x90"


def nested(depth: int = DEPTH) -> Nested:
    return Nested(depth)


def raw_frame(kind: str, body: dict, request_id: str = "hostile") -> bytes:
    """A frame the client would refuse to build: packed by hand, as an attacker would."""
    splices: list[Nested] = []

    def mark(value):
        if isinstance(value, Nested):
            splices.append(value)
            return value.marker
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    frame = msgpack.packb([messages.PROTOCOL_VERSION, kind, request_id, mark(body)], use_bin_type=True)
    for splice in splices:
        frame = frame.replace(msgpack.packb(splice.marker), splice.packed())
    return frame


def raw_call(endpoint: str, frame: bytes, timeout_ms: int = 5000) -> Message | None:
    """Send one frame; return the answer (None for kinds that are not answered)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send(frame)
        if not socket.poll(timeout_ms):
            return None
        return messages.decode(socket.recv())
    finally:
        socket.close(0)


def snapshot(client: Client) -> dict:
    """What must not change: per shard applied key, digest, generation; and the tables."""
    status = client.status()
    shards = {name: (s["applied"], s["digest"], s["generation"]) for name, s in status["shards"].items()}
    return {"shards": shards, "tables": client.list_tables()}


@pytest.fixture
def node(tmp_path: Path):
    thread_node = ThreadNode(tmp_path / "data")
    with thread_node.client() as client:
        client.create_table("known", "id", [("id", "INTEGER"), ("name", "TEXT")])
        client.put("known", {"id": 1, "name": "ada"})
    try:
        yield thread_node
    finally:
        thread_node.stop()


def _leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


HOSTILE = [
    ("transact", {"ops": [{"op": "delete", "table": "known", "key": nested()}]}, "transact.ops[0].key"),
    ("create_table", {"table": "t2", "key": "id", "columns": nested()}, "create_table.columns"),
    ("get", {"table": "known", "key": nested()}, "get.key"),
    ("scan", {"table": "known", "after": nested()}, "scan.after"),
    ("get", {"table": "known", "key": 1, "min_key": nested()}, "get.min_key"),
    (
        "watch",
        {
            "shard": "default",
            "replicant": "r1",
            "endpoint": "tcp://127.0.0.1:1",
            "from": nested(),
            "from_digest": GENESIS_DIGEST,
            "protocol": 1,
        },
        "watch.from",
    ),
    (
        "watch",
        {"shard": "default", "replicant": "r1", "endpoint": "", "from": [0, 0], "from_digest": b"", "protocol": 1},
        "watch.endpoint",
    ),
    (
        "watch",
        {"shard": "default", "replicant": "r1", "endpoint": "x", "from": [0, 0], "from_digest": b"", "protocol": 1},
        "watch.endpoint",
    ),
    ("push_ack", {"shard": "default", "agent": "a1", "applied": ["x"]}, "push_ack.applied"),
    ("rlog_entries", {"shard": "default", "after": [1, 2**64 - 1]}, "rlog_entries.after"),
    ("get", {"table": "known", "key": 2**64 - 1}, "get.key"),
    ("transact", {"ops": [{"op": "write", "table": "known", "row": {"id": 2**64 - 1}}]}, "transact.ops[0].row.id"),
    ("transact", {"ops": 5}, "transact.ops"),
    ("peer", {"shard": "default", "sender": "core2", "message": [nested()]}, "peer.message"),
    # the changefeed: a position is the client's, so every field of it is hostile input
    (
        "changes",
        {
            "positions": [
                {"shard": "default", "after": [0, 0], "phase": "copy", "table": "known", "table_after": nested()}
            ]
        },
        "changes.positions[0].table_after",
    ),
    ("changes", {"positions": [{"shard": "default", "after": [1, 2**64 - 1]}]}, "changes.positions[0].after"),
    (
        "changes",
        {"positions": [{"shard": "default", "after": [0, 0], "phase": "rewind"}]},
        "changes.positions[0].phase",
    ),
    ("changes", {"tables": ["known"], "wait_ms": 10**9}, "changes.wait_ms"),
    ("changes", {"tables": ["x" * 65]}, "changes.tables[0]"),
    ("changes", {"page_records": 0}, "changes.page_records"),
]


@pytest.mark.parametrize(("kind", "body", "path"), HOSTILE, ids=[f"{k}:{p}" for k, _, p in HOSTILE])
def test_hostile_contents_get_a_clear_error_naming_the_field_and_change_nothing(node, kind, body, path) -> None:
    with node.client() as client:
        before = snapshot(client)
        answer = raw_call(node.endpoint, raw_frame(kind, body))
        assert answer is not None and answer.kind == "error", answer
        assert answer.body.message.startswith(path), answer.body
        assert len(answer.body.message) < 300, "the error never prints the whole value"
        assert snapshot(client) == before
        assert client.put("known", {"id": 2, "name": "still serving"}) > TxKey(0, 0)
    assert node.thread.is_alive()


CLIENT_SIDE = [case for case in HOSTILE if not any(isinstance(v, Nested) for v in _leaves(case[1]))]


@pytest.mark.parametrize(("kind", "body", "path"), CLIENT_SIDE, ids=[p for _, _, p in CLIENT_SIDE])
def test_the_client_refuses_the_same_before_sending(kind, body, path) -> None:
    # Nothing listens there: a refusal must come from the client's own check, not from a node.
    with Client("tcp://127.0.0.1:9", timeout_ms=100, retries=0) as client, pytest.raises(InvalidRequest) as info:
        client.call(kind, body)
    assert path in str(info.value)


NOT_WIRE_VALUES = [
    decimal.Decimal("1.10"),
    datetime.date(2026, 1, 2),
    datetime.datetime(2026, 1, 2, 3, 4, 5),
    datetime.time(3, 4, 5),
    uuid.UUID(int=1),
    fractions.Fraction(1, 3),
    {1, 2},
]
NOT_WIRE = [
    ("transact", lambda v: {"ops": [{"op": "write", "table": "t", "row": {"id": 1, "price": v}}]}, "ops[0].row.price"),
    ("transact", lambda v: {"ops": [{"op": "delete", "table": "t", "key": v}]}, "transact.ops[0].key"),
    ("transact", lambda v: {"ops": [], "guards": [{"table": "t", "key": v}]}, "transact.guards[0].key"),
    ("transact", lambda v: {"ops": [], "guards": [{"table": "t", "key": 1, "equals": {"a": v}}]}, "equals.a"),
    ("query", lambda v: {"sql": "SELECT ?", "params": [1, v]}, "query.params[1]"),
    ("get", lambda v: {"table": "t", "key": v}, "get.key"),
    ("scan", lambda v: {"table": "t", "after": v}, "scan.after"),
]


@pytest.mark.parametrize("value", NOT_WIRE_VALUES, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize(("kind", "body", "path"), NOT_WIRE, ids=[p for _, _, p in NOT_WIRE])
def test_a_value_sqlite_cannot_store_is_refused_by_the_client_naming_the_field(kind, body, path, value) -> None:
    """msgspec writes a Decimal, a date, a time, a UUID as text: the client's check read that text back
    and sent it, so ``Decimal("1.10")`` was stored as the string "1.10" (sqlite3 refuses a Decimal). The
    client now checks the values it was given, before anything is sent (nothing listens there)."""
    with Client("tcp://127.0.0.1:9", timeout_ms=100, retries=0) as client, pytest.raises(InvalidRequest) as info:
        client.call(kind, body(value))
    assert path in str(info.value) and info.value.code == "bad_request"
    assert "must be null, a bool, an integer in SQLite's 64-bit range, a float, a string or bytes" in str(info.value)


class Colour(enum.IntEnum):
    RED = 1


class Word(enum.StrEnum):
    HELLO = "hello"


def test_what_the_client_sends_as_the_value_it_is_passes_its_check() -> None:
    """Enum members of int or str (msgspec sends their values), and a bytearray or memoryview (bytes)."""
    row = {"a": Colour.RED, "b": Word.HELLO, "c": bytearray(b"\x00"), "d": memoryview(b"\xff"), "e": True}
    message = Message("transact", "r1", {"ops": [{"op": "write", "table": "t", "row": row}]})
    sent = messages.decode(messages.encode(message, check=True)).body.ops[0].row
    assert sent == {"a": 1, "b": "hello", "c": b"\x00", "d": b"\xff", "e": True}


def test_poison_entry_a_table_differing_only_in_case_is_refused_before_it_is_logged(node) -> None:
    with node.client() as client:
        tail_before = client.rlog_tail("default", 100)
        with pytest.raises(RemoteError) as info:
            client.create_table("KNOWN", "id", [("id", "TEXT")])
        assert info.value.code == "table_exists" and "'known'" in str(info.value)
        for reserved in ("sqlite_stat9", "_mnesite_x"):
            with pytest.raises(RemoteError, match="is reserved"):
                client.create_table(reserved, "id", [("id", "TEXT")])
        assert client.rlog_tail("default", 100) == tail_before, "nothing was logged"
        assert client.put("known", {"id": 3, "name": "serving"})


def test_a_refused_create_table_in_a_new_shard_leaves_no_shard_behind(node) -> None:
    # Found by tests/fuzz: the shard used to be opened before the name was found taken.
    with node.client() as client:
        with pytest.raises(RemoteError) as info:
            client.create_table("known", "id", [("id", "TEXT")], shard="elsewhere")
        assert info.value.code == "table_exists"
        assert set(client.status()["shards"]) == {"default"}


def test_a_committed_entry_that_cannot_be_apply_stops_the_node_naming_the_entry(tmp_path: Path) -> None:
    from mnesite.rlog.store import EntryApplyError, Store
    from mnesite.rlog.types import CreateTableOp, make_entry

    store = Store(str(tmp_path / "db"))
    try:
        with store.write_transaction():
            store.ensure_shard("default", 0)
            store.apply_ops((CreateTableOp("known", "default", "id", (("id", "TEXT"),)),))
            position = store.shard("default")
            poison = make_entry(
                "default",
                TxKey(1, 1),
                position.applied,
                position.digest,
                (CreateTableOp("KNOWN", "default", "id", (("id", "INTEGER"),)),),
                "poison",
            )
            store.append_entries((poison,), 0, chain_verified=True)
            with pytest.raises(EntryApplyError, match=r"committed entry \(1, 1\) \(request 'poison'\)"):
                store.apply_committed("default", TxKey(1, 1))
    except EntryApplyError:
        pass
    finally:
        store.close()


# -- consensus: the receiver's state decides ----------------------------------------------------


def test_a_vote_request_with_generation_2_63_minus_1_is_a_protocol_violation() -> None:
    harness = Harness()
    effects = harness.receive("b", VoteRequest(2**63 - 1, TxKey(2**63 - 1, 1)))
    assert of_type(effects, ProtocolViolation) and not of_type(effects, PersistState)
    assert harness.machine.generation == 0
    jump = harness.machine.config.generation_jump_max
    assert of_type(harness.receive("b", VoteRequest(jump + 1, ZERO_KEY)), ProtocolViolation)
    # Within the bound it is an ordinary (pre-vote, sticky) vote request, not a violation.
    assert not of_type(harness.receive("b", VoteRequest(jump, ZERO_KEY)), ProtocolViolation)
    assert harness.machine.generation <= jump <= GENERATION_MAX


def test_an_append_request_from_a_second_sequencer_of_the_generation_is_ignored() -> None:
    harness = Harness()
    harness.elect()
    generation = harness.machine.generation
    effects = harness.receive("b", append(generation, None, chain([TxKey(generation, 1)])))
    assert of_type(effects, ProtocolViolation)
    assert harness.machine.role is Role.SEQUENCER and harness.machine.generation == generation
    # A follower of b in that generation ignores a third core claiming the same generation.
    follower = Harness()
    follower.receive("b", append(1, None, chain([TxKey(1, 1)])))
    assert follower.machine.sequencer == "b"
    effects = follower.receive("c", append(1, None, chain([TxKey(1, 1)])))
    assert of_type(effects, ProtocolViolation) and follower.machine.sequencer == "b"


def test_an_append_reply_acknowledging_past_what_was_sent_is_ignored() -> None:
    harness = Harness()
    harness.elect()
    generation = harness.machine.generation
    beyond = TxKey(generation, 99)
    effects = harness.receive("b", AppendReply(generation, True, beyond, beyond, ZERO_KEY))
    assert of_type(effects, ProtocolViolation)
    assert harness.machine.committed_key == ZERO_KEY and harness.machine.role is Role.SEQUENCER


def test_a_peer_message_decodes_to_frozen_fields_and_nothing_unbounded() -> None:
    message = messages.decode(raw_frame("push_ack", {"shard": "default", "agent": "a1", "applied": [1, 2]}))
    assert message.body.applied == TxKey(1, 2)
    with pytest.raises(AttributeError):
        message.body.applied = TxKey(0, 0)  # type: ignore[misc]
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert "nested deeper" in messages.free_value_refusal(deep, 8)
    with pytest.raises(MessageError):
        messages.decode(raw_frame("reply", {"result": nested(100_000)}))


# -- the data directory ---------------------------------------------------------------------------


def test_a_second_node_on_a_data_directory_refuses_to_start_and_files_are_private(tmp_path: Path) -> None:
    import stat

    from mnesite.rlog.data_dir import DataDirectoryInUse

    first = ThreadNode(tmp_path / "data")
    try:
        with pytest.raises(DataDirectoryInUse, match=r"in use by node core1 \(pid \d+\)"):
            ThreadNode(tmp_path / "data")
        with first.client() as client:
            client.create_table("t", "id", [("id", "INTEGER")])
            client.put("t", {"id": 1})
        assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700
        for path in (tmp_path / "data").iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        first.stop()
    ThreadNode(tmp_path / "data").stop()  # the lock goes with its node


def test_a_database_file_the_node_refuses_keeps_its_mode(tmp_path: Path) -> None:
    """Regression: the data directory's lock (``DataDirectoryLock.acquire``) narrowed an existing
    database file (and its -wal and -shm) to 0600 before ``Store`` opened it, so another application's
    SQLite file, or a file that is no database, at the node's path had its mode changed and was then
    refused ("not a mnesite database"). A refused file is left as it was, mode included; a mnesite
    database is narrowed to 0600 once it is known to be one, before its WAL is opened."""
    import stat

    import apsw
    from mnesite.rlog.data_dir import DataDirectoryLock
    from mnesite.rlog.store import StoreError

    data = tmp_path / "data"
    data.mkdir()
    database = data / "mnesite.db"

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    def write_foreign() -> None:
        connection = apsw.Connection(str(database))
        connection.execute("CREATE TABLE invoices(id INTEGER PRIMARY KEY)")
        connection.close()

    for make in (write_foreign, lambda: database.write_bytes(b"not a database, " * 64)):
        make()
        database.chmod(0o644)
        before = database.read_bytes()
        with pytest.raises(StoreError, match="not a mnesite database"):
            DataDirectoryLock.acquire_and_open(str(data), "core1", str(database), "FULL")
        assert mode(database) == 0o644, "a refused file keeps its mode"
        assert database.read_bytes() == before
        database.unlink()
    store, lock = DataDirectoryLock.acquire_and_open(str(data), "core1", str(database), "FULL")
    store.close()
    lock.release()
    for path in (database, data / "mnesite.db-wal", data / "mnesite.db-shm"):
        if path.exists():
            path.chmod(0o644)
    store, lock = DataDirectoryLock.acquire_and_open(str(data), "core1", str(database), "FULL")
    try:
        with store.write_transaction():
            store.ensure_shard("default", 0)
        for path in (database, data / "mnesite.db-wal", data / "mnesite.db-shm"):
            assert mode(path) == 0o600, path
    finally:
        store.close()
        lock.release()


def test_a_database_file_whose_mode_cannot_be_narrowed_is_named_and_its_connection_closed(
    tmp_path: Path, monkeypatch
) -> None:
    """Regression: a ``chmod`` of the database (or its -wal, -shm) that failed (``EPERM``: a file
    another user owns) left ``Store`` with its ``OSError`` as it was ("Operation not permitted", no
    word of narrowing) and its SQLite connection open until garbage collection. It is a
    ``StoreError`` now that names the file and the mode it could not be given, and the connection is
    closed before it leaves."""
    import errno
    import os

    import apsw
    from mnesite.rlog.store import Store, StoreError

    database = tmp_path / "mnesite.db"
    Store(str(database)).close()
    real_chmod = os.chmod

    def chmod(path, mode, *args, **kwargs):
        if str(path) == f"{database}-wal":
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_chmod(path, mode, *args, **kwargs)

    (tmp_path / "mnesite.db-wal").write_bytes(b"")  # as another process's open left it
    monkeypatch.setattr(os, "chmod", chmod)
    before = {id(connection) for connection in apsw.connections()}
    with pytest.raises(StoreError) as raised:
        Store(str(database), file_mode=0o600)
    said = str(raised.value)
    assert f"{database}-wal" in said and "0o600" in said and "Operation not permitted" in said, said
    left = [c for c in apsw.connections() if id(c) not in before and c.filename == str(database)]
    assert left == [], "the store's connection is closed before its error leaves"


def test_a_node_that_fails_to_open_its_data_directory_leaves_it_unlocked(tmp_path: Path) -> None:
    # A start that fails after the lock was taken (the database is not mnesite's, or cannot even be
    # opened) must give the lock back: a process that goes on (a test, an embedding program, a
    # restore that failed) would otherwise find its own directory "in use" by itself until it exits.
    from mnesite.rlog.data_dir import DataDirectoryLock
    from mnesite.rlog.store import StoreError

    data = tmp_path / "data"
    data.mkdir()
    (data / "mnesite.db").write_bytes(b"not a database, " * 64)
    with pytest.raises(StoreError, match="not a mnesite database"):
        ThreadNode(data)
    (data / "mnesite.db").unlink()
    (data / "mnesite.db").mkdir()  # the lock is taken, then the database file cannot be opened
    with pytest.raises(IsADirectoryError):
        DataDirectoryLock.acquire(str(data), "core1", str(data / "mnesite.db"))
    (data / "mnesite.db").rmdir()
    ThreadNode(data).stop()


def test_a_node_that_cannot_bind_its_endpoint_closes_what_it_opened(tmp_path: Path) -> None:
    # A bind that fails (the port is taken) left the node's store, data directory lock, zmq context
    # and socket open: the process that goes on could not start a node on that directory again.
    from mnesite.core.node import CoreNode

    taken = zmq.Context.instance().socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        node = CoreNode(node_config(tmp_path / "data", port))
        with pytest.raises(zmq.ZMQError):
            node.bind()
        assert node.context is None and node.socket is None
    finally:
        taken.close(0)
    ThreadNode(tmp_path / "data").stop()


def test_a_node_whose_store_fails_to_close_still_unlocks_its_data_directory(tmp_path: Path) -> None:
    # close() released the data directory's lock after store.close(): a store that raised there (a
    # disk error at the last checkpoint) kept the directory locked by this process until it exited.
    from mnesite.core.node import CoreNode
    from mnesite.rlog.data_dir import DataDirectoryLock

    node = CoreNode(node_config(tmp_path / "data", free_port()))
    node.bind()
    store_close = node.store.close

    def failing_close() -> None:
        store_close()
        raise OSError("disk I/O error at the last checkpoint")

    node.store.close = failing_close
    with pytest.raises(OSError, match="disk I/O error"):
        node.close()
    assert node.context is None
    DataDirectoryLock.acquire(str(tmp_path / "data"), "core1").release()


def test_a_replicant_that_cannot_make_its_dealers_closes_what_it_opened(tmp_path: Path, monkeypatch) -> None:
    # ReplicantNode.bind makes a dealer per core after the base bind (ROUTER, zmq context, metrics);
    # one that could not be made raised and left them, the store and the data directory's lock open.
    from mnesite.replicant.node import ReplicantNode
    from mnesite.rlog.config import parse_config
    from mnesite.rlog.data_dir import DataDirectoryLock

    config = parse_config(
        {
            "node": {"name": "replicant1", "role": "replicant", "data_dir": str(tmp_path / "data"),
                     "listen": f"tcp://127.0.0.1:{free_port()}"},
            "cluster": {"core_nodes": {"core1": f"tcp://127.0.0.1:{free_port()}"}},
        }
    )  # fmt: skip
    node = ReplicantNode(config)
    monkeypatch.setattr(node, "dealer", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="no socket for core core1"):
        node.bind()
    assert node.context is None and node.socket is None
    DataDirectoryLock.acquire(str(tmp_path / "data"), "replicant1").release()


@pytest.mark.slow
def test_a_second_process_on_a_data_directory_refuses_with_one_clear_line(tmp_path: Path, node_processes) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO, free_port, start_core_process

    _, endpoint, config = start_core_process(tmp_path, node_processes, data_dir="data")
    port = int(endpoint.rsplit(":", 1)[1])
    second = tmp_path / "second.toml"
    second.write_text(config.read_text().replace(str(port), str(free_port())).replace('"core1"', '"core9"', 1))
    result = subprocess.run(
        [sys.executable, "-m", "mnesite.cli", "start", "--config", str(second)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("Error: data directory "), result.stderr
    assert "in use by node core1" in result.stderr and "Traceback" not in result.stderr
    with Client(f"tcp://127.0.0.1:{port}", timeout_ms=2000) as client:
        assert client.status()["node"] == "core1", "the first node keeps serving"


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "stdin", "expected"),
    [
        (["put", "t", '{"id": 99999999999999999999}'], None, "Error: not sent: transact.ops[0].row.id: integer is"),
        (["tx", "-"], '{"ops": 5}', "Error: not sent: transact.ops: Expected `array`, got `int`"),
        (["get"], None, "Error: Missing argument 'TABLE'. (see 'mnesite get --help')"),
        (["--bogus"], None, "Error: No such option '--bogus'. (see 'mnesite --help')"),
        (["scan", "t", "--limit", "x"], None, "Error: Invalid value for '--limit'"),
    ],
)
def test_the_cli_answers_one_error_line_and_exit_1_never_a_traceback(arguments, stdin, expected) -> None:
    from click.testing import CliRunner
    from mnesite.cli.main import main

    from tests.conftest import free_port

    node = ["--node", f"tcp://127.0.0.1:{free_port()}", "--timeout-ms", "200"] if arguments[0] in ("put", "tx") else []
    result = CliRunner().invoke(main, arguments + node, input=stdin, prog_name="mnesite")
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1 and result.output.startswith(expected), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["compare", "a", "b", "--sample", "-1"], "Error: Invalid value for '--sample'"),
        (["compare", "a", "b", "--bogus"], "Error: No such option '--bogus'"),
        (["compare", "a", "b", "--timeout-ms", "x"], "Error: Invalid value for '--timeout-ms'"),
    ],
)
def test_compare_usage_errors_exit_2_could_not_compare_not_1_diverged(arguments, expected) -> None:
    """``mnesite compare`` exits 0 equal, 1 diverged, 2 could not compare: a mistyped option went through
    the group's usage-error path, which exits 1, and a script read "the replicas diverged"."""
    from click.testing import CliRunner
    from mnesite.cli.main import main

    result = CliRunner().invoke(main, arguments, prog_name="mnesite")
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and result.output.startswith(expected), result.output


# -- bounded watches -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_thousand_watches_to_dead_endpoints_cost_little_and_a_real_replicant_still_gets_pushes(
    tmp_path: Path, node_processes
) -> None:
    from tests.conftest import Cluster, free_port, wait_until
    from tests.fuzz.runner import rss_kb

    cluster = Cluster(tmp_path, node_processes, size=1, secure=False)  # raw zmq watches, no CurveZMQ
    cluster.start_all()
    with cluster.client("core1", timeout_ms=10_000) as client:
        client.create_table("known", "id", [("id", "INTEGER"), ("name", "TEXT")])
        for key in range(200):
            client.put("known", {"id": key, "name": "x" * 500})
        digest = bytes.fromhex(client.status()["shards"]["default"]["digest"])
    pid = cluster.nodes["core1"].process.pid
    rss_before_kb = rss_kb(pid)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(cluster.endpoints["core1"])
    answers = 0
    try:
        for index in range(1000):
            body = {
                "shard": "default",
                "replicant": f"ghost{index}",
                "endpoint": f"tcp://127.0.0.1:{free_port()}",  # nobody listens there
                "from": [0, 0],
                "from_digest": digest,
                "protocol": 1,
            }
            socket.send(messages.encode(Message("watch", f"w{index}", body)))
            if socket.poll(5000):
                socket.recv()
                answers += 1
    finally:
        socket.close(0)
    assert answers == 1000
    status = cluster.status("core1")
    watches_max = 256
    assert len(status["agents"]) <= watches_max
    rss_after_kb = rss_kb(pid)
    grown_mb = (rss_after_kb - rss_before_kb) / 1024
    print(f"\n1,000 dead watches: core RSS {rss_before_kb // 1024} -> {rss_after_kb // 1024} MB (+{grown_mb:.1f} MB)")
    assert grown_mb < 50
    cluster.add_replicant("replicant1")
    cluster.start("replicant1")
    wait_until(
        lambda: ((cluster.status("replicant1") or {}).get("shards", {}).get("default") or {}).get("mode") == "normal",
        120,
        "the real replicant to reach normal mode",
        interval_s=0.2,
    )
    with cluster.client("core1") as client:
        tx_key = client.put("known", {"id": 999, "name": "after the ghosts"})
    wait_until(
        lambda: tuple(cluster.status("replicant1")["shards"]["default"]["applied"]) >= tuple(tx_key),
        60,
        "the replicant to get the push of a new write",
        interval_s=0.2,
    )
    with cluster.client("replicant1") as client:
        assert client.get("known", 999) == {"id": 999, "name": "after the ghosts"}


# -- bounds inside the node ------------------------------------------------------------------------


def test_requests_outstanding_per_connection_are_bounded_and_released_by_the_answer(tmp_path: Path) -> None:
    from mnesite.rlog.server import OverloadedError

    thread_node = ThreadNode(tmp_path / "data", extra={"limits": {"requests_outstanding_max": 2}})
    thread_node.stop()  # the accounting only: no thread may touch the node meanwhile
    node = thread_node.node
    envelope = [b"client-a"]
    node.hold(envelope, "r1")
    node.hold(envelope, "r2")
    node.hold(envelope, "r2")  # the same request again (a retry) takes no second place
    with pytest.raises(OverloadedError, match="requests_outstanding_max 2"):
        node.hold(envelope, "r3")
    node.hold([b"client-b"], "r3")  # another connection has its own bound
    node.reply(envelope, messages.reply("r1", None))
    node.hold(envelope, "r3")
    assert set(node.outstanding[b"client-a"]) == {"r2", "r3"}


def test_connections_with_requests_waiting_are_bounded_node_wide_and_given_back(tmp_path: Path) -> None:
    """Regression: ``requests_outstanding_max`` bounded the requests of one connection, and the node kept
    a table of waiting requests for every connection that had one, however many connected. Past
    ``connections_waiting_max`` connections with requests waiting, a request of another connection that
    would wait is refused ``overloaded`` (counted in ``status``); a connection's entry goes once
    nothing of it waits, which gives its place back."""
    from mnesite.rlog.server import OverloadedError

    from tests.conftest import core_with_table

    with core_with_table(tmp_path / "data", {"limits": {"connections_waiting_max": 2}}) as node:
        node.hold([b"a"], "r1")
        node.hold([b"b"], "r1")
        with pytest.raises(OverloadedError, match="connections_waiting_max 2"):
            node.hold([b"c"], "r1")
        assert b"c" not in node.outstanding
        node.hold([b"a"], "r2")  # a connection with requests waiting already is not refused
        node.reply([b"a"], messages.reply("r1", None))
        node.reply([b"a"], messages.reply("r2", None))
        assert b"a" not in node.outstanding  # nothing of it waits: its place is given back
        node.hold([b"c"], "r1")
        waiting = {"waiting": 2, "waiting_max": 2, "refused": 1, "refused_unread": 0}
        assert {key: node.status()["connections"][key] for key in waiting} == waiting


def _write_frame(request_id: str, row_id: int, forwarded: bool = False) -> bytes:
    body = {"ops": [{"op": "write", "table": "t", "row": {"id": row_id}}], "forwarded": forwarded}
    return messages.encode(Message("transact", request_id, messages.typed_body("transact", body)))


def answers_of_turns(node, envelopes: set[bytes], turns_max: int = 20) -> dict[bytes, Message]:
    """The first answer each connection of ``envelopes`` gets, turning the node (not served) by hand."""
    answers: dict[bytes, Message] = {}
    node._send_queued = lambda socket, to, message: answers.setdefault(to[0], message)
    for _ in range(turns_max):
        node.turn()
        if envelopes <= set(answers):
            break
    return answers


def test_a_flood_of_client_connections_leaves_room_for_a_peer_cores_forwarded_write(tmp_path: Path) -> None:
    """Regression: a sequencer counted the connections of the cores that forward their clients' writes
    to it against ``connections_waiting_max``, as client connections: a flood of clients with requests
    waiting there had every forwarded write refused ``overloaded``. A peer's connection (without
    [security], a request another core marked forwarded) has ``PEER_CONNECTIONS_RESERVED`` more places;
    a client's is refused at the bound as before."""
    from tests.conftest import core_with_table

    with core_with_table(tmp_path / "data", {"limits": {"connections_waiting_max": 2}}) as node:
        node.hold([b"a"], "r1")
        node.hold([b"b"], "r1")
        node._backlog.append(([b"core2"], _write_frame("forwarded-1", 1, forwarded=True), ""))
        node._backlog.append(([b"client"], _write_frame("client-1", 2), ""))
        answers = answers_of_turns(node, {b"core2", b"client"})
    assert answers[b"client"].kind == "error" and answers[b"client"].body.code == "overloaded", answers
    assert answers[b"core2"].kind == "reply", answers


def test_a_peers_forwarding_connection_holds_as_many_writes_as_a_follower_forwards(tmp_path: Path) -> None:
    """Regression: ``requests_outstanding_max`` (1000 by default) bounded a peer's connection as a
    client's, while a follower core forwards up to ``FORWARDED_MAX`` (10,000) of its clients' writes
    over its one connection to the sequencer: past the bound the sequencer refused them ``overloaded``.
    A peer's connection (without [security], a request another core marked forwarded) holds at least
    ``PEER_REQUESTS_OUTSTANDING_MIN``; a client's is refused at the configured bound as before."""
    from mnesite.core.node import FORWARDED_MAX
    from mnesite.rlog.roles import PEER_REQUESTS_OUTSTANDING_MIN

    from tests.conftest import core_with_table

    assert FORWARDED_MAX <= PEER_REQUESTS_OUTSTANDING_MIN
    writes = 5
    with core_with_table(tmp_path / "data", {"limits": {"requests_outstanding_max": 2}}) as node:
        for number in range(writes):  # in one turn: each waits for the turn's commit
            node._backlog.append(([b"core2"], _write_frame(f"f{number}", number, forwarded=True), ""))
            node._backlog.append(([b"client"], _write_frame(f"c{number}", 100 + number), ""))
        answers: dict[str, Message] = {}
        node._send_queued = lambda socket, to, message: answers.setdefault(message.request_id, message)
        for _ in range(20):
            node.turn()
            if len(answers) == 2 * writes:
                break
    codes = {request_id: answer.body.code if answer.kind == "error" else "ok" for request_id, answer in answers.items()}
    assert [codes.get(f"f{number}") for number in range(writes)] == ["ok"] * writes, codes
    assert [codes.get(f"c{number}") for number in range(writes)] == ["ok", "ok"] + ["overloaded"] * 3, codes


def test_a_proposed_write_past_requests_outstanding_max_is_never_answered_overloaded(tmp_path: Path) -> None:
    # "overloaded" means "refused, nothing changed" (rlog.errors). A connection past its bound whose
    # write was admitted and proposed in the same turn (it commits) was nevertheless answered
    # "overloaded" when the node went to hold it for its commit: its client took it for not written.
    thread_node = ThreadNode(tmp_path / "data", extra={"limits": {"requests_outstanding_max": 1}})
    node = thread_node.node
    # The node's loop is parked between turns while a burst is sent, so that the burst is read in one
    # turn: sent to a running loop (it shares this process's GIL), each write could be read, committed
    # and answered before the next arrived, and the bound never met (a CI run of 2026-12-02).
    parked, release = threading.Event(), threading.Event()
    release.set()
    turn = node.turn

    def gated_turn() -> None:
        if not release.is_set():
            parked.set()
            if not release.wait(10):
                raise AssertionError("the test never released the node's loop")
        turn()

    node.turn = gated_turn
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        with thread_node.client() as client:
            client.create_table("known", "id", [("id", "INTEGER"), ("name", "TEXT")])
        socket.connect(thread_node.endpoint)
        writes, refused = 20, 0
        # A burst is read in one turn unless the loop is released before its second write has reached
        # the node's socket; a few bursts make that certain.
        for burst in range(5):
            release.clear()
            parked.clear()
            node.queries.wake()  # ends the turn waiting in its poll
            assert parked.wait(10), "the node's loop did not reach the end of its turn"
            numbers = range(burst * writes, (burst + 1) * writes)
            for number in numbers:
                body = {"ops": [{"op": "write", "table": "known", "row": {"id": number, "name": "w"}}]}
                socket.send(messages.encode(Message("transact", f"w{number}", body)))
            release.set()
            answers: dict[str, Message] = {}
            while len(answers) < writes:
                assert socket.poll(10_000), f"only {len(answers)} of {writes} writes were answered"
                answer = messages.decode(socket.recv())
                answers[answer.request_id] = answer
            with thread_node.client() as client:
                for number in numbers:
                    answer = answers[f"w{number}"]
                    written = client.get("known", number) is not None
                    if answer.kind == "error" and answer.body.code == "overloaded":
                        assert not written, f"write {number} was answered overloaded but applied"
                        refused += 1
                    elif answer.kind == "reply":
                        assert written
                    else:  # the bound may also be met after proposing (a re-send of a logged write)
                        assert answer.body.code == "outcome_unknown", answer
            if refused:
                break
        assert refused, "the bound was never reached: the test did not test it"
    finally:
        release.set()
        socket.close(0)
        thread_node.stop()


def test_a_resend_of_a_logged_write_past_requests_outstanding_max_is_told_outcome_unknown(tmp_path: Path) -> None:
    # A re-send whose entry is in the log, not yet applied, waits for its commit: past the connection's
    # bound it cannot wait, and "overloaded" would say it changed nothing (the entry may commit).
    thread_node = ThreadNode(tmp_path / "data", extra={"limits": {"requests_outstanding_max": 1}})
    with thread_node.client() as client:
        client.create_table("known", "id", [("id", "INTEGER")])
    thread_node.stop()  # the accounting only: no thread may touch the node meanwhile
    from mnesite.rlog.store import Store

    node = thread_node.node
    node.store = Store(node.config.database_path)  # closed with its node; one for this thread
    envelope = [b"client-a"]
    node.hold(envelope, "another")
    try:
        node._await_commit(node.shards["default"], TxKey(99, 1), envelope, "resent", duplicate=True)
    finally:
        node.store.close()
    answers = [message for _socket, to, message in node._outbox if to == envelope]
    assert [(answer.request_id, answer.body.code) for answer in answers] == [("resent", "outcome_unknown")]
    assert set(node.outstanding[b"client-a"]) == {"another"}


def test_status_counts_the_rlog_at_most_once_a_second(tmp_path: Path, monkeypatch) -> None:
    from mnesite.rlog.store import Store

    thread_node = ThreadNode(tmp_path / "data")
    with thread_node.client() as client:
        client.create_table("t", "id", [("id", "INTEGER")])
    thread_node.stop()  # closed its store; reopen one for this thread
    node = thread_node.node
    node.store = Store(node.config.database_path)
    now = [1_000_000]
    node.clock_ms = lambda: now[0]
    counted: list[str] = []
    monkeypatch.setattr(node.store, "rlog_statistics", lambda shard: counted.append(shard) or {"entries": 0})
    try:
        for _ in range(100):
            node.status()
        assert counted == ["default"]
        now[0] += 1000
        node.status()
        assert counted == ["default", "default"]
    finally:
        node.store.close()


def test_a_scan_page_above_the_frame_limit_is_too_large_not_silence_and_scan_pages_smaller(tmp_path: Path) -> None:
    thread_node = ThreadNode(tmp_path / "data", extra={"limits": {"frame_bytes_max": 64 * 1024}})
    try:
        with thread_node.client(timeout_ms=5000) as client:
            client.create_table("big", "id", [("id", "INTEGER"), ("text", "TEXT")])
            for key in range(20):
                client.put("big", {"id": key, "text": "x" * 10_000})
            with pytest.raises(RemoteError) as info:
                client.scan_page("big", limit=20)
            assert info.value.code == "too_large" and "frame_bytes_max" in str(info.value)
            assert [row["id"] for row in client.scan("big", page_rows=20)] == list(range(20))
            with pytest.raises(InvalidRequest) as refused:
                Client(thread_node.endpoint, frame_bytes_max=64 * 1024).put("big", {"id": 99, "text": "y" * 70_000})
            assert refused.value.code == "too_large"
    finally:
        thread_node.stop()


def test_generation_recovery_after_a_lost_disk_ignores_malformed_peer_journals(tmp_path: Path, monkeypatch) -> None:
    """A core with an empty database learns the generations in use from its peers' journal answers;
    a peer's answer is untrusted: a malformed generation drops that answer, a hostile shard name is
    skipped, and nothing crashes."""
    import contextlib

    from mnesite.core.node import CoreNode
    from mnesite.rlog.store import StoreError

    answers = {
        "core2": {"shards": {"default": {"generation": 7}, "a" * 500: {"generation": 9}}},
        "core3": {"shards": {"default": {"generation": 2**64}}},
        "core4": {"shards": {"default": {"generation": 5}, "other": {"generation": 3}}},
    }

    class PeerJournal:
        def __init__(self, peer: str) -> None:
            self.peer = peer

        def journal(self) -> dict:
            return answers[self.peer]

    config = node_config(tmp_path / "data", free_port())
    node = CoreNode(config)
    try:
        monkeypatch.setattr(node, "members", ("core1", "core2", "core3", "core4"))
        # The probe asks every core whose endpoint this core knows (config and membership entries).
        monkeypatch.setattr(node, "endpoints", {name: "tcp://127.0.0.1:1" for name in node.members})
        monkeypatch.setattr(node, "peer_client", lambda peer, timeout_ms: contextlib.nullcontext(PeerJournal(peer)))
        # core3's malformed answer counts as not reached, and a rebuilt member hears every other one.
        # Each of its ten rounds lasts the probe's timeout: 50 ms, not the 1 s recovery_timeout_ms.
        with pytest.raises(StoreError, match=r"1 did not: \['core3'\] \(heard \['core2', 'core4'\]\)"):
            node.recover_generations(timeout_ms=50)
        answers["core3"] = {"shards": {"default": {"generation": 2}}}
        assert node.recover_generations() == {"default": 7, "other": 3}
        assert node.store.consensus_state("default")[0] == 7
        assert node.store.consensus_state("other")[0] == 3
    finally:
        node.close()


def test_a_new_core_takes_its_membership_from_its_peers_and_ignores_malformed_ones(tmp_path: Path, monkeypatch):
    """Issue 14: a core added to a running cluster starts with the members its peers report (it is a
    learner outside them), not its config's; a hostile members list or endpoint is ignored."""
    import contextlib

    from mnesite.core.node import CoreNode

    answers = {
        "core2": {
            "shards": {"default": {"generation": 4, "members": ["core1", "core2", "core3"]}},
            "core_nodes": {"core3": "tcp://127.0.0.1:7403", "bad name!": "tcp://127.0.0.1:1", "core5": "no endpoint"},
        },
        "core3": {"shards": {"default": {"generation": 9, "members": ["x" * 500] * 40}}},
    }

    class PeerJournal:
        def __init__(self, peer: str) -> None:
            self.peer = peer

        def journal(self) -> dict:
            return answers[self.peer]

    config = node_config(tmp_path / "data", free_port(), name="core4")
    node = CoreNode(config)
    try:
        monkeypatch.setattr(node, "members", ("core1", "core2", "core3", "core4"))
        monkeypatch.setattr(node, "endpoints", {name: "tcp://127.0.0.1:1" for name in ("core2", "core3")})
        monkeypatch.setattr(node, "peer_client", lambda peer, timeout_ms: contextlib.nullcontext(PeerJournal(peer)))
        assert node.recover_generations() == {"default": 9}
        assert node.store.consensus_state("default")[2] == ("core1", "core2", "core3")
        assert node.members == ("core1", "core2", "core3")
        assert "bad name!" not in node.endpoints and "core5" not in node.endpoints
        node._open_shard("default")
        assert not node.shards["default"].consensus.voter
    finally:
        node.close()


@pytest.mark.parametrize(
    "frame",
    [
        b"\x94\xa3\x00\x00\x80",  # found by test_codec's hypothesis run: a header string, not UTF-8
        b"\x94\x01\xa2\xff\xfe\xa2id\x80",  # the kind
        b"\x94\x01\xa3get\xa2id\x82\xa5table\xa2\x80\x80\xa3key\x01",  # a body field
        b"\x94\x01\xa7changes\xa2id\x81\xa6tables\x91\xa2\xc3\x28",  # a changefeed table name
    ],
)
def test_a_string_that_is_not_utf8_is_a_malformed_frame_and_the_node_keeps_serving(node, frame: bytes) -> None:
    with pytest.raises(MessageError):
        messages.decode(frame)
    answer = raw_call(node.endpoint, frame)
    assert answer is not None and answer.kind == "error" and answer.body.code in ("bad_frame", "bad_request")
    with node.client() as client:
        assert client.get("known", 1) == {"id": 1, "name": "ada"}


def test_entry_ops_holding_a_string_that_is_not_utf8_are_refused() -> None:
    packed = msgpack.packb([["d", "known", 1]], use_bin_type=True).replace(b"known", b"kno\xffn")
    with pytest.raises(messages.MessageError):
        messages.decode_ops(packed)


class _Receiver:
    """What ``NodeServer.receive`` reads of its node: the ROUTER socket, no security, the counters."""

    receive = server.NodeServer.receive
    malformed_frame = server.NodeServer.malformed_frame

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket, self.security, self.metrics = socket, None, None
        self.malformed_frames, self._discarding = 0, False


@contextlib.contextmanager
def _inproc_pair(name: str) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A ROUTER bound to inproc://NAME and a DEALER connected to it, both closed after."""
    context = zmq.Context.instance()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    try:
        router.bind(f"inproc://{name}")
        dealer.connect(f"inproc://{name}")
        yield router, dealer
    finally:
        router.close(0)
        dealer.close(0)


def test_a_message_of_too_many_parts_is_refused_and_read_off_over_several_turns() -> None:
    # zmq bounds each part's size, not their number: the node keeps at most MESSAGE_PARTS_MAX of a
    # message's parts, and reads the rest off at most DISCARD_PARTS_PER_TURN a turn (raising zmq.Again
    # to end the turn's reading), so that its timers keep running; the next message is read intact.
    with _inproc_pair("too-many-parts") as (router, dealer):
        parts = 2 * server.DISCARD_PARTS_PER_TURN + 7
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.send_multipart([b"p"] * parts)
        dealer.send(b"next")
        assert router.poll(5000)
        receiver = _Receiver(router)
        assert receiver.receive() is None and receiver.malformed_frames == 1
        turns = 0
        while True:
            try:
                received = receiver.receive()
            except zmq.Again:
                turns += 1
                assert turns < 10, "the refused message is never read off"
                continue
            break
        # 20,008 parts with the identity, less the MESSAGE_PARTS_MAX read first: two turns of reading off
        assert turns == 2
        assert received is not None and received[1] == b"next" and len(received[0]) == 1
        assert receiver.malformed_frames == 1 and not receiver._discarding


def test_a_message_whose_envelope_part_is_longer_than_a_routing_id_is_refused() -> None:
    # The backlog of frames left for later turns is bounded in bytes by the frames it holds, and an
    # answer echoes the request's envelope: a part before the frame larger than any routing id (zmq's
    # are at most 255 bytes) would be held uncounted and sent back. Such a message is refused unanswered.
    with _inproc_pair("large-envelope") as (router, dealer):
        frame = raw_frame("get", {"table": "known", "key": 1})
        dealer.send_multipart([b"h" * (server.ENVELOPE_PART_BYTES_MAX + 1), frame])
        dealer.send_multipart([b"h" * server.ENVELOPE_PART_BYTES_MAX, frame])  # a proxy's hop: kept
        assert router.poll(5000)
        receiver = _Receiver(router)
        assert receiver.receive() is None and receiver.malformed_frames == 1
        assert router.poll(5000)
        received = receiver.receive()
        assert received is not None and received[1] == frame and len(received[0]) == 2
        assert receiver.malformed_frames == 1


def test_the_request_id_of_a_refused_frame_is_read_without_decoding_its_body() -> None:
    # A frame the loop refuses unread (too large, malformed, a full backlog) is answered with its
    # request id. Reading it unpacked the whole frame into Python objects: a frame of up to 4x
    # frame_bytes_max cost the loop about 70 ms per MB and ten times its size in memory, which is what
    # a refusal (overload, a hostile client) must not cost. Only the header is decoded now.
    import tracemalloc

    body = {"ops": [{"op": "write", "table": "t", "row": {"id": number, "v": "x"}} for number in range(60_000)]}
    frame = msgpack.packb([1, "transact", "the-id", body])
    assert len(frame) > 1_000_000
    tracemalloc.start()
    try:
        assert server.request_id_of(frame) == "the-id"
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 100_000, f"{peak_bytes} bytes allocated to read a request id"
    assert server.request_id_of(msgpack.packb([1, "transact", "x" * 65, {}])) == "?"
    assert server.request_id_of(msgpack.packb([1, "transact", 7, {}])) == "?"
    assert server.request_id_of(b"\x94\x01") == "?"
    assert server.request_id_of(msgpack.packb([1, "transact", "three items"])) == "?"
    assert server.request_id_of(raw_frame("get", {"table": nested(100_000)})) in ("hostile", "?")


def test_a_node_sent_a_message_of_200k_parts_keeps_serving_and_changes_nothing(node) -> None:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.connect(node.endpoint)
    try:
        with node.client(timeout_ms=10_000) as client:
            socket.send_multipart([raw_frame("get", {"table": "known", "key": 1})] * 200_000)
            wait_until(lambda: node.node.malformed_frames == 1, 30, "the node refuses the 200k-part message")
            assert client.put("known", {"id": 2, "name": "still serving"}) > TxKey(0, 0)
            assert client.get("known", 2) == {"id": 2, "name": "still serving"}
            assert client.get("known", 1) == {"id": 1, "name": "ada"}
        assert node.node.malformed_frames == 1 and not node.node._discarding  # read off whole, refused once
        assert not socket.poll(200), "a part of the refused message was answered"
    finally:
        socket.close(0)
    assert node.thread.is_alive()


def test_a_rebuilt_core_persists_its_vote_floor_and_its_consensus_judges_candidates_by_it(tmp_path: Path, monkeypatch):
    """A core on an empty database lost the entries it held; the highest log key its peers report
    stands in for them when it votes (``core.recovery.recovered_vote_floors``), across a restart."""
    from mnesite.core.consensus import MessageReceived, VoteRequest
    from mnesite.core.node import CoreNode
    from mnesite.core.recovery import well_formed_answers
    from mnesite.rlog.types import TxKey

    answers = {
        "core2": {"shards": {"default": {"generation": 4, "committed": [4, 10], "last": [4, 12]}}},
        "core3": {"shards": {"default": {"generation": 4, "committed": [4, 9], "last": [4, 9]}}},
    }
    config = node_config(tmp_path / "data", free_port())
    node = CoreNode(config)
    try:
        monkeypatch.setattr(node, "members", ("core1", "core2", "core3"))
        # What ``probe_peers`` makes of the peers' answers (asking each over its own client).
        monkeypatch.setattr(node, "probe_peers", lambda timeout_ms: well_formed_answers(answers))
        assert node.recover_generations() == {"default": 4}
    finally:
        node.close()
    restarted = CoreNode(config)  # the floor is on disk, read when the shard's machine is built
    try:
        consensus = restarted.shards["default"].consensus
        assert consensus.persisted_state().vote_floor == TxKey(4, 12)
        assert restarted.status()["shards"]["default"]["vote_floor"] == [4, 12]  # `mnesite status` shows it
        later = restarted.clock_ms() + 60_000  # past the quiet time after a start
        refused = consensus.step(MessageReceived("core3", VoteRequest(5, TxKey(4, 9))), later)
        granted = consensus.step(MessageReceived("core2", VoteRequest(6, TxKey(4, 12))), later)
        assert [effect.message.granted for effect in refused if hasattr(effect, "message")] == [False]
        assert [effect.message.granted for effect in granted if hasattr(effect, "message")] == [True]
    finally:
        restarted.close()


def test_a_rebuilt_core_waits_for_enough_peers_and_gives_up_with_a_clear_error(tmp_path: Path, monkeypatch):
    """With one of its two peers answering, a rebuilt member of three cores cannot know that its floor
    covers every committed entry (the silent one may be the only other holder): it asks again, starts
    once both answered, and gives up with a clear error after RECOVERY_ROUNDS_MAX rounds."""
    from mnesite.core import node as node_module
    from mnesite.core.node import CoreNode
    from mnesite.rlog.store import StoreError
    from mnesite.rlog.types import TxKey

    history = {"generation": 4, "committed": [4, 10], "last": [4, 12], "members": ["core1", "core2", "core3"]}
    rounds = []

    def probe(timeout_ms: int) -> dict:
        rounds.append(timeout_ms)
        answers = {"core2": {"shards": {"default": history}}}
        if len(rounds) >= 3:
            answers["core3"] = {"shards": {"default": {**history, "last": [4, 10]}}}
        return answers

    config = node_config(tmp_path / "data", free_port())
    node = CoreNode(config)
    try:
        monkeypatch.setattr(node, "probe_peers", probe)
        assert node.recover_generations(timeout_ms=10) == {"default": 4} and len(rounds) == 3
        assert node._vote_floor("default") == TxKey(4, 12)
        monkeypatch.setattr(node, "probe_peers", lambda timeout_ms: {"core2": {"shards": {"default": history}}})
        with pytest.raises(StoreError, match=r"1 did not: \['core3'\]"):
            node.recover_generations(timeout_ms=10)
    finally:
        node.close()
    assert node_module.RECOVERY_ROUNDS_MAX >= 2


def test_a_rebuilt_core_names_the_members_that_refused_its_key_or_were_full_when_it_gives_up(
    tmp_path: Path, monkeypatch, caplog
):
    """A core declared ``existing`` whose key a member does not authorize yet gave up saying only that
    the member did not answer: its probe's client knew the member refused its key (or held its
    connections_max). The rounds' warnings, ``status``'s reason and the final error now say which
    refused what, and what to do; a member merely silent is named as before."""
    from mnesite.core.node import CoreNode
    from mnesite.core.recovery import recovery_answer
    from mnesite.rlog.client import Unauthenticated, Unavailable
    from mnesite.rlog.errors import REFUSED_FULL, REFUSED_KEY
    from mnesite.rlog.store import StoreError

    port = free_port()
    cores = {"core1": f"tcp://127.0.0.1:{port}", **{f"core{n}": f"tcp://127.0.0.1:{free_port()}" for n in (2, 3, 4)}}
    config = node_config(tmp_path / "data", port, extra={"cluster": {"core_nodes": cores}})
    config = dataclasses.replace(config, initial_cluster_state="existing")
    monkeypatch.setattr(CoreNode, "recover_generations", lambda self, timeout_ms=None: {})  # at construction
    node = CoreNode(config)
    monkeypatch.undo()

    def refusing_client(peer: str, timeout_ms: int):
        errors = {
            "core2": Unauthenticated("node core2 refused this client's key"),
            "core3": Unavailable("node core3 refused the connection"),
            "core4": Unavailable("node core4 did not answer"),
        }
        errors["core2"].refused, errors["core3"].refused = REFUSED_KEY, REFUSED_FULL

        class Refused:
            def __enter__(self):
                raise errors[peer]

            def __exit__(self, *exc_info) -> None:
                return None

        return Refused()

    reasons = []
    probe = node.probe_peers

    def probe_and_look(timeout_ms: int) -> dict:
        answers = probe(timeout_ms)
        reasons.append(recovery_answer(node.recovery, 0).reason)
        return answers

    monkeypatch.setattr(node, "peer_client", refusing_client)
    monkeypatch.setattr(node, "probe_peers", probe_and_look)
    key_note = (
        "core2 refused this core's key: authorize it there (copy the public key file of core1's [security] "
        "client_key into core2's authorized_keys) and send core2 SIGHUP"
    )
    full_note = "core3 refused this core's connection: it holds its [limits] connections_max connections"
    try:
        with caplog.at_level(logging.WARNING, logger="mnesite"), pytest.raises(StoreError) as gave_up:
            node.recover_generations(timeout_ms=10)
    finally:
        node.close()
    message = str(gave_up.value)
    assert "3 did not: ['core2', 'core3', 'core4'] (heard [])" in message
    assert f"; {key_note}; {full_note}; start it again" in message
    assert key_note in reasons[0] and full_note in reasons[0] and "core4 refused" not in reasons[0]
    assert f"(answers from []); {key_note}; {full_note}; asking again (1 of" in caplog.text


def test_a_restored_core_at_the_peers_generation_counts_its_vote_there_as_cast(tmp_path: Path, monkeypatch):
    """Regression: a backup taken after its core adopted generation g and before it voted in g holds
    ``(g, no vote)``. Restored, the core learned that its peers are at g and kept its own state, as
    "already at the generation the peers know": it could then vote in g a second time, for another
    candidate than the one its lost vote went to (two sequencers of g). Its vote in g now counts as
    cast (for itself), as at any generation it recovers."""
    from mnesite.core.consensus import MessageReceived, VoteRequest
    from mnesite.core.node import CoreNode
    from mnesite.core.recovery import well_formed_answers
    from mnesite.rlog.types import TxKey

    members = ("core1", "core2", "core3")
    age = {"generation": 4, "committed": [4, 9], "last": [4, 9]}
    answers = {peer: {"shards": {"default": age}} for peer in members[1:]}
    config = node_config(tmp_path / "data", free_port())
    node = CoreNode(config)
    try:
        with node.store.write_transaction():  # what the backup held: generation 4 adopted, no vote in it
            node.store.ensure_shard("default", 0)
            node.store.persist_consensus_state("default", 4, None, members, False)
        monkeypatch.setattr(node, "members", members)
        monkeypatch.setattr(node, "probe_peers", lambda timeout_ms: well_formed_answers(answers))
        assert node.recover_generations() == {"default": 4}
        assert node.store.consensus_state("default") == (4, "core1", members, False)
    finally:
        node.close()
    restarted = CoreNode(config)
    try:
        consensus = restarted.shards["default"].consensus
        later = restarted.clock_ms() + 60_000  # past the quiet time after a start
        asked = consensus.step(MessageReceived("core3", VoteRequest(4, TxKey(4, 9))), later)
        assert [effect.message.granted for effect in asked if hasattr(effect, "message")] == [False]
    finally:
        restarted.close()


def test_a_rebuilt_core_asks_the_members_whose_endpoints_its_peers_report(tmp_path: Path, monkeypatch):
    """Regression: ``core_nodes`` only seeds a cluster; a core added later is known by the endpoint
    its add entry carried. A member rebuilt on an empty disk with its first config heard the peers
    it knew name that core as a member, but learned its endpoint only once every member had answered:
    it never asked it, and gave up after RECOVERY_ROUNDS_MAX rounds saying that core did not answer
    (again at every start). It now learns the endpoints from each round's answers and asks them next."""
    from mnesite.core.node import CoreNode

    cores = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("core1", "core2", "core3")}
    members = ["core1", "core2", "core4"]  # core3 was removed, core4 added (cluster remove-core, add-core)
    endpoints = {"core1": cores["core1"], "core2": cores["core2"], "core4": f"tcp://127.0.0.1:{free_port()}"}
    age = {"generation": 6, "committed": [6, 3], "last": [6, 3], "members": members}
    asked = []

    def probe(timeout_ms: int) -> dict:
        asked.append(sorted(node.endpoints))
        up = {"core2", "core4"} & set(node.endpoints)  # core3 is gone
        return {peer: {"core_nodes": endpoints, "shards": {"default": age}} for peer in up}

    config = node_config(tmp_path / "data", free_port(), extra={"cluster": {"core_nodes": cores}})
    monkeypatch.setattr(CoreNode, "recover_generations", lambda self, timeout_ms=None: {})  # at construction
    node = CoreNode(config)
    try:
        monkeypatch.undo()
        monkeypatch.setattr(node, "probe_peers", probe)
        assert node.recover_generations() == {"default": 6}
        assert len(asked) == 2 and "core4" in asked[1], "core4 is asked once a peer named its endpoint"
        assert node.endpoints["core4"] == endpoints["core4"] and node.members == ("core1", "core2", "core4")
    finally:
        node.close()


def test_a_core_whose_start_fails_gives_its_data_directory_back(tmp_path: Path, monkeypatch):
    """A start that failed after the data directory was locked (a rebuilt core whose peers did not all
    answer) kept the lock, the store and the query threads: the same process could not start a node on
    that directory again ("in use" by its own pid)."""
    from mnesite.core.node import CoreNode

    cores = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("core1", "core2", "core3")}
    config = node_config(tmp_path / "data", free_port(), extra={"cluster": {"core_nodes": cores}})

    def peers_silent(self, timeout_ms=None):
        raise RuntimeError("1 did not: ['core3']")

    monkeypatch.setattr(CoreNode, "recover_generations", peers_silent)
    with pytest.raises(RuntimeError, match="did not"):
        CoreNode(config)
    monkeypatch.setattr(CoreNode, "recover_generations", lambda self, timeout_ms=None: {})
    node = CoreNode(config)  # raised DataDirectoryInUse naming this very process
    node.close()


def _unread_answers(node, requests: list[bytes]) -> list[Message]:
    """Send ``requests`` to ``node`` (a core driven by hand) from a DEALER that reads nothing until the
    node has answered them all, then read every answer."""
    import time

    sent: list[Message] = []
    send_queued = node._send_queued

    def counted(socket, envelope, message) -> None:
        sent.append(message)
        send_queued(socket, envelope, message)

    node._send_queued = counted
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(node.config.listen)
        for frame in requests:
            dealer.send(frame)
        deadline_s = time.monotonic() + 20
        while len(sent) < len(requests):
            assert time.monotonic() < deadline_s, f"{len(sent)} of {len(requests)} answered"
            node.turn()
        answers = []
        for _ in requests:
            assert dealer.poll(10_000), f"{len(answers)} of {len(requests)} answers arrived"
            answers.append(messages.decode(dealer.recv(), 64 * 1024 * 1024))
        return answers
    finally:
        dealer.close(0)
        context.term()


def test_answers_a_connection_does_not_read_are_bounded_in_bytes_not_only_in_count(tmp_path: Path) -> None:
    """Regression: the answers zmq holds for a connection were bounded in count only
    (``replies_queued_max``, zmq's send high-water mark): a client that asked for large answers and
    never read them made the node hold up to ``replies_queued_max`` x ``frame_bytes_max`` (4 GiB at the
    defaults). Past ``replies_queued_bytes_max`` of large answers that zmq still holds for a connection,
    the next one is refused ``overloaded`` (a small answer) until the client reads."""
    from tests.conftest import core_with_table

    value_bytes, bytes_max = 1024 * 1024, 2 * 1024 * 1024
    with core_with_table(tmp_path / "data", {"limits": {"replies_queued_bytes_max": bytes_max}}) as node:
        with node.store.write_transaction():
            node.store.apply_ops((WriteOp("t", {"id": 1, "v": "x" * value_bytes}),))
        body = messages.typed_body("get", {"table": "t", "key": 1})
        requests = [messages.encode(Message("get", f"g{i}", body)) for i in range(30)]
        answers = _unread_answers(node, requests)
        # What zmq held for the connection while it read nothing: the bound, and never one answer more.
        assert node.unread_answers.refused > 0
    rows = [answer for answer in answers if answer.kind == "reply"]
    refused = [answer for answer in answers if answer.kind == "error"]
    assert all(answer.body.code == "overloaded" for answer in refused), refused[:1]
    assert "replies_queued_bytes_max" in refused[0].body.message
    # 2 MiB held by zmq is 2 answers; a few more went to the kernel's buffers (some MiB on loopback)
    # and the DEALER's queue, which zmq no longer holds: without the bound, all 30 were rows.
    assert 1 <= len(rows) <= 15, len(rows)
    assert len(refused) == 30 - len(rows)


def test_a_rebuilt_core_asks_its_refusing_peers_for_as_long_as_its_rounds_last(tmp_path: Path, monkeypatch):
    """A peer whose port refuses connections (it is starting too: a whole cluster restarted at once)
    ends a probe round at once: the ten rounds took a few milliseconds, and a rebuilt core declared
    ``existing`` gave up before its peers listened. Each round now lasts ``recovery_timeout_ms``."""
    from mnesite.core import node as node_module
    from mnesite.core.node import CoreNode
    from mnesite.rlog.store import StoreError

    port = free_port()
    cores = {"core1": f"tcp://127.0.0.1:{port}", "core2": f"tcp://127.0.0.1:{free_port()}"}  # core2: refused
    config = node_config(tmp_path / "data", port, extra={"cluster": {"core_nodes": cores}})
    config = dataclasses.replace(config, initial_cluster_state="existing")
    monkeypatch.setattr(CoreNode, "recover_generations", lambda self, timeout_ms=None: {})  # at construction
    node = CoreNode(config)
    monkeypatch.undo()
    try:
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"1 did not: \['core2'\]"):
            node.recover_generations(timeout_ms=60)
        elapsed_s = time.monotonic() - started
        assert elapsed_s >= (node_module.RECOVERY_ROUNDS_MAX - 1) * 0.06, elapsed_s
    finally:
        node.close()
