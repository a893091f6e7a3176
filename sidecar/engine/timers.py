"""The engine's timers: one binary heap, so ``next_timer_ms`` is a peek and each timer costs O(log n).

Timers are never removed when they become moot (an acked delivery's deadline, a filled gap's
timeout): the owner checks on expiry whether the timer still applies (a token it stored with it).
Moot timers are counted through ``mark_stale`` and the heap is rebuilt without them once they are
more than half of it, which keeps memory proportional to live timers at amortised O(1) per timer.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

DEADLINE = 0
"""An ack deadline: (entry, delivery id)."""
KEY_BACKOFF = 1
"""A key's backoff ends: (key, backoff_until)."""
ENTRY_BACKOFF = 2
"""none mode: one message's backoff ends: (entry, deliveries at the nack)."""
GAP = 3
"""A sequence gap's timeout: (key, (missing sequence, since))."""

_COMPACT_MIN_SIZE = 1024
"""Below this many timers a rebuild saves too little to be worth it."""

Timer = tuple[int, int, int, object, object]


class TimerHeap:
    __slots__ = ("_counter", "_heap", "_stale")

    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._counter = 0  # tie-break: equal due times fire in the order they were set
        self._stale = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due_ms: int, kind: int, subject: object, token: object) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (due_ms, self._counter, kind, subject, token))

    def mark_stale(self) -> None:
        """One timer no longer applies (the caller knows it exists and is not yet popped)."""
        self._stale += 1

    def peek_ms(self, is_live: Callable[[Timer], bool]) -> int | None:
        heap = self._heap
        while heap and not is_live(heap[0]):
            heapq.heappop(heap)
            self._stale = max(0, self._stale - 1)
        return heap[0][0] if heap else None

    def pop_due(self, now_ms: int) -> Timer | None:
        heap = self._heap
        if heap and heap[0][0] <= now_ms:
            return heapq.heappop(heap)
        return None

    def forget_stale(self) -> None:
        """A popped timer turned out moot (balances an earlier ``mark_stale``)."""
        self._stale = max(0, self._stale - 1)

    def maybe_compact(self, is_live: Callable[[Timer], bool]) -> None:
        heap = self._heap
        if len(heap) >= _COMPACT_MIN_SIZE and self._stale * 2 > len(heap):
            live = [timer for timer in heap if is_live(timer)]
            heapq.heapify(live)
            self._heap = live
            self._stale = 0
