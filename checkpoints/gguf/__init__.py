"""GGUF files as ordinary checkpoints: converted once into an HF directory in a cache.

`folio serve --model file.gguf` (or a directory holding exactly one .gguf and no config.json)
turns the file into config.json + tokenizer files + safetensors (projections of the kept block
types as raw blocks, everything else dequantized) under
`$FOLIO_CACHE_DIR/gguf/<sha256>/` (`cache.py`), which the executor's loader and the scheduler's
tokenizer then read like any other checkpoint. Nothing here imports torch: the scheduler runs it
as a subprocess (its tokenizer step imports transformers, which the scheduler keeps out) and the
executor runs it in-process before its torch import (checkpoints/resolve.py).

    python -m checkpoints.gguf PATH [--cache-dir D]   # prints the directory last

Module map: `reader.py` (opening the file, typed metadata), `hf_config.py` (config.json),
`weights.py` (names, rotary un-permutation, raw blocks or dequantization, safetensors),
`hf_tokenizer.py` (transformers' GGUF tokenizer conversion), `convert.py` (one conversion),
`cache.py` (hash, lock, temp dir and rename), `dequantize.py` (a float copy of a conversion, for
oracles and peers that cannot read raw blocks), `__main__.py` (the command line).
"""

from __future__ import annotations

import os
from pathlib import Path

from checkpoints.files import CheckpointError
from checkpoints.gguf.cache import gguf_cache_root, gguf_checkpoint_dir

__all__ = ["find_gguf_file", "gguf_cache_root", "gguf_checkpoint_dir", "names_gguf"]

GGUF_SUFFIX = ".gguf"


def names_gguf(model: str | os.PathLike) -> bool:
    """`model` stands for a GGUF model: a .gguf path (there or not), or a directory holding
    .gguf files and no config.json. It never raises: `find_gguf_file` says which file, or why
    none can be chosen."""
    path = Path(model).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        return True
    return (path.is_dir() and not (path / "config.json").exists()
            and any(p.suffix.lower() == GGUF_SUFFIX and p.is_file() for p in path.iterdir()))


def find_gguf_file(model: str | os.PathLike) -> Path | None:
    """The GGUF file `model` stands for: itself when it is a .gguf path, or the single .gguf in
    a directory that has no config.json. None when `model` is something else (an HF checkpoint
    directory, a hub id). A missing .gguf path and a directory with several .gguf files are
    CheckpointErrors: neither can mean anything else."""
    path = Path(model).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        if not path.exists():
            raise CheckpointError(path, "file not found")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:5]) + (" ..." if len(found) > 5 else "")
        raise CheckpointError(path, f"holds {len(found)} .gguf files ({names}); pass the one "
                                    "to serve")
    return found[0] if found else None
