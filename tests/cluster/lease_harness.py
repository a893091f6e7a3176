"""Managers under test: one ``ShardLeases`` per member with its callbacks recorded, a checker that
no two members hold one shard at one instant, a clock that moves only when a test moves it, and
polling with deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable

from sidecar.cluster.leases import ShardLeases
from sidecar.cluster.leases.manager import _monotonic_ms
from sidecar.cluster.leases.planner import fair_share
from sidecar.cluster.leases.writes import NO_ATTEMPTS, Attempts
from sidecar.store import documents as docs
from sidecar.wiring.subscription import _listen_leases

SUB_PATH = "pubsub-sidecar/orders"


class Member:
    """One pod's lease manager; ``events`` records (what, shard, epoch) in the order they happened."""

    def __init__(
        self,
        documents: docs.Documents,
        name: str,
        shards: int,
        *,
        lease_ms: int,
        monotonic_ms: Callable[[], int] = _monotonic_ms,
        address: str = "",
        attempts: Attempts = NO_ATTEMPTS,
    ) -> None:
        self.name = name
        self.documents = documents
        self.events: list[tuple[str, int, int]] = []
        self.gain_gate: asyncio.Event | None = None
        self.leases = ShardLeases(
            documents,
            SUB_PATH,
            shards,
            name,
            lease_ms=lease_ms,
            monotonic_ms=monotonic_ms,
            on_gained=self._gained,
            on_lost=self._lost,
            before_release=self._before_release,
            address=address,
            attempts=attempts,
        )
        self.task: asyncio.Task[None] | None = None
        self.listen: docs.Listening | None = None

    def start(self) -> None:
        """Run the rounds, with the Listen on the lease documents the sidecar runs beside them
        (``sidecar.wiring.subscription``): a change of owner or an ask starts a full round at once."""
        self.listen = _listen_leases(self.documents, self.leases, SUB_PATH, "orders")
        self.task = asyncio.ensure_future(self.leases.run())

    async def stop(self) -> None:
        """Cancel the task (kill -9, or a pause when started again later): no release."""
        if self.listen is not None:
            await self.listen.close()
            self.listen = None
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def _gained(self, shard: int, epoch: int) -> None:
        self.events.append(("gained", shard, epoch))
        if self.gain_gate is not None:
            await self.gain_gate.wait()
        self.events.append(("loaded", shard, epoch))

    def _lost(self, shard: int, epoch: int) -> None:
        self.events.append(("lost", shard, epoch))

    async def _before_release(self, shard: int) -> None:
        self.events.append(("before_release", shard, self.leases.holds(shard) or -1))


class OverlapChecker:
    """Samples every member's ``holds`` often, recording any shard two members hold at once."""

    def __init__(self, members: list[Member], shards: int) -> None:
        self.members = members
        self.shards = shards
        self.overlaps: list[str] = []
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            for shard in range(self.shards):
                holders = [m.name for m in self.members if m.leases.holds(shard) is not None]
                if len(holders) > 1:
                    self.overlaps.append(f"shard {shard} held by {holders}")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        assert not self.overlaps, self.overlaps[:5]


class FakeTime:
    """One clock for the database (``MemoryDocuments(clock_us=...)``) and every member's monotonic
    clock. It moves only when the test moves it, so a busy machine that delays rounds never runs a
    lease or a margin out: only ``pass_time`` does, in steps the live members renew across."""

    def __init__(self, start_ms: int = 1_000_000) -> None:
        self.now_ms = start_ms

    def monotonic_ms(self) -> int:
        return self.now_ms

    def clock_us(self) -> int:
        return self.now_ms * 1000


async def pass_time(clock: FakeTime, live: list[Member], ms: int, lease_ms: int) -> None:
    """Move ``clock`` on by ``ms`` in steps of a quarter lease; after each step, wait until every
    member of ``live`` has run a whole round (its renewals are then sent at the new time, so its
    0.8-lease margin outlasts the next step however late the round came). Members not in ``live``
    (stopped: killed or paused) renew nothing and run out."""
    step = max(1, lease_ms // 4)
    while ms > 0:
        clock.now_ms += min(step, ms)
        ms -= step
        targets = [(member, member.leases.stats.rounds + 2) for member in live]
        for member in live:
            member.leases.poke()
        await wait_until(
            functools.partial(_reached, targets), "a whole round of every live member after the clock moved"
        )


def _reached(targets: list[tuple[Member, int]]) -> bool:
    """Every member has started its round number ``target`` (so the one before it is over)."""
    return all(member.leases.stats.rounds >= target for member, target in targets)


async def wait_until(predicate: Callable[[], bool], what: str, timeout_seconds: float = 20.0) -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Fails naming ``what`` at the deadline."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_seconds:
            raise AssertionError(f"not within {timeout_seconds} s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def balanced(members: list[Member], shards: int) -> bool:
    """Every shard held by exactly one of ``members``, each holding floor(S/P) or ceil(S/P)."""
    owned = [m.leases.owned() for m in members]
    held = sorted(shard for o in owned for shard in o)
    base, ceiling = fair_share(shards, len(members))
    return held == list(range(shards)) and all(base <= len(o) <= ceiling for o in owned)
