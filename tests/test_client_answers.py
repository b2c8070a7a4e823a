"""The client reads a node's answers as untrusted: one that does not fit is ``bad_answer``.

A reply whose result lacks a field, or has one of the wrong type (a node of another protocol, a bug,
something else listening on the port), raised a bare KeyError or TypeError out of ``put``, ``count``,
``query``, ``scan`` and ``table`` (and past the DB-API's exception hierarchy), or was taken as it was:
``put`` returned ``TxKey('a', 'b')``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from mnesite.rlog import messages
from mnesite.rlog.client import Client, MnesiteError
from mnesite.rlog.limits import BACKUP_CHUNK_BYTES_MAX
from mnesite.rlog.range_requests import RangeAnswer
from mnesite.rlog.schema import TableSchema
from mnesite.rlog.types import TxKey
from mnesite.spark.replica import NodeReplica, ReplicaError, ShardApplied, parse_replica

from mnesite import dbapi
from tests.conftest import RouterNode

pytestmark = pytest.mark.timeout(60)


class ReplyingNode(RouterNode):
    """A ROUTER that answers every request with a reply whose result is ``result`` (set by the test)."""

    def __init__(self) -> None:
        self.result: Any = None
        super().__init__()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            received = self.receive()
            if received is not None:
                envelope, request_id = received
                self.send(envelope, messages.reply(request_id, self.result))


@pytest.fixture(scope="module")
def node() -> Iterator[ReplyingNode]:
    node = ReplyingNode()
    try:
        yield node
    finally:
        node.close()


def _dbapi_rows(client: Client) -> Any:
    return dbapi.Connection(client, "local", None, None).cursor().execute("SELECT 1").fetchall()


CALLS: dict[str, Callable[[Client], Any]] = {
    "put": lambda client: client.put("t", {"k": 1}),
    "create_table": lambda client: client.create_table("t", key="k"),
    "count": lambda client: client.count("t"),
    "query": lambda client: list(client.query("SELECT 1")),
    "table": lambda client: client.table("t"),
    "list_tables": lambda client: client.list_tables(),
    "scan": lambda client: list(client.scan("t")),
}
GARBAGE = [
    42,
    None,
    "text",
    [1, 2],
    {},
    {"tx_key": "ab", "rows": -1, "columns": 5},
    {"tx_key": [1], "rows": "x", "columns": ["a"], "rows_": 1},
    {"columns": ["a"], "rows": [1, 2], "tx_key": [1, -2]},
    [{"table": "t", "shard": "default", "key": "k", "columns": 7}],
]


def _malformed(call: str, garbage: Any) -> bool:
    """A list of row objects is a well-formed scan page (whatever the rows hold): not garbage to a scan."""
    return not (call == "scan" and isinstance(garbage, list) and all(isinstance(row, dict) for row in garbage))


@pytest.mark.parametrize(
    ("call", "garbage"),
    [(call, garbage) for call in CALLS for garbage in GARBAGE if _malformed(call, garbage)],
    ids=repr,
)
def test_a_malformed_answer_is_a_mnesite_error(node: ReplyingNode, call: str, garbage: Any) -> None:
    node.result = garbage
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client, pytest.raises(MnesiteError) as raised:
        CALLS[call](client)
    assert raised.value.code in ("bad_answer", "unknown_table"), raised.value


def test_a_dbapi_result_fetches_its_pages_with_the_connections_timeout(node: ReplyingNode) -> None:
    """Its statement's attempts share the call's deadline (``timeout_ms`` cut in ``retries + 1``
    parts, less what freeing the previous result took); each later page is a call of its own."""
    node.result = {"columns": ["a"], "rows": [[1]], "cursor": "token"}
    with dbapi.connect(node.endpoint, timeout_ms=3000, retries=2) as connection:
        cursor = connection.cursor().execute("SELECT a FROM t")
        assert cursor._result is not None and cursor._result.page_timeout_ms == 3000
        assert cursor.fetchone() == (1,)


@pytest.mark.parametrize("garbage", [42, {}, {"columns": 5, "rows": 3}, {"columns": ["a"], "rows": [7]}], ids=repr)
def test_the_dbapi_says_a_malformed_answer_with_its_own_errors(node: ReplyingNode, garbage: Any) -> None:
    node.result = garbage
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client, pytest.raises(dbapi.OperationalError) as raised:
        _dbapi_rows(client)
    assert raised.value.code == "bad_answer"


def test_a_scan_page_whose_rows_lack_the_key_column_is_a_bad_answer(node: ReplyingNode) -> None:
    tables = [{"table": "t", "shard": "default", "key": "k", "columns": [["k", "INTEGER"]]}]
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client:
        node.result = [{"v": 1}]
        client.list_tables = lambda: tables  # type: ignore[method-assign]
        with pytest.raises(MnesiteError) as raised:
            list(client.scan("t", page_rows=1))
    assert raised.value.code == "bad_answer"


def test_well_formed_answers_still_read(node: ReplyingNode) -> None:
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client:
        node.result = {"tx_key": [3, 4], "shard": "default"}
        assert client.put("t", {"k": 1}) == (3, 4) and client.last_tx_keys == {"default": (3, 4)}
        node.result = {"tx_key": [3, 5], "future_field": 1}  # a newer release may add fields
        assert client.put("t", {"k": 1}) == (3, 5)
        node.result = {"rows": 7}
        assert client.count("t") == 7
        node.result = {"columns": ["a"], "rows": [[1], [b"x"]], "cursor": None, "positions": {"default": [1, 2]}}
        result = client.query("SELECT a FROM t")
        assert list(result) == [(1,), (b"x",)] and result.positions == {"default": (1, 2)}
        node.result = [{"k": 1}]
        assert list(client.scan("t", page_rows=5)) == [{"k": 1}]
        node.result = None
        assert client.get("t", 1) is None


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ({"timeout_ms": 0}, "timeout_ms must be an integer of at least 1, got 0"),
        ({"timeout_ms": -5}, "timeout_ms must be an integer of at least 1"),
        ({"timeout_ms": "100"}, "timeout_ms must be an integer of at least 1, got '100'"),
        ({"retries": -1}, "retries must be an integer of at least 0"),
        ({"retries": "1"}, "retries must be an integer of at least 0, got '1'"),
        ({"retries": True}, "retries must be an integer of at least 0, got True"),
        ({"frame_bytes_max": 0}, "frame_bytes_max must be an integer of at least 1"),
    ],
)
def test_a_client_refuses_a_timeout_or_retries_it_cannot_use(node: ReplyingNode, arguments: dict, text: str) -> None:
    """A timeout of 0 (or retries of -1) ended every call at once in "no connection to ... completed in
    time; is the node running?" of a node that was up; a text timeout raised TypeError inside a call."""
    with pytest.raises(MnesiteError, match=text) as raised:
        Client(node.endpoint, **arguments)
    assert raised.value.code == "bad_request"
    if "frame_bytes_max" not in arguments:  # the DB-API's connect takes the others too: its InterfaceError
        with pytest.raises(dbapi.InterfaceError, match=text) as refused:
            dbapi.connect(node.endpoint, **arguments)
        assert refused.value.code == "bad_request"


