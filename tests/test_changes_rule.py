"""The changefeed's page rule (rlog.changes) against an in-memory log: the copy's corner cases that a
real node rarely shows (its start trimmed mid-copy, a node behind the copy, a drop during the copy)."""

from __future__ import annotations

from typing import Any

import pytest
from mnesite.rlog.changes import ChangesError, PageLimits, build_page, keep_holding, live, worth_a_page
from mnesite.rlog.messages import ChangesPosition
from mnesite.rlog.schema import TableSchema
from mnesite.rlog.types import GENESIS_DIGEST, CreateTableOp, DeleteOp, DropTableOp, Entry, TxKey, WriteOp

pytestmark = pytest.mark.timeout(30)

USERS = TableSchema("users", "default", "id", (("id", "INTEGER"), ("name", "TEXT")))


class MemoryLog:
    """A node's log and table in memory: ``write``/``delete`` append an entry and apply it."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.rows: dict[int, dict[str, Any]] = {}
        self.trimmed_key = TxKey(0, 0)
        self.tables = {"users": USERS}
        self.applied_key = TxKey(0, 0)
        self.generation = 1
        self.dropped: dict[tuple[TxKey, str], str] = {}  # (drop's key, table): its key column
        self.key_columns_asked = 0

    def _append(self, op: Any) -> TxKey:
        counter = self.applied_key.counter + 1 if self.applied_key.generation == self.generation else 1
        key = TxKey(self.generation, counter)
        self.entries.append(Entry("default", key, self.applied_key, GENESIS_DIGEST, (op,)))
        self.applied_key = key
        return key

    def write(self, key: int, name: str) -> TxKey:
        self.rows[key] = {"id": key, "name": name}
        return self._append(WriteOp("users", dict(self.rows[key])))

    def delete(self, key: int) -> TxKey:
        self.rows.pop(key, None)
        return self._append(DeleteOp("users", key))

    def trim_through(self, key: TxKey) -> None:
        self.trimmed_key = key
        self.entries = [entry for entry in self.entries if entry.tx_key > key]

    # FeedReader
    def catalog(self) -> dict[str, TableSchema]:
        return dict(self.tables)

    def shard_names(self) -> list[str]:
        return ["default"]

    def applied(self, shard: str) -> TxKey | None:
        return self.applied_key

    def trimmed(self, shard: str) -> TxKey:
        return self.trimmed_key

    def key_column_at(self, shard: str, table: str, tx_key: TxKey) -> str | None:
        """As ``Store.key_column_at``: the first drop of ``table`` at or after ``tx_key``, else the catalog."""
        self.key_columns_asked += 1
        for entry in self.entries:
            for op in entry.ops:
                if entry.tx_key >= tx_key and isinstance(op, DropTableOp) and op.table == table:
                    return self.dropped[(entry.tx_key, table)]
        return self.tables[table].key_column if table in self.tables else None

    def entries_after(self, shard: str, after: TxKey, limit: int, up_to: TxKey) -> list[Entry]:
        return [entry for entry in self.entries if after < entry.tx_key <= up_to][:limit]

    def table_batch(self, table: TableSchema, after: Any, rows_max: int, bytes_max: int) -> dict[str, Any]:
        keys = sorted(key for key in self.rows if after is None or key > after)
        chosen = keys[:rows_max]
        return {"rows": [dict(self.rows[key]) for key in chosen], "done": len(chosen) == len(keys)}


def apply(records: list[dict], state: dict) -> None:
    for record in records:
        if record["kind"] == "snapshot_begin":
            state.clear()
        elif record["kind"] in ("snapshot", "change") and record["op"] == "write":
            state[record["key"]] = record["row"]
        elif record["kind"] in ("snapshot", "change") and record["op"] == "delete":
            state.pop(record["key"], None)


def run_to_end(log: MemoryLog, positions: list, state: dict, limits: PageLimits, between=None) -> list[dict]:
    records: list[dict] = []
    for page_number in range(1000):
        page = build_page(log, ["users"], positions, limits)
        apply(page.records, state)
        records.extend(page.records)
        positions = page.positions
        if between is not None:
            between(page_number, page)
        if page.caught_up:
            return records
    raise AssertionError("the feed did not catch up in 1000 pages")


def test_a_copy_whose_start_is_trimmed_mid_copy_starts_again_saying_so_and_ends_equal() -> None:
    log = MemoryLog()
    for i in range(40):
        log.write(i, f"n{i}")
    log.trim_through(TxKey(1, 20))
    state: dict = {}

    def meanwhile(page_number: int, page) -> None:
        if page_number == 2:  # mid-copy: writes, then the log trimmed past the copy's start
            log.write(5, "changed")
            log.delete(7)
            log.write(100, "new")
            log.trim_through(log.applied_key)
        elif page_number < 6:
            log.write(200 + page_number, "later")

    records = run_to_end(log, [live("default", TxKey(1, 3))], state, PageLimits(10, 1 << 20), meanwhile)
    begins = [r for r in records if r["kind"] == "snapshot_begin"]
    assert len(begins) == 2
    assert "fell behind" in begins[0]["reason"] and "trimmed before its copy was healed" in begins[1]["reason"]
    assert state == log.rows
    assert [r["kind"] for r in records].count("snapshot_end") == 1


def test_a_copy_moved_to_a_node_behind_its_rows_waits_and_the_replay_reaches_every_key_read() -> None:
    ahead, behind = MemoryLog(), MemoryLog()
    for i in range(30):
        ahead.write(i, f"n{i}")
        behind.write(i, f"n{i}")
    ahead.trim_through(TxKey(1, 10))
    state: dict = {}
    page = build_page(ahead, ["users"], [live("default", TxKey(1, 2))], PageLimits(5, 1 << 20))
    apply(page.records, state)
    position = page.positions[0]
    assert position.phase == "copy" and position.replay_to == TxKey(1, 30)
    # The writes reach the first node only; the consumer moves to the second, which lags behind.
    for i in range(30, 40):
        ahead.write(i, "only ahead")
    page = build_page(ahead, ["users"], [position], PageLimits(5, 1 << 20))
    apply(page.records, state)
    assert page.positions[0].replay_to == TxKey(1, 40)  # rows were read at (1, 40)
    behind_page = build_page(behind, ["users"], page.positions, PageLimits(5, 1 << 20))
    assert behind_page.records == [] or behind_page.records[-1]["kind"] != "snapshot_end"
    # Caught up with everything the lagging node has: it cannot end the snapshot before (1, 40).
    records = run_to_end(behind, page.positions, state, PageLimits(5, 1 << 20))
    assert not any(r["kind"] == "snapshot_end" for r in records)
    for i in range(30, 40):
        behind.write(i, "only ahead")
    records = run_to_end(behind, [run_position(behind, page.positions, state)], state, PageLimits(5, 1 << 20))
    assert state == behind.rows == ahead.rows


def run_position(log: MemoryLog, positions: list, state: dict) -> ChangesPosition:
    """The position after paging ``log`` to its end (records applied to ``state``)."""
    for _ in range(1000):
        page = build_page(log, ["users"], positions, PageLimits(5, 1 << 20))
        apply(page.records, state)
        positions = page.positions
        if page.caught_up:
            return positions[0]
    raise AssertionError("no end")


def test_a_table_dropped_during_its_copy_is_skipped_and_the_drop_is_replayed() -> None:
    log = MemoryLog()
    for i in range(10):
        log.write(i, "x")
    log.trim_through(TxKey(1, 5))
    page = build_page(log, ["users"], [live("default", TxKey(1, 1))], PageLimits(3, 1 << 20))
    log.rows.clear()
    del log.tables["users"]
    log._append(DropTableOp("users", "default"))
    records = list(page.records)
    positions = page.positions
    for _ in range(20):
        page = build_page(log, ["users"], positions, PageLimits(3, 1 << 20))
        records.extend(page.records)
        positions = page.positions
        if page.caught_up:
            break
    ops = [(r["kind"], r.get("op")) for r in records]
    assert ("snapshot", "drop_table") in ops and ops[-1] == ("snapshot_end", None)


@pytest.mark.parametrize(
    "position",
    [
        ChangesPosition(shard="default", after=TxKey(1, 1), phase="copy", replay_to=TxKey(1, 1)),
        ChangesPosition(shard="default", after=TxKey(1, 1), phase="replay"),
        ChangesPosition(shard="default", after=TxKey(1, 5), phase="replay", replay_to=TxKey(1, 1)),
        ChangesPosition(shard="default", after=TxKey(1, 1), table="users"),
        ChangesPosition(shard="default", after=TxKey(1, 1), replay_to=TxKey(1, 1)),
        ChangesPosition(
            shard="default", after=TxKey(1, 1), phase="copy", table="users", table_after="x", replay_to=TxKey(1, 1)
        ),
        ChangesPosition(
            shard="default", after=TxKey(1, 1), phase="copy", table="users", replay_to=TxKey(1, 1), records_after=1
        ),
        ChangesPosition(shard="default", after=TxKey(0, 0), records_after=2),  # past the one-record entry
    ],
)
def test_positions_breaking_the_phase_rules_are_bad_requests(position: ChangesPosition) -> None:
    log = MemoryLog()
    log.write(1, "a")
    with pytest.raises(ChangesError) as error:
        build_page(log, ["users"], [position], PageLimits(5, 1 << 20))
    assert error.value.code == "bad_request"


def test_a_page_is_bounded_in_bytes_and_an_entry_larger_than_a_page_goes_alone() -> None:
    log = MemoryLog()
    for i in range(50):
        log.write(i, "x" * 1000)
    log._append(WriteOp("users", {"id": 999, "name": "y" * 10_000}))  # larger than a page
    for i in range(50, 60):
        log.write(i, "x" * 1000)
    positions = [live("default", TxKey(0, 0))]
    sizes = []
    for _ in range(100):
        page = build_page(log, ["users"], positions, PageLimits(1000, 4096))
        if page.caught_up:
            break
        sizes.append((len(page.records), page.bytes, [r["key"] for r in page.records]))
        positions = page.positions
    assert positions[0].after == log.applied_key
    for count, size, keys in sizes:
        assert size <= 4096 or keys == [999], (count, size, keys)
    assert ([999] in [keys for _, _, keys in sizes]) and sum(count for count, _, _ in sizes) == 61


def test_a_held_request_is_paged_again_when_a_shard_moves_or_its_wait_ends_and_held_while_nothing_is_for_it() -> None:
    then = {"default": TxKey(1, 5), "content": TxKey(2, 3)}
    assert not worth_a_page(then, then, now_ms=10, deadline_ms=20)
    assert worth_a_page(then, {**then, "content": TxKey(2, 4)}, now_ms=10, deadline_ms=20)
    assert worth_a_page(then, then, now_ms=20, deadline_ms=20)
    assert not worth_a_page(then, {"default": TxKey(1, 5)}, now_ms=10, deadline_ms=20)  # a shard gone: no move
    # A shard the node did not have when the page was built: once, until the page is built again.
    grown = {**then, "new": TxKey(3, 1)}
    assert worth_a_page(then, grown, now_ms=10, deadline_ms=20, shards_then=set(then))
    assert not worth_a_page(then, grown, now_ms=10, deadline_ms=20, shards_then=set(grown))
    log = MemoryLog()
    log.write(1, "a")
    caught_up = build_page(log, ["users"], [live("default", log.applied_key)], PageLimits(5, 1 << 20))
    assert keep_holding(caught_up, now_ms=10, deadline_ms=20) and not keep_holding(caught_up, 20, 20)
    behind = build_page(log, ["users"], [live("default", TxKey(0, 0))], PageLimits(5, 1 << 20))
    assert not keep_holding(behind, now_ms=10, deadline_ms=20)


def test_an_entry_larger_than_a_page_goes_over_several_pages_and_every_record_once_in_order() -> None:
    # A transaction whose records exceed the page's bytes (they could outgrow a frame) is cut between
    # pages: the position stays before the entry and counts the records delivered (records_after).
    log = MemoryLog()
    log.write(1, "before")
    rows = [WriteOp("users", {"id": 100 + i, "name": "z" * 300}) for i in range(40)]
    key = TxKey(1, 2)
    log.entries.append(Entry("default", key, log.applied_key, GENESIS_DIGEST, tuple(rows)))
    log.applied_key = key
    log.rows.update({op.row["id"]: dict(op.row) for op in rows})
    log.write(2, "after")
    positions = [live("default", TxKey(0, 0))]
    pages, state = [], {}
    for _ in range(100):
        page = build_page(log, ["users"], positions, PageLimits(1000, 4096))
        if page.caught_up:
            break
        assert page.bytes <= 4096 or len(page.records) == 1, page.bytes
        pages.append(page)
        apply(page.records, state)
        positions = page.positions
    keys = [record["key"] for page in pages for record in page.records]
    assert keys == [1, *(100 + i for i in range(40)), 2]  # each once, in the entry's order
    inside = [page.positions[0] for page in pages if page.positions[0].records_after]
    assert len(inside) >= 3 and all(position.after == TxKey(1, 1) for position in inside)
    assert [p.records_after for p in inside] == sorted(p.records_after for p in inside)
    assert positions[0].after == log.applied_key and positions[0].records_after is None
    assert state == log.rows
    # The position of a page cut inside the entry resumes there, on this node or another one alike.
    again = build_page(log, ["users"], [inside[0]], PageLimits(1000, 4096))
    assert again.records[0]["key"] == 100 + inside[0].records_after


def test_a_replay_position_inside_an_entry_resumes_inside_it() -> None:
    log = MemoryLog()
    rows = [WriteOp("users", {"id": i, "name": "w" * 500}) for i in range(20)]
    log.entries.append(Entry("default", TxKey(1, 1), TxKey(0, 0), GENESIS_DIGEST, tuple(rows)))
    log.applied_key = TxKey(1, 1)
    position = ChangesPosition(shard="default", after=TxKey(0, 0), phase="replay", replay_to=TxKey(1, 1))
    page = build_page(log, ["users"], [position], PageLimits(1000, 2048))
    moved = page.positions[0]
    assert moved.phase == "replay" and moved.records_after == len(page.records) < 20
    assert all(record["kind"] == "snapshot" for record in page.records)
    rest = build_page(log, ["users"], [moved], PageLimits(1000, 1 << 20))
    assert [r["key"] for r in page.records + rest.records if r["kind"] == "snapshot"] == list(range(20))
    assert rest.positions[0].phase == "live" and rest.positions[0].after == TxKey(1, 1)


def test_a_page_reads_at_most_entries_scanned_max_entries_of_a_shard_when_none_is_for_the_feed() -> None:
    """A feed of a rarely written table among busy ones: each page reads a bounded number of entries
    (docs: changefeed.md, Flow control), exactly ENTRIES_SCANNED_MAX, and moves past all it read. The
    bound was counted per call of ``_entries``, which ``run`` repeats while the position moves: a page
    read the whole log up to the applied key (here 3,000 entries of 3,000)."""
    from mnesite.rlog.changes import ENTRIES_SCANNED_MAX

    class CountingLog(MemoryLog):
        read = 0

        def entries_after(self, shard: str, after: TxKey, limit: int, up_to: TxKey) -> list[Entry]:
            entries = super().entries_after(shard, after, limit, up_to)
            self.read += len(entries)
            return entries

    log = CountingLog()
    for i in range(ENTRIES_SCANNED_MAX + 1000):
        log._append(WriteOp("other", {"id": i}))
    page = build_page(log, ["users"], [live("default", TxKey(0, 0))], PageLimits(100, 1 << 20))
    assert page.records == []
    assert log.read == ENTRIES_SCANNED_MAX
    assert page.positions == [live("default", TxKey(1, ENTRIES_SCANNED_MAX))]
    assert not page.caught_up  # answered at once: the consumer asks again from there


def test_a_position_the_log_does_not_chain_from_gets_a_copy_not_the_entries_after_it() -> None:
    """A force-start discarded the entries a consumer had read: the surviving history went on in a new
    generation from an earlier key. Served the entries after its position, the consumer would keep
    the discarded writes for good; it is sent a copy instead, saying why, and ends equal."""
    first = MemoryLog()
    for i in range(20):
        first.write(i, f"n{i}")
    state: dict = {}
    run_to_end(first, [live("default", TxKey(0, 0))], state, PageLimits(8, 1 << 20))
    assert state == first.rows

    survivor = MemoryLog()  # held the history up to (1, 12) only, then was force-started
    for i in range(12):
        survivor.write(i, f"n{i}")
    survivor.generation = 2
    for i in range(100, 105):
        survivor.write(i, f"after the force-start {i}")
    survivor.delete(3)

    records = run_to_end(survivor, [live("default", first.applied_key)], state, PageLimits(8, 1 << 20))
    begins = [record for record in records if record["kind"] == "snapshot_begin"]
    assert len(begins) == 1 and "not in this node's history" in begins[0]["reason"]
    assert "(1, 12) to (2, 1)" in begins[0]["reason"]
    assert state == survivor.rows  # the discarded writes of keys 12-19 are gone, the new ones are there


def test_a_position_in_the_history_is_served_the_entries_after_it_with_no_copy() -> None:
    log = MemoryLog()
    for i in range(10):
        log.write(i, f"n{i}")
    log.generation = 2
    for i in range(10, 15):
        log.write(i, f"n{i}")
    log.trim_through(TxKey(1, 4))
    for position in (TxKey(1, 4), TxKey(1, 7), TxKey(1, 10), TxKey(2, 3)):
        page = build_page(log, ["users"], [live("default", position)], PageLimits(100, 1 << 20))
        kinds = {record["kind"] for record in page.records}
        assert kinds == {"change"}, (position, kinds)
        assert page.records[0]["tx_key"] == list(log.entries_after("default", position, 1, log.applied_key)[0].tx_key)


def test_a_write_before_its_table_was_dropped_and_made_again_is_keyed_by_its_own_table_once_per_page() -> None:
    """The page keyed a write it met before any creation of its table by the catalog's key column, the
    table made last: the old table's writes carried the new key column's value. The reader says which
    table an entry wrote (``key_column_at``), asked once per table and page, not once per write."""
    log = MemoryLog()
    columns = (("id", "INTEGER"), ("name", "TEXT"))
    for i in range(3):
        log.write(i, f"n{i}")
    drop = log._append(DropTableOp("users", "default"))
    log.dropped[(drop, "users")] = "id"
    log.tables["users"] = TableSchema("users", "default", "name", columns)
    log._append(CreateTableOp("users", "default", "name", columns))
    log._append(WriteOp("users", {"id": 7, "name": "seven"}))
    for after, expected in ((TxKey(0, 0), [0, 1, 2, "seven"]), (TxKey(1, 2), [2, "seven"]), (drop, ["seven"])):
        log.key_columns_asked = 0
        page = build_page(log, ["users"], [live("default", after)], PageLimits(100, 1 << 20))
        assert [r["key"] for r in page.records if r.get("op") == "write"] == expected, after
        assert log.key_columns_asked == (1 if after < drop else 0)  # after the drop: the page's own create


def test_a_held_request_is_paged_again_at_once_when_a_shard_it_follows_is_being_copied_again() -> None:
    # A replicant's bootstrap keeps the applied key: nothing moves, yet nothing comes of the shard
    # until the copy is done, so the request is answered now (``not_ready``), not at its deadline.
    then = {"default": TxKey(1, 5)}
    assert worth_a_page(then, then, now_ms=10, deadline_ms=20, shards_not_serving=["default"])
    assert not worth_a_page(then, then, now_ms=10, deadline_ms=20, shards_not_serving=["content"])  # not followed
