"""The client's errors, and which gRPC status codes a new stream can cure.

Classified once, here: the subscriber retries what ``is_transient`` accepts and turns everything
else into ``SubscriptionError``, whose message is one line an app can print as it is.
"""

from __future__ import annotations

import grpc

_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # sidecar down, restarting, or a subscription still recovering
        grpc.StatusCode.CANCELLED,  # the server cancelled the stream, e.g. while shutting down
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
"""Codes a new stream can cure. Everything else (INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED,
PERMISSION_DENIED, ...) is a mistake in the app or the config: retrying would loop forever."""


def is_transient(code: grpc.StatusCode) -> bool:
    """True when reconnecting may cure an error with this status code."""
    return code in _TRANSIENT_CODES


def one_line(text: str) -> str:
    """``text`` with its whitespace runs (newlines included) collapsed: error lines stay one line."""
    return " ".join(text.split())


class ClientError(Exception):
    """Base class of this package's errors."""


class SubscriptionError(ClientError):
    """The sidecar refused the stream with an error that reconnecting cannot fix.

    ``str(error)`` is one line naming the subscription, the target, the code and the sidecar's
    reason, e.g. ``sidecar at unix:///run/sidecar.sock refused subscription 'orders': NOT_FOUND: ...``.
    """

    def __init__(self, subscription: str, code: grpc.StatusCode, details: str, target: str = "") -> None:
        where = f"sidecar at {target}" if target else "sidecar"
        super().__init__(f"{where} refused subscription {subscription!r}: {code.name}: {one_line(details)}")
        self.subscription = subscription
        self.target = target
        self.code = code
        self.details = details


class NotConfirmed(ClientError):
    """An ack will not be confirmed: the message was nacked, or its stream ended first.

    The sidecar redelivers such a message (with a higher ``delivery_attempt``).
    """
