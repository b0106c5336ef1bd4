"""HF transformers peers for `folio bench` (run in Folio's venv, as a separate process).

    kind "hf"        `model.generate`: greedy, left-padded batches of `batch_size` requests in
                     workload order, each batch generating its longest output length (shorter
                     requests keep only their own tokens; the rest is the padded batch's waste)
    kind "hf-batch"  continuous batching (the manager behind `generate_batch`, paged attention
                     over sdpa), each request with its own max_new_tokens. One manager lives
                     for the whole run: creating one sizes and fills its static tensors
                     (~18 s on a 2-core machine), which `generate_batch` would repeat per call

EOS is never a stop: both run until every request has its output_len tokens. See protocol.py
for the messages. The spec: {"kind", "model_dir", "dtype", "batch_size", "threads",
"kv_tokens", "max_num_batched_tokens"}.
"""

from __future__ import annotations

import sys
from importlib.metadata import version

from protocol import serve

PAD_ID = 0  # any id: padded positions are masked out


def load(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=getattr(torch, spec["dtype"]), attn_implementation="sdpa").eval()
    # No stop token at all: the checkpoint's EOS would otherwise end a request early.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    versions = {name: version(name) for name in ("torch", "transformers")}
    state = {"model": model, "kind": spec["kind"], "batch_size": spec.get("batch_size") or 16}
    if spec["kind"] == "hf-batch":
        state["manager"] = _start_manager(model, spec)
    return state, {"versions": versions, "threads": torch.get_num_threads()}


def _start_manager(model, spec: dict):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    # The KV pool holds the whole workload (no preemption), like Folio's and vLLM's pools.
    page_size = 256
    num_blocks = -(-int(spec.get("kv_tokens") or 65536) // page_size) + 1
    config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks,
        max_batch_tokens=spec.get("max_num_batched_tokens") or 2048)
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID,
                                  max_new_tokens=spec.get("max_model_len") or 2048)
    manager = model.init_continuous_batching(generation_config=generation,
                                             continuous_batching_config=config)
    manager.start()
    return manager


def _generate_padded(model, prompts, output_lens, batch_size):
    import torch
    from transformers import GenerationConfig

    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch, lens = prompts[start:start + batch_size], output_lens[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        config = GenerationConfig(max_new_tokens=max(lens), do_sample=False,
                                  eos_token_id=None, pad_token_id=PAD_ID)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        outputs += [row[width:width + n].tolist() for row, n in zip(out, lens, strict=True)]
    return outputs


def _generate_continuous(manager, prompts, output_lens):
    req_ids = [manager.add_request(input_ids=p, max_new_tokens=n)
               for p, n in zip(prompts, output_lens, strict=True)]
    results: dict[str, list[int]] = {}
    while len(results) < len(req_ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching manager stopped early")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id}: {result.error}")
            results[result.request_id] = list(result.generated_tokens)
    return [results[r] for r in req_ids]


def generate(state, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
    if state["kind"] == "hf-batch":
        return _generate_continuous(state["manager"], prompts, output_lens)
    return _generate_padded(state["model"], prompts, output_lens, state["batch_size"])


def close(state) -> None:
    if "manager" in state:
        state["manager"].stop(block=True, timeout=10)


if __name__ == "__main__":
    sys.exit(serve(load, generate, close))
