"""Spark compare of a live replicant against a live core while writes go on (real processes).

Keys written between the two replicas' applied keys are reported as in flight; a row changed behind
the replicant's back is reported as a difference, with both values."""

from __future__ import annotations

from typing import Any

import apsw
import pytest
from mnesite.spark.compare import EXIT_DIVERGED, EXIT_EQUAL, CompareOptions, compare

from tests.conftest import Cluster
from tests.test_cluster import Load, create_table
from tests.test_replicants import wait_normal, wait_replicant_caught_up

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.spark]


def test_live_replicant_against_live_core_under_writes(cluster: Cluster, spark_session: Any) -> None:
    cluster.start_all()
    create_table(cluster)
    cluster.add_replicant("replicant1")
    cluster.start("replicant1")
    wait_normal(cluster, "replicant1")
    load = Load(cluster, cluster.names, writers=4).start()
    load.wait_for(300)
    replicas = [cluster.endpoints["core1"], cluster.endpoints["replicant1"]]
    options = CompareOptions(tables=("kv",), **cluster.keys())  # the nodes run with [security]
    in_flight_total = 0
    for _ in range(3):
        report = compare(replicas, options, session=spark_session)
        assert report.exit_status == EXIT_EQUAL, report.to_json()
        pair = report.pairs[0]
        assert pair.counts["different"] == 0 and pair.counts["missing_on_left"] == 0
        assert pair.counts["missing_on_right"] == 0
        in_flight_total += pair.counts["in_flight"]
        load.wait_for(100)
    acknowledged = load.stop()
    # Writes went on during three compares: rows that moved between the two reads were seen, and
    # they were classified as in flight (the exit status above says none was taken for divergence).
    assert in_flight_total > 0

    # A change made directly in the replicant's database file is divergence, not in flight.
    wait_replicant_caught_up(cluster, ["replicant1"])
    victim = sorted(acknowledged)[len(acknowledged) // 2]
    connection = apsw.Connection(str(cluster.data_dir("replicant1") / "mnesite.db"))
    connection.set_busy_timeout(5000)
    connection.execute("UPDATE kv SET value = 'tampered' WHERE id = ?", (victim,))
    connection.close()
    report = compare(replicas, options, session=spark_session)
    assert report.exit_status == EXIT_DIVERGED
    pair = report.pairs[0]
    assert pair.counts["different"] == 1 and pair.counts["in_flight"] == 0
    sample = pair.samples["different"][0]
    assert "tampered" in str(sample) and str(victim) in str(sample)
