"""``persist``: make incoming messages durable with create-if-absent, and decide what each one was.

Rules:

- A message is created with an ``exists=false`` precondition through **BatchWrite**, which reports
  a status per write: a duplicate is a refused create, decided by the database, and it does not fail
  its neighbours as it would in an atomic Commit. Messages over ~1 MB (data in chunk documents) use
  one atomic Commit each.
- **ALREADY_EXISTS is read back** (one batched get per persist call). A tombstone there (acked,
  dead-lettered, dropped) makes the copy a DUPLICATE. A *pending* document there is handed to the
  engine as ``PersistResult.pending``: it may be one the engine has never seen (our own earlier
  create that applied although its RPC failed), and a redelivery of a pending message must reach
  the engine, which drops it if it already holds it. In sequence mode another fingerprint there is
  a CONFLICT.
- **Intake for another pod** (``IncomingMessage.to_owner``): the document carries ``inbox`` (its
  shard), which the shard owner's Listen watches. A copy that finds the document still *pending*
  without ``inbox`` (its first persist ran while this pod owned the shard, or on another pod that
  did) merges ``inbox`` into it (mask ``["inbox"]``, must exist) before the result is reported, so
  the message reaches the owner whoever stored it first; if that merge fails the copy is FAILED.
- A write RPC that failed is FAILED for its messages (Pub/Sub keeps them); a request refused as
  invalid is split in halves so that only the culprit fails; a permission or configuration error is
  FAILED too, never a dead letter: a misconfiguration must not dead-letter data.

Cost: one write per new message; one read per duplicate (+1 write when it gains ``inbox``); +2 per
chunk of a chunked message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.engine.types import Message
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.api import (
    IncomingMessage,
    PersistOutcome,
    PersistResult,
    StoreError,
    StoreRejected,
    StoreUnavailable,
    SubscriptionStoreConfig,
)


@dataclass(slots=True)
class _Plan:
    """One message's create: where, what, and how it went."""

    index: int
    incoming: IncomingMessage
    doc_id: str
    fields: dict[str, Any]
    chunks: list[bytes]
    size: int
    status: str = ""
    """"stored", "exists", or "" (failed: see ``error``)."""
    error: StoreError | None = None


