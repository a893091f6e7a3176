"""One configured relay on this pod: the outbox's Listen, the relay's shard leases, a worker per held
shard (``ShardRelay``), and what it reports.

Rules:

- **The view.** A Listen on the outbox collection keeps every entry (id, fields read by
  ``entries.read_entry``, update time) by shard (``shard_of(key)``; an entry without a usable key
  by ``shard_of(id)``). Snapshots are consistent: an entry missing from a snapshot committed after
  every entry in it, so numbering what a snapshot shows never skips an earlier entry of a key. A
  stale view (deletes not seen yet) is harmless: the counters skip what was settled.
- **One writer per key**: a shard is worked only while its lease is held (``sidecar.cluster``'s
  ``ShardLeases``, public API only: ``run``, ``fence``, ``shard_lost``, ``owned``, ``release_all``),
  and every settle is fenced by it. ``on_gained`` starts the shard's worker with a new
  ``ShardRelay`` (counters read afresh); ``on_lost`` cancels it; ``before_release`` lets its
  current step end first (a step cut between publish and settle is safe, only wasteful).
- **Backoff.** A step that failed (publish failure, store error) is tried again after
  ``backoff_seconds`` (capped, jittered; ``sidecar.backoff``), with nothing moved meanwhile, so a
  key's order never changes. A step that settled something is followed at once by the next.
- **Start.** ``check`` asks Pub/Sub whether this process may publish to the relay's topic: a reason
  not to start (``RelayRefused``, one line), before anything runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.backoff import backoff_seconds
from sidecar.cluster.leases import ShardLeases
from sidecar.config.relays import RelayConfig
from sidecar.publishing.entries import Entry, Rules, Unpublishable, read_entry
from sidecar.publishing.publisher import Publisher
from sidecar.publishing.shard_relay import ShardCounts, ShardRelay
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store import outbox
from sidecar.store.api import ShardLost, StoreError

_LOGGER = logging.getLogger(__name__)

_BACKOFF_INITIAL_SECONDS = 0.05
_BACKOFF_MAXIMUM_SECONDS = 10.0
_LISTEN_RETRY_MAXIMUM_SECONDS = 10.0
_RELEASE_WAIT_SECONDS = 5.0
_ENTRY_ID = re.compile(r"[A-Za-z0-9_-]{1,100}")


class RelayRefused(Exception):
    """The relay cannot run as configured (e.g. its topic takes no publishes from this process). One line."""


@dataclass(frozen=True, slots=True)
class WaitingEntry:
    """An entry in the waiting room, as the operator sees it."""

    relay: str
    entry_id: str
    key: str | None
    reason: str
    retry_helps: bool
    """True: the relay gave up on it (a retry may help); False: unpublishable as written."""


class Relay:
    def __init__(
        self,
        config: RelayConfig,
        *,
        project: str,
        root: str,
        documents: docs.Documents,
        publisher: Publisher,
        pod_id: str,
        leases: Callable[..., ShardLeases] = ShardLeases,
    ) -> None:
        self.config = config
        self.name = config.name
        self._documents = documents
        self._publisher = publisher
        self._relay_root = outbox.relay_root(root, config.name)
        self._rules = Rules(project, config.topic, config.key_attribute, config.sequence.attribute, config.ordering_key)
        self._view: dict[int, dict[str, Entry | Unpublishable]] = {}
        self._shard_of_entry: dict[str, int] = {}
        self._wakes: dict[int, asyncio.Event] = {}
        self._workers: dict[int, tuple[asyncio.Task[None], ShardRelay]] = {}
        self._totals = ShardCounts()
        self._listening: docs.Listening | None = None
        self._waiting_listening: docs.Listening | None = None
        self._given_up: dict[str, str] = {}
        """Entry id -> reason, for the entries the relay gave up on (the waiting documents)."""
        self._writes: set[asyncio.Task[None]] = set()
        self._closed = False
        self._listen_failures = 0
        self.snapshots = 0
        self.leases = leases(
            documents,
            self._relay_root,
            config.shards,
            pod_id,
            lease_ms=config.lease_duration_ms,
            on_gained=self._on_gained,
            on_lost=self._on_lost,
            before_release=self._before_release,
        )

    # ---- start and stop ----------------------------------------------------------------------

    async def check(self) -> None:
        """``RelayRefused`` (one line) when the relay's topic takes no publishes from this process."""
        reason = await self._publisher.can_publish(self.config.topic)
        if reason is not None:
            raise RelayRefused(f"relay {self.name!r}: {reason}")

    async def run(self) -> None:
        """Listen to the outbox and keep the leases until cancelled (or ``stop``)."""
        self._listen()
        try:
            await self.leases.run()
        finally:
            await self._close_listen()

    async def stop(self) -> None:
        """Hand the shards over (each worker ends its step first), stop listening."""
        await self.leases.release_all(self._drain)
        await self._close_listen()

    # ---- the view --------------------------------------------------------------------------

    def _listen(self, which: str = "both") -> None:
        if self._closed:
            return
        if which in ("both", "outbox"):
            self._listening = outbox.listen_outbox(
                self._documents, self.config.outbox.collection, self._on_change, self._on_listen_error
            )
        if which in ("both", "waiting"):
            self._waiting_listening = outbox.listen_waiting(
                self._documents, self._relay_root, self._on_waiting, self._on_waiting_error
            )

    async def _close_listen(self) -> None:
        self._closed = True
        listening, self._listening = self._listening, None
        waiting, self._waiting_listening = self._waiting_listening, None
        for one in (listening, waiting):
            if one is not None:
                await one.close()

    def _on_waiting(self, change: docs.Change) -> None:
        """The waiting documents: what the relay gave up on; one removed is an operator's retry or
        discard, and its key may flow again."""
        if change.initial:
            gone = set(self._given_up) - {entry_id for entry_id, _, _ in change.upserts}
        else:
            gone = set(change.removals)
        for entry_id, fields, _ in change.upserts:
            self._given_up[entry_id] = str(fields.get("reason", ""))
        for entry_id in gone:
            self._given_up.pop(entry_id, None)
            shard = self._shard_of_entry.get(entry_id)
            held = self._workers.get(shard) if shard is not None else None
            if held is not None:
                held[1].attempts.pop(entry_id, None)
            if shard is not None:
                self._wake(shard)

    def _record_give_up(self, entry_id: str, key: str, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self._give_up(entry_id, key, reason))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _give_up(self, entry_id: str, key: str, reason: str) -> None:
        for attempt in range(8):
            try:
                await outbox.give_up(self._documents, self._relay_root, entry_id, key, reason)
                return
            except StoreError as exc:
                _LOGGER.warning("relay %s: recording entry %s as waiting failed: %s", self.name, entry_id, exc)
                await asyncio.sleep(backoff_seconds(attempt, 0.1, _BACKOFF_MAXIMUM_SECONDS))

    def _on_listen_error(self, error: StoreError, which: str = "outbox") -> None:
        self._listen_failures += 1
        _LOGGER.error("relay %s: the Listen on the %s failed: %s; listening again", self.name, which, error)
        delay = backoff_seconds(min(self._listen_failures, 8), 0.5, _LISTEN_RETRY_MAXIMUM_SECONDS)
        asyncio.get_running_loop().call_later(delay, self._listen, which)

    def _on_waiting_error(self, error: StoreError) -> None:
        self._on_listen_error(error, "waiting")

    def _on_change(self, change: docs.Change) -> None:
        self.snapshots += 1
        touched: set[int] = set()
        if change.initial:
            touched.update(self._view)
            self._view.clear()
            self._shard_of_entry.clear()
        for entry_id in change.removals:
            shard = self._shard_of_entry.pop(entry_id, None)
            if shard is not None:
                self._view[shard].pop(entry_id, None)
                touched.add(shard)  # an entry its key waited behind may be gone (a discard)
        for entry_id, fields, update_time_us in change.upserts:
            entry = read_entry(entry_id, fields, update_time_us, self._rules)
            shard = shard_of(entry.key if entry.key is not None else entry_id, self.config.shards)
            old = self._shard_of_entry.get(entry_id)
            if old is not None and old != shard:
                self._view[old].pop(entry_id, None)
            self._shard_of_entry[entry_id] = shard
            self._view.setdefault(shard, {})[entry_id] = entry
            touched.add(shard)
        for shard in touched:
            self._wake(shard)

    def _wake(self, shard: int) -> None:
        event = self._wakes.get(shard)
        if event is not None:
            event.set()

    # ---- the shards --------------------------------------------------------------------------

    async def _on_gained(self, shard: int, epoch: int) -> None:
        worker = ShardRelay(
            self._relay_root,
            self.config.outbox.collection,
            shard,
            epoch,
            self._documents,
            self._publisher,
            self._rules,
            self.config.sequence.start,
            self.config.max_batch,
            functools.partial(self._fence, shard, epoch),
            lambda: self.leases.holds(shard) == epoch,
            waiting=self._given_up,
            on_give_up=self._record_give_up,
        )
        wake = self._wakes[shard] = asyncio.Event()
        wake.set()
        task = asyncio.get_running_loop().create_task(self._work(worker, wake), name=f"relay-{self.name}-{shard}")
        self._workers[shard] = (task, worker)

    def _fence(self, shard: int, epoch: int) -> docs.Fence:
        """The shard's lease as the fence of a settle planned under ``epoch``: ``ShardLost`` when the
        lease is held at another epoch now (a settle planned under an old one must not pass as new)."""
        fence = self.leases.fence(shard)
        if fence.expected.get("epoch") != epoch:
            raise ShardLost(self._relay_root, [shard], {shard: epoch})
        return fence

    def _on_lost(self, shard: int, epoch: int) -> None:
        held = self._workers.get(shard)
        if held is not None and held[1].epoch == epoch:
            del self._workers[shard]
            self._wakes.pop(shard, None)
            held[0].cancel()
            self._add_totals(held[1].counts)

    async def _before_release(self, shard: int) -> None:
        await self._drain({shard})

    async def _drain(self, shards: set[int]) -> None:
        """Let the shards' workers finish the step they are in, then stop them."""
        tasks = []
        for shard in shards:
            held = self._workers.get(shard)
            wake = self._wakes.pop(shard, None)
            if held is not None:
                tasks.append(held[0])
            if wake is not None:
                wake.set()  # the worker sees its wake event gone after its step, and ends
        stopping = [t for t in tasks if not t.done()]
        if stopping:
            await asyncio.wait(stopping, timeout=_RELEASE_WAIT_SECONDS)

    async def _work(self, worker: ShardRelay, wake: asyncio.Event) -> None:
        attempt = 0
        while self._wakes.get(worker.shard) is wake:
            await wake.wait()
            wake.clear()
            while self._wakes.get(worker.shard) is wake:
                try:
                    step = await worker.step(list(self._view.get(worker.shard, {}).values()))
                except ShardLost:
                    self.leases.shard_lost(worker.shard, worker.epoch)
                    return
                except StoreError as exc:
                    _LOGGER.warning("relay %s shard %d: %s; trying again", self.name, worker.shard, exc)
                    step = None
                except Exception:
                    _LOGGER.exception("relay %s shard %d: step failed; trying again", self.name, worker.shard)
                    step = None
                if step is not None and step.planned == 0:
                    attempt = 0
                    break
                if step is not None and step.failed == 0:
                    attempt = 0
                    continue
                await asyncio.sleep(backoff_seconds(attempt, _BACKOFF_INITIAL_SECONDS, _BACKOFF_MAXIMUM_SECONDS))
                attempt += 1

    def _add_totals(self, counts: ShardCounts) -> None:
        for name in ("published", "settled_batches", "publish_failures", "republished"):
            setattr(self._totals, name, getattr(self._totals, name) + getattr(counts, name))

    # ---- the Publish RPC ---------------------------------------------------------------------

    async def write_entry(self, entry_id: str, fields: dict[str, Any]) -> str:
        """An entry written by the sidecar for an app without Firestore (the ``Publish`` RPC):
        checked as the relay will read it (``ValueError`` with the reason if it can never be
        published), then created, durable on return; its id. An ``entry_id`` given again while the
        entry waits finds it (not a second entry). Not atomic with the app's own database."""
        if not entry_id:
            entry_id = secrets.token_hex(10)
        elif not _ENTRY_ID.fullmatch(entry_id):
            raise ValueError(f"entry_id {entry_id[:100]!r}: use 1-100 letters, digits, '-' or '_'")
        read = read_entry(entry_id, fields, 0, self._rules)
        if isinstance(read, Unpublishable):
            raise ValueError(read.reason)
        try:
            await outbox.write_entry(self._documents, self.config.outbox.collection, entry_id, fields)
        except docs.AlreadyExists:
            pass  # a retry of a write that applied: the entry is there, once
        return entry_id

    # ---- what it reports ---------------------------------------------------------------------

    def waiting(self) -> list[WaitingEntry]:
        """Entries that wait for an operator: unpublishable as written, or failed for good."""
        found: dict[str, WaitingEntry] = {}
        given_up = self._given_up
        for entries in self._view.values():
            for entry in entries.values():
                if isinstance(entry, Unpublishable):
                    found[entry.id] = WaitingEntry(self.name, entry.id, entry.key, entry.reason, False)
                elif entry.id in given_up:
                    found[entry.id] = WaitingEntry(self.name, entry.id, entry.key, given_up[entry.id], True)
        return sorted(found.values(), key=lambda w: w.entry_id)

    def counts(self) -> dict[str, int]:
        totals = ShardCounts(**{n: getattr(self._totals, n) for n in ShardCounts.__dataclass_fields__})
        for _task, worker in self._workers.values():
            for name in ShardCounts.__dataclass_fields__:
                setattr(totals, name, getattr(totals, name) + getattr(worker.counts, name))
        waiting = self.waiting()
        return {
            "relay_pending_entries": sum(len(v) for v in self._view.values()),
            "relay_published": totals.published,
            "relay_republished": totals.republished,
            "relay_settled_batches": totals.settled_batches,
            "relay_publish_failures": totals.publish_failures,
            "relay_waiting_entries": len(waiting),
            "relay_blocked_keys": len({w.key for w in waiting if w.key is not None}),
            "relay_shards_held": len(self._workers),
            "relay_listen_failures": self._listen_failures,
        }

    async def close_workers(self) -> None:
        for task, worker in list(self._workers.values()):
            task.cancel()
            self._add_totals(worker.counts)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()
