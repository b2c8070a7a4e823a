"""Every CLI command through click's CliRunner, against a node served from a thread."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from mnesite.cli.main import KeyCommand, main

from tests.conftest import ThreadNode, free_port

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def mnesite(thread_node: ThreadNode):
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None, node: bool = True):
        argv = [*args, "--node", thread_node.endpoint] if node else list(args)
        return runner.invoke(main, argv, input=input, catch_exceptions=False)

    created = invoke(
        "table", "create", "users", "--key-column", "id", "--column", "id:INTEGER", "--column", "name:TEXT"
    )
    assert created.exit_code == 0, created.output
    return invoke


def test_table_create_and_list(mnesite) -> None:
    result = mnesite("table", "list", "--json")
    assert json.loads(result.output) == [
        {"table": "users", "shard": "default", "key": "id", "columns": [["id", "INTEGER"], ["name", "TEXT"]]}
    ]
    assert "users  default  id   id:INTEGER, name:TEXT" in mnesite("table", "list").output
    again = mnesite("table", "create", "users", "--key-column", "id")
    assert again.exit_code == 1 and "already exists" in again.output
    bad = mnesite("table", "create", "t2", "--key-column", "id", "--column", "x:DATE")
    assert bad.exit_code == 1 and "NAME:TYPE" in bad.output
    bad_name = mnesite("table", "create", "bad-name", "--key-column", "id")
    assert bad_name.exit_code == 1 and "invalid table name" in bad_name.output


def test_put_get_delete_scan(mnesite) -> None:
    put = mnesite("put", "users", '{"id": 1, "name": "ada"}', "--json")
    tx_key = json.loads(put.output)["tx_key"]
    assert put.exit_code == 0 and len(tx_key) == 2
    assert re.fullmatch(r"\(\d+, \d+\)\n", mnesite("put", "users", '{"id": 2, "name": "bob"}').output)
    assert json.loads(mnesite("get", "users", "1", "--json").output) == {"id": 1, "name": "ada"}
    assert json.loads(mnesite("get", "users", "1").output) == {"id": 1, "name": "ada"}
    assert json.loads(mnesite("scan", "users", "--json").output) == [
        {"id": 1, "name": "ada"},
        {"id": 2, "name": "bob"},
    ]
    assert mnesite("scan", "users").output.splitlines() == ["id  name", "1   ada", "2   bob"]
    assert json.loads(mnesite("scan", "users", "--limit", "1", "--json").output) == [{"id": 1, "name": "ada"}]
    assert mnesite("delete", "users", "1", "--json").exit_code == 0
    assert mnesite("get", "users", "1", "--json").output.strip() == "null"
    missing = mnesite("get", "users", "1")
    assert missing.exit_code == 1 and "no row at key" in missing.output
    linear = mnesite("get", "users", "2", "--consistency", "linearizable", "--json")
    assert json.loads(linear.output)["name"] == "bob"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("put", "users", "{not json"), "ROW_JSON is not valid JSON"),
        (("put", "users", "[1, 2]"), "ROW_JSON must be a JSON object"),
        (("put", "users", '{"id": "x"}'), "users.id is INTEGER"),
        (("put", "nope", '{"id": 1}'), "unknown table 'nope'"),
        (("get", "users", "abc"), "is not an integer"),
        (("get", "nope", "1"), "unknown table 'nope'"),
        (("delete", "nope", "1"), "unknown table 'nope'"),
        (("scan", "nope"), "unknown table 'nope'"),
        (("rlog", "tail", "nope"), "unknown shard 'nope'"),
    ],
)
def test_bad_input_is_one_clear_line(mnesite, args, message) -> None:
    result = mnesite(*args)
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_tx_from_stdin_with_guards(mnesite) -> None:
    mnesite("put", "users", '{"id": 1, "name": "ada"}')
    request = {
        "guards": [{"table": "users", "key": 1, "equals": {"id": 1, "name": "ada"}}],
        "ops": [
            {"op": "write", "table": "users", "row": {"id": 2, "name": "b"}},
            {"op": "delete", "table": "users", "key": 1},
        ],
    }
    ok = mnesite("tx", "-", "--json", input=json.dumps(request))
    assert ok.exit_code == 0 and json.loads(ok.output)["tx_key"]
    failed = mnesite("tx", "-", input=json.dumps(request))
    assert failed.exit_code == 1 and "guard 0 failed: users[1] should be equal to" in failed.output
    assert json.loads(mnesite("get", "users", "2", "--json").output) == {"id": 2, "name": "b"}
    garbage = mnesite("tx", "-", input="{")
    assert garbage.exit_code == 1 and "not valid JSON" in garbage.output
    shape = mnesite("tx", "-", input='{"op": []}')
    assert shape.exit_code == 1 and '{"guards": [...], "ops": [...]}' in shape.output


def test_status_text_shows_the_acknowledgements_the_agents_refused() -> None:
    """A growing count is a broken or hostile replicant: ``status`` says it in its text, in total and per agent."""
    from mnesite.cli.main import describe_agents

    status = {
        "agent_budget": {"used_bytes": 1234, "bytes_max": 16777216, "evicted_agents": 1, "acks_refused": 9},
        "agents": [
            {
                "agent": "a1",
                "replicant": "r1",
                "shard": "s",
                "mode": "normal",
                "acked": [1, 3],
                "lag_entries": 0,
                "acks_refused": 2,
                "frame_bytes_max": 65536,
            },
            {
                "agent": "a2",
                "replicant": "r2",
                "shard": "s",
                "mode": "normal",
                "acked": [1, 2],
                "lag_entries": 1,
                "acks_refused": 0,
            },
        ],
    }
    assert describe_agents(status) == [
        "agents: 2, holding 1234 of 16777216 bytes (agents_bytes_max), 1 evicted for that budget, "
        "9 acknowledgements refused",
        "agent a1 -> r1 (s, normal): acked (1, 3), lag 0, 2 acknowledgements refused, frame_bytes_max 65536",
        "agent a2 -> r2 (s, normal): acked (1, 2), lag 1, 0 acknowledgements refused, frame_bytes_max not told",
    ]


def test_status_text_of_a_replicant_says_whether_its_upstream_hears_the_sequencer_and_why_reads_stay_fenced() -> None:
    """``--json`` showed ``hears_sequencer`` and ``read_fence_error``; the text form showed neither."""
    from mnesite.cli.main import describe_read_fence_error, replica_row

    info = {
        "mode": "normal",
        "upstream": "core1",
        "hears_sequencer": True,
        "applied": [1, 5],
        "digest": "ab" * 32,
        "lag_entries": 0,
        "bootstraps": 1,
        "resumes": 0,
        "rows_copied": 10,
        "entries_buffered": 0,
        "read_fence_error": None,
    }
    assert replica_row("s", info)["hears sequencer"] == "yes"
    assert replica_row("s", {**info, "hears_sequencer": False})["hears sequencer"] == "no"
    assert replica_row("s", {**info, "upstream": None})["hears sequencer"] == "-", "no upstream: unknown"
    assert describe_read_fence_error("s", info) is None
    refused = {**info, "read_fence_error": "core1 refused read_index: no_sequencer: no quorum"}
    assert describe_read_fence_error("s", refused) == (
        "WARNING: shard s: reads stay fenced after its bootstrap, the committed key not told: "
        "core1 refused read_index: no_sequencer: no quorum"
    )


def test_status_text_marks_a_lazy_follower() -> None:
    """Its lag is by design (core.consensus, "Lazy followers"): the operator must not take it for a fault."""
    from mnesite.cli.main import describe_follower

    assert describe_follower("s", "core2", {"match": [1, 9], "lag_entries": 0, "lazy": False}) == (
        "s: follower core2 matched (1, 9), lag 0"
    )
    assert describe_follower("s", "core3", {"match": [1, 5], "lag_entries": 4, "lazy": True}) == (
        "s: follower core3 matched (1, 5), lag 4 (lazy: fed every lazy_feed_interval_ms)"
    )
    assert describe_follower("s", "core3", {"match": [1, 5], "lag_entries": 4}) == (
        "s: follower core3 matched (1, 5), lag 4"
    ), "a release without the field"


def test_status_text_shows_a_rebuilt_core_below_its_vote_floor() -> None:
    """An operator replacing disks one at a time must know when the rebuilt core holds again what it held."""
    from mnesite.cli.main import describe_vote_floor

    below = {"last": [4, 7], "vote_floor": [4, 12]}
    assert describe_vote_floor("default", below) == (
        "default: REBUILT, catching up: log at (4, 7), below its vote floor (4, 12); it votes only for logs "
        "that reach the floor and does not campaign; rebuild no other core until it passes"
    )
    assert describe_vote_floor("default", {"last": [4, 12], "vote_floor": [4, 12]}) is None
    assert describe_vote_floor("default", {"last": [5, 1], "vote_floor": [4, 12]}) is None
    assert describe_vote_floor("default", {"last": [0, 0], "vote_floor": [0, 0]}) is None, "no floor"
    assert describe_vote_floor("default", {"last": [3, 1]}) is None, "a release without the field"


def test_status_text_says_who_left_a_core_out_and_what_it_no_longer_serves() -> None:
    """``status`` printed the exclusion as a Python dict (``EXCLUDED {'by': 'core1', ...}``); it says
    in words who forced it, which generation and members, how the journals compare and what to do."""
    from mnesite.cli.main import describe_exclusion
    from mnesite.core.node import RESTARTED_VERDICT

    excluded = {"by": "core1", "generation": 4, "members": ["core1"], "verdict": "journals DIVERGE at (3, 9)"}
    assert describe_exclusion("default", {"excluded": excluded}) == (
        "default: EXCLUDED by a forced start of core1 (generation 4, members core1): journals DIVERGE at (3, 9); "
        "it serves no write nor read of the shard: rebuild it (empty data directory), then cluster add-core"
    )
    # A core restarted since it was told knows the generation only (the rest was logged when told).
    restarted = {"by": None, "generation": 4, "members": None, "verdict": RESTARTED_VERDICT}
    assert describe_exclusion("default", {"excluded": restarted}) == (
        f"default: EXCLUDED by a forced start (generation 4): {RESTARTED_VERDICT}; it serves no write nor read of "
        "the shard: rebuild it (empty data directory), then cluster add-core"
    )
    assert describe_exclusion("default", {"excluded": None}) is None
    assert describe_exclusion("default", {}) is None, "a release without the field"


def test_tx_from_file(mnesite, tmp_path) -> None:
    path = tmp_path / "tx.json"
    path.write_text(json.dumps({"ops": [{"op": "write", "table": "users", "row": {"id": 5}}]}))
    assert mnesite("tx", str(path)).exit_code == 0
    assert json.loads(mnesite("get", "users", "5", "--json").output) == {"id": 5, "name": None}


def test_status_and_rlog_tail(mnesite, thread_node: ThreadNode) -> None:
    tx_key = json.loads(mnesite("put", "users", '{"id": 1, "name": "ada"}', "--json").output)["tx_key"]
    status = json.loads(mnesite("status", "--json").output)
    assert status["node"] == "core1" and status["role"] == "core"
    shard = status["shards"]["default"]
    assert shard["applied"] == tx_key and shard["generation"] == tx_key[0] and len(shard["digest"]) == 64
    text = mnesite("status").output
    assert "default" in text
    assert (
        "agents: 0, holding 0 of 16777216 bytes (agents_bytes_max), 0 evicted for that budget, "
        "0 acknowledgements refused" in text
    )
    assert status["agent_budget"] == {"used_bytes": 0, "bytes_max": 16777216, "evicted_agents": 0, "acks_refused": 0}
    entries = json.loads(mnesite("rlog", "tail", "default", "-n", "2", "--json").output)
    assert [e["tx_key"] for e in entries][-1] == tx_key
    assert entries[-1]["digest"] == shard["digest"] and entries[-1]["prev"] == entries[0]["tx_key"]
    assert entries[-1]["ops"] == [{"op": "write", "table": "users", "row": {"id": 1, "name": "ada"}}]
    text = mnesite("rlog", "tail", "default").output
    assert "create_table users" in text and 'write users {"id": 1, "name": "ada"}' in text


def test_unreachable_node_is_one_clear_line_with_a_hint_and_fails_fast() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    began = time.monotonic()
    result = CliRunner().invoke(main, ["status", "--node", endpoint, "--timeout-ms", "5000"])
    elapsed_s = time.monotonic() - began
    assert result.exit_code == 1
    assert result.output == (
        f"Error: node {endpoint} is unreachable: nothing accepts connections there; is the node running? check --node\n"
    )
    # A refused connection is known at once: not after the 10 s that timeout and retry would take.
    assert elapsed_s < 2.5, elapsed_s


def test_node_option_defaults_to_the_environment(thread_node: ThreadNode) -> None:
    result = CliRunner().invoke(main, ["status", "--json"], env={"MNESITE_NODE": thread_node.endpoint})
    assert result.exit_code == 0 and json.loads(result.output)["node"] == "core1"


def test_start_refuses_an_invalid_config(tmp_path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[node]\nrole = "leader"\n')
    result = CliRunner().invoke(main, ["start", "--config", str(config)])
    assert result.exit_code == 1
    assert result.output.strip() == f'Error: {config}: [node].role must be "core" or "replicant", got \'leader\''


def test_rlog_verify(tmp_path, thread_node: ThreadNode, mnesite) -> None:
    mnesite("put", "users", '{"id": 1, "name": "ada"}')
    data_dir = thread_node.node.config.data_dir
    result = CliRunner().invoke(main, ["rlog", "verify", data_dir, "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["shards"]["default"]["ok"] is True
    not_mnesite = tmp_path / "empty"
    not_mnesite.mkdir()
    bad = CliRunner().invoke(main, ["rlog", "verify", str(not_mnesite)])
    assert bad.exit_code == 1 and "no such database" in bad.output


def test_rlog_verify_of_a_data_directory_changes_no_byte_of_it(tmp_path) -> None:
    # verify is a read-only check, but it opened a data directory read-write: WAL pragma, a
    # checkpointer thread, and SQLite's checkpoint at the last close, which moved a crashed node's
    # WAL into its database file and deleted the WAL. It now opens it read-only.
    node = ThreadNode(tmp_path / "data")
    # The loop closes the node as it stops: held back until its thread is done, since the store's
    # connection may be used by one thread at a time (called from here while the loop ran, apsw
    # raised ThreadingViolationError now and then).
    close = node.node.close
    node.node.close = lambda: None
    try:
        with node.client() as client:
            client.create_table("users", "id", [("id", "INTEGER"), ("name", "TEXT")])
            client.put("users", {"id": 1, "name": "ada"})
    finally:
        node.stop()
        node.node.store.disk_failed()  # as after a crash: the last pages stay in the WAL
        close()
    data_dir = Path(node.node.config.data_dir)

    def files() -> dict[str, bytes]:
        return {path.name: path.read_bytes() for path in sorted(data_dir.iterdir()) if path.is_file()}

    before = files()
    assert "mnesite.db-wal" in before and before["mnesite.db-wal"]
    result = CliRunner().invoke(main, ["rlog", "verify", str(data_dir), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["shards"]["default"]["ok"] is True, result.output
    after = files()
    assert after.keys() == before.keys() and all(
        after[name] == before[name] for name in before if name != "mnesite.db-shm"
    )


def all_commands(group, prefix=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from all_commands(command, (*prefix, name))
        else:
            yield " ".join((*prefix, name))


def test_every_command_is_documented_in_the_command_table() -> None:
    """The hand-kept table of docs/reference/cli.md (moved from the README); the generated reference
    below it is checked option by option in tests/test_docs_cli.py."""
    page = (REPO / "docs" / "reference" / "cli.md").read_text()
    missing = [name for name in all_commands(main) if f"| `mnesite {name}" not in page]
    assert not missing, f"docs/reference/cli.md's command table does not document: {missing}"


def test_every_command_has_help() -> None:
    for name in all_commands(main):
        result = CliRunner().invoke(main, [*name.split(), "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, name


def test_a_write_without_a_definite_answer_says_its_outcome_is_unknown(silent_endpoint: str) -> None:
    silent_node = silent_endpoint
    # The node took the write and never answered: it may have happened.
    result = CliRunner().invoke(main, ["put", "users", '{"id": 1}', "--node", silent_node, "--timeout-ms", "100"])
    assert result.exit_code == 3, result.output
    assert result.output.startswith("Error: outcome unknown: the transact may or may not have happened")
    assert "send it again with request id" in result.output
    read = CliRunner().invoke(main, ["get", "users", "1", "--node", silent_node, "--timeout-ms", "100"])
    assert read.exit_code == 1 and "outcome unknown" not in read.output


def test_an_unanswered_request_is_told_from_one_never_sent(silent_endpoint: str) -> None:
    """``Unavailable.sent``: what ``journal force-start`` tells exit 3 (it may have happened) from exit 1
    (nothing was sent) by; it read the error's wording before."""
    from mnesite.rlog.client import Client, Unavailable

    with Client(silent_endpoint, timeout_ms=100, retries=0) as client, pytest.raises(Unavailable) as silent:
        client.force_start()
    assert silent.value.sent
    nothing = f"tcp://127.0.0.1:{free_port()}"
    with Client(nothing, timeout_ms=100, retries=0) as client, pytest.raises(Unavailable) as unsent:
        client.force_start()
    assert not unsent.value.sent


