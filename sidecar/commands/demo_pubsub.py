"""The demo's publisher side: topics, a subscription and publishing, with the official client.

Kept apart from the sidecar's own Pub/Sub modules (``sidecar.pipeline.ingest_pull``,
``sidecar.dead_letters.publisher``) because it plays the
role of the *publisher* and of the operator who creates the subscription, not of the sidecar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1

_PUBLISH_TIMEOUT_SECONDS = 30.0
"""Generous: on a busy 2-core machine the emulator, the sidecar and the app share the CPU."""


class DemoPubSub:
    def __init__(self, project: str) -> None:
        self._project = project
        self._publisher = pubsub_v1.PublisherClient()
        self._subscriber = pubsub_v1.SubscriberClient()

    def create_topic_and_subscription(self, topic: str, subscription: str, dead_letter_topic: str) -> None:
        for name in (topic, dead_letter_topic):
            try:
                self._publisher.create_topic(name=self._publisher.topic_path(self._project, name))
            except api_exceptions.AlreadyExists:
                pass
        try:
            self._subscriber.create_subscription(
                name=self._subscriber.subscription_path(self._project, subscription),
                topic=self._publisher.topic_path(self._project, topic),
                ack_deadline_seconds=30,
            )
        except api_exceptions.AlreadyExists:
            pass

    def publish_all(self, topic: str, messages: Sequence[tuple[bytes, dict[str, str]]]) -> list[str]:
        """Publish with the client's batching; returns the message ids once all are accepted."""
        path = self._publisher.topic_path(self._project, topic)
        # Attributes go in as keyword arguments; typed as Any so that none can be mistaken for the
        # client's own retry/timeout keywords (the demo's attribute names are order_id and seq).
        publish: Any = self._publisher.publish
        futures = [publish(path, data, **attributes) for data, attributes in messages]
        return [str(future.result(timeout=_PUBLISH_TIMEOUT_SECONDS)) for future in futures]

    def close(self) -> None:
        self._subscriber.close()
        self._publisher.stop()
