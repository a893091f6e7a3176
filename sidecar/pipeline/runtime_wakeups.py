"""Wake-ups of one subscription's runtime: the streams waiting for ready messages, and the timer.

Rules:

- Streams wait for ready messages on an ``asyncio.Event`` they register with ``add``; every
  registered event is set after a change that leaves messages ready (``after_change``), and all of
  them when a stream must look again whatever the engines hold (``wake_all``: a shard dropped, the
  runtime stopping or failed). No polling.
- One timer task (``run_timer``) calls ``engine.tick`` at the engines' ``next_timer_ms()``, woken
  early when an engine call schedules an earlier timer (backoff, ack deadline, gap timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from sidecar.engine.types import Action
from sidecar.pipeline.shard_engines import ShardEngine, ShardEngines


class Wakeups:
    """The streams' events and the timer task of one subscription's engines."""

    def __init__(self, engines: ShardEngines, clock: Callable[[], int]) -> None:
        self._engines = engines
        self._clock = clock
        self._wakers: set[asyncio.Event] = set()
        self._timer_wake = asyncio.Event()
        self._timer_due_ms: int | None = None

    def add(self, event: asyncio.Event) -> None:
        """Register a stream's event: set whenever messages may be ready, or the runtime stops."""
        self._wakers.add(event)
        if self._engines.has_ready():
            event.set()

    def remove(self, event: asyncio.Event) -> None:
        self._wakers.discard(event)

    def wake_all(self) -> None:
        """Every stream looks again (and notices a dropped shard, a stop or a failure)."""
        for event in self._wakers:
            event.set()

    def after_change(self) -> None:
        """Wake streams when messages are ready and the timer when an earlier timer appeared."""
        if self._wakers and self._engines.has_ready():
            for event in self._wakers:
                event.set()
        self.maybe_wake_timer()

    def maybe_wake_timer(self) -> None:
        due_ms = self._engines.next_timer_ms()
        if due_ms is not None and (self._timer_due_ms is None or due_ms < self._timer_due_ms):
            self._timer_wake.set()

    async def run_timer(self, apply: Callable[[ShardEngine, Sequence[Action]], None]) -> None:
        """Tick every engine whose timer is due and ``apply`` what it decided; returns only by cancellation."""
        while True:
            now_ms = self._clock()
            due_ms = self._engines.next_timer_ms()
            if due_ms is not None and due_ms <= now_ms:
                for entry in self._engines:
                    entry_due = entry.engine.next_timer_ms()
                    if entry_due is not None and entry_due <= now_ms:
                        apply(entry, entry.engine.tick(now_ms))
                self.after_change()
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
