"""The ledger of what zmq may still hold toward each peer core (``rlog.send_queue``); a real replicant
whose core does not read (its forwarded writes are refused once that is bounded), and a real sequencer
whose follower does not read (what it sends there is bounded, the cluster commits with the others)."""

from __future__ import annotations

import logging

import zmq
from mnesite.replicant.node import CORE_QUEUE_MAX
from mnesite.rlog.messages import Message, typed_body
from mnesite.rlog.send_queue import PeerQueues
from mnesite.rlog.server import send_tracked

from tests.conftest import free_port, replicant_by_hand, wait_until


class Sent:
    """A stand-in tracker: ``done`` once the test says zmq let go of the frame."""

    def __init__(self) -> None:
        self.done = False


def test_a_frame_leaves_the_ledger_once_zmq_let_go_of_it_and_those_before_it() -> None:
    queues = PeerQueues(bytes_max=1000)
    first, second, third = Sent(), Sent(), Sent()
    queues.sent("core1", first, 100)
    queues.sent("core1", second, 200)
    queues.sent("core1", third, 300)
    queues.sent("core2", Sent(), 50)
    assert queues.held_bytes("core1") == 600 and queues.held_bytes("core2") == 50
    # zmq sends a connection's frames in order: one behind an older frame still held is counted until it leaves.
    second.done = True
    assert queues.held_bytes("core1") == 600
    first.done = True
    assert queues.held_bytes("core1") == 300
    assert queues.status(("core1", "core2", "core3")) == {
        "core1": {"bytes": 300, "frames": 1, "refused": 0},
        "core2": {"bytes": 50, "frames": 1, "refused": 0},
        "core3": {"bytes": 0, "frames": 0, "refused": 0},
    }
    third.done = True
    assert queues.held_bytes("core1") == 0 and queues.held_bytes("core2") == 50


def test_past_its_bound_a_core_is_sent_nothing_more_and_one_is_always_sent_to_an_empty_queue() -> None:
    queues = PeerQueues(bytes_max=1000)
    assert queues.refusal("core1", 5000) is None, "a core holding nothing is always sent one frame"
    held = Sent()
    queues.sent("core1", held, 5000)
    why = queues.refusal("core1", 1)
    assert why is not None and "5000 bytes" in why and "core_queue_bytes_max 1000" in why
    assert queues.refusal("core2", 1000) is None, "each core has its own bound"
    queues.sent("core2", Sent(), 600)
    assert queues.refusal("core2", 400) is None and queues.refusal("core2", 401) is not None
    assert queues.status(("core1", "core2"))["core1"]["refused"] == 1
    held.done = True  # the core read again
    assert queues.refusal("core1", 1000) is None


