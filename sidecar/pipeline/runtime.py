"""One subscription's live state: executes the pure engine's decisions with a store and a clock.

The engine decides (deliver, drop, dead-letter, hold); this module does the I/O those decisions
need and feeds the results back. Rules it keeps:

- Nothing is delivered before ``recover()`` rebuilt the engine from ``store.load``'s cursors. Its
  pending messages are read afterwards, page by page, and restored into the engine as they arrive
  (``Engine.restore_pending``; until the last page the engine delivers only what it can prove is
  next, see ``Engine.restore``). Each stored record reaches an engine once (``ShardEngine.admit``).
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
- Shards (several pods on one subscription, ``shard_count`` set): one engine per shard this pod owns
  (``sidecar.pipeline.shard_engines``). ``adopt_shard`` loads a shard from the store and starts delivering it;
  ``drop_shard`` forgets it at once (its in-flight ids become unknown); ``drain_shard`` stops handing
  it out and waits for its in-flight acks before a graceful hand-over. The store refuses an
  advancing write of a shard this pod no longer owns (``ShardLost``): those acks are not confirmed,
  the shard is dropped, and ``on_shard_lost`` tells the lease manager. Messages of shards owned
  elsewhere are ignored here: they are durable, and their owner learns of them (Listen, or its load).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from sidecar.backoff import backoff_seconds
from sidecar.engine import Engine, UnknownDelivery
from sidecar.engine.core import HELD_MESSAGE_OVERHEAD_BYTES, REASON_BELOW_CURSOR, KeyNotBlocked, payload_size
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
from sidecar.pipeline.shard_engines import ShardEngine, ShardEngines
from sidecar.shards import shard_of
from sidecar.store.api import (
    DEAD_LETTERED,
    DEAD_LETTERED_ASIDE,
    DROPPED,
    IncomingMessage,
    PayloadBudget,
    ShardLost,
    Store,
    StoreError,
    StoreRejected,
    StoreUnavailable,
)

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

_HANDOVER_FLUSH_SECONDS = 1.0
"""At least this long for a drained shard's last checkpoint before a hand-over, whatever is left of
the drain timeout."""

RECOVERY_STALL_SECONDS = 120.0
"""A recovery that has read nothing new for this long is stuck: liveness reports it, so that
Kubernetes restarts the container instead of waiting on it for ever."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class DeadLetterSink(Protocol):
    """Publishes a message to the subscription's dead-letter topic (``sidecar.dead_letters.publisher``)."""

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        """Return once the dead-letter topic has the message; raise on any failure (it is retried)."""
        ...


class SubscriptionUnavailable(Exception):
    """The subscription cannot serve now: still recovering, stopping, or failed."""


class NotOwner(LookupError):
    """The key's shard is owned by another pod (or by none yet): ask the pod that delivers it."""


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
class _AckBatch:
    """Acks taken together: answered once each of its parts (stored, fast-path) is durable."""

    pending: list[_PendingAck]
    parts: int = 0
    refused: set[str] = field(default_factory=set)
    """Delivery ids whose shard was lost before their ack was durable: never confirmed."""

    @property
    def intents(self) -> list[AckIntent]:
        return [intent for pending in self.pending for intent in pending.intents]


