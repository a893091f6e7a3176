"""The benchmark's scenarios: what each publishes, how it consumes and what it measures.

Every scenario runs against one shared emulators process, on its own topic, subscription and
Firestore root, and (except the baseline) with its own sidecar process, so CPU and peak RSS belong
to that scenario alone. A scenario has two phases on the same subscription:

- **throughput**: publish the whole stream as fast as the official publisher goes while the app
  consumes; messages/s = distinct messages delivered / (last delivery - first publish).
- **latency**: publish at a fixed, modest rate (far below every consumer's capacity), so that
  publish-to-app latency is the pipeline's own, not the queueing delay of a backlog. Same rate for
  the baseline and the sidecar, so their p99 compare. The sidecar's latency runs from the instant
  a message became due in its key's order (the latest publish among it and its predecessors): a
  shuffled message waits for a predecessor published after it, and that wait is the workload's.
  The latency from its own publish is in the JSON (``own_publish_p50_ms``/``_p99_ms``).

The stream: messages round-robin over K keys with sequences 1, 2, ...; 10% are swapped with the
next message of their key (so they arrive out of order) and 1% are published a second time (a
publisher retry: same key, sequence and dedup attribute, a new message_id). The baseline counts
every published message (it cannot tell a retry); the sidecar counts distinct messages only.

Firestore reads, writes and deletes are per distinct delivered message over both phases, counted
from after the sidecar is ready until after it exits (a SIGTERM drains, so deferred deletes count).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import (
    TIMESTAMP_ATTRIBUTE,
    BenchError,
    Emulators,
    Outgoing,
    PubSub,
    Sidecar,
    cpu_seconds,
    peak_rss_mb,
    percentile,
    wait_until,
    write_sidecar_config,
)
from pubsub_sidecar_client import OrderedSubscriber

SHUFFLED_FRACTION = 0.10
DUPLICATED_FRACTION = 0.01

METRIC_PERIOD_SECONDS = 1.0
METRIC_DELAY_SECONDS = 2.0
"""The Monitoring emulator's sampling period and visibility delay: short, so watermark mode's latency
(about period + delay, against 60 s + 120 s in production) fits a benchmark run."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big one run is. ``hot_key_messages`` for the one-key scenario, whose every message is a
    full round trip (max_in_flight_per_key 1)."""

    messages: int
    hot_key_messages: int
    many_keys_messages: int
    latency_messages: int
    latency_rate_per_second: float
    recovery_pending: int
    recovery_keys: int
    held_messages: int = 200
    """held-gap: 1 KB messages that pile up behind one key's gap."""
    held_budget_mib: float = 0.05
    """held-gap: ``flow_control.max_held_bytes`` in MiB."""
    cost_messages: int = 200
    """cost: messages per 100-key stream."""
    cost_many_keys_messages: int = 2_000
    """cost: messages of the 10,000-key stream (more than one per key, or nothing could be shuffled)."""


SIZES: dict[str, Sizes] = {
    "smoke": Sizes(200, 100, 200, 40, 100.0, 200, 20, 300, 0.1),
    "quick": Sizes(3_000, 1_000, 3_000, 400, 200.0, 10_000, 1_000, 20_000, 5, 3_000, 20_000),
    "full": Sizes(50_000, 10_000, 100_000, 3_000, 200.0, 100_000, 1_000, 200_000, 100, 20_000, 50_000),
}


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    kind: str
    """"baseline", "sidecar", "recovery", "held", "scale-out" or "cost"."""
    mode: str = "sequence"
    keys: int = 100
    description: str = ""
    opt_in: bool = False
    """Runs only when named: not part of the default run (its minutes go to pod start-ups and waits)."""
    window: int = 1
    """``delivery.max_in_flight_per_key``: messages of one key in flight at once."""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("baseline", "baseline", "raw", 100, "official subscriber, no-op callback"),
        Scenario("seq-1key", "sidecar", "sequence", 1, "sequence mode, one hot key"),
        Scenario("seq-1key-w32", "sidecar", "sequence", 1, "sequence mode, one hot key, window 32", window=32),
        Scenario("seq-100keys", "sidecar", "sequence", 100, "sequence mode, 100 keys"),
        Scenario("seq-10000keys", "sidecar", "sequence", 10_000, "sequence mode, 10,000 keys"),
        Scenario("dedup-100keys", "sidecar", "none", 100, "dedup only (mode none), 100 keys"),
        Scenario("watermark-100keys", "sidecar", "watermark", 100, "watermark mode, 100 keys"),
        Scenario("recovery", "recovery", "sequence", 0, "start to /readyz with N pending"),
        Scenario("held-gap", "held", "sequence", 1, "one key held behind a gap, then filled"),
        Scenario("cost", "cost", "sequence", 100, "billed Firestore operations per message, TTL deletes, hotspots"),
        Scenario("scale-out", "scale-out", "sequence", 100, "1 vs 3 pods, failover, handover, lease upkeep", True),
    )
}

