"""The baseline and the sidecar scenarios: a throughput phase, then a latency phase, on one
subscription.

- **throughput**: publish the whole stream as fast as the official publisher goes while the app
  consumes; messages/s = distinct messages delivered / (last delivery - first publish).
- **latency**: publish at a fixed, modest rate (far below every consumer's capacity), so that
  publish-to-app latency is the pipeline's own, not the queueing delay of a backlog. Same rate for
  the baseline and the sidecar, so their p99 compare. The sidecar's latency runs from the instant
  a message became due in its key's order (the latest publish among it and its predecessors): a
  shuffled message waits for a predecessor published after it, and that wait is the workload's.
  The latency from its own publish is in the JSON (``own_publish_p50_ms``/``_p99_ms``).

Firestore reads, writes and deletes are per distinct delivered message over both phases, counted
from after the sidecar is ready until after it exits (a SIGTERM drains, so deferred deletes count).

Rules this module keeps:
- The baseline's clock starts once its subscriber process streams (one warm-up message first).
- The sidecar's latency phase starts on a settled sidecar (every app ack durable), and its CPU is
  counted up to the point where every ack is durable: that work belongs to these messages.
"""

from __future__ import annotations

import asyncio
import os
import uuid

from bench.app import BenchApp, wait_acks_durable
from bench.harness import CpuSplit, cpu_seconds, peak_rss_mb, percentile
from bench.otlp_receiver import OtlpReceiver
from bench.pubsub_clients import Outgoing
from bench.run_context import RunContext
from bench.scenarios import Result, Scenario, Sizes
from bench.sidecar_process import Sidecar, write_sidecar_config
from bench.workload import build_stream, phase_timeout, subscription_entry


def _messages_for(scenario: Scenario, sizes: Sizes) -> int:
    if scenario.keys == 1:
        return sizes.hot_key_messages
    if scenario.keys >= 10_000:
        return sizes.many_keys_messages
    return sizes.messages


def _latency_stream(context: RunContext, scenario: Scenario) -> tuple[list[Outgoing], int]:
    return build_stream(context.sizes.latency_messages, scenario.keys, "latency", "lat-", seed=2)


async def run_baseline(context: RunContext, scenario: Scenario) -> Result:
    subscription = context.new_subscription(scenario.name)
    stream, _ = build_stream(context.sizes.messages, scenario.keys, "throughput", "k-", seed=1)
    latency_stream, _ = _latency_stream(context, scenario)
    result, wait = context.pubsub.start_baseline(subscription)
    try:
        # One message first: the subscriber process is up and streaming before the clock starts.
        warm_up, _ = build_stream(1, 1, "throughput", "warm-up-", seed=3)
        await asyncio.to_thread(context.pubsub.publish, subscription, warm_up)
        await asyncio.to_thread(wait, 1, phase_timeout(1))
        cpu_before = cpu_seconds(result.pid)
        split = CpuSplit({"subscriber": result.pid, "emulators": context.emulators.pid, "bench": os.getpid()})
        split.start()
        started = await asyncio.to_thread(context.pubsub.publish, subscription, stream)
        await asyncio.to_thread(wait, 1 + len(stream), phase_timeout(len(stream)))
        split.stop()
        elapsed = result.last_at - started
        rate = context.sizes.latency_rate_per_second
        await asyncio.to_thread(context.pubsub.publish, subscription, latency_stream, rate)
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
        extra={"throughput_phase_cpu_seconds_per_10k": split.per_10k(len(stream))},
    )


async def run_sidecar(context: RunContext, scenario: Scenario) -> Result:
    subscription = context.new_subscription(scenario.name)
    count = _messages_for(scenario, context.sizes)
    stream, distinct = build_stream(count, scenario.keys, "throughput", "k-", seed=1)
    latency_stream, latency_distinct = _latency_stream(context, scenario)
    total_distinct = distinct + latency_distinct
    # Tracing on: every span goes over OTLP/gRPC to a receiver in this process (counted, not kept).
    receiver = OtlpReceiver(keep=False).start() if scenario.tracing else None
    config = write_sidecar_config(
        context.workdir / f"{scenario.name}.yaml",
        root=f"bench-{scenario.name}-{uuid.uuid4().hex[:6]}",
        subscription=subscription_entry(scenario, subscription),
        tracing={"enabled": True} if receiver is not None else None,
    )
    env = dict(context.emulators.env) | (receiver.env() if receiver is not None else {})
    sidecar = Sidecar(config, env)
    sidecar.start()
    app: BenchApp | None = None
    tracing: dict[str, float] = {}
    try:
        await asyncio.to_thread(sidecar.wait_ready)
        context.emulators.reset_firestore_counters()
        cpu_before = cpu_seconds(sidecar.pid)
        split = CpuSplit({"sidecar": sidecar.pid, "emulators": context.emulators.pid, "bench": os.getpid()})
        app = BenchApp(sidecar.grpc)
        app.start()
        split.start()
        started = await asyncio.to_thread(context.pubsub.publish, subscription, stream)
        await app.wait_for(distinct, phase_timeout(count))
        split.stop()
        elapsed = app.last_at - started
        # The latency phase starts on a settled sidecar, so that it measures the pipeline and
        # not the tail of the throughput phase's ack commits.
        await wait_acks_durable(sidecar, distinct)
        rate = context.sizes.latency_rate_per_second
        await asyncio.to_thread(context.pubsub.publish, subscription, latency_stream, rate)
        await app.wait_for(total_distinct, phase_timeout(len(latency_stream)))
        # CPU up to the point where every ack is durable: that work belongs to these messages.
        await wait_acks_durable(sidecar, total_distinct)
        cpu_used = cpu_seconds(sidecar.pid) - cpu_before
        rss = peak_rss_mb(sidecar.pid)
        duplicates_dropped = sidecar.metric("pubsub_sidecar_duplicates_total")
        dead_lettered = sidecar.metric("pubsub_sidecar_dead_lettered_total")
        error_logs = sidecar.error_log_lines()
        if receiver is not None:
            tracing = {
                name: sidecar.metric(f"pubsub_sidecar_trace_spans_{name}_total")
                for name in ("exported", "dropped", "export_failed", "not_recorded")
            }
    finally:
        if app is not None:
            await app.stop()
        exit_code = await asyncio.to_thread(sidecar.stop)
        if receiver is not None:
            tracing["received_by_the_receiver"] = receiver.span_count
            receiver.stop()
    counters = context.emulators.firestore_counters()
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
            "throughput_phase_cpu_seconds_per_10k": split.per_10k(distinct),
            **({"tracing_spans": tracing} if tracing else {}),
        },
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
