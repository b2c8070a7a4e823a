"""A core's rule-book (pure): what it does with a client's write, fence, retry and membership change.

Theory of operation
-------------------
The driver (``core/node.py``) owns the sockets and SQLite. Everything it must *decide* about a
request lives here, as functions of what it knows, so that the deterministic simulator
(``tests/sim``) runs the very same decisions under crashes, partitions and pauses:

* ``admit_write``: a write's shard and what it logs. Schema changes are checked with the apply's
  own rules (``rlog.schema``) against the catalog as the unapplied tails leave it, so what is
  logged applies on every node; a transaction is checked against that catalog (tables, types, one
  shard) and its guards are evaluated next, by ``core.transaction.evaluate``.
* ``route_write``: where a write goes. A request id already in this core's log is a **retry**: it
  is routed by that entry's shard and answered with that entry's key once committed; it is never
  admitted or proposed again (a client that heard no answer retries with the same id; the write
  takes effect once). Otherwise the sequencer proposes it; any other core forwards it once
  (``core.outcome.forward_target``) or refuses it with ``no_sequencer``; a core a forced start left
  out of the shard refuses it (``excluded``).
* ``HeldWrites`` and ``batch_outcomes``: a turn's writes without guards are held and proposed as one
  ``ProposedBatch``, in arrival order, before any other event of their shard's machine (a guarded
  write, a schema change, a resend of a held request id, an append, a tick) and at the end of the
  turn's input; each held write then waits for the entry carrying its request id, or hears why the
  batch refused it.
* ``guard_failure_answer``: a failed guard confirmed from committed state is answered
  ``guard_failed`` with the row found; one that cannot be confirmed is ``no_sequencer``: nothing
  was written, and the client retries with the same request id.
* ``fence_read`` and ``check_applied``: a linearizable read is answered only at the sequencer while
  ``ShardConsensus.read_index`` gives a key (elsewhere it is forwarded); a read that must see a key
  (read-your-writes) is refused ``not_applied`` until this core applied it.
* ``not_serving_reason``: whether a core serves local reads of a shard, and why not: not while a
  snapshot install is under way or its read fence is not reached (the install's own words), not
  while an install that deleted the shard's rows has not copied them again (``rows_lost``: the rows
  are half copied), not while a forced start left it out of the shard (``excluded``), and not while
  its consensus cannot follow the log (``stuck_reason``): in both its applied state stops while the
  others go on, so its reads would be ever staler.
* ``catalog_incomplete``: whether a table this core does not know may exist all the same: while one
  of its shards is not serving, or is below the vote floor that its recovery from an empty disk set
  (it holds less of the log than its peers did), a request naming an unknown table is answered
  ``not_ready`` (ask again or another core), never ``unknown_table`` (no such table).
* ``admit_membership_change``: an operator's add or remove at the sequencer: a retry while its
  change is pending or once it is in the log changes nothing; an add names an endpoint, and a core
  this one cannot speak with (``core.versions``) is not added.
* ``journal_verdict``: how this core's journal compares with the forced sequencer's at one key.
* ``ack_sender_allowed``: only the replicant an agent serves may move that agent's window.
* ``FollowerApply``: when a follower applies what it learned is committed. Applying is not what makes
  an entry durable or committed (the log is, and a restart applies again whatever was not applied),
  so a follower gathers the commits it hears and applies them together: at most ``delay_ms_max``
  after the first of them, at ``entries_max`` entries or ``bytes_max`` bytes, and at once when
  anything waits for its applied state (a read that must see a key, a query, a changefeed, a watch,
  a client's write or a held guard) or when the commit carries more than rows (a schema change, a
  membership or a cluster version), and at every commit on a sequencer or with ``delay_ms_max`` 0.
  A commit rewrites the data pages it changes in the WAL: the 64 clients' key ranges of a benchmark
  dirty about 34 pages a commit, and gathering eight commits writes most hot pages once instead of
  eight times (``benchmarks/PROFILE.md``, tenth session).
* ``commit_heard``: what a Commit effect does, in order. The writes waiting for the entries it
  commits are told first (``core.outcome.CommitWaiters``, rule 1): those entries are durable on a
  majority through earlier turns' commits, so the answer cannot be undone by whatever becomes of
  this turn; then ``FollowerApply`` decides whether to apply now, asked after the telling, so that a
  write already told no longer counts as waiting for this core's applied state.
* ``applied_waited_on``: what counts as waiting for a core's applied state (the ``waited_on`` of
  ``FollowerApply``): a client's write, a held guard, a query or a changefeed request.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from mnesite.core.consensus import (
    Commit,
    PersistEntries,
    PersistState,
    ProposalRejected,
    Proposed,
    ProposedBatch,
    Send,
)
from mnesite.core.outcome import CommitWaiters, Outcome, forward_target
from mnesite.core.transaction import GuardFailed, Transaction, parse_transaction
from mnesite.rlog.errors import RequestError
from mnesite.rlog.roles import WRITE_KINDS
from mnesite.rlog.schema import (
    DEFAULT_SHARD,
    TableSchema,
    check_column_addable,
    check_creatable,
    check_droppable,
    check_index_creatable,
    check_index_droppable,
    define_table,
    find_index,
)
from mnesite.rlog.types import ROW_OPS, AddColumnOp, CreateIndexOp, DropIndexOp, DropTableOp, Entry, Op, TxKey
from mnesite.rlog.versions import packs_runs
from msgspec import Struct

SCHEMA_CHANGE_KINDS = WRITE_KINDS - {"transact"}


# -- writes ----------------------------------------------------------------------------------------


class Admitted(Struct, frozen=True):
    """A write that passed admission: its shard, and either the ops it logs or the transaction to evaluate."""

    shard: str
    ops: tuple[Op, ...] = ()
    transaction: Transaction | None = None


def admit_write(kind: str, body: Any, catalog: dict[str, TableSchema], transaction_ops_max: int) -> Admitted:
    """Check a decoded write request against ``catalog`` (every shard's unapplied tail applied over
    the committed one); raises ``RequestError`` or ``rlog.schema.SchemaError`` when it is refused."""
    if kind == "transact":
        transaction = parse_transaction(body, catalog, transaction_ops_max)
        return Admitted(transaction.shard, transaction=transaction)
    op = schema_change_op(kind, body, catalog)
    return Admitted(op.shard, ops=(op,))


def schema_change_op(kind: str, body: Any, catalog: dict[str, TableSchema]) -> Any:
    """The op of a create/drop table, create/drop index or add column request, checked by the
    apply's own rule (``rlog.schema``): what is logged applies everywhere."""
    if kind == "create_table":
        table = define_table(body.table, body.key, body.columns, body.shard or DEFAULT_SHARD)
        op = table.to_op()
        # SQLite names are case-insensitive: the apply's rule decides what "taken" means.
        if not check_creatable(catalog, op):
            raise RequestError("table_exists", f"table {table.name!r} already exists in shard {table.shard!r}")
        return op
    if kind == "drop_index":
        found = find_index(catalog, body.index)
        if found is None:
            raise RequestError("unknown_index", f"unknown index {body.index!r}")
        op = DropIndexOp(body.index, found[0].name, found[0].shard)
        check_index_droppable(catalog, op)
        return op
    if kind not in SCHEMA_CHANGE_KINDS:
        raise RequestError("bad_request", f"{kind} is not a write")
    table = catalog.get(body.table)
    if table is None:
        raise RequestError("unknown_table", f"unknown table {body.table!r}")
    if kind == "drop_table":
        op = DropTableOp(table.name, table.shard)
        if not check_droppable(catalog, op):
            raise RequestError("unknown_table", f"unknown table {body.table!r}")
        return op
    if kind == "create_index":
        op = CreateIndexOp(body.index, table.name, table.shard, tuple(body.columns))
        if not check_index_creatable(catalog, op):
            raise RequestError("index_exists", f"index {body.index!r} already exists on {table.name!r}")
        return op
    op = AddColumnOp(table.name, table.shard, body.column, str(body.type).upper())
    if not check_column_addable(catalog, op):
        raise RequestError("column_exists", f"{table.name} has a column {body.column!r} already")
    return op


