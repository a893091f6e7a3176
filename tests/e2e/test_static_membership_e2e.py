"""End to end: static membership (issue 29, run (j)).

Two pods with the peer channel on, each a real ``pubsub-sidecar run`` with its own app. Pod 1 is
killed with -9 and started again at once with the same ``POD_NAME``, config and peer address (a
container restarted in its pod): it takes back every shard it held, each at a new epoch, long
before its old leases could expire (the lease here is 30 s, so nothing but static membership can
give them back to it sooner), and delivers them in order. A second process started under the same
pod name while the first lives (its own socket and peer port: another pod claiming the name) is
refused: it exits non-zero with one line naming the pod, and the first keeps its shards.

Every message is checked over both apps: per key in order, no confirmed message delivered again,
nothing lost (``check_sequence_guarantees_across``); a confirmed delivery is the last of its position
(``check_confirmed_deliveries_are_final``).
"""

from __future__ import annotations

import time

import pytest
from conftest import Scenario
from e2e_checks import check_confirmed_deliveries_are_final, check_sequence_guarantees_across
from e2e_fleet import (
    PeeringFleet,
    PeerPod,
    all_seen,
    async_wait_drained,
    async_wait_shards_spread,
    free_port,
    shuffled_traffic,
)
from e2e_waits import async_poll, async_wait_until

from pubsub_sidecar_client.status import get_status

pytestmark = pytest.mark.e2e

SHARDS = 4
LEASE_SECONDS = 30.0
"""Long, so that a take-back before it runs out can only be static membership's (the other pod takes
an expired lease only); the bound asserted is this lease, the measured figure is printed."""


async def _held(listen: str, sub_name: str) -> dict[int, int]:
    """Shard -> epoch the pod at ``listen`` delivers under now; {} when it does not answer."""
    try:
        response = await get_status(listen, sub_name)
    except Exception:
        return {}
    return {shard.shard: shard.epoch for shard in response.subscriptions[0].shards}


async def test_a_pod_restarted_under_its_name_takes_its_shards_back_at_once(scenario: Scenario) -> None:
    sub = scenario.add_subscription("orders", sharding={"shards": SHARDS, "lease_duration": f"{LEASE_SECONDS:g}s"})
    fleet = PeeringFleet(scenario)
    pods = await fleet.start(2)
    apps = [scenario.pod_app(sub, 0), scenario.pod_app(sub, 1)]
    listens = [scenario.pod_listen(0), scenario.pod_listen(1)]
    await async_wait_shards_spread(listens, sub.name, SHARDS)
    traffic, expected = shuffled_traffic(11, 16, 10)
    half = len(traffic) // 2
    await scenario.pubsub.publish_all(sub.topic, traffic[:half])
    await async_wait_until(lambda: apps[0].seen and apps[1].seen, "deliveries at both apps")
    before = await _held(listens[1], sub.name)
    assert before, "pod 1 holds no shard"

    pods[1].kill9()
    killed_at = time.monotonic()
    await apps[1].stop()
    pods[1].start(wait_ready=False)

    async def taken_back() -> dict[int, int] | None:
        held = await _held(listens[1], sub.name)
        return held if set(before) <= set(held) else None

    after = await async_poll(taken_back, "the restarted pod 1 to hold its shards again", LEASE_SECONDS + 30)
    took_seconds = time.monotonic() - killed_at
    print(f"kill -9 to its shards held again by the restarted pod: {took_seconds:.1f}s (lease {LEASE_SECONDS:g}s)")
    assert took_seconds < LEASE_SECONDS, "the restarted pod waited out its old leases"
    assert all(after[shard] > epoch for shard, epoch in before.items()), (before, after)
    await pods[1].async_wait_ready()
    apps.append(scenario.pod_app(sub, 1))

    # Another process claiming pod-1 while it lives: refused, one line; pod 1 keeps its shards.
    twin = fleet.sidecar(
        1,
        listen=f"unix://{scenario.workdir}/twin.sock",
        config_name="twin-pod1",
        peer=PeerPod(port := free_port(), f"127.0.0.1:{port}"),
    )
    twin.start(wait_ready=False)
    await async_wait_until(lambda: twin.returncode is not None, "the second pod-1 process to exit")
    refusals = [line for line in twin.output_lines() if "pod-1" in line and "is taken" in line]
    print(f"the second process exited with {twin.returncode}: {refusals}")
    assert twin.returncode != 0 and len(refusals) == 1, twin.output_tail()
    assert set(before) <= set(await _held(listens[1], sub.name)), "pod 1 lost its shards to the refused process"

    await scenario.pubsub.publish_all(sub.topic, traffic[half:])
    await async_wait_until(lambda: all_seen(apps, expected), "every message after the restart", 120)
    await async_wait_drained(scenario.emulators, [pods[0], pods[1]], sub.name, sub.subscription)
    check_sequence_guarantees_across(apps, expected)
    check_confirmed_deliveries_are_final(apps)
    assert pods[0].returncode is None and pods[1].returncode is None


async def test_a_second_process_under_a_living_pod_name_stops_without_pulling(scenario: Scenario) -> None:
    scenario.add_subscription("orders", sharding={"shards": SHARDS, "lease_duration": f"{LEASE_SECONDS:g}s"})
    fleet = PeeringFleet(scenario)
    (pod,) = await fleet.start(1)
    twin = fleet.sidecar(
        0,
        listen=f"unix://{scenario.workdir}/twin.sock",
        config_name="twin-pod0",
        peer=PeerPod(port := free_port(), f"127.0.0.1:{port}"),
    )
    twin.start(wait_ready=False)
    await async_wait_until(lambda: any("peer server listening" in line for line in twin.output_lines()), "the bind")
    bound_at = time.monotonic()
    await async_wait_until(lambda: twin.returncode is not None, "the second pod-0 process to exit", LEASE_SECONDS + 30)
    refused_after = time.monotonic() - bound_at
    print(f"the second process exited with {twin.returncode} {refused_after:.1f}s after it bound its ports")
    assert twin.returncode != 0
    assert not [line for line in twin.output_lines() if "ingest of orders started" in line], (
        "the refused process pulled"
    )
    assert refused_after < LEASE_SECONDS / 2, "the refused process waited out a lease before it stopped"
    assert pod.returncode is None
