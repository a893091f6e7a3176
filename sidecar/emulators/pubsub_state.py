"""The Pub/Sub emulator's broker: topics, subscriptions, messages, leases and their timers.

This module knows nothing of gRPC transport; it holds raw protobuf messages handed to it by
``pubsub.py`` and only reads or copies them. It runs on one asyncio loop and is not thread-safe.

Invariants:
- A published message is copied (by reference: messages are read-only once published) into every
  subscription attached to the topic at publish time; with none, it is dropped.
- Per subscription every unacked message (a :class:`Pending`) is in exactly one place: the
  ``available`` queue, leased (one :class:`Lease` with a fresh ack id per delivery), or waiting in
  the timer heap for a delayed release (retry backoff or the "delay deliveries" fault).
- ``unacked`` holds every unacked message in publish order, so its first entry is the oldest:
  that is what Cloud Monitoring's ``oldest_unacked_message_age`` reads.
- A lease ends exactly once: ack (message gone), nack/modack 0 or expiry (message available again,
  or forwarded to the dead-letter topic once ``max_delivery_attempts`` deliveries were made).
  Stale ack ids (of an ended lease) are accepted and ignored, as production does.
- Expiry and delayed releases share one heap ordered by loop time, served by a single timer
  handle; superseded heap entries are skipped when they come due, so a modack costs O(log n).
- A stream's flow-control budget counts its live leases; ending a lease frees it and wakes the
  stream. A stream always gets at least one message when it has none outstanding.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

_LOGGER = logging.getLogger(__name__)

MIN_ACK_DEADLINE_SECONDS = 10
MAX_ACK_DEADLINE_SECONDS = 600
DEFAULT_MAX_DELIVERY_ATTEMPTS = 5
"""Production's value when a dead-letter policy leaves ``max_delivery_attempts`` at 0."""
MAX_RESPONSE_BYTES = 3 * 1024 * 1024 + 512 * 1024
"""Stay below the 4 MiB receive limit of the client's emulator channel, with room for framing."""
MAX_MESSAGES_PER_RESPONSE = 1000
"""Bounds one StreamingPull/Pull response so a large backlog is spread over several writes."""

_LEASE = 0
_RELEASE = 1


class PubsubError(Exception):
    """A request the real service would refuse, with its status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, eq=False)
class Pending:
    """One message in one subscription, from publish until ack or dead-lettering."""

    seq: int
    message: Any
    """The raw ``google.pubsub.v1.PubsubMessage``, shared by all subscriptions, never mutated."""
    publish_time_ns: int
    size: int
    attempts: int = 0
    """Deliveries so far: 1 + nacks + expiries once delivered (``delivery_attempt``)."""


@dataclass(slots=True, eq=False)
class Lease:
    """One delivery of a message; its ack id is never reused."""

    ack_id: str
    subscription: Subscription
    pending: Pending
    deadline: float
    stream: StreamState | None
    active: bool = True
    extensions: int = 0
    """Deadline changes (modacks > 0) since delivery, for the admin API's lease report."""


@dataclass(slots=True, eq=False)
class StreamState:
    """Flow control and control flags of one open StreamingPull stream."""

    subscription: Subscription
    deadline_seconds: int
    max_messages: int
    max_bytes: int
    outstanding_messages: int = 0
    outstanding_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    break_code: grpc.StatusCode | None = None
    break_message: str = ""

    def can_take(self, size: int) -> bool:
        if self.outstanding_messages == 0:
            return True  # always allow one message, whatever its size
        if 0 < self.max_messages <= self.outstanding_messages:
            return False
        return not (self.max_bytes > 0 and self.outstanding_bytes + size > self.max_bytes)

    def end(self, code: grpc.StatusCode, message: str) -> None:
        if self.break_code is None:
            self.break_code = code
            self.break_message = message
        self.wake.set()


