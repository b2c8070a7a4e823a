"""Metrics (rlog.metrics): the [metrics] config key, the text built from a status, a real HTTP scrape
of a node in this process, the endpoint's bounds, and real processes scraped under writes."""

from __future__ import annotations

import errno
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq
from mnesite.rlog import metrics as metrics_module
from mnesite.rlog.config import ConfigError, parse_config
from mnesite.rlog.metrics import CONNECTION_TIMEOUT_S, NodeMetrics
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Cluster, ThreadNode, free_port, wait_until
from tests.test_cluster import Load, create_table


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics and parse it: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_the_metrics_key_is_exactly_listen_host_port(tmp_path: Path) -> None:
    base = {"node": {"name": "core1", "data_dir": str(tmp_path)}}
    assert parse_config(base).metrics_listen is None
    assert parse_config({**base, "metrics": {"listen": "127.0.0.1:9400"}}).metrics_listen == "127.0.0.1:9400"
    for bad in ({"listen": "9400"}, {"listen": "127.0.0.1:0"}, {"listen": 9400}, {"port": 9400}, {"listen": ":1"}):
        with pytest.raises(ConfigError, match=r"\[metrics\]"):
            parse_config({**base, "metrics": bad})


def test_metrics_text_from_a_status_names_every_family() -> None:
    metrics = NodeMetrics("replicant1", "replicant")
    metrics.committed(0.002, 3)
    metrics.acknowledged(0.01)
    metrics.malformed.inc()
    status = {
        "shards": {
            "default": {
                "mode": "bootstrap",
                "applied": [2, 40],
                "committed": [2, 45],
                "lag_entries": 5,
                "bootstraps": 1,
                "resumes": 0,
                "copy": {"rows": 500, "rows_expected": 1000, "rows_per_s": 250.0, "eta_ms": 2000},
            }
        },
        "security": {
            "curve": True,
            "refused_role": 2,
            "refused_sender": 1,
            "refused_unknown_key": 0,
            "handshakes_failed": {"auth": 3},
        },
        "protocol_violations": 7,
        "sends_dropped": 9,
        "sends_dropped_by": {"zmq": 3, "refused_connection": 2, "core_queue_bytes_max": 4},
        "disk": {"state": "full", "full_for_ms": 2500, "fills": 2, "writes_refused": 9},
        "agents": [],
        "agent_budget": {"used_bytes": 1234, "bytes_max": 16777216, "evicted_agents": 5, "acks_refused": 9},
        "queries": {"open": 2, "queries": 11, "pages": 13, "refused": 3, "budget_stops": 1, "expired": 4},
        "changes": {"pages": 21, "records": 340, "snapshots": 1, "refused": 6, "held": 2},
        "connections": {
            "waiting": 1,
            "waiting_max": 10000,
            "refused": 0,
            "refused_unread": 0,
            "open": 3,
            "open_max": 4,
            "refused_open_max": 8,
            "redials_refused": 6,
            "redials_refused_key": 5,
        },
    }
    metrics.refresh(0, status)
    samples = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert value(samples, "mnesite_commits_total") == 1
    assert value(samples, "mnesite_group_commit_transactions_sum") == 3
    assert value(samples, "mnesite_fsync_seconds_count") == 1
    assert value(samples, "mnesite_commit_seconds_count") == 1
    assert value(samples, "mnesite_malformed_messages_total") == 1
    assert value(samples, "mnesite_applied_counter", shard="default") == 40
    assert value(samples, "mnesite_committed_counter", shard="default") == 45
    assert value(samples, "mnesite_replicant_lag_entries", shard="default") == 5
    assert value(samples, "mnesite_replicant_mode", shard="default", mode="bootstrap") == 1
    assert value(samples, "mnesite_replicant_mode", shard="default", mode="normal") == 0
    assert value(samples, "mnesite_bootstrap_rows_copied", shard="default") == 500
    assert value(samples, "mnesite_bootstrap_rows_expected", shard="default") == 1000
    assert value(samples, "mnesite_bootstrap_eta_seconds", shard="default") == 2
    assert value(samples, "mnesite_refused_total", reason="role") == 2
    assert value(samples, "mnesite_refused_total", reason="handshake") == 3
    assert value(samples, "mnesite_protocol_violations_total") == 7
    assert value(samples, "mnesite_sends_dropped_total", reason="zmq") == 3
    assert value(samples, "mnesite_sends_dropped_total", reason="core_queue_bytes_max") == 4
    assert value(samples, "mnesite_sends_dropped_total", reason="refused_connection") == 2
    assert value(samples, "mnesite_agent_budget_used_bytes") == 1234
    assert value(samples, "mnesite_agent_budget_max_bytes") == 16777216
    assert value(samples, "mnesite_agent_budget_evictions_total") == 5
    assert value(samples, "mnesite_agent_acks_refused_total") == 9
    assert value(samples, "mnesite_node_info", node="replicant1", role="replicant") == 1
    assert value(samples, "mnesite_disk_full") == 1
    assert value(samples, "mnesite_disk_full_seconds") == 2.5
    assert value(samples, "mnesite_disk_fills_total") == 2
    assert value(samples, "mnesite_disk_full_writes_refused_total") == 9
    assert value(samples, "mnesite_queries_total") == 11
    assert value(samples, "mnesite_query_pages_total") == 13
    assert value(samples, "mnesite_queries_refused_total") == 3
    assert value(samples, "mnesite_query_budget_stops_total") == 1
    assert value(samples, "mnesite_query_cursors_expired_total") == 4
    assert value(samples, "mnesite_query_cursors_open") == 2
    assert value(samples, "mnesite_changes_pages_total") == 21
    assert value(samples, "mnesite_changes_records_total") == 340
    assert value(samples, "mnesite_changes_snapshots_total") == 1
    assert value(samples, "mnesite_changes_refused_total") == 6
    assert value(samples, "mnesite_changes_held") == 2
    assert value(samples, "mnesite_connections_open") == 3
    assert value(samples, "mnesite_connections_open_max") == 4
    assert value(samples, "mnesite_connections_refused_total") == 8
    assert value(samples, "mnesite_redials_refused_total") == 6
    assert value(samples, "mnesite_redials_refused_key_total") == 5
    # The process itself, for sizing (CPU per applied transaction, resident memory).
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_resident_memory_bytes") > 1024 * 1024


