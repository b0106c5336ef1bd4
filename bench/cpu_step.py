"""The executor's model on the CPU, alone: step times, a profile, and a run under contention.

    python -m bench.cpu_step [--dtype bfloat16] [--threads N] [--layers 24] MODE

Modes:
  run         16 prompts x 128 in, 32 decode steps at batch 16 (the CPU workload of
              /work/shared/BENCHMARKS.md, model only: no scheduler, no sampling beyond argmax);
              prints prefill time, decode TPOT and output tok/s.
  profile     torch.profiler tables for one 128-token prefill and one decode step at batch 32
              (context ~160), grouped by op.
  contention  `run` on a quiet machine, then again while a competitor process spins on one
              core, and the ratio of the two throughputs.

The model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, head_dim 64,
FFN 4864, vocab 151936, tied embeddings, q/k/v bias) with random weights, built directly: no
checkpoint on disk. Timings on a shared machine are noisy: every figure is the best of
`--repeat` runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

QWEN25_05B = dict(
    architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
    intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip
BLOCK_SIZE = 16


def build_model(dtype, num_layers: int):
    import torch

    from executor_svc.kv.kv_cache import KVCache
    from executor_svc.loading.loader import prepare_for_device
    from executor_svc.loading.model_config import ModelConfig
    from executor_svc.models import model_class
    from executor_svc.step.attention import default_backend

    cfg = ModelConfig.from_dict({**QWEN25_05B, "num_hidden_layers": num_layers})
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, dtype=dtype, max_model_len=4096, backend=default_backend())
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.eval()
    prepare_for_device(model, torch.device("cpu"), dtype)
    kv = KVCache.allocate(cfg, 32 * 12 + 16, BLOCK_SIZE, dtype, torch.device("cpu"))
    model.bind_kv_cache(kv.per_layer())
    return model, cfg


def make_batch(seq_lens: list[int], q_lens: list[int], seq_block_base: int = 12):
    """Flat batch where sequence i owns blocks i*seq_block_base ...; shapes as inputs.py."""
    import torch

    from executor_svc.step.batch import BatchMetadata

    num_seqs = len(seq_lens)
    max_blocks = max(-(-s // BLOCK_SIZE) for s in seq_lens)
    block_tables = (torch.arange(num_seqs)[:, None] * seq_block_base
                    + torch.arange(max_blocks)[None, :])  # [num_seqs, max_blocks]
    q = torch.tensor(q_lens)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
    qsl[1:] = q.cumsum(0)
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q)
    pos = torch.tensor(seq_lens)[seq_idx] - q[seq_idx] + torch.arange(int(q.sum())) - qsl[seq_idx]
    slots = block_tables[seq_idx, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    batch = BatchMetadata(
        slot_mapping=slots, block_tables=block_tables.int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl.int(),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), logits_indices=qsl[1:] - 1,
    )  # fmt: skip
    return pos, batch


def workload(model, num_seqs: int = 16, prompt_len: int = 128, num_out: int = 32) -> dict:
    """Prefill every prompt (one step, as the scheduler's 2048-token budget would), then
    `num_out` - 1 decode steps at batch num_seqs. Returns seconds per phase."""
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 150000, (num_seqs * prompt_len,), generator=gen)
    with torch.inference_mode():
        t0 = time.perf_counter()
        pos, batch = make_batch([prompt_len] * num_seqs, [prompt_len] * num_seqs)
        next_ids = model(ids, pos, batch).argmax(-1)
        t1 = time.perf_counter()
        for step in range(1, num_out):
            seq_len = prompt_len + step
            pos, batch = make_batch([seq_len] * num_seqs, [1] * num_seqs)
            next_ids = model(next_ids, pos, batch).argmax(-1)
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tpot_ms": (t2 - t1) / (num_out - 1) * 1e3,
            "out_tok_s": num_seqs * num_out / (t2 - t0)}


def best_of(model, repeat: int, **kw) -> dict:
    runs = [workload(model, **kw) for _ in range(repeat)]
    return {k: (max if k == "out_tok_s" else min)(r[k] for r in runs) for k in runs[0]}


def fmt(r: dict) -> str:
    return (f"prefill {r['prefill_s'] * 1e3:7.0f} ms  decode TPOT {r['tpot_ms']:6.1f} ms  "
            f"out {r['out_tok_s']:6.1f} tok/s")


def profile(model, rows: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(2)
    cases = {"prefill 1 x 128": ([128], [128]),
             "decode batch 32, ctx 160": ([160] * 32, [1] * 32)}
    with torch.inference_mode():
        for label, (seq_lens, q_lens) in cases.items():
            pos, batch = make_batch(seq_lens, q_lens)
            ids = torch.randint(0, 150000, (sum(q_lens),), generator=gen)
            for _ in range(2):
                model(ids, pos, batch)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    model(ids, pos, batch)
            print(f"\n== {label} (3 steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def spinner() -> subprocess.Popen:
    """A competitor: one Python process spinning on one core, until this process is gone."""
    code = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("run", "profile", "contention"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=None,
                    help="executor CPU threads (default: the executor's own rule)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--no-keep-freed-memory", action="store_true",
                    help="leave malloc as it is (the executor sets executor_svc/host_memory.py)")
    args = ap.parse_args()

    from executor_svc.cpu_threads import apply_cpu_threads, default_cpu_threads

    threads = args.threads or default_cpu_threads()
    apply_cpu_threads(threads)  # before the first torch op, as the executor does
    if not args.no_keep_freed_memory:
        from executor_svc.host_memory import keep_freed_memory

        keep_freed_memory()
    import torch

    dtype = getattr(torch, args.dtype)
    model, _ = build_model(dtype, args.layers)
    print(f"torch {torch.__version__}, {args.dtype}, threads {torch.get_num_threads()}, "
          f"cores {len(os.sched_getaffinity(0))}, layers {args.layers}, seqs {args.seqs}")
    workload(model, num_seqs=2, num_out=2)  # warm-up
    if args.mode == "profile":
        profile(model, args.rows)
        return
    quiet = best_of(model, args.repeat, num_seqs=args.seqs)
    print(f"quiet:     {fmt(quiet)}")
    if args.mode == "contention":
        proc = spinner()
        try:
            time.sleep(0.5)
            busy = best_of(model, args.repeat, num_seqs=args.seqs)
        finally:
            proc.kill()
            proc.wait()
        print(f"contended: {fmt(busy)}")
        print(f"throughput kept under contention: {busy['out_tok_s'] / quiet['out_tok_s']:.0%}")


if __name__ == "__main__":
    main()
