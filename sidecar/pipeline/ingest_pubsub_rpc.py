"""The Pub/Sub subscriber RPCs of the stream intake (``sidecar.pipeline.ingest_stream``), over
``grpc.aio`` with raw protobuf messages, and the batched sender of its acks, nacks and modacks.

- ``PubsubRpc``: the channel (to ``PUBSUB_EMULATOR_HOST`` without credentials, else to Pub/Sub with
  Application Default Credentials through the library's async transport, with the official client's
  channel options), the routing header (``x-goog-request-params: subscription=...``) and
  ``x-goog-api-client`` on every call, unary calls retried on UNAVAILABLE for up to 60 s (0.1 s
  growing x1.3, jittered: the official client's retry of Acknowledge and ModifyAckDeadline), and
  StreamingPull calls.
- ``AckSender``: acks and deadline changes (nacks are a deadline of 0) wait at most 50 ms, or until
  1,000 ids are queued, and go as one Acknowledge or ModifyAckDeadline call per 1,000 ids and
  deadline. They do not depend on any stream: what was queued while a stream was broken is sent
  all the same. A call given up on is logged and counted (``failures``), never raised: an ack not
  taken is a redelivery, which ingest deduplicates, a modack not taken a lease that ends sooner.
- The message classes are the library's generated ones, taken raw (``.pb()``): proto-plus wrappers
  cost several times the raw decoding on the hot path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.api_core import exceptions as api_exceptions
from google.pubsub_v1.services.subscriber.transports.base import DEFAULT_CLIENT_INFO
from google.pubsub_v1.services.subscriber.transports.grpc_asyncio import SubscriberGrpcAsyncIOTransport
from google.pubsub_v1.types import pubsub as _types

_LOGGER = logging.getLogger(__name__)

StreamingPullRequest: Any = _types.StreamingPullRequest.pb()
StreamingPullResponse: Any = _types.StreamingPullResponse.pb()
AcknowledgeRequest: Any = _types.AcknowledgeRequest.pb()
ModifyAckDeadlineRequest: Any = _types.ModifyAckDeadlineRequest.pb()
GetSubscriptionRequest: Any = _types.GetSubscriptionRequest.pb()
Subscription: Any = _types.Subscription.pb()

_SERVICE = "/google.pubsub.v1.Subscriber/"
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 30_000),
)
"""The official client's channel options."""

BATCH_LATENCY_SECONDS = 0.05
"""Acks, nacks and modacks wait at most this long to be sent together. The official client waits
10 ms (``_MAX_BATCH_LATENCY``); here an ack follows a durable write (a fast-path message's follows its
key's checkpoint, half a second on average), so 40 ms more delays nothing the app sees, and a
unary call costs about as much CPU as handling a dozen messages: 50 ms makes 5x fewer calls."""
MAX_IDS_PER_REQUEST = 1000
"""Ack ids per Acknowledge or ModifyAckDeadline call (``_ACK_IDS_BATCH_SIZE``)."""
UNARY_RETRY_SECONDS = 60.0
UNARY_TIMEOUT_SECONDS = 60.0


def default_channel() -> grpc.aio.Channel:
    """The official client's choice of endpoint and credentials, on an asyncio channel."""
    emulator = os.environ.get("PUBSUB_EMULATOR_HOST")
    if emulator:
        return grpc.aio.insecure_channel(emulator, options=CHANNEL_OPTIONS)
    channel: grpc.aio.Channel = SubscriberGrpcAsyncIOTransport.create_channel(options=list(CHANNEL_OPTIONS))
    return channel


def error_of(exc: grpc.aio.AioRpcError) -> api_exceptions.GoogleAPICallError:
    """The api_core exception of a failed call (what ingest reports of a closed pull)."""
    error: api_exceptions.GoogleAPICallError = api_exceptions.from_grpc_error(exc)  # type: ignore[no-untyped-call]
    return error


def refusal(message: str) -> api_exceptions.GoogleAPICallError:
    """A FAILED_PRECONDITION of our own, as Pub/Sub would report one."""
    error: api_exceptions.GoogleAPICallError = api_exceptions.FailedPrecondition(message)  # type: ignore[no-untyped-call]
    return error