def test_a_write_to_a_stopped_node_is_known_not_to_have_happened() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing accepts the connection: nothing was sent
    result = CliRunner().invoke(main, ["put", "users", '{"id": 1}', "--node", endpoint, "--timeout-ms", "100"])
    assert result.exit_code == 1, result.output
    assert "unreachable" in result.output and "outcome unknown" not in result.output


def test_get_and_scan_after_a_tx_key_read_your_writes(mnesite) -> None:
    put = mnesite("put", "users", '{"id": 7, "name": "eve"}')
    printed = put.output.strip()  # "(G, C)": what put prints is what --after takes
    assert json.loads(mnesite("get", "users", "7", "--after", printed, "--json").output) == {"id": 7, "name": "eve"}
    generation, counter = printed.strip("()").split(", ")
    scanned = mnesite("scan", "users", "--after", f"{generation},{counter}", "--json")
    assert {"id": 7, "name": "eve"} in json.loads(scanned.output)
    # A key this node has not applied: the read waits, then says so instead of answering stale.
    future = mnesite("get", "users", "7", "--after", f"{int(generation) + 1000},1", "--timeout-ms", "200")
    assert future.exit_code == 1 and "has not applied" in future.output
    bad = mnesite("get", "users", "7", "--after", "seven")
    assert bad.exit_code == 1 and "GENERATION,COUNTER" in bad.output  # usage errors: one Error: line, exit 1


