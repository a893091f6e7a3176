"""Lag as capacity: intake against delivery over a sliding window, and whether the backlog grows. Pure.

A queue that grows without pause is a capacity problem, not a spike. ``CapacityWindow`` is fed
samples of two running totals (``observe``) and says, at any instant, how fast messages came in,
how fast they were finished, and for how long the backlog has been growing (``capacity``).
``LeaseHealth`` is fed a lease manager's running counts and says since when its reads of Firestore
fail. Neither reads a clock: every instant is an argument (seconds, any monotonic origin), so both
are tested without sleeping.

Rules:

- Rates are the change of a total over the window (``WINDOW_SECONDS``, a sliding minute) divided by
  the time between the window's first and last samples. Until samples span ``MIN_SPAN_SECONDS``
  there are no rates (``Capacity.known`` False): a rate over a second or two is noise.
- The deficit is intake minus delivery (per second). The backlog *grows* when, over the window,
  more came in than was finished by more than ``GROWTH_MIN_MESSAGES`` and than ``GROWTH_SHARE`` of
  a whole window's intake at the current rate: messages in flight to the app make the two differ
  a little at any instant, and that is not growth.
- ``growing_for_seconds`` counts from where the first window that showed growth had its lowest
  backlog (the latest sample with the fewest messages in minus out), and goes back to 0 at the
  first window that does not show growth: a sustained deficit has a long one, a spike a short one.
  Alert on it, not on the deficit.
- Totals only grow (the sidecar's counters are running totals for the life of the process). A
  total seen to fall (a new process behind the same tracker) starts the window afresh.
- Memory is bounded: samples closer than ``MIN_SAMPLE_GAP_SECONDS`` to the previous one replace it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW_SECONDS = 60.0
MIN_SPAN_SECONDS = 10.0
GROWTH_MIN_MESSAGES = 10
"""Below this many messages more in than out over a window, the backlog is not said to grow."""
GROWTH_SHARE = 0.05
"""Nor below this share of a window's intake (messages in flight move with the load)."""
MIN_SAMPLE_GAP_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class Capacity:
    """Intake against delivery over the window ending now."""

    intake_per_second: float
    """New messages taken in per second (duplicates and recovered backlog not counted)."""
    delivered_per_second: float
    """Messages finished per second: acked by the app, or dead-lettered."""
    span_seconds: float
    """How much time the rates cover (up to the window); 0 until there are two samples."""
    growing_for_seconds: float
    """How long the backlog has been growing without pause; 0 when it does not grow."""

    @property
    def known(self) -> bool:
        """Whether the samples span enough time for the rates to mean something."""
        return self.span_seconds >= MIN_SPAN_SECONDS

    @property
    def deficit_per_second(self) -> float:
        """Intake minus delivery: positive while messages come in faster than they are finished."""
        return self.intake_per_second - self.delivered_per_second

    @property
    def growing(self) -> bool:
        return self.growing_for_seconds > 0


UNKNOWN = Capacity(0.0, 0.0, 0.0, 0.0)


class CapacityWindow:
    """Samples of (instant, intake total, delivered total) over the last ``window_seconds``."""

    def __init__(self, window_seconds: float = WINDOW_SECONDS) -> None:
        self._window = window_seconds
        self._samples: deque[tuple[float, int, int]] = deque()
        self._growing_since: float | None = None

    def observe(self, now: float, intake_total: int, delivered_total: int) -> None:
        """One sample of both running totals at ``now`` (instants must not go back)."""
        samples = self._samples
        if samples:
            last_at, last_intake, last_delivered = samples[-1]
            if now < last_at or intake_total < last_intake or delivered_total < last_delivered:
                samples.clear()  # another origin: start afresh rather than report a negative rate
                self._growing_since = None
            elif len(samples) > 1 and now - samples[-2][0] < MIN_SAMPLE_GAP_SECONDS:
                samples.pop()
        samples.append((now, intake_total, delivered_total))
        # Keep the newest sample at or before the window's start: the window then spans all of it.
        while len(samples) > 2 and samples[1][0] <= now - self._window:
            samples.popleft()
        self._update_growth()

    def _update_growth(self) -> None:
        samples = self._samples
        first_at, first_intake, first_delivered = samples[0]
        last_at, last_intake, last_delivered = samples[-1]
        if last_at - first_at < MIN_SPAN_SECONDS:
            return  # too short to tell: growth stays as it was
        came_in = last_intake - first_intake
        grew = came_in - (last_delivered - first_delivered)
        # The share is of a whole window's intake at the current rate: a short window is no more sensitive.
        if grew > max(GROWTH_MIN_MESSAGES, GROWTH_SHARE * came_in / (last_at - first_at) * self._window):
            if self._growing_since is None:
                # From the window's lowest backlog on (the latest such sample): growth started there.
                lowest = min(intake - delivered for _, intake, delivered in samples)
                self._growing_since = max(at for at, intake, delivered in samples if intake - delivered == lowest)
        else:
            self._growing_since = None

    def capacity(self, now: float) -> Capacity:
        """The rates over the window's samples, and how long the backlog has grown as of ``now``."""
        samples = self._samples
        if len(samples) < 2:
            return UNKNOWN
        first_at, first_intake, first_delivered = samples[0]
        last_at, last_intake, last_delivered = samples[-1]
        span = last_at - first_at
        if span <= 0:
            return UNKNOWN
        growing_for = 0.0 if self._growing_since is None else max(0.0, now - self._growing_since)
        return Capacity(
            intake_per_second=(last_intake - first_intake) / span,
            delivered_per_second=(last_delivered - first_delivered) / span,
            span_seconds=span,
            growing_for_seconds=growing_for,
        )


class LeaseHealth:
    """Since when a lease manager's reads of Firestore fail, from its running counts.

    A lease round reads the lease documents first; a round whose read fails writes nothing. So
    rounds whose reads all failed mean that Firestore does not answer this pod, and the pod loses
    its leases once they run out. ``observe`` takes the running totals of rounds and failed reads;
    the first sample with a new failure marks the start, the first with rounds that read again
    ends it."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None
        self.failing_since: float | None = None
        """The instant of the first sample that saw a failed read, while reads still fail."""
        self.failed_reads = 0
        """Failed reads since ``failing_since``."""

    def observe(self, now: float, rounds: int, read_failures: int) -> None:
        last, self._last = self._last, (rounds, read_failures)
        if last is None:
            return
        new_rounds, new_failures = rounds - last[0], read_failures - last[1]
        if new_rounds < 0 or new_failures < 0:
            self.failing_since, self.failed_reads = None, 0  # another origin
        elif new_failures > 0:
            if self.failing_since is None:
                self.failing_since = now
            self.failed_reads += new_failures
            if new_rounds > new_failures:  # some round of these read fine: Firestore answers again
                self.failing_since, self.failed_reads = None, 0
        elif new_rounds > 0:
            self.failing_since, self.failed_reads = None, 0
