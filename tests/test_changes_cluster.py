"""Real processes: the changefeed (rlog.changes) across a failover and from a trimmed position.

* The core a consumer follows is killed mid-stream (writes keep flowing); the consumer resumes from
  its last position on a replicant. What it received, per shard, is exactly the rlog's changes of its
  tables in order: no gap, no duplicate.
* A consumer starting at a position the log trimmed gets a copy at one tx key, then the changes, while
  writes go on; it ends equal to the table.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path

import pytest
from mnesite.rlog.client import Client, MnesiteError, Unavailable
from mnesite.rlog.types import TxKey

from tests.conftest import Cluster, wait_until
from tests.test_changes import apply_feed

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TABLES = ["users", "posts"]


class Writer:
    """Writes to both shards through every core until stopped (outcome-unknown writes are fine: the
    check is against the rlog, not against what the writer believes)."""

    def __init__(self, cluster: Cluster) -> None:
        self.client = Client(
            [cluster.endpoints[n] for n in cluster.names], timeout_ms=2000, retries=3, **cluster.keys()
        )
        self.stop = threading.Event()
        self.written = 0
        self.refused: collections.Counter[str] = collections.Counter()  # error codes, for a failure's message
        self.error: BaseException | None = None  # what ended the thread, if not the test
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                i += 1
                try:
                    if i % 7 == 0:
                        self.client.delete("users", i - 3)
                    else:
                        self.client.put("users", {"id": i, "name": f"u{i}"})
                    self.client.put("posts", {"id": i, "title": "t" * (i % 50)})
                    self.written += 1
                except MnesiteError as error:
                    self.refused[error.code] += 1  # an election: the next write goes to whoever leads
        except BaseException as error:  # reported by the test instead of its wait timing out
            self.error = error

    def wrote_more_than(self, count: int) -> bool:
        if self.error is not None:
            raise AssertionError(f"the writer stopped: {self.error!r}") from self.error
        return self.written > count

    def describe(self) -> str:
        return f"{self.written} writes, refused {dict(self.refused)}, endpoint {self.client.endpoint}"

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.client.close()


class FailoverConsumer:
    """A consumer given two cores: ``Client.changes`` moves to the second when the first stops
    answering, from the last position it received. Reads pages until ``target`` (per shard) is reached."""

    def __init__(self, cluster: Cluster, endpoints: list[str]) -> None:
        self.client = Client(endpoints, timeout_ms=1500, retries=2, **cluster.keys())
        self.records: list[dict] = []
        self.errors: list[BaseException] = []
        self.target: dict[str, TxKey] | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        try:
            feed = self.client.changes(TABLES, follow=True, wait_ms=200, page_records=50)
            for page in feed.pages():
                self.records.extend(page)
                target = self.target
                if target is not None and all(feed.position.get(s, TxKey(0, 0)) >= k for s, k in target.items()):
                    return
        except BaseException as error:  # reported by the test
            self.errors.append(error)
        finally:
            self.client.close()


def setup_tables(cluster: Cluster) -> None:
    with cluster.client("core1", timeout_ms=5000, retries=5) as client:
        client.create_table("users", "id", [("id", "INTEGER"), ("name", "TEXT")])
        client.create_table("posts", "id", [("id", "INTEGER"), ("title", "TEXT")], "content")


def expected_changes(client: Client, shard: str) -> list[tuple]:
    """(tx key, table, op, key) of every change of TABLES in the shard's rlog, in order."""
    changes: list[tuple] = []
    after = [0, 0]
    while True:
        entries = client.rlog_entries(shard, after, 1000)
        if not entries:
            return changes
        for entry in entries:
            if entry["prev"] != after and after != [0, 0]:
                raise AssertionError(f"the rlog of {shard} has a gap before {entry['tx_key']}")
            for op in entry["ops"]:
                if op.get("table") not in TABLES:
                    continue
                if op["op"] == "write":
                    changes.append((tuple(entry["tx_key"]), op["table"], "write", op["row"]["id"]))
                elif op["op"] == "delete":
                    changes.append((tuple(entry["tx_key"]), op["table"], "delete", op["key"]))
                else:
                    changes.append((tuple(entry["tx_key"]), op["table"], op["op"]))
            after = entry["tx_key"]


def received(records: list[dict], shard: str) -> list[tuple]:
    out = []
    for record in records:
        if record["kind"] != "change" or record["shard"] != shard:
            continue
        if record["op"] in ("write", "delete"):
            out.append((tuple(record["tx_key"]), record["table"], record["op"], record["key"]))
        else:
            out.append((tuple(record["tx_key"]), record["table"], record["op"]))
    return out


def applied_of(cluster: Cluster, name: str) -> dict[str, TxKey]:
    status = cluster.status(name) or {"shards": {}}
    return {shard: TxKey(*info["applied"]) for shard, info in status["shards"].items()}


