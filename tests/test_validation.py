"""Pure validation: table definitions, rows, transactions and guards, config files."""

from __future__ import annotations

import dataclasses

import pytest
from mnesite.core.transaction import GuardFailed, evaluate, parse_transaction
from mnesite.rlog.config import ConfigError, keys_needing_restart, load_config, parse_config
from mnesite.rlog.messages import MessageError, typed_body
from mnesite.rlog.schema import SchemaError, define_table
from mnesite.rlog.security import SecurityConfig
from mnesite.rlog.types import DeleteOp, WriteOp

pytestmark = pytest.mark.timeout(30)

USERS = define_table("users", "id", [["id", "INTEGER"], ["name", "TEXT"], ["score", "REAL"], ["blob", "BLOB"]])
OTHER = define_table("events", "id", [["id", "TEXT"]], shard="events")
CATALOG = {"users": USERS, "events": OTHER}


def parse(ops, guards=None):
    """A transact request as a node gets it: decoded by the wire schema, then checked against the catalog."""
    body = {"ops": ops} if guards is None else {"ops": ops, "guards": guards}
    try:
        request = typed_body("transact", body)
    except MessageError as error:
        raise SchemaError(error.code, str(error)) from None
    return parse_transaction(request, CATALOG, transaction_ops_max=10)


def test_define_table_validates_names_and_types() -> None:
    assert define_table("t", "k", []).columns == (("k", "TEXT"),)
    with pytest.raises(SchemaError, match="invalid table name"):
        define_table("bad name", "k", [])
    with pytest.raises(SchemaError, match="reserved"):
        define_table("_mnesite_x", "k", [])
    with pytest.raises(SchemaError, match="has type 'DATE'"):
        define_table("t", "k", [["d", "DATE"]])
    with pytest.raises(SchemaError, match="must be INTEGER, TEXT or BLOB"):
        define_table("t", "k", [["k", "REAL"]])
    with pytest.raises(SchemaError, match="declared twice"):
        define_table("t", "k", [["a", "TEXT"], ["A", "TEXT"]])


def test_writes_become_full_rows() -> None:
    tx = parse([{"op": "write", "table": "users", "row": {"id": 1, "score": 2}}])
    assert tx.ops == (WriteOp("users", {"id": 1, "name": None, "score": 2.0, "blob": None}),)
    assert tx.shard == "default"


@pytest.mark.parametrize(
    ("ops", "code", "text"),
    [
        ([{"op": "write", "table": "nope", "row": {"id": 1}}], "unknown_table", "unknown table 'nope'"),
        ([{"op": "write", "table": "users", "row": {"id": "x"}}], "wrong_type", "users.id is INTEGER"),
        ([{"op": "write", "table": "users", "row": {"id": 1, "name": 5}}], "wrong_type", "users.name is TEXT"),
        ([{"op": "write", "table": "users", "row": {"id": 1, "name": True}}], "wrong_type", "booleans"),
        ([{"op": "write", "table": "users", "row": {"id": 2**64 - 1}}], "bad_request", "64-bit"),
        ([{"op": "write", "table": "users", "row": {"id": 1, "zzz": 1}}], "unknown_column", "no column 'zzz'"),
        ([{"op": "write", "table": "users", "row": {"name": "a"}}], "wrong_type", "cannot be null"),
        ([{"op": "write", "table": "users", "row": [1]}], "bad_frame", "Expected `object`, got `array`"),
        ([{"op": "delete", "table": "users", "key": None}], "wrong_type", "cannot be null"),
        ([{"op": "upsert", "table": "users", "row": {"id": 1}}], "bad_request", "Invalid value 'upsert'"),
        ([], "bad_request", "at least one op"),
        ([{"op": "delete", "table": "users", "key": i} for i in range(11)], "too_large", "transaction_ops_max"),
        (
            [{"op": "delete", "table": "users", "key": 1}, {"op": "delete", "table": "events", "key": "a"}],
            "bad_request",
            "within one shard",
        ),
    ],
)
def test_bad_transactions_are_refused_with_a_clear_error(ops, code, text) -> None:
    with pytest.raises(SchemaError, match=text) as info:
        parse(ops)
    assert info.value.code == code


