"""End to end: a gap is held and visible (G4); with ``gap_timeout`` and ``skip`` the key goes on."""

from __future__ import annotations

import time

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_waits import async_poll, async_wait_until

from pubsub_sidecar_client import get_status

pytestmark = pytest.mark.e2e


async def test_gap_is_held_and_named_by_get_status_and_skipped_after_gap_timeout(scenario: Scenario) -> None:
    holding = scenario.add_subscription("holding")
    skipping = scenario.add_subscription("skipping", ordering={"gap_timeout": "1s", "on_gap_timeout": "skip"})
    sidecar = await scenario.start_sidecar()
    hold_app = scenario.app(holding)
    skip_app = scenario.app(skipping)
    before_publish = time.time()
    for sub in (holding, skipping):
        for seq in (1, 3):
            data, attributes = order_message("gappy", seq)
            await scenario.pubsub.publish(sub.topic, data, **attributes)

    # skip: after the gap timeout, 3 arrives flagged with the skipped range 2..2.
    await async_wait_until(lambda: any(s.sequence == 3 for s in skip_app.seen), "sequence 3 after the gap timeout")
    assert [(s.sequence, s.skipped) for s in skip_app.seen] == [(1, ()), (3, ((2, 2),))]

    # hold: 1 is delivered, 3 waits for 2 for as long as it takes; GetStatus says so.
    async def waiting_key() -> object:
        response = await get_status(sidecar.grpc, holding.name, max_keys=10)
        [status] = response.subscriptions
        key = next((k for k in status.keys_detail if k.key == "gappy"), None)
        return key if key is not None and key.state == "waiting_sequence" else None

    key = await async_poll(waiting_key, "GetStatus to show the gap")
    assert key.missing_sequence == 2  # type: ignore[attr-defined]
    assert "2" in key.waiting_for  # type: ignore[attr-defined]
    since = key.since.ToMilliseconds() / 1000  # type: ignore[attr-defined]
    assert before_publish - 1 <= since <= time.time()
    assert [s.sequence for s in hold_app.seen] == [1]

    # The missing message fills the gap: 2 then 3, in order.
    data, attributes = order_message("gappy", 2)
    await scenario.pubsub.publish(holding.topic, data, **attributes)
    await async_wait_until(lambda: len(hold_app.seen) == 3, "the held message once the gap is filled")
    assert [s.sequence for s in hold_app.seen] == [1, 2, 3]
    assert all(s.skipped == () for s in hold_app.seen)