PRESETS: dict[str, tuple[str, list[str]]] = {
    "smoke": ("smoke", ["baseline", "seq-100keys"]),
}
"""Scenario names that stand for a size profile and a list of scenarios."""


@dataclass
class Result:
    """One table row (and one JSON file). None: not measured by this scenario."""

    scenario: str
    description: str
    messages: int = 0
    messages_per_second: float | None = None
    ratio_to_baseline: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    reads_per_message: float | None = None
    writes_deletes_per_message: float | None = None
    cpu_seconds_per_10k: float | None = None
    cpu_ratio_to_baseline: float | None = None
    """CPU per message over the baseline's (the official subscriber in a process of its own)."""
    peak_rss_mb: float | None = None
    ready_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def build_stream(
    count: int,
    keys: int,
    phase: str,
    key_prefix: str,
    seed: int,
    shuffled: float = SHUFFLED_FRACTION,
    duplicated: float = DUPLICATED_FRACTION,
) -> tuple[list[Outgoing], int]:
    """``count`` distinct messages over ``keys`` keys, shuffled and duplicated as the module says
    (``shuffled``, ``duplicated``: the fractions; 0 and 0 give in-order traffic). Returns the
    publish order and the number of distinct messages."""
    rng = random.Random(seed)
    keys = max(1, min(keys, count))
    stream = [Outgoing(f"{key_prefix}{i % keys}", i // keys + 1, phase) for i in range(count)]
    for index in range(count):
        # The next message of the same key is `keys` places later in round-robin order.
        if rng.random() < shuffled and index + keys < count:
            stream[index], stream[index + keys] = stream[index + keys], stream[index]
    with_retries: list[Outgoing] = []
    for message in stream:
        with_retries.append(message)
        if rng.random() < duplicated:
            with_retries.append(message)
    return with_retries, count


def subscription_entry(scenario: Scenario, subscription: str) -> dict[str, Any]:
    key = {"attribute": "order_id"}
    ordering: dict[str, Any]
    if scenario.mode == "sequence":
        ordering = {"mode": "sequence", "key": key, "sequence": {"attribute": "seq", "start": 1}}
    elif scenario.mode == "watermark":
        period_plus_delay = METRIC_PERIOD_SECONDS + METRIC_DELAY_SECONDS
        ordering = {
            "mode": "watermark",
            "key": key,
            "timestamp": {"source": "publish_time"},
            "watermark": {
                "poll_interval": "500ms",
                "safety_margin": "0s",
                "max_metric_delay": f"{period_plus_delay:g}s",
            },
        }
    elif scenario.mode == "none":
        ordering = {"mode": "none", "key": key}
    else:
        raise BenchError(f"scenario {scenario.name!r}: unknown mode {scenario.mode!r}")
    entry: dict[str, Any] = {"name": "bench", "subscription": subscription, "ordering": ordering}
    if scenario.window != 1:
        entry["delivery"] = {"max_in_flight_per_key": scenario.window}
    # Sequence mode dedups by (key, sequence); the others need the publisher's retry-stable id.
    entry["dedup"] = {"attribute": "event_id", "ttl": "1h"}
    return entry


class BenchApp:
    """The no-op app: reads through ``OrderedSubscriber`` and acks every message at once."""

    def __init__(self, target: str, *, track_arrivals: bool = False) -> None:
        self._subscriber = OrderedSubscriber(target, "bench")
        self._track_arrivals = track_arrivals
        self.arrivals: list[tuple[float, str]] = []
        """(instant, key) of every delivery, redeliveries included, when ``track_arrivals``."""
        self.distinct: set[str] = set()
        self.redeliveries = 0
        self.sequences: list[int] = []
        """Sequence of every first delivery, in arrival order."""
        self.last_at = 0.0
        self.latencies: list[float] = []
        """Publish-to-app from the instant order allowed delivery (see ``_read``)."""
        self.own_publish_latencies: list[float] = []
        """Publish-to-app from the message's own publish, shuffle waits included."""
        self._key_ready: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._subscriber.start()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self._subscriber:
            now = time.time()
            await message.ack()
            if self._track_arrivals:
                self.arrivals.append((now, message.key))
            identity = message.attributes["event_id"]
            if identity in self.distinct:
                self.redeliveries += 1
                continue
            self.distinct.add(identity)
            self.sequences.append(message.sequence)
            self.last_at = now
            if message.attributes.get("phase") == "latency":
                published = float(message.attributes[TIMESTAMP_ATTRIBUTE])
                # A shuffled message cannot be delivered before its predecessor, published after
                # it: that wait is the workload's, not the sidecar's. Messages reach the app in key
                # order, so the running maximum of publish instants is when this one became due.
                due = max(published, self._key_ready.get(message.key, 0.0))
                self._key_ready[message.key] = due
                self.latencies.append(now - due)
                self.own_publish_latencies.append(now - published)
            self._changed.set()

    async def wait_for(self, count: int, within_seconds: float) -> None:
        deadline = time.monotonic() + within_seconds
        while len(self.distinct) < count:
            if self._task is not None and self._task.done():
                self._task.result()
                raise BenchError("the app's stream ended")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"the app got {len(self.distinct)} of {count} messages in {within_seconds:.0f}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
            except TimeoutError:
                continue

    async def stop(self) -> None:
        await self._subscriber.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def wait_acks_durable(sidecar: Sidecar, count: int) -> None:
    await asyncio.to_thread(
        wait_until,
        lambda: sidecar.metric("pubsub_sidecar_acked_total") >= count,
        phase_timeout(count),
        f"the sidecar to make {count} app acks durable",
        0.1,
    )


def phase_timeout(count: int) -> float:
    """Deadline for a phase: generous (shared, noisy cores) yet finite."""
    return 120.0 + count / 20.0


def _messages_for(scenario: Scenario, sizes: Sizes) -> int:
    if scenario.keys == 1:
        return sizes.hot_key_messages
    if scenario.keys >= 10_000:
        return sizes.many_keys_messages
    return sizes.messages


class Runner:
    """Runs scenarios against one emulators process; ``workdir`` holds the sidecar configs."""

    def __init__(self, emulators: Emulators, pubsub: PubSub, sizes: Sizes, workdir: Path) -> None:
        self.emulators = emulators
        self.pubsub = pubsub
        self.sizes = sizes
        self.workdir = workdir

    def _new_subscription(self, scenario: Scenario) -> str:
        return self.pubsub.create(f"{scenario.name}-{uuid.uuid4().hex[:8]}")

    async def run(self, scenario: Scenario) -> Result:
        if scenario.kind == "baseline":
            return await self._baseline(scenario)
        if scenario.kind == "sidecar":
            return await self._sidecar(scenario)
        if scenario.kind == "held":
            return await self._held(scenario)
        if scenario.kind == "cost":
            # Imported here, as scale-out: bench.cost builds on this module.
            from bench.cost import run_cost

            return await run_cost(self, scenario)
        if scenario.kind == "scale-out":
            # Imported here: bench.scale_out builds on this module (BenchApp, build_stream, ...).
            from bench.scale_out import run_scale_out

            return await run_scale_out(self, scenario)
        return await self._recovery(scenario)

    def _latency_stream(self, scenario: Scenario) -> tuple[list[Outgoing], int]:
        return build_stream(self.sizes.latency_messages, scenario.keys, "latency", "lat-", seed=2)

    async def _baseline(self, scenario: Scenario) -> Result:
        subscription = self._new_subscription(scenario)
        stream, _ = build_stream(self.sizes.messages, scenario.keys, "throughput", "k-", seed=1)
        latency_stream, _ = self._latency_stream(scenario)
        result, wait = self.pubsub.start_baseline(subscription)
        try:
            # One message first: the subscriber process is up and streaming before the clock starts.
            warm_up, _ = build_stream(1, 1, "throughput", "warm-up-", seed=3)
            await asyncio.to_thread(self.pubsub.publish, subscription, warm_up)
            await asyncio.to_thread(wait, 1, phase_timeout(1))
            cpu_before = cpu_seconds(result.pid)
            started = await asyncio.to_thread(self.pubsub.publish, subscription, stream)
            await asyncio.to_thread(wait, 1 + len(stream), phase_timeout(len(stream)))
            elapsed = result.last_at - started
            rate = self.sizes.latency_rate_per_second
            await asyncio.to_thread(self.pubsub.publish, subscription, latency_stream, rate)
            total = len(stream) + len(latency_stream)
            await asyncio.to_thread(wait, 1 + total, phase_timeout(len(latency_stream)))
            cpu_used = cpu_seconds(result.pid) - cpu_before
        finally:
            await asyncio.to_thread(result.stop)
        return Result(
            scenario.name,
            scenario.description,
            messages=len(stream),
            messages_per_second=len(stream) / elapsed,
            ratio_to_baseline=1.0,
            cpu_seconds_per_10k=cpu_used / total * 10_000,
            cpu_ratio_to_baseline=1.0,
            p50_ms=_ms(percentile(result.latencies, 0.50)),
            p99_ms=_ms(percentile(result.latencies, 0.99)),
        )

    async def _sidecar(self, scenario: Scenario) -> Result:
        subscription = self._new_subscription(scenario)
        count = _messages_for(scenario, self.sizes)
        stream, distinct = build_stream(count, scenario.keys, "throughput", "k-", seed=1)
        latency_stream, latency_distinct = self._latency_stream(scenario)
        total_distinct = distinct + latency_distinct
        config = write_sidecar_config(
            self.workdir / f"{scenario.name}.yaml",
            root=f"bench-{scenario.name}-{uuid.uuid4().hex[:6]}",
            subscription=subscription_entry(scenario, subscription),
        )
        sidecar = Sidecar(config, self.emulators.env)
        sidecar.start()
        app: BenchApp | None = None
        try:
            await asyncio.to_thread(sidecar.wait_ready)
            self.emulators.reset_firestore_counters()
            cpu_before = cpu_seconds(sidecar.pid)
            app = BenchApp(sidecar.grpc)
            app.start()
            started = await asyncio.to_thread(self.pubsub.publish, subscription, stream)
            await app.wait_for(distinct, phase_timeout(count))
            elapsed = app.last_at - started
            # The latency phase starts on a settled sidecar, so that it measures the pipeline and
            # not the tail of the throughput phase's ack commits.
            await wait_acks_durable(sidecar, distinct)
            rate = self.sizes.latency_rate_per_second
            await asyncio.to_thread(self.pubsub.publish, subscription, latency_stream, rate)
            await app.wait_for(total_distinct, phase_timeout(len(latency_stream)))
            # CPU up to the point where every ack is durable: that work belongs to these messages.
            await wait_acks_durable(sidecar, total_distinct)
            cpu_used = cpu_seconds(sidecar.pid) - cpu_before
            rss = peak_rss_mb(sidecar.pid)
            duplicates_dropped = sidecar.metric("pubsub_sidecar_duplicates_total")
            dead_lettered = sidecar.metric("pubsub_sidecar_dead_lettered_total")
            error_logs = sidecar.error_log_lines()
        finally:
            if app is not None:
                await app.stop()
            exit_code = await asyncio.to_thread(sidecar.stop)
        counters = self.emulators.firestore_counters()
        return Result(
            scenario.name,
            scenario.description,
            messages=distinct,
            messages_per_second=distinct / elapsed,
            p50_ms=_ms(percentile(app.latencies, 0.50)),
            p99_ms=_ms(percentile(app.latencies, 0.99)),
            reads_per_message=counters["reads"] / total_distinct,
            writes_deletes_per_message=(counters["writes"] + counters["deletes"]) / total_distinct,
            cpu_seconds_per_10k=cpu_used / total_distinct * 10_000,
            peak_rss_mb=rss,
            extra={
                "keys": scenario.keys,
                "mode": scenario.mode,
                "published": len(stream) + len(latency_stream),
                "distinct": total_distinct,
                "duplicates_dropped": duplicates_dropped,
                "redeliveries_to_app": app.redeliveries,
                "own_publish_p50_ms": _ms(percentile(app.own_publish_latencies, 0.50)),
                "own_publish_p99_ms": _ms(percentile(app.own_publish_latencies, 0.99)),
                "dead_lettered": dead_lettered,
                "sidecar_error_log_lines": len(error_logs),
                "first_sidecar_error": error_logs[0] if error_logs else None,
                "firestore": counters,
                "latency_rate_per_second": rate,
                "sidecar_exit_code": exit_code,
            },
        )

    async def _held(self, scenario: Scenario) -> Result:
        return await _held_gap(self, scenario)

    async def _recovery(self, scenario: Scenario) -> Result:
        """Fill Firestore with N pending messages through a sidecar with no app, restart it and
        time start to /readyz (what a pod restart costs)."""
        subscription = self._new_subscription(scenario)
        pending = self.sizes.recovery_pending
        keys = self.sizes.recovery_keys
        stream = [Outgoing(f"r-{i % keys}", i // keys + 1, "recovery") for i in range(pending)]
        entry = subscription_entry(Scenario(scenario.name, "sidecar", "sequence", keys), subscription)
        # No app drains the backlog: without this the sidecar would (rightly) stop pulling at
        # 10,000 undelivered messages and leave the rest in Pub/Sub.
        entry["flow_control"] = {"max_undelivered_messages": None}
        # Every message stored: in order, with no app, the fast path would leave them in Pub/Sub
        # (unacked, up to max_outstanding_messages) instead of in Firestore, where recovery reads.
        entry["ordering"]["fast_path"] = False
        config = write_sidecar_config(
            self.workdir / f"{scenario.name}.yaml",
            root=f"bench-{scenario.name}-{uuid.uuid4().hex[:6]}",
            subscription=entry,
        )
        sidecar = Sidecar(config, self.emulators.env)
        sidecar.start()
        try:
            await asyncio.to_thread(sidecar.wait_ready)
            fill_started = time.monotonic()
            await asyncio.to_thread(self.pubsub.publish, subscription, stream)
            await _until_holding(sidecar, pending, f"the sidecar to store {pending} messages", 0.5)
            fill_seconds = time.monotonic() - fill_started
            await asyncio.to_thread(sidecar.stop)
            self.emulators.reset_firestore_counters()
            restart_at = time.monotonic()
            sidecar.start()
            await asyncio.to_thread(sidecar.wait_ready, 600.0, 0.02)
            ready_seconds = time.monotonic() - restart_at
            cpu_to_ready = cpu_seconds(sidecar.pid)
            # Ready once every shard's cursors are read; its pending messages are read after, page
            # by page, while the keys already deliver: the run times that too, and checks them all.
            await _until_holding(sidecar, pending, f"the restarted sidecar to hold its {pending} messages", 0.25)
            loaded_seconds = time.monotonic() - restart_at
            rss = peak_rss_mb(sidecar.pid)
            cpu_used = cpu_seconds(sidecar.pid)
            counters = self.emulators.firestore_counters()
        finally:
            await asyncio.to_thread(sidecar.stop)
        return Result(
            scenario.name,
            f"start to /readyz, {pending:,} pending over {keys:,} keys (all held after {loaded_seconds:.1f} s)",
            messages=pending,
            reads_per_message=counters["reads"] / pending,
            peak_rss_mb=rss,
            ready_seconds=ready_seconds,
            cpu_seconds_per_10k=cpu_used / pending * 10_000,
            extra={
                "keys": keys,
                "fill_seconds": fill_seconds,
                "fill_messages_per_second": pending / fill_seconds,
                "firestore_during_recovery": counters,
                "cpu_seconds_start_to_ready": cpu_to_ready,
                "loaded_seconds": loaded_seconds,
                "cpu_seconds_start_to_loaded": cpu_used,
            },
        )


async def _until_holding(sidecar: Sidecar, pending: int, what: str, interval: float) -> None:
    """Wait until ``sidecar`` holds ``pending`` messages (its buffered gauge), polled every ``interval``."""
    await asyncio.to_thread(
        wait_until,
        lambda: sidecar.metric("pubsub_sidecar_buffered_messages") >= pending,
        phase_timeout(pending),
        what,
        interval,
    )


async def _held_gap(runner: Runner, scenario: Scenario) -> Result:
    """One key: N 1 KB messages held behind a missing sequence 1, then 1 is published. Peak RSS must
    stay within the held-bytes budget plus a fixed overhead, and all N+1 arrive in order."""
    sizes = runner.sizes
    count = sizes.held_messages
    subscription = runner._new_subscription(scenario)
    entry = subscription_entry(scenario, subscription)
    entry["flow_control"] = {"max_held_bytes": f"{sizes.held_budget_mib:g}MiB"}
    # A window of 32: the drain is limited by the app, not by one ack commit per message (one key).
    entry["delivery"] = {"max_in_flight_per_key": 32}
    config = write_sidecar_config(
        runner.workdir / f"{scenario.name}.yaml",
        root=f"bench-{scenario.name}-{uuid.uuid4().hex[:6]}",
        subscription=entry,
    )
    sidecar = Sidecar(config, runner.emulators.env)
    sidecar.start()
    app: BenchApp | None = None
    try:
        await asyncio.to_thread(sidecar.wait_ready)
        runner.emulators.reset_firestore_counters()
        app = BenchApp(sidecar.grpc)
        app.start()
        held = [Outgoing("held", seq, "throughput") for seq in range(2, count + 2)]
        fill_started = time.monotonic()
        await asyncio.to_thread(runner.pubsub.publish, subscription, held, None, 1_000)
        await asyncio.to_thread(
            wait_until,
            lambda: sidecar.metric("pubsub_sidecar_buffered_messages") >= count,
            phase_timeout(count),
            f"the sidecar to hold {count} messages",
            0.5,
        )
        fill_seconds = time.monotonic() - fill_started
        rss_held = peak_rss_mb(sidecar.pid)
        if app.distinct:
            raise BenchError(f"held-gap: {len(app.distinct)} messages were delivered past the gap")
        drain_started = time.monotonic()
        await asyncio.to_thread(runner.pubsub.publish, subscription, [Outgoing("held", 1, "throughput")], None, 1_000)
        await app.wait_for(count + 1, phase_timeout(count))
        drain_seconds = time.monotonic() - drain_started
        rss = peak_rss_mb(sidecar.pid)
        in_order = app.sequences == list(range(1, count + 2))
        counters = runner.emulators.firestore_counters()
    finally:
        if app is not None:
            await app.stop()
        await asyncio.to_thread(sidecar.stop)
    if not in_order:
        raise BenchError("held-gap: the messages did not arrive in order after the gap was filled")
    return Result(
        scenario.name,
        f"{count:,} x 1 KB held behind a gap, budget {sizes.held_budget_mib:g} MiB, window 32",
        messages=count + 1,
        messages_per_second=(count + 1) / drain_seconds,
        reads_per_message=counters["reads"] / (count + 1),
        writes_deletes_per_message=(counters["writes"] + counters["deletes"]) / (count + 1),
        peak_rss_mb=rss,
        extra={
            "held_budget_mib": sizes.held_budget_mib,
            "peak_rss_mb_while_held": rss_held,
            "fill_seconds": fill_seconds,
            "drain_seconds": drain_seconds,
            "in_order": in_order,
            "firestore": counters,
        },
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def resolve(names: Sequence[str] | None, quick: bool) -> tuple[Sizes, str, list[Scenario]]:
    """The size profile and the scenarios to run, baseline first whenever a sidecar scenario runs
    (every ratio is to the baseline of the same run)."""
    profile = "quick" if quick else "full"
    wanted: list[str] = []
    for name in names or [n for n, s in SCENARIOS.items() if not s.opt_in]:
        if name in PRESETS:
            profile, members = PRESETS[name]
            wanted.extend(members)
        elif name in SCENARIOS:
            wanted.append(name)
        else:
            known = ", ".join([*SCENARIOS, *PRESETS])
            raise BenchError(f"unknown scenario {name!r}; known: {known}")
    if any(SCENARIOS[n].kind == "sidecar" for n in wanted) and "baseline" not in wanted:
        wanted.insert(0, "baseline")
    ordered = sorted(dict.fromkeys(wanted), key=list(SCENARIOS).index)
    return SIZES[profile], profile, [SCENARIOS[n] for n in ordered]
