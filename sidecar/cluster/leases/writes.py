"""The writes of a lease round, carried out: one BatchWrite of compare-and-set writes with this
pod's beat, and the takes that must lapse their owner's member document in an atomic Commit each
(``sidecar.cluster.leases.liveness``). What applied is booked in ``Holdings`` and ``LeaseStats``.

Rules:

- **The beat renews every held lease.** A beat that applied extends the safety margin of every
  shard this pod holds to ``sent + 0.8 * lease_ms`` (``sent``: when the request left, earlier than
  its update time); a take's margin counts from the last beat that applied, not from the take: the
  other pods judge this pod alive from its member document only.
- **Per-write outcomes.** A lost compare-and-set (another pod wrote first) costs only its write and
  asks for the next round soon; a write that failed otherwise is logged and retried by the next
  round; an ambiguous failure (``Unavailable``) is read back by the next round (a take that did
  apply shows this pod as owner but not holding it, and is taken again at a new epoch).
- **Delivery attempts go with a shard given up.** A hand-over or release records what
  ``Attempts.handed_attempts`` gives for its shard (the attempts this pod made of the shard's
  pending messages) in the lease document it writes anyway; a take that applied hands what the
  document read held (``LeaseWrite.attempts``) to ``Attempts.inherit_attempts`` before the shard's
  load begins. No write of its own: no operation is billed for them.
- **A take that lapses an owner** applies whole or not at all: the lapse is a compare-and-set on
  the member document's version read, so the owner's late beat and the take exclude each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from sidecar.cluster.leases.holdings import Holdings
from sidecar.cluster.leases.layout import lease_fields, lease_path
from sidecar.cluster.leases.liveness import lapse_write
from sidecar.cluster.leases.members import MemberView
from sidecar.cluster.leases.membership import Membership
from sidecar.cluster.leases.planner import GIVING_UP, Action, LeaseWrite
from sidecar.store import documents as docs
from sidecar.store.api import StoreUnavailable

_LOGGER = logging.getLogger("sidecar.cluster.leases.manager")
"""The manager's logger: the round's writes are what it reports."""


class Attempts(Protocol):
    """Delivery attempts of a shard's pending messages, opaque here (``layout``: ``attempts``)."""

    def handed_attempts(self, shard: int) -> str:
        """What to record in the lease write giving ``shard`` up (``""``: nothing)."""
        ...

    def inherit_attempts(self, shard: int, encoded: str) -> None:
        """What a giving pod recorded, for the shard just taken (before its load)."""
        ...


class _NoAttempts:
    def handed_attempts(self, shard: int) -> str:
        return ""

    def inherit_attempts(self, shard: int, encoded: str) -> None:
        pass


NO_ATTEMPTS: Attempts = _NoAttempts()
"""Nothing recorded, nothing kept (a lease manager without a runtime: tests, tools)."""


@dataclass(slots=True)
class LeaseStats:
    """Counters for GetStatus and metrics."""

    rounds: int = 0
    read_failures: int = 0
    renewals: int = 0
    """Held leases a beat renewed (one per held lease per beat that applied)."""
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


