"""Optional API-key authentication and TLS for the public gRPC port.

With an API key, every call except the health service (grpc.health.v1.Health, which load
balancers and orchestrators probe without credentials) must carry the metadata
`authorization: Bearer <key>`; other calls end with UNAUTHENTICATED before their request is
even parsed. Reflection needs the key too. The key is compared through its SHA-256 digest with
hmac.compare_digest, so the time taken reveals neither its content nor its length.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger("folio.scheduler.auth")

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
MISSING_KEY = ("this server requires an API key: send the metadata 'authorization: Bearer "
               "<key>' (folio --api-key, FolioClient(api_key=...), or FOLIO_API_KEY)")
WRONG_KEY = "the API key in the 'authorization' metadata is not valid for this server"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


def _ignore_request(_data: bytes) -> None:
    return None  # a refused call's payload is never parsed


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def refuse(_request, context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable; makes this an async generator, as streaming handlers are

    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, _ignore_request, serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, _ignore_request, serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, _ignore_request, serializer)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, _ignore_request, serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        self._key_digest = _digest(api_key)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        token = _bearer_token(handler_call_details.invocation_metadata)
        if token is None:
            log.info("call refused: no API key", method=handler_call_details.method)
            return _refusing_handler(handler, MISSING_KEY)
        if not hmac.compare_digest(_digest(token), self._key_digest):
            log.info("call refused: wrong API key", method=handler_call_details.method)
            return _refusing_handler(handler, WRONG_KEY)
        return handler


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials from a PEM certificate (chain) and its PEM private key."""
    return grpc.ssl_server_credentials(
        [(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])
