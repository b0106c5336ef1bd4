"""Our models through the Triton launchers (the GPU path), here in Triton's interpreter.

`kernels` reads FOLIO_KERNELS and the interpreter needs TRITON_INTERPRET before its first
launch, so this runs in a fresh process. On a CUDA machine the default path is Triton already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, sys
from pathlib import Path
import kernels
from tests.executor.harness import PlanDriver, hf_greedy, make_hf_model, make_runner, save_checkpoint

# Phi-4-mini's shape: RoPE on the first 24 of each head's 32 dimensions (views into qkv).
PHI4_MINI = dict(hidden_size=128, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "short_factor": [1.0 + 0.05 * i for i in range(12)],
    "long_factor": [1.0 + 0.6 * i for i in range(12)]})
result = {}
# qwen2_moe: kernels.fused_moe's Triton kernel (SwiGLU) and a shared expert; gpt_oss: its
# biases and clamped SwiGLU, and attention sinks and sliding windows in the Triton attention.
for name, arch, overrides in (("qwen3", "qwen3", {}), ("llama3", "llama3", {}),
                              ("phi4_mini", "phi3", PHI4_MINI), ("qwen2_moe", "qwen2_moe", {}),
                              ("gpt_oss", "gpt_oss", {})):
    hf = make_hf_model(arch, **overrides)
    runner = make_runner(save_checkpoint(hf, Path(sys.argv[1]) / name))
    driver = PlanDriver(seed=4, num_kv_groups=runner.kv_cache.layout.num_groups)
    prompts = {"a": [5, 6, 7, 8, 9, 10, 11, 12, 13], "b": [1, 2, 3]}
    got = {r: [] for r in prompts}
    plans = [lambda: driver.plan(new_reqs=[driver.new("a", prompts["a"], 5),
                                           driver.new("b", prompts["b"], 3)]),
             lambda: driver.plan(cached_reqs=[driver.cached("a", 4)] + driver.decode_all(["b"]))]
    plans += [lambda: driver.plan(cached_reqs=driver.decode_all(["a", "b"]))] * 3
    for make_plan in plans:
        out = runner.execute(make_plan())
        driver.record(out.sampled)
        for r, ids in out.sampled:
            got[r].extend(ids)
    result[name] = {r: [got[r][:3], hf_greedy(hf, p, 3)] for r, p in prompts.items()}
print(json.dumps(result))
"""


def test_models_through_triton_launchers_match_hf(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "FOLIO_KERNELS": "triton", "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"qwen3", "llama3", "phi4_mini", "qwen2_moe", "gpt_oss"}
    for arch, reqs in result.items():
        for req_id, (ours, hf) in reqs.items():
            assert len(ours) == 3 and ours == hf, (arch, req_id)
