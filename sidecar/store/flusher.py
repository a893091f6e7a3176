"""The background checkpoint flush of a ``DocumentStore``: writes the cursors and checkpoints left lagging.

Acks write their keys' cursors in their own Commits when those are due; what is left dirty (a
cursor changed within the coalescing interval, a shard whose checkpoint is stale after a load,
fast-path acks waiting for their shard's next checkpoint) is written here, by one task per store.

Rules:

- **Woken, not polling.** ``wake(sub)`` starts the task if it is not running and wakes it, only
  when ``sub`` has something to write (a dirty cursor, a stale shard, an ack waiting); the task
  sleeps until the first shard is due (``ShardWriter.next_due_ms``), or an interval when none is.
- **A part of the shards at a time** (``_FLUSH_ROUNDS``): each round writes the due checkpoints of
  at most 1/``_FLUSH_ROUNDS`` of a subscription's shards, under the subscription's lock, the ones
  written longest ago first; each shard is still written at most once per interval.
- **A failure is retried soon, then less often**: after a ``StoreError`` the next try waits a
  capped exponential backoff with jitter (``sidecar.backoff``), from 50 ms up to the interval.
- **A lost shard is dropped, never retried**: its updates are the new owner's; the subscription's
  loss watcher (``watch_losses``) is told, and the runtime tells the lease manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from sidecar.backoff import backoff_seconds
from sidecar.store.api import ShardLost, StoreError
from sidecar.store.fencing import ShardWriter, Subscription

_LOGGER = logging.getLogger(__name__)

_FLUSH_ROUNDS = 4
"""The background flush writes the due checkpoints of at most 1/``_FLUSH_ROUNDS`` of a
subscription's shards at a time, and the next such part ``interval / _FLUSH_ROUNDS`` later: the
shards' checkpoints fall into that many phases of the interval instead of one. All at once, one
flush built every shard's checkpoint and settled every fast-path ack of the interval in one step
of the event loop (and one Commit), a pause of 10-20 ms each interval that every message arriving
meanwhile waited out. Each shard is still written at most once per interval; acks wait as long on
average once the phases are set (in the first interval, up to three quarters of it longer)."""


class CheckpointFlusher:
    """The background flush task of one store, over its subscriptions and its ``ShardWriter``."""

    def __init__(
        self,
        subscriptions: Mapping[str, Subscription],
        writer: ShardWriter,
        interval_ms: int,
        clock_ms: Callable[[], int],
        *,
        enabled: bool = True,
    ) -> None:
        self._subscriptions = subscriptions
        self._writer = writer
        self._interval_ms = interval_ms
        self._clock_ms = clock_ms
        self._enabled = enabled
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loss_watchers: dict[str, Callable[[ShardLost], None]] = {}
        """Per subscription: told of shards the background flush found lost (``watch_losses``)."""

    def watch_losses(self, subscription: str, callback: Callable[[ShardLost], None]) -> None:
        self._loss_watchers[subscription] = callback

    def wake(self, sub: Subscription) -> None:
        """Start (if need be) and wake the task when ``sub`` has something to write."""
        if not self._enabled or not (sub.book.has_dirty() or sub.stale or any(sub.waiters.values())):
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="store-cursor-flush")
        self._wake.set()

    async def stop(self) -> None:
        """Cancel the task and wait for it to end; idempotent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        """Writes the checkpoints (and cursors) left lagging, each as soon as it is due, a part of
        the shards at a time (``_FLUSH_ROUNDS``)."""
        failures = 0
        paced_until_ms = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Acks waiting for a checkpoint: until the first is due (each shard's at most once per
            # interval). Otherwise an interval: cursors of stored messages are already durable.
            now_ms = self._clock_ms()
            due = [self._writer.next_due_ms(sub, now_ms) for sub in self._subscriptions.values()]
            first = max(paced_until_ms, min((ms for ms in due if ms is not None), default=now_ms + self._interval_ms))
            if failures:
                # The store failed: retried soon (a Commit failing at 10-20% must not cost the acks
                # waiting for it a whole interval per failure), and backing off to an interval.
                first = max(first, now_ms + int(1000 * self._backoff_seconds(failures - 1)))
            await asyncio.sleep(max(0, first - now_ms) / 1000)
            failed = False
            for sub in self._subscriptions.values():
                try:
                    if await self._part(sub):
                        # More shards are due: the next part one round later.
                        paced_until_ms = self._clock_ms() + self._interval_ms // _FLUSH_ROUNDS
                        self._wake.set()
                except ShardLost as exc:
                    # Their updates are dropped (the new owner has the shards), never retried; the
                    # runtime drops them too, and tells the lease manager.
                    _LOGGER.warning("store: cursor flush of %s: %s; their cursor updates are dropped", sub.name, exc)
                    watcher = self._loss_watchers.get(sub.name)
                    if watcher is not None:
                        watcher(exc)
                except StoreError as exc:
                    _LOGGER.warning("store: cursor flush of %s failed, will retry: %s", sub.name, exc)
                    failed = True
                    self._wake.set()
                    continue
                self.wake(sub)
            failures = failures + 1 if failed else 0

    def _backoff_seconds(self, attempt: int) -> float:
        """Before the flush's next try after ``attempt + 1`` failures in a row: capped exponential
        with jitter, from 50 ms up to the checkpoint interval."""
        return backoff_seconds(attempt, min(0.05, self._interval_ms / 1000), self._interval_ms / 1000)

    async def _part(self, sub: Subscription) -> bool:
        """One round of the background flush for ``sub``: the due shards written longest ago, at most
        1/``_FLUSH_ROUNDS`` of its shards. True when more are due. Raises as ``DocumentStore.flush``."""
        per_round = -(-sub.config.shards // _FLUSH_ROUNDS)
        async with sub.lock:
            now_ms = self._clock_ms()
            lost = await self._writer.flush(sub, now_ms, max_shards=per_round)
            more = bool(self._writer.due_shards(sub, now_ms))
        if lost:
            raise ShardLost(sub.name, lost, sub.lost_at(lost))
        return more
