"""The executor's configuration: one frozen dataclass, built once from the command line.

Values learned at run time (how many KV blocks fit, the model's real max length) are not
written back here; they travel in the Hello message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from checkpoints.quant_config import KV_CACHE_DTYPES
from checkpoints.quant_config import SCHEMES as QUANTIZATION_SCHEMES

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str) -> int:
    """'512MiB' -> 536870912. Bare numbers are bytes; KiB/MiB/GiB are powers of 1024."""
    m = _SIZE_RE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read memory size {text!r}: write a number with a unit, e.g. 512MiB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ExecutorConfig:
    model: str | None  # dir, .gguf, hub id or folio: name (named_models.py); None: default
    scheduler_address: str = "tcp://127.0.0.1:5557"
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides memory-based sizing
    kv_cache_memory: int | None = None  # bytes; None = the device's default
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device this executor may use
    # The scheduler's limits: the profiling step's shape (memory.py); decode graphs are
    # captured up to max_num_seqs sequences (graph_runner.py).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    swap_space: float = 0.0  # GiB of host memory for the CPU KV swap pool; 0 = no swapping
    # GiB of host memory for the prefix cache's host tier (kv/host_tier.py); 0 = none.
    kv_offloading_size: float = 0.0
    # Where the host tier lives: a tier file in shared memory that the serving process owns
    # (protos/kv_tier_file.py), so that it outlives this executor; None: private memory.
    kv_offloading_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    cpu_threads: int | None = None  # torch intra-op threads; None = cpu_threads.default_cpu_threads
    max_model_len: int | None = None
    log_format: str = "console"
    log_level: str = "info"
    hub_cache_dir: str | None = None
    channel_secret_file: str | None = None  # None: $FOLIO_CHANNEL_SECRET, else no auth
    parent_pid: int | None = None  # exit when this process is gone (see lifecycle.py)
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    tensor_parallel_size: int = 1  # ranks sharding the model (distributed.py, tp_launch.py)
    quantization: str | None = None  # int8 | fp8: quantize linear weights at load
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: what the KV cache stores (kv_quant.py)
    # Speculative decoding's draft model (draft.py): proposals per step (0 = none), its
    # checkpoint (None: the served model) and the decoder layers kept (None: all).
    num_draft_tokens: int = 0
    draft_model: str | None = None
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not self.model.strip():
            raise ValueError("--model is empty: give a checkpoint directory, a .gguf file, a "
                             "hub id, or leave it out for the default model")
        if not re.match(r"^(tcp|ipc|inproc)://.+", self.scheduler_address):
            raise ValueError(
                f"--scheduler-address {self.scheduler_address!r} is not a ZeroMQ endpoint; "
                "use e.g. tcp://127.0.0.1:5557 or ipc:///tmp/folio.sock")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be a positive size such as 512MiB")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1, got "
                             f"{self.max_num_batched_tokens}")
        if not 0 <= self.swap_space < 1 << 20:  # also refuses NaN and inf
            raise ValueError(f"--swap-space must be >= 0 GiB (and finite), got {self.swap_space}")
        if not 0 <= self.kv_offloading_size < 1 << 20:
            raise ValueError("--kv-offloading-size must be >= 0 GiB (and finite), got "
                             f"{self.kv_offloading_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {self.cpu_threads}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be console or json, got {self.log_format!r}")
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ValueError(f"--parent-pid must be a process id (>= 1), got {self.parent_pid}")
        if not 1 <= self.tensor_parallel_size <= 512:
            raise ValueError("--tensor-parallel-size must be between 1 and 512, got "
                             f"{self.tensor_parallel_size}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if not 0 <= self.num_draft_tokens <= 16:
            raise ValueError("--num-draft-tokens must be between 0 and 16, got "
                             f"{self.num_draft_tokens}")
        if self.num_draft_tokens == 0 and (self.draft_model or self.draft_layers):
            raise ValueError("--draft-model and --draft-layers need --num-draft-tokens")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"--draft-layers must be at least 1, got {self.draft_layers}")
