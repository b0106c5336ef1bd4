"""The executor process: load the model, size the KV cache, greet the scheduler, serve steps.

    connect -> Hello -> (Welcome | Reject) -> [StepPlan -> StepResult | ExecutorError]* -> Shutdown

Hello is resent every `HELLO_RETRY_S` seconds until the scheduler answers, so the executor may
start before the scheduler binds. A resent Hello can earn more than one Welcome; the extras are
ignored.

Plans are run in the order they arrive; the scheduler sends the next one while this one runs
(overlapped scheduling), so it is usually queued when a step ends. After a failed step, the plan
behind it may still name the failed requests: they are skipped in that one plan.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from checkpoints.resolve import resolve_model_dir
from executor_svc.config import ExecutorConfig
from executor_svc.host_memory import return_freed_memory
from executor_svc.kv.host_tier import (
    available_host_bytes,
    check_host_memory,
    map_tier_file,
    num_host_blocks_for,
    open_tier_file,
    tier_identity,
)
from executor_svc.kv.kv_cache import KVCache, bytes_per_block, model_kv_layout, num_blocks_for
from executor_svc.kv.kv_scales import default_scales, read_kv_scales
from executor_svc.kv.memory import DEFAULT_GRAPH_RESERVE_BYTES, profiled_kv_budget
from executor_svc.kv.swap import SwapPool, num_swap_blocks_for
from executor_svc.loading.loader import (
    effective_max_model_len,
    has_random_weights,
    load_model,
)
from executor_svc.loading.model_config import ModelConfig
from executor_svc.parallel.distributed import all_reduce_min, barrier, init_tp, tp_rank, tp_size
from executor_svc.parallel.tp_worker import GroupBroken, Leader, follow
from executor_svc.spec.draft import DraftProposer, load_draft
from executor_svc.step.graph_runner import DecodeGraphRunner
from executor_svc.step.runner import ModelRunner
from kernels import kv_quant
from protos.channel import AuthFailed, BadMessage, ExecutorEnd, SchedulerLost
from protos.channel_keys import ChannelKeys, read_secret
from protos.plan import (
    PROTOCOL_VERSION,
    ExecutorError,
    Hello,
    Reject,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
)

log = structlog.get_logger(__name__)

HELLO_RETRY_S = 2.0
STATS_INTERVAL_S = 10.0
EXIT_OK, EXIT_FAILED, EXIT_REJECTED = 0, 1, 2

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None
                  ) -> tuple[torch.dtype, str]:
    """The model's dtype and why: `--dtype` as given, or auto's choice, the fastest dtype that
    loses nothing the checkpoint has beyond bf16's rounding of its 16-bit weights.

    CUDA: bf16 (fp16 where the GPU has no bf16). CPU: a float32 (or unstated) checkpoint stays
    float32; a 16-bit one runs in bf16 where the CPU multiplies bf16 natively (AVX512-BF16,
    AMX: half fp32's bytes per weight and per KV position, what a memory-bound step reads),
    else in float32, which is exact for it and faster than emulated bf16."""
    if name != "auto":
        return _DTYPES[name], f"--dtype {name}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: bfloat16 on CUDA"
        return torch.float16, "auto: float16, this GPU has no bfloat16"
    if checkpoint_dtype in (None, "float32"):
        return torch.float32, (f"auto: the checkpoint's weights are {checkpoint_dtype}"
                               if checkpoint_dtype else "auto: the checkpoint states no dtype")
    from kernels.cpu.runtime import has_native_bf16

    if has_native_bf16():
        return torch.bfloat16, (f"auto: the checkpoint's weights are {checkpoint_dtype} and "
                                "this CPU multiplies bfloat16 natively")
    return torch.float32, (f"auto: the checkpoint's weights are {checkpoint_dtype}, but this "
                           "CPU has no native bfloat16 matmuls (emulated ones are slower than "
                           "float32, which holds the weights exactly)")


@dataclass
class Executor:
    runner: ModelRunner
    hello: Hello


def build_executor(cfg: ExecutorConfig, model_dir: Path) -> Executor:
    """Everything before the first message: model, KV cache, and the Hello that reports them.
    `model_dir` is the local directory `cfg.model` resolved to."""
    if cfg.tensor_parallel_size > 1:  # before the device: a CUDA rank takes its local GPU
        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        rank, _ = init_tp(cfg.tensor_parallel_size, "cuda" if cuda else "cpu")
        structlog.contextvars.bind_contextvars(rank=rank)
    device = resolve_device(cfg.device)
    check_host_memory(cfg.kv_offloading_size, cfg.swap_space, available_host_bytes())
    model_cfg = ModelConfig.from_dir(model_dir)
    dtype, why = resolve_dtype(cfg.dtype, device, model_cfg.checkpoint_dtype)
    log.info("model dtype", dtype=str(dtype).removeprefix("torch."), reason=why)
    max_model_len = effective_max_model_len(model_cfg, cfg.max_model_len)
    model = load_model(model_dir, dtype=dtype, device=device, max_model_len=max_model_len,
                       cfg=model_cfg, quantization=cfg.quantization)
    draft_model = draft_cfg = None
    if cfg.num_draft_tokens and model_kv_layout(model_cfg).windowed:
        # The draft model attends over the target's block tables, whose windowed entries the
        # scheduler releases.
        raise ValueError("--num-draft-tokens: a draft model is not supported with a model "
                         "whose layers attend through sliding windows; use n-gram "
                         "speculation (--speculative-method ngram) instead")
    if cfg.num_draft_tokens:  # speculative decoding's draft model (draft.py)
        draft_dir = (resolve_model_dir(cfg.draft_model, cache_dir=cfg.hub_cache_dir)
                     if cfg.draft_model else model_dir)
        draft_model, draft_cfg = load_draft(draft_dir, model_cfg, cfg.draft_layers, dtype=dtype,
                                            device=device, max_model_len=max_model_len)
    if device.type == "cpu":
        # What loading freed below the weights (host_memory.py).
        log.info("freed load-time memory returned", released=return_freed_memory())
    # Measured after the weights are in place, by a step of the largest shape (memory.py).
    profiled = None
    if device.type == "cuda" and cfg.num_kv_blocks is None and cfg.kv_cache_memory is None:
        profiled = profiled_kv_budget(
            model, model_cfg, block_size=cfg.block_size, max_model_len=max_model_len,
            dtype=dtype, device=device, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, gpu_memory_utilization=cfg.gpu_memory_utilization,
            graph_reserve_bytes=0 if cfg.enforce_eager else DEFAULT_GRAPH_RESERVE_BYTES)
    # What the cache stores (kernels/kv_quant.py): the model's dtype, fp8 or int8; fp8 reads
    # the checkpoint's static scales (1.0 without them).
    kv_dtype = kv_quant.kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    static_scales = draft_scales = None
    if kv_dtype == torch.float8_e4m3fn:
        static_scales = (read_kv_scales(model_dir, model_cfg, tp_size(), tp_rank())
                         or default_scales(model_cfg, tp_size()))
        draft_scales = default_scales(draft_cfg, tp_size()) if draft_cfg is not None else None
    # Block ids are shared by every rank: the pool is the smallest rank's.
    # The draft model's KV cache has the target's blocks: the budget holds both.
    extra = bytes_per_block(draft_cfg, cfg.block_size, kv_dtype) if draft_cfg is not None else 0
    num_blocks = all_reduce_min(num_blocks_for(model_cfg, cfg.block_size, kv_dtype, device,
                                               cfg.num_kv_blocks, cfg.kv_cache_memory, profiled,
                                               extra),
                                device)
    kv_cache = KVCache.allocate(model_cfg, num_blocks, cfg.block_size, kv_dtype, device,
                                static_scales)
    kv_cache.bind(model)
    draft = None
    if draft_model is not None:
        draft_kv = KVCache.allocate(draft_cfg, num_blocks, cfg.block_size, kv_dtype, device,
                                    draft_scales)
        draft_kv.bind(draft_model)
        draft = DraftProposer(draft_model, draft_kv, cfg.num_draft_tokens, max_model_len, device)
    if device.type == "cuda":  # every attention variant compiled before the first request
        from executor_svc.step.warmup import warm_attention  # imports triton: CUDA only

        warm_attention(kv_cache.per_layer()[0], model_cfg.num_heads // tp_size(),
                       cfg.max_num_batched_tokens, dtype=dtype,  # this rank's q heads
                       softcap=model_cfg.attn_logit_softcapping > 0,
                       sinks=getattr(model, "has_sinks", False))
    num_swap_blocks = all_reduce_min(
        num_swap_blocks_for(cfg.swap_space,
                            bytes_per_block(model_cfg, cfg.block_size, kv_dtype)),
        device)
    swap_pool = SwapPool.allocate(kv_cache, num_swap_blocks) if num_swap_blocks else None
    num_host_blocks = all_reduce_min(
        num_host_blocks_for(cfg.kv_offloading_size,
                            bytes_per_block(model_cfg, cfg.block_size, kv_dtype)),
        device)
    host_tier = host_tier_records = None
    tier_path = cfg.kv_offloading_path
    if num_host_blocks and tier_path is not None:
        tier = open_tier_file(tier_path, tier_identity(
            model_name=model_dir.name, architecture=model_cfg.architecture,
            kv_dtype_name=kv_dtype_name(kv_dtype), kv_cache=kv_cache,
            block_size=cfg.block_size, num_slots=num_host_blocks,
            tensor_parallel_size=tp_size()), rank=tp_rank(), barrier=lambda: barrier(device))
        host_tier, host_tier_records = map_tier_file(tier, kv_cache, tp_rank())
    elif num_host_blocks:
        host_tier = SwapPool.allocate(kv_cache, num_host_blocks, what="prefix cache host tier")
    tokenizer_json = model_dir / "tokenizer.json"  # structured output's matchers read it
    graph_runner = None
    # After the KV cache: graphs bind it. A model may opt out (MoE: its expert routing reads
    # the chosen experts back on the host, which a captured graph cannot).
    if device.type == "cuda" and not cfg.enforce_eager and model.cuda_graphs:
        graph_runner = DecodeGraphRunner(model, cfg.max_num_seqs,
                                         -(-max_model_len // cfg.block_size), max_model_len,
                                         model_cfg.hidden_size, dtype, device,
                                         use_cuda_graphs=True,
                                         num_kv_groups=kv_cache.layout.num_groups)
        graph_runner.capture()
    runner = ModelRunner(model, kv_cache, cfg.block_size, max_model_len,
                         model_cfg.vocab_size, device, swap_pool,
                         tokenizer_json if tokenizer_json.is_file() else None, graph_runner,
                         draft, host_tier, host_tier_records)
    hello = Hello(
        protocol_version=PROTOCOL_VERSION,
        executor_id=f"{socket.gethostname()}-{os.getpid()}",
        model_name=model_dir.name,  # a name, never a path the scheduler would pass on
        architecture=model_cfg.architecture,
        vocab_size=model_cfg.vocab_size,
        max_model_len=max_model_len,
        block_size=cfg.block_size,
        num_kv_blocks=num_blocks,
        num_swap_blocks=num_swap_blocks,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        random_weights=has_random_weights(model_dir),
        tensor_parallel_size=tp_size(),
        num_draft_tokens=cfg.num_draft_tokens if draft is not None else 0,
        kv_windows=list(kv_cache.layout.windows),
        kv_cache_dtype=kv_dtype_name(kv_dtype),
        num_host_blocks=num_host_blocks,
    )
    return Executor(runner, hello)


def handshake(end: ExecutorEnd, hello: Hello, leader: Leader) -> int | None:
    """Send Hello until the scheduler answers: None once welcomed, else the exit code.

    A scheduler that is not there yet, a refusal that says "retry" (another executor is
    connected) and a lost connection all lead to the next Hello; only a final Reject or a
    Shutdown ends the executor."""
    attempt = 0
    while True:
        leader.heartbeat()
        sent = end.send(hello)  # False while no connection is up: nothing queues
        attempt += 1
        # The first Hello at INFO; retries while the scheduler is not up yet at DEBUG.
        (log.info if attempt == 1 else log.debug)(
            "hello sent" if sent else "waiting for the scheduler", attempt=attempt,
            num_kv_blocks=hello.num_kv_blocks, num_swap_blocks=hello.num_swap_blocks,
            max_model_len=hello.max_model_len)
        deadline = time.monotonic() + HELLO_RETRY_S
        while (left := deadline - time.monotonic()) > 0:
            msg = end.recv(timeout_ms=max(1, int(left * 1000)))
            match msg:
                case None:
                    break
                case Welcome(protocol_version=version):
                    log.info("welcomed by the scheduler", protocol_version=version)
                    return None
                case Reject(reason=reason, retry=True):
                    _warn_once("scheduler asks to retry", reason=reason)
                case Reject(reason=reason):
                    log.error("scheduler rejected this executor", reason=reason)
                    print(f"executor rejected by the scheduler: {reason}", file=sys.stderr)
                    return EXIT_REJECTED
                case Shutdown():
                    log.info("shutdown requested before the handshake completed")
                    return EXIT_OK
                case AuthFailed(reason=reason):
                    _warn_once("cannot connect to the scheduler", reason=reason, level="error")
                case SchedulerLost():
                    log.info("connection to the scheduler lost; retrying")
                case BadMessage(reason=reason):
                    log.error("undecodable message from the scheduler", error=reason)
                case _:
                    log.debug("ignoring message before the handshake",
                              message=type(msg).__name__)


def serve(end: ExecutorEnd, runner: ModelRunner, leader: Leader) -> int | None:
    """Answer plans until Shutdown (an exit code) or until the scheduler is lost (None: the
    caller drops every request and says Hello again, to this scheduler or its successor).
    With tensor parallelism, every plan is run on every rank (tp_worker.py)."""
    stats = _Stats()
    result_sent_at: float | None = None  # when the previous step's answer went out
    failed_req_ids: set[str] = set()  # of the previous step, if it failed
    while True:
        msg = end.recv(timeout_ms=int(STATS_INTERVAL_S * 1000))
        match msg:
            case None:
                leader.heartbeat()
                runner.settle_host_tier()
            case StepPlan():
                idle_s = 0.0 if result_sent_at is None else time.perf_counter() - result_sent_at
                if msg.reset:
                    runner.requests.clear()
                    failed_req_ids = set()
                plan = _without(msg, failed_req_ids)
                leader.step(plan)
                reply = _step(runner, plan, stats, idle_s)
                failed_req_ids = _scheduled_ids(msg) if isinstance(reply, ExecutorError) else set()
                end.send(reply)
                result_sent_at = time.perf_counter()
            case Shutdown():
                log.info("shutdown requested by the scheduler")
                leader.stop()
                return EXIT_OK
            case SchedulerLost():
                log.warning("lost the scheduler; dropping every request and reconnecting")
                return None
            case Reject(reason=reason):
                # The scheduler does not know this connection (it restarted, or declared us
                # lost after a step that took too long): start over with Hello.
                log.warning("the scheduler no longer knows this executor; reconnecting",
                            reason=reason)
                return None
            case Welcome():
                log.debug("extra welcome (answer to a resent hello)")
            case BadMessage(reason=reason):
                # No step id to answer with; the scheduler's own timeout has to notice.
                log.error("undecodable message from the scheduler", error=reason)
            case _:
                log.warning("ignoring unexpected message", message=type(msg).__name__)
        stats.maybe_log(len(runner.requests))


_warned: set[str] = set()


def _warn_once(event: str, level: str = "warning", **fields) -> None:
    """The handshake loop repeats every HELLO_RETRY_S: say each distinct thing once."""
    key = event + repr(sorted(fields.items()))
    if key not in _warned:
        _warned.add(key)
        getattr(log, level)(event, **fields)


def _scheduled_ids(plan: StepPlan) -> set[str]:
    return {r.req_id for r in plan.new_reqs} | {r.req_id for r in plan.cached_reqs}


def _without(plan: StepPlan, req_ids: set[str]) -> StepPlan:
    """`plan` less the requests of a step that failed (their state is gone; the scheduler
    fails them when it reads the ExecutorError, and names them in no later plan)."""
    if not req_ids or not (_scheduled_ids(plan) & req_ids):
        return plan
    log.info("skipping the requests of the failed step", num_requests=len(req_ids))
    return dataclasses.replace(
        plan, new_reqs=[r for r in plan.new_reqs if r.req_id not in req_ids],
        cached_reqs=[r for r in plan.cached_reqs if r.req_id not in req_ids])


def _step(runner: ModelRunner, plan: StepPlan, stats: _Stats,
          idle_s: float) -> StepResult | ExecutorError:
    structlog.contextvars.bind_contextvars(step=plan.step_id)
    try:
        out = runner.execute(plan)
    except GroupBroken:
        raise
    except Exception as e:
        log.exception("step failed")
        return ExecutorError(step_id=plan.step_id, message=f"{type(e).__name__}: {e}")
    finally:
        structlog.contextvars.unbind_contextvars("step")
    stats.add(out.num_tokens, len(out.sampled), out.execute_time_s)
    log.debug("step done", step=plan.step_id, num_tokens=out.num_tokens,
              num_sampled=len(out.sampled), execute_time_s=round(out.execute_time_s, 6))
    return StepResult(step_id=plan.step_id, sampled=out.sampled, execute_time_s=out.execute_time_s,
                      logprobs=out.logprobs, idle_time_s=idle_s,
                      sampled_logprobs=out.sampled_logprobs, prompt_logprobs=out.prompt_logprobs,
                      proposals=out.proposals)


class _Stats:
    """Counters behind the periodic INFO line."""

    def __init__(self) -> None:
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since = now
        self.num_steps = self.num_tokens = self.num_sampled = 0
        self.busy_s = 0.0

    def add(self, num_tokens: int, num_sampled: int, execute_time_s: float) -> None:
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.num_sampled += num_sampled
        self.busy_s += execute_time_s

    def maybe_log(self, num_requests: int) -> None:
        now = time.monotonic()
        if now - self.since < STATS_INTERVAL_S:
            return
        if self.num_steps:
            elapsed = now - self.since
            log.info("executor stats", steps=self.num_steps, num_requests=num_requests,
                     tokens_per_s=round(self.num_tokens / elapsed, 1),
                     sampled_per_s=round(self.num_sampled / elapsed, 1),
                     busy_fraction=round(self.busy_s / elapsed, 3))
        self._reset(now)


def run(cfg: ExecutorConfig, model_dir: Path) -> int:
    """Build, greet, serve; after losing the scheduler, drop every request and greet again. A
    `lifecycle.ShutdownRequested` raised by a signal anywhere in here passes through (the
    socket is closed on the way) to `cli.main()`."""
    try:
        secret = read_secret(cfg.channel_secret_file)
        keys = ChannelKeys.from_secret(secret) if secret is not None else None
        executor = build_executor(cfg, model_dir)
    except (ValueError, NotImplementedError, OSError) as e:
        # One line and no traceback: a bad checkpoint or flag is fixed by the operator, and
        # CheckpointError's text already starts with the file at fault.
        print(f"executor failed to start: {e}", file=sys.stderr)
        return EXIT_FAILED
    runner = executor.runner
    try:
        if tp_rank() != 0:  # a follower: rank 0 alone talks to the scheduler
            follow(runner.execute, runner.requests.clear, runner.device)
            return EXIT_OK
        end = ExecutorEnd(cfg.scheduler_address, keys)
        leader = Leader(runner.device)
        try:
            log.info("connecting to the scheduler", address=cfg.scheduler_address,
                     channel_authenticated=keys is not None, tensor_parallel_size=tp_size())
            while True:
                exit_code = handshake(end, executor.hello, leader)
                if exit_code is not None:
                    leader.stop()
                    return exit_code
                exit_code = serve(end, runner, leader)
                if exit_code is not None:
                    return exit_code
                runner.requests.clear()  # the next scheduler starts from nothing
                leader.clear()
        finally:
            end.close()
    except GroupBroken as e:
        log.error("a tensor-parallel rank failed; ending this executor so it is restarted",
                  error=str(e)[:500])
        return EXIT_FAILED


def kv_dtype_name(kv_dtype: torch.dtype) -> str:
    """What the KV cache stores, as Hello.kv_cache_dtype and the host tier file name it: the
    model's dtype ("bfloat16"...), "fp8_e4m3" or "int8"."""
    return str(kv_dtype).removeprefix("torch.").replace("float8_e4m3fn", "fp8_e4m3")