def test_guards_compare_full_rows_or_absence() -> None:
    current = {("users", 1): {"id": 1, "name": "a", "score": None, "blob": None}}

    def read(table, key):
        return current.get((table.name, key))

    ok = parse(
        [{"op": "delete", "table": "users", "key": 1}],
        [{"table": "users", "key": 1, "equals": {"id": 1, "name": "a"}}, {"table": "users", "key": 2, "equals": None}],
    )
    assert evaluate(ok, CATALOG, read) == (DeleteOp("users", 1),)
    failing = parse(
        [{"op": "delete", "table": "users", "key": 1}],
        [{"table": "users", "key": 2, "equals": None}, {"table": "users", "key": 1, "equals": None}],
    )
    outcome = evaluate(failing, CATALOG, read)
    assert isinstance(outcome, GuardFailed) and outcome.index == 1
    assert outcome.actual == current[("users", 1)]
    assert "guard 1 failed: users[1] should be absent" in outcome.describe()
    with pytest.raises(SchemaError, match="differs from the guarded key"):
        parse([{"op": "delete", "table": "users", "key": 1}], [{"table": "users", "key": 1, "equals": {"id": 2}}])


def test_default_config_is_a_single_core() -> None:
    config = load_config(None)
    assert (config.name, config.role, config.listen) == ("core1", "core", "tcp://127.0.0.1:7400")
    assert config.data_dir.endswith("mnesite-data") and config.synchronous == "FULL"
    assert config.core_nodes == {"core1": "tcp://127.0.0.1:7400"}


@pytest.mark.parametrize(
    ("data", "text"),
    [
        ({"node": {"role": "leader"}}, r"\[node\].role"),
        ({"node": {"listen": "http://x"}}, r"\[node\].listen"),
        ({"node": {"colour": "red"}}, r"unknown key \[node\].colour"),
        ({"nodes": {}}, r"unknown section \[nodes\]"),
        ({"node": {"name": "a"}, "cluster": {"core_nodes": {"b": "tcp://127.0.0.1:1"}}}, "must list this core"),
        ({"cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:99999"}}}, r"core_nodes.core1"),
        (
            {"cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400", "core2": "tcp://127.0.0.1:7400"}}},
            r"\[cluster\].core_nodes.core2 has the endpoint of core1",
        ),
        (  # the same endpoint spelt another way (rlog.types.endpoint_identity)
            {"cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400", "core2": "tcp://localhost:07400"}}},
            r"\[cluster\].core_nodes.core2 has the endpoint of core1",
        ),
        # A wildcard is for listen only: a peer cannot connect to it (zmq: Invalid argument at start).
        (
            {"cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400", "core2": "tcp://*:7401"}}},
            r"\[cluster\].core_nodes.core2 must be an address to connect to",
        ),
        (
            {"node": {"role": "replicant"}, "cluster": {"core_nodes": {"core1": "tcp://*:7400"}}},
            r"\[cluster\].core_nodes.core1 must be an address to connect to",
        ),
        # zmq connects to 0.0.0.0 and [::], to this machine: another host's core is never reached.
        (
            {"cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400", "core2": "tcp://0.0.0.0:7401"}}},
            r"\[cluster\].core_nodes.core2 must be an address to connect to",
        ),
        (
            {"node": {"role": "replicant"}, "cluster": {"core_nodes": {"core1": "tcp://[::]:7400"}}},
            r"\[cluster\].core_nodes.core1 must be an address to connect to",
        ),
        # A replicant gives its listen address to the cores: pushes to 0.0.0.0 went to the core's machine.
        *(
            (
                {
                    "node": {"role": "replicant", "name": "r1", "listen": listen},
                    "cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400"}},
                    "security": {"insecure": True},
                },
                r"\[node\].listen of a replicant must name its host, not 'tcp://",
            )
            for listen in ("tcp://0.0.0.0:7500", "tcp://[::]:7500", "tcp://*:7500")
        ),
        ({"node": {"role": "replicant"}}, "at least one core"),
        ({"storage": {"synchronous": "SOMETIMES"}}, r"\[storage\].synchronous"),
        ({"limits": {"group_commit_max": 0}}, r"\[limits\].group_commit_max"),
        # Below it an entry and the append around it do not fit (core.node.consensus_config_of).
        ({"limits": {"frame_bytes_max": 1024}}, r"\[limits\].frame_bytes_max must be an integer in 65536\.\."),
        ({"limits": {"group_commit_max": "9"}}, r"\[limits\].group_commit_max"),
        ({"rlog": {"retention_entries": 5}}, r"unknown key \[rlog\].retention_entries"),
        ({"cluster": {"election_timeout_ms": 5}}, r"unknown key \[cluster\].election_timeout_ms "),
        ({"cluster": {"heartbeat_interval_ms": 900}}, r"heartbeat_interval_ms must be at most half"),
        ({"cluster": {"lazy_feed_interval_ms": 150}}, r"lazy_feed_interval_ms must be at most heartbeat_interval_ms"),
        ({"cluster": {"lazy_feed_interval_ms": -1}}, r"\[cluster\].lazy_feed_interval_ms must be an integer in 0\.\."),
        ({"cluster": {"election_timeout_ms_min": 500, "election_timeout_ms_max": 100}}, r"at least election_"),
        ({"cluster": {"initial_cluster_state": "rebuilt"}}, r"initial_cluster_state must be one of new, existing"),
        ({"cluster": {"initial_cluster_state": 1}}, r"initial_cluster_state must be one of new, existing"),
    ],
)
def test_config_mistakes_name_the_key(data, text) -> None:
    with pytest.raises(ConfigError, match=text):
        parse_config(data)


