"""tokenizer.json, tokenizer_config.json and the chat template from a GGUF file's metadata.

The conversion is transformers' own (`convert_gguf_tokenizer`: vocabulary, merges, pre-tokenizer
regex by `tokenizer.ggml.pre`, control tokens as special tokens), so the files match what
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds. Its front door is not used: it reads
the file with a torch-based reader, and this converter must run without torch (the scheduler
runs it). So the metadata comes from our reader, shaped as transformers' `get_gguf_tokenizer`
shapes it, and the backend is wrapped and saved with `save_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

from checkpoints.files import CheckpointError
from checkpoints.gguf.reader import Metadata

# tokenizer_config names -> the GGUF key holding that token's id
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def write_tokenizer(meta: Metadata, out_dir: Path) -> None:
    """Write the tokenizer files into `out_dir`; CheckpointError for what the file lacks."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its info lines are noise on our stderr
    arch = meta.str("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(meta.path, "metadata tokenizer.ggml.tokens is missing: the file "
                                         "carries no tokenizer")
    tokenizer_dict, tokenizer_config = ({
        name: meta.get(f"tokenizer.{key}") for key, name in GGUF_TOKENIZER_MAPPING[group].items()
        if f"tokenizer.{key}" in meta} for group in ("tokenizer", "tokenizer_config"))
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # As transformers does: llama.cpp adds BOS to a sentencepiece vocabulary unless told not to.
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = meta.token_id(key)
        if token_id is not None and token_id >= len(tokens):
            raise CheckpointError(meta.path, f"metadata {key} = {token_id} is outside the "
                                             f"vocabulary of {len(tokens)} tokens")
        tokenizer_config[name] = tokens[token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
        backend = _without_ids_past(backend, len(tokens))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend,
                                            **{**tokenizer_config, **extra})
    except Exception as e:  # transformers raises ValueError/KeyError/... on what it cannot build
        raise CheckpointError(meta.path, f"cannot build a tokenizer from its metadata "
                                         f"({type(e).__name__}: {e})") from None
    tokenizer.save_pretrained(str(out_dir))


def _without_ids_past(backend, num_tokens: int):
    """The backend minus added tokens with ids past the file's token list. transformers' byte-
    level builder adds GPT-2's "<|endoftext|>" as the unknown token when the file names none
    (Llama 3 files): an id the model has no embedding for, which would also make the
    scheduler's vocabulary larger than the executor's. Every token the file lists is kept."""
    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    kept = [t for t in data["added_tokens"] if t["id"] < num_tokens]
    if len(kept) == len(data["added_tokens"]):
        return backend
    data["added_tokens"] = kept
    return Tokenizer.from_str(json.dumps(data))

