"""The mnesite data source and the Spark compare job over real replica files (and one live node)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import apsw
import pytest
from click.testing import CliRunner
from mnesite.rlog.store import Store
from mnesite.rlog.types import AddColumnOp, DropTableOp, WriteOp
from mnesite.spark.cli import compare as compare_command
from mnesite.spark.cli import render_report
from mnesite.spark.compare import EXIT_DIVERGED, EXIT_EQUAL, EXIT_ERROR, CompareError, CompareOptions, compare

from tests.spark_fixtures import commit, copy_replica, create_store, create_table, delete_keys, write_rows

pytestmark = [pytest.mark.spark]

USERS_ROWS = 2000
DRILL = CompareOptions(ranges_initial=8, fanout=4, leaf_rows_max=16, sample_max=5)


def user(key: int) -> dict[str, Any]:
    return {"id": key, "name": f"user {key}", "score": key / 7, "extra": key if key % 3 else f"t{key}", "avatar": None}


def build_primary(directory: Path) -> Store:
    store = create_store(directory)
    create_table(
        store,
        "users",
        "id",
        [("id", "INTEGER"), ("name", "TEXT"), ("score", "REAL"), ("extra", "ANY"), ("avatar", "BLOB")],
    )
    create_table(store, "tags", "tag", [("tag", "TEXT"), ("weight", "INTEGER")])
    write_rows(store, "users", [user(key) for key in range(USERS_ROWS)])
    write_rows(store, "tags", [{"tag": f"tag-{key:04d}", "weight": key} for key in range(300)])
    return store


@pytest.fixture
def equal_replicas(tmp_path: Path) -> tuple[Path, Path]:
    build_primary(tmp_path / "a").close()
    return tmp_path / "a", copy_replica(tmp_path / "a", tmp_path / "b")


def tamper(directory: Path, statements: list[tuple[str, tuple]]) -> None:
    """Change a replica behind mnesite's back, as disk corruption or a bug would."""
    connection = apsw.Connection(str(directory / "mnesite.db"))
    with connection:
        for sql, bindings in statements:
            connection.execute(sql, bindings)
    connection.close()


def samples_by_key(pair: Any, category: str) -> dict[Any, dict[str, Any]]:
    return {sample["key"]: sample for sample in pair.samples[category]}


@pytest.mark.timeout(120)
def test_data_source_reads_a_table_in_key_range_partitions(spark_session: Any, equal_replicas: tuple) -> None:
    primary, _ = equal_replicas
    for location in (str(primary), str(primary / "mnesite.db")):
        frame = (
            spark_session.read.format("mnesite")
            .option("path", location)
            .option("table", "users")
            .option("partitions", "3")
            .load()
        )
        assert [(f.name, f.dataType.simpleString()) for f in frame.schema.fields] == [
            ("id", "bigint"),
            ("name", "string"),
            ("score", "double"),
            ("extra", "string"),
            ("avatar", "binary"),
        ]
        assert frame.rdd.getNumPartitions() == 3
        sizes = frame.rdd.glom().map(len).collect()
        assert sum(sizes) == USERS_ROWS and min(sizes) > USERS_ROWS // 4
        rows = {row["id"]: row.asDict() for row in frame.collect()}
        assert len(rows) == USERS_ROWS
        # ANY renders as text: integers in decimal, text unchanged.
        assert rows[4] == {"id": 4, "name": "user 4", "score": 4 / 7, "extra": "4", "avatar": None}
        assert rows[3]["extra"] == "t3"
    with pytest.raises(Exception, match="unknown table"):
        spark_session.read.format("mnesite").option("path", str(primary)).option("table", "nope").load()


@pytest.mark.timeout(120)
def test_equal_replicas_compare_equal_and_ship_only_range_digests(spark_session: Any, equal_replicas: tuple) -> None:
    messages: list[str] = []
    report = compare([str(p) for p in equal_replicas], DRILL, session=spark_session, progress=messages.append)
    assert report.exit_status == EXIT_EQUAL and not report.diverged
    assert report.tables == ["tags", "users"]
    assert report.rows["users"] == {str(equal_replicas[0]): USERS_ROWS, str(equal_replicas[1]): USERS_ROWS}
    assert report.statistics["levels"] == 1 and report.statistics["rows_shipped"] == 0
    assert all(count == 0 for pair in report.pairs for count in pair.counts.values())
    assert any("level 1" in message for message in messages)
    applied = report.to_json()["applied"]
    assert applied[str(equal_replicas[0])] == applied[str(equal_replicas[1])]


