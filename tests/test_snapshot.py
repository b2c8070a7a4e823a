"""core.snapshot: which offers a follower takes, the install's stages in order, abandon and the read fence."""

from __future__ import annotations

import pytest
from mnesite.core.snapshot import (
    BeginInstall,
    FenceReached,
    FinishInstall,
    InstallAbandoned,
    InstallMode,
    SnapshotInstall,
    SnapshotOffer,
    accept_offer,
)
from mnesite.rlog.replication import (
    ApplyBatch,
    BatchReceived,
    CommittedReceived,
    FetchBatch,
    FetchCommitted,
    FetchTables,
    RequestFailed,
    TablesReceived,
    Ticked,
)
from mnesite.rlog.types import TxKey

pytestmark = pytest.mark.timeout(10)

OFFER = SnapshotOffer("core1", 3, TxKey(3, 50), b"d" * 32)


def test_only_the_known_sequencer_in_this_generation_beyond_the_applied_key_and_one_at_a_time():
    assert accept_offer(OFFER, 3, "core1", TxKey(2, 9), installing=False) is None
    assert "known sequencer" in accept_offer(OFFER, 4, "core1", TxKey(2, 9), installing=False)
    assert "known sequencer" in accept_offer(OFFER, 3, "core2", TxKey(2, 9), installing=False)
    assert "not beyond" in accept_offer(OFFER, 3, "core1", TxKey(3, 50), installing=False)
    assert "under way" in accept_offer(OFFER, 3, "core1", TxKey(2, 9), installing=True)


def test_an_install_begins_copies_finishes_then_waits_for_the_fence():
    install = SnapshotInstall(OFFER, 2, 1000, 0)
    assert install.start() == [BeginInstall(OFFER.key, OFFER.digest), FetchTables("core1")]
    applied = TxKey(2, 9)
    effects = install.step(TablesReceived("core1", ("t",), ("k",)), applied, 1)
    assert effects == [FetchBatch("core1", "t", None, 2)]
    rows = ({"k": 1}, {"k": 2})
    effects = install.step(BatchReceived("core1", "t", None, rows, False, 3), applied, 2)
    assert effects == [FetchBatch("core1", "t", 2, 2), ApplyBatch("t", rows)]
    effects = install.step(BatchReceived("core1", "t", 2, ({"k": 3},), True), applied, 3)
    assert effects == [
        ApplyBatch("t", ({"k": 3},)),
        FinishInstall(OFFER.key, OFFER.digest),
        FetchCommitted("core1", 1),
    ]
    assert install.mode is InstallMode.FENCED and not install.serving
    assert install.step(CommittedReceived("core1", TxKey(3, 60), 1), OFFER.key, 4) == []
    assert install.step(Ticked(), TxKey(3, 59), 5) == []
    assert install.step(Ticked(), TxKey(3, 60), 6) == [FenceReached()]
    assert install.mode is InstallMode.DONE and install.serving


def test_no_answer_or_a_failed_request_abandons_the_install():
    install = SnapshotInstall(OFFER, 2, 1000, 0)
    install.start()
    assert install.step(Ticked(), TxKey(2, 9), 999) == []
    assert install.step(Ticked(), TxKey(2, 9), 1000) == [InstallAbandoned("no answer from core1 for 1000 ms")]
    assert not install.serving
    other = SnapshotInstall(OFFER, 2, 1000, 0)
    other.start()
    assert isinstance(other.step(RequestFailed("core1", "boom"), TxKey(2, 9), 1)[0], InstallAbandoned)


def test_a_malformed_batch_abandons_and_a_stale_one_is_ignored():
    install = SnapshotInstall(OFFER, 2, 1000, 0)
    install.start()
    install.step(TablesReceived("core1", ("t",), ("k",)), TxKey(2, 9), 1)
    assert install.step(BatchReceived("core1", "t", 7, ({"k": 8},), True), TxKey(2, 9), 2) == []
    effects = install.step(BatchReceived("core1", "t", None, ({"v": 1},), True), TxKey(2, 9), 3)
    assert len(effects) == 1 and "without its key column" in effects[0].reason


