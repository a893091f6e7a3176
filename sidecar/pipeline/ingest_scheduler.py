"""A scheduler for the official Pub/Sub subscriber that runs its callbacks on the event loop in batches.

Why: the client's default ``ThreadScheduler`` submits one thread-pool future per message, and ingest's
callback then woke the event loop once per message (``call_soon_threadsafe``): thread hand-offs,
futures and loop wake-ups came to about 11% of the sidecar's GIL-held samples. Here the client's
thread appends the call to a buffer and wakes the loop at most once while a run is pending; the loop
then runs the buffered callbacks one after the other, in the order they were scheduled.

How the client's ``Scheduler`` contract (``subscribe(..., scheduler=...)``; read in the client's
``scheduler.py`` and ``_protocol/streaming_pull_manager.py``) is kept:

- ``queue`` is the dispatcher's request queue. ``Message.ack()``/``nack()`` put requests on it from
  any thread (here the loop's), the client's dispatcher thread sends them. The client only calls
  ``put``, ``get()`` and ``get(timeout=)`` on it (``dispatcher.py``, ``helper_threads.py``), so it is a
  ``queue.SimpleQueue``: its ``put`` is one C call, where ``queue.Queue``'s takes a lock and notifies
  a condition in Python, once per ack.
- ``schedule(callback, message)`` is called on the client's threads (the stream consumer's, or the
  dispatcher's when an ack releases the next message of an ordering key). ``callback`` is the
  manager's wrapper (``_wrap_callback_errors``) around ours: an exception of our callback nacks the
  message and fails the ``StreamingPullFuture``, exactly as with the default scheduler.
- ``shutdown(await_msg_callbacks)`` runs on the manager's shutdown thread. What is still in the buffer
  was never handed to a callback: it is returned, and the manager nacks it. With
  ``await_msg_callbacks`` it first waits for the run the loop is in the middle of (ingest relies on
  this: once the pull future is done, every message handed over has reached its callback). The loop
  runs one run as one callback, so a coroutine on the loop never sees half a run. Never waits when
  called on the loop's own thread, which would deadlock.
- After ``shutdown``, or once the loop is closed, ``schedule`` nacks the message at once: the
  ``ThreadScheduler`` drops such a message with a warning and leaves it to its lease. A loop that is
  stopped but not closed keeps the wake-up queued; the messages stay in the buffer, and ``shutdown``
  returns them.

Lives beside ``sidecar.pipeline.ingest_pull``, which alone imports it: the Pub/Sub client library stays behind
the streaming pull (with ``sidecar.dead_letters`` for publishing and the dead-letter tooling), and this module keeps
the threading rules of the hand-over to itself.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from google.cloud.pubsub_v1.subscriber.message import Message
from google.cloud.pubsub_v1.subscriber.scheduler import Scheduler

_LOGGER = logging.getLogger(__name__)

_MAX_CALLBACKS_PER_RUN = 200
"""Callbacks run per turn of the loop: a flow-control window's worth of messages (1,000 by default)
arriving at once is split so that the loop serves delivery streams every few milliseconds."""

_Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class LoopScheduler(Scheduler):
    """Runs the subscriber's callbacks on ``loop``, many per wake-up. One per ``subscribe()`` call."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, max_callbacks_per_run: int = _MAX_CALLBACKS_PER_RUN) -> None:
        if max_callbacks_per_run < 1:
            raise ValueError(f"max_callbacks_per_run must be >= 1, got {max_callbacks_per_run}")
        self._loop = loop
        self._max_callbacks_per_run = max_callbacks_per_run
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._run_ended = threading.Condition(self._lock)
        self._buffer: list[_Call] = []
        self._is_wake_pending = False
        """A ``_run`` is queued on the loop: ``schedule`` only appends."""
        self._running_thread: int | None = None
        """The loop's thread while it runs callbacks; ``shutdown`` waits for it to be None."""
        self._is_shut_down = False
        self.runs = 0
        """Runs of callbacks on the loop (each one loop callback); written on the loop only."""
        self.callbacks = 0
        """Callbacks run on the loop; written on the loop only."""

    @property
    def queue(self) -> queue.SimpleQueue[Any]:  # type: ignore[override]
        """The dispatcher's request queue (acks, nacks and modacks of the messages)."""
        return self._queue

    @property
    def is_shut_down(self) -> bool:
        with self._lock:
            return self._is_shut_down

    def buffered(self) -> int:
        """Calls scheduled and not yet taken by the loop."""
        with self._lock:
            return len(self._buffer)

    def schedule(self, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Buffer the call and wake the loop unless a wake-up is already pending. Any thread."""
        with self._lock:
            if not self._is_shut_down and not self._loop.is_closed():
                self._buffer.append((callback, args, kwargs))
                if self._is_wake_pending:
                    return
                try:
                    self._loop.call_soon_threadsafe(self._run)
                except RuntimeError:
                    pass  # closed since the check: refused below with the rest of the buffer
                else:
                    self._is_wake_pending = True
                    return
                refused = self._buffer
                self._buffer = []
            else:
                # A loop closed with a wake-up pending never runs it: what it left buffered goes too.
                refused = [*self._buffer, (callback, args, kwargs)]
                self._buffer = []
        _LOGGER.warning(
            "Pub/Sub scheduler: %d messages arrived after shutdown or with the event loop closed; nacking them",
            len(refused),
        )
        _nack(refused)

    def shutdown(self, await_msg_callbacks: bool = False) -> list[Message]:
        """Take no more calls; return the messages never handed to a callback (the manager nacks them)."""
        with self._lock:
            self._is_shut_down = True
            dropped = self._buffer
            self._buffer = []
            if await_msg_callbacks:
                me = threading.get_ident()
                while self._running_thread is not None and self._running_thread != me:
                    self._run_ended.wait()
        return [args[0] for _callback, args, _kwargs in dropped if args]

    def _run(self) -> None:
        """On the loop: run what is buffered, up to ``max_callbacks_per_run``; queue another run for the rest."""
        with self._lock:
            limit = self._max_callbacks_per_run
            batch = self._buffer[:limit]
            del self._buffer[:limit]
            if self._buffer:
                # More than one run's worth: the rest waits one turn of the loop (still buffered, so
                # a shutdown meanwhile returns it). call_soon: this is the loop's thread.
                self._loop.call_soon(self._run)
            else:
                self._is_wake_pending = False
            if not batch:
                return
            self._running_thread = threading.get_ident()
        self.runs += 1
        started = 0
        try:
            for callback, args, kwargs in batch:
                started += 1
                try:
                    callback(*args, **kwargs)
                except Exception:
                    # The client's wrapper already nacked the message; what escapes it is its own
                    # report failing (a second error sets the pull future's exception again).
                    _LOGGER.exception("Pub/Sub scheduler: a subscriber callback failed")
        finally:
            self.callbacks += started
            with self._lock:
                self._running_thread = None
                self._run_ended.notify_all()
            # Only a BaseException (KeyboardInterrupt, SystemExit) leaves calls not started: give their
            # messages back rather than lose track of them.
            _nack(batch[started:])


def _nack(calls: list[_Call]) -> None:
    for _callback, args, _kwargs in calls:
        if args and isinstance(args[0], Message):
            args[0].nack()
