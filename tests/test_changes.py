"""The changefeed (rlog.changes): the page rule against a real store, and a thread node end to end.

The acceptance runs with real processes (failover mid-stream, a trimmed start) are in
tests/test_changes_cluster.py."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from mnesite.bootstrap.serve import read_batch
from mnesite.cli.main import main
from mnesite.rlog import messages
from mnesite.rlog.changes import COPY_STALL_PAGES_MAX, PageLimits, build_page, live, position_to_wire
from mnesite.rlog.client import Client, InvalidRequest, MnesiteError, RemoteError
from mnesite.rlog.messages import ChangesPosition
from mnesite.rlog.server import StoreFeedReader
from mnesite.rlog.store import Store
from mnesite.rlog.types import ZERO_KEY, TxKey

from tests.conftest import RouterNode, ScriptedNode, ThreadNode, wait_until

pytestmark = pytest.mark.timeout(60)


def apply_feed(records, state: dict | None = None) -> dict:
    """A consumer: {table: {key: row}} from records, as the docs tell a consumer to apply them."""
    state = {} if state is None else state
    for record in records:
        kind = record["kind"]
        if kind == "snapshot_begin":
            for table in record["tables"]:
                state[table] = {}
        elif kind in ("change", "snapshot"):
            table = state.setdefault(record["table"], {})
            if record["op"] == "write":
                table[record["key"]] = record["row"]
            elif record["op"] == "delete":
                table.pop(record["key"], None)
            elif record["op"] == "drop_table":
                state.pop(record["table"], None)
    return state


def _put_users(client: Client, ids: range) -> list[TxKey]:
    """Writes users ``{"id": i, "name": f"n{i}"}`` for each ``i`` of ``ids``, an entry each: their keys."""
    return [client.put("users", {"id": i, "name": f"n{i}"}) for i in ids]


def table_rows(client: Client, table: str) -> dict:
    key = client.table(table)["key"]
    return {row[key]: row for row in client.scan(table)}


@pytest.fixture
def node(tmp_path: Path):
    thread_node = ThreadNode(tmp_path / "data", extra={"limits": {"changes_page_records_max": 7}})
    with thread_node.client() as client:
        client.create_table("users", "id", [("id", "INTEGER"), ("name", "TEXT")])
        client.create_table("other", "id", [("id", "INTEGER"), ("v", "INTEGER")])
    try:
        yield thread_node
    finally:
        thread_node.stop()


def test_every_change_in_log_order_with_its_key_and_row_and_resume_is_strictly_after(node) -> None:
    with node.client() as client:
        keys = _put_users(client, range(20))
        client.put("other", {"id": 1, "v": 1})
        with client.transaction() as tx:  # one entry, two ops: they travel together
            tx.put("users", {"id": 100, "name": "x"})
            tx.delete("users", 3)
        last = client.last_tx_key
        records = list(client.changes(["users"]))
        changes = [r for r in records if r["kind"] == "change"]
        writes = [r for r in changes if r["op"] == "write"]
        assert [r["tx_key"] for r in writes[:20]] == keys
        assert all(r["table"] == "users" for r in changes)  # the filter
        assert writes[0]["row"] == {"id": 0, "name": "n0"} and writes[0]["key"] == 0
        assert changes[0]["op"] == "create_table" and changes[0]["definition"]["key"] == "id"
        assert [(r["op"], r["key"]) for r in changes[-2:]] == [("write", 100), ("delete", 3)]
        assert changes[-1]["tx_key"] == changes[-2]["tx_key"] == last
        keys_seen = [r["tx_key"] for r in changes]
        assert keys_seen == sorted(keys_seen)
        assert apply_feed(records)["users"] == table_rows(client, "users")
        # Resume strictly after a key: nothing before or at it comes again.
        resumed = [r for r in client.changes(["users"], after_tx_key=keys[9]) if r["kind"] == "change"]
        assert [r["tx_key"] for r in resumed] == keys[10:] + [last, last]
        feed = client.changes(["users"])
        assert len(list(feed)) == len(records) and feed.pages_fetched > 3  # pages of at most 7 records
        assert feed.position == {"default": last}
        assert list(client.changes(["users"], after_tx_key=feed.cursor)) == []


@contextlib.contextmanager
def trimmed_past_the_first_write(
    tmp_path: Path, writes: int, delete: int | None = None
) -> Iterator[tuple[Client, TxKey]]:
    """A node keeping 5 entries, pages of 4 records, ``users`` with ``writes`` rows written (then the
    row ``delete`` deleted) and its first write trimmed from the log: a client and that write's key."""
    thread_node = ThreadNode(
        tmp_path / "data",
        extra={
            "rlog": {"retention_entries_max": 5, "retention_interval_ms": 10},
            "limits": {"changes_page_records_max": 4},
        },
    )
    try:
        with thread_node.client() as client:
            client.create_table("users", "id", [("id", "INTEGER"), ("name", "TEXT")])
            first = client.put("users", {"id": 0, "name": "zero"})
            for i in range(1, writes):
                client.put("users", {"id": i, "name": f"n{i}"})
            if delete is not None:
                client.delete("users", delete)
            # Past the entry after the first write, not only the first write: a log trimmed exactly to
            # it still holds everything after it, and a feed from there needs no copy (this raced the
            # retention passes of a loaded machine).
            after_first = [first[0], first[1] + 1]
            wait_until(lambda: client.rlog_entries("default")[0]["tx_key"] > after_first, 10, "the log trimmed")
            yield client, first
    finally:
        thread_node.stop()


