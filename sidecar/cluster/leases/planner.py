"""What one pod writes to the lease documents in one round: a pure function of what it read.

No I/O and no clock: the views carry ``expired`` as judged on the database's clock by the caller,
and every write is a compare-and-set on the version the view was read at (a create for a missing
document), so two pods planning from the same read can never both win one shard.

Rules (KCL's lease taker and Kafka's cooperative rebalancing, adapted):

- **Live pods** are the owners of unexpired leases, the pods asking for an unexpired lease
  (``wanted_by``), and this pod. With S shards and P live pods every pod aims for ``floor(S/P)``
  (``base``) and may hold up to ``ceil(S/P)``; when every pod holds one of the two and every shard
  is owned, the shares are balanced within one.
- **Renew** every lease this pod holds (``beat + 1``: every renewal changes the document). A
  renewal clears an ask it does not grant, so an ask from a pod that has died never outlives the
  owner's next renewal. The manager writes a renewal only when it clears an ask: the pod's member
  document's beat renews every lease it holds (``sidecar.cluster.leases.liveness``, which also
  judges ``expired`` in the views from the owners' member documents).
- **Create** a missing document (first use, or deleted by hand) free, at the read's time, and take
  it in a later plan like any free lease (the manager plans again at once). A create's only
  precondition is "missing", which a document deleted and created again meanwhile also meets: a
  create planned before that and applied after it writes an epoch from before, so no pod ever
  holds the epoch a create writes.
- **Take** free and expired leases, and leases that name this pod but that it does not hold
  (handed over to it, or held by an earlier life of this pod id), up to the ceiling. An
  acquisition always moves the epoch, so a write fenced with an epoch from before never applies.
- **Every change of owner** (take, hand-over, release) is a compare-and-set on the version read,
  and sets the epoch to ``LeaseView.next_epoch``: above the one read and never below the read's
  time, so an epoch held never repeats for a shard, even when its document was deleted or rewritten
  by hand (``sidecar.cluster.leases.layout``).
- **Bad documents** (a view with ``problem``: corrupt, newer layout, another S) are not leases: never
  taken, renewed, asked for, handed over nor released, not counted in S for the fair share, and a
  held shard whose document turned bad is ``lost`` (this pod cannot renew it).
- **Ask** (set ``wanted_by`` to this pod, nothing else) when below ``base`` after taking, one
  lease per missing shard, from the pods holding most above ``base``, only on leases nobody asks for
  yet, and never twice: an ask changes the update time once, so it keeps a dead owner's lease alive
  for at most one more lease duration.
- **Hand over** (``owner`` = the asking pod) asked-for leases while above ``base``; **release**
  (``owner`` = ``""``) what is still above the ceiling, and leases naming this pod that it neither
  holds nor takes.
- **Draining** (SIGTERM, while the apps' in-flight messages drain): renew only, create, take and
  ask nothing. **Leaving**: hand every lease naming this pod over, to the pod asking for it, else to
  the successor (another pod alive now) holding fewest, so each shard has a named owner at once;
  release it only when there is none; and withdraw its asks.

A held lease whose document shows another owner or epoch, or is missing or bad, is reported
``lost``. Invariants (property tested in tests/cluster/): every epoch a change of owner writes is
above every epoch the shard ever had, across deletions and repairs by hand; a write never changes
the owner or epoch of a lease that is neither held by this pod nor free, expired or naming this pod;
a bad document is never written.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sidecar.cluster.leases.layout import LeaseView


class Mode(enum.Enum):
    RUN = "run"
    DRAIN = "drain"
    LEAVE = "leave"


class Action(enum.Enum):
    CREATE = "create"
    """A missing document, written free (nobody holds its epoch)."""
    RENEW = "renew"
    ACQUIRE = "acquire"
    ASK = "ask"
    WITHDRAW = "withdraw"
    """Clear this pod's own ask (leaving)."""
    HAND_OVER = "hand_over"
    RELEASE = "release"


GIVING_UP = frozenset({Action.HAND_OVER, Action.RELEASE})
"""Writes after which this pod no longer holds the shard (it must stop delivering first)."""


