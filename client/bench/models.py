"""The checkpoint every peer runs: resolved the way `folio serve` resolves `--model`, or built.

Folio takes a checkpoint directory, a GGUF file, a hub id or a `folio:` name; vLLM and HF need
a Hugging Face checkpoint directory. `resolve_model_dir` goes through Folio's own resolution
(checkpoints/: `folio:` names, GGUF files converted once into the cache), so
every peer loads the very files Folio loads.

`--random-model NAME` builds a random-weight checkpoint from a real model's config (seeded,
cached under $FOLIO_CACHE_DIR/bench-models, default ~/.cache/folio/bench-models). It carries
Folio's small tokenizer (ids beyond its 2048 entries decode to nothing; the benchmark sends
token ids, and vLLM runs with skip_tokenizer_init) and the FOLIO_RANDOM_WEIGHTS marker.

    python -m client.bench.models NAME [--seed S] [--cache-dir D]   # builds it, prints the dir
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = 1
INITIALIZER_RANGE = 0.1  # wider than HF's 0.02 so greedy argmaxes are not float-noise ties

# The published configs of the models whose shapes the benchmark plan names.
RANDOM_MODELS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    ),
}
# SmolLM2-135M's sizes as a Mistral (which Mistral-7B's config shapes: head_dim given, no
# attention or MLP bias) with and without a sliding window: a pair that differs only in the
# window, for `folio bench context` (decode time as the context grows past the window).
_SMOLLM2_AS_MISTRAL = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=49152,
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
)
RANDOM_MODELS["smollm2-135m-mistral"] = dict(_SMOLLM2_AS_MISTRAL, sliding_window=None)
RANDOM_MODELS["smollm2-135m-swa256"] = dict(_SMOLLM2_AS_MISTRAL, sliding_window=256)
# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of
# intermediate 768, top 8, its vocabulary) in 4 layers instead of 48, stored in bf16 (6 GB; fp32
# would need 12), and a dense Qwen3 with the same active parameters per token: one SwiGLU MLP of
# intermediate 8 * 768 = 6144. `folio bench context` runs them side by side: a MoE decode step
# should cost what its active experts cost.
_QWEN3_30B_A3B_LAYERS = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False, save_dtype="bfloat16",
)
RANDOM_MODELS["qwen3-30b-a3b-4l"] = dict(
    _QWEN3_30B_A3B_LAYERS, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
RANDOM_MODELS["qwen3-30b-a3b-4l-dense"] = dict(
    _QWEN3_30B_A3B_LAYERS, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
    intermediate_size=8 * 768)
MARKER = "FOLIO_RANDOM_WEIGHTS"


def bench_models_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    from checkpoints.cache_dir import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "bench-models"


def random_model_dir(name: str, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                     python: str = sys.executable) -> Path:
    """The cached random checkpoint `name`, built first (in a subprocess: it needs torch)."""
    if name not in RANDOM_MODELS:
        raise ValueError(f"--random-model is one of {', '.join(RANDOM_MODELS)}, got {name!r}")
    target = bench_models_dir(cache_dir) / f"{name}-random-seed{seed}-v{VERSION}"
    if (target / MARKER).exists():
        return target
    argv = [python, "-m", "client.bench.models", name, "--seed", str(seed), "--out", str(target)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the random {name} checkpoint failed:\n{done.stderr[-2000:]}")
    return target


def resolve_model_dir(model: str | None) -> Path:
    """The Hugging Face checkpoint directory behind a `folio serve --model` value, resolved as
    the scheduler resolves it (a GGUF file converted by the converter's own process)."""
    from checkpoints import named_models, resolve

    if named_models.is_named(model):
        model = str(named_models.named_model_path(model))
    return resolve.resolve_model_dir(model, hub_files=resolve.HUB_CONFIG_FILES,
                                     convert_gguf=resolve.convert_in_subprocess)


def peer_model_dir(model_dir: Path) -> Path:
    """The checkpoint the peers (vLLM, HF) load: `model_dir` itself, or for a converted GGUF
    file whose raw blocks Folio keeps quantized (quant_method gguf, which no peer reads) a
    cached float copy (checkpoints/gguf/dequantize.py)."""
    quant = read_config(model_dir).get("quantization_config") or {}
    if quant.get("quant_method") != "gguf":
        return model_dir
    from checkpoints.gguf.dequantize import dequantized_copy

    target = bench_models_dir() / f"{model_dir.name}-float"
    if not (target / "config.json").exists():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        dequantized_copy(model_dir, partial)
        partial.rename(target)
    return target


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def max_model_len(config: dict) -> int:
    return int(config.get("max_position_embeddings") or 2048)


def sliding_window(config: dict) -> int | None:
    """The sliding window every layer of `config` attends within, as Folio reads it (None:
    full attention; Qwen2-style configs carry a window they use only with use_sliding_window)."""
    if not config.get("sliding_window") or config.get("use_sliding_window") is False:
        return None
    return int(config["sliding_window"])


def _write_random_model(name: str, seed: int, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    from checkpoints.tiny_random import (
        build_tokenizer,
        special_token_ids,
        write_tokenizer,
    )

    hf_logging.disable_progress_bar()
    tok = build_tokenizer()
    ids = special_token_ids(tok)
    fields = dict(RANDOM_MODELS[name])
    model_type = fields.pop("model_type")
    save_dtype = fields.pop("save_dtype", "float32")  # built and written in it
    config = AutoConfig.for_model(
        model_type, **fields, initializer_range=INITIALIZER_RANGE, dtype=save_dtype,
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, save_dtype)).eval()
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                     pad_token_id=ids["pad_token_id"]).save_pretrained(out_dir)
    write_tokenizer(tok, out_dir)
    (out_dir / MARKER).write_text(f"random {name} (folio bench), seed {seed}, v{VERSION}\n")


def build(name: str, seed: int, target: Path) -> Path:
    """Write into a temp dir beside `target` and rename it into place: a concurrent or
    interrupted build never leaves a half-written checkpoint under the final name."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_random_model(name, seed, tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.bench.models",
                                description="Build a random-weight benchmark checkpoint.")
    p.add_argument("name", choices=sorted(RANDOM_MODELS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="target directory (default: the cache)")
    args = p.parse_args(argv)
    if args.out is None:
        print(random_model_dir(args.name, args.seed))
        return 0
    print(build(args.name, args.seed, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def model_facts(model_dir: Path, folio_model: str, config: dict, max_model_len: int) -> dict:
    """The result file's "model" entry: what every peer loaded."""
    return {"dir": str(model_dir), "folio_model": folio_model,
            "architecture": (config.get("architectures") or ["?"])[0],
            "random_weights": (model_dir / MARKER).exists(),
            "max_model_len": max_model_len, "config": config}
