"""`python -m checkpoints.tiny_random`: deterministic, safe under concurrent first use, and a
checkpoint HF transformers loads as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "FOLIO_RANDOM_WEIGHTS", "README.md")


def start_build(cache_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "checkpoints.tiny_random", "--cache-dir",
                             str(cache_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> Path:
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    return Path(out.splitlines()[-1])


def test_concurrent_first_use_and_determinism(tmp_path, default_model_dir):
    shared = tmp_path / "shared"
    procs = [start_build(shared) for _ in range(3)]  # racing first uses of one cache dir
    dirs = [finish(p) for p in procs]
    assert len(set(dirs)) == 1 and dirs[0].parent == shared
    assert sorted(p.name for p in shared.iterdir()) == [dirs[0].name]  # no temp dirs left over
    for name in FILES:  # built independently in another cache dir: the same bytes
        assert (dirs[0] / name).read_bytes() == (default_model_dir / name).read_bytes(), name
    assert finish(start_build(shared)) == dirs[0]  # second use: found, not rebuilt


def test_loads_in_transformers(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert model.config.vocab_size == len(tokenizer) >= 2000
    text = "Grüße, 世界! 🚀 naïve café"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert chat == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(logits).all()
    assert "random" in (default_model_dir / "README.md").read_text()