class LeaseWriter:
    """Sends one subscription's lease writes for this pod and books what applied."""

    def __init__(
        self,
        documents: docs.Documents,
        sub_path: str,
        shard_count: int,
        *,
        holdings: Holdings,
        membership: Membership,
        stats: LeaseStats,
        margin_ms: int,
        monotonic_ms: Callable[[], int],
        running: Callable[[], bool],
        attempts: Attempts = NO_ATTEMPTS,
    ) -> None:
        self._documents = documents
        self._sub_path = sub_path
        self._subscription = sub_path.rpartition("/")[2]
        self._shard_count = shard_count
        self._holdings = holdings
        self._membership = membership
        self._stats = stats
        self._margin_ms = margin_ms
        self._monotonic_ms = monotonic_ms
        self._running = running
        """False once draining began: a take that applies then is left as a stray (released later)."""
        self._attempts = attempts

    async def send(self, writes: Sequence[LeaseWrite], member: docs.Write | None = None) -> bool:
        """Write ``writes`` and ``member`` (this pod's member document) in one BatchWrite; True when
        one lost a race (another pod wrote first) or failed."""
        if not writes and member is None:
            return False
        batch = [self._lease_write(w) for w in writes]
        if member is not None:
            batch.append(member)
        # The margin counts from before the request leaves: the write's update time is later.
        sent_ms = self._monotonic_ms()
        try:
            statuses = await self._documents.batch_write(batch)
        except StoreUnavailable as exc:
            # Maybe applied: the next round's read tells (a take that did apply shows this pod as
            # owner but not holding it, and is taken again at a new epoch).
            self._stats.renewal_failures += len(self._holdings.shards()) if member is not None else 0
            _LOGGER.warning("subscription %s: lease write failed, retrying soon: %s", self._subscription, exc)
            return True
        conflict = False
        if member is not None:
            code, message = statuses.pop()
            if code == docs.OK:
                self._beat_applied(sent_ms)
            else:
                # The next round's read tells why: a blip, a lapse by another pod, or a newer process of this name.
                conflict = True
                self._stats.renewal_failures += len(self._holdings.shards())
                _LOGGER.warning(
                    "subscription %s: member document write failed: %d %s", self._subscription, code, message
                )
        for write, (code, message) in zip(writes, statuses, strict=True):
            if code == docs.OK:
                self._applied(write, sent_ms)
                continue
            if code in (docs.FAILED_PRECONDITION, docs.ALREADY_EXISTS):
                self._stats.conflicts += 1
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

    def _lease_write(self, w: LeaseWrite) -> docs.Write:
        attempts = self._attempts.handed_attempts(w.shard) if w.action in GIVING_UP else ""
        fields = lease_fields(self._shard_count, w.owner, w.epoch, w.beat, w.lease_ms, w.wanted_by, attempts)
        return docs.compare_and_set(lease_path(self._sub_path, w.shard), fields, w.update_time_us)

    def _beat_applied(self, sent_ms: int) -> None:
        """The beat renews every lease this pod holds: its margin counts from when the beat was sent."""
        self._membership.beat_sent_ms = sent_ms
        for shard, epoch in self._holdings.epochs().items():
            if self._holdings.renew(shard, epoch, sent_ms + self._margin_ms):
                self._stats.renewals += 1

    def _applied(self, write: LeaseWrite, sent_ms: int) -> None:
        # A lease is held as long as this pod's member document is alive: from its last beat.
        beat_ms = self._membership.beat_sent_ms
        deadline_ms = min(sent_ms, sent_ms if beat_ms is None else beat_ms) + self._margin_ms
        if write.action is Action.RENEW:
            pass  # an ask cleared; the beat renews
        elif write.action is Action.ACQUIRE:
            if not self._running() or write.shard in self._holdings:
                return  # draining began meanwhile: the stray is released by the next round
            self._stats.takes += 1
            if write.attempts:
                self._attempts.inherit_attempts(write.shard, write.attempts)
            self._holdings.take(write.shard, write.epoch, deadline_ms)
        elif write.action is Action.CREATE:
            self._stats.creates += 1
        elif write.action is Action.ASK:
            self._stats.asks += 1
        elif write.action is Action.HAND_OVER:
            self._stats.handovers += 1
        elif write.action is Action.RELEASE:
            self._stats.releases += 1

    async def take_lapsing(self, owner: MemberView, writes: list[LeaseWrite]) -> bool:
        """Take ``writes`` (leases of ``owner``, whose member document was read expired) in one Commit
        that marks the member document lapsed; True when it did not apply (liveness docstring)."""
        batch = [lapse_write(self._sub_path, owner), *(self._lease_write(w) for w in writes)]
        sent_ms = self._monotonic_ms()
        try:
            await self._documents.commit(batch)
        except (docs.PreconditionFailed, docs.AlreadyExists):
            self._stats.conflicts += 1
            return True
        except StoreUnavailable as exc:
            _LOGGER.warning(
                "subscription %s: take from %r failed, retrying soon: %s", self._subscription, owner.pod, exc
            )
            return True
        _LOGGER.info(
            "subscription %s: pod %r (incarnation %d) lapsed: its member document expired; took shards %s",
            self._subscription,
            owner.pod,
            owner.incarnation,
            [w.shard for w in writes],
        )
        for write in writes:
            self._applied(write, sent_ms)
        self._holdings.arm_timer()
        return False
