"""The grpc.aio servicer of ``pubsub_sidecar.v1.OrderedDelivery``: Subscribe streams, GetStatus, UnblockKey,
SkipGap, Publish.

Rules:

- Each Subscribe stream is one engine consumer with its own id (``sidecar.delivery.streams``). Its
  first request must be ``open``; ``open.max_outstanding_messages`` is the stream's budget of messages
  sent and not yet acked or nacked (0 = ``default_max_outstanding``; above ``max_outstanding_limit``
  or negative is INVALID_ARGUMENT). A subscription that is not ready, or a sidecar that drains,
  refuses ``open`` with UNAVAILABLE.
- The stream's sender and reader (``sidecar.delivery.subscribe``) do the work: what is sent when, acks
  and their confirmations, how the stream ends.
- However a stream ends (client gone, cancel, deadline, error), ``consumer_closed`` runs in a
  ``finally`` so its in-flight messages are redelivered at once.
- GetStatus answers for one subscription or all of them, with at most ``MAX_STATUS_KEYS`` keys of
  detail each; UnblockKey records the skip durably (``SubscriptionRuntime.unblock``) before it answers,
  and so does SkipGap (``SubscriptionRuntime.skip_gap``).
- Publish hands the entry to the sidecar's relays (``entries``, an ``EntryWriter``: the wiring sets
  it) and answers once the entry is durable; it is not atomic with the app's own database.
- Domain errors map to gRPC status codes in one place: ``sidecar.delivery.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.delivery import subscribe
from sidecar.delivery.errors import BadRequest, UnknownRelay, UnknownSubscription, abort, decoded, quote
from sidecar.delivery.responses import fill_reports, skip_gap_response, subscription_status, unblock_response
from sidecar.delivery.streams import DeliveryCounters, OpenStreams, SubscribeStream
from sidecar.engine.dead_letters import KeyNotBlocked
from sidecar.ops.capacity import Capacity
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.pipeline.runtime_context import SubscriptionUnavailable

_LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_OUTSTANDING = 1000
"""Pub/Sub's own client default: enough to keep 1,000 keys busy with one message each."""

MAX_OUTSTANDING_LIMIT = 10_000
"""Caps what one stream may hold unacked: Pub/Sub messages reach 10 MB, so memory is the limit."""

MAX_STATUS_KEYS = 10_000
"""GetStatus per-key detail cap: keeps one response well under the default 4 MiB receive limit."""


class StatusReports(Protocol):
    """What GetStatus adds to the runtime's status, by subscription name: capacity, lease health, and
    the dead letters ingest decided before the engine saw the message (malformed, ...)."""

    def capacity(self, name: str) -> Capacity: ...

    def lease_problem(self, name: str) -> str | None: ...

    def dead_letters(self, name: str) -> Mapping[str, int]: ...


class WaitingReport(Protocol):
    @property
    def entry_id(self) -> str: ...

    @property
    def key(self) -> str | None: ...

    @property
    def reason(self) -> str: ...

    @property
    def retry_helps(self) -> bool: ...


class RelayReport(Protocol):
    """One relay as GetStatus shows it (``sidecar.publishing.relay.Relay``)."""

    @property
    def name(self) -> str: ...

    def counts(self) -> dict[str, int]: ...

    def waiting(self) -> Sequence[WaitingReport]: ...


class EntryWriter(Protocol):
    """Where Publish writes an outbox entry, and what GetStatus reports of the relays: the sidecar's
    relays (``sidecar.wiring.relays``)."""

    def relay_names(self) -> list[str]: ...

    def reports(self) -> Sequence[RelayReport]: ...

    async def write_entry(self, relay: str, entry_id: str, fields: dict[str, Any]) -> str:
        """Write the entry durably; its id. ``LookupError``: no such relay; ``ValueError``: an entry
        that can never be published (the reason); ``StoreError``: not confirmed."""
        ...


