"""Table and index names across shards, applied at several nodes over the real store (``rlog.store``).

Theory of operation
-------------------
Names are one SQLite namespace per node, but each shard's log is applied on its own, in any
interleaving with the others'. The rule under test is ``rlog.schema.name_held_elsewhere``: a shard's
apply waits at a committed entry creating a name another shard's table or index holds at that node
(``Store.name_waits``), and is tried again once that name is let go (``Store.name_wait_due``).

* History. From one ``random.Random(seed)``, two or three shards' committed logs of real
  ``rlog.types.Entry`` objects: create and drop table, create and drop index, over a small pool of
  names (4 table names, 2 index names, in either letter case; an index may take a table's name), and
  row writes and deletes. Every schema op is admitted by production's proposal rule
  (``core.rules.schema_change_op``: ``check_creatable``, ``check_droppable``, ``check_index_creatable``,
  ``check_index_droppable``) against the catalog of one reference ``Store`` that applies every entry
  in one global commit order: a sequencer-correct history, where a name dropped in shard A is created
  in shard B only once that drop committed. The reference never waits.
* Modes. ``exclusive`` (the seeds' mode): the first third of the history is a common prefix every
  node applies in commit order (as a node started from a copy would have it), and in the rest each
  name is created by one shard only (moving once from its prefix holder, or new). ``free``: any
  sequencer-correct history, no prefix. ``concurrent``: shards a and b each create one name against
  the same catalog (two sequencers that did not see each other's create), write to it, and then, if
  ``remedy``, an operator drops it in one of them (the documented remedy); the reference applies
  with waits and retries like a node.
* Nodes. Each node is a real ``Store`` in a temporary directory, a core or a replicant, fed the
  shards' logs in its own random interleaving (per-shard order kept, batches of 1 to 4 entries, each
  shard with its own speed), one write transaction per turn, driven as production drives it:
  a core appends (``append_entries``), hears the commit of all it appended or of only part of it
  (the rest commits with a later batch of the shard, or at the end: the log holds an uncommitted
  tail, drawn from an RNG of its own so that the schedule is the seed's as before),
  applies at once or gathers the commit for a later turn
  (``CoreNode._apply_up_to``: a waiting shard not due is skipped; its unapplied tail passed as
  ``held``, or not, as when the tail spilled past its bound) and then retries the due waiting shards
  up to their committed key (``CoreNode._apply_name_waits``); a replicant logs and applies
  (``log_and_apply_verified``) and retries the due waiting shards up to their log's end
  (``ReplicantNode._apply_name_waits``). Now and then a node restarts: its store is closed and
  opened again, its waits are lost, and it applies what it had not (a core up to its committed key
  with its tail read back from the log, a replicant ``_logged_end``).
* Checks after every turn: no apply fails (``EntryApplyError``, ``StoreError``); no shard applied past
  the commit the node heard (a lifetime is skipped only once its drop committed); a waiting shard waits
  at its next entry, and that entry creates a name another shard holds at the node now; a shard that
  does not wait applied everything it was given (but a core's gathered commits). At the end, once
  every entry was delivered: no wait is left, and every node's catalog (tables, columns, indexes and
  their shards), rows and applied positions equal the reference's (``concurrent`` without remedy: one
  of the two shards waits at its create at every node instead, as documented).

A failure raises ``SimulationFailure`` naming the seed, the mode and the command that replays it.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mnesite.core import rules
from mnesite.rlog.errors import RequestError
from mnesite.rlog.messages import typed_body
from mnesite.rlog.schema import SchemaError, TableSchema, define_table, name_held_elsewhere
from mnesite.rlog.store import Store, StoreError
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ZERO_KEY,
    CreateIndexOp,
    CreateTableOp,
    DeleteOp,
    DropTableOp,
    Entry,
    TxKey,
    WriteOp,
    make_entry,
)

from tests.sim.cluster import SimulationFailure, replay_command

TABLE_NAMES = ("t0", "t1", "t2", "t3")
INDEX_NAMES = ("i0", "i1")
OPTIONAL_COLUMNS = (("v", "TEXT"), ("n", "INTEGER"), ("r", "REAL"))
KEYS = 4  # row keys 0..3: writes and deletes meet each other
ENTRIES = 60
NODES = 3
BATCH_MAX = 4
RESTART_PROBABILITY = 0.05
GATHER_PROBABILITY = 0.3  # a core gathers a commit instead of applying it at once
COMMIT_LAG_PROBABILITY = 0.3  # a core hears the commit of only part of what it appended (drawn apart)
READ_BACK_PROBABILITY = 0.3  # a core applies from its log instead of its tail
TRACE_MAX = 30
PROPOSALS_MAX = 200
MODES = ("exclusive", "free", "concurrent")
TEST_FILE = "tests/test_names_simulation.py"


def _value(rng: random.Random, column_type: str) -> Any:
    return {"INTEGER": rng.randrange(100), "TEXT": rng.choice("xyz") * rng.randint(1, 3), "REAL": rng.random()}[
        column_type
    ]


def _row(rng: random.Random, table: TableSchema) -> dict[str, Any]:
    row = {name: _value(rng, column_type) for name, column_type in table.columns}
    row[table.key_column] = rng.randrange(KEYS)
    return row


def _new_name(op: Any) -> str | None:
    if isinstance(op, CreateTableOp):
        return op.table.lower()
    if isinstance(op, CreateIndexOp):
        return op.index.lower()
    return None


@dataclass
class History:
    """The shards' committed logs in one global commit order, and the reference that applied them."""

    shards: tuple[str, ...]
    entries: list[Entry] = field(default_factory=list)
    prefix: int = 0  # the first entries every node applies in commit order
    reference: Store | None = None
    concurrent_name: str | None = None
    ends: dict[str, tuple[TxKey, bytes]] = field(default_factory=dict)

    def of_shard(self, shard: str) -> list[Entry]:
        return [entry for entry in self.entries if entry.shard == shard]


