"""Whether Pub/Sub delivers to this pod: what the StreamingPull attempts of one subscription say.

The official subscriber hides stream failures. It reopens a stream that ended with a retryable
code (``_RETRYABLE_STREAM_ERRORS`` in its ``streaming_pull_manager.py``: ABORTED, DEADLINE_EXCEEDED,
INTERNAL, RESOURCE_EXHAUSTED (quota), UNAVAILABLE, UNKNOWN) without end, logging at DEBUG, and it
closes the pull for good on a terminating one (CANCELLED, INVALID_ARGUMENT, NOT_FOUND (a deleted
subscription), PERMISSION_DENIED, UNAUTHENTICATED). Either way a pod can receive nothing while its
probes stay green. This module turns the attempts into one answer, ``problem()``, that /readyz,
GetStatus and the metrics report (docs/operations.md, "Probes").

Rules (pure: the clock and the count of received messages are arguments; thread-safe, since the
attempts end on the client's threads):

- An attempt that ends with a code other than OK or CANCELLED (the client's own cancel, at a stop
  or a close) is a failure. The first failure after the last sign of health starts a run.
- Signs of health end a run: a message received since the run started, or an attempt that has
  stayed open ``settled_after_seconds`` (an attempt that failed after that long was a working
  stream that ended: a new run starts with its failure).
- ``problem()`` names the run's last code and details once it has lasted ``failing_after_seconds``
  (retryable failures: the client is still retrying), and at once when the pull was closed for
  good (``closed``: ingest opens a new one after a backoff). None otherwise.
- Failures are counted by code (``errors``) whatever their run, for the metric.

Bound: a pod whose every StreamingPull fails is reported within ``failing_after_seconds`` (10 s)
of the first failure, one closed for good at once; it is reported healthy again once a reopened
stream stayed open ``settled_after_seconds`` (5 s) or delivered a message. /readyz adds its 2 s
cache to each.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from google.api_core import exceptions as api_exceptions

from sidecar.backoff import backoff_seconds

FAILING_AFTER_SECONDS = 10.0
"""A run of failed attempts this long is reported. The client reopens a failed stream at once (at
most 5 times in 10 s, its reopen throttle), so a blip (one UNAVAILABLE, a stream the server
closed after minutes) is over within a second or two and never reported."""

SETTLED_AFTER_SECONDS = 5.0
"""An attempt open this long without an error counts as working. Refusals (a missing subscription,
a missing permission, a quota) come back within a round trip of the open."""

_IGNORED_CODES = frozenset({"OK", "CANCELLED"})
"""Endings that are no failure: a clean end, and the client cancelling its own stream."""

_LOGGER = logging.getLogger(__name__)

_REOPEN_INITIAL_SECONDS = 1.0
"""First wait before a streaming pull closed for good is opened again (a subscription recreated at
once, a permission granted back)."""
_REOPEN_MAXIMUM_SECONDS = 30.0
"""Cap on that wait: a fixed subscription is pulled again within 30 s, and a lasting refusal costs
two StreamingPull calls a minute."""

_MAX_DETAILS_CHARS = 200
"""Status details quoted in ``problem()``: enough for Pub/Sub's messages, short enough for a probe body."""


@dataclass(frozen=True, slots=True)
class PullFailure:
    """The last failure of a run: its status code name and details."""

    code: str
    details: str


