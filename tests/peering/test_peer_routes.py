"""The owners' directory as the sidecar wires it (``sidecar.wiring.peering``): owners and epochs read
from the lease documents and addresses from the member documents on demand, over ``MemoryDocuments``;
and the peer server's credentials as /metrics counts them."""

from __future__ import annotations

from dataclasses import dataclass

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
from sidecar.store.memory_documents import MemoryDocuments
from sidecar.wiring.peering import (
    RECHECK_SECONDS,
    LeaseRoutes,
    Peering,
    PeerRoutes,
    lease_owner,
    member_address,
)

pytestmark = pytest.mark.timeout(60)

SUB_PATH = "root/orders"


async def test_routes_are_read_on_demand_kept_and_read_again_once_forgotten() -> None:
    documents = MemoryDocuments()
    documents.docs[f"{SUB_PATH}/members/pod-b"] = {"pod": "pod-b", "address": "10.0.0.2:7100"}
    documents.docs[f"{SUB_PATH}/leases/0000"] = {"owner": "pod-b", "epoch": 7}
    documents.docs[f"{SUB_PATH}/leases/0001"] = {"owner": "pod-a", "epoch": 3}
    documents.docs[f"{SUB_PATH}/leases/0002"] = {"owner": "", "epoch": 4}
    sub_paths = {"orders": SUB_PATH}
    now = [0.0]
    routes = PeerRoutes(
        "pod-a", lease_owner(documents, sub_paths), member_address(documents, sub_paths), clock=lambda: now[0]
    )
    try:
        want = PeerRoute(pod="pod-b", epoch=7, address="10.0.0.2:7100")
        assert routes.route("orders", 0) is None, "not read yet: the inbox's way meanwhile"
        await wait_until(lambda: routes.route("orders", 0) == want, "the owner of shard 0, then its address")
        for shard in (1, 2, 3):  # this pod's own, a free one, one without a lease document
            routes.route("orders", shard)
        await wait_until(lambda: documents.reads >= 5, "shards 1-3 read")
        reads = documents.reads
        assert [routes.route("orders", shard) for shard in (1, 2, 3)] == [None, None, None]
        assert routes.route("orders", 0) == want
        assert documents.reads == reads, "kept: no read per message"
        now[0] += RECHECK_SECONDS
        routes.route("orders", 2)
        await wait_until(lambda: documents.reads == reads + 1, "a free shard read again after a while")
        # pod-b restarts elsewhere and takes shard 0 at a new epoch; the forwarder's refusal forgets it.
        documents.docs[f"{SUB_PATH}/members/pod-b"] = {"pod": "pod-b", "address": "10.0.0.9:7100"}
        documents.docs[f"{SUB_PATH}/leases/0000"] = {"owner": "pod-b", "epoch": 8}
        assert routes.route("orders", 0) == want, "stale until the forwarder says so"
        routes.forget("orders", 0)
        await wait_until(
            lambda: routes.route("orders", 0) == PeerRoute(pod="pod-b", epoch=8, address="10.0.0.9:7100"),
            "the new epoch and the new address",
        )
    finally:
        await routes.close()


@pytest.mark.parametrize("metadata", [(), (("x-sidecar-peer-secret-bin", b"forged"),)], ids=["none", "forged"])
async def test_a_call_without_the_secret_gets_unauthenticated_and_the_metric_counts_it(
    metadata: tuple[tuple[str, bytes], ...],
) -> None:
    documents = MemoryDocuments()
    routes = PeerRoutes("pod-a", lease_owner(documents, {}), member_address(documents, {}))
    credentials = PeerCredentials(b"secret")
    peering = Peering(PeerServer("127.0.0.1:0", credentials), PeerForwarder(routes, credentials), routes)
    address = await peering.start()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PeerCollector(peering.metrics))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = peer_pb2_grpc.PeerIntakeStub(channel).Forward(metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError):
                # The server may end the call before the write is taken: either step raises then
                # (a write racing the end raises grpc's INTERNAL); the call's status says why it ended.
                await call.write(peer_pb2.ForwardRequest(subscription="orders"))
                await call.read()
            assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        text = generate_latest(registry).decode()
        assert "pubsub_sidecar_peer_unauthenticated_total 1.0" in text
    finally:
        await peering.close()


@dataclass(frozen=True)
class _Known:
    pod: str
    epoch: int
    address: str


def test_lease_routes_answer_from_the_lease_managers_view_and_leave_out_this_pod_and_unknown_addresses() -> None:
    known = {0: _Known("pod-b", 7, "10.0.0.2:7100"), 1: _Known("pod-a", 3, "10.0.0.1:7100"), 2: _Known("pod-c", 4, "")}
    routes = LeaseRoutes("pod-a", {"orders": known.get})
    assert routes.route("orders", 0) == PeerRoute(pod="pod-b", epoch=7, address="10.0.0.2:7100")
    assert routes.route("orders", 1) is None, "this pod's own shard"
    assert routes.route("orders", 2) is None, "an owner without an address"
    assert routes.route("orders", 3) is None, "free, or not read yet"
    assert routes.route("other", 0) is None, "an unknown subscription"
