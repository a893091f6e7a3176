"""``DocumentStore``: the ``Store`` protocol over a document database (``sidecar.store.documents``).

Model, under the root collection (default ``pubsub-sidecar``), per subscription ``{root}/{name}``:

- ``{root}/{name}``: the subscription document: ``mode`` (a subscription stored in one ordering mode
  is refused in another) and the layout version ``v``.
- ``{root}/{name}/checkpoints/{shard}``: per shard, ``clean_ms``, the checkpoint of its cursor documents.
- ``{root}/{name}/messages/{id}``: one document per message (``sidecar.store.layout``). ``state``
  is ``pending`` until the message is acked, dead-lettered or dropped; it then becomes a
  *tombstone*: data and attributes are removed, identity and fingerprint stay (a late redelivery is
  still a duplicate), and ``expire_at`` = finish time + dedup TTL is set for a TTL policy. Pending
  documents never carry ``expire_at``: TTL never deletes an undelivered message.
- ``{root}/{name}/keys/{hash(key)}``: the key's cursor (``sidecar.store.cursors``); it never expires.
- Message, cursor and checkpoint documents carry the key's ``shard`` (layout v2), so that the owner
  of a shard loads just its shard (``load(shards=...)``).

Writes, and why:

- ``persist``: create-if-absent through BatchWrite (``sidecar.store.persist``).
- ``commit_acks``/``mark_done`` write tombstones in atomic Commits and return only once they are
  durable. **All tombstones of one key in a call go into one Commit**, together with the cursor
  document when it is due: a cursor (on the cursor document or on a tombstone) never becomes durable
  before the tombstones it passes. Cursor documents are coalesced (at most one write per key per
  ``cursor_write_interval_ms``); a shard's checkpoint ``clean_ms`` says up to when all its cursor
  documents are current, and ``load`` folds in the tombstones finished since then
  (``sidecar.store.recovery``). With a ``FenceSource`` every such Commit is fenced by the leases of
  the shards it touches (``sidecar.store.fencing``): a pod that lost a shard cannot advance its keys.
- The cursors and checkpoints left lagging (and the fast-path acks waiting for a checkpoint) are
  written by the background flush, a part of the shards at a time (``sidecar.store.flusher``).
- ``load`` reads the subscription document, the cursor documents, the pending messages and the
  recent tombstones (``sidecar.store.shard_reads``), and leaves every decision to the pure
  ``recovery.recover``. With
  ``pending=False`` it reads all but the pending messages, which ``pending_pages`` then yields a
  query page at a time (``recovery.restorable`` checks and orders each page).

Cost per delivered message in steady state: 1 write (create) + 1 write (tombstone) + at most one
cursor write per key per interval, and no reads; +1 read per duplicate; +2 per chunk; with fences,
+1 read per shard touched per Commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

from sidecar.engine.types import AckIntent, EngineSnapshot, KeyCursor, Message
from sidecar.store import documents as docs
from sidecar.store import layout, recovery
from sidecar.store.api import (
    DEAD_LETTERED,
    DEAD_LETTERED_ASIDE,
    IncomingMessage,
    PayloadBudget,
    PersistResult,
    ShardLost,
    StoreError,
    StoreRejected,
    SubscriptionStoreConfig,
)
from sidecar.store.cursor_book import CursorBook
from sidecar.store.cursors import fold_skip_gap, fold_unblock, is_blocked, key_cursor, position_of, rules_of
from sidecar.store.fencing import FenceSource, Finish, ShardWriter, Subscription
from sidecar.store.flusher import CheckpointFlusher
from sidecar.store.inbox import InboxListening, listen_inbox
from sidecar.store.layout import message_path
from sidecar.store.persist import Persister
from sidecar.store.reader import Progress, Reader
from sidecar.store.shard_reads import read_shards, running_total, stopped

_LOGGER = logging.getLogger(__name__)

_LOADS_AT_ONCE = 4
"""Shard loads reading at once: enough to keep Firestore and the decoding busy together (each load
runs its three reads at once too), few enough that the pages in memory stay a handful."""

_TOMBSTONES_PER_COMMIT = 400
"""Leaves 100 writes of each ack Commit for piggybacked cursor documents and the checkpoint."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


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
        fences: FenceSource | None = None,
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
        self._subscriptions = {
            name: Subscription(name, config, f"{root}/{name}", CursorBook(rules_of(config), cursor_write_interval_ms))
            for name, config in subscriptions.items()
        }
        self._persister = Persister(documents, message_path)
        self._reader = Reader(documents)
        if not 1 <= tombstones_per_commit <= _TOMBSTONES_PER_COMMIT:
            raise ValueError(f"tombstones_per_commit: must be 1..{_TOMBSTONES_PER_COMMIT}, got {tombstones_per_commit}")
        self._writer = ShardWriter(documents, fences, cursor_write_interval_ms, tombstones_per_commit)
        """Plans the Commits that advance keys (tombstones per Commit: lower only in tests)."""
        self._flusher = CheckpointFlusher(
            self._subscriptions, self._writer, cursor_write_interval_ms, clock_ms, enabled=background_flush
        )
        self._load_slots = asyncio.Semaphore(_LOADS_AT_ONCE)

    def _sub(self, name: str) -> Subscription:
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

    async def commit_acks(
        self, subscription: str, acks: Sequence[AckIntent], now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> None:
        sub = self._sub(subscription)
        items = []
        volatile = [ack for ack in acks if ack.message.volatile and not ack.aside]
        for ack in acks:
            if ack.message.volatile and not ack.aside:
                continue
            target = layout.doc_id_of(ack.message)
            if target is None:
                raise StoreRejected(f"commit_acks: message {ack.message.dedup_id!r} was never stored (no ref)")
            if ack.aside:
                items.append(Finish(ack.message, target[0], target[1], layout.ACKED, None, aside=True))
            else:
                items.append(Finish(ack.message, target[0], target[1], layout.ACKED, ack.cursor, ack=ack))
        lost: dict[int, int | None] = {}
        try:
            await self._finish(sub, items, now_ms, "commit_acks", epochs)
        except ShardLost as exc:
            lost.update({shard: exc.epochs.get(shard) for shard in exc.shards})
        if volatile:
            lost.update(await self._volatile_acks(sub, volatile, now_ms, epochs))
        if lost:
            raise ShardLost(sub.name, lost, {shard: epoch for shard, epoch in lost.items() if epoch is not None})

    async def _volatile_acks(
        self, sub: Subscription, acks: list[AckIntent], now_ms: int, epochs: Mapping[int, int] | None
    ) -> dict[int, int | None]:
        """Acks of fast-path messages (no document): folded into their keys' cursors, durable with
        their shards' next checkpoints (coalesced: at most one per shard per interval), which this
        waits for. Returns the shards lost meanwhile (their acks are not durable), with the epoch
        lost where known."""
        async with sub.lock:
            shards = {sub.shard(ack.message.key) for ack in acks}
            refused = sub.refused(epochs, shards)
            lost: set[int] = set()
            if self._writer.fences is not None:
                self._writer.acquire(sub, shards - refused.keys(), lost)
            if lost:
                sub.forget(lost)
            out: dict[int, int | None] = {shard: sub.lost_at(lost).get(shard) for shard in lost}
            out.update(refused)
            mine = [ack for ack in acks if sub.shard(ack.message.key) not in out]
            proposed = sub.book.propose(mine, [], now_ms)
            sub.book.accept(proposed, now_ms)
            loop = asyncio.get_running_loop()
            waits = []
            for shard in sorted(sub.book.dirty_shards() & {sub.shard(ack.message.key) for ack in mine}):
                waiter: asyncio.Future[None] = loop.create_future()
                sub.waiters.setdefault(shard, []).append(waiter)
                waits.append(waiter)
        self._flusher.wake(sub)
        for result in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(result, ShardLost):
                out.update({shard: result.epochs.get(shard) for shard in result.shards})
            elif isinstance(result, BaseException):
                raise result
        return out

    async def mark_done(
        self,
        subscription: str,
        messages: Sequence[Message],
        state: str,
        now_ms: int,
        *,
        epochs: Mapping[int, int] | None = None,
    ) -> None:
        if state not in layout.FINISH_STATES:
            raise ValueError(f"mark_done: state must be one of {sorted(layout.FINISH_STATES)}, got {state!r}")
        sub = self._sub(subscription)
        items = []
        for message in messages:
            # A CONFLICT's copy has no ref: its document holds the other payload, which stays pending.
            # A fast-path message has none either, but its finish is recorded where its document
            # would be (a dead letter's record must outlive the restart that forgets the message).
            target = layout.doc_id_of(message)
            if target is None and message.volatile:
                target = (layout.message_doc_id(message.key, message.dedup_id, message.sequence, message.replay_id), 0)
            if target is None:
                continue
            dead = state in (DEAD_LETTERED, DEAD_LETTERED_ASIDE) and position_of(message) is not None
            # A replay dead-lettered aside (refused, or flagged and failed) may share its position with
            # another message: recorded, never folded.
            aside = bool(message.replay_id) and state != DEAD_LETTERED
            dead = dead and not aside
            items.append(
                Finish(message, target[0], target[1], state, None, dead_letter=message if dead else None, aside=aside)
            )
        await self._finish(sub, items, now_ms, "mark_done", epochs)

    async def _finish(
        self, sub: Subscription, items: list[Finish], now_ms: int, what: str, epochs: Mapping[int, int] | None
    ) -> None:
        if not items:
            return
        async with sub.lock:
            # Under the lock: a load restoring a shard at a new epoch takes it too.
            refused = sub.refused(epochs, {sub.shard(item.message.key) for item in items})
            if refused:
                items = [item for item in items if sub.shard(item.message.key) not in refused]
            lost = await self._writer.finish(sub, items, now_ms) if items else set()
        self._flusher.wake(sub)
        if lost or refused:
            if lost:
                _LOGGER.warning("store: %s of %s: shard(s) %s lost to another owner", what, sub.name, sorted(lost))
            raise ShardLost(sub.name, lost | refused.keys(), {**sub.lost_at(lost), **refused})

    async def unblock(
        self, subscription: str, key: str, now_ms: int, *, epochs: Mapping[int, int] | None = None
    ) -> object | None:
        sub = self._sub(subscription)
        async with sub.lock:
            refused = sub.refused(epochs, {sub.shard(key)})
            if refused:
                raise ShardLost(sub.name, refused, refused)
            current = sub.book.states.get(key)
            if current is None or current.blocked_at is None or not is_blocked(current):
                return None
            position = current.blocked_at
            state = current.copy()
            fold_unblock(state, sub.book.mode, position)
            # Written now, whatever the coalescing interval: the operator's answer waits for it, and
            # the document carries every durable change of the key (the book holds nothing else).
            lost = await self._writer.unblock(sub, state, now_ms)
        if lost:
            raise ShardLost(sub.name, lost, sub.lost_at(lost))
        return position

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
        sub = self._sub(subscription)
        async with sub.lock:
            refused = sub.refused(epochs, {sub.shard(key)})
            if refused:
                raise ShardLost(sub.name, refused, refused)
            current = sub.book.states.get(key)
            state = current.copy() if current is not None else sub.book.rules.new_state(key)
            if sub.book.mode != "sequence" or not fold_skip_gap(state, first, through):
                return False
            # Written now, like an unblock: the operator's answer waits for it.
            lost = await self._writer.unblock(sub, state, now_ms)
        if lost:
            raise ShardLost(sub.name, lost, sub.lost_at(lost))
        return True

    async def flush(self, subscription: str, shards: frozenset[int] | None = None) -> None:
        """Write every due dirty cursor and checkpoint now (the background task writes them a part at
        a time: ``sidecar.store.flusher``); with ``shards``, those shards' unwritten cursors and checkpoints,
        due or not (``Store.flush``: before a hand-over). Raises ShardLost after writing the rest
        when shards were lost (their updates are dropped)."""
        sub = self._sub(subscription)
        if shards is not None:
            self._check_shards(sub, shards, "flush")
        async with sub.lock:
            lost = await self._writer.flush(sub, self._clock_ms(), only=shards)
        if lost:
            raise ShardLost(sub.name, lost, sub.lost_at(lost))

    # ---- load -----------------------------------------------------------------------------------

    async def load(
        self,
        subscription: str,
        now_ms: int,
        progress: Progress | None = None,
        max_payload_bytes: int | PayloadBudget | None = None,
        shards: frozenset[int] | None = None,
        *,
        pending: bool = True,
        epoch: int | None = None,
    ) -> EngineSnapshot:
        sub = self._sub(subscription)
        self._check_shards(sub, shards, "load")
        wanted = frozenset(range(sub.config.shards)) if shards is None else shards
        budget = PayloadBudget(max_payload_bytes) if isinstance(max_payload_bytes, int) else max_payload_bytes
        async with self._load_slots:  # the reads take no lock (``sidecar.store.shard_reads``)
            read = await read_shards(
                self._documents, self._reader, sub, shards, now_ms, budget, running_total(progress), pending=pending
            )
        checkpoints, since, recovered = read.checkpoints, read.since_ms, read.recovered
        async with sub.lock:
            # Only the book: replaced for these shards in one step (no await), so a concurrent load
            # of other shards, or a flush, sees it before or after, never half restored.
            sub.forget(wanted)
            sub.book.restore(recovered.states, dirty_since_ms=since, shards=wanted)
            if epoch is not None:
                sub.epochs.update(dict.fromkeys(wanted, epoch))
            for shard, clean in checkpoints.items():
                sub.checkpoint_ms[shard] = clean
                if clean is None:
                    sub.stale.add(shard)  # written by the next flush, so the next load reads less
        self._flusher.wake(sub)
        return recovered.snapshot

    async def pending_pages(
        self,
        subscription: str,
        shards: frozenset[int] | None,
        max_payload_bytes: int | PayloadBudget | None,
        progress: Progress | None,
    ) -> AsyncGenerator[list[Message], None]:
        # Reads only (no ``sub.lock``): pending documents are the intake's and the acks', and what
        # they change meanwhile reaches the engine through them. One load slot per page, so that
        # pages of many shards and the shards' state loads share the bound on reads at once.
        sub = self._sub(subscription)
        self._check_shards(sub, shards, "pending_pages")
        budget = PayloadBudget(max_payload_bytes) if isinstance(max_payload_bytes, int) else max_payload_bytes
        pages = self._reader.pending_pages(
            sub.path, budget, running_total(progress), shards, attempts=None, slots=self._load_slots
        )
        async with contextlib.aclosing(pages):
            while True:
                try:
                    page = await anext(pages)
                    ordered = list(recovery.restorable(page, sub.config.mode))
                except StopAsyncIteration:
                    return
                except layout.CorruptDocument as exc:
                    raise stopped(sub, exc) from exc
                yield ordered

    @staticmethod
    def _check_shards(sub: Subscription, shards: frozenset[int] | None, what: str) -> None:
        if shards is not None and any(not 0 <= shard < sub.config.shards for shard in shards):
            raise ValueError(f"{what}: shards must be in 0..{sub.config.shards - 1}, got {sorted(shards)}")

    def listen_inbox(
        self,
        subscription: str,
        shard: int,
        on_messages: Callable[[list[Message]], None],
        on_error: Callable[[StoreError], None],
        *,
        skip_initial: bool = False,
        on_initial: Callable[[], None] | None = None,
    ) -> InboxListening:
        """Messages other pods stored for ``shard``'s owner, as they are committed (``sidecar.store.inbox``)."""
        sub = self._sub(subscription)
        return listen_inbox(
            self._documents,
            self._reader,
            sub.path,
            shard,
            on_messages,
            on_error,
            skip_initial=skip_initial,
            on_initial=on_initial,
        )

    def watch_losses(self, subscription: str, callback: Callable[[ShardLost], None]) -> None:
        self._sub(subscription)
        self._flusher.watch_losses(subscription, callback)

    def release(self, subscription: str, shards: frozenset[int]) -> None:
        self._sub(subscription).forget(shards)

    def cursor(self, subscription: str, key: str) -> KeyCursor | None:
        sub = self._sub(subscription)
        state = sub.book.states.get(key)
        return None if state is None else key_cursor(state, sub.config.mode)

    async def read_payloads(self, subscription: str, messages: Sequence[Message], now_ms: int) -> list[Message]:
        return await self._reader.read_payloads(self._sub(subscription).path, messages)

    async def close(self) -> None:
        """Stop the flush task, write what is dirty (best effort), close the documents; idempotent."""
        await self._flusher.stop()
        for sub in self._subscriptions.values():
            if sub.book.has_dirty():
                try:
                    await self.flush(sub.name)
                except StoreError as exc:
                    # Harmless: load() recovers the cursors from the tombstones.
                    _LOGGER.warning("store: final cursor flush of %s failed: %s", sub.name, exc)
        await self._documents.close()