class OrderedDeliveryServicer(sidecar_pb2_grpc.OrderedDeliveryServicer):
    """Serves Subscribe, GetStatus, UnblockKey, SkipGap (over ``{subscription name: SubscriptionRuntime}``)
    and Publish (over ``entries``)."""

    def __init__(
        self,
        runtimes: Mapping[str, SubscriptionRuntime],
        *,
        default_max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
        max_outstanding_limit: int = MAX_OUTSTANDING_LIMIT,
        pull_failures: Mapping[str, Callable[[], str | None]] | None = None,
        reports: StatusReports | None = None,
    ) -> None:
        if not 0 < default_max_outstanding <= max_outstanding_limit:
            raise ValueError(
                f"default_max_outstanding must be in 1..{max_outstanding_limit}, got {default_max_outstanding}"
            )
        self._runtimes = dict(runtimes)
        self._pull_failures = dict(pull_failures or {})
        """Subscription name -> why Pub/Sub delivers nothing to it (``PullHealth.problem``), for GetStatus."""
        self._reports = reports
        """Capacity and lease health by subscription name (``sidecar.wiring.reporting.Reports``), for GetStatus."""
        self._default_max_outstanding = default_max_outstanding
        self._max_outstanding_limit = max_outstanding_limit
        self._streams = OpenStreams()
        self.counters = DeliveryCounters()
        self.entries: EntryWriter | None = None
        """The relays Publish writes to (set by the wiring; None: this sidecar runs none)."""

    @property
    def is_draining(self) -> bool:
        return self._streams.draining

    def drain(self) -> None:
        """Shutdown: send no more messages; each stream ends once its outstanding messages are acked
        (or nacked) and confirmed. ``server.stop(grace)`` cuts off what is still open after that."""
        self._streams.drain()

    # ---- Subscribe -------------------------------------------------------------------------

    async def Subscribe(
        self,
        request_iterator: AsyncIterator[sidecar_pb2.SubscribeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[sidecar_pb2.SubscribeResponse]:
        requests = aiter(request_iterator)
        try:
            first = await anext(requests, None)
            if first is None:
                return  # the client closed without opening: nothing to do
            stream = self._open(decoded(first))
        except Exception as exc:
            await abort(context, exc)
            return
        self.counters.streams_opened += 1
        self.counters.streams_active += 1
        runtime = stream.runtime
        _LOGGER.info(
            "stream %s opened by %s (max outstanding %d)", stream.consumer, context.peer(), stream.max_outstanding
        )
        reader = asyncio.create_task(subscribe.read(stream, requests, self.counters), name=f"reader:{stream.consumer}")
        runtime.add_waker(stream.wake)
        self._streams.add(stream)
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(subscribe.send(stream, self._streams, self.counters)) as responses:
                async for response in responses:
                    yield response
            error = stream.error
        except Exception as exc:
            error = exc
        finally:
            reader.cancel()
            self._streams.discard(stream)
            runtime.remove_waker(stream.wake)
            runtime.consumer_closed(stream.consumer)
            self.counters.streams_active -= 1
            _LOGGER.info("stream %s closed (%d messages unacked, given back)", stream.consumer, len(stream.outstanding))
        if error is not None:
            await abort(context, error)

    def _open(self, request: sidecar_pb2.SubscribeRequest) -> SubscribeStream:
        if request.WhichOneof("request") != "open":
            raise BadRequest("first request must be open (SubscribeRequest.open with the subscription name)")
        runtime = self._runtime(request.open.subscription, field="open.subscription")
        requested = request.open.max_outstanding_messages
        if requested < 0 or requested > self._max_outstanding_limit:
            raise BadRequest(
                f"open.max_outstanding_messages must be 0 (server default {self._default_max_outstanding}) "
                f"or 1..{self._max_outstanding_limit}, got {requested}"
            )
        if self._streams.draining:
            raise SubscriptionUnavailable("the sidecar is shutting down; reconnect")
        if not runtime.is_ready:
            raise SubscriptionUnavailable(runtime.unavailable_reason())
        return SubscribeStream(runtime, requested or self._default_max_outstanding, runtime.ack_deadline_ms)

    # ---- GetStatus -------------------------------------------------------------------------

    async def GetStatus(
        self, request: sidecar_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.GetStatusResponse:
        try:
            request = decoded(request)
            if request.max_keys < 0:
                raise BadRequest(f"max_keys must be >= 0, got {request.max_keys}")
            max_keys = min(request.max_keys, MAX_STATUS_KEYS)
            if request.subscription:
                runtimes = [self._runtime(request.subscription, field="subscription")]
            else:
                runtimes = list(self._runtimes.values())
            response = sidecar_pb2.GetStatusResponse()
            for runtime in runtimes:
                status, keys = runtime.status(max_keys)
                proto = subscription_status(runtime, status, keys, runtime.now_ms())
                pull_failure = self._pull_failures.get(runtime.name)
                proto.pull_failure = (pull_failure() if pull_failure is not None else None) or ""
                if self._reports is not None:
                    reports, name = self._reports, runtime.name
                    fill_reports(proto, reports.capacity(name), reports.lease_problem(name), reports.dead_letters(name))
                response.subscriptions.append(proto)
            if not request.subscription and self.entries is not None:
                for relay in self.entries.reports():
                    response.relays.append(_relay_status(relay, max_keys))
            return response
        except Exception as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    # ---- operator actions on one key ------------------------------------------------------

    def _ready_runtime_for_key(self, request: Any, key_is: str) -> SubscriptionRuntime:
        """The runtime an operator's request on one key names, once it is ready: unknown
        subscription NOT_FOUND, no key INVALID_ARGUMENT, not ready UNAVAILABLE (``errors``)."""
        runtime = self._runtime(request.subscription, field="subscription")
        if not request.key:
            raise BadRequest(f"key is required: {key_is}")
        if not runtime.is_ready:
            raise SubscriptionUnavailable(runtime.unavailable_reason())
        return runtime

    # ---- UnblockKey ------------------------------------------------------------------------

    async def UnblockKey(
        self, request: sidecar_pb2.UnblockKeyRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.UnblockKeyResponse:
        try:
            request = decoded(request)
            runtime = self._ready_runtime_for_key(request, "the ordering key to unblock")
            try:
                unblocked = await runtime.unblock(request.key)
            except KeyNotBlocked as exc:
                raise KeyNotBlocked(f"key {quote(request.key)} of subscription {quote(runtime.name)} is not "
                                    "blocked by a dead letter (unknown, running, or its dead letter is still "
                                    "being published)") from exc  # fmt: skip
            return unblock_response(unblocked)
        except Exception as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    # ---- SkipGap ---------------------------------------------------------------------------

    async def SkipGap(
        self, request: sidecar_pb2.SkipGapRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.SkipGapResponse:
        try:
            request = decoded(request)
            runtime = self._ready_runtime_for_key(request, "the ordering key that waits on a gap")
            return skip_gap_response(await runtime.skip_gap(request.key, request.through))
        except Exception as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    # ---- Publish ---------------------------------------------------------------------------

    async def Publish(
        self, request: sidecar_pb2.PublishRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.PublishResponse:
        try:
            request = decoded(request)
            relays = self.entries.relay_names() if self.entries is not None else []
            known = ", ".join(relays) or "(none)"
            if not request.relay:
                raise BadRequest(f"relay is required: a relay `name` from the config (one of: {known})")
            if self.entries is None or request.relay not in relays:
                raise UnknownRelay(f"unknown relay {quote(request.relay)}; this sidecar runs: {known}")
            fields: dict[str, Any] = {"key": request.key, "data": request.data}
            if request.attributes:
                fields["attributes"] = dict(request.attributes)
            for name in ("topic", "traceparent", "tracestate"):
                if getattr(request, name):
                    fields[name] = getattr(request, name)
            try:
                entry_id = await self.entries.write_entry(request.relay, request.entry_id, fields)
            except LookupError as exc:
                raise UnknownRelay(str(exc)) from exc
            except ValueError as exc:
                raise BadRequest(f"relay {quote(request.relay)}: {exc}") from exc
            return sidecar_pb2.PublishResponse(entry_id=entry_id)
        except Exception as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    # ---- shared ----------------------------------------------------------------------------

    def _runtime(self, name: str, *, field: str) -> SubscriptionRuntime:
        known = ", ".join(sorted(self._runtimes)) or "(none)"
        if not name:
            raise BadRequest(f"{field} is required: the subscription `name` from the config (one of: {known})")
        runtime = self._runtimes.get(name)
        if runtime is None:
            raise UnknownSubscription(f"unknown subscription {quote(name)}; this sidecar serves: {known}")
        return runtime


def _relay_status(relay: RelayReport, max_entries: int) -> sidecar_pb2.RelayStatus:
    counts = relay.counts()
    proto = sidecar_pb2.RelayStatus(
        name=relay.name,
        pending_entries=counts.get("relay_pending_entries", 0),
        shards_held=counts.get("relay_shards_held", 0),
        waiting_entries=counts.get("relay_waiting_entries", 0),
        blocked_keys=counts.get("relay_blocked_keys", 0),
        published=counts.get("relay_published", 0),
        publish_failures=counts.get("relay_publish_failures", 0),
    )
    for entry in list(relay.waiting())[:max_entries]:
        proto.waiting.add(
            entry_id=entry.entry_id, key=entry.key or "", reason=entry.reason, retry_helps=entry.retry_helps
        )
    return proto
