"""Content-level fuzzing of 3 cores + 1 replicant (real processes): see ``tests.fuzz.runner``.

CI runs a bounded batch (``MNESITE_FUZZ_MESSAGES``, default 2,000 messages, well inside 2 minutes);
``make fuzz`` runs 100,000 and prints the figures the README quotes.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import Cluster, wait_until
from tests.fuzz.runner import Fuzzer
from tests.fuzz.strategies import Known, hostile_message, legitimate_write

MESSAGES = int(os.environ.get("MNESITE_FUZZ_MESSAGES", "2000"))
BATCH_MESSAGES = int(os.environ.get("MNESITE_FUZZ_BATCH", "500"))
MESSAGES_PER_EXAMPLE = 20
SEED = int(os.environ.get("MNESITE_FUZZ_SEED", "10"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(300, MESSAGES // 10))]


@pytest.fixture
def fuzzed_cluster(cluster: Cluster) -> Cluster:
    cluster.start_all()
    with cluster.client("core1", timeout_ms=10_000) as client:  # the client retries during the election
        client.create_table("known", "id", [("id", "INTEGER"), ("name", "TEXT"), ("karma", "REAL")])
        for key in range(20):
            client.put("known", {"id": key, "name": f"row{key}", "karma": key / 2})
    cluster.add_replicant("replicant1")
    cluster.start("replicant1")

    def replicant_ready() -> bool:
        status = cluster.status("replicant1")
        shard = (status or {}).get("shards", {}).get("default")
        return bool(shard) and shard.get("mode") == "normal"

    wait_until(replicant_ready, 60, "the replicant to reach normal mode", interval_s=0.2)
    return cluster


def test_hostile_messages_of_every_kind_leave_every_node_alive_and_unchanged(fuzzed_cluster: Cluster) -> None:
    names = ["core1", "core2", "core3", "replicant1"]
    fuzzer = Fuzzer(fuzzed_cluster, names, names[:3])
    fuzzer.baseline()
    known = Known()
    examples = max(1, MESSAGES // MESSAGES_PER_EXAMPLE)
    batch_examples = max(1, BATCH_MESSAGES // MESSAGES_PER_EXAMPLE)
    sent_examples = [0]
    message = st.one_of(hostile_message(known), hostile_message(known), hostile_message(known), legitimate_write(known))

    @settings(
        max_examples=examples,
        phases=[Phase.generate],  # no shrinking: a failure prints its batch and the seed replays it
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @given(st.lists(message, min_size=MESSAGES_PER_EXAMPLE, max_size=MESSAGES_PER_EXAMPLE))
    def one_example(batch) -> None:
        for index, (kind, body) in enumerate(batch):
            if index == 0 and isinstance(body, dict):
                fuzzer.send_deep(kind, body)  # one 1,010-level frame per example, in a rotating field
            fuzzer.send(kind, body)
        sent_examples[0] += 1
        if sent_examples[0] % batch_examples == 0:
            fuzzer.check()

    started = time.monotonic()
    try:
        seeded = pytest.importorskip("hypothesis").seed(SEED)(one_example)
        seeded()
        fuzzer.check()
    finally:
        fuzzer.report.seconds = time.monotonic() - started
        print(f"\nfuzz: {fuzzer.report.summary()}")
        fuzzer.close()
    assert fuzzer.report.messages_sent >= MESSAGES * 0.9
    assert fuzzer.report.rss_ratio_max <= 2.0, fuzzer.report.summary()
