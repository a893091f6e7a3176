"""Receiving and sorting: the subscriber's callback, and the queues between it and the store.

``Sorter.on_message`` is the subscriber's callback (``LoopScheduler`` runs it on the event loop): it
classifies the message and queues it unsorted. ``sort_pending`` then sends each message one of
five ways, in this order:

- **Forwarded** (several pods, a ``Forwarder`` given): a message whose key's shard another pod owns
  is handed to that owner over the peer channel (docs/forwarding.md). Acked with Pub/Sub only when
  the owner answered that its outcome is durable; a refusal or a broken channel sends it back here,
  marked, to be stored for the owner (``inbox``) as before. A message forwarded to this pod
  (``on_message(from_peer=True)``) is never forwarded again.

- **Fast path** (sequence mode, ``ordering.fast_path``): ``runtime.take_fast`` takes an in-order
  message without a write; its Pub/Sub ack waits for ``Settlement.on_volatile_settled``. Offered
  by key and sequence, so that a message and its successor swapped in one hand-over both take it.
- **Deferred, once** (``_defer``): a message whose key has a write under way waits for it, then is
  offered again: its predecessor may be in that write.
- **Held** (``_hold``): a message beyond its key's first missing position waits a little,
  unstored, for that position (``predecessor_wait_seconds``).
- **To store**: the rest, taken in batches (``take_batch``) by the ingest's batch loop.

Rules:

- A message waiting (held, deferred or to store) is offered to the fast path again when its key
  takes it (``reoffer``), when its key has a message stored (``release_keys`` and ``reoffer``, called
  by ``sidecar.pipeline.ingest_persist``), and just before its batch is written
  (``take_fast_before_store``) (docs/ingest.md).
- Never messages with a Pub/Sub ordering key on the fast path, held or deferred: the client gives
  the callback the next message of such a key only once this one is acked.
- Sorting settles nothing but malformed messages (dead-lettered, then acked), forwarded messages
  whose owner answered that their outcome is durable (acked), and a message classify failed on (a
  bug of ours: nacked after the maximum backoff, never dead-lettered); every queued message stays
  held in ``Settlement`` until the store, the runtime or the owner made it safe.
- ``persisting`` counts, by key, the messages sorted to be stored and not yet released: deferring
  waits on it. Everything runs on the event loop. Messages are seen as ``PulledMessage``: the
  Pub/Sub client library is not imported here.
"""

from __future__ import annotations

import collections
import datetime
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sidecar.config.model import SubscriptionConfig
from sidecar.pipeline.classify import Malformed, classify
from sidecar.pipeline.ingest_counters import IngestCounters
from sidecar.pipeline.ingest_held import Held
from sidecar.pipeline.ingest_settlement import PulledMessage, Settlement
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.shards import shard_of
from sidecar.store.api import IncomingMessage

if TYPE_CHECKING:
    import asyncio

_LOGGER = logging.getLogger(__name__)

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_ONE_MS = datetime.timedelta(milliseconds=1)

MAX_BATCH_MESSAGES = 500
"""Firestore's BatchWrite takes at most 500 writes: one persist call maps onto one such request."""

MAX_BATCH_BYTES = 8 * 1024 * 1024
"""Bounds the data of one persist call (Firestore requests are capped at 10 MiB; the store splits
larger messages itself, this keeps one call's memory and latency bounded)."""

BATCH_WINDOW_SECONDS = 0.010
"""Wait this long for a batch to fill: 10 ms adds little latency next to a store commit, and at
1,000 msg/s it turns ten single-message commits into one."""

PREDECESSOR_WAIT_SECONDS = 0.150
"""Sequence mode with the fast path: how long a message beyond its key's first missing position
waits, unstored, for that position (``_hold``). A publisher's swapped pair arrives a few
messages apart: if the missing one comes meanwhile, both take the fast path, and neither costs a
document (create and tombstone). Waiting delays no delivery: the message could not be delivered
before its predecessor anyway, and is offered to the fast path the moment that one takes it."""

