"""The history recorder: client threads that run register operations against real nodes and record,
for each operation, its invocation and completion times (``time.monotonic``, one clock for all
threads) and its outcome, as ``checker.Operation`` records.

Each thread owns one ``Client`` (clients are not thread-safe) attached to one node, half of them on
cores and half on replicants, and a ``random.Random`` derived from the run's seed. Its operations,
on a few keys of one table ``registers(id INTEGER, value INTEGER)``:

* a ``linearizable`` read;
* a blind write of a value no other operation writes: ``(thread + 1) * 10**7 + counter``;
* a compare-and-set: a ``linearizable`` read (recorded as a read), then a transaction whose guard
  says the row ``equals`` what was read and which writes a fresh value. A failed guard reports the
  row it found (``detail["actual"]``): that is recorded as a failed CAS which read that row.

Outcomes: a reply is ``ok``; a failed guard is ``fail``; ``OutcomeUnknown`` (no definite answer) of a
write or CAS is ``unknown`` (it may have taken effect or may still do so); any other error of a write
or CAS is one the client knows did not happen (never sent to a stopped node, refused) and is left out
like a read that got no answer, since an operation that did nothing constrains nothing. After such an
error the thread pauses ``UNAVAILABLE_PAUSE_S`` (a stopped node refuses at once: without the pause a
thread would spin on it while it is down).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from mnesite.rlog.client import Client, GuardFailed, MnesiteError, OutcomeUnknown

from tests.fault.checker import CAS, FAIL, OK, READ, UNKNOWN, WRITE, Operation
from tests.fault.partitions import Refusal

TABLE = "registers"
COLUMNS = [("id", "INTEGER"), ("value", "INTEGER")]
VALUES_PER_PROCESS = 10**7
READ_SHARE = 0.4
WRITE_SHARE = 0.3  # the rest are compare-and-set
UNAVAILABLE_PAUSE_S = 0.1
OPERATIONS_MAX = 2_000_000  # per recorder: a bound on memory for very long runs


MALFORMED = -1  # recorded for a row that is not a register row: no operation writes it, so the checker flags it


def row_value(row: Any) -> int | None:
    """The register value of a row as read (``None``: absent, ``MALFORMED``: not a register row)."""
    if row is None:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("value"), int) or isinstance(row.get("value"), bool):
        return MALFORMED
    return row["value"]


class Recorder:
    """Runs ``len(connect)`` client threads until ``stop()``; ``history`` holds what they saw."""

    def __init__(self, connect: list[Callable[[], Client]], keys: int, seed: int) -> None:
        """``connect``: one factory per client thread that makes its ``Client`` (node, keys, timeouts)."""
        self.connect = connect
        self.keys = keys
        self.seed = seed
        self.history: list[Operation] = []
        self.acknowledged: dict[int, tuple[int, int]] = {}  # value -> tx key the node acknowledged
        # Every error a client got, with when it got it (refused operations are not in the history).
        self.refusals: list[Refusal] = []
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.failures: list[BaseException] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(process,), name=f"recorder-{process}", daemon=True)
            for process in range(len(connect))
        ]

    def start(self) -> Recorder:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the threads; each finishes its current operation, bounded by its client's timeout."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise RuntimeError(f"{thread.name} did not stop within {timeout_s} s")
        if self.failures:
            raise RuntimeError(f"a recorder thread failed: {self.failures[0]!r}") from self.failures[0]

    def _record(self, operation: Operation, tx_key: Any = None) -> None:
        with self._lock:
            if len(self.history) >= OPERATIONS_MAX:
                raise RuntimeError(f"more than {OPERATIONS_MAX} operations recorded")
            self.history.append(operation)
            self.counts[f"{operation.kind} {operation.status}"] += 1
            if tx_key is not None:
                self.acknowledged[operation.value] = tuple(tx_key)

    def _error(self, error: MnesiteError, process: int, kind: str, invoked_s: float) -> bool:
        """Count ``error``; True if the operation may have taken effect (its outcome is unknown)."""
        with self._lock:
            self.errors[error.code] += 1
            if len(self.refusals) < OPERATIONS_MAX:
                self.refusals.append(Refusal(process, kind, invoked_s, time.monotonic(), error.code))
        if isinstance(error, OutcomeUnknown):
            return True
        self._stopping.wait(UNAVAILABLE_PAUSE_S)
        return False

    def _run(self, process: int) -> None:
        try:
            self._operate(process)
        except BaseException as error:  # reported by stop(): a silent dead thread would thin the history
            with self._lock:
                self.failures.append(error)

    def _operate(self, process: int) -> None:
        rng = random.Random(self.seed * 1000 + process)
        counter = 0
        with self.connect[process]() as client:
            while not self._stopping.is_set():
                key = rng.randrange(self.keys)
                choice = rng.random()
                if choice < READ_SHARE:
                    self.read(client, process, key)
                    continue
                counter += 1
                value = (process + 1) * VALUES_PER_PROCESS + counter
                if choice < READ_SHARE + WRITE_SHARE:
                    self.write(client, process, key, value)
                else:
                    self.compare_and_set(client, process, key, value)

    def read(self, client: Client, process: int, key: int) -> tuple[bool, Any]:
        invoked = time.monotonic()
        try:
            row = client.get(TABLE, key, consistency="linearizable")
        except MnesiteError as error:
            self._error(error, process, READ, invoked)
            return False, None
        self._record(Operation(process, key, READ, OK, invoked, time.monotonic(), row_value(row)))
        return True, row

    def write(self, client: Client, process: int, key: int, value: int) -> None:
        invoked = time.monotonic()
        try:
            tx_key = client.put(TABLE, {"id": key, "value": value})
        except MnesiteError as error:
            if self._error(error, process, WRITE, invoked):
                self._record(Operation(process, key, WRITE, UNKNOWN, invoked, math.inf, value))
            return
        self._record(Operation(process, key, WRITE, OK, invoked, time.monotonic(), value), tx_key)

    def compare_and_set(self, client: Client, process: int, key: int, value: int) -> None:
        answered, row = self.read(client, process, key)
        if not answered:
            return
        expected = row_value(row)
        guards = [{"table": TABLE, "key": key, "equals": row}]
        ops = [{"op": "write", "table": TABLE, "row": {"id": key, "value": value}}]
        invoked = time.monotonic()
        try:
            tx_key = client.transact(ops, guards)
        except GuardFailed as error:
            completed = time.monotonic()
            actual = error.detail.get("actual", MALFORMED) if isinstance(error.detail, dict) else MALFORMED
            found = MALFORMED if actual == MALFORMED else row_value(actual)
            self._record(Operation(process, key, CAS, FAIL, invoked, completed, found, expected))
            return
        except MnesiteError as error:
            if self._error(error, process, CAS, invoked):
                self._record(Operation(process, key, CAS, UNKNOWN, invoked, math.inf, value, expected))
            return
        self._record(Operation(process, key, CAS, OK, invoked, time.monotonic(), value, expected), tx_key)
