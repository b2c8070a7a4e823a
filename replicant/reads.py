"""A replicant's held-read rule (pure): which reads wait, for what, and when they may be answered.

Theory of operation
-------------------
A replicant answers ``local`` reads from whatever it applied. A read that must reflect a key waits
instead of answering stale data:

* ``read-your-writes`` (the request names ``min_key``, a key for every shard it reads, or
  ``min_keys``, the client's last write per shard: ``rlog.types.read_targets``): every shard it waits
  on must reach its key;
* ``linearizable``: the key of each shard is that shard's *read index*, the committed key its
  sequencer confirms with a quorum (``read_index`` request, ``core.rules.fence_read``). The read
  indexes of one read are gathered by ``ReadIndexGather``: the read waits once every shard answered,
  and is refused (at most once) as soon as one shard could not answer, or its request could not be
  sent at all (``no_sequencer``, nothing was sent: answered at once, as a forwarded write is, not at
  the request's timeout). ``check_client_requests_room``
  admits what this replicant asks the cores on its clients' behalf (a read's read indexes, a
  forwarded write) only while that keeps the replicant under half of its pending requests (the rest
  stay for its replicas' own: probes, watches, bootstrap batches, read fences); past it the request is
  refused ``overloaded`` at once, never asked without a pending entry (which nothing would answer).

``shards_to_wait_on``: a read of a known table waits on that table's shard. A read that must see a
key may name a table this replicant does not know yet (created by the very write whose key the
client waits for): it waits on every shard it replicates; once the table appears its own shard's
target decides, and if every shard reached its target and the table is still unknown, it did not
exist (the driver answers ``unknown_table``). A ``local`` read of an unknown table is refused at once.

``WaitingReads`` holds them, bounded in count, each with a deadline (then ``timeout``). A held read is
ready when the replica of its shard is readable at its target (``ShardReplica.readable_at``: applied
at least that key, and past the read fence of its bootstrap). The simulator runs this module for its
replicants' linearizable reads and checks every answer against the committed history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from mnesite.rlog.errors import OverloadedError
from mnesite.rlog.types import ZERO_KEY, TxKey

Payload = TypeVar("Payload")
Readable = Callable[[str, TxKey], bool]  # (shard, key) -> is the replica of shard readable at key


def shards_to_wait_on(table_shard: str | None, must_see_a_key: bool, replicated: Iterable[str]) -> list[str] | None:
    """The shards a read waits on; None: the table is unknown and the read must not wait (refuse it)."""
    if table_shard is not None:
        return [table_shard]
    shards = sorted(replicated)
    return shards if must_see_a_key and shards else None


@dataclass
class WaitingRead(Generic[Payload]):
    """One held read: ``targets`` maps each shard it waits on to the key that shard must reach."""

    payload: Payload
    table: str
    targets: dict[str, TxKey]
    deadline_ms: int

    def is_ready(self, table_shard: str | None, readable: Readable) -> bool:
        if table_shard is not None:
            if table_shard in self.targets:
                return readable(table_shard, self.targets[table_shard])
            if readable(table_shard, ZERO_KEY):
                return True  # its shard has no key to reach: the keys waited for were other shards' writes
        return all(readable(shard, key) for shard, key in self.targets.items())

    def describe(self) -> str:
        return ", ".join(f"shard {shard} did not reach {key}" for shard, key in sorted(self.targets.items()))


class WaitingReads(Generic[Payload]):
    """The held reads of one replicant: at most ``count_max``, answered when ready or at their deadline."""

    def __init__(self, count_max: int) -> None:
        self.count_max = count_max
        self.reads: list[WaitingRead[Payload]] = []

    def __len__(self) -> int:
        return len(self.reads)

    def hold(self, payload: Payload, table: str, targets: dict[str, TxKey], deadline_ms: int) -> None:
        if len(self.reads) >= self.count_max:
            raise OverloadedError(f"{self.count_max} reads are waiting already")
        self.reads.append(WaitingRead(payload, table, dict(targets), deadline_ms))

    def ready(self, shard_of: Callable[[str], str | None], readable: Readable) -> list[WaitingRead[Payload]]:
        """Remove and return the reads that may be answered now (``shard_of``: a table's shard, if known)."""
        # One pass: ``read not in ready`` compared every held read with every ready one (quadratic,
        # about 30 s of the loop turn for WAITING_READS_MAX reads released by one push).
        ready: list[WaitingRead[Payload]] = []
        waiting: list[WaitingRead[Payload]] = []
        for read in self.reads:
            (ready if read.is_ready(shard_of(read.table), readable) else waiting).append(read)
        if ready:
            self.reads = waiting
        return ready

    def expired(self, now_ms: int) -> list[WaitingRead[Payload]]:
        """Remove and return the reads whose deadline passed (answered ``timeout``)."""
        expired = [read for read in self.reads if read.deadline_ms <= now_ms]
        if expired:
            self.reads = [read for read in self.reads if read.deadline_ms > now_ms]
        return expired


def check_client_requests_room(pending: int, asking: int, pending_max: int) -> None:
    """Refuse (``OverloadedError``) a client's request whose ``asking`` requests to the cores (a read's
    read indexes, a forwarded write) would take the replicant past half of its ``pending_max`` pending
    requests (``pending`` now): a flood of linearizable reads or writes never starves the replicas' own
    requests, and each request asked has its pending entry (and deadline)."""
    if pending + asking > pending_max // 2:
        raise OverloadedError(f"{pending} requests to the cores are pending here; retry later")


GATHER_WAITING = "waiting"  # more shards must answer
GATHER_FAILED = "failed"  # one shard could not answer: refuse the read (once)
GATHER_DONE = "done"  # answered already: ignore late answers


@dataclass
class ReadIndexGather:
    """The read indexes of one linearizable read, one per shard it waits on; decided at most once."""

    shards: tuple[str, ...]
    keys: dict[str, TxKey] = field(default_factory=dict)
    answered: bool = False

    def arrived(self, shard: str, key: TxKey | None) -> str | dict[str, TxKey]:
        """A shard's answer (None: it failed). The targets to wait for once all are in, else a GATHER_*."""
        if self.answered:
            return GATHER_DONE
        if key is None:
            self.answered = True
            return GATHER_FAILED
        self.keys[shard] = key
        if set(self.keys) >= set(self.shards):
            self.answered = True
            return dict(self.keys)
        return GATHER_WAITING
