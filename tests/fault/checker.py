"""A per-key linearizability checker for register histories recorded from real clients.

Theory of operation. Each key of the test table is a register holding a unique integer or nothing
(``None``: the row is absent). Clients run four kinds of operation on it:

* ``read``: returns the value (a ``linearizable`` read);
* ``write``: a blind write of a value no other operation ever writes;
* ``cas``: a transaction whose guard says "the row equals ``expected``" and that writes ``value``.
  It succeeds (``ok``) or fails (``fail``); a failed guard reports the row it found, so a failed CAS is
  a read that must also differ from ``expected``;
* any write or CAS whose outcome is ``unknown`` (the client timed out): it may have taken effect at any
  moment after its invocation, even long after the client gave up, or never.

A history is linearizable when there is one total order of the operations that respects real time
(an operation that completed before another was invoked comes first) and in which every operation
sees the register as the ones before it left it. The search is Wing and Gong's: walk the history in
time order, try to linearize any pending operation whose invocation precedes the earliest pending
completion, and backtrack when a completion arrives whose operation could not be placed. Lowe's
memoisation makes it practical: a configuration (set of linearized operations, register value)
that was explored once is never explored again. Operations of unknown outcome have no completion:
they are optional, so the search succeeds once every operation with a known outcome is placed.
An unknown write whose value nobody ever observed is dropped before the search: placing it can
only make later reads harder to explain, so dropping it loses no linearization.

The search is bounded by ``steps_max``; past it the verdict is ``undetermined``, never a pass.
This module is pure (no clock, no sockets): the recorder in ``tests/fault/history.py`` feeds it.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

READ = "read"
WRITE = "write"
CAS = "cas"
KINDS = (READ, WRITE, CAS)

OK = "ok"
FAIL = "fail"
UNKNOWN = "unknown"
STATUSES = (OK, FAIL, UNKNOWN)

# The search budget: a step is one look at one event. A legal history with about ten clients
# in flight needs some hundred steps per operation (each placement rescans the pending calls);
# a thousand per operation leaves room and still bounds the time to about a second per thousand.
STEPS_PER_OPERATION_MAX = 1000
STEPS_MIN = 100_000


@dataclass(frozen=True)
class Operation:
    """One client operation on one key, with its invocation and completion times (seconds, one clock).

    ``value``: what a write or CAS writes, or what a read (or a failed CAS) found (``None``: absent).
    ``expected``: the CAS guard. ``completed_s`` is ``math.inf`` for an unknown outcome.
    """

    process: int
    key: int
    kind: str
    status: str
    invoked_s: float
    completed_s: float
    value: int | None = None
    expected: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.status not in STATUSES:
            raise ValueError(f"bad operation kind {self.kind!r} or status {self.status!r}")
        if self.kind == READ and self.status != OK:
            raise ValueError("a read without an answer tells nothing: leave it out of the history")
        if self.kind == WRITE and self.status == FAIL:
            raise ValueError("a write never fails for certain here: record it as unknown")
        if self.status == UNKNOWN and self.completed_s != math.inf:
            raise ValueError("an operation of unknown outcome has no completion time")
        if self.completed_s < self.invoked_s:
            raise ValueError("an operation completed before it was invoked")

    def describe(self) -> str:
        completed = "open" if self.completed_s == math.inf else f"{self.completed_s:.4f}"
        if self.kind == READ:
            what = f"read -> {self.value}"
        elif self.kind == WRITE:
            what = f"write {self.value}"
        elif self.status == FAIL:
            what = f"cas {self.expected} -> ? failed, found {self.value}"
        else:
            what = f"cas {self.expected} -> {self.value}"
        return f"[{self.invoked_s:.4f}, {completed}] p{self.process} key {self.key}: {what} ({self.status})"


class Verdict(enum.Enum):
    LINEARIZABLE = "linearizable"
    VIOLATION = "violation"
    UNDETERMINED = "undetermined"  # the search budget ran out: nothing was proved


@dataclass
class KeyResult:
    key: int
    verdict: Verdict
    operations: int
    steps: int
    # On a violation: the longest prefix of operations the search could place, and the history.
    linearized_max: list[Operation] = field(default_factory=list)
    history: list[Operation] = field(default_factory=list)
    # Reads that are stale (or of a value nobody wrote) for certain, found before any search.
    stale: list[Operation] = field(default_factory=list)

    def report(self, around: int = 30) -> str:
        lines = [f"key {self.key}: {self.verdict.value} ({self.operations} operations, {self.steps} steps)"]
        if self.verdict is Verdict.LINEARIZABLE:
            return "\n".join(lines)
        if self.stale:
            lines.append(f"  {len(self.stale)} reads saw a value overwritten before they began, or never written:")
            for read in self.stale[:around]:
                lines.append(f"    {read.describe()}")
                writers = [op for op in self.history if op.kind in (WRITE, CAS) and op.value == read.value]
                lines += [f"      written by {op.describe()}" for op in writers if op is not read]
            return "\n".join(lines)
        placed = {id(op) for op in self.linearized_max}
        lines.append(f"  longest linearizable prefix ({len(self.linearized_max)} operations) ends with:")
        lines += [f"    {op.describe()}" for op in self.linearized_max[-5:]]
        # The operations that could not be placed and overlap the end of that prefix explain the failure.
        frontier = self.linearized_max[-1].invoked_s if self.linearized_max else -math.inf
        pending = [op for op in self.history if id(op) not in placed and op.completed_s >= frontier]
        lines.append("  first operations that could not be placed after it:")
        lines += [f"    {op.describe()}" for op in pending[:around]]
        return "\n".join(lines)


def _observed(history: list[Operation]) -> set[int | None]:
    """Values some operation saw: read results, rows found by failed CAS, CAS guards."""
    seen: set[int | None] = set()
    for op in history:
        if op.kind == READ or (op.kind == CAS and op.status == FAIL):
            seen.add(op.value)
        if op.kind == CAS:
            seen.add(op.expected)
    return seen


def _step(op: Operation, state: int | None) -> tuple[bool, int | None]:
    """Whether ``op`` may take effect on a register holding ``state``, and the register after it."""
    if op.kind == READ:
        return op.value == state, state
    if op.kind == WRITE:
        return True, op.value
    if op.status == FAIL:
        return op.value == state and op.expected != state, state
    if op.status == OK:
        return op.expected == state, op.value
    # Unknown CAS: it took effect only if its guard held; placing it where it would fail changes nothing.
    return True, (op.value if op.expected == state else state)


def _definitely_stale(operations: list[Operation], initial: int | None) -> list[Operation]:
    """Reads (and failed CAS) that no linearization can explain, found without a search.

    A read of ``v`` is stale for certain when the only operation that wrote ``v`` completed before
    some acknowledged write ``w`` was invoked, and ``w`` completed before the read was invoked:
    every order puts that write of ``v``, then ``w``, then the read, and values are never written
    twice. The initial value counts as written before everything (the model has no delete). A read
    of a value that nothing wrote is impossible as well. This settles, in O(n log n), histories whose
    many concurrent reads would exhaust the search's budget (a paused node answering a burst of
    queued reads), and it never condemns a linearizable history.
    """
    written_at: dict[int | None, float] = {initial: -math.inf}
    for op in operations:
        if op.kind in (WRITE, CAS) and not (op.kind == CAS and op.status == FAIL):
            written_at[op.value] = op.completed_s  # math.inf for an unknown outcome: never "before"
    acknowledged = sorted(
        (op for op in operations if op.status == OK and op.kind in (WRITE, CAS)), key=lambda op: op.invoked_s
    )
    invoked = [op.invoked_s for op in acknowledged]
    # earliest_completion[i]: the earliest completion among acknowledged writes invoked at or after invoked[i].
    earliest_completion = [math.inf] * (len(acknowledged) + 1)
    for index in range(len(acknowledged) - 1, -1, -1):
        earliest_completion[index] = min(acknowledged[index].completed_s, earliest_completion[index + 1])
    stale = []
    for op in operations:
        if not (op.kind == READ or (op.kind == CAS and op.status == FAIL)):
            continue
        if op.value not in written_at:
            stale.append(op)
            continue
        first_later = bisect.bisect_right(invoked, written_at[op.value])
        if earliest_completion[first_later] < op.invoked_s:
            stale.append(op)
    return stale


class _Node:
    """One call or completion event in the doubly linked list the search unlinks and relinks."""

    __slots__ = ("index", "op", "is_call", "match", "previous", "next")

    def __init__(self, index: int, op: Operation | None, is_call: bool) -> None:
        self.index = index
        self.op = op
        self.is_call = is_call
        self.match: _Node | None = None
        self.previous: _Node | None = None
        self.next: _Node | None = None


def check_key(
    key: int,
    history: Iterable[Operation],
    initial: int | None = None,
    steps_max: int | None = None,
    search_only: bool = False,
) -> KeyResult:
    """Decide whether one key's history is linearizable, starting from ``initial``.

    ``steps_max``: the search budget (default ``STEPS_PER_OPERATION_MAX`` per operation). ``search_only``
    skips the stale-read pre-check (the self-tests show the search alone catches the same histories)."""
    operations = [op for op in history if op.key == key]
    seen = _observed(operations)
    # Dropped: unknown writes nobody observed (see the theory of operation). Kept: everything else.
    operations = [
        op for op in operations if not (op.status == UNKNOWN and op.kind in (WRITE, CAS) and op.value not in seen)
    ]
    operations.sort(key=lambda op: op.invoked_s)
    if steps_max is None:
        steps_max = max(STEPS_MIN, STEPS_PER_OPERATION_MAX * len(operations))
    stale = [] if search_only else _definitely_stale(operations, initial)
    if stale:
        return KeyResult(key, Verdict.VIOLATION, len(operations), 0, stale=stale, history=operations)
    events: list[tuple[float, int, int, bool]] = []
    for index, op in enumerate(operations):
        # At equal times a call sorts before a completion: the two operations count as concurrent.
        events.append((op.invoked_s, 0, index, True))
        if op.status != UNKNOWN:
            events.append((op.completed_s, 1, index, False))
    events.sort()
    head = _Node(-1, None, False)
    calls: dict[int, _Node] = {}
    tail = head
    for _, _, index, is_call in events:
        node = _Node(index, operations[index], is_call)
        if is_call:
            calls[index] = node
        else:
            calls[index].match = node
        tail.next, node.previous, tail = node, tail, node

    def lift(call: _Node) -> None:
        call.previous.next = call.next
        if call.next is not None:
            call.next.previous = call.previous
        completion = call.match
        if completion is not None:
            completion.previous.next = completion.next
            if completion.next is not None:
                completion.next.previous = completion.previous

    def unlift(call: _Node) -> None:
        completion = call.match
        if completion is not None:
            completion.previous.next = completion
            if completion.next is not None:
                completion.next.previous = completion
        call.previous.next = call
        if call.next is not None:
            call.next.previous = call

    # The set of placed operations, kept canonical and small: definite operations are numbered in
    # invocation order and a search mostly places them in about that order, so the set is "the first
    # ``prefix`` of them" plus a few placed beyond; unknown ones are few and kept as a set. A bit
    # set of every operation would cost O(n) per step and make long histories quadratic.
    definite_number: dict[int, int] = {}
    for index, op in enumerate(operations):
        if op.status != UNKNOWN:
            definite_number[index] = len(definite_number)
    definite_total = len(definite_number)
    prefix = 0
    beyond: frozenset[int] = frozenset()
    unknown_placed: frozenset[int] = frozenset()
    state = initial
    cache: set[tuple[int, frozenset[int], frozenset[int], int | None]] = {(prefix, beyond, unknown_placed, initial)}
    stack: list[tuple[_Node, int | None, int, frozenset[int], frozenset[int]]] = []
    longest: list[int] = []
    steps = 0
    entry = head.next
    while prefix < definite_total:
        steps += 1
        if steps > steps_max:
            return KeyResult(key, Verdict.UNDETERMINED, len(operations), steps)
        if entry is not None and entry.is_call:
            allowed, after = _step(entry.op, state)
            if allowed:
                new_prefix, new_beyond, new_unknown = prefix, beyond, unknown_placed
                number = definite_number.get(entry.index)
                if number is None:
                    new_unknown = unknown_placed | {entry.index}
                elif number == prefix:
                    new_prefix += 1
                    if new_prefix in beyond:
                        rest = set(beyond)
                        while new_prefix in rest:
                            rest.discard(new_prefix)
                            new_prefix += 1
                        new_beyond = frozenset(rest)
                else:
                    new_beyond = beyond | {number}
                configuration = (new_prefix, new_beyond, new_unknown, after)
                if configuration not in cache:
                    cache.add(configuration)
                    stack.append((entry, state, prefix, beyond, unknown_placed))
                    state, prefix, beyond, unknown_placed = after, new_prefix, new_beyond, new_unknown
                    lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
            continue
        # A completion whose operation is not placed (or the end of the list): undo the last choice.
        if len(stack) > len(longest):
            longest = [call.index for call, *_ in stack]  # only at a backtrack: snapshots stay rare
        if not stack:
            return KeyResult(
                key,
                Verdict.VIOLATION,
                len(operations),
                steps,
                linearized_max=[operations[index] for index in longest],
                history=operations,
            )
        entry, state, prefix, beyond, unknown_placed = stack.pop()
        unlift(entry)
        entry = entry.next
    return KeyResult(key, Verdict.LINEARIZABLE, len(operations), steps)


def check_history(
    history: list[Operation], initial: dict[int, int | None] | None = None, steps_max: int | None = None
) -> list[KeyResult]:
    """Check every key independently (a register per key is P-compositional: Herlihy and Wing)."""
    keys = sorted({op.key for op in history})
    return [check_key(key, history, (initial or {}).get(key), steps_max) for key in keys]
