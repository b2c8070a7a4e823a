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
REQUEST_ID_CHARS_MAX = messages.REQUEST_ID_CHARS_MAX
KINDS = messages.SCHEMAS


class CodecError(ValueError):
    """A frame could not be decoded. ``code`` is the error code to answer with."""

    def __init__(self, message: str, code: str = "bad_frame") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Message:
    """``body``: its kind's Struct once decoded; a sender may give a dict (checked only if asked)."""

    kind: str
    request_id: str
    body: Any = field(default_factory=dict)


def _refuse_ext(code: int, data: memoryview) -> Any:
    raise CodecError(f"msgpack extension type {code} is not allowed")


_HEADER = msgspec.msgpack.Decoder(tuple[Any, Any, Any, msgspec.Raw], ext_hook=_refuse_ext)
_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Message, check: bool = False) -> bytes:
    """Encode a message; raises ``CodecError`` if it cannot be represented, or, with ``check``
    (clients), if the receiver's schema would refuse it."""
    try:
        body = _ENCODER.encode(message.body)
    except (TypeError, ValueError, OverflowError) as error:
        if check and message.kind in KINDS:  # an integer beyond 64 bits: the schema's checks name the field
            try:
                msgspec.convert(message.body, KINDS[message.kind].body).verify()
            except msgspec.ValidationError as refusal:
                raise CodecError(str(messages.body_error(message.kind, refusal))) from None
            except messages.MessageError as refusal:
                raise CodecError(f"{message.kind}.{refusal}", refusal.code) from None
        raise CodecError(f"cannot encode {message.kind}: {error}") from None
    if check:
        check_header(message.kind, message.request_id)
        try:
            messages.decode_body(message.kind, body)
        except messages.MessageError as error:
            raise CodecError(str(error), error.code) from None
    return _ENCODER.encode((PROTOCOL_VERSION, message.kind, message.request_id, msgspec.Raw(body)))


def decode(frame: bytes, frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT) -> Message:
    """Decode one frame. Anything malformed raises ``CodecError``, nothing else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise CodecError("frame must be bytes")
    if len(frame) > frame_bytes_max:
        raise CodecError(f"frame of {len(frame)} bytes exceeds frame_bytes_max {frame_bytes_max}", "frame_too_large")
    try:
        version, kind, request_id, body = _HEADER.decode(frame)
    except CodecError:
        raise
    except msgspec.ValidationError:
        raise CodecError("frame must be [version, kind, request_id, body]") from None
    except msgspec.DecodeError as error:
        raise CodecError(f"malformed msgpack frame: {type(error).__name__}") from None
    except UnicodeDecodeError:  # msgspec raises it, not a DecodeError, for a string that is not UTF-8
        raise CodecError("malformed msgpack frame: a string is not UTF-8") from None
    except RecursionError:  # a body deeper than msgspec's skip recursion: split off without recursion
        version, kind, request_id, body = _split_deep_frame(frame)
    if type(version) is not int:
        raise CodecError("protocol version must be an integer")
    if version != PROTOCOL_VERSION:
        message = f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})"
        raise CodecError(message, "unsupported_version")
    check_header(kind, request_id)
    try:
        return Message(kind, request_id, messages.decode_body(kind, body))
    except messages.MessageError as error:
        raise CodecError(str(error), error.code) from None


def _split_deep_frame(frame: bytes | bytearray | memoryview) -> tuple[Any, Any, Any, memoryview]:
    """The header read by msgpack's streaming unpacker (scalars, or refused), the body left as bytes
    so that its refusal can still name the field too deep."""
    unpacker = msgpack.Unpacker(raw=False, ext_hook=_refuse_ext, max_buffer_size=len(frame))
    unpacker.feed(frame)
    try:
        if unpacker.read_array_header() != 4:
            raise CodecError("frame must be [version, kind, request_id, body]")
        header = tuple(unpacker.unpack() for _ in range(3))
    except CodecError:
        raise
    except Exception as error:  # msgpack raises many types for garbage; all mean the same here.
        raise CodecError(f"malformed msgpack frame: {type(error).__name__}") from None
    return (*header, memoryview(frame)[unpacker.tell() :])


def check_header(kind: Any, request_id: Any) -> None:
    if type(kind) is not str:
        raise CodecError("message kind must be a string")
    if kind not in KINDS:
        raise CodecError(f"unknown message kind {kind!r:.40}", "unknown_kind")
    if type(request_id) is not str or not 0 < len(request_id) <= REQUEST_ID_CHARS_MAX:
        raise CodecError(f"request_id must be a string of 1..{REQUEST_ID_CHARS_MAX} characters")


def reply(request_id: str, result: Any = None) -> Message:
    return Message("reply", request_id, messages.Reply(result=result))


def error(request_id: str, code: str, message: str, detail: Any = None) -> Message:
    return Message("error", request_id, messages.Error(code=code, message=message, detail=detail))
