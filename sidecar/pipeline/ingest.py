"""Ingest: Pub/Sub StreamingPull -> classify -> the runtime's fast path, or store.persist
(batched) -> runtime -> ack.

``Ingestor`` is the one public class: it joins the modules that each do one job of it and runs the
batch loop that drives them.

- ``ingest_pull``: the Pub/Sub client and the StreamingPull (with ``ingest_scheduler``, which runs
  the callback on the event loop, and ``ingest_watch``, which reports each attempt to ``PullHealth``).
- ``ingest_sort``: the callback (classify), forwarding to the key's owner, and the fast path,
  deferred, held (``ingest_held``) and to-store queues; ``ingest_forwarded``: a message another
  pod forwarded, taken by ``take_forwarded`` as this pod's own intake (docs/forwarding.md).
- ``ingest_persist``: persist batches, and what each store outcome makes of its message.
- ``ingest_settlement``: every message received until acked or nacked; dead letter, then ack.
- ``ingest_backpressure``: no new batch while the app is too far behind.
- ``ingest_counters``: ``Ingestor.counters``.

Rules (G1 in DESIGN §1 depends on each of them):

- **Ack only what is safe.** A Pub/Sub message is acked only after the store said it is durable
  (STORED, after ``runtime.on_stored``; or DUPLICATE: an earlier copy is durable), after its app ack
  is durable (the in-order fast path: ``runtime.take_fast``, settled by ``on_volatile_settled``), or
  after the dead-letter topic accepted it (malformed, CONFLICT, or rejected by the store for good),
  or after the key's owner answered that its outcome is durable there (forwarded: docs/forwarding.md).
  Nothing is ever acked on a failure path, and nothing is ever dropped: a message not acked is
  nacked or left to its lease, and Pub/Sub delivers it again. Each module's docstring says its part.
- **Sorted as they come** (``_batch_loop``): received messages are sorted at once (the fast path
  waits for nothing); what must be stored is batched for up to ``batch_window_seconds`` (or
  ``max_batch_messages`` / ``max_batch_bytes``), offered to the fast path once more, and written
  as soon as one of ``max_concurrent_persists`` persist slots is free.
- **Threads.** The subscriber's callback runs on the event loop: ``LoopScheduler``
  (``sidecar.pipeline.ingest_scheduler``) takes the messages from the client's threads and runs the
  callbacks on the loop, many per wake-up. Everything happens on the loop but the client's own work.
- **Flow control, two levels.** The client's ``FlowControl`` bounds what it holds un-acked, and
  no new batch is persisted while ``runtime.undelivered()`` is over ``max_undelivered_messages``
  (``ingest_backpressure``): the client's flow control then fills up and pauses the stream.
- **Failure is loud, and reported.** Every StreamingPull attempt is reported to ``pull_health``
  (``ingest_pull``): the client retries transient stream errors silently, and /readyz, GetStatus
  and the metrics say when they last (10 s). A streaming pull the client closed for good
  (NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED, INVALID_ARGUMENT) is logged at ERROR and opened
  again after a backoff (1 s doubling to 30 s), so that the pod recovers when the subscription or
  permission is back; messages held from the closed pull are settled as usual (their acks are lost
  with it, and Pub/Sub redelivers them: duplicates). Any other end of the pull or of the batching
  worker, or a failed task (a bug), makes ``run()`` raise ``IngestError``.
- **Stop.** ``stop()`` takes no new batch, lets persists and dead-letter publishes in progress
  finish within the grace period and acks what they made safe, stops the streaming pull (the client
  sends queued acks before its dispatcher stops), and then nacks everything else it holds with its
  own ModifyAckDeadline calls: nacked on the open stream, they would come straight back to it.
- Payloads never appear in logs; ids, counts and reasons do. Of the ingest modules only
  ``ingest_pull`` (with ``ingest_scheduler`` and ``ingest_watch``, which it alone uses) imports
  Pub/Sub; the others see its messages as ``ingest_settlement.PulledMessage``.

Known limit: the Python client hands messages that carry a Pub/Sub ``ordering_key`` to the callback
one per ordering key at a time, until the previous one is acked or nacked. Such keys therefore
ingest one message per persist round trip (about ``batch_window_seconds`` plus a store commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from google.api_core import exceptions as api_exceptions

from sidecar.backoff import backoff_seconds
from sidecar.config.model import SequenceOrdering, SubscriptionConfig
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.pipeline.ingest_backpressure import Backpressure
from sidecar.pipeline.ingest_counters import IngestCounters
from sidecar.pipeline.ingest_forwarded import ForwardedMessage
from sidecar.pipeline.ingest_intake import make_intake
from sidecar.pipeline.ingest_persist import Persister
from sidecar.pipeline.ingest_pull import SubscriberClient, describe_seconds
from sidecar.pipeline.ingest_settlement import Settlement
from sidecar.pipeline.ingest_sort import (
    BATCH_WINDOW_SECONDS,
    MAX_BATCH_BYTES,
    MAX_BATCH_MESSAGES,
    Forwarder,
    Sorter,
)
from sidecar.pipeline.pull_health import PullHealth, describe_error
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.store.api import Store

_LOGGER = logging.getLogger(__name__)

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


class IngestError(Exception):
    """Ingest cannot continue for this subscription (e.g. the streaming pull ended for good)."""


class Ingestor:
    """Pulls one subscription, persists what it receives, acks only what the store made durable."""

    def __init__(
        self,
        sub_config: SubscriptionConfig,
        store: Store,
        runtime: SubscriptionRuntime,
        dead_letters: DeadLetterPublisher,
        *,
        subscriber: SubscriberClient | None = None,
        max_batch_messages: int = MAX_BATCH_MESSAGES,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        batch_window_seconds: float = BATCH_WINDOW_SECONDS,
        max_concurrent_persists: int = _MAX_CONCURRENT_PERSISTS,
        backoff_initial_seconds: float = _BACKOFF_INITIAL_SECONDS,
        backoff_maximum_seconds: float = _BACKOFF_MAXIMUM_SECONDS,
        pause_poll_seconds: float = _PAUSE_POLL_SECONDS,
        max_lease_duration_seconds: float = _MAX_LEASE_DURATION_SECONDS,
        clock: Callable[[], int] | None = None,
        fast_path: bool | None = None,
        predecessor_wait_seconds: float | None = None,
        forwarder: Forwarder | None = None,
    ) -> None:
        if max_batch_messages < 1:
            raise ValueError(f"max_batch_messages must be >= 1, got {max_batch_messages}")
        if max_concurrent_persists < 1:
            raise ValueError(f"max_concurrent_persists must be >= 1, got {max_concurrent_persists}")
        if not 0 < backoff_initial_seconds <= backoff_maximum_seconds:
            raise ValueError("backoff: need 0 < backoff_initial_seconds <= backoff_maximum_seconds")
        self.name = sub_config.name
        self.subscription_path = sub_config.subscription
        self._runtime = runtime
        self._backoff_initial_seconds = backoff_initial_seconds
        self._backoff_maximum_seconds = backoff_maximum_seconds

        self.counters = IngestCounters()
        self.pull_health = PullHealth(lambda: self.counters.received)
        """What the StreamingPull attempts say (readiness, GetStatus, metrics)."""
        self._pull = make_intake(
            sub_config, self.pull_health, subscriber=subscriber, max_lease_duration_seconds=max_lease_duration_seconds
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        """Set when the batch loop may have work: a message received, a persist slot freed,
        deferred messages back."""
        self._persist_slots = asyncio.Semaphore(max_concurrent_persists)
        self._tasks: set[asyncio.Task[None]] = set()
        self._settlement = Settlement(
            self.name,
            self.counters,
            dead_letters,
            backoff_seconds=self._backoff_seconds,
            backoff_maximum_seconds=backoff_maximum_seconds,
        )
        runtime.on_volatile_settled = self._settlement.on_volatile_settled
        ordering = sub_config.ordering
        configured = isinstance(ordering, SequenceOrdering) and ordering.fast_path
        self._sorter = Sorter(
            sub_config,
            runtime,
            self.counters,
            self._settlement,
            self._wake,
            spawn=self._spawn,
            is_stopping=self._is_stopping,
            fast_path=configured if fast_path is None else fast_path and configured,
            max_batch_messages=max_batch_messages,
            max_batch_bytes=max_batch_bytes,
            batch_window_seconds=batch_window_seconds,
            predecessor_wait_seconds=predecessor_wait_seconds,
            backoff_maximum_seconds=backoff_maximum_seconds,
            forwarder=forwarder,
        )
        self._persister = Persister(
            self.name,
            store,
            runtime,
            self.counters,
            self._sorter,
            self._settlement,
            spawn=self._spawn,
            is_stopping=self._is_stopping,
            clock=clock if clock is not None else runtime.now_ms,
            backoff_seconds=self._backoff_seconds,
        )
        self._backpressure = Backpressure(
            self.name,
            runtime,
            self.counters,
            max_undelivered=sub_config.flow_control.max_undelivered_messages,
            pause_poll_seconds=pause_poll_seconds,
        )
        self._task_failure: BaseException | None = None
        self._stopping = False
        self._stopped = False

    # ---- state -----------------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        """True while no batch is persisted because ``undelivered`` is over the limit."""
        return self._backpressure.is_paused

    @property
    def is_healthy(self) -> bool:
        """Pulling and processing: started, not stopping, neither the stream nor the worker ended, and
        the StreamingPull attempts do not fail (``pull_health``)."""
        pull_done = self._pull.done
        return (
            not self.pull_health.is_failing()
            and pull_done is not None
            and not pull_done.done()
            and self._worker is not None
            and not self._worker.done()
            and not self._stopping
        )

    @property
    def held_messages(self) -> int:
        """Messages received and not yet acked or nacked (persisting, waiting, or dead-lettering)."""
        return self._settlement.held

    def stages(self) -> dict[str, int]:
        """Messages received and not settled, by where they wait now (the ``ingest_messages`` gauge):
        an operator's view of a stall between Pub/Sub and the engine."""
        return {
            "handoff": self.handoff_buffered,
            **self._sorter.stages(),
            "storing": self._persister.persisting_messages,
            "fast_path": self._settlement.fast_path,
            "nack_scheduled": self._settlement.nack_scheduled,
            "unsettled": self._settlement.held,
        }

    @property
    def handoff_runs(self) -> int:
        """Times the loop took received messages from the client's threads (one wake-up each)."""
        return self._pull.handoff_runs

    @property
    def handoff_buffered(self) -> int:
        """Messages the client received and the loop has not taken yet (not yet in ``received``)."""
        return self._pull.handoff_buffered

    @property
    def _predecessor_wait_seconds(self) -> float:
        """``predecessor_wait_seconds`` of the sorter (tests change it while running)."""
        return self._sorter.predecessor_wait_seconds

    @_predecessor_wait_seconds.setter
    def _predecessor_wait_seconds(self, seconds: float) -> None:
        self._sorter.predecessor_wait_seconds = seconds

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the streaming pull. The runtime must have recovered (it receives what is stored)."""
        if self._pull.is_opened:
            raise RuntimeError(f"ingest of {self.name!r}: start() called twice")
        if self._stopping:
            raise RuntimeError(f"ingest of {self.name!r}: start() after stop()")
        if not self._runtime.is_ready:
            raise RuntimeError(f"ingest of {self.name!r}: the subscription runtime has not recovered")
        self._loop = asyncio.get_running_loop()
        self._pull.make_client()
        self._worker = asyncio.create_task(self._batch_loop(), name=f"ingest:{self.name}")
        self._pull.subscribe(self._loop, self._sorter.on_message)
        flow_control = self._pull.flow_control
        _LOGGER.info(
            "ingest of %s started on %s (max outstanding %d messages, max undelivered %s, max lease extension %s)",
            self.name,
            self.subscription_path,
            flow_control.max_messages,
            self._backpressure.max_undelivered,
            describe_seconds(flow_control.max_duration_per_lease_extension),
        )

    async def run(self) -> None:
        """Start if needed and wait until ``stop()``; raises ``IngestError`` if pulling ends otherwise."""
        if not self._pull.is_opened:
            await self.start()
        while True:
            assert self._pull.done is not None and self._worker is not None
            try:
                # asyncio.wait never cancels what it waits on: a cancelled run() leaves both to _abort().
                await asyncio.wait({self._pull.done, self._worker}, return_when=asyncio.FIRST_COMPLETED)
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
        pull_done = self._pull.done
        assert pull_done is not None and self._worker is not None
        if self._worker.done() or self._task_failure is not None or not pull_done.done():
            return None
        if pull_done.cancelled():
            return None
        exc = pull_done.exception()
        return exc if isinstance(exc, api_exceptions.GoogleAPICallError) else None

    async def _reopen_after(self, error: api_exceptions.GoogleAPICallError) -> bool:
        """Report the close, wait out the backoff, and pull again; False when ``stop()`` came first
        (the worker's end also ends the wait: ``run()`` then raises its failure)."""
        assert self._worker is not None and self._loop is not None
        delay = self._pull.report_closed(error)
        # The worker ends only by stop() (which cancels it) or a failure: either ends the wait.
        await asyncio.wait({self._worker}, timeout=delay)
        if self._stopping:
            return False
        if not self._worker.done():
            self._pull.subscribe(self._loop, self._sorter.on_message)
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
        if not await self._pull.shut_down():
            errors.append(IngestError(f"ingest of {self.name!r}: streaming pull did not shut down"))
        self._sorter.forget_queued()
        await self._settlement.give_back(self._pull.nack_ids if self._pull.can_give_back else None)
        errors += await self._pull.close_client()
        if errors:
            raise IngestError(f"ingest of {self.name!r} stopped with errors: {errors!r}") from errors[0]

    def set_forwarder(self, forwarder: Forwarder | None) -> None:
        """Forward messages of other pods' shards to their owners (``ingest_sort``); before ``start``."""
        self._sorter.forwarder = forwarder

    def take_forwarded(self, message: ForwardedMessage) -> bool:
        """Take a message another pod forwarded as this pod's own intake (its ``ack``/``nack`` answer
        that pod); False, taking nothing, unless pulling runs and the runtime is ready."""
        if self._stopping or self._worker is None or self._worker.done() or not self._runtime.is_ready:
            return False
        self.counters.forwarded_in += 1
        self._sorter.on_message(message, from_peer=True)
        return True

    async def ping(self, timeout_seconds: float = 5.0) -> bool:
        """True if Pub/Sub answers for this subscription now (GetSubscription); for readiness checks."""
        return await self._pull.ping(timeout_seconds)

    # ---- the batch loop --------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        """Sort what was received (fast path, deferred, to store) and start persists while a slot
        is free. A fast-path message never waits for a persist slot: only what must be stored does."""
        sorter = self._sorter
        while True:
            sorter.store_held()
            if not sorter.has_pending and not self._can_store():
                self._wake.clear()
                held_until = sorter.held_until()
                if held_until is not None:
                    # Until the first held message's wait ends (or something arrives).
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), max(0.0, held_until - time.monotonic()))
                else:
                    await self._wake.wait()
                continue
            if sorter.has_pending:
                # Sorted at once: the fast path waits for nothing; only what is stored is batched.
                await self._backpressure.maybe_wait()
                sorter.sort_pending()
                continue
            window_left = sorter.store_window_left()
            if window_left > 0:
                # Collect a fuller batch to store, sorting what arrives meanwhile.
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), window_left)
                except TimeoutError:
                    pass
                continue
            # Offered again: a message whose predecessor arrived while it waited takes the fast path.
            batch = sorter.take_fast_before_store(sorter.take_batch())
            if not batch:
                continue
            await self._persist_slots.acquire()  # free: at once
            self._spawn(self._persister.persist_batch(batch), release_slot=True)

    def _can_store(self) -> bool:
        return self._sorter.has_to_store and not self._persist_slots.locked()

    # ---- tasks and failure -----------------------------------------------------------------

    def _is_stopping(self) -> bool:
        return self._stopping

    def _abort(self) -> None:
        """Immediate teardown after a failure or cancellation: no draining, everything given back."""
        self._stopping = True
        if self._worker is not None:
            self._worker.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._settlement.nack_all()
        self._sorter.forget_queued()
        self._pull.cancel()

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
        pull_done = self._pull.done
        assert pull_done is not None
        if pull_done.done() and not pull_done.cancelled():
            exc = pull_done.exception()
            if exc is not None:
                error = IngestError(
                    f"streaming pull of {self.subscription_path} (subscription {self.name!r}) ended: "
                    f"{describe_error(exc)}"
                )
                error.__cause__ = exc
                return error
        return IngestError(f"streaming pull of {self.subscription_path} (subscription {self.name!r}) ended")

    def _backoff_seconds(self, attempt: int) -> float:
        return backoff_seconds(attempt, self._backoff_initial_seconds, self._backoff_maximum_seconds)


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
