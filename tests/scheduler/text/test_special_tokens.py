"""skip_special_tokens and spaces_between_special_tokens in the streamed text, on real
tokenizers: the default tiny-random model's byte-level BPE (special tokens <|im_start|>,
<|im_end|>...) and a word-level tokenizer without a decoder (tokenizers joins its tokens with
spaces, the case the flag exists for).

Oracles: transformers' `decode` for skip_special_tokens; for spaces_between_special_tokens,
vLLM's fast detokenizer rule computed with tokenizers' own `DecodeStream` (step by step: an
added token right after another added token is shown as its bare content).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from tokenizers.decoders import DecodeStream

from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.tokenizer import Tokenizer
from tests.fixtures.tiny_model import write_model_dir

WORDS = ["hello", " world", "\n", " café", "日本語", " ", "x", "😀 end"]


def streamed(tok: Tokenizer, ids: list[int], skip: bool, spaces: bool) -> str:
    detok = IncrementalDetokenizer(tok, skip, spaces)
    return "".join(detok.push([i]) for i in ids) + detok.flush()


def vllm_fast_rule(hf: HFTokenizer, ids: list[int], skip: bool, spaces: bool) -> str:
    stream = DecodeStream(skip_special_tokens=skip)
    added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
    out, last_added = "", False
    for i in ids:
        piece = stream.step(hf, i) or ""
        if not (skip or spaces):
            if i in added and last_added:
                piece = added[i]
            last_added = i in added
        out += piece
    return out


@pytest.fixture(scope="module")
def byte_level(default_model_dir):
    from transformers import AutoTokenizer

    return Tokenizer(default_model_dir), AutoTokenizer.from_pretrained(default_model_dir)


def test_byte_level_special_tokens_shown_or_skipped_as_transformers_decodes(byte_level):
    ours, theirs = byte_level
    specials = sorted(ours.added_token_ids)
    assert {"<|im_start|>", "<|im_end|>"} <= {t.content for t in
                                              theirs.added_tokens_decoder.values() if t.special}
    rng = random.Random(5)
    for _ in range(30):
        ids = []  # whole words (valid UTF-8, so DecodeStream emits all) and special tokens
        for _ in range(rng.randint(1, 12)):
            ids += [rng.choice(specials)] if rng.random() < 0.4 else \
                ours.encode(rng.choice(WORDS), add_special_tokens=False)
        for skip in (True, False):
            want = theirs.decode(ids, skip_special_tokens=skip)
            for spaces in (True, False):
                assert streamed(ours, ids, skip, spaces) == want, (ids, skip, spaces)
                # Byte-level BPE puts nothing between tokens: the flag changes nothing.
                assert want == vllm_fast_rule(ours._tok, ids, skip, spaces)
    chat = ours.encode("<|im_start|>assistant\nHi<|im_end|><|im_end|>", add_special_tokens=False)
    assert streamed(ours, chat, skip=False, spaces=True) == \
        "<|im_start|>assistant\nHi<|im_end|><|im_end|>"
    assert streamed(ours, chat, skip=True, spaces=True) == "assistant\nHi"


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    hf.add_special_tokens(["<a>", "<b>"])  # ids 3, 4
    hf.add_tokens(["<plain>"])  # id 5: added but not special
    return Tokenizer(write_model_dir(tmp_path_factory.mktemp("word-level"), tokenizer=hf)), hf


@pytest.mark.parametrize("ids", [[3, 4, 1, 2, 3, 4], [1, 3, 5, 4, 4, 2], [4], [5, 5, 1]])
def test_spaces_between_special_tokens_follow_vllms_rule(word_level, ids):
    ours, hf = word_level
    for skip in (True, False):
        for spaces in (True, False):
            assert streamed(ours, ids, skip, spaces) == vllm_fast_rule(hf, ids, skip, spaces)


def test_word_level_shows_the_difference(word_level):
    ours, _ = word_level
    ids = [3, 4, 1, 2, 3, 4]
    assert streamed(ours, ids, skip=False, spaces=True) == "<a> <b> hello world <a> <b>"
    assert streamed(ours, ids, skip=False, spaces=False) == "<a><b> hello world <a><b>"
    assert streamed(ours, ids, skip=True, spaces=False) == "hello world"
