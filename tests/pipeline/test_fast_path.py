"""The in-order fast path at ingest: nothing stored, the Pub/Sub ack held until the app's ack is durable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from ingest_harness import IngestHarness, assert_subscription_empty
from pubsub_admin import block_loop_until, wait_until

from sidecar.pipeline.ingest_sort import PEER_PREDECESSOR_WAIT_SECONDS, PREDECESSOR_WAIT_SECONDS

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


async def _in_turn(h: IngestHarness, n: int) -> list[tuple[int | None, bool]]:
    """(sequence, volatile) of ``n`` deliveries taken one at a time, each acked before the next is
    taken (the key's window is one message); the last is left unacked."""
    assert h.runtime is not None
    seen: list[tuple[int | None, bool]] = []
    for i in range(n):
        (delivery,) = await _take(h, 1)
        seen.append((delivery.message.sequence, delivery.message.volatile))
        if i < n - 1:
            await h.runtime.ack("app", [delivery.delivery_id])
    return seen


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
    await assert_subscription_empty(h)


async def test_a_message_beyond_a_gap_is_stored_and_the_one_filling_it_takes_the_fast_path(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True).start()
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.persisted == 1, "2 stored: it waits for 1")
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 1, "1 fills the gap: it waits for nothing but the app")
    assert [m.sequence for m in await h.stored_pending()] == [2]
    assert await _in_turn(h, 2) == [(1, True), (2, False)]


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


async def test_a_copy_of_a_fast_path_message_in_flight_is_acked_with_it_and_never_written(
    make_harness: MakeHarness,
) -> None:
    # A publisher's retry: same key, sequence and content, a new message id. Stored, it would cost a
    # document and its tombstone only to be dropped; kept beside its original, it is acked with it.
    h = await make_harness(fast_path=True).start()
    assert h.runtime is not None and h.ingestor is not None
    await h.publish_order("A", 1)
    (first,) = await _take(h, 1)
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 2, "the copy kept beside its original")
    assert (h.counters.persist_batches, h.counters.acked, h.ingestor.held_messages) == (0, 0, 2)
    assert h.runtime.take("app", 10) == [], "the copy is never delivered"

    await h.runtime.ack("app", [first.delivery_id])
    await wait_until(lambda: h.counters.acked == 2, "both acked in Pub/Sub once the ack is durable")
    assert (h.runtime.counters.fast_path_copies, h.runtime.counters.fast_path_duplicates) == (1, 1)
    assert (h.counters.persisted, await h.stored_pending()) == (0, [])
    await assert_subscription_empty(h)


async def test_a_conflicting_copy_of_a_fast_path_message_is_stored_and_dead_lettered(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True).start()
    dead = h.admin.collect(h.dead_letter_subscription)
    await h.publish_order("A", 1)
    await _take(h, 1)
    await h.publish_order("A", 1, data=b"other content")
    await wait_until(lambda: len(dead.messages) == 1, "the conflicting copy dead-lettered")
    assert dead.messages[0].attributes["sidecar_reason"] == "conflict"
    assert h.runtime is not None and h.runtime.counters.fast_path_copies == 0


async def test_a_copy_goes_back_to_pubsub_with_its_original_when_the_shard_is_dropped(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True).start()
    assert h.runtime is not None
    await h.publish_order("A", 1)
    await _take(h, 1)
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 2, "the copy kept beside its original")
    [(shard, epoch)] = h.runtime.shards().items()
    assert h.runtime.drop_shard(shard, epoch)
    await wait_until(lambda: h.counters.nacked == 2, "both given back to Pub/Sub")
    assert (h.counters.acked, h.runtime.counters.fast_path_duplicates) == (0, 0)


async def test_the_fast_path_is_off_when_the_config_says_so(make_harness: MakeHarness) -> None:
    h = await make_harness(fast_path=True, config_fast_path=False).start()
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.persisted == 1, "stored")
    assert h.counters.fast_path == 0


