"""`folio:tiny-random`: a real tokenizer, a small Llama with random weights, built without torch.

Tests and `folio serve --model folio:tiny-random` run on this, so a fresh machine with no model
hub can serve, stream and be tested. The weights are random (the directory carries a
`FOLIO_RANDOM_WEIGHTS` marker that both services report as `random_weights`), so the text is
noise; the tokenizer is real byte-level BPE, so every UTF-8 string round-trips and
detokenization is honest work.

Everything is derived from constants in this file: the tokenizer is trained on the corpus
`CORPUS` below, the weights are numpy draws from a fixed seed, initialized as transformers
initializes a LlamaForCausalLM (normal(0, initializer_range) for linear and embedding weights,
the padding token's embedding row zero, ones for RMSNorm weights), and config.json and
generation_config.json hold what transformers writes for that LlamaConfig, so transformers
loads the directory as its own (the tests' oracle). The directory is built once per cache dir
under a versioned name (bump `VERSION` when anything here changes) in a temp dir that is
renamed into place, so concurrent first uses never see a half-written model.

    python -m checkpoints.tiny_random [--cache-dir D]   # prints the directory last
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from checkpoints.cache_dir import default_cache_dir

VERSION = 2  # 2: weights drawn by numpy (1: by torch through transformers)
MODEL_NAME = "folio-tiny-random"
SEED = 1234
VOCAB_SIZE_TARGET = 2048  # the corpus holds enough merges to reach it exactly
MAX_POSITION_EMBEDDINGS = 2048
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 688
NUM_HIDDEN_LAYERS = 4
NUM_ATTENTION_HEADS = 8
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
INITIALIZER_RANGE = 0.05  # wider than 0.02 so greedy outputs are not a sea of ties

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN]  # ids 0..4, in this order

# ChatML turns. The template emits BOS itself, so render it and tokenize without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

README = f"""# {MODEL_NAME}

Folio's embedded tiny model (`folio:tiny-random`). **The weights are random** (seed {SEED}):
the model produces noise. It exists so that Folio can start, stream and be tested without
downloading anything. The tokenizer is a real byte-level BPE trained on a small built-in corpus.

