"""Strict readers for the step-plan protocol's wire fields (`protos.plan`): each returns the
value when its type is exactly right (bool is not an int here) and raises TypeError or ValueError
otherwise, which the codec turns into `protos.channel.ProtocolError`."""

from __future__ import annotations


def _int(v: object) -> int:
    if type(v) is not int:
        raise TypeError(f"expected an int, got {type(v).__name__}")
    return v


def _nat(v: object) -> int:
    if type(v) is not int or v < 0:
        raise TypeError(f"expected an int >= 0, got {v!r:.40}")
    return v


def _float(v: object) -> float:
    if type(v) is float or type(v) is int:
        return float(v)
    raise TypeError(f"expected a number, got {type(v).__name__}")


def _bool(v: object) -> bool:
    if type(v) is not bool:
        raise TypeError(f"expected a bool, got {type(v).__name__}")
    return v


def _str(v: object) -> str:
    if type(v) is not str:
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _list(v: object, n: int | None = None) -> list:
    if type(v) is not list:
        raise TypeError(f"expected a list, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise ValueError(f"expected {n} fields, got {len(v)}")
    return v


def _nats(v: object) -> list[int]:
    """A list of ints >= 0 (token ids, block ids), returned as is (msgpack made it)."""
    if type(v) is not list:
        raise TypeError(f"expected a list of ints, got {type(v).__name__}")
    for x in v:
        if type(x) is not int or x < 0:
            raise TypeError(f"expected ints >= 0 in a list, got {x!r:.40}")
    return v


def _strs(v: object) -> list[str]:
    if type(v) is not list or not {*map(type, v)} <= {str}:
        raise TypeError("expected a list of strings")
    return v


def _pairs(v: object) -> list[tuple[int, int]]:
    return [(_nat(a), _nat(b)) for a, b in (_list(p, 2) for p in _list(v))]


# What StructuredSpec.kind may be (the public SamplingParams.structured_output oneof).
def _only(values: list, cls: type) -> bool:
    """Every item's type is exactly `cls` (bool is not int), checked without a Python loop."""
    return {*map(type, values)} <= {cls}


def _floats(v: object) -> list[float]:
    if type(v) is not list or not {*map(type, v)} <= {float, int}:
        raise TypeError("expected a list of numbers")
    return [float(x) for x in v]
