"""Quantized test checkpoints and their float references, from the tiny float checkpoints.

- `write_fp8_checkpoint`: an fp8 checkpoint as vLLM / llm-compressor write them: every
  projection's weight in e4m3 with a ``weight_scale`` per tensor (a scalar) or per channel
  ([N, 1]), optionally a static ``input_scale``, and ``quantization_config`` in config.json;
  embeddings, norms and the LM head stay float (``ignored_layers: ["lm_head"]``).
- `write_dequantized_checkpoint`: the float checkpoint a quantized model equals: every weight
  Folio quantizes replaced by its dequantization ``q.float() * scale``, so HF transformers
  serves as the oracle of the quantized model, token for token.
- `write_gptq_checkpoint` / `write_awq_checkpoint` (tests/int4_checkpoints.py): 4-bit GPTQ
  and AWQ checkpoints in the real tools' on-disk layout, by round to nearest (not GPTQ's or
  AWQ's algorithms); `int4_reference_weights` their float64 dequantization, read back from
  the files; `write_int4_dequantized_checkpoint` the float checkpoint they equal.

The quantized values come from Folio's own quantizer for quantize-at-load (the function under
test is the model, not the rounding), and from this file's for fp8 checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def projection_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the weights Folio quantizes: every projection (not embeddings, norms or
    the LM head)."""
    return sorted(n for n in tensors if n.endswith("_proj.weight"))


def _copy_dir(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


def fp8_quantize(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale [N, 1] or []) as llm-compressor's fp8 recipe stores them."""
    w = weight.float()
    absmax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = absmax / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(src: Path, dst: Path, per_channel: bool,
                         static_input: bool = False) -> Path:
    _copy_dir(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in projection_weights(tensors):
        prefix = name.removesuffix(".weight")
        tensors[name], tensors[f"{prefix}.weight_scale"] = fp8_quantize(tensors[name],
                                                                        per_channel)
        if static_input:
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.02)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    edit_config(dst, quantization_config={
        "quant_method": "fp8", "activation_scheme": "static" if static_input else "dynamic",
        "ignored_layers": ["lm_head"]})
    return dst


def edit_config(model_dir: Path, **fields) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config, indent=2))


def write_dequantized_checkpoint(src: Path, dst: Path, scheme: str) -> Path:
    """`src` (float, or fp8) with its projections as the `scheme` ("int8", "fp8" quantized at
    load, or "checkpoint" for an fp8 checkpoint's own) model holds them, dequantized."""
    from executor_svc.quantization.methods import METHODS

    _copy_dir(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in projection_weights(tensors):
        prefix = name.removesuffix(".weight")
        if scheme == "checkpoint":
            scale = tensors.pop(f"{prefix}.weight_scale").float()
            tensors.pop(f"{prefix}.input_scale", None)
            q = tensors[name]
            scale = scale.reshape(-1)[:, None] if scale.numel() > 1 else scale
        else:
            q, scale = METHODS[scheme]().quantize(tensors[name])
            scale = scale[:, None]
        tensors[name] = q.float() * scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

