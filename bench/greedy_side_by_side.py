"""Folio's and llama.cpp's greedy continuations of one chat prompt on the same GGUF file, decoded
with the model's tokenizer and printed side by side (Markdown).

    python bench/greedy_side_by_side.py [--model FILE.gguf] [--prompt TEXT] [--max-tokens N]

Both servers are the `folio bench` peers (client/bench/folio_peer.py, llamacpp_peer.py): the
prompt is rendered with the model's chat template into token ids once, and both get those ids,
greedy, EOS ignored, the same number of tokens. llama-server comes from
bench/install_llama_cpp.sh (or --llama-server).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.bench import models  # noqa: E402
from client.bench.folio_peer import FolioPeer  # noqa: E402
from client.bench.llamacpp_peer import DEFAULT_LLAMA_SERVER, LlamaCppPeer, gguf_file  # noqa: E402
from client.bench.metrics import UNSEEN_ID  # noqa: E402
from client.bench.workload import Request  # noqa: E402

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
MAX_MODEL_LEN = 2048


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y and UNSEEN_ID not in (x, y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: Folio's default model)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    gguf = gguf_file(args.model)
    model_dir = models.resolve_model_dir(args.model)  # Folio's converted checkpoint of `gguf`
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = list(tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    request = Request(ids, args.max_tokens, 0.0)
    threads = len(os.sched_getaffinity(0))
    log_dir = Path(tempfile.mkdtemp(prefix="side-by-side-"))
    peers = [FolioPeer(str(model_dir), ["--dtype", "float32", "--max-model-len",
                                        str(MAX_MODEL_LEN)], {"OMP_NUM_THREADS": str(threads)},
                       log_dir),
             LlamaCppPeer(args.llama_server, gguf, 1, MAX_MODEL_LEN, threads, MAX_MODEL_LEN,
                          log_dir)]
    outputs: dict[str, list[int]] = {}
    for peer in peers:
        try:
            peer.start()
            outputs[peer.name] = peer.run("latency", [request]).requests[0].output_ids
        finally:
            peer.stop()

    folio, llama = outputs["folio"], outputs["llamacpp"]
    diff = first_difference(folio, llama)
    print(f"Prompt ({len(ids)} tokens, chat template of `{gguf.name}`): {args.prompt!r}; "
          f"{args.max_tokens} greedy tokens each, EOS ignored.\n")
    print("| Folio | llama.cpp |\n|---|---|")

    def cell(out: list[int]) -> str:
        text = tok.decode([t for t in out if t != UNSEEN_ID], skip_special_tokens=False)
        return text.replace("|", "\\|").replace("\n", "<br>")

    print(f"| {cell(folio)} | {cell(llama)} |\n")
    print("Identical token ids." if diff is None else
          f"The ids first differ at output position {diff} (of {len(folio)}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
