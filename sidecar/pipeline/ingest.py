"""Ingest: Pub/Sub StreamingPull -> classify -> the runtime's fast path, or store.persist
(batched) -> runtime -> ack.

Rules (G1 in DESIGN §1 depends on each of them):

- **Ack only what is safe.** A Pub/Sub message is acked only after the store said it is durable
  (STORED, after ``runtime.on_stored``; or DUPLICATE: an earlier copy is durable), after its app ack
  is durable (the in-order fast path: ``runtime.take_fast``, settled by ``on_volatile_settled``), or
  after the dead-letter topic accepted it (malformed, CONFLICT, or rejected by the store for good).
  Nothing is ever acked on a failure path, and nothing is ever dropped: a message not acked is
  nacked or left to its lease, and Pub/Sub delivers it again.
- **Sorted as they come** (``_batch_loop``): the fast path first, then a message whose key has a
  write under way waits for it once (``_defer``), a message beyond its key's first missing
  position waits a little for that position, unstored (``_hold``), and the rest is stored in
  batches; a message waiting is offered to the fast path again when its key takes it or has a
  message stored, and just before its batch is written (docs/ingest.md).
- **Threads.** The subscriber's callback runs on the event loop: ``LoopScheduler``
  (``sidecar.pipeline.ingest_scheduler``) takes the messages from the client's threads and runs the callbacks on
  the loop, many per wake-up. Everything happens on the loop but the client's own work.
- **Store failure: nack after a backoff.** FAILED results and ``StoreError`` keep the message leased
  for a capped exponential backoff (with jitter, growing with consecutive failed batches), then nack
  it so that Pub/Sub redelivers it at once. Chosen over letting the lease lapse because the lease
  is the client's business (its leaser extends it for up to ``max_lease_duration``, one hour by
  default) and a lapse would take an ack deadline or that hour; an immediate nack would make a
  hot redelivery loop during a store outage. While messages wait out their backoff they still
  count against the client's flow control, so pulling slows down by itself during an outage.
- **Dead letters.** Malformed messages and CONFLICTs are published to the dead-letter topic,
  retried with backoff until the topic takes them (the client keeps the lease meanwhile), and
  acked only then. A subscription without a ``dead_letter_topic`` cannot do that: such a message
  is nacked after the maximum backoff, so it stays in Pub/Sub (where the subscription's own
  dead-letter policy, if any, applies) and an error is logged each time.
- **Flow control, two levels.** ``FlowControl(max_messages, max_bytes)`` bounds what the client
  holds un-acked (received, being classified, persisted or dead-lettered). Above that, when
  ``runtime.undelivered()`` (messages releasable or in flight to the app, never those held for
  ordering: DESIGN §4, backpressure without deadlock) exceeds ``max_undelivered_messages``, no new
  batch is persisted. Received messages are then held un-acked, so the client's flow control
  fills up and pauses the stream, and Pub/Sub keeps the backlog. Chosen over cancelling and
  restarting the streaming pull because a cancel nacks what the client holds (a redelivery burst on
  resume), restarts cost a new stream, and the held messages are exactly what is persisted first on
  resume. ``undelivered`` is re-read every ``pause_poll_seconds`` while paused (the runtime has no
  "acked" event to wait on); pulling resumes once it is back at or under the limit.
- **Failure is loud, and reported.** Every StreamingPull attempt is watched (``sidecar.pipeline.ingest_watch``
  reports each one's end to ``pull_health``, a ``sidecar.pipeline.pull_health.PullHealth``): the client
  retries transient stream errors by itself and silently, and /readyz, GetStatus and the metrics
  say when they last (10 s). A streaming pull the client closed for good (NOT_FOUND: a deleted
  subscription, PERMISSION_DENIED, UNAUTHENTICATED, INVALID_ARGUMENT) is logged at ERROR naming the
  subscription and the status, reported at once, and opened again after a backoff (1 s doubling to
  30 s, reset once a stream works), so that the pod recovers when the subscription or permission is
  back; messages held from the closed pull are settled as usual (their acks are lost with it, and
  Pub/Sub redelivers them: duplicates). Any other end of the pull or of the batching worker (a bug)
  makes ``run()`` raise ``IngestError``.
- **Stop.** ``stop()`` takes no new batch, lets persists and dead-letter publishes in progress
  finish within the grace period and acks what they made safe, stops the streaming pull (the client
  sends queued acks before its dispatcher stops), and then nacks everything else it holds with its
  own ModifyAckDeadline calls: nacked on the open stream, they would come straight back to it.
- Payloads never appear in logs; ids, counts and reasons do. Only this module (with its scheduler,
  ``sidecar.pipeline.ingest_scheduler``, and its transport, ``sidecar.pipeline.ingest_watch``, which it alone uses) and
  ``sidecar.dead_letters.publisher`` import Pub/Sub.

Known limit: the Python client hands messages that carry a Pub/Sub ``ordering_key`` to the callback
one per ordering key at a time, until the previous one is acked or nacked. Such keys therefore
ingest one message per persist round trip (about ``batch_window_seconds`` plus a store commit).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber.futures import StreamingPullFuture
from google.cloud.pubsub_v1.subscriber.message import Message as PubsubMessage

from sidecar.backoff import backoff_seconds
from sidecar.config.model import SequenceOrdering, SubscriptionConfig
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.engine.types import Message
from sidecar.pipeline.classify import Malformed, classify
from sidecar.pipeline.ingest_scheduler import LoopScheduler
from sidecar.pipeline.ingest_watch import watched_transport
from sidecar.pipeline.pull_health import PullHealth
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.store.api import IncomingMessage, PersistOutcome, Store, StoreError, StoreRejected

_LOGGER = logging.getLogger(__name__)

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_ONE_MS = datetime.timedelta(milliseconds=1)

_MAX_BATCH_MESSAGES = 500
"""Firestore's BatchWrite takes at most 500 writes: one persist call maps onto one such request."""

_MAX_BATCH_BYTES = 8 * 1024 * 1024
"""Bounds the data of one persist call (Firestore requests are capped at 10 MiB; the store splits
larger messages itself, this keeps one call's memory and latency bounded)."""