def test_a_trimmed_position_gets_a_copy_at_one_key_then_the_changes_and_ends_equal(tmp_path: Path) -> None:
    with trimmed_past_the_first_write(tmp_path, 40, delete=5) as (client, first):
        feed = client.changes(["users"], after_tx_key=first)
        records = []
        for record in feed:
            records.append(record)
            if sum(r["kind"] == "snapshot" for r in records) == 3:
                # Writes while the copy is read: the replay heals what the dirty reads saw.
                client.put("users", {"id": 1, "name": "changed"})
                client.delete("users", 39)
                client.put("users", {"id": 1000, "name": "new"})
        kinds = [r["kind"] for r in records]
        assert kinds[0] == "snapshot_begin" and "fell behind" in records[0]["reason"]
        end = kinds.index("snapshot_end")
        assert set(kinds[1:end]) == {"snapshot"}
        assert records[end]["tx_key"] >= records[0]["tx_key"]
        assert apply_feed(records)["users"] == table_rows(client, "users")
        assert feed.position == {"default": TxKey(*client.status()["shards"]["default"]["applied"])}


def _resumed_after_each_record(client: Client, tables: list[str], records: list, cursors: list) -> None:
    """Resuming from the cursor saved after record k gives exactly what follows it, once record k ends
    its entry (or a copy); inside an entry the resume repeats that entry from its start."""
    for k, cursor in enumerate(cursors):
        rest = list(client.changes(tables, after_tx_key=cursor))
        record = records[k]
        ends_entry = (
            k + 1 == len(records)
            or record["kind"] in ("snapshot_begin", "snapshot_end")
            or (record["kind"] == "change" and records[k + 1]["tx_key"] != record["tx_key"])
        )
        if ends_entry:
            assert rest == records[k + 1 :], (k, record, rest[:2])
        elif record["kind"] == "change":
            start = next(i for i, r in enumerate(records) if r["tx_key"] == record["tx_key"])
            assert rest == records[start:], (k, record, rest[:2])


def test_a_cursor_saved_after_each_record_resumes_with_what_was_not_applied(node) -> None:
    """The docs' consumer saves ``feed.cursor`` after each record it applied. The cursor moved only
    once the next record was asked for: a consumer that stopped right after an entry's last record
    got that entry again on resuming, and after ``snapshot_end`` the whole copy again."""
    with node.client() as client:
        for i in range(10):
            client.put("users", {"id": i, "name": f"n{i}"})
        with client.transaction() as tx:  # one entry of three records
            for i in range(10, 13):
                tx.put("users", {"id": i, "name": f"n{i}"})
        for i in range(13, 18):
            client.put("users", {"id": i, "name": f"n{i}"})
        feed = client.changes(["users"], after_tx_key=ZERO_KEY)
        records, cursors = [], []
        for record in feed:
            records.append(record)
            cursors.append(feed.cursor)
        assert len(records) == 19  # create_table and 18 writes, over pages of 7
        unmoved = client.changes(["users"]).cursor  # a feed from the log's start, before its first page
        assert unmoved == [] and list(client.changes(["users"], after_tx_key=unmoved)) == records
        _resumed_after_each_record(client, ["users"], records, cursors)


def test_a_cursor_saved_after_a_copy_ends_does_not_copy_again(tmp_path: Path) -> None:
    with trimmed_past_the_first_write(tmp_path, 12) as (client, first):
        feed = client.changes(["users"], after_tx_key=first)
        records, cursors = [], []
        for record in feed:
            records.append(record)
            cursors.append(feed.cursor)
        end = [r["kind"] for r in records].index("snapshot_end")
        assert list(client.changes(["users"], after_tx_key=cursors[end])) == records[end + 1 :]


