"""The in-order fast path at ingest: nothing stored, the Pub/Sub ack held until the app's ack is durable."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from ingest_harness import IngestHarness
from pubsub_admin import wait_until

pytestmark = pytest.mark.timeout(90)

MakeHarness = Callable[..., IngestHarness]


async def _take(h: IngestHarness, n: int) -> list:
    assert h.runtime is not None
    taken: list = []

    def more() -> bool:
        taken.extend(h.runtime.take("app", n - len(taken)))  # type: ignore[union-attr]
        return len(taken) >= n

    await wait_until(more, f"{n} deliveries")
    return taken


async def test_in_order_messages_are_delivered_without_a_record_and_acked_once_their_ack_is_durable(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True).start()
    assert h.runtime is not None and h.ingestor is not None
    for seq in (1, 2, 3):
        await h.publish_order("A", seq)
        (message,) = await _take(h, 1)
        assert message.message.sequence == seq and message.message.volatile
        assert await h.stored_pending() == [], "nothing was written"
        assert h.counters.acked == seq - 1 and h.ingestor.held_messages == 1, "Pub/Sub keeps it until durable"
        result = await h.runtime.ack("app", [message.delivery_id])
        assert result.confirmed == [message.delivery_id]
        await wait_until(lambda seq=seq: h.counters.acked == seq, "the Pub/Sub ack after the durable ack")
    assert (h.counters.fast_path, h.counters.persisted) == (3, 0)
    cursor = h.store.cursor(h.name, "A")
    assert cursor is not None and cursor.next_sequence == 4
    assert h.ingestor.held_messages == 0
    await h.stop_ingest()
    assert await h.admin.pull_available(h.subscription) == []


async def test_a_message_beyond_a_gap_is_stored_and_the_one_filling_it_takes_the_fast_path(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True).start()
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.persisted == 1, "2 stored: it waits for 1")
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 1, "1 fills the gap: it waits for nothing but the app")
    assert [m.sequence for m in await h.stored_pending()] == [2]
    delivered = await _take(h, 1)
    assert [(d.message.sequence, d.message.volatile) for d in delivered] == [(1, True)]
    assert h.runtime is not None
    await h.runtime.ack("app", [delivered[0].delivery_id])
    (second,) = await _take(h, 1)
    assert (second.message.sequence, second.message.volatile) == (2, False)


async def test_several_in_order_messages_of_a_key_take_the_fast_path_while_the_first_is_in_flight(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True).start()
    await h.publish_order("A", 1)
    (first,) = await _take(h, 1)
    for seq in (2, 3):
        await h.publish_order("A", seq)
    await wait_until(lambda: h.counters.fast_path == 3, "2 and 3 queue behind 1 without a document")
    assert await h.stored_pending() == []
    assert h.runtime is not None
    await h.runtime.ack("app", [first.delivery_id])
    for seq in (2, 3):
        (message,) = await _take(h, 1)
        assert message.message.sequence == seq
        await h.runtime.ack("app", [message.delivery_id])
    await wait_until(lambda: h.counters.acked == 3, "all three acked in Pub/Sub once durable")


async def test_a_nacked_fast_path_message_comes_back_from_memory_and_pub_sub_still_holds_it(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True).start()
    await h.publish_order("A", 1)
    (first,) = await _take(h, 1)
    assert h.runtime is not None
    h.runtime.nack("app", [first.delivery_id], retry_after_ms=0)
    (again,) = await _take(h, 1)
    assert again.message.sequence == 1 and again.attempt == 2
    assert h.counters.acked == 0 and h.counters.nacked == 0
    await h.runtime.ack("app", [again.delivery_id])
    await wait_until(lambda: h.counters.acked == 1, "acked in Pub/Sub once durable")


async def test_a_dead_lettered_fast_path_message_is_recorded_then_acked(make_harness: MakeHarness) -> None:
    h = await make_harness(fast_path=True).start()
    dead = h.admin.collect(h.dead_letter_subscription)
    await h.publish_order("A", 1)
    (first,) = await _take(h, 1)
    assert h.runtime is not None
    h.runtime.nack("app", [first.delivery_id], dead_letter=True)
    await wait_until(lambda: len(dead.messages) == 1, "the dead letter published")
    await wait_until(lambda: h.counters.acked == 1, "acked in Pub/Sub after the dead letter was recorded")
    assert dead.messages[0].attributes["sidecar_reason"] == "app_dead_letter"


async def test_the_fast_path_is_off_when_the_config_says_so(make_harness: MakeHarness) -> None:
    h = await make_harness(fast_path=True, config_fast_path=False).start()
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.persisted == 1, "stored")
    assert h.counters.fast_path == 0
