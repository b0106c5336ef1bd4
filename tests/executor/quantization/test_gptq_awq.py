"""GPTQ and AWQ checkpoints: word unpacking against a per-bit reference, each format's layers
against (q - z) * scale computed here from the values packed, whole tiny models loaded from
packed tensors against the float model on the same dequantized weights, and every refusal.

The packer here is a plain loop over values (for the word-level tests, 8-bit GPTQ included);
whole checkpoints come from tests/fixtures/int4_checkpoints.py's RTN writers and their independent
reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints.files import CheckpointError
from checkpoints.quant_config import checkpoint_quant_config, resolve_quant_config
from executor_svc.loading.loader import load_model
from executor_svc.quantization.gptq import AWQ_ORDER, awq_grouped, gptq_grouped, unpack_words
from executor_svc.quantization.grouped import grouped_of
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.int4_checkpoints import (
    int4_reference_weights,
    write_awq_checkpoint,
    write_gptq_checkpoint,
)
from tests.fixtures.quant_checkpoints import edit_config

CPU = torch.device("cpu")


def pack_loop(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """uint values -> int32 words along `dim`, value i of a word at bits [bits*i, ...):
    element order[i] of each run of 32/bits (identity when None)."""
    pf = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64)
    runs = v.reshape(*v.shape[:-1], -1, pf)
    words = torch.zeros(runs.shape[:-1], dtype=torch.int64)
    for i in range(pf):
        words |= runs[..., order[i] if order else i] << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def test_unpack_words_against_the_loop_packer():
    gen = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        values = torch.randint(0, 2**bits, (3, 32, 5), generator=gen)
        for dim in (0, 1, 2):
            if values.shape[dim] % (32 // bits):
                continue
            words = pack_loop(values, bits, dim)
            assert torch.equal(unpack_words(words, bits, dim).long(), values)


def _gptq_tensors(n, k, bits, gs, act_order, gen):
    groups = -(-k // gs)
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    z = torch.randint(1, 2**bits, (groups, n), generator=gen)
    s = (torch.rand(groups, n, generator=gen) * 0.01 + 1e-3).half()
    g_idx = torch.arange(k) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    w = (q.double() - z.double()[g_idx]) * s.double()[g_idx]  # [K, N]
    return q, z, s, g_idx.int(), w.t()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("minus_one", [False, True])
def test_gptq_layer_unpacks_to_q_minus_z_times_scale(bits, act_order, minus_one):
    gen = torch.Generator().manual_seed(bits)
    n, k, gs = 24, 64, 16
    q, z, s, g_idx, w = _gptq_tensors(n, k, bits, gs, act_order, gen)
    gw = gptq_grouped(pack_loop(q, bits, 0), pack_loop(z - int(minus_one), bits, 1), s, g_idx,
                      bits, gs, minus_one)
    assert gw.bits == bits
    torch.testing.assert_close(gw.dequantize().double(), w, rtol=0, atol=0)


def test_awq_layer_unpacks_with_the_interleaved_order():
    gen = torch.Generator().manual_seed(3)
    n, k, gs = 32, 48, 16
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // gs, n), generator=gen)
    s = (torch.rand(k // gs, n, generator=gen) * 0.01 + 1e-3).half()
    g = torch.arange(k) // gs
    w = ((q.double() - z.double()[g]) * s.double()[g]).t()
    gw = awq_grouped(pack_loop(q, 4, 1, AWQ_ORDER), pack_loop(z, 4, 1, AWQ_ORDER), s, gs, 0)
    torch.testing.assert_close(gw.dequantize().double(), w, rtol=0, atol=0)
    # A row-parallel rank's rows start inside the matrix: its groups continue from there.
    part = awq_grouped(pack_loop(q[16:], 4, 1, AWQ_ORDER), pack_loop(z, 4, 1, AWQ_ORDER), s,
                       gs, 16)
    torch.testing.assert_close(part.dequantize().double(), w[:, 16:], rtol=0, atol=0)


def write_checkpoint(root: Path, fmt: str, act_order: bool = False, arch: str = "qwen2",
                     src: Path | None = None) -> Path:
    """A tiny float checkpoint as an RTN GPTQ (v1, asymmetric) or AWQ checkpoint, group 16."""
    src = src or make_checkpoint(arch, root / "float")
    if fmt == "gptq":
        return write_gptq_checkpoint(src, root / fmt, 16, desc_act=act_order, sym=False)
    return write_awq_checkpoint(src, root / fmt, 16)


@pytest.mark.parametrize("fmt, act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_packed_model_holds_the_checkpoints_dequantized_weights(tmp_path, fmt, act_order):
    """Every quantized layer holds, exactly, the weights the checkpoint's files define
    (tests/fixtures/int4_checkpoints.py reads them back on its own), the float ones released."""
    ckpt = write_checkpoint(tmp_path, fmt, act_order)
    reference = int4_reference_weights(ckpt)
    model = load_model(ckpt, dtype=torch.float32, device=CPU, max_model_len=64)
    for i, block in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for layer, names in ((block.self_attn.qkv_proj, ("q", "k", "v")),
                             (block.mlp.gate_up_proj, ("gate", "up"))):
            parts = ("self_attn." if len(names) == 3 else "mlp.")
            want = torch.cat([reference[f"{p}{parts}{n}_proj.weight"] for n in names])
            gw, perm = grouped_of(layer)
            assert (perm is not None) == act_order and gw.g_idx is None and gw.bits == 4
            if perm is not None:
                want = want[:, perm]
            assert torch.equal(gw.dequantize().double(), want)
            assert layer.weight.numel() == 0
    assert not any(n.endswith(("qweight", "qzeros", "g_idx")) for n, _ in model.named_parameters())


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False,
               "checkpoint_format": "gptq"}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True,
              "version": "gemm"}


def _tp_rank(rank: int, model_dir: str, out_dir: str) -> None:
    from tests.executor.parallel.test_tp_model import greedy_run

    result = greedy_run(Path(model_dir))
    if rank == 0:
        torch.save(result, Path(out_dir) / "tp2.pt")


@pytest.mark.parametrize("fmt, act_order", [("gptq", True), ("awq", False)])
def test_tp2_equals_tp1(tmp_path, fmt, act_order):
    """Column-parallel layers read their words of N, row-parallel ones their rows of K (an
    act-order rank keeps the groups its columns use, which are no longer whole: the kernel's
    g_idx path): TP = 2 gives TP = 1's tokens and logits."""
    from tests.executor.harness import make_hf_model, save_checkpoint
    from tests.executor.parallel.test_tp_model import greedy_run
    from tests.executor.parallel.tp_procs import run_ranks

    float_dir = save_checkpoint(make_hf_model("qwen2"), tmp_path / "ckpt")
    model_dir = write_checkpoint(tmp_path, fmt, act_order, src=float_dir)
    expected = greedy_run(model_dir)
    run_ranks(_tp_rank, 2, str(model_dir), str(tmp_path))
    got = torch.load(tmp_path / "tp2.pt")
    assert got["tokens"] == expected["tokens"]
    for a, b in zip(got["logits"], expected["logits"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_refusals(tmp_path):
    """Layouts that cannot load name what is wrong; packed integers outside a quantized
    layer are refused."""
    src = write_checkpoint(tmp_path, "gptq")
    tensors = load_file(src / "model.safetensors")
    config = (src / "config.json").read_text()
    edit_config(src, quantization_config=None)
    with pytest.raises(CheckpointError, match=r"no matching parameter.*qweight.*packed quantized "
                                              r"tensors: config\.json needs the "
                                              r"quantization_config"):
        load_model(src, dtype=torch.float32, device=CPU, max_model_len=64)
    (src / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"--quantization int8 disagrees with the checkpoint"):
        resolve_quant_config("int8", src)
    bad = dict(tensors)
    p = "model.layers.0.self_attn.o_proj."
    bad[p + "qweight"] = bad[p + "qweight"].float()
    save_file(bad, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"o_proj\.qweight has dtype F32, but its "
                                              r"quantized layer stores packed integers"):
        load_model(src, dtype=torch.float32, device=CPU, max_model_len=64)
    bad = dict(tensors)
    bad.pop(p + "qzeros")
    save_file(bad, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks tensors.*o_proj\.qzeros"):
        load_model(src, dtype=torch.float32, device=CPU, max_model_len=64)
    for qc, message in [
            ({"bits": 3}, r"gptq with bits 3 is not supported \(supported: 4, 8\)"),
            ({"group_size": 0}, r"group_size must be a positive integer or -1"),
            ({"desc_act": "yes"}, r"desc_act must be true or false"),
            ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported")]:
        with pytest.raises(ValueError, match=message):
            checkpoint_quant_config({"quantization_config": GPTQ_CONFIG | qc})
    for qc, message in [({"version": "gemv"}, r"awq version 'gemv' is not supported"),
                        ({"zero_point": False}, r"without zero points"),
                        ({"bits": 8}, r"awq with bits 8 is not supported")]:
        with pytest.raises(ValueError, match=message):
            checkpoint_quant_config({"quantization_config": AWQ_CONFIG | qc})
    float_dir = make_checkpoint("qwen2", tmp_path / "plain")
    with pytest.raises(ValueError, match=r"--quantization gptq loads gptq checkpoints"):
        resolve_quant_config("gptq", float_dir)
