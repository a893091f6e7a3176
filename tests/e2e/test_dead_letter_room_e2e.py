"""End to end: a key blocked by a dead letter is seen, unblocked after the fix, and dead letters discarded.

A real sidecar process and the emulators; the operator's commands run as processes too
(``python -m sidecar dead-letters ...``, ``python -m sidecar unblock ...``), with the official
Pub/Sub client inside. The app fails ``a#2`` until it is "fixed" and always fails ``c#1``; both keys
block (``on_dead_letter: block``). Replay is not built yet: after the fix the operator unblocks ``a``
(its dead letter is skipped on record) and discards ``c``'s dead letter, which unblocks nothing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_processes import _python_env
from e2e_waits import async_poll, async_wait_until

from pubsub_sidecar_client import get_status

pytestmark = pytest.mark.e2e


async def command(scenario: Scenario, *argv: str) -> subprocess.CompletedProcess[str]:
    env = _python_env(scenario.emulators.env)
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "sidecar", *argv], env=env, capture_output=True, text=True, timeout=120
    )


def rows(result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


async def test_a_blocked_key_is_listed_unblocked_after_the_fix_and_a_discard_is_on_record(scenario: Scenario) -> None:
    fixed = False

    def app_logic(message: Any) -> str:
        if (message.key, message.sequence) == ("a", 2) and not fixed:
            return "nack"
        return "nack" if (message.key, message.sequence) == ("c", 1) else "ack"

    sub = scenario.add_subscription("orders", delivery={"max_delivery_attempts": 2, "on_dead_letter": "block"})
    assert sub.dead_letter_subscription is not None
    dl = ("--dead-letter-subscription", sub.dead_letter_subscription)
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub, app_logic)
    for key, seq in (("a", 1), ("a", 2), ("a", 3), ("c", 1), ("c", 2)):
        data, attributes = order_message(key, seq)
        await scenario.pubsub.publish(sub.topic, data, **attributes)

    # list: both dead letters wait, with what an operator needs; nothing is acked by looking.
    async def both_listed() -> list[dict[str, Any]] | None:
        listed = rows(await command(scenario, "dead-letters", "list", *dl, "--json"))
        return listed if len(listed) == 2 else None

    listed = {row["key"]: row for row in await async_poll(both_listed, "two dead letters listed")}
    assert {k: (r["position"], r["reason"], r["attempts"], r["subscription"]) for k, r in listed.items()} == {
        "a": (2, "max_delivery_attempts", 2, "orders"),
        "c": (1, "max_delivery_attempts", 2, "orders"),
    }
    assert (
        rows(await command(scenario, "dead-letters", "list", *dl, "--json", "--key", "a"))[0]["message_id"]
        == (listed["a"]["message_id"])
    )

    # status and the alarm: both keys stopped, each at its dead letter.
    async def blocked() -> dict[str, Any] | None:
        response = await get_status(sidecar.grpc, "orders", max_keys=10)
        keys = {k.key: k for k in response.subscriptions[0].keys_detail if k.state == "blocked_dead_letter"}
        return keys if len(keys) == 2 else None

    keys = await async_poll(blocked, "both keys blocked")
    assert (keys["a"].blocked_sequence, keys["a"].blocked_message_id) == (2, listed["a"]["message_id"])
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_keys_blocked_dead_letter", subscription="orders") == 2, "the alarm"
    )
    assert not any((s.key, s.sequence) == ("a", 3) for s in app.seen)

    # The fix, then unblock: a#3 is delivered, a#2 stays skipped.
    fixed = True
    result = await command(scenario, "unblock", "--target", sidecar.grpc, "--subscription", "orders", "--key", "a")
    assert result.returncode == 0, result.stderr
    assert "skipped the dead letter at sequence 2" in result.stdout
    await async_wait_until(lambda: any((s.key, s.sequence) == ("a", 3) for s in app.seen), "a#3 after the unblock")
    delivered_a = [s.sequence for s in app.seen if s.key == "a"]
    assert delivered_a == [1, 2, 2, 3], "a#2 was delivered again, or a#3 out of order"

    # discard c's dead letter with a note: one log record, and c stays blocked.
    result = await command(scenario, "dead-letters", "discard", *dl, "--key", "c", "--note", "c cancelled by support")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    [record] = [r for r in records if r.get("event") == "dead_letter_discarded"]
    assert (record["key"], record["position"], record["note"]) == ("c", 1, "c cancelled by support")
    assert [row["key"] for row in rows(await command(scenario, "dead-letters", "list", *dl, "--json"))] == ["a"]
    response = await get_status(sidecar.grpc, "orders", max_keys=10)
    assert [k.key for k in response.subscriptions[0].keys_detail if k.state == "blocked_dead_letter"] == ["c"]

    # kill -9 and restart: the unblock was durable (a goes on), c is still blocked.
    sidecar.kill9()
    restarted = await scenario.start_sidecar()
    data, attributes = order_message("a", 4)
    await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: any((s.key, s.sequence) == ("a", 4) for s in app.seen), "a#4 after the restart")
    response = await get_status(restarted.grpc, "orders", max_keys=10)
    [c_status] = [k for k in response.subscriptions[0].keys_detail if k.key == "c"]
    assert (c_status.state, c_status.blocked_sequence) == ("blocked_dead_letter", 1)
    assert not any((s.key, s.sequence) == ("c", 2) for s in app.seen)