_CORE_SHARD = {
    "role": "sequencer",
    "generation": 2,
    "sequencer": "core1",
    "applied": [2, 5],
    "committed": [2, 5],
    "last": [2, 5],
    "digest": "ab" * 32,
    "members": ["core1"],
}
_REPLICANT_SHARD = {
    "mode": "normal",
    "upstream": "core1",
    "applied": [2, 5],
    "digest": None,
    "lag_entries": None,
    "bootstraps": 1,
    "resumes": 0,
    "rows_copied": 3,
    "entries_buffered": 0,
}
_STATUS = {"node": "core1", "role": "core", "shards": {"default": _CORE_SHARD}}
_MEMBERS = {
    "node": "core1",
    "members": ["core1"],
    "endpoints": {"core1": "tcp://127.0.0.1:1"},
    "shards": {
        "default": {
            "members": ["core1"],
            "committed_members": ["core1"],
            "learner": None,
            "sequencer": "core1",
            "generation": 2,
        }
    },
}
_ENTRY = {"shard": "default", "tx_key": [2, 5], "prev": [2, 4], "digest": "cd" * 32, "request_id": "r", "ops": []}
_JOURNAL_SHARD = {
    "generation": 2,
    "committed": [2, 5],
    "last": [2, 6],
    "digest": "ab" * 32,
    "forced": False,
    "members": ["core1"],
    "pending_members": None,
    "hears_sequencer": True,
    "agents": 0,
    "cluster_version": 2,
}
_JOURNAL = {
    "node": "core1",
    "core_nodes": {"core1": "tcp://127.0.0.1:1"},
    "members": ["core1"],
    "reachable_peers": [],
    "shards": {"default": _JOURNAL_SHARD},
}
_FORCED = {
    "node": "core1",
    "members": ["core1"],
    "reached": [],
    "left_out": ["core2"],
    "may_lose": "writes that core2 committed but core1 never received are lost",
    "shards": {"default": {"generation": 3, "members": ["core1"], "left_out": ["core2"], "last": [2, 6]}},
}
_BACKUP = {
    "path": "/b",
    "state": "done",
    "error": None,
    "pages_copied": 4,
    "pages_total": 4,
    "seconds": 0.25,
    "shards": {"default": {"applied": [2, 5], "digest": "ab" * 32, "generation": 2}},
}
_CHUNK = {"data": b"SQLite format 3\x00", "size": 4096, "end": False}
_POSITION = {"shard": "default", "applied": [2, 5], "applied_digest": "ab" * 32}
_RANGE = {"rows": 3, "digest": b"d" * 32, "split_keys": [1, "b"]}
_RANGE_DIGESTS = {**_POSITION, "ranges": [_RANGE, {"rows": 9, "digest": None, "split_keys": []}], "more": False}
_KEY_BOUNDARIES = {**_POSITION, "rows": 3, "keys": [1, "b"]}
_ROW_DIGESTS = {**_POSITION, "rows": [[1, b"d" * 32], ["b", b"e" * 32]], "more": True}
ADMIN_CALLS: dict[str, Callable[[Client], Any]] = {
    "status": lambda client: client.status(),
    "members": lambda client: client.members(),
    "rlog_tail": lambda client: client.rlog_tail("default", 5),
    "rlog_entries": lambda client: client.rlog_entries("default"),
    "journal": lambda client: client.journal(),
    "force_start": lambda client: client.force_start(),
    "membership_change": lambda client: client.change_membership("default", "add", "core2", "tcp://127.0.0.1:2"),
    "stop": lambda client: client.stop(),
    "backup": lambda client: client.backup("/b"),
    "backup_read": lambda client: client.backup_read("/b", 0),
    "range_digest": lambda client: client.range_digest("t", [[None, None]]),
    "key_boundaries": lambda client: client.key_boundaries("t", 2),
    "row_digests": lambda client: client.row_digests("t"),
}
ADMIN_GARBAGE = {
    "status": [
        42,
        [],
        {},
        {**_STATUS, "shards": 7},
        {**_STATUS, "node": None},
        # A core's shard without what ``mnesite status`` prints of it: KeyError out of the command.
        {**_STATUS, "shards": {"default": {"role": "sequencer"}}},
        {**_STATUS, "shards": {"default": {**_CORE_SHARD, "applied": "ab"}}},
        {**_STATUS, "shards": {"default": {**_CORE_SHARD, "digest": 5}}},
        {**_STATUS, "shards": {"default": {**_CORE_SHARD, "followers": {"core2": {"match": [1]}}}}},
        {**_STATUS, "shards": {"default": {**_CORE_SHARD, "install": {"rows": -1, "from": "core2"}}}},
        # A core's shard is not a replicant's: the role says which the node must answer.
        {**_STATUS, "role": "replicant"},
        {**_STATUS, "role": "replicant", "shards": {"default": {**_REPLICANT_SHARD, "copy": {"rows": "x"}}}},
        {**_STATUS, "security": {"curve": True}},
        {**_STATUS, "backup": {"path": "/b", "state": "running"}},
        {**_STATUS, "agents": [{"agent": "a"}]},
        {**_STATUS, "versions": {"cluster_versions": [1, 2, 3]}},
    ],
    "members": [
        42,
        {},
        {**_MEMBERS, "members": "core1"},
        {**_MEMBERS, "endpoints": ["tcp://127.0.0.1:1"]},
        {**_MEMBERS, "shards": {"default": {"members": ["core1"]}}},
    ],
    "rlog_tail": [42, {}, [1], [{**_ENTRY, "tx_key": "ab"}], [{**_ENTRY, "ops": [5]}], [{"tx_key": [2, 5]}]],
}
ADMIN_GARBAGE["rlog_entries"] = ADMIN_GARBAGE["rlog_tail"]