class ShardView(Struct, frozen=True):
    """What a core knows of one shard when a request for it arrives."""

    shard: str
    is_sequencer: bool
    sequencer: str | None
    excluded: bool = False


@dataclass(frozen=True)
class AwaitCommit:
    """Answer once ``tx_key`` is applied (``duplicate``: the request id was in the log already)."""

    tx_key: TxKey
    duplicate: bool


@dataclass(frozen=True)
class Forward:
    """Send the request, marked forwarded, to the sequencer ``target``; relay its answer."""

    target: str


class Propose(Struct, frozen=True):
    """This core is the sequencer and the request is new: evaluate its guards and propose it."""


WriteRoute = AwaitCommit | Forward | Propose


def route_write(view: ShardView, me: str, forwarded: bool, earlier_key: TxKey | None) -> WriteRoute:
    """Where a write for ``view.shard`` goes. ``earlier_key``: the key of the entry this core's log
    holds with the request's id (a retry), if any; ``forwarded``: another core forwarded it here."""
    if view.excluded:
        raise RequestError("excluded", f"{me} was left out of shard {view.shard} by a forced start")
    if view.is_sequencer:
        return AwaitCommit(earlier_key, duplicate=True) if earlier_key is not None else Propose()
    target = forward_target(view.sequencer, me, forwarded)
    if target is None:
        raise RequestError(
            "no_sequencer", f"shard {view.shard} has no sequencer reachable from {me} (election or no quorum)"
        )
    return Forward(target)


