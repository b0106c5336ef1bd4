"""Whole models at TP = 2 and 4 (gloo, real processes) against TP = 1: the same greedy tokens
and logits through the paged KV cache (a prefill with a chunked prompt, then decode steps), on
every architecture of the harness plus a GQA case with fewer KV heads than ranks and a
vocabulary that does not split evenly; each rank reads only its shard of the checkpoint; the
configurations that cannot be split are refused with the numbers."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints.files import (
    open_safetensors,
    read_weight_headers,
    safetensors_files,
)
from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.kv_scales import default_scales
from executor_svc.loading.loader import (
    effective_max_model_len,
    load_model,
    load_weights,
    plan_weights,
)
from executor_svc.loading.model_config import ModelConfig, check_tensor_parallel, local_kv_heads
from executor_svc.models import model_class
from executor_svc.parallel import distributed
from executor_svc.step.runner import ModelRunner
from tests.executor.harness import ARCHS, BLOCK_SIZE, NUM_BLOCKS, PlanDriver, make_hf_model
from tests.executor.harness import save_checkpoint as save_hf
from tests.executor.models.test_moe import _edit_tensors, _stack_experts
from tests.executor.parallel.tp_procs import run_ranks

PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [42],
           [200, 1, 150, 33, 87, 45, 66, 71, 299, 8, 120, 9, 64, 32, 16, 4, 2, 77, 88]]
CHUNK = 9  # the third prompt's first step: a chunked prefill
NUM_DECODE = 4

# name -> (arch, overrides): every architecture, and GQA with one KV head (replicated on
# every rank) and a vocabulary of 301 (a short, padded last range at TP = 2 and 4).
CASES: dict[str, tuple[str, dict]] = {arch: (arch, {}) for arch in ARCHS}
CASES["gqa_kv1"] = ("llama2", dict(num_key_value_heads=1, vocab_size=301))


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {name: str(save_hf(make_hf_model(arch, **overrides), root / name))
            for name, (arch, overrides) in CASES.items()}


@pytest.fixture(scope="module")
def tp1_results(tp_checkpoints) -> dict[str, dict]:
    """The oracle: every case run with one rank (no group)."""
    return {name: greedy_run(Path(d)) for name, d in tp_checkpoints.items()}


def greedy_run(model_dir: Path, quantization: str | None = None,
               kv_dtype: torch.dtype | None = None) -> dict | None:
    """Prefill (one prompt chunked) and NUM_DECODE greedy decode steps over the paged cache,
    calling the model directly. Rank 0 (or a lone rank): {"tokens": {req_id: ids}, "logits":
    [per step]}; other ranks None. Rank 0's greedy ids reach the others by broadcast.
    `kv_dtype`: a quantized KV cache (fp8 at its default scales, or int8)."""
    cfg = ModelConfig.from_dir(model_dir)
    max_len = effective_max_model_len(cfg, None)
    cpu = torch.device("cpu")
    model = load_model(model_dir, dtype=torch.float32, device=cpu, max_model_len=max_len, cfg=cfg,
                       quantization=quantization)
    scales = (default_scales(cfg, distributed.tp_size()) if kv_dtype == torch.float8_e4m3fn
              else None)
    kv_cache = KVCache.allocate(cfg, NUM_BLOCKS, BLOCK_SIZE, kv_dtype or torch.float32, cpu,
                                scales)
    assert kv_cache.k_caches[0].shape[2] == local_kv_heads(cfg, distributed.tp_size())
    kv_cache.bind(model)
    runner = ModelRunner(model, kv_cache, BLOCK_SIZE, max_len, cfg.vocab_size, cpu)
    driver = PlanDriver(seed=3, num_kv_groups=kv_cache.layout.num_groups)
    req_ids = [f"r{i}" for i in range(len(PROMPTS))]
    tokens: dict[str, list[int]] = {r: [] for r in req_ids}
    step_logits: list[torch.Tensor] = []
    first = [driver.new(r, p, len(p) if r != "r2" else CHUNK)
             for r, p in zip(req_ids, PROMPTS, strict=True)]
    plans = [driver.plan(new_reqs=first)]
    for step in range(NUM_DECODE + 1):
        scheduled = runner.apply(plans[-1])
        inputs = runner.prepare(scheduled)
        with torch.inference_mode():
            logits = model(inputs.input_ids, inputs.positions, inputs.batch)
        ids = torch.empty(len(inputs.sample_rows), dtype=torch.int64)
        if distributed.tp_rank() == 0:
            step_logits.append(logits)
            ids = logits.argmax(dim=-1)
        else:
            assert logits is None, "only rank 0 gets logits"
        distributed.broadcast_tensor(ids)
        # What ModelRunner.execute does after sampling.
        batch = runner.input_batch
        batch.num_computed[scheduled.rows] += scheduled.query_lens
        batch.append_sampled_tokens(inputs.sample_rows, ids.numpy())
        sampled = [(batch.req_ids[r], [int(t)])
                   for r, t in zip(inputs.sample_rows, ids.tolist(), strict=True)]
        driver.record(sampled)
        for req_id, new_ids in sampled:
            tokens[req_id].extend(new_ids)
        cached = driver.decode_all(["r0", "r1"])
        cached.append(driver.cached("r2", len(PROMPTS[2]) - CHUNK) if step == 0
                      else driver.decode_all(["r2"])[0])
        plans.append(driver.plan(cached_reqs=cached))
    if distributed.tp_rank() != 0:
        return None
    return {"tokens": tokens, "logits": step_logits}


def _model_rank(rank: int, checkpoints: dict[str, str], out_dir: str) -> None:
    for name, model_dir in checkpoints.items():
        result = greedy_run(Path(model_dir))
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{name}.pt")


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_matches_tp1(tp, tp_checkpoints, tp1_results, tmp_path):
    # Every case's heads divide 4 (4 q heads; 4, 2 or 1 KV heads), so all run at both sizes.
    run_ranks(_model_rank, tp, tp_checkpoints, str(tmp_path))
    for name, expected in tp1_results.items():
        got = torch.load(tmp_path / f"{name}.pt")
        assert got["tokens"] == expected["tokens"], name
        assert len(got["tokens"]["r2"]) == NUM_DECODE  # the chunked prompt sampled from step 1
        for step, (a, b) in enumerate(zip(got["logits"], expected["logits"], strict=True)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")


KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
KV_CASES = ("llama2", "gqa_kv1")  # KV heads split over the ranks, and one replicated


def _kv_rank(rank: int, checkpoints: dict[str, str], kv_name: str, out_dir: str) -> None:
    for name in KV_CASES:
        result = greedy_run(Path(checkpoints[name]), kv_dtype=KV_DTYPES[kv_name])
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{name}.pt")


@pytest.mark.parametrize("kv_name", KV_DTYPES)
def test_tp2_over_a_quantized_kv_cache_matches_tp1(kv_name, tp_checkpoints, tmp_path):
    """Each rank quantizes its own KV heads' rows (int8: a scale per position and head) with
    the same values one rank would: the same tokens and logits."""
    run_ranks(_kv_rank, 2, tp_checkpoints, kv_name, str(tmp_path))
    for name in KV_CASES:
        expected = greedy_run(Path(tp_checkpoints[name]), kv_dtype=KV_DTYPES[kv_name])
        got = torch.load(tmp_path / f"{name}.pt")
        assert got["tokens"] == expected["tokens"], name
        for step, (a, b) in enumerate(zip(got["logits"], expected["logits"], strict=True)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")


class _RecordingSlice:
    def __init__(self, inner, name: str, reads: list):
        self.inner, self.name, self.reads = inner, name, reads

    def __getitem__(self, index: tuple):
        (dim, part), = [(d, s) for d, s in enumerate(index) if s != slice(None)]
        self.reads.append([self.name, dim, part.start, part.stop])
        return self.inner[index]


class _RecordingFile:
    """safetensors' file handle, recording what is read of each tensor."""

    def __init__(self, inner, reads: list):
        self.inner, self.reads = inner, reads

    def get_tensor(self, name: str):
        self.reads.append([name, None, None, None])
        return self.inner.get_tensor(name)

    def get_slice(self, name: str):
        return _RecordingSlice(self.inner.get_slice(name), name, self.reads)


