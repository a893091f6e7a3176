"""What the sidecar asks of durable storage, independent of Firestore.

``sidecar.store`` implements it on Firestore; ``sidecar.memory_store`` implements it in memory for
component tests (not durable). Ingest calls ``persist``; delivery calls ``commit_acks`` and only then
confirms the acks to the app; recovery calls ``load`` before anything is delivered.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sidecar.engine.types import AckIntent, EngineSnapshot, Message, Payload


class StoreError(Exception):
    """Base of the store's errors; third-party errors are translated into these at the boundary."""


class StoreUnavailable(StoreError):
    """Transient: nothing was decided, try again later (Pub/Sub keeps the message meanwhile)."""


class StoreRejected(StoreError):
    """Permanent for this input (e.g. larger than any document split allows)."""


@dataclass(frozen=True, slots=True)
class IncomingMessage:
    """A Pub/Sub message classified by ingest (key, position, dedup id), ready to persist."""

    key: str
    dedup_id: str
    message_id: str
    data: bytes
    attributes: dict[str, str]
    ordering_key: str
    publish_time_ms: int
    fingerprint: bytes
    sequence: int | None = None
    timestamp_ms: int | None = None

    def to_message(self, stored_at_ms: int, ref: str) -> Message:
        """The engine's view of this message once a store made it durable under ``ref``."""
        return Message(
            key=self.key,
            dedup_id=self.dedup_id,
            message_id=self.message_id,
            fingerprint=self.fingerprint,
            stored_at_ms=stored_at_ms,
            sequence=self.sequence,
            timestamp_ms=self.timestamp_ms,
            payload=Payload(
                data=self.data,
                attributes=dict(self.attributes),
                publish_time_ms=self.publish_time_ms,
                ordering_key=self.ordering_key,
                ref=ref,
            ),
        )


class PersistOutcome(enum.Enum):
    STORED = "stored"
    """Newly durable: hand ``message`` to the engine, then ack Pub/Sub."""
    DUPLICATE = "duplicate"
    """Already stored with the same content: ack Pub/Sub, nothing else."""
    CONFLICT = "conflict"
    """Same identity (key and sequence) with other content: dead-letter the new one, then ack."""
    FAILED = "failed"
    """Not decided (``error`` says why): do not ack; Pub/Sub redelivers."""


@dataclass(frozen=True, slots=True)
class PersistResult:
    outcome: PersistOutcome
    message: Message
    error: StoreError | None = None


class Store(Protocol):
    async def persist(
        self, subscription: str, batch: Sequence[IncomingMessage], now_ms: int
    ) -> list[PersistResult]:
        """Make each message durable unless it already is; one result per input, in order."""
        ...

    async def commit_acks(self, subscription: str, acks: Sequence[AckIntent], now_ms: int) -> None:
        """Make app acks durable (tombstones plus coalesced cursors). Raises StoreError if not."""
        ...

    async def mark_done(self, subscription: str, messages: Sequence[Message], state: str, now_ms: int) -> None:
        """Record a terminal state other than an ack: "dead_lettered" or "dropped" (a duplicate the
        engine found, e.g. below the cursor). Raises StoreError if not durable."""
        ...

    async def load(self, subscription: str, now_ms: int) -> EngineSnapshot:
        """Cursors and pending messages, to rebuild the engine before anything is delivered."""
        ...

    async def close(self) -> None: ...
