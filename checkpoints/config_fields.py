"""Typed reads of config.json fields: each returns the value when it is what HF writes and raises
ValueError naming the field otherwise (callers add the file's path). Strings and fractions are
never taken for sizes: a model built from a silently rounded size would only fail later, on a
tensor."""

from __future__ import annotations

import math
from typing import Any

REQUIRED = object()


def positive_int(d: dict[str, Any], key: str, default: Any = REQUIRED) -> int:
    """A positive JSON integer (absent or null: `default`)."""
    value = d.get(key)
    if value is None:  # absent, or null as some configs write head_dim
        value = default
    if value is REQUIRED:
        raise ValueError(f"lacks the field {key!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def positive_float(d: dict[str, Any], key: str, default: float) -> float:
    """A positive finite JSON number (absent or null: `default`)."""
    value = d.get(key)
    if value is None:
        value = default
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not 0 < value < math.inf):
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def boolean(d: dict[str, Any], key: str) -> bool:
    """A JSON boolean (absent or null: False); the string "false" is refused, not truthy."""
    value = d.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value
