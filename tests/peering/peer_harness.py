"""Two pods of one subscription in one process, joined by the real peer channel.

Each pod is wired as the sidecar wires it: an ``Ingestor`` on the Pub/Sub emulator (official client),
a ``SubscriptionRuntime`` with shards, a ``DocumentStore`` fenced by its pod's leases, and the
shard's inbox Listen (``ShardOwnership``). Both stores share one ``MemoryDocuments`` (Firestore's
semantics in memory, with its billed-operation counters and write hooks), as two pods share one
database. The test plays the lease manager: it writes the lease documents and tells each pod what it
holds. The *sender* pulls the test's subscription and owns no shard; the *owner* holds every shard,
runs the ``PeerServer`` and pulls a subscription of its own that receives nothing, so that every
message the owner delivers came through the sender: forwarded, or through the inbox.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pubsub_admin import PubSubAdmin

from sidecar.config.model import SubscriptionConfig
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.peering.auth import PeerCredentials
from sidecar.peering.client import PeerForwarder
from sidecar.peering.routes import PeerRoute
from sidecar.peering.server import MAX_MESSAGE_BYTES, LocalIntake, PeerServer
from sidecar.pipeline.ingest import Ingestor
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.shards import shard_of
from sidecar.store import documents as docs
from sidecar.store.api import ShardLost, SubscriptionStoreConfig
from sidecar.store.document_store import DocumentStore
from sidecar.store.memory_documents import MemoryDocuments
from sidecar.wiring.ownership import ShardOwnership

SHARDS = 4
ROOT = "t"
SUB = "orders"
SECRET = b"s3cret-peer-token"


def sub_config(subscription: str, *, max_outstanding_messages: int = 100) -> SubscriptionConfig:
    return SubscriptionConfig.model_validate(
        {
            "name": SUB,
            "subscription": subscription,
            "ordering": {
                "mode": "sequence",
                "key": {"attribute": "order_id"},
                "sequence": {"attribute": "seq", "start": 1},
                "fast_path": True,
            },
            "flow_control": {
                "max_outstanding_messages": max_outstanding_messages,
                "max_outstanding_bytes": 10 * 1024 * 1024,
            },
            "sharding": {"shards": SHARDS},
        }
    )


class StaticDirectory:
    """The owner of every shard, as the sender believes it (a test may make it stale)."""

    def __init__(self) -> None:
        self.routes: dict[int, PeerRoute] = {}
        self.forgotten: list[int] = []
        """Shards the forwarder said were routed wrong (this directory keeps answering the same)."""

    def route(self, subscription: str, shard: int) -> PeerRoute | None:
        return self.routes.get(shard) if subscription == SUB else None

    def forget(self, subscription: str, shard: int) -> None:
        self.forgotten.append(shard)


@dataclass
class Pod:
    name: str
    documents: MemoryDocuments
    epochs: dict[int, int] = field(default_factory=dict)
    store: DocumentStore | None = None
    runtime: SubscriptionRuntime | None = None
    ingestor: Ingestor | None = None
    ownership: ShardOwnership | None = None
    run_task: asyncio.Task[None] | None = None

    def lease_path(self, shard: int) -> str:
        return f"{ROOT}/{SUB}/leases/{shard:04d}"

    def fence(self, subscription: str, shard: int) -> docs.Fence:
        epoch = self.epochs.get(shard)
        if epoch is None:
            raise ShardLost(subscription, frozenset({shard}))
        return docs.Fence(self.lease_path(shard), {"owner": self.name, "epoch": epoch})


class TwoPods:
    """The sender and the owner (see the module docstring); ``close()`` stops everything."""

    def __init__(
        self,
        admin: PubSubAdmin,
        *,
        sender_secret: bytes | None = SECRET,
        forwarder_kwargs: dict[str, Any] | None = None,
        **server_kwargs: Any,
    ) -> None:
        self.admin = admin
        self.documents = MemoryDocuments()
        self.sender = Pod("sender", self.documents)
        self.owner = Pod("owner", self.documents)
        self.directory = StaticDirectory()
        self.server = PeerServer("127.0.0.1:0", PeerCredentials(SECRET), **server_kwargs)
        self.forwarder = PeerForwarder(
            self.directory, PeerCredentials(sender_secret), retry_initial_seconds=0.05, **(forwarder_kwargs or {})
        )
        self.dead_letters = DeadLetterPublisher({SUB: None})
        self.topic = ""
        self.subscription = ""
        self.max_in_flight = 1_000

    async def start(self) -> TwoPods:
        self.topic = await self.admin.create_topic("orders")
        self.subscription = await self.admin.create_subscription("orders", self.topic)
        idle_topic = await self.admin.create_topic("idle")
        idle_subscription = await self.admin.create_subscription("idle", idle_topic)
        await self._make(self.owner, sub_config(idle_subscription), forwarder=None)
        assert self.owner.runtime is not None and self.owner.ingestor is not None and self.owner.ownership
        for shard in range(SHARDS):
            self.hold(shard, epoch=3)
            await self.owner.ownership.on_gained(shard, 3)
        runtime, ingestor = self.owner.runtime, self.owner.ingestor
        self.server.register(
            SUB,
            LocalIntake(
                held_epoch=lambda shard: runtime.shards().get(shard),
                take=ingestor.take_forwarded,
                max_in_flight=self.max_in_flight,
            ),
        )
        address = await self.server.start()
        for shard in range(SHARDS):
            self.directory.routes[shard] = PeerRoute(pod="owner", epoch=3, address=address)
        await self._make(self.sender, sub_config(self.subscription), forwarder=self.forwarder)
        return self

    def hold(self, shard: int, epoch: int) -> None:
        """The owner holds ``shard`` at ``epoch`` (its lease document says so)."""
        self.owner.epochs[shard] = epoch
        self.documents.docs[self.owner.lease_path(shard)] = {"owner": "owner", "epoch": epoch}

    async def _make(self, pod: Pod, config: SubscriptionConfig, *, forwarder: PeerForwarder | None) -> None:
        pod.store = DocumentStore(
            self.documents,
            {SUB: SubscriptionStoreConfig(mode="sequence", shards=SHARDS)},
            root=ROOT,
            fences=pod.fence,
            cursor_write_interval_ms=100,
        )
        pod.runtime = SubscriptionRuntime(SUB, config.engine_config(), pod.store, self.dead_letters, shard_count=SHARDS)
        pod.runtime.pod = pod.name
        pod.runtime.lease_check = pod.epochs.get
        await pod.runtime.recover()
        await pod.runtime.loaded()
        await pod.runtime.start()
        pod.ownership = ShardOwnership(pod.runtime, pod.store, drain_timeout_seconds=1.0)
        pod.ingestor = Ingestor(
            config,
            pod.store,
            pod.runtime,
            self.dead_letters,
            forwarder=forwarder,
            backoff_initial_seconds=0.05,
            backoff_maximum_seconds=0.3,
        )
        await pod.ingestor.start()
        pod.run_task = asyncio.create_task(pod.ingestor.run())

    async def close(self) -> None:
        for pod in (self.sender, self.owner):
            if pod.ingestor is not None:
                try:
                    await pod.ingestor.stop(grace_seconds=1.0)
                except Exception:
                    pass  # reported by the test that made it fail; cleanup goes on
            if pod.run_task is not None:
                pod.run_task.cancel()
                try:
                    await pod.run_task
                except BaseException:
                    pass
        await self.forwarder.close()
        await self.server.stop(0)
        for pod in (self.sender, self.owner):
            if pod.ownership is not None:
                await pod.ownership.close()
            if pod.runtime is not None:
                await pod.runtime.stop(grace_seconds=0.5)
            if pod.store is not None:
                await pod.store.close()
        await self.dead_letters.aclose()

    # ---- helpers -------------------------------------------------------------------------------

    async def publish(self, key: str, seq: int, data: bytes | None = None) -> str:
        payload = data if data is not None else f"{key}:{seq}".encode()
        return await self.admin.publish(self.topic, payload, order_id=key, seq=str(seq))

    def take(self, n: int) -> list[Any]:
        assert self.owner.runtime is not None
        return list(self.owner.runtime.take("app", n))

    def billed(self) -> int:
        return self.documents.reads + self.documents.writes + self.documents.deletes


def shard_of_key(key: str) -> int:
    return shard_of(key, SHARDS)


__all__ = ["MAX_MESSAGE_BYTES", "SECRET", "SHARDS", "SUB", "Pod", "StaticDirectory", "TwoPods", "shard_of_key"]
