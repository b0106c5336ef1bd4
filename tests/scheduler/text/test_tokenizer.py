"""Tokenizer loading, chat rendering, EOS ids, and incremental detokenization."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from scheduler_svc.text.tokenizer import ChatTurn, ModelDirError, Tokenizer
from tests.fixtures.tiny_model import (
    BOS_ID,
    CONFIG_VOCAB_SIZE,
    END_OF_TURN_ID,
    EOS_ID,
    build_sentencepiece_style_tokenizer,
    write_model_dir,
)

MULTILINGUAL = ["héllo wörld", "日本語のテキスト", "emoji 😀🎉 end", "Ελληνικά και русский",
                "mixed ascii and 中文 and 🚀"]


def test_reads_model_facts(tiny_tokenizer):
    assert tiny_tokenizer.architecture == "LlamaForCausalLM"
    assert tiny_tokenizer.config_vocab_size == CONFIG_VOCAB_SIZE
    assert tiny_tokenizer.random_weights
    # config.json says 1, generation_config.json says [1, 2]: the union.
    assert tiny_tokenizer.eos_token_ids == {EOS_ID, END_OF_TURN_ID}


def test_eos_from_int_and_list(tmp_path):
    tok = Tokenizer(write_model_dir(tmp_path, config_eos=[3, EOS_ID], generation_eos=(5,),
                                    random_weights=False))
    assert tok.eos_token_ids == {EOS_ID, 3, 5}
    assert not tok.random_weights


def test_encode_adds_bos_and_round_trips(tiny_tokenizer):
    for text in MULTILINGUAL:
        ids = tiny_tokenizer.encode(text)
        assert ids[0] == BOS_ID
        assert tiny_tokenizer.decode(ids) == text


def test_chat_template_renders_with_special_tokens(tiny_tokenizer):
    turns = [ChatTurn("system", "be brief"), ChatTurn("user", "hi")]
    text = tiny_tokenizer.render_chat(turns, add_generation_prompt=True)
    assert text == ("<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tiny_tokenizer.encode_chat(turns)
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID  # BOS from the template only
    without = tiny_tokenizer.render_chat(turns, add_generation_prompt=False)
    assert not without.endswith("assistant\n")


def test_missing_tokenizer_file_is_explained(tmp_path):
    with pytest.raises(ModelDirError, match="no tokenizer.json"):
        Tokenizer(tmp_path)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)  # one id per step normally; several when speculating
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_deltas_concatenate_to_full_decode(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    # The tokenizer really splits characters: some single ids decode to U+FFFD.
    if any(ord(c) > 127 for c in text):
        assert any(REPLACEMENT_CHAR in tiny_tokenizer.decode([i]) for i in ids)
    rng = random.Random(text)
    for _ in range(5):
        detok = IncrementalDetokenizer(tiny_tokenizer)
        deltas = stream(detok, ids, rng)
        assert "".join(deltas) == tiny_tokenizer.decode(ids) == text
        assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_one_id_at_a_time_holds_back_partial_characters(tiny_tokenizer):
    ids = tiny_tokenizer.encode("a😀b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "a😀b"
    assert "😀" in deltas  # emitted whole, in the step that completed it
    assert deltas.count("") >= 1  # steps that ended inside the emoji emitted nothing
    assert detok.flush() == ""


def test_special_tokens_are_skipped_and_random_ids_stay_consistent(tiny_tokenizer):
    rng = random.Random(0)
    vocab = tiny_tokenizer.vocab_size
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tiny_tokenizer)
        deltas = stream(detok, ids, rng)
        assert "".join(deltas) == tiny_tokenizer.decode(ids)
        # Only the final flush may carry a dangling partial character.
        assert all(REPLACEMENT_CHAR not in d for d in deltas[:-1]) or \
            REPLACEMENT_CHAR in tiny_tokenizer.decode(ids)


def test_flush_emits_a_dangling_partial_character(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ok😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tiny_tokenizer)
    text = "".join(detok.push([i]) for i in ids)
    assert text == "ok"
    assert detok.flush().endswith(REPLACEMENT_CHAR)


def test_chat_template_file_and_generation_tags(tmp_path):
    model_dir = write_model_dir(tmp_path)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m['content'] | tojson }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = Tokenizer(model_dir)
    turns = [ChatTurn("user", "héllo"), ChatTurn("assistant", "hi")]
    assert tok.render_chat(turns) == '[user]"héllo"[assistant]hi[assistant]'


def test_sentencepiece_style_leading_spaces_survive_windowing(tmp_path):
    tok = Tokenizer(write_model_dir(tmp_path, tokenizer=build_sentencepiece_style_tokenizer()))
    ids = tok.encode("hello 日本 world", add_special_tokens=False)
    assert REPLACEMENT_CHAR in tok.decode(ids[2:3])  # a byte-fallback piece of 日
    assert tok.decode(ids[-3:]) == "world"  # a window's first "▁" is stripped
    rng = random.Random(1)
    for text in ["hello world the quick fox", "a  b   c", *MULTILINGUAL]:
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(5):
            deltas = stream(IncrementalDetokenizer(tok), ids, rng)
            assert "".join(deltas) == tok.decode(ids) == text
            assert all(REPLACEMENT_CHAR not in d for d in deltas)