PEER_PREDECESSOR_WAIT_SECONDS = 1.0
"""The same wait at a pod with the peer channel on (``Ingestor`` picks it once a forwarder is set).
A key's messages then reach its owner by several paths, its own pull and every other pod's forward,
each behind its own pod's backlog: in ``python -m bench --quick --scenario scale-out`` (3 pods, 2
cores, an in-order stream) 150 ms let about 12% of the messages arrive after their wait ended, each
then stored and tombstoned (+0.24 billed operations a message against one pod); 1 s brought that to
+0.01. The wait costs no delivery (as above) and no memory beyond what flow control already bounds:
a held message is one the owner's ``max_outstanding_messages`` and the sender's window count."""


class Forwarder(Protocol):
    """Hands a message of a shard this pod does not own to the shard's owner (``sidecar.peering.client``;
    the contract is in ``sidecar.pipeline.ingest_forwarded``)."""

    def forward(self, subscription: str, shard: int, message: PulledMessage, on_answer: Callable[[bool], None]) -> bool:
        """Take ``message`` for the owner of ``shard``; False when it cannot now (``on_answer`` is then
        never called). Once taken, ``on_answer`` is called once, on the loop: True when the owner made
        its outcome durable, False for a refusal or a broken channel."""


def predecessor_wait_for(forwarder: Forwarder | None) -> float:
    """How long a message waits, unstored, for its key's missing position: longer where other pods
    forward to this one, since a predecessor may come through any of them."""
    return PREDECESSOR_WAIT_SECONDS if forwarder is None else PEER_PREDECESSOR_WAIT_SECONDS


@dataclass(slots=True)
class Received:
    """A received message on its way to the fast path or the store, with what classify made of it."""

    message: PulledMessage
    incoming: IncomingMessage
    deferred: bool = False
    """It already waited once for its key's persist (``Sorter._defer``): never twice."""
    from_peer: bool = False
    """Forwarded to this pod by another (``on_message(from_peer=True)``): never forwarded again."""
    forward_refused: bool = False
    """Forwarded and refused (or its channel broke): stored for the owner now, not offered again."""


