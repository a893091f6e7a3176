"""Delivery to the app's streams at the runtime: take ready messages, read back stripped payloads,
accept acks and nacks.

Each stream is one engine consumer. Rules:

- Nothing is handed out before the runtime is ready (recovered, running, not stopping), nor of a
  shard being handed over, nor on a lease check that no longer holds: ``take`` and ``submit_ack``
  first drop every shard whose lease is not held within its margin now, and ``load_payloads`` again
  after its read: a delivery whose shard was dropped while its payload was read back is withheld
  (its next owner delivers it).
- Shards are taken from in turn, so that none starves (``ShardEngines.take``).
- A stored message leaves the held-bytes budget when it is first handed out; a fast-path message was
  never counted (its Pub/Sub lease and the client's flow control bound it).
- An ack is accepted by the engine that handed the id out (the engine holds the key as "acking")
  and confirmed only once durable (``runtime_acks``, G3). An id no engine knows for the consumer
  (already acked, expired, another stream's, a dropped shard's) is answered unknown at once.
- A nack gives messages back to the engine: redelivered after backoff, or dead-lettered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from sidecar.engine import UnknownDelivery
from sidecar.engine.payloads import HELD_MESSAGE_OVERHEAD_BYTES, payload_size
from sidecar.engine.types import AckIntent, Deliver
from sidecar.pipeline.runtime_acks import AckPipeline, AckTicket
from sidecar.pipeline.runtime_context import RuntimeContext, SubscriptionUnavailable


class Deliveries:
    """Takes messages for the streams and accepts their acks and nacks."""

    def __init__(
        self,
        ctx: RuntimeContext,
        acks: AckPipeline,
        *,
        drop_expired_leases: Callable[[], None],
        wake_timer: Callable[[], None],
        on_delivered: Callable[[Sequence[Deliver], int], None] | None,
    ) -> None:
        self._ctx = ctx
        self._acks = acks
        self._drop_expired_leases = drop_expired_leases
        self._wake_timer = wake_timer
        self._on_delivered = on_delivered
        """Observer of every batch ``take`` hands out, with ``now_ms`` (metrics: publish-to-delivery)."""

    def take(self, consumer: str, max_messages: int) -> list[Deliver]:
        """Up to ``max_messages`` releasable messages for ``consumer`` (none while not ready)."""
        ctx = self._ctx
        if max_messages <= 0 or not ctx.is_ready:
            return []
        self._drop_expired_leases()
        now_ms = ctx.clock()
        deliveries: list[Deliver] = []
        for entry, delivery in ctx.engines.take(consumer, max_messages, now_ms):
            payload = delivery.message.payload
            # A fast-path message was never counted (its Pub/Sub lease and the client's flow control bound it).
            if delivery.attempt == 1 and payload is not None and not delivery.message.volatile:
                size = 0 if payload.stripped else payload_size(payload)
                entry.held_bytes = max(0, entry.held_bytes - size - HELD_MESSAGE_OVERHEAD_BYTES)
            deliveries.append(delivery)
        if deliveries:
            self._wake_timer()
            if self._on_delivered is not None:
                self._on_delivered(deliveries, now_ms)
        return deliveries

    async def load_payloads(self, deliveries: list[Deliver]) -> list[Deliver]:
        """``deliveries`` with every stripped payload read back from the store (counted as reads).

        Retried while the store is unavailable; the deliveries stay in flight meanwhile (their ack
        deadline runs, and an expiry gives them back as usual)."""
        ctx = self._ctx
        stripped = [d.message for d in deliveries if d.message.payload is not None and d.message.payload.stripped]
        if not stripped:
            return deliveries
        loaded = await ctx.retry_store(ctx.store.read_payloads, stripped)
        ctx.counters.payloads_read += len(stripped)
        by_ref = {m.payload.ref: m for m in loaded if m.payload is not None}
        # The read took time (retried while the store is unavailable): what ``take`` checked then
        # (the lease within its margin, the shard still this engine's) may no longer hold. Nothing
        # is handed to an app on a check that is no longer true: a delivery of a shard dropped
        # meanwhile is not sent (its next owner delivers it).
        self._drop_expired_leases()
        out = []
        for delivery in deliveries:
            if ctx.engines.for_delivery(delivery.delivery_id) is None:
                ctx.counters.deliveries_withheld += 1
                continue
            payload = delivery.message.payload
            if payload is not None and payload.stripped:
                delivery = dataclasses.replace(delivery, message=by_ref[payload.ref])
            out.append(delivery)
        return out

    def submit_ack(self, consumer: str, delivery_ids: Sequence[str]) -> AckTicket:
        """Accept acks now (the engine holds their keys as "acking"); confirm once durable."""
        ctx = self._ctx
        ctx.require_recovered()
        if ctx.failure is not None:
            raise SubscriptionUnavailable(f"subscription {ctx.name!r} failed: {ctx.failure!r}")
        self._drop_expired_leases()
        now_ms = ctx.clock()
        intents: list[AckIntent] = []
        unknown: list[str] = []
        for delivery_id in delivery_ids:
            entry = ctx.engines.for_delivery(delivery_id)
            try:
                if entry is None:
                    raise UnknownDelivery(delivery_id)
                intents.append(entry.engine.ack(consumer, delivery_id, now_ms))
            except UnknownDelivery:
                unknown.append(delivery_id)
        ctx.counters.unknown_ids += len(unknown)
        ctx.counters.acks_submitted += len(intents)
        if not intents:
            return AckTicket(unknown=unknown, confirmed=None)
        return AckTicket(unknown=unknown, confirmed=self._acks.submit(intents))

    def nack(
        self,
        consumer: str,
        delivery_ids: Sequence[str],
        *,
        retry_after_ms: int | None = None,
        dead_letter: bool = False,
    ) -> list[str]:
        """Give messages back (redelivered after backoff, or dead-lettered); returns the unknown ids."""
        ctx = self._ctx
        ctx.require_recovered()
        now_ms = ctx.clock()
        unknown: list[str] = []
        for delivery_id in delivery_ids:
            entry = ctx.engines.for_delivery(delivery_id)
            try:
                if entry is None:
                    raise UnknownDelivery(delivery_id)
                actions = entry.engine.nack(
                    consumer, delivery_id, now_ms, retry_after_ms=retry_after_ms, dead_letter=dead_letter
                )
            except UnknownDelivery:
                unknown.append(delivery_id)
                continue
            ctx.apply(entry, actions)
        ctx.counters.unknown_ids += len(unknown)
        ctx.after_change()
        return unknown

    def consumer_closed(self, consumer: str) -> None:
        """A stream ended: its in-flight messages are ready again at once, for any stream."""
        ctx = self._ctx
        now_ms = ctx.clock()
        for entry in ctx.engines:
            entry.engine.consumer_closed(consumer, now_ms)
        ctx.after_change()
