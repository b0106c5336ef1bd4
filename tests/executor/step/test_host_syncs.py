"""The step's one host sync: every call in executor_svc that would block the host on a GPU
(a read of a device tensor's values, or a host-to-device copy that is not pinned and
non_blocking) is counted while the runner executes steps on the CPU, through a
TorchFunctionMode that sees every torch call. Each step may make one: the transfer of its
sampled ids (and the logprobs asked for). kernels/cpu/ never runs on CUDA, so calls from it
are not counted; the executor's own files are."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

import executor_svc
from executor_svc.kv.kv_cache import to_device
from executor_svc.sample.sampler import SamplingBatch
from protos.plan import CachedRequest
from protos.sampling_spec import SamplingSpec
from tests.executor.harness import PlanDriver, make_runner

EXECUTOR_DIR = str(Path(executor_svc.__file__).parent)
# Tensor methods that read device values back to the host (or sync to find an output size).
READS = {"item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero",
         "masked_select", "unique", "numpy"}


class HostSyncCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = sys._getframe(1)
        where = frame.f_code.co_filename
        if where.startswith(EXECUTOR_DIR):
            name = getattr(func, "__name__", str(func))
            blocking_copy = (name in ("to", "copy_") and not kwargs.get("non_blocking")
                             and not (args and isinstance(args[0], torch.Tensor)
                                      and args[0].is_pinned()) and _names_a_device(args, kwargs))
            creates_on_device = name in ("tensor", "as_tensor") and "device" in kwargs
            if (name in READS and not _host_only(name, args)) or blocking_copy or creates_on_device:
                self.calls.append(f"{name} at {Path(where).name}:{frame.f_lineno}")
        return func(*args, **kwargs)


def _host_only(name: str, args) -> bool:
    # .numpy() raises on a CUDA tensor rather than syncing: it only ever reads host buffers.
    return name == "numpy"


def _names_a_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])


def test_every_step_makes_at_most_the_one_transfer_of_sampled_ids(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir, num_swap_blocks=16)
    d = PlanDriver(seed=3)
    specs = {"greedy": SamplingSpec(temperature=0.0),
             "lp": SamplingSpec(temperature=0.8, top_p=0.9, seed=7, num_logprobs=3,
                                sampled_logprob=True),
             "proc": SamplingSpec(top_k=5, repetition_penalty=1.3, presence_penalty=0.5,
                                  min_p=0.05, logit_bias=((3, 2.0),), bad_words=((4, 5),),
                                  min_tokens=2, min_tokens_stop_ids=(1,))}
    counter = HostSyncCounter()
    per_step: list[list[str]] = []

    def step(**kwargs) -> None:
        with counter:
            out = runner.execute(d.plan(**kwargs))
        per_step.append(list(counter.calls))
        counter.calls.clear()
        d.record(out.sampled)

    step(new_reqs=[d.new(r, list(range(10 + i, 19 + 2 * i)), 9 + i, specs[r])
                   for i, r in enumerate(specs)])
    for _ in range(3):
        step(cached_reqs=d.decode_all(list(specs)))
    lp_tokens = runner.requests["lp"].token_ids  # all it holds, the last one sampled
    step(preempted_req_ids=["lp"], swap_out=d.swap_out("lp", [0, 1, 2, 3]),
         cached_reqs=d.decode_all(["greedy", "proc"]),
         block_copies=[(d.block_ids["greedy"][0], d.free[0])])
    pairs, new = d.swap_in("lp", [0, 1, 2, 3], lp_tokens, specs["lp"])
    step(swap_in=pairs, new_reqs=[new], cached_reqs=d.decode_all(["greedy", "proc"]))
    assert len(per_step) == 6
    for calls in per_step:
        assert len(calls) == 1, calls
        assert calls[0].startswith("cpu at outputs.py"), calls


def test_the_counter_sees_reads_and_blocking_copies():
    counter = HostSyncCounter()
    with counter:  # from_specs builds with torch.tensor(..., device=): three blocking copies
        batch = SamplingBatch.from_specs([SamplingSpec(top_p=0.5, seed=1)], [4],
                                         torch.device("cpu"))
        to_device(np.arange(3), torch.device("cpu"))  # the runner's helper: not counted
    assert len(counter.calls) == 6 and all("sampler.py" in c for c in counter.calls)
    assert batch.num_rows == 1


def test_a_step_verifying_proposals_makes_the_one_transfer_too(checkpoint_cache):
    """Verification's verdict crosses with the sampled ids (a greedy and a seeded row, one
    logprobs row beside them that carries no proposals)."""
    _, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir)
    d = PlanDriver(seed=4)
    specs = {"greedy": SamplingSpec(temperature=0.0),
             "seeded": SamplingSpec(temperature=0.8, top_p=0.9, seed=7),
             "lp": SamplingSpec(temperature=0.0, num_logprobs=2, sampled_logprob=True)}
    out = runner.execute(d.plan(new_reqs=[d.new(r, list(range(10 + i, 19 + i)), 9, specs[r])
                                          for i, r in enumerate(specs)]))
    d.record(out.sampled)
    cached = d.decode_all(["lp"])
    for req_id in ("greedy", "seeded"):
        computed = d.num_computed[req_id]
        new = d._grow(req_id, computed + 3)
        cached.append(CachedRequest(req_id=req_id, new_block_ids=new, num_computed_tokens=computed,
                                    num_scheduled_tokens=3, spec_token_ids=[5, 6]))
    counter = HostSyncCounter()
    with counter:
        out = runner.execute(d.plan(cached_reqs=cached))
    assert sorted(r for r, _ in out.sampled) == sorted(specs)
    assert len(counter.calls) == 1, counter.calls
    assert counter.calls[0].startswith("cpu at outputs.py"), counter.calls
