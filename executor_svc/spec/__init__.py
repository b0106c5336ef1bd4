"""Speculative decoding on the executor: the draft model that proposes, and the verifier that
accepts proposals while they equal what plain decoding would draw and settles their rows."""
