"""The apsw store: atomic apply (invariant 4), no gaps, chain verification, retention."""

from __future__ import annotations

import os

import apsw
import pytest
from mnesite.rlog.schema import define_table
from mnesite.rlog.store import EntryApplyError, Store, StoreError
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, CreateTableOp, DropTableOp, TxKey, WriteOp, make_entry

pytestmark = pytest.mark.timeout(30)

TABLE = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])


@pytest.fixture
def store(tmp_path):
    store = Store(str(tmp_path / "mnesite.db"), synchronous="NORMAL")
    with store.write_transaction():
        store.ensure_shard("default", 1)
        entry = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [TABLE.to_op()])
        store.append_entry(entry, 0)
        store.apply_entry(entry)
    yield store
    store.close()


def append(store: Store, counter: int, value: str, appended_ms: int = 0):
    position = store.shard("default")
    entry = make_entry(
        "default", TxKey(1, counter), position.applied, position.digest, [WriteOp("t", {"k": counter, "v": value})]
    )
    with store.write_transaction():
        store.append_entry(entry, appended_ms)
        store.apply_entry(entry)
    return entry


def test_apply_moves_data_and_position_together(store) -> None:
    entry = append(store, 2, "a")
    position = store.shard("default")
    assert (position.applied, position.digest) == (entry.tx_key, entry.digest)
    assert store.read_row(store.catalog()["t"], 2) == {"k": 2, "v": "a"}


def test_a_failure_mid_transaction_leaves_neither_data_nor_position(store) -> None:
    before = store.shard("default")
    position = before
    entry = make_entry("default", TxKey(1, 2), position.applied, position.digest, [WriteOp("t", {"k": 2, "v": "x"})])
    with pytest.raises(RuntimeError, match="crash"), store.write_transaction():
        store.append_entry(entry, 0)
        store.apply_entry(entry)
        raise RuntimeError("crash between apply and commit")
    assert store.shard("default") == before
    assert store.read_row(store.catalog()["t"], 2) is None
    assert store.last_entry_key("default") == TxKey(1, 1)


def test_entries_that_do_not_follow_the_applied_key_are_refused(store) -> None:
    position = store.shard("default")
    gap = make_entry("default", TxKey(1, 5), TxKey(1, 4), position.digest, [])
    with pytest.raises(StoreError, match="follows"), store.write_transaction():
        store.apply_entry(gap)
    forged = make_entry("default", TxKey(1, 2), position.applied, b"\x01" * 32, [])
    with pytest.raises(StoreError, match="digest mismatch"), store.write_transaction():
        store.apply_entry(forged)


def test_verify_chain_finds_a_tampered_entry(store) -> None:
    for counter in range(2, 6):
        append(store, counter, f"v{counter}")
    assert store.verify_chain("default") == TxKey(1, 5)
    store.connection.execute("UPDATE _mnesite_rlog SET digest = zeroblob(32) WHERE counter = 3")
    with pytest.raises(StoreError, match=r"digest mismatch at \(1, [34]\)"):
        store.verify_chain("default")


def test_retention_keeps_the_newest_entries(store) -> None:
    for counter in range(2, 12):
        append(store, counter, "x", appended_ms=counter * 1000)
    with store.write_transaction():
        assert store.trim("default", entries_max=5, before_ms=None) == 6
    assert [e.tx_key.counter for e in store.tail("default", 100)] == [7, 8, 9, 10, 11]
    with store.write_transaction():
        store.trim("default", entries_max=100, before_ms=10_500)
    assert [e.tx_key.counter for e in store.tail("default", 100)] == [11]
    with store.write_transaction():
        store.trim("default", entries_max=100, before_ms=10**9)
    assert [e.tx_key.counter for e in store.tail("default", 100)] == [11], "the newest entry is always kept"
    assert store.verify_chain("default") == TxKey(1, 11)


def test_user_tables_are_strict(store) -> None:
    import sqlite_utils

    database = sqlite_utils.Database(store.connection)
    assert database["t"].strict and database["t"].pks == ["k"]
    assert {c.name: c.type for c in database["t"].columns} == {"k": "INTEGER", "v": "TEXT"}
    with pytest.raises((apsw.ConstraintError, apsw.MismatchError)):
        store.connection.execute("INSERT INTO t VALUES ('not an integer', 'x')")
    with pytest.raises(apsw.ConstraintError):
        store.connection.execute("INSERT INTO t VALUES (7, x'00')")


def test_a_file_that_is_not_a_mnesite_database_is_refused(tmp_path) -> None:
    path = tmp_path / "other.db"
    connection = apsw.Connection(str(path))
    connection.execute("CREATE TABLE x(a)")
    connection.close()
    with pytest.raises(StoreError, match="not a mnesite database"):
        Store(str(path), create=False)
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a mnesite database"):
        Store(str(tmp_path / "junk.db"), create=False)
    with pytest.raises(StoreError, match="no such database"):
        Store(str(tmp_path / "missing.db"), create=False)


def test_a_store_is_never_created_in_another_applications_database(tmp_path) -> None:
    """Regression: ``Store(path)`` (``create=True``, how a node opens its data directory's database)
    wrote mnesite's schema, a format version and the WAL mode into any SQLite file at that path, a
    user's own database included, and opened it as a store. Such a file is refused, named, with its
    tables, and left byte for byte as it was; an empty file and an existing store open as before."""
    path = tmp_path / "mine.db"
    connection = apsw.Connection(str(path))
    connection.execute("CREATE TABLE invoices(id INTEGER PRIMARY KEY, total REAL)")
    connection.execute("INSERT INTO invoices VALUES (1, 9.5)")
    connection.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a mnesite database") as raised:
        Store(str(path))
    assert str(path) in str(raised.value) and "invoices" in str(raised.value)
    assert path.read_bytes() == before, "the file is not modified"
    assert not (tmp_path / "mine.db-wal").exists()
    (tmp_path / "empty.db").write_bytes(b"")
    Store(str(tmp_path / "empty.db")).close()
    Store(str(tmp_path / "empty.db")).close()  # a store now: opened again


