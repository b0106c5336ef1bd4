"""Folio's cache root, shared by everything it builds once and keeps: the tiny random model,
GGUF conversions, the benchmark's random checkpoints. Hub downloads go to the hub's own cache
(or --hub-cache-dir)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$FOLIO_CACHE_DIR, else ~/.cache/folio."""
    env = os.environ.get("FOLIO_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "folio"
