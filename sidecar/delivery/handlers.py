"""The OrderedDelivery method table, with request decoding that never fails inside gRPC.

The generated ``add_OrderedDeliveryServicer_to_server`` decodes with ``FromString``: bytes that are
not a valid message then raise inside grpc itself, which answers UNKNOWN (unary) or hands the
servicer a DecodeError that reads as a bug of ours (INTERNAL, logged at ERROR with a stack trace).
Here an undecodable request becomes an ``Undecodable`` value that the servicer refuses with
INVALID_ARGUMENT, as production refuses a malformed request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from pubsub_sidecar.v1 import sidecar_pb2

SERVICE_NAME = sidecar_pb2.DESCRIPTOR.services_by_name["OrderedDelivery"].full_name

_M = TypeVar("_M", bound=Message)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Stands in for a request whose bytes are not a valid message of its type."""

    type_name: str
    reason: str

    def describe(self) -> str:
        return f"cannot decode the request as {self.type_name}: {self.reason}"


def _decoder(message_type: type[_M]) -> Callable[[bytes], _M | Undecodable]:
    full_name = message_type.DESCRIPTOR.full_name

    def decode(data: bytes) -> _M | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(full_name, str(exc) or "invalid wire format")

    return decode


class _Servicer(Protocol):
    def Subscribe(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any: ...

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...

    async def UnblockKey(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...

    async def SkipGap(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...

    async def Publish(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...


def ordered_delivery_handler(servicer: _Servicer) -> grpc.GenericRpcHandler:
    """What ``add_OrderedDeliveryServicer_to_server`` registers, with the decoders above."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Subscribe": grpc.stream_stream_rpc_method_handler(
                servicer.Subscribe,
                request_deserializer=_decoder(sidecar_pb2.SubscribeRequest),
                response_serializer=sidecar_pb2.SubscribeResponse.SerializeToString,
            ),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                servicer.GetStatus,
                request_deserializer=_decoder(sidecar_pb2.GetStatusRequest),
                response_serializer=sidecar_pb2.GetStatusResponse.SerializeToString,
            ),
            "UnblockKey": grpc.unary_unary_rpc_method_handler(
                servicer.UnblockKey,
                request_deserializer=_decoder(sidecar_pb2.UnblockKeyRequest),
                response_serializer=sidecar_pb2.UnblockKeyResponse.SerializeToString,
            ),
            "SkipGap": grpc.unary_unary_rpc_method_handler(
                servicer.SkipGap,
                request_deserializer=_decoder(sidecar_pb2.SkipGapRequest),
                response_serializer=sidecar_pb2.SkipGapResponse.SerializeToString,
            ),
            "Publish": grpc.unary_unary_rpc_method_handler(
                servicer.Publish,
                request_deserializer=_decoder(sidecar_pb2.PublishRequest),
                response_serializer=sidecar_pb2.PublishResponse.SerializeToString,
            ),
        },
    )
