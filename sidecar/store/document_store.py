"""``DocumentStore``: the ``Store`` protocol over a document database (``sidecar.store.documents``).

Model, under the root collection (default ``pubsub-sidecar``), per subscription ``{root}/{name}``:

- ``{root}/{name}``: the subscription document: ``mode`` (a subscription stored in one ordering mode
  is refused in another) and ``clean_ms``, the checkpoint of the cursor documents.
- ``{root}/{name}/messages/{id}``: one document per message (``sidecar.store.layout``). ``state``
  is ``pending`` until the message is acked, dead-lettered or dropped; it then becomes a
  *tombstone*: data and attributes are removed, identity and fingerprint stay (a late redelivery is
  still a duplicate), and ``expire_at`` = finish time + dedup TTL is set for a TTL policy. Pending
  documents never carry ``expire_at``: TTL never deletes an undelivered message.
- ``{root}/{name}/keys/{hash(key)}``: the key's cursor (``sidecar.store.cursors``); it never expires.

Writes, and why:

- ``persist``: create-if-absent through BatchWrite (``sidecar.store.persist``).
- ``commit_acks``/``mark_done`` write tombstones in atomic Commits and return only once they are
  durable. **All tombstones of one key in a call go into one Commit**, together with the cursor
  document when it is due: a cursor (on the cursor document or on a tombstone) never becomes durable
  before the tombstones it passes. Cursor documents are coalesced (at most one write per key per
  ``cursor_write_interval_ms``); the checkpoint ``clean_ms`` says up to when all cursor documents are
  current, and ``load`` folds in the tombstones finished since then (``sidecar.store.recovery``).
- ``load`` reads the subscription document, the cursor documents, the pending messages and the
  recent tombstones, and leaves every decision to the pure ``recovery.recover``.

Cost per delivered message in steady state: 1 write (create) + 1 write (tombstone) + at most one
cursor write per key per interval, and no reads; +1 read per duplicate; +2 per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sidecar.engine.types import AckIntent, EngineSnapshot, KeyCursor, Message
from sidecar.store import documents as docs
from sidecar.store import layout, recovery
from sidecar.store.api import (
    DEAD_LETTERED,
    DEAD_LETTERED_ASIDE,
    IncomingMessage,
    PersistResult,
    StoreError,
    StoreRejected,
    SubscriptionStoreConfig,
)
from sidecar.store.cursors import (
    CursorBook,
    CursorRules,
    KeyState,
    cursor_fields,
    fold_unblock,
    is_blocked,
    key_cursor,
    position_of,
)
from sidecar.store.layout import message_path
from sidecar.store.persist import Persister
from sidecar.store.reader import Progress, Reader

_LOGGER = logging.getLogger(__name__)

_TOMBSTONES_PER_COMMIT = 400
"""Leaves 100 writes of each ack Commit for piggybacked cursor documents and the checkpoint."""



def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class _Subscription:
    name: str
    config: SubscriptionStoreConfig
    path: str
    """Relative path of the subscription document."""
    book: CursorBook
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    checkpoint_ms: int | None = None
    checkpoint_written_ms: int | None = None
    checkpoint_stale: bool = False
    """A Commit changed tombstones or cursors after the last checkpoint write."""


@dataclass(frozen=True, slots=True)
class _Finish:
    """One tombstone to write: which document, which state, and what it tells the cursor."""

    message: Message
    doc_id: str
    chunks: int
    state: str
    cursor: int | tuple[int, str] | None
    ack: AckIntent | None = None
    dead_letter: Message | None = None
    """A dead letter (state ``dead_lettered`` or ``dead_lettered_aside``): folded into the key's cursor."""
    aside: bool = False
    """A replay finished outside its key's order: recorded, folded into no cursor (``layout``)."""


def rules_of(config: SubscriptionStoreConfig) -> CursorRules:
    start = None if config.first_sequence_any else config.sequence_start
    return CursorRules(config.mode, config.on_dead_letter, start)


