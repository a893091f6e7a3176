"""Writes that advance keys: tombstones, cursor documents, checkpoints and unblocks, in Commits grouped
by shard, each Commit fenced by the leases of the shards it touches.

Several pods share a subscription; a key's shard has one owner at a time, recorded in the shard's
lease document (``owner``, ``epoch``; the lease manager takes and renews it). A ``FenceSource``
gives, per (subscription, shard), the ``documents.Fence`` this pod's writes must pass: the lease
must still name this pod with the epoch it holds. Every Commit of this module carries one fence per
shard it writes to, and ``Documents.commit`` applies it only if every fence holds.

Why the old owner can do no harm (a pod paused past its lease, or cut off, that wakes and writes):
on Firestore a fenced Commit is a read-write transaction that reads the fence documents and commits
the writes. Firestore's read-write transactions are serializable: a transaction that commits read
every document at a version no committed write precedes that it did not see. A new owner's lease
write (a compare-and-set on the lease's ``update_time``) either comes before the old owner's
transaction read the lease, and the fence sees the new owner or epoch and fails, or after the
transaction committed, and then every write of the old owner is already durable before the new
owner's lease exists, so the new owner's load (which comes after its lease write) reads it. In
production the transaction holds its read locks pessimistically until it commits, so the lease
write waits; in the project's emulator (``sidecar/emulators/firestore/transactions.py``) a commit
whose read document changed since it was read is aborted. Either way no write of an old owner
applies after the lease changed. The pod's clock plays no part in this argument.

Rules:

- **One Commit may cover several shards, with one fence each** (one read each): commits stay few.
  A key's tombstones stay in one Commit (``_split_group`` aside), and the cursor documents and
  checkpoints that ride along are those of the shards the Commit already touches.
- **A failed fence loses only its shards.** ``Fenced`` names the fences that failed; their shards
  are lost: the book forgets them (``CursorBook.release``: their pending cursor updates are
  dropped and never retried by this pod), and the same Commit is sent again without them. The
  other Commits of the call go on. The caller raises ``ShardLost`` at the end, once everything
  outside the lost shards is durable.
- **A shard's checkpoint** (``layout.checkpoint_path``, ``clean_ms``) is written only here, fenced:
  an old owner can no more move it than a cursor.
- Persist (intake: creates) is never fenced: any pod stores any message, and a create decides
  nothing about order.
- **A drop never replaces a finished tombstone.** A ``dropped`` tombstone replaces its message
  document only if that is still the pending record: the document is read first, outside any
  transaction, and the drop is a compare-and-set on the version read (``update_time``). A stale
  copy of a record the owner finished meanwhile (a read-back or a Listen snapshot older than the
  owner's ack) would otherwise replace an ``acked`` tombstone, the only durable record of the key's
  cursor until the next checkpoint, with one recovery does not fold: the next owner's cursor would
  stop at a sequence no longer pending, and the key would wait for it for good. A record found no
  longer pending makes its drop moot (left out); a compare-and-set that fails (the record changed
  between the read and the Commit) fails the whole Commit, which is planned again from a new read.
- **A transaction reads nothing but lease documents.** Firestore keeps a read-write transaction's
  read locks until it commits, rolls back, or has been idle 60 s, and a process killed between
  its reads and its Commit leaves them for that long; every write to a locked document waits
  (transactions and plain writes alike). A drop's guard read inside the transaction would so lock
  a message document that the next owner's acks write at once (its record was pending, so it is
  delivered and acked again): all its acks in that Commit would wait up to a minute. A read
  outside the transaction locks nothing; the compare-and-set keeps the guarantee.

Cost: one lease read per shard touched per fenced Commit; nothing without fences; one read per
dropped record (its guard), fenced or not, and again after a failed compare-and-set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.engine.types import AckIntent, Message
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.api import DEAD_LETTERED, DROPPED, ShardLost, SubscriptionStoreConfig
from sidecar.store.cursor_book import CursorBook
from sidecar.store.cursor_documents import cursor_fields, overlay_fields
from sidecar.store.cursors import CursorState, skips_of

_SHARDS_PER_FLUSH_COMMIT = 100
"""Shards per flush Commit: leaves most of its 500 writes for cursor documents, and bounds the
fence reads of one transaction."""

FenceSource = Callable[[str, int], docs.Fence | None]
"""(subscription, shard) -> the fence this pod's writes to the shard must pass (None: none);
raises ``ShardLost`` at once when the pod knows it does not own the shard."""


@dataclass(slots=True)
class Subscription:
    """What the store keeps in memory for one subscription."""

    name: str
    config: SubscriptionStoreConfig
    path: str
    """Relative path of the subscription document."""
    book: CursorBook
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    checkpoint_ms: dict[int, int | None] = field(default_factory=dict)
    """Per shard: the ``clean_ms`` its checkpoint document holds, as far as this pod knows."""
    checkpoint_written_ms: dict[int, int] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)
    """Shards whose checkpoint lags behind their cursors (the flush writes it)."""
    waiters: dict[int, list[asyncio.Future[None]]] = field(default_factory=dict)
    """Per shard: acks of fast-path messages waiting for the shard's next checkpoint, which makes
    them durable (``DocumentStore.commit_acks``). Resolved by that Commit; failed with ShardLost."""
    epochs: dict[int, int] = field(default_factory=dict)
    """Per shard: the lease epoch its cursor state was loaded under (``load(epoch=...)``). Its
    writes are fenced with that epoch, and decisions made under another one are refused
    (``refused``): the same pod may lose a shard and take it again at a later epoch, and what its
    engine of the earlier epoch accepted must not be written, nor confirmed, under the new one."""
    lost_epochs: dict[int, int] = field(default_factory=dict)
    """Per shard: the epoch it was last forgotten at (for ``ShardLost.epochs``)."""

    def shard(self, key: str) -> int:
        return self.book.shard(key)

    def forget(self, shards: Iterable[int]) -> None:
        """The pod lost ``shards``: drop their cursor state and checkpoint bookkeeping."""
        lost = set(shards)
        self.book.release(lost)
        for shard in lost:
            self.checkpoint_ms.pop(shard, None)
            self.checkpoint_written_ms.pop(shard, None)
            epoch = self.epochs.pop(shard, None)
            if epoch is not None:
                self.lost_epochs[shard] = epoch
            for waiter in self.waiters.pop(shard, []):
                if not waiter.done():
                    waiter.set_exception(ShardLost(self.name, [shard], self.lost_at(lost)))
        self.stale -= lost

    def refused(self, epochs: Mapping[int, int] | None, shards: Iterable[int]) -> dict[int, int]:
        """Of ``shards``, those whose decisions were made under an epoch (``epochs``) other than
        the one their state is held at now (or whose state is not held): shard -> that epoch.
        Without ``epochs`` (a store without leases) nothing is refused."""
        if epochs is None:
            return {}
        return {shard: epochs[shard] for shard in shards if shard in epochs and self.epochs.get(shard) != epochs[shard]}

    def lost_at(self, shards: Iterable[int]) -> dict[int, int]:
        """The epochs ``shards`` were lost at, where known."""
        return {shard: self.lost_epochs[shard] for shard in shards if shard in self.lost_epochs}

    def checkpointed(self, shard: int, clean_ms: int, now_ms: int) -> None:
        """The shard's checkpoint was written: ``clean_ms`` holds; the acks waiting for it are durable
        when it left nothing out."""
        self.checkpoint_ms[shard], self.checkpoint_written_ms[shard] = clean_ms, now_ms
        if clean_ms == now_ms:
            self.stale.discard(shard)
            for waiter in self.waiters.pop(shard, []):
                if not waiter.done():
                    waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class Finish:
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


class ShardWriter:
    """Plans and sends the fenced Commits of one store."""

    def __init__(
        self, documents: docs.Documents, fences: FenceSource | None, interval_ms: int, per_commit: int
    ) -> None:
        self._documents = documents
        self.fences = fences
        self._interval_ms = interval_ms
        self._per_commit = per_commit

    async def finish(self, sub: Subscription, items: list[Finish], now_ms: int) -> set[int]:
        """Tombstones in Commits of <= ``per_commit`` writes, grouped by shard; one key's tombstones
        never span two Commits. Returns the shards lost on the way (nothing of theirs applied)."""
        by_key: dict[str, list[Finish]] = {}
        for item in sorted(items, key=lambda item: sub.shard(item.message.key)):
            by_key.setdefault(item.message.key, []).append(item)
        commits: list[list[Finish]] = [[]]
        size = 0
        for group in by_key.values():
            for part in _split_group(group, self._per_commit):
                part_size = sum(1 + item.chunks for item in part)
                if commits[-1] and size + part_size > self._per_commit:
                    commits.append([])
                    size = 0
                commits[-1].extend(part)
                size += part_size
        lost: set[int] = set()
        for commit in commits:
            shards = {sub.shard(item.message.key) for item in commit}
            await self._commit(sub, commit, shards, now_ms, lost)
        return lost

    async def flush(
        self, sub: Subscription, now_ms: int, max_shards: int | None = None, *, only: Iterable[int] | None = None
    ) -> set[int]:
        """Every due dirty cursor and lagging checkpoint, in one Commit; returns the shards lost.
        Only shards whose checkpoint is due: a shard written less than an interval ago would cost a
        fence read and write nothing. With ``max_shards``, only that many of them, those written
        longest ago first (``due_shards``). With ``only``: those shards' dirty cursors and lagging
        checkpoints, due or not (a hand-over: the next owner then reads every cursor there)."""
        if only is not None:
            shards = sorted(set(only) & (sub.book.dirty_shards() | sub.stale))
        else:
            shards = sorted(self.due_shards(sub, now_ms)[:max_shards])
        lost: set[int] = set()
        for start in range(0, len(shards), _SHARDS_PER_FLUSH_COMMIT):
            part = set(shards[start : start + _SHARDS_PER_FLUSH_COMMIT])
            await self._commit(sub, [], part, now_ms, lost, force=only is not None)
        return lost

    def due_shards(self, sub: Subscription, now_ms: int) -> list[int]:
        """The shards whose checkpoint (or cursors) a flush would write now, written longest ago first."""
        written = sub.checkpoint_written_ms
        due = [shard for shard in sub.book.dirty_shards() | sub.stale if self._due(sub, shard, now_ms)]
        return sorted(due, key=lambda shard: (written.get(shard, -1), shard))

    async def unblock(self, sub: Subscription, state: CursorState, now_ms: int) -> set[int]:
        """Write the key's cursor (in its shard's checkpoint) now, whatever the coalescing interval
        (an unblock, or an operator's gap skip); returns the shards lost (the key's, when its fence
        failed: nothing written)."""
        shard = sub.shard(state.key)
        lost: set[int] = set()
        fences = self.acquire(sub, {shard}, lost)
        if lost:
            sub.forget(lost)
            return lost
        # Into the shard's checkpoint at once (with every other change of the shard), whatever the
        # coalescing interval: the operator's answer waits for it.
        state.changed_ms = now_ms
        state.dirty_since_ms = state.dirty_since_ms or now_ms
        proposed = {state.key: state}
        plan = _plan_checkpoint(sub, shard, proposed, docs.MAX_WRITES - 1, now_ms)
        if await self._send(sub, plan.writes, fences, lost):
            sub.book.accept(proposed, now_ms, documents=plan.spill, overlays={shard: plan.kept})
            sub.checkpointed(shard, plan.clean_ms, now_ms)
        return lost

    # ---- internals ------------------------------------------------------------------------------

    async def _commit(
        self,
        sub: Subscription,
        items: list[Finish],
        shards: set[int],
        now_ms: int,
        lost: set[int],
        *,
        force: bool = False,
    ) -> None:
        """``items``' tombstones plus the due cursors and checkpoints of ``shards``, fenced; booked
        once durable. Lost shards are dropped and the rest is sent again until it applies."""
        moot: set[str] = set()
        """Paths of drops found moot: their record is no longer pending."""
        items = _without_redundant_drops(sub, items)
        while True:
            shards -= lost
            items = [item for item in items if sub.shard(item.message.key) not in lost and not _moot(sub, item, moot)]
            if not shards:
                return
            fences = self.acquire(sub, shards, lost)
            if lost & shards:
                sub.forget(lost)
                continue
            versions = await self._pending_versions(sub, items, moot)
            items = [item for item in items if not _moot(sub, item, moot)]
            writes: list[docs.Write] = []
            for item in items:
                path = layout.message_path(sub.path, item.doc_id)
                fields = layout.tombstone_fields(
                    item.message,
                    item.state,
                    now_ms,
                    sub.config.dedup_ttl_ms,
                    item.cursor,
                    sub.shard(item.message.key),
                    aside=item.aside,
                    skipped=skips_of(item.ack) if item.ack is not None else (),
                )
                if item.state == DROPPED:
                    # A drop finishes a record that is still pending, never a tombstone: an acked one
                    # carries the key's cursor until the next checkpoint (module docstring).
                    writes.append(docs.compare_and_set(path, fields, versions[path]))
                else:
                    writes.append(docs.replace(path, fields))
                writes += [docs.delete(f"{path}/chunks/{layout.chunk_doc_id(i)}") for i in range(item.chunks)]
            acks = [item.ack for item in items if item.ack is not None]
            dead = [i.dead_letter for i in items if i.dead_letter is not None and i.state == DEAD_LETTERED]
            aside = [i.dead_letter for i in items if i.dead_letter is not None and i.state != DEAD_LETTERED]
            proposed = sub.book.propose(acks, dead, now_ms, aside)
            room = docs.MAX_WRITES - len(writes) - len(shards)
            spilled: list[CursorState] = []
            overlays: dict[int, list[CursorState]] = {}
            cleans: dict[int, int] = {}
            for shard in self._due_checkpoints(sub, shards, proposed, now_ms, force):
                plan = _plan_checkpoint(sub, shard, proposed, room, now_ms)
                room -= len(plan.spill)
                writes += plan.writes
                cleans[shard] = plan.clean_ms
                spilled += plan.spill
                overlays[shard] = plan.kept
            if not writes:
                return
            try:
                if not await self._send(sub, writes, fences, lost):
                    continue
            except docs.PreconditionFailed:
                if not versions:
                    raise
                continue  # a dropped record changed since it was read: read it again
            sub.book.accept(proposed, now_ms, documents=spilled, overlays=overlays)
            for shard, clean in cleans.items():
                sub.checkpointed(shard, clean, now_ms)
            return

    def _due_checkpoints(
        self, sub: Subscription, shards: set[int], proposed: dict[str, CursorState], now_ms: int, force: bool = False
    ) -> list[int]:
        """The shards among ``shards`` whose checkpoint this Commit writes: those with a change not
        yet in a cursor record (or a lagging checkpoint), at most once per interval each (``force``:
        whenever); the others that lag are marked stale (the background flush writes them)."""
        lagging = (sub.book.dirty_shards(proposed) | sub.stale) & shards
        out: list[int] = []
        for shard in sorted(lagging):
            if force or self._due(sub, shard, now_ms):
                out.append(shard)
            sub.stale.add(shard)  # until the Commit that writes it succeeds
        return out

    def _due(self, sub: Subscription, shard: int, now_ms: int) -> bool:
        """Whether ``shard``'s checkpoint may be written now: at most once per interval."""
        last = sub.checkpoint_written_ms.get(shard)
        return last is None or now_ms - last >= self._interval_ms

    def next_due_ms(self, sub: Subscription, now_ms: int) -> int | None:
        """When the first checkpoint that acks wait for is due (None: no ack waits for one)."""
        lagging = {shard for shard, waiting in sub.waiters.items() if waiting}
        if not lagging:
            return None
        written = sub.checkpoint_written_ms
        return min(now_ms if shard not in written else written[shard] + self._interval_ms for shard in lagging)

    def acquire(self, sub: Subscription, shards: set[int], lost: set[int]) -> dict[int, docs.Fence]:
        """The fence of each of ``shards``; a shard the source says is lost goes to ``lost``, and so
        does one the pod now holds at another epoch than its state was loaded under (the state is
        that epoch's: a write of it under the new epoch would pass a fence it was never decided
        under)."""
        if self.fences is None:
            return {}
        out: dict[int, docs.Fence] = {}
        for shard in sorted(shards):
            try:
                fence = self.fences(sub.name, shard)
            except ShardLost:
                lost.add(shard)
                continue
            if fence is None:
                continue
            loaded = sub.epochs.get(shard)
            if loaded is not None and fence.expected.get("epoch", loaded) != loaded:
                lost.add(shard)
                continue
            out[shard] = fence
        return out

    async def _pending_versions(self, sub: Subscription, items: list[Finish], moot: set[str]) -> dict[str, int]:
        """Read the message documents of ``items``' drops (one batched read, no transaction: it locks
        nothing): the version of each still pending, by path; the others go to ``moot``."""
        paths = [layout.message_path(sub.path, item.doc_id) for item in items if item.state == DROPPED]
        if not paths:
            return {}
        _read_us, found = await self._documents.get_versioned(paths)
        versions: dict[str, int] = {}
        for path in paths:
            record = found.get(path)
            if (
                record is None
                or record.fields is None
                or record.update_time_us is None
                or record.fields.get("state") != layout.PENDING
            ):
                moot.add(path)
            else:
                versions[path] = record.update_time_us
        return versions

    async def _send(
        self, sub: Subscription, writes: list[docs.Write], fences: dict[int, docs.Fence], lost: set[int]
    ) -> bool:
        """Commit; False when a fence failed (its shards are then in ``lost`` and forgotten). A
        compare-and-set that fails raises ``PreconditionFailed``."""
        if not fences:
            await self._documents.commit(writes)  # no transaction: an unfenced Commit costs what it did
            return True
        try:
            await self._documents.commit(writes, list(fences.values()))
        except docs.Fenced as exc:
            failed = {shard for shard, fence in fences.items() if fence.path in exc.paths}
            if not failed:  # not told which: every one
                failed = set(fences)
            lost |= failed
            sub.forget(failed)
            return False
        return True


