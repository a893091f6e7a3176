"""One subscription's shard leases for this pod: rounds of read, plan, compare-and-set.

Before the first round the process joins under its pod name (``membership``: static membership).
A lease is held while its document names the pod and the pod's member document is alive
(``liveness``): the member document's beat renews every lease of the pod at once, and lease
documents are written only when ownership changes. Two kinds of rounds, one every ``lease_ms / 2``
(sooner after ``poke()``, which the Listen on the lease documents calls on every change of them):

- **Light** (the steady state): read this pod's member document and those of the other pods the
  leases name (P reads), and beat (one write, a compare-and-set on the version read). Nothing
  grows with S. The next light round comes no later than the moment the first watched pod's member
  document would expire, so a pod that dies is seen within ``_CHECK_SLACK_MS`` of its expiry.
- **Full** (the first round, after a poke, when a watched pod is no longer alive, when a shard was
  lost since the last full round, while draining, after a round that wrote anything else than the
  beat or lost a race, and at least every ``_FULL_EVERY_ROUNDS`` rounds): read every lease document
  with the member documents they name, judge the leases by their owners' (``liveness.judged``),
  ask ``sidecar.cluster.leases.planner`` what to write, and write it (``writes.LeaseWriter``): one
  BatchWrite of compare-and-set writes with the beat (a renewal writes a lease document only to
  clear an ask), and one atomic Commit per owner whose leases are taken while its member document
  was read expired (the Commit lapses it). A round that created missing documents (free) reads and
  plans again at once, to take them.

A member document naming a newer process of this pod name drops every shard and ends ``run()``
(``Superseded``); one lapsed by another pod (or deleted) drops every shard, and the process joins
again at once under a new incarnation.

Safety, and which clock serves what:

- Expiry is judged on the database's clock only (``read_time - update_time > lease_ms``, both from
  one read), so a pod whose wall clock is off behaves the same: nothing here reads the wall clock.
- This pod's monotonic clock serves only its own safety margin: after a beat *sent* at t, every
  shard it holds counts as held until ``t + 0.8 * lease_ms``. The beat's update time is later than
  t, and another pod can take a lease of this pod only after reading that version of its member
  document at least ``lease_ms`` of database time after it, and lapsing it (a compare-and-set on
  that version, in the same Commit as the take: a later beat fails), so the margin ends first
  (clock rates may differ by up to 20 %). ``sidecar.cluster.leases.holdings`` keeps the held
  shards and their margins: ``holds()`` compares with the clock on every call, and a timer drops a
  shard the moment its margin passes (``on_lost``), not only at the next round.
- Every write names the version it was planned from, so a paused pod that wakes and writes from
  an old read changes nothing. The lease document is also the fence of every advancing write
  (``fence()``), which Firestore checks in the store's transactions: that, not the margin, is what
  makes a zombie harmless.

Bad lease documents (``layout``: corrupt, a newer layout, another S beside documents of this S)
stop their own shard only: never taken nor written, dropped if held, logged once
(``layout.note_problems``) and listed by ``blocked()`` while it lasts. Only lease documents that
all name another S than this pod's stop ``run()`` (``LeaseLayoutError``): this pod's configuration
is wrong. Callbacks (``on_gained`` awaited before a shard counts as held, ``on_lost`` exactly once
after it) are ``Holdings``' rules; this module decides when a shard is taken, renewed, lost or given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from sidecar.backoff import backoff_seconds
from sidecar.cluster.leases import planner
from sidecar.cluster.leases.holdings import Holding, Holdings
from sidecar.cluster.leases.layout import LeaseView, lease_path, note_problems, read_lease, shard_count_refusal
from sidecar.cluster.leases.liveness import first_expiry_us, judged, lapses, watched
from sidecar.cluster.leases.members import MemberView, Superseded, answers
from sidecar.cluster.leases.membership import Lapsed, Membership, Route
from sidecar.cluster.leases.planner import GIVING_UP, Action, LeaseWrite, Mode
from sidecar.cluster.leases.writes import NO_ATTEMPTS, Attempts, LeaseStats, LeaseWriter
from sidecar.shards import MAX_SHARDS
from sidecar.store import documents as docs
from sidecar.store.api import ShardLost, StoreUnavailable

_LOGGER = logging.getLogger(__name__)

SAFETY_FACTOR = 0.8
"""A lease counts as held for 80 % of its duration after the renewal was sent: the other 20 %
absorb a difference of clock rates between this pod and the database, and the lag of the timer."""

ROUNDS_PER_LEASE = 2
"""A beat every half lease: one that fails is tried again soon (a tenth of a round later, backing
off), well before the safety margin (0.8 lease) runs out; a third beat a lease would cost a half more."""

_FULL_EVERY_ROUNDS = 120
"""A full round at least every 60 leases (10 minutes at the default lease), Listen or not: a Listen
that failed (it is not started again) must not leave an ask unanswered for good. A pod that left or
died is seen by the light rounds, so only balancing waits on this; it costs S / 120 reads a round."""

_CHECK_SLACK_MS = 20
"""After the moment a watched pod's member document would expire: when a light round looks again."""

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

