"""Blocking Python client for a Folio server (one gRPC channel, thread-safe like grpc's)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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

DEFAULT_ADDRESS = "127.0.0.1:50051"
API_KEY_ENV = "FOLIO_API_KEY"
Metadata = tuple[tuple[str, str], ...]


def health_status_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def auth_metadata(api_key: str | None) -> Metadata:
    """The call metadata for a server started with --api-key; api_key None reads
    FOLIO_API_KEY, and an empty key sends none."""
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    return (("authorization", f"Bearer {key}"),) if key else ()


def channel_credentials(tls: bool, tls_ca: str | Path | None) -> grpc.ChannelCredentials | None:
    """TLS credentials: trusting the PEM certificate(s) in `tls_ca` (a private CA, or the
    server's self-signed certificate), or the system's roots with `tls` alone; None for
    plaintext."""
    if tls_ca is not None:
        return grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
    return grpc.ssl_channel_credentials() if tls else None


class FolioClient:
    """`FolioClient("127.0.0.1:50051")`; use as a context manager to close the channel.

    `generate` returns the gRPC stream itself: iterate it for `GenerateResponse` messages and
    call `.cancel()` on it to stop early (the server then aborts the request and frees its KV
    blocks). `generate_text` waits for the whole completion.

    `api_key` (default: the FOLIO_API_KEY environment variable) is sent as
    `authorization: Bearer <key>` on every call. `tls=True` connects over TLS trusting the
    system's roots; `tls_ca` (a PEM file) trusts that CA or self-signed certificate instead.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 api_key: str | None = None, tls: bool = False,
                 tls_ca: str | Path | None = None):
        self.address = address
        self.timeout = timeout  # default deadline per call, seconds; None = no deadline
        self._metadata = auth_metadata(api_key)
        credentials = channel_credentials(tls, tls_ca)
        self._channel = (grpc.secure_channel(address, credentials) if credentials is not None
                         else grpc.insecure_channel(address))
        self._stub = pb_grpc.GeneratorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> FolioClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
    ) -> Iterator[pb.GenerateResponse]:
        """Stream a completion. `sampling`: temperature, top_p, top_k, seed, max_tokens,
        stop_token_ids, ignore_eos, n, beam_width, length_penalty, early_stopping, stop (a
        string or a list), include_stop_str_in_output, skip_special_tokens,
        spaces_between_special_tokens, min_tokens, repetition_penalty, presence_penalty,
        frequency_penalty, min_p, logit_bias ({token id: bias}), allowed_token_ids, bad_words,
        logprobs, prompt_logprobs (None = server default); also `cache_salt` (prefix-cache
        hits only between requests of the same salt). The last message of a sequence stopped
        by a stop says which in its `matched_stop` oneof."""
        req = generate_request(prompt, token_ids=token_ids, messages=messages,
                               add_generation_prompt=add_generation_prompt,
                               request_id=request_id, **sampling)
        return self._stub.Generate(req, timeout=self._timeout(timeout), metadata=self._metadata)

    def generate_text(self, prompt: str | None = None, **kwargs) -> Completion:
        """One sequence folded into a Completion; for n > 1 use `generate_choices`."""
        if (kwargs.get("n") or 1) > 1:
            raise ValueError("generate_text returns one sequence; use generate_choices for n > 1")
        completion = Completion()
        for resp in self.generate(prompt, **kwargs):
            completion.add(resp)
        return completion

    def generate_choices(self, prompt: str | None = None, **kwargs) -> list[Completion]:
        """All n sequences (n > 1 or beam search), ordered by index."""
        choices = Choices()
        for resp in self.generate(prompt, **kwargs):
            choices.add(resp)
        return choices.completions

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        resp = self._stub.Abort(pb.AbortRequest(request_id=request_id),
                                timeout=self._timeout(timeout), metadata=self._metadata)
        return resp.found

    def tokenize(self, text: str | None = None, *, messages: Messages | None = None,
                 add_generation_prompt: bool | None = None,
                 timeout: float | None = None) -> list[int]:
        req = tokenize_request(text, messages=messages,
                               add_generation_prompt=add_generation_prompt)
        resp = self._stub.Tokenize(req, timeout=self._timeout(timeout), metadata=self._metadata)
        return list(resp.token_ids)

    def model_info(self, *, timeout: float | None = None) -> dict:
        return message_to_dict(self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self._timeout(timeout), metadata=self._metadata))

    def stats(self, *, timeout: float | None = None) -> dict:
        return message_to_dict(self._stub.GetServerStats(
            pb.GetServerStatsRequest(), timeout=self._timeout(timeout), metadata=self._metadata))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name: "SERVING", "NOT_SERVING", ... (needs no API key)."""
        resp = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=self._timeout(timeout) or 10.0)
        return health_status_name(resp.status)

    def wait_ready(self, timeout: float = 60.0, *, poll_s: float = 0.2) -> None:
        """Block until health is SERVING (the executor has joined); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.address} not SERVING after {timeout:g}s ({last})")
            try:
                last = self.health(timeout=max(min(remaining, 5.0), 0.05))
                if last == "SERVING":
                    return
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))
