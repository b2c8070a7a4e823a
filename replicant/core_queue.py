"""What a replicant's DEALER toward each core may still hold, in bytes: a pure ledger.

Theory of operation
-------------------
zmq bounds a DEALER's send queue in frames (its SNDHWM, ``CORE_QUEUE_MAX``), not in bytes: a core that
is down, hung or does not read made a replicant hold up to that many forwarded writes of up to
``frame_bytes_max`` each (gigabytes). ``CoreQueues`` counts, per core, the frames sent toward it that
zmq may still hold, and their bytes; the driver refuses to send one more that would take a core past
``core_queue_bytes_max`` (``refusal``), as it refuses a write it cannot send at all.

A frame is known to have left once zmq lets go of it: a frame sent without a copy carries a tracker
(``zmq.MessageTracker``, anything with ``done``) that is done once zmq handed it to the kernel (the core
reads again) or dropped it (its socket closed). That proof needs no answer from the core: a frame the
core never answers (a one-way acknowledgement, a request it dropped, one sent before it restarted)
does not pin the ledger, and a closed socket's frames are given back by zmq itself (their trackers
are done: no reset is needed when a connection is closed and opened again). zmq sends a connection's
frames in order, so they leave the ledger in order: once the oldest is not done, nothing is looked at
behind it (what it keeps for a moment is on the safe side).

Frames below the driver's tracking threshold are not recorded (tracking costs on the write path): they
are bounded by zmq's count, that many times the threshold. A core holding nothing is always sent one
frame, whatever its size (``frame_bytes_max`` bounds it): a bound below a frame refuses nothing alone.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class Tracker(Protocol):
    """What the ledger asks of a sent frame: whether zmq let go of it (``zmq.MessageTracker``)."""

    @property
    def done(self) -> bool: ...


class CoreQueues:
    """Frames and bytes sent toward each core that zmq may still hold; ``bytes_max`` per core."""

    def __init__(self, bytes_max: int) -> None:
        self.bytes_max = bytes_max
        self._held: dict[str, deque[tuple[Tracker, int]]] = {}
        self._bytes: dict[str, int] = {}
        self.refused: dict[str, int] = {}  # frames refused per core for its bound

    def sent(self, core: str, tracker: Tracker, size: int) -> None:
        """Record a frame of ``size`` bytes just sent toward ``core``, with its tracker."""
        self._held.setdefault(core, deque()).append((tracker, size))
        self._bytes[core] = self._bytes.get(core, 0) + size

    def held_bytes(self, core: str) -> int:
        """The bytes of the frames toward ``core`` that zmq may still hold (forgetting, in order, those
        it let go of)."""
        held = self._held.get(core)
        if not held:
            return 0
        while held and held[0][0].done:
            _, size = held.popleft()
            self._bytes[core] -= size
        return self._bytes[core]

    def full(self, core: str) -> bool:
        """Whether ``core`` would be sent nothing more now, whatever the frame: ``bytes_max`` held."""
        return self.held_bytes(core) >= self.bytes_max

    def refusal(self, core: str, size: int) -> str | None:
        """Why a frame of ``size`` bytes toward ``core`` is not sent now (counted), else None: past
        ``bytes_max`` of frames zmq still holds toward it. A core holding nothing is always sent one."""
        held = self.held_bytes(core)
        if held == 0 or held + size <= self.bytes_max:
            return None
        self.refused[core] = self.refused.get(core, 0) + 1
        return (
            f"{held} bytes sent toward it are still queued here, not taken by the core, and this frame has "
            f"{size} (core_queue_bytes_max {self.bytes_max}): the core is away or does not read"
        )

    def status(self, cores: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """Per core: ``bytes`` and ``frames`` zmq may still hold toward it, frames ``refused`` for the bound."""
        return {
            core: {
                "bytes": self.held_bytes(core),
                "frames": len(self._held.get(core, ())),
                "refused": self.refused.get(core, 0),
            }
            for core in cores
        }
