"""Round trips of consensus peer messages, and garbage only ever raising MessageError."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mnesite.core.consensus import (
    AppendReply,
    AppendRequest,
    ExclusionNotice,
    PreVoteReply,
    PreVoteRequest,
    VoteReply,
    VoteRequest,
)
from mnesite.core.consensus_wire import CONSENSUS_WIRE_VERSION, message_from_wire, message_to_wire
from mnesite.rlog.messages import MessageError
from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, CreateTableOp, DeleteOp, TxKey, WriteOp, make_entry

from tests.conftest import examples_by_lane

FIRST = make_entry("s", TxKey(1, 1), ZERO_KEY, GENESIS_DIGEST, (WriteOp("t", {"k": 1, "v": b"x"}),), "w1")
SECOND = make_entry(
    "s", TxKey(1, 2), FIRST.tx_key, FIRST.digest, (DeleteOp("t", 1), CreateTableOp("u", "s", "k", (("k", "int"),)))
)
MESSAGES = [
    VoteRequest(3, TxKey(2, 7)),
    VoteReply(3, True),
    VoteReply(0, False),
    PreVoteRequest(4, TxKey(3, 2)),
    PreVoteReply(4, True),
    AppendRequest(2, TxKey(1, 0), GENESIS_DIGEST, TxKey(1, 1), ("a", "b", "c"), (FIRST, SECOND)),
    AppendRequest(2, TxKey(1, 2), SECOND.digest, ZERO_KEY, ("a",), ()),
    AppendReply(4, False, ZERO_KEY, TxKey(3, 9), TxKey(3, 1)),
    AppendReply(4, True, TxKey(3, 9), TxKey(3, 9), TxKey(3, 1), 987_654),
    AppendRequest(2, TxKey(1, 2), SECOND.digest, ZERO_KEY, ("a",), (), 123_456),
    ExclusionNotice(9, ("a",), TxKey(3, 9), SECOND.digest),
    ExclusionNotice(9, ("a", "b"), ZERO_KEY, None),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_through_msgpack(message):
    frame = msgpack.packb(message_to_wire(message), use_bin_type=True)
    assert message_from_wire(msgpack.unpackb(frame, raw=False)) == message


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        [CONSENSUS_WIRE_VERSION],
        [CONSENSUS_WIRE_VERSION + 1, "vote_reply", 1, True],
        [CONSENSUS_WIRE_VERSION, "nope", 1, True],
        [CONSENSUS_WIRE_VERSION, "vote_reply", 1],
        [CONSENSUS_WIRE_VERSION, "vote_reply", -1, True],
        [CONSENSUS_WIRE_VERSION, "vote_reply", True, True],
        [CONSENSUS_WIRE_VERSION, "vote_reply", 1, 1],
        [CONSENSUS_WIRE_VERSION, "vote_request", 1, [1]],
        [CONSENSUS_WIRE_VERSION, "vote_request", 2**64, [1, 1]],
        [CONSENSUS_WIRE_VERSION, "append_request", 1, [0, 0], b"short", [0, 0], ["a"], [], 0],
        [CONSENSUS_WIRE_VERSION, "append_request", 1, [0, 0], GENESIS_DIGEST, [0, 0], [], [], 0],
        [CONSENSUS_WIRE_VERSION, "append_request", 1, [0, 0], GENESIS_DIGEST, [0, 0], ["a"], [["bad"]], 0],
        [CONSENSUS_WIRE_VERSION, "append_request", 1, [0, 0], GENESIS_DIGEST, [0, 0], ["a"], [None] * 5000, 0],
        [CONSENSUS_WIRE_VERSION, "append_request", 1, [0, 0], GENESIS_DIGEST, [0, 0], ["a"], [], -1],
        [CONSENSUS_WIRE_VERSION, "append_reply", 1, True, [0, 0], [0, 0], [0, 0], "soon"],
        [CONSENSUS_WIRE_VERSION, "pre_vote_request", 1, [1]],
        [CONSENSUS_WIRE_VERSION, "pre_vote_reply", 1, "yes"],
        [CONSENSUS_WIRE_VERSION, "exclusion_notice", 1, ["a"], [0, 0], b"short"],
        [CONSENSUS_WIRE_VERSION, "exclusion_notice", 1, [], [0, 0], None],
        [CONSENSUS_WIRE_VERSION, "exclusion_notice", 1, ["a"], [0, 0]],
    ],
)
def test_malformed_messages_raise_codec_error(value):
    with pytest.raises(MessageError):
        message_from_wire(value)


_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
_scalars = _scalars | st.binary(max_size=40)
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=8) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=40,
)


@pytest.mark.timeout(60)
@examples_by_lane(400, _values)
def test_arbitrary_values_only_raise_codec_error(value):
    with contextlib.suppress(MessageError):
        message_from_wire(value)


@pytest.mark.timeout(60)
@examples_by_lane(400, st.sampled_from(MESSAGES), st.data())
def test_mutated_valid_messages_decode_or_raise_codec_error(message, data):
    wire = message_to_wire(message)
    position = data.draw(st.integers(0, len(wire) - 1))
    wire[position] = data.draw(_values)
    try:
        decoded = message_from_wire(wire)
    except MessageError:
        return
    # Compared as the bytes that travel: a tx key goes out as a tuple and may come in as a list.
    assert msgpack.packb(message_to_wire(decoded)) == msgpack.packb(wire)


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_frames_unpacked_then_decoded_only_raise_codec_error(frame):
    try:
        value = msgpack.unpackb(frame, raw=False)
    except Exception:  # msgpack's own errors belong to the frame codec, not to this module
        return
    with contextlib.suppress(MessageError):
        message_from_wire(value)


# The bytes release 0.1.0 sends (computed with its consensus_wire): a later release must send and
# read exactly these, or a rolling upgrade breaks between a new and an old core.
V0_1_0_FRAMES = {
    0: "9402ac766f74655f7265717565737403920207",
    5: (
        "9902ae617070656e645f7265717565737402920100c420000000000000000000000000000000000000000000000000000000"
        "000000000092010193a161a162a1639296a173920101920000c4206b0e6832ad60504c109f7d72625cd6b7aa65474abb8afa"
        "7557b3c54b311c4a81c4119193a177a1749292a16b0192a176c40178a2773196a173920102920101c420b45045a6b8dcb5e8"
        "22f95eaab77d02b0a3342180b398b28933dcf657f3555d5ec4189293a164a1740195a163a175a173a16b9192a16ba3696e74"
        "c000"
    ),
    8: "9802ac617070656e645f7265706c7904c3920309920309920301ce000f1206",
    11: "9602b06578636c7573696f6e5f6e6f746963650992a161a162920000c0",
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("index", sorted(V0_1_0_FRAMES))
def test_the_wire_bytes_are_those_of_release_0_1_0(index):
    frame = bytes.fromhex(V0_1_0_FRAMES[index])
    assert msgpack.packb(message_to_wire(MESSAGES[index]), use_bin_type=True) == frame
    assert message_from_wire(msgpack.unpackb(frame, raw=False)) == MESSAGES[index]


# A node decodes a peer frame's message from its msgpack bytes (``Peer.message`` is left raw): the
# same messages, refusals and hostile inputs, on that path.


@pytest.mark.timeout(10)
@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_from_their_packed_bytes(message):
    assert message_from_wire(msgpack.packb(message_to_wire(message), use_bin_type=True)) == message


@pytest.mark.timeout(10)
def test_packed_bytes_that_are_not_a_message_raise_codec_error():
    hostile = [
        b"",
        b"\xc1",  # never used in msgpack
        b"\x91" * 1010 + b"\xc0",  # nested 1,010 levels
        msgpack.packb([CONSENSUS_WIRE_VERSION, "vote_reply", 1, True, "extra"]),
        msgpack.packb([CONSENSUS_WIRE_VERSION, "vote_reply", 1]),
        msgpack.packb([CONSENSUS_WIRE_VERSION, "vote_request", 1, [1, 2**64 - 1]]),
        msgpack.packb([CONSENSUS_WIRE_VERSION, "append_request", 1, [0, 0], b"x" * 32, [0, 0], ["a"], [[1]] * 5000, 0]),
        b"\x94\x02\xa2\x00\x80\x01\xc3",  # a kind that is not UTF-8
    ]
    for frame in hostile:
        with pytest.raises(MessageError):
            message_from_wire(frame)


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_bytes_only_raise_codec_error(frame):
    with contextlib.suppress(MessageError):
        message_from_wire(frame)