@pytest.mark.timeout(120)
def test_changed_deleted_and_added_rows_are_reported_exactly(spark_session: Any, equal_replicas: tuple) -> None:
    primary, copy = equal_replicas
    tamper(
        copy,
        [
            ("UPDATE users SET name = 'mallory' WHERE id IN (3, 1000)", ()),
            ("UPDATE users SET score = 0.5 WHERE id = 1999", ()),
            ("UPDATE users SET avatar = x'00ff' WHERE id = 42", ()),
            ("DELETE FROM users WHERE id IN (0, 1500)", ()),
            ("INSERT INTO users VALUES (5000, 'eve', 1.0, x'01', NULL)", ()),
            ("UPDATE tags SET weight = -1 WHERE tag = 'tag-0100'", ()),
            ("INSERT INTO tags VALUES ('tag-0100a', 1)", ()),
        ],
    )
    report = compare([str(primary), str(copy)], DRILL, session=spark_session)
    assert report.exit_status == EXIT_DIVERGED
    users = next(p for p in report.pairs if p.table == "users")
    assert users.counts == {"missing_on_left": 1, "missing_on_right": 2, "different": 4, "in_flight": 0}
    different = samples_by_key(users, "different")
    assert sorted(different) == [3, 42, 1000, 1999]  # sample_max=5 holds all four
    assert different[3]["left"] == user(3) and different[3]["right"] == {**user(3), "name": "mallory"}
    assert different[42]["right"]["avatar"] == b"\x00\xff"
    assert different[1999]["right"]["score"] == 0.5
    missing = samples_by_key(users, "missing_on_right")
    assert {key: sample["left"] for key, sample in missing.items()} == {0: user(0), 1500: user(1500)}
    added = samples_by_key(users, "missing_on_left")[5000]
    assert added["left"] is None and added["right"]["name"] == "eve"
    tags = next(p for p in report.pairs if p.table == "tags")
    assert tags.counts == {"missing_on_left": 1, "missing_on_right": 0, "different": 1, "in_flight": 0}
    assert samples_by_key(tags, "different")["tag-0100"]["right"] == {"tag": "tag-0100", "weight": -1}
    assert report.rows["users"] == {str(primary): USERS_ROWS, str(copy): USERS_ROWS - 1}
    # Drilling down shipped digests for sub-ranges and only small leaves of rows.
    assert report.statistics["levels"] > 1
    assert 0 < report.statistics["rows_shipped"] <= 8 * DRILL.leaf_rows_max * 2


@pytest.mark.timeout(120)
def test_sample_is_bounded(spark_session: Any, equal_replicas: tuple) -> None:
    primary, copy = equal_replicas
    tamper(copy, [("UPDATE users SET name = 'x' WHERE id % 10 = 0", ())])
    options = CompareOptions(tables=("users",), sample_max=3)
    report = compare([str(primary), str(copy)], options, session=spark_session)
    (users,) = report.pairs
    assert users.counts["different"] == USERS_ROWS // 10
    assert sorted(samples_by_key(users, "different")) == [0, 10, 20]


@pytest.mark.timeout(120)
def test_keys_touched_between_applied_keys_are_in_flight_not_divergence(spark_session: Any, tmp_path: Path) -> None:
    build_primary(tmp_path / "ahead").close()
    behind = copy_replica(tmp_path / "ahead", tmp_path / "behind")
    store = Store(str(tmp_path / "ahead" / "mnesite.db"), synchronous="OFF")
    behind_key = store.shard("default").applied
    commit(store, [WriteOp("users", {**user(7), "name": "renamed"}), WriteOp("users", user(9000))])
    delete_keys(store, "users", [8])
    ahead_key = commit(store, [WriteOp("tags", {"tag": "tag-0001", "weight": 99})])
    store.close()
    report = compare([str(tmp_path / "ahead"), str(behind)], DRILL, session=spark_session)
    assert report.exit_status == EXIT_EQUAL
    (span,) = report.in_flight_spans
    assert (span.ahead, span.behind_key, span.ahead_key) == (str(tmp_path / "ahead"), behind_key, ahead_key)
    assert span.complete and span.entries == 3
    users = next(p for p in report.pairs if p.table == "users")
    assert users.counts == {"missing_on_left": 0, "missing_on_right": 0, "different": 0, "in_flight": 3}
    in_flight = samples_by_key(users, "in_flight")
    assert in_flight[7]["left"]["name"] == "renamed" and in_flight[7]["right"] == user(7)
    assert in_flight[8]["left"] is None and in_flight[9000]["right"] is None
    # A real divergence next to in-flight keys still counts.
    tamper(behind, [("UPDATE users SET name = 'bad' WHERE id = 11", ())])
    report = compare([str(tmp_path / "ahead"), str(behind)], DRILL, session=spark_session)
    users = next(p for p in report.pairs if p.table == "users")
    assert report.exit_status == EXIT_DIVERGED
    assert users.counts["different"] == 1 and users.counts["in_flight"] == 3
    assert list(samples_by_key(users, "different")) == [11]