def test_after_takes_a_key_per_shard_as_put_json_names_it(mnesite) -> None:
    """A tx key orders one shard's log: ``--after G,C`` waits for that key in every shard the read reads,
    so a key of a write to another shard made a read wait out its timeout for a position its own shard
    may never reach. ``put --json`` names the write's shard; ``--after SHARD=G,C`` (once per shard) waits
    for each key in its own shard only."""
    created = mnesite("table", "create", "events", "--key-column", "id", "--column", "id:INTEGER", "--shard", "busy")
    assert created.exit_code == 0, created.output
    for number in range(5):  # the busy shard's log runs ahead of the users table's shard
        assert mnesite("put", "events", json.dumps({"id": number})).exit_code == 0
    wrote = json.loads(mnesite("put", "events", '{"id": 99}', "--json").output)
    assert wrote["shard"] == "busy"
    generation, counter = wrote["tx_key"]
    user = json.loads(mnesite("put", "users", '{"id": 8, "name": "ann"}', "--json").output)
    assert user["shard"] == "default" and user["tx_key"][1] < counter
    # The events' key given for every shard: the users table's shard has no such position yet.
    unqualified = mnesite("get", "users", "8", "--after", f"{generation},{counter}", "--timeout-ms", "300")
    assert unqualified.exit_code == 1 and "has not applied" in unqualified.output
    # Named with its shard, it is no wait for the users table; the users' own key is, and is applied.
    after = ["--after", f"busy={generation},{counter}", "--after", "default={},{}".format(*user["tx_key"])]
    read = mnesite("get", "users", "8", *after, "--json", "--timeout-ms", "2000")
    assert read.exit_code == 0 and json.loads(read.output) == {"id": 8, "name": "ann"}
    assert json.loads(mnesite("get", "events", "99", *after, "--json").output) == {"id": 99}
    counted = mnesite("count", "events", "--after", f"busy={generation},{counter}", "--json")
    assert counted.exit_code == 0 and json.loads(counted.output)["rows"] == 6
    for wrong, said in [
        (["--after", "1,1", "--after", "2,2"], "SHARD=G,C once per shard"),
        (["--after", "1,1", "--after", "busy=2,2"], "not both"),
        (["--after", "=1,1"], "no shard"),
        (["--after", "busy=1,1", "--after", "busy=2,2"], "given twice"),
        (["--after", "busy=one"], "GENERATION,COUNTER"),
    ]:
        refused = mnesite("get", "users", "8", *wrong)
        assert refused.exit_code == 1 and said in refused.output, (wrong, refused.output)


