"""The wire codec round-trips every valid message and turns any garbage into MessageError only."""

from __future__ import annotations

import contextlib

import msgpack
import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mnesite.rlog import messages
from mnesite.rlog.messages import Message, MessageError
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ZERO_KEY,
    CreateTableOp,
    DeleteOp,
    OpDecodeError,
    TxKey,
    WriteOp,
    WriteRows,
    decode_op,
    entry_from_wire,
    make_entry,
    pack_ops,
    unpack_ops,
)

from tests.conftest import examples_by_lane

# Every property here is about what the codec accepts and means, none about its speed: no test has
# hypothesis's 200 ms deadline per example, which a loaded machine (a suite beside others on two CPUs)
# overran by descheduling the test, and failed the suite. pytest-timeout still bounds each test.
pytestmark = pytest.mark.timeout(60)

scalars = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
rows = st.dictionaries(names, scalars, max_size=5)
request_ids = st.text(min_size=1, max_size=64)


@st.composite
def transact_messages(draw) -> Message:
    ops = draw(
        st.lists(
            st.one_of(
                st.fixed_dictionaries({"op": st.just("write"), "table": names, "row": rows}),
                st.fixed_dictionaries({"op": st.just("delete"), "table": names, "key": scalars}),
            ),
            min_size=1,
            max_size=5,
        )
    )
    guards = draw(st.lists(st.fixed_dictionaries({"table": names, "key": scalars, "equals": st.none() | rows})))
    return Message("transact", draw(request_ids), {"ops": ops, "guards": guards})


@settings(deadline=None)
@given(transact_messages())
def test_transact_round_trips(message: Message) -> None:
    decoded = messages.decode(messages.encode(message))
    assert (decoded.kind, decoded.request_id) == (message.kind, message.request_id)
    assert decoded.body.ops == [
        messages.WriteRequest(table=op["table"], row=op["row"])
        if op["op"] == "write"
        else messages.DeleteRequest(table=op["table"], key=op["key"])
        for op in message.body["ops"]
    ]
    assert [(g.table, g.key, g.equals) for g in decoded.body.guards] == [
        (g["table"], g["key"], g["equals"]) for g in message.body["guards"]
    ]
    # A decoded body encodes to a frame that decodes to the same typed value.
    assert messages.decode(messages.encode(decoded)) == decoded


@settings(deadline=None)
@given(st.sampled_from(["status", "list_tables"]), request_ids)
def test_empty_body_kinds_round_trip(kind: str, request_id: str) -> None:
    message = Message(kind, request_id, {})
    assert messages.decode(messages.encode(message)) == Message(kind, request_id, messages.Empty())


@examples_by_lane(2000, st.binary(max_size=512))
@example(b"\x94\xa2\x00\x80")  # a header string of invalid UTF-8 (msgspec raises UnicodeDecodeError)
@example(b"\x94\x01\xa3get\xa1r\x81\xa5table\xa2\x00\x80")  # the same in a body's field
def test_arbitrary_bytes_only_raise_codec_error(frame: bytes) -> None:
    try:
        message = messages.decode(frame)
    except MessageError:
        return
    assert message.kind in messages.SCHEMAS


