"""The CPU backend's executor side: thread budget, linear methods, the per-step attention plan,
and whole models on the CPU backend against the twins (the oracle path, FOLIO_KERNELS=torch
semantics: plain F.linear and kernels/twins.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from executor_svc.cli import build_parser, config_from_args
from executor_svc.cpu_threads import default_cpu_threads
from executor_svc.models.linear import (
    DENSE,
    Linear,
    PackedCpuLinear,
    TiedHead,
    UpcastCpuLinear,
    cpu_linear_method,
    use_linear_method,
)
from kernels import cpu, twins
from tests.executor.harness import PlanDriver, make_runner

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [42]]


@pytest.mark.parametrize("cores", [1, 2, 4, 16])
def test_default_threads_use_every_core(cores):
    assert default_cpu_threads(cores) == cores


def test_cpu_threads_flag():
    assert config_from_args(build_parser().parse_args(["--cpu-threads", "3"])).cpu_threads == 3
    assert config_from_args(build_parser().parse_args([])).cpu_threads is None
    with pytest.raises(ValueError, match="--cpu-threads"):
        config_from_args(build_parser().parse_args(["--cpu-threads", "0"]))


def test_apply_cpu_threads_sets_torch_before_first_op():
    code = ("from executor_svc.cpu_threads import apply_cpu_threads\n"
            "apply_cpu_threads(1)\n"
            "import torch\n"
            "import os\n"
            "print(torch.get_num_threads(), torch.get_num_interop_threads(),\n"
            "      os.environ['GOMP_SPINCOUNT'])\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    # After the log line: one intra-op and one inter-op thread, a short spin before sleeping.
    assert done.stdout.splitlines()[-1].split() == ["1", "1", "3000"]


def _layer(out_features: int, in_features: int, dtype: torch.dtype, bias: bool) -> Linear:
    layer = Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if bias:
            layer.bias.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("rows", [1, 2, 16, 128, 300, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp32_linear_matches_f_linear(rows, bias):
    layer = _layer(200, 96, torch.float32, bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    use_linear_method(layer, PackedCpuLinear())
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 16, 128, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_of_this_cpu_matches_f_linear(rows, bias):
    # With AVX512-BF16/AMX (not forced lower by ATEN_CPU_CAPABILITY) the packed forms, as in
    # fp32; without, fp32 products on the bf16 weight, which stays.
    layer = _layer(200, 96, torch.bfloat16, bias)
    x = torch.randn(rows, 96).bfloat16()
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float() if bias else None)
    native = cpu.has_native_bf16()
    method = cpu_linear_method(torch.bfloat16, native)
    assert isinstance(method, PackedCpuLinear if native else UpcastCpuLinear)
    use_linear_method(layer, method)
    assert layer.weight.numel() == (0 if native else 200 * 96)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_bf16_without_native_support_upcasts():
    assert isinstance(cpu_linear_method(torch.bfloat16, native_bf16=False), UpcastCpuLinear)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_bf16_linear_is_fp32_math_on_bf16_weights(rows, bias):
    # A small chunk so the product is assembled from several slices of weight rows.
    layer = _layer(300, 64, torch.bfloat16, bias)
    x = torch.randn(rows, 64).bfloat16()
    use_linear_method(layer, UpcastCpuLinear(chunk_elems=64 * 70))
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
    bias_fp32 = layer.bias.float() if bias else None
    expected = F.linear(x.float(), layer.weight.float(), bias_fp32)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_tied_head_shares_the_embedding_and_gets_the_method(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama3")  # tied embeddings
    runner = make_runner(model_dir)
    model = runner.model
    assert isinstance(model.lm_head, TiedHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # The loader gave every linear layer, the tied head included, the CPU fp32 method.
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, PackedCpuLinear) for m in linears)
    assert isinstance(model.lm_head.method, PackedCpuLinear)
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names)) and not any(n.startswith("lm_head") for n in names)
    # Packed forms replace the plain weights, except the embedding the head shares.
    assert all(m.weight.numel() == 0 for m in linears)
    assert model.model.embed_tokens.weight.numel() > 0


def test_attention_plan_is_built_once_per_step(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir)
    driver = PlanDriver(seed=4)
    plan = driver.plan(new_reqs=[driver.new(f"r{i}", p, len(p)) for i, p in enumerate(PROMPTS)])
    inputs = runner.prepare(runner.apply(plan))
    input_ids, positions, batch = inputs.input_ids, inputs.positions, inputs.batch
    with mock.patch.object(cpu, "plan_attention", wraps=cpu.plan_attention) as plan:
        with torch.inference_mode():
            runner.model(input_ids, positions, batch)
            runner.model(input_ids, positions, dataclasses.replace(batch))  # a new step
    assert plan.call_count == 2  # one per step, not one per layer


@pytest.mark.parametrize("arch", ["llama2", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_model_matches_twins_path(arch, dtype, checkpoint_cache):
    """Prefills (one chunked), then mixed steps of decodes and a chunk, on the CPU backend
    against the same model with plain linears and the twin kernels: every row's logits."""
    _, model_dir = checkpoint_cache(arch)
    # Both keep their plain weights: each is converted, then given its linear method here.
    fast, oracle = (make_runner(model_dir, keep_plain_weights=True) for _ in range(2))
    for runner in (fast, oracle):
        runner.model.to(dtype)
        for cache in (*runner.kv_cache.k_caches, *runner.kv_cache.v_caches):
            cache.data = cache.data.to(dtype)
        runner.model.bind_kv_cache(runner.kv_cache.per_layer())
    use_linear_method(oracle.model, DENSE)
    use_linear_method(fast.model, cpu_linear_method(dtype, cpu.has_native_bf16()))
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    driver = PlanDriver(seed=5)
    first = [driver.new(f"r{i}", p, len(p)) for i, p in enumerate(PROMPTS[:2])]
    first.append(driver.new("r2", PROMPTS[2] * 9, 5))  # a chunked prefill
    plans = [driver.plan(new_reqs=first)]
    for step in range(3):
        logits = [_forward(fast, plans[-1], oracle=False), _forward(oracle, plans[-1], True)]
        torch.testing.assert_close(logits[0], logits[1], atol=tol, rtol=tol)
        # The same next token for both (the scheduler's role here: no sampling involved).
        for runner in (fast, oracle):
            for req_id in ("r0", "r1"):
                runner.input_batch.append_tokens(runner.input_batch.row_of[req_id], [7 + step])
        driver.record([("r0", [7 + step]), ("r1", [7 + step])])
        cached = driver.decode_all(["r0", "r1"])
        if step == 0:
            cached.append(driver.cached("r2", 4))
        plans.append(driver.plan(cached_reqs=cached))


