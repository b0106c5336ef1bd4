"""The executor's structured-output module on the tiny model's real tokenizer: masks against a
brute-force oracle over the vocabulary, the batched mask op against a per-row loop, matcher
advance / rollback / replay, the compile cache, stale rows and error matchers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from executor_svc.sample.structured import GrammarCompiler, StructuredRows, apply_bitmask
from protos.sampling_spec import StructuredSpec

CHOICES = ["yes", "no", "maybe", "yesterday"]
EOS = (1, 3)  # the tiny model's EOS ids (config.json and generation_config.json)


@pytest.fixture(scope="module")
def tokenizer_json(default_model_dir):
    return default_model_dir / "tokenizer.json"


@pytest.fixture(scope="module")
def vocab_size(default_model_dir):
    return json.loads((default_model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def hf_tok(tokenizer_json):
    return Tokenizer.from_file(str(tokenizer_json))


def token_bytes(hf_tok: Tokenizer, vocab_size: int) -> list[bytes | None]:
    """Each id's bytes (byte-level BPE: decode() of one id); None for special tokens."""
    special = {t.content for t in hf_tok.get_added_tokens_decoder().values() if t.special}
    out: list[bytes | None] = []
    for v in range(vocab_size):
        piece = hf_tok.id_to_token(v)
        out.append(None if piece is None or piece in special else
                   hf_tok.decode([v], skip_special_tokens=False).encode())
    return out


def allowed_ids(mask_row: np.ndarray, vocab_size: int) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def choice_oracle(done: bytes, pieces: list[bytes | None]) -> set[int]:
    """Tokens that keep `done` + token a prefix of some choice, plus EOS when done is one."""
    words = [c.encode() for c in CHOICES]
    ok = {v for v, b in enumerate(pieces)
          if b and any(w.startswith(done + b) for w in words)}
    return ok | (set(EOS) if done in words else set())


def rows_with(spec: StructuredSpec, tokenizer_json, vocab_size, row: int = 0, req_id: str = "r",
              output_ids=()) -> tuple[StructuredRows, list[str | None]]:
    rows = StructuredRows(tokenizer_json, vocab_size)
    rows.add(row, req_id, spec, list(output_ids))
    req_ids: list[str | None] = [None] * (row + 1)
    req_ids[row] = req_id
    return rows, req_ids


def test_choice_masks_match_the_brute_force_oracle(tokenizer_json, vocab_size, hf_tok):
    pieces = token_bytes(hf_tok, vocab_size)
    spec = StructuredSpec(kind="choice", text=json.dumps(CHOICES), eos_token_ids=EOS)
    rows, req_ids = rows_with(spec, tokenizer_json, vocab_size)
    done = b""
    # Walk "yes" then "terday" one allowed token at a time, checking the mask at each state.
    for target in (b"yes", b"yesterday"):
        while done != target:
            idx, mask = rows.bitmask(np.array([0]), req_ids)
            assert idx.tolist() == [0]
            allowed, oracle = allowed_ids(mask[0], vocab_size), choice_oracle(done, pieces)
            words = [c.encode()[len(done):] for c in CHOICES if c.encode().startswith(done)]
            if len({w[:1] for w in words}) > 1:  # more than one way on: every way is allowed
                assert allowed == oracle, done
            else:
                # The rest is forced: llguidance allows only the canonical tokens of the forced
                # bytes (never a non-canonical split), so a subset holding the longest.
                longest = max(oracle, key=lambda v: len(pieces[v]))
                assert longest in allowed and allowed <= oracle, done
            step = max((v for v in allowed if v not in EOS
                        and target.startswith(done + pieces[v])), key=lambda v: len(pieces[v]))
            rows.advance([0], req_ids, [[step]])
            done += pieces[step]
        _, mask = rows.bitmask(np.array([0]), req_ids)
        assert allowed_ids(mask[0], vocab_size) == choice_oracle(done, pieces)
    # "yesterday" is complete and nothing may follow: EOS alone.
    assert allowed_ids(mask[0], vocab_size) == set(EOS)


