"""The engine's actions other than deliveries, carried out: dead letters, dropped duplicates, holds;
an operator's unblock of a key a dead letter blocks, and an operator's skip of a key's gap.

Rules:

- A dead letter is published (retried with backoff until it succeeds, never dropped, G1), then
  ``store.mark_done(..., "dead_lettered")`` (or ``"dead_lettered_aside"`` for a message outside its
  key's order: late, conflicting, below the cursor), then ``engine.dead_letter_done``. Each dead
  letter is its own task, so a message the topic keeps refusing delays only its own key, never the
  others' dead letters; at most ``_DEAD_LETTER_PUBLISHES`` publish calls run at once, and the number
  waiting (``dead_letters_pending``) counts in the runtime's ``undelivered()``, so ingest pauses
  rather than queueing without bound (``dead_letters_pending`` in GetStatus and metrics shows it).
- A dead letter below the cursor whose record is no longer pending in the store is a stale copy
  (a Listen snapshot older than this pod's own ack of it): nothing is published.
- A duplicate the engine finds is recorded with ``store.mark_done(..., "dropped")`` only when no
  message the engine holds shares its record (``DropDuplicate.finish_record``). Losing that write is
  harmless: an unmarked duplicate is loaded again and dropped again.
- Both writes are fenced by the epoch of the engine that decided them; a write of a shard lost
  meanwhile goes to ``shard_lost`` (the next owner finds the record pending and decides again).
- An unblock is recorded in the store first (a restart keeps it), then the engine delivers the
  key's next messages; one unblock at a time.
- A gap skip is checked by the engine (``Engine.missing_range``), recorded in the store (the key's
  cursor moves past the range, remembered as skipped), then applied by the engine; one operator
  action at a time (the unblock's lock). A missing sequence that arrives while the skip is being
  recorded fills the gap: the engine then delivers it in order, and the store counts it as skipped
  until its ack is durable (``fold_ack`` takes it out); after a restart before that ack it is
  dead-lettered ``late``, never lost (G1) nor delivered after a later one (G2).
- Deliveries come only from the runtime's ``take``: an engine returning one anywhere else is a bug.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sidecar.engine.dead_letters import REASON_BELOW_CURSOR, KeyNotBlocked
from sidecar.engine.gap_skip import KeyNotWaitingOnGap
from sidecar.engine.types import Action, DeadLetter, DropDuplicate, Hold, Message, SkippedRange
from sidecar.pipeline.runtime_context import NotOwner, RuntimeContext, retry_backoff_seconds
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.store.api import DEAD_LETTERED, DEAD_LETTERED_ASIDE, DROPPED, ShardLost, StoreError, StoreRejected

_LOGGER = logging.getLogger(__name__)

_DEAD_LETTER_PUBLISHES = 32
"""Dead-letter publish calls in flight at once: enough to keep a healthy topic busy, few enough
that a burst of dead letters does not flood the publisher client."""


class DeadLetterSink(Protocol):
    """Publishes a message to the subscription's dead-letter topic (``sidecar.dead_letters.publisher``)."""

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        """Return once the dead-letter topic has the message; raise on any failure (it is retried)."""
        ...


@dataclass(frozen=True, slots=True)
class Unblocked:
    """What ``unblock`` passed: the key's blocking dead letter, now skipped durably."""

    key: str
    position: object | None
    """The sequence or ``(timestamp_ms, dedup_id)`` passed; None if the store had no durable block."""
    message_id: str | None
    """The dead-lettered message's Pub/Sub id when this process holds it (not after a restart)."""


