"""One subscription's live state: executes the pure engine's decisions with a store and a clock.

The engine decides (deliver, drop, dead-letter, hold); the runtime does the I/O those decisions
need and feeds the results back. ``SubscriptionRuntime`` is what ingest, the delivery layer and the
wiring use; it owns the lifecycle and hands each job to a part of its own, which states its rules:

- ``runtime_context``: what the parts share (engines, store, clock, counters), store calls retried
  while the store is unavailable, fencing by lease epoch, and the hooks the parts tell each other by.
- ``runtime_loading``: recovery and each shard's load (cursors, then pending pages), messages as
  they are stored, the held-bytes budget, liveness of a load.
- ``runtime_fast_path``: sequence mode's in-order fast path, and settling its messages with Pub/Sub.
- ``runtime_acks``: acks group-committed, confirmed only once durable (G3).
- ``runtime_actions``: dead letters (published, then recorded, G1), dropped duplicates, an
  operator's unblock or gap skip.
- ``runtime_shards``: shard adoption, drain and loss (one engine per owned shard, ``shard_engines``).
- ``runtime_delivery``: take, read back stripped payloads, accept acks and nacks.
- ``runtime_wakeups``: streams woken when messages are ready, and the one timer task.
- ``message_traces``: each message's span (tracing on) and the trace context its deliveries carry;
  told of each step here (stored, the engine's decisions, take, acks, nacks, confirmations, shards
  dropped), never consulted for a decision.

Rules the runtime itself keeps:

- Nothing is delivered before ``recover()`` rebuilt the engine from ``store.load``'s cursors (with
  shards: before ``adopt_shard`` loaded each). Its pending messages are read afterwards, page by
  page (``loaded()`` waits for them).
- Every engine call happens on the event loop thread, with ``now_ms`` read from ``clock``.
- The background work (``run()``: timer, ack commits, dead letters, drops, a watch on the loads) is
  one TaskGroup: a worker that fails for good (a permanent ``StoreError`` on ``commit_acks`` or
  ``load``) fails the runtime loudly (``run()`` raises, ``failure`` is set, every stream is woken and
  ends); acks not yet durable then are never confirmed, and a restart redelivers them.
- ``stop()`` stops delivering, gives queued acks up to a grace period to become durable, then stops
  the workers; what is still in flight stays pending in the store (an unconfirmed ack may cause one
  redelivery, G3).
- Messages of shards owned elsewhere are ignored here: they are durable, and their owner learns of
  them (Listen, or its load).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence

from sidecar.engine.types import Action, Deliver, EngineConfig, EngineStatus, KeyStatus, Message, SkippedRange
from sidecar.pipeline.message_traces import MessageTraces
from sidecar.pipeline.runtime_acks import AckPipeline, AckResult, AckTicket
from sidecar.pipeline.runtime_actions import DeadLetterSink, EngineActions, Unblocked
from sidecar.pipeline.runtime_context import RuntimeContext, RuntimeCounters, SubscriptionUnavailable, first_cause
from sidecar.pipeline.runtime_delivery import Deliveries
from sidecar.pipeline.runtime_fast_path import FastPath
from sidecar.pipeline.runtime_loading import ShardLoading
from sidecar.pipeline.runtime_shards import ShardOwnership
from sidecar.pipeline.runtime_wakeups import Wakeups
from sidecar.pipeline.shard_engines import ShardEngine, ShardEngines
from sidecar.shards import shard_of
from sidecar.store.api import IncomingMessage, ShardLost, Store

_LOGGER = logging.getLogger(__name__)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class SubscriptionRuntime:
    """Drives one subscription's engines: recovery, timers, durable acks, dead letters, shards."""

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
        shard_count: int | None = None,
        on_shard_lost: Callable[[int, int], None] | None = None,
    ) -> None:
        self.name = name
        # Delivery ids must not repeat across restarts of the sidecar, so each process gets its own.
        prefix = id_prefix if id_prefix is not None else f"{secrets.token_hex(4)}-"
        engines = ShardEngines(
            prefix, (lambda key: 0) if shard_count is None else functools.partial(_shard, count=shard_count)
        )
        self._wakeups = Wakeups(engines, clock)
        self._ctx = RuntimeContext(
            name,
            engine_config,
            store,
            clock,
            engines,
            shard_count,
            apply=self._apply,
            after_change=self._wakeups.after_change,
            settle=self._settle,
            shard_lost=self._shard_lost,
        )
        self._actions = EngineActions(self._ctx, dead_letters)
        self._fast_path = FastPath(self._ctx)
        self._acks = AckPipeline(self._ctx)
        self._loading = ShardLoading(self._ctx, max_held_bytes, self._wakeups.wake_all)
        self._shards = ShardOwnership(self._ctx, self._loading, self._acks, self._fast_path, self._wakeups.wake_all)
        self._shards.on_lost = on_shard_lost
        self._deliveries = Deliveries(
            self._ctx,
            self._acks,
            drop_expired_leases=self._shards.drop_expired_leases,
            wake_timer=self._wakeups.maybe_wake_timer,
            on_delivered=on_delivered,
        )
        self.pod = ""
        """This process's identity among the pods of the subscription (set with leases)."""
        self.status_counts: Callable[[], dict[str, int]] | None = None
        """More counters for GetStatus and metrics (the lease manager's), read when asked."""
        self.traces = MessageTraces(name)
        """The messages' spans and the trace context each delivery carries (the wiring replaces it
        when tracing is on): told of every step below, asked by the delivery layer."""
        self.traces.bind(clock, engines.route)
        self._task: asyncio.Task[None] | None = None
        store.watch_losses(name, self._shard_lost)

    # ---- what the wiring sets --------------------------------------------------------------

    @property
    def lease_check(self) -> Callable[[int], int | None] | None:
        """The lease manager's ``holds``: the epoch of a shard held within its safety margin now."""
        return self._ctx.lease_check

    @lease_check.setter
    def lease_check(self, check: Callable[[int], int | None] | None) -> None:
        self._ctx.lease_check = check

    @property
    def on_volatile_settled(self) -> Callable[[Message, bool], None] | None:
        """Told when a fast-path message (``take_fast``) is settled: True once it is safe (its ack
        durable, or its dead letter published and recorded): ack it in Pub/Sub; False when this pod
        gave it up (shard lost, dropped, stopped): nack it, Pub/Sub delivers it again."""
        return self._fast_path.on_settled

    @on_volatile_settled.setter
    def on_volatile_settled(self, callback: Callable[[Message, bool], None] | None) -> None:
        self._fast_path.on_settled = callback

    @property
    def on_shard_lost(self) -> Callable[[int, int], None] | None:
        """Told when the store refused a write because this pod no longer owns a shard."""
        return self._shards.on_lost

    @on_shard_lost.setter
    def on_shard_lost(self, callback: Callable[[int, int], None] | None) -> None:
        self._shards.on_lost = callback

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def ack_deadline_ms(self) -> int:
        return self._ctx.config.ack_deadline_ms

    def now_ms(self) -> int:
        """The runtime's clock: what every engine call is given as ``now_ms``."""
        return self._ctx.clock()

    @property
    def failure(self) -> BaseException | None:
        """Why the runtime failed for good (the sidecar must restart); None while it has not."""
        return self._ctx.failure

    @property
    def counters(self) -> RuntimeCounters:
        return self._ctx.counters

    def unavailable_reason(self) -> str:
        """Why ``is_ready`` is False, in words for a client's status message."""
        return self._ctx.unavailable_reason()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The background work started by ``start()``: it ends only by ``stop()`` or a failure."""
        return self._task

    @property
    def is_ready(self) -> bool:
        """Recovered, running and not stopping: streams may be served."""
        return self._ctx.is_ready

    @property
    def sharded(self) -> bool:
        return self._ctx.shard_count is not None

    @property
    def shard_count(self) -> int:
        return self._ctx.shard_count or 0

    @property
    def recovered_documents(self) -> int:
        """Documents ``load`` has read so far during recovery."""
        return self._loading.recovered_documents

    def extra_counts(self) -> dict[str, int]:
        """Counters beyond the engine's: sharding, and whatever ``status_counts`` adds."""
        counters = self._ctx.counters
        counts: dict[str, int] = {}
        if self._ctx.config.mode == "sequence":
            counts["fast_path"] = counters.fast_path
            counts["fast_path_copies"] = counters.fast_path_copies
            counts["fast_path_duplicates"] = counters.fast_path_duplicates
        if self._ctx.shard_count is not None:
            counts["not_owned"] = counters.not_owned
            counts["shards_adopted"] = counters.shards_adopted
            counts["shards_dropped"] = counters.shards_dropped
            counts["shards_loading"] = self.loading_shards
            counts["acks_fenced"] = counters.acks_fenced
            counts["deliveries_withheld"] = counters.deliveries_withheld
        if self.status_counts is not None:
            counts.update(self.status_counts())
        return counts

    def shards(self) -> dict[int, int]:
        """Shard -> lease epoch of every shard this pod delivers now (``{0: 0}`` without leases)."""
        return self._ctx.engines.shards()

    async def recover(self) -> None:
        """Rebuild from the store. Must complete before anything is delivered.

        Without shards: load everything into one engine. With shards: nothing to load yet; each
        shard is loaded by ``adopt_shard`` once its lease is held."""
        if self._ctx.recovered or self._loading.recovery_started_ms is not None:
            raise RuntimeError(f"subscription {self.name!r}: recover() called twice")
        await self._loading.recover()
        self._ctx.recovered = True
        self._wakeups.after_change()

    async def loaded(self) -> None:
        """Wait until every shard's pending messages are restored; raises if a load failed for good."""
        await self._loading.loaded()

    @property
    def loading_shards(self) -> int:
        """Shards whose pending messages are still being read."""
        return self._loading.loading_shards

    def is_live(self) -> bool:
        """False when recovery, or a shard load in progress, has made no progress for
        ``RECOVERY_STALL_SECONDS`` (or the runtime failed)."""
        return self._loading.is_live()

    async def start(self) -> None:
        """Run the background work (timers, ack commits, dead letters) in a task of its own."""
        if self._task is not None:
            raise RuntimeError(f"subscription {self.name!r}: start() called twice")
        self._ctx.require_recovered()
        self._task = asyncio.create_task(self.run(), name=f"runtime:{self.name}")
        self._task.add_done_callback(self._on_task_done)

    async def run(self) -> None:
        """The background work; returns only by cancellation, raises if a worker fails for good."""
        self._ctx.require_recovered()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._wakeups.run_timer(self._apply), name=f"timer:{self.name}")
                group.create_task(self._acks.run(), name=f"acks:{self.name}")
                group.create_task(self._actions.run_dead_letters(), name=f"dead-letters:{self.name}")
                group.create_task(self._actions.run_drops(), name=f"drops:{self.name}")
                group.create_task(self._watch_loads(), name=f"loads:{self.name}")
        except BaseException as exc:
            # Waiting streams must learn that their acks will not be confirmed by this process.
            self._acks.fail_pending(SubscriptionUnavailable(f"subscription {self.name!r} stopped"))
            if not isinstance(exc, asyncio.CancelledError):
                self._ctx.failure = first_cause(exc)
            raise

    async def _watch_loads(self) -> None:
        """Ends ``run()`` with the error of a shard load that failed for good (its task runs apart)."""
        await self._loading.failed.wait()
        assert self._ctx.failure is not None
        raise self._ctx.failure

    async def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop delivering, let queued acks commit for up to ``grace_seconds``, then stop the workers.

        Idempotent. Messages still in flight stay pending in the store and are delivered again
        after a restart (an unconfirmed ack may cause one redelivery, G3).
        """
        self._ctx.stopping = True
        self._wakeups.wake_all()  # streams notice is_ready is False and end
        self._loading.cancel_all()
        task = self._task
        if task is None or task.done():
            self.traces.end_all()
            return
        try:
            if not self._acks.idle.is_set():
                await asyncio.wait_for(self._acks.idle.wait(), grace_seconds)
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
        finally:
            self.traces.end_all()  # after the last acks were confirmed (their spans ended acked)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._ctx.failure = self._ctx.failure or first_cause(exc)
            _LOGGER.critical("subscription %s runtime failed; its streams end", self.name, exc_info=exc)
            self._wakeups.wake_all()

    # ---- shards ----------------------------------------------------------------------------

    async def adopt_shard(self, shard: int, epoch: int) -> None:
        """This pod now owns ``shard`` at ``epoch``: load it from the store and deliver its keys.

        Retried while the store is unavailable; raises StoreError on a permanent error."""
        await self._shards.adopt(shard, epoch)

    def handed_attempts(self, shard: int) -> str:
        """The delivery attempts of ``shard``'s dropped engine, for the lease write giving it up."""
        return self._ctx.engines.handed_attempts(shard)

    def inherit_attempts(self, shard: int, encoded: str) -> None:
        """Keep the delivery attempts the shard's previous owner recorded (before its load)."""
        self._ctx.engines.inherit_attempts(shard, encoded)

    def drop_shard(self, shard: int, epoch: int | None = None) -> bool:
        """Stop delivering ``shard`` at once (lost, or handed over); ``epoch``: only if the engine is
        still that epoch's. Returns whether an engine was dropped."""
        dropped = self._shards.drop(shard, epoch)
        self.traces.keep_shards(self.shards())
        return dropped

    async def drain_shard(self, shard: int, timeout_seconds: float) -> None:
        """Before a graceful hand-over: hand out nothing more of ``shard``, wait (up to
        ``timeout_seconds``) for its in-flight acks to be durable, then write its checkpoint."""
        await self._shards.drain(shard, timeout_seconds)

    def inbox_behind(self, shard: int, epoch: int) -> None:
        """Before ``adopt_shard``: the shard's inbox has no first snapshot yet (``ShardLoading``)."""
        self._loading.inbox_behind(shard, epoch)

    def inbox_caught_up(self, shard: int, epoch: int) -> None:
        """The shard's inbox Listen handed over its first snapshot (``ShardLoading.inbox_caught_up``)."""
        self._loading.inbox_caught_up(shard, epoch)

    def owner_epoch(self, key: str) -> int | None:
        """The lease epoch under which this pod delivers ``key`` now; None when it does not (another
        pod owns its shard, or none does yet, or it is being handed over). With leases this asks
        ``lease_check`` too, so a lease whose local deadline just passed counts as lost at once."""
        entry = self._ctx.delivering(key)
        return None if entry is None else entry.epoch

    # ---- events from ingest and the watermark source ---------------------------------------

    def on_stored(self, messages: Sequence[Message]) -> None:
        """Messages the store made durable (PersistOutcome.STORED), in arrival order. Those of shards
        this pod does not own are left to their owner."""
        self.traces.stored(messages, self._epoch_of)
        self._loading.on_stored(messages)

    def take_fast(self, batch: Sequence[IncomingMessage]) -> list[Message | None]:
        """Sequence mode's in-order fast path (docs/store.md), per message of ``batch`` in order: when
        it is the first position its key is missing, at this pod, the key's owner, it goes to the
        engine without being stored, flagged ``volatile``, and is returned; the caller keeps its
        Pub/Sub ack until ``on_volatile_settled``. A copy of a fast-path message not yet settled
        (same position and content) is returned too, and kept beside its original: it is settled
        with it, so it is acked as a duplicate once the original's ack is durable, and given back
        to Pub/Sub with it otherwise. None: store it as usual."""
        taken = self._fast_path.take(batch)
        if self.traces.enabled:
            self.traces.stored([m for m in taken if m is not None], self._epoch_of)
        return taken

    def awaits_predecessor(self, incoming: IncomingMessage) -> bool:
        """Sequence mode: whether ``incoming``, which did not take the fast path, lies beyond the first
        position its key is missing at this pod, the key's owner (``Engine.awaits_predecessor``):
        ingest may keep it back a little for that position, so that both take the fast path."""
        return self._fast_path.awaits_predecessor(incoming)

    @property
    def held_bytes(self) -> int:
        """Memory, estimated, of stored messages not yet handed out (held or ready): payloads kept
        plus ``HELD_MESSAGE_OVERHEAD_BYTES`` each."""
        return self._ctx.engines.held_bytes

    def advance_watermark(self, watermark_ms: int) -> None:
        self._ctx.require_recovered()
        now_ms = self._ctx.clock()
        for entry in self._ctx.engines:
            self._apply(entry, entry.engine.advance_watermark(watermark_ms, now_ms))
        self._wakeups.after_change()

    def undelivered(self) -> int:
        """Messages releasable or in flight, not yet acked: what ingest's flow control counts.

        Messages held for ordering are not counted (DESIGN §4 "backpressure without deadlock").
        """
        return self._actions.dead_letters_pending + sum(entry.engine.undelivered() for entry in self._ctx.engines)

    @property
    def dead_letters_pending(self) -> int:
        """Dead letters waiting to be published or recorded."""
        return self._actions.dead_letters_pending

    # ---- delivery --------------------------------------------------------------------------

    def add_waker(self, event: asyncio.Event) -> None:
        """Register a stream's event: set whenever messages may be ready, or the runtime stops."""
        self._wakeups.add(event)

    def remove_waker(self, event: asyncio.Event) -> None:
        self._wakeups.remove(event)

    def take(self, consumer: str, max_messages: int) -> list[Deliver]:
        """Up to ``max_messages`` releasable messages for ``consumer`` (none while not ready)."""
        deliveries = self._deliveries.take(consumer, max_messages)
        self.traces.released(deliveries)
        return deliveries

    async def load_payloads(self, deliveries: list[Deliver]) -> list[Deliver]:
        """``deliveries`` with every stripped payload read back from the store; a delivery whose
        shard was dropped meanwhile is withheld (``Deliveries.load_payloads``)."""
        return await self._deliveries.load_payloads(deliveries)

    def submit_ack(self, consumer: str, delivery_ids: Sequence[str]) -> AckTicket:
        """Accept acks now (the engine holds their keys as "acking"); confirm once durable."""
        ticket = self._deliveries.submit_ack(consumer, delivery_ids)
        if self.traces.enabled and ticket.confirmed is not None:
            unknown = set(ticket.unknown)
            self.traces.acked(i for i in delivery_ids if i not in unknown)
            ticket.confirmed.add_done_callback(self._traces_confirmed)
        return ticket

    def _traces_confirmed(self, future: asyncio.Future[list[str]]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.traces.confirmed(future.result())

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
        unknown = self._deliveries.nack(consumer, delivery_ids, retry_after_ms=retry_after_ms, dead_letter=dead_letter)
        if self.traces.enabled:
            self.traces.nacked((i for i in delivery_ids if i not in unknown), dead_letter)
        return unknown

    def consumer_closed(self, consumer: str) -> None:
        """A stream ended: its in-flight messages are ready again at once, for any stream."""
        self._deliveries.consumer_closed(consumer)

    def status(self, max_keys: int = 100) -> tuple[EngineStatus, list[KeyStatus]]:
        self._ctx.require_recovered()
        return self._ctx.engines.status(self._ctx.config.mode, self._ctx.clock(), max_keys)

    async def unblock(self, key: str) -> Unblocked:
        """An operator skips the dead letter that blocks ``key``: recorded in the store first, then
        the engine delivers the key's next messages (``EngineActions.unblock``). Raises KeyNotBlocked
        when the key is not blocked, NotOwner when another pod delivers it, StoreError when the
        store cannot record it (nothing changed)."""
        return await self._actions.unblock(key)

    async def skip_gap(self, key: str, through: int) -> SkippedRange:
        """An operator skips the missing sequences ``key`` waits on, up to ``through``: recorded in the
        store first, then the engine releases what follows (``EngineActions.skip_gap``). Raises
        KeyNotWaitingOnGap or SkipOutOfRange, NotOwner, StoreError (nothing changed)."""
        return await self._actions.skip_gap(key, through)

    # ---- the hooks the parts tell each other by (RuntimeContext) ---------------------------

    def _apply(self, entry: ShardEngine, actions: Sequence[Action]) -> None:
        self.traces.decided(entry.shard, entry.epoch, actions)
        self._actions.apply(entry, actions)

    def _settle(self, entry: ShardEngine, message: Message, safe: bool) -> None:
        self._fast_path.settle(entry, message, safe)

    def _shard_lost(self, exc: ShardLost) -> None:
        self._shards.shard_lost(exc)
        self.traces.keep_shards(self.shards())

    def _epoch_of(self, key: str) -> int | None:
        """The epoch of the engine that takes ``key``'s messages here (None: no engine here)."""
        entry = self._ctx.engines.for_key(key)
        return None if entry is None else entry.epoch


def _shard(key: str, count: int) -> int:
    # Positional, as every other caller: ``shard_of``'s cache keys a keyword call apart.
    return shard_of(key, count)
