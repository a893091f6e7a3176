"""The stream intake: one subscription's StreamingPull over ``grpc.aio``, on the event loop, with raw
protobuf messages. It replaces the official subscriber's streaming pull manager (its 20-odd threads,
a ``Future``, ``Message`` and lock per message, proto-plus wrappers), keeping what the sidecar relies
on from it; ``sidecar.pipeline.ingest_pull`` (the official client, ``intake: client``) is the other
intake, and ``tests/pipeline/test_intake_conformance.py`` runs one fault script against both.

What it does, each rule the official client's (google-cloud-pubsub 2.x, read in its
``streaming_pull_manager.py``, ``leaser.py``, ``dispatcher.py``, ``heartbeater.py``; docs/ingest.md):

- **The stream.** The first request names the subscription, a client id kept across reconnects,
  the stream ack deadline and the flow-control limits; the call carries the routing header
  (``x-goog-request-params: subscription=...``) and the client's ``x-goog-api-client``. A heartbeat
  (an empty request, or the new stream ack deadline) every 30 s keeps idle streams open.
- **Leases** (``sidecar.pipeline.ingest_leases``): every message received is modacked at once to the
  current deadline (the receipt modack), extended every 10 ms to 0.9 deadlines (at random) while
  held, and dropped after ``max_lease_duration``. Acks, nacks (modack 0) and modacks go as unary
  calls, batched for up to 50 ms (the official client: 10 ms) or 1,000 ids, retried on UNAVAILABLE
  for up to 60 s: nothing depends on the stream being up, so acks buffered while it is broken are
  sent all the same.
- **Flow control on this side.** Messages past ``max_outstanding_*`` are held back, leased, and
  handed over as acks free room; the stream is not read while the load is 1 or more, and is read
  again below 0.8.
- **Reconnection.** A stream that ends with a retryable code (ABORTED, DEADLINE_EXCEEDED,
  INTERNAL, RESOURCE_EXHAUSTED, SERVICE_UNAVAILABLE, UNKNOWN, GATEWAY_TIMEOUT), or with OK, is opened
  again: at most 5 opens in 10 s, and after opens that got nothing a backoff from 0.1 s growing to
  60 s. Any other code closes the pull for good (``done`` fails with the Pub/Sub error); ingest
  reports it and opens a new pull after its own backoff. Every attempt is reported to ``PullHealth``.
- **Ordering.** On a subscription with message ordering, a key's next message is handed over only
  once the previous one was acked or nacked.
- **Exactly-once subscriptions are refused.** Such a subscription makes the acks' results part of
  the contract; this intake does not read them, so the pull is closed with FAILED_PRECONDITION
  naming ``intake: client``, which does.
- **Shutdown.** The stream is cancelled, what was held back is nacked, and the queued acks and nacks
  are flushed before ``shut_down`` returns; what ingest still holds it gives back with ``nack_ids``.

The callback runs on the loop, at most ``_MAX_CALLBACKS_PER_TURN`` messages per turn, so that a
full response does not keep delivery streams waiting. The calls themselves, the raw message classes
and the batching of acks are ``sidecar.pipeline.ingest_pubsub_rpc``'s (the one module of this intake
that imports the Pub/Sub library).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.api_core import exceptions as api_exceptions

from sidecar.backoff import backoff_seconds
from sidecar.config.model import FlowControlConfig
from sidecar.pipeline import ingest_pubsub_rpc as rpc
from sidecar.pipeline.ingest_leases import RESUME_THRESHOLD, LeaseBook
from sidecar.pipeline.ingest_stream_message import FlowLimits, IntakeMessage
from sidecar.pipeline.pull_health import PullHealth, report_closed

_LOGGER = logging.getLogger(__name__)

RETRYABLE_STREAM_CODES = frozenset(
    {
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.OK,
    }
)
"""Codes a stream that ends with is opened again (the official ``_RETRYABLE_STREAM_ERRORS``; a
GATEWAY_TIMEOUT reaches gRPC as UNAVAILABLE). OK: Pub/Sub ends long-lived streams now and then."""

HEARTBEAT_SECONDS = 30.0
_DEFAULT_STREAM_ACK_DEADLINE_SECONDS = 60
_LEASE_LOOP_MIN_SECONDS = 0.01
"""The lease loop sleeps 0.01-0.9 x deadline seconds, at random (the official leaser's snooze)."""
_REOPEN_LIMIT = 5
_REOPEN_WINDOW_SECONDS = 10.0
"""At most 5 opens in 10 s (the official client's reopen throttle)."""
_OPEN_BACKOFF_INITIAL_SECONDS = 0.1
_OPEN_BACKOFF_MAXIMUM_SECONDS = 60.0
"""After opens that got nothing (the official client's retry of StreamingPull: 0.1 s to 60 s)."""
_SHUTDOWN_SECONDS = 10.0
_MAX_CALLBACKS_PER_TURN = 200
"""Messages handed over per turn of the loop: a response of 1,000 is split so that delivery
streams are served every few milliseconds."""


class StreamIntake:
    """One subscription's streaming pull on the event loop (see the module's rules)."""

    def __init__(
        self,
        name: str,
        subscription_path: str,
        flow: FlowControlConfig,
        health: PullHealth,
        *,
        max_lease_duration_seconds: float,
        channel_factory: Callable[[], grpc.aio.Channel] = rpc.default_channel,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.subscription_path = subscription_path
        self._health = health
        self._heartbeat_seconds = heartbeat_seconds
        self._clock = clock
        extension = (flow.max_lease_extension_ms or 0) // 1000
        self.flow_control = FlowLimits(flow.max_outstanding_messages, flow.max_outstanding_bytes, extension)
        self.leases = LeaseBook(
            max_messages=flow.max_outstanding_messages,
            max_bytes=flow.max_outstanding_bytes,
            max_lease_seconds=max_lease_duration_seconds,
            max_extension_seconds=extension,
        )
        self.client_id = str(uuid.uuid4())
        """Kept across reconnects (Pub/Sub uses it to keep a client's flow control across streams)."""
        self.rpc = rpc.PubsubRpc(subscription_path, channel_factory, clock=clock)
        self.sender = rpc.AckSender(name, self.rpc)
        self._callback: Callable[[IntakeMessage], None] | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._upkeep: list[asyncio.Task[None]] = []
        """The lease and heartbeat loops: from the first ``subscribe`` to ``shut_down``/``cancel``."""
        self.done: asyncio.Future[None] | None = None
        """The current pull; fails with the Pub/Sub error that closed it for good (or our callback's),
        ends cancelled after ``cancel()`` or ``shut_down()``."""
        self._on_hold: collections.deque[IntakeMessage] = collections.deque()
        self._on_hold_bytes = 0
        self._key_waiting: dict[str, collections.deque[IntakeMessage]] = {}
        """Ordering keys with a message handed over and not settled: their next messages, in order."""
        self._ordered = False
        self._readable = asyncio.Event()
        self._readable.set()
        self._stream_deadline = self._stream_deadline_now()
        self._opens: collections.deque[float] = collections.deque()
        self._call: Any = None
        self._shut_down = False
        self.runs = 0
        """Responses handed over (one loop turn or more each)."""

    # ---- what ingest sees ------------------------------------------------------------------

    @property
    def is_opened(self) -> bool:
        return self.done is not None

    @property
    def handoff_runs(self) -> int:
        return self.runs

    @property
    def handoff_buffered(self) -> int:
        """Received, not handed over yet: held back by flow control or behind their ordering key."""
        return len(self._on_hold) + sum(len(q) for q in self._key_waiting.values())

    @property
    def can_give_back(self) -> bool:
        return self.rpc.is_open

    def make_client(self) -> None:
        self.rpc.open()

    def subscribe(self, loop: asyncio.AbstractEventLoop, callback: Callable[[IntakeMessage], None]) -> None:
        """Open a streaming pull (at start, and again after one was closed for good)."""
        assert self.rpc.is_open, "make_client() first"
        self._callback = callback
        self._shut_down = False
        self.done = loop.create_future()
        self._run_task = loop.create_task(self._run(self.done), name=f"intake:{self.name}")
        if not self._upkeep:
            self._upkeep = [
                loop.create_task(self._maintain_leases(), name=f"intake:{self.name}:leases"),
                loop.create_task(self._heartbeat(), name=f"intake:{self.name}:heartbeat"),
            ]

    def report_closed(self, error: api_exceptions.GoogleAPICallError) -> float:
        return report_closed(self._health, self.subscription_path, self.name, error)

    def cancel(self) -> None:
        """Stop the pull without waiting."""
        self._stop_tasks()
        if self.done is not None and not self.done.done():
            self.done.cancel()

    async def shut_down(self) -> bool:
        """Stop reading, nack what was held back, flush acks and nacks; False if not within 10 s."""
        if self.done is None:
            return True
        self._shut_down = True
        self.cancel()
        held = [*self._on_hold, *(m for q in self._key_waiting.values() for m in q)]
        self._on_hold.clear()
        self._on_hold_bytes = 0
        self._key_waiting.clear()
        for message in held:
            self.settle(message, acked=False)
        return await self.sender.drain(_SHUTDOWN_SECONDS)

    async def nack_ids(self, ack_ids: list[str]) -> None:
        """Nack ``ack_ids`` now, with one ModifyAckDeadline call (``Settlement.give_back``)."""
        request = rpc.ModifyAckDeadlineRequest(
            subscription=self.subscription_path, ack_ids=ack_ids, ack_deadline_seconds=0
        )
        await self.rpc.call("ModifyAckDeadline", request, timeout_seconds=_SHUTDOWN_SECONDS)

    async def close_client(self) -> list[BaseException]:
        try:
            await self.rpc.close()
        except Exception as exc:
            return [exc]
        return []

    async def ping(self, timeout_seconds: float) -> bool:
        """True if Pub/Sub answers for this subscription now (GetSubscription)."""
        if not self.rpc.is_open:
            return False
        request = rpc.GetSubscriptionRequest(subscription=self.subscription_path)
        try:
            await self.rpc.call("GetSubscription", request, timeout_seconds=timeout_seconds, retry=False)
        except api_exceptions.GoogleAPICallError as exc:
            _LOGGER.warning("ingest of %s: Pub/Sub ping failed: %s", self.name, exc)
            return False
        return True

    # ---- settling ----------------------------------------------------------------------------

    def settle(self, message: IntakeMessage, *, acked: bool) -> None:
        """An ack or a nack of ``message``. Sent even when its lease was dropped meanwhile: Pub/Sub
        takes an ack of an ack id still valid, and ignores one that is not."""
        self.leases.release(message.ack_id, self._clock(), acked=acked)
        if acked:
            self.sender.ack(message.ack_id)
        else:
            self.sender.modack([message.ack_id], 0)
        if self._ordered and message.ordering_key:
            self._next_of_key(message.ordering_key)
        if self._on_hold or not self._readable.is_set():
            self._release_held()

    # ---- receiving ---------------------------------------------------------------------------

    async def _run(self, done: asyncio.Future[None]) -> None:
        failed_opens = 0
        try:
            while True:
                await self._throttle(failed_opens)
                got, error = await self._one_stream()
                failed_opens = 0 if got else failed_opens + 1
                if error is not None:
                    if not done.done():
                        done.set_exception(error)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: ingest fails loudly with it
            _LOGGER.exception("ingest of %s: the stream intake failed", self.name)
            if not done.done():
                done.set_exception(exc)

    async def _throttle(self, failed_opens: int) -> None:
        now = self._clock()
        while self._opens and self._opens[0] <= now - _REOPEN_WINDOW_SECONDS:
            self._opens.popleft()
        wait = 0.0
        if len(self._opens) >= _REOPEN_LIMIT:
            wait = self._opens[0] + _REOPEN_WINDOW_SECONDS - now
        if failed_opens:
            backoff = backoff_seconds(failed_opens - 1, _OPEN_BACKOFF_INITIAL_SECONDS, _OPEN_BACKOFF_MAXIMUM_SECONDS)
            wait = max(wait, backoff)
        if wait > 0:
            await asyncio.sleep(wait)
        self._opens.append(self._clock())

    async def _one_stream(self) -> tuple[bool, BaseException | None]:
        """Read one stream to its end: (whether it gave anything, the error that closes the pull
        for good, or None to open another)."""
        attempt = self._health.attempt_started()
        call = self.rpc.streaming_pull()
        self._call = call
        got = False
        try:
            self._stream_deadline = self._stream_deadline_now()
            first = rpc.StreamingPullRequest(
                subscription=self.subscription_path,
                client_id=self.client_id,
                stream_ack_deadline_seconds=self._stream_deadline,
                max_outstanding_messages=self.leases.max_messages,
                max_outstanding_bytes=self.leases.max_bytes,
            )
            # Not awaited before reading: a refusal at the start of the call (a quota, a missing
            # permission) would fail the write first, and grpc's aio client then sets the call's
            # status to INTERNAL "Internal error from Core" itself, over the server's. Read first,
            # the reader mostly gets the server's status (grpc can still fail the write first).
            asyncio.ensure_future(call.write(first)).add_done_callback(_retrieved)
            while True:
                if not self._readable.is_set():
                    await self._readable.wait()
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                got = True
                refused = self._check_properties(response)
                if refused is not None:
                    call.cancel()
                    self._health.attempt_ended(attempt, "FAILED_PRECONDITION", refused.message or "")
                    return got, refused
                await self._on_response(response)
        except asyncio.CancelledError:
            call.cancel()
            self._health.attempt_ended(attempt, "CANCELLED", "")
            raise
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            self._health.attempt_ended(attempt, code.name, exc.details() or "")
            return got, None if code in RETRYABLE_STREAM_CODES else rpc.error_of(exc)
        finally:
            self._call = None
        code = await call.code()
        self._health.attempt_ended(attempt, code.name, (await call.details()) or "")
        return got, None

    def _check_properties(self, response: Any) -> api_exceptions.GoogleAPICallError | None:
        properties = response.subscription_properties
        if properties.exactly_once_delivery_enabled:
            return rpc.refusal(
                f"subscription {self.subscription_path} has exactly-once delivery: the stream intake does not "
                f"read ack results; set intake: client for subscription {self.name!r}"
            )
        self._ordered = properties.message_ordering_enabled
        return None

    async def _on_response(self, response: Any) -> None:
        received = response.received_messages
        if not received:
            return
        self.runs += 1
        now = self._clock()
        leases = self.leases
        hold = self._on_hold
        ack_ids = []
        for item in received:
            message = IntakeMessage(self, item)
            leases.add(message.ack_id, message.size, now)
            ack_ids.append(message.ack_id)
            hold.append(message)
            self._on_hold_bytes += message.size
        self.sender.modack(ack_ids, leases.deadline())  # the receipt modack
        for _turn in range(len(hold)):
            if not self._release_held(_MAX_CALLBACKS_PER_TURN):
                break
            await asyncio.sleep(0)

    def _release_held(self, limit: int = _MAX_CALLBACKS_PER_TURN) -> bool:
        """Hand held-back messages over while the load allows, up to ``limit``; True if more could
        go now (the caller yields a turn first). Pauses or resumes reading by the load."""
        hold = self._on_hold
        leases = self.leases
        handed = 0
        while hold and handed < limit and leases.has_room(len(hold), self._on_hold_bytes):
            message = hold.popleft()
            self._on_hold_bytes -= message.size
            if message.ack_id not in leases:
                continue  # dropped meanwhile (held past max_lease_duration)
            key = message.ordering_key
            if self._ordered and key:
                waiting = self._key_waiting.get(key)
                if waiting is not None:
                    waiting.append(message)
                    continue
                self._key_waiting[key] = collections.deque()
            handed += 1
            self._hand_over(message)
        load = leases.load(len(hold), self._on_hold_bytes)
        if hold or load >= 1.0:
            self._readable.clear()
        elif load < RESUME_THRESHOLD:
            self._readable.set()
        return bool(hold) and handed >= limit

    def _next_of_key(self, key: str) -> None:
        waiting = self._key_waiting.get(key)
        if waiting is None:
            return
        while waiting:
            message = waiting.popleft()
            if message.ack_id in self.leases:
                self._hand_over(message)
                return
        del self._key_waiting[key]

    def _hand_over(self, message: IntakeMessage) -> None:
        callback = self._callback
        if callback is None or self._shut_down:
            self.settle(message, acked=False)
            return
        try:
            callback(message)
        except Exception as exc:
            # The official client's rule: the message is nacked and the pull fails with the error.
            _LOGGER.exception("ingest of %s: the callback failed on message %s", self.name, message.message_id)
            self.settle(message, acked=False)
            if self.done is not None and not self.done.done():
                self.done.set_exception(exc)

    # ---- leases and heartbeats ------------------------------------------------------------

    async def _maintain_leases(self) -> None:
        while True:
            deadline = self.leases.deadline()
            extend, dropped = self.leases.due(self._clock())
            if dropped:
                _LOGGER.warning("ingest of %s: dropping %d messages leased too long", self.name, len(dropped))
            if extend:
                self.sender.modack(extend, deadline)
                self.sender.flush()
            if self._on_hold or not self._readable.is_set():
                self._release_held()
            await asyncio.sleep(random.uniform(_LEASE_LOOP_MIN_SECONDS, deadline * 0.9))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_seconds)
            call = self._call
            if call is None:
                continue
            deadline = self._stream_deadline_now()
            request = rpc.StreamingPullRequest()
            if deadline != self._stream_deadline:
                request.stream_ack_deadline_seconds = self._stream_deadline = deadline
            try:
                await call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
                pass  # the stream is ending: its reader reports why and opens the next one

    def _stream_deadline_now(self) -> int:
        """The stream's ack deadline, Pub/Sub's lease on what it sends until our receipt modack: the
        cap when one is set, else 60 s or the current lease extension if longer (the official
        client's ``_stream_ack_deadline``)."""
        if self.leases.max_extension_seconds:
            return self.leases.deadline()
        return max(_DEFAULT_STREAM_ACK_DEADLINE_SECONDS, self.leases.deadline())

    def _stop_tasks(self) -> None:
        if self._run_task is not None:
            self._run_task.cancel()
        for task in self._upkeep:
            task.cancel()
        self._upkeep = []
        if self._call is not None:
            self._call.cancel()


def _retrieved(task: asyncio.Future[None]) -> None:
    """The first request's write: its failure is the call's, which the reader reports."""
    if not task.cancelled():
        task.exception()
