"""The in-process EmulatorStack: real ports, admin routes, clean start failure and stop, in a loop or a thread."""

from __future__ import annotations

import json
import threading
import urllib.request

import aiohttp
import grpc
import pytest

from sidecar.emulators.stack import EmulatorStack

pytestmark = pytest.mark.timeout(60)


async def test_stack_binds_real_ports_and_serves_admin_routes() -> None:
    async with EmulatorStack(metric_period=1, metric_delay=0) as stack:
        for host in (stack.pubsub_host, stack.monitoring_host):
            assert not host.endswith(":0")
            async with grpc.aio.insecure_channel(host) as channel:
                await channel.channel_ready()
        assert stack.env["PUBSUB_EMULATOR_HOST"] == stack.pubsub_host
        assert stack.env["MONITORING_EMULATOR_HOST"] == stack.monitoring_host
        assert "pubsub" in stack.injector.stream_breakers
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{stack.admin_url}/healthz") as response:
                assert response.status == 200
            async with session.post(f"{stack.admin_url}/pubsub/delay", json={"seconds": 2}) as response:
                assert response.status == 200
        assert stack.pubsub is not None and stack.pubsub.broker.delivery_delay_seconds == {"*": 2.0}
    assert "pubsub" not in stack.injector.stream_breakers
    await stack.stop()  # idempotent


async def test_port_in_use_fails_start_and_releases_what_was_started() -> None:
    async with EmulatorStack() as first:
        taken = int(first.monitoring_host.rsplit(":", 1)[1])
        second = EmulatorStack(monitoring_port=taken)
        with pytest.raises(OSError, match="monitoring"):
            await second.start()
        assert second.pubsub is not None
        assert "pubsub" not in second.injector.stream_breakers, "the half-started stack was cleaned up"


def test_stack_in_its_own_thread_serves_sync_callers() -> None:
    # Other folders' session fixtures may run stacks of their own in threads of the same name.
    before = {t for t in threading.enumerate() if t.name == "emulators"}
    stack = EmulatorStack()
    stack.start_in_thread()
    ours = {t for t in threading.enumerate() if t.name == "emulators"} - before
    assert len(ours) == 1
    try:
        with urllib.request.urlopen(f"{stack.admin_url}/healthz", timeout=10) as response:
            assert json.loads(response.read()) == {"status": "ok"}
        with grpc.insecure_channel(stack.pubsub_host) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
    finally:
        stack.stop_thread()
    assert not any(t.is_alive() for t in ours), "stop_thread joined the stack's thread"
