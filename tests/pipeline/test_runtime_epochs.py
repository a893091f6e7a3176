"""A pod that loses a shard in a Firestore brownout and takes it back (issue cases 1, 4 and 7).

Same world as ``test_runtime_shards``: one pod's ``SubscriptionRuntime`` over ``DocumentStore`` on
``MemoryDocuments``, the lease documents written by the test, which plays the lease manager. The
faults are the production ones: Commits that fail while the brownout lasts (retried by the runtime
for as long as they fail), a margin that runs out meanwhile, the same pod taking the shard again at
a new epoch, a payload read that outlives the lease, another pod taking a shard behind this one's
back while only the background checkpoint flush writes to it.

The rule these tests keep: a decision is written, and confirmed, only under the epoch it was made
under (``Store.commit_acks(epochs=...)``); nothing is handed to an app after a check that no longer
holds; a loss the store finds on its own reaches the runtime and the lease manager.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from delivery_harness import incoming_message as sequence_message
from test_runtime_shards import ROOT, SUB, World, keys_of_shard

from sidecar.store import documents as docs
from sidecar.store import layout

DEADLINE_SECONDS = 10.0


class Brownout:
    """Fails every Commit (before it applies) while ``on``; ``refused`` is set at each refusal."""

    def __init__(self, world: World) -> None:
        self.on = False
        self.refused = asyncio.Event()
        world.documents.before_write = self._before

    def _before(self, kind: str, writes: object) -> None:
        if self.on and kind == "commit":
            self.refused.set()
            raise docs.Unavailable("commit: Firestore unavailable (brownout)")


@pytest.fixture
async def make_world() -> AsyncIterator[Callable[..., World]]:
    worlds: list[World] = []

    def build(**kwargs: object) -> World:
        world = World(**kwargs)
        worlds.append(world)
        return world

    yield build
    for world in worlds:
        await world.runtime.stop(grace_seconds=0.5)
        await world.store.close()


async def _start(world: World, shard: int, epoch: int) -> None:
    await world.runtime.recover()
    await world.runtime.start()
    world.hold(shard, epoch)
    await world.runtime.adopt_shard(shard, epoch)
    await world.runtime.loaded()


async def _until(predicate: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_SECONDS
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not within {DEADLINE_SECONDS} s: {what}")
        await asyncio.sleep(0.01)


def _state(world: World, key: str, seq: int) -> object:
    path = f"{ROOT}/{SUB}/messages/{layout.message_doc_id(key, f'{key}/{seq}', seq, None)}"
    return world.documents.docs[path]["state"]


async def test_an_ack_accepted_under_an_old_epoch_is_never_written_nor_confirmed_under_the_new_one(
    make_world: Callable[..., World],
) -> None:
    """Case 1: the ack's Commit fails through a brownout, the pod drops the shard and takes it
    back at epoch + 1, Firestore recovers. Fenced with the epoch the pod held when it was sent, the
    retried Commit passed and the old delivery was confirmed while the new engine delivered the
    message again: a confirmed ack followed by a redelivery (G3)."""
    world = make_world()
    brownout = Brownout(world)
    key = keys_of_shard(0, 1)[0]
    await _start(world, 0, 7)
    await world.store_messages([(key, 1)])
    [delivery] = world.runtime.take("app", 10)
    assert delivery.epoch == 7

    brownout.on = True
    ticket = world.runtime.submit_ack("app", [delivery.delivery_id])
    await asyncio.wait_for(brownout.refused.wait(), DEADLINE_SECONDS)  # the ack is being retried
    # The margin ran out, and the lease manager (the lease still names this pod) took it back.
    world.hold(0, 8)
    await world.runtime.adopt_shard(0, 8)
    await world.runtime.loaded()
    brownout.on = False

    assert ticket.confirmed is not None
    confirmed = await asyncio.wait_for(ticket.confirmed, DEADLINE_SECONDS)
    assert confirmed == [], "an ack of epoch 7's engine confirmed under epoch 8"
    assert _state(world, key, 1) == layout.PENDING, "its tombstone was written under epoch 8"
    [again] = world.runtime.take("app", 10)
    assert (again.message.sequence, again.epoch) == (1, 8)
    assert world.runtime.counters.acks_fenced == 1
    assert (await world.runtime.ack("app", [again.delivery_id])).confirmed == [again.delivery_id]
    assert _state(world, key, 1) == layout.ACKED


async def test_a_fast_path_ack_accepted_under_an_old_epoch_is_not_folded_into_the_new_book(
    make_world: Callable[..., World],
) -> None:
    """Case 1, fast-path variant: the drop gives the message back to Pub/Sub; its ack, queued behind
    a stored message's ack that the brownout keeps retrying, reaches the store after the pod took
    the shard back. Folded into the new epoch's cursors it would be confirmed, and Pub/Sub's
    redelivery would take the fast path again: a confirmed ack followed by a redelivery."""
    world = make_world(background_flush=True)
    brownout = Brownout(world)
    settled: list[tuple[str, bool]] = []
    world.runtime.on_volatile_settled = lambda message, safe: settled.append((message.dedup_id, safe))
    stored_key, fast_key = keys_of_shard(0, 2)
    await _start(world, 0, 7)
    await world.store_messages([(stored_key, 1)])
    [taken] = world.runtime.take_fast([sequence_message(fast_key, 1)])
    assert taken is not None
    deliveries = {d.message.key: d for d in world.runtime.take("app", 10)}

    brownout.on = True
    stored_ticket = world.runtime.submit_ack("app", [deliveries[stored_key].delivery_id])
    await asyncio.wait_for(brownout.refused.wait(), DEADLINE_SECONDS)  # retried while the brownout lasts
    fast_ticket = world.runtime.submit_ack("app", [deliveries[fast_key].delivery_id])  # queued behind it
    world.hold(0, 8)
    await world.runtime.adopt_shard(0, 8)
    await world.runtime.loaded()
    assert settled == [(f"{fast_key}/1", False)], "the drop gives the fast-path message back to Pub/Sub"
    brownout.on = False

    assert stored_ticket.confirmed is not None and fast_ticket.confirmed is not None
    assert await asyncio.wait_for(stored_ticket.confirmed, DEADLINE_SECONDS) == []
    assert await asyncio.wait_for(fast_ticket.confirmed, DEADLINE_SECONDS) == [], "confirmed under epoch 8"
    # Pub/Sub delivers it again: still the key's next message for the epoch-8 engine, not a duplicate.
    [again] = world.runtime.take_fast([sequence_message(fast_key, 1)])
    assert again is not None
    redelivered = {(d.message.key, d.message.sequence, d.epoch) for d in world.runtime.take("app", 10)}
    assert redelivered == {(stored_key, 1, 8), (fast_key, 1, 8)}


async def test_a_payload_read_back_after_the_margin_ran_out_is_not_sent(make_world: Callable[..., World]) -> None:
    """Case 4: a held message's payload was left in the store (over ``max_held_bytes``); while it
    is read back for delivery the lease's margin runs out. The delivery must not be handed over."""
    world = make_world(max_held_bytes=1)
    key = keys_of_shard(0, 1)[0]
    await _start(world, 0, 7)
    await world.store_messages([(key, 2)])  # held behind 1, its payload stripped
    await world.store_messages([(key, 1)])
    assert world.runtime.counters.payloads_stripped == 1
    [first] = world.runtime.take("app", 10)
    assert (await world.runtime.ack("app", [first.delivery_id])).confirmed == [first.delivery_id]
    [second] = world.runtime.take("app", 10)
    assert second.message.payload is not None and second.message.payload.stripped

    gate = asyncio.Event()
    reading = asyncio.Event()
    read = world.documents.get_all

    async def slow_read(paths: list[str]) -> dict[str, docs.Fields | None]:
        reading.set()
        await gate.wait()
        return await read(paths)

    world.documents.get_all = slow_read  # type: ignore[method-assign]
    loading = asyncio.ensure_future(world.runtime.load_payloads([second]))
    await asyncio.wait_for(reading.wait(), DEADLINE_SECONDS)
    world.epochs.pop(0)  # the margin ran out meanwhile: the pod no longer holds the shard
    gate.set()
    assert await asyncio.wait_for(loading, DEADLINE_SECONDS) == []
    assert 0 not in world.runtime.shards()
    assert world.runtime.counters.deliveries_withheld == 1