@dataclass(slots=True, eq=False)
class Subscription:
    """A subscription's configuration (raw ``Subscription`` proto) and its message state."""

    config: Any
    unacked: dict[int, Pending] = field(default_factory=dict)
    available: deque[Pending] = field(default_factory=deque)
    leases: dict[str, Lease] = field(default_factory=dict)
    streams: set[StreamState] = field(default_factory=set)
    pull_wake: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: bool = False

    @property
    def name(self) -> str:
        return str(self.config.name)

    @property
    def ack_deadline_seconds(self) -> int:
        return int(self.config.ack_deadline_seconds) or MIN_ACK_DEADLINE_SECONDS

    @property
    def max_delivery_attempts(self) -> int:
        """0 without a dead-letter policy (then ``delivery_attempt`` is not reported)."""
        if not self.config.HasField("dead_letter_policy") or not self.config.dead_letter_policy.dead_letter_topic:
            return 0
        return int(self.config.dead_letter_policy.max_delivery_attempts) or DEFAULT_MAX_DELIVERY_ATTEMPTS

    @property
    def retry_backoff_seconds(self) -> float:
        if not self.config.HasField("retry_policy"):
            return 0.0
        backoff = self.config.retry_policy.minimum_backoff
        seconds: float = backoff.seconds + backoff.nanos / 1e9
        return seconds

    def notify(self) -> None:
        for stream in self.streams:
            stream.wake.set()
        self.pull_wake.set()


@dataclass(frozen=True, slots=True)
class Backlog:
    """What Cloud Monitoring reports for one subscription with unacked messages."""

    oldest_publish_time_ns: int
    num_undelivered: int


