"""Who owns a shard, at which epoch, reached at which address: what the forwarder reads.

``PeerDirectory.route`` answers from what this pod knows now (``sidecar.wiring.peering``: the lease
managers' view of the lease and member documents); None when forwarding cannot help: the owner is
unknown, is this pod, or has no known address. The answer may be stale: the owner checks the epoch
named and refuses (``STALE_EPOCH``, ``NOT_OWNER``), the message then goes the inbox's way, and the
forwarder calls ``forget`` (a directory that caches may read the route again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PeerRoute:
    """The owner of a shard as this pod knows it."""

    pod: str
    epoch: int
    address: str
    """host:port of the owner's peer server."""


class PeerDirectory(Protocol):
    def route(self, subscription: str, shard: int) -> PeerRoute | None:
        """The owner of ``shard`` of ``subscription`` if another pod, with its address; else None."""

    def forget(self, subscription: str, shard: int) -> None:
        """The route given for ``shard`` was refused or its channel broke: read it again next time."""
