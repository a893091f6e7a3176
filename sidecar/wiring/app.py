"""Wires one running sidecar together: start in dependency order, stop in reverse.

This module only wires; every component does its own job (``ingest``, ``store``, ``runtime``,
``delivery``, ``watermark``, ``observability``). It installs the process's one signal handler.

Start: the gRPC and HTTP listeners are bound first (an address in use, e.g. a second sidecar on a
running one's port, stops the start there: one line on stderr, exit 2, nothing else ran) -> store
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
that Kubernetes restarts it; an invalid config file exits 2 with one line on stderr, and so does
no way to reach Pub/Sub or Firestore (no emulator variable, no credentials: ``sidecar.config.credentials``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.cluster.leases.manager import ShardLeases
from sidecar.config import credentials
from sidecar.config.credentials import require_google_access
from sidecar.config.model import (
    ConfigError,
    SidecarConfig,
    SubscriptionConfig,
    config_error_exit,
    load_config,
)
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.delivery.server import GrpcServer
from sidecar.engine.types import Deliver
from sidecar.ops.listening import ListenError, ensure_tcp_port_free
from sidecar.ops.logs import setup_logging
from sidecar.ops.observability import HttpEndpoint, Metrics, NotReady, Readiness, SubscriptionMetrics
from sidecar.pipeline.ingest import Ingestor
from sidecar.pipeline.runtime import RECOVERY_STALL_SECONDS, SubscriptionRuntime, SubscriptionUnavailable, _first_cause
from sidecar.pipeline.watermark_source import WatermarkSource
from sidecar.store import documents as docs
from sidecar.store.api import StoreError, SubscriptionStoreConfig
from sidecar.store.firestore import FirestoreStore, check_deployment
from sidecar.store.timed import TimedStore
from sidecar.wiring.ownership import ShardOwnership

_LOGGER = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
"""A command line the user must fix (the same code as a bad config file)."""

_STOP_STEP_TIMEOUT_SECONDS = 10.0
"""Bound on each shutdown step besides the stream drain, so that a hung client cannot eat the pod's
termination grace period."""

_AFTER_DRAIN_RESERVE_FRACTION = 0.2
"""Share of the grace period kept for the steps after the stream drain (ack commits, closing
clients): the drain may use the rest, and the whole shutdown still ends within the grace period."""


@dataclass
class _Subscription:
    config: SubscriptionConfig
    runtime: SubscriptionRuntime
    ingestor: Ingestor
    watermark: WatermarkSource | None = None
    leases: ShardLeases | None = None
    ownership: ShardOwnership | None = None
    lease_listen: docs.Listening | None = None
    listen_leases: Callable[[], docs.Listening] | None = None
    """Starts the Listen on the subscription's lease documents (``_run``)."""


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
            # Index exemptions and the TTL policy (docs/operations.md): a warning per missing piece,
            # naming the command; never a reason not to start, so it runs beside the start.
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
                errors = await _shutdown(subs, grpc_server, http, self.grace_seconds, stopped)
                for step, step_error in errors:
                    _LOGGER.error("shutdown step %s failed: %r", step, step_error)
                await _collect(self._watchers)
                _LOGGER.info("sidecar stopped (%s)", ", ".join(stopped))

    def _observe_persist(self, subscription: str, seconds: float) -> None:
        self.metrics.persist_latency.labels(subscription).observe(seconds)

    def _observe_deliveries(self, subscription: str, deliveries: Sequence[Deliver], now_ms: int) -> None:
        histogram = self.metrics.publish_to_delivery.labels(subscription)
        for delivery in deliveries:
            payload = delivery.message.payload
            if delivery.attempt == 1 and payload is not None:
                histogram.observe(max(0, now_ms - payload.publish_time_ms) / 1000)

    def _build(
        self, clients: contextlib.AsyncExitStack
    ) -> tuple[dict[str, _Subscription], GrpcServer, HttpEndpoint, Readiness]:
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
        clients.push_async_callback(_close_quietly, "store", store.close)
        dead_letters = DeadLetterPublisher(
            {sub.name: sub.dead_letter_topic for sub in config.subscriptions},
            subscription_paths={sub.name: sub.subscription for sub in config.subscriptions},
        )
        clients.push_async_callback(_close_quietly, "dead-letter publisher", dead_letters.aclose)
        # Ingest persists through the timing wrapper (persist-latency histogram); delivery reports each
        # batch it hands out (publish-to-delivery histogram, first attempts only).
        timed_store = TimedStore(store, self._observe_persist)
        subs: dict[str, _Subscription] = {}
        for sub in config.subscriptions:
            runtime = SubscriptionRuntime(
                sub.name,
                sub.engine_config(),
                store,
                dead_letters,
                on_delivered=functools.partial(self._observe_deliveries, sub.name),
                max_held_bytes=sub.flow_control.max_held_bytes,
                shard_count=sub.sharding.shards,
            )
            ownership = ShardOwnership(runtime, store, drain_timeout_seconds=sub.sharding.drain_timeout_ms / 1000)
            leases = ShardLeases(
                store.documents,
                f"{config.firestore.root}/{sub.name}",
                sub.sharding.shards,
                pod,
                lease_ms=sub.sharding.lease_duration_ms,
                on_gained=ownership.on_gained,
                on_lost=ownership.on_lost,
                before_release=ownership.before_release,
            )
            leases_by_sub[sub.name] = leases
            runtime.pod = pod
            runtime.lease_check = leases.holds
            runtime.status_counts = functools.partial(_lease_counts, leases, ownership)
            runtime.on_shard_lost = leases.shard_lost
            ingestor = Ingestor(sub, timed_store, runtime, dead_letters)
            subs[sub.name] = _Subscription(
                sub,
                runtime,
                ingestor,
                _watermark_source(sub, runtime),
                leases=leases,
                ownership=ownership,
                listen_leases=functools.partial(
                    _listen_leases, store.documents, leases, f"{config.firestore.root}/{sub.name}", sub.name
                ),
            )
        grpc_server = GrpcServer(
            {name: s.runtime for name, s in subs.items()},
            config.listen,
            pull_failures={name: s.ingestor.pull_health.problem for name, s in subs.items()},
        )
        checks: dict[str, Callable[[], Awaitable[None]]] = {"firestore": store.ping}
        checks.update({f"pubsub:{name}": _pubsub_check(s.ingestor) for name, s in subs.items()})
        checks.update({f"streaming_pull:{name}": _pull_check(s.ingestor) for name, s in subs.items()})
        readiness = Readiness(checks)
        self.metrics.add_collector(lambda: _metrics_snapshot(subs.values()))
        http = HttpEndpoint(config.http, self.metrics, readiness, functools.partial(_stuck, subs))
        return subs, grpc_server, http, readiness

    async def _listen(self, grpc_server: GrpcServer, http: HttpEndpoint) -> str:
        """Bind both servers before anything else starts; raises ``ListenError`` (one line) when an
        address is in use. The HTTP port is checked before gRPC binds, so that a clash on either
        is the only line the process prints."""
        host, _, port = self.config.http.rpartition(":")
        ensure_tcp_port_free(host, int(port), "http")
        grpc_address = await grpc_server.start()
        await http.start()
        return grpc_address

    async def _run(
        self,
        subs: dict[str, _Subscription],
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
        for name, s in subs.items():
            if s.leases is not None and s.listen_leases is not None:
                s.lease_listen = s.listen_leases()
                watchers[asyncio.ensure_future(s.leases.run())] = f"shard leases of {name}"
                # Ingest after the first round's shards are loaded (bounded: a slow load only costs
                # a few messages stored for their owner, which is this pod, through the inbox).
                lease_seconds = s.config.sharding.lease_duration_ms / 1000
                if not await s.leases.settled(timeout_seconds=lease_seconds):
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
                _LOGGER.critical("%s failed; stopping: %s", what, _first_cause(failure), exc_info=failure)
            else:
                self.failure = RuntimeError(f"{what} ended unexpectedly")
                _LOGGER.critical("%s ended unexpectedly; stopping", what)

    async def _first_rounds_loaded(self, subs: dict[str, _Subscription]) -> bool:
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


async def _freeze_once_loaded(subs: dict[str, _Subscription]) -> None:
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


def pod_identity() -> str:
    """This process among the pods of a subscription: the pod's name (``POD_NAME`` from the downward
    API, else the host name), the process id and a random suffix, so that a restarted container is a
    new owner whose epoch moves on, never a zombie taken for the live one."""
    base = os.environ.get("POD_NAME") or socket.gethostname() or "sidecar"
    return f"{base}-{os.getpid()}-{secrets.token_hex(3)}"


def _lease_counts(leases: ShardLeases, ownership: ShardOwnership) -> dict[str, int]:
    counts = leases.stats.counts()
    counts["inbox_messages"] = ownership.inbox_messages
    counts["inbox_listen_failures"] = ownership.listen_failures
    return counts


def _listen_leases(documents: docs.Documents, leases: ShardLeases, sub_path: str, name: str) -> docs.Listening:
    """A Listen on the subscription's lease documents: any change (a release, a request, a take)
    runs a lease round at once instead of at the next renewal."""

    seen: dict[str, tuple[object, object, object]] = {}

    def on_change(change: docs.Change) -> None:
        # Renewals (``beat``) change nothing to act on; a take, hand-over, release or request does.
        # Poking on every renewal would make every pod's renewal start a round at every other pod.
        if change.initial:
            seen.clear()
        relevant = bool(change.removals)
        for doc_id, fields, _ in change.upserts:
            state = (fields.get("owner"), fields.get("epoch"), fields.get("wanted_by"))
            relevant |= seen.get(doc_id) != state
            seen[doc_id] = state
        for doc_id in change.removals:
            seen.pop(doc_id, None)
        if relevant and not change.initial:
            leases.poke()

    def on_error(error: StoreError) -> None:
        # The rounds still run every third of a lease: hand-overs are seen later, nothing is lost.
        _LOGGER.warning("subscription %s: the Listen on lease documents failed (%s); rounds continue", name, error)

    return documents.listen(sub_path, "leases", [], on_change, on_error)


def _stuck(subs: dict[str, _Subscription]) -> str | None:
    """Liveness: which subscription's recovery stopped making progress, if any."""
    for name, s in subs.items():
        if not s.runtime.is_live():
            return (
                f"subscription {name!r}: recovery made no progress for {RECOVERY_STALL_SECONDS:.0f}s "
                f"({s.runtime.recovered_documents} documents read)"
            )
    return None


async def _collect(watchers: dict[asyncio.Future[Any], str]) -> None:
    """After shutdown: the components' tasks have ended (stop() ends them); cancel any that did not,
    and retrieve every outcome so that none is reported as "never retrieved"."""
    for task in watchers:
        if not task.done():
            task.cancel()
    results = await asyncio.gather(*watchers, return_exceptions=True)
    for (_task, what), result in zip(watchers.items(), results, strict=True):
        if isinstance(result, Exception):
            _LOGGER.debug("%s ended with %r", what, result)


def _watermark_source(sub: SubscriptionConfig, runtime: SubscriptionRuntime) -> WatermarkSource | None:
    ordering = sub.ordering
    if ordering.mode != "watermark":
        return None
    # The subscription name is resolved to projects/P/subscriptions/S when the config is loaded.
    _, project, _, subscription_id = sub.subscription.split("/")
    return WatermarkSource(
        project=project,
        subscription_id=subscription_id,
        poll_interval_s=ordering.watermark.poll_interval_ms / 1000,
        safety_margin_ms=ordering.watermark.safety_margin_ms,
        allowed_skew_ms=ordering.timestamp.allowed_skew_ms or 0,
        max_metric_delay_ms=ordering.watermark.max_metric_delay_ms,
        on_watermark=runtime.advance_watermark,
    )


def _pubsub_check(ingestor: Ingestor) -> Callable[[], Awaitable[None]]:
    async def check() -> None:
        if not await ingestor.ping():
            raise ConnectionError(f"Pub/Sub does not answer for {ingestor.subscription_path}")

    return check


def _pull_check(ingestor: Ingestor) -> Callable[[], Awaitable[None]]:
    """Ready only while Pub/Sub delivers to this pod: the client retries most StreamingPull errors
    without a word, so a GetSubscription that answers says nothing about them (``PullHealth``)."""

    async def check() -> None:
        problem = ingestor.pull_health.problem()
        if problem is not None:
            raise NotReady(problem)

    return check


def _metrics_snapshot(subs: Iterable[_Subscription]) -> list[SubscriptionMetrics]:
    now_ms = time.time_ns() // 1_000_000
    snapshots = []
    for s in subs:
        if not s.runtime.is_ready and s.runtime.failure is None:
            continue  # still recovering (or stopping): no engine numbers yet
        try:
            status, _ = s.runtime.status(max_keys=0)
        except Exception:  # the engine is gone (stopping): skip rather than fail the scrape
            continue
        counts = status.counts
        dead = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("dead_lettered:")}
        oldest = status.oldest_undelivered_ms
        lag = None
        if s.watermark is not None and s.watermark.watermark_ms is not None:
            lag = max(0.0, (now_ms - s.watermark.watermark_ms) / 1000)
        ingest = s.ingestor.counters
        extra = s.runtime.extra_counts()
        snapshots.append(
            SubscriptionMetrics(
                subscription=s.config.name,
                received=ingest.received,
                malformed=ingest.malformed,
                duplicates=ingest.duplicates + counts.get("duplicates", 0) + s.runtime.counters.fast_path_duplicates,
                delivered=counts.get("delivered", 0),
                acked=counts.get("acked", 0),
                nacked=counts.get("nacked", 0) + counts.get("expired", 0),
                late=counts.get("late", 0),
                dead_lettered=dead,
                buffered=status.buffered,
                in_flight=status.in_flight,
                keys_blocked=status.keys_blocked,
                keys_blocked_dead_letter=status.keys_blocked_dead_letter,
                stored=ingest.persisted,
                fast_path=s.runtime.counters.fast_path,
                oldest_undelivered_age_seconds=0.0 if oldest is None else max(0.0, (now_ms - oldest) / 1000),
                watermark_lag_seconds=lag,
                shards_owned=len(s.runtime.shards()) if s.runtime.sharded else None,
                lease_renewals=extra.get("lease_renewals", 0),
                lease_renewal_failures=extra.get("lease_renewal_failures", 0),
                shards_adopted=extra.get("shards_adopted", 0),
                shards_dropped=extra.get("shards_dropped", 0),
                lease_blocked_shards=extra.get("lease_blocked", 0),
                streaming_pull_failing=s.ingestor.pull_health.is_failing(),
                streaming_pull_errors=dict(s.ingestor.pull_health.errors),
                ingest_stages=s.ingestor.stages(),
            )
        )
    return snapshots


