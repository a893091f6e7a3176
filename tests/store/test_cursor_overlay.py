"""Cursors kept in their shard's checkpoint (the overlay), and moved to their own documents past a budget."""

from __future__ import annotations

import dataclasses

import pytest
from store_helpers import ack, client_of, cursors, documents, incoming

from sidecar.engine.types import AckIntent, KeyCursor, Message, Payload
from sidecar.store import cursor_book as cursor_module
from sidecar.store.api import PersistOutcome, SubscriptionStoreConfig
from sidecar.store.cursor_book import CursorBook
from sidecar.store.cursor_documents import overlay_entry_size
from sidecar.store.cursors import CursorRules, CursorState

_ROOT = "pubsub-sidecar/orders"


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def _message(key: str, seq: int) -> Message:
    payload = Payload(data=b"", attributes={}, publish_time_ms=0, ordering_key="", ref="x")
    return Message(key=key, dedup_id=f"{key}-{seq}", message_id="m", known_fingerprint=b"f", stored_at_ms=0,
                   sequence=seq, payload=payload)  # fmt: skip


async def _stored(store, items, now_ms=1000):
    results = await store.persist("orders", items, now_ms)
    assert all(r.outcome is PersistOutcome.STORED for r in results)
    return [r.message for r in results]


async def test_many_keys_cost_one_checkpoint_write_per_shard_and_come_back_exactly(make_store, emulator):
    config = {"orders": SubscriptionStoreConfig(mode="sequence", shards=4)}
    clock = Clock(10_000)
    store = make_store(config, clock_ms=clock)
    keys = [f"k{i}" for i in range(200)]
    messages = await _stored(store, [incoming(key, 1) for key in keys])
    before = emulator.counters()
    await store.commit_acks("orders", [ack(m, 2) for m in messages], 10_000)
    spent = {name: emulator.counters()[name] - before[name] for name in ("reads", "writes", "deletes")}
    # 200 tombstones and one checkpoint per shard: no cursor document at all.
    assert spent == {"reads": 0, "writes": 204, "deletes": 0}
    assert await documents(client_of(store), f"{_ROOT}/keys") == {}
    snapshot = await make_store(config).load("orders", 20_000)
    assert sorted(snapshot.cursors, key=lambda c: c.key) == sorted((KeyCursor(k, 2) for k in keys), key=lambda c: c.key)


async def test_past_the_budget_the_oldest_changed_keys_move_to_their_own_documents(make_store, monkeypatch):
    monkeypatch.setattr(cursor_module, "OVERLAY_MAX_BYTES", 2_000)
    clock = Clock(10_000)
    store = make_store(clock_ms=clock)
    keys = [f"key-{i:03d}" for i in range(100)]
    first = await _stored(store, [incoming(key, 1) for key in keys])
    for i, message in enumerate(first):  # key-000 changes first, key-099 last
        await store.commit_acks("orders", [ack(message, 2)], 10_000 + i)
    clock.now_ms = 12_000
    await store.flush("orders")
    client = client_of(store)
    (checkpoint,) = (await documents(client, f"{_ROOT}/checkpoints")).values()
    in_overlay = {entry["key"] for entry in checkpoint["cursors"].values()}
    own = {fields["key"] for fields in (await documents(client, f"{_ROOT}/keys")).values()}
    assert in_overlay and own and in_overlay | own == set(keys) and not in_overlay & own
    assert max(own) < min(in_overlay), "the keys changed longest ago move first"
    budget = sum(overlay_entry_size(cursor_module.CursorState(k, next_sequence=2)) for k in in_overlay)
    assert budget <= 2_000
    # A moved key that changes again comes back into the overlay, which wins over its older document.
    (again,) = await _stored(store, [incoming("key-000", 2)], now_ms=13_000)
    clock.now_ms = 14_000
    await store.commit_acks("orders", [ack(again, 3)], 14_000)
    clock.now_ms = 16_000
    await store.flush("orders")
    assert (await cursors(client, _ROOT))["key-000"]["next_seq"] == 3
    snapshot = await make_store().load("orders", 20_000)
    expected = {k: 2 for k in keys} | {"key-000": 3}
    assert {c.key: c.next_sequence for c in snapshot.cursors} == expected


