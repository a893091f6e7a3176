"""The server around the servicer: Unix socket, health, reflection, GetStatus."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Callable

import grpc
from delivery_harness import WAIT_SECONDS, Harness, sequence_config, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pubsub_sidecar.v1 import sidecar_pb2
from sidecar.delivery.server import SERVICE_NAME, GrpcServer, ListenError
from sidecar.engine.types import EngineConfig


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return response.status


async def test_unix_socket_serves_subscribe_and_health(make_harness: Callable[..., Harness]) -> None:
    # A short path: Unix socket paths are limited to about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="sc-") as directory:
        path = os.path.join(directory, "sidecar.sock")
        harness = await make_harness(listen=f"unix://{path}").start()
        assert harness.address == f"unix://{path}"

        subscriber = await harness.subscribe("orders", auto_ack=True)
        await harness.publish("orders", [("k", 1), ("k", 2)])
        messages = await subscriber.next_messages(2)
        assert [m.sequence for m in messages] == [1, 2]
        assert harness.channel is not None
        assert await _health(harness.channel, "") == health_pb2.HealthCheckResponse.SERVING
        await harness.stop()
        assert not _exists(path)


async def test_listen_address_errors_are_clear() -> None:
    for listen, reason in [
        ("localhost", "expected host:port"),
        ("unix://relative.sock", "absolute path"),
        ("unix:///no/such/dir/s.sock", "does not exist"),
    ]:
        server = GrpcServer({}, listen)
        try:
            await server.start()
        except ListenError as exc:
            assert reason in str(exc)
        else:
            await server.stop(0)
            raise AssertionError(f"{listen!r} was accepted")


async def test_health_is_not_serving_until_marked_ready(make_harness: Callable[..., Harness]) -> None:
    configs: dict[str, EngineConfig] = {"orders": sequence_config(), "prices": EngineConfig(mode="none")}
    harness = await make_harness(configs).start(serving=False)
    assert harness.channel is not None and harness.server is not None
    services = ["", SERVICE_NAME, "orders", "prices"]
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    serving = health_pb2.HealthCheckResponse.SERVING

    assert [await _health(harness.channel, s) for s in services] == [not_serving] * 4
    await harness.server.set_serving(["orders"])
    assert [await _health(harness.channel, s) for s in services] == [not_serving, not_serving, serving, not_serving]
    await harness.server.set_serving(["prices"])
    assert [await _health(harness.channel, s) for s in services] == [serving] * 4

    await harness.server.enter_graceful_shutdown()
    assert [await _health(harness.channel, s) for s in services] == [not_serving] * 4


async def test_reflection_lists_and_describes_the_services(harness: Harness) -> None:
    assert harness.channel is not None
    stub = reflection_pb2_grpc.ServerReflectionStub(harness.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    responses = [r async for r in stub.ServerReflectionInfo(iter(requests), timeout=10)]

    listed = {s.name for s in responses[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= listed
    assert responses[1].file_descriptor_response.file_descriptor_proto


async def test_get_status_shows_a_key_waiting_on_a_gap(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1), ("k", 3), ("other", 1)])
    messages = await subscriber.next_messages(2)
    await subscriber.ack([m.delivery_id for m in messages])
    await subscriber.wait_confirmed([m.delivery_id for m in messages])

    response = await harness.stub.GetStatus(sidecar_pb2.GetStatusRequest(subscription="orders", max_keys=10))

    (status,) = response.subscriptions
    assert (status.name, status.mode, status.buffered) == ("orders", "sequence", 1)
    assert status.counts["acked"] == 2
    waiting = {k.key: k for k in status.keys_detail}["k"]
    assert waiting.state == "waiting_sequence"
    assert waiting.missing_sequence == 2
    assert waiting.HasField("since")


async def test_get_status_errors(harness: Harness) -> None:
    all_subscriptions = await harness.stub.GetStatus(sidecar_pb2.GetStatusRequest())
    assert [s.name for s in all_subscriptions.subscriptions] == ["orders"]
    assert not all_subscriptions.subscriptions[0].keys_detail  # max_keys 0: no per-key detail

    for request, code in [
        (sidecar_pb2.GetStatusRequest(subscription="nope"), grpc.StatusCode.NOT_FOUND),
        (sidecar_pb2.GetStatusRequest(max_keys=-1), grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        try:
            await harness.stub.GetStatus(request)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is code
        else:
            raise AssertionError(f"{request} did not fail")


async def test_graceful_stop_lets_outstanding_acks_confirm_then_ends_streams(harness: Harness) -> None:
    assert harness.server is not None
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1), ("j", 1)])
    messages = await subscriber.next_messages(2)

    stopping = asyncio.create_task(harness.server.stop(grace_seconds=WAIT_SECONDS))
    await wait_until(lambda: harness.server is not None and harness.server.servicer.is_draining, "drain")
    await subscriber.ack([m.delivery_id for m in messages])

    code, details = await subscriber.wait_end()
    assert code is grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    assert sorted(subscriber.confirmed) == sorted(m.delivery_id for m in messages)
    await asyncio.wait_for(stopping, WAIT_SECONDS)
