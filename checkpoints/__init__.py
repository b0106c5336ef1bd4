"""Where a model comes from: a checkpoint directory's files and their checks, `--model`
resolution (directories, GGUF files, hub ids), the named models, the quantization scheme a
checkpoint declares, its RoPE and the context that implies, and the GGUF converter. Both services import it, the scheduler before it
serves and the executor before its torch import.

May import: the standard library, numpy, safetensors (its numpy API), tokenizers, gguf,
huggingface_hub, structlog, tqdm, and transformers only inside the GGUF converter's tokenizer
step (`gguf/hf_tokenizer.py`, which the scheduler runs in a subprocess). Never torch, triton,
`kernels`, `scheduler_svc` or `executor_svc`, not even lazily (tests/test_boundaries.py).

Modules: `files.py` (checkpoint files checked without torch, CheckpointError), `resolve.py`
(a --model value -> a local directory), `named_models.py` (the default model, folio: names),
`tiny_random.py` (folio:tiny-random, built once), `quant_config.py` (quantization schemes),
`rope.py` (RoPE specs, the model's context), `config_fields.py` (typed config.json reads),
`cache_dir.py` ($FOLIO_CACHE_DIR), `gguf/` (GGUF file -> cached checkpoint directory).
"""
