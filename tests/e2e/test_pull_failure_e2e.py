"""End to end: a pod that Pub/Sub delivers nothing to says so on /readyz, GetStatus and /metrics, with
the cause, within a bounded time, and recovers when pulling works again.

The official subscriber (unmodified) closes the streaming pull for good on NOT_FOUND (here: the
subscription deleted while the stream runs; the emulator ends open streams with NOT_FOUND, as
production does) and retries RESOURCE_EXHAUSTED (quota) silently for ever. Before, the first made
the sidecar exit 1 (a crash loop with no probe, status or metric saying why) and the second left
every probe green while nothing arrived.

Bounds (sidecar/pipeline/pull_health.py, plus the 2 s readiness cache): a pull closed for good is reported at
once; failures the client retries, once they lasted 10 s; ready again once a stream stayed open 5 s
or delivered a message, after the reopen backoff (1 s doubling to 30 s) for a closed pull.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_processes import SidecarProcess
from e2e_waits import async_poll, async_wait_until

from pubsub_sidecar_client import get_status
from sidecar.pipeline.pull_health import FAILING_AFTER_SECONDS

pytestmark = pytest.mark.e2e

_READINESS_CACHE_SECONDS = 2.0

_SLACK_SECONDS = 8.0
"""For polls on a busy 2-core machine: the bound itself is the product's, this is the test's reading."""


def _readyz(sidecar: SidecarProcess) -> tuple[int, dict[str, str]]:
    status, body = sidecar.http_get("/readyz")
    return status, (json.loads(body)["checks"] if body else {})


async def _pull_failure(sidecar: SidecarProcess, name: str) -> str:
    response = await get_status(sidecar.grpc, name, max_keys=0, timeout_seconds=10)
    [sub] = response.subscriptions
    return str(sub.pull_failure)


async def _not_ready_because(sidecar: SidecarProcess, name: str, fragment: str) -> str:
    status, checks = await asyncio.to_thread(_readyz, sidecar)
    reason = checks.get(f"streaming_pull:{name}", "")
    return reason if status == 503 and fragment in reason else ""


async def test_a_deleted_subscription_turns_readyz_503_at_once_with_the_cause_and_recovers_once_recreated(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)
    data, attributes = order_message("a", 1)
    await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: len(app.confirmed_at) == 1, "a#1 confirmed")
    assert (await asyncio.to_thread(_readyz, sidecar))[0] == 200
    assert await _pull_failure(sidecar, sub.name) == ""

    deleted = time.monotonic()
    await asyncio.to_thread(scenario.pubsub.subscriber.delete_subscription, subscription=sub.subscription)
    reason = await async_poll(
        lambda: _not_ready_because(sidecar, sub.name, "closed by NOT_FOUND"), "/readyz 503 naming NOT_FOUND"
    )
    elapsed = time.monotonic() - deleted
    assert elapsed < _READINESS_CACHE_SECONDS + _SLACK_SECONDS, f"reported after {elapsed:.1f}s"
    assert "Subscription does not exist" in reason and sub.subscription in reason
    assert "closed by NOT_FOUND" in await _pull_failure(sidecar, sub.name)
    assert sidecar.metric("pubsub_sidecar_streaming_pull_failing", subscription=sub.name) == 1
    assert sidecar.metric("pubsub_sidecar_streaming_pull_errors_total", subscription=sub.name, code="NOT_FOUND") >= 1
    # Liveness stays: a restart cannot bring the subscription back, and the process keeps serving.
    assert sidecar.http_get("/healthz")[0] == 200
    assert sidecar.returncode is None

    # Recreated: pulled again within the reopen backoff, and what is published arrives.
    await asyncio.to_thread(scenario.pubsub.subscriber.create_subscription, name=sub.subscription, topic=sub.topic)
    data, attributes = order_message("a", 2)
    await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: len(app.confirmed_at) == 2, "a#2 confirmed after the subscription came back")
    await async_poll(lambda: _ready(sidecar), "/readyz 200 again")
    assert await _pull_failure(sidecar, sub.name) == ""
    assert sidecar.metric("pubsub_sidecar_streaming_pull_failing", subscription=sub.name) == 0
    assert [(s.key, s.sequence) for s in app.seen] == [("a", 1), ("a", 2)]


async def _ready(sidecar: SidecarProcess) -> bool:
    return (await asyncio.to_thread(_readyz, sidecar))[0] == 200


async def test_a_quota_refusing_every_stream_turns_readyz_503_once_it_lasts_and_clears_when_it_ends(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)
    emulators = scenario.emulators

    emulators.add_fault(service="pubsub", method="StreamingPull", code="RESOURCE_EXHAUSTED")
    started = time.monotonic()
    emulators.break_streams("pubsub", "UNAVAILABLE")
    reason = await async_poll(
        lambda: _not_ready_because(sidecar, sub.name, "RESOURCE_EXHAUSTED"),
        "/readyz 503 naming RESOURCE_EXHAUSTED",
        within_seconds=FAILING_AFTER_SECONDS + _READINESS_CACHE_SECONDS + 30,
    )
    elapsed = time.monotonic() - started
    assert elapsed >= FAILING_AFTER_SECONDS - 1, f"reported after {elapsed:.1f}s, before the failures lasted"
    assert elapsed < FAILING_AFTER_SECONDS + _READINESS_CACHE_SECONDS + _SLACK_SECONDS, f"{elapsed:.1f}s"
    assert reason.startswith("every streaming pull failed for ") and "injected fault" in reason
    assert "RESOURCE_EXHAUSTED" in await _pull_failure(sidecar, sub.name)
    assert sidecar.metric("pubsub_sidecar_streaming_pull_failing", subscription=sub.name) == 1
    assert (
        sidecar.metric("pubsub_sidecar_streaming_pull_errors_total", subscription=sub.name, code="RESOURCE_EXHAUSTED")
        >= 2
    )
    assert sidecar.http_get("/healthz")[0] == 200

    emulators.clear_faults("pubsub")
    data, attributes = order_message("a", 1)
    await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: len(app.confirmed_at) == 1, "a#1 confirmed once the quota is back")
    await async_poll(lambda: _ready(sidecar), "/readyz 200 again")
    assert sidecar.metric("pubsub_sidecar_streaming_pull_failing", subscription=sub.name) == 0
