"""End to end: every counter a pod exports only grows while shards move between pods (issue 31, item 4).

A counter that falls breaks every ``increase()`` and ``rate()`` alert. The engine of a shard is
dropped when another pod takes the shard; the counts it made must stay in the pod's totals.
"""

from __future__ import annotations

import pytest
from conftest import Scenario, Sub
from e2e_config import order_message
from e2e_processes import SidecarProcess
from e2e_waits import async_wait_until
from prometheus_client.parser import text_string_to_metric_families

from pubsub_sidecar_client.status import get_status

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