@pytest.mark.timeout(120)
def test_trimmed_rlog_makes_lag_count_as_divergence(spark_session: Any, tmp_path: Path) -> None:
    build_primary(tmp_path / "ahead").close()
    behind = copy_replica(tmp_path / "ahead", tmp_path / "behind")
    store = Store(str(tmp_path / "ahead" / "mnesite.db"), synchronous="OFF")
    commit(store, [WriteOp("users", {**user(7), "name": "renamed"})])
    commit(store, [WriteOp("users", {**user(9), "name": "renamed"})])
    with store.write_transaction():
        store.trim("default", entries_max=1, before_ms=None)
    store.close()
    report = compare([str(tmp_path / "ahead"), str(behind)], DRILL, session=spark_session)
    (span,) = report.in_flight_spans
    assert not span.complete and "no longer holds" in span.reason
    users = next(p for p in report.pairs if p.table == "users")
    assert users.counts["different"] == 2 and report.exit_status == EXIT_DIVERGED


@pytest.mark.timeout(120)
def test_tables_missing_on_one_side_are_reported(spark_session: Any, equal_replicas: tuple) -> None:
    primary, copy = equal_replicas
    tamper(copy, [("DROP TABLE tags", ()), ("DELETE FROM _mnesite_tables WHERE name = 'tags'", ())])
    report = compare([str(primary), str(copy)], CompareOptions(tables=("tags", "users")), session=spark_session)
    assert report.tables_missing == {"tags": [str(copy)]} and report.tables_in_flight == {}
    assert report.tables == ["users"] and report.exit_status == EXIT_DIVERGED
    with pytest.raises(CompareError, match="unknown table 'nope'"):
        compare([str(primary), str(copy)], CompareOptions(tables=("nope",)), session=spark_session)


@pytest.mark.timeout(120)
def test_cli_prints_a_table_or_json_and_exits_by_outcome(spark_session: Any, equal_replicas: tuple) -> None:
    primary, copy = equal_replicas
    runner = CliRunner()
    result = runner.invoke(compare_command, [str(primary), str(copy), "--table", "tags", "--quiet"])
    assert result.exit_code == EXIT_EQUAL, result.output
    assert "result: equal" in result.output and "tags" in result.output
    tamper(copy, [("UPDATE tags SET weight = 7 WHERE tag = 'tag-0003'", ())])
    result = runner.invoke(compare_command, [str(primary), str(copy), "--table", "tags", "--json", "--sample", "1"])
    assert result.exit_code == EXIT_DIVERGED, result.output
    report = json.loads(result.stdout)
    assert report["status"] == "diverged"
    (pair,) = report["pairs"]
    assert pair["counts"]["different"] == 1
    assert pair["samples"]["different"] == [
        {"key": "tag-0003", "left": {"tag": "tag-0003", "weight": 3}, "right": {"tag": "tag-0003", "weight": 7}}
    ]
    assert "compare: level 1" in result.stderr  # progress goes to stderr
    assert "range(s) digested" in result.stderr and "compare: row level" in result.stderr


@pytest.mark.timeout(30)
def test_quiet_silences_what_a_child_process_writes_to_its_inherited_stderr(capfd: pytest.CaptureFixture) -> None:
    import subprocess

    from mnesite.spark.session import quiet_stderr

    # The JVM's start-up lines come from a child that inherits descriptor 2, like this shell.
    with quiet_stderr():
        subprocess.run(["sh", "-c", "echo jvm-start-up-line >&2"], check=True)
    subprocess.run(["sh", "-c", "echo after-quiet >&2"], check=True)
    err = capfd.readouterr().err
    assert "jvm-start-up-line" not in err and "after-quiet" in err