@dataclass(frozen=True, slots=True)
class LeaseWrite:
    """The whole new content of one lease document, written only over the version read."""

    shard: int
    action: Action
    owner: str
    epoch: int
    beat: int
    lease_ms: int
    wanted_by: str
    update_time_us: int | None
    """The precondition: the version read; None creates the document (it was missing)."""
    attempts: str = ""
    """A take: the delivery attempts the document read holds (``layout``), for this pod once it applies."""


@dataclass(frozen=True, slots=True)
class Plan:
    writes: tuple[LeaseWrite, ...]
    lost: frozenset[int]
    """Held shards whose document names another owner or epoch: drop them now."""
    pods: int
    """Live pods seen (the P of the fair share)."""


def fair_share(shard_count: int, pods: int) -> tuple[int, int]:
    """(floor, ceiling) of S shards over P pods."""
    base, extra = divmod(shard_count, pods)
    return base, base + (1 if extra else 0)


def plan(
    views: Sequence[LeaseView],
    me: str,
    held: Mapping[int, int],
    lease_ms: int,
    mode: Mode = Mode.RUN,
    successors: Sequence[str] = (),
) -> Plan:
    """The writes of one round. ``views``: every shard's lease from one read (bad documents
    included: they are left alone); ``successors``: the other pods alive now, to whom a leaving pod
    hands what nobody asks for; ``held``: shard -> epoch this pod holds now (within its safety
    margin, or being loaded)."""
    views = sorted((v for v in views if not v.problem), key=lambda v: v.shard)
    lost = frozenset(s for s, e in held.items() if not _names(_view_at(views, s), me, e))
    mine = [v for v in views if v.shard in held and v.shard not in lost]
    stray = [v for v in views if v.exists and v.owner == me and (v.shard not in held or v.shard in lost)]
    writes: list[LeaseWrite] = []
    live = _live_pods(views, me)
    if mode is Mode.LEAVE:
        heirs = _heirs(views, [pod for pod in successors if pod != me])
        for v in mine + [v for v in stray if not v.expired]:
            writes.append(_give_up(v, lease_ms, heirs))
        writes.extend(
            _write(v, Action.WITHDRAW, v.owner, v.epoch, v.beat, v.lease_ms, "")
            for v in views
            if v.exists and v.wanted_by == me and v.owner not in ("", me) and not v.expired
        )
        return Plan(tuple(sorted(writes, key=lambda w: w.shard)), lost, len(live))
    if mode is Mode.DRAIN:
        writes.extend(_write(v, Action.RENEW, me, v.epoch, v.beat + 1, lease_ms, v.wanted_by) for v in mine)
        writes.extend(_release(v, lease_ms) for v in stray if not v.expired)
        return Plan(tuple(sorted(writes, key=lambda w: w.shard)), lost, len(live))

    base, ceiling = fair_share(len(views), len(live))
    asked = [v for v in mine if v.wanted_by not in ("", me)]
    handed = asked[: max(0, len(mine) - base)]
    for v in handed:
        writes.append(_give_up(v, lease_ms))
    keep = [v for v in mine if v not in handed]
    surplus = max(0, len(keep) - ceiling)
    for v in keep[len(keep) - surplus :]:
        writes.append(_release(v, lease_ms))
    keep = keep[: len(keep) - surplus]
    writes.extend(_write(v, Action.RENEW, me, v.epoch, v.beat + 1, lease_ms, "") for v in keep)

    writes.extend(_create(v, lease_ms) for v in views if not v.exists)
    candidates = _takeable(views, me, held, lost)
    room = max(0, ceiling - len(keep))
    taken = candidates[:room]
    writes.extend(_write(v, Action.ACQUIRE, me, v.next_epoch, v.beat + 1, lease_ms, "") for v in taken)
    writes.extend(_release(v, lease_ms) for v in candidates[room:] if v.owner == me and not v.expired)

    holding = len(keep) + len(taken)
    if holding < base:
        writes.extend(_asks(views, me, base, base - holding))
    return Plan(tuple(sorted(writes, key=lambda w: w.shard)), lost, len(live))


def _view_at(views: Sequence[LeaseView], shard: int) -> LeaseView | None:
    index = shard if 0 <= shard < len(views) and views[shard].shard == shard else None
    if index is not None:
        return views[index]
    return next((v for v in views if v.shard == shard), None)


