"""The one dispatch point: twins on CPU without a Triton launch, Triton where asked.

Each check runs in a fresh interpreter, since the backend choice and TRITON_INTERPRET are read
at import time.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Calls the public kernels on CPU tensors and checks them against the twins.
CALL_ALL = """
import sys, torch
import kernels
from kernels import twins
torch.manual_seed(0)
x = torch.randn(4, 64)
torch.testing.assert_close(kernels.silu_and_mul(x), twins.silu_and_mul(x))
w = torch.randn(64)
torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), twins.rms_norm(x, w, 1e-6))
k_cache = torch.zeros(2, 16, 1, 32); v_cache = torch.zeros(2, 16, 1, 32)
key, value = torch.randn(3, 1, 32), torch.randn(3, 1, 32)
kernels.store_kv(key, value, k_cache, v_cache, torch.tensor([0, 17, 1]))
assert torch.equal(k_cache[1, 1], key[1])
q = torch.randn(3, 2, 32)
q2, key2 = q.clone(), key.clone()
cache = torch.randn(8, 32)
kernels.rotary(torch.tensor([0, 1, 2]), q, key, cache)
twins.rotary(torch.tensor([0, 1, 2]), q2, key2, cache)
torch.testing.assert_close(q, q2)
args = (q, k_cache, v_cache, torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 3, 3, 0.2)
torch.testing.assert_close(kernels.paged_attention(*args), twins.paged_attention(*args))
w13, w2 = torch.randn(4, 32, 64) / 8, torch.randn(4, 64, 16) / 4
topk_weights, topk_ids = torch.softmax(torch.randn(4, 2), -1), torch.tensor([[0, 2], [2, 1], [0, 3], [2, 0]])
torch.testing.assert_close(kernels.fused_moe(x, w13, w2, topk_weights, topk_ids),
                           twins.fused_moe(x, w13, w2, topk_weights, topk_ids))
print("triton" in sys.modules, "kernels.triton_ops" in sys.modules)
"""


def _run(env_overrides: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("FOLIO_KERNELS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", **env_overrides)
    done = subprocess.run([sys.executable, "-c", CALL_ALL], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The script's own line is the last: a first use of the fused CPU kernels may log their
    # build before it (structlog's default output is stdout).
    return done.stdout.strip().splitlines()[-1].split()


def test_cpu_default_uses_twins_without_importing_triton():
    assert _run({}) == ["False", "False"]


def test_forced_triton_runs_interpreted_on_cpu():
    pytest.importorskip("triton")
    assert _run({"FOLIO_KERNELS": "triton", "TRITON_INTERPRET": "1"}) == ["True", "True"]


def test_forced_triton_without_interpreter_fails_clearly():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", FOLIO_KERNELS="triton")
    code = "import torch, kernels; kernels.silu_and_mul(torch.randn(2, 8))"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and "TRITON_INTERPRET=1" in done.stderr
