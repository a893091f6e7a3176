"""A gained shard's inbox when the Listen's first snapshot comes late (docs/store.md, "Several pods").

Pod "me" gains a shard (``ShardOwnership.on_gained``) while another pod stores messages for it
(``inbox``). The inbox Listen's first snapshot is held back (``MemoryDocuments.listen_gate``; on the
Firestore emulator, the Listen stream opens only when the test lets it) past the bounded wait, so
the shard loads without it; messages committed after the load's page reads are then in no page,
only in that late snapshot. Every such message must reach the engine, exactly once, and its key
must deliver in order. The runtime, store and ownership are the real ones; the test plays the
lease manager (lease documents, ``on_gained``) and the app (``take``, ``ack``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from sidecar.engine.types import Deliver, EngineConfig, Message
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.api import IncomingMessage, PersistOutcome, ShardLost, StoreError, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore
from sidecar.store.firestore import FirestoreDocuments
from sidecar.store.inbox import InboxListening
from sidecar.store.memory_documents import MemoryDocuments
from sidecar.wiring.ownership import ShardOwnership

SHARDS = 4
SHARD = 2
ROOT = "t"
SUB = "orders"
CONFIG = {SUB: SubscriptionStoreConfig(mode="sequence", shards=SHARDS)}
WAIT_SECONDS = 15.0
"""Generous (the machine is shared); every wait ends as soon as its condition holds."""
FIRST_SNAPSHOT_SECONDS = 0.05
"""The bounded wait for the first snapshot: short, since the tests hold that snapshot back anyway."""

KEY = next(f"k{i}" for i in range(1_000) if shard_of(f"k{i}", SHARDS) == SHARD)


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll with a deadline: the runtime's state has no event a test could wait on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_SECONDS
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {WAIT_SECONDS}s waiting for {what}")
        await asyncio.sleep(0.01)


class HeldDocuments(MemoryDocuments):
    """MemoryDocuments whose inbox Listens read their first snapshot only once ``snapshots`` is set,
    and whose pending-message pages of the shard, once ``hold_pages`` is called, hold one document
    each and are read one at a time as the test allows them."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots = asyncio.Event()
        self.listen_gate = self._gate
        self.pages_allowed: int | None = None
        self.pages_read = 0
        self._moved = asyncio.Event()

    async def _gate(self, parent: str, collection: str, where: Sequence[docs.Filter]) -> None:
        if collection == "messages":
            await self.snapshots.wait()

    def hold_pages(self) -> None:
        self.pages_allowed = 0

    def allow_page(self, pages: int = 1) -> None:
        assert self.pages_allowed is not None
        self.pages_allowed += pages
        self._moved.set()

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
        pending_page = collection == "messages" and docs.Filter(layout.SHARD, "EQUAL", SHARD) in filters
        if pending_page and self.pages_allowed is not None:
            limit = 1
            while self.pages_read >= self.pages_allowed:
                self._moved.clear()
                await self._moved.wait()
            self.pages_read += 1
        return await super().query(parent, collection, where, order_by, after, limit)


class _Sink:
    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        raise AssertionError(f"nothing is dead-lettered here, got {message.dedup_id} ({reason})")


class Pods:
    """Pod "me" (runtime, fenced store, ownership of the shard) and another pod's intake."""

    def __init__(self, documents: docs.Documents) -> None:
        self.documents = documents
        self.epochs: dict[int, int] = {}
        self.store = DocumentStore(documents, CONFIG, root=ROOT, fences=self._fence, background_flush=False)
        self.other = DocumentStore(documents, CONFIG, root=ROOT, background_flush=False)
        self.runtime = SubscriptionRuntime(
            SUB, EngineConfig(mode="sequence", ack_deadline_ms=60_000), self.store, _Sink(), shard_count=SHARDS
        )
        self.runtime.pod = "me"
        self.runtime.lease_check = self.epochs.get
        self.ownership = ShardOwnership(
            self.runtime, self.store, drain_timeout_seconds=1.0, first_snapshot_seconds=FIRST_SNAPSHOT_SECONDS
        )
        self.delivered: list[int | None] = []

    def _fence(self, subscription: str, shard: int) -> docs.Fence:
        epoch = self.epochs.get(shard)
        if epoch is None:
            raise ShardLost(subscription, frozenset({shard}))
        return docs.Fence(f"{ROOT}/{SUB}/leases/{shard:04d}", {"owner": "me", "epoch": epoch})

    async def start(self) -> None:
        await self.runtime.recover()
        await self.runtime.start()

    async def stop(self) -> None:
        await self.ownership.close()
        await self.runtime.stop(grace_seconds=0.5)

    async def gain(self, epoch: int = 1) -> None:
        """Take the shard's lease in the store, then carry the gain out as the lease manager would."""
        await self.documents.commit([docs.replace(f"{ROOT}/{SUB}/leases/{SHARD:04d}", {"owner": "me", "epoch": epoch})])
        self.epochs[SHARD] = epoch
        await self.ownership.on_gained(SHARD, epoch)

    async def stored_elsewhere(self, *sequences: int) -> None:
        """The other pod stores ``KEY``'s ``sequences`` for this shard's owner (``inbox``)."""
        batch = [
            IncomingMessage(
                key=KEY,
                dedup_id=f"{KEY}/{seq}",
                message_id=f"m-{seq}",
                data=f"{KEY}#{seq}".encode(),
                attributes={},
                ordering_key="",
                publish_time_ms=1,
                sequence=seq,
                to_owner=True,
            )
            for seq in sequences
        ]
        results = await self.other.persist(SUB, batch, 1_000)
        assert {r.outcome for r in results} == {PersistOutcome.STORED}

    async def deliver_in_order(self, through: int) -> None:
        """Play the app: take what is ready and ack it, until ``KEY``'s ``through`` is acked."""
        deliveries: list[Deliver] = []

        def took() -> bool:
            deliveries.extend(self.runtime.take("app", 10))
            return bool(deliveries)

        while not self.delivered or self.delivered[-1] != through:
            await wait_until(took, f"a delivery of {KEY} after {self.delivered}")
            for delivery in deliveries:
                self.delivered.append(delivery.message.sequence)
                result = await self.runtime.ack("app", [delivery.delivery_id])
                assert result.confirmed == [delivery.delivery_id]
            deliveries.clear()

    def pending(self) -> list[int]:
        """``KEY``'s sequences still pending in the store (MemoryDocuments only)."""
        assert isinstance(self.documents, MemoryDocuments)
        return sorted(
            fields["seq"]
            for path, fields in self.documents.docs.items()
            if "/messages/" in path and fields.get("state") == layout.PENDING
        )

    def counts(self) -> dict[str, int]:
        return self.runtime.status()[0].counts