_BATCH_WINDOW_SECONDS = 0.010
"""Wait this long for a batch to fill: 10 ms adds little latency next to a store commit, and at
1,000 msg/s it turns ten single-message commits into one."""

_PREDECESSOR_WAIT_SECONDS = 0.150
"""Sequence mode with the fast path: how long a message beyond its key's first missing position
waits, unstored, for that position (``_hold``). A publisher's swapped pair arrives a few messages
apart: if the missing one comes meanwhile, both take the fast path, and neither costs a document
(create and tombstone). Waiting delays no delivery: the message could not be delivered before its
predecessor anyway, and is offered to the fast path the moment that one takes it."""

_MAX_CONCURRENT_PERSISTS = 2
"""Two persist calls overlap so that one batch fills while the previous one commits."""

_BACKOFF_INITIAL_SECONDS = 0.25
"""First nack delay after a failed persist: store blips usually clear within this."""

_BACKOFF_MAXIMUM_SECONDS = 10.0
"""Cap on the nack delay and the dead-letter retry delay: an outage costs one redelivery per message
per 10 s, and a recovered store or topic is used again within 10 s."""

_PAUSE_POLL_SECONDS = 0.05
"""How often ``undelivered`` is re-read while pulling is paused: a fraction of an app's ack latency."""

_MAX_LEASE_DURATION_SECONDS = 3600.0
"""The client's default: a message held longer is released from lease management and redelivered
(harmless: the copy is a DUPLICATE by then, or persisted if the first never was)."""

_DRAIN_GRACE_SECONDS = 10.0
"""Default wait in ``stop()`` for persists and dead-letter publishes in progress."""

_MAX_IDS_PER_MODACK = 1000
"""Pub/Sub accepts at most 1000 ack ids per ModifyAckDeadline call."""

_PULL_SHUTDOWN_SECONDS = 10.0
"""How long ``stop()`` waits for the client to shut the stream down and flush its acks and nacks."""

_STREAM_THREAD_EXIT_SECONDS = 2.0
"""How long ``stop()`` then waits for the client's stream thread to end before closing the client.
It ends within a second unless it is inside a retried attempt to reopen a failing stream (retries
sleep up to 60 s): closing the channel under it would make it fail with a traceback."""

_REOPEN_INITIAL_SECONDS = 1.0
"""First wait before a streaming pull closed for good is opened again (a subscription recreated at
once, a permission granted back)."""

_REOPEN_MAXIMUM_SECONDS = 30.0
"""Cap on that wait: a fixed subscription is pulled again within 30 s, and a lasting refusal costs
two StreamingPull calls a minute."""

_STREAM_THREAD_NAME = "Thread-ConsumeBidirectionalStream"
"""The name google-api-core gives the thread that reads a StreamingPull stream (``bidi.py``)."""


class IngestError(Exception):
    """Ingest cannot continue for this subscription (e.g. the streaming pull ended for good)."""


@dataclass(slots=True)
class IngestCounters:
    """Cumulative counts for metrics; plain attributes read by the observability layer."""

    received: int = 0
    """Pub/Sub deliveries handed to the callback (redeliveries included)."""
    fast_path: int = 0
    """Messages the runtime's fast path took, never stored: in order (delivered without a document),
    or copies of such a message still unsettled (acked with it: the runtime's ``fast_path_copies``)."""
    deferred: int = 0
    """Messages that waited for a persist of their key in progress before trying the fast path again."""
    held: int = 0
    """Messages kept back, unstored, for their key's missing position (``Ingestor._hold``)."""
    malformed: int = 0
    duplicates: int = 0
    persisted: int = 0
    """Messages the store newly made durable (STORED)."""
    persist_failures: int = 0
    """Messages whose persist failed (each is nacked after a backoff and comes back)."""
    persist_batches: int = 0
    conflicts: int = 0
    rejected: int = 0
    """Messages the store refused for good (StoreRejected): dead-lettered."""
    dead_lettered: int = 0
    dead_letter_failures: int = 0
    acked: int = 0
    nacked: int = 0
    pauses: int = 0
    """Times pulling paused because ``undelivered`` was over ``max_undelivered_messages``."""
    stored_for_owner: int = 0
    """Messages stored for the pod that owns their key's shard (several pods on one subscription)."""
    owner_changed: int = 0
    """Messages stored while this pod's lease on their shard moved on: nacked, redelivered, marked."""


@dataclass(slots=True)
class _Item:
    """A received message waiting to be persisted, with what classify made of it."""

    message: PubsubMessage
    incoming: IncomingMessage
    deferred: bool = False
    """It already waited once for its key's persist (``Ingestor._defer``): never twice."""