class Persister:
    """Executes ``persist`` for one store: plans creates, writes them, reads back what existed."""

    def __init__(self, documents: docs.Documents, message_path: Callable[[str, str], str]) -> None:
        self._documents = documents
        self._message_path = message_path
        """(subscription path, doc id) -> the message document's path."""

    async def persist(
        self, sub_path: str, config: SubscriptionStoreConfig, batch: Sequence[IncomingMessage], now_ms: int
    ) -> list[PersistResult]:
        results: list[PersistResult | None] = [None] * len(batch)
        first: dict[str, _Plan] = {}
        repeats: list[_Plan] = []
        for index, incoming in enumerate(batch):
            plan = self._plan(sub_path, index, incoming, now_ms, shard_of(incoming.key, config.shards))
            if plan.error is not None:
                results[index] = PersistResult(PersistOutcome.FAILED, _message(plan, now_ms), plan.error)
            elif plan.doc_id in first:
                repeats.append(plan)  # one BatchWrite may not write a document twice
            else:
                first[plan.doc_id] = plan
        plans = list(first.values())
        inline = [plan for plan in plans if not plan.chunks]
        await asyncio.gather(
            *(self._batch_write(sub_path, group) for group in _groups(inline)),
            *(self._commit_chunked(sub_path, plan) for plan in plans if plan.chunks),
        )
        existing = await self._read_existing(sub_path, plans)
        await self._address_to_owner(sub_path, plans, existing)
        chunk_data = await self._read_pending_chunks(sub_path, plans, existing)
        for plan in plans:
            results[plan.index] = _outcome(config, plan, existing, chunk_data, now_ms)
        for plan in repeats:
            results[plan.index] = _repeat_outcome(config, plan, first[plan.doc_id], existing, results, now_ms)
        return [result for result in results if result is not None]

    def _plan(self, sub_path: str, index: int, incoming: IncomingMessage, now_ms: int, shard: int) -> _Plan:
        doc_id = layout.message_doc_id(incoming.key, incoming.dedup_id, incoming.sequence, incoming.replay_id)
        path = self._message_path(sub_path, doc_id)
        fields = layout.message_fields(incoming, now_ms, chunks=0, shard=shard)
        size = layout.document_size(path, fields)
        chunks: list[bytes] = []
        if size > layout.INLINE_LIMIT_BYTES:
            chunks = layout.split_data(incoming.data)
            fields = layout.message_fields(incoming, now_ms, chunks=len(chunks), shard=shard)
            size = layout.document_size(path, fields)
        plan = _Plan(index, incoming, doc_id, fields, chunks, size)
        if len(chunks) > layout.MAX_CHUNKS or size > layout.INLINE_LIMIT_BYTES:
            plan.error = StoreRejected(
                f"message {incoming.message_id!r} of key {incoming.key[:100]!r} is too large to store: "
                f"{len(incoming.data):,} data bytes (limit {layout.MAX_CHUNKS * layout.CHUNK_BYTES:,}), "
                f"{size:,} bytes besides the data (limit {layout.INLINE_LIMIT_BYTES:,})"
            )
        return plan

    async def _batch_write(self, sub_path: str, group: list[_Plan]) -> None:
        writes = [docs.create(self._message_path(sub_path, plan.doc_id), plan.fields) for plan in group]
        try:
            statuses = await self._documents.batch_write(writes)
        except docs.RequestRejected as exc:
            if len(group) > 1:
                # The request as a whole was refused: split it so that only the culprit fails.
                middle = len(group) // 2
                await self._batch_write(sub_path, group[:middle])
                await self._batch_write(sub_path, group[middle:])
                return
            for plan in group:
                plan.error = exc
            return
        except StoreError as exc:
            # Permissions or a missing database are not the message's fault: keep it in Pub/Sub.
            for plan in group:
                plan.error = StoreUnavailable(f"persist: {exc}")
            return
        for plan, (code, message) in zip(group, statuses, strict=True):
            if code == docs.OK:
                plan.status = "stored"
            elif code == docs.ALREADY_EXISTS:
                plan.status = "exists"
            elif code in docs.INPUT_CODES:
                plan.error = StoreRejected(f"Firestore refused message {plan.incoming.message_id!r}: {message}")
            else:
                kind = "unavailable" if code in docs.RETRYABLE_CODES else f"error {code}"
                plan.error = StoreUnavailable(f"Firestore {kind} for message {plan.incoming.message_id!r}: {message}")

    async def _commit_chunked(self, sub_path: str, plan: _Plan) -> None:
        """Main document (exists=false) and its chunks in one atomic Commit."""
        path = self._message_path(sub_path, plan.doc_id)
        writes = [docs.create(path, plan.fields)]
        writes += [
            docs.replace(f"{path}/chunks/{layout.chunk_doc_id(i)}", {"d": chunk}) for i, chunk in enumerate(plan.chunks)
        ]
        try:
            await self._documents.commit(writes)
        except docs.AlreadyExists:
            plan.status = "exists"
            return
        except docs.RequestRejected as exc:
            plan.error = exc
            return
        except StoreError as exc:
            plan.error = StoreUnavailable(f"persist: {exc}")
            return
        plan.status = "stored"

    async def _read_existing(self, sub_path: str, plans: list[_Plan]) -> dict[str, dict[str, Any] | None]:
        """The stored documents of refused creates, in one batched read."""
        wanted = [plan for plan in plans if plan.status == "exists"]
        if not wanted:
            return {}
        paths = {plan.doc_id: self._message_path(sub_path, plan.doc_id) for plan in wanted}
        try:
            found = await self._documents.get_all(list(paths.values()))
        except StoreError as exc:
            for plan in wanted:
                plan.status, plan.error = "", StoreUnavailable(f"persist: reading a duplicate back: {exc}")
            return {}
        return {doc_id: found.get(path) for doc_id, path in paths.items()}

    async def _address_to_owner(
        self, sub_path: str, plans: list[_Plan], existing: dict[str, dict[str, Any] | None]
    ) -> None:
        """Merge ``inbox`` into pending documents a ``to_owner`` copy found without it (one BatchWrite)."""
        wanted = []
        for plan in plans:
            stored = existing.get(plan.doc_id)
            if (
                plan.incoming.to_owner
                and stored is not None
                and stored.get("state") == layout.PENDING
                and layout.INBOX not in stored
            ):
                wanted.append((plan, stored))
        if not wanted:
            return
        inbox = layout.INBOX
        writes = [
            docs.Write(self._message_path(sub_path, plan.doc_id), {inbox: plan.fields[layout.SHARD]}, (inbox,), True)
            for plan, _ in wanted
        ]
        try:
            statuses = await self._documents.batch_write(writes)
        except StoreError as exc:
            statuses = [(14, str(exc))] * len(writes)
        for (plan, stored), (code, message) in zip(wanted, statuses, strict=True):
            if code == docs.OK:
                stored[inbox] = plan.fields[layout.SHARD]
            else:
                # Not acked: the redelivery tries again (or finds a tombstone: nothing to hand over).
                plan.status = ""
                plan.error = StoreUnavailable(f"persist: addressing pending {plan.doc_id} to its owner: {message}")

    async def _read_pending_chunks(
        self, sub_path: str, plans: list[_Plan], existing: dict[str, dict[str, Any] | None]
    ) -> dict[str, bytes]:
        """Data of existing pending documents kept in chunks (rare: a large message whose create
        applied unseen), so that it can reach the engine like any other pending copy."""
        wanted: dict[str, list[str]] = {}
        for plan in plans:
            stored = existing.get(plan.doc_id)
            if stored is not None and stored.get("state") == layout.PENDING and stored.get("chunks"):
                path = self._message_path(sub_path, plan.doc_id)
                count = int(stored["chunks"])
                wanted[plan.doc_id] = [f"{path}/chunks/{layout.chunk_doc_id(i)}" for i in range(count)]
        if not wanted:
            return {}
        try:
            found = await self._documents.get_all([path for paths in wanted.values() for path in paths])
        except StoreError:
            return {}  # the copy is acked as a duplicate; the document stays pending for the next load
        data: dict[str, bytes] = {}
        for doc_id, paths in wanted.items():
            parts = [found.get(path) for path in paths]
            if all(part is not None and isinstance(part.get("d"), bytes) for part in parts):
                data[doc_id] = b"".join(part["d"] for part in parts if part is not None)
        return data


