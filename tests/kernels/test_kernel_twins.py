"""The torch twins against oracles from elsewhere: transformers' Llama modules and dense
attention in float64. fp32 CPU runs of Folio must match transformers token for token, so the
elementwise twins are held to bitwise equality.
"""

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import (
    apply_rotary_pos_emb as phi3_apply_rotary_pos_emb,
)

from kernels import twins


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _llama3_config(head_dim: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 1024},
    )  # fmt: skip


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_transformers(with_residual):
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96)
    x, residual = torch.randn(11, 96), torch.randn(11, 96)
    if with_residual:
        out, new_residual = twins.rms_norm(x, norm.weight.data, 1e-5, residual)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(out, norm(residual + x))
    else:
        assert torch.equal(twins.rms_norm(x, norm.weight.data, 1e-5), norm(x))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_is_transformers_llama3(head_dim):
    rotary_emb = LlamaRotaryEmbedding(_llama3_config(head_dim))
    max_position, num_tokens = 4096, 13
    # The model builds the cache once: cos | sin halves of transformers' per-position tables.
    cos, sin = rotary_emb(
        torch.zeros(1), torch.arange(max_position)[None]
    )  # [1, max_pos, head_dim]
    cos_sin_cache = torch.cat((cos[0, :, : head_dim // 2], sin[0, :, : head_dim // 2]), dim=-1)
    positions = torch.randint(0, max_position, (num_tokens,))
    q, k = torch.randn(num_tokens, 4, head_dim), torch.randn(num_tokens, 2, head_dim)
    # transformers' layout: [batch, heads, seq, head_dim] with tables gathered at the positions.
    cos_p, sin_p = rotary_emb(torch.zeros(1), positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_p, sin_p
    )
    twins.rotary(positions, q, k, cos_sin_cache)
    assert torch.equal(q, q_ref[0].transpose(0, 1))
    assert torch.equal(k, k_ref[0].transpose(0, 1))


@pytest.mark.parametrize("head_dim, factor", [(128, 0.75), (32, 0.75), (64, 0.5)])
def test_partial_rotary_on_views_is_transformers_phi3(head_dim, factor):
    """Phi-4-mini's partial RoPE: the model hands the twin the first rotary_dim columns of each
    head as strided views, with a rotary_dim-wide table; transformers' Phi-3 rotates the same
    columns of whole heads and passes the rest through."""
    rotary_dim = int(head_dim * factor)
    config = Phi3Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=4096,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": factor})
    rotary_emb = Phi3RotaryEmbedding(config)
    max_position, num_tokens, half = 4096, 13, rotary_dim // 2
    cos, sin = rotary_emb(torch.zeros(1), torch.arange(max_position)[None])
    assert cos.shape[-1] == rotary_dim
    cos_sin_cache = torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)
    positions = torch.randint(0, max_position, (num_tokens,))
    qkv = torch.randn(num_tokens, 8 * head_dim)  # q | k | v of one fused projection
    q = qkv[:, :4 * head_dim].view(num_tokens, 4, head_dim)
    k = qkv[:, 4 * head_dim:6 * head_dim].view(num_tokens, 2, head_dim)
    cos_p, sin_p = rotary_emb(torch.zeros(1), positions[None])
    q_ref, k_ref = phi3_apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_p, sin_p)
    v_before = qkv[:, 6 * head_dim:].clone()
    twins.rotary(positions, q[..., :rotary_dim], k[..., :rotary_dim], cos_sin_cache)
    assert torch.equal(q, q_ref[0].transpose(0, 1))
    assert torch.equal(k, k_ref[0].transpose(0, 1))
    assert torch.equal(qkv[:, 6 * head_dim:], v_before)


def test_silu_and_mul_is_gate_times_up():
    x = torch.randn(6, 2 * 48)
    gate, up = x[:, :48], x[:, 48:]
    assert torch.equal(twins.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


def test_store_kv_writes_only_valid_slots():
    k_cache = torch.full((3, 4, 2, 8), float("nan"))
    v_cache = k_cache.clone()
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    twins.store_kv(key, value, k_cache, v_cache, torch.tensor([9, -1, 2]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[0, 2], value[2])
    assert k_cache.isnan().sum() == (12 - 2) * 16  # 12 slots, 2 written


def _dense_attention(q, k, v, q_len, scale):  # [q_len, H, D], [L, Hkv, D] -> [q_len, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    seq_len = k.shape[0]
    visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_is_dense_causal_attention(paged_batch, dtype):
    seqs = [(23, 23), (33, 1), (70, 13), (9, 1)]
    batch = paged_batch(seqs, 8, 2, 64, 16, dtype, device=torch.device("cpu"))
    out = twins.paged_attention(*batch.args())
    block_size = batch.k_cache.shape[1]
    for i, (seq_len, q_len) in enumerate(seqs):
        # Read the context back position by position: an independent walk of the block table.
        pos = torch.arange(seq_len)
        block_ids = batch.block_tables[i].long()[pos // block_size]
        k = batch.k_cache[block_ids, pos % block_size]
        v = batch.v_cache[block_ids, pos % block_size]
        start = int(batch.query_start_loc[i])
        expected = _dense_attention(batch.q[start : start + q_len], k, v, q_len, batch.scale)
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(
            out[start : start + q_len].double(), expected, atol=tol, rtol=tol
        )
