"""The Node.js outbox example (examples/node-outbox/, @google-cloud/firestore from its lockfile) as a
real process against the Firestore emulator, with a relay publishing what it wrote: order 456's
OrderCreated and OrderCancelled arrive numbered 1 and 2, in the order the app committed them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from npm_install import npm_ci
from test_relay_emulators import Pods, Received, make_topic, relay_config, running, until

from sidecar.emulators.stack import EmulatorStack

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node-outbox"
NODE_MISSING = "`node` is not on PATH: the Node.js outbox example's test needs Node.js >= 18 and npm"

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason=NODE_MISSING)


@pytest.fixture(scope="module")
def installed() -> None:
    """``npm ci`` from the committed lockfile, once per module."""
    npm_ci(EXAMPLE_DIR)


async def test_the_node_app_writes_entries_the_relay_publishes_in_order(
    installed: None, stack: EmulatorStack, project: str
) -> None:
    topic, subscription = make_topic(project)
    pods = Pods(project, relay_config(topic))
    pods.add("pod-a")
    received = Received(subscription)
    try:
        async with running(pods.relays):
            node = await asyncio.create_subprocess_exec(
                shutil.which("node") or "node",
                "checkout.js",
                "--project",
                project,
                "--order",
                "456",
                cwd=EXAMPLE_DIR,
                env={**os.environ, **stack.env},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(node.communicate(), 120)
            assert node.returncode == 0, err.decode()
            written = [json.loads(line)["event"] for line in out.decode().splitlines()]
            assert written == ["OrderCreated", "OrderCancelled"]

            async def both_published() -> bool:
                await asyncio.get_running_loop().run_in_executor(None, received.pull)
                return len(received.by_number()) == 2

            await until("the Node app's two events published", both_published)
        events = {seq: json.loads(data)["type"] for (key, seq), data in received.by_number().items() if key == "456"}
        assert events == {1: "OrderCreated", 2: "OrderCancelled"}
    finally:
        received.close()
        await pods.close()