async def _shutdown(
    subs: dict[str, _Subscription],
    grpc_server: GrpcServer,
    http: HttpEndpoint,
    grace_seconds: float,
    stopped: list[str],
) -> list[tuple[str, BaseException]]:
    """Stop the servers and components (the clients close after); every step runs even when an
    earlier one failed; errors are collected, not raised.

    A loop of awaited steps rather than ``gather``: the order is the point (no new messages before
    the streams drain, no closed client under a running component).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_seconds
    reserve = grace_seconds * _AFTER_DRAIN_RESERVE_FRACTION
    errors: list[tuple[str, BaseException]] = []

    def left(keep: float = 0.0) -> float:
        return max(0.1, deadline - keep - loop.time())

    async def step(name: str, coro: Awaitable[object], limit_seconds: float = _STOP_STEP_TIMEOUT_SECONDS) -> None:
        try:
            await asyncio.wait_for(coro, limit_seconds)
            stopped.append(name)
        except Exception as exc:
            errors.append((name, exc))

    await step("health", grpc_server.enter_graceful_shutdown())
    for name, s in subs.items():
        if s.watermark is not None:
            await step(f"watermark:{name}", s.watermark.close())
        # Persists in progress finish (their messages are then acked to Pub/Sub); the rest is nacked.
        ingest_grace = min(5.0, left(reserve) / 2)
        await step(f"ingest:{name}", s.ingestor.stop(grace_seconds=ingest_grace), ingest_grace + 15.0)
    for name, s in subs.items():
        # Hand the shards over now, not after their leases expire: the other pods take them at once.
        if s.leases is not None and s.ownership is not None:
            drain = s.config.sharding.drain_timeout_ms / 1000
            await step(f"leases:{name}", s.leases.release_all(s.ownership.drain), drain + _STOP_STEP_TIMEOUT_SECONDS)
            await step(f"shards:{name}", s.ownership.close())
        if s.lease_listen is not None:
            await step(f"lease-listen:{name}", s.lease_listen.close())
    drain = left(reserve)
    await step("grpc", grpc_server.stop(drain), drain + _STOP_STEP_TIMEOUT_SECONDS)
    for name, s in subs.items():
        commit = min(5.0, left())
        await step(f"runtime:{name}", s.runtime.stop(grace_seconds=commit), commit + _STOP_STEP_TIMEOUT_SECONDS)
    await step("http", http.stop())
    return errors


async def _close_quietly(name: str, close: Callable[[], Awaitable[object]]) -> None:
    """Close one client within a bound; a failure is logged, and the next client still closes."""
    try:
        await asyncio.wait_for(close(), _STOP_STEP_TIMEOUT_SECONDS)
    except Exception as exc:
        _LOGGER.error("closing the %s failed: %r", name, exc)


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _main(config: SidecarConfig, grace_seconds: float) -> int:
    sidecar = Sidecar(config, grace_seconds=grace_seconds)
    loop = asyncio.get_running_loop()
    # The one place that installs signal handlers for this process (STYLE: two servers each
    # registering their own would replace each other).
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sidecar.request_stop)
    await sidecar.serve()
    if isinstance(sidecar.failure, ListenError):
        return EXIT_USAGE
    return EXIT_FAILURE if sidecar.failure is not None else EXIT_OK


def run_command(args: argparse.Namespace) -> int:
    """``pubsub-sidecar run --config FILE``."""
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return config_error_exit(exc)
    if not args.grace_period > 0:
        print(f"pubsub-sidecar: --grace-period must be positive, got {args.grace_period}", file=sys.stderr)
        return EXIT_USAGE
    watermark = any(sub.ordering.mode == "watermark" for sub in config.subscriptions)
    # GoogleAccessMissing: one line and exit 2 (sidecar.commands.main), before any client or log line.
    require_google_access([credentials.PUBSUB, credentials.FIRESTORE, *([credentials.MONITORING] * watermark)])
    try:
        setup_logging(args.log_format, args.log_level)
    except ValueError as exc:
        print(f"pubsub-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(_main(config, args.grace_period))