def test_a_fence_whose_answer_was_lost_is_asked_again_and_a_restart_fences_again():
    install = SnapshotInstall.fenced("core2", 1000, 0)
    assert install.step(Ticked(), TxKey(3, 1), 0) == [FetchCommitted("core2", 1)]
    assert install.step(Ticked(), TxKey(3, 1), 500) == []
    assert install.step(CommittedReceived("core2", None, 1), TxKey(3, 1), 600) == [FetchCommitted("core2", 2)]
    assert install.step(CommittedReceived("core3", TxKey(3, 1), 1), TxKey(3, 1), 700) == [], "question 1's: stale"
    assert install.step(CommittedReceived("core3", TxKey(3, 1), 2), TxKey(3, 1), 700) == [FenceReached()]


def test_a_snapshot_is_offered_only_to_a_follower_heard_within_the_window():
    from mnesite.core.snapshot import offer_due

    assert offer_due(1000, 1500, 500) and not offer_due(1000, 1501, 500)
    assert not offer_due(None, 0, 500)  # never heard: it may be down


def test_a_follower_whose_rows_an_abandoned_install_deleted_takes_an_offer_at_its_applied_key():
    """An abandoned install left the rows half copied while the position stayed: an offer at the
    applied key heals them too (but one behind it would take the applied state back)."""
    at_applied = accept_offer(OFFER, 3, "core1", OFFER.key, installing=False, rows_lost=True)
    assert at_applied is None
    assert "not beyond" in accept_offer(OFFER, 3, "core1", OFFER.key, installing=False)
    assert "not beyond" in accept_offer(OFFER, 3, "core1", TxKey(3, 51), installing=False, rows_lost=True)


def test_a_follower_whose_rows_are_lost_asks_its_sequencer_for_an_offer_now_and_then():
    from mnesite.core.snapshot import SNAPSHOT_REQUEST_INTERVAL_MS, snapshot_request_due

    assert snapshot_request_due(True, False, "core1", "core2", None, 0)
    assert not snapshot_request_due(False, False, "core1", "core2", None, 0)  # its rows are whole
    assert not snapshot_request_due(True, True, "core1", "core2", None, 0)  # an install is under way
    assert not snapshot_request_due(True, False, None, "core2", None, 0)  # no sequencer known
    assert not snapshot_request_due(True, False, "core2", "core2", None, 0)  # itself
    assert not snapshot_request_due(True, False, "core1", "core2", 0, SNAPSHOT_REQUEST_INTERVAL_MS - 1)
    assert snapshot_request_due(True, False, "core1", "core2", 0, SNAPSHOT_REQUEST_INTERVAL_MS)


@pytest.mark.timeout(60)
def test_a_core_whose_rows_an_abandoned_install_deleted_is_never_force_started(tmp_path, monkeypatch) -> None:
    """Regression: a core whose install was abandoned (its rows half copied: ``rows_lost``) does not
    campaign, but a forced start made it sequencer all the same: it then executed transactions and
    evaluated guards against half-copied rows (wrong rows committed for good), and, being the
    sequencer, was never offered the snapshot that would heal them. The consensus now refuses, saying
    why (``ForceStartRequested.rows_lost``), so the operator force-starts a core whose rows are whole."""
    from mnesite.rlog.errors import RequestError

    from tests.conftest import follower_by_hand

    with follower_by_hand(tmp_path / "data") as (node, driver):
        node.rows_lost.add("default")  # as an abandoned install leaves it (BeginInstall, then InstallAbandoned)
        monkeypatch.setattr(node, "probe_peers", lambda timeout_ms: {})  # no other core answers
        with pytest.raises(RequestError, match="half copied") as refused:
            node.force_start()
        assert refused.value.code == "force_start_refused"
        assert driver.consensus.sequencer is None and driver.consensus.generation == 0
        node.rows_lost.discard("default")  # an install healed it: the operator's override is taken
        assert node.force_start()["node"] == "core1"
        assert driver.consensus.sequencer == "core1"


