"""Shard loads that run at the same time (``DocumentStore.load(shards=...)``): each reads without the
subscription's lock, so other shards' loads, acks and flushes go on meanwhile; only the cursor book is
restored under the lock, in one step. A load cancelled midway (its shard dropped while loading) leaves
nothing of itself behind, and loading the shard again later works."""

from __future__ import annotations

import asyncio

from gated_documents import DEADLINE_SECONDS as _DEADLINE_SECONDS
from gated_documents import GatedDocuments, keys_by_shard, until
from store_helpers import ack, incoming

from sidecar.engine.payloads import HELD_MESSAGE_OVERHEAD_BYTES
from sidecar.store import layout
from sidecar.store.api import PayloadBudget, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore

_SHARDS = 4
_CONFIG = {"orders": SubscriptionStoreConfig(mode="sequence", shards=_SHARDS)}


def _keys(per_shard: int) -> dict[int, list[str]]:
    return keys_by_shard(_SHARDS, per_shard)


async def _filled(documents: GatedDocuments, keys: dict[int, list[str]], per_key: int) -> None:
    """Every key's message 1 acked (a tombstone, and its cursor in the shard's checkpoint), messages
    2..per_key+1 pending, by a pod that then went away."""
    writer = DocumentStore(documents, _CONFIG, background_flush=False)
    every = [key for shard_keys in keys.values() for key in shard_keys]
    results = await writer.persist("orders", [incoming(key, 1) for key in every], 1_000)
    await writer.commit_acks("orders", [ack(result.message, 2) for result in results], 1_500)
    await writer.flush("orders")
    await writer.persist("orders", [incoming(key, seq) for key in every for seq in range(2, per_key + 2)], 1_600)


async def test_two_shards_load_at_the_same_time_and_each_restores_only_its_keys() -> None:
    documents = GatedDocuments()
    keys = _keys(3)
    await _filled(documents, keys, per_key=4)
    documents.gates = {0: asyncio.Event(), 1: asyncio.Event()}
    store = DocumentStore(documents, _CONFIG, background_flush=False)

    loads = {shard: asyncio.ensure_future(store.load("orders", 2_000, shards=frozenset({shard}))) for shard in (0, 1)}
    # Both shards read at once: neither waits for the other's load to end (the reads hold no lock).
    await until(documents, lambda: documents.waiting.get(0, 0) > 0 and documents.waiting.get(1, 0) > 0, "both reading")
    assert not any(load.done() for load in loads.values())
    # And each load's reads run together: its cursors, tombstones and pending messages are all asked for.
    await until(documents, lambda: documents.waiting[0] >= 3 and documents.waiting[1] >= 3, "three reads per load")
    documents.gates[1].set()
    snapshot_1 = await asyncio.wait_for(loads[1], _DEADLINE_SECONDS)
    assert not loads[0].done()
    documents.gates[0].set()
    snapshot_0 = await asyncio.wait_for(loads[0], _DEADLINE_SECONDS)

    for shard, snapshot in ((0, snapshot_0), (1, snapshot_1)):
        assert {m.key for m in snapshot.pending} == set(keys[shard])
        assert sorted(m.sequence for m in snapshot.pending if m.key == keys[shard][0]) == [2, 3, 4, 5]
    # The book knows both shards' keys (sequence 1 acked), and nothing of the others.
    for key in keys[0] + keys[1]:
        cursor = store.cursor("orders", key)
        assert cursor is not None and cursor.next_sequence == 2
    assert all(store.cursor("orders", key) is None for key in keys[2] + keys[3])