def test_age_retention_waits_for_followers_but_the_count_bound_is_hard(store) -> None:
    for counter in range(2, 12):
        append(store, counter, "x", appended_ms=counter * 1000)
    with store.write_transaction():
        store.trim("default", entries_max=100, before_ms=10**9, keep_from=TxKey(1, 6))
    assert [e.tx_key.counter for e in store.tail("default", 100)][0] == 6, "a follower at (1, 6) still needs 7.."
    assert store.trimmed("default")[0] == TxKey(1, 5)
    assert store.digest_at("default", TxKey(1, 5)) is not None, "the last trimmed digest is kept for appends"
    with store.write_transaction():
        store.trim("default", entries_max=3, before_ms=None, keep_from=TxKey(1, 6))
    assert [e.tx_key.counter for e in store.tail("default", 100)] == [9, 10, 11]
    assert store.verify_chain("default") == TxKey(1, 11)


def test_a_trim_that_fails_midway_removes_nothing(store) -> None:
    """A trim deletes the oldest entries, then records the last one removed (its key and digest are
    what an append after it, and a watch from it, are checked against). The core's retention logs a
    failure that is not the disk's and goes on with the turn, whose commit then kept the deletion
    without the record: the log no longer chained from its trimmed key. A trim is all or nothing."""
    for counter in range(2, 8):
        append(store, counter, "x")
    # Any error of the second statement (a trigger stands in for it) must undo the first.
    store.connection.execute(
        "CREATE TRIGGER refuse_trim BEFORE UPDATE OF trimmed_counter ON _mnesite_shards "
        "BEGIN SELECT RAISE(ABORT, 'refused'); END"
    )
    with store.write_transaction():
        with pytest.raises(apsw.ConstraintError, match="refused"):
            store.trim("default", entries_max=2, before_ms=None)
        store.ensure_shard("other", 1)  # the turn goes on and commits
    assert [e.tx_key.counter for e in store.tail("default", 100)] == list(range(1, 8))
    assert store.trimmed("default")[0] == ZERO_KEY
    assert store.verify_chain("default") == TxKey(1, 7)


def test_a_savepoint_whose_transaction_sqlite_rolled_back_raises_the_error_that_did_it(store) -> None:
    """After some errors (SQLITE_FULL among them) SQLite rolls back the whole transaction, savepoints
    included: undoing the savepoint then failed with "no such savepoint", which hid the error that
    matters (a full disk, which the node must tell from a bug: ``storage_fault``)."""
    # A trigger's RAISE(ROLLBACK) ends the transaction the way such an error does.
    store.connection.execute(
        "CREATE TRIGGER roll_back BEFORE INSERT ON t WHEN NEW.k = 99 BEGIN SELECT RAISE(ROLLBACK, 'gone'); END"
    )
    store.connection.execute("BEGIN IMMEDIATE")
    with pytest.raises(apsw.ConstraintError, match="gone"), store.savepoint():
        store.connection.execute("INSERT INTO t VALUES (99, 'x')")
    assert not store.connection.in_transaction
    store.rollback()  # what the node's turn does next: nothing left to roll back, no error


def entries_after_applied(store: Store, counters: range) -> list:
    """Chained entries of generation 1 at ``counters``, each writing a row of t, after the applied key."""
    position = store.shard("default")
    entries = []
    previous, digest = position.applied, position.digest
    for counter in counters:
        entry = make_entry("default", TxKey(1, counter), previous, digest, [WriteOp("t", {"k": counter, "v": "u"})])
        entries.append(entry)
        previous, digest = entry.tx_key, entry.digest
    return entries


def test_retention_never_trims_unapplied_entries(store) -> None:
    entries = entries_after_applied(store, range(2, 6))
    with store.write_transaction():
        store.append_entries(entries, 0)
        store.trim("default", entries_max=1, before_ms=10**9)
    assert store.last_entry_key("default") == TxKey(1, 5)
    assert [e.tx_key.counter for e in store.tail("default", 100)] == [2, 3, 4, 5], "only applied entries may go"
    with store.write_transaction():
        assert store.truncate_after("default", TxKey(1, 3)) == 2
        with pytest.raises(StoreError, match="would remove applied entry"):
            store.truncate_after("default", ZERO_KEY)


def test_count_between_counts_keys_in_the_half_open_range_up_to_a_limit(store) -> None:
    for counter in range(2, 12):
        append(store, counter, "v")
    assert store.count_between("default", TxKey(1, 1), TxKey(1, 11), 100) == 10
    assert store.count_between("default", TxKey(1, 5), TxKey(1, 8), 100) == 3
    assert store.count_between("default", TxKey(1, 1), TxKey(1, 11), 4) == 4


def test_a_snapshot_install_clears_the_rows_then_restarts_the_log_at_its_key(store) -> None:
    append(store, 2, "old")
    with store.write_transaction():
        store.clear_rows("default")
        assert store.shard("default").applied == TxKey(1, 2)  # the position stays until the end
        store.write_rows("t", [{"k": 5, "v": "copied"}, {"k": 6, "v": "copied"}])
        store.restart_log_at("default", TxKey(3, 40), b"d" * 32)
    assert store.scan(TABLE, None, 10) == [{"k": 5, "v": "copied"}, {"k": 6, "v": "copied"}]
    position = store.shard("default")
    assert (position.applied, position.digest) == (TxKey(3, 40), b"d" * 32)
    assert store.last_entry("default") == (TxKey(3, 40), b"d" * 32)
    assert store.trimmed("default") == (TxKey(3, 40), b"d" * 32) and store.tail("default", 5) == []


def test_at_full_a_durable_commit_syncs_the_wal_and_an_apply_only_commit_does_not(tmp_path, monkeypatch) -> None:
    """One durable commit per round: a commit that only applies entries already in the log skips the
    fsync; every durable one (``write_transaction`` included) syncs the WAL file."""
    import mnesite.rlog.store as store_module

    synced: list[int] = []
    real_fdatasync = store_module.os.fdatasync
    monkeypatch.setattr(store_module.os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd)))
    full = Store(str(tmp_path / "full.db"), synchronous="FULL")
    try:
        with full.write_transaction():
            full.ensure_shard("default", 1)
        assert len(synced) == 1
        full.connection.execute("BEGIN IMMEDIATE")
        full.ensure_shard("other", 1)
        full.commit(durable=False)
        assert len(synced) == 1
        full.connection.execute("BEGIN IMMEDIATE")
        full.ensure_shard("third", 1)
        full.commit(durable=True)
        assert len(synced) == 2
        assert set(full.shards()) == {"default", "other", "third"}
    finally:
        full.close()
    normal = Store(str(tmp_path / "normal.db"), synchronous="NORMAL")
    with normal.write_transaction():
        normal.ensure_shard("default", 1)
    normal.close()
    assert len(synced) == 2  # NORMAL never syncs a commit


