"""A lying replicant on a core node (served from a thread of the test): acknowledgements must prove
what was read (core.agent, "Proven acknowledgements").

A raw socket watches from the start of a log of about 1.6 MB, naming an endpoint where nothing
listens (zmq keeps every push handed to it for that endpoint, on the core), and acknowledges the
keys the core's ``status`` says its agent pushed, without having read any push. If the core took
those acknowledgements, its agent would push the whole log into zmq's queue while the memory budget
(``agents_bytes_max``, 64 KiB here) counted none of it. It must refuse them (counted in
``status``), push no more than its first (probation) push, and stop the agent for its silence.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from mnesite.core import node as node_module
from mnesite.rlog import messages
from mnesite.rlog.messages import Message
from mnesite.rlog.replication import REPLICATION_PROTOCOL_VERSION
from mnesite.rlog.types import GENESIS_DIGEST

from tests.conftest import ThreadNode, free_port, wait_until

pytestmark = pytest.mark.timeout(90)

ROW_BYTES = 16 * 1024
ROWS = 100
AGENTS_BYTES_MAX = 64 * 1024
PUSH_BYTES_MAX = 256 * 1024  # [limits] push_bytes_max's default: the budget is crossed by one push at most
LIE_FOR_S = 3.0
# The node's probation (3 s): a watch's first acknowledgement must come within it. Shorter here, so that
# the agent stops for its silence sooner; the lies come every 50 ms, twenty of them within it.
PROBATION_TIMEOUT_MS = 1000


def agent_of(core: ThreadNode, agent_id: str) -> dict | None:
    with core.client(timeout_ms=1000, retries=0) as client:
        status = client.status()
    return next((agent for agent in status.get("agents", []) if agent["agent"] == agent_id), None)


@pytest.fixture
def core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadNode]:
    monkeypatch.setattr(node_module, "PROBATION_TIMEOUT_MS", PROBATION_TIMEOUT_MS)
    core = ThreadNode(tmp_path / "data", extra={"limits": {"agents_bytes_max": AGENTS_BYTES_MAX}})
    try:
        yield core
    finally:
        core.stop()


def test_a_replicant_acknowledging_pushes_it_never_read_cannot_grow_the_cores_queues(core: ThreadNode) -> None:
    with core.client(timeout_ms=10_000) as client:
        client.create_table("blob", "id", [("id", "INTEGER"), ("data", "TEXT")])
        for row_id in range(ROWS):
            last = tuple(client.put("blob", {"id": row_id, "data": "x" * ROW_BYTES}))
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(core.endpoint)
    try:
        body = {
            "shard": "default",
            "replicant": "liar",
            "endpoint": f"tcp://127.0.0.1:{free_port()}",  # nobody listens: every push stays queued on the core
            "from": [0, 0],
            "from_digest": GENESIS_DIGEST,
            "protocol": REPLICATION_PROTOCOL_VERSION,
        }
        socket.send(messages.encode(Message("watch", "w1", body)))
        assert socket.poll(5000), "the core did not answer the watch"
        answer = messages.decode(socket.recv())
        assert answer.kind == "reply", answer
        agent_id = answer.body.result["agent"]
        # The lie: acknowledge whatever the agent pushed, as if read, again and again.
        pushed_max = 0
        deadline = time.monotonic() + LIE_FOR_S
        while time.monotonic() < deadline:
            agent = agent_of(core, agent_id)
            if agent is None:
                break  # stopped: it took none of the lies for a sign of life
            pushed_max = max(pushed_max, agent["sent"][1])
            ack = {"shard": "default", "agent": agent_id, "applied": agent["sent"]}
            socket.send(messages.encode(Message("push_ack", "ack", ack)))
            time.sleep(0.05)  # the liar's pace; what is measured is how far the agent pushed meanwhile
        with core.client(timeout_ms=1000, retries=0) as client:
            status = client.status()
        pushed_bytes = pushed_max * ROW_BYTES  # about one row per entry (a table creation first)
        assert pushed_bytes <= AGENTS_BYTES_MAX + PUSH_BYTES_MAX, (
            f"the agent pushed up to entry {pushed_max} of {last} (about {pushed_bytes} bytes, all queued in zmq "
            f"for a dead endpoint) on acknowledgements that proved nothing; budget {status.get('agent_budget')}"
        )
        assert status["agent_budget"]["acks_refused"] > 0
        # Not a sign of life either: the agent stops for its silence (its probation, PROBATION_TIMEOUT_MS).
        wait_until(lambda: agent_of(core, agent_id) is None, 10, "the lying replicant's agent to stop")
    finally:
        socket.close(0)
