"""Health and metrics over HTTP: ``/healthz``, ``/readyz`` and ``/metrics`` (aiohttp, prometheus-client).

Counters and gauges are not kept twice: a custom collector reads them from the running
subscriptions (engine status and ingest counters) at scrape time, so a scrape always agrees with
GetStatus; the capacity gauges are what ``sidecar.ops.capacity`` made of the last second's sample
(GetStatus reads the same). Only the two latency histograms are observed as events happen. The snapshots, the
histograms' observations, the readiness checks and the liveness answer are made by
``sidecar.wiring.reporting``: this module knows nothing of the sidecar's layers.

``/healthz`` answers 200 while the process serves HTTP and every subscription makes progress
(liveness): a recovery that has read nothing new for minutes answers 503, so that Kubernetes
restarts the container rather than waiting on it for ever. ``/readyz`` answers 200
once recovery is done *and* every readiness check passes (Pub/Sub and Firestore reachable, and each
subscription's StreamingPull working: ``sidecar.pipeline.pull_health`` says when it has failed for 10 s or
was closed for good, with the cause); checks are cached for ``_CHECK_TTL_SECONDS`` so that probes do
not hammer the backends. A failed check's text names the cause (``describe_failure``): "no answer
from Firestore within 5 s (TimeoutError)", never an exception's empty text.

Every counter is a running total for the life of the process, whatever shards come and go (the
layers below keep a dropped shard's counts); figures that go up and down are gauges.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from sidecar.ops.capacity import Capacity
from sidecar.ops.listening import ListenError, describe_bind_error

_LOGGER = logging.getLogger(__name__)

PREFIX = "pubsub_sidecar"

_CHECK_TTL_SECONDS = 2.0
"""Kubernetes probes every few seconds; a 2 s cache keeps one probe from costing one RPC per backend."""

_CHECK_TIMEOUT_SECONDS = 5.0
"""A readiness check slower than this counts as failed: an unready pod is better than a hung probe."""


@dataclass(frozen=True, slots=True)
class SubscriptionMetrics:
    """One subscription's counters and gauges at scrape time."""

    subscription: str
    received: int
    malformed: int
    duplicates: int
    delivered: int
    acked: int
    nacked: int
    late: int
    dead_lettered: Mapping[str, int]
    buffered: int
    in_flight: int
    keys_blocked: int
    oldest_undelivered_age_seconds: float
    watermark_lag_seconds: float | None
    keys_blocked_dead_letter: int = 0
    stored: int = 0
    fast_path: int = 0
    shards_owned: int | None = None
    """Several pods: shards this pod owns and delivers now (None without shard leases)."""
    lease_renewals: int = 0
    lease_renewal_failures: int = 0
    shards_adopted: int = 0
    shards_dropped: int = 0
    lease_blocked_shards: int = 0
    """Shards whose lease document this pod cannot read as its own (newer layout, corrupt): stopped."""
    streaming_pull_failing: bool = False
    """Every StreamingPull failed for the bound, or the pull was closed for good (``PullHealth``)."""
    streaming_pull_errors: Mapping[str, int] = field(default_factory=dict)
    """Failed StreamingPull attempts by status code name, since the start."""
    ingest_stages: Mapping[str, int] = field(default_factory=dict)
    """Messages received and not settled with Pub/Sub, by where they wait (``Ingestor.stages``)."""
    capacity: Capacity | None = None
    """Intake against delivery over the last minute (``sidecar.ops.capacity``); None when not sampled."""
    lease_problem: bool = False
    """Several pods: this pod's lease reads of Firestore fail (it loses its shards as leases run out)."""


