"""The logits processors through the real server (scheduler + executor processes, gRPC on
127.0.0.1) on a tiny random llama.

Oracles: HF transformers `generate` in fp32 with its own processors (repetition_penalty,
sequence_bias, min_new_tokens) plus small processors written here for what HF lacks (OpenAI's
presence/frequency penalties, an allowed-token list, bad words matched against the output
only, as vLLM does); for what changes sampling rather than greedy answers, the definition
itself (min_p = 1 keeps only the top token; a banned token never appears; min_tokens holds
back EOS exactly that long); and an uninterrupted run for preemption (recompute, swap) and
for the same request alone or in a batch.
"""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.hf_oracle import load_hf_model, random_prompts
from tests.fixtures.checkpoints import make_checkpoint

BLOCK_SIZE = 16
MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 6, 17, 40, 90)
# Any two of these prompts with their outputs exceed the pool: preemption by recompute.
SMALL_POOL_BLOCKS = 14
SMALL_POOL_LENGTHS = (100, 104, 108, 112)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama3", tmp_path_factory.mktemp("ckpt-processors"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def eos_ids(checkpoint) -> list[int]:
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    return list(eos) if isinstance(eos, list) else [eos]


@pytest.fixture(scope="module")
def server(folio_server, checkpoint):
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE)]) as s:
        yield s


@pytest.fixture(scope="module", params=[["--preemption-mode", "recompute"],
                                        ["--preemption-mode", "swap", "--swap-space", "0.002"]],
                ids=["recompute", "swap"])
def small_pool_server(request, folio_server, checkpoint):
    args = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(SMALL_POOL_BLOCKS),
            *request.param]
    with folio_server(model=checkpoint, args=args) as s:
        yield s


async def generate_all(address: str, requests: list[dict]) -> list:
    async with AsyncFolioClient(address, timeout=300) as client:
        return await asyncio.gather(*(client.generate_text(**r) for r in requests))


# ---- HF oracle ------------------------------------------------------------------------------

def _processor(fn):
    from transformers import LogitsProcessor

    class Wrapped(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return fn(input_ids, scores)

    return Wrapped()


def openai_penalties(num_prompt: int, presence: float, frequency: float):
    """OpenAI's presence/frequency penalties over the generated tokens, token by token."""
    import torch

    pres, freq = torch.tensor(presence), torch.tensor(frequency)  # float32, as sent

    def apply(input_ids, scores):
        output = input_ids[0, num_prompt:].tolist()
        for t in set(output):
            scores[0, t] = scores[0, t] - freq * output.count(t)
            scores[0, t] = scores[0, t] - pres
        return scores

    return _processor(apply)


def allowed_only(allowed: list[int]):
    def apply(input_ids, scores):
        keep = scores.new_zeros(scores.shape[1], dtype=bool)
        keep[allowed] = True
        return scores.masked_fill(~keep, float("-inf"))

    return _processor(apply)


def output_bad_words(num_prompt: int, sequences: list[list[int]]):
    """vLLM's bad words: a sequence's last token is banned when the rest ends the output."""
    def apply(input_ids, scores):
        output = input_ids[0, num_prompt:].tolist()
        for seq in sequences:
            prefix = seq[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                scores[0, seq[-1]] = float("-inf")
        return scores

    return _processor(apply)


def bad_word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: as is, and after a space when that is another first
    token in as many tokens."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def hf_generate(model, prompt: list[int], max_new_tokens: int, *, eos_ids=None,
                processors=(), **kwargs) -> list[int]:
    import torch
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                             pad_token_id=eos_ids[0] if eos_ids else None,
                             logits_processor=LogitsProcessorList(processors), **kwargs)
    return out[0, len(prompt):].tolist()


# ---- greedy, token-exact against HF --------------------------------------------------------

