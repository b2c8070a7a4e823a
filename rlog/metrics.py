"""Prometheus metrics of a node: ``[metrics] listen = "127.0.0.1:9400"``, ``GET /metrics``.

Theory of operation
-------------------
Three kinds of figures, kept apart so that a scrape never touches the node's loop:

* **Events** the loop counts as they happen, through small hooks at the places that do the work:
  SQLite commits, the duration of the durable ones (the fsync at ``synchronous=FULL``; a commit
  that only applies entries already durable in the log skips it), transactions per commit
  (group commit), the time a write waited between its arrival and its acknowledgement (commit
  latency as a client sees it), malformed frames. prometheus_client's counters and histograms are
  thread-safe, so the hook is one increment or ``observe``.
* **The process** (its CPU seconds, resident memory and open file descriptors, ``process_*``):
  prometheus_client's process collector reads them from ``/proc`` in the scrape thread.
* **State** (generations, sequencer, committed and applied tx keys, replicant lag and mode, agents
  and their memory budget, bootstrap progress, refusals, a full disk) is what ``status`` already
  reports. The loop hands a fresh status dict to ``NodeMetrics.refresh`` at most once per
  ``REFRESH_INTERVAL_MS``; the scrape thread only reads the last one handed over (the loop
  replaces the reference and never mutates a dict it handed over), and turns it into metric
  families when scraped.

The HTTP endpoint is an untrusted socket like any other: one thread serves one connection at a
time (a slow or hostile client delays only other scrapes, never the node), each connection has a
``CONNECTION_TIMEOUT_S`` socket timeout, request lines and headers are bounded by ``http.server``,
and only ``GET /metrics`` (and ``/``) is answered, and ``HEAD`` of them (GET's headers, no body). It
is unauthenticated: the default, and the advice, is a loopback address; a node listening elsewhere
logs a warning at start.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("mnesite.metrics")

REFRESH_INTERVAL_MS = 1000
CONNECTION_TIMEOUT_S = 2.0
LISTEN_BACKLOG_MAX = 16
# How often the endpoint's thread looks for a stop between connections (http.server's default, 0.5 s,
# made every node's stop wait up to that long for it).
STOP_POLL_S = 0.05
# Transactions per SQLite commit: 1 .. group_commit_max (256 by default, up to 100,000).
GROUP_COMMIT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384, 100_000)
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REPLICANT_MODES = ("disconnected", "bootstrap", "local_replay", "normal")


def parse_listen(where: str, value: Any) -> tuple[str, int]:
    """``host:port`` (``[::1]:port`` for IPv6) as (host, port); ValueError naming ``where`` otherwise."""
    if not isinstance(value, str) or ":" not in value or len(value) > 255:
        raise ValueError(f'{where} must be "host:port", for example "127.0.0.1:9400", got {value!r}')
    host, _, port_text = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f'{where} must be "host:port" with a port in 1..65535, got {value!r}')
    return host, int(port_text)


def _key_parts(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    return None


class NodeMetrics:
    """The metrics of one node: event hooks for the loop, and a collector over its last status."""

    def __init__(self, node: str, role: str) -> None:
        self.node = node
        self.role = role
        self.registry = CollectorRegistry(auto_describe=False)
        self.commits = Counter(
            "mnesite_commits",
            "SQLite commits (a durable one fsyncs the WAL at synchronous=FULL; applies of logged entries do not)",
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "mnesite_fsync_seconds",
            "Duration of a durable SQLite COMMIT: the fsync of the turn's writes",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.group_commit = Histogram(
            "mnesite_group_commit_transactions",
            "Transactions applied per SQLite commit (group commit size)",
            buckets=GROUP_COMMIT_BUCKETS,
            registry=self.registry,
        )
        self.write_seconds = Histogram(
            "mnesite_commit_seconds",
            "Commit latency: from a write's arrival at this node to its acknowledgement with a tx key",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.malformed = Counter(
            "mnesite_malformed_messages",
            "Frames refused because they do not decode or fit their schema",
            registry=self.registry,
        )
        self._status: dict[str, Any] = {}
        self._next_refresh_ms = 0
        self.registry.register(_StatusCollector(self))
        # The process's CPU seconds, resident memory and file descriptors (process_*, read from /proc
        # by the scrape thread): what sizing a node needs, e.g. its CPU per applied transaction.
        ProcessCollector(registry=self.registry)

    # -- hooks for the loop ----------------------------------------------------------------

    def committed(self, seconds: float, transactions: int, durable: bool = True) -> None:
        """One COMMIT of ``seconds``: ``transactions`` applied in it; ``durable``: it waited for an fsync."""
        self.commits.inc()
        if durable:
            self.commit_seconds.observe(seconds)
        if transactions > 0:
            self.group_commit.observe(transactions)

    def acknowledged(self, seconds: float) -> None:
        self.write_seconds.observe(seconds)

    def refresh_due(self, now_ms: int) -> bool:
        return now_ms >= self._next_refresh_ms

    def refresh(self, now_ms: int, status: dict[str, Any]) -> None:
        """Hand over a fresh status dict (the loop must not change it afterwards)."""
        self._next_refresh_ms = now_ms + REFRESH_INTERVAL_MS
        self._status = status

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _StatusCollector:
    """Metric families built, at scrape time, from the last status the loop handed over."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        status = self.metrics._status  # one read of the reference: the loop swaps it, never mutates it
        info = GaugeMetricFamily("mnesite_node_info", "This node: name and role", labels=["node", "role"])
        info.add_metric([self.metrics.node, self.metrics.role], 1)
        yield info
        if not status:
            return
        yield from _shard_families(status)
        yield from _node_families(status)


