"""Wires one running sidecar together: start in dependency order, stop in reverse.

This module only wires; every component does its own job (``ingest``, ``store``, ``runtime``,
``delivery``, ``watermark``, ``observability``). It installs the process's one signal handler.
One subscription's parts are made in ``sidecar.wiring.subscription``, what they report to
``sidecar.ops`` is read in ``sidecar.wiring.reporting``, and the stop sequence is
``sidecar.wiring.shutdown``'s.

Start: the gRPC, peer (with ``peering``) and HTTP listeners are bound first (an address in use, e.g.
a second sidecar on a running one's port, stops the start there: one line on stderr, exit 2, nothing
else ran) -> store
and dead-letter publisher -> one runtime per subscription, each with its shard leases
(``sidecar.cluster.leases``) carried out by ``sidecar.wiring.ownership`` (gRPC health NOT_SERVING meanwhile) ->
runtimes ready (nothing is delivered before a shard is loaded) -> runtimes'
background work, lease rounds and the Listen on the lease documents -> ingest and watermark sources
-> once every shard taken in the first lease round is loaded (none taken: that round is done),
health SERVING, /readyz ready, and the log line ``sidecar ready: ... gRPC on ADDR, HTTP on ADDR``
(with the bound ports, so port 0 works). Shards taken later are loaded as their leases are taken.

Stop (SIGTERM/SIGINT), all within ``grace_seconds``: /readyz and gRPC health NOT_SERVING -> stop
pulling (ingest gives back what it did not persist) -> drain the shards (hand out nothing more, wait
up to ``sharding.drain_timeout`` for the app's acks) and hand every lease over at once -> drain the
app streams (what is left is given back: it is pending in Firestore and the shards' next owners
deliver it) -> stop runtimes (queued acks commit) -> close clients. Every step runs even if an earlier
one failed. A component that fails for good stops the process the same way with exit code 1, so
that Kubernetes restarts it (``serve_until_stopped`` returns the sidecar, its ``failure`` set; the
``run`` command, ``sidecar.commands.run``, turns that into the exit code). An invalid config file
exits 2 with one line on stderr, and so does no way to reach Pub/Sub or Firestore (no emulator
variable, no credentials: ``sidecar.config.credentials``): the ``run`` command checks both first.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.cluster.leases.manager import ShardLeases
from sidecar.config.model import SidecarConfig
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.delivery.server import GrpcServer
from sidecar.ops.listening import ListenError, ensure_tcp_port_free
from sidecar.ops.observability import HttpEndpoint, Metrics, PeerCollector, Readiness
from sidecar.ops.tracing import TraceCounters, TracingCollector, start_tracing
from sidecar.pipeline.runtime_context import SubscriptionUnavailable, first_cause
from sidecar.publishing.relay import RelayRefused
from sidecar.store import documents as docs
from sidecar.store.api import SubscriptionStoreConfig
from sidecar.store.firestore import FirestoreStore, check_deployment
from sidecar.store.timed import TimedStore
from sidecar.wiring.peering import Peering, make_peering
from sidecar.wiring.relays import Relays
from sidecar.wiring.reporting import LatencyObserver, Reports, metrics_snapshot, readiness_checks, stuck
from sidecar.wiring.shutdown import close_quietly, collect, shutdown
from sidecar.wiring.subscription import SubscriptionParts, assemble_subscription, pod_identity

_LOGGER = logging.getLogger(__name__)


@dataclass
class Sidecar:
    """One running sidecar; ``serve()`` runs until ``request_stop()`` or a component failure."""

    config: SidecarConfig
    grace_seconds: float = 25.0
    metrics: Metrics = field(default_factory=Metrics)
    failure: BaseException | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _watchers: dict[asyncio.Future[Any], str] = field(default_factory=dict)
    """Long-running tasks of the components (ingest, watermark, runtime): one ending means failure."""
    _freeze: asyncio.Future[None] | None = None
    """Freezes what the first recovery loaded, once its pending pages are restored."""
    _peering: Peering | None = None
    """The peer channel (``sidecar.wiring.peering``): None without ``peering`` in the config."""
    _relays: Relays | None = None
    """The outbox relays (``sidecar.wiring.relays``), made by ``_build``."""

    def request_stop(self) -> None:
        if not self._stop.is_set():
            _LOGGER.info("stop requested; shutting down within %.1fs", self.grace_seconds)
        self._stop.set()

    async def serve(self) -> None:
        # The clients close last, in reverse order of creation, whatever happens in between.
        async with contextlib.AsyncExitStack() as clients:
            try:
                parts = self._build(clients)
            except Exception as exc:  # e.g. no credentials, a bad address: one clear line, exit 1
                self.failure = exc
                _LOGGER.critical("cannot start: %s", _describe(exc), exc_info=exc)
                return
            subs, grpc_server, http, readiness = parts
            try:
                grpc_address = await self._listen(grpc_server, http)
            except ListenError as exc:
                # Nothing else started: one line, exit 2 (``sidecar.ops.listening``).
                self.failure = exc
                print(f"pubsub-sidecar: {exc}", file=sys.stderr, flush=True)
                await grpc_server.stop(0)
                return
            try:  # a relay whose topic takes no publishes from here: one line, exit 2 (as above)
                await self._relays_or_none().check()
            except RelayRefused as exc:
                self.failure = exc
                print(f"pubsub-sidecar: {exc}", file=sys.stderr, flush=True)
                await grpc_server.stop(0)
                return
            # Index exemptions and the TTL policy (docs/operations.md): one warning summing up what is
            # missing, naming the commands; never a reason not to start, so it runs beside the start.
            deployment_check = asyncio.create_task(
                check_deployment(self.config.project, self.config.firestore.database, _LOGGER), name="deployment-check"
            )
            clients.callback(deployment_check.cancel)
            stopped: list[str] = []
            try:
                await self._run(subs, grpc_server, http, readiness, grpc_address)
            except Exception as exc:  # a startup failure (cannot listen, ...): stop what did start
                self.failure = exc
                _LOGGER.critical("sidecar failed: %s", _describe(exc), exc_info=exc)
            finally:
                if self._freeze is not None:
                    self._freeze.cancel()
                readiness.mark_shutting_down()
                await self._relays_or_none().stop()  # hand the relays' shards over first
                errors = await shutdown(subs, grpc_server, http, self.grace_seconds, stopped)
                for step, step_error in errors:
                    _LOGGER.error("shutdown step %s failed: %r", step, step_error)
                await collect(self._watchers)
                _LOGGER.info("sidecar stopped (%s)", ", ".join(stopped))

    def _build(
        self, clients: contextlib.AsyncExitStack
    ) -> tuple[dict[str, SubscriptionParts], GrpcServer, HttpEndpoint, Readiness]:
        """Make every component (nothing runs yet); registers the clients' close in ``clients``."""
        config = self.config
        pod = pod_identity()
        leases_by_sub: dict[str, ShardLeases] = {}

        def fence(subscription: str, shard: int) -> docs.Fence:
            return leases_by_sub[subscription].fence(shard)

        store = FirestoreStore(
            config.project,
            {
                sub.name: SubscriptionStoreConfig(
                    mode=sub.ordering.mode,
                    dedup_ttl_ms=sub.engine_config().dedup_ttl_ms,
                    on_dead_letter=sub.delivery.on_dead_letter,
                    sequence_start=sub.engine_config().sequence_start,
                    first_sequence_any=sub.engine_config().first_sequence_any,
                    shards=sub.sharding.shards,
                )
                for sub in config.subscriptions
            },
            database=config.firestore.database,
            root=config.firestore.root,
            fences=fence,
        )
        clients.push_async_callback(close_quietly, "store", store.close)
        dead_letters = DeadLetterPublisher(
            {sub.name: sub.dead_letter_topic for sub in config.subscriptions},
            subscription_paths={sub.name: sub.subscription for sub in config.subscriptions},
        )
        clients.push_async_callback(close_quietly, "dead-letter publisher", dead_letters.aclose)
        # Ingest persists through the timing wrapper (persist-latency histogram); delivery reports each
        # batch it hands out (publish-to-delivery histogram, first attempts only).
        observer = LatencyObserver(self.metrics)
        timed_store = TimedStore(store, observer.persisted)
        subs: dict[str, SubscriptionParts] = {}
        for sub in config.subscriptions:
            parts = assemble_subscription(
                sub,
                root=config.firestore.root,
                pod=pod,
                store=store,
                timed_store=timed_store,
                dead_letters=dead_letters,
                on_delivered=observer.delivered,
                # In this pod's member document: what other pods dial, and what a restart under this
                # pod name checks (its peer port is bound before the leases start: docs/leases.md).
                peer_address=_peer_address(config),
            )
            if parts.leases is not None:
                leases_by_sub[sub.name] = parts.leases
            subs[sub.name] = parts
        # The peer channel: messages of other pods' shards forwarded to their owners (docs/forwarding.md).
        self._peering = make_peering(config, pod, subs)
        if self._peering is not None:
            clients.push_async_callback(close_quietly, "peer channel", self._peering.close)
            self.metrics.registry.register(PeerCollector(self._peering.metrics))
        # Tracing (sidecar.ops.tracing): one provider for the process, closed after the runtimes
        # stopped (spans end as acks are confirmed); its counters are exported tracing on or off.
        trace_counters = TraceCounters()
        tracer = None
        if config.tracing.enabled:
            tracing = start_tracing(config.tracing.max_queue_size, trace_counters)
            clients.push_async_callback(close_quietly, "tracing", tracing.aclose)
            tracer = tracing.tracer
        for s in subs.values():
            s.runtime.traces.configure(trace_counters, tracer, config.tracing.max_open_spans)
        self.metrics.registry.register(TracingCollector(trace_counters, subs))
        # The outbox relays (``relays:``, docs/publishing.md): their own Firestore clients and publisher.
        self._relays = Relays(config, pod)
        clients.push_async_callback(close_quietly, "relays", self._relays.close)
        self.metrics.registry.register(self._relays.collector())
        # Capacity (intake against delivery) and lease health, sampled once a second for metrics and status.
        reports = Reports(subs)
        sampling = asyncio.ensure_future(reports.run())
        clients.callback(sampling.cancel)
        grpc_server = GrpcServer(
            {name: s.runtime for name, s in subs.items()},
            config.listen,
            pull_failures={name: s.ingestor.pull_health.problem for name, s in subs.items()},
            reports=reports,
        )
        grpc_server.servicer.entries = self._relays  # the Publish RPC writes through the relays
        readiness = Readiness(readiness_checks(store.ping, subs))
        self.metrics.add_collector(lambda: metrics_snapshot(subs.values(), reports))
        http = HttpEndpoint(config.http, self.metrics, readiness, lambda: stuck(subs))
        return subs, grpc_server, http, readiness

    async def _listen(self, grpc_server: GrpcServer, http: HttpEndpoint) -> str:
        """Bind both servers before anything else starts; raises ``ListenError`` (one line) when an
        address is in use. The HTTP port is checked before gRPC binds, so that a clash on either
        is the only line the process prints."""
        host, _, port = self.config.http.rpartition(":")
        ensure_tcp_port_free(host, int(port), "http")
        grpc_address = await grpc_server.start()
        if self._peering is not None:
            await self._peering.start()
        await http.start()
        return grpc_address

    async def _run(
        self,
        subs: dict[str, SubscriptionParts],
        grpc_server: GrpcServer,
        http: HttpEndpoint,
        readiness: Readiness,
        grpc_address: str,
    ) -> None:
        for s in subs.values():
            if self._stop.is_set():
                return
            await s.runtime.recover()
            await s.runtime.start()
        watchers = self._watchers
        self._relays_or_none().start(watchers)
        for name, s in subs.items():
            if s.leases is not None and s.listen_leases is not None:
                s.lease_listen = s.listen_leases()
                watchers[asyncio.ensure_future(s.leases.run())] = f"shard leases of {name}"
                # Ingest after the first round's shards are loaded (bounded: a slow load only costs
                # a few messages stored for their owner, which is this pod, through the inbox).
                lease_seconds = s.config.sharding.lease_duration_ms / 1000
                if not await s.leases.settled(timeout_seconds=lease_seconds):
                    if s.leases.failure is not None:
                        break  # e.g. its pod name refused: the leases' watcher stops the sidecar, nothing pulled
                    _LOGGER.info("subscription %s: ingest starts before the first shards are loaded", name)
            if s.runtime.failure is not None and s.runtime.task is not None:
                # It failed while its first shards loaded (a document it cannot read): that cause,
                # not an ingest refusing to start on a runtime that never recovered, stops the sidecar.
                watchers[s.runtime.task] = f"runtime of {name}"
                break
            await s.ingestor.start()
            watchers[asyncio.ensure_future(s.ingestor.run())] = f"ingest of {name}"
            if s.watermark is not None:
                watchers[asyncio.ensure_future(s.watermark.run())] = f"watermark source of {name}"
            if s.runtime.task is not None:
                watchers[s.runtime.task] = f"runtime of {name}"
        # Ready only once every shard of the first lease round has its cursors read (its pending
        # messages are read after, while its keys deliver), however long that takes: before, the
        # app would connect to a sidecar that had nothing of those shards to deliver.
        # A stuck load is liveness's to catch (``RECOVERY_STALL_SECONDS``); a pod that got no lease
        # is ready after its first round.
        if await self._first_rounds_loaded(subs):
            await grpc_server.set_serving()
            readiness.mark_recovered()
            http_address = f"{self.config.http.rpartition(':')[0]}:{http.bound_port}"
            _LOGGER.info(
                "sidecar ready: %d subscriptions, gRPC on %s, HTTP on %s", len(subs), grpc_address, http_address
            )
            self._freeze = asyncio.ensure_future(_freeze_once_loaded(subs))

        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({stop_wait, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        for task in done:
            if task is stop_wait:
                continue
            what = watchers[task]
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                self.failure = failure
                # The cause, not a TaskGroup's "unhandled errors" wrapper: the line must say why (a
                # document of a newer layout names itself and says to upgrade: docs/upgrades.md).
                _LOGGER.critical("%s failed; stopping: %s", what, first_cause(failure), exc_info=failure)
            else:
                self.failure = RuntimeError(f"{what} ended unexpectedly")
                _LOGGER.critical("%s ended unexpectedly; stopping", what)

    def _relays_or_none(self) -> Relays:
        return self._relays if self._relays is not None else Relays(self.config, "")

    async def _first_rounds_loaded(self, subs: dict[str, SubscriptionParts]) -> bool:
        """Wait until every subscription's first lease round is loaded; False when a stop was
        requested or a component ended first (the caller then stops as usual)."""
        settled = [s.leases.settled() for s in subs.values() if s.leases is not None]
        if not settled:
            return True
        loaded = asyncio.ensure_future(asyncio.gather(*settled))
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            waits: set[asyncio.Future[Any]] = {loaded, stop_wait, *self._watchers}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            if not loaded.done():
                loaded.cancel()
        return loaded.done() and not loaded.cancelled() and all(loaded.result())


async def _freeze_once_loaded(subs: dict[str, SubscriptionParts]) -> None:
    """Freeze what recovery loaded once the first round's pending pages are all restored."""
    for s in subs.values():
        try:
            await s.runtime.loaded()
        except SubscriptionUnavailable:
            return  # the runtime failed: the sidecar is stopping
    _freeze_recovered_objects()


def _freeze_recovered_objects() -> None:
    """What recovery loaded (up to hundreds of thousands of held messages) lives until delivered:
    moved out of the collector's generations, so that no later collection walks it again (each
    full collection would, for nothing). One collection first, so that no garbage of the start-up
    is kept for good; frozen objects are still freed by reference counting as usual."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    _LOGGER.info(
        "recovered objects frozen out of garbage collection",
        extra={"objects": gc.get_freeze_count(), "seconds": round(time.perf_counter() - started, 3)},
    )


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def serve_until_stopped(config: SidecarConfig, grace_seconds: float) -> Sidecar:
    """Run one sidecar until SIGTERM/SIGINT or a component failure; its ``failure`` says why it stopped."""
    sidecar = Sidecar(config, grace_seconds=grace_seconds)
    loop = asyncio.get_running_loop()
    # The one place that installs signal handlers for this process (STYLE: two servers each
    # registering their own would replace each other).
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sidecar.request_stop)
    await sidecar.serve()
    return sidecar


def _peer_address(config: SidecarConfig) -> str:
    """This pod's peer address (``peering.advertise_address``, else ``$POD_IP:<port>``); "" without peering."""
    peering = config.peering
    return peering.advertised(os.environ) if peering is not None and peering.enabled else ""
