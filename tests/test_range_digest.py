"""Row texts and range digests computed by SQLite: exact, sensitive to every change, keys that sort right."""

from __future__ import annotations

import apsw
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# -- row texts: what SQLite builds natively must parse back to exactly the stored values -----------
from mnesite.rlog.range_digest import (
    decode_row_text,
    key_bytes,
    key_from_bytes,
    row_text_sql,
    text_range_digest,
)
from mnesite.rlog.range_requests import check_sql_features

TEXT_COLUMNS = [("k", "INTEGER"), ("i", "INTEGER"), ("r", "REAL"), ("t", "TEXT"), ("b", "BLOB"), ("a", "ANY")]
_reals = st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 0.1 + 0.2, 5e-324, 1e300, 2.0**53])
_any = st.none() | st.integers(-(2**63), 2**63 - 1) | _reals | st.text() | st.binary()


def _stored_texts(rows: list[tuple]) -> list[tuple[tuple, bytes]]:
    connection = apsw.Connection(":memory:")
    check_sql_features(connection)
    connection.execute(
        "CREATE TABLE t (k INTEGER PRIMARY KEY NOT NULL, i INTEGER, r REAL, t TEXT, b BLOB, a ANY) STRICT"
    )
    connection.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?, ?)", rows)
    found = [
        (tuple(row[:6]), row[6])
        for row in connection.execute(f"SELECT k, i, r, t, b, a, {row_text_sql(TEXT_COLUMNS)} FROM t ORDER BY k")
    ]
    connection.close()
    return found


def _same(left: tuple, right: tuple) -> bool:
    # Exact equality, storage class and the sign of zero included.
    return [(type(v), repr(v)) for v in left] == [(type(v), repr(v)) for v in right]


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.none() | st.integers(-(2**63), 2**63 - 1),
            st.none() | _reals,
            st.none() | st.text(),
            st.none() | st.binary(),
            _any,
        ),
        max_size=6,
    )
)
def test_row_texts_decode_to_the_stored_values(values: list[tuple]) -> None:
    rows = [(index, *row) for index, row in enumerate(values)]
    for stored, text in _stored_texts(rows):
        assert _same(decode_row_text(text, [t for _, t in TEXT_COLUMNS]), stored), (stored, text)


@pytest.mark.timeout(10)
def test_row_texts_tell_apart_what_sqlite_tells_apart() -> None:
    rows = [
        (1, None, None, "", b"", 7),
        (2, None, None, None, None, 7.0),
        (3, 0, 0.0, "a\x00b", b"a\x00b", -0.0),
        (4, 0, 0.0, "a\x00c", b"a\x00c", 0.0),
        (5, None, None, "x", None, "x"),
        (6, None, None, None, b"x", b"x"),
        (7, None, None, "1,2", None, None),
        (8, None, None, "1", None, "2"),
    ]
    texts = _stored_texts(rows)
    assert len({text for _, text in texts}) == len(rows)
    for stored, text in texts:
        assert _same(decode_row_text(text, [t for _, t in TEXT_COLUMNS]), stored)
    assert text_range_digest(0, None) != text_range_digest(1, b"")
    assert text_range_digest(1, texts[0][1]) != text_range_digest(1, texts[1][1])


@pytest.mark.timeout(10)
def test_key_bytes_sort_like_keys_and_round_trip() -> None:
    integers = [-(2**63), -1, 0, 1, 2**63 - 1]
    texts = ["", "a", "ab", "b", "é", "\U0001f600"]
    blobs = [b"", b"\x00", b"\x00\x01", b"\xff"]
    for key_type, keys in (("INTEGER", integers), ("TEXT", texts), ("BLOB", blobs)):
        assert sorted(keys, key=key_bytes) == sorted(keys)
        assert [key_from_bytes(key_bytes(key), key_type) for key in keys] == keys
    with pytest.raises(TypeError):
        key_bytes(True)