def test_at_full_the_first_durable_commit_also_syncs_the_directory_of_the_wal(tmp_path, monkeypatch) -> None:
    """SQLite at FULL syncs the directory once after it creates the -wal file (its DIRSYNC flag), so that
    the file, not only its contents, survives a power failure: the store commits at NORMAL and syncs
    the WAL itself (``commit``), so it must sync the directory too, once, before the first durable
    commit returns. Without it the first writes acknowledged after each start (SQLite removes the WAL
    when the node stops) were durable only on file systems that persist a new file's name with it."""
    import stat

    import mnesite.rlog.store as store_module

    synced: list[str] = []
    real_fsync, real_fdatasync = store_module.os.fsync, store_module.os.fdatasync

    def what(fd: int) -> str:
        return "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"

    monkeypatch.setattr(store_module.os, "fsync", lambda fd: (synced.append(what(fd)), real_fsync(fd)))
    monkeypatch.setattr(store_module.os, "fdatasync", lambda fd: (synced.append(what(fd)), real_fdatasync(fd)))
    full = Store(str(tmp_path / "full.db"), synchronous="FULL")
    try:
        with full.write_transaction():
            full.ensure_shard("default", 1)
        assert synced == ["file", "directory"]
        with full.write_transaction():
            full.ensure_shard("other", 1)
        assert synced == ["file", "directory", "file"]  # once per WAL file, not per commit
    finally:
        full.close()


def test_a_spill_is_replayed_a_bounded_number_of_entries_at_a_time(store, monkeypatch) -> None:
    """A bootstrap's spill may hold up to ``spill_bytes_max`` (1 GiB) of entries: the replay reads,
    decodes and applies them ``SPILL_REPLAY_ENTRIES_MAX`` at a time, in order, in the caller's one
    transaction, instead of decoding the whole spill into memory at once."""
    import mnesite.rlog.store as store_module

    monkeypatch.setattr(store_module, "SPILL_REPLAY_ENTRIES_MAX", 3, raising=False)
    position = store.shard("default")
    entries, previous = [], (position.applied, position.digest)
    for counter in range(2, 10):  # 8 entries: batches of 3, 3 and 2
        entry = make_entry("default", TxKey(1, counter), *previous, [WriteOp("t", {"k": counter, "v": "spilled"})])
        entries.append(entry)
        previous = (entry.tx_key, entry.digest)
    batches: list[int] = []
    real_append = store.append_entries
    monkeypatch.setattr(
        store, "append_entries", lambda batch, *args: (batches.append(len(batch)), real_append(batch, *args))
    )
    with store.write_transaction():
        store.spill(entries)
        last = store.replay_spill("default", position.applied, position.digest, 0)
    assert last == TxKey(1, 9) and store.spilled("default") == 0
    assert batches == [3, 3, 2]
    assert (store.shard("default").applied, store.shard("default").digest) == previous
    assert [row["k"] for row in store.scan(TABLE, None, 100)] == list(range(2, 10))
    assert store.verify_chain("default") == TxKey(1, 9)


def test_apply_committed_from_held_entries_matches_reading_them_back(tmp_path) -> None:
    """Applying from the driver's in-memory tail gives the rows and position of the log path; a
    held copy that does not link to the applied key is not trusted (the log is read instead)."""
    stores = [Store(str(tmp_path / f"{name}.db"), synchronous="NORMAL") for name in ("held", "read", "gap")]
    create = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [TABLE.to_op()])
    entries = [create]
    for counter in range(2, 6):
        row = {"k": counter % 3, "v": f"v{counter}"}
        entries.append(
            make_entry("default", TxKey(1, counter), entries[-1].tx_key, entries[-1].digest, [WriteOp("t", row)])
        )
    for store in stores:
        with store.write_transaction():
            store.ensure_shard("default", 1)
            store.append_entries(entries, 0)
    with stores[0].write_transaction():
        assert stores[0].apply_committed("default", TxKey(1, 5), entries) == entries
    with stores[1].write_transaction():
        assert stores[1].apply_committed("default", TxKey(1, 5)) == entries
    with stores[2].write_transaction():
        # A held copy with a gap (entry 3 missing): applied from the log instead, all the same.
        assert stores[2].apply_committed("default", TxKey(1, 5), entries[:2] + entries[3:]) == entries
    results = [(s.shard("default"), s.scan(s.catalog()["t"], None, 100)) for s in stores]
    assert results[0] == results[1] == results[2]
    assert results[0][0].applied == TxKey(1, 5) and results[0][0].digest == entries[-1].digest
    for store in stores:
        store.close()


def test_a_batch_apply_that_fails_names_the_entry_that_cannot_be_applied(store) -> None:
    """Held entries are applied set-based; when that fails, the error still names the one entry at
    fault (not the first of the batch) and the batch leaves no row behind."""
    entries = [store.shard("default")]
    held = []
    previous_key, previous_digest = entries[0].applied, entries[0].digest
    for counter, table in ((2, "t"), (3, "missing"), (4, "t")):
        entry = make_entry(
            "default", TxKey(1, counter), previous_key, previous_digest, [WriteOp(table, {"k": counter, "v": "x"})]
        )
        held.append(entry)
        previous_key, previous_digest = entry.tx_key, entry.digest
    with store.write_transaction():
        store.append_entries(held, 0)
    with pytest.raises(EntryApplyError, match=r"entry \(1, 3\)") as failure, store.write_transaction():
        store.apply_committed("default", TxKey(1, 4), held)
    assert failure.value.entry == held[1]
    assert store.read_row(store.catalog()["t"], 2) is None
    assert store.shard("default").applied == TxKey(1, 1)


