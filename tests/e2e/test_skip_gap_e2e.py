"""End to end: a key stuck on a gap (no ``gap_timeout``) is named by ``pubsub-sidecar status`` with the
``skip-gap`` command that frees it; that command, run as a process, skips the gap durably: the key
goes on in order, and after ``kill -9`` and a restart the skip still holds (nothing delivered again,
the skipped sequence published late goes to the dead-letter topic as ``late``).

A real sidecar process, the emulators, Google's unmodified clients; the operator's commands are the
installed ``pubsub-sidecar`` console script."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_processes import _python_env
from e2e_waits import async_poll, async_wait_until

pytestmark = pytest.mark.e2e

_COMMAND = Path(sys.executable).parent / "pubsub-sidecar"


async def command(scenario: Scenario, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = _python_env(scenario.emulators.env)
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=120)


def sequences(seen: list[object], key: str) -> list[int]:
    return [s.sequence for s in seen if s.key == key]  # type: ignore[attr-defined]


async def test_status_names_skip_gap_which_frees_the_key_durably_across_a_kill9(scenario: Scenario) -> None:
    sub = scenario.add_subscription("orders")
    assert sub.dead_letter_subscription is not None
    sidecar = await scenario.start_sidecar()
    app = scenario.app(sub)
    for seq in (1, 2, 4, 5):
        data, attributes = order_message("k", seq)
        await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: sequences(app.seen, "k") == [1, 2], "1 and 2 delivered")
    # A skip is refused while the acks before the gap are not durable ("retry once they are"):
    # the operator's command comes once the app's acks of 1 and 2 are confirmed.
    await async_wait_until(
        lambda: {("k", 1), ("k", 2)} <= {(key, seq) for key, seq, _ in app.confirmed_at}, "1 and 2 acked durably"
    )

    async def free_with() -> str | None:
        result = await command(scenario, [str(_COMMAND), "status", "--target", sidecar.grpc, "--json"])
        assert result.returncode == 0, result.stderr
        (orders,) = json.loads(result.stdout)["subscriptions"]
        key = next((k for k in orders["keys_detail"] if k["key"] == "k" and k["state"] == "waiting_sequence"), None)
        return key["free_with"] if key is not None else None

    line = await async_poll(free_with, "status to name the command that frees k")
    assert (
        line
        == f"pubsub-sidecar skip-gap --target {shlex.quote(sidecar.grpc)} --subscription orders --key k --through 3"
    )
    assert sequences(app.seen, "k") == [1, 2]  # still stuck: nothing skips it but the operator

    argv = shlex.split(line)
    result = await command(scenario, [str(_COMMAND), *argv[1:]])
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "skipped the gap of key 'k' of subscription 'orders': missing sequence 3 passed over\n"
    await async_wait_until(
        lambda: {("k", 4), ("k", 5)} <= {(key, seq) for key, seq, _ in app.confirmed_at}, "4 and 5 acked durably"
    )
    assert sequences(app.seen, "k") == [1, 2, 4, 5]
    assert [s.skipped for s in app.seen if s.key == "k"][2] == ((3, 3),)

    # kill -9 and a restart: the skip was durable. 3 arriving now is late; 6 is next in order.
    sidecar.kill9()
    await scenario.start_sidecar()
    data, attributes = order_message("k", 3)
    await scenario.pubsub.publish(sub.topic, data, **attributes)
    (dead,) = await scenario.pubsub.pull_until(sub.dead_letter_subscription, 1, "3 on the dead-letter topic", 120)
    assert (dead.data, dead.attributes["sidecar_reason"]) == (b"k#3", "late")
    data, attributes = order_message("k", 6)
    await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: 6 in sequences(app.seen, "k"), "6 after the restart", 120)
    assert sequences(app.seen, "k") == [1, 2, 4, 5, 6]  # nothing delivered again, 3 never