def test_follow_waits_for_the_next_change_and_hands_it_over(node) -> None:
    with node.client() as client:
        client.put("users", {"id": 1, "name": "a"})
        start = client.last_tx_key
    got: list = []

    def consume() -> None:
        with node.client() as consumer:
            for record in consumer.changes(["users"], after_tx_key=start, follow=True, wait_ms=200):
                got.append(record)
                return

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    with node.client() as client:
        written = client.put("users", {"id": 2, "name": "b"})
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert [(r["tx_key"], r["row"]) for r in got] == [(written, {"id": 2, "name": "b"})]


def test_hostile_positions_are_refused_with_a_clear_error(node) -> None:
    with node.client() as client:
        for positions, code in [
            ([{"shard": "default", "after": [0, 0], "phase": "copy"}], "bad_request"),
            ([{"shard": "default", "after": [0, 0]}, {"shard": "default", "after": [0, 1]}], "bad_request"),
            ([{"shard": "default", "after": [5, 0], "phase": "replay", "replay_to": [1, 0]}], "bad_request"),
        ]:
            with pytest.raises(RemoteError) as error:
                client.call("changes", {"positions": positions})
            assert error.value.code == code
        with pytest.raises(InvalidRequest):
            client.call("changes", {"positions": [{"shard": "default", "after": [0, 2**64]}]})
        with pytest.raises(MnesiteError) as error:
            list(client.changes(["nope"]))
        assert error.value.code == "unknown_table"
        assert client.get("users", 1) is None  # still serving


def test_the_page_rule_against_a_store_moves_by_whole_entries_within_its_bounds(node) -> None:
    with node.client() as client:
        with client.transaction() as tx:
            for i in range(10):  # one entry of ten ops: above the page's 3 records, it goes alone
                tx.put("users", {"id": i, "name": "x" * 10})
        client.put("users", {"id": 99, "name": "y"})
        # The acknowledgement may leave before its turn's commit (NodeServer.reply); a read is served in
        # a later turn, after it, so the file read below holds the write.
        assert client.get("users", 99) == {"id": 99, "name": "y"}
    # A connection of the test's own: the node's loop keeps its own.
    store = Store(node.node.store.path, readonly=True)
    reader = StoreFeedReader(store, read_batch)
    page = build_page(reader, ["users"], [live("default", ZERO_KEY)], PageLimits(3, 1_000_000))
    assert [r["op"] for r in page.records] == ["create_table"]
    page = build_page(reader, ["users"], page.positions, PageLimits(3, 1_000_000))
    assert len(page.records) == 10 and len({tuple(r["tx_key"]) for r in page.records}) == 1
    assert list(page.positions[0].after) == page.records[0]["tx_key"]
    page = build_page(reader, ["users"], page.positions, PageLimits(3, 1_000_000))
    assert [r["key"] for r in page.records] == [99] and not page.caught_up
    page = build_page(reader, ["users"], page.positions, PageLimits(3, 1_000_000))
    assert page.records == [] and page.caught_up
    # A copy position on a node behind the snapshot's start waits instead of copying older rows.
    ahead = store.shard("default").applied
    ahead = TxKey(ahead.generation, ahead.counter + 5)
    waiting = ChangesPosition(shard="default", after=ahead, phase="copy", table="users", replay_to=ahead)
    page = build_page(reader, ["users"], [waiting], PageLimits(3, 1_000_000))
    assert page.records == [] and page.caught_up and page.positions == [waiting]
    store.close()


def test_two_shards_each_in_its_own_log_order_and_resume_is_a_position_per_shard(node) -> None:
    with node.client() as client:
        client.create_table("posts", "id", [("id", "INTEGER"), ("title", "TEXT")], "content")
        written: dict[str, list] = {"default": [], "content": []}
        for i in range(30):
            written["default"].append(client.put("users", {"id": i, "name": "u"}))
            written["content"].append(client.put("posts", {"id": i, "title": "p"}))
        feed = client.changes(["users", "posts"])
        records = [r for r in feed if r["kind"] == "change" and r["op"] == "write"]
        for shard in ("default", "content"):
            assert [r["tx_key"] for r in records if r["shard"] == shard] == written[shard]
        assert feed.position == {"default": written["default"][-1], "content": written["content"][-1]}
        # A position per shard: each shard resumes strictly after its own key.
        middle = {"default": written["default"][9], "content": written["content"][19]}
        resumed = [r for r in client.changes(["users", "posts"], after_tx_key=middle) if r["kind"] == "change"]
        assert [r["tx_key"] for r in resumed if r["shard"] == "default"] == written["default"][10:]
        assert [r["tx_key"] for r in resumed if r["shard"] == "content"] == written["content"][20:]


