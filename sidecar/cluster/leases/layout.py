"""Lease documents of one subscription: paths, fields, and the strict reading of what others wrote. Pure.

One document per shard, ``{sub_path}/leases/{shard:04d}``, created on first use, never deleted:

- ``v`` (int): ``LEASE_LAYOUT_VERSION``. A higher ``v`` was written by a newer sidecar: that shard is
  left alone, never overwritten (it may mean something this version cannot see).
- ``shards`` (int): S of the pod that wrote it. Pods that disagree on S disagree on which shard a
  key is in, and two of them would deliver one key: when no lease document names this pod's S and
  one names another (``shard_count_refusal``), the pod's configuration is wrong and the whole
  subscription is refused; a single document naming another S beside documents of this S is a bad
  document of its shard.
- ``owner`` (str, ``""`` when free), ``epoch`` (int, moves up on every change of owner, never
  repeats: ``LeaseView.next_epoch``), ``beat`` (int, +1 on every renewal, so a renewal always
  changes the document and its ``update_time``), ``lease_ms`` (int, the owner's lease duration),
  ``wanted_by`` (str, a pod asking for the shard, ``""`` when none).
- ``attempts`` (str, optional): written only by a hand-over or release, opaque here: the delivery
  attempts the giving pod made of the shard's pending messages, for the next owner
  (``sidecar.pipeline.shard_engines``). Any other write leaves it out; a reader that does not know
  it ignores it, and one that cannot read it ignores it too (it only numbers attempts).

Expiry is judged on the database's clock only: ``read_time - update_time > lease_ms`` (both from
one read), so a pod's wall clock never matters. ``LeaseView.expired`` is the lease document's own;
the manager judges a lease by its owner's member document instead when the owner has one
(``sidecar.cluster.leases.liveness``), and lease documents are then written only on changes.

Epochs are unique per shard for all time, across a deleted or rewritten document: an epoch is never
below the read time of the read it was planned from (``next_epoch``). Every write that sets an epoch
commits after that read and over the version read, so its update time is at least the read time and
later than the version's: every epoch written is at most its own write's update time. A later read
(after a deletion by hand, after a repair with any epoch) has a read time no earlier than every update
time before it, hence above every epoch ever written by a pod; and the update times of one document
grow strictly, so ``epoch + 1`` keeps the bound too.

A document this pod must not read as its own (a newer ``v``, a missing, ill-typed, negative or
oversized field, another S) is a view with ``problem`` set, naming the document: its shard is never
taken nor written by this pod, and every other shard goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from sidecar.store import documents as docs
from sidecar.store.api import StoreRejected

_LOGGER = logging.getLogger("sidecar.cluster.leases.manager")
"""The manager's logger: these lines were always its."""

LEASE_LAYOUT_VERSION = 1

_STRING_FIELDS = ("owner", "wanted_by")
_COUNTER_FIELDS = ("shards", "epoch", "beat", "lease_ms")

MAX_COUNTER = 2**63 - 2
"""Firestore integers are 64-bit signed: a counter above this could not be moved on by one."""


class LeaseLayoutError(StoreRejected):
    """The lease documents of a subscription name another shard count than this pod's configuration."""


@dataclass(frozen=True, slots=True)
class LeaseView:
    """One shard's lease as one read saw it (a missing document is a free lease, ``exists=False``)."""

    shard: int
    exists: bool
    owner: str = ""
    epoch: int = 0
    beat: int = 0
    lease_ms: int = 0
    wanted_by: str = ""
    expired: bool = False
    """On the database's clock: the read's time minus the document's update time exceeds ``lease_ms``."""
    update_time_us: int | None = None
    """The version read: the compare-and-set precondition of any write based on this view."""
    read_us: int = 0
    """The read's time on the database's clock (microseconds): no new epoch is below it."""
    problem: str = ""
    """Why this pod must not read the document as a lease (one line naming it); ``""`` when it may."""
    other_shard_count: int | None = None
    """The S the document names when that is its problem (``shard_count_refusal``)."""
    attempts: str = ""
    """What the last hand-over or release recorded of the shard's delivery attempts (module docstring)."""

    @property
    def is_free(self) -> bool:
        return not self.exists or not self.owner

    @property
    def next_epoch(self) -> int:
        """The epoch of any change of owner planned from this view: above the one read, and never
        below the read time, so above every epoch this shard ever had (module docstring)."""
        return max(self.epoch + 1, self.read_us)


def lease_path(sub_path: str, shard: int) -> str:
    return f"{sub_path}/leases/{shard:04d}"


