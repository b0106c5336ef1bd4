"""The scheduler's side of structured output: reading the oneof, the cheap limits, and the
validator (llguidance, off the event loop, cached by (kind, text))."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from protos.folio.v1 import generator_pb2 as pb
from protos.sampling_spec import StructuredSpec
from scheduler_svc.api.structured_output import (
    MAX_CHOICES,
    StructuredValidator,
    structured_from_proto,
)
from scheduler_svc.errors import InvalidRequest


def params(**kwargs) -> pb.SamplingParams:
    p = pb.SamplingParams()
    for name, value in kwargs.items():
        if name == "choice":
            p.choice.choices.extend(value)
        else:
            setattr(p, name, value)
    return p


def test_the_oneof_becomes_a_spec():
    assert structured_from_proto(params(), False) is None
    assert structured_from_proto(params(json_object=False), False) is None
    assert structured_from_proto(params(json_object=True), False) == \
        StructuredSpec(kind="json_object", text="")
    assert structured_from_proto(params(regex="a+"), False) == StructuredSpec(kind="regex",
                                                                              text="a+")
    spec = structured_from_proto(params(choice=["x", "y z"]), False)
    assert spec.kind == "choice" and json.loads(spec.text) == ["x", "y z"]


@pytest.mark.parametrize("kwargs, beam, says", [
    (dict(regex="a"), True, "beam search"),
    (dict(choice=[]), False, "1 to"),
    (dict(choice=["a"] * (MAX_CHOICES + 1)), False, "1 to"),
    (dict(choice=["a", ""]), False, "empty string"),
    (dict(json_schema=""), False, "empty"),
    (dict(grammar="x" * ((1 << 20) + 1)), False, "at most"),
])
def test_cheap_limits(kwargs, beam, says):
    with pytest.raises(InvalidRequest, match=says):
        structured_from_proto(params(**kwargs), beam)


async def test_validator_refuses_with_the_library_message_and_caches():
    validator = StructuredValidator(frozenset({2, 0}))
    try:
        good = StructuredSpec(kind="json_schema", text='{"type": "object"}')
        checked = await asyncio.gather(*(validator.check(good) for _ in range(3)))
        assert all(c.eos_token_ids == (0, 2) for c in checked)  # the model's EOS ids, sorted
        compiled = validator.num_compiled
        assert await validator.check(good) == checked[0]
        assert validator.num_compiled == compiled  # a hit: not compiled again
        bad = StructuredSpec(kind="regex", text="[z-a]")
        for _ in range(2):
            with pytest.raises(InvalidRequest, match="(?s)invalid regex: .*invalid character class range"):
                await validator.check(bad)
        assert validator.num_compiled == compiled + 1  # errors are cached too
        with pytest.raises(InvalidRequest, match="invalid grammar"):
            await validator.check(StructuredSpec(kind="grammar", text="root ::= nope"))
        assert (await validator.check(StructuredSpec(kind="grammar", text='start: "a" | "b"'))).text
    finally:
        validator.close()


def test_validation_imports_no_torch():
    code = ("import sys, asyncio; from scheduler_svc.api.structured_output import *; "
            "from protos.sampling_spec import StructuredSpec; v = StructuredValidator(frozenset({1})); "
            "asyncio.run(v.check(StructuredSpec(kind='json_schema', text='{\"type\": \"object\"}'))); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'executor_svc')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
