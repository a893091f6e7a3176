"""Member documents: one per pod of a subscription, naming the process that runs under the pod's name.

``{sub_path}/members/{pod}`` (``member_path``; the pod name is the document id when it is a plain
name, else a digest of it), written by that pod's lease manager:

- ``v`` (int): ``MEMBER_LAYOUT_VERSION``. A higher one was written by a newer sidecar: this pod
  refuses to run the subscription under that name (``MembershipRefused``) and never overwrites it.
- ``pod`` (str): the pod name (``POD_NAME``), the owner the lease documents name.
- ``incarnation`` (int): the process running under the name. A new process takes
  ``MemberView.next_incarnation``, above the one read and never below the read's time, so an
  incarnation never repeats (the epoch rule of ``sidecar.cluster.leases.layout``).
- ``address`` (str): where the process answers other pods (the peer channel), ``""`` when unknown.
- ``lease_ms`` (int): its lease duration; ``beat`` (int): +1 on every round, so every round moves
  the document's update time, which is what freshness is measured from.
- ``left`` (bool): the process gave its shards up on SIGTERM and stopped.
- ``lapsed`` (bool): another pod found the document expired and took the process's leases, in one
  atomic Commit that also set this (a compare-and-set on the version it read). The process's beat,
  a compare-and-set too, can then never apply: it stops holding everything and joins again.

A pod's shard is held while its lease document names the pod and the pod's member document is
``alive`` (``MemberView.alive``): renewing the member document (the beat) renews every lease of
the pod at once, and lease documents are written only when ownership changes (docs/leases.md).

**Static membership.** A process starting under a pod name (``decide_join``) takes the name over at
once (a compare-and-set on the version read, with a new incarnation) when the document is missing,
left, or expired on the database's clock (``read_time - update_time > lease_ms``). When it is
fresh, the earlier process may still live: if it recorded an address, this process dials it
(``answers``): a refused or timed-out connection means the earlier process is gone (a container
killed with -9 closed its port), and the name is taken over at once; an answer means it lives, and
this process is refused (``MembershipRefused``): two processes must never run under one name. When
the address recorded is this process's own (a container restarted in the same pod), it is taken
over at once without dialling: the sidecar binds its peer port before its leases start
(``sidecar.wiring.app``), so while this process holds that address no other process listens
there; a living earlier process would have made that bind fail. With no address recorded there is
no way to tell but time: the process waits until the document expires.
A process that finds its document naming another incarnation while it runs (``Superseded``) stops:
a newer process of its name took over, and every lease it held is being taken at a new epoch.

Failure cases of the probe: an earlier process that is paused still has its listening socket, so
the kernel accepts the connection and the newcomer is refused (safe: it is restarted later); an
address that another process now answers on (the pod's IP given to another pod after this one
died) also refuses, until the document expires (at most one lease). A probe that wrongly finds a
live process gone (its network cut) lets the newcomer take over: the earlier process then sees
``Superseded`` at its next round and stops, and meanwhile every write it makes is fenced by the
lease documents, which the newcomer's takes moved to new epochs.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from sidecar.store import documents as docs
from sidecar.store.api import StoreRejected

MEMBER_LAYOUT_VERSION = 1

PROBE_TIMEOUT_SECONDS = 0.5
"""How long ``answers`` waits for a connection: a live process on the pod network answers in far
less; a killed one refuses at once (its port is closed), an address nobody holds times out."""

_PLAIN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class MembershipRefused(StoreRejected):
    """Another process runs under this pod name (or its member document cannot be read as one)."""


class Superseded(StoreRejected):
    """This process's member document names a newer process of the same pod name: it must stop."""


@dataclass(frozen=True, slots=True)
class MemberView:
    """One pod's member document as one read saw it (a missing document: ``exists=False``)."""

    pod: str
    exists: bool
    incarnation: int = 0
    address: str = ""
    lease_ms: int = 0
    beat: int = 0
    left: bool = False
    lapsed: bool = False
    expired: bool = False
    """On the database's clock: the read's time minus the document's update time exceeds ``lease_ms``."""
    update_time_us: int | None = None
    read_us: int = 0
    problem: str = ""
    """Why this pod must not read the document as a member document; ``""`` when it may."""

    @property
    def alive(self) -> bool:
        """Readable, not expired, not left, not lapsed: the leases naming this pod are held."""
        return self.exists and not self.problem and not (self.expired or self.left or self.lapsed)

    @property
    def next_incarnation(self) -> int:
        """A new process's incarnation: above the one read and never below the read's time."""
        return max(self.incarnation + 1, self.read_us)