class SidecarCollector(Collector):
    """Turns ``SubscriptionMetrics`` snapshots into Prometheus families."""

    def __init__(self, source: Callable[[], Iterable[SubscriptionMetrics]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snapshots = list(self._source())
        counters = {
            "received": "Messages received from Pub/Sub.",
            "malformed": "Messages that could not be classified (sent to the dead-letter topic).",
            "duplicates": "Duplicates dropped (Pub/Sub redeliveries and publisher retries).",
            "delivered": "Deliveries to the app (redeliveries included).",
            "acked": "App acks made durable.",
            "nacked": "App nacks and ack-deadline expiries.",
            "late": "Messages that arrived behind their key's cursor.",
            "stored": "Messages written to Firestore before their Pub/Sub ack.",
            "fast_path": "Messages delivered without a Firestore document (in order at their key's owner).",
        }
        yield from _counter_families(counters, snapshots)
        dead = CounterMetricFamily(
            f"{PREFIX}_dead_lettered", "Messages published to the dead-letter topic.", labels=["subscription", "reason"]
        )
        for snap in snapshots:
            for reason, count in sorted(snap.dead_lettered.items()):
                dead.add_metric([snap.subscription, reason], count)
        yield dead
        gauges = {
            "buffered_messages": ("buffered", "Messages stored and not yet acked, dead-lettered or dropped."),
            "in_flight_messages": ("in_flight", "Messages delivered to the app and not yet acked."),
            "keys_blocked": ("keys_blocked", "Keys holding messages behind a gap, the watermark or a dead letter."),
            "keys_blocked_dead_letter": (
                "keys_blocked_dead_letter",
                "Keys stopped at a dead letter (on_dead_letter: block) until an operator unblocks or replays.",
            ),
            "oldest_undelivered_age_seconds": (
                "oldest_undelivered_age_seconds",
                "Age of the oldest stored message not yet delivered: the number to alert on.",
            ),
        }
        for name, (attr, doc) in gauges.items():
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["subscription"])
            for snap in snapshots:
                gauge.add_metric([snap.subscription], getattr(snap, attr))
            yield gauge
        lag = GaugeMetricFamily(
            f"{PREFIX}_watermark_lag_seconds", "Now minus the watermark (watermark mode).", labels=["subscription"]
        )
        for snap in snapshots:
            if snap.watermark_lag_seconds is not None:
                lag.add_metric([snap.subscription], snap.watermark_lag_seconds)
        yield lag
        sharded = [snap for snap in snapshots if snap.shards_owned is not None]
        owned = GaugeMetricFamily(
            f"{PREFIX}_shards_owned", "Shards this pod owns and delivers now (several pods).", labels=["subscription"]
        )
        for snap in sharded:
            owned.add_metric([snap.subscription], snap.shards_owned or 0)
        yield owned
        blocked = GaugeMetricFamily(
            f"{PREFIX}_lease_blocked_shards",
            "Shards stopped because their lease document cannot be read as this version's (a newer layout, a "
            "corrupt or ill-typed field): nobody delivers their keys until it is repaired (the log names it).",
            labels=["subscription"],
        )
        for snap in sharded:
            blocked.add_metric([snap.subscription], snap.lease_blocked_shards)
        yield blocked
        lease_counters = {
            "lease_renewals": "Shard lease renewals written.",
            "lease_renewal_failures": "Shard lease renewals that failed (Firestore error or lease moved on).",
            "shards_adopted": "Shards this pod took over and loaded (a handover is a recovery).",
            "shards_dropped": "Shards this pod stopped delivering (lost, handed over, or fenced by Firestore).",
        }
        yield from _counter_families(lease_counters, sharded)
        failing = GaugeMetricFamily(
            f"{PREFIX}_streaming_pull_failing",
            "1 while Pub/Sub delivers nothing to this pod: every StreamingPull failed for 10 s or more, or the "
            "pull was closed for good (the cause: /readyz, GetStatus pull_failure, the errors by code).",
            labels=["subscription"],
        )
        for snap in snapshots:
            failing.add_metric([snap.subscription], 1 if snap.streaming_pull_failing else 0)
        yield failing
        errors = CounterMetricFamily(
            f"{PREFIX}_streaming_pull_errors",
            "StreamingPull attempts that failed, by status code (the client retries most without a word).",
            labels=["subscription", "code"],
        )
        for snap in snapshots:
            for code, count in sorted(snap.streaming_pull_errors.items()):
                errors.add_metric([snap.subscription, code], count)
        yield errors
        stages = GaugeMetricFamily(
            f"{PREFIX}_ingest_messages",
            "Messages received from Pub/Sub and not yet acked or nacked to it, by where they wait: handoff "
            "(from the client's thread), unsorted, held (for a missing predecessor), deferred (behind a store "
            "of their key), to_store, storing, fast_path (delivered unstored, ack not yet durable), "
            "nack_scheduled (a failed store, given back after a backoff), forwarding (handed to the key's owner, "
            "not answered yet); unsettled counts them all (dead-letter "
            "publishes under way too).",
            labels=["subscription", "stage"],
        )
        for snap in snapshots:
            for stage, count in snap.ingest_stages.items():
                stages.add_metric([snap.subscription, stage], count)
        yield stages
        yield from _capacity_families(snapshots)


def _capacity_families(snapshots: list[SubscriptionMetrics]) -> Iterator[Metric]:
    """Lag as capacity: intake against delivery over the last minute, and how long the backlog grew."""
    measured = [snap for snap in snapshots if snap.capacity is not None and snap.capacity.known]
    gauges = {
        "intake_rate": ("intake_per_second", "New messages taken in per second, over the last minute."),
        "delivery_rate": (
            "delivered_per_second",
            "Messages finished per second (acked by the app, or dead-lettered), over the last minute.",
        ),
        "backlog_deficit": (
            "deficit_per_second",
            "Intake rate minus delivery rate: positive while messages come in faster than they are finished.",
        ),
        "backlog_deficit_seconds": (
            "growing_for_seconds",
            "How long the backlog has been growing without pause (0 when it does not): alert on this, a "
            "sustained deficit is a capacity problem, a spike is not.",
        ),
    }
    for name, (attr, doc) in gauges.items():
        gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["subscription"])
        for snap in measured:
            gauge.add_metric([snap.subscription], getattr(snap.capacity, attr))
        yield gauge
    failing = GaugeMetricFamily(
        f"{PREFIX}_lease_reads_failing",
        "1 while this pod's lease reads of Firestore fail (several pods): it loses its shards as their leases "
        "run out (`pubsub-sidecar status` says since when).",
        labels=["subscription"],
    )
    for snap in snapshots:
        if snap.shards_owned is not None:
            failing.add_metric([snap.subscription], 1 if snap.lease_problem else 0)
    yield failing


