"""One Publish call: an event handed to the sidecar's outbox relay, numbered in order per key.

For apps without Firestore (docs/publishing.md). The sidecar writes the outbox entry and answers once
it is durable; its relay then publishes it with the key's next sequence number. NOT atomic with the
app's own database: an app that changes its state and publishes may do one without the other.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc


async def publish(
    target: str,
    relay: str,
    key: str,
    data: bytes,
    *,
    attributes: Mapping[str, str] | None = None,
    topic: str = "",
    entry_id: str = "",
    traceparent: str = "",
    tracestate: str = "",
    timeout_seconds: float = 30.0,
) -> str:
    """Hand one event to the relay ``relay`` of the sidecar at ``target``; the entry's id once durable.

    Pass an ``entry_id`` of your own to retry safely: after UNAVAILABLE (the write may have applied),
    the same call again answers with the same id while the entry waits to be published, instead of
    writing a second one. Raises grpc.aio.AioRpcError: NOT_FOUND for an unknown relay,
    INVALID_ARGUMENT for an event that can never be published (the details say why), UNAVAILABLE.
    """
    request = sidecar_pb2.PublishRequest(
        relay=relay,
        key=key,
        data=data,
        attributes=dict(attributes or {}),
        topic=topic,
        entry_id=entry_id,
        traceparent=traceparent,
        tracestate=tracestate,
    )
    async with grpc.aio.insecure_channel(target) as channel:
        stub = sidecar_pb2_grpc.OrderedDeliveryStub(channel)
        response: sidecar_pb2.PublishResponse = await stub.Publish(request, timeout=timeout_seconds)
        return response.entry_id
