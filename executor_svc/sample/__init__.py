"""From logits to token ids: the sampler (greedy, temperature, top-k/top-p/min-p, seeded
draws, logprobs), the logits processors and their per-row state, and structured-output
matchers. It sits below `step/` and `spec/` and imports neither."""
