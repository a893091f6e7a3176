"""End to end, happy path: sequence mode reorders and dedups; dedup-only mode dedups.

The official publisher publishes, the sidecar runs as its own process against the emulators, and
the project's ``OrderedSubscriber`` is the app.
"""

from __future__ import annotations

import random

import pytest
from conftest import Scenario
from e2e_checks import check_sequence_guarantees
from e2e_config import order_message
from e2e_waits import async_wait_until

pytestmark = pytest.mark.e2e

KEYS = 50
PER_KEY = 40


async def test_sequence_mode_delivers_each_key_in_order_exactly_once_from_shuffled_duplicated_input(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)
    rng = random.Random(6)
    originals = [order_message(f"order-{k}", s) for k in range(KEYS) for s in range(1, PER_KEY + 1)]
    # Publisher retries: the same content published again, so with a new Pub/Sub message id.
    duplicates = rng.sample(originals, len(originals) // 10)
    batch = originals + duplicates
    rng.shuffle(batch)

    await scenario.pubsub.publish_all(sub.topic, batch)

    await async_wait_until(lambda: len(app.distinct()) >= len(originals), "every message at the app", 120)
    # Quiescent: every duplicate was recognised, nothing is left to deliver.
    await async_wait_until(
        lambda: (
            sidecar.metric("pubsub_sidecar_received_total", subscription=sub.name) >= len(batch)
            and sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub.name) == 0
        ),
        "the sidecar to receive every copy and drain",
    )
    check_sequence_guarantees(app, {f"order-{k}": PER_KEY for k in range(KEYS)})
    assert len(app.seen) == len(originals), "a duplicate or redelivery reached the app"
    for seen in app.seen:
        assert seen.data == f"{seen.key}#{seen.sequence}".encode()
        assert seen.delivery_attempt == 1
    assert sidecar.metric("pubsub_sidecar_duplicates_total", subscription=sub.name) >= len(duplicates)


async def test_dedup_only_mode_never_delivers_redeliveries_or_attribute_duplicates_twice(scenario: Scenario) -> None:
    sub = scenario.add_subscription("events", mode="none", dedup={"attribute": "event_id", "ttl": "1d"})
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)
    # The sidecar's Pub/Sub acks of the first 100 events fail (INTERNAL: the client does not retry
    # it), so Pub/Sub redelivers all of them after their ack deadline, although they are stored and
    # delivered already. (The client merges acks into few calls: a rate below 1 would be all or none.)
    scenario.emulators.add_fault(service="pubsub", method="Acknowledge", code="INTERNAL", rate=1.0)
    events = [(f"event {i}".encode(), {"event_id": f"e-{i}"}) for i in range(100)]
    # Attribute duplicates: other content and message id, same event id: the first one stored wins.
    retries = [(f"event {i} (retry)".encode(), {"event_id": f"e-{i}"}) for i in range(0, 100, 4)]
    await scenario.pubsub.publish_all(sub.topic, events)
    await async_wait_until(lambda: len(app.confirmed_at) >= len(events), "every event acked by the app")
    scenario.emulators.clear_faults()
    await scenario.pubsub.publish_all(sub.topic, retries)

    copies = len(events) + len(retries) + len(events)
    await async_wait_until(
        lambda: (
            sidecar.metric("pubsub_sidecar_received_total", subscription=sub.name) >= copies
            and sidecar.metric("pubsub_sidecar_duplicates_total", subscription=sub.name) >= len(retries) + len(events)
            and sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub.name) == 0
        ),
        "the redeliveries and retries to reach the sidecar and be recognised",
    )
    ids = [seen.attributes["event_id"] for seen in app.seen]
    assert sorted(ids) == sorted(f"e-{i}" for i in range(100)), "an event was lost or delivered twice"
    assert {seen.dedup_id for seen in app.seen} == {f"e-{i}" for i in range(100)}
    assert all(b"retry" not in seen.data for seen in app.seen)
