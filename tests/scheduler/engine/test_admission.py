"""Admission at the context's edge, through the real gRPC server and engine loop with a
null-model executor: a prompt of exactly max_model_len tokens gets its one token (LENGTH), for
n = 1 as for n > 1, also where the KV pool caps max_model_len; one token more is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.folio.v1 import generator_pb2 as pb
from tests.scheduler.admission_draws import MODEL_VOCAB
from tests.scheduler.api.test_server import wait_idle
from tests.scheduler.grpc_harness import collect, gen_request, null_continuation, running_server
from tests.scheduler.kv_mirror import KVMirror, NullModel
from tests.scheduler.null_executor import make_hello

pytestmark = pytest.mark.timeout(60)


def prompt_of(num_tokens: int) -> list[int]:
    return [10 + i % 400 for i in range(num_tokens)]


@pytest.mark.parametrize("hello, max_model_len", [
    (dict(max_model_len=64, block_size=4, num_kv_blocks=32), 64),  # the model's limit
    (dict(max_model_len=2048, block_size=16, num_kv_blocks=8), 128),  # the pool's limit
], ids=["model-limit", "pool-limit"])
@pytest.mark.parametrize("n", [1, 3])
async def test_a_prompt_of_max_model_len_tokens_gets_one_token(harness, hello, max_model_len, n):
    await harness.serve(hello=make_hello(**hello))
    for num_prompt in (max_model_len - 1, max_model_len):
        prompt = prompt_of(num_prompt)
        responses = await collect(harness.stub.Generate(gen_request(prompt, n=n)))
        finals = {r.index: r for r in responses if r.finish_reason}
        assert sorted(finals) == list(range(n))
        for index in range(n):
            tokens = [t for r in responses if r.index == index for t in r.token_ids]
            assert tokens == null_continuation(prompt, 1)
            assert finals[index].finish_reason == pb.FINISH_REASON_LENGTH
            assert finals[index].usage.prompt_tokens == num_prompt
            assert finals[index].usage.completion_tokens == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(harness.stub.Generate(gen_request(prompt_of(max_model_len + 1), n=n)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt has {max_model_len + 1} tokens but max_model_len is {max_model_len}" \
        in err.value.details()
    stats = await wait_idle(harness)
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_preemption_that_empties_a_step_does_not_idle_the_engine(tiny_tokenizer):
    """Found by test_admission_properties: "r0" (newer) decodes with a draft proposal, which
    takes the whole 2-token budget, while "r1/1" (older, recomputed after a preemption) is
    mid-prompt; "r0" runs the pool dry and is preempted, which left the step empty, so
    schedule() returned None with a request it could run, and the engine idled until its next
    stats tick (here 30 s) before planning again. Both requests must end at once."""
    model = NullModel(MODEL_VOCAB, context=1)
    async with running_server(tiny_tokenizer, max_num_seqs=3, max_num_batched_tokens=2,
                              enable_prefix_caching=False, overlap_scheduling=False,
                              speculative_method="draft", num_speculative_tokens=1,
                              stats_interval_s=30.0) as harness:
        hello = make_hello(max_model_len=40, block_size=1, num_kv_blocks=6,
                           num_swap_blocks=1, num_draft_tokens=1)
        # Steps of 0.1 s: "r0" arrives while the first of "r1"'s prompt steps runs.
        await harness.serve(hello=hello, step_delay_s=0.1,
                            mirror=KVMirror(1, model, num_draft_tokens=1, max_model_len=6))
        r1 = harness.stub.Generate(gen_request([4, 41, 78, 115, 152, 189], n=2, temperature=0))
        await asyncio.sleep(0.05)
        r0 = harness.stub.Generate(gen_request([4], temperature=0))
        done = await asyncio.wait_for(asyncio.gather(collect(r1), collect(r0)), timeout=10)
        for responses in done:
            assert all(r.finish_reason == pb.FINISH_REASON_LENGTH
                       for r in responses if r.finish_reason)
        stats = await wait_idle(harness)
        assert stats.kv_blocks_free == stats.kv_blocks_total
