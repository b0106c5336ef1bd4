"""Abuse of the executor channel while a real (null-model) executor serves a stream.

The scheduler runs with a channel secret. Peers without it cannot complete the ZeroMQ
handshake (they learn nothing); a peer with it that sends garbage, wrong frame counts, wrong
field types, oversized frames or a flood only gets its messages dropped (and logged, rate
limited); a second executor with the key is refused while the first serves. Throughout, the
first executor's stream completes with exactly its uninterrupted tokens and health stays
SERVING.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq

from protos.channel import decode, encode
from protos.channel_keys import ChannelKeys
from protos.plan import Hello, Reject, StepResult
from tests.scheduler.grpc_harness import (
    SERVING,
    Harness,
    collect,
    gen_request,
    null_continuation,
    running_server,
)
from tests.scheduler.null_executor import make_hello

pytestmark = pytest.mark.timeout(120)

KEYS = ChannelKeys.from_secret("the-operator's-secret-0123456789")
WRONG_KEYS = ChannelKeys.from_secret("an-intruder's-guess-0123456789")
MAX_FRAME = 1 << 20


@pytest.fixture
async def secure(tiny_tokenizer):
    async with running_server(tiny_tokenizer, keys=KEYS, max_frame_bytes=MAX_FRAME,
                              executor_timeout_s=5.0) as h:
        yield h


class Peer:
    """A raw DEALER socket: whatever an attacker (or a broken executor) would send."""

    def __init__(self, address: str, keys: ChannelKeys | None, server_keys=KEYS):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        if keys is not None:
            self.sock.curve_serverkey = server_keys.server_public
            self.sock.curve_publickey = keys.client_public
            self.sock.curve_secretkey = keys.client_secret
        self.sock.connect(address)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def replies(self, timeout_ms: int) -> list:
        out = []
        while self.sock.poll(timeout_ms):
            out.append(decode(self.sock.recv()))
            timeout_ms = 50
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


async def start_stream(h: Harness, n: int = 40):
    ex = await h.serve(step_delay_s=0.02, keys=KEYS)
    call = h.stub.Generate(gen_request([5, 6, 7], max_tokens=n))
    first = await call.read()
    return ex, call, list(first.token_ids)


async def finish_stream(h: Harness, call, tokens: list[int], n: int = 40) -> None:
    tokens += [t for r in await collect(call) for t in r.token_ids]
    assert tokens == null_continuation([5, 6, 7], n)
    assert await h.health_status() == SERVING


WRONG_TYPED = [
    [Hello.TAG, "3", "e", "m", "a", 1, 2, 3, 4, 5, "f", "cpu", False],
    [Hello.TAG, 3, "e"],
    [StepResult.TAG, "0", [], 0.0, []],
    [StepResult.TAG, 0, [["x"], [["a"]]], 0.0, [], 0.0],
    [StepResult.TAG, 0, {"x": 1}, 0.0, []],
    [6, "step", "message"],
    [7, 1, 2, 3],
    [99],
    "not a list",
    [],
]


async def test_garbage_from_a_key_holder_is_dropped(secure, capfd):
    ex, call, tokens = await start_stream(secure)
    peer = Peer(secure.executor_address, KEYS)
    try:
        frames = [b"", b"\xc1", b"\xff" * 100, msgpack.packb({"a": 1}), b"x" * 1000]
        frames += [msgpack.packb(w, use_bin_type=True) for w in WRONG_TYPED]
        for frame in frames:
            peer.send(frame)
        peer.send(b"one", b"two")  # two frames where one is expected
        peer.send(b"a", b"b", b"c")
        assert await asyncio.to_thread(peer.replies, 500) == []  # garbage earns nothing
        # A well-formed answer to a step it was never given: told to say Hello.
        peer.send(encode(StepResult(step_id=0, sampled=[("r", [1])])))
        replies = await asyncio.to_thread(peer.replies, 2000)
        assert [type(r) for r in replies] == [Reject] and replies[0].retry
    finally:
        peer.close()
    await finish_stream(secure, call, tokens)
    out = capfd.readouterr().out
    assert out.count("dropped a malformed executor-channel message") == 1  # rate limited


async def test_an_oversized_frame_only_drops_its_connection(secure):
    ex, call, tokens = await start_stream(secure)
    peer = Peer(secure.executor_address, KEYS)
    try:
        peer.send(b"\x00" * (MAX_FRAME + 1))
        peer.send(encode(make_hello(executor_id="big")))  # after the drop: reconnects
        await asyncio.sleep(0.3)
    finally:
        peer.close()
    await finish_stream(secure, call, tokens)


async def test_a_flood_does_not_stall_the_server(secure, capfd):
    ex, call, tokens = await start_stream(secure, n=60)
    peer = Peer(secure.executor_address, KEYS)
    junk = msgpack.packb([99])
    counts = secure.server.engine._warn.counts
    num_flood = 300_000

    def seen() -> int:
        return counts.get("dropped a malformed executor-channel message", 0) + \
            counts.get("dropped executor-channel traffic: too many queued events", 0)

    try:
        flooding = asyncio.ensure_future(asyncio.to_thread(
            lambda: [peer.send(junk) for _ in range(num_flood)]))
        deadline = asyncio.get_running_loop().time() + 90
        # Health answers promptly while the flood arrives and is dropped.
        while seen() < num_flood:
            assert asyncio.get_running_loop().time() < deadline, f"only {seen()} arrived"
            start = asyncio.get_running_loop().time()
            assert await secure.health_status() == SERVING
            assert asyncio.get_running_loop().time() - start < 1.0
            await asyncio.sleep(0.1)
        await flooding
    finally:
        peer.close()
    await finish_stream(secure, call, tokens, n=60)
    responses = await collect(secure.stub.Generate(gen_request([8, 9], max_tokens=5)))
    assert [t for r in responses for t in r.token_ids] == null_continuation([8, 9], 5)
    lines = capfd.readouterr().out.count("\n")
    assert lines < 200, f"{lines} log lines for a flood"


@pytest.mark.parametrize("keys", [None, WRONG_KEYS], ids=["no-key", "wrong-key"])
async def test_a_peer_without_the_key_learns_nothing(secure, keys, capfd):
    ex, call, tokens = await start_stream(secure)
    intruder = Peer(secure.executor_address, keys)
    try:
        for _ in range(3):
            intruder.send(encode(make_hello(executor_id="intruder")))
            intruder.send(encode(StepResult(step_id=0, sampled=[("r", [1])])))
        # Nothing gets through: no Welcome, no plan, no Reject, not even a handshake.
        assert await asyncio.to_thread(intruder.replies, 1500) == []
    finally:
        intruder.close()
    await finish_stream(secure, call, tokens)
    assert ex.mirror.num_plans > 0 and secure.server.engine.executor.executor_id == "null-0"
    out = capfd.readouterr().out
    assert "refused an executor-channel connection" in out


async def test_a_second_executor_with_the_key_is_refused(secure):
    ex, call, tokens = await start_stream(secure)
    second = Peer(secure.executor_address, KEYS)
    try:
        second.send(encode(make_hello(executor_id="second")))
        replies = await asyncio.to_thread(second.replies, 2000)
        assert len(replies) == 1 and isinstance(replies[0], Reject) and replies[0].retry
    finally:
        second.close()
    await finish_stream(secure, call, tokens)
    assert secure.server.engine.executor.executor_id == "null-0"