def test_a_following_consumer_is_held_while_only_other_tables_change(node) -> None:
    with node.client() as client:
        start = client.put("users", {"id": 1, "name": "a"})
    got: list = []
    feeds: list = []

    def consume() -> None:
        with node.client() as consumer:
            feed = consumer.changes(["users"], after_tx_key=start, follow=True, wait_ms=5000)
            feeds.append(feed)
            for record in feed:
                got.append(record)
                return

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    with node.client() as client:
        for i in range(50):
            client.put("other", {"id": i, "v": i})
        written = client.put("users", {"id": 2, "name": "b"})
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert [r["tx_key"] for r in got] == [written]
    # Held at the node while the other table changed: not a page per write of it.
    assert feeds[0].pages_fetched <= 3


def test_cli_changes(node) -> None:
    runner = CliRunner()

    def mnesite(*args: str):
        return runner.invoke(main, [*args, "--node", node.endpoint], catch_exceptions=False)

    with node.client() as client:
        first = client.put("users", {"id": 1, "name": "ada"})
        second = client.put("users", {"id": 2, "name": "bob"})
        client.delete("users", 1)
        last = client.last_tx_key
    lines = mnesite("changes", "users", "--from", f"{first.generation},{first.counter}", "--json")
    assert lines.exit_code == 0, lines.output
    records = [json.loads(line) for line in lines.stdout.splitlines()]
    assert [(r["tx_key"], r["op"], r["key"]) for r in records] == [
        (list(second), "write", 2),
        (list(last), "delete", 1),
    ]
    assert records[0]["row"] == {"id": 2, "name": "bob"}
    text = mnesite("changes", "users", "--from", f"default:{second.generation},{second.counter}")
    assert text.stdout.splitlines() == [f"{last} default users delete 1"]
    assert f"resume with --from default:{last.generation},{last.counter}" in text.stderr
    bad = mnesite("changes", "--from", "a:1,1", "--from", "nonsense")
    assert bad.exit_code != 0
    unknown = mnesite("changes", "nope")
    assert unknown.exit_code == 1 and "unknown table 'nope'" in unknown.output


def test_cli_changes_resume_line_of_several_shards_can_be_given_back(node) -> None:
    """With tables of several shards the resume line said "--from a:G,C b:G,C": given back as printed,
    the second position was taken for a TABLE. Each position has its own --from."""
    import shlex

    runner = CliRunner()
    with node.client() as client:
        client.create_table("far", "id", [("id", "INTEGER")], shard="far")
        client.put("users", {"id": 1, "name": "ada"})
        client.put("far", {"id": 1})
    first = runner.invoke(main, ["changes", "users", "far", "--node", node.endpoint])
    assert first.exit_code == 0, first.output
    resume = first.stderr.splitlines()[-1].split("resume with ", 1)[1]
    with node.client() as client:
        last = client.put("far", {"id": 2})
    again = runner.invoke(main, ["changes", "users", "far", *shlex.split(resume), "--node", node.endpoint])
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines() == [f"{last} far far write 2 " + '{"id": 2}']


def _feed_raising_once_caught_up(node, monkeypatch, error: BaseException) -> TxKey:
    """Two writes; every ``ChangeFeed`` page fetch after the one that delivered the second raises ``error``."""
    from mnesite.rlog.client import ChangeFeed

    with node.client() as client:
        client.put("users", {"id": 1, "name": "ada"})
        last = client.put("users", {"id": 2, "name": "bob"})
    real_fetch_page = ChangeFeed.fetch_page
    delivered: dict[int, tuple] = {}  # per feed (each CLI run makes its own), kept alive: no id reused

    def raising_once_caught_up(feed):
        _, keys = delivered.setdefault(id(feed), (feed, []))
        if last in keys:
            raise error
        records, positions = real_fetch_page(feed)
        keys.extend(record.get("tx_key") for record in records)
        return records, positions

    monkeypatch.setattr(ChangeFeed, "fetch_page", raising_once_caught_up)
    return last


def test_cli_changes_follow_ended_by_ctrl_c_exits_0_and_names_the_resume_position(node, monkeypatch) -> None:
    """Ctrl-C is how ``changes --follow`` ends. It printed "Error: aborted" and exited 1, and the line
    naming the position to resume from (what a follower needs most) was never printed."""
    # The operator's Ctrl-C while the feed waits for more.
    last = _feed_raising_once_caught_up(node, monkeypatch, KeyboardInterrupt())
    result = CliRunner().invoke(main, ["changes", "users", "--follow", "--node", node.endpoint])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == f"{last} default users write 2 " + '{"id": 2, "name": "bob"}'
    assert f"resume with --from default:{last.generation},{last.counter}" in result.stderr
    assert "Error" not in result.stderr