def test_config_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[node\nname=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(str(bad))
    good = tmp_path / "node.toml"
    good.write_text('[node]\nname = "n1"\ndata_dir = "d"\nlisten = "tcp://127.0.0.1:7500"\n')
    config = load_config(str(good))
    assert config.data_dir == str(tmp_path / "d") and config.core_nodes == {"n1": "tcp://127.0.0.1:7500"}
    assert config.initial_cluster_state == "new"
    assert parse_config({"cluster": {"initial_cluster_state": "existing"}}).initial_cluster_state == "existing"


def test_the_lazy_feed_interval_reaches_the_consensus_machine_and_its_default_follows_a_short_heartbeat(
    tmp_path,
) -> None:
    """0 turns lazy followers off; the default (20 ms) is capped by the machine at a shorter heartbeat
    interval rather than refused (a config that only shortens the heartbeat stays valid)."""
    from mnesite.core.node import CoreNode

    from tests.conftest import free_port, node_config

    assert parse_config({"cluster": {"lazy_feed_interval_ms": 0}}).timing.lazy_feed_interval_ms == 0
    short = parse_config({"cluster": {"election_timeout_ms_min": 20, "heartbeat_interval_ms": 10}})
    assert short.timing.lazy_feed_interval_ms == 20
    config = node_config(tmp_path / "core", free_port(), extra={"cluster": {"lazy_feed_interval_ms": 7}})
    node = CoreNode(config)
    try:
        assert node.consensus_config.lazy_feed_interval_ms == 7
    finally:
        node.close()


def test_driver_limits_a_user_may_tune_are_config_keys_with_bounds() -> None:
    config = parse_config(
        {
            "limits": {"guard_failures_held_max": 7, "guard_hold_ms_max": 250},
            "rlog": {"retention_interval_ms": 50},
            "cluster": {"recovery_timeout_ms": 3000},
        }
    )
    assert (config.limits.guard_failures_held_max, config.limits.guard_hold_ms_max) == (7, 250)
    assert config.retention.retention_interval_ms == 50
    assert config.timing.recovery_timeout_ms == 3000
    defaults = parse_config({})
    assert defaults.retention.retention_interval_ms == 1000 and defaults.timing.recovery_timeout_ms == 1000
    for section, key in [("limits", "guard_hold_ms_max"), ("rlog", "retention_interval_ms")]:
        with pytest.raises(ConfigError, match=key):
            parse_config({section: {key: 0}})


def test_a_core_holds_failed_guards_within_its_configured_limits(tmp_path) -> None:
    from mnesite.core.node import CoreNode

    config = parse_config(
        {"node": {"data_dir": str(tmp_path)}, "limits": {"guard_failures_held_max": 3, "guard_hold_ms_max": 40}}
    )
    node = CoreNode(config)
    try:
        node._shard_for("default", create=True)
        tail = node.shards["default"].tail
        assert (tail.failures_held_max, tail.hold_ms_max) == (3, 40)
    finally:
        node.close()


def test_a_cores_agents_take_push_delay_ms_max_from_the_config_and_0_turns_it_off(tmp_path) -> None:
    from mnesite.core.node import CoreNode

    assert parse_config({}).limits.push_delay_ms_max == 50
    for bad in (-1, 251, True):
        with pytest.raises(ConfigError, match="push_delay_ms_max"):
            parse_config({"limits": {"push_delay_ms_max": bad}})
    for value in (0, 20):
        config = parse_config(
            {"node": {"data_dir": str(tmp_path / str(value))}, "limits": {"push_delay_ms_max": value}}
        )
        node = CoreNode(config)
        try:
            assert node.agent_server.config.push_delay_ms_max == value
        finally:
            node.close()


def test_a_cores_agents_take_ack_timeout_ms_from_the_config(tmp_path) -> None:
    """An agent stops when its replicant acknowledges nothing, or reads no push, for ``ack_timeout_ms``
    (core.agent): a link that carries less than ``window_bytes_max`` in that time could never catch
    up, and the timeout could not be raised (it was AgentConfig's 10 s, no config key)."""
    from mnesite.core.node import CoreNode

    assert parse_config({}).limits.ack_timeout_ms == 10_000
    for bad in (999, 600_001, True, "10s"):
        with pytest.raises(ConfigError, match=r"\[limits\]\.ack_timeout_ms must be an integer in 1000\.\.600000"):
            parse_config({"limits": {"ack_timeout_ms": bad}})
    config = parse_config({"node": {"data_dir": str(tmp_path)}, "limits": {"ack_timeout_ms": 60_000}})
    node = CoreNode(config)
    try:
        assert node.agent_server.config.ack_timeout_ms == 60_000
    finally:
        node.close()


def test_a_replicants_spill_budget_is_configured_by_limits_spill_entries_max_and_spill_bytes_max(tmp_path) -> None:
    """Regression: a replicant's spill budget (the entries one bootstrapping shard spills, the bytes all
    its shards spill together) was fixed in ``ReplicaConfig``, while the sizing page's trap (a copy
    that outlasts retention after its spill filled begins again for ever) is sized by it. It is now
    ``[limits] spill_entries_max`` and ``spill_bytes_max``, bounded, and reaches the replicant's replicas."""
    from mnesite.replicant.replica import ReplicaConfig

    from tests.conftest import replicant_by_hand

    default = parse_config({}).limits
    assert (default.spill_entries_max, default.spill_bytes_max) == (100_000, 1024**3)
    assert (ReplicaConfig().spill_entries_max, ReplicaConfig().spill_bytes_max) == (100_000, 1024**3)
    for key, bad, bounds in [
        ("spill_entries_max", 0, r"1\.\.1000000000"),
        ("spill_entries_max", 10**9 + 1, r"1\.\.1000000000"),
        ("spill_bytes_max", 1024**2 - 1, r"1048576\.\.1099511627776"),
        ("spill_bytes_max", "1GiB", r"1048576\.\.1099511627776"),
    ]:
        with pytest.raises(ConfigError, match=rf"\[limits\]\.{key} must be an integer in {bounds}"):
            parse_config({"limits": {key: bad}})
    with replicant_by_hand(tmp_path / "data", {"spill_entries_max": 500, "spill_bytes_max": 8 * 1024**2}) as node:
        assert (node.replica_config.spill_entries_max, node.replica_config.spill_bytes_max) == (500, 8 * 1024**2)
        assert node.spill_budget.bytes_max == 8 * 1024**2


@pytest.mark.parametrize("trailing", ["\n", "\r\n"])
def test_a_name_endpoint_or_path_with_a_trailing_newline_is_refused_everywhere(trailing, tmp_path) -> None:
    """Every name rule ends its pattern at the end of the string: ``$`` also matches before a final
    newline, so ``"kv\\n"`` passed the wire, the schema and the config (found by reading)."""
    from mnesite.rlog.messages import decode_ops
    from mnesite.rlog.types import pack_ops

    with pytest.raises(SchemaError, match="invalid table name"):
        define_table("kv" + trailing, "k", [])
    with pytest.raises(MessageError):
        typed_body("get", {"table": "kv" + trailing, "key": 1})
    with pytest.raises(MessageError):
        typed_body("backup", {"path": "/tmp/backup" + trailing})
    with pytest.raises(MessageError):
        decode_ops(pack_ops((WriteOp("kv" + trailing, {"id": 1}),)))
    with pytest.raises(ConfigError):
        parse_config({"node": {"name": "core1" + trailing}})
    with pytest.raises(ConfigError):
        parse_config({"node": {"name": "core1", "listen": "tcp://127.0.0.1:7000" + trailing}})
    # The same names without the newline pass.
    define_table("kv", "k", [])
    typed_body("get", {"table": "kv", "key": 1})
    decode_ops(pack_ops((WriteOp("kv", {"id": 1}),)))


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (  # a core's config copied for another core, listen left as it was
            {
                "node": {"name": "core2", "listen": "tcp://127.0.0.1:7400"},
                "cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400", "core2": "tcp://127.0.0.1:7401"}},
            },
            r"\[node\].listen tcp://127.0.0.1:7400 is the endpoint of core core1",
        ),
        (  # the same endpoint spelt another way
            {
                "node": {"name": "r1", "role": "replicant", "listen": "tcp://localhost:7400"},
                "cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400"}},
            },
            r"\[node\].listen tcp://localhost:7400 is the endpoint of core core1",
        ),
        (
            {
                "node": {"name": "core1", "role": "replicant", "listen": "tcp://127.0.0.1:7402"},
                "cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7400"}},
            },
            r"\[node\].name 'core1' is a core's name",
        ),
        ({"node": {"data_dir": "data\0dir"}}, r"\[node\].data_dir must be a non-empty path"),
        ({"security": {"server_key": "k\0", "insecure": False}}, r"\[security\].server_key must be a path"),
    ],
)
def test_config_mistakes_that_started_a_broken_node_name_the_key(data, text) -> None:
    """Each of these started a node (a replicant watching itself, a core answering for another) or
    failed at start with "cannot start: ValueError: embedded null byte", naming no key."""
    with pytest.raises(ConfigError, match=text):
        parse_config(data)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path) -> None:
    """tomllib raised UnicodeDecodeError, which ``mnesite start`` printed as "cannot start: ..." without the file."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[node]\nname = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.toml: invalid TOML: not UTF-8 text \(byte 18\)"):
        load_config(str(bad))


def test_a_core_may_listen_on_its_own_endpoint_or_a_wildcard_and_a_replicant_beside_the_cores() -> None:
    cores = {"core1": "tcp://127.0.0.1:7400", "core2": "tcp://127.0.0.1:7401"}
    parse_config({"node": {"name": "core2", "listen": "tcp://127.0.0.1:7401"}, "cluster": {"core_nodes": cores}})
    wildcard = {"name": "core2", "listen": "tcp://*:7401"}
    parse_config({"node": wildcard, "cluster": {"core_nodes": cores}, "security": {"insecure": True}})
    replicant = {"name": "r1", "role": "replicant", "listen": "tcp://127.0.0.1:7402"}
    parse_config({"node": replicant, "cluster": {"core_nodes": cores}})


def test_keys_needing_restart_names_every_edited_key_a_sighup_does_not_apply() -> None:
    """A SIGHUP applies [security] authorized_keys and roles only; any other key edited in the file is
    named (as the file names it), so that an edit is never silently ignored until a restart."""
    running = parse_config({"limits": {"scan_rows_max": 100}, "metrics": {"listen": "127.0.0.1:9400"}})
    assert keys_needing_restart(running, running) == []
    edited = parse_config(
        {
            "node": {"listen": "tcp://127.0.0.1:7401"},
            "cluster": {"core_nodes": {"core1": "tcp://127.0.0.1:7401"}, "heartbeat_interval_ms": 50},
            "storage": {"synchronous": "normal"},
            "limits": {"scan_rows_max": 200},
            "rlog": {"retention_entries_max": 10},
        }
    )
    assert keys_needing_restart(running, edited) == [
        "[node].listen",
        "[cluster].core_nodes",
        "[cluster].heartbeat_interval_ms",
        "[storage].synchronous",
        "[limits].scan_rows_max",
        "[rlog].retention_entries_max",
        "[metrics].listen",
    ]
    # [security]: the keys a reload applies are not named; the others are; turning it on or off is one key.
    keys = SecurityConfig(False, "/k/cluster.key_secret", "/k/core1.key_secret", "/k/authorized", {"core": ("core1",)})
    secure = dataclasses.replace(running, security=keys)
    reloadable = dataclasses.replace(keys, authorized_keys="/k/other", roles={"core": ("core1",), "admin": ("ops",)})
    assert keys_needing_restart(secure, dataclasses.replace(secure, security=reloadable)) == []
    rotated = dataclasses.replace(keys, server_key="/k/new.key_secret", follow_key_links=True)
    assert keys_needing_restart(secure, dataclasses.replace(secure, security=rotated)) == [
        "[security].server_key",
        "[security].follow_key_links",
    ]
    assert keys_needing_restart(running, secure) == ["[security]"]
    insecure = dataclasses.replace(running, security=SecurityConfig(insecure=True))
    assert keys_needing_restart(secure, insecure) == ["[security]"]
