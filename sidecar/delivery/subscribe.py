"""One Subscribe stream at work: its sender (what is sent, when it waits, how it ends) and its reader.

Rules:

- The sender takes what the stream's budget allows from the runtime at once (``OpenStreams.take``)
  and sends it in as few responses as fit (``sidecar.delivery.responses``), with the confirmations
  that are pending. Nothing more is sent once the client stopped sending (it could never ack it) or
  the sidecar drains. Payloads left in the store (over the held-bytes budget) are read back first.
- Acks are handed to the runtime at once (the key stays "acking"); the delivery ids come back in
  ``ack_confirmations`` only when the runtime reports them durable. Reading never waits for a
  commit, so acks from one stream batch into the same group commit.
- Ack/nack of a delivery id the engine does not know for this stream is counted and ignored. After
  ``open``, a request is ``ack`` or ``nack``; an empty request is accepted and ignored (a keepalive);
  a second ``open`` or a negative ``nack.retry_after`` is a ``BadRequest`` that ends the stream.
- The stream ends with OK once the client half-closed and every ack it sent is answered; while the
  sidecar drains, with UNAVAILABLE once nothing it holds is outstanding or unconfirmed; on an error
  (the reader's, a failed ack commit, a runtime that stopped), with that error's code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from pubsub_sidecar.v1 import sidecar_pb2
from sidecar.delivery.errors import BadRequest, decoded
from sidecar.delivery.responses import subscribe_responses
from sidecar.delivery.streams import DeliveryCounters, OpenStreams, SubscribeStream
from sidecar.engine.types import Deliver
from sidecar.pipeline.runtime_acks import AckTicket
from sidecar.pipeline.runtime_context import SubscriptionUnavailable

_LOGGER = logging.getLogger(__name__)


async def send(
    stream: SubscribeStream, streams: OpenStreams, counters: DeliveryCounters
) -> AsyncGenerator[sidecar_pb2.SubscribeResponse, None]:
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
        if not stream.reader_done and not streams.draining:
            # Nothing more is sent once the client stopped sending: it could never ack it (what
            # was dealt to it stays in flight to it and is given back when the stream ends).
            deliveries, stream.dealt = stream.dealt, []
            free = stream.free_budget(now_ms)
            if free > 0:
                deliveries += streams.take(stream, free, now_ms)
            if deliveries:
                # Payloads left in the store (over the held-bytes budget) are read back first.
                deliveries = await runtime.load_payloads(deliveries)
        confirmations, stream.confirmations = stream.confirmations, []
        if deliveries or confirmations:
            traceparents = runtime.traces.delivered(deliveries) if deliveries else None
            for response in subscribe_responses(deliveries, confirmations, traceparents):
                counters.responses_sent += 1
                yield response
            counters.messages_sent += len(deliveries)
            continue
        if stream.reader_done and stream.pending_acks == 0:
            return  # half-closed by the client and every ack answered: end with OK
        if streams.draining and stream.pending_acks == 0 and not stream.outstanding:
            raise SubscriptionUnavailable("the sidecar is shutting down; reconnect")
        timeout = stream.seconds_until_expiry(now_ms)
        if timeout is None:
            await stream.wake.wait()
        else:
            try:
                await asyncio.wait_for(stream.wake.wait(), timeout)
            except TimeoutError:
                pass


async def read(
    stream: SubscribeStream, requests: AsyncIterator[sidecar_pb2.SubscribeRequest], counters: DeliveryCounters
) -> None:
    """The reader: applies acks and nacks as they arrive; never waits for a commit."""
    try:
        async for received in requests:
            request = decoded(received)
            kind = request.WhichOneof("request")
            if kind == "ack":
                _on_ack(stream, list(request.ack.delivery_ids), counters)
            elif kind == "nack":
                _on_nack(stream, request.nack, counters)
            elif kind == "open":
                raise BadRequest("open may be sent only once, as the first request of a stream")
            # An empty request carries nothing: accepted as a keepalive.
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if isinstance(exc, BadRequest):
            counters.bad_requests += 1
        stream.fail(exc)
    finally:
        stream.reader_done = True
        stream.wake.set()


def _on_ack(stream: SubscribeStream, delivery_ids: list[str], counters: DeliveryCounters) -> None:
    for delivery_id in delivery_ids:
        stream.outstanding.pop(delivery_id, None)
    ticket: AckTicket = stream.runtime.submit_ack(stream.consumer, delivery_ids)
    _count_unknown(stream, "ack", ticket.unknown, counters)
    if ticket.confirmed is not None:
        stream.pending_acks += 1
        ticket.confirmed.add_done_callback(stream.on_confirmed)
    stream.wake.set()


def _on_nack(stream: SubscribeStream, nack: sidecar_pb2.Nack, counters: DeliveryCounters) -> None:
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
    _count_unknown(stream, "nack", unknown, counters)
    stream.wake.set()


def _count_unknown(stream: SubscribeStream, what: str, unknown: list[str], counters: DeliveryCounters) -> None:
    if unknown:
        counters.unknown_ids += len(unknown)
        _LOGGER.debug("stream %s: %s of %d unknown delivery ids ignored", stream.consumer, what, len(unknown))