def _counter_families(docs: dict[str, str], snapshots: list[SubscriptionMetrics]) -> Iterator[Metric]:
    """One counter family per ``name -> doc``, a sample per subscription from the attribute ``name``."""
    for name, doc in docs.items():
        family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["subscription"])
        for snap in snapshots:
            family.add_metric([snap.subscription], getattr(snap, name))
        yield family


@dataclass
class Metrics:
    """The registry plus the histograms observed as events happen."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    persist_latency: Histogram = field(init=False)
    publish_to_delivery: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.persist_latency = Histogram(
            f"{PREFIX}_persist_latency_seconds",
            "Time for one Firestore persist batch.",
            ["subscription"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.publish_to_delivery = Histogram(
            f"{PREFIX}_publish_to_delivery_seconds",
            "Pub/Sub publish time to first delivery to the app.",
            ["subscription"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )

    def add_collector(self, source: Callable[[], Iterable[SubscriptionMetrics]]) -> None:
        self.registry.register(SidecarCollector(source))


# ---- the peer channel (docs/forwarding.md) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerMetrics:
    """The peer channel's counters at scrape time (``sidecar.wiring.peering`` reads them)."""

    unauthenticated: int
    """Peer calls refused with UNAUTHENTICATED: no secret, or a wrong one."""
    answered: Mapping[str, int]
    """As the owner: forwarded messages by answer (``accepted``, or the refusal's reason)."""
    forwarded: Mapping[str, int]
    """As the sender: forwarded messages by answer (``accepted``, a refusal's reason, ``broken``)."""


class PeerCollector(Collector):
    """``PeerMetrics`` as Prometheus families."""

    def __init__(self, source: Callable[[], PeerMetrics]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snap = self._source()
        yield CounterMetricFamily(
            f"{PREFIX}_peer_unauthenticated",
            "Peer calls refused with UNAUTHENTICATED (no shared secret, or a wrong one): alert on any increase.",
            value=snap.unauthenticated,
        )
        families = {
            "peer_answered": ("Messages other pods forwarded to this one, by its answer.", snap.answered),
            "peer_forwarded": ("Messages this pod forwarded to their owner, by the answer.", snap.forwarded),
        }
        for name, (doc, counts) in families.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["answer"])
            for answer, count in sorted(counts.items()):
                family.add_metric([answer], count)
            yield family