def _without(answer: dict[str, Any], field: str) -> dict[str, Any]:
    return {name: value for name, value in answer.items() if name != field}


ADMIN_GARBAGE |= {
    "journal": [
        42,
        {},
        # ``journal show`` iterates the core names and endpoints: AttributeError out of the command.
        {**_JOURNAL, "core_nodes": ["core1"]},
        _without(_JOURNAL, "reachable_peers"),
        # A shard without what ``journal show`` prints of it, or what a replicant reads: KeyError.
        {**_JOURNAL, "shards": {"default": _without(_JOURNAL_SHARD, "forced")}},
        {**_JOURNAL, "shards": {"default": _without(_JOURNAL_SHARD, "hears_sequencer")}},
        {**_JOURNAL, "shards": {"default": {**_JOURNAL_SHARD, "last": "ab"}}},
        {**_JOURNAL, "shards": {"default": {**_JOURNAL_SHARD, "generation": -1}}},
        # Joined into the members column as they came: "c,o,r,e,1".
        {**_JOURNAL, "shards": {"default": {**_JOURNAL_SHARD, "members": "core1"}}},
        {**_JOURNAL, "peer_versions": {"core2": {"cluster_versions": "12"}}},
    ],
    "force_start": [
        42,
        {},
        {**_FORCED, "members": "core1"},
        _without(_FORCED, "may_lose"),
        {**_FORCED, "shards": {"default": {"generation": 3}}},
        {**_FORCED, "shards": {"default": {"generation": 3, "last": [2]}}},
    ],
    # ``cluster add-core`` prints the committed tx key, or why nothing changed.
    "membership_change": [42, {}, {"shard": "default"}, {"tx_key": "ab"}, {"tx_key": [1, -1]}, {"unchanged": None}],
    "stop": [42, {}, {"stopping": True}, {"node": 5}],
    "backup": [
        42,
        {},
        {**_BACKUP, "state": None},
        {**_BACKUP, "pages_total": "4"},
        _without(_BACKUP, "seconds"),
        {**_BACKUP, "state": "failed"},
        {**_BACKUP, "shards": {"default": {"applied": "ab", "digest": "ab"}}},
    ],
    # ``backup --download`` appends the data to LOCAL and compares the offsets with the size.
    "backup_read": [
        42,
        {},
        {**_CHUNK, "data": [1, 2]},
        {**_CHUNK, "data": bytes(BACKUP_CHUNK_BYTES_MAX + 1)},
        {**_CHUNK, "size": -1},
        _without(_CHUNK, "end"),
    ],
    "range_digest": [
        42,
        {},
        _without(_RANGE_DIGESTS, "applied"),
        {**_RANGE_DIGESTS, "ranges": 5},
        {**_RANGE_DIGESTS, "ranges": [_without(_RANGE, "split_keys")]},
        {**_RANGE_DIGESTS, "ranges": [{**_RANGE, "rows": -1}]},
        # A digest as text (base64 would convert to bytes): the compare job reads it as bytes.
        {**_RANGE_DIGESTS, "ranges": [{**_RANGE, "digest": "ZGQ="}]},
    ],
    "key_boundaries": [42, {}, {**_KEY_BOUNDARIES, "keys": 5}, {**_KEY_BOUNDARIES, "rows": "3"}],
    "row_digests": [
        42,
        _without(_ROW_DIGESTS, "more"),
        {**_ROW_DIGESTS, "rows": 5},
        {**_ROW_DIGESTS, "rows": [[1]]},
        {**_ROW_DIGESTS, "rows": [[1, "ZGQ="]]},
    ],
}


