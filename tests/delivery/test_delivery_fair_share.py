"""Several Subscribe streams on one subscription share its keys (docs/delivery.md): over real gRPC.

Before, whichever stream's sender ran first after messages became ready took every ready key up to
its budget (1,000 by default): with two apps, one received all 600 messages of 200 keys.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

from delivery_harness import Harness, sequence_config, wait_until

KEYS = 200
PER_KEY = 3


def _in_order(keys: int = KEYS) -> list[tuple[str, int]]:
    """Every key's messages, keys interleaved: k0#1, k1#1, ..., k0#2, ..."""
    return [(f"k{k}", seq) for seq in range(1, PER_KEY + 1) for k in range(keys)]


async def _streams_open(harness: Harness, count: int) -> None:
    assert harness.server is not None
    servicer = harness.server.servicer
    await wait_until(lambda: servicer.counters.streams_active == count, f"{count} streams open at the server")


async def test_ready_keys_are_dealt_evenly_to_the_streams_with_room(harness: Harness) -> None:
    first = await harness.subscribe("orders")
    second = await harness.subscribe("orders")
    await _streams_open(harness, 2)

    await harness.publish("orders", _in_order())
    # One message per key is in flight at a time (max_in_flight_per_key 1): 200 go out, none acked.
    await wait_until(lambda: len(first.received) + len(second.received) == KEYS, "one message of every key")

    counts = sorted([len(first.received), len(second.received)])
    assert counts == [KEYS // 2, KEYS // 2], counts
    first_keys = {m.key for m in first.received}
    second_keys = {m.key for m in second.received}
    assert not first_keys & second_keys and len(first_keys | second_keys) == KEYS


async def test_acking_streams_each_get_a_share_and_every_key_stays_in_order(harness: Harness) -> None:
    streams = [await harness.subscribe("orders", auto_ack=True) for _ in range(3)]
    seen: dict[str, list[int]] = defaultdict(list)
    for stream in streams:
        stream.on_message = lambda m: seen[m.key].append(m.sequence)
    await _streams_open(harness, 3)

    await harness.publish("orders", _in_order())
    await wait_until(lambda: sum(len(s) for s in seen.values()) == KEYS * PER_KEY, "every message")

    assert all(seqs == list(range(1, PER_KEY + 1)) for seqs in seen.values()), seen
    per_stream = [len(stream.received) for stream in streams]
    # An even deal is 200 each; the first round alone gives each stream a third of the keys.
    assert min(per_stream) >= KEYS * PER_KEY // 6, per_stream
    keys_per_stream = [len(Counter(m.key for m in stream.received)) for stream in streams]
    assert min(keys_per_stream) >= KEYS // 4, keys_per_stream


async def test_a_key_stays_on_one_stream_while_it_has_messages_in_flight(
    make_harness: Callable[..., Harness],
) -> None:
    harness = await make_harness({"orders": sequence_config(max_in_flight_per_key=PER_KEY)}).start()
    first = await harness.subscribe("orders")
    second = await harness.subscribe("orders")
    await _streams_open(harness, 2)

    await harness.publish("orders", _in_order(20))
    await wait_until(lambda: len(first.received) + len(second.received) == 20 * PER_KEY, "3 messages of 20 keys")

    streams_of: dict[str, set[int]] = defaultdict(set)
    for index, stream in enumerate((first, second)):
        for message in stream.received:
            streams_of[message.key].add(index)
    assert all(len(indexes) == 1 for indexes in streams_of.values()), streams_of
    assert sorted(Counter(index for [index] in map(list, streams_of.values())).values()) == [10, 10]
