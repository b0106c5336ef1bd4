"""Folio's executor: runs the model over a paged KV cache, one scheduler step plan at a time."""
