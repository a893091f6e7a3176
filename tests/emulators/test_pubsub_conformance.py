"""Pub/Sub conformance: the official google-cloud-pubsub client against the emulator (or PUBSUB_EMULATOR_HOST)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.pubsub_v1 import types
from pubsub_clients import Inbox, subscribed

pytestmark = [
    pytest.mark.timeout(120),
    # The GAPIC publish (no client-side size check) is only reachable through the deprecated `api`.
    pytest.mark.filterwarnings('ignore:The "api" property:DeprecationWarning'),
]


def dead_letter_policy(topic: str, attempts: int = 5) -> dict[str, Any]:
    return {"dead_letter_topic": topic, "max_delivery_attempts": attempts}


def test_publisher_batching_delivers_all_10000_messages_once(resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    publisher = pubsub_v1.PublisherClient(
        batch_settings=pubsub_v1.types.BatchSettings(max_messages=500, max_latency=0.01)
    )
    futures = [publisher.publish(topic, f"m{i}".encode(), index=str(i)) for i in range(10_000)]
    ids = [f.result(timeout=60) for f in futures]
    assert len(set(ids)) == 10_000

    inbox = Inbox()
    with subscribed(subscriber, subscription, inbox, max_messages=2000):
        inbox.wait_for(lambda ms: len({m.data for m in ms}) >= 10_000, 60, "all 10,000 messages")
    received = inbox.messages
    assert {m.data for m in received} == {f"m{i}".encode() for i in range(10_000)}
    assert {m.message_id for m in received} == set(ids)
    assert all(m.publish_time is not None and m.attributes["index"] == m.data[1:].decode() for m in received)


def test_unacked_message_returns_after_ack_deadline_with_next_delivery_attempt(resources: Any, subscriber: Any) -> None:
    topic, dlq = resources.topic(), resources.topic("dlq")
    subscription = resources.subscription(topic, ack_deadline_seconds=10, dead_letter_policy=dead_letter_policy(dlq))
    resources.publisher.publish(topic, b"expiring").result(timeout=30)

    first = subscriber.pull(subscription=subscription, max_messages=1, timeout=30).received_messages
    assert len(first) == 1 and first[0].delivery_attempt == 1
    leased_at = time.monotonic()
    again: list[Any] = []
    while not again:
        again = list(subscriber.pull(subscription=subscription, max_messages=1, timeout=30).received_messages)
        assert time.monotonic() - leased_at < 40, "the message never came back"
    elapsed = time.monotonic() - leased_at
    assert elapsed >= 9.0, f"redelivered after {elapsed:.1f} s, before the 10 s ack deadline"
    assert again[0].message.message_id == first[0].message.message_id
    assert again[0].delivery_attempt == 2
    assert again[0].ack_id != first[0].ack_id
    subscriber.acknowledge(subscription=subscription, ack_ids=[again[0].ack_id])
    # The stale ack id of the first delivery is accepted and ignored, as production does.
    subscriber.acknowledge(subscription=subscription, ack_ids=[first[0].ack_id])


def test_nack_redelivers_at_once_with_next_delivery_attempt(resources: Any, subscriber: Any) -> None:
    topic, dlq = resources.topic(), resources.topic("dlq")
    subscription = resources.subscription(topic, dead_letter_policy=dead_letter_policy(dlq, 10))
    resources.publisher.publish(topic, b"nack-me").result(timeout=30)

    inbox = Inbox(should_ack=lambda m: m.delivery_attempt >= 2)
    with subscribed(subscriber, subscription, inbox):
        inbox.wait_for(lambda ms: len(ms) >= 2, 30, "the redelivery after a nack")
    first, second = inbox.messages[:2]
    assert (first.delivery_attempt, second.delivery_attempt) == (1, 2)
    assert first.message_id == second.message_id
    # Far below the 10 s ack deadline: the nack, not an expiry, brought it back.
    assert inbox.arrived_at[1] - inbox.arrived_at[0] < 5.0


def test_message_is_dead_lettered_after_max_delivery_attempts(resources: Any, subscriber: Any) -> None:
    topic, dlq = resources.topic(), resources.topic("dlq")
    subscription = resources.subscription(topic, dead_letter_policy=dead_letter_policy(dlq, 5))
    dlq_subscription = resources.subscription(dlq, "dlq-s")
    resources.publisher.publish(topic, b"poison", kind="poison").result(timeout=30)

    rejected, dead = Inbox(should_ack=lambda m: False), Inbox()
    with subscribed(subscriber, subscription, rejected), subscribed(subscriber, dlq_subscription, dead):
        dead.wait_for(lambda ms: len(ms) >= 1, 60, "the message on the dead-letter topic")
    assert [m.delivery_attempt for m in rejected.messages[:5]] == [1, 2, 3, 4, 5]
    assert len(rejected.messages) == 5
    assert dead.messages[0].data == b"poison"
    assert dead.messages[0].attributes["kind"] == "poison"


def test_each_subscription_gets_every_message(resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    first, second = resources.subscription(topic, "a"), resources.subscription(topic, "b")
    expected = {f"fan-{i}".encode() for i in range(200)}
    for future in [resources.publisher.publish(topic, data) for data in expected]:
        future.result(timeout=30)

    inbox_a, inbox_b = Inbox(), Inbox()
    with subscribed(subscriber, first, inbox_a), subscribed(subscriber, second, inbox_b):
        inbox_a.wait_for(lambda ms: len({m.data for m in ms}) >= 200, 30, "subscription a")
        inbox_b.wait_for(lambda ms: len({m.data for m in ms}) >= 200, 30, "subscription b")
    assert set(inbox_a.data()) == expected == set(inbox_b.data())


def test_subscription_gets_only_messages_published_after_it_exists(resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    resources.publisher.publish(topic, b"before").result(timeout=30)
    subscription = resources.subscription(topic)
    resources.publisher.publish(topic, b"after").result(timeout=30)

    inbox = Inbox()
    with subscribed(subscriber, subscription, inbox):
        inbox.wait_for(lambda ms: b"after" in [m.data for m in ms], 30, "the message published after")
    # Delivery is FIFO here, so "before" would have come first had it been fanned out.
    assert inbox.data() == [b"after"]


def test_ordering_keys_and_attributes_round_trip(resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic, enable_message_ordering=True)
    assert subscriber.get_subscription(subscription=subscription).enable_message_ordering is True
    publisher = pubsub_v1.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
    )
    keys = ["alpha", "beta", "gamma"]
    futures = [
        publisher.publish(topic, f"{key}:{i}".encode(), ordering_key=key, seq=str(i), key=key, empty="")
        for i in range(30)
        for key in keys
    ]
    for future in futures:
        future.result(timeout=30)

    inbox = Inbox()
    with subscribed(subscriber, subscription, inbox):
        inbox.wait_for(lambda ms: len(ms) >= 90, 30, "90 ordered messages")
    by_key: dict[str, list[int]] = defaultdict(list)
    for message in inbox.messages:
        assert message.ordering_key == message.attributes["key"]
        assert message.attributes["empty"] == ""
        assert message.data == f"{message.ordering_key}:{message.attributes['seq']}".encode()
        by_key[message.ordering_key].append(int(message.attributes["seq"]))
    assert by_key == {key: list(range(30)) for key in keys}


def test_topic_and_subscription_admin_round_trip(resources: Any, subscriber: Any) -> None:
    publisher = resources.publisher
    topic, dlq = resources.topic(), resources.topic("dlq")
    project_path = f"projects/{resources.project}"
    assert publisher.get_topic(topic=topic).name == topic
    assert topic in {t.name for t in publisher.list_topics(project=project_path)}

    subscription = resources.subscription(
        topic,
        dead_letter_policy=dead_letter_policy(dlq, 7),
        retry_policy={"minimum_backoff": {"seconds": 0}, "maximum_backoff": {"seconds": 5}},
    )
    got = subscriber.get_subscription(subscription=subscription)
    assert got.topic == topic
    assert got.ack_deadline_seconds == 10  # 0 means production's default
    assert got.dead_letter_policy.dead_letter_topic == dlq
    assert got.dead_letter_policy.max_delivery_attempts == 7
    assert got.retry_policy.maximum_backoff.total_seconds() == 5
    assert got.enable_message_ordering is False
    assert list(publisher.list_topic_subscriptions(topic=topic)) == [subscription]
    assert subscription in {s.name for s in subscriber.list_subscriptions(project=project_path)}

    updated = subscriber.update_subscription(
        request={
            "subscription": {"name": subscription, "ack_deadline_seconds": 42},
            "update_mask": {"paths": ["ack_deadline_seconds"]},
        }
    )
    assert updated.ack_deadline_seconds == 42
    assert subscriber.get_subscription(subscription=subscription).ack_deadline_seconds == 42
    assert updated.dead_letter_policy.max_delivery_attempts == 7

    publisher.delete_topic(topic=topic)
    assert subscriber.get_subscription(subscription=subscription).topic == "_deleted-topic_"
    with pytest.raises(exceptions.NotFound):
        publisher.get_topic(topic=topic)
    subscriber.delete_subscription(subscription=subscription)
    with pytest.raises(exceptions.NotFound):
        subscriber.get_subscription(subscription=subscription)


@pytest.mark.parametrize(
    "topic_id",
    ["ab", "1starts-with-digit", "goog-reserved", "has space", "x" * 256, "bad/slash"],
)
def test_malformed_topic_names_are_invalid_argument(resources: Any, topic_id: str) -> None:
    with pytest.raises(exceptions.InvalidArgument):
        resources.publisher.create_topic(name=f"projects/{resources.project}/topics/{topic_id}")


def test_errors_carry_the_real_status_codes(resources: Any, subscriber: Any) -> None:
    publisher = resources.publisher
    topic = resources.topic()
    missing_topic = publisher.topic_path(resources.project, "never-created-topic")
    missing_sub = subscriber.subscription_path(resources.project, "never-created-sub")

    with pytest.raises(exceptions.AlreadyExists):
        publisher.create_topic(name=topic)
    with pytest.raises(exceptions.NotFound):
        publisher.get_topic(topic=missing_topic)
    with pytest.raises(exceptions.NotFound):
        publisher.publish(missing_topic, b"x").result(timeout=30)
    with pytest.raises(exceptions.NotFound):
        resources.subscription(missing_topic)
    with pytest.raises(exceptions.InvalidArgument):
        resources.subscription(topic, ack_deadline_seconds=5)
    with pytest.raises(exceptions.InvalidArgument):
        resources.subscription(topic, dead_letter_policy=dead_letter_policy(topic, 3))
    subscription = resources.subscription(topic)
    with pytest.raises(exceptions.AlreadyExists):
        subscriber.create_subscription(request={"name": subscription, "topic": topic})
    with pytest.raises(exceptions.NotFound):
        subscriber.acknowledge(subscription=missing_sub, ack_ids=["1-1"])
    with pytest.raises(exceptions.InvalidArgument):
        subscriber.modify_ack_deadline(subscription=subscription, ack_ids=["1-1"], ack_deadline_seconds=601)
    with pytest.raises(exceptions.InvalidArgument):
        publisher.api.publish(
            request=types.PublishRequest(topic=topic, messages=[{"data": b"x" * (10 * 1000 * 1000 + 1)}]),
            retry=None,
        )
    with pytest.raises(exceptions.InvalidArgument):
        publisher.api.publish(request=types.PublishRequest(topic=topic, messages=[{}]), retry=None)


def test_streaming_pull_on_missing_subscription_fails_with_not_found(resources: Any, subscriber: Any) -> None:
    future = subscriber.subscribe(subscriber.subscription_path(resources.project, "no-such-sub"), Inbox())
    with pytest.raises(exceptions.NotFound):
        future.result(timeout=30)
