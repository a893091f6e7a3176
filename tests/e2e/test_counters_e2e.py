"""End to end: honest counters and states (issue 31, items 4 and 5).

- Every counter a pod exports only grows while shards move between pods: a counter that falls
  breaks every ``increase()`` and ``rate()`` alert. The engine of a shard is dropped when another
  pod takes the shard; the counts it made stay in the pod's totals.
- A malformed message is counted as a dead letter of reason ``malformed``, logged at WARNING, and
  its dead letter carries its key when the key attribute was readable.
- While Firestore does not answer, status says the leases are lost and why, and /readyz names the cause.
- Status and metrics show intake against delivery.
- A message in flight when a Firestore outage took the leases is delivered again as attempt 2.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest
from conftest import Scenario, Sub
from e2e_config import order_message
from e2e_processes import SidecarProcess
from e2e_waits import async_poll, async_wait_until
from prometheus_client.parser import text_string_to_metric_families

from pubsub_sidecar.v1 import sidecar_pb2
from pubsub_sidecar_client.status import get_status
from sidecar.commands.status import format_table

pytestmark = pytest.mark.e2e

SHARDS = 8
KEYS = 16
PER_KEY = 4

Series = tuple[str, tuple[tuple[str, str], ...]]


def _totals(pod: SidecarProcess) -> dict[Series, float]:
    """Every ``_total`` sample of the pod's ``/metrics``, by name and labels."""
    status, body = pod.http_get("/metrics")
    assert status == 200, f"/metrics answered {status}"
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        if family.type == "counter"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


async def _status_counts(scenario: Scenario, pod: int, sub: Sub) -> dict[str, int]:
    response = await get_status(scenario.pod_listen(pod), sub.name)
    return dict(response.subscriptions[0].counts)


async def test_counters_only_grow_when_another_pod_takes_shards(scenario: Scenario) -> None:
    sub = scenario.add_subscription(
        "counted", sharding={"shards": SHARDS, "lease_duration": "10s"}, ordering={"first_sequence": "any"}
    )
    first = scenario.pod_sidecar(0)
    first.start(wait_ready=False)
    await first.async_wait_ready()
    app = scenario.pod_app(sub, 0)
    await async_wait_until(lambda: _shards_sync(scenario, sub) == SHARDS, "pod 0 owns every shard", 60)
    # Every key from its second position (the key's cursor starts at the first it sees), then each first:
    # behind the cursor, late, dead-lettered.
    await scenario.pubsub.publish_all(
        sub.topic, [order_message(f"k{k}", s) for k in range(KEYS) for s in range(2, PER_KEY + 1)]
    )
    await async_wait_until(lambda: len(app.confirmed_at) >= KEYS * (PER_KEY - 1), "every message confirmed", 90)
    await scenario.pubsub.publish_all(sub.topic, [order_message(f"k{k}", 1) for k in range(KEYS)])
    await async_wait_until(
        lambda: first.metric("pubsub_sidecar_late_total", subscription=sub.name) >= KEYS, "every late copy counted", 60
    )
    before = _totals(first)
    counts_before = await _status_counts(scenario, 0, sub)
    assert before[("pubsub_sidecar_delivered_total", (("subscription", sub.name),))] >= KEYS * (PER_KEY - 1)
    assert counts_before["late"] >= KEYS

    second = scenario.pod_sidecar(1)
    second.start(wait_ready=False)
    await second.async_wait_ready()
    await async_wait_until(
        lambda: _shards_sync(scenario, sub, pod=0) <= SHARDS // 2 + 1, "pod 1 takes shards from pod 0", 90
    )
    after = _totals(first)
    counts_after = await _status_counts(scenario, 0, sub)
    fell = {series: (value, after.get(series)) for series, value in before.items() if after.get(series, 0) < value}
    assert not fell, f"counters fell when shards moved: {fell}"
    monotonic = ("stored", "delivered", "acked", "late", "dead_lettered", "duplicates")
    fell_status = {
        n: (counts_before[n], counts_after.get(n)) for n in monotonic if counts_after.get(n, 0) < counts_before[n]
    }
    assert not fell_status, f"status counts fell when shards moved: {fell_status}"
    assert first.returncode is None and second.returncode is None


def _shards_sync(scenario: Scenario, sub: Sub, pod: int = 0) -> int:
    """Shards the pod owns now (its ``pubsub_sidecar_shards_owned`` gauge)."""
    return int(scenario.sidecars[pod].metric("pubsub_sidecar_shards_owned", subscription=sub.name))


async def test_a_malformed_message_is_counted_warned_about_and_found_by_its_key(scenario: Scenario) -> None:
    sub = scenario.add_subscription("picky")
    sidecar = await scenario.start_sidecar()
    await scenario.pubsub.publish(sub.topic, b"no sequence", order_id="o-456")
    await scenario.pubsub.publish(sub.topic, b"no key", seq="1")
    assert sub.dead_letter_subscription is not None
    dead = await scenario.pubsub.pull_until(sub.dead_letter_subscription, 2, "the malformed messages")
    keys = {letter.data: letter.attributes.get("sidecar_key", "") for letter in dead}
    assert keys == {b"no sequence": "o-456", b"no key": ""}
    assert all(letter.attributes["sidecar_reason"].startswith("malformed: ") for letter in dead)
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_dead_lettered_total", subscription=sub.name, reason="malformed") == 2,
        "two malformed dead letters counted",
    )
    warned = [
        record
        for record in sidecar.log_records()
        if "dead-lettered" in record.get("message", "") and "malformed" in record["message"]
    ]
    assert len(warned) == 2 and all(record["severity"] == "WARNING" for record in warned), warned
    # GetStatus counts them as the metrics do.
    counts = (await get_status(scenario.listen, sub.name)).subscriptions[0].counts
    assert (counts["dead_lettered"], counts["dead_lettered:malformed"]) == (2, 2)


