"""The CPU attention kernels over a quantized KV cache against the model-dtype cache.

    python -m bench.cpu_kv_attention [--dtype float32] [--contexts 512,2048,8192] [--batch 16]

SmolLM2-135M's heads (9 query heads, 3 KV heads, head_dim 64), KV blocks of 16: the fused
decode kernel (`batch` sequences of one query each at the given context) and the fused prefill
kernel (one 256-token chunk after a cached prefix of context - 256) on a cache of the model's
dtype, of fp8 (static per-head scales) and of int8 (scales per position and head). The
variants run interleaved, `--repeat` rounds, and each cell is the best round (a shared machine
slows some rounds, never speeds one up); torch's thread count. A call walks `layers` distinct
caches in turn (enough that the fp32 ones exceed 64 MiB), as a model's layers do, so no
variant is timed out of a cache that a real step would not find warm.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from kernels import cpu_ext, kv_quant

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PREFILL_CHUNK = 256


def make_cache(kv_dtype, model_dtype, num_blocks, gen):
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    rows = torch.randn(shape, generator=gen).view(-1, NUM_KV_HEADS, HEAD_DIM)
    if kv_dtype is None:
        return rows.view(shape).to(model_dtype), None
    static = torch.ones(num_blocks * BLOCK, NUM_KV_HEADS)
    codes, scale = kv_quant.quantize_rows(rows, kv_dtype, static)
    if kv_quant.dynamic_scales(kv_dtype):
        return codes.view(shape), scale.view(shape[:3]).contiguous()
    return codes.view(shape), kv_quant.static_scale_view(torch.ones(NUM_KV_HEADS), num_blocks,
                                                         BLOCK)


def time_calls(calls: list, iters: int) -> float:
    """Seconds per call, each iteration running every call (layer) once."""
    for fn in calls:
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        for fn in calls:
            fn()
    return (time.perf_counter() - start) / (iters * len(calls))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    ops = cpu_ext.load()
    assert ops is not None, "the fused CPU kernels did not build"
    model_dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    variants = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        blocks_per_seq = -(-ctx // BLOCK)
        num_blocks = blocks_per_seq * args.batch
        fp32_bytes = 2 * num_blocks * BLOCK * NUM_KV_HEADS * HEAD_DIM * 4
        layers = max(1, -(-(64 << 20) // fp32_bytes))
        caches = {name: [(make_cache(d, model_dtype, num_blocks, gen),
                          make_cache(d, model_dtype, num_blocks, gen)) for _ in range(layers)]
                  for name, d in variants.items()}
        tables = torch.randperm(num_blocks, generator=gen).int().view(args.batch, blocks_per_seq)
        lens = torch.full((args.batch,), ctx, dtype=torch.int32)
        q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, generator=gen).to(model_dtype)
        out = torch.empty_like(q)
        qp = torch.randn(PREFILL_CHUNK, NUM_HEADS, HEAD_DIM, generator=gen).to(model_dtype)
        outp = torch.empty_like(qp)
        qsl = torch.tensor([0, PREFILL_CHUNK], dtype=torch.int32)
        seq_ids = torch.zeros(1, dtype=torch.int32)
        best = {(name, kind): float("inf") for name in variants for kind in ("decode", "prefill")}
        iters = max(1, 2048 // (ctx * layers))
        for _ in range(args.repeat):
            for name, per_layer in caches.items():
                decodes, prefills = [], []
                for (k, ks), (v, vs) in per_layer:
                    scales = dict(k_scale=ks, v_scale=vs) if ks is not None else {}
                    decodes.append(functools.partial(ops.decode_attention, out, q, k, v, tables,
                                                     lens, 0.125, **scales))
                    prefills.append(functools.partial(ops.prefill_attention, outp, qp, k, v,
                                                      tables[:1], qsl, lens[:1], seq_ids, 0.125,
                                                      **scales))
                best[name, "decode"] = min(best[name, "decode"], time_calls(decodes, iters))
                best[name, "prefill"] = min(best[name, "prefill"], time_calls(prefills, iters))
        for kind in ("decode", "prefill"):
            base = best["auto", kind]
            rows.append((ctx, kind, *(f"{best[n, kind] * 1e3:.3f} ({base / best[n, kind]:.2f}x)"
                                      for n in variants)))
    print(f"fused CPU attention, {args.dtype} q, {torch.get_num_threads()} threads, "
          f"{ops.isa()} build; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"decode: batch {args.batch} x 1 query; prefill: one {PREFILL_CHUNK}-token chunk at "
          "the end of the context. ms per call, best of the rounds (speed-up vs auto)")
    print()
    print("| context | kernel | auto | fp8 | int8 |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


if __name__ == "__main__":
    main()
