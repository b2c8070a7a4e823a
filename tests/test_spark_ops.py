"""What the Spark compare reads from a node's rlog (``spark.replica``): the keys each entry touches.
Entries the cores write themselves (membership, the cluster version of issue 23) and index changes touch
no row (as a file replica reads them); a table created or dropped, or a column added, is a table change;
an op the compare does not know stops it with a clear error."""

from __future__ import annotations

import pytest
from mnesite.rlog.types import (
    AddColumnOp,
    ClusterVersionOp,
    CreateIndexOp,
    CreateTableOp,
    DropIndexOp,
    DropTableOp,
    MembersOp,
    OpDecodeError,
    WriteOp,
    op_to_json,
)
from mnesite.spark.replica import _op_from_client, columns_added, tables_changed

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    "op",
    [
        ClusterVersionOp("default", 2),
        MembersOp(("core1", "core2", "core3"), "", ""),
        CreateIndexOp("users_by_name", "users", "default", ("name",)),
        DropIndexOp("users_by_name", "users", "default"),
    ],
    ids=lambda op: type(op).__name__,
)
def test_ops_that_change_no_row_touch_nothing(op) -> None:
    assert _op_from_client(op_to_json(op)) is None


def test_a_node_and_a_file_read_a_table_created_dropped_or_altered_alike() -> None:
    """A table dropped in a node's span was read as no op, so it was not known to be in flight; a
    column added was read as no op too (once it stopped the compare with "unknown op", exit 2), so a
    declaration that differed by it was reported as divergence."""
    ops = (
        CreateTableOp("fresh", "default", "k", (("k", "INTEGER"),)),
        DropTableOp("users", "default"),
        AddColumnOp("fresh", "default", "email", "TEXT"),
    )
    read = tuple(_op_from_client(op_to_json(op)) for op in ops)
    assert read == ops
    assert tables_changed(read) == (("fresh", "created"), ("users", "dropped"))
    assert columns_added(read) == (("fresh", "email"),)


def test_a_write_is_read_and_an_unknown_op_is_refused() -> None:
    assert _op_from_client(op_to_json(WriteOp("users", {"id": 1}))) == WriteOp("users", {"id": 1})
    with pytest.raises(OpDecodeError, match="unknown op 'rename_table'"):
        _op_from_client({"op": "rename_table", "table": "users"})


@pytest.mark.timeout(60)
def test_a_node_replica_reads_rows_larger_than_a_frame_holds_per_batch(tmp_path) -> None:
    """The data source reads a live node's rows in scan pages of ``batch_rows`` (1,000). A page of big
    rows exceeds the node's frame_bytes_max and is answered ``too_large``: the read failed, where
    ``Client.scan`` asks for fewer rows. It reads every row now, in key ranges too."""
    from mnesite.spark.replica import open_replica, parse_replica

    from tests.conftest import ThreadNode

    node = ThreadNode(tmp_path / "data", extra={"limits": {"frame_bytes_max": 64 * 1024}})
    try:
        with node.client() as client:
            client.create_table("big", key="k", columns=[("k", "INTEGER"), ("v", "TEXT")])
            for start in range(0, 300, 20):
                client.transact(
                    [
                        {"op": "write", "table": "big", "row": {"k": k, "v": "x" * 1000}}
                        for k in range(start, start + 20)
                    ]
                )
        with open_replica(parse_replica(node.endpoint)) as replica:
            table = replica.table("big")
            assert [key for key, _ in replica.iter_rows(table, None, None)] == list(range(300))
            assert [key for key, _ in replica.iter_rows(table, 99, 250)] == list(range(100, 251))
    finally:
        node.stop()


@pytest.mark.parametrize(
    "change",
    [{"in_flight_entries_max": 0}, {"timeout_ms": 0}, {"batch_rows_max": 0}, {"batch_rows_max": 10**9}],
    ids=lambda change: next(iter(change)),
)
def test_compare_options_out_of_bounds_are_refused_before_anything_runs(change) -> None:
    """``CompareOptions`` checked most of its bounds but not these: a zero timeout failed each node request,
    ``in_flight_entries_max`` 0 marked every lag incomplete (divergence), a huge batch asked nodes for more
    rows than any answers."""
    from dataclasses import replace

    from mnesite.spark.compare import CompareError, CompareOptions, compare

    with pytest.raises(CompareError, match=next(iter(change))):
        compare(["a", "b"], replace(CompareOptions(), **change))


