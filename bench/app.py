"""The app the bench runs against a sidecar, and the waits on what the sidecar has settled.

Rules this module keeps:
- ``BenchApp`` is a no-op app: it reads through the public client (``OrderedSubscriber``) and acks
  every message at once, so what is measured is the sidecar and the client, not the app.
- A message counts once, by its ``event_id``: a redelivery is counted apart, never as throughput.
- Latency runs from the instant a message became due in its key's order (see ``BenchApp._read``),
  and also from its own publish.
- Every wait has a deadline (``phase_timeout``) and names what it waited for; the sidecar's progress
  is read from its ``/metrics``.
"""

from __future__ import annotations

import asyncio
import time

from bench.harness import BenchError, wait_until
from bench.pubsub_clients import TIMESTAMP_ATTRIBUTE
from bench.sidecar_process import Sidecar
from bench.workload import phase_timeout
from pubsub_sidecar_client import OrderedSubscriber


class BenchApp:
    """The no-op app: reads through ``OrderedSubscriber`` and acks every message at once."""

    def __init__(self, target: str, *, track_arrivals: bool = False) -> None:
        self._subscriber = OrderedSubscriber(target, "bench")
        self._track_arrivals = track_arrivals
        self.arrivals: list[tuple[float, str]] = []
        """(instant, key) of every delivery, redeliveries included, when ``track_arrivals``."""
        self.distinct: set[str] = set()
        self.redeliveries = 0
        self.sequences: list[int] = []
        """Sequence of every first delivery, in arrival order."""
        self.last_at = 0.0
        self.latencies: list[float] = []
        """Publish-to-app from the instant order allowed delivery (see ``_read``)."""
        self.own_publish_latencies: list[float] = []
        """Publish-to-app from the message's own publish, shuffle waits included."""
        self._key_ready: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._subscriber.start()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self._subscriber:
            now = time.time()
            await message.ack()
            if self._track_arrivals:
                self.arrivals.append((now, message.key))
            identity = message.attributes["event_id"]
            if identity in self.distinct:
                self.redeliveries += 1
                continue
            self.distinct.add(identity)
            self.sequences.append(message.sequence)
            self.last_at = now
            if message.attributes.get("phase") == "latency":
                published = float(message.attributes[TIMESTAMP_ATTRIBUTE])
                # A shuffled message cannot be delivered before its predecessor, published after
                # it: that wait is the workload's, not the sidecar's. Messages reach the app in key
                # order, so the running maximum of publish instants is when this one became due.
                due = max(published, self._key_ready.get(message.key, 0.0))
                self._key_ready[message.key] = due
                self.latencies.append(now - due)
                self.own_publish_latencies.append(now - published)
            self._changed.set()

    async def wait_for(self, count: int, within_seconds: float) -> None:
        deadline = time.monotonic() + within_seconds
        while len(self.distinct) < count:
            if self._task is not None and self._task.done():
                self._task.result()
                raise BenchError("the app's stream ended")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"the app got {len(self.distinct)} of {count} messages in {within_seconds:.0f}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
            except TimeoutError:
                continue

    async def stop(self) -> None:
        await self._subscriber.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def wait_acks_durable(sidecar: Sidecar, count: int) -> None:
    await asyncio.to_thread(
        wait_until,
        lambda: sidecar.metric("pubsub_sidecar_acked_total") >= count,
        phase_timeout(count),
        f"the sidecar to make {count} app acks durable",
        0.1,
    )


async def until_holding(sidecar: Sidecar, pending: int, what: str, interval: float) -> None:
    """Wait until ``sidecar`` holds ``pending`` messages (its buffered gauge), polled every ``interval``."""
    await asyncio.to_thread(
        wait_until,
        lambda: sidecar.metric("pubsub_sidecar_buffered_messages") >= pending,
        phase_timeout(pending),
        what,
        interval,
    )
