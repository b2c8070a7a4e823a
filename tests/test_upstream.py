"""replicant.upstream.choose_upstream, rule by rule (see its module docstring)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from mnesite.replicant.upstream import choose_upstream, near_tie_agents
from mnesite.rlog.replication import JournalAnswer
from mnesite.rlog.types import TxKey

APPLIED = TxKey(2, 10)
AHEAD = TxKey(2, 20)


def age(committed: TxKey = AHEAD, hears: bool = True, agents: int = 0) -> JournalAnswer:
    return JournalAnswer(committed_key=committed, hears_sequencer=hears, agents=agents)


def choices(ages, applied=APPLIED, exclude=frozenset(), draws=200) -> Counter:
    rng = random.Random(1)
    return Counter(choose_upstream(ages, applied, rng, exclude) for _ in range(draws))


@pytest.mark.timeout(10)
def test_a_core_behind_the_applied_key_is_never_chosen_even_when_it_is_the_least_loaded():
    ages = {"behind": age(TxKey(2, 9), agents=0), "ahead": age(TxKey(2, 11), agents=500)}
    assert choices(ages) == Counter({"ahead": 200})


@pytest.mark.timeout(10)
def test_an_older_generation_is_behind_whatever_its_counter():
    ages = {"old": age(TxKey(1, 999), agents=0)}
    assert choose_upstream(ages, APPLIED, random.Random(0)) is None


@pytest.mark.timeout(10)
def test_a_core_exactly_at_the_applied_key_qualifies():
    assert choose_upstream({"core0": age(APPLIED)}, APPLIED, random.Random(0)) == "core0"


@pytest.mark.timeout(10)
def test_cores_that_did_not_answer_or_are_excluded_never_qualify():
    ages = {"silent": None, "failed": age(agents=0), "other": age(agents=300)}
    assert choices(ages, exclude=frozenset({"failed"})) == Counter({"other": 200})
    assert choose_upstream({"silent": None}, APPLIED, random.Random(0)) is None
    assert choose_upstream({}, APPLIED, random.Random(0)) is None


@pytest.mark.timeout(10)
def test_cores_that_hear_the_sequencer_are_preferred_over_less_loaded_ones():
    ages = {"cut_off": age(hears=False, agents=0), "hearing": age(hears=True, agents=400)}
    assert choices(ages) == Counter({"hearing": 200})


@pytest.mark.timeout(10)
def test_a_core_that_does_not_hear_the_sequencer_is_chosen_when_no_qualifying_core_does():
    ages = {"cut_off": age(hears=False), "behind_but_hearing": age(TxKey(2, 1), hears=True)}
    assert choices(ages) == Counter({"cut_off": 200})


@pytest.mark.timeout(10)
def test_the_fewest_agents_win_when_loads_differ_clearly():
    ages = {"busy": age(agents=50), "idle": age(agents=20), "busier": age(agents=90)}
    assert choices(ages) == Counter({"idle": 200})


@pytest.mark.timeout(10)
def test_ties_and_near_ties_are_broken_by_the_random_source():
    ages = {"a": age(agents=100), "b": age(agents=100 + near_tie_agents(100)), "c": age(agents=150)}
    counts = choices(ages, draws=400)
    assert set(counts) == {"a", "b"}
    assert min(counts.values()) > 100  # both get a fair share, not a fixed winner


@pytest.mark.timeout(10)
def test_the_same_random_state_gives_the_same_choice_whatever_the_mapping_order():
    ages = {f"core{i}": age(agents=i % 2) for i in range(5)}
    reversed_ages = dict(reversed(list(ages.items())))
    first = [choose_upstream(ages, APPLIED, random.Random(seed)) for seed in range(30)]
    second = [choose_upstream(reversed_ages, APPLIED, random.Random(seed)) for seed in range(30)]
    assert first == second
    assert len(set(first)) > 1


def test_a_replicant_forwards_writes_to_a_core_it_watches_else_to_any_core():
    from mnesite.replicant.upstream import write_target

    rng = random.Random(1)
    assert write_target([None, "core2", "core1"], ("core0", "core1", "core2"), rng) == "core2"
    drawn = {write_target([None], ("core0", "core1", "core2"), rng) for _ in range(50)}
    assert drawn == {"core0", "core1", "core2"}


@pytest.mark.timeout(10)
def test_a_write_goes_to_a_core_that_can_take_it_and_is_refused_only_when_none_can():
    """Regression: the watched core was chosen for every write although its queue was full or its
    send had just failed, and each write was refused while other cores were fine."""
    from mnesite.replicant.upstream import write_target

    rng = random.Random(1)
    cores = ("core0", "core1", "core2")
    assert write_target(["core2", "core1"], cores, rng, frozenset({"core2"})) == "core1"  # watched first
    drawn = {write_target(["core2"], cores, rng, frozenset({"core2"})) for _ in range(50)}
    assert drawn == {"core0", "core1"}
    assert write_target([None], cores, rng, frozenset({"core0", "core1"})) == "core2"
    # None can take it: chosen as if all could (the driver's send refuses it, saying why).
    assert write_target(["core2"], cores, rng, frozenset(cores)) == "core2"
    assert write_target([None], cores, rng, frozenset(cores)) in cores


@pytest.mark.parametrize(
    "result",
    [
        None,
        [],
        {"shards": []},
        {"shards": {"s": []}},
        {"shards": {"s": {"committed": "x", "hears_sequencer": True, "agents": 0}}},
        {"shards": {"s": {"committed": [1, 2], "hears_sequencer": 1, "agents": 0}}},
        {"shards": {"s": {"committed": [1, 2], "hears_sequencer": True, "agents": -1}}},
        {"shards": {"s": {"committed": [1, 2], "hears_sequencer": True, "agents": True}}},
        {"shards": {"other": {"committed": [1, 2], "hears_sequencer": True, "agents": 0}}},
    ],
)
def test_a_malformed_journal_answer_counts_as_no_answer(result):
    from mnesite.rlog.replication import journal_answer

    assert journal_answer(result, "s") is None


def test_a_journal_answer_is_read_from_the_cores_reply():
    from mnesite.rlog.replication import journal_answer

    reply = {"shards": {"s": {"committed": [3, 4], "hears_sequencer": False, "agents": 2, "generation": 3}}}
    assert journal_answer(reply, "s") == JournalAnswer(TxKey(3, 4), False, 2)