def _gauge(name: str, text: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, labels=labels)


def _shard_families(status: dict[str, Any]) -> Iterator[Any]:
    shards: dict[str, dict[str, Any]] = status.get("shards") or {}
    keys = {
        kind: (
            _gauge(f"mnesite_{kind}_generation", f"Generation of the shard's {kind} tx key", ["shard"]),
            _gauge(f"mnesite_{kind}_counter", f"Counter of the shard's {kind} tx key", ["shard"]),
        )
        for kind in ("applied", "committed", "last")
    }
    generation = _gauge("mnesite_generation", "The shard's current generation (sequencer term)", ["shard"])
    elections = CounterMetricFamily(
        "mnesite_elections", "Generations this core moved through since it started", labels=["shard"]
    )
    sequencer = _gauge("mnesite_sequencer", "1 for the sequencer this node knows for the shard", ["shard", "sequencer"])
    is_sequencer = _gauge("mnesite_is_sequencer", "1 if this core is the shard's sequencer", ["shard"])
    follower_lag = _gauge(
        "mnesite_follower_lag_entries", "Entries a follower core is behind (on the sequencer)", ["shard", "follower"]
    )
    lag = _gauge(
        "mnesite_replicant_lag_entries", "Entries this replicant is behind its upstream's committed key", ["shard"]
    )
    mode = _gauge("mnesite_replicant_mode", "1 for the replicant's current mode of the shard", ["shard", "mode"])
    bootstraps = CounterMetricFamily(
        "mnesite_bootstraps", "Bootstraps of the shard on this replicant", labels=["shard"]
    )
    resumes = CounterMetricFamily(
        "mnesite_resumes", "Resumes from the rlog (no copy) on this replicant", labels=["shard"]
    )
    copy_rows = _gauge(
        "mnesite_bootstrap_rows_copied", "Rows copied by the bootstrap or snapshot install under way", ["shard"]
    )
    copy_expected = _gauge(
        "mnesite_bootstrap_rows_expected", "Rows the bootstrap or install expects (estimate)", ["shard"]
    )
    copy_rate = _gauge(
        "mnesite_bootstrap_rows_per_second", "Copy rate of the bootstrap or install under way", ["shard"]
    )
    copy_eta = _gauge("mnesite_bootstrap_eta_seconds", "Estimated time left for the bootstrap or install", ["shard"])
    for shard, info in shards.items():
        for kind, (gen_family, counter_family) in keys.items():
            parts = _key_parts(info.get(kind))
            if parts is not None:
                gen_family.add_metric([shard], parts[0])
                counter_family.add_metric([shard], parts[1])
        if "generation" in info:
            generation.add_metric([shard], info["generation"])
        if "elections" in info:
            elections.add_metric([shard], info["elections"])
        if "role" in info:
            is_sequencer.add_metric([shard], 1 if info["role"] == "sequencer" else 0)
            if info.get("sequencer"):
                sequencer.add_metric([shard, info["sequencer"]], 1)
        for follower, follower_info in (info.get("followers") or {}).items():
            if follower_info.get("lag_entries") is not None:
                follower_lag.add_metric([shard, follower], follower_info["lag_entries"])
        if "mode" in info:
            for name in REPLICANT_MODES:
                mode.add_metric([shard, name], 1 if info["mode"] == name else 0)
            if info.get("lag_entries") is not None:
                lag.add_metric([shard], info["lag_entries"])
            bootstraps.add_metric([shard], info.get("bootstraps", 0))
            resumes.add_metric([shard], info.get("resumes", 0))
        copy = info.get("copy") or info.get("install")
        if copy and (copy.get("rows") or copy.get("rows_expected")):
            copy_rows.add_metric([shard], copy.get("rows") or 0)
            copy_expected.add_metric([shard], copy.get("rows_expected") or 0)
            copy_rate.add_metric([shard], copy.get("rows_per_s") or 0)
            if copy.get("eta_ms") is not None:
                copy_eta.add_metric([shard], copy["eta_ms"] / 1000)
    yield from (*[f for pair in keys.values() for f in pair], generation, elections, sequencer, is_sequencer)
    yield from (follower_lag, lag, mode, bootstraps, resumes, copy_rows, copy_expected, copy_rate, copy_eta)


