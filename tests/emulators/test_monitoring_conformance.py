"""Cloud Monitoring conformance: the official google-cloud-monitoring client reads Pub/Sub backlog metrics.

The client has no emulator switch; it reaches MONITORING_EMULATOR_HOST through an insecure channel
handed to its gRPC transport, as docs/emulators.md describes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.api import metric_pb2
from google.api_core import exceptions
from google.cloud import monitoring_v3
from google.cloud.monitoring_v3.services.metric_service.transports import MetricServiceGrpcAsyncIOTransport

pytestmark = pytest.mark.timeout(120)

AGE = "pubsub.googleapis.com/subscription/oldest_unacked_message_age"
UNDELIVERED = "pubsub.googleapis.com/subscription/num_undelivered_messages"


@pytest.fixture
async def metrics(emulators: Any) -> AsyncIterator[monitoring_v3.MetricServiceAsyncClient]:
    if not emulators.monitoring_host:
        pytest.skip("MONITORING_EMULATOR_HOST is not set")
    channel = grpc.aio.insecure_channel(emulators.monitoring_host)
    yield monitoring_v3.MetricServiceAsyncClient(transport=MetricServiceGrpcAsyncIOTransport(channel=channel))
    await channel.close()


async def series(
    client: monitoring_v3.MetricServiceAsyncClient,
    project: str,
    metric: str,
    subscription_id: str,
    start: float,
    end: float,
) -> list[Any]:
    interval = monitoring_v3.TimeInterval(
        start_time={"seconds": int(start), "nanos": int(start % 1 * 1e9)},
        end_time={"seconds": int(end), "nanos": int(end % 1 * 1e9)},
    )
    pager = await client.list_time_series(
        request={
            "name": f"projects/{project}",
            "filter": f'metric.type = "{metric}"  AND resource.labels.subscription_id="{subscription_id}"',
            "interval": interval,
        }
    )
    return [ts async for ts in pager]


async def test_backlog_metrics_follow_the_truth_and_vanish_when_empty(
    emulators: Any, resources: Any, subscriber: Any, metrics: monitoring_v3.MetricServiceAsyncClient
) -> None:
    emulators.require_admin()  # asserts our sampling period and delay
    period, delay = emulators.metric_period_seconds, emulators.metric_delay_seconds
    topic = resources.topic()
    subscription = resources.subscription(topic)
    sub_id = subscription.rsplit("/", 1)[-1]
    published_after = time.time()
    for future in [resources.publisher.publish(topic, f"b{i}".encode()) for i in range(3)]:
        future.result(timeout=30)
    published_before = time.time()

    deadline = time.monotonic() + 30
    while True:
        found = await series(metrics, emulators.project, AGE, sub_id, published_after - 60, time.time())
        if found and found[0].points[0].value.int64_value >= 2:
            break
        assert time.monotonic() < deadline, "the age metric never reached 2 s"
        await asyncio.sleep(period / 4)
    [age_series] = found
    assert age_series.resource.type == "pubsub_subscription"
    assert age_series.resource.labels["subscription_id"] == sub_id
    assert age_series.metric_kind == metric_pb2.MetricDescriptor.GAUGE
    assert age_series.value_type == metric_pb2.MetricDescriptor.INT64
    ends = [p.interval.end_time.timestamp() for p in age_series.points]
    assert ends == sorted(ends, reverse=True), "points must come newest first"
    queried_at = time.time()
    assert ends[0] <= queried_at - delay + 0.05, "a point became visible before the metric delay"
    for point in age_series.points:
        end = point.interval.end_time.timestamp()
        assert end - published_before - period <= point.value.int64_value <= end - published_after + period

    [count_series] = await series(metrics, emulators.project, UNDELIVERED, sub_id, published_after - 60, time.time())
    assert count_series.points[0].value.int64_value == 3

    pulled = list(subscriber.pull(subscription=subscription, max_messages=10, timeout=30).received_messages)
    while len(pulled) < 3:
        pulled.extend(subscriber.pull(subscription=subscription, max_messages=10, timeout=30).received_messages)
    subscriber.acknowledge(subscription=subscription, ack_ids=[m.ack_id for m in pulled])
    acked_at = time.time()

    # Wait, without polling for absence, until samples taken well after the ack are visible.
    await asyncio.sleep(delay + 2 * period)
    assert await series(metrics, emulators.project, AGE, sub_id, acked_at + period, time.time()) == []
    assert await series(metrics, emulators.project, UNDELIVERED, sub_id, acked_at + period, time.time()) == []
    # The history before the ack is still there.
    assert await series(metrics, emulators.project, AGE, sub_id, published_after, acked_at)


async def test_subscription_that_never_had_messages_has_no_series(
    emulators: Any, resources: Any, metrics: monitoring_v3.MetricServiceAsyncClient
) -> None:
    emulators.require_admin()
    subscription = resources.subscription(resources.topic())
    created_at = time.time()
    await asyncio.sleep(emulators.metric_delay_seconds + 2 * emulators.metric_period_seconds)
    sub_id = subscription.rsplit("/", 1)[-1]
    assert await series(metrics, emulators.project, AGE, sub_id, created_at - 1, time.time()) == []


@pytest.mark.parametrize(
    "filter_text",
    [
        'metric.type = "pubsub.googleapis.com/subscription/no_such_metric"',
        'resource.labels.subscription_id = "x"',
        "metric.type = unquoted",
        "",
    ],
)
async def test_bad_filters_are_invalid_argument(
    emulators: Any, metrics: monitoring_v3.MetricServiceAsyncClient, filter_text: str
) -> None:
    now = time.time()
    with pytest.raises(exceptions.InvalidArgument):
        await metrics.list_time_series(
            request={
                "name": f"projects/{emulators.project}",
                "filter": filter_text,
                "interval": {"start_time": {"seconds": int(now) - 60}, "end_time": {"seconds": int(now)}},
            }
        )
