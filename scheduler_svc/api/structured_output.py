"""Structured output at the front door: read the public oneof, check the constraint compiles.

The scheduler only validates; the executor compiles each constraint again against the model's
tokenizer and keeps one matcher per request (``executor_svc/sample/structured.py``). Validation uses
llguidance, which needs no torch (its ``torch`` and ``hf`` submodules are never imported here),
and no tokenizer: a constraint that llguidance accepts here compiles in the executor.

Validating can take milliseconds to seconds for a large schema, so it runs on a small thread
pool (llguidance drops the GIL while it compiles), never on the event loop; results, errors
included, are cached by (kind, text), so a schema sent again is checked once.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import llguidance

from protos.folio.v1 import generator_pb2 as pb
from protos.sampling_spec import StructuredSpec
from protos.structured_grammar import llguidance_grammar
from scheduler_svc.errors import InvalidRequest

# A constraint is compiled per request in the executor: keep it to what a schema needs.
MAX_STRUCTURED_CHARS = 1 << 20
MAX_CHOICES = 1024
CACHE_SIZE = 256  # distinct (kind, text) validation results kept
NUM_THREADS = 2

def structured_from_proto(p: pb.SamplingParams, is_beam_search: bool) -> StructuredSpec | None:
    """The request's constraint with the cheap checks done (sizes, beam search); None when it
    has none. eos_token_ids are filled in by `StructuredValidator.check`."""
    kind = p.WhichOneof("structured_output")
    if kind is None:
        return None
    if kind == "json_object" and not p.json_object:
        return None  # json_object = false asks for nothing
    if is_beam_search:
        raise InvalidRequest(f"structured output ({kind}) cannot be combined with beam search; "
                             "use beam_width 1 (n > 1 samples several constrained sequences)")
    match kind:
        case "choice":
            choices = list(p.choice.choices)
            if not 1 <= len(choices) <= MAX_CHOICES:
                raise InvalidRequest(f"choice must hold 1 to {MAX_CHOICES} strings, "
                                     f"got {len(choices)}")
            if not all(choices):
                raise InvalidRequest("choice holds an empty string; every choice needs at "
                                     "least one character")
            text = json.dumps(choices)
        case "json_object":
            text = ""
        case _:
            text = getattr(p, kind)
            if not text:
                raise InvalidRequest(f"{kind} is empty; send the {kind.replace('_', ' ')} "
                                     "or leave the field unset")
    if len(text) > MAX_STRUCTURED_CHARS:
        raise InvalidRequest(f"{kind} may have at most {MAX_STRUCTURED_CHARS} characters, "
                             f"got {len(text)}")
    return StructuredSpec(kind=kind, text=text)


def _validate(kind: str, text: str) -> str:
    """'' when llguidance accepts the constraint, else its message."""
    try:
        grammar = llguidance_grammar(kind, text)
    except Exception as e:  # llguidance's own readers raise ValueError; anything is the text's
        return str(e) or type(e).__name__
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""


class StructuredValidator:
    """Checks constraints off the event loop, with a cache of the results by (kind, text).

    Invariant: the cache holds at most CACHE_SIZE entries, least recently used dropped first;
    an entry is the validation result, '' for a valid constraint."""

    def __init__(self, eos_token_ids: frozenset[int]):
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._pool = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="folio-grammar")
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.num_compiled = 0  # validations run (cache misses), for tests and stats

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def check(self, spec: StructuredSpec) -> StructuredSpec:
        """`spec` with the model's EOS ids; InvalidRequest quoting llguidance's message when
        the constraint does not compile."""
        key = (spec.kind, spec.text)
        error = self._cache.get(key)
        if error is None:
            error = await asyncio.get_running_loop().run_in_executor(
                self._pool, _validate, spec.kind, spec.text)
            self.num_compiled += 1
            self._cache[key] = error
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if error:
            raise InvalidRequest(f"invalid {spec.kind.replace('_', ' ')}: {error}")
        return StructuredSpec(kind=spec.kind, text=spec.text, eos_token_ids=self.eos_token_ids)