values = st.recursive(
    scalars | st.booleans(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@examples_by_lane(1000, values)
def test_arbitrary_msgpack_values_only_raise_codec_error(value) -> None:
    with contextlib.suppress(MessageError):
        messages.decode(msgpack.packb(value, use_bin_type=True))


@examples_by_lane(1000, st.sampled_from(sorted(messages.SCHEMAS)), values)
def test_well_framed_bodies_of_wrong_shape_raise_codec_error(kind: str, body) -> None:
    frame = msgpack.packb([messages.PROTOCOL_VERSION, kind, "r1", body], use_bin_type=True)
    try:
        message = messages.decode(frame)
    except MessageError:
        return
    assert message.kind == kind and isinstance(message.body, messages.SCHEMAS[kind].body)


def test_errors_name_the_problem() -> None:
    with pytest.raises(MessageError, match="version 9 is not supported") as info:
        messages.decode(msgpack.packb([9, "status", "r", {}]))
    assert info.value.code == "unsupported_version"
    with pytest.raises(MessageError, match="unknown message kind") as info:
        messages.decode(msgpack.packb([1, "launch_missiles", "r", {}]))
    assert info.value.code == "unknown_kind"
    with pytest.raises(MessageError, match=r"transact: Object missing required field `ops`"):
        messages.decode(msgpack.packb([1, "transact", "r", {}]))
    with pytest.raises(MessageError, match=r"get\.table: Expected `str`, got `int`"):
        messages.decode(msgpack.packb([1, "get", "r", {"table": 5, "key": 1}]))
    with pytest.raises(MessageError, match=r"get\.table: Expected `str` of length <= 64"):
        messages.decode(msgpack.packb([1, "get", "r", {"table": "t" * 65, "key": 1}]))
    with pytest.raises(MessageError, match="extension type"):
        messages.decode(msgpack.packb([1, "get", "r", {"table": "t", "key": msgpack.ExtType(5, b"x")}]))


def test_oversized_frames_are_refused_before_parsing() -> None:
    frame = messages.encode(Message("get", "r", {"table": "t", "key": "x" * 2000}))
    with pytest.raises(MessageError) as info:
        messages.decode(frame, frame_bytes_max=1000)
    assert info.value.code == "frame_too_large"


@settings(deadline=None)
@given(
    st.lists(
        st.one_of(
            st.builds(WriteOp, names, rows),
            st.builds(DeleteOp, names, scalars),
            st.builds(
                CreateTableOp,
                names,
                names,
                names,
                st.lists(st.tuples(names, st.sampled_from(["INTEGER", "TEXT"])), max_size=3).map(tuple),
            ),
        ),
        max_size=4,
    ),
    st.none() | request_ids,
)
def test_entries_round_trip_on_the_wire(ops, request_id) -> None:
    entry = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, ops, request_id)
    wire = msgpack.unpackb(msgpack.packb(entry.to_wire(), use_bin_type=True), raw=False)
    assert entry_from_wire(wire) == entry


@settings(deadline=None)
@given(values)
def test_garbage_entries_only_raise_op_decode_error(value) -> None:
    with contextlib.suppress(OpDecodeError):
        entry_from_wire(value)


# The fast check of a push's ops (``messages._wire_ops_well_formed``) may only say yes to what the
# generic checks accept: values near the edges of every rule, mutated one at a time.
wire_values = st.one_of(
    scalars,
    st.just(2**63),
    st.just(-(2**63) - 1),
    st.just(float("nan")),
    st.just(True),
    st.just(["k", 1]),
    st.just({"k": 1}),
    st.just("bad name!"),
    st.just(""),
    st.just("x" * 65),
)


@st.composite
def wire_ops(draw):
    ops = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["w", "d", "x", 7, "r"]))
        table = draw(st.one_of(names, wire_values))
        if kind == "d" or kind == 7:
            ops.append([kind, table, draw(wire_values)])
            continue
        if kind == "r":  # a run of rows: column names, then rows of values (or anything else)
            columns = draw(st.lists(st.one_of(names, wire_values), max_size=3))
            rows = draw(st.lists(st.one_of(st.lists(wire_values, max_size=3), wire_values), max_size=4))
            ops.append(["r", table, columns, rows])
            continue
        pairs = draw(
            st.lists(
                st.one_of(
                    st.tuples(st.one_of(names, wire_values), wire_values).map(list),
                    wire_values,
                    st.lists(names, min_size=3, max_size=3),
                ),
                max_size=4,
            )
        )
        op = [kind, table, pairs]
        if draw(st.booleans()) and draw(st.booleans()):
            op.append("extra")
        ops.append(op)
    return ops


