"""Shard adoption and loss at the runtime: which shards this pod delivers, at which lease epoch.

With several pods on one subscription (``shard_count`` set) the runtime runs one engine per shard
this pod owns (``sidecar.pipeline.shard_engines``); the lease manager (``sidecar.cluster``, joined by
``sidecar.wiring.ownership``) says which. Rules:

- ``adopt`` loads a shard from the store (``runtime_loading``) and starts delivering it; adopting
  it again at another epoch drops the old engine first.
- ``drop`` forgets a shard at once: its engine and held messages (they stay pending in the store),
  its load, its in-flight ids (they become unknown: their acks are refused, never confirmed, and the
  next owner delivers those messages again, which G3 allows for unconfirmed acks), and its
  unsettled fast-path messages (given back to Pub/Sub). A shard drained first (``drain``) was
  handed over on purpose: logged at INFO; any other drop (a lease lost or fenced) at WARNING.
- ``drain`` stops handing a shard out and waits (bounded) for its in-flight acks to be durable,
  then writes its checkpoint, before a graceful hand-over. A flush that cannot finish in time costs
  the next owner a longer load, never a message: the tombstones are durable already.
- The store refuses an advancing write of a shard this pod no longer owns (``ShardLost``): the
  shard is dropped and ``on_lost`` tells the lease manager. A shard this pod holds again at another
  epoch than the one lost is not dropped (only what was decided under the old epoch was refused).
- Before anything is handed to an app (``drop_expired_leases``), every shard whose lease is no
  longer held within its margin now is dropped: a pod that wakes from a pause must not hand out one
  more message before its lease manager has noticed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sidecar.pipeline.runtime_acks import AckPipeline
from sidecar.pipeline.runtime_context import RuntimeContext
from sidecar.pipeline.runtime_fast_path import FastPath
from sidecar.pipeline.runtime_loading import ShardLoading
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.store.api import ShardLost, StoreError

_LOGGER = logging.getLogger(__name__)

_HANDOVER_FLUSH_SECONDS = 1.0
"""At least this long for a drained shard's last checkpoint before a hand-over, whatever is left of
the drain timeout."""


class ShardOwnership:
    """Adopts, drains and drops this pod's shards; tells the lease manager of a shard lost."""

    def __init__(
        self,
        ctx: RuntimeContext,
        loading: ShardLoading,
        acks: AckPipeline,
        fast_path: FastPath,
        wake_streams: Callable[[], None],
    ) -> None:
        self._ctx = ctx
        self._loading = loading
        self._acks = acks
        self._fast_path = fast_path
        self._wake_streams = wake_streams
        self.on_lost: Callable[[int, int], None] | None = None
        """Told (shard, epoch) when the store refused a write because this pod no longer owns a shard."""

    async def adopt(self, shard: int, epoch: int) -> None:
        """This pod now owns ``shard`` at ``epoch``: load it from the store and deliver its keys.

        Retried while the store is unavailable; raises StoreError on a permanent error."""
        ctx = self._ctx
        if ctx.shard_count is None or not 0 <= shard < ctx.shard_count:
            raise ValueError(f"subscription {ctx.name!r}: no shard {shard} to adopt")
        current = ctx.engines.get(shard)
        if current is not None:
            if current.epoch == epoch:
                return
            self.drop(shard, current.epoch)
        await self._loading.adopt(shard, epoch)
        ctx.counters.shards_adopted += 1
        ctx.progress.set()
        ctx.after_change()

    def drop(self, shard: int, epoch: int | None = None) -> bool:
        """Stop delivering ``shard`` at once (lost, or handed over): its engine and held messages are
        forgotten (they stay pending in the store), its in-flight ids become unknown. ``epoch``: only
        if the engine is still that epoch's. Returns whether an engine was dropped."""
        ctx = self._ctx
        entry = ctx.engines.get(shard)
        if entry is None or (epoch is not None and entry.epoch != epoch):
            return False
        ctx.engines.remove(shard)
        self._loading.forget(shard, entry.epoch)
        ctx.store.release(ctx.name, frozenset({shard}))
        self._fast_path.settle_all(entry)
        ctx.counters.shards_dropped += 1
        # A shard drained first was handed over on purpose (a rebalance, a stop): normal operation.
        _LOGGER.log(
            logging.INFO if entry.draining else logging.WARNING,
            "subscription %s: shard %d (epoch %d) %s; its keys are delivered by its next owner",
            ctx.name,
            shard,
            entry.epoch,
            "handed over" if entry.draining else "dropped (its lease was lost or fenced)",
        )
        ctx.progress.set()
        self._wake_streams()
        return True

    async def drain(self, shard: int, timeout_seconds: float) -> None:
        """Before a graceful hand-over: hand out nothing more of ``shard``, wait (up to
        ``timeout_seconds``) until the app acked what it holds of it and those acks are durable,
        then write the shard's unwritten cursors and checkpoint (``Store.flush(shards=...)``), so
        that the next owner starts from a current checkpoint rather than folding tombstones."""
        ctx = self._ctx
        entry = ctx.engines.get(shard)
        if entry is None:
            return
        entry.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while ctx.current(entry) and not self._drained(entry):
            remaining = deadline - loop.time()
            if remaining <= 0:
                _LOGGER.warning(
                    "subscription %s: shard %d handed over with messages still in flight (not confirmed: "
                    "its next owner delivers them again)",
                    ctx.name,
                    shard,
                )
                return
            ctx.progress.clear()
            try:
                await asyncio.wait_for(ctx.progress.wait(), remaining)
            except TimeoutError:
                pass
        if not ctx.current(entry):
            return
        try:
            # Bounded like the drain: the tombstones are durable already, so a flush that cannot
            # finish in time costs the next owner a longer load, never a message.
            await asyncio.wait_for(
                ctx.store.flush(ctx.name, frozenset({shard})), max(deadline - loop.time(), _HANDOVER_FLUSH_SECONDS)
            )
        except ShardLost as exc:
            self.shard_lost(exc)
        except (StoreError, TimeoutError) as exc:
            _LOGGER.warning(
                "subscription %s: shard %d handed over without its last checkpoint (%s); its next owner "
                "rebuilds the cursors from the tombstones",
                ctx.name,
                shard,
                exc or type(exc).__name__,
            )

    def _drained(self, entry: ShardEngine) -> bool:
        status, _ = entry.engine.status(self._ctx.clock(), max_keys=0)
        if status.in_flight:
            return False
        return not self._acks.may_hold_acks_of(entry.shard)

    def drop_expired_leases(self) -> None:
        """Drop every shard whose lease is no longer held within its margin *now*: a pod that wakes
        from a pause must not hand out one more message before its lease manager has noticed."""
        check = self._ctx.lease_check
        if check is None:
            return
        for entry in self._ctx.engines:
            if check(entry.shard) != entry.epoch:
                self._lose(entry)

    def shard_lost(self, exc: ShardLost) -> None:
        """The store refused a write: this pod's lease on those shards has moved on. A shard this
        pod holds again at another epoch than the one lost is not dropped (only what was decided
        under the old epoch was refused)."""
        for shard in sorted(exc.shards):
            entry = self._ctx.engines.get(shard)
            if entry is not None and exc.lost_at(shard, entry.epoch):
                self._lose(entry)

    def _lose(self, entry: ShardEngine) -> None:
        """Drop a shard this pod learnt it no longer owns, and tell the lease manager."""
        if self.drop(entry.shard, entry.epoch) and self.on_lost is not None:
            self.on_lost(entry.shard, entry.epoch)
