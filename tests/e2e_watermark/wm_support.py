"""Helpers for the watermark-mode end-to-end tests: real emulators and sidecar processes.

The processes and the app client come from ``tests/e2e/e2e_*.py`` (imported, not copied: their
directory is put on ``sys.path`` here). The emulators run with the short metric period and
delay of the brief (1 s sampling, 2 s visibility), so the watermark meets the same kind of lag it
meets in production, only a minute shorter. Each test gets its own topics, subscriptions, Firestore
root and sidecar, and everything it starts is stopped by the ``scenario`` fixture, also on failure.

``Recorder`` is the app's side: it keeps, per delivery, the event time and the ``late`` flag that
the generic harness app does not, and ``StatusSampler`` keeps the watermark that GetStatus reports
over time, so a test can compare each delivery with the watermark at or after it.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

from e2e_app import App
from e2e_config import subscription_entry, write_config
from e2e_google import PubSub
from e2e_processes import EmulatorsProcess, SidecarProcess

from pubsub_sidecar_client import Message, get_status

METRIC_PERIOD_S = 1.0
METRIC_DELAY_S = 2.0
MAX_METRIC_DELAY_S = 4.0
POLL_INTERVAL_S = 0.5


def watermark_ordering(
    timestamp: dict[str, Any], *, safety_margin: str = "0s", on_late: str = "dead_letter"
) -> dict[str, Any]:
    """The ``ordering`` block of a watermark subscription with the brief's short timings."""
    return {
        "key": {"attribute": "key"},
        "timestamp": timestamp,
        "watermark": {
            "poll_interval": f"{int(POLL_INTERVAL_S * 1000)}ms",
            "safety_margin": safety_margin,
            "max_metric_delay": f"{int(MAX_METRIC_DELAY_S)}s",
        },
        "on_late": on_late,
    }


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message as the app saw it, with the wall clock (ms) and monotonic time of arrival."""

    key: str
    event_ms: int
    dedup_id: str
    message_id: str
    data: bytes
    late: bool
    delivery_attempt: int
    publish_ms: int
    wall_ms: int
    at: float

    @property
    def position(self) -> tuple[int, str]:
        return (self.event_ms, self.dedup_id)


def _ms(value: Any) -> int:
    return int(value.timestamp() * 1000)


class Recorder:
    """The app's decision callback: records every delivery, acks it (or holds it when told)."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.hold = False

    def __call__(self, message: Message) -> str:
        assert message.event_time is not None, f"watermark mode delivered {message.dedup_id} without event_time"
        assert message.publish_time is not None
        self.deliveries.append(
            Delivery(
                key=message.key,
                event_ms=_ms(message.event_time),
                dedup_id=message.dedup_id,
                message_id=message.message_id,
                data=message.data,
                late=message.late,
                delivery_attempt=message.delivery_attempt,
                publish_ms=_ms(message.publish_time),
                wall_ms=time.time_ns() // 1_000_000,
                at=time.monotonic(),
            )
        )
        return "hold" if self.hold else "ack"

    def data(self) -> set[bytes]:
        return {d.data for d in self.deliveries}

    def by_key(self) -> dict[str, list[Delivery]]:
        keys: dict[str, list[Delivery]] = defaultdict(list)
        for delivery in self.deliveries:
            keys[delivery.key].append(delivery)
        return keys


class StatusSampler:
    """Polls GetStatus for one subscription and keeps ``(monotonic time, watermark ms)`` samples."""

    def __init__(self, target: str, subscription: str, interval: float = 0.1) -> None:
        self.target = target
        self.subscription = subscription
        self.interval = interval
        self.samples: list[tuple[float, int | None]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> StatusSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def sample(self) -> int | None:
        response = await get_status(self.target, self.subscription, timeout_seconds=5.0)
        (status,) = response.subscriptions
        watermark = status.watermark.ToMilliseconds() if status.HasField("watermark") else None
        self.samples.append((time.monotonic(), watermark))
        return watermark

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception:
                pass
            await asyncio.sleep(self.interval)

    def watermark_after(self, at: float) -> int | None:
        """The first watermark sampled at or after monotonic time ``at`` (None if none yet)."""
        for when, watermark in self.samples:
            if when >= at and watermark is not None:
                return watermark
        return None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


@dataclass
class Sub:
    name: str
    topic: str
    subscription: str
    dead_letter_topic: str
    dead_letter_subscription: str


class Scenario:
    """One test's world: watermark subscriptions, the config, sidecar processes, apps, samplers."""

    def __init__(self, emulators: EmulatorsProcess, pubsub: PubSub) -> None:
        self.emulators = emulators
        self.pubsub = pubsub
        # A Unix socket (not port 0) keeps the address stable across the kill -9 test's restart.
        self.workdir = Path(tempfile.mkdtemp(prefix="e2ewm-", dir="/tmp"))
        self.listen = f"unix://{self.workdir}/sidecar.sock"
        self.root = f"e2ewm-{uuid.uuid4().hex[:10]}"
        self.entries: list[dict[str, Any]] = []
        self.sidecars: list[SidecarProcess] = []
        self.apps: list[App] = []
        self.samplers: list[StatusSampler] = []

    def add_subscription(self, name: str, ordering: dict[str, Any]) -> Sub:
        topic = self.pubsub.topic(name)
        subscription = self.pubsub.subscription(topic)
        dl_topic = self.pubsub.topic(f"{name}-dl")
        dl_subscription = self.pubsub.subscription(dl_topic)
        self.entries.append(
            subscription_entry(name, subscription, mode="watermark", dead_letter_topic=dl_topic, ordering=ordering)
        )
        return Sub(name, topic, subscription, dl_topic, dl_subscription)

    async def start_sidecar(self) -> SidecarProcess:
        config = write_config(
            self.workdir / "sidecar.yaml", listen=self.listen, root=self.root, subscriptions=self.entries
        )
        process = SidecarProcess(config, dict(self.emulators.env))
        self.sidecars.append(process)
        process.start(wait_ready=False)
        await process.async_wait_ready()
        return process

    def app(self, sub: Sub, recorder: Recorder) -> App:
        app = App(self.listen, sub.name, recorder).start()
        self.apps.append(app)
        return app

    def sampler(self, sub: Sub) -> StatusSampler:
        sampler = StatusSampler(self.listen, sub.name).start()
        self.samplers.append(sampler)
        return sampler

    async def close(self) -> None:
        for sampler in self.samplers:
            await sampler.stop()
        for app in self.apps:
            await app.stop()
        for process in self.sidecars:
            process.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
