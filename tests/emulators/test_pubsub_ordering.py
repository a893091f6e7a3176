"""Subscriptions with ``enable_message_ordering``: per key in publish order, one message out at a time,
a nack or an expiry redelivers that message before the rest of its key. Through the official clients."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

import pytest
from google.cloud import pubsub_v1
from google.pubsub_v1 import types
from pubsub_clients import Inbox, raw_stream, subscribed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ordered_publisher(emulators: Any) -> Any:
    return pubsub_v1.PublisherClient(publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True))


def publish_keyed(publisher: Any, topic: str, items: list[tuple[str, str]]) -> None:
    """Publish (ordering key, data) pairs in the given order and wait for all of them."""
    futures = [publisher.publish(topic, data.encode(), ordering_key=key) for key, data in items]
    for future in futures:
        future.result(timeout=30)


def received(responses: Any, count: int) -> list[Any]:
    """The next ``count`` received messages, however many responses they come in."""
    messages: list[Any] = []
    while len(messages) < count:
        messages.extend(next(responses).received_messages)
    return messages


def test_a_key_has_one_message_out_at_a_time_and_a_nack_redelivers_it_first(
    resources: Any, subscriber: Any, ordered_publisher: Any
) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic, enable_message_ordering=True)
    publish_keyed(ordered_publisher, topic, [("A", "a1"), ("A", "a2"), ("A", "a3"), ("B", "b1"), ("", "free")])

    with raw_stream(subscriber, subscription) as (_requests, responses):
        first = next(responses)
        assert first.subscription_properties.message_ordering_enabled
        # Everything was published before the stream opened and is dispatched at once: the first
        # response holds the head of each key and the unkeyed message, and nothing else.
        assert sorted(m.message.data for m in first.received_messages) == [b"a1", b"b1", b"free"]
        by_data = {m.message.data: m for m in first.received_messages}

        subscriber.acknowledge(subscription=subscription, ack_ids=[by_data[b"a1"].ack_id])
        [a2] = received(responses, 1)
        assert a2.message.data == b"a2"
        # A nack gives a2 back; a3 stays behind it.
        subscriber.modify_ack_deadline(subscription=subscription, ack_ids=[a2.ack_id], ack_deadline_seconds=0)
        [again] = received(responses, 1)
        assert again.message.data == b"a2" and again.ack_id != a2.ack_id
        subscriber.acknowledge(subscription=subscription, ack_ids=[again.ack_id])
        [a3] = received(responses, 1)
        assert a3.message.data == b"a3"


def test_an_expired_lease_redelivers_the_message_before_the_rest_of_its_key(
    resources: Any, subscriber: Any, ordered_publisher: Any
) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic, enable_message_ordering=True)
    publish_keyed(ordered_publisher, topic, [("K", "k1"), ("K", "k2")])

    with raw_stream(subscriber, subscription, stream_ack_deadline_seconds=10) as (requests, responses):
        [k1] = received(responses, 1)
        leased_at = time.monotonic()
        assert k1.message.data == b"k1"
        # Nothing is acked: after the 10 s deadline k1 comes back, still ahead of k2.
        [again] = received(responses, 1)
        assert time.monotonic() - leased_at >= 9.0
        assert again.message.data == b"k1" and again.ack_id != k1.ack_id
        requests.send(types.StreamingPullRequest(ack_ids=[again.ack_id]))
        [k2] = received(responses, 1)
        assert k2.message.data == b"k2"


def test_official_subscriber_sees_every_key_in_publish_order_through_random_nacks(
    resources: Any, subscriber: Any, ordered_publisher: Any
) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic, enable_message_ordering=True)
    keys, per_key = 12, 15
    rng = random.Random(16)
    items = [(f"key-{k}", f"{k}:{i}") for i in range(per_key) for k in range(keys)]
    publish_keyed(ordered_publisher, topic, items)

    nacked: set[bytes] = set()

    def should_ack(message: Any) -> bool:
        # Nack about a fifth of the messages once each: each must come back before its successors.
        if message.data not in nacked and rng.random() < 0.2:
            nacked.add(message.data)
            return False
        return True

    inbox = Inbox(should_ack)
    with subscribed(subscriber, subscription, inbox):
        inbox.wait_for(lambda ms: sum(inbox.decisions) >= keys * per_key, 60, "every message acked")
    deliveries: dict[str, list[tuple[int, bool]]] = defaultdict(list)
    for message, acked in zip(inbox.messages, inbox.decisions, strict=True):
        deliveries[message.ordering_key].append((int(message.data.decode().split(":")[1]), acked))
    assert len(deliveries) == keys
    for key, seen in deliveries.items():
        expected = 0
        for index, acked in seen:
            assert index == expected, f"{key}: got message {index} while {expected} was due: {seen}"
            expected += 1 if acked else 0
        assert expected == per_key
    assert nacked, "the test nacked nothing"
