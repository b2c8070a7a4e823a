"""Node-side range requests: a live node hashes key ranges itself, exactly like a file replica does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import apsw
import pytest
from mnesite.rlog import messages, range_requests
from mnesite.rlog.client import MnesiteError
from mnesite.rlog.messages import typed_body
from mnesite.rlog.range_digest import text_range_digest
from mnesite.rlog.schema import SchemaError
from mnesite.rlog.store import Store
from mnesite.rlog.types import WriteOp
from mnesite.spark.replica import FileReplica, NodeReplica, parse_replica

from tests.conftest import ThreadNode
from tests.spark_fixtures import commit, create_table

COLUMNS = [("k", "INTEGER"), ("name", "TEXT"), ("score", "REAL"), ("extra", "ANY"), ("data", "BLOB")]


def row(key: int) -> dict[str, Any]:
    extra: Any = [key, f"t{key}", key / 3, b"\x00" * (key % 4), None][key % 5]
    return {"k": key, "name": f"name, {key}\x00!", "score": key * 0.1, "extra": extra, "data": bytes([key % 256]) * 3}


def fill(node: ThreadNode, keys: range) -> None:
    with node.client() as client:
        client.create_table("items", key="k", columns=COLUMNS)
        with client.transaction() as tx:
            for key in keys:
                tx.put("items", row(key))


def file_replica(node: ThreadNode, tmp_path: Path) -> FileReplica:
    replica = FileReplica(parse_replica(str(tmp_path / "data")))
    assert "items" in replica.catalog()
    return replica


@pytest.mark.timeout(60)
def test_node_digests_equal_the_file_replica_digests(thread_node: ThreadNode, tmp_path: Path) -> None:
    fill(thread_node, range(0, 400, 2))
    node = NodeReplica(parse_replica(thread_node.endpoint))
    with node, file_replica(thread_node, tmp_path) as local:
        table = local.table("items")
        assert node.table("items") == table
        ranges = [(None, 10), (10, 11), (11, 200), (200, None)]
        from_node = node.range_digests(table, ranges, split_parts=4, split_rows_min=10)
        from_file = local.range_digests(table, ranges, split_parts=4, split_rows_min=10)
        assert from_node == from_file
        assert [answer.rows for answer in from_node] == [6, 0, 95, 99]
        assert from_node[1].digest == text_range_digest(0, None)
        assert len({answer.digest for answer in from_node}) == 4
        # Split keys cut a range with more than split_rows_min rows into about split_parts parts.
        assert from_node[0].split_keys == () and len(from_node[2].split_keys) == 3
        assert all(11 < key <= 200 for key in from_node[2].split_keys)
        assert node.key_boundaries(table, 4) == local.key_boundaries(table, 4) == (200, [98, 198, 298])
        assert node.key_boundaries(table, 3, 100, 120) == (10, [108, 116])  # every 4th of 102..120
        assert list(node.row_digests(table, 5, 21)) == list(local.row_digests(table, 5, 21))
        assert [key for key, _ in node.row_digests(table, 5, 21)] == list(range(6, 21, 2))
        # One changed value changes exactly the digests that cover it.
        rows_before = dict(local.row_digests(table, 140, 160))
        with thread_node.client() as client:
            client.put("items", {**row(150), "score": 15.000000000000002})
        changed = node.range_digests(table, ranges)
        assert [a.digest == b.digest for a, b in zip(changed, from_file, strict=True)] == [True, True, False, True]
        rows_after = dict(node.row_digests(table, 140, 160))
        assert rows_after.keys() == rows_before.keys() and len(rows_after) == 10
        assert [key for key in rows_after if rows_after[key] != rows_before[key]] == [150]


@pytest.mark.timeout(60)
def test_answers_carry_the_applied_position(thread_node: ThreadNode) -> None:
    fill(thread_node, range(10))
    with thread_node.client() as client:
        tx_key = client.put("items", row(3))
        status = client.status()["shards"]["default"]
        for answer in (
            client.range_digest("items", [[None, None]]),
            client.key_boundaries("items", 2),
            client.row_digests("items"),
        ):
            assert answer["shard"] == "default"
            assert answer["applied"] == list(tx_key) == list(status["applied"])
            assert answer["applied_digest"] == status["digest"]
        assert client.range_digest("items", [[None, None]])["ranges"][0]["rows"] == 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "body", "code", "message"),
    [
        ("range_digest", {"table": "nope", "ranges": [[None, None]]}, "unknown_table", "unknown table 'nope'"),
        ("key_boundaries", {"table": "nope", "parts": 2}, "unknown_table", "unknown table"),
        ("row_digests", {"table": "nope"}, "unknown_table", "unknown table"),
        ("range_digest", {"table": "items", "ranges": []}, "bad_request", "ranges: Expected `array` of length >= 1"),
        ("range_digest", {"table": "items", "ranges": [[1]]}, "bad_request", "range 0 must be a [low, high] pair"),
        ("range_digest", {"table": "items", "ranges": [[None, 5], 7]}, "bad_request", "range 1 must be"),
        ("range_digest", {"table": "items", "ranges": [[5, 5]]}, "bad_request", "low must be below high"),
        ("range_digest", {"table": "items", "ranges": [["a", None]]}, "bad_request", "range 0 low"),
        ("range_digest", {"table": "items", "ranges": [[None, None]], "split_parts": -1}, "bad_request", "split_parts"),
        (
            "range_digest",
            {"table": "items", "ranges": [[None, None]] * (range_requests.RANGES_MAX + 1)},
            "bad_request",
            "ranges: Expected `array` of length <= 10000",
        ),
        ("key_boundaries", {"table": "items", "parts": 0}, "bad_request", "parts must be"),
        ("key_boundaries", {"table": "items", "parts": range_requests.PARTS_MAX + 1}, "bad_request", "parts must be"),
        ("key_boundaries", {"table": "items", "parts": 2, "low": 9, "high": 1}, "bad_request", "low must be below"),
        ("row_digests", {"table": "items", "limit": 0}, "bad_request", "limit must be"),
        ("row_digests", {"table": "items", "high": b"x"}, "bad_request", "range high"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_node_keeps_serving(
    thread_node: ThreadNode, kind: str, body: dict[str, Any], code: str, message: str
) -> None:
    fill(thread_node, range(5))
    with thread_node.client() as client:
        with pytest.raises(MnesiteError) as raised:
            client.call(kind, body)
        assert raised.value.code == code and message in str(raised.value)
        assert client.range_digest("items", [[None, None]])["ranges"][0]["rows"] == 5


@pytest.mark.timeout(60)
def test_unknown_fields_and_wrong_field_types_are_refused_by_the_node(thread_node: ThreadNode) -> None:
    import msgpack
    import zmq

    fill(thread_node, range(5))
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(thread_node.endpoint)
    try:
        for request_id, body, message in (
            ("r1", {"table": "items", "ranges": [[None, None]], "extra": 1}, "unknown field `extra`"),
            ("r2", {"table": "items", "ranges": "all"}, "range_digest.ranges: Expected `array`, got `str`"),
            ("r3", {"ranges": [[None, None]]}, "missing required field `table`"),
        ):
            # Raw frames: the client would refuse to encode these itself.
            socket.send(msgpack.packb([messages.PROTOCOL_VERSION, "range_digest", request_id, body], use_bin_type=True))
            assert socket.poll(5000), "the node did not answer"
            answer = messages.decode(socket.recv())
            assert answer.kind == "error" and answer.body.code == "bad_frame", answer
            assert message in answer.body.message
    finally:
        socket.close(0)
        context.term()
    with thread_node.client() as client:
        assert client.range_digest("items", [[None, None]])["ranges"][0]["rows"] == 5


@pytest.mark.timeout(60)
def test_answers_are_bounded_by_the_row_budget(tmp_path: Path) -> None:
    node = ThreadNode(tmp_path / "data", extra={"limits": {"scan_rows_max": 3}})  # 30 rows hashed per answer
    try:
        fill(node, range(100))
        with node.client() as client:
            answer = client.range_digest("items", [[None, 19], [19, 39], [39, None]])
            assert answer["more"] is True and [r["rows"] for r in answer["ranges"]] == [20]
            # A range larger than the budget: no digest, a lower bound on its rows, split keys to cut it.
            answer = client.range_digest("items", [[None, None]], split_parts=4)
            (only,) = answer["ranges"]
            assert only["digest"] is None and only["rows"] == 31 and len(only["split_keys"]) == 3
            assert len(client.row_digests("items")["rows"]) == 30
            assert len(client.row_digests("items", limit=7)["rows"]) == 7
            with pytest.raises(MnesiteError, match="limit must be"):
                client.row_digests("items", limit=31)
            assert client.key_boundaries("items", 2)["rows"] == 100  # keys walked: 100 per scan row
        with (
            NodeReplica(parse_replica(node.endpoint)) as replica,
            FileReplica(parse_replica(str(tmp_path / "data"))) as local,
        ):
            table = local.table("items")
            ranges = [(None, 19), (19, 39), (39, 59), (59, 79), (79, None)]
            # The replica asks again from the first unanswered range until every range is answered.
            assert replica.range_digests(table, ranges) == local.range_digests(table, ranges)
            assert replica.range_digests(table, [(None, None)])[0].digest is None
            assert list(replica.row_digests(table, None, None)) == list(local.row_digests(table, None, None))
    finally:
        node.stop()


@pytest.mark.timeout(30)
def test_reads_nest_inside_an_open_write_transaction(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "mnesite.db"), synchronous="OFF")
    create_table(store, "items", "k", COLUMNS)
    commit(store, [WriteOp("items", row(key)) for key in range(5)])
    body = typed_body("range_digest", {"table": "items", "ranges": [[None, None]]})
    before = range_requests.answer(store, "range_digest", body, 100, 10**6)
    assert not store.connection.in_transaction  # the read transaction was released
    store.connection.execute("BEGIN IMMEDIATE")  # what the node does during a turn
    commit_inside = [WriteOp("items", row(7))]
    from mnesite.rlog.types import TxKey, make_entry

    position = store.shard("default")
    entry = make_entry(
        "default", TxKey(1, position.applied.counter + 1), position.applied, position.digest, tuple(commit_inside)
    )
    store.append_entry(entry, 0)
    store.apply_entry(entry)
    inside = range_requests.answer(store, "range_digest", body, 100, 10**6)
    assert store.connection.in_transaction  # still the node's transaction, not committed by the read
    assert inside["ranges"][0]["rows"] == 6 and inside["applied"] == list(entry.tx_key)
    assert inside["ranges"][0]["digest"] != before["ranges"][0]["digest"]
    store.connection.execute("ROLLBACK")
    assert range_requests.answer(store, "range_digest", body, 100, 10**6) == before
    with pytest.raises(SchemaError) as raised:
        range_requests.answer(store, "scan", body, 100, 10**6)
    assert raised.value.code == "bad_request"
    store.close()


@pytest.mark.timeout(30)
def test_row_digests_of_large_rows_are_bounded_in_bytes_hashed_and_say_more(tmp_path: Path) -> None:
    """Regression: ``row_digests`` built and hashed the text of up to ``scan_rows_max * 10`` rows
    (100,000 by default) whatever their size, in one loop turn: 100 KB rows cost a node about 20 GB of
    row text per request. It now stops after about ``DIGEST_ROWS_PER_SCAN_ROW`` frames of row text
    (at least one row) and says ``more``; the compare asks again after the last key."""
    store = Store(str(tmp_path / "mnesite.db"), synchronous="OFF")
    create_table(store, "large", "k", [("k", "INTEGER"), ("v", "BLOB")])
    commit(store, [WriteOp("large", {"k": key, "v": bytes(20_000)}) for key in range(300)])
    frame_bytes_max = 100_000  # row text hashed per request: about 10 frames, 1 MB: some 50 rows
    keys, low, pages = [], None, 0
    while True:
        body = typed_body("row_digests", {"table": "large", "low": low})
        answer = range_requests.answer(store, "row_digests", body, 10_000, frame_bytes_max)
        page = [key for key, _ in answer["rows"]]
        assert 0 < len(page) <= 60
        keys += page
        pages += 1
        if not answer["more"]:
            break
        low = page[-1]
    assert keys == list(range(300)) and pages >= 5
    # A row larger than the bound still goes, alone.
    body = typed_body("row_digests", {"table": "large"})
    answer = range_requests.answer(store, "row_digests", body, 10_000, 1000)
    assert [key for key, _ in answer["rows"]] == [0] and answer["more"]


def _large_rows_store(tmp_path: Path, rows: int, value_bytes: int) -> Store:
    store = Store(str(tmp_path / "mnesite.db"), synchronous="OFF")
    create_table(store, "large", "k", [("k", "INTEGER"), ("v", "BLOB")])
    for start in range(0, rows, 50):
        commit(
            store, [WriteOp("large", {"k": k, "v": bytes([k % 256]) * value_bytes}) for k in range(start, start + 50)]
        )
    return store


def _large_rows_digest(keys: range, value_bytes: int) -> bytes:
    # The row text of (k INTEGER, v BLOB), written out by hand (rlog.range_digest's section comment).
    texts = b"".join(b"%d,%d:%s," % (k, value_bytes, bytes([k % 256]) * value_bytes) for k in keys)
    return text_range_digest(len(keys), texts)


@pytest.mark.timeout(60)
def test_a_range_digest_holds_one_row_text_at_a_time_not_the_whole_range(tmp_path: Path) -> None:
    """Regression: ``range_digests`` had SQLite ``group_concat`` the row texts of a whole range (up
    to ``scan_rows_max * 10`` rows, 100,000 by default) and copied the result into Python: with
    wide rows one request made a node hold up to SQLite's 1 GB value, twice, on its loop thread.
    It now hashes the row texts one at a time, and the digests are the same."""
    import tracemalloc

    value_bytes = 100_000
    store = _large_rows_store(tmp_path, 300, value_bytes)  # 30 MB of row text in one range
    table = store.catalog()["large"]
    connection = store.connection
    sqlite_before = apsw.memory_used()
    apsw.memory_high_water(True)
    tracemalloc.start()
    try:
        with range_requests.read_snapshot(connection):
            answers = range_requests.range_digests(connection, table, [(None, None), (99, 199)])
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    sqlite_peak = apsw.memory_high_water() - sqlite_before
    assert [answer.rows for answer in answers] == [300, 100]
    assert answers[0].digest == _large_rows_digest(range(300), value_bytes)
    assert answers[1].digest == _large_rows_digest(range(100, 200), value_bytes)
    assert python_peak < 4_000_000, python_peak
    assert sqlite_peak < 12_000_000, sqlite_peak  # the page cache may grow too (at most 16 MB, mostly full)
    store.close()


@pytest.mark.timeout(60)
def test_range_digest_answers_are_bounded_in_bytes_of_row_text(tmp_path: Path) -> None:
    """Regression: a ``range_digest`` request was bounded in rows only (``scan_rows_max * 10``), so
    wide rows made one request hash gigabytes on the node's loop thread. Like ``row_digests``, it
    now stops at about ``DIGEST_ROWS_PER_SCAN_ROW`` frames of row text: the ranges it finished come
    back with ``more``, and a range over the budget alone gets no digest, its row count and split
    keys, which the compare cuts smaller (as for the row budget)."""
    value_bytes = 20_000
    store = _large_rows_store(tmp_path, 300, value_bytes)
    frame_bytes_max = 100_000  # row text hashed per request: about 10 frames, 1 MB: some 50 rows
    ranges = [[None, 19], [19, 39], [39, 59], [59, None]]  # 20 rows (400 KB) each, the last one 240 rows
    body = typed_body("range_digest", {"table": "large", "ranges": ranges})
    answer = range_requests.answer(store, "range_digest", body, 10_000, frame_bytes_max)
    assert answer["more"] is True
    assert [(r["rows"], r["digest"]) for r in answer["ranges"]] == [
        (20, _large_rows_digest(range(0, 20), value_bytes)),
        (20, _large_rows_digest(range(20, 40), value_bytes)),
    ]
    body = typed_body("range_digest", {"table": "large", "ranges": [[59, None]], "split_parts": 4})
    answer = range_requests.answer(store, "range_digest", body, 10_000, frame_bytes_max)
    (only,) = answer["ranges"]
    assert answer["more"] is False and only["digest"] is None and only["rows"] == 240
    assert len(only["split_keys"]) == 3 and all(59 < key < 299 for key in only["split_keys"])
    # Under the budget the digest is there, and the same as without any budget.
    body = typed_body("range_digest", {"table": "large", "ranges": [[None, 9]]})
    answer = range_requests.answer(store, "range_digest", body, 10_000, frame_bytes_max)
    assert answer["ranges"][0]["digest"] == _large_rows_digest(range(10), value_bytes)
    store.close()


@pytest.mark.timeout(30)
def test_equal_rows_of_a_text_key_table_written_in_another_order_digest_the_same(tmp_path: Path) -> None:
    """A range's row texts are hashed in key order. A table with a TEXT key keeps SQLite's rowid,
    and an unbounded range was scanned in rowid order, that is in the order the rows were written:
    a core (the log's order) and a replicant bootstrapped from it (key order) digested equal tables
    differently, and every compare drilled down from the top."""
    columns = [("k", "TEXT"), ("v", "INTEGER")]
    answers = []
    for name, keys in (("written", ["m", "b", "z", "a"]), ("sorted", ["a", "b", "m", "z"])):
        store = Store(str(tmp_path / f"{name}.db"), synchronous="OFF")
        try:
            create_table(store, "t", "k", columns)
            for key in keys:
                commit(store, [WriteOp("t", {"k": key, "v": ord(key)})])
            body = typed_body("range_digest", {"table": "t", "ranges": [[None, None], ["a", "m"]]})
            answers.append(range_requests.answer(store, "range_digest", body, 100, 10**6)["ranges"])
        finally:
            store.close()
    assert answers[0] == answers[1]
    assert [answer["rows"] for answer in answers[0]] == [4, 2]


@pytest.mark.timeout(60)
def test_a_scan_page_above_the_nodes_scan_rows_max_is_asked_again_smaller(tmp_path: Path) -> None:
    """A node with a smaller ``scan_rows_max`` than a client's page (the Spark data source's 1,000-row
    batches) answered ``bad_request``, and the read failed; it is ``too_large`` now, and ``Client.scan``
    asks again for fewer rows, as for a page above a frame."""
    node = ThreadNode(tmp_path / "data", extra={"limits": {"scan_rows_max": 3}})
    try:
        fill(node, range(10))
        with node.client() as client:
            with pytest.raises(MnesiteError, match="above this node's scan_rows_max 3") as refused:
                client.scan_page("items", None, 10)
            assert getattr(refused.value, "code", None) == "too_large"
            assert [row["k"] for row in client.scan("items", page_rows=10)] == list(range(10))
        with NodeReplica(parse_replica(node.endpoint)) as replica:
            table = replica.table("items")
            assert [key for key, _ in replica.iter_rows(table, None, None, 1000)] == list(range(10))
    finally:
        node.stop()


def test_a_range_request_that_fails_in_sqlite_is_answered_internal(tmp_path: Path, monkeypatch) -> None:
    """A range request that SQLite failed was answered ``internal_error``, a code of its own, where
    every other failure at a node is ``internal`` (the one code clients and the DB-API map to an
    internal error). It is ``internal`` now, with what SQLite said."""
    store = Store(str(tmp_path / "mnesite.db"), synchronous="OFF")
    create_table(store, "items", "k", [("k", "INTEGER"), ("v", "TEXT")])

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise apsw.IOError("disk I/O error")

    monkeypatch.setattr(range_requests, "row_digests", broken)
    with pytest.raises(SchemaError) as refused:
        range_requests.answer(store, "row_digests", typed_body("row_digests", {"table": "items"}), 100, 1 << 20)
    assert refused.value.code == "internal"
    assert "range request failed in SQLite" in str(refused.value) and "disk I/O error" in str(refused.value)