T = TypeVar("T")
P = TypeVar("P")  # where an outcome goes (the driver: a reply envelope; the simulator: a client)


def holds_write(transaction: Transaction | None) -> bool:
    """A write that reads nothing (a transaction without guards) is held for the turn's batch; a
    guarded write or a schema change is proposed at once, after the held ones, so that what follows
    it in the turn (a guard, an admission) sees it in the unapplied tail."""
    return transaction is not None and not transaction.guards


@dataclass
class HeldWrites(Generic[T]):
    """One shard's writes held in this loop turn, each with the driver's context (where its answer
    goes). The driver proposes them (``take``) before stepping its shard's machine with anything
    else, so the log order is the arrival order; bounded by the driver with its waiters."""

    held: list[tuple[Proposed, T]] = field(default_factory=list)
    request_ids: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, proposed: Proposed, context: T) -> None:
        self.held.append((proposed, context))
        self.request_ids.add(proposed.request_id or "")

    def holds(self, request_id: str) -> bool:
        """A resend of a held write: the driver proposes the held ones first, then answers it from the log."""
        return request_id in self.request_ids

    def take(self, cluster_version: int = 1) -> tuple[ProposedBatch, list[tuple[str, T]]]:
        """The batch to step, and each write's (request id, context), in arrival order; empties the hold.
        ``cluster_version``: the shard's applied one, which decides how its entries pack their rows."""
        held, self.held = self.held, []
        self.request_ids = set()
        batch = ProposedBatch(tuple(proposed for proposed, _ in held), packs_runs(cluster_version))
        return batch, [(proposed.request_id or "", context) for proposed, context in held]


def batch_outcomes(effects: Iterable[Any]) -> tuple[dict[str, TxKey], dict[str, ProposalRejected]]:
    """What a ``ProposedBatch`` step did with each request id: the key of its entry (it waits for
    that entry to commit), or the machine's rejection (not the sequencer, too large, ...)."""
    keys: dict[str, TxKey] = {}
    refused: dict[str, ProposalRejected] = {}
    for effect in effects:
        if isinstance(effect, PersistEntries):
            for entry in effect.entries:
                if entry.request_id is not None:
                    keys[entry.request_id] = entry.tx_key
        elif isinstance(effect, ProposalRejected) and effect.request_id is not None:
            refused[effect.request_id] = effect
    return keys, refused