def _reads_rank(rank: int, checkpoints: dict[str, str], out_dir: str) -> None:
    for name, model_dir in checkpoints.items():
        cfg = ModelConfig.from_dir(Path(model_dir))
        reads: list = []

        @contextlib.contextmanager
        def recording_open(file, framework="np", reads=reads):
            with open_safetensors(file, framework) as f:
                yield _RecordingFile(f, reads)

        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg, dtype=torch.float32, max_model_len=64,
                                                  backend=None)
        headers = read_weight_headers(safetensors_files(Path(model_dir)))
        placements = plan_weights(model, headers, cfg.tie_word_embeddings)
        model.to_empty(device="cpu")
        load_weights(model, placements, open_file=recording_open)
        (Path(out_dir) / f"{name}.{rank}.json").write_text(json.dumps(reads))


def test_each_rank_reads_only_its_shard(tp_checkpoints, tmp_path):
    tp = 2
    # untied head; biases; q/k norms; kv < tp; q|k|v and gate|up stored fused (one slice per
    # part and rank)
    # part and rank); experts: one slice of every expert's tensor per rank, per-expert
    # (Qwen and Mixtral names) or stacked 3-D (two parts, gate and up, in gate_up_proj)
    names = ["llama2", "qwen2", "qwen3", "gqa_kv1", "phi3", "qwen2_moe", "mixtral",
             "qwen3_moe_stacked"]
    checkpoints = {n: tp_checkpoints[n] for n in names[:-1]}
    stacked = shutil.copytree(tp_checkpoints["qwen3_moe"], tmp_path / "qwen3_moe_stacked")
    _edit_tensors(stacked, _stack_experts)
    checkpoints["qwen3_moe_stacked"] = str(stacked)
    run_ranks(_reads_rank, tp, checkpoints, str(tmp_path))
    for name in names:
        model_dir = Path(checkpoints[name])
        cfg = ModelConfig.from_dir(model_dir)
        reads = [json.loads((tmp_path / f"{name}.{r}.json").read_text()) for r in range(tp)]
        for header in read_weight_headers(safetensors_files(model_dir)):
            per_rank = [[r[1:] for r in rank_reads if r[0] == header.name]
                        for rank_reads in reads]
            if header.name.endswith(("norm.weight", ".gate.weight", "shared_expert_gate.weight")):
                # replicated (norms, routers): read whole by every rank
                assert all(r == [[None, None, None]] for r in per_rank), (name, header.name)
                continue
            # Sharded: one slice per rank (per part of a tensor holding fused parts), never
            # the whole tensor; together the slices cover the tensor once, except KV heads
            # replicated on tp / num_kv_heads ranks.
            parts = 3 if ".qkv_proj." in header.name else 2 if ".gate_up_proj" in header.name \
                else 1
            assert all(len(r) == parts and all(s[0] is not None for s in r)
                       for r in per_rank), (name, header)
            dim = per_rank[0][0][0]
            counts = np.zeros(header.shape[dim], np.int64)
            for rank_reads in per_rank:
                for _, start, stop in rank_reads:
                    counts[start:stop] += 1
            kv = (".k_proj." in header.name or ".v_proj." in header.name)
            copies = tp // cfg.num_kv_heads if kv and cfg.num_kv_heads < tp else 1
            assert (counts == copies).all(), (name, header.name, counts)


