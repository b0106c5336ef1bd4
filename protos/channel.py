"""The scheduler <-> executor channel: msgpack codec plus the two ZeroMQ socket ends.

The scheduler binds a ROUTER socket; executors connect DEALER sockets. A ROUTER prefixes every
incoming message with the peer's identity frame (a fresh one per connection), so the scheduler
can tell a restarted executor from the old one.

Security (`ChannelKeys`): with a shared secret, both ends derive CURVE key pairs from it; the
scheduler's ZAP handler admits only the executor key, so a peer without the secret never
completes the ZeroMQ handshake: it can send nothing and learns nothing (the traffic is also
encrypted). Without a secret the channel is plain TCP/IPC, allowed only on loopback addresses
unless the operator insists (`check_insecure_address`).

Liveness: ZMTP heartbeats (`HEARTBEAT_*`, answered by libzmq's I/O thread even while Python is
busy in a long step) plus a socket monitor turn a dead peer into an event within about a
second: `PeerLost(identity)` on the scheduler's side, `SchedulerLost()` on the executor's.

Bounds: frames above `MAX_FRAME_BYTES` are refused by libzmq (the connection is dropped);
a frame is decoded only if it is a list with a known tag, and every field's type is checked
(`protos.plan`). The receive methods never raise for what a peer sent: they return
`BadMessage` instead, so a reader loop cannot be killed by input.

Addresses are ZeroMQ endpoints: ``tcp://127.0.0.1:5557`` or ``ipc:///tmp/folio.sock``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from protos.channel_keys import SECRET_ENV, ChannelKeys
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

# What the scheduler accepts from an executor (a StepResult with top logprobs for 256 beams is
# a few MB) and what an executor accepts from its scheduler (a plan re-sending 256 long
# contexts after a restart is ~100s of MB).
MAX_FRAME_BYTES = 64 << 20
MAX_PLAN_BYTES = 1 << 30
RECV_BATCH = 256  # messages taken per wake-up of the scheduler's reader
HEARTBEAT_IVL_MS = 500  # ZMTP PING this often on an otherwise quiet connection
HEARTBEAT_TIMEOUT_MS = 2000  # no traffic at all for this long: the connection is dropped
_MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_SUCCEEDED)


class ProtocolError(ValueError):
    """A frame that is not a Folio message (wrong tag, wrong shape, wrong field type)."""


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


_DECODERS = {cls.TAG: cls.from_wire for cls in (Hello, Welcome, Reject, StepPlan, StepResult,
                                                ExecutorError, Shutdown)}


def decode(frame: bytes) -> Message:
    try:
        # No maps in Folio messages; nesting depth is bounded by msgpack's own stack limit.
        w = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_map_len=0,
                            max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {type(e).__name__}: {e}"[:300]) from e
    if not isinstance(w, list) or not w:
        raise ProtocolError("a message is a non-empty list [tag, ...]")
    tag = w[0]
    from_wire = _DECODERS.get(tag) if type(tag) is int else None
    if from_wire is None:
        raise ProtocolError(f"unknown message tag {tag!r:.40}")
    try:
        return from_wire(w)
    except (TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"malformed message with tag {tag}: {e}"[:300]) from e


# ---- events other than messages -----------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PeerLost:
    """Scheduler side: the connection of the peer with this identity closed (process died,
    network gone, heartbeat timeout)."""

    identity: bytes


@dataclass(frozen=True, kw_only=True)
class SchedulerLost:
    """Executor side: the connection to the scheduler closed."""


@dataclass(frozen=True, kw_only=True)
class BadMessage:
    """A frame that could not be decoded (or had the wrong number of frames); dropped."""

    identity: bytes | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class AuthFailed:
    """A peer failed the ZeroMQ handshake (wrong or missing key, or security mismatch)."""

    reason: str


def _common_options(sock: zmq.Socket, max_frame_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def _monitor_event(frames: list) -> tuple[int, int]:
    event = parse_monitor_message(frames)
    return int(event["event"]), int(event["value"])


_AUTH_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "a peer presented a key the scheduler does not accept",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a peer failed the channel's handshake (a different "
                                         "channel secret, or one end has none)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "a peer's ZeroMQ handshake failed",
}


class _ZapHandler:
    """ZAP (ZeroMQ's authentication protocol) on a thread: admit exactly one CURVE key.

    Runs beside the event loop so an authentication never waits for a busy loop."""

    def __init__(self, ctx: zmq.Context, client_public: bytes):
        self._allowed = z85.decode(client_public)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("inproc://zeromq.zap.01")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="folio-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import hmac

        while not self._stop.is_set():
            try:
                if not self._sock.poll(200):
                    continue
                frames = self._sock.recv_multipart()
            except zmq.ZMQError:
                return  # the socket was closed
            # version, request id, domain, address, identity, mechanism, credentials...
            if len(frames) < 6:
                continue
            version, request_id, mechanism = frames[0], frames[1], frames[5]
            key = frames[6] if len(frames) > 6 else b""
            ok = mechanism == b"CURVE" and hmac.compare_digest(key, self._allowed)
            reply = [version, request_id, b"200" if ok else b"400",
                     b"OK" if ok else b"unknown key", b"executor" if ok else b"", b""]
            try:
                self._sock.send_multipart(reply)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


class SchedulerEnd:
    """The scheduler's side: an asyncio ROUTER bound to `address`.

    `recv()` returns, in order of occurrence, `(identity, Message)`, `PeerLost`, `BadMessage`
    or `AuthFailed`. Monitor events are always drained before a message is returned, so a
    disconnect of an old connection is reported before a message from a new connection that
    reuses its file descriptor."""

    def __init__(self, address: str, keys: ChannelKeys | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        # A context of our own: the ZAP endpoint is per context, and this one can be shadowed
        # by a blocking context for the ZAP thread.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context.shadow(self._sync_ctx.underlying)
        self._zap = _ZapHandler(self._sync_ctx, keys.client_public) if keys else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        _common_options(self._sock, max_frame_bytes)
        # Fail fast instead of queueing when the executor is gone.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if keys is not None:
            self._sock.setsockopt(zmq.CURVE_SERVER, 1)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
            self._sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
        self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
        # Blocking twins of the two sockets for non-blocking reads: a message already queued
        # is taken at once, without a round through the event loop.
        self._sock_now = zmq.Socket.shadow(self._sock.underlying)
        self._monitor_now = zmq.Socket.shadow(self._monitor.underlying)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        try:
            self._sock.bind(address)
        except zmq.ZMQError:
            self.close()
            raise
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.authenticated = keys is not None
        self._fd_identity: dict[int, bytes] = {}  # open connections that have sent something
        self._events: deque = deque()

    async def recv(self) -> tuple[bytes, Message] | PeerLost | BadMessage | AuthFailed:
        while not self._events:
            self._drain_monitor()
            if not self._events and not self._receive_batch(RECV_BATCH):
                await self._poller.poll()
        return self._events.popleft()

    def _receive_batch(self, limit: int) -> bool:
        """Take up to `limit` queued messages without waiting; False if there was none."""
        for i in range(limit):
            try:
                frames = self._sock_now.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return i > 0
            self._receive_one(frames)
        return True

    def _receive_one(self, frames: list[zmq.Frame]) -> None:
        self._drain_monitor()  # see the class docstring: disconnects first
        identity = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD) if len(frames) > 1 else -1
        if isinstance(fd, int) and fd >= 0:
            self._fd_identity[fd] = identity
        if len(frames) != 2:
            self._events.append(BadMessage(identity=identity,
                                           reason=f"{len(frames) - 1} frames, expected 1"))
            return
        try:
            self._events.append((identity, decode(frames[1].bytes)))
        except ProtocolError as e:
            self._events.append(BadMessage(identity=identity, reason=str(e)))

    def _drain_monitor(self) -> None:
        while self._monitor_now.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self._monitor_now.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event, value = _monitor_event(frames)
            if event == zmq.EVENT_DISCONNECTED:
                identity = self._fd_identity.pop(value, None)
                if identity is not None:
                    self._events.append(PeerLost(identity=identity))
            elif event in _AUTH_FAILURES:
                self._events.append(AuthFailed(reason=_AUTH_FAILURES[event]))

    async def send(self, identity: bytes, msg: Message) -> None:
        """Raises zmq.ZMQError when the peer is gone (ROUTER_MANDATORY)."""
        await self._sock.send_multipart([identity, encode(msg)])

    def close(self) -> None:
        self._poller.unregister(self._sock)
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        if self._zap is not None:
            self._zap.close()
        self._sync_ctx.term()


class ExecutorEnd:
    """The executor's side: a blocking DEALER connected to the scheduler.

    `recv()` returns a Message, `SchedulerLost` when the connection dropped, `BadMessage`,
    `AuthFailed`, or None when `timeout_ms` passed. `send()` returns False when no connection
    is up (IMMEDIATE: nothing queues for a scheduler that is not there)."""

    def __init__(self, address: str, keys: ChannelKeys | None = None,
                 max_frame_bytes: int = MAX_PLAN_BYTES):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _common_options(self._sock, max_frame_bytes)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if keys is not None:
            self._sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            self._sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(address)
        self.connected = False  # a ZeroMQ handshake completed and no disconnect since

    def wait_connected(self, timeout_ms: int) -> bool:
        """Until a connection to the scheduler is up (its ZeroMQ handshake done), or False
        after `timeout_ms`. Messages that arrive meanwhile stay queued."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self.connected:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return False
            if self._monitor.poll(min(left_ms, 100)):
                self._monitor_event()
        return True

    def send(self, msg: Message) -> bool:
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv(self, timeout_ms: int | None = None
             ) -> Message | SchedulerLost | BadMessage | AuthFailed | None:
        while True:
            if (event := self._monitor_event()) is not None:
                return event
            ready = dict(self._poller.poll(timeout_ms))
            if not ready:
                return None
            if self._monitor in ready:
                continue  # handled at the top of the loop
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 1:
                return BadMessage(identity=None, reason=f"{len(frames)} frames, expected 1")
            try:
                return decode(frames[0])
            except ProtocolError as e:
                return BadMessage(identity=None, reason=str(e))

    def _monitor_event(self) -> SchedulerLost | AuthFailed | None:
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            event, _ = _monitor_event(frames)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                was_connected, self.connected = self.connected, False
                if was_connected:
                    return SchedulerLost()
            elif event in _AUTH_FAILURES:
                return AuthFailed(reason="the handshake with the scheduler failed: start both with "
                                  f"the same channel secret (${SECRET_ENV} or "
                                  "--channel-secret-file), or both without one")

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()
