"""Continuous batching and KV memory: the Scheduler, which plans steps over the parts it owns
(its request queues, its view of the executor, the block manager, the applying of step results
and its counters), requests and sequence groups (n > 1, beam search), preemption, speculative
proposals and the prefix cache. Pure bookkeeping over token ids: it imports `protos`, the
service's `config` (the preemption modes) and its own modules; never the engine, API or text."""
