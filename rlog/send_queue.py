"""What a node's DEALER toward each peer core may still hold, in bytes: a pure ledger.

Theory of operation
-------------------
zmq bounds a DEALER's send queue in frames (its SNDHWM: a replicant's ``CORE_QUEUE_MAX``, a core's
``PEER_SEND_QUEUE_MAX``), not in bytes: a core that is down, hung or does not read made a replicant hold
up to that many forwarded writes of up to ``frame_bytes_max`` each (gigabytes), and a sequencer hold
the appends (up to ``append_bytes_max`` each) it re-sends a silent follower at every heartbeat.
``PeerQueues`` counts, per peer core, the frames sent toward it that zmq may still hold, and their bytes;
the driver (``NodeServer.send_bounded``) refuses to send one more that would take a peer past
``core_queue_bytes_max`` (``refusal``), as it refuses a frame it cannot send at all: a forwarded write
is answered ``no_sequencer``, nothing sent; a consensus message is dropped (the protocol re-sends it).

A frame is known to have left once zmq lets go of it: a frame sent without a copy carries a tracker
(``zmq.MessageTracker``, anything with ``done``) that is done once zmq handed it to the kernel (the core
reads again) or dropped it (its socket closed). That proof needs no answer from the core: a frame the
core never answers (a one-way acknowledgement, a request it dropped, one sent before it restarted)
does not pin the ledger, and a closed socket's frames are given back by zmq itself (their trackers
are done: no reset is needed when a connection is closed and opened again). zmq sends a connection's
frames in order, so they leave the ledger in order: once the oldest is not done, nothing is looked at
behind it (what it keeps for a moment is on the safe side).

Frames below the sender's threshold (``TRACKED_BYTES_MIN`` at a replicant, ``CORE_TRACKED_BYTES_MIN``
at a core) are not recorded (tracking costs on the write path): they are bounded by zmq's count, that
many times the threshold. A peer holding nothing is always sent one
frame, whatever its size (``frame_bytes_max`` bounds it): a bound below a frame refuses nothing alone.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class Tracker(Protocol):
    """What the ledger asks of a sent frame: whether zmq let go of it (``zmq.MessageTracker``)."""

    @property
    def done(self) -> bool: ...


# Frames a replicant sends toward a core from this size are sent without a copy and tracked (the
# socket's copy_threshold must be 0: pyzmq copies a smaller frame sent without a copy, and its tracker
# is done at once); smaller ones are bounded by zmq's count only (1,000 x 4 KiB = 4 MiB per core).
TRACKED_BYTES_MIN = 4096
# A core toward its peer cores tracks only the frames it sends without a copy anyway (from 64 KiB,
# ``rlog.server.COPY_BYTES_MIN``): a frame sent without a copy costs pyzmq a Frame, a tracker and a
# wake-up of its garbage thread, and a sequencer's appends of a turn's writes are 4-64 KiB at 64
# clients (tracking them from 4 KiB cost the three cores 1-3% more CPU a write: benchmarks/PROFILE.md,
# thirty-fourth session). Smaller ones: 1,000 x 64 KiB = 64 MiB per peer at most.
CORE_TRACKED_BYTES_MIN = 64 * 1024


class PeerQueues:
    """Frames and bytes sent toward each peer core that zmq may still hold; ``bytes_max`` per peer."""

    def __init__(self, bytes_max: int) -> None:
        self.bytes_max = bytes_max
        self._held: dict[str, deque[tuple[Tracker, int]]] = {}
        self._bytes: dict[str, int] = {}
        self.refused: dict[str, int] = {}  # frames refused per peer for its bound

    def sent(self, peer: str, tracker: Tracker, size: int) -> None:
        """Record a frame of ``size`` bytes just sent toward ``peer``, with its tracker."""
        self._held.setdefault(peer, deque()).append((tracker, size))
        self._bytes[peer] = self._bytes.get(peer, 0) + size

    def held_bytes(self, peer: str) -> int:
        """The bytes of the frames toward ``peer`` that zmq may still hold (forgetting, in order, those
        it let go of)."""
        held = self._held.get(peer)
        if not held:
            return 0
        while held and held[0][0].done:
            _, size = held.popleft()
            self._bytes[peer] -= size
        return self._bytes[peer]

    def full(self, peer: str) -> bool:
        """Whether ``peer`` would be sent nothing more now, whatever the frame: ``bytes_max`` held."""
        return self.held_bytes(peer) >= self.bytes_max

    def refusal(self, peer: str, size: int) -> str | None:
        """Why a frame of ``size`` bytes toward ``peer`` is not sent now (counted), else None: past
        ``bytes_max`` of frames zmq still holds toward it. A peer holding nothing is always sent one."""
        held = self.held_bytes(peer)
        if held == 0 or held + size <= self.bytes_max:
            return None
        self.refused[peer] = self.refused.get(peer, 0) + 1
        return (
            f"{held} bytes sent toward it are still queued here, not taken by the core, and this frame has "
            f"{size} (core_queue_bytes_max {self.bytes_max}): the core is away or does not read"
        )

    def status(self, peers: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """Per peer: ``bytes`` and ``frames`` zmq may still hold toward it, frames ``refused`` for the bound."""
        return {
            peer: {
                "bytes": self.held_bytes(peer),
                "frames": len(self._held.get(peer, ())),
                "refused": self.refused.get(peer, 0),
            }
            for peer in peers
        }