def test_a_key_whose_document_was_written_within_the_interval_stays_in_the_overlay(monkeypatch):
    monkeypatch.setattr(cursor_module, "OVERLAY_MAX_BYTES", 1)
    book = CursorBook(CursorRules("sequence"), interval_ms=1_000)
    proposed = book.propose([AckIntent("d", _message("a", 1), 2)], [], 5_000)
    kept, spill, left = book.plan_checkpoint(0, proposed, room=10, now_ms=5_000)
    assert [s.key for s in spill] == ["a"] and kept == [] and left is None
    book.accept(proposed, 5_000, documents=spill)
    proposed = book.propose([AckIntent("d", _message("a", 2), 3)], [], 5_500)
    kept, spill, left = book.plan_checkpoint(0, proposed, room=10, now_ms=5_500)
    assert spill == [] and [s.key for s in kept] == ["a"], "at most one write per second per document"
    kept, spill, left = book.plan_checkpoint(0, proposed, room=0, now_ms=7_000)
    assert spill == [] and [s.key for s in kept] == ["a"], "no room left in the Commit: it waits in the overlay"


def test_past_the_hard_limit_only_changes_not_yet_in_the_overlay_wait(monkeypatch):
    monkeypatch.setattr(cursor_module, "OVERLAY_MAX_BYTES", 1)
    monkeypatch.setattr(cursor_module, "OVERLAY_HARD_BYTES", 1)
    book = CursorBook(CursorRules("sequence"), interval_ms=1_000)
    proposed = book.propose([AckIntent("d", _message("a", 1), 2)], [], 5_000)
    book.accept(proposed, 5_000, overlays={0: list(proposed.values())})
    proposed = book.propose([AckIntent("d", _message("a", 2), 3), AckIntent("e", _message("b", 1), 2)], [], 5_100)
    kept, spill, left = book.plan_checkpoint(0, proposed, room=0, now_ms=5_100)
    assert [s.key for s in kept] == ["a"], "a key already in the overlay is never dropped from it"
    assert spill == [] and left == 5_100, "b waits: the checkpoint says its shard is clean only up to then"


@pytest.mark.parametrize("bad", ["nope", {"x": "nope"}])
async def test_a_corrupt_overlay_stops_recovery_naming_the_checkpoint(make_store, bad):
    store = make_store()
    await store.load("orders", 1000)
    await (
        client_of(store).document(f"{_ROOT}/checkpoints/0000").set({"shard": 0, "clean_ms": 5, "v": 2, "cursors": bad})
    )
    with pytest.raises(Exception, match="checkpoint document pubsub-sidecar/orders/checkpoints/0000"):
        await make_store().load("orders", 2000)


def test_a_key_state_copy_has_every_field_and_shares_nothing_mutable() -> None:
    # copy() names the fields one by one: a field added later and left out fails here.
    state = CursorState(
        key="k",
        next_sequence=7,
        last_position=(5, "m"),
        done_above={9, 11},
        blocked_at=12,
        unblocked={13},
        written_ms=1,
        dirty_since_ms=2,
        known_from=3,
        skips=[[4, 5]],
        in_overlay=True,
        changed_ms=6,
    )
    defaults = CursorState(key="")
    assert all(getattr(state, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(CursorState))
    copied = state.copy()
    assert copied == state
    copied.done_above.add(20)
    copied.unblocked.add(21)
    copied.skips[0][1] = 6
    copied.skips.append([30, 31])
    assert (state.done_above, state.unblocked, state.skips) == ({9, 11}, {13}, [[4, 5]])