def test_a_failed_batch_apply_rolls_the_whole_transaction_back_and_leaves_none_open(store) -> None:
    """No savepoint around the set-based apply: when it fails, the turn's transaction is rolled back
    (what was appended before it too: nothing of the turn is committed, the node stops), and naming
    the entry at fault applies the entries one by one in a transaction that is rolled back as well."""
    start = store.shard("default")
    t_create = make_entry(
        "default", TxKey(1, 2), start.applied, start.digest, [CreateTableOp("u", "default", "k", (("k", "INTEGER"),))]
    )
    write_u = make_entry("default", TxKey(1, 3), t_create.tx_key, t_create.digest, [WriteOp("u", {"k": 1})])
    bad = make_entry("default", TxKey(1, 4), write_u.tx_key, write_u.digest, [WriteOp("missing", {"k": 2})])
    held = [t_create, write_u, bad]
    store.connection.execute("BEGIN IMMEDIATE")
    store.append_entries(held, 0)
    with pytest.raises(EntryApplyError, match=r"entry \(1, 4\)") as failure:
        store.apply_committed("default", TxKey(1, 4), held)
    # The table made by the first entry of the batch is there when the third is tried alone.
    assert failure.value.entry == bad and "missing" in str(failure.value)
    assert not store.connection.in_transaction
    assert store.last_entry("default")[0] == start.applied  # the appends of the turn are gone too
    assert "u" not in store.catalog() and store.shard("default").applied == start.applied


def test_a_replicant_s_apply_that_fails_names_the_entry_and_keeps_nothing(store) -> None:
    """A replicant applies pushed entries with ``log_and_apply_verified`` (set-based too): an entry
    that cannot be applied stops the node with the ``EntryApplyError`` naming it, as on a core, not
    a bare "unknown table" that hides which committed entry it was."""
    start = store.shard("default")
    good = make_entry("default", TxKey(1, 2), start.applied, start.digest, [WriteOp("t", {"k": 2, "v": "a"})])
    bad = make_entry("default", TxKey(1, 3), good.tx_key, good.digest, [WriteOp("missing", {"k": 3})])
    store.connection.execute("BEGIN IMMEDIATE")
    with pytest.raises(EntryApplyError, match=r"entry \(1, 3\).*missing") as failure:
        store.log_and_apply_verified([good, bad], 0)
    assert failure.value.entry == bad
    assert not store.connection.in_transaction
    assert store.last_entry("default")[0] == start.applied and store.read_row(store.catalog()["t"], 2) is None


def test_a_batch_that_fails_only_together_names_its_first_entry_with_the_batch_s_error(store, monkeypatch) -> None:
    start = store.shard("default")
    first = make_entry("default", TxKey(1, 2), start.applied, start.digest, [WriteOp("t", {"k": 2, "v": "a"})])
    second = make_entry("default", TxKey(1, 3), first.tx_key, first.digest, [WriteOp("t", {"k": 3, "v": "b"})])
    store.connection.execute("BEGIN IMMEDIATE")
    store.append_entries([first, second], 0)

    def batch_fails(ops, healing=False):
        raise StoreError("only together")

    monkeypatch.setattr(store, "apply_ops_batched", batch_fails)
    with pytest.raises(EntryApplyError, match="only together") as failure:
        store.apply_committed("default", second.tx_key, [first, second])
    assert failure.value.entry == first
    assert not store.connection.in_transaction and store.read_row(store.catalog()["t"], 2) is None


def test_the_end_of_the_log_is_read_again_after_a_rollback_a_truncation_and_a_snapshot_install(store) -> None:
    """The log's end is cached per shard: every way the log changes besides an append refreshes it."""
    entry = append(store, 2, "a")
    with pytest.raises(RuntimeError), store.write_transaction():
        later = make_entry("default", TxKey(1, 3), entry.tx_key, entry.digest, [WriteOp("t", {"k": 3, "v": "b"})])
        store.append_entries([later], 0)
        assert store.last_entry("default") == (later.tx_key, later.digest)
        raise RuntimeError("rolled back")
    assert store.last_entry("default") == (entry.tx_key, entry.digest)
    with store.write_transaction():
        store.append_entries([later], 0)
        assert store.truncate_after("default", entry.tx_key) == 1
    assert store.last_entry("default") == (entry.tx_key, entry.digest)
    with pytest.raises(StoreError, match="follows"):
        store.append_entries([make_entry("default", TxKey(1, 9), later.tx_key, later.digest, ())], 0)
    with store.write_transaction():
        store.restart_log_at("default", TxKey(2, 7), b"r" * 32)
    assert store.last_entry("default") == (TxKey(2, 7), b"r" * 32)


def drop_entry(store: Store, counter: int, table: str = "t", shard: str = "default"):
    position = store.shard("default")
    return make_entry("default", TxKey(1, counter), position.applied, position.digest, [DropTableOp(table, shard)])


def test_a_drop_removes_the_table_its_rows_and_its_catalog_entry_and_replays_idempotently(store) -> None:
    append(store, 2, "a")
    entry = drop_entry(store, 3)
    with store.write_transaction():
        store.append_entry(entry, 0)
        store.apply_entry(entry)
        store.apply_ops(entry.ops)  # applied again (a replay over a copy made after it): changes nothing
    assert "t" not in store.catalog()
    assert not store.connection.execute("SELECT name FROM sqlite_master WHERE name = 't'").fetchall()
    assert store.verify_chain("default") == entry.tx_key


def test_a_drop_naming_another_shard_or_letter_case_stops_the_apply(store) -> None:
    for table, shard in (("t", "other"), ("T", "default")):
        with pytest.raises(StoreError, match="cannot drop table"), store.write_transaction():
            store.apply_entry(drop_entry(store, 2, table, shard))
    assert "t" in store.catalog()


def test_a_replay_over_a_copy_made_after_a_drop_heals_only_while_healing(tmp_path) -> None:
    """A bootstrap copy taken after the drop lacks the table that earlier spilled entries write to."""
    source = Store(str(tmp_path / "source.db"), synchronous="NORMAL")
    with source.write_transaction():
        source.ensure_shard("default", 1)
        create = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [TABLE.to_op()])
        write = make_entry("default", TxKey(1, 2), create.tx_key, create.digest, [WriteOp("t", {"k": 1, "v": "a"})])
        drop = make_entry("default", TxKey(1, 3), write.tx_key, write.digest, [DropTableOp("t", "default")])
    source.close()
    copy = Store(str(tmp_path / "copy.db"), synchronous="NORMAL")
    with copy.write_transaction():
        copy.ensure_shard("default", 1)
        copy.restart_log_at("default", create.tx_key, create.digest)  # K0 = the create; no table copied
    with pytest.raises(StoreError, match="unknown table"), copy.write_transaction():
        copy.apply_entry(write)
    with copy.write_transaction():
        for entry in (write, drop):
            copy.apply_entry(entry, healing=True)
    assert copy.shard("default").applied == drop.tx_key and "t" not in copy.catalog()
    copy.close()
    # The replicant's batched path (log_and_apply_verified) follows the same healing rule.
    batched = Store(str(tmp_path / "batched.db"), synchronous="NORMAL")
    with batched.write_transaction():
        batched.ensure_shard("default", 1)
        batched.restart_log_at("default", create.tx_key, create.digest)
    with pytest.raises(StoreError, match="unknown table"), batched.write_transaction():
        batched.log_and_apply_verified([write, drop], 0)
    assert batched.shard("default").applied == create.tx_key, "a refused batch changes nothing"
    with batched.write_transaction():
        batched.log_and_apply_verified([write, drop], 0, healing=True)
    assert batched.shard("default").applied == drop.tx_key and "t" not in batched.catalog()
    batched.close()


