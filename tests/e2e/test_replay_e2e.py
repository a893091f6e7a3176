"""End to end: dead letters replayed after the fix, a replay killed between its publish and its ack.

A real sidecar process and the emulators; the operator's commands run as processes
(``python -m sidecar dead-letters ...``) with the official Pub/Sub client inside. Subscription
``orders`` blocks a key at a dead letter, ``skips`` goes on past it and delivers replays flagged
(``on_replay_behind: deliver_flagged``). The app fails ``a#2``, ``b#2`` and ``c#1`` until they
are "fixed".
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from typing import Any

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_processes import _python_env
from e2e_waits import async_poll, async_wait_until

from pubsub_sidecar_client import Message, get_status

pytestmark = pytest.mark.e2e


async def command(scenario: Scenario, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sidecar", *argv],
        env=_python_env({**scenario.emulators.env, **env}),
        capture_output=True,
        text=True,
        timeout=120,
    )


def rows(result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


class FlakyApp:
    """Fails the messages in ``broken`` until they are fixed; records what it saw (with ``replayed``)."""

    def __init__(self, broken: set[tuple[str, int]]) -> None:
        self.broken = broken
        self.seen: list[tuple[str, int, bool, bool]] = []
        """(key, sequence, replayed flag, carries a replay marker)."""

    def __call__(self, message: Message) -> str:
        self.seen.append((message.key, message.sequence, message.replayed, "sidecar_replay_id" in message.attributes))
        return "nack" if (message.key, message.sequence) in self.broken else "ack"

    def of(self, key: str) -> list[tuple[int, bool, bool]]:
        return [(seq, flagged, marked) for k, seq, flagged, marked in self.seen if k == key]


async def test_replay_after_the_fix_delivers_in_order_flags_a_skipped_one_and_survives_kill_9(
    scenario: Scenario,
) -> None:
    orders = scenario.add_subscription("orders", delivery={"max_delivery_attempts": 2, "on_dead_letter": "block"})
    skips = scenario.add_subscription(
        "skips",
        delivery={"max_delivery_attempts": 2, "on_dead_letter": "skip", "on_replay_behind": "deliver_flagged"},
    )
    assert orders.dead_letter_subscription and skips.dead_letter_subscription
    dl_orders = ("--dead-letter-subscription", orders.dead_letter_subscription)
    dl_skips = ("--dead-letter-subscription", skips.dead_letter_subscription)
    sidecar = await scenario.start_sidecar()
    app = FlakyApp({("a", 2), ("b", 2), ("c", 1)})
    scenario.app(orders, app)
    scenario.app(skips, app)
    for key, seq in (("a", 1), ("a", 2), ("a", 3), ("c", 1), ("c", 2)):
        await publish(scenario, orders.topic, key, seq)
    for seq in (1, 2, 3):
        await publish(scenario, skips.topic, "b", seq)
    foreign_id = await scenario.pubsub.publish(orders.dead_letter_topic or "", b"not ours", origin="elsewhere")

    # list: a#2 and c#1 wait (a and c blocked), b#2 waits (b went on), the foreign one is listed as such.
    async def listed(dl: tuple[str, str], count: int) -> list[dict[str, Any]] | None:
        found = rows(await command(scenario, "dead-letters", "list", *dl, "--json"))
        return found if len(found) == count else None

    waiting = {(r["key"], r["position"], r["reason"]) for r in await async_poll(lambda: listed(dl_orders, 3), "3")}
    assert waiting == {("a", 2, "max_delivery_attempts"), ("c", 1, "max_delivery_attempts"), (None, None, "foreign")}
    (b_row,) = await async_poll(lambda: listed(dl_skips, 1), "b's dead letter")
    assert (b_row["key"], b_row["position"]) == ("b", 2)
    await async_wait_until(lambda: (3, False, False) in app.of("b"), "b#3 delivered past the skipped b#2")
    assert app.of("a") == [(1, False, False), (2, False, False), (2, False, False)], "a#3 waits behind a#2"

    # Bad input: nothing matches (exit 0, says so); a dead-letter subscription that does not exist.
    result = await command(scenario, "dead-letters", "replay", *dl_orders, "--key", "zzz")
    assert result.returncode == 0 and "no dead letters match (key 'zzz'); nothing replayed" in result.stdout
    missing = orders.dead_letter_subscription + "-nope"
    result = await command(scenario, "dead-letters", "replay", "--dead-letter-subscription", missing)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "does not exist" in result.stderr

    # The fix, then replay a: a#2 comes back as a's next message, then a#3, in order; a is unblocked.
    app.broken.clear()
    result = await command(scenario, "dead-letters", "replay", *dl_orders, "--key", "a")
    assert result.returncode == 0, result.stderr
    await async_wait_until(lambda: (3, False, False) in app.of("a"), "a#3 after the replay of a#2")
    assert app.of("a")[3:] == [(2, False, True), (3, False, False)], "the replay, in order, unflagged, then a#3"

    # Replay b (its key went past b#2 under skip): delivered flagged `replayed`.
    result = await command(scenario, "dead-letters", "replay", *dl_skips)
    assert result.returncode == 0, result.stderr
    await async_wait_until(lambda: (2, True, True) in app.of("b"), "b#2 replayed, flagged")

    # Replay c, killed after its publish and before its ack (a deterministic hold, then SIGKILL).
    hold = scenario.workdir / "replay-published"
    killed = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "sidecar", "dead-letters", "replay", *dl_orders, "--key", "c", "--lease-seconds", "10"],
        env=_python_env({**scenario.emulators.env, "PUBSUB_SIDECAR_REPLAY_HOLD_AFTER_PUBLISH": str(hold)}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await async_wait_until(hold.exists, "the replay of c#1 published and held before its ack")
    finally:
        killed.send_signal(signal.SIGKILL)
        await asyncio.to_thread(killed.wait, 30)
    await async_wait_until(lambda: (2, False, False) in app.of("c"), "c#1's replay, then c#2")
    duplicates_before = sidecar.metric("pubsub_sidecar_duplicates_total", subscription="orders")
    # Its dead letter comes back once the killed run's lease lapses; the second run replays it again.
    await async_poll(lambda: listed(dl_orders, 2), "c's dead letter back (with the foreign one) after the lease")
    result = await command(scenario, "dead-letters", "replay", *dl_orders, "--key", "c")
    assert result.returncode == 0 and "replayed 1 dead letter(s)" in result.stdout, result.stderr
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_duplicates_total", subscription="orders") > duplicates_before,
        "the second publish of c#1's replay dropped as a duplicate",
    )
    assert app.of("c") == [(1, False, False), (1, False, False), (1, False, True), (2, False, False)], (
        "c#1's replay delivered once across the two runs, in order, then c#2"
    )

    # The foreign message was never replayed; only it is left. And a is durably on: kill -9, restart.
    assert [r["message_id"] for r in rows(await command(scenario, "dead-letters", "list", *dl_orders, "--json"))] == [
        foreign_id
    ]
    sidecar.kill9()
    restarted = await scenario.start_sidecar()
    await publish(scenario, orders.topic, "a", 4)
    await async_wait_until(lambda: (4, False, False) in app.of("a"), "a#4 after the restart")
    response = await get_status(restarted.grpc, "orders", max_keys=10)
    assert not [k.key for k in response.subscriptions[0].keys_detail if k.state == "blocked_dead_letter"]
    assert [s for s, _f, marked in app.of("a") if marked] == [2], "a#2's replay delivered once, not again"


async def publish(scenario: Scenario, topic: str, key: str, seq: int) -> None:
    data, attributes = order_message(key, seq)
    await scenario.pubsub.publish(topic, data, **attributes)
