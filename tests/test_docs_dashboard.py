"""The Grafana dashboard (docs/operations/grafana-dashboard.json) queries only metrics a node exports.

Every PromQL expression of the dashboard (panel targets and template variables) is reduced to the
metric names it selects; a real core with sample data and a real replicant following it, both with
``[metrics] listen``, are scraped, and every name must be one they export (a sample, or a family
they declare, with the suffixes Prometheus gives counters and histograms).
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, NodeProcess, free_port, wait_until

DASHBOARD = REPO / "docs" / "operations" / "grafana-dashboard.json"
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"}
PROMQL_KEYWORDS |= {"offset", "inf", "nan"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def expressions(dashboard: dict) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panel targets (rows included) and query variables."""

    def panels(items: list[dict]) -> Iterator[dict]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            label_values = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*\w+\s*\)\s*", query)
            yield label_values.group(1) if label_values else query


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, keywords, labels or durations)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression)  # label values, legend strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", text):
        name, is_call = match.group(1), match.group(2)
        if not is_call and name.lower() not in PROMQL_KEYWORDS:
            names.add(name)
    return names


def exported_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return answer.read().decode()


def test_metric_names_are_read_out_of_promql() -> None:
    expression = (
        'histogram_quantile(0.99, sum by (instance, le) (rate(mnesite_fsync_seconds_bucket{instance=~"$x"}'
        "[$__rate_interval]))) / on(instance) mnesite_agents == 1 and mnesite_generation offset 5m"
    )
    assert metric_names(expression) == {"mnesite_fsync_seconds_bucket", "mnesite_agents", "mnesite_generation"}
    dashboard = json.loads(DASHBOARD.read_text())
    named = set().union(*(metric_names(expression) for expression in expressions(dashboard)))
    assert len(named) >= 20, named  # the panels are read, not skipped


def test_a_metric_the_node_does_not_export_is_caught() -> None:
    exported = exported_names("# HELP mnesite_commits x\n# TYPE mnesite_commits counter\nmnesite_commits_total 3.0\n")
    assert metric_names("rate(mnesite_commits_total[1m])") <= exported
    assert not metric_names("rate(mnesite_commit_total[1m])") <= exported


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_metric_the_dashboard_queries_is_exported(tmp_path: Path, node_processes: list[NodeProcess]) -> None:
    core_port, replicant_port = free_port(), free_port()
    metrics_ports = {"core1": free_port(), "replicant1": free_port()}
    cluster = f'[cluster]\ncore_nodes = {{ core1 = "tcp://127.0.0.1:{core_port}" }}\n'
    configs = {
        "core1": (core_port, f'[node]\nname = "core1"\ndata_dir = "core1"\nlisten = "tcp://127.0.0.1:{core_port}"\n'),
        "replicant1": (
            replicant_port,
            '[node]\nname = "replicant1"\nrole = "replicant"\ndata_dir = "replicant1"\n'
            f'listen = "tcp://127.0.0.1:{replicant_port}"\n',
        ),
    }
    for name, (port, node) in configs.items():
        config = tmp_path / f"{name}.toml"
        config.write_text(f'{node}{cluster}[metrics]\nlisten = "127.0.0.1:{metrics_ports[name]}"\n')
        process = NodeProcess(config, tmp_path / f"{name}.log")
        node_processes.append(process)
        process.start(f"tcp://127.0.0.1:{port}")
    from mnesite.rlog.client import Client

    with Client(f"tcp://127.0.0.1:{core_port}", timeout_ms=5000) as client:
        client.create_table("users", key="id", columns=[("id", "INTEGER"), ("name", "TEXT")])
        client.put("users", {"id": 1, "name": "ada"})
    texts: dict[str, str] = {}

    def both_report_their_state() -> bool:
        # the state families appear once the loop has handed the metrics a status (about every second)
        for name, port in metrics_ports.items():
            texts[name] = scrape(port)
        return all("mnesite_generation" in text or "mnesite_replicant_mode" in text for text in texts.values())

    wait_until(both_report_their_state, 30, "both nodes to export their state families")
    exported = exported_names(texts["core1"]) | exported_names(texts["replicant1"])
    dashboard = json.loads(DASHBOARD.read_text())
    unknown = {
        name: expression
        for expression in expressions(dashboard)
        for name in metric_names(expression)
        if name not in exported
    }
    assert unknown == {}, f"the dashboard queries metrics no node exports: {unknown}"