def test_after_reads_a_tx_key_of_ascii_digits_only() -> None:
    """``--after G,C`` read G and C with int(), which also takes "1_000", "+5", " 7" inside a part and
    other scripts' digits: a mistyped key waited for another position. Each part is ASCII digits; the
    forms put, tx and --json print still read."""
    import click
    from mnesite.cli.main import parse_after
    from mnesite.rlog.types import TxKey

    for text in ("3,17", "3, 17", "(3, 17)", "[3, 17]", " (3,17) ", "0,0", f"{2**63 - 1},1"):
        assert parse_after((text,)) in (TxKey(3, 17), TxKey(0, 0), TxKey(2**63 - 1, 1)), text
    assert parse_after(("busy=(3, 17)", "default=4,5")) == {"busy": TxKey(3, 17), "default": TxKey(4, 5)}
    for text in ("1_000,1", "+3,17", "3,+17", "-3,17", "\u0663,17", "3,\uff11", "3,1 7", "3.0,17", "3,17,1",
                 "3", "(3,17", "3,17]", "3;17", "", "0x3,17", "3,\t17"):  # fmt: skip
        with pytest.raises(click.BadParameter, match="is not a tx key GENERATION,COUNTER: two ASCII digit runs"):
            parse_after((text,))
        with pytest.raises(click.BadParameter, match="is not a tx key"):
            parse_after((f"busy={text}",))
    for text in (f"{2**63},1", "1," + "9" * 5000):
        with pytest.raises(click.BadParameter, match="a tx key part is at most 9223372036854775807"):
            parse_after((text,))
    # On the command line: a usage error, one Error: line and exit 1, before any connection.
    refused = CliRunner().invoke(main, ["get", "users", "7", "--after", "3,1_7", "--node", "tcp://127.0.0.1:1"])
    assert refused.exit_code == 1 and "'3,1_7' is not a tx key GENERATION,COUNTER" in refused.output, refused.output


