"""Dead-letter publishing: a message the sidecar gives up on goes to its subscription's dead-letter topic.

Rules:

- The published message carries the original ``data`` and ``attributes`` unchanged, plus
  ``sidecar_reason``, ``sidecar_subscription``, ``sidecar_key``, ``sidecar_delivery_attempts`` and
  ``sidecar_message_id`` (the original Pub/Sub message id: the dead letter gets a new one), and
  ``sidecar_ordering_key`` when the original had one (this publisher does not enable ordering, so the
  ordering key travels as an attribute), and the message's position in its key's order when it has
  one: ``sidecar_sequence`` (sequence mode) or ``sidecar_timestamp_ms`` (watermark mode), which
  ``pubsub-sidecar dead-letters list`` shows without knowing the sidecar's config, and
  ``sidecar_subscription_path`` (the Pub/Sub subscription it came from) so that ``dead-letters
  replay`` finds the topic to send it back to. A sidecar attribute replaces an original one of the
  same name.
- ``publish`` returns only once Pub/Sub accepted the message and raises ``DeadLetterPublishError``
  otherwise. There is exactly one retry layer and it is the caller's (runtime and ingest retry with
  backoff and keep the message un-acked meanwhile): the client's own retries are switched off, so an
  outage shows up in the callers' counters and logs within seconds instead of after the client's
  10-minute default.
- The event loop never blocks: ``PublisherClient.publish`` only queues, and its future is awaited
  through ``asyncio.wrap_future``.
- Payloads never appear in logs; only ids, sizes and reasons do.
- This module and ``sidecar.pipeline.ingest_pull`` (the subscriber) are the only ones that import Pub/Sub
  (STYLE).

Pub/Sub caps an attribute value at 1024 bytes: ``sidecar_key`` and ``sidecar_reason`` are cut to fit
(a key may be 2 KB of text). ``PublisherClient.publish`` takes attributes as keyword arguments, so an
original attribute named like one of its parameters (``topic``, ``data``, ``ordering_key``, ``retry``,
``timeout``) cannot go that way: such a message is published with the client's unary ``Publish`` RPC in
an executor thread instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1
from google.pubsub_v1 import PublisherClient as GapicPublisherClient
from google.pubsub_v1 import PubsubMessage

from sidecar.engine.types import Message

_LOGGER = logging.getLogger(__name__)

_MAX_ATTRIBUTE_VALUE_BYTES = 1024
"""Pub/Sub's limit on one attribute value; a longer one fails the whole publish, for ever."""

_PUBLISH_TIMEOUT_SECONDS = 30.0
"""Deadline of one Publish RPC: long enough for a slow backend, short enough that a hung call is
retried by the caller well within an ack deadline extension."""

_CLOSE_TIMEOUT_SECONDS = 10.0
"""How long ``aclose`` waits for publishes still in flight before closing the channel."""

_PUBLISH_KWARGS = frozenset({"topic", "data", "ordering_key", "retry", "timeout"})
"""Parameter names of ``PublisherClient.publish``: attributes with these names would collide."""


class DeadLetterError(Exception):
    """Base of this module's errors."""


class DeadLetterPublishError(DeadLetterError):
    """The dead-letter topic did not take the message (transient or not); the caller retries."""


class NoDeadLetterTopic(DeadLetterError):
    """The subscription has no ``dead_letter_topic`` configured, so there is nowhere to publish."""


def _cut_utf8(text: str, max_bytes: int) -> str:
    """``text`` shortened to at most ``max_bytes`` of UTF-8, never splitting a character."""
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    return encoded[:max_bytes].decode("utf-8", errors="ignore")


def dead_letter_attributes(
    attributes: Mapping[str, str],
    *,
    subscription: str,
    reason: str,
    key: str,
    attempts: int,
    message_id: str,
    ordering_key: str = "",
    sequence: int | None = None,
    timestamp_ms: int | None = None,
    subscription_path: str = "",
) -> dict[str, str]:
    """The attributes of a dead letter: the original ones plus the sidecar's (which win on a clash)."""
    result = dict(attributes)
    result["sidecar_reason"] = _cut_utf8(reason, _MAX_ATTRIBUTE_VALUE_BYTES)
    result["sidecar_subscription"] = _cut_utf8(subscription, _MAX_ATTRIBUTE_VALUE_BYTES)
    result["sidecar_key"] = _cut_utf8(key, _MAX_ATTRIBUTE_VALUE_BYTES)
    result["sidecar_delivery_attempts"] = str(attempts)
    result["sidecar_message_id"] = _cut_utf8(message_id, _MAX_ATTRIBUTE_VALUE_BYTES)
    if ordering_key:
        result["sidecar_ordering_key"] = _cut_utf8(ordering_key, _MAX_ATTRIBUTE_VALUE_BYTES)
    if sequence is not None:
        result["sidecar_sequence"] = str(sequence)
    if timestamp_ms is not None:
        result["sidecar_timestamp_ms"] = str(timestamp_ms)
    if subscription_path:
        result["sidecar_subscription_path"] = _cut_utf8(subscription_path, _MAX_ATTRIBUTE_VALUE_BYTES)
    return result


