"""Connecting an executor: checking its Hello, the model facts the scheduler keeps from it, and
the fresh Scheduler (with a BlockManager sized by the Hello) that serves it.

`answer_hello` decides the answer and `Engine._handshake` applies it. One executor is connected at
a time: a Hello from another connection while one is connected is refused with a retryable
Reject (it is never swapped in); once the connected one is lost, the next Hello is welcomed and
every unfinished request resumes on it (registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from protos.plan import PROTOCOL_VERSION, Hello, Reject, Welcome
from scheduler_svc.config import SchedulerConfig, num_speculative_tokens
from scheduler_svc.sched.block_manager import BlockManager, longest_context
from scheduler_svc.sched.kv_events import KvEventLog
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.text.tokenizer import Tokenizer

log = structlog.get_logger("folio.scheduler.engine")  # part of the engine's connection log

ANOTHER_EXECUTOR = ("another executor is connected to this scheduler; this one is refused "
                    "while it serves (it will be welcomed if that one is lost)")


@dataclass(frozen=True)
class ExecutorInfo:
    """The connected executor: its ZeroMQ identity and the facts its Hello reported."""

    identity: bytes
    executor_id: str
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int  # effective: min(model, --max-model-len, what the KV pool holds)
    block_size: int
    num_kv_blocks: int
    dtype: str
    device: str
    random_weights: bool
    tensor_parallel_size: int
    kv_cache_dtype: str = ""  # what the KV cache stores: dtype's, "fp8_e4m3" or "int8"

    @classmethod
    def from_hello(cls, identity: bytes, hello: Hello, max_model_len_cap: int | None,
                   max_num_batched_tokens: int = 1) -> ExecutorInfo:
        # A sequence running alone must fit in the pool, or it would preempt itself forever;
        # with sliding windows it holds only the windows' blocks (and a step's chunk) there.
        max_model_len = longest_context(hello.num_kv_blocks, hello.block_size,
                                        hello.kv_windows, max_num_batched_tokens,
                                        hello.max_model_len)
        if max_model_len_cap is not None:
            max_model_len = min(max_model_len, max_model_len_cap)
        return cls(identity=identity, executor_id=hello.executor_id,
                   model_name=hello.model_name, architecture=hello.architecture,
                   vocab_size=hello.vocab_size, max_model_len=max_model_len,
                   block_size=hello.block_size, num_kv_blocks=hello.num_kv_blocks,
                   dtype=hello.dtype, device=hello.device,
                   random_weights=bool(hello.random_weights),
                   tensor_parallel_size=hello.tensor_parallel_size,
                   kv_cache_dtype=hello.kv_cache_dtype or hello.dtype)


def check_hello(hello: Hello, tokenizer: Tokenizer) -> str | None:
    """None if the executor can serve this scheduler, else the reason for an operator."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return (f"executor speaks protocol v{hello.protocol_version}, this scheduler "
                f"v{PROTOCOL_VERSION}; run matching versions")
    if hello.tensor_parallel_size < 1:
        return "executor reported no ranks (tensor_parallel_size 0); run matching versions"
    if hello.vocab_size < 1:
        return "executor reported an empty vocabulary; check its model"
    if hello.block_size < 1 or hello.num_kv_blocks < 1:
        return (f"executor reported {hello.num_kv_blocks} KV blocks of {hello.block_size} "
                "tokens; it needs at least one block (give it more --kv-cache-memory)")
    if hello.max_model_len < 2 or longest_context(hello.num_kv_blocks, hello.block_size,
                                                  hello.kv_windows, 1, 2) < 2:
        return (f"executor can hold only {hello.num_kv_blocks} KV blocks of "
                f"{hello.block_size} tokens in {len(hello.kv_windows)} KV groups (max_model_len "
                f"{hello.max_model_len}); a request needs at least 2 tokens")
    if tokenizer.vocab_size > hello.vocab_size:
        return (f"the scheduler's tokenizer has {tokenizer.vocab_size} tokens but the "
                f"executor's model only {hello.vocab_size}; start both on the same model")
    return None