@pytest.mark.timeout(60)
def test_cli_bad_input_is_one_line_and_exit_2(spark_session: Any, equal_replicas: tuple, tmp_path: Path) -> None:
    import socket

    primary, _ = equal_replicas
    not_a_database = tmp_path / "notes.txt"
    not_a_database.write_text("hello, this is not sqlite\n" * 10)
    empty_directory = tmp_path / "empty"
    empty_directory.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    cases = [
        ([str(primary), str(not_a_database)], "not a mnesite database"),
        ([str(primary), str(empty_directory)], "has no mnesite.db"),
        ([str(primary), str(tmp_path / "absent")], "no such file or directory"),
        ([str(primary), str(primary), "--table", "nope"], "unknown table 'nope'"),
        ([str(primary)], "at least two replicas"),
        ([str(primary), f"tcp://127.0.0.1:{closed_port}", "--timeout-ms", "200"], f"127.0.0.1:{closed_port}"),
    ]
    runner = CliRunner()
    for arguments, message in cases:
        result = runner.invoke(compare_command, [*arguments, "--quiet"])
        assert result.exit_code == EXIT_ERROR, (arguments, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], (arguments, lines)
        assert "Traceback" not in result.output and result.stdout == ""


@pytest.mark.timeout(30)
def test_missing_java_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mnesite.spark.session import SparkUnavailableError, build_session

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(SparkUnavailableError, match="apt-get install -y openjdk-17-jre-headless"):
        build_session("local[1]")