def test_a_closed_connection_s_frames_leave_the_ledger_by_themselves() -> None:
    """A socket closed (``close_dealer``) drops its queue, and zmq lets go of its frames: their
    trackers are done, so the ledger needs no reset of its own (the replicant never closes one anyway)."""
    queues = PeerQueues(bytes_max=1000)
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # connected where nobody listens: zmq queues
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.copy_threshold = 0  # as the replicant's own (ReplicantNode.bind)
    dealer.connect(f"tcp://127.0.0.1:{free_port()}")
    try:
        queues.sent("core1", send_tracked(dealer, [b"x" * 5000]), 5000)
        assert queues.held_bytes("core1") == 5000
    finally:
        dealer.close(0)
    wait_until(lambda: queues.held_bytes("core1") == 0, 5, "zmq to let go of a closed socket's frames")


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_writes_forwarded_to_a_core_that_does_not_read_are_refused_past_core_queue_bytes_max(tmp_path, caplog) -> None:
    """Regression: zmq bounds a replicant's queue toward a core in frames only (CORE_QUEUE_MAX, 1000):
    writes forwarded to a core that accepted the connection and read nothing piled up in the replicant,
    about 1 GiB for 1000 writes of 1 MiB (4 GiB at frame_bytes_max). Past core_queue_bytes_max of frames
    zmq still holds toward it, the next write is refused no_sequencer at once, nothing sent; once the
    core reads again, writes go to it again."""
    mib = 1024 * 1024
    context = zmq.Context.instance()
    core = context.socket(zmq.ROUTER)  # accepts, and (at first) reads nothing
    core.setsockopt(zmq.LINGER, 0)
    core.setsockopt(zmq.RCVHWM, 1)  # this process's zmq takes at most a frame off the connection for it
    # Kernel buffers of a fixed size at both ends: grown by the kernel's autotuning, they took frames
    # off zmq after the bound was reached, and the bytes zmq held fell below it before the status
    # read them (this test failed about one run in four).
    core.setsockopt(zmq.RCVBUF, 256 * 1024)
    endpoint = f"tcp://127.0.0.1:{core.bind_to_random_port('tcp://127.0.0.1')}"
    dealer = context.socket(zmq.DEALER)  # as the replicant's node makes it (NodeServer.dealer)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, CORE_QUEUE_MAX)
    dealer.setsockopt(zmq.SNDBUF, 256 * 1024)
    dealer.connect(endpoint)
    try:
        with replicant_by_hand(tmp_path / "r", {"core_queue_bytes_max": 8 * mib}) as node:
            node.core_sockets = {"core1": dealer}
            node.warnings.clock = lambda: 0  # one second that never ends: one warning line, the rest counted
            caplog.set_level(logging.WARNING, logger="mnesite.replicant")
            row = {"id": 1, "v": "x" * mib}
            body = typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": row}]})
            rss_before = _rss_bytes()
            refused = []
            for sent in range(100):
                node._dispatch([b"client"], Message("transact", f"w{sent}", body))
                refused += [m for _s, to, m in node._outbox if to == [b"client"]]
                node._outbox.clear()
            grown = _rss_bytes() - rss_before
            assert refused, "every write was queued toward a core that reads nothing"
            assert {m.body.code for m in refused} == {"no_sequencer"}
            assert "core_queue_bytes_max" in refused[0].body.message
            assert "nothing was sent" in refused[0].body.message
            warned = [r.getMessage() for r in caplog.records if "core_queue_bytes_max" in r.getMessage()]
            assert len(warned) == 1 and warned[0].startswith("core core1: "), warned
            forwarded = len(node.pending)
            assert forwarded + len(refused) == 100 and forwarded < 40, forwarded  # 8 MiB, and the kernel's buffers
            assert grown < 48 * mib, f"the replicant grew by {grown // mib} MiB"  # 100 MiB before
            status = node.status()["core_queues"]["core1"]
            assert 7 * mib < status["bytes"] <= 9 * mib and status["refused"] == len(refused), status
            # Where an operator looks for sends not made: counted once each, with their reason.
            dropped = {key: node.status()[key] for key in ("sends_dropped", "sends_dropped_by")}
            by = {"zmq": 0, "refused_connection": 0, "core_queue_bytes_max": len(refused)}
            assert dropped == {"sends_dropped": len(refused), "sends_dropped_by": by}, dropped
            # The core reads again: zmq lets go of the frames, and the next write is sent.
            core.setsockopt(zmq.RCVHWM, 0)
            read = []

            def drained() -> bool:
                while core.poll(0):
                    read.append(core.recv_multipart())
                return node.peer_queues.held_bytes("core1") == 0

            wait_until(drained, 10, "the core to read what was queued toward it")
            node._dispatch([b"client"], Message("transact", "after", body))
            assert [m for _s, to, m in node._outbox if to == [b"client"]] == []
            assert node.pending["after"].purpose == "forward"
    finally:
        dealer.close(0)
        core.close(0)


def test_status_names_the_cores_a_replicant_holds_bytes_toward() -> None:
    from mnesite.cli.main import describe_core_queues

    queues = {"core1": {"bytes": 0, "frames": 0, "refused": 0}, "core2": {"bytes": 9000, "frames": 2, "refused": 3}}
    assert describe_core_queues({"core_queues": queues}) == [
        "core core2: 9000 bytes queued toward it, not taken yet (2 frames); 3 sends refused for core_queue_bytes_max"
    ]
    assert describe_core_queues({"node": "core1"}) == []  # a core's status: no such field


def test_status_text_counts_the_sends_dropped_with_those_refused_for_the_byte_bound() -> None:
    from mnesite.cli.main import describe_sends_dropped

    by = {"zmq": 2, "core_queue_bytes_max": 5}
    assert describe_sends_dropped({"sends_dropped": 7, "sends_dropped_by": by}) == (
        "sends dropped: 7 (5 core_queue_bytes_max, 2 zmq)"
    )
    assert describe_sends_dropped({"sends_dropped": 0, "sends_dropped_by": {"zmq": 0}}) is None
    assert describe_sends_dropped({"sends_dropped": 3}) == "sends dropped: 3", "a release without the reasons"


def test_a_write_of_a_few_kib_queued_toward_a_core_is_counted(tmp_path) -> None:
    """Regression (found while writing this ledger): pyzmq copies a frame sent without a copy below its
    socket's copy_threshold (64 KiB), and its tracker is done at once: forwarded writes of 4 to 64 KiB
    left the ledger while zmq still held them. The replicant's core sockets copy nothing they track."""
    from mnesite.replicant.node import ReplicantNode
    from mnesite.rlog.config import parse_config

    config = {
        "node": {"name": "r1", "role": "replicant", "data_dir": str(tmp_path / "r"),
                 "listen": f"tcp://127.0.0.1:{free_port()}"},
        "cluster": {"core_nodes": {"core1": f"tcp://127.0.0.1:{free_port()}"}},  # nobody listens: zmq queues
    }  # fmt: skip
    node = ReplicantNode(parse_config(config))
    try:
        node.bind()
        body = typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1, "v": "x" * 10_000}}]})
        node._dispatch([b"client"], Message("transact", "w1", body))
        assert node.pending["w1"].purpose == "forward"
        queued = node.status()["core_queues"]["core1"]
        assert queued["frames"] == 1 and 10_000 < queued["bytes"] < 11_000, queued
    finally:
        node.close()