def test_a_force_start_the_node_answers_too_late_is_sent_once_and_said_to_be_unknown(tmp_path: Path) -> None:
    """A force start waits up to 2 s for the members' journals before the core answers. The CLI's
    client, hearing nothing within --timeout-ms, sent force_start again: a second force start, which
    the first one's reduced membership refuses. The operator read `did not answer force_start` (exit
    1) while the core had been forced."""
    import zmq
    from mnesite.rlog.store import Store

    silent = [zmq.Context.instance().socket(zmq.ROUTER) for _ in range(2)]
    port = free_port()
    cores = {"core1": f"tcp://127.0.0.1:{port}"}
    for name, socket in zip(("core2", "core3"), silent, strict=True):
        socket.setsockopt(zmq.LINGER, 0)
        cores[name] = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    (tmp_path / "data").mkdir()
    store = Store(str(tmp_path / "data" / "mnesite.db"))
    with store.write_transaction():
        store.ensure_shard("default", 0)  # a shard, so that there is something to force
    store.close()
    node = ThreadNode(tmp_path / "data", {"cluster": {"core_nodes": cores}}, port=port)
    calls = []
    force_start = node.node.force_start
    node.node.force_start = lambda: calls.append(1) or force_start()
    try:
        argv = ["journal", "force-start", "--yes", "--node", node.endpoint, "--timeout-ms", "300"]
        result = CliRunner().invoke(main, argv)
        with node.client(timeout_ms=10_000) as client:
            journal = client.journal()  # answered after every force_start the node was sent
        assert journal["shards"]["default"]["forced"]
        assert len(calls) == 1
        assert result.exit_code == 3, result.output
        assert "may have happened" in result.output and "journal show" in result.output
    finally:
        node.stop()
        for socket in silent:
            socket.close(0)


