"""The KV cache: its blocks per layer, swapping blocks to and from the CPU pool, and how much
memory it may take (a profiling step)."""