class Broker:
    """Topics and subscriptions of the emulator, and message delivery between them."""

    def __init__(self, wall_clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._wall_clock_ns = wall_clock_ns
        self.topics: dict[str, Any] = {}
        self.subscriptions: dict[str, Subscription] = {}
        self._topic_subs: dict[str, set[str]] = {}
        self._seq = itertools.count(1)
        self._ack_seq = itertools.count(1)
        self._message_ids = itertools.count(1)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self.delivery_delay_seconds: dict[str, float] = {}
        """Fault: subscription name (or "*") -> seconds every new message waits before it is deliverable."""

    # -- topics and subscriptions ------------------------------------------------------------

    def add_topic(self, config: Any) -> None:
        if config.name in self.topics:
            raise PubsubError(grpc.StatusCode.ALREADY_EXISTS, f"Topic already exists: {config.name}")
        self.topics[config.name] = config
        self._topic_subs.setdefault(config.name, set())

    def topic(self, name: str) -> Any:
        try:
            return self.topics[name]
        except KeyError:
            raise PubsubError(grpc.StatusCode.NOT_FOUND, f"Topic not found: {name}") from None

    def delete_topic(self, name: str, deleted_marker: str) -> None:
        self.topic(name)
        del self.topics[name]
        # Production keeps the subscriptions and reports their topic as deleted.
        for sub_name in self._topic_subs.pop(name, set()):
            self.subscriptions[sub_name].config.topic = deleted_marker

    def topic_subscriptions(self, name: str) -> list[str]:
        self.topic(name)
        return sorted(self._topic_subs.get(name, ()))

    def add_subscription(self, config: Any) -> Subscription:
        if config.name in self.subscriptions:
            raise PubsubError(grpc.StatusCode.ALREADY_EXISTS, f"Subscription already exists: {config.name}")
        self.topic(config.topic)
        sub = Subscription(config=config)
        self.subscriptions[config.name] = sub
        self._topic_subs[config.topic].add(config.name)
        return sub

    def subscription(self, name: str) -> Subscription:
        try:
            return self.subscriptions[name]
        except KeyError:
            raise PubsubError(grpc.StatusCode.NOT_FOUND, f"Subscription does not exist: {name}") from None

    def delete_subscription(self, name: str) -> None:
        sub = self.subscription(name)
        del self.subscriptions[name]
        self._topic_subs.get(sub.config.topic, set()).discard(name)
        sub.deleted = True
        for lease in sub.leases.values():
            lease.active = False
        sub.leases.clear()
        sub.unacked.clear()
        sub.available.clear()
        for stream in list(sub.streams):
            stream.end(grpc.StatusCode.NOT_FOUND, f"Subscription does not exist: {name}")
        sub.pull_wake.set()

    # -- publishing ----------------------------------------------------------------------------

    def publish(self, topic_name: str, messages: Iterable[Any]) -> list[str]:
        """Assign ids and publish time to ``messages`` (mutated in place) and fan them out."""
        self.topic(topic_name)
        subs = [self.subscriptions[n] for n in self._topic_subs.get(topic_name, ())]
        now_ns = self._wall_clock_ns()
        seconds, nanos = divmod(now_ns, 1_000_000_000)
        ids: list[str] = []
        for message in messages:
            message_id = str(next(self._message_ids))
            message.message_id = message_id
            message.publish_time.seconds = seconds
            message.publish_time.nanos = nanos
            ids.append(message_id)
            if subs:
                size = message.ByteSize()
                for sub in subs:
                    self._enqueue(sub, Pending(next(self._seq), message, now_ns, size))
        for sub in subs:
            sub.notify()
        return ids

    def _enqueue(self, sub: Subscription, pending: Pending) -> None:
        sub.unacked[pending.seq] = pending
        delay = self.delivery_delay_seconds.get(sub.name, self.delivery_delay_seconds.get("*", 0.0))
        if delay > 0:
            self._push(self._now() + delay, _RELEASE, (sub, pending))
        else:
            sub.available.append(pending)

    # -- delivery --------------------------------------------------------------------------------

    def open_stream(self, sub: Subscription, deadline_seconds: int, max_messages: int, max_bytes: int) -> StreamState:
        stream = StreamState(sub, deadline_seconds, max_messages, max_bytes)
        sub.streams.add(stream)
        return stream

    def close_stream(self, stream: StreamState) -> None:
        # Leases of a closed stream stay valid (the client acks through unary calls) until they expire.
        stream.closed = True
        stream.subscription.streams.discard(stream)

    def break_streams(self, code: grpc.StatusCode, message: str) -> int:
        streams = [s for sub in self.subscriptions.values() for s in sub.streams]
        for stream in streams:
            stream.end(code, message)
        return len(streams)

    def take(self, sub: Subscription, stream: StreamState | None, max_messages: int) -> list[Lease]:
        """Lease available messages to ``stream`` (None: a unary Pull) within its budget and one response."""
        if sub.deleted or not sub.available:
            return []
        deadline_seconds = stream.deadline_seconds if stream is not None else sub.ack_deadline_seconds
        deadline = self._now() + deadline_seconds
        limit = min(max_messages, MAX_MESSAGES_PER_RESPONSE)
        leases: list[Lease] = []
        response_bytes = 0
        available = sub.available
        while available and len(leases) < limit:
            pending = available[0]
            if leases and response_bytes + pending.size > MAX_RESPONSE_BYTES:
                break
            if stream is not None:
                if not stream.can_take(pending.size):
                    break
                stream.outstanding_messages += 1
                stream.outstanding_bytes += pending.size
            available.popleft()
            response_bytes += pending.size + 64
            pending.attempts += 1
            lease = Lease(f"{next(self._ack_seq):x}-{pending.seq:x}", sub, pending, deadline, stream)
            sub.leases[lease.ack_id] = lease
            leases.append(lease)
        for lease in leases:
            self._push(deadline, _LEASE, lease)
        return leases

    def acknowledge(self, sub: Subscription, ack_ids: Iterable[str]) -> None:
        for ack_id in ack_ids:
            lease = sub.leases.pop(ack_id, None)
            if lease is None:
                continue  # stale or unknown: production ignores it
            self._end_lease(lease)
            sub.unacked.pop(lease.pending.seq, None)

    def modify_deadline(self, sub: Subscription, ack_ids: Iterable[str], seconds: int) -> None:
        if seconds == 0:
            for ack_id in ack_ids:
                lease = sub.leases.pop(ack_id, None)
                if lease is not None:
                    self._end_lease(lease)
                    self._redeliver(sub, lease.pending)
            return
        deadline = self._now() + seconds
        for ack_id in ack_ids:
            lease = sub.leases.get(ack_id)
            if lease is not None:
                # Shorter or longer alike: the new deadline counts from now, as production does.
                lease.deadline = deadline
                lease.extensions += 1
                self._push(deadline, _LEASE, lease)

    def lease_report(self, sub: Subscription) -> list[dict[str, Any]]:
        """The subscription's live leases: message id, attempt, seconds left and modacks so far."""
        now = self._now()
        return [
            {
                "ack_id": lease.ack_id,
                "message_id": lease.pending.message.message_id,
                "delivery_attempt": lease.pending.attempts,
                "seconds_left": round(lease.deadline - now, 3),
                "extensions": lease.extensions,
            }
            for lease in sub.leases.values()
        ]

    def _end_lease(self, lease: Lease) -> None:
        lease.active = False
        stream = lease.stream
        if stream is not None and not stream.closed:
            stream.outstanding_messages -= 1
            stream.outstanding_bytes -= lease.pending.size
            stream.wake.set()

    def _redeliver(self, sub: Subscription, pending: Pending) -> None:
        """After a nack or an expiry: dead-letter after the last attempt, else make it available again."""
        max_attempts = sub.max_delivery_attempts
        if max_attempts and pending.attempts >= max_attempts:
            sub.unacked.pop(pending.seq, None)
            self._dead_letter(sub, pending)
            return
        backoff = sub.retry_backoff_seconds
        if backoff > 0:
            self._push(self._now() + backoff, _RELEASE, (sub, pending))
            return
        sub.available.append(pending)
        sub.notify()

    def _dead_letter(self, sub: Subscription, pending: Pending) -> None:
        topic_name = sub.config.dead_letter_policy.dead_letter_topic
        if topic_name not in self.topics:
            # Production keeps retrying delivery when the dead-letter topic is gone; here it is dropped.
            _LOGGER.warning("dead-letter topic %s of %s does not exist; message dropped", topic_name, sub.name)
            return
        forwarded = type(pending.message)()
        forwarded.data = pending.message.data
        forwarded.ordering_key = pending.message.ordering_key
        forwarded.attributes.update(pending.message.attributes)
        project = sub.name.split("/")[1]
        publish_time = pending.message.publish_time
        forwarded.attributes.update(
            {
                "CloudPubSubDeadLetterSourceDeliveryCount": str(pending.attempts),
                "CloudPubSubDeadLetterSourceSubscription": sub.name.rsplit("/", 1)[-1],
                "CloudPubSubDeadLetterSourceSubscriptionProject": project,
                "CloudPubSubDeadLetterSourceTopicPublishTime": publish_time.ToJsonString(),
            }
        )
        self.publish(topic_name, [forwarded])

    # -- timers ------------------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _push(self, when: float, kind: int, obj: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, obj))
        if self._timer is None or when < self._timer_when:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_when = when
            self._timer = asyncio.get_running_loop().call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = self._now()
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, _, kind, obj = heapq.heappop(heap)
            if kind == _LEASE:
                lease: Lease = obj
                if not lease.active or lease.deadline != when:
                    continue  # acked, nacked or extended since this entry was pushed
                self._expire(lease)
            else:
                sub_released, pending = obj
                if not sub_released.deleted and pending.seq in sub_released.unacked:
                    sub_released.available.append(pending)
                    sub_released.notify()
        if heap:
            self._timer_when = heap[0][0]
            self._timer = asyncio.get_running_loop().call_at(self._timer_when, self._on_timer)

    def _expire(self, lease: Lease) -> None:
        sub = lease.subscription
        if sub.leases.pop(lease.ack_id, None) is None:
            return
        self._end_lease(lease)
        self._redeliver(sub, lease.pending)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()

    # -- monitoring ------------------------------------------------------------------------------

    def backlogs(self) -> dict[str, Backlog]:
        """Subscriptions with unacked messages -> oldest publish time and count (empty ones omitted)."""
        result: dict[str, Backlog] = {}
        for name, sub in self.subscriptions.items():
            if sub.unacked:
                oldest = next(iter(sub.unacked.values()))
                result[name] = Backlog(oldest.publish_time_ns, len(sub.unacked))
        return result
