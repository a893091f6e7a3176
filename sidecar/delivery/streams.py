"""The open Subscribe streams: each one's budget and state, and how ready messages are dealt to them.

Rules:

- Each Subscribe stream is one engine consumer with its own id (``SubscribeStream.consumer``).
- Flow control: a stream has at most ``max_outstanding`` messages sent and not yet acked or nacked
  (``outstanding``, oldest first). A delivery the app keeps past the subscription's ack deadline is
  expired by the engine; the stream then stops counting it (``free_budget``), so an app that never
  acks cannot pin the budget.
- A stream is open for new messages only while it has no error and its client still sends
  (``can_receive``): a client that stopped sending could never ack them.
- Several streams on one subscription share its keys: when other streams of the subscription can
  take messages too, the ready ones are dealt to all of them one at a time in turn
  (``OpenStreams.take``), so that no stream takes every ready key because its sender ran first. The
  engine keeps a key on the stream that has its messages in flight. A lone stream takes up to its
  budget in one call. Every message taken is counted in its stream's ``outstanding`` at once.
- Once the sidecar drains (``OpenStreams.drain``), every stream is woken and sends nothing more.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from sidecar.engine.types import Deliver
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.pipeline.runtime_context import SubscriptionUnavailable

_consumer_ids = itertools.count(1)


@dataclass(slots=True)
class DeliveryCounters:
    streams_opened: int = 0
    streams_active: int = 0
    messages_sent: int = 0
    responses_sent: int = 0
    unknown_ids: int = 0
    bad_requests: int = 0


class SubscribeStream:
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
        """Taken for this stream by another stream's sender (``OpenStreams.take``) and counted in
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


class OpenStreams:
    """The servicer's open streams, whether the sidecar drains, and the deal among a subscription's streams."""

    def __init__(self) -> None:
        self._streams: set[SubscribeStream] = set()
        self._deal_turn = 0
        """Which stream's turn comes first in the next ``_deal`` (moves on each time)."""
        self.draining = False

    def add(self, stream: SubscribeStream) -> None:
        self._streams.add(stream)

    def discard(self, stream: SubscribeStream) -> None:
        self._streams.discard(stream)

    def drain(self) -> None:
        """Send no more messages: every stream wakes and sees it."""
        self.draining = True
        for stream in self._streams:
            stream.wake.set()

    def take(self, stream: SubscribeStream, free: int, now_ms: int) -> list[Deliver]:
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

    def _deal(self, stream: SubscribeStream, free: int, peers: list[SubscribeStream], now_ms: int) -> list[Deliver]:
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