@pytest.fixture
async def held() -> AsyncIterator[tuple[Pods, HeldDocuments]]:
    documents = HeldDocuments()
    pods = Pods(documents)
    await pods.start()
    try:
        yield pods, documents
    finally:
        await pods.stop()


async def test_a_first_snapshot_later_than_the_load_is_handed_over_and_its_key_delivers_in_order(
    held: tuple[Pods, HeldDocuments],
) -> None:
    pods, documents = held
    await pods.stored_elsewhere(1)
    await pods.gain()  # waits for a snapshot that does not come, then loads anyway
    await pods.runtime.loaded()
    assert documents.snapshots.is_set() is False
    # Committed after the load read its pages, before the Listen read anything: in no page.
    await pods.stored_elsewhere(2, 3)

    (first,) = pods.runtime.take("app", 10)
    assert first.message.sequence == 1
    documents.snapshots.set()  # the late first snapshot: 1 (in flight, loaded), 2 and 3
    await wait_until(lambda: pods.ownership.inbox_messages == 3, "the late snapshot")
    pods.delivered.append(1)
    assert (await pods.runtime.ack("app", [first.delivery_id])).confirmed == [first.delivery_id]

    await pods.deliver_in_order(through=3)
    assert pods.delivered == [1, 2, 3]
    assert pods.pending() == []
    assert pods.counts()["delivered"] == 3
    # 1, loaded by a page and in the late snapshot after the load, reached the engine once.
    assert pods.counts()["duplicates"] == 0


@pytest.mark.parametrize("snapshot_first", [True, False], ids=["snapshot-then-page", "page-then-snapshot"])
async def test_a_record_both_paged_and_in_a_late_snapshot_reaches_the_engine_once(
    held: tuple[Pods, HeldDocuments], snapshot_first: bool
) -> None:
    pods, documents = held
    documents.hold_pages()
    await pods.stored_elsewhere(1, 2)
    await pods.gain()  # the state is read; the pages wait
    await wait_until(lambda: pods.runtime.loading_shards == 1, "the load")
    if not snapshot_first:
        documents.allow_page()  # page 1 holds KEY/1 alone
        await wait_until(lambda: pods.counts()["recovered"] == 1, "the first page")
    await pods.stored_elsewhere(3)  # after the state read, before the last pages
    documents.snapshots.set()  # read now: 1, 2 and 3, handed over while the shard loads
    await wait_until(lambda: pods.ownership.inbox_messages == 3, "the late snapshot")
    documents.allow_page(10)  # the rest: 1 to 3, one a page, and the empty last one
    await pods.runtime.loaded()

    await pods.deliver_in_order(through=3)
    assert pods.delivered == [1, 2, 3]
    counts = pods.counts()
    # Each record reached the engine once: by its page or by the snapshot, whichever came first.
    assert counts["duplicates"] == 0
    assert counts["recovered"] + counts["stored"] == 3


