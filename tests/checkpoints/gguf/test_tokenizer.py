"""The scheduler's Tokenizer on a converted GGUF equals transformers' tokenizer for the GGUF
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`): ids, chat rendering, decoding, EOS."""

from __future__ import annotations

import pytest

from checkpoints.gguf import gguf_checkpoint_dir
from scheduler_svc.text.tokenizer import ChatTurn, Tokenizer
from tests.fixtures.gguf_files import make_gguf

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
    assert_same_tokenizer(ours, theirs, eos_ids, num_tokens=2048)  # tests/fixtures/checkpoints.py's


def _write_sentencepiece_tokenizer(writer, vocab_size: int) -> None:
    """A Llama 2 style vocabulary (`tokenizer.ggml.model` "llama"): <unk>, <s>, </s>, the 256
    byte-fallback tokens, then pieces with "▁" for a space, scored best first; no merges (they
    are derived from the scores)."""
    import gguf

    pieces = ["▁", "e", "t", "a", "o", "n", "h", "s", "r", "l", "d", "i", "w", "c", "u", "T",
              "H", ".", ",", "▁t", "he", "▁the", "▁a", "er", "in", "▁w", "▁T", "▁The", "an",
              "or", "▁s", "▁h", "re", "on", "▁wor", "ld", "▁world", "ll", "▁he", "llo",
              "▁hello", "▁H", "▁Hello", "at", "▁c", "▁ca", "▁cat", "▁sat", "▁on", "en", "ou"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    assert len(tokens) <= vocab_size
    tokens += [f"▁pad{i}" for i in range(vocab_size - len(tokens))]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab_size - 259))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab_size - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                             "{{ m['content'] }}{{ eos_token }}{% endfor %}")


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    """Llama 2 and early Mistral files carry a sentencepiece vocabulary: BOS added by default,
    "▁" for spaces, unknown characters spelled as bytes."""
    from tests.executor.harness import make_hf_model, save_checkpoint
    from tests.fixtures.gguf_files import write_gguf

    vocab_size = 320
    hf_dir = save_checkpoint(make_hf_model("llama2", num_hidden_layers=1,
                                           vocab_size=vocab_size), tmp_path / "hf")
    gguf_file = write_gguf(hf_dir, tmp_path / "sp.gguf", write_tokenizer=lambda w:
                           _write_sentencepiece_tokenizer(w, vocab_size))
    ours = Tokenizer(gguf_checkpoint_dir(gguf_file, tmp_path / "cache"))
    theirs = transformers_tokenizer(gguf_file)
    assert ours.encode("Hello world")[0] == 1  # BOS
    assert_same_tokenizer(ours, theirs, eos_ids={2}, num_tokens=vocab_size)
