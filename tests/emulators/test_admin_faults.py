"""Faults switched on through the admin HTTP API take effect on the official clients' calls."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from google.api_core import exceptions

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def admin(emulators: Any) -> Iterator[Any]:
    emulators.require_admin()
    yield emulators
    assert emulators.admin("DELETE", "/faults")[0] == 200
    assert emulators.admin("DELETE", "/pubsub/delay")[0] == 200


class Received:
    """Subscriber callback that acks and lets the test wait for a given payload."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.at: dict[bytes, float] = {}

    def __call__(self, message: Any) -> None:
        message.ack()
        with self._cond:
            self.at.setdefault(message.data, time.monotonic())
            self._cond.notify_all()

    def wait(self, data: bytes, timeout: float = 30) -> float:
        with self._cond:
            assert self._cond.wait_for(lambda: data in self.at, timeout), f"{data!r} never arrived"
            return self.at[data]


def test_admin_api_rejects_bad_input_with_the_reason(admin: Any) -> None:
    assert admin.admin("GET", "/healthz") == (200, {"status": "ok"})
    status, body = admin.admin("POST", "/faults", {"service": "pubsub", "code": "NO_SUCH_CODE"})
    assert status == 400 and "code" in body["error"]
    status, body = admin.admin("POST", "/faults", {"service": "pubsub", "rate": 2})
    assert status == 400 and "rate" in body["error"]
    status, body = admin.admin("POST", "/faults", {"service": "ftp"})
    assert status == 400 and "service" in body["error"]
    status, body = admin.admin("POST", "/faults", b"{not json")
    assert status == 400 and "JSON" in body["error"]
    status, body = admin.admin("POST", "/streams/break", {"service": "pubsub", "code": "OK"})
    assert status == 400 and "code" in body["error"]
    status, body = admin.admin("POST", "/pubsub/delay", {"seconds": -1})
    assert status == 400 and "seconds" in body["error"]
    assert admin.admin("GET", "/faults") == (200, [])


def test_injected_retryable_publish_failures_are_retried_by_the_client(admin: Any, resources: Any) -> None:
    topic = resources.topic()
    status, rule = admin.admin(
        "POST", "/faults", {"service": "pubsub", "method": "Publish", "code": "UNAVAILABLE", "remaining": 2}
    )
    assert status == 201 and rule["remaining"] == 2
    assert resources.publisher.publish(topic, b"despite faults").result(timeout=60)
    [active] = admin.admin("GET", "/faults")[1]
    assert active["remaining"] == 0, "both injected failures were consumed by the client's retries"


def test_injected_terminal_code_reaches_the_caller(admin: Any, resources: Any) -> None:
    topic = resources.topic()
    admin.admin("POST", "/faults", {"service": "pubsub", "method": "GetTopic", "code": "PERMISSION_DENIED"})
    with pytest.raises(exceptions.PermissionDenied):
        resources.publisher.get_topic(topic=topic)
    admin.admin("DELETE", "/faults?service=pubsub")
    assert resources.publisher.get_topic(topic=topic).name == topic


def test_broken_streams_are_reopened_by_the_subscriber(admin: Any, resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    received = Received()
    future = subscriber.subscribe(subscription, received)
    try:
        resources.publisher.publish(topic, b"before break").result(timeout=30)
        received.wait(b"before break")
        status, body = admin.admin("POST", "/streams/break", {"service": "pubsub", "code": "UNAVAILABLE"})
        assert status == 200 and body["broken"] >= 1
        resources.publisher.publish(topic, b"after break").result(timeout=30)
        received.wait(b"after break")
        assert not future.done(), "UNAVAILABLE must make the client reconnect, not stop"
    finally:
        future.cancel()
        future.result(timeout=30)


def test_delayed_deliveries_arrive_after_the_delay(admin: Any, resources: Any, subscriber: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    assert admin.admin("POST", "/pubsub/delay", {"seconds": 1.5, "subscription": subscription})[0] == 200
    received = Received()
    future = subscriber.subscribe(subscription, received)
    try:
        published_at = time.monotonic()
        resources.publisher.publish(topic, b"late").result(timeout=30)
        assert received.wait(b"late") - published_at >= 1.4
    finally:
        future.cancel()
        future.result(timeout=30)


def test_a_lost_reply_applies_the_call_and_fails_only_its_answer(admin: Any, resources: Any) -> None:
    status, rule = admin.admin(
        "POST",
        "/faults",
        {"service": "pubsub", "method": "CreateTopic", "code": "UNAVAILABLE", "lose_reply": True, "remaining": 1},
    )
    assert status == 201 and rule["lose_reply"] is True
    topic = resources.publisher.topic_path(resources.project, f"lost-{uuid.uuid4().hex[:12]}")
    resources.topics.append(topic)
    with pytest.raises(exceptions.ServiceUnavailable, match="reply lost"):
        resources.publisher.create_topic(name=topic, retry=None)
    # The caller saw an error, yet the topic exists: its retry meets ALREADY_EXISTS.
    assert resources.publisher.get_topic(topic=topic).name == topic
    with pytest.raises(exceptions.AlreadyExists):
        resources.publisher.create_topic(name=topic, retry=None)


def test_a_publish_whose_reply_is_lost_is_stored_twice_by_the_clients_retry(admin: Any, resources: Any) -> None:
    topic = resources.topic()
    subscription = resources.subscription(topic)
    admin.admin(
        "POST",
        "/faults",
        {"service": "pubsub", "method": "Publish", "code": "UNAVAILABLE", "lose_reply": True, "remaining": 1},
    )
    resources.publisher.publish(topic, b"once").result(timeout=60)
    assert admin.admin("GET", "/faults")[1][0]["remaining"] == 0
    pulled: list[Any] = []
    deadline = time.monotonic() + 30
    while len(pulled) < 2:
        assert time.monotonic() < deadline, f"both copies of the published message never arrived: {pulled}"
        response = resources.subscriber.pull(subscription=subscription, max_messages=10, timeout=5)
        pulled.extend(m.message for m in response.received_messages)
    assert [m.data for m in pulled] == [b"once", b"once"]
    assert pulled[0].message_id != pulled[1].message_id, "two stored messages, as production's retried publish"


def test_lose_reply_rules_are_validated(admin: Any) -> None:
    status, body = admin.admin("POST", "/faults", {"service": "firestore", "lose_reply": "yes"})
    assert status == 400 and "lose_reply" in body["error"]
    status, body = admin.admin("POST", "/faults", {"service": "firestore", "code": None, "lose_reply": True})
    assert status == 400 and "lose_reply" in body["error"]
    assert admin.admin("GET", "/faults") == (200, [])
