"""A shard load in two phases: ``load(pending=False)`` restores the state (cursors, book), then
``pending_pages`` yields the pending messages a page at a time. Together they give what one ``load``
gives; a page that fails transiently is read again from its cursor (nothing twice, nothing skipped);
a corrupt document ends the pages with StoreRejected; the payload budget spans the pages; page reads
take a load slot each, and a consumer holding a page holds none."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from gated_documents import DEADLINE_SECONDS, GatedDocuments, keys_by_shard, shard_queried, until
from store_helpers import ack, incoming

from sidecar.engine.payloads import HELD_MESSAGE_OVERHEAD_BYTES
from sidecar.engine.types import EngineSnapshot, Message
from sidecar.store import document_store, layout, reader
from sidecar.store import documents as docs
from sidecar.store.api import PayloadBudget, Store, StoreRejected, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory import MemoryStore
from sidecar.store.memory_documents import MemoryDocuments
from sidecar.store.recovery import restore_order

_SHARDS = 4
_CONFIG = {"orders": SubscriptionStoreConfig(mode="sequence", shards=_SHARDS)}
_PAGE_SIZE = 5
"""Documents per page in these tests: each shard below spans several pages."""
_KEYS = keys_by_shard(_SHARDS, 3)
_PER_KEY = 6
"""Pending messages per key (sequences 2..7; 1 is acked): 18 per shard, four pages of 5."""


@pytest.fixture(autouse=True)
def _small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "_PAGE_SIZE", _PAGE_SIZE)
    # Retries of a failed page at once: the tests count tries, they do not measure the backoff.
    monkeypatch.setattr(reader, "_RETRY_INITIAL_SECONDS", 0.001)
    monkeypatch.setattr(reader, "_RETRY_MAX_SECONDS", 0.001)


async def _fill(store: Store) -> None:
    """Every key's sequence 1 acked, sequences 2..7 pending (stored at different times, so that the
    restore order is not the document order)."""
    every = [key for keys in _KEYS.values() for key in keys]
    results = await store.persist("orders", [incoming(key, 1) for key in every], 1_000)
    await store.commit_acks("orders", [ack(result.message, 2) for result in results], 1_500)
    for seq in range(_PER_KEY + 1, 1, -1):
        await store.persist("orders", [incoming(key, seq) for key in every], 2_000 - seq)


async def _pages(
    store: Store,
    shards: frozenset[int] | None,
    budget: int | PayloadBudget | None = None,
    progress: list[int] | None = None,
) -> list[list[Message]]:
    pages = store.pending_pages("orders", shards, budget, None if progress is None else progress.append)
    return [page async for page in pages]


def _identities(messages: Sequence[Message]) -> list[tuple[str, int | None]]:
    return sorted((m.key, m.sequence) for m in messages)


def _document_store(documents: MemoryDocuments) -> DocumentStore:
    return DocumentStore(documents, _CONFIG, background_flush=False)


async def _filled_document_store() -> DocumentStore:
    documents = MemoryDocuments()
    await _fill(_document_store(documents))
    return _document_store(documents)


@pytest.mark.parametrize("kind", ["documents", "memory"])
async def test_pages_of_two_shards_hold_each_pending_message_once_and_nothing_of_other_shards(kind: str) -> None:
    store: Store
    if kind == "documents":
        store = await _filled_document_store()
    else:
        store = MemoryStore(_SHARDS, page_size=_PAGE_SIZE)
        await _fill(store)
    wanted = frozenset({0, 2})

    pages = await _pages(store, wanted)

    every = [m for page in pages for m in page]
    expected = [(key, seq) for shard in wanted for key in _KEYS[shard] for seq in range(2, _PER_KEY + 2)]
    assert _identities(every) == sorted(expected)  # each exactly once, none of shards 1 and 3
    assert len(pages) == 2 * 4  # 18 messages per shard: pages of 5, 5, 5 and 3
    assert all(0 < len(page) <= _PAGE_SIZE for page in pages)
    assert all(page == sorted(page, key=restore_order) for page in pages)
    assert all(not m.payload.stripped and m.payload.data == b"payload" for m in every)


@pytest.mark.parametrize("kind", ["documents", "memory"])
async def test_state_first_then_pages_gives_what_one_load_gives(kind: str) -> None:
    store: Store
    whole: Store
    if kind == "documents":
        documents = MemoryDocuments()
        await _fill(_document_store(documents))
        store, whole = _document_store(documents), _document_store(documents)
    else:
        store = whole = MemoryStore(_SHARDS, page_size=_PAGE_SIZE)
        await _fill(store)
    shards = frozenset({1, 3})

    state = await store.load("orders", 3_000, shards=shards, pending=False)
    pages = await _pages(store, shards)
    once: EngineSnapshot = await whole.load("orders", 3_000, shards=shards)

    assert state.pending == ()
    assert sorted(state.cursors, key=lambda c: c.key) == sorted(once.cursors, key=lambda c: c.key)
    assert len(state.cursors) == 2 * len(_KEYS[1])
    paged = [m for page in pages for m in page]
    assert _identities(paged) == _identities(once.pending) and len(paged) == len(set(paged))
    # The book is restored by the state load alone: the keys' cursors are known before any page.
    assert all(store.cursor("orders", key) is not None for shard in shards for key in _KEYS[shard])


class FlakyDocuments(MemoryDocuments):
    """MemoryDocuments whose pending-message query of one shard at one cursor fails ``failures`` times
    with Unavailable; records every pending query as (shard, cursor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: tuple[int, int] | None = None
        """(shard, page number from 0) whose query fails."""
        self.failures = 0
        self.queries: list[tuple[int | None, object | None]] = []

    async def query(
        self,
        parent: str,
        collection: str,
        where: docs.Filter | Sequence[docs.Filter] | None,
        order_by: str | None,
        after: object | None,
        limit: int,
    ) -> docs.Page:
        filters = docs.filters_of(where)
        if collection == "messages" and any(f.field == "state" for f in filters):
            shard = shard_queried(filters)
            page_number = len({cursor for s, cursor in self.queries if s == shard and cursor != after})
            self.queries.append((shard, after))
            if self.failures > 0 and (shard, page_number) == self.fail_at:
                self.failures -= 1
                raise docs.Unavailable("injected: the page's query failed")
        return await super().query(parent, collection, where, order_by, after, limit)


@pytest.mark.parametrize("failures", [2, 4])
async def test_a_page_that_fails_is_read_again_from_its_cursor_and_nothing_repeats(failures: int) -> None:
    documents = FlakyDocuments()
    await _fill(_document_store(documents))
    # The second page of shard 1 fails: more often than a whole load would try (3) with 4.
    documents.fail_at, documents.failures = (1, 1), failures
    progress: list[int] = []

    pages = await _pages(_document_store(documents), frozenset({1}), progress=progress)

    assert documents.failures == 0
    expected = [(key, seq) for key in _KEYS[1] for seq in range(2, _PER_KEY + 2)]
    assert _identities([m for page in pages for m in page]) == sorted(expected)
    # The failed page was asked for again with the same cursor, and the first page was not read again.
    cursors = [cursor for shard, cursor in documents.queries if shard == 1]
    assert cursors.count(None) == 1
    assert cursors.count(cursors[1]) == failures + 1 and cursors[1] is not None
    assert progress[-1] == len(expected)  # the retried page is counted once


async def test_a_corrupt_pending_document_ends_the_pages_with_store_rejected_naming_it() -> None:
    documents = MemoryDocuments()
    await _fill(_document_store(documents))
    store = _document_store(documents)
    victim = next(
        path
        for path, fields in sorted(documents.docs.items())
        if "/messages/" in path and fields.get("state") == layout.PENDING and fields.get("shard") == 2
    )
    del documents.docs[victim]["seq"]

    with pytest.raises(StoreRejected, match=victim.rpartition("/")[2]) as raised:
        await _pages(store, frozenset({2}))
    assert "no seq" in str(raised.value)
    # Other shards' pages are not affected.
    assert len([m for page in await _pages(store, frozenset({0})) for m in page]) == 3 * _PER_KEY


async def test_the_payload_budget_spans_the_pages_and_later_pages_come_back_stripped() -> None:
    documents = MemoryDocuments()
    writer = _document_store(documents)
    (key,) = keys_by_shard(_SHARDS, 1)[0]
    await writer.persist("orders", [incoming(key, seq, data=bytes([seq]) * 1_000) for seq in range(1, 21)], 1_000)
    # Each message charges 600 bytes of bookkeeping, then keeps its payload (1,143 bytes) if that
    # fits: 13,000 bytes keep the first 7 payloads, and then none (the bookkeeping eats the rest).
    budget = PayloadBudget(13_000)

    pages = await _pages(_document_store(documents), frozenset({0}), budget)

    assert [len(page) for page in pages] == [5, 5, 5, 5]
    assert [sum(not m.payload.stripped for m in page) for page in pages] == [5, 2, 0, 0]
    assert all(m.payload.data == bytes([m.sequence]) * 1_000 for page in pages for m in page if not m.payload.stripped)
    assert all(m.payload.data == b"" and m.payload.attributes == {} for page in pages[2:] for m in page)
    assert budget.remaining == 13_000 - 20 * HELD_MESSAGE_OVERHEAD_BYTES - 7 * 1_143


async def test_a_page_whose_chunks_fail_to_read_charges_the_budget_once() -> None:
    class FlakyChunks(MemoryDocuments):
        failures = 1

        async def get_all(self, paths: Sequence[str]) -> dict[str, docs.Fields]:
            if self.failures and any("/chunks/" in path for path in paths):
                self.failures -= 1
                raise docs.Unavailable("injected: the chunks' read failed")
            return await super().get_all(paths)

    documents = FlakyChunks()
    (key,) = keys_by_shard(_SHARDS, 1)[0]
    big = bytes(range(256)) * 6_000  # 1.5 MB: two chunk documents
    await _document_store(documents).persist("orders", [incoming(key, 1, data=big), incoming(key, 2)], 1_000)
    budget = PayloadBudget(10_000_000)

    (page,) = await _pages(_document_store(documents), frozenset({0}), budget)

    assert documents.failures == 0
    assert [m.payload.data for m in page] == [big, b"payload"]
    spent = 2 * HELD_MESSAGE_OVERHEAD_BYTES + layout.CHUNK_BYTES + 33 + 110 + len(b"payload") + 33 + 110
    assert budget.remaining == 10_000_000 - spent


async def test_progress_counts_the_documents_read_so_far_page_by_page() -> None:
    store = await _filled_document_store()
    progress: list[int] = []

    pages = await _pages(store, frozenset({0, 1}), progress=progress)

    # Cumulative, one call per page read (18 per shard: pages of 5, 5, 5, 3), never counting twice.
    assert progress == [5, 10, 15, 18, 23, 28, 33, 36]
    assert progress[-1] == sum(len(page) for page in pages) == 2 * 3 * _PER_KEY


async def test_a_consumer_holding_pages_holds_no_load_slot_but_each_page_read_takes_one() -> None:
    documents = GatedDocuments()
    await _fill(_document_store(documents))
    store = _document_store(documents)
    # One generator per load slot, each suspended at its first page while its consumer holds it.
    generators = [
        store.pending_pages("orders", frozenset({shard}), None, None) for shard in range(document_store._LOADS_AT_ONCE)
    ]
    firsts = [await asyncio.wait_for(anext(pages), DEADLINE_SECONDS) for pages in generators]
    assert all(len(page) == _PAGE_SIZE for page in firsts)
    # Had they kept their slots, this load would wait for ever.
    state = await asyncio.wait_for(store.load("orders", 3_000, shards=frozenset({0}), pending=False), DEADLINE_SECONDS)
    assert len(state.cursors) == len(_KEYS[0])

    # Every slot taken by a load held at its gate (two reads each: cursors, tombstones): the next
    # page of shard 0, which is not gated, waits for a slot.
    documents.gates = {1: asyncio.Event(), 2: asyncio.Event()}
    loads = [
        asyncio.ensure_future(store.load("orders", 3_000, shards=frozenset({shard}), pending=False))
        for shard in (1, 2, 1, 2)
    ]
    await until(documents, lambda: documents.waiting.get(1, 0) >= 4 and documents.waiting.get(2, 0) >= 4, "4 loads")
    following = asyncio.ensure_future(anext(generators[0]))
    for _ in range(50):  # let the loop run it as far as it can go: not to the end
        await asyncio.sleep(0)
    assert not following.done()
    for gate in documents.gates.values():
        gate.set()
    assert len(await asyncio.wait_for(following, DEADLINE_SECONDS)) == _PAGE_SIZE
    await asyncio.wait_for(asyncio.gather(*loads), DEADLINE_SECONDS)
    for pages in generators:
        await pages.aclose()


async def test_memory_store_pages_retry_unavailable_and_stop_at_rejected() -> None:
    store = MemoryStore(_SHARDS, page_size=_PAGE_SIZE)
    await _fill(store)
    store.fail_next("pending_pages", 4)

    pages = await _pages(store, frozenset({3}))

    expected = sorted((key, seq) for key in _KEYS[3] for seq in range(2, _PER_KEY + 2))
    assert _identities([m for page in pages for m in page]) == expected
    assert store.calls["pending_pages"] == len(pages) + 4

    store.fail_next("pending_pages", 1, error=StoreRejected("injected: refused"))
    with pytest.raises(StoreRejected, match="injected"):
        await _pages(store, frozenset({3}))


async def test_memory_store_leaves_out_a_message_finished_before_its_page_is_read() -> None:
    store = MemoryStore(_SHARDS, page_size=_PAGE_SIZE)
    await _fill(store)
    everything = (await store.load("orders", 3_000, shards=frozenset({0}))).pending
    pages = store.pending_pages("orders", frozenset({0}), None, None)
    first = await anext(pages)
    finished = next(m for m in reversed(everything) if m not in first)
    await store.commit_acks("orders", [ack(finished, None)], 3_000)

    rest = [m async for page in pages for m in page]

    assert _identities(first + rest) == _identities([m for m in everything if m != finished])


async def test_firestore_store_loads_the_state_then_pages_of_two_shards(make_store, monkeypatch) -> None:
    monkeypatch.setattr(reader, "_PAGE_SIZE", 64)
    config = {"orders": SubscriptionStoreConfig(mode="sequence", shards=2)}
    keys = keys_by_shard(2, 10)
    every = [key for shard_keys in keys.values() for key in shard_keys]
    writer = make_store(config)
    acked = await writer.persist("orders", [incoming(key, 1) for key in every], 1_000)
    await writer.commit_acks("orders", [ack(result.message, 2) for result in acked], 1_500)
    await writer.flush("orders")
    await writer.persist("orders", [incoming(key, seq) for key in every for seq in range(2, 17)], 2_000)
    both = frozenset({0, 1})
    store = make_store(config)
    progress: list[int] = []

    state = await store.load("orders", 3_000, shards=both, pending=False)
    pages = [page async for page in store.pending_pages("orders", both, None, progress.append)]
    once = await make_store(config).load("orders", 3_000, shards=both)

    assert state.pending == () and len(once.pending) == 300
    assert sorted(state.cursors, key=lambda c: c.key) == sorted(once.cursors, key=lambda c: c.key)
    assert all(cursor.next_sequence == 2 for cursor in state.cursors) and len(state.cursors) == 20
    paged = [m for page in pages for m in page]
    assert _identities(paged) == _identities(once.pending) == sorted((k, s) for k in every for s in range(2, 17))
    assert len(pages) >= 6 and all(len(page) <= 64 for page in pages)  # 150 per shard: 3 pages each
    assert all(page == sorted(page, key=restore_order) for page in pages)
    assert progress[-1] == 300
