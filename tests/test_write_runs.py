"""A bulk write packs its rows as one run only once every member reads runs (cluster version 2).

Real processes: three cores of this release, one of them made to speak only cluster version 1 (the
test switch ``MNESITE_TEST_CLUSTER_VERSION_ONLY``, as a release 0.1.0 member would), then restarted
without it. The log itself is read beside the running nodes: while the cluster is at version 1 a bulk
write is one ``w`` op a row on every core (release 0.1.0 decodes nothing else); once at 2, one ``r``
op, which followers and a replicant apply to the same rows (digests converge).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mnesite.rlog.types import TxKey
from mnesite.rlog.versions import SPEAK_ONLY_ENV, packs_runs

from tests.conftest import Cluster, NodeProcess, logged_op_tags, wait_until

pytestmark = pytest.mark.timeout(180)
TABLE, ROWS, SHARD = "bulk", 50, "default"


def _cluster_versions(cluster: Cluster) -> set:
    return {
        ((cluster.status(name) or {}).get("shards", {}).get(SHARD) or {}).get("cluster_version")
        for name in cluster.names
    }


def _bulk_write(cluster: Cluster, first: int) -> TxKey:
    ops = [{"op": "write", "table": TABLE, "row": {"id": first + i, "note": f"row {first + i}"}} for i in range(ROWS)]
    with cluster.client(cluster.names[0], timeout_ms=5000, retries=5) as client:
        return TxKey(*client.transact(ops))


def test_the_packing_rule_follows_the_cluster_version() -> None:
    assert not packs_runs(1) and packs_runs(2)


@pytest.mark.slow
def test_a_bulk_write_is_packed_a_row_at_a_time_at_version_1_and_as_one_run_at_2(
    tmp_path: Path, node_processes: list[NodeProcess]
) -> None:
    cluster = Cluster(tmp_path, node_processes)
    cluster.add_replicant("replicant1")
    cluster.start("core1")
    cluster.start("core2")
    cluster.nodes["core3"].start(cluster.endpoints["core3"], env={SPEAK_ONLY_ENV: "1"})
    with cluster.client("core1", timeout_ms=5000, retries=5) as client:
        client.create_table(TABLE, "id", [("id", "INTEGER"), ("note", "TEXT")])
    cluster.start("replicant1")

    at_1 = _bulk_write(cluster, 0)
    cluster.wait_converged(cluster.names)
    assert _cluster_versions(cluster) == {1}  # core3 speaks only 1
    for name in cluster.names:
        assert logged_op_tags(cluster.data_dir(name), SHARD, at_1) == ["w"] * ROWS, name

    cluster.nodes["core3"].stop()
    cluster.start("core3")  # now speaks 1 and 2: the shard moves to 2
    wait_until(lambda: _cluster_versions(cluster) == {2}, 60, "the cluster version to move to 2", interval_s=0.2)
    at_2 = _bulk_write(cluster, ROWS)
    for name in [*cluster.names, "replicant1"]:
        data_dir = cluster.data_dir(name)
        wait_until(lambda d=data_dir: logged_op_tags(d, SHARD, at_2) is not None, 30, f"{name} to log {at_2}")
        assert logged_op_tags(data_dir, SHARD, at_2) == ["r"], name
    position = cluster.wait_replicants_converged(cluster.names, ["replicant1"])
    assert tuple(position["applied"]) >= tuple(at_2)
    for name in [*cluster.names, "replicant1"]:
        with cluster.client(name, timeout_ms=5000, retries=5) as client:
            rows = list(client.scan(TABLE))
        assert [(row["id"], row["note"]) for row in rows] == [(i, f"row {i}") for i in range(2 * ROWS)], name
