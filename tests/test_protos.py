"""The step-plan wire format and the committed gRPC stubs."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parent.parent

MESSAGES = [
    Hello(PROTOCOL_VERSION, "exec-1", "tiny", "LlamaForCausalLM", 32000, 4096, 16, 1234, 64,
          "bfloat16", "cuda:0", random_weights=True, tensor_parallel_size=4,
          num_draft_tokens=3),
    Welcome(PROTOCOL_VERSION),
    Reject("executor speaks protocol v9, this scheduler v1"),
    StepPlan(step_id=0),
    StepPlan(
        step_id=17,
        new_reqs=[
            NewRequest("r1", [1, 2, 3, 4], SamplingSpec(), [7], 0, 4),
            NewRequest("r2", list(range(40)), SamplingSpec(0.7, 0.9, 50, 2**63 - 1), [3, 9, 4],
                       16, 24),
            NewRequest("b0", [5, 6], SamplingSpec(0.0, num_logprobs=8, append_sampled=False),
                       [1], 1, 1),
            # A resumed request with every logits processor: 3 prompt tokens, 2 outputs.
            NewRequest("p0", [5, 6, 7, 8, 9], SamplingSpec(
                0.8, seed=3, min_tokens=4, min_tokens_stop_ids=(2, 7), repetition_penalty=1.3,
                presence_penalty=-0.5, frequency_penalty=2.0, min_p=0.05,
                logit_bias=((4, -100.0), (9, 2.5)), allowed_token_ids=(4, 5, 9),
                bad_words=((8,), (6, 7, 8))), [2], 0, 5, 3),
        ],
        cached_reqs=[CachedRequest("r0", [], 33, 1), CachedRequest("r3", [12], 48, 1),
                     CachedRequest("b1", [], 7, 1, [901]),
                     CachedRequest("s0", [13], 60, 4, [], [5, 6, 7])],  # three proposals
        finished_req_ids=["r4", "r5"],
        preempted_req_ids=["r6"],
        block_copies=[(1, 2), (5, 6)],
        swap_out=[(8, 0)],
        swap_in=[(1, 10)],
    ),
    # Structured output, and a resume: tokens past num_prompt_tokens were generated.
    StepPlan(step_id=18, new_reqs=[
        NewRequest("g0", [5, 6, 7], SamplingSpec(
            structured=StructuredSpec("json_schema", '{"type": "object"}', (2, 7))),
            [1], 0, 3, num_prompt_tokens=2),
        NewRequest("g1", [5], SamplingSpec(0.0, structured=StructuredSpec("choice", '["a"]')),
                   [1], 0, 1),
    ]),
    StepPlan(step_id=19, new_reqs=[NewRequest(
        "p", [5, 6, 7], SamplingSpec(num_logprobs=2, sampled_logprob=True, prompt_logprobs=0,
                                processed_logprobs=True),
        [2], 0, 3)]),
    StepResult(17, [("r1", [42]), ("r0", [7, 8])], 0.0123,
               [("b0", [3, 1], [-0.25, -1.5])]),
    StepResult(18),
    StepResult(19, [("p", [4]), ("q", [9])], 0.5, [("p", [4, 2], [-0.5, -1.0])], 0.01,
               sampled_logprobs=[("p", -0.5, 1), ("q", -7.25, 130)],
               prompt_logprobs=[PromptLogprobs("p", 1, [-2.0, -0.125], [3, 1],
                                               [[5, 6], [7, 8]], [[-1.0, -1.5], [-0.125, -3.0]]),
                                PromptLogprobs("q", 17, [-1.0], [2], [[]], [[]])]),
    StepResult(20, [("s", [4, 5, 6])], proposals=[("s", [7, 8]), ("t", [1])]),
    ExecutorError(19, "CUDA out of memory"),
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
    return msgpack.packb([StepPlan.TAG, 1, [], cached, [], [], [], [], [], False])


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
