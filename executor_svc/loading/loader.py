"""Build a checkpoint's model class and fill every parameter from safetensors.

The loader is strict: a checkpoint tensor with no home in the model, a parameter (or a shard of
a fused parameter) the checkpoint never fills, or a shape mismatch is a `CheckpointError`
naming the file and the tensor. It is found from the safetensors headers while the model is
still on the meta device, before any weight memory is allocated. Two exceptions:
``lm_head.weight`` is ignored when embeddings are tied (the model reuses the embedding matrix),
and rotary ``inv_freq`` buffers that old checkpoints carry are skipped (the model computes its
own RoPE table). Damaged files themselves are caught by `checkpoints.files`.

Tensor parallel: each parameter's layer says which slice of its checkpoint tensor this rank
holds (`WeightShard`, models/parallel.py); the headers are checked against the whole tensor's
shape, and each rank reads only its slices from the files, never a whole sharded tensor.

Fused projections (qkv_proj, gate_up_proj) are filled part by part: from one checkpoint tensor
per part (q_proj, k_proj, v_proj: the model's `packed_modules`), or from one tensor that
already stacks the parts under the fused name (Phi-3), each part's slice read from its rows.
A mixture-of-experts layer (models/moe.py's `Experts`: `FusedMoE`, `GptOssExperts`) places its
own tensors (`checkpoint_placements`: one per expert and projection, or transformers 5's stacked
3-D ones); its shards are named by the per-expert tensors, so a missing expert is reported by its name.
gpt-oss's MXFP4 experts load as their uint8 blocks and scales and are dequantized by the layer's
`finish_loading` (models/gpt_oss.py); no linear layer is quantized for them.
Experts a quantized checkpoint stores quantized (a converted GGUF file's raw expert blocks
included) load into one linear per expert and projection (executor_svc/quantization/experts.py),
each tensor placed by name like a fused projection's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

import kernels
from checkpoints.files import (
    INDEX_FILE,
    PACKED_DTYPES,
    CheckpointError,
    TensorHeader,
    open_safetensors,
    read_weight_headers,
    safetensors_files,
)
from checkpoints.quant_config import resolve_quant_config
from executor_svc.host_memory import return_freed_memory
from executor_svc.kv.kv_scales import is_kv_scale_name
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models import model_class
from executor_svc.models.linear import TiedHead, cpu_linear_method, use_linear_method
from executor_svc.models.moe import Experts, PackedCpuExperts, use_experts_method
from executor_svc.models.parallel import WeightShard, prefused_shard, replicated
from executor_svc.quantization.experts import prepare_expert_linears
from executor_svc.quantization.gguf_loading import gguf_weight_shard, prepare_gguf_params
from executor_svc.quantization.loading import (
    check_header_dtype,
    prepare_checkpoint_params,
    quantize_model,
    scale_shard,
)
from executor_svc.step.attention import AttentionBackend, default_backend

log = structlog.get_logger(__name__)

RANDOM_WEIGHTS_MARKER = "FOLIO_RANDOM_WEIGHTS"


def has_random_weights(model_dir: Path) -> bool:
    return (Path(model_dir) / RANDOM_WEIGHTS_MARKER).exists()


def _fused_target(name: str, packed: dict[str, tuple[str, ...]]) -> tuple[str, int] | None:
    """'a.q_proj.weight' -> ('a.qkv_proj.weight', 0) when q_proj is shard 0 of qkv_proj."""
    parts = name.split(".")
    for fused, shards in packed.items():
        for shard_id, shard in enumerate(shards):
            if shard in parts:
                i = parts.index(shard)
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard_id
    return None


def checkpoint_targets(model: nn.Module, name: str,
                       packed: dict[str, tuple[str, ...]]) -> list[tuple[str, int | None]]:
    """The (parameter, fused shard id) pairs checkpoint tensor `name` fills: itself (shard
    None), one part of a fused projection ('a.k_proj.weight' -> ('a.qkv_proj.weight', 1)), or,
    when it names a fused projection's parameter itself, every part of it. An expert's tensor
    of a MoE layer in its per-expert form (quantized experts) goes where the layer says
    (`Experts.linear_target`); ValueError for an expert past the configured count."""
    expert = _expert_linear_target(model, name)
    if expert is not None:
        return [expert]
    target = _fused_target(name, packed)
    if target is not None:
        return [target]
    module_name = name.rpartition(".")[0]
    try:
        sizes = getattr(model.get_submodule(module_name), "output_sizes", None)
    except AttributeError:
        sizes = None  # no such module: reported as a tensor with no matching parameter
    if sizes:
        return [(name, shard_id) for shard_id in range(len(sizes))]
    return [(name, None)]


def _experts_owner(model: nn.Module, name: str) -> tuple[nn.Module, str, str] | None:
    """(the module, its name, the tensor's name relative to it) when checkpoint tensor `name`
    lies under an ``experts`` module of the model, else None."""
    match = _EXPERTS.fullmatch(name)
    if match is None:
        return None
    try:
        return model.get_submodule(match.group(1)), match.group(1), match.group(2)
    except AttributeError:
        return None


def _expert_linear_target(model: nn.Module, name: str) -> tuple[str, int | None] | None:
    found = _experts_owner(model, name)
    if found is None or not getattr(found[0], "has_expert_linears", False):
        return None
    owner, owner_name, key = found
    try:
        target = owner.linear_target(key)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name}: {e}") from None
    return None if target is None else (f"{owner_name}.{target[0]}", target[1])


@dataclass(frozen=True)
class _Placement:
    """One checkpoint tensor's part that this rank reads, and the parameter `pname` (and for a
    fused projection its shard `shard_id`) it fills; `shard` says which slice goes where."""

    file: Path
    name: str  # as the checkpoint spells it
    pname: str
    shard_id: int | None
    shard: WeightShard


def plan_weights(model: nn.Module, headers: list[TensorHeader],
                 tie_word_embeddings: bool) -> list[_Placement]:
    """Match every checkpoint tensor to its parameter by the headers alone.

    Run while the parameters are still on the meta device: a wrong shape (against the whole
    checkpoint tensor, whatever slice this rank reads), a tensor with no home or a parameter
    nobody fills is refused, naming the file, before any memory is allocated for a model that
    could not be loaded anyway."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, ...]] = getattr(model, "packed_modules", {})
    # Every (parameter, shard) that must be filled; unfused parameters have one shard, None.
    # A FusedMoE's (models/moe.py) shards are named by the per-expert checkpoint tensors.
    todo: set[tuple[str, int | str | None]] = set()
    for pname in params:
        module_name, _, param_name = pname.rpartition(".")
        owner = model.get_submodule(module_name)
        sizes = getattr(owner, "output_sizes", None)
        if hasattr(owner, "checkpoint_parts"):
            todo.update((pname, f"{module_name}.{label}")
                        for label in owner.checkpoint_parts(param_name))
        elif sizes:
            todo.update((pname, i) for i in range(len(sizes)))
        else:
            todo.add((pname, None))
    placements: list[_Placement] = []
    unexpected: list[TensorHeader] = []
    for header in headers:
        if header.name.endswith("rotary_emb.inv_freq"):
            continue
        if is_kv_scale_name(header.name):  # the KV cache's, not a module's (kv/kv_scales.py)
            continue
        if tie_word_embeddings and header.name == "lm_head.weight":
            continue
        experts = _expert_placements(model, header)
        if experts is not None:
            if not experts:
                unexpected.append(header)
            for pname, labels, shard in experts:
                check_header_dtype(header, params[pname])
                if header.shape != shard.full_shape:
                    raise CheckpointError(header.file, f"checkpoint tensor {header.name} has "
                                                       f"shape {header.shape}, the model built "
                                                       f"from config.json expects "
                                                       f"{shard.full_shape}")
                # shard_id 0: a part of a fused parameter (no padding rows to zero).
                placements.append(_Placement(header.file, header.name, pname, 0, shard))
                todo.difference_update((pname, label) for label in labels)
            continue
        for pname, shard_id in checkpoint_targets(model, header.name, packed):
            if pname not in params:
                unexpected.append(header)
                break
            check_header_dtype(header, params[pname])
            shard = weight_shard(model, pname, shard_id, params[pname])
            if shard_id is not None and pname == header.name:  # all the parts in one tensor
                try:
                    shard = prefused_shard(model.get_submodule(pname.rpartition(".")[0]),
                                           shard, shard_id)
                except ValueError as e:
                    raise CheckpointError(header.file, f"{header.name}: {e}") from None
            if header.shape != shard.full_shape:
                raise CheckpointError(header.file, f"checkpoint tensor {header.name} has shape "
                                                   f"{header.shape}, the model built from "
                                                   f"config.json expects {shard.full_shape}")
            placements.append(_Placement(header.file, header.name, pname, shard_id, shard))
            todo.discard((pname, shard_id))
    files = sorted({h.file for h in headers})
    # A sharded checkpoint's index speaks for all its files.
    where = files[0] if len(files) == 1 else files[0].parent / INDEX_FILE
    if unexpected:
        names = sorted(h.name for h in unexpected)
        packed = any(h.dtype in PACKED_DTYPES for h in unexpected)
        raise CheckpointError(where, f"checkpoint tensors with no matching parameter in "
                                     f"{type(model).__name__}: {', '.join(names[:10])}"
                                     + (" ..." if len(names) > 10 else "")
                                     + ("; these are packed quantized tensors: config.json "
                                        "needs the quantization_config they were written "
                                        "with" if packed else ""))
    if todo:
        missing = sorted(_missing_name(model, p, s) for p, s in todo)
        raise CheckpointError(where, f"checkpoint lacks tensors for {len(missing)} parameter(s) "
                                     f"of {type(model).__name__}: {', '.join(missing[:10])}"
                                     + (" ..." if len(missing) > 10 else ""))
    return placements


