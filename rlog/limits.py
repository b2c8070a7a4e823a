"""Validation shared by the protocol configs: every limit is a positive integer."""

from __future__ import annotations

import dataclasses
from typing import Any


def require_positive_ints(config: Any, error: type[Exception]) -> None:
    """Raise ``error`` naming the first field of the dataclass ``config`` that is not an integer >= 1."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise error(f"{field.name} must be a positive integer, got {value!r}")