def guard_failure_answer(failure: GuardFailed, confirmed: bool, reason: str) -> tuple[str, str, Any]:
    """The error (code, message, detail) a failed guard is answered with (``core.guard_tail`` decides
    ``confirmed``): the row found when committed state confirms it; otherwise a retry."""
    if confirmed:
        return "guard_failed", failure.describe(), {"index": failure.index, "actual": failure.actual}
    # Nothing was written: the client retries with the same request id and is evaluated afresh.
    return "no_sequencer", f"the guard failed but cannot be confirmed from committed state ({reason}); retry", None


# -- reads -----------------------------------------------------------------------------------------


def fence_read(view: ShardView, me: str, forwarded: bool, read_index: TxKey | None) -> TxKey | Forward:
    """A linearizable read or ``read_index`` request: the key it must reflect (at the sequencer, while
    its lease and its generation's first commit allow: ``ShardConsensus.read_index``) or where to
    forward it. Refused when neither is possible: the client retries elsewhere."""
    if not view.is_sequencer:
        target = forward_target(view.sequencer, me, forwarded)
        if target is None:
            raise RequestError("no_sequencer", f"shard {view.shard} has no sequencer reachable from {me}")
        return Forward(target)
    if read_index is None:
        raise RequestError(
            "no_sequencer",
            f"{me} cannot serve a linearizable read of shard {view.shard} now "
            "(its generation's first entry has not committed, or no majority answered it recently)",
        )
    return read_index


def read_index_feeds_lazy_followers(kind: str, forwarded: bool) -> bool:
    """Whether a sequencer answering this read steps ``FeedRequested`` (core.consensus, "Lazy followers"):
    a ``read_index`` another core forwarded, which that core (a follower's linearizable query, a
    replicant's read) then waits to apply; a lazy follower would make it wait for its next feed."""
    return kind == "read_index" and forwarded


def check_applied(me: str, min_key: TxKey | None, applied: TxKey | None) -> None:
    """Read-your-writes: a read that must see ``min_key`` waits (the client retries) until it is applied."""
    if min_key is not None and (applied is None or applied < min_key):
        raise RequestError("not_applied", f"{me} has not applied {min_key} yet")


# What a core says when an install deleted a shard's rows and none copied them since, and its install
# said nothing of it (the driver's installs do: ``CoreNode._execute_install``; the simulator's are one step).
ROWS_LOST_REASON = (
    "a snapshot install was abandoned (the shard's rows are half copied); asking the sequencer for another offer"
)


def not_serving_reason(
    install_reason: str | None,
    rows_lost: bool,
    stuck_reason: str | None,
    applied: TxKey | None,
    excluded_generation: int | None = None,
) -> str | None:
    """Why a core serves no local read of a shard now (None: it serves); reads hear it as ``not_ready``
    and ``status`` shows it (``not_serving_reason``). ``install_reason``: what the shard's snapshot
    install says while it keeps the shard from serving (``core.snapshot``: copying, its read fence not
    reached, interrupted or abandoned); ``rows_lost``: an install deleted the shard's rows and none has
    copied them since; ``stuck_reason``: ``ShardConsensus.stuck_reason``; ``applied``: this core's
    applied key of the shard, where its state stopped; ``excluded_generation``: the forced generation
    that left this core out of the shard (``ShardConsensus.excluded``), if one did."""
    if install_reason is not None:
        return install_reason
    if excluded_generation is not None:
        at = f" at {applied}" if applied is not None else ""
        # No sequencer feeds it any more while the forced generation goes on (its journal may even
        # diverge from it), and none counts it as a follower, so no lag says how stale it is: a local
        # read would be ever staler, silently. Before the exclusion was known, it was a follower.
        return (
            f"left out of the shard by a forced start (generation {excluded_generation}); its applied state "
            f"stopped{at}: rebuild it and add it again (cluster add-core)"
        )
    if rows_lost:
        return ROWS_LOST_REASON
    if stuck_reason is not None:
        at = f" at {applied}" if applied is not None else ""
        # Its applied state stops there while the others go on: a local read would be ever staler.
        return f"stopped{at}: {stuck_reason}"
    return None


