"""Component-test harness for the delivery layer: MemoryStore + SubscriptionRuntime + a real grpc.aio server on port 0.

Tests talk to the server through a real channel with the generated stubs (not ``pubsub_sidecar_client``), so
what they check is the wire contract. Everything a test starts is stopped by the fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Iterable, Sequence

import grpc
from google.protobuf import duration_pb2

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.delivery.server import GrpcServer
from sidecar.engine.types import EngineConfig, Message
from sidecar.pipeline.runtime import SubscriptionRuntime, wall_clock_ms
from sidecar.store.api import IncomingMessage, PersistOutcome
from sidecar.store.memory import MemoryStore

WAIT_SECONDS = 15.0
"""Generous: other engineers' test suites share the 2 cores."""


async def wait_until(predicate: Callable[[], bool], what: str, within_seconds: float = WAIT_SECONDS) -> None:
    """Poll with a deadline, for server state that has no event a test could wait on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_seconds
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within_seconds}s waiting for {what}")
        await asyncio.sleep(0.01)


class RecordingDeadLetters:
    """DeadLetterSink that records publishes and can fail the next N of them."""

    def __init__(self) -> None:
        self.published: list[tuple[str, Message, str, int]] = []
        self.failures_left = 0
        self.attempts = 0
        self.changed = asyncio.Event()
        self.refused_keys: set[str] = set()
        """Messages of these keys are refused for ever (a topic that keeps rejecting them)."""

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        self.attempts += 1
        if message.key in self.refused_keys:
            raise ConnectionError(f"dead-letter topic refuses key {message.key!r} (injected)")
        if self.failures_left > 0:
            self.failures_left -= 1
            raise ConnectionError("dead-letter topic unreachable (injected)")
        self.published.append((subscription, message, reason, attempts))
        self.changed.set()


class Subscriber:
    """A raw Subscribe stream: a pump task queues every response; writes are serialised."""

    def __init__(self, stub: sidecar_pb2_grpc.OrderedDeliveryStub, *, auto_ack: bool = False) -> None:
        self.call = stub.Subscribe()
        self.auto_ack = auto_ack
        self.responses: asyncio.Queue[sidecar_pb2.SubscribeResponse | None] = asyncio.Queue()
        self.received: list[sidecar_pb2.OrderedMessage] = []
        self.confirmed: list[str] = []
        self._write_lock = asyncio.Lock()
        self._confirmed_event = asyncio.Event()
        self._pump_task = asyncio.create_task(self._pump())
        self.on_message: Callable[[sidecar_pb2.OrderedMessage], None] | None = None

    async def _pump(self) -> None:
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    break
                self.received.extend(response.messages)
                if self.on_message is not None:
                    for message in response.messages:
                        self.on_message(message)
                if response.ack_confirmations:
                    self.confirmed.extend(response.ack_confirmations)
                    self._confirmed_event.set()
                await self.responses.put(response)
                if self.auto_ack and response.messages:
                    await self.ack([m.delivery_id for m in response.messages])
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the RPC ended with an error status: read it from code()
        finally:
            await self.responses.put(None)

    async def write(self, request: sidecar_pb2.SubscribeRequest) -> None:
        async with self._write_lock:
            await self.call.write(request)

    async def open(self, subscription: str, max_outstanding: int = 0) -> Subscriber:
        await self.write(
            sidecar_pb2.SubscribeRequest(
                open=sidecar_pb2.Open(subscription=subscription, max_outstanding_messages=max_outstanding)
            )
        )
        return self

    async def ack(self, delivery_ids: Iterable[str]) -> None:
        await self.write(sidecar_pb2.SubscribeRequest(ack=sidecar_pb2.Ack(delivery_ids=list(delivery_ids))))

    async def nack(
        self, delivery_ids: Iterable[str], *, retry_after_ms: int | None = None, dead_letter: bool = False
    ) -> None:
        nack = sidecar_pb2.Nack(delivery_ids=list(delivery_ids), dead_letter=dead_letter)
        if retry_after_ms is not None:
            retry_after = duration_pb2.Duration()
            retry_after.FromMilliseconds(retry_after_ms)
            nack.retry_after.CopyFrom(retry_after)
        await self.write(sidecar_pb2.SubscribeRequest(nack=nack))

    async def next_messages(self, count: int, within_seconds: float = WAIT_SECONDS) -> list[sidecar_pb2.OrderedMessage]:
        """Wait until ``count`` more messages than already consumed arrived; return them."""
        messages: list[sidecar_pb2.OrderedMessage] = []
        async with asyncio.timeout(within_seconds):
            while len(messages) < count:
                response = await self.responses.get()
                if response is None:
                    raise AssertionError(f"stream ended after {len(messages)} of {count} messages: {await self.code()}")
                messages.extend(response.messages)
        return messages

    async def wait_confirmed(self, delivery_ids: Iterable[str], within_seconds: float = WAIT_SECONDS) -> None:
        wanted = set(delivery_ids)
        async with asyncio.timeout(within_seconds):
            while not wanted <= set(self.confirmed):
                self._confirmed_event.clear()
                await self._confirmed_event.wait()

    async def wait_end(self, within_seconds: float = WAIT_SECONDS) -> tuple[grpc.StatusCode, str]:
        async with asyncio.timeout(within_seconds):
            await asyncio.shield(self._pump_task)
            return await self.code()

    async def code(self) -> tuple[grpc.StatusCode, str]:
        return await self.call.code(), await self.call.details()

    async def close(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump_task


class Harness:
    """Store, runtimes, server, channel: one sidecar delivery layer with no Pub/Sub or Firestore."""

    def __init__(
        self, configs: dict[str, EngineConfig], listen: str = "127.0.0.1:0", max_held_bytes: int | None = None
    ) -> None:
        self.configs = configs
        self.listen = listen
        self.max_held_bytes = max_held_bytes
        self.store = MemoryStore()
        self.dead_letters = RecordingDeadLetters()
        self.runtimes: dict[str, SubscriptionRuntime] = {}
        self.server: GrpcServer | None = None
        self.channel: grpc.aio.Channel | None = None
        self.address = ""
        self._subscribers: list[Subscriber] = []

    async def start(self, *, serving: bool = True) -> Harness:
        for name, config in self.configs.items():
            runtime = SubscriptionRuntime(
                name, config, self.store, self.dead_letters, id_prefix=f"{name}-", max_held_bytes=self.max_held_bytes
            )
            await runtime.recover()
            await runtime.loaded()
            await runtime.start()
            self.runtimes[name] = runtime
        self.server = GrpcServer(self.runtimes, self.listen)
        self.address = await self.server.start()
        if serving:
            await self.server.set_serving()
        self.channel = grpc.aio.insecure_channel(self.address)
        return self

    @property
    def stub(self) -> sidecar_pb2_grpc.OrderedDeliveryStub:
        assert self.channel is not None
        return sidecar_pb2_grpc.OrderedDeliveryStub(self.channel)

    async def subscribe(self, subscription: str, max_outstanding: int = 0, *, auto_ack: bool = False) -> Subscriber:
        subscriber = Subscriber(self.stub, auto_ack=auto_ack)
        self._subscribers.append(subscriber)
        return await subscriber.open(subscription, max_outstanding)

    def raw_stream(self) -> Subscriber:
        subscriber = Subscriber(self.stub)
        self._subscribers.append(subscriber)
        return subscriber

    async def publish(self, subscription: str, items: Sequence[tuple[str, int]]) -> list[Message]:
        """Persist ``(key, sequence)`` messages and hand the stored ones to the runtime, like ingest."""
        mode = self.configs[subscription].mode
        incoming = [incoming_message(key, seq, sequenced=mode == "sequence") for key, seq in items]
        results = await self.store.persist(subscription, incoming, wall_clock_ms())
        stored = [r.message for r in results if r.outcome is PersistOutcome.STORED]
        self.runtimes[subscription].on_stored(stored)
        return stored

    async def stop(self) -> None:
        for subscriber in self._subscribers:
            await subscriber.close()
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(0)
        for runtime in self.runtimes.values():
            await runtime.stop(0)


def incoming_message(key: str, seq: int, *, sequenced: bool = True) -> IncomingMessage:
    """Key ``key``, data ``key:seq``; sequence ``seq`` unless ``sequenced`` is False (dedup id ``key/seq``)."""
    return IncomingMessage(
        key=key,
        dedup_id=f"{key}/{seq}",
        message_id=f"m-{key}-{seq}",
        data=f"{key}:{seq}".encode(),
        attributes={"seq": str(seq)},
        ordering_key=key,
        publish_time_ms=wall_clock_ms(),
        known_fingerprint=hashlib.sha256(f"{key}:{seq}".encode()).digest(),
        sequence=seq if sequenced else None,
        timestamp_ms=None,
    )


def sequence_config(**overrides: object) -> EngineConfig:
    return EngineConfig(mode="sequence", **overrides)  # type: ignore[arg-type]