async def test_a_first_snapshot_before_the_load_is_left_out_and_nothing_is_handed_twice() -> None:
    documents = MemoryDocuments()  # no gate: the snapshot comes before the bounded wait ends
    pods = Pods(documents)
    await pods.start()
    try:
        await pods.stored_elsewhere(1, 2)
        pods.ownership = ShardOwnership(pods.runtime, pods.store, drain_timeout_seconds=1.0)
        await pods.gain()
        await pods.runtime.loaded()
        await pods.stored_elsewhere(3)  # a later change: handed over
        await pods.deliver_in_order(through=3)
        assert pods.delivered == [1, 2, 3]
        assert pods.ownership.inbox_messages == 1
        assert pods.counts()["duplicates"] == 0
    finally:
        await pods.stop()


class FailingInbox:
    """The store's inbox, with each Listen's ``on_error`` kept so that the test can fail it."""

    def __init__(self, store: DocumentStore) -> None:
        self._store = store
        self.listens: list[tuple[InboxListening, Callable[[StoreError], None]]] = []

    def listen_inbox(
        self,
        subscription: str,
        shard: int,
        on_messages: Callable[[list[Message]], None],
        on_error: Callable[[StoreError], None],
        *,
        skip_initial: bool = False,
        on_initial: Callable[[], None] | None = None,
    ) -> InboxListening:
        listening = self._store.listen_inbox(
            subscription, shard, on_messages, on_error, skip_initial=skip_initial, on_initial=on_initial
        )
        self.listens.append((listening, on_error))
        return listening


async def test_a_failed_listen_is_closed_and_its_successor_hands_over_what_came_in_between() -> None:
    documents = MemoryDocuments()
    pods = Pods(documents)
    inbox = FailingInbox(pods.store)
    pods.ownership = ShardOwnership(pods.runtime, inbox, drain_timeout_seconds=1.0)
    await pods.start()
    try:
        await pods.stored_elsewhere(1)
        await pods.gain()
        await pods.runtime.loaded()
        (failed, fail), *_ = inbox.listens
        fail(docs.Unavailable("a chunk read failed"))  # as ``listen_inbox`` reports a failed read
        # Committed while no Listen runs: the failed one is closed before it could see it.
        await pods.stored_elsewhere(2)
        await wait_until(lambda: failed.closed, "the failed Listen to be closed")
        await wait_until(lambda: len(inbox.listens) == 2, "the Listen to start again")
        await pods.deliver_in_order(through=2)
        assert pods.delivered == [1, 2]
        assert pods.ownership.listen_failures == 1
        fail(docs.Unavailable("late report of the closed Listen"))  # ignored: it is not the running one
        assert pods.ownership.listen_failures == 1 and len(inbox.listens) == 2
    finally:
        await pods.stop()


async def test_one_corrupt_document_leaves_the_rest_of_its_snapshot_handed_over() -> None:
    documents = MemoryDocuments()
    pods = Pods(documents)
    await pods.stored_elsewhere(1, 2)
    (bad,) = [path for path, fields in documents.docs.items() if fields.get("seq") == 2]
    del documents.docs[bad]["key"]  # edited by hand: refused, named in the log
    got: list[Message] = []
    arrived = asyncio.Event()

    def on_messages(messages: list[Message]) -> None:
        got.extend(messages)
        arrived.set()

    listening = pods.store.listen_inbox(SUB, SHARD, on_messages, lambda error: None)
    try:
        await asyncio.wait_for(arrived.wait(), WAIT_SECONDS)
        assert [m.sequence for m in got] == [1]
    finally:
        await listening.close()


async def test_a_late_first_snapshot_on_the_firestore_emulator_is_handed_over(emulator: Any) -> None:
    import uuid

    documents = FirestoreDocuments(f"late-{uuid.uuid4().hex[:12]}")
    opened = asyncio.Event()
    open_stream = documents._listen_stream

    async def late_stream(requests: AsyncIterator[Any]) -> Any:
        await opened.wait()  # the stream opens, and the server reads the first snapshot, only now
        return await open_stream(requests)

    documents._listen_stream = late_stream  # type: ignore[method-assign]
    pods = Pods(documents)
    await pods.start()
    try:
        await pods.stored_elsewhere(1)
        await pods.gain()
        await pods.runtime.loaded()
        await pods.stored_elsewhere(2, 3)
        opened.set()
        await pods.deliver_in_order(through=3)
        assert pods.delivered == [1, 2, 3]
    finally:
        await pods.stop()
        await documents.close()


@pytest.mark.parametrize("skip_initial", [False, True])
async def test_on_initial_comes_after_the_first_snapshot_is_handed_over_or_left_out(skip_initial: bool) -> None:
    documents = MemoryDocuments()
    pods = Pods(documents)
    await pods.stored_elsewhere(1)
    seen: list[str] = []
    done = asyncio.Event()

    def on_initial() -> None:
        seen.append("initial")
        done.set()

    listening = pods.store.listen_inbox(
        SUB,
        SHARD,
        lambda messages: seen.extend(f"{KEY}/{m.sequence}" for m in messages),
        lambda error: None,
        skip_initial=skip_initial,
        on_initial=on_initial,
    )
    try:
        await asyncio.wait_for(done.wait(), WAIT_SECONDS)
        assert seen == (["initial"] if skip_initial else [f"{KEY}/1", "initial"])
    finally:
        await listening.close()
