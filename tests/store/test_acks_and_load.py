"""commit_acks, mark_done and load: tombstones, coalesced cursors, recovery after a crash."""

from __future__ import annotations

import grpc
import pytest
from store_helpers import ack, client_of, cursors, documents, incoming

from sidecar.emulators.faults import FaultRule
from sidecar.engine.types import KeyCursor
from sidecar.shards import shard_of
from sidecar.store import layout as store_codec
from sidecar.store.api import PersistOutcome, StoreRejected, StoreUnavailable, SubscriptionStoreConfig

_ROOT = "pubsub-sidecar/orders"


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


async def _stored(store, items, now_ms=1000, subscription="orders"):
    results = await store.persist(subscription, items, now_ms)
    assert all(r.outcome is PersistOutcome.STORED for r in results)
    return [r.message for r in results]


async def test_ack_tombstones_and_coalesces_cursor_writes(make_store, emulator):
    clock = Clock(10_000)
    store = make_store(clock_ms=clock)
    messages = await _stored(store, [incoming("a", seq, data=b"x" * 100) for seq in range(1, 51)])
    before = emulator.counters()
    for i, message in enumerate(messages):  # 50 separate ack commits within one second
        await store.commit_acks("orders", [ack(message, message.sequence + 1)], 10_000 + i * 10)
    spent = {name: emulator.counters()[name] - before[name] for name in before}
    # 50 tombstones + the shard's checkpoint (with the key's cursor in it) once; nothing read.
    assert spent == {"reads": 0, "writes": 51, "deletes": 0, "ttl_deletes": 0}
    client = client_of(store)
    assert await documents(client, f"{_ROOT}/keys") == {}, "a few keys' cursors live in their shard's checkpoint"
    (checkpoint,) = (await documents(client, f"{_ROOT}/checkpoints")).values()
    assert checkpoint["clean_ms"] == 10_000
    ((key_id, cursor),) = checkpoint["cursors"].items()
    assert cursor == {"key": "a", "next_seq": 2, "known": 1} and key_id == store_codec.key_doc_id("a")
    docs = await documents(client, f"{_ROOT}/messages")
    assert all(d["state"] == "acked" and "data" not in d and "attrs" not in d for d in docs.values())
    assert all(d["expire_at"].timestamp() * 1000 == d["done_ms"] + 7 * 24 * 3600 * 1000 for d in docs.values())
    clock.now_ms = 11_000
    await store.flush("orders")
    (checkpoint,) = (await documents(client, f"{_ROOT}/checkpoints")).values()
    assert checkpoint["clean_ms"] == 11_000 and checkpoint["cursors"][store_codec.key_doc_id("a")]["next_seq"] == 51


async def test_background_flush_writes_a_lagging_cursor(make_store):
    store = make_store(cursor_write_interval_ms=50)
    (first, second) = await _stored(store, [incoming("a", 1), incoming("a", 2)])
    await store.commit_acks("orders", [ack(first, 2)], store._clock_ms())
    await store.commit_acks("orders", [ack(second, 3)], store._clock_ms())
    client = client_of(store)
    deadline = store._clock_ms() + 10_000
    while store._clock_ms() < deadline:
        found = await cursors(client, _ROOT)
        if found and found["a"]["next_seq"] == 3:
            break
    else:
        pytest.fail("the background flush never wrote the cursor")


async def test_load_after_crash_rebuilds_exact_cursors_and_pending(make_store):
    crashed = make_store(clock_ms=Clock(5_000))
    items = [incoming(key, seq) for key in ("a", "b/c", "ü") for seq in range(1, 5)]
    messages = {(m.key, m.sequence): m for m in await _stored(crashed, items)}
    await crashed.commit_acks("orders", [ack(messages[("a", 1)], 2)], 5_000)  # cursor written
    await crashed.commit_acks("orders", [ack(messages[("a", 2)], 3), ack(messages[("b/c", 1)], 2)], 5_100)
    await crashed.commit_acks("orders", [ack(messages[("a", 3)], 4)], 5_200)  # both cursors lag
    recovered = make_store()
    snapshot = await recovered.load("orders", 6_000)
    assert sorted(snapshot.cursors, key=lambda c: c.key) == [
        KeyCursor(key="a", next_sequence=4),
        KeyCursor(key="b/c", next_sequence=2),
    ]
    assert sorted((m.key, m.sequence) for m in snapshot.pending) == sorted(
        [("a", 4), ("b/c", 2), ("b/c", 3), ("b/c", 4)] + [("ü", s) for s in range(1, 5)]
    )


