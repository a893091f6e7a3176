"""What the running subscriptions report to ``sidecar.ops``: metric snapshots, latencies, readiness, liveness.

``sidecar.ops`` knows nothing of the sidecar's layers; this glue reads the subscriptions' parts and
hands it plain values. Rules:

- Counters and gauges are read at scrape time (``metrics_snapshot``), from the same engine status
  that GetStatus answers with, so a scrape always agrees with it. A subscription still recovering
  (or stopping) has no engine numbers yet and is left out of the scrape rather than failing it.
- Every counter is a running total for the life of the process (the engines keep a dropped
  shard's counts: ``ShardEngines.retired``). ``dead_lettered_total`` is by reason family: the
  engine's reasons, and those ingest decides before the engine (``malformed``, ``conflict``,
  ``store_rejected``), always exported so that ``increase()`` sees the first one.
- Only the two latency histograms are observed as events happen (``LatencyObserver``): a persist
  batch's duration, and publish-to-delivery for first attempts only.
- Readiness: Firestore and each subscription's Pub/Sub answer, and each subscription's StreamingPull
  works (``PullHealth``): the client retries most StreamingPull errors without a word, so a
  GetSubscription that answers says nothing about them.
- Liveness names the first subscription whose recovery stopped making progress, if any.
- Capacity and lease health are sampled once a second (``Reports.run``) from the same running
  totals, into the pure ``sidecar.ops.capacity`` trackers: intake is the messages the engines took
  in (``stored``, the fast path's included, not what a load restored, less duplicates), delivery
  the messages finished (acked or dead-lettered); a lease round whose read fails means Firestore does
  not answer. Metrics and GetStatus read what was sampled last; a subscription not ready is not
  sampled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sidecar.engine.status import iso
from sidecar.engine.types import Deliver
from sidecar.ops.capacity import UNKNOWN, Capacity, CapacityWindow, LeaseHealth
from sidecar.ops.observability import Metrics, NotReady, ReadinessCheck, SubscriptionMetrics
from sidecar.pipeline.ingest import Ingestor
from sidecar.pipeline.runtime_loading import RECOVERY_STALL_SECONDS
from sidecar.wiring.subscription import SubscriptionParts


@dataclass(frozen=True, slots=True)
class LatencyObserver:
    """Observes the latency histograms of ``Metrics`` as events happen."""

    metrics: Metrics

    def persisted(self, subscription: str, seconds: float) -> None:
        self.metrics.persist_latency.labels(subscription).observe(seconds)

    def delivered(self, subscription: str, deliveries: Sequence[Deliver], now_ms: int) -> None:
        histogram = self.metrics.publish_to_delivery.labels(subscription)
        for delivery in deliveries:
            payload = delivery.message.payload
            if delivery.attempt == 1 and payload is not None:
                histogram.observe(max(0, now_ms - payload.publish_time_ms) / 1000)


def readiness_checks(
    ping_store: ReadinessCheck, subs: Mapping[str, SubscriptionParts]
) -> dict[str, Callable[[], Awaitable[None]]]:
    """Firestore, then each subscription's Pub/Sub and StreamingPull, by the name /readyz shows."""
    checks: dict[str, Callable[[], Awaitable[None]]] = {"firestore": ping_store}
    checks.update({f"pubsub:{name}": _pubsub_check(s.ingestor) for name, s in subs.items()})
    checks.update({f"streaming_pull:{name}": _pull_check(s.ingestor) for name, s in subs.items()})
    return checks


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


def stuck(subs: Mapping[str, SubscriptionParts]) -> str | None:
    """Liveness: which subscription's recovery stopped making progress, if any."""
    for name, s in subs.items():
        if not s.runtime.is_live():
            return (
                f"subscription {name!r}: recovery made no progress for {RECOVERY_STALL_SECONDS:.0f}s "
                f"({s.runtime.recovered_documents} documents read)"
            )
    return None


SAMPLE_SECONDS = 1.0
"""How often ``Reports.run`` samples the running totals: the rates cover a minute of them."""


class Reports:
    """Capacity (intake against delivery) and lease health of each subscription, sampled."""

    def __init__(
        self,
        subs: Mapping[str, SubscriptionParts],
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._subs = subs
        self._monotonic = monotonic
        self._wall = wall
        self._capacity = {name: CapacityWindow() for name in subs}
        self._leases = {name: LeaseHealth() for name in subs if subs[name].leases is not None}

    def sample(self) -> None:
        """One sample of every ready subscription's running totals."""
        now, wall = self._monotonic(), self._wall()
        for name, s in self._subs.items():
            leases, health = s.leases, self._leases.get(name)
            if leases is not None and health is not None:
                health.observe(wall, leases.stats.rounds, leases.stats.read_failures)
            if not s.runtime.is_ready:
                continue
            try:
                counts = s.runtime.status(max_keys=0)[0].counts
            except Exception:  # the engine is gone (stopping): nothing to sample
                continue
            # ``stored`` leaves out what a load restored (``recovered``): a shard's backlog is not intake.
            intake = counts.get("stored", 0) - counts.get("duplicates", 0)
            self._capacity[name].observe(now, max(0, intake), counts.get("acked", 0) + counts.get("dead_lettered", 0))

    async def run(self, interval_seconds: float = SAMPLE_SECONDS) -> None:
        """Sample for ever (cancelled at shutdown)."""
        while True:
            self.sample()
            await asyncio.sleep(interval_seconds)

    def capacity(self, name: str) -> Capacity:
        window = self._capacity.get(name)
        return UNKNOWN if window is None else window.capacity(self._monotonic())

    def dead_letters(self, name: str) -> dict[str, int]:
        """Dead letters ingest decided, by reason family, for GetStatus's counts (as the metrics)."""
        s = self._subs.get(name)
        return {} if s is None else ingest_dead_letters(s)

    def lease_problem(self, name: str) -> str | None:
        """Why this pod cannot hold its leases, in words; None while its lease reads work."""
        health = self._leases.get(name)
        if health is None or health.failing_since is None:
            return None
        since = iso(int(health.failing_since * 1000))
        return (
            f"Firestore unavailable since {since}: {health.failed_reads} lease reads failed; this pod loses "
            "its shards as their leases run out and delivers none of their keys until Firestore answers"
        )


def ingest_dead_letters(s: SubscriptionParts) -> dict[str, int]:
    """Dead letters ingest decides before the engine sees the message, by reason family (every
    family always present, so that ``increase()`` sees the first one)."""
    ingest = s.ingestor.counters
    return {"malformed": ingest.malformed, "conflict": ingest.conflicts, "store_rejected": ingest.rejected}


def metrics_snapshot(subs: Iterable[SubscriptionParts], reports: Reports | None = None) -> list[SubscriptionMetrics]:
    """Each ready subscription's counters and gauges, now (``SidecarCollector`` calls it at scrape time)."""
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
        ingest = s.ingestor.counters
        for reason, count in ingest_dead_letters(s).items():
            dead[reason] = dead.get(reason, 0) + count
        oldest = status.oldest_undelivered_ms
        lag = None
        if s.watermark is not None and s.watermark.watermark_ms is not None:
            lag = max(0.0, (now_ms - s.watermark.watermark_ms) / 1000)
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
                capacity=reports.capacity(s.config.name) if reports is not None else None,
                lease_problem=reports.lease_problem(s.config.name) is not None if reports is not None else False,
            )
        )
    return snapshots