def _missing_name(model: nn.Module, pname: str, shard: int | str | None) -> str:
    """How a parameter (shard) no checkpoint tensor filled is reported: a FusedMoE's label, or
    the checkpoint's tensor name where the layer knows it (`checkpoint_names`: a MoE expert's
    linears), else the parameter and its fused shard."""
    if isinstance(shard, str):
        return shard
    module_name, _, param_name = pname.rpartition(".")
    names = getattr(model.get_submodule(module_name), "checkpoint_names", None)
    if names is not None:
        return f"{module_name.rpartition('.')[0]}.{names[shard or 0]}.{param_name}"
    return pname if shard is None else f"{pname} (shard {shard})"


_EXPERTS = re.compile(r"(.+\.experts)\.(.+)")


def _expert_placements(model: nn.Module, header: TensorHeader
                       ) -> list[tuple[str, list[str], WeightShard]] | None:
    """None when `header` is no tensor of a stacked-form `Experts` layer's (models/moe.py),
    else where it goes: (parameter, the per-expert labels it fills, shard) entries, empty when
    the experts module has no place for it. An expert past the configured count is a
    CheckpointError. A layer in its per-expert form holds linears, placed by name."""
    found = _experts_owner(model, header.name)
    if found is None:
        return None
    owner, owner_name, key = found
    if not hasattr(owner, "checkpoint_placements") or owner.has_expert_linears:
        return None
    try:
        entries = owner.checkpoint_placements(key)
        check_dtype = getattr(owner, "check_checkpoint_dtype", None)
        if entries and check_dtype is not None:  # the layer's own words for a wrong dtype
            check_dtype(key, header.dtype)
    except ValueError as e:
        raise CheckpointError(header.file, f"checkpoint tensor {header.name}: {e}") from None
    return [(f"{owner_name}.{param}", [f"{owner_name}.{label}" for label in labels],
             shard) for param, labels, shard in entries or []]