@pytest.mark.timeout(60)
def test_a_fenced_install_whose_own_core_is_sequencer_reaches_its_fence_without_a_crash(tmp_path) -> None:
    """Regression: a core that installed a snapshot (fenced: reads wait for the committed key) may be
    elected sequencer before its fence is reached. It then answers its own fence question at once
    (``FetchCommitted`` to itself), inside the step that asked: that inner step reached the fence and
    removed the install, and the outer step removed it again: ``KeyError`` out of the loop, the core
    stopped, and with ``read_fenced`` still on disk it did so again at each election it won."""
    from mnesite.core.snapshot import SnapshotInstall

    from tests.conftest import core_with_table

    with core_with_table(tmp_path / "data") as node:
        # As a restart between FinishInstall and the fence leaves it (CoreNode.__init__).
        node.installs["default"] = SnapshotInstall.fenced("core1", 60_000, node.clock_ms())
        node.not_serving["default"] = "replaying after a snapshot install"
        node.begin()
        node.store.set_meta("read_fenced:default", 1)
        node.run_turn()
        assert "default" not in node.installs and "default" not in node.not_serving
        assert node.store.meta("read_fenced:default") in (0, "0")


def test_an_install_takes_the_shard_s_tables_as_listed_even_after_a_drop_or_a_re_creation(tmp_path) -> None:
    """A follower far enough behind to install a snapshot may hold a table of the shard the cores
    dropped since, or dropped and created again with another key. The install only added the listed
    columns and indexes to what it held: the dropped table stayed, and the re-created one kept its old
    key, so its copied rows were stored under keys SQLite made up and a read by their key found nothing."""
    from mnesite.rlog import messages
    from mnesite.rlog.schema import define_table

    from tests.conftest import follower_by_hand

    with follower_by_hand(tmp_path / "data") as (node, _driver):
        old = define_table("t", "k", [["k", "INTEGER"], ["v", "TEXT"]])
        node.store.apply_ops((old.to_op(), define_table("gone", "k", [["k", "INTEGER"]]).to_op()))
        install = SnapshotInstall(SnapshotOffer("core2", 1, TxKey(1, 9), b"d" * 32), 100, 60_000, node.clock_ms())
        node.installs["default"] = install
        created_again = define_table("t", "id", [["id", "TEXT"], ["w", "BLOB"]])
        answer = messages.reply("r1", [created_again.to_json()])
        node._on_install_answer(("default", "tables", {}, 0, install), answer)
        assert node.store.catalog() == {"t": created_again}


@pytest.mark.parametrize("value", ["text", [1], {"a": 1}, 2**63])
def test_a_snapshot_batch_row_the_listed_table_cannot_hold_abandons_the_install_not_the_core(tmp_path, value) -> None:
    """A batch's rows come from a peer, and a table dropped and created again with other column types
    after ``list_tables`` sends values the listed (STRICT) table refuses: ``store.write_rows`` raised
    out of the turn and stopped the core. The batch is checked first (``bootstrap.copy.rows_refusal``,
    as a replicant's copy does) and the install is abandoned, saying why; nothing is written."""
    from mnesite.rlog import messages
    from mnesite.rlog.schema import define_table

    from tests.conftest import follower_by_hand

    with follower_by_hand(tmp_path / "data") as (node, _driver):
        install = SnapshotInstall(SnapshotOffer("core2", 1, TxKey(1, 9), b"d" * 32), 100, 60_000, node.clock_ms())
        node.installs["default"] = install
        listed = define_table("t", "k", [["k", "INTEGER"], ["v", "INTEGER"]])
        node._on_install_answer(("default", "tables", {}, 0, install), messages.reply("r1", [listed.to_json()]))
        rows = [{"k": 1, "v": 2}, {"k": 2, "v": value}]
        answer = messages.reply("r2", {"rows": rows, "done": True, "rows_total": 2})
        node._on_install_answer(("default", "batch", {"table": "t", "after": None}, 0, install), answer)
        assert install.mode is InstallMode.ABANDONED
        assert "default" not in node.installs
        assert node.store.count_rows(node.store.catalog()["t"]) == 0


