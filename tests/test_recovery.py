"""``core.recovery``: what a core decides from its peers' journal answers (generation recovery, force start)."""

from __future__ import annotations

import pytest
from mnesite.core.consensus import GENERATION_MAX
from mnesite.core.recovery import (
    journal_generation,
    reached_generations,
    reached_last_keys,
    recovered_generations,
    vote_recovered,
    well_formed_answers,
)
from mnesite.rlog.schema import INTEGER_MAX
from mnesite.rlog.types import TxKey


def test_a_core_with_a_lost_disk_recovers_the_highest_generation_any_peer_knows_per_shard():
    answers = {
        "core2": {"shards": {"default": {"generation": 7}, "other": {"generation": 1}}},
        "core3": {"shards": {"default": {"generation": 9}}},
    }
    assert recovered_generations(answers) == {"default": 9, "other": 1}


def test_no_answer_recovers_nothing():
    assert recovered_generations({}) == {}


@pytest.mark.parametrize("generation", [2**63, 2**63 - 1, -1, "7", True, None, 7.0])
def test_one_malformed_generation_drops_the_whole_answer(generation):
    answers = {
        "core2": {"shards": {"default": {"generation": 3}, "other": {"generation": generation}}},
        "core3": {"shards": {"default": {"generation": 2}}},
    }
    assert well_formed_answers(answers) == {"core3": answers["core3"]}
    # core2's 3 is not believed either: its answer as a whole is untrusted.
    assert recovered_generations(answers) == {"default": 2}


@pytest.mark.parametrize("answer", [None, [], {"shards": []}, {"shards": {"default": [7]}}, {}])
def test_an_answer_that_is_not_a_journal_counts_as_not_reached(answer):
    assert well_formed_answers({"core2": answer}) == {}


def test_a_hostile_shard_name_never_becomes_a_shard():
    answers = {"core2": {"shards": {"a" * 500: {"generation": 9}, "_mnesite_x": {"generation": 4}, "ok": {}}}}
    # "ok" states no generation: malformed, so the whole answer goes.
    assert recovered_generations(answers) == {}
    answers = {"core2": {"shards": {"a" * 500: {"generation": 9}, "ok": {"generation": 4}}}}
    assert recovered_generations(answers) == {"ok": 4}


def test_a_forced_start_is_told_every_reached_peer_in_name_order_with_0_for_an_unknown_shard():
    answers = {"core3": {"shards": {"default": {"generation": 5}}}, "core2": {"shards": {}}}
    assert reached_generations(answers, "default") == (("core2", 0), ("core3", 5))
    assert journal_generation(answers["core2"], "default") == 0


def test_a_forced_start_is_told_the_last_key_of_every_reached_peer_that_says_it():
    """The machine refuses a forced start while a reached member holds more of the log; a peer whose
    answer gives no well-formed last key for the shard is weighed as holding nothing there."""
    answers = {
        "core4": {"shards": {"default": {"generation": 2, "last": [2, 9]}}},
        "core2": {"shards": {"default": {"generation": 1, "last": [1, 3]}, "other": {"generation": 1}}},
        "core3": {"shards": {"default": {"generation": 1, "last": [1, "x"]}}},
        "core5": {"shards": {"default": {"generation": -1, "last": [9, 9]}}},  # malformed: not reached
        "core6": {"shards": {}},
    }
    assert reached_last_keys(answers, "default") == (("core2", TxKey(1, 3)), ("core4", TxKey(2, 9)))
    assert reached_last_keys(answers, "other") == ()


def test_a_recovered_generation_leaves_room_for_a_campaign():
    """A peer's journal is held to the bound of a consensus message's generation: a core that recovered
    2**63 - 1 persisted it, and its first campaign asked SQLite for 2**63."""
    answers = {"core2": {"shards": {"default": {"generation": GENERATION_MAX}}}}
    assert recovered_generations(answers) == {"default": GENERATION_MAX}
    assert GENERATION_MAX + 1 <= INTEGER_MAX
    assert recovered_generations({"core2": {"shards": {"default": {"generation": GENERATION_MAX + 1}}}}) == {}


def test_a_core_with_a_lost_disk_takes_the_highest_log_key_any_peer_reports_as_its_vote_floor():
    from mnesite.core.recovery import recovered_vote_floors
    from mnesite.rlog.types import TxKey

    answers = {
        "core2": {"shards": {"default": {"generation": 3, "committed": [3, 7], "last": [3, 9]}}},
        "core3": {
            "shards": {
                "default": {"generation": 3, "committed": [3, 8], "last": [3, 8]},
                "other": {"generation": 1, "committed": [1, 2], "last": "junk"},  # a malformed key adds nothing
                "bad name!": {"generation": 1, "committed": [1, 5], "last": [1, 5]},
            }
        },
        "core4": {"shards": {"default": {"generation": 2**63, "last": [9, 9]}}},  # malformed: not reached
    }
    assert recovered_vote_floors(answers) == {"default": TxKey(3, 9), "other": TxKey(1, 2)}
    assert recovered_vote_floors({}) == {}
    hostile = {"core2": {"shards": {"default": {"generation": 1, "last": [True, 1], "committed": [1, -1]}}}}
    assert recovered_vote_floors(hostile) == {}


