"""Tensor parallelism: torch.distributed set-up, the worker ranks that follow rank 0's steps,
and launching the ranks of one node."""
