"""Quantization accuracy on a real model, through the public API (CPU or GPU).

    python -m bench.quant_accuracy --schemes none,int8,fp8 --out bench/results [--model M]

For each scheme one real `folio serve` (with `--quantization SCHEME`, none: without; a
`LABEL=DIR` entry serves the checkpoint DIR as it is, e.g. a GPTQ or AWQ checkpoint written by
`python -m bench.rtn_checkpoint`; `kv-DTYPE` serves the float weights with `--kv-cache-dtype
DTYPE`, the quantized KV cache) on 127.0.0.1, driven over gRPC:
- **perplexity** over a fixed text set: the English corpus Folio's default tokenizer is trained
  on (`checkpoints/tiny_random.py` CORPUS, ~6 KB of prose and dialogue, versioned with that
  file), tokenized by the served model's tokenizer and cut into windows of `--window` tokens;
  each window is one request with prompt_logprobs=0 and max_tokens=1, and the perplexity is
  exp(-mean log p) over every window token after the first (the model's own predictions,
  teacher-forced, as the server computes them);
- **weight bytes**: what the executor's model holds once prepared (its "model loaded" line);
- **greedy agreement** with the unquantized model: `--num-prompts` prompts (fixed, varied) x
  `--max-tokens` greedy tokens (ignore_eos); per prompt the length of the common prefix, and
  over all the share of prompts identical to the end and the mean common-prefix fraction.
Writes STEM.json and .md to --out (--stem, default quant-accuracy; the first scheme is the
reference; put none first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import subprocess
import time
from pathlib import Path

from client.aio import AsyncFolioClient
from client.bench.folio_peer import FolioPeer

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def quicksort(items):",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip:",
    "Once upon a time, in a village by the mountains,",
    "The three laws of thermodynamics are",
    "Translate to French: The cat sleeps on the warm window sill.",
    "import numpy as np\n\n# compute the mean of each row",
    "Q: What is 12 times 7?\nA:",
    "The best way to learn a new language is",
    "Dear hiring manager, I am writing to apply for",
    "In 1969, the first humans landed on",
    "Summarize: The harbor was quiet before dawn. Fishing boats rocked against the pier.",
    "A recipe for pancakes needs",
    "The difference between a list and a tuple in Python is",
]


async def perplexity(client: AsyncFolioClient, text: str, window: int) -> tuple[float, int]:
    ids = await client.tokenize(text)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        done = await client.generate_text(token_ids=chunk, max_tokens=1, temperature=0.0,
                                          prompt_logprobs=0)
        lps = [t["logprob"] for t in done.prompt_logprobs or []]
        assert len(lps) == len(chunk) - 1, (len(lps), len(chunk))
        total += sum(lps)
        count += len(lps)
    return math.exp(-total / count), count


async def greedy(client: AsyncFolioClient, prompts: list[str], max_tokens: int) -> list[list[int]]:
    done = await asyncio.gather(*(client.generate_text(p, max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True) for p in prompts))
    return [d.token_ids for d in done]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_scheme(model: str, scheme: str, extra: list[str], args) -> dict:
    from checkpoints.tiny_random import CORPUS

    scheme, _, checkpoint = scheme.partition("=")
    if checkpoint:  # a quantized checkpoint, served as it is
        model, flags = checkpoint, []
    elif scheme.startswith("kv-"):  # the quantized KV cache (kernels/kv_quant.py)
        flags = ["--kv-cache-dtype", scheme.removeprefix("kv-")]
    else:
        flags = [] if scheme == "none" else ["--quantization", scheme]
    serve = [*extra, *flags,
             "--log-level", "info"]  # the executor's "model loaded" line carries weight_bytes
    peer = FolioPeer(model, serve)
    started = time.monotonic()
    info = peer.start()
    try:
        async def measure():
            async with AsyncFolioClient(peer.address, timeout=1800) as client:
                ppl, n = await perplexity(client, CORPUS, args.window)
                tokens = await greedy(client, PROMPTS[:args.num_prompts], args.max_tokens)
            return ppl, n, tokens

        ppl, n, tokens = asyncio.run(measure())
        found = re.findall(r"weight_bytes\W+(\d+)", peer.log_tail(2_000_000))
    finally:
        peer.stop()
    return {"scheme": scheme, "model": model, "perplexity": ppl, "perplexity_tokens": n, "tokens": tokens,
            "model_info": info["model_info"], "command": info["command"],
            "weight_bytes": int(found[-1]) if found else None,
            "seconds": time.monotonic() - started}


def summarize(rows: list[dict], max_tokens: int) -> None:
    ref = rows[0]["tokens"]
    for row in rows:
        prefixes = [common_prefix(a, b) for a, b in zip(ref, row["tokens"], strict=True)]
        row["greedy_common_prefix"] = prefixes
        row["greedy_identical"] = sum(p == max_tokens for p in prefixes) / len(prefixes)
        row["greedy_mean_prefix_fraction"] = sum(prefixes) / (max_tokens * len(prefixes))


def write(rows: list[dict], args, out: Path) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"model": args.model or "default", "window": args.window,
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "commit": commit, "schemes": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Quantization accuracy", "",
             f"- model: {args.model or 'the default (SmolLM2-135M-Instruct GGUF)'}; commit {commit}",
             f"- perplexity: the default tokenizer's corpus (checkpoints/tiny_random.py), "
             f"windows of {args.window} tokens",
             f"- greedy: {args.num_prompts} prompts x {args.max_tokens} tokens against "
             f"`{rows[0]['scheme']}`",
             "- weight bytes: every tensor the executor's model holds once prepared (on the CPU "
             "the fp32 linears keep two packed forms, the quantized ones their int8/fp8 weight "
             "and scales; embeddings and the LM head stay unquantized)", "",
             "| scheme | perplexity | greedy identical | mean common prefix | weight MiB |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        mib = f"{r['weight_bytes'] / 2**20:.1f}" if r["weight_bytes"] else "?"
        lines.append(f"| {r['scheme']} | {r['perplexity']:.3f} | {r['greedy_identical']:.0%} | "
                     f"{r['greedy_mean_prefix_fraction']:.0%} | {mib} |")
    (out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="served model (default: Folio's default)")
    p.add_argument("--schemes", default="none,int8,fp8")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `folio serve` argument (repeatable)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stem", default="quant-accuracy", help="the output files' name")
    args = p.parse_args(argv)
    model = args.model
    if model is None:  # the default model's GGUF file, as `folio serve` finds it
        from checkpoints.named_models import smollm2_gguf

        model = str(smollm2_gguf())
    rows = [run_scheme(model, s, args.serve_arg, args) for s in args.schemes.split(",")]
    summarize(rows, args.max_tokens)
    write(rows, args, args.out)
    print((args.out / f"{args.stem}.md").read_text())


if __name__ == "__main__":
    main()