ReadinessCheck = Callable[[], Awaitable[None]]
"""Raises (anything) when the dependency is not reachable."""


class NotReady(Exception):
    """Raised by a check that explains itself: /readyz shows its text as is."""


Liveness = Callable[[], str | None]
"""Returns why the process is stuck, or None while it makes progress."""


class Readiness:
    """Recovered flag plus cached dependency checks."""

    def __init__(
        self,
        checks: Mapping[str, ReadinessCheck],
        *,
        clock: Callable[[], float] = time.monotonic,
        timeout_seconds: float = _CHECK_TIMEOUT_SECONDS,
    ) -> None:
        self._checks = dict(checks)
        self._clock = clock
        self._timeout = timeout_seconds
        self._recovered = False
        self._shutting_down = False
        self._cache: dict[str, tuple[float, str | None]] = {}
        self._lock = asyncio.Lock()

    def mark_recovered(self) -> None:
        self._recovered = True

    def mark_shutting_down(self) -> None:
        self._shutting_down = True

    async def evaluate(self) -> tuple[bool, dict[str, str]]:
        """(ready, {check name: "ok" | reason})."""
        async with self._lock:
            now = self._clock()
            results: dict[str, str] = {
                "recovered": "ok" if self._recovered else "recovery not finished",
                "shutdown": "shutting down" if self._shutting_down else "ok",
            }
            for name, check in self._checks.items():
                cached = self._cache.get(name)
                if cached is None or now - cached[0] > _CHECK_TTL_SECONDS:
                    cached = (now, await _run_check(name, check, self._timeout))
                    self._cache[name] = cached
                results[name] = cached[1] or "ok"
            return all(v == "ok" for v in results.values()), results


async def _run_check(name: str, check: ReadinessCheck, timeout_seconds: float) -> str | None:
    try:
        await asyncio.wait_for(check(), timeout_seconds)
    except asyncio.CancelledError:
        raise
    except NotReady as exc:
        return str(exc)[:300] or "not ready"
    except Exception as exc:  # any failure means "not ready"; say which
        return describe_failure(name, exc, timeout_seconds)[:300]
    return None


def describe_failure(name: str, exc: BaseException, timeout_seconds: float) -> str:
    """A failed readiness check in words that name the cause, never an exception's empty text:
    no answer in time says so; otherwise the exception's own text, or its cause's."""
    kind = type(exc).__name__
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"no answer from {_SUBJECTS.get(name.split(':', 1)[0], name)} within {timeout_seconds:g} s ({kind})"
    text = str(exc).strip()
    cause = exc.__cause__ or exc.__context__
    while not text and cause is not None:
        text = f"{type(cause).__name__}: {cause}".strip().removesuffix(":")
        cause = cause.__cause__ or cause.__context__
    subject = _SUBJECTS.get(name.split(":", 1)[0], name)
    return f"{subject} check failed: {kind}: {text}" if text else f"{subject} check failed: {kind} with no message"


_SUBJECTS = {"firestore": "Firestore", "pubsub": "Pub/Sub", "streaming_pull": "Pub/Sub StreamingPull"}
"""What a check's name (before any ``:<subscription>``) is about, as /readyz says it."""


class HttpEndpoint:
    """The aiohttp server for probes and scrapes."""

    def __init__(self, address: str, metrics: Metrics, readiness: Readiness, liveness: Liveness | None = None) -> None:
        host, _, port = address.rpartition(":")
        self._liveness = liveness
        self._host = host or "127.0.0.1"
        self._port = int(port)
        self._metrics = metrics
        self._readiness = readiness
        self._runner: web.AppRunner | None = None
        self.bound_port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_handler)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise ListenError(describe_bind_error(f"{self._host}:{self._port}", "http", exc)) from None
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port
        _LOGGER.info("http endpoint listening", extra={"address": f"{self._host}:{self.bound_port}"})

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _healthz(self, _request: web.Request) -> web.Response:
        problem = self._liveness() if self._liveness is not None else None
        if problem:
            return web.json_response({"status": "stuck", "reason": problem}, status=503)
        return web.json_response({"status": "alive"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        ready, checks = await self._readiness.evaluate()
        return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)

    async def _metrics_handler(self, _request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
