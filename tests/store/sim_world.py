"""The crash simulation's world: what Pub/Sub holds, the run's configuration, what a process keeps
in memory, and what the documents say.

Plain pieces that every other part of the simulation (``crash_sim``) shares. Rules:

- ``Published`` is one published copy; copies of one identity (key, sequence) differ only by
  ``variant`` (a conflict), and ``incoming`` builds the same message the intake would see.
- ``Life`` is everything a process holds in memory: a crash throws it away whole; only the
  documents (``MemoryDocuments``) survive. ``ShardLoad`` is a paged load under way, part of a life.
- ``DocumentRecords`` reads what the documents hold now (never what a process believes): the
  checks of G1-G3 and the model of the TTL policy go by it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.engine import DeadLetter, Deliver, Engine, EngineConfig
from sidecar.engine.types import AckIntent, Message
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.store import layout
from sidecar.store.api import (
    DEAD_LETTERED,
    DEAD_LETTERED_ASIDE,
    IncomingMessage,
    PayloadBudget,
    SubscriptionStoreConfig,
)
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments

SUB = "s"
Identity = tuple[str, int]


class Crash(BaseException):
    """The process died here (a BaseException: no store code may catch it)."""


@dataclass(frozen=True)
class Published:
    """One published copy: the message plus which variant of its content (conflicts differ)."""

    key: str
    seq: int
    variant: int = 0
    malformed: bool = False

    @property
    def identity(self) -> Identity:
        return (self.key, self.seq)

    def incoming(self, to_owner: bool = False) -> IncomingMessage:
        data = f"{self.key}/{self.seq}/{self.variant}".encode()
        return IncomingMessage(
            key=self.key,
            dedup_id=f"{self.key}#{self.seq}#{self.variant}",
            message_id=f"m-{self.key}-{self.seq}-{self.variant}",
            data=data,
            attributes={"v": str(self.variant)},
            ordering_key="",
            publish_time_ms=1_000,
            known_fingerprint=hashlib.sha256(data).digest(),
            sequence=self.seq,
            to_owner=to_owner,
        )


@dataclass
class SimConfig:
    keys: int = 2
    per_key: int = 4
    max_in_flight: int = 1
    max_attempts: int = 3
    on_dead_letter: str = "block"
    gap_timeout_ms: int | None = None
    on_gap_timeout: str = "hold"
    on_late: str = "dead_letter"
    unpublished: frozenset[Identity] = frozenset()
    """Sequences never published (gaps that never fill: need ``on_gap_timeout: skip``)."""
    conflicts: frozenset[Identity] = frozenset()
    """Identities also published with other content (a conflict)."""
    malformed: int = 0
    dedup_ttl_ms: int = 60_000
    ack_deadline_ms: int = 5_000
    tombstones_per_commit: int = 2
    max_held_bytes: int | None = None
    """Payload bytes of held messages kept in memory (the runtime's budget); past it they are stripped."""
    max_idle_keys: int = 10_000
    """Idle keys the engine keeps; past it they are forgotten and rebuilt from the store's cursor."""
    fast_path: bool = False
    """The in-order fast path: a message exactly at its key's next position, at the owner, with
    nothing of its key held, goes to the engine unstored; its Pub/Sub ack waits for its durable ack."""
    pods: int = 1
    shards: int = 1
    """S: with 3 keys and S = 2 or 3, keys share shards or have their own."""
    paged: bool = False
    """Recover as the runtime does (``_load_shard``): each shard's state first (``load(...,
    pending=False)``, ``Engine.restore(..., loading=True)``), then its pending messages page by page
    (``pending_pages``), one page per ``page`` operation, anything else in between."""
    page_size: int = 2
    """Documents per query page while ``paged`` (the Firestore reader's ``_PAGE_SIZE``, 2,000 in
    production): small, so that a shard's pending messages span several pages."""
    epoch_rule: bool = True
    """The runtime's rule: every decision goes to the store with the epoch of the engine that made
    it (``epochs=``), every load with the epoch it is made under, and an ack of an engine dropped
    since is refused before it is sent. False plays the code before that rule (writes fenced with
    whatever the pod believes when they are sent), for the test that the simulation finds it."""

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            mode="sequence",
            gap_timeout_ms=self.gap_timeout_ms,
            on_gap_timeout=self.on_gap_timeout,  # type: ignore[arg-type]
            on_late=self.on_late,  # type: ignore[arg-type]
            dedup_ttl_ms=self.dedup_ttl_ms,
            max_in_flight_per_key=self.max_in_flight,
            ack_deadline_ms=self.ack_deadline_ms,
            max_delivery_attempts=self.max_attempts,
            backoff_initial_ms=100,
            backoff_maximum_ms=1_000,
            on_dead_letter=self.on_dead_letter,  # type: ignore[arg-type]
            max_idle_keys=self.max_idle_keys,
        )

    def store_config(self) -> SubscriptionStoreConfig:
        return SubscriptionStoreConfig(
            mode="sequence",
            dedup_ttl_ms=self.dedup_ttl_ms,
            on_dead_letter=self.on_dead_letter,  # type: ignore[arg-type]
            shards=self.shards,
        )


@dataclass
class ShardLoad:
    """One shard's paged load under way (the runtime's ``_load_pending``): gone at a crash."""

    entry: ShardEngine
    """The runtime's own record of a loading shard: ``admit`` (its ``handed`` refs) is the rule that
    each stored record reaches the engine once, whether a page or the intake hands it over first."""
    pages: AsyncGenerator[list[Message], None]
    """``DocumentStore.pending_pages`` for the shard, suspended between pages."""