def _node_families(status: dict[str, Any]) -> Iterator[Any]:
    if "transactions" in status:
        transactions = CounterMetricFamily("mnesite_transactions", "Transactions applied by this node")
        transactions.add_metric([], status["transactions"])
        yield transactions
    agents = status.get("agents")
    if agents is not None:
        count = _gauge("mnesite_agents", "Agents serving replicant watches on this core", [])
        count.add_metric([], len(agents))
        yield count
        agent_lag = _gauge(
            "mnesite_agent_lag_entries", "Entries an agent's replicant has not acknowledged", ["shard", "replicant"]
        )
        for agent in agents:
            if agent.get("lag_entries") is not None:
                agent_lag.add_metric([agent["shard"], agent["replicant"]], agent["lag_entries"])
        yield agent_lag
    budget = status.get("agent_budget")
    if budget is not None:
        # core.agent_budget: the bytes all agents hold together, the bound, and evictions for it.
        used = _gauge(
            "mnesite_agent_budget_used_bytes", "Bytes all agents hold: pushed to replicants, not acknowledged", []
        )
        used.add_metric([], budget["used_bytes"])
        limit = _gauge("mnesite_agent_budget_max_bytes", "The agents' memory budget: [limits] agents_bytes_max", [])
        limit.add_metric([], budget["bytes_max"])
        evicted = CounterMetricFamily(
            "mnesite_agent_budget_evictions", "Silent agents stopped because the agents' memory budget was spent"
        )
        evicted.add_metric([], budget["evicted_agents"])
        # core.agent, "Proven acknowledgements": an ack that proves no push read (a lying or broken replicant).
        refused = CounterMetricFamily(
            "mnesite_agent_acks_refused", "Replicant acknowledgements refused: no valid token, or keys beyond it"
        )
        refused.add_metric([], budget.get("acks_refused", 0))
        yield from (used, limit, evicted, refused)
    peer_versions = status.get("peer_versions")
    if peer_versions is not None:
        # rlog.versions / core.versions: 1 for a peer this core cannot speak with (refused), else 0.
        incompatible = _gauge(
            "mnesite_peer_incompatible",
            "1 for a peer core refused because it speaks no common cluster version",
            ["peer"],
        )
        for peer, info in sorted(peer_versions.items()):
            incompatible.add_metric([peer], 0 if info.get("compatible", True) else 1)
        cluster_version = _gauge("mnesite_cluster_version", "The cluster version this core's shards agreed on", [])
        cluster_version.add_metric([], status.get("cluster_version", 1))
        yield from (incompatible, cluster_version)
    dropped_by = status.get("sends_dropped_by")
    if dropped_by is not None:
        # rlog.server: outgoing frames not sent, each counted once, by reason (sends_dropped in status).
        dropped = CounterMetricFamily(
            "mnesite_sends_dropped",
            "Outgoing frames not sent: dropped by zmq, toward a node that refused this one, or refused for "
            "core_queue_bytes_max",
            labels=["reason"],
        )
        for reason, count in sorted(dropped_by.items()):
            dropped.add_metric([reason], count)
        yield dropped
    violations = CounterMetricFamily(
        "mnesite_protocol_violations", "Well-formed messages that break the protocol against this node's state"
    )
    violations.add_metric([], status.get("protocol_violations", 0))
    yield violations
    security = status.get("security") or {}
    refused = CounterMetricFamily(
        "mnesite_refused", "Requests and connections refused by [security]", labels=["reason"]
    )
    if security.get("curve"):
        refused.add_metric(["role"], security.get("refused_role", 0))
        refused.add_metric(["sender"], security.get("refused_sender", 0))
        refused.add_metric(["unknown_key"], security.get("refused_unknown_key", 0))
        refused.add_metric(["handshake"], sum((security.get("handshakes_failed") or {}).values()))
    yield refused
    connections = status.get("connections")
    if connections is not None:
        # rlog.server: requests refused ``overloaded`` for a node-wide or a per-connection bound.
        overloaded = CounterMetricFamily(
            "mnesite_overloaded",
            "Requests refused overloaded: connections waiting, or answers not read",
            labels=["reason"],
        )
        overloaded.add_metric(["connections_waiting_max"], connections["refused"])
        overloaded.add_metric(["replies_queued_bytes_max"], connections["refused_unread"])
        waiting = _gauge("mnesite_connections_waiting", "Client connections with requests waiting for an answer", [])
        waiting.add_metric([], connections["waiting"])
        yield from (overloaded, waiting)
        if "open" in connections:  # rlog.connections: [limits] connections_max
            open_now = _gauge("mnesite_connections_open", "Connections open on the node's listen socket", [])
            open_now.add_metric([], connections["open"])
            open_max = _gauge("mnesite_connections_open_max", "[limits] connections_max", [])
            open_max.add_metric([], connections["open_max"])
            refused_max = CounterMetricFamily(
                "mnesite_connections_refused", "Connections refused at their handshake: connections_max were open"
            )
            refused_max.add_metric([], connections["refused_open_max"])
            yield from (open_now, open_max, refused_max)
        if "redials_refused" in connections:  # rlog.connections: this node's own connections refused
            redials = CounterMetricFamily(
                "mnesite_redials_refused",
                "This node's connections to other nodes dialled again after a refusal for their connections_max",
            )
            redials.add_metric([], connections["redials_refused"])
            yield redials
        if "redials_refused_key" in connections:
            redials_key = CounterMetricFamily(
                "mnesite_redials_refused_key",
                "This node's connections to other nodes dialled again after a refusal of this node's key",
            )
            redials_key.add_metric([], connections["redials_refused_key"])
            yield redials_key
    yield from _disk_families(status.get("disk"))
    yield from _backup_families(status)
    yield from _reader_families(status.get("queries"), status.get("changes"))


