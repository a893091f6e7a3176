"""The peer channel joined to the sidecar (docs/forwarding.md): the owners' directory, the peer server
and the forwarder, made from the config's ``peering`` section.

- **Directory** (``PeerRoutes``, the ``sidecar.peering.routes.PeerDirectory`` the forwarder reads):
  who owns each shard and at which epoch comes from a Listen on each subscription's lease documents
  (``owner``, ``epoch``; a renewal changes neither, so it is read and ignored); where an owner
  answers comes from its member document (``{sub_path}/members/{pod}``, field ``address``: the pod
  names Kubernetes gives are plain document ids), read once per owner and epoch, on the first
  message for it (meanwhile, and when it has no address, messages take the inbox's way). A stale
  answer costs nothing but a refusal: the owner checks the epoch named.
- **Server** (``sidecar.peering.server``) on ``[::]:<peering.port>``, one ``LocalIntake`` per
  subscription: the shard's epoch as this pod delivers it now (the runtime's engines, and the lease's
  own check), ``Ingestor.take_forwarded``, and the bound ``flow_control.max_outstanding_messages``.
- **Forwarder** (``sidecar.peering.client``) given to every subscription's ingest before it starts.
- Without ``peering`` (or with ``port: 0``) none of this exists: the inbox path only, as before.
- A lease Listen that fails is started again after a capped, jittered backoff (``sidecar.backoff``);
  meanwhile the directory answers from what it knew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

from sidecar.backoff import backoff_seconds
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

_LISTEN_RETRY_INITIAL_SECONDS = 0.5
_LISTEN_RETRY_MAXIMUM_SECONDS = 30.0

AddressOf = Callable[[str, str], Awaitable[str]]
"""(subscription, pod) -> the pod's peer address, "" when it has none."""


class PeerRoutes:
    """Owners of shards (lease documents) and their addresses (member documents), as this pod knows them."""

    def __init__(self, pod: str, address_of: AddressOf) -> None:
        self._pod = pod
        self._address_of = address_of
        self._owners: dict[str, dict[int, tuple[str, int]]] = {}
        self._addresses: dict[tuple[str, str], str] = {}
        self._lookups: dict[tuple[str, str], asyncio.Task[None]] = {}

    def route(self, subscription: str, shard: int) -> PeerRoute | None:
        owner = self._owners.get(subscription, {}).get(shard)
        if owner is None or owner[0] == self._pod:
            return None
        pod, epoch = owner
        address = self._addresses.get((subscription, pod))
        if address is None:
            self._look_up(subscription, pod)
            return None
        return PeerRoute(pod=pod, epoch=epoch, address=address) if address else None

    def on_leases(self, subscription: str, change: docs.Change) -> None:
        """A snapshot of ``subscription``'s lease documents: owners and epochs; a new epoch of an
        owner makes its address read again (a restarted process may answer elsewhere)."""
        owners = self._owners.setdefault(subscription, {})
        if change.initial:
            owners.clear()
        for doc_id, fields, _ in change.upserts:
            if not doc_id.isdigit():
                continue
            shard = int(doc_id)
            owner, epoch = fields.get("owner"), fields.get("epoch")
            if not isinstance(owner, str) or not owner or not isinstance(epoch, int):
                owners.pop(shard, None)
                continue
            if owners.get(shard) != (owner, epoch):
                self._addresses.pop((subscription, owner), None)
            owners[shard] = (owner, epoch)
        for doc_id in change.removals:
            if doc_id.isdigit():
                owners.pop(int(doc_id), None)

    def _look_up(self, subscription: str, pod: str) -> None:
        key = (subscription, pod)
        if key in self._lookups:
            return

        async def look_up() -> None:
            try:
                self._addresses[key] = await self._address_of(subscription, pod)
            except StoreError as exc:
                _LOGGER.warning("peering: the address of %s (%s) cannot be read: %s", pod, subscription, exc)
            finally:
                self._lookups.pop(key, None)

        self._lookups[key] = asyncio.ensure_future(look_up())

    async def close(self) -> None:
        for task in list(self._lookups.values()):
            task.cancel()
        await asyncio.gather(*self._lookups.values(), return_exceptions=True)


