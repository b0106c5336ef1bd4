"""Round-to-nearest GPTQ / AWQ checkpoints of a real model, for accuracy and speed runs.

    python -m bench.rtn_checkpoint --format gptq --group-size 64 --desc-act --out DIR [--src D]

`--src`: a float HF checkpoint directory (one model.safetensors); default: Folio's default
model (the SmolLM2-135M-Instruct GGUF), converted and then dequantized to float32
(checkpoints/gguf/dequantize.py). The values are RTN (each group's range spread
over the 4-bit steps), NOT GPTQ's or AWQ's algorithms: these checkpoints exercise the formats
and the kernels, and their accuracy is RTN's. Layouts and conventions:
tests/fixtures/int4_checkpoints.py, whose writers this calls.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def default_float_checkpoint(dest: Path) -> Path:
    from checkpoints.gguf import gguf_checkpoint_dir
    from checkpoints.gguf.dequantize import dequantized_copy
    from checkpoints.named_models import smollm2_gguf

    return dequantized_copy(gguf_checkpoint_dir(smollm2_gguf()), dest)


def main(argv: list[str] | None = None) -> None:
    from tests.fixtures.int4_checkpoints import write_awq_checkpoint, write_gptq_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--format", choices=("gptq", "awq"), required=True)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--desc-act", action="store_true", help="GPTQ act order (a seeded order)")
    p.add_argument("--sym", action="store_true", help="GPTQ symmetric (zero point 8)")
    p.add_argument("--src", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = args.src or default_float_checkpoint(Path(tmp) / "float")
        if args.format == "gptq":
            write_gptq_checkpoint(src, args.out, args.group_size, desc_act=args.desc_act,
                                  sym=args.sym)
        else:
            write_awq_checkpoint(src, args.out, args.group_size)
    print(args.out)


if __name__ == "__main__":
    main()
