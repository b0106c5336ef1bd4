"""The scheduler's Tokenizer on a converted GGUF equals transformers' tokenizer for the GGUF
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`): ids, chat rendering, decoding, EOS."""

from __future__ import annotations

import pytest

from executor_svc.gguf_checkpoint import gguf_checkpoint_dir
from scheduler_svc.tokenizer import ChatTurn, Tokenizer
from tests.gguf_files import make_gguf

TEXTS = ["Hello world", " leading space and  double  spaces", "line one\nline two\n\n\ttab",
         "héllo wörld, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어", "emoji 😀🎉 end 🚀",
         "numbers 3.14159 1,000,000 -17 1e-5", "<|im_start|>user\nhi<|im_end|>",
         "def add(a, b):\n    return a + b  # code", ""]
CHATS = [
    [ChatTurn("user", "What is the capital of France?")],
    [ChatTurn("system", "Be brief."), ChatTurn("user", "Hi!"),
     ChatTurn("assistant", "Hello. 👋"), ChatTurn("user", "Bye\nnow")],
]


def transformers_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def assert_same_tokenizer(ours: Tokenizer, theirs, eos_ids: set[int], num_tokens: int) -> None:
    """`num_tokens`: the file's token list. transformers may hold one more (it adds GPT-2's
    "<|endoftext|>" as the unknown token to a file that names none, an id past the model's
    embeddings); ours keeps exactly the file's, and the texts here never spell that token."""
    for text in TEXTS:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert (ours.decode(ids, skip_special_tokens=skip)
                        == theirs.decode(ids, skip_special_tokens=skip)), (text, skip)
    for chat in CHATS:
        messages = [{"role": t.role, "content": t.content} for t in chat]
        for gen_prompt in (True, False):
            text = theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=gen_prompt)
            assert ours.render_chat(chat, add_generation_prompt=gen_prompt) == text
            # The template writes its own special tokens: tokenize without adding more.
            assert (ours.encode_chat(chat, add_generation_prompt=gen_prompt)
                    == theirs(text, add_special_tokens=False)["input_ids"])
    assert ours.eos_token_ids == eos_ids
    assert ours.vocab_size == num_tokens <= len(theirs)


@pytest.mark.parametrize("arch", ["llama2", "qwen2", "qwen3"])
def test_tiny_gguf_tokenizer_matches_transformers(arch, tmp_path):
    _, gguf_file = make_gguf(arch, "F16", tmp_path, num_hidden_layers=1)
    ours = Tokenizer(gguf_checkpoint_dir(gguf_file, tmp_path / "cache"))
    theirs = transformers_tokenizer(gguf_file)
    # EOS plus the end-of-turn id the file names (tokenizer.ggml.eot_token_id).
    eos_ids = {theirs.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|im_end|>")}
    assert_same_tokenizer(ours, theirs, eos_ids, num_tokens=2048)  # tests/checkpoints.py's