async def test_watermark_cursor_is_the_highest_acked_position(make_store):
    store = make_store({"prices": SubscriptionStoreConfig(mode="watermark")})
    items = [incoming("p", timestamp_ms=ts, dedup_id=f"id{ts}") for ts in (100, 200, 300)]
    messages = await _stored(store, items, subscription="prices")
    await store.commit_acks("prices", [ack(messages[1], (200, "id200")), ack(messages[0], (100, "id100"))], 1000)
    snapshot = await make_store({"prices": SubscriptionStoreConfig(mode="watermark")}).load("prices", 2000)
    assert snapshot.cursors == (KeyCursor(key="p", last_position=(200, "id200")),)
    assert [m.timestamp_ms for m in snapshot.pending] == [300]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("block", KeyCursor("a", 2, blocked=True, blocked_position=2)), ("skip", KeyCursor("a", 3))],
)
async def test_dead_letter_blocks_or_skips_the_key_after_restart(make_store, policy, expected):
    config = {"orders": SubscriptionStoreConfig(mode="sequence", on_dead_letter=policy)}
    store = make_store(config)
    one, two, _three = await _stored(store, [incoming("a", 1), incoming("a", 2), incoming("a", 3)])
    await store.commit_acks("orders", [ack(one, 2)], 1000)
    await store.mark_done("orders", [two], "dead_lettered", 1100)
    snapshot = await make_store(config).load("orders", 2000)
    assert snapshot.cursors == (expected,)
    assert [m.sequence for m in snapshot.pending] == [3]


async def test_mark_done_ignores_a_conflicting_copy(make_store):
    store = make_store()
    (_original,) = await _stored(store, [incoming("a", 1, data=b"one")])
    (conflict,) = await store.persist("orders", [incoming("a", 1, data=b"two")], 2000)
    assert conflict.outcome is PersistOutcome.CONFLICT
    await store.mark_done("orders", [conflict.message], "dead_lettered", 3000)
    (pending,) = (await make_store().load("orders", 4000)).pending
    assert pending.payload is not None and pending.payload.data == b"one"


async def test_acking_a_chunked_message_deletes_its_chunks(make_store, emulator):
    store = make_store()
    (big,) = await _stored(store, [incoming("big", 1, data=b"z" * 2_500_000)])
    before = emulator.counters()
    await store.commit_acks("orders", [ack(big, 2)], 2000)
    assert emulator.counters()["deletes"] - before["deletes"] == 3
    doc_id = store_codec.message_doc_id("big", "", 1)
    assert await documents(client_of(store), f"{_ROOT}/messages/{doc_id}/chunks") == {}


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED])
async def test_failed_ack_commit_raises_unavailable_and_loses_nothing(make_store, emulator, code):
    store = make_store()
    one, _two = await _stored(store, [incoming("a", 1), incoming("a", 2)])
    emulator.injector.add(FaultRule("firestore", "Commit", code=code, remaining=1))
    with pytest.raises(StoreUnavailable):
        await store.commit_acks("orders", [ack(one, 2)], 2000)
    snapshot = await make_store().load("orders", 2500)
    assert snapshot.cursors == () and [m.sequence for m in snapshot.pending] == [1, 2]
    await store.commit_acks("orders", [ack(one, 2)], 3000)
    snapshot = await make_store().load("orders", 4000)
    assert snapshot.cursors == (KeyCursor("a", 2),) and [m.sequence for m in snapshot.pending] == [2]


async def test_mode_change_is_refused_with_a_clear_error(make_store):
    await make_store().load("orders", 1000)
    with pytest.raises(StoreRejected, match=r"stored in mode 'sequence'.*configured as 'watermark'"):
        await make_store({"orders": SubscriptionStoreConfig(mode="watermark")}).load("orders", 2000)


