"""End to end, the Node.js example app (examples/node/) against the emulators and a real sidecar.

The app is the user's code in another language: it loads proto/ at run time with @grpc/proto-loader,
so these tests also prove the proto works outside Python. Skipped only where `node` is missing.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_waits import async_wait_until
from node_example import NODE_MISSING, NodeApp, install

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("node") is None, reason=NODE_MISSING),
]

EXIT_SECONDS = 15.0
"""SIGTERM to exit: the app waits at most 2 s for confirmations; the rest is a loaded machine's slack."""


@pytest.fixture(scope="module")
def node_installed() -> None:
    install()


@pytest.fixture
def node_apps() -> Iterator[list[NodeApp]]:
    apps: list[NodeApp] = []
    try:
        yield apps
    finally:
        for app in apps:
            print(f"---- node app ----\n{app.describe()}")
            app.stop()


def start_node(apps: list[NodeApp], target: str, subscription: str) -> NodeApp:
    app = NodeApp(target, subscription)
    apps.append(app)
    return app


async def test_node_app_prints_in_order_acks_reconnects_after_a_restart_and_stops_on_sigterm(
    scenario: Scenario, node_installed: None, node_apps: list[NodeApp]
) -> None:
    sub = scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar()
    app = start_node(node_apps, scenario.listen, sub.name)
    # Out of order, with a publisher retry of #2.
    for seq in (3, 1, 2, 2):
        data, attributes = order_message("order-1", seq)
        await scenario.pubsub.publish(sub.topic, data, **attributes)

    await asyncio.to_thread(app.wait_for_count, 3)
    assert app.sequences("order-1") == [1, 2, 3]
    assert [m["data"] for m in app.messages] == ["order-1#1", "order-1#2", "order-1#3"]
    assert all(m["delivery_attempt"] == 1 and not m["redelivered"] for m in app.messages)
    # The app's acks are durable in the sidecar (acked_total counts acks made durable).
    await async_wait_until(lambda: sidecar.metric("pubsub_sidecar_acked_total", subscription=sub.name) == 3, "3 acks")

    # The sidecar dies and comes back on the same socket: the app reconnects on its own.
    sidecar.kill9()
    await asyncio.to_thread(app.wait_for_stderr, "is not serving subscription 'orders'")
    sidecar.start(wait_ready=False)
    await sidecar.async_wait_ready()
    for seq in (5, 4):
        data, attributes = order_message("order-1", seq)
        await scenario.pubsub.publish(sub.topic, data, **attributes)
    await asyncio.to_thread(app.wait_for_count, 5)
    # Confirmed acks are never delivered again: exactly 1..5, each once.
    assert app.sequences("order-1") == [1, 2, 3, 4, 5]
    await asyncio.to_thread(app.wait_for_stderr, "serves subscription 'orders' again")
    await async_wait_until(lambda: sidecar.metric("pubsub_sidecar_acked_total", subscription=sub.name) == 2, "2 acks")

    app.terminate()
    assert await asyncio.to_thread(app.wait_exit, EXIT_SECONDS) == 0
    assert app.stderr_lines[-2:] == ["subscriber: SIGTERM: stopping", "subscriber: stopped"]
    assert not any(line.startswith("subscriber: error") for line in app.stderr_lines)


async def test_node_app_refused_for_an_unknown_subscription_prints_one_error_line_and_exits_2(
    scenario: Scenario, node_installed: None, node_apps: list[NodeApp]
) -> None:
    scenario.add_subscription("orders")
    await scenario.start_sidecar()
    app = start_node(node_apps, scenario.listen, "no-such-subscription")

    assert await asyncio.to_thread(app.wait_exit, EXIT_SECONDS) == 2
    assert app.stderr_lines == [
        f"subscriber: error: sidecar at {scenario.listen} refused subscription 'no-such-subscription': "
        "NOT_FOUND: unknown subscription 'no-such-subscription'; this sidecar serves: orders"
    ]
    assert app.messages == []


async def test_node_app_started_before_the_sidecar_waits_with_one_line_then_reads(
    scenario: Scenario, node_installed: None, node_apps: list[NodeApp]
) -> None:
    sub = scenario.add_subscription("orders")
    app = start_node(node_apps, scenario.listen, sub.name)
    await asyncio.to_thread(app.wait_for_stderr, "is not serving subscription 'orders'")
    data, attributes = order_message("order-9", 1)
    await scenario.pubsub.publish(sub.topic, data, **attributes)

    await scenario.start_sidecar()
    await asyncio.to_thread(app.wait_for_count, 1)
    assert app.sequences("order-9") == [1]
    waiting = [line for line in app.stderr_lines if "is not serving" in line]
    # Each distinct reason once (no socket yet; then, maybe, "still recovering"), never once per attempt.
    assert len(waiting) == len(set(waiting)) <= 3, app.stderr_lines
    assert app.returncode is None
