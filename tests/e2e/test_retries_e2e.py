"""End to end: app nacks are retried with backoff, then dead-lettered; the key follows on_dead_letter (G5).

Two subscriptions in one sidecar, one per policy: with ``block`` the key's next message is held (and
GetStatus says so), with ``skip`` it is delivered.
"""

from __future__ import annotations

import itertools

import pytest
from conftest import Scenario, Sub
from e2e_app import App
from e2e_config import order_message
from e2e_waits import async_poll, async_wait_until

from pubsub_sidecar_client import get_status

pytestmark = pytest.mark.e2e

MAX_ATTEMPTS = 3
BACKOFF_INITIAL_SECONDS = 0.2


def _poison(message: object) -> str:
    """The app fails ``bad#2`` every time and acks everything else."""
    return "nack" if (message.key, message.sequence) == ("bad", 2) else "ack"  # type: ignore[attr-defined]


def _attempts(app: App, key: str, sequence: int) -> list[tuple[int, float]]:
    return [(seen.delivery_attempt, seen.at) for seen in app.seen if (seen.key, seen.sequence) == (key, sequence)]


async def _publish(scenario: Scenario, sub: Sub) -> None:
    for data, attributes in [order_message("bad", s) for s in (1, 2, 3)] + [order_message("good", s) for s in (1, 2)]:
        await scenario.pubsub.publish(sub.topic, data, **attributes)


async def test_nacked_message_is_retried_with_backoff_then_dead_lettered_and_the_key_follows_its_policy(
    scenario: Scenario,
) -> None:
    delivery = {
        "max_delivery_attempts": MAX_ATTEMPTS,
        "backoff": {"initial": f"{int(BACKOFF_INITIAL_SECONDS * 1000)}ms", "maximum": "2s"},
    }
    blocking = scenario.add_subscription("blocking", delivery={**delivery, "on_dead_letter": "block"})
    skipping = scenario.add_subscription("skipping", delivery={**delivery, "on_dead_letter": "skip"})
    sidecar = await scenario.start_sidecar()
    block_app = scenario.app(blocking, _poison)
    skip_app = scenario.app(skipping, _poison)
    await _publish(scenario, blocking)
    await _publish(scenario, skipping)

    for sub, app in ((blocking, block_app), (skipping, skip_app)):
        assert sub.dead_letter_subscription is not None
        [dead] = await scenario.pubsub.pull_until(sub.dead_letter_subscription, 1, f"the dead letter of {sub.name}")
        assert dead.data == b"bad#2"
        assert dead.attributes["order_id"] == "bad" and dead.attributes["seq"] == "2"
        assert dead.attributes["sidecar_reason"]
        assert dead.attributes["sidecar_subscription"] == sub.name
        assert dead.attributes["sidecar_key"] == "bad"
        assert dead.attributes["sidecar_delivery_attempts"] == str(MAX_ATTEMPTS)

        attempts = _attempts(app, "bad", 2)
        assert [attempt for attempt, _ in attempts] == list(range(1, MAX_ATTEMPTS + 1))
        gaps = [later - earlier for (_, earlier), (_, later) in itertools.pairwise(attempts)]
        # Backoff with jitter: never an immediate redelivery (half the initial delay at least).
        assert all(gap >= BACKOFF_INITIAL_SECONDS / 2 for gap in gaps), gaps
        await async_wait_until(lambda app=app: len(_attempts(app, "good", 2)) == 1, f"good#2 on {sub.name}")

    # skip: the key goes on with its next message.
    await async_wait_until(lambda: len(_attempts(skip_app, "bad", 3)) == 1, "bad#3 after the dead letter (skip)")

    # block: the key stops; GetStatus says why, and bad#3 stays held.
    async def blocked_key() -> object:
        response = await get_status(sidecar.grpc, blocking.name, max_keys=10)
        key = next((k for k in response.subscriptions[0].keys_detail if k.key == "bad"), None)
        return key if key is not None and key.state == "blocked_dead_letter" else None

    key = await async_poll(blocked_key, "GetStatus to show the key blocked on its dead letter")
    assert key.buffered == 1
    assert _attempts(block_app, "bad", 3) == []
    assert [seen.sequence for seen in block_app.seen if seen.key == "bad"] == [1] + [2] * MAX_ATTEMPTS
