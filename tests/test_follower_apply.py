"""A follower gathers the commits it hears and applies them together (``core.rules.FollowerApply``).

The pure rule first; then three real cores whose followers may hold commits for 3 s, so that what the
rule promises is visible: the commits are held (the status says how many), a read that must see a
key, a query and a waiting changefeed get them applied at once, a schema change is applied at once,
and an idle follower applies what it holds when the delay ends, with no request to wake it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from mnesite.core.rules import FollowerApply
from mnesite.rlog.types import DropTableOp, MembersOp, TxKey, WriteOp

from tests.conftest import Cluster, seed_ranges, wait_until
from tests.sim.cluster import GatheringSimulation, SimulationFailure
from tests.sim.disk import GatheringDiskFullSimulation
from tests.sim.replicants import GatheringReplicantSimulation

pytestmark = pytest.mark.timeout(120)

DELAY_MS = 3000


# -- the rule -------------------------------------------------------------------------------


def _rows(count: int, size: int = 10) -> list[SimpleNamespace]:
    """``count`` committed entries of one written row each, ``size`` packed bytes each (what the rule reads)."""
    return [SimpleNamespace(ops=(WriteOp("t", {"id": i}),), packed=b"x" * size) for i in range(count)]


def test_commits_are_gathered_until_the_delay_ends() -> None:
    rule = FollowerApply(delay_ms_max=100)
    assert rule.committed(TxKey(1, 1), _rows(1, 50), following=True, waited_on=False, now_ms=1000) is None
    assert rule.committed(TxKey(1, 3), _rows(2, 50), following=True, waited_on=False, now_ms=1050) is None
    assert (rule.up_to, rule.entries, rule.bytes) == (TxKey(1, 3), 3, 150)
    assert rule.deadline_ms() == 1100  # from the first commit gathered, not the last
    assert rule.due(1099, waited_on=False) is None
    assert rule.due(1100, waited_on=False) == TxKey(1, 3)
    assert (rule.up_to, rule.entries, rule.bytes, rule.deadline_ms()) == (None, 0, 0, None)
    assert rule.due(5000, waited_on=True) is None  # nothing gathered, nothing to apply


def test_a_waiting_reader_a_sequencer_or_more_than_rows_applies_everything_gathered() -> None:
    rule = FollowerApply(delay_ms_max=100)
    assert rule.committed(TxKey(1, 1), _rows(1), True, False, 0) is None
    assert rule.due(1, waited_on=True) == TxKey(1, 1)
    assert rule.committed(TxKey(1, 2), _rows(1), True, False, 0) is None
    schema_change = [SimpleNamespace(ops=(DropTableOp("t", "default"),), packed=b"x")]
    assert rule.committed(TxKey(1, 3), schema_change, following=True, waited_on=False, now_ms=1) == TxKey(1, 3)
    assert rule.committed(TxKey(1, 4), _rows(1), True, waited_on=True, now_ms=2) == TxKey(1, 4)
    assert rule.committed(TxKey(1, 5), _rows(1), following=False, waited_on=False, now_ms=3) == TxKey(1, 5)
    mixed = [SimpleNamespace(ops=(WriteOp("t", {"id": 1}), MembersOp(("a", "b"))), packed=b"x")]
    assert rule.committed(TxKey(1, 6), mixed, True, False, 4) == TxKey(1, 6)
    assert rule.committed(TxKey(1, 7), [], True, False, 5) is None  # a commit notice of nothing new waits too
    assert rule.take() == TxKey(1, 7)


def test_the_entry_and_byte_bounds_and_delay_0() -> None:
    by_entries = FollowerApply(delay_ms_max=10_000, entries_max=4, bytes_max=10**9)
    assert by_entries.committed(TxKey(1, 3), _rows(3), True, False, 0) is None
    assert by_entries.committed(TxKey(1, 4), _rows(1), True, False, 0) == TxKey(1, 4)
    by_bytes = FollowerApply(delay_ms_max=10_000, entries_max=10**6, bytes_max=100)
    assert by_bytes.committed(TxKey(1, 1), _rows(1, 99), True, False, 0) is None
    assert by_bytes.committed(TxKey(1, 2), _rows(1, 1), True, False, 0) == TxKey(1, 2)
    never = FollowerApply(delay_ms_max=0)
    assert never.committed(TxKey(1, 1), _rows(1), True, False, 0) == TxKey(1, 1)


def test_an_older_commit_key_never_moves_the_gathered_key_back() -> None:
    rule = FollowerApply(delay_ms_max=100)
    rule.committed(TxKey(2, 5), _rows(5), True, False, 0)
    rule.committed(TxKey(2, 4), [], True, False, 1)
    assert rule.take() == TxKey(2, 5)


# -- the simulator: followers gathering under crashes, partitions, pauses and snapshots ------------

GATHERING_SEEDS = range(0, 24)
GATHERING_FAST_SEEDS = 6  # the fast lane's sample of the invariant tests below; CI runs the others too (deep)


def _run_gathering(seed: int) -> GatheringSimulation:
    simulation = GatheringSimulation(seed, 3 if seed % 2 == 0 else 5)
    simulation.run()
    return simulation


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seeds", seed_ranges(len(GATHERING_SEEDS), GATHERING_FAST_SEEDS))
def test_followers_gathering_commits_keep_every_invariant_of_the_simulator(seeds: range) -> None:
    """Every check of the core simulation holds (acknowledged writes committed and applied where they
    are acknowledged, committed prefixes agree, reads and failed guards answer committed prefixes),
    with followers gathering commits, and the gathering is exercised: applies whose time came."""
    assert sum(_run_gathering(seed).applies_gathered for seed in seeds) > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seeds", seed_ranges(len(GATHERING_SEEDS), GATHERING_FAST_SEEDS))
def test_followers_gathering_commits_on_full_disks_keep_every_invariant(seeds: range) -> None:
    gathered = failed_steps = 0
    for seed in seeds:
        simulation = GatheringDiskFullSimulation(seed, 3 if seed % 2 == 0 else 5)
        simulation.run()
        gathered += simulation.applies_gathered
        failed_steps += simulation.failed_steps
    assert gathered > 0 and failed_steps > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seeds", seed_ranges(len(GATHERING_SEEDS), GATHERING_FAST_SEEDS))
def test_replicants_of_followers_gathering_commits_keep_every_invariant(seeds: range) -> None:
    """The replicant simulation's checks (no gap, no duplicate, reads only of committed prefixes, tables
    equal at the end) with cores whose followers gather: pushes carry what is committed, not yet applied."""
    gathered = 0
    for seed in seeds:
        simulation = GatheringReplicantSimulation(seed, 3 if seed % 2 == 0 else 5, 2)
        simulation.run()
        gathered += simulation.applies_gathered
    assert gathered > 0


@pytest.mark.timeout(120)
def test_the_simulator_catches_a_follower_that_never_applies_on_time(monkeypatch) -> None:
    monkeypatch.setattr(FollowerApply, "due", lambda self, now_ms, waited_on: self.take() if waited_on else None)
    with pytest.raises(SimulationFailure, match="past the delay"):
        for seed in GATHERING_SEEDS:
            _run_gathering(seed)


@pytest.mark.timeout(120)
def test_the_simulator_catches_a_sequencer_that_gathers(monkeypatch) -> None:
    committed = FollowerApply.committed
    monkeypatch.setattr(
        FollowerApply,
        "committed",
        lambda self, up_to, entries, following, waited_on, now_ms: committed(self, up_to, entries, True, False, now_ms),
    )
    with pytest.raises(SimulationFailure, match="reported committed at .* but not committed there"):
        for seed in GATHERING_SEEDS:
            _run_gathering(seed)


# -- three real cores -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gathering_cluster(module_cluster: Cluster) -> Cluster:
    """Three cores whose followers may hold commits for DELAY_MS and a table ``t``, started once for the
    module: each test writes rows of its own ids."""
    cluster = module_cluster
    cluster.extend_core_configs(f"[limits]\nfollower_apply_delay_ms_max = {DELAY_MS}\n")
    cluster.start_all()
    with cluster.client("core1", timeout_ms=5000, retries=20) as client:  # forwarded to the sequencer elected
        client.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
    return cluster


@pytest.fixture
def gathering(gathering_cluster: Cluster) -> tuple[Cluster, str, str]:
    """(cluster, sequencer, follower), the follower holding no commits of an earlier test (a read that
    must see the sequencer's last key makes it apply them at once): the commits a test writes start a
    gathering of their own."""
    cluster = gathering_cluster
    wait_until(lambda: cluster.sequencer() is not None, 30, "a sequencer")
    sequencer = cluster.sequencer()[0]
    follower = next(name for name in cluster.names if name != sequencer)
    with cluster.client(follower, timeout_ms=10_000) as client:
        client.get("t", -1, after_tx_key=TxKey(*_shard_status(cluster, sequencer)["last"]))
    cluster.wait_converged([sequencer, follower], timeout_s=30)
    return cluster, sequencer, follower


def _shard_status(cluster: Cluster, name: str) -> dict:
    status = cluster.status(name)
    assert status is not None, f"{name} does not answer"
    return status["shards"]["default"]


def _write(cluster: Cluster, sequencer: str, ids: range) -> TxKey:
    with cluster.client(sequencer, timeout_ms=5000) as client:
        keys = [client.put("t", {"id": i, "v": f"row {i}"}) for i in ids]
    return keys[-1]


def _held(cluster: Cluster, follower: str, last: TxKey) -> dict:
    """Wait until ``follower`` heard ``last`` committed; it must still hold it unapplied."""
    wait_until(lambda: tuple(_shard_status(cluster, follower)["committed"]) >= last, 5, f"{follower} to hear {last}")
    shard = _shard_status(cluster, follower)
    assert tuple(shard["applied"]) < last, f"{follower} applied at once: {shard}"
    assert shard["gathered_entries"] > 0
    return shard


@pytest.mark.slow
def test_a_follower_holds_commits_and_a_read_that_must_see_a_key_applies_them_at_once(gathering) -> None:
    cluster, sequencer, follower = gathering
    last = _write(cluster, sequencer, range(20))
    _held(cluster, follower, last)
    began = time.monotonic()
    with cluster.client(follower, timeout_ms=10_000) as client:
        row = client.get("t", 19, after_tx_key=last)
    elapsed = time.monotonic() - began
    assert row == {"id": 19, "v": "row 19"}
    assert elapsed < DELAY_MS / 1000 / 2, f"the read waited {elapsed:.2f} s: it did not make the follower apply"
    shard = _shard_status(cluster, follower)
    assert tuple(shard["applied"]) >= last and shard["gathered_entries"] == 0


@pytest.mark.slow
def test_a_query_at_a_follower_applies_what_it_holds(gathering) -> None:
    cluster, sequencer, follower = gathering
    last = _write(cluster, sequencer, range(100, 130))
    _held(cluster, follower, last)
    began = time.monotonic()
    with cluster.client(follower, timeout_ms=10_000) as client:
        rows = list(client.query("SELECT count(*), max(id) FROM t WHERE id BETWEEN 100 AND 199", after_tx_key=last))
    assert rows == [(30, 129)]
    assert time.monotonic() - began < DELAY_MS / 1000 / 2


@pytest.mark.slow
def test_a_changefeed_waiting_at_a_follower_gets_a_commit_at_once(gathering) -> None:
    cluster, sequencer, follower = gathering
    start = _write(cluster, sequencer, range(200, 201))
    with cluster.client(follower, timeout_ms=10_000) as client:
        client.get("t", 200, after_tx_key=start)  # applied up to start: the feed begins there
    received: list[tuple[float, dict]] = []

    def follow() -> None:
        with cluster.client(follower, timeout_ms=10_000) as client:
            for record in client.changes(["t"], after_tx_key=start, follow=True, wait_ms=5000):
                received.append((time.monotonic(), record))
                return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    # The feed's request is held at the follower before the write: its status counts it.
    wait_until(
        lambda: ((cluster.status(follower) or {}).get("changes") or {}).get("held", 0) >= 1,
        5,
        "the changefeed request to be held at the follower",
        interval_s=0.02,
    )
    written = time.monotonic()
    _write(cluster, sequencer, range(201, 202))
    reader.join(timeout=10)
    assert received, "no change arrived"
    arrived, record = received[0]
    assert record["row"] == {"id": 201, "v": "row 201"}
    assert arrived - written < DELAY_MS / 1000 / 2, f"the change took {arrived - written:.2f} s"


@pytest.mark.slow
def test_a_schema_change_is_applied_at_once_and_an_idle_follower_applies_when_the_delay_ends(gathering) -> None:
    cluster, sequencer, follower = gathering
    last = _write(cluster, sequencer, range(300, 310))
    _held(cluster, follower, last)
    with cluster.client(sequencer, timeout_ms=5000) as client:
        client.create_table("u", "id", [("id", "INTEGER")])

    def has_u() -> bool:
        with cluster.client(follower, timeout_ms=5000) as client:
            return any(table["table"] == "u" for table in client.list_tables())

    began = time.monotonic()
    wait_until(has_u, DELAY_MS / 1000 / 2, f"{follower} to apply the create_table at once")
    assert tuple(_shard_status(cluster, follower)["applied"]) >= last  # with the rows gathered before it
    # Nothing asks the follower anything now but its status: it applies the next rows by the deadline.
    last = _write(cluster, sequencer, range(310, 315))
    _held(cluster, follower, last)
    began = time.monotonic()
    wait_until(lambda: tuple(_shard_status(cluster, follower)["applied"]) >= last, DELAY_MS / 1000 + 5, "the delay")
    waited = time.monotonic() - began
    assert waited < DELAY_MS / 1000 + 2, f"applied after {waited:.2f} s"
