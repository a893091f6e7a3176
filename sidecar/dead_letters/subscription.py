"""Pub/Sub access of the dead-letter tooling (``pubsub-sidecar dead-letters``): read without acking, ack, release.

This is the third module that imports google-cloud-pubsub, beside ``sidecar.pipeline.ingest_pull`` (the
sidecar's subscriber) and ``sidecar.dead_letters.publisher`` (its publisher): the tool is a separate, synchronous
command that pulls from a dead-letter subscription with the unary Pull RPC, which neither of those
does, and keeping its calls here keeps ``sidecar.commands.dead_letters`` and ``sidecar.dead_letters.view``
free of any Google library (STYLE: one module per Google library and job).

Rules:

- **Nothing is acked by reading.** ``scan`` pulls every message available and holds their leases
  (extended to the lease, 120 s by default, and renewed while the scan lasts) so that one scan sees each
  message once; ``release`` gives the ones not acted on back at once (a modack to 0 seconds, which
  is Pub/Sub's nack). If the command dies, the leases lapse and the messages come back by themselves.
- A dead letter leaves the subscription only through ``ack``, called by the command once what it
  decided (discard, or a replay made durable) is done.
- A replay is published with the unary Publish RPC (``ReplayPublisher``), which answers only once
  Pub/Sub has stored the messages: that answer is what makes acking the dead letters safe.
- Errors are classified here, once: a subscription that does not exist is ``SubscriptionNotFound``
  (the command exits 2), a malformed name ``BadSubscriptionName`` (exit 2), a replay's source
  subscription or topic that is gone ``ReplayTargetNotFound`` (exit 2), anything else from Pub/Sub
  ``DeadLetterToolError`` (exit 1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1
from google.pubsub_v1 import PublisherClient as GapicPublisherClient
from google.pubsub_v1 import PubsubMessage

from sidecar.dead_letters.view import WaitingLetter

_LOGGER = logging.getLogger(__name__)

_SCAN_LEASE_SECONDS = 120
"""Lease held on scanned messages: long enough for a scan and an operator's replay or discard of
thousands of messages, short enough that a killed command's messages come back within minutes."""

_PULL_BATCH = 500
"""Messages asked for per Pull: fewer round trips; Pub/Sub answers with at most 1,000."""

_PULL_TIMEOUT_SECONDS = 10.0
"""Deadline of one Pull: an empty subscription answers empty well within it (the emulator in 1 s)."""

_RPC_TIMEOUT_SECONDS = 30.0
"""Deadline of the other unary calls (GetSubscription, Acknowledge, ModifyAckDeadline)."""

_ACK_IDS_PER_CALL = 500
"""Ack ids per Acknowledge/ModifyAckDeadline call, well under Pub/Sub's 512 KB request limit."""


class DeadLetterToolError(Exception):
    """Pub/Sub refused or failed a call of the tool (one line, for the operator)."""


class SubscriptionNotFound(DeadLetterToolError):
    """The dead-letter subscription does not exist."""


class BadSubscriptionName(DeadLetterToolError):
    """Pub/Sub refused the subscription's name."""


class ReplayTargetNotFound(DeadLetterToolError):
    """The subscription a dead letter came from, or the topic to replay it to, does not exist."""


_DELETED_TOPIC = "_deleted-topic_"
"""What Pub/Sub reports as the topic of a subscription whose topic was deleted."""