Serve a real model with `folio serve --model DIR_OR_HUB_ID`.
"""

# The tokenizer's training text: varied prose, dialogue, code, numbers and non-ASCII scripts, so
# that common English words become single tokens and other scripts still split sensibly.
CORPUS = """\
The harbor was quiet before dawn. Fishing boats rocked against the pier, their ropes creaking
while gulls circled above the lighthouse. Maria walked along the stone wall, counting the boats
as she always did: twelve on the left, nine on the right, and one old wooden skiff that nobody
had painted in years. She remembered when her grandfather rowed it out past the breakwater.
"Are you coming to the market today?" asked Tomas. "Only if the weather holds," she answered.
Scientists measure the temperature of the ocean at many depths. Warm water near the surface
mixes slowly with the colder layers below, and the currents carry heat from the equator toward
the poles. Over decades, these small changes add up to large effects on climate and on life.
A computer program is a list of instructions. The processor reads each instruction, performs
an operation on numbers stored in memory, and moves on to the next one. Modern processors run
billions of instructions every second, yet a single mistake in a program can stop everything.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i * 2))
if (count > 0 && buffer != NULL) { free(buffer); count = 0; }
SELECT name, price FROM products WHERE price < 100 ORDER BY name;
The recipe calls for 2 cups of flour, 1 teaspoon of salt, 3 eggs and 250 ml of milk. Mix the
dry ingredients first, then whisk in the eggs and milk until the batter is smooth. Let it rest
for 30 minutes before cooking. Serves 4 people, or 2 very hungry ones.
On March 14, 2025, the council voted 7 to 2 in favor of the new library. Construction will
begin next spring and should take about eighteen months. The building will have three floors,
a reading garden, and rooms where students can study late into the evening.
Learning a language takes patience. At first every sentence is a puzzle; later the words
arrive on their own, and one day you notice that you are thinking in the new language without
translating. Teachers say that reading stories aloud is one of the best ways to practice.
Questions and answers: What is the capital of France? Paris. How many days are in a week?
Seven. Which planet is closest to the sun? Mercury. Why is the sky blue? Sunlight scatters
off the molecules in the air, and blue light scatters more than red light does.
The train left the station at 8:45 and crossed the valley on a long iron bridge. Passengers
pressed their faces to the windows to watch the river far below, shining like a silver thread
between the green hills. A child asked whether the bridge could ever fall; her father laughed.
Le café était fermé, alors nous avons marché jusqu'à la boulangerie près de l'église.
Déjà vu, naïve, façade, résumé, coöperate, São Paulo, Zürich, Málaga, Kraków, Ångström.
Über den Wolken muss die Freiheit wohl grenzenlos sein, sagte er und lächelte müde.
El niño comió una manzana mientras la señora leía el periódico en la estación.
Привет, мир! Как дела? Сегодня хорошая погода для прогулки по парку.
Γεια σου κόσμε. Η θάλασσα είναι ήρεμη σήμερα.
こんにちは世界。今日はいい天気ですね。東京の桜はとてもきれいです。
你好，世界！我们今天去图书馆看书吧。这本书很有意思。
안녕하세요, 세계! 오늘 날씨가 정말 좋네요.
مرحبا بالعالم. كيف حالك اليوم؟
नमस्ते दुनिया। आज मौसम अच्छा है।
Emoji are text too: 😀 😂 🎉 🚀 ❤️ 👍 🌍 🐍 ☕ 🍕 — and so are symbols like € £ ¥ © ® ™ ± × ÷ ≤ ≥ ∞ → ←.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -17 1e-5 65536 1,000,000.
The committee reviewed every proposal carefully. Some were practical and cheap; others were
ambitious and would require years of work. In the end they chose a plan that balanced both:
start small, measure the results, and grow only what proves useful to the people it serves.
Good morning! Thank you very much. You are welcome. Please help me understand this problem.
I think that the answer is simple, but we should check it again before we write it down.
The old library smelled of paper and dust. Rows of books stretched into the shadows, and the
librarian knew exactly where each one belonged, even the ones that had not been opened for a
hundred years. Visitors whispered, as if the books themselves might be sleeping.
Rain fell all afternoon. The streets emptied, the shops lit their lamps early, and the sound
of water in the gutters became the only music in town until the evening bells began to ring.
User: Can you explain how a bicycle stays upright? Assistant: Mostly through steering. When the
bike leans, the rider turns the front wheel into the lean without thinking, and the wheels'
motion brings the frame back over its contact points. Speed makes those corrections easier.
User: Write a short poem about autumn. Assistant: Leaves let go of the branches slowly, / gold
and copper on the wind, / the garden keeps their colors for a week, / then winter writes again.
Servers answer requests from clients over the network. A request arrives, waits in a queue,
is scheduled with other requests into a batch, and the results stream back as they are ready.
Memory is divided into fixed-size blocks so that long and short requests can share it without
waste; when memory runs out, the newest request is paused and resumed later from its prompt.
Error: file not found (path=/tmp/data.json, code=404). Warning: retrying in 5 seconds...
{"id": 17, "name": "widget", "tags": ["red", "small"], "price": 9.99, "in_stock": true}
https://example.com/docs/getting-started?lang=en#install  user@example.org  +1 (555) 010-2030
Mountains rise slowly over millions of years as plates of rock push against each other, and
rivers wear them down again, carrying sand and gravel to the plains and finally to the sea.
Farmers watch the sky, the soil and the calendar; a late frost or an early drought can decide
whether the harvest feeds a family through the winter or leaves them buying grain in spring.
The orchestra tuned their instruments while the audience found their seats. Then the hall fell
silent, the conductor raised her hands, and the first quiet notes of the violins began to play.
Doctors recommend drinking enough water, sleeping seven to nine hours, walking every day and
eating vegetables, fruit and whole grains. Small habits, repeated for years, matter the most.
"""


def tiny_random_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The model directory, building it first if this cache dir does not hold it yet."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-random-v{VERSION}"
    if (target / "FOLIO_RANDOM_WEIGHTS").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_tiny_random(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        try:
            os.rename(tmp, target)  # atomic; fails if a concurrent builder got there first
        except OSError:
            if not (target / "FOLIO_RANDOM_WEIGHTS").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tokenizer():
    """Train the byte-level BPE tokenizer (deterministic: same corpus, same merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE_TARGET,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no <unk> ever
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Like Llama 3: encode(text) starts with BOS; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _tokenizer_config(tok) -> dict:
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(tok, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = _tokenizer_config(tok)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def special_token_ids(tok) -> dict[str, int]:
    return {
        "bos_token_id": tok.token_to_id(BOS_TOKEN),
        "eos_token_id": tok.token_to_id(EOS_TOKEN),
        "pad_token_id": tok.token_to_id(PAD_TOKEN),
        "im_end_id": tok.token_to_id(IM_END),
    }


def hf_config(vocab_size: int, ids: dict[str, int]) -> dict:
    """config.json: the fields transformers writes for this LlamaConfig (its own version
    number aside)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos_token_id"],
        "dtype": "float32",
        "eos_token_id": ids["eos_token_id"],
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": INITIALIZER_RANGE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_hidden_layers": NUM_HIDDEN_LAYERS,
        "num_key_value_heads": NUM_KEY_VALUE_HEADS,
        "pad_token_id": ids["pad_token_id"],
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": True,  # no lm_head.weight: the head is the embedding
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def generation_config(ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": ids["bos_token_id"],
        "do_sample": True,
        "eos_token_id": [ids["eos_token_id"], ids["im_end_id"]],  # a chat turn ends at <|im_end|>
        "pad_token_id": ids["pad_token_id"],
        "temperature": 1.0,
        "top_p": 1.0,
    }


def random_weights(vocab_size: int, pad_token_id: int) -> dict[str, np.ndarray]:
    """Every tensor of the model, float32, HF names, drawn in this fixed order from SEED."""
    rng = np.random.default_rng(SEED)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(INITIALIZER_RANGE)

    q_rows, kv_rows = NUM_ATTENTION_HEADS * HEAD_DIM, NUM_KEY_VALUE_HEADS * HEAD_DIM
    embed = normal(vocab_size, HIDDEN_SIZE)
    embed[pad_token_id] = 0.0  # nn.Embedding(padding_idx=pad_token_id), as HF initializes it
    weights = {"model.embed_tokens.weight": embed,
               "model.norm.weight": np.ones(HIDDEN_SIZE, dtype=np.float32)}
    for i in range(NUM_HIDDEN_LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q_rows, HIDDEN_SIZE),
            p + "self_attn.k_proj.weight": normal(kv_rows, HIDDEN_SIZE),
            p + "self_attn.v_proj.weight": normal(kv_rows, HIDDEN_SIZE),
            p + "self_attn.o_proj.weight": normal(HIDDEN_SIZE, q_rows),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.down_proj.weight": normal(HIDDEN_SIZE, INTERMEDIATE_SIZE),
            p + "input_layernorm.weight": np.ones(HIDDEN_SIZE, dtype=np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN_SIZE, dtype=np.float32),
        }
    return weights


def write_model(out_dir: Path, vocab_size: int, ids: dict[str, int]) -> None:
    from safetensors.numpy import save_file

    weights = random_weights(vocab_size, ids["pad_token_id"])
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors creates it private
    for name, value in (("config.json", hf_config(vocab_size, ids)),
                        ("generation_config.json", generation_config(ids))):
        (out_dir / name).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_tiny_random(out_dir: Path) -> None:
    out_dir = Path(out_dir)
    tok = build_tokenizer()
    write_tokenizer(tok, out_dir)
    write_model(out_dir, tok.get_vocab_size(), special_token_ids(tok))
    (out_dir / "README.md").write_text(README)
    # Written last: its presence means the directory is complete.
    (out_dir / "FOLIO_RANDOM_WEIGHTS").write_text(
        f"{MODEL_NAME} v{VERSION}: random weights, seed {SEED}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints.tiny_random",
        description="Create (once) and print the directory of folio:tiny-random.")
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default: $FOLIO_CACHE_DIR or ~/.cache/folio)")
    args = parser.parse_args(argv)
    path = tiny_random_dir(args.cache_dir)
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