@pytest.mark.timeout(120)
def test_live_node_compares_equal_to_its_own_file(spark_session: Any, thread_node: Any, tmp_path: Path) -> None:
    pytest.importorskip("mnesite.rlog.client")
    with thread_node.client() as client:
        client.create_table("kv", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
        for key in range(50):
            client.put("kv", {"k": key, "v": f"value {key}"})
        # The file is read directly below; an acknowledgement may leave before its turn's commit
        # (NodeServer.reply), a read is answered after it.
        assert client.get("kv", 49) == {"k": 49, "v": "value 49"}
    data_directory = tmp_path / "data"
    assert os.path.exists(data_directory / "mnesite.db")
    report = compare([thread_node.endpoint, str(data_directory)], DRILL, session=spark_session)
    assert report.exit_status == EXIT_EQUAL, report.to_json()
    assert report.rows["kv"] == {thread_node.endpoint: 50, str(data_directory): 50}
    frame = spark_session.read.format("mnesite").option("node", thread_node.endpoint).option("table", "kv").load()
    assert sorted(row["k"] for row in frame.collect()) == list(range(50))


@pytest.mark.timeout(120)
def test_row_level_joined_by_spark_gives_the_driver_merge_report(spark_session: Any, equal_replicas: tuple) -> None:
    primary, copy = equal_replicas
    tamper(
        copy,
        [
            ("UPDATE users SET name = 'mallory' WHERE id IN (3, 1000)", ()),
            ("DELETE FROM users WHERE id IN (0, 1500)", ()),
            ("INSERT INTO users VALUES (5000, 'eve', 1.0, x'01', NULL)", ()),
            ("UPDATE tags SET weight = -1 WHERE tag = 'tag-0100'", ()),
        ],
    )
    merged = compare([str(primary), str(copy)], DRILL, session=spark_session)
    joined = compare([str(primary), str(copy)], replace(DRILL, driver_row_digests_max=0), session=spark_session)
    assert (merged.statistics["row_level"], joined.statistics["row_level"]) == ("driver", "spark")
    assert [p.to_json() for p in joined.pairs] == [p.to_json() for p in merged.pairs]
    users = next(p for p in joined.pairs if p.table == "users")
    assert users.counts == {"missing_on_left": 1, "missing_on_right": 2, "different": 2, "in_flight": 0}
    assert samples_by_key(users, "different")[1000]["right"]["name"] == "mallory"


def compare_with_its_file_and_a_tampered_copy(
    spark_session: Any, endpoint: str, data: Path, table: str, key: int
) -> Any:
    """Compare a live node with its own data directory (equal: the report is returned), then with an
    online copy of it where ``key``'s ``v`` was changed (exactly that difference is reported)."""
    options = CompareOptions(ranges_initial=1, fanout=4, leaf_rows_max=16)
    report = compare([endpoint, str(data)], options, session=spark_session)
    assert report.exit_status == EXIT_EQUAL, report.to_json()
    copy = data.parent / "copy"
    copy.mkdir()
    target = apsw.Connection(str(copy / "mnesite.db"))
    with target.backup("main", apsw.Connection(str(data / "mnesite.db")), "main") as backup:
        backup.step()
    target.close()
    tamper(copy, [(f"UPDATE {table} SET v = 'x' WHERE k = ?", (key,))])
    (pair,) = compare([endpoint, str(copy)], options, session=spark_session).pairs
    assert pair.counts["different"] == 1 and list(samples_by_key(pair, "different")) == [key]
    return report


@pytest.mark.timeout(120)
def test_a_node_over_its_row_budget_is_drilled_into_not_misreported(spark_session: Any, tmp_path: Path) -> None:
    from tests.conftest import ThreadNode

    node = ThreadNode(tmp_path / "data", extra={"limits": {"scan_rows_max": 2}})  # 20 rows hashed per answer
    try:
        with node.client() as client:
            client.create_table("kv", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
            with client.transaction() as tx:
                for key in range(60):
                    tx.put("kv", {"k": key, "v": f"value {key}"})
            # The file is read directly below; an acknowledgement may leave before its turn's commit
            # (NodeServer.reply), a read is answered after it.
            assert client.get("kv", 59) == {"k": 59, "v": "value 59"}
        report = compare_with_its_file_and_a_tampered_copy(spark_session, node.endpoint, tmp_path / "data", "kv", 33)
        assert report.statistics["levels"] == 2 and report.statistics["rows_shipped"] == 0
    finally:
        node.stop()


@pytest.mark.timeout(120)
def test_a_node_over_its_byte_budget_is_drilled_into_with_the_same_results(spark_session: Any, tmp_path: Path) -> None:
    """A node's ``range_digest`` answer hashes at most about ten frames of row text (the regression
    is in tests/test_range_requests.py): a range of wide rows over it gets no digest, is drilled into
    like a range over the row budget, and the compare's results are those of an unbounded replica."""
    from tests.conftest import ThreadNode

    node = ThreadNode(tmp_path / "data", extra={"limits": {"frame_bytes_max": 64 * 1024}})  # 640 KB per answer
    try:
        with node.client() as client:
            client.create_table("wide", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
            for start in range(0, 120, 4):  # 1.2 MB of row text
                client.transact(
                    [
                        {"op": "write", "table": "wide", "row": {"k": k, "v": f"{k:05d}" * 2000}}
                        for k in range(start, start + 4)
                    ]
                )
            assert client.get("wide", 119)["k"] == 119  # answered after the last turn's commit
        report = compare_with_its_file_and_a_tampered_copy(spark_session, node.endpoint, tmp_path / "data", "wide", 77)
        assert report.statistics["levels"] == 2 and report.statistics["rows_shipped"] == 0
        assert set(report.rows["wide"].values()) == {120}  # the node counted the range it did not hash
    finally:
        node.stop()


@pytest.mark.timeout(120)
def test_a_replica_an_executor_cannot_read_is_a_compare_error_not_a_spark_traceback(
    spark_session: Any, equal_replicas: tuple
) -> None:
    """Executors open each replica again (on a cluster, from the worker's disk): a replica the driver
    read but an executor cannot (the file went away in between, or is not on that worker) failed the
    Spark job with a captured Java traceback instead of a CompareError (the CLI's exit 2)."""
    primary, copy = equal_replicas

    def remove_the_copy_once_planned(message: str) -> None:
        if message.startswith("comparing"):
            os.rename(copy / "mnesite.db", copy / "moved.db")

    with pytest.raises(CompareError) as caught:
        compare([str(primary), str(copy)], DRILL, session=spark_session, progress=remove_the_copy_once_planned)
    message = str(caught.value)
    assert "\n" not in message and str(copy) in message and "not a mnesite database" in message, message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row_level", ["driver", "spark"])
def test_writes_during_the_compare_are_in_flight_whichever_joins_the_rows(
    spark_session: Any, thread_node: Any, tmp_path: Path, row_level: str
) -> None:
    """A live node moves on while it is read: keys written between the plan and the row level are in
    flight. The driver's merge widened the in-flight keys to those writes; Spark's join (many differing
    rows) did not, and reported them as divergence."""
    with thread_node.client() as client:
        client.create_table("kv", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
        with client.transaction() as tx:
            for key in range(60):
                tx.put("kv", {"k": key, "v": f"value {key}"})
        assert client.get("kv", 59) == {"k": 59, "v": "value 59"}  # answered after its turn's commit
    copy = tmp_path / "copy"
    copy.mkdir()
    target = apsw.Connection(str(copy / "mnesite.db"))
    with target.backup("main", apsw.Connection(str(tmp_path / "data" / "mnesite.db")), "main") as backup:
        backup.step()
    target.close()
    tamper(copy, [("UPDATE kv SET v = 'x' WHERE k = 33", ())])

    def write_during_the_levels(message: str) -> None:
        if message.startswith("level 1"):
            with thread_node.client() as client:
                client.put("kv", {"k": 34, "v": "written during the compare"})
                assert client.get("kv", 34)["v"] == "written during the compare"

    options = CompareOptions(
        ranges_initial=1, leaf_rows_max=100, driver_row_digests_max=1_000_000 if row_level == "driver" else 0
    )
    report = compare(
        [thread_node.endpoint, str(copy)], options, session=spark_session, progress=write_during_the_levels
    )
    assert report.statistics["row_level"] == row_level
    (pair,) = report.pairs
    assert pair.counts == {"missing_on_left": 0, "missing_on_right": 0, "different": 1, "in_flight": 1}, pair.counts
    assert list(samples_by_key(pair, "in_flight")) == [34]


@pytest.mark.timeout(120)
def test_writes_to_a_data_directory_during_the_compare_are_in_flight(spark_session: Any, equal_replicas: tuple) -> None:
    """A data directory whose node keeps writing is read one snapshot per call (spark.replica): keys
    written between the plan and the row level are in flight there too, not only on tcp:// nodes."""
    primary, copy = equal_replicas
    tamper(copy, [("UPDATE tags SET weight = -1 WHERE tag = 'tag-0010'", ())])

    def write_during_the_levels(message: str) -> None:
        if message.startswith("level 1"):
            store = Store(str(primary / "mnesite.db"), synchronous="OFF")
            commit(store, [WriteOp("tags", {"tag": "tag-0011", "weight": 1111})])
            store.close()

    options = CompareOptions(tables=("tags",), ranges_initial=1, leaf_rows_max=1000)
    report = compare([str(primary), str(copy)], options, session=spark_session, progress=write_during_the_levels)
    (pair,) = report.pairs
    assert pair.counts == {"missing_on_left": 0, "missing_on_right": 0, "different": 1, "in_flight": 1}, pair.counts
    assert list(samples_by_key(pair, "in_flight")) == ["tag-0011"]
    assert report.exit_status == EXIT_DIVERGED


@pytest.mark.timeout(120)
def test_a_table_in_another_shard_is_declared_differently(spark_session: Any, tmp_path: Path) -> None:
    """The same rows in a table of another shard are not a replica of it: the shard is part of its
    declaration (its rows follow another log), and was left out of the comparison of definitions."""
    for name, shard in (("a", "default"), ("b", "other")):
        store = create_store(tmp_path / name)
        create_table(store, "kv", "k", [("k", "INTEGER"), ("v", "TEXT")], shard=shard)
        commit(store, [WriteOp("kv", {"k": 1, "v": "one"})], shard=shard)
        store.close()
    report = compare([str(tmp_path / "a"), str(tmp_path / "b")], CompareOptions(), session=spark_session)
    assert list(report.tables_mismatched) == ["kv"]
    assert report.tables_mismatched["kv"][str(tmp_path / "b")]["shard"] == "other"
    assert report.exit_status == EXIT_DIVERGED


@pytest.mark.timeout(120)
def test_a_behind_replica_whose_last_entry_differs_from_the_ahead_ones_has_a_diverged_history(
    spark_session: Any, tmp_path: Path
) -> None:
    """The span between two applied keys was taken as lag when the ahead replica's log went through the
    behind one's key: the digests at that key were never compared. A behind replica that applied another
    entry at that key (another history) had its differences in keys the span touched again reported as
    in flight, and the replicas as equal."""
    build_primary(tmp_path / "ahead").close()
    behind = copy_replica(tmp_path / "ahead", tmp_path / "behind")
    store = Store(str(behind / "mnesite.db"), synchronous="OFF")
    other_history = commit(store, [WriteOp("users", {**user(7), "name": "written by another history"})])
    store.close()
    store = Store(str(tmp_path / "ahead" / "mnesite.db"), synchronous="OFF")
    assert commit(store, [WriteOp("users", {**user(7), "name": "renamed"})]) == other_history
    commit(store, [WriteOp("users", {**user(7), "name": "renamed again"})])
    store.close()
    report = compare([str(tmp_path / "ahead"), str(behind)], DRILL, session=spark_session)
    assert report.exit_status == EXIT_DIVERGED, report.to_json()
    (diverged,) = report.histories_diverged
    assert diverged["shard"] == "default" and diverged["applied"] == list(other_history)
    assert diverged["right_digest"] == report.applied[str(behind)]["default"].digest
    assert diverged["left_digest"] not in ("", diverged["right_digest"])
    (span,) = report.in_flight_spans
    assert not span.complete and "different digest" in span.reason


def node_over_its_budgets(data: Path, rows: int) -> Any:
    """A live node hashing at most 20 rows and walking at most 200 keys per answer (scan_rows_max 2),
    holding ``rows`` rows of ``kv``."""
    from tests.conftest import ThreadNode

    node = ThreadNode(data, extra={"limits": {"scan_rows_max": 2}})
    fill_kv(node, rows)
    return node


def fill_kv(node: Any, rows: int) -> None:
    """Table ``kv`` on ``node`` with keys 0 to ``rows - 1``, in one transaction, committed."""
    with node.client() as client:
        client.create_table("kv", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
        with client.transaction() as tx:
            for key in range(rows):
                tx.put("kv", {"k": key, "v": f"value {key}"})
        # Files are read directly: an acknowledgement may leave before its turn's commit, a read after it.
        assert client.get("kv", rows - 1) == {"k": rows - 1, "v": f"value {rows - 1}"}


@pytest.mark.timeout(120)
def test_row_digests_a_node_only_gave_a_lower_count_for_are_joined_by_spark(spark_session: Any, tmp_path: Path) -> None:
    """A leaf's row count from a node over its row budget is a lower bound (21 for 600 rows here): the
    driver took it for the leaf's size and merged every row digest itself, past driver_row_digests_max
    (its memory bound); such a leaf's rows go to Spark."""
    node = node_over_its_budgets(tmp_path / "data", 600)
    try:
        options = CompareOptions(ranges_initial=1, depth_max=1, driver_row_digests_max=1000)
        report = compare([node.endpoint, str(tmp_path / "data")], options, session=spark_session)
        assert report.exit_status == EXIT_EQUAL, report.to_json()
        assert report.statistics["rows_shipped"] == 1200
        assert report.statistics["row_level"] == "spark"
    finally:
        node.stop()


@pytest.mark.timeout(120)
def test_first_level_ranges_cover_a_node_past_its_key_boundaries_bound(spark_session: Any, tmp_path: Path) -> None:
    """A node walks at most scan_rows_max * 100 keys per key_boundaries answer (200 here): the first
    level's boundaries covered those first keys only, and the rest of the table was one range, over the
    node's row budget, counted as a lower bound (the report's rows were wrong) and, equal or not,
    drilled into and compared row by row. The driver asks again after the last key."""
    node = node_over_its_budgets(tmp_path / "data", 600)
    try:
        options = CompareOptions(range_rows=16, leaf_rows_max=16)
        report = compare([node.endpoint, node.endpoint], options, session=spark_session)
        assert report.exit_status == EXIT_EQUAL, report.to_json()
        assert report.rows["kv"] == {node.endpoint: 600, f"{node.endpoint}#2": 600}
        assert report.statistics["levels"] == 1 and report.statistics["rows_shipped"] == 0
    finally:
        node.stop()


@pytest.mark.timeout(120)
def test_more_first_level_ranges_than_a_node_cuts_per_answer_is_not_a_compare_error(
    spark_session: Any, thread_node: Any, tmp_path: Path
) -> None:
    """A node cuts a range into at most 65,536 parts per key_boundaries answer (a node configured with
    a big scan_rows_max has tables whose first level wants more): asking for more was answered
    bad_request, and the compare could not run."""
    fill_kv(thread_node, 50)
    options = CompareOptions(ranges_initial=70_000)
    report = compare([thread_node.endpoint, str(tmp_path / "data")], options, session=spark_session)
    assert report.exit_status == EXIT_EQUAL, report.to_json()
    assert report.statistics["range_digests"] == 2 * 50  # one range per row


def compare_after_trimming(primary: Path, copy: Path, spark_session: Any) -> Any:
    """Compare after the primary's log is trimmed to its last entry: the span is no longer held."""
    trimmed = Store(str(primary / "mnesite.db"), synchronous="OFF")
    with trimmed.write_transaction():
        trimmed.trim("default", entries_max=1, before_ms=None)
    trimmed.close()
    return compare([str(primary), str(copy)], DRILL, session=spark_session)


@pytest.mark.timeout(120)
def test_a_column_added_between_the_applied_keys_is_in_flight(spark_session: Any, equal_replicas: tuple) -> None:
    """A column the more advanced replica's rlog adds between the two applied keys is the other
    replica's lag: the table was reported declared differently, and the replicas diverged (exit 1),
    for a replicant one add_column behind its core."""
    primary, copy = equal_replicas
    store = Store(str(primary / "mnesite.db"), synchronous="OFF")
    commit(store, [AddColumnOp("tags", "default", "colour", "TEXT")])
    commit(store, [WriteOp("tags", {"tag": "tag-0001", "weight": 1, "colour": "red"})])
    store.close()
    for replicas in ([primary, copy], [copy, primary]):
        report = compare([str(replica) for replica in replicas], DRILL, session=spark_session)
        assert report.columns_in_flight == {"tags": {str(copy): ["colour"]}}, report.to_json()
        assert report.tables_mismatched == {} and "tags" not in report.tables
        assert report.exit_status == EXIT_EQUAL and report.tables == ["users"]
        assert f"table tags: column(s) colour missing on {copy}, added in flight" in render_report(report)
    # The same difference with no entry that explains it (the log trimmed past the add) still diverges.
    report = compare_after_trimming(primary, copy, spark_session)
    assert list(report.tables_mismatched) == ["tags"] and report.columns_in_flight == {}
    assert report.exit_status == EXIT_DIVERGED


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["created", "dropped"])
def test_a_table_created_or_dropped_between_the_applied_keys_is_in_flight(
    spark_session: Any, equal_replicas: tuple, change: str
) -> None:
    """A table the more advanced replica's rlog creates (or drops) between the two applied keys is the
    other replica's lag, like the keys those entries touch: it was reported missing on the other
    replica, and the replicas diverged (exit 1), for a replicant one create_table behind its core."""
    primary, copy = equal_replicas
    store = Store(str(primary / "mnesite.db"), synchronous="OFF")
    if change == "created":
        create_table(store, "fresh", "k", [("k", "INTEGER")])
        commit(store, [WriteOp("fresh", {"k": 1})])
    else:
        commit(store, [DropTableOp("tags", "default")])
    commit(store, [WriteOp("users", {**user(7), "name": "renamed"})])
    store.close()
    table, lacking = ("fresh", copy) if change == "created" else ("tags", primary)
    for replicas in ([primary, copy], [copy, primary]):
        report = compare([str(replica) for replica in replicas], DRILL, session=spark_session)
        assert report.tables_in_flight == {table: [str(lacking)]} and report.tables_missing == {}, report.to_json()
        assert table not in report.tables and report.exit_status == EXIT_EQUAL
        assert f"table {table}: missing on {lacking}, created or dropped in flight" in render_report(report)
    # The same table missing with no entry that explains it still diverges.
    report = compare_after_trimming(primary, copy, spark_session)
    assert report.tables_missing == {table: [str(lacking)]} and report.exit_status == EXIT_DIVERGED


@pytest.mark.timeout(180)
def test_a_table_dropped_and_created_again_between_the_applied_keys_is_in_flight(
    spark_session: Any, equal_replicas: tuple
) -> None:
    """A table the more advanced replica's rlog drops and creates again between the two applied keys
    holds none of the behind replica's rows: they were reported missing on the replica ahead (exit 1).
    Every key of it is in flight, whichever joins the row digests; a table created again with another
    declaration is reported as such, not as declared differently."""
    primary, copy = equal_replicas
    store = Store(str(primary / "mnesite.db"), synchronous="OFF")
    commit(store, [DropTableOp("tags", "default")])
    create_table(store, "tags", "tag", [("tag", "TEXT"), ("weight", "INTEGER")])
    write_rows(store, "tags", [{"tag": f"tag-{key:04d}", "weight": 1000 + key} for key in range(5)])
    commit(store, [WriteOp("users", {**user(7), "name": "renamed"})])
    store.close()
    for options in (DRILL, replace(DRILL, driver_row_digests_max=0)):
        report = compare([str(primary), str(copy)], options, session=spark_session)
        assert report.statistics["row_level"] == ("driver" if options is DRILL else "spark")
        tags = next(p for p in report.pairs if p.table == "tags")
        assert tags.counts == {"missing_on_left": 0, "missing_on_right": 0, "different": 0, "in_flight": 300}
        assert report.exit_status == EXIT_EQUAL, report.to_json()
    # Created again with another declaration: not compared, and said so.
    store = Store(str(primary / "mnesite.db"), synchronous="OFF")
    commit(store, [DropTableOp("tags", "default")])
    create_table(store, "tags", "tag", [("tag", "TEXT"), ("colour", "TEXT")])
    store.close()
    report = compare([str(copy), str(primary)], DRILL, session=spark_session)
    assert report.tables_recreated_in_flight == {"tags": [str(copy)]} and report.tables_mismatched == {}
    assert report.tables == ["users"] and report.exit_status == EXIT_EQUAL
    assert "table tags: dropped and created again in flight" in render_report(report)
