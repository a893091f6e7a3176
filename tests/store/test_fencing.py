"""Fenced commits on Firestore (our emulator, the official client's GAPIC), shard loads and intake for
another pod: what several pods on one subscription rely on (sidecar/store/fencing.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from store_helpers import ack, client_of, documents, incoming

from sidecar.engine.types import AckIntent
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store.api import DROPPED, PersistOutcome, ShardLost, StoreUnavailable, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

_ROOT = "pubsub-sidecar/orders"
_SHARDS = 4
_CONFIG = {"orders": SubscriptionStoreConfig(mode="sequence", shards=_SHARDS)}


def _lease(shard: int) -> str:
    return f"{_ROOT}/leases/{shard:04d}"


class Leases:
    """What a pod believes it holds: its FenceSource."""

    def __init__(self, pod: str, held: dict[int, int]) -> None:
        self.pod = pod
        self.held = dict(held)

    def __call__(self, subscription: str, shard: int) -> docs.Fence:
        if shard not in self.held:
            raise ShardLost(subscription, {shard})
        return docs.Fence(_lease(shard), {"owner": self.pod, "epoch": self.held[shard]})


def _keys_in_two_shards() -> tuple[str, str]:
    """Two keys of different shards among ``_SHARDS``."""
    first = "a"
    second = next(f"b{i}" for i in range(100) if shard_of(f"b{i}", _SHARDS) != shard_of(first, _SHARDS))
    return first, second


async def _set_leases(store, leases: dict[int, tuple[str, int]]) -> None:
    client = client_of(store)
    for shard, (owner, epoch) in leases.items():
        await client.document(_lease(shard)).set({"owner": owner, "epoch": epoch})


async def test_a_fenced_commit_applies_while_the_lease_holds_and_nothing_once_it_changed(make_store, emulator):
    store = make_store(_CONFIG)
    documents_ = store.documents
    await _set_leases(store, {0: ("pod-a", 7)})
    fence = docs.Fence(_lease(0), {"owner": "pod-a", "epoch": 7})
    before = emulator.counters()
    await documents_.commit([docs.replace(f"{_ROOT}/keys/x", {"n": 1})], [fence])
    spent = {name: emulator.counters()[name] - before[name] for name in before}
    assert spent == {"reads": 1, "writes": 1, "deletes": 0, "ttl_deletes": 0}, "a fence costs one read of its lease"
    await _set_leases(store, {0: ("pod-b", 8)})
    with pytest.raises(docs.Fenced) as caught:
        await documents_.commit([docs.replace(f"{_ROOT}/keys/x", {"n": 2})], [fence])
    assert caught.value.paths == (_lease(0),)
    assert (await documents(client_of(store), f"{_ROOT}/keys"))["x"] == {"n": 1}
    with pytest.raises(docs.Fenced):  # a missing lease document never holds
        await documents_.commit([docs.replace(f"{_ROOT}/keys/x", {"n": 3})], [docs.Fence(_lease(9), {"epoch": 1})])


async def test_a_lease_taken_between_the_fence_read_and_the_commit_fails_the_commit(make_store, monkeypatch):
    """The transaction read the lease, then another pod took it: Firestore aborts the Commit (serializable
    transactions), the retry reads the new owner, and the commit is refused: never applied."""
    store = make_store(_CONFIG)
    documents_ = store.documents
    await _set_leases(store, {0: ("pod-a", 7)})
    read_in_transaction = documents_._batch_get
    taken = asyncio.Event()

    async def read_then_steal(paths, transaction, **new_transaction):
        found = await read_in_transaction(paths, transaction, **new_transaction)
        if (transaction or new_transaction) and not taken.is_set():
            taken.set()
            await client_of(store).document(_lease(0)).set({"owner": "pod-b", "epoch": 8})
        return found

    monkeypatch.setattr(documents_, "_batch_get", read_then_steal)
    with pytest.raises(docs.Fenced):
        await documents_.commit(
            [docs.replace(f"{_ROOT}/keys/x", {"n": 1})], [docs.Fence(_lease(0), {"owner": "pod-a", "epoch": 7})]
        )
    assert taken.is_set() and await documents(client_of(store), f"{_ROOT}/keys") == {}


async def test_a_commit_that_stays_aborted_is_unavailable(make_store, monkeypatch):
    store = make_store(_CONFIG)
    documents_ = store.documents
    await _set_leases(store, {0: ("pod-a", 7)})
    read_in_transaction = documents_._batch_get
    epoch = iter(range(100, 200))

    async def read_then_touch(paths, transaction, **new_transaction):
        found = await read_in_transaction(paths, transaction, **new_transaction)
        if transaction or new_transaction:  # every attempt: the lease changes (a renewal) after it was read
            await client_of(store).document(_lease(0)).update({"beat": next(epoch)})
        return found

    monkeypatch.setattr(documents_, "_batch_get", read_then_touch)
    monkeypatch.setattr("sidecar.store.firestore._fence_backoff_seconds", lambda attempt: 0.0)
    with pytest.raises(StoreUnavailable, match="aborted 5 times"):
        await documents_.commit(
            [docs.replace(f"{_ROOT}/keys/x", {"n": 1})], [docs.Fence(_lease(0), {"owner": "pod-a", "epoch": 7})]
        )


async def test_acks_over_two_shards_apply_where_the_lease_holds_and_raise_shard_lost_for_the_other(make_store):
    first, second = _keys_in_two_shards()
    s1, s2 = shard_of(first, _SHARDS), shard_of(second, _SHARDS)
    leases = Leases("pod-a", {s1: 1, s2: 1})
    store = make_store(_CONFIG, fences=leases)
    await _set_leases(store, {s1: ("pod-a", 1), s2: ("pod-a", 1)})
    await store.load("orders", 1000, shards=frozenset({s1, s2}))
    one, two = [r.message for r in await store.persist("orders", [incoming(first, 1), incoming(second, 1)], 1000)]
    await _set_leases(store, {s2: ("pod-b", 2)})  # pod-a does not know yet
    with pytest.raises(ShardLost) as caught:
        await store.commit_acks("orders", [ack(one, 2), ack(two, 2)], 2000)
    assert caught.value.shards == {s2}
    stored = await documents(client_of(store), f"{_ROOT}/messages")
    assert sorted(fields["state"] for fields in stored.values()) == ["acked", "pending"]
    assert store.cursor("orders", first) is not None and store.cursor("orders", second) is None
    leases.held.pop(s2)  # now it knows: refused at once, without a Commit
    with pytest.raises(ShardLost):
        await store.commit_acks("orders", [ack(two, 2)], 2100)


async def test_load_of_one_shard_reads_only_its_keys_and_release_forgets_them(make_store, emulator):
    first, second = _keys_in_two_shards()
    s1, s2 = shard_of(first, _SHARDS), shard_of(second, _SHARDS)
    writer = make_store(_CONFIG)
    await writer.load("orders", 1000)
    one, _ = [r.message for r in await writer.persist("orders", [incoming(first, 1), incoming(first, 2)], 1000)]
    three, _ = [r.message for r in await writer.persist("orders", [incoming(second, 1), incoming(second, 2)], 1000)]
    await writer.commit_acks("orders", [ack(one, 2), ack(three, 2)], 1500)
    await writer.flush("orders")
    reader = make_store(_CONFIG)
    snapshot = await reader.load("orders", 3000, shards=frozenset({s1}))
    assert [(c.key, c.next_sequence) for c in snapshot.cursors] == [(first, 2)]
    assert [(m.key, m.sequence) for m in snapshot.pending] == [(first, 2)]
    assert reader.cursor("orders", second) is None
    reader.release("orders", frozenset({s1}))
    assert reader.cursor("orders", first) is None, "a released shard's cursor was handed out"
    snapshot = await reader.load("orders", 3000, shards=frozenset({s2}))
    assert [(m.key, m.sequence) for m in snapshot.pending] == [(second, 2)]


async def test_intake_for_another_pod_carries_inbox_and_a_pending_copy_gains_it(make_store):
    store = make_store(_CONFIG)
    shard = shard_of("a", _SHARDS)
    (result,) = await store.persist("orders", [incoming("a", 1)], 1000)  # stored by the owner: no inbox
    (stored,) = (await documents(client_of(store), f"{_ROOT}/messages")).values()
    assert stored["shard"] == shard and "inbox" not in stored
    (again,) = await store.persist("orders", [dataclasses.replace(incoming("a", 1), to_owner=True)], 2000)
    assert again.outcome is PersistOutcome.DUPLICATE and again.pending is not None
    (stored,) = (await documents(client_of(store), f"{_ROOT}/messages")).values()
    assert stored["inbox"] == shard and stored["state"] == "pending"
    (fresh,) = await store.persist("orders", [dataclasses.replace(incoming("a", 2), to_owner=True)], 2000)
    assert fresh.outcome is PersistOutcome.STORED
    assert {f.get("inbox") for f in (await documents(client_of(store), f"{_ROOT}/messages")).values()} == {shard}
    await store.commit_acks("orders", [ack(result.message, 2)], 3000)
    done = [f for f in (await documents(client_of(store), f"{_ROOT}/messages")).values() if f["state"] == "acked"]
    assert len(done) == 1 and "inbox" not in done[0], "a tombstone keeps inbox: the owner's Listen would see it"


async def test_a_replay_is_a_message_document_like_any_other_shard_inbox_and_fenced_tombstones(make_store):
    """Stored for another pod, a replay carries ``shard`` and ``inbox``; its owner loads it with its
    shard; its tombstones (in the key's order or aside) are fenced like every other, and once the
    shard is lost nothing of it applies."""
    first, second = _keys_in_two_shards()
    s1, s2 = shard_of(first, _SHARDS), shard_of(second, _SHARDS)
    leases = Leases("pod-a", {s1: 1, s2: 1})
    store = make_store(_CONFIG, fences=leases)
    await _set_leases(store, {s1: ("pod-a", 1), s2: ("pod-a", 1)})
    await store.load("orders", 1000, shards=frozenset({s1, s2}))
    replays = [
        dataclasses.replace(incoming(key, 1), message_id=f"replay-{key}", replay_id=f"dl-{key}", to_owner=True)
        for key in (first, second)
    ]
    on_time, other = [r.message for r in await store.persist("orders", replays, 1000)]
    stored = {f["replay"]: f for f in (await documents(client_of(store), f"{_ROOT}/messages")).values()}
    assert {(f["shard"], f["inbox"], f["state"]) for f in stored.values()} == {(s1, s1, "pending"), (s2, s2, "pending")}
    owner = make_store(_CONFIG)
    snapshot = await owner.load("orders", 1500, shards=frozenset({s2}))
    assert [(m.key, m.replay_id) for m in snapshot.pending] == [(second, f"dl-{second}")]
    await _set_leases(store, {s2: ("pod-b", 2)})  # pod-a does not know yet
    with pytest.raises(ShardLost) as caught:
        await store.commit_acks(
            "orders", [ack(on_time, 2), AckIntent(f"d-{other.dedup_id}", other, 1, aside=True)], 2000
        )
    assert caught.value.shards == {s2}
    stored = {f["replay"]: f for f in (await documents(client_of(store), f"{_ROOT}/messages")).values()}
    assert (stored[f"dl-{first}"]["state"], stored[f"dl-{first}"]["shard"]) == ("acked", s1)
    assert "inbox" not in stored[f"dl-{first}"], "a tombstone keeps no inbox: the owner's Listen would see it"
    assert stored[f"dl-{second}"]["state"] == "pending", "the lost shard's aside ack applied"
    assert store.cursor("orders", first) is not None


async def test_reads_added_by_fencing_one_per_shard_touched_per_commit() -> None:
    """The figure for docs/store.md: MemoryDocuments' counters, as Firestore bills."""
    first, second = _keys_in_two_shards()
    held = {shard_of(first, _SHARDS): 1, shard_of(second, _SHARDS): 1}
    counts = {}
    for fenced in (False, True):
        memory = MemoryDocuments()
        for shard in held:
            memory.docs[_lease(shard)] = {"owner": "pod-a", "epoch": 1}
        store = DocumentStore(memory, _CONFIG, background_flush=False, fences=Leases("pod-a", held) if fenced else None)
        await store.load("orders", 1000, shards=frozenset(held))
        messages = [r.message for r in await store.persist("orders", [incoming(first, 1), incoming(second, 1)], 1000)]
        reads = memory.reads
        await store.commit_acks("orders", [ack(messages[0], 2)], 2000)  # one shard
        one = memory.reads - reads
        await store.commit_acks("orders", [ack(messages[1], 2)], 2000)  # the other, same Commit size
        await store.flush("orders")
        counts[fenced] = (one, memory.reads - reads)
    assert counts[False] == (0, 0)
    assert counts[True] == (1, 2), counts  # one lease read per shard per fenced Commit (the flush had none due)


async def test_a_fenced_commit_that_fails_leaves_no_lock_on_the_lease_behind(make_store, emulator):
    """Case B of the brownout: a fenced Commit fails (UNAVAILABLE) and so does the first Rollback.
    The transaction read the lease, so until it ends it holds the lease against every later fenced
    Commit (and, in production, the lease renewals) for up to 60 s idle. The Rollback is retried, so
    the next fenced Commit goes through at once instead of waiting out lock timeouts."""
    from sidecar.emulators.faults import FaultRule

    store = make_store(_CONFIG)
    documents_ = store.documents
    await _set_leases(store, {0: ("pod-a", 7)})
    fence = docs.Fence(_lease(0), {"owner": "pod-a", "epoch": 7})
    emulator.injector.add(FaultRule("firestore", "Commit", remaining=1))
    emulator.injector.add(FaultRule("firestore", "Rollback", remaining=2))
    with pytest.raises(StoreUnavailable):
        await documents_.commit([docs.replace(f"{_ROOT}/keys/x", {"n": 1})], [fence])
    # The emulator's lock wait is 20 s: a lingering transaction would hold this one up that long.
    await asyncio.wait_for(documents_.commit([docs.replace(f"{_ROOT}/keys/x", {"n": 2})], [fence]), 10)
    assert (await documents(client_of(store), f"{_ROOT}/keys"))["x"] == {"n": 2}


async def test_a_drop_abandoned_after_its_reads_holds_no_lock_on_the_record_the_next_owner_acks(
    make_store, emulator, monkeypatch
):
    """Run (g) of issue 27: a process killed between a fenced drop's reads and its Commit (no Rollback
    ever comes). Firestore keeps a read-write transaction's read locks until it has been idle 60 s,
    and every write to a locked document waits. The record it meant to drop is still pending, so the
    next owner delivers it and its ack writes that document: had the drop read the record inside its
    transaction, that ack (and every other ack in its Commit) would wait out lock timeouts. The drop
    reads the record outside the transaction and compares-and-sets on the version read."""
    from sidecar.emulators.faults import FaultRule

    key = "a"
    shard = shard_of(key, _SHARDS)
    dying = make_store(_CONFIG, fences=Leases("pod-a", {shard: 7}))
    await _set_leases(dying, {shard: ("pod-a", 7)})
    await dying.load("orders", 1000, shards=frozenset({shard}), epoch=7)
    [stored] = [r.message for r in await dying.persist("orders", [incoming(key, 1)], 1000)]

    async def killed(transaction: bytes) -> None:
        return None  # a dead process rolls nothing back

    monkeypatch.setattr(dying.documents, "_rollback", killed)
    emulator.injector.add(FaultRule("firestore", "Commit", remaining=1))
    with pytest.raises(StoreUnavailable):
        await dying.mark_done("orders", [stored], DROPPED, 2000, epochs={shard: 7})

    # The pod restarted: a new owner id and epoch, which loads the shard and acks the pending record.
    await _set_leases(dying, {shard: ("pod-a2", 8)})
    next_owner = make_store(_CONFIG, fences=Leases("pod-a2", {shard: 8}))
    snapshot = await next_owner.load("orders", 3000, shards=frozenset({shard}), epoch=8)
    assert [m.dedup_id for m in snapshot.pending] == [stored.dedup_id]
    # The emulator's lock wait is 20 s (then ABORTED, and the retry waits again): a lock left on the
    # record would hold this up that long. The abandoned transaction's read of the lease holds up
    # younger reads of it for at most 5 s (the emulator's rule for an idle older transaction).
    await asyncio.wait_for(next_owner.commit_acks("orders", [ack(stored, 2)], 3000, epochs={shard: 8}), 15)
    assert {fields["state"] for fields in (await documents(client_of(next_owner), f"{_ROOT}/messages")).values()} == {
        "acked"
    }


async def test_a_blip_on_a_fenced_commits_begin_or_lease_read_is_retried_inside_the_commit(make_store, emulator):
    """Under an error rate each of a fenced commit's three calls fails now and then: at 20% a commit
    that gave up on any of them would fail half the time, and the acks behind it wait out the
    runtime's growing backoff (run (g) of issue 27: acks confirmed 16 s late). The Begin and the
    lease read are idempotent and retried at once; only the Commit's failure reaches the caller."""
    from sidecar.emulators.faults import FaultRule

    store = make_store(_CONFIG)
    documents_ = store.documents
    await _set_leases(store, {0: ("pod-a", 7)})
    fence = docs.Fence(_lease(0), {"owner": "pod-a", "epoch": 7})
    emulator.injector.add(FaultRule("firestore", "BeginTransaction", remaining=1))
    emulator.injector.add(FaultRule("firestore", "BatchGetDocuments", remaining=2))
    await documents_.commit([docs.replace(f"{_ROOT}/keys/x", {"n": 1})], [fence])
    assert (await documents(client_of(store), f"{_ROOT}/keys"))["x"] == {"n": 1}
