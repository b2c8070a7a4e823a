"""What a client is told about its write (pure): acknowledged, or outcome unknown; and forwarding.

Theory of operation
-------------------
A write reaches some core. The sequencer proposes it and the client waits for the entry to
commit; any other core forwards it, once, to the sequencer it knows and relays the answer. The
client must never be told "done" for a write that did not commit, and whenever the core cannot
know, it says ``outcome_unknown``: the client retries with the same request id, which is
idempotent (an id found in the rlog is answered with its tx key once committed).

``CommitWaiters`` (at the sequencer; one per shard) maps the log's fate to answers:

1. A waiter for tx key K is acknowledged when K commits and the entry committed at K carries the
   waiter's request id (driver and simulator tell it as the commit is stepped, just before
   applying it in the same step: ``core.rules.commit_heard``). Another entry at K (not possible under the
   consensus rules, but checked) gives ``outcome_unknown``.
2. A truncation of the uncommitted tail after A gives ``outcome_unknown`` to every waiter above A
   (a new sequencer replaced those entries; the write may still have reached its log).
3. A proposal the consensus machine gives up on (``ProposalFailed``) gives ``outcome_unknown``.
4. A key already applied when the client starts waiting (a retried request id) is answered at once.

``ForwardedRequests`` (at every other core):

1. ``forward_target``: a request is forwarded only if it was not forwarded already (one hop, so
   two cores that each believe the other is the sequencer cannot bounce it) and the sequencer is
   known and is not this core; otherwise the client is told ``no_sequencer`` and retries.
2. A forwarded request whose sequencer is replaced (this core follows another one now), or that
   is not answered within ``timeout_ms``, gets ``outcome_unknown`` at once: the old sequencer may
   be dead, and the client retries with the same request id.
3. At most ``forwarded_max`` are pending; the next one is refused (``overloaded``).
4. A request forwarded again while its id is still pending (a client that heard nothing resends on
   a new connection) replaces the earlier one, which is told ``outcome_unknown`` at once: the
   sequencer's one answer for that id goes to the newest, and the earlier would wait forever. The
   driver forwards a write under its client's request id (the sequencer applies an id once) and a
   read under a fresh one of its own, so that a read's answer goes to the connection that asked it
   and to no other client that chose the same id.
5. A forward whose frame never left this core (``unsent``: dropped at send, the sequencer's send
   queue full) is answered at once, not at ``timeout_ms``: nothing reached the sequencer, so the
   client is told ``no_sequencer`` as under rule 1 (and retries). Only a request that replaced an
   earlier forward of its id (rule 4), which may have reached it, is told ``outcome_unknown``.

Both hold the client's reply address as an opaque ``payload``; the driver turns each
``Acknowledged`` / ``OutcomeUnknown`` into a frame. The simulator (``tests/sim/cluster.py``) runs
``CommitWaiters`` for its clients' writes and checks every acknowledgement against the committed log.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from mnesite.rlog.types import Entry, TxKey
from msgspec import Struct

Payload = TypeVar("Payload")

REASON_TRUNCATED = "its entry was replaced by the new sequencer"
REASON_OTHER_ENTRY = "another entry committed at its key"
REASON_FORWARD_TIMEOUT = "the sequencer did not answer in time"
REASON_SENT_AGAIN = "the request was sent again; the answer goes to the newest"


class Acknowledged(Struct, frozen=True):
    """The write committed at ``tx_key`` (``duplicate``: a retry of a request id already in the rlog)."""

    request_id: str
    tx_key: TxKey
    duplicate: bool = False


@dataclass(frozen=True)
class OutcomeUnknown:
    """The core cannot tell whether the write committed: retry with the same request id."""

    request_id: str
    reason: str


Outcome = Acknowledged | OutcomeUnknown


# Requests of one connection waiting under one request id for one entry: a client resends on silence,
# a few times; more are answered by the answers already owed (``CommitWaiters.wait``).
RESENDS_WAITING_MAX = 8


class CommitWaiters(Generic[Payload]):
    """Writes waiting at the sequencer for their entry to commit (one per shard)."""

    def __init__(self) -> None:
        # tx key -> [(payload, request id, duplicate: a resend of a request id already in the log)]
        self._waiting: dict[TxKey, list[tuple[Payload, str, bool]]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @staticmethod
    def answer_now(tx_key: TxKey, request_id: str, applied_key: TxKey, duplicate: bool = False) -> Acknowledged | None:
        """Rule 4: the answer if ``tx_key`` is applied already; None: ``wait`` for it."""
        return Acknowledged(request_id, tx_key, duplicate) if tx_key <= applied_key else None

    def wait(self, tx_key: TxKey, request_id: str, payload: Payload, duplicate: bool = False) -> bool:
        """Wait for ``tx_key`` to commit (after ``answer_now`` said None); every request waiting gets its
        answer. False, and nothing added, for a resend (``duplicate``) of a ``payload`` (a connection)
        that waits under ``request_id`` with ``RESENDS_WAITING_MAX`` requests already: the answers to
        come are its answers, and its resends cannot grow this without bound."""
        waiting = self._waiting.setdefault(tx_key, [])
        if duplicate and sum(p == payload and r == request_id for p, r, _ in waiting) >= RESENDS_WAITING_MAX:
            return False
        waiting.append((payload, request_id, duplicate))
        self._count += 1
        return True

    def committed(self, entries: Iterable[Entry]) -> list[tuple[Payload, Outcome]]:
        """Rule 1: the entries just committed (or, read back from the log, applied), in order."""
        answers: list[tuple[Payload, Outcome]] = []
        if not self._waiting:
            return answers  # a follower's, usually: nobody waits there, and it hears commits all the time
        for entry in entries:
            for payload, request_id, duplicate in self._pop(entry.tx_key):
                if entry.request_id == request_id:
                    answers.append((payload, Acknowledged(request_id, entry.tx_key, duplicate)))
                else:
                    answers.append((payload, OutcomeUnknown(request_id, REASON_OTHER_ENTRY)))
        return answers

    def truncated(self, after_key: TxKey) -> list[tuple[Payload, Outcome]]:
        """Rule 2: the tail after ``after_key`` was removed."""
        answers: list[tuple[Payload, Outcome]] = []
        for key in sorted(k for k in self._waiting if k > after_key):
            answers += [(payload, OutcomeUnknown(r, REASON_TRUNCATED)) for payload, r, _ in self._pop(key)]
        return answers

    def failed(self, tx_key: TxKey, reason: str) -> list[tuple[Payload, Outcome]]:
        """Rule 3: the consensus machine gave up on the proposal at ``tx_key``."""
        return [(payload, OutcomeUnknown(request_id, reason)) for payload, request_id, _ in self._pop(tx_key)]

    def abandoned(self, reason: str) -> list[tuple[Payload, Outcome]]:
        """Every waiter, when the log they wait on is replaced (a snapshot install)."""
        answers: list[tuple[Payload, Outcome]] = []
        for key in sorted(self._waiting):
            answers += [(payload, OutcomeUnknown(r, reason)) for payload, r, _ in self._pop(key)]
        return answers

    def _pop(self, tx_key: TxKey) -> list[tuple[Payload, str, bool]]:
        waiting = self._waiting.pop(tx_key, [])
        self._count -= len(waiting)
        return waiting


def forward_target(sequencer: str | None, core_name: str, already_forwarded: bool) -> str | None:
    """Rule 1 of forwarding: the core to forward to, or None (the client is told ``no_sequencer``)."""
    if already_forwarded or sequencer is None or sequencer == core_name:
        return None
    return sequencer


@dataclass(frozen=True)
class Unsent(Generic[Payload]):
    """Rule 5: a forward dropped at send. ``may_have_reached``: it replaced an earlier forward of its
    request id (rule 4), which may have reached the sequencer (``outcome_unknown``); otherwise nothing
    of the request did (``no_sequencer``)."""

    payload: Payload
    shard: str
    sequencer: str
    may_have_reached: bool


@dataclass
class _Forwarded(Generic[Payload]):
    payload: Payload
    deadline_ms: int
    shard: str
    sequencer: str
    replaced: bool = False  # it replaced an earlier forward of its request id (rule 4)


class ForwardedRequests(Generic[Payload]):
    """Requests this core forwarded to a sequencer, waiting for the answer to relay."""

    def __init__(self, forwarded_max: int, timeout_ms: int) -> None:
        self.forwarded_max = forwarded_max
        self.timeout_ms = timeout_ms
        self._pending: dict[str, _Forwarded[Payload]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def full(self) -> bool:
        """Rule 3."""
        return len(self._pending) >= self.forwarded_max

    def forwarded(
        self, request_id: str, payload: Payload, shard: str, sequencer: str, now_ms: int
    ) -> list[tuple[Payload, Outcome]]:
        """Wait for the answer to ``request_id``; rule 4: what to tell the request it replaces, if any."""
        replaced = self._pending.pop(request_id, None)
        self._pending[request_id] = _Forwarded(
            payload, now_ms + self.timeout_ms, shard, sequencer, replaced=replaced is not None
        )
        if replaced is None:
            return []
        return [(replaced.payload, OutcomeUnknown(request_id, REASON_SENT_AGAIN))]

    def answered(self, request_id: str) -> Payload | None:
        """The payload to relay the sequencer's answer to; None for an answer nobody waits for."""
        pending = self._pending.pop(request_id, None)
        return pending.payload if pending is not None else None

    def unsent(self, request_id: str) -> Unsent[Payload] | None:
        """Rule 5: the forward of ``request_id`` was dropped at send; who to answer now. None: nobody
        waits for it."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return None
        return Unsent(pending.payload, pending.shard, pending.sequencer, may_have_reached=pending.replaced)

    def sequencer_changed(self, shard: str, sequencer: str | None) -> list[tuple[Payload, Outcome]]:
        """Rule 2: this core now follows ``sequencer`` (None: none) in ``shard``."""
        replaced = [r for r, f in self._pending.items() if f.shard == shard and f.sequencer != sequencer]
        answers: list[tuple[Payload, Outcome]] = []
        for request_id in replaced:
            pending = self._pending.pop(request_id)
            answers.append((pending.payload, OutcomeUnknown(request_id, f"sequencer {pending.sequencer} was replaced")))
        return answers

    def expired(self, now_ms: int) -> list[tuple[Payload, Outcome]]:
        """Rule 2: not answered in time."""
        late = [r for r, f in self._pending.items() if f.deadline_ms <= now_ms]
        return [(self._pending.pop(r).payload, OutcomeUnknown(r, REASON_FORWARD_TIMEOUT)) for r in late]
