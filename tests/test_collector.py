"""``mnesite start`` freezes what starting made out of Python's cyclic collector; ``status`` shows it.

Under load a core's full collections walked the whole start-up heap (modules, types, the node's
state): 22-45 ms of its loop each, 0.6-5 ms once that heap is frozen (benchmarks/PROFILE.md,
thirteenth session). The freeze belongs to the process that runs the node (the CLI), never to
``serve_forever``: a node served from a thread must leave its host's heap alone.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from mnesite.rlog.client import Client

from tests.conftest import NodeProcess, start_core_process

pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow
def test_a_node_process_freezes_its_start_up_heap(tmp_path: Path, node_processes: list[NodeProcess]) -> None:
    _, endpoint, _ = start_core_process(tmp_path, node_processes)
    with Client(endpoint) as client:
        client.create_table("t", "id", [("id", "INTEGER"), ("v", "TEXT")])
        for i in range(200):
            client.put("t", {"id": i, "v": "x" * 100})
        collector = client.status()["collector"]
    # Start-up makes tens of thousands of objects (about 35,000 for a core); all of them are frozen.
    assert collector["frozen"] > 10_000, collector
    assert len(collector["collections"]) == 3 and collector["collections"][0] > 0, collector


def test_a_node_served_from_a_thread_does_not_freeze_its_host(thread_node) -> None:
    frozen_before = gc.get_freeze_count()
    with thread_node.client() as client:
        collector = client.status()["collector"]
    assert collector["frozen"] == frozen_before == gc.get_freeze_count()
    assert len(collector["collections"]) == 3
