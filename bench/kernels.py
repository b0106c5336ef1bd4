"""Kernel benchmark: paged attention against the GPU's measured limits and against torch.

    python -m bench.kernels --out DIR [--dtype bfloat16] [--quick]

Decode (batch 1/16/64/256 x context 1k/4k/16k/32k) reports achieved GB/s, (KV + q bytes read) /
time, next to the measured copy bandwidth; prefill (1k/4k/8k/16k) reports achieved TFLOP/s next
to the measured bf16 matmul peak. Each case is checked against torch SDPA on the same K/V laid
out contiguously before it is timed, and SDPA (plus FlexAttention's paged attention for decode,
where it runs) is timed side by side. Writes DIR/kernels.json and DIR/kernels.md with the commit,
device, versions and command. Shapes are Llama-3.1-8B's attention: 32 q heads, 8 KV heads,
head_dim 128. Needs CUDA; `--smoke` runs tiny shapes on any device to check the plumbing only.
"""

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels

DECODE_BW_TARGET = 0.85  # of measured copy bandwidth, batch >= 16 and context >= 4k
PREFILL_PEAK_TARGET = 0.55  # of measured matmul peak at 8k
FLEX_PAGE_SIZE = 128  # FlexAttention's KV tile: its pages must match it
FULL = {"decode_batches": (1, 16, 64, 256), "decode_contexts": (1024, 4096, 16384, 32768),
        "prefill_lens": (1024, 4096, 8192, 16384), "prefill_tokens": 16384}  # fmt: skip
QUICK = {"decode_batches": (16, 64), "decode_contexts": (4096, 16384),
         "prefill_lens": (4096, 8192), "prefill_tokens": 8192}  # fmt: skip
SMOKE = {"decode_batches": (1, 3), "decode_contexts": (64, 200),
         "prefill_lens": (64, 128), "prefill_tokens": 128}  # fmt: skip
