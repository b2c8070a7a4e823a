"""Building a quiet SparkSession that can run mnesite's executor code.

Theory of operation
-------------------
Spark needs a Java runtime; without one PySpark fails deep inside a gateway start-up with a
message that does not say what to install, so ``require_java`` checks first and names the
Debian package. Executors are Python workers started by the JVM: in local mode they inherit
this process's environment, so the directory that holds the ``rlog`` and ``spark`` packages is
put on ``PYTHONPATH`` and the workers use this interpreter. On a cluster the workers must have
mnesite installed (``pip install mnesite[spark]``). Logs are quiet by default: log level
ERROR, no UI, a small number of shuffle partitions (the compare job shuffles digests, not rows).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

JAVA_PACKAGE = "openjdk-17-jre-headless"
SHUFFLE_PARTITIONS_DEFAULT = 8
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG4J_QUIET_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2-quiet.properties")


class SparkUnavailableError(RuntimeError):
    """Spark cannot start here (no Java, no pyspark); the message says what to install."""


def require_java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = os.path.join(java_home, "bin", "java")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("java")
    if found is None:
        raise SparkUnavailableError(
            f"Spark needs Java and none was found (no java on PATH or in JAVA_HOME); "
            f"install it with: apt-get install -y {JAVA_PACKAGE}"
        )
    return found


def prepare_environment() -> None:
    """Make local-mode Python workers able to import ``rlog`` and ``spark`` with this interpreter."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if PROJECT_ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([PROJECT_ROOT, *paths])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # The JVM is launched before any builder option applies: quiet its start-up through the environment.
    quiet = f"-Dlog4j2.configurationFile=file:{LOG4J_QUIET_PATH}"
    if quiet not in os.environ.get("SPARK_SUBMIT_OPTS", ""):
        os.environ["SPARK_SUBMIT_OPTS"] = (os.environ.get("SPARK_SUBMIT_OPTS", "") + " " + quiet).strip()
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null meanwhile (``compare --quiet``).

    The JVM that PySpark launches writes its start-up lines ("Using incubator modules", "Setting
    default log level") to the stderr it inherits, before any log4j setting applies; only the
    descriptor it inherits can silence them. It keeps that descriptor for its life, so its later
    warnings stay quiet too; this process gets its own stderr back at the end.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def start_failure(master: str, error: Exception) -> str:
    """One line for a session that did not start: the master, and the Java exception's own line (a
    Py4J error's first line only names the constructor that failed). A cluster master that does not
    answer makes Spark give up after about a minute and stop the context it was starting."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    java = next((line.removeprefix(": ") for line in lines if line.startswith(": ")), "")
    text = f"Spark could not start with master {master}: {java or lines[0]}"
    if not master.startswith("local") and "stopped SparkContext" in java:
        text += " (does a Spark master answer at that URL?)"
    return text


def build_session(
    master: str = "local[*]",
    app_name: str = "mnesite-compare",
    shuffle_partitions: int = SHUFFLE_PARTITIONS_DEFAULT,
    log_level: str = "ERROR",
    extra_config: dict[str, str] | None = None,
) -> Any:
    """A SparkSession with the mnesite data source registered."""
    require_java()
    try:
        from pyspark.sql import SparkSession
    except ImportError as error:
        raise SparkUnavailableError(f"pyspark is not installed ({error}); install mnesite[spark]") from None
    prepare_environment()
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no "hostname resolves to loopback" warning
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
    )
    for name, value in (extra_config or {}).items():
        builder = builder.config(name, value)
    try:
        session = builder.getOrCreate()
    except Exception as error:  # the gateway raises plain exceptions; turn them into one line
        raise SparkUnavailableError(start_failure(master, error)) from None
    session.sparkContext.setLogLevel(log_level)
    from mnesite.spark.datasource import register

    register(session)
    return session