def catalog_incomplete(shards: Iterable[tuple[str, str | None, TxKey | None, TxKey]]) -> str | None:
    """Why a table unknown at this core may exist all the same (None: its catalog holds what its
    shards' logs hold). ``shards``: per shard, its name, ``not_serving_reason``, this core's applied
    key (None: no position) and the vote floor of its recovery from an empty disk (``ZERO_KEY``: none).
    A shard not serving may have lost its tables with its rows (an install); one below its vote floor
    has not applied what its peers held when it was rebuilt, its tables' creation perhaps among it."""
    for shard, not_serving, applied, floor in shards:
        if not_serving is not None:
            return f"shard {shard}: {not_serving}"
        if applied is not None and applied < floor:
            return f"shard {shard} is recovering from an empty disk: applied {applied} of at least {floor}"
    return None


# -- membership, journals, agents ------------------------------------------------------------------


@dataclass(frozen=True)
class RequestChange:
    """Start the change: step ``MembershipChangeRequested`` with this endpoint (empty for a removal)."""

    endpoint: str


@dataclass(frozen=True)
class StillPending:
    """A retry of a change still catching its learner up: answer when the first one is answered."""


MembershipRoute = RequestChange | StillPending | AwaitCommit


def admit_membership_change(
    add: bool,
    name: str,
    endpoint: str,
    known_endpoint: str | None,
    request_id: str,
    pending: Mapping[str, Any],
    earlier_key: TxKey | None,
    pending_max: int,
    incompatible: str | None = None,
) -> MembershipRoute:
    """An operator's change at the sequencer (``core.membership`` decides whether the machine takes it).
    ``incompatible``: why the core to add may not be a member of the shard, if it may not
    (``core.versions.member_refusal``: this core cannot speak with it, or it cannot read the shard's log)."""
    if request_id in pending:
        return StillPending()
    if earlier_key is not None:
        return AwaitCommit(earlier_key, duplicate=True)
    chosen = endpoint or known_endpoint or ""
    if add and not chosen:
        raise RequestError("bad_request", f"the endpoint of core {name!r} is unknown: give it")
    if add and incompatible is not None:
        raise RequestError("incompatible_version", f"core {name} is refused: {incompatible}")
    if len(pending) >= pending_max:
        raise RequestError("overloaded", "too many membership changes pending")
    return RequestChange(chosen if add else "")


def journal_verdict(key: TxKey, own_digest: bytes | None, their_digest: bytes | None) -> str:
    """How this core's journal compares with the forced sequencer's at ``key`` (said to the operator)."""
    if own_digest is None or their_digest is None:
        return f"cannot compare journals at {key} (one side no longer holds it)"
    if own_digest == their_digest:
        return f"journals agree up to {key}"
    return f"journals DIVERGE at {key}"


def ack_sender_allowed(authenticated: bool, watch_replicant: str | None, principal: str) -> bool:
    """Only the replicant an agent serves may move that agent's window (when peers are authenticated;
    an acknowledgement for an agent that does not exist moves nothing anyway)."""
    return not authenticated or watch_replicant is None or watch_replicant == principal


# What a follower holds committed and not applied, at most (``FollowerApply``): the entries stay in
# the shard's in-memory tail (``core.guard_tail``) until applied.
FOLLOWER_APPLY_ENTRIES_MAX = 4096
FOLLOWER_APPLY_BYTES_MAX = 16 * 1024 * 1024
# Effects a follower's gathered commits may wait through; before any other one (a role change, a
# truncation, a failed proposal, a snapshot's offer) the driver applies what was gathered.
GATHER_THROUGH = frozenset((Commit, PersistEntries, PersistState, Send))


