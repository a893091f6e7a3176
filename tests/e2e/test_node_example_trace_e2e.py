"""End to end, the Node.js example (examples/node/) prints each message's trace context: the
``traceparent`` the sidecar delivers, loaded from proto/ at run time like every other field."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest
from conftest import Scenario
from e2e_config import order_message
from node_example import NODE_MISSING, NodeApp, install

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("node") is None, reason=NODE_MISSING),
]

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def node_app(scenario: Scenario) -> Iterator[list[NodeApp]]:
    install()
    apps: list[NodeApp] = []
    try:
        yield apps
    finally:
        for app in apps:
            print(f"---- node app ----\n{app.describe()}")
            app.stop()


async def test_the_node_app_prints_the_traceparent_it_got(scenario: Scenario, node_app: list[NodeApp]) -> None:
    sub = scenario.add_subscription("orders")
    await scenario.start_sidecar()
    app = NodeApp(scenario.listen, sub.name)
    node_app.append(app)

    await scenario.pubsub.publish_all(
        sub.topic, [order_message("o", 1, traceparent=TRACEPARENT), order_message("o", 2)]
    )

    await asyncio.to_thread(app.wait_for_count, 2)
    assert [(m["sequence"], m["traceparent"]) for m in app.messages] == [("1", TRACEPARENT), ("2", "")]
