"""The Pub/Sub emulator's data: messages in a subscription, leases, streams, snapshots.

Plain state with small helpers; the rules that move a message between states live in
``pubsub_state.py`` (delivery) and ``pubsub_replay.py`` (retention, snapshots, seek).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc

MIN_ACK_DEADLINE_SECONDS = 10
MAX_ACK_DEADLINE_SECONDS = 600
DEFAULT_MAX_DELIVERY_ATTEMPTS = 5
"""Production's value when a dead-letter policy leaves ``max_delivery_attempts`` at 0."""
MAX_RESPONSE_BYTES = 3 * 1024 * 1024 + 512 * 1024
"""Stay below the 4 MiB receive limit of the client's emulator channel, with room for framing."""
MAX_MESSAGES_PER_RESPONSE = 1000
"""Bounds one StreamingPull/Pull response so a large backlog is spread over several writes."""
RESPONSE_OVERHEAD_BYTES = 64
"""Per received message: ack id, delivery attempt and field tags around the message itself."""
HISTORY_EVENTS = 32
"""Events of one message kept for the admin report (``Pending.history``): the last ones."""
FINISHED_MESSAGES_KEPT = 1000
"""Per subscription: how many acked (or dead-lettered) messages keep their history for the admin API."""


class PubsubError(Exception):
    """A request the real service would refuse, with its status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, eq=False)
class Pending:
    """One message in one subscription, from publish until ack (or expunge, or dead-lettering)."""

    seq: int
    """Publish order within the broker: sorting by it is sorting by publish."""
    message: Any
    """The raw ``google.pubsub.v1.PubsubMessage``, shared by all subscriptions, never mutated."""
    publish_time_ns: int
    size: int
    attempts: int = 0
    """Deliveries so far: 1 + nacks + expiries once delivered (``delivery_attempt``)."""
    release_token: int = 0
    """Matches the timer entry that may release it after a backoff or delay; anything else is stale."""
    history: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=HISTORY_EVENTS))
    """Its last deliveries, acks, nacks, extensions and expiries (monotonic seconds, what): the
    admin route ``/pubsub/unacked`` shows them, to tell where a message that never arrives goes."""

    @property
    def ordering_key(self) -> str:
        return str(self.message.ordering_key)


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


@dataclass(frozen=True, slots=True)
class Finished:
    """A message that left a subscription (acked or dead-lettered), kept for the admin API's history."""

    message_id: str
    outcome: str
    """"acked" or "dead-lettered"."""
    attempts: int
    history: deque[tuple[float, str]]
    """The message's ``Pending.history`` (no longer written to)."""