class DeadLetterSubscription:
    """A dead-letter subscription read with unary Pull; the messages leased are remembered until released."""

    def __init__(
        self, path: str, client: pubsub_v1.SubscriberClient | None = None, *, lease_seconds: int = _SCAN_LEASE_SECONDS
    ) -> None:
        self.path = path
        self._lease_seconds = lease_seconds
        self._owns_client = client is None
        self._client = client if client is not None else pubsub_v1.SubscriberClient()
        self._held: dict[str, WaitingLetter] = {}
        """By the dead letter's message id: a message whose lease lapsed mid-scan comes back with a new
        ack id and replaces its entry (only the newest ack id is valid)."""

    def check(self) -> None:
        """Raise ``SubscriptionNotFound`` unless the subscription exists (before touching any message)."""
        self._call("GetSubscription", self._client.get_subscription, request={"subscription": self.path})

    def scan(self, max_messages: int) -> tuple[list[WaitingLetter], bool]:
        """Every available message up to ``max_messages``, leased; and whether the cap cut the scan."""
        renewed_at = time.monotonic()
        while len(self._held) < max_messages:
            wanted = min(_PULL_BATCH, max_messages - len(self._held))
            try:
                response = self._client.pull(
                    request={"subscription": self.path, "max_messages": wanted},
                    retry=None,
                    timeout=_PULL_TIMEOUT_SECONDS,
                )
            except api_exceptions.DeadlineExceeded:
                break  # nothing arrived within the deadline: the subscription is drained
            except api_exceptions.GoogleAPICallError as exc:
                raise _classify("Pull", self.path, exc) from exc
            if not response.received_messages:
                break
            fresh = [self._letter(received) for received in response.received_messages]
            self._held.update((letter.dead_letter_id, letter) for letter in fresh)
            self._modack([letter.ack_id for letter in fresh], self._lease_seconds)
            if time.monotonic() - renewed_at > self._lease_seconds / 2:
                # A long scan keeps its first messages.
                self._modack([letter.ack_id for letter in self._held.values()], self._lease_seconds)
                renewed_at = time.monotonic()
        return list(self._held.values()), len(self._held) >= max_messages

    def topic_of(self, subscription: str) -> str:
        """The topic ``subscription`` (another one: a replay's source) is attached to."""
        try:
            found = self._client.get_subscription(request={"subscription": subscription}, timeout=_RPC_TIMEOUT_SECONDS)
        except api_exceptions.NotFound as exc:
            raise ReplayTargetNotFound(
                f"subscription {subscription}, which dead letters came from, does not exist: pass --topic"
            ) from exc
        except api_exceptions.GoogleAPICallError as exc:
            raise _classify("GetSubscription", subscription, exc) from exc
        if not found.topic or found.topic == _DELETED_TOPIC:
            raise ReplayTargetNotFound(f"the topic of subscription {subscription} was deleted: pass --topic")
        return str(found.topic)

    def renew(self, letters: Sequence[WaitingLetter]) -> None:
        """Extend the leases of ``letters`` (before a step that may take a while)."""
        self._modack([letter.ack_id for letter in letters], self._lease_seconds)

    def ack(self, letters: Sequence[WaitingLetter]) -> None:
        """Remove ``letters`` from the subscription for good."""
        ack_ids = [letter.ack_id for letter in letters]
        for chunk in _chunks(ack_ids):
            self._call("Acknowledge", self._client.acknowledge, request={"subscription": self.path, "ack_ids": chunk})
        for letter in letters:
            self._held.pop(letter.dead_letter_id, None)

    def release(self) -> None:
        """Give every message still held back to the subscription at once (best effort: leases lapse anyway)."""
        held, self._held = [letter.ack_id for letter in self._held.values()], {}
        try:
            self._modack(held, 0)
        except DeadLetterToolError as exc:
            _LOGGER.warning("could not release %d dead letters (they come back when their lease lapses): %s",
                            len(held), exc)  # fmt: skip

    def close(self) -> None:
        try:
            self.release()
        finally:
            if self._owns_client:
                self._client.close()

    # ---- internals -------------------------------------------------------------------------

    def _modack(self, ack_ids: list[str], seconds: int) -> None:
        for chunk in _chunks(ack_ids):
            self._call(
                "ModifyAckDeadline",
                self._client.modify_ack_deadline,
                request={"subscription": self.path, "ack_ids": chunk, "ack_deadline_seconds": seconds},
            )

    def _call(self, rpc: str, method: Any, **kwargs: Any) -> Any:
        try:
            return method(timeout=_RPC_TIMEOUT_SECONDS, **kwargs)
        except api_exceptions.GoogleAPICallError as exc:
            raise _classify(rpc, self.path, exc) from exc

    @staticmethod
    def _letter(received: Any) -> WaitingLetter:
        message = received.message
        return WaitingLetter.from_pubsub(
            received.ack_id, message.message_id, message.publish_time, message.data, message.attributes
        )


class ReplayPublisher:
    """Publishes replays with the unary Publish RPC: it returns once Pub/Sub stored them."""

    def __init__(self, client: pubsub_v1.PublisherClient | None = None) -> None:
        self._owns_client = client is None
        self._client = client if client is not None else pubsub_v1.PublisherClient()

    def publish(self, topic: str, messages: Sequence[tuple[bytes, dict[str, str], str]]) -> list[str]:
        """Publish ``(data, attributes, ordering_key)`` messages to ``topic``; their new message ids.

        Pub/Sub's own retry policy for Publish applies (transient errors are retried within the
        deadline): a replay that then still fails leaves its dead letters un-acked."""
        request = [PubsubMessage(data=data, attributes=attrs, ordering_key=key) for data, attrs, key in messages]
        try:
            response = GapicPublisherClient.publish(
                self._client, topic=topic, messages=request, timeout=_RPC_TIMEOUT_SECONDS
            )
        except api_exceptions.NotFound as exc:
            raise ReplayTargetNotFound(f"topic {topic} does not exist") from exc
        except api_exceptions.GoogleAPICallError as exc:
            raise _classify("Publish", topic, exc) from exc
        return list(response.message_ids)

    def close(self) -> None:
        if self._owns_client:
            self._client.stop()
            self._client.transport.close()  # type: ignore[no-untyped-call]  # the client's own, unannotated


def _chunks(items: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(items), _ACK_IDS_PER_CALL):
        yield items[start : start + _ACK_IDS_PER_CALL]


def _classify(rpc: str, path: str, exc: api_exceptions.GoogleAPICallError) -> DeadLetterToolError:
    if isinstance(exc, api_exceptions.NotFound):
        return SubscriptionNotFound(f"dead-letter subscription {path} does not exist")
    if isinstance(exc, api_exceptions.InvalidArgument) and rpc == "GetSubscription":
        return BadSubscriptionName(f"{rpc} refused {path}: {exc.message}")
    return DeadLetterToolError(f"{rpc} on {path} failed: {exc.__class__.__name__} {exc.code}: {exc.message}")
