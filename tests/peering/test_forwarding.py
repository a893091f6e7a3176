"""Forwarding to the key's owner over the real peer channel, between two pods on the emulators
(``peer_harness``): delivered by the owner, acked with Pub/Sub only once the owner's outcome is
durable, falling back to the inbox on any refusal or a broken channel, and costing what the owner's
own fast path costs."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime

import pytest
from peer_harness import TwoPods, shard_of_key
from pubsub_admin import wait_until

from sidecar.pipeline.ingest_forwarded import ForwardedMessage
from sidecar.store import documents as docs

pytestmark = pytest.mark.timeout(120)


async def _take_one(pods: TwoPods) -> object:
    taken: list[object] = []

    def more() -> bool:
        taken.extend(pods.take(1))
        return bool(taken)

    await wait_until(more, "a delivery at the owner")
    return taken[0]


async def test_a_forwarded_in_order_message_is_delivered_by_the_owner_and_acked_once_its_app_ack_is_durable(
    make_pods,
) -> None:
    pods = await make_pods().start()
    sender, owner = pods.sender.ingestor, pods.owner.ingestor
    assert sender is not None and owner is not None and pods.owner.runtime is not None
    before = pods.billed()
    await pods.publish("A", 1)
    delivery = await _take_one(pods)
    assert delivery.message.sequence == 1 and delivery.message.volatile, "the owner's fast path took it"
    assert owner.counters.forwarded_in == 1 and owner.counters.received == 0, "not received from Pub/Sub"
    # The owner's app has not acked: the sender still holds the message, unacked with Pub/Sub.
    assert sender.counters.acked == 0 and sender.held_messages == 1
    result = await pods.owner.runtime.ack("app", [delivery.delivery_id])
    assert result.confirmed == [delivery.delivery_id]
    await wait_until(lambda: sender.counters.acked == 1, "the sender's Pub/Sub ack after the owner's durable ack")
    assert sender.counters.forwarded == 1 and sender.counters.stored_for_owner == 0
    assert owner.counters.acked == 0, "the owner acked nothing with Pub/Sub: it answered the sender"
    # No message document, no inbox: only the key's cursor checkpoint, as at the owner's own fast path.
    assert not [path for path in pods.documents.docs if "/messages/" in path], "nothing stored for the message"
    # A checkpoint is a fenced commit (a write and the lease read); on a loaded machine the cursor's
    # flushes may fall in two commits. The inbox's way costs more (test_a_stale_epoch_...).
    assert pods.billed() - before <= 4
    await sender.stop()
    assert await pods.admin.pull_available(pods.subscription) == []


async def _deliver_all(pods: TwoPods, want: int) -> list[tuple[str, int]]:
    """Take and ack deliveries at the owner until ``want`` were confirmed; (key, sequence) of each."""
    assert pods.owner.runtime is not None
    seen: list[tuple[str, int]] = []

    async def step() -> None:
        for delivery in pods.take(10):
            seen.append((delivery.message.key, delivery.message.sequence))
            result = await pods.owner.runtime.ack("app", [delivery.delivery_id])  # type: ignore[union-attr]
            assert result.confirmed == [delivery.delivery_id]

    async def until_done() -> None:
        while len(seen) < want:
            await step()
            await asyncio.sleep(0.01)

    await asyncio.wait_for(until_done(), 30)
    return seen


async def _nothing_more(pods: TwoPods) -> None:
    """No further delivery at the owner, checked after every message of the sender is settled."""
    sender = pods.sender.ingestor
    assert sender is not None
    await wait_until(lambda: sender.held_messages == 0, "the sender settled everything")
    await wait_until(lambda: pods.owner.ingestor is not None and pods.owner.ingestor.held_messages == 0, "owner idle")
    assert pods.take(10) == []


async def test_the_owners_store_failing_means_no_pub_sub_ack_and_the_message_survives(make_pods) -> None:
    pods = await make_pods().start()
    sender = pods.sender.ingestor
    assert sender is not None

    def refuse(kind: str, writes: object) -> None:
        raise docs.Unavailable("test: Firestore unavailable")

    pods.documents.before_write = refuse
    await pods.publish("B", 2)  # beyond the gap at 1: the owner must store it
    await wait_until(lambda: sender.counters.forward_refused >= 1, "the owner gave it back (FAILED)")
    await wait_until(lambda: sender.counters.persist_failures >= 1, "the inbox's way failed too")
    assert pods.forwarder.stats.refused["failed"] >= 1
    assert sender.counters.acked == 0 and sender.counters.forwarded == 0, "never acked while nothing is durable"
    pods.documents.before_write = None
    await pods.publish("B", 1)
    assert await _deliver_all(pods, 2) == [("B", 1), ("B", 2)]
    await _nothing_more(pods)
    assert sender.counters.acked == 2


async def test_a_stale_epoch_is_refused_and_the_message_goes_through_the_inbox_once(make_pods) -> None:
    pods = await make_pods().start()
    sender = pods.sender.ingestor
    assert sender is not None
    shard = shard_of_key("C")
    pods.directory.routes[shard] = dataclasses.replace(pods.directory.routes[shard], epoch=2)  # the owner holds 3
    before = pods.billed()
    await pods.publish("C", 1)
    assert await _deliver_all(pods, 1) == [("C", 1)]
    await _nothing_more(pods)
    assert pods.forwarder.stats.refused["stale_epoch"] == 1 and pods.server.stats.refused["stale_epoch"] == 1
    assert pods.directory.forgotten == [shard], "the stale route is to be read again"
    assert (sender.counters.stored_for_owner, sender.counters.forwarded, sender.counters.acked) == (1, 0, 1)
    inbox_cost = pods.billed() - before
    # The forwarded way, on a key of another shard of the same pods, for comparison.
    other = next(key for key in (f"D{i}" for i in range(100)) if shard_of_key(key) != shard)
    before = pods.billed()
    await pods.publish(other, 1)
    assert await _deliver_all(pods, 1) == [(other, 1)]
    await _nothing_more(pods)
    forwarded_cost = pods.billed() - before
    assert sender.counters.forwarded == 1
    assert forwarded_cost + 2 <= inbox_cost, (forwarded_cost, inbox_cost)


async def test_a_shard_the_owner_does_not_hold_is_refused_and_delivered_once_it_is_gained(make_pods) -> None:
    pods = await make_pods().start()
    sender, ownership = pods.sender.ingestor, pods.owner.ownership
    assert sender is not None and ownership is not None
    shard = shard_of_key("E")
    pods.owner.epochs.pop(shard)
    ownership.on_lost(shard, 3)
    await pods.publish("E", 1)
    await wait_until(lambda: sender.counters.stored_for_owner == 1, "refused, then stored for the owner")
    assert pods.forwarder.stats.refused["not_owner"] == 1
    assert pods.take(10) == []
    pods.hold(shard, 4)
    await ownership.on_gained(shard, 4)
    assert await _deliver_all(pods, 1) == [("E", 1)]
    await _nothing_more(pods)


async def test_a_channel_broken_mid_flight_falls_back_and_nothing_confirmed_is_delivered_again(make_pods) -> None:
    pods = await make_pods().start()
    sender = pods.sender.ingestor
    assert sender is not None and pods.owner.runtime is not None
    await pods.publish("F", 1)
    delivery = await _take_one(pods)
    assert delivery.message.volatile and sender.counters.acked == 0
    await pods.server.stop(0)  # the owner's peer server goes away while its answer is pending
    await wait_until(lambda: sender.counters.stored_for_owner == 1, "the sender stored it for the owner")
    await wait_until(lambda: sender.counters.acked == 1, "acked once the inbox copy is durable")
    assert pods.forwarder.stats.refused["broken"] == 1
    result = await pods.owner.runtime.ack("app", [delivery.delivery_id])
    assert result.confirmed == [delivery.delivery_id]
    await _nothing_more(pods)
    # The channel is unusable now: later messages go the inbox's way at once, and arrive.
    await pods.publish("F", 2)
    assert await _deliver_all(pods, 1) == [("F", 2)]
    await _nothing_more(pods)


async def test_past_the_owners_bound_a_forwarded_message_is_refused_overloaded(make_pods) -> None:
    pods = make_pods()
    pods.max_in_flight = 1
    await pods.start()
    sender = pods.sender.ingestor
    assert sender is not None
    await pods.publish("G", 1)
    first = await _take_one(pods)  # in flight at the owner until its app acks it
    await pods.publish("H", 1)
    await wait_until(lambda: sender.counters.stored_for_owner == 1, "refused OVERLOADED, stored for the owner")
    assert pods.server.stats.refused["overloaded"] == 1 and pods.forwarder.stats.refused["overloaded"] == 1
    assert pods.owner.runtime is not None
    await pods.owner.runtime.ack("app", [first.delivery_id])
    assert await _deliver_all(pods, 1) == [("H", 1)]
    await _nothing_more(pods)
    assert sender.counters.acked == 2


@pytest.mark.parametrize("secret", [None, b"forged"], ids=["no credentials", "forged secret"])
async def test_a_call_without_the_secret_is_unauthenticated_counted_and_the_message_still_arrives(
    make_pods, secret: bytes | None
) -> None:
    pods = await make_pods(sender_secret=secret).start()
    sender = pods.sender.ingestor
    assert sender is not None
    await pods.publish("J", 1)
    assert await _deliver_all(pods, 1) == [("J", 1)]
    await _nothing_more(pods)
    assert pods.server.stats.unauthenticated == 1
    assert pods.owner.ingestor is not None and pods.owner.ingestor.counters.forwarded_in == 0
    assert pods.forwarder.stats.refused["broken"] == 1 and sender.counters.stored_for_owner == 1


async def test_a_frame_over_the_owners_size_bound_is_refused_and_the_message_takes_the_inbox(make_pods) -> None:
    pods = await make_pods(max_message_bytes=64 * 1024).start()
    sender = pods.sender.ingestor
    assert sender is not None
    await pods.publish("K", 1, data=b"x" * (200 * 1024))
    assert await _deliver_all(pods, 1) == [("K", 1)]
    await _nothing_more(pods)
    assert pods.owner.ingestor is not None and pods.owner.ingestor.counters.forwarded_in == 0
    assert pods.forwarder.stats.refused["broken"] == 1 and sender.counters.stored_for_owner == 1


async def test_past_the_senders_window_a_message_is_stored_for_the_owner_at_once(make_pods) -> None:
    pods = await make_pods(forwarder_kwargs={"window": 1}).start()
    sender = pods.sender.ingestor
    assert sender is not None and pods.owner.runtime is not None
    await pods.publish("L", 1)
    first = await _take_one(pods)  # its answer waits for the owner's app: the window stays full
    await pods.publish("M", 1)
    await wait_until(lambda: sender.counters.stored_for_owner == 1, "stored for the owner: the window is full")
    assert sender.counters.forward_refused == 0, "declined at once, never sent"
    await pods.owner.runtime.ack("app", [first.delivery_id])
    assert await _deliver_all(pods, 1) == [("M", 1)]
    await _nothing_more(pods)
    assert (sender.counters.forwarded, sender.counters.acked) == (1, 2)


async def test_many_messages_of_several_keys_go_in_batches_and_arrive_in_order_per_key(make_pods) -> None:
    pods = await make_pods().start()
    sender = pods.sender.ingestor
    assert sender is not None
    keys = ["N", "P", "Q"]
    futures = [
        pods.admin.publisher.publish(pods.topic, f"{key}:{seq}".encode(), order_id=key, seq=str(seq))
        for seq in range(1, 21)
        for key in keys
    ]
    for future in futures:
        await asyncio.wrap_future(future)
    seen = await _deliver_all(pods, 60)
    for key in keys:
        assert [seq for k, seq in seen if k == key] == list(range(1, 21)), key
    await _nothing_more(pods)
    assert sender.counters.forwarded == 60 and sender.counters.stored_for_owner == 0


async def test_messages_taken_together_are_sent_in_batches_within_the_bound_and_each_answered_once(make_pods) -> None:
    pods = await make_pods(forwarder_kwargs={"max_batch_messages": 8}).start()
    answers: list[tuple[int, bool]] = []
    now = datetime.datetime.now(datetime.UTC)
    for seq in range(1, 31):
        message = ForwardedMessage(
            message_id=f"m{seq}",
            data=f"R:{seq}".encode(),
            attributes={"order_id": "R", "seq": str(seq)},
            ordering_key="",
            publish_time=now,
            delivery_attempt=0,
            on_settled=lambda accepted: None,
        )
        taken = pods.forwarder.forward(
            "orders", shard_of_key("R"), message, lambda accepted, seq=seq: answers.append((seq, accepted))
        )
        assert taken
    assert await _deliver_all(pods, 30) == [("R", seq) for seq in range(1, 31)]
    await wait_until(lambda: len(answers) == 30, "every message answered")
    assert sorted(answers) == [(seq, True) for seq in range(1, 31)]
    assert (pods.forwarder.stats.sent, pods.forwarder.stats.batches) == (30, 4), "taken together: 8+8+8+6"


async def test_an_owner_stopping_gives_forwarded_messages_back_to_their_sender_which_stores_them(make_pods) -> None:
    pods = await make_pods().start()
    sender, owner = pods.sender.ingestor, pods.owner.ingestor
    assert sender is not None and owner is not None and pods.owner.runtime is not None
    await pods.publish("S", 1)
    delivery = await _take_one(pods)  # taken by the owner's fast path: its answer waits for the app
    await owner.stop(grace_seconds=1.0)
    await wait_until(lambda: pods.forwarder.stats.refused["failed"] == 1, "given back: REFUSED failed")
    await wait_until(lambda: sender.counters.stored_for_owner == 1, "stored for the owner instead")
    await wait_until(lambda: sender.counters.acked == 1, "acked once stored")
    await pods.owner.runtime.ack("app", [delivery.delivery_id])
    await wait_until(lambda: sender.held_messages == 0, "the sender settled everything")
    assert pods.take(10) == [], "the stored copy is not delivered again"
