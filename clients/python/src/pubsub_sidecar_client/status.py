"""One GetStatus call: the sidecar's backlog, blocked keys and watermark."""

from __future__ import annotations

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc


async def get_status(
    target: str, subscription: str = "", *, max_keys: int = 0, timeout_seconds: float = 10.0
) -> sidecar_pb2.GetStatusResponse:
    """Ask the sidecar at ``target`` for its backlog (all subscriptions when ``subscription`` is empty).

    Raises grpc.aio.AioRpcError on failure (NOT_FOUND for an unknown subscription).
    """
    async with grpc.aio.insecure_channel(target) as channel:
        stub = sidecar_pb2_grpc.OrderedDeliveryStub(channel)
        response: sidecar_pb2.GetStatusResponse = await stub.GetStatus(
            sidecar_pb2.GetStatusRequest(subscription=subscription, max_keys=max_keys), timeout=timeout_seconds
        )
        return response
