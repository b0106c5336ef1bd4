"""Find a checkpoint, build its model class, and fill every parameter from safetensors.

The loader is strict: a checkpoint tensor with no home in the model, a parameter (or a shard of
a fused parameter) the checkpoint never fills, or a shape mismatch is an error naming the
tensor. Two exceptions: ``lm_head.weight`` is ignored when embeddings are tied (the model reuses
the embedding matrix), and rotary ``inv_freq`` buffers that old checkpoints carry are skipped
(the model computes its own RoPE table).
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from torch import nn

from executor_svc.attention import AttentionBackend, default_backend
from executor_svc.model_config import ModelConfig
from executor_svc.models import model_class

log = structlog.get_logger(__name__)

RANDOM_WEIGHTS_MARKER = "FOLIO_RANDOM_WEIGHTS"
_INDEX_FILE = "model.safetensors.index.json"


def resolve_model_dir(model: str, cache_dir: str | None = None) -> Path:
    """A local checkpoint directory as is; anything else is a hub id to download."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"--model {model!r} is a file; give the checkpoint's directory")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id=model, cache_dir=cache_dir,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as e:  # the hub client raises many types (offline, 404, auth, bad id)
        raise ValueError(f"--model {model!r} is not a local directory and downloading it from "
                         f"the model hub failed: {type(e).__name__}: {e}") from e
    return Path(local)


def has_random_weights(model_dir: Path) -> bool:
    return (Path(model_dir) / RANDOM_WEIGHTS_MARKER).exists()


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the shards named by the index, or model.safetensors."""
    index = model_dir / _INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index} names shards that are not there: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{model_dir} holds no model.safetensors nor {_INDEX_FILE}; only "
                     "safetensors checkpoints are supported")


def _fused_target(name: str, packed: dict[str, tuple[str, ...]]) -> tuple[str, int] | None:
    """'a.q_proj.weight' -> ('a.qkv_proj.weight', 0) when q_proj is shard 0 of qkv_proj."""
    parts = name.split(".")
    for fused, shards in packed.items():
        for shard_id, shard in enumerate(shards):
            if shard in parts:
                i = parts.index(shard)
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard_id
    return None


def load_weights(model: nn.Module, files: list[Path], tie_word_embeddings: bool) -> None:
    """Copy every checkpoint tensor into its parameter; raise on anything missing or extra."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, ...]] = getattr(model, "packed_modules", {})
    # Every (parameter, shard) that must be filled; unfused parameters have one shard, None.
    todo: set[tuple[str, int | None]] = set()
    for pname in params:
        module = model.get_submodule(pname.rsplit(".", 1)[0])
        sizes = getattr(module, "output_sizes", None)
        if sizes:
            todo.update((pname, i) for i in range(len(sizes)))
        else:
            todo.add((pname, None))
    unexpected: list[str] = []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if tie_word_embeddings and name == "lm_head.weight":
                        continue
                    target = _fused_target(name, packed)
                    pname, shard_id = target if target else (name, None)
                    if pname not in params:
                        unexpected.append(name)
                        continue
                    _copy_into(model, params[pname], pname, shard_id, f.get_tensor(name), name)
                    todo.discard((pname, shard_id))
    if unexpected:
        raise ValueError(f"checkpoint tensors with no matching parameter in "
                         f"{type(model).__name__}: {', '.join(sorted(unexpected)[:10])}"
                         + (" ..." if len(unexpected) > 10 else ""))
    if todo:
        missing = sorted(p if s is None else f"{p} (shard {s})" for p, s in todo)
        raise ValueError(f"checkpoint lacks tensors for {len(missing)} parameter(s) of "
                         f"{type(model).__name__}: {', '.join(missing[:10])}"
                         + (" ..." if len(missing) > 10 else ""))


def _copy_into(model: nn.Module, param: torch.Tensor, pname: str, shard_id: int | None,
               tensor: torch.Tensor, ckpt_name: str) -> None:
    dest = param.data
    if shard_id is not None:
        sizes = model.get_submodule(pname.rsplit(".", 1)[0]).output_sizes
        start = sum(sizes[:shard_id])
        dest = dest.narrow(0, start, sizes[shard_id])
    if dest.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                         f"the model expects {tuple(dest.shape)}")
    dest.copy_(tensor)


def effective_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The model's position limit, capped by the operator and by a sliding window."""
    max_len = cfg.max_position_embeddings
    if requested is not None:
        max_len = min(max_len, requested)
    if cfg.sliding_window is not None and cfg.sliding_window < max_len:
        log.warning("capping max_model_len at the sliding window: paged sliding-window "
                    "attention is not implemented, and within the window full attention is "
                    "exact", sliding_window=cfg.sliding_window, max_model_len=max_len)
        max_len = cfg.sliding_window
    return max_len


def load_model(model_dir: Path, *, dtype: torch.dtype, device: torch.device,
               max_model_len: int, backend: AttentionBackend | None = None,
               cfg: ModelConfig | None = None) -> nn.Module:
    """Build the registered class for the checkpoint in `model_dir` and load its weights."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    cls = model_class(cfg.architecture)
    files = safetensors_files(model_dir)
    # Parameters start on the meta device so no time goes into a random init we overwrite.
    with torch.device("meta"):
        model = cls(cfg, dtype=dtype, max_model_len=max_model_len,
                    backend=backend or default_backend(), device=device)
    model.to_empty(device=device)
    load_weights(model, files, cfg.tie_word_embeddings)
    model.eval()
    log.info("model loaded", architecture=cfg.architecture, files=len(files),
             params=sum(p.numel() for p in model.parameters()), dtype=str(dtype),
             device=str(device))
    return model
