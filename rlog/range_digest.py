"""Canonical digests of key ranges of a table (pure: no SQLite, no Spark, no clock).

Theory of operation
-------------------
Two replicas hold the same rows in a key range exactly when they produce the same
*range digest* for it. A range is half-open on the left, ``(low, high]``: ``low`` is
excluded and ``high`` included, ``None`` meaning unbounded. That matches the batched
dirty-read protocol (``scan_page(after=low)``) so a live node and a file replica read a
range the same way, and split keys taken from one replica's rows are inclusive upper ends.

A row is encoded canonically as the msgpack array of its values in the table's declared
column order (``use_bin_type``: TEXT and BLOB stay distinct; floats are always float64).
Ranges are read in key order, so the range digest is simply BLAKE2b over the row count
prefix-free concatenation of the encoded rows; no order-independent combination is needed.
The row count is folded in at the end so that a range digest also commits to its size.

``split_ranges`` is the single pass an executor (or, later, the node itself) makes over a
key-ordered row stream: it cuts the stream at shared split keys and yields one digest per
range, plus evenly spaced split keys of each range taken with a bounded, deterministic
decimating sample, which the next drill-down level uses as sub-boundaries.

Keys compare with Python's ``<``: within one STRICT key column (INTEGER, TEXT or BLOB)
that is SQLite's BINARY order (UTF-8 byte order equals code point order).

The compare job and the node's range requests use the *row text* half of this module (at
the end): SQLite builds the canonical text of each row natively (``row_text_sql``) and
Python hashes whole ranges of it, which avoids a Python call per row. The msgpack half above
stays the reference for rows that are already Python values (``split_ranges``,
``KeySampler``); the two kinds of digests are never compared with each other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

RANGE_DIGEST_BYTES = 16
ROW_DIGEST_BYTES = 16
SAMPLE_KEYS_MAX = 4096  # bound on the keys a range keeps in memory to choose its split keys
_DIGEST_PERSON = b"mnesite-range1"


def encode_row(values: Sequence[Any]) -> bytes:
    """Canonical bytes of one row given as its values in declared column order."""
    return msgpack.packb(list(values), use_bin_type=True)


def encode_key(key: Any) -> bytes:
    """Canonical bytes of a key (used to join keys across replicas whatever their type)."""
    return msgpack.packb(key, use_bin_type=True)


def decode_key(blob: bytes) -> Any:
    return msgpack.unpackb(blob, raw=False)


def row_digest(values: Sequence[Any]) -> bytes:
    """Digest of one row: what row-level comparison ships instead of the row."""
    return hashlib.blake2b(encode_row(values), digest_size=ROW_DIGEST_BYTES, person=_DIGEST_PERSON).digest()


class RangeHasher:
    """Incremental digest of the rows of one key range, fed in key order."""

    __slots__ = ("_hash", "rows")

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=RANGE_DIGEST_BYTES, person=_DIGEST_PERSON)
        self.rows = 0

    def update(self, values: Sequence[Any]) -> None:
        encoded = encode_row(values)
        # Length prefix: the concatenation stays unambiguous whatever the row bytes are.
        self._hash.update(len(encoded).to_bytes(4, "big"))
        self._hash.update(encoded)
        self.rows += 1

    def digest(self) -> bytes:
        final = self._hash.copy()
        final.update(b"rows" + self.rows.to_bytes(8, "big"))
        return final.digest()


def range_digest(rows: Iterable[Sequence[Any]]) -> tuple[int, bytes]:
    """``(row count, digest)`` of rows given in key order as value sequences in declared column order."""
    hasher = RangeHasher()
    for values in rows:
        hasher.update(values)
    return hasher.rows, hasher.digest()


def in_range(key: Any, low: Any, high: Any) -> bool:
    """Whether ``key`` is in ``(low, high]`` (``None``: unbounded)."""
    return (low is None or key > low) and (high is None or key <= high)


class KeySampler:
    """Evenly spaced keys of a key-ordered stream, in bounded memory, without knowing its length.

    Keeps the keys at positions that are multiples of ``stride``; when ``keys_max`` are held it
    drops every other one and doubles the stride. Deterministic: the same stream gives the same keys.
    """

    __slots__ = ("keys", "keys_max", "position", "stride")

    def __init__(self, keys_max: int = SAMPLE_KEYS_MAX) -> None:
        if keys_max < 2:
            raise ValueError("keys_max must be at least 2")
        self.keys_max = keys_max
        self.keys: list[Any] = []
        self.stride = 1
        self.position = 0

    def add(self, key: Any) -> None:
        if self.position % self.stride == 0:
            self.keys.append(key)
            if len(self.keys) >= self.keys_max:
                self.keys = self.keys[::2]
                self.stride *= 2
        self.position += 1

    def split_keys(self, parts: int) -> list[Any]:
        """At most ``parts - 1`` increasing keys cutting the stream into ``parts`` near-equal ranges."""
        if parts < 2 or len(self.keys) < 2:
            return []
        chosen: list[Any] = []
        for index in range(1, parts):
            # The upper end of part ``index - 1`` is the key just before the part boundary.
            position = (index * len(self.keys)) // parts - 1
            if position < 0:
                continue
            key = self.keys[position]
            if not chosen or key > chosen[-1]:
                chosen.append(key)
        # Positions stay below len(keys) - 1: the last key is never a split key, so no part is empty.
        return chosen


@dataclass(frozen=True)
class RangeResult:
    """What one replica reports for one range: its row count, digest and proposed sub-split keys."""

    index: int
    low: Any
    high: Any
    rows: int
    digest: bytes
    split_keys: tuple[Any, ...]


def boundaries_to_ranges(low: Any, high: Any, split_keys: Sequence[Any]) -> list[tuple[Any, Any]]:
    """The ranges ``(low, s1], (s1, s2], ..., (sk, high]``; split keys must be increasing and inside."""
    edges = [low, *split_keys, high]
    for before, after in zip(split_keys, split_keys[1:], strict=False):
        if not before < after:
            raise ValueError("split keys must be strictly increasing")
    for key in split_keys:
        if not in_range(key, low, high) or (high is not None and key == high):
            raise ValueError(f"split key {key!r} is not strictly inside ({low!r}, {high!r}]")
    return list(zip(edges, edges[1:], strict=False))


def split_ranges(
    rows: Iterable[tuple[Any, Sequence[Any]]],
    ranges: Sequence[tuple[Any, Any]],
    split_parts: int = 0,
    sample_keys_max: int = SAMPLE_KEYS_MAX,
) -> Iterator[RangeResult]:
    """Digest consecutive ``ranges`` from one pass over ``(key, values)`` rows in key order.

    ``ranges`` must be consecutive and increasing (each one's low is the previous one's high);
    ``rows`` must cover them (rows outside all ranges raise ``ValueError``). Every range yields
    exactly one result, empty ones included, in order. With ``split_parts >= 2`` each result
    also carries up to ``split_parts - 1`` split keys for drilling into that range.
    """
    for (_, high), (next_low, _) in zip(ranges, ranges[1:], strict=False):
        if high != next_low:
            raise ValueError("ranges must be consecutive")
    index = 0
    hasher = RangeHasher()
    sampler = KeySampler(sample_keys_max)
    previous_key: Any = None
    seen_any = False

    def finish(position: int) -> RangeResult:
        low, high = ranges[position]
        splits = tuple(sampler.split_keys(split_parts)) if split_parts >= 2 else ()
        return RangeResult(position, low, high, hasher.rows, hasher.digest(), splits)

    for key, values in rows:
        if seen_any and not key > previous_key:
            raise ValueError(f"rows are not in strictly increasing key order at {key!r}")
        seen_any, previous_key = True, key
        if not ranges or not in_range(key, ranges[0][0], ranges[-1][1]):
            raise ValueError(f"key {key!r} is outside the ranges being digested")
        while not in_range(key, *ranges[index]):
            yield finish(index)
            index += 1
            hasher, sampler = RangeHasher(), KeySampler(sample_keys_max)
        hasher.update(values)
        if split_parts >= 2:
            sampler.add(key)
    while index < len(ranges):
        yield finish(index)
        index += 1
        hasher, sampler = RangeHasher(), KeySampler(sample_keys_max)


# -- row text: the canonical row encoding SQLite computes itself ----------------------------------
#
# Hashing rows in Python costs a Python call per row; the compare job instead has SQLite build a
# canonical *row text* natively and hashes whole ranges of it at once. The row text is the values
# in declared column order, each followed by ``,``:
#
# * INTEGER column: the decimal integer; REAL column: SQLite's ``quote()`` of the value, which
#   round-trips exactly (checked by ``SQL_FEATURES_CHECK``), or ``-0.0`` for negative zero;
#   TEXT column: ``<UTF-8 byte length>:<bytes>``; BLOB column: ``<byte length>:<bytes>``;
#   null in any of those: nothing.
# * ANY column: the same with a type letter first (``i``, ``r``, ``t``, ``b``), ``n`` for null.
#
# Numbers never contain ``,`` or ``:`` and text and blobs are length-prefixed, so the text of a
# row parses back to exactly its values and storage classes (``decode_row_text``), and the
# concatenated texts of a range parse back to its rows. A range digest is BLAKE2b over its row
# count and the concatenated row texts; rows are concatenated in the order SQLite scans the key
# range (its key order in practice, not relied upon): an order that differed between replicas
# could only make equal ranges look different and be drilled into, never the reverse.

ROW_TEXT_PERSON = b"mnesite-rowtext1"
ROW_TEXT_VERSION = 1
# Every SQLite function the row text uses, with values that show quote() round-trips exactly.
SQL_FEATURES_CHECK = (
    "SELECT quote(0.30000000000000004) = '0.30000000000000004' AND quote(5e-324) = '4.9406564584124654e-324' "
    "AND atan2(-0.0, -1.0) < 0 AND octet_length('é') = 2"
)


def _quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _real_sql(column: str) -> str:
    # quote() renders -0.0 like 0.0; atan2 tells them apart (a REAL column stores -0.0 as 0 anyway).
    # No ELSE: null stays null (quote() would render it as the text NULL).
    return (
        f"CASE WHEN {column} = 0.0 AND atan2({column}, -1.0) < 0 THEN '-0.0' "
        f"WHEN {column} IS NOT NULL THEN quote({column}) END"
    )


def value_text_sql(column: str, column_type: str) -> str:
    """SQL for one value's row text, ``,`` included (``column`` is an already quoted identifier)."""
    if column_type == "INTEGER":
        return f"ifnull({column} || ',', ',')"
    if column_type == "REAL":
        return f"ifnull({_real_sql(column)} || ',', ',')"
    if column_type == "TEXT":
        return f"ifnull(octet_length({column}) || ':' || {column} || ',', ',')"
    if column_type == "BLOB":
        return f"ifnull(length({column}) || ':' || {column} || ',', ',')"
    if column_type == "ANY":
        return (
            f"CASE typeof({column}) WHEN 'integer' THEN 'i' || {column} WHEN 'real' THEN 'r' || {_real_sql(column)} "
            f"WHEN 'text' THEN 't' || octet_length({column}) || ':' || {column} "
            f"WHEN 'blob' THEN 'b' || length({column}) || ':' || {column} ELSE 'n' END || ','"
        )
    raise ValueError(f"unknown column type {column_type!r}")


