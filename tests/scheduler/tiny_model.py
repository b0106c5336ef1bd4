"""A model directory with only what the scheduler reads: a byte-level BPE tokenizer trained here
with `tokenizers`, tokenizer_config.json with a chat template, config.json and
generation_config.json. No weights: scheduler tests never load torch.

The corpus is English, so characters from other scripts and emoji stay split into byte tokens:
single tokens that end in the middle of a UTF-8 character, which is what detokenization must
survive.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

BOS, EOS, END_OF_TURN = "<s>", "</s>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, END_OF_TURN, "<|im_start|>"]  # ids 0..3
BOS_ID, EOS_ID, END_OF_TURN_ID = 0, 1, 2
CONFIG_VOCAB_SIZE = 512  # the "model's" vocab: larger than the tokenizer's, as real ones often are

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a scheduler hands out blocks of key value cache to every sequence",
    "tokens stream back to the client one step at a time",
    "hello world, hello folio; numbers 0123456789 and punctuation!?",
] * 20

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    return tok


def build_sentencepiece_style_tokenizer() -> Tokenizer:
    """Llama-2 style: "▁" for spaces, byte fallback for unknown characters, and a decoder that
    strips the first token's leading space (the case windowed detokenization must get right)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<unk>", BOS, EOS])
    tok.train_from_iterator(CORPUS, trainer)
    # The <0xXX> byte tokens are ordinary vocabulary (not special, so decoding keeps them).
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(data))


def write_model_dir(path: Path, *, config_eos=EOS_ID, generation_eos=(EOS_ID, END_OF_TURN_ID),
                    random_weights: bool = True, tokenizer: Tokenizer | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (tokenizer or build_tokenizer()).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": {"content": EOS}, "chat_template": CHAT_TEMPLATE}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": CONFIG_VOCAB_SIZE,
        "eos_token_id": config_eos, "bos_token_id": BOS_ID}))
    (path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": list(generation_eos)}))
    if random_weights:
        (path / "FOLIO_RANDOM_WEIGHTS").write_text("random weights\n")
    return path