def test_a_digest_a_replicant_does_not_know_yet_is_unknown_not_a_diverged_history() -> None:
    """A replicant's status gives digest null from a bootstrap's reset until its replay. It was read as
    the text "None", compared with the other replica's digest at the same applied key, and reported
    as diverged histories (and, behind, made every key of the span divergence)."""
    from types import SimpleNamespace

    from mnesite.rlog.types import TxKey
    from mnesite.spark.compare import CompareOptions, CompareReport, _find_in_flight
    from mnesite.spark.replica import NodeReplica, ReplicaSpec, ShardApplied

    replica = NodeReplica.__new__(NodeReplica)  # no node: only its status answer matters
    replica.spec = ReplicaSpec("node", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1")
    replica._error_type = RuntimeError
    replica.client = SimpleNamespace(status=lambda: {"shards": {"default": {"applied": [1, 5], "digest": None}}})
    unknown = replica.applied()["default"]
    assert unknown == ShardApplied("default", TxKey(1, 5), "")
    known = ShardApplied("default", TxKey(1, 5), "ab" * 16)
    report = CompareReport([], {"core": {"default": known}, "replicant": {"default": unknown}})
    _find_in_flight([replica, replica], ["core", "replicant"], {}, ["default"], report, CompareOptions(), print)
    assert report.histories_diverged == []


def test_spark_row_level_streams_a_tasks_row_digests_instead_of_holding_them(monkeypatch) -> None:
    """The Spark row level (used when the differing rows are too many for the driver) ran each task
    through ``run_task``, which lists every row digest of the task's leaf ranges before the first one
    reaches Spark: an executor held a task's share of all the differing rows, unbounded. The records
    are now read page by page: the first comes before the next page is read."""
    pytest.importorskip("pyspark")
    from types import SimpleNamespace

    from mnesite.rlog.range_digest import key_bytes
    from mnesite.rlog.schema import TableSchema
    from mnesite.spark import compare as compare_module
    from mnesite.spark.compare import CompareOptions, CompareReport, _Task
    from mnesite.spark.replica import ReplicaSpec

    class ReadPastFirstPage(Exception):
        pass

    class OnePageReplica:
        def __enter__(self) -> OnePageReplica:
            return self

        def __exit__(self, *exc_info: object) -> None:
            pass

        def row_digests(self, table, low, high):
            yield from [(1, b"d" * 16), (2, b"e" * 16)]
            raise ReadPastFirstPage

    monkeypatch.setattr(compare_module, "open_replica", lambda spec, timeout_ms: OnePageReplica())
    captured = {}

    class Captured(Exception):
        pass

    def flat_map(function):
        captured["records"] = function
        raise Captured  # only the function Spark would run on the executors matters here

    session = SimpleNamespace(
        sparkContext=SimpleNamespace(parallelize=lambda tasks, count: SimpleNamespace(flatMap=flat_map)),
        createDataFrame=None,
    )
    table = TableSchema("t", "default", "id", (("id", "INTEGER"),))
    task = _Task(0, ReplicaSpec("file", "/nowhere", "a"), table, 0, ((None, None),), 0, 0, True, 1000)
    report = CompareReport([], {})
    with pytest.raises(Captured):
        compare_module._spark_row_level(
            session, None, [task], {"t": table}, ["a", "b"], {}, {}, CompareOptions(), report, print, print
        )
    records = iter(captured["records"](task))
    assert next(records) == ("t", key_bytes(1), 0, b"d" * 16)
    assert next(records) == ("t", key_bytes(2), 0, b"e" * 16)
    with pytest.raises(ReadPastFirstPage):
        next(records)


class _JavaClass:
    def __init__(self, name: str) -> None:
        self.name = name

    def getName(self) -> str:  # noqa: N802 (Java's name)
        return self.name


class _JavaThrowable:
    """What Py4J hands back for a Java exception: ``getCause``, ``getClass().getName()``, ``getMessage``
    (``alive=False``: the JVM is gone, every call raises as Py4J's do)."""

    _target_id = "o42"

    def __init__(self, name: str, message: str | None, cause: _JavaThrowable | None = None, trace: str = "") -> None:
        self.name, self.message, self.cause, self.alive = name, message, cause, True
        self._gateway_client = self  # py4j asks its gateway client for the stack trace's text
        self.trace = trace

    def _check(self) -> None:
        if not self.alive:
            raise ConnectionError("Answer from Java side is empty")

    def getCause(self) -> _JavaThrowable | None:  # noqa: N802
        self._check()
        return self.cause

    def getClass(self) -> _JavaClass:  # noqa: N802
        self._check()
        return _JavaClass(self.name)

    def getMessage(self) -> str | None:  # noqa: N802
        self._check()
        return self.message

    def send_command(self, command: str) -> str:
        from py4j.protocol import escape_new_line

        self._check()
        return "ys" + escape_new_line(self.trace)


PY4J_FIRST_LINE = "An error occurred while calling o123.collectToPython.\n"
PYTHON_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/opt/mnesite/spark/datasource.py", line 120, in read\n'
    "    row[column]\n"
    "    ~~~^^^^^^^^\n"
    "KeyError: 'email'\n"
    "\n"
    "The above exception was the direct cause of the following exception:\n"
    "\n"
    "Traceback (most recent call last):\n"
    '  File "/opt/pyspark/worker.py", line 9, in main\n'
    "pyspark.errors.exceptions.base.PySparkRuntimeError: [PYTHON_DATA_SOURCE_READ] failed\n"
)


