"""Peer messages of ``core.consensus`` as plain msgpack-able values, and back.

A message is the list ``[CONSENSUS_WIRE_VERSION, kind, field...]``:

* ``["vote_request", generation, last_key]``
* ``["vote_reply", generation, granted]``
* ``["pre_vote_request", generation, last_key]`` and ``["pre_vote_reply", generation, granted]``
* ``["append_request", generation, prev_key, prev_digest, commit_key, members, entries, sent_ms]``
* ``["append_reply", generation, success, match_key, last_key, commit_key, request_sent_ms]``
* ``["exclusion_notice", generation, members, key, digest-or-nil]``

Tx keys are ``[generation, counter]``; entries use ``rlog.types.entry_to_wire``. Decoding anything
malformed raises ``rlog.codec.CodecError`` and nothing else (fuzzed with hypothesis). Routing by
shard and naming the sender are the transport's job.
"""

from __future__ import annotations

from typing import Any

from mnesite.core.consensus import (
    MEMBERS_MAX,
    AppendReply,
    AppendRequest,
    ExclusionNotice,
    PeerMessage,
    PreVoteReply,
    PreVoteRequest,
    VoteReply,
    VoteRequest,
)
from mnesite.rlog.codec import CodecError
from mnesite.rlog.messages import MessageError, check_name, decode_entry, wire_entry
from mnesite.rlog.types import (
    DIGEST_BYTES,
    Entry,
    OpDecodeError,
    TxKey,
    entry_to_wire,
    tx_key_from_wire,
)

# 2: entries carry their ops packed (``rlog.types.entry_to_wire``).
CONSENSUS_WIRE_VERSION = 2
# Far above any entries_per_append_max; a frame claiming more is refused before decoding entries.
APPEND_ENTRIES_WIRE_MAX = 4096
GENERATION_MAX = 2**63 - 1

_FIELD_COUNTS = {
    "vote_request": 2,
    "vote_reply": 2,
    "pre_vote_request": 2,
    "pre_vote_reply": 2,
    "append_request": 7,
    "append_reply": 6,
    "exclusion_notice": 4,
}


def message_to_wire(message: PeerMessage) -> list[Any]:
    if isinstance(message, VoteRequest):
        return [CONSENSUS_WIRE_VERSION, "vote_request", message.generation, message.last_key.to_wire()]
    if isinstance(message, VoteReply):
        return [CONSENSUS_WIRE_VERSION, "vote_reply", message.generation, message.granted]
    if isinstance(message, PreVoteRequest):
        return [CONSENSUS_WIRE_VERSION, "pre_vote_request", message.generation, message.last_key.to_wire()]
    if isinstance(message, PreVoteReply):
        return [CONSENSUS_WIRE_VERSION, "pre_vote_reply", message.generation, message.granted]
    if isinstance(message, AppendRequest):
        return [
            CONSENSUS_WIRE_VERSION,
            "append_request",
            message.generation,
            message.prev_key.to_wire(),
            message.prev_digest,
            message.commit_key.to_wire(),
            list(message.members),
            [entry_to_wire(entry) for entry in message.entries],
            message.sent_ms,
        ]
    if isinstance(message, AppendReply):
        return [
            CONSENSUS_WIRE_VERSION,
            "append_reply",
            message.generation,
            message.success,
            message.match_key.to_wire(),
            message.last_key.to_wire(),
            message.commit_key.to_wire(),
            message.request_sent_ms,
        ]
    if isinstance(message, ExclusionNotice):
        return [
            CONSENSUS_WIRE_VERSION,
            "exclusion_notice",
            message.generation,
            list(message.members),
            message.key.to_wire(),
            message.digest,
        ]
    raise TypeError(f"not a consensus peer message: {message!r}")