async def _start_gated(h: IngestHarness) -> asyncio.Event:
    """Start ``h`` with every persist of its store held until the returned event is set (a slow store)."""
    await h.setup()
    gate = _gate_persists(h)
    await h.start_ingest()
    return gate


def _gate_persists(h: IngestHarness) -> asyncio.Event:
    """Hold every persist of ``h``'s store until the returned event is set (a slow store)."""
    gate = asyncio.Event()
    persist = h.store.persist

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()
        return await persist(*args, **kwargs)

    h.store.persist = slow  # type: ignore[method-assign]
    return gate


async def test_a_message_behind_its_keys_persist_waits_for_it_then_takes_the_fast_path(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(fast_path=True)
    gate = await _start_gated(h)
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.persist_batches == 1, "2 (beyond a gap) being stored")
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 1, "1 takes the fast path at once")
    await h.publish_order("A", 3)
    await wait_until(lambda: h.counters.deferred == 1, "3 waits for 2's persist instead of being stored")
    assert (h.counters.fast_path, h.counters.persisted, h.counters.persist_batches) == (1, 0, 1)
    assert h.ingestor is not None
    stages = h.ingestor.stages()
    assert {stage: n for stage, n in stages.items() if n} == {
        "storing": 1,
        "fast_path": 1,
        "deferred": 1,
        "unsettled": 3,
    }, "where each of the three waits, for the ingest_messages gauge"
    gate.set()
    await wait_until(lambda: h.counters.fast_path == 2, "3 takes the fast path once 2 is stored")
    assert (h.counters.persisted, h.counters.persist_batches) == (1, 1), "only 2 was written"
    assert [m.sequence for m in await h.stored_pending()] == [2]
    assert h.runtime is not None
    for seq, volatile in ((1, True), (2, False), (3, True)):
        (delivered,) = await _take(h, 1)
        assert (delivered.message.sequence, delivered.message.volatile) == (seq, volatile)
        await h.runtime.ack("app", [delivered.delivery_id])
    await wait_until(lambda: h.counters.acked == 3, "all three acked in Pub/Sub once durable")
    assert not any(h.ingestor.stages().values()), "nothing left waiting once all are acked"


async def test_a_message_waits_for_its_keys_persist_only_once(make_harness: MakeHarness) -> None:
    h = make_harness(fast_path=True)
    gate = await _start_gated(h)
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.persist_batches == 1, "2 being stored")
    await h.publish_order("A", 4)  # 3 never comes: 4 cannot take the fast path, even after 2
    await wait_until(lambda: h.counters.deferred == 1, "4 waits for 2's persist")
    gate.set()
    await wait_until(lambda: h.counters.persisted == 2, "then 4 is stored, not deferred again")
    assert h.counters.deferred == 1 and h.counters.fast_path == 0
    assert sorted(m.sequence for m in await h.stored_pending()) == [2, 4]


async def test_the_fast_path_does_not_wait_for_a_persist_slot(make_harness: MakeHarness) -> None:
    h = make_harness(fast_path=True, max_concurrent_persists=1)
    gate = await _start_gated(h)
    await h.publish_order("B", 5)
    await wait_until(lambda: h.counters.persist_batches == 1, "B 5 holds the only persist slot")
    await h.publish_order("A", 1)
    (delivered,) = await _take(h, 1)
    assert (delivered.message.key, delivered.message.sequence, delivered.message.volatile) == ("A", 1, True)
    assert h.counters.persisted == 0, "B 5 is still being stored"
    gate.set()
    await wait_until(lambda: h.counters.persisted == 1, "B 5 stored")


async def test_a_swapped_pair_both_take_the_fast_path(make_harness: MakeHarness) -> None:
    # 2 waits to be stored (a batch window far longer than the test's deadline); 1 takes the fast
    # path, and 2 is offered again at once, not when the window ends.
    h = await make_harness(fast_path=True, batch_window_seconds=3600.0).start()
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.received == 1, "2 received, waiting to be stored")
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 2, "both taken by the fast path")
    assert (h.counters.fast_path, h.counters.persisted) == (2, 0)
    assert [d.message.sequence for d in await _take(h, 1)] == [1]


