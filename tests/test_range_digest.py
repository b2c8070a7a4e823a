"""Range digests: canonical, sensitive to every change, and one pass equals range-by-range hashing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlog.range_digest import (
    KeySampler,
    RangeHasher,
    boundaries_to_ranges,
    decode_key,
    encode_key,
    in_range,
    range_digest,
    row_digest,
    split_ranges,
)

ROWS = [(1, "a", 1.5, b"x", None), (2, "b", 2.0, b"", 7), (5, "c", -0.0, b"\x00", "t")]


@pytest.mark.timeout(10)
def test_range_digest_is_deterministic_and_counts_rows() -> None:
    count, digest = range_digest(ROWS)
    assert count == 3
    assert range_digest(list(ROWS)) == (3, digest)
    assert len(digest) == 16
    assert range_digest([]) == (0, RangeHasher().digest())
    assert range_digest([]) != range_digest([()])


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "changed",
    [
        [(1, "a", 1.5, b"x", None), (2, "b", 2.0, b"", 7)],  # a row less
        [*ROWS, (6, "d", 0.0, b"", None)],  # a row more
        [(1, "a", 1.5, b"x", None), (2, "b", 2.0, b"", 7.0), ROWS[2]],  # integer 7 became real 7.0
        [(1, "a", 1.5, "x", None), ROWS[1], ROWS[2]],  # blob became text
        [(1, "a", 1.5, b"x", ""), ROWS[1], ROWS[2]],  # null became empty text
        [(1, "a", 1.5, None, b"x"), ROWS[1], ROWS[2]],  # values swapped between columns
        [ROWS[1], ROWS[0], ROWS[2]],  # another order
        [(1, "a", 1.5, b"x", None), (2, "b", 2.0, b"", 7), (5, "c", 0.0, b"\x00", "t")],  # -0.0 became 0.0
    ],
)
def test_range_digest_changes_with_any_change(changed: list[tuple]) -> None:
    assert range_digest(changed)[1] != range_digest(ROWS)[1]


@pytest.mark.timeout(10)
def test_row_boundaries_are_unambiguous() -> None:
    # Two rows of one value each must not hash like one row of two values.
    assert range_digest([("ab",), ("c",)])[1] != range_digest([("a",), ("bc",)])[1]
    assert row_digest(("a", "b")) != row_digest(("ab",))


@pytest.mark.timeout(10)
def test_keys_round_trip_through_their_encoding() -> None:
    for key in (0, -(2**63), 2**63 - 1, "", "é", b"\x00\xff"):
        assert decode_key(encode_key(key)) == key
    assert encode_key("a") != encode_key(b"a")


@pytest.mark.timeout(10)
def test_ranges_are_open_below_and_closed_above() -> None:
    assert in_range(5, 4, 5) and not in_range(4, 4, 5)
    assert in_range(-(10**6), None, 0) and in_range(10**6, 0, None) and in_range("x", None, None)
    assert boundaries_to_ranges(None, None, [3, 7]) == [(None, 3), (3, 7), (7, None)]
    with pytest.raises(ValueError, match="increasing"):
        boundaries_to_ranges(None, None, [7, 3])
    with pytest.raises(ValueError, match="inside"):
        boundaries_to_ranges(3, 9, [9])


@pytest.mark.timeout(10)
def test_split_ranges_rejects_unordered_rows_and_keys_outside() -> None:
    with pytest.raises(ValueError, match="increasing key order"):
        list(split_ranges([(2, (2,)), (1, (1,))], [(None, None)]))
    with pytest.raises(ValueError, match="outside"):
        list(split_ranges([(10, (10,))], [(None, 5)]))
    with pytest.raises(ValueError, match="consecutive"):
        list(split_ranges([], [(None, 1), (2, None)]))


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(
    keys=st.lists(st.integers(-1000, 1000), unique=True, max_size=200).map(sorted),
    cuts=st.lists(st.integers(-1100, 1100), unique=True, max_size=8).map(sorted),
    parts=st.integers(0, 6),
)
def test_one_pass_equals_hashing_each_range_alone(keys: list[int], cuts: list[int], parts: int) -> None:
    rows = [(key, (key, f"v{key}")) for key in keys]
    ranges = boundaries_to_ranges(None, None, cuts)
    results = list(split_ranges(rows, ranges, parts))
    assert [r.index for r in results] == list(range(len(ranges)))
    for result, (low, high) in zip(results, ranges, strict=True):
        inside = [values for key, values in rows if in_range(key, low, high)]
        assert (result.low, result.high) == (low, high)
        assert (result.rows, result.digest) == range_digest(inside)
        splits = list(result.split_keys)
        assert len(splits) <= max(parts - 1, 0)
        assert splits == sorted(set(splits))
        if splits:
            # Split keys cut the range into non-empty sub-ranges: valid boundaries for every replica.
            assert boundaries_to_ranges(low, high, splits)
            assert splits[-1] < [v[0] for v in inside][-1]


@pytest.mark.timeout(30)
def test_key_sampler_is_bounded_and_evenly_spaced() -> None:
    sampler = KeySampler(keys_max=64)
    for key in range(100_000):
        sampler.add(key)
        assert len(sampler.keys) < 64
    splits = sampler.split_keys(4)
    assert len(splits) == 3
    # Each quarter holds about a quarter of the keys (within one sampling stride).
    for index, split in enumerate(splits, start=1):
        assert abs(split - index * 25_000) <= 2 * sampler.stride
    assert KeySampler().split_keys(4) == []
    with pytest.raises(ValueError):
        KeySampler(keys_max=1)


# -- row texts: what SQLite builds natively must parse back to exactly the stored values -----------

import apsw  # noqa: E402

from rlog.range_digest import (  # noqa: E402
    decode_row_text,
    key_bytes,
    key_from_bytes,
    row_text_sql,
    text_range_digest,
)
from rlog.range_requests import check_sql_features  # noqa: E402

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
    found = [(tuple(row[:6]), row[6]) for row in connection.execute(
        f"SELECT k, i, r, t, b, a, {row_text_sql(TEXT_COLUMNS)} FROM t ORDER BY k")]
    connection.close()
    return found


def _same(left: tuple, right: tuple) -> bool:
    # Exact equality, storage class and the sign of zero included.
    return [(type(v), repr(v)) for v in left] == [(type(v), repr(v)) for v in right]


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.none() | st.integers(-(2**63), 2**63 - 1), st.none() | _reals, st.none() | st.text(),
                  st.none() | st.binary(), _any),
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
        (1, None, None, "", b"", 7), (2, None, None, None, None, 7.0), (3, 0, 0.0, "a\x00b", b"a\x00b", -0.0),
        (4, 0, 0.0, "a\x00c", b"a\x00c", 0.0), (5, None, None, "x", None, "x"), (6, None, None, None, b"x", b"x"),
        (7, None, None, "1,2", None, None), (8, None, None, "1", None, "2"),
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
