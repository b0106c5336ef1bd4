"""4-bit GPTQ and AWQ test checkpoints, quantized by round to nearest (RTN), in the on-disk
layout GPTQModel / AutoGPTQ and AutoAWQ write, and their float64 dequantization.

The values are RTN, not GPTQ's (Hessian error feedback) or AWQ's (activation-aware scaling)
algorithms: what Folio's loaders read is the layout, which is the same. Every decoder
projection (``*_proj.weight``, [N, K] = [out_features, in_features]) is quantized; embeddings,
norms, biases and the LM head stay as the source checkpoint has them.

GPTQ (quant_method "gptq", checkpoint format "gptq" = v1), per quantized module ``prefix``:

- ``prefix.qweight`` int32 [K/8, N]: input rows k = 8r..8r+7 of output column n in word
  [r, n], row 8r + j in bits 4j..4j+3 (low bits first). Columns stay in checkpoint order
  even with act order; `g_idx` says which group each one belongs to.
- ``prefix.qzeros`` int32 [G, N/8]: zero point z of group g, output n in word [g, n // 8],
  bits 4(n % 8)..; v1 stores z - 1 (so a v1 loader adds 1 back).
- ``prefix.scales`` fp16 [G, N]; ``prefix.g_idx`` int32 [K]: the group of every input row.
- G = ceil(K / group_size), or 1 for group_size -1 (one group over all of K).
- Without desc_act g_idx[k] = k // group_size. With desc_act the rows are quantized in an
  order `perm` (GPTQ's: by Hessian diagonal, so shared by the modules that read one input;
  here: a seeded random permutation per input) and groups are
  taken along it: g_idx[perm[i]] = i // group_size.
- W[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n].
- sym: z = 8 and scale = 2 max|w| / 15 (GPTQ's quantizer). Asymmetric: the group's range
  [min(w, 0), max(w, 0)] is spread over 14 steps, not 15, so that z >= 1: v1's z - 1 is then
  never -1, which the tools store as nibble 15 and read back inconsistently (GPTQModel's v1 to
  v2 conversion adds 0x11111111 and carries into the next nibble).
- config.json ``quantization_config`` and ``quantize_config.json`` (GPTQModel writes both):
  bits, group_size, desc_act, sym, ``lm_head: false`` (the LM head is not quantized),
  quant_method / format / checkpoint_format "gptq", pack_dtype "int32".

AWQ (quant_method "awq", version "gemm", zero_point true), per quantized module:

- ``prefix.qweight`` int32 [K, N/8]: outputs n = 8c..8c+7 of input row k in word [k, c], in
  AWQ's interleaved order: nibble i (bits 4i..4i+3) holds output 8c + AWQ_ORDER[i].
- ``prefix.qzeros`` int32 [G, N/8], the zero points packed the same way (stored as is, no -1).
- ``prefix.scales`` fp16 [G, N]; G = K / group_size (group_size must divide K); no g_idx.
- W[n, k] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n].
- The range is [min(w, 0), max(w, 0)] over 15 steps (AutoAWQ's pseudo-quantizer uses the bare
  min and max, which can clip an all-positive group; including 0 keeps every error <= scale/2).
- config.json ``quantization_config``: quant_method, zero_point, group_size, bits, version,
  ``modules_to_not_convert: null`` (AutoAWQ never quantizes the LM head).

Every scale is the smallest fp16 at or above the exact one, so no group's range clips and
|W - dequantized| <= scale / 2 for every weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.quant_checkpoints import _copy_dir, edit_config, projection_weights

PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
_MIN_SCALE = 2.0 ** -14  # fp16's smallest normal: the scale of an all-zero group


def group_index(k: int, group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """[K] int64: the group of every input row, groups taken along `perm` (default: k order)."""
    size = k if group_size == -1 else group_size
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // size
    return g_idx


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 >= x, element-wise (round to nearest may round a scale down)."""
    h = x.half()
    low = h.float() < x
    h[low] = torch.nextafter(h[low], torch.full_like(h[low], float("inf")))
    return h