def _refusal_rank(rank: int, model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide "
                                         r"intermediate_size 129 \(129 % 2 = 1\)"):
        load_model(Path(model_dir), dtype=torch.float32, device=torch.device("cpu"),
                   max_model_len=64)


def test_unsplittable_model_is_refused_in_the_group(tp_checkpoints, tmp_path):
    model_dir = tmp_path / "odd"
    shutil.copytree(tp_checkpoints["llama2"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 129}))
    run_ranks(_refusal_rank, 2, str(model_dir))


@pytest.mark.parametrize("overrides, tp, message", [
    (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), 4,
     r"--tensor-parallel-size 4 does not divide num_attention_heads 6 \(6 % 4 = 2\)"),
    (dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=48), 4,
     r"--tensor-parallel-size 4: num_key_value_heads 3 is neither a multiple of 4 nor a "
     r"divisor of it"),
    (dict(intermediate_size=130), 4,
     r"--tensor-parallel-size 4 does not divide intermediate_size 130 \(130 % 4 = 2\)"),
])
def test_refusals_name_the_flag_and_numbers(overrides, tp, message):
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    cfg = ModelConfig.from_dict({**base, **overrides})
    check_tensor_parallel(cfg, 1)  # one rank takes anything
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(cfg, tp)


@pytest.mark.parametrize("num_kv_heads, tp, expected", [(8, 2, 4), (2, 2, 1), (2, 4, 1),
                                                        (1, 4, 1), (4, 1, 4)])
def test_local_kv_heads(num_kv_heads, tp, expected):
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=10,
                                     hidden_size=64, intermediate_size=8,
                                     num_hidden_layers=1, num_attention_heads=8,
                                     num_key_value_heads=num_kv_heads))
    check_tensor_parallel(cfg, tp)
    assert local_kv_heads(cfg, tp) == expected
