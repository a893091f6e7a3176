"""Helpers shared by the Pub/Sub emulator's gRPC handlers: error mapping, paging, field masks.

One place turns our errors into status codes: :class:`PubsubError` -> its code, :class:`InvalidName`
-> INVALID_ARGUMENT, anything unexpected -> INTERNAL (logged), never UNKNOWN, which the publisher
retries silently for ten minutes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import field_mask_pb2

from sidecar.emulators.pubsub_model import PubsubError
from sidecar.emulators.pubsub_names import InvalidName

_LOGGER = logging.getLogger(__name__)

MAX_PAGE_SIZE = 1000

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def invalid(message: str) -> PubsubError:
    return PubsubError(grpc.StatusCode.INVALID_ARGUMENT, message)


def guarded(handler: Handler) -> Handler:
    """Turn our errors into their status codes and anything unexpected into INTERNAL."""

    @functools.wraps(handler)
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(request, context)
        except PubsubError as exc:
            await context.abort(exc.code, exc.message)
        except InvalidName as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            _LOGGER.exception("pubsub emulator: unexpected error in %s", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"emulator error in {handler.__name__}")

    return call


def unary(fn: Handler, request: Any, response: Any) -> grpc.RpcMethodHandler:
    """A guarded unary handler on raw protobuf classes."""
    return grpc.unary_unary_rpc_method_handler(guarded(fn), request.FromString, response.SerializeToString)


def page(names: list[str], page_size: int, page_token: str) -> tuple[list[str], str]:
    """A page of sorted ``names`` after ``page_token`` (the last name of the previous page)."""
    if page_size < 0:
        raise invalid("page_size must not be negative")
    size = min(page_size or MAX_PAGE_SIZE, MAX_PAGE_SIZE)
    rest = [n for n in names if n > page_token] if page_token else names
    chosen = rest[:size]
    return chosen, (chosen[-1] if len(rest) > size else "")


def apply_mask(target: Any, update: Any, mask: Any, immutable: set[str]) -> None:
    """Copy the fields ``mask`` names from ``update`` into ``target``; unknown or immutable ones are refused."""
    if not mask.paths:
        raise invalid("update_mask must name at least one field")
    fields = {f.name for f in target.DESCRIPTOR.fields}
    for path in mask.paths:
        top = path.split(".", 1)[0]
        if top not in fields:
            raise invalid(f"update_mask: unknown field {path!r}")
        if top in immutable:
            raise invalid(f"update_mask: field {path!r} cannot be updated")
    field_mask_pb2.FieldMask(paths=list(mask.paths)).MergeMessage(
        update, target, replace_message_field=True, replace_repeated_field=True
    )


def duration_ns(duration: Any) -> int:
    return int(duration.seconds) * 1_000_000_000 + int(duration.nanos)
