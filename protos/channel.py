"""The scheduler <-> executor channel: msgpack codec plus the two ZeroMQ socket ends.

The scheduler binds a ROUTER socket; executors connect DEALER sockets. A ROUTER prefixes every
incoming message with the peer's identity frame, so the scheduler can tell a restarted executor
(new identity, new Hello) from the old one. Only one executor is active at a time today.

Addresses are ZeroMQ endpoints: ``tcp://127.0.0.1:5557`` or ``ipc:///tmp/folio.sock``.
"""

from __future__ import annotations

import msgpack
import zmq
import zmq.asyncio

from protos.plan import (
    ExecutorError,
    Hello,
    Message,
    Reject,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
)


class ProtocolError(ValueError):
    """A frame that is not a Folio message (wrong tag, wrong shape)."""


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def decode(frame: bytes) -> Message:
    try:
        w = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {e}") from e
    if not isinstance(w, list) or not w:
        raise ProtocolError("a message is a non-empty list [tag, ...]")
    try:
        match w[0]:
            case Hello.TAG:
                return Hello.from_wire(w)
            case Welcome.TAG:
                return Welcome.from_wire(w)
            case Reject.TAG:
                return Reject.from_wire(w)
            case StepPlan.TAG:
                return StepPlan.from_wire(w)
            case StepResult.TAG:
                return StepResult.from_wire(w)
            case ExecutorError.TAG:
                return ExecutorError.from_wire(w)
            case Shutdown.TAG:
                return Shutdown.from_wire(w)
    except (TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"malformed message with tag {w[0]!r}: {e}") from e
    raise ProtocolError(f"unknown message tag {w[0]!r}")


class SchedulerEnd:
    """The scheduler's side: an asyncio ROUTER bound to `address`."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None):
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Fail fast instead of queueing when the executor is gone.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[bytes, Message]:
        """Next (peer identity, message)."""
        identity, frame = await self._sock.recv_multipart()
        return identity, decode(frame)

    async def poll(self, timeout_ms: int) -> bool:
        return bool(await self._sock.poll(timeout_ms, zmq.POLLIN))

    async def send(self, identity: bytes, msg: Message) -> None:
        await self._sock.send_multipart([identity, encode(msg)])

    def close(self) -> None:
        self._sock.close(0)


class ExecutorEnd:
    """The executor's side: a blocking DEALER connected to the scheduler."""

    def __init__(self, address: str, ctx: zmq.Context | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)

    def send(self, msg: Message) -> None:
        self._sock.send(encode(msg))

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """Next message, or None if `timeout_ms` passes first."""
        if timeout_ms is not None and not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return decode(self._sock.recv())

    def close(self) -> None:
        self._sock.close(0)
