"""Deterministic simulation of 3- and 5-core clusters under faults (see tests/sim/cluster.py).

CI runs ``CI_SEEDS`` seeds (even seeds: 3 cores, odd seeds: 5 cores), ``make test-fast`` the first
``FAST_SEEDS`` (the others are marked deep). Replay one seed with
``MNESITE_SIM_SEED=123 .venv/bin/pytest tests/test_simulation.py -k seed_123``; run more locally
with ``MNESITE_SIM_SEEDS=5000``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import pytest
from mnesite.core import membership, rules, snapshot
from mnesite.core.consensus import (
    EXCLUSION_NOTICE_INTERVAL_MS,
    AppendRequest,
    ForceStarted,
    ForceStartRefused,
    Role,
    ShardConsensus,
)
from mnesite.core.guard_tail import GuardTail
from mnesite.rlog import retention
from mnesite.rlog.types import ZERO_KEY, TxKey
from mnesite.rlog.versions import THIS_RELEASE

from tests.conftest import seed_ranges, simulation_seeds
from tests.sim import Simulation, SimulationFailure, run_seed
from tests.sim import cluster as sim_cluster
from tests.sim.cluster import READ_KEYS, replay_command
from tests.sim.exclusion import excluded_member_reading_locally
from tests.sim.versions import (
    STUCK_RUN_MS,
    stuck_member_behind_one_append,
    stuck_member_reading_locally,
    stuck_member_under_writes,
)

CI_SEEDS = 240
FAST_SEEDS = 60  # the developers' fast lane runs these; the others are marked deep


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_SIM_SEEDS", FAST_SEEDS))
def test_seed(seed):
    result = run_seed(seed)
    # Every run must commit something after healing, or it checked nothing.
    assert result.committed_entries >= 4


@pytest.mark.timeout(30)
def test_the_same_seed_replays_the_same_run():
    assert run_seed(7) == run_seed(7)


def _first_failure(seed_count: int) -> tuple[int, SimulationFailure] | None:
    for seed in range(seed_count):
        try:
            run_seed(seed)
        except SimulationFailure as failure:
            return seed, failure
    return None


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_broken_voting_rule(monkeypatch):
    """Granting every vote lets a stale candidate win and overwrite committed entries."""
    monkeypatch.setattr(ShardConsensus, "_candidate_log_is_up_to_date", lambda self, candidate_last_key: True)
    found = _first_failure(CI_SEEDS)
    assert found is not None, f"no violation caught in {CI_SEEDS} seeds with a broken voting rule"
    seed, failure = found
    assert f"seed {seed} " in str(failure)
    assert replay_command(seed) in str(failure)


@pytest.mark.timeout(60)
def test_the_simulator_checkers_catch_a_quorum_that_is_too_small(monkeypatch):
    """With one vote/ack short of a majority, the simulator's own checks (not the machine's) fire."""
    monkeypatch.setattr(ShardConsensus, "_majority", lambda self: max(1, len(self.members) // 2))
    found = _first_failure(CI_SEEDS)
    assert found is not None, f"no violation caught in {CI_SEEDS} seeds with a too small quorum"
    assert "ConsensusInvariantError" not in str(found[1]).splitlines()[0]


def _sequencer_crashes_before_its_fsync(seed: int) -> Simulation:
    """The sequencer's append reaches one follower (the other is cut off), that follower answers,
    and the sequencer crashes before its own commit made the entry durable (Persisted). Then the
    follower holding the entry is cut off and the two others elect a sequencer. Returns once the
    cluster is healed and quiet, after the simulator's final check."""
    simulation = Simulation(seed, 3)
    simulation._heal()
    old = simulation.run_until_quiet()
    near, far = [name for name in sorted(simulation.nodes) if name != old.name]
    simulation.cut = {(old.name, far), (far, old.name)}
    simulation.write(old.name)
    simulation._end_batches()  # the append leaves now; the driver's commit (Persisted) comes a turn later
    last = old.log.last_key()
    for _ in range(200):
        if old.machine is not None and dict(old.machine.status().follower_match_keys).get(near) == last:
            break
        simulation.now_ms += 1
        simulation._deliver_due()
    simulation._crash(old)
    old.down_until_ms = simulation.now_ms
    simulation._restart_due()
    simulation.cut = {(near, other) for other in simulation.nodes} | {(other, near) for other in simulation.nodes}
    for _ in range(300):
        simulation.advance()
    simulation._heal()
    simulation.final_check(simulation.run_until_quiet())
    return simulation


@pytest.mark.timeout(60)
def test_a_sequencer_crash_before_its_fsync_loses_no_acknowledged_write():
    for seed in range(6):
        _sequencer_crashes_before_its_fsync(seed)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_sequencer_that_counts_itself_before_its_append_is_durable(monkeypatch):
    """Counting its own entry before Persisted lets one follower's answer commit (and acknowledge) an
    entry that the crash takes away while that follower is outvoted: the checkers must see it."""
    monkeypatch.setattr(ShardConsensus, "_own_match_key", lambda self: self._last_key)
    caught = 0
    for seed in range(6):
        try:
            _sequencer_crashes_before_its_fsync(seed)
        except SimulationFailure:
            caught += 1
    assert caught > 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("core_count", [3, 5])
