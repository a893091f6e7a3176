"""The store writes a decision only under the lease epoch it was made under (docs/store.md, "Several
pods: fencing"): ``load(epoch=...)`` records the epoch a shard's state is held at, and every write
that carries ``epochs`` is refused for a shard held at another epoch, without touching what the
store holds for the new one. Over ``MemoryDocuments`` with a fence source the test drives."""

from __future__ import annotations

import pytest
from store_helpers import ack, incoming

from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.api import DEAD_LETTERED, ShardLost, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

_SUB = "orders"
_ROOT = "r"
_SHARDS = 2
_KEY = next(f"k{i}" for i in range(100) if shard_of(f"k{i}", _SHARDS) == 0)


class _Pod:
    """The lease as this pod's lease manager knows it (its FenceSource), and in the database."""

    def __init__(self, documents: MemoryDocuments) -> None:
        self.documents = documents
        self.epoch: int | None = None

    def hold(self, epoch: int) -> None:
        self.epoch = epoch
        self.documents.docs[f"{_ROOT}/{_SUB}/leases/0000"] = {"owner": "me", "epoch": epoch}

    def __call__(self, subscription: str, shard: int) -> docs.Fence:
        if self.epoch is None:
            raise ShardLost(subscription, [shard])
        return docs.Fence(f"{_ROOT}/{_SUB}/leases/{shard:04d}", {"owner": "me", "epoch": self.epoch})


async def _store() -> tuple[DocumentStore, MemoryDocuments, _Pod]:
    documents = MemoryDocuments()
    pod = _Pod(documents)
    store = DocumentStore(
        documents,
        {_SUB: SubscriptionStoreConfig(mode="sequence", shards=_SHARDS)},
        root=_ROOT,
        fences=pod,
        background_flush=False,
        clock_ms=lambda: 1_000,
    )
    return store, documents, pod


def _state(documents: MemoryDocuments, message: object) -> object:
    target = layout.doc_id_of(message)  # type: ignore[arg-type]
    assert target is not None
    return documents.docs[layout.message_path(f"{_ROOT}/{_SUB}", target[0])]["state"]


async def test_acks_and_dead_letters_of_another_epoch_are_refused_and_the_held_state_is_kept() -> None:
    store, documents, pod = await _store()
    pod.hold(8)
    await store.load(_SUB, 1_000, shards=frozenset({0}), epoch=8)
    [one, two] = [r.message for r in await store.persist(_SUB, [incoming(_KEY, 1), incoming(_KEY, 2)], 1_000)]

    with pytest.raises(ShardLost) as caught:
        await store.commit_acks(_SUB, [ack(one, 2)], 1_000, epochs={0: 7})
    assert caught.value.shards == {0} and caught.value.lost_at(0, 7) and not caught.value.lost_at(0, 8)
    with pytest.raises(ShardLost):
        await store.mark_done(_SUB, [two], DEAD_LETTERED, 1_000, epochs={0: 7})
    with pytest.raises(ShardLost):
        await store.unblock(_SUB, _KEY, 1_000, epochs={0: 7})
    assert (_state(documents, one), _state(documents, two)) == (layout.PENDING, layout.PENDING)
    assert store.cursor(_SUB, _KEY) is None or store.cursor(_SUB, _KEY).next_sequence == 1  # type: ignore[union-attr]

    await store.commit_acks(_SUB, [ack(one, 2)], 1_000, epochs={0: 8})  # the epoch held: written
    assert _state(documents, one) == layout.ACKED
    cursor = store.cursor(_SUB, _KEY)
    assert cursor is not None and cursor.next_sequence == 2


async def test_state_loaded_under_one_epoch_is_not_written_under_the_next() -> None:
    """The lease manager took the shard back at a new epoch before this pod reloaded it: the state
    held is the old epoch's, so its writes are refused (and it is forgotten) rather than fenced
    with the new epoch, which they would pass."""
    store, documents, pod = await _store()
    pod.hold(7)
    await store.load(_SUB, 1_000, shards=frozenset({0}), epoch=7)
    [one] = [r.message for r in await store.persist(_SUB, [incoming(_KEY, 1)], 1_000)]
    pod.hold(8)
    with pytest.raises(ShardLost) as caught:
        await store.commit_acks(_SUB, [ack(one, 2)], 1_000, epochs={0: 7})
    assert caught.value.lost_at(0, 7) and not caught.value.lost_at(0, 8)
    assert _state(documents, one) == layout.PENDING
    assert store.cursor(_SUB, _KEY) is None, "the epoch-7 state is forgotten"