def test_advance_rollback_and_replay_agree(tokenizer_json, vocab_size, hf_tok):
    spec = StructuredSpec(kind="regex", text=r"[a-z]{2,6}@(x|y)\.com", eos_token_ids=EOS)
    text_ids = hf_tok.encode("abc@y.com", add_special_tokens=False).ids
    rows, req_ids = rows_with(spec, tokenizer_json, vocab_size)
    masks = []
    for t in text_ids:
        masks.append(rows.bitmask(np.array([0]), req_ids)[1][0].copy())
        rows.advance([0], req_ids, [[t]])
    final = rows.bitmask(np.array([0]), req_ids)[1][0]
    assert allowed_ids(final, vocab_size) == set(EOS)
    matcher = rows.matcher_of(0)
    assert matcher.is_accepting() and not matcher.is_error()
    # Rolling back k tokens gives the mask seen before them.
    assert matcher.rollback(2)
    assert (rows.bitmask(np.array([0]), req_ids)[1][0] == masks[-2]).all()
    # A fresh row given the outputs to replay (a resume) lands in the same state.
    replayed, req_ids2 = rows_with(spec, tokenizer_json, vocab_size, row=3, req_id="s",
                                   output_ids=text_ids[:-2])
    assert (replayed.bitmask(np.array([3]), req_ids2)[1][0] == masks[-2]).all()


def test_compile_cache_hits(tokenizer_json, vocab_size):
    compiler = GrammarCompiler(tokenizer_json, vocab_size)
    spec = StructuredSpec(kind="json_schema", text='{"type": "integer"}', eos_token_ids=EOS)
    a, b = compiler.matcher(spec), compiler.matcher(spec)
    assert compiler.num_compiled == 1 and a is not b  # one compile, two independent copies
    a.consume_tokens([])  # the copies do not share state:
    assert a.compute_bitmask() == b.compute_bitmask()
    compiler.matcher(StructuredSpec(kind="json_schema", text='{"type": "integer"}',
                                    eos_token_ids=(1,)))
    compiler.matcher(StructuredSpec(kind="regex", text='{"type": "integer"}', eos_token_ids=EOS))
    assert compiler.num_compiled == 3  # another EOS set, another kind: compiled anew


def test_stale_rows_and_unconstrained_rows_are_skipped(tokenizer_json, vocab_size):
    spec = StructuredSpec(kind="choice", text='["a"]', eos_token_ids=EOS)
    rows = StructuredRows(tokenizer_json, vocab_size)
    rows.add(0, "r0", spec, [])
    rows.add(2, "r2", spec, [])
    req_ids = ["other", None, "r2", "plain"]  # row 0 was freed and reused by another request
    idx, mask = rows.bitmask(np.array([3, 2, 0]), req_ids)
    assert idx.tolist() == [1] and mask.shape == (1, (vocab_size + 31) // 32)
    rows.add(2, "plain2", None, [])  # reused by an unconstrained request: forgotten
    assert rows.bitmask(np.array([2]), ["x", None, "plain2"])[0].tolist() == []


def test_a_grammar_that_cannot_compile_allows_only_eos(tokenizer_json, vocab_size):
    # The scheduler refuses this; an executor sent it anyway ends the sequence, nothing else.
    rows, req_ids = rows_with(StructuredSpec(kind="regex", text="[a-", eos_token_ids=EOS),
                              tokenizer_json, vocab_size)
    _, mask = rows.bitmask(np.array([0]), req_ids)
    assert allowed_ids(mask[0], vocab_size) == set(EOS)


def test_apply_bitmask_equals_a_per_row_loop():
    gen = torch.Generator().manual_seed(0)
    num_logits, vocab = 5, 77  # not a multiple of 32: the last word is partly used
    logits = torch.randn(num_logits, vocab, generator=gen)
    idx = torch.tensor([3, 0, 4])
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).int()
    expected = logits.clone()
    for j, row in enumerate(idx.tolist()):
        for v in range(vocab):
            if not (int(bitmask[j, v // 32]) >> (v % 32)) & 1:
                expected[row, v] = float("-inf")
    apply_bitmask(logits, idx, bitmask)
    assert torch.equal(logits, expected)


def test_a_tokenizer_llguidance_cannot_read_ends_only_that_request(tmp_path, vocab_size):
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not a tokenizer")
    rows, req_ids = rows_with(StructuredSpec(kind="choice", text='["a"]', eos_token_ids=EOS),
                              broken, vocab_size)
    idx, mask = rows.bitmask(np.array([0]), req_ids)  # no exception: the step goes on
    assert idx.tolist() == [0] and allowed_ids(mask[0], vocab_size) == set(EOS)
