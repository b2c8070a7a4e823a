"""Integrity comparison of two or more replicas with Spark: ship range digests, drill into differences.

Theory of operation
-------------------
1. *Plan (driver).* Open every replica (file read-only, or node client); read catalogs and each
   shard's applied tx key. Tables missing on a replica or declared differently are reported
   and not compared. The first level's key ranges come from the replica with the most rows
   (``ntile`` over its key index for a file, a sampled key scan for a node): the same
   boundaries for every replica, ranges ``(low, high]`` covering the whole key space.
2. *In flight (driver).* For each pair (first replica, other replica) and each shard whose
   applied keys differ, the more advanced replica's rlog between the two applied keys is read
   (bounded by ``in_flight_entries_max``). The keys its entries wrote or deleted are *in flight*:
   a difference there is the lag of one replica, not divergence. If the rlog no longer holds
   the whole span (trimmed, or the histories do not connect), the shard is marked incomplete
   and its differences count as divergence.
3. *Digest levels (Spark).* Tasks ``(replica, table, consecutive ranges)`` run on executors; each
   reads its ranges once in key order and emits per range a row count, a BLAKE2b digest
   (``rlog.range_digest``) and a few evenly spaced split keys. Spark groups the digests by range
   and keeps the ranges whose digests are not all equal. Those with more than
   ``leaf_rows_max`` rows on some replica are cut at the split keys of the replica with the most
   rows there and digested again (at most ``depth_max`` levels). Equal replicas therefore ship
   only one digest per first-level range.
4. *Row level (Spark).* For the differing leaf ranges every replica emits ``(key, row digest,
   row)``; Spark full-outer-joins the first replica with each other one on the key, classifies
   keys (missing on one side, values differ, in flight), counts them exactly and keeps a sample
   of at most ``sample_max`` keys per class with both values.

Exit status: 0 equal (in-flight differences allowed), 1 diverged, 2 could not compare
(``CompareError``: bad replica, unknown table, unreachable node, Spark unavailable).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from rlog.range_digest import encode_key, encode_row, row_digest, split_ranges
from rlog.schema import TableSchema
from rlog.types import TxKey
from spark.replica import (
    BATCH_ROWS_MAX,
    NODE_TIMEOUT_MS,
    FileReplica,
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
SPLIT_SAMPLE_KEYS_MAX = 1024  # keys a task keeps per range to choose sub-split keys

Progress = Callable[[str], None]


class CompareError(RuntimeError):
    """The replicas could not be compared; the message is one line for the operator."""


@dataclass(frozen=True)
class CompareOptions:
    tables: tuple[str, ...] = ()  # empty: every table of every replica
    master: str = "local[*]"
    sample_max: int = 10  # sampled keys per class, per table and pair
    ranges_initial: int = 64  # first-level key ranges per table
    fanout: int = 16  # sub-ranges a differing range is cut into
    leaf_rows_max: int = 256  # a differing range with at most this many rows goes to row level
    depth_max: int = 6  # digest levels before going to row level regardless
    level_ranges_max: int = 200_000  # differing ranges one level may drill into
    in_flight_entries_max: int = 100_000  # rlog entries read per shard and pair
    tasks_per_core: int = 2
    batch_rows_max: int = BATCH_ROWS_MAX
    timeout_ms: int = NODE_TIMEOUT_MS

    def check(self) -> None:
        if not 0 <= self.sample_max <= SAMPLE_MAX_LIMIT:
            raise CompareError(f"sample must be between 0 and {SAMPLE_MAX_LIMIT}")
        if self.ranges_initial < 1 or self.fanout < 2 or self.leaf_rows_max < 1 or self.depth_max < 1:
            raise CompareError("ranges_initial >= 1, fanout >= 2, leaf_rows_max >= 1 and depth_max >= 1 are required")


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
        return {"table": self.table, "left": self.left, "right": self.right, "diverged": self.diverged,
                "counts": dict(self.counts), "samples": self.samples}


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
        return {"shard": self.shard, "left": self.left, "right": self.right, "ahead": self.ahead,
                "from": list(self.behind_key), "to": list(self.ahead_key), "complete": self.complete,
                "entries": self.entries, "reason": self.reason}


@dataclass
class CompareReport:
    replicas: list[ReplicaSpec]
    applied: dict[str, dict[str, ShardApplied]]  # replica label -> shard -> applied
    tables: list[str] = field(default_factory=list)
    rows: dict[str, dict[str, int]] = field(default_factory=dict)  # table -> replica label -> rows
    tables_missing: dict[str, list[str]] = field(default_factory=dict)  # table -> labels lacking it
    tables_mismatched: dict[str, dict[str, Any]] = field(default_factory=dict)  # table -> label -> definition
    histories_diverged: list[dict[str, Any]] = field(default_factory=list)
    in_flight_spans: list[InFlightSpan] = field(default_factory=list)
    pairs: list[PairTableResult] = field(default_factory=list)
    statistics: dict[str, Any] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return bool(
            self.tables_missing or self.tables_mismatched or self.histories_diverged
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
            "tables_mismatched": self.tables_mismatched,
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
    return json.dumps(report.to_json(), default=json_default, indent=indent, sort_keys=False)


# -- executor side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Task:
    """Work for one executor: consecutive-or-not ranges of one table of one replica."""

    replica_index: int
    spec: ReplicaSpec
    table: TableSchema
    ranges: tuple[tuple[str, Any, Any], ...]  # (range id, low, high), in key order
    split_parts: int
    row_level: bool
    timeout_ms: int
    batch_rows_max: int


def _runs(ranges: Sequence[tuple[str, Any, Any]]) -> Iterator[list[tuple[str, Any, Any]]]:
    """Group ranges into runs of consecutive ones, so that each run is one scan."""
    run: list[tuple[str, Any, Any]] = []
    for item in ranges:
        if run and run[-1][2] != item[1]:
            yield run
            run = []
        run.append(item)
    if run:
        yield run


def run_task(task: _Task) -> Iterator[tuple[Any, ...]]:
    """Executor entry point: digests per range, or (key, row digest, row) per row at row level."""
    with open_replica(task.spec, task.timeout_ms) as replica:
        for run in _runs(task.ranges):
            low, high = run[0][1], run[-1][2]
            rows = replica.iter_rows(task.table, low, high, task.batch_rows_max)
            if task.row_level:
                for key, values in rows:
                    yield (task.table.name, encode_key(key), task.replica_index, row_digest(values), encode_row(values))
                continue
            bounds = [(item[1], item[2]) for item in run]
            for result in split_ranges(rows, bounds, task.split_parts, SPLIT_SAMPLE_KEYS_MAX):
                range_id = run[result.index][0]
                splits = msgpack.packb(list(result.split_keys), use_bin_type=True)
                yield (task.table.name, range_id, task.replica_index, result.rows, result.digest, splits)


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
            specs = [parse_replica(text) for text in replica_texts]
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
            from spark.session import SparkUnavailableError, build_session

            say(f"starting Spark ({options.master})")
            try:
                session = build_session(options.master)
            except SparkUnavailableError as error:
                raise CompareError(str(error)) from None
        try:
            _run(session, replicas, labels, report, in_flight, options, say)
        finally:
            if owns_session:
                session.stop()
    finally:
        for replica in replicas:
            replica.close()
    report.statistics["seconds"] = round(time.monotonic() - started, 3)
    say(f"done in {report.statistics['seconds']} s: {'diverged' if report.diverged else 'equal'}")
    return report


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


InFlightKeys = dict[tuple[int, str], set[bytes]]  # (right replica index, table) -> encoded keys


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
    for name in wanted:
        lacking = [label for label, catalog in zip(labels, catalogs, strict=True) if name not in catalog]
        if lacking:
            report.tables_missing[name] = lacking
            continue
        definitions = {label: catalog[name] for label, catalog in zip(labels, catalogs, strict=True)}
        if len({(d.key_column, d.columns) for d in definitions.values()}) > 1:
            report.tables_mismatched[name] = {
                label: {"key": d.key_column, "columns": [list(c) for c in d.columns]}
                for label, d in definitions.items()
            }
            continue
        comparable[name] = definitions[labels[0]]
    report.tables = sorted(comparable)
    say(f"comparing {len(comparable)} table(s) across {len(replicas)} replicas")
    in_flight = _find_in_flight(replicas, labels, comparable, report, options, say)
    report.statistics["in_flight_keys"] = sum(len(keys) for keys in in_flight.values())
    return report, in_flight


def _find_in_flight(
    replicas: list[Replica],
    labels: list[str],
    tables: dict[str, TableSchema],
    report: CompareReport,
    options: CompareOptions,
    say: Progress,
) -> InFlightKeys:
    """Keys touched between the applied keys of the first replica and each other one (see step 2)."""
    shards = sorted({t.shard for t in tables.values()})
    in_flight: InFlightKeys = defaultdict(set)
    for right in range(1, len(replicas)):
        for shard in shards:
            left_applied = report.applied[labels[0]].get(shard)
            right_applied = report.applied[labels[right]].get(shard)
            left_key = left_applied.applied if left_applied else TxKey(0, 0)
            right_key = right_applied.applied if right_applied else TxKey(0, 0)
            if left_key == right_key:
                if left_applied and right_applied and left_applied.digest != right_applied.digest:
                    report.histories_diverged.append(
                        {"shard": shard, "left": labels[0], "right": labels[right], "applied": list(left_key),
                         "left_digest": left_applied.digest, "right_digest": right_applied.digest}
                    )
                continue
            if left_key > right_key:
                ahead, behind_key, ahead_key = 0, right_key, left_key
            else:
                ahead, behind_key, ahead_key = right, left_key, right_key
            span = InFlightSpan(shard, labels[0], labels[right], labels[ahead], behind_key, ahead_key, True, 0)
            touched, span.complete, span.reason, span.entries = _touched_between(
                replicas[ahead], shard, behind_key, ahead_key, options.in_flight_entries_max
            )
            for table_name, key in touched:
                if table_name in tables:
                    in_flight[(right, table_name)].add(encode_key(key))
            report.in_flight_spans.append(span)
            say(f"shard {shard}: {labels[ahead]} is ahead of the other by {span.entries} entries"
                + ("" if span.complete else f" ({span.reason})"))
    return in_flight


def _touched_between(
    replica: Replica, shard: str, behind: TxKey, ahead: TxKey, entries_max: int
) -> tuple[list[tuple[str, Any]], bool, str, int]:
    """(touched keys, complete, reason, entries read) for the entries in ``(behind, ahead]``."""
    touched: list[tuple[str, Any]] = []
    after = behind
    count = 0
    while after < ahead:
        batch = replica.entries_after(shard, after, min(1000, entries_max - count) or 1)
        if not batch:
            return touched, False, f"the rlog of {replica.spec.label} ends before {ahead}", count
        if count == 0 and batch[0].prev != behind:
            return touched, False, f"the rlog of {replica.spec.label} no longer holds the entry after {behind}", count
        for entry in batch:
            if entry.tx_key > ahead:
                return touched, True, "", count
            if count >= entries_max:
                return touched, False, f"more than in_flight_entries_max={entries_max} entries", count
            touched.extend(entry.touched)
            count += 1
            after = entry.tx_key
    return touched, True, "", count


def _run(
    session: Any,
    replicas: list[Replica],
    labels: list[str],
    report: CompareReport,
    in_flight: InFlightKeys,
    options: CompareOptions,
    say: Progress,
) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

    tables = {name: replicas[0].catalog()[name] for name in report.tables}
    context = session.sparkContext
    parallelism = max(1, context.defaultParallelism * options.tasks_per_core)
    digest_schema = StructType([
        StructField("table", StringType(), False),
        StructField("range_id", StringType(), False),
        StructField("replica", IntegerType(), False),
        StructField("rows", LongType(), False),
        StructField("digest", BinaryType(), False),
        StructField("splits", BinaryType(), False),
    ])
    row_schema = StructType([
        StructField("table", StringType(), False),
        StructField("key", BinaryType(), False),
        StructField("replica", IntegerType(), False),
        StructField("digest", BinaryType(), False),
        StructField("row", BinaryType(), False),
    ])

    def tasks_for(ranges: dict[str, list[tuple[str, Any, Any]]], row_level: bool) -> list[_Task]:
        tasks = []
        total = sum(len(r) for r in ranges.values()) or 1
        for name, table_ranges in ranges.items():
            # Spread each table's ranges over about its share of the parallelism.
            chunks = max(1, round(parallelism * len(table_ranges) / total / len(replicas)))
            size = -(-len(table_ranges) // chunks)
            for start in range(0, len(table_ranges), size):
                chunk = tuple(table_ranges[start:start + size])
                for index, replica in enumerate(replicas):
                    tasks.append(_Task(index, replica.spec, tables[name], chunk, options.fanout, row_level,
                                       options.timeout_ms, options.batch_rows_max))
        return tasks

    # Level 1: the same boundaries for every replica, from the replica with the most rows.
    pending: dict[str, list[tuple[str, Any, Any]]] = {}
    for name, table in tables.items():
        reference = _reference_replica(replicas, table)
        split_keys = reference.split_keys(table, options.ranges_initial)
        edges = [None, *split_keys, None]
        pending[name] = [(str(i), low, high) for i, (low, high) in enumerate(zip(edges, edges[1:], strict=False))]
    leaves: dict[str, list[tuple[str, Any, Any]]] = defaultdict(list)
    level = 0
    digests_shipped = 0
    while pending:
        level += 1
        tasks = tasks_for(pending, row_level=False)
        frame = session.createDataFrame(
            context.parallelize(tasks, len(tasks)).flatMap(run_task), digest_schema
        ).cache()
        digests_shipped += sum(len(r) for r in pending.values()) * len(replicas)
        if level == 1:
            for row in frame.groupBy("table", "replica").agg(F.sum("rows").alias("rows")).collect():
                report.rows.setdefault(row["table"], {})[labels[row["replica"]]] = int(row["rows"])
            for name in tables:
                for label in labels:
                    report.rows.setdefault(name, {}).setdefault(label, 0)
        differing = (
            frame.groupBy("table", "range_id")
            .agg(
                F.countDistinct("digest").alias("digests"),
                F.max("rows").alias("rows_max"),
                F.max_by("splits", "rows").alias("splits"),
            )
            .filter(F.col("digests") > 1)
            .limit(options.level_ranges_max + 1)
            .collect()
        )
        frame.unpersist()
        say(f"level {level}: {sum(len(r) for r in pending.values())} range(s) digested, {len(differing)} differ")
        bounds = {(name, item[0]): item for name, items in pending.items() for item in items}
        next_pending: dict[str, list[tuple[str, Any, Any]]] = defaultdict(list)
        too_many = len(differing) > options.level_ranges_max
        for row in sorted(differing, key=lambda r: (r["table"], _range_sort_key(r["range_id"]))):
            name, range_id = row["table"], row["range_id"]
            _, low, high = bounds[(name, range_id)]
            splits = msgpack.unpackb(bytes(row["splits"]), raw=False)
            if too_many or row["rows_max"] <= options.leaf_rows_max or level >= options.depth_max or not splits:
                leaves[name].append((range_id, low, high))
                continue
            edges = [low, *splits, high]
            for child, (child_low, child_high) in enumerate(zip(edges, edges[1:], strict=False)):
                next_pending[name].append((f"{range_id}.{child}", child_low, child_high))
        for name in next_pending:
            next_pending[name].sort(key=lambda item: _range_sort_key(item[0]))
        pending = dict(next_pending)
    report.statistics.update({"levels": level, "range_digests": digests_shipped,
                              "leaf_ranges": sum(len(v) for v in leaves.values())})
    for name in tables:
        for right in range(1, len(replicas)):
            report.pairs.append(PairTableResult(name, labels[0], labels[right]))
    if not leaves:
        report.statistics["rows_shipped"] = 0
        return

    # Row level: ship (key, row digest, row) for the differing leaves only.
    for name in leaves:
        leaves[name].sort(key=lambda item: _range_sort_key(item[0]))
    tasks = tasks_for(dict(leaves), row_level=True)
    rows = session.createDataFrame(context.parallelize(tasks, len(tasks)).flatMap(run_task), row_schema).cache()
    report.statistics["rows_shipped"] = rows.count()
    say(f"row level: {report.statistics['rows_shipped']} row(s) from {report.statistics['leaf_ranges']} range(s)")
    in_flight_rows = [(right, name, key) for (right, name), keys in in_flight.items() for key in keys]
    in_flight_frame = session.createDataFrame(
        in_flight_rows,
        StructType([StructField("right", IntegerType(), False), StructField("table", StringType(), False),
                     StructField("key", BinaryType(), False)]),
    ).withColumn("in_flight", F.lit(True))
    results = {(p.table, p.right): p for p in report.pairs}
    from pyspark.sql import Window

    for right in range(1, len(replicas)):
        left_rows = rows.filter(F.col("replica") == 0).select(
            "table", "key", F.col("digest").alias("left_digest"), F.col("row").alias("left_row"))
        right_rows = rows.filter(F.col("replica") == right).select(
            "table", "key", F.col("digest").alias("right_digest"), F.col("row").alias("right_row"))
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
            .withColumn("category", F.when(F.col("in_flight").isNotNull(), F.lit("in_flight"))
                        .otherwise(F.col("category")))
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
                result = results[(row["table"], labels[right])]
                result.samples[row["category"]].append(_sample(tables[row["table"]], row))
            for result in results.values():
                for items in result.samples.values():
                    items.sort(key=lambda item: _sortable(item["key"]))
        joined.unpersist()
    rows.unpersist()


def _range_sort_key(range_id: str) -> tuple[int, ...]:
    return tuple(int(part) for part in range_id.split("."))


def _sortable(key: Any) -> tuple[int, Any]:
    order = {int: 0, str: 1, bytes: 2}
    return (order.get(type(key), 3), key)


def _reference_replica(replicas: list[Replica], table: TableSchema) -> Replica:
    """The file replica with the most rows (cheap to count), else the first node replica."""
    counted = [(replica.row_count(table), index) for index, replica in enumerate(replicas)
               if isinstance(replica, FileReplica)]
    if counted:
        return replicas[max(counted)[1]]
    return replicas[0]


def _decode_row(table: TableSchema, blob: Any) -> dict[str, Any] | None:
    if blob is None:
        return None
    values = msgpack.unpackb(bytes(blob), raw=False)
    return dict(zip([name for name, _ in table.columns], values, strict=True))


def _sample(table: TableSchema, row: Any) -> dict[str, Any]:
    return {
        "key": msgpack.unpackb(bytes(row["key"]), raw=False),
        "left": _decode_row(table, row["left_row"]),
        "right": _decode_row(table, row["right_row"]),
    }


__all__ = [
    "CATEGORIES",
    "EXIT_DIVERGED",
    "EXIT_EQUAL",
    "EXIT_ERROR",
    "CompareError",
    "CompareOptions",
    "CompareReport",
    "InFlightSpan",
    "PairTableResult",
    "compare",
    "report_json",
]