@pytest.fixture
def metrics_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The node hands its endpoint a fresh status once a second; ten times a second here, so that a
    # test awaiting a refresh waits a tenth of the time.
    monkeypatch.setattr(metrics_module, "REFRESH_INTERVAL_MS", 100)
    port = free_port()
    node = ThreadNode(tmp_path / "data", extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
    try:
        yield node, port
    finally:
        node.stop()
    # The endpoint is closed with the node.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_scrape_of_a_node_shows_commits_moving(metrics_node) -> None:
    node, port = metrics_node
    with node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        before = scrape(port)
        for row_id in range(50):
            client.put("kv", {"id": row_id, "value": "x"})
    wait_until(lambda: (value(scrape(port), "mnesite_applied_counter", shard="default") or 0) >= 51, 10, "a refresh")
    after = scrape(port)
    assert after[("mnesite_commits_total", ())] >= before[("mnesite_commits_total", ())] + 50
    assert after[("mnesite_commit_seconds_count", ())] >= 50  # every put waited for its commit
    assert after[("mnesite_group_commit_transactions_sum", ())] >= 50
    assert value(after, "mnesite_is_sequencer", shard="default") == 1
    assert value(after, "mnesite_sequencer", shard="default", sequencer="core1") == 1
    assert value(after, "mnesite_transactions_total") >= 51
    # A core's agents' memory budget ([limits] agents_bytes_max, default 16 MiB); no agent, nothing held.
    assert value(after, "mnesite_agent_budget_max_bytes") == 16 * 1024 * 1024
    assert value(after, "mnesite_agent_budget_used_bytes") == 0
    assert value(after, "mnesite_agent_budget_evictions_total") == 0


def test_the_commit_metrics_count_every_commit_the_node_makes(metrics_node) -> None:
    """A sequencer commits twice in a turn that commits writes: its appended entries (with the fsync),
    then their applies (no fsync: the log is durable). mnesite_commits_total counted only the first,
    about half the commits ``status`` reports; mnesite_fsync_seconds counts the durable ones."""
    node, port = metrics_node
    with node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        for row_id in range(50):
            client.put("kv", {"id": row_id, "value": "x"})

        def agree() -> bool:
            status, samples = client.status(), scrape(port)
            return (samples[("mnesite_commits_total", ())], samples[("mnesite_fsync_seconds_count", ())]) == (
                status["commits"],
                status["durable_commits"],
            )

        wait_until(agree, 10, "the commit metrics to agree with status")
        assert client.status()["commits"] > client.status()["durable_commits"] >= 50
    samples = scrape(port)
    assert samples[("mnesite_group_commit_transactions_sum", ())] >= 51  # each applied transaction once


def test_a_scrape_counts_the_changefeed_pages_and_queries_a_node_answered(metrics_node) -> None:
    node, port = metrics_node
    with node.client(timeout_ms=5000) as client:
        client.create_table("kv", "id", [("id", "INTEGER"), ("value", "TEXT")])
        for row_id in range(5):
            client.put("kv", {"id": row_id, "value": "x"})
        records = list(client.changes(["kv"], page_records=2))
        rows = client.query("SELECT count(*) AS n FROM kv")
    assert [r for r in records if r["kind"] == "change" and r["op"] == "write"] and rows
    changes = [r for r in records if r["kind"] == "change"]

    def counted() -> bool:
        samples = scrape(port)
        return (value(samples, "mnesite_changes_records_total") or 0) >= len(changes) and (
            value(samples, "mnesite_queries_total") or 0
        ) >= 1

    wait_until(counted, 10, "a refresh counting the feed and the query")
    samples = scrape(port)
    assert value(samples, "mnesite_changes_pages_total") >= 3  # 6 change records, at most 2 a page
    assert value(samples, "mnesite_changes_held") == 0 and value(samples, "mnesite_changes_refused_total") == 0
    assert value(samples, "mnesite_query_pages_total") >= 1 and value(samples, "mnesite_queries_refused_total") == 0


def test_the_endpoint_is_bounded_and_answers_only_metrics(metrics_node, monkeypatch: pytest.MonkeyPatch) -> None:
    node, port = metrics_node
    # A connection's socket timeout is CONNECTION_TIMEOUT_S; the scrape below waits out a silent
    # client's, 0.5 s here rather than 2 s.
    assert metrics_module._Handler.timeout == CONNECTION_TIMEOUT_S
    monkeypatch.setattr(metrics_module._Handler, "timeout", 0.5)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/admin", timeout=5)
    assert refused.value.code == 404
    # A client that connects and says nothing holds the one serving thread for at most its timeout,
    # and the node's own socket answers meanwhile.
    silent = socket.create_connection(("127.0.0.1", port))
    try:
        began = time.monotonic()
        with node.client(timeout_ms=2000) as client:
            client.status()
        assert time.monotonic() - began < 1.0
        assert value(scrape(port), "mnesite_node_info", node="core1", role="core") == 1
        assert time.monotonic() - began < 0.5 + 3
    finally:
        silent.close()
    # A frame that is not a message is answered with an error and counted.
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(node.endpoint)
        dealer.send(b"\x93garbage")
        assert dealer.poll(5000), "no answer to a malformed frame"
        dealer.recv()
    finally:
        dealer.close()
        context.term()
    wait_until(lambda: (value(scrape(port), "mnesite_malformed_messages_total") or 0) >= 1, 5, "the count")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_processes_scraped_under_writes_show_commits_and_lag(cluster: Cluster) -> None:
    ports = {name: free_port() for name in [*cluster.names, "replicant1"]}
    for name in cluster.names:
        config = cluster.root / f"{name}.toml"
        config.write_text(config.read_text() + f'[metrics]\nlisten = "127.0.0.1:{ports[name]}"\n')
    cluster.start_all()
    create_table(cluster)
    cluster.add_replicant("replicant1")
    config = cluster.root / "replicant1.toml"
    config.write_text(config.read_text() + f'[metrics]\nlisten = "127.0.0.1:{ports["replicant1"]}"\n')
    cluster.start("replicant1")
    wait_until(
        lambda: value(scrape(ports["replicant1"]), "mnesite_replicant_mode", shard="default", mode="normal") == 1,
        60,
        "replicant1 to report normal mode",
        interval_s=0.2,
    )
    wait_until(lambda: cluster.sequencer() is not None, 30, "a sequencer")
    sequencer, _ = cluster.sequencer()
    first = {name: scrape(port) for name, port in ports.items()}
    upstream = cluster.status("replicant1")["shards"]["default"]["upstream"]

    def agent_lag() -> float | None:
        return value(scrape(ports[upstream]), "mnesite_agent_lag_entries", shard="default", replicant="replicant1")

    load = Load(cluster, cluster.names, writers=3).start()
    try:
        load.wait_for(300)
        # The replicant stops acknowledging: the lag its upstream's agent reports grows, then drains.
        cluster.nodes["replicant1"].signal(signal.SIGSTOP)
        try:
            wait_until(lambda: (agent_lag() or 0) > 0, 30, "the agent's lag to grow", interval_s=0.2)
        finally:
            cluster.nodes["replicant1"].signal(signal.SIGCONT)
    finally:
        load.stop()
    # Drained once the writes stop: under a steady load the agents' push delay (push_delay_ms_max) keeps
    # up to a delay's commits unpushed at any moment, so the lag need not read 0 while writers run.
    wait_until(lambda: agent_lag() == 0, 30, "the agent's lag to drain", interval_s=0.2)

    def applied(samples: dict) -> float:
        return value(samples, "mnesite_applied_counter", shard="default") or 0

    # Each node's status reaches its metrics at the next refresh (at most a second after it changed).
    wait_until(
        lambda: all(applied(scrape(port)) > applied(first[name]) for name, port in ports.items()),
        10,
        "every node's applied key to move in its metrics",
        interval_s=0.2,
    )
    second = {name: scrape(port) for name, port in ports.items()}
    assert second[sequencer][("mnesite_commits_total", ())] > first[sequencer][("mnesite_commits_total", ())] + 10
    assert value(second[sequencer], "mnesite_group_commit_transactions_sum") >= 300
    assert value(second[sequencer], "mnesite_commit_seconds_count") >= 1
    assert value(second[upstream], "mnesite_agents") >= 1
    # Each node's own process: its CPU seconds grew under the writes, and its resident memory is its own.
    for name in [*cluster.names, "replicant1"]:
        assert value(second[name], "process_cpu_seconds_total") > value(first[name], "process_cpu_seconds_total")
        assert 10 * 1024 * 1024 < value(second[name], "process_resident_memory_bytes") < 1024**3
    for name in [*cluster.names, "replicant1"]:
        assert value(second[name], "mnesite_applied_counter", shard="default") > value(
            first[name], "mnesite_applied_counter", shard="default"
        ), f"{name}'s applied key did not move"
    assert value(second["replicant1"], "mnesite_replicant_lag_entries", shard="default") is not None
    assert value(second["replicant1"], "mnesite_resumes_total", shard="default") is not None


@pytest.mark.parametrize(("host", "warned"), [("[::1]", False), ("127.0.0.1", False), ("0.0.0.0", True)])
def test_the_metrics_endpoint_warns_only_off_loopback(host: str, warned: bool, caplog) -> None:
    """The endpoint has no authentication: off loopback it says so in the log. An IPv6 loopback
    (``[::1]``) was taken for a public address (its host reached the check without its brackets)."""
    from mnesite.rlog.config import is_loopback
    from mnesite.rlog.metrics import start_metrics

    if host == "[::1]":
        try:
            socket.socket(socket.AF_INET6).bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
    with caplog.at_level("WARNING", logger="mnesite.metrics"):
        _, server = start_metrics(f"{host}:{free_port()}", "core1", "core", is_loopback)
        server.stop()
    assert any("readable by anyone" in record.getMessage() for record in caplog.records) is warned


def test_the_metrics_endpoint_stops_at_once() -> None:
    """Its thread looked for a stop only between half-second waits for a connection: every node's
    stop (and every test's) waited up to 0.5 s for it."""
    from mnesite.rlog.config import is_loopback
    from mnesite.rlog.metrics import start_metrics

    _, server = start_metrics(f"127.0.0.1:{free_port()}", "core1", "core", is_loopback)
    # Nothing to await: the thread is in its wait for a connection within a few milliseconds of its
    # start (a scrape's answer is read before the thread is done with it, and a stop then is prompt).
    time.sleep(0.05)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 0.25


def test_a_metrics_address_in_use_is_named_as_the_metrics_listen_key() -> None:
    """``mnesite start`` said only "cannot start: OSError: [Errno 98] Address already in use" (zmq's
    own bind error names its address): the node's listen port seemed to be the one taken."""
    from mnesite.rlog.config import is_loopback
    from mnesite.rlog.metrics import start_metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError) as refused:
            start_metrics(listen, "core1", "core", is_loopback)
    assert refused.value.errno == errno.EADDRINUSE
    assert f"[metrics].listen {listen}: " in str(refused.value)


