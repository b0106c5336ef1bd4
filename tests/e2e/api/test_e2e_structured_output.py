"""Structured output through the real server and executor (the tiny random-weight model, whose
outputs are noise: only the constraint gives them shape).

Oracles from elsewhere: `jsonschema` for JSON schemas, Python's `re.fullmatch` for regexes
(and for the GBNF grammar, whose language is written again as a regex), membership for choice;
for preemption and an executor crash, the same requests on an undisturbed server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import grpc
import jsonschema
import pytest

from client import AsyncFolioClient, FolioClient
from tests.conftest import TINY_RANDOM
from tests.e2e.e2e_util import wait_idle
from tests.e2e.engine.test_e2e_faults import executor_pid, wait_health
from tests.e2e.hf_oracle import random_prompts

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@(mail|post)\.(com|org)"
CHOICES = ["yes", "no", "maybe", "it depends"]
GBNF = 'root ::= "(" num ("+" num)? ")" " = " num\nnum ::= [0-9] [0-9]?'
GBNF_AS_REGEX = r"\([0-9]{1,2}(\+[0-9]{1,2})?\) = [0-9]{1,2}"

KINDS = {
    "json_schema": (dict(json_schema=json.dumps(SCHEMA)),
                    lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    "regex": (dict(regex=REGEX), lambda text: _fullmatch(REGEX, text)),
    "choice": (dict(choice=CHOICES), lambda text: _member(text, CHOICES)),
    "grammar": (dict(grammar=GBNF), lambda text: _fullmatch(GBNF_AS_REGEX, text)),
}
SAMPLING = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, seed=1234)}
PROMPTS = ["The harbor was quiet", "Answer in JSON:", "def main():"]


def _fullmatch(pattern: str, text: str) -> None:
    assert re.fullmatch(pattern, text), (pattern, text)


def _member(text: str, choices: list[str]) -> None:
    assert text in choices, text


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_completes_and_validates(default_server, kind, sampling):
    constraint, check = KINDS[kind]
    with FolioClient(default_server.address, timeout=120) as client:
        for prompt in PROMPTS:
            for c in client.generate_choices(prompt, max_tokens=100, n=2, **constraint,
                                             **SAMPLING[sampling]):
                # Complete: ended on an EOS id the mask left as the only choice.
                assert c.finish_reason == "stop", (prompt, c.text, c.finish_reason)
                check(c.text)


def test_json_object_outputs_are_objects(default_server):
    """Any object: a random model opens a string key and, its closing quote being one token
    in the whole vocabulary, rarely ends it; those that end must parse as a JSON object. (The
    real model's test, test_e2e_real_model.py, sees them end.)"""
    with FolioClient(default_server.address, timeout=120) as client:
        for seed in range(6):
            c = client.generate_text("Reply in JSON.", json_object=True, seed=seed,
                                     max_tokens=24)
            assert c.text.startswith("{"), c.text
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict), c.text
            else:
                assert c.finish_reason == "length"


def test_n2_sequences_are_constrained_each_on_its_own(default_server):
    with FolioClient(default_server.address, timeout=120) as client:
        comps = client.generate_choices("Pick:", regex=REGEX, n=2, seed=5, max_tokens=60)
    assert len(comps) == 2
    for c in comps:
        _fullmatch(REGEX, c.text)
    # Two seeds, two draws: with an 8-letter alphabet run they differ (a collision would
    # mean one matcher drove both rows).
    assert comps[0].text != comps[1].text