class Ingestor:
    """Pulls one subscription, persists what it receives, acks only what the store made durable."""

    def __init__(
        self,
        sub_config: SubscriptionConfig,
        store: Store,
        runtime: SubscriptionRuntime,
        dead_letters: DeadLetterPublisher,
        *,
        subscriber: pubsub_v1.SubscriberClient | None = None,
        max_batch_messages: int = _MAX_BATCH_MESSAGES,
        max_batch_bytes: int = _MAX_BATCH_BYTES,
        batch_window_seconds: float = _BATCH_WINDOW_SECONDS,
        max_concurrent_persists: int = _MAX_CONCURRENT_PERSISTS,
        backoff_initial_seconds: float = _BACKOFF_INITIAL_SECONDS,
        backoff_maximum_seconds: float = _BACKOFF_MAXIMUM_SECONDS,
        pause_poll_seconds: float = _PAUSE_POLL_SECONDS,
        max_lease_duration_seconds: float = _MAX_LEASE_DURATION_SECONDS,
        clock: Callable[[], int] | None = None,
        fast_path: bool | None = None,
        predecessor_wait_seconds: float = _PREDECESSOR_WAIT_SECONDS,
    ) -> None:
        if max_batch_messages < 1:
            raise ValueError(f"max_batch_messages must be >= 1, got {max_batch_messages}")
        if max_concurrent_persists < 1:
            raise ValueError(f"max_concurrent_persists must be >= 1, got {max_concurrent_persists}")
        if not 0 < backoff_initial_seconds <= backoff_maximum_seconds:
            raise ValueError("backoff: need 0 < backoff_initial_seconds <= backoff_maximum_seconds")
        self._config = sub_config
        self.name = sub_config.name
        self.subscription_path = sub_config.subscription
        self._store = store
        self._runtime = runtime
        self._dead_letters = dead_letters
        self._subscriber = subscriber
        self._owns_subscriber = subscriber is None
        flow = sub_config.flow_control
        self._max_undelivered = flow.max_undelivered_messages
        self._flow_control = pubsub_v1.types.FlowControl(
            max_messages=flow.max_outstanding_messages,
            max_bytes=flow.max_outstanding_bytes,
            max_lease_duration=max_lease_duration_seconds,
            # Caps every lease extension, the receipt modack and the stream ack deadline alike, so
            # a message this process pulled is redelivered at most this long after a crash (without
            # it the client stretches extensions to the 99th percentile of its ack times, up to
            # 600 s, once persists were slow). 0 leaves it to the client (docs/ingest.md). An int:
            # the client copies it into int32 request fields, and a float fails every request.
            max_duration_per_lease_extension=(flow.max_lease_extension_ms or 0) // 1000,
        )
        self._max_batch_messages = max_batch_messages
        self._max_batch_bytes = max_batch_bytes
        self._batch_window_seconds = batch_window_seconds
        self._max_concurrent_persists = max_concurrent_persists
        self._predecessor_wait_seconds = predecessor_wait_seconds
        self._backoff_initial_seconds = backoff_initial_seconds
        self._backoff_maximum_seconds = backoff_maximum_seconds
        self._pause_poll_seconds = pause_poll_seconds
        self._clock = clock if clock is not None else runtime.now_ms

        self.counters = IngestCounters()
        self.pull_health = PullHealth(lambda: self.counters.received)
        """What the StreamingPull attempts say (readiness, GetStatus, metrics)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pull: StreamingPullFuture | None = None
        self._scheduler: LoopScheduler | None = None
        self._stream_threads: list[threading.Thread] = []
        self._handoff_runs_before = 0
        """``handoff_runs`` of the schedulers of earlier pulls (one per ``_subscribe``)."""
        self._pull_done: asyncio.Future[Any] | None = None
        """``_pull`` as an asyncio future; it ends cancelled after our own ``_pull.cancel()``."""
        self._worker: asyncio.Task[None] | None = None
        self._pending: collections.deque[_Item] = collections.deque()
        """Received, not yet sorted (``_sort_pending``): fast path, deferred, or to store."""
        self._to_store: collections.deque[_Item] = collections.deque()
        """Sorted, to be stored: batched for up to ``batch_window_seconds``, then a free persist slot."""
        self._to_store_bytes = 0
        self._held: collections.deque[tuple[float, _Item]] = collections.deque()
        """(until, item): messages waiting, unstored, for their key's missing position (``_hold``),
        in the order they came (so by ``until``)."""
        self._to_store_since = 0.0
        """When the oldest of ``_to_store`` was queued (``time.monotonic``)."""
        self._wake = asyncio.Event()
        """Set when the batch loop may have work: a message received, a persist slot freed,
        deferred messages back."""
        self._persist_slots = asyncio.Semaphore(max_concurrent_persists)
        self._persisting_messages = 0
        """Messages in a persist under way (``_persist_batch``)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._unsettled: dict[str, PubsubMessage] = {}
        """ack_id -> message received and neither acked nor nacked yet: what stop() gives back."""
        self._nack_timers: dict[str, asyncio.TimerHandle] = {}
        ordering = sub_config.ordering
        configured = isinstance(ordering, SequenceOrdering) and ordering.fast_path
        self._fast_path = configured if fast_path is None else fast_path and configured
        """The in-order fast path (``runtime.take_fast``): sequence mode, ``ordering.fast_path``."""
        self._fast: dict[int, PubsubMessage] = {}
        """Fast-path messages (``runtime.take_fast``) by ``id`` of the engine's message: their Pub/Sub
        ack waits for ``runtime.on_volatile_settled``."""
        runtime.on_volatile_settled = self._settled
        self._persisting: collections.Counter[str] = collections.Counter()
        """Keys with messages in a persist in progress (fast path only): how many."""
        self._deferred: dict[str, list[_Item]] = {}
        """Messages waiting, by key, for the persists of their key in progress (``_defer``)."""
        self._consecutive_failures = 0
        self._task_failure: BaseException | None = None
        self._paused = False
        self._stopping = False
        self._stopped = False

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        """True while no batch is persisted because ``undelivered`` is over the limit."""
        return self._paused

    @property
    def is_healthy(self) -> bool:
        """Pulling and processing: started, not stopping, neither the stream nor the worker ended, and
        the StreamingPull attempts do not fail (``pull_health``)."""
        return (
            not self.pull_health.is_failing()
            and self._pull_done is not None
            and not self._pull_done.done()
            and self._worker is not None
            and not self._worker.done()
            and not self._stopping
        )

    @property
    def held_messages(self) -> int:
        """Messages received and not yet acked or nacked (persisting, waiting, or dead-lettering)."""
        return len(self._unsettled)

    def stages(self) -> dict[str, int]:
        """Messages received and not settled, by where they wait now (the ``ingest_messages`` gauge):
        an operator's view of a stall between Pub/Sub and the engine."""
        return {
            "handoff": self.handoff_buffered,
            "unsorted": len(self._pending),
            "held": len(self._held),
            "deferred": sum(len(items) for items in self._deferred.values()),
            "to_store": len(self._to_store),
            "storing": self._persisting_messages,
            "fast_path": len(self._fast),
            "nack_scheduled": len(self._nack_timers),
            "unsettled": len(self._unsettled),
        }

    async def start(self) -> None:
        """Open the streaming pull. The runtime must have recovered (it receives what is stored)."""
        if self._pull is not None:
            raise RuntimeError(f"ingest of {self.name!r}: start() called twice")
        if self._stopping:
            raise RuntimeError(f"ingest of {self.name!r}: start() after stop()")
        if not self._runtime.is_ready:
            raise RuntimeError(f"ingest of {self.name!r}: the subscription runtime has not recovered")
        self._loop = asyncio.get_running_loop()
        if self._subscriber is None:
            # Made here, not at import: it reads PUBSUB_EMULATOR_HOST at construction.
            self._subscriber = pubsub_v1.SubscriberClient(transport=watched_transport(self.pull_health))
        self._worker = asyncio.create_task(self._batch_loop(), name=f"ingest:{self.name}")
        self._subscribe()
        _LOGGER.info(
            "ingest of %s started on %s (max outstanding %d messages, max undelivered %s, max lease extension %s)",
            self.name,
            self.subscription_path,
            self._flow_control.max_messages,
            self._max_undelivered,
            _describe_seconds(self._flow_control.max_duration_per_lease_extension),
        )

    def _subscribe(self) -> None:
        """Open a streaming pull (at start, and again after one was closed for good)."""
        assert self._subscriber is not None and self._loop is not None
        threads_before = set(threading.enumerate())
        if self._scheduler is not None:
            self._handoff_runs_before += self._scheduler.runs
        self._scheduler = LoopScheduler(self._loop)
        self._pull = self._subscriber.subscribe(
            self.subscription_path,
            callback=self._on_message,
            flow_control=self._flow_control,
            # Annotated ThreadScheduler, but the manager uses only the abstract Scheduler's
            # queue/schedule/shutdown, and the docstring asks for any scheduler.
            scheduler=self._scheduler,  # type: ignore[arg-type]
            # The shutdown then waits for a run of callbacks the loop is in, so that once the pull
            # future is done every message handed to us has reached _on_message (stop() gives them
            # all back); the scheduler returns the rest, and the client nacks those.
            await_callbacks_on_shutdown=True,
        )
        # subscribe() starts the stream's reader thread before it returns: the one new thread of that
        # name is ours. stop() closes the client only once that thread ended.
        self._stream_threads = [t for t in self._stream_threads if t.is_alive()] + [
            t for t in threading.enumerate() if t not in threads_before and t.name == _STREAM_THREAD_NAME
        ]
        self._pull_done = asyncio.wrap_future(self._pull)

    async def run(self) -> None:
        """Start if needed and wait until ``stop()``; raises ``IngestError`` if pulling ends otherwise."""
        if self._pull is None:
            await self.start()
        while True:
            assert self._pull_done is not None and self._worker is not None
            try:
                # asyncio.wait never cancels what it waits on: a cancelled run() leaves both to _abort().
                await asyncio.wait({self._pull_done, self._worker}, return_when=asyncio.FIRST_COMPLETED)
                if self._stopping:
                    return
                closed = self._closed_for_good()
                if closed is None:
                    break
                if not await self._reopen_after(closed):
                    return  # stopped meanwhile
            except asyncio.CancelledError:
                if not self._stopping:
                    self._abort()
                raise
        failure = self._failure()
        self._abort()
        raise failure

    def _closed_for_good(self) -> api_exceptions.GoogleAPICallError | None:
        """The Pub/Sub error the client closed the streaming pull with, while the worker runs on;
        None when something else ended (a bug, or our callback's failure): ``run()`` raises then."""
        assert self._pull_done is not None and self._worker is not None
        if self._worker.done() or self._task_failure is not None or not self._pull_done.done():
            return None
        if self._pull_done.cancelled():
            return None
        exc = self._pull_done.exception()
        return exc if isinstance(exc, api_exceptions.GoogleAPICallError) else None

    async def _reopen_after(self, error: api_exceptions.GoogleAPICallError) -> bool:
        """Report the close, wait out the backoff, and pull again; False when ``stop()`` came first
        (the worker's end also ends the wait: ``run()`` then raises its failure)."""
        assert self._worker is not None
        status = error.grpc_status_code
        code = status.name if status is not None else type(error).__name__
        delay = backoff_seconds(
            self.pull_health.consecutive_closes + 1, _REOPEN_INITIAL_SECONDS, _REOPEN_MAXIMUM_SECONDS
        )
        self.pull_health.closed(code, error.message or str(error), delay)
        _LOGGER.error(
            "streaming pull of %s (subscription %r) was closed by Pub/Sub: %s; nothing is received until it "
            "works again, /readyz answers 503; opening it again in %.1fs",
            self.subscription_path,
            self.name,
            _describe(error),
            delay,
        )
        # The worker ends only by stop() (which cancels it) or a failure: either ends the wait.
        await asyncio.wait({self._worker}, timeout=delay)
        if self._stopping:
            return False
        if not self._worker.done():
            self._subscribe()
        return True

    async def stop(self, grace_seconds: float = _DRAIN_GRACE_SECONDS) -> None:
        """Take no new work, finish what is in progress within ``grace_seconds``, give back the rest.

        Idempotent. Order: stop batching -> drain persists and dead-letter publishes (their acks go
        out through the client) -> stop the streaming pull (which flushes those acks) -> nack every
        message still held -> close the client.
        """
        if self._stopped:
            return
        self._stopping = True
        self._stopped = True
        errors: list[BaseException] = []
        if self._worker is not None:
            self._worker.cancel()
            await _wait_cancelled(self._worker)
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace_seconds)
            if pending:
                _LOGGER.warning(
                    "ingest of %s: %d persists or dead-letter publishes unfinished after %.1fs; their "
                    "messages are given back",
                    self.name,
                    len(pending),
                    grace_seconds,
                )
            for task in pending:
                task.cancel()
            for task in list(self._tasks):
                await _wait_cancelled(task)
        if self._pull is not None and self._pull_done is not None:
            self._pull.cancel()
            # asyncio.wait, not await: once cancel() was called the client's future reports itself
            # cancelled, so the wrapper ends "cancelled" when the shutdown completes; that is success.
            done, _ = await asyncio.wait({self._pull_done}, timeout=_PULL_SHUTDOWN_SECONDS)
            if not done:
                errors.append(IngestError(f"ingest of {self.name!r}: streaming pull did not shut down"))
            elif not self._pull_done.cancelled():
                self._pull_done.exception()  # retrieved: a failure was reported by run() already
        await self._give_back()
        if self._owns_subscriber and self._subscriber is not None:
            if await self._stream_threads_ended(_STREAM_THREAD_EXIT_SECONDS):
                try:
                    self._subscriber.close()
                except Exception as exc:
                    errors.append(exc)
            else:
                # Its channel stays open: closed under the thread's retry, the next attempt would fail
                # with "Cannot invoke RPC: Channel closed!". The thread is a daemon and ends with the
                # process, which is what a stop is followed by.
                _LOGGER.warning(
                    "ingest of %s: the Pub/Sub stream thread is still retrying to reopen the stream; "
                    "leaving its client open",
                    self.name,
                )
        if errors:
            raise IngestError(f"ingest of {self.name!r} stopped with errors: {errors!r}") from errors[0]

    async def _stream_threads_ended(self, timeout_seconds: float) -> bool:
        deadline = time.monotonic() + timeout_seconds
        for thread in self._stream_threads:
            await asyncio.to_thread(thread.join, max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._stream_threads)

    async def ping(self, timeout_seconds: float = 5.0) -> bool:
        """True if Pub/Sub answers for this subscription now (GetSubscription); for readiness checks."""
        subscriber = self._subscriber
        if subscriber is None:
            return False
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                loop.run_in_executor(
                    None,
                    lambda: subscriber.get_subscription(
                        subscription=self.subscription_path, retry=None, timeout=timeout_seconds
                    ),
                ),
                timeout_seconds + 1.0,
            )
        except (api_exceptions.GoogleAPICallError, TimeoutError, ValueError) as exc:
            _LOGGER.warning("ingest of %s: Pub/Sub ping failed: %s", self.name, exc)
            return False
        return True

    @property
    def handoff_runs(self) -> int:
        """Times the loop took received messages from the client's threads (one wake-up each)."""
        return self._handoff_runs_before + (0 if self._scheduler is None else self._scheduler.runs)

    @property
    def handoff_buffered(self) -> int:
        """Messages the client received and the loop has not taken yet (not yet in ``received``)."""
        return 0 if self._scheduler is None else self._scheduler.buffered()

    # ---- receiving (on the loop, from LoopScheduler) ---------------------------------------

    def _on_message(self, message: PubsubMessage) -> None:
        """The subscriber's callback; ``LoopScheduler`` runs it on the loop."""
        self.counters.received += 1
        self._unsettled[message.ack_id] = message
        if self._stopping:
            return  # held; stop() nacks it with the rest
        attributes = dict(message.attributes)
        try:
            result = classify(
                self._config,
                message.data,
                attributes,
                message.ordering_key,
                message.message_id,
                _publish_time_ms(message),
            )
        except Exception:
            # A bug of ours, not the message's fault: never dead-letter on it, never crash on it.
            _LOGGER.exception("ingest of %s: classify failed on message %s", self.name, message.message_id)
            self._nack_later(message, self._backoff_maximum_seconds)
            return
        if isinstance(result, Malformed):
            self.counters.malformed += 1
            self._spawn(self._dead_letter_then_ack(message, f"malformed: {result.reason}", key=""))
            return
        self._pending.append(_Item(message=message, incoming=result))
        self._wake.set()

    # ---- batching and persisting -----------------------------------------------------------

    async def _batch_loop(self) -> None:
        """Sort what was received (fast path, deferred, to store) and start persists while a slot
        is free. A fast-path message never waits for a persist slot: only what must be stored does."""
        while True:
            self._store_held()
            if not self._pending and not self._can_store():
                self._wake.clear()
                if self._held:
                    # Until the first held message's wait ends (or something arrives).
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), max(0.0, self._held[0][0] - time.monotonic()))
                else:
                    await self._wake.wait()
                continue
            if self._pending:
                # Sorted at once: the fast path waits for nothing; only what is stored is batched.
                await self._maybe_wait_while_over_limit()
                self._sort_pending()
                continue
            window_left = self._store_window_left()
            if window_left > 0:
                # Collect a fuller batch to store, sorting what arrives meanwhile.
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), window_left)
                except TimeoutError:
                    pass
                continue
            batch = self._take_batch()
            if self._fast_path and self._runtime.is_ready:
                # Offered again: a message whose predecessor arrived while it waited takes the fast path.
                rest = self._take_fast(batch)
                if len(rest) < len(batch):
                    kept = {id(item) for item in rest}
                    self._release_keys([item for item in batch if id(item) not in kept])
                batch = rest
                if not batch:
                    continue
            await self._persist_slots.acquire()  # free: at once
            self._spawn(self._persist_batch(batch), release_slot=True)

    def _store_window_left(self) -> float:
        """Seconds the next batch to store may still wait for more (0: store it now)."""
        if len(self._to_store) >= self._max_batch_messages or self._to_store_bytes >= self._max_batch_bytes:
            return 0.0
        return max(0.0, self._to_store_since + self._batch_window_seconds - time.monotonic())

    def _can_store(self) -> bool:
        return bool(self._to_store) and not self._persist_slots.locked()

    def _sort_pending(self) -> None:
        """Everything received goes to the fast path or waits behind its key's persist (``_defer``), or
        is queued to be stored."""
        batch = list(self._pending)
        self._pending.clear()
        if self._fast_path and self._runtime.is_ready:
            rest = self._take_fast(batch)
            if len(rest) < len(batch):
                # The keys that took the fast path: their messages waiting, and those of the batch
                # left (beyond one waiting), are offered again together, so a chain follows at once.
                left = {id(item) for item in rest}
                keys = {item.incoming.key for item in batch if id(item) not in left}
                left = {id(item) for item in self._reoffer(keys, [i for i in rest if i.incoming.key in keys])}
                rest = [item for item in rest if item.incoming.key not in keys or id(item) in left]
            batch = self._hold(self._defer(rest))
            # Counted from now: a later message of the key waits for this one to be stored (``_defer``).
            self._persisting.update(item.incoming.key for item in batch)
        self._queue_to_store(batch)

    def _queue_to_store(self, batch: list[_Item]) -> None:
        if batch and not self._to_store:
            self._to_store_since = time.monotonic()
        self._to_store.extend(batch)
        self._to_store_bytes += sum(len(item.message.data) for item in batch)

    def _hold(self, batch: list[_Item]) -> list[_Item]:
        """Keep back, unstored, for ``predecessor_wait_seconds``, a message beyond its key's first
        missing position (``runtime.awaits_predecessor``); ``_reoffer`` hands it to the fast path
        when that position takes it, ``_store_held`` queues it to be stored when the wait ends.
        Not messages with a Pub/Sub ordering key (the client holds back the rest of their key
        until they are acked). Returns what to store now."""
        if self._predecessor_wait_seconds <= 0:
            return batch
        until = time.monotonic() + self._predecessor_wait_seconds
        rest: list[_Item] = []
        for item in batch:
            if not item.incoming.ordering_key and self._runtime.awaits_predecessor(item.incoming):
                self._held.append((until, item))
                self.counters.held += 1
            else:
                rest.append(item)
        return rest

    def _store_held(self) -> None:
        """Held messages whose wait ended go to be stored."""
        held = self._held
        now = time.monotonic()
        expired: list[_Item] = []
        while held and held[0][0] <= now:
            expired.append(held.popleft()[1])
        if expired:
            self._persisting.update(item.incoming.key for item in expired)
            self._queue_to_store(expired)

    def _reoffer(self, keys: set[str], fresh: list[_Item] | None = None) -> list[_Item]:
        """Offer the fast path ``fresh`` (just received) together with the messages of ``keys`` held
        for a predecessor or waiting to be stored (a swapped successor): sorted by key and sequence,
        a predecessor taken lets its successors follow in the same pass, not when their wait or the
        batch window ends. Called too when ``keys`` had a message stored. Returns the messages of
        ``fresh`` not taken."""
        fresh = fresh or []
        if not keys:
            return fresh
        held = [item for _, item in self._held if item.incoming.key in keys]
        waiting = [item for item in self._to_store if item.incoming.key in keys]
        if not held and not waiting:
            return fresh  # offered already, and nothing of their keys waits that could open the way
        left = {id(item) for item in self._take_fast([*fresh, *held, *waiting])}
        if any(id(item) not in left for item in held):
            self._held = collections.deque(
                (until, item) for until, item in self._held if item.incoming.key not in keys or id(item) in left
            )
        taken = [item for item in waiting if id(item) not in left]
        if taken:
            gone = {id(item) for item in taken}
            self._to_store = collections.deque(item for item in self._to_store if id(item) not in gone)
            self._to_store_bytes -= sum(len(item.message.data) for item in taken)
            self._release_keys(taken)
        return [item for item in fresh if id(item) in left]

    def _take_batch(self) -> list[_Item]:
        """The next batch to store: up to ``max_batch_messages`` and ``max_batch_bytes``."""
        batch: list[_Item] = []
        size = 0
        to_store = self._to_store
        while to_store and len(batch) < self._max_batch_messages:
            item_size = len(to_store[0].message.data)
            if batch and size + item_size > self._max_batch_bytes:
                break
            batch.append(to_store.popleft())
            size += item_size
        self._to_store_bytes -= size
        return batch

    async def _maybe_wait_while_over_limit(self) -> None:
        limit = self._max_undelivered
        if limit is None or self._runtime.undelivered() <= limit:
            return
        self._paused = True
        self.counters.pauses += 1
        _LOGGER.info(
            "ingest of %s paused: %d undelivered messages, over the limit of %d",
            self.name,
            self._runtime.undelivered(),
            limit,
        )
        try:
            # Polled: the runtime has no event for "the app acked" (module docstring).
            while self._runtime.undelivered() > limit:  # noqa: ASYNC110
                await asyncio.sleep(self._pause_poll_seconds)
        finally:
            self._paused = False
        _LOGGER.info("ingest of %s resumed: %d undelivered", self.name, self._runtime.undelivered())

    def _take_fast(self, batch: list[_Item]) -> list[_Item]:
        """Hand in-order messages to the runtime's fast path (nothing written); the rest is stored.
        Not messages with a Pub/Sub ordering key: the client gives the callback the next message of
        such a key only once this one is acked, and a fast-path ack waits for a checkpoint.

        Offered by key and sequence, so that a message and its successor swapped in one pull batch
        both take the fast path (in arrival order the successor would find its predecessor missing)."""
        candidates = sorted(
            (item for item in batch if not item.incoming.ordering_key),
            key=lambda item: (item.incoming.key, item.incoming.sequence or 0),
        )
        taken = self._runtime.take_fast([item.incoming for item in candidates])
        fast = {id(item): message for item, message in zip(candidates, taken, strict=True) if message is not None}
        for item in candidates:
            message = fast.get(id(item))
            if message is not None:
                self._fast[id(message)] = item.message
        self.counters.fast_path += len(fast)
        return [item for item in batch if id(item) not in fast]

    def _settled(self, message: Message, safe: bool) -> None:
        """The runtime settled a fast-path message: safe (ack durable, or dead letter recorded): ack it;
        given up (shard lost or dropped): nack it, so that Pub/Sub delivers it again."""
        pubsub = self._fast.pop(id(message), None)
        if pubsub is None or pubsub.ack_id not in self._unsettled:
            return  # stop() gave it back already
        if safe:
            self._ack(pubsub)
        else:
            self._nack(pubsub)

    def _defer(self, batch: list[_Item]) -> list[_Item]:
        """Keep back, once, a message whose key has a persist in progress: its predecessor may be in
        it, and once stored the predecessor makes it the next in order, so it can take the fast
        path then instead of being stored now. It waits no longer than being stored would take
        (one persist), and a hot key with one message stored does not store every later one while
        that persist is under way. Returns what to store now."""
        persisting = self._persisting
        rest: list[_Item] = []
        for item in batch:
            key = item.incoming.key
            if (
                not item.deferred
                and persisting[key]
                and item.incoming.sequence is not None
                and not item.incoming.ordering_key
            ):
                item.deferred = True
                self._deferred.setdefault(key, []).append(item)
                self.counters.deferred += 1
            else:
                rest.append(item)
        return rest

    def _release_keys(self, batch: list[_Item]) -> None:
        """``batch`` is no longer on its way to the store (stored, failed, or taken by the fast path
        after all): messages deferred behind its keys go back to the front of the queue."""
        persisting = self._persisting
        back: list[_Item] = []
        for item in batch:
            key = item.incoming.key
            if key not in persisting:
                continue  # sorted while the fast path was off
            persisting[key] -= 1
            if persisting[key] <= 0:
                del persisting[key]
                back += self._deferred.pop(key, ())
        if back and not self._stopping:
            self._pending.extendleft(reversed(back))
            self._wake.set()

    async def _persist_batch(self, batch: list[_Item]) -> None:
        self.counters.persist_batches += 1
        self._persisting_messages += len(batch)
        try:
            await self._store_batch(batch)
        finally:
            self._persisting_messages -= len(batch)
            self._release_keys(batch)
            if self._fast_path and self._runtime.is_ready and not self._stopping:
                # A message stored may be the predecessor its key's waiting messages lacked.
                self._reoffer({item.incoming.key for item in batch})

    async def _store_batch(self, batch: list[_Item]) -> None:
        # Several pods: a message whose key this pod does not deliver is stored for its owner
        # (``to_owner``: the owner's Listen picks it up). One whose key it delivers is handed to the
        # runtime after the write only if the lease is still held at the same epoch; otherwise the
        # new owner's load may have missed it, so it is nacked and its redelivery marks it.
        epochs = [self._runtime.owner_epoch(item.incoming.key) for item in batch]
        incoming = [
            item.incoming if epoch is not None or not self._runtime.sharded else _to_owner(item.incoming)
            for item, epoch in zip(batch, epochs, strict=True)
        ]
        try:
            results = await self._store.persist(self.name, incoming, self._clock())
        except StoreRejected as exc:
            if len(batch) == 1:
                self._dead_letter_rejected(batch[0], exc)
                return
            # Which message the store refused is unknown: try each alone, so one bad message
            # neither poisons its batch mates nor returns forever.
            for item in batch:
                await self._store_batch([item])
            return
        except StoreError as exc:
            self._on_persist_failed(batch, exc)
            return
        if len(results) != len(batch):
            _LOGGER.error(
                "ingest of %s: store returned %d results for %d messages", self.name, len(results), len(batch)
            )
            self._on_persist_failed(batch, StoreError("result count mismatch"))
            return

        stored: list[Message] = []
        stored_items: list[_Item] = []
        failed: list[_Item] = []
        first_error: StoreError | None = None
        sharded = self._runtime.sharded
        for item, result, epoch in zip(batch, results, epochs, strict=True):
            outcome = result.outcome
            if (
                sharded
                and epoch is not None
                and outcome is not PersistOutcome.FAILED
                and epoch != self._runtime.owner_epoch(item.incoming.key)
            ):
                # Written unmarked while this pod's lease moved on: the next owner's load may have
                # missed it. Pub/Sub redelivers it, and that copy marks the document for the owner.
                self.counters.owner_changed += 1
                self._nack(item.message)
            elif outcome is PersistOutcome.STORED and sharded and epoch is None:
                self.counters.persisted += 1
                self.counters.stored_for_owner += 1
                self._ack(item.message)
            elif outcome is PersistOutcome.STORED:
                stored.append(result.message)
                stored_items.append(item)
            elif outcome is PersistOutcome.DUPLICATE:
                self.counters.duplicates += 1
                if result.pending is not None:
                    # A pending original the engine may never have seen: it drops it if it holds it.
                    self._runtime.on_stored([result.pending])
                self._ack(item.message)
            elif outcome is PersistOutcome.CONFLICT:
                self.counters.conflicts += 1
                if result.pending is not None:
                    self._runtime.on_stored([result.pending])
                self._spawn(self._dead_letter_then_ack(item.message, "conflict", key=item.incoming.key))
            elif isinstance(result.error, StoreRejected):
                self._dead_letter_rejected(item, result.error)
            else:
                failed.append(item)
                first_error = first_error or result.error
        if stored:
            # The engine learns of them before Pub/Sub forgets them: an ack first could lose them
            # if on_stored failed (they are durable, but only a restart would load them).
            self._runtime.on_stored(stored)
            self.counters.persisted += len(stored)
            for item in stored_items:
                self._ack(item.message)
        if failed:
            self._on_persist_failed(failed, first_error or StoreError("persist failed"))
        else:
            self._consecutive_failures = 0

    def _on_persist_failed(self, items: Sequence[_Item], error: BaseException) -> None:
        delay = self._backoff_seconds(self._consecutive_failures)
        self._consecutive_failures += 1
        self.counters.persist_failures += len(items)
        _LOGGER.warning(
            "ingest of %s: persist of %d messages failed (%s); nacking them in %.2fs",
            self.name,
            len(items),
            error,
            delay,
        )
        for item in items:
            self._nack_later(item.message, delay)

    # ---- dead letters ----------------------------------------------------------------------

    def _dead_letter_rejected(self, item: _Item, error: StoreError) -> None:
        self.counters.rejected += 1
        self._spawn(self._dead_letter_then_ack(item.message, f"store_rejected: {error}", key=item.incoming.key))

    async def _dead_letter_then_ack(self, message: PubsubMessage, reason: str, *, key: str) -> None:
        """Publish to the dead-letter topic until it takes the message, then ack (never before)."""
        if self._dead_letters.topic_for(self.name) is None:
            _LOGGER.error(
                "ingest of %s: message %s needs dead-lettering (%s) but the subscription has no "
                "dead_letter_topic; leaving it in Pub/Sub",
                self.name,
                message.message_id,
                reason,
            )
            self.counters.dead_letter_failures += 1
            self._nack_later(message, self._backoff_maximum_seconds)
            return
        attempt = 0
        while True:
            try:
                await self._dead_letters.publish_raw(
                    self.name,
                    data=message.data,
                    attributes=dict(message.attributes),
                    reason=reason,
                    message_id=message.message_id,
                    key=key,
                    ordering_key=message.ordering_key,
                )
                break
            except Exception as exc:
                self.counters.dead_letter_failures += 1
                _LOGGER.warning(
                    "ingest of %s: dead-letter publish of %s failed (attempt %d): %s; retrying",
                    self.name,
                    message.message_id,
                    attempt + 1,
                    exc,
                )
            await asyncio.sleep(self._backoff_seconds(attempt))
            attempt += 1
        self.counters.dead_lettered += 1
        self._ack(message)

    # ---- settling --------------------------------------------------------------------------

    def _ack(self, message: PubsubMessage) -> None:
        if self._unsettled.pop(message.ack_id, None) is None:
            return
        message.ack()
        self.counters.acked += 1

    def _nack(self, message: PubsubMessage) -> None:
        self._nack_timers.pop(message.ack_id, None)
        if self._unsettled.pop(message.ack_id, None) is None:
            return
        message.nack()
        self.counters.nacked += 1

    def _nack_later(self, message: PubsubMessage, delay_seconds: float) -> None:
        assert self._loop is not None
        self._nack_timers[message.ack_id] = self._loop.call_later(delay_seconds, self._nack, message)

    async def _give_back(self) -> None:
        """Nack everything still held, with our own ModifyAckDeadline calls, once the stream is closed.

        Not ``message.nack()``: after the stream closed the client's dispatcher is gone and would drop
        them, and before it closed Pub/Sub would send them straight back to this stream.
        """
        for handle in self._nack_timers.values():
            handle.cancel()
        self._nack_timers.clear()
        ack_ids = list(self._unsettled)
        self._unsettled.clear()
        self._forget_queued()
        subscriber = self._subscriber
        if not ack_ids or subscriber is None:
            return
        for start in range(0, len(ack_ids), _MAX_IDS_PER_MODACK):
            chunk = ack_ids[start : start + _MAX_IDS_PER_MODACK]
            try:
                await asyncio.to_thread(
                    subscriber.modify_ack_deadline,
                    subscription=self.subscription_path,
                    ack_ids=chunk,
                    ack_deadline_seconds=0,
                    timeout=_PULL_SHUTDOWN_SECONDS,
                )
            except api_exceptions.GoogleAPICallError as exc:
                # No loss: their leases run out and Pub/Sub redelivers them a little later.
                _LOGGER.warning("ingest of %s: giving back %d messages failed: %s", self.name, len(chunk), exc)
                continue
            self.counters.nacked += len(chunk)
        _LOGGER.info("ingest of %s: %d unpersisted messages given back to Pub/Sub", self.name, len(ack_ids))

    def _nack_all(self) -> int:
        for handle in self._nack_timers.values():
            handle.cancel()
        self._nack_timers.clear()
        messages = list(self._unsettled.values())
        for message in messages:
            self._nack(message)
        self._forget_queued()
        return len(messages)

    def _forget_queued(self) -> None:
        """Everything queued is given back (it is all in ``_unsettled``)."""
        self._pending.clear()
        self._to_store.clear()
        self._to_store_bytes = 0
        self._held.clear()
        self._deferred.clear()
        self._persisting.clear()

    def _abort(self) -> None:
        """Immediate teardown after a failure or cancellation: no draining, everything given back."""
        self._stopping = True
        if self._worker is not None:
            self._worker.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._nack_all()
        if self._pull is not None:
            self._pull.cancel()

    # ---- helpers ---------------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None], *, release_slot: bool = False) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._tasks.discard(finished)
            if release_slot:
                self._persist_slots.release()
                self._wake.set()
            if not finished.cancelled() and finished.exception() is not None:
                # A bug (the store contract or the runtime broke): fail run() loudly.
                _LOGGER.critical("ingest of %s: task failed", self.name, exc_info=finished.exception())
                if self._task_failure is None:
                    self._task_failure = finished.exception()
                if self._worker is not None and not self._worker.done():
                    self._worker.cancel()

        task.add_done_callback(done)

    def _failure(self) -> IngestError:
        if self._task_failure is not None:
            error = IngestError(f"ingest of {self.name!r} failed: {self._task_failure!r}")
            error.__cause__ = self._task_failure
            return error
        if self._worker is not None and self._worker.done() and not self._worker.cancelled():
            exc = self._worker.exception()
            error = IngestError(f"ingest of {self.name!r} failed: {exc!r}")
            error.__cause__ = exc
            return error
        assert self._pull_done is not None
        if self._pull_done.done() and not self._pull_done.cancelled():
            exc = self._pull_done.exception()
            if exc is not None:
                error = IngestError(
                    f"streaming pull of {self.subscription_path} (subscription {self.name!r}) ended: {_describe(exc)}"
                )
                error.__cause__ = exc
                return error
        return IngestError(f"streaming pull of {self.subscription_path} (subscription {self.name!r}) ended")

    def _backoff_seconds(self, attempt: int) -> float:
        return backoff_seconds(attempt, self._backoff_initial_seconds, self._backoff_maximum_seconds)


def _to_owner(incoming: IncomingMessage) -> IncomingMessage:
    return dataclasses.replace(incoming, to_owner=True)


def _publish_time_ms(message: PubsubMessage) -> int:
    """Publish time in integer ms since the epoch, computed exactly (no float rounding)."""
    publish_time = message.publish_time
    if publish_time.tzinfo is None:
        publish_time = publish_time.replace(tzinfo=datetime.UTC)
    milliseconds: int = (publish_time - _EPOCH) // _ONE_MS
    return milliseconds


def _describe_seconds(seconds: float) -> str:
    return f"{seconds:g}s" if seconds else "unbounded"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return f"{exc.__class__.__name__} ({exc.code}): {exc.message}"
    return f"{exc.__class__.__name__}: {exc}"


async def _wait_cancelled(task: asyncio.Task[Any]) -> None:
    """Await a task we cancelled. Its own failure is not raised here: ``run()`` reports it."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # we ourselves are being cancelled
    except Exception:
        pass