def test_a_rebuilt_member_needs_answers_from_every_other_member():
    """The vote it cast before its loss may be known only to its candidate: every other member must
    answer (n - majority + 1 would do for the floor, not for the votes: ``test_simulation.py``)."""
    from mnesite.core.recovery import recovery_shortfall

    history = {"generation": 3, "last": [3, 4]}
    three = ("core1", "core2", "core3")
    assert recovery_shortfall({"core2": {"shards": {"default": history}}}, three, "core1") == 1
    both = {"core2": {"shards": {"default": history}}, "core3": {"shards": {"default": history}}}
    assert recovery_shortfall(both, three, "core1") == 0
    five = ("core1", "core2", "core3", "core4", "core5")
    answers = {peer: {"shards": {"default": history}} for peer in ("core2", "core3")}
    assert recovery_shortfall(answers, five, "core1") == 2
    answers["core9"] = {"shards": {"default": history}}  # not a member: does not count
    assert recovery_shortfall(answers, five, "core1") == 2
    answers["core4"] = {"shards": {"default": history}}
    assert recovery_shortfall(answers, five, "core1") == 1, "n - majority + 1 answered: not enough"
    answers["core5"] = {"shards": {"default": {"generation": 0}}}  # a member that never saw an election counts
    assert recovery_shortfall(answers, five, "core1") == 0
    # A new cluster (no generation in use anywhere, or nobody answered) and a learner wait for nobody.
    assert recovery_shortfall({"core2": {"shards": {"default": {"generation": 0}}}}, three, "core1") == 0
    assert recovery_shortfall({}, three, "core1") == 0
    assert recovery_shortfall({"core2": {"shards": {"default": history}}}, three, "core4") == 0
    # A malformed answer counts as not reached.
    assert recovery_shortfall({"core2": {"shards": {"default": {"generation": -1}}}, **both}, three, "core1") == 0
    assert recovery_shortfall({"core2": {"shards": {"default": {"generation": "x"}}}}, three, "core1") == 0


def test_a_core_declared_existing_waits_for_every_other_member_even_when_none_saw_an_election():
    """``[cluster] initial_cluster_state = "existing"``: a rebuilt core that reaches only cores that
    never saw an election (or none) does not take them for a new cluster; "new" (the default) does."""
    from mnesite.core.recovery import recovery_shortfall

    three = ("core1", "core2", "core3")
    fresh = {"core2": {"shards": {"default": {"generation": 0}}}}
    assert recovery_shortfall(fresh, three, "core1") == 0
    assert recovery_shortfall(fresh, three, "core1", existing=True) == 1
    assert recovery_shortfall({}, three, "core1", existing=True) == 2
    every = {**fresh, "core3": {"shards": {}}}  # every other member answered: nothing was ever elected
    assert recovery_shortfall(every, three, "core1", existing=True) == 0
    assert recovery_shortfall({}, three, "core4", existing=True) == 0, "a learner holds no vote and no entry"
    assert recovery_shortfall({}, ("core1",), "core1", existing=True) == 0, "a single core has no one to hear"


@pytest.mark.parametrize(
    ("own_generation", "own_voted_for", "recovered", "persisted"),
    [
        (0, None, 7, True),  # an empty database: every generation in use may have had its vote
        (3, "core2", 7, True),  # a backup behind the peers
        (7, None, 7, True),  # a backup of generation 7 taken before its vote: the vote may be lost
        (7, "core2", 7, False),  # its vote in 7 is on record: the only one it could have cast
        (7, "core1", 7, False),
        (8, None, 7, False),  # past what the peers know: nothing to recover
    ],
)
def test_a_recovered_generation_counts_the_vote_in_it_as_cast_unless_one_is_on_record(
    own_generation, own_voted_for, recovered, persisted
):
    assert vote_recovered(own_generation, own_voted_for, recovered) is persisted


