"""What the sidecar asks of durable storage, independent of Firestore: the ``Store`` protocol and its types.

``sidecar.store.document_store.DocumentStore`` implements it over a document database
(``sidecar.store.firestore`` for Firestore); ``sidecar.store.memory.MemoryStore`` implements it in
memory for component tests (not durable). Ingest calls ``persist``; delivery calls ``commit_acks``
and only then confirms the acks to the app; recovery calls ``load`` before anything is delivered
(and, when it loads the state first, ``pending_pages`` while it already delivers).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sidecar.engine.fingerprint import fingerprint
from sidecar.engine.types import (
    AckIntent,
    DeadLetterPolicy,
    EngineSnapshot,
    KeyCursor,
    Message,
    Mode,
    Payload,
    record,
)
from sidecar.shards import MAX_SHARDS

DEAD_LETTERED = "dead_lettered"
"""``mark_done`` state: dead-lettered in its key's order (attempts exhausted, or the app asked)."""
DEAD_LETTERED_ASIDE = "dead_lettered_aside"
"""``mark_done`` state: dead-lettered outside its key's order (late, conflicting, below the cursor)."""
DROPPED = "dropped"
"""``mark_done`` state: a duplicate the engine found, whose record no held message shares."""


class StoreError(Exception):
    """Base of the store's errors; third-party errors are translated into these at the boundary."""


class StoreUnavailable(StoreError):
    """Transient: nothing was decided, try again later (Pub/Sub keeps the message meanwhile)."""


class StoreRejected(StoreError):
    """Permanent for this input (e.g. larger than any document split allows)."""


class ShardLost(StoreError):
    """This pod no longer owns ``shards`` (a fence failed, or it knew so at once).

    Raised by ``commit_acks``, ``mark_done``, ``unblock`` and ``flush``: everything of the call outside
    these shards was applied and is durable; nothing inside them was, and the store has forgotten
    their cursor state (``Store.release``). Their keys are the new owner's now: stop delivering them,
    and never confirm their acks (the new owner's app gets those messages again, which G3 allows).
    """

    def __init__(self, subscription: str, shards: Iterable[int], epochs: Mapping[int, int] | None = None) -> None:
        self.subscription = subscription
        self.shards: frozenset[int] = frozenset(shards)
        self.epochs: dict[int, int] = {shard: epoch for shard, epoch in (epochs or {}).items() if shard in self.shards}
        """Per shard, where known, the lease epoch that was lost: the state loaded, or the decisions
        made, under that epoch. The same pod may hold the shard again at a later epoch: that is not
        lost (``lost_at``)."""
        at = f" (at epoch {', '.join(f'{s}: {e}' for s, e in sorted(self.epochs.items()))})" if self.epochs else ""
        super().__init__(f"subscription {subscription!r}: lost shard(s) {sorted(self.shards)}{at} to another owner")

    def lost_at(self, shard: int, epoch: int) -> bool:
        """Whether the shard was lost as held at ``epoch`` (an unknown epoch counts as any)."""
        return shard in self.shards and self.epochs.get(shard, epoch) == epoch


class PayloadBudget:
    """Payload bytes that loads may still keep in memory, shared by the loads that run at once
    (``Store.load``'s ``max_payload_bytes``): past it, pending messages are loaded stripped. Every
    message's bookkeeping is charged whether its payload is kept or not."""

    __slots__ = ("remaining",)

    def __init__(self, remaining: int) -> None:
        self.remaining = remaining

    def charge(self, size: int) -> None:
        """Bytes that are kept anyway (a message's bookkeeping): may take the budget below zero."""
        self.remaining -= size

    def refund(self, size: int) -> None:
        """Give back bytes charged or taken for messages that will not be kept after all."""
        self.remaining += size

    def take(self, size: int) -> bool:
        """Keep ``size`` more bytes if they fit; False (nothing taken) when they do not."""
        if size > self.remaining:
            return False
        self.remaining -= size
        return True


@dataclass(frozen=True, slots=True)
class SubscriptionStoreConfig:
    """What the store needs to know about one subscription."""

    mode: Mode
    dedup_ttl_ms: int = 7 * 24 * 3600 * 1000
    on_dead_letter: DeadLetterPolicy = "block"
    sequence_start: int = 1
    first_sequence_any: bool = False
    shards: int = 1
    """S: a key's shard is ``sidecar.shards.shard_of(key, shards)``; written on every message and
    cursor document, so it must be the same on every pod of the subscription."""

    def __post_init__(self) -> None:
        if self.mode not in ("sequence", "watermark", "none"):
            raise ValueError(f"mode: must be sequence, watermark or none, got {self.mode!r}")
        if self.dedup_ttl_ms <= 0:
            raise ValueError(f"dedup_ttl_ms: must be positive, got {self.dedup_ttl_ms}")
        if self.on_dead_letter not in ("block", "skip"):
            raise ValueError(f"on_dead_letter: must be block or skip, got {self.on_dead_letter!r}")
        if type(self.shards) is not int or not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards: must be an integer 1..{MAX_SHARDS}, got {self.shards!r}")


