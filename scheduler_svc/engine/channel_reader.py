"""The engine's reader of the executor channel: every event into one queue, the noise logged.

One task reads the ROUTER socket (`protos.channel.SchedulerEnd.recv`), so the engine loop can
wait on "an event or new work" without two readers racing on the socket. Malformed messages
and failed handshakes are only logged (rate limited) and never reach the loop, so a flood of
them cannot stall it; beyond `MAX_INBOX` queued events only the connected executor's are kept.
The reader never dies of what it reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from protos.channel import AuthFailed, BadMessage, SchedulerEnd
from scheduler_svc.engine.log_limit import LogLimiter

log = structlog.get_logger("folio.scheduler.engine")

MAX_INBOX = 4096  # queued channel events; beyond it, only the connected executor's are kept
YIELD_EVERY = 32  # queued events return without awaiting anything: let others run this often


class ChannelReader:
    def __init__(self, channel: SchedulerEnd, from_executor: Callable[[object], bool],
                 warn: LogLimiter):
        self.channel = channel
        self.inbox: asyncio.Queue = asyncio.Queue()
        self._from_executor = from_executor  # is this event from the connected executor?
        self._warn = warn

    async def run(self) -> None:
        num_read = 0
        while True:
            num_read += 1
            if num_read % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            try:
                event = await self.channel.recv()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in the channel code: never let the reader die of it
                log.exception("reading the executor channel failed")
                await asyncio.sleep(0.1)
                continue
            match event:
                case BadMessage(reason=reason):
                    self._warn.warning("dropped a malformed executor-channel message",
                                       error=reason, known_executor=self._from_executor(event))
                case AuthFailed(reason=reason):
                    self._warn.warning("refused an executor-channel connection", reason=reason)
                case _ if self.inbox.qsize() >= MAX_INBOX and not self._from_executor(event):
                    self._warn.warning("dropped executor-channel traffic: too many queued "
                                       "events")
                case _:
                    self.inbox.put_nowait(event)
