"""From logits to token ids: the sampler (greedy, temperature, top-k/top-p/min-p, seeded
draws), the logits processors and their per-row state, and structured-output matchers."""
