"""End to end on a Pub/Sub subscription with ``enable_message_ordering``: the sidecar, keyed by the
Pub/Sub ordering key, delivers every key in order exactly once while Pub/Sub holds each key to one
outstanding message and redelivers nacked ones first.

Publishing is in order per key (that is what an ordering key means), with publisher-retry
duplicates; the sidecar's own Pub/Sub nacks come from failed Firestore writes (it nacks what it
could not persist), and the app nacks some first deliveries.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from conftest import Scenario
from e2e_checks import check_sequence_guarantees
from e2e_waits import async_wait_until

from pubsub_sidecar_client import Message

pytestmark = pytest.mark.e2e

KEYS = 8
PER_KEY = 12
FAILED_PERSISTS = 4
"""BatchWrite calls that fail before anything is stored: the sidecar nacks those messages."""


async def test_sidecar_on_an_ordered_subscription_delivers_each_key_in_order_once_through_nacks_and_duplicates(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("ordered", message_ordering=True, ordering={"key": {"ordering_key": True}})
    sidecar = await scenario.start_sidecar()
    app_nacks: set[tuple[str, int]] = set()
    rng = random.Random(1613)

    def decide(message: Message) -> str:
        # The app fails about one message in six once: the sidecar redelivers it before the key goes on.
        if (message.key, message.sequence) not in app_nacks and rng.random() < 0.17:
            app_nacks.add((message.key, message.sequence))
            return "nack"
        return "ack"

    app = scenario.app(sub, decide)
    scenario.emulators.add_fault(
        service="firestore", method="BatchWrite", code="UNAVAILABLE", rate=1.0, remaining=FAILED_PERSISTS
    )
    batch: list[tuple[str, bytes, dict[str, str]]] = []
    duplicates = 0
    for seq in range(1, PER_KEY + 1):
        for k in range(KEYS):
            key = f"order-{k}"
            batch.append((key, f"{key}#{seq}".encode(), {"seq": str(seq)}))
            if seq > 1 and rng.random() < 0.15:  # a publisher retry: the previous message again, later
                batch.append((key, f"{key}#{seq - 1}".encode(), {"seq": str(seq - 1)}))
                duplicates += 1
    await scenario.pubsub.publish_ordered(sub.topic, batch)

    expected = {f"order-{k}": PER_KEY for k in range(KEYS)}
    await async_wait_until(
        lambda: {(s.key, s.sequence) for s in app.seen} >= {(k, s) for k in expected for s in range(1, PER_KEY + 1)},
        "every message at the app",
        120,
    )
    await async_wait_until(
        lambda: (
            sidecar.metric("pubsub_sidecar_received_total", subscription=sub.name) >= len(batch)
            and sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub.name) == 0
        ),
        "the sidecar to receive every copy and drain",
    )
    check_sequence_guarantees(app, expected)
    # Exactly once to the app, plus the one redelivery of each message it nacked: no duplicate got through.
    deliveries = Counter((s.key, s.sequence) for s in app.seen)
    for delivered, count in deliveries.items():
        assert count == (2 if delivered in app_nacks else 1), f"{delivered} delivered {count} times"
    assert app_nacks, "the app nacked nothing"
    assert duplicates and sidecar.metric("pubsub_sidecar_duplicates_total", subscription=sub.name) >= duplicates
    # The failed persists were nacked to Pub/Sub and came back: more receipts than published copies.
    assert sidecar.metric("pubsub_sidecar_received_total", subscription=sub.name) > len(batch)
    assert sidecar.returncode is None
