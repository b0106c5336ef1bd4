"""The quantized skinny linears on the CPU against fp32 and the dequantizing twin.

    python -m bench.cpu_quant_linear [--rows 1 8 64 256] [--repeat 5] [--threads N]

For SmolLM2-135M's linear shapes (N, K) in {(576, 576), (192, 576), (1536, 576), (576, 1536)}
and each row count: microseconds per call of
  fp32   skinny_linear on pack_skinny_weight(W)
  g4     skinny_linear_g4, 4-bit codes, group 32, fp32 offsets (GGUF Q4_1's form)
  g8     skinny_linear_g8, int8 codes, group 32, no offsets (Q8_0's form)
  f8     skinny_linear_f8, e4m3 with one scale per row
  twin   GroupedWeight(4-bit).dequantize() then F.linear, every call
Each call runs on one of enough copies of the weight to exceed the last-level cache (weights
cold, as in a model step where every layer's matrices stream once). Figures are the best of
`--repeat` passes; on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from executor_svc.models.linear import pack_skinny_weight
from executor_svc.quantization.grouped import GroupedWeight
from kernels import cpu_ext, cpu_quant

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
GROUP = 32
COLD_BYTES = 96 << 20  # fp32 bytes of weight copies per shape: past a typical L3


def _weights(n: int, k: int, copies: int, gen: torch.Generator) -> dict[str, list]:
    made: dict[str, list] = {name: [] for name in ("fp32", "g4", "g8", "f8", "twin")}
    for _ in range(copies):
        w = torch.randn(n, k, generator=gen) * 0.05
        made["fp32"].append(pack_skinny_weight(w))
        q4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scales = torch.rand(n, k // GROUP, generator=gen) * 0.01
        offsets = -8 * scales
        made["g4"].append(cpu_quant.pack_grouped(q4, scales, offsets, GROUP))
        if len(made["twin"]) < 4:  # dequantizes every call: compute bound, cache state moot
            made["twin"].append(GroupedWeight(q4, scales, offsets, GROUP))
        q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        made["g8"].append(cpu_quant.pack_grouped(q8, scales, None, GROUP))
        scale = w.abs().amax(dim=1) / 448
        made["f8"].append((cpu_quant.pack_fp8((w / scale[:, None]).to(torch.float8_e4m3fn)),
                           scale))
    return made


def _call(name: str, x: torch.Tensor, weight, n: int) -> torch.Tensor:
    ops = cpu_ext.load()
    if name == "fp32":
        return ops.skinny_linear(x, weight, None, n)
    if name in ("g4", "g8"):
        return cpu_quant.grouped_linear(x, weight, None)
    if name == "f8":
        return cpu_quant.fp8_linear(x, weight[0], weight[1], None)
    return F.linear(x, weight.dequantize())


def _time(x: torch.Tensor, made: dict[str, list], n: int, repeat: int) -> dict[str, float]:
    """Best microseconds per call of each kind; passes alternate between the kinds, so a burst
    of contention from another process slows one pass of each rather than all of one."""
    best = dict.fromkeys(made, float("inf"))
    for _ in range(repeat):
        for name, copies in made.items():
            t0 = time.perf_counter()
            for weight in copies:
                _call(name, x, weight, n)
            best[name] = min(best[name], (time.perf_counter() - t0) / len(copies))
    return {name: t * 1e6 for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_ext.load() is None:
        raise SystemExit("the fused CPU kernels did not build here")
    gen = torch.Generator().manual_seed(0)
    names = ["fp32", "g4", "g8", "f8", "twin"]
    print(f"threads={torch.get_num_threads()} isa={cpu_ext.capability()} (us per call, best of "
          f"{args.repeat}; x/fp32 = speedup over fp32)")
    print(f"{'N x K':>11} {'rows':>4} " + " ".join(f"{n:>8}" for n in names)
          + "   g4/fp32 g8/fp32 f8/fp32")
    for n, k in SHAPES:
        copies = max(2, COLD_BYTES // (4 * n * k))
        made = _weights(n, k, copies, gen)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            us = _time(x, made, n, args.repeat)
            ratios = " ".join(f"{us['fp32'] / us[m]:7.2f}" for m in ("g4", "g8", "f8"))
            print(f"{n:>5} x {k:<4} {rows:>4} " + " ".join(f"{us[m]:8.0f}" for m in names)
                  + f"   {ratios}", flush=True)


if __name__ == "__main__":
    main()