def _reference_accepts(ops) -> bool:
    """The rules for an entry's ops in plain Python, one value at a time: what ``decode_ops`` must
    accept, no more and no less (writes, deletes and runs of rows; ``wire_ops`` makes no other kinds)."""
    import re

    def name(value):
        return type(value) is str and 0 < len(value) <= 64 and re.fullmatch(r"[A-Za-z0-9_.\-]+", value) is not None

    def scalar(value):
        if type(value) is int:
            return -(2**63) <= value < 2**63
        if type(value) is float:
            return value == value
        return value is None or type(value) in (bool, str, bytes)

    for op in ops:
        if isinstance(op, list) and len(op) == 4 and op[0] == "r":  # a run of rows: its entry's only op
            if len(ops) != 1 or not name(op[1]) or not isinstance(op[2], list) or not isinstance(op[3], list):
                return False
            columns, rows = op[2], op[3]
            if not columns or not all(map(name, columns)) or columns != sorted(set(columns)) or len(rows) < 2:
                return False
            if not all(isinstance(row, list) and len(row) == len(columns) and all(map(scalar, row)) for row in rows):
                return False
            continue
        if not isinstance(op, list) or len(op) != 3 or op[0] not in ("w", "d") or not name(op[1]):
            return False
        if op[0] == "d":
            if not scalar(op[2]):
                return False
            continue
        if not isinstance(op[2], list):
            return False
        columns = []
        for pair in op[2]:
            if not isinstance(pair, list) or len(pair) != 2 or not name(pair[0]) or not scalar(pair[1]):
                return False
            columns.append(pair[0])
        if columns != sorted(set(columns)):
            return False
    return True


@examples_by_lane(400, wire_ops())
def test_decode_ops_accepts_exactly_what_the_plain_rules_accept(ops) -> None:
    try:
        packed = msgpack.packb(ops, use_bin_type=True)
    except (OverflowError, TypeError):
        return  # not representable in msgpack: nothing can send it
    try:
        decoded = messages.decode_ops(packed)
    except messages.MessageError:
        decoded = None
    accepted = _reference_accepts(ops)
    assert (decoded is not None) == accepted, ops
    if accepted:
        assert decoded == _expected(ops)


def _expected(ops) -> tuple:
    """What accepted ops mean: a run of rows is a ``WriteOp`` a row, any other op ``decode_op``'s."""
    if len(ops) == 1 and ops[0][0] == "r":
        return tuple(WriteOp(ops[0][1], dict(zip(ops[0][2], row, strict=True))) for row in ops[0][3])
    return tuple(decode_op(op) for op in ops)


def test_a_push_with_a_malformed_row_is_refused_with_the_path_of_the_value() -> None:
    entry = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [WriteOp("t", {"k": 1})])
    wire = entry.to_wire()
    wire[4] = msgpack.packb([["w", "t", [["k", 1], ["v", float("nan")]]]], use_bin_type=True)
    body = {"shard": "default", "agent": "a", "core": "c", "entries": [wire], "committed": [1, 1]}
    body["hears_sequencer"] = True
    frame = msgpack.packb([messages.PROTOCOL_VERSION, "push", "r", body], use_bin_type=True)
    # The envelope passes the message check; the ops are checked when the entry is decoded.
    checked = messages.decode(frame).body.entries[0]
    with pytest.raises(messages.MessageError, match=r"ops: NaN cannot be stored"):
        messages.decode_entry(checked)
    wire[4] = msgpack.packb([["w", "t", [["k", 1], ["z!", 1]]]], use_bin_type=True)
    frame = msgpack.packb([messages.PROTOCOL_VERSION, "push", "r", body], use_bin_type=True)
    with pytest.raises(messages.MessageError, match=r"ops: name .z!. has characters that are not allowed"):
        messages.decode_entry(messages.decode(frame).body.entries[0])
    # Ops that are not packed bytes are refused by the message check itself.
    wire[4] = [["w", "t", [["k", 1]]]]
    frame = msgpack.packb([messages.PROTOCOL_VERSION, "push", "r", body], use_bin_type=True)
    with pytest.raises(MessageError, match=r"push\.entries\[0\]\[4\]: Expected `bytes`, got `array`"):
        messages.decode(frame)


