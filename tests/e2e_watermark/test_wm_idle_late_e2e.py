"""Watermark mode end to end: the missing-point rule on an idle subscription, and ``on_late``.

Idle: the sidecar acks a message within milliseconds, so the backlog metric shows no point for it
(or one that proves nothing: rule 1 never passes the oldest unacked message). An empty backlog
reports no point at all, so the last messages of an idle subscription can only be released by the
missing-point rule, once ``max_metric_delay`` (+ the safety margin) has passed: never earlier, and
not never.

Late: a message whose event time is behind its key's delivered cursor is dead-lettered with a
reason (``on_late: dead_letter``) or delivered flagged ``late`` (``on_late: deliver``).
"""

from __future__ import annotations

import time

import pytest
from e2e_waits import async_wait_until
from wm_support import MAX_METRIC_DELAY_S, Recorder, Scenario, watermark_ordering

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SAFETY_MARGIN_S = 1.0
CLOCK_SLACK_MS = 50
"""publish_time is stamped by the emulator and the app reads the same host clock: only rounding differs."""


async def test_idle_subscription_releases_after_max_metric_delay_and_late_follows_on_late(
    scenario: Scenario,
) -> None:
    idle = scenario.add_subscription(
        "wm-idle", watermark_ordering({"source": "publish_time"}, safety_margin=f"{SAFETY_MARGIN_S:.0f}s")
    )
    late_attr = {"attribute": "event_ms", "allowed_skew": "1s"}
    dead = scenario.add_subscription("wm-late-dl", watermark_ordering(late_attr, on_late="dead_letter"))
    deliver = scenario.add_subscription("wm-late-deliver", watermark_ordering(late_attr, on_late="deliver"))
    sidecar = await scenario.start_sidecar()
    recorders = {sub.name: Recorder() for sub in (idle, dead, deliver)}
    idle_sampler = scenario.sampler(idle)
    apps = {sub.name: scenario.app(sub, recorders[sub.name]) for sub in (idle, dead, deliver)}

    # The idle subscription's last messages, and one on-time message per late-test subscription.
    idle_messages = [(f"idle-{i}".encode(), {"key": f"i{i % 2}"}) for i in range(4)]
    await scenario.pubsub.publish_all(idle.topic, idle_messages)
    on_time_ms = time.time_ns() // 1_000_000
    for sub in (dead, deliver):
        await scenario.pubsub.publish_all(sub.topic, [(b"on-time", {"key": "a", "event_ms": str(on_time_ms)})])

    idle_recorder = recorders[idle.name]
    await async_wait_until(lambda: len(idle_recorder.deliveries) >= len(idle_messages), "the idle messages")
    await idle_sampler.sample()
    assert idle_recorder.data() == {data for data, _ in idle_messages}
    floor_ms = int((MAX_METRIC_DELAY_S + SAFETY_MARGIN_S) * 1000) - CLOCK_SLACK_MS
    for delivery in idle_recorder.deliveries:
        waited = delivery.wall_ms - delivery.publish_ms
        assert waited >= floor_ms, f"{delivery.data!r} released after {waited} ms, before the missing-point rule allows"
        watermark = idle_sampler.watermark_after(delivery.at)
        assert watermark is not None and delivery.event_ms <= watermark

    # The late messages go out only once the on-time one was delivered and its ack confirmed, so
    # that the key's cursor is known to be past them.
    for sub in (dead, deliver):
        await async_wait_until(lambda sub=sub: apps[sub.name].confirmed_at, f"{sub.name}: on-time message acked")
        await scenario.pubsub.publish_all(sub.topic, [(b"late", {"key": "a", "event_ms": str(on_time_ms - 1000)})])

    assert dead.dead_letter_subscription is not None
    (dead_lettered,) = await scenario.pubsub.pull_until(dead.dead_letter_subscription, 1, "the late dead letter")
    assert dead_lettered.data == b"late"
    assert "late" in dead_lettered.attributes.get("sidecar_reason", ""), dead_lettered.attributes
    assert [d.data for d in recorders[dead.name].deliveries] == [b"on-time"]

    deliver_recorder = recorders[deliver.name]
    await async_wait_until(lambda: len(deliver_recorder.deliveries) >= 2, "the late message, delivered")
    on_time, late = deliver_recorder.deliveries
    assert (on_time.data, on_time.late) == (b"on-time", False)
    assert (late.data, late.late, late.event_ms) == (b"late", True, on_time_ms - 1000)

    for sub in (dead, deliver):
        assert sidecar.metric("pubsub_sidecar_late_total", subscription=sub.name) == 1
    assert sidecar.metric("pubsub_sidecar_watermark_lag_seconds", subscription=idle.name) > 0
