"""Harness for the ingest tests: one subscription wired as in the sidecar.

The pieces under test are real: the official Pub/Sub clients against the Pub/Sub emulator, the
``Ingestor``, the ``DeadLetterPublisher`` and a ``SubscriptionRuntime`` over a ``MemoryStore``.
Everything a harness starts is stopped by ``close()`` (the fixtures call it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from pubsub_admin import WAIT_SECONDS, PubSubAdmin

from sidecar.config.model import SubscriptionConfig
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.engine.types import Message
from sidecar.pipeline.ingest import Ingestor
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.store.memory import MemoryStore


def make_sub_config(
    name: str,
    subscription: str,
    *,
    mode: str,
    dead_letter_topic: str | None,
    max_undelivered_messages: int | None,
    max_outstanding_messages: int,
    fast_path: bool = True,
    intake: str = "stream",
) -> SubscriptionConfig:
    ordering: dict[str, Any] = {"mode": mode}
    if mode == "sequence":
        ordering["key"] = {"attribute": "order_id"}
        ordering["sequence"] = {"attribute": "seq", "start": 1}
        ordering["fast_path"] = fast_path
    body: dict[str, Any] = {
        "name": name,
        "subscription": subscription,
        "ordering": ordering,
        "dead_letter_topic": dead_letter_topic,
        "intake": intake,
        "flow_control": {
            "max_undelivered_messages": max_undelivered_messages,
            "max_outstanding_messages": max_outstanding_messages,
            "max_outstanding_bytes": 10 * 1024 * 1024,
        },
    }
    return SubscriptionConfig.model_validate(body)


class IngestHarness:
    """One subscription wired as in the sidecar: Ingestor -> MemoryStore -> SubscriptionRuntime."""

    def __init__(
        self,
        admin: PubSubAdmin,
        *,
        mode: str = "sequence",
        with_dead_letter_topic: bool = True,
        max_undelivered_messages: int | None = None,
        max_outstanding_messages: int = 100,
        name: str = "orders",
        config_fast_path: bool = True,
        intake: str = "stream",
        **ingestor_kwargs: Any,
    ) -> None:
        self._config_fast_path = config_fast_path
        self.intake = intake
        """``stream`` (the sidecar's own StreamingPull) or ``client`` (the official subscriber's)."""
        self.admin = admin
        self.mode = mode
        self.name = name
        self._with_dead_letter_topic = with_dead_letter_topic
        self._max_undelivered = max_undelivered_messages
        self._max_outstanding = max_outstanding_messages
        # The persist path by default; the in-order fast path is tested where asked for.
        self._ingestor_kwargs = {
            "backoff_initial_seconds": 0.05,
            "backoff_maximum_seconds": 0.5,
            "fast_path": False,
            **ingestor_kwargs,
        }
        self.store = MemoryStore()
        self.topic = ""
        self.subscription = ""
        self.dead_letter_topic: str | None = None
        self.dead_letter_subscription = ""
        self.runtime: SubscriptionRuntime | None = None
        self.dead_letters: DeadLetterPublisher | None = None
        self.config: SubscriptionConfig | None = None
        self.ingestor: Ingestor | None = None
        self.run_task: asyncio.Task[None] | None = None
        self._ingestors: list[Ingestor] = []
        self._run_tasks: list[asyncio.Task[None]] = []

    async def start(self) -> IngestHarness:
        await self.setup()
        await self.start_ingest()
        return self

    async def setup(self, *, create_subscription: bool = True) -> None:
        """Topics, subscriptions, dead-letter publisher and a recovered runtime; no ingest yet."""
        self.topic = await self.admin.create_topic(self.name)
        if create_subscription:
            self.subscription = await self.admin.create_subscription(self.name, self.topic)
        else:
            self.subscription = self.admin.subscription_path(self.name)
        if self._with_dead_letter_topic:
            self.dead_letter_topic = await self.admin.create_topic(f"{self.name}-dl")
            self.dead_letter_subscription = await self.admin.create_subscription(
                f"{self.name}-dl", self.dead_letter_topic
            )
        self.config = make_sub_config(
            self.name,
            self.subscription,
            mode=self.mode,
            dead_letter_topic=self.dead_letter_topic,
            max_undelivered_messages=self._max_undelivered,
            max_outstanding_messages=self._max_outstanding,
            fast_path=self._config_fast_path,
            intake=self.intake,
        )
        self.dead_letters = DeadLetterPublisher({self.name: self.dead_letter_topic})
        self.runtime = SubscriptionRuntime(self.name, self.config.engine_config(), self.store, self.dead_letters)
        await self.runtime.recover()
        await self.runtime.loaded()
        await self.runtime.start()

    async def start_ingest(self) -> None:
        """A new Ingestor (the previous one, if any, must have stopped) and its run() task."""
        assert self.config is not None and self.runtime is not None and self.dead_letters is not None
        ingestor = Ingestor(self.config, self.store, self.runtime, self.dead_letters, **self._ingestor_kwargs)
        self._ingestors.append(ingestor)
        self.ingestor = ingestor
        await ingestor.start()
        self.run_task = asyncio.create_task(ingestor.run())
        self._run_tasks.append(self.run_task)

    async def stop_ingest(self) -> None:
        """Stop pulling (as the sidecar does first on SIGTERM); run() then returns."""
        if self.ingestor is not None:
            await self.ingestor.stop(grace_seconds=5.0)
        if self.run_task is not None:
            await asyncio.wait_for(self.run_task, WAIT_SECONDS)

    async def close(self) -> None:
        for ingestor in self._ingestors:
            try:
                await ingestor.stop(grace_seconds=1.0)
            except Exception:
                pass  # reported by the test that made it fail; cleanup goes on
        for task in self._run_tasks:
            if not task.done():
                task.cancel()
            try:
                await task
            except BaseException:
                pass
        if self.runtime is not None:
            await self.runtime.stop(grace_seconds=1.0)
        if self.dead_letters is not None:
            await self.dead_letters.aclose()
        await self.store.close()

    # ---- helpers for tests -----------------------------------------------------------------

    @property
    def counters(self) -> Any:
        assert self.ingestor is not None
        return self.ingestor.counters

    async def stored_pending(self) -> list[Message]:
        """Messages the store holds and that are not finished (acked, dead-lettered, dropped)."""
        snapshot = await self.store.load(self.name, 0)
        return list(snapshot.pending)

    async def publish_order(self, key: str, seq: int | str, data: bytes | None = None, **extra: str) -> str:
        return await asyncio.wrap_future(self.submit_order(key, seq, data, **extra))

    def submit_order(
        self, key: str, seq: int | str, data: bytes | None = None, **extra: str
    ) -> concurrent.futures.Future[str]:
        """Hand a message to the publisher client without yielding to the loop (for a test that keeps
        the loop busy while the client's threads publish and receive it); its future gives the id."""
        payload = data if data is not None else f"{key}:{seq}".encode()
        future: concurrent.futures.Future[str] = self.admin.publisher.publish(
            self.topic, payload, order_id=key, seq=str(seq), **extra
        )
        return future


async def assert_subscription_empty(h: IngestHarness) -> None:
    """Nothing is left for Pub/Sub to redeliver: every message was acked.

    The ingestor holds nothing, then stops (which would nack anything held, making it available);
    a unary Pull then finds nothing.
    """
    assert h.ingestor is not None and h.ingestor.held_messages == 0
    await h.stop_ingest()
    assert await h.admin.pull_available(h.subscription) == []
