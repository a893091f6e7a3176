"""The delivery layer's errors and their gRPC status codes: the one mapping from domain errors to codes.

Rules:

- Every method of the servicer ends a failed call through ``abort``, which takes the code and the
  details from ``status_for``: no other module picks a status code for an error.
- A mapped error (``BadRequest``: INVALID_ARGUMENT; ``UnknownSubscription``, ``UnknownRelay``: NOT_FOUND;
  ``SubscriptionUnavailable``: UNAVAILABLE; ``KeyNotBlocked``, ``KeyNotWaitingOnGap``, ``NotOwner``:
  FAILED_PRECONDITION; ``SkipOutOfRange``: INVALID_ARGUMENT) is
  logged at INFO without a traceback. Anything else is a bug of ours: INTERNAL, logged at ERROR with
  its traceback, and only the exception's type name reaches the client.
- A ``StoreError`` answers UNAVAILABLE "it may have applied": the store did not confirm the write;
  the client retries.
- Client input quoted in a message is cut to ``_MAX_ECHO_CHARS`` (``quote``): the message travels in a
  header, and an oversized header would reach the client as another code.
- An ``Undecodable`` request (``sidecar.delivery.handlers``) is a ``BadRequest`` (``decoded``).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import grpc

from pubsub_sidecar.v1 import sidecar_pb2
from sidecar.delivery.handlers import Undecodable
from sidecar.engine.dead_letters import KeyNotBlocked
from sidecar.engine.gap_skip import KeyNotWaitingOnGap, SkipOutOfRange
from sidecar.pipeline.runtime_context import NotOwner, SubscriptionUnavailable
from sidecar.store.api import StoreError

_LOGGER = logging.getLogger(__name__)

_M = TypeVar(
    "_M",
    sidecar_pb2.SubscribeRequest,
    sidecar_pb2.GetStatusRequest,
    sidecar_pb2.UnblockKeyRequest,
    sidecar_pb2.SkipGapRequest,
    sidecar_pb2.PublishRequest,
)

_MAX_ECHO_CHARS = 100
"""Client input quoted in an error message is cut to this. The message travels in a header, and
clients refuse headers above 8-16 KiB: a 1 MB subscription name echoed whole would reach the
client as RESOURCE_EXHAUSTED instead of NOT_FOUND."""


class BadRequest(ValueError):
    """The client sent something it must not: INVALID_ARGUMENT, the stream ends."""


class UnknownSubscription(LookupError):
    """No subscription by that name in the config: NOT_FOUND."""


class UnknownRelay(LookupError):
    """No relay by that name in the config (``Publish``): NOT_FOUND."""


def quote(value: str) -> str:
    """``repr(value)``, cut short with its full size when longer than ``_MAX_ECHO_CHARS``."""
    if len(value) <= _MAX_ECHO_CHARS:
        return repr(value)
    return f"{value[:_MAX_ECHO_CHARS]!r}... ({len(value.encode())} bytes)"


def decoded(request: _M | Undecodable) -> _M:
    """The request, or ``BadRequest`` when its bytes were not a valid message."""
    if isinstance(request, Undecodable):
        raise BadRequest(request.describe())
    return request


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from our errors to gRPC status codes and messages."""
    if isinstance(exc, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, UnknownSubscription):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "unknown subscription"
    if isinstance(exc, UnknownRelay):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "unknown relay"
    if isinstance(exc, SubscriptionUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, KeyNotBlocked):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]) if exc.args else "key is not blocked"
    if isinstance(exc, KeyNotWaitingOnGap):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]) if exc.args else "key does not wait on a gap"
    if isinstance(exc, SkipOutOfRange):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc.args[0]) if exc.args else "through is out of range"
    if isinstance(exc, NotOwner):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]) if exc.args else "key owned by another pod"
    if isinstance(exc, StoreError):
        return grpc.StatusCode.UNAVAILABLE, f"the store did not confirm it (it may have applied): retry: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with ``exc``'s status code (raises, as ``context.abort`` does)."""
    code, details = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        _LOGGER.error("request failed: %s", details, exc_info=exc)
    else:
        _LOGGER.info("request ended with %s: %s", code.name, details)
    await context.abort(code, details)
