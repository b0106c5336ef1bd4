"""A checkpoint's KV cache scales: the static fp8 scales of a quantized KV cache.

llm-compressor and vLLM's fp8 checkpoints carry, per decoder layer, ``self_attn.k_scale`` and
``self_attn.v_scale`` (some writers nest them as ``self_attn.attn.k_scale``): fp32, a scalar
(per tensor) or ``[num_kv_heads]`` (per head), meaning value = fp8 code * scale. They are not
weights of any module: the loader skips them (`is_kv_scale_name`) and this module reads them
for `--kv-cache-dtype fp8`. Without them fp8 uses 1.0 (vLLM's default); int8 computes its
scales as it stores (kernels/kv_quant.py) and ignores them.
"""

from __future__ import annotations

import re
from pathlib import Path

import structlog
import torch

from checkpoints.files import open_safetensors, read_weight_headers, safetensors_files
from executor_svc.loading.model_config import ModelConfig, local_kv_heads
from executor_svc.models.parallel import kv_head_start

log = structlog.get_logger(__name__)

_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")


class KVScaleError(ValueError):
    """A KV scale tensor of the wrong shape or value, named."""


def is_kv_scale_name(name: str) -> bool:
    return _NAME.match(name) is not None


def default_scales(cfg: ModelConfig, tp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k_scale, v_scale) [local KV heads] fp32 of 1.0 per layer."""
    ones = torch.ones(local_kv_heads(cfg, tp_size))
    return [(ones, ones) for _ in range(cfg.num_layers)]


def read_kv_scales(model_dir: Path, cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0,
                   ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per layer (k_scale, v_scale) for this rank's KV heads, [local_kv_heads] fp32, from the
    checkpoint; None when it has none. A checkpoint with scales for some layers or one of K/V
    only, a shape other than a scalar or [num_kv_heads], or a scale not finite and > 0 is
    refused (KVScaleError naming the tensor)."""
    files = safetensors_files(model_dir)
    headers = [h for h in read_weight_headers(files) if is_kv_scale_name(h.name)]
    if not headers:
        return None
    found: dict[tuple[int, str], torch.Tensor] = {}
    heads = local_kv_heads(cfg, tp_size)
    start = kv_head_start(cfg.num_kv_heads, tp_size, tp_rank)
    for h in headers:
        match = _NAME.match(h.name)
        assert match is not None
        layer, kind = int(match.group(1)), match.group(2)
        if layer >= cfg.num_layers:
            raise KVScaleError(f"{h.name}: the model has {cfg.num_layers} layers")
        with open_safetensors(h.file, "pt") as f:
            value = f.get_tensor(h.name).float().reshape(-1)
        if value.numel() == 1:
            value = value.expand(cfg.num_kv_heads)
        elif value.numel() != cfg.num_kv_heads:
            raise KVScaleError(f"{h.name} has shape {h.shape}: a KV scale is a scalar or one "
                               f"per KV head ({cfg.num_kv_heads})")
        if not (torch.isfinite(value).all() and (value > 0).all()):
            raise KVScaleError(f"{h.name} holds a scale that is not finite and > 0")
        found[layer, kind] = value[start:start + heads].clone()
    missing = [f"layer {i} {kind}_scale" for i in range(cfg.num_layers) for kind in "kv"
               if (i, kind) not in found]
    if missing:
        raise KVScaleError(f"the checkpoint's KV scales lack {', '.join(missing[:6])}"
                           + (" ..." if len(missing) > 6 else ""))
    log.info("KV cache scales read from the checkpoint", layers=cfg.num_layers,
             per_head=any(h.shape not in ((), (1,)) for h in headers))
    return [(found[i, "k"], found[i, "v"]) for i in range(cfg.num_layers)]
