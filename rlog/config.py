"""Node configuration: one TOML file per node, validated with errors that name the key.

Example::

    [node]
    name = "core1"
    role = "core"                       # "core" | "replicant"
    data_dir = "./mnesite-data"
    listen = "tcp://127.0.0.1:7400"

    [cluster]
    core_nodes = { core1 = "tcp://127.0.0.1:7400" }
    election_timeout_ms_min = 800       # randomised election timeout, per shard
    election_timeout_ms_max = 1600
    heartbeat_interval_ms = 100         # at most half of election_timeout_ms_min
    lazy_feed_interval_ms = 20          # followers no commit waits for are fed this often (<= heartbeat; 0: off)
    initial_cluster_state = "new"       # "existing": this core was rebuilt in a running cluster (core.recovery)
    recovery_timeout_ms = 1000          # a core on an empty database waits this long for its peers' journals
    # cluster_id = "<32 hex digits>"    # optional: the same on every node; a node of another is refused

    [storage]
    synchronous = "FULL"                # OFF | NORMAL | FULL | EXTRA
    disk_probe_interval_ms = 1000       # while the disk is full: how often a write probe checks for space (rlog.disk)

    [limits]
    frame_bytes_max = 4194304           # larger frames get a frame_too_large error (64 KiB..256 MiB; core.agent)
    group_commit_max = 256              # requests drained per loop turn; writes among them share one commit
    transaction_ops_max = 1000          # ops plus guards in one transaction
    scan_rows_max = 10000               # rows per scan page
    turn_bytes_max = 8388608            # frames drained per loop turn, in bytes
    turn_ms_max = 50                    # time spent draining frames per loop turn
    push_bytes_max = 262144             # bytes in one agent push, and pushed per loop turn (<= frame_bytes_max / 2)
    window_bytes_max = 8388608          # bytes an agent pushed that its replicant has not acknowledged
    ack_timeout_ms = 10000              # an agent whose replicant acks, reads or applies nothing this long stops
    push_delay_ms_max = 50              # a partial push waits this long after the previous one (0: never)
    follower_apply_delay_ms_max = 100   # a following core applies commits together, within this (0: each at once)
    agents_bytes_max = 16777216         # bytes all agents of a node hold together (unacknowledged pushes)
    requests_outstanding_max = 1000     # requests awaiting a later answer, per client connection
    connections_max = 1024              # connections the listen socket holds open; more are refused (docs: Sizing)
    connections_waiting_max = 10000     # client connections with requests awaiting a later answer, per node
    requests_queued_max = 10000         # incoming frames zmq queues per connection (see Sizing)
    replies_queued_max = 1000           # answers zmq queues per connection
    replies_queued_bytes_max = 16777216 # bytes of large answers zmq holds per connection (the next is overloaded)
    core_queue_bytes_max = 16777216     # bytes zmq holds toward one core, a replicant's or a peer (then: no_sequencer)
    watches_max = 256                   # replicant watches (agents) per core
    replicant_watches_max = 256         # agents one replicant (principal) holds on a core (default: watches_max)
    push_queue_max = 1024               # frames queued to one replicant endpoint (a frame dropped here costs a resync)
    guard_failures_held_max = 10000     # failed guards the sequencer holds until what they observed commits
    guard_hold_ms_max = 5000            # how long one is held at most (then: no_sequencer, retry)
    unapplied_tail_entries_max = 10000  # unapplied entries of a shard a core keeps in memory (then: overloaded)
    unapplied_tail_bytes_max = 67108864 # and their bytes (the rest is read back from the log)
    backup_step_pages_max = 256         # pages an online backup copies per step (mnesite backup)
    query_ms_max = 10000                # SQLite time one query may spend, all its pages together (mnesite query)
    query_page_rows_max = 1000          # rows in one page of a query's answer
    query_page_bytes_max = 1048576      # bytes of values in one page (at most frame_bytes_max / 4)
    query_cursors_max = 16              # queries with more pages to fetch, held open per node
    query_cursors_per_connection_max = 8 # of them, held for one client connection (default: half of query_cursors_max)
    query_idle_ms_max = 30000           # a held query whose next page is not asked for in this time is closed
    query_temp_bytes_max = 268435456    # bytes of temporary files one query may hold (its sorts spilled to disk)
    query_temp_bytes_total_max = 1073741824  # bytes of temporary files all of a node's queries hold together
    index_build_step_rows_max = 1000    # rows an online index build copies per step, a step at most every 10 ms
    changes_page_records_max = 1000     # records in one changefeed page (mnesite changes)
    changes_page_bytes_max = 1048576    # bytes of records in one changefeed page (at most frame_bytes_max / 4)
    changes_waiting_max = 1000          # changefeed requests held until their tables change, per node
    spill_entries_max = 100000          # a replicant's spill of one bootstrapping shard, in entries
    spill_bytes_max = 1073741824        # bytes all of a replicant's spills hold together (docs: Sizing)

    [rlog]
    retention_entries_max = 100000      # newest entries kept per shard
    retention_age_ms_max = 0            # 0: no age limit
    retention_interval_ms = 1000        # how often retention runs

    [backup]                            # scheduled backups (rlog.backup_schedule); off if absent or interval_s = 0
    directory = "/var/backups/mnesite"  # absolute, on this node's host; must exist and be writable at start
    interval_s = 3600                   # one backup this often (at least 60; 0: off)
    keep = 7                            # this node's newest scheduled backups kept there (1..10000)

    [metrics]                           # Prometheus text endpoint, GET /metrics (rlog.metrics); off if absent
    listen = "127.0.0.1:9400"           # unauthenticated: keep it on loopback or a private network

    [security]                          # CurveZMQ + roles (rlog.security, rlog.roles)
    server_key = "keys/cluster.key_secret"   # the cluster's server key pair: same file on every node
    client_key = "keys/core1.key_secret"     # this node's identity when it talks to other nodes
    authorized_keys = "keys"                 # directory of public keys NAME.key, one per principal
    follow_key_links = false                 # true: follow key files that are symbolic links (Kubernetes secrets)
    # insecure = true                        # no CurveZMQ even off loopback (warned at every start)
    [security.roles]
    core = ["core1", "core2", "core3"]
    replicant = ["replicant1"]
    admin = ["ops"]
    writer = ["app"]
    reader = ["dashboard"]

A node whose ``listen`` is not a loopback address refuses to start without ``[security]``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

from mnesite.rlog.backup_schedule import INTERVAL_S_MAX, KEEP_DEFAULT, KEEP_MAX, NAME_ATTEMPTS_MAX, interval_s_min
from mnesite.rlog.limits import FRAME_BYTES_MAX_BOUNDS
from mnesite.rlog.messages import BACKUP_PATH_CHARS_MAX, BACKUP_PATH_PATTERN
from mnesite.rlog.security import SecurityConfig, SecurityError, check_roles
from mnesite.rlog.types import endpoint_identity
from mnesite.rlog.versions import CLUSTER_ID_PATTERN

DEFAULT_LISTEN = "tcp://127.0.0.1:7400"
DEFAULT_DATA_DIR = "./mnesite-data"
DEFAULT_NAME = "core1"
INITIAL_CLUSTER_STATES = ("new", "existing")
ROLES = ("core", "replicant")
ENDPOINT_PATTERN = re.compile(r"^tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+|\*):(\d{1,5})\Z")
NODE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}\Z")
LOOPBACK_HOSTS = ("localhost", "[::1]")
SECURITY_PATHS = ("server_key", "client_key", "authorized_keys")
SECURITY_KEYS = (*SECURITY_PATHS, "insecure", "follow_key_links", "roles")  # what [security] may hold


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


def is_wildcard(endpoint: str) -> bool:
    """Whether ``endpoint`` binds every interface (``*``, ``0.0.0.0``, ``[::]``): an address to listen
    on, not one to give another node, which connecting there reaches its own machine."""
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if host == "*":
        return True
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") else host).is_unspecified
    except ValueError:
        return False  # a host name


def check_endpoint(where: str, value: Any) -> str:
    match = ENDPOINT_PATTERN.match(value) if isinstance(value, str) else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{where} must be an endpoint like tcp://127.0.0.1:7400, got {value!r}")
    return value


@dataclass(frozen=True)
class Limits:
    frame_bytes_max: int = 4 * 1024 * 1024
    group_commit_max: int = 256
    transaction_ops_max: int = 1000
    scan_rows_max: int = 10000
    # Work of one loop turn: frames (bytes) drained and time spent on them. What is left waits in the
    # socket for the next turn, which starts with the consensus ticks: heartbeats, appends and votes
    # never wait behind a long batch of large transactions, pushes or catch-up reads.
    turn_bytes_max: int = 8 * 1024 * 1024
    turn_ms_max: int = 50
    # An agent's pushes to one replicant: bytes in one push, and pushed but unacknowledged (core.agent).
    push_bytes_max: int = 256 * 1024
    window_bytes_max: int = 8 * 1024 * 1024
    # An agent stops when its replicant acknowledges nothing, or reads no push it was sent, for this
    # long (core.agent's "Read lag"): a replicant's link must carry window_bytes_max per shard it
    # catches up within it, so a slower link needs a longer timeout (or a smaller window).
    ack_timeout_ms: int = 10_000
    # How long a partial push waits after an agent's previous push, so that the commits meanwhile ride
    # in it (core.agent's "Push delay"): a replicant costs a wake-up, a transaction and an
    # acknowledgement per push, not per commit; its lag grows by this much at most. 0: no wait.
    push_delay_ms_max: int = 50
    # How long a core that follows a shard may hold what it heard is committed before applying it, so
    # that several commits' rows are applied (and their pages written to the WAL) together
    # (core.rules.FollowerApply). Reads that wait for a key, queries, changefeeds and watches make it
    # apply at once; a read that waits for nothing may see the follower this much older. 0: at every commit.
    follower_apply_delay_ms_max: int = 100
    # Bytes all agents of a node hold together (pushed, not acknowledged: in the outbox, in zmq's send
    # queues, on the wire). Past it the longest-silent agents are evicted, never an acknowledging
    # one (core.agent_budget): replicant streams cost the node this much memory at most.
    agents_bytes_max: int = 16 * 1024 * 1024
    # Requests waiting for a later answer (a commit, the sequencer, a read fence) per client connection.
    requests_outstanding_max: int = 1000
    # Connections the listen socket holds open at once (clients, replicants, peer cores, CLI commands):
    # past it a new one is refused at its handshake (rlog.connections); with [security] a peer core's key
    # never is. Each costs a file descriptor and a receive queue. 1024: with the node's own files it fits
    # a hard RLIMIT_NOFILE of 4096 (older systems, some containers), which a node checks at start.
    connections_max: int = 1024
    # Connections with such requests, per node: past it a new connection's request that would wait is
    # refused ``overloaded`` (NodeServer.hold); a peer's (a core or replicant forwarding for its clients)
    # has PEER_CONNECTIONS_RESERVED more places. A connection's entry goes once nothing of it waits.
    connections_waiting_max: int = 10_000
    # Frames zmq queues: incoming ones in all, answers per connection (a client that does not read).
    requests_queued_max: int = 10_000
    replies_queued_max: int = 1000
    # Bytes of large answers (from 64 KiB, sent without a copy) zmq still holds for one connection: past
    # it, the next large answer is refused ``overloaded`` until the client reads (one is always sent).
    replies_queued_bytes_max: int = 16 * 1024 * 1024
    # Bytes of the frames a node sent toward one core (a replicant's core, a core's peer) that zmq still
    # holds (from 4 KiB at a replicant, 64 KiB at a core, tracked: rlog.send_queue): past it, a
    # consensus message is dropped (the protocol re-sends it), and a write to forward goes to another
    # core (a replicant) or is refused ``no_sequencer``, nothing sent, when none can take it, until the
    # core reads again (one frame is always sent to a core holding nothing).
    core_queue_bytes_max: int = 16 * 1024 * 1024
    # Replicant watches (agents) one core serves; the agent silent for longest (core.agent_budget's
    # liveness: no progress within two heartbeats) is evicted when a new watch needs room.
    watches_max: int = 256
    # Watches (agents) one replicant holds on one core (with security on: one principal), at most
    # watches_max (core.watch). Not given: watches_max, no bound of its own (a replicant holds one
    # agent per shard it follows, and a cluster may have more shards than any default). A core that
    # serves several replicant keys sets it so that one key cannot take every slot.
    replicant_watches_max: int = 256
    # Frames queued to one replicant's endpoint (pushes beyond it are dropped and re-sent by the agent).
    push_queue_max: int = 1024
    # Failed guards a sequencer holds until the entries they observed commit (core.guard_tail), and
    # for how long at most: past either bound the client is told to retry.
    guard_failures_held_max: int = 10_000
    guard_hold_ms_max: int = 5_000
    # A shard's unapplied tail a core keeps in memory (core.guard_tail), in entries and bytes: past
    # either (a shard whose apply waits at a name another shard holds, Store.name_waits) the rest is
    # read back from the log, and its sequencer refuses writes ``overloaded`` until the tail drains.
    unapplied_tail_entries_max: int = 10_000
    unapplied_tail_bytes_max: int = 64 * 1024 * 1024
    # Pages an online backup copies per step (rlog.backup); smaller steps share the machine more evenly.
    backup_step_pages_max: int = 256
    # Read-only SQL queries (rlog.query): the SQLite time one query may spend (its pages together),
    # each page's rows and bytes, the queries held open for their next page, and how long one waits.
    query_ms_max: int = 10_000
    query_page_rows_max: int = 1000
    query_page_bytes_max: int = 1024 * 1024
    query_cursors_max: int = 16
    # Of those, the most one client connection holds: one cannot take them all. Not given: half of
    # query_cursors_max (at least 1); given: at most query_cursors_max.
    query_cursors_per_connection_max: int = 8
    query_idle_ms_max: int = 30_000
    # Bytes of SQLite's temporary files (a sort or grouping larger than its cache, spilled to disk) one
    # query may hold, and all of a node's queries together (rlog.query.TempBudget); past either the
    # query fails. They are kept while the query's cursor is open.
    query_temp_bytes_max: int = 256 * 1024 * 1024
    query_temp_bytes_total_max: int = 1024 * 1024 * 1024
    # Rows an online index build (rlog.store) copies per step (one step at most every 10 ms); a table with
    # fewer rows is indexed at once.
    index_build_step_rows_max: int = 1000
    # The changefeed (rlog.changes): a consumer pulls pages, so a page bounds what one costs the node;
    # caught-up consumers wait for their next change in a bounded list.
    changes_page_records_max: int = 1000
    changes_page_bytes_max: int = 1024 * 1024
    changes_waiting_max: int = 1000
    # A replicant's spill while it bootstraps a shard (replicant.replica): the entries one shard
    # spills, and the bytes all its shards spill together; past either its agent is released until the
    # copy is done, then it resumes from the spill's last key (docs: Sizing).
    spill_entries_max: int = 100_000
    spill_bytes_max: int = 1024 * 1024 * 1024


@dataclass(frozen=True)
class Retention:
    retention_entries_max: int = 100_000
    retention_age_ms_max: int = 0
    # How often a node applies the retention floor (rlog.retention) to its rlog.
    retention_interval_ms: int = 1000


@dataclass(frozen=True)
class Timing:
    election_timeout_ms_min: int = 800
    election_timeout_ms_max: int = 1600
    heartbeat_interval_ms: int = 100
    # How often the sequencer feeds the followers a commit does not wait for (core.consensus, "Lazy
    # followers"; capped at heartbeat_interval_ms); 0: every follower is sent every batch at once.
    lazy_feed_interval_ms: int = 20
    # How long a core that starts on an empty database waits for its peers' journals (core.recovery).
    recovery_timeout_ms: int = 1000


@dataclass(frozen=True)
class Backup:
    """``[backup]``: a backup of this node every ``interval_s`` seconds (0: none) into ``directory`` on its
    host, its newest ``keep`` kept there (rlog.backup_schedule)."""

    directory: str | None = None
    interval_s: int = 0
    keep: int = KEEP_DEFAULT


@dataclass(frozen=True)
class Config:
    name: str = DEFAULT_NAME
    role: str = "core"
    data_dir: str = DEFAULT_DATA_DIR
    listen: str = DEFAULT_LISTEN
    core_nodes: dict[str, str] = field(default_factory=dict)
    # What an empty data directory means (etcd's initial-cluster-state): "new", the first start of a
    # new cluster; "existing", a core rebuilt (lost disk, wiped, restored) in a cluster with history,
    # which then waits for every other member before it takes part (core.recovery.recovery_shortfall).
    initial_cluster_state: str = "new"
    # The cluster's id (32 lowercase hex digits), the same in every node's config; None: the data
    # directory's, if it records one. A node refuses peers and cores that announce another (rlog.versions).
    cluster_id: str | None = None
    synchronous: str = "FULL"
    # While the disk is full (rlog.disk): how often the node tries a small durable write to see
    # whether space was freed, and resumes writing if it succeeds.
    disk_probe_interval_ms: int = 1000
    limits: Limits = field(default_factory=Limits)
    retention: Retention = field(default_factory=Retention)
    timing: Timing = field(default_factory=Timing)
    # None: no [security] section (allowed on loopback only); insecure = true is SecurityConfig(insecure=True).
    security: SecurityConfig | None = None
    source_path: str | None = None  # the TOML file, re-read on SIGHUP
    # [metrics] listen: "host:port" of the Prometheus endpoint (rlog.metrics); None: no endpoint.
    metrics_listen: str | None = None
    backup: Backup = field(default_factory=Backup)

    @property
    def secure(self) -> bool:
        return self.security is not None and self.security.enabled

    @property
    def database_path(self) -> str:
        return os.path.join(self.data_dir, "mnesite.db")


_LIMIT_BOUNDS = {
    "frame_bytes_max": FRAME_BYTES_MAX_BOUNDS,  # rlog.limits says why
    "group_commit_max": (1, 100_000),
    "transaction_ops_max": (1, 1_000_000),
    "scan_rows_max": (1, 1_000_000),
    "turn_bytes_max": (1024, 1024 * 1024 * 1024),
    "turn_ms_max": (1, 60_000),
    "push_bytes_max": (1024, 256 * 1024 * 1024),
    "window_bytes_max": (1024, 1024 * 1024 * 1024),
    "ack_timeout_ms": (1000, 600_000),  # above the agents' heartbeat interval (500 ms); ten minutes at most
    "push_delay_ms_max": (0, 250),  # below the agents' heartbeat interval (500 ms)
    "follower_apply_delay_ms_max": (0, 10_000),
    "agents_bytes_max": (64 * 1024, 64 * 1024 * 1024 * 1024),
    "requests_outstanding_max": (1, 1_000_000),
    "connections_max": (1, 1_000_000),  # each needs a file descriptor: checked against RLIMIT_NOFILE at start
    "connections_waiting_max": (1, 1_000_000),
    "requests_queued_max": (1, 1_000_000),
    "replies_queued_max": (1, 1_000_000),
    "replies_queued_bytes_max": (64 * 1024, 64 * 1024 * 1024 * 1024),
    "core_queue_bytes_max": (64 * 1024, 64 * 1024 * 1024 * 1024),
    "watches_max": (1, 100_000),
    "replicant_watches_max": (1, 100_000),
    "push_queue_max": (1, 100_000),
    "backup_step_pages_max": (1, 1_000_000),
    "query_ms_max": (1, 3_600_000),
    "query_page_rows_max": (1, 1_000_000),
    "query_page_bytes_max": (1024, 128 * 1024 * 1024),
    "query_cursors_max": (1, 10_000),
    "query_cursors_per_connection_max": (1, 10_000),
    "query_idle_ms_max": (100, 3_600_000),
    "query_temp_bytes_max": (0, 1024**4),  # 0: no query may spill to disk
    "query_temp_bytes_total_max": (0, 1024**4),
    "index_build_step_rows_max": (1, 1_000_000),
    "changes_page_records_max": (1, 1_000_000),
    "changes_page_bytes_max": (1024, 128 * 1024 * 1024),
    "changes_waiting_max": (1, 1_000_000),
    "spill_entries_max": (1, 10**9),
    "spill_bytes_max": (1024 * 1024, 1024**4),  # on disk; at least a few entries of a usual size
    "retention_entries_max": (1, 10**12),
    "retention_age_ms_max": (0, 10**15),
    "retention_interval_ms": (10, 3_600_000),
    "guard_failures_held_max": (1, 1_000_000),
    "guard_hold_ms_max": (1, 600_000),
    # Far above what a sequencer has in flight (a turn proposes up to group_commit_max writes): a lower
    # bound would refuse writes of a shard whose apply merely lags; at most what memory could hold.
    "unapplied_tail_entries_max": (100, 10_000_000),
    "unapplied_tail_bytes_max": (1024 * 1024, 64 * 1024 * 1024 * 1024),
    "recovery_timeout_ms": (10, 600_000),
    "election_timeout_ms_min": (10, 600_000),
    "election_timeout_ms_max": (10, 600_000),
    "heartbeat_interval_ms": (1, 300_000),
    "lazy_feed_interval_ms": (0, 300_000),
}


# A probe is one small durable write: more often than every 10 ms would compete with reads for
# nothing, and an operator who freed space should not wait more than ten minutes for the node.
DISK_PROBE_INTERVAL_MS_BOUNDS = (10, 600_000)


def _int_section(section: str, raw: Any, cls: type) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{section}] must be a table")
    known = {f.name for f in fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"unknown key [{section}].{key} (known: {', '.join(sorted(known))})")
        low, high = _LIMIT_BOUNDS[key]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"[{section}].{key} must be an integer in {low}..{high}, got {value!r}")
        values[key] = value
    return cls(**values)


def parse_config(data: dict[str, Any], base_dir: str = ".") -> Config:
    """Validate a parsed TOML document. Relative ``data_dir`` is resolved against ``base_dir``."""
    sections = {"node", "cluster", "storage", "limits", "rlog", "security", "metrics", "backup"}
    for section in data:
        if section not in sections:
            raise ConfigError(f"unknown section [{section}] (known: {', '.join(sorted(sections))})")
    node = data.get("node", {})
    if not isinstance(node, dict):
        raise ConfigError("[node] must be a table")
    for key in node:
        if key not in ("name", "role", "data_dir", "listen"):
            raise ConfigError(f"unknown key [node].{key} (known: data_dir, listen, name, role)")
    name = node.get("name", DEFAULT_NAME)
    if not isinstance(name, str) or not NODE_NAME_PATTERN.match(name):
        raise ConfigError(f"[node].name must be 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    role = node.get("role", "core")
    if role not in ROLES:
        raise ConfigError(f'[node].role must be "core" or "replicant", got {role!r}')
    data_dir = node.get("data_dir", DEFAULT_DATA_DIR)
    if not isinstance(data_dir, str) or not data_dir or "\0" in data_dir:
        raise ConfigError(f"[node].data_dir must be a non-empty path, got {data_dir!r}")
    data_dir = os.path.abspath(os.path.join(base_dir, os.path.expanduser(data_dir)))
    listen = check_endpoint("[node].listen", node.get("listen", DEFAULT_LISTEN))

    cluster = data.get("cluster", {})
    if not isinstance(cluster, dict):
        raise ConfigError("[cluster] must be a table")
    timing_keys = {f.name for f in fields(Timing)}
    cluster_keys = ("core_nodes", "initial_cluster_state", "cluster_id")
    for key in cluster:
        if key not in cluster_keys and key not in timing_keys:
            known = ", ".join(sorted((*cluster_keys, *timing_keys)))
            raise ConfigError(f"unknown key [cluster].{key} (known: {known})")
    initial_cluster_state = cluster.get("initial_cluster_state", "new")
    if initial_cluster_state not in INITIAL_CLUSTER_STATES:
        raise ConfigError(
            f"[cluster].initial_cluster_state must be one of {', '.join(INITIAL_CLUSTER_STATES)}, "
            f"got {initial_cluster_state!r}"
        )
    cluster_id = cluster.get("cluster_id")
    if cluster_id is not None and (type(cluster_id) is not str or not CLUSTER_ID_PATTERN.match(cluster_id)):
        raise ConfigError(f"[cluster].cluster_id must be 32 lowercase hex digits (128 bits), got {cluster_id!r:.60}")
    timing = _int_section("cluster", {k: v for k, v in cluster.items() if k in timing_keys}, Timing)
    if timing.election_timeout_ms_max < timing.election_timeout_ms_min:
        raise ConfigError("[cluster].election_timeout_ms_max must be at least election_timeout_ms_min")
    if timing.heartbeat_interval_ms * 2 > timing.election_timeout_ms_min:
        raise ConfigError("[cluster].heartbeat_interval_ms must be at most half of election_timeout_ms_min")
    if "lazy_feed_interval_ms" in cluster and timing.lazy_feed_interval_ms > timing.heartbeat_interval_ms:
        # Left at its default it is capped instead (core.consensus): a short heartbeat alone is no error.
        raise ConfigError("[cluster].lazy_feed_interval_ms must be at most heartbeat_interval_ms")
    core_nodes = cluster.get("core_nodes", {name: listen} if role == "core" else {})
    if not isinstance(core_nodes, dict):
        raise ConfigError('[cluster].core_nodes must be a table of name = "tcp://host:port"')
    named_at: dict[str, str] = {}
    for core_name, endpoint in core_nodes.items():
        if not NODE_NAME_PATTERN.match(core_name):
            raise ConfigError(f"[cluster].core_nodes: invalid node name {core_name!r}")
        check_endpoint(f"[cluster].core_nodes.{core_name}", endpoint)
        if is_wildcard(endpoint) and not (role == "core" and core_name == name):
            # A wildcard is an address to bind (listen), not one this node can connect to (its own
            # entry may be its listen address: a single core listening on every interface). zmq refuses
            # to connect to *; to 0.0.0.0 or [::] it connects, to this machine: another host's core
            # is never reached.
            raise ConfigError(
                f"[cluster].core_nodes.{core_name} must be an address to connect to, not {endpoint!r} "
                "(a wildcard is for [node].listen)"
            )
        # Two names at one endpoint (a copied line): what is sent to one core reaches the other, and
        # the cluster runs a core short of what its size says, with nothing in the log until a failure.
        identity = endpoint_identity(endpoint)  # tcp://localhost:P is tcp://127.0.0.1:P
        if identity in named_at:
            raise ConfigError(
                f"[cluster].core_nodes.{core_name} has the endpoint of {named_at[identity]} ({endpoint}); "
                "every core needs its own"
            )
        named_at[identity] = core_name
    if role == "core" and name not in core_nodes:
        raise ConfigError(f"[cluster].core_nodes must list this core node {name!r}")
    if role == "replicant" and is_wildcard(listen):
        # The replicant gives its listen address to the cores it watches: they push to it. Pushes to
        # 0.0.0.0 went to the core's own machine, and the replicant, elsewhere, never caught up.
        raise ConfigError(
            f"[node].listen of a replicant must name its host, not {listen!r}: cores push to that address"
        )
    if role == "replicant" and not core_nodes:
        raise ConfigError("[cluster].core_nodes must list at least one core for a replicant")
    if role == "replicant" and name in core_nodes:
        # Its requests to the cores would carry a core's name (watches, forwarded writes, the core role's key).
        raise ConfigError(f"[node].name {name!r} is a core's name in [cluster].core_nodes; a replicant needs its own")
    # Listening at another core's endpoint (a copied config whose listen was not changed): what is sent
    # to that core reaches this node, and a replicant watches itself.
    other = named_at.get(endpoint_identity(listen))
    if other is not None and not (role == "core" and other == name):
        raise ConfigError(
            f"[node].listen {listen} is the endpoint of core {other} in [cluster].core_nodes; "
            "give this node its own listen address"
        )

    storage = data.get("storage", {})
    if not isinstance(storage, dict):
        raise ConfigError("[storage] must be a table")
    for key in storage:
        if key not in ("synchronous", "disk_probe_interval_ms"):
            raise ConfigError(f"unknown key [storage].{key} (known: disk_probe_interval_ms, synchronous)")
    disk_probe_interval_ms = storage.get("disk_probe_interval_ms", 1000)
    low, high = DISK_PROBE_INTERVAL_MS_BOUNDS
    probe_ms = disk_probe_interval_ms
    if not isinstance(probe_ms, int) or isinstance(probe_ms, bool) or not low <= probe_ms <= high:
        raise ConfigError(
            f"[storage].disk_probe_interval_ms must be an integer in {low}..{high}, got {disk_probe_interval_ms!r}"
        )
    synchronous = storage.get("synchronous", "FULL")
    if not isinstance(synchronous, str) or synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ConfigError(f"[storage].synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")

    limits = _int_section("limits", data.get("limits", {}), Limits)
    if "replicant_watches_max" not in data.get("limits", {}):
        # Not given: watches_max (a config that changed watches_max alone stays valid and bounds as before).
        limits = dataclasses.replace(limits, replicant_watches_max=limits.watches_max)
    elif limits.replicant_watches_max > limits.watches_max:
        raise ConfigError("[limits].replicant_watches_max must be at most [limits].watches_max")
    if "query_cursors_per_connection_max" not in data.get("limits", {}):
        # Not given: half of query_cursors_max (a config that changed query_cursors_max alone keeps a share).
        limits = dataclasses.replace(limits, query_cursors_per_connection_max=max(1, limits.query_cursors_max // 2))
    elif limits.query_cursors_per_connection_max > limits.query_cursors_max:
        raise ConfigError("[limits].query_cursors_per_connection_max must be at most [limits].query_cursors_max")
    metrics_listen = parse_metrics(data.get("metrics"))
    security = parse_security(data.get("security"), base_dir)
    if security is not None and security.enabled:
        # Peers know a core only by its key's principal, which must be its node name.
        unlisted = sorted(set(core_nodes) - set(security.roles.get("core", ())))
        if unlisted:
            raise ConfigError(
                f"[security.roles].core must list every core of [cluster].core_nodes; missing {', '.join(unlisted)}"
            )
    if security is None and not is_loopback(listen):
        raise ConfigError(
            f"[node].listen {listen!r} is not a loopback address: configure [security] (CurveZMQ keys and roles), "
            "or say [security] insecure = true to run unauthenticated"
        )

    return Config(
        name=name,
        role=role,
        data_dir=data_dir,
        listen=listen,
        core_nodes=dict(core_nodes),
        initial_cluster_state=initial_cluster_state,
        cluster_id=cluster_id,
        synchronous=synchronous.upper(),
        disk_probe_interval_ms=disk_probe_interval_ms,
        limits=limits,
        retention=_int_section("rlog", data.get("rlog", {}), Retention),
        timing=timing,
        security=security,
        metrics_listen=metrics_listen,
        backup=parse_backup(data.get("backup")),
    )


# The longest name a scheduled backup gets in its directory (rlog.backup_schedule.file_name): "/", a
# node name of up to 64 characters, "-YYYYMMDDTHHMMSSZ.db", a taken second's "-N" at most and ".partial".
_BACKUP_NAME_CHARS_MAX = 1 + 64 + 20 + len(f"-{NAME_ATTEMPTS_MAX}") + 8


def parse_backup(raw: Any) -> Backup:
    """``[backup]``: ``directory`` (an absolute path a backup may be written under: ``rlog.backup.check_path``'s
    characters), ``interval_s`` (0: off) and ``keep``. Whether the directory exists and is writable is
    checked when the node starts (``NodeServer``), on its own host."""
    if raw is None:
        return Backup()
    if not isinstance(raw, dict):
        raise ConfigError("[backup] must be a table")
    known = {f.name for f in fields(Backup)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"unknown key [backup].{key} (known: {', '.join(sorted(known))})")
    low = interval_s_min()
    interval_s = raw.get("interval_s", 0)
    if type(interval_s) is not int or not (interval_s == 0 or low <= interval_s <= INTERVAL_S_MAX):
        raise ConfigError(
            f"[backup].interval_s must be 0 (off) or an integer in {low}..{INTERVAL_S_MAX}, got {interval_s!r}"
        )
    keep = raw.get("keep", KEEP_DEFAULT)
    if type(keep) is not int or not 1 <= keep <= KEEP_MAX:
        raise ConfigError(f"[backup].keep must be an integer in 1..{KEEP_MAX}, got {keep!r}")
    directory = raw.get("directory")
    if directory is not None:
        if (
            not isinstance(directory, str)
            or not re.match(BACKUP_PATH_PATTERN, directory)
            or ".." in directory.split("/")
            or len(directory) + _BACKUP_NAME_CHARS_MAX > BACKUP_PATH_CHARS_MAX
        ):
            raise ConfigError(
                "[backup].directory must be an absolute path of letters, digits, '_', '.', '-' and '/' without '..' "
                f"(at most {BACKUP_PATH_CHARS_MAX - _BACKUP_NAME_CHARS_MAX} characters), got {directory!r:.100}"
            )
        directory = directory.rstrip("/") or "/"
    elif interval_s:
        raise ConfigError("[backup].directory is required when [backup].interval_s is set")
    return Backup(directory, interval_s, keep)


def parse_metrics(raw: Any) -> str | None:
    """``[metrics] listen = "127.0.0.1:9400"``: the Prometheus endpoint's address (None: off)."""
    from mnesite.rlog.metrics import parse_listen

    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("[metrics] must be a table")
    for key in raw:
        if key != "listen":
            raise ConfigError(f"unknown key [metrics].{key} (known: listen)")
    if "listen" not in raw:
        return None
    try:
        parse_listen("[metrics].listen", raw["listen"])
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return raw["listen"]