class DeadLetterPublisher:
    """Publishes to each subscription's dead-letter topic; satisfies ``runtime.DeadLetterSink``.

    ``topics`` maps a subscription's config ``name`` to its ``dead_letter_topic`` (None or absent:
    none configured), ``subscription_paths`` to its Pub/Sub subscription. The client is made here
    unless one is passed in; it honours ``PUBSUB_EMULATOR_HOST`` as read at construction.
    """

    def __init__(
        self,
        topics: Mapping[str, str | None],
        *,
        client: pubsub_v1.PublisherClient | None = None,
        publish_timeout_seconds: float = _PUBLISH_TIMEOUT_SECONDS,
        subscription_paths: Mapping[str, str] | None = None,
    ) -> None:
        self._topics = dict(topics)
        self._paths = dict(subscription_paths or {})
        self._owns_client = client is None
        self._client = client if client is not None else pubsub_v1.PublisherClient()
        self._timeout_seconds = publish_timeout_seconds
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._closed = False
        self.published = 0
        """Dead letters Pub/Sub accepted (cumulative)."""
        self.failures = 0
        """Publish attempts that failed (cumulative; each is retried by the caller)."""

    def topic_for(self, subscription: str) -> str | None:
        return self._topics.get(subscription)

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        """Dead-letter a message the store holds (from the engine). Raises ``DeadLetterError``."""
        payload = message.payload
        if payload is None:
            # A stored message always has its payload; publishing an empty one would lose the data.
            raise DeadLetterPublishError(
                f"subscription {subscription!r}: message {message.message_id!r} has no payload to dead-letter"
            )
        await self._publish(
            subscription,
            payload.data,
            dead_letter_attributes(
                payload.attributes,
                subscription=subscription,
                reason=reason,
                key=message.key,
                attempts=attempts,
                message_id=message.message_id,
                ordering_key=payload.ordering_key,
                sequence=message.sequence,
                timestamp_ms=message.timestamp_ms,
                subscription_path=self._paths.get(subscription, ""),
            ),
            message.message_id,
        )

    async def publish_raw(
        self,
        subscription: str,
        *,
        data: bytes,
        attributes: Mapping[str, str],
        reason: str,
        message_id: str,
        key: str = "",
        ordering_key: str = "",
        attempts: int = 0,
    ) -> None:
        """Dead-letter a Pub/Sub message that never became an engine message (malformed, conflict).

        ``key`` is empty when the message had none that could be read. Raises ``DeadLetterError``.
        """
        await self._publish(
            subscription,
            data,
            dead_letter_attributes(
                attributes,
                subscription=subscription,
                reason=reason,
                key=key,
                attempts=attempts,
                message_id=message_id,
                ordering_key=ordering_key,
                subscription_path=self._paths.get(subscription, ""),
            ),
            message_id,
        )

    async def aclose(self) -> None:
        """Flush and stop the client, wait briefly for publishes in flight, close the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            self._client.stop()  # sends what is batched; publish() raises from now on
        except Exception as exc:
            errors.append(exc)
        if self._in_flight:
            _done, pending = await asyncio.wait(set(self._in_flight), timeout=_CLOSE_TIMEOUT_SECONDS)
            if pending:
                _LOGGER.warning("%d dead-letter publishes still in flight at close", len(pending))
        if self._owns_client:
            try:
                self._client.transport.close()  # type: ignore[no-untyped-call]  # the client's own, unannotated
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise DeadLetterError(f"closing the dead-letter publisher: {errors!r}") from errors[0]

    # ---- internals -------------------------------------------------------------------------

    async def _publish(self, subscription: str, data: bytes, attributes: dict[str, str], message_id: str) -> None:
        topic = self._topics.get(subscription)
        if not topic:
            self.failures += 1
            raise NoDeadLetterTopic(f"subscription {subscription!r} has no dead_letter_topic configured")
        if self._closed:
            self.failures += 1
            raise DeadLetterPublishError(f"dead-letter publisher is closed (subscription {subscription!r})")
        try:
            future = self._start_publish(topic, data, attributes)
            self._in_flight.add(future)
            try:
                await asyncio.shield(future)
            finally:
                if future.done():
                    self._in_flight.discard(future)
                else:
                    future.add_done_callback(self._in_flight.discard)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            raise DeadLetterPublishError(
                f"subscription {subscription!r}: publishing message {message_id!r} ({len(data)} bytes) "
                f"to {topic} failed: {_describe(exc)}"
            ) from exc
        self.published += 1
        reason = attributes["sidecar_reason"]
        # A malformed message is the publisher's mistake, for someone to fix: a warning, not news.
        _LOGGER.log(
            logging.WARNING if reason.startswith("malformed") else logging.INFO,
            "subscription %s: message %s dead-lettered to %s (reason: %s)",
            subscription,
            message_id,
            topic,
            reason,
        )

    def _start_publish(self, topic: str, data: bytes, attributes: dict[str, str]) -> asyncio.Future[Any]:
        if _PUBLISH_KWARGS.isdisjoint(attributes):
            # retry=None: the caller is the retry layer (module docstring).
            concurrent_future = self._client.publish(
                topic, data, retry=None, timeout=self._timeout_seconds, **attributes
            )
            return asyncio.wrap_future(concurrent_future)
        call = functools.partial(
            GapicPublisherClient.publish,
            self._client,
            topic=topic,
            messages=[PubsubMessage(data=data, attributes=attributes)],
            retry=None,
            timeout=self._timeout_seconds,
        )
        return asyncio.get_running_loop().run_in_executor(None, call)


def _describe(exc: BaseException) -> str:
    """A short, payload-free description of a publish failure."""
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return f"{exc.__class__.__name__} {exc.code}: {exc.message}"
    return f"{exc.__class__.__name__}: {exc}"
