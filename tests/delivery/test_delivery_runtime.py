"""SubscriptionRuntime with a MemoryStore: recovery, store failures, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from delivery_harness import Harness, RecordingDeadLetters, sequence_config, wait_until
from delivery_harness import incoming_message as sequence_message

from pubsub_sidecar.v1 import sidecar_pb2
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.pipeline.runtime_context import SubscriptionUnavailable
from sidecar.store.api import StoreRejected
from sidecar.store.memory import MemoryStore


async def test_confirmed_acks_survive_a_restart_and_unconfirmed_ones_come_back(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders", max_outstanding=10)
    await harness.publish("orders", [("a", 1), ("a", 2), ("b", 1)])
    first = {m.key: m for m in await subscriber.next_messages(2)}
    await subscriber.ack([first["a"].delivery_id])
    await subscriber.wait_confirmed([first["a"].delivery_id])
    await wait_until(lambda: len(subscriber.received) == 3, "a/2 after a/1 was confirmed")

    # A new process over the same store: a/1 is done; a/2 and b/1 were never acked.
    restarted = SubscriptionRuntime("orders", sequence_config(), harness.store, RecordingDeadLetters())
    await restarted.recover()
    await restarted.loaded()
    await restarted.start()
    try:
        deliveries = restarted.take("consumer", 10)
        assert sorted((d.message.key, d.message.sequence) for d in deliveries) == [("a", 2), ("b", 1)]
        result = await restarted.ack("consumer", [d.delivery_id for d in deliveries])
        assert sorted(result.confirmed) == sorted(d.delivery_id for d in deliveries)
    finally:
        await restarted.stop()


async def test_unavailable_store_on_commit_is_retried_until_durable(harness: Harness) -> None:
    harness.store.fail_next("commit_acks", 3)
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1)])
    (message,) = await subscriber.next_messages(1)

    await subscriber.ack([message.delivery_id])

    await subscriber.wait_confirmed([message.delivery_id])
    assert harness.runtimes["orders"].counters.store_retries == 3
    assert harness.store.committed_batches == [[message.delivery_id]]


async def test_permanent_commit_error_fails_the_subscription_loudly(harness: Harness) -> None:
    harness.store.fail_next("commit_acks", 1, error=StoreRejected("injected: write too large"))
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1)])
    (message,) = await subscriber.next_messages(1)

    await subscriber.ack([message.delivery_id])

    code, details = await subscriber.wait_end()
    assert code is grpc.StatusCode.UNAVAILABLE
    assert "could not be made durable" in details
    assert subscriber.confirmed == []
    runtime = harness.runtimes["orders"]
    assert isinstance(runtime.failure, StoreRejected)
    assert not runtime.is_ready


async def test_stopping_the_runtime_ends_streams_with_unavailable(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1)])
    await subscriber.next_messages(1)

    await harness.runtimes["orders"].stop(grace_seconds=1)

    code, details = await subscriber.wait_end()
    assert code is grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in details


async def test_nothing_is_delivered_before_recovery() -> None:
    store = MemoryStore()
    store.fail_next("load", 2)  # recovery retries a store that is not reachable yet
    runtime = SubscriptionRuntime("orders", sequence_config(), store, RecordingDeadLetters())

    assert runtime.take("consumer", 10) == []
    assert not runtime.is_ready
    try:
        runtime.on_stored([])
    except SubscriptionUnavailable as exc:
        assert "recovering" in str(exc)
    else:
        raise AssertionError("on_stored accepted messages before recovery")

    await runtime.recover()

    await runtime.loaded()
    assert runtime.counters.store_retries == 2
    assert runtime.is_ready


async def test_dead_letter_publish_is_retried_and_never_dropped(make_harness: Callable[..., Harness]) -> None:
    harness = await make_harness({"orders": sequence_config(max_delivery_attempts=1, on_dead_letter="skip")}).start()
    harness.dead_letters.failures_left = 3
    subscriber = await harness.subscribe("orders")
    stored = await harness.publish("orders", [("k", 1), ("k", 2)])
    (first,) = await subscriber.next_messages(1)

    await subscriber.nack([first.delivery_id], retry_after_ms=0)  # the only attempt is used up

    (following,) = await subscriber.next_messages(1)
    assert following.sequence == 2
    assert harness.dead_letters.attempts == 4
    assert [m.sequence for _, m, _, _ in harness.dead_letters.published] == [1]
    await wait_until(lambda: harness.store.state_of("orders", stored[0]) == "dead_lettered", "the tombstone")


async def test_a_dead_letter_the_topic_refuses_delays_only_its_own_key(make_harness: Callable[..., Harness]) -> None:
    harness = await make_harness({"orders": sequence_config(max_delivery_attempts=1, on_dead_letter="skip")}).start()
    harness.dead_letters.refused_keys.add("a")
    runtime = harness.runtimes["orders"]
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("a", 1), ("a", 2), ("b", 1), ("b", 2)])
    first = {m.key: m for m in await subscriber.next_messages(2)}

    await subscriber.nack([first["a"].delivery_id], retry_after_ms=0)  # a/1's dead letter never goes through
    await wait_until(lambda: harness.dead_letters.attempts >= 2, "a/1's dead letter to be retried")
    await subscriber.nack([first["b"].delivery_id], retry_after_ms=0)

    # b's dead letter is published although a's is stuck, and b goes on; a waits, visibly.
    (following,) = await subscriber.next_messages(1)
    assert (following.key, following.sequence) == ("b", 2)
    assert [(m.key, m.sequence) for _, m, _, _ in harness.dead_letters.published] == [("b", 1)]
    assert runtime.dead_letters_pending == 1
    assert runtime.undelivered() >= 1  # counted: ingest pauses before pending dead letters pile up
    status = await harness.stub.GetStatus(sidecar_pb2.GetStatusRequest(subscription="orders", max_keys=10))
    assert status.subscriptions[0].counts["dead_letters_pending"] == 1
    (a_status,) = [k for k in status.subscriptions[0].keys_detail if k.key == "a"]
    assert a_status.state == "blocked_dead_letter"


async def test_undelivered_counts_ready_and_in_flight_but_not_held(harness: Harness) -> None:
    runtime = harness.runtimes["orders"]
    await harness.publish("orders", [("k", 1), ("k", 3), ("j", 1)])  # k/3 is held behind a gap
    assert runtime.undelivered() == 2

    deliveries = runtime.take("consumer", 1)
    assert len(deliveries) == 1 and runtime.undelivered() == 2
    await asyncio.wait_for(runtime.ack("consumer", [deliveries[0].delivery_id]), 10)
    assert runtime.undelivered() == 1


async def test_held_payloads_past_the_budget_stay_in_the_store_and_arrive_intact(
    make_harness: Callable[..., Harness],
) -> None:
    harness = await make_harness(max_held_bytes=3_000).start()
    runtime = harness.runtimes["orders"]
    await harness.publish("orders", [("k", seq) for seq in range(2, 12)])  # all held: 1 is missing
    # Each held message counts 600 bytes of bookkeeping, plus 150 for a payload kept (data "k:N" and
    # attribute "seq"="N", with object headers): 4 payloads fit in 3,000 bytes, 6 stay in the store.
    assert (runtime.counters.payloads_stripped, runtime.held_bytes) == (6, 4 * 750 + 6 * 600)
    subscriber = await harness.subscribe("orders", max_outstanding=100, auto_ack=True)
    await harness.publish("orders", [("k", 1)])

    await wait_until(lambda: len(subscriber.received) == 11, "every message after the gap filled")
    assert [(m.sequence, m.data, dict(m.attributes)) for m in subscriber.received] == [
        (seq, f"k:{seq}".encode(), {"seq": str(seq)}) for seq in range(1, 12)
    ]
    assert runtime.counters.payloads_read == runtime.counters.payloads_stripped
    assert harness.store.calls["read_payloads"] >= 1


async def test_a_fast_path_delivery_leaves_the_held_bytes_of_stored_messages_alone(
    make_harness: Callable[..., Harness],
) -> None:
    # A fast-path message is never counted in held_bytes (its Pub/Sub lease and the client's flow
    # control bound it): handing it out must not take its size off what stored messages hold.
    harness = await make_harness(max_held_bytes=1_000_000).start()
    runtime = harness.runtimes["orders"]
    await harness.publish("orders", [("k", 2), ("k", 3)])  # held: k/1 is missing
    held = runtime.held_bytes
    assert held > 0
    [taken] = runtime.take_fast([sequence_message("j", 1)])
    assert taken is not None and runtime.held_bytes == held

    [delivery] = runtime.take("consumer", 10)
    assert (delivery.message.key, delivery.message.sequence) == ("j", 1)
    assert runtime.held_bytes == held
