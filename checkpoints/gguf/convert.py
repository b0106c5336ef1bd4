"""One GGUF file -> one HF checkpoint directory (config, tokenizer, safetensors).

Everything that can be refused is checked before the slow part: the architecture, the config
numbers, every tensor's name, shape and type, the tokenizer, and the free disk space. Only then
are the weights written (linear weights, the embedding and the untied LM head of the kept
block types as raw blocks, the rest dequantized: weights.py), and the marker file is written
last.

config.json declares the raw ones, for the executor's loader (executor_svc/quantization):

    "quantization_config": {"quant_method": "gguf",
                            "tensor_types": {"model.layers.0.self_attn.q_proj.weight": "Q4_1",
                                             ...}}

present only when at least one tensor is kept quantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import structlog

from checkpoints.files import CheckpointError

log = structlog.get_logger("checkpoints.gguf")

MARKER_FILE = "folio-gguf.json"  # written last: a directory without it is not finished
CONVERTER_VERSION = 4  # bump when the output for the same file changes; old entries rebuild
_FREE_SPACE_MARGIN = 1.05


def convert(gguf_file: Path, out_dir: Path, sha256: str, progress: bool) -> None:
    """Write the checkpoint for `gguf_file` into the existing, empty `out_dir`."""
    import gguf

    from checkpoints.gguf.hf_config import (
        build_config,
        build_generation_config,
        read_config_tensors,
        tensor_names,
    )
    from checkpoints.gguf.hf_tokenizer import write_tokenizer
    from checkpoints.gguf.reader import Metadata, open_gguf
    from checkpoints.gguf.weights import (
        is_expert,
        kept_quantized,
        plan_tensors,
        write_safetensors,
    )

    reader = open_gguf(gguf_file)
    meta = Metadata(gguf_file, reader)
    if meta.get("split.count", 1) != 1:
        raise CheckpointError(gguf_file, f"is part {meta.get('split.no', 0) + 1} of a GGUF split "
                                         f"into {meta.get('split.count')} files; merge them "
                                         "into one file first (llama.cpp's gguf-split --merge)")
    config = build_config(meta, tensor_names(reader), read_config_tensors(gguf_file, reader))
    num_tokens = len(meta.get("tokenizer.ggml.tokens") or ())
    if num_tokens > config["vocab_size"]:  # fewer is fine: embeddings are often padded
        raise CheckpointError(gguf_file, f"its tokenizer lists {num_tokens} tokens, more than "
                                         f"the model's {config['vocab_size']} embeddings")
    plan = plan_tensors(gguf_file, reader, config)
    kept = kept_quantized(plan)
    if kept:
        config["quantization_config"] = {"quant_method": "gguf", "tensor_types": kept}
    out_bytes = sum(t.n_bytes if t.name in kept else
                    t.n_elements * (2 if t.kind == gguf.GGMLQuantizationType.F16 else 4)
                    for t in plan)
    _check_free_space(gguf_file, out_dir, out_bytes)
    types = sorted({t.kind.name for t in plan})
    experts = [t for t in plan if is_expert(t.name)]
    moe = ({"expert_tensors": len(experts),
            "expert_out_bytes": sum(t.n_bytes if t.name in kept else 4 * t.n_elements
                                    for t in experts)} if experts else {})
    log.info("converting GGUF to a checkpoint (once per file; linear weights, embedding and "
             "LM head of Q8_0/Q4_0/Q4_1/Q4_K/Q6_K stay quantized, MoE experts included; the "
             "rest is dequantized)",
             file=str(gguf_file), architecture=config["architectures"][0],
             tensors=len(plan), tensor_types=",".join(types), kept_quantized=len(kept),
             params=sum(t.n_elements for t in plan), out_bytes=out_bytes,
             out_dir=str(out_dir), **moe)
    write_tokenizer(meta, out_dir)
    files = write_safetensors(plan, config, out_dir, progress, kept)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps(build_generation_config(meta), indent=2) + "\n")
    marker = {"converter_version": CONVERTER_VERSION, "source": str(gguf_file),
              "sha256": sha256, "weight_files": [f.name for f in files]}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _check_free_space(gguf_file: Path, out_dir: Path, out_bytes: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if free < out_bytes * _FREE_SPACE_MARGIN:
        raise CheckpointError(gguf_file, f"converting it needs about {out_bytes / 2**30:.1f} GiB "
                                         f"in {out_dir.parent}, which has "
                                         f"{free / 2**30:.1f} GiB free (set $FOLIO_CACHE_DIR "
                                         "to a larger disk)")