# (status key, metric name, help) of the read-only SQL queries (rlog.query) and the changefeed (rlog.changes)
QUERY_COUNTERS = (
    ("queries", "mnesite_queries", "Read-only SQL queries started"),
    ("pages", "mnesite_query_pages", "Pages of query results answered"),
    ("refused", "mnesite_queries_refused", "Queries refused by the read-only checks"),
    ("budget_stops", "mnesite_query_budget_stops", "Queries stopped after query_ms_max of SQLite time"),
    ("expired", "mnesite_query_cursors_expired", "Query cursors closed because their reader stopped asking"),
)
CHANGES_COUNTERS = (
    ("pages", "mnesite_changes_pages", "Changefeed pages answered"),
    ("records", "mnesite_changes_records", "Changefeed records answered (changes and copy rows)"),
    ("snapshots", "mnesite_changes_snapshots", "Copies begun for a consumer whose position was trimmed"),
    ("refused", "mnesite_changes_refused", "Changefeed requests refused: changes_waiting_max were held"),
)


def _reader_families(queries: dict[str, Any] | None, changes: dict[str, Any] | None) -> Iterator[Any]:
    """What readers asked of this node: SQL queries and changefeed pages (a node serves both)."""
    for figures, counters in ((queries, QUERY_COUNTERS), (changes, CHANGES_COUNTERS)):
        for key, name, text in counters if figures is not None else ():
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], figures.get(key, 0))
            yield counter
    if queries is not None:
        open_cursors = _gauge("mnesite_query_cursors_open", "Query cursors open (a statement's snapshot held)", [])
        open_cursors.add_metric([], queries.get("open", 0))
        yield open_cursors
    if changes is not None:
        held = _gauge("mnesite_changes_held", "Changefeed requests held until a shard they follow moves", [])
        held.add_metric([], changes.get("held", 0))
        yield held


