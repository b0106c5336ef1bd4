"""Text: the tokenizer (and where a model's tokenizer comes from), the incremental detokenizer
and stop strings. It imports nothing else of the service."""
