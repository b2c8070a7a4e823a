"""Wire codec: msgpack frames with an explicit protocol version and message kind.

A frame is the msgpack array ``[version, kind, request_id, body]``:

* ``version``: ``PROTOCOL_VERSION``; other versions are refused with a clear reason.
* ``kind``: one of ``KINDS``; ``rlog.messages`` holds each kind's schema (types, ranges, lengths, depth).
* ``request_id``: a client-chosen string (at most 64 characters). It pairs a reply with
  its request and, for writes, makes a retried request idempotent.
* ``body``: a map from field name to value, checked against the kind's schema and also given as a
  frozen dataclass (``Message.fields``).

Decoding never raises anything but ``CodecError`` (fuzzed with hypothesis), and never
pickles: msgpack extension types are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
from mnesite.rlog import messages

PROTOCOL_VERSION = 1
FRAME_BYTES_MAX_DEFAULT = 4 * 1024 * 1024
REQUEST_ID_CHARS_MAX = messages.REQUEST_ID_CHARS_MAX


class CodecError(ValueError):
    """A frame could not be decoded. ``code`` is the error code to answer with."""

    def __init__(self, message: str, code: str = "bad_frame") -> None:
        super().__init__(message)
        self.code = code


# One schema entry per kind lives in ``rlog.messages``; this is the set of kinds it knows.
KINDS = messages.SCHEMAS


@dataclass(frozen=True)
class Message:
    kind: str
    request_id: str
    body: dict[str, Any] = field(default_factory=dict)
    # The body as its kind's frozen dataclass (``rlog.messages``); set by ``decode``.
    fields: Any = field(default=None, compare=False, repr=False)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise CodecError(f"msgpack extension type {code} is not allowed")


def encode(message: Message) -> bytes:
    """Encode a message; raises ``CodecError`` if it cannot be represented."""
    check_message(message)
    try:
        return msgpack.packb(
            [PROTOCOL_VERSION, message.kind, message.request_id, message.body],
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError) as error:
        raise CodecError(f"cannot encode {message.kind}: {error}") from None


def decode(frame: bytes, frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT) -> Message:
    """Decode one frame. Anything malformed raises ``CodecError``, nothing else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise CodecError("frame must be bytes")
    if len(frame) > frame_bytes_max:
        raise CodecError(f"frame of {len(frame)} bytes exceeds frame_bytes_max {frame_bytes_max}", "frame_too_large")
    try:
        value = msgpack.unpackb(
            bytes(frame),
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            use_list=True,
        )
    except CodecError:
        raise
    except Exception as error:  # msgpack raises many types for garbage; all mean the same here.
        raise CodecError(f"malformed msgpack frame: {type(error).__name__}") from None
    if not isinstance(value, list) or len(value) != 4:
        raise CodecError("frame must be [version, kind, request_id, body]")
    version, kind, request_id, body = value
    if not isinstance(version, int) or isinstance(version, bool):
        raise CodecError("protocol version must be an integer")
    if version != PROTOCOL_VERSION:
        raise CodecError(
            f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})",
            "unsupported_version",
        )
    message = Message(kind, request_id, body) if isinstance(kind, str) else None
    if message is None:
        raise CodecError("message kind must be a string")
    return Message(kind, request_id, body, check_message(message))


def check_message(message: Message) -> Any:
    """Check a message against its kind's schema; return the body's frozen dataclass."""
    if message.kind not in KINDS:
        raise CodecError(f"unknown message kind {message.kind!r:.40}", "unknown_kind")
    if not isinstance(message.request_id, str) or not 0 < len(message.request_id) <= REQUEST_ID_CHARS_MAX:
        raise CodecError(f"request_id must be a string of 1..{REQUEST_ID_CHARS_MAX} characters")
    try:
        return messages.check_body(message.kind, message.body)[1]
    except messages.MessageError as error:
        raise CodecError(str(error), error.code) from None


def reply(request_id: str, result: Any = None) -> Message:
    return Message("reply", request_id, {"result": result})


def error(request_id: str, code: str, message: str, detail: Any = None) -> Message:
    body: dict[str, Any] = {"code": code, "message": message}
    if detail is not None:
        body["detail"] = detail
    return Message("error", request_id, body)