def is_loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def parse_security(raw: Any, base_dir: str) -> SecurityConfig | None:
    """Validate ``[security]``; relative paths are resolved against ``base_dir``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("[security] must be a table")
    for key in raw:
        if key not in SECURITY_KEYS:
            raise ConfigError(f"unknown key [security].{key} (known: {', '.join(sorted(SECURITY_KEYS))})")
    insecure = raw.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ConfigError(f"[security].insecure must be true or false, got {insecure!r}")
    follow_key_links = raw.get("follow_key_links", False)
    if not isinstance(follow_key_links, bool):
        raise ConfigError(f"[security].follow_key_links must be true or false, got {follow_key_links!r}")
    paths: dict[str, str] = {}
    for key in SECURITY_PATHS:
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value or "\0" in value:
            raise ConfigError(f"[security].{key} must be a path, got {value!r}")
        paths[key] = os.path.abspath(os.path.join(base_dir, os.path.expanduser(value)))
        if not os.path.exists(paths[key]):
            raise ConfigError(f"[security].{key}: {paths[key]} does not exist")
    if insecure:
        if paths or raw.get("roles") or follow_key_links:
            raise ConfigError("[security].insecure = true cannot be combined with keys, roles or follow_key_links")
        return SecurityConfig(insecure=True)
    for key in SECURITY_PATHS:
        if key not in paths:
            raise ConfigError(f"[security].{key} is required (or set [security] insecure = true)")
    try:
        roles = check_roles(raw.get("roles", {}))
    except SecurityError as error:
        raise ConfigError(str(error)) from None
    return SecurityConfig(
        False, paths["server_key"], paths["client_key"], paths["authorized_keys"], roles, follow_key_links
    )


# What a SIGHUP applies to a running node (``NodeServer.reload_security``); every other key is read at start.
RELOADED_KEYS = ("[security].authorized_keys", "[security].roles")


def config_keys(config: Config) -> dict[str, Any]:
    """``config``'s values by the name its TOML file gives them (``[limits].scan_rows_max``).
    ``[security]`` stands for the section's mode (absent, insecure, keys): turning it on or off is one change."""

    def section(name: str, values: Any) -> dict[str, Any]:
        return {f"[{name}].{f.name}": getattr(values, f.name) for f in fields(values) if f.name != "insecure"}

    keys: dict[str, Any] = {f"[node].{key}": getattr(config, key) for key in ("name", "role", "data_dir", "listen")}
    keys["[cluster].core_nodes"] = config.core_nodes
    keys["[cluster].initial_cluster_state"] = config.initial_cluster_state
    keys["[cluster].cluster_id"] = config.cluster_id
    keys.update(section("cluster", config.timing))
    keys["[storage].synchronous"] = config.synchronous
    keys["[storage].disk_probe_interval_ms"] = config.disk_probe_interval_ms
    keys.update(section("limits", config.limits))
    keys.update(section("rlog", config.retention))
    keys["[metrics].listen"] = config.metrics_listen
    keys.update(section("backup", config.backup))
    security = config.security
    keys["[security]"] = "absent" if security is None else "insecure" if security.insecure else "keys"
    if security is not None and security.enabled:
        keys.update(section("security", security))
    return keys


def keys_needing_restart(running: Config, reloaded: Config) -> list[str]:
    """The keys a reload found changed that it does not apply (all but ``RELOADED_KEYS``), in
    ``config_keys``' order: a SIGHUP names them, or an edit would look applied and be silently ignored."""
    before, after = config_keys(running), config_keys(reloaded)
    changed = [key for key in {**before, **after} if before.get(key) != after.get(key)]
    if "[security]" in changed:  # turned on or off: its keys' changes are that one change
        return [key for key in changed if not key.startswith("[security].")]
    return [key for key in changed if key not in RELOADED_KEYS]


def load_config(path: str | None) -> Config:
    """Load and validate ``path``; ``None`` gives the single-core default (data in ./mnesite-data)."""
    if path is None:
        return parse_config({})
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    except OSError as error:
        raise ConfigError(f"{path}: {error.strerror}") from None
    try:
        config = parse_config(data, base_dir=os.path.dirname(os.path.abspath(path)))
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    return dataclasses.replace(config, source_path=os.path.abspath(path))
