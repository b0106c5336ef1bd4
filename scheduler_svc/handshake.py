"""Checking an executor's Hello, and the model facts the scheduler keeps from it."""

from __future__ import annotations

from dataclasses import dataclass

from protos.plan import PROTOCOL_VERSION, Hello
from scheduler_svc.tokenizer import Tokenizer


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

    @classmethod
    def from_hello(cls, identity: bytes, hello: Hello, max_model_len_cap: int | None
                   ) -> ExecutorInfo:
        # A sequence running alone must fit in the pool, or it would preempt itself forever.
        max_model_len = min(hello.max_model_len, hello.num_kv_blocks * hello.block_size)
        if max_model_len_cap is not None:
            max_model_len = min(max_model_len, max_model_len_cap)
        return cls(identity=identity, executor_id=hello.executor_id,
                   model_name=hello.model_name, architecture=hello.architecture,
                   vocab_size=hello.vocab_size, max_model_len=max_model_len,
                   block_size=hello.block_size, num_kv_blocks=hello.num_kv_blocks,
                   dtype=hello.dtype, device=hello.device,
                   random_weights=bool(hello.random_weights))


def check_hello(hello: Hello, tokenizer: Tokenizer) -> str | None:
    """None if the executor can serve this scheduler, else the reason for an operator."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return (f"executor speaks protocol v{hello.protocol_version}, this scheduler "
                f"v{PROTOCOL_VERSION}; run matching versions")
    if hello.block_size < 1 or hello.num_kv_blocks < 1:
        return (f"executor reported {hello.num_kv_blocks} KV blocks of {hello.block_size} "
                "tokens; it needs at least one block (give it more --kv-cache-memory)")
    if hello.max_model_len < 2 or hello.num_kv_blocks * hello.block_size < 2:
        return (f"executor can hold only {hello.num_kv_blocks * hello.block_size} tokens of KV "
                f"(max_model_len {hello.max_model_len}); a request needs at least 2")
    if tokenizer.vocab_size > hello.vocab_size:
        return (f"the scheduler's tokenizer has {tokenizer.vocab_size} tokens but the "
                f"executor's model only {hello.vocab_size}; start both on the same model")
    return None