@record
class IncomingMessage:
    """A Pub/Sub message classified by ingest (key, position, dedup id), ready to persist."""

    key: str
    dedup_id: str
    message_id: str
    data: bytes
    attributes: dict[str, str]
    ordering_key: str
    publish_time_ms: int
    sequence: int | None = None
    timestamp_ms: int | None = None
    to_owner: bool = False
    """Persisted by a pod that does not own the key's shard: the document carries ``inbox`` so that
    the owner's Listen hands it over (also merged into a pending copy that already exists)."""
    replay_id: str = ""
    """An operator's replay of a dead letter (``sidecar_replay_id``): a record of its own."""
    known_fingerprint: bytes | None = field(default=None, compare=False, repr=False)
    """Set when known (a replay's is its original's, without the marker); None: computed from
    ``data``, ``attributes`` and ``ordering_key`` when first asked for (``fingerprint``)."""

    @property
    def fingerprint(self) -> bytes:
        """A hash of the content the publisher controls (``sidecar.engine.fingerprint``)."""
        known = self.known_fingerprint
        if known is None:
            known = fingerprint(self.data, self.attributes, self.ordering_key)
            object.__setattr__(self, "known_fingerprint", known)  # a cache: equality ignores it
        return known

    def to_message(self, stored_at_ms: int, ref: str, *, volatile: bool = False) -> Message:
        """The engine's view of this message once a store made it durable under ``ref`` (or, with
        ``volatile``, as the in-order fast path takes it: not stored)."""
        return Message(
            key=self.key,
            dedup_id=self.dedup_id,
            message_id=self.message_id,
            known_fingerprint=self.known_fingerprint,
            stored_at_ms=stored_at_ms,
            sequence=self.sequence,
            timestamp_ms=self.timestamp_ms,
            replay_id=self.replay_id,
            volatile=volatile,
            payload=Payload(
                data=self.data,
                attributes=self.attributes,  # shared: no record changes its attributes
                publish_time_ms=self.publish_time_ms,
                ordering_key=self.ordering_key,
                ref=ref,
            ),
        )


class PersistOutcome(enum.Enum):
    STORED = "stored"
    """Newly durable: hand ``message`` to the engine, then ack Pub/Sub."""
    DUPLICATE = "duplicate"
    """Already stored with the same content: ack Pub/Sub (after handing ``pending`` to the engine)."""
    CONFLICT = "conflict"
    """Same identity (key and sequence) with other content: dead-letter the new one, then ack
    (after handing ``pending``, the stored original, to the engine)."""
    FAILED = "failed"
    """Not decided (``error`` says why): do not ack; Pub/Sub redelivers."""


@dataclass(frozen=True, slots=True)
class PersistResult:
    outcome: PersistOutcome
    message: Message
    error: StoreError | None = None
    pending: Message | None = None
    """DUPLICATE or CONFLICT: the stored copy when it is still pending. It may be one the engine has
    never seen (a create that applied although its RPC failed, or a restart's load raced with it),
    so it is handed to the engine too, which drops it if it holds it already."""


