"""Peer messages of ``core.consensus`` on the wire: one msgspec type per kind, in the wire's schema.

A message is the array ``[CONSENSUS_WIRE_VERSION, kind, field...]``, its fields in the order of the
``core.consensus`` message's own fields:

* ``vote_request`` / ``pre_vote_request``: generation, last_key
* ``vote_reply`` / ``pre_vote_reply``: generation, granted
* ``append_request``: generation, prev_key, prev_digest, commit_key, members, entries, sent_ms
* ``append_reply``: generation, success, match_key, last_key, commit_key, request_sent_ms
* ``exclusion_notice``: generation, members, key, digest-or-nil

Tx keys are ``[generation, counter]`` (``rlog.types.TxKey``, bounded to 64 bits), names follow the
wire's one name rule and entries are ``rlog.messages.WireEntry`` (ops packed, decoded and checked
by ``decode_entry``). msgspec checks every field of a kind's type in C; decoding anything malformed
raises ``rlog.codec.CodecError`` and nothing else (fuzzed with hypothesis). Routing by shard and
naming the sender are the transport's job (the ``peer`` kind of ``rlog.messages``).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import msgspec
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
from mnesite.rlog.messages import Digest, MessageError, Name, NonNegative, WireEntry, body_error, decode_entries
from mnesite.rlog.types import TxKey, entry_to_wire
from msgspec import Meta, Struct

# 2: entries carry their ops packed (``rlog.types.entry_to_wire``).
CONSENSUS_WIRE_VERSION = 2
# Far above any entries_per_append_max; a frame claiming more is refused before decoding entries.
APPEND_ENTRIES_WIRE_MAX = 4096

Version = Literal[2]
Members = Annotated[tuple[Name, ...], Meta(min_length=1, max_length=MEMBERS_MAX)]


class _Wire(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    version: Version
    kind: str


class _Vote(_Wire, frozen=True):
    generation: NonNegative
    last_key: TxKey


class _Granted(_Wire, frozen=True):
    generation: NonNegative
    granted: bool


class _Append(_Wire, frozen=True):
    generation: NonNegative
    prev_key: TxKey
    prev_digest: Digest
    commit_key: TxKey
    members: Members
    entries: Annotated[list[WireEntry], Meta(max_length=APPEND_ENTRIES_WIRE_MAX)]
    sent_ms: NonNegative  # the sequencer's monotonic clock (the receiver clamps it to its own)


class _AppendReply(_Wire, frozen=True):
    generation: NonNegative
    success: bool
    match_key: TxKey
    last_key: TxKey
    commit_key: TxKey
    request_sent_ms: NonNegative


class _Exclusion(_Wire, frozen=True):
    generation: NonNegative
    members: Members
    key: TxKey
    digest: Digest | None


# kind -> (the consensus message, its wire type)
KINDS: dict[str, tuple[type, type[_Wire]]] = {
    "vote_request": (VoteRequest, _Vote),
    "vote_reply": (VoteReply, _Granted),
    "pre_vote_request": (PreVoteRequest, _Vote),
    "pre_vote_reply": (PreVoteReply, _Granted),
    "append_request": (AppendRequest, _Append),
    "append_reply": (AppendReply, _AppendReply),
    "exclusion_notice": (ExclusionNotice, _Exclusion),
}
_KIND_OF = {message: kind for kind, (message, _) in KINDS.items()}
_DECODERS = {kind: msgspec.msgpack.Decoder(wire_type) for kind, (_, wire_type) in KINDS.items()}


class _Head(Struct, frozen=True, array_like=True):
    """The first two fields of any message (the rest is skipped): its version and kind."""

    version: Any
    kind: Any


_HEAD = msgspec.msgpack.Decoder(_Head)


def message_to_wire(message: PeerMessage) -> list[Any]:
    kind = _KIND_OF.get(type(message))
    if kind is None:
        raise TypeError(f"not a consensus peer message: {message!r}")
    fields = [getattr(message, field.name) for field in dataclasses.fields(message)]
    if kind == "append_request":
        fields[5] = [entry_to_wire(entry) for entry in fields[5]]
    return [CONSENSUS_WIRE_VERSION, kind, *fields]


def message_from_wire(value: Any) -> PeerMessage:
    """Inverse of ``message_to_wire``: of its msgpack bytes (a ``peer`` frame's ``message``, decoded
    once, by its kind's type) or of the unpacked list; raises ``CodecError`` on anything else."""
    packed = isinstance(value, (bytes, bytearray, memoryview, msgspec.Raw))
    try:
        head = _HEAD.decode(value) if packed else _Head(*value[:2])
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError, TypeError):
        raise CodecError("consensus message must be [version, kind, ...]") from None
    if head.version != CONSENSUS_WIRE_VERSION or type(head.version) is not int:
        raise CodecError(f"consensus wire version {head.version!r:.40} is not supported", "unsupported_version")
    kind = head.kind
    if type(kind) is not str or kind not in KINDS:
        raise CodecError(f"unknown consensus message kind {kind!r:.40}", "unknown_kind")
    message_type, wire_type = KINDS[kind]
    try:
        wire = _DECODERS[kind].decode(value) if packed else msgspec.convert(value, wire_type)
        fields = list(msgspec.structs.astuple(wire)[2:])
        if kind == "append_request":
            fields[5] = decode_entries(wire.entries)
    except msgspec.ValidationError as error:
        raise CodecError(str(body_error(kind, error))[:400]) from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        raise CodecError(f"{kind}: malformed msgpack") from None
    except MessageError as error:
        raise CodecError(f"{kind}.entries: {str(error)[:300]}") from None
    return message_type(*fields)
