"""A converted GGUF directory with every kept block tensor dequantized: the float checkpoint
the kept-quantized model equals (the converter's output before it kept blocks). No torch.

    dequantized_copy(converted_dir, dest)   # dest: config.json without quantization_config,
                                            # raw block tensors replaced by gguf's float32

The gguf package's dequantization is the one the converter uses for every other tensor and
the one transformers uses for GGUF files, so this copy is what HF serves for the same file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def dequantized_copy(model_dir: Path, dest: Path) -> Path:
    import gguf
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    types = (config.pop("quantization_config", None) or {}).get("tensor_types", {})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in sorted(dest.glob("*.safetensors")):
        weights = load_file(str(file))
        kept = [name for name in weights if name in types]
        if not kept:
            continue
        for name in kept:
            weights[name] = gguf.quants.dequantize(weights[name],
                                                   gguf.GGMLQuantizationType[types[name]])
        save_file(weights, str(file), metadata={"format": "pt"})
    return dest
