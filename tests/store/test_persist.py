"""persist: create-if-absent through BatchWrite, duplicates and conflicts decided by Firestore."""

from __future__ import annotations

import re

import grpc
from store_helpers import client_of, documents, incoming

from sidecar.emulators.faults import FaultRule
from sidecar.store import layout as store_codec
from sidecar.store.api import PersistOutcome, StoreRejected, StoreUnavailable, SubscriptionStoreConfig
from sidecar.store.documents import Unavailable
from sidecar.store.firestore import FirestoreDocuments

_MESSAGES = "pubsub-sidecar/orders/messages"


async def test_new_duplicate_and_conflict_in_sequence_mode(make_store, emulator):
    store = make_store()
    first = await store.persist("orders", [incoming("a", 1, data=b"one")], 1000)
    assert first[0].outcome is PersistOutcome.STORED
    assert first[0].message.payload is not None and first[0].message.payload.data == b"one"
    before = emulator.counters()
    again = await store.persist("orders", [incoming("a", 1, data=b"one"), incoming("a", 1, data=b"other")], 2000)
    after = emulator.counters()
    assert [r.outcome for r in again] == [PersistOutcome.DUPLICATE, PersistOutcome.CONFLICT]
    assert again[1].message.payload is not None and again[1].message.payload.ref == ""
    assert after["writes"] == before["writes"]  # refused creates are not billed
    assert after["reads"] - before["reads"] == 1  # one batched get of the existing document
    docs = await documents(client_of(store), _MESSAGES)
    assert list(docs) == [store_codec.message_doc_id("a", "", 1)]
    (doc,) = docs.values()
    assert doc["data"] == b"one" and doc["state"] == "pending" and "expire_at" not in doc


async def test_one_duplicate_does_not_poison_the_batch(make_store):
    store = make_store({"plain": SubscriptionStoreConfig(mode="none")})
    await store.persist("plain", [incoming("k", dedup_id="e3")], 1000)
    batch = [incoming("k", dedup_id=f"e{i}") for i in range(6)] + [incoming("k", dedup_id="e1")]
    results = await store.persist("plain", batch, 2000)
    outcomes = [r.outcome for r in results]
    assert outcomes == [PersistOutcome.STORED] * 3 + [PersistOutcome.DUPLICATE] + [PersistOutcome.STORED] * 2 + [
        PersistOutcome.DUPLICATE
    ]
    docs = await documents(client_of(store), "pubsub-sidecar/plain/messages")
    assert sorted(d["dedup_id"] for d in docs.values()) == [f"e{i}" for i in range(6)]


async def test_keys_with_slash_unicode_and_2kb_text_get_hashed_ids(make_store):
    store = make_store()
    keys = ["tenant/42/order", "ключ-🔑-鍵", "x" * 2048, "__reserved__"]
    results = await store.persist("orders", [incoming(key, 1) for key in keys], 1000)
    assert all(r.outcome is PersistOutcome.STORED for r in results)
    docs = await documents(client_of(store), _MESSAGES)
    assert all(re.fullmatch(r"[0-9a-f]{40}", doc_id) for doc_id in docs)
    assert sorted(doc["key"] for doc in docs.values()) == sorted(keys)
    snapshot = await store.load("orders", 2000)
    assert sorted(m.key for m in snapshot.pending) == sorted(keys)


async def test_3mb_message_is_chunked_in_one_commit_and_reassembled(make_store, emulator):
    store = make_store()
    data = bytes(range(256)) * (3 * 1024 * 1024 // 256)
    before = emulator.counters()
    (result,) = await store.persist("orders", [incoming("big", 1, data=data, attributes={"__x__": "y"})], 1000)
    assert result.outcome is PersistOutcome.STORED
    assert emulator.counters()["writes"] - before["writes"] == 5  # main document + 4 chunks
    doc_id = store_codec.message_doc_id("big", "", 1)
    client = client_of(store)
    main = (await documents(client, _MESSAGES))[doc_id]
    assert "data" not in main and main["chunks"] == 4
    chunks = await documents(client, f"{_MESSAGES}/{doc_id}/chunks")
    assert sorted(chunks) == ["000", "001", "002", "003"]
    (again,) = await store.persist("orders", [incoming("big", 1, data=data, attributes={"__x__": "y"})], 2000)
    assert again.outcome is PersistOutcome.DUPLICATE
    (loaded,) = (await store.load("orders", 3000)).pending
    assert loaded.payload is not None and loaded.payload.data == data and loaded.payload.attributes == {"__x__": "y"}


async def test_message_beyond_10mib_is_rejected_not_crashing(make_store):
    store = make_store()
    (result,) = await store.persist("orders", [incoming("huge", 1, data=b"x" * (11 * 1_000_000 + 1))], 1000)
    assert result.outcome is PersistOutcome.FAILED and isinstance(result.error, StoreRejected)


async def test_injected_unavailable_and_aborted_fail_the_batch_and_lose_nothing(make_store, emulator):
    store = make_store()
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED):
        emulator.injector.add(FaultRule("firestore", "BatchWrite", code=code, remaining=1))
        failed = await store.persist("orders", [incoming("a", 1), incoming("b", 1)], 1000)
        assert [r.outcome for r in failed] == [PersistOutcome.FAILED] * 2
        assert all(isinstance(r.error, StoreUnavailable) for r in failed)
    retried = await store.persist("orders", [incoming("a", 1), incoming("b", 1)], 2000)
    assert [r.outcome for r in retried] == [PersistOutcome.STORED] * 2
    assert len((await store.load("orders", 3000)).pending) == 2


async def test_create_applied_behind_a_failed_rpc_is_stored_not_duplicate(make_store, monkeypatch):
    """The RPC failed after Firestore applied it: the retry's ALREADY_EXISTS is our own write."""
    store = make_store()
    real = FirestoreDocuments.batch_write
    calls = 0

    async def applied_then_lost(self, writes):
        nonlocal calls
        calls += 1
        result = await real(self, writes)
        if calls == 1:
            raise Unavailable("answer lost")
        return result

    monkeypatch.setattr(FirestoreDocuments, "batch_write", applied_then_lost)
    (lost,) = await store.persist("orders", [incoming("a", 1)], 1000)
    assert lost.outcome is PersistOutcome.FAILED and isinstance(lost.error, StoreUnavailable)
    # The redelivery meets the document that applied unseen: still pending, so it reaches the engine.
    (retry,) = await store.persist("orders", [incoming("a", 1)], 2000)
    assert retry.outcome is PersistOutcome.DUPLICATE
    assert retry.pending is not None and retry.pending.stored_at_ms == 1000 and retry.pending.payload.data == b"payload"