def test_a_changefeed_request_held_at_a_core_is_answered_as_soon_as_a_snapshot_install_of_its_shard_begins(
    tmp_path,
) -> None:
    """A ``changes`` request held at a core (caught up, waiting for its shard to move) waited out its
    whole ``wait_ms`` when the core began installing a snapshot of the shard: ``BeginInstall`` deletes
    the rows and keeps the applied key, so nothing woke it until the copy was done, although a request
    asked meanwhile is refused at once (``not_ready``). It is now answered in the turn the install
    begins, with that same answer. Once the read fence is reached the shard serves again, and a request
    held then waits for the shard to move, as before."""
    from mnesite.rlog.errors import RequestError

    from tests.conftest import changes_of_default as changes
    from tests.conftest import follower_by_hand
    from tests.conftest import queued_to as answers

    with follower_by_hand(tmp_path / "data") as (node, _driver):
        node._dispatch([b"held"], changes("held-1", node.store.shard("default").applied))
        node.serve_changes()
        assert node.changes_statistics()["held"] == 1 and not answers(node, [b"held"])
        install = SnapshotInstall(SnapshotOffer("core2", 1, TxKey(1, 9), b"d" * 32), 100, 60_000, node.clock_ms())
        node.installs["default"] = install
        node._execute_install("default", install.start())
        node.serve_changes()
        (answer,) = answers(node, [b"held"])
        assert node.changes_statistics()["held"] == 0
        with pytest.raises(RequestError) as now:  # what a request asked now gets
            node._dispatch([b"now"], changes("asked-now", node.store.shard("default").applied))
        assert (answer.request_id, answer.kind, answer.body.code) == ("held-1", "error", "not_ready")
        assert answer.body.message == str(now.value) and "installing a snapshot" in answer.body.message
        # The copy (no table) is done, then the read fence is reached: the shard serves again.
        node._step_install("default", TablesReceived("core2", (), ()))
        assert install.mode is InstallMode.FENCED
        node._step_install("default", CommittedReceived("core2", TxKey(1, 9), install._fence.question))
        assert install.mode is InstallMode.DONE and node._not_serving_reason("default") is None
        node._dispatch([b"after"], changes("after-1", node.store.shard("default").applied))
        node.serve_changes()
        assert node.changes_statistics()["held"] == 1 and not answers(node, [b"after"])


def test_an_install_says_which_snapshot_from_whom_and_why_its_fence_is_not_known_yet():
    """The install's words for a refused read named no sequencer, said no 'retry later', and an ask of
    its fence key that was refused left no reason, where a replicant's read fence keeps one."""
    install = SnapshotInstall(OFFER, 2, 1000, 0)
    install.start()
    under_way = install.not_serving_reason()
    assert under_way == "installing a snapshot at (3, 50) from core1 (0 rows copied so far); retry later"
    install.step(TablesReceived("core1", (), ()), TxKey(2, 9), 1)  # nothing to copy: fenced, asked
    assert install.mode is InstallMode.FENCED and install.read_fence_error is None
    refused = "core1 refused read_index: no_sequencer: no quorum"
    install.step(CommittedReceived("core1", None, 1, refused), OFFER.key, 2)
    assert install.read_fence_error == refused
    assert install.not_serving_reason() == (
        "replaying after installing a snapshot at (3, 50) from core1, up to the committed key being asked for; "
        f"that key was not told at the last ask: {refused}; retry later"
    )
    install.step(CommittedReceived("core1", TxKey(3, 60), 2), OFFER.key, 3)
    assert install.read_fence_error is None
    assert install.not_serving_reason() == (
        "replaying after installing a snapshot at (3, 50) from core1, up to (3, 60); retry later"
    )
    restarted = SnapshotInstall.fenced("core2", 1000, 0)  # neither the offer's key nor its sequencer known
    assert restarted.not_serving_reason() == (
        "replaying after installing a snapshot, up to the committed key being asked for; retry later"
    )


