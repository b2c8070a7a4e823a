"""What a node does when its disk fails it: the rules, without any I/O.

Theory of operation
-------------------
A node's writes can fail in two ways that call for opposite answers:

* **Full** (SQLite's ``SQLITE_FULL``, ``ENOSPC``/``EDQUOT``, also from a write SQLite reports as
  ``SQLITE_IOERR_WRITE``, as it does a quota's: ``rlog.store.storage_fault``): nothing was written and
  nothing was lost; the write can succeed later, once space is freed. The node keeps running: it rolls back the
  turn, sends none of the turn's frames (so nothing that was not made durable is acknowledged),
  rebuilds its state machines from what is on disk, and then refuses writes with the error code
  ``disk_full`` while it keeps serving reads of what it holds. A core tells its shards
  (``core.consensus.DiskFull``): a sequencer steps down, and a full core neither votes, campaigns nor
  acknowledges appends, so the majority goes on without it. A replicant stops applying pushes
  (``replicant.replica``) and keeps its position. Every ``disk_probe_interval_ms`` the driver tries a
  small durable write (``PROBE_BYTES``); the first that succeeds ends the state (``freed``), and the
  node takes part again as after a restart.
* **Failed** (an I/O error: ``EIO`` from ``fsync``/``fdatasync`` or a write, ``SQLITE_IOERR_*``): the
  kernel may already have dropped the dirty pages it could not write and marked them clean, so a
  second fsync can succeed and say nothing (PostgreSQL's "fsyncgate", 2018). What the process
  believes is on disk may not be, and no retry can tell. So the node stops at once, with an error
  that says so (``StorageFailedError``), and sends nothing of the failed turn; a restart recovers
  from what the log really holds, and the peers (which never saw an acknowledgement of the lost
  writes) fill in whatever is missing.

``DiskHealth`` holds the state and decides when to probe and when a line goes to the log: one line
when the disk fills, one when it is writable again, never one per refused write or failed probe.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from mnesite.rlog.types import TxKey

ERROR_DISK_FULL = "disk_full"
# A probe writes this many bytes durably (and removes them): enough that the next turn's writes are
# likely to fit too, so that a node does not resume for one write and fill again at the next.
PROBE_BYTES = 256 * 1024


class StorageFault(enum.Enum):
    FULL = "full"  # nothing written, nothing lost: wait for space
    FAILED = "failed"  # an I/O error: what is on disk is unknown, stop


class StorageFailedError(RuntimeError):
    """The disk failed a write or a sync (not for want of space): the node must stop; a restart
    recovers from its log (see the module's docstring for why it is never retried)."""


@dataclass(frozen=True)
class DiskFull:
    """Event for a node's pure machines: a write failed for want of space; nothing can be persisted
    until ``DiskFreed``. A core's ``ShardConsensus`` is rebuilt from disk by its driver; a replicant's
    ``ShardReplica`` keeps serving, so it is told the position the disk still holds instead
    (``applied_key``, ``applied_digest``: the failed turn's applies were rolled back), whether
    its reads are fenced there (``read_fenced``: the turn that reached the read fence may be one of
    them) and the shard's spill there (``spilled`` entries of ``spilled_bytes`` bytes as stored: the
    turn's spilled entries, a bootstrap reset's delete or a replay were rolled back with it)."""

    error: str = ""
    applied_key: TxKey | None = None
    applied_digest: bytes | None = None
    read_fenced: bool = False
    spilled: int | None = None
    spilled_bytes: int | None = None


@dataclass(frozen=True)
class DiskFreed:
    """Event: a probe wrote durably again; persisting may resume."""


class DiskState(enum.Enum):
    OK = "ok"
    FULL = "full"


@dataclass
class DiskHealth:
    """Whether the node may write, and when it tries again (pure: time comes in as ``now_ms``)."""

    probe_interval_ms: int
    state: DiskState = DiskState.OK
    since_ms: int | None = None  # when the disk was found full (None while OK)
    error: str = ""  # what the last full write said
    fills: int = 0  # how many times the disk was found full since the node started
    probes_failed: int = 0  # probes that found the disk still full (in this and earlier episodes)
    writes_refused: int = 0  # client writes answered disk_full
    next_probe_ms: int = 0
    last_full_ms: int = 0  # how long the last finished episode lasted

    def __post_init__(self) -> None:
        if self.probe_interval_ms <= 0:
            raise ValueError("probe_interval_ms must be positive")

    @property
    def full(self) -> bool:
        return self.state is DiskState.FULL

    def filled(self, error: str, now_ms: int) -> bool:
        """A write failed for want of space. True when this starts an episode (log one line then).

        Only the episode's first failure schedules the probe: a later failure (a turn that fails
        again while full) never puts it off, or a node whose turns keep failing would never probe
        and never resume. The probe then runs every ``probe_interval_ms`` (``probe_failed``)."""
        self.error = error
        if self.state is DiskState.FULL:
            return False
        self.state = DiskState.FULL
        self.since_ms = now_ms
        self.next_probe_ms = now_ms + self.probe_interval_ms
        self.fills += 1
        return True

    def probe_due(self, now_ms: int) -> bool:
        return self.state is DiskState.FULL and now_ms >= self.next_probe_ms

    def probe_failed(self, error: str, now_ms: int) -> None:
        """A probe found the disk still full: the next one is due a probe interval from this one."""
        self.probes_failed += 1
        self.filled(error, now_ms)
        self.next_probe_ms = now_ms + self.probe_interval_ms

    def freed(self, now_ms: int) -> int:
        """A probe wrote durably: writes may go on. Returns how long the disk was full (for the log)."""
        full_ms = now_ms - self.since_ms if self.since_ms is not None else 0
        self.state = DiskState.OK
        self.since_ms = None
        self.last_full_ms = full_ms
        return full_ms

    def refusal(self) -> str | None:
        """The message a write is refused with while full (None: writes may go on)."""
        if self.state is not DiskState.FULL:
            return None
        self.writes_refused += 1
        return f"the disk is full ({self.error}); writes are refused until space is freed, reads are served"

    def status(self, now_ms: int) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "full_for_ms": now_ms - self.since_ms if self.since_ms is not None else 0,
            "error": self.error if self.full else "",
            "fills": self.fills,
            "probes_failed": self.probes_failed,
            "writes_refused": self.writes_refused,
            "probe_interval_ms": self.probe_interval_ms,
        }
