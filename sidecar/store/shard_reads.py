"""What a load reads of a subscription's shards, and the recovered state it makes of it.

``DocumentStore.load`` takes a load slot, calls ``read_shards``, then restores its cursor book
from the result under the subscription's lock. This module is the reading part.

Rules:

- **Reads only, and no lock.** The reads are most of a load: other shards' acks and flushes must
  not wait for them. Nothing of this pod writes to the shards read meanwhile (the caller's
  contract: with fences, a shard being taken is not held yet, so its writes are refused). The one
  write is the subscription document, created on first use (create-if-absent: a process that lost
  the race reads the other's).
- **Four reads at once**: the subscription document with the shards' checkpoints, the recent
  tombstones, the cursor documents and the pending messages; only the tombstones' range waits for
  the checkpoints (it starts at their oldest ``clean_ms``). One range per shard
  (``layout.DONE_AT``): no index hotspot, and only this load's shards. A failed read cancels the
  others.
- **Every decision is recovery's** (``recovery.recover``, pure): this module only gathers.
- **A refused document stops the load**: ``StoreRejected`` naming the subscription and the
  document (``stopped``), never a guess.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sidecar.engine.types import Message
from sidecar.store import documents as docs
from sidecar.store import layout, recovery
from sidecar.store.api import PayloadBudget, StoreRejected
from sidecar.store.cursors import rules_of
from sidecar.store.fencing import Subscription
from sidecar.store.reader import Progress, Reader

_A = TypeVar("_A")
_B = TypeVar("_B")


@dataclass(frozen=True, slots=True)
class ShardsRead:
    """What ``read_shards`` found: per shard its checkpoint (``clean_ms``; None when never
    written), the time recovery folded tombstones from, and the recovered states and snapshot."""

    checkpoints: dict[int, int | None]
    since_ms: int
    recovered: recovery.Recovered


async def _then(first: Awaitable[_A], then: Callable[[_A], Awaitable[_B]]) -> _B:
    """``then(await first)``: a read that needs another's answer, as one awaitable."""
    return await then(await first)


async def _nothing() -> list[Message]:
    """What ``load(pending=False)`` reads of pending messages."""
    return []


def stopped(sub: Subscription, exc: Exception) -> StoreRejected:
    """A load or a pending page refused a document: one line naming the subscription and the document."""
    return StoreRejected(f"recovery of subscription {sub.name!r} stopped at {sub.path}: {exc}")


def running_total(progress: Progress | None) -> Progress:
    """A callback taking each read's document count, passing ``progress`` the total so far."""
    total = 0

    def count(n: int) -> None:
        nonlocal total
        total += n
        if progress is not None:
            progress(total)

    return count


async def read_checkpoints(
    documents: docs.Documents, sub: Subscription, shards: frozenset[int], now_ms: int
) -> tuple[dict[int, int | None], list[tuple[str, dict[str, Any]]]]:
    """Check the subscription document (create it on first use); the checkpoints of ``shards``
    (``clean_ms`` per shard) and the cursors their overlays hold (key document id, fields)."""
    paths = {shard: layout.checkpoint_path(sub.path, shard) for shard in sorted(shards)}
    found = await documents.get_all([sub.path, *paths.values()])
    fields = found.get(sub.path)
    overlays = [entry for path in paths.values() for entry in recovery.overlay_of(path, found.get(path))]
    if fields is None:
        created = {"name": sub.name, "mode": sub.config.mode, "created_ms": now_ms, "v": layout.LAYOUT_VERSION}
        try:
            await documents.commit([docs.create(sub.path, created)])
        except docs.AlreadyExists:
            return await read_checkpoints(documents, sub, shards, now_ms)  # another process created it meanwhile
        # A new subscription: nothing of it exists, every shard is clean now.
        stored = {shard: recovery.checkpoint_of(path, found.get(path)) for shard, path in paths.items()}
        return {shard: now_ms if clean is None else clean for shard, clean in stored.items()}, overlays
    recovery.check_subscription(sub.name, sub.config.mode, sub.path, fields)
    return {shard: recovery.checkpoint_of(path, found.get(path)) for shard, path in paths.items()}, overlays


async def read_shards(
    documents: docs.Documents,
    reader: Reader,
    sub: Subscription,
    shards: frozenset[int] | None,
    now_ms: int,
    budget: PayloadBudget | None,
    count: Progress,
    *,
    pending: bool,
) -> ShardsRead:
    """Read ``shards`` (None: all) of ``sub`` and recover them; ``pending=False`` reads all but the
    pending messages. Raises ``StoreRejected`` (``stopped``) on a refused document."""
    wanted = frozenset(range(sub.config.shards)) if shards is None else shards

    async def recent(checkpoints: dict[int, int | None]) -> list[tuple[str, dict[str, Any]]]:
        since = recovery.since_ms(checkpoints.values())
        ranges = []
        for shard in sorted(wanted):
            # One range per shard (``layout.DONE_AT``): no index hotspot, and only this load's shards.
            low, high = layout.done_at_range(shard, since)
            where = [
                docs.Filter(layout.DONE_AT, "GREATER_THAN_OR_EQUAL", low),
                docs.Filter(layout.DONE_AT, "LESS_THAN", high),
            ]
            ranges.append(reader.query_all(sub.path, "messages", where, layout.DONE_AT, count))
        return [found for part in await asyncio.gather(*ranges) for found in part]

    # The three reads go at once; the tombstones' range needs the checkpoints first.
    try:
        checkpoints_read = asyncio.ensure_future(read_checkpoints(documents, sub, wanted, now_ms))
        tombstones = asyncio.ensure_future(_then(checkpoints_read, lambda found: recent(found[0])))
        cursor_reads = asyncio.ensure_future(reader.query_shards(sub.path, "keys", shards, count))
        pending_reads = asyncio.ensure_future(
            reader.load_pending(sub.path, budget, count, shards) if pending else _nothing()
        )
        reads = asyncio.gather(checkpoints_read, tombstones, cursor_reads, pending_reads)
        try:
            (checkpoints, overlays), recent_docs, cursor_docs, pending_read = await reads
        except BaseException:
            reads.cancel()
            for read in (checkpoints_read, tombstones, cursor_reads, pending_reads):
                read.cancel()
            raise
        since = recovery.since_ms(checkpoints.values())
        recovered = recovery.recover(
            rules_of(sub.config), cursor_docs, recent_docs, pending_read, since, shards, overlays=overlays
        )
        del cursor_docs, recent_docs, pending_read  # the snapshot holds what is needed of them
    except (recovery.ModeMismatch, layout.CorruptDocument) as exc:
        raise stopped(sub, exc) from exc
    return ShardsRead(checkpoints, since, recovered)