def row_text_sql(columns: Sequence[tuple[str, str]]) -> str:
    """SQL expression of a row's canonical text, as a BLOB (see the section comment above)."""
    if not columns:
        raise ValueError("a table has at least one column")
    parts = " || ".join(value_text_sql(_quote_identifier(name), column_type) for name, column_type in columns)
    return f"CAST({parts} AS BLOB)"


def text_range_digest(rows: int, text: bytes | None) -> bytes:
    """Range digest from SQLite's concatenated row texts of the range (``None`` when it is empty)."""
    hasher = hashlib.blake2b(digest_size=RANGE_DIGEST_BYTES, person=ROW_TEXT_PERSON)
    hasher.update(b"rows %d;" % rows)
    if text:
        hasher.update(text)
    return hasher.digest()


def text_row_digest(text: bytes) -> bytes:
    """Row digest from SQLite's row text."""
    return hashlib.blake2b(text, digest_size=ROW_DIGEST_BYTES, person=ROW_TEXT_PERSON, salt=b"row").digest()


def decode_row_text(text: bytes, column_types: Sequence[str]) -> tuple[Any, ...]:
    """The values a row text encodes (the inverse of ``row_text_sql``; raises ``ValueError``)."""
    values: list[Any] = []
    position = 0

    def number_until_comma() -> bytes:
        nonlocal position
        end = text.index(b",", position)
        token = text[position:end]
        position = end
        return token

    def length_prefixed() -> bytes:
        nonlocal position
        colon = text.index(b":", position)
        length = int(text[position:colon])
        start = colon + 1
        if start + length > len(text):
            raise ValueError("row text is truncated")
        position = start + length
        return text[start:position]

    def real(token: bytes) -> float:
        return -0.0 if token == b"-0.0" else float(token)

    for column_type in column_types:
        kind = {"INTEGER": "i", "REAL": "r", "TEXT": "t", "BLOB": "b"}.get(column_type)
        if kind is None:
            if column_type != "ANY":
                raise ValueError(f"unknown column type {column_type!r}")
            kind = chr(text[position])
            position += 1
            if kind == "n":
                kind = ""
        elif text[position : position + 1] == b",":
            kind = ""  # null
        if kind == "i":
            values.append(int(number_until_comma()))
        elif kind == "r":
            values.append(real(number_until_comma()))
        elif kind == "t":
            values.append(length_prefixed().decode("utf-8"))
        elif kind == "b":
            values.append(length_prefixed())
        elif kind == "":
            values.append(None)
        else:
            raise ValueError(f"unknown type letter {kind!r}")
        if text[position : position + 1] != b",":
            raise ValueError(f"expected ',' at byte {position}")
        position += 1
    if position != len(text):
        raise ValueError("row text has trailing bytes")
    return tuple(values)


# -- keys as bytes that sort like SQLite sorts them ----------------------------------------------

_INTEGER_OFFSET = 2**63


def key_bytes(key: Any) -> bytes:
    """Bytes of a key that compare like the keys of one key column do in SQLite (BINARY order)."""
    if isinstance(key, bool):
        raise TypeError("a key cannot be a boolean")
    if isinstance(key, int):
        return (key + _INTEGER_OFFSET).to_bytes(8, "big")
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise TypeError(f"a key must be an integer, text or blob, not {type(key).__name__}")


def key_from_bytes(blob: bytes, key_type: str) -> Any:
    """The inverse of ``key_bytes`` for a key column of type ``key_type``."""
    if key_type == "INTEGER":
        return int.from_bytes(blob, "big") - _INTEGER_OFFSET
    if key_type == "TEXT":
        return bytes(blob).decode("utf-8")
    if key_type == "BLOB":
        return bytes(blob)
    raise ValueError(f"{key_type} is not a key type")
