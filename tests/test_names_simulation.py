"""Table and index names across shards, at simulated nodes over the real store (see tests/sim/names.py).

CI runs ``CI_SEEDS`` seeds, ``make test-fast`` the first ``FAST_SEEDS`` (the others are marked deep).
Replay one seed with ``MNESITE_SIM_SEED=12 .venv/bin/pytest tests/test_names_simulation.py -k seed_12``;
run more locally with ``MNESITE_NAMES_SIM_SEEDS=2000``.
"""

from __future__ import annotations

import re

import pytest
from mnesite.rlog import schema
from mnesite.rlog import store as store_module
from mnesite.rlog.schema import LifetimeSkip
from mnesite.rlog.store import Store

from tests.conftest import simulation_seeds
from tests.sim import SimulationFailure
from tests.sim.names import run_names_seed

CI_SEEDS = 40
FAST_SEEDS = 10  # the developers' fast lane runs these; the others are marked deep


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_NAMES_SIM_SEEDS", FAST_SEEDS))
def test_seed(seed: int) -> None:
    simulation = run_names_seed(seed)
    assert len(simulation.history.entries) >= 20 and simulation.turns >= 3 * 20


@pytest.mark.timeout(30)
def test_the_seeds_make_shards_wait_restart_nodes_and_take_both_paths() -> None:
    """Or the seeds above checked nothing of the rule."""
    simulations = [run_names_seed(seed) for seed in range(FAST_SEEDS)]
    assert sum(len(s.waits_met) for s in simulations) >= 15
    assert sum(bool(s.waits_met) for s in simulations) >= FAST_SEEDS // 2
    assert sum(s.restarts for s in simulations) >= 20
    met_at = {node.rstrip("0123456789") for s in simulations for node, _, _ in s.waits_met}
    assert met_at == {"core", "replicant"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(5))
def test_creates_of_one_name_in_two_shards_wait_and_never_stop_a_node(seed: int) -> None:
    """Shards a and b each create one name without seeing the other's create: every node applies one
    of them and waits, visibly, at the other (never ``EntryApplyError``); the rest goes on."""
    simulation = run_names_seed(seed, "concurrent", remedy=False)
    assert simulation.waits_met, "both creates reached every node: one of them waits"
    assert all("drop it in shard" in text for text in simulation.waits_seen)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(5))
def test_creates_of_one_name_in_two_shards_converge_once_an_operator_drops_one(seed: int) -> None:
    """The documented remedy: the name dropped in one of the two shards. Nodes where the kept shard
    waited apply its create once the drop applies; nodes where the dropped shard waited skip its
    create's lifetime (``rlog.schema.lifetime_end``) once its drop committed."""
    run_names_seed(seed, "concurrent", remedy=True)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", simulation_seeds(CI_SEEDS, "MNESITE_NAMES_SIM_SEEDS", FAST_SEEDS))
def test_any_sequencer_correct_history_converges(seed: int) -> None:
    """``free``: a name created by a shard after another shard dropped it may be applied first at a
    node; the older create's shard skips the name's lifetime once its drop committed."""
    run_names_seed(seed, "free")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", [6, 7, 8])
def test_the_remedy_converges_where_the_dropped_shard_waited(seed: int) -> None:
    """``concurrent`` with the remedy, at seeds where a node applied the kept shard's create first:
    the dropped shard's create, writes and drop are skipped there (its lifetime of the name)."""
    run_names_seed(seed, "concurrent", remedy=True)


@pytest.mark.timeout(30)
def test_the_simulation_catches_a_name_held_elsewhere_taken_as_free(monkeypatch) -> None:
    """Mutation: the apply's rule finds no name held by another shard: the create meets SQLite's
    table of that name and the node stops."""
    monkeypatch.setattr(store_module, "name_held_elsewhere", lambda catalog, shard, ops: None)
    with pytest.raises(SimulationFailure, match=r"seed 0 .*the store stopped the node: .*cannot be applied"):
        run_names_seed(0)


