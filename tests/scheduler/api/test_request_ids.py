"""Client request ids over gRPC: "/" is reserved for the ids of a request's sequences
(`<id>/<i>`, `<id>/prompt`, `<id>/beam<r>.<k>`), so a client id may not contain it, and a
group's sequences never collide with a client's request."""

from __future__ import annotations

import grpc
import pytest

from protos.folio.v1 import generator_pb2 as pb
from tests.scheduler.grpc_harness import collect, null_continuation

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8, 9, 10]


def request(req_id: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=req_id, token_ids=pb.TokenIds(ids=PROMPT),
                              sampling=pb.SamplingParams(**sampling))


@pytest.mark.parametrize("req_id", ["p/0", "p/prompt", "p/beam0.1", "/", "tenant/42"])
async def test_request_ids_with_a_slash_get_invalid_argument(harness, req_id):
    await harness.serve(step_delay_s=0.02)
    # "p" runs with n = 3: its sequences "p/prompt", then "p/0" .. "p/2", are in the scheduler.
    group = harness.stub.Generate(request("p", n=3, temperature=0.0, max_tokens=8))
    first = await group.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(harness.stub.Generate(request(req_id, max_tokens=2)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"request_id {req_id!r} may not contain '/'" in err.value.details()
    assert "reserved for the ids of a request's sequences" in err.value.details()
    # The group is untouched: every sequence streams its greedy continuation to the end.
    responses = [first, *await collect(group)]
    by_index: dict[int, list[int]] = {}
    for resp in responses:
        by_index.setdefault(resp.index, []).extend(resp.token_ids)
    assert by_index == {i: null_continuation(PROMPT, 8) for i in range(3)}
    assert sum(r.finish_reason == pb.FINISH_REASON_LENGTH for r in responses) == 3
    # And ids without a slash still work.
    plain = await collect(harness.stub.Generate(request("p-0", max_tokens=2)))
    assert [t for r in plain for t in r.token_ids] == null_continuation(PROMPT, 2)
