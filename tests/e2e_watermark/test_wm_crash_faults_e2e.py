"""Watermark mode end to end: kill -9 and restart, and Monitoring outages.

Crash: messages delivered, messages stored and held by the watermark, and messages still in
Pub/Sub when the sidecar is killed with SIGKILL must all reach the app after a restart, per key in
event-time order (a message may come again only if its ack was not confirmed, G3).

Monitoring faults: while every ListTimeSeries call fails, the watermark must stay frozen and
nothing newer than it may be delivered, for longer than the missing-point rule would need to
release it had an error been mistaken for "no point". Once Monitoring answers again, it flows.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from e2e_waits import async_wait_until
from wm_support import MAX_METRIC_DELAY_S, POLL_INTERVAL_S, Delivery, Recorder, Scenario, watermark_ordering

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

KEYS = ("a", "b", "c")


def _batch(label: str, per_key: int) -> list[tuple[bytes, dict[str, str]]]:
    """Messages for every key with event times from now, 10 ms apart per key, shuffled."""
    now_ms = time.time_ns() // 1_000_000
    messages = [
        (f"{key}/{label}{i}".encode(), {"key": key, "event_ms": str(now_ms + i * 10)})
        for key in KEYS
        for i in range(per_key)
    ]
    random.Random(label).shuffle(messages)
    return messages


def _check_order_across_restarts(deliveries: list[Delivery]) -> None:
    """G2: a message reaches the app only after every earlier one of its key did (at least once)."""
    seen: dict[str, set[tuple[int, str]]] = {}
    for delivery in deliveries:
        assert not delivery.late, f"{delivery.data!r} flagged late"
        earlier = seen.setdefault(delivery.key, set())
        positions = sorted(d.position for d in deliveries if d.key == delivery.key and d.position < delivery.position)
        missing = [p for p in positions if p not in earlier]
        assert not missing, f"{delivery.data!r} delivered before earlier messages of key {delivery.key}: {missing}"
        earlier.add(delivery.position)


async def test_kill9_and_restart_keeps_order_and_loses_nothing(scenario: Scenario) -> None:
    sub = scenario.add_subscription("wm-crash", watermark_ordering({"attribute": "event_ms", "allowed_skew": "3s"}))
    first = await scenario.start_sidecar()
    recorder = Recorder()
    app = scenario.app(sub, recorder)

    delivered_early = _batch("A", 6)
    await scenario.pubsub.publish_all(sub.topic, delivered_early)
    await async_wait_until(lambda: recorder.deliveries, "the first deliveries")
    # Stored and held by the watermark at the moment of the kill.
    held = _batch("B", 6)
    await scenario.pubsub.publish_all(sub.topic, held)
    stored = len(delivered_early) + len(held)
    await async_wait_until(
        lambda: first.metric("pubsub_sidecar_received_total", subscription=sub.name) >= stored, "batch B stored"
    )
    first.kill9()
    # Still in Pub/Sub while the sidecar is down.
    pending = _batch("C", 6)
    await scenario.pubsub.publish_all(sub.topic, pending)
    await scenario.start_sidecar()

    expected = {data for data, _ in delivered_early + held + pending}
    await async_wait_until(lambda: recorder.data() >= expected, "every message after the restart")
    assert recorder.data() == expected
    # G3 with times: no delivery of a message after its ack was confirmed.
    for delivery in recorder.deliveries:
        for (_key, _seq, dedup), when in app.confirmed_at.items():
            assert dedup != delivery.dedup_id or delivery.at < when, f"{delivery.data!r} delivered after confirmation"
    _check_order_across_restarts(recorder.deliveries)


async def test_monitoring_outage_freezes_the_watermark(scenario: Scenario) -> None:
    sub = scenario.add_subscription("wm-faults", watermark_ordering({"source": "publish_time"}))
    sidecar = await scenario.start_sidecar()
    recorder = Recorder()
    scenario.app(sub, recorder)
    sampler = scenario.sampler(sub)

    await scenario.pubsub.publish_all(sub.topic, [(b"before", {"key": "a"})])
    await async_wait_until(lambda: recorder.deliveries, "the message before the outage")

    logged_before = len(sidecar.log_records())
    scenario.emulators.add_fault(service="monitoring", code="UNAVAILABLE", rate=1)

    def query_failed() -> bool:
        return any(
            "Monitoring query failed" in str(r.get("message", "")) for r in sidecar.log_records()[logged_before:]
        )

    await async_wait_until(query_failed, "the sidecar to see the Monitoring outage")
    frozen = await sampler.sample()
    assert frozen is not None

    during = [(f"during-{i}".encode(), {"key": "a" if i % 2 else "b"}) for i in range(4)]
    await scenario.pubsub.publish_all(sub.topic, during)
    # Watch for longer than the missing-point rule needs (max_metric_delay + poll + slack).
    watch_until = time.monotonic() + MAX_METRIC_DELAY_S + 4 * POLL_INTERVAL_S
    while time.monotonic() < watch_until:
        assert await sampler.sample() == frozen, "the watermark moved while Monitoring failed"
        assert [d.data for d in recorder.deliveries] == [b"before"], "delivered during the Monitoring outage"
        await asyncio.sleep(0.1)

    scenario.emulators.clear_faults()
    cleared_at = time.monotonic()
    await async_wait_until(lambda: len(recorder.deliveries) >= 1 + len(during), "delivery after the outage")
    assert recorder.data() == {b"before"} | {data for data, _ in during}
    for delivery in recorder.deliveries[1:]:
        assert delivery.event_ms > frozen and delivery.at > cleared_at
