"""A real delivery layer (grpc.aio server on port 0) over ``MemoryStore`` whose subscription ``orders``
(sequence mode, no gap timeout) has key ``a`` stuck on a gap: 1 and 2 were delivered and acked
durably, 4 and 5 are held, 3 is missing. Shared by the SkipGap RPC's tests and the command's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from incoming_messages import sequence_message

from sidecar.delivery.server import GrpcServer
from sidecar.engine.types import EngineConfig, Message
from sidecar.pipeline.runtime import SubscriptionRuntime, wall_clock_ms
from sidecar.store.api import PersistOutcome
from sidecar.store.memory import MemoryStore


@dataclass
class Sink:
    """The dead-letter topic: what was published, with its reason."""

    published: list[tuple[int | None, str]] = field(default_factory=list)

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        self.published.append((message.sequence, reason))


@dataclass
class GapSidecar:
    address: str
    runtime: SubscriptionRuntime
    store: MemoryStore
    sink: Sink

    async def store_and_hand(self, *seqs: int) -> None:
        results = await self.store.persist("orders", [sequence_message("a", s) for s in seqs], wall_clock_ms())
        assert {r.outcome for r in results} == {PersistOutcome.STORED}
        self.runtime.on_stored([r.message for r in results])

    async def take_and_ack(self) -> list[int | None]:
        """Sequences taken now, each acked durably."""
        taken = self.runtime.take("app", 10)
        if taken:
            result = await self.runtime.ack("app", [d.delivery_id for d in taken])
            assert sorted(result.confirmed) == sorted(d.delivery_id for d in taken)
        return [d.message.sequence for d in taken]


async def until(predicate: Callable[[], object], what: str, seconds: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def gap_sidecar(**config: object) -> AsyncIterator[GapSidecar]:
    store = MemoryStore()
    sink = Sink()
    runtime = SubscriptionRuntime("orders", EngineConfig(mode="sequence", **config), store, sink)  # type: ignore[arg-type]
    server = GrpcServer({"orders": runtime}, "127.0.0.1:0")
    try:
        await runtime.recover()
        await runtime.loaded()
        await runtime.start()
        address = await server.start()
        await server.set_serving()
        sidecar = GapSidecar(address, runtime, store, sink)
        await sidecar.store_and_hand(1, 2, 4, 5)
        assert await sidecar.take_and_ack() == [1]
        assert await sidecar.take_and_ack() == [2]
        assert sidecar.runtime.take("app", 10) == []
        (key,) = runtime.status()[1]
        assert (key.state, key.missing_sequence, key.last_missing_sequence) == ("waiting_sequence", 3, 3)
        yield sidecar
    finally:
        await server.stop(0)
        await runtime.stop(0)
