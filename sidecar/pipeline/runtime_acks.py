"""The ack pipeline: apps' acks group-committed to the store, confirmed only once durable (G3).

Rules:

- An app's ack counts only once ``store.commit_acks`` succeeded: a ticket's ``confirmed`` future
  resolves with the accepted ids only then. Acks from all streams are group-committed: while one
  ``commit_acks`` call runs, new acks queue up and go together in the next call (up to
  ``_MAX_ACKS_PER_COMMIT`` acks a call, or one submission alone when it is larger).
- Acks of fast-path messages (``volatile``: never stored) wait for their shards' next checkpoint
  (up to an interval): they are made durable in a task of their own, so that the batches behind them
  do not wait too. A batch's tickets are answered once each of its parts (stored, fast-path) is
  durable. Once its ack is durable a fast-path message is settled as safe: Pub/Sub may forget it.
- Each ack goes to the store with the epoch its engine accepted it under (``fenced``): one accepted
  by an engine dropped since (the shard lost, even if taken back at a new epoch) is refused, never
  written under the new epoch nor confirmed (G3: its message is delivered again). The store refuses
  an advancing write of a shard this pod no longer owns (``ShardLost``): everything outside the lost
  shards is durable and confirmed, the acks inside are not, and the shards go to ``shard_lost``.
- A transient ``StoreUnavailable`` is retried with backoff, forever. A permanent ``StoreError``
  fails the pipeline loudly (``run()`` raises and the runtime fails): acks that can never be made
  durable must not be confirmed, and a restart redelivers them. The tickets waiting then fail with
  ``SubscriptionUnavailable``; so do the queued ones when the runtime stops (``fail_pending``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sidecar.engine.types import AckIntent, Message
from sidecar.pipeline.runtime_context import RuntimeContext, SubscriptionUnavailable
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.store.api import ShardLost

_MAX_ACKS_PER_COMMIT = 1000
"""Bounds one commit_acks call (the store splits it into Firestore's 500-write commits)."""


@dataclass(frozen=True, slots=True)
class AckResult:
    confirmed: list[str]
    """Delivery ids whose ack is durable: they will never be delivered again (G3)."""
    unknown: list[str]
    """Ids the engine does not know for this consumer (already acked, expired, another stream's)."""


@dataclass(slots=True)
class AckTicket:
    """``submit_ack``'s answer: unknown ids at once, the rest once durable."""

    unknown: list[str]
    confirmed: asyncio.Future[list[str]] | None
    """Resolves with the accepted ids after commit_acks succeeded; None when no id was accepted.
    Fails with ``SubscriptionUnavailable`` if the runtime stops or fails first."""


@dataclass(slots=True)
class _PendingAck:
    intents: list[AckIntent]
    future: asyncio.Future[list[str]]


@dataclass(slots=True)
class _AckBatch:
    """Acks taken together: answered once each of its parts (stored, fast-path) is durable."""

    pending: list[_PendingAck]
    parts: int = 0
    refused: set[str] = field(default_factory=set)
    """Delivery ids whose shard was lost before their ack was durable: never confirmed."""

    @property
    def intents(self) -> list[AckIntent]:
        return [intent for pending in self.pending for intent in pending.intents]


class AckPipeline:
    """Queues the engines' accepted acks and commits them in batches (``run``)."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self._ctx = ctx
        self._pending: list[_PendingAck] = []
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()
        """Set while no ack is queued or being committed."""
        self.idle.set()

    def submit(self, intents: list[AckIntent]) -> asyncio.Future[list[str]]:
        """Queue acks the engines accepted; the future resolves with their ids once durable."""
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._pending.append(_PendingAck(intents=intents, future=future))
        self.idle.clear()
        self._wake.set()
        return future

    def may_hold_acks_of(self, shard: int) -> bool:
        """Whether acks of ``shard`` are queued, or a commit (which may hold some) is under way."""
        route = self._ctx.engines.route
        return (
            any(route(intent.message.key) == shard for pending in self._pending for intent in pending.intents)
            or not self.idle.is_set()
        )

    async def run(self) -> None:
        """Commits acks in batches (group commit). Acks of fast-path messages wait for their shards'
        next checkpoint (up to an interval): they are made durable in a task of their own, so that
        the batches behind them do not wait too."""
        running: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []

        def done(task: asyncio.Task[None]) -> None:
            running.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())  # type: ignore[arg-type]
            self._wake.set()

        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if failures:
                    raise failures[0]
                while self._pending:
                    batch = _AckBatch(self._take_batch())
                    fast = [intent for intent in batch.intents if intent.message.volatile]
                    stored = [intent for intent in batch.intents if not intent.message.volatile]
                    batch.parts = bool(fast) + bool(stored)
                    if fast:
                        task = asyncio.create_task(self._commit_acks(batch, fast), name=f"fast-acks:{self._ctx.name}")
                        running.add(task)
                        task.add_done_callback(done)
                    if stored:
                        await self._commit_acks(batch, stored)
                if not running and not self._pending:
                    self.idle.set()
                    self._ctx.progress.set()
        finally:
            for task in list(running):
                task.cancel()

    async def _commit_acks(self, batch: _AckBatch, intents: list[AckIntent]) -> None:
        """Make ``intents`` (part of ``batch``) durable, tell the engines, settle fast-path messages;
        the batch's tickets are answered once all its parts are done."""
        ctx = self._ctx
        engines = ctx.engines
        lost: frozenset[int] = frozenset()
        # Each ack goes to the store with the epoch its engine accepted it under: one accepted by
        # an engine dropped since (the shard lost, even if taken back at a new epoch) is refused,
        # never written under the new epoch nor confirmed (G3: its message is delivered again).
        epochs: dict[int, int] = {}
        current: list[AckIntent] = []
        for intent in intents:
            entry = engines.for_delivery(intent.delivery_id)
            if entry is None:
                ctx.counters.acks_fenced += 1
                batch.refused.add(intent.delivery_id)
            else:
                epochs[entry.shard] = entry.epoch
                current.append(intent)
        intents = current
        try:
            if intents:
                await ctx.retry_store(ctx.store.commit_acks, intents, epochs=ctx.fenced(epochs))
        except ShardLost as exc:
            # Everything outside ``exc.shards`` is durable; acks inside are not, and never
            # will be by this pod: not confirmed, so the next owner delivers them again.
            lost = frozenset(shard for shard in exc.shards if exc.lost_at(shard, epochs.get(shard, -1)))
            ctx.shard_lost(exc)
        except BaseException as exc:
            error = SubscriptionUnavailable(f"acks of {ctx.name!r} could not be made durable: {exc!r}")
            for pending in batch.pending:
                if not pending.future.done():
                    pending.future.set_exception(error)
            raise
        ctx.counters.ack_commits += 1
        now_ms = ctx.clock()
        durable: dict[int, tuple[ShardEngine, list[str]]] = {}
        settled: list[tuple[ShardEngine, Message]] = []
        for intent in intents:
            if lost and engines.route(intent.message.key) in lost:
                ctx.counters.acks_fenced += 1
                batch.refused.add(intent.delivery_id)
                continue
            entry = engines.for_delivery(intent.delivery_id)
            if entry is not None:
                durable.setdefault(entry.shard, (entry, []))[1].append(intent.delivery_id)
                if intent.message.volatile:
                    settled.append((entry, intent.message))
        for entry, ids in durable.values():
            ctx.apply(entry, entry.engine.ack_durable(ids, now_ms))
        for entry, message in settled:
            ctx.settle(entry, message, True)  # its ack is durable: Pub/Sub may forget it
        batch.parts -= 1
        if batch.parts == 0:
            for pending in batch.pending:
                if not pending.future.done():
                    pending.future.set_result(
                        [intent.delivery_id for intent in pending.intents if intent.delivery_id not in batch.refused]
                    )
        ctx.progress.set()
        ctx.after_change()

    def _take_batch(self) -> list[_PendingAck]:
        batch: list[_PendingAck] = []
        count = 0
        while self._pending and (not batch or count + len(self._pending[0].intents) <= _MAX_ACKS_PER_COMMIT):
            pending = self._pending.pop(0)
            batch.append(pending)
            count += len(pending.intents)
        return batch

    def fail_pending(self, error: Exception) -> None:
        """The runtime stopped or failed: every queued ack's ticket fails with ``error``."""
        pending, self._pending = self._pending, []
        for entry in pending:
            if not entry.future.done():
                entry.future.set_exception(error)
                # Mark retrieved: a stream that already ended will never await it.
                entry.future.exception()
        self.idle.set()
