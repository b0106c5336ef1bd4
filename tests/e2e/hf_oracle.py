"""HF transformers as the oracle (greedy and beam search), plus the prompts the tests send."""

from __future__ import annotations

import random
from pathlib import Path

# Lengths straddle block boundaries (block size 16) and reach ~200 tokens.
PROMPT_LENGTHS = (1, 2, 7, 15, 16, 17, 33, 64, 100, 131, 200)
NUM_SPECIAL_TOKENS = 5  # ids 0..4 in the default tokenizer; prompts avoid them


def random_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(n)] for n in lengths]


def load_hf_model(model_dir: str | Path):
    """float32 on the CPU; a gpt-oss checkpoint with MXFP4 experts dequantized by HF's own
    MXFP4 integration (tests/fixtures/mxfp4_checkpoints.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.fixtures.mxfp4_checkpoints import declares_mxfp4, load_hf_mxfp4

    if declares_mxfp4(Path(model_dir)):
        model = load_hf_mxfp4(Path(model_dir))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # ignore_eos on the server side: HF must not stop at EOS either (min_new_tokens would
    # instead mask EOS out of the argmax, which changes the answer).
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int,
              eos_token_id: int | None = None) -> list[list[int]]:
    """HF `generate(do_sample=False)`, one prompt at a time (no padding effects); with
    `eos_token_id`, each continuation stops after that id (included)."""
    import torch

    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=0, eos_token_id=eos_token_id,
                                 pad_token_id=eos_token_id)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def hf_beam_search(model, prompt: list[int], beam_width: int, n: int, length_penalty: float,
                   early_stopping: bool | str, stop_ids, max_new_tokens: int):
    """HF `generate(num_beams=beam_width, do_sample=False, num_return_sequences=n)`.

    `early_stopping` in HF's terms (False, True or "never"). Returns the n best beams' generated
    ids (each up to its stop token), their sequence scores, and HF's per-step scores."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=beam_width,
            num_return_sequences=n, length_penalty=length_penalty, early_stopping=early_stopping,
            max_new_tokens=max_new_tokens, eos_token_id=sorted(stop_ids) or None,
            pad_token_id=model.config.pad_token_id, return_dict_in_generate=True,
            output_scores=True)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    sequences = [out.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist()
                 for i in range(n)]
    return sequences, out.sequences_scores.tolist(), out.scores


def mismatch_report(model, prompt: list[int], expected: list[int], got: list[int]) -> str:
    """Where two greedy runs part, and how close the oracle's top two logits were there
    (a gap near float noise means a tie, not a wrong kernel)."""
    import torch

    pos = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
               min(len(expected), len(got)))
    lines = [f"prompt len {len(prompt)}: first difference at output {pos}",
             f"  hf:    {expected}", f"  folio: {got}"]
    if pos < min(len(expected), len(got)):
        with torch.inference_mode():
            ids = torch.tensor([prompt + expected[:pos]], dtype=torch.long)
            logits = model(ids).logits[0, -1].float()
        top = torch.topk(logits, 2)
        lines.append(f"  hf top-2 at that step: ids {top.indices.tolist()} logits "
                     f"{[round(v, 6) for v in top.values.tolist()]}; folio chose {got[pos]} "
                     f"(hf logit {logits[got[pos]].item():.6f})")
    return "\n".join(lines)
