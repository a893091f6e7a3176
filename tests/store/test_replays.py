"""The store's side of a replay: a record of its own beside its original's tombstone, a second publish
of one replay a duplicate, and only a replay finished in its key's order moves the key's cursor."""

from __future__ import annotations

import dataclasses

from store_helpers import ack, incoming

from sidecar.engine.types import AckIntent, KeyCursor
from sidecar.store.api import PersistOutcome, SubscriptionStoreConfig

_BLOCK = {"orders": SubscriptionStoreConfig(mode="sequence", on_dead_letter="block")}


def replay(key: str, sequence: int, replay_id: str):
    original = incoming(key, sequence)
    return dataclasses.replace(original, message_id=f"replay-{replay_id}", replay_id=replay_id)


async def _blocked_at_two(store):
    results = await store.persist("orders", [incoming("a", 1), incoming("a", 2), incoming("a", 3)], 1000)
    one, two, three = (r.message for r in results)
    await store.commit_acks("orders", [ack(one, 2)], 1000)
    await store.mark_done("orders", [two], "dead_lettered", 1100)
    return three


async def test_a_replay_is_stored_beside_its_originals_tombstone_and_a_second_publish_is_a_duplicate(make_store):
    store = make_store(_BLOCK)
    await _blocked_at_two(store)
    (first,) = await store.persist("orders", [replay("a", 2, "dl-1")], 2000)
    assert first.outcome is PersistOutcome.STORED
    assert first.message.replay_id == "dl-1" and first.message.sequence == 2
    (again,) = await store.persist("orders", [replay("a", 2, "dl-1")], 2100)
    assert again.outcome is PersistOutcome.DUPLICATE
    assert again.pending is not None and again.pending.replay_id == "dl-1", "the pending replay goes to the engine"
    (other,) = await store.persist("orders", [replay("a", 2, "dl-2")], 2200)
    assert other.outcome is PersistOutcome.STORED, "another dead letter's replay is a record of its own"
    snapshot = await make_store(_BLOCK).load("orders", 3000)
    assert snapshot.cursors == (KeyCursor("a", 2, blocked=True, blocked_position=2),)
    assert sorted((m.sequence, m.replay_id) for m in snapshot.pending) == [(2, "dl-1"), (2, "dl-2"), (3, "")]


async def test_the_ack_of_a_replay_at_the_block_moves_the_key_on_durably(make_store):
    store = make_store(_BLOCK)
    await _blocked_at_two(store)
    (stored,) = await store.persist("orders", [replay("a", 2, "dl-1")], 2000)
    await store.commit_acks("orders", [ack(stored.message, 3)], 2100)
    snapshot = await make_store(_BLOCK).load("orders", 3000)
    assert snapshot.cursors == (KeyCursor("a", 3),), "a restart after the replay's ack does not block again"
    assert [m.sequence for m in snapshot.pending] == [3]


async def test_a_later_dead_letter_blocks_again_after_a_replay_moved_the_key_on(make_store):
    store = make_store(_BLOCK)
    three = await _blocked_at_two(store)
    (stored,) = await store.persist("orders", [replay("a", 2, "dl-1")], 2000)
    await store.commit_acks("orders", [ack(stored.message, 3)], 2100)
    await store.mark_done("orders", [three], "dead_lettered", 2200)
    snapshot = await make_store(_BLOCK).load("orders", 3000)
    assert snapshot.cursors == (KeyCursor("a", 3, blocked=True, blocked_position=3),)


async def test_a_replay_finished_outside_its_keys_order_moves_no_cursor(make_store):
    """Delivered flagged (or refused) at a position another message holds: recorded, never folded,
    so the message that holds the position is neither passed nor lost after a restart."""
    store = make_store(_BLOCK)
    (held,) = (r.message for r in await store.persist("orders", [incoming("a", 1)], 1000))
    flagged, refused = (
        r.message for r in await store.persist("orders", [replay("a", 1, "dl-1"), replay("a", 1, "dl-2")], 1100)
    )
    await store.commit_acks("orders", [AckIntent("d-1", flagged, 1, aside=True)], 1200)
    await store.mark_done("orders", [refused], "dead_lettered_aside", 1300)
    snapshot = await make_store(_BLOCK).load("orders", 3000)
    assert snapshot.cursors == (), "folded, the ack would have finished sequence 1 and dropped the held message"
    assert [(m.sequence, m.replay_id) for m in snapshot.pending] == [(1, "")]
    assert snapshot.pending[0].dedup_id == held.dedup_id