def test_a_sequencer_bounds_what_it_queues_toward_a_follower_that_does_not_read(tmp_path) -> None:
    """Regression: zmq bounds a core's DEALER toward a peer in frames only (PEER_SEND_QUEUE_MAX, 1000): a
    sequencer whose follower accepts and never reads (hung, stopped) held every append sent to it, and
    the ones each heartbeat re-sends (up to append_bytes_max each), without bound in bytes. Past
    core_queue_bytes_max of frames zmq still holds toward that follower, what is sent there is refused
    (counted per peer in status), and the shard keeps committing with the other follower."""
    from mnesite.rlog.client import Client

    from tests.conftest import ThreadNode

    mib = 1024 * 1024
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # core3: accepts, reads nothing
    silent.setsockopt(zmq.LINGER, 0)
    silent.setsockopt(zmq.RCVHWM, 1)  # this process's zmq takes at most a frame off the connection for it
    ports = {"core1": free_port(), "core2": free_port()}
    cores = {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()}
    cores["core3"] = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    extra = {"cluster": {"core_nodes": cores}, "limits": {"core_queue_bytes_max": 2 * mib}}
    nodes = {}
    try:
        for name in ("core1", "core2"):
            nodes[name] = ThreadNode(tmp_path / name, extra, port=ports[name], name=name)
        with Client([cores["core1"], cores["core2"]], timeout_ms=5000, retries=5) as client:
            client.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
            sequencer = client.members()["shards"]["default"]["sequencer"]
        rss_before = _rss_bytes()
        with Client(cores[sequencer], timeout_ms=5000, retries=0) as client:
            queue: dict = {}
            for written in range(400):  # 100 MiB toward core3 at most: the kernel's buffers take a few MiB
                client.put("t", {"id": written, "v": "x" * (256 * 1024)})
                queue = client.status()["core_queues"]["core3"]
                if queue["refused"]:
                    break
            assert queue["refused"], f"{written + 1} writes of 256 KiB and nothing refused toward core3: {queue}"
            # An append holds at most append_bytes_max (512 KiB): the bound, plus one frame.
            assert queue["bytes"] <= 2 * mib + 600 * 1024, queue
            for more in range(written + 1, written + 21):  # the shard commits with core1 and core2
                client.put("t", {"id": more, "v": "x" * (256 * 1024)})
            status = client.status()
        assert status["core_queues"]["core3"]["bytes"] <= 2 * mib + 600 * 1024, status["core_queues"]
        assert status["core_queues"]["core3"]["refused"] >= queue["refused"]
        assert set(status["core_queues"]) == {"core1", "core2", "core3"} - {sequencer}
        assert status["shards"]["default"]["committed"] >= [1, written + 21], status["shards"]["default"]
        grown = _rss_bytes() - rss_before
        assert grown < 160 * mib, f"the test process (both cores) grew by {grown // mib} MiB"
    finally:
        for node in nodes.values():
            node.stop()
        silent.close(0)


def test_a_write_forwarded_to_a_sequencer_that_does_not_read_is_refused_past_the_bound(tmp_path) -> None:
    """A follower core forwarding client writes to a sequencer that accepts and never reads held up to
    PEER_SEND_QUEUE_MAX of them (4 GiB at frame_bytes_max). Past core_queue_bytes_max, a write is
    answered no_sequencer at once, nothing sent."""
    from mnesite.core.node import CoreNode

    from tests.conftest import node_config

    mib = 1024 * 1024
    sequencer = zmq.Context.instance().socket(zmq.ROUTER)
    sequencer.setsockopt(zmq.LINGER, 0)
    sequencer.setsockopt(zmq.RCVHWM, 1)
    cores = {
        "core1": f"tcp://127.0.0.1:{free_port()}",
        "core2": f"tcp://127.0.0.1:{sequencer.bind_to_random_port('tcp://127.0.0.1')}",
    }
    extra = {"cluster": {"core_nodes": cores}, "limits": {"core_queue_bytes_max": 4 * mib}}
    node = CoreNode(node_config(tmp_path / "data", free_port(), extra=extra))
    try:
        node.bind()
        node.begin()
        node.store.ensure_shard("default", 0)
        node._open_shard("default")
        answers = []
        node.reply = lambda envelope, message: answers.append(message)  # what the clients are told
        body = typed_body("transact", {"ops": [{"op": "write", "table": "t", "row": {"id": 1, "v": "x" * mib}}]})
        for sent in range(100):
            node._forward([b"client"], Message("transact", f"w{sent}", body), "default", "core2")
            node.flush()
        assert answers and {m.body.code for m in answers} == {"no_sequencer"}, answers[:1]
        assert "core_queue_bytes_max" in answers[0].body.message and "nothing was sent" in answers[0].body.message
        status = node.status()
        queue = status["core_queues"]["core2"]
        assert queue["bytes"] <= 5 * mib and queue["refused"] == len(answers) < 100, queue
        assert status["sends_dropped_by"]["core_queue_bytes_max"] == len(answers), status["sends_dropped_by"]
        assert status["sends_dropped"] == len(answers) + status["sends_dropped_by"]["zmq"]
    finally:
        node.close()
        sequencer.close(0)