def _forward(runner, plan, oracle: bool) -> torch.Tensor:
    """All token rows' logits for `plan`; oracle: the twins and the generic attention path."""
    scheduled = runner.apply(plan)
    inputs = runner.prepare(scheduled)
    input_ids, positions, batch = inputs.input_ids, inputs.positions, inputs.batch
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    with contextlib.ExitStack() as stack:
        if oracle:
            stack.enter_context(mock.patch("kernels._impl", lambda x: twins))
            stack.enter_context(mock.patch("executor_svc.step.attention.cpu_backend_active",
                                           lambda x: False))
        with torch.inference_mode():
            logits = runner.model(input_ids, positions, batch)  # [num_tokens, vocab]
    runner.input_batch.num_computed[scheduled.rows] += scheduled.query_lens
    return logits


def test_packing_releases_the_plain_weight_once():
    layer = _layer(64, 32, torch.float32, bias=True)
    use_linear_method(layer, PackedCpuLinear())
    assert layer.weight.numel() == 0 and layer.packed_weight is not None
    with pytest.raises(ValueError, match="already released"):
        use_linear_method(layer, PackedCpuLinear())


@pytest.mark.parametrize("keep", [True, False])
def test_malloc_reuses_freed_memory_instead_of_faulting_fresh_pages(keep):
    """Large tensors allocated and freed over and over (a step's activations): with
    keep_freed_memory they land on pages already faulted in once the heap has grown (next to
    no new page faults); glibc's default maps and faults in fresh ones every time."""
    code = ("import resource, torch\n"
            "from executor_svc.host_memory import keep_freed_memory\n"
            f"assert keep_freed_memory() if {keep} else True\n"
            "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(4):\n"  # the heap grows to the working set
            "    torch.ones(20_000_000)\n"  # 80 MB, freed at once
            "before = faults()\n"
            "for _ in range(6):\n"
            "    torch.ones(20_000_000)\n"
            "print(faults() - before)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    faults = int(done.stdout.splitlines()[-1])
    pages = 80_000_000 // 4096  # of one tensor
    assert faults < pages // 2 if keep else faults > 3 * pages



def test_freed_memory_below_live_tensors_goes_back_to_the_os():
    """With keep_freed_memory, a large tensor freed below one still alive (plain weights
    replaced by packed ones at load) stays resident until return_freed_memory hands it back."""
    code = ("import torch\n"
            "from executor_svc.host_memory import keep_freed_memory, return_freed_memory\n"
            "assert keep_freed_memory()\n"
            "anon = lambda: next(int(line.split()[1]) for line in open('/proc/self/status')\n"
            "                    if line.startswith('RssAnon')) * 1024\n"
            "plain = torch.ones(50_000_000)\n"  # 200 MB, low in the heap
            "packed = torch.ones(50_000_000)\n"  # above it, alive
            "del plain\n"
            "held = anon()\n"
            "assert return_freed_memory()\n"
            "print(held - anon())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.splitlines()[-1]) > 150_000_000  # most of the 200 MB returned


# ---- --dtype auto ---------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint, native, expected", [
    ("float32", True, torch.float32),  # never narrower than the checkpoint
    (None, True, torch.float32),
    ("bfloat16", True, torch.bfloat16),
    ("float16", True, torch.bfloat16),
    ("bfloat16", False, torch.float32),  # emulated bf16 is slower than fp32
    ("float16", False, torch.float32),
])
def test_auto_dtype_on_a_cpu_follows_the_checkpoint_and_native_bf16(checkpoint, native, expected):
    from executor_svc.worker import resolve_dtype

    with mock.patch("kernels.cpu.runtime.has_native_bf16", return_value=native):
        dtype, why = resolve_dtype("auto", torch.device("cpu"), checkpoint)
    assert dtype == expected
    assert why.startswith("auto: ") and (checkpoint or "states no dtype") in why
    if checkpoint in ("bfloat16", "float16"):
        assert ("natively" in why) == native and ("no native" in why) == (not native)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_taken_as_given(name):
    from executor_svc.worker import resolve_dtype

    with mock.patch("kernels.cpu.runtime.has_native_bf16", return_value=False):
        assert resolve_dtype(name, torch.device("cpu"), "bfloat16") == (getattr(torch, name),
                                                                         f"--dtype {name}")