class EngineActions:
    """Carries out what the engines decided besides deliveries, each in the order the rules say."""

    def __init__(self, ctx: RuntimeContext, dead_letters: DeadLetterSink) -> None:
        self._ctx = ctx
        self._dead_letters = dead_letters
        self._dead_letter_queue: asyncio.Queue[tuple[ShardEngine, DeadLetter]] = asyncio.Queue()
        self._dead_letters_pending = 0
        self._dead_letter_slots = asyncio.Semaphore(_DEAD_LETTER_PUBLISHES)
        self._drops: list[tuple[ShardEngine, Message]] = []
        self._drops_wake = asyncio.Event()
        self._unblock_lock = asyncio.Lock()

    @property
    def dead_letters_pending(self) -> int:
        """Dead letters waiting to be published or recorded."""
        return self._dead_letters_pending

    def apply(self, entry: ShardEngine, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, DeadLetter):
                self._dead_letters_pending += 1
                self._dead_letter_queue.put_nowait((entry, action))
            elif isinstance(action, DropDuplicate):
                if action.finish_record:
                    self._drops.append((entry, action.message))
                    self._drops_wake.set()
            elif isinstance(action, Hold):
                _LOGGER.debug("subscription %s holds %s: %s", self._ctx.name, action.message.dedup_id, action.reason)
            else:
                # Deliveries come only from take(): one here would be in flight with no stream.
                raise RuntimeError(f"engine returned {type(action).__name__} outside take(): {action!r}")

    async def run_dead_letters(self) -> None:
        """Each queued dead letter in a task of its own; returns only by cancellation."""
        async with asyncio.TaskGroup() as group:
            while True:
                entry, action = await self._dead_letter_queue.get()
                group.create_task(self._dead_letter_one(entry, action), name=f"dead-letter:{self._ctx.name}")

    async def _dead_letter_one(self, entry: ShardEngine, action: DeadLetter) -> None:
        ctx = self._ctx
        try:
            if action.reason == REASON_BELOW_CURSOR and await self._finished_elsewhere(action.message):
                # A stale copy (a Listen snapshot older than this pod's own ack of it): nothing to do.
                _LOGGER.info("subscription %s: %s was already finished", ctx.name, action.message.dedup_id)
            else:
                await self._publish_dead_letter(action)
                state = DEAD_LETTERED if action.in_order else DEAD_LETTERED_ASIDE
                try:
                    await ctx.retry_store(
                        ctx.store.mark_done, [action.message], state, epochs=ctx.fenced({entry.shard: entry.epoch})
                    )
                except ShardLost as exc:
                    # The topic has it; the next owner loads it pending and may dead-letter it again.
                    ctx.shard_lost(exc)
                except StoreError:
                    # The topic has it (G1 holds); unmarked, it is loaded and dead-lettered again after a restart.
                    _LOGGER.exception(
                        "subscription %s: could not record dead letter %s", ctx.name, action.message.dedup_id
                    )
        finally:
            self._dead_letters_pending -= 1
        if ctx.current(entry):
            self.apply(entry, entry.engine.dead_letter_done(action.message, ctx.clock()))
            if action.message.volatile:
                ctx.settle(entry, action.message, True)  # the topic has it, and its record says so
        ctx.after_change()

    async def _finished_elsewhere(self, message: Message) -> bool:
        """Whether ``message``'s record is no longer pending in the store (read back to check)."""
        if message.payload is None or not message.payload.ref:
            return False
        try:
            await self._ctx.retry_store(self._ctx.store.read_payloads, [message])
        except StoreRejected:
            return True
        return False

    async def _publish_dead_letter(self, action: DeadLetter) -> None:
        attempt = 0
        while True:
            try:
                async with self._dead_letter_slots:
                    await self._dead_letters.publish(self._ctx.name, action.message, action.reason, action.attempts)
                return
            except Exception:
                self._ctx.counters.dead_letter_publish_failures += 1
                _LOGGER.warning(
                    "subscription %s: dead-letter publish of %s failed (attempt %d); retrying",
                    self._ctx.name,
                    action.message.dedup_id,
                    attempt + 1,
                    exc_info=True,
                )
            await asyncio.sleep(retry_backoff_seconds(attempt))
            attempt += 1

    async def run_drops(self) -> None:
        """Records the dropped duplicates in batches; returns only by cancellation."""
        ctx = self._ctx
        while True:
            await self._drops_wake.wait()
            self._drops_wake.clear()
            while self._drops:
                batch, self._drops = self._drops, []
                current = [(entry, message) for entry, message in batch if ctx.current(entry)]
                if not current:
                    continue
                messages = [message for _, message in current]
                epochs = {entry.shard: entry.epoch for entry, _ in current}
                try:
                    await ctx.retry_store(ctx.store.mark_done, messages, DROPPED, epochs=ctx.fenced(epochs))
                except ShardLost as exc:
                    ctx.shard_lost(exc)  # the next owner finds them pending and drops them again
                except StoreError:
                    # Harmless: an unmarked duplicate is loaded again and dropped again by the engine.
                    _LOGGER.exception(
                        "subscription %s: could not record %d dropped duplicates", ctx.name, len(messages)
                    )

    async def unblock(self, key: str) -> Unblocked:
        """An operator skips the dead letter that blocks ``key``: recorded in the store first (a
        restart keeps it), then the engine delivers the key's next messages. Raises KeyNotBlocked
        when the key is not blocked, NotOwner when another pod delivers it, StoreError when the
        store cannot record it (nothing changed)."""
        ctx = self._ctx
        ctx.require_recovered()
        async with self._unblock_lock:  # one at a time: the second of two sees the key running
            entry = self._owned(key)
            if not entry.engine.is_blocked(key):
                raise KeyNotBlocked(f"key {key!r} of subscription {ctx.name!r} is not blocked by a dead letter")
            try:
                position = await ctx.store.unblock(
                    ctx.name, key, ctx.clock(), epochs=ctx.fenced({entry.shard: entry.epoch})
                )
            except ShardLost as exc:
                ctx.shard_lost(exc)
                raise
            if not ctx.current(entry):
                raise NotOwner(f"key {key!r} of subscription {ctx.name!r}: its shard was handed over meanwhile")
            message, actions = entry.engine.unblock(key, position, ctx.clock())
            self.apply(entry, actions)
        _LOGGER.warning(
            "subscription %s: key unblocked by an operator; its dead letter at %s is skipped",
            ctx.name,
            position,
            extra={"subscription": ctx.name, "key": key, "message_id": message.message_id if message else None},
        )
        ctx.after_change()
        return Unblocked(key, position, message.message_id if message is not None else None)

    async def skip_gap(self, key: str, through: int) -> SkippedRange:
        """An operator skips the missing sequences ``key`` waits on, up to ``through``: recorded in the
        store first (a restart keeps it), then the engine releases what follows. Raises
        KeyNotWaitingOnGap or SkipOutOfRange (nothing changed), NotOwner when another pod delivers
        the key, StoreError when the store cannot record it (nothing changed)."""
        ctx = self._ctx
        ctx.require_recovered()
        async with self._unblock_lock:  # one operator action at a time
            entry = self._owned(key)
            skipped = entry.engine.missing_range(key, through)
            try:
                recorded = await ctx.store.skip_gap(
                    ctx.name,
                    key,
                    skipped.first,
                    skipped.last,
                    ctx.clock(),
                    epochs=ctx.fenced({entry.shard: entry.epoch}),
                )
            except ShardLost as exc:
                ctx.shard_lost(exc)
                raise
            if not recorded:
                raise KeyNotWaitingOnGap(
                    f"key {key!r} of subscription {ctx.name!r} waits on sequence {skipped.first}, but the store's "
                    "cursor is not there yet (an ack is still being recorded): retry"
                )
            if not ctx.current(entry):
                raise NotOwner(f"key {key!r} of subscription {ctx.name!r}: its shard was handed over meanwhile")
            try:
                entry.engine.skip_gap(key, through, ctx.clock())
            except (KeyNotWaitingOnGap, ValueError):
                # The gap filled while the store recorded the skip (module docstring): kept as recorded.
                _LOGGER.warning(
                    "subscription %s: a missing sequence of the key arrived while its gap skip was recorded",
                    ctx.name,
                    extra={"subscription": ctx.name, "key": key},
                )
        _LOGGER.warning(
            "subscription %s: gap skipped by an operator: sequences %d to %d",
            ctx.name,
            skipped.first,
            skipped.last,
            extra={"subscription": ctx.name, "key": key},
        )
        ctx.after_change()
        return skipped

    def _owned(self, key: str) -> ShardEngine:
        entry = self._ctx.engines.for_key(key)
        if entry is None:
            ctx = self._ctx
            raise NotOwner(
                f"key {key!r} of subscription {ctx.name!r} is delivered by another pod "
                f"(shard {ctx.engines.route(key)} is not owned here); ask that pod"
            )
        return entry
