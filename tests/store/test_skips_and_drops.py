"""Skipped ranges as the engine reports them, drops only over pending records, and the hand-over
flush: ``DocumentStore`` over ``MemoryDocuments`` (Firestore's semantics in memory)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from store_helpers import incoming

from sidecar.engine.types import AckIntent, Message, SkippedRange
from sidecar.store import documents as docs
from sidecar.store import layout, recovery
from sidecar.store.api import DROPPED, PersistOutcome, SubscriptionStoreConfig
from sidecar.store.cursor_book import CursorBook
from sidecar.store.cursors import CursorRules
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

SUB = "orders"
_ROOT = f"pubsub-sidecar/{SUB}"
_LEASE = f"{_ROOT}/leases/0000"


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def _store(documents: MemoryDocuments, clock: Clock, *, fenced: bool = False) -> DocumentStore:
    def fences(subscription: str, shard: int) -> docs.Fence:
        return docs.Fence(_LEASE, {"owner": "me", "epoch": 1})

    return DocumentStore(
        documents,
        {SUB: SubscriptionStoreConfig(mode="sequence")},
        clock_ms=clock,
        background_flush=False,
        fences=fences if fenced else None,
    )


async def _stored(store: DocumentStore, key: str, *seqs: int) -> list[Message]:
    results = await store.persist(SUB, [incoming(key, seq) for seq in seqs], 1_000)
    assert all(r.outcome is PersistOutcome.STORED for r in results)
    return [r.message for r in results]


def _ack(message: Message, cursor: int, skipped: tuple[SkippedRange, ...] = ()) -> AckIntent:
    return AckIntent(f"d-{message.dedup_id}", message, cursor, skipped=skipped)


def _doc(documents: MemoryDocuments, message: Message) -> dict[str, Any]:
    assert message.payload is not None
    return documents.docs[layout.message_path(_ROOT, message.payload.ref)]


# ---- drops ----------------------------------------------------------------------------------------


async def test_a_record_finished_between_a_drops_read_and_its_commit_keeps_its_tombstone() -> None:
    """The drop reads its record outside the transaction, so the owner's ack may land before the
    drop's Commit: the drop is a compare-and-set on the version read, fails, and is planned again
    from a new read, which finds the record finished: the drop is moot, the tombstone stays."""
    documents, clock = MemoryDocuments(), Clock(10_000)
    store = _store(documents, clock, fenced=True)
    documents.docs[_LEASE] = {"owner": "me", "epoch": 1}
    await store.load(SUB, clock())
    [first] = await _stored(store, "k", 1)
    assert first.payload is not None
    path = layout.message_path(_ROOT, first.payload.ref)
    acked = {**documents.docs[path], "state": "acked", "cursor_seq": 2}
    read_versions = documents.get_versioned
    raced: list[str] = []

    async def read_then_finish(paths: Sequence[str]) -> tuple[int, dict[str, docs.Versioned]]:
        found = await read_versions(paths)
        if path in paths and not raced:  # the owner's ack lands between the read and the Commit
            raced.append(path)
            await documents.commit([docs.replace(path, acked)])
        return found

    documents.get_versioned = read_then_finish  # type: ignore[method-assign]
    await store.mark_done(SUB, [first], DROPPED, clock())
    assert raced == [path]
    assert _doc(documents, first) == acked, "the drop replaced the tombstone written after its read"


async def test_two_copies_of_one_record_dropped_in_one_call_write_one_tombstone() -> None:
    """Two copies of a record (a Pub/Sub redelivery beside the original) dropped together address one
    document: one compare-and-set, not two (the second, after the first, could never apply)."""
    documents, clock = MemoryDocuments(), Clock(10_000)
    store = _store(documents, clock, fenced=True)
    documents.docs[_LEASE] = {"owner": "me", "epoch": 1}
    await store.load(SUB, clock())
    [first] = await _stored(store, "k", 1)
    await asyncio.wait_for(store.mark_done(SUB, [first, first], DROPPED, clock()), 5)
    assert _doc(documents, first)["state"] == DROPPED


async def test_a_drop_never_replaces_an_acked_tombstone_and_finishes_a_pending_record() -> None:
    documents, clock = MemoryDocuments(), Clock(10_000)
    store = _store(documents, clock)
    await store.load(SUB, clock())
    first, second = await _stored(store, "k", 1, 2)
    await store.commit_acks(SUB, [_ack(first, 2)], clock())
    acked = dict(_doc(documents, first))
    assert acked["state"] == "acked" and acked["cursor_seq"] == 2
    reads = documents.reads
    # A stale copy of 1 (read back pending before the ack) and a copy of 2, pending: both dropped.
    await store.mark_done(SUB, [first, second], DROPPED, clock())
    assert _doc(documents, first) == acked, "the drop replaced the acked tombstone that carries the cursor"
    assert _doc(documents, second)["state"] == DROPPED
    # One guard read per dropped record, before the Commit (none inside it): the moot one is left out.
    assert documents.reads - reads == 2
    # A restart folds the acked tombstone: the cursor is past 1.
    cursor = _store(documents, clock)
    snapshot = await cursor.load(SUB, clock())
    assert [(c.key, c.next_sequence) for c in snapshot.cursors] == [("k", 2)]


async def test_a_moot_drop_in_a_fenced_commit_loses_no_shard() -> None:
    documents, clock = MemoryDocuments(), Clock(10_000)
    documents.docs[_LEASE] = {"owner": "me", "epoch": 1}
    store = _store(documents, clock, fenced=True)
    await store.load(SUB, clock())
    (first,) = await _stored(store, "k", 1)
    await store.commit_acks(SUB, [_ack(first, 2)], clock())
    await store.mark_done(SUB, [first], DROPPED, clock())  # no ShardLost: the lease still holds
    assert _doc(documents, first)["state"] == "acked"
    (third,) = await _stored(store, "k", 3)
    await store.mark_done(SUB, [third], DROPPED, clock())
    assert _doc(documents, third)["state"] == DROPPED


# ---- the hand-over flush ----------------------------------------------------------------------------


async def test_a_hand_over_flush_writes_the_shards_cursors_whatever_the_interval() -> None:
    documents, clock = MemoryDocuments(), Clock(10_000)
    store = _store(documents, clock)
    await store.load(SUB, clock())
    first, second = await _stored(store, "k", 1, 2)
    await store.commit_acks(SUB, [_ack(first, 2)], clock())  # writes the checkpoint (next 2)
    clock.now_ms += 10
    await store.commit_acks(SUB, [_ack(second, 3)], clock())  # not due: on its tombstone only
    checkpoint = f"{_ROOT}/checkpoints/0000"
    assert documents.docs[checkpoint]["cursors"][layout.key_doc_id("k")]["next_seq"] == 2
    await store.flush(SUB)  # nothing due yet
    assert documents.docs[checkpoint]["cursors"][layout.key_doc_id("k")]["next_seq"] == 2
    writes = documents.writes
    await store.flush(SUB, frozenset({0}))
    assert documents.docs[checkpoint]["cursors"][layout.key_doc_id("k")]["next_seq"] == 3
    assert documents.docs[checkpoint]["clean_ms"] == clock()
    assert documents.writes - writes == 1, "the checkpoint alone"
    await store.flush(SUB, frozenset({0}))
    assert documents.writes - writes == 1, "nothing unwritten left: nothing written"


# ---- skipped ranges -------------------------------------------------------------------------------


def _book() -> CursorBook:
    return CursorBook(CursorRules("sequence"), 1_000)


def _plain(key: str, seq: int) -> Message:
    return incoming(key, seq).to_message(1_000, "x")


def test_the_fold_records_the_ranges_an_ack_carried_and_nothing_else() -> None:
    book = _book()
    # 1 and 2 were finished by acks the book has not seen (a fast-path ack folded later, a lost
    # answer): an ack of 3 with cursor 4 passes them, and they are no skip.
    book.accept(book.propose([_ack(_plain("k", 3), 4)], [], 1), 1)
    assert (book.states["k"].next_sequence, book.states["k"].skips) == (4, [])
    # 4..5 skipped by a gap timeout, 6 finished above (acked with a window), 7 skipped, 8 acked.
    book.accept(book.propose([_ack(_plain("k", 6), 4)], [], 2), 2)
    carried = (SkippedRange(4, 5), SkippedRange(7, 7))
    book.accept(book.propose([_ack(_plain("k", 8), 9, carried)], [], 3), 3)
    assert (book.states["k"].next_sequence, book.states["k"].skips) == (9, [[4, 5], [7, 7]])
    # The same ranges on an ack folded later (it was durable first elsewhere): nothing new.
    book.accept(book.propose([_ack(_plain("k", 7), 8, carried)], [], 4), 4)
    assert book.states["k"].skips == [[4, 5]], "7 was acked late after all: no longer skipped"


def test_only_the_part_of_a_carried_range_the_cursor_passes_now_is_recorded() -> None:
    book = _book()
    state = book.rules.new_state("k")
    state.next_sequence, state.known_from = 5, 1  # 1..4 finished (a late 4 was finished after all)
    book.states["k"] = state
    book.accept(book.propose([_ack(_plain("k", 8), 9, (SkippedRange(2, 7),))], [], 1), 1)
    assert book.states["k"].skips == [[5, 7]]


def _tombstone(seq: int, cursor: int, **extra: Any) -> tuple[str, dict[str, Any]]:
    fields = {"key": "k", "seq": seq, "cursor_seq": cursor, "state": "acked", "done_ms": 100 + seq, "shard": 0}
    return f"t{seq}", {**fields, "v": 2, **extra}


def test_recovery_records_a_tombstones_skips_and_infers_them_for_an_earlier_releases_only() -> None:
    rules = CursorRules("sequence")

    def skips(*tombstones: tuple[str, dict[str, Any]]) -> tuple[tuple[int, int], ...]:
        (cursor,) = recovery.recover(rules, [], list(tombstones), [], 0).snapshot.cursors
        return cursor.skipped

    assert skips(_tombstone(3, 4, cursor_skips=[])) == (), "1 and 2 were acked (their acks unseen)"
    assert skips(_tombstone(3, 4, cursor_skips=[1, 1])) == ((1, 1),)
    # Written before acks carried their ranges: what the cursor passed unseen counts as skipped.
    assert skips(_tombstone(3, 4)) == ((1, 2),)