class Sorter:
    """One subscription's received messages, from the callback until the fast path or a batch takes them."""

    def __init__(
        self,
        sub_config: SubscriptionConfig,
        runtime: SubscriptionRuntime,
        counters: IngestCounters,
        settlement: Settlement,
        wake: asyncio.Event,
        *,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        is_stopping: Callable[[], bool],
        fast_path: bool,
        backoff_maximum_seconds: float,
        max_batch_messages: int = MAX_BATCH_MESSAGES,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        batch_window_seconds: float = BATCH_WINDOW_SECONDS,
        predecessor_wait_seconds: float | None = None,
        forwarder: Forwarder | None = None,
    ) -> None:
        self._config = sub_config
        self.name = sub_config.name
        self._runtime = runtime
        self._counters = counters
        self._settlement = settlement
        self._wake = wake
        """Set when the batch loop may have work: a message received, deferred messages back."""
        self._spawn = spawn
        self._is_stopping = is_stopping
        self.fast_path = fast_path
        """The in-order fast path (``runtime.take_fast``): sequence mode, ``ordering.fast_path``."""
        self._max_batch_messages = max_batch_messages
        self._max_batch_bytes = max_batch_bytes
        self._batch_window_seconds = batch_window_seconds
        self._predecessor_wait_given = predecessor_wait_seconds
        """None: the wait follows the forwarder (``predecessor_wait_for``), set now or later."""
        self.predecessor_wait_seconds = (
            predecessor_wait_for(forwarder) if predecessor_wait_seconds is None else predecessor_wait_seconds
        )
        self._backoff_maximum_seconds = backoff_maximum_seconds
        self._pending: collections.deque[Received] = collections.deque()
        """Received, not yet sorted (``sort_pending``): fast path, deferred, or to store."""
        self._to_store: collections.deque[Received] = collections.deque()
        """Sorted, to be stored: batched for up to ``batch_window_seconds``, then a free persist slot."""
        self._to_store_bytes = 0
        self._held: Held[Received] = Held(_key_of)
        """Messages waiting, unstored, for their key's missing position (``_hold``)."""
        self._to_store_since = 0.0
        """When the oldest of ``_to_store`` was queued (``time.monotonic``)."""
        self._persisting: collections.Counter[str] = collections.Counter()
        """Keys with messages in a persist in progress (fast path only): how many."""
        self._deferred: dict[str, list[Received]] = {}
        """Messages waiting, by key, for the persists of their key in progress (``_defer``)."""
        self._forwarder = forwarder
        self.forwarding = 0
        """Messages handed to the forwarder and not answered yet."""

    @property
    def forwarder(self) -> Forwarder | None:
        """Takes messages of shards other pods own to their owners; None: the inbox's way only."""
        return self._forwarder

    @forwarder.setter
    def forwarder(self, forwarder: Forwarder | None) -> None:
        self._forwarder = forwarder
        if self._predecessor_wait_given is None:
            self.predecessor_wait_seconds = predecessor_wait_for(forwarder)

    def stages(self) -> dict[str, int]:
        """Messages queued here, by queue (part of ``Ingestor.stages``)."""
        return {
            "unsorted": len(self._pending),
            "held": len(self._held),
            "deferred": sum(len(items) for items in self._deferred.values()),
            "to_store": len(self._to_store),
            "forwarding": self.forwarding,
        }

    @property
    def has_pending(self) -> bool:
        """Messages received and not sorted yet."""
        return bool(self._pending)

    @property
    def has_to_store(self) -> bool:
        """Messages sorted to be stored."""
        return bool(self._to_store)

    def held_until(self) -> float | None:
        """When the first held message's wait ends (``time.monotonic``); None when none is held."""
        return self._held.next_deadline()

    # ---- receiving (on the loop, from LoopScheduler) ---------------------------------------

    def on_message(self, message: PulledMessage, *, from_peer: bool = False) -> None:
        """The subscriber's callback; ``LoopScheduler`` runs it on the loop. ``from_peer``: another pod
        forwarded it (``Ingestor.take_forwarded``)."""
        if not from_peer:
            self._counters.received += 1  # from Pub/Sub; forwarded ones count as ``forwarded_in``
        self._settlement.receive(message)
        if self._is_stopping():
            return  # held; stop() nacks it with the rest
        attributes = dict(message.attributes)
        try:
            result = classify(
                self._config,
                message.data,
                attributes,
                message.ordering_key,
                message.message_id,
                _publish_time_ms(message),
            )
        except Exception:
            # A bug of ours, not the message's fault: never dead-letter on it, never crash on it.
            _LOGGER.exception("ingest of %s: classify failed on message %s", self.name, message.message_id)
            self._settlement.nack_later(message, self._backoff_maximum_seconds)
            return
        if isinstance(result, Malformed):
            self._counters.malformed += 1
            self._spawn(self._settlement.dead_letter_then_ack(message, f"malformed: {result.reason}", key=result.key))
            return
        self._pending.append(Received(message=message, incoming=result, from_peer=from_peer))
        self._wake.set()

    # ---- sorting ---------------------------------------------------------------------------

    def sort_pending(self) -> None:
        """Everything received goes to the fast path or waits behind its key's persist (``_defer``), or
        is queued to be stored."""
        batch = self._forward(list(self._pending))
        self._pending.clear()
        if self.fast_path and self._runtime.is_ready:
            rest = self._take_fast(batch)
            if len(rest) < len(batch):
                # The keys that took the fast path: their messages waiting, and those of the batch
                # left (beyond one waiting), are offered again together, so a chain follows at once.
                left = {id(item) for item in rest}
                keys = {item.incoming.key for item in batch if id(item) not in left}
                left = {id(item) for item in self.reoffer(keys, [i for i in rest if i.incoming.key in keys])}
                rest = [item for item in rest if item.incoming.key not in keys or id(item) in left]
            batch = self._hold(self._defer(rest))
            # Counted from now: a later message of the key waits for this one to be stored (``_defer``).
            self._persisting.update(item.incoming.key for item in batch)
        self._queue_to_store(batch)

    def _forward(self, batch: list[Received]) -> list[Received]:
        """Hand each message whose key's shard another pod owns to the forwarder; returns the rest."""
        forwarder = self.forwarder
        runtime = self._runtime
        if forwarder is None or not runtime.sharded or not batch:
            return batch
        rest: list[Received] = []
        for item in batch:
            key = item.incoming.key
            if item.from_peer or item.forward_refused or runtime.owner_epoch(key) is not None:
                rest.append(item)
                continue
            shard = shard_of(key, runtime.shard_count)
            answer = functools.partial(self._answered, item)
            if forwarder.forward(self.name, shard, item.message, answer):
                self.forwarding += 1
            else:
                rest.append(item)
        return rest

    def _answered(self, item: Received, accepted: bool) -> None:
        """The owner's answer for a forwarded message: durable there -> ack; else store it for the owner."""
        self.forwarding -= 1
        if accepted:
            self._counters.forwarded += 1
            self._settlement.ack(item.message)
            return
        self._counters.forward_refused += 1
        if self._is_stopping():
            return  # held; stop() gives it back with the rest
        item.forward_refused = True
        self._pending.append(item)
        self._wake.set()

    def _queue_to_store(self, batch: list[Received]) -> None:
        if batch and not self._to_store:
            self._to_store_since = time.monotonic()
        self._to_store.extend(batch)
        self._to_store_bytes += sum(len(item.message.data) for item in batch)

    def _hold(self, batch: list[Received]) -> list[Received]:
        """Keep back, unstored, for ``predecessor_wait_seconds``, a message beyond its key's first
        missing position (``runtime.awaits_predecessor``); ``reoffer`` hands it to the fast path
        when that position takes it, ``store_held`` queues it to be stored when the wait ends.
        Not messages with a Pub/Sub ordering key (the client holds back the rest of their key
        until they are acked). Returns what to store now."""
        if self.predecessor_wait_seconds <= 0:
            return batch
        until = time.monotonic() + self.predecessor_wait_seconds
        rest: list[Received] = []
        for item in batch:
            if not item.incoming.ordering_key and self._runtime.awaits_predecessor(item.incoming):
                self._held.hold(item, until)
                self._counters.held += 1
            else:
                rest.append(item)
        return rest

    def store_held(self) -> None:
        """Held messages whose wait ended go to be stored."""
        expired = self._held.expired(time.monotonic())
        if expired:
            self._persisting.update(item.incoming.key for item in expired)
            self._queue_to_store(expired)

    def reoffer(self, keys: set[str], fresh: list[Received] | None = None) -> list[Received]:
        """Offer the fast path ``fresh`` (just received) together with the messages of ``keys`` held
        for a predecessor or waiting to be stored (a swapped successor): sorted by key and sequence,
        a predecessor taken lets its successors follow in the same pass, not when their wait or the
        batch window ends. Called too when ``keys`` had a message stored. Returns the messages of
        ``fresh`` not taken."""
        fresh = fresh or []
        if not keys:
            return fresh
        held = self._held.of_keys(keys)
        waiting = [item for item in self._to_store if item.incoming.key in keys]
        if not held and not waiting:
            return fresh  # offered already, and nothing of their keys waits that could open the way
        left = {id(item) for item in self._take_fast([*fresh, *held, *waiting])}
        self._held.release([item for item in held if id(item) not in left])
        taken = [item for item in waiting if id(item) not in left]
        if taken:
            gone = {id(item) for item in taken}
            self._to_store = collections.deque(item for item in self._to_store if id(item) not in gone)
            self._to_store_bytes -= sum(len(item.message.data) for item in taken)
            self.release_keys(taken)
        return [item for item in fresh if id(item) in left]

    # ---- batches to store ------------------------------------------------------------------

    def store_window_left(self) -> float:
        """Seconds the next batch to store may still wait for more (0: store it now)."""
        if len(self._to_store) >= self._max_batch_messages or self._to_store_bytes >= self._max_batch_bytes:
            return 0.0
        return max(0.0, self._to_store_since + self._batch_window_seconds - time.monotonic())

    def take_batch(self) -> list[Received]:
        """The next batch to store: up to ``max_batch_messages`` and ``max_batch_bytes``."""
        batch: list[Received] = []
        size = 0
        to_store = self._to_store
        while to_store and len(batch) < self._max_batch_messages:
            item_size = len(to_store[0].message.data)
            if batch and size + item_size > self._max_batch_bytes:
                break
            batch.append(to_store.popleft())
            size += item_size
        self._to_store_bytes -= size
        return batch

    def take_fast_before_store(self, batch: list[Received]) -> list[Received]:
        """Offer ``batch`` (just taken to be stored) to the fast path once more: a message whose
        predecessor arrived while it waited takes it. Returns what to store."""
        if not (self.fast_path and self._runtime.is_ready):
            return batch
        rest = self._take_fast(batch)
        if len(rest) < len(batch):
            kept = {id(item) for item in rest}
            self.release_keys([item for item in batch if id(item) not in kept])
        return rest

    def _take_fast(self, batch: list[Received]) -> list[Received]:
        """Hand in-order messages to the runtime's fast path (nothing written); the rest is stored.
        Not messages with a Pub/Sub ordering key: the client gives the callback the next message of
        such a key only once this one is acked, and a fast-path ack waits for a checkpoint.

        Offered by key and sequence, so that a message and its successor swapped in one pull batch
        both take the fast path (in arrival order the successor would find its predecessor missing)."""
        candidates = sorted(
            (item for item in batch if not item.incoming.ordering_key),
            key=lambda item: (item.incoming.key, item.incoming.sequence or 0),
        )
        taken = self._runtime.take_fast([item.incoming for item in candidates])
        fast = {id(item): message for item, message in zip(candidates, taken, strict=True) if message is not None}
        for item in candidates:
            message = fast.get(id(item))
            if message is not None:
                self._settlement.await_volatile(message, item.message)
        self._counters.fast_path += len(fast)
        return [item for item in batch if id(item) not in fast]

    def _defer(self, batch: list[Received]) -> list[Received]:
        """Keep back, once, a message whose key has a persist in progress: its predecessor may be in
        it, and once stored the predecessor makes it the next in order, so it can take the fast
        path then instead of being stored now. It waits no longer than being stored would take
        (one persist), and a hot key with one message stored does not store every later one while
        that persist is under way. Returns what to store now."""
        persisting = self._persisting
        rest: list[Received] = []
        for item in batch:
            key = item.incoming.key
            if (
                not item.deferred
                and persisting[key]
                and item.incoming.sequence is not None
                and not item.incoming.ordering_key
            ):
                item.deferred = True
                self._deferred.setdefault(key, []).append(item)
                self._counters.deferred += 1
            else:
                rest.append(item)
        return rest

    def release_keys(self, batch: list[Received]) -> None:
        """``batch`` is no longer on its way to the store (stored, failed, or taken by the fast path
        after all): messages deferred behind its keys go back to the front of the queue."""
        persisting = self._persisting
        back: list[Received] = []
        for item in batch:
            key = item.incoming.key
            if key not in persisting:
                continue  # sorted while the fast path was off
            persisting[key] -= 1
            if persisting[key] <= 0:
                del persisting[key]
                back += self._deferred.pop(key, ())
        if back and not self._is_stopping():
            self._pending.extendleft(reversed(back))
            self._wake.set()

    def forget_queued(self) -> None:
        """Everything queued is given back (it is all held in ``Settlement``)."""
        self._pending.clear()
        self._to_store.clear()
        self._to_store_bytes = 0
        self._held.clear()
        self._deferred.clear()
        self._persisting.clear()


def _key_of(item: Received) -> str:
    return item.incoming.key


def _publish_time_ms(message: PulledMessage) -> int:
    """Publish time in integer ms since the epoch, computed exactly (no float rounding)."""
    known: int | None = getattr(message, "publish_time_ms", None)  # the stream intake's, from the raw stamp
    if known is not None:
        return known
    publish_time = message.publish_time
    if publish_time.tzinfo is None:
        publish_time = publish_time.replace(tzinfo=datetime.UTC)
    milliseconds: int = (publish_time - _EPOCH) // _ONE_MS
    return milliseconds
