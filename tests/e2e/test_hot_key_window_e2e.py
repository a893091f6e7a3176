"""End to end: one hot key with ``max_in_flight_per_key: 8`` and an app that acks each window in
reverse. A real sidecar process, the emulators, the official publisher, and the app through
``pubsub_sidecar_client.OrderedSubscriber``: every message is delivered once, in order, and every
ack is confirmed (each on its own, once durable: docs/api.md), on the fast path and off it."""

from __future__ import annotations

import asyncio

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_waits import async_wait_until

from pubsub_sidecar_client import OrderedSubscriber

pytestmark = pytest.mark.e2e

WINDOW = 8
COUNT = 200


@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_window_of_acks_out_of_order_is_delivered_in_order_once_and_confirmed(
    scenario: Scenario, fast_path: bool
) -> None:
    sub = scenario.add_subscription(
        "hot", delivery={"max_in_flight_per_key": WINDOW}, ordering={"fast_path": fast_path}
    )
    sidecar = await scenario.start_sidecar()
    for seq in range(1, COUNT + 1):
        data, attributes = order_message("hot", seq)
        await scenario.pubsub.publish(sub.topic, data, **attributes)

    confirmed: list[str] = []
    delivered: list[int] = []
    sequence_of: dict[str, int] = {}
    subscriber = OrderedSubscriber(scenario.listen, "hot", on_ack_confirmed=confirmed.append)
    subscriber.start()
    try:
        window = []
        async with asyncio.timeout(120):
            async for message in subscriber:
                delivered.append(message.sequence)
                sequence_of[message.delivery_id] = message.sequence
                window.append(message)
                # The sidecar hands out up to WINDOW at once: ack each full window (or the tail)
                # last message first, so every ack but one comes before its predecessor's.
                if len(window) == WINDOW or len(delivered) == COUNT:
                    for held in reversed(window):
                        await held.ack()
                    window = []
                if len(delivered) == COUNT:
                    break
        await async_wait_until(lambda: len(confirmed) == COUNT, f"{COUNT} confirmations")
    finally:
        await subscriber.close()
    assert delivered == list(range(1, COUNT + 1)), "in order, each once"
    assert sorted(sequence_of[d] for d in confirmed) == list(range(1, COUNT + 1))
    assert sidecar.metric("pubsub_sidecar_acked_total", subscription="hot") == COUNT
