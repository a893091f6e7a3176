"""pubsub-sidecar-client: read the pubsub-sidecar's ordered stream from a Python app.

    from pubsub_sidecar_client import OrderedSubscriber

    async with OrderedSubscriber("127.0.0.1:50051", "orders") as sub:
        async for msg in sub:
            handle(msg.key, msg.data)
            await msg.ack()

``publish(target, relay, key, data)`` hands an event to the sidecar's outbox relay (apps without
Firestore: docs/publishing.md). Depends only on grpcio and protobuf. The generated gRPC code for the
API is the ``pubsub_sidecar.v1`` package of this same distribution (``sidecar_pb2``,
``sidecar_pb2_grpc``).
"""

from pubsub_sidecar_client.errors import ClientError, NotConfirmed, SubscriptionError
from pubsub_sidecar_client.message import Message
from pubsub_sidecar_client.publish import publish
from pubsub_sidecar_client.status import get_status
from pubsub_sidecar_client.subscriber import OrderedSubscriber

__all__ = [
    "ClientError",
    "Message",
    "NotConfirmed",
    "OrderedSubscriber",
    "SubscriptionError",
    "get_status",
    "publish",
]