@dataclass(slots=True)
class RuntimeCounters:
    """Cumulative counts of what the runtime itself did (the engine keeps the delivery counts)."""

    acks_submitted: int = 0
    fast_path: int = 0
    """Messages taken by the in-order fast path (``take_fast``): delivered without a document."""
    fast_path_copies: int = 0
    """Copies of unsettled fast-path messages that ``take_fast`` kept beside their original, unstored."""
    fast_path_duplicates: int = 0
    """Those copies acked as duplicates once their original's ack (or dead letter) was durable."""
    unknown_ids: int = 0
    ack_commits: int = 0
    store_retries: int = 0
    dead_letter_publish_failures: int = 0
    payloads_stripped: int = 0
    """Held messages whose payload was left in the store (over ``max_held_bytes``)."""
    payloads_read: int = 0
    """Stripped payloads read back from the store for delivery."""
    not_owned: int = 0
    """Stored messages of shards this pod does not own (their owner delivers them)."""
    shards_adopted: int = 0
    shards_dropped: int = 0
    acks_fenced: int = 0
    """Acks refused because the shard's lease had moved on (or the engine that accepted them was
    dropped, even if the shard was taken back since at a new epoch): not confirmed."""
    deliveries_withheld: int = 0
    """Deliveries taken but not sent: their shard was dropped while their payload was read back."""


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
        shard_count: int | None = None,
        on_shard_lost: Callable[[int, int], None] | None = None,
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
        self._shard_count = shard_count
        """None: one engine for every key (no leases). Otherwise keys route to ``shard_of(key, S)``."""
        self._engines = ShardEngines(
            self._id_prefix, (lambda key: 0) if shard_count is None else functools.partial(_shard, count=shard_count)
        )
        self.on_shard_lost = on_shard_lost
        self.pod = ""
        """This process's identity among the pods of the subscription (set with leases)."""
        self.lease_check: Callable[[int], int | None] | None = None
        """The lease manager's ``holds``: the epoch of a shard held within its safety margin now."""
        self.on_volatile_settled: Callable[[Message, bool], None] | None = None
        """Told when a fast-path message (``take_fast``) is settled: True once it is safe (its ack
        durable, or its dead letter published and recorded): ack it in Pub/Sub; False when this pod
        gave it up (shard lost, dropped, stopped): nack it, Pub/Sub delivers it again."""
        self.status_counts: Callable[[], dict[str, int]] | None = None
        """More counters for GetStatus and metrics (the lease manager's), read when asked."""
        """Told when the store refused a write because this pod no longer owns a shard."""
        self._recovered = False
        self._progress = asyncio.Event()
        """Set whenever acks became durable or a shard changed: ``drain_shard`` waits on it."""
        self._unblock_lock = asyncio.Lock()
        self._max_held_bytes = max_held_bytes
        """Payload bytes kept in memory for stored messages not yet handed out (None: no limit)."""
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
        self._dead_letter_queue: asyncio.Queue[tuple[ShardEngine, DeadLetter]] = asyncio.Queue()
        self._dead_letters_pending = 0
        self._dead_letter_slots = asyncio.Semaphore(_DEAD_LETTER_PUBLISHES)
        self._recovery_started_ms: int | None = None
        self._recovery_progress_ms: int | None = None
        self.recovered_documents = 0
        """Documents ``load`` has read so far during recovery."""
        self._loads = 0
        """Shard loads in progress (``adopt_shard``, and the pending pages after it): liveness
        watches their progress too."""
        self._load_failed = asyncio.Event()
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
        self._drops: list[tuple[ShardEngine, Message]] = []
        self._drops_wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        store.watch_losses(name, self._shard_lost)

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
        if not self._recovered:
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
        return self._recovered and not self._stopping and self.failure is None

    @property
    def sharded(self) -> bool:
        return self._shard_count is not None

    @property
    def shard_count(self) -> int:
        return self._shard_count or 0

    def extra_counts(self) -> dict[str, int]:
        """Counters beyond the engine's: sharding, and whatever ``status_counts`` adds."""
        counts: dict[str, int] = {}
        if self._config.mode == "sequence":
            counts["fast_path"] = self.counters.fast_path
            counts["fast_path_copies"] = self.counters.fast_path_copies
            counts["fast_path_duplicates"] = self.counters.fast_path_duplicates
        if self._shard_count is not None:
            counts["not_owned"] = self.counters.not_owned
            counts["shards_adopted"] = self.counters.shards_adopted
            counts["shards_dropped"] = self.counters.shards_dropped
            counts["shards_loading"] = self.loading_shards
            counts["acks_fenced"] = self.counters.acks_fenced
            counts["deliveries_withheld"] = self.counters.deliveries_withheld
        if self.status_counts is not None:
            counts.update(self.status_counts())
        return counts

    def shards(self) -> dict[int, int]:
        """Shard -> lease epoch of every shard this pod delivers now (``{0: 0}`` without leases)."""
        return self._engines.shards()

    async def recover(self) -> None:
        """Rebuild from the store. Must complete before anything is delivered.

        Without shards: load everything into one engine. With shards: nothing to load yet; each
        shard is loaded by ``adopt_shard`` once its lease is held."""
        if self._recovered or self._recovery_started_ms is not None:
            raise RuntimeError(f"subscription {self.name!r}: recover() called twice")
        self._recovery_started_ms = self._recovery_progress_ms = self._clock()
        if self._shard_count is None:
            await self._load_shard(0, 0, None)
        self._recovered = True
        self._after_change()

    async def adopt_shard(self, shard: int, epoch: int) -> None:
        """This pod now owns ``shard`` at ``epoch``: load it from the store and deliver its keys.

        Retried while the store is unavailable; raises StoreError on a permanent error."""
        if self._shard_count is None or not 0 <= shard < self._shard_count:
            raise ValueError(f"subscription {self.name!r}: no shard {shard} to adopt")
        current = self._engines.get(shard)
        if current is not None:
            if current.epoch == epoch:
                return
            self.drop_shard(shard, current.epoch)
        self._recovery_progress_ms = self._clock()
        self._loads += 1
        try:
            await self._load_shard(shard, epoch, frozenset({shard}))
        finally:
            self._loads -= 1
            if not self._loads:
                self._budget = None  # the next load starts from what the engines hold then
        self.counters.shards_adopted += 1
        self._progress.set()
        self._after_change()

    def inbox_behind(self, shard: int, epoch: int) -> None:
        """Before ``adopt_shard``: the shard's inbox Listen has not handed over its first snapshot,
        which may come after the load and hold records a page restored. Until ``inbox_caught_up``
        the engine keeps admitting each record once (``ShardEngine.admit``) past the end of the load."""
        self._inbox_behind[shard] = epoch

    def inbox_caught_up(self, shard: int, epoch: int) -> None:
        """The shard's inbox Listen handed over its first snapshot: records are no longer remembered
        once the load has ended (a later copy is a duplicate of what the engine holds, or finished)."""
        if self._inbox_behind.get(shard) == epoch:
            del self._inbox_behind[shard]
        entry = self._engines.get(shard)
        loader = self._loaders.get(shard)
        if entry is not None and entry.epoch == epoch and (loader is None or loader.done()):
            entry.handed = None

    def _progress_counter(self) -> Callable[[int], None]:
        """A ``progress`` callback for one store read: documents read count towards recovery."""
        seen = 0

        def progress(documents: int) -> None:
            nonlocal seen
            self.recovered_documents += documents - seen
            seen = documents
            self._recovery_progress_ms = self._clock()

        return progress

    async def _load_shard(self, shard: int, epoch: int, shards: frozenset[int] | None) -> None:
        """Load a shard in two steps (docs/store.md, "Recovery"): its cursors, after which its
        engine exists and delivers, then its pending messages page by page in a task of their own
        (``_load_pending``), each page restored into the engine as it arrives."""
        extra: dict[str, object] = {} if shards is None else {"shards": shards}
        budget = self._payload_budget()
        self._state_loads += 1
        self._states_read.clear()
        try:
            snapshot = await self._retry_store(
                self._store.load,
                progress=self._progress_counter(),
                max_payload_bytes=budget,
                pending=False,
                epoch=None if self._shard_count is None else epoch,
                **extra,
            )
        finally:
            self._state_loads -= 1
            if not self._state_loads:
                self._states_read.set()
        engine = Engine.restore(
            self._config,
            snapshot,
            self._clock(),
            id_prefix=self._engines.engine_prefix(shard, epoch),
            cursor_source=functools.partial(self._store.cursor, self.name),
            loading=True,
            epoch=epoch,
        )
        entry = self._engines.add(shard, epoch, engine, 0)
        entry.handed = set()
        _LOGGER.info(
            "subscription %s recovered%s: %d key cursors; reading its pending messages",
            self.name,
            "" if shards is None else f" shard {shard} (epoch {epoch})",
            len(snapshot.cursors),
        )
        self._loads += 1
        loader = asyncio.create_task(self._load_pending(entry, shards, budget), name=f"load:{self.name}:{shard}")
        self._loaders[shard] = loader
        loader.add_done_callback(functools.partial(self._on_loader_done, shard))

    async def _load_pending(
        self, entry: ShardEngine, shards: frozenset[int] | None, budget: PayloadBudget | None
    ) -> None:
        """Restore the shard's pending messages into its loading engine, page by page, then end
        the load (gap timers, the watermark, the fast path and the messages stored meanwhile)."""
        restored = 0
        pages = self._store.pending_pages(self.name, shards, budget, self._progress_counter())
        try:
            while True:
                # The state of the shards being taken comes first: it is what readiness and their
                # first deliveries wait for, and the pages' reads would only queue ahead of it.
                await self._states_read.wait()
                try:
                    page = await anext(pages)
                except StopAsyncIteration:
                    break
                if self._engines.get(entry.shard) is not entry:
                    return  # dropped meanwhile: nothing of it is restored
                fresh = [message for message in page if entry.admit(message)]
                entry.engine.restore_pending(fresh, self._clock())
                entry.held_bytes += _held_size(fresh)
                restored += len(fresh)
                self._after_change()
        finally:
            await pages.aclose()
        if self._engines.get(entry.shard) is not entry:
            return
        if self._inbox_behind.get(entry.shard) != entry.epoch:
            entry.handed = None
        actions = entry.engine.finish_loading(self._clock())
        entry.held_bytes -= _held_size([a.message for a in actions if isinstance(a, DropDuplicate | DeadLetter)])
        self._apply(entry, actions)
        self._after_change()
        _LOGGER.info(
            "subscription %s%s loaded: %d pending messages",
            self.name,
            "" if self._shard_count is None else f" shard {entry.shard} (epoch {entry.epoch})",
            restored,
        )

    def _on_loader_done(self, shard: int, task: asyncio.Task[None]) -> None:
        if self._loaders.get(shard) is task:
            del self._loaders[shard]
        self._loads -= 1
        if not self._loads:
            self._budget = None  # the next load starts from what the engines hold then
        self._progress.set()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # A permanent StoreError (a corrupt document): nothing of the shard can be proven in order.
            self.failure = self.failure or _first_cause(exc)
            self._load_failed.set()
            _LOGGER.critical(
                "subscription %s: loading shard %d failed; its streams end", self.name, shard, exc_info=exc
            )
            for event in self._wakers:
                event.set()

    async def loaded(self) -> None:
        """Wait until every shard's pending messages are restored (``_load_pending``); raises the
        runtime's failure if a load failed for good."""
        while self._loaders:
            await asyncio.wait(list(self._loaders.values()))
        if self.failure is not None:
            raise SubscriptionUnavailable(self.unavailable_reason()) from self.failure

    @property
    def loading_shards(self) -> int:
        """Shards whose pending messages are still being read."""
        return len(self._loaders)

    def _payload_budget(self) -> PayloadBudget | None:
        """The payload bytes a load may keep in memory: what ``max_held_bytes`` leaves beside the
        engines' held messages, shared by every load that runs at the same time (each of 16 shard
        loads must not keep a whole budget). A retried load is charged again: more of it stripped,
        never more kept."""
        if self._max_held_bytes is None:
            return None
        if self._budget is None:
            self._budget = PayloadBudget(self._max_held_bytes - self.held_bytes)
        return self._budget

    def drop_shard(self, shard: int, epoch: int | None = None) -> bool:
        """Stop delivering ``shard`` at once (lost, or handed over): its engine and held messages are
        forgotten (they stay pending in the store), its in-flight ids become unknown. ``epoch``: only
        if the engine is still that epoch's. Returns whether an engine was dropped."""
        entry = self._engines.get(shard)
        if entry is None or (epoch is not None and entry.epoch != epoch):
            return False
        self._engines.remove(shard)
        if self._inbox_behind.get(shard) == entry.epoch:
            del self._inbox_behind[shard]
        loader = self._loaders.get(shard)
        if loader is not None:
            loader.cancel()
        self._store.release(self.name, frozenset({shard}))
        self._settle_all(entry)
        self.counters.shards_dropped += 1
        _LOGGER.warning(
            "subscription %s: shard %d (epoch %d) dropped; its keys are delivered by its next owner",
            self.name,
            shard,
            entry.epoch,
        )
        self._progress.set()
        for event in self._wakers:
            event.set()
        return True

    async def drain_shard(self, shard: int, timeout_seconds: float) -> None:
        """Before a graceful hand-over: hand out nothing more of ``shard``, wait (up to
        ``timeout_seconds``) until the app acked what it holds of it and those acks are durable,
        then write the shard's unwritten cursors and checkpoint (``Store.flush(shards=...)``), so
        that the next owner starts from a current checkpoint rather than folding tombstones."""
        entry = self._engines.get(shard)
        if entry is None:
            return
        entry.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while self._engines.get(shard) is entry and not self._drained(entry):
            remaining = deadline - loop.time()
            if remaining <= 0:
                _LOGGER.warning(
                    "subscription %s: shard %d handed over with messages still in flight (not confirmed: "
                    "its next owner delivers them again)",
                    self.name,
                    shard,
                )
                return
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                pass
        if self._engines.get(shard) is not entry:
            return
        try:
            # Bounded like the drain: the tombstones are durable already, so a flush that cannot
            # finish in time costs the next owner a longer load, never a message.
            await asyncio.wait_for(
                self._store.flush(self.name, frozenset({shard})), max(deadline - loop.time(), _HANDOVER_FLUSH_SECONDS)
            )
        except ShardLost as exc:
            self._shard_lost(exc)
        except (StoreError, TimeoutError) as exc:
            _LOGGER.warning(
                "subscription %s: shard %d handed over without its last checkpoint (%s); its next owner "
                "rebuilds the cursors from the tombstones",
                self.name,
                shard,
                exc or type(exc).__name__,
            )

    def _drained(self, entry: ShardEngine) -> bool:
        status, _ = entry.engine.status(self._clock(), max_keys=0)
        if status.in_flight:
            return False
        return (
            not any(
                self._engines.route(intent.message.key) == entry.shard
                for pending in self._acks_pending
                for intent in pending.intents
            )
            and self._acks_idle.is_set()
        )

    def is_live(self) -> bool:
        """False when recovery, or a shard load in progress, has made no progress for
        ``RECOVERY_STALL_SECONDS`` (or the runtime failed)."""
        if self.failure is not None:
            return False
        if (self._recovered and not self._loads) or self._recovery_progress_ms is None:
            return True
        return self._clock() - self._recovery_progress_ms < RECOVERY_STALL_SECONDS * 1000

    async def start(self) -> None:
        """Run the background work (timers, ack commits, dead letters) in a task of its own."""
        if self._task is not None:
            raise RuntimeError(f"subscription {self.name!r}: start() called twice")
        self._require_recovered()
        self._task = asyncio.create_task(self.run(), name=f"runtime:{self.name}")
        self._task.add_done_callback(self._on_task_done)

    async def run(self) -> None:
        """The background work; returns only by cancellation, raises if a worker fails for good."""
        self._require_recovered()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._timer_loop(), name=f"timer:{self.name}")
                group.create_task(self._ack_commit_loop(), name=f"acks:{self.name}")
                group.create_task(self._dead_letter_loop(), name=f"dead-letters:{self.name}")
                group.create_task(self._drop_loop(), name=f"drops:{self.name}")
                group.create_task(self._watch_loads(), name=f"loads:{self.name}")
        except BaseException as exc:
            # Waiting streams must learn that their acks will not be confirmed by this process.
            self._fail_pending_acks(SubscriptionUnavailable(f"subscription {self.name!r} stopped"))
            if not isinstance(exc, asyncio.CancelledError):
                self.failure = _first_cause(exc)
            raise

    async def _watch_loads(self) -> None:
        """Ends ``run()`` with the error of a shard load that failed for good (its task runs apart)."""
        await self._load_failed.wait()
        assert self.failure is not None
        raise self.failure

    async def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop delivering, let queued acks commit for up to ``grace_seconds``, then stop the workers.

        Idempotent. Messages still in flight stay pending in the store and are delivered again
        after a restart (an unconfirmed ack may cause one redelivery, G3).
        """
        self._stopping = True
        for event in self._wakers:
            event.set()  # streams notice is_ready is False and end
        for loader in list(self._loaders.values()):
            loader.cancel()
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
        """Messages the store made durable (PersistOutcome.STORED), in arrival order. Those of shards
        this pod does not own are left to their owner."""
        self._require_recovered()
        now_ms = self._clock()
        budget = self._max_held_bytes
        for message in messages:
            entry = self._engines.for_key(message.key)
            if entry is None:
                self.counters.not_owned += 1
                continue
            if not entry.admit(message):
                continue  # its record was restored from a page already: the engine has it
            engine = entry.engine
            actions = engine.on_stored(message, now_ms)
            payload = message.payload
            if payload is not None and (not actions or isinstance(actions[0], Hold)):
                # The budget covers payloads and the bookkeeping of every message not yet handed out.
                size = 0 if payload.stripped else payload_size(payload)
                overhead = HELD_MESSAGE_OVERHEAD_BYTES
                if size and actions and budget is not None and self.held_bytes + size + overhead > budget:
                    # Held for ordering and over the budget: the store keeps the payload meanwhile.
                    if engine.strip_payload(message):
                        self.counters.payloads_stripped += 1
                        size = 0
                entry.held_bytes += size + overhead
            self._apply(entry, actions)
        self._after_change()

    def take_fast(self, batch: Sequence[IncomingMessage]) -> list[Message | None]:
        """Sequence mode's in-order fast path (docs/store.md), per message of ``batch`` in order: when
        it is the first position its key is missing, at this pod, the key's owner, it goes to the
        engine without being stored, flagged ``volatile``, and is returned; the caller keeps its
        Pub/Sub ack until ``on_volatile_settled``. A copy of a fast-path message not yet settled
        (same position and content) is returned too, and kept beside its original: it is settled
        with it, so it is acked as a duplicate once the original's ack is durable, and given back
        to Pub/Sub with it otherwise. None: store it as usual."""
        self._require_recovered()
        now_ms = self._clock()
        taken: list[Message | None] = [self._take_one_fast(incoming, now_ms) for incoming in batch]
        if any(message is not None for message in taken):
            self._after_change()
        return taken

    def awaits_predecessor(self, incoming: IncomingMessage) -> bool:
        """Sequence mode: whether ``incoming``, which did not take the fast path, lies beyond the first
        position its key is missing at this pod, the key's owner (``Engine.awaits_predecessor``):
        ingest may keep it back a little for that position, so that both take the fast path."""
        entry = self._fast_entry(incoming)
        if entry is None:
            return False
        return entry.engine.awaits_predecessor(incoming.to_message(self._clock(), "", volatile=True))

    def _fast_entry(self, incoming: IncomingMessage) -> ShardEngine | None:
        """The engine that could take ``incoming`` by the fast path: this pod delivers its key now."""
        if incoming.sequence is None or incoming.replay_id or incoming.to_owner or self._stopping:
            return None
        entry = self._engines.for_key(incoming.key)
        if entry is None or entry.draining:
            return None
        if self.lease_check is not None and self.lease_check(entry.shard) != entry.epoch:
            return None
        return entry

    def _take_one_fast(self, incoming: IncomingMessage, now_ms: int) -> Message | None:
        entry = self._fast_entry(incoming)
        if entry is None:
            return None
        message = incoming.to_message(now_ms, "", volatile=True)
        if not entry.engine.fast_path(message):
            original = entry.engine.volatile_original(message)
            if original is None or id(original) not in entry.volatile:
                return None
            # Stored, it would cost a document and its tombstone, only to be dropped as a duplicate.
            entry.copies.setdefault(id(original), []).append(message)
            self.counters.fast_path_copies += 1
            return message
        entry.volatile[id(message)] = message
        self.counters.fast_path += 1
        self._apply(entry, entry.engine.on_stored(message, now_ms))
        return message

    def _settle(self, entry: ShardEngine, message: Message, safe: bool) -> None:
        if entry.volatile.pop(id(message), None) is None:
            return
        copies = entry.copies.pop(id(message), ())
        if safe:
            self.counters.fast_path_duplicates += len(copies)
        if self.on_volatile_settled is not None:
            self.on_volatile_settled(message, safe)
            for copy in copies:
                self.on_volatile_settled(copy, safe)

    def _settle_all(self, entry: ShardEngine) -> None:
        """The shard's engine is gone: every fast-path message it held goes back to Pub/Sub."""
        for message in list(entry.volatile.values()):
            self._settle(entry, message, False)

    def owner_epoch(self, key: str) -> int | None:
        """The lease epoch under which this pod delivers ``key`` now; None when it does not (another
        pod owns its shard, or none does yet, or it is being handed over). With leases this asks
        ``lease_check`` too, so a lease whose local deadline just passed counts as lost at once."""
        entry = self._engines.for_key(key)
        if entry is None or entry.draining:
            return None
        if self.lease_check is not None and self.lease_check(entry.shard) != entry.epoch:
            return None
        return entry.epoch

    @property
    def held_bytes(self) -> int:
        """Memory, estimated, of stored messages not yet handed out (held or ready): payloads kept
        plus ``HELD_MESSAGE_OVERHEAD_BYTES`` each."""
        return self._engines.held_bytes

    def advance_watermark(self, watermark_ms: int) -> None:
        self._require_recovered()
        now_ms = self._clock()
        for entry in self._engines:
            self._apply(entry, entry.engine.advance_watermark(watermark_ms, now_ms))
        self._after_change()

    def undelivered(self) -> int:
        """Messages releasable or in flight, not yet acked: what ingest's flow control counts.

        Messages held for ordering are not counted (DESIGN §4 "backpressure without deadlock").
        """
        return self._dead_letters_pending + sum(entry.engine.undelivered() for entry in self._engines)

    @property
    def dead_letters_pending(self) -> int:
        """Dead letters waiting to be published or recorded."""
        return self._dead_letters_pending

    # ---- delivery --------------------------------------------------------------------------

    def add_waker(self, event: asyncio.Event) -> None:
        """Register a stream's event: set whenever messages may be ready, or the runtime stops."""
        self._wakers.add(event)
        if self._engines.has_ready():
            event.set()

    def remove_waker(self, event: asyncio.Event) -> None:
        self._wakers.discard(event)

    def take(self, consumer: str, max_messages: int) -> list[Deliver]:
        """Up to ``max_messages`` releasable messages for ``consumer`` (none while not ready)."""
        if max_messages <= 0 or not self.is_ready:
            return []
        self._drop_expired_leases()
        now_ms = self._clock()
        deliveries: list[Deliver] = []
        for entry, delivery in self._engines.take(consumer, max_messages, now_ms):
            payload = delivery.message.payload
            # A fast-path message was never counted (its Pub/Sub lease and the client's flow control bound it).
            if delivery.attempt == 1 and payload is not None and not delivery.message.volatile:
                size = 0 if payload.stripped else payload_size(payload)
                entry.held_bytes = max(0, entry.held_bytes - size - HELD_MESSAGE_OVERHEAD_BYTES)
            deliveries.append(delivery)
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
        # The read took time (retried while the store is unavailable): what ``take`` checked then
        # (the lease within its margin, the shard still this engine's) may no longer hold. Nothing
        # is handed to an app on a check that is no longer true: a delivery of a shard dropped
        # meanwhile is not sent (its next owner delivers it).
        self._drop_expired_leases()
        out = []
        for delivery in deliveries:
            if self._engines.for_delivery(delivery.delivery_id) is None:
                self.counters.deliveries_withheld += 1
                continue
            payload = delivery.message.payload
            if payload is not None and payload.stripped:
                delivery = dataclasses.replace(delivery, message=by_ref[payload.ref])
            out.append(delivery)
        return out

    def submit_ack(self, consumer: str, delivery_ids: Sequence[str]) -> AckTicket:
        """Accept acks now (the engine holds their keys as "acking"); confirm once durable."""
        self._require_recovered()
        if self.failure is not None:
            raise SubscriptionUnavailable(f"subscription {self.name!r} failed: {self.failure!r}")
        self._drop_expired_leases()
        now_ms = self._clock()
        intents: list[AckIntent] = []
        unknown: list[str] = []
        for delivery_id in delivery_ids:
            entry = self._engines.for_delivery(delivery_id)
            try:
                if entry is None:
                    raise UnknownDelivery(delivery_id)
                intents.append(entry.engine.ack(consumer, delivery_id, now_ms))
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
        self._require_recovered()
        now_ms = self._clock()
        unknown: list[str] = []
        for delivery_id in delivery_ids:
            entry = self._engines.for_delivery(delivery_id)
            try:
                if entry is None:
                    raise UnknownDelivery(delivery_id)
                actions = entry.engine.nack(
                    consumer, delivery_id, now_ms, retry_after_ms=retry_after_ms, dead_letter=dead_letter
                )
            except UnknownDelivery:
                unknown.append(delivery_id)
                continue
            self._apply(entry, actions)
        self.counters.unknown_ids += len(unknown)
        self._after_change()
        return unknown

    def consumer_closed(self, consumer: str) -> None:
        """A stream ended: its in-flight messages are ready again at once, for any stream."""
        now_ms = self._clock()
        for entry in self._engines:
            entry.engine.consumer_closed(consumer, now_ms)
        self._after_change()

    def status(self, max_keys: int = 100) -> tuple[EngineStatus, list[KeyStatus]]:
        self._require_recovered()
        return self._engines.status(self._config.mode, self._clock(), max_keys)

    # ---- internals -------------------------------------------------------------------------

    async def unblock(self, key: str) -> Unblocked:
        """An operator skips the dead letter that blocks ``key``: recorded in the store first (a
        restart keeps it), then the engine delivers the key's next messages. Raises KeyNotBlocked
        when the key is not blocked, NotOwner when another pod delivers it, StoreError when the
        store cannot record it (nothing changed)."""
        self._require_recovered()
        async with self._unblock_lock:  # one at a time: the second of two sees the key running
            entry = self._engines.for_key(key)
            if entry is None:
                raise NotOwner(
                    f"key {key!r} of subscription {self.name!r} is delivered by another pod "
                    f"(shard {self._engines.route(key)} is not owned here); ask that pod"
                )
            if not entry.engine.is_blocked(key):
                raise KeyNotBlocked(f"key {key!r} of subscription {self.name!r} is not blocked by a dead letter")
            try:
                position = await self._store.unblock(
                    self.name, key, self._clock(), epochs=self._fenced({entry.shard: entry.epoch})
                )
            except ShardLost as exc:
                self._shard_lost(exc)
                raise
            if self._engines.get(entry.shard) is not entry:
                raise NotOwner(f"key {key!r} of subscription {self.name!r}: its shard was handed over meanwhile")
            message, actions = entry.engine.unblock(key, position, self._clock())
            self._apply(entry, actions)
        _LOGGER.warning(
            "subscription %s: key unblocked by an operator; its dead letter at %s is skipped",
            self.name,
            position,
            extra={"subscription": self.name, "key": key, "message_id": message.message_id if message else None},
        )
        self._after_change()
        return Unblocked(key, position, message.message_id if message is not None else None)

    def _require_recovered(self) -> None:
        if not self._recovered:
            raise SubscriptionUnavailable(f"subscription {self.name!r} is still recovering")

    def _apply(self, entry: ShardEngine, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, DeadLetter):
                self._dead_letters_pending += 1
                self._dead_letter_queue.put_nowait((entry, action))
            elif isinstance(action, DropDuplicate):
                if action.finish_record:
                    self._drops.append((entry, action.message))
                    self._drops_wake.set()
            elif isinstance(action, Hold):
                _LOGGER.debug("subscription %s holds %s: %s", self.name, action.message.dedup_id, action.reason)
            else:
                # Deliveries come only from take(): one here would be in flight with no stream.
                raise RuntimeError(f"engine returned {type(action).__name__} outside take(): {action!r}")

    def _drop_expired_leases(self) -> None:
        """Drop every shard whose lease is no longer held within its margin *now*: a pod that wakes
        from a pause must not hand out one more message before its lease manager has noticed."""
        check = self.lease_check
        if check is None:
            return
        for entry in self._engines:
            if check(entry.shard) != entry.epoch:
                self._lose(entry)

    def _fenced(self, epochs: dict[int, int]) -> dict[int, int] | None:
        """``epochs`` (shard -> the epoch a decision was made under) for the store, with leases;
        None without (one engine, never dropped: nothing to tell apart)."""
        return None if self._shard_count is None else epochs

    def _current(self, entry: ShardEngine) -> bool:
        """Whether ``entry`` still delivers its shard (not dropped or replaced since)."""
        return self._engines.get(entry.shard) is entry

    def _shard_lost(self, exc: ShardLost) -> None:
        """The store refused a write: this pod's lease on those shards has moved on. A shard this
        pod holds again at another epoch than the one lost is not dropped (only what was decided
        under the old epoch was refused)."""
        for shard in sorted(exc.shards):
            entry = self._engines.get(shard)
            if entry is not None and exc.lost_at(shard, entry.epoch):
                self._lose(entry)

    def _lose(self, entry: ShardEngine) -> None:
        """Drop a shard this pod learnt it no longer owns, and tell the lease manager."""
        if self.drop_shard(entry.shard, entry.epoch) and self.on_shard_lost is not None:
            self.on_shard_lost(entry.shard, entry.epoch)

    def _after_change(self) -> None:
        """Wake streams when messages are ready and the timer when an earlier timer appeared."""
        if self._wakers and self._engines.has_ready():
            for event in self._wakers:
                event.set()
        self._maybe_wake_timer()

    def _maybe_wake_timer(self) -> None:
        due_ms = self._engines.next_timer_ms()
        if due_ms is not None and (self._timer_due_ms is None or due_ms < self._timer_due_ms):
            self._timer_wake.set()

    async def _timer_loop(self) -> None:
        while True:
            now_ms = self._clock()
            due_ms = self._engines.next_timer_ms()
            if due_ms is not None and due_ms <= now_ms:
                for entry in self._engines:
                    entry_due = entry.engine.next_timer_ms()
                    if entry_due is not None and entry_due <= now_ms:
                        self._apply(entry, entry.engine.tick(now_ms))
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
        """Commits acks in batches (group commit). Acks of fast-path messages wait for their shards'
        next checkpoint (up to an interval): they are made durable in a task of their own, so that
        the batches behind them do not wait too."""
        running: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []

        def done(task: asyncio.Task[None]) -> None:
            running.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())  # type: ignore[arg-type]
            self._acks_wake.set()

        try:
            while True:
                await self._acks_wake.wait()
                self._acks_wake.clear()
                if failures:
                    raise failures[0]
                while self._acks_pending:
                    batch = _AckBatch(self._take_ack_batch())
                    fast = [intent for intent in batch.intents if intent.message.volatile]
                    stored = [intent for intent in batch.intents if not intent.message.volatile]
                    batch.parts = bool(fast) + bool(stored)
                    if fast:
                        task = asyncio.create_task(self._commit_acks(batch, fast), name=f"fast-acks:{self.name}")
                        running.add(task)
                        task.add_done_callback(done)
                    if stored:
                        await self._commit_acks(batch, stored)
                if not running and not self._acks_pending:
                    self._acks_idle.set()
                    self._progress.set()
        finally:
            for task in list(running):
                task.cancel()

    async def _commit_acks(self, batch: _AckBatch, intents: list[AckIntent]) -> None:
        """Make ``intents`` (part of ``batch``) durable, tell the engines, settle fast-path messages;
        the batch's tickets are answered once all its parts are done."""
        lost: frozenset[int] = frozenset()
        # Each ack goes to the store with the epoch its engine accepted it under: one accepted by
        # an engine dropped since (the shard lost, even if taken back at a new epoch) is refused,
        # never written under the new epoch nor confirmed (G3: its message is delivered again).
        epochs: dict[int, int] = {}
        current: list[AckIntent] = []
        for intent in intents:
            entry = self._engines.for_delivery(intent.delivery_id)
            if entry is None:
                self.counters.acks_fenced += 1
                batch.refused.add(intent.delivery_id)
            else:
                epochs[entry.shard] = entry.epoch
                current.append(intent)
        intents = current
        try:
            if intents:
                await self._retry_store(self._store.commit_acks, intents, epochs=self._fenced(epochs))
        except ShardLost as exc:
            # Everything outside ``exc.shards`` is durable; acks inside are not, and never
            # will be by this pod: not confirmed, so the next owner delivers them again.
            lost = frozenset(shard for shard in exc.shards if exc.lost_at(shard, epochs.get(shard, -1)))
            self._shard_lost(exc)
        except BaseException as exc:
            error = SubscriptionUnavailable(f"acks of {self.name!r} could not be made durable: {exc!r}")
            for pending in batch.pending:
                if not pending.future.done():
                    pending.future.set_exception(error)
            raise
        self.counters.ack_commits += 1
        now_ms = self._clock()
        durable: dict[int, tuple[ShardEngine, list[str]]] = {}
        settled: list[tuple[ShardEngine, Message]] = []
        for intent in intents:
            if lost and self._engines.route(intent.message.key) in lost:
                self.counters.acks_fenced += 1
                batch.refused.add(intent.delivery_id)
                continue
            entry = self._engines.for_delivery(intent.delivery_id)
            if entry is not None:
                durable.setdefault(entry.shard, (entry, []))[1].append(intent.delivery_id)
                if intent.message.volatile:
                    settled.append((entry, intent.message))
        for entry, ids in durable.values():
            self._apply(entry, entry.engine.ack_durable(ids, now_ms))
        for entry, message in settled:
            self._settle(entry, message, True)  # its ack is durable: Pub/Sub may forget it
        batch.parts -= 1
        if batch.parts == 0:
            for pending in batch.pending:
                if not pending.future.done():
                    pending.future.set_result(
                        [intent.delivery_id for intent in pending.intents if intent.delivery_id not in batch.refused]
                    )
        self._progress.set()
        self._after_change()

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
                entry, action = await self._dead_letter_queue.get()
                group.create_task(self._dead_letter_one(entry, action), name=f"dead-letter:{self.name}")

    async def _dead_letter_one(self, entry: ShardEngine, action: DeadLetter) -> None:
        try:
            if action.reason == REASON_BELOW_CURSOR and await self._finished_elsewhere(action.message):
                # A stale copy (a Listen snapshot older than this pod's own ack of it): nothing to do.
                _LOGGER.info("subscription %s: %s was already finished", self.name, action.message.dedup_id)
            else:
                await self._publish_dead_letter(action)
                state = DEAD_LETTERED if action.in_order else DEAD_LETTERED_ASIDE
                try:
                    await self._retry_store(
                        self._store.mark_done, [action.message], state, epochs=self._fenced({entry.shard: entry.epoch})
                    )
                except ShardLost as exc:
                    # The topic has it; the next owner loads it pending and may dead-letter it again.
                    self._shard_lost(exc)
                except StoreError:
                    # The topic has it (G1 holds); unmarked, it is loaded and dead-lettered again after a restart.
                    _LOGGER.exception(
                        "subscription %s: could not record dead letter %s", self.name, action.message.dedup_id
                    )
        finally:
            self._dead_letters_pending -= 1
        if self._current(entry):
            self._apply(entry, entry.engine.dead_letter_done(action.message, self._clock()))
            if action.message.volatile:
                self._settle(entry, action.message, True)  # the topic has it, and its record says so
        self._after_change()

    async def _finished_elsewhere(self, message: Message) -> bool:
        """Whether ``message``'s record is no longer pending in the store (read back to check)."""
        if message.payload is None or not message.payload.ref:
            return False
        try:
            await self._retry_store(self._store.read_payloads, [message])
        except StoreRejected:
            return True
        return False

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
                current = [(entry, message) for entry, message in batch if self._current(entry)]
                if not current:
                    continue
                messages = [message for _, message in current]
                epochs = {entry.shard: entry.epoch for entry, _ in current}
                try:
                    await self._retry_store(self._store.mark_done, messages, DROPPED, epochs=self._fenced(epochs))
                except ShardLost as exc:
                    self._shard_lost(exc)  # the next owner finds them pending and drops them again
                except StoreError:
                    # Harmless: an unmarked duplicate is loaded again and dropped again by the engine.
                    _LOGGER.exception(
                        "subscription %s: could not record %d dropped duplicates", self.name, len(messages)
                    )

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
    return backoff_seconds(attempt, _RETRY_INITIAL_SECONDS, _RETRY_MAXIMUM_SECONDS)


def _held_size(messages: Sequence[Message]) -> int:
    """What ``messages`` weigh against ``max_held_bytes``: payloads kept plus the bookkeeping."""
    return sum(
        payload_size(m.payload) for m in messages if m.payload is not None and not m.payload.stripped
    ) + HELD_MESSAGE_OVERHEAD_BYTES * len(messages)


def _shard(key: str, count: int) -> int:
    return shard_of(key, count)


def _first_cause(exc: BaseException) -> BaseException:
    """The worker's own error rather than the TaskGroup's wrapper, for ``failure`` and error messages."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
