"""A small asyncio client for apps that read the sidecar's ordered stream.

    async with OrderedSubscriber("127.0.0.1:50051", "orders") as sub:
        async for msg in sub:
            handle(msg.key, msg.data)
            await msg.ack()

Rules this module keeps:
- One task reads the stream (``_run``); everything the app sends (acks, nacks) goes through a
  queue that the stream's request iterator drains, so writes never race. Acks queued together are
  merged into one request.
- Each connection is a *generation* (``_Stream``). A delivery id is valid only on the stream that
  delivered it: when a stream ends, the sidecar gives its unacked messages back and redelivers them
  with new delivery ids, so acks and nacks for the old stream's messages are dropped here (``ack()``
  returns False), not sent, and messages of the old stream the app has not picked up yet are
  discarded rather than handed out twice.
- ``msg.ack()`` returns once the ack is queued on the live stream. The sidecar confirms an ack only
  after it is durable; ``await msg.confirmed()`` waits for that confirmation. After a confirmation
  the message is never delivered again; an unconfirmed ack may lead to one redelivery.
- Transient failures (the sidecar restarting, a broken connection, a subscription still
  recovering: UNAVAILABLE and the like, or the server ending the stream) reconnect with exponential
  backoff and jitter. A run of failures is logged as one WARNING line (repeats of the same error go
  to DEBUG) and its end as one INFO line, so a sidecar that is down does not flood the app's log.
  Errors that retrying cannot fix (INVALID_ARGUMENT, NOT_FOUND, ...) stop the subscriber and are
  raised to the app as ``SubscriptionError`` (one line) from the ``async for``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from types import TracebackType

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from pubsub_sidecar_client.errors import ClientError, NotConfirmed, SubscriptionError, is_transient, one_line
from pubsub_sidecar_client.message import Message, _Stream, _to_datetime, _to_duration, _trace_context

_LOGGER = logging.getLogger(__name__)

_DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.max_receive_message_length", 16 * 1024 * 1024),)
"""Pub/Sub messages reach 10 MB and the sidecar sends a large one alone in a response; gRPC's default
receive limit of 4 MiB would reject it."""

_MAX_IDS_PER_ACK = 1000
"""Merged acks stay far below gRPC's 4 MiB default message limit (delivery ids are short strings)."""

_RECENT_CONFIRMATIONS = 10_000
"""How many confirmed delivery ids ``wait_confirmed`` still recognises after the fact."""


