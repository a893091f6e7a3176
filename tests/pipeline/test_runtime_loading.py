"""SubscriptionRuntime recovering by pages (``_load_pending``): keys deliver while the rest is read.

The store is a ``MemoryStore`` whose page reads wait on a gate the test opens, so each test
chooses exactly what has been read when it takes, acks, or lets time pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import pytest
from delivery_harness import RecordingDeadLetters, sequence_config, wait_until
from delivery_harness import incoming_message as sequence_message

from sidecar.engine import EngineConfig
from sidecar.engine.types import Message
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.pipeline.runtime_context import SubscriptionUnavailable
from sidecar.store.api import PayloadBudget, PersistOutcome, StoreRejected
from sidecar.store.memory import MemoryStore

SUB = "orders"


class GatedPages(MemoryStore):
    """Every page after the first waits for ``next_page`` (set by the test, cleared on use)."""

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size=page_size)
        self.next_page = asyncio.Event()
        self.pages_read = 0

    async def pending_pages(
        self,
        subscription: str,
        shards: frozenset[int] | None,
        max_payload_bytes: int | PayloadBudget | None,
        progress: Callable[[int], None] | None,
    ) -> AsyncGenerator[list[Message], None]:
        async for page in super().pending_pages(subscription, shards, max_payload_bytes, progress):
            if self.pages_read:
                await self.next_page.wait()
                self.next_page.clear()
            self.pages_read += 1
            yield page


async def _fill(store: MemoryStore, items: list[tuple[str, int]]) -> None:
    results = await store.persist(SUB, [sequence_message(key, seq) for key, seq in items], 0)
    assert all(r.outcome is PersistOutcome.STORED for r in results)


class _Clock:
    def __init__(self) -> None:
        self.ms = 1_000

    def __call__(self) -> int:
        return self.ms


async def _recovered(store: MemoryStore, config: EngineConfig, clock: _Clock) -> SubscriptionRuntime:
    runtime = SubscriptionRuntime(SUB, config, store, RecordingDeadLetters(), clock=clock, id_prefix="t-")
    await runtime.recover()
    await runtime.start()
    return runtime


def _taken(runtime: SubscriptionRuntime) -> list[tuple[str, int | None]]:
    return [(d.message.key, d.message.sequence) for d in runtime.take("c", 100)]


async def test_a_key_delivers_its_restored_head_and_a_gap_on_an_unread_page_is_never_skipped() -> None:
    store = GatedPages(page_size=2)
    # Stored order puts b/2 and a/1 on the first page, b/1 on the second.
    await _fill(store, [("b", 2), ("a", 1), ("b", 1)])
    clock = _Clock()
    runtime = await _recovered(store, sequence_config(gap_timeout_ms=0, on_gap_timeout="skip"), clock)
    try:
        assert runtime.is_ready and runtime.loading_shards == 1
        await wait_until(lambda: store.pages_read == 1, "the first page")
        assert _taken(runtime) == [("a", 1)]  # b/2 waits: b/1 may be (and is) on a later page
        clock.ms += 60_000
        await asyncio.sleep(0.05)  # the timer task runs what is due: no gap timer while loading
        assert _taken(runtime) == []
        assert runtime.status()[0].counts["gap_timeouts"] == 0

        store.next_page.set()
        await runtime.loaded()
        assert runtime.loading_shards == 0
        assert _taken(runtime) == [("b", 1)]
        assert runtime.status()[0].counts["skipped"] == 0
    finally:
        await runtime.stop(0)


async def test_a_record_stored_while_loading_reaches_the_engine_once() -> None:
    store = GatedPages(page_size=1)
    await _fill(store, [("a", 1), ("a", 2)])
    runtime = await _recovered(store, sequence_config(), _Clock())
    try:
        await wait_until(lambda: store.pages_read == 1, "the first page")
        # Ingest hands over a/2 (a redelivery read back pending) before its page is read.
        (a2,) = [r.message for r in await store.persist(SUB, [sequence_message("a", 2)], 0) if r.message]
        runtime.on_stored([a2])
        store.next_page.set()
        await runtime.loaded()
        for expected in (1, 2):
            (delivery,) = runtime.take("c", 10)
            assert (delivery.message.key, delivery.message.sequence) == ("a", expected)
            await runtime.ack("c", [delivery.delivery_id])
        counts = runtime.status()[0].counts
        assert counts["duplicates"] == 0, counts  # not dropped as a copy of itself
        assert store.state_of(SUB, a2) == "acked"
    finally:
        await runtime.stop(0)


async def test_messages_stored_while_loading_wait_for_the_end_of_the_load() -> None:
    store = GatedPages(page_size=1)
    await _fill(store, [("a", 1), ("b", 1)])
    runtime = await _recovered(store, sequence_config(), _Clock())
    try:
        await wait_until(lambda: store.pages_read == 1, "the first page")
        results = await store.persist(SUB, [sequence_message("a", 2)], 0)
        runtime.on_stored([r.message for r in results if r.message is not None])
        first = runtime.take("c", 10)
        assert [(d.message.key, d.message.sequence) for d in first] == [("a", 1)]
        await runtime.ack("c", [first[0].delivery_id])
        assert runtime.take("c", 10) == []  # a/2 was stored during the load: it waits for its end
        assert not runtime.take_fast([sequence_message("a", 2)])[0]  # nor does the fast path take it
        store.next_page.set()
        await runtime.loaded()
        assert sorted(_taken(runtime)) == [("a", 2), ("b", 1)]
    finally:
        await runtime.stop(0)


async def test_a_shard_dropped_while_loading_restores_nothing_more() -> None:
    store = GatedPages(page_size=1)
    await _fill(store, [("a", 1), ("a", 2), ("a", 3)])
    runtime = SubscriptionRuntime(SUB, sequence_config(), store, RecordingDeadLetters(), shard_count=1)
    await runtime.recover()
    await runtime.start()
    try:
        await runtime.adopt_shard(0, 1)
        await wait_until(lambda: store.pages_read == 1, "the first page")
        assert runtime.drop_shard(0, 1)
        store.next_page.set()
        await runtime.loaded()
        assert runtime.failure is None and runtime.shards() == {}
        assert store.pages_read == 1
    finally:
        await runtime.stop(0)


async def test_a_corrupt_page_fails_the_subscription_loudly() -> None:
    store = MemoryStore(page_size=1)
    await _fill(store, [("a", 1), ("a", 2)])
    store.fail_next("pending_pages", 1, error=StoreRejected("message document x: no seq"))
    runtime = await _recovered(store, sequence_config(), _Clock())
    try:
        with pytest.raises(SubscriptionUnavailable, match="failed"):
            await runtime.loaded()
        assert isinstance(runtime.failure, StoreRejected)
        assert not runtime.is_ready and not runtime.is_live()
    finally:
        await runtime.stop(0)
