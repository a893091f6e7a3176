"""Messages of one subscription are spread over all its open StreamingPull streams, as production does:
every stream with flow-control room gets a share, not just the first one to wake."""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import pytest
from google.cloud import pubsub_v1
from pubsub_clients import Inbox, publish_all, raw_stream, subscribed

pytestmark = pytest.mark.timeout(120)

CLIENTS = 3
MESSAGES = 300


def test_three_official_subscribers_on_one_subscription_each_get_a_fair_share(resources: Any, emulators: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    # One SubscriberClient each: separate channels and streams, as separate pods would have.
    clients = [pubsub_v1.SubscriberClient() for _ in range(CLIENTS)]
    inboxes = [Inbox() for _ in range(CLIENTS)]
    with ExitStack() as stack:
        for client, inbox in zip(clients, inboxes, strict=True):
            stack.callback(client.close)
            stack.enter_context(subscribed(client, subscription, inbox))
        # Warm-up: single messages until every client has one, which shows that all three streams
        # are open (the clients open them in the background) and that single messages rotate.
        deadline = time.monotonic() + 60
        warm = 0
        while not all(inbox.messages for inbox in inboxes):
            assert time.monotonic() < deadline, f"not every client received a warm-up message: {warm} sent"
            # Counted before publishing: the message may be in an inbox before the publish returns.
            before = sum(len(inbox.messages) for inbox in inboxes)
            publish_all(resources.publisher, topic, [f"warm-{warm}".encode()])
            wait_for_total(inboxes, before + 1)
            warm += 1

        publish_all(resources.publisher, topic, [f"m{i}".encode() for i in range(MESSAGES)])
        wait_for_total(inboxes, warm + MESSAGES)
    counts = [sum(not m.data.startswith(b"warm") for m in inbox.messages) for inbox in inboxes]
    assert sum(counts) == MESSAGES
    # An equal share is 100 each; every client must get a substantial part of it.
    assert min(counts) >= MESSAGES // CLIENTS // 2, f"uneven spread over the streams: {counts}"


def test_a_stream_without_flow_control_room_gets_nothing_and_the_other_gets_the_rest(
    resources: Any, subscriber: Any
) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    with raw_stream(subscriber, subscription, max_outstanding_messages=2) as (_r1, small):
        publish_all(resources.publisher, topic, [b"first-1", b"first-2"])
        got_small = [m.message.data for m in next(small).received_messages]
        while len(got_small) < 2:
            got_small.extend(m.message.data for m in next(small).received_messages)
        # The small stream is full and acks nothing: ten more all go to the new stream.
        with raw_stream(subscriber, subscription) as (_r2, big):
            publish_all(resources.publisher, topic, [f"second-{i}".encode() for i in range(10)])
            got_big: list[bytes] = []
            while len(got_big) < 10:
                got_big.extend(m.message.data for m in next(big).received_messages)
    assert sorted(got_small) == [b"first-1", b"first-2"]
    assert sorted(got_big) == sorted(f"second-{i}".encode() for i in range(10))


def wait_for_total(inboxes: list[Inbox], total: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(len(inbox.messages) for inbox in inboxes) < total:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {total} messages over all clients")
        time.sleep(0.02)