class OrderedSubscriber:
    """Reads one subscription's ordered stream from the sidecar; reconnects when it breaks.

    Args:
        target: ``host:port`` or ``unix:///path/to/socket``.
        subscription: the subscription's ``name`` in the sidecar's config.
        max_outstanding_messages: messages delivered and not yet acked or nacked; 0 = server default.
        on_ack_confirmed: called with each confirmed delivery id, on the event loop.
    """

    def __init__(
        self,
        target: str,
        subscription: str,
        *,
        max_outstanding_messages: int = 0,
        on_ack_confirmed: Callable[[str], None] | None = None,
        reconnect_backoff_initial_seconds: float = 0.2,
        reconnect_backoff_max_seconds: float = 10.0,
        close_timeout_seconds: float = 2.0,
        channel_options: tuple[tuple[str, int | str], ...] = (),
    ) -> None:
        if not target:
            raise ValueError("target must be 'host:port' or 'unix:///path', got an empty string")
        if not subscription:
            raise ValueError("subscription must be the subscription's name in the sidecar config, got ''")
        if max_outstanding_messages < 0:
            raise ValueError(f"max_outstanding_messages must be >= 0, got {max_outstanding_messages}")
        if not 0 < reconnect_backoff_initial_seconds <= reconnect_backoff_max_seconds:
            raise ValueError("need 0 < reconnect_backoff_initial_seconds <= reconnect_backoff_max_seconds")
        self.target = target
        self.subscription = subscription
        self.max_outstanding_messages = max_outstanding_messages
        self._on_ack_confirmed = on_ack_confirmed
        self._backoff_initial = reconnect_backoff_initial_seconds
        self._backoff_max = reconnect_backoff_max_seconds
        self._close_timeout = close_timeout_seconds
        self._channel_options = channel_options

        self._stream: _Stream | None = None
        self._generation = 0
        self._ready: deque[Message] = deque()
        self._wakeup = asyncio.Event()
        self._confirmation_queues: list[asyncio.Queue[str | None]] = []
        self._recently_confirmed: OrderedDict[str, None] = OrderedDict()
        self._error: ClientError | None = None
        self._outage: str | None = None
        """Why the last attempts failed, while they keep failing (None once a stream delivers)."""
        self._closing = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        """Set while a stream is open; tests and health checks can wait on it."""
        self.reconnects = 0
        """How many times the subscriber opened a new stream after the first."""

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> OrderedSubscriber:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def start(self) -> None:
        """Start the background task that keeps a stream open (``async with`` does this)."""
        if self._task is not None:
            raise RuntimeError("OrderedSubscriber already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"ordered-subscriber:{self.subscription}")

    async def close(self) -> None:
        """Stop: wait up to ``close_timeout_seconds`` for sent acks to be confirmed, then end the stream.

        Messages delivered and not acked are given back by the sidecar and redelivered later.
        Idempotent.
        """
        if self._closed:
            return
        self._closing = True
        stream = self._stream
        if stream is not None and stream.is_open and self._error is None:
            try:
                await asyncio.wait_for(stream.all_confirmed.wait(), self._close_timeout)
            except TimeoutError:
                _LOGGER.warning(
                    "closing with %d unconfirmed acks; the sidecar may redeliver those messages",
                    len(stream.awaiting_confirmation),
                )
        if self._task is not None:
            self._task.cancel()
            # Collect the task's end without swallowing our own cancellation.
            await asyncio.gather(self._task, return_exceptions=True)
        self._finish()

    @property
    def is_running(self) -> bool:
        """True while the background task keeps (or tries to keep) a stream open."""
        return self._task is not None and not self._task.done()

    def _finish(self) -> None:
        self._closed = True
        if self._stream is not None:
            self._stream.close()
        self.connected.clear()
        self._wakeup.set()
        for queue in self._confirmation_queues:
            queue.put_nowait(None)

    # ---- what the app reads ------------------------------------------------------------------

    def __aiter__(self) -> OrderedSubscriber:
        return self

    async def __anext__(self) -> Message:
        while True:
            while self._ready:
                message = self._ready.popleft()
                # Messages of a stream that ended were given back to the sidecar: skip them.
                if message._stream.is_open:
                    return message
            if self._error is not None:
                raise self._error
            if self._closed or self._closing:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    def ack_confirmations(self) -> AsyncIterator[str]:
        """Yield every delivery id the sidecar confirms from the moment of this call, until the
        subscriber closes.

        Raises SubscriptionError (or ClientError) if the subscriber stops on an error.
        """
        # Register now, not on the first `anext`: a confirmation arriving in between must not be lost.
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._confirmation_queues.append(queue)
        if self._closed:
            queue.put_nowait(None)
        return self._iterate_confirmations(queue)

    async def _iterate_confirmations(self, queue: asyncio.Queue[str | None]) -> AsyncIterator[str]:
        try:
            while True:
                delivery_id = await queue.get()
                if delivery_id is None:
                    break
                yield delivery_id
            if self._error is not None:
                raise self._error
        finally:
            self._confirmation_queues.remove(queue)

    async def wait_confirmed(self, delivery_id: str) -> None:
        """Wait for the confirmation of ``delivery_id`` (see ``Message.confirmed``).

        Raises NotConfirmed for an id this subscriber does not know on its current stream.
        """
        if delivery_id in self._recently_confirmed:
            return
        stream = self._stream
        message = stream.outstanding.get(delivery_id) if stream is not None else None
        if message is None:
            raise NotConfirmed(f"delivery {delivery_id}: unknown on the current stream (earlier stream, or nacked)")
        await message.confirmed()

    # ---- what the app sends ------------------------------------------------------------------

    def _settle(
        self,
        message: Message,
        *,
        ack: bool,
        retry_after: timedelta | float | None = None,
        dead_letter: bool = False,
    ) -> bool:
        request = sidecar_pb2.SubscribeRequest()
        if not ack:
            # Validate before anything changes, so a bad argument leaves the message unsettled.
            duration = _to_duration(retry_after) if retry_after is not None else None
            request.nack.delivery_ids.append(message.delivery_id)
            if duration is not None:
                request.nack.retry_after.CopyFrom(duration)
            request.nack.dead_letter = dead_letter
        else:
            request.ack.delivery_ids.append(message.delivery_id)
        if self._error is not None:
            raise self._error
        stream = message._stream
        if message._settled or not stream.is_open or stream is not self._stream:
            _LOGGER.debug("dropping %s for delivery %s: settled or stream gone", "ack" if ack else "nack", message)
            return False
        message._settled = True
        if ack:
            stream.awaiting_confirmation.add(message.delivery_id)
            stream.all_confirmed.clear()
        else:
            stream.outstanding.pop(message.delivery_id, None)
            message._fail_confirmation("the message was nacked")
        stream.outgoing.put_nowait(request)
        return True

    # ---- the stream --------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        try:
            while not self._closing:
                stream = self._open_generation()
                started = asyncio.get_running_loop().time()
                try:
                    await self._read_stream(stream)
                    _LOGGER.info("sidecar ended the stream of %r; reconnecting", self.subscription)
                except grpc.aio.AioRpcError as exc:
                    code, details = exc.code(), one_line(exc.details() or "")
                    if not is_transient(code):
                        self._error = SubscriptionError(self.subscription, code, details, self.target)
                        _LOGGER.error("%s", self._error)
                        return
                    self._note_outage(f"{code.name}: {details}")
                except Exception as exc:
                    # A bug here must surface in the app's `async for`, not leave it waiting forever.
                    self._error = ClientError(f"subscriber for {self.subscription!r} stopped: {exc!r}")
                    self._error.__cause__ = exc
                    _LOGGER.exception("subscriber for %r stopped", self.subscription)
                    return
                finally:
                    self.connected.clear()
                    stream.close()
                # A stream that worked for a while starts the backoff over; one that fails at once
                # keeps growing it, so a sidecar that is down is not hammered.
                lived = asyncio.get_running_loop().time() - started
                failures = 0 if stream.got_response or lived >= self._backoff_max else failures + 1
                await asyncio.sleep(self._backoff_delay(failures))
        finally:
            if self._error is not None:
                self._finish()

    def _note_outage(self, reason: str) -> None:
        """Log a transient failure: WARNING when an outage starts or its reason changes, else DEBUG.

        A sidecar that is down or still recovering makes every attempt fail the same way; one line
        says so, instead of one per attempt.
        """
        level = logging.DEBUG if reason == self._outage else logging.WARNING
        _LOGGER.log(
            level,
            "sidecar at %s is not serving subscription %r (%s); retrying with backoff",
            self.target,
            self.subscription,
            reason,
        )
        self._outage = reason

    def _backoff_delay(self, failures: int) -> float:
        ceiling = min(self._backoff_max, self._backoff_initial * (1 << min(failures, 30)))
        # "Equal jitter": at least half the ceiling, so reconnects never spin, spread over the rest.
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _open_generation(self) -> _Stream:
        if self._generation:
            self.reconnects += 1
        self._generation += 1
        stream = _Stream(self._generation)
        self._stream = stream
        return stream

    async def _read_stream(self, stream: _Stream) -> None:
        # A channel per stream: gRPC's own channel reconnect backoff (up to 120 s) would otherwise
        # sit on top of ours after a sidecar restart.
        options = [*_DEFAULT_CHANNEL_OPTIONS, *self._channel_options]
        async with grpc.aio.insecure_channel(self.target, options=options) as channel:
            stub = sidecar_pb2_grpc.OrderedDeliveryStub(channel)
            call = stub.Subscribe(self._requests(stream))
            await call.wait_for_connection()
            self.connected.set()
            async for response in call:
                stream.got_response = True
                if self._outage is not None:
                    _LOGGER.info("sidecar at %s serves subscription %r again", self.target, self.subscription)
                    self._outage = None
                self._on_response(stream, response)

    async def _requests(self, stream: _Stream) -> AsyncIterator[sidecar_pb2.SubscribeRequest]:
        yield sidecar_pb2.SubscribeRequest(
            open=sidecar_pb2.Open(
                subscription=self.subscription, max_outstanding_messages=self.max_outstanding_messages
            )
        )
        while True:
            request = await stream.outgoing.get()
            if request is None or not stream.is_open:
                return
            # Merge the acks that queued up meanwhile into one request; nacks keep their own
            # arguments and their place in the order.
            while request.HasField("ack") and not stream.outgoing.empty():
                following = stream.outgoing.get_nowait()
                if (
                    following is not None
                    and following.HasField("ack")
                    and len(request.ack.delivery_ids) < _MAX_IDS_PER_ACK
                ):
                    request.ack.delivery_ids.extend(following.ack.delivery_ids)
                    continue
                yield request
                if following is None:
                    return
                request = following
            yield request

    def _on_response(self, stream: _Stream, response: sidecar_pb2.SubscribeResponse) -> None:
        for proto in response.messages:
            message = Message(
                delivery_id=proto.delivery_id,
                key=proto.key,
                message_id=proto.message_id,
                dedup_id=proto.dedup_id,
                data=proto.data,
                attributes=dict(proto.attributes),
                publish_time=_to_datetime(proto, "publish_time"),
                sequence=proto.sequence,
                event_time=_to_datetime(proto, "event_time"),
                delivery_attempt=proto.delivery_attempt,
                late=proto.late,
                skipped=tuple((r.first, r.last) for r in proto.skipped),
                epoch=proto.epoch,
                replayed=proto.replayed,
                trace_context=_trace_context(proto),
                _subscriber=self,
                _stream=stream,
            )
            stream.outstanding[message.delivery_id] = message
            self._ready.append(message)
        if response.messages:
            self._wakeup.set()
        for delivery_id in response.ack_confirmations:
            self._on_confirmation(stream, delivery_id)

    def _on_confirmation(self, stream: _Stream, delivery_id: str) -> None:
        message = stream.outstanding.pop(delivery_id, None)
        stream.awaiting_confirmation.discard(delivery_id)
        if not stream.awaiting_confirmation:
            stream.all_confirmed.set()
        if message is not None:
            message._mark_confirmed()
        self._recently_confirmed[delivery_id] = None
        if len(self._recently_confirmed) > _RECENT_CONFIRMATIONS:
            self._recently_confirmed.popitem(last=False)
        for queue in self._confirmation_queues:
            queue.put_nowait(delivery_id)
        if self._on_ack_confirmed is not None:
            try:
                self._on_ack_confirmed(delivery_id)
            except Exception:
                # The app's callback must not kill the stream that feeds it.
                _LOGGER.exception("on_ack_confirmed callback failed for %s", delivery_id)
