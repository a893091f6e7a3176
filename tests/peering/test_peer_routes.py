"""The owners' directory as the sidecar wires it (``sidecar.wiring.peering``): owners and epochs from a
Listen on the lease documents, addresses from the member documents, over ``MemoryDocuments``."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pubsub_admin import wait_until

from sidecar.ops.observability import PeerCollector
from sidecar.peering.auth import PeerCredentials
from sidecar.peering.client import PeerForwarder
from sidecar.peering.proto import peer_pb2, peer_pb2_grpc
from sidecar.peering.routes import PeerRoute
from sidecar.peering.server import PeerServer
from sidecar.store import documents as docs
from sidecar.store.memory_documents import MemoryDocuments
from sidecar.wiring.peering import Peering, PeerRoutes, member_address

pytestmark = pytest.mark.timeout(60)

SUB_PATH = "root/orders"


async def test_routes_follow_the_lease_documents_and_read_each_owners_address_once_per_epoch() -> None:
    documents = MemoryDocuments()
    documents.docs[f"{SUB_PATH}/members/pod-b"] = {"pod": "pod-b", "address": "10.0.0.2:7100"}
    documents.docs[f"{SUB_PATH}/leases/0000"] = {"owner": "pod-b", "epoch": 7}
    documents.docs[f"{SUB_PATH}/leases/0001"] = {"owner": "pod-a", "epoch": 3}
    documents.docs[f"{SUB_PATH}/leases/0002"] = {"owner": "", "epoch": 4}
    routes = PeerRoutes("pod-a", member_address(documents, {"orders": SUB_PATH}))
    credentials = PeerCredentials(b"secret")
    peering = Peering(
        PeerServer("127.0.0.1:0", credentials),
        PeerForwarder(routes, credentials),
        routes,
        documents,
        {"orders": SUB_PATH},
    )
    await peering.start()
    try:
        await wait_until(lambda: routes.route("orders", 0) is not None, "the owner of shard 0 and its address")
        assert routes.route("orders", 0) == PeerRoute(pod="pod-b", epoch=7, address="10.0.0.2:7100")
        assert routes.route("orders", 1) is None, "this pod's own shard: never forwarded"
        assert routes.route("orders", 2) is None, "a free shard"
        assert routes.route("orders", 3) is None, "no lease document"
        reads = documents.reads
        assert routes.route("orders", 0) is not None and documents.reads == reads, "the address is cached"
        # pod-b restarts elsewhere and takes shard 0 at a new epoch: its address is read again.
        documents.docs[f"{SUB_PATH}/members/pod-b"] = {"pod": "pod-b", "address": "10.0.0.9:7100"}
        await documents.commit([docs.replace(f"{SUB_PATH}/leases/0000", {"owner": "pod-b", "epoch": 8})])
        await wait_until(
            lambda: routes.route("orders", 0) == PeerRoute(pod="pod-b", epoch=8, address="10.0.0.9:7100"),
            "the new epoch and the new address",
        )
    finally:
        await peering.close()


@pytest.mark.parametrize("metadata", [(), (("x-sidecar-peer-secret-bin", b"forged"),)], ids=["none", "forged"])
async def test_a_call_without_the_secret_gets_unauthenticated_and_the_metric_counts_it(
    metadata: tuple[tuple[str, bytes], ...],
) -> None:
    documents = MemoryDocuments()
    routes = PeerRoutes("pod-a", member_address(documents, {"orders": SUB_PATH}))
    credentials = PeerCredentials(b"secret")
    peering = Peering(PeerServer("127.0.0.1:0", credentials), PeerForwarder(routes, credentials), routes, documents, {})
    address = await peering.start()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PeerCollector(peering.metrics))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = peer_pb2_grpc.PeerIntakeStub(channel).Forward(metadata=metadata)
            await call.write(peer_pb2.ForwardRequest(subscription="orders"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        text = generate_latest(registry).decode()
        assert "pubsub_sidecar_peer_unauthenticated_total 1.0" in text
    finally:
        await peering.close()
