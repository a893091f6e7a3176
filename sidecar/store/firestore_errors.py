"""Errors of Google's libraries as the store's, once: which are retried, and what each becomes.

``sidecar.store.firestore`` catches ``CALL_ERRORS`` around every RPC and raises ``translate``'s
answer. This module imports grpc, google-api-core and google-auth, never google-cloud-firestore.

Rules:

- ``RETRYABLE`` -> ``documents.Unavailable`` (for a write: it may have applied); ``INPUT_ERRORS``
  -> ``documents.RequestRejected``; ALREADY_EXISTS -> ``documents.AlreadyExists``; anything else
  (permission, missing database or index) -> ``documents.Misconfigured``. FAILED_PRECONDITION from
  a Commit (an ``update_time`` precondition) is told apart by the caller, which knows the RPC:
  ``documents.PreconditionFailed``.
- **Reads are retried briefly** (``READ_RETRY``: idempotent, a short retry absorbs blips). Writes
  are not retried here: the callers retry with their own backoff, and an ambiguous create is
  resolved by reading it back. A fenced commit's idempotent steps retry ``BLIPS`` themselves.
- **A Listen stream that fails is resumed** unless ``listen_failure`` says the failure is one a
  reconnect does not cure (``LISTEN_PERMANENT``, or credentials): that one ends the listen.
"""

from __future__ import annotations

import grpc
from google.api_core import exceptions as core_exceptions
from google.api_core import retry_async
from google.auth import exceptions as auth_exceptions

from sidecar.store import documents as docs
from sidecar.store.api import StoreError

RETRYABLE: tuple[type[BaseException], ...] = (
    core_exceptions.ServiceUnavailable,
    core_exceptions.DeadlineExceeded,
    core_exceptions.Aborted,
    core_exceptions.InternalServerError,
    core_exceptions.Unknown,
    core_exceptions.ResourceExhausted,
    core_exceptions.Cancelled,
    core_exceptions.RetryError,
    auth_exceptions.TransportError,
    grpc.aio.AioRpcError,
    TimeoutError,
    ConnectionError,
)
INPUT_ERRORS: tuple[type[BaseException], ...] = (core_exceptions.InvalidArgument, core_exceptions.OutOfRange)
TERMINAL: tuple[type[BaseException], ...] = (core_exceptions.GoogleAPICallError, auth_exceptions.GoogleAuthError)
CALL_ERRORS: tuple[type[BaseException], ...] = (*RETRYABLE, *TERMINAL)
"""What an RPC may raise that ``translate`` maps."""

READ_RETRY = retry_async.AsyncRetry(
    initial=0.05,
    maximum=1.0,
    multiplier=2.0,
    timeout=10.0,
    predicate=retry_async.if_exception_type(
        core_exceptions.ServiceUnavailable,
        core_exceptions.DeadlineExceeded,
        core_exceptions.InternalServerError,
        core_exceptions.Aborted,
    ),
)
"""Reads are idempotent: a short retry absorbs blips. Writes are not retried here (the callers
retry with their own backoff, and an ambiguous create is resolved by reading it back)."""

BLIPS: tuple[type[BaseException], ...] = (
    core_exceptions.ServiceUnavailable,
    core_exceptions.DeadlineExceeded,
    core_exceptions.InternalServerError,
)
"""What a fenced commit's idempotent steps (its Begin, its read of the fences) try again at once."""

LISTEN_PERMANENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Listen failures that a reconnect does not cure: reported through ``on_error``."""


def translate(exc: BaseException, what: str) -> StoreError:
    if isinstance(exc, core_exceptions.AlreadyExists):
        return docs.AlreadyExists(f"{what}: {exc}")
    if isinstance(exc, INPUT_ERRORS):
        return docs.RequestRejected(f"{what}: Firestore refused the request: {exc}")
    if isinstance(exc, RETRYABLE):
        return docs.Unavailable(f"{what}: Firestore unavailable: {exc}")
    return docs.Misconfigured(f"{what}: Firestore error (check permissions, database and indexes): {exc}")


def translate_grpc(exc: grpc.aio.AioRpcError, what: str) -> StoreError:
    """A raw gRPC error (a call made on the channel itself) as api_core's, then translated."""
    return translate(core_exceptions.from_grpc_error(exc), what)  # type: ignore[no-untyped-call]


def listen_failure(exc: BaseException) -> StoreError | None:
    """What ends a listen for good (``on_error``), or None when a reconnect may cure ``exc``."""
    code = exc.grpc_status_code if isinstance(exc, core_exceptions.GoogleAPICallError) else None
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
    if code in LISTEN_PERMANENT or isinstance(exc, auth_exceptions.GoogleAuthError):
        return translate(exc, "listen")
    return None
