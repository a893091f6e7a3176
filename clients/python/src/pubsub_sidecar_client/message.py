"""What the app holds: ``Message`` (one delivery, as plain Python values) and the connection
generation (``_Stream``) that delivered it.

Rules this module keeps:
- A delivery id is valid only on the stream that delivered it, so each message keeps a reference to
  its ``_Stream``; the subscriber drops acks for messages whose stream is gone.
- A message settles (ack, nack) through whatever delivered it, seen only as a ``_Settler``: this
  module does not import the subscriber, which builds messages and imports this module.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from google.protobuf import duration_pb2

from pubsub_sidecar.v1 import sidecar_pb2
from pubsub_sidecar_client.errors import NotConfirmed


class _Settler(Protocol):
    """What settles a message: ``OrderedSubscriber`` queues the ack or nack on the message's stream
    and returns False when it is dropped (settled already, or the stream is gone)."""

    def _settle(
        self,
        message: Message,
        *,
        ack: bool,
        retry_after: timedelta | float | None = None,
        dead_letter: bool = False,
    ) -> bool: ...


class _Stream:
    """One connection's state: its outgoing requests and the messages it delivered."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.is_open = True
        self.outgoing: asyncio.Queue[sidecar_pb2.SubscribeRequest | None] = asyncio.Queue()
        self.outstanding: dict[str, Message] = {}
        """Delivered on this stream and not yet confirmed or nacked, by delivery id."""
        self.awaiting_confirmation: set[str] = set()
        self.all_confirmed = asyncio.Event()
        self.all_confirmed.set()
        self.got_response = False

    def close(self) -> None:
        """End this generation: nothing more is sent, and nothing it delivered can be confirmed."""
        self.is_open = False
        while not self.outgoing.empty():
            self.outgoing.get_nowait()
        # Unblock the request iterator so gRPC finishes the call.
        self.outgoing.put_nowait(None)
        for message in self.outstanding.values():
            message._fail_confirmation(f"the stream (generation {self.generation}) ended before the ack was confirmed")
        self.outstanding.clear()
        self.awaiting_confirmation.clear()
        self.all_confirmed.set()


@dataclass(eq=False, slots=True)
class Message:
    """A message delivered by the sidecar, as plain Python values.

    ``publish_time`` and ``event_time`` are timezone-aware UTC datetimes (``event_time`` is None
    outside watermark mode); ``sequence`` is 0 outside sequence mode; ``skipped`` holds the
    inclusive ``(first, last)`` sequence ranges skipped right before this message. ``replayed`` says
    that an operator replayed this message from the dead-letter topic after its key had gone past
    it: it is not in its original order (a replay that took its place in the order is not flagged).
    """

    delivery_id: str
    key: str
    message_id: str
    dedup_id: str
    data: bytes
    attributes: dict[str, str]
    publish_time: datetime | None
    sequence: int
    event_time: datetime | None
    delivery_attempt: int
    late: bool
    skipped: tuple[tuple[int, int], ...]
    epoch: int
    """The fencing token of this key: its shard's lease epoch at the delivering sidecar (0 without
    leases). Grows whenever the key moves to another sidecar; refuse side effects of a lower one."""
    replayed: bool
    trace_context: dict[str, str]
    """The message's W3C trace context as a propagation carrier: ``{"traceparent": ...}`` (and
    ``"tracestate"`` when the message carries one), empty when it carries none. With OpenTelemetry:
    ``TraceContextTextMapPropagator().extract(message.trace_context)`` is the context to start the
    app's span in, so that it continues the publisher's trace (through the sidecar's span when the
    sidecar traces)."""
    _subscriber: _Settler = field(repr=False)
    _stream: _Stream = field(repr=False)
    _settled: bool = field(default=False, repr=False)
    _is_confirmed: bool = field(default=False, repr=False)
    _failure: str = field(default="", repr=False)
    _confirmation: asyncio.Future[None] | None = field(default=None, repr=False)

    async def ack(self) -> bool:
        """Acknowledge; returns True once queued on the stream, False when dropped.

        Dropped means the stream that delivered the message is gone (it will be redelivered) or
        the message was already acked or nacked.
        """
        return self._subscriber._settle(self, ack=True)

    async def nack(self, retry_after: timedelta | float | None = None, dead_letter: bool = False) -> bool:
        """Give the message back: redelivered after ``retry_after`` (seconds or timedelta; None = the
        subscription's backoff policy), or published to the dead-letter topic when ``dead_letter``.

        Returns as ``ack()`` does. Raises ValueError for a negative ``retry_after``.
        """
        return self._subscriber._settle(self, ack=False, retry_after=retry_after, dead_letter=dead_letter)

    async def confirmed(self) -> None:
        """Wait until the sidecar confirms this message's ack as durable.

        Raises NotConfirmed when that cannot happen any more (nacked, or the stream ended first).
        Call it after ``ack()``; before, it waits for an ack that someone else sends.
        """
        if self._is_confirmed:
            return
        if self._failure:
            raise NotConfirmed(f"delivery {self.delivery_id}: {self._failure}")
        # A waiter that was cancelled cancelled the future with it: start a fresh one.
        if self._confirmation is None or self._confirmation.cancelled():
            self._confirmation = asyncio.get_running_loop().create_future()
        await self._confirmation

    @property
    def is_confirmed(self) -> bool:
        return self._is_confirmed

    def _mark_confirmed(self) -> None:
        self._is_confirmed = True
        if self._confirmation is not None and not self._confirmation.done():
            self._confirmation.set_result(None)

    def _fail_confirmation(self, reason: str) -> None:
        if self._is_confirmed or self._failure:
            return
        self._failure = reason
        # The future exists only if someone awaits it, so its exception is always retrieved.
        if self._confirmation is not None and not self._confirmation.done():
            self._confirmation.set_exception(NotConfirmed(f"delivery {self.delivery_id}: {reason}"))


def _trace_context(proto: sidecar_pb2.OrderedMessage) -> dict[str, str]:
    """``OrderedMessage.traceparent`` with the tracestate the message's attributes carry beside it."""
    if not proto.traceparent:
        return {}
    carrier = {"traceparent": proto.traceparent}
    attributes = proto.attributes
    prefix = "googclient_" if "googclient_traceparent" in attributes else ""
    tracestate = attributes.get(prefix + "tracestate", "")
    if tracestate:
        carrier["tracestate"] = tracestate
    return carrier


def _to_datetime(message: sidecar_pb2.OrderedMessage, field_name: str) -> datetime | None:
    if not message.HasField(field_name):
        return None
    moment: datetime = getattr(message, field_name).ToDatetime(tzinfo=UTC)
    return moment


def _to_duration(retry_after: timedelta | float) -> duration_pb2.Duration:
    seconds = retry_after.total_seconds() if isinstance(retry_after, timedelta) else float(retry_after)
    if seconds < 0:
        raise ValueError(f"retry_after must not be negative, got {retry_after!r}")
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration
