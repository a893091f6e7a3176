"""The leases the stream intake (``sidecar.pipeline.ingest_stream``) holds on what it pulled: pure
bookkeeping, no I/O and no clock of its own (every call is given ``now``, monotonic seconds).

The rules are the official Python subscriber's (``_protocol/leaser.py``, ``histogram.py`` and the
streaming pull manager, google-cloud-pubsub 2.x), which the intake replaces:

- **Every message received is leased** until it is acked or nacked (``release``), or until it was
  held longer than ``max_lease_seconds`` (``FlowControl.max_lease_duration``): ``due`` then drops it
  and Pub/Sub redelivers it once its deadline passes.
- **The ack deadline** asked for is the 99th percentile of the seconds from receipt to ack, in whole
  seconds within Pub/Sub's range (10-600 s); with no ack yet, 10 s. It is sticky: computed again
  only once the number of acks recorded grew past min(2x, +100) of the last computation. A
  configured ``max_extension_seconds`` caps it (and is itself raised to 10 s, the minimum).
- **Flow control is the client's.** ``load`` is the larger of messages and bytes held over their
  maximums; the intake stops reading the stream at 1.0 and reads again below ``RESUME_THRESHOLD``
  (Pub/Sub's own limits, sent in the stream's first request, are advisory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_ACK_DEADLINE_SECONDS = 10
MAX_ACK_DEADLINE_SECONDS = 600
RESUME_THRESHOLD = 0.8
"""Below this load a paused intake reads the stream again (the official client's threshold)."""


@dataclass(slots=True)
class _Lease:
    size: int
    received: float


class AckHistogram:
    """Seconds from receipt to ack, counted per whole second in 10-600 (values outside are clamped)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.size = 0

    def add(self, seconds: float) -> None:
        value = min(MAX_ACK_DEADLINE_SECONDS, max(MIN_ACK_DEADLINE_SECONDS, math.ceil(seconds)))
        self._counts[value] = self._counts.get(value, 0) + 1
        self.size += 1

    def percentile(self, percent: float) -> int:
        """The smallest value at or above ``percent`` of the recorded ones; 10 with none."""
        if not self.size:
            return MIN_ACK_DEADLINE_SECONDS
        target = self.size * percent / 100
        seen = 0
        for value in sorted(self._counts):
            seen += self._counts[value]
            if seen >= target:
                return value
        return MAX_ACK_DEADLINE_SECONDS


class LeaseBook:
    """The leased messages of one streaming pull, by ack id, and the ack deadline to ask for."""

    def __init__(
        self,
        *,
        max_messages: int,
        max_bytes: int,
        max_lease_seconds: float,
        max_extension_seconds: int = 0,
    ) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError(
                f"flow control needs max_messages >= 1 and max_bytes >= 1, got {max_messages}, {max_bytes}"
            )
        if max_lease_seconds <= 0:
            raise ValueError(f"max_lease_seconds must be > 0, got {max_lease_seconds}")
        if max_extension_seconds < 0:
            raise ValueError(f"max_extension_seconds must be >= 0, got {max_extension_seconds}")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_lease_seconds = max_lease_seconds
        self.max_extension_seconds = max_extension_seconds
        self._leases: dict[str, _Lease] = {}
        self.bytes = 0
        self.histogram = AckHistogram()
        self._histogram_size_at_update = 0
        self._deadline = self._capped(self.histogram.percentile(99))

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, ack_id: object) -> bool:
        return ack_id in self._leases

    def add(self, ack_id: str, size: int, now: float) -> None:
        """Lease a message just received (a redelivery under the same ack id keeps its first lease)."""
        if ack_id in self._leases:
            return
        self._leases[ack_id] = _Lease(size, now)
        self.bytes += size

    def release(self, ack_id: str, now: float, *, acked: bool) -> bool:
        """End a lease (an ack when ``acked``: its time to ack is recorded); False if none was held."""
        lease = self._leases.pop(ack_id, None)
        if lease is None:
            return False
        self.bytes -= lease.size
        if acked:
            self.histogram.add(now - lease.received)
        return True

    def load(self, on_hold: int = 0, on_hold_bytes: int = 0) -> float:
        """Held over the maximums, not counting ``on_hold`` messages (received, not yet handed over)."""
        return max(
            (len(self._leases) - on_hold) / self.max_messages,
            (self.bytes - on_hold_bytes) / self.max_bytes,
        )

    def has_room(self, on_hold: int = 0, on_hold_bytes: int = 0) -> bool:
        """``load(on_hold, on_hold_bytes) < 1``, without the divisions: asked once per message handed over."""
        return len(self._leases) - on_hold < self.max_messages and self.bytes - on_hold_bytes < self.max_bytes

    def deadline(self) -> int:
        """The ack deadline to ask for now, in seconds (sticky; see the module's rules)."""
        size = self.histogram.size
        target = min(self._histogram_size_at_update * 2, self._histogram_size_at_update + 100)
        if size > target:
            self._histogram_size_at_update = size
            self._deadline = self._capped(self.histogram.percentile(99))
        return self._deadline

    def due(self, now: float) -> tuple[list[str], list[str]]:
        """The leases to extend now and those held past ``max_lease_seconds``, which are dropped
        (no longer leased: Pub/Sub redelivers them once their deadline passes)."""
        cutoff = now - self.max_lease_seconds
        dropped = [ack_id for ack_id, lease in self._leases.items() if lease.received < cutoff]
        for ack_id in dropped:
            self.release(ack_id, now, acked=False)
        return list(self._leases), dropped

    def _capped(self, seconds: int) -> int:
        if self.max_extension_seconds:
            seconds = min(seconds, max(self.max_extension_seconds, MIN_ACK_DEADLINE_SECONDS))
        return max(MIN_ACK_DEADLINE_SECONDS, min(MAX_ACK_DEADLINE_SECONDS, seconds))
