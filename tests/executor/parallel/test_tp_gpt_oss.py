"""gpt-oss at TP = 2 against TP = 1 (gloo, real processes): the same greedy tokens and logits
(a chunked prefill then decode steps, test_tp_model.py's `greedy_run`), and each rank reads
only its slices: its heads' sinks, its range of the interleaved gate/up columns (gate and up
alike) and of down's rows; the down bias, the router and the norms whole (the down bias is
added by rank 0 alone). test_tp_model.py also runs it among every harness architecture.

MXFP4 experts (tests/fixtures/mxfp4_checkpoints.py) with intermediate_size 96, three blocks of
32: TP = 2 and 4 equal TP = 1, and each rank reads the rows of its gate/up range in the
blocks and scales, and of down the blocks that hold its range, a block two ranks share read by
both (TP 2: 48 each, blocks [0, 2) and [1, 3))."""

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
from tests.fixtures.mxfp4_checkpoints import write_mxfp4_experts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(save_hf(make_hf_model("gpt_oss"), tmp_path_factory.mktemp("tp") / "gpt_oss"))


MXFP4_INTER = 96  # three MXFP4 blocks: TP 2 and 4 split one


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory) -> str:
    model = make_hf_model("gpt_oss", intermediate_size=MXFP4_INTER)
    return str(write_mxfp4_experts(save_hf(model, tmp_path_factory.mktemp("tp") / "mxfp4")))


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


@pytest.mark.parametrize("tp", [2, 4])
def test_mxfp4_tp_greedy_matches_tp1(mxfp4_checkpoint, tp, tmp_path):
    expected = greedy_run(Path(mxfp4_checkpoint))
    run_ranks(_model_rank, tp, {"mxfp4": mxfp4_checkpoint}, str(tmp_path))
    got = torch.load(tmp_path / "mxfp4.pt")
    assert got["tokens"] == expected["tokens"]
    for step, (a, b) in enumerate(zip(got["logits"], expected["logits"], strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, s=step: f"step {s}: {m}")


def test_mxfp4_each_rank_reads_its_rows_and_covering_blocks(mxfp4_checkpoint, tmp_path):
    run_ranks(_reads_rank, 2, mxfp4_checkpoint, str(tmp_path))
    reads = [{r[0]: r[1:] for r in json.loads((tmp_path / f"{rank}.json").read_text())}
             for rank in range(2)]
    prefix = "model.layers.1.mlp.experts."
    inter = MXFP4_INTER
    expect = {  # tensor -> (rank 0's [dim, start, stop], rank 1's)
        "gate_up_proj_blocks": ([1, 0, inter], [1, inter, 2 * inter]),  # interleaved rows
        "gate_up_proj_scales": ([1, 0, inter], [1, inter, 2 * inter]),
        "gate_up_proj_bias": ([1, 0, inter], [1, inter, 2 * inter]),
        "down_proj_blocks": ([2, 0, 2], [2, 1, 3]),  # elements [0, 48) and [48, 96)
        "down_proj_scales": ([2, 0, 2], [2, 1, 3]),
        "down_proj_bias": ([None, None, None], [None, None, None]),
    }
    for name, (rank0, rank1) in expect.items():
        assert reads[0][prefix + name] == rank0, name
        assert reads[1][prefix + name] == rank1, name
    assert not any(name.endswith(("gate_up_proj", "down_proj")) for name in reads[0])
