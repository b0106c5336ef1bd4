"""GGUF files written from tiny HF checkpoints, the way llama.cpp's converter writes them.

`write_gguf(hf_dir, path, tensor_type)` reads an HF checkpoint directory (tests/checkpoints.py
makes them) and writes one GGUF with the `gguf` package's writer: the architecture's metadata
under llama.cpp's key names, a gpt2-style BPE tokenizer (tokens, token types, merges, special
ids, pre-tokenizer name, chat template), and the tensors under llama.cpp's names. As llama.cpp
does: llama q/k rows are permuted for its interleaved RoPE, llama3 RoPE scaling becomes a
`rope_freqs` tensor, 1-D tensors stay F32, and 2-D ones take the requested type.

This is test-side code, written from llama.cpp's documented behaviour, independent of the
converter under test (checkpoints/gguf).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

# HF model_type -> GGUF architecture (llama.cpp writes Mistral as llama)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from [half | half] to pairs."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(config: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling: the divisor of each inverse frequency."""
    rope = config["rope_parameters"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_metadata(writer, arch: str, config: dict, name: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if config.get("head_dim") is not None:  # llama.cpp states head_dim when the config does
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)


def _write_tokenizer(writer, hf_dir: Path) -> None:
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    gen_config = json.loads((hf_dir / "generation_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab |= {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "ids must be dense"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex, as tests/checkpoints.py trains
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_pad_token_id(vocab[tok_config["pad_token"]])
    # The chat turn's end, which generation_config lists as a second stop id.
    extra_stops = [i for i in gen_config["eos_token_id"] if i != vocab[tok_config["eos_token"]]]
    if extra_stops:
        writer.add_eot_token_id(extra_stops[0])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    writer.add_add_eos_token(False)
    writer.add_chat_template(tok_config["chat_template"])


def write_gguf(hf_dir: Path, path: Path, tensor_type: str = "F16", name: str = "folio-test",
               encode: Callable[[str, np.ndarray], tuple[np.ndarray, object]] | None = None,
               write_tokenizer: Callable[[object], None] | None = None) -> Path:
    """Write `hf_dir`'s model as a GGUF at `path`, 2-D tensors as `tensor_type` ("F32", "F16",
    "BF16" or a type gguf can quantize to, e.g. "Q8_0"). `encode(gguf_name, values)` may
    override the stored (data, type) per tensor, e.g. to hold hand-made quantized blocks;
    `write_tokenizer(writer)` replaces the tokenizer metadata taken from `hf_dir`."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    weights = load_file(str(hf_dir / "model.safetensors"))
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, config, name)
    if write_tokenizer is not None:
        write_tokenizer(writer)
    else:
        _write_tokenizer(writer, hf_dir)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "BF16": gguf.LlamaFileType.MOSTLY_BF16}.get(
                              tensor_type, gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if (config.get("rope_parameters") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    for hf_name in sorted(weights):
        values = weights[hf_name].astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            values = llama_cpp_permute(values, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            values = llama_cpp_permute(values, config["num_key_value_heads"])
        gguf_name = gguf_tensor_name(hf_name)
        if encode is not None and (custom := encode(gguf_name, values)) is not None:
            data, kind = custom
        elif values.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            data, kind = values, gguf.GGMLQuantizationType.F32
        else:
            data, kind = gguf.quants.quantize(values, qtype), qtype
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_gguf(arch: str, tensor_type: str, root: Path, **overrides) -> tuple[Path, Path]:
    """(hf_dir, gguf_file) under `root`: a tiny random `arch` checkpoint (tests/checkpoints.py,
    `overrides` to its config) and the GGUF written from it. Biases and q/k norm weights get
    random values first (HF inits them at 0 and 1), so a dropped or misplaced one would show."""
    from safetensors.numpy import load_file, save_file

    from tests.checkpoints import make_checkpoint

    hf_dir = make_checkpoint(arch, root / "hf", **overrides)
    weights = load_file(str(hf_dir / "model.safetensors"))
    rng = np.random.default_rng(sum(map(ord, arch)))
    for name, values in weights.items():
        if name.endswith("_proj.bias"):
            weights[name] = rng.normal(0, 0.5, values.shape).astype(values.dtype)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            weights[name] = rng.uniform(0.5, 1.5, values.shape).astype(values.dtype)
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (root / "gguf").mkdir(parents=True, exist_ok=True)
    return hf_dir, write_gguf(hf_dir, root / "gguf" / f"tiny-{arch}.{tensor_type}.gguf",
                              tensor_type)
