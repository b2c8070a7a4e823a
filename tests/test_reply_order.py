"""When a write's acknowledgement leaves a core, relative to the turn's commits (``NodeServer.reply``).

A write is acknowledged once its entry is committed, which at a sequencer means durable in its own
log (a commit with an fsync) and at a majority. The acknowledgement then leaves at once, before the
entry is applied and before the commit of the turn that applies it (that commit has no fsync and
only makes the apply durable, which a restart redoes): 100-150 us off a 1-client write
(benchmarks/PROFILE.md). Checked here on a one-core cluster, where the entry commits at its own fsync."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from mnesite.rlog import messages, server

from tests.conftest import ThreadNode


@pytest.mark.timeout(60)
def test_an_acknowledgement_leaves_after_its_entry_is_durable_and_before_the_applys_commit(
    tmp_path: Path, monkeypatch
) -> None:
    node = ThreadNode(tmp_path / "data")
    events: list[tuple[str, object]] = []
    lock = threading.Lock()
    try:
        with node.client(timeout_ms=5000) as client:
            client.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
        store = node.node.store
        commit, send_frames, apply_committed = store.commit, server.send_frames, store.apply_committed

        def recorded_apply(*args, **kwargs):
            applied = apply_committed(*args, **kwargs)
            with lock:
                events.extend(("apply", tuple(entry.tx_key)) for entry in applied)
            return applied

        def recorded_commit(durable: bool = True) -> None:
            commit(durable)
            with lock:
                events.append(("commit", durable))

        def recorded_send(socket, frames) -> None:
            answer = messages.decode(frames[-1])
            result = getattr(answer.body, "result", None)
            if answer.kind == "reply" and isinstance(result, dict) and "tx_key" in result:
                with lock:
                    events.append(("ack", tuple(result["tx_key"])))
            send_frames(socket, frames)

        monkeypatch.setattr(store, "commit", recorded_commit)
        monkeypatch.setattr(store, "apply_committed", recorded_apply)
        monkeypatch.setattr(server, "send_frames", recorded_send)
        with node.client(timeout_ms=5000) as client:
            keys = [tuple(client.put("t", {"id": i, "v": "x"})) for i in range(20)]
    finally:
        node.stop()
    acks = [i for i, (what, _) in enumerate(events) if what == "ack"]
    assert [events[i][1] for i in acks] == keys
    for i in acks:
        before = [durable for what, durable in events[:i] if what == "commit"]
        after = [durable for what, durable in events[i + 1 :] if what == "commit"]
        # Its entry's commit, with the fsync, came first; the apply's commit (no fsync) follows it.
        assert before and before[-1] is True, events
        assert after and after[0] is False, events
        # Told as its entry commits, before the apply of the same step (no read is served in between).
        assert ("apply", events[i][1]) in events[i + 1 :], events