def test_cli_changes_that_lose_their_node_still_name_the_resume_position(node, monkeypatch) -> None:
    """A feed whose node stops answering ended with only "Error: ...": the position to resume from,
    which a table-filtered feed cannot rebuild from the records it printed, was lost with it."""
    from mnesite.rlog.client import Unavailable

    last = _feed_raising_once_caught_up(node, monkeypatch, Unavailable("did not answer changes within 1000 ms"))
    for json_flag in ([], ["--json"]):
        result = CliRunner().invoke(main, ["changes", "users", "--follow", *json_flag, "--node", node.endpoint])
        assert result.exit_code == 1, result.output
        lines = result.stderr.splitlines()
        assert lines[-1] == "Error: did not answer changes within 1000 ms", lines
        assert f"resume with --from default:{last.generation},{last.counter}" in lines[-2], lines


def test_a_transaction_whose_records_outgrow_a_frame_reaches_the_consumer_over_several_pages(tmp_path: Path) -> None:
    # 1,000 rows of 200 bytes: the write fits a 256 KiB frame, its change records (about 60 bytes more
    # each) do not; they used to be answered too_large, and the feed could not pass the entry.
    limits = {
        "frame_bytes_max": 256 * 1024,
        "query_page_bytes_max": 128 * 1024,
        "changes_page_bytes_max": 64 * 1024,
    }
    thread_node = ThreadNode(tmp_path / "data", extra={"limits": limits})
    try:
        with thread_node.client() as client:
            client.create_table("users", "id", [("id", "INTEGER"), ("name", "TEXT")])
            client.put("users", {"id": 0, "name": "first"})
            big = client.transact(
                [{"op": "write", "table": "users", "row": {"id": i, "name": "n" * 200}} for i in range(1, 1001)]
            )
            client.put("users", {"id": 5000, "name": "last"})
            feed = client.changes(["users"])
            records = [record for record in feed if record["kind"] == "change" and record["op"] == "write"]
            cursors = feed.pages_fetched
        assert [record["key"] for record in records] == [0, *range(1, 1001), 5000]
        assert [record["tx_key"] for record in records[1:1001]] == [big] * 1000
        assert cursors >= 5  # about 300 KB of records in pages of at most 64 KiB
    finally:
        thread_node.stop()


def test_a_held_feed_of_every_table_wakes_for_a_shard_created_while_it_waits(node) -> None:
    """A held request was paged again only when a shard it had a position in moved: a feed of every
    table, held before a new shard's first entry, heard of it only at the end of its wait_ms."""
    with node.client() as client:
        client.put("users", {"id": 1, "name": "a"})
        feed = client.changes(None)
        for _record in feed:
            pass
        cursor = feed.cursor
    got: list = []

    def consume() -> None:
        with node.client(timeout_ms=30_000) as consumer:
            for record in consumer.changes(None, after_tx_key=cursor, follow=True, wait_ms=20_000):
                got.append(record)
                return

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_until(lambda: node.node.changes_statistics()["held"] == 1, 10, "the request to be held")
    with node.client() as client:
        client.create_table("posts", "id", [("id", "INTEGER"), ("title", "TEXT")], "content")
    thread.join(timeout=8)  # well inside the 20 s wait
    assert not thread.is_alive(), "the held feed did not wake for the new shard"
    assert got and got[0]["shard"] == "content" and got[0]["op"] == "create_table"


def test_a_held_request_is_paged_again_from_where_its_last_page_ended_not_from_its_start(node, monkeypatch) -> None:
    """A held request was paged again from the positions it arrived with: each turn that moved its
    shard read every entry since then again (quadratic in the writes of the wait, on the loop thread;
    up to 2,000 entries per held request per turn). Paged from where its last page ended, each entry
    is read about once."""
    entries_read = [0]
    entries_after = StoreFeedReader.entries_after

    def counted(self, shard, after, limit, up_to):
        entries = entries_after(self, shard, after, limit, up_to)
        entries_read[0] += len(entries)
        return entries

    monkeypatch.setattr(StoreFeedReader, "entries_after", counted)
    with node.client() as client:
        start = client.put("users", {"id": 1, "name": "a"})
    got: list = []

    def consume() -> None:
        with node.client(timeout_ms=20_000) as consumer:
            feed = consumer.changes(["users"], after_tx_key=start, follow=True, wait_ms=15_000)
            for record in feed:
                got.append(record)
                return

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_until(lambda: node.node.changes_statistics()["held"] == 1, 10, "the request to be held")
    writes = 60
    with node.client() as client:
        for i in range(writes):
            client.put("other", {"id": i, "v": i})
        written = client.put("users", {"id": 2, "name": "b"})
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert [r["tx_key"] for r in got] == [written]
    assert entries_read[0] <= 3 * (writes + 1), f"{entries_read[0]} entries read for {writes + 1} written"


