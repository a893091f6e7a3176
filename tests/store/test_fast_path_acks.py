"""Acks of fast-path messages (no document): durable with their shard's next checkpoint."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from store_helpers import ack, client_of, cursors, documents, incoming

from sidecar.engine.types import KeyCursor, Message
from sidecar.shards import shard_of
from sidecar.store.api import ShardLost, SubscriptionStoreConfig

_ROOT = "pubsub-sidecar/orders"


def volatile(key: str, seq: int) -> Message:
    return incoming(key, seq).to_message(1000, "", volatile=True)


async def test_a_fast_path_ack_writes_no_document_and_returns_once_its_checkpoint_is_durable(make_store, emulator):
    config = {"orders": SubscriptionStoreConfig(mode="sequence", shards=4)}
    store = make_store(config, cursor_write_interval_ms=200)
    await store.load("orders", store._clock_ms())
    keys = [f"k{i}" for i in range(40)]
    before = emulator.counters()
    await store.commit_acks("orders", [ack(volatile(key, 1), 2) for key in keys], store._clock_ms())
    spent = {name: emulator.counters()[name] - before[name] for name in ("reads", "writes", "deletes")}
    shards = {shard_of(key, 4) for key in keys}
    assert spent == {"reads": 0, "writes": len(shards), "deletes": 0}, "one checkpoint per shard, nothing else"
    client = client_of(store)
    assert await documents(client, f"{_ROOT}/messages") == {}
    assert {key: fields["next_seq"] for key, fields in (await cursors(client, _ROOT)).items()} == dict.fromkeys(keys, 2)
    snapshot = await make_store(config).load("orders", store._clock_ms())
    assert sorted(snapshot.cursors, key=lambda c: c.key) == sorted((KeyCursor(k, 2) for k in keys), key=lambda c: c.key)


async def test_fast_path_acks_wait_for_the_coalescing_interval_not_longer(make_store):
    store = make_store(cursor_write_interval_ms=300)
    await store.load("orders", store._clock_ms())
    await store.commit_acks("orders", [ack(volatile("a", 1), 2)], store._clock_ms())  # writes the checkpoint
    loop = asyncio.get_running_loop()
    started = loop.time()
    await store.commit_acks("orders", [ack(volatile("a", 2), 3)], store._clock_ms())
    waited = loop.time() - started
    assert waited < 5.0, "the background flush writes the checkpoint once it is due"
    assert store.cursor("orders", "a") == KeyCursor("a", 3)


async def test_a_fast_path_ack_of_a_lost_shard_raises_shard_lost_and_is_not_durable(make_store):
    lost: set[int] = set()

    def fences(subscription: str, shard: int):
        if shard in lost:
            raise ShardLost(subscription, [shard])
        return None

    config = {"orders": SubscriptionStoreConfig(mode="sequence", shards=2)}
    store = make_store(config, cursor_write_interval_ms=100, fences=fences)
    await store.load("orders", store._clock_ms())
    gone = next(key for key in (f"k{i}" for i in range(100)) if shard_of(key, 2) == 1)
    kept = next(key for key in (f"k{i}" for i in range(100)) if shard_of(key, 2) == 0)
    lost.add(1)
    with pytest.raises(ShardLost) as caught:
        await store.commit_acks("orders", [ack(volatile(gone, 1), 2), ack(volatile(kept, 1), 2)], store._clock_ms())
    assert caught.value.shards == frozenset({1})
    assert store.cursor("orders", gone) is None and store.cursor("orders", kept) == KeyCursor(kept, 2)
    assert set(await cursors(client_of(store), _ROOT)) == {kept}


async def test_the_background_flush_writes_the_checkpoints_a_quarter_of_the_shards_at_a_time(make_store):
    # All at once, one flush built every shard's checkpoint and settled every waiting ack in one step
    # of the event loop, a pause each interval that every message arriving meanwhile waited out.
    config = {"orders": SubscriptionStoreConfig(mode="sequence", shards=8)}
    store = make_store(config, cursor_write_interval_ms=400)
    await store.load("orders", store._clock_ms())
    keys = [f"k{i}" for i in range(64)]
    assert {shard_of(key, 8) for key in keys} == set(range(8))
    await store.commit_acks("orders", [ack(volatile(key, 1), 2) for key in keys], store._clock_ms())
    client = client_of(store)
    written = sorted(
        [snap.update_time.timestamp() async for snap in client.collection(f"{_ROOT}/checkpoints").stream()]
    )
    assert len(written) == 8, "every shard's checkpoint, once"
    parts = [written[i : i + 2] for i in range(0, 8, 2)]
    assert all(len(set(part)) == 1 for part in parts), f"two shards per Commit: {written}"
    gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(parts)]
    assert all(gap >= 0.09 for gap in gaps), f"parts a round (100 ms) apart: {gaps}"
    assert {key: fields["next_seq"] for key, fields in (await cursors(client, _ROOT)).items()} == dict.fromkeys(keys, 2)