def _groups(plans: list[_Plan]) -> list[list[_Plan]]:
    groups: list[list[_Plan]] = []
    size = 0
    for plan in plans:
        if not groups or len(groups[-1]) >= docs.MAX_WRITES or size + plan.size > layout.MAX_REQUEST_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(plan)
        size += plan.size
    return groups


def _message(plan: _Plan, now_ms: int, *, stored: bool = True) -> Message:
    ref = layout.ref_for(plan.doc_id, len(plan.chunks)) if stored else ""
    return layout.message_from_incoming(plan.incoming, now_ms, ref)


def _pending_copy(plan: _Plan, stored: dict[str, Any], chunk_data: dict[str, bytes]) -> Message | None:
    """The stored document as the engine's message, when it is still pending."""
    if stored.get("state") != layout.PENDING:
        return None
    data = chunk_data.get(plan.doc_id)
    if stored.get("chunks") and data is None:
        return None  # chunks unreadable now: the document stays pending for the next load
    try:
        return layout.message_from_fields(plan.doc_id, stored, data)
    except layout.CorruptDocument:
        return None


def _outcome(
    config: SubscriptionStoreConfig,
    plan: _Plan,
    existing: dict[str, dict[str, Any] | None],
    chunk_data: dict[str, bytes],
    now_ms: int,
) -> PersistResult:
    if plan.status == "stored":
        return PersistResult(PersistOutcome.STORED, _message(plan, now_ms))
    if plan.status != "exists":
        assert plan.error is not None
        return PersistResult(PersistOutcome.FAILED, _message(plan, now_ms), plan.error)
    stored = existing.get(plan.doc_id)
    if stored is None:
        # Gone between the create and the read (TTL): the next attempt creates it.
        error = StoreUnavailable(f"message document {plan.doc_id} vanished while checking a duplicate")
        return PersistResult(PersistOutcome.FAILED, _message(plan, now_ms), error)
    pending = _pending_copy(plan, stored, chunk_data)
    if config.mode == "sequence" and stored.get("fp") != plan.incoming.fingerprint:
        return PersistResult(PersistOutcome.CONFLICT, _message(plan, now_ms, stored=False), pending=pending)
    return PersistResult(PersistOutcome.DUPLICATE, _message(plan, now_ms), pending=pending)


def _repeat_outcome(
    config: SubscriptionStoreConfig,
    plan: _Plan,
    original: _Plan,
    existing: dict[str, dict[str, Any] | None],
    results: list[PersistResult | None],
    now_ms: int,
) -> PersistResult:
    """A second copy in the same batch: decided by the first copy's fate (which already carries
    any pending original for the engine)."""
    first = results[original.index]
    assert first is not None
    if first.outcome is PersistOutcome.FAILED:
        return PersistResult(PersistOutcome.FAILED, _message(plan, now_ms), first.error)
    if config.mode == "sequence":
        stored = existing.get(original.doc_id)
        fingerprint = original.incoming.fingerprint if stored is None else stored.get("fp")
        if fingerprint != plan.incoming.fingerprint:
            return PersistResult(PersistOutcome.CONFLICT, _message(plan, now_ms, stored=False))
    return PersistResult(PersistOutcome.DUPLICATE, _message(plan, now_ms))
