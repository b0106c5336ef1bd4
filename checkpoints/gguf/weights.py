"""GGUF tensors -> HF-named safetensors shards, without torch.

Three things happen to each tensor:
1. its name goes from llama.cpp's (`blk.3.attn_q.weight`) to the HF one the loader expects
   (`model.layers.3.self_attn.q_proj.weight`);
2. a linear weight (q/k/v/o/gate/up/down projection), the embedding (`token_embd`) or the
   untied LM head (`output`) stored as one of KEPT_TYPES is kept quantized: written as its
   raw block bytes, uint8 [rows, row_bytes] (each row whole blocks, ggml's layout), its
   type listed in config.json's quantization_config (`kept_quantized`);
   the executor unpacks it at load (executor_svc/quantization/gguf_blocks.py). Every other
   tensor is dequantized by the `gguf` package: every quantized type comes out float32, F16
   stays F16, BF16 becomes float32 (numpy has no bfloat16; the widening is exact). The
   executor's loader casts to the serving dtype;
3. for the llama architecture, q and k (weights and biases) get llama.cpp's rotary permutation
   undone. llama.cpp reorders each head's rows from HF's "rotate half" layout (first half of
   the head, then second half) to interleaved pairs; undoing it restores HF's rows exactly.
   Qwen2/Qwen3 files are written unpermuted (llama.cpp runs them with NeoX-style RoPE). The
   permutation moves whole rows, and a block never spans two rows, so raw rows are permuted
   the same way. Phi-3 and Gemma files are unpermuted too (NeoX-style);
4. for Gemma 2 and 3, every RMSNorm weight (1-D, never kept raw) gets 1 subtracted: llama.cpp
   adds 1 when converting (its norm multiplies by the weight, Gemma's by 1 + weight). HF's
   1 + (w - 1) is then the file's w exactly.

Phi-3's fused tensors keep their HF form: `attn_qkv` is ``self_attn.qkv_proj`` (q|k|v rows) and
`ffn_up` holds gate|up, which is ``mlp.gate_up_proj``.

Mixture-of-experts layers: llama.cpp merges a layer's experts into one tensor per projection,
`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, ggml dims [cols, rows, experts], i.e.
numpy [experts, rows, cols] once reversed like every other tensor's. Each becomes one HF tensor
per expert (`mlp.experts.E.gate_proj`..., Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`),
expert E's slice of the merged tensor: its rows are whole rows of blocks, so the same slice of
the raw bytes is that expert's raw rows (`PlannedTensor.data`). The router `ffn_gate_inp` is
``mlp.gate`` (Mixtral ``block_sparse_moe.gate``), Qwen2-MoE's shared expert
`ffn_{gate,up,down}_shexp` is ``mlp.shared_expert.*`` and its 1-D gate `ffn_gate_inp_shexp`
becomes ``mlp.shared_expert_gate.weight`` [1, hidden]. Expert projections of a KEPT_TYPES type
stay raw like any projection (KEEP_EXPERTS_RAW), gate and up only when their merged tensors
share one type (the executor stacks them); down on its own. A merged tensor has one type, so
within a layer every expert is stored alike: gate|up raw or float, down raw or float.

Every tensor the model needs must be there with the shape the config implies, and nothing else
may be: a mismatch is refused here, naming the GGUF file, before anything is written.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.files import INDEX_FILE, CheckpointError
from checkpoints.gguf.hf_config import CONFIG_TENSORS
from checkpoints.quant_config import GGUF_TYPES

SHARD_BYTES = 2 << 30  # bounds the memory a conversion holds to one shard of float32 tensors

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per HF model_type: names that differ from (or add to) the ones above.
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_QWEN_MOE_NAMES = {"ffn_gate_inp": "mlp.gate",
                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj",
                   "ffn_down_shexp": "mlp.shared_expert.down_proj",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_FAMILY_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_NAMES,
    "gemma3_text": _GEMMA_NAMES,
    "qwen2_moe": _QWEN_MOE_NAMES,
    "qwen3_moe": _QWEN_MOE_NAMES,
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
}
# Merged expert tensors (one per projection, every expert) -> the HF name of expert E's.
_QWEN_EXPERTS = {"ffn_gate_exps": "mlp.experts.{}.gate_proj",
                 "ffn_up_exps": "mlp.experts.{}.up_proj",
                 "ffn_down_exps": "mlp.experts.{}.down_proj"}
_EXPERT_NAMES = {
    "qwen2_moe": _QWEN_EXPERTS,
    "qwen3_moe": _QWEN_EXPERTS,
    "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
                "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{}.w2"},
}
MOE_TYPES = tuple(_EXPERT_NAMES)
GEMMA_TYPES = ("gemma2", "gemma3_text")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERT_TENSOR = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.\w+"
                            r"\.weight")

KEPT_TYPES = GGUF_TYPES  # block types whose linear, embedding and LM head matrices stay raw
# Whether expert projections of a KEPT_TYPES type stay raw blocks too: each expert's raw rows
# are listed in tensor_types like any projection's, and the executor serves them through one
# GGUF-block linear per expert and projection (executor_svc/quantization/experts.py). Off,
# they would be dequantized to float32 and cost float memory.
KEEP_EXPERTS_RAW = True
_VOCAB_MATRICES = ("model.embed_tokens.weight", "lm_head.weight")  # rows: one per token
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "qkv_proj", "gate_up_proj",  # Phi-3's, already one tensor
            "w1", "w3", "w2")  # Mixtral's experts
# Projections of one module the executor fuses into one matrix (q|k|v, gate|up, and a MoE
# layer's gate|up of every expert): kept raw only if all share one type (one parameter of raw
# rows holds them, and rows of different types differ in length).
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


@dataclass(frozen=True)
class PlannedTensor:
    """One HF tensor to write and where its values are: a GGUF tensor, or for a merged expert
    tensor one expert's slice of it (`expert`). `shape` is the HF shape."""

    tensor: Any  # gguf.ReaderTensor
    name: str
    shape: tuple[int, ...]
    expert: int | None = None

    @property
    def kind(self):
        return self.tensor.tensor_type

    @property
    def data(self) -> np.ndarray:
        """The stored values (raw bytes for a block type): the expert's [rows, row_bytes]
        slice of a merged tensor's [experts, rows, row_bytes]."""
        return self.tensor.data if self.expert is None else self.tensor.data[self.expert]

    @property
    def num_parts(self) -> int:  # the tensor's experts, 1 for an ordinary tensor
        return 1 if self.expert is None else int(self.tensor.shape[-1])

    @property
    def n_bytes(self) -> int:
        return int(self.tensor.n_bytes) // self.num_parts

    @property
    def n_elements(self) -> int:
        return int(self.tensor.n_elements) // self.num_parts