def lease_fields(
    shard_count: int, owner: str, epoch: int, beat: int, lease_ms: int, wanted_by: str, attempts: str = ""
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "v": LEASE_LAYOUT_VERSION,
        "shards": shard_count,
        "owner": owner,
        "epoch": epoch,
        "beat": beat,
        "lease_ms": lease_ms,
        "wanted_by": wanted_by,
    }
    if attempts:
        fields["attempts"] = attempts
    return fields


def read_lease(path: str, shard: int, shard_count: int, read_us: int, version: docs.Versioned) -> LeaseView:
    """The view of one lease document; a bad one is a view with ``problem`` naming the document."""
    fields = version.fields
    if fields is None:
        return LeaseView(shard, exists=False, read_us=read_us)
    problem = _problem(path, fields, version.update_time_us)
    if problem is not None:
        return LeaseView(shard, exists=True, read_us=read_us, problem=problem)
    if fields["shards"] != shard_count:
        return LeaseView(
            shard,
            exists=True,
            read_us=read_us,
            problem=(
                f"lease document {path}: written with shards={fields['shards']}, this pod is configured with "
                f"shards={shard_count}"
            ),
            other_shard_count=fields["shards"],
        )
    assert version.update_time_us is not None  # checked by _problem
    lease_ms = fields["lease_ms"]
    return LeaseView(
        shard,
        exists=True,
        owner=fields["owner"],
        epoch=fields["epoch"],
        beat=fields["beat"],
        lease_ms=lease_ms,
        wanted_by=fields["wanted_by"],
        expired=read_us - version.update_time_us > lease_ms * 1000,
        update_time_us=version.update_time_us,
        read_us=read_us,
        attempts=attempts if isinstance(attempts := fields.get("attempts"), str) else "",
    )


def shard_count_refusal(sub_path: str, shard_count: int, views: Sequence[LeaseView]) -> LeaseLayoutError | None:
    """The subscription-wide refusal when this pod's S is the odd one out: some lease document names
    another S and none names this one (a pod started with a wrong ``sharding.shards``). Otherwise a
    document naming another S is only its own shard's problem (a document changed by hand)."""
    others = [v for v in views if v.other_shard_count is not None]
    if not others or any(v.exists and not v.problem for v in views):
        return None
    written = others[0].other_shard_count
    return LeaseLayoutError(
        f"lease documents of {sub_path}: written with shards={written}, this pod is configured with "
        f"shards={shard_count}; a subscription's stored state is sharded for good (its cursors and "
        f"pending messages carry their shard): set sharding.shards back to {written} "
        "(docs/operations.md, 'Changing the shard count S')"
    )


def note_problems(views: Sequence[LeaseView], blocked: dict[int, str], subscription: str) -> int:
    """Keep ``blocked`` (shard -> problem) as ``views`` show it, logging once per problem, not every
    round: an ERROR line when a document turns bad (or its problem changes), an INFO line when it
    reads as a lease again. Returns how many shards are blocked."""
    for view in views:
        known = blocked.get(view.shard)
        if view.problem and view.problem != known:
            _LOGGER.error(
                "subscription %s: shard %d stopped, its lease document is left alone: %s",
                subscription,
                view.shard,
                view.problem,
            )
            blocked[view.shard] = view.problem
        elif not view.problem and known is not None:
            _LOGGER.info(
                "subscription %s: shard %d: its lease document reads as a lease again", subscription, view.shard
            )
            del blocked[view.shard]
    return len(blocked)


def _problem(path: str, fields: docs.Fields, update_time_us: int | None) -> str | None:
    written = fields.get("v")
    if not _is_int(written):
        return f"lease document {path}: field 'v' is {_shown(written)}, not an integer (corrupt)"
    if written > LEASE_LAYOUT_VERSION:
        return (
            f"lease document {path}: layout version {written} was written by a newer sidecar "
            f"(this one reads version {LEASE_LAYOUT_VERSION}); upgrade this pod"
        )
    for name in _COUNTER_FIELDS:
        value = fields.get(name)
        if not _is_int(value) or not 0 <= value <= MAX_COUNTER:
            return f"lease document {path}: field {name!r} is {_shown(value)}, not a non-negative integer (corrupt)"
    for name in _STRING_FIELDS:
        if not isinstance(fields.get(name), str):
            return f"lease document {path}: field {name!r} is {_shown(fields.get(name))}, not a string (corrupt)"
    if update_time_us is None:
        return f"lease document {path}: the read returned it without an update time"
    return None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    return "missing" if value is None else f"{type(value).__name__} {value!r}"[:80]