@pytest.mark.parametrize(
    ("call", "garbage"), [(call, garbage) for call, answers in ADMIN_GARBAGE.items() for garbage in answers], ids=repr
)
def test_a_malformed_admin_answer_is_a_bad_answer(node: ReplyingNode, call: str, garbage: Any) -> None:
    """The admin calls (``status``, ``members``, the rlog reads, ``journal``, ``force_start``,
    ``change_membership``, ``stop``, ``backup``) and the range requests returned the node's answer as
    it was: a number, a list for a dict, a shard without its applied key reached the caller (and
    ``mnesite status``, ``journal show`` or the compare job died on a KeyError or TypeError). They are
    checked as every data answer."""
    node.result = garbage
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client, pytest.raises(MnesiteError) as raised:
        ADMIN_CALLS[call](client)
    assert raised.value.code == "bad_answer", raised.value
    assert f"malformed {call} answer" in str(raised.value)


def test_well_formed_admin_answers_still_read_as_they_came(node: ReplyingNode) -> None:
    """The caller still gets the answer whole (the fields no check reads, and those a newer release adds)."""
    secure = {"curve": True, "authorized_keys": 2, "refused_role": 0, "refused_sender": 0, "reloads": 1}
    secure["handshakes_failed"] = {"auth": 0, "protocol": 0, "no_detail": 0}
    replicant = {**_STATUS, "role": "replicant", "shards": {"default": _REPLICANT_SHARD}, "no_core_reached": None}
    answers = {
        "status": [
            {**_STATUS, "commits": 9, "security": secure, "future_field": [1]},
            {**_STATUS, "shards": {}, "security": {"curve": False, "insecure": True}, "backup": None},
            replicant,
        ],
        "members": [{**_MEMBERS, "future_field": 1}],
        "rlog_tail": [[], [_ENTRY, {**_ENTRY, "ops": [{"op": "write", "table": "t", "row": {"k": 1}}]}]],
    }
    answers["rlog_entries"] = answers["rlog_tail"]
    answers |= {
        "journal": [
            {**_JOURNAL, "future_field": 1},
            {**_JOURNAL, "shards": {}, "versions": {"software": "0.2.0", "cluster_versions": [1, 2]}},
            # Release 0.1.0's: no versions, no cluster version, no shard members (read with a default).
            {**_JOURNAL, "shards": {"default": _without(_without(_JOURNAL_SHARD, "cluster_version"), "members")}},
        ],
        "force_start": [_FORCED, {**_FORCED, "shards": {}, "left_out": []}],
        "membership_change": [
            {"tx_key": [2, 7], "shard": "default", "duplicate": True},
            {"shard": "default", "members": ["core1", "core2"], "unchanged": "already_member"},
        ],
        "stop": [{"node": "core1", "stopping": True}],
        "backup": [
            _BACKUP,
            {**_BACKUP, "state": "failed", "error": "disk full"},
            {"state": "running", "pages_copied": 0, "pages_total": 0},
        ],
        "backup_read": [_CHUNK, {"data": b"", "size": 0, "end": True}],
        "range_digest": [_RANGE_DIGESTS, {**_RANGE_DIGESTS, "ranges": [], "more": True}],
        "key_boundaries": [_KEY_BOUNDARIES, {**_KEY_BOUNDARIES, "rows": 0, "keys": []}],
        "row_digests": [_ROW_DIGESTS, {**_ROW_DIGESTS, "rows": [], "more": False}],
    }
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client:
        for call, results in answers.items():
            for result in results:
                node.result = result
                assert ADMIN_CALLS[call](client) == result


