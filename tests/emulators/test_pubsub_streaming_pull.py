"""StreamingPull details through the official client's raw GAPIC call: flow control, sizes, validation."""

from __future__ import annotations

from typing import Any

import pytest
from google.api_core import exceptions
from google.pubsub_v1 import types
from pubsub_clients import Requests, first_request

pytestmark = pytest.mark.timeout(60)


def publish_all(resources: Any, topic: str, payloads: list[bytes]) -> None:
    for future in [resources.publisher.publish(topic, data) for data in payloads]:
        future.result(timeout=30)


def test_flow_control_caps_outstanding_messages_until_acks_free_room(resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    publish_all(resources, topic, [f"fc{i}".encode() for i in range(20)])

    requests = Requests(first_request(subscription, max_outstanding_messages=5))
    responses = subscriber.streaming_pull(requests=iter(requests))
    try:
        first = next(responses).received_messages
        assert len(first) == 5
        subscriber.acknowledge(subscription=subscription, ack_ids=[m.ack_id for m in first[:2]])
        second = next(responses).received_messages
        assert len(second) == 2, "two acks free room for exactly two more"
        # Acks on the stream itself count too.
        requests.send(types.StreamingPullRequest(ack_ids=[m.ack_id for m in second]))
        assert len(next(responses).received_messages) == 2
    finally:
        requests.close()
        responses.cancel()


def test_large_backlog_is_split_into_responses_under_4_mib(resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    payloads = [bytes([i]) * 1_000_000 for i in range(10)]
    publish_all(resources, topic, payloads)

    requests = Requests(first_request(subscription))
    responses = subscriber.streaming_pull(requests=iter(requests))
    received: list[bytes] = []
    try:
        while len(received) < 10:
            response = next(responses)
            assert types.StreamingPullResponse.pb(response).ByteSize() < 4 * 1024 * 1024
            received.extend(m.message.data for m in response.received_messages)
    finally:
        requests.close()
        responses.cancel()
    assert sorted(received) == sorted(payloads)


@pytest.mark.parametrize(
    "later",
    [
        types.StreamingPullRequest(modify_deadline_ack_ids=["a", "b"], modify_deadline_seconds=[10]),
        types.StreamingPullRequest(modify_deadline_ack_ids=["a"], modify_deadline_seconds=[-1]),
        types.StreamingPullRequest(max_outstanding_messages=10),
    ],
    ids=["unequal-lengths", "negative-seconds", "first-request-field-later"],
)
def test_malformed_later_requests_end_the_stream_with_invalid_argument(
    resources: Any, subscriber: Any, later: types.StreamingPullRequest
) -> None:
    subscription = resources.subscription(resources.topic())
    requests = Requests(first_request(subscription))
    requests.send(later)
    responses = subscriber.streaming_pull(requests=iter(requests))
    try:
        with pytest.raises(exceptions.InvalidArgument):
            next(responses)
    finally:
        requests.close()


@pytest.mark.parametrize("deadline", [5, 601])
def test_out_of_range_stream_ack_deadline_is_invalid_argument(resources: Any, subscriber: Any, deadline: int) -> None:
    subscription = resources.subscription(resources.topic())
    requests = Requests(types.StreamingPullRequest(subscription=subscription, stream_ack_deadline_seconds=deadline))
    responses = subscriber.streaming_pull(requests=iter(requests))
    try:
        with pytest.raises(exceptions.InvalidArgument):
            next(responses)
    finally:
        requests.close()