def rtn_int4(weight: torch.Tensor, g_idx: torch.Tensor, sym: bool, steps: int = 15
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest: (q [N, K] int64 in 0..15, scales [N, G] fp16, zeros [N, G] int64),
    W ~ (q - zeros[:, g_idx]) * scales[:, g_idx]; `steps` spans an asymmetric group's range."""
    w = weight.float()
    n, _ = w.shape
    num_groups = int(g_idx.max()) + 1
    index = g_idx.expand(n, -1)
    # Including 0 (include_self over zeros) keeps 0 exactly representable and z in range.
    wmax = w.new_zeros(n, num_groups).scatter_reduce(1, index, w, "amax")
    wmin = w.new_zeros(n, num_groups).scatter_reduce(1, index, w, "amin")
    if sym:
        scales = _fp16_at_least((2 * torch.maximum(wmax, -wmin) / 15).clamp_min(_MIN_SCALE))
        zeros = torch.full((n, num_groups), 8, dtype=torch.long)
    else:
        scales = _fp16_at_least(((wmax - wmin) / steps).clamp_min(_MIN_SCALE))
        zeros = torch.round(-wmin / scales.float()).long().clamp(15 - steps, 15)
    q = torch.round(w / scales.float()[:, g_idx]).long() + zeros[:, g_idx]
    return q.clamp(0, 15), scales, zeros


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2^32-1 -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack_along_rows(v: torch.Tensor) -> torch.Tensor:
    """[R, C] int64 nibbles -> int32 [R/8, C]: row 8r + j in bits 4j of word [r, c]."""
    r, c = v.shape
    shifts = (4 * torch.arange(PACK)).view(1, PACK, 1)
    return _as_int32((v.reshape(r // PACK, PACK, c) << shifts).sum(1))


def _pack_along_cols(v: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, C] int64 nibbles -> int32 [R, C/8]: column 8c + order[i] in bits 4i of word [r, c]."""
    r, c = v.shape
    shifts = (4 * torch.arange(PACK)).view(1, 1, PACK)
    nibbles = v.reshape(r, c // PACK, PACK)[:, :, list(order)]
    return _as_int32((nibbles << shifts).sum(2))


def _check_shape(name: str, n: int, k: int, group_size: int, awq: bool) -> None:
    if n % PACK or k % PACK:
        raise ValueError(f"{name}: [{n}, {k}] is not a multiple of {PACK} in both dimensions")
    if awq and (group_size < 1 or k % group_size):
        raise ValueError(f"{name}: AWQ needs a group_size dividing K={k}, got {group_size}")
    if group_size == 0 or group_size < -1:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")


def write_gptq_checkpoint(src: Path, dst: Path, group_size: int = 128, desc_act: bool = False,
                          sym: bool = True, seed: int = 0) -> Path:
    """`src` (a float checkpoint dir) as a 4-bit GPTQ v1 checkpoint in `dst` (RTN values);
    with desc_act the modules reading one input (q|k|v, gate|up: GPTQ's Hessian, hence its
    order, comes from the input) share a permutation, each input its own from one generator
    seeded `seed`."""
    _copy_dir(src, dst)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for name in projection_weights(tensors):
        prefix = name.removesuffix(".weight")
        w = tensors.pop(name)
        n, k = w.shape
        _check_shape(name, n, k, group_size, awq=False)
        block, _, module = prefix.rpartition(".")
        shared = (block, k) if module in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                          "up_proj") else (prefix, k)
        if desc_act and shared not in perms:
            perms[shared] = torch.randperm(k, generator=gen)
        perm = perms.get(shared) if desc_act else None
        g_idx = group_index(k, group_size, perm)
        q, scales, zeros = rtn_int4(w, g_idx, sym, steps=15 if sym else 14)
        tensors[f"{prefix}.qweight"] = _pack_along_rows(q.T.contiguous())
        tensors[f"{prefix}.qzeros"] = _pack_along_cols((zeros - 1).T.contiguous(),
                                                       tuple(range(PACK)))
        tensors[f"{prefix}.scales"] = scales.T.contiguous()
        tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = {"bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "lm_head": False, "quant_method": "gptq", "format": "gptq",
              "checkpoint_format": "gptq", "pack_dtype": "int32", "true_sequential": True,
              "meta": {"quantizer": ["folio-tests:rtn"]}}
    edit_config(dst, quantization_config=config)
    (dst / "quantize_config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_awq_checkpoint(src: Path, dst: Path, group_size: int = 128) -> Path:
    """`src` (a float checkpoint dir) as a 4-bit AWQ GEMM checkpoint in `dst` (RTN values)."""
    _copy_dir(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in projection_weights(tensors):
        prefix = name.removesuffix(".weight")
        w = tensors.pop(name)
        n, k = w.shape
        _check_shape(name, n, k, group_size, awq=True)
        q, scales, zeros = rtn_int4(w, group_index(k, group_size), sym=False)
        tensors[f"{prefix}.qweight"] = _pack_along_cols(q.T.contiguous(), AWQ_ORDER)
        tensors[f"{prefix}.qzeros"] = _pack_along_cols(zeros.T.contiguous(), AWQ_ORDER)
        tensors[f"{prefix}.scales"] = scales.T.contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    edit_config(dst, quantization_config={
        "quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4,
        "version": "gemm", "modules_to_not_convert": None})
    return dst


# The reading side below is written from the format description above, not from the writers:
# it shares no packing code with them.

def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int64 [..., W, 8]: nibble j of each word (bits 4j..4j+3) at j."""
    unsigned = words.long() & 0xFFFFFFFF
    return (unsigned.unsqueeze(-1) >> (4 * torch.arange(PACK))) & 0xF


def _gptq_weight(t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    qweight = t[f"{prefix}.qweight"]  # [K/8, N]
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    q = _nibbles(qweight).permute(0, 2, 1).reshape(k, n)  # row 8r + j from nibble j
    z = _nibbles(t[f"{prefix}.qzeros"]).reshape(-1, n) + 1  # [G, N]; v1 stores z - 1
    g = t[f"{prefix}.g_idx"].long()
    w = (q - z[g]).double() * t[f"{prefix}.scales"].double()[g]  # [K, N]
    return w.T.contiguous()


def _awq_weight(t: dict[str, torch.Tensor], prefix: str, group_size: int) -> torch.Tensor:
    inverse = [AWQ_ORDER.index(j) for j in range(PACK)]  # output 8c + j is in nibble inverse[j]
    qweight = t[f"{prefix}.qweight"]  # [K, N/8]
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    q = _nibbles(qweight)[..., inverse].reshape(k, n)
    z = _nibbles(t[f"{prefix}.qzeros"])[..., inverse].reshape(-1, n)
    g = torch.arange(k) // group_size
    w = (q - z[g]).double() * t[f"{prefix}.scales"].double()[g]  # [K, N]
    return w.T.contiguous()


def int4_reference_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """{"<prefix>.weight": float64 [N, K]} for every 4-bit module of a GPTQ (v1) or AWQ (gemm)
    checkpoint dir, dequantized from its files by the definitions in this module's docstring."""
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    tensors = load_file(model_dir / "model.safetensors")
    prefixes = sorted(n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight"))
    match config["quant_method"]:
        case "gptq":
            return {f"{p}.weight": _gptq_weight(tensors, p) for p in prefixes}
        case "awq":
            return {f"{p}.weight": _awq_weight(tensors, p, config["group_size"])
                    for p in prefixes}
        case method:
            raise ValueError(f"not a 4-bit GPTQ/AWQ checkpoint: quant_method {method!r}")


def write_int4_dequantized_checkpoint(quant_dir: Path, dst: Path,
                                      round_to: torch.dtype | None = None) -> Path:
    """The float checkpoint the GPTQ/AWQ checkpoint `quant_dir` equals: its 4-bit modules
    replaced by `int4_reference_weights` (stored fp32; exact, since (q - z) * scale needs at
    most 15 significant bits), the quantization config dropped. `round_to` (fp16) rounds each
    weight through that dtype first: GPTQModel's torch kernels multiply by those values."""
    _copy_dir(quant_dir, dst)
    tensors = load_file(quant_dir / "model.safetensors")
    for name, weight in int4_reference_weights(quant_dir).items():
        prefix = name.removesuffix(".weight")
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            tensors.pop(f"{prefix}.{part}", None)
        tensors[name] = (weight.to(round_to) if round_to else weight).float()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "quantize_config.json").unlink(missing_ok=True)
    return dst