def test_a_failed_backup_is_a_metric_until_a_backup_succeeds() -> None:
    metrics = NodeMetrics("core1", "core")
    failure = {"path": "/b/x", "error": "OSError: No space left on device", "failed_at": "", "failed_at_s": 1700.5}
    for failed, expected in ((failure, (1, 1700.5)), (None, (0, 0))):
        metrics.refresh(0, {"shards": {}, "backup": None, "backup_failed": failed})
        samples = {}
        for family in text_string_to_metric_families(metrics.text().decode()):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        assert (
            value(samples, "mnesite_backup_failed"),
            value(samples, "mnesite_backup_failed_timestamp_seconds"),
        ) == expected


def test_the_last_scheduled_backup_s_success_is_a_metric_only_with_a_schedule() -> None:
    metrics = NodeMetrics("core1", "core")
    name = "mnesite_backup_scheduled_success_timestamp_seconds"
    for schedule, expected in (
        (None, None),
        ({"last_success_at_s": None}, 0),
        ({"last_success_at_s": 1800.25}, 1800.25),
    ):
        metrics.refresh(0, {"shards": {}, "backup": None, "backup_failed": None, "backup_schedule": schedule})
        samples = {}
        for family in text_string_to_metric_families(metrics.text().decode()):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        assert value(samples, name) == expected