@pytest.mark.parametrize("penalty", [1.5, 0.7])
async def test_repetition_penalty_greedy_matches_hf(server, hf_model, penalty):
    prompts = random_prompts(hf_model.config.vocab_size, PROMPT_LENGTHS, seed=4)
    got = await generate_all(server.address, [
        dict(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
             repetition_penalty=penalty) for p in prompts])
    for prompt, c in zip(prompts, got, strict=True):
        want = hf_generate(hf_model, prompt, MAX_TOKENS, repetition_penalty=penalty)
        assert c.token_ids == want, (len(prompt), c.token_ids, want)
    plain = await generate_all(server.address, [
        dict(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for p in prompts])
    assert [c.token_ids for c in plain] != [c.token_ids for c in got], "the penalty did nothing"


async def test_every_processor_together_greedy_matches_hf(server, hf_model, hf_tokenizer,
                                                          eos_ids):
    """Penalties, logit_bias, allowed ids, bad words and min_tokens in one request each, with
    EOS on: HF stops where Folio stops."""
    vocab = hf_model.config.vocab_size
    prompts = random_prompts(vocab, PROMPT_LENGTHS, seed=5)
    words = ["the", "hello world"]
    sequences = bad_word_sequences(hf_tokenizer, words)
    requests, oracles = [], []
    for i, prompt in enumerate(prompts):
        # Push EOS up so min_tokens decides where the answer ends, and pull a frequent token down.
        bias = {eos_ids[0]: 12.0, prompt[-1]: -5.0, 7 + i: 3.0}
        allowed = sorted(set(range(5, vocab, 3)) | set(eos_ids) | {7 + i}) if i % 2 else []
        presence, frequency = 1.5 - 0.5 * i, 2.0 - 1.0 * i
        kwargs = dict(repetition_penalty=1.2 + 0.1 * i, presence_penalty=presence,
                      frequency_penalty=frequency, min_tokens=3 + i)
        requests.append(dict(token_ids=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                             logit_bias=bias, allowed_token_ids=allowed, bad_words=words,
                             **kwargs))
        processors = [openai_penalties(len(prompt), presence, frequency),
                      output_bad_words(len(prompt), sequences)]
        if allowed:
            processors.append(allowed_only(allowed))
        oracles.append(hf_generate(
            hf_model, prompt, MAX_TOKENS, eos_ids=eos_ids, processors=processors,
            repetition_penalty=1.2 + 0.1 * i, min_new_tokens=3 + i,
            sequence_bias={(t,): b for t, b in bias.items()}))
    got = await generate_all(server.address, requests)
    for i, (c, want) in enumerate(zip(got, oracles, strict=True)):
        assert c.token_ids == want, (i, c.token_ids, want)
        if want[-1] in eos_ids:
            assert c.finish_reason == "stop" and len(want) > 3 + i
    assert any(c.finish_reason == "stop" for c in got), "EOS never reached: min_tokens untested"


# ---- behaviour by definition ---------------------------------------------------------------

async def test_min_tokens_holds_back_eos_and_stop_ids_exactly(server, eos_ids):
    """EOS (or a stop id) biased to the top: it comes right after min_tokens, not before."""
    prompt = random_prompts(1000, (9,), seed=6)[0]
    stop_id = 42
    requests = [dict(token_ids=prompt, temperature=t, seed=1, max_tokens=MAX_TOKENS,
                     logit_bias={eos_ids[0]: 100.0}, min_tokens=k)
                for k in (0, 1, 5, 20) for t in (0.0, 1.0)]
    requests += [dict(token_ids=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                      ignore_eos=True, stop_token_ids=[stop_id], logit_bias={stop_id: 100.0},
                      min_tokens=k) for k in (0, 7)]
    got = await generate_all(server.address, requests)
    for r, c in zip(requests, got, strict=True):
        k = r["min_tokens"]
        assert len(c.token_ids) == k + 1 and c.finish_reason == "stop", (r, c)
        assert c.token_ids[-1] == (stop_id if r.get("stop_token_ids") else eos_ids[0])
        assert not set(c.token_ids[:-1]) & {stop_id, *eos_ids}


async def test_banned_and_allowed_tokens_hold_under_sampling(server, hf_tokenizer):
    vocab = hf_tokenizer.vocab_size
    prompts = random_prompts(vocab, (3, 30), seed=7)
    [word] = [w for w in ("hello", "world", "the", "and") if len(
        hf_tokenizer.encode(w, add_special_tokens=False)) == 1][:1]
    word_ids = {s[0] for s in bad_word_sequences(hf_tokenizer, [word])}
    allowed = list(range(100, 140))
    base = dict(temperature=1.5, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = []
    for i, p in enumerate(prompts):
        requests += [
            dict(token_ids=p, seed=i, bad_words=[word], logit_bias=dict.fromkeys(word_ids, 100.0),
                 **base),
            dict(token_ids=p, seed=i, allowed_token_ids=allowed, **base),
            dict(token_ids=p, seed=i, logit_bias={50: -100.0, 51: -100.0},
                 allowed_token_ids=[50, 51, 52], **base),
            dict(token_ids=p, seed=i, logit_bias={77: 100.0}, **base)]
    got = await generate_all(server.address, requests)
    for i in range(0, len(got), 4):
        banned, allowed_only_, biased, forced = got[i:i + 4]
        assert not set(banned.token_ids) & word_ids, banned.token_ids
        assert set(allowed_only_.token_ids) <= set(allowed)
        assert biased.token_ids == [52] * MAX_TOKENS
        assert forced.token_ids == [77] * MAX_TOKENS


async def test_min_p_one_keeps_only_the_top_token(server, hf_model):
    prompts = random_prompts(hf_model.config.vocab_size, PROMPT_LENGTHS, seed=8)
    common = dict(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    greedy = await generate_all(server.address, [dict(token_ids=p, temperature=0.0, **common)
                                                 for p in prompts])
    sampled = await generate_all(server.address, [
        dict(token_ids=p, temperature=2.0, seed=i, min_p=1.0, **common)
        for i, p in enumerate(prompts)])
    assert [c.token_ids for c in sampled] == [c.token_ids for c in greedy]


# ---- interruptions and batch composition: an uninterrupted run is the oracle ----------------

def _penalised_requests(vocab: int, lengths, eos_ids: list[int]) -> list[dict]:
    prompts = random_prompts(vocab, lengths, seed=9)
    requests = []
    for i, p in enumerate(prompts):
        requests.append(dict(
            token_ids=p, temperature=0.0 if i % 2 else 0.9, seed=100 + i, max_tokens=32,
            repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.6, min_p=0.02,
            min_tokens=20 + i, logit_bias={eos_ids[0]: 30.0}, bad_words=["and"],
            request_id=f"pen-{i}"))
    return requests


async def test_preemption_keeps_penalties_and_min_tokens(server, small_pool_server, hf_model,
                                                         eos_ids):
    """A recomputed or swapped-in request is re-sent with prompt + outputs; the executor must
    still count only the outputs (penalties, min_tokens): the answers equal the unpreempted
    run's."""
    requests = _penalised_requests(hf_model.config.vocab_size, SMALL_POOL_LENGTHS, eos_ids)
    want = [await generate_all(server.address, [r]) for r in requests]  # one at a time
    got = await generate_all(small_pool_server.address, requests)
    for (w,), g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert any(w.finish_reason == "stop" for (w,) in want), "min_tokens never ended a request"
    stats = wait_idle(small_pool_server.address)
    assert stats["num_preemptions"] > 0, stats
    assert (stats["num_swap_outs"] > 0) == (stats["swap_blocks_total"] > 0), stats


async def test_a_request_alone_equals_it_in_a_batch(server, hf_model, eos_ids):
    requests = _penalised_requests(hf_model.config.vocab_size, PROMPT_LENGTHS, eos_ids)
    alone = [await generate_all(server.address, [r]) for r in requests]
    others = [dict(token_ids=p, temperature=1.0, seed=i, max_tokens=32, top_k=20)
              for i, p in enumerate(random_prompts(hf_model.config.vocab_size, (5, 50), seed=1))]
    together = await generate_all(server.address, others + requests)
    for (a,), t in zip(alone, together[len(others):], strict=True):
        assert t.token_ids == a.token_ids


async def test_beam_search_refuses_processors(server):
    import grpc

    for field, value in (("repetition_penalty", 1.2), ("min_tokens", 2),
                         ("logit_bias", {5: 1.0}), ("bad_words", ["x"])):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(server.address, [dict(token_ids=[5, 6], beam_width=2,
                                                     max_tokens=4, **{field: value})])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details() and "beam" in err.value.details()
