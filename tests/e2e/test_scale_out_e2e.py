"""End to end: three sidecar pods and three apps on one subscription (issue: shard leases with fencing).

Each pod is a real ``pubsub-sidecar run`` process with its own gRPC socket and its own app; all share
the emulators' subscription, whose StreamingPull spreads messages over every open stream. Publishing
is shuffled and duplicated throughout. Every run checks, over all apps at once
(``check_sequence_guarantees_across``): per key, a message reaches an app only after some app acked
its predecessor; no confirmed ack is delivered again; nothing is lost; no pod crashes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest
from conftest import Scenario, Sub
from e2e_app import App
from e2e_checks import check_sequence_guarantees_across
from e2e_config import order_message
from e2e_processes import SidecarProcess
from e2e_waits import async_wait_until

from pubsub_sidecar_client.status import get_status
from sidecar.shards import shard_of

pytestmark = pytest.mark.e2e

SHARDS = 8
LEASE = "10s"
"""The product's default. Shorter would make failover quicker, but a pod whose renewal is about half
a lease late stops delivering its shards: with 3 s, a pod that two loaded cores left without running
for 1.4 s lost every shard, and the steady-state checks (each key at its pod, at that shard's epoch)
saw shards move that nobody moved."""
BALANCE_SECONDS = 60.0
"""From a change of pods to balanced shards: a dead or paused pod's leases expire (10 s), then the
survivors take and spread them in a few rounds, on loaded cores."""
KEYS = 16
PER_KEY = 12


def _traffic(seed: int, keys: int = KEYS, per_key: int = PER_KEY) -> list[tuple[bytes, dict[str, str]]]:
    """Every key's 1..per_key, shuffled, with a fifth of them published twice."""
    rng = random.Random(seed)
    messages = [order_message(f"k{k}", s) for k in range(keys) for s in range(1, per_key + 1)]
    messages += rng.sample(messages, len(messages) // 5)
    rng.shuffle(messages)
    return messages


def _expected(keys: int = KEYS, per_key: int = PER_KEY) -> dict[str, int]:
    return {f"k{k}": per_key for k in range(keys)}


def _all_seen(apps: Sequence[App], expected: dict[str, int]) -> bool:
    seen = {(s.key, s.sequence) for app in apps for s in app.seen}
    return all((key, seq) in seen for key, last in expected.items() for seq in range(1, last + 1))


async def _shards_of(pod: SidecarProcess, scenario: Scenario, index: int, sub: Sub) -> dict[int, int]:
    response = await get_status(scenario.pod_listen(index), sub.name)
    return {shard.shard: shard.epoch for shard in response.subscriptions[0].shards}


async def _start_pods(scenario: Scenario, sub: Sub, count: int, first: int = 0) -> list[SidecarProcess]:
    pods = [scenario.pod_sidecar(first + i) for i in range(count)]
    for pod in pods:
        pod.start(wait_ready=False)
    await asyncio.gather(*(pod.async_wait_ready() for pod in pods))
    return pods


async def _publish_slowly(
    scenario: Scenario, sub: Sub, messages: list[tuple[bytes, dict[str, str]]], chunks: int
) -> None:
    """Publish in ``chunks`` parts with a pause between, so that traffic spans what the test does."""
    size = max(1, len(messages) // chunks)
    for start in range(0, len(messages), size):
        await scenario.pubsub.publish_all(sub.topic, messages[start : start + size])
        await asyncio.sleep(0.3)


async def _balanced(scenario: Scenario, sub: Sub, indexes: Sequence[int]) -> dict[int, dict[int, int]]:
    """Wait until the pods' shard sets are disjoint, cover every shard, and each holds its share."""
    owned: dict[int, dict[int, int]] = {}

    async def check() -> bool:
        nonlocal owned
        owned = {i: await _shards_of(scenario.sidecars[i], scenario, i, sub) for i in indexes}
        all_shards = [shard for shards in owned.values() for shard in shards]
        share = SHARDS // len(indexes)
        return sorted(all_shards) == list(range(SHARDS)) and all(
            share <= len(shards) <= share + 1 for shards in owned.values()
        )

    deadline = asyncio.get_running_loop().time() + BALANCE_SECONDS
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"shards never balanced: {owned}"
        await asyncio.sleep(0.2)
    return owned


def _sidecar(scenario: Scenario) -> Sub:
    return scenario.add_subscription("orders", sharding={"shards": SHARDS, "lease_duration": LEASE})


async def test_steady_state_three_pods_deliver_every_key_in_order(scenario: Scenario) -> None:
    sub = _sidecar(scenario)
    pods = await _start_pods(scenario, sub, 3)
    apps = [scenario.pod_app(sub, i) for i in range(3)]
    owned = await _balanced(scenario, sub, [0, 1, 2])
    await scenario.pubsub.publish_all(sub.topic, _traffic(1))
    await async_wait_until(lambda: _all_seen(apps, _expected()), "every message at some app", 90)
    check_sequence_guarantees_across(apps, _expected())
    # Each app got only the keys of its pod's shards, each with that shard's epoch.
    for index, app in enumerate(apps):
        for seen in app.seen:
            assert shard_of(seen.key, SHARDS) in owned[index], f"pod {index} delivered {seen.key} of another pod"
            assert seen.epoch == owned[index][shard_of(seen.key, SHARDS)]
    assert all(pod.returncode is None for pod in pods)


async def test_kill9_of_one_pod_then_a_new_pod_joins(scenario: Scenario) -> None:
    sub = _sidecar(scenario)
    pods = await _start_pods(scenario, sub, 3)
    apps = [scenario.pod_app(sub, i) for i in range(3)]
    await _balanced(scenario, sub, [0, 1, 2])
    traffic = _traffic(2)
    half = len(traffic) // 2
    await scenario.pubsub.publish_all(sub.topic, traffic[:half])
    await async_wait_until(lambda: sum(len(app.seen) for app in apps) >= 5, "some deliveries")
    pods[1].kill9()
    await apps[1].stop()
    await scenario.pubsub.publish_all(sub.topic, traffic[half:])
    # The survivors take the dead pod's shards after its leases expire; then a new pod joins.
    await _balanced(scenario, sub, [0, 2])
    joined = await _start_pods(scenario, sub, 1, first=3)
    apps.append(scenario.pod_app(sub, 3))
    await _balanced(scenario, sub, [0, 2, 3])
    await async_wait_until(lambda: _all_seen(apps, _expected()), "every message after the kill", 120)
    check_sequence_guarantees_across(apps, _expected())
    assert all(pod.returncode is None for pod in [pods[0], pods[2], *joined])


async def test_rolling_restart_with_sigterm_one_pod_at_a_time(scenario: Scenario) -> None:
    sub = _sidecar(scenario)
    await _start_pods(scenario, sub, 3)
    apps = [scenario.pod_app(sub, i) for i in range(3)]
    await _balanced(scenario, sub, [0, 1, 2])
    publishing = asyncio.create_task(_publish_slowly(scenario, sub, _traffic(3), chunks=12))
    live = [0, 1, 2]
    for old in (0, 1, 2):
        new = old + 3
        await _start_pods(scenario, sub, 1, first=new)
        apps.append(scenario.pod_app(sub, new))
        assert await asyncio.to_thread(scenario.sidecars[old].terminate) == 0
        await apps[old].stop()
        live = [i for i in live if i != old] + [new]
        await _balanced(scenario, sub, live)
    await publishing
    await async_wait_until(lambda: _all_seen(apps, _expected()), "every message through the rollout", 120)
    check_sequence_guarantees_across(apps, _expected())


async def test_a_paused_owner_can_do_no_harm_after_it_wakes(scenario: Scenario) -> None:
    sub = _sidecar(scenario)
    pods = await _start_pods(scenario, sub, 3)
    holding = True
    apps = [
        scenario.pod_app(sub, 0, lambda _m: "hold" if holding else "ack"),
        scenario.pod_app(sub, 1),
        scenario.pod_app(sub, 2),
    ]
    await _balanced(scenario, sub, [0, 1, 2])
    await scenario.pubsub.publish_all(sub.topic, _traffic(4))
    await async_wait_until(lambda: len(apps[0].held) >= 3, "the paused pod's app to hold messages")
    confirmed_before = set(apps[0].confirmed_at)
    pods[0].pause()
    try:
        # Past its lease: the others take its shards and deliver its keys, the held ones again.
        await _balanced(scenario, sub, [1, 2])
        held_keys = {message.key for message in apps[0].held}
        await async_wait_until(
            lambda: held_keys <= {s.key for app in apps[1:] for s in app.seen}, "the held keys at the new owners"
        )
    finally:
        pods[0].resume()
    holding = False
    # Awake, the old owner's app acks what it held: the sidecar must refuse every one of them
    # (unknown ids once it dropped the shards, or acks Firestore fenced): none is confirmed.
    held = [(m.key, m.sequence, m.dedup_id) for m in apps[0].held]
    sent = await apps[0].ack_held()

    async def refused() -> bool:
        counts = (await get_status(scenario.pod_listen(0), sub.name)).subscriptions[0].counts
        return counts["unknown_delivery_ids"] + counts.get("acks_fenced", 0) >= sent

    deadline = asyncio.get_running_loop().time() + 30
    while not await refused():
        assert asyncio.get_running_loop().time() < deadline, "the woken pod never refused the stale acks"
        await asyncio.sleep(0.1)
    await async_wait_until(lambda: _all_seen(apps, _expected()), "every message after the pause", 120)
    assert not [ident for ident in held if ident in apps[0].confirmed_at and ident not in confirmed_before]
    check_sequence_guarantees_across(apps, _expected())
    assert pods[0].returncode is None, "the paused pod crashed"


async def test_two_pods_starting_at_the_same_instant_split_the_shards(scenario: Scenario) -> None:
    sub = _sidecar(scenario)
    pods = [scenario.pod_sidecar(0), scenario.pod_sidecar(1)]
    for pod in pods:
        pod.start(wait_ready=False)
    await asyncio.gather(*(pod.async_wait_ready() for pod in pods))
    apps = [scenario.pod_app(sub, 0), scenario.pod_app(sub, 1)]
    owned = await _balanced(scenario, sub, [0, 1])
    assert not set(owned[0]) & set(owned[1])
    await scenario.pubsub.publish_all(sub.topic, _traffic(5))
    await async_wait_until(lambda: _all_seen(apps, _expected()), "every message", 90)
    check_sequence_guarantees_across(apps, _expected())
