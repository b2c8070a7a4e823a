"""Integrity comparison of two or more replicas with Spark: ship range digests, drill into differences.

Theory of operation
-------------------
1. *Plan (driver).* Open every replica (file read-only, or node client); read catalogs and each
   shard's applied tx key. Tables missing on a replica or declared differently (shard, key
   column, columns and their types) are reported and not compared (a table created or dropped
   in flight, step 2, is reported as such). The first level's key
   ranges come from the replica with the most rows (``key_boundaries``: SQLite walks the key
   index, of the file or on the node, asked again after the last key while a node's bounded
   walk leaves more than about one range): the same boundaries for every replica, ranges
   ``(low, high]`` covering the whole key space.
2. *In flight (driver).* For each pair (first replica, other replica) and each shard whose
   applied keys differ, the more advanced replica's rlog between the two applied keys is read
   (bounded by ``in_flight_entries_max``). The keys its entries wrote or deleted are *in flight*:
   a difference there is the lag of one replica, not divergence; so is a table lacking on one
   replica of a pair that those entries created (on the replica ahead) or dropped last
   (``tables_in_flight``, not compared), and a table declared differently only by columns at the
   end of the ahead replica's declaration that those entries added (``columns_in_flight``, not
   compared). A table those entries dropped and created again holds none of the behind replica's
   rows any more: every key of it is in flight for that pair (``EveryKey``), and if it was created
   again with another declaration it is reported in ``tables_recreated_in_flight``, not compared.
   If the rlog no longer holds
   the whole span (trimmed, or the histories do not connect), the shard is marked incomplete
   and its differences count as divergence. If the more advanced replica's entry at the other's
   applied key has another digest, the histories diverged: reported as such, and no key is in flight.
3. *Digest levels (Spark).* The first level's ranges are small: about ``range_rows`` (64) rows
   each, at most ``ranges_initial_max`` per table (or ``ranges_initial`` if set), so that with
   differences spread all over the table a differing range is still only a few rows. Tasks
   ``(replica, table, ranges)`` run on executors; each asks its replica for one row count and one
   digest per range (``rlog.range_requests``): SQLite builds each row's canonical text and
   concatenates a range's texts natively, Python hashes one string per range, and a live node
   does this itself so that only digests cross the network. Each task returns one compact
   result; the driver merges the digest lists (no Spark shuffle: they are small) and keeps the
   ranges whose digests are not all equal (a node over its row budget answers no digest, which
   counts as differing). Those with more than ``leaf_rows_max`` rows on some replica are cut at
   the split keys of the replica with the most rows there, which came with its digests, and
   digested again (at most ``depth_max`` levels). Equal replicas therefore ship only digests.
4. *Row level.* For the differing leaf ranges every replica ships ``(key, row digest)`` per row
   (computed from the same row texts). When there are known to be at most ``driver_row_digests_max``
   of them the driver merges them; otherwise (or when a node over its row budget gave only a lower
   bound for a leaf's rows) Spark full-outer-joins the first replica with each other one on the
   key. Either way keys are classified (missing on one side, values differ, in flight) and counted
   exactly, and at most ``sample_max`` keys per class are kept, the first in key order, whose rows
   are then read by key from both replicas.

Exit status: 0 equal (in-flight differences allowed), 1 diverged, 2 could not compare
(``CompareError``: bad replica, unknown table, unreachable node, Spark unavailable).
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mnesite.rlog.json_text import json_text
from mnesite.rlog.range_digest import key_bytes, key_from_bytes
from mnesite.rlog.schema import TableSchema
from mnesite.rlog.types import TxKey
from mnesite.spark.replica import (
    BATCH_ROWS_MAX,
    NODE_TIMEOUT_MS,
    Replica,
    ReplicaError,
    ReplicaSpec,
    ShardApplied,
    open_replica,
    parse_replica,
)

EXIT_EQUAL = 0
EXIT_DIVERGED = 1
EXIT_ERROR = 2

CATEGORIES = ("missing_on_left", "missing_on_right", "different")
SAMPLE_MAX_LIMIT = 10_000
TIMEOUT_MS_LIMIT = 600_000  # each request to a node (mnesite compare --timeout-ms takes the same range)

Progress = Callable[[str], None]


class CompareError(RuntimeError):
    """The replicas could not be compared; the message is one line for the operator."""


@dataclass(frozen=True)
class CompareOptions:
    tables: tuple[str, ...] = ()  # empty: every table of every replica
    master: str = "local[*]"
    sample_max: int = 10  # sampled keys per class, per table and pair
    ranges_initial: int = 0  # first-level key ranges per table; 0: about one per range_rows rows
    range_rows: int = 64  # rows per first-level range when ranges_initial is 0
    ranges_initial_max: int = 200_000  # first-level ranges per table at most (bigger tables drill down)
    fanout: int = 16  # sub-ranges a differing range is cut into
    leaf_rows_max: int = 256  # a differing range with at most this many rows goes to row level
    depth_max: int = 6  # digest levels before going to row level regardless
    level_ranges_max: int = 200_000  # differing ranges one level may drill into
    driver_row_digests_max: int = 1_000_000  # row digests merged by the driver; more are joined by Spark
    in_flight_entries_max: int = 100_000  # rlog entries read per shard and pair
    tasks_per_core: int = 2
    batch_rows_max: int = BATCH_ROWS_MAX
    timeout_ms: int = NODE_TIMEOUT_MS
    key: str | None = None  # for tcp:// replicas of a cluster with [security]: the caller's secret key file
    server_key: str | None = None  # ... and the cluster's public key file
    follow_key_links: bool = False  # ... which may be symbolic links (a Kubernetes secret volume), checked

    def check(self) -> None:
        if not 0 <= self.sample_max <= SAMPLE_MAX_LIMIT:
            raise CompareError(f"sample must be between 0 and {SAMPLE_MAX_LIMIT}")
        for name, low, high in (
            ("in_flight_entries_max", 1, 10**9),
            ("batch_rows_max", 1, BATCH_ROWS_MAX),
            ("timeout_ms", 1, TIMEOUT_MS_LIMIT),
        ):
            if not low <= getattr(self, name) <= high:
                raise CompareError(f"{name} must be between {low} and {high}, got {getattr(self, name)}")
        if (
            self.ranges_initial < 0
            or self.range_rows < 1
            or self.ranges_initial_max < 1
            or self.fanout < 2
            or self.leaf_rows_max < 1
            or self.depth_max < 1
            or self.level_ranges_max < 1
            or self.driver_row_digests_max < 0
            or self.tasks_per_core < 1
        ):
            raise CompareError(
                "ranges_initial >= 0, range_rows >= 1, ranges_initial_max >= 1, fanout >= 2, leaf_rows_max >= 1, "
                "depth_max >= 1, level_ranges_max >= 1, driver_row_digests_max >= 0 and tasks_per_core >= 1 "
                "are required"
            )


@dataclass
class PairTableResult:
    """The first replica (left) against another (right), for one table."""

    table: str
    left: str
    right: str
    counts: dict[str, int] = field(default_factory=lambda: {c: 0 for c in (*CATEGORIES, "in_flight")})
    samples: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {c: [] for c in (*CATEGORIES, "in_flight")}
    )

    @property
    def diverged(self) -> bool:
        return any(self.counts[c] for c in CATEGORIES)

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "left": self.left,
            "right": self.right,
            "diverged": self.diverged,
            "counts": dict(self.counts),
            "samples": self.samples,
        }


@dataclass
class InFlightSpan:
    shard: str
    left: str
    right: str
    ahead: str | None  # which replica is further; None when both applied the same key
    behind_key: TxKey
    ahead_key: TxKey
    complete: bool
    entries: int
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "left": self.left,
            "right": self.right,
            "ahead": self.ahead,
            "from": list(self.behind_key),
            "to": list(self.ahead_key),
            "complete": self.complete,
            "entries": self.entries,
            "reason": self.reason,
        }


@dataclass
class CompareReport:
    replicas: list[ReplicaSpec]
    applied: dict[str, dict[str, ShardApplied]]  # replica label -> shard -> applied
    tables: list[str] = field(default_factory=list)
    rows: dict[str, dict[str, int]] = field(default_factory=dict)  # table -> replica label -> rows
    tables_missing: dict[str, list[str]] = field(default_factory=dict)  # table -> labels lacking it
    # Tables lacking only where an entry in flight (step 2) created or dropped them: lag, not divergence.
    tables_in_flight: dict[str, list[str]] = field(default_factory=dict)  # table -> labels lacking it
    tables_mismatched: dict[str, dict[str, Any]] = field(default_factory=dict)  # table -> label -> definition
    # Tables declared differently only by columns an entry in flight added on the replica ahead: lag, not
    # divergence (not compared). table -> label -> the columns it lacks.
    columns_in_flight: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # Tables declared differently only because an entry in flight dropped and created them again on the
    # replica ahead: lag, not divergence (not compared). table -> labels of the replicas behind.
    tables_recreated_in_flight: dict[str, list[str]] = field(default_factory=dict)
    histories_diverged: list[dict[str, Any]] = field(default_factory=list)
    in_flight_spans: list[InFlightSpan] = field(default_factory=list)
    pairs: list[PairTableResult] = field(default_factory=list)
    statistics: dict[str, Any] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return bool(
            self.tables_missing
            or self.tables_mismatched
            or self.histories_diverged
            or any(p.diverged for p in self.pairs)
        )

    @property
    def exit_status(self) -> int:
        return EXIT_DIVERGED if self.diverged else EXIT_EQUAL

    def to_json(self) -> dict[str, Any]:
        return {
            "status": "diverged" if self.diverged else "equal",
            "exit_status": self.exit_status,
            "replicas": [r.to_json() for r in self.replicas],
            "applied": {
                label: {s: {"applied": list(a.applied), "digest": a.digest} for s, a in shards.items()}
                for label, shards in self.applied.items()
            },
            "tables": self.tables,
            "rows": self.rows,
            "tables_missing": self.tables_missing,
            "tables_in_flight": self.tables_in_flight,
            "tables_mismatched": self.tables_mismatched,
            "columns_in_flight": self.columns_in_flight,
            "tables_recreated_in_flight": self.tables_recreated_in_flight,
            "histories_diverged": self.histories_diverged,
            "in_flight_spans": [s.to_json() for s in self.in_flight_spans],
            "pairs": [p.to_json() for p in self.pairs],
            "statistics": self.statistics,
        }


def json_default(value: Any) -> Any:
    """JSON rendering of values the report holds: blobs as ``{"hex": ...}``."""
    if isinstance(value, (bytes, bytearray)):
        return {"hex": bytes(value).hex()}
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def report_json(report: CompareReport, indent: int | None = 2) -> str:
    """The report as JSON (``compare --json``): a sampled infinite REAL as ``9.0e+999``, as every ``--json``."""
    return json_text(report.to_json(), default=json_default, indent=indent)


# -- executor side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Task:
    """Work for one executor: key ranges of one table of one replica, digested or row-digested."""

    replica_index: int
    spec: ReplicaSpec
    table: TableSchema
    first: int  # index of ranges[0] in the level's list of ranges of this table
    ranges: tuple[tuple[Any, Any], ...]  # (low, high), in key order
    split_parts: int
    split_rows_min: int
    row_level: bool
    timeout_ms: int


def run_task(task: _Task) -> tuple[Any, ...]:
    """Executor entry point: one result per task, so a level ships few, compact Python objects.

    Digest level: ``(table, replica, first, rows, digests, splits)`` with one row count and one
    digest (None: over a node's budget) per range and ``splits`` mapping a range's position to
    its split keys. Row level: ``(table, replica, first, [(key, row digest), ...])``.
    """
    with open_replica(task.spec, task.timeout_ms) as replica:
        if task.row_level:
            found: list[tuple[Any, bytes]] = []
            for low, high in task.ranges:
                found.extend(replica.row_digests(task.table, low, high))
            return (task.table.name, task.replica_index, task.first, found)
        answers = replica.range_digests(task.table, list(task.ranges), task.split_parts, task.split_rows_min)
    if len(answers) != len(task.ranges):
        raise ReplicaError(f"{task.spec.label}: {len(answers)} digests for {len(task.ranges)} ranges")
    return (
        task.table.name,
        task.replica_index,
        task.first,
        [answer.rows for answer in answers],
        [answer.digest for answer in answers],
        {position: answer.split_keys for position, answer in enumerate(answers) if answer.split_keys},
    )


def row_digest_records(task: _Task) -> Iterator[tuple[str, bytes, int, bytes]]:
    """Executor entry point of the row level joined by Spark: ``(table, key bytes, replica, row digest)``
    per row of a row-level task's ranges, yielded as the replica's pages of row digests come (a file's
    ``ROW_DIGESTS_PAGE_MAX`` rows, a node's answer). Spark joins when the differing rows are too many
    for the driver, so a task's share of them must not sit in one list on the executor."""
    with open_replica(task.spec, task.timeout_ms) as replica:
        for low, high in task.ranges:
            for key, digest in replica.row_digests(task.table, low, high):
                yield (task.table.name, key_bytes(key), task.replica_index, digest)


# -- driver side ----------------------------------------------------------------------------------


def compare(
    replica_texts: Sequence[str],
    options: CompareOptions | None = None,
    session: Any = None,
    progress: Progress | None = None,
) -> CompareReport:
    """Compare replicas (data directories, ``mnesite.db`` files or ``tcp://`` endpoints).

    Uses ``session`` if given, else the session already active in this process (both are left
    running; ``options.master`` does not apply to them), else builds one on ``options.master`` and
    stops it at the end. Raises ``CompareError`` when the replicas cannot be compared.
    """
    options = options or CompareOptions()
    options.check()
    say = progress or (lambda message: None)
    if len(replica_texts) < 2:
        raise CompareError("compare needs at least two replicas")
    started = time.monotonic()
    replicas: list[Replica] = []
    try:
        try:
            specs = [
                parse_replica(text, options.key, options.server_key, options.follow_key_links) for text in replica_texts
            ]
            for spec in specs:
                replicas.append(open_replica(spec, options.timeout_ms))
            labels = _unique_labels(specs)
            report, in_flight = _plan(replicas, labels, options, say)
        except ReplicaError as error:
            raise CompareError(str(error)) from None
        if session is None:
            session = _active_session()
        owns_session = session is None
        if owns_session:
            from mnesite.spark.session import SparkUnavailableError, build_session

            say(f"starting Spark ({options.master})")
            spark_began = time.monotonic()
            try:
                session = build_session(options.master)
            except SparkUnavailableError as error:
                raise CompareError(str(error)) from None
            say(f"Spark started in {time.monotonic() - spark_began:.1f} s")
        try:
            _run(session, replicas, labels, report, in_flight, options, say)
        except ReplicaError as error:  # read by the driver: a node went away, a boundary read failed
            raise CompareError(str(error)) from None
        except Exception as error:
            # A task failed on an executor, which opens every replica again (on a cluster, from the
            # worker's disk): Spark raises its own exception around the task's ReplicaError. It is a
            # compare that could not run (exit 2), said in the replica's one line, not a Java traceback.
            if not _is_spark_error(error):
                raise
            raise CompareError(_spark_failure(error)) from error
        finally:
            if owns_session:
                session.stop()
    finally:
        for replica in replicas:
            replica.close()
    report.statistics["seconds"] = round(time.monotonic() - started, 3)
    say(f"done in {report.statistics['seconds']} s: {'diverged' if report.diverged else 'equal'}")
    return report


def _is_spark_error(error: Exception) -> bool:
    """Whether ``error`` is Spark's (a job or the gateway failed), not a defect of this module."""
    try:
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException
    except ImportError:
        return False
    return isinstance(error, (PySparkException, Py4JError))


SPARK_FAILURE_CHARS_MAX = 300  # of the root cause's line in a failed job's one-line error
JAVA_CAUSES_MAX = 64  # the causes walked to a Java exception's root (a cycle must not hang the error path)
PYTHON_TRACEBACK = "Traceback (most recent call last):"


def _spark_failure(error: Exception) -> str:
    """One line for a failed Spark job: the ``ReplicaError`` a task raised if there is one (its message
    names the replica), else the root cause.

    A job that fails on an executor reaches the driver as a ``Py4JJavaError`` whose first line is
    Py4J's own ("An error occurred while calling o123.collectToPython."), which says nothing; the
    cause is at the bottom of the chain Spark wraps it in. So the line is the innermost Java
    exception's class and message (``java.io.FileNotFoundException: ...``) or, when a Python worker
    raised it, the Python exception's own line (``ValueError: ...``: the first of its traceback, the
    root of a chained one). The full error stays the ``CompareError``'s ``__cause__``."""
    text = _error_text(error)
    marker = f"{ReplicaError.__name__}: "
    for line in text.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].strip()
    cause = _java_root_cause(error) or _root_cause_of_text(text)
    cause = cause or next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return f"the Spark job failed: {cause[:SPARK_FAILURE_CHARS_MAX]}"


def _error_text(error: Exception) -> str:
    """``str(error)``: a ``Py4JJavaError`` asks the JVM for its stack trace, which fails once the
    gateway is gone; then Py4J's own message is all there is."""
    try:
        return str(error)
    except Exception:
        return str(getattr(error, "errmsg", "") or type(error).__name__)


def _java_root_cause(error: Exception) -> str | None:
    """``Class: message`` of the innermost cause of a ``Py4JJavaError``'s Java exception (its Python
    exception's line when that cause is a Python worker's), or None (no Java exception, or the JVM
    did not answer: the text is read instead)."""
    java = getattr(error, "java_exception", None)
    if java is None:
        return None
    try:
        for _ in range(JAVA_CAUSES_MAX):
            cause = java.getCause()
            if cause is None:
                break
            java = cause
        name = str(java.getClass().getName())
        message = java.getMessage()
    except Exception:
        return None
    message = str(message) if message is not None else ""
    python = _python_exception_line(message)
    if python is not None:
        return python
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return f"{name}: {first}" if first else name


def _root_cause_of_text(text: str) -> str | None:
    """The root cause in a failed job's text: a Python traceback's exception line, else the last
    ``Caused by:`` of a Java stack trace, else the Java exception Py4J's ``: `` line names."""
    python = _python_exception_line(text)
    if python is not None:
        return python
    lines = text.splitlines()
    caused = [line.removeprefix("Caused by: ").strip() for line in lines if line.startswith("Caused by: ")]
    if caused:
        return caused[-1]
    return next((line.removeprefix(": ").strip() for line in lines if line.startswith(": ")), None)


def _python_exception_line(text: str) -> str | None:
    """The exception line (``ValueError: ...``) of the first Python traceback in ``text``: the line after
    the header that is not a frame (frames and their source lines are indented); None without one."""
    start = text.find(PYTHON_TRACEBACK)
    if start < 0:
        return None
    for line in text[start + len(PYTHON_TRACEBACK) :].splitlines():
        if line.strip() and not line[0].isspace():
            return line.strip()
    return None


def _active_session() -> Any:
    """The SparkSession already running in this process, if any (it is reused and left running)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return None
    return SparkSession.getActiveSession()


def _unique_labels(specs: Sequence[ReplicaSpec]) -> list[str]:
    labels: list[str] = []
    for index, spec in enumerate(specs):
        label = spec.label
        if label in labels:
            label = f"{label}#{index + 1}"
        labels.append(label)
    return labels


class EveryKey(set):
    """The in-flight keys of a table that the entries between a pair's applied keys dropped or created:
    all of them (the replica ahead holds a new table, none of the behind replica's rows). Adding to it
    changes nothing; it is empty to iterate (the Spark join tests ``every_key_tables`` instead)."""

    def __contains__(self, key: object) -> bool:
        return True

    def add(self, key: Any) -> None:
        pass


InFlightKeys = dict[tuple[int, str], set[bytes]]  # (right replica index, table) -> key_bytes of keys


def every_key_in_flight(in_flight: InFlightKeys, right: int, changed: dict[str, str], tables: Any) -> None:
    """Mark every key of the compared ``tables`` that the span's entries created or dropped (``changed``)
    in flight for the pair of the first replica and replica ``right``."""
    for name in changed:
        if name in tables:
            in_flight[(right, name)] = EveryKey()


def every_key_tables(in_flight: InFlightKeys, right: int) -> list[str]:
    """The tables whose every key is in flight for the pair of the first replica and replica ``right``."""
    return sorted(name for (index, name), keys in in_flight.items() if index == right and isinstance(keys, EveryKey))


def _plan(
    replicas: list[Replica], labels: list[str], options: CompareOptions, say: Progress
) -> tuple[CompareReport, InFlightKeys]:
    catalogs = [replica.catalog() for replica in replicas]
    specs = [replica.spec for replica in replicas]
    applied = {label: replica.applied() for label, replica in zip(labels, replicas, strict=True)}
    report = CompareReport(specs, applied)
    known = sorted(set().union(*catalogs))
    if options.tables:
        unknown = [t for t in options.tables if t not in known]
        if unknown:
            listing = ", ".join(known) or "none"
            raise CompareError(f"unknown table {unknown[0]!r}: no replica has it (tables: {listing})")
        wanted = list(dict.fromkeys(options.tables))
    else:
        wanted = known
    comparable: dict[str, TableSchema] = {}
    lacking_by_table: dict[str, list[str]] = {}
    mismatched: dict[str, list[TableSchema]] = {}
    for name in wanted:
        lacking = [label for label, catalog in zip(labels, catalogs, strict=True) if name not in catalog]
        if lacking:
            lacking_by_table[name] = lacking
            continue
        definitions = {label: catalog[name] for label, catalog in zip(labels, catalogs, strict=True)}
        # The shard is part of a table's declaration: the same rows in another shard follow another log.
        if len({(d.shard, d.key_column, d.columns) for d in definitions.values()}) > 1:
            mismatched[name] = list(definitions.values())
            continue
        comparable[name] = definitions[labels[0]]
    report.tables = sorted(comparable)
    say(f"comparing {len(comparable)} table(s) across {len(replicas)} replicas")
    shards = {table.shard for table in comparable.values()}
    shards.update(catalog[name].shard for name in lacking_by_table for catalog in catalogs if name in catalog)
    shards.update(d.shard for definitions in mismatched.values() for d in definitions)
    in_flight, changes = _find_in_flight(replicas, labels, comparable, sorted(shards), report, options, say)
    for name, definitions in mismatched.items():
        lacking_columns = _columns_added_in_flight(name, definitions, changes)
        recreated = _recreated_in_flight(name, definitions, changes)
        if lacking_columns is not None:
            report.columns_in_flight[name] = {labels[i]: columns for i, columns in lacking_columns.items()}
        elif recreated is not None:
            report.tables_recreated_in_flight[name] = [labels[i] for i in recreated]
        else:
            report.tables_mismatched[name] = {
                label: {"shard": d.shard, "key": d.key_column, "columns": [list(c) for c in d.columns]}
                for label, d in zip(labels, definitions, strict=True)
            }
    for name, lacking in lacking_by_table.items():
        if _created_or_dropped_in_flight(name, catalogs, changes):
            report.tables_in_flight[name] = lacking
        else:
            report.tables_missing[name] = lacking
    # Keys the span's entries named one by one, and tables whose every key is in flight for a pair
    # (``EveryKey``: dropped or created in the span, so no key count says how much they excused).
    report.statistics["in_flight_keys"] = sum(len(keys) for keys in in_flight.values())
    report.statistics["in_flight_tables"] = sum(isinstance(keys, EveryKey) for keys in in_flight.values())
    return report, in_flight


# (right replica index, shard) -> (index of the replica ahead, table -> its last change in the span,
# table -> the columns added in the span)
TableChanges = dict[tuple[int, str], tuple[int, dict[str, str], dict[str, set[str]]]]


def _created_or_dropped_in_flight(name: str, catalogs: list[dict[str, TableSchema]], changes: TableChanges) -> bool:
    """Whether table ``name``, lacking on some replicas, is lacking only where the span between the
    applied keys of a pair explains it: the replica ahead created it last, or dropped it last."""
    for right in range(1, len(catalogs)):
        holders = [index for index in (0, right) if name in catalogs[index]]
        if len(holders) != 1:
            continue  # both have it or both lack it: no difference in this pair
        ahead, last, _ = changes.get((right, catalogs[holders[0]][name].shard), (-1, {}, {}))
        if last.get(name) != ("created" if holders[0] == ahead else "dropped"):
            return False
    return True


def _recreated_in_flight(name: str, definitions: list[TableSchema], changes: TableChanges) -> list[int] | None:
    """For table ``name``, declared differently on some replicas: the indexes of the replicas behind (in
    order) when every difference from the first replica is explained by the span between the two applied
    keys having dropped the table and created it again last (the replica ahead holds the new one); None
    otherwise."""
    behind: list[int] = []
    for right in range(1, len(definitions)):
        other, first = definitions[right], definitions[0]
        if (other.shard, other.key_column, other.columns) == (first.shard, first.key_column, first.columns):
            continue
        if other.shard != first.shard:
            # One shard's span cannot explain a table of another shard (whose rows follow another log):
            # declared differently, as before the span was looked at.
            return None
        ahead, last, _ = changes.get((right, definitions[0].shard), (-1, {}, {}))
        if ahead not in (0, right) or last.get(name) != "created":
            return None
        index = right if ahead == 0 else 0
        if index not in behind:
            behind.append(index)
    return sorted(behind) or None


def _columns_added_in_flight(
    name: str, definitions: list[TableSchema], changes: TableChanges
) -> dict[int, list[str]] | None:
    """For table ``name``, declared differently on some replicas: the columns each replica lacks
    (by replica index), when every difference from the first replica is explained by the span between
    the two applied keys: same shard and key column, and the replica behind lacks only columns at the
    end of the other's that the span's entries added (add_column); None otherwise."""
    lacking: dict[int, list[str]] = {}
    first = definitions[0]
    for right in range(1, len(definitions)):
        other = definitions[right]
        if (other.shard, other.key_column) != (first.shard, first.key_column):
            return None
        if other.columns == first.columns:
            continue
        ahead, _, added = changes.get((right, first.shard), (-1, {}, {}))
        if ahead not in (0, right):
            return None
        behind = right if ahead == 0 else 0
        longer, shorter = definitions[ahead].columns, definitions[behind].columns
        extra = longer[len(shorter) :]
        if longer[: len(shorter)] != shorter or not extra:
            return None
        columns = [column for column, _ in extra]
        if not set(columns) <= added.get(name, set()):
            return None
        lacking.setdefault(behind, [])
        lacking[behind].extend(column for column in columns if column not in lacking[behind])
    return lacking


def _find_in_flight(
    replicas: list[Replica],
    labels: list[str],
    tables: dict[str, TableSchema],
    shards: list[str],
    report: CompareReport,
    options: CompareOptions,
    say: Progress,
) -> tuple[InFlightKeys, TableChanges]:
    """Keys touched, and tables created or dropped, between the applied keys of the first replica
    and each other one in ``shards`` (see step 2)."""
    in_flight: InFlightKeys = defaultdict(set)
    changes: TableChanges = {}
    for right in range(1, len(replicas)):
        for shard in shards:
            left_applied = report.applied[labels[0]].get(shard)
            right_applied = report.applied[labels[right]].get(shard)
            left_key = left_applied.applied if left_applied else TxKey(0, 0)
            right_key = right_applied.applied if right_applied else TxKey(0, 0)
            if left_key == right_key:
                # Another digest at the same key is another history; an unknown one ("") tells nothing.
                digests = {left_applied.digest, right_applied.digest} if left_applied and right_applied else set()
                if len(digests) > 1 and "" not in digests:
                    report.histories_diverged.append(
                        {
                            "shard": shard,
                            "left": labels[0],
                            "right": labels[right],
                            "applied": list(left_key),
                            "left_digest": left_applied.digest,
                            "right_digest": right_applied.digest,
                        }
                    )
                continue
            if left_key > right_key:
                ahead, behind_key, ahead_key = 0, right_key, left_key
            else:
                ahead, behind_key, ahead_key = right, left_key, right_key
            span = InFlightSpan(shard, labels[0], labels[right], labels[ahead], behind_key, ahead_key, True, 0)
            behind_applied = right_applied if ahead == 0 else left_applied
            touched, span.complete, span.reason, span.entries, changed, added = _touched_between(
                replicas[ahead],
                shard,
                behind_key,
                ahead_key,
                options.in_flight_entries_max,
                behind_applied.digest if behind_applied else "",
            )
            changes[(right, shard)] = (ahead, changed, added)
            every_key_in_flight(in_flight, right, changed, tables)
            if span.reason.startswith(HISTORY_DIVERGED) and behind_applied is not None:
                # Reported like two replicas at one key with different digests: the digests at the behind key.
                ahead_digest = _digest_at(replicas[ahead], shard, behind_key) or ""
                left_digest, right_digest = (
                    (ahead_digest, behind_applied.digest) if ahead == 0 else (behind_applied.digest, ahead_digest)
                )
                report.histories_diverged.append(
                    {
                        "shard": shard,
                        "left": labels[0],
                        "right": labels[right],
                        "applied": list(behind_key),
                        "left_digest": left_digest,
                        "right_digest": right_digest,
                    }
                )
            for table_name, key in touched:
                if table_name in tables:
                    in_flight[(right, table_name)].add(key_bytes(key))
            report.in_flight_spans.append(span)
            say(
                f"shard {shard}: {labels[ahead]} is ahead of the other by {span.entries} entries"
                + ("" if span.complete else f" ({span.reason})")
            )
    return in_flight, changes


def _widen_in_flight(
    replicas: list[Replica],
    labels: list[str],
    tables: dict[str, TableSchema],
    report: CompareReport,
    in_flight: InFlightKeys,
    options: CompareOptions,
    say: Progress,
) -> None:
    """Live nodes, and the files of running nodes (read one snapshot per call), move on while they are
    read: every key touched between the lowest applied key seen before the reads and the highest seen
    after them (on either side of a pair) may legitimately differ, so it is in flight, not divergence.
    Read once the row digests are in; replicas that did not move cost one ``applied`` read each."""
    after = [replica.applied() for replica in replicas]
    shards = sorted({t.shard for t in tables.values()})
    for right in range(1, len(replicas)):
        for shard in shards:
            positions = [
                position
                for position in (
                    report.applied[labels[0]].get(shard),
                    report.applied[labels[right]].get(shard),
                    after[0].get(shard),
                    after[right].get(shard),
                )
                if position is not None
            ]
            seen = [position.applied for position in positions]
            moved = any(report.applied[labels[index]].get(shard) != after[index].get(shard) for index in (0, right))
            if not moved or min(seen) == max(seen):
                continue  # nothing moved: the plan's span (step 2) already holds the lag between the two
            low, high = min(seen), max(seen)
            low_digest = next(position.digest for position in positions if position.applied == low)
            ahead = max((0, right), key=lambda index: after[index][shard].applied if shard in after[index] else low)
            span = InFlightSpan(shard, labels[0], labels[right], labels[ahead], low, high, True, 0)
            touched, span.complete, span.reason, span.entries, changed, _ = _touched_between(
                replicas[ahead], shard, low, high, options.in_flight_entries_max, low_digest
            )
            span.reason = span.reason or "the replicas moved on while they were read"
            every_key_in_flight(in_flight, right, changed, tables)
            for table_name, key in touched:
                if table_name in tables:
                    in_flight[(right, table_name)].add(key_bytes(key))
            report.in_flight_spans.append(span)
            say(f"shard {shard}: writes went on during the compare ({span.entries} entries in flight)")


HISTORY_DIVERGED = "histories diverged"


def _digest_at(replica: Replica, shard: str, key: TxKey) -> str | None:
    """The digest of ``replica``'s entry at ``key`` (hex), or None when its log does not hold it (trimmed)."""
    if key.counter < 1:
        return None
    # The entry at ``key`` is the first one after (generation, counter - 1): nothing sorts between them.
    probe = replica.entries_after(shard, TxKey(key.generation, key.counter - 1), 1)
    return probe[0].digest if probe and probe[0].tx_key == key else None


def _touched_between(
    replica: Replica, shard: str, behind: TxKey, ahead: TxKey, entries_max: int, behind_digest: str = ""
) -> tuple[list[tuple[str, Any]], bool, str, int, dict[str, str], dict[str, set[str]]]:
    """(touched keys, complete, reason, entries read, table -> last "created" or "dropped", table -> the
    columns added) for the entries in ``(behind, ahead]`` (as far as they were read, when incomplete).

    The span is lag only if ``replica``'s history goes through the behind replica's position: the
    entry after ``behind`` must name it as previous, and the entry at ``behind``, when the log still
    holds it, must have the behind replica's digest (``behind_digest``). Another entry at the same key
    is another history: the span is incomplete (its reason starts with ``HISTORY_DIVERGED``), and what
    its keys show is divergence, not lag."""
    touched: list[tuple[str, Any]] = []
    changed: dict[str, str] = {}
    added: dict[str, set[str]] = defaultdict(set)
    after = behind
    count = 0
    if behind_digest:
        digest = _digest_at(replica, shard, behind)
        if digest is not None and digest != behind_digest:
            reason = (
                f"{HISTORY_DIVERGED}: the rlog of {replica.spec.label} has a different digest at {behind} "
                f"({digest[:16]}, the other replica applied {behind_digest[:16]})"
            )
            return touched, False, reason, count, changed, added
    while after < ahead:
        batch = replica.entries_after(shard, after, min(1000, entries_max - count) or 1)
        if not batch:
            return touched, False, f"the rlog of {replica.spec.label} ends before {ahead}", count, changed, added
        if count == 0 and batch[0].prev != behind:
            return (
                touched,
                False,
                f"the rlog of {replica.spec.label} no longer holds the entry after {behind}",
                count,
                changed,
                added,
            )
        for entry in batch:
            if entry.tx_key > ahead:
                return touched, True, "", count, changed, added
            if count >= entries_max:
                return touched, False, f"more than in_flight_entries_max={entries_max} entries", count, changed, added
            touched.extend(entry.touched)
            changed.update(entry.tables_changed)
            for table_name, column in entry.columns_added:
                added[table_name].add(column)
            count += 1
            after = entry.tx_key
    return touched, True, "", count, changed, added


def _run(
    session: Any,
    replicas: list[Replica],
    labels: list[str],
    report: CompareReport,
    in_flight: InFlightKeys,
    options: CompareOptions,
    say: Progress,
) -> None:
    tables = {name: replicas[0].catalog()[name] for name in report.tables}
    context = session.sparkContext
    parallelism = max(1, context.defaultParallelism * options.tasks_per_core)

    def tasks_for(ranges: dict[str, list[tuple[Any, Any]]], row_level: bool) -> list[_Task]:
        tasks = []
        total = sum(len(r) for r in ranges.values()) or 1
        for name, table_ranges in ranges.items():
            # Spread each table's ranges over about its share of the parallelism.
            chunks = max(1, round(parallelism * len(table_ranges) / total / len(replicas)))
            size = -(-len(table_ranges) // chunks)
            for start in range(0, len(table_ranges), size):
                chunk = tuple(table_ranges[start : start + size])
                for index, replica in enumerate(replicas):
                    tasks.append(
                        _Task(
                            index,
                            replica.spec,
                            tables[name],
                            start,
                            chunk,
                            options.fanout,
                            options.leaf_rows_max,
                            row_level,
                            options.timeout_ms,
                        )
                    )
        return tasks

    def run(tasks: list[_Task]) -> list[tuple[Any, ...]]:
        return context.parallelize(tasks, len(tasks)).map(run_task).collect() if tasks else []

    phases: dict[str, float] = {}
    report.statistics["phase_seconds"] = phases
    clock = [time.monotonic()]

    def phase(name: str) -> None:
        now = time.monotonic()
        phases[name] = round(phases.get(name, 0.0) + now - clock[0], 3)
        clock[0] = now

    # Level 1: the same boundaries for every replica, from the replica with the most rows.
    pending: dict[str, list[tuple[Any, Any]]] = {}
    for name, table in tables.items():
        reference, rows = _reference_replica(replicas, table)
        if options.ranges_initial:
            split_keys = reference.split_keys(table, min(options.ranges_initial, options.ranges_initial_max))
        else:
            split_keys = _initial_split_keys(reference, table, rows, options)
        edges = [None, *split_keys, None]
        pending[name] = list(zip(edges, edges[1:], strict=False))
    phase("boundaries")
    # (low, high, rows on all replicas, whether that count is exact: a node over its row budget
    # answers no digest and a lower bound for the rows, so a leaf's size is then unknown).
    leaves: dict[str, list[tuple[Any, Any, int, bool]]] = defaultdict(list)
    level = 0
    digests_shipped = 0
    while pending:
        level += 1
        shape = {name: len(items) for name, items in pending.items()}
        counts = {name: [[0] * size for _ in replicas] for name, size in shape.items()}
        digests: dict[str, list[list[bytes | None]]] = {
            name: [[None] * size for _ in replicas] for name, size in shape.items()
        }
        splits: dict[str, list[dict[int, tuple[Any, ...]]]] = {name: [{} for _ in replicas] for name in shape}
        for name, replica_index, first, rows, range_digests, range_splits in run(tasks_for(pending, False)):
            counts[name][replica_index][first : first + len(rows)] = rows
            digests[name][replica_index][first : first + len(range_digests)] = range_digests
            for position, keys in range_splits.items():
                splits[name][replica_index][first + position] = keys
        phase("digest_jobs")
        digests_shipped += sum(shape.values()) * len(replicas)
        if level == 1:
            for name in tables:
                report.rows[name] = {label: sum(counts[name][index]) for index, label in enumerate(labels)}
        next_pending: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        differing = 0
        for name, items in pending.items():
            differing_here = [
                position
                for position in range(len(items))
                if any(
                    digests[name][r][position] is None or digests[name][r][position] != digests[name][0][position]
                    for r in range(len(replicas))
                )
            ]
            differing += len(differing_here)
            too_many = len(differing_here) > options.level_ranges_max
            for position in differing_here:
                low, high = items[position]
                per_replica = [counts[name][r][position] for r in range(len(replicas))]
                widest = max(range(len(replicas)), key=lambda r: (per_replica[r], -r))
                cut = splits[name][widest].get(position, ())
                if too_many or max(per_replica) <= options.leaf_rows_max or level >= options.depth_max or not cut:
                    exact = all(digests[name][r][position] is not None for r in range(len(replicas)))
                    leaves[name].append((low, high, sum(per_replica), exact))
                    continue
                edges = [low, *cut, high]
                next_pending[name].extend(zip(edges, edges[1:], strict=False))
        say(f"level {level}: {sum(shape.values())} range(s) digested, {differing} differ")
        pending = dict(next_pending)
        phase("digest_merge")
    report.statistics.update(
        {"levels": level, "range_digests": digests_shipped, "leaf_ranges": sum(len(v) for v in leaves.values())}
    )
    for name in tables:
        for right in range(1, len(replicas)):
            report.pairs.append(PairTableResult(name, labels[0], labels[right]))
    report.statistics["rows_shipped"] = 0
    report.statistics["rows_fetched"] = 0
    if not leaves:
        return

    # Row level: (key, row digest) for the rows of the differing leaves only.
    leaf_ranges = {name: [(low, high) for low, high, _, _ in items] for name, items in leaves.items()}
    expected = sum(rows for items in leaves.values() for _, _, rows, _ in items)
    exact = all(exact for items in leaves.values() for _, _, _, exact in items)
    results = {(p.table, p.right): p for p in report.pairs}
    # The driver holds every row digest it merges: only when their number is known to be within its bound.
    if exact and expected <= options.driver_row_digests_max:
        report.statistics["row_level"] = "driver"
        found: dict[str, list[dict[Any, bytes]]] = {name: [{} for _ in replicas] for name in leaf_ranges}
        shipped = 0
        for name, replica_index, _, pairs in run(tasks_for(leaf_ranges, True)):
            found[name][replica_index].update(pairs)
            shipped += len(pairs)
        phase("row_job")
        # Nodes, and the data directories of running nodes (one snapshot per read), move on meanwhile.
        _widen_in_flight(replicas, labels, tables, report, in_flight, options, say)
        phase("in_flight_widening")
        report.statistics["rows_shipped"] = shipped
        say(f"row level: {shipped} row digest(s) from {report.statistics['leaf_ranges']} range(s), merged here")
        for name, per_replica in found.items():
            for right in range(1, len(replicas)):
                keys = _classify(per_replica[0], per_replica[right], in_flight.get((right, name), set()))
                _fill(results[(name, labels[right])], keys, options.sample_max)
        phase("row_merge")
    else:
        report.statistics["row_level"] = "spark"

        def widen() -> None:
            # As for the driver's merge: once the row digests are in, the writes made meanwhile are in flight.
            _widen_in_flight(replicas, labels, tables, report, in_flight, options, say)

        _spark_row_level(
            session, run, tasks_for(leaf_ranges, True), tables, labels, results, in_flight, options, report, say, widen
        )
        phase("row_spark_join")
    _fetch_samples(replicas, tables, results, labels, report)
    phase("samples")


def _classify(left: dict[Any, bytes], right: dict[Any, bytes], in_flight: set[bytes]) -> dict[str, list[Any]]:
    """Keys of one pair by category, from both sides' row digests of the differing leaves."""
    keys: dict[str, list[Any]] = {category: [] for category in (*CATEGORIES, "in_flight")}
    for key, digest in left.items():
        other = right.get(key)
        category = "missing_on_right" if other is None else ("different" if other != digest else None)
        if category is not None:
            keys["in_flight" if key_bytes(key) in in_flight else category].append(key)
    for key in right.keys() - left.keys():
        keys["in_flight" if key_bytes(key) in in_flight else "missing_on_left"].append(key)
    return keys


def _fill(result: PairTableResult, keys: dict[str, list[Any]], sample_max: int) -> None:
    """Exact counts, and the ``sample_max`` first keys in key order per category (rows come later)."""
    for category, items in keys.items():
        result.counts[category] += len(items)
        chosen = heapq.nsmallest(sample_max, items, key=key_bytes) if sample_max else []
        result.samples[category] = [{"key": key, "left": None, "right": None} for key in chosen]


def _spark_row_level(
    session: Any,
    run: Callable[[list[_Task]], list[tuple[Any, ...]]],
    tasks: list[_Task],
    tables: dict[str, TableSchema],
    labels: list[str],
    results: dict[tuple[str, str], PairTableResult],
    in_flight: InFlightKeys,
    options: CompareOptions,
    report: CompareReport,
    say: Progress,
    widen: Callable[[], None],
) -> None:
    """Row level for many differing rows: Spark joins the row digests, the driver gets counts and samples.

    ``widen`` runs once the row digests are read (cached), before the in-flight keys are joined."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("table", StringType(), False),
            StructField("key", BinaryType(), False),
            StructField("replica", IntegerType(), False),
            StructField("digest", BinaryType(), False),
        ]
    )
    context = session.sparkContext
    rows = session.createDataFrame(context.parallelize(tasks, len(tasks)).flatMap(row_digest_records), schema).cache()
    report.statistics["rows_shipped"] = rows.count()
    widen()
    say(
        f"row level: {report.statistics['rows_shipped']} row digest(s) from "
        f"{report.statistics['leaf_ranges']} range(s), joined by Spark"
    )
    in_flight_rows = [(right, name, key) for (right, name), keys in in_flight.items() for key in keys]
    in_flight_frame = session.createDataFrame(
        in_flight_rows,
        StructType(
            [
                StructField("right", IntegerType(), False),
                StructField("table", StringType(), False),
                StructField("key", BinaryType(), False),
            ]
        ),
    ).withColumn("in_flight", F.lit(True))
    for right in range(1, len(labels)):
        every = every_key_tables(in_flight, right)
        in_flight_here = F.col("in_flight").isNotNull()
        if every:
            in_flight_here = in_flight_here | F.col("table").isin(every)
        left_rows = rows.filter(F.col("replica") == 0).select("table", "key", F.col("digest").alias("left_digest"))
        right_rows = rows.filter(F.col("replica") == right).select(
            "table", "key", F.col("digest").alias("right_digest")
        )
        joined = (
            left_rows.join(right_rows, ["table", "key"], "full_outer")
            .withColumn(
                "category",
                F.when(F.col("left_digest").isNull(), F.lit("missing_on_left"))
                .when(F.col("right_digest").isNull(), F.lit("missing_on_right"))
                .when(F.col("left_digest") != F.col("right_digest"), F.lit("different")),
            )
            .filter(F.col("category").isNotNull())
            .join(F.broadcast(in_flight_frame.filter(F.col("right") == right).drop("right")), ["table", "key"], "left")
            .withColumn("category", F.when(in_flight_here, F.lit("in_flight")).otherwise(F.col("category")))
            .cache()
        )
        for row in joined.groupBy("table", "category").count().collect():
            results[(row["table"], labels[right])].counts[row["category"]] = int(row["count"])
        if options.sample_max:
            window = Window.partitionBy("table", "category").orderBy("key")
            sampled = (
                joined.withColumn("position", F.row_number().over(window))
                .filter(F.col("position") <= options.sample_max)
                .collect()
            )
            for row in sorted(sampled, key=lambda r: (r["table"], r["category"], r["position"])):
                key = key_from_bytes(bytes(row["key"]), tables[row["table"]].key_type)
                results[(row["table"], labels[right])].samples[row["category"]].append(
                    {"key": key, "left": None, "right": None}
                )
        joined.unpersist()
    rows.unpersist()


def _fetch_samples(
    replicas: list[Replica],
    tables: dict[str, TableSchema],
    results: dict[tuple[str, str], PairTableResult],
    labels: list[str],
    report: CompareReport,
) -> None:
    """The rows of the sampled keys, read by key from both replicas of each pair.

    A live node is read after the digests were taken, so a sampled row shows its state now.
    """
    fetched = 0
    for (name, right_label), result in results.items():
        table = tables[name]
        names = [column for column, _ in table.columns]
        keys = sorted({sample["key"] for items in result.samples.values() for sample in items}, key=key_bytes)
        if not keys:
            continue
        try:
            left_rows = replicas[0].read_rows(table, keys)
            right_rows = replicas[labels.index(right_label)].read_rows(table, keys)
        except ReplicaError as error:
            raise CompareError(str(error)) from None
        fetched += len(left_rows) + len(right_rows)
        for items in result.samples.values():
            for sample in items:
                left, right = left_rows.get(sample["key"]), right_rows.get(sample["key"])
                sample["left"] = dict(zip(names, left, strict=True)) if left is not None else None
                sample["right"] = dict(zip(names, right, strict=True)) if right is not None else None
            items.sort(key=lambda item: key_bytes(item["key"]))
    report.statistics["rows_fetched"] = fetched


def _initial_split_keys(reference: Replica, table: TableSchema, rows: int, options: CompareOptions) -> list[Any]:
    """The first level's split keys, about one per ``range_rows`` rows, at most ``ranges_initial_max - 1``.

    A node's ``key_boundaries`` walks a bounded number of keys from the low end (``rows`` is then a
    lower bound and its keys cut only those first rows): the rest of the table would be one range,
    over the node's row budget, drilled into a budget's worth of rows per level. So the keys are asked
    for again after the last one until what follows it is about one range; for a file, which counts
    all its rows, that is one more count of the last range's rows."""
    keys: list[Any] = []
    while True:
        parts = min(max(1, -(-rows // options.range_rows)), options.ranges_initial_max - len(keys))
        if parts < 2:
            return keys
        found = reference.key_boundaries(table, parts, keys[-1] if keys else None)[1]
        if not found:
            return keys
        keys.extend(found)
        rows = reference.key_boundaries(table, 1, keys[-1])[0]


def _reference_replica(replicas: list[Replica], table: TableSchema) -> tuple[Replica, int]:
    """The replica with the most rows (ties: the first) and its row count (bounded on a node)."""
    counted = []
    for index, replica in enumerate(replicas):
        try:
            counted.append((replica.key_boundaries(table, 1)[0], -index))
        except ReplicaError as error:
            raise CompareError(str(error)) from None
    rows, index = max(counted)
    return replicas[-index], rows


__all__ = [
    "CATEGORIES",
    "EXIT_DIVERGED",
    "EXIT_EQUAL",
    "EXIT_ERROR",
    "CompareError",
    "CompareOptions",
    "CompareReport",
    "EveryKey",
    "InFlightSpan",
    "PairTableResult",
    "compare",
    "report_json",
]