def test_a_read_refused_during_a_snapshot_install_says_so_and_why_the_fence_key_is_not_known(tmp_path) -> None:
    """A core's read of a shard it installs a snapshot of was refused ``not_ready`` with the install's
    bare words; while its read fence's key was refused by the core asked, nothing said why."""
    from mnesite.rlog import messages
    from mnesite.rlog.errors import RequestError

    from tests.conftest import follower_by_hand

    def refusal() -> str:
        with pytest.raises(RequestError) as refused:
            node._check_serving("default")
        assert refused.value.code == "not_ready"
        return str(refused.value)

    with follower_by_hand(tmp_path / "data") as (node, _driver):
        install = SnapshotInstall(SnapshotOffer("core2", 1, TxKey(1, 9), b"d" * 32), 100, 60_000, node.clock_ms())
        node.installs["default"] = install
        node._execute_install("default", install.start())
        assert "installing a snapshot at (1, 9) from core2 (0 rows copied so far); retry later" in refusal()
        node._step_install("default", TablesReceived("core2", (), ()))
        [(request_id, pending)] = [(r, one) for r, one in node.install_requests.items() if one[1] == "fence"]
        del node.install_requests[request_id]
        node._on_install_answer(pending, messages.error(request_id, "no_sequencer", "the sequencer is being elected"))
        said = "core2 refused read_index: no_sequencer: the sequencer is being elected"
        fenced = "replaying after installing a snapshot at (1, 9) from core2, up to the committed key being asked for"
        assert f"{fenced}; that key was not told at the last ask: {said}; retry later" in refusal()
        assert node.status()["shards"]["default"]["install"]["read_fence_error"] == said


def test_the_sequencer_counts_what_it_serves_of_each_learner_or_member_install_and_forgets_the_rest():
    """``CopiesServed``: what ``cluster add-core`` sees move while a learner's install copies (its
    matched key moves only at the end), bounded to the learner and the members being installed."""
    from mnesite.core.snapshot import CopiesServed

    copies = CopiesServed(idle_ms=10_000)
    members = ("core1", "core2")
    assert copies.shown("s", "core3", members, 0) is None
    copies.served("s", "core3", "a", True, 100, 1000, "core3", members)
    copies.served("s", "core3", "a", False, 50, 1500, "core3", members)
    copies.served("s", "core3", "b", True, 7, 2000, "core3", members)
    assert copies.shown("s", "core3", members, 2500) == {"rows": 157, "batches": 3, "last_batch_age_ms": 500}
    # The first table's first batch asked again: the install began again, and so does its count.
    copies.served("s", "core3", "a", True, 20, 3000, "core3", members)
    assert copies.shown("s", "core3", members, 3000) == {"rows": 20, "batches": 1, "last_batch_age_ms": 0}
    # Another shard's count is its own; a core neither learner nor member (a replicant naming one, a
    # core removed) is not counted.
    copies.served("other", "core3", "x", True, 5, 3000, "core3", members)
    copies.served("s", "core9", "a", True, 5, 3000, "core3", members)
    assert copies.shown("other", "core3", members, 3000)["rows"] == 5
    assert set(copies._shards["s"]) == {"core3"}
    # The learner's count stays however long its copy stands still (a stalled copy is seen as such).
    assert copies.shown("s", "core3", members, 999_000)["last_batch_age_ms"] == 996_000
    # A member's install is counted too, and forgotten once it was served nothing for idle_ms.
    copies.served("s", "core2", "a", True, 9, 4000, "core3", members)
    assert copies.shown("s", "core2", members, 13_999) == {"rows": 9, "batches": 1, "last_batch_age_ms": 9999}
    assert copies.shown("s", None, members, 14_000) is None
    assert copies.shown("s", "core2", members, 14_000) is None
    # Once the learner is neither learner nor member (its add refused), or this core is no longer the
    # sequencer (no learner, no members), the counts go.
    assert copies.shown("s", None, members, 15_000) is None and copies.shown("s", "core3", members, 15_000) is None
    assert copies.shown("other", "core3", members, 15_000) is not None
    assert copies.shown("other", None, (), 15_000) is None
    assert copies.shown("other", "core3", ("core3",), 15_000) is None
    assert not copies._shards


