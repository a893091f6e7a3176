"""End to end: ``kill -9`` of the sidecar at several points, then a restart (G1, G2, G3 through crashes).

The kills land mid-ingest (messages received, some persisted and not yet acked to Pub/Sub, some
not persisted), while the app holds delivered messages unacked, and right after the sidecar confirmed
acks. What was not acked to Pub/Sub comes back after its ack deadline (10 s); what was stored comes
back from Firestore at recovery; confirmed acks survive in Firestore.
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

KEYS = 20
PER_KEY = 24


async def test_kill9_at_several_points_loses_nothing_keeps_order_and_never_redelivers_confirmed_acks(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar()
    holding = False
    app = scenario.app(sub, lambda _message: "hold" if holding else "ack")
    rng = random.Random(9)
    messages = [order_message(f"k{k}", s) for k in range(KEYS) for s in range(1, PER_KEY + 1)]
    rng.shuffle(messages)
    thirds = [messages[i::3] for i in range(3)]

    async def restart() -> None:
        await asyncio.to_thread(sidecar.start, False)
        await sidecar.async_wait_ready()

    # 1. Mid-ingest: Firestore answers slowly, so that at the kill a persist of the second half is
    # in flight (neither durable nor acked to Pub/Sub) while the first half is durable and acked.
    first, second = thirds[0][: len(thirds[0]) // 2], thirds[0][len(thirds[0]) // 2 :]
    scenario.emulators.add_fault(
        service="firestore", method="BatchWrite", code=None, delay_seconds=1.0, writes_to="/messages/"
    )
    await scenario.pubsub.publish_all(sub.topic, first)
    await async_wait_until(lambda: len(app.seen) >= 1, "the first half to be stored and delivered")
    await scenario.pubsub.publish_all(sub.topic, second)
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_received_total", subscription=sub.name) >= len(thirds[0]),
        "the second half to be received",
    )
    sidecar.kill9()
    scenario.emulators.clear_faults()
    await restart()

    # 2. While the app holds delivered messages without acking them.
    holding = True
    await scenario.pubsub.publish_all(sub.topic, thirds[1])
    await async_wait_until(lambda: len(app.held) >= 5, "the app to hold some messages")
    sidecar.kill9()
    holding = False
    await restart()
    # Their stream died with the sidecar: the acks are refused locally, the messages come again.
    assert await app.ack_held() == 0

    # 3. Right after acks were confirmed as durable.
    await scenario.pubsub.publish_all(sub.topic, thirds[2])
    confirmed_before = len(app.confirmed_at)
    await async_wait_until(lambda: len(app.confirmed_at) >= confirmed_before + 5, "new ack confirmations")
    sidecar.kill9()
    await restart()

    expected = {(f"k{k}", s) for k in range(KEYS) for s in range(1, PER_KEY + 1)}
    await async_wait_until(
        lambda: {(seen.key, seen.sequence) for seen in app.seen} >= expected, "every message after the crashes", 120
    )
    # An ack the sidecar made durable just before a kill may never be confirmed to the app; it is
    # not delivered again either. So quiescence is judged by the sidecar: nothing left to deliver.
    # (A kill between a fenced commit's read of the lease document and its Commit leaves that
    # transaction open until it expires, 60 s idle; the Firestore emulator once made every later
    # transaction's read of the document wait for it, so that the restarted sidecar's acks were
    # confirmed only a minute later, one run in four on busy cores. Reads no longer wait for an
    # idle transaction: see docs/emulators-firestore.md.)
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub.name) == 0,
        "the sidecar to drain",
    )
    check_sequence_guarantees(app, {f"k{k}": PER_KEY for k in range(KEYS)})
