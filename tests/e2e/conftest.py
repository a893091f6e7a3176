"""Fixtures for the end-to-end tests: one emulators process per session, one scenario per test.

Each test gets its own topics and subscriptions (uuid names), its own Firestore root and its own
sidecar process(es), so tests share the emulators without seeing each other's state. Everything a
scenario starts (apps, sidecars, the socket directory) is stopped by the fixture, also on failure.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e_app import App
from e2e_config import subscription_entry, write_config
from e2e_google import PubSub
from e2e_processes import EmulatorsProcess, SidecarProcess

from pubsub_sidecar_client import Message


@pytest.fixture(scope="session")
def emulators() -> Iterator[EmulatorsProcess]:
    process = EmulatorsProcess(metric_period=1.0, metric_delay=2.0)
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def pubsub(emulators: EmulatorsProcess) -> Iterator[PubSub]:
    client = PubSub(emulators.env)
    try:
        yield client
    finally:
        client.close()


@dataclass
class Sub:
    """One subscription of a scenario: its config name, topic, subscription and dead-letter pair."""

    name: str
    topic: str
    subscription: str
    dead_letter_topic: str | None
    dead_letter_subscription: str | None


class Scenario:
    """One test's world: subscriptions, a config file, the sidecar process and app clients."""

    def __init__(self, emulators: EmulatorsProcess, pubsub: PubSub) -> None:
        self.emulators = emulators
        self.pubsub = pubsub
        # Short path: a Unix socket path is limited to 108 bytes. A socket (not port 0) keeps the
        # sidecar's address stable across the restarts of the crash tests.
        self.workdir = Path(tempfile.mkdtemp(prefix="e2e-", dir="/tmp"))
        self.listen = f"unix://{self.workdir}/sidecar.sock"
        self.root = f"e2e-{uuid.uuid4().hex[:10]}"
        self.subs: list[Sub] = []
        self.entries: list[dict[str, Any]] = []
        self.sidecars: list[SidecarProcess] = []
        self.apps: list[App] = []

    def add_subscription(
        self, name: str, *, dead_letter: bool = True, message_ordering: bool = False, **entry: Any
    ) -> Sub:
        topic = self.pubsub.topic(name)
        subscription = self.pubsub.subscription(topic, enable_message_ordering=message_ordering)
        dl_topic = dl_sub = None
        if dead_letter:
            dl_topic = self.pubsub.topic(f"{name}-dl")
            dl_sub = self.pubsub.subscription(dl_topic)
        sub = Sub(name, topic, subscription, dl_topic, dl_sub)
        self.subs.append(sub)
        self.entries.append(subscription_entry(name, subscription, dead_letter_topic=dl_topic, **entry))
        return sub

    def config_path(self) -> Path:
        path = self.workdir / "sidecar.yaml"
        return write_config(path, listen=self.listen, root=self.root, subscriptions=self.entries)

    def sidecar(self, *, grace_period: float = 10.0) -> SidecarProcess:
        """A sidecar process for this scenario's config, not started."""
        process = SidecarProcess(self.config_path(), dict(self.emulators.env), grace_period=grace_period)
        self.sidecars.append(process)
        return process

    async def start_sidecar(self, *, grace_period: float = 10.0) -> SidecarProcess:
        process = self.sidecar(grace_period=grace_period)
        process.start(wait_ready=False)
        await process.async_wait_ready()
        return process

    def app(self, sub: Sub, decide: Callable[[Message], str] | None = None, **kwargs: Any) -> App:
        app = App(self.listen, sub.name, decide, **kwargs).start()
        self.apps.append(app)
        return app

    # ---- several pods on one subscription: one sidecar and one app per pod ----------------------

    def pod_listen(self, pod: int) -> str:
        return f"unix://{self.workdir}/pod{pod}.sock"

    def pod_sidecar(self, pod: int, *, grace_period: float = 10.0) -> SidecarProcess:
        """Pod ``pod``'s sidecar (same config, its own gRPC socket), not started."""
        path = write_config(
            self.workdir / f"pod{pod}.yaml", listen=self.pod_listen(pod), root=self.root, subscriptions=self.entries
        )
        env = {**self.emulators.env, "POD_NAME": f"pod-{pod}"}
        process = SidecarProcess(path, env, grace_period=grace_period)
        self.sidecars.append(process)
        return process

    def pod_app(self, sub: Sub, pod: int, decide: Callable[[Message], str] | None = None, **kwargs: Any) -> App:
        app = App(self.pod_listen(pod), sub.name, decide, **kwargs).start()
        self.apps.append(app)
        return app

    async def close(self) -> None:
        for app in self.apps:
            print(f"---- app of {app.subscription}: {len(app.seen)} seen, {len(app.confirmed_at)} confirmed")
            await app.stop()
        for index, process in enumerate(self.sidecars):
            if process.returncode is None:
                status, body = process.http_get("/metrics")
                samples = [line for line in body.splitlines() if line.startswith("pubsub_sidecar_")]
                print(f"---- sidecar {index} /metrics ({status}):\n" + "\n".join(samples))
            process.stop()
            # Captured by pytest and shown only when the test fails.
            print(f"---- sidecar {index} (last lines) ----\n{process.output_tail(80)}")
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
async def scenario(emulators: EmulatorsProcess, pubsub: PubSub) -> AsyncIterator[Scenario]:
    world = Scenario(emulators, pubsub)
    try:
        yield world
    finally:
        emulators.clear_faults()
        await world.close()
