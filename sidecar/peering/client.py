"""The sender's side of the peer channel: ``PeerForwarder``, the ingest's ``Forwarder`` over gRPC.

Rules (docs/forwarding.md; G1 in DESIGN §1 depends on the first):

- **Answered once, acked only on ACCEPTED.** Every message taken (``forward`` returned True) gets
  exactly one answer: True only for the owner's ACCEPTED; False for a refusal, and for every message
  still unanswered when its stream ends in any way (an error such as UNAVAILABLE, the owner's end,
  our own close). The sorter stores a message answered False for its owner (``inbox``): a message
  whose outcome was in fact durable at the owner is then a second copy, which the owner's dedup drops.
- **Stale routes are read again.** A ``NOT_OWNER`` or ``STALE_EPOCH`` answer, or a stream that
  ended with the message unanswered, makes the directory ``forget`` the shard's route.
- **One channel per owner address**, reused; on it one ``Forward`` stream at a time, opened when a
  message is to be sent. A stream that ends marks the address unusable for a capped, jittered backoff
  (``sidecar.backoff``), during which ``forward`` declines at once (the inbox's way), so that a dead
  owner costs no wait.
- **Bounded.** At most ``window`` messages per owner address are taken and unanswered; past it
  ``forward`` declines. Sent in batches of up to ``max_batch_messages`` / ``max_batch_bytes`` (one
  subscription each); a message too large for a frame (``max_message_bytes``) is declined.
- The Pub/Sub client keeps extending the lease of a message meanwhile: nothing to do but not settle it.
- Payloads never appear in logs; addresses, counts and status codes do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from sidecar.backoff import backoff_seconds
from sidecar.peering.auth import PeerCredentials
from sidecar.peering.proto import peer_pb2, peer_pb2_grpc
from sidecar.peering.routes import PeerDirectory
from sidecar.peering.server import MAX_MESSAGE_BYTES
from sidecar.pipeline.ingest_settlement import PulledMessage

_LOGGER = logging.getLogger(__name__)

WINDOW = 1_000
"""Messages per owner address taken and not answered yet: a few hundred milliseconds of a busy pod's
intake, while its Pub/Sub client's flow control (5,000 by default) bounds the whole."""

MAX_BATCH_MESSAGES = 500
MAX_BATCH_BYTES = 4 * 1024 * 1024
"""A batch's bound: well below a frame's (``max_message_bytes``), so one batch never ties up a stream."""

_ENVELOPE_BYTES = 64 * 1024
"""Room in a frame for a message's envelope (ids, shard, epoch, attribute framing)."""

_RETRY_INITIAL_SECONDS = 0.2
_RETRY_MAXIMUM_SECONDS = 10.0

_END_WAIT_SECONDS = 1.0
"""After a failed write, how long the reader may take to see the call's end (its status, late answers)."""

_STALE_ROUTE = frozenset({peer_pb2.Outcome.NOT_OWNER, peer_pb2.Outcome.STALE_EPOCH})
"""Refusals that say the directory's route was wrong."""

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass
class ForwarderStats:
    """What the forwarder did since it started (metrics, tests)."""

    sent: int = 0
    batches: int = 0
    """Requests written (each a batch of one subscription's messages)."""
    accepted: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    """Answers False by reason: the owner's refusals (``not_owner``, ...) and ``broken`` (stream ended)."""
    streams_broken: int = 0


class PeerForwarder:
    """Forwards messages to their key's owner; one ``_Link`` per owner address."""

    def __init__(
        self,
        directory: PeerDirectory,
        credentials: PeerCredentials,
        *,
        window: int = WINDOW,
        max_batch_messages: int = MAX_BATCH_MESSAGES,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        retry_initial_seconds: float = _RETRY_INITIAL_SECONDS,
        retry_maximum_seconds: float = _RETRY_MAXIMUM_SECONDS,
    ) -> None:
        if window < 1 or max_batch_messages < 1:
            raise ValueError("window and max_batch_messages must be >= 1")
        self._directory = directory
        self._credentials = credentials
        self._window = window
        self._max_batch_messages = max_batch_messages
        self._max_batch_bytes = max_batch_bytes
        self._max_message_bytes = max_message_bytes
        self._retry = (retry_initial_seconds, retry_maximum_seconds)
        self._links: dict[str, _Link] = {}
        self._closed = False
        self.stats = ForwarderStats()

    def forward(self, subscription: str, shard: int, message: PulledMessage, on_answer: Callable[[bool], None]) -> bool:
        if self._closed:
            return False
        route = self._directory.route(subscription, shard)
        if route is None:
            return False
        link = self._links.get(route.address)
        if link is None:
            link = self._links[route.address] = _Link(self, route.address)
        return link.offer(subscription, shard, route.epoch, message, on_answer)

    def in_flight(self) -> int:
        """Messages taken and not answered yet, over every owner."""
        return sum(len(link.answers) for link in self._links.values())

    async def close(self) -> None:
        """End every stream (their messages are answered False) and close the channels."""
        self._closed = True
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()


