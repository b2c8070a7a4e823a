"""Wire codec: msgpack frames with an explicit protocol version and message kind.

A frame is the msgpack array ``[version, kind, request_id, body]``:

* ``version``: ``PROTOCOL_VERSION``; other versions are refused with a clear reason.
* ``kind``: one of ``KINDS``; each kind declares the body fields it requires.
* ``request_id``: a client-chosen string (at most 64 characters). It pairs a reply with
  its request and, for writes, makes a retried request idempotent.
* ``body``: a map from field name to value.

Decoding never raises anything but ``CodecError`` (fuzzed with hypothesis), and never
pickles: msgpack extension types are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
FRAME_BYTES_MAX_DEFAULT = 4 * 1024 * 1024
REQUEST_ID_CHARS_MAX = 64


class CodecError(ValueError):
    """A frame could not be decoded. ``code`` is the error code to answer with."""

    def __init__(self, message: str, code: str = "bad_frame") -> None:
        super().__init__(message)
        self.code = code


# kind -> {field: (python types, required)}
_ANY = object
KINDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    # client requests
    "transact": {"guards": ((list,), False), "ops": ((list,), True), "forwarded": ((bool,), False)},
    "create_table": {
        "table": ((str,), True),
        "key": ((str,), True),
        "columns": ((list,), True),
        "shard": ((str,), False),
        "forwarded": ((bool,), False),
    },
    "list_tables": {},
    # min_key: wait (at most wait_ms) until the table's shard has applied that tx key
    "get": {
        "table": ((str,), True),
        "key": ((_ANY,), True),
        "forwarded": ((bool,), False),
        "consistency": ((str,), False),
        "min_key": ((list,), False),
        "wait_ms": ((int,), False),
    },
    "scan": {
        "table": ((str,), True),
        "after": ((_ANY,), False),
        "forwarded": ((bool,), False),
        "limit": ((int,), False),
        "consistency": ((str,), False),
        "min_key": ((list,), False),
        "wait_ms": ((int,), False),
    },
    "status": {},
    # a bootstrap's key-ordered dirty-read batch of one table (bootstrap.serve), answered {rows, done}
    "bootstrap_batch": {
        "table": ((str,), True),
        "after": ((_ANY,), False),
        "limit": ((int,), True),
        "bytes_max": ((int,), False),
    },
    # the committed key of a shard, confirmed by a sequencer that hears a majority (linearizable reads)
    "read_index": {"shard": ((str,), True), "forwarded": ((bool,), False)},
    "journal": {},
    "force_start": {},
    # replicant -> core: start watching a shard (answered with the agent id and resume/bootstrap)
    "watch": {
        "shard": ((str,), True),
        "replicant": ((str,), True),
        "endpoint": ((str,), True),
        "from": ((list,), True),
        "from_digest": ((bytes,), True),
        "protocol": ((int,), True),
        # chosen by the replica; the answer and every push of the new agent repeat it
        "watch_id": ((str,), False),
    },
    # core agent -> replicant: committed entries (none: a heartbeat)
    "push": {
        "shard": ((str,), True),
        "agent": ((str,), True),
        "core": ((str,), True),
        "entries": ((list,), True),
        "committed": ((list,), True),
        "hears_sequencer": ((bool,), True),
        # the answer to the watch that created the agent (a push may overtake that answer)
        "watch": ((dict,), False),
    },
    # replicant -> core agent: applied key, or why the push was rejected
    "push_ack": {
        "shard": ((str,), True),
        "agent": ((str,), True),
        "applied": ((list,), True),
        "rejected": ((str,), False),
    },
    # sequencer -> a follower behind its trimmed key: install a snapshot at this key (core.snapshot)
    "snapshot_offer": {
        "shard": ((str,), True),
        "sender": ((str,), True),
        "generation": ((int,), True),
        "key": ((list,), True),
        "digest": ((bytes,), True),
    },
    # between cores: one consensus message of one shard (see core.consensus_wire), exclusion notices included
    "peer": {"shard": ((str,), True), "sender": ((str,), True), "message": ((list,), True)},
    "rlog_tail": {"shard": ((str,), True), "count": ((int,), False)},
    "rlog_entries": {"shard": ((str,), True), "after": ((list,), False), "limit": ((int,), False)},
    # replies
    "reply": {"result": ((_ANY,), False)},
    "error": {"code": ((str,), True), "message": ((str,), True), "detail": ((_ANY,), False)},
}


def _range_kinds() -> dict[str, dict[str, tuple[tuple[type, ...], bool]]]:
    from mnesite.rlog.range_requests import KINDS as range_kinds  # lazily: range_requests imports the store

    return range_kinds


KINDS.update(_range_kinds())


@dataclass(frozen=True)
class Message:
    kind: str
    request_id: str
    body: dict[str, Any] = field(default_factory=dict)


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
    check_message(message)
    return message


def check_message(message: Message) -> None:
    if message.kind not in KINDS:
        raise CodecError(f"unknown message kind {message.kind!r:.40}", "unknown_kind")
    if not isinstance(message.request_id, str) or not 0 < len(message.request_id) <= REQUEST_ID_CHARS_MAX:
        raise CodecError(f"request_id must be a string of 1..{REQUEST_ID_CHARS_MAX} characters")
    if not isinstance(message.body, dict):
        raise CodecError("body must be a map")
    spec = KINDS[message.kind]
    for name in message.body:
        if name not in spec:
            raise CodecError(f"{message.kind}: unknown field {name!r:.40}")
    for name, (types, required) in spec.items():
        if name not in message.body:
            if required:
                raise CodecError(f"{message.kind}: missing field {name!r}")
            continue
        value = message.body[name]
        if types == (_ANY,):
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise CodecError(f"{message.kind}: field {name!r} must be {'/'.join(t.__name__ for t in types)}")


def reply(request_id: str, result: Any = None) -> Message:
    return Message("reply", request_id, {"result": result})


def error(request_id: str, code: str, message: str, detail: Any = None) -> Message:
    body: dict[str, Any] = {"code": code, "message": message}
    if detail is not None:
        body["detail"] = detail
    return Message("error", request_id, body)