async def test_a_load_cancelled_midway_leaves_nothing_and_the_shard_loads_again_later() -> None:
    documents = GatedDocuments()
    keys = _keys(2)
    await _filled(documents, keys, per_key=3)
    documents.gates = {0: asyncio.Event(), 1: asyncio.Event()}
    store = DocumentStore(documents, _CONFIG, background_flush=False)

    dropped = asyncio.ensure_future(store.load("orders", 2_000, shards=frozenset({0})))
    other = asyncio.ensure_future(store.load("orders", 2_000, shards=frozenset({1})))
    await until(documents, lambda: documents.waiting.get(0, 0) >= 3 and documents.waiting.get(1, 0) >= 3, "reading")
    # Shard 0 is dropped while it loads: its lease manager cancels the load.
    dropped.cancel()
    await until(documents, lambda: documents.waiting[0] == 0, "the cancelled reads to end")
    assert dropped.cancelled()
    documents.gates[1].set()
    await asyncio.wait_for(other, _DEADLINE_SECONDS)
    assert all(store.cursor("orders", key) is None for key in keys[0])
    assert all(store.cursor("orders", key) is not None for key in keys[1])

    documents.gates[0].set()
    again = await asyncio.wait_for(store.load("orders", 2_000, shards=frozenset({0})), _DEADLINE_SECONDS)
    assert {m.key for m in again.pending} == set(keys[0]) and len(again.pending) == 3 * len(keys[0])
    assert all(store.cursor("orders", key) is not None for key in keys[0] + keys[1])


async def test_acks_of_a_loaded_shard_commit_while_another_shard_is_still_loading() -> None:
    documents = GatedDocuments()
    keys = _keys(1)
    writer = DocumentStore(documents, _CONFIG, background_flush=False)
    await writer.persist("orders", [incoming(keys[0][0], 1), incoming(keys[1][0], 2)], 1_000)
    store = DocumentStore(documents, _CONFIG, background_flush=False)
    loaded = await store.load("orders", 2_000, shards=frozenset({0}))
    documents.gates = {1: asyncio.Event()}
    loading = asyncio.ensure_future(store.load("orders", 2_000, shards=frozenset({1})))
    await until(documents, lambda: documents.waiting.get(1, 0) >= 3, "shard 1 reading")

    # The load of shard 1 holds no lock while it reads: shard 0's ack commits meanwhile.
    (message,) = loaded.pending
    await asyncio.wait_for(store.commit_acks("orders", [ack(message, 2)], 3_000), _DEADLINE_SECONDS)
    assert documents.docs[layout.message_path("pubsub-sidecar/orders", message.payload.ref)]["state"] == layout.ACKED
    assert not loading.done()
    documents.gates[1].set()
    assert [m.sequence for m in (await asyncio.wait_for(loading, _DEADLINE_SECONDS)).pending] == [2]


async def test_loads_at_the_same_time_share_one_payload_budget() -> None:
    documents = GatedDocuments()
    keys = _keys(1)
    writer = DocumentStore(documents, _CONFIG, background_flush=False)
    await writer.persist(
        "orders",
        [incoming(keys[shard][0], seq, data=bytes([seq]) * 1_000) for shard in (0, 1) for seq in range(2, 12)],
        1_000,
    )
    store = DocumentStore(documents, _CONFIG, background_flush=False)
    # Each message counts its bookkeeping (600 bytes), plus 1,143 for a payload kept: one budget of
    # 8,000 bytes for both loads keeps 4 payloads in all, where 8,000 each would keep 4 + 4.
    budget = PayloadBudget(8_000)
    documents.gates = {0: asyncio.Event(), 1: asyncio.Event()}
    loads = [asyncio.ensure_future(store.load("orders", 2_000, None, budget, frozenset({s}))) for s in (0, 1)]
    await until(documents, lambda: documents.waiting.get(0, 0) >= 3 and documents.waiting.get(1, 0) >= 3, "reading")
    documents.gates[0].set()
    documents.gates[1].set()
    snapshots = await asyncio.wait_for(asyncio.gather(*loads), _DEADLINE_SECONDS)
    pending = [m for snapshot in snapshots for m in snapshot.pending]
    kept = [m for m in pending if not m.payload.stripped]
    assert len(pending) == 20
    assert len(kept) == 4
    assert all(m.payload.data == bytes([m.sequence]) * 1_000 for m in kept)
    assert budget.remaining == 8_000 - 20 * HELD_MESSAGE_OVERHEAD_BYTES - 4 * 1_143
