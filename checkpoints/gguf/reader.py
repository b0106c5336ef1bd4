"""Open a GGUF file and read its metadata with every failure named in one line.

`gguf.GGUFReader` memory-maps the file and parses the header, the metadata and the tensor index
(a view of every tensor's bytes) up front. Its own errors are terse (a truncated file fails on a
numpy reshape), so the file is checked here first (empty, wrong magic) and every read the reader
makes is bounded by the file's size, which turns a cut file into "needs N bytes, has M".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.files import CheckpointError

GGUF_MAGIC = b"GGUF"


class _Truncated(Exception):
    def __init__(self, needed: int, size: int):
        super().__init__(f"needs {needed} bytes, has {size}")
        self.needed = needed
        self.size = size


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path`, or a CheckpointError saying what is wrong with it."""
    import gguf

    class BoundedReader(gguf.GGUFReader):
        # Every byte the reader looks at goes through _get; a slice past the end of a memmap
        # is silently short, so the bound is checked here.
        def _get(self, offset, dtype, count=1, *args, **kwargs):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise _Truncated(end, len(self.data))
            return super()._get(offset, dtype, count, *args, **kwargs)

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise CheckpointError(path, "file not found") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a GGUF file") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot be read: {e.strerror or e}") from None
    if not magic:
        raise CheckpointError(path, "empty file (0 bytes), not a GGUF model")
    if magic != GGUF_MAGIC:
        raise CheckpointError(path, f"not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        return BoundedReader(path)
    except _Truncated as e:
        raise CheckpointError(path, f"truncated GGUF file: its header and tensors need at "
                                    f"least {e.needed} bytes, the file has {e.size}") from None
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError on bad bytes
        raise CheckpointError(path, f"damaged GGUF file ({type(e).__name__}: {e})") from None


class Metadata:
    """The GGUF key/value metadata as Python values, with typed lookups that name the key."""

    def __init__(self, path: Path, reader):
        self.path = path
        self.values: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue  # the header's counts, not metadata
            try:
                self.values[key] = field.contents()
            except Exception as e:  # a field whose bytes do not decode
                raise CheckpointError(path, f"metadata {key} cannot be decoded "
                                            f"({type(e).__name__}: {e})") from None

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def _missing(self, key: str) -> CheckpointError:
        return CheckpointError(self.path, f"metadata {key} is missing")

    def _wrong(self, key: str, expected: str) -> CheckpointError:
        return CheckpointError(self.path, f"metadata {key} must be {expected}, got "
                                          f"{self.values[key]!r}")

    def str(self, key: str, default: str | None = None) -> str:
        if key not in self.values:
            if default is None:
                raise self._missing(key)
            return default
        if not isinstance(self.values[key], str):
            raise self._wrong(key, "a string")
        return self.values[key]

    def positive_int(self, key: str, default: int | None = None) -> int:
        if key not in self.values:
            if default is None:
                raise self._missing(key)
            return default
        value = self.values[key]
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # some files give a per-layer list; one value for all is fine
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self._wrong(key, "a positive integer (the same for every layer)")
        return value

    def positive_float(self, key: str, default: float | None = None) -> float:
        if key not in self.values:
            if default is None:
                raise self._missing(key)
            return default
        value = self.values[key]
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not 0 < value < float("inf")):
            raise self._wrong(key, "a positive number")
        return float(value)

    def token_id(self, key: str) -> int | None:
        value = self.values.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self._wrong(key, "a token id")
        return value
