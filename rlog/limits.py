"""Limits shared by the roles, and the validation shared by the protocol configs: every limit is a
positive integer."""

from __future__ import annotations

import dataclasses
from typing import Any

# Shards one node holds at most: a core refuses to create more, a replicant opens no more of those
# its cores report (their answers are untrusted input).
SHARDS_MAX = 1000
# [limits] frame_bytes_max, at least and at most: a status answer, a few rows, and an entry with an
# append's envelope around it (core.node) need the low bound.
FRAME_BYTES_MAX_BOUNDS = (64 * 1024, 256 * 1024 * 1024)
# Bytes of a frame besides the entries it carries: an append's or a push's envelope (keys, digest,
# sender, shard, counters, a push's watch answer and token), well above what msgpack makes of them.
FRAME_ENVELOPE_BYTES = 4096
# Bytes of a backup file in one ``backup_read`` answer, at most (rlog.backup.chunk_bytes_max).
BACKUP_CHUNK_BYTES_MAX = 1024 * 1024


def require_positive_ints(config: Any, error: type[Exception], zero_allowed: tuple[str, ...] = ()) -> None:
    """Raise ``error`` naming the first field of the dataclass ``config`` that is not an integer >= 1
    (>= 0 for the fields named in ``zero_allowed``, where 0 turns something off)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        low = 0 if field.name in zero_allowed else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            kind = "a non-negative" if low == 0 else "a positive"
            raise error(f"{field.name} must be {kind} integer, got {value!r}")