def chain_after(store: Store, ops_list) -> list:
    position = store.shard("default")
    key, digest, entries = position.applied, position.digest, []
    for ops in ops_list:
        entry = make_entry("default", TxKey(1, key.counter + 1), key, digest, ops)
        entries.append(entry)
        key, digest = entry.tx_key, entry.digest
    return entries


def test_a_verified_batch_is_logged_and_applied_in_op_order_with_one_position(store) -> None:
    from mnesite.rlog.types import DeleteOp

    entries = chain_after(
        store,
        [
            [WriteOp("t", {"k": 1, "v": "a"}), WriteOp("t", {"k": 2, "v": "b"}), WriteOp("t", {"k": 1, "v": "c"})],
            [DeleteOp("t", 2), WriteOp("t", {"k": 3, "v": "d"})],
            [WriteOp("t", {"k": 2, "v": "e"}), DeleteOp("t", 3)],
        ],
    )
    with store.write_transaction():
        store.log_and_apply_verified(entries, 0)
    table = store.catalog()["t"]
    assert store.scan(table, None, 10) == [{"k": 1, "v": "c"}, {"k": 2, "v": "e"}]
    position = store.shard("default")
    assert (position.applied, position.digest) == (entries[-1].tx_key, entries[-1].digest)
    assert store.entries_after("default", TxKey(1, 1), 10) == entries
    assert store.verify_chain("default") == entries[-1].tx_key


def test_a_membership_entry_moves_only_the_position_on_both_apply_paths(tmp_path) -> None:
    """A replicant applies a membership entry (core.membership) like any other, set-based; it
    changes no table, between writes of one table too."""
    from mnesite.rlog.types import MembersOp

    members = MembersOp(("core1", "core2", "core4"), "core4", "tcp://127.0.0.1:7404")
    ops_list = [[WriteOp("t", {"k": 1, "v": "a"}), members, WriteOp("t", {"k": 2, "v": "b"})], [members]]
    for batched in (False, True):
        store = Store(str(tmp_path / f"mnesite-{batched}.db"), synchronous="NORMAL")
        with store.write_transaction():
            store.ensure_shard("default", 1)
            first = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [TABLE.to_op()])
            store.append_entry(first, 0)
            store.apply_entry(first)
        entries = chain_after(store, ops_list)
        with store.write_transaction():
            if batched:
                store.log_and_apply_verified(entries, 0)
            else:
                for entry in entries:
                    store.append_entry(entry, 0)
                    store.apply_entry(entry)
        assert store.scan(store.catalog()["t"], None, 10) == [{"k": 1, "v": "a"}, {"k": 2, "v": "b"}]
        assert store.shard("default").applied == entries[-1].tx_key
        assert store.entries_after("default", TxKey(1, 1), 10) == entries
        store.close()


def test_a_verified_batch_with_a_gap_is_refused_and_changes_nothing(store) -> None:
    entries = chain_after(store, [[WriteOp("t", {"k": n, "v": "x"})] for n in range(3)])
    before = store.shard("default")
    for batch in (entries[1:], [entries[0], entries[2]]):
        with pytest.raises(StoreError, match="follow"), store.write_transaction():
            store.log_and_apply_verified(batch, 0)
        assert store.shard("default") == before
        assert store.scan(store.catalog()["t"], None, 10) == []
        assert store.last_entry_key("default") == TxKey(1, 1)


def test_packed_entries_go_on_the_wire_exactly_as_decoded_ones_within_their_size_bound(store) -> None:
    import msgpack
    from mnesite.rlog.types import DeleteOp

    entries = chain_after(
        store,
        [[WriteOp("t", {"v": "é" * 300, "k": 2}), DeleteOp("t", 1)], [WriteOp("t", {"k": 3, "v": None})]],
    )
    with store.write_transaction():
        store.log_and_apply_verified(entries, 0)
    packed = store.packed_entries_after("default", TxKey(1, 1), 10)
    assert [p.tx_key for p in packed] == [e.tx_key for e in entries]
    for entry, packed_entry in zip(entries, packed, strict=True):
        assert packed_entry.to_wire() == msgpack.unpackb(msgpack.packb(entry.to_wire()), raw=False)
        assert msgpack.packb(packed_entry.to_wire()) == msgpack.packb(entry.to_wire())
        assert len(msgpack.packb(packed_entry.to_wire())) <= packed_entry.size_bytes
    assert store.packed_entries_after("default", TxKey(1, 2), 1)[0].tx_key == TxKey(1, 3)


def test_a_batch_of_row_ops_is_applied_in_runs_of_one_kind_and_table_in_order(tmp_path) -> None:
    from mnesite.rlog.store import _row_op_run_ends
    from mnesite.rlog.types import DeleteOp, MembersOp, WriteOp

    ops = [WriteOp("a", {"id": 1}), WriteOp("a", {"id": 2}), DeleteOp("a", 1), WriteOp("b", {"id": 1})]
    ops += [WriteOp("a", {"id": 1}), WriteOp("a", {"id": 3})]
    assert _row_op_run_ends(ops) == [2, 3, 4, 6]
    assert _row_op_run_ends([*ops, MembersOp(("c1",), "", "")]) is None  # the caller scans
    assert _row_op_run_ends(ops[:2]) == [2]  # one kind of one table: one run
    assert _row_op_run_ends([ops[0], WriteOp("b", {"id": 1})]) == [1, 2]  # one kind, two tables
    assert _row_op_run_ends([ops[0], DeleteOp("a", 2)]) == [1, 2]  # one table, two kinds
    store = Store(str(tmp_path / "runs.db"))
    with store.write_transaction():
        store.ensure_shard("default", 0)
        for name in ("a", "b"):
            store.apply_ops((define_table(name, "id", [("id", "INTEGER")], "default").to_op(),))
        store.apply_ops_batched(ops)
    catalog = store.catalog()
    assert [row["id"] for row in store.scan(catalog["a"], None, 10)] == [1, 2, 3]  # deleted, then written again
    assert [row["id"] for row in store.scan(catalog["b"], None, 10)] == [1]