def weight_shard(model: nn.Module, pname: str, shard_id: int | None,
                 param: torch.Tensor) -> WeightShard:
    """The owning layer's `weight_shard` for this parameter (models/parallel.py); a layer
    without one (norms) holds its parameters whole on every rank. Fused projections are
    always parallel layers (one rank included), so their shards are placed there."""
    module_name, _, param_name = pname.rpartition(".")
    owner = model.get_submodule(module_name)
    if param_name in getattr(owner, "scale_layouts", {}):  # an fp8 checkpoint's scale
        return scale_shard(owner, param_name, shard_id)
    if param_name in getattr(owner, "quant_params", ()):  # a GPTQ/AWQ packed tensor
        return owner.quant_shard(param_name, shard_id)
    if param_name == "weight" and getattr(owner, "gguf_type", None) is not None:
        return gguf_weight_shard(owner, shard_id)  # raw GGUF blocks: the shard in bytes
    describe = getattr(owner, "weight_shard", None)
    return describe(param_name, shard_id) if describe is not None else replicated(param)


def load_weights(model: nn.Module, placements: list[_Placement],
                 open_file: Callable[..., Any] = open_safetensors) -> None:
    """Copy every planned checkpoint slice into its (now allocated) parameter, reading only
    this rank's slice from the file (safetensors' get_slice reads just those bytes).
    `open_file` is `open_safetensors`'s signature (tests wrap it to record the reads)."""
    params = dict(model.named_parameters())
    by_file: dict[Path, list[_Placement]] = {}
    for p in placements:
        by_file.setdefault(p.file, []).append(p)
    with torch.no_grad():
        for file, entries in by_file.items():
            with open_file(file, framework="pt") as f:
                for p in entries:
                    _copy_shard(f, p, params[p.pname].data)