class _Link:
    """One owner address: its channel, its stream, the messages taken for it and not answered."""

    def __init__(self, forwarder: PeerForwarder, address: str) -> None:
        self._forwarder = forwarder
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._queue: collections.deque[tuple[str, peer_pb2.ForwardedMessage]] = collections.deque()
        self.answers: dict[int, tuple[str, int, Callable[[bool], None]]] = {}
        """local id -> (subscription, shard, answer), for every message taken (queued or sent) and not answered."""
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._usable_at = 0.0

    def offer(
        self, subscription: str, shard: int, epoch: int, message: PulledMessage, on_answer: Callable[[bool], None]
    ) -> bool:
        forwarder = self._forwarder
        if time.monotonic() < self._usable_at or len(self.answers) >= forwarder._window:
            return False
        size = len(message.data) + sum(len(k) + len(v) for k, v in message.attributes.items())
        if size > forwarder._max_message_bytes - _ENVELOPE_BYTES:
            return False
        local_id = next(self._ids)
        forwarded = peer_pb2.ForwardedMessage(
            local_id=local_id,
            shard=shard,
            epoch=epoch,
            message_id=message.message_id,
            data=message.data,
            attributes=dict(message.attributes),
            ordering_key=message.ordering_key,
            delivery_attempt=getattr(message, "delivery_attempt", None) or 0,
        )
        forwarded.publish_time.FromDatetime(_aware(message.publish_time))
        self._queue.append((subscription, forwarded))
        self.answers[local_id] = (subscription, shard, on_answer)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"peer-forward:{self.address}")
        self._wake.set()
        return True

    async def _run(self) -> None:
        """One stream: send what is queued, read the answers; when it ends, answer the rest False."""
        forwarder = self._forwarder
        if self._channel is None:
            options = [
                *_CHANNEL_OPTIONS,
                ("grpc.max_receive_message_length", forwarder._max_message_bytes),
                ("grpc.max_send_message_length", forwarder._max_message_bytes),
            ]
            self._channel = grpc.aio.insecure_channel(self.address, options=options)
        stub = peer_pb2_grpc.PeerIntakeStub(self._channel)
        call = stub.Forward(metadata=forwarder._credentials.call_metadata())
        reader = asyncio.create_task(self._read(call))
        error: BaseException | None = None
        try:
            while not reader.done():
                if not self._queue:
                    self._wake.clear()
                    waiter = asyncio.ensure_future(self._wake.wait())
                    await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    continue
                for request in self._take_requests():
                    await call.write(request)
                    forwarder.stats.sent += len(request.messages)
                    forwarder.stats.batches += 1
            error = reader.exception()
        except asyncio.CancelledError:
            error = None
            raise
        except Exception as exc:  # the stream failed while writing (grpc's errors, a closed call)
            error = exc
            # The answers already on their way, and the status the call ended with (a write racing the
            # end raises grpc's INTERNAL instead): the reader gets both, if it ends soon.
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(reader), _END_WAIT_SECONDS)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                error = reader.exception()
        finally:
            call.cancel()
            if not reader.done():
                reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            self._broken(error)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        stats = self._forwarder.stats
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            for outcome in response.outcomes:
                taken = self.answers.pop(outcome.local_id, None)
                if taken is None:
                    continue
                subscription, shard, answer = taken
                accepted = outcome.verdict == peer_pb2.Outcome.ACCEPTED
                if accepted:
                    stats.accepted += 1
                    self._failures = 0
                else:
                    stats.refused[peer_pb2.Outcome.Reason.Name(outcome.reason).lower()] += 1
                    if outcome.reason in _STALE_ROUTE:
                        self._forwarder._directory.forget(subscription, shard)
                answer(accepted)

    def _take_requests(self) -> list[peer_pb2.ForwardRequest]:
        """What is queued, as batches of one subscription each within the bounds."""
        forwarder = self._forwarder
        requests: list[peer_pb2.ForwardRequest] = []
        queue = self._queue
        while queue:
            subscription = queue[0][0]
            batch: list[peer_pb2.ForwardedMessage] = []
            size = 0
            while queue and queue[0][0] == subscription and len(batch) < forwarder._max_batch_messages:
                item_size = len(queue[0][1].data)
                if batch and size + item_size > forwarder._max_batch_bytes:
                    break
                batch.append(queue.popleft()[1])
                size += item_size
            requests.append(peer_pb2.ForwardRequest(subscription=subscription, messages=batch))
        return requests

    def _broken(self, error: BaseException | None) -> None:
        """The stream ended: every message unanswered is answered False; the address rests a while."""
        self._queue.clear()
        answers, self.answers = self.answers, {}
        forwarder = self._forwarder
        if error is not None or answers:
            forwarder.stats.streams_broken += 1
            delay = backoff_seconds(self._failures, *forwarder._retry)
            self._failures += 1
            self._usable_at = time.monotonic() + delay
            code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__
            _LOGGER.warning(
                "peer channel to %s ended (%s) with %d messages unanswered: they take the inbox's way; "
                "forwarding there again in %.2fs",
                self.address,
                code if error is not None else "closed",
                len(answers),
                delay,
            )
        forwarder.stats.refused["broken"] += len(answers)
        for subscription, shard in {(sub, shard) for sub, shard, _ in answers.values()}:
            forwarder._directory.forget(subscription, shard)  # the owner may be gone: read it again
        for _, _, answer in answers.values():
            answer(False)

    async def close(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _aware(moment: datetime.datetime) -> datetime.datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.UTC)
