"""``core.watch``: whether and how a core serves a replicant's watch (pure rules)."""

from __future__ import annotations

import pytest
from mnesite.core.watch import (
    WatchRefusedError,
    agent_to_evict,
    check_not_a_core_endpoint,
    check_watch_request,
    decide_watch,
    superseded_agents,
)
from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION, UNKNOWN_DIGEST
from mnesite.rlog.types import TxKey, endpoint_identity

DIGESTS = {TxKey(1, 5): b"d5", TxKey(1, 9): b"d9"}
TRIMMED = TxKey(1, 2)
COMMITTED = TxKey(1, 9)


def decide(from_key, from_digest, trimmed=TRIMMED, committed=COMMITTED):
    return decide_watch(from_key, from_digest, trimmed, committed, b"d9", DIGESTS.get, "core1")


def test_resume_needs_a_retained_committed_key_with_the_same_digest():
    assert decide(TxKey(1, 5), b"d5") == ("resume", TxKey(1, 5), b"d5")
    assert decide(TxKey(1, 5), b"other") == ("bootstrap", TxKey(1, 9), b"d9")  # another history
    assert decide(TxKey(1, 5), UNKNOWN_DIGEST) == ("bootstrap", TxKey(1, 9), b"d9")  # unknown position
    assert decide(TxKey(1, 5), b"d5", trimmed=TxKey(1, 6)) == ("bootstrap", TxKey(1, 9), b"d9")  # trimmed


def test_a_core_behind_the_replica_refuses_rather_than_move_it_backwards():
    with pytest.raises(WatchRefusedError) as refused:
        decide(TxKey(1, 10), b"x")
    assert refused.value.code == "behind"


def test_another_protocol_version_or_a_bad_watch_id_is_refused():
    check_watch_request(REPLICATION_PROTOCOL_VERSION, "w1", "core1")
    for protocol, watch_id, code in [
        (REPLICATION_PROTOCOL_VERSION + 1, "w1", "incompatible_protocol"),
        (REPLICATION_PROTOCOL_VERSION, 7, "bad_request"),
        (REPLICATION_PROTOCOL_VERSION, "w" * 65, "bad_request"),
    ]:
        with pytest.raises(WatchRefusedError) as refused:
            check_watch_request(protocol, watch_id, "core1")
        assert refused.value.code == code


def test_a_new_watch_supersedes_the_same_replicants_agents_of_that_shard_only():
    watches = [("a1", "rep1", "s"), ("a2", "rep1", "t"), ("a3", "rep2", "s"), ("a4", "rep1", "s")]
    assert superseded_agents(watches, "rep1", "s") == ["a1", "a4"]


def test_at_the_bound_the_longest_silent_watch_makes_room_and_otherwise_the_watch_is_refused():
    """Silent by the memory budget's rule (no progress within ``silent_ms``): never acknowledged (silent
    since its watch) or acknowledged once and then no more (silent since then); live ones stay."""
    from mnesite.core.agent_budget import AgentUse

    def evict(*agents: tuple[str, int, bool], now_ms: int = 10_000) -> str | None:
        uses = [AgentUse(agent_id, 0, progress_ms, acknowledged) for agent_id, progress_ms, acknowledged in agents]
        return agent_to_evict(uses, 3, "core1", now_ms, silent_ms=1_000)

    assert evict(("a1", 9_500, True)) is None
    assert evict(("a1", 9_500, True), ("a2", 5_000, False), ("a3", 5_000, False)) == "a2"  # the oldest of two
    # Acknowledged once at 2 s and silent since: silent longer than a watch never acknowledged since 5 s.
    assert evict(("a1", 9_500, True), ("a2", 5_000, False), ("a3", 2_000, True)) == "a3"
    with pytest.raises(WatchRefusedError) as refused:
        evict(("a1", 9_500, True), ("a2", 9_001, True), ("a3", 9_999, True))
    assert refused.value.code == "overloaded"


def test_one_replicant_holds_at_most_replicant_watches_max_agents_and_is_told_why():
    """One principal (with security on, a watch's replicant is its key's principal) could open watches
    of one shard after another until ``watches_max``, leaving every other replicant ``overloaded``."""
    from mnesite.core.watch import check_replicant_watches

    owners = ["rep1", "rep2", "rep1"]
    check_replicant_watches(owners, "rep1", 3, "core1")  # two held, a third fits
    check_replicant_watches(owners, "rep2", 2, "core1")
    with pytest.raises(WatchRefusedError) as refused:
        check_replicant_watches(owners, "rep1", 2, "core1")
    assert refused.value.code == "overloaded"
    assert "replicant rep1 holds 2 watches" in str(refused.value) and "replicant_watches_max" in str(refused.value)


def test_endpoints_spelt_another_way_have_one_identity_and_different_endpoints_keep_theirs():
    same = [
        ("tcp://127.0.0.1:7400", "tcp://localhost:7400"),
        ("tcp://127.0.0.1:7400", "tcp://LOCALHOST.:07400"),
        ("tcp://127.0.0.1:7400", "tcp://[::1]:7400"),
        ("tcp://127.0.0.1:7400", "tcp://[::ffff:127.0.0.1]:7400"),
        ("tcp://127.0.0.1:7400", "tcp://0.0.0.0:7400"),
        ("tcp://*:7400", "tcp://127.0.0.1:7400"),  # a core's own entry may be its wildcard listen
        ("tcp://db1.example:7400", "TCP://DB1.Example:7400/"),
        ("tcp://[2001:db8::1]:7400", "tcp://[2001:DB8:0:0:0:0:0:1]:7400"),
        ("ipc://run/core1", "ipc://./run//core1"),
    ]
    for a, b in same:
        assert endpoint_identity(a) == endpoint_identity(b), (a, b)
    different = [
        ("tcp://127.0.0.1:7400", "tcp://127.0.0.1:7401"),
        ("tcp://127.0.0.1:7400", "tcp://127.0.0.2:7400"),
        ("tcp://db1.example:7400", "tcp://db2.example:7400"),
        ("ipc://run/core1", "ipc://run/core2"),
    ]
    for a, b in different:
        assert endpoint_identity(a) != endpoint_identity(b), (a, b)


def test_a_watch_naming_a_cores_endpoint_in_any_spelling_is_refused():
    cores = {"core1": "tcp://127.0.0.1:7400", "core2": "tcp://db2.example:7400"}
    for endpoint, core in [("tcp://localhost:7400", "core1"), ("tcp://DB2.example.:7400", "core2")]:
        with pytest.raises(WatchRefusedError) as refused:
            check_not_a_core_endpoint(endpoint, cores)
        assert refused.value.code == "bad_request" and f"endpoint of core {core}" in str(refused.value)
    check_not_a_core_endpoint("tcp://localhost:7401", cores)
