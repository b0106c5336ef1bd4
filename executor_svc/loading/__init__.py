"""How a checkpoint gets onto the device: config facts the models build from (model_config.py)
and the loader (weights, quantization, device prep). Where a model comes from, and the checks
that need no torch, are in the shared `checkpoints` package."""
