"""The shards this pod holds: each one's epoch, the end of its safety margin, and its load.

``sidecar.cluster.leases.manager`` runs the rounds (read, plan, compare-and-set) and tells this
module what they did: a take that applied (``take``), a renewal (``renew``), a shard lost or given up
(``drop``). This module reads no document and writes none.

Rules this module keeps:

- Only this pod's monotonic clock serves here, for its own safety margin: a shard counts as held
  (``holds``, ``owned``) once its ``on_gained`` returned and until the deadline its last successful
  write set, and not a millisecond past it. ``holds()`` compares with the clock on every call, and a
  timer drops a shard the moment its margin passes (``on_lost``), not only at the next round: a pod
  that wakes from a pause never delivers on a margin that ran out while it slept.
- ``on_gained(shard, epoch)`` is awaited in its own task (renewals go on meanwhile) before the shard
  counts as held; ``on_lost(shard, epoch)`` is called exactly once for every ``on_gained`` started,
  when the shard is dropped, and only after ``on_gained`` returned or was cancelled.
- An exception from ``on_gained`` drops its shard and is kept as ``failure`` (the manager's ``run()``
  raises it); a round is asked for at once (``poke``).
- A drop that is a loss (``counted``: another owner or epoch seen, the margin passed, the store
  refused a fenced write, a load failed) is counted in ``lost`` and logged; a shard given up is not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

_LOGGER = logging.getLogger("sidecar.cluster.leases.manager")
"""The manager's logger: a lost shard or a failed load is logged under the name it always had."""


class _LossCount(Protocol):
    """Where a loss is counted: ``LeaseStats`` of the manager."""

    lost: int


@dataclass(slots=True)
class Holding:
    epoch: int
    deadline_ms: int
    """On this pod's monotonic clock: the end of the safety margin of the last successful write."""
    gaining: asyncio.Task[None] | None
    ready: bool = False


class Holdings:
    """One subscription's held shards for this pod, with the timer that drops them when due."""

    def __init__(
        self,
        subscription: str,
        *,
        monotonic_ms: Callable[[], int],
        on_gained: Callable[[int, int], Awaitable[None]],
        on_lost: Callable[[int, int], None],
        poke: Callable[[], None],
        stats: _LossCount,
    ) -> None:
        self._subscription = subscription
        self._monotonic_ms = monotonic_ms
        self._on_gained = on_gained
        self._on_lost = on_lost
        self._poke = poke
        self._stats = stats
        self._held: dict[int, Holding] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.failure: BaseException | None = None
        """What the first failed ``on_gained`` raised."""

    # ---- what the rest of the sidecar asks ------------------------------------------------------

    def holds(self, shard: int) -> int | None:
        """The epoch of ``shard`` if this pod holds it, loaded, within its safety margin now."""
        holding = self._held.get(shard)
        if holding is None or not holding.ready or self._monotonic_ms() >= holding.deadline_ms:
            return None
        return holding.epoch

    def owned(self) -> dict[int, int]:
        """Shard -> epoch of every shard ``holds`` answers for now."""
        now = self._monotonic_ms()
        return {s: h.epoch for s, h in sorted(self._held.items()) if h.ready and now < h.deadline_ms}

    # ---- what the rounds read -----------------------------------------------------------------

    def __contains__(self, shard: int) -> bool:
        return shard in self._held

    def get(self, shard: int) -> Holding | None:
        return self._held.get(shard)

    def shards(self) -> list[int]:
        """The shards held now, loading or loaded (a copy: dropping while iterating is fine)."""
        return list(self._held)

    def items(self) -> list[tuple[int, Holding]]:
        return list(self._held.items())

    def ready(self, shard: int) -> bool:
        """Whether held ``shard`` is loaded (``KeyError`` when it is not held)."""
        return self._held[shard].ready

    def snapshot(self) -> dict[int, Holding]:
        return dict(self._held)

    def epochs(self) -> dict[int, int]:
        """Shard -> epoch of every shard held, loading or loaded (what the planner renews)."""
        return {shard: holding.epoch for shard, holding in self._held.items()}

    # ---- what the rounds did ------------------------------------------------------------------

    def take(self, shard: int, epoch: int, deadline_ms: int) -> None:
        """A take applied: hold ``shard`` from now, loading until ``on_gained`` returns."""
        holding = Holding(epoch, deadline_ms, None)
        self._held[shard] = holding
        holding.gaining = asyncio.ensure_future(self._gain(shard, holding))

    def renew(self, shard: int, epoch: int, deadline_ms: int) -> bool:
        """A renewal applied: True when it extended a shard still held at ``epoch``."""
        holding = self._held.get(shard)
        if holding is None or holding.epoch != epoch:
            return False
        holding.deadline_ms = deadline_ms
        return True

    def drop(self, shard: int, *, counted: bool = True) -> None:
        """Stop holding ``shard`` now; ``on_lost`` once its ``on_gained`` is over."""
        holding = self._held.pop(shard, None)
        if holding is None:
            return
        if counted:
            self._stats.lost += 1
            _LOGGER.info("subscription %s: lost shard %d (epoch %d)", self._subscription, shard, holding.epoch)
        gaining = holding.gaining
        if gaining is not None and not gaining.done():
            gaining.cancel()
            gaining.add_done_callback(lambda _: self._on_lost(shard, holding.epoch))
        else:
            self._on_lost(shard, holding.epoch)
        self.arm_timer()

    def expire_due(self) -> None:
        """Drop every shard whose safety margin has passed."""
        now = self._monotonic_ms()
        for shard, holding in list(self._held.items()):
            if now >= holding.deadline_ms:
                self.drop(shard)

    def arm_timer(self) -> None:
        """Set the timer to the earliest deadline of the shards held (none when nothing is held)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        earliest = min(holding.deadline_ms for holding in self._held.values())
        delay_ms = max(0, earliest - self._monotonic_ms())
        self._timer = asyncio.get_running_loop().call_later(delay_ms / 1000, self._on_timer)

    # ---- internals ----------------------------------------------------------------------------

    async def _gain(self, shard: int, holding: Holding) -> None:
        try:
            await self._on_gained(shard, holding.epoch)
        except asyncio.CancelledError:
            raise  # dropped meanwhile: the done callback ``drop`` added calls on_lost
        except Exception as exc:
            holding.gaining = None
            _LOGGER.error("subscription %s: loading shard %d failed: %r", self._subscription, shard, exc)
            if self.failure is None:
                self.failure = exc
            self.drop(shard)
            self._poke()
            return
        holding.gaining = None
        if self._held.get(shard) is holding:
            holding.ready = True

    def _on_timer(self) -> None:
        self._timer = None
        self.expire_due()
        self.arm_timer()
