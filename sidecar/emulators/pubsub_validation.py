"""What the Pub/Sub emulator checks in publishes, subscription configs and deadlines, as production does.

Every refusal is a :class:`PubsubError` (INVALID_ARGUMENT) with a message naming the field.
"""

from __future__ import annotations

from typing import Any

from google.pubsub_v1 import types

from sidecar.emulators.pubsub_model import MAX_ACK_DEADLINE_SECONDS, MIN_ACK_DEADLINE_SECONDS
from sidecar.emulators.pubsub_names import parse_topic
from sidecar.emulators.pubsub_replay import check_retention
from sidecar.emulators.pubsub_rpc import invalid

MAX_PUBLISH_REQUEST_BYTES = 10 * 1000 * 1000
"""Production refuses a Publish request (and so any message) above 10 MB."""
MAX_ATTRIBUTE_KEY_BYTES = 256
MAX_ATTRIBUTE_VALUE_BYTES = 1024
MAX_ORDERING_KEY_BYTES = 1024
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600
"""What production fills in for ``message_retention_duration`` when it is unset."""
DEFAULT_EXPIRATION_TTL_SECONDS = 31 * 24 * 3600
_SubscriptionState = types.Subscription.State


def validate_subscription(config: Any) -> None:
    """Check and fill in a subscription config as production does on create and update."""
    if config.ack_deadline_seconds == 0:
        config.ack_deadline_seconds = MIN_ACK_DEADLINE_SECONDS
    if not MIN_ACK_DEADLINE_SECONDS <= config.ack_deadline_seconds <= MAX_ACK_DEADLINE_SECONDS:
        raise invalid(
            f"ack_deadline_seconds must be between {MIN_ACK_DEADLINE_SECONDS} and {MAX_ACK_DEADLINE_SECONDS}"
            f" (got {config.ack_deadline_seconds})"
        )
    if config.HasField("dead_letter_policy") and config.dead_letter_policy.dead_letter_topic:
        policy = config.dead_letter_policy
        parse_topic(policy.dead_letter_topic)
        if policy.max_delivery_attempts == 0:
            policy.max_delivery_attempts = 5
        if not 5 <= policy.max_delivery_attempts <= 100:
            raise invalid(
                f"dead_letter_policy.max_delivery_attempts must be between 5 and 100 "
                f"(got {policy.max_delivery_attempts})"
            )
    if config.HasField("retry_policy"):
        low = config.retry_policy.minimum_backoff.ToTimedelta().total_seconds()
        high = config.retry_policy.maximum_backoff.ToTimedelta().total_seconds()
        if not 0 <= low <= 600 or not 0 <= high <= 600:
            raise invalid("retry_policy backoffs must be between 0 and 600 seconds")
    if config.message_retention_duration.seconds == 0 and config.message_retention_duration.nanos == 0:
        config.message_retention_duration.seconds = DEFAULT_RETENTION_SECONDS
    check_retention(config.message_retention_duration, "message_retention_duration")
    if not config.HasField("expiration_policy"):
        config.expiration_policy.ttl.seconds = DEFAULT_EXPIRATION_TTL_SECONDS
    config.state = _SubscriptionState.ACTIVE


CLIENT_ATTRIBUTE_PREFIX = "googclient_"
"""Pub/Sub reserves keys that start with ``goog`` except these, which Google's own client libraries set
(``googclient_traceparent`` with OpenTelemetry tracing on): the service accepts them."""


def validate_messages(request: Any) -> None:
    if not request.messages:
        raise invalid("Publish: the request contains no messages")
    size = request.ByteSize()
    if size > MAX_PUBLISH_REQUEST_BYTES:
        raise invalid(f"Publish: request size {size} bytes exceeds the limit of {MAX_PUBLISH_REQUEST_BYTES} bytes")
    for index, message in enumerate(request.messages):
        if not message.data and not message.attributes:
            raise invalid(f"Publish: message {index} contains neither data nor attributes")
        for key, value in message.attributes.items():
            if not key or len(key.encode()) > MAX_ATTRIBUTE_KEY_BYTES:
                raise invalid(f"Publish: message {index}: attribute key {key!r} must be 1-256 bytes")
            if key.startswith("goog") and not key.startswith(CLIENT_ATTRIBUTE_PREFIX):
                raise invalid(f"Publish: message {index}: attribute key {key!r} is reserved (starts with 'goog')")
            if len(value.encode()) > MAX_ATTRIBUTE_VALUE_BYTES:
                raise invalid(f"Publish: message {index}: attribute {key!r} value exceeds 1024 bytes")
        if len(message.ordering_key.encode()) > MAX_ORDERING_KEY_BYTES:
            raise invalid(f"Publish: message {index}: ordering_key exceeds 1024 bytes")


def check_modack_seconds(seconds: int) -> None:
    if not 0 <= seconds <= MAX_ACK_DEADLINE_SECONDS:
        raise invalid(f"ack_deadline_seconds must be between 0 and {MAX_ACK_DEADLINE_SECONDS} (got {seconds})")
