"""Helpers for the front-end tests: raw-bytes calls that send what no protobuf library would
serialize (the server itself: `grpc_harness.running_server`)."""

from __future__ import annotations

import grpc

from protos.folio.v1 import generator_pb2 as pb

INVALID_UTF8 = b"\xff\xfe\xc3("  # a lone continuation byte, and a truncated sequence


def with_invalid_utf8(msg, marker: str) -> bytes:
    """`msg` serialized with the string `marker` (which it must contain exactly once, e.g. as
    a field's value) replaced by invalid UTF-8 of the same length, so the framing stays valid."""
    assert len(marker.encode()) == len(INVALID_UTF8)
    data = msg.SerializeToString()
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), INVALID_UTF8)


async def raw_generate(port: int, data: bytes, timeout: float = 30.0
                       ) -> list[pb.GenerateResponse]:
    """A Generate call whose request is `data` as is."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/folio.v1.Generator/Generate",
                                    response_deserializer=pb.GenerateResponse.FromString)
        return [r async for r in call(data, timeout=timeout)]


async def raw_unary(port: int, method: str, data: bytes, response_cls, timeout: float = 30.0):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/folio.v1.Generator/{method}",
                                   response_deserializer=response_cls.FromString)
        return await call(data, timeout=timeout)
