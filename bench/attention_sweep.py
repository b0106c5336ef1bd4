"""Sweep the decode launch's tile shape, stages, warps and split target (CUDA only).

    BS=16 BUDGET=230 OUT=DIR python -m bench.attention_sweep

Patches kernels.attention's launch_config (the short launch's BLOCK_N, NUM_STAGES, num_warps)
and pick_max_splits (resident warps per SM it splits to fill), times paged_attention on Llama-3-8B's heads (32 q, 8 KV,
head_dim 128, bf16, KV block size $BS) at batch x context 1x16k, 16x4k, 16x16k, 64x4k, 64x16k
with triton.testing.do_bench (median), checks each output against the default config's, and
writes one JSON row per config (GB/s of K/V read) to $OUT/sweep.json, until $BUDGET seconds.
"""
import itertools
import json
import os
import time

import torch
import triton
from triton.testing import do_bench

import kernels.attention as A

orig_cfg, orig_splits = A.launch_config, A.pick_max_splits
OVR = {}
SPLIT_MULT = [32]
def cfg(dtype, h, hkv, d, long):
    c = orig_cfg(dtype, h, hkv, d, long)
    if not long:
        c.update(OVR)
    return c
def splits(num_warps, device):
    target = SPLIT_MULT[0] * A._num_sms(device)
    return 1 if num_warps >= target else min(triton.cdiv(target, num_warps), A.MAX_SPLITS)
A.launch_config, A.pick_max_splits = cfg, splits
dev = torch.device("cuda")
dt = torch.bfloat16
H, HKV, D, BS = 32, 8, 128, int(os.environ.get("BS", "16"))
cases = {}
for b, ctx in [(1, 16384), (16, 4096), (16, 16384), (64, 4096), (64, 16384)]:
    nb = b * (-(-ctx // BS))
    bt = torch.randperm(nb, device=dev).view(b, -1).int()
    cache = torch.randn(2, nb, BS, HKV, D, device=dev, dtype=dt)
    q = torch.randn(b, H, D, device=dev, dtype=dt)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    cases[(b, ctx)] = (q, cache[0], cache[1], bt, sl, qsl, 1, ctx, D ** -0.5)
ref = {k: A.paged_attention(*v).clone() for k, v in cases.items()}
results = []
grid = list(itertools.product([16, 32, 64], [4, 3, 6], [1, 2, 4], [32, 16, 64]))
t0 = time.time()
for bn, st, nw, sm in grid:
    if time.time() - t0 > float(os.environ.get("BUDGET", "200")):
        break
    OVR.clear()
    OVR.update(BLOCK_N=bn, NUM_STAGES=st, num_warps=nw)
    SPLIT_MULT[0] = sm
    row = {"BLOCK_N": bn, "NUM_STAGES": st, "num_warps": nw, "warps_per_sm": sm}
    try:
        for (b, ctx), args in cases.items():
            out = A.paged_attention(*args)
            err = (out.float() - ref[(b, ctx)].float()).abs().max().item()
            ms = do_bench(lambda a=args: A.paged_attention(*a), warmup=10, rep=40,
                          return_mode="median")
            gbps = (2 * b * ctx * HKV * D * 2) / ms / 1e6
            row[f"{b}x{ctx}"] = round(gbps)
            row["max_err"] = max(row.get("max_err", 0), err)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    results.append(row)
    print(json.dumps(row), flush=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w"), indent=1)
