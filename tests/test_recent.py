"""core.recent: the window of entries persisted last, which a sequencer feeds followers from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mnesite.core.guard_tail import GuardTail
from mnesite.core.node import StoreLogView
from mnesite.core.recent import RecentBudget, RecentEntries, entry_bytes
from mnesite.rlog.types import TxKey, WriteOp, make_entry


def chain(first: int, count: int, prev: TxKey, digest: bytes = b"\0" * 32, value: str = "x", generation: int = 1):
    """``count`` entries continuing ``prev`` (whose digest is ``digest``), keys from ``first``."""
    entries = []
    for counter in range(first, first + count):
        entry = make_entry(
            "default", TxKey(generation, counter), prev, digest, (WriteOp("t", {"id": counter, "v": value}),)
        )
        entries.append(entry)
        prev, digest = entry.tx_key, entry.digest
    return entries


def test_after_answers_slices_of_what_it_holds_and_none_outside():
    window = RecentEntries()
    entries = chain(5, 10, TxKey(1, 4))
    window.add(entries)
    assert window.after(TxKey(1, 4), 3) == entries[:3]  # the key before the first entry
    assert window.after(TxKey(1, 9), 64) == entries[5:]
    assert window.after(TxKey(1, 14), 64) == []  # the last key: nothing follows yet
    assert window.after(TxKey(1, 3), 64) is None  # before the window: the store answers
    assert window.after(TxKey(1, 15), 64) is None
    assert RecentEntries().after(TxKey(1, 1), 64) is None


def test_an_add_that_does_not_continue_the_window_empties_it_first():
    window = RecentEntries()
    window.add(chain(1, 5, TxKey(0, 0)))
    elsewhere = chain(20, 2, TxKey(1, 19))
    window.add(elsewhere)
    assert window.entries == elsewhere
    assert window.after(TxKey(1, 3), 64) is None
    assert window.budget.entries == 2 and window.budget.bytes == sum(map(entry_bytes, elsewhere))


def test_a_truncation_drops_the_entries_after_its_key_and_a_new_run_continues_there():
    window = RecentEntries()
    first = chain(1, 10, TxKey(0, 0))
    window.add(first)
    window.truncated(TxKey(1, 6))
    assert window.keys == [TxKey(1, n) for n in range(1, 7)]
    # The new sequencer's entries (generation 2) continue the log after the truncation's key.
    replacement = chain(1, 3, TxKey(1, 6), first[5].digest, value="new", generation=2)
    window.add(replacement)
    assert window.after(TxKey(1, 6), 64) == replacement
    assert window.after(TxKey(1, 5), 2) == [first[5], replacement[0]]


def test_a_window_is_bounded_in_entries_and_in_bytes():
    by_count = RecentEntries(entries_max=100)
    for start in range(1, 1000, 10):
        by_count.add(chain(start, 10, TxKey(1, start - 1) if start > 1 else TxKey(0, 0)))
        assert len(by_count.entries) <= 100
    assert by_count.keys[-1] == TxKey(1, 1000)  # the newest are kept
    assert by_count.keys == sorted(by_count.keys) and len(by_count.entries) >= 75
    one = entry_bytes(chain(1, 1, TxKey(0, 0), value="y" * 1000)[0])
    by_bytes = RecentEntries(bytes_max=10 * one)
    by_bytes.add(chain(1, 30, TxKey(0, 0), value="y" * 1000))
    assert by_bytes.bytes <= 10 * one and by_bytes.keys[-1] == TxKey(1, 30)


def test_the_node_budget_bounds_every_window_together_and_a_cleared_window_gives_its_share_back():
    budget = RecentBudget(entries_max=50, bytes_max=10**9)
    a, b = RecentEntries(budget), RecentEntries(budget)
    a.add(chain(1, 40, TxKey(0, 0)))
    b.add(chain(1, 30, TxKey(0, 0)))
    assert budget.entries <= 50 and budget.entries == len(a.entries) + len(b.entries)
    assert a.keys[-1] == TxKey(1, 40) and b.keys[-1] == TxKey(1, 30)
    a.clear()
    assert budget.entries == len(b.entries) and budget.bytes == b.bytes
    b.clear()
    assert (budget.entries, budget.bytes) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "truncate", "clear"]), st.integers(1, 40)), max_size=40))
def test_whatever_the_window_answers_is_the_log(steps):
    """A model log changed as a driver changes it (appends at its end, truncations, a driver rebuilt):
    every answer of the window equals the log's own, whatever the bounds dropped."""
    budget = RecentBudget(entries_max=60, bytes_max=10**9)
    window = RecentEntries(budget, entries_max=50)
    log = chain(1, 1, TxKey(0, 0))
    window.add(log)
    generation = 1
    for action, number in steps:
        if action == "add":
            last = log[-1]
            more = chain(last.tx_key.counter + 1, number, last.tx_key, last.digest, generation=generation)
            log += more
            window.add(more)
        elif action == "truncate":
            cut = max(1, len(log) - number)
            log = log[:cut]
            window.truncated(log[-1].tx_key)
            generation += 1  # a new sequencer's entries replace the truncated ones
        else:
            window.clear()
        assert budget.entries == len(window.entries) <= 50
        keys = [entry.tx_key for entry in log]
        for index in range(len(log)):
            answer = window.after(keys[index], 7)
            if answer is not None:
                assert answer == log[index + 1 : index + 8]


