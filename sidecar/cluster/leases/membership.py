"""This process's membership of one subscription: its pod name taken as a new incarnation, its beat,
and the addresses of the pods that own shards. I/O for ``sidecar.cluster.leases.members``' rules.

``ShardLeases`` (``manager``) drives it:

- ``join()`` once, before the first round: takes the pod name for this process
  (``members.decide_join``): at once when no earlier process of the name can be running, refused
  (``MembershipRefused``) when one answers on the address it recorded, after its member document
  expired when it recorded none. A write whose answer was lost is recognised at the next read by
  its incarnation (incarnations never repeat).
- Every round reads the member document (with the lease documents in a full round) and ``check``s
  it: a newer incarnation of the name (``Superseded``), or a document this sidecar does not read as
  a member document (``MembershipRefused``), stops the process (the manager drops every shard
  first); a document lapsed by another pod (or deleted by hand) is ``Lapsed``: the manager drops
  every shard and the process joins again at once. ``beat()`` is the round's write of it
  (``beat + 1``, a compare-and-set on the version read), ``left=True`` when ``release_all`` gives
  everything up; ``beat_sent_ms`` is when the last of its writes that applied was sent, which the
  safety margin of every lease this pod holds counts from.
- ``members`` reads what a round read of the other pods' member documents, and keeps their
  addresses for ``address_of`` (``ShardLeases.route``); ``watched`` are the pods a light round reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from sidecar.backoff import backoff_seconds
from sidecar.cluster.leases.members import (
    Join,
    MembershipRefused,
    MemberView,
    Superseded,
    decide_join,
    member_fields,
    member_path,
    read_member,
)
from sidecar.store import documents as docs
from sidecar.store.api import StoreUnavailable

_LOGGER = logging.getLogger("sidecar.cluster.leases.manager")
"""The manager's logger: membership is part of what it reports."""

_MISSING = docs.Versioned(None, None)


@dataclass(frozen=True, slots=True)
class Route:
    """Who delivers a shard, as this pod last read it (``ShardLeases.route``): the owner's pod name,
    its epoch, and the address its member document names (``""``: none, or not read yet)."""

    pod: str
    epoch: int
    address: str


class Lapsed(Exception):
    """This process's member document was lapsed by another pod, or deleted: it must join again."""