class FollowerApply:
    """A follower's applies of committed entries, gathered (see the module's theory of operation).

    ``committed`` is told of each commit and answers the key to apply up to now, or None while the
    commit may wait; ``due`` answers the same at any other time (a loop turn, a reader waiting);
    ``deadline_ms`` is when a gathered commit must be applied at the latest, for the loop's poll.
    """

    def __init__(
        self,
        delay_ms_max: int,
        entries_max: int = FOLLOWER_APPLY_ENTRIES_MAX,
        bytes_max: int = FOLLOWER_APPLY_BYTES_MAX,
    ) -> None:
        self.delay_ms_max = delay_ms_max
        self.entries_max = entries_max
        self.bytes_max = bytes_max
        self.up_to: TxKey | None = None  # committed, not applied: apply up to this key
        self.since_ms = 0  # when the oldest commit gathered was heard
        self.entries = 0
        self.bytes = 0

    def committed(
        self, up_to: TxKey, entries: Sequence[Entry], following: bool, waited_on: bool, now_ms: int
    ) -> TxKey | None:
        """A commit up to ``up_to`` of ``entries``, the entries it commits that were not committed
        before. ``following``: this core follows the shard and serves it (not a sequencer, a
        candidate, or a shard being installed from a snapshot); ``waited_on``: something waits for
        this core's applied state. Only entries of rows may wait: a schema change, a membership or a
        cluster version changes what the node itself does next."""
        if self.up_to is None:
            self.since_ms = now_ms
        if self.up_to is None or up_to > self.up_to:
            self.up_to = up_to
        if not following or self.delay_ms_max == 0 or not all(ROW_OPS.issuperset(map(type, e.ops)) for e in entries):
            return self.take()
        self.entries += len(entries)
        self.bytes += sum(len(entry.packed) for entry in entries)
        return self.due(now_ms, waited_on)

    def newly_committed(self, keys: Sequence[TxKey], entries: Sequence[Entry], up_to: TxKey) -> Sequence[Entry]:
        """Of a shard's unapplied tail (its entries in key order, and their keys), those a commit up to
        ``up_to`` adds to what is gathered already."""
        since = bisect.bisect_right(keys, self.up_to) if self.up_to is not None else 0
        return entries[since : bisect.bisect_right(keys, up_to, since)]

    def due(self, now_ms: int, waited_on: bool) -> TxKey | None:
        """The key to apply up to now, if a gathered commit must be applied (and forgets it), else None."""
        if self.up_to is None:
            return None
        if (
            waited_on
            or self.entries >= self.entries_max
            or self.bytes >= self.bytes_max
            or now_ms - self.since_ms >= self.delay_ms_max
        ):
            return self.take()
        return None

    def take(self) -> TxKey | None:
        """Whatever is gathered, to apply now (None if nothing is)."""
        key, self.up_to, self.entries, self.bytes = self.up_to, None, 0, 0
        return key

    def deadline_ms(self) -> int | None:
        return None if self.up_to is None else self.since_ms + self.delay_ms_max


def commit_heard(
    apply: FollowerApply,
    waiters: CommitWaiters[P],
    tail_keys: Sequence[TxKey],
    tail_entries: Sequence[Entry],
    up_to: TxKey,
    following: bool,
    waited_on: Callable[[], bool],
    now_ms: int,
) -> tuple[Sequence[Entry], list[tuple[P, Outcome]], TxKey | None]:
    """A Commit effect up to ``up_to`` (see the module's theory of operation), the driver's and the
    simulator's alike: (the entries of the unapplied tail it newly commits, the outcomes to tell now,
    the key to apply up to now or None while a follower gathers). ``waited_on`` is asked after the
    telling. Entries not in the tail (read back from the log) are told when applied."""
    new = apply.newly_committed(tail_keys, tail_entries, up_to)
    told = waiters.committed(new)  # nothing to do where nobody waits (a follower's)
    return new, told, apply.committed(up_to, new, following, waited_on(), now_ms)


def applied_waited_on(waiters: int, held_guards: int, queries: int, changes: int) -> bool:
    """Whether anything waits for a core's applied state of a shard (the driver's and the simulator's,
    which has no queries or changefeeds): the counts of writes waiting for their commit, of failed
    guards held until they can be told, of waiting queries and of held changefeed requests."""
    return bool(waiters or held_guards or queries or changes)
