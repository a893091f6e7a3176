"""Lease documents of one subscription: paths, fields, and the strict reading of what others wrote. Pure.

One document per shard, ``{sub_path}/leases/{shard:04d}``, created on first use, never deleted:

- ``v`` (int): ``LEASE_LAYOUT_VERSION``. A higher ``v`` was written by a newer sidecar: refused,
  never overwritten (it may mean something this version cannot see).
- ``shards`` (int): S of the pod that wrote it. Another S is refused: pods that disagree on S
  disagree on which shard a key is in, and two of them would deliver one key.
- ``owner`` (str, ``""`` when free), ``epoch`` (int, +1 on every change of owner, never down),
  ``beat`` (int, +1 on every renewal, so a renewal always changes the document and its
  ``update_time``), ``lease_ms`` (int, the owner's lease duration), ``wanted_by`` (str, a pod asking
  for the shard, ``""`` when none).

Expiry is judged on the database's clock only: ``read_time - update_time > lease_ms`` (both from
one read), so a pod's wall clock never matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

from sidecar.store import documents as docs
from sidecar.store.api import StoreRejected

LEASE_LAYOUT_VERSION = 1

_STRING_FIELDS = ("owner", "wanted_by")
_COUNTER_FIELDS = ("shards", "epoch", "beat", "lease_ms")


class LeaseLayoutError(StoreRejected):
    """A lease document this sidecar must not read as its own (newer, corrupt, other shard count)."""


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

    @property
    def is_free(self) -> bool:
        return not self.exists or not self.owner


def lease_path(sub_path: str, shard: int) -> str:
    return f"{sub_path}/leases/{shard:04d}"


def lease_fields(shard_count: int, owner: str, epoch: int, beat: int, lease_ms: int, wanted_by: str) -> dict[str, Any]:
    return {
        "v": LEASE_LAYOUT_VERSION,
        "shards": shard_count,
        "owner": owner,
        "epoch": epoch,
        "beat": beat,
        "lease_ms": lease_ms,
        "wanted_by": wanted_by,
    }


def read_lease(path: str, shard: int, shard_count: int, read_us: int, version: docs.Versioned) -> LeaseView:
    """The view of one lease document, or ``LeaseLayoutError`` naming the document and the fault."""
    fields = version.fields
    if fields is None:
        return LeaseView(shard, exists=False)
    written = fields.get("v")
    if not _is_int(written):
        raise LeaseLayoutError(f"lease document {path}: field 'v' is {_shown(written)}, not an integer (corrupt)")
    if written > LEASE_LAYOUT_VERSION:
        raise LeaseLayoutError(
            f"lease document {path}: layout version {written} was written by a newer sidecar "
            f"(this one reads version {LEASE_LAYOUT_VERSION}); upgrade this pod"
        )
    for name in _COUNTER_FIELDS:
        value = fields.get(name)
        if not _is_int(value) or value < 0:
            raise LeaseLayoutError(
                f"lease document {path}: field {name!r} is {_shown(value)}, not a non-negative integer (corrupt)"
            )
    for name in _STRING_FIELDS:
        if not isinstance(fields.get(name), str):
            raise LeaseLayoutError(
                f"lease document {path}: field {name!r} is {_shown(fields.get(name))}, not a string (corrupt)"
            )
    if fields["shards"] != shard_count:
        raise LeaseLayoutError(
            f"lease document {path}: written with shards={fields['shards']}, this pod is configured with "
            f"shards={shard_count}; a subscription's stored state is sharded for good (its cursors and "
            f"pending messages carry their shard): set sharding.shards back to {fields['shards']} "
            "(docs/operations.md, 'Changing the shard count S')"
        )
    if version.update_time_us is None:
        raise LeaseLayoutError(f"lease document {path}: the read returned it without an update time")
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
    )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    return "missing" if value is None else f"{type(value).__name__} {value!r}"[:80]
