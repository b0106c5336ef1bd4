"""Quantized-linear benchmark: the weight-only kernels against a 16-bit torch matmul on a GPU.

    python -m bench.quant_kernels --out DIR [--dtype bfloat16] [--smoke] [--sweep]

At Llama-3.1-8B's linear shapes (o_proj 4096x4096, up 14336x4096, down 4096x14336) and 1, 16
and 128 rows: F.linear on 16-bit weights, w8a16_linear (int8 and e4m3 per channel) and
group_quant_linear (4-bit g128 with offsets, the same in act order, 8-bit g32). Each kernel is
checked against its fp32 twin on the same quantized weights before it is timed. Reports
microseconds, bytes moved (weights, scales, activations in and out) per microsecond next to the
measured copy bandwidth, and the speedup over the 16-bit matmul. Writes DIR/quant-kernels.json and
.md with the commit, device, versions and command. `--smoke` runs tiny shapes on any device.
`--sweep` first times a grid of decode launch configurations (tile sizes, pipeline stages,
split-K waves) at one row and writes the fastest per case to DIR/quant-sweep.json: the data the
launchers' decode heuristics are set from.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from bench.kernels import environment, measure_limits, time_ms
from executor_svc.quantization.grouped import GroupedWeight, pack_int4
from kernels import twins

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K)
SMOKE_SHAPES = ((96, 64), (64, 160))
ROWS = (1, 16, 128)
VARIANTS = ("int8", "e4m3", "g4-128", "g4-128-act", "g8-32")


def _weights(variant: str, n: int, k: int, gen: torch.Generator):
    """(kernel args without x and bias, weight-side bytes)."""
    if variant in ("int8", "e4m3"):
        w = torch.randn(n, k, generator=gen)
        top = 127.0 if variant == "int8" else torch.finfo(torch.float8_e4m3fn).max
        scale = w.abs().amax(dim=1) / top
        q = w / scale[:, None]
        q = q.round().to(torch.int8) if variant == "int8" else q.to(torch.float8_e4m3fn)
        return (q, scale), q.numel() + scale.numel() * 4
    bits, group = (4, 128) if variant.startswith("g4") else (8, 32)
    groups = -(-k // group)
    g_idx = None
    if variant.endswith("act"):
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // group).to(torch.int32)
    lo, hi, qdtype = (0, 16, torch.uint8) if bits == 4 else (-128, 128, torch.int8)
    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=qdtype)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    offsets = torch.randn(n, groups, generator=gen) * 0.1 if bits == 4 else None
    gw = GroupedWeight(q, scales, offsets, group, g_idx)
    qweight = pack_int4(gw.q) if bits == 4 else gw.q
    side = qweight.numel() + scales.numel() * 4 * (2 if offsets is not None else 1)
    return (qweight, scales, offsets, g_idx, group), side + (k * 4 if g_idx is not None else 0)


def _call(variant: str, x, weight_args, config=None):
    if config is not None:  # the Triton launchers themselves (kernels.* takes no config)
        from kernels import triton_ops

        if variant in ("int8", "e4m3"):
            return triton_ops.w8a16_linear(x, *weight_args, None, config=config)
        return triton_ops.group_quant_linear(x, *weight_args, None, config=config)
    if variant in ("int8", "e4m3"):
        return kernels.w8a16_linear(x, *weight_args, None)
    return kernels.group_quant_linear(x, *weight_args, None)


def _twin(variant: str, x, weight_args):
    if variant in ("int8", "e4m3"):
        return twins.w8a16_linear(x, *weight_args, None)
    return twins.group_quant_linear(x, *weight_args, None)


def case(n: int, k: int, device, dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(n * 7 + k)
    dense = torch.randn(n, k, generator=gen).to(device, dtype)
    rows_out = []
    for variant in VARIANTS:
        host_args, weight_bytes = _weights(variant, n, k, gen)
        dev_args = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in host_args)
        for rows in ROWS:
            x_host = torch.randn(rows, k, generator=gen)
            x = x_host.to(device, dtype)
            want = _twin(variant, x_host, host_args)
            got = _call(variant, x, dev_args).float().cpu()
            scale = want.abs().max().clamp(min=1.0)
            err = ((got - want).abs().max() / scale).item()
            ours_us = time_ms(lambda v=variant, x=x, a=dev_args: _call(v, x, a), device) * 1e3
            dense_us = time_ms(lambda x=x: F.linear(x, dense), device) * 1e3
            moved = weight_bytes + rows * (k + n) * x.element_size()
            rows_out.append({"n": n, "k": k, "rows": rows, "variant": variant, "us": ours_us,
                             "dense_us": dense_us, "speedup": dense_us / ours_us,
                             "gbps": moved / ours_us / 1e3,
                             "dense_gbps": (n * k + rows * (k + n)) * x.element_size()
                             / dense_us / 1e3,
                             "max_rel_err": err})  # fmt: skip
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def _sweep_configs(variant: str):
    """Candidate decode configurations (whole-group tiles where the group allows)."""
    group = {"g4-128": 128, "g8-32": 32}.get(variant)
    for bn in (32, 64, 128):
        for bk in (32, 64, 128, 256):
            tile = group is None or group % bk == 0
            if (group is None and bk == 32) or (variant == "g4-128" and not tile):
                continue
            for stages in (2, 4):
                for waves in (4, 8):
                    config = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
                                  num_stages=stages, WAVES=waves)
                    if group is not None:
                        config["TILE_GROUPS"] = tile
                    yield config
    for bn in (16, 32, 64):  # the GEMV kernel (kernels/quant_gemv.py)
        for bk in (64, 128, 256, 512):
            if group is not None and group % bk:
                continue
            for stages in (2, 4):
                for waves in (4, 8):
                    yield dict(BLOCK_N=bn, BLOCK_K=bk, GEMV=True, num_warps=4,
                               num_stages=stages, WAVES=waves)


def sweep(device, dtype, shapes, budget_s: float) -> list[dict]:
    """The fastest decode configuration per (variant, shape), within budget_s seconds."""
    def quick_ms(fn) -> float:
        if device.type != "cuda":
            return time_ms(fn, device)
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=25, return_mode="median")

    deadline = time.monotonic() + budget_s
    best = []
    for n, k in shapes:
        gen = torch.Generator().manual_seed(n + k)
        x = torch.randn(1, k, generator=gen).to(device, dtype)
        for variant in ("int8", "g4-128", "g8-32"):
            host_args, _ = _weights(variant, n, k, gen)
            dev_args = tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                             for t in host_args)  # fmt: skip
            want = _twin(variant, x.float().cpu(), host_args)
            rows = []
            for config in _sweep_configs(variant):
                if time.monotonic() > deadline:
                    break

                def fn(c=config, a=dev_args, v=variant, x=x):
                    return _call(v, x, a, c)

                try:
                    got = fn().float().cpu()
                    us = quick_ms(fn) * 1e3
                except Exception as exc:  # a tile that does not fit the device: skipped
                    print("sweep skips", config, type(exc).__name__, str(exc)[:120], flush=True)
                    continue
                rows.append((us, ((got - want).abs().max() / want.abs().max()).item(), config))
            if rows:
                us, err, config = min(rows, key=lambda r: r[0])
                default_us = time_ms(lambda a=dev_args, v=variant, x=x: _call(v, x, a), device) * 1e3
                best.append({"n": n, "k": k, "variant": variant, "us": us, "max_rel_err": err,
                             "config": config, "default_us": default_us, "tried": len(rows),
                             "top5": [(r[0], r[2]) for r in sorted(rows, key=lambda r: r[0])[:5]]})  # fmt: skip
                print("sweep", json.dumps(best[-1]), flush=True)
    return best


def markdown(result: dict) -> str:
    env, copy = result["environment"], result["limits"]["copy_gbps"]
    lines = [f"# Quantized linears on {env['device']} ({result['dtype']} activations)", "",
             f"commit {env['commit']} · torch {env['torch']} · triton {env['triton']} · "
             f"`{env.get('command', '')}`", "",
             f"Measured copy bandwidth {copy:.0f} GB/s. GB/s = (weights + scales + activations "
             "in and out) / time; speedup = 16-bit F.linear time / kernel time.", "",
             "| N x K | rows | kernel | us | GB/s | of copy | 16-bit us | speedup | max rel err |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["cases"]:
        lines.append(f"| {r['n']}x{r['k']} | {r['rows']} | {r['variant']} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {r['gbps'] / copy:.0%} | {r['dense_us']:.1f} | "
                     f"{r['speedup']:.2f} | {r['max_rel_err']:.1e} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_kernels",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--sweep", type=float, default=0.0, metavar="SECONDS",
                        help="first sweep decode launch configurations for at most SECONDS")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("bench.quant_kernels needs a CUDA device; --smoke checks the plumbing on CPU.",
              file=sys.stderr)  # fmt: skip
        return 2
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    limits = measure_limits(device, dtype, args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        found = sweep(device, dtype, SMOKE_SHAPES if args.smoke else SHAPES, args.sweep)
        (args.out / "quant-sweep.json").write_text(json.dumps(found, indent=1) + "\n")
    cases = []
    for n, k in SMOKE_SHAPES if args.smoke else SHAPES:
        cases += case(n, k, device, dtype)
    result = {"environment": environment(device), "dtype": str(dtype).split(".")[-1],
              "limits": limits, "cases": cases}  # fmt: skip
    result["environment"]["command"] = " ".join(["python -m bench.quant_kernels",
                                                 *(argv or sys.argv[1:])])  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant-kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "quant-kernels.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