def test_a_learner_names_itself_in_its_batches_only_to_a_sequencer_that_announces_its_versions():
    from mnesite.core.snapshot import reads_copy_sender
    from mnesite.rlog.versions import RELEASE_0_1_0, THIS_RELEASE

    assert reads_copy_sender(THIS_RELEASE)
    assert not reads_copy_sender(RELEASE_0_1_0) and not reads_copy_sender(None)


@pytest.mark.timeout(60)
def test_the_sequencer_s_members_answer_shows_a_learner_s_snapshot_copy_moving(tmp_path) -> None:
    """Regression: ``members`` showed of a learner only its matched key, which a snapshot install
    moves only at its end; `cluster add-core` saw a long install as stalled. A learner installing
    from this sequencer names itself in its batches, and ``learner_copy`` counts what it was served."""
    from mnesite.core.node import CoreNode
    from mnesite.rlog import admin_answers, messages
    from mnesite.rlog.messages import Message

    from tests.conftest import core_with_table, free_port, node_config, queued_to

    with core_with_table(tmp_path / "core1") as sequencer:
        sequencer.begin()
        sequencer.store.write_rows("t", [{"id": i, "v": f"row {i}"} for i in range(5)])
        learner_endpoint = f"tcp://127.0.0.1:{free_port()}"
        change = {"shard": "default", "action": "add", "name": "core2", "endpoint": learner_endpoint}
        asked = Message("membership_change", "m1", messages.typed_body("membership_change", change))
        sequencer._dispatch([b"op"], asked)
        assert sequencer.membership()["shards"]["default"]["learner"] == "core2"
        assert sequencer.membership()["shards"]["default"]["learner_copy"] is None

        cores = {"core1": sequencer.config.listen, "core2": learner_endpoint}
        config = node_config(tmp_path / "core2", free_port(), "core2", extra={"cluster": {"core_nodes": cores}})
        learner = CoreNode(config)
        try:
            learner.begin()
            learner.store.ensure_shard("default", 0)
            learner._open_shard("default")
            learner.peer_versions.heard("core1", sequencer.journal(), 0)
            position = sequencer.store.shard("default")
            offer = SnapshotOffer("core1", 1, position.applied, position.digest, ("core1",))
            install = SnapshotInstall(offer, 2, 60_000, learner.clock_ms())
            learner.installs["default"] = install
            learner._execute_install("default", install.start())
            shown = []
            while install.mode is not InstallMode.FENCED:
                (request,) = [m for _, _, m in learner._outbox if m.request_id in learner.install_requests]
                learner._outbox.clear()
                sequencer._dispatch([b"learner"], messages.decode(messages.encode(request)))
                (answer,) = queued_to(sequencer, [b"learner"])
                sequencer._outbox.clear()
                learner._on_install_answer(learner.install_requests.pop(request.request_id), answer)
                if request.kind == "bootstrap_batch":
                    members = sequencer.membership()
                    assert messages.answer_as(members, admin_answers.Membership) is not None
                    copy = members["shards"]["default"]["learner_copy"]
                    shown.append((copy["rows"], copy["batches"]))
        finally:
            learner.close()
        assert shown == [(2, 1), (4, 2), (5, 3)]