def test_a_copy_page_costs_its_rows_not_a_count_of_the_table(node, monkeypatch) -> None:
    """A copy's first page of each table went through the bootstrap's first batch, which counts the
    table's rows (up to 500,001, for a bootstrap's progress) in the node's loop: a page of one record
    cost a count of the whole table, and the feed threw the count away. A page costs its rows only."""
    counted: list[str] = []
    count_rows = Store.count_rows

    def recorded(self, table, limit=None):
        counted.append(table.name)
        return count_rows(self, table, limit)

    with node.client() as client:
        for i in range(20):
            client.put("users", {"id": i, "name": f"n{i}"})
        applied = client.status()["shards"]["default"]["applied"]
        monkeypatch.setattr(Store, "count_rows", recorded)
        position = {"shard": "default", "after": applied, "phase": "copy", "table": "users", "replay_to": applied}
        page = client.call("changes", {"tables": ["users"], "positions": [position], "page_records": 1})
    assert [record["kind"] for record in page["records"]] == ["snapshot"]
    assert counted == []


def test_writes_before_a_table_is_dropped_and_made_again_keep_the_key_of_their_own_definition(node) -> None:
    """A feed read from a position after a table's creation met its writes with the key column of the
    catalog, the table as it is now: once the table had been dropped and made again keyed on another
    column, the old table's writes carried the new key column's value as their key. A change's key is
    that of the table its entry wrote, whichever definitions came after it."""
    columns = [("id", "INTEGER"), ("name", "TEXT"), ("email", "TEXT")]
    with node.client() as client:
        created = [client.create_table("people", "id", columns)]
        client.put("people", {"id": 1, "name": "a", "email": "a@x"})
        client.put("people", {"id": 2, "name": "b", "email": "b@x"})
        client.delete("people", 2)
        client.drop_table("people")
        created.append(client.create_table("people", "name", columns))
        client.put("people", {"id": 3, "name": "c", "email": "c@x"})
        client.drop_table("people")
        created.append(client.create_table("people", "email", columns))
        client.put("people", {"id": 4, "name": "d", "email": "d@x"})
        expected = [("write", 1), ("write", 2), ("delete", 2), ("write", "c"), ("write", "d@x")]
        # From the log's start (each creation read before its writes), and from past each creation.
        for start, after in enumerate([None, *created]):
            records = list(client.changes(["people"], after_tx_key=after))
            keyed = [(r["op"], r["key"]) for r in records if r["op"] in ("write", "delete")]
            assert keyed == expected[[0, 0, 3, 4][start] :], after
        assert apply_feed(client.changes(["people"]))["people"] == table_rows(client, "people")


def _trimmed_here_only(monkeypatch, through: list) -> None:
    """This node answers as one whose log was trimmed through ``through[0]`` (None: its own log):
    another node of the cluster may still hold what this one trimmed (each core trims by itself)."""
    trimmed = StoreFeedReader.trimmed
    monkeypatch.setattr(
        StoreFeedReader, "trimmed", lambda self, shard: through[0] if through[0] is not None else trimmed(self, shard)
    )


def _applied_on_pages(monkeypatch, on_page: Callable[[int], bool], applied: TxKey | None) -> list[int]:
    """This node answers ``applied`` as its applied key at the calls (one a page; counted from 1) that
    ``on_page`` picks, and its own at the others. Returns the count of calls so far, in a list."""
    real_applied = StoreFeedReader.applied
    pages = [0]

    def applied_on_some_pages(self, shard):
        pages[0] += 1
        return applied if on_page(pages[0]) else real_applied(self, shard)

    monkeypatch.setattr(StoreFeedReader, "applied", applied_on_some_pages)
    return pages


def test_a_cursor_saved_inside_a_copy_never_resumes_from_the_position_before_it(node, monkeypatch) -> None:
    """After ``snapshot_begin`` (drop what you hold) the cursor still named the position from before
    the copy until the page's last record: a consumer that saved it there and resumed at a node that
    still holds that position (cores trim each by itself) got the changes after it on top of tables
    it had emptied, and lost every row written before it. The cursor moves to the copy's start."""
    with node.client() as client:
        start = _put_users(client, range(5))[-1]
        last = _put_users(client, range(5, 20))[-1]
        through: list = [last]
        _trimmed_here_only(monkeypatch, through)
        feed = client.changes(["users"], after_tx_key=start)
        applied, records = [], iter(feed)
        for record in records:
            applied.append(record)
            if record["kind"] == "snapshot":
                break
        assert [r["kind"] for r in applied] == ["snapshot_begin", "snapshot"]
        cursor = feed.cursor
        through[0] = None  # the consumer restarts at a node whose log still holds ``start``
        rest = list(client.changes(["users"], after_tx_key=cursor))
        assert rest[0]["kind"] == "snapshot", rest[0]  # the copy goes on (its rows again: full rows)
        assert apply_feed(applied + rest)["users"] == table_rows(client, "users")
        assert "default" not in feed.position  # inside a copy: no tx key to resume the shard from