def test_rows_decoded_as_runs_are_applied_as_their_writes_are(tmp_path) -> None:
    # A replicant decodes a bulk write packed as one WriteRows as it is (tuples in sorted column order);
    # the store must leave exactly what the same entries decoded as WriteOps leave: a table declared in
    # another column order, rows of before an added column (null there), a column the table lacks
    # (left out), runs of different column lists next to each other, and apply_ops as well.
    from mnesite.rlog import messages
    from mnesite.rlog.types import AddColumnOp, WriteRows, pack_ops

    people = define_table("p", "id", [("name", "TEXT"), ("id", "INTEGER"), ("age", "INTEGER")], "default")
    entries = [
        [WriteOp("p", {"name": f"n{i}", "id": i, "age": 20 + i}) for i in range(4)],
        [AddColumnOp("p", "default", "city", "TEXT")],
        [WriteOp("p", {"name": f"m{i}", "id": i, "age": 30 + i}) for i in range(2, 6)],  # no city: null
        [WriteOp("p", {"name": f"c{i}", "id": i, "age": 1, "city": "x"}) for i in range(5, 7)],
        [WriteOp("p", {"name": "g", "id": 9, "age": 2, "city": "y", "ghost": 1}) for _ in range(2)],
    ]
    contents = []
    for mode in ("ops", "runs", "runs one by one"):
        store = Store(str(tmp_path / f"{mode}.db"))
        runs = mode != "ops"  # packed as a cluster at version 2 packs them, decoded as a replicant decodes
        decoded = [messages.decode_ops(pack_ops(tuple(ops), runs), runs=runs) for ops in entries]
        if mode == "runs":
            assert [type(ops[0]) for ops in decoded] == [WriteRows, AddColumnOp, WriteRows, WriteRows, WriteRows]
        with store.write_transaction():
            store.ensure_shard("default", 0)
            store.apply_ops((people.to_op(),))
            if mode == "runs one by one":
                for ops in decoded:
                    store.apply_ops(ops)
            else:
                store.apply_ops_batched([op for ops in decoded for op in ops])
        contents.append(list(store.connection.execute('SELECT * FROM "p" ORDER BY "id"')))
        store.close()
    assert contents[0] == contents[1] == contents[2]
    assert contents[0][2:4] == [("m2", 2, 32, None), ("m3", 3, 33, None)]
    assert contents[0][-1] == ("g", 9, 2, "y")


def test_a_run_of_a_table_that_is_gone_is_skipped_only_while_healing(store) -> None:
    from mnesite.rlog.types import WriteRows

    run = WriteRows("gone", ("k", "v"), [(1, "a")])
    with store.write_transaction():
        store.apply_ops_batched([run], healing=True)  # a bootstrap copy made after the drop lacks it
        with pytest.raises(StoreError):
            store.apply_ops_batched([run])


def test_the_key_retention_counts_back_to_is_the_one_an_offset_walk_finds(tmp_path, monkeypatch) -> None:
    # Store._newest_key_at counts each generation's entries from its first and last key (counters are
    # consecutive within a generation); the OFFSET walk it replaced is the reference, at every offset, over
    # a log of several generations, after trims, and past the generations it counts (then it walks).
    import mnesite.rlog.store as store_module

    store = Store(str(tmp_path / "generations.db"))
    with store.write_transaction():
        store.ensure_shard("default", 1)
    previous, digest = ZERO_KEY, GENESIS_DIGEST
    for generation, count in ((1, 5), (2, 1), (4, 6), (5, 3), (7, 2)):
        for counter in range(1, count + 1):
            entry = make_entry("default", TxKey(generation, counter), previous, digest, [TABLE.to_op()])
            with store.write_transaction():
                store.append_entry(entry, 0)
                store.apply_entry(entry)
            previous, digest = entry.tx_key, entry.digest

    def walked(offset: int) -> TxKey | None:
        return store._newest_key("shard = ?", ("default",), offset)

    for trimmed in (0, 3, 6, 9):  # entries removed by retention so far
        if trimmed:
            with store.write_transaction():
                store.trim("default", 17 - trimmed, None)
        held = [TxKey(*row) for row in store.connection.execute("SELECT generation, counter FROM _mnesite_rlog")]
        assert len(held) == 17 - trimmed
        for counted in (64, 2, 1):
            monkeypatch.setattr(store_module, "RETENTION_GENERATIONS_COUNTED", counted)
            assert [store._newest_key_at("default", offset) for offset in range(20)] == [walked(o) for o in range(20)]
    store.close()