class NamesSimulation:
    def __init__(self, seed: int, directory: str, mode: str = "exclusive", remedy: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.seed, self.mode, self.remedy = seed, mode, remedy
        self.rng = random.Random(seed)
        self.directory = Path(directory)
        self.trace: list[str] = []
        self.waits_seen: list[str] = []  # each wait's text (``NameWait.describe``) when first met
        self.waits_met: set[tuple[str, str, TxKey]] = set()  # (node, shard, entry) of each wait met
        self.restarts = 0
        self.turns = 0
        shards = ("a", "b") if mode == "concurrent" or self.rng.random() < 0.5 else ("a", "b", "c")
        self.history = History(shards)
        self.history.reference = self._open(self.directory / "reference.db")
        self._suffix_creators: dict[str, str] = {}  # exclusive mode: name -> the shard that created it
        self._dropped: dict[str, str] = {}  # table name (folded) -> the shard that dropped it last

    # -- failures ---------------------------------------------------------------------------

    def fail(self, what: str) -> SimulationFailure:
        lines = "\n".join(f"  {line}" for line in self.trace[-TRACE_MAX:])
        return SimulationFailure(
            f"names simulation seed {self.seed} ({self.mode}, shards {','.join(self.history.shards)}) failed: "
            f"{what}\nreplay with: {replay_command(self.seed, TEST_FILE)}\nlast events:\n{lines}"
        )

    def _open(self, path: Path) -> Store:
        store = Store(str(path), synchronous="NORMAL")
        with store.write_transaction():
            for shard in self.history.shards:
                store.ensure_shard(shard, 1)
        return store

    # -- the history ------------------------------------------------------------------------

    def generate(self, entries: int = ENTRIES) -> History:
        history = self.history
        if self.mode == "concurrent":
            self._generate_concurrent(entries)
        else:
            history.prefix = entries // 2 if self.mode == "exclusive" else 0
            while len(history.entries) < entries:
                if not self._propose_one(exclusive=self.mode == "exclusive" and len(history.entries) >= history.prefix):
                    break  # every name taken for good by a shard that holds no table: the history ends
        return history

    def _propose_one(self, exclusive: bool) -> bool:
        """One entry admitted against the reference's catalog, committed and applied there; False
        when none was found in ``PROPOSALS_MAX`` tries."""
        catalog = self.history.reference.catalog()
        for _ in range(PROPOSALS_MAX):
            proposed = self._proposal(catalog)
            if proposed is None:
                continue
            shard, ops = proposed
            name = _new_name(ops[0])
            if exclusive and name is not None and self._suffix_creators.setdefault(name, shard) != shard:
                continue  # in the exclusive suffix a name is created by one shard only
            self._commit(shard, ops)
            return True
        return False

    def _proposal(self, catalog: dict[str, TableSchema]) -> tuple[str, tuple[Any, ...]] | None:
        """A random request, admitted by production's rule or None (refused, or nothing to do)."""
        rng = self.rng
        tables = sorted(catalog.values(), key=lambda table: table.name)
        kind = rng.choices(["create_table", "drop_table", "create_index", "drop_index", "rows"], [3, 3, 2, 2, 4])[0]
        if kind == "create_table":
            name, shard = rng.choice(TABLE_NAMES), rng.choice(self.history.shards)
            if self._dropped and rng.random() < 0.6:  # a name let go, taken by another shard: a move
                name, dropper = rng.choice(sorted(self._dropped.items()))
                shard = rng.choice([s for s in self.history.shards if s != dropper])
            columns = [["k", "INTEGER"], *(list(c) for c in OPTIONAL_COLUMNS if rng.random() < 0.5)]
            body = {"table": name.upper() if rng.random() < 0.3 else name, "key": "k", "columns": columns}
            body["shard"] = shard
        elif not tables:
            return None
        elif kind == "drop_table":
            body = {"table": rng.choice(tables).name}
        elif kind == "create_index":
            table = rng.choice(tables)
            name = rng.choice(INDEX_NAMES) if rng.random() < 0.8 else rng.choice(TABLE_NAMES)
            body = {"index": name, "table": table.name, "columns": [rng.choice(table.columns)[0]]}
        elif kind == "drop_index":
            indexes = [index.name for table in tables for index in table.indexes]
            if not indexes:
                return None
            body = {"index": rng.choice(indexes)}
        else:
            table = rng.choice(tables)
            ops = [
                WriteOp(table.name, _row(rng, table))
                if rng.random() < 0.75
                else DeleteOp(table.name, rng.randrange(KEYS))
                for _ in range(rng.randint(1, 3))
            ]
            return table.shard, tuple(ops)
        try:
            op = rules.schema_change_op(kind, typed_body(kind, body), catalog)
        except (RequestError, SchemaError):
            return None
        return op.shard, (op,)

    def _commit(self, shard: str, ops: tuple[Any, ...]) -> Entry:
        """The next entry of ``shard``'s log, applied by the reference in commit order."""
        history = self.history
        key, digest = history.ends.get(shard, (ZERO_KEY, GENESIS_DIGEST))
        counter = key.counter + 1
        entry = make_entry(shard, TxKey(1, counter), key, digest, ops, request_id=f"{shard}{counter}")
        history.ends[shard] = (entry.tx_key, entry.digest)
        for op in ops:
            if isinstance(op, DropTableOp):
                self._dropped[op.table.lower()] = shard
            elif isinstance(op, CreateTableOp):
                self._dropped.pop(op.table.lower(), None)
        history.entries.append(entry)
        reference = history.reference
        with reference.write_transaction():
            reference.log_and_apply_verified([entry], 0)
            _retry_to_log_end(reference)
        if reference.name_waits and self.mode != "concurrent":
            raise self.fail(f"the reference, applying in commit order, waits: {reference.name_waits}")
        return entry

    def _generate_concurrent(self, entries: int) -> None:
        """Shards a and b each create one name against the same catalog, write to it, and then, if
        ``remedy``, an operator drops it in one of them; ordinary entries before and after."""
        history, rng = self.history, self.rng
        history.prefix = 0
        while len(history.entries) < entries // 3 and self._propose_one(exclusive=True):
            pass
        catalog = history.reference.catalog()
        free = [name for name in TABLE_NAMES if name not in {n.lower() for n in catalog}]
        free = [n for n in free if not any(i.name.lower() == n for t in catalog.values() for i in t.indexes)]
        name = rng.choice(free) if free else None
        if name is None:
            raise self.fail("no free name for the concurrent creates")
        history.concurrent_name = name
        created = {}
        for shard, spelling in (("a", name), ("b", name.upper())):
            columns = [["k", "INTEGER"], *(list(c) for c in OPTIONAL_COLUMNS if rng.random() < 0.5)]
            body = {"table": spelling, "key": "k", "columns": columns, "shard": shard}
            op = rules.schema_change_op("create_table", typed_body("create_table", body), catalog)
            created[shard] = define_table(spelling, "k", columns, shard)
            self._commit(shard, (op,))
        for _ in range(rng.randint(1, 3)):
            shard = rng.choice("ab")
            self._commit(shard, (WriteOp(created[shard].name, _row(rng, created[shard])),))
        self._suffix_creators[name] = "a"  # no one else creates it
        if self.remedy:
            loser = rng.choice("ab")
            self.trace.append(f"operator: drop {created[loser].name!r} in shard {loser}")
            drop = typed_body("drop_table", {"table": created[loser].name})
            self._commit(loser, (rules.schema_change_op("drop_table", drop, {created[loser].name: created[loser]}),))
            winner = "b" if loser == "a" else "a"
            self._suffix_creators[name] = winner
            self._commit(winner, (WriteOp(created[winner].name, _row(rng, created[winner])),))
            while len(history.entries) < entries and self._propose_one(exclusive=True):
                pass

    # -- the nodes --------------------------------------------------------------------------

    def run(self) -> None:
        self.generate()
        nodes = [SimNode(self, index, "core" if self.rng.random() < 0.5 else "replicant") for index in range(NODES)]
        try:
            for node in nodes:
                node.run()
        finally:
            for node in nodes:
                node.store.close()
            self.history.reference.close()


def _retry_to_log_end(store: Store) -> list[str]:
    """A replicant's retry of its due waiting shards, up to their log's end (``ReplicantNode._apply_name_waits``)."""
    retried = []
    while due := store.name_waits_due():
        for shard in due:
            retried.append(shard)
            store.apply_committed(shard, store.last_entry(shard)[0])
    return retried


class SimNode:
    def __init__(self, simulation: NamesSimulation, index: int, kind: str) -> None:
        self.simulation = simulation
        self.name = f"{kind}{index}"
        self.kind = kind
        self.rng = simulation.rng
        self.path = simulation.directory / f"{self.name}.db"
        self.store = simulation._open(self.path)
        history = simulation.history
        self.logs = {shard: history.of_shard(shard) for shard in history.shards}
        self.delivered = dict.fromkeys(history.shards, 0)  # entries of each shard logged here
        self.commits = dict.fromkeys(history.shards, 0)  # of them, those this node heard committed
        # Its own RNG: the commit lag leaves the seed's schedule (batches, restarts, gathers) as it was.
        self.commit_rng = random.Random(f"{simulation.seed}-{index}-commit")
        self.tail: dict[str, list[Entry]] = {shard: [] for shard in history.shards}  # a core's unapplied tail
        self.gathered: set[str] = set()  # a core's shards whose last commit is not applied yet
        self.speeds = {shard: self.rng.choice([1, 4, 16]) for shard in history.shards}

    def _trace(self, what: str, turn_begins: bool = True) -> None:
        self.simulation.turns += turn_begins
        self.simulation.trace.append(f"{self.name} turn {self.simulation.turns}: {what}")

    def fail(self, what: str) -> SimulationFailure:
        return self.simulation.fail(f"node {self.name}: {what}")

    def committed(self, shard: str) -> TxKey:
        count = self.commits[shard]
        return self.logs[shard][count - 1].tx_key if count else ZERO_KEY

    # -- the schedule -----------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[str, int]]:
        history = self.simulation.history
        for entry in history.entries[: history.prefix]:
            yield entry.shard, 1
        left = {shard: len(self.logs[shard]) for shard in history.shards}
        for entry in history.entries[: history.prefix]:
            left[entry.shard] -= 1
        while shards := [shard for shard in history.shards if left[shard]]:
            shard = self.rng.choices(shards, [self.speeds[s] for s in shards])[0]
            count = min(left[shard], self.rng.randint(1, BATCH_MAX))
            left[shard] -= count
            yield shard, count

    def run(self) -> None:
        for shard, count in self._batches():
            if self.rng.random() < RESTART_PROBABILITY:
                self.restart()
            self.turn(shard, count)
        if lagging := sorted(shard for shard in self.commits if self.commits[shard] < self.delivered[shard]):
            self.commits.update(self.delivered)  # the commits heard last: applied with the gathered ones
            self.gathered.update(lagging)
        if self.gathered:
            self.apply_gathered()
        if self.rng.random() < 0.3:
            self.restart()
        self.final_check()

    def _in_turn(self, action: Any, *args: Any) -> None:
        """One turn of the node (counted before it is traced): one write transaction, then the checks."""
        try:
            with self.store.write_transaction():
                action(*args)
        except StoreError as error:  # EntryApplyError too
            raise self.fail(f"the store stopped the node: {error}") from None
        self.check()

    def turn(self, shard: str, count: int) -> None:
        start = self.delivered[shard]
        batch = self.logs[shard][start : start + count]
        self.delivered[shard] += count
        heard = self.commits[shard]
        self.commits[shard] = self.delivered[shard]
        beyond_prefix = sum(self.delivered.values()) > self.simulation.history.prefix
        if self.kind == "core" and beyond_prefix and self.commit_rng.random() < COMMIT_LAG_PROBABILITY:
            # The commit moves, if at all, to short of what the core appended.
            self.commits[shard] = self.commit_rng.randrange(heard, self.delivered[shard])
        self._trace(
            f"shard {shard} entries {batch[0].tx_key.counter}..{batch[-1].tx_key.counter}, "
            f"committed {self.committed(shard).counter}"
        )
        self._in_turn(self._receive_core if self.kind == "core" else self._receive_replicant, shard, batch)
        if self.gathered and self.rng.random() < 0.5:
            self.apply_gathered()

    def _receive_replicant(self, shard: str, batch: list[Entry]) -> None:
        self.store.log_and_apply_verified(batch, 0)  # ``ReplicantNode.apply_entries``
        _retry_to_log_end(self.store)

    def _receive_core(self, shard: str, batch: list[Entry]) -> None:
        self.store.append_entries(batch, 0)
        self.tail[shard].extend(batch)
        if self.rng.random() < GATHER_PROBABILITY:
            self.gathered.add(shard)  # ``FollowerApply``: applied in a later turn
            return
        self.gathered.discard(shard)
        self._apply_up_to(shard, self.committed(shard))

    def apply_gathered(self) -> None:
        def apply() -> None:
            for shard in sorted(self.gathered):
                self.gathered.discard(shard)
                self._apply_up_to(shard, self.committed(shard))

        self._trace(f"applies gathered commits of {sorted(self.gathered)}")
        self._in_turn(apply)

    def _apply_up_to(self, shard: str, up_to: TxKey, retrying: bool = False) -> None:
        """``CoreNode._apply_up_to`` and its retry of the due waiting shards (``_apply_name_waits``)."""
        store = self.store
        if not store.name_wait_may_end(shard, up_to, self.tail[shard]):
            return
        held = self.tail[shard] if self.rng.random() >= READ_BACK_PROBABILITY else ()
        store.apply_committed(shard, up_to, held)
        applied = store.shard(shard).applied
        self.tail[shard] = [entry for entry in self.tail[shard] if entry.tx_key > applied]
        if store.name_waits and not retrying:
            while due := store.name_waits_due():
                for waiting in due:
                    self.gathered.discard(waiting)  # ``driver.apply.take()``: up to the committed key
                    self._apply_up_to(waiting, self.committed(waiting), retrying=True)

    def restart(self) -> None:
        """Close the store and open it again: the waits (in memory) are lost; what was logged and not
        applied is applied as the node does at a start (a core once it hears the committed key again)."""
        self.simulation.restarts += 1
        self._trace("restarts")
        self.store.close()
        self.store = Store(str(self.path), synchronous="NORMAL")
        self.gathered = set()
        if self.kind == "core":
            for shard in self.tail:  # ``_open_shard``: the tail read back from the log
                self.tail[shard] = self.store.entries_after(shard, self.store.shard(shard).applied, 1000)

            def resume() -> None:
                for shard in self.rng.sample(list(self.tail), len(self.tail)):
                    if self.tail[shard]:
                        self._apply_up_to(shard, self.committed(shard))

        else:

            def resume() -> None:
                for shard in self.delivered:  # ``ReplicantNode._logged_end``, then a step's retry
                    position = self.store.shard(shard)
                    if self.store.last_entry(shard)[0] > position.applied:
                        self.store.apply_committed(shard, self.store.last_entry(shard)[0])
                _retry_to_log_end(self.store)

        self._in_turn(resume)

    # -- the checks -------------------------------------------------------------------------

    def check(self) -> None:
        store = self.store
        catalog = store.catalog()
        for shard, log in self.logs.items():
            applied = store.shard(shard).applied
            committed = self.committed(shard)
            if applied > committed:
                raise self.fail(f"shard {shard} applied {applied} past the commit it heard, {committed}")
            wait = store.name_waits.get(shard)
            if wait is None:
                if applied != committed and shard not in self.gathered:
                    raise self.fail(f"shard {shard} applied {applied} of {committed} and does not wait")
                continue
            following = next((entry for entry in log if entry.prev == applied), None)
            if following is None or wait.tx_key != following.tx_key:
                raise self.fail(f"shard {shard} waits at {wait.tx_key}, not at the entry after {applied}")
            held = name_held_elsewhere(catalog, shard, following.ops)
            if held is None:
                raise self.fail(
                    f"shard {shard} waits at {wait.tx_key} for {wait.held.name!r}, which no other shard holds here"
                )
            self.simulation.waits_met.add((self.name, shard, wait.tx_key))
            text = wait.describe()
            if text not in self.simulation.waits_seen:
                self.simulation.waits_seen.append(text)
                self._trace(text, turn_begins=False)

    def final_check(self) -> None:
        store, simulation = self.store, self.simulation
        reference = simulation.history.reference
        if simulation.mode == "concurrent" and not simulation.remedy:
            self._check_one_concurrent_wait()
            return
        if store.name_waits:
            raise self.fail(
                f"waits left once every entry was delivered: {[w.describe() for w in store.name_waits.values()]}"
            )
        if store.shards() != reference.shards():
            raise self.fail(f"applied positions {store.shards()} differ from the reference's {reference.shards()}")
        if store.catalog() != reference.catalog():
            raise self.fail(f"catalog {store.catalog()} differs from the reference's {reference.catalog()}")
        for table in reference.catalog().values():
            if store.scan(table, None, KEYS + 1) != reference.scan(table, None, KEYS + 1):
                raise self.fail(f"rows of {table.name} differ from the reference's")

    def _check_one_concurrent_wait(self) -> None:
        """Both creates and no drop: one of the two shards waits at its create, at every node."""
        store, name = self.store, self.simulation.history.concurrent_name
        waits = [wait for wait in store.name_waits.values() if wait.held.name.lower() == name]
        if len(waits) != 1 or len(store.name_waits) != 1:
            raise self.fail(f"expected one shard to wait at its create of {name!r}, got {store.name_waits}")
        other = waits[0].held.holder_shard
        if store.shard(other).applied != self.committed(other):
            raise self.fail(f"shard {other}, which holds {name!r}, did not apply all it was given")


def run_names_seed(seed: int, mode: str = "exclusive", remedy: bool = True) -> NamesSimulation:
    """Run one seed in a temporary directory; returns the finished simulation (its counters)."""
    with tempfile.TemporaryDirectory(prefix="mnesite-names-") as directory:
        simulation = NamesSimulation(seed, directory, mode, remedy)
        simulation.run()
    return simulation
