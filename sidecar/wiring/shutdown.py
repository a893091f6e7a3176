"""The shutdown sequence: stop the servers and components in order within the grace period, then close clients.

Rules (STYLE: readiness off -> health NOT_SERVING -> stop pulling -> drain -> stop the server -> close
clients; ``sidecar.wiring.app`` turns /readyz off before it calls ``shutdown``):

- The order is the point: gRPC health NOT_SERVING -> per subscription, its watermark source, then
  ingest (persists in progress finish and their messages are acked to Pub/Sub; the rest is nacked)
  -> per subscription, drain its shards and hand every lease over at once (the other pods take them
  without waiting for the leases to expire), close its ownership and the Listen on its leases ->
  drain the app streams (what is left is given back: it is pending in Firestore and the shards' next
  owners deliver it) -> stop the runtimes (queued acks commit) -> stop HTTP. A loop of awaited steps,
  not ``gather``: no new messages before the streams drain, no closed client under a running component.
- Every step runs even when an earlier one failed: errors are collected and returned, not raised.
- Each step is bounded (``_STOP_STEP_TIMEOUT_SECONDS`` besides what it is given), so that a hung
  client cannot eat the pod's termination grace period; the stream drain leaves
  ``_AFTER_DRAIN_RESERVE_FRACTION`` of the grace period to the steps after it.
- Clients close after every component stopped, each within a bound (``close_quietly``): a failure
  is logged and the next client still closes.
- The components' long-running tasks are collected after (``collect``): cancelled if still running,
  every outcome retrieved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sidecar.delivery.server import GrpcServer
from sidecar.ops.observability import HttpEndpoint
from sidecar.wiring.subscription import SubscriptionParts

_LOGGER = logging.getLogger(__name__)

_STOP_STEP_TIMEOUT_SECONDS = 10.0
"""Bound on each shutdown step besides the stream drain, so that a hung client cannot eat the pod's
termination grace period."""

_AFTER_DRAIN_RESERVE_FRACTION = 0.2
"""Share of the grace period kept for the steps after the stream drain (ack commits, closing
clients): the drain may use the rest, and the whole shutdown still ends within the grace period."""


async def shutdown(
    subs: Mapping[str, SubscriptionParts],
    grpc_server: GrpcServer,
    http: HttpEndpoint,
    grace_seconds: float,
    stopped: list[str],
) -> list[tuple[str, BaseException]]:
    """Stop the servers and components (the clients close after); every step runs even when an
    earlier one failed; errors are collected, not raised.

    A loop of awaited steps rather than ``gather``: the order is the point (no new messages before
    the streams drain, no closed client under a running component).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_seconds
    reserve = grace_seconds * _AFTER_DRAIN_RESERVE_FRACTION
    errors: list[tuple[str, BaseException]] = []

    def left(keep: float = 0.0) -> float:
        return max(0.1, deadline - keep - loop.time())

    async def step(name: str, coro: Awaitable[object], limit_seconds: float = _STOP_STEP_TIMEOUT_SECONDS) -> None:
        try:
            await asyncio.wait_for(coro, limit_seconds)
            stopped.append(name)
        except Exception as exc:
            errors.append((name, exc))

    await step("health", grpc_server.enter_graceful_shutdown())
    for name, s in subs.items():
        if s.watermark is not None:
            await step(f"watermark:{name}", s.watermark.close())
        # Persists in progress finish (their messages are then acked to Pub/Sub); the rest is nacked.
        ingest_grace = min(5.0, left(reserve) / 2)
        await step(f"ingest:{name}", s.ingestor.stop(grace_seconds=ingest_grace), ingest_grace + 15.0)
    for name, s in subs.items():
        # Hand the shards over now, not after their leases expire: the other pods take them at once.
        if s.leases is not None and s.ownership is not None:
            drain = s.config.sharding.drain_timeout_ms / 1000
            await step(f"leases:{name}", s.leases.release_all(s.ownership.drain), drain + _STOP_STEP_TIMEOUT_SECONDS)
            await step(f"shards:{name}", s.ownership.close())
        if s.lease_listen is not None:
            await step(f"lease-listen:{name}", s.lease_listen.close())
    drain = left(reserve)
    await step("grpc", grpc_server.stop(drain), drain + _STOP_STEP_TIMEOUT_SECONDS)
    for name, s in subs.items():
        commit = min(5.0, left())
        await step(f"runtime:{name}", s.runtime.stop(grace_seconds=commit), commit + _STOP_STEP_TIMEOUT_SECONDS)
    await step("http", http.stop())
    return errors


async def close_quietly(name: str, close: Callable[[], Awaitable[object]]) -> None:
    """Close one client within a bound; a failure is logged, and the next client still closes."""
    try:
        await asyncio.wait_for(close(), _STOP_STEP_TIMEOUT_SECONDS)
    except Exception as exc:
        _LOGGER.error("closing the %s failed: %r", name, exc)


async def collect(watchers: dict[asyncio.Future[Any], str]) -> None:
    """After shutdown: the components' tasks have ended (stop() ends them); cancel any that did not,
    and retrieve every outcome so that none is reported as "never retrieved"."""
    for task in watchers:
        if not task.done():
            task.cancel()
    results = await asyncio.gather(*watchers, return_exceptions=True)
    for (_task, what), result in zip(watchers.items(), results, strict=True):
        if isinstance(result, Exception):
            _LOGGER.debug("%s ended with %r", what, result)
