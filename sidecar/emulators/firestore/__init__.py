"""Firestore emulator (``google.firestore.v1.Firestore``) for Google's unmodified client.

``FirestoreEmulator`` is what the emulator stack uses: it registers the gRPC service on a
``grpc.aio`` server (the stack installs the fault interceptor), serves the admin routes
(counters, reset), and closes. Modules, by job: ``values`` (Value ordering/equality), ``paths``
(field paths), ``names`` (resource names), ``limits`` (production limits), ``documents``
(store, versions, history), ``writes`` (one write: preconditions, masks, transforms),
``query`` (StructuredQuery), ``transactions`` (isolation), ``counters`` (billing),
``listen`` and ``listen_targets`` (the Listen stream), ``service`` (gRPC handlers), ``protos``
(the one importer of Google's libraries).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from aiohttp import web

from sidecar.emulators.faults import FaultInjector
from sidecar.emulators.firestore.counters import Counters
from sidecar.emulators.firestore.documents import DocumentStore
from sidecar.emulators.firestore.listen import ListenHub
from sidecar.emulators.firestore.service import FirestoreService
from sidecar.emulators.firestore.transactions import TransactionManager

__all__ = ["FirestoreEmulator"]


class FirestoreEmulator:
    """One in-memory Firestore (all projects and databases), its counters and admin routes.

    All methods except ``counters`` must be called on the loop that runs the gRPC server.
    ``monotonic`` drives transaction expiry (tests pass a fake clock); ``version_retention_seconds``
    bounds how far back ``read_time`` reads and read-only transactions can look.
    """

    def __init__(
        self,
        injector: FaultInjector,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        version_retention_seconds: float = 60.0,
        lock_timeout_seconds: float = 20.0,
    ) -> None:
        self.injector = injector
        self._counters = Counters()
        self._store = DocumentStore(retention_us=int(version_retention_seconds * 1_000_000))
        self._transactions = TransactionManager(monotonic, lock_timeout_seconds)
        self._listens = ListenHub(self._store, self._counters)
        self._service = FirestoreService(self._store, self._transactions, self._counters, self._listens)
        # Admin ``POST /streams/break {"service": "firestore"}`` ends the open Listen streams.
        injector.stream_breakers["firestore"] = self._listens.break_streams

    def add_to_server(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((self._service.handler(),))

    @property
    def listen_streams(self) -> int:
        """How many Listen streams are open (read on the server's loop, or as a racy count in tests)."""
        return len(self._listens.sessions)

    @property
    def counters(self) -> dict[str, int]:
        return self._counters.snapshot()

    def reset_counters(self) -> None:
        self._counters.reset()

    def reset(self) -> None:
        """Drop all documents and transactions (counters are kept: reset those separately)."""
        self._transactions.clear()
        self._store.clear()
        self._listens.reset()

    def admin_routes(self) -> list[web.RouteDef]:
        async def get_counters(request: web.Request) -> web.Response:
            return web.json_response(self.counters)

        async def reset_counters(request: web.Request) -> web.Response:
            self.reset_counters()
            return web.json_response(self.counters)

        async def reset(request: web.Request) -> web.Response:
            self.reset()
            return web.json_response({"reset": True})

        return [
            web.get("/firestore/counters", get_counters),
            web.post("/firestore/counters/reset", reset_counters),
            web.post("/firestore/reset", reset),
        ]

    async def close(self) -> None:
        """End every transaction (waking commits that wait on them); idempotent."""
        self._transactions.clear()
        if self.injector.stream_breakers.get("firestore") == self._listens.break_streams:
            del self.injector.stream_breakers["firestore"]
        await self._listens.break_streams(grpc.StatusCode.UNAVAILABLE)