def test_wire_entry_ops_must_be_the_canonical_packing() -> None:
    """The digest covers the packed bytes: bytes that decode to the same ops but are not what
    ``pack_ops`` makes (a larger int form, unsorted or repeated columns, float32, an extension
    type) are refused, so a digest over the received bytes is always the digest of the ops."""
    entry = make_entry("default", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, [WriteOp("t", {"a": 1, "b": 2.5})])
    wire = entry.to_wire()
    assert messages.decode_entry(msgspec.convert(wire, messages.WireEntry)) == entry
    canonical = wire[4]
    assert canonical == msgpack.packb([["w", "t", [["a", 1], ["b", 2.5]]]], use_bin_type=True)
    variants = {
        "int as uint32": canonical.replace(b"\xa1a\x01", b"\xa1a\xce\x00\x00\x00\x01"),
        "unsorted": msgpack.packb([["w", "t", [["b", 2.5], ["a", 1]]]], use_bin_type=True),
        "repeated": msgpack.packb([["w", "t", [["a", 1], ["a", 1]]]], use_bin_type=True),
        "float32": msgpack.packb([["w", "t", [["a", 1], ["b", 2.5]]]], use_bin_type=True, use_single_float=True),
        "ext": msgpack.packb([["w", "t", [["a", msgpack.ExtType(1, b"x")]]]], use_bin_type=True),
        "trailing": canonical + b"\x00",
        "not a list": msgpack.packb({"w": 1}, use_bin_type=True),
    }
    for name, packed in variants.items():
        assert packed != canonical, name
        with pytest.raises(messages.MessageError):
            messages.decode_entry(msgspec.convert([*wire[:4], packed, wire[5]], messages.WireEntry))
            pytest.fail(f"{name} was accepted")


def _free_value_reference(value, depth_max: int, items_max: int) -> bool:
    """The walk FreeValue did before its fast paths (one stack trip per value): accepted or not."""
    stack, items = [(value, 1)], 0
    while stack:
        current, depth = stack.pop()
        items += 1
        if items > items_max:
            return False
        if isinstance(current, (list, tuple, dict)):
            if depth >= depth_max:
                return False
            children = list(current.keys()) + list(current.values()) if isinstance(current, dict) else current
            stack.extend((child, depth + 1) for child in children)
        elif not (current is None or isinstance(current, (bool, int, float, str, bytes))):
            return False
    return True


free_scalars = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3), st.binary(max_size=3))
free_values = st.recursive(
    st.one_of(free_scalars, st.just(object()), st.just({"k": 1, "v": "x"})),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(st.dictionaries(st.text(max_size=2), free_scalars, max_size=3), max_size=4),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
    ),
    max_leaves=30,
)


@examples_by_lane(500, free_values, st.integers(1, 6), st.integers(1, 40))
def test_free_value_accepts_exactly_what_the_plain_walk_accepts(value, depth_max, items_max) -> None:
    accepted = messages.free_value_refusal(value, depth_max, items_max) is None
    assert accepted == _free_value_reference(value, depth_max, items_max)


def test_a_one_row_entry_is_refused_with_the_same_reason_as_a_long_one() -> None:
    # decode_ops and scalars_refusal take shortcuts for a one-row entry; the reason they give must be
    # the one the set-based checks give for the same values in a long entry.
    cases = [
        ([["k", 1], ["v", float("nan")], ["w", [1]]], "must be null"),
        ([["k", 2**63], ["v", float("nan")]], "outside SQLite's 64-bit range"),
        ([["k", 1], ["v", float("nan")]], "NaN cannot be stored"),
        ([["k", 1], ["v", {"a": 1}]], "must be null"),
        ([["v", 1], ["k", 1]], "sorted and unique"),
        ([["k", 1], ["k", 1]], "sorted and unique"),
    ]
    for pairs, reason in cases:
        for rows in (1, 9):
            packed = msgpack.packb([["w", "t", pairs]] * rows, use_bin_type=True)
            with pytest.raises(messages.MessageError, match=reason):
                messages.decode_ops(packed)
    assert messages.decode_ops(msgpack.packb([["w", "t", [["k", 1], ["v", None]]]], use_bin_type=True)) == (
        WriteOp("t", {"k": 1, "v": None}),
    )


_column_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


