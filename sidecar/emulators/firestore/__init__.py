"""Firestore emulator (``google.firestore.v1.Firestore``) for Google's unmodified client.

``FirestoreEmulator`` is what the emulator stack uses: it registers the gRPC service on a
``grpc.aio`` server (the stack installs the fault interceptor), serves the admin routes
(counters, reset), and closes. Modules, by job: ``values`` (Value ordering/equality), ``paths``
(field paths), ``names`` (resource names), ``limits`` (production limits), ``documents``
(store, versions, history), ``writes`` (one write: preconditions, masks, transforms),
``query`` (StructuredQuery), ``transactions`` (isolation), ``counters`` (billing),
``listen`` and ``listen_targets`` (the Listen stream), ``service`` (gRPC handlers), ``indexes``
(the ``firestore.indexes.json`` config), ``index_plan`` (queries refused without an index),
``ttl`` (TTL policies and sweeps), ``hotspots`` (appends at the end of an index),
``admin_fields`` (FirestoreAdmin GetField/ListFields), ``protos`` (the one importer of Google's
libraries).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from aiohttp import web

from sidecar.emulators.faults import FaultInjector
from sidecar.emulators.firestore.admin_fields import FieldAdminService
from sidecar.emulators.firestore.counters import Counters
from sidecar.emulators.firestore.documents import DocumentStore
from sidecar.emulators.firestore.hotspots import HotspotCounter
from sidecar.emulators.firestore.indexes import IndexConfig
from sidecar.emulators.firestore.listen import ListenHub
from sidecar.emulators.firestore.service import FirestoreService
from sidecar.emulators.firestore.transactions import TransactionManager
from sidecar.emulators.firestore.ttl import TtlSweeper

__all__ = ["FirestoreEmulator"]


class FirestoreEmulator:
    """One in-memory Firestore (all projects and databases), its counters and admin routes.

    All methods except ``counters`` must be called on the loop that runs the gRPC server.
    ``monotonic`` drives transaction expiry (tests pass a fake clock); ``version_retention_seconds``
    bounds how far back ``read_time`` reads and read-only transactions can look. ``indexes`` is
    the loaded ``firestore.indexes.json`` (None: production's defaults, no query refused); its
    ``ttl: true`` overrides become TTL policies, swept every ``ttl_sweep_seconds`` (0: after every
    commit).
    """

    def __init__(
        self,
        injector: FaultInjector,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        version_retention_seconds: float = 60.0,
        lock_timeout_seconds: float = 20.0,
        indexes: IndexConfig | None = None,
        ttl_sweep_seconds: float = 60.0,
    ) -> None:
        self.injector = injector
        self.indexes = indexes or IndexConfig.everything()
        self._counters = Counters()
        self._store = DocumentStore(retention_us=int(version_retention_seconds * 1_000_000))
        self._transactions = TransactionManager(monotonic, lock_timeout_seconds)
        self._listens = ListenHub(self._store, self._counters, self.indexes)
        self.hotspots = HotspotCounter(self.indexes)
        self._store.write_observers.append(self.hotspots.on_write)
        self.ttl = TtlSweeper(self._store, self._counters, ttl_sweep_seconds)
        for group, path in self.indexes.ttl_fields():
            self.ttl.add_policy(group, path)
        self._service = FirestoreService(
            self._store, self._transactions, self._counters, self._listens, self.indexes, self.ttl.after_commit
        )
        self._admin = FieldAdminService(self.indexes)
        # Admin ``POST /streams/break {"service": "firestore"}`` ends the open Listen streams.
        injector.stream_breakers["firestore"] = self._listens.break_streams

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register both services; called on the server's loop, which also runs the TTL sweeps."""
        server.add_generic_rpc_handlers((self._service.handler(), self._admin.handler()))
        self.ttl.start()

    @property
    def listen_streams(self) -> int:
        """How many Listen streams are open (read on the server's loop, or as a racy count in tests)."""
        return len(self._listens.sessions)

    @property
    def counters(self) -> dict[str, int]:
        return self._counters.snapshot()

    def counters_report(self) -> dict[str, Any]:
        """The admin route's body: the billing counters plus ``hotspots``."""
        return {**self._counters.snapshot(), "hotspots": self.hotspots.snapshot()}

    def reset_counters(self) -> None:
        self._counters.reset()
        self.hotspots.reset_counts()

    def reset(self) -> None:
        """Drop all documents and transactions (counters are kept: reset those separately)."""
        self._transactions.clear()
        self._store.clear()
        self.ttl.clear()
        self.hotspots.clear()
        self._listens.reset()

    def admin_routes(self) -> list[web.RouteDef]:
        async def get_counters(request: web.Request) -> web.Response:
            return web.json_response(self.counters_report())

        async def reset_counters(request: web.Request) -> web.Response:
            self.reset_counters()
            return web.json_response(self.counters_report())

        async def ttl_sweep(request: web.Request) -> web.Response:
            as_of_us = None
            if request.can_read_body:
                try:
                    body = await request.json()
                except ValueError:
                    return web.json_response({"error": "body must be JSON"}, status=400)
                as_of_ms = body.get("as_of_ms") if isinstance(body, dict) else None
                if as_of_ms is not None:
                    if isinstance(as_of_ms, bool) or not isinstance(as_of_ms, int | float):
                        return web.json_response({"error": "as_of_ms must be epoch milliseconds"}, status=400)
                    as_of_us = int(as_of_ms * 1000)
            return web.json_response({"deleted": self.ttl.sweep(as_of_us)})

        async def reset(request: web.Request) -> web.Response:
            self.reset()
            return web.json_response({"reset": True})

        return [
            web.get("/firestore/counters", get_counters),
            web.post("/firestore/counters/reset", reset_counters),
            web.post("/firestore/reset", reset),
            web.post("/firestore/ttl/sweep", ttl_sweep),
        ]

    async def close(self) -> None:
        """End every transaction (waking commits that wait on them) and the TTL sweeps; idempotent."""
        self._transactions.clear()
        await self.ttl.close()
        if self.injector.stream_breakers.get("firestore") == self._listens.break_streams:
            del self.injector.stream_breakers["firestore"]
        await self._listens.break_streams(grpc.StatusCode.UNAVAILABLE)
