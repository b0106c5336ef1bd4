"""`folio bench context` (client/bench/context.py): its arguments, the random Mistral pair it is
for, its report from fabricated runs, and one short real run on the tiny model. Speed is the
benchmark's business: nothing here asserts a time beyond "positive"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.bench import models, report
from client.bench.cli import build_parser, default_peers, parse_random_models
from client.bench.context import DEFAULT_INPUT_LENS, cell_aggregates, parse_input_lens
from client.bench.metrics import MODES, tpot_ratio

ROOT = Path(__file__).resolve().parents[2]
TINY_RANDOM = "folio:tiny-random"  # checkpoints.named_models
PAIR = "smollm2-135m-mistral,smollm2-135m-swa256"


# ---- arguments ------------------------------------------------------------------------------

def test_context_mode_takes_a_model_list_and_prompt_lengths():
    assert "context" in MODES
    args = build_parser().parse_args(["context", "--random-model", PAIR,
                                      "--input-lens", "4096,256, 1024,256", "--batch-size", "2"])
    assert args.mode == "context" and args.batch_size == 2
    assert parse_random_models(args.random_model, args.mode) == ["smollm2-135m-mistral",
                                                                 "smollm2-135m-swa256"]
    assert parse_input_lens(args.input_lens) == [256, 1024, 4096]  # distinct, ascending
    assert args.peers is None and default_peers("context") == ("folio",)
    assert "vllm" in default_peers("throughput")
    defaults = build_parser().parse_args(["context"])
    assert parse_input_lens(defaults.input_lens) == parse_input_lens(DEFAULT_INPUT_LENS)
    assert len(parse_input_lens(DEFAULT_INPUT_LENS)) >= 3


@pytest.mark.parametrize("text", ["", "256,x", "0,256", "-4"])
def test_bad_prompt_lengths_are_refused(text):
    with pytest.raises(SystemExit, match="--input-lens"):
        parse_input_lens(text)


def test_a_model_list_is_for_context_mode_only_and_names_must_exist():
    assert parse_random_models(None, "latency") == []
    assert parse_random_models("smollm2-135m", "latency") == ["smollm2-135m"]
    with pytest.raises(SystemExit, match="context mode only"):
        parse_random_models(PAIR, "latency")
    with pytest.raises(SystemExit, match="--random-model is one of"):
        parse_random_models("smollm2-135m,no-such-model", "context")


def test_the_mistral_pair_differs_from_each_other_only_in_the_window():
    plain, windowed = (models.RANDOM_MODELS[n] for n in PAIR.split(","))
    assert {k for k in plain.keys() | windowed.keys()
            if plain.get(k) != windowed.get(k)} == {"sliding_window"}
    assert (models.sliding_window(plain), models.sliding_window(windowed)) == (None, 256)
    assert windowed["architectures"] == ["MistralForCausalLM"]
    assert windowed["model_type"] == "mistral" and windowed["head_dim"] == 64
    assert windowed["max_position_embeddings"] == 8192
    assert windowed["rope_parameters"]["rope_theta"] == 100000.0
    smollm2 = models.RANDOM_MODELS["smollm2-135m"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "tie_word_embeddings"):
        assert windowed[key] == smollm2[key], key
    # Folio reads the window the same way (Qwen2's unused window is not one).
    from executor_svc.loading.model_config import ModelConfig

    hf_fields = {k: v for k, v in windowed.items() if k != "model_type"}
    num_layers = windowed["num_hidden_layers"]
    assert ModelConfig.from_dict(hf_fields).layer_windows == (256,) * num_layers
    assert ModelConfig.from_dict({**hf_fields, "sliding_window": None}).layer_windows == \
        (0,) * num_layers
    assert models.sliding_window(models.RANDOM_MODELS["qwen2.5-0.5b"]) is None
    assert models.sliding_window({"sliding_window": 4096, "use_sliding_window": False}) is None


# ---- report ---------------------------------------------------------------------------------

def _req(ttft_s: float, e2e_s: float, num_output: int = 5, prompt_len: int = 8) -> dict:
    return {"prompt_len": prompt_len, "num_output": num_output, "ttft_s": ttft_s, "e2e_s": e2e_s}


def test_a_refused_run_is_reported_by_its_grpc_status_and_details():
    import grpc

    from client.bench.context import error_text

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "prompt has 512 tokens but max_model_len is 256; shorten the prompt"

    assert error_text(Refused()) == ("INVALID_ARGUMENT: prompt has 512 tokens but max_model_len "
                                     "is 256; shorten the prompt")
    assert error_text(RuntimeError("no\ntoken")) == "no token"


def test_tpot_is_pooled_over_requests_and_repetitions():
    runs = [{"requests": [_req(0.1, 0.5), _req(0.1, 0.9)]},  # TPOT 100 and 200 ms
            {"requests": [_req(0.2, 1.4)]}]  # 300 ms
    cells = cell_aggregates(runs)
    tpot, ttft = cells["TPOT (ms)"], cells["TTFT (ms)"]
    assert (tpot.median, tpot.low, tpot.high) == pytest.approx((200.0, 100.0, 300.0))
    assert len(tpot.values) == 3 and ttft.median == pytest.approx(100.0)
    assert "TPOT (ms)" not in cell_aggregates([{"requests": [_req(0.1, 0.1, num_output=1)]}])


def _fabricated(tmp_path: Path):
    """What context.run hands report.write_context: two models, three lengths, the windowed
    model failing at the longest."""
    lens = [256, 1024, 4096]
    tpot_s = {"smollm2-135m-mistral": {256: 0.010, 1024: 0.014, 4096: 0.030},
              "smollm2-135m-swa256": {256: 0.010, 1024: 0.0105}}
    runs = {col: {str(n): [{"rep": rep, "requests": [_req(0.05 * n / 256, 0.05 * n / 256
                                                           + 4 * t * (1 + rep / 100))]}
                           for rep in range(2)] for n, t in by_len.items()}
            for col, by_len in tpot_s.items()}
    cells = {col: {n: cell_aggregates(r) for n, r in by_len.items()}
             for col, by_len in runs.items()}
    machine = report.machine_facts() | {"git_commit": "abc123", "command": "folio bench context"}
    result = {
        "mode": "context", "name": "2026-11-28-test", "dtype": "float32", "reps": 2,
        "competing_load": False, "machine": machine, "load_before": [0.5, 0, 0],
        "load_after": [0.7, 0, 0],
        "models": {col: {"dir": f"/cache/{col}", "folio_model": f"/cache/{col}",
                         "architecture": "MistralForCausalLM", "random_weights": True,
                         "sliding_window": models.sliding_window(models.RANDOM_MODELS[col]),
                         "max_model_len": 4128, "config": {}} for col in tpot_s},
        "columns": {col: {"model": col, "peer": "folio"} for col in tpot_s},
        "workload": {"dataset": "random", "batch_size": 1, "input_lens": lens, "output_len": 5,
                     "seed": 0, "requested_output_tokens_per_run": 5},
        "settings": {}, "peers": {}, "skipped": {},
        "failed": {"smollm2-135m-swa256": {"4096": "failed: prompt longer than max_model_len"}},
        "short_outputs": {"smollm2-135m-swa256": {"1024": 1.0}}, "runs": runs,
    }
    result["models"]["smollm2-135m-swa256"]["folio_max_model_len"] = 256
    result["models"]["smollm2-135m-mistral"]["folio_max_model_len"] = 4128
    return report.write_context(tmp_path, result["name"], result, cells)


def test_markdown_has_lengths_down_models_across_windows_and_the_tpot_ratio(tmp_path):
    paths = _fabricated(tmp_path)
    table = paths["md"].read_text()
    lines = table.splitlines()
    header = lines.index("## TPOT (ms) by context") + 2
    assert [c.strip() for c in lines[header].strip("|").split("|")] == [
        "prompt tokens", "smollm2-135m-mistral", "smollm2-135m-swa256"]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")[1:]]
            for r in lines[header + 2:header + 7]}
    assert rows["window"] == ["none (full attention)", "256 tokens"]
    assert rows["4096"][0].startswith("30.") and rows["4096"][1] == "failed"
    assert all("–" in cell for cell in rows["256"])  # median (min–max) of two repetitions
    # The windowed model's longest context failed: its ratio is over the longest that ran.
    assert rows["1024"][1].endswith(" (short)")
    assert "smollm2-135m-swa256 at 1024 prompt tokens: short, 1 output tokens of 5" in table
    assert rows["longest / shortest"] == ["3.00 (4096 vs 256)", "1.05 (1024 vs 256)"]
    assert "## TTFT (ms) by context" in table
    assert f"({report.cpu_isa()})" in table  # every result names the ISA
    assert "smollm2-135m-swa256, sliding window 256 tokens: TPOT at 1024 prompt tokens is " \
           "1.05x TPOT at 256" in table
    assert "smollm2-135m-swa256 at 4096 prompt tokens: failed: prompt longer" in table
    assert "Folio only" in table
    assert "max_model_len 4128 (Folio serves 256)" in table  # the server capped it
    assert "smollm2-135m-mistral-random" not in table and table.count("Folio serves") == 1


def test_json_keeps_every_request_the_summary_and_the_ratios(tmp_path):
    paths = _fabricated(tmp_path)
    result = json.loads(paths["json"].read_text())
    assert result["mode"] == "context" and result["machine"]["isa"]
    summary = result["summary"]["smollm2-135m-mistral"]
    assert set(summary) == {"256", "1024", "4096"}
    assert summary["4096"]["TPOT (ms)"]["count"] == 2
    assert result["tpot_ratio"]["smollm2-135m-mistral"]["ratio"] == pytest.approx(3.0, rel=0.01)
    assert result["tpot_ratio"]["smollm2-135m-swa256"]["longest"] == 1024
    assert len(result["runs"]["smollm2-135m-swa256"]["256"]) == 2
    assert tpot_ratio({"256": {}}) is None
    if "png" in paths:
        assert paths["png"].read_bytes().startswith(b"\x89PNG")


# ---- the real command -----------------------------------------------------------------------

@pytest.mark.e2e
def test_context_end_to_end_on_the_tiny_model(tmp_path, folio_cache_dir):
    lens, output_len = [8, 24], 4
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "client.cli", "bench", "context", "--model", TINY_RANDOM,
           "--input-lens", ",".join(map(str, lens)), "--output-len", str(output_len),
           "--reps", "1", "--out", str(out), "--name", "ctx"]
    env = {**os.environ, "FOLIO_CACHE_DIR": str(folio_cache_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    result = json.loads(next(out.glob("*-ctx.json")).read_text())
    (col,) = result["columns"]
    assert result["models"][col]["sliding_window"] is None
    assert result["models"][col]["max_model_len"] == lens[-1] + output_len
    assert result["failed"] == {} and result["skipped"] == {}
    for n in lens:
        (run,) = result["runs"][col][str(n)]
        assert [(r["prompt_len"], r["num_output"]) for r in run["requests"]] == [(n, output_len)]
        assert result["summary"][col][str(n)]["TPOT (ms)"]["median"] > 0
    assert result["machine"]["command"].startswith("folio bench context")
    table = next(out.glob("*-ctx.md")).read_text()
    assert f"({result['machine']['isa']})" in table and "| longest / shortest |" in table
