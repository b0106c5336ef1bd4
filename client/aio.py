"""asyncio Python client for a Folio server; mirrors `client.api.FolioClient`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.api import DEFAULT_ADDRESS, auth_metadata, channel_credentials, health_status_name
from client.messages import (
    Choices,
    Completion,
    Messages,
    generate_request,
    message_to_dict,
    tokenize_request,
)
from protos.folio.v1 import generator_pb2 as pb
from protos.folio.v1 import generator_pb2_grpc as pb_grpc


class AsyncFolioClient:
    """`async with AsyncFolioClient(address) as c: async for resp in c.generate(...)`.

    `generate` returns the grpc.aio call: iterate it, or `.cancel()` it to stop early. The
    channel belongs to the event loop it was created on. `api_key`, `tls` and `tls_ca` as in
    `FolioClient`.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 api_key: str | None = None, tls: bool = False,
                 tls_ca: str | Path | None = None):
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)
        credentials = channel_credentials(tls, tls_ca)
        self._channel = (grpc.aio.secure_channel(address, credentials)
                         if credentials is not None else grpc.aio.insecure_channel(address))
        self._stub = pb_grpc.GeneratorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncFolioClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Messages | None = None,
        add_generation_prompt: bool | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling,
    ) -> AsyncIterator[pb.GenerateResponse]:
        req = generate_request(prompt, token_ids=token_ids, messages=messages,
                               add_generation_prompt=add_generation_prompt,
                               request_id=request_id, **sampling)
        return self._stub.Generate(req, timeout=self._timeout(timeout), metadata=self._metadata)

    async def generate_text(self, prompt: str | None = None, **kwargs) -> Completion:
        """One sequence folded into a Completion; for n > 1 use `generate_choices`."""
        if (kwargs.get("n") or 1) > 1:
            raise ValueError("generate_text returns one sequence; use generate_choices for n > 1")
        completion = Completion()
        async for resp in self.generate(prompt, **kwargs):
            completion.add(resp)
        return completion

    async def generate_choices(self, prompt: str | None = None, **kwargs) -> list[Completion]:
        """All n sequences (n > 1 or beam search), ordered by index."""
        choices = Choices()
        async for resp in self.generate(prompt, **kwargs):
            choices.add(resp)
        return choices.completions

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        resp = await self._stub.Abort(pb.AbortRequest(request_id=request_id),
                                      timeout=self._timeout(timeout), metadata=self._metadata)
        return resp.found

    async def tokenize(self, text: str | None = None, *, messages: Messages | None = None,
                       add_generation_prompt: bool | None = None,
                       timeout: float | None = None) -> list[int]:
        req = tokenize_request(text, messages=messages,
                               add_generation_prompt=add_generation_prompt)
        resp = await self._stub.Tokenize(req, timeout=self._timeout(timeout),
                                         metadata=self._metadata)
        return list(resp.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> dict:
        resp = await self._stub.GetModelInfo(pb.GetModelInfoRequest(),
                                             timeout=self._timeout(timeout),
                                             metadata=self._metadata)
        return message_to_dict(resp)

    async def stats(self, *, timeout: float | None = None) -> dict:
        resp = await self._stub.GetServerStats(pb.GetServerStatsRequest(),
                                               timeout=self._timeout(timeout),
                                               metadata=self._metadata)
        return message_to_dict(resp)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                        timeout=self._timeout(timeout) or 10.0)
        return health_status_name(resp.status)

    async def wait_ready(self, timeout: float = 60.0, *, poll_s: float = 0.2) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no answer"
        while loop.time() < deadline:
            try:
                last = await self.health(timeout=max(min(deadline - loop.time(), 5.0), 0.05))
                if last == "SERVING":
                    return
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            await asyncio.sleep(poll_s)
        raise TimeoutError(f"{self.address} not SERVING after {timeout:g}s ({last})")
