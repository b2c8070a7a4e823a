"""``[limits] frame_bytes_max`` bounds what a core sends its peers, not only what clients send it.

A follower decodes an append within its own frame_bytes_max (a larger frame is refused
``frame_too_large``, at every resend). Appends were cut at a fixed 512 KiB whatever the limit, and an
entry as large as the client's request went alone: with a frame_bytes_max under 512 KiB a follower
catching up never caught up, and with any limit one write close to it (its request fitted; the append
around its entry did not) left the sequencer unheard by its followers and the shard without commits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mnesite.core.consensus import AppendReply, AppendRequest, PersistedState
from mnesite.core.consensus_wire import message_to_wire
from mnesite.core.node import CoreNode
from mnesite.rlog import messages
from mnesite.rlog.client import RemoteError
from mnesite.rlog.messages import Message
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, TxKey, WriteOp, make_entry

from tests.conftest import ThreadNode, free_port, node_config
from tests.test_consensus import Harness, sends

pytestmark = pytest.mark.timeout(60)

FRAME_BYTES_MAX = 64 * 1024
CORES = ("core1", "core2", "core3")


def consensus_config(tmp_path: Path):
    """The consensus settings a core with ``FRAME_BYTES_MAX`` runs with."""
    endpoints = {name: f"tcp://127.0.0.1:{free_port()}" for name in CORES}
    extra = {"cluster": {"core_nodes": endpoints}, "limits": {"frame_bytes_max": FRAME_BYTES_MAX}}
    node = CoreNode(node_config(tmp_path / "data", free_port(), extra=extra))
    try:
        return node.consensus_config
    finally:
        node.close()


def peer_frame(message: AppendRequest) -> bytes:
    """``message`` as a core sends it to a peer (``CoreNode._on_effect``)."""
    body = {"shard": "default", "sender": "core1", "message": message_to_wire(message)}
    return messages.encode(Message("peer", "peer", body))


def test_a_follower_catching_up_gets_appends_within_its_frame_bytes_max(tmp_path: Path) -> None:
    entries, prev, digest = [], ZERO_KEY, GENESIS_DIGEST
    for counter in range(1, 41):  # 40 entries of 20 KB: what a follower down for a while has to catch up on
        entry = make_entry("s", TxKey(1, counter), prev, digest, (WriteOp("t", {"k": counter, "v": "x" * 20_000}),))
        entries.append(entry)
        prev, digest = entry.tx_key, entry.digest
    sequencer = Harness("core1", CORES, entries, PersistedState(1, None, CORES), config=consensus_config(tmp_path))
    sequencer.elect()
    sequencer.ack("core3", sequencer.machine.last_key)
    # core2 lost its disk: it holds nothing, and is sent every entry from the first on.
    reply = AppendReply(sequencer.machine.generation, False, ZERO_KEY, ZERO_KEY, ZERO_KEY, sequencer.now_ms)
    sent: list[AppendRequest] = []
    for _ in range(len(entries) + 1):
        appends = [message for to, message in sends(sequencer.receive("core2", reply), AppendRequest) if to == "core2"]
        if not appends:
            break
        sent.extend(appends)
        last = appends[-1].entries[-1].tx_key if appends[-1].entries else appends[-1].prev_key
        reply = AppendReply(sequencer.machine.generation, True, last, last, ZERO_KEY, sequencer.now_ms)
    assert [entry.tx_key for append in sent for entry in append.entries][:40] == [e.tx_key for e in entries]
    for append in sent:
        messages.decode(peer_frame(append), FRAME_BYTES_MAX)  # raised frame_too_large: appends of 512 KiB


def test_a_write_whose_entry_would_not_fit_an_append_is_too_large_and_the_next_commits(tmp_path: Path) -> None:
    node = ThreadNode(tmp_path / "data", extra={"limits": {"frame_bytes_max": FRAME_BYTES_MAX}})
    try:
        with node.client(timeout_ms=5000) as client:
            client.create_table("big", "id", [("id", "INTEGER"), ("text", "TEXT")])
            # The request fits the frame (the client checks it), the append around its entry would not.
            with pytest.raises(RemoteError) as refused:
                client.put("big", {"id": 1, "text": "x" * (FRAME_BYTES_MAX - 300)})
            assert refused.value.code == "too_large" and "frame_bytes_max 65536" in str(refused.value)
            client.put("big", {"id": 2, "text": "y" * (FRAME_BYTES_MAX // 2)})
            assert [row["id"] for row in client.scan("big")] == [2]
    finally:
        node.stop()