def test_a_feed_that_moves_to_a_node_behind_its_copy_does_not_end_inside_it(node, monkeypatch) -> None:
    """A feed that is not following ended as "caught up" on an empty page: after moving to a node
    whose applied key is behind the copy's start (a lagging replicant), inside the copy, without its
    ``snapshot_end``, holding part of the tables. It waits for that node instead (held pages)."""
    with node.client() as client:
        start, *_, last = _put_users(client, range(20))
        _trimmed_here_only(monkeypatch, [last])
        # Pages 2 to 4 come from a node behind the copy's start (a lagging replicant).
        pages = _applied_on_pages(monkeypatch, lambda page: 2 <= page <= 4, TxKey(last.generation, last.counter - 5))
        feed = client.changes(["users"], after_tx_key=start, wait_ms=50)
        records = list(feed)
        kinds = [r["kind"] for r in records]
        assert kinds[0] == "snapshot_begin" and kinds[-1] == "snapshot_end", kinds
        assert pages[0] > 4
        assert apply_feed(records)["users"] == table_rows(client, "users")
        assert feed.position == {"default": last}


@pytest.mark.parametrize("stuck", ["behind", "no_shard"])
def test_a_feed_not_following_gives_up_on_a_node_that_never_reaches_its_copy(node, monkeypatch, stuck) -> None:
    """Inside a copy a feed that is not following waits for a node behind it (held pages): at a node
    that never gets there (cut off from its cores, or without the shard at all) ``mnesite changes``
    without --follow never ended. It waits while the node moves, and otherwise ends with an error
    naming the shard (the CLI prints its resume line, which says the shard stopped inside a copy)."""
    from mnesite.rlog.client import ChangeFeed

    with node.client() as client:
        start, *_, last = _put_users(client, range(20))
        _trimmed_here_only(monkeypatch, [last])
        stuck_at = TxKey(last.generation, last.counter - 5) if stuck == "behind" else None
        _applied_on_pages(monkeypatch, lambda page: page >= 2, stuck_at)
        real_fetch = ChangeFeed.fetch_page

        def bounded(feed):
            assert feed.pages_fetched < 100, "the feed never ends"
            return real_fetch(feed)

        monkeypatch.setattr(ChangeFeed, "fetch_page", bounded)
        feed = client.changes(["users"], after_tx_key=start, wait_ms=10)
        records = []
        with pytest.raises(MnesiteError, match="shard default.*copy"):
            for record in feed:
                records.append(record)
        assert records[0]["kind"] == "snapshot_begin"
        assert feed.position == {} and feed.cursor[0]["phase"] != "live"


class StalledFeedNode(RouterNode):
    """A node that cannot move a copy: every ``changes`` request gets an empty page at the positions it
    asked, with ``applied`` as the node's applied keys (empty: it has no such shard, as a replicant cut
    off from its cores might not). ``pages``: how many it answered."""

    def __init__(self, applied: dict[str, TxKey]) -> None:
        self.applied = {shard: list(key) for shard, key in applied.items()}
        self.pages = 0
        super().__init__()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if not self.socket.poll(20):
                continue
            *envelope, frame = self.socket.recv_multipart()
            request = messages.decode(frame)
            page = {
                "records": [],
                "positions": [position_to_wire(position) for position in request.body.positions],
                "applied": self.applied,
            }
            self.pages += 1
            self.send(envelope, messages.reply(request.request_id, page))


def _cursor_inside_a_copy(client: Client, monkeypatch) -> tuple[list[dict], list[dict], TxKey]:
    """A feed of users stopped inside a copy (this node trimmed through its last write): the records
    it applied (``snapshot_begin`` and one ``snapshot``), its cursor, and the copy's start K0."""
    start, *_, last = _put_users(client, range(20))
    _trimmed_here_only(monkeypatch, [last])
    feed = client.changes(["users"], after_tx_key=start)
    applied = []
    for record in feed:
        applied.append(record)
        if record["kind"] == "snapshot":
            return applied, feed.cursor, last
    raise AssertionError(f"no copy: {applied}")


