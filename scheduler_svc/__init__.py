"""Folio's scheduler process: gRPC API, tokenization, continuous batching, KV block tables.

Never imports torch, triton, kernels or executor_svc (see tests/test_boundaries.py).
"""