async def test_steady_state_cost_per_delivered_message(make_store, emulator):
    clock = Clock(100_000)
    store = make_store(clock_ms=clock)
    await store.load("orders", clock.now_ms)
    before = emulator.counters()
    keys, per_key = 50, 20
    delivered = 0
    for seq in range(1, per_key + 1):  # 50 keys x 10 messages/s each, acked in batches of 50
        clock.now_ms += 100
        messages = await _stored(store, [incoming(f"key-{k}", seq) for k in range(keys)], clock.now_ms)
        await store.commit_acks("orders", [ack(m, seq + 1) for m in messages], clock.now_ms)
        delivered += len(messages)
    spent = {name: emulator.counters()[name] - before[name] for name in before}
    assert (spent["writes"] + spent["deletes"]) / delivered <= 2.2
    assert spent["reads"] / delivered <= 0.2


async def test_load_keeps_payloads_within_the_budget_and_reads_the_rest_back(make_store, emulator):
    store = make_store()
    await _stored(store, [incoming("a", seq, data=bytes([seq]) * 1_000) for seq in range(2, 12)])  # held: 1 missing
    restarted = make_store()
    # Each message counts 600 bytes of bookkeeping, plus 1,143 for a payload kept (1,000 data bytes,
    # one attribute, object headers): 3 payloads fit in 6,000 bytes.
    snapshot = await restarted.load("orders", 2000, None, 6_000)
    kept = [m for m in snapshot.pending if not m.payload.stripped]
    stripped = [m for m in snapshot.pending if m.payload.stripped]
    assert len(kept) == 3 and len(stripped) == 7
    assert all(m.payload.data == b"" and m.payload.attributes == {} for m in stripped)
    before = emulator.counters()
    loaded = await restarted.read_payloads("orders", stripped, 3000)
    assert [m.payload.data for m in loaded] == [bytes([m.sequence]) * 1_000 for m in stripped]
    assert all(not m.payload.stripped and m.payload.attributes == {"k": "a"} for m in loaded)
    assert emulator.counters()["reads"] - before["reads"] == len(stripped)


async def test_reading_back_a_payload_that_is_no_longer_pending_is_refused(make_store):
    store = make_store()
    (message,) = await _stored(store, [incoming("a", 1)])
    await store.commit_acks("orders", [ack(message, 2)], 2000)
    with pytest.raises(StoreRejected, match="not pending"):
        await store.read_payloads("orders", [message], 3000)


@pytest.mark.parametrize(
    ("collection", "fields", "complaint"),
    [
        ("keys", {"next_seq": 3, "shard": 0, "v": 2}, "cursor document keys/bad"),
        ("keys", {"key": "a", "next_seq": "three", "shard": 0, "v": 2}, "expected an integer"),
        ("keys", {"key": "a", "next_seq": 3, "v": 99}, "layout version 99 is newer"),
        ("keys", {"key": "a", "next_seq": 3, "shard": "0", "v": 2}, "shard='0' is not"),
        ("messages", {"key": "a", "seq": 1, "state": "pending", "shard": 0, "v": 2}, "message document bad"),
        (
            "messages",
            {"state": "acked", "done_at": "0000/010000000000000", "shard": 0, "v": 2},
            "not a tombstone of ours",
        ),
        # Layout v1 (before shards): refused, naming the document and what to do.
        ("keys", {"key": "a", "next_seq": 3, "v": 1}, "cursor document keys/bad is of layout v1"),
        ("messages", {"key": "a", "seq": 1, "state": "pending"}, "message document bad is of layout v1"),
        # (A layout-1 tombstone has no ``done_at``: no load reads it; the subscription document refuses v1.)
    ],
)
async def test_a_malformed_or_newer_document_stops_recovery_naming_it(make_store, collection, fields, complaint):
    store = make_store()
    await store.load("orders", 1000)
    client = client_of(store)
    await client.document(f"{_ROOT}/{collection}/bad").set(fields)
    with pytest.raises(StoreRejected, match="recovery of subscription 'orders' stopped") as caught:
        await make_store().load("orders", 2000)
    assert complaint in str(caught.value) and "\n" not in str(caught.value)


async def test_a_subscription_of_layout_v1_is_refused_until_drained(make_store):
    store = make_store()
    await client_of(store).document(_ROOT).set({"name": "orders", "mode": "sequence", "clean_ms": 5, "v": 1})
    with pytest.raises(StoreRejected, match="subscription document pubsub-sidecar/orders is of layout v1") as caught:
        await store.load("orders", 2000, shards=frozenset({0}))
    assert "drain the subscription with the previous sidecar version first" in str(caught.value)