def test_the_newest_key_appended_before_a_time_is_found_by_bisection_as_a_walk_finds_it(tmp_path) -> None:
    # Retention's age bound (Store._newest_appended_before) bisects over the log's keys, named by each
    # generation's first and last counter: the walk from the newest entry it replaced is the reference at
    # every time, over several generations and after trims; after the clock stepped back it stops where the
    # appended times cross the bound (an entry before it, the next one at or after it).
    store = Store(str(tmp_path / "ages.db"))
    with store.write_transaction():
        store.ensure_shard("default", 1)
    previous, digest = ZERO_KEY, GENESIS_DIGEST
    times = iter([10, 10, 20, 30, 30, 30, 40, 55, 60, 61, 70, 80, 95, 96, 97, 120])
    for generation, count in ((1, 4), (2, 1), (4, 6), (5, 3), (7, 2)):
        for counter in range(1, count + 1):
            entry = make_entry("default", TxKey(generation, counter), previous, digest, [TABLE.to_op()])
            with store.write_transaction():
                store.append_entry(entry, next(times))
                store.apply_entry(entry)
            previous, digest = entry.tx_key, entry.digest

    def walked(before_ms: int) -> TxKey | None:
        return store._newest_key("shard = ? AND appended_ms < ?", ("default", before_ms))

    for trimmed in (0, 5, 11):
        if trimmed:
            with store.write_transaction():
                store.trim("default", 16 - trimmed, None)
        assert [store._newest_appended_before("default", t) for t in range(130)] == [walked(t) for t in range(130)]
    with store.write_transaction():  # the node's clock stepped back: times 120 (kept), then 50, 130, 140
        for when in (50, 130, 140):
            entry = make_entry("default", TxKey(7, previous.counter + 1), previous, digest, [TABLE.to_op()])
            store.append_entry(entry, when)
            store.apply_entry(entry)
            previous, digest = entry.tx_key, entry.digest
    rows = list(store.connection.execute("SELECT generation, counter, appended_ms FROM _mnesite_rlog ORDER BY 1, 2"))
    for before_ms in range(150):
        found = store._newest_appended_before("default", before_ms)
        if found is None:
            assert rows[0][2] >= before_ms
            continue
        index = [TxKey(g, c) for g, c, _ in rows].index(found)
        assert rows[index][2] < before_ms and (index + 1 == len(rows) or rows[index + 1][2] >= before_ms)
    store.close()


def test_a_snapshot_install_keeps_the_log_after_its_key_when_the_log_holds_that_key(store) -> None:
    """Regression: ``restart_log_at`` emptied the log, so an install at a key the follower's log holds
    (an offer it asked for after an abandoned install: core.snapshot, "Re-offer") dropped the entries
    after it, which this core may have acknowledged (a committed write could lose a replica it was
    counted on). Holding the key with the offer's digest, the log keeps them (Raft's rule)."""
    entries = entries_after_applied(store, range(2, 6))
    with store.write_transaction():
        store.append_entries(entries, 0)
        store.restart_log_at("default", TxKey(1, 3), entries[1].digest)
    assert [e.tx_key.counter for e in store.tail("default", 100)] == [4, 5]
    assert store.trimmed("default") == (TxKey(1, 3), entries[1].digest)
    assert store.shard("default").applied == TxKey(1, 3)
    with store.write_transaction():  # another history at that key: nothing of this log is kept
        store.restart_log_at("default", TxKey(1, 4), b"x" * 32)
    assert store.tail("default", 100) == [] and store.last_entry("default") == (TxKey(1, 4), b"x" * 32)


@pytest.mark.parametrize("path", ["apply_entry", "apply_committed", "log_and_apply_verified"])
def test_each_drop_is_recorded_with_its_key_column_and_trimmed_with_the_log(tmp_path, path: str) -> None:
    """The changefeed keys a write of an older entry by its own table's key column (``key_column_at``):
    the catalog holds only the table of that name made last. Every apply path records a drop (batched
    ones flatten many entries' ops), a rolled-back one leaves nothing, and retention trims them."""
    store = Store(str(tmp_path / "mnesite.db"), synchronous="NORMAL")
    columns = (("k", "INTEGER"), ("v", "TEXT"))
    batches = [
        [CreateTableOp("t", "default", "k", columns)],
        [WriteOp("t", {"k": 1, "v": "a"})],
        [WriteOp("t", {"k": 2, "v": "b"}), DropTableOp("t", "default")],  # (1, 3): writes, then drops
        [CreateTableOp("t", "default", "v", columns), WriteOp("t", {"k": 3, "v": "c"})],
        [DropTableOp("t", "default"), CreateTableOp("t", "default", "k", columns)],  # (1, 5)
        [WriteOp("t", {"k": 4, "v": "d"})],
    ]
    try:
        with store.write_transaction():
            store.ensure_shard("default", 1)
        entries, prev, digest = [], ZERO_KEY, GENESIS_DIGEST
        for counter, ops in enumerate(batches, start=1):
            entries.append(make_entry("default", TxKey(1, counter), prev, digest, ops))
            prev, digest = entries[-1].tx_key, entries[-1].digest
        store.connection.execute("BEGIN")  # a drop rolled back is not recorded
        for entry in entries[:3]:
            store.apply_entry(entry)
        store.rollback()
        assert store.connection.execute("SELECT count(*) FROM _mnesite_dropped_tables").fetchone() == (0,)
        with store.write_transaction():
            if path == "log_and_apply_verified":
                store.log_and_apply_verified(entries, 0)
            else:
                store.append_entries(entries, 0)
                if path == "apply_entry":
                    for entry in entries:
                        store.apply_entry(entry)
                else:
                    store.apply_committed("default", entries[-1].tx_key, held=entries)
        drops = store.connection.execute("SELECT * FROM _mnesite_dropped_tables").fetchall()
        assert drops == [("default", "t", "k", 1, 3), ("default", "t", "v", 1, 5)]
        assert [store.key_column_at("default", "t", TxKey(1, c)) for c in range(2, 7)] == ["k", "k", "v", "v", "k"]
        assert store.key_column_at("default", "gone", TxKey(1, 2)) is None
        with store.write_transaction():
            store.trim("default", 2, None)  # keeps (1, 5) and (1, 6): the drop at (1, 3) has no entry before it
        assert store.connection.execute("SELECT counter FROM _mnesite_dropped_tables").fetchall() == [(5,)]
    finally:
        store.close()


def test_a_drop_a_copy_applied_outside_any_entry_is_never_recorded_under_a_later_entry(tmp_path) -> None:
    """Regression: a snapshot install's or bootstrap's schema ops (``shard_schema_ops_toward``, applied
    with ``apply_ops``, outside any entry) left their drops pending, as the id of an op freed since; the
    next apply matched pending drops to its entries' ops by ``id()``, so a drop op of that entry that
    took the freed op's id (CPython reuses addresses) recorded the copy's table and key column under
    the entry, and the changefeed keyed writes before it by a column of a table long gone. Played here
    by the same op object (the id a reused address gives): the entry's drop must record only the key
    column of the table it dropped."""
    store = Store(str(tmp_path / "mnesite.db"), synchronous="NORMAL")
    columns = (("k", "INTEGER"), ("v", "TEXT"))
    drop = DropTableOp("t", "default")
    try:
        with store.write_transaction():
            store.ensure_shard("default", 1)
        for same_transaction in (False, True):
            with store.write_transaction():
                store.apply_ops((CreateTableOp("t", "default", "k", columns),))  # what the copy held
            store.connection.execute("BEGIN")
            store.apply_ops((drop,))  # the copy's: the core lists no table t (dropped meanwhile)
            if not same_transaction:
                store.commit()
                store.connection.execute("BEGIN")
            ops = [CreateTableOp("t", "default", "v", columns), WriteOp("t", {"k": 1, "v": "a"}), drop]
            entry = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, ops)
            store.append_entries([entry], 0)
            store.apply_entry(entry)
            drops = store.connection.execute("SELECT name, key_column, counter FROM _mnesite_dropped_tables").fetchall()
            assert drops == [("t", "v", 1)], (same_transaction, drops)
            store.rollback()
    finally:
        store.close()


