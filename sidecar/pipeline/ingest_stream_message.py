"""What the stream intake hands ingest: ``IntakeMessage``, one received message read once from its raw
protobuf (``PulledMessage`` to ingest), acked or nacked through the intake that leased it; and
``FlowLimits``, the limits in force for ingest's start log."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Protocol

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


class Settles(Protocol):
    """The intake a message came from: it ends the message's lease and sends its ack or nack."""

    def settle(self, message: IntakeMessage, *, acked: bool) -> None: ...


class IntakeMessage:
    """A message the stream intake received, as ingest sees it (``PulledMessage``)."""

    __slots__ = (
        "_intake",
        "_publish_nanos",
        "_publish_seconds",
        "ack_id",
        "attributes",
        "data",
        "delivery_attempt",
        "message_id",
        "ordering_key",
        "size",
    )

    def __init__(self, intake: Settles, received: Any) -> None:
        message = received.message
        self._intake = intake
        self.ack_id: str = received.ack_id
        self.message_id: str = message.message_id
        self.data: bytes = message.data
        attributes = message.attributes
        self.attributes: Mapping[str, str] = {k: attributes[k] for k in attributes}  # dict() of it is 2x slower
        self.ordering_key: str = message.ordering_key
        stamp = message.publish_time
        self._publish_seconds: int = stamp.seconds
        self._publish_nanos: int = stamp.nanos
        attempt: int = received.delivery_attempt
        self.delivery_attempt: int | None = attempt or None
        self.size: int = message.ByteSize()

    @property
    def publish_time(self) -> datetime.datetime:
        return _EPOCH + datetime.timedelta(seconds=self._publish_seconds, microseconds=self._publish_nanos // 1000)

    @property
    def publish_time_ms(self) -> int:
        return self._publish_seconds * 1000 + self._publish_nanos // 1_000_000

    def ack(self) -> None:
        self._intake.settle(self, acked=True)

    def nack(self) -> None:
        self._intake.settle(self, acked=False)


class FlowLimits:
    """The limits in force, for ingest's start log (the official client's ``FlowControl`` fields)."""

    def __init__(self, max_messages: int, max_bytes: int, max_duration_per_lease_extension: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_duration_per_lease_extension = max_duration_per_lease_extension