class NoStore:
    """A store that must not be read: the view answers from memory."""

    def entries_after(self, shard, key, limit):
        raise AssertionError(f"the store was read after {key}")


class ListStore:
    def __init__(self, entries):
        self.entries = entries

    def entries_after(self, shard, key, limit):
        return [entry for entry in self.entries if entry.tx_key > key][:limit]


def test_the_log_view_serves_applied_entries_from_the_window_and_the_rest_from_the_store():
    entries = chain(1, 100, TxKey(0, 0))
    tail: GuardTail = GuardTail()
    tail.add(tuple(entries[90:]))  # the unapplied tail: entries 91-100
    window = RecentEntries()
    window.add(entries[40:])  # persisted last: entries 41-100
    # A lazy follower fed from key 50: applied entries, out of the tail, in the window.
    assert StoreLogView(NoStore(), "default", tail, window).entries_after(TxKey(1, 50), 64) == entries[50:100]
    with pytest.raises(AssertionError, match="the store was read"):
        StoreLogView(NoStore(), "default", tail, window).entries_after(TxKey(1, 20), 64)
    # Before the window, the store answers, as it did before there was one.
    view = StoreLogView(ListStore(entries), "default", tail, window)
    assert view.entries_after(TxKey(1, 20), 64) == entries[20:84]


def test_a_sequencers_writes_fill_its_window_and_a_shard_rebuilt_from_disk_gives_its_share_back(tmp_path):
    from tests.conftest import ThreadNode

    thread_node = ThreadNode(tmp_path / "data")
    try:
        with thread_node.client() as client:
            client.create_table("kv", "id", [("id", "INTEGER"), ("v", "TEXT")])
            for number in range(20):
                client.put("kv", {"id": number, "v": "w"})
    finally:
        thread_node.stop()  # the driver below is touched by this thread alone
    node = thread_node.node
    window = node.shards["default"].log_view.recent
    last = node.store.last_entry("default")[0]
    assert window.keys[-1] == last and len(window.entries) >= 20
    assert node.recent_budget.entries == len(window.entries)
    node.store = type(node.store)(node.config.database_path)  # the stopped node closed its own
    try:
        rebuilt = node._open_shard("default")  # as a snapshot install or a full disk rebuilds it
    finally:
        node.store.close()
    assert rebuilt.log_view.recent.entries == [] and window.entries == []
    assert (node.recent_budget.entries, node.recent_budget.bytes) == (0, 0)
