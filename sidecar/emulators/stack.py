"""All emulators in one process and one asyncio loop: Pub/Sub, Firestore, Monitoring and the admin API.

Each emulator is its own ``grpc.aio`` server on its own port, built with the fault interceptor of
its service, so faults apply to every RPC without the emulators knowing. Start order is
Pub/Sub -> Firestore -> Monitoring (which reads Pub/Sub's state) -> admin; stop is the reverse and
collects errors instead of stopping at the first. Port 0 binds a free port; the ``*_host``
attributes always carry the real one.

The Firestore emulator is optional here: when ``sidecar.emulators.firestore`` cannot be imported,
the stack runs without it and says so in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import grpc
from aiohttp import web

from sidecar.emulators.admin import build_admin_app
from sidecar.emulators.faults import FaultInjector, FaultInterceptor
from sidecar.emulators.monitoring import MonitoringEmulator
from sidecar.emulators.pubsub import PubsubEmulator

_LOGGER = logging.getLogger(__name__)

_SERVER_OPTIONS = [
    # Above Pub/Sub's 10 MB publish limit, so an oversize publish reaches the emulator and gets
    # production's INVALID_ARGUMENT instead of the transport's RESOURCE_EXHAUSTED.
    ("grpc.max_receive_message_length", 32 * 1024 * 1024),
    ("grpc.max_send_message_length", 32 * 1024 * 1024),
    # gRPC sets SO_REUSEPORT by default: a second emulator on a taken port would then "start" and
    # share the port silently. Fail loudly instead.
    ("grpc.so_reuseport", 0),
]
_STOP_GRACE_SECONDS = 1.0
"""Open streams are cancelled after this; the emulators hold nothing worth waiting longer for."""
_THREAD_START_TIMEOUT_SECONDS = 30.0


class EmulatorStack:
    """Runs the emulators inside the current loop (``start``/``stop``) or in a thread of their own."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        pubsub_port: int = 0,
        firestore_port: int = 0,
        monitoring_port: int = 0,
        admin_port: int = 0,
        metric_period: float = 60.0,
        metric_delay: float = 120.0,
        firestore_indexes: str | None = None,
        ttl_sweep_seconds: float = 60.0,
    ) -> None:
        """``firestore_indexes``: a ``firestore.indexes.json`` for the Firestore emulator (None: every
        field indexed); ``ttl_sweep_seconds``: its TTL sweep interval (0: after every commit)."""
        self.host = host
        self._ports = {"pubsub": pubsub_port, "firestore": firestore_port, "monitoring": monitoring_port}
        self._admin_port = admin_port
        self._metric_period = metric_period
        self._metric_delay = metric_delay
        self._firestore_indexes = firestore_indexes
        self._ttl_sweep_seconds = ttl_sweep_seconds
        self.injector = FaultInjector()
        self.pubsub: PubsubEmulator | None = None
        self.firestore: Any = None
        self.monitoring: MonitoringEmulator | None = None
        self.pubsub_host = ""
        self.firestore_host = ""
        self.monitoring_host = ""
        self.admin_url = ""
        self._servers: list[grpc.aio.Server] = []
        self._runner: web.AppRunner | None = None
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment variables that point the official clients at these emulators."""
        env = {"PUBSUB_EMULATOR_HOST": self.pubsub_host}
        if self.firestore_host:
            env["FIRESTORE_EMULATOR_HOST"] = self.firestore_host
        env["MONITORING_EMULATOR_HOST"] = self.monitoring_host
        return env

    async def _serve(self, service: str, add: Callable[[grpc.aio.Server], None]) -> str:
        server = grpc.aio.server(interceptors=[FaultInterceptor(self.injector, service)], options=_SERVER_OPTIONS)
        add(server)
        address = f"{self.host}:{self._ports[service]}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc's way of saying the bind failed
            await server.stop(None)
            raise OSError(f"{service} emulator: cannot bind {address} (in use?)") from exc
        await server.start()
        self._servers.append(server)
        self._cleanups.append(lambda: server.stop(_STOP_GRACE_SECONDS))
        return f"{self.host}:{port}"

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        pubsub = PubsubEmulator(self.injector)
        self.pubsub = pubsub
        self._cleanups.append(pubsub.close)
        self.pubsub_host = await self._serve("pubsub", pubsub.add_to_server)

        extra_routes = list(pubsub.admin_routes())
        firestore_cls = _firestore_class()
        if firestore_cls is not None:
            indexes = None
            if self._firestore_indexes is not None:
                # OSError / ValueError (one line naming the entry): `emulators` prints it and exits 1.
                from sidecar.emulators.firestore.indexes import load_index_config

                indexes = load_index_config(self._firestore_indexes)
            firestore = firestore_cls(self.injector, indexes=indexes, ttl_sweep_seconds=self._ttl_sweep_seconds)
            self.firestore = firestore
            self._cleanups.append(firestore.close)
            self.firestore_host = await self._serve("firestore", firestore.add_to_server)
            extra_routes.extend(firestore.admin_routes())

        # One clock for both: the backlog ages Monitoring reports follow the Pub/Sub emulator's clock.
        monitoring = MonitoringEmulator(
            pubsub.backlogs, self._metric_period, self._metric_delay, wall_clock_ns=pubsub.broker.now_ns
        )
        self.monitoring = monitoring
        self._cleanups.append(monitoring.close)
        self.monitoring_host = await self._serve("monitoring", monitoring.add_to_server)
        monitoring.start()

        runner = web.AppRunner(build_admin_app(self.injector, extra_routes), access_log=None)
        await runner.setup()
        self._runner = runner
        self._cleanups.append(runner.cleanup)
        site = web.TCPSite(runner, self.host, self._admin_port)
        await site.start()
        admin_port = runner.addresses[0][1]
        self.admin_url = f"http://{self.host}:{admin_port}"
        _LOGGER.info("emulators ready: %s admin=%s", self.env, self.admin_url)

    async def stop(self) -> None:
        """Stop everything started, newest first; idempotent; raises the first error after trying all."""
        errors: list[BaseException] = []
        while self._cleanups:
            cleanup = self._cleanups.pop()
            try:
                await cleanup()
            except Exception as exc:
                _LOGGER.exception("emulator cleanup failed")
                errors.append(exc)
        self._servers.clear()
        if errors:
            raise errors[0]

    async def __aenter__(self) -> EmulatorStack:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- own thread, for tests driving the synchronous clients from the main thread ------------------

    def start_in_thread(self) -> None:
        """Start the stack on a new loop in a daemon thread; returns once it serves (or raises its error)."""
        if self._thread is not None:
            raise RuntimeError("EmulatorStack: already started in a thread")
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()
        self._loop = loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="emulators", daemon=True)
        self._thread.start()
        if not ready.wait(_THREAD_START_TIMEOUT_SECONDS):
            raise TimeoutError("emulators did not start in time")
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop_thread(self) -> None:
        """Stop a stack started with ``start_in_thread`` and join its thread."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(_THREAD_START_TIMEOUT_SECONDS)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(loop.stop)
            thread.join(_THREAD_START_TIMEOUT_SECONDS)
            self._thread = None
            self._loop = None


def _firestore_class() -> Any:
    try:
        from sidecar.emulators.firestore import FirestoreEmulator
    except ImportError as exc:
        _LOGGER.warning("Firestore emulator not available (%s); running without it", exc)
        return None
    return FirestoreEmulator