@dataclass
class Life:
    """What one process holds in memory: gone at a crash."""

    store: DocumentStore
    engines: dict[int, Engine]
    """One per shard this pod delivers (loaded when it took the shard)."""
    believed: dict[int, int]
    """Shard -> the lease epoch this pod thinks it holds (its fences)."""
    to_ack: list[int] = field(default_factory=list)
    """Pub/Sub copies persisted, not yet acked (the ack is its own step)."""
    outstanding: dict[str, Deliver] = field(default_factory=dict)
    """Deliveries the app holds, by delivery id."""
    acks: list[AckIntent] = field(default_factory=list)
    """Acks the engine accepted, not yet committed."""
    dead_letters: list[DeadLetter] = field(default_factory=list)
    drops: list[Message] = field(default_factory=list)
    accepted: set[Identity] = field(default_factory=set)
    """Identities whose app ack the engine accepted in this life."""
    held_bytes: int = 0
    fast: dict[int, tuple[int, Message]] = field(default_factory=dict)
    """Fast-path messages by ``id``: (the Pub/Sub copy whose ack waits, the engine's message)."""
    ack_tasks: list[tuple[asyncio.Task[None], list[AckIntent]]] = field(default_factory=list)
    """``commit_acks`` calls under way: one with fast-path acks waits for its shards' checkpoint."""
    loads: dict[int, ShardLoad] = field(default_factory=dict)
    """Shards whose pending messages are still being read (``SimConfig.paged``)."""
    budget: PayloadBudget | None = None
    """The payload budget shared by the loads under way (the runtime's ``_payload_budget``)."""
    seen: list[Message] = field(default_factory=list)
    """The last stored records handed to an engine: ``stale_copy`` hands one over again."""
    accepted_by: dict[str, tuple[int, Engine]] = field(default_factory=dict)
    """Delivery id -> (epoch, engine) that accepted its app ack: the runtime's delivery-id prefix."""

    @property
    def engine(self) -> Engine:
        """The engine of the lowest shard held (the only one with one shard): for scripted runs."""
        return self.engines[min(self.engines)]


@dataclass
class DocumentRecords:
    """What the documents hold now: message states, cursor records."""

    def __init__(self, documents: MemoryDocuments) -> None:
        self.documents = documents

    def cursor_passed(self, key: str) -> set[Identity]:
        """Positions of ``key`` its durable cursor record passed or finished (a fast-path message's
        ack leaves nothing else: no document)."""
        record = next((fields for fields in self.cursor_records() if fields.get("key") == key), None)
        if record is None:
            return set()
        passed = {(key, seq) for seq in range(1, int(record.get("next_seq") or 1))}
        return passed | {(key, seq) for seq in record.get("above_seq") or []}

    def cursor_records(self) -> list[dict[str, Any]]:
        """Every key's cursor as written: checkpoint overlay entries first (recovery prefers them),
        then cursor documents."""
        overlays = [
            entry
            for path, fields in self.documents.docs.items()
            if "/checkpoints/" in path
            for entry in (fields.get(layout.OVERLAY) or {}).values()
        ]
        return overlays + [fields for path, fields in self.documents.docs.items() if "/keys/" in path]

    def snapshot_of_messages(self) -> dict[str, dict[str, Any]]:
        """Every message document as it is now (to show that a refused Commit changed nothing)."""
        return {path: dict(fields) for path, fields in self.documents.docs.items() if "/messages/" in path}

    def pending_documents(self) -> set[Identity]:
        return self.documents_in(("pending",))

    def finished_documents(self) -> set[Identity]:
        return {(key, seq) for key, seq, _ in self.finished_contents()}

    def finished_contents(self) -> set[tuple[str, int, bytes]]:
        """(key, seq, fingerprint) of every message acked or dead-lettered durably."""
        return {
            (fields["key"], fields["seq"], fields["fp"])
            for fields in self.message_documents(("acked", DEAD_LETTERED, DEAD_LETTERED_ASIDE))
        }

    def documents_in(self, states: tuple[str, ...]) -> set[Identity]:
        return {(fields["key"], fields["seq"]) for fields in self.message_documents(states)}

    def message_documents(self, states: tuple[str, ...]) -> list[dict[str, Any]]:
        return [
            fields
            for path, fields in self.documents.docs.items()
            if "/messages/" in path and "/chunks/" not in path and fields.get("state") in states
        ]


async def next_page(pages: AsyncGenerator[list[Message], None]) -> list[Message] | None:
    """The next page, None after the last."""
    try:
        return await anext(pages)
    except StopAsyncIteration:
        return None


def kept_bytes(messages: Sequence[Message]) -> int:
    """Payload bytes of ``messages`` kept in memory (the sim's ``held_bytes`` counts no bookkeeping)."""
    return sum(len(m.payload.data) for m in messages if m.payload is not None and not m.payload.stripped)


def lease_path(shard: int) -> str:
    return f"pubsub-sidecar/{SUB}/leases/{shard:04d}"


def content_of(message: Message) -> tuple[str, int, bytes]:
    assert message.sequence is not None
    return (message.key, message.sequence, message.fingerprint)


def identity_of(message: Message) -> Identity:
    assert message.sequence is not None
    return (message.key, message.sequence)
