"""The peer channel joined to the sidecar (docs/forwarding.md): the owners' directory, the peer server
and the forwarder, made from the config's ``peering`` section.

- **Directory** (the ``sidecar.peering.routes.PeerDirectory`` the forwarder reads). ``LeaseRoutes``
  when the lease managers know each shard's owner and its address (``make_peering(lease_routes=)``:
  their rounds read the lease documents anyway, so it costs nothing). Otherwise ``PeerRoutes``,
  read on demand, never listened to (a Listen on the lease documents would be billed a read for
  every renewal): the first message of a shard reads its lease document (``owner``, ``epoch``: one
  billed read), the first of an owner reads its member document (``{sub_path}/members/{pod}``,
  field ``address``: the pod names Kubernetes gives are plain document ids). Meanwhile, and when the
  owner is this pod, nobody, or has no address, messages take the inbox's way. A route is kept until
  the forwarder says it was wrong (``forget``: a ``NOT_OWNER`` or ``STALE_EPOCH`` answer, or a
  stream that broke); a shard read free or owned by this pod is read again after
  ``RECHECK_SECONDS``. So the directory costs reads only when ownership changes, and a stale route
  costs one refusal: the owner checks the epoch named.
- **Server** (``sidecar.peering.server``) on ``[::]:<peering.port>``, one ``LocalIntake`` per
  subscription: the shard's epoch as this pod delivers it now (the runtime's engines, and the lease's
  own check), ``Ingestor.take_forwarded``, and the bound ``flow_control.max_outstanding_messages``.
- **Forwarder** (``sidecar.peering.client``) given to every subscription's ingest before it starts.
- Without ``peering`` (or with ``port: 0``) none of this exists: the inbox path only, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from sidecar.cluster.leases.layout import lease_path
from sidecar.config.model import SidecarConfig
from sidecar.config.peering import read_peer_secret
from sidecar.ops.observability import PeerMetrics
from sidecar.peering.auth import PeerCredentials
from sidecar.peering.client import PeerForwarder
from sidecar.peering.routes import PeerRoute
from sidecar.peering.server import LocalIntake, PeerServer
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.store import documents as docs
from sidecar.store.api import StoreError
from sidecar.wiring.subscription import SubscriptionParts

_LOGGER = logging.getLogger(__name__)

RECHECK_SECONDS = 1.0
"""How long a shard read free, or owned by this pod, is taken as such before it is read again."""

OwnerOf = Callable[[str, int], Awaitable[tuple[str, int] | None]]
"""(subscription, shard) -> (owner pod, epoch) from its lease document; None when free or missing."""
AddressOf = Callable[[str, str], Awaitable[str]]
"""(subscription, pod) -> the pod's peer address, "" when it has none."""


