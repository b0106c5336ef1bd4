"""gpt-oss with MXFP4 experts, as openai ships it (tests/fixtures/mxfp4_checkpoints.py): the
experts are dequantized at load, into float32 bit for bit what HF's own MXFP4 integration
(Mxfp4Config(dequantize=True)) gives, into bfloat16 those values exactly; the "model loaded"
line says so; malformed MXFP4 checkpoints and configs are refused with one line naming the
tensor or field. Greedy and logits against HF run in test_models.py, TP in
tests/executor/parallel/test_tp_gpt_oss.py, the server in tests/e2e/models/test_e2e_moe.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from checkpoints.files import CheckpointError
from executor_svc.loading.loader import load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.gpt_oss import GptOssExperts
from tests.executor.harness import MXFP4_ARCH, plain_expert_weights
from tests.executor.models.test_moe import _edit_config, _edit_tensors

CPU = torch.device("cpu")
LAYER = "model.layers.1.mlp.experts."


def _load(model_dir: Path, dtype: torch.dtype = torch.float32, **kwargs):
    return load_model(model_dir, dtype=dtype, device=CPU, max_model_len=64, **kwargs)


def _copy(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    return dest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_equal_hfs_dequantized_weights(checkpoint_cache, dtype):
    """HF dequantizes into float32 (exact: every value is a power of two times at most two
    significant bits), so bfloat16 holds the same values."""
    hf_model, model_dir = checkpoint_cache(MXFP4_ARCH)
    model = _load(model_dir, dtype)
    for layer, hf_layer in zip(model.model.layers, hf_model.model.layers, strict=True):
        experts, hf = layer.mlp.experts, hf_layer.mlp.experts
        assert isinstance(experts, GptOssExperts) and experts.loaded
        gate_up = hf.gate_up_proj.detach()  # [E, hidden, 2I], gate/up interleaved
        assert gate_up.dtype == torch.float32
        inter = hf.intermediate_size
        w13, w2 = plain_expert_weights(experts)
        assert w13.dtype == w2.dtype == dtype
        assert torch.equal(w13[:, :inter], gate_up[..., 0::2].transpose(1, 2).to(dtype))
        assert torch.equal(w13[:, inter:], gate_up[..., 1::2].transpose(1, 2).to(dtype))
        assert torch.equal(w2, hf.down_proj.detach().transpose(1, 2).to(dtype))
        bias = hf.gate_up_proj_bias.detach().to(dtype)
        assert torch.equal(experts.w13_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
        assert torch.equal(experts.w2_bias, hf.down_proj_bias.detach().to(dtype))
        # The packed tensors are gone; nothing in the layer is uint8.
        assert not hasattr(experts, "gate_up_proj_blocks")
        assert all(p.dtype == dtype for p in experts.parameters())


def test_model_loaded_line_says_the_experts_were_dequantized(checkpoint_cache):
    _, model_dir = checkpoint_cache(MXFP4_ARCH)
    with capture_logs() as logs:
        model = _load(model_dir)
    line = next(entry for entry in logs if entry["event"] == "model loaded")
    assert line["experts_dequantized_at_load"] == "mxfp4"
    assert line["quantization"] is None  # served as a float model
    experts = [m for m in model.modules() if isinstance(m, GptOssExperts)]
    # Float memory: the experts' matrices at 4 bytes an element (padded to 16-feature slabs on
    # the CPU backend), their biases too.
    matrices = sum(4 * 3 * m.num_experts * m.intermediate_size * m.hidden_size for m in experts)
    biases = sum(p.numel() * 4 for m in experts for name, p in m.named_parameters()
                 if name.endswith("bias"))
    assert matrices + biases <= line["expert_bytes"] <= 1.5 * (matrices + biases)
    # And a float checkpoint's line says nothing of the kind.
    _, float_dir = checkpoint_cache("gpt_oss")
    with capture_logs() as logs:
        _load(float_dir)
    line = next(entry for entry in logs if entry["event"] == "model loaded")
    assert "experts_dequantized_at_load" not in line


def _reshape_blocks(tensors: dict) -> None:
    name = LAYER + "gate_up_proj_blocks"
    e, rows, groups, size = tensors[name].shape
    tensors[name] = tensors[name].reshape(e, rows, groups * 2, size // 2).contiguous()


def _scales_wrong_groups(tensors: dict) -> None:
    name = LAYER + "down_proj_scales"
    tensors[name] = tensors[name][..., :-1].contiguous()


def _blocks_as_floats(tensors: dict) -> None:
    name = LAYER + "down_proj_blocks"
    tensors[name] = tensors[name].float()


def _float_matrix_too(tensors: dict) -> None:
    tensors[LAYER + "gate_up_proj"] = torch.zeros(4, 64, 256)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(LAYER + "down_proj_scales"),
     r"lacks tensors for 1 parameter\(s\) of GptOssForCausalLM: "
     r"model\.layers\.1\.mlp\.experts\.down_proj_scales$"),
    (lambda t: t.pop(LAYER + "gate_up_proj_blocks"),
     r"lacks tensors .*model\.layers\.1\.mlp\.experts\.gate_up_proj_blocks$"),
    (_reshape_blocks,
     r"checkpoint tensor model\.layers\.1\.mlp\.experts\.gate_up_proj_blocks has shape "
     r"\(4, 256, 4, 8\), the model built from config\.json expects \(4, 256, 2, 16\)"),
    (_scales_wrong_groups,
     r"checkpoint tensor model\.layers\.1\.mlp\.experts\.down_proj_scales has shape "
     r"\(4, 64, 3\), the model built from config\.json expects \(4, 64, 4\)"),
    (_blocks_as_floats,
     r"checkpoint tensor model\.layers\.1\.mlp\.experts\.down_proj_blocks: has dtype F32; "
     r"MXFP4 blocks and scales are stored as U8"),
    (_float_matrix_too,
     r"checkpoint tensor model\.layers\.1\.mlp\.experts\.gate_up_proj: is a float matrix, "
     r"but config\.json's quantization_config declares MXFP4 experts"),
])
def test_malformed_mxfp4_checkpoint_is_named(checkpoint_cache, tmp_path, edit, message):
    _, model_dir = checkpoint_cache(MXFP4_ARCH)
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_tensors(broken, edit)
    with pytest.raises(CheckpointError, match=message) as info:
        _load(broken)
    assert "\n" not in str(info.value)


def test_mxfp4_tensors_without_the_quantization_config_are_named(checkpoint_cache, tmp_path):
    _, model_dir = checkpoint_cache(MXFP4_ARCH)
    broken = _copy(model_dir, tmp_path / "broken")
    _edit_config(broken, quantization_config=None)
    with pytest.raises(CheckpointError, match=r"checkpoint tensor model\.layers\.\d\.mlp\."
                                              r"experts\.\w+_(blocks|scales): is an MXFP4 "
                                              r"tensor, but config\.json declares no "
                                              r"quantization_config 'mxfp4'"):
        _load(broken)


def test_quantization_flag(checkpoint_cache):
    """--quantization may name the checkpoint's scheme; another is refused, and mxfp4 on a
    float checkpoint says what it loads."""
    _, model_dir = checkpoint_cache(MXFP4_ARCH)
    model = _load(model_dir, quantization="mxfp4")
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.float32
    with pytest.raises(ValueError, match=r"--quantization int8 disagrees with the checkpoint, "
                                         r"whose config\.json declares mxfp4 weights"):
        _load(model_dir, quantization="int8")
    _, float_dir = checkpoint_cache("gpt_oss")
    with pytest.raises(ValueError, match=r"--quantization mxfp4 loads mxfp4 checkpoints, and "
                                         r"this one's config\.json declares no "
                                         r"quantization_config"):
        _load(float_dir, quantization="mxfp4")


_CONFIG = dict(architectures=["GptOssForCausalLM"], vocab_size=300, hidden_size=64,
               intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               quantization_config={"quant_method": "mxfp4"})


def test_config_fields_are_named():
    assert ModelConfig.from_dict(_CONFIG).mxfp4_experts
    assert not ModelConfig.from_dict({**_CONFIG, "quantization_config": None}).mxfp4_experts
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method 'mxfp4' is "
                                         r"gpt-oss's expert format; MixtralForCausalLM has no "
                                         r"MXFP4 weights"):
        ModelConfig.from_dict({**_CONFIG, "architectures": ["MixtralForCausalLM"]})
    for field, value in (("intermediate_size", 40), ("hidden_size", 48)):
        cfg = ModelConfig.from_dict({**_CONFIG, field: value, "head_dim": 16})
        with pytest.raises(ValueError, match=rf"{field} \({value}\) is not a multiple of 32: "
                                             r"MXFP4 experts"):
            GptOssExperts(cfg, torch.float32)