class PubsubRpc:
    """One subscription's calls to Pub/Sub's Subscriber service, on one channel."""

    def __init__(
        self,
        subscription_path: str,
        channel_factory: Callable[[], grpc.aio.Channel] = default_channel,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.subscription_path = subscription_path
        self._channel_factory = channel_factory
        self._clock = clock
        client_info: tuple[str, str] = DEFAULT_CLIENT_INFO.to_grpc_metadata()  # type: ignore[no-untyped-call]
        self.metadata = (("x-goog-request-params", f"subscription={subscription_path}"), client_info)
        self._channel: grpc.aio.Channel | None = None
        self._unaries: dict[str, Any] = {}

    @property
    def is_open(self) -> bool:
        return self._channel is not None

    def open(self) -> None:
        if self._channel is None:
            self._channel = self._channel_factory()
            self._unaries.clear()

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    def streaming_pull(self) -> Any:
        """A new StreamingPull call (nothing written yet)."""
        if self._channel is None:
            raise api_exceptions.ServiceUnavailable("StreamingPull: the channel is closed")  # type: ignore[no-untyped-call]
        stream = self._channel.stream_stream(
            _SERVICE + "StreamingPull",
            request_serializer=_serialize,
            response_deserializer=StreamingPullResponse.FromString,
        )
        return stream(metadata=self.metadata)

    async def call(
        self, method: str, request: Any, *, timeout_seconds: float = UNARY_TIMEOUT_SECONDS, retry: bool = True
    ) -> Any:
        """One unary call (raw request, raw response), retried on UNAVAILABLE within
        ``timeout_seconds`` (60 s at most) unless ``retry`` is False; raises the api_core error it
        ended with."""
        if self._channel is None:
            raise api_exceptions.ServiceUnavailable(f"{method}: the channel is closed")  # type: ignore[no-untyped-call]
        unary = self._unaries.get(method)
        if unary is None:
            response_class = Subscription if method == "GetSubscription" else None
            unary = self._unaries[method] = self._channel.unary_unary(
                _SERVICE + method,
                request_serializer=_serialize,
                response_deserializer=response_class.FromString if response_class is not None else _ignore,
            )
        # As api_core's: the timeout bounds the retries too, never more than the retry's 60 s.
        give_up_at = self._clock() + min(UNARY_RETRY_SECONDS, timeout_seconds)
        delay = 0.1
        while True:
            try:
                left = max(0.001, give_up_at - self._clock())
                return await unary(request, timeout=left, metadata=self.metadata)
            except grpc.aio.AioRpcError as exc:
                if not retry or exc.code() != grpc.StatusCode.UNAVAILABLE or self._clock() + delay > give_up_at:
                    raise error_of(exc) from None
            await asyncio.sleep(random.uniform(delay / 2, delay))
            delay = min(60.0, delay * 1.3)


class AckSender:
    """Acks and deadline changes of one subscription, batched (see the module's rules)."""

    def __init__(self, name: str, rpc: PubsubRpc) -> None:
        self._name = name
        self._rpc = rpc
        self._acks: list[str] = []
        self._modacks: dict[int, list[str]] = {}
        self._modack_count = 0
        self._flush_handle: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self.failures = 0
        """Calls given up on (their messages come back: no loss)."""
        self.calls = 0
        """Calls made (for the conformance test and the benchmark's counts)."""

    def ack(self, ack_id: str) -> None:
        self._acks.append(ack_id)
        if len(self._acks) >= MAX_IDS_PER_REQUEST:
            self.flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(BATCH_LATENCY_SECONDS, self.flush)

    def modack(self, ack_ids: list[str], seconds: int) -> None:
        """Set the deadline of ``ack_ids`` to ``seconds`` (0: a nack)."""
        self._modacks.setdefault(seconds, []).extend(ack_ids)
        self._modack_count += len(ack_ids)
        if self._modack_count >= MAX_IDS_PER_REQUEST:
            self.flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(BATCH_LATENCY_SECONDS, self.flush)

    def flush(self) -> None:
        """Send everything queued now."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        acks, self._acks = self._acks, []
        modacks, self._modacks = self._modacks, {}
        self._modack_count = 0
        path = self._rpc.subscription_path
        for start in range(0, len(acks), MAX_IDS_PER_REQUEST):
            chunk = acks[start : start + MAX_IDS_PER_REQUEST]
            self._send("Acknowledge", AcknowledgeRequest(subscription=path, ack_ids=chunk))
        for seconds, ids in modacks.items():
            for start in range(0, len(ids), MAX_IDS_PER_REQUEST):
                chunk = ids[start : start + MAX_IDS_PER_REQUEST]
                request = ModifyAckDeadlineRequest(subscription=path, ack_ids=chunk, ack_deadline_seconds=seconds)
                self._send("ModifyAckDeadline", request)

    async def drain(self, timeout_seconds: float) -> bool:
        """Flush, and wait for every call in flight; False if some did not end in time."""
        self.flush()
        if not self._sending:
            return True
        _done, pending = await asyncio.wait(set(self._sending), timeout=timeout_seconds)
        return not pending

    def _send(self, method: str, request: Any) -> None:
        if not self._rpc.is_open:
            self.failures += 1
            _LOGGER.warning(
                "ingest of %s: %s of %d ids after the channel closed: not sent",
                self._name,
                method,
                len(request.ack_ids),
            )
            return
        self.calls += 1
        task = asyncio.get_running_loop().create_task(self._call(method, request))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _call(self, method: str, request: Any) -> None:
        try:
            await self._rpc.call(method, request)
        except api_exceptions.GoogleAPICallError as exc:
            self.failures += 1
            _LOGGER.warning("ingest of %s: %s of %d ids failed: %s", self._name, method, len(request.ack_ids), exc)


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def _ignore(_data: bytes) -> None:
    return None
