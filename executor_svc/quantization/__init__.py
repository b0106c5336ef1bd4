"""Quantized linear weights in the executor: their linear methods (methods.py), the loader's
part (loading.py), GPTQ/AWQ and GGUF block unpacking. Which scheme a checkpoint uses is read
without torch in checkpoints/quant_config.py; the modules here all need torch."""