def test_force_start_after_the_majority_is_lost_for_good_keeps_every_acknowledged_write(core_count):
    for seed in range(10):
        simulation = Simulation(seed, core_count)
        sequencer = simulation.run_until_quiet()
        for _ in range(5):
            simulation.write(sequencer.name)
        simulation.run_until_quiet()
        acknowledged = dict(simulation.acknowledged)
        assert len(acknowledged) == 5
        # The cluster was quiet, so every survivor holds every committed entry: nothing is lost.
        names = sorted(simulation.nodes)
        survivors = names[: core_count // 2]
        simulation.lose_for_good(names[core_count // 2 :])
        # No random faults from here on: a pause of the one other survivor would fence the forced
        # sequencer and leave the write's outcome unknown (the scenario is the loss of the majority).
        simulation._heal()
        simulation.force_start(survivors[0])
        simulation.write(survivors[0])
        sequencer = simulation.run_until_quiet()
        assert sequencer.name == survivors[0] and sequencer.state.forced
        assert sequencer.machine is not None and sequencer.machine.members == tuple(survivors)
        assert len(simulation.acknowledged) == 6
        assert acknowledged.items() <= simulation.acknowledged.items()
        simulation.final_check(sequencer)


def _force_start_beside_a_core_that_holds_more(seed: int, forcer_role: str) -> tuple[Simulation, str, list]:
    """5 cores, no random faults: L is cut off while the others commit three writes; then the
    three cores other than L and one follower R are lost for good (R holds every write) and the
    cut heals. The operator force-starts ``forcer_role`` ("lagging": L, or "ahead": R). Returns the
    simulation, the core forced and the effects of its force start."""
    simulation = Simulation(seed, 5)
    simulation._heal()
    sequencer = simulation.run_until_quiet()
    names = sorted(simulation.nodes)
    lagging, ahead = [name for name in names if name != sequencer.name][:2]
    simulation.cut = {(lagging, other) for other in names} | {(other, lagging) for other in names}
    for _ in range(3):
        simulation.write(sequencer.name)

    def ahead_knows_the_writes_committed() -> bool:
        machine = simulation.nodes[ahead].machine
        keys = simulation.acknowledged.values()
        return len(keys) == 3 and machine is not None and machine.committed_key >= max(keys)

    while not ahead_knows_the_writes_committed():
        simulation.advance()
    simulation.lose_for_good([name for name in names if name not in (lagging, ahead)])
    simulation.cut = set()
    forcer = lagging if forcer_role == "lagging" else ahead
    return simulation, forcer, simulation.force_start(forcer)


@pytest.mark.timeout(60)
def test_force_start_is_refused_beside_a_core_that_holds_more_and_keeps_every_write_there():
    for seed in range(6):
        simulation, lagging, effects = _force_start_beside_a_core_that_holds_more(seed, "lagging")
        [refused] = [effect for effect in effects if isinstance(effect, ForceStartRefused)]
        assert "holds the log up to" in refused.reason and effects == [refused]
        machine = simulation.nodes[lagging].machine
        assert machine is not None and not machine.status().forced
        acknowledged = dict(simulation.acknowledged)
        simulation, ahead, effects = _force_start_beside_a_core_that_holds_more(seed, "ahead")
        forced = [effect.members for effect in effects if isinstance(effect, ForceStarted)]
        assert forced == [tuple(sorted((ahead, lagging)))]
        simulation.write(ahead)
        sequencer = simulation.run_until_quiet()
        assert sequencer.name == ahead and sequencer.state.forced
        assert len(simulation.acknowledged) == 4 and acknowledged.items() <= simulation.acknowledged.items()
        simulation.final_check(sequencer)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_force_start_beside_a_core_that_holds_more(monkeypatch):
    """Mutation: a forced start that weighs no reached core's log builds the new generation on the
    lagging core's log: the core that holds the committed writes cannot follow it."""
    real = ShardConsensus._force_start
    monkeypatch.setattr(
        ShardConsensus, "_force_start", lambda self, reached, last_keys=(), rows_lost=False: real(self, reached)
    )
    simulation, _, _ = _force_start_beside_a_core_that_holds_more(0, "lagging")
    with pytest.raises(SimulationFailure, match="ConsensusInvariantError|acknowledged"):
        simulation.run_until_quiet()


# ---------------------------------------------------------------- linearizable reads and failed guards


class _AppendsLost(Simulation):
    """Appends on the directed links in ``lost`` are lost (votes and pre-votes still pass)."""

    lost: frozenset[tuple[str, str]] = frozenset()

    def _send(self, sender, to, message):
        if (sender, to) in self.lost and isinstance(message, AppendRequest):
            return
        super()._send(sender, to, message)


def _stale_sequencer_reads_after_a_pause(seed: int) -> _AppendsLost:
    """A sequencer paused through an election that it never hears of reads from its old state.

    While it is paused, the others elect a new sequencer (their pre-votes and vote requests wait in
    its queue; the new sequencer's appends to it are lost) and acknowledge a new write. A read sent
    to the old sequencer reaches it right after those queued requests: its lease counted only
    answers to its own appends, long expired, so it must refuse.
    """
    simulation = _AppendsLost(seed, 3)
    simulation._heal()  # no random faults: the scenario is the fault
    old = simulation.run_until_quiet()
    simulation.write(old.name)
    simulation.run_until_quiet()
    simulation.lost = frozenset((name, old.name) for name in simulation.nodes)
    old.paused_until_ms = simulation.now_ms + 2000
    acknowledged = len(simulation.acknowledged)
    while simulation.now_ms < old.paused_until_ms - 100 and len(simulation.acknowledged) == acknowledged:
        simulation.advance()
        machines = [n.machine for n in simulation.nodes.values() if n is not old and n.machine is not None]
        new = next((m for m in machines if m.read_index(simulation.now_ms) is not None), None)
        if new is not None and simulation.write_count == acknowledged:
            simulation.write(new.name)
    assert len(simulation.acknowledged) == acknowledged + 1, "the new sequencer acknowledged no write"
    simulation.read(old.name, key=simulation.write_count % READ_KEYS)
    while simulation.now_ms <= old.paused_until_ms + 100:
        simulation.advance()
    return simulation


@pytest.mark.timeout(30)
def test_a_stale_sequencer_refuses_linearizable_reads_after_a_pause():
    for seed in range(5):
        simulation = _stale_sequencer_reads_after_a_pause(seed)
        assert simulation.reads_checked == 0, "the old sequencer served a read"


@pytest.mark.timeout(30)
def test_the_simulator_catches_a_lease_that_counts_any_frame(monkeypatch):
    """Mutation: the read lease counts any frame from a peer (here queued pre-votes and votes)."""
    monkeypatch.setattr(ShardConsensus, "_counts_for_lease", lambda self, message: True)
    with pytest.raises(SimulationFailure, match="linearizable read .* returned"):
        _stale_sequencer_reads_after_a_pause(0)


def _reads_at_a_new_sequencer_before_its_first_entry_commits(seed: int) -> _AppendsLost:
    """The sequencer dies right after acknowledging a write that one follower never received.

    The other follower has it but does not know it committed. It wins the election; the follower
    that lacks the entry answers its first append (so it hears this generation) with a failure, so
    the new sequencer's committed key stays behind the acknowledged write until the retry lands.
    Reads are sent to it all along: until its no-op commits it must refuse them.
    """
    simulation = _AppendsLost(seed, 3)
    simulation._heal()
    old = simulation.run_until_quiet()
    heir, lacking = sorted(name for name in simulation.nodes if name != old.name)
    simulation.lost = frozenset({(old.name, lacking)})
    acknowledged = len(simulation.acknowledged)
    simulation.write(old.name)
    while len(simulation.acknowledged) == acknowledged:
        simulation.advance()
    written_key = simulation.acknowledged[f"w{simulation.write_count}"]
    simulation.lose_for_good([old.name])
    # What it sent last (the append that would tell the heir the write committed) is lost with it.
    simulation.network = [item for item in simulation.network if item[2] != old.name]
    heapq.heapify(simulation.network)
    heir_machine = simulation.nodes[heir].machine
    assert heir_machine is not None and heir_machine.committed_key < written_key, "the scenario needs a lagging heir"
    deadline_ms = simulation.now_ms + 5000
    while simulation.now_ms < deadline_ms and heir_machine.committed_key.generation <= written_key.generation:
        simulation.advance()
        if heir_machine.role is Role.SEQUENCER:
            simulation.read(heir, key=simulation.write_count % READ_KEYS)
    assert heir_machine.committed_key.generation > written_key.generation, "the heir did not take over"
    for _ in range(10):
        simulation.advance()
    return simulation


@pytest.mark.timeout(30)
def test_a_new_sequencer_serves_reads_only_after_its_first_entry_commits():
    for seed in range(5):
        simulation = _reads_at_a_new_sequencer_before_its_first_entry_commits(seed)
        assert simulation.reads_checked > 0, "the new sequencer never served a read"


@pytest.mark.timeout(30)
def test_the_simulator_catches_reads_served_before_the_new_generations_first_entry_commits(monkeypatch):
    monkeypatch.setattr(ShardConsensus, "_own_generation_committed", lambda self: True)
    for seed in (1, 2):  # seeds at which the heir serves a read in time to be caught
        with pytest.raises(SimulationFailure, match="linearizable read .* returned"):
            _reads_at_a_new_sequencer_before_its_first_entry_commits(seed)


@pytest.mark.timeout(30)
def test_the_simulator_catches_guard_failures_answered_from_the_uncommitted_tail(monkeypatch):
    monkeypatch.setattr(GuardTail, "must_hold", lambda self, observed_key, committed_key: False)
    with pytest.raises(SimulationFailure, match="failed guard .* returned"):
        run_seed(1)  # the first seed whose draws give the mutation a failed guard to answer early


@pytest.mark.timeout(60)
def test_seeds_check_reads_and_failed_guards():
    results = [run_seed(seed) for seed in range(6)]
    assert all(result.reads_checked > 0 for result in results)
    assert sum(result.guard_failures_checked for result in results) > 0
    # Clients re-send guarded writes while their failure is held (guard_tail rule 3), and the held
    # failures answer those re-sends, each request id once (the simulator checks every answer).
    assert all(result.guard_resends > 0 for result in results)
    assert sum(result.guard_resends_answered for result in results) > 0


@pytest.mark.timeout(30)
def test_the_simulator_catches_a_resent_guard_evaluated_again_while_its_failure_is_held(monkeypatch):
    """core.guard_tail rule 3 (``GuardTail.resent``): a guarded write sent again while its failure is
    held is answered by that held failure, once. Mutation: a tail that never finds the held failure,
    so that the driver evaluates the re-send afresh; the simulator's clients re-send while a failure
    is held, and it catches the request id answered twice."""
    monkeypatch.setattr(GuardTail, "resent", lambda self, same, renewed: None)
    for seed in (0, 1):
        with pytest.raises(SimulationFailure, match=r"request c\d+ answered twice"):
            run_seed(seed)


# ---------------------------------------------------------------- pre-vote and stickiness


def _generations_after_a_follower_is_cut_off(seed: int, core_count: int) -> tuple[tuple[int, str], tuple[int, str]]:
    """(generation, sequencer) before and after a follower is cut off for 5 election timeouts."""
    simulation = Simulation(seed, core_count)
    simulation._heal()
    sequencer = simulation.run_until_quiet()
    assert sequencer.machine is not None
    before = (sequencer.machine.generation, sequencer.name)
    follower = next(name for name in simulation.nodes if name != sequencer.name)
    simulation.cut = {(a, b) for a in simulation.nodes for b in simulation.nodes if (a == follower) != (b == follower)}
    until_ms = simulation.now_ms + 5 * simulation.config.election_timeout_ms_max
    while simulation.now_ms < until_ms:
        simulation.advance()
    simulation.cut = set()
    after = simulation.run_until_quiet()
    assert after.machine is not None
    return before, (after.machine.generation, after.name)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("core_count", [3, 5])
def test_a_follower_cut_off_and_back_does_not_depose_a_healthy_sequencer(core_count):
    for seed in range(5):
        before, after = _generations_after_a_follower_is_cut_off(seed, core_count)
        assert after == before


@pytest.mark.timeout(30)
def test_without_pre_vote_a_follower_back_from_a_partition_deposes_the_sequencer(monkeypatch):
    """Mutation: a timed-out follower campaigns at once; the scenario above must notice."""
    monkeypatch.setattr(ShardConsensus, "_pre_vote", lambda self: self._campaign())
    outcomes = [_generations_after_a_follower_is_cut_off(seed, 3) for seed in range(5)]
    assert any(after != before for before, after in outcomes)


def _failover_ms(seed: int, core_count: int) -> int:
    """Time from losing a quiet cluster's sequencer until a new one may serve linearizable reads."""
    simulation = Simulation(seed, core_count)
    simulation._heal()
    old = simulation.run_until_quiet()
    simulation.lose_for_good([old.name])
    killed_ms = simulation.now_ms
    limit_ms = 10 * simulation.config.election_timeout_ms_max
    while simulation.now_ms - killed_ms < limit_ms:
        machines = [node.machine for node in simulation.nodes.values() if node.machine is not None]
        if any(machine.read_index(simulation.now_ms) is not None for machine in machines):
            return simulation.now_ms - killed_ms
        simulation.advance()
    raise AssertionError(f"seed {seed}: no new sequencer within {limit_ms} ms")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("core_count", [3, 5])
def test_with_a_majority_up_the_election_converges_quickly(core_count):
    durations = sorted(_failover_ms(seed, core_count) for seed in range(20))
    election_timeout_ms_max = Simulation(0, core_count).config.election_timeout_ms_max
    # Split votes happen (two cores time out in the same tick), but never for long.
    assert durations[len(durations) // 2] <= 1.5 * election_timeout_ms_max, durations
    assert durations[-1] <= 5 * election_timeout_ms_max, durations


def _faulty_phase(simulation: Simulation, duration_ms: int) -> None:
    """Random faults and writes for ``duration_ms`` (the left-out cores stay lost)."""
    end_ms = simulation.now_ms + duration_ms
    while simulation.now_ms < end_ms:
        simulation._inject_faults()
        simulation._restart_due()
        if simulation.rng.random() < simulation.faults.write_probability:
            simulation._client_write()
        simulation._advance()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("core_count", [3, 5])
def test_forced_starts_and_resumed_paused_cores_never_give_two_sequencers(core_count):
    for seed in range(12):
        _forced_start_scenario(Simulation(seed, core_count), left_out_majority_returns=False)


@pytest.mark.timeout(60)
def test_the_simulator_catches_the_split_brain_of_a_left_out_majority_that_comes_back():
    """The limit of any forced start: if the paused majority comes back, it still forms a quorum of
    the old membership. The checkers must see the two histories (this is why left-out cores must
    be rebuilt before they rejoin)."""
    failures = 0
    for seed in range(12):
        try:
            _forced_start_scenario(Simulation(seed, 3), left_out_majority_returns=True)
        except SimulationFailure:
            failures += 1
    assert failures > 0


def _forced_start_scenario(simulation: Simulation, left_out_majority_returns: bool) -> None:
    """The issue's split-brain sequence, checked by the simulator's invariants after every step.

    A force start is refused at every core while a majority is up (one core paused, as in the
    issue). Once a majority is paused, the core left alone may force-start; one paused core then
    resumes with its stale state (the others stay lost) under random faults and writes: no two
    sequencers in one generation, one committed history, every acknowledged write kept.
    """
    majority = simulation.core_count // 2 + 1
    sequencer = simulation.run_until_quiet()
    for _ in range(5):
        simulation.write(sequencer.name)
    sequencer = simulation.run_until_quiet()
    names = sorted(simulation.nodes)
    # One core paused (the sequencer): every other core still reaches a majority and is refused.
    sequencer.paused_until_ms = simulation.now_ms + 400
    for name in names:
        if name == sequencer.name:
            continue
        machine = simulation.nodes[name].machine
        assert machine is not None
        generation, members = machine.generation, machine.members
        effects = simulation.force_start(name)
        assert [type(e) for e in effects] == [ForceStartRefused], effects
        assert (machine.generation, machine.members) == (generation, members)
    simulation.run_until_quiet()
    # A majority paused: the core left alone (with at most a minority) may force-start.
    forcer = simulation.rng.choice(names)
    paused = simulation.rng.sample([n for n in names if n != forcer], majority)
    resumed = paused[0]
    for name in paused:
        simulation.nodes[name].paused_until_ms = simulation.now_ms + simulation.rng.randint(100, 900)
    if not left_out_majority_returns:
        simulation.lose_for_good(paused[1:])
    acknowledged = dict(simulation.acknowledged)
    reached = {n for n in names if n not in paused}
    generations = [simulation.nodes[n].state.generation for n in reached]
    effects = simulation.force_start(forcer)
    [forced] = [e for e in effects if isinstance(e, ForceStarted)]
    assert set(forced.members) == reached and resumed not in forced.members
    assert forced.generation > max(generations)
    _faulty_phase(simulation, 2000)
    simulation._heal()
    sequencer = simulation.run_until_quiet()
    assert sequencer.name in reached and sequencer.machine is not None and sequencer.machine.members == forced.members
    assert acknowledged.items() <= simulation.acknowledged.items()
    simulation.final_check(sequencer)
    if not left_out_majority_returns:
        # The resumed core talked to the cluster and was told by the forced membership that it is out.
        # A notice can be lost like any message and is repeated at most once per interval: give it
        # a few intervals of simulated time (quiet: no faults any more).
        simulation.run_until_quiet()
        returned = simulation.nodes[resumed].machine
        deadline_ms = simulation.now_ms + 5 * EXCLUSION_NOTICE_INTERVAL_MS
        while returned is not None and not returned.excluded and simulation.now_ms < deadline_ms:
            simulation.advance()
        assert returned is not None and returned.excluded and returned.role is not Role.SEQUENCER


def _forced_core_dies_before_a_left_out_core_comes_back(seed: int) -> None:
    """Five cores, no random faults. One core (L) is cut off; two are lost for good; the operator
    force-starts F, which reaches R; once R holds the forced generation's entry committed, F is lost
    for good too, and L's link heals. R, the forced generation's other member, must tell L that it
    was left out (F, who used to be the only one to, is gone): L then stops taking part."""
    simulation, forced, left_out = _force_start_with_a_core_cut_off(seed, 5, 2)
    forcer, kept = forced.members
    machine = simulation.nodes[kept].machine
    while machine is not None and machine.committed_key < TxKey(forced.generation, 1):
        simulation.advance()
    simulation.lose_for_good([forcer])
    _left_out_core_is_told(simulation, left_out, kept)


def _force_start_with_a_core_cut_off(seed: int, core_count: int, kept: int) -> tuple[Simulation, ForceStarted, str]:
    """No random faults, three writes; then the core after the first ``kept`` in name order is cut off,
    the ones after it are lost for good and the operator force-starts the first, which reaches the
    first ``kept`` (the forced set). Returns the simulation, the force start and the core cut off."""
    simulation = Simulation(seed, core_count)
    simulation._heal()
    sequencer = simulation.run_until_quiet()
    for _ in range(3):
        simulation.write(sequencer.name)
    simulation.run_until_quiet()
    names = sorted(simulation.nodes)
    left_out = names[kept]
    simulation.cut = {link for other in simulation.nodes for link in ((left_out, other), (other, left_out))}
    simulation.lose_for_good(names[kept + 1 :])
    [forced] = [effect for effect in simulation.force_start(names[0]) if isinstance(effect, ForceStarted)]
    assert forced.members == tuple(names[:kept])
    return simulation, forced, left_out


def _left_out_core_is_told(simulation: Simulation, left_out: str, kept: str) -> None:
    """Heal every link: ``left_out`` must be told by ``kept`` (the last forced member) that it is out."""
    simulation.cut = set()
    returned = simulation.nodes[left_out].machine
    deadline_ms = simulation.now_ms + 5 * simulation.config.election_timeout_ms_max + 5 * EXCLUSION_NOTICE_INTERVAL_MS
    while returned is not None and not returned.excluded and simulation.now_ms < deadline_ms:
        simulation.advance()
    if returned is None or not returned.excluded or returned.role is Role.SEQUENCER:
        raise simulation.fail(f"{left_out}, left out by the forced start, was never told so by {kept}")


@pytest.mark.timeout(60)
def test_a_left_out_core_is_told_by_the_forced_generation_after_the_forced_core_died():
    for seed in range(6):
        _forced_core_dies_before_a_left_out_core_comes_back(seed)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_forced_generation_whose_members_do_not_know_it_is_forced(monkeypatch):
    """Mutation: only the forced core knows (and tells) that the generation is forced, as before."""
    monkeypatch.setattr(membership, "forced_start_entry", lambda key: False)
    with pytest.raises(SimulationFailure, match="seed 0 .*was never told so"):
        _forced_core_dies_before_a_left_out_core_comes_back(0)


def _kept_core_installs_the_forced_entry_then_is_the_last_forced_member(seed: int) -> None:
    """Seven cores, no random faults. L is cut off; three are lost for good; the operator force-starts
    F, which reaches R and S (forced set {F, R, S}). R is cut off before the forced entry reaches it;
    F and S commit it and go on, F trims past R's log, so R gets the forced entry only through a
    snapshot install once its links heal. Then F and S are lost for good and L's link heals: R, the
    last forced member, must tell L that it was left out, as a member that got the entry by append."""
    simulation, forced, left_out = _force_start_with_a_core_cut_off(seed, 7, 3)
    forcer, kept, other = forced.members
    simulation.cut |= {link for peer in simulation.nodes for link in ((kept, peer), (peer, kept))}
    forced_machine, machine = simulation.nodes[forcer].machine, simulation.nodes[kept].machine
    assert forced_machine is not None and machine is not None
    while forced_machine.committed_key <= TxKey(forced.generation, 1) or (
        simulation.nodes[forcer].log.trimmed_key() <= TxKey(forced.generation, 1)
    ):
        simulation.write(forcer)
        simulation.advance()
    simulation.cut = {link for peer in simulation.nodes for link in ((left_out, peer), (peer, left_out))}
    while simulation.nodes[kept].applied_key < TxKey(forced.generation, 1):
        simulation.advance()
    machine = simulation.nodes[kept].machine
    if machine is not None and machine.members == forced.members and not machine.status().forced:
        raise simulation.fail(f"{kept} holds the forced generation's entry (by snapshot) but is not forced")
    simulation.lose_for_good([forcer, other])
    _left_out_core_is_told(simulation, left_out, kept)


@pytest.mark.timeout(60)
def test_a_core_that_installed_the_forced_entry_by_snapshot_tells_a_left_out_core():
    for seed in range(6):
        _kept_core_installs_the_forced_entry_then_is_the_last_forced_member(seed)


@pytest.mark.timeout(60)
def test_the_simulator_catches_an_install_that_keeps_the_followers_forced_flag(monkeypatch):
    """Mutation: an install takes the offer's membership but keeps the follower's forced flag, as before."""
    monkeypatch.setattr(
        sim_cluster,
        "state_after_install",
        lambda offer, members, forced: (snapshot.state_after_install(offer, members, False)[0], forced),
    )
    with pytest.raises(SimulationFailure, match="seed 1 .*by snapshot. but is not forced"):
        _kept_core_installs_the_forced_entry_then_is_the_last_forced_member(1)


def _forced_core_loses_its_forced_entry_then_dies(seed: int) -> None:
    """Five cores, no random faults. L is cut off, two are lost for good, the operator force-starts F,
    which reaches R (forced set {F, R}). F crashes before its forced entry is durable, and the entry
    never reaches R: F restarts with the forced membership in its state only, and R elects it in a
    later generation, learning the committed membership from F's appends (not from an entry). Once R
    holds F's committed entries, F is lost for good and L's link heals: R, the last forced member, must
    tell L that it was left out."""
    simulation, forced, left_out = _force_start_with_a_core_cut_off(seed, 5, 2)
    forcer, kept = forced.members
    simulation.cut |= {(forcer, kept), (kept, forcer)}  # the forced entry's appends are lost
    simulation._crash(simulation.nodes[forcer])
    assert simulation.nodes[forcer].log.last_key() < TxKey(forced.generation, 1)
    while any(sender == forcer for _, _, sender, _, _ in simulation.network):
        simulation.advance()
    simulation.cut -= {(forcer, kept), (kept, forcer)}
    machine = simulation.nodes[kept].machine
    while machine is None or machine.committed_key <= TxKey(forced.generation, 1):
        simulation._restart_due()
        simulation.advance()
        machine = simulation.nodes[kept].machine
    if machine.members == forced.members and not machine.status().forced:
        raise simulation.fail(f"{kept} holds the forced membership committed (from appends) but is not forced")
    simulation.lose_for_good([forcer])
    _left_out_core_is_told(simulation, left_out, kept)


@pytest.mark.timeout(60)
def test_a_member_that_learns_the_forced_membership_from_appends_tells_a_left_out_core():
    for seed in range(6):
        _forced_core_loses_its_forced_entry_then_dies(seed)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_forced_sequencer_that_does_not_record_its_membership_again(monkeypatch):
    """Mutation: an elected forced sequencer's first entry is a plain no-op, as before: its members
    learn the forced membership from its appends only, without the forced flag."""
    monkeypatch.setattr(membership, "elected_first_ops", lambda forced, change_in_flight, members: ())
    with pytest.raises(SimulationFailure, match="seed 0 .*from appends. but is not forced"):
        _forced_core_loses_its_forced_entry_then_dies(0)


def _floor_ignoring_the_applied_key(view, entries_max, before_ms, applied_key, keep_from=None):
    """Mutation of the retention floor: entries not applied yet may go (as if all were applied)."""
    return _RETENTION_FLOOR(view, entries_max, before_ms, view.last_key(), keep_from)


_RETENTION_FLOOR = retention.retention_floor
# Fixed seeds that trim (a count bound of 4 entries, 5 cores, lagging followers).
RETENTION_SEEDS = (3,)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_retention_floor_that_ignores_the_applied_key(monkeypatch):
    # The unmutated rule passes the same seeds, and trims in them (or the test proves nothing).
    results = [run_seed(seed) for seed in RETENTION_SEEDS]
    assert sum(result.entries_trimmed for result in results) > 0
    monkeypatch.setattr(retention, "retention_floor", _floor_ignoring_the_applied_key)
    for seed in RETENTION_SEEDS:
        with pytest.raises(SimulationFailure, match=f"seed {seed} .* lost or changed its applied entry"):
            run_seed(seed)


@pytest.mark.deep  # over CI's seeds 0-39, most of them deep
@pytest.mark.timeout(60)
def test_the_ci_seeds_trim_with_the_production_retention_rule_and_send_snapshots():
    results = [run_seed(seed) for seed in range(0, 40)]
    assert sum(result.entries_trimmed for result in results) > 0
    assert sum(result.snapshots for result in results) > 0


# Seeds at which a sequencer that proposes a resent request id again is caught (found with the
# mutation below; each fails with "request wN committed at ... and again at ...").
RESEND_SEEDS = (1, 3, 14, 15)


@pytest.mark.timeout(60)
def test_clients_resend_with_the_same_request_id_and_it_takes_effect_once():
    """Unmutated, the same seeds resend writes, some answered from the log, none committed twice."""
    resends = answered_from_log = 0
    for seed in range(40):
        simulation = Simulation(seed, 3 if seed % 2 == 0 else 5)
        simulation.run()
        resends += simulation.resends
        answered_from_log += simulation.resends_answered_from_log
    assert resends > 100 and answered_from_log > 5, (resends, answered_from_log)
    assert set(RESEND_SEEDS) <= set(range(40))  # run above: unmutated, they keep every invariant


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_resent_request_proposed_again(monkeypatch):
    """core.rules.route_write answers a request id found in the log from the log; without it, a
    client's resend of a write that did commit takes effect twice."""
    route_write = rules.route_write
    monkeypatch.setattr(
        rules, "route_write", lambda view, me, forwarded, earlier: route_write(view, me, forwarded, None)
    )
    for seed in RESEND_SEEDS:
        with pytest.raises(SimulationFailure, match=r"request w\d+ committed at .* and again at"):
            run_seed(seed)


@pytest.mark.timeout(60)
def test_the_simulator_catches_writes_told_before_their_entries_commit(monkeypatch):
    """core.rules.commit_heard tells the writes whose entries a Commit effect commits, and only those;
    one that also told the writes further down the unapplied tail (persisted here, not committed)
    acknowledges what a new sequencer may still replace. The simulator runs the same rule as the
    driver and checks every acknowledgement against the committed history when it is told."""
    commit_heard = rules.commit_heard

    def told_early(apply, waiters, keys, entries, up_to, following, waited_on, now_ms):
        new, told, apply_up_to = commit_heard(apply, waiters, keys, entries, up_to, following, waited_on, now_ms)
        return new, told + waiters.committed(entries), apply_up_to

    monkeypatch.setattr(rules, "commit_heard", told_early)
    with pytest.raises(SimulationFailure, match=r"acknowledged at .* but not committed there"):
        for seed in range(40):
            run_seed(seed)


def _abandoned_install_under_a_retaining_sequencer(seed: int) -> tuple[Simulation, str]:
    """3 cores, no faults, nothing trimmed: a follower's install is abandoned half way (its rows
    deleted) under a sequencer that retains its position, then writes go on."""
    sim = Simulation(seed, 3)
    sim._heal()  # no faults
    # Nothing trimmed: the sequencer's own rule (offer while trimmed past the follower) never offers.
    sim.faults = dataclasses.replace(sim.faults, retention_entries_max=10**9)
    sequencer = sim.run_until_quiet()
    follower = next(name for name in sim.nodes if name != sequencer.name)
    for _ in range(5):
        sim.write(sequencer.name)
        sim.advance()
    sim.abandon_install(follower)
    for _ in range(5):
        sim.write(sequencer.name)
        sim.read(follower, 0, kind="local")  # refused while its rows are half copied
        sim.advance()
    assert sim.local_reads_answered[follower] == 0 or not sim.nodes[follower].rows_lost
    return sim, follower


@pytest.mark.timeout(60)
def test_an_install_abandoned_under_a_sequencer_that_retains_the_position_heals():
    """Regression: the sequencer offered a snapshot only while its rlog was trimmed past the
    follower's position, so an install abandoned under a sequencer that retained it left the
    follower's rows half copied for good (no read served, no campaign). The follower now asks
    (``core.snapshot``, "Re-offer") and the sequencer's consensus offers (``SnapshotRequested``)."""
    for seed in (1, 2, 3):
        sim, follower = _abandoned_install_under_a_retaining_sequencer(seed)
        sequencer = sim.run_until_quiet()
        sim.final_check(sequencer)
        node = sim.nodes[follower]
        assert not node.rows_lost and sim.snapshots == 1 and sim.installs_abandoned == 1
        assert node.applied_digest == sequencer.applied_digest and sequencer.log.trimmed_key() == ZERO_KEY
        reads_before = sim.local_reads_answered[follower]
        sim.read(follower, 0, kind="local")
        for _ in range(10):
            sim.advance()
        assert sim.local_reads_answered[follower] > reads_before, "the healed follower serves local reads again"


@pytest.mark.timeout(60)
def test_the_simulator_catches_an_abandoned_install_that_never_gets_another_offer(monkeypatch):
    """The old behaviour (the sequencer ignores a follower's request for an offer): the follower's
    rows stay half copied, which the final check catches."""
    monkeypatch.setattr(ShardConsensus, "_on_snapshot_requested", lambda self, follower: None)
    sim, _ = _abandoned_install_under_a_retaining_sequencer(1)
    with pytest.raises(SimulationFailure, match="seed 1 .*still half copied by an abandoned snapshot install"):
        sim.run_until_quiet()


def _abandoned_install_cut_off(seed: int) -> tuple[Simulation, str]:
    """3 cores, no faults: every key written and applied everywhere, then a follower's install is
    abandoned half way (its rows deleted) while it is cut off from the other cores (no offer heals it),
    and a client asks it for local reads of key 0."""
    sim = Simulation(seed, 3)
    sim._heal()  # no faults
    sequencer = sim.run_until_quiet()
    for _ in range(2 * READ_KEYS):
        sim.write(sequencer.name)
        sim.advance()
    sequencer = sim.run_until_quiet()
    follower = next(name for name in sim.nodes if name != sequencer.name)
    sim.cut = {(a, b) for a in sim.nodes for b in sim.nodes if (a == follower) != (b == follower)}
    sim.abandon_install(follower)
    for _ in range(5):
        sim.read(follower, 0, kind="local")
        sim.advance()
    for _ in range(20):
        sim.advance()
    return sim, follower


def _serving_half_copied_rows(install_reason, rows_lost, stuck_reason, applied, excluded_generation=None):
    """Mutation of the serving rule: the rows an abandoned install deleted are served as if whole."""
    return _NOT_SERVING_REASON(install_reason, False, stuck_reason, applied, excluded_generation)


_NOT_SERVING_REASON = rules.not_serving_reason


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_serving_rule_that_ignores_half_copied_rows(monkeypatch):
    """``core.rules.not_serving_reason`` (run by the driver and by the simulator's local-read gate)
    serves no read of rows an abandoned install deleted; one that ignores ``rows_lost`` answers a
    local read from them, which the simulator's check of local reads catches (the node applied a row
    its rows no longer hold)."""
    # Unmutated, the same scenario answers no local read at the follower, and heals once reconnected.
    for seed in (1, 2, 3):
        sim, follower = _abandoned_install_cut_off(seed)
        assert sim.nodes[follower].rows_lost and sim.local_reads_answered[follower] == 0
        sim._heal()
        sim.final_check(sim.run_until_quiet())
        assert not sim.nodes[follower].rows_lost
    monkeypatch.setattr(rules, "not_serving_reason", _serving_half_copied_rows)
    for seed in (1, 2, 3):
        with pytest.raises(SimulationFailure, match=f"seed {seed} .*local read of key 0 at .* half copied"):
            _abandoned_install_cut_off(seed)


class _AbandoningSimulation(Simulation):
    installs_abandoned_max = 2  # the first two installs are abandoned half way


ABANDONING_SEEDS = 40
ABANDONING_FAST_SEEDS = 10  # the fast lane's sample; CI runs the others too (deep)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seeds", seed_ranges(ABANDONING_SEEDS, ABANDONING_FAST_SEEDS))
def test_seeds_whose_first_installs_are_abandoned_heal(seeds):
    """Under the CI faults (trimming, crashes, partitions), the first installs are abandoned: every
    follower still ends with whole rows (the final check), through the sequencer's trimmed-log offers
    or through a follower's request."""
    abandoned = 0
    for seed in seeds:
        sim = _AbandoningSimulation(seed, 3 if seed % 2 == 0 else 5)
        sim.run()
        abandoned += sim.installs_abandoned
    assert abandoned > 0


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_serving_rule_that_ignores_a_stuck_consensus(monkeypatch):
    """``core.rules.not_serving_reason`` serves no local read at a core whose consensus is stuck at a
    cluster version entry it refused (``stuck_reason``): its state stops while the others go on. The
    simulator checks what such a read returns, not why it was served: where faults cannot hold a core
    back (``StuckMemberSimulation``), a local read must reflect every entry committed more than
    ``_local_read_lag_ms_max`` before it began, a bound a core that can follow meets (the other cores
    answer over a hundred reads under it here) and a stuck one breaks once a write commits after it
    stopped. A check of the history, rather than of ``stuck_reason`` itself, also catches a consensus
    that stops without saying so."""
    seeds = (1, 2, 3, 4)
    for seed in seeds:
        sim, stuck, answered = stuck_member_reading_locally(seed)
        node = sim.nodes[stuck]
        assert node.machine is not None and node.machine.stuck_reason is not None
        assert sim.local_reads_answered[stuck] == answered, "the stuck core answers no local read"
        assert node.applied_key < sim.committed_last_key and sim.snapshots == 0
        others = [name for name in sim.nodes if name != stuck]
        assert all(sim.local_reads_answered[name] >= 30 for name in others), sim.local_reads_answered
    monkeypatch.setattr(rules, "not_serving_reason", _serving_a_stuck_consensus)
    for seed in seeds:
        with pytest.raises(SimulationFailure, match=f"seed {seed} .*local read of key \\d at core\\d"):
            stuck_member_reading_locally(seed)


def _serving_a_left_out_core(install_reason, rows_lost, stuck_reason, applied, excluded_generation=None):
    """Mutation of the serving rule: a core a forced start left out serves its local reads as before."""
    return _NOT_SERVING_REASON(install_reason, rows_lost, stuck_reason, applied, None)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_serving_rule_that_serves_a_core_left_out_by_a_forced_start(monkeypatch):
    """``core.rules.not_serving_reason`` serves no local read at a core a forced start left out of the
    shard (``ShardConsensus.excluded``): no sequencer feeds it any more and none counts its lag, so its
    reads would be ever staler, silently. In ``tests.sim.exclusion`` the forced core commits a write
    every 300 ms while clients read locally there and at the left-out core, held to the lag bound of a
    run without faults: the forced core answers under it, the left-out one answers nothing; with the
    rule mutated to ignore the exclusion, it answers from its frozen state and the check of the
    history catches it once a write commits after the exclusion."""
    seeds = (1, 2, 3, 4)
    for seed in seeds:
        sim, forced, left_out, answered = excluded_member_reading_locally(seed)
        assert sim.nodes[left_out].machine.excluded
        assert sim.local_reads_answered[left_out] == answered, "the left-out core answers no local read"
        assert sim.local_reads_answered[forced] >= 30, sim.local_reads_answered
    monkeypatch.setattr(rules, "not_serving_reason", _serving_a_left_out_core)
    for seed in seeds:
        with pytest.raises(SimulationFailure, match=f"seed {seed} .*local read of key \\d at core\\d"):
            excluded_member_reading_locally(seed)


_SHARD_CONSENSUS_INIT = ShardConsensus.__init__


def _ignoring_the_persisted_exclusion(self, shard, name, log, state, *args, **kwargs):
    """Mutation of the machine's start: the exclusion it was built with (persisted) is ignored, as when
    it lived only in memory."""
    _SHARD_CONSENSUS_INIT(self, shard, name, log, dataclasses.replace(state, excluded_generation=None), *args, **kwargs)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_left_out_core_that_forgets_its_exclusion_when_it_restarts(monkeypatch):
    """A core a forced start left out kept that only in memory: restarted, it served local reads of its
    frozen state again, as a follower hearing no sequencer, until a member of the forced generation told
    it again. In ``tests.sim.exclusion`` it crashes and restarts while the forced core writes and clients
    read at both: rebuilt from what it persisted (``PersistedState.excluded_generation``), it answers no
    local read; with the persisted exclusion ignored at the machine's start, the check of the history
    catches its stale reads."""
    seeds = (1, 2, 3, 4)
    for seed in seeds:
        sim, _, left_out, answered = excluded_member_reading_locally(seed)
        node = sim.nodes[left_out]
        assert node.machine.excluded and node.state.excluded_generation == node.machine.excluded_generation
        assert sim.crashes == 1 and sim.local_reads_answered[left_out] == answered
    monkeypatch.setattr(ShardConsensus, "__init__", _ignoring_the_persisted_exclusion)
    for seed in seeds:
        with pytest.raises(SimulationFailure, match=f"seed {seed} .*local read of key \\d at core\\d"):
            excluded_member_reading_locally(seed)


@pytest.mark.timeout(60)
def test_a_stuck_member_refuses_snapshot_offers_at_the_cluster_version_it_does_not_speak(monkeypatch):
    """The sequencer's snapshot offers carry the cluster version its applied state records, as
    production's do (``CoreNode`` reads it from its store), not a version the simulator assumes. In
    ``StuckMemberSimulation`` the sequencer trims past the stuck member and offers it snapshots at the
    version it refused: it refuses each (``core.snapshot.accept_offer``) and stays stuck. Mutation: an
    offer rule that ignores the version lets it install a copy it cannot read; the simulator catches it."""
    version = THIS_RELEASE.cluster_versions[1]  # the one the scenario's sequencer appends
    for seed in (1, 2):
        sim, stuck, _ = stuck_member_reading_locally(seed)
        assert sim.offers_refused > 0 and sim.snapshots == 0
        assert sim.nodes[stuck].machine.stuck_reason is not None
        versions = {name: node.cluster_version for name, node in sim.nodes.items()}
        assert versions == {name: 1 if name == stuck else version for name in sim.nodes}
    monkeypatch.setattr(snapshot, "unspoken_cluster_version", lambda version, own: None)
    with pytest.raises(SimulationFailure, match=f"took a snapshot offer at cluster version {version}, which it cannot"):
        stuck_member_reading_locally(1)


@pytest.mark.timeout(60)
def test_a_stuck_member_takes_the_entries_of_an_append_before_the_cluster_version_it_does_not_speak():
    """Regression: a member that does not speak a cluster version refused the whole append holding
    its entry, the entries before it too, and so stayed behind what it could read: the write that
    travelled with the entry was neither persisted nor applied there (nor, when it came alone, applied:
    every later append telling its commit also held the entry). Its consensus now takes the entries
    before the refused one, as an append of those alone, and their commit: it stops at the entry
    before (``StuckMemberSimulation``: the write and the version entry proposed in one turn)."""
    for seed in (5, 6, 7, 9):  # seeds whose appends carry more than one entry
        sim, stuck, written = stuck_member_behind_one_append(seed)
        node = sim.nodes[stuck]
        assert node.machine is not None and node.machine.stuck_reason is not None
        assert "was refused" in node.machine.stuck_reason
        assert (node.log.last_key(), node.applied_key) == (written, written), seed
        assert sim.committed_last_key > written and node.cluster_version == 1


# How soon after its first send the sequencer has heard a stuck member refuse the entry (a few of
# the simulator's round trips, at most 2 * 60 ms each).
REFUSAL_HEARD_MS = 300


@pytest.mark.timeout(60)
def test_a_stuck_member_is_resent_the_entry_it_refused_at_most_once_a_heartbeat_interval():
    """Regression: a member stuck at a cluster version entry it refused answered each batch that
    reached it as missing its previous entry; the sequencer retreated and resent it the refused entry
    at once, so that under writes it got the entry again about every round trip until an upgrade.
    The sequencer now takes an answer to its probe that stops before the probe's end as a refusal and
    sends that member nothing more until its next heartbeat, which resends from its match key (the
    member may have been upgraded since): at most one resend a heartbeat interval. Once upgraded, the
    member takes the entry and catches up."""
    for seed in range(8):
        sim, stuck = stuck_member_under_writes(seed)
        node = sim.nodes[stuck]
        assert node.machine is not None and node.machine.stuck_reason is not None, seed
        sent, interval_ms = sim.refused_sent_ms, sim.config.heartbeat_interval_ms
        # Until the sequencer hears the refusal, the appends pipelined behind the entry fail one by
        # one (each retreat probes once): a few round trips. From then on, a heartbeat probes.
        settled = [sent_ms for sent_ms in sent if sent_ms >= sent[0] + REFUSAL_HEARD_MS]
        assert len(settled) >= STUCK_RUN_MS // interval_ms // 2, (seed, sent)
        gaps = [later - earlier for earlier, later in itertools.pairwise(settled)]
        assert min(gaps) >= interval_ms, (seed, interval_ms, sent)
        # Upgraded (restarted on this release), it takes the entry at the next probe and catches up.
        sim.rolled_back = None
        sim._crash(node)
        sequencer = sim.run_until_quiet()
        assert node.machine is not None and node.machine.stuck_reason is None, seed
        assert node.applied_key == sequencer.applied_key and node.cluster_version == sequencer.cluster_version, seed


@pytest.mark.timeout(60)
def test_a_stuck_member_is_probed_with_the_one_entry_it_refused():
    """Regression: each heartbeat's probe of a member stuck at a cluster version entry it refused
    carried a whole append from its match key (up to ``entries_per_append_max`` entries and
    ``append_bytes_max`` bytes: 64 entries, 512 KiB every 100 ms by default), all decoded and dropped
    there, for as long as it stayed stuck. A refused member is now probed with the one entry after its
    match key, which is all it can tell about: it takes it once upgraded, and catches up from there."""
    for seed in (0, 5, 6, 7):  # seeds whose appends carry more than one entry
        sim, stuck = stuck_member_under_writes(seed)
        assert sim.config.entries_per_append_max > 1
        sent = sim.refused_sent_ms
        settled = [
            count
            for sent_ms, count in zip(sent, sim.refused_sent_entries, strict=True)
            if sent_ms >= sent[0] + REFUSAL_HEARD_MS
        ]
        assert len(settled) >= STUCK_RUN_MS // sim.config.heartbeat_interval_ms // 2, (seed, sent)
        assert set(settled) == {1}, (seed, settled)
        sim.rolled_back = None
        sim._crash(sim.nodes[stuck])
        sequencer = sim.run_until_quiet()
        assert sim.nodes[stuck].applied_key == sequencer.applied_key, seed


def _serving_a_stuck_consensus(install_reason, rows_lost, stuck_reason, applied, excluded_generation=None):
    """Mutation of the serving rule: a core whose consensus cannot follow the log serves anyway."""
    return _NOT_SERVING_REASON(install_reason, rows_lost, None, applied, excluded_generation)


def test_a_failure_names_the_test_that_replays_it(monkeypatch):
    """A fixed scenario has no ``seed_N`` test id: the replay command names the test that ran it."""
    from tests.sim.cluster import replay_command

    node_id = "tests/test_simulation.py::test_an_install_abandoned_under_a_sequencer_that_retains_the_position_heals"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{node_id} (call)")
    assert replay_command(3) == f"MNESITE_SIM_SEED=3 .venv/bin/pytest '{node_id}'"
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert replay_command(3, "tests/test_disk_simulation.py") == (
        "MNESITE_SIM_SEED=3 .venv/bin/pytest tests/test_disk_simulation.py -k 'seed_3'"
    )


def _commit_writes(sim: Simulation, sequencer: str, why: str, count: int = 5) -> None:
    """``count`` writes at ``sequencer``, then time for them to commit on the cores it reaches."""
    for _ in range(count):
        sim.write(sequencer)
        sim.advance()
    for _ in range(100):
        sim.advance()
    assert len(sim.acknowledged) >= count, why


def _disk_lost_while_a_core_lags(seed: int) -> Simulation:
    """3 cores, no random faults: writes commit on the sequencer and one follower while the third is
    cut off from the sequencer; that follower's disk is then lost. It recovers from the journals of
    the other two (``core.recovery``), and the sequencer is cut off from it at once, before it could
    send it anything: the lagging core campaigns, and the rebuilt core's vote decides. Then heal."""
    sim = Simulation(seed, 3)
    sim._heal()
    sim.faults = dataclasses.replace(sim.faults, retention_entries_max=10**9)
    sequencer = sim.run_until_quiet()
    a = sequencer.name
    b, c = (name for name in sorted(sim.nodes) if name != a)
    sim.cut = {(a, c), (c, a)}
    _commit_writes(sim, a, "the writes committed on the sequencer and b")
    sim.lose_disk(b)
    sim._restart_due()  # b recovers (it reaches a and c) and starts
    assert sim.nodes[b].machine is not None and not sim.nodes[b].disk_lost
    sim.cut |= {(a, b), (b, a)}
    for _ in range(300):  # 3 s: c's election timeouts pass
        sim._restart_due()
        sim.advance()
    sim.cut = set()
    sequencer = sim.run_until_quiet()
    sim.final_check(sequencer)
    assert sim.disks_lost == 1
    return sim


@pytest.mark.timeout(60)
def test_a_core_rebuilt_on_an_empty_disk_never_elects_a_core_that_lacks_what_it_held():
    """The writes were committed on the sequencer and the core whose disk was lost. With an empty log
    that core counted the lagging core up to date, elected it, and the writes were truncated from the
    old sequencer: acknowledged writes lost to one lost disk. Its recovered vote floor refuses it."""
    for seed in (1, 2, 3, 4):
        sim = _disk_lost_while_a_core_lags(seed)
        assert sim.acknowledged, "acknowledged writes survived"


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_rebuilt_core_that_ignores_its_vote_floor(monkeypatch):
    """Mutation: recovery names no floor (the rule before it); the lagging core is elected with the
    rebuilt core's vote and the acknowledged writes are lost, which the simulator catches."""
    from tests.sim import cluster

    monkeypatch.setattr(cluster, "recovered_vote_floors", lambda answers: {})
    for seed in (1, 2, 3, 4):
        with pytest.raises(SimulationFailure, match="missing|different entry|commits"):
            _disk_lost_while_a_core_lags(seed)


def _vote_lost_with_the_disk(seed: int) -> Simulation:
    """5 cores, no random faults. The sequencer ``a`` is cut off from three cores; one of them, P,
    campaigns in generation g and gets Q's vote (and no other: its request to ``a`` is held on a slow
    link, the rest are cut). Q's disk is then lost, and with it the vote. Q restarts reaching ``a``, R
    and S (n - majority + 1 = 3 of the others) but not P, so none of its answers knows g. If it starts,
    it votes again in g, for a core of R and S; then P's held request reaches ``a``, which has voted in
    no generation g, and P wins g with the lost vote: two sequencers of one generation. A rebuilt core
    must hear every other member before it takes part (``core.recovery.recovery_shortfall``)."""
    sim = Simulation(seed, 5)
    sim._heal()
    sim.faults = dataclasses.replace(sim.faults, retention_entries_max=10**9)
    a = sim.run_until_quiet().name
    names = sorted(sim.nodes)
    b, c, d, e = (name for name in names if name != a)

    def cut(x: str, y: str) -> None:
        sim.cut |= {(x, y), (y, x)}

    def machine(name: str) -> ShardConsensus:
        node_machine = sim.nodes[name].machine
        assert node_machine is not None, f"{name} is running"
        return node_machine

    for other in (b, c, d):
        cut(a, other)
    for _ in range(3000):
        sim.advance()
        candidates = [name for name in (b, c, d) if machine(name).role is Role.CANDIDATE]
        if candidates:
            break
    else:
        raise AssertionError("no core campaigned")
    p = candidates[0]
    q = next(name for name in (b, c, d) if name != p)
    generation = machine(p).generation
    held = [message for message in sim.network if message[2] == p and message[3] == a]
    assert held, f"{p}'s vote request to {a} is on its way"
    sim.network = [message for message in sim.network if message not in held]
    heapq.heapify(sim.network)
    for other in names:
        if other not in (p, q):
            cut(p, other)
    for _ in range(200):
        sim.advance()
        if q in machine(p)._votes:
            break
    else:
        raise AssertionError(f"{q} did not vote for {p}")
    cut(p, q)
    sim.lose_disk(q)
    sim.cut -= {(a, q), (q, a)}
    r, s = (name for name in names if name not in (a, p, q))
    for _ in range(300):  # Q asks a, R and S (and, with the rule, waits for P)
        sim._restart_due()
        sim.advance()
        if sim.nodes[q].machine is not None:
            break
    for other in names:
        if other != a:
            cut(a, other)
    for _ in range(1000):  # R, S and Q (if it started) elect; a votes in nothing
        sim._restart_due()
        sim.advance()
    sim.cut -= {(p, a), (a, p)}
    for message in held:  # the slow link delivers P's request for a's vote in generation g
        heapq.heappush(sim.network, (sim.now_ms + 1, *message[1:]))
    for _ in range(200):
        sim.advance()
    sim._heal()
    sequencer = sim.run_until_quiet()
    sim.final_check(sequencer)
    assert machine(q).generation >= generation and sim.disks_lost == 1
    assert any(event[1:3] == (q, "recovery heard too few cores") for event in sim.trace), (
        f"{q} waited for {p}, whose answer knows generation {generation}"
    )
    return sim


@pytest.mark.timeout(60)
def test_a_core_rebuilt_on_an_empty_disk_waits_for_every_other_member_before_it_votes():
    """A vote cast before the loss lives on at its candidate only: the rebuilt core starts once every
    other member answered, so it learns that generation and never votes in it again."""
    for seed in (1, 2, 6, 8):
        _vote_lost_with_the_disk(seed)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_rebuilt_core_that_votes_again_in_a_generation_it_voted_in(monkeypatch):
    """Mutation: the rule before, n - majority + 1 of the other members; the rebuilt core learns
    nothing of generation g from them, votes in it again and two cores are sequencers of g."""
    from mnesite.core import recovery

    from tests.sim import cluster

    def majority_only(answers, members, name, existing=False):
        if name not in members:
            return 0
        usable = recovery.well_formed_answers(answers)
        history = any(recovery.journal_generation(j, shard) > 0 for j in usable.values() for shard in j["shards"])
        if not existing and not history:
            return 0
        heard = sum(1 for peer in usable if peer in members and peer != name)
        return max(0, len(members) - (len(members) // 2 + 1) + 1 - heard)

    monkeypatch.setattr(cluster, "recovery_shortfall", majority_only)
    for seed in (1, 2, 6, 8):  # seeds whose other cores elect in generation g itself
        with pytest.raises(SimulationFailure, match="two sequencers in generation"):
            _vote_lost_with_the_disk(seed)


def _rebuilt_core_reaching_only_a_core_that_never_saw_an_election(seed: int, declared_existing: bool) -> Simulation:
    """3 cores; the third is cut off from the start, so it never sees an election. The other two
    elect and commit writes; the follower's disk is then lost and it restarts reaching only the third
    core, whose journal shows no generation: just what a core of a new cluster hears. Undeclared, it
    starts with nothing to recover, votes for the third core in the generation it voted in before and
    with an empty log: two sequencers of one generation, and the writes it helped commit truncated.
    Declared ``initial_cluster_state = "existing"``, it waits for the sequencer's answer."""
    sim = Simulation(seed, 3)
    sim.rebuilt_cores_declared_existing = declared_existing
    sim._heal()
    sim.faults = dataclasses.replace(sim.faults, retention_entries_max=10**9)
    a, b, c = sorted(sim.nodes)
    sim.cut = {(c, a), (a, c), (c, b), (b, c)}
    for _ in range(3000):
        sim.advance()
        sequencer = next((n for n in (a, b) if sim.nodes[n].machine.role is Role.SEQUENCER), None)
        if sequencer is not None and sim.nodes[c].machine.generation == 0:
            break
    else:
        raise AssertionError("a and b elected no sequencer while c never saw an election")
    follower = b if sequencer == a else a
    _commit_writes(sim, sequencer, "the writes committed on the sequencer and the follower")
    sim.lose_disk(follower)
    sim.cut = {(follower, sequencer), (sequencer, follower), (c, sequencer), (sequencer, c)}
    for _ in range(1500):
        sim._restart_due()
        sim.advance()
    sim._heal()
    sim.faults = dataclasses.replace(sim.faults, retention_entries_max=10**9)
    sim.final_check(sim.run_until_quiet())
    return sim


@pytest.mark.timeout(60)
def test_a_rebuilt_core_declared_existing_does_not_take_a_fresh_core_for_a_new_cluster():
    for seed in (1, 2, 3, 4):
        sim = _rebuilt_core_reaching_only_a_core_that_never_saw_an_election(seed, declared_existing=True)
        assert any(event[2] == "recovery heard too few cores" for event in sim.trace if len(event) > 2)


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_rebuilt_core_that_takes_a_fresh_core_for_a_new_cluster():
    """Mutation: the operator starts the rebuilt core without ``initial_cluster_state = "existing"``."""
    for seed in (1, 2, 3, 4):
        with pytest.raises(SimulationFailure, match="two sequencers|missing|different entry|commits"):
            _rebuilt_core_reaching_only_a_core_that_never_saw_an_election(seed, declared_existing=False)


class _LazyAppendsLost(_AppendsLost):
    lazy_feed_interval_ms = 5


def _ack_after_the_eager_follower_goes_silent(seed: int) -> tuple[int, int]:
    """A quiet 3-core cluster whose sequencer feeds one follower lazily; then every append to the
    eager one is lost. Returns how long the next write took to be acknowledged, in ms, and how many
    generations went by meanwhile."""
    simulation = _LazyAppendsLost(seed, 3, tick_ms=1)
    simulation._heal()
    simulation.faults = dataclasses.replace(simulation.faults, delay_ms_max=2)
    sequencer = simulation.run_until_quiet()
    simulation.write(sequencer.name)  # a batch makes the sequencer choose its lazy follower
    sequencer = simulation.run_until_quiet()
    machine = sequencer.machine
    assert machine is not None and len(machine.lazy_followers) == 1, "the scenario needs a lazy follower"
    (eager,) = set(machine.members) - machine.lazy_followers - {sequencer.name}
    simulation.lost = frozenset({(sequencer.name, eager)})
    generation, acknowledged, began_ms = machine.generation, len(simulation.acknowledged), simulation.now_ms
    simulation.write(sequencer.name)
    while len(simulation.acknowledged) == acknowledged and simulation.now_ms < began_ms + 5000:
        simulation.advance()
    assert len(simulation.acknowledged) > acknowledged, "the write was never acknowledged"
    return simulation.now_ms - began_ms, machine.generation - generation


# The lazy follower, not fed for longer than its interval (5 ms), gets the write's batch at once; the
# batch and its answer cross the network in at most 2 ms each, in 1-ms ticks.
SILENT_EAGER_ACK_MS_MAX = 10


@pytest.mark.timeout(60)
def test_a_silent_eager_follower_delays_a_write_by_a_lazy_feed_not_an_election():
    """Thrifty replication's liveness: with every append to the eager follower lost, the lazy
    follower's next feed commits the write, within a few ticks and in the same generation."""
    for seed in range(0, 12, 2):
        took_ms, generations = _ack_after_the_eager_follower_goes_silent(seed)
        assert generations == 0, f"seed {seed}: an election ({generations} generations)"
        assert took_ms <= SILENT_EAGER_ACK_MS_MAX, f"seed {seed}: acknowledged after {took_ms} ms"


@pytest.mark.timeout(60)
def test_the_simulator_catches_a_lazy_follower_that_is_never_fed(monkeypatch):
    """A ``_feed`` that sends nothing (it notes the feed, so that its deadline passes): the lazy
    follower gets the write only when a heartbeat resends it (every 30 ms here), and the bound above
    catches that. (One that notes nothing either leaves the sequencer's deadline passed after a tick,
    which the simulator's own check catches.)"""

    def starving(self, peer, progress):
        progress.fed_ms = self._now_ms

    monkeypatch.setattr(ShardConsensus, "_feed", starving)
    delays = [_ack_after_the_eager_follower_goes_silent(seed)[0] for seed in range(0, 12, 2)]
    assert max(delays) > SILENT_EAGER_ACK_MS_MAX, delays


@pytest.mark.timeout(60)
def test_seeds_with_lazy_followers_feed_them():
    """The seeds' runs exercise the rule: the simulator counts the lazy feeds the sequencers made."""
    fed = 0
    original = ShardConsensus._feed

    def counting(self, peer, progress):
        nonlocal fed
        fed += 1
        original(self, peer, progress)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShardConsensus, "_feed", counting)
        lazy_seeds = [seed for seed in range(12) if sim_cluster.Simulation(seed, 3).config.lazy_feed_interval_ms]
        for seed in lazy_seeds[:3]:
            run_seed(seed)
    assert lazy_seeds and fed > 0