_AGENT = {
    "agent": "a1",
    "replicant": "replicant1",
    "shard": "default",
    "mode": "normal",
    "acked": [2, 5],
    "lag_entries": 0,
}
_VERSIONS = {"software": "0.2.0", "cluster_versions": [1, 2]}
_INSTALL = {"rows": 1, "from": "core2"}
_REPLICANT = {**_STATUS, "role": "replicant", "shards": {"default": _REPLICANT_SHARD}}
# The status fields added after the typed answers, each malformed, and where the refusal says it is.
NEWER_STATUS_GARBAGE = [
    ({**_STATUS, "agents": [{**_AGENT, "frame_bytes_max": "4 MiB"}]}, "agents[0].frame_bytes_max"),
    ({**_STATUS, "agents": [{**_AGENT, "frame_bytes_max": -1}]}, "agents[0].frame_bytes_max"),
    ({**_STATUS, "sends_dropped_by": {"zmq": "3", "core_queue_bytes_max": 0}}, "sends_dropped_by[...]"),
    ({**_STATUS, "sends_dropped_by": [3, 0]}, "sends_dropped_by"),
    ({**_STATUS, "sends_dropped": -2}, "sends_dropped"),
    ({**_STATUS, "versions": {**_VERSIONS, "cluster_id": "AB" * 16}}, "versions.cluster_id"),
    ({**_STATUS, "versions": {**_VERSIONS, "cluster_id": "0" + "ab" * 16}}, "versions.cluster_id"),
    ({**_STATUS, "versions": {**_VERSIONS, "cluster_id": 7}}, "versions.cluster_id"),
    ({**_STATUS, "peer_versions": {"core2": {**_VERSIONS, "cluster_id": "ab"}}}, "peer_versions[...].cluster_id"),
    (
        {**_STATUS, "shards": {"default": {**_CORE_SHARD, "install": {**_INSTALL, "read_fence_error": 5}}}},
        "shards[...].install.read_fence_error",
    ),
    (
        {**_REPLICANT, "shards": {"default": {**_REPLICANT_SHARD, "read_fence_error": ["no"]}}},
        "shards[...].read_fence_error",
    ),
]


