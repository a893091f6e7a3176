"""One subscription's shard leases for this pod: rounds of read, plan, compare-and-set.

Before the first round the process joins under its pod name (``membership``: static membership).
Every ``lease_ms / 3`` (sooner after ``poke()``, e.g. from a Listen on the lease documents) a round
reads all S lease documents and this pod's member document in one batched read, asks
``sidecar.cluster.leases.planner`` what to write, and writes it with the member document's beat in
one BatchWrite of compare-and-set writes (per-write outcomes: one lost race costs only that shard).
A conflict (another pod wrote first) brings the next round forward. A round that created missing
documents (free) reads and plans again at once, to take them. A member document naming a newer
process of this pod name drops every shard and ends ``run()`` (``Superseded``).

Safety, and which clock serves what:

- Expiry is judged on the database's clock only (``read_time - update_time > lease_ms``, both from
  one read; ``sidecar.cluster.leases.layout``), so a pod whose wall clock is off behaves the same: nothing
  here reads the wall clock.
- This pod's monotonic clock serves only its own safety margin: after a renewal or take *sent* at
  t, the shard counts as held until ``t + 0.8 * lease_ms``. The write's update time is later than
  t, and another pod can take the lease only from a read of that version at least ``lease_ms`` of
  database time after it, so the margin ends first (clock rates may differ by up to 20 %).
  ``sidecar.cluster.leases.holdings`` keeps the held shards and their margins: ``holds()`` compares
  with the clock on every call, and a timer drops a shard the moment its margin passes
  (``on_lost``), not only at the next round: a pod that wakes from a pause never delivers on a
  margin that ran out while it slept.
- Every write names the version it was planned from, so a paused pod that wakes and writes from
  an old read changes nothing. The lease document is also the fence of every advancing write
  (``fence()``), which Firestore checks in the store's transactions: that, not the margin, is what
  makes a zombie harmless.

Bad lease documents (``sidecar.cluster.leases.layout``: corrupt, a newer layout, another S beside documents
of this S) stop their own shard only: never taken nor written, dropped if held, one ERROR line
naming the document when a round first sees the problem (and one INFO line when it is gone), and
listed by ``blocked()`` (counted in ``LeaseStats.blocked``) while it lasts; every other shard goes
on. Only lease documents that all name another S than this pod's stop ``run()``
(``LeaseLayoutError``): then it is this pod's configuration that is wrong.

Callbacks: ``on_gained(shard, epoch)`` is awaited (in its own task, renewals go on meanwhile)
before the shard counts as held; ``on_lost(shard, epoch)`` is called exactly once for every
``on_gained`` started, when the shard is lost (another owner or epoch seen, the margin passed, the
store refused a fenced write) or given up (after ``before_release`` and before the hand-over is
written), and only after ``on_gained`` returned or was cancelled. An exception from ``on_gained``
ends ``run()`` with it. ``Holdings`` keeps these rules; this module decides when a shard is taken,
renewed, lost or given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields

from sidecar.backoff import backoff_seconds
from sidecar.cluster.leases import planner
from sidecar.cluster.leases.holdings import Holding, Holdings
from sidecar.cluster.leases.layout import LeaseView, lease_fields, lease_path, read_lease, shard_count_refusal
from sidecar.cluster.leases.members import Superseded, answers
from sidecar.cluster.leases.membership import Membership, Route
from sidecar.cluster.leases.planner import GIVING_UP, Action, LeaseWrite, Mode
from sidecar.shards import MAX_SHARDS
from sidecar.store import documents as docs
from sidecar.store.api import ShardLost, StoreUnavailable

_LOGGER = logging.getLogger(__name__)

SAFETY_FACTOR = 0.8
"""A lease counts as held for 80 % of its duration after the renewal was sent: the other 20 %
absorb a difference of clock rates between this pod and the database, and the lag of the timer."""

ROUNDS_PER_LEASE = 3
"""KCL renews every failover time / 3: two renewals may fail before the safety margin runs out."""

MIN_LEASE_MS = 300
"""Below this a round (a batched read and a BatchWrite) would not reliably fit a third of a lease."""

MAX_LEASE_MS = 600_000
"""Ten minutes: a longer lease only delays failover after a crash."""

_RELEASE_WAIT_SHARE = 0.25
"""Of ``lease_ms``: how long a round waits for ``before_release`` of a balancing hand-over before it
writes it anyway (the other shards' renewals must not wait longer; acks still in flight then fail
their fence and are not confirmed, so the new owner's app gets those messages again, as G3 allows)."""

_CONFLICT_DELAY_SHARE = 0.1
"""Of a round's period: the random wait before the round that follows a lost race, so pods racing
for the same leases spread out instead of colliding again."""

_LEAVE_ATTEMPTS = 3
"""Rounds ``release_all`` tries before it leaves what remains to expire."""

_SETTLED_POLL_SECONDS = 0.02
"""How often ``settled`` looks: start-up waits on it once, so a poll costs nothing that matters."""


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(slots=True)
class LeaseStats:
    """Counters for GetStatus and metrics."""

    rounds: int = 0
    read_failures: int = 0
    renewals: int = 0
    renewal_failures: int = 0
    creates: int = 0
    """Missing lease documents written (free): one per shard at first use, or after a deletion by hand."""
    takes: int = 0
    asks: int = 0
    handovers: int = 0
    releases: int = 0
    lost: int = 0
    conflicts: int = 0
    pods: int = 0
    """Live pods seen by the last round."""
    blocked: int = 0
    """Shards whose lease document the last round could not read as a lease (``blocked()``)."""

    def counts(self) -> dict[str, int]:
        return {f"lease_{field.name}": getattr(self, field.name) for field in fields(self)}


class ShardLeases:
    """Takes, renews, balances and gives up one subscription's shard leases for this pod."""

    def __init__(
        self,
        documents: docs.Documents,
        sub_path: str,
        shard_count: int,
        pod_id: str,
        *,
        lease_ms: int = 10_000,
        monotonic_ms: Callable[[], int] = _monotonic_ms,
        on_gained: Callable[[int, int], Awaitable[None]],
        on_lost: Callable[[int, int], None],
        before_release: Callable[[int], Awaitable[None]],
        address: str = "",
        probe: Callable[[str], Awaitable[bool]] = answers,
    ) -> None:
        if not isinstance(shard_count, int) or isinstance(shard_count, bool) or not 1 <= shard_count <= MAX_SHARDS:
            raise ValueError(f"sharding.shards: must be an integer from 1 to {MAX_SHARDS}, got {shard_count!r}")
        if not isinstance(lease_ms, int) or isinstance(lease_ms, bool) or not MIN_LEASE_MS <= lease_ms <= MAX_LEASE_MS:
            raise ValueError(
                f"sharding.lease_duration: must be from {MIN_LEASE_MS} ms to {MAX_LEASE_MS} ms, got {lease_ms!r} ms"
            )
        if not isinstance(pod_id, str) or not pod_id.strip():
            raise ValueError(f"pod id: must be a non-empty string, got {pod_id!r}")
        if not sub_path or sub_path.startswith("/") or sub_path.endswith("/"):
            raise ValueError(f"subscription path: must be a relative document path, got {sub_path!r}")
        if not isinstance(address, str):
            raise ValueError(f'peer address: must be a string ("" when unknown), got {address!r}')
        self._documents = documents
        self._sub_path = sub_path
        self._subscription = sub_path.rpartition("/")[2]
        self._shard_count = shard_count
        self._paths = [lease_path(sub_path, shard) for shard in range(shard_count)]
        self.pod_id = pod_id
        self.lease_ms = lease_ms
        self._period_ms = lease_ms // ROUNDS_PER_LEASE
        self._margin_ms = int(lease_ms * SAFETY_FACTOR)
        self._monotonic_ms = monotonic_ms
        self._before_release = before_release
        self.stats = LeaseStats()
        self._holdings = Holdings(
            self._subscription,
            monotonic_ms=monotonic_ms,
            on_gained=on_gained,
            on_lost=on_lost,
            poke=self.poke,
            stats=self.stats,
        )
        self._mode = Mode.RUN
        self._left = False
        self._lock = asyncio.Lock()
        self._poked = asyncio.Event()
        self._random = random.Random()
        self._first_round: dict[int, Holding] | None = None
        """The shards held after the first completed round (``settled`` waits for their loads)."""
        self._soon = 0
        """Rounds in a row that asked for the next one soon (conflicts, failures): their backoff."""
        self._blocked: dict[int, str] = {}
        """Shard -> the problem of its lease document, as the last read saw it."""
        self._membership = Membership(documents, sub_path, pod_id, address=address, lease_ms=lease_ms, probe=probe)
        self._views: list[LeaseView] = []
        """The lease documents as the last round read them (``route``)."""

    # ---- API for the runtime -------------------------------------------------------------------

    async def run(self) -> None:
        """Rounds until cancelled; after ``release_all`` it only waits to be cancelled.

        Raises ``LeaseLayoutError`` when the lease documents name another shard count than this
        pod's, and whatever ``on_gained`` raised. A bad document stops its shard only (``blocked``)."""
        if self._membership.incarnation is None:
            await self._membership.join()
        while True:
            self._raise_failure()
            if self._left:
                await asyncio.Future()
            self._poked.clear()
            conflict = await self._round()
            self._raise_failure()
            delay_ms: float = self._period_ms
            if conflict:
                # Soon, spread out (pods racing for one lease must not collide again), and backing
                # off when rounds keep failing (an outage costs few calls).
                ceiling = self._period_ms * _CONFLICT_DELAY_SHARE
                delay_ms = 1000 * backoff_seconds(self._soon, ceiling / 1000, self._period_ms / 1000)
                self._soon += 1
            else:
                self._soon = 0
            # ``asyncio.timeout``, not ``wait_for``: on Python 3.11 a cancellation that comes as the
            # poke does is swallowed by ``wait_for``, and the task would then wait for good (after
            # ``release_all``) with its cancellation lost.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_ms / 1000):
                    await self._poked.wait()

    async def settled(self, timeout_seconds: float | None = None) -> bool:
        """Wait until the first round has completed and every shard it took is loaded (or lost
        meanwhile); False on timeout (``None``: no bound) or when the manager failed.

        Shards taken by later rounds are not waited for: the first round is what this pod can take
        at once at start-up, and a pod that got no lease (others hold them all) is settled as soon
        as that round is done. Readiness waits for this (a stuck load is caught by liveness
        instead); ingest waits for it, bounded, so that a lone pod does not store its first
        messages for an owner (itself) it has not become yet."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_seconds is None else loop.time() + timeout_seconds
        while not self._first_round_loaded():
            if (deadline is not None and loop.time() >= deadline) or self._holdings.failure is not None:
                return False
            await asyncio.sleep(_SETTLED_POLL_SECONDS)
        return self._holdings.failure is None

    def _first_round_loaded(self) -> bool:
        if self._first_round is None:
            return False
        for shard, holding in self._first_round.items():
            if self._holdings.get(shard) is holding and not holding.ready:
                return False  # still loading (a shard lost or re-taken since is not waited for)
        return True

    def poke(self) -> None:
        """Run a round now (a lease document changed)."""
        self._poked.set()

    def holds(self, shard: int) -> int | None:
        """The epoch of ``shard`` if this pod holds it, loaded, within its safety margin now."""
        return self._holdings.holds(shard)

    def owned(self) -> dict[int, int]:
        """Shard -> epoch of every shard ``holds`` answers for now."""
        return self._holdings.owned()

    def blocked(self) -> dict[int, str]:
        """Shard -> why its lease document is left alone (one line naming it), as the last round saw it."""
        return dict(self._blocked)

    def route(self, shard: int) -> Route | None:
        """Who delivers ``shard`` as the last round read it, with the owner's address (the
        forwarder's view); None when the lease is free, expired, unreadable, or not read yet."""
        view = self._views[shard] if 0 <= shard < len(self._views) else None
        if view is None or view.problem or view.is_free or view.expired:
            return None
        return Route(view.owner, view.epoch, self._membership.address_of(view.owner))

    @property
    def incarnation(self) -> int | None:
        return self._membership.incarnation

    def fence(self, shard: int) -> docs.Fence:
        """The lease document as the fence of an advancing write; ``ShardLost`` when not held."""
        epoch = self.holds(shard)
        if epoch is None:
            raise ShardLost(self._subscription, frozenset({shard}))
        return docs.Fence(lease_path(self._sub_path, shard), {"owner": self.pod_id, "epoch": epoch})

    def shard_lost(self, shard: int, epoch: int) -> None:
        """The store refused a write fenced with ``epoch``: the lease moved on. Drop it, look now."""
        holding = self._holdings.get(shard)
        if holding is not None and holding.epoch == epoch:
            self._holdings.drop(shard)
        self.poke()

    async def release_all(self, drain: Callable[[set[int]], Awaitable[None]]) -> None:
        """SIGTERM: take nothing more, let ``drain`` finish the held shards' in-flight work (renewals
        go on meanwhile), then hand every lease over (to a pod asking for it) or free it at once."""
        if self._left:
            return
        self._mode = Mode.DRAIN
        for shard, holding in self._holdings.items():
            if not holding.ready:
                self._holdings.drop(shard, counted=False)  # still loading: nothing of it in flight, give it up as it is
        self.poke()
        try:
            await drain(set(self.owned()))
        except Exception:
            # Hand over all the same: what did not drain fails its fence and is not confirmed.
            _LOGGER.exception("subscription %s: draining before the hand-over failed", self._subscription)
        async with self._lock:
            self._mode = Mode.LEAVE
            try:
                for attempt in range(_LEAVE_ATTEMPTS):
                    if await self._leave_round() or attempt == _LEAVE_ATTEMPTS - 1:
                        break
                    await asyncio.sleep(self._period_ms * _CONFLICT_DELAY_SHARE / 1000)
            finally:
                for shard in self._holdings.shards():
                    self._holdings.drop(shard, counted=False)
                self._left = True
                self.poke()

    # ---- rounds ------------------------------------------------------------------------------

    async def _round(self) -> bool:
        """One round in the current mode; True when it should run again soon: a write lost a race, or
        the read or a write failed (a renewal retried at once keeps the lease through a blip, where
        waiting a whole period could let the safety margin run out)."""
        async with self._lock:
            if self._left:
                return False
            conflict = False
            beat = True
            # Missing documents are created free, then taken by a second pass at once (a first
            # round takes what it can, which ``settled`` relies on).
            for _ in range(2):
                mode = self._mode
                views = await self._read()
                if views is None:
                    return True
                plan = planner.plan(views, self.pod_id, self._holdings.epochs(), self.lease_ms, mode)
                self.stats.pods = plan.pods
                for shard in plan.lost:
                    self._holdings.drop(shard)
                # This pod's member document beats once a round, in the same BatchWrite.
                member = self._membership.beat() if beat else None
                beat = False
                conflict |= await self._send([w for w in plan.writes if w.action not in GIVING_UP], member)
                giving = [w for w in plan.writes if w.action in GIVING_UP]
                if giving:
                    await self._before_giving_up({w.shard for w in giving if w.shard in self._holdings})
                    conflict |= await self._send(giving)
                if not any(w.action is Action.CREATE for w in plan.writes):
                    break
            if self._first_round is None:
                self._first_round = self._holdings.snapshot()
        await self._membership.refresh_addresses(self._views)
        return conflict

    async def _leave_round(self) -> bool:
        """One leaving round; True when every lease naming this pod was handed over or freed."""
        try:
            views = await self._read()
        except Superseded:
            return True  # a newer process of this pod name holds what this one held
        if views is None:
            return False
        plan = planner.plan(views, self.pod_id, self._holdings.epochs(), self.lease_ms, Mode.LEAVE)
        for shard in self._holdings.shards():
            self._holdings.drop(shard, counted=shard in plan.lost)
        # The member document says this process left: a process restarted under the name takes it at once.
        return not await self._send(list(plan.writes), self._membership.beat(left=True)) and not plan.lost

    async def _read(self) -> list[LeaseView] | None:
        self.stats.rounds += 1
        self._holdings.expire_due()
        try:
            read_us, versions = await self._documents.get_versioned([*self._paths, self._membership.path])
        except StoreUnavailable as exc:
            self.stats.read_failures += 1
            _LOGGER.warning("subscription %s: lease read failed, retrying next round: %s", self._subscription, exc)
            return None
        self._holdings.expire_due()
        missing = docs.Versioned(None, None)
        views = [
            read_lease(path, shard, self._shard_count, read_us, versions.get(path, missing))
            for shard, path in enumerate(self._paths)
        ]
        refusal = shard_count_refusal(self._sub_path, self._shard_count, views)
        if refusal is not None:
            raise refusal
        stop = self._membership.check(read_us, versions)
        if stop is not None:
            # A newer process of this pod name takes every shard at new epochs: stop holding them now.
            for shard in self._holdings.shards():
                self._holdings.drop(shard)
            raise stop
        self._note_problems(views)
        self._views = views
        return views

    def _note_problems(self, views: Sequence[LeaseView]) -> None:
        """Once per problem, not every round: an ERROR line when a document turns bad (or its problem
        changes), an INFO line when it reads as a lease again."""
        for view in views:
            known = self._blocked.get(view.shard)
            if view.problem and view.problem != known:
                _LOGGER.error(
                    "subscription %s: shard %d stopped, its lease document is left alone: %s",
                    self._subscription,
                    view.shard,
                    view.problem,
                )
                self._blocked[view.shard] = view.problem
            elif not view.problem and known is not None:
                _LOGGER.info(
                    "subscription %s: shard %d: lease document %s reads as a lease again",
                    self._subscription,
                    view.shard,
                    self._paths[view.shard],
                )
                del self._blocked[view.shard]
        self.stats.blocked = len(self._blocked)

    async def _before_giving_up(self, shards: set[int]) -> None:
        """Let the runtime stop delivering and drain (bounded), then stop holding: the hand-over
        must not be written while this pod still counts the shard as its own."""
        ready = [shard for shard in sorted(shards) if self._holdings.ready(shard)]
        if ready:
            waits = asyncio.gather(*(self._before_release(shard) for shard in ready))
            try:
                await asyncio.wait_for(waits, self.lease_ms * _RELEASE_WAIT_SHARE / 1000)
            except TimeoutError:
                _LOGGER.warning(
                    "subscription %s: shards %s did not drain within %d ms; handing them over anyway",
                    self._subscription,
                    ready,
                    int(self.lease_ms * _RELEASE_WAIT_SHARE),
                )
        for shard in shards:
            if shard in self._holdings:
                self._holdings.drop(shard, counted=False)

    async def _send(self, writes: Sequence[LeaseWrite], member: docs.Write | None = None) -> bool:
        """Write ``writes`` and ``member`` (this pod's member document) in one BatchWrite; True when
        one lost a race (another pod wrote first) or failed."""
        if not writes and member is None:
            return False
        batch = [
            docs.compare_and_set(
                lease_path(self._sub_path, w.shard),
                lease_fields(self._shard_count, w.owner, w.epoch, w.beat, w.lease_ms, w.wanted_by),
                w.update_time_us,
            )
            for w in writes
        ]
        if member is not None:
            batch.append(member)
        # The margin counts from before the request leaves: the write's update time is later.
        sent_ms = self._monotonic_ms()
        try:
            statuses = await self._documents.batch_write(batch)
        except StoreUnavailable as exc:
            # Maybe applied: the next round's read tells (a take that did apply shows this pod as
            # owner but not holding it, and is taken again at a new epoch).
            self.stats.renewal_failures += sum(1 for w in writes if w.action is Action.RENEW)
            _LOGGER.warning("subscription %s: lease write failed, retrying soon: %s", self._subscription, exc)
            return True
        conflict = False
        if member is not None:
            code, message = statuses.pop()
            if code != docs.OK:
                # The next round's read tells why: a blip, a deletion by hand, or a newer process of this name.
                conflict = True
                _LOGGER.warning(
                    "subscription %s: member document write failed: %d %s", self._subscription, code, message
                )
        for write, (code, message) in zip(writes, statuses, strict=True):
            if code == docs.OK:
                self._applied(write, sent_ms)
                continue
            if write.action is Action.RENEW:
                self.stats.renewal_failures += 1
            if code in (docs.FAILED_PRECONDITION, docs.ALREADY_EXISTS):
                self.stats.conflicts += 1
                conflict = True
                continue
            conflict = True
            _LOGGER.warning(
                "subscription %s: lease write (%s) of shard %d failed, retrying soon: %d %s",
                self._subscription,
                write.action.value,
                write.shard,
                code,
                message,
            )
        self._holdings.arm_timer()
        return conflict

    def _applied(self, write: LeaseWrite, sent_ms: int) -> None:
        deadline_ms = sent_ms + self._margin_ms
        if write.action is Action.RENEW:
            if self._holdings.renew(write.shard, write.epoch, deadline_ms):
                self.stats.renewals += 1
        elif write.action is Action.ACQUIRE:
            if self._mode is not Mode.RUN or write.shard in self._holdings:
                return  # draining began meanwhile: the stray is released by the next round
            self.stats.takes += 1
            self._holdings.take(write.shard, write.epoch, deadline_ms)
        elif write.action is Action.CREATE:
            self.stats.creates += 1
        elif write.action is Action.ASK:
            self.stats.asks += 1
        elif write.action is Action.HAND_OVER:
            self.stats.handovers += 1
        elif write.action is Action.RELEASE:
            self.stats.releases += 1

    def _raise_failure(self) -> None:
        if self._holdings.failure is not None:
            raise self._holdings.failure
