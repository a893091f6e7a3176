"""The streaming pull: one subscription's Pub/Sub ``SubscriberClient`` and its StreamingPull.

``StreamingPull`` owns the client (made here unless one is passed in), opens the streaming pull
with ``LoopScheduler`` (``sidecar.pipeline.ingest_scheduler``) so that the callback runs on the event
loop, reopens it after Pub/Sub closed it for good, shuts it down, closes the client, and answers
readiness pings. What to do with what it pulls and when to reopen is ``sidecar.pipeline.ingest``'s.

Rules:

- **Flow control.** ``FlowControl(max_messages, max_bytes)`` bounds what the client holds un-acked;
  ``max_duration_per_lease_extension`` (``flow_control.max_lease_extension``) caps every lease
  extension, the receipt modack and the stream ack deadline, so a message this process pulled is
  redelivered at most that long after a crash (docs/ingest.md, "Leases and crashes").
- **Every attempt is watched.** The client is made with ``watched_transport``
  (``sidecar.pipeline.ingest_watch``), which reports each StreamingPull attempt's end to
  ``PullHealth``: the client retries transient stream errors by itself and silently.
- **Closed for good, opened again.** A streaming pull the client closed for good is reported at
  once (``report_closed``, logged at ERROR naming the subscription and the status) and opened again
  after a backoff (1 s doubling to 30 s, reset once a stream works).
- **Shutdown flushes.** The stream is opened with ``await_callbacks_on_shutdown``: once it is shut
  down every message handed over has reached the callback, and the client has sent the acks and
  nacks queued before. The client is closed only once its stream thread ended (closed under a
  thread still retrying to reopen the stream, that thread would fail with a traceback).
- This module, with ``ingest_scheduler`` and ``ingest_watch`` (which it alone uses), is the ingest's
  only import of the Pub/Sub client library; ``sidecar.dead_letters`` has its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber.futures import StreamingPullFuture
from google.cloud.pubsub_v1.subscriber.message import Message as PubsubMessage

from sidecar.config.model import FlowControlConfig
from sidecar.pipeline.ingest_scheduler import LoopScheduler
from sidecar.pipeline.ingest_watch import watched_transport
from sidecar.pipeline.pull_health import PullHealth, report_closed

_LOGGER = logging.getLogger(__name__)

SubscriberClient = pubsub_v1.SubscriberClient
"""The client class, named here for ``Ingestor(subscriber=...)``: only this module imports the library."""

_PULL_SHUTDOWN_SECONDS = 10.0
"""How long ``shut_down()`` waits for the client to shut the stream down and flush its acks and nacks;
also the timeout of each ``nack_ids`` call."""

_STREAM_THREAD_EXIT_SECONDS = 2.0
"""How long ``close_client()`` then waits for the client's stream thread to end before closing the
client. It ends within a second unless it is inside a retried attempt to reopen a failing stream
(retries sleep up to 60 s): closing the channel under it would make it fail with a traceback."""

_STREAM_THREAD_NAME = "Thread-ConsumeBidirectionalStream"
"""The name google-api-core gives the thread that reads a StreamingPull stream (``bidi.py``)."""


class StreamingPull:
    """One subscription's streaming pull and the client it runs on."""

    def __init__(
        self,
        name: str,
        subscription_path: str,
        flow: FlowControlConfig,
        health: PullHealth,
        *,
        subscriber: SubscriberClient | None,
        max_lease_duration_seconds: float,
    ) -> None:
        self.name = name
        self.subscription_path = subscription_path
        self._health = health
        self.subscriber = subscriber
        """The client: passed in, or made by ``make_client``."""
        self._owns_subscriber = subscriber is None
        self.flow_control = pubsub_v1.types.FlowControl(
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
        self._future: StreamingPullFuture | None = None
        self.done: asyncio.Future[Any] | None = None
        """The current pull as an asyncio future; it ends cancelled after our own ``cancel()``."""
        self._scheduler: LoopScheduler | None = None
        self._stream_threads: list[threading.Thread] = []
        self._handoff_runs_before = 0
        """``handoff_runs`` of the schedulers of earlier pulls (one per ``subscribe``)."""

    @property
    def is_opened(self) -> bool:
        """``subscribe`` was called."""
        return self._future is not None

    @property
    def handoff_runs(self) -> int:
        """Times the loop took received messages from the client's threads (one wake-up each)."""
        return self._handoff_runs_before + (0 if self._scheduler is None else self._scheduler.runs)

    @property
    def handoff_buffered(self) -> int:
        """Messages the client received and the loop has not taken yet."""
        return 0 if self._scheduler is None else self._scheduler.buffered()

    def make_client(self) -> None:
        """Make the client unless one was passed in."""
        if self.subscriber is None:
            # Made here, not at import: it reads PUBSUB_EMULATOR_HOST at construction.
            self.subscriber = SubscriberClient(transport=watched_transport(self._health))

    def subscribe(self, loop: asyncio.AbstractEventLoop, callback: Callable[[PubsubMessage], None]) -> None:
        """Open a streaming pull (at start, and again after one was closed for good)."""
        assert self.subscriber is not None
        threads_before = set(threading.enumerate())
        if self._scheduler is not None:
            self._handoff_runs_before += self._scheduler.runs
        self._scheduler = LoopScheduler(loop)
        self._future = self.subscriber.subscribe(
            self.subscription_path,
            callback=callback,
            flow_control=self.flow_control,
            # Annotated ThreadScheduler, but the manager uses only the abstract Scheduler's
            # queue/schedule/shutdown, and the docstring asks for any scheduler.
            scheduler=self._scheduler,  # type: ignore[arg-type]
            # The shutdown then waits for a run of callbacks the loop is in, so that once the pull
            # future is done every message handed to us has reached the callback (stop() gives them
            # all back); the scheduler returns the rest, and the client nacks those.
            await_callbacks_on_shutdown=True,
        )
        # subscribe() starts the stream's reader thread before it returns: the one new thread of that
        # name is ours. close_client() closes the client only once that thread ended.
        self._stream_threads = [t for t in self._stream_threads if t.is_alive()] + [
            t for t in threading.enumerate() if t not in threads_before and t.name == _STREAM_THREAD_NAME
        ]
        self.done = asyncio.wrap_future(self._future)

    def report_closed(self, error: api_exceptions.GoogleAPICallError) -> float:
        """Report that Pub/Sub closed the pull for good; returns how long to wait before opening it again."""
        return report_closed(self._health, self.subscription_path, self.name, error)

    @property
    def can_give_back(self) -> bool:
        """``nack_ids`` has a client to call."""
        return self.subscriber is not None

    def cancel(self) -> None:
        """Stop the streaming pull without waiting (the client shuts it down on its threads)."""
        if self._future is not None:
            self._future.cancel()

    async def shut_down(self) -> bool:
        """Stop the streaming pull and wait for the client's shutdown (which flushes queued acks and
        nacks); False if it did not end within ``_PULL_SHUTDOWN_SECONDS``."""
        if self._future is None or self.done is None:
            return True
        self._future.cancel()
        # asyncio.wait, not await: once cancel() was called the client's future reports itself
        # cancelled, so the wrapper ends "cancelled" when the shutdown completes; that is success.
        done, _ = await asyncio.wait({self.done}, timeout=_PULL_SHUTDOWN_SECONDS)
        if not done:
            return False
        if not self.done.cancelled():
            self.done.exception()  # retrieved: a failure was reported by run() already
        return True

    async def nack_ids(self, ack_ids: list[str]) -> None:
        """Nack ``ack_ids`` (at most 1000) with our own ModifyAckDeadline call, not through the
        stream (``Settlement.give_back``, after the stream was shut down), on a worker thread."""
        subscriber = self.subscriber
        assert subscriber is not None
        await asyncio.to_thread(
            subscriber.modify_ack_deadline,
            subscription=self.subscription_path,
            ack_ids=ack_ids,
            ack_deadline_seconds=0,
            timeout=_PULL_SHUTDOWN_SECONDS,
        )

    async def close_client(self) -> list[BaseException]:
        """Close the client if it was made here, once its stream thread ended; the errors met."""
        if not self._owns_subscriber or self.subscriber is None:
            return []
        if not await self._stream_threads_ended(_STREAM_THREAD_EXIT_SECONDS):
            # Its channel stays open: closed under the thread's retry, the next attempt would fail
            # with "Cannot invoke RPC: Channel closed!". The thread is a daemon and ends with the
            # process, which is what a stop is followed by.
            _LOGGER.warning(
                "ingest of %s: the Pub/Sub stream thread is still retrying to reopen the stream; "
                "leaving its client open",
                self.name,
            )
            return []
        try:
            self.subscriber.close()
        except Exception as exc:
            return [exc]
        return []

    async def _stream_threads_ended(self, timeout_seconds: float) -> bool:
        deadline = time.monotonic() + timeout_seconds
        for thread in self._stream_threads:
            await asyncio.to_thread(thread.join, max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._stream_threads)

    async def ping(self, timeout_seconds: float) -> bool:
        """True if Pub/Sub answers for this subscription now (GetSubscription)."""
        subscriber = self.subscriber
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


def describe_seconds(seconds: float) -> str:
    """``max_duration_per_lease_extension`` for a log line (0: the client's own, unbounded by us)."""
    return f"{seconds:g}s" if seconds else "unbounded"
