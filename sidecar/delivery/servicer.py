"""The grpc.aio servicer of ``pubsub_sidecar.v1.OrderedDelivery``: Subscribe streams, GetStatus, UnblockKey.

The only module that turns engine types into protobuf messages. Rules:

- Each Subscribe stream is one engine consumer with its own id. Its first request must be ``open``;
  later requests are ``ack``/``nack`` (an empty request is accepted and ignored, as a keepalive).
- Several streams on one subscription share its keys: when other streams of the subscription
  can take messages too, the ready ones are dealt to all of them one at a time in turn (``_deal``),
  so that no stream takes every ready key because its sender ran first. The engine keeps a key on
  the stream that has its messages in flight. A lone stream takes up to its budget in one call.
- Flow control: a stream has at most ``max_outstanding_messages`` messages sent and not yet acked or
  nacked (0 = ``default_max_outstanding``; above ``max_outstanding_limit`` or negative is
  INVALID_ARGUMENT). The sender takes up to the free budget from the runtime at once and sends it in
  as few responses as fit under ``_MAX_RESPONSE_BYTES`` (clients' default receive limit is 4 MiB; a
  single larger message goes alone, so clients that expect messages above 4 MiB must raise it).
  A delivery the app keeps past the subscription's ack deadline is expired by the engine; the stream
  then stops counting it, so an app that never acks cannot pin the budget.
- Acks are handed to the runtime at once (the key stays "acking"); the delivery ids come back in
  ``ack_confirmations`` only when the runtime reports them durable. Reading never waits for a
  commit, so acks from one stream batch into the same group commit.
- Ack/nack of a delivery id the engine does not know for this stream is counted and ignored.
- However a stream ends (client gone, cancel, deadline, error), ``consumer_closed`` runs in a
  ``finally`` so its in-flight messages are redelivered at once.
- Domain errors map to gRPC status codes in one place: ``_status_for``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.delivery.handlers import Undecodable
from sidecar.engine.core import KeyNotBlocked, attributes_text
from sidecar.engine.types import Deliver, EngineStatus, KeyStatus
from sidecar.pipeline.runtime import AckTicket, NotOwner, SubscriptionRuntime, SubscriptionUnavailable
from sidecar.store.api import StoreError

_LOGGER = logging.getLogger(__name__)

_M = TypeVar("_M", sidecar_pb2.SubscribeRequest, sidecar_pb2.GetStatusRequest, sidecar_pb2.UnblockKeyRequest)

DEFAULT_MAX_OUTSTANDING = 1000
"""Pub/Sub's own client default: enough to keep 1,000 keys busy with one message each."""

MAX_OUTSTANDING_LIMIT = 10_000
"""Caps what one stream may hold unacked: Pub/Sub messages reach 10 MB, so memory is the limit."""

MAX_STATUS_KEYS = 10_000
"""GetStatus per-key detail cap: keeps one response well under the default 4 MiB receive limit."""

_MAX_RESPONSE_BYTES = 3 * 1024 * 1024
"""Stay under the 4 MiB default receive limit of gRPC clients, with room for our size estimate's error."""

_MESSAGE_OVERHEAD_BYTES = 96
"""Rough protobuf framing per OrderedMessage (tags, lengths, timestamps, attempt, flags)."""

_MAX_ECHO_CHARS = 100
"""Client input quoted in an error message is cut to this. The message travels in a header, and
clients refuse headers above 8-16 KiB: a 1 MB subscription name echoed whole would reach the
client as RESOURCE_EXHAUSTED instead of NOT_FOUND."""

_consumer_ids = itertools.count(1)


def _quote(value: str) -> str:
    """``repr(value)``, cut short with its full size when longer than ``_MAX_ECHO_CHARS``."""
    if len(value) <= _MAX_ECHO_CHARS:
        return repr(value)
    return f"{value[:_MAX_ECHO_CHARS]!r}... ({len(value.encode())} bytes)"


def _decoded(request: _M | Undecodable) -> _M:
    if isinstance(request, Undecodable):
        raise BadRequest(request.describe())
    return request