def member_doc_id(pod: str) -> str:
    """The pod name when it is a plain name (every Kubernetes pod name is), else a digest of it."""
    if _PLAIN_ID.fullmatch(pod) and not (pod.startswith("__") and pod.endswith("__")):
        return pod
    return "sha256-" + hashlib.sha256(pod.encode("utf-8", "surrogatepass")).hexdigest()


def member_path(sub_path: str, pod: str) -> str:
    return f"{sub_path}/members/{member_doc_id(pod)}"


def member_fields(
    pod: str, incarnation: int, address: str, lease_ms: int, beat: int, *, left: bool = False, lapsed: bool = False
) -> dict[str, Any]:
    return {
        "v": MEMBER_LAYOUT_VERSION,
        "pod": pod,
        "incarnation": incarnation,
        "address": address,
        "lease_ms": lease_ms,
        "beat": beat,
        "left": left,
        "lapsed": lapsed,
    }


def read_member(path: str, pod: str, read_us: int, version: docs.Versioned) -> MemberView:
    """The view of one member document; a bad one is a view with ``problem`` naming the document."""
    fields = version.fields
    if fields is None:
        return MemberView(pod, exists=False, read_us=read_us)
    problem = _problem(path, pod, fields, version.update_time_us)
    if problem is not None:
        return MemberView(pod, exists=True, read_us=read_us, problem=problem)
    assert version.update_time_us is not None  # checked by _problem
    return MemberView(
        pod,
        exists=True,
        incarnation=fields["incarnation"],
        address=fields["address"],
        lease_ms=fields["lease_ms"],
        beat=fields["beat"],
        left=fields["left"],
        lapsed=fields["lapsed"],
        expired=read_us - version.update_time_us > fields["lease_ms"] * 1000,
        update_time_us=version.update_time_us,
        read_us=read_us,
    )


class Join(enum.Enum):
    TAKE_OVER = "take_over"
    """Write the document with a new incarnation now (missing, left, expired, or its process gone)."""
    PROBE = "probe"
    """Fresh, with an address: take over only if nothing answers there."""
    WAIT = "wait"
    """Fresh, no address: wait until it expires."""
    REFUSE = "refuse"
    """Not readable as a member document (``problem``): leave it alone."""


def decide_join(view: MemberView, own_address: str) -> Join:
    """What a process starting under ``view.pod`` with ``own_address`` does with its member
    document (module docstring)."""
    if view.problem:
        return Join.REFUSE
    if not view.alive or (view.address and view.address == own_address):
        return Join.TAKE_OVER
    return Join.PROBE if view.address else Join.WAIT


async def answers(address: str, timeout_seconds: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """Whether a process accepts a TCP connection at ``address`` (``host:port``) within the timeout."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    host = host.strip("[]")  # an IPv6 literal
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_seconds)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _problem(path: str, pod: str, fields: docs.Fields, update_time_us: int | None) -> str | None:
    written = fields.get("v")
    if not _is_int(written):
        return f"member document {path}: field 'v' is {written!r:.60}, not an integer (corrupt)"
    if written > MEMBER_LAYOUT_VERSION:
        return (
            f"member document {path}: layout version {written} was written by a newer sidecar "
            f"(this one reads version {MEMBER_LAYOUT_VERSION}); upgrade this pod"
        )
    for name in ("incarnation", "lease_ms", "beat"):
        value = fields.get(name)
        if not _is_int(value) or not 0 <= value < 2**63 - 1:
            return f"member document {path}: field {name!r} is {value!r:.60}, not a non-negative integer (corrupt)"
    for name in ("pod", "address"):
        if not isinstance(fields.get(name), str):
            return f"member document {path}: field {name!r} is {fields.get(name)!r:.60}, not a string (corrupt)"
    for name in ("left", "lapsed"):
        if not isinstance(fields.get(name), bool):
            return f"member document {path}: field {name!r} is {fields.get(name)!r:.60}, not a boolean (corrupt)"
    if fields["pod"] != pod:
        return f"member document {path}: names pod {fields['pod']!r:.60}, not {pod!r:.60} (corrupt)"
    if update_time_us is None:
        return f"member document {path}: the read returned it without an update time"
    return None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