async def test_a_shard_the_background_flush_finds_lost_is_dropped_and_the_lease_manager_told(
    make_world: Callable[..., World],
) -> None:
    """Case 7: the checkpoint flush is the only write left for a shard (its last ack's tombstone
    went in while the checkpoint was not due), and another pod took the lease meanwhile. The
    flush's fence fails; the runtime must stop delivering the shard and tell the lease manager, not
    go on handing out its keys until some other write happens to find out."""
    world = make_world(background_flush=True)
    key = keys_of_shard(0, 1)[0]
    await _start(world, 0, 7)
    await world.store_messages([(key, 1), (key, 2), (key, 3)])
    for _ in range(2):
        [delivery] = world.runtime.take("app", 10)
        assert (await world.runtime.ack("app", [delivery.delivery_id])).confirmed == [delivery.delivery_id]
    world.steal(0)  # another pod has the lease; this one has not noticed, and writes nothing more
    await _until(lambda: world.lost == [(0, 7)], "the lease manager told of the lost shard")
    assert 0 not in world.runtime.shards()
    assert world.runtime.take("app", 10) == []


async def test_a_graceful_hand_over_writes_the_shards_last_checkpoint(make_world: Callable[..., World]) -> None:
    """Before its lease is handed over, a drained shard's cursors are written whatever the
    coalescing interval: the next owner starts from them instead of folding tombstones."""
    world = make_world()
    key = keys_of_shard(0, 1)[0]
    await _start(world, 0, 7)
    await world.store_messages([(key, 1), (key, 2)])
    for _ in range(2):  # the second ack's cursor waits for the next interval
        [delivery] = world.runtime.take("app", 10)
        assert (await world.runtime.ack("app", [delivery.delivery_id])).confirmed == [delivery.delivery_id]
    checkpoint = layout.checkpoint_path(f"{ROOT}/{SUB}", 0)

    def written_next() -> object:
        overlay = world.documents.docs[checkpoint][layout.OVERLAY]
        return overlay[layout.key_doc_id(key)]["next_seq"]

    assert written_next() == 2
    await world.runtime.drain_shard(0, 2.0)
    assert written_next() == 3
