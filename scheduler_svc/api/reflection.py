"""gRPC server reflection under both of its service names, v1 and v1alpha.

grpcio-reflection (1.85, the newest) implements only `grpc.reflection.v1alpha`. The v1
protocol is the same schema under another package: `grpc.reflection.v1` renamed every message
and kept every field and number, so a v1 request is byte for byte a v1alpha request. Clients
that ask for v1 first (grpcurl, buf curl, Postman) therefore get the library's own servicer,
registered a second time under the v1 name with v1 message classes. Those classes come from a
descriptor derived from the library's v1alpha file at import time (package renamed, type
references followed), so no copy of either .proto lives here and `list_services` /
`file_containing_symbol` describe the v1 service like any other.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file descriptor with its package (and every reference into it) renamed."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's language options name v1alpha's packages
    old, new = f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # assigning "" would set it on a scalar
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return proto


def _v1_messages() -> tuple[type, type]:
    pool = descriptor_pool.Default()
    try:
        file = pool.FindFileByName(V1_FILE)
    except KeyError:
        file = pool.Add(_v1_file()) or pool.FindFileByName(V1_FILE)
    return (message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionRequest"]),
            message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionResponse"]))


V1Request, V1Response = _v1_messages()


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection v1alpha (the library's registration) and v1 (the same servicer), each
    listing `service_names` and both reflection services."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)

    async def v1_info(request_iterator, context):
        async def as_v1alpha():
            async for request in request_iterator:
                yield reflection_pb2.ServerReflectionRequest.FromString(
                    request.SerializeToString())
        async for response in servicer.ServerReflectionInfo(as_v1alpha(), context):
            yield V1Response.FromString(response.SerializeToString())

    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        v1_info, request_deserializer=V1Request.FromString,
        response_serializer=V1Response.SerializeToString)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(V1_SERVICE_NAME, handlers)