class Membership:
    """This process under one pod name, for one subscription (module docstring)."""

    def __init__(
        self,
        documents: docs.Documents,
        sub_path: str,
        pod_id: str,
        *,
        address: str,
        lease_ms: int,
        probe: Callable[[str], Awaitable[bool]],
        monotonic_ms: Callable[[], int],
    ) -> None:
        self._documents = documents
        self._sub_path = sub_path
        self._subscription = sub_path.rpartition("/")[2]
        self.pod_id = pod_id
        self.address = address
        self._lease_ms = lease_ms
        self._period_s = lease_ms / 3000
        self._probe = probe
        self.path = member_path(sub_path, pod_id)
        self.incarnation: int | None = None
        """Set once ``join`` took the name for this process."""
        self._view: MemberView | None = None
        """The member document as the last round read it (the version its beat replaces)."""
        self._monotonic_ms = monotonic_ms
        self.beat_sent_ms: int | None = None
        """When the last write of the member document that applied was sent (this pod's clock)."""
        self._addresses: dict[str, str] = {}
        """Pod -> the address its member document named when last read."""
        self.watched: set[str] = set()
        """The other pods the leases named at the last full round: a light round reads their documents."""

    # ---- the rounds ---------------------------------------------------------------------------

    def check(self, read_us: int, versions: dict[str, docs.Versioned]) -> Exception | None:
        """Keep this pod's member document as a round read it; the reason this process must stop,
        if any: a newer incarnation of the name, or a document it must not read as a member's."""
        view = read_member(self.path, self.pod_id, read_us, versions.get(self.path, _MISSING))
        if view.problem:
            return MembershipRefused(f"subscription {self._subscription}: {view.problem}")
        if not view.exists or (view.lapsed and view.incarnation == self.incarnation):
            self.incarnation = None
            return Lapsed(f"subscription {self._subscription}: member document {self.path} lapsed or deleted")
        if view.exists and view.incarnation != self.incarnation:
            return Superseded(
                f"subscription {self._subscription}: member document {self.path} names incarnation "
                f"{view.incarnation} of pod {self.pod_id!r}, this process is incarnation {self.incarnation}: "
                "a newer process runs under this pod name; this one stops"
            )
        self._view = view
        return None

    @property
    def own(self) -> MemberView | None:
        """This pod's member document as the last round read it."""
        return self._view

    def beat(self, *, left: bool = False) -> docs.Write:
        """The round's write of the member document: ``beat + 1`` over the version the round read
        (created again with this incarnation if it was deleted by hand)."""
        assert self.incarnation is not None, "joined before any round"
        view = self._view
        exists = view is not None and view.exists
        beat = view.beat + 1 if view is not None and exists else 0
        fields = member_fields(self.pod_id, self.incarnation, self.address, self._lease_ms, beat, left=left)
        return docs.compare_and_set(self.path, fields, view.update_time_us if view is not None and exists else None)

    # ---- joining ------------------------------------------------------------------------------

    async def join(self) -> None:
        """Take the pod name for this process (module docstring); raises ``MembershipRefused``."""
        attempt = 0
        tried: int | None = None
        waiting_logged = False
        while True:
            try:
                read_us, found = await self._documents.get_versioned([self.path])
            except StoreUnavailable as exc:
                _LOGGER.warning("subscription %s: member document read failed, retrying: %s", self._subscription, exc)
                await self._later(attempt)
                attempt += 1
                continue
            view = read_member(self.path, self.pod_id, read_us, found.get(self.path, _MISSING))
            if tried is not None and view.exists and not view.problem and view.incarnation == tried:
                self.incarnation = tried  # an earlier write whose answer was lost did apply
                return
            decision = decide_join(view, self.address)
            if decision is Join.REFUSE:
                raise MembershipRefused(f"subscription {self._subscription}: {view.problem}")
            if decision is Join.WAIT:
                if not waiting_logged:
                    waiting_logged = True
                    _LOGGER.info(
                        "subscription %s: incarnation %d of pod %r beat less than a lease ago and recorded no "
                        "address to ask: waiting until its member document expires",
                        self._subscription,
                        view.incarnation,
                        self.pod_id,
                    )
                assert view.update_time_us is not None
                left_us = view.lease_ms * 1000 - (read_us - view.update_time_us)
                await asyncio.sleep(min(max(left_us, 0) / 1_000_000 + 0.01, self._period_s))
                continue
            if decision is Join.PROBE and await self._probe(view.address):
                raise MembershipRefused(
                    f"subscription {self._subscription}: pod name {self.pod_id!r} is taken: incarnation "
                    f"{view.incarnation} beat less than a lease ago and answers on {view.address}; two processes "
                    "must not run under one pod name (POD_NAME)"
                )
            tried = view.next_incarnation
            fields = member_fields(self.pod_id, tried, self.address, self._lease_ms, 0)
            write = docs.compare_and_set(self.path, fields, view.update_time_us if view.exists else None)
            sent_ms = self._monotonic_ms()
            try:
                ((code, _),) = await self._documents.batch_write([write])
            except StoreUnavailable as exc:
                _LOGGER.warning("subscription %s: member document write failed, retrying: %s", self._subscription, exc)
                await self._later(attempt)
                attempt += 1
                continue
            if code == docs.OK:
                self.incarnation = tried
                self._view = None
                self.beat_sent_ms = sent_ms
                if view.exists and not view.left:
                    _LOGGER.info(
                        "subscription %s: pod %r taken over from incarnation %d (%s) by incarnation %d",
                        self._subscription,
                        self.pod_id,
                        view.incarnation,
                        "expired"
                        if view.expired
                        else "its address is this process's own"
                        if view.address == self.address
                        else f"nothing answers on {view.address}",
                        tried,
                    )
                return
            # Another process of this name wrote first (or a blip): read again, soon.
            await self._later(attempt)
            attempt += 1

    async def _later(self, attempt: int) -> None:
        await asyncio.sleep(backoff_seconds(attempt, 0.05, self._period_s))

    # ---- the other pods ------------------------------------------------------------------------

    def paths(self, pods: Iterable[str]) -> list[str]:
        return [member_path(self._sub_path, pod) for pod in pods]

    def members(self, read_us: int, versions: dict[str, docs.Versioned], pods: Iterable[str]) -> dict[str, MemberView]:
        """The member documents of ``pods`` as one read saw them; their addresses are kept."""
        out: dict[str, MemberView] = {}
        for pod in pods:
            path = member_path(self._sub_path, pod)
            view = read_member(path, pod, read_us, versions.get(path, _MISSING))
            out[pod] = view
            if view.exists and not view.problem:
                self._addresses[pod] = view.address
            else:
                self._addresses.pop(pod, None)
        return out

    def address_of(self, pod: str) -> str:
        """The address ``pod``'s member document named when last read (``""``: none, or not read)."""
        if pod == self.pod_id:
            return self.address
        return self._addresses.get(pod, "")
