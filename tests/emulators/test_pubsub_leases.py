"""Lease deadlines as the official client sets them: modacks shorten and extend, counted by the emulator.

A subscriber that dies leaves its messages to their lease deadlines, so the emulator must honour the
deadline each ModifyAckDeadline sets (from now, shorter or longer than before), and the stream ack
deadline the client sends, exactly as production does. The admin API's lease report and RPC
counters make both visible.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from google.cloud import pubsub_v1
from pubsub_clients import wait_until

pytestmark = pytest.mark.timeout(90)

Emulators = Any
"""The session fixture of tests/emulators/conftest.py (not importable by name: every test folder has a
conftest module)."""


def lease_report(emulators: Emulators, subscription: str) -> list[dict[str, Any]]:
    status, body = emulators.admin("GET", f"/pubsub/leases?subscription={subscription}")
    assert status == 200, body
    return list(body)


def counters(emulators: Emulators) -> dict[str, int]:
    status, body = emulators.admin("GET", "/pubsub/counters")
    assert status == 200, body
    return dict(body)


def test_modack_shortens_a_lease_and_the_message_returns_at_the_new_deadline(
    emulators: Emulators, resources: Any, subscriber: Any
) -> None:
    emulators.require_admin()
    topic = resources.topic()
    subscription = resources.subscription(topic, ack_deadline_seconds=600)
    resources.publisher.publish(topic, b"short lease").result(timeout=30)
    [first] = subscriber.pull(subscription=subscription, max_messages=1, timeout=30).received_messages
    [lease] = lease_report(emulators, subscription)
    assert 590 < lease["seconds_left"] <= 600
    assert lease["extensions"] == 0

    before = counters(emulators)
    subscriber.modify_ack_deadline(subscription=subscription, ack_ids=[first.ack_id], ack_deadline_seconds=10)
    shortened_at = time.monotonic()
    after = counters(emulators)
    assert after["modify_ack_deadline_calls"] - before["modify_ack_deadline_calls"] == 1
    assert after["modify_ack_deadline_ack_ids"] - before["modify_ack_deadline_ack_ids"] == 1
    [lease] = lease_report(emulators, subscription)
    assert 8 < lease["seconds_left"] <= 10
    assert lease["extensions"] == 1

    again: list[Any] = []
    while not again:
        again = list(subscriber.pull(subscription=subscription, max_messages=1, timeout=30).received_messages)
        assert time.monotonic() - shortened_at < 40, "the message never came back"
    elapsed = time.monotonic() - shortened_at
    assert 9.0 <= elapsed < 40, f"redelivered {elapsed:.1f}s after the modack to 10 s"
    assert again[0].message.message_id == first.message.message_id
    status, body = emulators.admin("GET", f"/pubsub/unacked?subscription={subscription}")
    assert status == 200, body
    [unacked] = body
    assert (unacked["delivery_attempt"], unacked["leased"]) == (2, True)
    events = [event.split(" ", 1)[1] for event in unacked["history"]]
    first_id, again_id = first.ack_id, again[0].ack_id
    assert [e.split(" to ")[0] for e in events] == [
        f"leased {first_id}",
        f"deadline of {first_id} set",
        f"lease {first_id} expired",
        f"leased {again_id}",
    ], events
    assert events[0].endswith("to a Pull") and events[1].endswith("set to 10s")
    subscriber.acknowledge(subscription=subscription, ack_ids=[again[0].ack_id])
    assert lease_report(emulators, subscription) == []


def test_subscriber_with_capped_lease_extension_never_leases_for_longer(
    emulators: Emulators, resources: Any, subscriber: Any
) -> None:
    emulators.require_admin()
    topic = resources.topic()
    subscription = resources.subscription(topic)
    received = threading.Event()

    def hold(message: Any) -> None:  # never acked: the client keeps extending its lease
        received.set()

    flow = pubsub_v1.types.FlowControl(max_duration_per_lease_extension=10)
    future = subscriber.subscribe(subscription, hold, flow_control=flow)
    try:
        resources.publisher.publish(topic, b"held").result(timeout=30)
        assert received.wait(30)

        def extended() -> bool:
            leases = lease_report(emulators, subscription)
            return len(leases) == 1 and leases[0]["extensions"] >= 2  # receipt modack, then the leaser

        wait_until(extended, 30, "the client's lease extension")
        [lease] = lease_report(emulators, subscription)
        # The client's stream deadline and every modack are 10 s: never more is left.
        assert 0 < lease["seconds_left"] <= 10
    finally:
        future.cancel()
        future.result(timeout=30)


@pytest.mark.parametrize("report", ["leases", "unacked", "finished", "streams"])
def test_reports_refuse_bad_and_unknown_subscriptions(emulators: Emulators, report: str) -> None:
    emulators.require_admin()
    status, body = emulators.admin("GET", f"/pubsub/{report}?subscription=nope")
    assert status == 400 and body["error"].startswith("subscription:")
    absent = f"projects/{emulators.project}/subscriptions/absent"
    status, body = emulators.admin("GET", f"/pubsub/{report}?subscription={absent}")
    assert status == 404