def test_get_of_a_missing_key_exits_1_and_with_json_prints_null_and_exits_0(mnesite) -> None:
    """What docs/reference/cli.md says of ``get``: a missing row is an ``Error:`` line and exit 1; with
    ``--json`` it is ``null`` and exit 0 (a script reads the answer, and a failure still exits 1)."""
    missing = mnesite("get", "users", "404")
    assert (missing.exit_code, missing.stdout, missing.stderr) == (1, "", "Error: users: no row at key '404'\n")
    as_json = mnesite("get", "users", "404", "--json")
    assert (as_json.exit_code, as_json.stdout, as_json.stderr) == (0, "null\n", "")
    failed = mnesite("get", "nope", "404", "--json")
    assert failed.exit_code == 1 and failed.stdout == "" and "unknown table 'nope'" in failed.stderr


@pytest.mark.parametrize("typed", ["1_000", "+5", " 12 ", "12 ", "\u0663", "\uff15", "1 000", "0x10", "5\n", "", "-"])
def test_an_integer_key_is_ascii_digits_and_nothing_else(mnesite, typed: str) -> None:
    """Python's int() read ``1_000`` as 1000, ``+5`` as 5, `` 12 `` as 12 and ``٣`` (Arabic-Indic
    three) as 3: a key typed wrong read or deleted another row. A key is ASCII digits, with a leading
    minus for a negative one; anything else is refused, saying so, and nothing is read or written."""
    for key in (1000, 5, 12, 3, 10):
        assert mnesite("put", "users", json.dumps({"id": key, "name": str(key)})).exit_code == 0
    for command in ("get", "delete"):
        refused = mnesite(command, "users", typed)
        assert refused.exit_code == 1 and refused.stdout == "", refused.output
        assert refused.stderr == (
            f"Error: users.id is INTEGER; {typed!r} is not an integer (give ASCII digits, with a leading - for "
            "a negative key)\n"
        )
    refused = mnesite("scan", "users", "--from", typed)
    assert refused.exit_code == 1 and "is not an integer" in refused.stderr
    assert len(json.loads(mnesite("scan", "users", "--json").stdout)) == 5  # nothing deleted


