"""End to end: ``delivery_attempt`` goes on counting on the pod a graceful hand-over gave the shard to.

A message delivered by pod 0 and never acked is delivered by pod 1 once pod 0 gave its shard up
(SIGTERM, or the balancing that gives pod 1 its half first) as attempt 2: the hand-over's lease
write carried pod 0's attempts (docs/observability.md, "``delivery_attempt`` across redeliveries").
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import Scenario, Sub
from e2e_config import order_message
from e2e_waits import async_wait_until

pytestmark = pytest.mark.e2e


def _shards(scenario: Scenario, sub: Sub, pod: int) -> int:
    """Shards the pod owns now (its ``pubsub_sidecar_shards_owned`` gauge)."""
    return int(scenario.sidecars[pod].metric("pubsub_sidecar_shards_owned", subscription=sub.name))


async def test_delivery_attempt_goes_on_counting_on_the_pod_a_graceful_hand_over_gave_the_shard_to(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("handed", sharding={"shards": 2, "lease_duration": "4s", "drain_timeout": "1s"})
    first = scenario.pod_sidecar(0)
    first.start(wait_ready=False)
    await first.async_wait_ready()
    await async_wait_until(lambda: _shards(scenario, sub, 0) == 2, "pod 0 owns every shard", 60)
    # The app of pod 0 keeps the message unacked: it is in flight when pod 0 gives its shard up.
    held = scenario.pod_app(sub, 0, lambda message: "hold")
    await scenario.pubsub.publish_all(sub.topic, [order_message("held", 1)])
    await async_wait_until(lambda: len(held.seen) == 1, "the first delivery", 60)
    assert held.seen[0].delivery_attempt == 1

    second = scenario.pod_sidecar(1)
    second.start(wait_ready=False)
    await second.async_wait_ready()
    app = scenario.pod_app(sub, 1)
    await async_wait_until(lambda: _shards(scenario, sub, 1) >= 1, "pod 1 takes a shard", 90)
    assert await asyncio.to_thread(first.terminate) == 0
    await async_wait_until(
        lambda: any(m.key == "held" for m in app.seen), "pod 1 delivers the message pod 0 gave up", 90
    )
    again = next(m for m in app.seen if m.key == "held")
    assert (again.key, again.sequence) == ("held", 1)
    assert again.delivery_attempt == 2
    assert second.returncode is None
