"""Glue between one subscription's shard leases, its store and its runtime (several pods).

``sidecar.cluster.leases`` decides which shards this pod owns; this module carries each decision out:

- **Gained** (``on_gained``, awaited before the lease counts as held for delivery): a Listen on the
  shard's inbox (messages other pods stored for it) starts first, and its first snapshot is waited
  for (at most ``first_snapshot_seconds``); then the runtime loads the shard from the store (a
  handover is a recovery). **A first snapshot is left out only if it arrived before the load began
  to read** (the load's reads are later, so they hold everything in it); one that comes later, or
  the first of a Listen started again, is handed over whole: it may hold messages other pods
  committed after the load's page reads, which are in nothing else (a sequence key would wait for
  them for good). Every other inbox change feeds the runtime as ingest does; those that arrive
  while the shard's state is read are kept and handed over once its engine exists. A record both
  loaded by a page and handed over, in either order, reaches the engine once while the shard
  loads (``ShardEngine.admit``); a copy handed over after the load is dropped by the engine as a
  duplicate of what it holds, or of what it finished (a stale copy: its drop leaves the tombstone).
- **Lost** (``on_lost``: a failed renewal, another owner seen, the local deadline passed, or the
  store refusing a fenced write): the runtime drops the shard at once and its Listen closes.
- **Handing over** (``before_release``: balancing, or SIGTERM through ``release_all``): the runtime
  stops handing out the shard's messages and waits, up to ``drain_timeout``, for the app's acks of
  those in flight to be durable; then the lease manager writes the hand-over.
- A Listen on the subscription's lease documents pokes the lease manager, so a released or
  requested shard is seen within one round trip rather than at the next renewal round.

A Listen that fails (or cannot start) is closed and started again after a capped, jittered backoff
(``sidecar.backoff``); meanwhile the shard's keys still deliver everything this pod ingests itself,
and others' intake waits in Firestore. The new Listen's first snapshot is handed over (the load has
read already), so what was committed between the old Listen's last snapshot and it is not lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from sidecar.backoff import backoff_seconds
from sidecar.engine.types import Message
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.store.api import StoreError
from sidecar.store.inbox import InboxListening

_LOGGER = logging.getLogger(__name__)

FIRST_SNAPSHOT_SECONDS = 10.0
"""How long a gained shard's load waits for its inbox Listen's first snapshot. Past it the load goes
ahead; the Listen, late or restarted, then hands over its whole first snapshot when it comes."""

_LISTEN_RETRY_INITIAL_SECONDS = 0.2
_LISTEN_RETRY_MAXIMUM_SECONDS = 10.0


class InboxSource(Protocol):
    """What the store offers for a shard's inbox (``DocumentStore.listen_inbox``)."""

    def listen_inbox(
        self,
        subscription: str,
        shard: int,
        on_messages: Callable[[list[Message]], None],
        on_error: Callable[[StoreError], None],
        *,
        skip_initial: bool = False,
        on_initial: Callable[[], None] | None = None,
    ) -> InboxListening: ...


