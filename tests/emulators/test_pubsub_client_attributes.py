"""The Pub/Sub emulator on attribute keys: ``goog`` is reserved, except the ``googclient_`` keys that
Google's own client libraries set (``googclient_traceparent`` with OpenTelemetry tracing on), which
the service accepts and delivers unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from google.api_core import exceptions
from pubsub_clients import Inbox, subscribed

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_googclient_attributes_are_accepted_and_delivered(resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    resources.publisher.publish(topic, b"x", googclient_traceparent=TRACEPARENT).result(timeout=30)

    inbox = Inbox()
    with subscribed(subscriber, subscription, inbox):
        inbox.wait_for(lambda ms: len(ms) >= 1, 30, "the message")
    assert inbox.messages[0].attributes["googclient_traceparent"] == TRACEPARENT


@pytest.mark.parametrize("key", ["goog", "googkey", "goog_traceparent", "googclient"])
def test_other_goog_keys_are_reserved(resources: Any, key: str) -> None:
    topic = resources.topic()
    with pytest.raises(exceptions.InvalidArgument):
        resources.publisher.publish(topic, b"x", **{key: "v"}).result(timeout=30)