class BadRequest(ValueError):
    """The client sent something it must not: INVALID_ARGUMENT, the stream ends."""


class UnknownSubscription(LookupError):
    """No subscription by that name in the config: NOT_FOUND."""


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from our errors to gRPC status codes and messages."""
    if isinstance(exc, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, UnknownSubscription):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "unknown subscription"
    if isinstance(exc, SubscriptionUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, KeyNotBlocked):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]) if exc.args else "key is not blocked"
    if isinstance(exc, NotOwner):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]) if exc.args else "key owned by another pod"
    if isinstance(exc, StoreError):
        return grpc.StatusCode.UNAVAILABLE, f"the store did not confirm it (it may have applied): retry: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


@dataclass(slots=True)
class DeliveryCounters:
    streams_opened: int = 0
    streams_active: int = 0
    messages_sent: int = 0
    responses_sent: int = 0
    unknown_ids: int = 0
    bad_requests: int = 0


class _Stream:
    """One Subscribe stream's state, shared by its sender (the handler) and its reader task."""

    def __init__(self, runtime: SubscriptionRuntime, max_outstanding: int, ack_deadline_ms: int) -> None:
        self.runtime = runtime
        self.consumer = f"{runtime.name}#{next(_consumer_ids)}"
        self.max_outstanding = max_outstanding
        self.ack_deadline_ms = ack_deadline_ms
        self.outstanding: dict[str, int] = {}
        """delivery id -> sent at (ms), oldest first."""
        self.confirmations: list[str] = []
        self.pending_acks = 0
        self.wake = asyncio.Event()
        self.error: BaseException | None = None
        self.reader_done = False
        self.dealt: list[Deliver] = []
        """Taken for this stream by another stream's sender (``_deal``) and counted in
        ``outstanding``, not yet sent: this stream's sender sends them next."""

    def can_receive(self) -> bool:
        """Open for new messages: no error, and the client still sends (it could ack them)."""
        return self.error is None and not self.reader_done

    def free_budget(self, now_ms: int) -> int:
        free = self.max_outstanding - len(self.outstanding)
        if free <= 0:
            # The engine expires deliveries kept past the ack deadline and redelivers them; stop
            # counting those so an app that forgot some acks still gets messages.
            expired_before = now_ms - self.ack_deadline_ms
            for delivery_id, sent_ms in list(self.outstanding.items()):
                if sent_ms > expired_before:
                    break
                del self.outstanding[delivery_id]
            free = self.max_outstanding - len(self.outstanding)
        return free

    def seconds_until_expiry(self, now_ms: int) -> float | None:
        if len(self.outstanding) < self.max_outstanding or not self.outstanding:
            return None
        oldest_ms = next(iter(self.outstanding.values()))
        return max(0.0, (oldest_ms + self.ack_deadline_ms - now_ms) / 1000)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.wake.set()

    def on_confirmed(self, future: asyncio.Future[list[str]]) -> None:
        self.pending_acks -= 1
        if future.cancelled():
            self.fail(SubscriptionUnavailable(f"subscription {self.runtime.name!r} stopped before acks were durable"))
        elif (exc := future.exception()) is not None:
            self.fail(exc)
        else:
            self.confirmations.extend(future.result())
        self.wake.set()


