"""Quantized linear weights: the schemes (config.py, no torch), their linear methods
(methods.py) and the loader's part (loading.py). Import the torch modules directly; this
package's root stays importable before torch."""

from executor_svc.quantization.config import SCHEMES, QuantConfig, resolve_quant_config

__all__ = ["SCHEMES", "QuantConfig", "resolve_quant_config"]
