"""The null-model executor: a peer process that speaks the step-plan protocol but runs no model.

    python -m bench.null_executor ADDRESS NUM_KV_BLOCKS

Used by bench/scheduler.py to measure the scheduler and the channel alone. It answers each
StepPlan with a StepResult holding one token for each request that samples, and imports protos
only, never torch (it exits 3 if torch was loaded).
"""

from __future__ import annotations

import os
import sys

from protos.channel import ExecutorEnd
from protos.plan import PROTOCOL_VERSION, Hello, Shutdown, StepPlan, StepResult, Welcome

BLOCK_SIZE = 16
VOCAB_SIZE = 128256  # Llama-3.1's, so token ids take their real msgpack widths
MODEL_MAX_LEN = 131072
PEER_TIMEOUT_MS = 60_000


def null_executor(address: str, num_kv_blocks: int) -> int:
    """Serve step plans without a model. Exit 0 after Shutdown, 2 on a protocol failure or a
    silent scheduler, 3 if torch was imported (this process must measure the channel only)."""
    end = ExecutorEnd(address)
    try:
        if not end.wait_connected(PEER_TIMEOUT_MS):
            return 2
        end.send(Hello(protocol_version=PROTOCOL_VERSION,
                       executor_id=f"null-executor-{os.getpid()}", model_name="null-model",
                       architecture="NullModelExecutor", vocab_size=VOCAB_SIZE,
                       max_model_len=MODEL_MAX_LEN, block_size=BLOCK_SIZE,
                       num_kv_blocks=num_kv_blocks,
                       num_swap_blocks=0, dtype="none", device="cpu",
                       random_weights=True))  # fmt: skip
        if not isinstance(end.recv(PEER_TIMEOUT_MS), Welcome):
            return 2
        num_tokens: dict[str, int] = {}  # tokens held per request, as a real executor counts
        while True:
            match end.recv(PEER_TIMEOUT_MS):
                case StepPlan() as plan:
                    end.send(null_step(plan, num_tokens))
                case Shutdown():
                    return 3 if "torch" in sys.modules else 0
                case _:
                    return 2
    finally:
        end.close()


def null_step(plan: StepPlan, num_tokens: dict[str, int]) -> StepResult:
    """One token for each request whose scheduled tokens reach the end of what it holds (the
    protocol's sampling rule); requests mid-way through a prompt sample nothing."""
    for req_id in plan.finished_req_ids + plan.preempted_req_ids:
        num_tokens.pop(req_id, None)
    reached: list[tuple[str, int]] = []
    for new in plan.new_reqs:
        num_tokens[new.req_id] = len(new.token_ids)
        reached.append((new.req_id, new.num_computed_tokens + new.num_scheduled_tokens))
    for cached in plan.cached_reqs:
        num_tokens[cached.req_id] += len(cached.new_token_ids)
        reached.append((cached.req_id, cached.num_computed_tokens + cached.num_scheduled_tokens))
    sampled: list[tuple[str, list[int]]] = []
    for req_id, num_done in reached:
        if num_done == num_tokens[req_id]:
            # Any id will do; varying it keeps the requests' block keys distinct.
            sampled.append((req_id, [(num_done * 7919 + len(sampled)) % VOCAB_SIZE]))
            num_tokens[req_id] += 1  # append_sampled: the executor keeps what it samples
    return StepResult(step_id=plan.step_id, sampled=sampled)



if __name__ == "__main__":
    sys.exit(null_executor(sys.argv[1], int(sys.argv[2])))
