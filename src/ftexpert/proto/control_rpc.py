"""Message classes, client stubs and server handlers of proto/control.proto and grpc.health.v1.

Built at import time from the committed descriptor set (proto/control_descriptors.py), in a private
descriptor pool, so that:
- it imports under any protobuf runtime from 4.21 on (no generated code pinned to one version);
- it does not clash with another copy of grpc.health.v1 (grpcio-health-checking) in the default pool;
- the method table (names, request/response types, streaming) comes from the .proto, not a copy.

Usage:
    from ftexpert.proto import control_rpc as rpc
    stub = rpc.ControlStub(channel); stats = stub.GetStats(rpc.msg.GetStatsRequest())
    server.add_generic_rpc_handlers([rpc.control_handlers(servicer)])
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ftexpert.proto.control_descriptors import DESCRIPTOR_SET_B64

CONTROL_SERVICE = "ft.control.v1.Control"
HEALTH_SERVICE = "grpc.health.v1.Health"

_POOL = descriptor_pool.DescriptorPool()
_FILE_SET = descriptor_pb2.FileDescriptorSet.FromString(base64.b64decode("".join(DESCRIPTOR_SET_B64)))
for _file in _FILE_SET.file:  # dependencies come first in the set
    _POOL.AddSerializedFile(_file.SerializeToString())


def _message_class(full_name: str) -> type:
    desc = _POOL.FindMessageTypeByName(full_name)
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(_POOL).GetPrototype(desc)  # pragma: no cover - old runtimes


def _classes_of_package(package: str) -> SimpleNamespace:
    out = {}
    for file in _FILE_SET.file:
        if file.package != package:
            continue
        for message in file.message_type:
            out[message.name] = _message_class(f"{package}.{message.name}")
    return SimpleNamespace(**out)


# Message classes by short name: msg.Stats, msg.Policy, ...; health.HealthCheckRequest, ...
msg = _classes_of_package("ft.control.v1")
health = _classes_of_package("grpc.health.v1")
SERVING_STATUS = health.HealthCheckResponse.ServingStatus  # enum wrapper: .Value("SERVING"), .Name(1)


@dataclass(frozen=True)
class Method:
    service: str
    name: str
    request: type
    response: type
    server_streaming: bool
    client_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


def methods_of(service_full_name: str) -> dict[str, Method]:
    service = _POOL.FindServiceByName(service_full_name)
    return {
        m.name: Method(service_full_name, m.name, _message_class(m.input_type.full_name),
                       _message_class(m.output_type.full_name), m.server_streaming, m.client_streaming)
        for m in service.methods
    }


CONTROL_METHODS = methods_of(CONTROL_SERVICE)
HEALTH_METHODS = methods_of(HEALTH_SERVICE)


class _Stub:
    """A client stub: one callable attribute per method, as protoc's generated stubs have."""

    def __init__(self, channel: grpc.Channel, methods: dict[str, Method]):
        for name, m in methods.items():
            if m.client_streaming:
                raise NotImplementedError(f"{m.path}: client streaming is not used by this service")
            factory = channel.unary_stream if m.server_streaming else channel.unary_unary
            setattr(self, name, factory(m.path, request_serializer=m.request.SerializeToString,
                                        response_deserializer=m.response.FromString))


class ControlStub(_Stub):
    def __init__(self, channel: grpc.Channel):
        super().__init__(channel, CONTROL_METHODS)


class HealthStub(_Stub):
    def __init__(self, channel: grpc.Channel):
        super().__init__(channel, HEALTH_METHODS)


def _handlers(service: str, methods: dict[str, Method], servicer: Any) -> grpc.GenericRpcHandler:
    table: dict[str, grpc.RpcMethodHandler] = {}
    for name, m in methods.items():
        impl: Callable | None = getattr(servicer, name, None)
        if impl is None:
            raise TypeError(f"{type(servicer).__name__} lacks method {name} of {service}")
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        table[name] = make(impl, request_deserializer=m.request.FromString,
                           response_serializer=m.response.SerializeToString)
    return grpc.method_handlers_generic_handler(service, table)


def control_handlers(servicer: Any) -> grpc.GenericRpcHandler:
    """Server handlers of ft.control.v1.Control; `servicer` has one method per rpc: (request, context)."""
    return _handlers(CONTROL_SERVICE, CONTROL_METHODS, servicer)


def health_handlers(servicer: Any) -> grpc.GenericRpcHandler:
    """Server handlers of the standard grpc.health.v1.Health service."""
    return _handlers(HEALTH_SERVICE, HEALTH_METHODS, servicer)


def descriptor_summary(file_set: descriptor_pb2.FileDescriptorSet | None = None) -> list[tuple]:
    """A protoc-version-independent summary of a descriptor set (for the drift test)."""
    file_set = _FILE_SET if file_set is None else file_set
    rows: list[tuple] = []

    def walk(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        for f in message.field:
            rows.append(("field", f"{prefix}.{message.name}", f.name, f.number, f.type, f.label,
                         f.type_name, f.proto3_optional))
        for e in message.enum_type:
            rows.extend(("enum", f"{prefix}.{message.name}.{e.name}", v.name, v.number) for v in e.value)
        for nested in message.nested_type:
            walk(f"{prefix}.{message.name}", nested)

    for file in file_set.file:
        for message in file.message_type:
            walk(file.package, message)
        for e in file.enum_type:
            rows.extend(("enum", f"{file.package}.{e.name}", v.name, v.number) for v in e.value)
        for service in file.service:
            rows.extend(("method", f"{file.package}.{service.name}", m.name, m.input_type, m.output_type,
                         m.client_streaming, m.server_streaming) for m in service.method)
    return sorted(rows, key=repr)
