"""Backpressure: no new batch is persisted while the app is too far behind.

``Backpressure.maybe_wait`` is awaited by the ingest's batch loop before it sorts what was received.

Rules:

- **Two levels.** The client's ``FlowControl(max_messages, max_bytes)`` bounds what it holds
  un-acked (received, being classified, persisted or dead-lettered). Above that, when
  ``runtime.undelivered()`` exceeds ``max_undelivered_messages``, the batch loop waits here.
  Received messages are then held un-acked, so the client's flow control fills up and pauses the
  stream, and Pub/Sub keeps the backlog.
- **Without deadlock** (DESIGN §4): ``undelivered`` counts messages releasable or in flight to the
  app, never those held for ordering: the message that releases them may be exactly what is still
  in Pub/Sub.
- Chosen over cancelling and restarting the streaming pull because a cancel nacks what the client
  holds (a redelivery burst on resume), restarts cost a new stream, and the held messages are
  exactly what is persisted first on resume.
- ``undelivered`` is re-read every ``pause_poll_seconds`` while paused (the runtime has no "acked"
  event to wait on); pulling resumes once it is back at or under the limit.
"""

from __future__ import annotations

import asyncio
import logging

from sidecar.pipeline.ingest_counters import IngestCounters
from sidecar.pipeline.runtime import SubscriptionRuntime

_LOGGER = logging.getLogger(__name__)


class Backpressure:
    """Pauses one subscription's batch loop while its runtime has too many undelivered messages."""

    def __init__(
        self,
        name: str,
        runtime: SubscriptionRuntime,
        counters: IngestCounters,
        *,
        max_undelivered: int | None,
        pause_poll_seconds: float,
    ) -> None:
        self.name = name
        self._runtime = runtime
        self._counters = counters
        self.max_undelivered = max_undelivered
        """``flow_control.max_undelivered_messages``; None: no limit."""
        self._pause_poll_seconds = pause_poll_seconds
        self.is_paused = False
        """True while no batch is persisted because ``undelivered`` is over the limit."""

    async def maybe_wait(self) -> None:
        """Return at once under the limit; otherwise wait until the app is back at or under it."""
        limit = self.max_undelivered
        if limit is None or self._runtime.undelivered() <= limit:
            return
        self.is_paused = True
        self._counters.pauses += 1
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
            self.is_paused = False
        _LOGGER.info("ingest of %s resumed: %d undelivered", self.name, self._runtime.undelivered())