def new_scheduler(info: ExecutorInfo, hello: Hello, config: SchedulerConfig, *,
                  first_step_id: int = 0, reset_executor: bool = False,
                  kv_events: KvEventLog | None = None,
                  host_kv_events: KvEventLog | None = None) -> Scheduler:
    """A scheduler for the executor `info`: its KV pool, CPU swap pool and host tier, empty,
    its prefix cache reporting to `kv_events` and its host tier to `host_kv_events` (which the
    caller has cleared). Step ids
    continue from `first_step_id`, so a late answer to an older plan never matches a new
    one; `reset_executor` makes the first plan tell the executor to drop what it holds.
    Speculative decoding runs on one rank only (ranks > 1 would each have to verify)."""
    spec_k = num_speculative_tokens(config)
    if config.speculative_method == "draft" and hello.num_draft_tokens < spec_k:
        log.warning("speculative decoding is off: the executor runs no draft model making "
                    f"{spec_k} proposals (start it with --num-draft-tokens {spec_k})",
                    num_draft_tokens=hello.num_draft_tokens)
        spec_k = 0
    if spec_k and hello.tensor_parallel_size > 1:
        log.warning("speculative decoding is off: not supported with tensor parallelism yet",
                    tensor_parallel_size=hello.tensor_parallel_size)
        spec_k = 0
    return Scheduler(
        BlockManager(info.num_kv_blocks, info.block_size, max(0, hello.num_swap_blocks),
                     windows=hello.kv_windows, window_margin=spec_k, events=kv_events,
                     # The tier holds prefix-cache blocks only: nothing to hold without it.
                     num_host_blocks=hello.num_host_blocks if config.enable_prefix_caching
                     else 0, host_events=host_kv_events),
        config.max_num_seqs, config.max_num_batched_tokens, info.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        preemption_mode=config.preemption_mode, first_step_id=first_step_id,
        reset_executor=reset_executor, num_speculative_tokens=spec_k,
        speculative_method=config.speculative_method or "ngram")


def log_connected(info: ExecutorInfo, hello: Hello, config: SchedulerConfig) -> None:
    """Log a connected executor, with a hint for each way it serves less than was asked."""
    log.info("executor connected", executor_id=hello.executor_id, model=hello.model_name,
             num_kv_blocks=info.num_kv_blocks, num_swap_blocks=hello.num_swap_blocks,
             num_host_blocks=hello.num_host_blocks, block_size=info.block_size,
             max_model_len=info.max_model_len, dtype=info.dtype, device=info.device,
             kv_cache_dtype=info.kv_cache_dtype, random_weights=info.random_weights,
             tensor_parallel_size=info.tensor_parallel_size)
    if info.max_model_len < min(hello.max_model_len, config.max_model_len or 1 << 62):
        log.warning("max_model_len capped by the KV pool", max_model_len=info.max_model_len,
                    hint="give the executor more --kv-cache-memory or --num-kv-blocks")
    if config.preemption_mode == "swap" and hello.num_swap_blocks <= 0:
        log.warning("--preemption-mode swap, but the executor has no CPU swap pool: "
                    "preempted requests will be recomputed",
                    hint="start the executor with --swap-space GiB")


def answer_hello(connected: ExecutorInfo | None, connected_hello: Hello | None,
                 identity: bytes, hello: Hello, tokenizer: Tokenizer
                 ) -> tuple[Welcome | Reject | None, str | None]:
    """(answer, what to log): no answer to a changed Hello from the connected executor; a
    Welcome with `connected` None means: connect this executor."""
    if connected is not None:
        if identity == connected.identity:
            # An executor resends Hello until answered: a copy after our Welcome is no
            # restart (a restarted process connects anew, with a new identity).
            if hello == connected_hello:
                return Welcome(protocol_version=PROTOCOL_VERSION), None
            return None, "ignored a changed Hello from the connected executor"
        return Reject(reason=ANOTHER_EXECUTOR, retry=True), "refused a second executor"
    reason = check_hello(hello, tokenizer)
    if reason is not None:
        return Reject(reason=reason), f"executor rejected: {reason}"
    return Welcome(protocol_version=PROTOCOL_VERSION), None
