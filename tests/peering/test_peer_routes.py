"""The owners' directory as the sidecar wires it (``sidecar.wiring.peering``): the lease managers' own
view of each shard's owner and address; and the peer server's credentials as /metrics counts them."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.cluster.leases.membership import Route
from sidecar.ops.observability import PeerCollector
from sidecar.peering.auth import PeerCredentials
from sidecar.peering.client import PeerForwarder
from sidecar.peering.proto import peer_pb2_grpc
from sidecar.peering.routes import PeerRoute
from sidecar.peering.server import PeerServer
from sidecar.wiring.peering import LeaseRoutes, Peering

pytestmark = pytest.mark.timeout(60)


def test_lease_routes_answer_from_the_lease_managers_view_and_leave_out_this_pod_and_unknown_addresses() -> None:
    known = {0: Route("pod-b", 7, "10.0.0.2:7100"), 1: Route("pod-a", 3, "10.0.0.1:7100"), 2: Route("pod-c", 4, "")}
    routes = LeaseRoutes("pod-a", {"orders": known.get})
    assert routes.route("orders", 0) == PeerRoute(pod="pod-b", epoch=7, address="10.0.0.2:7100")
    assert routes.route("orders", 1) is None, "this pod's own shard"
    assert routes.route("orders", 2) is None, "an owner without an address"
    assert routes.route("orders", 3) is None, "free, expired, or not read yet"
    assert routes.route("other", 0) is None, "an unknown subscription"


@pytest.mark.parametrize("metadata", [(), (("x-sidecar-peer-secret-bin", b"forged"),)], ids=["none", "forged"])
async def test_a_call_without_the_secret_gets_unauthenticated_and_the_metric_counts_it(
    metadata: tuple[tuple[str, bytes], ...],
) -> None:
    credentials = PeerCredentials(b"secret")
    peering = Peering(PeerServer("127.0.0.1:0", credentials), PeerForwarder(LeaseRoutes("pod-a", {}), credentials))
    address = await peering.start()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PeerCollector(peering.metrics))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = peer_pb2_grpc.PeerIntakeStub(channel).Forward(metadata=metadata)
            # The server ends the call on its metadata, before reading a request. Nothing is written:
            # a write that loses the race with that end makes grpc's client set the call's status to
            # INTERNAL itself (``set_internal_error``), hiding the server's.
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        text = generate_latest(registry).decode()
        assert "pubsub_sidecar_peer_unauthenticated_total 1.0" in text
    finally:
        await peering.close()