@dataclass(slots=True, eq=False)
class StreamState:
    """Flow control, the leases waiting to be written, and control flags of one StreamingPull stream."""

    subscription: Subscription
    deadline_seconds: int
    max_messages: int
    max_bytes: int
    number: int = 0
    """Unique within the broker (never reused, unlike ``id()``): histories and the admin API name it."""
    client_id: str = ""
    """The client's ``client_id`` from the first request (the Python client keeps it across reconnects)."""
    routing: str = ""
    """The call's ``x-goog-request-params`` header (``subscription=...`` from Google's clients)."""
    heartbeats: int = 0
    """Empty requests the client sent on the open stream (keep-alives; the Python client's every 30 s)."""
    outstanding_messages: int = 0
    outstanding_bytes: int = 0
    outbox: deque[Lease] = field(default_factory=deque)
    """Leased to this stream by the dispatcher, not yet written to it."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    writing_since: float | None = None
    """Loop time the response being written now was handed to gRPC (None: not writing); a client that
    stopped reading keeps the write waiting."""
    closed: bool = False
    break_code: grpc.StatusCode | None = None
    break_message: str = ""

    def has_room(self) -> bool:
        """Whether flow control lets this stream take at least one more message (always when it has none)."""
        if self.outstanding_messages == 0:
            return True
        if 0 < self.max_messages <= self.outstanding_messages:
            return False
        return not (0 < self.max_bytes <= self.outstanding_bytes)

    def can_take(self, size: int) -> bool:
        if self.outstanding_messages == 0:
            return True  # always allow one message, whatever its size
        if 0 < self.max_messages <= self.outstanding_messages:
            return False
        return not (self.max_bytes > 0 and self.outstanding_bytes + size > self.max_bytes)

    @property
    def is_open(self) -> bool:
        return not self.closed and self.break_code is None

    @property
    def label(self) -> str:
        return f"stream {self.number}" + (f" (client {self.client_id})" if self.client_id else "")

    def end(self, code: grpc.StatusCode, message: str) -> None:
        if self.break_code is None:
            self.break_code = code
            self.break_message = message
        self.wake.set()

    def next_response(self) -> list[Lease]:
        """Leases for one response from the outbox: at most 1000 and under the 4 MiB bound."""
        outbox = self.outbox
        leases: list[Lease] = []
        size = 0
        while outbox and len(leases) < MAX_MESSAGES_PER_RESPONSE:
            lease = outbox[0]
            if not lease.active:
                outbox.popleft()  # acked or revoked (seek, deletion) before it was written
                continue
            if leases and size + lease.pending.size > MAX_RESPONSE_BYTES:
                break
            outbox.popleft()
            size += lease.pending.size + RESPONSE_OVERHEAD_BYTES
            leases.append(lease)
        return leases


@dataclass(slots=True, eq=False)
class Subscription:
    """A subscription's configuration (raw ``Subscription`` proto) and its message state."""

    config: Any
    created_ns: int = 0
    unacked: dict[int, Pending] = field(default_factory=dict)
    """Every unacked message by seq, in publish order (so the first is the oldest)."""
    acked: dict[int, Pending] = field(default_factory=dict)
    """Acked messages kept for Seek while ``retain_acked_messages`` is set (retention still applies)."""
    finished: deque[Finished] = field(default_factory=lambda: deque(maxlen=FINISHED_MESSAGES_KEPT))
    """The last acked or dead-lettered messages with their histories, oldest first (admin API only)."""
    available: deque[Pending] = field(default_factory=deque)
    leases: dict[str, Lease] = field(default_factory=dict)
    streams: dict[StreamState, None] = field(default_factory=dict)
    """Open streams in the order they opened (an ended one leaves at once): the dispatcher serves the
    least loaded first, ties round-robin."""
    next_stream: int = 0
    busy_keys: set[str] = field(default_factory=set)
    """Ordered subscriptions: keys with a message leased or waiting out a backoff."""
    held: dict[str, deque[Pending]] = field(default_factory=dict)
    """Ordered subscriptions: messages of a busy key, in publish order, until the key is free."""
    pull_wake: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: bool = False

    @property
    def name(self) -> str:
        return str(self.config.name)

    @property
    def is_ordered(self) -> bool:
        return bool(self.config.enable_message_ordering)

    @property
    def ack_deadline_seconds(self) -> int:
        return int(self.config.ack_deadline_seconds) or MIN_ACK_DEADLINE_SECONDS

    @property
    def retention_ns(self) -> int:
        duration = self.config.message_retention_duration
        return int(duration.seconds) * 1_000_000_000 + int(duration.nanos)

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


@dataclass(slots=True, eq=False)
class Snapshot:
    """A snapshot: the messages it retains (unacked at creation, and everything published since)."""

    config: Any
    """The raw ``google.pubsub.v1.Snapshot`` returned to clients."""
    expire_ns: int
    messages: dict[str, tuple[Any, int]] = field(default_factory=dict)
    """message_id -> (message, publish time in ns), in publish order."""


@dataclass(frozen=True, slots=True)
class Backlog:
    """What Cloud Monitoring reports for one subscription with unacked messages."""

    oldest_publish_time_ns: int
    num_undelivered: int