def _raw_request(port: int, request: bytes) -> bytes:
    """Send ``request`` and read the whole answer (the endpoint closes each connection: HTTP/1.0)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def test_head_is_answered_as_get_without_a_body() -> None:
    """Monitoring probes send ``HEAD /metrics``: it was ``501 Unsupported method``, and a probe took the
    node for down. HEAD gets GET's status and headers, and not one byte of body."""
    from mnesite.rlog.config import is_loopback
    from mnesite.rlog.metrics import start_metrics

    _, server = start_metrics(f"127.0.0.1:{free_port()}", "core1", "core", is_loopback)
    port = server.server_address[1]
    try:
        for path in ("/metrics", "/", "/metrics?probe=1"):
            head, _, body = _raw_request(port, f"HEAD {path} HTTP/1.0\r\n\r\n".encode()).partition(b"\r\n\r\n")
            status, *fields = head.decode().split("\r\n")
            headers = dict(field.split(": ", 1) for field in fields)
            assert status.split(" ", 2)[1] == "200", head
            assert headers["Content-Type"].startswith("text/plain") and int(headers["Content-Length"]) > 100
            assert body == b""
        missing, _, body = _raw_request(port, b"HEAD /admin HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
        assert missing.split(b" ", 2)[1] == b"404" and body == b""
        get, _, body = _raw_request(port, b"GET /metrics HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
        assert get.split(b" ", 2)[1] == b"200" and b"mnesite_node_info" in body
    finally:
        server.stop()
