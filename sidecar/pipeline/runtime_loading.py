"""Stored messages into the engines: a shard's load from the store, and messages as they are stored.

Rules:

- A shard loads in two steps (docs/store.md, "Recovery"): its cursors, after which its engine exists
  and delivers what it can prove is next (``Engine.restore``), then its pending messages page by
  page in a task of their own, each page restored into the engine as it arrives
  (``Engine.restore_pending``). The pages wait while any shard's cursors are being read: those are
  what readiness and the first deliveries wait for.
- Each stored record reaches an engine once (``ShardEngine.admit``): a page read before a record was
  finished can still hold it, and the shard's inbox Listen may hand over records a page restored
  until its first snapshot came (``inbox_behind`` / ``inbox_caught_up``).
- A load retries while the store is unavailable. A permanent ``StoreError`` reading the cursors
  raises to the caller (``recover``, ``adopt``); reading the pages (a corrupt document) it fails
  the runtime: nothing of the shard can be proven in order. A shard dropped while it loads keeps
  nothing of the load.
- Memory: stored messages not yet handed out count against ``max_held_bytes`` (payloads kept plus
  ``HELD_MESSAGE_OVERHEAD_BYTES`` each). A message held for ordering over the budget leaves its
  payload in the store (read back at delivery). The loads under way share one ``PayloadBudget``: what
  the budget leaves beside the engines' held messages.
- Liveness: a recovery or shard load that has read nothing new for ``RECOVERY_STALL_SECONDS`` is stuck.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

from sidecar.engine import Engine
from sidecar.engine.payloads import HELD_MESSAGE_OVERHEAD_BYTES, payload_size
from sidecar.engine.types import DeadLetter, DropDuplicate, Hold, Message
from sidecar.pipeline.runtime_context import RuntimeContext, SubscriptionUnavailable, first_cause
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.store.api import PayloadBudget

_LOGGER = logging.getLogger(__name__)

RECOVERY_STALL_SECONDS = 120.0
"""A recovery that has read nothing new for this long is stuck: liveness reports it, so that
Kubernetes restarts the container instead of waiting on it for ever."""


class ShardLoading:
    """Loads shards into the engines and hands them the messages stored since."""

    def __init__(self, ctx: RuntimeContext, max_held_bytes: int | None, wake_streams: Callable[[], None]) -> None:
        self._ctx = ctx
        self._max_held_bytes = max_held_bytes
        """Payload bytes kept in memory for stored messages not yet handed out (None: no limit)."""
        self._wake_streams = wake_streams
        self.recovery_started_ms: int | None = None
        self._recovery_progress_ms: int | None = None
        self.recovered_documents = 0
        """Documents ``load`` has read so far during recovery."""
        self._loads = 0
        """Shard loads in progress (``adopt``, and the pending pages after it): liveness watches
        their progress too."""
        self.failed = asyncio.Event()
        """Set when a shard's load failed for good (``ctx.failure`` says why)."""
        self._state_loads = 0
        """Shard loads reading their state (``load(pending=False)``) now."""
        self._states_read = asyncio.Event()
        """Set while no shard's state is being read: pending pages wait for it."""
        self._states_read.set()
        self._loaders: dict[int, asyncio.Task[None]] = {}
        """Per shard, the task restoring its pending messages (``_load_pending``)."""
        self._inbox_behind: dict[int, int] = {}
        """Shard -> epoch whose inbox Listen has not handed over its first snapshot (``inbox_behind``)."""
        self._budget: PayloadBudget | None = None
        """The payload budget the loads in progress share (``_payload_budget``)."""

    # ---- loads -----------------------------------------------------------------------------

    async def recover(self) -> None:
        """The runtime's recovery: without shards, load everything into one engine; with shards,
        nothing yet (``adopt`` loads each shard once its lease is held)."""
        self.recovery_started_ms = self._recovery_progress_ms = self._ctx.clock()
        if self._ctx.shard_count is None:
            await self._load_shard(0, 0, None)

    async def adopt(self, shard: int, epoch: int) -> None:
        """Load ``shard`` at ``epoch``: once this returns its engine delivers; its pages follow."""
        self._recovery_progress_ms = self._ctx.clock()
        self._loads += 1
        try:
            await self._load_shard(shard, epoch, frozenset({shard}))
        finally:
            self._loads -= 1
            if not self._loads:
                self._budget = None  # the next load starts from what the engines hold then

    def forget(self, shard: int, epoch: int) -> None:
        """``shard``'s engine at ``epoch`` was dropped: its pages stop, its inbox is not awaited."""
        if self._inbox_behind.get(shard) == epoch:
            del self._inbox_behind[shard]
        loader = self._loaders.get(shard)
        if loader is not None:
            loader.cancel()

    def cancel_all(self) -> None:
        """The runtime stops: no more pages are read."""
        for loader in list(self._loaders.values()):
            loader.cancel()

    def inbox_behind(self, shard: int, epoch: int) -> None:
        """Before ``adopt``: the shard's inbox Listen has not handed over its first snapshot,
        which may come after the load and hold records a page restored. Until ``inbox_caught_up``
        the engine keeps admitting each record once (``ShardEngine.admit``) past the end of the load."""
        self._inbox_behind[shard] = epoch

    def inbox_caught_up(self, shard: int, epoch: int) -> None:
        """The shard's inbox Listen handed over its first snapshot: records are no longer remembered
        once the load has ended (a later copy is a duplicate of what the engine holds, or finished)."""
        if self._inbox_behind.get(shard) == epoch:
            del self._inbox_behind[shard]
        entry = self._ctx.engines.get(shard)
        loader = self._loaders.get(shard)
        if entry is not None and entry.epoch == epoch and (loader is None or loader.done()):
            entry.handed = None

    async def loaded(self) -> None:
        """Wait until every shard's pending messages are restored (``_load_pending``); raises the
        runtime's failure if a load failed for good."""
        while self._loaders:
            await asyncio.wait(list(self._loaders.values()))
        if self._ctx.failure is not None:
            raise SubscriptionUnavailable(self._ctx.unavailable_reason()) from self._ctx.failure

    @property
    def loading_shards(self) -> int:
        """Shards whose pending messages are still being read."""
        return len(self._loaders)

    def is_live(self) -> bool:
        """False when recovery, or a shard load in progress, has made no progress for
        ``RECOVERY_STALL_SECONDS`` (or the runtime failed)."""
        if self._ctx.failure is not None:
            return False
        if (self._ctx.recovered and not self._loads) or self._recovery_progress_ms is None:
            return True
        return self._ctx.clock() - self._recovery_progress_ms < RECOVERY_STALL_SECONDS * 1000

    def _progress_counter(self) -> Callable[[int], None]:
        """A ``progress`` callback for one store read: documents read count towards recovery."""
        seen = 0

        def progress(documents: int) -> None:
            nonlocal seen
            self.recovered_documents += documents - seen
            seen = documents
            self._recovery_progress_ms = self._ctx.clock()

        return progress

    async def _load_shard(self, shard: int, epoch: int, shards: frozenset[int] | None) -> None:
        """Load a shard in two steps (docs/store.md, "Recovery"): its cursors, after which its
        engine exists and delivers, then its pending messages page by page in a task of their own
        (``_load_pending``), each page restored into the engine as it arrives."""
        ctx = self._ctx
        extra: dict[str, object] = {} if shards is None else {"shards": shards}
        budget = self._payload_budget()
        self._state_loads += 1
        self._states_read.clear()
        try:
            snapshot = await ctx.retry_store(
                ctx.store.load,
                progress=self._progress_counter(),
                max_payload_bytes=budget,
                pending=False,
                epoch=None if ctx.shard_count is None else epoch,
                **extra,
            )
        finally:
            self._state_loads -= 1
            if not self._state_loads:
                self._states_read.set()
        engine = Engine.restore(
            ctx.config,
            snapshot,
            ctx.clock(),
            id_prefix=ctx.engines.engine_prefix(shard, epoch),
            cursor_source=functools.partial(ctx.store.cursor, ctx.name),
            loading=True,
            epoch=epoch,
        )
        entry = ctx.engines.add(shard, epoch, engine, 0)
        entry.handed = set()
        _LOGGER.info(
            "subscription %s recovered%s: %d key cursors; reading its pending messages",
            ctx.name,
            "" if shards is None else f" shard {shard} (epoch {epoch})",
            len(snapshot.cursors),
        )
        self._loads += 1
        loader = asyncio.create_task(self._load_pending(entry, shards, budget), name=f"load:{ctx.name}:{shard}")
        self._loaders[shard] = loader
        loader.add_done_callback(functools.partial(self._on_loader_done, shard))

    async def _load_pending(
        self, entry: ShardEngine, shards: frozenset[int] | None, budget: PayloadBudget | None
    ) -> None:
        """Restore the shard's pending messages into its loading engine, page by page, then end
        the load (gap timers, the watermark, the fast path and the messages stored meanwhile)."""
        ctx = self._ctx
        restored = 0
        pages = ctx.store.pending_pages(ctx.name, shards, budget, self._progress_counter())
        try:
            while True:
                # The state of the shards being taken comes first: it is what readiness and their
                # first deliveries wait for, and the pages' reads would only queue ahead of it.
                await self._states_read.wait()
                try:
                    page = await anext(pages)
                except StopAsyncIteration:
                    break
                if not ctx.current(entry):
                    return  # dropped meanwhile: nothing of it is restored
                fresh = [ctx.engines.with_prior(message) for message in page if entry.admit(message)]
                entry.engine.restore_pending(fresh, ctx.clock())
                entry.held_bytes += _held_size(fresh)
                restored += len(fresh)
                ctx.after_change()
        finally:
            await pages.aclose()
        if not ctx.current(entry):
            return
        if self._inbox_behind.get(entry.shard) != entry.epoch:
            entry.handed = None
        actions = entry.engine.finish_loading(ctx.clock())
        entry.held_bytes -= _held_size([a.message for a in actions if isinstance(a, DropDuplicate | DeadLetter)])
        ctx.apply(entry, actions)
        ctx.after_change()
        _LOGGER.info(
            "subscription %s%s loaded: %d pending messages",
            ctx.name,
            "" if ctx.shard_count is None else f" shard {entry.shard} (epoch {entry.epoch})",
            restored,
        )

    def _on_loader_done(self, shard: int, task: asyncio.Task[None]) -> None:
        if self._loaders.get(shard) is task:
            del self._loaders[shard]
        self._loads -= 1
        if not self._loads:
            self._budget = None  # the next load starts from what the engines hold then
        self._ctx.progress.set()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # A permanent StoreError (a corrupt document): nothing of the shard can be proven in order.
            self._ctx.failure = self._ctx.failure or first_cause(exc)
            self.failed.set()
            _LOGGER.critical(
                "subscription %s: loading shard %d failed; its streams end", self._ctx.name, shard, exc_info=exc
            )
            self._wake_streams()

    def _payload_budget(self) -> PayloadBudget | None:
        """The payload bytes a load may keep in memory: what ``max_held_bytes`` leaves beside the
        engines' held messages, shared by every load that runs at the same time (each of 16 shard
        loads must not keep a whole budget). A retried load is charged again: more of it stripped,
        never more kept."""
        if self._max_held_bytes is None:
            return None
        if self._budget is None:
            self._budget = PayloadBudget(self._max_held_bytes - self._ctx.engines.held_bytes)
        return self._budget

    # ---- messages as they are stored ---------------------------------------------------------

    def on_stored(self, messages: Sequence[Message]) -> None:
        """Messages the store made durable (PersistOutcome.STORED), in arrival order. Those of shards
        this pod does not own are left to their owner."""
        ctx = self._ctx
        ctx.require_recovered()
        now_ms = ctx.clock()
        budget = self._max_held_bytes
        for message in messages:
            entry = ctx.engines.for_key(message.key)
            if entry is None:
                ctx.counters.not_owned += 1
                continue
            if not entry.admit(message):
                continue  # its record was restored from a page already: the engine has it
            message = ctx.engines.with_prior(message)
            engine = entry.engine
            actions = engine.on_stored(message, now_ms)
            payload = message.payload
            if payload is not None and (not actions or isinstance(actions[0], Hold)):
                # The budget covers payloads and the bookkeeping of every message not yet handed out.
                size = 0 if payload.stripped else payload_size(payload)
                overhead = HELD_MESSAGE_OVERHEAD_BYTES
                if size and actions and budget is not None and ctx.engines.held_bytes + size + overhead > budget:
                    # Held for ordering and over the budget: the store keeps the payload meanwhile.
                    if engine.strip_payload(message):
                        ctx.counters.payloads_stripped += 1
                        size = 0
                entry.held_bytes += size + overhead
            ctx.apply(entry, actions)
        ctx.after_change()


def _held_size(messages: Sequence[Message]) -> int:
    """What ``messages`` weigh against ``max_held_bytes``: payloads kept plus the bookkeeping."""
    return sum(
        payload_size(m.payload) for m in messages if m.payload is not None and not m.payload.stripped
    ) + HELD_MESSAGE_OVERHEAD_BYTES * len(messages)
