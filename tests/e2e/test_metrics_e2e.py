"""End to end: what /metrics, /readyz, gRPC health and the logs say agrees with what happened."""

from __future__ import annotations

import grpc
import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_waits import async_wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.e2e


async def test_metrics_count_what_the_app_and_the_publisher_did(scenario: Scenario) -> None:
    sub = scenario.add_subscription("metered")
    sidecar = await scenario.start_sidecar()

    def metric(name: str) -> float:
        return sidecar.metric(name, subscription=sub.name)

    # Key "a" is complete (1..5, plus two duplicates); key "b" waits on a gap (2 is missing).
    complete = [order_message("a", s) for s in range(1, 6)]
    duplicates = [order_message("a", 2), order_message("a", 4)]
    gapped = [order_message("b", 1), order_message("b", 3)]
    await scenario.pubsub.publish_all(sub.topic, complete + duplicates + gapped)
    app = scenario.app(sub)

    await async_wait_until(lambda: len(app.confirmed_at) >= 6, "a1..a5 and b1 acked and confirmed")
    await async_wait_until(lambda: metric("pubsub_sidecar_received_total") >= 9, "every copy received")
    await async_wait_until(lambda: metric("pubsub_sidecar_keys_blocked") == 1, "key b counted as blocked")

    assert metric("pubsub_sidecar_delivered_total") == 6
    assert metric("pubsub_sidecar_acked_total") == 6
    assert metric("pubsub_sidecar_duplicates_total") == 2
    assert metric("pubsub_sidecar_nacked_total") == 0
    assert metric("pubsub_sidecar_dead_lettered_total") == 0
    assert metric("pubsub_sidecar_buffered_messages") == 1  # b3, held behind the gap
    assert metric("pubsub_sidecar_in_flight_messages") == 0
    # b3 was never delivered: the oldest undelivered message has an age, which grows.
    first_age = metric("pubsub_sidecar_oldest_undelivered_age_seconds")
    assert first_age > 0
    await async_wait_until(
        lambda: metric("pubsub_sidecar_oldest_undelivered_age_seconds") > first_age, "the oldest age to grow"
    )
    # One publish-to-delivery observation per first delivery; persist observed per batch.
    assert metric("pubsub_sidecar_publish_to_delivery_seconds_count") == 6
    assert metric("pubsub_sidecar_persist_latency_seconds_count") >= 1

    # Filling the gap releases b2 and b3, and the gauges go back to zero.
    await scenario.pubsub.publish_all(sub.topic, [order_message("b", 2)])
    await async_wait_until(lambda: len(app.confirmed_at) >= 8, "b2 and b3 acked and confirmed")
    await async_wait_until(lambda: metric("pubsub_sidecar_buffered_messages") == 0, "nothing buffered")
    assert metric("pubsub_sidecar_keys_blocked") == 0
    assert metric("pubsub_sidecar_oldest_undelivered_age_seconds") == 0
    assert metric("pubsub_sidecar_delivered_total") == 8


async def test_readiness_grpc_health_and_logs_agree(scenario: Scenario) -> None:
    sub = scenario.add_subscription("healthy")
    sidecar = await scenario.start_sidecar()

    status, _ = sidecar.http_get("/healthz")
    assert status == 200
    status, body = sidecar.http_get("/readyz")
    assert status == 200, body
    async with grpc.aio.insecure_channel(scenario.listen) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", sub.name, "pubsub_sidecar.v1.OrderedDelivery"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service

    records = sidecar.log_records()
    assert records, "the sidecar logged nothing as JSON"
    for record in records:
        assert record["severity"] in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
        assert isinstance(record["message"], str)
    assert any("ready" in record["message"] for record in records)

    assert sidecar.terminate() == 0
