"""Leases judged by their owners' member documents, and the member documents a take must lapse. Pure.

A lease is held while its document names a pod and that pod's member document is alive
(``MemberView.alive``): the member document's beat renews every lease of the pod at once, and lease
documents are written only when ownership changes. Rules:

- **Expiry** of a lease (``judged``) is its owner's: expired when the owner's member document is
  expired, left or lapsed. A lease whose owner has no member document (a sidecar from before them,
  or one deleted by hand) keeps the expiry of its own document (``read_time - update_time >
  lease_ms``), as before member documents.
- **An ask** (``wanted_by``) from a pod whose member document is not alive is no ask: a pod that
  died never keeps a lease from being balanced.
- **A take from a living process needs its lapse** (``lapses``): taking a lease whose owner's member
  document was read expired, but not yet lapsed or left, goes in one atomic Commit with the lapse of
  that member document, a compare-and-set on the version read. So a late beat of the owner (a
  compare-and-set on its version) and the take exclude each other: a beat that applied first fails
  the take; a take that applied first fails every later beat, and the owner, whose safety margin
  counts from its last beat that applied, stops holding (docs/leases.md, "Time").
- **Watching**: a pod reads, between full rounds, the member documents of the pods its leases name
  (``watched``), and looks again the moment the first of them would expire (``first_expiry_us``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from sidecar.cluster.leases.layout import LeaseView
from sidecar.cluster.leases.members import MemberView, member_fields, member_path
from sidecar.cluster.leases.planner import Action, LeaseWrite
from sidecar.store import documents as docs


def _readable(member: MemberView | None) -> bool:
    return member is not None and member.exists and not member.problem


def judged(views: Sequence[LeaseView], members: Mapping[str, MemberView]) -> list[LeaseView]:
    """``views`` with each lease's expiry its owner's, and asks of pods not alive left out."""
    out: list[LeaseView] = []
    for view in views:
        if view.problem or not view.exists:
            out.append(view)
            continue
        expired = view.expired
        owner = members.get(view.owner) if view.owner else None
        if owner is not None and _readable(owner):
            expired = not owner.alive
        wanted_by = view.wanted_by
        asker = members.get(wanted_by) if wanted_by else None
        if asker is not None and _readable(asker) and not asker.alive:
            wanted_by = ""
        out.append(replace(view, expired=expired, wanted_by=wanted_by))
    return out


def needs_lapse(view: LeaseView, members: Mapping[str, MemberView], me: str) -> MemberView | None:
    """The member document a take of ``view`` must lapse in the same Commit, if any."""
    if not view.owner or view.owner == me:
        return None
    owner = members.get(view.owner)
    if owner is None or not _readable(owner) or owner.left or owner.lapsed:
        return None
    return owner


def lapses(
    writes: Sequence[LeaseWrite], views: Mapping[int, LeaseView], members: Mapping[str, MemberView], me: str
) -> dict[str, tuple[MemberView, list[LeaseWrite]]]:
    """Owner -> (its member document as read, the takes that must lapse it): the takes among
    ``writes`` of leases whose owner's member document is readable and neither left nor lapsed."""
    out: dict[str, tuple[MemberView, list[LeaseWrite]]] = {}
    for write in writes:
        if write.action is not Action.ACQUIRE:
            continue
        owner = needs_lapse(views[write.shard], members, me)
        if owner is not None:
            out.setdefault(owner.pod, (owner, []))[1].append(write)
    return out


def lapse_write(sub_path: str, owner: MemberView) -> docs.Write:
    """``owner``'s member document marked lapsed, over the version read (nothing else changes)."""
    fields = member_fields(
        owner.pod, owner.incarnation, owner.address, owner.lease_ms, owner.beat, left=owner.left, lapsed=True
    )
    return docs.compare_and_set(member_path(sub_path, owner.pod), fields, owner.update_time_us)


def watched(views: Sequence[LeaseView], me: str) -> set[str]:
    """The pods other than ``me`` that the leases name (owners and askers)."""
    pods: set[str] = set()
    for view in views:
        if view.exists and not view.problem:
            pods.update(name for name in (view.owner, view.wanted_by) if name and name != me)
    return pods


def first_expiry_us(members: Sequence[MemberView]) -> int | None:
    """Of the alive ``members`` (one read), how long after the read the first would expire if it
    beat no more (database time, microseconds); None when none is alive."""
    left = [
        m.lease_ms * 1000 - (m.read_us - m.update_time_us) for m in members if m.alive and m.update_time_us is not None
    ]
    return max(0, min(left)) if left else None