def message_from_wire(value: Any) -> PeerMessage:
    """Inverse of ``message_to_wire``; raises ``CodecError`` on anything else."""
    if not isinstance(value, (list, tuple)) or len(value) < 2:
        raise CodecError("consensus message must be [version, kind, ...]")
    version, kind = value[0], value[1]
    if not _is_int(version) or version != CONSENSUS_WIRE_VERSION:
        raise CodecError(f"consensus wire version {version!r:.40} is not supported", "unsupported_version")
    if not isinstance(kind, str) or kind not in _FIELD_COUNTS:
        raise CodecError(f"unknown consensus message kind {kind!r:.40}", "unknown_kind")
    fields = value[2:]
    if len(fields) != _FIELD_COUNTS[kind]:
        raise CodecError(f"{kind} must have {_FIELD_COUNTS[kind]} fields, got {len(fields)}")
    generation = _generation(fields[0])
    if kind == "vote_request":
        return VoteRequest(generation, _tx_key(fields[1]))
    if kind == "vote_reply":
        return VoteReply(generation, _bool(fields[1]))
    if kind == "pre_vote_request":
        return PreVoteRequest(generation, _tx_key(fields[1]))
    if kind == "pre_vote_reply":
        return PreVoteReply(generation, _bool(fields[1]))
    if kind == "append_request":
        prev_key, prev_digest, commit_key, members, entries, sent_ms = fields[1:]
        if not isinstance(prev_digest, bytes) or len(prev_digest) != DIGEST_BYTES:
            raise CodecError(f"prev_digest must be {DIGEST_BYTES} bytes")
        return AppendRequest(
            generation,
            _tx_key(prev_key),
            prev_digest,
            _tx_key(commit_key),
            _members(members),
            _entries(entries),
            _time_ms(sent_ms),
        )
    if kind == "exclusion_notice":
        members, key, digest = fields[1:]
        if digest is not None and (not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES):
            raise CodecError(f"digest must be {DIGEST_BYTES} bytes or nil")
        return ExclusionNotice(generation, _members(members), _tx_key(key), digest)
    success, match_key, last_key, commit_key, request_sent_ms = fields[1:]
    return AppendReply(
        generation,
        _bool(success),
        _tx_key(match_key),
        _tx_key(last_key),
        _tx_key(commit_key),
        _time_ms(request_sent_ms),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _generation(value: Any) -> int:
    if not _is_int(value) or not 0 <= value <= GENERATION_MAX:
        raise CodecError("generation must be a non-negative 64-bit integer")
    return value


def _time_ms(value: Any) -> int:
    # A monotonic clock reading of the sequencer (the receiver also clamps it to its own clock).
    if not _is_int(value) or not 0 <= value <= GENERATION_MAX:
        raise CodecError("a time must be a non-negative 64-bit integer of milliseconds")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CodecError("flag must be a boolean")
    return value


def _tx_key(value: Any) -> TxKey:
    try:
        key = tx_key_from_wire(value)
    except OpDecodeError as error:
        raise CodecError(str(error)[:200]) from None
    if key.generation > GENERATION_MAX or key.counter > GENERATION_MAX:
        raise CodecError("tx key parts must fit in 64 bits")
    return key


def _members(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not 0 < len(value) <= MEMBERS_MAX:
        raise CodecError(f"members must be a list of 1..{MEMBERS_MAX} names")
    for name in value:
        if not check_name(name):
            raise CodecError("member names must be names (rlog.messages.NAME_PATTERN)")
    return tuple(value)


def _entries(value: Any) -> tuple[Entry, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > APPEND_ENTRIES_WIRE_MAX:
        raise CodecError(f"entries must be a list of at most {APPEND_ENTRIES_WIRE_MAX}")
    entries = []
    for index, item in enumerate(value):
        try:
            # The wire's entry type: bounded names and keys, a 32-byte digest, canonical packed ops.
            entries.append(decode_entry(wire_entry(item)))
        except MessageError as error:
            raise CodecError(f"append_request.entries[{index}]: {str(error)[:300]}") from None
    return tuple(entries)
