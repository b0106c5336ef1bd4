"""`folio serve --model tiny.gguf`: the scheduler converts the file once (a subprocess), hands the
converted directory to its executor child, and the served greedy tokens equal transformers
loading the same GGUF. The same for a Qwen2-MoE file (merged expert tensors, a shared expert),
dense layers and Q4_0 experts served as GGUF blocks (one linear per expert and projection,
the executor's "model loaded" line counting their block bytes); transformers reads
no expert sizes from a GGUF, so its oracle gets the original checkpoint's config
(tests/checkpoints/gguf/test_convert_moe.py)."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from client import FolioClient
from tests.checkpoints.gguf.test_convert import load_transformers_gguf
from tests.e2e.hf_oracle import hf_greedy
from tests.fixtures.gguf_files import make_gguf

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return make_gguf("qwen2", "Q8_0", tmp_path_factory.mktemp("gguf"))[1]


def test_folio_serve_a_gguf_file(folio_server, folio_cache_dir, gguf_file):
    with folio_server(model=gguf_file, args=["--log-format", "console"]) as server, \
            FolioClient(server.address, timeout=120) as client:
        info = client.model_info()
        # The file's name, not the cache entry's hash nor a path.
        assert info["model_name"] == gguf_file.stem
        assert info["architecture"] == "Qwen2ForCausalLM"
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        prompts = [client.tokenize("The harbor was quiet before dawn."),
                   client.tokenize(messages=chat)]
        served = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                       ignore_eos=True).token_ids for p in prompts]
        text = client.generate_text(messages=chat, temperature=0.0, max_tokens=4).text
        log = server.log_tail(1 << 20)
    assert served == hf_greedy(load_transformers_gguf(gguf_file), prompts, MAX_TOKENS)
    assert isinstance(text, str)
    # Converted once, by the scheduler; its executor child was handed the directory.
    assert log.count("converting GGUF to a checkpoint") == 1, log[-3000:]
    converted = folio_cache_dir / "gguf" / hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert f"args='--model {converted} " in log, log[-3000:]
    assert "Traceback" not in log


def test_folio_serve_a_moe_gguf_file(folio_server, tmp_path):
    hf_dir, gguf_file = make_gguf("qwen2_moe", "Q8_0", tmp_path, expert_type="Q4_0")
    with folio_server(model=gguf_file, args=["--log-format", "console"]) as server, \
            FolioClient(server.address, timeout=120) as client:
        assert client.model_info()["architecture"] == "Qwen2MoeForCausalLM"
        prompts = [client.tokenize("The harbor was quiet before dawn."),
                   client.tokenize(messages=[{"role": "user", "content": "Hi there!"}])]
        served = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                       ignore_eos=True).token_ids for p in prompts]
        log = server.log_tail(1 << 20)
    assert served == hf_greedy(load_transformers_gguf(gguf_file, hf_dir), prompts, MAX_TOKENS)
    assert "expert_tensors=36" in log and "Traceback" not in log, log[-3000:]
    # The executor holds the experts as Q4_0 blocks (0.625 bytes a weight), not as float32.
    loaded = re.search(r"model loaded [^\n]*", log)
    assert loaded is not None and "quantization=gguf" in loaded.group(0), log[-3000:]
    expert_bytes = re.search(r"expert_bytes=(\d+)", loaded.group(0))
    config = json.loads((hf_dir / "config.json").read_text())
    num = (config["num_hidden_layers"] * config["num_experts"] * 3 * config["hidden_size"]
           * config["moe_intermediate_size"])
    assert expert_bytes is not None and int(expert_bytes.group(1)) <= 0.8 * num, loaded.group(0)