@pytest.mark.parametrize("stuck", ["behind", "no_shard"])
def test_a_feed_stalled_inside_a_copy_goes_on_at_its_next_endpoint(node, monkeypatch, stuck) -> None:
    """A feed not following, inside a copy at a node that cannot move it, ended with ``changes_stalled``
    although the client had another endpoint that could: it goes on there from the same positions,
    and gets every record the copy and the changes after it hold, exactly once."""
    with node.client() as client:
        applied, cursor, k0 = _cursor_inside_a_copy(client, monkeypatch)
        later = _put_users(client, range(20, 25))  # written during the copy: its replay heals them in
        expected = list(client.changes(["users"], after_tx_key=cursor))  # the rest, from the node that moves it
    assert expected[-1] == {"kind": "snapshot_end", "shard": "default", "tx_key": later[-1]}, expected
    stalled = StalledFeedNode({"default": TxKey(k0.generation, k0.counter - 5)} if stuck == "behind" else {})
    try:
        with Client([stalled.endpoint, node.endpoint], timeout_ms=2000, retries=1) as both:
            feed = both.changes(["users"], after_tx_key=cursor, wait_ms=10)
            rest = list(feed)
        # A node behind: its first page cannot tell whether it moves (nothing to compare it with).
        assert stalled.pages == COPY_STALL_PAGES_MAX + (stuck == "behind")
        assert rest == expected
        replayed = [r["tx_key"] for r in rest if r["kind"] == "snapshot" and r["tx_key"] is not None]
        assert replayed == sorted(set(replayed)) and set(later) <= set(replayed)  # each entry once, in order
        with node.client() as client:
            assert apply_feed(applied + rest)["users"] == table_rows(client, "users")
        assert feed.position == {"default": later[-1]}
    finally:
        stalled.close()


def test_a_feed_stalled_inside_a_copy_at_every_endpoint_ends_naming_them(node, monkeypatch) -> None:
    """Every endpoint stalled: the feed ends with ``changes_stalled`` naming each and why, having asked
    each for one stall's pages, never back and forth between them. One that the client's failover left
    (``not_ready``) back to a stalled node is not tried again either: the feed still ends."""
    with node.client() as client:
        _, cursor, k0 = _cursor_inside_a_copy(client, monkeypatch)
    nodes = [StalledFeedNode({}), StalledFeedNode({"default": TxKey(k0.generation, k0.counter - 5)})]
    not_ready = ScriptedNode([("not_ready", "replicant r3 cannot serve shard default yet")] * 5)
    try:
        endpoints = [stalled.endpoint for stalled in nodes]
        with Client(endpoints, timeout_ms=2000, retries=1) as client, pytest.raises(MnesiteError) as info:
            list(client.changes(["users"], after_tx_key=cursor, wait_ms=10))
        assert info.value.code == "changes_stalled"
        message = str(info.value)
        assert f"{endpoints[0]}: shard default: the node has no such shard" in message, message
        assert f"{endpoints[1]}: shard default: the node's applied key" in message, message
        assert [stalled.pages for stalled in nodes] == [COPY_STALL_PAGES_MAX, COPY_STALL_PAGES_MAX + 1]  # (behind)
        # A stalled node, then one that answers not_ready: the client's own failover carries the page
        # back to the stalled node, which stalls again; the not-ready one had its turn, so the feed ends.
        nodes[0].pages = 0
        with (
            Client([nodes[0].endpoint, not_ready.endpoint], timeout_ms=2000, retries=1) as client,
            pytest.raises(MnesiteError) as info,
        ):
            list(client.changes(["users"], after_tx_key=cursor, wait_ms=10))
        assert info.value.code == "changes_stalled" and not_ready.endpoint in str(info.value)
        assert nodes[0].pages == 2 * COPY_STALL_PAGES_MAX and len(not_ready.requests) == 1
    finally:
        for stalled in nodes:
            stalled.close()
        not_ready.close()


def test_cli_changes_stopped_inside_a_copy_says_so_instead_of_leaving_the_shard_out(node, monkeypatch) -> None:
    """Stopped inside a copy, the resume line left the shard out without a word (or, before the copy's
    first page ended, named the key before the copy, which a node that still holds it answers with
    changes on top of the tables the printed snapshot_begin said to drop)."""
    with node.client() as client:
        client.create_table("far", "id", [("id", "INTEGER")], shard="far")
        far = client.put("far", {"id": 1})
        start, *_, last = _put_users(client, range(20))
    through: list = [last]
    _trimmed_here_only(monkeypatch, through)
    from mnesite.rlog.client import ChangeFeed

    real_iter = ChangeFeed.__iter__

    def interrupted_in_the_copy(feed):
        for record in real_iter(feed):
            yield record
            if record["kind"] == "snapshot":
                raise KeyboardInterrupt  # the operator's Ctrl-C inside the copy

    monkeypatch.setattr(ChangeFeed, "__iter__", interrupted_in_the_copy)
    after = ["--from", f"far:{far.generation},{far.counter}", "--from", f"default:{start.generation},{start.counter}"]
    result = CliRunner().invoke(main, ["changes", "users", "far", *after, "--node", node.endpoint])
    assert result.exit_code == 0, result.output
    line = result.stderr.splitlines()[-1]
    assert line.startswith(f"stopped; resume with --from far:{far.generation},{far.counter}; "), line
    assert "--from default:" not in line
    assert "shard default stopped inside a copy" in line and "drop what you hold of its tables" in line