class PullHealth:
    """The StreamingPull attempts of one subscription (see the module docstring)."""

    def __init__(
        self,
        received: Callable[[], int],
        *,
        failing_after_seconds: float = FAILING_AFTER_SECONDS,
        settled_after_seconds: float = SETTLED_AFTER_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._received = received
        self._failing_after = failing_after_seconds
        self._settled_after = settled_after_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._open: dict[int, float] = {}
        """Attempt -> when it started, for the attempts not ended yet."""
        self._failing_since: float | None = None
        self._received_at_failure = 0
        self._last: PullFailure | None = None
        self._closed: PullFailure | None = None
        """The pull was closed for good with this failure, and no stream has worked since."""
        self._reopen_at: float | None = None
        self.consecutive_closes = 0
        """Pulls closed for good since a stream last worked: ingest's backoff before the next one."""
        self.errors: Counter[str] = Counter()
        """Failed attempts by status code name, since the start."""

    def attempt_started(self) -> int:
        with self._lock:
            attempt = next(self._ids)
            self._open[attempt] = self._clock()
            return attempt

    def attempt_ended(self, attempt: int, code: str, details: str) -> None:
        """An attempt ended with ``code`` (a ``grpc.StatusCode`` name)."""
        with self._lock:
            now = self._clock()
            started = self._open.pop(attempt, now)
            if code in _IGNORED_CODES:
                return
            self.errors[code] += 1
            if now - started >= self._settled_after:
                self._healthy()  # a working stream ended: this failure starts a new run
            self._refresh(now)
            if self._failing_since is None:
                self._failing_since = now
                self._received_at_failure = self._received()
            self._last = PullFailure(code, " ".join(details.split())[:_MAX_DETAILS_CHARS])

    def closed(self, code: str, details: str, reopen_in_seconds: float) -> None:
        """The pull ended for good with ``code``; ingest opens a new one in ``reopen_in_seconds``."""
        with self._lock:
            now = self._clock()
            self._refresh(now)
            failure = PullFailure(code, " ".join(details.split())[:_MAX_DETAILS_CHARS])
            if self._failing_since is None:
                self._failing_since = now
                self._received_at_failure = self._received()
            self._last = self._closed = failure
            self._reopen_at = now + reopen_in_seconds
            self.consecutive_closes += 1

    def problem(self) -> str | None:
        """Why this pod receives nothing from Pub/Sub, in one line; None while pulling works."""
        with self._lock:
            now = self._clock()
            self._refresh(now)
            if self._failing_since is None or self._last is None:
                return None
            failing = now - self._failing_since
            if self._closed is not None:
                text = f"the streaming pull was closed by {self._closed.code}: {self._closed.details}"
                if self._reopen_at is not None and self._reopen_at > now and not self._open:
                    return f"{text}; reopening in {self._reopen_at - now:.0f}s"
                return f"{text}; failing for {failing:.0f}s, reopened"
            if failing < self._failing_after:
                return None
            return f"every streaming pull failed for {failing:.0f}s, last with {self._last.code}: {self._last.details}"

    def is_failing(self) -> bool:
        return self.problem() is not None

    def _refresh(self, now: float) -> None:
        """End the run on a sign of health (lock held)."""
        if self._failing_since is None:
            return
        if self._received() != self._received_at_failure:
            self._healthy()
            return
        if any(now - started >= self._settled_after for started in self._open.values()):
            self._healthy()

    def _healthy(self) -> None:
        self._failing_since = None
        self._last = None
        self._closed = None
        self._reopen_at = None
        self.consecutive_closes = 0


def report_closed(
    health: PullHealth, subscription_path: str, name: str, error: api_exceptions.GoogleAPICallError
) -> float:
    """Report that Pub/Sub closed a pull for good (``PullHealth``, an ERROR log), for either intake;
    returns how long to wait before opening it again."""
    status = error.grpc_status_code
    code = status.name if status is not None else type(error).__name__
    delay = backoff_seconds(health.consecutive_closes + 1, _REOPEN_INITIAL_SECONDS, _REOPEN_MAXIMUM_SECONDS)
    health.closed(code, error.message or str(error), delay)
    _LOGGER.error(
        "streaming pull of %s (subscription %r) was closed by Pub/Sub: %s; nothing is received until it "
        "works again, /readyz answers 503; opening it again in %.1fs",
        subscription_path,
        name,
        describe_error(error),
        delay,
    )
    return delay


def describe_error(exc: BaseException) -> str:
    """An error for a log line or ``IngestError``: a Pub/Sub error with its status code."""
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return f"{exc.__class__.__name__} ({exc.code}): {exc.message}"
    return f"{exc.__class__.__name__}: {exc}"