async def test_status_and_readiness_say_why_leases_are_lost_while_firestore_does_not_answer(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("leased", sharding={"shards": 4, "lease_duration": "10s"})
    pod = scenario.pod_sidecar(0)
    pod.start(wait_ready=False)
    await pod.async_wait_ready()
    await async_wait_until(lambda: _shards_sync(scenario, sub) == 4, "pod 0 owns every shard", 60)

    async def lease_problem() -> str:
        response = await get_status(scenario.pod_listen(0), sub.name)
        return response.subscriptions[0].lease_problem

    assert await lease_problem() == ""
    scenario.emulators.add_fault(service="firestore", method="*", code="UNAVAILABLE")
    try:
        problem = await async_poll(lease_problem, "status to say the leases are lost", 60)
        assert problem.startswith("Firestore unavailable since ") and "lease reads failed" in problem
        response = await get_status(scenario.pod_listen(0), sub.name)
        table = format_table(response, datetime.now(UTC))
        assert "  LEASES LOST: Firestore unavailable since " in table
        status, firestore = await async_poll(lambda: _readyz_firestore(pod), "/readyz to answer", 30)
        # "no answer from Firestore within 5 s (TimeoutError)" while the client retries, or the error's own text.
        assert status == 503 and "Firestore" in firestore and not firestore.rstrip().endswith(":"), firestore
    finally:
        scenario.emulators.clear_faults("firestore")
    await async_poll(lambda: _cleared(lease_problem), "status to stop saying the leases are lost", 60)


async def _readyz_firestore(pod: SidecarProcess) -> tuple[int, str] | None:
    """/readyz's status and its Firestore check, or None while it does not answer. A check waits up to
    5 s for Firestore, so the probe waits longer than ``http_get`` does."""

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{pod.http}/readyz", timeout=20) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    status, body = await asyncio.to_thread(get)
    try:
        return status, json.loads(body)["checks"]["firestore"]
    except (ValueError, KeyError):
        return None


async def _cleared(problem: Callable[[], Awaitable[str]]) -> bool:
    return not await problem()


async def test_status_and_metrics_show_intake_against_delivery(scenario: Scenario) -> None:
    sub = scenario.add_subscription("measured")
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)

    async def capacity() -> sidecar_pb2.CapacityStatus | None:
        response = await get_status(scenario.listen, sub.name)
        status = response.subscriptions[0]
        return status.capacity if status.HasField("capacity") else None

    # Rates appear once the sidecar sampled 10 s of its totals: nothing came in, nothing grows.
    idle = await async_poll(capacity, "capacity in GetStatus", 60)
    assert (idle.intake_per_second, idle.delivered_per_second, idle.growing_for.ToSeconds()) == (0, 0, 0)
    await scenario.pubsub.publish_all(sub.topic, [order_message(f"m{k}", s) for k in range(10) for s in (1, 2, 3)])
    await async_wait_until(lambda: len(app.confirmed_at) >= 30, "every message confirmed")
    # Every message was finished: both rates show them, and the backlog is not said to grow.
    await async_wait_until(
        lambda: (
            sidecar.metric("pubsub_sidecar_backlog_deficit_seconds", subscription=sub.name) == 0
            and sidecar.metric("pubsub_sidecar_backlog_deficit", subscription=sub.name) == 0
        ),
        "intake and delivery to match over the window",
    )
    assert sidecar.metric("pubsub_sidecar_intake_rate", subscription=sub.name) > 0
    assert sidecar.metric("pubsub_sidecar_delivery_rate", subscription=sub.name) > 0
    after = await capacity()
    assert after is not None and after.intake_per_second > 0 and after.intake_per_second == after.delivered_per_second


async def test_delivery_attempt_goes_on_counting_after_a_firestore_outage_took_the_leases(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("retried", sharding={"shards": 2, "lease_duration": "4s"})
    pod = scenario.pod_sidecar(0)
    pod.start(wait_ready=False)
    await pod.async_wait_ready()
    await async_wait_until(lambda: _shards_sync(scenario, sub) == 2, "pod 0 owns every shard", 60)
    # The app keeps the message unacked: it is in flight when the outage drops its shard.
    app = scenario.pod_app(sub, 0, lambda message: "hold")
    await scenario.pubsub.publish_all(sub.topic, [order_message("held", 1)])
    await async_wait_until(lambda: len(app.seen) == 1, "the first delivery")
    assert app.seen[0].delivery_attempt == 1
    scenario.emulators.add_fault(service="firestore", method="*", code="UNAVAILABLE")
    try:
        await async_wait_until(lambda: _shards_sync(scenario, sub) == 0, "the leases run out", 60)
    finally:
        scenario.emulators.clear_faults("firestore")
    await async_wait_until(lambda: len(app.seen) >= 2, "the message delivered again once the shard is back", 90)
    again = app.seen[1]
    assert (again.key, again.sequence) == ("held", 1)
    assert again.epoch > app.seen[0].epoch  # a new engine, under a new lease
    assert again.delivery_attempt == 2
