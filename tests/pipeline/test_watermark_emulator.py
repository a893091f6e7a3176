"""WatermarkSource against the Monitoring emulator, which samples the Pub/Sub emulator's real backlog.

Metric period 1 s and visibility delay 2 s (production: 60 s and 120 s), so ``max_metric_delay`` is
3 s plus 1 s of slack for a sampler running late on a busy machine. The stack runs in the test's own
loop, so the emulator's truth (``stack.pubsub.backlogs()``) can be read at the very moment each
watermark is applied. ``safety_margin`` is 0: the rule alone must keep the watermark below the truth.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from google.cloud import pubsub_v1

from sidecar.emulators.stack import EmulatorStack
from sidecar.pipeline.watermark_source import WatermarkSource

PROJECT = "watermark-tests"
PERIOD_S = 1.0
VISIBILITY_S = 2.0
MAX_METRIC_DELAY_MS = 4_000
POLL_S = 0.2
WAIT_S = 20.0
"""Generous: other suites share the two cores."""


@dataclass
class Observed:
    """Each watermark the source applied, with the emulator's oldest unacked publish time at that instant."""

    subscription: str
    stack: EmulatorStack
    applied: list[tuple[int, int | None]] = field(default_factory=list)

    def __call__(self, watermark_ms: int) -> None:
        assert self.stack.pubsub is not None
        backlog = self.stack.pubsub.backlogs().get(self.subscription)
        oldest_ms = None if backlog is None else backlog.oldest_publish_time_ns // 1_000_000
        self.applied.append((watermark_ms, oldest_ms))

    def violations(self) -> list[tuple[int, int | None]]:
        return [(w, oldest) for w, oldest in self.applied if oldest is not None and w >= oldest]


@dataclass
class World:
    stack: EmulatorStack
    publisher: pubsub_v1.PublisherClient
    subscriber: pubsub_v1.SubscriberClient
    topic: str
    subscription: str
    subscription_id: str

    def source(self, observed: Observed, **kwargs: float) -> WatermarkSource:
        return WatermarkSource(
            PROJECT,
            self.subscription_id,
            POLL_S,
            0,
            0,
            MAX_METRIC_DELAY_MS,
            observed,
            **kwargs,
        )

    async def publish(self, count: int) -> None:
        futures = [self.publisher.publish(self.topic, f"m{i}".encode()) for i in range(count)]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    async def admin(self, method: str, path: str, body: dict[str, object] | None = None) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.stack.admin_url + path, json=body) as response,
        ):
            response.raise_for_status()


@pytest.fixture
async def world(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    async with EmulatorStack(metric_period=PERIOD_S, metric_delay=VISIBILITY_S) as stack:
        for name, value in stack.env.items():
            monkeypatch.setenv(name, value)
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
        suffix = uuid.uuid4().hex[:8]
        topic = f"projects/{PROJECT}/topics/t-{suffix}"
        subscription_id = f"s-{suffix}"
        subscription = f"projects/{PROJECT}/subscriptions/{subscription_id}"
        # The sync admin calls need this loop free: it serves them.
        await asyncio.to_thread(publisher.create_topic, name=topic)
        await asyncio.to_thread(subscriber.create_subscription, name=subscription, topic=topic)
        try:
            yield World(stack, publisher, subscriber, topic, subscription, subscription_id)
        finally:
            await asyncio.to_thread(publisher.stop)
            await asyncio.to_thread(subscriber.close)


async def wait_for(predicate: Callable[[], bool], what: str, deadline_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def stop(task: asyncio.Task[None], source: WatermarkSource) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await source.close()


async def test_watermark_follows_backlog_then_advances_when_acked(world: World) -> None:
    observed = Observed(world.subscription, world.stack)
    source = world.source(observed)
    task = asyncio.create_task(source.run())
    try:
        await world.publish(5)
        assert world.stack.pubsub is not None
        oldest_ms = world.stack.pubsub.backlogs()[world.subscription].oldest_publish_time_ns // 1_000_000
        # Nobody acks: wait until the missing-point rule alone would have passed the backlog, and a
        # point showing that backlog is visible. The point must win.
        await wait_for(
            lambda: (
                time.time() * 1000 > oldest_ms + MAX_METRIC_DELAY_MS + 2_000
                and source.status().newest_point is not None
                and source.status().newest_point.end_time_ms > oldest_ms
            ),  # type: ignore[union-attr]
            "a visible point of the backlog, well past max_metric_delay",
        )
        status = source.status()
        assert status.rule == "point"
        assert status.watermark_ms is not None and status.watermark_ms < oldest_ms
        assert observed.violations() == []

        # Ack everything: points stop (an empty backlog has none) and rule 2 takes W past the messages.
        newest_publish_ms = int(time.time() * 1000)
        received: list[pubsub_v1.subscriber.message.Message] = []

        def ack(message: pubsub_v1.subscriber.message.Message) -> None:
            received.append(message)
            message.ack()

        pull = world.subscriber.subscribe(world.subscription, callback=ack)
        try:
            await wait_for(lambda: not world.stack.pubsub.backlogs(), "the backlog to be acked")  # type: ignore[union-attr]
            acked_at = time.monotonic()
            await wait_for(
                lambda: (source.watermark_ms or 0) >= newest_publish_ms, "the watermark to pass the acked backlog"
            )
            released_after_s = time.monotonic() - acked_at
        finally:
            pull.cancel()
        assert len(received) >= 5
        assert source.status().rule == "missing_point"
        # Rule 2 needs the last backlog point to age past max_metric_delay: about 4 s here.
        assert released_after_s <= MAX_METRIC_DELAY_MS / 1000 + PERIOD_S + 3.0
        assert observed.violations() == []
        values = [w for w, _ in observed.applied]
        assert values == sorted(set(values))  # strictly increasing
        print(f"watermark passed the acked backlog {released_after_s:.2f}s after the last ack")
    finally:
        await stop(task, source)


async def test_monitoring_faults_freeze_the_watermark(world: World) -> None:
    observed = Observed(world.subscription, world.stack)
    source = world.source(observed, max_backoff_s=0.5)
    task = asyncio.create_task(source.run())
    try:
        # An idle subscription: the watermark advances by rule 2 on every poll.
        await wait_for(lambda: len(observed.applied) >= 2, "the watermark to advance on an idle subscription")
        await world.admin("POST", "/faults", {"service": "monitoring", "code": "UNAVAILABLE", "rate": 1})
        # A poll may be in flight while the fault is added: take the frozen value after the first error.
        await wait_for(lambda: source.status().consecutive_errors >= 1, "the first failed query")
        frozen = source.watermark_ms
        applied = len(observed.applied)
        failing_since = time.monotonic()
        await wait_for(
            lambda: source.status().consecutive_errors >= 3 and time.monotonic() - failing_since >= 2.0,
            "three failed queries over two seconds",
        )
        status = source.status()
        assert status.watermark_ms == frozen
        assert len(observed.applied) == applied
        assert status.last_error is not None and status.last_error.startswith("UNAVAILABLE")

        await world.admin("DELETE", "/faults?service=monitoring")
        await wait_for(lambda: source.last_error is None, "a successful query after the faults")
        assert source.watermark_ms is not None and frozen is not None
        assert source.watermark_ms >= frozen + 2_000  # the time spent failing is made up at once
    finally:
        await stop(task, source)