def _copy_shard(f: Any, p: _Placement, dest: torch.Tensor) -> None:
    shard = p.shard
    if shard.expert is not None:  # one expert's tensor, into its slice of the stack
        dest = dest[shard.expert]
    if shard.dest_index is not None:
        dest[shard.dest_index].copy_(f.get_tensor(p.name).reshape(()))
        return
    if shard.dim is None:
        dest.copy_(f.get_tensor(p.name))
        return
    if shard.size:
        index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.size),)
        dest.narrow(shard.dim, shard.dest_start, shard.size).copy_(f.get_slice(p.name)[index])
    pad = dest.shape[shard.dim] - shard.size
    if p.shard_id is None and pad:  # the last vocab range's padding rows
        dest.narrow(shard.dim, shard.size, pad).zero_()


def effective_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The model's position limit (the scaled context for YaRN and dynamic NTK, see
    `RopeSpec.max_position`), capped by the operator. Sliding windows cap nothing: the
    attention layers honour them (`ModelConfig.layer_windows`)."""
    max_len = cfg.rope.max_position(cfg.max_position_embeddings)
    if requested is not None:
        max_len = min(max_len, requested)
    return max_len


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (-1: none, e.g. the embedding)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else -1


def load_model(model_dir: Path, *, dtype: torch.dtype, device: torch.device,
               max_model_len: int, backend: AttentionBackend | None = None,
               cfg: ModelConfig | None = None, keep_plain_weights: bool = False,
               quantization: str | None = None, num_layers: int | None = None) -> nn.Module:
    """Build the registered class for the checkpoint in `model_dir` and load its weights.
    `keep_plain_weights`: the CPU backend may release the plain linear weights once it has
    its own forms of them (prepare_for_device); True keeps them readable (tests, tools).
    `quantization`: --quantization (int8, fp8, gguf or None); an fp8 checkpoint or a
    converted GGUF file's raw blocks are quantized whatever it says
    (executor_svc/quantization). `num_layers`: keep only the first N decoder layers (a
    draft model cut from the served one, executor_svc/spec/draft.py); the others' tensors are
    skipped, every kept parameter is still filled."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    if num_layers is not None and num_layers < cfg.num_layers:
        cfg = cfg.with_num_layers(num_layers)
    qcfg = resolve_quant_config(quantization, model_dir)
    if qcfg is not None and qcfg.scheme == "mxfp4":
        # gpt-oss's experts only (cfg.mxfp4_experts): they dequantize themselves as they load
        # (models/gpt_oss.py), and every linear layer holds float weights.
        qcfg = None
    try:
        cls = model_class(cfg.architecture)
    except ValueError as e:  # the architecture named by config.json
        raise CheckpointError(model_dir / "config.json", str(e)) from None
    files = safetensors_files(model_dir)
    headers = read_weight_headers(files)
    if num_layers is not None:
        headers = [h for h in headers if _layer_index(h.name) < cfg.num_layers]
    log.info("loading model", model_dir=str(model_dir), architecture=cfg.architecture,
             files=len(files), bytes=sum(f.stat().st_size for f in files))
    # Parameters start on the meta device so no time goes into a random init we overwrite,
    # and the checkpoint's headers are checked against their shapes before any allocation.
    with torch.device("meta"):
        try:
            model = cls(cfg, dtype=dtype, max_model_len=max_model_len,
                        backend=backend or default_backend(), device=device)
        except ValueError as e:  # a value the model class refuses comes from config.json
            raise CheckpointError(model_dir / "config.json", str(e)) from None
    if qcfg is not None and qcfg.from_checkpoint:
        packed = getattr(model, "packed_modules", {})
        types = qcfg.tensor_types or {}  # gguf: the tensors stored as raw blocks
        if num_layers is not None:  # a cut copy: the layers kept
            types = {name: kind for name, kind in types.items()
                     if _layer_index(name) < cfg.num_layers}
        try:
            # Experts stored quantized: one linear per expert and projection.
            if qcfg.scheme == "gguf":
                prepare_expert_linears(model, headers, lambda h: h.name in types)
            else:
                prepare_expert_linears(model, headers)
            targets = [(pname, shard_id, h) for h in headers
                       for pname, shard_id in checkpoint_targets(model, h.name, packed)]
            if qcfg.scheme == "gguf":
                prepare_gguf_params(model, targets, types, model_dir / "config.json")
            else:
                prepare_checkpoint_params(model, targets, qcfg)
        except ValueError as e:
            raise CheckpointError(model_dir / "config.json", str(e)) from None
    placements = plan_weights(model, headers, cfg.tie_word_embeddings)
    model.to_empty(device=device)
    load_weights(model, placements)
    finish = getattr(model, "finish_loading", None)
    if finish is not None:  # a family's fix-up of the checkpoint's values (Gemma's norms)
        with torch.no_grad():
            finish()
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    if qcfg is not None:
        quantize_model(model, qcfg)
    prepare_for_device(model, device, dtype, keep_plain_weights)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    # This rank's bytes (tensor parallel: its shards); of them, the experts' (MoE models).
    moe_facts = {"expert_bytes": sum(map(model_weight_bytes, experts))} if experts else {}
    if cfg.mxfp4_experts:  # served in the model dtype (quantization None): say from what
        moe_facts["experts_dequantized_at_load"] = "mxfp4"
    log.info("model loaded", architecture=cfg.architecture, files=len(files),
             params=num_params, dtype=str(dtype), device=str(device),
             quantization=qcfg.scheme if qcfg is not None else None,
             weight_bytes=model_weight_bytes(model), **moe_facts)
    return model


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model's modules hold once prepared: parameters, buffers and
    the forms linear methods attach (packed or quantized weights, scales), each storage once."""
    seen: set[int] = set()
    total = 0
    holders = [*model.modules(), *(m for m in vars(model).values() if isinstance(m, TiedHead))]
    for holder in holders:  # a tied LM head is no module, but holds its method's forms
        for value in vars(holder).values():
            if isinstance(value, dict):
                tensors = value.values()
            elif is_dataclass(value):  # a method's packed form (kernels/cpu_quant.py slabs)
                tensors = [getattr(value, f.name) for f in fields(value)]
            else:
                tensors = [value]
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.is_meta:
                    continue
                try:
                    key = t.untyped_storage().data_ptr()
                except (RuntimeError, NotImplementedError):  # opaque (oneDNN-packed) tensors
                    key = id(t)
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total



def prepare_for_device(model: nn.Module, device: torch.device, dtype: torch.dtype,
                       keep_plain_weights: bool = False) -> None:
    """After the weights are in place: give the linear layers the method for this device
    (models/linear.py). On the CPU backend that may pre-pack weights; with FOLIO_KERNELS=torch
    (the twins, the oracle path) and on CUDA the layers keep plain F.linear."""
    probe = torch.empty(0, device=device)
    if not kernels.cpu_backend_active(probe):
        return
    method = cpu_linear_method(dtype, kernels.cpu.has_native_bf16(), keep_plain_weights)
    with torch.no_grad():
        num_layers = use_linear_method(model, method)
    log.info("cpu linear layers prepared", method=type(method).__name__, layers=num_layers,
             dtype=str(dtype), native_bf16=kernels.cpu.has_native_bf16())
    if kernels.cpu.fused_kernels() is not None:  # MoE experts into the fused kernel's slabs
        with torch.no_grad():
            num_experts = use_experts_method(model, PackedCpuExperts(keep_plain_weights),
                                             return_freed_memory)
        if num_experts:
            log.info("cpu experts packed", layers=num_experts)
    # Built (or loaded from its cache) now, before the first step rather than inside it.
    log.info("cpu fused kernels", enabled=kernels.cpu.fused_kernels() is not None,
             isa=kernels.cpu_ext.capability(), cpu_isa=kernels.cpu_ext.cpu_capability())
    if dtype != torch.float32 and not kernels.cpu.has_native_bf16():
        log.warning("no native bf16/fp16 matmuls (no AVX512-BF16/AMX, or "
                    "ATEN_CPU_CAPABILITY forced a narrower ISA): 16-bit "
                    "weights halve memory but compute in fp32 and run slower than "
                    "--dtype float32 here", dtype=str(dtype))