@dataclass(frozen=True, slots=True)
class _CheckpointPlan:
    writes: list[docs.Write]
    """The keys moved to their own cursor documents, then the checkpoint itself."""
    kept: list[CursorState]
    spill: list[CursorState]
    clean_ms: int


def _plan_checkpoint(
    sub: Subscription, shard: int, proposed: dict[str, CursorState], room: int, now_ms: int
) -> _CheckpointPlan:
    """The writes of ``shard``'s checkpoint now (``CursorBook.plan_checkpoint``), with its clean time."""
    kept, spill, left = sub.book.plan_checkpoint(shard, proposed, room, now_ms)
    clean_ms = now_ms if left is None else left
    writes = [_cursor_write(sub, state, shard, now_ms) for state in spill]
    writes.append(_checkpoint_write(sub, shard, clean_ms, kept))
    return _CheckpointPlan(writes, kept, spill, clean_ms)


def _checkpoint_write(sub: Subscription, shard: int, clean_ms: int, overlay: list[CursorState]) -> docs.Write:
    """The shard's checkpoint: ``clean_ms`` and the overlay of cursors (``CursorBook``), as one replace."""
    fields: dict[str, Any] = {layout.SHARD: shard, "clean_ms": clean_ms, "v": layout.LAYOUT_VERSION}
    fields[layout.OVERLAY] = {layout.key_doc_id(state.key): overlay_fields(state) for state in overlay}
    return docs.replace(layout.checkpoint_path(sub.path, shard), fields)