def test_the_upstream_core_killed_mid_stream_the_consumer_resumes_on_a_replicant_no_gap_no_duplicate(
    cluster: Cluster,
) -> None:
    cluster.start_all()
    setup_tables(cluster)
    cluster.add_replicant("replicant1")
    cluster.start("replicant1")
    records: list[dict] = []
    failover = FailoverConsumer(cluster, [cluster.endpoints["core1"], cluster.endpoints["core3"]])
    with Writer(cluster) as writer:
        wait_until(lambda: writer.written > 50, 60, "writes flowing")
        failover.thread.start()
        with cluster.client("core1", timeout_ms=1500, retries=0) as consumer:
            feed = consumer.changes(TABLES, follow=True, wait_ms=300, page_records=50)
            with pytest.raises(Unavailable):
                for record in feed:
                    records.append(record)
                    if len(records) == 400:
                        cluster.nodes["core1"].kill()  # mid-stream, writes keep flowing
            cursor = feed.cursor
        killed_at, written_at_kill = len(records), writer.written
        assert killed_at >= 400
        try:
            wait_until(lambda: writer.wrote_more_than(written_at_kill + 100), 90, "writes after the kill")
        except AssertionError as error:
            raise AssertionError(f"{error}; the writer: {writer.describe()}") from error
    # Writes stopped: the consumer resumes from its last position on the replicant, until caught up
    # with what the surviving cores committed.
    survivors = ["core2", "core3"]
    final = {shard: cluster.wait_converged(survivors, shard=shard)["applied"] for shard in ("default", "content")}
    wait_until(
        lambda: all(applied_of(cluster, "replicant1").get(s) == TxKey(*k) for s, k in final.items()), 60, "replicant"
    )
    with cluster.client("replicant1", timeout_ms=3000, retries=2) as consumer:
        records.extend(consumer.changes(TABLES, after_tx_key=cursor))
    failover.target = {shard: TxKey(*key) for shard, key in final.items()}
    failover.thread.join(timeout=60)
    assert not failover.thread.is_alive() and not failover.errors, failover.errors
    assert len(records) > killed_at
    assert not any(record["kind"].startswith("snapshot") for record in records)
    with cluster.client("core2", timeout_ms=5000, retries=2) as client:
        for shard in ("default", "content"):
            expected = expected_changes(client, shard)
            for consumer, got in (
                ("resumed", received(records, shard)),
                ("failover", received(failover.records, shard)),
            ):
                assert len(got) == len(set(got)), f"{consumer}: duplicates in {shard}"
                assert got == expected, f"{consumer}, {shard}: got {len(got)} changes, the rlog holds {len(expected)}"
        state = apply_feed(records)
        for table in TABLES:
            assert state[table] == {row["id"]: row for row in client.scan(table)}


def test_a_consumer_at_a_trimmed_position_gets_a_copy_then_the_changes_and_ends_equal(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.extend_core_configs("[rlog]\nretention_entries_max = 30\nretention_interval_ms = 100\n")
    cluster.start_all()
    setup_tables(cluster)
    with cluster.client("core1", timeout_ms=5000, retries=5) as client:
        first = client.put("users", {"id": 0, "name": "first"})
        for i in range(1, 300):
            client.put("users", {"id": i, "name": f"u{i}"})
            if i % 5 == 0:
                client.delete("users", i - 2)
    cluster.add_replicant("replicant1")
    config = tmp_path / "replicant1.toml"
    config.write_text(config.read_text() + "[limits]\nchanges_page_records_max = 25\n")
    cluster.start("replicant1")
    wait_until(lambda: "default" in applied_of(cluster, "replicant1"), 60, "replicant1 to serve")
    records: list[dict] = []
    with Writer(cluster), cluster.client("replicant1", timeout_ms=3000, retries=3) as consumer:
        wait_until(lambda: _serves(consumer), 60, "replicant1 to serve changes")
        for record in consumer.changes(["users"], after_tx_key=first):
            records.append(record)
    final = cluster.wait_converged(cluster.names)["applied"]
    wait_until(lambda: applied_of(cluster, "replicant1").get("default") == TxKey(*final), 60, "replicant1")
    with cluster.client("replicant1", timeout_ms=3000, retries=3) as consumer:
        feed = consumer.changes(["users"], after_tx_key=_resume_from(records, first))
        records.extend(feed)
        kinds = [record["kind"] for record in records]
        assert kinds[0] == "snapshot_begin" and "fell behind" in records[0]["reason"]
        assert kinds.count("snapshot_end") == 1 and kinds.index("snapshot_end") > 1
        assert feed.position == {"default": TxKey(*final)}
        state = apply_feed(records)["users"]
        assert state == {row["id"]: row for row in consumer.scan("users")}
    with cluster.client("core2", timeout_ms=3000) as client:
        assert state == {row["id"]: row for row in client.scan("users")}


def _serves(client: Client) -> bool:
    try:
        client.call("changes", {"tables": ["users"], "page_records": 1})
        return True
    except MnesiteError:
        return False


def _resume_from(records: list[dict], first: TxKey) -> TxKey:
    """The consumer's own position: the last change's key, or the snapshot's end."""
    keys = [r["tx_key"] for r in records if r["kind"] in ("change", "snapshot_end")]
    return keys[-1] if keys else first