_LEAVE_ATTEMPTS = 3  # rounds ``release_all`` tries before it leaves what remains to expire

_SETTLED_POLL_SECONDS = 0.02
"""How often ``settled`` looks (start-up waits on it once: a poll costs nothing that matters)."""


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


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
        attempts: Attempts = NO_ATTEMPTS,
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
        self._first_round: dict[int, Holding] | None = None
        """The shards held after the first completed round (``settled`` waits for their loads)."""
        self._soon = 0
        """Rounds in a row that asked for the next one soon (conflicts, failures): their backoff."""
        self._blocked: dict[int, str] = {}
        """Shard -> the problem of its lease document, as the last read saw it."""
        self._membership = Membership(
            documents, sub_path, pod_id, address=address, lease_ms=lease_ms, probe=probe, monotonic_ms=monotonic_ms
        )
        self._writer = LeaseWriter(
            documents,
            sub_path,
            shard_count,
            holdings=self._holdings,
            membership=self._membership,
            stats=self.stats,
            margin_ms=self._margin_ms,
            monotonic_ms=monotonic_ms,
            running=lambda: self._mode is Mode.RUN,
            attempts=attempts,
        )
        self._views: list[LeaseView] = []
        """The lease documents as the last full round judged them (``route``)."""
        self._full = True
        """The next round reads every lease document (poked, first, or something left to do)."""
        self._check_at_ms: int | None = None
        """When the first watched pod's member document would expire (this pod's clock)."""
        self._held_after_full: set[int] = set()
        """The shards held when the last full round ended: a light round that finds fewer runs a full one."""
        self._light_rounds = 0
        self._run_failure: BaseException | None = None
        self._raw: dict[int, LeaseView] = {}
        """The lease documents as the last full round read them (before ``liveness.judged``)."""

    # ---- API for the runtime -------------------------------------------------------------------

    async def run(self) -> None:
        """Rounds until cancelled; after ``release_all`` it only waits to be cancelled.

        Raises ``LeaseLayoutError`` when the lease documents name another shard count than this
        pod's, ``MembershipRefused``/``Superseded`` (``members``), and whatever ``on_gained`` raised,
        kept as ``failure`` too. A bad document stops its shard only (``blocked``)."""
        try:
            await self._rounds()
        except Exception as exc:
            self._run_failure = exc  # ``settled`` answers False at once: the start must not go on
            raise

    @property
    def failure(self) -> BaseException | None:
        """What ended ``run()``, or the first failed ``on_gained``; None while all is well."""
        return self._run_failure or self._holdings.failure

    async def _rounds(self) -> None:
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
            if self._check_at_ms is not None:
                delay_ms = max(0, min(delay_ms, self._check_at_ms - self._monotonic_ms()))
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
        meanwhile); False on timeout (``None``: no bound) or at once when the manager failed (a
        refused pod name, another S: ``failure``). Later rounds' shards are not waited for; a pod
        that got no lease is settled once that round is done. Readiness waits for this; ingest too,
        bounded, so that a lone pod does not store its first messages for an owner (itself) it has
        not become yet."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_seconds is None else loop.time() + timeout_seconds
        while not self._first_round_loaded():
            if (deadline is not None and loop.time() >= deadline) or self.failure is not None:
                return False
            await asyncio.sleep(_SETTLED_POLL_SECONDS)
        return self.failure is None

    def _first_round_loaded(self) -> bool:
        """Every shard the first round took is loaded (one lost or re-taken since is not waited for)."""
        first = self._first_round
        return first is not None and all(self._holdings.get(s) is not h or h.ready for s, h in first.items())

    def poke(self) -> None:
        """Run a full round now (a lease document changed)."""
        self._full = True
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
            if not self._full and self._mode is Mode.RUN:
                light = await self._light_round()
                if light is not None:
                    return light
            self._full = False
            conflict = False
            beat = True
            # Missing documents are created free, then taken by a second pass at once (a first
            # round takes what it can, which ``settled`` relies on).
            for _ in range(2):
                mode = self._mode
                read = await self._read()
                if read is None:
                    return True
                views, members = read
                plan = planner.plan(views, self.pod_id, self._holdings.epochs(), self.lease_ms, mode)
                self.stats.pods = plan.pods
                for shard in plan.lost:
                    self._holdings.drop(shard)
                # A renewal writes a lease document only to clear an ask: the beat renews them all.
                writes = [w for w in plan.writes if w.action not in GIVING_UP and not self._idle(w)]
                lapsing = lapses(writes, self._raw, members, self.pod_id)
                taken = {id(w) for _, ws in lapsing.values() for w in ws}
                member = self._membership.beat() if beat else None
                beat = False
                conflict |= await self._writer.send([w for w in writes if id(w) not in taken], member)
                for owner, ws in lapsing.values():
                    conflict |= await self._writer.take_lapsing(owner, ws)
                giving = [w for w in plan.writes if w.action in GIVING_UP]
                if giving:
                    await self._before_giving_up({w.shard for w in giving if w.shard in self._holdings})
                    conflict |= await self._writer.send(giving)
                self._full |= conflict or bool(writes or giving)
                if not any(w.action is Action.CREATE for w in plan.writes):
                    break
            if self._first_round is None:
                self._first_round = self._holdings.snapshot()
            self._held_after_full = set(self._holdings.shards())
            self._light_rounds = 0
            return conflict

    def _idle(self, write: LeaseWrite) -> bool:
        """A renewal that would leave its lease document as it is (no ask to clear)."""
        return write.action is Action.RENEW and self._raw[write.shard].wanted_by == write.wanted_by

    async def _light_round(self) -> bool | None:
        """Between full rounds: read this pod's and the watched pods' member documents, and beat;
        None when a watched pod is no longer alive (a full round follows at once)."""
        self._holdings.expire_due()
        self._light_rounds += 1
        if set(self._holdings.shards()) != self._held_after_full or self._light_rounds >= _FULL_EVERY_ROUNDS:
            return None  # a shard lost since (its margin passed, a fence failed), or time to look at every lease
        self.stats.rounds += 1
        pods = sorted(self._membership.watched)
        try:
            read_us, versions = await self._documents.get_versioned(
                [self._membership.path, *self._membership.paths(pods)]
            )
        except StoreUnavailable as exc:
            self.stats.read_failures += 1
            _LOGGER.warning("subscription %s: member read failed, retrying soon: %s", self._subscription, exc)
            return True
        self._holdings.expire_due()
        if await self._check_own(read_us, versions):
            return True
        members = self._membership.members(read_us, versions, pods)
        if not all(m.alive for m in members.values()):
            return None
        self._schedule_check(members)
        conflict = await self._writer.send([], self._membership.beat())
        self._full |= conflict  # a poke that came meanwhile is kept
        return conflict

    async def _check_own(self, read_us: int, versions: dict[str, docs.Versioned]) -> bool:
        """Stop (raise) when a newer process took this pod name; True when this process's member
        document had lapsed and it joined again (every shard dropped: they are taken anew)."""
        stop = self._membership.check(read_us, versions)
        if stop is None:
            return False
        for shard in self._holdings.shards():
            self._holdings.drop(shard)
        if not isinstance(stop, Lapsed):
            raise stop
        _LOGGER.warning("subscription %s: %s; joining again", self._subscription, stop)
        await self._membership.join()
        self._full = True
        return True

    def _schedule_check(self, members: dict[str, MemberView]) -> None:
        first_us = first_expiry_us(list(members.values()))
        now = self._monotonic_ms()
        self._check_at_ms = None if first_us is None else now + first_us // 1000 + _CHECK_SLACK_MS

    async def _leave_round(self) -> bool:
        """One leaving round; True when every lease naming this pod was handed over or freed."""
        try:
            read = await self._read()
        except Superseded:
            return True  # a newer process of this pod name holds what this one held
        if read is None:
            return False
        alive = [pod for pod, member in read[1].items() if member.alive]  # the heirs: pods alive now
        plan = planner.plan(read[0], self.pod_id, self._holdings.epochs(), self.lease_ms, Mode.LEAVE, alive)
        for shard in self._holdings.shards():
            self._holdings.drop(shard, counted=shard in plan.lost)
        # The member document says this process left: a process restarted under the name takes it at once.
        return not await self._writer.send(list(plan.writes), self._membership.beat(left=True)) and not plan.lost

    async def _read(self) -> tuple[list[LeaseView], dict[str, MemberView]] | None:
        """Every lease document, this pod's member document and those of the pods the leases name
        (a second read for pods not watched yet); the leases judged by their owners' (``liveness``)."""
        self.stats.rounds += 1
        self._holdings.expire_due()
        pods = sorted(self._membership.watched)
        try:
            paths = [*self._paths, self._membership.path, *self._membership.paths(pods)]
            read_us, versions = await self._documents.get_versioned(paths)
            missing = docs.Versioned(None, None)
            raw = [
                read_lease(path, shard, self._shard_count, read_us, versions.get(path, missing))
                for shard, path in enumerate(self._paths)
            ]
            named = sorted(watched(raw, self.pod_id) - set(pods))
            more_us, more = await self._documents.get_versioned(self._membership.paths(named)) if named else (0, {})
        except StoreUnavailable as exc:
            self.stats.read_failures += 1
            _LOGGER.warning("subscription %s: lease read failed, retrying next round: %s", self._subscription, exc)
            return None
        self._holdings.expire_due()
        refusal = shard_count_refusal(self._sub_path, self._shard_count, raw)
        if refusal is not None:
            raise refusal
        if await self._check_own(read_us, versions):
            return None
        self.stats.blocked = note_problems(raw, self._blocked, self._subscription)
        members = self._membership.members(read_us, versions, pods)  # each judged at its own read's time
        members.update(self._membership.members(more_us, more, named))
        members = {pod: members[pod] for pod in watched(raw, self.pod_id)}
        self._membership.watched = {pod for pod, member in members.items() if member.alive}  # light rounds
        self._schedule_check(members)
        own = self._membership.own
        if own is not None:
            members[self.pod_id] = own  # this pod's leases are judged by its own member document too
        self._raw = {view.shard: view for view in raw}
        self._views = judged(raw, members)
        return self._views, members

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

    def _raise_failure(self) -> None:
        if self._holdings.failure is not None:
            raise self._holdings.failure