def _disk_families(disk: dict[str, Any] | None) -> Iterator[Any]:
    """The disk's state (``rlog.disk``): alert on ``mnesite_disk_full == 1``."""
    if disk is None:
        return
    full = _gauge("mnesite_disk_full", "1 while the disk is full: writes are refused with disk_full", [])
    full.add_metric([], 1 if disk.get("state") == "full" else 0)
    full_for = _gauge("mnesite_disk_full_seconds", "How long the disk has been full (0 when not)", [])
    full_for.add_metric([], (disk.get("full_for_ms") or 0) / 1000)
    fills = CounterMetricFamily("mnesite_disk_fills", "Times the disk was found full since the node started")
    fills.add_metric([], disk.get("fills", 0))
    refused = CounterMetricFamily("mnesite_disk_full_writes_refused", "Writes refused with disk_full")
    refused.add_metric([], disk.get("writes_refused", 0))
    yield from (full, full_for, fills, refused)


def _backup_families(status: dict[str, Any]) -> Iterator[Any]:
    """The last backup's failure (``backup_failed``, kept until a backup succeeds): alert on it."""
    if "backup" not in status:
        return
    failed = status.get("backup_failed")
    gauge = _gauge("mnesite_backup_failed", "1 while the last backup failed and none has succeeded since", [])
    gauge.add_metric([], 1 if failed is not None else 0)
    when = _gauge("mnesite_backup_failed_timestamp_seconds", "Unix time of that failure (0 when none)", [])
    when.add_metric([], failed["failed_at_s"] if failed is not None else 0)
    yield from (gauge, when)
    schedule = status.get("backup_schedule")
    if schedule is not None:  # [backup] interval_s: alert when this gets older than a few intervals
        last = _gauge(
            "mnesite_backup_scheduled_success_timestamp_seconds",
            "Unix time the last scheduled backup ([backup]) finished, since the node started (0: none yet)",
            [],
        )
        last.add_metric([], schedule.get("last_success_at_s") or 0)
        yield last


class _Handler(http.server.BaseHTTPRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # the socket timeout of one connection: a silent client is dropped
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        """HEAD, as monitoring probes send it: GET's status and headers, no body (RFC 9110 9.3.2);
        it was 501 (http.server answers a method without a ``do_`` method so)."""
        self._answer(with_body=False)

    def _answer(self, with_body: bool) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")  # sends no body to a HEAD itself
            return
        body = self.server.metrics.text()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # a scrape every few seconds must not fill the node's log


class MetricsServer(http.server.HTTPServer):
    """One thread, one connection at a time: bounded threads and memory whatever clients do."""

    request_queue_size = LISTEN_BACKLOG_MAX
    allow_reuse_address = True

    def __init__(self, host: str, port: int, metrics: NodeMetrics) -> None:
        self.metrics = metrics
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(
            target=self.serve_forever, args=(STOP_POLL_S,), name="mnesite-metrics", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def start_metrics(
    listen: str, node: str, role: str, is_loopback: Callable[[str], bool]
) -> tuple[NodeMetrics, MetricsServer]:
    """Bind ``listen`` and serve ``/metrics`` from a thread; raises OSError if the address is taken."""
    host, port = parse_listen("[metrics].listen", listen)
    metrics = NodeMetrics(node, role)
    try:
        server = MetricsServer(host, port, metrics)
    except OSError as error:
        # Said as it was ("Address already in use"), the node's own listen address seemed to be taken.
        raise OSError(error.errno, f"[metrics].listen {listen}: {error.strerror}") from None
    server.start()
    if not is_loopback(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"):  # IPv6: bracketed
        log.warning("metrics on %s:%d are readable by anyone who can reach it (no authentication)", host, port)
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return metrics, server