class OrderedDeliveryServicer(sidecar_pb2_grpc.OrderedDeliveryServicer):
    """Serves Subscribe and GetStatus over ``{subscription name: SubscriptionRuntime}``."""

    def __init__(
        self,
        runtimes: Mapping[str, SubscriptionRuntime],
        *,
        default_max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
        max_outstanding_limit: int = MAX_OUTSTANDING_LIMIT,
        pull_failures: Mapping[str, Callable[[], str | None]] | None = None,
    ) -> None:
        if not 0 < default_max_outstanding <= max_outstanding_limit:
            raise ValueError(
                f"default_max_outstanding must be in 1..{max_outstanding_limit}, got {default_max_outstanding}"
            )
        self._runtimes = dict(runtimes)
        self._pull_failures = dict(pull_failures or {})
        """Subscription name -> why Pub/Sub delivers nothing to it (``PullHealth.problem``), for GetStatus."""
        self._default_max_outstanding = default_max_outstanding
        self._max_outstanding_limit = max_outstanding_limit
        self._streams: set[_Stream] = set()
        self._deal_turn = 0
        """Which stream's turn comes first in the next ``_deal`` (moves on each time)."""
        self._draining = False
        self.counters = DeliveryCounters()

    @property
    def is_draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Shutdown: send no more messages; each stream ends once its outstanding messages are acked
        (or nacked) and confirmed. ``server.stop(grace)`` cuts off what is still open after that."""
        self._draining = True
        for stream in self._streams:
            stream.wake.set()

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
            stream = self._open(_decoded(first))
        except Exception as exc:
            await self._abort(context, exc)
            return
        self.counters.streams_opened += 1
        self.counters.streams_active += 1
        runtime = stream.runtime
        _LOGGER.info(
            "stream %s opened by %s (max outstanding %d)", stream.consumer, context.peer(), stream.max_outstanding
        )
        reader = asyncio.create_task(self._read(stream, requests), name=f"reader:{stream.consumer}")
        runtime.add_waker(stream.wake)
        self._streams.add(stream)
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(self._send(stream)) as responses:
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
            await self._abort(context, error)

    def _open(self, request: sidecar_pb2.SubscribeRequest) -> _Stream:
        if request.WhichOneof("request") != "open":
            raise BadRequest("first request must be open (SubscribeRequest.open with the subscription name)")
        runtime = self._runtime(request.open.subscription, field="open.subscription")
        requested = request.open.max_outstanding_messages
        if requested < 0 or requested > self._max_outstanding_limit:
            raise BadRequest(
                f"open.max_outstanding_messages must be 0 (server default {self._default_max_outstanding}) "
                f"or 1..{self._max_outstanding_limit}, got {requested}"
            )
        if self._draining:
            raise SubscriptionUnavailable("the sidecar is shutting down; reconnect")
        if not runtime.is_ready:
            raise SubscriptionUnavailable(runtime.unavailable_reason())
        return _Stream(runtime, requested or self._default_max_outstanding, runtime.ack_deadline_ms)

    async def _send(self, stream: _Stream) -> AsyncGenerator[sidecar_pb2.SubscribeResponse, None]:
        """The sender: takes what the budget allows, sends it with pending confirmations, waits."""
        runtime = stream.runtime
        while True:
            if stream.error is not None:
                return
            if not runtime.is_ready:
                raise SubscriptionUnavailable(runtime.unavailable_reason())
            stream.wake.clear()
            now_ms = runtime.now_ms()
            deliveries: list[Deliver] = []
            if not stream.reader_done and not self._draining:
                # Nothing more is sent once the client stopped sending: it could never ack it (what
                # was dealt to it stays in flight to it and is given back when the stream ends).
                deliveries, stream.dealt = stream.dealt, []
                free = stream.free_budget(now_ms)
                if free > 0:
                    deliveries += self._take(stream, free, now_ms)
                if deliveries:
                    # Payloads left in the store (over the held-bytes budget) are read back first.
                    deliveries = await runtime.load_payloads(deliveries)
            confirmations, stream.confirmations = stream.confirmations, []
            if deliveries or confirmations:
                for response in _responses(deliveries, confirmations):
                    self.counters.responses_sent += 1
                    yield response
                self.counters.messages_sent += len(deliveries)
                continue
            if stream.reader_done and stream.pending_acks == 0:
                return  # half-closed by the client and every ack answered: end with OK
            if self._draining and stream.pending_acks == 0 and not stream.outstanding:
                raise SubscriptionUnavailable("the sidecar is shutting down; reconnect")
            timeout = stream.seconds_until_expiry(now_ms)
            if timeout is None:
                await stream.wake.wait()
            else:
                try:
                    await asyncio.wait_for(stream.wake.wait(), timeout)
                except TimeoutError:
                    pass

    def _take(self, stream: _Stream, free: int, now_ms: int) -> list[Deliver]:
        """What ``stream`` sends now: up to ``free`` messages, or its share when other streams of its
        subscription have room too (``_deal``). Each is counted in ``outstanding`` at once."""
        runtime = stream.runtime
        peers = [p for p in self._streams if p.runtime is runtime and p is not stream and p.can_receive()]
        if peers:
            return self._deal(stream, free, peers, now_ms)
        # One stream on the subscription (the hot path): everything ready, up to the budget.
        deliveries = runtime.take(stream.consumer, free)
        for delivery in deliveries:
            stream.outstanding[delivery.delivery_id] = now_ms
        return deliveries

    def _deal(self, stream: _Stream, free: int, peers: list[_Stream], now_ms: int) -> list[Deliver]:
        """Deal the ready messages one at a time to every stream of the subscription with room, in
        turn (the first turn moves on at each deal), until none is left or every budget is full;
        returns ``stream``'s own, and wakes the others for theirs.

        The engine still decides which message each take gets (a key stays with the stream that has
        its messages in flight), so dealing spreads keys without ever splitting one. Without it the
        stream whose sender ran first took every ready key up to its budget."""
        runtime = stream.runtime
        seats = [(stream, free), *((p, p.free_budget(now_ms)) for p in peers)]
        turn = self._deal_turn % len(seats)
        self._deal_turn += 1
        left = {id(s): budget for s, budget in seats[turn:] + seats[:turn] if budget > 0}
        order = [s for s, _ in seats[turn:] + seats[:turn] if id(s) in left]
        own: list[Deliver] = []
        while order:
            still = []
            for seat in order:
                taken = runtime.take(seat.consumer, 1)
                if not taken:
                    continue  # nothing ready for it (what is left is in flight to other streams)
                [delivery] = taken
                seat.outstanding[delivery.delivery_id] = now_ms
                if seat is stream:
                    own.append(delivery)
                else:
                    seat.dealt.append(delivery)
                left[id(seat)] -= 1
                if left[id(seat)] > 0:
                    still.append(seat)
            order = still
        for peer in peers:
            if peer.dealt:
                peer.wake.set()
        return own

    async def _read(self, stream: _Stream, requests: AsyncIterator[sidecar_pb2.SubscribeRequest]) -> None:
        """The reader: applies acks and nacks as they arrive; never waits for a commit."""
        try:
            async for received in requests:
                request = _decoded(received)
                kind = request.WhichOneof("request")
                if kind == "ack":
                    self._on_ack(stream, list(request.ack.delivery_ids))
                elif kind == "nack":
                    self._on_nack(stream, request.nack)
                elif kind == "open":
                    raise BadRequest("open may be sent only once, as the first request of a stream")
                # An empty request carries nothing: accepted as a keepalive.
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, BadRequest):
                self.counters.bad_requests += 1
            stream.fail(exc)
        finally:
            stream.reader_done = True
            stream.wake.set()

    def _on_ack(self, stream: _Stream, delivery_ids: list[str]) -> None:
        for delivery_id in delivery_ids:
            stream.outstanding.pop(delivery_id, None)
        ticket: AckTicket = stream.runtime.submit_ack(stream.consumer, delivery_ids)
        self._count_unknown(stream, "ack", ticket.unknown)
        if ticket.confirmed is not None:
            stream.pending_acks += 1
            ticket.confirmed.add_done_callback(stream.on_confirmed)
        stream.wake.set()

    def _on_nack(self, stream: _Stream, nack: sidecar_pb2.Nack) -> None:
        retry_after_ms: int | None = None
        if nack.HasField("retry_after"):
            retry_after_ms = nack.retry_after.ToMilliseconds()
            if retry_after_ms < 0:
                raise BadRequest(f"nack.retry_after must not be negative, got {nack.retry_after.ToJsonString()}")
        delivery_ids = list(nack.delivery_ids)
        for delivery_id in delivery_ids:
            stream.outstanding.pop(delivery_id, None)
        unknown = stream.runtime.nack(
            stream.consumer, delivery_ids, retry_after_ms=retry_after_ms, dead_letter=nack.dead_letter
        )
        self._count_unknown(stream, "nack", unknown)
        stream.wake.set()

    def _count_unknown(self, stream: _Stream, what: str, unknown: list[str]) -> None:
        if unknown:
            self.counters.unknown_ids += len(unknown)
            _LOGGER.debug("stream %s: %s of %d unknown delivery ids ignored", stream.consumer, what, len(unknown))

    # ---- GetStatus -------------------------------------------------------------------------

    async def GetStatus(
        self, request: sidecar_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.GetStatusResponse:
        try:
            request = _decoded(request)
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
                proto = _subscription_status(runtime, status, keys, runtime.now_ms())
                pull_failure = self._pull_failures.get(runtime.name)
                proto.pull_failure = (pull_failure() if pull_failure is not None else None) or ""
                response.subscriptions.append(proto)
            return response
        except Exception as exc:
            await self._abort(context, exc)
            raise  # unreachable: abort raises

    # ---- UnblockKey ------------------------------------------------------------------------

    async def UnblockKey(
        self, request: sidecar_pb2.UnblockKeyRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.UnblockKeyResponse:
        try:
            request = _decoded(request)
            runtime = self._runtime(request.subscription, field="subscription")
            if not request.key:
                raise BadRequest("key is required: the ordering key to unblock")
            if not runtime.is_ready:
                raise SubscriptionUnavailable(runtime.unavailable_reason())
            try:
                unblocked = await runtime.unblock(request.key)
            except KeyNotBlocked as exc:
                raise KeyNotBlocked(f"key {_quote(request.key)} of subscription {_quote(runtime.name)} is not "
                                    "blocked by a dead letter (unknown, running, or its dead letter is still "
                                    "being published)") from exc  # fmt: skip
            response = sidecar_pb2.UnblockKeyResponse(skipped_message_id=unblocked.message_id or "")
            if isinstance(unblocked.position, int):
                response.skipped_sequence = unblocked.position
            elif isinstance(unblocked.position, tuple):
                response.skipped_timestamp.CopyFrom(_timestamp(int(unblocked.position[0])))
            return response
        except Exception as exc:
            await self._abort(context, exc)
            raise  # unreachable: abort raises

    # ---- shared ----------------------------------------------------------------------------

    def _runtime(self, name: str, *, field: str) -> SubscriptionRuntime:
        known = ", ".join(sorted(self._runtimes)) or "(none)"
        if not name:
            raise BadRequest(f"{field} is required: the subscription `name` from the config (one of: {known})")
        runtime = self._runtimes.get(name)
        if runtime is None:
            raise UnknownSubscription(f"unknown subscription {_quote(name)}; this sidecar serves: {known}")
        return runtime

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, details = _status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            _LOGGER.error("request failed: %s", details, exc_info=exc)
        else:
            _LOGGER.info("request ended with %s: %s", code.name, details)
        await context.abort(code, details)


# ---- engine types -> protobuf ------------------------------------------------------------------


def _responses(deliveries: list[Deliver], confirmations: list[str]) -> list[sidecar_pb2.SubscribeResponse]:
    """Pack messages into responses under ``_MAX_RESPONSE_BYTES``; confirmations ride on the first.
    Each message is built in place in its response (``messages.add``): no copy of its payload."""
    response = sidecar_pb2.SubscribeResponse()
    responses = [response]
    batch_bytes = 0
    for delivery in deliveries:
        size = _estimated_size(delivery)
        if batch_bytes and batch_bytes + size > _MAX_RESPONSE_BYTES:
            response = sidecar_pb2.SubscribeResponse()
            responses.append(response)
            batch_bytes = 0
        _fill_ordered_message(response.messages.add(), delivery)
        batch_bytes += size
    if confirmations:
        responses[0].ack_confirmations.extend(confirmations)
    return responses


def _estimated_size(delivery: Deliver) -> int:
    message = delivery.message
    size = _MESSAGE_OVERHEAD_BYTES + len(delivery.delivery_id) + len(message.key)
    size += len(message.message_id) + len(message.dedup_id)
    payload = message.payload
    if payload is not None:
        size += len(payload.data) + attributes_text(payload.attributes) + 8 * len(payload.attributes)
    return size + 16 * len(delivery.skipped)


def _fill_ordered_message(proto: sidecar_pb2.OrderedMessage, delivery: Deliver) -> None:
    message = delivery.message
    payload = message.payload
    proto.delivery_id = delivery.delivery_id
    proto.key = message.key
    proto.message_id = message.message_id
    proto.dedup_id = message.dedup_id
    proto.sequence = message.sequence or 0
    proto.delivery_attempt = delivery.attempt
    proto.late = delivery.late
    proto.replayed = delivery.replayed
    proto.epoch = delivery.epoch
    for skipped in delivery.skipped:
        proto.skipped.add(first=skipped.first, last=skipped.last)
    if payload is not None:
        proto.data = payload.data
        attributes = proto.attributes
        for name, value in payload.attributes.items():  # a third faster than the map's generic update()
            attributes[name] = value
        _set_timestamp(proto.publish_time, payload.publish_time_ms)
    if message.timestamp_ms is not None:
        _set_timestamp(proto.event_time, message.timestamp_ms)


def _set_timestamp(target: timestamp_pb2.Timestamp, ms: int) -> None:
    seconds, millis = divmod(ms, 1000)
    target.seconds = seconds
    target.nanos = millis * 1_000_000


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    seconds, millis = divmod(ms, 1000)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=millis * 1_000_000)


def _duration(ms: int) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(ms)
    return duration


def _subscription_status(
    runtime: SubscriptionRuntime, status: EngineStatus, keys: list[KeyStatus], now_ms: int
) -> sidecar_pb2.SubscriptionStatus:
    counts = dict(status.counts)
    runtime_counters = runtime.counters
    counts["unknown_delivery_ids"] = runtime_counters.unknown_ids
    counts["ack_commits"] = runtime_counters.ack_commits
    counts["store_retries"] = runtime_counters.store_retries
    counts["dead_letter_publish_failures"] = runtime_counters.dead_letter_publish_failures
    counts["dead_letters_pending"] = runtime.dead_letters_pending  # a current value, not a running count
    counts.update(runtime.extra_counts())
    proto = sidecar_pb2.SubscriptionStatus(
        name=runtime.name,
        mode=status.mode,
        buffered=status.buffered,
        ready=status.ready,
        in_flight=status.in_flight,
        keys=status.keys,
        keys_blocked=status.keys_blocked,
        counts=counts,
    )
    if runtime.sharded:
        proto.pod = runtime.pod
        proto.shard_count = runtime.shard_count
        for shard, epoch in sorted(runtime.shards().items()):
            proto.shards.add(shard=shard, epoch=epoch)
    if status.oldest_undelivered_ms is not None:
        proto.oldest_undelivered_age.CopyFrom(_duration(max(0, now_ms - status.oldest_undelivered_ms)))
    if status.watermark_ms is not None:
        proto.watermark.CopyFrom(_timestamp(status.watermark_ms))
        proto.watermark_lag.CopyFrom(_duration(max(0, now_ms - status.watermark_ms)))
    for key in keys:
        detail = proto.keys_detail.add(
            key=key.key,
            state=key.state,
            waiting_for=key.waiting_for,
            buffered=key.buffered,
            in_flight=key.in_flight,
        )
        if key.since_ms is not None:
            detail.since.CopyFrom(_timestamp(key.since_ms))
        if key.next_sequence is not None:
            detail.next_sequence = key.next_sequence
        if key.missing_sequence is not None:
            detail.missing_sequence = key.missing_sequence
        if key.blocked_message_id:
            detail.blocked_message_id = key.blocked_message_id
        if key.blocked_sequence is not None:
            detail.blocked_sequence = key.blocked_sequence
    return proto
