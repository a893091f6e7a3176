"""SubscriptionRuntime with shards: one engine per owned shard over the real DocumentStore.

The store is ``DocumentStore`` over ``MemoryDocuments`` (Firestore's semantics in memory) with a
fence source reading lease documents this test writes itself, as another pod taking a shard would.
No lease manager: the test plays its part (``adopt_shard``, ``drop_shard``, ``lease_check``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from sidecar.engine.types import EngineConfig
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.pipeline.runtime_context import NotOwner
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store.api import IncomingMessage, PersistOutcome, ShardLost, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

SHARDS = 4
ROOT = "t"
SUB = "orders"


class _Sink:
    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []

    async def publish(self, subscription: str, message: object, reason: str, attempts: int) -> None:
        self.published.append((getattr(message, "dedup_id", "?"), reason))


class World:
    """One pod's runtime and store, and the lease documents as every pod sees them."""

    def __init__(self, *, background_flush: bool = False, **runtime_kwargs: Any) -> None:
        """``background_flush``: the store writes lagging checkpoints by itself (every 200 ms);
        ``runtime_kwargs`` go to the runtime (``max_held_bytes``, ...)."""
        self.documents = MemoryDocuments()
        self.epochs: dict[int, int] = {}
        self.store = DocumentStore(
            self.documents,
            {SUB: SubscriptionStoreConfig(mode="sequence", shards=SHARDS)},
            root=ROOT,
            fences=self._fence,
            background_flush=background_flush,
            cursor_write_interval_ms=200 if background_flush else 1_000,
        )
        self.lost: list[tuple[int, int]] = []
        self.runtime = SubscriptionRuntime(
            SUB,
            EngineConfig(mode="sequence", ack_deadline_ms=60_000),
            self.store,
            _Sink(),
            shard_count=SHARDS,
            on_shard_lost=lambda shard, epoch: self.lost.append((shard, epoch)),
            **runtime_kwargs,
        )
        self.runtime.pod = "me"
        self.runtime.lease_check = lambda shard: self.epochs.get(shard)

    def lease_path(self, shard: int) -> str:
        return f"{ROOT}/{SUB}/leases/{shard:04d}"

    def _fence(self, subscription: str, shard: int) -> docs.Fence:
        epoch = self.epochs.get(shard)
        if epoch is None:
            raise ShardLost(subscription, frozenset({shard}))
        return docs.Fence(self.lease_path(shard), {"owner": "me", "epoch": epoch})

    def hold(self, shard: int, epoch: int) -> None:
        self.epochs[shard] = epoch
        self.documents.docs[self.lease_path(shard)] = {"owner": "me", "epoch": epoch}

    def steal(self, shard: int) -> None:
        """Another pod takes ``shard`` in Firestore; this pod has not noticed (a paused pod)."""
        lease = self.documents.docs[self.lease_path(shard)]
        self.documents.docs[self.lease_path(shard)] = {"owner": "other", "epoch": lease["epoch"] + 1}

    async def store_messages(self, pairs: list[tuple[str, int]]) -> None:
        batch = [
            IncomingMessage(
                key=key,
                dedup_id=f"{key}/{seq}",
                message_id=f"m-{key}-{seq}",
                data=f"{key}#{seq}".encode(),
                attributes={},
                ordering_key="",
                publish_time_ms=1,
                known_fingerprint=f"{key}/{seq}".encode(),
                sequence=seq,
            )
            for key, seq in pairs
        ]
        results = await self.store.persist(SUB, batch, 1_000)
        assert {r.outcome for r in results} == {PersistOutcome.STORED}
        self.runtime.on_stored([r.message for r in results])


def keys_of_shard(shard: int, count: int) -> list[str]:
    keys = [f"key-{i}" for i in range(400) if shard_of(f"key-{i}", SHARDS) == shard]
    return keys[:count]


@pytest.fixture
async def world() -> World:
    w = World()
    await w.runtime.recover()
    await w.runtime.loaded()
    await w.runtime.start()
    yield w  # type: ignore[misc]
    await w.runtime.stop(grace_seconds=0.5)


async def test_an_adopted_shard_delivers_its_keys_with_its_epoch_and_others_are_left_alone(world: World) -> None:
    mine, other = keys_of_shard(0, 2), keys_of_shard(1, 1)
    world.hold(0, 7)
    await world.runtime.adopt_shard(0, 7)
    await world.runtime.loaded()
    await world.store_messages([(mine[0], 1), (mine[1], 1), (other[0], 1)])

    deliveries = world.runtime.take("c", 10)

    assert sorted(d.message.key for d in deliveries) == sorted(mine)
    assert {d.epoch for d in deliveries} == {7}
    assert world.runtime.counters.not_owned == 1
    assert world.runtime.shards() == {0: 7}
    assert world.runtime.owner_epoch(mine[0]) == 7 and world.runtime.owner_epoch(other[0]) is None