class DocumentStore:
    """``Store`` over ``Documents``. One instance per process; it owns and closes ``documents``."""

    def __init__(
        self,
        documents: docs.Documents,
        subscriptions: Mapping[str, SubscriptionStoreConfig],
        *,
        root: str = "pubsub-sidecar",
        cursor_write_interval_ms: int = 1_000,
        clock_ms: Callable[[], int] = wall_clock_ms,
        background_flush: bool = True,
        tombstones_per_commit: int = _TOMBSTONES_PER_COMMIT,
    ) -> None:
        for what, segment in [("root", root), *(("subscription name", name) for name in subscriptions)]:
            if (
                not segment
                or "/" in segment
                or segment in (".", "..")
                or len(segment.encode()) > 1500
                or (segment.startswith("__") and segment.endswith("__"))
            ):
                raise ValueError(f"{what} {segment!r} is not a valid Firestore id (no '/', not __x__, <= 1500 bytes)")
        if cursor_write_interval_ms <= 0:
            raise ValueError(f"cursor_write_interval_ms: must be positive, got {cursor_write_interval_ms}")
        self._documents = documents
        self._clock_ms = clock_ms
        self._root = root
        self._interval_ms = cursor_write_interval_ms
        self._subscriptions = {
            name: _Subscription(name, config, f"{root}/{name}", CursorBook(rules_of(config), cursor_write_interval_ms))
            for name, config in subscriptions.items()
        }
        self._persister = Persister(documents, message_path)
        self._reader = Reader(documents)
        self._background_flush = background_flush
        if not 1 <= tombstones_per_commit <= _TOMBSTONES_PER_COMMIT:
            raise ValueError(f"tombstones_per_commit: must be 1..{_TOMBSTONES_PER_COMMIT}, got {tombstones_per_commit}")
        self._per_commit = tombstones_per_commit
        """Tombstone writes per ack Commit (lower only in tests, to split batches over several Commits)."""
        self._flush_wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    def _sub(self, name: str) -> _Subscription:
        sub = self._subscriptions.get(name)
        if sub is None:
            raise StoreRejected(f"unknown subscription {name!r}; configured: {sorted(self._subscriptions)}")
        return sub

    async def ping(self) -> None:
        """One cheap read (1 document read), for readiness; raises StoreError if the database does not answer."""
        await self._documents.get_all([f"{self._root}/ping"])

    # ---- persist --------------------------------------------------------------------------------

    async def persist(self, subscription: str, batch: Sequence[IncomingMessage], now_ms: int) -> list[PersistResult]:
        sub = self._sub(subscription)
        return await self._persister.persist(sub.path, sub.config, batch, now_ms)

    # ---- acks, terminal states, cursors -------------------------------------------------------

    async def commit_acks(self, subscription: str, acks: Sequence[AckIntent], now_ms: int) -> None:
        sub = self._sub(subscription)
        items = []
        for ack in acks:
            target = layout.doc_id_of(ack.message)
            if target is None:
                raise StoreRejected(f"commit_acks: message {ack.message.dedup_id!r} was never stored (no ref)")
            if ack.aside:
                items.append(_Finish(ack.message, target[0], target[1], layout.ACKED, None, aside=True))
            else:
                items.append(_Finish(ack.message, target[0], target[1], layout.ACKED, ack.cursor, ack=ack))
        await self._finish(sub, items, now_ms, "commit_acks")

    async def mark_done(self, subscription: str, messages: Sequence[Message], state: str, now_ms: int) -> None:
        if state not in layout.FINISH_STATES:
            raise ValueError(f"mark_done: state must be one of {sorted(layout.FINISH_STATES)}, got {state!r}")
        sub = self._sub(subscription)
        items = []
        for message in messages:
            # A CONFLICT's copy has no ref: its document holds the other payload, which stays pending.
            target = layout.doc_id_of(message)
            if target is None:
                continue
            dead = state in (DEAD_LETTERED, DEAD_LETTERED_ASIDE) and position_of(message) is not None
            # A replay dead-lettered aside (refused, or flagged and failed) may share its position with
            # another message: recorded, never folded.
            aside = bool(message.replay_id) and state != DEAD_LETTERED
            dead = dead and not aside
            items.append(
                _Finish(message, target[0], target[1], state, None, dead_letter=message if dead else None, aside=aside)
            )
        await self._finish(sub, items, now_ms, "mark_done")

    async def _finish(self, sub: _Subscription, items: list[_Finish], now_ms: int, what: str) -> None:
        """Tombstones in Commits of <= 500 writes; one key's tombstones never span two Commits."""
        if not items:
            return
        by_key: dict[str, list[_Finish]] = {}
        for item in items:
            by_key.setdefault(item.message.key, []).append(item)
        commits: list[list[_Finish]] = [[]]
        size = 0
        for group in by_key.values():
            for part in _split_group(group, self._per_commit):
                part_size = sum(1 + item.chunks for item in part)
                if commits[-1] and size + part_size > self._per_commit:
                    commits.append([])
                    size = 0
                commits[-1].extend(part)
                size += part_size
        async with sub.lock:
            for commit in commits:
                writes: list[docs.Write] = []
                for item in commit:
                    path = message_path(sub.path, item.doc_id)
                    fields = layout.tombstone_fields(
                        item.message, item.state, now_ms, sub.config.dedup_ttl_ms, item.cursor, aside=item.aside
                    )
                    writes.append(docs.replace(path, fields))
                    writes += [docs.delete(f"{path}/chunks/{layout.chunk_doc_id(i)}") for i in range(item.chunks)]
                acks = [item.ack for item in commit if item.ack is not None]
                dead = [i.dead_letter for i in commit if i.dead_letter is not None and i.state == DEAD_LETTERED]
                aside = [i.dead_letter for i in commit if i.dead_letter is not None and i.state != DEAD_LETTERED]
                proposed = sub.book.propose(acks, dead, now_ms, aside)
                await self._commit_cursors(sub, writes, proposed, now_ms, what)
        self._maybe_wake_flusher(sub)

    async def unblock(self, subscription: str, key: str, now_ms: int) -> object | None:
        sub = self._sub(subscription)
        async with sub.lock:
            current = sub.book.states.get(key)
            if current is None or current.blocked_at is None or not is_blocked(current):
                return None
            position = current.blocked_at
            state = current.copy()
            fold_unblock(state, sub.book.mode, position)
            # Written now, whatever the coalescing interval: the operator's answer waits for it, and
            # the document carries every durable change of the key (the book holds nothing else).
            fields = cursor_fields(state)
            fields["written_ms"] = now_ms
            await self._documents.commit([docs.replace(f"{sub.path}/keys/{layout.key_doc_id(key)}", fields)])
            sub.book.accept({key: state}, [state], now_ms)
        return position

    async def _commit_cursors(
        self, sub: _Subscription, writes: list[docs.Write], proposed: dict[str, KeyState], now_ms: int, what: str
    ) -> None:
        """Commit ``writes`` plus the cursor documents now due (and the checkpoint), then book them."""
        due = sub.book.due(now_ms, proposed, docs.MAX_WRITES - len(writes) - 1)
        for state in due:
            fields = cursor_fields(state)
            fields["written_ms"] = now_ms
            writes.append(docs.replace(f"{sub.path}/keys/{layout.key_doc_id(state.key)}", fields))
        written = {state.key for state in due}
        remaining = [s.dirty_since_ms for s in sub.book.dirty_states(proposed) if s.key not in written]
        clean_ms = min((ms for ms in remaining if ms is not None), default=now_ms)
        write_checkpoint = bool(
            (writes or due or sub.checkpoint_stale)
            and clean_ms != sub.checkpoint_ms
            and (sub.checkpoint_written_ms is None or now_ms - sub.checkpoint_written_ms >= self._interval_ms)
        )
        if write_checkpoint:
            # Name and mode too: a store that acks before any load() must not leave a mode-less document.
            checkpoint = {"name": sub.name, "mode": sub.config.mode, "clean_ms": clean_ms, "v": layout.LAYOUT_VERSION}
            writes.append(docs.merge(sub.path, checkpoint, list(checkpoint)))
        if not writes:
            return
        await self._documents.commit(writes)
        sub.book.accept(proposed, due, now_ms)
        if write_checkpoint:
            sub.checkpoint_ms, sub.checkpoint_written_ms = clean_ms, now_ms
        sub.checkpoint_stale = not write_checkpoint

    def _maybe_wake_flusher(self, sub: _Subscription) -> None:
        if not self._background_flush or not (sub.book.has_dirty() or sub.checkpoint_stale):
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="store-cursor-flush")
        self._flush_wake.set()

    async def _flush_loop(self) -> None:
        """Writes cursors left dirty (their key was written < interval ago) once they are due."""
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            await asyncio.sleep(self._interval_ms / 1000)
            for sub in self._subscriptions.values():
                try:
                    await self.flush(sub.name)
                except StoreError as exc:
                    _LOGGER.warning("store: cursor flush of %s failed, will retry: %s", sub.name, exc)
                    self._flush_wake.set()
                    continue
                self._maybe_wake_flusher(sub)

    async def flush(self, subscription: str) -> None:
        """Write every due dirty cursor and the checkpoint now (the background task calls this)."""
        sub = self._sub(subscription)
        async with sub.lock:
            await self._commit_cursors(sub, [], {}, self._clock_ms(), "cursor flush")

    # ---- load -----------------------------------------------------------------------------------

    async def _checkpoint(self, sub: _Subscription, now_ms: int) -> int | None:
        """Check the stored mode, create the document on first use; returns the checkpoint."""
        found = (await self._documents.get_all([sub.path])).get(sub.path)
        if found is None:
            fields = {
                "name": sub.name,
                "mode": sub.config.mode,
                "created_ms": now_ms,
                "clean_ms": now_ms,
                "v": layout.LAYOUT_VERSION,
            }
            try:
                await self._documents.commit([docs.create(sub.path, fields)])
            except docs.AlreadyExists:
                return await self._checkpoint(sub, now_ms)  # another process created it meanwhile
            return now_ms
        try:
            return recovery.checkpoint_of(sub.name, sub.config.mode, sub.path, found)
        except (recovery.ModeMismatch, layout.CorruptDocument) as exc:
            raise StoreRejected(str(exc)) from exc

    async def load(
        self,
        subscription: str,
        now_ms: int,
        progress: Progress | None = None,
        max_payload_bytes: int | None = None,
    ) -> EngineSnapshot:
        sub = self._sub(subscription)
        loaded = 0

        def count(n: int) -> None:
            nonlocal loaded
            loaded += n
            if progress is not None:
                progress(loaded)

        async with sub.lock:
            checkpoint = await self._checkpoint(sub, now_ms)
            since = recovery.since_ms(checkpoint)
            reader = self._reader
            cursor_docs = await reader.query_all(sub.path, "keys", None, None, count)
            recent_docs = await reader.query_all(
                sub.path, "messages", docs.Filter("done_ms", "GREATER_THAN_OR_EQUAL", since), "done_ms", count
            )
            try:
                pending = await reader.load_pending(sub.path, max_payload_bytes, count)
                recovered = recovery.recover(rules_of(sub.config), cursor_docs, recent_docs, pending, since)
            except layout.CorruptDocument as exc:
                raise StoreRejected(f"recovery of subscription {sub.name!r} stopped at {sub.path}: {exc}") from exc
            sub.book.restore(recovered.states, dirty_since_ms=since)
            sub.checkpoint_ms = checkpoint
        self._maybe_wake_flusher(sub)
        return recovered.snapshot

    def cursor(self, subscription: str, key: str) -> KeyCursor | None:
        sub = self._sub(subscription)
        state = sub.book.states.get(key)
        return None if state is None else key_cursor(state, sub.config.mode)

    async def read_payloads(self, subscription: str, messages: Sequence[Message], now_ms: int) -> list[Message]:
        return await self._reader.read_payloads(self._sub(subscription).path, messages)

    async def close(self) -> None:
        """Stop the flush task, write what is dirty (best effort), close the documents; idempotent."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        for sub in self._subscriptions.values():
            if sub.book.has_dirty():
                try:
                    await self.flush(sub.name)
                except StoreError as exc:
                    # Harmless: load() recovers the cursors from the tombstones.
                    _LOGGER.warning("store: final cursor flush of %s failed: %s", sub.name, exc)
        await self._documents.close()


def _split_group(group: list[_Finish], per_commit: int) -> list[list[_Finish]]:
    """One key's tombstones in parts of at most ``per_commit`` writes (one part unless the
    key has a very large in-flight window of chunked messages). Only the last part carries cursors:
    an earlier part, committed first, records just the finished positions (``done_above``), which are
    true on their own, so no cursor is ever durable ahead of a tombstone."""
    parts: list[list[_Finish]] = [[]]
    size = 0
    for item in group:
        if parts[-1] and size + 1 + item.chunks > per_commit:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += 1 + item.chunks
    for part in parts[:-1]:
        for i, item in enumerate(part):
            if item.ack is not None:
                ack = AckIntent(item.ack.delivery_id, item.ack.message, None)
                part[i] = _Finish(item.message, item.doc_id, item.chunks, item.state, None, ack=ack, aside=item.aside)
    return parts