def hf_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The HF parameter name for a GGUF tensor name in a `model_type` model, None if it has no
    HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **_FAMILY_NAMES.get(model_type, {})}
    if m and m[2] in names:
        return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
    return None


def expert_names(gguf_name: str, model_type: str, num_experts: int) -> list[str] | None:
    """The HF names of every expert's tensor in a merged expert tensor (in expert order), None
    when `gguf_name` is not one in a `model_type` model."""
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    names = _EXPERT_NAMES.get(model_type, {})
    if not m or m[2] not in names or m[3] != "weight":
        return None
    return [f"model.layers.{m[1]}.{names[m[2]].format(e)}.weight" for e in range(num_experts)]


def is_expert(hf_name: str) -> bool:
    return _EXPERT_TENSOR.fullmatch(hf_name) is not None


def _merged_name(hf_name: str, model_type: str) -> str:
    """The GGUF tensor an HF name comes from where that is a merged expert tensor, else the
    HF name itself (for messages)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.\d+\.(\w+)\.weight", hf_name)
    if is_expert(hf_name) and m:
        for gguf, pattern in _EXPERT_NAMES[model_type].items():
            if pattern.rsplit(".", 1)[-1] == m[3]:
                return f"blk.{m[1]}.{gguf}.weight"
    return hf_name


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the model built from `config` needs, with its shape."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]  # Phi-3: none
    vocab = config["vocab_size"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (q_rows, hidden),
                   p + "self_attn.k_proj.weight": (kv_rows, hidden),
                   p + "self_attn.v_proj.weight": (kv_rows, hidden),
                   p + "self_attn.o_proj.weight": (hidden, q_rows),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
        if config["model_type"] == "qwen2" or config.get("attention_bias") or config.get(
                "qkv_bias"):  # Qwen2-MoE's q/k/v biases
            shapes |= {p + "self_attn.q_proj.bias": (q_rows,),
                       p + "self_attn.k_proj.bias": (kv_rows,),
                       p + "self_attn.v_proj.bias": (kv_rows,)}
        if config.get("attention_bias"):  # HF's attention_bias covers o_proj too
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"):
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,),
                       p + "self_attn.k_norm.weight": (head_dim,)}
        if config["model_type"] == "phi3":  # the parts stored as one tensor each
            for part in ("q_proj", "k_proj", "v_proj"):
                del shapes[p + f"self_attn.{part}.weight"]
            del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
            shapes |= {p + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
                       p + "mlp.gate_up_proj.weight": (2 * inter, hidden)}
        if config["model_type"] in GEMMA_TYPES:  # a norm after attention and around the MLP
            shapes |= {p + name + ".weight": (hidden,) for name in _GEMMA_NAMES.values()}
        if config["model_type"] in MOE_TYPES:
            for part in ("gate_proj", "up_proj", "down_proj"):
                del shapes[p + f"mlp.{part}.weight"]
            shapes |= _moe_shapes(config, p)
    return shapes


def _moe_shapes(config: dict[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's tensors (prefix `p`): the router, every expert's projections, and
    Qwen2-MoE's shared expert and its gate."""
    hidden = config["hidden_size"]
    model_type = config["model_type"]
    num_experts = config.get("num_local_experts") or config["num_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]  # Mixtral's
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    shapes = {f"{p}{block}.gate.weight": (num_experts, hidden)}
    gate, up, down = (_EXPERT_NAMES[model_type][f"ffn_{w}_exps"] for w in ("gate", "up", "down"))
    for e in range(num_experts):
        shapes |= {f"{p}{gate.format(e)}.weight": (inter, hidden),
                   f"{p}{up.format(e)}.weight": (inter, hidden),
                   f"{p}{down.format(e)}.weight": (hidden, inter)}
    shared = config.get("shared_expert_intermediate_size") or 0
    if shared:
        shapes |= {p + "mlp.shared_expert.gate_proj.weight": (shared, hidden),
                   p + "mlp.shared_expert.up_proj.weight": (shared, hidden),
                   p + "mlp.shared_expert.down_proj.weight": (hidden, shared),
                   p + "mlp.shared_expert_gate.weight": (1, hidden)}
    return shapes


def plan_tensors(path: Path, reader, config: dict[str, Any]) -> list[PlannedTensor]:
    """Every HF tensor to write, checked against the config: names, shapes, completeness and
    whether the gguf package can dequantize the tensor's type. A merged expert tensor plans
    one tensor per expert."""
    expected = expected_shapes(config)
    model_type = config["model_type"]
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    plan: list[PlannedTensor] = []
    checked_types: set[Any] = set()
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists dims inner first
        experts = expert_names(tensor.name, model_type, num_experts)
        names = experts or [hf_name(tensor.name, model_type)]
        if any(name is None or name not in expected for name in names):
            raise CheckpointError(path, f"tensor {tensor.name} has no place in a "
                                        f"{config['architectures'][0]} built from this file's "
                                        "metadata")
        if experts is not None:
            want = (num_experts, *expected[names[0]])
            if len(shape) == 3 and shape[1:] == want[1:] and shape[0] != num_experts:
                raise CheckpointError(path, f"tensor {tensor.name} holds {shape[0]} experts; "
                                            f"metadata {_ARCH_KEY[model_type]}.expert_count "
                                            f"says {num_experts}")
        else:
            want = expected[names[0]]
            if names[0].endswith("shared_expert_gate.weight") and shape == want[1:]:
                shape = want  # llama.cpp stores HF's [1, hidden] as [hidden]
        if shape != want:
            raise CheckpointError(path, f"tensor {tensor.name} has shape {shape}; the metadata "
                                        f"implies {want}")
        if tensor.tensor_type not in checked_types:
            _check_dequantizable(path, tensor)
            checked_types.add(tensor.tensor_type)
        for e, name in enumerate(names):
            plan.append(PlannedTensor(tensor, name, expected.pop(name),
                                      e if experts is not None else None))
    if expected:
        missing = sorted({_merged_name(name, model_type) for name in expected})
        raise CheckpointError(path, f"lacks {len(missing)} tensor(s) a "
                                    f"{config['architectures'][0]} needs, e.g. "
                                    f"{', '.join(missing[:5])}")
    return plan


# The GGUF architecture whose metadata states a model_type's expert count (for messages).
_ARCH_KEY = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _check_dequantizable(path: Path, tensor) -> None:
    import gguf

    kind = tensor.tensor_type
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return
    try:  # one row is enough to learn whether the package implements this type
        gguf.quants.dequantize(tensor.data[:1], kind)
    except NotImplementedError:
        raise CheckpointError(path, f"tensor {tensor.name} is stored as {kind.name}, which "
                                    "cannot be dequantized (supported: F32, F16, BF16, Q4_0, "
                                    "Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K and the "
                                    "IQ types)") from None


def kept_quantized(plan: list[PlannedTensor]) -> dict[str, str]:
    """HF name -> GGUF type of every matrix written as raw blocks (see the module docstring):
    the embedding, the untied LM head and a projection's weight of a KEPT_TYPES type, where
    the projections fused with it have the same type; expert projections only while
    KEEP_EXPERTS_RAW. The others are dequantized."""
    keep_experts = KEEP_EXPERTS_RAW  # read per call: the one place that decides
    types = {t.name: t.kind.name for t in plan}
    kept = {name: kind for name, kind in types.items() if kind in KEPT_TYPES
            and (keep_experts or not is_expert(name))
            and (name in _VOCAB_MATRICES
                 or name.endswith(".weight") and name.split(".")[-2] in _LINEARS)}
    for name in [n for n in kept if n not in _VOCAB_MATRICES]:
        module, projection = name.removesuffix(".weight").rsplit(".", 1)
        for group in _FUSED:
            if projection in group and len({types.get(f"{module}.{m}.weight")
                                             for m in group}) > 1:
                del kept[name]
    return kept


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows were reordered from
    [first half | second half] to interleaved pairs (h0, h_half, h1, h_half+1, ...)."""
    rows = weights.shape[0]
    per_head = rows // num_heads
    # llama.cpp: reshape(heads, 2, half, ...).swapaxes(1, 2); this is its inverse.
    w = weights.reshape(num_heads, per_head // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weights.shape))


def dequantize(planned: PlannedTensor, config: dict[str, Any], raw: bool = False) -> np.ndarray:
    """The tensor's values in HF layout: float32, or float16 where the file holds F16; with
    `raw`, its block bytes, uint8 [rows, row_bytes]."""
    import gguf

    name, shape, data = planned.name, planned.shape, planned.data
    if raw:
        values = np.array(data, dtype=np.uint8).reshape(shape[0], -1)
    elif planned.kind == gguf.GGMLQuantizationType.F16:
        values = np.array(data, dtype=np.float16).reshape(shape)
    else:
        values = np.asarray(gguf.quants.dequantize(data, planned.kind),
                            dtype=np.float32).reshape(shape)
    if config["model_type"] in ("llama", "mixtral"):
        if ".self_attn.q_proj." in name:
            values = unpermute_rotary(values, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            values = unpermute_rotary(values, config["num_key_value_heads"])
    elif config["model_type"] in GEMMA_TYPES and name.endswith("norm.weight") and not raw:
        values = values.astype(np.float32) - np.float32(1.0)  # llama.cpp stored 1 + w
    return np.ascontiguousarray(values)


def write_safetensors(plan: list[PlannedTensor], config: dict[str, Any], out_dir: Path,
                      progress: bool, kept: dict[str, str]) -> list[Path]:
    """Write every planned tensor into `out_dir`, the `kept` ones (kept_quantized) as raw
    blocks, the others dequantized: one model.safetensors, or shards of at most SHARD_BYTES
    plus the index when the model is larger. Returns the files written."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0
    tmp_files: list[Path] = []
    weight_map: dict[str, int] = {}  # HF name -> shard number

    def flush() -> None:
        nonlocal shard, shard_bytes
        tmp = out_dir / f".shard-{len(tmp_files)}.safetensors"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp_files.append(tmp)
        shard, shard_bytes = {}, 0

    with tqdm(plan, desc="converting GGUF tensors", unit="tensor", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for planned in bar:
            name = planned.name
            values = dequantize(planned, config, raw=name in kept)
            if shard and shard_bytes + values.nbytes > SHARD_BYTES:
                flush()
            shard[name] = values
            shard_bytes += values.nbytes
            weight_map[name] = len(tmp_files)
        flush()
    if len(tmp_files) == 1:
        final = [out_dir / "model.safetensors"]
    else:
        n = len(tmp_files)
        final = [out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, dest in zip(tmp_files, final, strict=True):
        tmp.chmod(0o644)  # safetensors creates it private; the cache is meant to be shared
        tmp.rename(dest)
    if len(final) > 1:
        import json

        index = {"metadata": {"total_size": sum(f.stat().st_size for f in final)},
                 "weight_map": {name: final[i].name for name, i in sorted(weight_map.items())}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return final
