"""End to end: forwarding to the key's owner over the peer channel (issue 29, run (h) and item 5).

Every pod is a real ``pubsub-sidecar run`` with the peer channel on (a shared secret file, its own
peer port, advertised on 127.0.0.1) and its own app; the emulators' StreamingPull spreads messages
over every pod, so most land on a pod that does not own their key and are forwarded. Every run
checks, over all apps at once: per key in order, no confirmed message delivered again, nothing lost
(``check_sequence_guarantees_across``; per delivery, a confirmed one is the last of its position
anywhere: ``check_confirmed_deliveries_are_final``), Pub/Sub left with nothing leased; and from each pod's
``/metrics`` that forwarding did (or did not) happen.

- (h) the network between the pods and one owner is cut mid-run (``PeerLink``: its connections reset,
  new ones refused; the senders see UNAVAILABLE) and restored: the messages in flight and those
  arriving meanwhile take the inbox's way, and forwarding resumes once the link is back.
- More pods than shards (S=2, 3 pods): the pod without a shard stays ready and forwards all it pulls.
- One pod: the peer channel is on but never used (every peer counter zero).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from conftest import Scenario
from e2e_checks import check_confirmed_deliveries_are_final, check_sequence_guarantees_across
from e2e_config import order_message
from e2e_fleet import (
    PeeringFleet,
    ReadinessWatch,
    all_seen,
    async_wait_drained,
    async_wait_shards_spread,
    peer_counts,
    shuffled_traffic,
)
from e2e_waits import async_poll, async_wait_until, async_wait_until_threaded

pytestmark = pytest.mark.e2e

KEYS = 24
PER_KEY = 12


async def test_forwarding_survives_a_cut_peer_channel(scenario: Scenario) -> None:
    shards = 8
    sub = scenario.add_subscription("orders", sharding={"shards": shards})
    fleet = PeeringFleet(scenario)
    link = await fleet.link(1)  # the others reach pod 1's peer server only through it
    try:
        pods = await fleet.start(3)
        apps = [scenario.pod_app(sub, index) for index in range(3)]
        await async_wait_shards_spread([scenario.pod_listen(index) for index in range(3)], sub.name, shards)
        expected = {f"k{k}": PER_KEY for k in range(KEYS)}
        phases = [_phase(seed, first, first + PER_KEY // 3 - 1) for seed, first in enumerate(range(1, PER_KEY, 4))]

        # 1. The link carries forwarded messages: pod 1 accepts some from the others.
        await scenario.pubsub.publish_all(sub.topic, phases[0])
        await async_wait_until_threaded(
            lambda: peer_counts(pods[1], "answered").get("accepted", 0) > 0, "pod 1 to accept forwarded messages"
        )

        # 2. Cut: the senders' streams to pod 1 end with UNAVAILABLE and their messages are stored.
        # Only what the senders log after the cut counts: a stream may also end while pods start.
        logged_before_cut = {index: len(pods[index].log_records()) for index in (0, 2)}
        await link.cut()
        await scenario.pubsub.publish_all(sub.topic, phases[1])

        def unavailable_seen() -> bool:
            return any(
                "UNAVAILABLE" in str(record.get("message", "")) and f"127.0.0.1:{link.port}" in str(record)
                for index, already in logged_before_cut.items()
                for record in pods[index].log_records()[already:]
            )

        await async_wait_until(unavailable_seen, "a sender to see UNAVAILABLE on the channel to pod 1")
        await async_wait_until(
            lambda: all_seen(apps, {key: 2 * PER_KEY // 3 for key in expected}),
            "the messages published during the cut to be delivered",
        )

        # 3. Restore: forwarding to pod 1 resumes (after the senders' backoff); probe keys keep
        # traffic coming until it has.
        await link.restore()
        accepted_at_restore = peer_counts(pods[1], "answered").get("accepted", 0)
        await scenario.pubsub.publish_all(sub.topic, phases[2])
        probe = 0
        deadline = asyncio.get_running_loop().time() + 60
        while peer_counts(pods[1], "answered").get("accepted", 0) <= accepted_at_restore:
            assert asyncio.get_running_loop().time() < deadline, "forwarding to pod 1 never resumed"
            await scenario.pubsub.publish_all(sub.topic, [order_message(f"probe{probe}", 1)])
            expected[f"probe{probe}"] = 1
            probe += 1
            await asyncio.sleep(0.25)  # pacing the probe publishes, not a synchronisation

        await async_wait_until(lambda: all_seen(apps, expected), "every message at some app", 120)
        await async_wait_drained(scenario.emulators, pods, sub.name, sub.subscription)
        check_sequence_guarantees_across(apps, expected)
        check_confirmed_deliveries_are_final(apps)
        forwarded = [peer_counts(pod, "forwarded") for pod in pods]
        print(f"forwarded by answer, per pod: {forwarded}; probes: {probe}; link connections: {link.connections}")
        # How many messages a broken stream left unanswered depends on what was in flight at the cut
        # (none, when it fell between batches): the senders' UNAVAILABLE after the cut is the check.
        assert all(counts.get("accepted", 0) > 0 for counts in forwarded), forwarded
        assert all(pod.returncode is None for pod in pods)
    finally:
        await fleet.close()


def _phase(seed: int, first: int, last: int) -> list[tuple[bytes, dict[str, str]]]:
    """Every key's ``first..last``, shuffled, a fifth of them published twice."""
    rng = random.Random(seed)
    messages = [order_message(f"k{k}", s) for k in range(KEYS) for s in range(first, last + 1)]
    messages += rng.sample(messages, len(messages) // 5)
    rng.shuffle(messages)
    return messages


async def test_more_pods_than_shards_the_idle_pod_stays_ready_and_forwards(scenario: Scenario) -> None:
    shards = 2
    sub = scenario.add_subscription("orders", sharding={"shards": shards})
    fleet = PeeringFleet(scenario)
    pods = await fleet.start(3)
    apps = [scenario.pod_app(sub, index) for index in range(3)]
    listens = [scenario.pod_listen(index) for index in range(3)]

    async def one_each() -> dict[int, set[int]] | None:
        owned = await async_wait_shards_spread(listens, sub.name, shards)
        return owned if all(len(held) <= 1 for held in owned.values()) else None

    owned = await async_poll(one_each, "each shard at its own pod")
    idle = next(index for index, held in owned.items() if not held)
    since = time.monotonic()
    with ReadinessWatch(pods) as watch:
        traffic, expected = shuffled_traffic(9, KEYS, PER_KEY)
        await scenario.pubsub.publish_all(sub.topic, traffic)
        await async_wait_until(lambda: all_seen(apps, expected), "every message at some app", 90)
        await async_wait_drained(scenario.emulators, pods, sub.name, sub.subscription)
    # 0 is a /readyz that did not answer within 5 s (two loaded cores), not an unready pod.
    answers = [status for at, status in watch.answers[idle] if at >= since]
    assert 200 in answers and set(answers) <= {200, 0}, f"the idle pod {idle} answered /readyz {set(answers)}"
    assert pods[idle].returncode is None
    check_sequence_guarantees_across(apps, expected)
    check_confirmed_deliveries_are_final(apps)
    forwarded = peer_counts(pods[idle], "forwarded")
    print(f"shards per pod: {owned}; the idle pod {idle} forwarded, by answer: {forwarded}")
    assert forwarded.get("accepted", 0) > 0, "the idle pod forwarded nothing"
    assert not apps[idle].seen, "the pod without a shard delivered messages"
    assert not any(peer_counts(pods[idle], "answered").values()), "a pod without a shard accepted messages"


async def test_one_pod_never_uses_the_peer_channel(scenario: Scenario) -> None:
    sub = scenario.add_subscription("orders", sharding={"shards": 4})
    fleet = PeeringFleet(scenario)
    (pod,) = await fleet.start(1)
    app = scenario.pod_app(sub, 0)
    traffic, expected = shuffled_traffic(10, KEYS, PER_KEY)
    await scenario.pubsub.publish_all(sub.topic, traffic)
    await async_wait_until(lambda: all_seen([app], expected), "every message at the app", 90)
    await async_wait_drained(scenario.emulators, [pod], sub.name, sub.subscription)
    check_sequence_guarantees_across([app], expected)
    check_confirmed_deliveries_are_final([app])
    assert not any(peer_counts(pod, "forwarded").values()), peer_counts(pod, "forwarded")
    assert not any(peer_counts(pod, "answered").values()), peer_counts(pod, "answered")
    assert pod.metric("pubsub_sidecar_peer_unauthenticated_total") == 0
