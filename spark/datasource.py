"""The ``mnesite`` PySpark data source: one table of one replica as a DataFrame.

Theory of operation
-------------------
``spark.read.format("mnesite").option("table", T)`` with either ``option("path", DIR_OR_DB)``
(a node's data directory or its ``mnesite.db``, opened read-only) or ``option("node",
"tcp://host:port")`` (a live node, read with the batched dirty-read protocol; for a cluster with
``[security]`` add ``option("key", SECRET_KEY_FILE)`` and ``option("server_key", CLUSTER_KEY_FILE)``, and
``option("follow_key_links", "true")`` when they are symbolic links, a Kubernetes secret volume: each
link and directory on the way is checked, as ``Client(follow_key_links=True)`` does).

The driver reads the catalog once to build the schema from the table's declared columns
and chooses ``partitions`` key ranges ``(low, high]`` from evenly spaced keys (``key_boundaries``:
SQLite walks the key index, of the file or on the node, which walks a bounded number of keys from
the low end, so the last partition holds the rest of a big table). Each range is one
``InputPartition``; executors open the replica themselves and read their range in key
order, so reads run in parallel and no executor holds more than one batch of rows.

Types: INTEGER -> long, REAL -> double, TEXT -> string, BLOB -> binary. ANY -> string, with
this conversion: text unchanged, integers in decimal, reals as Python's shortest round-trip
``repr`` (``1.0``, ``1e+100``), blobs as the SQL literal ``X'0A1B'`` (upper-case hex), null as
null. The conversion loses the storage class; compare replicas with ``spark.compare``, which
hashes the stored values, not this rendering.

Options: ``table`` (required), ``path`` or ``node`` (exactly one), ``partitions`` (default 4,
at most ``PARTITIONS_MAX``), ``batch_rows`` (rows per node request, at most
``BATCH_ROWS_MAX``), ``timeout_ms`` (node requests, default 5000), ``key`` and ``server_key`` (key
files for a node of a cluster with ``[security]``), ``follow_key_links`` (``true`` or ``false``, the
default: follow those key files through symbolic links).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from mnesite.rlog.schema import TableSchema
from mnesite.spark.replica import (
    BATCH_ROWS_MAX,
    NODE_TIMEOUT_MS,
    ReplicaError,
    ReplicaSpec,
    open_replica,
    parse_replica,
)
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    BinaryType,
    DataType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

SOURCE_NAME = "mnesite"
PARTITIONS_DEFAULT = 4
PARTITIONS_MAX = 10_000

_SPARK_TYPES: dict[str, DataType] = {
    "INTEGER": LongType(),
    "REAL": DoubleType(),
    "TEXT": StringType(),
    "BLOB": BinaryType(),
    "ANY": StringType(),
}


def any_to_string(value: Any) -> str | None:
    """The documented rendering of an ANY column value as a string (see the module docstring)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return "X'" + value.hex().upper() + "'"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def spark_schema(table: TableSchema) -> StructType:
    return StructType(
        [
            StructField(name, _SPARK_TYPES[column_type], nullable=name != table.key_column)
            for name, column_type in table.columns
        ]
    )


def _int_option(options: dict[str, str], name: str, default: int, maximum: int) -> int:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ReplicaError(f"option {name} must be an integer, got {text!r}") from None
    if not 1 <= value <= maximum:
        raise ReplicaError(f"option {name} must be between 1 and {maximum}, got {value}")
    return value


def _bool_option(options: dict[str, str], name: str) -> bool:
    """``true`` or ``false`` (any case: ``.option(name, True)`` sends ``"true"``); absent: false."""
    text = options.get(name)
    if text is None:
        return False
    if text.lower() not in ("true", "false"):
        raise ReplicaError(f"option {name} must be true or false, got {text!r}")
    return text.lower() == "true"


def _replica_spec(options: dict[str, str]) -> ReplicaSpec:
    path, node = options.get("path"), options.get("node")
    if (path is None) == (node is None):
        raise ReplicaError("the mnesite data source needs exactly one of the options path and node")
    if node is not None and not node.startswith("tcp://"):
        raise ReplicaError(f"option node must be an endpoint like tcp://127.0.0.1:7400, got {node!r}")
    return parse_replica(
        node if node is not None else path,
        options.get("key"),
        options.get("server_key"),
        _bool_option(options, "follow_key_links"),
    )


class KeyRangePartition(InputPartition):
    """Rows with keys in ``(low, high]`` (``None``: unbounded)."""

    def __init__(self, index: int, low: Any, high: Any) -> None:
        super().__init__((index, low, high))
        self.index, self.low, self.high = index, low, high


class MnesiteDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.spec = _replica_spec(dict(options))
        table_name = options.get("table")
        if not table_name:
            raise ReplicaError("the mnesite data source needs the option table")
        self.timeout_ms = _int_option(dict(options), "timeout_ms", NODE_TIMEOUT_MS, 600_000)
        with open_replica(self.spec, self.timeout_ms) as replica:
            self.table = replica.table(table_name)

    def schema(self) -> StructType:
        return spark_schema(self.table)

    def reader(self, schema: StructType) -> DataSourceReader:
        return MnesiteReader(self.spec, self.table, dict(self.options), self.timeout_ms)


class MnesiteReader(DataSourceReader):
    def __init__(self, spec: ReplicaSpec, table: TableSchema, options: dict[str, str], timeout_ms: int) -> None:
        self.spec = spec
        self.table = table
        self.timeout_ms = timeout_ms
        self.partition_count = _int_option(options, "partitions", PARTITIONS_DEFAULT, PARTITIONS_MAX)
        self.batch_rows = _int_option(options, "batch_rows", BATCH_ROWS_MAX, BATCH_ROWS_MAX)

    def partitions(self) -> Sequence[InputPartition]:
        with open_replica(self.spec, self.timeout_ms) as replica:
            split_keys = replica.split_keys(self.table, self.partition_count)
        edges = [None, *split_keys, None]
        return [
            KeyRangePartition(index, low, high) for index, (low, high) in enumerate(zip(edges, edges[1:], strict=False))
        ]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        if not isinstance(partition, KeyRangePartition):
            raise ReplicaError(f"unexpected partition {partition!r}")
        any_columns = [index for index, (_, column_type) in enumerate(self.table.columns) if column_type == "ANY"]
        with open_replica(self.spec, self.timeout_ms) as replica:
            for _, values in replica.iter_rows(self.table, partition.low, partition.high, self.batch_rows):
                if any_columns:
                    converted = list(values)
                    for index in any_columns:
                        converted[index] = any_to_string(converted[index])
                    yield tuple(converted)
                else:
                    yield values


def register(session: Any) -> None:
    """Register the ``mnesite`` format on a SparkSession."""
    session.dataSource.register(MnesiteDataSource)
