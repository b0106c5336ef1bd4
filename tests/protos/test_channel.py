"""The channel's codec against hostile bytes, and its keys and address rules.

Whatever a peer sends, `decode` either returns a message whose every field has its declared
type or raises ProtocolError: nothing else escapes, so a reader cannot be killed by input.
"""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.channel import ProtocolError, decode, encode
from protos.channel_keys import ChannelKeys, check_insecure_address, is_loopback, read_secret
from protos.plan import (
    CachedRequest,
    ExecutorError,
    Hello,
    NewRequest,
    Reject,
    SamplingSpec,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
)
from tests.protos.test_protos import MESSAGES

# Anything msgpack can carry (maps included: they must be refused too).
wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=20)


def check_types(msg) -> None:
    """Every field of a decoded message has its annotated type (recursively)."""
    hints = typing.get_type_hints(type(msg))
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        if hint is bool:
            assert type(value) is bool, (f.name, value)
        elif hint is int:
            assert type(value) is int, (f.name, value)
        elif hint is float:
            assert type(value) is float, (f.name, value)
        elif hint is str:
            assert type(value) is str, (f.name, value)
        elif origin is list:
            assert type(value) is list, (f.name, value)
            for item in value:
                if dataclasses.is_dataclass(item):
                    check_types(item)
        elif origin is tuple:
            check_tuple(value, hint, f.name)
        elif dataclasses.is_dataclass(value):
            check_types(value)


def check_tuple(value, hint, name: str) -> None:
    """tuple[X, ...] or tuple[X, Y] of ints, floats and such tuples, checked recursively."""
    assert type(value) is tuple, (name, value)
    args = typing.get_args(hint)
    items = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
    assert len(items) == len(value), (name, value)
    for item, item_hint in zip(value, items, strict=True):
        if typing.get_origin(item_hint) is tuple:
            check_tuple(item, item_hint, name)
        else:
            assert type(item) is item_hint, (name, value)


def mutations(wire: list) -> list[list]:
    """The wire form with one position (at any depth) replaced, for each position."""
    out = []

    def walk(node, path):
        if isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, path + [i])
        if path and path != [0]:
            out.append(path)

    walk(wire, [])
    return out


def replaced(wire, path, value):
    if not path:
        return value
    copy = list(wire)
    if path[0] == len(copy):
        return copy + [value]
    copy[path[0]] = replaced(copy[path[0]], path[1:], value)
    return copy


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_field_of_any_type_is_refused_or_well_typed(msg, data):
    wire = msg.to_wire()
    paths = mutations(wire) or [[len(wire)]]  # Shutdown: [tag] alone; append a field
    for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=6)):
        frame = msgpack.packb(replaced(wire, path, data.draw(wire_values)), use_bin_type=True)
        try:
            decoded = decode(frame)
        except ProtocolError:
            continue
        check_types(decoded)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | wire_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_arbitrary_frames_never_raise_anything_but_protocol_error(frame):
    try:
        check_types(decode(frame))
    except ProtocolError:
        pass


SPEC_WIRE = SamplingSpec().to_wire()


NO_CACHED = [[], [], [], [], [], []]  # a plan's cached requests on the wire: six empty columns


def plan_with_spec(index: int, value) -> list:
    """A StepPlan's wire form with one new request whose SamplingSpec field `index` is
    `value`."""
    spec = list(SPEC_WIRE)
    spec[index] = value
    return [StepPlan.TAG, 0, [["r", [1], spec, [0], 0, 1, 1]], NO_CACHED, [], [], [], [], [],
            False, [], [], []]