@pytest.mark.parametrize(("garbage", "where"), NEWER_STATUS_GARBAGE, ids=repr)
def test_a_malformed_newer_status_field_is_a_bad_answer_naming_it(node: ReplyingNode, garbage: Any, where: str) -> None:
    """A core's per-agent ``frame_bytes_max``, ``sends_dropped_by``, ``versions.cluster_id`` and a read
    fence's ``read_fence_error`` reached ``mnesite status`` as they came (a text size, a negative count,
    an upper-case cluster id); the refusal says where in the answer, not only which type it is not."""
    node.result = garbage
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client, pytest.raises(MnesiteError) as raised:
        client.status()
    assert raised.value.code == "bad_answer", raised.value
    assert "malformed status answer: not a " in str(raised.value)
    assert f"status.{where}: " in str(raised.value)


def test_the_newer_status_fields_read_present_null_or_absent(node: ReplyingNode) -> None:
    """A node of a release before them answers without them; a core names no cluster id, an agent
    whose replicant told no frame limit has a null one, a fence with no error a null one."""
    versions = {**_VERSIONS, "cluster_id": "0123456789abcdef" * 2}
    answers = [
        {
            **_STATUS,
            "agents": [{**_AGENT, "frame_bytes_max": 4 * 1024 * 1024}, {**_AGENT, "frame_bytes_max": None}],
            "sends_dropped": 3,
            "sends_dropped_by": {"zmq": 1, "core_queue_bytes_max": 2, "a_newer_reason": 0},
            "versions": versions,
            "peer_versions": {"core2": versions, "core3": _VERSIONS},
            "shards": {"default": {**_CORE_SHARD, "install": {**_INSTALL, "read_fence_error": "no answer"}}},
        },
        {
            **_STATUS,
            "agents": [_AGENT],
            "versions": _VERSIONS,
            "shards": {"default": {**_CORE_SHARD, "install": _INSTALL}},
        },
        {**_STATUS, "versions": {**_VERSIONS, "cluster_id": None}},
        {
            **_REPLICANT,
            "shards": {"default": {**_REPLICANT_SHARD, "read_fence_error": None}},
            "core_versions": {"core1": versions},
        },
    ]
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client:
        for answer in answers:
            node.result = answer
            assert client.status() == answer