def test_a_recovering_core_says_whom_it_waits_for_and_why():
    """``status``'s ``recovery`` section (``recovery_answer``): until an answer shows history (or the
    cluster is declared existing) the core waits for the members it asked, not knowing how many it
    needs; once one does, for every other member; the ``not_ready`` refusal names them."""
    from mnesite.core.recovery import RecoveryProgress, recovering_refusal, recovery_answer

    three = ("core1", "core2", "core3")
    progress = RecoveryProgress("core1", three, False, started_ms=1000, rounds_max=10, round_timeout_ms=500)
    progress.round, progress.asked = 1, ("core2", "core3")
    fresh = recovery_answer(progress, 1250)
    assert (fresh.phase, fresh.round, fresh.elapsed_ms, fresh.needed) == ("asking", 1, 250, None)
    assert fresh.waiting_for == ["core2", "core3"] and fresh.answered == []
    assert "whether the cluster has history" in fresh.reason and "round 1 of 10" in fresh.reason
    progress.answers = {"core2": {"shards": {"default": {"generation": 4}}}, "core3": "garbage"}
    progress.phase = "waiting"
    history = recovery_answer(progress, 1600)
    assert (history.needed, history.answered, history.waiting_for) == (1, ["core2"], ["core3"])
    assert "every other member must answer" in history.reason and "round 2 of 10" in history.reason
    refusal = recovering_refusal("core1", history)
    assert "recovering at start-up" in refusal and "waiting for core3" in refusal and "status" in refusal
    declared = RecoveryProgress("core1", three, True, started_ms=0, rounds_max=10, round_timeout_ms=500)
    assert recovery_answer(declared, 0).waiting_for == ["core2", "core3"] and recovery_answer(declared, 0).needed == 2


def test_a_member_that_refused_this_cores_key_or_was_full_is_named_with_what_to_do():
    """A member that refused a recovering core's connection at its handshake will not answer until an
    operator acts: ``refusal_notes`` says, for each silent member that did, which (this core's key not
    authorized there, or it held its connections_max) and what to do; ``status``'s reason says it too."""
    from mnesite.core.recovery import RecoveryProgress, recovery_answer, refusal_notes
    from mnesite.rlog.errors import REFUSED_FULL, REFUSED_KEY

    refusals = {"core2": REFUSED_KEY, "core3": REFUSED_FULL, "core5": REFUSED_KEY}
    notes = refusal_notes(["core4", "core3", "core2"], refusals, "core1")  # core5 answered: not silent
    assert notes == [
        "core2 refused this core's key: authorize it there (copy the public key file of core1's [security] "
        "client_key into core2's authorized_keys) and send core2 SIGHUP",
        "core3 refused this core's connection: it holds its [limits] connections_max connections",
    ]
    assert refusal_notes(["core4"], refusals, "core1") == [] and refusal_notes([], refusals, "core1") == []

    three = ("core1", "core2", "core3")
    progress = RecoveryProgress("core1", three, True, started_ms=0, rounds_max=10, round_timeout_ms=500)
    progress.round, progress.phase, progress.asked = 1, "waiting", ("core2", "core3")
    progress.answers, progress.refusals = {"core3": {"shards": {}}}, {"core2": REFUSED_KEY}
    answer = recovery_answer(progress, 0)
    assert answer.waiting_for == ["core2"] and "core2 refused this core's key" in answer.reason
    assert "send core2 SIGHUP" in answer.reason and answer.reason.endswith("asking again in round 2 of 10")
    progress.refusals = {"core3": REFUSED_KEY}  # refused in an earlier attempt, answered now: not named
    assert "refused" not in recovery_answer(progress, 0).reason
    fresh = RecoveryProgress("core1", three, False, started_ms=0, rounds_max=10, round_timeout_ms=500)
    fresh.asked, fresh.refusals = ("core2", "core3"), {"core3": REFUSED_FULL}
    assert "core3 refused this core's connection" in recovery_answer(fresh, 0).reason


def test_a_core_whose_peers_refused_it_says_so_at_start_not_that_it_is_a_core_of_a_new_cluster():
    """Regression: a core being added with ``[security]`` whose key the cores do not authorize yet
    heard no peer, and logged that it started "as a core of a new cluster": its peers refused its
    key and said nothing about the cluster's history. ``unrecovered_start`` names each refusal and
    what to do (a warning); only with no refusal among the silent peers is it a new cluster's core."""
    from mnesite.core.recovery import unrecovered_start
    from mnesite.rlog.errors import REFUSED_FULL, REFUSED_KEY

    warn, said = unrecovered_start([], ["core2", "core3"], {"core2": REFUSED_KEY, "core3": REFUSED_FULL}, "core4")
    assert warn and "new cluster" not in said
    assert said.startswith("empty database: peers refused this core's connection, so it cannot tell whether")
    assert (
        "core2 refused this core's key: authorize it there (copy the public key file of core4's [security] "
        "client_key into core2's authorized_keys) and send core2 SIGHUP; "
        "core3 refused this core's connection: it holds its [limits] connections_max connections" in said
    )
    assert "a core being added needs no restart" in said and 'initial_cluster_state = "existing"' in said
    # One refused, one answered without history: still said (the refusing one may hold the history).
    warn, said = unrecovered_start(["core3"], ["core2"], {"core2": REFUSED_KEY}, "core4")
    assert warn and "answers from ['core3']" in said and "core2 refused this core's key" in said
    # No refusal (or one from a peer that answered since): a new cluster's core, as before (info).
    for silent, refusals in (([], {}), (["core2"], {}), (["core2"], {"core3": REFUSED_KEY})):
        warn, said = unrecovered_start(["core3"], silent, refusals, "core4")
        assert not warn and "starting as a core of a new cluster" in said and "refused" not in said
