"""Glue between one subscription's shard leases, its store and its runtime (several pods).

``sidecar.leases`` decides which shards this pod owns; this module carries each decision out:

- **Gained** (``on_gained``, awaited before the lease counts as held for delivery): the runtime
  loads the shard from the store (a handover is a recovery) and delivers its keys; then a Listen
  on the shard's inbox (messages other pods stored for it) feeds the runtime, as ingest does. The
  Listen starts after the load, and its first snapshot holds every inbox document, so nothing
  stored between the two is missed; a message seen by both is dropped by the engine as a
  duplicate of what it holds.
- **Lost** (``on_lost``: a failed renewal, another owner seen, the local deadline passed, or the
  store refusing a fenced write): the runtime drops the shard at once and its Listen closes.
- **Handing over** (``before_release``: balancing, or SIGTERM through ``release_all``): the runtime
  stops handing out the shard's messages and waits, up to ``drain_timeout``, for the app's acks of
  those in flight to be durable; then the lease manager writes the hand-over.
- A Listen on the subscription's lease documents pokes the lease manager, so a released or
  requested shard is seen within one round trip rather than at the next renewal round.

A Listen that fails is restarted after a capped, jittered backoff (``sidecar.backoff``); meanwhile the
shard's keys still deliver everything this pod ingests itself, and others' intake waits in Firestore.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from sidecar.backoff import backoff_seconds
from sidecar.engine.types import Message
from sidecar.runtime import SubscriptionRuntime
from sidecar.store.api import StoreError

_LOGGER = logging.getLogger(__name__)

_LISTEN_RETRY_INITIAL_SECONDS = 0.2
_LISTEN_RETRY_MAXIMUM_SECONDS = 10.0


class Listening(Protocol):
    async def close(self) -> None: ...


class InboxSource(Protocol):
    """What the store offers for a shard's inbox (``DocumentStore.listen_inbox``)."""

    def listen_inbox(
        self,
        subscription: str,
        shard: int,
        on_messages: Callable[[list[Message]], None],
        on_error: Callable[[StoreError], None],
    ) -> Listening: ...


class ShardOwnership:
    """Carries out one subscription's lease decisions on its runtime and store."""

    def __init__(self, runtime: SubscriptionRuntime, inbox: InboxSource, *, drain_timeout_seconds: float) -> None:
        self._runtime = runtime
        self._inbox = inbox
        self._drain_timeout = drain_timeout_seconds
        self._listens: dict[int, Listening] = {}
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.listen_failures = 0
        self.inbox_messages = 0

    # ---- lease manager callbacks -------------------------------------------------------------

    async def on_gained(self, shard: int, epoch: int) -> None:
        await self._runtime.adopt_shard(shard, epoch)
        self._start_listen(shard, epoch, attempt=0)

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
        if self._runtime.shards().get(shard) != epoch:
            return  # lost (or re-gained at another epoch) meanwhile

        def on_messages(messages: list[Message]) -> None:
            if self._runtime.shards().get(shard) != epoch:
                return
            self.inbox_messages += len(messages)
            self._runtime.on_stored(messages)

        def on_error(error: StoreError) -> None:
            self.listen_failures += 1
            _LOGGER.warning(
                "subscription %s: inbox listen of shard %d failed (%s); restarting it",
                self._runtime.name,
                shard,
                error,
            )
            self._listens.pop(shard, None)
            self._restarts[shard] = asyncio.ensure_future(self._restart_later(shard, epoch, attempt + 1))

        self._listens[shard] = self._inbox.listen_inbox(self._runtime.name, shard, on_messages, on_error)

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
