"""Wire codec: a frame is the msgpack array ``[version, kind, request_id, body]``.

``version`` is ``PROTOCOL_VERSION``; ``kind`` one of ``KINDS`` (``rlog.messages``); ``request_id`` pairs
a reply with its request and makes a retried write idempotent; ``body`` is decoded once, straight into
its kind's Struct. Decoding raises ``CodecError`` and nothing else, and never pickles (no ext types).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
from mnesite.rlog import messages

PROTOCOL_VERSION = 1
FRAME_BYTES_MAX_DEFAULT = 4 * 1024 * 1024
KINDS = messages.SCHEMAS


CodecError = messages.MessageError  # a frame could not be decoded; ``code`` is the error code to answer with


@dataclass(frozen=True)
class Message:
    """``body``: its kind's Struct once decoded; a sender may give a dict (checked only if asked)."""

    kind: str
    request_id: str
    body: Any = field(default_factory=dict)


_HEADER = msgspec.msgpack.Decoder(tuple[Any, Any, Any, msgspec.Raw], ext_hook=messages.refuse_ext)
_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Message, check: bool = False) -> bytes:
    """Encode a message; raises ``CodecError`` if it cannot be represented, or, with ``check``
    (clients), if the receiver's schema would refuse it."""
    try:
        body = _ENCODER.encode(message.body)
    except (TypeError, ValueError, OverflowError) as error:
        if check and message.kind in KINDS:  # an integer beyond 64 bits: the schema's checks name the field
            messages.decode_body(message.kind, message.body)
        raise CodecError(f"cannot encode {message.kind}: {error}") from None
    if check:
        check_header(message.kind, message.request_id)
        messages.decode_body(message.kind, body)
    return _ENCODER.encode((PROTOCOL_VERSION, message.kind, message.request_id, msgspec.Raw(body)))


def decode(frame: bytes, frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT) -> Message:
    """Decode one frame. Anything malformed raises ``CodecError``, nothing else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise CodecError("frame must be bytes")
    if len(frame) > frame_bytes_max:
        raise CodecError(f"frame of {len(frame)} bytes exceeds frame_bytes_max {frame_bytes_max}", "frame_too_large")
    deep = False
    try:
        version, kind, request_id, body = _HEADER.decode(frame)
    except msgspec.ValidationError:
        raise CodecError("frame must be [version, kind, request_id, body]") from None
    except msgspec.DecodeError as error:
        raise CodecError(f"malformed msgpack frame: {type(error).__name__}") from None
    except UnicodeDecodeError:  # msgspec raises it, not a DecodeError, for a string that is not UTF-8
        raise CodecError("malformed msgpack frame: a string is not UTF-8") from None
    except RecursionError:  # deeper than msgspec recurses: unpacked by msgpack (in C) to name the field
        try:
            version, kind, request_id, body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception as error:  # garbage, or not 4 items (msgpack raises many types): all the same here
            raise CodecError(f"malformed msgpack frame: {type(error).__name__}") from None
        deep = True
    if type(version) is not int:
        raise CodecError("protocol version must be an integer")
    if version != PROTOCOL_VERSION:
        message = f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})"
        raise CodecError(message, "unsupported_version")
    check_header(kind, request_id)
    if deep:
        raise CodecError(f"{_deep_path(kind, body)}: is nested deeper than the decoder allows")
    return Message(kind, request_id, messages.decode_body(kind, body))


def _deep_path(kind: str, body: Any) -> str:
    """The path of the field nested deeper than a free value may be, walked with an explicit stack;
    indices only between fields (``ops[0].key``)."""
    stack: list[tuple[Any, str, int]] = [(body, kind, 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > messages.FREE_VALUE_DEPTH_MAX:
            return path
        if isinstance(value, dict):
            stack.extend((item, f"{path}.{str(key)[:64]}", depth + 1) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend(
                (item, f"{path}[{i}]" if type(item) is dict else path, depth + 1) for i, item in enumerate(value)
            )
    return kind


def check_header(kind: Any, request_id: Any) -> None:
    if type(kind) is not str:
        raise CodecError("message kind must be a string")
    if kind not in KINDS:
        raise CodecError(f"unknown message kind {kind!r:.40}", "unknown_kind")
    if type(request_id) is not str or not 0 < len(request_id) <= messages.REQUEST_ID_CHARS_MAX:
        raise CodecError(f"request_id must be a string of 1..{messages.REQUEST_ID_CHARS_MAX} characters")


def reply(request_id: str, result: Any = None) -> Message:
    return Message("reply", request_id, messages.Reply(result=result))


def error(request_id: str, code: str, message: str, detail: Any = None) -> Message:
    return Message("error", request_id, messages.Error(code=code, message=message, detail=detail))
