"""What the Pub/Sub emulator remembers of messages that left a subscription (``GET /pubsub/finished``).

A dump after a late delivery must show what happened to a message that was finally acked (or
dead-lettered): its deliveries, nacks and expiries. The broker keeps the last
``FINISHED_MESSAGES_KEPT`` of them per subscription, oldest first.
"""

from __future__ import annotations

from typing import Any

from google.pubsub_v1 import types
from pubsub_clients import Inbox, publish_all, subscribed, wait_until

from sidecar.emulators.pubsub_model import FINISHED_MESSAGES_KEPT
from sidecar.emulators.pubsub_state import Broker

TOPIC = "projects/p/topics/topic-1"
DEAD_LETTERS = "projects/p/topics/dead-letters"
SUBSCRIPTION = "projects/p/subscriptions/sub-1"

Emulators = Any
"""The session fixture of tests/emulators/conftest.py (not importable by name)."""


def _broker(**subscription: Any) -> tuple[Broker, Any]:
    broker = Broker()
    broker.add_topic(types.Topic.pb()(name=TOPIC))
    broker.add_topic(types.Topic.pb()(name=DEAD_LETTERS))
    sub = broker.add_subscription(types.Subscription.pb()(name=SUBSCRIPTION, topic=TOPIC, **subscription))
    return broker, sub


def _events(entry: dict[str, Any]) -> list[str]:
    """The history's events without their "-1.234s " age."""
    return [event.split(" ", 1)[1] for event in entry["history"]]


async def test_an_acked_message_keeps_its_history_after_a_nack() -> None:
    broker, sub = _broker()
    [message_id] = broker.publish(TOPIC, [types.PubsubMessage.pb()(data=b"m")])
    [first] = broker.take(sub, 10)
    broker.modify_deadline(sub, [first.ack_id], 0)
    [second] = broker.take(sub, 10)
    broker.acknowledge(sub, [second.ack_id])
    assert broker.unacked_report(sub) == []
    [entry] = broker.finished_report(sub)
    assert (entry["message_id"], entry["outcome"], entry["delivery_attempt"]) == (message_id, "acked", 2)
    assert _events(entry) == [
        f"leased {first.ack_id} to a Pull",
        f"nacked {first.ack_id}",
        f"leased {second.ack_id} to a Pull",
        f"acked {second.ack_id}",
    ]


async def test_a_dead_lettered_message_is_kept_with_its_outcome() -> None:
    broker, sub = _broker(dead_letter_policy={"dead_letter_topic": DEAD_LETTERS, "max_delivery_attempts": 5})
    [message_id] = broker.publish(TOPIC, [types.PubsubMessage.pb()(data=b"m")])
    for _ in range(5):
        [lease] = broker.take(sub, 10)
        broker.modify_deadline(sub, [lease.ack_id], 0)
    [entry] = broker.finished_report(sub)
    assert (entry["message_id"], entry["outcome"], entry["delivery_attempt"]) == (message_id, "dead-lettered", 5)
    assert _events(entry)[-1] == "forwarded to the dead-letter topic"


async def test_only_the_last_messages_are_kept() -> None:
    broker, sub = _broker()
    extra = 5
    ids = broker.publish(TOPIC, [types.PubsubMessage.pb()(data=b"m") for _ in range(FINISHED_MESSAGES_KEPT + extra)])
    while leases := broker.take(sub, 1000):
        broker.acknowledge(sub, [lease.ack_id for lease in leases])
    report = broker.finished_report(sub)
    assert [entry["message_id"] for entry in report] == ids[extra:]


def test_the_admin_api_shows_acked_messages_with_the_stream_that_had_them(
    emulators: Emulators, resources: Any, subscriber: Any
) -> None:
    emulators.require_admin()
    topic = resources.topic()
    subscription = resources.subscription(topic)
    inbox = Inbox()
    with subscribed(subscriber, subscription, inbox):
        ids = publish_all(resources.publisher, topic, [b"a", b"b"])
        inbox.wait_for(lambda messages: len(messages) >= 2, 30, "both messages")

        def finished() -> list[dict[str, Any]]:
            status, body = emulators.admin("GET", f"/pubsub/finished?subscription={subscription}")
            assert status == 200, body
            return list(body)

        wait_until(lambda: {m["message_id"] for m in finished()} == set(ids), 30, "both acks")
    for entry in finished():
        assert entry["outcome"] == "acked"
        events = _events(entry)
        assert events[0].startswith("leased ") and " to stream " in events[0] and "(client " in events[0], events
        assert events[-1].startswith("acked "), events
