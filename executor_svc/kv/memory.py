"""How much device memory the KV cache may take: measured by a profiling step, not guessed.

On CUDA, before the cache exists, the runner executes one step of the largest shape the
scheduler may send (``max_num_batched_tokens`` tokens over ``min(max_num_seqs, tokens)``
sequences, every sequence sampling with top-k/top-p and top logprobs, so the sampler's sort and
log-softmax run on that many rows) and the allocator's peak is read. The cache then gets::

    total * gpu_memory_utilization
      - used before the profile   (weights, CUDA context, compiled modules, other processes)
      - activation peak           (max_memory_allocated during the step - allocated before it)
      - graph reserve             (the CUDA graph pool; a parameter the graph runner feeds)

The profiling step runs over a one-block KV cache: every block id in its plan is 0, so its
stores and attention reads stay inside that block (the values are garbage; only the memory
counts). Its tokens are id 0.

On the CPU the cache keeps its flag-given budget (``--kv-cache-memory``, default 1 GiB): host
memory is not partitioned like a GPU's, and a full-size prefill at start-up costs seconds on a
small machine. `profile_step` runs there too (tests run it at a small size), with the process's
peak resident size as its allocator statistics; `cuda_memory` holds the only CUDA-only lines.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from executor_svc.kv.kv_cache import KVCache
from executor_svc.loading.model_config import ModelConfig
from executor_svc.step.runner import ModelRunner
from protos.plan import NewRequest, SamplingSpec, StepPlan

log = structlog.get_logger(__name__)

MIB = 1 << 20
# The CUDA graph pool's share until the graph runner measures its own: vLLM's captures of
# 67 batch sizes for 8B-class models take 0.3-1 GiB; decode graphs over fewer sizes take less.
DEFAULT_GRAPH_RESERVE_BYTES = 512 * MIB
PROFILE_REQ_PREFIX = "__profile-"


@dataclass(frozen=True)
class MemorySnapshot:
    total: int  # bytes of the device
    free: int  # bytes nobody holds (the driver's view)
    allocated: int  # bytes held by this process's tensors now
    peak_allocated: int  # the most held since the last peak reset


@dataclass(frozen=True)
class MemoryProfile:
    total: int
    used_before: int  # total - free before the profiling step
    activation_peak: int  # peak allocated during the step - allocated before it

    def kv_cache_budget(self, gpu_memory_utilization: float, graph_reserve_bytes: int) -> int:
        """Bytes for the KV cache; ValueError (with what to change) when nothing is left."""
        budget = (int(self.total * gpu_memory_utilization) - self.used_before
                  - self.activation_peak - graph_reserve_bytes)
        if budget <= 0:
            raise ValueError(
                f"no device memory is left for the KV cache: {gpu_memory_utilization:g} of "
                f"{self.total / MIB:.0f} MiB, less {self.used_before / MIB:.0f} MiB in use "
                f"(weights and other processes), a {self.activation_peak / MIB:.0f} MiB "
                f"activation peak and a {graph_reserve_bytes / MIB:.0f} MiB graph reserve; "
                "raise --gpu-memory-utilization, lower --max-num-batched-tokens or "
                "--max-num-seqs, or use a smaller model or dtype")
        return budget


def cuda_memory(device: torch.device) -> MemorySnapshot:
    """The allocator's and the driver's view of one CUDA device (the CUDA-only lines)."""
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(total, free, torch.cuda.memory_allocated(device),
                          torch.cuda.max_memory_allocated(device))


def host_memory() -> MemorySnapshot:
    """The CPU stand-in: physical memory, and this process's current and peak resident size
    (the peak never resets, so a CPU profile can only over-count)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    free = os.sysconf("SC_AVPHYS_PAGES") * page
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return MemorySnapshot(total, free, resident, max(peak, resident))


def snapshot_for(device: torch.device) -> Callable[[], MemorySnapshot]:
    if device.type == "cuda":
        return lambda: cuda_memory(device)
    return host_memory


def profile_plan(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, vocab_size: int, num_kv_groups: int = 1) -> StepPlan:
    """The largest step the scheduler may send, as new requests over block 0 only."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    per_seq = min(max_model_len, max(1, max_num_batched_tokens // num_seqs))
    lens = [per_seq] * num_seqs
    spare = min(max_num_batched_tokens - per_seq * num_seqs, num_seqs * (max_model_len - per_seq))
    for i in range(max(spare, 0)):  # the remainder, one token each, within max_model_len
        lens[i % num_seqs] += 1
    sampling = SamplingSpec(temperature=1.0, top_p=0.9, top_k=50,
                            num_logprobs=min(20, vocab_size))
    reqs = [NewRequest(req_id=f"{PROFILE_REQ_PREFIX}{i}", token_ids=[0] * n, sampling=sampling,
                       block_ids=[0] * (num_kv_groups * -(-n // block_size)),
                       num_computed_tokens=0, num_scheduled_tokens=n) for i, n in enumerate(lens)]
    return StepPlan(step_id=-1, new_reqs=reqs)


def profile_step(execute: Callable[[StepPlan], object], plan: StepPlan,
                 snapshot: Callable[[], MemorySnapshot], device: torch.device) -> MemoryProfile:
    """Run `plan` through `execute` (a runner over a one-block cache) and measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # cached blocks would count as "used before"
        torch.cuda.reset_peak_memory_stats(device)
    before = snapshot()
    execute(plan)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    after = snapshot()
    profile = MemoryProfile(before.total, before.total - before.free,
                            max(0, after.peak_allocated - before.allocated))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the step's activations go back to the driver for the cache
    log.info("memory profiled", num_tokens=sum(r.num_scheduled_tokens for r in plan.new_reqs),
             num_seqs=len(plan.new_reqs), total_mib=profile.total // MIB,
             used_before_mib=profile.used_before // MIB,
             activation_peak_mib=profile.activation_peak // MIB)
    return profile


def profiled_kv_budget(model: torch.nn.Module, cfg: ModelConfig, *, block_size: int,
                       max_model_len: int, dtype: torch.dtype, device: torch.device,
                       max_num_batched_tokens: int, max_num_seqs: int,
                       gpu_memory_utilization: float, graph_reserve_bytes: int) -> int:
    """Bind a one-block cache and run the profiling step: the KV cache's byte budget. The
    caller binds the real cache next (the scratch block stays bound until then)."""
    scratch = KVCache.allocate(cfg, 1, block_size, dtype, device)
    scratch.bind(model)
    runner = ModelRunner(model, scratch, block_size, max_model_len, cfg.vocab_size, device)
    plan = profile_plan(max_num_batched_tokens, max_num_seqs, max_model_len, block_size,
                        cfg.vocab_size, scratch.layout.num_groups)
    try:
        profile = profile_step(runner.execute, plan, snapshot_for(device), device)
    finally:
        runner.reset()
    return profile.kv_cache_budget(gpu_memory_utilization, graph_reserve_bytes)
