"""The step-plan wire format and the committed gRPC stubs."""

from __future__ import annotations

import ast
import dataclasses
import filecmp
import importlib.util
from pathlib import Path

import msgpack
import pytest

from protos.channel import ProtocolError, decode, encode
from protos.plan import (
    PROTOCOL_VERSION,
    CachedRequest,
    ExecutorError,
    Hello,
    NewRequest,
    PromptLogprobs,
    Reject,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
)
from protos.sampling_spec import SamplingSpec, StructuredSpec

ROOT = Path(__file__).resolve().parents[2]

MESSAGES = [
    Hello(protocol_version=PROTOCOL_VERSION, executor_id="exec-1", model_name="tiny",
          architecture="LlamaForCausalLM", vocab_size=32000, max_model_len=4096, block_size=16,
          num_kv_blocks=1234, num_swap_blocks=64,
          dtype="bfloat16", device="cuda:0", random_weights=True, tensor_parallel_size=4,
          num_draft_tokens=3, num_host_blocks=5000),
    Welcome(protocol_version=PROTOCOL_VERSION),
    Reject(reason="executor speaks protocol v9, this scheduler v1"),
    StepPlan(step_id=0),
    StepPlan(
        step_id=17,
        new_reqs=[
            NewRequest(req_id="r1", token_ids=[1, 2, 3, 4], sampling=SamplingSpec(), block_ids=[7],
                       num_computed_tokens=0, num_scheduled_tokens=4),
            NewRequest(req_id="r2", token_ids=list(range(40)),
                       sampling=SamplingSpec(temperature=0.7, top_p=0.9, top_k=50, seed=2**63 - 1),
                       block_ids=[3, 9, 4],
                       num_computed_tokens=16, num_scheduled_tokens=24),
            NewRequest(req_id="b0", token_ids=[5, 6], sampling=SamplingSpec(temperature=0.0,
                                                                            num_logprobs=8,
                                                                            append_sampled=False),
                       block_ids=[1], num_computed_tokens=1, num_scheduled_tokens=1),
            # A resumed request with every logits processor: 3 prompt tokens, 2 outputs.
            NewRequest(req_id="p0", token_ids=[5, 6, 7, 8, 9], sampling=SamplingSpec(
                temperature=0.8, seed=3, min_tokens=4, min_tokens_stop_ids=(2, 7),
                repetition_penalty=1.3,
                presence_penalty=-0.5, frequency_penalty=2.0, min_p=0.05,
                logit_bias=((4, -100.0), (9, 2.5)), allowed_token_ids=(4, 5, 9),
                bad_words=((8,), (6, 7, 8))), block_ids=[2], num_computed_tokens=0,
                num_scheduled_tokens=5, num_prompt_tokens=3),
        ],
        cached_reqs=[CachedRequest(req_id="r0", new_block_ids=[], num_computed_tokens=33,
                                   num_scheduled_tokens=1),
                     CachedRequest(req_id="r3", new_block_ids=[12], num_computed_tokens=48,
                                   num_scheduled_tokens=1),
                     CachedRequest(req_id="b1", new_block_ids=[], num_computed_tokens=7,
                                   num_scheduled_tokens=1, new_token_ids=[901]),
                     CachedRequest(req_id="s0", new_block_ids=[13], num_computed_tokens=60,
                                   num_scheduled_tokens=4, new_token_ids=[],
                                   spec_token_ids=[5, 6, 7])],  # three proposals
        finished_req_ids=["r4", "r5"],
        preempted_req_ids=["r6"],
        block_copies=[(1, 2), (5, 6)],
        swap_out=[(8, 0)],
        swap_in=[(1, 10)],
        offload_out=[(4, 300), (5, 301)],
        offload_in=[(12, 9)],
        offload_keys=["0f" * 32, "a1" * 34],
    ),
    # Structured output, and a resume: tokens past num_prompt_tokens were generated.
    StepPlan(step_id=18, new_reqs=[
        NewRequest(req_id="g0", token_ids=[5, 6, 7], sampling=SamplingSpec(
            structured=StructuredSpec(kind="json_schema", text='{"type": "object"}',
                                      eos_token_ids=(2, 7))),
            block_ids=[1], num_computed_tokens=0, num_scheduled_tokens=3, num_prompt_tokens=2),
        NewRequest(req_id="g1", token_ids=[5], sampling=SamplingSpec(
            temperature=0.0, structured=StructuredSpec(kind="choice", text='["a"]')),
                   block_ids=[1], num_computed_tokens=0, num_scheduled_tokens=1),
    ]),
    StepPlan(step_id=19, new_reqs=[NewRequest(
        req_id="p", token_ids=[5, 6, 7],
        sampling=SamplingSpec(num_logprobs=2, sampled_logprob=True, prompt_logprobs=0,
                              processed_logprobs=True),
        block_ids=[2], num_computed_tokens=0, num_scheduled_tokens=3)]),
    StepResult(step_id=17, sampled=[("r1", [42]), ("r0", [7, 8])], execute_time_s=0.0123,
               logprobs=[("b0", [3, 1], [-0.25, -1.5])]),
    StepResult(step_id=18),
    StepResult(step_id=19, sampled=[("p", [4]), ("q", [9])], execute_time_s=0.5,
               logprobs=[("p", [4, 2], [-0.5, -1.0])], idle_time_s=0.01,
               sampled_logprobs=[("p", -0.5, 1), ("q", -7.25, 130)],
               prompt_logprobs=[PromptLogprobs(req_id="p", start=1, token_logprobs=[-2.0, -0.125],
                                               ranks=[3, 1], top_ids=[[5, 6], [7, 8]],
                                               top_logprobs=[[-1.0, -1.5], [-0.125, -3.0]]),
                                PromptLogprobs(req_id="q", start=17, token_logprobs=[-1.0],
                                               ranks=[2], top_ids=[[]], top_logprobs=[[]])]),
    StepResult(step_id=20, sampled=[("s", [4, 5, 6])], proposals=[("s", [7, 8]), ("t", [1])]),
    ExecutorError(step_id=19, message="CUDA out of memory"),
    Shutdown(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert back == msg
    assert type(back) is type(msg)


def test_wire_is_plain_msgpack():
    # Only lists, ints, floats, strings, bools and None: a peer in any language can read it.
    def plain(x):
        if isinstance(x, list):
            return all(plain(i) for i in x)
        return x is None or isinstance(x, (int, float, str, bool))

    for msg in MESSAGES:
        assert plain(msgpack.unpackb(encode(msg)))


WIRE_CLASSES = [Hello, Welcome, Reject, StepPlan, NewRequest, CachedRequest, StepResult,
                PromptLogprobs, ExecutorError, Shutdown, SamplingSpec, StructuredSpec]


@pytest.mark.parametrize("cls", [c for c in WIRE_CLASSES if dataclasses.is_dataclass(c)],
                         ids=lambda c: c.__name__)
def test_wire_dataclasses_are_keyword_only(cls):
    """A field added to a message can never shift a positional value into another's place."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    assert all(f.kw_only for f in fields), cls
    if fields:
        with pytest.raises(TypeError, match="positional"):
            cls(*[None] * len(fields))


def test_wire_records_are_built_by_name_everywhere():
    """The tuple records (CachedRequest, PromptLogprobs: NamedTuples, fast to decode in
    columns) cannot refuse positional arguments themselves, so no code builds any wire
    message positionally: every call of a wire class, in every package and test, names its
    fields."""
    names = {c.__name__ for c in WIRE_CLASSES}
    offenders = []
    for top in ("protos", "checkpoints", "scheduler_svc", "executor_svc", "client", "bench",
                "tests"):
        for path in (ROOT / top).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            owner = {id(n): c.name for c in ast.walk(tree)
                     if isinstance(c, ast.ClassDef) and c.name in names for n in ast.walk(c)}
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                name = (func.id if isinstance(func, ast.Name)
                        else func.attr if isinstance(func, ast.Attribute) else None)
                if name == "cls":
                    name = owner.get(id(node))
                if name in names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(...)")
    assert not offenders, "wire messages built positionally:\n" + "\n".join(offenders)


def test_plan_counts_scheduled_tokens():
    assert MESSAGES[4].num_scheduled_tokens == 4 + 24 + 1 + 5 + 1 + 1 + 1 + 4


@pytest.mark.parametrize("frame, match", [
    (b"\xc1", "undecodable"),
    (msgpack.packb({"t": 1}), "max_map_len"),  # no maps in Folio messages
    (msgpack.packb("text"), "non-empty list"),
    (msgpack.packb([99, 1]), "unknown message tag 99"),
    (msgpack.packb([StepPlan.TAG, 1, [[1]]]), "malformed message"),
])
def test_bad_frames_are_refused(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def _columns_plan(cached: list) -> bytes:
    return msgpack.packb([StepPlan.TAG, 1, [], cached, [], [], [], [], [], False, [], [], []])


def _columns_result(sampled: list) -> bytes:
    return msgpack.packb([StepResult.TAG, 1, sampled, 0.0, [], 0.0, [[], [], []], [], []])


@pytest.mark.parametrize("frame, match", [
    # cached requests travel as six columns of equal length
    (_columns_plan([["a"], [[]], [0], [1], [[]]]), "expected 6 fields"),
    (_columns_plan([["a", "b"], [[], []], [0], [1, 1], [[], []], [[], []]]),
     "columns of 2 entries"),
    (_columns_plan([[7], [[]], [0], [1], [[]], [[]]]), "request ids must be strings"),
    (_columns_plan([["a"], [[]], [True], [1], [[]], [[]]]), "token counts"),  # bool: no int
    (_columns_plan([["a"], [[]], [0], [-1], [[]], [[]]]), "token counts"),
    (_columns_plan([["a"], [[3, -2]], [0], [1], [[]], [[]]]), "ints >= 0"),
    (_columns_plan([["a"], [None], [0], [1], [[]], [[]]]), "must be lists"),
    (_columns_plan([["a"], [[]], [0], [1], [["x"]], [[]]]), "ints >= 0"),
    (_columns_plan([["a"], [[]], [0], [2], [[]], [[-1]]]), "ints >= 0"),  # a bad proposal
    (_columns_plan([["a"], [[]], [0], [2], [[]], [7]]), "must be lists"),
    # sampled tokens travel as two columns: request ids, token id lists
    (_columns_result([["a", "b"], [[1]]]), "as many token id lists"),
    (_columns_result([["a"], [[1.5]]]), "ints >= 0"),
    (_columns_result([["a"], [[-3]]]), "ints >= 0"),
    (_columns_result([["a"], [5]]), "must be lists"),
    (_columns_result([[b"a"], [[5]]]), "list of strings"),
    # the draft model's proposals: [req_id, token ids] pairs
    (msgpack.packb([StepResult.TAG, 1, [[], []], 0.0, [], 0.0, [[], [], []], [],
                    [["a", [-1]]]]), "ints >= 0"),
    (msgpack.packb([StepResult.TAG, 1, [[], []], 0.0, [], 0.0, [[], [], []], [],
                    [["a"]]]), "expected 2 fields"),
])
def test_malformed_columns_are_refused(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_committed_stubs_are_fresh(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is a test extra")
    from protos.generate import PROTO_FILES, generate

    generate(tmp_path)
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            fresh, committed = tmp_path / f"{stem}{suffix}", ROOT / f"{stem}{suffix}"
            assert filecmp.cmp(fresh, committed, shallow=False), (
                f"{committed} is stale: run `python -m protos.generate`")
