"""An in-memory ``Store`` for tests and benchmarks of the delivery layer. NOT DURABLE.

Everything lives in this process's memory and is gone when it exits: never use it to run the
sidecar for real (G1 needs Firestore). It exists so that the runtime and the gRPC servicer can be
tested and measured without Firestore, with the same observable rules as the Firestore store:

- identity: a message with a ``sequence`` (sequence mode) is identified by ``(key, sequence)``; the
  same identity with the same ``fingerprint`` is a DUPLICATE, with another fingerprint a CONFLICT
  (the new one is dead-lettered, the stored one stays). Without a sequence the identity is
  ``dedup_id``: a second copy is a DUPLICATE. Tombstones (acked, dead-lettered, dropped) keep their
  identity, so a late redelivery of a finished message is still a duplicate.
- ``commit_acks`` tombstones each acked message and moves its key's cursor forward, never back.
- ``load`` returns the cursors plus every message not yet finished, in the order they were stored
  (with ``shards``: of those shards' keys, ``shard_of(key, shards)`` of the constructor's count);
  with ``pending=False`` just the cursors.
- ``pending_pages`` yields the messages not yet finished when it starts, ``page_size`` at a time
  (a constructor argument, small by default so that tests cross several pages), each page in the
  order recovery restores them; a message finished before its page is read is left out, one
  stored after the start is not added (its ``persist`` hands it over). A page read that fails
  (``fail_next("pending_pages", n)``) is tried again like the Firestore store's. Neither ``load``
  nor the pages strip payloads: ``max_payload_bytes`` is ignored here.
- ``release`` hides the cursors of those shards from ``cursor`` until a ``load`` takes them back,
  as a pod that lost them would; the data, being the database here, stays. No fencing: one process
  (``epoch``/``epochs`` are accepted and ignored).

Test hooks are plain public attributes: ``commit_gate`` (an ``asyncio.Event`` that ``commit_acks``
waits on before committing), ``fail_next(method, count)`` (the next ``count`` calls of ``method``
raise ``StoreUnavailable`` without changing anything), and call records (``committed_batches``,
``calls``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from sidecar.engine.types import AckIntent, EngineSnapshot, KeyCursor, Message
from sidecar.shards import shard_of
from sidecar.store.api import (
    IncomingMessage,
    PayloadBudget,
    PersistOutcome,
    PersistResult,
    ShardLost,
    StoreError,
    StoreRejected,
    StoreUnavailable,
)
from sidecar.store.reader import retrying
from sidecar.store.recovery import restore_order

_PENDING = "pending"
_TERMINAL_STATES = frozenset({"acked", "dead_lettered", "dead_lettered_aside", "dropped"})
_HOOKED_METHODS = frozenset(
    {"persist", "commit_acks", "mark_done", "load", "pending_pages", "read_payloads", "unblock", "skip_gap"}
)
_PAGE_SIZE = 50
"""Messages per ``pending_pages`` page by default: small, so that runtime tests with a few hundred
pending messages restore several pages (the Firestore store's pages are 2,000 documents)."""


@dataclass(slots=True)
class _Record:
    message: Message
    state: str


@dataclass(slots=True)
class _SubscriptionData:
    records: dict[str, _Record]
    """doc id -> record, in insertion (= stored) order."""
    cursors: dict[str, KeyCursor]
    released: set[int] = field(default_factory=set)
    """Shards this store was told it lost (``release``): their cursors are not its to hand out."""
    dead_lettered_at: dict[str, object] = field(default_factory=dict)
    """key -> position of its last in-order dead letter (what ``unblock`` passes)."""


def doc_id_for(key: str, dedup_id: str, sequence: int | None) -> str:
    """The record id: hash of (key, sequence) in sequence mode, else hash of the dedup id (DESIGN §5)."""
    identity = f"seq\x00{key}\x00{sequence}" if sequence is not None else f"dedup\x00{dedup_id}"
    return hashlib.sha256(identity.encode()).hexdigest()[:40]


class MemoryStore:
    """``Store`` kept in a dict: for delivery-layer tests and benchmarks only, NOT durable."""

    def __init__(self, shards: int = 1, *, page_size: int = _PAGE_SIZE) -> None:
        shard_of("", shards)  # validates the count
        if page_size < 1:
            raise ValueError(f"page_size: must be positive, got {page_size}")
        self._shards = shards
        """S, for ``load(shards=...)`` and ``release``."""
        self._page_size = page_size
        self._subscriptions: dict[str, _SubscriptionData] = {}
        self.commit_gate: asyncio.Event | None = None
        """When set to an Event, ``commit_acks`` waits for it before committing (tests hold acks with it)."""
        self.commits_waiting = 0
        """commit_acks calls currently held by ``commit_gate``."""
        self.committed_batches: list[list[str]] = []
        """Delivery ids of each successful ``commit_acks`` call, in call order."""
        self.calls: collections.Counter[str] = collections.Counter()
        """Calls per method, failed ones included."""
        self._failures: dict[str, tuple[int, StoreError | None]] = {}
        self.closed = False

    # ---- test hooks ------------------------------------------------------------------------

    def fail_next(self, method: str, count: int = 1, *, error: StoreError | None = None) -> None:
        """Make the next ``count`` calls of ``method`` raise ``error`` (default StoreUnavailable)."""
        if method not in _HOOKED_METHODS:
            raise ValueError(f"fail_next: method must be one of {sorted(_HOOKED_METHODS)}, got {method!r}")
        if count < 0:
            raise ValueError(f"fail_next: count must be >= 0, got {count}")
        self._failures[method] = (count, error)

    def state_of(self, subscription: str, message: Message) -> str | None:
        """The stored state of ``message`` ("pending", "acked", ...), None if it was never stored."""
        data = self._subscriptions.get(subscription)
        if data is None:
            return None
        record = data.records.get(doc_id_for(message.key, message.dedup_id, message.sequence))
        return None if record is None else record.state

    def cursor(self, subscription: str, key: str) -> KeyCursor | None:
        data = self._subscriptions.get(subscription)
        if data is None or shard_of(key, self._shards) in data.released:
            return None
        return data.cursors.get(key)

    async def flush(self, subscription: str, shards: frozenset[int] | None = None) -> None:
        """Nothing to write: every change is applied when it is made."""

    def watch_losses(self, subscription: str, callback: Callable[[ShardLost], None]) -> None:
        """Nothing to watch: this store writes only when called, and has no fences."""

    def release(self, subscription: str, shards: frozenset[int]) -> None:
        self._data(subscription).released |= shards

    def _enter(self, method: str) -> None:
        self.calls[method] += 1
        if self.closed:
            raise StoreUnavailable("memory store is closed")
        remaining, error = self._failures.get(method, (0, None))
        if remaining > 0:
            self._failures[method] = (remaining - 1, error)
            raise error or StoreUnavailable(f"injected failure of {method}")

    def _data(self, subscription: str) -> _SubscriptionData:
        data = self._subscriptions.get(subscription)
        if data is None:
            data = self._subscriptions[subscription] = _SubscriptionData(records={}, cursors={})
        return data

    # ---- Store -----------------------------------------------------------------------------

    async def persist(self, subscription: str, batch: Sequence[IncomingMessage], now_ms: int) -> list[PersistResult]:
        self._enter("persist")
        data = self._data(subscription)
        results: list[PersistResult] = []
        for incoming in batch:
            doc_id = doc_id_for(incoming.key, incoming.dedup_id, incoming.sequence)
            message = incoming.to_message(now_ms, doc_id)
            existing = data.records.get(doc_id)
            if existing is None:
                data.records[doc_id] = _Record(message=message, state=_PENDING)
                results.append(PersistResult(PersistOutcome.STORED, message))
            elif incoming.sequence is not None and existing.message.fingerprint != incoming.fingerprint:
                results.append(PersistResult(PersistOutcome.CONFLICT, message))
            else:
                pending = existing.message if existing.state == _PENDING else None
                results.append(PersistResult(PersistOutcome.DUPLICATE, existing.message, pending=pending))
        return results

    async def commit_acks(
        self, subscription: str, acks: Sequence[AckIntent], now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> None:
        gate = self.commit_gate
        if gate is not None:
            self.commits_waiting += 1
            try:
                await gate.wait()
            finally:
                self.commits_waiting -= 1
        self._enter("commit_acks")
        data = self._data(subscription)
        # Validate first so that a bad batch changes nothing, like an atomic commit. A fast-path
        # message (``volatile``) has no record: its ack only moves the cursor.
        records = [None if ack.message.volatile else self._record_of(data, ack.message) for ack in acks]
        for ack, record in zip(acks, records, strict=True):
            if record is not None:
                record.state = "acked"
            self._advance_cursor(data, ack)
        self.committed_batches.append([ack.delivery_id for ack in acks])

    async def mark_done(
        self,
        subscription: str,
        messages: Sequence[Message],
        state: str,
        now_ms: int,
        *,
        epochs: Mapping[int, int] | None = None,
    ) -> None:
        if state not in _TERMINAL_STATES - {"acked"}:
            raise ValueError(f"mark_done: state must be one of {sorted(_TERMINAL_STATES - {'acked'})}, got {state!r}")
        self._enter("mark_done")
        data = self._data(subscription)
        for message in messages:
            doc_id = doc_id_for(message.key, message.dedup_id, message.sequence)
            record = data.records.get(doc_id)
            # A conflict's second copy was never stored: dead-lettering it leaves the original alone.
            if record is None or record.message.fingerprint != message.fingerprint:
                continue
            if record.state == _PENDING:  # a tombstone stays what it first became
                record.state = state
                position = message.sequence if message.sequence is not None else message.timestamp_ms
                if state == "dead_lettered" and position is not None:
                    data.dead_lettered_at[message.key] = (
                        position if message.sequence is not None else (position, message.dedup_id)
                    )

    async def unblock(
        self, subscription: str, key: str, now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> object | None:
        """The key's last in-order dead letter: this store does not know the policy, and its caller
        (the runtime) asks only for a key the engine has blocked."""
        self._enter("unblock")
        return self._data(subscription).dead_lettered_at.pop(key, None)

    async def skip_gap(
        self,
        subscription: str,
        key: str,
        first: int,
        through: int,
        now_ms: int,
        *,
        epochs: Mapping[int, int] | None = None,
    ) -> bool:
        """The key's cursor moves past ``first..through``, which it remembers as skipped."""
        self._enter("skip_gap")
        data = self._data(subscription)
        current = data.cursors.get(key, KeyCursor(key=key))
        if current.next_sequence not in (None, first) or through < first:
            return False
        known_from = current.known_from if current.known_from is not None else first
        data.cursors[key] = replace(
            current, next_sequence=through + 1, known_from=known_from, skipped=(*current.skipped, (first, through))
        )
        return True

    async def load(
        self,
        subscription: str,
        now_ms: int,
        progress: Callable[[int], None] | None = None,
        max_payload_bytes: int | PayloadBudget | None = None,
        shards: frozenset[int] | None = None,
        *,
        pending: bool = True,
        epoch: int | None = None,
    ) -> EngineSnapshot:
        self._enter("load")
        data = self._data(subscription)
        data.released -= set(range(self._shards)) if shards is None else shards
        held = tuple(data.records[doc_id].message for doc_id in self._pending_ids(data, shards)) if pending else ()
        cursors = tuple(cursor for key, cursor in data.cursors.items() if self._wanted(key, shards))
        if progress is not None:
            progress(len(held) + len(cursors))
        return EngineSnapshot(cursors=cursors, pending=held)

    async def pending_pages(
        self,
        subscription: str,
        shards: frozenset[int] | None,
        max_payload_bytes: int | PayloadBudget | None,
        progress: Callable[[int], None] | None,
    ) -> AsyncGenerator[list[Message], None]:
        data = self._data(subscription)
        ids = self._pending_ids(data, shards)
        read = 0
        for start in range(0, len(ids), self._page_size):
            page_ids = ids[start : start + self._page_size]
            page = await retrying(functools.partial(self._read_page, data, page_ids), "pending_pages", None)
            read += len(page)
            if progress is not None:
                progress(read)
            if page:
                yield sorted(page, key=restore_order)

    async def _read_page(self, data: _SubscriptionData, doc_ids: list[str]) -> list[Message]:
        """One page: those of ``doc_ids`` still pending (a call ``fail_next`` can fail)."""
        self._enter("pending_pages")
        return [data.records[doc_id].message for doc_id in doc_ids if data.records[doc_id].state == _PENDING]

    async def read_payloads(self, subscription: str, messages: Sequence[Message], now_ms: int) -> list[Message]:
        self._enter("read_payloads")
        data = self._data(subscription)
        out = []
        for message in messages:
            record = data.records.get(doc_id_for(message.key, message.dedup_id, message.sequence))
            if record is None or record.state != _PENDING:
                raise StoreRejected(f"read_payloads: message {message.dedup_id!r} is not pending")
            out.append(record.message)
        return out

    async def close(self) -> None:
        self.closed = True

    # ---- helpers ---------------------------------------------------------------------------

    def _wanted(self, key: str, shards: frozenset[int] | None) -> bool:
        return shards is None or shard_of(key, self._shards) in shards

    def _pending_ids(self, data: _SubscriptionData, shards: frozenset[int] | None) -> list[str]:
        """The records not yet finished of ``shards``' keys, in stored order."""
        return [
            doc_id
            for doc_id, record in data.records.items()
            if record.state == _PENDING and self._wanted(record.message.key, shards)
        ]

    @staticmethod
    def _record_of(data: _SubscriptionData, message: Message) -> _Record:
        record = data.records.get(doc_id_for(message.key, message.dedup_id, message.sequence))
        if record is None:
            raise StoreError(f"commit_acks: message {message.dedup_id!r} of key {message.key!r} was never stored")
        return record

    @staticmethod
    def _advance_cursor(data: _SubscriptionData, ack: AckIntent) -> None:
        key = ack.message.key
        current = data.cursors.get(key, KeyCursor(key=key))
        cursor = ack.cursor
        if isinstance(cursor, int):
            if current.next_sequence is None or cursor > current.next_sequence:
                current = replace(current, next_sequence=cursor)
        elif isinstance(cursor, tuple):
            if current.last_position is None or cursor > current.last_position:
                current = replace(current, last_position=cursor)
        else:
            return  # none mode keeps no cursor
        data.cursors[key] = current