async def test_a_shard_loaded_after_a_handover_resumes_at_its_durable_cursor(world: World) -> None:
    (key,) = keys_of_shard(2, 1)
    world.hold(2, 1)
    await world.runtime.adopt_shard(2, 1)
    await world.runtime.loaded()
    await world.store_messages([(key, 1), (key, 2)])
    (first,) = world.runtime.take("c", 10)
    assert (await world.runtime.ack("c", [first.delivery_id])).confirmed == [first.delivery_id]
    await world.store.flush(SUB)

    # Handed over and back (epoch 1 -> 3): a recovery of that one shard.
    world.runtime.drop_shard(2, 1)
    world.hold(2, 3)
    await world.runtime.adopt_shard(2, 3)
    await world.runtime.loaded()

    (again,) = world.runtime.take("c", 10)
    assert (again.message.sequence, again.epoch) == (2, 3)


async def test_acks_of_a_stolen_shard_are_not_confirmed_and_the_others_are(world: World) -> None:
    (a,), (b,) = keys_of_shard(0, 1), keys_of_shard(3, 1)
    world.hold(0, 1)
    world.hold(3, 1)
    await world.runtime.adopt_shard(0, 1)
    await world.runtime.loaded()
    await world.runtime.adopt_shard(3, 1)
    await world.runtime.loaded()
    await world.store_messages([(a, 1), (a, 2), (b, 1)])
    deliveries = {d.message.key: d for d in world.runtime.take("c", 10)}
    world.steal(0)  # this pod still believes it holds shard 0

    result = await world.runtime.ack("c", [deliveries[a].delivery_id, deliveries[b].delivery_id])

    assert result.confirmed == [deliveries[b].delivery_id]
    assert world.runtime.shards() == {3: 1}
    assert world.lost == [(0, 1)]
    assert world.runtime.counters.acks_fenced == 1
    # Nothing of the refused ack reached Firestore: a/1 is still pending there.
    pending = [f for path, f in world.documents.docs.items() if "/messages/" in path and f.get("state") == "pending"]
    assert sorted((f["key"], f["seq"]) for f in pending) == [(a, 1), (a, 2)]


async def test_a_woken_pod_hands_out_nothing_of_a_shard_whose_lease_ran_out(world: World) -> None:
    (key,) = keys_of_shard(1, 1)
    world.hold(1, 4)
    await world.runtime.adopt_shard(1, 4)
    await world.runtime.loaded()
    await world.store_messages([(key, 1)])
    del world.epochs[1]  # the lease margin ran out while the process was stopped

    assert world.runtime.take("c", 10) == []
    assert world.runtime.shards() == {}
    assert world.lost == [(1, 4)]


async def test_drain_waits_for_in_flight_acks_then_returns(world: World) -> None:
    (key,) = keys_of_shard(0, 1)
    world.hold(0, 2)
    await world.runtime.adopt_shard(0, 2)
    await world.runtime.loaded()
    await world.store_messages([(key, 1), (key, 2)])
    (delivery,) = world.runtime.take("c", 10)

    drain = asyncio.ensure_future(world.runtime.drain_shard(0, timeout_seconds=30))
    await asyncio.sleep(0)
    assert not drain.done()
    assert world.runtime.owner_epoch(key) is None  # draining: ingest stores for the next owner
    await world.runtime.ack("c", [delivery.delivery_id])
    await asyncio.wait_for(drain, 5)
    # Draining hands out nothing more: key/2 waits for the next owner.
    assert world.runtime.take("c", 10) == []


async def test_drain_gives_up_at_its_timeout(world: World) -> None:
    (key,) = keys_of_shard(0, 1)
    world.hold(0, 2)
    await world.runtime.adopt_shard(0, 2)
    await world.runtime.loaded()
    await world.store_messages([(key, 1)])
    world.runtime.take("c", 10)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await world.runtime.drain_shard(0, timeout_seconds=0.2)
    assert 0.15 <= loop.time() - started < 3


async def test_unblock_of_a_key_owned_elsewhere_names_the_shard(world: World) -> None:
    (key,) = keys_of_shard(2, 1)
    with pytest.raises(NotOwner, match="shard 2"):
        await world.runtime.unblock(key)


async def test_ids_of_an_earlier_epoch_are_unknown_after_a_handover(world: World) -> None:
    (key,) = keys_of_shard(3, 1)
    world.hold(3, 1)
    await world.runtime.adopt_shard(3, 1)
    await world.runtime.loaded()
    await world.store_messages([(key, 1)])
    (old,) = world.runtime.take("c", 10)
    world.runtime.drop_shard(3, 1)
    world.hold(3, 2)
    await world.runtime.adopt_shard(3, 2)
    await world.runtime.loaded()

    result = await world.runtime.ack("c", [old.delivery_id])

    assert result.unknown == [old.delivery_id] and result.confirmed == []
    (new,) = world.runtime.take("c", 10)
    assert dataclasses.replace(new, delivery_id=old.delivery_id, epoch=1).message == old.message