@click.command(cls=KeyCommand)
@click.argument("table")
@click.argument("key")
@click.option("--timeout-ms", type=click.IntRange(1, None), default=5)
@click.option("-t", "--tag", default=None)
@click.option("--pair", nargs=2, default=None)
@click.option("--json", "as_json", is_flag=True)
@click.option("-v", "verbose", count=True)
def _key_command(**params) -> None:
    """A command as ``get``, with a short option, a two-value option and a count besides."""


@pytest.mark.parametrize(
    ("words", "parsed"),
    [
        ("t -5", {"key": "-5"}),
        ("-5 t", {"table": "-5", "key": "t"}),
        ("t --json -5", {"key": "-5", "as_json": True}),
        ("t -5 --json", {"key": "-5", "as_json": True}),
        ("t -- -5", {"key": "-5"}),
        ("t -5 --timeout-ms 7", {"key": "-5", "timeout_ms": 7}),
        ("t -t -5 -6", {"key": "-6", "tag": "-5"}),
        ("t --tag=-5 -6", {"key": "-6", "tag": "-5"}),
        ("t -t-5 -6", {"key": "-6", "tag": "-5"}),
        ("t -vt -5 -6", {"key": "-6", "tag": "-5", "verbose": 1}),
        ("t -vv -6", {"key": "-6", "verbose": 2}),
        ("t --pair -1 -2 -6", {"key": "-6", "pair": ("-1", "-2")}),
        ("t --pair=-1 -2 -6", {"key": "-6", "pair": ("-1", "-2")}),
        ("t -5 --timeout-ms -5", "Invalid value for '--timeout-ms': -5 is not in the range x>=1."),
        ("t -5 --tag", "Option '--tag' requires an argument."),
        ("t -5 --pair -1", "Option '--pair' requires 2 arguments."),
        ("t --jsn -5", "No such option '--jsn'. Did you mean '--json'?"),
        ("t -5 --jsn", "No such option '--jsn'. Did you mean '--json'?"),
        ("t -5 -x", "No such option '-x'."),
        ("t -5 -6", "Got unexpected extra argument (-6)"),
        ("t -5 -- x", "Got unexpected extra argument (x)"),
        ("t -5 --json=1", "Option '--json' does not take a value."),
    ],
)
def test_a_key_command_reads_a_negative_integer_as_an_argument_and_all_else_as_click_does(
    words: str, parsed: dict | str
) -> None:
    """``KeyCommand`` (``get``, ``delete``) reads a word of a minus and digits as an argument where
    click would read an option; an option's values, joined or not, stay its values, and every refusal
    is click's own. It once patched a private method of click's parser; it now reorders the words
    before click parses them, through click's public API only, with the same outcomes."""
    try:
        context = _key_command.make_context("key", words.split())
    except click.UsageError as error:
        assert error.format_message() == parsed
    else:
        defaults = {"table": "t", "timeout_ms": 5, "tag": None, "pair": None, "as_json": False, "verbose": 0}
        assert context.params == {**defaults, **parsed}


