"""The compare job's plan (spark.compare, step 2) over file replicas, without Spark: which differences
between two replicas at different applied keys are lag (in flight) and which are divergence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mnesite.rlog.store import Store
from mnesite.rlog.types import DropTableOp
from mnesite.spark.compare import CompareOptions, _classify, _plan
from mnesite.spark.replica import FileReplica, parse_replica

from tests.spark_fixtures import commit, copy_replica, create_store, create_table, write_rows

TAGS = (("tag", "TEXT"), ("weight", "INTEGER"))


def _planned(replicas: list[Path]) -> tuple[Any, Any, dict[str, list[dict[Any, bytes]]]]:
    """``_plan``'s report and in-flight keys, and every table's row digests on each replica."""
    opened = [FileReplica(parse_replica(str(path))) for path in replicas]
    try:
        labels = [str(path) for path in replicas]
        report, in_flight = _plan(opened, labels, CompareOptions(), lambda message: None)
        rows = {
            name: [dict(replica.row_digests(replica.catalog()[name], None, None)) for replica in opened]
            for name in report.tables
        }
    finally:
        for replica in opened:
            replica.close()
    return report, in_flight, rows


def test_a_table_dropped_and_created_again_between_the_applied_keys_is_in_flight(tmp_path: Path) -> None:
    """Regression: a table the more advanced replica's rlog dropped and created again between the two
    applied keys (same declaration) kept the behind replica's old rows, which no entry of the span
    writes or deletes: they were counted missing on the replica ahead, and the replicas diverged (exit 1)
    for a replicant a few entries behind its core. Created again with another declaration, the table
    was reported declared differently (diverged). Both are the behind replica's lag."""
    store = create_store(tmp_path / "ahead")
    create_table(store, "tags", "tag", TAGS)
    create_table(store, "notes", "id", [("id", "INTEGER"), ("text", "TEXT")])
    write_rows(store, "tags", [{"tag": f"tag-{key:03d}", "weight": key} for key in range(40)])
    write_rows(store, "notes", [{"id": key, "text": f"n{key}"} for key in range(10)])
    store.close()
    behind = copy_replica(tmp_path / "ahead", tmp_path / "behind")
    store = Store(str(tmp_path / "ahead" / "mnesite.db"), synchronous="OFF")
    commit(store, [DropTableOp("tags", "default")])
    create_table(store, "tags", "tag", TAGS)
    write_rows(store, "tags", [{"tag": f"tag-{key:03d}", "weight": 1000 + key} for key in range(5)])
    commit(store, [DropTableOp("notes", "default")])
    create_table(store, "notes", "id", [("id", "INTEGER"), ("body", "TEXT"), ("pinned", "INTEGER")])
    store.close()
    ahead = tmp_path / "ahead"
    for order in ([ahead, behind], [behind, ahead]):
        report, in_flight, rows = _planned(order)
        assert report.tables == ["tags"] and report.tables_mismatched == {}, report.to_json()
        assert report.tables_recreated_in_flight == {"notes": [str(behind)]}, report.to_json()
        # Every key of tags is in flight: counted as a table, since no key count can say so.
        assert report.statistics["in_flight_tables"] == 1 and report.statistics["in_flight_keys"] == 0
        keys = _classify(rows["tags"][0], rows["tags"][1], in_flight[(1, "tags")])
        assert {category: len(found) for category, found in keys.items()} == {
            "missing_on_left": 0,
            "missing_on_right": 0,
            "different": 0,
            "in_flight": 40,  # 35 rows only the behind replica still has, 5 written again with other values
        }
        assert not report.diverged
    # The same difference with no entry that explains it (the log trimmed past the drop) diverges.
    trimmed = Store(str(ahead / "mnesite.db"), synchronous="OFF")
    with trimmed.write_transaction():
        trimmed.trim("default", entries_max=1, before_ms=None)
    trimmed.close()
    report, in_flight, rows = _planned([ahead, behind])
    assert list(report.tables_mismatched) == ["notes"] and report.tables_recreated_in_flight == {}
    keys = _classify(rows["tags"][0], rows["tags"][1], in_flight.get((1, "tags"), set()))
    assert len(keys["missing_on_left"]) == 35 and len(keys["different"]) == 5 and report.diverged


def test_a_table_of_another_shard_is_never_taken_for_one_made_again_in_flight() -> None:
    """Regression (the session's own change, caught by the Spark test of tables in another shard): a
    table declared in shard ``other`` on one replica and created in ``default``'s span on the other was
    reported as made again in flight; one shard's span cannot explain a table of another shard."""
    from mnesite.rlog.schema import define_table
    from mnesite.spark.compare import _recreated_in_flight

    columns = [["k", "INTEGER"], ["v", "TEXT"]]
    ahead = define_table("kv", "k", columns, shard="default")
    behind_same_shard = define_table("kv", "v", columns, shard="default")
    behind_other_shard = define_table("kv", "k", columns, shard="other")
    created_in_span = {(1, "default"): (0, {"kv": "created"}, {})}
    assert _recreated_in_flight("kv", [ahead, behind_same_shard], created_in_span) == [1]
    assert _recreated_in_flight("kv", [ahead, behind_other_shard], created_in_span) is None
