"""One heap of deadlines served by a single event-loop timer handle (lease expiries, delayed releases).

Entries are never removed: a superseded one (a lease acked or extended since) is recognised and
skipped by the owner's callback when it comes due, so pushing costs O(log n) and nothing else.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any


class TimerHeap:
    """Calls ``on_due(when, kind, obj)`` for each pushed entry once the loop's clock reaches ``when``."""

    def __init__(self, on_due: Callable[[float, int, Any], None]) -> None:
        self._on_due = on_due
        self._heap: list[tuple[float, int, int, Any]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0

    def push(self, when: float, kind: int, obj: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._order), kind, obj))
        if self._timer is None or when < self._timer_when:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_when = when
            self._timer = asyncio.get_running_loop().call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, _, kind, obj = heapq.heappop(heap)
            self._on_due(when, kind, obj)
        if heap:
            self._timer_when = heap[0][0]
            self._timer = loop.call_at(self._timer_when, self._fire)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()