def test_a_negative_key_needs_no_double_dash(mnesite, thread_node: ThreadNode) -> None:
    """``mnesite get users -5`` was ``No such option '-5'``: a negative key had to follow ``--``. A word
    of a minus and digits is KEY for ``get`` and ``delete``; options around it are parsed as before."""
    assert mnesite("put", "users", '{"id": -5, "name": "neg"}').exit_code == 0
    assert json.loads(mnesite("get", "users", "-5").stdout) == {"id": -5, "name": "neg"}
    assert json.loads(mnesite("get", "users", "-5", "--json").stdout) == {"id": -5, "name": "neg"}
    assert json.loads(mnesite("get", "users", "--json", "-5").stdout) == {"id": -5, "name": "neg"}
    after_dashes = mnesite("get", "users", "--node", thread_node.endpoint, "--", "-5", node=False)
    assert json.loads(after_dashes.stdout) == {"id": -5, "name": "neg"}  # as before
    assert json.loads(mnesite("scan", "users", "--from", "-5", "--json").stdout) == [{"id": -5, "name": "neg"}]
    assert mnesite("get", "users", "-0", "--json").stdout == "null\n"
    timeout = mnesite("get", "users", "-5", "--timeout-ms", "-5")  # an option's value stays its value
    assert timeout.exit_code == 1 and "Invalid value for '--timeout-ms'" in timeout.stderr
    typo = mnesite("get", "users", "--jsn", "-5")  # other words that look like options still are
    assert typo.exit_code == 1 and "No such option '--jsn'" in typo.stderr
    assert json.loads(mnesite("delete", "users", "-5", "--json").stdout)["tx_key"]
    assert mnesite("get", "users", "-5", "--json").stdout == "null\n"
    # Where no argument takes it, -5 is still refused, and the refusal says how to pass one.
    refused = mnesite("scan", "users", "-5")
    assert refused.exit_code == 1 and "No such option '-5'" in refused.stderr and "goes after --" in refused.stderr
