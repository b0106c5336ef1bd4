"""Phi-3 through the real server (`folio serve`, CPU), greedy tokens equal to HF transformers':

1. a tiny random Phi3ForCausalLM checkpoint (fused qkv_proj / gate_up_proj tensors, LongRoPE)
   with prompts of 1..200 tokens sent concurrently;
2. the same at --tensor-parallel-size 2 with a KV pool that preempts and a shared prefix (each
   rank reads its rows of each fused part);
3. --quantization int8, against HF serving the dequantized weights;
4. the model as a Q8_0 GGUF file (llama.cpp's names, attn_qkv and ffn_up holding gate|up, the
   LongRoPE factors as tensors), against HF serving the dequantized conversion;
5. Phi-4-mini's shape: RoPE on the first 3/4 of each head (partial_rotary_factor 0.75, 24 of
   32 dimensions, LongRoPE factors for those), concurrent prompts, two sharing a prefix.

The checkpoint's original context (256) holds every prompt plus its generation: HF's Phi-3
generate re-encodes a sequence with the long factors once it passes it, which a paged engine
does not (tests/executor/models/test_phi3.py covers that case against HF step by step).
"""

from __future__ import annotations

import pytest

from checkpoints.gguf import gguf_checkpoint_dir
from checkpoints.gguf.dequantize import dequantized_copy
from client import FolioClient
from tests.e2e.hf_oracle import hf_greedy, load_hf_model, random_prompts
from tests.e2e.models.test_e2e_greedy import (
    BLOCK_SIZE,
    MAX_TOKENS,
    assert_same_tokens,
    generate_all,
)
from tests.e2e.models.test_e2e_tensor_parallel import check_tp_server
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.gguf_files import write_gguf
from tests.fixtures.quant_checkpoints import write_dequantized_checkpoint

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("phi3", tmp_path_factory.mktemp("ckpt-phi3"))


async def test_phi3_concurrent_greedy_matches_hf(folio_server, checkpoint):
    hf_model = load_hf_model(checkpoint)
    prompts = random_prompts(hf_model.config.vocab_size)
    assert max(map(len, prompts)) + MAX_TOKENS <= hf_model.config.original_max_position_embeddings
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE)]) as server:
        got = await generate_all(server.address, prompts, num_sampled=2)
        with FolioClient(server.address) as client:
            assert client.model_info()["architecture"] == "Phi3ForCausalLM"
    assert_same_tokens(hf_model, prompts, hf_greedy(hf_model, prompts, MAX_TOKENS), got)


@pytest.mark.slow  # CI time: the executor-level tests cover this path
async def test_phi3_tp2_with_preemption_and_prefix_caching(folio_server, tmp_path):
    await check_tp_server(folio_server, "phi3", 2, tmp_path)


@pytest.mark.slow  # CI time: the executor-level tests cover this path
async def test_phi3_int8_matches_hf_on_the_dequantized_weights(folio_server, checkpoint,
                                                               tmp_path):
    reference = load_hf_model(write_dequantized_checkpoint(checkpoint, tmp_path / "deq", "int8"))
    prompts = random_prompts(reference.config.vocab_size, (1, 7, 17, 64, 131), seed=4)
    args = ["--block-size", str(BLOCK_SIZE), "--quantization", "int8"]
    with folio_server(model=checkpoint, args=args) as server:
        got = await generate_all(server.address, prompts)
    assert_same_tokens(reference, prompts, hf_greedy(reference, prompts, MAX_TOKENS), got)


@pytest.mark.slow  # CI time: the executor-level tests cover this path
async def test_phi3_q8_0_gguf_matches_hf_on_its_dequantized_conversion(folio_server,
                                                                       checkpoint, tmp_path):
    gguf_file = write_gguf(checkpoint, tmp_path / "tiny-phi3.Q8_0.gguf", "Q8_0")
    # The oracle's own conversion (the server converts the file again into its cache).
    reference = load_hf_model(dequantized_copy(gguf_checkpoint_dir(gguf_file, tmp_path / "c"),
                                               tmp_path / "deq"))
    prompts = random_prompts(reference.config.vocab_size, (1, 7, 17, 64, 131), seed=5)
    with folio_server(model=gguf_file, args=["--block-size", str(BLOCK_SIZE)]) as server:
        got = await generate_all(server.address, prompts)
    assert_same_tokens(reference, prompts, hf_greedy(reference, prompts, MAX_TOKENS), got)


async def test_phi4_mini_partial_rotary_concurrent_greedy_matches_hf(folio_server, tmp_path):
    half = 12  # rotary_dim 24 of head_dim 32
    checkpoint = make_checkpoint("phi3", tmp_path / "phi4-mini", hidden_size=128,
                                 rope_parameters={
                                     "rope_type": "longrope", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.75,
                                     "short_factor": [1.0 + 0.05 * i for i in range(half)],
                                     "long_factor": [1.0 + 0.6 * i for i in range(half)]})
    hf_model = load_hf_model(checkpoint)
    assert hf_model.model.rotary_emb.inv_freq.numel() == half
    prompts = random_prompts(hf_model.config.vocab_size, (1, 7, 17, 64, 131), seed=6)
    prompts.append(prompts[-1][:100] + prompts[2])  # the 131-token prompt's first 100 tokens
    assert max(map(len, prompts)) + MAX_TOKENS <= hf_model.config.original_max_position_embeddings
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE)]) as server:
        got = await generate_all(server.address, prompts)
    assert_same_tokens(hf_model, prompts, hf_greedy(hf_model, prompts, MAX_TOKENS), got)
