"""End to end under injected faults: the guarantees of the happy path hold (G1, G2, G3).

Firestore fails 10% of its calls with each of UNAVAILABLE, ABORTED and DEADLINE_EXCEEDED, Pub/Sub
fails 10% of the sidecar's acks and modacks, and the emulator breaks the StreamingPull streams
while the messages flow. All switched on through the emulators' admin API, while the sidecar runs.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import Scenario
from e2e_checks import check_sequence_guarantees
from e2e_config import order_message
from e2e_waits import async_wait_until

pytestmark = pytest.mark.e2e

KEYS = 10
PER_KEY = 20
FAULT_RATE = 0.1


async def test_firestore_errors_and_broken_pubsub_streams_lose_nothing_and_keep_order(scenario: Scenario) -> None:
    sub = scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)
    emulators = scenario.emulators
    # Every Firestore call the sidecar makes on its message path; not Rollback (a client's clean-up,
    # which production practically never fails) and not the lease Listens.
    for method in ("BatchWrite", "Commit", "BatchGetDocuments", "RunQuery", "BeginTransaction"):
        for code in ("UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED"):
            emulators.add_fault(service="firestore", method=method, code=code, rate=FAULT_RATE)
    for method in ("Acknowledge", "ModifyAckDeadline"):
        emulators.add_fault(service="pubsub", method=method, code="UNAVAILABLE", rate=FAULT_RATE)

    rng = random.Random(10)
    messages = [order_message(f"f{k}", s) for k in range(KEYS) for s in range(1, PER_KEY + 1)]
    messages += rng.sample(messages, len(messages) // 10)
    rng.shuffle(messages)
    halves = messages[: len(messages) // 2], messages[len(messages) // 2 :]
    await scenario.pubsub.publish_all(sub.topic, halves[0])
    # Shuffled, the first half leaves gaps in every key: wait for it to be received, not delivered.
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_received_total", subscription=sub.name) >= len(halves[0]),
        "the first half to reach the sidecar under faults",
    )
    broken = await asyncio.to_thread(emulators.break_streams, "pubsub", "UNAVAILABLE")
    assert broken >= 1, "the sidecar had no open StreamingPull to break"
    await scenario.pubsub.publish_all(sub.topic, halves[1])
    await async_wait_until(lambda: len(app.seen) >= 100, "more deliveries under faults")
    await asyncio.to_thread(emulators.break_streams, "pubsub", "UNAVAILABLE")

    expected = {(f"f{k}", s) for k in range(KEYS) for s in range(1, PER_KEY + 1)}
    await async_wait_until(
        lambda: {(seen.key, seen.sequence) for seen in app.seen} >= expected, "every message under faults", 120
    )
    emulators.clear_faults()
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub.name) == 0,
        "the sidecar to drain",
    )
    check_sequence_guarantees(app, {f"f{k}": PER_KEY for k in range(KEYS)})
    assert sidecar.returncode is None, "the sidecar died under faults"
