"""docs/operations/sizing.md states the memory and disk bounds the code enforces, with the code's values.

The page's measured figures (CPU, bytes, resident memory) are a dated reading; its bounds are not: each
sentence that names a bound is checked against the constant or the default that sets it.
"""

from __future__ import annotations

import re

import pytest
from mnesite.core import rules
from mnesite.replicant.replica import ReplicaConfig
from mnesite.rlog import checkpoint, config, server, store

from tests.conftest import REPO, core_with_table

pytestmark = pytest.mark.timeout(30)

PAGE = REPO / "docs" / "operations" / "sizing.md"
MIB = 1024 * 1024


def page() -> str:
    return re.sub(r"\s+", " ", PAGE.read_text())


def test_the_sizing_page_states_the_bounds_the_code_sets() -> None:
    text = page()
    limits = config.Limits()
    assert store.PAGE_CACHE_BYTES_MAX == 16 * MIB
    assert "SQLite's page cache of the writing connection: 16 MiB" in text
    assert (
        f"at most {server.BACKLOG_FACTOR} x `group_commit_max` frames and {server.BACKLOG_FACTOR} x `turn_bytes_max`"
        in text
    )
    assert rules.FOLLOWER_APPLY_BYTES_MAX == 16 * MIB
    assert f"at most {rules.FOLLOWER_APPLY_ENTRIES_MAX:,} entries or 16 MiB" in text
    assert limits.agents_bytes_max == 16 * MIB and "`agents_bytes_max` (16 MiB)" in text
    assert f"grows to about 32 MiB ({checkpoint.WAL_PAGES_BACKGROUND:,} pages)" in text
    assert checkpoint.WAL_PAGES_BACKGROUND * 4096 // MIB in (31, 32)  # 4 KiB pages
    retention = config.Retention().retention_entries_max
    assert f"({retention:,} by default" in text
    spill = limits  # a replicant's spill budget: the defaults of [limits] and of ReplicaConfig
    assert (spill.spill_entries_max, spill.spill_bytes_max) == (ReplicaConfig().spill_entries_max, 1024 * MIB)
    assert ReplicaConfig().spill_bytes_max == 1024 * MIB
    assert f"at most {spill.spill_entries_max:,} entries of a shard and 1 GiB for all the shards of a node" in text
    assert "`spill_entries_max` and `spill_bytes_max`" in text


def test_the_sizing_page_names_only_config_keys_that_exist() -> None:
    keys = set(config.Limits.__dataclass_fields__) | set(config.Retention.__dataclass_fields__)
    named = set(re.findall(r"`([a-z_]+_(?:max|ms_max|delay_ms_max))`", page()))
    assert named and named <= keys, named - keys


def test_the_sizing_page_states_the_inbound_queues_bound_in_bytes_per_connection(tmp_path) -> None:
    """zmq's receive high-water mark counts messages per connection, and zmq bounds each part's size, not a
    message's parts: the page said "`requests_queued_max` incoming frames" as if that were a node's bound,
    and no bytes. It states the per-connection byte bound of the socket's options as the node sets them
    (read back from a bound core's ROUTER) and that a message of many parts has none."""
    import zmq

    text = page()
    limits = config.Limits()
    factor = server.SOCKET_MESSAGE_FACTOR
    with core_with_table(tmp_path / "data") as node:
        assert node.socket.getsockopt(zmq.RCVHWM) == limits.requests_queued_max
        assert node.socket.getsockopt(zmq.MAXMSGSIZE) == factor * limits.frame_bytes_max
    assert "`requests_queued_max` incoming requests per connection" in text
    per_connection_gib = limits.requests_queued_max * factor * limits.frame_bytes_max / (1024 * MIB)
    assert f"`requests_queued_max` x {factor} x `frame_bytes_max`" in text
    assert f"part of more than {factor} x `frame_bytes_max`" in text
    assert f"about {per_connection_gib:.0f} GiB at the defaults, per connection" in text
    assert f"more than {server.MESSAGE_PARTS_MAX} parts" in text and f"past the {server.MESSAGE_PARTS_MAX}th" in text
    assert f"backlog above ({server.BACKLOG_FACTOR} x `turn_bytes_max`" in text
    from mnesite.core import node as core_node
    from mnesite.replicant import node as replicant_node

    assert core_node.PEER_SEND_QUEUE_MAX == replicant_node.CORE_QUEUE_MAX == 1000
    assert "its peers queue at most 1,000 incoming messages each" in text


def test_the_sizing_page_states_what_a_nodes_own_connections_cost_and_their_redial() -> None:
    from mnesite.rlog import connections

    text = page()
    assert (connections.REDIAL_DELAY_MS_MIN, connections.REDIAL_DELAY_MS_MAX) == (250, 4000)
    assert "dialled again by the node, after 250 ms, then up to every 4 s while it is refused" in text
    assert f"costs {connections.FILES_PER_DEALER} descriptors" in text
    assert f"and {connections.SOCKETS_PER_DEALER} zmq sockets" in text
    assert f"beyond zmq's default of {connections.SOCKETS_DEFAULT} sockets" in text