async def test_cursor_documents_carry_no_ttl_a_layout_version_and_their_shard(make_store):
    store = make_store({"orders": SubscriptionStoreConfig(mode="sequence", shards=8)})
    (message,) = await _stored(store, [incoming("a", 1)])
    await store.commit_acks("orders", [ack(message, 2)], 2000)
    await store.flush("orders")
    shard = shard_of("a", 8)
    assert "expire_at" not in (await cursors(client_of(store), _ROOT))["a"]
    (tombstone,) = (await documents(client_of(store), f"{_ROOT}/messages")).values()
    assert tombstone["state"] == "acked" and "expire_at" in tombstone and "data" not in tombstone
    assert tombstone["shard"] == shard and tombstone["v"] == 2
    checkpoints = await documents(client_of(store), f"{_ROOT}/checkpoints")
    cursor = {"key": "a", "next_seq": 2, "known": 1}
    assert checkpoints == {
        f"{shard:04d}": {"shard": shard, "clean_ms": 2000, "v": 2, "cursors": {store_codec.key_doc_id("a"): cursor}}
    }


async def test_unblock_is_durable_and_a_restart_does_not_block_the_key_again(make_store):
    config = {"orders": SubscriptionStoreConfig(mode="sequence", on_dead_letter="block")}
    store = make_store(config)
    one, two, _three = await _stored(store, [incoming("a", 1), incoming("a", 2), incoming("a", 3)])
    await store.commit_acks("orders", [ack(one, 2)], 1000)
    await store.mark_done("orders", [two], "dead_lettered", 1100)
    assert store.cursor("orders", "a") == KeyCursor("a", 2, blocked=True, blocked_position=2)
    # Within the coalescing interval of the last cursor write: the unblock writes it anyway.
    assert await store.unblock("orders", "a", 1200) == 2
    assert await store.unblock("orders", "a", 1300) is None  # not blocked any more
    snapshot = await make_store(config).load("orders", 2000)
    assert snapshot.cursors == (KeyCursor("a", 3),)
    assert [m.sequence for m in snapshot.pending] == [3]
    cursor = (await cursors(client_of(store), _ROOT))["a"]
    # The cursor passed 2, so the unblock needs no record any more: a block at 2 would not count.
    assert cursor["next_seq"] == 3 and "blk_seq" not in cursor and "unb_seq" not in cursor


async def test_unblock_above_an_unfinished_message_keeps_that_message_pending(make_store):
    config = {"orders": SubscriptionStoreConfig(mode="sequence", on_dead_letter="block")}
    store = make_store(config)
    _one, two = await _stored(store, [incoming("a", 1), incoming("a", 2)])
    await store.mark_done("orders", [two], "dead_lettered", 1100)  # 2 dead-lettered while 1 was in flight
    assert await store.unblock("orders", "a", 1200) == 2
    snapshot = await make_store(config).load("orders", 2000)
    assert snapshot.cursors == (KeyCursor("a", 1, acked_above=(2,)),)
    assert [m.sequence for m in snapshot.pending] == [1]
    cursor = (await cursors(client_of(store), _ROOT))["a"]
    assert cursor["unb_seq"] == [2] and cursor["above_seq"] == [2]


async def test_watermark_unblock_survives_a_restart(make_store):
    config = {"prices": SubscriptionStoreConfig(mode="watermark", on_dead_letter="block")}
    store = make_store(config)
    first, _second = await _stored(
        store, [incoming("p", timestamp_ms=100, dedup_id="id100"), incoming("p", timestamp_ms=200, dedup_id="id200")],
        subscription="prices",
    )  # fmt: skip
    await store.mark_done("prices", [first], "dead_lettered", 1100)
    blocked = KeyCursor("p", blocked=True, blocked_position=(100, "id100"))
    assert (await make_store(config).load("prices", 1500)).cursors == (blocked,)
    assert await store.unblock("prices", "p", 1200) == (100, "id100")
    snapshot = await make_store(config).load("prices", 2000)
    assert snapshot.cursors == ()
    assert [m.timestamp_ms for m in snapshot.pending] == [200]
