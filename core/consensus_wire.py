"""Peer messages of ``core.consensus`` on the wire (a ``peer`` frame's ``message``): the array
``[CONSENSUS_WIRE_VERSION, kind, field...]``, the message's fields in order, each of its name's wire type
(``FIELD_TYPES``), checked by msgspec in C. Anything malformed raises ``MessageError``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

import msgspec
from mnesite.core import consensus
from mnesite.rlog.messages import Digest, MessageError, NonNegative, WireEntry, decode_entry, typed
from mnesite.rlog.types import Name, TxKey
from msgspec import Meta

CONSENSUS_WIRE_VERSION = 2  # 2: entries carry their ops packed (``rlog.types.Entry.to_wire``)
APPEND_ENTRIES_WIRE_MAX = 4096  # far above any entries_per_append_max: more is refused before decoding
# fmt: off
FIELD_TYPES: dict[str, Any] = {  # a consensus message's field -> its wire type
    **dict.fromkeys(("generation", "sent_ms", "request_sent_ms"), NonNegative),  # sent_ms: the sequencer's clock
    **dict.fromkeys(("last_key", "prev_key", "commit_key", "match_key", "key"), TxKey),
    "granted": bool, "success": bool, "prev_digest": Digest, "digest": Digest | None,
    "members": Annotated[tuple[Name, ...], Meta(min_length=1, max_length=consensus.MEMBERS_MAX)],
    "entries": Annotated[list[WireEntry], Meta(max_length=APPEND_ENTRIES_WIRE_MAX)],
}
# fmt: on


def _wire_type(message: type) -> Any:  # the array [version, kind, field...] of a consensus message
    fields = [(field.name, FIELD_TYPES[field.name]) for field in dataclasses.fields(message)]
    fields = [("version", Literal[CONSENSUS_WIRE_VERSION]), ("kind", str), *fields]
    return msgspec.defstruct(f"{message.__name__}Wire", fields, array_like=True, forbid_unknown_fields=True)


# kind (VoteRequest: vote_request) -> (message type, decoder of its wire type)
KINDS = {
    re.sub(r"(?<!^)(?=[A-Z])", "_", message.__name__).lower(): (message, msgspec.msgpack.Decoder(_wire_type(message)))
    for message in consensus.PeerMessage.__args__
}
_KIND_OF = {message: kind for kind, (message, _) in KINDS.items()}
_HEAD = msgspec.msgpack.Decoder(msgspec.defstruct("Head", [("version", Any), ("kind", Any)], array_like=True))
_ENCODER = msgspec.msgpack.Encoder()


def message_to_wire(message: consensus.PeerMessage) -> list[Any]:
    kind = _KIND_OF[type(message)]  # a KeyError for anything that is not a peer message
    fields = [getattr(message, field.name) for field in dataclasses.fields(message)]
    if kind == "append_request":
        fields[5] = [entry.to_wire() for entry in fields[5]]
    return [CONSENSUS_WIRE_VERSION, kind, *fields]


def message_from_wire(value: Any) -> consensus.PeerMessage:
    """Inverse of ``message_to_wire``, of its msgpack bytes or the unpacked list; else raises ``MessageError``."""
    try:
        packed = value if isinstance(value, (bytes, bytearray, memoryview, msgspec.Raw)) else _ENCODER.encode(value)
        version, kind = msgspec.structs.astuple(_HEAD.decode(packed))
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, TypeError, OverflowError):
        raise MessageError("consensus message must be [version, kind, ...]") from None
    if version != CONSENSUS_WIRE_VERSION or type(version) is not int:
        raise MessageError(f"consensus wire version {version!r:.40} is not supported", "unsupported_version")
    if type(kind) is not str or kind not in KINDS:
        raise MessageError(f"unknown consensus message kind {kind!r:.40}", "unknown_kind")
    message_type, decoder = KINDS[kind]
    fields = list(msgspec.structs.astuple(typed(kind, decoder.decode, packed))[2:])
    if kind == "append_request":
        fields[5] = typed(f"{kind}.entries", lambda wire: tuple(map(decode_entry, wire)), fields[5])
    return message_type(*fields)