_TABLE = TableSchema("t", "default", "k", (("k", "INTEGER"),))
REPLICA_CALLS: dict[str, Callable[[NodeReplica], Any]] = {
    "range_digest": lambda replica: replica.range_digests(_TABLE, [(None, None)]),
    "key_boundaries": lambda replica: replica.key_boundaries(_TABLE, 2),
    "row_digests": lambda replica: list(replica.row_digests(_TABLE, None, None)),
    "rlog_entries": lambda replica: replica.entries_after("default", TxKey(0, 0), 10),
    "status": lambda replica: replica.applied(),
}
REPLICA_GARBAGE = [(call, garbage) for call in REPLICA_CALLS for garbage in ADMIN_GARBAGE[call]] + [
    # What the typed answers do not say, which the compare job checks itself: how many ranges came
    # back (at least one, at most those asked), and the fields of an op beyond its kind.
    ("range_digest", {**_RANGE_DIGESTS, "ranges": []}, "range_digest answered 0 of 1 ranges"),
    ("range_digest", _RANGE_DIGESTS, "range_digest answered 2 of 1 ranges"),
    ("rlog_entries", [{**_ENTRY, "ops": [{"op": "delete", "key": 1}]}], "malformed rlog entry ('table')"),
    ("rlog_entries", [{**_ENTRY, "ops": [{"op": "rename_table"}]}], "malformed rlog entry (unknown op"),
]


@pytest.fixture
def replica(node: ReplyingNode) -> Iterator[NodeReplica]:
    with NodeReplica(parse_replica(node.endpoint), timeout_ms=2000) as replica:
        yield replica


@pytest.mark.parametrize("case", REPLICA_GARBAGE, ids=repr)
def test_the_compare_job_refuses_a_malformed_answer_saying_so(node: ReplyingNode, replica: NodeReplica, case) -> None:
    """The compare job's node replica (``spark.replica.NodeReplica``) checked each range answer's shape
    again after the client's typed check (``admin_answers``); it now relies on that check and keeps
    only what the types do not say. Either way a malformed answer is one clear ``ReplicaError``."""
    call, garbage, *expected = case
    node.result = garbage
    with pytest.raises(ReplicaError) as refused:
        REPLICA_CALLS[call](replica)
    message = expected[0] if expected else f"{call} failed: malformed {call} answer"
    assert message in str(refused.value)


def test_the_compare_job_reads_well_formed_answers_as_before(node: ReplyingNode, replica: NodeReplica) -> None:
    node.result = _RANGE_DIGESTS
    assert replica.range_digests(_TABLE, [(None, 5), (5, None)]) == [
        RangeAnswer(3, b"d" * 32, (1, "b")),
        RangeAnswer(9, None, ()),
    ]
    node.result = _KEY_BOUNDARIES
    assert replica.key_boundaries(_TABLE, 2) == (3, [1, "b"])
    node.result = {**_ROW_DIGESTS, "more": False}
    assert list(replica.row_digests(_TABLE, None, None)) == [(1, b"d" * 32), ("b", b"e" * 32)]
    node.result = _STATUS
    assert replica.applied() == {"default": ShardApplied("default", TxKey(2, 5), "ab" * 32)}
    # A replicant's digest is null from a bootstrap's reset until its replay: unknown, "".
    node.result = {**_STATUS, "role": "replicant", "shards": {"default": {**_REPLICANT_SHARD, "digest": None}}}
    assert replica.applied() == {"default": ShardApplied("default", TxKey(2, 5), "")}


_POSITIONS = [{"shard": "s", "after": [1, 1]}]
CHANGES_GARBAGE = [
    # Two records of one shard, the first without its tx key: KeyError out of the feed's iterator.
    {"records": [{"kind": "change", "shard": "s"}, {"kind": "change", "shard": "s"}], "applied": {"s": [1, 1]}},
    # A copy's start without its tables: KeyError out of the iterator.
    {"records": [{"kind": "snapshot_begin", "shard": "s", "tx_key": [2, 1]}, {"kind": "snapshot", "shard": "s"}]},
    # Applied keys that are not pairs of integers: TypeError comparing them with the feed's positions.
    {"records": [], "applied": {"s": "ab"}},
    {"records": [], "applied": {"s": [1, "x"]}},
    # A tx key of text was handed to the caller as TxKey('a', 'b').
    {"records": [{"kind": "change", "shard": "s", "tx_key": "ab"}]},
    {"records": [{"kind": "snapshot_end", "shard": "s", "tx_key": [1, -2]}]},
]


