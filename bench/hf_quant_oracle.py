"""HF transformers' greedy tokens from a GPTQ or AWQ checkpoint, on the CPU: the oracle of
Folio's 4-bit loaders. Runs under the venv bench/install_hf_quant.sh makes (GPTQModel there
supplies the quantized linear layers), never under Folio's own:

    .venv-hf-quant/bin/python bench/hf_quant_oracle.py --model DIR --prompt-ids '[[1, 2, 3]]' \
        [--max-new-tokens 16] [--weights-out FILE]

Prints one JSON object: {"kernels": [the quantized layers' classes], "tokens": [[ids], ...]},
greedy, never stopping at an EOS id. GPTQModel's plain torch kernels are chosen (backend
"torch" / "torch_awq"): they dequantize to fp16 exactly ((q - z) * scale, one rounding) and
multiply in the model's dtype (fp32 here), where the default CPU kernels go through bf16.
--weights-out writes every quantized layer's weight as the layer computes it ([N, K] fp32,
probed with an identity input, bias detached), to compare with a reference dequantization.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Neither this folder nor Folio's root may shadow the venv's packages: both have a `kernels`,
# which transformers imports as the hub's kernels package when it finds one.
_SHADOWING = {Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]}
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in _SHADOWING]

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig  # noqa: E402

TORCH_BACKENDS = {"gptq": "torch", "awq": "torch_awq"}


def load(model_dir: Path):
    method = json.loads((model_dir / "config.json").read_text())["quantization_config"][
        "quant_method"]
    if method not in TORCH_BACKENDS:
        raise SystemExit(f"{model_dir} is not a GPTQ or AWQ checkpoint (quant_method {method!r})")
    config_cls = GPTQConfig if method == "gptq" else AwqConfig
    # Only the loading attributes (the backend) of this config override the checkpoint's.
    override = config_cls(bits=4, backend=TORCH_BACKENDS[method])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 device_map="cpu", quantization_config=override)
    return model.eval()


def quantized_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, "qweight")}


def greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def layer_weights(layers: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    weights = {}
    with torch.no_grad():
        for name, layer in layers.items():
            bias, layer.bias = layer.bias, None
            eye = torch.eye(layer.in_features, dtype=torch.float32)
            weights[f"{name}.weight"] = layer(eye).T.contiguous()  # [N, K]
            layer.bias = bias
    return weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompt-ids", required=True, help="JSON list of token id lists")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--weights-out", type=Path)
    args = parser.parse_args(argv)
    model = load(args.model)
    layers = quantized_layers(model)
    if not layers:
        raise SystemExit(f"transformers loaded no quantized layer from {args.model}")
    if args.weights_out:
        save_file(layer_weights(layers), args.weights_out)
    tokens = greedy(model, json.loads(args.prompt_ids), args.max_new_tokens)
    kernels = sorted({type(m).__name__ for m in layers.values()})
    print(json.dumps({"kernels": kernels, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
