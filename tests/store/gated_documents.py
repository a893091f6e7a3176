"""``MemoryDocuments`` whose shard queries wait at a gate, and the helpers the shard-load tests share:
keys picked per shard, a wait on what the gates see with a deadline (never a bare sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.memory_documents import MemoryDocuments

DEADLINE_SECONDS = 10.0


class GatedDocuments(MemoryDocuments):
    """MemoryDocuments whose queries of gated shards wait until their gate opens; records which
    shards have a query waiting, so a test can see two loads reading at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[int, asyncio.Event] = {}
        self.waiting: dict[int, int] = {}
        self.changed = asyncio.Event()

    async def query(
        self,
        parent: str,
        collection: str,
        where: docs.Filter | Sequence[docs.Filter] | None,
        order_by: str | None,
        after: object | None,
        limit: int,
    ) -> docs.Page:
        shard = shard_queried(docs.filters_of(where))
        gate = self.gates.get(shard) if shard is not None else None
        if gate is not None and shard is not None:
            self.waiting[shard] = self.waiting.get(shard, 0) + 1
            self.changed.set()
            try:
                await gate.wait()
            finally:
                self.waiting[shard] -= 1
        return await super().query(parent, collection, where, order_by, after, limit)


def shard_queried(filters: list[docs.Filter]) -> int | None:
    """The shard a load's query reads: ``shard == X``, or X's ``done_at`` range."""
    for condition in filters:
        if condition.field == layout.SHARD:
            return int(condition.value)
        if condition.field == layout.DONE_AT:
            return int(str(condition.value)[:4])
    return None


async def until(documents: GatedDocuments, predicate: Callable[[], bool], what: str) -> None:
    """Wait until ``predicate()`` holds, woken by each gated query; fails the test past the deadline."""

    async def wait() -> None:
        while not predicate():
            documents.changed.clear()
            await documents.changed.wait()

    try:
        await asyncio.wait_for(wait(), DEADLINE_SECONDS)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def keys_by_shard(shards: int, per_shard: int) -> dict[int, list[str]]:
    """``per_shard`` keys of each of ``shards`` shards."""
    out: dict[int, list[str]] = {shard: [] for shard in range(shards)}
    for i in range(10_000):
        key = f"k{i}"
        keys = out[shard_of(key, shards)]
        if len(keys) < per_shard:
            keys.append(key)
        if all(len(keys) == per_shard for keys in out.values()):
            return out
    raise AssertionError("not enough keys")