class ShardOwnership:
    """Carries out one subscription's lease decisions on its runtime and store."""

    def __init__(
        self,
        runtime: SubscriptionRuntime,
        inbox: InboxSource,
        *,
        drain_timeout_seconds: float,
        first_snapshot_seconds: float = FIRST_SNAPSHOT_SECONDS,
    ) -> None:
        self._runtime = runtime
        self._inbox = inbox
        self._drain_timeout = drain_timeout_seconds
        self._first_snapshot_seconds = first_snapshot_seconds
        self._listens: dict[int, InboxListening] = {}
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._loading: dict[int, list[Message]] = {}
        """Shards being gained: inbox messages that arrived meanwhile, handed over once the engine exists."""
        self._before_load: dict[int, asyncio.Event] = {}
        """Shards gained whose load has not begun to read: set when a first inbox snapshot arrived."""
        self.listen_failures = 0
        self.inbox_messages = 0

    # ---- lease manager callbacks -------------------------------------------------------------

    async def on_gained(self, shard: int, epoch: int) -> None:
        first_snapshot = asyncio.Event()
        early: list[Message] = []
        self._loading[shard] = early
        self._before_load[shard] = first_snapshot
        try:
            self._start_listen(shard, epoch, attempt=0)
            try:
                await asyncio.wait_for(first_snapshot.wait(), self._first_snapshot_seconds)
            except TimeoutError:
                _LOGGER.warning(
                    "subscription %s: shard %d's inbox Listen gave no snapshot within %.1fs; loading anyway,"
                    " its first snapshot is handed over when it comes",
                    self._runtime.name,
                    shard,
                    self._first_snapshot_seconds,
                )
            # The load reads from here on: a first snapshot arriving later may hold messages committed
            # after those reads, so it is handed over instead of left out.
            del self._before_load[shard]
            listening = self._listens.get(shard)
            if listening is not None:
                listening.skip_initial = False
            if not first_snapshot.is_set():
                self._runtime.inbox_behind(shard, epoch)
            await self._runtime.adopt_shard(shard, epoch)
        except BaseException:
            self._stop_listen(shard)
            raise
        finally:
            self._loading.pop(shard, None)
            self._before_load.pop(shard, None)
        if early:
            self._runtime.on_stored(early)

    def on_lost(self, shard: int, epoch: int) -> None:
        self._runtime.drop_shard(shard, epoch)
        self._stop_listen(shard)

    async def before_release(self, shard: int) -> None:
        await self._runtime.drain_shard(shard, self._drain_timeout)

    async def drain(self, shards: set[int]) -> None:
        """SIGTERM: drain every shard at once (``release_all``'s drain step)."""
        await asyncio.gather(*(self._runtime.drain_shard(shard, self._drain_timeout) for shard in shards))

    async def close(self) -> None:
        for task in self._restarts.values():
            task.cancel()
        self._restarts.clear()
        for shard in list(self._listens):
            self._stop_listen(shard)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # ---- inbox listens -----------------------------------------------------------------------

    def _start_listen(self, shard: int, epoch: int, attempt: int) -> None:
        self._stop_listen(shard)
        if shard not in self._loading and self._runtime.shards().get(shard) != epoch:
            return  # lost (or re-gained at another epoch) meanwhile
        listening: InboxListening | None = None

        def on_messages(messages: list[Message]) -> None:
            self.inbox_messages += len(messages)
            early = self._loading.get(shard)
            if early is not None:
                early.extend(messages)
            elif self._runtime.shards().get(shard) == epoch:
                self._runtime.on_stored(messages)

        def on_initial() -> None:
            waiting = self._before_load.get(shard)
            if waiting is not None:
                waiting.set()
            else:
                self._runtime.inbox_caught_up(shard, epoch)

        def on_error(error: StoreError) -> None:
            if listening is None or self._listens.get(shard) is not listening:
                return  # a Listen stopped or replaced already
            self._failed(shard, epoch, attempt, error)

        try:
            listening = self._inbox.listen_inbox(
                self._runtime.name,
                shard,
                on_messages,
                on_error,
                # Only a first snapshot that arrives before the load reads may be left out.
                skip_initial=shard in self._before_load,
                on_initial=on_initial,
            )
        except StoreError as exc:
            self._failed(shard, epoch, attempt, exc)
            return
        self._listens[shard] = listening

    def _failed(self, shard: int, epoch: int, attempt: int, error: StoreError) -> None:
        """Close the shard's Listen (a failed read leaves its stream open) and start one later."""
        self.listen_failures += 1
        _LOGGER.warning(
            "subscription %s: inbox listen of shard %d failed (%s); restarting it",
            self._runtime.name,
            shard,
            error,
        )
        self._stop_listen(shard)
        self._restarts[shard] = asyncio.ensure_future(self._restart_later(shard, epoch, attempt + 1))

    async def _restart_later(self, shard: int, epoch: int, attempt: int) -> None:
        await asyncio.sleep(backoff_seconds(attempt, _LISTEN_RETRY_INITIAL_SECONDS, _LISTEN_RETRY_MAXIMUM_SECONDS))
        self._restarts.pop(shard, None)
        self._start_listen(shard, epoch, attempt)

    def _stop_listen(self, shard: int) -> None:
        restart = self._restarts.pop(shard, None)
        if restart is not None:
            restart.cancel()
        listening = self._listens.pop(shard, None)
        if listening is not None:
            task = asyncio.ensure_future(listening.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
