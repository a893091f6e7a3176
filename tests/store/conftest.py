"""Fixtures for the Firestore store tests: our Firestore emulator in a thread, behind the fault interceptor.

The emulator runs on its own event loop in a background thread on port 0; the store under test uses
the official client through ``FIRESTORE_EMULATOR_HOST``. Every test gets its own project id, so tests
never see each other's documents; counters are global, so tests assert on differences.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from sidecar.emulators.faults import FaultInjector, FaultInterceptor
from sidecar.emulators.firestore import FirestoreEmulator
from sidecar.store import FirestoreStore, SubscriptionStoreConfig

_START_TIMEOUT_SECONDS = 30.0


class _EmulatorThread(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="store-test-firestore", daemon=True)
        self.injector = FaultInjector(seed=7)
        self.emulator = FirestoreEmulator(self.injector)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stopping: asyncio.Event | None = None

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:
            self.error = exc
            self.ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = grpc.aio.server(
            interceptors=[FaultInterceptor(self.injector, "firestore")],
            options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
        )
        self.emulator.add_to_server(server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.ready.set()
        try:
            await self._stopping.wait()
        finally:
            await self.emulator.close()
            await server.stop(grace=None)

    def stop(self) -> None:
        if self._stopping is not None:
            self.loop.call_soon_threadsafe(self._stopping.set)
        self.join(timeout=10)


@dataclass
class Emulator:
    host: str
    injector: FaultInjector
    emulator: FirestoreEmulator

    def counters(self) -> dict[str, int]:
        return dict(self.emulator.counters)


@pytest.fixture(scope="session")
def firestore_emulator() -> Iterator[Emulator]:
    thread = _EmulatorThread()
    thread.start()
    if not thread.ready.wait(_START_TIMEOUT_SECONDS) or thread.error is not None:
        thread.stop()
        raise RuntimeError(f"Firestore emulator did not start: {thread.error!r}")
    try:
        yield Emulator(f"127.0.0.1:{thread.port}", thread.injector, thread.emulator)
    finally:
        thread.stop()


@pytest.fixture
def emulator(firestore_emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", firestore_emulator.host)
    try:
        yield firestore_emulator
    finally:
        firestore_emulator.injector.clear()


StoreFactory = Callable[..., FirestoreStore]


@pytest.fixture
async def make_store(emulator: Emulator) -> AsyncIterator[StoreFactory]:
    """Builds stores on a fresh project (shared by the stores of one test); closes them all at the end."""
    project = f"store-test-{uuid.uuid4().hex[:12]}"
    stores: list[FirestoreStore] = []

    def build(configs: dict[str, SubscriptionStoreConfig] | None = None, **kwargs: object) -> FirestoreStore:
        store = FirestoreStore(project, configs or {"orders": SubscriptionStoreConfig(mode="sequence")}, **kwargs)  # type: ignore[arg-type]
        stores.append(store)
        return store

    try:
        yield build
    finally:
        for store in stores:
            await store.close()