def test_the_drops_recorded_go_with_the_log_a_snapshot_install_or_a_bootstrap_restarts(tmp_path) -> None:
    """``_mnesite_dropped_tables`` is kept while the log holds entries before the drop (``trim`` deletes
    them with the entries): ``restart_log_at`` and ``reset_shard`` emptied or cut the shard's log but
    left its drops, kept for no entry. They go with the entries, in the same transaction."""
    store = Store(str(tmp_path / "mnesite.db"), synchronous="NORMAL")
    columns = (("k", "INTEGER"), ("v", "TEXT"))
    batches = [
        [CreateTableOp("t", "default", "k", columns)],
        [DropTableOp("t", "default")],  # (1, 2)
        [CreateTableOp("t", "default", "v", columns)],
        [DropTableOp("t", "default")],  # (1, 4)
        [CreateTableOp("t", "default", "k", columns)],
        [CreateTableOp("u", "other", "k", columns)],  # another shard's drop stays throughout
        [DropTableOp("u", "other")],
    ]
    drops = "SELECT shard, counter FROM _mnesite_dropped_tables ORDER BY shard, counter"
    try:
        with store.write_transaction():
            store.ensure_shard("default", 1)
            store.ensure_shard("other", 1)
        entries, prev, digest = [], ZERO_KEY, GENESIS_DIGEST
        for counter, ops in enumerate(batches[:5], start=1):
            entries.append(make_entry("default", TxKey(1, counter), prev, digest, ops))
            prev, digest = entries[-1].tx_key, entries[-1].digest
        other = [make_entry("other", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, batches[5])]
        other.append(make_entry("other", TxKey(1, 2), other[0].tx_key, other[0].digest, batches[6]))
        with store.write_transaction():
            store.log_and_apply_verified(entries, 0)
            store.log_and_apply_verified(other, 0)
        assert store.connection.execute(drops).fetchall() == [("default", 2), ("default", 4), ("other", 2)]
        # A snapshot install at (1, 3), the same history: the entries after it, and their drop, stay.
        with store.write_transaction():
            store.restart_log_at("default", TxKey(1, 3), entries[2].digest)
        assert [e.tx_key.counter for e in store.tail("default", 100)] == [4, 5]
        assert store.connection.execute(drops).fetchall() == [("default", 4), ("other", 2)]
        assert store.key_column_at("default", "t", TxKey(1, 4)) == "v"
        # Another history: the log is emptied, and its drops with it.
        with store.write_transaction():
            store.restart_log_at("default", TxKey(1, 4), b"x" * 32)
        assert store.tail("default", 100) == []
        assert store.connection.execute(drops).fetchall() == [("other", 2)]
        assert store.key_column_at("default", "t", TxKey(1, 4)) == "k"  # the catalog's: the table there now
        # A bootstrap starts (a replicant's ResetShard): the same; a rollback keeps them all.
        store.connection.execute("BEGIN")
        store.reset_shard("other")
        assert store.connection.execute(drops).fetchall() == []
        store.rollback()
        assert store.connection.execute(drops).fetchall() == [("other", 2)]
        with store.write_transaction():
            store.reset_shard("other")
        assert store.connection.execute(drops).fetchall() == []
    finally:
        store.close()


def test_the_exclusion_by_a_forced_start_is_persisted_per_shard_and_cleared(tmp_path) -> None:
    """A core a forced start left out kept that only in memory: restarted, it served local reads of a
    state that no longer moves. The forced generation is persisted in the shard's row (NULL: not left
    out), beside the generation and vote, and survives a reopen; clearing it is persisted too."""
    path = str(tmp_path / "mnesite.db")
    store = Store(path, synchronous="NORMAL")
    with store.write_transaction():
        store.ensure_shard("default", 1)
        store.ensure_shard("other", 1)
        assert store.excluded_generation("default") is None
        store.persist_excluded_generation("default", 4)
    store.close()
    store = Store(path, synchronous="NORMAL")
    assert (store.excluded_generation("default"), store.excluded_generation("other")) == (4, None)
    with store.write_transaction():
        store.persist_excluded_generation("default", None)
    store.close()
    store = Store(path, synchronous="NORMAL")
    assert store.excluded_generation("default") is None
    with pytest.raises(StoreError, match="unknown shard"):
        store.excluded_generation("nope")
    store.close()


def test_a_store_from_before_the_exclusion_column_opens_and_gets_it(tmp_path) -> None:
    """A data directory written before ``excluded_generation`` existed (release 0.1.0's shard rows have
    no such column; ``CREATE TABLE IF NOT EXISTS`` leaves them as they are) opens: the column is added,
    NULL for every shard (not left out), the rows and the storage format are unchanged."""
    path = str(tmp_path / "mnesite.db")
    store = Store(path, synchronous="NORMAL")
    with store.write_transaction():
        store.ensure_shard("default", 3)
        store.persist_consensus_state("default", 3, "core2", ("core1", "core2"), True)
    store.close()
    older = apsw.Connection(path)
    older.execute("ALTER TABLE _mnesite_shards DROP COLUMN excluded_generation")
    columns = [row[1] for row in older.execute("PRAGMA table_info(_mnesite_shards)")]
    assert "excluded_generation" not in columns and "trimmed_digest" in columns
    older.close()
    store = Store(path, synchronous="NORMAL")
    assert store.excluded_generation("default") is None
    assert store.consensus_state("default") == (3, "core2", ("core1", "core2"), True)
    assert store.storage_format() == 1
    with store.write_transaction():
        store.persist_excluded_generation("default", 5)
    store.close()
    store = Store(path, synchronous="NORMAL")
    assert store.excluded_generation("default") == 5
    store.close()
