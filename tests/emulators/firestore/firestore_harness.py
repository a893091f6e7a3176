"""The in-process Firestore emulator the conformance suite runs against (see conftest.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from sidecar.emulators.faults import FaultInjector, FaultInterceptor
from sidecar.emulators.firestore import FirestoreEmulator


class FakeMonotonic:
    """time.monotonic plus an offset that tests move forward (transaction expiry)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@dataclass
class Endpoint:
    host: str
    emulator: FirestoreEmulator | None = None
    injector: FaultInjector | None = None
    clock: FakeMonotonic | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def local(self) -> FirestoreEmulator:
        """The in-process emulator, or skip (an external endpoint has no counters or faults)."""
        if self.emulator is None:
            pytest.skip("emulator-only test: FIRESTORE_EMULATOR_HOST points at an external endpoint")
        return self.emulator


class ServerThread(threading.Thread):
    def __init__(self, emulator: FirestoreEmulator, injector: FaultInjector) -> None:
        super().__init__(name="firestore-emulator", daemon=True)
        self.emulator = emulator
        self.injector = injector
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
        self.join(timeout=30)
