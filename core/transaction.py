"""Client transactions: parse, validate, evaluate guards, produce result ops (pure).

Theory of operation
-------------------
A client transaction is a list of guards and a list of requested ops over the tables of
one shard. The node that assigns the tx key (the sequencer) evaluates it against the
current state, through a ``read_row`` function it passes in:

1. ``parse_transaction`` checks tables, columns and types against the catalog (the shapes were
   checked once, when the request was decoded: ``rlog.messages.Transact``).
   Any mistake raises ``SchemaError`` and nothing has been read or written.
2. ``evaluate`` checks every guard (etcd-style compare: the current row equals the given
   full row, or is absent when ``equals`` is null). If one fails, the result names the
   first failing guard and the row actually found; nothing is logged.
3. Otherwise it returns the ops as *results*: full rows for writes, keys for deletes. Those
   are what the rlog records, so every replica applies the same results whatever its state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mnesite.rlog.messages import Transact, WriteRequest
from mnesite.rlog.schema import SchemaError, TableSchema, check_key, check_row
from mnesite.rlog.types import DeleteOp, Op, WriteOp
from msgspec import Struct


@dataclass(frozen=True)
class Guard:
    table: str
    key: Any
    equals: dict[str, Any] | None


class Transaction(Struct, frozen=True):
    shard: str
    guards: tuple[Guard, ...]
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class GuardFailed:
    index: int
    guard: Guard
    actual: dict[str, Any] | None

    def describe(self) -> str:
        expected = "absent" if self.guard.equals is None else f"equal to {self.guard.equals}"
        found = "absent" if self.actual is None else f"{self.actual}"
        return f"guard {self.index} failed: {self.guard.table}[{self.guard.key!r}] should be {expected}, is {found}"


def _table(catalog: dict[str, TableSchema], name: str) -> TableSchema:
    table = catalog.get(name)
    if table is None:
        raise SchemaError("unknown_table", f"unknown table {name!r}")
    return table


def parse_transaction(request: Transact, catalog: dict[str, TableSchema], transaction_ops_max: int) -> Transaction:
    """Check a decoded ``transact`` request against the catalog: tables, columns, types, one shard.

    Its shapes were checked once, when it was decoded (``rlog.messages.Transact``); what is left
    depends on the catalog, which the wire schema cannot know.
    """
    guards, ops = request.guards, request.ops
    if not ops:
        raise SchemaError("bad_request", "a transaction needs at least one op")
    if len(ops) + len(guards) > transaction_ops_max:
        raise SchemaError(
            "too_large", f"{len(ops)} ops and {len(guards)} guards exceed transaction_ops_max {transaction_ops_max}"
        )
    shards: set[str] = set()
    parsed_guards = []
    for index, guard in enumerate(guards):
        table = _table(catalog, guard.table)
        shards.add(table.shard)
        key = check_key(table, guard.key)
        equals = guard.equals
        if equals is not None:
            equals = check_row(table, equals)
            if equals[table.key_column] != key:
                raise SchemaError("bad_request", f"guard {index}: the row's key differs from the guarded key")
        parsed_guards.append(Guard(table.name, key, equals))
    parsed_ops: list[Op] = []
    for op in ops:
        table = _table(catalog, op.table)
        shards.add(table.shard)
        if type(op) is WriteRequest:
            parsed_ops.append(WriteOp(table.name, check_row(table, op.row)))
        else:
            parsed_ops.append(DeleteOp(table.name, check_key(table, op.key)))
    if len(shards) != 1:
        raise SchemaError("bad_request", f"a transaction must stay within one shard, this one spans {sorted(shards)}")
    return Transaction(shards.pop(), tuple(parsed_guards), tuple(parsed_ops))


def evaluate(
    transaction: Transaction,
    catalog: dict[str, TableSchema],
    read_row: Callable[[TableSchema, Any], dict[str, Any] | None],
) -> tuple[Op, ...] | GuardFailed:
    """Check the guards against current state; return the result ops or the first failed guard."""
    for index, guard in enumerate(transaction.guards):
        actual = read_row(catalog[guard.table], guard.key)
        if actual != guard.equals:
            return GuardFailed(index, guard, actual)
    return transaction.ops
