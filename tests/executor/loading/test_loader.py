"""The loader: sharded checkpoints, strictness about missing and unexpected tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints.files import safetensors_files
from checkpoints.resolve import resolve_model_dir
from executor_svc.loading.loader import load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models import model_class
from executor_svc.models.rope import inv_freq_for
from tests.executor.harness import make_hf_model, save_checkpoint


def _load(model_dir):
    return load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                      max_model_len=64, keep_plain_weights=True)


def _rewrite(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_every_tensor(tmp_path):
    hf_model = make_hf_model("qwen3")
    model_dir = save_checkpoint(hf_model, tmp_path / "ckpt", max_shard_size="40KB")
    assert (model_dir / "model.safetensors.index.json").exists()
    assert len(safetensors_files(model_dir)) > 1
    model = _load(model_dir)
    hf_state = hf_model.state_dict()
    layer = model.model.layers[1]
    # Fused rows hold the checkpoint tensors in order q|k|v and gate|up.
    q, k, v = layer.self_attn.qkv_proj.weight.split(layer.self_attn.split_sizes)
    torch.testing.assert_close(q, hf_state["model.layers.1.self_attn.q_proj.weight"])
    torch.testing.assert_close(v, hf_state["model.layers.1.self_attn.v_proj.weight"])
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    torch.testing.assert_close(up, hf_state["model.layers.1.mlp.up_proj.weight"])
    torch.testing.assert_close(layer.self_attn.k_norm.weight,
                               hf_state["model.layers.1.self_attn.k_norm.weight"])


def test_missing_tensor_is_named(tmp_path):
    model_dir = save_checkpoint(make_hf_model("llama2"), tmp_path / "ckpt")
    _rewrite(model_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks tensors.*layers\.1\.self_attn\.qkv_proj\.weight "
                                         r"\(shard 1\)"):
        _load(model_dir)


def test_missing_lm_head_of_untied_model_is_named(tmp_path):
    model_dir = save_checkpoint(make_hf_model("llama2"), tmp_path / "ckpt")
    _rewrite(model_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lacks tensors.*lm_head\.weight"):
        _load(model_dir)


def test_unexpected_tensor_is_named(tmp_path):
    model_dir = save_checkpoint(make_hf_model("llama2"), tmp_path / "ckpt")
    _rewrite(model_dir, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight":
                                            torch.zeros(3, 3)}))
    with pytest.raises(ValueError, match=r"no matching parameter.*mlp\.extra_proj\.weight"):
        _load(model_dir)


def test_wrong_shape_is_named(tmp_path):
    model_dir = save_checkpoint(make_hf_model("llama2"), tmp_path / "ckpt")
    _rewrite(model_dir, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(65,\)"):
        _load(model_dir)


def test_tied_lm_head_and_rotary_buffers_are_tolerated(tmp_path):
    hf_model = make_hf_model("llama3")  # tied embeddings
    model_dir = save_checkpoint(hf_model, tmp_path / "ckpt")

    def add_extras(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _rewrite(model_dir, add_extras)
    model = _load(model_dir)
    assert model.lm_head_weight() is model.model.embed_tokens.weight


def test_unknown_architecture_and_bad_dirs(tmp_path):
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
        model_class("GPT2LMHeadModel")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_dir(tmp_path / "empty")
    with pytest.raises(ValueError, match="no model.safetensors"):
        safetensors_files(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_dir(str(tmp_path / "file"))


def test_hub_download_failure_is_explained(tmp_path, monkeypatch):
    # No hub here: the download fails and the error says what was tried.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not a local directory and downloading it"):
        resolve_model_dir("folio-test/no-such-model", cache_dir=str(tmp_path))


def test_old_style_rope_config_reads_like_new(tmp_path):
    base = json.loads(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}))
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "linear", "factor": 4.0}})
    new = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}})
    assert old.rope == new.rope
    assert old.rope.rope_type == "linear" and old.rope.theta == 5e5
    assert old.num_kv_heads == 2 and old.head_dim == 4


def test_freq_factors_rope_divides_each_frequency():
    # The GGUF converter's form of llama3 scaling: one divisor per rotary frequency.
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1}
    plain = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": 5e5}})
    scaled = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "freq_factors", "rope_theta": 5e5, "freq_factors": [1.0, 2.0, 4.0, 8.0]}})
    torch.testing.assert_close(inv_freq_for(scaled.rope, 8),
                               inv_freq_for(plain.rope, 8) / torch.tensor([1.0, 2.0, 4.0, 8.0]))
    with pytest.raises(ValueError, match=r"4 entries; rotary_dim 16 \(the rotated part of "
                                         r"each head\) needs 8"):
        inv_freq_for(scaled.rope, 16)
    for bad in ([], [1.0, -2.0], "8", [True]):
        with pytest.raises(ValueError, match="freq_factors"):
            ModelConfig.from_dict({**base, "rope_parameters": {
                "rope_type": "freq_factors", "freq_factors": bad}})