def _cursor_write(sub: Subscription, state: CursorState, shard: int, now_ms: int) -> docs.Write:
    fields = cursor_fields(state)
    fields["written_ms"] = now_ms
    fields[layout.SHARD] = shard
    return docs.replace(f"{sub.path}/keys/{layout.key_doc_id(state.key)}", fields)


def _moot(sub: Subscription, item: Finish, moot: set[str]) -> bool:
    return item.state == DROPPED and layout.message_path(sub.path, item.doc_id) in moot


def _without_redundant_drops(sub: Subscription, items: list[Finish]) -> list[Finish]:
    """``items`` without the drops of a record that another item finishes too (a second copy of
    the record in the call, or its ack): the drop would only replace that tombstone, and one
    compare-and-set after a write to its own document can never apply."""
    others = {layout.message_path(sub.path, item.doc_id) for item in items if item.state != DROPPED}
    kept: list[Finish] = []
    for item in items:
        if item.state == DROPPED:
            path = layout.message_path(sub.path, item.doc_id)
            if path in others:
                continue
            others.add(path)
        kept.append(item)
    return kept


def _split_group(group: list[Finish], per_commit: int) -> list[list[Finish]]:
    """One key's tombstones in parts of at most ``per_commit`` writes (one part unless the
    key has a very large in-flight window of chunked messages). Only the last part carries cursors:
    an earlier part, committed first, records just the finished positions (``done_above``), which are
    true on their own, so no cursor is ever durable ahead of a tombstone."""
    parts: list[list[Finish]] = [[]]
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
                part[i] = Finish(item.message, item.doc_id, item.chunks, item.state, None, ack=ack, aside=item.aside)
    return parts