@pytest.mark.parametrize("garbage", CHANGES_GARBAGE, ids=repr)
def test_a_malformed_changes_page_is_a_bad_answer(node: ReplyingNode, garbage: dict[str, Any]) -> None:
    """The changefeed checked that each record had a known kind and a shard, nothing more: a record
    without the tx key or tables the feed reads, or an applied key that is no pair of integers, raised
    KeyError or TypeError out of the iterator (``ChangeFeed`` promises ``MnesiteError``), or reached the
    caller as it was."""
    node.result = {"positions": _POSITIONS, "applied": {"s": [1, 1]}, **garbage}
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client, pytest.raises(MnesiteError) as raised:
        next(iter(client.changes(["t"], after_tx_key={"s": (1, 1)})))
    assert raised.value.code == "bad_answer", raised.value


def test_well_formed_changes_pages_still_read(node: ReplyingNode) -> None:
    change = {"kind": "change", "shard": "s", "tx_key": [1, 2], "table": "t", "op": "write", "key": 1, "row": {}}
    copied = {"kind": "snapshot", "shard": "s", "tx_key": None, "table": "t", "op": "write", "key": 1, "row": {}}
    node.result = {"records": [change, copied], "positions": _POSITIONS, "applied": {"s": [1, 2]}, "new": 1}
    with Client(node.endpoint, timeout_ms=2000, retries=0) as client:
        feed = iter(client.changes(["t"], after_tx_key={"s": (1, 1)}))
        assert next(feed) == {**change, "tx_key": (1, 2)} and next(feed)["tx_key"] is None
        node.result = {"records": [], "positions": _POSITIONS, "applied": {"s": [1, 1]}}
        assert list(client.changes(["t"], after_tx_key={"s": (1, 1)})) == []


@pytest.mark.parametrize(
    ("call", "text"),
    [
        (lambda client: client.query("SELECT 1", timeout_ms=0), "timeout_ms must be an integer of at least 1, got 0"),
        (lambda client: client.query("SELECT 1", timeout_ms="100"), "timeout_ms must be an integer of at least 1"),
        (lambda client: client.query("SELECT 1", after_tx_key=(1, 1), timeout_ms="9"), "at least 1, got '9'"),
        (lambda client: client.call("status", timeout_ms=-5), "timeout_ms must be an integer of at least 1, got -5"),
        (lambda client: client.call("status", retries=-1), "retries must be an integer of at least 0, got -1"),
    ],
)
def test_a_call_refuses_a_timeout_or_retries_it_cannot_use(node: ReplyingNode, call: Callable, text: str) -> None:
    """The constructor refuses them, but a call's own ``timeout_ms`` (``query``'s) or ``retries`` did not:
    0 ended the call at once in "no connection to ... completed in time; is the node running?" of a
    node that was up, and a text one raised TypeError from inside it."""
    node.result = {"columns": ["a"], "rows": [[1]]}
    with Client(node.endpoint, timeout_ms=2000) as client:
        with pytest.raises(MnesiteError, match=text) as raised:
            call(client)
        assert raised.value.code == "bad_request"
        assert list(client.query("SELECT 1", timeout_ms=1000)) == [(1,)]  # a timeout it can use still works


def test_the_client_errors_cross_a_process_boundary_whole() -> None:
    """An exception a worker process raises reaches its parent pickled (multiprocessing, a process
    pool). ``OutcomeUnknown`` did not unpickle (its ``__init__`` takes the request id, which its args
    lacked): the parent got a TypeError in place of the error and lost the id that alone tells the
    write's outcome. Every error keeps its class, message, code and what it carries."""
    import pickle

    from mnesite.rlog.client import GuardFailed, OutcomeUnknown, Unavailable

    unknown = pickle.loads(pickle.dumps(OutcomeUnknown("outcome unknown: the transact may or may not", "r1")))
    assert type(unknown) is OutcomeUnknown and unknown.request_id == "r1" and unknown.code == "outcome_unknown"
    assert str(unknown) == "outcome unknown: the transact may or may not"
    stopped = Unavailable("node a: stopping", "stopping")
    stopped.sent = True
    guard = GuardFailed("guard 0 failed", "guard_failed", {"index": 0})
    for error in (stopped, guard, dbapi.OperationalError("refused", "overloaded")):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), str(copy), copy.code, vars(copy)) == (type(error), str(error), error.code, vars(error))
