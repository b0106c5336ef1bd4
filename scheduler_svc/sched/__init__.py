"""Continuous batching and KV memory: the Scheduler (its state, step building, step results),
requests and sequence groups (n > 1, beam search), preemption, speculative proposals, the block
manager and the prefix cache. Pure bookkeeping over token ids: it imports `protos`, the
service's `config` (the preemption modes) and its own modules; never the engine, API or text."""
