"""Flags -> ExecutorConfig, memory sizes, and KV cache sizing from a budget."""

from __future__ import annotations

import pytest
import torch

from checkpoints.rope import RopeSpec
from executor_svc.cli import build_parser, config_from_args
from executor_svc.config import ExecutorConfig, parse_memory
from executor_svc.kv.kv_cache import bytes_per_block, num_blocks_for
from executor_svc.loading.model_config import ModelConfig


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5 GiB", int(1.5 * 2**30)),
    ("100", 100), ("64kb", 64_000), ("3G", 3 * 2**30),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "5 parsecs", "-1GiB", "GiB"])
def test_parse_memory_rejects_nonsense(text):
    with pytest.raises(ValueError, match="cannot read memory size"):
        parse_memory(text)


def test_flags_build_a_frozen_config():
    args = build_parser().parse_args([
        "--model", "/m", "--kv-cache-memory", "256MiB", "--block-size", "32", "--dtype",
        "float16", "--device", "cpu", "--max-model-len", "1024", "--log-format", "json"])
    cfg = config_from_args(args)
    assert cfg == ExecutorConfig(model="/m", kv_cache_memory=256 * 2**20, block_size=32,
                                 dtype="float16", device="cpu", max_model_len=1024,
                                 log_format="json")
    with pytest.raises(AttributeError):
        cfg.block_size = 8  # type: ignore[misc]


def test_graph_flags():
    cfg = config_from_args(build_parser().parse_args(["--model", "/m"]))
    assert (cfg.max_num_seqs, cfg.enforce_eager) == (256, False)  # graphs on where CUDA is
    cfg = config_from_args(build_parser().parse_args(
        ["--model", "/m", "--max-num-seqs", "12", "--enforce-eager"]))
    assert (cfg.max_num_seqs, cfg.enforce_eager) == (12, True)
    with pytest.raises(ValueError, match="--max-num-seqs must be at least 1"):
        ExecutorConfig(model="/m", max_num_seqs=0)


def _cfg(num_layers=2, num_kv_heads=2, head_dim=16) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64,
                       intermediate_size=8, num_layers=num_layers, num_heads=4,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                       max_position_embeddings=128, rope=RopeSpec())


def test_kv_blocks_from_memory_budget():
    cfg = _cfg()
    per_block = bytes_per_block(cfg, 16, torch.float16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 2  # k+v, layers, block, kv heads, head_dim, bytes
    cpu = torch.device("cpu")
    assert num_blocks_for(cfg, 16, torch.float16, cpu, None, 10 * per_block + 5) == 10
    assert num_blocks_for(cfg, 16, torch.float16, cpu, 7, 10 * per_block) == 7  # explicit wins
    assert num_blocks_for(cfg, 16, torch.float32, cpu, None, None) == (1 << 30) // (2 * per_block)
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for(cfg, 16, torch.float16, cpu, None, per_block - 1)


@pytest.mark.parametrize("fields, expected", [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # transformers < 5 spelled it so
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),
    ({"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "auto"}, None),
    ({"dtype": "float8_e4m3fn"}, None),
    ({"dtype": ["bfloat16"]}, None),
    ({}, None),
])
def test_the_checkpoints_dtype_is_read_from_its_config(fields, expected):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_dict(base | fields).checkpoint_dtype == expected