@pytest.mark.parametrize("wire", [
    [Hello.TAG, "3", "e", "m", "a", 1, 2, 3, 4, 5, "f", "cpu", False, 1, 0, [0],
     0],  # version a string
    [Hello.TAG, 3, "e", "m", "a", -1, 2, 3, 4, 5, "f", "cpu", False, 1, 0, [0],
     0],  # negative vocab
    [Hello.TAG, 3, "e", "m", "a", 1, 2, 3, 4, 5, "f", "cpu", 1, 1, 0, [0],
     0],  # bool as an int
    [Hello.TAG, 3, "e", "m", "a", 1, 2, 3, 4, 5, "f", "cpu", False, 1, -4, [0],
     0],  # negative drafts
    [Welcome.TAG],  # too few fields
    [Reject.TAG, "why", "yes"],
    [StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], "no", [], [], []],
    [StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], False, [[1, -2]], [], ["ab"]],  # slot -2
    [StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], False, [], [[1]], []],  # not a pair
    [StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], False, [[1, 2]], [], []],  # no key
    [StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], False, [[1, 2]], [], ["abc"]],  # odd hex
    [StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], False, [[1, 2]], [], [7]],  # not a str
    [StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], False],  # protocol v12's plan
    [StepPlan.TAG, 0, [["r", [1], ["hot", *SPEC_WIRE[1:]], [0], 0, 1, 1]], NO_CACHED, [], [], [],
     [], [], False, [], [], []],  # a NewRequest whose SamplingSpec has a string temperature
    plan_with_spec(12, [[3, 1.0], [3, 2.0]]),  # logit_bias names token 3 twice
    plan_with_spec(12, [[3]]),  # a logit_bias entry without its value
    plan_with_spec(12, [[-3, 1.0]]),  # a negative token id
    plan_with_spec(14, [[5], []]),  # an empty bad word
    plan_with_spec(13, [1, "2"]),  # allowed_token_ids with a string
    plan_with_spec(7, [1.5]),  # a float stop id
    [StepPlan.TAG, 0, [["r", [1, 2], SPEC_WIRE, [0], 0, 1, 3]], NO_CACHED, [], [], [], [], [],
     False, [], [], []],  # more prompt tokens than token ids
    [StepResult.TAG, 0, [["r"], [[1.5]]], 0.0, [], 0.0],
    [StepResult.TAG, 0, [["r"], [[1]]], 0.0, [["r", [1, 2], [0.0]]], 0.0],  # ids != logprobs
    [StepResult.TAG, 0, [["r"], [[1]], "extra"], 0.0, [], 0.0],
    plan_with_spec(15, ["yaml", "", []]),  # an unknown structured output kind
    plan_with_spec(15, ["regex", "a", [-1]]),  # a negative EOS id
    plan_with_spec(15, ["regex", "a"]),  # a StructuredSpec without its EOS ids
    # Protocol v7's logprob columns: a rank of 0, columns of different lengths, a prompt entry
    # starting at token 0 (which has no context), top lists that do not line up.
    [StepResult.TAG, 0, [["r"], [[1]]], 0.0, [], 0.0, [["r"], [-1.0], [0]], [], []],
    [StepResult.TAG, 0, [["r"], [[1]]], 0.0, [], 0.0, [["r"], [-1.0, -2.0], [1]], [], []],
    [StepResult.TAG, 0, [[], []], 0.0, [], 0.0, [[], [], []], [["r", 0, [-1.0], [1], [[]], [[]]]],
     []],
    [StepResult.TAG, 0, [[], []], 0.0, [], 0.0, [[], [], []],
     [["r", 1, [-1.0], [1], [[1, 2]], [[-1.0]]]], []],
    [StepResult.TAG, 0, [[], []], 0.0, [], 0.0, [[], [], []], [["r", 1, [-1.0], [], [], []]], []],
    # Protocol v11's proposals: a negative id, an entry without its ids.
    [StepResult.TAG, 0, [[], []], 0.0, [], 0.0, [[], [], []], [], [["r", [-1]]]],
    [StepResult.TAG, 0, [[], []], 0.0, [], 0.0, [[], [], []], [], [["r"]]],
    [ExecutorError.TAG, -1, "m"],
    [Shutdown.TAG, 1],
])
def test_wrong_types_are_refused(wire):
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(wire, use_bin_type=True))


def test_a_plan_that_only_breaks_one_rule_decodes_once_fixed():
    """The refusals above are for the one broken field: the same frames with it fixed decode."""
    for index, value in ((12, [[3, 1.0], [4, 2.0]]), (14, [[5], [6, 7]]), (13, [1, 2]),
                         (7, [1])):
        decode(msgpack.packb(plan_with_spec(index, value), use_bin_type=True))
    decode(msgpack.packb([StepPlan.TAG, 0, [["r", [1, 2], SPEC_WIRE, [0], 0, 1, 2]], NO_CACHED,
                          [], [], [], [], [], False, [], [], []], use_bin_type=True))
    decode(msgpack.packb([StepPlan.TAG, 0, [], NO_CACHED, [], [], [], [], [], False,
                          [[1, 2]], [[2, 1]], ["ab" * 32]], use_bin_type=True))


def test_valid_extremes_still_decode():
    extreme = NewRequest(req_id="r", token_ids=[0, 2**31],
                         sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=0,
                                               seed=-(2**63)),
                         block_ids=[0], num_computed_tokens=0, num_scheduled_tokens=2)
    held = CachedRequest(req_id="c", new_block_ids=[], num_computed_tokens=0,
                         num_scheduled_tokens=1, new_token_ids=[])
    plan = StepPlan(step_id=7, new_reqs=[extreme], cached_reqs=[held], reset=True)
    assert decode(encode(plan)) == plan


def test_keys_from_one_secret_are_stable_and_distinct():
    a, b = ChannelKeys.from_secret("s" * 20), ChannelKeys.from_secret("s" * 20)
    other = ChannelKeys.from_secret("t" * 20)
    assert a == b and a != other
    assert len({a.server_public, a.client_public, a.server_secret, a.client_secret}) == 4
    with pytest.raises(ValueError, match="too short"):
        ChannelKeys.from_secret("short")


def test_secret_from_file_wins_over_the_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_text("from-the-file-0123456789\n")
    env = {"FOLIO_CHANNEL_SECRET": "from-the-env-0123456789"}
    assert read_secret(str(path), env) == "from-the-file-0123456789"
    assert read_secret(None, env) == "from-the-env-0123456789"
    assert read_secret(None, {}) is None
    with pytest.raises(ValueError, match="cannot read the channel secret file"):
        read_secret(str(tmp_path / "missing"), env)
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        read_secret(str(tmp_path / "empty"), env)


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5557", True), ("tcp://localhost:5557", True), ("tcp://[::1]:5557", True),
    ("ipc:///tmp/folio.sock", True), ("tcp://0.0.0.0:5557", False),
    ("tcp://10.1.2.3:5557", False), ("tcp://scheduler:5557", False), ("tcp://*:5557", False),
])
def test_only_loopback_addresses_may_go_without_a_secret(address, loopback):
    assert is_loopback(address) is loopback
    if loopback:
        check_insecure_address(address, allow_insecure=False)
    else:
        with pytest.raises(ValueError, match="--insecure-channel"):
            check_insecure_address(address, allow_insecure=False)
        check_insecure_address(address, allow_insecure=True)