@pytest.mark.parametrize("kwargs, says", [
    (dict(json_schema='{"type": "nonsense"}'), "invalid json schema"),
    (dict(json_schema="{not json"), "invalid json schema"),
    (dict(regex="[a-"), "unclosed character class"),
    (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
    (dict(choice=["ok", ""]), "empty string"),
    (dict(regex="a+", beam_width=2), "beam search"),
    (dict(regex="a+", min_tokens=2), "min_tokens"),
])
def test_invalid_constraints_are_refused_and_the_server_goes_on(default_server, kwargs, says):
    with FolioClient(default_server.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate_text("Hello", max_tokens=8, **kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in err.value.details(), err.value.details()
        # The same server keeps serving, constrained and not.
        assert client.generate_text("Hello", max_tokens=4, temperature=0).finish_reason
        assert client.generate_text("Hi", choice=["a", "b"], max_tokens=4).text in ("a", "b")


async def test_bad_and_good_requests_in_one_batch(default_server):
    """Invalid constraints arriving among valid ones fail alone."""
    async with AsyncFolioClient(default_server.address, timeout=120) as client:
        async def good(i):
            return await client.generate_text(f"Go {i}", regex=REGEX, seed=i, max_tokens=60)

        async def bad(i):
            with pytest.raises(grpc.RpcError) as err:
                await client.generate_text(f"No {i}", regex="(", max_tokens=8)
            return err.value.code()

        results = await asyncio.gather(*(good(i) if i % 2 else bad(i) for i in range(8)))
    for i, r in enumerate(results):
        if i % 2:
            _fullmatch(REGEX, r.text)
        else:
            assert r == grpc.StatusCode.INVALID_ARGUMENT


# ---- preemption by recompute and an executor crash: same outputs as an undisturbed run ----

LONG_REGEX = r"[a-z]{6}( [a-z]{2,6}){8,12}\."  # long outputs (~30+ tokens), always ends


def workload(vocab_size: int) -> list[dict]:
    prompts = random_prompts(vocab_size, [20 + 9 * i for i in range(6)], seed=3)
    reqs = []
    for i, prompt in enumerate(prompts):
        kind = [dict(regex=LONG_REGEX), dict(json_schema=json.dumps(SCHEMA))][i % 2]
        sampling = dict(temperature=0.0) if i < 3 else dict(temperature=0.8, seed=40 + i)
        reqs.append(dict(token_ids=prompt, max_tokens=120, **kind, **sampling))
    return reqs


async def run_all(address: str, reqs: list[dict], progress: list[int] | None = None
                  ) -> list[tuple[list[int], str, str]]:
    """(tokens, text, finish reason) of each request, all run concurrently; `progress[0]`
    counts the tokens streamed."""
    progress = [0] if progress is None else progress
    async with AsyncFolioClient(address, timeout=300) as client:
        async def one(kw):
            tokens, text, finish = [], "", None
            async for resp in client.generate(**kw):
                tokens += resp.token_ids
                progress[0] += len(resp.token_ids)
                text += resp.text
                finish = resp.finish_reason or finish
            return tokens, text, finish
        return list(await asyncio.gather(*(one(kw) for kw in reqs)))


def check_outputs(reqs, outputs) -> None:
    for kw, (_, text, finish) in zip(reqs, outputs, strict=True):
        assert finish == 1, (kw, text)  # FINISH_REASON_STOP
        if "regex" in kw:
            _fullmatch(LONG_REGEX, text)
        else:
            jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def vocab_size(default_model_dir):
    return json.loads((default_model_dir / "config.json").read_text())["vocab_size"]


async def test_preemption_by_recompute_gives_the_unpreempted_outputs(folio_server, default_server,
                                                                     vocab_size):
    reqs = workload(vocab_size)
    reference = await run_all(default_server.address, reqs)
    check_outputs(reqs, reference)
    args = ["--block-size", "16", "--num-kv-blocks", "12", "--preemption-mode", "recompute",
            "--max-num-batched-tokens", "32"]
    with folio_server(model=TINY_RANDOM, args=args) as server:
        outputs = await run_all(server.address, reqs)
        stats = wait_idle(server.address)
    assert stats["num_preemptions"] > 0, stats
    assert outputs == reference


async def test_executor_crash_resumes_with_the_uninterrupted_outputs(folio_server, vocab_size):
    reqs = workload(vocab_size)
    with folio_server(model=TINY_RANDOM, args=["--max-num-seqs", "2"]) as server:
        reference = await run_all(server.address, reqs)
        check_outputs(reqs, reference)
        progress = [0]
        task = asyncio.create_task(run_all(server.address, reqs, progress))
        async with AsyncFolioClient(server.address) as client:
            while progress[0] < 20:  # the first requests are mid-output (2 run at a time)
                await asyncio.sleep(0.005)
            assert not task.done()
            killed_at = progress[0]
            pid = executor_pid(server.proc.pid)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await wait_health(client, "NOT_SERVING", 10)
            await wait_health(client, "SERVING", 180)
        outputs = await asyncio.wait_for(task, 300)
    assert outputs == reference
    assert killed_at < sum(len(t) for t, _, _ in reference)  # the kill came mid-output