class Store(Protocol):
    async def persist(self, subscription: str, batch: Sequence[IncomingMessage], now_ms: int) -> list[PersistResult]:
        """Make each message durable unless it already is; one result per input, in order."""
        ...

    async def commit_acks(
        self, subscription: str, acks: Sequence[AckIntent], now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> None:
        """Make app acks durable (tombstones plus coalesced cursors). Raises StoreError if not.

        ``epochs``: per shard, the lease epoch under which its acks were accepted (the engine's). An
        ack of a shard the store holds at another epoch (or no longer holds) is refused, never
        applied: ``ShardLost`` with that epoch. Every write is fenced with the epoch the shard was
        loaded at (``load(epoch=...)``), never with whatever the pod holds when it is sent."""
        ...

    async def mark_done(
        self,
        subscription: str,
        messages: Sequence[Message],
        state: str,
        now_ms: int,
        *,
        epochs: Mapping[int, int] | None = None,
    ) -> None:
        """Record a terminal state other than an ack: "dead_lettered" (in the key's order: moves or
        blocks the cursor), "dead_lettered_aside" (late or conflicting: outside the key's order) or
        "dropped" (a duplicate the engine found, e.g. below the cursor). Raises StoreError if not
        durable. ``epochs`` as for ``commit_acks``."""
        ...

    async def unblock(
        self, subscription: str, key: str, now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> object | None:
        """Record durably that an operator passed the dead letter ``key`` is blocked at: after a
        restart the key is not blocked again, and that position counts as skipped. Returns the
        position passed (a sequence, or ``(timestamp_ms, dedup_id)``), None when the store does not
        have the key blocked. Raises StoreError if not durable. ``epochs`` as for ``commit_acks``."""
        ...

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
        """Record durably that an operator skipped the missing sequences ``first..through`` of
        ``key`` (sequence mode), whose cursor stands at ``first``: after a restart the key's cursor
        is past them and a copy of one is late. False, nothing written, when the store's cursor
        stands elsewhere. Raises StoreError if not durable. ``epochs`` as for ``commit_acks``."""
        ...

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
        """Cursors and pending messages, to rebuild the engine before anything is delivered.
        ``shards``: only those shards' keys (a pod that takes shards over loads just them); None: all.
        Loads of different shards may run at once; a load must not run at the same time as this
        pod's writes that advance its shards' keys (with fences, the lease being taken refuses them).
        ``progress`` is called with the number of documents read so far, as reading goes on. Past
        ``max_payload_bytes`` of payloads (a ``PayloadBudget``: shared by the loads that run at once),
        pending messages come back stripped (``Payload.stripped``): read them with ``read_payloads``
        when they are delivered.
        ``pending=False``: everything but the pending messages (the snapshot's ``pending`` is
        empty; the cursor state is restored all the same): read them with ``pending_pages``.
        Raises StoreRejected, naming the document, on a document it cannot read as its own.
        ``epoch``: the lease epoch the shards are loaded under; the writes that advance them are
        fenced with it, and those decided under another epoch are refused (``commit_acks``)."""
        ...

    def pending_pages(
        self,
        subscription: str,
        shards: frozenset[int] | None,
        max_payload_bytes: int | PayloadBudget | None,
        progress: Callable[[int], None] | None,
    ) -> AsyncGenerator[list[Message], None]:
        """Every pending message of ``shards`` (None: all), a page at a time (an async generator),
        for the caller to restore each page while it already delivers (after ``load(pending=False)``
        of the same shards). Within a page, messages are in the order ``load`` gives them; each
        message comes exactly once. Payloads within ``max_payload_bytes`` as ``load`` does (the
        budget spans the pages: later pages come back stripped once it is spent). ``progress`` is
        called with the number of documents read so far. A page that fails transiently is read
        again from where it stopped, for as long as it fails (``progress`` stalls meanwhile);
        raises StoreRejected, naming the document, on a document it cannot read as its own."""
        ...

    def cursor(self, subscription: str, key: str) -> KeyCursor | None:
        """The key's durable cursor as the store knows it now (no I/O): lets the engine forget an
        idle key and rebuild it when a message for it arrives. None: nothing durable for the key
        (or its shard was released)."""
        ...

    async def flush(self, subscription: str, shards: frozenset[int] | None = None) -> None:
        """Write unwritten cursor changes now. ``shards``: those shards' changes and checkpoints, due
        or not: called before a graceful hand-over of them (after their acks are durable, before the
        lease goes), so that the next owner finds every cursor in the checkpoints and needs no
        tombstone to rebuild one. None: every change that is due. Raises ShardLost (those shards'
        changes are dropped: the next owner rebuilds them from the tombstones) or StoreError."""
        ...

    def watch_losses(self, subscription: str, callback: Callable[[ShardLost], None]) -> None:
        """Have ``callback`` told when a write the store makes on its own (the background flush of
        checkpoints) finds shards of ``subscription`` lost: their cursor state is forgotten, and
        the acks waiting for their checkpoint failed with the same ``ShardLost``."""
        ...

    def release(self, subscription: str, shards: frozenset[int]) -> None:
        """Forget the cached cursor state of ``shards``' keys, and their unwritten cursor updates (no
        I/O): the pod lost them, another owner advances them now. ``load(shards=...)`` takes them back."""
        ...

    async def read_payloads(self, subscription: str, messages: Sequence[Message], now_ms: int) -> list[Message]:
        """The pending ``messages`` (stripped) with their payloads read back, in order. Raises
        StoreRejected when one is no longer pending (its record was finished or deleted)."""
        ...

    async def close(self) -> None: ...
