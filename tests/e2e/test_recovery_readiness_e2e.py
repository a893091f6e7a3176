"""End to end: a restarted sidecar says ready only once the shards of its first lease round have
their cursors read; their pending messages are read after, while the keys deliver.

Before, start-up waited at most one lease duration for those loads and then answered /readyz 200
anyway. Here Firestore's queries (every read of a load: cursors, recent tombstones, pending
messages) are slowed to several lease durations, and the test checks that /readyz answers 503
meanwhile; that every stored message is then held, and delivered in order once the missing first
sequences arrive. A pod that gets no lease at all (another holds every shard) must still become
ready after its first round.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import Scenario
from e2e_checks import check_sequence_guarantees
from e2e_config import order_message
from e2e_processes import SidecarProcess
from e2e_waits import async_wait_until

pytestmark = pytest.mark.e2e

KEYS = 6
HELD_PER_KEY = 5
"""Sequences 2..6 of each key, held behind the missing 1: all stored in Firestore (no fast path)."""

LEASE = "2s"
QUERY_DELAY_SECONDS = 6.0
"""Each RunQuery of the restarted sidecar's loads waits this long: three lease durations, so that
the old bound (one lease duration) would have said ready long before the loads end."""


async def test_readyz_waits_for_the_first_rounds_cursors_then_every_message_is_read_and_delivered(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("orders", sharding={"shards": 4, "lease_duration": LEASE})
    sidecar = await scenario.start_sidecar()
    held = [order_message(f"r{k}", s) for k in range(KEYS) for s in range(2, HELD_PER_KEY + 2)]
    await scenario.pubsub.publish_all(sub.topic, held)
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub.name) == len(held),
        "the held messages to be stored",
    )
    # A graceful stop hands the leases back: the restarted sidecar takes every shard in its first round.
    assert await asyncio.to_thread(sidecar.terminate) == 0

    scenario.emulators.add_fault(service="firestore", method="RunQuery", code=None, delay_seconds=QUERY_DELAY_SECONDS)
    await asyncio.to_thread(sidecar.start, False)
    answers: list[int] = []

    async def first_ready() -> None:
        """Poll /readyz until it answers 200."""
        while True:
            if sidecar.returncode is not None:
                raise AssertionError(f"the sidecar exited:\n{sidecar.output_tail()}")
            if sidecar.http:
                status, _ = await asyncio.to_thread(sidecar.http_get, "/readyz")
                answers.append(status)
                if status == 200:
                    return
            else:
                _learn_http_address(sidecar)
            await asyncio.sleep(0.05)

    await asyncio.wait_for(first_ready(), 120)
    assert 503 in answers, f"/readyz never answered 503 while the shards' cursors were read: {answers}"
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub.name) == len(held),
        "every stored message to be read back",
        within_seconds=120,
    )

    scenario.emulators.clear_faults()
    app = scenario.app(sub)
    await scenario.pubsub.publish_all(sub.topic, [order_message(f"r{k}", 1) for k in range(KEYS)])
    await async_wait_until(lambda: len(app.seen) >= KEYS * (HELD_PER_KEY + 1), "every message after the restart")
    check_sequence_guarantees(app, {f"r{k}": HELD_PER_KEY + 1 for k in range(KEYS)})


async def test_a_pod_that_gets_no_lease_still_becomes_ready(scenario: Scenario) -> None:
    scenario.add_subscription("orders", sharding={"shards": 1, "lease_duration": LEASE})
    first = scenario.pod_sidecar(0)
    await asyncio.to_thread(first.start, True)
    second = scenario.pod_sidecar(1)
    await asyncio.to_thread(second.start, True)
    # Ready although its first round took nothing: the only shard stays with the first pod.
    assert second.metric("pubsub_sidecar_shards_owned") == 0
    assert first.metric("pubsub_sidecar_shards_owned") == 1


def _learn_http_address(sidecar: SidecarProcess) -> None:
    """The HTTP address (port 0) is in the log line ``http endpoint listening``, before ``ready``."""
    for line in sidecar.output_lines():
        if '"http endpoint listening"' in line and '"address": "' in line:
            sidecar.http = line.split('"address": "', 1)[1].split('"', 1)[0]
            return
