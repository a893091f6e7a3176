"""Settlement: every message ingest received, until it is acked or nacked with Pub/Sub.

``Settlement`` holds each received message by ack id (``receive``) until one of its ways out, and
is the only place that acks or nacks a Pub/Sub message.

Rules (G1 in DESIGN §1 depends on each of them):

- **Ack only what is safe.** The callers ack a message only after the store said it is durable,
  after its fast-path app ack is durable (``on_volatile_settled`` with ``safe``), or after the
  dead-letter topic accepted it (``dead_letter_then_ack``). Nothing is ever dropped: a message not
  acked is nacked or left to its lease, and Pub/Sub delivers it again.
- **Once.** A message is settled once: ``ack`` and ``nack`` of a message no longer held do
  nothing (a nack scheduled by ``nack_later`` and then overtaken by an ack, a fast-path message
  given back at stop and settled by the runtime afterwards).
- **Dead letters.** Published to the dead-letter topic, retried with backoff until the topic takes
  them (the client keeps the lease meanwhile), and acked only then. A subscription without a
  ``dead_letter_topic`` cannot do that: such a message is nacked after the maximum backoff, so it
  stays in Pub/Sub (where the subscription's own dead-letter policy, if any, applies) and an error
  is logged each time.
- **Give back at stop with our own calls.** ``give_back`` nacks everything still held with its own
  ModifyAckDeadline calls once the stream is closed: nacked on the open stream, Pub/Sub would send
  them straight back to it, and after the stream closed the client's dispatcher would drop them.
- **Forwarded messages** (``sidecar.pipeline.ingest_forwarded``): a message another pod forwarded is
  held and settled like Pub/Sub's, by the same rules; its ``ack``/``nack`` answer that pod, and
  ``give_back`` nacks it directly (it has no ack id Pub/Sub knows). ``acked``/``nacked`` count
  Pub/Sub's messages only.
- Everything runs on the event loop. Payloads never appear in logs; ids, counts and reasons do.
  Pub/Sub's messages are seen through ``PulledMessage`` (what ingest uses of them), and the give-back
  calls through ``StreamingPull.nack_ids``: only ``sidecar.pipeline.ingest_pull`` imports the client.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from google.api_core import exceptions as api_exceptions

from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.engine.types import Message
from sidecar.pipeline.ingest_counters import IngestCounters
from sidecar.pipeline.ingest_forwarded import is_forwarded

_LOGGER = logging.getLogger(__name__)

_MAX_IDS_PER_MODACK = 1000
"""Pub/Sub accepts at most 1000 ack ids per ModifyAckDeadline call."""


class PulledMessage(Protocol):
    """What ingest uses of a message the Pub/Sub subscriber hands over (its ``Message``)."""

    @property
    def ack_id(self) -> str: ...
    @property
    def message_id(self) -> str: ...
    @property
    def data(self) -> bytes: ...
    @property
    def attributes(self) -> Mapping[str, str]: ...
    @property
    def ordering_key(self) -> str: ...
    @property
    def publish_time(self) -> datetime.datetime: ...
    def ack(self) -> None:
        """Ack through the client's dispatcher (queued; sent on the stream's connection)."""

    def nack(self) -> None:
        """Nack through the client's dispatcher: Pub/Sub redelivers it at once."""