def _py4j_error(java: _JavaThrowable) -> Exception:
    from py4j.protocol import Py4JJavaError

    return Py4JJavaError(PY4J_FIRST_LINE, java)


def test_a_failed_spark_job_is_told_by_its_root_cause_not_py4j_s_first_line() -> None:
    """Regression: a job that failed on an executor was reported as the first line of the Py4JJavaError,
    "the Spark job failed: An error occurred while calling o123.collectToPython.", which says nothing.
    The line is now the innermost Java exception's class and message, or the Python exception's line
    when a Python worker raised it (the root of a chained traceback). No Spark is started: the Java
    side is a stand-in with Py4J's interface."""
    pytest.importorskip("py4j")
    from mnesite.spark.compare import _spark_failure

    unreadable = _JavaThrowable("java.io.FileNotFoundException", "/data/core2/mnesite.db (Permission denied)")
    job = _JavaThrowable("org.apache.spark.SparkException", "Job aborted due to stage failure: ...", unreadable)
    assert _spark_failure(_py4j_error(job)) == (
        "the Spark job failed: java.io.FileNotFoundException: /data/core2/mnesite.db (Permission denied)"
    )

    worker = _JavaThrowable("org.apache.spark.api.python.PythonException", PYTHON_TRACE)
    job = _JavaThrowable("org.apache.spark.SparkException", "Job aborted due to stage failure: ...", worker)
    assert _spark_failure(_py4j_error(job)) == "the Spark job failed: KeyError: 'email'"

    # A cause without a message is named by its class alone.
    job = _JavaThrowable(
        "org.apache.spark.SparkException", "Job aborted", _JavaThrowable("java.lang.OutOfMemoryError", None)
    )
    assert _spark_failure(_py4j_error(job)) == "the Spark job failed: java.lang.OutOfMemoryError"


def test_a_failed_spark_job_s_root_cause_is_read_from_its_text_when_the_jvm_does_not_answer() -> None:
    """The stack trace's text (what ``str`` of a Py4JJavaError gives) is read when the Java objects cannot
    be asked (a call failed); and when even the text cannot be had (the gateway is gone), Py4J's own
    line is all there is. A Python exception's own text (a captured ``PythonException``, an
    ``AnalysisException``) gives its traceback's exception line, else its first line."""
    pytest.importorskip("py4j")
    from mnesite.spark.compare import _spark_failure

    trace = (
        "org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 failed\n"
        "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2898)\n"
        "Caused by: org.apache.spark.SparkException: Task failed while writing rows\n"
        "\tat org.apache.spark.sql.errors.QueryExecutionErrors$.taskFailedWhileWritingRowsError\n"
        "Caused by: java.lang.IllegalStateException: column v is not in the replica's schema\n"
        "\t... 12 more\n"
    )
    error = _py4j_error(_JavaThrowable("org.apache.spark.SparkException", "Job aborted", trace=trace))

    def fails() -> None:
        raise ConnectionError("Answer from Java side is empty")

    error.java_exception.getCause = fails
    assert _spark_failure(error) == (
        "the Spark job failed: java.lang.IllegalStateException: column v is not in the replica's schema"
    )

    error.java_exception.alive = False  # the gateway is gone: str(error) itself fails
    assert _spark_failure(error) == "the Spark job failed: An error occurred while calling o123.collectToPython."

    python = RuntimeError(
        "\n  An exception was thrown from the Python worker. Please see the stack trace below.\n" + PYTHON_TRACE
    )
    assert _spark_failure(python) == "the Spark job failed: KeyError: 'email'"
    analysis = RuntimeError(
        "[UNRESOLVED_COLUMN.WITH_SUGGESTION] A column `v2` cannot be resolved. SQLSTATE: 42703;\n'Project"
    )
    assert _spark_failure(analysis).startswith(
        "the Spark job failed: [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column `v2`"
    )
    long = RuntimeError("x" * 1000)
    assert len(_spark_failure(long)) == len("the Spark job failed: ") + 300


def test_a_failed_spark_job_a_replica_error_caused_is_told_by_the_replica_error() -> None:
    """The line a task's ``ReplicaError`` gives (it names the replica) still wins over the root cause."""
    pytest.importorskip("py4j")
    from mnesite.spark.compare import _spark_failure

    trace = (
        "Traceback (most recent call last):\n"
        '  File "x", line 1\n'
        "mnesite.spark.replica.ReplicaError: /d/mnesite.db: not a mnesite database\n"
    )
    worker = _JavaThrowable("org.apache.spark.api.python.PythonException", trace)
    job = _JavaThrowable(
        "org.apache.spark.SparkException", "Job aborted", worker, trace="SparkException\nCaused by: " + trace
    )
    assert _spark_failure(_py4j_error(job)) == "/d/mnesite.db: not a mnesite database"
