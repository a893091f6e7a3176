"""Ingest against the Pub/Sub emulator: acks only after the store said durable, dead letters,
store failures, duplicates, backpressure, terminal stream errors (reported, pulled again) and stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from ingest_harness import IngestHarness, assert_subscription_empty
from pubsub_admin import WAIT_SECONDS, wait_until

pytestmark = pytest.mark.timeout(90)

MakeHarness = Callable[..., IngestHarness]


async def test_valid_messages_are_persisted_then_acked_and_not_redelivered(make_harness: MakeHarness) -> None:
    h = await make_harness().start()
    ids = [await h.publish_order("A", seq) for seq in (1, 2, 3)]
    ids.append(await h.publish_order("B", 1))

    await wait_until(lambda: h.counters.acked == 4, "4 acks")
    pending = await h.stored_pending()
    assert sorted((m.key, m.sequence) for m in pending) == [("A", 1), ("A", 2), ("A", 3), ("B", 1)]
    assert {m.message_id for m in pending} == set(ids)
    assert all(m.payload is not None and m.payload.data == f"{m.key}:{m.sequence}".encode() for m in pending)
    assert (h.counters.persisted, h.counters.duplicates, h.counters.nacked) == (4, 0, 0)
    # The engine has them, all releasable (no gap): they count as undelivered.
    assert h.runtime is not None and h.runtime.undelivered() == 4
    await assert_subscription_empty(h)


async def test_malformed_messages_are_dead_lettered_with_reason_then_acked(make_harness: MakeHarness) -> None:
    h = await make_harness().start()
    dead = h.admin.collect(h.dead_letter_subscription)
    no_seq = await h.admin.publish(h.topic, b"no sequence", order_id="A")
    bad_seq = await h.admin.publish(h.topic, b"bad sequence", order_id="A", seq="1e3")
    no_key = await h.admin.publish(h.topic, b"no key", seq="1")

    await wait_until(lambda: len(dead.messages) == 3, "3 dead letters")
    by_id = {m.attributes["sidecar_message_id"]: m for m in dead.messages}
    assert set(by_id) == {no_seq, bad_seq, no_key}
    assert by_id[no_seq].data == b"no sequence"
    assert by_id[bad_seq].attributes["seq"] == "1e3"  # the original attributes travel along
    for message in dead.messages:
        assert message.attributes["sidecar_reason"].startswith("malformed: ")
        assert message.attributes["sidecar_subscription"] == "orders"
        # The key when it could be read (issue 31: `dead-letters list --key` finds it).
        assert message.attributes["sidecar_key"] == ("" if message.data == b"no key" else "A")
        assert message.attributes["sidecar_delivery_attempts"] == "0"
    await wait_until(lambda: h.counters.acked == 3, "3 acks")
    assert (h.counters.malformed, h.counters.dead_lettered, h.counters.persisted) == (3, 3, 0)
    assert await h.stored_pending() == []
    await assert_subscription_empty(h)


async def test_store_failure_means_no_ack_and_the_message_is_persisted_after_redelivery(
    make_harness: MakeHarness,
) -> None:
    h = await make_harness().start()
    h.store.fail_next("persist", 2)
    for seq in (1, 2, 3):
        await h.publish_order("A", seq)

    await wait_until(lambda: h.counters.persisted == 3 and h.counters.acked == 3, "3 persisted and acked")
    assert h.counters.persist_failures >= 1
    # Failed ones were nacked (not acked) and came back from Pub/Sub.
    assert h.counters.nacked == h.counters.persist_failures
    assert h.counters.received == 3 + h.counters.persist_failures
    assert sorted(m.sequence for m in await h.stored_pending()) == [1, 2, 3]
    await assert_subscription_empty(h)


async def test_duplicates_are_acked_and_not_stored_again(make_harness: MakeHarness) -> None:
    h = await make_harness().start()
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.persisted == 1, "first copy persisted")
    await h.publish_order("A", 1)  # a publisher retry: same key, sequence and payload, new message id

    await wait_until(lambda: h.counters.duplicates == 1 and h.counters.acked == 2, "duplicate acked")
    assert h.counters.persisted == 1
    assert [(m.key, m.sequence) for m in await h.stored_pending()] == [("A", 1)]
    assert h.runtime is not None and h.runtime.undelivered() == 1
    await assert_subscription_empty(h)


async def test_conflict_is_dead_lettered_then_acked_and_the_first_copy_kept(make_harness: MakeHarness) -> None:
    h = await make_harness().start()
    dead = h.admin.collect(h.dead_letter_subscription)
    await h.publish_order("A", 1, data=b"first")
    await wait_until(lambda: h.counters.persisted == 1, "first copy persisted")
    conflicting = await h.publish_order("A", 1, data=b"second")

    await wait_until(lambda: len(dead.messages) == 1 and h.counters.acked == 2, "conflict dead-lettered, acked")
    [letter] = dead.messages
    assert letter.data == b"second"
    assert letter.attributes["sidecar_reason"] == "conflict"
    assert letter.attributes["sidecar_key"] == "A"
    assert letter.attributes["sidecar_message_id"] == conflicting
    [kept] = await h.stored_pending()
    assert kept.payload is not None and kept.payload.data == b"first"
    assert h.counters.conflicts == 1


async def test_dead_letter_publish_failure_is_retried_and_not_acked_meanwhile(make_harness: MakeHarness) -> None:
    h = make_harness()
    await h.setup()
    dead = h.admin.collect(h.dead_letter_subscription)
    await h.admin.publish(h.topic, b"no sequence", order_id="A")
    await h.admin.add_fault(method="Publish", code="UNAVAILABLE", rate=1.0)
    await h.start_ingest()

    await wait_until(lambda: h.counters.dead_letter_failures >= 2, "two failed dead-letter publishes")
    assert h.counters.acked == 0 and h.counters.nacked == 0
    assert h.ingestor is not None and h.ingestor.held_messages == 1
    assert dead.messages == []

    await h.admin.clear_faults()
    await wait_until(lambda: len(dead.messages) == 1 and h.counters.acked == 1, "dead letter after the fault")
    assert dead.messages[0].data == b"no sequence"
    assert h.counters.dead_lettered == 1
    await assert_subscription_empty(h)


async def test_without_a_dead_letter_topic_a_malformed_message_stays_in_pubsub(make_harness: MakeHarness) -> None:
    h = await make_harness(with_dead_letter_topic=False, backoff_maximum_seconds=0.2).start()
    await h.admin.publish(h.topic, b"no sequence", order_id="A")

    # Nacked after the maximum backoff, again on each redelivery; never acked.
    await wait_until(lambda: h.counters.nacked >= 2, "two nacks")
    assert h.counters.acked == 0 and h.counters.dead_lettered == 0
    assert h.counters.dead_letter_failures >= 2


async def test_pulling_pauses_while_undelivered_is_over_the_limit_and_resumes(make_harness: MakeHarness) -> None:
    h = await make_harness(
        mode="none", max_undelivered_messages=4, max_batch_messages=2, max_concurrent_persists=1
    ).start()
    assert h.runtime is not None and h.ingestor is not None
    for n in range(12):
        await h.admin.publish(h.topic, f"m{n}".encode())

    await wait_until(lambda: h.ingestor is not None and h.ingestor.is_paused, "ingest paused")
    # One batch (2) may pass the limit (4) before the check sees it; nothing more is persisted.
    assert 4 < h.counters.persisted <= 6
    assert h.runtime.undelivered() == h.counters.persisted
    held_while_paused = h.counters.persisted
    assert h.counters.acked == held_while_paused

    # The app consumes: undelivered drops, pulling resumes, and everything arrives in the end.
    runtime = h.runtime
    delivered: set[str] = set()

    async def app_takes_and_acks() -> bool:
        deliveries = runtime.take("app", 100)
        if deliveries:
            result = await runtime.ack("app", [d.delivery_id for d in deliveries])
            assert len(result.confirmed) == len(deliveries)
            delivered.update(d.message.message_id for d in deliveries)
        return len(delivered) == 12

    await _until_async(app_takes_and_acks, "the app got all 12", WAIT_SECONDS)
    assert h.counters.persisted == 12 and h.counters.acked == 12
    assert h.counters.pauses >= 1
    assert not h.ingestor.is_paused


async def test_messages_held_for_ordering_never_pause_pulling(make_harness: MakeHarness) -> None:
    h = await make_harness(max_undelivered_messages=2, max_batch_messages=2).start()
    assert h.runtime is not None
    for seq in range(2, 9):  # sequence 1 is missing: all of these are held behind the gap
        await h.publish_order("K", seq)
    await wait_until(lambda: h.counters.persisted == 7, "7 held messages persisted")
    assert h.counters.pauses == 0 and h.runtime.undelivered() == 0

    await h.publish_order("K", 1)  # the message that fills the gap was still in Pub/Sub
    await wait_until(lambda: h.counters.persisted == 8, "the gap filled")
    assert h.runtime.undelivered() >= 1


async def test_broken_stream_and_failing_acks_are_survived_without_loss(make_harness: MakeHarness) -> None:
    h = await make_harness().start()
    await h.publish_order("A", 1)
    await wait_until(lambda: h.counters.acked == 1, "first message acked")
    await h.admin.break_streams("UNAVAILABLE")  # transient: the client reopens the stream
    await h.admin.add_fault(method="Acknowledge", code="UNAVAILABLE", rate=0.5)
    for seq in (2, 3, 4):
        await h.publish_order("A", seq)

    await wait_until(lambda: h.counters.persisted == 4, "all 4 persisted after the break")
    assert h.ingestor is not None and h.ingestor.is_healthy
    # A lost ack only means a later redelivery, which the store reports as a DUPLICATE.
    assert sorted(m.sequence for m in await h.stored_pending()) == [1, 2, 3, 4]
    assert h.counters.nacked == 0


async def test_missing_subscription_is_reported_loudly_and_run_keeps_pulling(make_harness: MakeHarness) -> None:
    # The pull closed for good is reported (readiness, GetStatus, metrics) and opened again after a
    # backoff, so that the pod recovers once the subscription exists (test_ingest_pull_health.py).
    h = make_harness()
    await h.setup(create_subscription=False)
    await h.start_ingest()
    assert h.run_task is not None and h.ingestor is not None
    ingestor = h.ingestor
    await wait_until(lambda: "closed by NOT_FOUND" in (ingestor.pull_health.problem() or ""), "the close reported")
    assert not h.run_task.done() and not ingestor.is_healthy


async def test_stop_gives_back_unpersisted_messages_for_the_next_ingestor(make_harness: MakeHarness) -> None:
    # A long backoff keeps failed messages held by the ingestor when stop() comes.
    h = await make_harness(backoff_initial_seconds=30.0, backoff_maximum_seconds=30.0).start()
    assert h.ingestor is not None and h.ingestor.is_healthy
    h.store.fail_next("persist", 1000)
    for seq in (1, 2, 3):
        await h.publish_order("A", seq)
    await wait_until(lambda: h.counters.persist_failures == 3, "3 failed persists")
    assert h.ingestor.held_messages == 3

    await h.stop_ingest()
    assert h.counters.nacked == 3 and h.counters.acked == 0 and h.ingestor.held_messages == 0
    assert not h.ingestor.is_healthy

    h.store.fail_next("persist", 0)
    await h.start_ingest()  # a new Ingestor on the same subscription, store and runtime
    await wait_until(lambda: h.counters.persisted == 3 and h.counters.acked == 3, "3 persisted after restart")
    await assert_subscription_empty(h)


async def _until_async(step: Callable[[], Awaitable[bool]], what: str, within_seconds: float) -> None:
    """Run an async ``step`` until it returns True, with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_seconds
    while not await step():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within_seconds}s waiting for {what}")
        await asyncio.sleep(0.02)
