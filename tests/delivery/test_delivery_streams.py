"""Subscribe over real gRPC: order per key, sharing keys across streams, acks, nacks, closed streams."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable

from delivery_harness import Harness, sequence_config, wait_until


def _shuffled(keys: int, per_key: int, seed: int) -> list[tuple[str, int]]:
    items = [(f"k{k}", seq) for k in range(keys) for seq in range(1, per_key + 1)]
    random.Random(seed).shuffle(items)
    return items


def _assert_in_order_exactly_once(seen: list[tuple[str, int]], keys: int, per_key: int) -> None:
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, seq in seen:
        by_key[key].append(seq)
    assert len(by_key) == keys
    for key, seqs in by_key.items():
        assert seqs == list(range(1, per_key + 1)), f"key {key} arrived as {seqs}"


async def test_one_stream_receives_each_keys_messages_in_order(harness: Harness) -> None:
    keys, per_key = 5, 20
    subscriber = await harness.subscribe("orders", auto_ack=True)
    await harness.publish("orders", _shuffled(keys, per_key, seed=1))

    messages = await subscriber.next_messages(keys * per_key)

    _assert_in_order_exactly_once([(m.key, m.sequence) for m in messages], keys, per_key)
    assert all(m.delivery_attempt == 1 for m in messages)
    assert messages[0].data == f"{messages[0].key}:{messages[0].sequence}".encode()
    assert messages[0].attributes["seq"] == str(messages[0].sequence)
    assert messages[0].publish_time.seconds > 0


async def test_several_streams_share_keys_and_keep_order(harness: Harness) -> None:
    keys, per_key = 12, 10
    seen: list[tuple[str, int]] = []  # global arrival order across all streams
    per_stream: list[int] = []
    subscribers = []
    for _ in range(3):
        # A small budget per stream forces the keys to spread across the streams.
        subscriber = await harness.subscribe("orders", max_outstanding=2, auto_ack=True)
        subscriber.on_message = lambda m: seen.append((m.key, m.sequence))
        subscribers.append(subscriber)
    await harness.publish("orders", _shuffled(keys, per_key, seed=2))

    await wait_until(lambda: len(seen) >= keys * per_key, "every message")
    per_stream = [len(s.received) for s in subscribers]

    _assert_in_order_exactly_once(seen, keys, per_key)
    assert sum(1 for n in per_stream if n > 0) >= 2, f"keys were not spread: {per_stream}"


async def test_stream_never_holds_more_than_max_outstanding(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders", max_outstanding=3)
    await harness.publish("orders", [(f"k{k}", 1) for k in range(10)])

    first = await subscriber.next_messages(3)
    await _wait_status(harness, ready=7, in_flight=3)
    assert len(subscriber.received) == 3
    await subscriber.ack([first[0].delivery_id])
    more = await subscriber.next_messages(1)
    assert len(more) == 1 and len(subscriber.received) == 4


async def _wait_status(harness: Harness, *, ready: int, in_flight: int) -> None:
    def matches() -> bool:
        status, _ = harness.runtimes["orders"].status(0)
        return (status.ready, status.in_flight) == (ready, in_flight)

    await wait_until(matches, f"ready={ready} in_flight={in_flight}")


async def test_killed_stream_gives_its_messages_to_another_in_order(harness: Harness) -> None:
    first = await harness.subscribe("orders")
    await harness.publish("orders", [("k", seq) for seq in range(1, 6)])
    (in_flight,) = await first.next_messages(1)
    assert (in_flight.key, in_flight.sequence) == ("k", 1)

    second = await harness.subscribe("orders", auto_ack=True)
    await first.close()  # cancelled mid-flight, without acking

    messages = await second.next_messages(5)
    assert [m.sequence for m in messages] == [1, 2, 3, 4, 5]
    assert messages[0].dedup_id == in_flight.dedup_id
    assert messages[0].delivery_id != in_flight.delivery_id
    assert messages[0].delivery_attempt == 2
    assert [m.delivery_attempt for m in messages[1:]] == [1, 1, 1, 1]


async def test_ack_is_confirmed_only_after_the_store_made_it_durable(harness: Harness) -> None:
    gate = asyncio.Event()
    harness.store.commit_gate = gate
    subscriber = await harness.subscribe("orders")
    stored = await harness.publish("orders", [("k", 1), ("k", 2)])
    (message,) = await subscriber.next_messages(1)

    await subscriber.ack([message.delivery_id])
    await wait_until(lambda: harness.store.commits_waiting > 0, "commit_acks to reach the gate")
    # The commit is held in the store: no confirmation may come. The key's next message may: G2
    # waits for the app's ack, not for its durability.
    (following,) = await subscriber.next_messages(1)
    assert following.sequence == 2
    assert subscriber.confirmed == []
    assert harness.store.state_of("orders", stored[0]) == "pending"

    gate.set()
    await subscriber.wait_confirmed([message.delivery_id])
    assert harness.store.state_of("orders", stored[0]) == "acked"


async def test_acks_from_many_streams_are_group_committed(harness: Harness) -> None:
    gate = asyncio.Event()
    harness.store.commit_gate = gate
    subscribers = [await harness.subscribe("orders", max_outstanding=1) for _ in range(4)]
    await harness.publish("orders", [(f"k{k}", 1) for k in range(4)])
    delivered = [(s, (await s.next_messages(1))[0]) for s in subscribers]

    for subscriber, message in delivered:
        await subscriber.ack([message.delivery_id])
    await wait_until(lambda: harness.runtimes["orders"].counters.acks_submitted == len(delivered), "all acks")
    gate.set()

    for subscriber, message in delivered:
        await subscriber.wait_confirmed([message.delivery_id])
    committed = [i for batch in harness.store.committed_batches for i in batch]
    assert sorted(committed) == sorted(m.delivery_id for _, m in delivered)
    # The first commit may have left with the first ack alone; everything after it waited together.
    assert len(harness.store.committed_batches) <= 2


async def test_nack_redelivers_with_the_next_attempt(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1), ("k", 2)])
    (first,) = await subscriber.next_messages(1)

    await subscriber.nack([first.delivery_id], retry_after_ms=0)
    (again,) = await subscriber.next_messages(1)
    assert (again.sequence, again.delivery_attempt) == (1, 2)
    assert again.delivery_id != first.delivery_id

    loop = asyncio.get_running_loop()
    nacked_at = loop.time()
    await subscriber.nack([again.delivery_id], retry_after_ms=300)
    (third,) = await subscriber.next_messages(1)
    assert loop.time() - nacked_at >= 0.29
    assert (third.sequence, third.delivery_attempt) == (1, 3)


async def test_nack_with_dead_letter_publishes_and_moves_on(make_harness: Callable[..., Harness]) -> None:
    harness = await make_harness({"orders": sequence_config(on_dead_letter="skip")}).start()
    harness.dead_letters.failures_left = 2  # the topic fails twice: retried, never dropped
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1), ("k", 2)])
    (first,) = await subscriber.next_messages(1)

    await subscriber.nack([first.delivery_id], dead_letter=True)
    (following,) = await subscriber.next_messages(1)

    assert following.sequence == 2
    assert harness.dead_letters.attempts == 3
    ((subscription, message, reason, _),) = harness.dead_letters.published
    assert (subscription, message.sequence) == ("orders", 1)
    assert reason
    assert harness.store.state_of("orders", message) == "dead_lettered"


async def test_client_half_close_ends_stream_after_pending_confirmations(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1)])
    (message,) = await subscriber.next_messages(1)
    await subscriber.ack([message.delivery_id])
    await subscriber.call.done_writing()

    code, _ = await subscriber.wait_end()
    assert code.name == "OK"
    assert subscriber.confirmed == [message.delivery_id]