def member_address(documents: docs.Documents, sub_paths: Mapping[str, str]) -> AddressOf:
    """Reads a pod's peer address from its member document (one billed read)."""

    async def address_of(subscription: str, pod: str) -> str:
        path = f"{sub_paths[subscription]}/members/{pod}"
        found = (await documents.get_all([path])).get(path)
        address = found.get("address") if found is not None and not found.get("left") else None
        return address if isinstance(address, str) else ""

    return address_of


class Peering:
    """The peer server, the forwarder and the directory's Listens of one sidecar."""

    def __init__(
        self,
        server: PeerServer,
        forwarder: PeerForwarder,
        routes: PeerRoutes,
        documents: docs.Documents,
        sub_paths: Mapping[str, str],
    ) -> None:
        self.server = server
        self.forwarder = forwarder
        self.routes = routes
        self._documents = documents
        self._sub_paths = dict(sub_paths)
        self._listens: dict[str, docs.Listening] = {}
        self._restarts: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> str:
        """Bind the peer server (``ListenError`` when the port is taken) and start the directory's Listens."""
        address = await self.server.start()
        for name in self._sub_paths:
            self._listen(name, attempt=0)
        return address

    def _listen(self, name: str, attempt: int) -> None:
        if self._closed:
            return

        def on_error(error: StoreError) -> None:
            _LOGGER.warning("peering: the Listen on %s's lease documents failed (%s); restarting it", name, error)
            listening = self._listens.pop(name, None)
            if listening is not None:
                self._spawn(listening.close())
            self._spawn(self._listen_later(name, attempt + 1))

        self._listens[name] = self._documents.listen(
            self._sub_paths[name], "leases", [], lambda change: self.routes.on_leases(name, change), on_error
        )

    async def _listen_later(self, name: str, attempt: int) -> None:
        await asyncio.sleep(backoff_seconds(attempt, _LISTEN_RETRY_INITIAL_SECONDS, _LISTEN_RETRY_MAXIMUM_SECONDS))
        self._listen(name, attempt)

    def _spawn(self, coroutine: Awaitable[object]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(_quietly(coroutine))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    def metrics(self) -> PeerMetrics:
        server, forwarder = self.server.stats, self.forwarder.stats
        return PeerMetrics(
            unauthenticated=server.unauthenticated,
            answered={"accepted": server.accepted, **server.refused},
            forwarded={"accepted": forwarder.accepted, **forwarder.refused},
        )

    async def close(self) -> None:
        """Stop the directory, the forwarder's streams and the server (open calls end: senders fall back)."""
        self._closed = True
        for task in list(self._restarts):
            task.cancel()
        for listening in self._listens.values():
            with contextlib.suppress(StoreError):
                await listening.close()
        self._listens.clear()
        await self.routes.close()
        await self.forwarder.close()
        await self.server.stop(1.0)


def make_peering(
    config: SidecarConfig, pod: str, documents: docs.Documents, subs: Mapping[str, SubscriptionParts]
) -> Peering | None:
    """The peer channel for ``subs`` (given its forwarder, nothing runs yet); None when it is off.
    Raises ``PeerSecretError`` when the secret file cannot be used."""
    peering = config.peering
    if peering is None or not peering.enabled:
        return None
    credentials = PeerCredentials(read_peer_secret(peering.secret_file) if peering.secret_file else None)
    server = PeerServer(f"[::]:{peering.port}", credentials)
    sub_paths = {name: f"{config.firestore.root}/{name}" for name in subs}
    routes = PeerRoutes(pod, member_address(documents, sub_paths))
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
    return Peering(server, forwarder, routes, documents, sub_paths)


def _held_epoch(runtime: SubscriptionRuntime) -> Callable[[int], int | None]:
    """The epoch under which ``runtime`` delivers ``shard`` now: its engine's, confirmed by the lease."""

    def held_epoch(shard: int) -> int | None:
        epoch = runtime.shards().get(shard)
        check = runtime.lease_check
        if epoch is None or (check is not None and check(shard) != epoch):
            return None
        return epoch

    return held_epoch


async def _quietly(coroutine: Awaitable[object]) -> None:
    with contextlib.suppress(StoreError):
        await coroutine
