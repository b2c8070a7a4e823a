"""Canonical digests of key ranges of a table, computed by SQLite (pure helpers: SQL text and hashing).

Theory of operation
-------------------
Two replicas hold the same rows in a key range exactly when they produce the same *range digest*
for it. A range is half-open on the left, ``(low, high]``: ``low`` is excluded and ``high``
included, ``None`` meaning unbounded. That matches the batched dirty-read protocol
(``scan_page(after=low)``), so a live node and a file replica read a range the same way.

SQLite builds the canonical *row text* of each row natively (``row_text_sql``) and Python hashes
a range's row texts one after the other into one hash (``range_hasher``; ``text_range_digest`` is
the same digest of texts already joined), so memory holds one row text, not a range. The compare job
(for file replicas) and the node's range requests (``rlog.range_requests``) use the same functions,
so a live node and a copy of its file give identical digests. Keys travel as bytes that sort like
SQLite sorts them (``key_bytes``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

RANGE_DIGEST_BYTES = 16
ROW_DIGEST_BYTES = 16


# -- row text: the canonical row encoding SQLite computes itself ----------------------------------
#
# Encoding rows' values in Python would cost Python work per value; the compare job instead has
# SQLite build a canonical *row text* natively, and Python only feeds each row's text, one bytes
# object, to the range's hash. The row text is the values in declared column order, each followed by ``,``:
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
# count and the concatenated row texts, in key order (``ORDER BY`` the key: a table with a TEXT key
# keeps a rowid, and a plain scan of an unbounded range returns rows in the order they were written,
# which differs between a core and a replica copied in key order). An order that differed between
# replicas could only make equal ranges look different and be drilled into, never the reverse.

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


def range_hasher(rows: int) -> Any:
    """A hash object for the digest of a range of ``rows`` rows: ``update`` it with the range's row
    texts in key order, then ``digest()``. The row count comes first, so it is known before the texts."""
    hasher = hashlib.blake2b(digest_size=RANGE_DIGEST_BYTES, person=ROW_TEXT_PERSON)
    hasher.update(b"rows %d;" % rows)
    return hasher


def text_range_digest(rows: int, text: bytes | None) -> bytes:
    """Range digest from the concatenated row texts of the range (``None`` when it is empty)."""
    hasher = range_hasher(rows)
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
