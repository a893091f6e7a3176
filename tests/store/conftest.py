"""Fixtures for the Firestore store tests: our Firestore emulator in a thread, behind the fault interceptor.

The emulator runs on its own event loop in a background thread on port 0; the store under test uses
the official client through ``FIRESTORE_EMULATOR_HOST``. Every test gets its own project id, so tests
never see each other's documents; counters are global, so tests assert on differences.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest

from sidecar.emulators.faults import FaultInjector
from sidecar.emulators.firestore import FirestoreEmulator
from sidecar.emulators.firestore.threaded import ServerThread
from sidecar.store.api import SubscriptionStoreConfig
from sidecar.store.firestore import FirestoreStore

_START_TIMEOUT_SECONDS = 30.0


@dataclass
class Emulator:
    host: str
    injector: FaultInjector
    emulator: FirestoreEmulator
    loop: asyncio.AbstractEventLoop
    """The emulator's own loop (coroutines of the injector run there)."""

    def counters(self) -> dict[str, int]:
        return dict(self.emulator.counters)


@pytest.fixture(scope="session")
def firestore_emulator() -> Iterator[Emulator]:
    injector = FaultInjector(seed=7)
    thread = ServerThread(FirestoreEmulator(injector), injector)
    thread.start()
    if not thread.ready.wait(_START_TIMEOUT_SECONDS) or thread.error is not None:
        thread.stop()
        raise RuntimeError(f"Firestore emulator did not start: {thread.error!r}")
    try:
        yield Emulator(f"127.0.0.1:{thread.port}", thread.injector, thread.emulator, thread.loop)
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
