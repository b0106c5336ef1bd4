"""Which quantization scheme a model's linear weights use: from --quantization and from the
checkpoint's config.json ``quantization_config``. No torch here: the executor checks this
before its torch import, with the rest of the checkpoint (executor_svc/cli.py
check_checkpoint), and the scheduler checks --quantization against SCHEMES.

Schemes (methods in executor_svc/quantization/methods.py):

- ``int8``: W8A16, symmetric int8 weights with one fp32 scale per output channel
  (absmax / 127), quantized at load from an unquantized checkpoint.
- ``fp8``: float8 e4m3 weights, fp32 scale per output channel, 16/32-bit activations.
  Quantized at load (absmax / 448 per channel) from an unquantized checkpoint, or loaded as
  they are from an fp8 checkpoint, as vLLM, llm-compressor and transformers write them:
  ``quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic" | "static",
  ...}`` with each quantized layer's ``weight`` in F8_E4M3, its ``weight_scale`` per tensor
  (a scalar) or per channel ([N] or [N, 1]), and with "static", an ``input_scale``. Products
  here always take 16/32-bit activations: static input scales are loaded (every tensor has a
  home) but not applied, which is at least as accurate as the fp8 activations they were
  calibrated for.
- ``gptq``: GPTQ checkpoints (``quant_method: "gptq"``, bits 4 or 8, ``group_size`` (-1: one
  group per row), ``desc_act`` (act order: ``g_idx`` groups columns out of order), ``sym``,
  ``checkpoint_format`` "gptq" (stored zero points are z - 1, the original format) or
  "gptq_v2" (z as is)); each quantized layer stores ``qweight`` int32 [K*bits/32, N],
  ``qzeros`` int32 [G, N*bits/32], ``scales`` [G, N] and ``g_idx`` int32 [K].
- ``awq``: AutoAWQ's GEMM checkpoints (``quant_method: "awq"``, bits 4, ``group_size``,
  ``zero_point`` true, ``version`` "gemm"): ``qweight`` int32 [K, N/8] and ``qzeros`` int32
  [G, N/8] with AWQ's interleaved order inside each int32, ``scales`` [G, N].
  Both load as they are (executor_svc/quantization/gptq.py), never quantized at load.
- ``gguf``: a GGUF file's block-quantized linear weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), kept
  as the converter wrote them (checkpoints/gguf): each such layer's ``weight`` is
  its raw block rows, uint8 [N, row_bytes], unpacked at load
  (executor_svc/quantization/gguf_blocks.py).
  Only from a checkpoint: ``quantization_config = {"quant_method": "gguf", "tensor_types":
  {hf_weight_name: ggml_type, ...}}``; the layers it does not list hold float weights.
- ``mxfp4``: gpt-oss's experts as openai ships them (``quant_method: "mxfp4"``): each layer's
  ``mlp.experts.gate_up_proj_blocks``/``_scales`` and ``down_proj_blocks``/``_scales``, FP4
  E2M1 codes with an E8M0 scale per 32 (executor_svc/loading/mxfp4.py). Only from a
  checkpoint, and not a scheme of the linear layers (the rest of the model is float): the
  experts are dequantized into the model dtype as they load (executor_svc/models/gpt_oss.py),
  so the model is served as a float one. ``modules_to_not_convert`` is not read: the loader
  takes MXFP4 tensors for every gpt-oss experts module and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoints.files import CheckpointError, read_json_object

SCHEMES = ("int8", "fp8", "gptq", "awq", "gguf", "mxfp4")
# --kv-cache-dtype (vLLM's names; kernels/kv_quant.py defines what each stores): auto = the
# model's dtype, fp8 = fp8_e4m3. Here, torch-free, for both services' flag checks.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
LOAD_TIME_SCHEMES = ("int8", "fp8")  # the schemes --quantization can apply to float weights
# GGUF block types kept quantized (the converter writes, executor_svc/quantization/gguf_blocks.py
# unpacks).
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
ACTIVATION_SCHEMES = ("dynamic", "static")


@dataclass(frozen=True)
class QuantConfig:
    scheme: str  # one of SCHEMES
    # True: the checkpoint holds the quantized weights and their scales (load them as they
    # are); False: quantize the checkpoint's float weights at load.
    from_checkpoint: bool = False
    activation_scheme: str = "dynamic"  # the checkpoint's; activations stay 16/32-bit here
    bits: int = 8
    group_size: int = -1  # -1: one group spans the whole input row
    desc_act: bool = False  # GPTQ act order
    zeros_minus_one: bool = False  # GPTQ's original format stores zero points minus one
    # gguf: checkpoint weight name -> GGUF block type of every layer stored as raw blocks.
    tensor_types: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(unsupported(self.scheme))
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation_scheme must be one of {', '.join(ACTIVATION_SCHEMES)}, "
                             f"got {self.activation_scheme!r}")


def unsupported(scheme: object) -> str:
    return f"unsupported quantization scheme {scheme!r} (supported: {', '.join(SCHEMES)})"


def checkpoint_quant_config(config_json: dict[str, Any]) -> QuantConfig | None:
    """The scheme a checkpoint's config.json declares, None when it declares none; ValueError
    (a sentence naming the field) for a scheme or a variant Folio cannot load."""
    qc = config_json.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        return _int4_config(method, qc)
    if method == "gguf":
        return _gguf_quant_config(qc)
    if method == "mxfp4":  # how gpt-oss ships its experts; models read ModelConfig's flag
        return QuantConfig("mxfp4", from_checkpoint=True)
    if method != "fp8":
        raise ValueError(unsupported(method))
    if qc.get("weight_block_size") is not None:
        raise ValueError("block-wise fp8 (quantization_config.weight_block_size "
                         f"{qc['weight_block_size']!r}) is not supported; fp8 checkpoints with "
                         "per-tensor or per-channel weight scales are")
    activation_scheme = qc.get("activation_scheme", "dynamic")
    if activation_scheme not in ACTIVATION_SCHEMES:
        raise ValueError("quantization_config.activation_scheme must be one of "
                         f"{', '.join(ACTIVATION_SCHEMES)}, got {activation_scheme!r}")
    return QuantConfig("fp8", from_checkpoint=True, activation_scheme=activation_scheme)


def _int4_config(method: str, qc: dict[str, Any]) -> QuantConfig:
    """GPTQ's and AWQ's fields, each checked (see the module docstring)."""
    bits = qc.get("bits", qc.get("w_bit"))
    allowed_bits = (4, 8) if method == "gptq" else (4,)
    if bits not in allowed_bits or isinstance(bits, bool):
        raise ValueError(f"{method} with bits {bits!r} is not supported (supported: "
                         f"{', '.join(map(str, allowed_bits))})")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (
            group_size < 1 and group_size != -1):
        raise ValueError(f"quantization_config.group_size must be a positive integer or -1, "
                         f"got {group_size!r}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (supported: gemm)")
        if qc.get("zero_point", True) is not True:
            raise ValueError("awq without zero points (zero_point false) is not supported")
        return QuantConfig("awq", from_checkpoint=True, bits=4, group_size=group_size)
    desc_act = qc.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise ValueError(f"quantization_config.desc_act must be true or false, got {desc_act!r}")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (supported: gptq, "
                         "gptq_v2)")
    return QuantConfig("gptq", from_checkpoint=True, bits=bits, group_size=group_size,
                       desc_act=desc_act, zeros_minus_one=fmt == "gptq")


def _gguf_quant_config(qc: dict[str, Any]) -> QuantConfig:
    types = qc.get("tensor_types")
    if not isinstance(types, dict) or not types:
        raise ValueError("quantization_config.tensor_types must be a non-empty object "
                         f"(weight name -> GGUF type), got {types!r}")
    for name, kind in types.items():
        if kind not in GGUF_TYPES:
            raise ValueError(f"quantization_config.tensor_types[{name!r}] = {kind!r}: GGUF "
                             f"types kept quantized are {', '.join(GGUF_TYPES)}")
    return QuantConfig("gguf", from_checkpoint=True, tensor_types=dict(types))


def resolve_quant_config(flag: str | None, model_dir: Path) -> QuantConfig | None:
    """--quantization (None: not given) against the checkpoint's own scheme. A quantized
    checkpoint loads as it is (the flag may name its scheme); a flag asking for another
    scheme is refused rather than stacking two quantizations. Errors in config.json are
    CheckpointErrors naming it; a flag that disagrees with it is a ValueError naming both."""
    path = model_dir / "config.json"
    try:
        from_checkpoint = checkpoint_quant_config(read_json_object(path))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(path, str(e)) from None
    if flag is not None and flag not in SCHEMES:
        raise ValueError(f"--quantization: {unsupported(flag)}")
    if from_checkpoint is None:
        if flag == "gguf":
            raise ValueError(f"--quantization gguf loads the block-quantized weights of a "
                             f"converted GGUF file, and {path} declares none "
                             f"(quantization_config); serve the .gguf file itself, or leave "
                             f"the flag out")
        if flag is not None and flag not in LOAD_TIME_SCHEMES:
            raise ValueError(f"--quantization {flag} loads {flag} checkpoints, and this one's "
                             f"config.json declares no quantization_config; to quantize float "
                             f"weights at load use {' or '.join(LOAD_TIME_SCHEMES)}")
        return None if flag is None else QuantConfig(flag)
    if flag is not None and flag != from_checkpoint.scheme:
        raise ValueError(f"--quantization {flag} disagrees with the checkpoint, whose "
                         f"config.json declares {from_checkpoint.scheme} weights "
                         f"(quantization_config); leave the flag out or pass --quantization "
                         f"{from_checkpoint.scheme}")
    return from_checkpoint