async def test_a_message_beyond_a_gap_waits_unstored_for_its_predecessor_then_both_take_the_fast_path(
    make_harness: MakeHarness,
) -> None:
    # No batch window: without the wait, 2 would be stored before 1 is even published.
    h = await make_harness(fast_path=True, batch_window_seconds=0.0, predecessor_wait_seconds=3600.0).start()
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.held == 1, "2 kept back for 1")
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 2, "1 takes the fast path, and 2 right behind it")
    assert (h.counters.persist_batches, h.counters.persisted) == (0, 0), "neither was written"
    assert [d.message.sequence for d in await _take(h, 1)] == [1]


async def test_held_successors_follow_a_predecessor_that_arrives_beside_a_later_message_of_their_key(
    make_harness: MakeHarness,
) -> None:
    # 1 and 4 come in one hand-over: 1 takes the fast path and 4 (3 is missing) is kept back; 2,
    # kept back before, follows 1 at once rather than when its wait ends.
    # intake: client, whose threads receive while the loop is kept busy (the stream intake reads on
    # the loop, so that a busy loop receives nothing): the one way to make one hand-over certain.
    h = await make_harness(
        fast_path=True, batch_window_seconds=0.0, predecessor_wait_seconds=3600.0, intake="client"
    ).start()
    assert h.ingestor is not None
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.held == 1, "2 kept back for 1")
    runs = h.ingestor.handoff_runs
    # One hand-over for certain, however the client's threads split the two (separate Publish
    # batches or stream responses on a busy machine): the loop is kept busy until both wait for it.
    published = [h.submit_order("A", 1), h.submit_order("A", 4)]
    ingestor = h.ingestor
    block_loop_until(lambda: ingestor.handoff_buffered == 2, "1 and 4 buffered for the loop")
    await asyncio.gather(*map(asyncio.wrap_future, published))
    await wait_until(lambda: h.counters.received == 3, "1 and 4 received")
    assert h.ingestor.handoff_runs == runs + 1, "one hand-over"
    await wait_until(lambda: h.counters.fast_path == 2, "2 follows 1 at once")
    assert (h.counters.held, h.counters.persisted) == (2, 0), "4 is kept back for 3"
    assert [seq for seq, _ in await _in_turn(h, 2)] == [1, 2]


async def test_a_held_message_is_stored_when_its_predecessor_does_not_come_in_time(make_harness: MakeHarness) -> None:
    h = await make_harness(fast_path=True, predecessor_wait_seconds=0.2).start()
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.persisted == 1, "2 stored once its wait ended")
    assert (h.counters.held, h.counters.fast_path, h.counters.acked) == (1, 0, 1)
    await h.publish_order("A", 1)
    assert await _in_turn(h, 2) == [(1, True), (2, False)]


async def test_a_held_message_follows_a_predecessor_that_was_stored(make_harness: MakeHarness) -> None:
    # 3 waits for 2; 2 is stored (its own wait set to nothing) and 1 takes the fast path while 2's
    # write is under way: 3 is offered again once 2 is stored, and follows at once.
    h = make_harness(fast_path=True, predecessor_wait_seconds=3600.0)
    gate = await _start_gated(h)
    assert h.ingestor is not None
    await h.publish_order("A", 3)
    await wait_until(lambda: h.counters.held == 1, "3 kept back")
    h.ingestor._predecessor_wait_seconds = 0.0
    await h.publish_order("A", 2)
    await wait_until(lambda: h.counters.persist_batches == 1, "2 being stored")
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 1, "1 takes the fast path; 3 still waits: 2 is not stored yet")
    gate.set()
    await wait_until(lambda: h.counters.fast_path == 2, "3 takes the fast path once 2 is stored")
    assert h.counters.persisted == 1
    assert h.runtime is not None
    for seq, volatile in ((1, True), (2, False), (3, True)):
        (delivered,) = await _take(h, 1)
        assert (delivered.message.sequence, delivered.message.volatile) == (seq, volatile)
        await h.runtime.ack("app", [delivered.delivery_id])


