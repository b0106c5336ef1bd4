"""Where a model comes from and how it gets onto the device: checkpoint directories, config
facts, the named and default models, and the loader (weights, quantization, device prep)."""
