"""gpt-oss at TP = 2 against TP = 1 (gloo, real processes): the same greedy tokens and logits
(a chunked prefill then decode steps, test_tp_model.py's `greedy_run`), and each rank reads
only its slices: its heads' sinks, its range of the interleaved gate/up columns (gate and up
alike) and of down's rows; the down bias, the router and the norms whole (the down bias is
added by rank 0 alone). test_tp_model.py also runs it among every harness architecture."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from checkpoints.files import open_safetensors, read_weight_headers, safetensors_files
from executor_svc.loading.loader import load_weights, plan_weights
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models import model_class
from tests.executor.harness import make_hf_model
from tests.executor.harness import save_checkpoint as save_hf
from tests.executor.parallel.test_tp_model import (
    NUM_DECODE,
    _model_rank,
    _RecordingFile,
    greedy_run,
)
from tests.executor.parallel.tp_procs import run_ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(save_hf(make_hf_model("gpt_oss"), tmp_path_factory.mktemp("tp") / "gpt_oss"))


def test_tp2_greedy_matches_tp1(checkpoint, tmp_path):
    expected = greedy_run(Path(checkpoint))
    run_ranks(_model_rank, 2, {"gpt_oss": checkpoint}, str(tmp_path))
    got = torch.load(tmp_path / "gpt_oss.pt")
    assert got["tokens"] == expected["tokens"]
    assert len(got["tokens"]["r2"]) == NUM_DECODE
    for step, (a, b) in enumerate(zip(got["logits"], expected["logits"], strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, s=step: f"step {s}: {m}")


def _reads_rank(rank: int, model_dir: str, out_dir: str) -> None:
    cfg = ModelConfig.from_dir(Path(model_dir))
    reads: list = []

    @contextlib.contextmanager
    def recording_open(file, framework="np"):
        with open_safetensors(file, framework) as f:
            yield _RecordingFile(f, reads)

    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, dtype=torch.float32, max_model_len=64,
                                              backend=None)
    headers = read_weight_headers(safetensors_files(Path(model_dir)))
    load_weights(model.to_empty(device="cpu"),
                 plan_weights(model, headers, cfg.tie_word_embeddings),
                 open_file=recording_open)
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(reads))


def test_each_rank_reads_only_its_slices(checkpoint, tmp_path):
    run_ranks(_reads_rank, 2, checkpoint, str(tmp_path))
    reads = [{r[0]: r[1:] for r in json.loads((tmp_path / f"{rank}.json").read_text())}
             for rank in range(2)]
    inter, heads = 128, 4  # the harness's intermediate_size and q heads
    prefix = "model.layers.1."
    expect = {  # tensor -> (dim, rank 0's [start, stop)); rank 1 the next range
        "self_attn.sinks": (0, 0, heads // 2),
        "mlp.experts.gate_up_proj": (2, 0, inter),  # 2I interleaved columns: half each
        "mlp.experts.gate_up_proj_bias": (1, 0, inter),
        "mlp.experts.down_proj": (1, 0, inter // 2),
    }
    for name, (dim, start, stop) in expect.items():
        size = stop - start
        assert reads[0][prefix + name] == [dim, start, stop], name
        assert reads[1][prefix + name] == [dim, start + size, stop + size], name
    for name in ("mlp.experts.down_proj_bias", "mlp.router.weight", "mlp.router.bias",
                 "input_layernorm.weight", "self_attn.o_proj.bias"):
        assert reads[0][prefix + name] == reads[1][prefix + name] == [None, None, None], name
