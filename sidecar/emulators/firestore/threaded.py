"""The Firestore emulator alone, on its own event loop in a daemon thread: for tests that use the
synchronous official client (or another loop) in the main thread.

``start()`` the thread, wait on ``ready``, read ``port`` (bound on 127.0.0.1:0), ``stop()`` at the end.
The server has the fault interceptor and a 16 MiB receive limit, so requests over Firestore's 10 MiB
get the emulator's INVALID_ARGUMENT rather than gRPC's RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from sidecar.emulators.faults import FaultInjector, FaultInterceptor
from sidecar.emulators.firestore import FirestoreEmulator


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
