"""Secondary indexes and added columns: the ops, their one rule each (rlog.schema), the store applying
them (replays change nothing), the guard tail, copies brought up to date, and through a node and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import apsw
import msgspec
import pytest
from click.testing import CliRunner
from mnesite.cli.main import main
from mnesite.core.guard_tail import GuardTail
from mnesite.core.transaction import parse_transaction
from mnesite.rlog.client import RemoteError
from mnesite.rlog.messages import MessageError, WireEntry, decode_entry, typed_body
from mnesite.rlog.roles import RoleTable
from mnesite.rlog.schema import (
    IndexSchema,
    SchemaError,
    check_column_addable,
    check_creatable,
    check_index_creatable,
    check_index_droppable,
    define_table,
    schema_ops_toward,
    shard_schema_ops_toward,
    table_from_json,
)
from mnesite.rlog.store import Store
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ZERO_KEY,
    AddColumnOp,
    CreateIndexOp,
    DeleteOp,
    DropIndexOp,
    DropTableOp,
    OpDecodeError,
    TxKey,
    WriteOp,
    decode_op,
    make_entry,
)

from tests.conftest import ThreadNode

pytestmark = pytest.mark.timeout(60)

USERS = define_table("users", "id", [["id", "INTEGER"], ["name", "TEXT"], ["karma", "INTEGER"]], "s")
CATALOG = {"users": USERS}
BY_KARMA = CreateIndexOp("by_karma", "users", "s", ("karma", "name"))
EMAIL = AddColumnOp("users", "s", "email", "TEXT")


def test_the_ops_encode_canonically_and_travel_in_entries() -> None:
    for op in (BY_KARMA, DropIndexOp("by_karma", "users", "s"), EMAIL):
        assert decode_op(msgspec.to_builtins(op)) == op
    entry = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (BY_KARMA, EMAIL), "r1")
    assert decode_entry(msgspec.convert(entry.to_wire(), WireEntry)) == entry
    other = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (BY_KARMA,), "r1")
    assert other.digest != entry.digest  # the digest chain covers schema changes
    for malformed in (["i", "x", "users", "s", "karma"], ["j", "x", "users"], ["a", "users", "s", "c", 1]):
        with pytest.raises(OpDecodeError):
            decode_op(malformed)
    wire = entry.to_wire()
    import msgpack

    hostile = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (CreateIndexOp("ix", "users", "s", ()),))
    with pytest.raises(MessageError):
        decode_entry(msgspec.convert(hostile.to_wire(), WireEntry))  # an index of no column is no wire op
    wire[4] = msgpack.packb([["i", "ix", "users", "s", ["bad name!"]]], use_bin_type=True)
    with pytest.raises(MessageError):
        decode_entry(msgspec.convert(wire, WireEntry))


def test_index_rules() -> None:
    assert check_index_creatable(CATALOG, BY_KARMA) is True
    changed = {"users": USERS.changed_by(BY_KARMA)}
    assert changed["users"].indexes == (IndexSchema("by_karma", ("karma", "name")),)
    assert check_index_creatable(changed, BY_KARMA) is False  # a replay changes nothing
    refusals = [
        (CATALOG, CreateIndexOp("ix", "nope", "s", ("id",)), "unknown table"),
        (CATALOG, CreateIndexOp("ix", "users", "other", ("id",)), "shard"),
        (CATALOG, CreateIndexOp("ix", "users", "s", ("nope",)), "no column 'nope'"),
        (CATALOG, CreateIndexOp("ix", "users", "s", ("karma", "karma")), "twice"),
        (CATALOG, CreateIndexOp("ix", "users", "s", ()), "1..16"),
        (CATALOG, CreateIndexOp("users", "users", "s", ("id",)), "name of a table"),
        (CATALOG, CreateIndexOp("_mnesite_x", "users", "s", ("id",)), "reserved"),
        (changed, CreateIndexOp("BY_KARMA", "users", "s", ("id",)), "already exists"),
    ]
    for catalog, op, words in refusals:
        with pytest.raises(SchemaError, match=words):
            check_index_creatable(catalog, op)
    with pytest.raises(SchemaError, match="name of index"):
        check_creatable(changed, define_table("by_karma", "id", []).to_op())
    assert check_index_droppable(changed, DropIndexOp("by_karma", "users", "s")) is True
    assert check_index_droppable(CATALOG, DropIndexOp("by_karma", "users", "s")) is False
    with pytest.raises(SchemaError):
        check_index_droppable(changed, DropIndexOp("by_karma", "users", "other"))


def test_column_rules() -> None:
    assert check_column_addable(CATALOG, EMAIL) is True
    changed = {"users": USERS.changed_by(EMAIL)}
    assert changed["users"].columns[-1] == ("email", "TEXT")
    assert check_column_addable(changed, EMAIL) is False
    for op, words in [
        (AddColumnOp("users", "s", "email", "INTEGER"), "already"),
        (AddColumnOp("users", "s", "NAME", "TEXT"), "already"),
        (AddColumnOp("users", "s", "x", "DATE"), "use one of"),
        (AddColumnOp("nope", "s", "x", "TEXT"), "unknown table"),
        (AddColumnOp("users", "s", "bad name", "TEXT"), "invalid column name"),
    ]:
        catalog = changed if op.column == "email" else CATALOG
        with pytest.raises(SchemaError, match=words):
            check_column_addable(catalog, op)


@pytest.fixture
def store(tmp_path: Path):
    store = Store(str(tmp_path / "node.db"))
    with store.write_transaction():
        store.apply_ops((USERS.to_op(), WriteOp("users", {"id": 1, "name": "ada", "karma": 7})))
    yield store
    store.close()


def _sqlite_schema(store: Store) -> list[tuple]:
    return list(store.connection.execute("SELECT type, name, tbl_name, sql FROM sqlite_schema ORDER BY name"))


def test_the_store_applies_them_and_a_replay_changes_nothing(store: Store) -> None:
    with store.write_transaction():
        store.apply_ops((BY_KARMA, EMAIL, WriteOp("users", {"id": 2, "name": "bob", "karma": 3, "email": "b@x"})))
    assert store.catalog()["users"].indexes == (IndexSchema("by_karma", ("karma", "name")),)
    assert store.catalog()["users"].columns[-1] == ("email", "TEXT")
    rows = list(store.connection.execute("SELECT id, email FROM users ORDER BY id"))
    assert rows == [(1, None), (2, "b@x")]
    plan = list(store.connection.execute("EXPLAIN QUERY PLAN SELECT name FROM users WHERE karma = 3"))
    assert "by_karma" in str(plan)
    schema = _sqlite_schema(store)
    with store.write_transaction():
        store.apply_ops((BY_KARMA, EMAIL))  # a replay over a copy made after them
    assert _sqlite_schema(store) == schema
    with store.write_transaction():
        store.apply_ops_batched([DropIndexOp("by_karma", "users", "s"), DropIndexOp("by_karma", "users", "s")])
    assert store.catalog()["users"].indexes == () and "by_karma" not in str(_sqlite_schema(store))
    with store.write_transaction():
        store.apply_ops((BY_KARMA, DropTableOp("users", "s")))
    assert store.catalog() == {}
    assert list(store.connection.execute("SELECT * FROM _mnesite_indexes")) == []


def test_a_copy_is_brought_to_the_listed_definition(store: Store) -> None:
    listed = USERS.changed_by(EMAIL).changed_by(BY_KARMA)
    assert table_from_json(json.loads(json.dumps(listed.to_json()))) == listed
    stale = USERS.changed_by(CreateIndexOp("old", "users", "s", ("name",)))
    assert schema_ops_toward(None, listed) == (listed.to_op(), BY_KARMA)
    assert schema_ops_toward(stale, listed) == (EMAIL, DropIndexOp("old", "users", "s"), BY_KARMA)
    assert schema_ops_toward(listed, listed) == ()
    with store.write_transaction():
        store.apply_ops((CreateIndexOp("old", "users", "s", ("name",)),))
        store.apply_ops(schema_ops_toward(store.catalog()["users"], listed))
    assert store.catalog()["users"] == listed
    with pytest.raises(SchemaError):
        table_from_json({**listed.to_json(), "indexes": [{"name": "x", "columns": ["nope"]}]})


def test_a_copy_s_shard_is_brought_to_the_listed_tables_dropped_and_re_created_ones_included(store: Store) -> None:
    """A bootstrap or snapshot install takes a shard's tables as its core lists them. Each listed table
    was only brought up to date (columns added, indexes changed): a table dropped on the cores stayed,
    and one dropped and created again with another key kept its old key, under which the copied rows
    were then stored."""
    gone = define_table("gone", "id", [["id", "INTEGER"]], "s")
    other_shard = define_table("elsewhere", "id", [["id", "INTEGER"]], "t")
    again = define_table("users", "uid", [["uid", "TEXT"], ["name", "TEXT"]], "s")
    retyped = define_table("users", "id", [["id", "INTEGER"], ["name", "BLOB"], ["karma", "INTEGER"]], "s")
    catalog = {"users": USERS, "gone": gone, "elsewhere": other_shard}
    listed = USERS.changed_by(EMAIL).changed_by(BY_KARMA)
    assert shard_schema_ops_toward(catalog, "s", [listed]) == (DropTableOp("gone", "s"), EMAIL, BY_KARMA)
    assert shard_schema_ops_toward(catalog, "s", [again]) == (
        DropTableOp("users", "s"),
        DropTableOp("gone", "s"),
        again.to_op(),
    )
    assert shard_schema_ops_toward(catalog, "s", [retyped])[0] == DropTableOp("users", "s")
    assert shard_schema_ops_toward({"users": listed}, "s", [listed]) == ()
    with store.write_transaction():
        store.apply_ops((USERS.to_op(), gone.to_op(), other_shard.to_op()))
        store.write_rows("users", [{"id": 1, "name": "old", "karma": 0}])
        store.apply_ops(shard_schema_ops_toward(store.catalog(), "s", [again]))
    assert store.catalog() == {"users": again, "elsewhere": other_shard}


def test_a_copy_drops_what_it_must_before_a_listed_name_takes_it(store: Store) -> None:
    """Index names are one namespace with the tables'. Regression: the ops followed the listed order, so
    an index moved from ``zeta`` to ``alpha`` was made on ``alpha`` before ``zeta``'s was dropped, and a
    table made under the name of one of ``zeta``'s dropped indexes before that drop: ``index_exists``
    or ``table_exists``, a ``StoreError`` out of the bootstrap's or snapshot install's turn."""
    alpha = define_table("alpha", "id", [["id", "INTEGER"], ["v", "TEXT"]], "s")
    zeta = define_table("zeta", "id", [["id", "INTEGER"], ["v", "TEXT"]], "s")
    with store.write_transaction():
        store.apply_ops((alpha.to_op(), zeta.to_op(), CreateIndexOp("ix", "zeta", "s", ("v",))))
    moved = [alpha.changed_by(CreateIndexOp("ix", "alpha", "s", ("v",))), zeta]
    named_after = [define_table("IX", "k", [["k", "TEXT"]], "s"), alpha, zeta]  # alpha's ix dropped
    for listed in (moved, named_after):
        with store.write_transaction():
            store.apply_ops(shard_schema_ops_toward(store.catalog(), "s", listed))
        assert store.catalog() == {table.name: table for table in listed}


def test_the_guard_tail_checks_later_writes_against_the_changed_table() -> None:
    tail: GuardTail[str] = GuardTail(CATALOG)
    tail.add((make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (EMAIL, BY_KARMA)),))
    catalog = tail.catalog_over(CATALOG)
    assert catalog["users"].columns[-1] == ("email", "TEXT") and catalog["users"].indexes
    request = typed_body("transact", {"ops": [{"op": "write", "table": "users", "row": {"id": 3, "email": "c@x"}}]})
    assert parse_transaction(request, catalog, 100)
    with pytest.raises(SchemaError, match="no column 'email'"):
        parse_transaction(request, CATALOG, 100)


def test_only_admins_change_schemas() -> None:
    roles = RoleTable({"admin": ["ops"], "writer": ["app"], "reader": ["dash"], "replicant": ["r1"]})
    for kind in ("create_index", "drop_index", "add_column"):
        assert roles.refusal("ops", kind) is None
        assert roles.refusal("r1", kind) is None  # forwarding its admin client's request
        assert "may not send" in roles.refusal("app", kind)
        assert "may not send" in roles.refusal("dash", kind)


# -- through a node -------------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path):
    node = ThreadNode(tmp_path / "data")
    with node.client() as client:
        client.create_table("users", "id", [("id", "INTEGER"), ("name", "TEXT"), ("karma", "INTEGER")])
        with client.transaction() as tx:
            for i in range(100):
                tx.put("users", {"id": i, "name": f"user{i}", "karma": i % 10})
    try:
        yield node
    finally:
        node.stop()


def test_client_index_and_column_changes(node: ThreadNode) -> None:
    with node.client() as client:
        created = client.create_index("users", ["karma"])
        assert client.table("users")["indexes"] == [{"name": "users_karma_idx", "columns": ["karma"]}]
        added = client.add_column("users", "email", "text")
        assert added > created and client.last_tx_key == added
        client.put("users", {"id": 500, "name": "new", "karma": 1, "email": "n@x"})
        assert client.get("users", 500)["email"] == "n@x" and client.get("users", 1)["email"] is None
        assert list(client.query("SELECT count(*) FROM users WHERE karma = 1 AND email IS NULL")) == [(10,)]
        with pytest.raises(RemoteError) as refused:
            client.create_index("users", ["karma"])
        assert refused.value.code == "index_exists"
        with pytest.raises(RemoteError) as refused:
            client.drop_index("nope")
        assert refused.value.code == "unknown_index"
        with pytest.raises(RemoteError) as refused:
            client.put("users", {"id": 501, "phone": "1"})
        assert refused.value.code == "unknown_column"
        client.drop_index("users_karma_idx")
        assert "indexes" not in client.table("users")
        # rlog tail shows each schema change as what it is (an index op used to fail the whole read).
        ops = [op for entry in client.rlog_tail("default", 20) for op in entry["ops"]]
        kinds = [op["op"] for op in ops if op["op"] in ("create_index", "add_column", "drop_index")]
        assert kinds == ["create_index", "add_column", "drop_index"]
        assert {"op": "add_column", "table": "users", "shard": "default", "column": "email", "type": "TEXT"} in ops
    connection = apsw.Connection(node.node.config.database_path, flags=apsw.SQLITE_OPEN_READONLY)
    names = [row[0] for row in connection.execute("SELECT name FROM sqlite_schema WHERE tbl_name = 'users'")]
    connection.close()
    assert names == ["users"]


def test_cli_index_and_add_column(node: ThreadNode) -> None:
    runner = CliRunner()

    def mnesite(*args: str):
        return runner.invoke(main, [*args, "--node", node.endpoint], catch_exceptions=False)

    created = mnesite("index", "create", "users", "karma", "name", "--name", "by_karma")
    assert created.exit_code == 0 and created.output.startswith("created index by_karma on users (karma, name)")
    assert json.loads(mnesite("index", "create", "users", "name", "--json").output)["index"] == "users_name_idx"
    added = mnesite("table", "add-column", "users", "email:TEXT")
    assert added.exit_code == 0 and "added email TEXT to users" in added.output
    described = mnesite("table", "describe", "users").output.splitlines()
    assert described[-4:] == ["", "index           columns", "by_karma        karma, name", "users_name_idx  name"]
    assert "email   TEXT" in "\n".join(described)
    assert json.loads(mnesite("table", "describe", "users", "--json").output)["indexes"][0]["name"] == "by_karma"
    bad = mnesite("table", "add-column", "users", "phone")
    assert bad.exit_code == 1 and "NAME:TYPE" in bad.output
    refused = mnesite("index", "create", "users", "nope")
    assert refused.exit_code == 1 and "no column 'nope'" in refused.output
    dropped = mnesite("index", "drop", "by_karma", "--json")
    assert dropped.exit_code == 0 and len(json.loads(dropped.output)["tx_key"]) == 2
    assert "by_karma" not in mnesite("table", "describe", "users").output
    tail = mnesite("rlog", "tail", "default", "-n", "4").output
    for line in (
        "create_index by_karma on users (karma, name)",
        "add_column users.email TEXT",
        "drop_index by_karma on users",
    ):
        assert line in tail, tail


# -- online index builds (rlog.store) -------------------------------------------------------------


def _rows(store: Store, table: str = "users") -> list[tuple]:
    return list(store.connection.execute(f"SELECT * FROM {table} ORDER BY id"))


def _build_to_the_end(store: Store, steps_max: int = 1000) -> int:
    steps = 0
    while store.index_builds():
        with store.write_transaction():
            store.index_build_step()
        steps += 1
        assert steps < steps_max
    return steps


@pytest.fixture
def big(tmp_path: Path):
    store = Store(str(tmp_path / "big.db"))
    store.index_build_step_rows_max = 100
    with store.write_transaction():
        store.apply_ops((USERS.to_op(),))
        store.apply_ops_batched([WriteOp("users", {"id": i, "name": f"u{i}", "karma": i % 7}) for i in range(1000)])
    yield store
    store.close()


def test_an_index_on_a_large_table_is_built_in_steps_while_writes_apply(big: Store) -> None:
    with big.write_transaction():
        big.apply_ops((BY_KARMA,))
    # The catalog has it at once (every node alike); SQLite will have it when the copy is done.
    assert big.catalog()["users"].indexes == (IndexSchema("by_karma", ("karma", "name")),)
    assert big.index_build_status() == {"users": {"rows_copied": 0, "indexes": ["by_karma"]}}
    steps = 0
    while big.index_builds():
        with big.write_transaction():
            big.index_build_step()
            # Writes and deletes land on both sides of the copy's position, and beyond the old end.
            big.apply_ops_batched(
                [
                    WriteOp("users", {"id": steps * 37 % 1000, "name": f"w{steps}", "karma": 1}),
                    DeleteOp("users", steps * 53 % 1000 + 1),
                    WriteOp("users", {"id": 1000 + steps, "name": "new", "karma": 2}),
                ]
            )
            big.apply_ops((DeleteOp("users", 1000 + steps - 1),))
        steps += 1
        assert steps < 100
    assert steps > 5
    physical = list(big.connection.execute("SELECT name, tbl_name FROM sqlite_schema WHERE type = 'index'"))
    assert ("by_karma", "users") in physical
    assert not [name for name, _ in physical if name.startswith("_mnesite_build")]
    plan = str(list(big.connection.execute("EXPLAIN QUERY PLAN SELECT id FROM users WHERE karma = 1")))
    assert "by_karma" in plan
    # The built table holds exactly what applying the same ops without any build gives.
    reference = Store(str(Path(big.path).with_name("reference.db")))
    with reference.write_transaction():
        reference.apply_ops((USERS.to_op(),))
        reference.apply_ops_batched([WriteOp("users", {"id": i, "name": f"u{i}", "karma": i % 7}) for i in range(1000)])
        for step in range(steps):
            reference.apply_ops_batched(
                [
                    WriteOp("users", {"id": step * 37 % 1000, "name": f"w{step}", "karma": 1}),
                    DeleteOp("users", step * 53 % 1000 + 1),
                    WriteOp("users", {"id": 1000 + step, "name": "new", "karma": 2}),
                ]
            )
            reference.apply_ops((DeleteOp("users", 1000 + step - 1),))
    assert _rows(big) == _rows(reference)
    reference.close()
    assert list(big.connection.execute("SELECT count(*) FROM users INDEXED BY by_karma WHERE karma >= 0")) == [
        (len(_rows(big)),)
    ]


def test_a_second_build_keeps_the_first_index_and_changes_during_builds(big: Store) -> None:
    with big.write_transaction():
        big.apply_ops((BY_KARMA,))
    _build_to_the_end(big)
    by_name = CreateIndexOp("by_name", "users", "s", ("name",))
    with big.write_transaction():
        big.apply_ops((by_name,))
    # The table keeps its index while the shadow gets both (the old one under its other physical name).
    assert "by_karma" in str(list(big.connection.execute("SELECT name FROM sqlite_schema")))
    with big.write_transaction():
        big.index_build_step()
        big.apply_ops((EMAIL, WriteOp("users", {"id": 5, "name": "five", "karma": 5, "email": "5@x"})))
    _build_to_the_end(big)
    indexes = dict(big.connection.execute("SELECT name, physical FROM _mnesite_indexes"))
    assert indexes == {"by_karma": "_mnesite_b_by_karma", "by_name": "by_name"}
    assert big.connection.execute("SELECT email FROM users WHERE id = 5").fetchone() == ("5@x",)
    assert [i.name for i in big.catalog()["users"].indexes] == ["by_karma", "by_name"]
    # Dropping an index that is being built ends its build; dropping the table ends any build.
    third = CreateIndexOp("third", "users", "s", ("email",))
    with big.write_transaction():
        big.apply_ops((third,))
        assert big.index_builds() == {"users": "_mnesite_build_users"}
        big.apply_ops((DropIndexOp("third", "users", "s"),))
    assert big.index_builds() == {}
    with big.write_transaction():
        big.apply_ops((third, DropIndexOp("by_karma", "users", "s")))
    assert big.index_builds()
    _build_to_the_end(big)
    assert dict(big.connection.execute("SELECT name, physical FROM _mnesite_indexes")) == {
        "by_name": "_mnesite_b_by_name",
        "third": "third",
    }
    with big.write_transaction():
        big.apply_ops((CreateIndexOp("fourth", "users", "s", ("karma",)), DropTableOp("users", "s")))
    assert big.index_builds() == {} and big.catalog() == {}
    assert list(big.connection.execute("SELECT name FROM sqlite_schema WHERE name LIKE '%users%'")) == []


def test_a_build_resumes_after_a_restart(big: Store) -> None:
    with big.write_transaction():
        big.apply_ops((BY_KARMA,))
    for _ in range(3):
        with big.write_transaction():
            big.index_build_step()
    path = big.path
    big.close()
    reopened = Store(path)
    reopened.index_build_step_rows_max = 100
    assert reopened.index_build_status()["users"]["rows_copied"] == 300
    before = _rows(reopened)
    assert _build_to_the_end(reopened) == 8
    assert _rows(reopened) == before and reopened.index_builds() == {}
    reopened.close()


def test_a_replay_over_a_later_copy_skips_the_changes_it_supersedes(store: Store) -> None:
    """The copy was made after: index by_karma dropped and made again on other columns, table gone."""
    with store.write_transaction():
        store.apply_ops((CreateIndexOp("by_karma", "users", "s", ("name",)),))
    replay = (
        BY_KARMA,
        EMAIL,
        DropIndexOp("by_karma", "users", "s"),
        CreateIndexOp("by_karma", "users", "s", ("name",)),
    )
    with pytest.raises(Exception, match="cannot create index"), store.write_transaction():
        store.apply_ops(replay[:1])
    with store.write_transaction():
        store.apply_ops(replay[:1], healing=True)
        store.apply_ops(replay[1:], healing=True)
    assert store.catalog()["users"].indexes == (IndexSchema("by_karma", ("name",)),)
    with store.write_transaction():
        store.apply_ops((DropTableOp("users", "s"),))
        store.apply_ops((BY_KARMA, EMAIL), healing=True)
    assert store.catalog() == {}