MEMORY_HEADROOM = 0.8  # of free device memory a case may use


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds per call after warm-up (compilation stays out of the number)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def sdpa(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """torch SDPA on contiguous [batch, heads, seq, head_dim] tensors, GQA without expansion."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def flex_paged_decode(q4, k, v, expected, scale, device, read_bytes) -> dict:
    """FlexAttention's paged decode over the same K/V ([batch, Hkv, ctx, D]); errors recorded."""
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        batch, num_kv_heads, ctx, head_dim = k.shape
        n_pages = batch * -(-ctx // FLEX_PAGE_SIZE)
        paged = PagedAttention(n_pages, FLEX_PAGE_SIZE, batch, device=str(device))
        for b in range(batch):
            paged.reserve(torch.tensor(b, device=device), torch.tensor(ctx, device=device))
        shape = (1, num_kv_heads, n_pages * FLEX_PAGE_SIZE, head_dim)
        k_flex = torch.zeros(shape, device=device, dtype=k.dtype)
        v_flex = torch.zeros_like(k_flex)
        batch_idx = torch.arange(batch, device=device)
        input_pos = torch.arange(ctx, device=device)[None].expand(batch, ctx)
        paged.assign(batch_idx, input_pos, k, v, k_flex, v_flex)
        logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, batch, None, 1, ctx,
                                    device=str(device), BLOCK_SIZE=FLEX_PAGE_SIZE)  # fmt: skip
        kv_len = torch.full((batch,), ctx, device=device)
        block_mask = paged.convert_logical_block_mask(logical, kv_len=kv_len)
        score_mod = paged.get_score_mod(None, kv_len=kv_len)
        flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

        def call():
            return flex(q4, k_flex, v_flex, block_mask=block_mask, score_mod=score_mod,
                        scale=scale, enable_gqa=True)  # fmt: skip

        err = (call()[:, :, 0].float() - expected.float()).abs().max().item()
        ms = time_ms(call, device)
        return {"flex_ms": ms, "flex_gbps": read_bytes / ms / 1e6, "flex_max_abs_err": err}
    except Exception as e:  # an experimental API: report why it did not run, keep going
        return {"flex_error": f"{type(e).__name__}: {str(e)[:300]}"}


def environment(device: torch.device) -> dict:
    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10)
            return done.stdout.strip() if done.returncode == 0 else "unknown"
        except OSError:
            return "unknown"

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": git("status", "--porcelain") not in ("", "unknown"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _fmt(row: dict, key: str, digits: int = 1) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_report(result: dict) -> str:
    env, limits, shapes = result["environment"], result["limits"], result["shapes"]
    lines = [
        "# Folio kernel benchmark", "",
        f"- device: {env['device']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}",
        f"- commit: {env['commit']}{' (dirty tree)' if env['dirty'] else ''}; date {env['date']}",
        f"- command: `{env.get('command', '')}`",
        f"- shapes: {shapes}" + (" — SMOKE RUN, numbers mean nothing" if result["smoke"] else ""),
        f"- measured copy bandwidth {limits['copy_gbps']:.0f} GB/s, "
        f"matmul peak {limits['matmul_tflops']:.0f} TFLOP/s", "",
        f"## Decode (target: >= {DECODE_BW_TARGET:.0%} of copy bandwidth at batch >= 16, context >= 4k)",
        "", "| batch | context | folio ms | folio GB/s | of copy BW | SDPA GB/s | Flex paged GB/s | target met |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]  # fmt: skip
    for row in result["decode"]:
        if "skipped" in row:
            lines.append(f"| {row['batch']} | {row['context']} | {row['skipped']} | | | | | |")
            continue
        met = {True: "yes", False: "NO"}.get(row.get("meets_target"), "")
        flex = _fmt(row, "flex_gbps", 0) if "flex_gbps" in row else "n/a"
        lines.append(f"| {row['batch']} | {row['context']} | {_fmt(row, 'folio_ms', 3)} | "
                     f"{_fmt(row, 'folio_gbps', 0)} | {row['fraction_of_copy_bw']:.0%} | "
                     f"{_fmt(row, 'sdpa_gbps', 0)} | {flex} | {met} |")  # fmt: skip
    lines += [
        "", f"## Prefill (target: >= {PREFILL_PEAK_TARGET:.0%} of matmul peak at 8k)", "",
        "| batch x seq_len | folio ms | folio TFLOP/s | of peak | SDPA TFLOP/s | target met |",
        "|---:|---:|---:|---:|---:|:---:|",
    ]  # fmt: skip
    for row in result["prefill"]:
        met = {True: "yes", False: "NO"}.get(row.get("meets_target"), "")
        lines.append(f"| {row['batch']} x {row['seq_len']} | {_fmt(row, 'folio_ms', 3)} | "
                     f"{_fmt(row, 'folio_tflops')} | {row['fraction_of_matmul_peak']:.0%} | "
                     f"{_fmt(row, 'sdpa_tflops')} | {met} |")  # fmt: skip
    for key, what in (("sdpa_error", "torch SDPA"), ("flex_error", "FlexAttention paged decode")):
        errors = {r.get(key) for r in result["decode"] + result["prefill"]} - {None}
        if errors:
            lines += ["", f"{what} did not run in some cases: " + "; ".join(sorted(errors))]
    return "\n".join(lines) + "\n"


def measure_limits(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    """Copy bandwidth (read + write bytes / time) and dense matmul throughput on this device."""
    numel = (1 << 22) if smoke else (1 << 29)  # 1 GiB of bf16 on a GPU
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device)
    n = 256 if smoke else 8192
    a, b = (
        torch.randn(n, n, device=device, dtype=dtype),
        torch.randn(n, n, device=device, dtype=dtype),
    )
    mm_ms = time_ms(lambda: a @ b, device)
    return {
        "copy_gbps": 2 * src.numel() * src.element_size() / copy_ms / 1e6,
        "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
    }


def _fits(num_bytes: float, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    torch.cuda.empty_cache()  # freed tensors still sit in the caching allocator
    free, _ = torch.cuda.mem_get_info(device)
    return num_bytes < MEMORY_HEADROOM * free


def _paged_layout(batch: int, seq_len: int, block_size: int, device: torch.device):
    """Shuffled physical blocks, as a long-running server's free list hands them out."""
    blocks_per_seq = -(-seq_len // block_size)
    perm = torch.randperm(batch * blocks_per_seq, device=device)
    return perm.view(batch, blocks_per_seq).int()  # [batch, blocks_per_seq]


def _contiguous(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    gathered = cache[block_tables.long()].flatten(1, 2)[:, :seq_len]  # [batch, seq_len, Hkv, D]
    return gathered.transpose(1, 2).contiguous()  # [batch, Hkv, seq_len, D]


def _check(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Max abs error; fails past bf16 rounding of both outputs (one ulp each at |x| ~ 4)."""
    diff = (ours.float() - reference.float()).abs()
    if (diff > 2e-2 + 2e-2 * reference.float().abs()).any():
        raise AssertionError(f"paged_attention disagrees with SDPA: max abs error {diff.max():.3g}")
    return diff.max().item()


def _time_paged_attention(attn_args: tuple, device: torch.device) -> float:
    return time_ms(lambda: kernels.paged_attention(*attn_args), device)


def decode_case(batch: int, ctx: int, args, device, dtype) -> dict:
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    elt = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * ctx * hkv * d * elt
    row = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes}
    if not _fits(kv_bytes, device):
        return {**row, "skipped": "not enough device memory"}
    block_tables = _paged_layout(batch, ctx, args.block_size, device)
    num_blocks = block_tables.numel()
    cache = torch.randn(2, num_blocks, args.block_size, hkv, d, device=device, dtype=dtype)
    q = torch.randn(batch, h, d, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    scale = d**-0.5
    attn_args = (q, cache[0], cache[1], block_tables, seq_lens, query_start_loc, 1, ctx, scale, out)
    read_bytes = kv_bytes + q.numel() * elt
    row["folio_ms"] = _time_paged_attention(attn_args, device)
    row["folio_gbps"] = read_bytes / row["folio_ms"] / 1e6

    # The peers read the same K/V laid out contiguously; the gather peaks at 1.5x the KV bytes.
    checked = _fits(1.5 * kv_bytes, device)
    if checked:
        k, v = _contiguous(cache[0], block_tables, ctx), _contiguous(cache[1], block_tables, ctx)
    del attn_args, cache  # only `out` is needed from here on
    if not checked:
        k = torch.randn(batch, hkv, ctx, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
    q4 = q[:, :, None]  # [batch, H, 1, D]
    try:
        reference = sdpa(q4, k, v, scale, causal=False)[:, :, 0]
        if checked:
            row["max_abs_err_vs_sdpa"] = _check(out, reference)
        del reference
        row["sdpa_ms"] = time_ms(lambda: sdpa(q4, k, v, scale, causal=False), device)
        row["sdpa_gbps"] = read_bytes / row["sdpa_ms"] / 1e6
    except RuntimeError as e:  # e.g. out of memory where no SDPA backend takes GQA natively
        row["sdpa_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if checked and _fits(1.1 * kv_bytes, device):  # Flex copies K/V into its own page pool
        row.update(flex_paged_decode(q4, k, v, out, scale, device, read_bytes))
    return row


def prefill_case(seq_len: int, args, device, dtype) -> dict:
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    batch = max(1, args.prefill_tokens // seq_len)
    num_tokens = batch * seq_len
    # Causal: query i meets i + 1 keys; QK^T and PV each cost 2 * head_dim FLOPs per pair.
    flops = 4 * batch * h * d * seq_len * (seq_len + 1) // 2
    row = {"batch": batch, "seq_len": seq_len, "flops": flops}
    block_tables = _paged_layout(batch, seq_len, args.block_size, device)
    num_blocks = block_tables.numel()
    k_cache = torch.empty(num_blocks, args.block_size, hkv, d, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    q = torch.randn(num_tokens, h, d, device=device, dtype=dtype)
    key, value = torch.randn(2, num_tokens, hkv, d, device=device, dtype=dtype).unbind(0)
    pos = torch.arange(seq_len, device=device)
    slot_mapping = (block_tables[:, pos // args.block_size].long() * args.block_size
                    + pos % args.block_size).flatten()  # fmt: skip
    kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_len
    out = torch.empty_like(q)
    scale = d**-0.5

    def ours():
        kernels.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                seq_len, seq_len, scale, out)  # fmt: skip

    q4 = q.view(batch, seq_len, h, d).transpose(1, 2)  # [batch, H, S, D]
    k4 = key.view(batch, seq_len, hkv, d).transpose(1, 2)
    v4 = value.view(batch, seq_len, hkv, d).transpose(1, 2)
    row["folio_ms"] = time_ms(ours, device)
    row["folio_tflops"] = flops / row["folio_ms"] / 1e9
    try:
        reference = sdpa(q4, k4, v4, scale, causal=True).transpose(1, 2).reshape_as(out)
        row["max_abs_err_vs_sdpa"] = _check(out, reference)
        del reference
        row["sdpa_ms"] = time_ms(lambda: sdpa(q4, k4, v4, scale, causal=True), device)
        row["sdpa_tflops"] = flops / row["sdpa_ms"] / 1e9
    except RuntimeError as e:
        row["sdpa_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    args.prefill_tokens = sizes["prefill_tokens"]
    torch.manual_seed(0)
    limits = measure_limits(device, dtype, args.smoke)
    print(f"limits: {limits}", flush=True)
    decode = []
    for batch in sizes["decode_batches"]:
        for ctx in sizes["decode_contexts"]:
            decode.append(decode_case(batch, ctx, args, device, dtype))
            print("decode", json.dumps(decode[-1]), flush=True)
    prefill = []
    for seq_len in sizes["prefill_lens"]:
        prefill.append(prefill_case(seq_len, args, device, dtype))
        print("prefill", json.dumps(prefill[-1]), flush=True)
    for row in decode:
        if "folio_gbps" in row:
            row["fraction_of_copy_bw"] = row["folio_gbps"] / limits["copy_gbps"]
            if row["batch"] >= 16 and row["context"] >= 4096:
                row["target"] = DECODE_BW_TARGET
                row["meets_target"] = row["fraction_of_copy_bw"] >= DECODE_BW_TARGET
    for row in prefill:
        row["fraction_of_matmul_peak"] = row["folio_tflops"] / limits["matmul_tflops"]
        if row["seq_len"] == 8192:
            row["target"] = PREFILL_PEAK_TARGET
            row["meets_target"] = row["fraction_of_matmul_peak"] >= PREFILL_PEAK_TARGET
    shapes = {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads,
              "head_dim": args.head_dim, "block_size": args.block_size, "dtype": args.dtype}  # fmt: skip
    return {"environment": environment(device), "shapes": shapes, "smoke": args.smoke,
            "limits": limits, "decode": decode, "prefill": prefill}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for kernels.json/.md")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="a few representative cases")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, any device: plumbing only"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench.kernels measures GPU kernels and needs a CUDA device "
              "(torch.cuda.is_available() is False); --smoke checks the plumbing on CPU.",
              file=sys.stderr)  # fmt: skip
        return 2
    result = run(args)
    result["environment"]["command"] = " ".join(
        ["python -m bench.kernels", *(argv or sys.argv[1:])]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "kernels.md").write_text(markdown_report(result))
    print(f"wrote {args.out / 'kernels.json'} and {args.out / 'kernels.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