def _names(view: LeaseView | None, me: str, epoch: int) -> bool:
    return view is not None and view.exists and view.owner == me and view.epoch == epoch


def _live_pods(views: Sequence[LeaseView], me: str) -> set[str]:
    live = {me}
    for v in views:
        if v.exists and not v.expired:
            live.update(name for name in (v.owner, v.wanted_by) if name)
    return live


def _takeable(views: Sequence[LeaseView], me: str, held: Mapping[int, int], lost: frozenset[int]) -> list[LeaseView]:
    """Leases this pod may take, best first: naming it already, then free, then expired. Each group
    starts at an offset of this pod's own, so pods racing for free leases mostly try different ones."""
    start = int.from_bytes(hashlib.sha256(me.encode("utf-8", "surrogatepass")).digest()[:4], "big")
    count = max(1, len(views))

    def rank(v: LeaseView) -> tuple[int, int]:
        group = 0 if v.exists and v.owner == me else 1 if v.is_free else 2
        return group, (v.shard - start) % count

    takeable = [
        v
        for v in views
        if v.exists and (v.shard not in held or v.shard in lost) and (v.is_free or v.expired or v.owner == me)
    ]
    return sorted(takeable, key=rank)


def _asks(views: Sequence[LeaseView], me: str, base: int, missing: int) -> list[LeaseWrite]:
    """Up to ``missing`` asks (fewer by those already standing) on leases of pods above ``base``."""
    owned: dict[str, list[LeaseView]] = {}
    for v in views:
        if v.exists and v.owner and not v.expired:
            owned.setdefault(v.owner, []).append(v)
    standing = sum(1 for leases in owned.values() for v in leases if v.wanted_by == me and v.owner != me)
    missing -= standing
    spare = {
        owner: len(leases) - base - sum(1 for v in leases if v.wanted_by)
        for owner, leases in owned.items()
        if owner != me
    }
    asks: list[LeaseWrite] = []
    while missing > 0:
        donor = max(spare, key=lambda owner: (spare[owner], owner), default=None)
        if donor is None or spare[donor] <= 0:
            break
        spare[donor] -= 1
        asked = {a.shard for a in asks}
        lease = next((v for v in owned[donor] if not v.wanted_by and v.shard not in asked), None)
        if lease is None:
            continue
        asks.append(_write(lease, Action.ASK, lease.owner, lease.epoch, lease.beat, lease.lease_ms, me))
        missing -= 1
    return asks


def _create(v: LeaseView, lease_ms: int) -> LeaseWrite:
    return LeaseWrite(v.shard, Action.CREATE, "", v.next_epoch, 0, lease_ms, "", None)


def _give_up(v: LeaseView, lease_ms: int, heirs: dict[str, int] | None = None) -> LeaseWrite:
    """To the pod asking for it, else (leaving) to the heir holding fewest, else free."""
    if v.wanted_by and v.wanted_by != v.owner:
        return _write(v, Action.HAND_OVER, v.wanted_by, v.next_epoch, v.beat + 1, lease_ms, "")
    if heirs:
        heir = min(heirs, key=lambda pod: (heirs[pod], pod))
        heirs[heir] += 1
        return _write(v, Action.HAND_OVER, heir, v.next_epoch, v.beat + 1, lease_ms, "")
    return _release(v, lease_ms)


def _heirs(views: Sequence[LeaseView], successors: Sequence[str]) -> dict[str, int]:
    """Each successor with the unexpired leases it owns now (a leaving pod's shards go to the fewest)."""
    heirs = dict.fromkeys(successors, 0)
    for v in views:
        if v.exists and not v.expired and v.owner in heirs:
            heirs[v.owner] += 1
    return heirs


def _release(v: LeaseView, lease_ms: int) -> LeaseWrite:
    return _write(v, Action.RELEASE, "", v.next_epoch, v.beat + 1, lease_ms, "")


def _write(
    v: LeaseView, action: Action, owner: str, epoch: int, beat: int, lease_ms: int, wanted_by: str
) -> LeaseWrite:
    assert v.exists and v.update_time_us is not None, "only a create writes without a version"
    attempts = v.attempts if action is Action.ACQUIRE else ""
    return LeaseWrite(v.shard, action, owner, epoch, beat, lease_ms, wanted_by, v.update_time_us, attempts)
