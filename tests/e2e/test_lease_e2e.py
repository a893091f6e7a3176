"""End to end: a kill -9 hides the messages the dead sidecar had pulled for at most one lease extension.

Messages pulled and not yet persisted are leased to the process that pulled them; after a kill -9
nobody acks or nacks them, and Pub/Sub gives them to anyone only when that lease runs out. The
Pub/Sub client stretches every lease extension to the 99th percentile of its ack times (up to
600 s) unless ``max_duration_per_lease_extension`` caps it, and the sidecar's ack times are persist
times: after a stretch of slow Firestore commits, an uncapped client keeps messages hidden for
that long. ``flow_control.max_lease_extension`` (default 10 s) is that cap.

The test makes the acks slow first (the ingredient of the original report), then holds fresh
messages unpersisted with a slow Firestore, kills the sidecar, and reads the dead leases' time left
from the Pub/Sub emulator: the cap, not the slow acks, bounds it. A restarted sidecar then delivers
those messages well within a minute.
"""

from __future__ import annotations

import time

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_waits import async_poll, async_wait_until

pytestmark = pytest.mark.e2e

LEASE_EXTENSION_SECONDS = 10
"""The default ``flow_control.max_lease_extension``."""

SLOW_ACK_SECONDS = 16.0
"""How long the first persist takes. An uncapped client's extensions then grow to about this, well
past the cap, so the test fails without it."""

HOLD_PERSIST_SECONDS = 300.0
"""Firestore delay that keeps the victims unpersisted until the kill. Past the store's 30 s RPC
timeout a persist fails and its messages are nacked and pulled again (fresh leases); the poll below
then simply waits for those."""

REDELIVERY_BOUND_SECONDS = 40.0
"""Kill to redelivered-to-the-app: the dead process's leases (its Pub/Sub leases and its shard
leases, 10 s each, running out together), a lease round and a restart on two loaded cores (19 s
seen on busy cores); an unbounded lease after slow acks, or the client's 60 s stream deadline,
would exceed it."""

VICTIMS = 5


async def test_messages_pulled_by_a_killed_sidecar_are_redelivered_within_the_lease_extension(
    scenario: Scenario,
) -> None:
    # The persist path: the in-order fast path would deliver these messages without the BatchWrite
    # the test slows down (its own Pub/Sub ack waits on a checkpoint, under the same lease cap).
    sub = scenario.add_subscription("orders", ordering={"fast_path": False})
    emulators = scenario.emulators
    emulators.add_fault(
        service="firestore", method="BatchWrite", code=None, delay_seconds=SLOW_ACK_SECONDS, writes_to="/messages/"
    )
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)

    # 1. A slow ack: the client's ack-time histogram now holds SLOW_ACK_SECONDS.
    data, attributes = order_message("warm-up", 1)
    await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: app.seen, "the slowly persisted warm-up message", SLOW_ACK_SECONDS + 60)

    # 2. Victims: pulled by the sidecar, held unpersisted by a Firestore that does not answer.
    emulators.clear_faults()
    emulators.add_fault(
        service="firestore", method="BatchWrite", code=None, delay_seconds=HOLD_PERSIST_SECONDS, writes_to="/messages/"
    )
    victim_ids = set(await scenario.pubsub.publish_all(sub.topic, [order_message(f"v{i}", 1) for i in range(VICTIMS)]))

    async def extended_leases() -> list[dict[str, object]] | None:
        # Two deadline changes each: the receipt modack and one lease extension after it, so the
        # leaser has applied what it learnt from the slow ack.
        leases = [lease for lease in emulators.leases(sub.subscription) if lease["message_id"] in victim_ids]
        done = len(leases) == VICTIMS and all(int(lease["extensions"]) >= 2 for lease in leases)
        return leases if done else None

    await async_poll(extended_leases, "the victims' leases to be extended by the sidecar")
    sidecar.kill9()
    killed_at = time.monotonic()
    leases = [lease for lease in emulators.leases(sub.subscription) if lease["message_id"] in victim_ids]
    hidden = max(float(lease["seconds_left"]) for lease in leases)
    print(f"after the kill, the dead sidecar's leases hide the victims for {hidden:.1f}s more")
    assert hidden <= LEASE_EXTENSION_SECONDS + 0.5, leases

    # 3. A restarted sidecar gets them as soon as the leases lapse, and the app sees each once.
    emulators.clear_faults()
    sidecar.start(wait_ready=False)
    victim_keys = {f"v{i}" for i in range(VICTIMS)}
    await async_wait_until(
        lambda: victim_keys <= {seen.key for seen in app.seen},
        "the victims to be delivered by the restarted sidecar",
        REDELIVERY_BOUND_SECONDS + 30,
    )
    redelivered_after = max(seen.at for seen in app.seen if seen.key in victim_keys) - killed_at
    print(f"kill -9 to redelivery: {redelivered_after:.1f}s")
    assert redelivered_after < REDELIVERY_BOUND_SECONDS
    assert sorted(seen.key for seen in app.seen if seen.key in victim_keys) == sorted(victim_keys)
