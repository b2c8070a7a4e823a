"""JSON text that JSON parsers read back, for every ``--json`` output (the ``mnesite`` commands, ``compare``).

JSON has no infinity, and a REAL may hold one (SQLite stores ``1e999`` so): Python's json writes the
word ``Infinity``, which JSON parsers refuse. It is written as SQLite's own ``json()`` writes it,
``9.0e+999``, a JSON number that parsers (Python's json too) read back as infinity; a NaN, which SQLite
never holds (it stores one as null), as ``null``.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable
from typing import Any

INFINITY_TEXT = "9.0e+999"  # what SQLite's json() writes for an infinity


def json_text(value: Any, default: Callable[[Any], Any] | None = None, **options: Any) -> str:
    """``json.dumps(value, default=default, **options)``, an infinity written as ``9.0e+999`` and a NaN
    as ``null``: valid JSON, whatever ``options`` (``indent``, ``ensure_ascii``) say."""
    try:
        return json.dumps(value, default=default, allow_nan=False, **options)
    except ValueError:  # rare: only a value holding a non-finite float gets here
        pass
    # Each infinity becomes a string no value holds (a fresh random token), written as a number after.
    token = secrets.token_hex(16)
    marks = {math.inf: f"+{token}", -math.inf: f"-{token}"}
    text = json.dumps(_marked(value, default, marks), allow_nan=False, **options)
    for number, mark in ((INFINITY_TEXT, marks[math.inf]), (f"-{INFINITY_TEXT}", marks[-math.inf])):
        text = text.replace(json.dumps(mark), number)
    return text


def _marked(value: Any, default: Callable[[Any], Any] | None, marks: dict[float, str]) -> Any:
    """``value`` with each non-finite float replaced: an infinity by its mark, a NaN by None; a value
    ``default`` converts is converted first (its result may hold one)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else (None if math.isnan(value) else marks[value])
    if isinstance(value, dict):  # a non-finite key is text, as Python's json writes a float key
        return {_key(key): _marked(item, default, marks) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_marked(item, default, marks) for item in value]
    if value is None or isinstance(value, (str, int)) or default is None:
        return value
    return _marked(default(value), default, marks)


def _key(key: Any) -> Any:
    if isinstance(key, float) and not math.isfinite(key):
        return "null" if math.isnan(key) else ("-" if key < 0 else "") + INFINITY_TEXT
    return key
