"""Snapshots, Seek and message retention through the official subscriber client.

These tests move the emulator's retention clock (admin API ``/pubsub/clock``) by days, so they run
against emulators of their own (``private_emulators``): no other test sees the aged messages.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from google.api_core import exceptions
from google.protobuf import timestamp_pb2
from pubsub_clients import PrivateEmulators

pytestmark = pytest.mark.timeout(120)

DAY = 24 * 3600


class World:
    """Topics, subscriptions and snapshots of one test on the private emulators."""

    def __init__(self, private: PrivateEmulators) -> None:
        self.private = private
        self.publisher = private.publisher
        self.subscriber = private.subscriber
        self.project = private.emulators.project

    def name(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:10]}"

    def topic(self, **fields: Any) -> str:
        path = self.publisher.topic_path(self.project, self.name("t"))
        self.publisher.create_topic(request={"name": path, **fields})
        return path

    def subscription(self, topic: str, **fields: Any) -> str:
        path = self.subscriber.subscription_path(self.project, self.name("s"))
        self.subscriber.create_subscription(request={"name": path, "topic": topic, **fields})
        return path

    def snapshot_path(self) -> str:
        return self.subscriber.snapshot_path(self.project, self.name("snap"))

    def publish(self, topic: str, *payloads: bytes) -> list[Any]:
        """Publish one at a time (distinct publish times); returns what a Pull of them shows later."""
        return [self.publisher.publish(topic, data).result(timeout=30) for data in payloads]

    def pull(self, subscription: str, *, ack: bool = True) -> list[bytes]:
        """Everything available now (a Pull waits a second when there is nothing), acked by default."""
        received: list[Any] = []
        while True:
            response = self.subscriber.pull(subscription=subscription, max_messages=100, timeout=30)
            if not response.received_messages:
                break
            received.extend(response.received_messages)
            if ack:
                self.subscriber.acknowledge(
                    subscription=subscription, ack_ids=[m.ack_id for m in response.received_messages]
                )
        return sorted(m.message.data for m in received)

    def pull_messages(self, subscription: str, count: int) -> list[Any]:
        received: list[Any] = []
        while len(received) < count:
            response = self.subscriber.pull(subscription=subscription, max_messages=count - len(received), timeout=30)
            received.extend(response.received_messages)
        return received

    def advance_clock(self, seconds: float) -> None:
        status, body = self.private.emulators.admin("POST", "/pubsub/clock", {"advance_seconds": seconds})
        assert status == 200, body


@pytest.fixture
def world(private_emulators: PrivateEmulators) -> Iterator[World]:
    yield World(private_emulators)


def test_seek_to_a_snapshot_replays_its_backlog_and_everything_published_after_it(world: World) -> None:
    topic = world.topic()
    subscription = world.subscription(topic)
    world.publish(topic, b"before-1", b"before-2")
    snapshot = world.snapshot_path()
    created = world.subscriber.create_snapshot(
        request={"name": snapshot, "subscription": subscription, "labels": {"why": "deploy"}}
    )
    assert created.name == snapshot and created.topic == topic and created.labels == {"why": "deploy"}
    world.publish(topic, b"after-1")
    assert world.pull(subscription) == [b"after-1", b"before-1", b"before-2"]
    assert world.pull(subscription) == [], "all acked"

    world.subscriber.seek(request={"subscription": subscription, "snapshot": snapshot})
    assert world.pull(subscription) == [b"after-1", b"before-1", b"before-2"]
    world.subscriber.delete_snapshot(request={"snapshot": snapshot})


def test_snapshot_admin_get_list_update_delete(world: World) -> None:
    topic = world.topic()
    subscription = world.subscription(topic)
    [first_id] = world.publish(topic, b"oldest")
    snapshot = world.snapshot_path()
    created = world.subscriber.create_snapshot(request={"name": snapshot, "subscription": subscription})
    # 7 days minus the age of the oldest unacked message: 7 days from its publish time.
    [oldest] = world.pull_messages(subscription, 1)
    assert oldest.message.message_id == first_id
    expected_expiry = oldest.message.publish_time + datetime.timedelta(days=7)
    assert abs((created.expire_time - expected_expiry).total_seconds()) < 1
    assert world.subscriber.get_snapshot(request={"snapshot": snapshot}) == created
    listed = list(world.subscriber.list_snapshots(request={"project": f"projects/{world.project}"}))
    assert snapshot in [s.name for s in listed]

    updated = world.subscriber.update_snapshot(
        request={"snapshot": {"name": snapshot, "labels": {"team": "ops"}}, "update_mask": {"paths": ["labels"]}}
    )
    assert updated.labels == {"team": "ops"} and updated.expire_time == created.expire_time
    with pytest.raises(exceptions.InvalidArgument):
        world.subscriber.update_snapshot(
            request={
                "snapshot": {"name": snapshot, "topic": "projects/p/topics/other"},
                "update_mask": {"paths": ["topic"]},
            }
        )
    world.subscriber.delete_snapshot(request={"snapshot": snapshot})
    with pytest.raises(exceptions.NotFound):
        world.subscriber.get_snapshot(request={"snapshot": snapshot})
    with pytest.raises(exceptions.NotFound):
        world.subscriber.delete_snapshot(request={"snapshot": snapshot})


def test_seek_to_a_time_with_retained_acked_messages_replays_from_that_time(world: World) -> None:
    topic = world.topic()
    subscription = world.subscription(topic, retain_acked_messages=True)
    world.publish(topic, b"m1", b"m2", b"m3")
    received = world.pull_messages(subscription, 3)
    world.subscriber.acknowledge(subscription=subscription, ack_ids=[m.ack_id for m in received])
    publish_time = {m.message.data: m.message.publish_time for m in received}

    world.subscriber.seek(request={"subscription": subscription, "time": publish_time[b"m2"]})
    assert world.pull(subscription) == [b"m2", b"m3"], "published at or after the time: unacked again"
    world.subscriber.seek(request={"subscription": subscription, "time": timestamp_pb2.Timestamp(seconds=0)})
    assert world.pull(subscription) == [b"m1", b"m2", b"m3"]


def test_seek_without_retained_acked_messages_only_moves_the_unacked_ones(world: World) -> None:
    topic = world.topic()
    subscription = world.subscription(topic)
    world.publish(topic, b"acked", b"unacked")
    received = {m.message.data: m for m in world.pull_messages(subscription, 2)}
    world.subscriber.acknowledge(subscription=subscription, ack_ids=[received[b"acked"].ack_id])

    # Back to the start: the acked message is not retained, so only the unacked one is there (again:
    # its lease was revoked by the seek).
    world.subscriber.seek(request={"subscription": subscription, "time": timestamp_pb2.Timestamp(seconds=0)})
    assert world.pull(subscription, ack=False) == [b"unacked"]
    # Forward past it: it is marked acked.
    future = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    world.subscriber.seek(request={"subscription": subscription, "time": future})
    assert world.pull(subscription) == []


def test_retention_expunges_old_messages_and_a_seek_before_the_window_restores_only_retained_ones(world: World) -> None:
    topic = world.topic()
    subscription = world.subscription(
        topic, retain_acked_messages=True, message_retention_duration=datetime.timedelta(minutes=10)
    )
    world.publish(topic, b"old-acked")
    assert world.pull(subscription) == [b"old-acked"]
    world.publish(topic, b"old-unacked")
    world.advance_clock(11 * 60)
    world.publish(topic, b"new")
    # The unacked message older than the retention is gone, delivered or not.
    assert world.pull(subscription) == [b"new"]

    world.subscriber.seek(request={"subscription": subscription, "time": timestamp_pb2.Timestamp(seconds=0)})
    assert world.pull(subscription) == [b"new"], "expunged messages are not restored"


def test_topic_retention_lets_a_new_subscription_seek_back_before_it_existed(world: World) -> None:
    topic = world.topic(message_retention_duration=datetime.timedelta(days=1))
    world.publish(topic, b"before-the-subscription")
    subscription = world.subscription(topic)
    config = world.subscriber.get_subscription(subscription=subscription)
    assert config.topic_message_retention_duration == datetime.timedelta(days=1)
    assert world.pull(subscription) == []
    world.subscriber.seek(request={"subscription": subscription, "time": timestamp_pb2.Timestamp(seconds=0)})
    assert world.pull(subscription) == [b"before-the-subscription"]


def test_snapshot_lifetime_follows_the_oldest_unacked_message_and_expires(world: World) -> None:
    topic = world.topic()
    subscription = world.subscription(topic)
    world.publish(topic, b"ageing")
    early = world.snapshot_path()
    world.subscriber.create_snapshot(request={"name": early, "subscription": subscription})

    # The backlog is now 6 days 23.5 hours old: a snapshot would live less than an hour.
    world.advance_clock(7 * DAY - 30 * 60)
    with pytest.raises(exceptions.FailedPrecondition, match="less than 1 hour"):
        world.subscriber.create_snapshot(request={"name": world.snapshot_path(), "subscription": subscription})
    assert world.subscriber.get_snapshot(request={"snapshot": early}).name == early

    world.advance_clock(31 * 60)
    with pytest.raises(exceptions.NotFound):
        world.subscriber.get_snapshot(request={"snapshot": early})
    with pytest.raises(exceptions.NotFound):
        world.subscriber.seek(request={"subscription": subscription, "snapshot": early})
    # Both the message (7-day retention) and the snapshot are gone; an empty backlog snapshots fine.
    assert world.pull(subscription) == []
    fresh = world.subscriber.create_snapshot(request={"name": world.snapshot_path(), "subscription": subscription})
    assert fresh.expire_time > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=6)


def test_bad_snapshot_and_seek_requests_get_production_codes(world: World) -> None:
    topic, other_topic = world.topic(), world.topic()
    subscription, other = world.subscription(topic), world.subscription(other_topic)
    snapshot = world.snapshot_path()
    world.subscriber.create_snapshot(request={"name": snapshot, "subscription": subscription})
    subscriber = world.subscriber
    project = world.project
    missing_sub = subscriber.subscription_path(project, "no-such-sub")
    missing_snapshot = subscriber.snapshot_path(project, "no-such-snapshot")
    create = subscriber.create_snapshot
    cases: list[tuple[type[Exception], Any]] = [
        (exceptions.AlreadyExists, lambda: create(request={"name": snapshot, "subscription": subscription})),
        (exceptions.NotFound, lambda: create(request={"name": world.snapshot_path(), "subscription": missing_sub})),
        (exceptions.InvalidArgument, lambda: create(
            request={"name": f"projects/{project}/snapshots/x", "subscription": subscription})),
        (exceptions.InvalidArgument, lambda: create(request={"name": snapshot, "subscription": ""})),
        (exceptions.InvalidArgument, lambda: subscriber.get_snapshot(request={"snapshot": "snapshots/x"})),
        (exceptions.InvalidArgument, lambda: subscriber.list_snapshots(request={"project": "project-without-prefix"})),
        (exceptions.InvalidArgument, lambda: subscriber.seek(request={"subscription": subscription})),
        (exceptions.NotFound, lambda: subscriber.seek(
            request={"subscription": subscription, "snapshot": missing_snapshot})),
        (exceptions.FailedPrecondition, lambda: subscriber.seek(request={"subscription": other, "snapshot": snapshot})),
        (exceptions.NotFound, lambda: subscriber.seek(request={"subscription": missing_sub, "snapshot": snapshot})),
        (exceptions.InvalidArgument, lambda: world.subscription(
            topic, message_retention_duration=datetime.timedelta(minutes=5))),
        (exceptions.InvalidArgument, lambda: world.subscription(
            topic, message_retention_duration=datetime.timedelta(days=32))),
        (exceptions.InvalidArgument, lambda: world.topic(message_retention_duration=datetime.timedelta(days=40))),
    ]  # fmt: skip
    for index, (expected, call) in enumerate(cases):
        with pytest.raises(expected):
            call()
            pytest.fail(f"case {index} was accepted")
    # A listing still pages, and a created snapshot with no name gets one in the subscription's project.
    generated = subscriber.create_snapshot(request={"subscription": subscription})
    assert generated.name.startswith(f"projects/{project}/snapshots/")


def test_clock_admin_api_refuses_bad_input(world: World) -> None:
    emulators = world.private.emulators
    assert emulators.admin("POST", "/pubsub/clock", {"advance_seconds": -1})[0] == 400
    assert emulators.admin("POST", "/pubsub/clock", {"seconds": 1})[0] == 400
    assert emulators.admin("POST", "/pubsub/clock", b"not json")[0] == 400
    status, body = emulators.admin("GET", "/pubsub/clock")
    assert status == 200 and body["offset_seconds"] >= 0
