"""The peer channel joined to the sidecar (docs/forwarding.md): the owners' directory, the peer server
and the forwarder, made from the config's ``peering`` section.

- **Directory** (``LeaseRoutes``, the ``sidecar.peering.routes.PeerDirectory`` the forwarder reads):
  each subscription's lease manager's own view (``ShardLeases.route``): the owner and epoch of every
  shard from the lease documents its rounds read anyway, and each owner's address from its member
  document (``peering.advertise_address``, else ``$POD_IP:<port>``). It costs no read of its own. A
  shard that is free, expired, this pod's, or whose owner has no address yet has no route: its
  messages take the inbox's way. A route gone stale costs a refusal (the owner checks the epoch
  named) until the next round corrects it; ``forget`` has nothing to do.
- **Server** (``sidecar.peering.server``) on ``[::]:<peering.port>``, one ``LocalIntake`` per
  subscription: the shard's epoch as this pod delivers it now (the runtime's engines, and the lease's
  own check), ``Ingestor.take_forwarded``, and the bound ``flow_control.max_outstanding_messages``.
- **Forwarder** (``sidecar.peering.client``) given to every subscription's ingest before it starts.
- Without ``peering`` (or with ``port: 0``) none of this exists: the inbox path only, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from sidecar.cluster.leases.membership import Route
from sidecar.config.model import SidecarConfig
from sidecar.config.peering import read_peer_secret
from sidecar.ops.observability import PeerMetrics
from sidecar.peering.auth import PeerCredentials
from sidecar.peering.client import PeerForwarder
from sidecar.peering.routes import PeerRoute
from sidecar.peering.server import LocalIntake, PeerServer
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.wiring.subscription import SubscriptionParts


class LeaseRoutes:
    """The directory from each subscription's lease manager (``ShardLeases.route``)."""

    def __init__(self, pod: str, routes: Mapping[str, Callable[[int], Route | None]]) -> None:
        self._pod = pod
        self._routes = dict(routes)

    def route(self, subscription: str, shard: int) -> PeerRoute | None:
        routes = self._routes.get(subscription)
        known = routes(shard) if routes is not None else None
        if known is None or known.pod == self._pod or not known.address:
            return None
        return PeerRoute(pod=known.pod, epoch=known.epoch, address=known.address)

    def forget(self, subscription: str, shard: int) -> None:
        """Nothing to do: the lease manager's next round reads the shard's owner again."""


class Peering:
    """The peer server, the forwarder and the directory of one sidecar."""

    def __init__(self, server: PeerServer, forwarder: PeerForwarder) -> None:
        self.server = server
        self.forwarder = forwarder

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
        """Stop the forwarder's streams and the server (open calls end: their senders fall back)."""
        await self.forwarder.close()
        await self.server.stop(1.0)


def make_peering(config: SidecarConfig, pod: str, subs: Mapping[str, SubscriptionParts]) -> Peering | None:
    """The peer channel for ``subs`` (given its forwarder, nothing runs yet); None when it is off.
    Raises ``PeerSecretError`` when the secret file cannot be used."""
    peering = config.peering
    if peering is None or not peering.enabled:
        return None
    credentials = PeerCredentials(read_peer_secret(peering.secret_file) if peering.secret_file else None)
    server = PeerServer(f"[::]:{peering.port}", credentials)
    routes = LeaseRoutes(pod, {name: s.leases.route for name, s in subs.items() if s.leases is not None})
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
    return Peering(server, forwarder)


def _held_epoch(runtime: SubscriptionRuntime) -> Callable[[int], int | None]:
    """The epoch under which ``runtime`` delivers ``shard`` now: its engine's, confirmed by the lease."""

    def held_epoch(shard: int) -> int | None:
        epoch = runtime.shards().get(shard)
        check = runtime.lease_check
        if epoch is None or (check is not None and check(shard) != epoch):
            return None
        return epoch

    return held_epoch