class Settlement:
    """The received messages of one subscription not yet acked or nacked, and their acks and nacks."""

    def __init__(
        self,
        name: str,
        counters: IngestCounters,
        dead_letters: DeadLetterPublisher,
        *,
        backoff_seconds: Callable[[int], float],
        backoff_maximum_seconds: float,
    ) -> None:
        self._name = name
        self._counters = counters
        self._dead_letters = dead_letters
        self._backoff_seconds = backoff_seconds
        self._backoff_maximum_seconds = backoff_maximum_seconds
        self._unsettled: dict[str, PulledMessage] = {}
        """ack_id -> message received and neither acked nor nacked yet: what stop() gives back."""
        self._nack_timers: dict[str, asyncio.TimerHandle] = {}
        self._fast: dict[int, PulledMessage] = {}
        """Fast-path messages (``runtime.take_fast``) by ``id`` of the engine's message: their Pub/Sub
        ack waits for ``runtime.on_volatile_settled``."""

    @property
    def held(self) -> int:
        """Messages received and not yet acked or nacked."""
        return len(self._unsettled)

    @property
    def fast_path(self) -> int:
        """Fast-path messages whose Pub/Sub ack waits for the runtime (``on_volatile_settled``)."""
        return len(self._fast)

    @property
    def nack_scheduled(self) -> int:
        """Messages with a nack scheduled (``nack_later``)."""
        return len(self._nack_timers)

    def receive(self, message: PulledMessage) -> None:
        """``message`` was handed to ingest: held until acked or nacked."""
        self._unsettled[message.ack_id] = message

    def await_volatile(self, taken: Message, message: PulledMessage) -> None:
        """``message`` took the fast path as ``taken``: its ack waits for ``on_volatile_settled``."""
        self._fast[id(taken)] = message

    def on_volatile_settled(self, message: Message, safe: bool) -> None:
        """The runtime settled a fast-path message: safe (ack durable, or dead letter recorded): ack it;
        given up (shard lost or dropped): nack it, so that Pub/Sub delivers it again."""
        pubsub = self._fast.pop(id(message), None)
        if pubsub is None or pubsub.ack_id not in self._unsettled:
            return  # stop() gave it back already
        if safe:
            self.ack(pubsub)
        else:
            self.nack(pubsub)

    def ack(self, message: PulledMessage) -> None:
        if self._unsettled.pop(message.ack_id, None) is None:
            return
        message.ack()
        if not is_forwarded(message):
            self._counters.acked += 1

    def nack(self, message: PulledMessage) -> None:
        self._nack_timers.pop(message.ack_id, None)
        if self._unsettled.pop(message.ack_id, None) is None:
            return
        message.nack()
        if not is_forwarded(message):
            self._counters.nacked += 1

    def nack_later(self, message: PulledMessage, delay_seconds: float) -> None:
        """Keep ``message`` leased for ``delay_seconds``, then nack it (a backoff before redelivery)."""
        loop = asyncio.get_running_loop()
        self._nack_timers[message.ack_id] = loop.call_later(delay_seconds, self.nack, message)

    def nack_all(self) -> int:
        """Nack everything held at once (through the client); returns how many."""
        self._cancel_timers()
        messages = list(self._unsettled.values())
        for message in messages:
            self.nack(message)
        return len(messages)

    async def give_back(self, nack_ids: Callable[[list[str]], Awaitable[None]] | None) -> None:
        """Nack everything still held, with our own ModifyAckDeadline calls (``nack_ids``: the
        intake's; None without a client), once the stream is closed.

        Not ``message.nack()``: after the stream closed the client's dispatcher is gone and would drop
        them, and before it closed Pub/Sub would send them straight back to this stream.
        """
        self._cancel_timers()
        for forwarded in [m for m in self._unsettled.values() if is_forwarded(m)]:
            self.nack(forwarded)  # answers the pod that forwarded it: no Pub/Sub ack id of ours
        ack_ids = list(self._unsettled)
        self._unsettled.clear()
        if not ack_ids or nack_ids is None:
            return
        for start in range(0, len(ack_ids), _MAX_IDS_PER_MODACK):
            chunk = ack_ids[start : start + _MAX_IDS_PER_MODACK]
            try:
                await nack_ids(chunk)
            except api_exceptions.GoogleAPICallError as exc:
                # No loss: their leases run out and Pub/Sub redelivers them a little later.
                _LOGGER.warning("ingest of %s: giving back %d messages failed: %s", self._name, len(chunk), exc)
                continue
            self._counters.nacked += len(chunk)
        _LOGGER.info("ingest of %s: %d unpersisted messages given back to Pub/Sub", self._name, len(ack_ids))

    async def dead_letter_then_ack(self, message: PulledMessage, reason: str, *, key: str) -> None:
        """Publish to the dead-letter topic until it takes the message, then ack (never before)."""
        if self._dead_letters.topic_for(self._name) is None:
            _LOGGER.error(
                "ingest of %s: message %s needs dead-lettering (%s) but the subscription has no "
                "dead_letter_topic; leaving it in Pub/Sub",
                self._name,
                message.message_id,
                reason,
            )
            self._counters.dead_letter_failures += 1
            self.nack_later(message, self._backoff_maximum_seconds)
            return
        attempt = 0
        while True:
            try:
                await self._dead_letters.publish_raw(
                    self._name,
                    data=message.data,
                    attributes=dict(message.attributes),
                    reason=reason,
                    message_id=message.message_id,
                    key=key,
                    ordering_key=message.ordering_key,
                )
                break
            except Exception as exc:
                self._counters.dead_letter_failures += 1
                _LOGGER.warning(
                    "ingest of %s: dead-letter publish of %s failed (attempt %d): %s; retrying",
                    self._name,
                    message.message_id,
                    attempt + 1,
                    exc,
                )
            await asyncio.sleep(self._backoff_seconds(attempt))
            attempt += 1
        self._counters.dead_lettered += 1
        self.ack(message)

    def _cancel_timers(self) -> None:
        for handle in self._nack_timers.values():
            handle.cancel()
        self._nack_timers.clear()
