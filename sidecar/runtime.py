"""One subscription's live state: executes the pure engine's decisions with a store and a clock.

The engine decides (deliver, drop, dead-letter, hold); this module does the I/O those decisions
need and feeds the results back. Rules it keeps:

- Nothing is delivered before ``recover()`` rebuilt the engine from ``store.load``.
- Every engine call happens on the event loop thread, with ``now_ms`` read from ``clock`` here.
- An app ack counts only once ``store.commit_acks`` succeeded: ``ack``/``submit_ack`` resolve with
  the confirmed ids only then (G3). Acks from all streams are group-committed: while one
  ``commit_acks`` call runs, new acks queue up and go together in the next call.
- A transient ``StoreUnavailable`` is retried with capped exponential backoff, forever (Pub/Sub and
  the store keep the messages meanwhile). A permanent ``StoreError`` on ``commit_acks`` or ``load``
  fails the runtime loudly (``run()`` raises, ``failure`` is set): acks that can never be made
  durable must not be confirmed, and a restart redelivers them.
- A dead letter is published (retried with backoff until it succeeds, never dropped, G1), then
  ``store.mark_done(..., "dead_lettered")`` (or ``"dead_lettered_aside"`` for a message outside its
  key's order: late, conflicting, below the cursor), then ``engine.dead_letter_done``. Each dead
  letter is its own task, so a message the topic keeps refusing delays only its own key, never the
  others' dead letters; at most ``_DEAD_LETTER_PUBLISHES`` publish calls run at once, and the number
  waiting counts in ``undelivered()``, so ingest pauses rather than queueing without bound
  (``dead_letters_pending`` in GetStatus and metrics shows it).
- A duplicate the engine finds is recorded with ``store.mark_done(..., "dropped")`` only when no
  message the engine holds shares its record (``DropDuplicate.finish_record``).
- Streams wait for ready messages on an ``asyncio.Event`` they register with ``add_waker``; the
  runtime sets every registered event after a change that leaves messages ready. No polling.
- One timer task calls ``engine.tick`` at ``engine.next_timer_ms()``, woken early when an engine
  call schedules an earlier timer (backoff, ack deadline, gap timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sidecar.engine import Engine, UnknownDelivery
from sidecar.engine.core import HELD_MESSAGE_OVERHEAD_BYTES, KeyNotBlocked, payload_size
from sidecar.engine.types import (
    AckIntent,
    Action,
    DeadLetter,
    Deliver,
    DropDuplicate,
    EngineConfig,
    EngineStatus,
    Hold,
    KeyStatus,
    Message,
)
from sidecar.store.api import DEAD_LETTERED, DEAD_LETTERED_ASIDE, DROPPED, Store, StoreError, StoreUnavailable

_LOGGER = logging.getLogger(__name__)

_T = TypeVar("_T")

_RETRY_INITIAL_SECONDS = 0.05
"""First retry soon: most store blips (a Firestore UNAVAILABLE) clear within tens of milliseconds."""

_RETRY_MAXIMUM_SECONDS = 5.0
"""Cap so that a recovered store is used again within seconds, while an outage costs one call per 5 s."""

_MAX_ACKS_PER_COMMIT = 1000
"""Bounds one commit_acks call (the store splits it into Firestore's 500-write commits)."""

_DEAD_LETTER_PUBLISHES = 32
"""Dead-letter publish calls in flight at once: enough to keep a healthy topic busy, few enough
that a burst of dead letters does not flood the publisher client."""

RECOVERY_STALL_SECONDS = 120.0
"""A recovery that has read nothing new for this long is stuck: liveness reports it, so that
Kubernetes restarts the container instead of waiting on it for ever."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class DeadLetterSink(Protocol):
    """Publishes a message to the subscription's dead-letter topic (``sidecar.deadletter``)."""

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        """Return once the dead-letter topic has the message; raise on any failure (it is retried)."""
        ...


class SubscriptionUnavailable(Exception):
    """The subscription cannot serve now: still recovering, stopping, or failed."""


@dataclass(frozen=True, slots=True)
class Unblocked:
    """What ``unblock`` passed: the key's blocking dead letter, now skipped durably."""

    key: str
    position: object | None
    """The sequence or ``(timestamp_ms, dedup_id)`` passed; None if the store had no durable block."""
    message_id: str | None
    """The dead-lettered message's Pub/Sub id when this process holds it (not after a restart)."""


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
class RuntimeCounters:
    """Cumulative counts of what the runtime itself did (the engine keeps the delivery counts)."""

    acks_submitted: int = 0
    unknown_ids: int = 0
    ack_commits: int = 0
    store_retries: int = 0
    dead_letter_publish_failures: int = 0
    payloads_stripped: int = 0
    """Held messages whose payload was left in the store (over ``max_held_bytes``)."""
    payloads_read: int = 0
    """Stripped payloads read back from the store for delivery."""


class SubscriptionRuntime:
    """Drives one subscription's ``Engine``: recovery, timers, durable acks, dead letters."""

    def __init__(
        self,
        name: str,
        engine_config: EngineConfig,
        store: Store,
        dead_letters: DeadLetterSink,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        id_prefix: str | None = None,
        on_delivered: Callable[[Sequence[Deliver], int], None] | None = None,
        max_held_bytes: int | None = None,
    ) -> None:
        self.name = name
        self._config = engine_config
        self._store = store
        self._dead_letters = dead_letters
        self._clock = clock
        # Delivery ids must not repeat across restarts of the sidecar, so each process gets its own.
        self._id_prefix = id_prefix if id_prefix is not None else f"{secrets.token_hex(4)}-"
        self._on_delivered = on_delivered
        """Observer of every batch ``take`` hands out, with ``now_ms`` (metrics: publish-to-delivery)."""
        self._engine: Engine | None = None
        self._unblock_lock = asyncio.Lock()
        self._max_held_bytes = max_held_bytes
        """Payload bytes kept in memory for stored messages not yet handed out (None: no limit)."""
        self._held_bytes = 0
        self._stopping = False
        self.failure: BaseException | None = None
        self.counters = RuntimeCounters()

        self._wakers: set[asyncio.Event] = set()
        self._timer_wake = asyncio.Event()
        self._timer_due_ms: int | None = None
        self._acks_pending: list[_PendingAck] = []
        self._acks_wake = asyncio.Event()
        self._acks_idle = asyncio.Event()
        self._acks_idle.set()
        self._dead_letter_queue: asyncio.Queue[DeadLetter] = asyncio.Queue()
        self._dead_letters_pending = 0
        self._dead_letter_slots = asyncio.Semaphore(_DEAD_LETTER_PUBLISHES)
        self._recovery_started_ms: int | None = None
        self._recovery_progress_ms: int | None = None
        self.recovered_documents = 0
        """Documents ``load`` has read so far during recovery."""
        self._drops: list[Message] = []
        self._drops_wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def ack_deadline_ms(self) -> int:
        return self._config.ack_deadline_ms

    def now_ms(self) -> int:
        """The runtime's clock: what every engine call is given as ``now_ms``."""
        return self._clock()

    def unavailable_reason(self) -> str:
        """Why ``is_ready`` is False, in words for a client's status message."""
        if self.failure is not None:
            return f"subscription {self.name!r} failed ({self.failure!r}); the sidecar must restart"
        if self._engine is None:
            return f"subscription {self.name!r} is still recovering; retry shortly"
        if self._stopping:
            return f"subscription {self.name!r} is shutting down; reconnect"
        return f"subscription {self.name!r} is ready"

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The background work started by ``start()``: it ends only by ``stop()`` or a failure."""
        return self._task

    @property
    def is_ready(self) -> bool:
        """Recovered, running and not stopping: streams may be served."""
        return self._engine is not None and not self._stopping and self.failure is None

    async def recover(self) -> None:
        """Rebuild the engine from the store. Must complete before anything is delivered."""
        if self._engine is not None:
            raise RuntimeError(f"subscription {self.name!r}: recover() called twice")
        self._recovery_started_ms = self._recovery_progress_ms = self._clock()

        def progress(documents: int) -> None:
            self.recovered_documents = documents
            self._recovery_progress_ms = self._clock()

        snapshot = await self._retry_store(self._store.load, progress=progress, max_payload_bytes=self._max_held_bytes)
        now_ms = self._clock()
        self._engine = Engine.restore(
            self._config,
            snapshot,
            now_ms,
            id_prefix=self._id_prefix,
            cursor_source=functools.partial(self._store.cursor, self.name),
        )
        self._held_bytes = sum(
            payload_size(m.payload) for m in snapshot.pending if m.payload is not None and not m.payload.stripped
        ) + HELD_MESSAGE_OVERHEAD_BYTES * len(snapshot.pending)
        _LOGGER.info(
            "subscription %s recovered: %d pending messages, %d key cursors",
            self.name,
            len(snapshot.pending),
            len(snapshot.cursors),
        )
        self._after_change()

    def is_live(self) -> bool:
        """False when recovery has made no progress for ``RECOVERY_STALL_SECONDS`` (or the runtime failed)."""
        if self.failure is not None:
            return False
        if self._engine is not None or self._recovery_progress_ms is None:
            return True
        return self._clock() - self._recovery_progress_ms < RECOVERY_STALL_SECONDS * 1000

    async def start(self) -> None:
        """Run the background work (timers, ack commits, dead letters) in a task of its own."""
        if self._task is not None:
            raise RuntimeError(f"subscription {self.name!r}: start() called twice")
        self._require_engine()
        self._task = asyncio.create_task(self.run(), name=f"runtime:{self.name}")
        self._task.add_done_callback(self._on_task_done)

    async def run(self) -> None:
        """The background work; returns only by cancellation, raises if a worker fails for good."""
        self._require_engine()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._timer_loop(), name=f"timer:{self.name}")
                group.create_task(self._ack_commit_loop(), name=f"acks:{self.name}")
                group.create_task(self._dead_letter_loop(), name=f"dead-letters:{self.name}")
                group.create_task(self._drop_loop(), name=f"drops:{self.name}")
        except BaseException as exc:
            # Waiting streams must learn that their acks will not be confirmed by this process.
            self._fail_pending_acks(SubscriptionUnavailable(f"subscription {self.name!r} stopped"))
            if not isinstance(exc, asyncio.CancelledError):
                self.failure = _first_cause(exc)
            raise

    async def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop delivering, let queued acks commit for up to ``grace_seconds``, then stop the workers.

        Idempotent. Messages still in flight stay pending in the store and are delivered again
        after a restart (an unconfirmed ack may cause one redelivery, G3).
        """
        self._stopping = True
        for event in self._wakers:
            event.set()  # streams notice is_ready is False and end
        task = self._task
        if task is None or task.done():
            return
        try:
            if not self._acks_idle.is_set():
                await asyncio.wait_for(self._acks_idle.wait(), grace_seconds)
        except TimeoutError:
            _LOGGER.warning("subscription %s: acks not durable within %.1fs of stop", self.name, grace_seconds)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # we ourselves were cancelled
        except Exception:
            pass  # already logged by _on_task_done; stop() must not raise for a failure seen before

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failure = self.failure or _first_cause(exc)
            _LOGGER.critical("subscription %s runtime failed; its streams end", self.name, exc_info=exc)
            for event in self._wakers:
                event.set()

    # ---- events from ingest and the watermark source ---------------------------------------

    def on_stored(self, messages: Sequence[Message]) -> None:
        """Messages the store made durable (PersistOutcome.STORED), in arrival order."""
        engine = self._require_engine()
        now_ms = self._clock()
        budget = self._max_held_bytes
        for message in messages:
            actions = engine.on_stored(message, now_ms)
            payload = message.payload
            if payload is not None and (not actions or isinstance(actions[0], Hold)):
                # The budget covers payloads and the bookkeeping of every message not yet handed out.
                size = 0 if payload.stripped else payload_size(payload)
                overhead = HELD_MESSAGE_OVERHEAD_BYTES
                if size and actions and budget is not None and self._held_bytes + size + overhead > budget:
                    # Held for ordering and over the budget: the store keeps the payload meanwhile.
                    if engine.strip_payload(message):
                        self.counters.payloads_stripped += 1
                        size = 0
                self._held_bytes += size + overhead
            self._apply(actions)
        self._after_change()

    @property
    def held_bytes(self) -> int:
        """Memory, estimated, of stored messages not yet handed out (held or ready): payloads kept
        plus ``HELD_MESSAGE_OVERHEAD_BYTES`` each."""
        return self._held_bytes

    def advance_watermark(self, watermark_ms: int) -> None:
        engine = self._require_engine()
        self._apply(engine.advance_watermark(watermark_ms, self._clock()))
        self._after_change()

    def undelivered(self) -> int:
        """Messages releasable or in flight, not yet acked: what ingest's flow control counts.

        Messages held for ordering are not counted (DESIGN §4 "backpressure without deadlock").
        """
        if self._engine is None:
            return 0
        status, _ = self._engine.status(self._clock(), max_keys=0)
        return status.ready + status.in_flight + self._dead_letters_pending

    @property
    def dead_letters_pending(self) -> int:
        """Dead letters waiting to be published or recorded."""
        return self._dead_letters_pending

    # ---- delivery --------------------------------------------------------------------------

    def add_waker(self, event: asyncio.Event) -> None:
        """Register a stream's event: set whenever messages may be ready, or the runtime stops."""
        self._wakers.add(event)
        if self._engine is not None and self._engine.has_ready():
            event.set()

    def remove_waker(self, event: asyncio.Event) -> None:
        self._wakers.discard(event)

    def take(self, consumer: str, max_messages: int) -> list[Deliver]:
        """Up to ``max_messages`` releasable messages for ``consumer`` (none while not ready)."""
        engine = self._engine
        if engine is None or max_messages <= 0 or not self.is_ready:
            return []
        now_ms = self._clock()
        deliveries = engine.take(consumer, max_messages, now_ms)
        for delivery in deliveries:
            payload = delivery.message.payload
            if delivery.attempt == 1 and payload is not None:
                size = 0 if payload.stripped else payload_size(payload)
                self._held_bytes = max(0, self._held_bytes - size - HELD_MESSAGE_OVERHEAD_BYTES)
        if deliveries:
            self._maybe_wake_timer()
            if self._on_delivered is not None:
                self._on_delivered(deliveries, now_ms)
        return deliveries

    async def load_payloads(self, deliveries: list[Deliver]) -> list[Deliver]:
        """``deliveries`` with every stripped payload read back from the store (counted as reads).

        Retried while the store is unavailable; the deliveries stay in flight meanwhile (their ack
        deadline runs, and an expiry gives them back as usual)."""
        stripped = [d.message for d in deliveries if d.message.payload is not None and d.message.payload.stripped]
        if not stripped:
            return deliveries
        loaded = await self._retry_store(self._store.read_payloads, stripped)
        self.counters.payloads_read += len(stripped)
        by_ref = {m.payload.ref: m for m in loaded if m.payload is not None}
        out = []
        for delivery in deliveries:
            payload = delivery.message.payload
            if payload is not None and payload.stripped:
                delivery = dataclasses.replace(delivery, message=by_ref[payload.ref])
            out.append(delivery)
        return out

    def submit_ack(self, consumer: str, delivery_ids: Sequence[str]) -> AckTicket:
        """Accept acks now (the engine holds their keys as "acking"); confirm once durable."""
        engine = self._require_engine()
        if self.failure is not None:
            raise SubscriptionUnavailable(f"subscription {self.name!r} failed: {self.failure!r}")
        now_ms = self._clock()
        intents: list[AckIntent] = []
        unknown: list[str] = []
        for delivery_id in delivery_ids:
            try:
                intents.append(engine.ack(consumer, delivery_id, now_ms))
            except UnknownDelivery:
                unknown.append(delivery_id)
        self.counters.unknown_ids += len(unknown)
        self.counters.acks_submitted += len(intents)
        if not intents:
            return AckTicket(unknown=unknown, confirmed=None)
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._acks_pending.append(_PendingAck(intents=intents, future=future))
        self._acks_idle.clear()
        self._acks_wake.set()
        return AckTicket(unknown=unknown, confirmed=future)

    async def ack(self, consumer: str, delivery_ids: Sequence[str]) -> AckResult:
        """Ack and wait until durable: ``confirmed`` only holds ids that commit_acks made durable."""
        ticket = self.submit_ack(consumer, delivery_ids)
        confirmed = await ticket.confirmed if ticket.confirmed is not None else []
        return AckResult(confirmed=confirmed, unknown=ticket.unknown)

    def nack(
        self,
        consumer: str,
        delivery_ids: Sequence[str],
        *,
        retry_after_ms: int | None = None,
        dead_letter: bool = False,
    ) -> list[str]:
        """Give messages back (redelivered after backoff, or dead-lettered); returns the unknown ids."""
        engine = self._require_engine()
        now_ms = self._clock()
        unknown: list[str] = []
        for delivery_id in delivery_ids:
            try:
                actions = engine.nack(
                    consumer, delivery_id, now_ms, retry_after_ms=retry_after_ms, dead_letter=dead_letter
                )
            except UnknownDelivery:
                unknown.append(delivery_id)
                continue
            self._apply(actions)
        self.counters.unknown_ids += len(unknown)
        self._after_change()
        return unknown

    def consumer_closed(self, consumer: str) -> None:
        """A stream ended: its in-flight messages are ready again at once, for any stream."""
        if self._engine is None:
            return
        self._engine.consumer_closed(consumer, self._clock())
        self._after_change()

    def status(self, max_keys: int = 100) -> tuple[EngineStatus, list[KeyStatus]]:
        engine = self._require_engine()
        return engine.status(self._clock(), max_keys=max_keys)

    # ---- internals -------------------------------------------------------------------------

    async def unblock(self, key: str) -> Unblocked:
        """An operator skips the dead letter that blocks ``key``: recorded in the store first (a
        restart keeps it), then the engine delivers the key's next messages. Raises KeyNotBlocked
        when the key is not blocked, StoreError when the store cannot record it (nothing changed)."""
        engine = self._require_engine()
        async with self._unblock_lock:  # one at a time: the second of two sees the key running
            if not engine.is_blocked(key):
                raise KeyNotBlocked(f"key {key!r} of subscription {self.name!r} is not blocked by a dead letter")
            position = await self._store.unblock(self.name, key, self._clock())
            message, actions = engine.unblock(key, position, self._clock())
            self._apply(actions)
        _LOGGER.warning(
            "subscription %s: key unblocked by an operator; its dead letter at %s is skipped",
            self.name,
            position,
            extra={"subscription": self.name, "key": key, "message_id": message.message_id if message else None},
        )
        self._after_change()
        return Unblocked(key, position, message.message_id if message is not None else None)

    def _require_engine(self) -> Engine:
        if self._engine is None:
            raise SubscriptionUnavailable(f"subscription {self.name!r} is still recovering")
        return self._engine

    def _apply(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, DeadLetter):
                self._dead_letters_pending += 1
                self._dead_letter_queue.put_nowait(action)
            elif isinstance(action, DropDuplicate):
                if action.finish_record:
                    self._drops.append(action.message)
                    self._drops_wake.set()
            elif isinstance(action, Hold):
                _LOGGER.debug("subscription %s holds %s: %s", self.name, action.message.dedup_id, action.reason)
            else:
                # Deliveries come only from take(): one here would be in flight with no stream.
                raise RuntimeError(f"engine returned {type(action).__name__} outside take(): {action!r}")

    def _after_change(self) -> None:
        """Wake streams when messages are ready and the timer when an earlier timer appeared."""
        engine = self._engine
        if engine is None:
            return
        if self._wakers and engine.has_ready():
            for event in self._wakers:
                event.set()
        self._maybe_wake_timer()

    def _maybe_wake_timer(self) -> None:
        due_ms = self._engine.next_timer_ms() if self._engine is not None else None
        if due_ms is not None and (self._timer_due_ms is None or due_ms < self._timer_due_ms):
            self._timer_wake.set()

    async def _timer_loop(self) -> None:
        engine = self._require_engine()
        while True:
            now_ms = self._clock()
            due_ms = engine.next_timer_ms()
            if due_ms is not None and due_ms <= now_ms:
                self._apply(engine.tick(now_ms))
                self._after_change()
                # Let other tasks run even if the engine keeps reporting due timers.
                await asyncio.sleep(0)
                continue
            self._timer_due_ms = due_ms
            self._timer_wake.clear()
            timeout = None if due_ms is None else (due_ms - now_ms) / 1000
            try:
                await asyncio.wait_for(self._timer_wake.wait(), timeout)
            except TimeoutError:
                pass
            finally:
                self._timer_due_ms = None

    async def _ack_commit_loop(self) -> None:
        engine = self._require_engine()
        while True:
            await self._acks_wake.wait()
            self._acks_wake.clear()
            while self._acks_pending:
                batch = self._take_ack_batch()
                intents = [intent for pending in batch for intent in pending.intents]
                try:
                    await self._retry_store(self._store.commit_acks, intents)
                except BaseException as exc:
                    error = SubscriptionUnavailable(f"acks of {self.name!r} could not be made durable: {exc!r}")
                    for pending in batch:
                        if not pending.future.done():
                            pending.future.set_exception(error)
                    raise
                self.counters.ack_commits += 1
                self._apply(engine.ack_durable([intent.delivery_id for intent in intents], self._clock()))
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_result([intent.delivery_id for intent in pending.intents])
                self._after_change()
            self._acks_idle.set()

    def _take_ack_batch(self) -> list[_PendingAck]:
        batch: list[_PendingAck] = []
        count = 0
        while self._acks_pending and (not batch or count + len(self._acks_pending[0].intents) <= _MAX_ACKS_PER_COMMIT):
            pending = self._acks_pending.pop(0)
            batch.append(pending)
            count += len(pending.intents)
        return batch

    def _fail_pending_acks(self, error: Exception) -> None:
        pending, self._acks_pending = self._acks_pending, []
        for entry in pending:
            if not entry.future.done():
                entry.future.set_exception(error)
                # Mark retrieved: a stream that already ended will never await it.
                entry.future.exception()
        self._acks_idle.set()

    async def _dead_letter_loop(self) -> None:
        async with asyncio.TaskGroup() as group:
            while True:
                action = await self._dead_letter_queue.get()
                group.create_task(self._dead_letter_one(action), name=f"dead-letter:{self.name}")

    async def _dead_letter_one(self, action: DeadLetter) -> None:
        engine = self._require_engine()
        try:
            await self._publish_dead_letter(action)
            state = DEAD_LETTERED if action.in_order else DEAD_LETTERED_ASIDE
            try:
                await self._retry_store(self._store.mark_done, [action.message], state)
            except StoreError:
                # The topic has it (G1 holds); unmarked, it is loaded and dead-lettered again after a restart.
                _LOGGER.exception(
                    "subscription %s: could not record dead letter %s", self.name, action.message.dedup_id
                )
        finally:
            self._dead_letters_pending -= 1
        self._apply(engine.dead_letter_done(action.message, self._clock()))
        self._after_change()

    async def _publish_dead_letter(self, action: DeadLetter) -> None:
        attempt = 0
        while True:
            try:
                async with self._dead_letter_slots:
                    await self._dead_letters.publish(self.name, action.message, action.reason, action.attempts)
                return
            except Exception:
                self.counters.dead_letter_publish_failures += 1
                _LOGGER.warning(
                    "subscription %s: dead-letter publish of %s failed (attempt %d); retrying",
                    self.name,
                    action.message.dedup_id,
                    attempt + 1,
                    exc_info=True,
                )
            await asyncio.sleep(_backoff_seconds(attempt))
            attempt += 1

    async def _drop_loop(self) -> None:
        while True:
            await self._drops_wake.wait()
            self._drops_wake.clear()
            while self._drops:
                batch, self._drops = self._drops, []
                try:
                    await self._retry_store(self._store.mark_done, batch, DROPPED)
                except StoreError:
                    # Harmless: an unmarked duplicate is loaded again and dropped again by the engine.
                    _LOGGER.exception("subscription %s: could not record %d dropped duplicates", self.name, len(batch))

    async def _retry_store(self, method: Callable[..., Awaitable[_T]], *args: object, **kwargs: object) -> _T:
        """``method(subscription, *args, now_ms, **kwargs)`` until it succeeds.

        StoreUnavailable is retried with backoff (``now_ms`` read afresh each time); other
        StoreErrors raise.
        """
        what = getattr(method, "__name__", "call")
        attempt = 0
        while True:
            try:
                return await method(self.name, *args, self._clock(), **kwargs)
            except StoreUnavailable as exc:
                self.counters.store_retries += 1
                _LOGGER.warning("subscription %s: store %s unavailable (%s); retrying", self.name, what, exc)
            await asyncio.sleep(_backoff_seconds(attempt))
            attempt += 1


def _backoff_seconds(attempt: int) -> float:
    """Capped exponential backoff with full jitter, so that retries from many tasks spread out."""
    ceiling = min(_RETRY_MAXIMUM_SECONDS, _RETRY_INITIAL_SECONDS * 2**attempt)
    return random.uniform(ceiling / 2, ceiling)


def _first_cause(exc: BaseException) -> BaseException:
    """The worker's own error rather than the TaskGroup's wrapper, for ``failure`` and error messages."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