@pytest.mark.timeout(30)
def test_the_simulation_catches_a_waiting_shard_never_tried_again(monkeypatch) -> None:
    """Mutation: ``name_wait_due`` is never true: a shard waits on once its name was let go."""
    monkeypatch.setattr(Store, "name_wait_due", lambda self, shard: False)
    with pytest.raises(SimulationFailure, match=r"seed 0 .*waits at .* which no other shard holds here"):
        run_names_seed(0)


# Mutations of the lifetime skip (``rlog.schema.lifetime_end``, ``may_end_lifetime``): each is caught
# within ``MUTATION_SEEDS`` seeds of one mode (a tenth of a second each).
MUTATION_SEEDS = 10


def _first_failure(mode: str) -> str:
    for seed in range(MUTATION_SEEDS):
        try:
            run_names_seed(seed, mode)
        except SimulationFailure as failure:
            return str(failure)
    raise AssertionError(f"the mutation survived seeds 0..{MUTATION_SEEDS - 1} of {mode}")


def _mutate_span(monkeypatch, end_shift: int) -> None:
    """``lifetime_end`` ends its span ``end_shift`` entries after the lifetime's drop (before it if
    negative): the entries taken in are skipped whole, those left out applied as usual."""
    lifetime_end = schema.lifetime_end

    def shifted(catalog, shard, entries, start):
        skip = lifetime_end(catalog, shard, entries, start)
        end = skip.end + end_shift if isinstance(skip, LifetimeSkip) else -1
        if not start <= end < len(entries):
            return skip  # nothing to mutate here
        ops = (*skip.ops, *((),) * end_shift)[: end - start + 1]
        return LifetimeSkip(end, ops, tuple(drop for drop in skip.dropped if drop[0] <= end))

    monkeypatch.setattr(store_module, "lifetime_end", shifted)


@pytest.mark.timeout(30)
def test_the_simulation_catches_a_lifetime_span_that_ends_before_the_drop(monkeypatch) -> None:
    """Mutation: the span stops one entry short: the drop is applied as usual, of a name another
    shard holds here, and the node stops."""
    _mutate_span(monkeypatch, -1)
    assert "the store stopped the node" in _first_failure("exclusive")


@pytest.mark.timeout(30)
def test_the_simulation_catches_a_lifetime_span_that_ends_after_the_drop(monkeypatch) -> None:
    """Mutation: the span runs one entry past the drop and skips it: a node stops at what follows,
    or ends unlike the reference."""
    _mutate_span(monkeypatch, 1)
    assert re.search(r"the store stopped the node|differ", _first_failure("exclusive"))


@pytest.mark.timeout(30)
def test_the_simulation_catches_a_lifetime_skipped_before_its_drop_commits(monkeypatch) -> None:
    """Mutation: a waiting shard looks for the end of the lifetime in its log past the commit (a
    core's appended, uncommitted tail) too, and applies the span through an uncommitted drop: the
    check that no shard applies past the commit its node heard fails (the simulation's cores hear
    commits behind their appends since this test was written; before, the mutation survived)."""
    before_name_wait = Store._before_name_wait

    def looking_past_the_commit(self, shard, entries):
        ready = before_name_wait(self, shard, entries)
        if shard not in self.name_waits or not entries:
            return ready
        uncommitted = self.entries_after(shard, entries[-1].tx_key, 1000)
        return before_name_wait(self, shard, [*entries, *uncommitted]) if uncommitted else ready

    monkeypatch.setattr(Store, "_before_name_wait", looking_past_the_commit)
    assert "past the commit it heard" in _first_failure("exclusive")


@pytest.mark.timeout(30)
def test_the_simulation_catches_a_waiting_shard_not_looked_at_when_its_drop_commits(monkeypatch) -> None:
    """Mutation: ``may_end_lifetime`` is never true: a core's waiting shard is not tried again when
    the drop that ends its name's lifetime commits, and waits on. Only ``free`` histories let a
    create be applied ahead of an older shard's lifetime of the name."""
    monkeypatch.setattr(store_module, "may_end_lifetime", lambda ops: False)
    assert "waits left once every entry was delivered" in _first_failure("free")
