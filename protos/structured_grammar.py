"""What a StructuredSpec means: the llguidance grammar each kind of constraint becomes.

Shared by both services (llguidance imports no torch): the scheduler validates the grammar at
the front door (``scheduler_svc/api/structured_output.py``), the executor builds its matchers from
the same grammar (``executor_svc/sample/structured.py``), so what was accepted is what runs.
"""

from __future__ import annotations

import llguidance

# What the matcher in the executor is built from, for each kind (llguidance's format names).
# json_object is the schema of "any object"; choice's text is the JSON list of the choices.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON output without free whitespace between tokens: xgrammar's any_whitespace=False.
# With llguidance's default (any whitespace), small models can loop on spaces and newlines
# until max_tokens. A schema's own "x-guidance" options override this.
JSON_DEFAULTS = {"whitespace_flexible": False}


def llguidance_grammar(kind: str, text: str) -> str:
    """The llguidance grammar for a constraint; ValueError with the library's message when the
    text cannot even be read (not JSON, GBNF naming an unknown rule...). Used by both services:
    the scheduler validates its result, the executor builds matchers from it."""
    match kind:
        case "json_schema" | "json_object":
            schema = JSON_OBJECT_SCHEMA if kind == "json_object" else text
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        case "regex":
            return llguidance.grammar_from("regex", text)
        case "grammar":
            return llguidance.grammar_from("grammar", text)
        case "choice":
            return llguidance.grammar_from("choice", text)
    raise ValueError(f"unknown structured output kind {kind!r}")
