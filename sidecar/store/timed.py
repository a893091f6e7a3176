"""A Store wrapper that times ``persist`` for the persist-latency histogram; everything else passes through."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

from sidecar.engine.types import AckIntent, EngineSnapshot, KeyCursor, Message
from sidecar.store.api import IncomingMessage, PayloadBudget, PersistResult, ShardLost, Store


class TimedStore:
    """Implements ``Store`` over another store, reporting each ``persist`` call's duration."""

    def __init__(self, inner: Store, observe: Callable[[str, float], None]) -> None:
        self._inner = inner
        self._observe = observe
        """Called with (subscription, seconds) after every persist call, failed ones included."""

    async def persist(self, subscription: str, batch: Sequence[IncomingMessage], now_ms: int) -> list[PersistResult]:
        started = time.perf_counter()
        try:
            return await self._inner.persist(subscription, batch, now_ms)
        finally:
            self._observe(subscription, time.perf_counter() - started)

    async def commit_acks(
        self, subscription: str, acks: Sequence[AckIntent], now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> None:
        await self._inner.commit_acks(subscription, acks, now_ms, epochs=epochs)

    async def mark_done(
        self,
        subscription: str,
        messages: Sequence[Message],
        state: str,
        now_ms: int,
        *,
        epochs: Mapping[int, int] | None = None,
    ) -> None:
        await self._inner.mark_done(subscription, messages, state, now_ms, epochs=epochs)

    async def unblock(
        self, subscription: str, key: str, now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> object | None:
        return await self._inner.unblock(subscription, key, now_ms, epochs=epochs)

    async def skip_gap(
        self,
        subscription: str,
        key: str,
        first: int,
        through: int,
        now_ms: int,
        *,
        epochs: Mapping[int, int] | None = None,
    ) -> bool:
        return await self._inner.skip_gap(subscription, key, first, through, now_ms, epochs=epochs)

    async def load(
        self,
        subscription: str,
        now_ms: int,
        progress: Callable[[int], None] | None = None,
        max_payload_bytes: int | PayloadBudget | None = None,
        shards: frozenset[int] | None = None,
        *,
        pending: bool = True,
        epoch: int | None = None,
    ) -> EngineSnapshot:
        return await self._inner.load(
            subscription, now_ms, progress, max_payload_bytes, shards, pending=pending, epoch=epoch
        )

    def pending_pages(
        self,
        subscription: str,
        shards: frozenset[int] | None,
        max_payload_bytes: int | PayloadBudget | None,
        progress: Callable[[int], None] | None,
    ) -> AsyncGenerator[list[Message], None]:
        return self._inner.pending_pages(subscription, shards, max_payload_bytes, progress)

    def cursor(self, subscription: str, key: str) -> KeyCursor | None:
        return self._inner.cursor(subscription, key)

    async def flush(self, subscription: str, shards: frozenset[int] | None = None) -> None:
        await self._inner.flush(subscription, shards)

    def watch_losses(self, subscription: str, callback: Callable[[ShardLost], None]) -> None:
        self._inner.watch_losses(subscription, callback)

    def release(self, subscription: str, shards: frozenset[int]) -> None:
        self._inner.release(subscription, shards)

    async def read_payloads(self, subscription: str, messages: Sequence[Message], now_ms: int) -> list[Message]:
        return await self._inner.read_payloads(subscription, messages, now_ms)

    async def close(self) -> None:
        await self._inner.close()
