"""bench/quant_accuracy end to end on the tiny random model: two real servers (unquantized,
int8), the result files, and numbers that hold by construction."""

from __future__ import annotations

import json
import math

import pytest

from bench.quant_accuracy import common_prefix, main

# Two real servers.
pytestmark = pytest.mark.e2e


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([5, 6], [5, 6]) == 2


def test_quant_accuracy_writes_its_results(tmp_path, folio_cache_dir, monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(folio_cache_dir))
    main(["--model", "folio:tiny-random", "--schemes", "none,int8", "--num-prompts", "3",
          "--max-tokens", "4", "--window", "96", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "quant-accuracy.json").read_text())
    none, int8 = result["schemes"]
    assert (none["scheme"], int8["scheme"]) == ("none", "int8")
    assert none["greedy_identical"] == 1.0 and none["greedy_common_prefix"] == [4, 4, 4]
    assert none["perplexity_tokens"] == int8["perplexity_tokens"] > 1000
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in (none, int8))
    assert 0 < int8["weight_bytes"] < none["weight_bytes"]
    assert "| int8 |" in (tmp_path / "quant-accuracy.md").read_text()


def test_quant_accuracy_serves_a_written_checkpoint(tmp_path, folio_cache_dir, monkeypatch):
    """bench.rtn_checkpoint writes an AWQ checkpoint of a float one; LABEL=DIR serves it as it
    is next to the float model."""
    from bench.rtn_checkpoint import main as write_rtn
    from tests.fixtures.checkpoints import make_checkpoint

    monkeypatch.setenv("FOLIO_CACHE_DIR", str(folio_cache_dir))
    src = make_checkpoint("llama2", tmp_path / "float")
    write_rtn(["--format", "awq", "--group-size", "16", "--src", str(src),
               "--out", str(tmp_path / "awq")])
    main(["--model", str(src), "--schemes", f"none,awq-rtn={tmp_path / 'awq'}",
          "--num-prompts", "2", "--max-tokens", "4", "--window", "96",
          "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "quant-accuracy.json").read_text())
    none, awq = result["schemes"]
    assert awq["scheme"] == "awq-rtn" and awq["model"] == str(tmp_path / "awq")
    assert math.isfinite(awq["perplexity"]) and 0 < awq["weight_bytes"] < none["weight_bytes"]
