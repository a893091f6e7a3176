"""An operator's gap skip in the store (``Store.skip_gap``, ``cursors.fold_skip_gap``): written at
once, fenced, and still there after a restart, where a copy of a skipped sequence is late and the
key's cursor stands past the range. Over ``MemoryDocuments``, restarted by a second store on the
same documents."""

from __future__ import annotations

import pytest
from store_helpers import ack, incoming

from sidecar.engine import DeadLetter, Engine, EngineConfig
from sidecar.engine.types import KeyCursor
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store.api import ShardLost, SubscriptionStoreConfig
from sidecar.store.cursors import CursorState, fold_ack, fold_skip_gap
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

_SUB = "orders"
_ROOT = "r"
_SHARDS = 2
_KEY = next(f"k{i}" for i in range(100) if shard_of(f"k{i}", _SHARDS) == 0)


def _store(documents: MemoryDocuments, epoch: int | None = None) -> DocumentStore:
    fences = None
    if epoch is not None:
        documents.docs[f"{_ROOT}/{_SUB}/leases/0000"] = {"owner": "me", "epoch": epoch}

        def fences(subscription: str, shard: int) -> docs.Fence:
            return docs.Fence(f"{_ROOT}/{_SUB}/leases/{shard:04d}", {"owner": "me", "epoch": epoch})

    return DocumentStore(
        documents,
        {_SUB: SubscriptionStoreConfig(mode="sequence", shards=_SHARDS)},
        root=_ROOT,
        fences=fences,
        background_flush=False,
        clock_ms=lambda: 1_000,
    )


async def test_a_recorded_skip_survives_a_restart_and_a_late_copy_is_dead_lettered_late() -> None:
    documents = MemoryDocuments()
    store = _store(documents)
    await store.load(_SUB, 1_000)
    stored = await store.persist(_SUB, [incoming(_KEY, seq) for seq in (1, 2, 4, 5)], 1_000)
    one, two, four, five = (result.message for result in stored)
    await store.commit_acks(_SUB, [ack(one, 2), ack(two, 3)], 1_000)
    assert await store.skip_gap(_SUB, _KEY, 3, 3, 1_100)
    # Recorded once: the cursor no longer stands at 3, so the same skip again is refused.
    assert not await store.skip_gap(_SUB, _KEY, 3, 3, 1_200)

    restarted = _store(documents)
    snapshot = await restarted.load(_SUB, 2_000)
    (cursor,) = snapshot.cursors
    assert (cursor.next_sequence, cursor.known_from, cursor.skipped) == (4, 1, ((3, 3),))
    assert [m.sequence for m in snapshot.pending] == [4, 5]
    engine = Engine.restore(EngineConfig(mode="sequence"), snapshot, 2_000)
    engine.tick(2_000)
    assert [d.message.sequence for d in engine.take("c", 10, 2_000)] == [4]
    late = (await restarted.persist(_SUB, [incoming(_KEY, 3)], 2_000))[0].message
    assert engine.on_stored(late, 2_000) == [DeadLetter(late, "late", 0)]
    del four, five


async def test_the_skip_is_refused_when_the_stores_cursor_is_not_at_the_gap() -> None:
    store = _store(MemoryDocuments())
    await store.load(_SUB, 1_000)
    (one,) = [r.message for r in await store.persist(_SUB, [incoming(_KEY, 1), incoming(_KEY, 3)], 1_000)][:1]
    assert not await store.skip_gap(_SUB, _KEY, 2, 2, 1_000)  # 1 is not acked: the cursor is at 1
    await store.commit_acks(_SUB, [ack(one, 2)], 1_000)
    assert await store.skip_gap(_SUB, _KEY, 2, 2, 1_000)
    assert store.cursor(_SUB, _KEY) == KeyCursor(_KEY, 3)


async def test_the_skip_is_fenced_by_the_epoch_it_was_decided_under() -> None:
    documents = MemoryDocuments()
    store = _store(documents, epoch=8)
    await store.load(_SUB, 1_000, shards=frozenset({0}), epoch=8)
    await store.persist(_SUB, [incoming(_KEY, 3)], 1_000)
    with pytest.raises(ShardLost):
        await store.skip_gap(_SUB, _KEY, 1, 2, 1_000, epochs={0: 7})
    assert await store.skip_gap(_SUB, _KEY, 1, 2, 1_000, epochs={0: 8})
    cursor = (await _store(documents).load(_SUB, 2_000)).cursors[0]
    assert (cursor.next_sequence, cursor.skipped) == (3, ((1, 2),))


def test_fold_skip_gap_records_the_range_as_an_ack_carrying_it_would() -> None:
    by_skip = CursorState(_KEY, next_sequence=3, known_from=1)
    assert fold_skip_gap(by_skip, 3, 5)
    by_ack = CursorState(_KEY, next_sequence=3, known_from=1)
    fold_ack(by_ack, "sequence", 6, 7, [(3, 5)])
    fold_ack(by_skip, "sequence", 6, 7, [])
    assert (by_skip.next_sequence, by_skip.skips) == (by_ack.next_sequence, by_ack.skips) == (7, [[3, 5]])
    above = CursorState(_KEY, next_sequence=3, known_from=1, done_above={4})
    assert not fold_skip_gap(above, 3, 5)  # 4 is finished, not missing
    assert above == CursorState(_KEY, next_sequence=3, known_from=1, done_above={4})