_column_cases = st.integers(1, 4).flatmap(
    lambda width: st.tuples(st.just(width), st.lists(_column_values, max_size=24))
)


@pytest.mark.timeout(60)
@examples_by_lane(500, _column_cases)
@example((1, [2**63]))
@example((2, [1, "a", 2**63, "b", 3, "c"]))
@example((2, [1, 1.5, 2, float("nan")]))
@example((3, [None, b"x", True, None, b"y", [1]]))
def test_the_column_wise_scalar_check_gives_the_general_rules_answer(case) -> None:
    # decode_ops checks the values of rows that share their columns a column at a time: for any values,
    # it must refuse exactly what scalars_refusal refuses, with the same reason.
    width, values = case
    values = values[: len(values) // width * width]
    assert messages.scalars_refusal(values, width) == messages.scalars_refusal(values)


def test_a_members_op_names_its_added_core_and_its_endpoint_together_or_neither() -> None:
    # A members op that adds a core carries where it listens; a half-set pair is refused in any entry.
    for added, endpoint in (("b", ""), ("", "tcp://127.0.0.1:9")):
        bad = ["m", ["a", "b"], added, endpoint]
        for ops in ([bad], [["w", "t", [["k", 1]]], bad], [["d", "t", 1], bad, ["w", "t", [["k", 2]]]]):
            with pytest.raises(messages.MessageError, match="added and endpoint must be both set or both empty"):
                messages.decode_ops(msgpack.packb(ops, use_bin_type=True))
    good = [["w", "t", [["k", 1]]], ["m", ["a", "b"], "b", "tcp://127.0.0.1:9"], ["d", "t", 3]]
    decoded = messages.decode_ops(msgpack.packb(good, use_bin_type=True))
    assert decoded == (WriteOp("t", {"k": 1}), decode_op(good[1]), decode_op(good[2]))


def _expanded(ops) -> tuple:
    """``ops`` with each ``WriteRows`` written out as the ``WriteOp`` of each of its rows."""
    return tuple(
        written
        for op in ops
        for written in (
            [WriteOp(op.table, dict(zip(op.columns, row, strict=True))) for row in op.rows]
            if type(op) is WriteRows
            else [op]
        )
    )


@st.composite
def one_table_entries(draw):
    """Entries of one table's rows, the shape a replicant decodes as a run, each maybe spoiled once: a
    row's columns swapped, lacking one, repeated, another table's, a hostile value, a delete among them,
    or a row's last column moved to the next row's start."""
    columns = sorted(draw(st.sets(names, min_size=1, max_size=4)))
    count = draw(st.integers(2, 6))
    ops = [["w", "t", [[column, draw(scalars)] for column in columns]] for _ in range(count)]
    where = draw(st.integers(0, count - 1))
    spoil = draw(st.sampled_from(["none", "swap", "lack", "repeat", "table", "value", "delete", "extra", "shift"]))
    pairs = ops[where][2]
    if spoil == "swap" and len(pairs) > 1:
        pairs[0], pairs[1] = pairs[1], pairs[0]
    elif spoil == "lack" and len(pairs) > 1:
        del pairs[-1]
    elif spoil == "repeat":
        pairs.append(list(pairs[-1]))
    elif spoil == "table":
        ops[where][1] = "u"
    elif spoil == "value":
        pairs[0][1] = draw(st.sampled_from([float("nan"), 2**63, [1], {"a": 1}]))
    elif spoil == "delete":
        ops[where] = ["d", "t", draw(scalars)]
    elif spoil == "shift" and where + 1 < count:  # the columns, all rows together, still read as the list repeated
        ops[where + 1][2].insert(0, pairs.pop())
    elif spoil == "extra":
        pairs.append(["zzzzzzzzzzzz", 1])  # sorts after every generated name: another column list
    return ops


@st.composite
def one_run_entries(draw):
    """Entries of one run of rows (a bulk write from cluster version 2 on), each maybe spoiled once: its
    columns swapped or repeated, a row short or long, a hostile value, one row only, no column, a bad
    name, another op beside it, or the run written as the writes it packs."""
    columns = sorted(draw(st.sets(names, min_size=1, max_size=4)))
    rows = [[draw(scalars) for _ in columns] for _ in range(draw(st.integers(2, 6)))]
    where = draw(st.integers(0, len(rows) - 1))
    spoil = draw(st.sampled_from(["none", "swap", "repeat", "short", "long", "value", "one", "empty", "name", "other"]))
    if spoil == "swap" and len(columns) > 1:
        columns[0], columns[1] = columns[1], columns[0]
    elif spoil == "repeat":
        columns.append(columns[-1])
        rows = [[*row, row[-1]] for row in rows]
    elif spoil == "short":
        rows[where].pop()
    elif spoil == "long":
        rows[where].append(None)
    elif spoil == "value":
        rows[where][0] = draw(st.sampled_from([float("nan"), 2**63, [1], {"a": 1}]))
    elif spoil == "one":
        rows = rows[:1]
    elif spoil == "empty":
        columns, rows = [], [[] for _ in rows]
    elif spoil == "name":
        columns[0] = draw(st.sampled_from(["bad name!", "", "x" * 65]))
    ops = [["r", "t", columns, rows]]
    if spoil == "other":
        ops.insert(draw(st.integers(0, 1)), draw(st.sampled_from([["d", "t", 1], ["w", "t", [["a", 1]]]])))
    return ops


@examples_by_lane(400, st.one_of(one_table_entries(), one_run_entries(), wire_ops()))
def test_decoding_runs_accepts_and_means_exactly_what_decoding_ops_does(ops) -> None:
    # A replicant decodes with ``runs``: a bulk write's one WriteRows stays one. The same checks must
    # refuse the same entries with the same reason, and what it keeps must be the same writes.
    try:
        packed = msgpack.packb(ops, use_bin_type=True)
    except (OverflowError, TypeError):
        return
    outcomes = []
    for runs in (False, True):
        try:
            outcomes.append(messages.decode_ops(packed, runs=runs))
        except messages.MessageError as error:
            outcomes.append(str(error))
    plain, as_runs = outcomes
    assert isinstance(plain, str) != _reference_accepts(ops), ops
    if isinstance(plain, str):
        assert as_runs == plain
        return
    assert _expanded(as_runs) == plain == _expected(ops)
    one_run = len(ops) == 1 and ops[0][0] == "r"
    assert [type(op) for op in as_runs] == ([WriteRows] if one_run else [type(op) for op in plain])
    assert unpack_ops(packed) == plain  # what the log's reader (trusted) makes of the same bytes


def test_a_bulk_write_packs_as_one_run_of_tuples_in_the_order_of_its_sorted_columns() -> None:
    writes = tuple(WriteOp("t", {"b": str(i), "a": i}) for i in range(3))
    packed = pack_ops(writes, runs=True)  # a sequencer at cluster version 2
    assert msgpack.unpackb(packed) == [["r", "t", ["a", "b"], [[0, "0"], [1, "1"], [2, "2"]]]]
    assert len(packed) < len(pack_ops(writes))  # the column names once, not per row
    assert messages.decode_ops(packed, runs=True) == (WriteRows("t", ("a", "b"), [(0, "0"), (1, "1"), (2, "2")]),)
    assert messages.decode_ops(packed) == writes == unpack_ops(packed)
    # Packed a write at a time: one write, two tables, two column lists, a delete among them, cluster version 1.
    for ops in (
        writes[:1],
        (*writes, WriteOp("u", {"a": 1})),
        (*writes, WriteOp("t", {"a": 9})),
        (*writes, DeleteOp("t", 1)),
    ):
        assert pack_ops(ops, runs=True) == pack_ops(ops)
        assert messages.decode_ops(pack_ops(ops), runs=True) == ops  # a replicant keeps a WriteOp a row
    assert [op[0] for op in msgpack.unpackb(pack_ops(writes))] == ["w", "w", "w"]
    # One column: still a tuple a row.
    single = tuple(WriteOp("t", {"a": i}) for i in range(2))
    assert messages.decode_ops(pack_ops(single, runs=True), runs=True) == (WriteRows("t", ("a",), [(0,), (1,)]),)
