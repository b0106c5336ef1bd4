"""What every gRPC service of the scheduler shares: exceptions -> statuses, and method tables
whose request deserializer never raises.

`grpc_errors` is the one place where exceptions become statuses: FolioError subclasses carry
their code and a message for the client; anything else is INTERNAL and logged with a traceback.

Services are registered with our own method handlers (`method_handlers`) whose request
deserializer never raises: a message protobuf cannot parse (invalid UTF-8 in a string field,
truncated bytes) arrives as `Undecodable` and is answered INVALID_ARGUMENT, where grpc's
generated handlers would answer UNKNOWN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from scheduler_svc.errors import FolioError, InvalidRequest

log = structlog.get_logger("folio.scheduler.server")


async def _abort_with(context: grpc.aio.ServicerContext, e: Exception, method: str) -> None:
    if isinstance(e, FolioError):
        log.info("request refused", method=method, code=e.code.name, reason=str(e))
        await context.abort(e.code, str(e))
    log.exception("unexpected error in a handler", method=method)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal scheduler error ({type(e).__name__}: {e}); see the server log")


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """A request message protobuf could not parse."""

    message_type: str
    proto_file: str
    reason: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(f"could not decode the request as a {self.message_type} "
                              f"({self.reason}); serialize it from {self.proto_file}, "
                              "with valid UTF-8 in every string field")


def lenient_deserializer(message_cls) -> Callable[[bytes], object]:
    def deserialize(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return Undecodable(message_cls.DESCRIPTOR.full_name,
                               message_cls.DESCRIPTOR.file.name, str(e))
    return deserialize


def grpc_errors(fn):
    """Map exceptions from a unary or server-streaming handler to gRPC statuses; a request
    that could not be decoded is INVALID_ARGUMENT before the handler runs."""
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream_handler(self, request, context):
            try:
                if isinstance(request, Undecodable):
                    raise request.error()
                # aclosing: a client that goes away closes the inner generator right here, so
                # its cleanup (aborting the request, freeing blocks) runs now, not at GC time.
                async with contextlib.aclosing(fn(self, request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort_with(context, e, fn.__name__)
        return stream_handler

    @functools.wraps(fn)
    async def unary_handler(self, request, context):
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort_with(context, e, fn.__name__)
    return unary_handler


def method_handlers(service: ServiceDescriptor, servicer: object
                    ) -> dict[str, grpc.RpcMethodHandler]:
    """The method table grpc's generated `add_*Servicer_to_server` would build for `service`,
    with lenient request deserializers: every method of the descriptor, each bound to the
    servicer's method of the same name (which must exist: a service is served whole)."""
    table = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client streaming is not supported here")
        kind = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        table[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=lenient_deserializer(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString)
    return table


def register(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    handlers = method_handlers(service, servicer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