class RouteLike(Protocol):
    """What a lease manager knows of a shard's owner (``ShardLeases.route``, with member documents)."""

    @property
    def pod(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def address(self) -> str: ...


class LeaseRoutes:
    """The directory from each subscription's lease manager, which reads every lease document each
    round anyway (and each owner's member document when it takes a lease): no read of its own.
    ``forget`` has nothing to do: the next round corrects what was wrong."""

    def __init__(self, pod: str, routes: Mapping[str, Callable[[int], RouteLike | None]]) -> None:
        self._pod = pod
        self._routes = dict(routes)

    def route(self, subscription: str, shard: int) -> PeerRoute | None:
        routes = self._routes.get(subscription)
        known = routes(shard) if routes is not None else None
        if known is None or known.pod == self._pod or not known.address:
            return None
        return PeerRoute(pod=known.pod, epoch=known.epoch, address=known.address)

    def forget(self, subscription: str, shard: int) -> None:
        return None

    async def close(self) -> None:
        return None


class PeerRoutes:
    """Owners of shards and their addresses, read on demand and kept until the forwarder says otherwise."""

    def __init__(
        self, pod: str, owner_of: OwnerOf, address_of: AddressOf, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._pod = pod
        self._owner_of = owner_of
        self._address_of = address_of
        self._clock = clock
        self._owners: dict[tuple[str, int], tuple[str, int] | float] = {}
        """(subscription, shard) -> (pod, epoch); or, read free or this pod's, when to read it again."""
        self._addresses: dict[tuple[str, str], str] = {}
        self._reads: dict[tuple[str, str, object], asyncio.Task[None]] = {}

    def route(self, subscription: str, shard: int) -> PeerRoute | None:
        owner = self._owners.get((subscription, shard))
        if owner is None or (isinstance(owner, float) and self._clock() >= owner):
            self._read(("owner", subscription, shard), lambda: self._read_owner(subscription, shard))
            return None
        if isinstance(owner, float):
            return None  # free, or this pod's, until it is read again
        pod, epoch = owner
        address = self._addresses.get((subscription, pod))
        if address is None:
            self._read(("address", subscription, pod), lambda: self._read_address(subscription, pod))
            return None
        return PeerRoute(pod=pod, epoch=epoch, address=address) if address else None

    def forget(self, subscription: str, shard: int) -> None:
        owner = self._owners.pop((subscription, shard), None)
        if isinstance(owner, tuple):
            self._addresses.pop((subscription, owner[0]), None)  # a restarted owner may answer elsewhere

    async def _read_owner(self, subscription: str, shard: int) -> None:
        owner = await self._owner_of(subscription, shard)
        if owner is None or owner[0] == self._pod:
            self._owners[(subscription, shard)] = self._clock() + RECHECK_SECONDS
        else:
            self._owners[(subscription, shard)] = owner

    async def _read_address(self, subscription: str, pod: str) -> None:
        self._addresses[(subscription, pod)] = await self._address_of(subscription, pod)

    def _read(self, key: tuple[str, str, object], read: Callable[[], Awaitable[None]]) -> None:
        """Start ``read`` unless a read of ``key`` is under way."""
        if key in self._reads:
            return

        async def run() -> None:
            try:
                await read()
            except StoreError as exc:
                _LOGGER.warning("peering: reading %s of %s failed: %s", key[0], key[1], exc)
            finally:
                self._reads.pop(key, None)

        self._reads[key] = asyncio.ensure_future(run())

    async def close(self) -> None:
        for task in list(self._reads.values()):
            task.cancel()
        await asyncio.gather(*self._reads.values(), return_exceptions=True)


def lease_owner(documents: docs.Documents, sub_paths: Mapping[str, str]) -> OwnerOf:
    """Reads a shard's owner and epoch from its lease document (one billed read)."""

    async def owner_of(subscription: str, shard: int) -> tuple[str, int] | None:
        path = lease_path(sub_paths[subscription], shard)
        found = (await documents.get_all([path])).get(path)
        if found is None:
            return None
        owner, epoch = found.get("owner"), found.get("epoch")
        return (owner, epoch) if isinstance(owner, str) and owner and isinstance(epoch, int) else None

    return owner_of


def member_address(documents: docs.Documents, sub_paths: Mapping[str, str]) -> AddressOf:
    """Reads a pod's peer address from its member document (one billed read)."""

    async def address_of(subscription: str, pod: str) -> str:
        path = f"{sub_paths[subscription]}/members/{pod}"
        found = (await documents.get_all([path])).get(path)
        address = found.get("address") if found is not None and not found.get("left") else None
        return address if isinstance(address, str) else ""

    return address_of


class Peering:
    """The peer server, the forwarder and the directory of one sidecar."""

    def __init__(self, server: PeerServer, forwarder: PeerForwarder, routes: PeerRoutes | LeaseRoutes) -> None:
        self.server = server
        self.forwarder = forwarder
        self.routes = routes

    async def start(self) -> str:
        """Bind the peer server; ``ListenError`` when the port is taken."""
        return await self.server.start()

    def metrics(self) -> PeerMetrics:
        server, forwarder = self.server.stats, self.forwarder.stats
        return PeerMetrics(
            unauthenticated=server.unauthenticated,
            answered={"accepted": server.accepted, **server.refused},
            forwarded={"accepted": forwarder.accepted, **forwarder.refused},
        )

    async def close(self) -> None:
        """Stop the directory's reads, the forwarder's streams and the server (senders fall back)."""
        await self.routes.close()
        await self.forwarder.close()
        await self.server.stop(1.0)


def make_peering(
    config: SidecarConfig,
    pod: str,
    documents: docs.Documents,
    subs: Mapping[str, SubscriptionParts],
    lease_routes: Mapping[str, Callable[[int], RouteLike | None]] | None = None,
) -> Peering | None:
    """The peer channel for ``subs`` (given its forwarder, nothing runs yet); None when it is off.
    ``lease_routes``: each subscription's lease manager's view of its owners (``LeaseRoutes``); without
    it the directory reads them itself (``PeerRoutes``). Raises ``PeerSecretError`` when the secret
    file cannot be used."""
    peering = config.peering
    if peering is None or not peering.enabled:
        return None
    credentials = PeerCredentials(read_peer_secret(peering.secret_file) if peering.secret_file else None)
    server = PeerServer(f"[::]:{peering.port}", credentials)
    sub_paths = {name: f"{config.firestore.root}/{name}" for name in subs}
    routes: PeerRoutes | LeaseRoutes = (
        LeaseRoutes(pod, lease_routes)
        if lease_routes is not None
        else PeerRoutes(pod, lease_owner(documents, sub_paths), member_address(documents, sub_paths))
    )
    forwarder = PeerForwarder(routes, credentials)
    for name, s in subs.items():
        server.register(
            name,
            LocalIntake(
                held_epoch=_held_epoch(s.runtime),
                take=s.ingestor.take_forwarded,
                max_in_flight=s.config.flow_control.max_outstanding_messages,
            ),
        )
        s.ingestor.set_forwarder(forwarder)
    return Peering(server, forwarder, routes)


def _held_epoch(runtime: SubscriptionRuntime) -> Callable[[int], int | None]:
    """The epoch under which ``runtime`` delivers ``shard`` now: its engine's, confirmed by the lease."""

    def held_epoch(shard: int) -> int | None:
        epoch = runtime.shards().get(shard)
        check = runtime.lease_check
        if epoch is None or (check is not None and check(shard) != epoch):
            return None
        return epoch

    return held_epoch
