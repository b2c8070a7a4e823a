"""Content-level fuzzing of 3 cores + 1 replicant (real processes): see ``tests.fuzz.runner``.

CI runs a bounded batch (``MNESITE_FUZZ_MESSAGES``, default 2,000 messages, well inside 2 minutes);
``make fuzz`` runs 100,000 and prints the figures the README quotes.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.conftest import Cluster, wait_until
from tests.fuzz.runner import Fuzzer, FuzzFailure
from tests.fuzz.strategies import Known, hostile_message, legitimate_write

MESSAGES = int(os.environ.get("MNESITE_FUZZ_MESSAGES", "2000"))
BATCH_MESSAGES = int(os.environ.get("MNESITE_FUZZ_BATCH", "500"))
MESSAGES_PER_EXAMPLE = 20
SEED = int(os.environ.get("MNESITE_FUZZ_SEED", "10"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(300, MESSAGES // 10))]


@pytest.fixture
def fuzzed_cluster(tmp_path, node_processes) -> Cluster:
    # Without [security], so that hostile contents reach every decoder and state machine (with it,
    # most of them would be refused earlier, by role): contents, not identities, are under test here.
    cluster = Cluster(tmp_path, node_processes, secure=False)
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
    failures: list[str] = []
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
        if failures:
            return  # the first failure ends the run; hypothesis' own report would print huge values
        try:
            for index, (kind, body) in enumerate(batch):
                if index == 0 and isinstance(body, dict):
                    fuzzer.send_deep(kind, body)  # one 1,010-level frame per example, in a rotating field
                fuzzer.send(kind, body)
            sent_examples[0] += 1
            if sent_examples[0] % batch_examples == 0:
                fuzzer.check()
        except FuzzFailure as failure:
            kinds = ", ".join(kind for kind, _ in batch)
            failures.append(f"{failure} (after example {sent_examples[0]}; its kinds: {kinds}; seed {SEED})")

    started = time.monotonic()
    try:
        seed(SEED)(one_example)()  # replay a run: MNESITE_FUZZ_SEED
        if not failures:
            fuzzer.check()
    finally:
        fuzzer.report.seconds = time.monotonic() - started
        print(f"\nfuzz: {fuzzer.report.summary()}")
        fuzzer.close()
    assert not failures, failures[0][:5000]
    assert fuzzer.report.messages_sent >= MESSAGES * 0.9
    assert fuzzer.report.rss_ratio_max <= 2.0, fuzzer.report.summary()


def test_the_issue_reproductions_against_real_processes_change_nothing(fuzzed_cluster: Cluster) -> None:
    """The crashes that killed every core: a huge generation, a poison table and hostile writes
    travelling through the replicant's forwarding; every node stays up and keeps serving writes."""
    import msgpack
    import zmq
    from mnesite.core.consensus import VoteRequest
    from mnesite.core.consensus_wire import message_to_wire
    from mnesite.rlog import messages
    from mnesite.rlog.client import RemoteError
    from mnesite.rlog.types import TxKey

    from tests.fuzz.runner import deep_frame

    cluster = fuzzed_cluster
    names = ["core1", "core2", "core3", "replicant1"]
    before = {name: cluster.status(name)["shards"]["default"]["generation"] for name in names[:3]}
    vote = message_to_wire(VoteRequest(2**63 - 1, TxKey(2**63 - 1, 1)))
    frames = {
        "core1": [
            messages.encode(messages.Message("peer", "v", {"shard": "default", "sender": "core2", "message": vote})),
        ],
        "replicant1": [
            deep_frame("transact", {"ops": []}, "ops", "deep-through-replicant"),
            msgpack.packb(
                [1, "transact", "big", {"ops": [{"op": "write", "table": "known", "row": {"id": 2**64 - 1}}]}]
            ),  # noqa: E501
        ],
    }
    context = zmq.Context.instance()
    for name, batch in frames.items():
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 5000)  # deliver the unanswered peer message before closing
        socket.connect(cluster.endpoints[name])
        try:
            for frame in batch:
                socket.send(frame)
                if name == "replicant1":
                    assert socket.poll(10_000), "the replicant answers hostile writes itself"
                    answer = messages.decode(socket.recv())
                    assert answer.kind == "error" and answer.body.code in ("bad_frame", "bad_request"), answer
        finally:
            socket.close()  # with the linger set above
    with cluster.client("replicant1", timeout_ms=10_000) as client, pytest.raises(RemoteError) as info:
        client.create_table("KNOWN", "id", [("id", "TEXT")])  # forwarded to a core, refused before logging
    assert info.value.code == "table_exists"
    for name in names[:3]:
        status = cluster.status(name)
        assert status is not None, f"{name} died"
        assert status["shards"]["default"]["generation"] < before[name] + 1000
    wait_until(lambda: cluster.status("core1")["protocol_violations"] >= 1, 30, "the violation to be counted")
    with cluster.client("replicant1", timeout_ms=10_000) as client:
        tx_key = client.put("known", {"id": 5000, "name": "still serving"})
    cluster.wait_converged(cluster.names)
    assert tuple(cluster.status("core2")["shards"]["default"]["applied"]) >= tuple(tx_key)


def test_the_state_checker_catches_a_change_no_fuzzed_write_was_acknowledged_for(fuzzed_cluster: Cluster) -> None:
    """The checker can fail: a write it did not send (so never saw acknowledged) is an unintended change."""
    names = ["core1", "core2", "core3", "replicant1"]
    fuzzer = Fuzzer(fuzzed_cluster, names, names[:3])
    try:
        fuzzer.baseline()
        fuzzer.check()  # nothing happened yet: passes
        with fuzzed_cluster.client("core2") as client:
            client.put("known", {"id": 777, "name": "behind the fuzzer's back"})
        with pytest.raises(FuzzFailure, match="unintended state change"):
            fuzzer.check()
    finally:
        fuzzer.close()