async def test_a_held_message_the_fast_path_took_is_not_stored_when_its_old_wait_ends(
    make_harness: MakeHarness,
) -> None:
    # B#2 and A#2 are kept back in one hand-over (one wait for both); A#1 takes A#2 along the fast
    # path. The entry of A#2's wait is left where it was, behind B#2's: when the wait ends, B#2 is
    # stored and A#2's entry must be passed over.
    # intake: client, whose threads receive while the loop is kept busy (one hand-over for certain).
    h = await make_harness(
        fast_path=True, batch_window_seconds=0.0, predecessor_wait_seconds=0.5, intake="client"
    ).start()
    assert h.ingestor is not None
    ingestor = h.ingestor
    published = [h.submit_order("B", 2), h.submit_order("A", 2)]
    block_loop_until(lambda: ingestor.handoff_buffered == 2, "B#2 and A#2 buffered for the loop")
    await asyncio.gather(*map(asyncio.wrap_future, published))
    await wait_until(lambda: h.counters.held == 2, "B#2 and A#2 kept back")
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.fast_path == 2, "A#1 takes the fast path, and A#2 right behind it")
    assert ingestor.stages()["held"] == 1, "B#2 still waits"
    await wait_until(lambda: h.counters.persisted == 1, "B#2 stored once the wait ended")
    await wait_until(lambda: h.counters.persist_batches == 1 and not ingestor.stages()["held"], "the wait over")
    assert h.counters.persisted == 1, "A#2 was not stored"
    assert [(d.message.key, d.message.sequence) for d in await _take(h, 1)] == [("A", 1)]


async def test_a_predecessor_releases_its_own_key_only_and_the_others_are_stored_when_their_wait_ends(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness(fast_path=True, batch_window_seconds=0.0, predecessor_wait_seconds=0.5).start()
    assert h.ingestor is not None
    for key in ("A", "B", "C"):
        await h.publish_order(key, 2)
    await wait_until(lambda: h.counters.held == 3, "A#2, B#2 and C#2 kept back")
    await h.publish_order("B", 1)
    await wait_until(lambda: h.counters.fast_path == 2, "B#1 and B#2 on the fast path")
    assert h.ingestor.stages()["held"] == 2, "A#2 and C#2 still wait"
    await wait_until(lambda: h.counters.persisted == 2, "A#2 and C#2 stored once their wait ended")
    assert h.ingestor.stages()["held"] == 0 and h.counters.fast_path == 2


class _Declines:
    """A forwarder that takes nothing (every message then goes this pod's own way)."""

    def forward(self, subscription: str, shard: int, message: object, on_answer: Callable[[bool], None]) -> bool:
        return False


async def test_with_the_peer_channel_a_message_waits_longer_for_its_predecessor_unless_a_wait_is_given(
    make_harness: MakeHarness,
) -> None:
    default = make_harness(fast_path=True)
    await default.start()
    given = make_harness(fast_path=True, predecessor_wait_seconds=0.2, name="payments")
    await given.start()
    assert default.ingestor is not None and given.ingestor is not None
    assert default.ingestor._predecessor_wait_seconds == PREDECESSOR_WAIT_SECONDS
    default.ingestor.set_forwarder(_Declines())
    given.ingestor.set_forwarder(_Declines())
    assert default.ingestor._predecessor_wait_seconds == PEER_PREDECESSOR_WAIT_SECONDS > PREDECESSOR_WAIT_SECONDS
    assert given.ingestor._predecessor_wait_seconds == 0.2, "a wait given is kept"
    default.ingestor.set_forwarder(None)
    assert default.ingestor._predecessor_wait_seconds == PREDECESSOR_WAIT_SECONDS
