"""Watermark mode end to end: per-key event-time order across publishers, nothing released early.

Three subscriptions on one sidecar take the same traffic: timestamps from an RFC 3339 attribute,
from an epoch-milliseconds attribute, and from Pub/Sub's publish time. Three publisher threads
(each its own official client) publish interleaved event times, each its share shuffled.

Emulator truth: before the bulk, one message per topic, the earliest of key ``k0``, is published
while the Pub/Sub emulator delays its delivery by ``HELD_S``: for that long it sits unacked in
Pub/Sub while later messages of its key are already stored by the sidecar. The backlog metric sees
it, so no ``k0`` message may reach the app before it was even released by the emulator.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime

import pytest
from e2e_google import PubSub
from e2e_waits import async_wait_until
from wm_support import Recorder, Scenario, Sub, watermark_ordering

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

KEYS = ("k0", "k1", "k2", "k3")
PER_KEY = 12
PUBLISHERS = 3
HELD_S = 3.0
STEP_MS = 15


def _rfc3339(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _publish_threaded(env: dict[str, str], topics: list[str], shares: list[list[tuple[bytes, dict[str, str]]]]) -> None:
    """Each share published by its own thread and client, all released together by a barrier."""
    barrier = threading.Barrier(len(shares))
    errors: list[BaseException] = []

    def publish(share: list[tuple[bytes, dict[str, str]]]) -> None:
        client = PubSub(env)
        try:
            barrier.wait(timeout=30)
            futures = [client.publisher.publish(topic, data, **attrs) for data, attrs in share for topic in topics]
            for future in futures:
                future.result(timeout=30)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=publish, args=(share,)) for share in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, f"publishers failed: {errors!r}"
    assert not any(thread.is_alive() for thread in threads), "a publisher thread did not finish"


def _check_order(sub: Sub, recorder: Recorder, expected: set[bytes]) -> None:
    """Every message exactly once, none late, and per key in (event time, dedup id) order."""
    assert recorder.data() == expected, f"{sub.name}: missing {sorted(expected - recorder.data())[:5]}"
    assert len(recorder.deliveries) == len(expected), f"{sub.name}: some message was delivered twice"
    assert not [d for d in recorder.deliveries if d.late], f"{sub.name}: a message was flagged late"
    for key, deliveries in recorder.by_key().items():
        positions = [d.position for d in deliveries]
        assert positions == sorted(positions), f"{sub.name} key {key}: out of event-time order: {positions}"


async def test_event_time_order_across_interleaved_publishers(scenario: Scenario) -> None:
    skew = {"allowed_skew": "3s"}
    subs = [
        scenario.add_subscription("wm-rfc", watermark_ordering({"attribute": "event_time", **skew})),
        scenario.add_subscription(
            "wm-epoch", watermark_ordering({"attribute": "event_ms", **skew}, safety_margin="1s")
        ),
        scenario.add_subscription("wm-ptime", watermark_ordering({"source": "publish_time"})),
    ]
    await scenario.start_sidecar()
    recorders = {sub.name: Recorder() for sub in subs}
    samplers = {sub.name: scenario.sampler(sub) for sub in subs}
    for sub in subs:
        scenario.app(sub, recorders[sub.name])

    def message(key: str, event_ms: int, label: str) -> tuple[bytes, dict[str, str]]:
        attrs = {"key": key, "event_time": _rfc3339(event_ms), "event_ms": str(event_ms)}
        return f"{key}/{label}".encode(), attrs

    t0 = time.time_ns() // 1_000_000
    topics = [sub.topic for sub in subs]
    # The earliest message of k0, held unacked in Pub/Sub for HELD_S by the emulator.
    scenario.emulators.admin("POST", "/pubsub/delay", {"seconds": HELD_S})
    held_published_at = time.monotonic()
    first_data, first_attrs = message("k0", t0 - 10, "first")
    await scenario.pubsub.publish_all(topics[0], [(first_data, first_attrs)])
    for topic in topics[1:]:
        await scenario.pubsub.publish_all(topic, [(first_data, first_attrs)])
    scenario.emulators.admin("DELETE", "/pubsub/delay")

    # Message i of a key goes to publisher i % PUBLISHERS: the publishers' event times interleave.
    shares: list[list[tuple[bytes, dict[str, str]]]] = [[] for _ in range(PUBLISHERS)]
    for k, key in enumerate(KEYS):
        for i in range(PER_KEY):
            shares[i % PUBLISHERS].append(message(key, t0 + i * STEP_MS + k, str(i)))
    rng = random.Random(7)
    for share in shares:
        rng.shuffle(share)
    _publish_threaded(dict(scenario.emulators.env), topics, shares)

    expected = {first_data} | {data for share in shares for data, _ in share}
    await async_wait_until(
        lambda: all(len(recorders[s.name].deliveries) >= len(expected) for s in subs), "every message delivered"
    )
    # One more sample after the last delivery, so that every delivery has a watermark at/after it.
    for sampler in samplers.values():
        await sampler.sample()

    for sub in subs:
        recorder, sampler = recorders[sub.name], samplers[sub.name]
        _check_order(sub, recorder, expected)
        for delivery in recorder.deliveries:
            watermark = sampler.watermark_after(delivery.at)
            assert watermark is not None and delivery.event_ms <= watermark, (
                f"{sub.name}: {delivery.data!r} (event {delivery.event_ms}) delivered above the watermark {watermark}"
            )
        k0 = recorder.by_key()["k0"]
        assert k0[0].data == first_data, f"{sub.name}: k0 did not start with its earliest message"
        early = [d.data for d in k0 if d.at < held_published_at + HELD_S]
        assert not early, f"{sub.name}: delivered while k0's earliest message was still unacked in Pub/Sub: {early}"
        if sub.name == "wm-ptime":
            assert all(d.event_ms == d.publish_ms for d in recorder.deliveries), "event_time is not publish_time"
