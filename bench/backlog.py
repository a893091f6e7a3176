"""The scenarios of a backlog the sidecar holds: ``recovery`` (a restart with N messages pending in
Firestore) and ``held-gap`` (one key's messages held behind a missing sequence, within the held-bytes
budget).

Rules this module keeps:
- Recovery times start to ``/readyz`` (a pod restart's cost), then to every pending message held
  again (the buffered gauge): the sidecar is ready once its shards' cursors are read and loads the
  pending messages after, page by page, while the keys already deliver.
- Recovery's backlog is stored in Firestore, not left in Pub/Sub: no app runs, the undelivered limit
  is lifted and the fast path is off.
- Held-gap fails the run when a message is delivered past the gap, or when the messages do not
  arrive in order once the gap is filled.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from bench.app import BenchApp, until_holding
from bench.harness import BenchError, cpu_seconds, peak_rss_mb, wait_until
from bench.pubsub_clients import Outgoing
from bench.run_context import RunContext
from bench.scenarios import Result, Scenario
from bench.sidecar_process import Sidecar, write_sidecar_config
from bench.workload import phase_timeout, subscription_entry


async def run_recovery(context: RunContext, scenario: Scenario) -> Result:
    """Fill Firestore with N pending messages through a sidecar with no app, restart it and
    time start to /readyz (what a pod restart costs)."""
    subscription = context.new_subscription(scenario.name)
    pending = context.sizes.recovery_pending
    keys = context.sizes.recovery_keys
    stream = [Outgoing(f"r-{i % keys}", i // keys + 1, "recovery") for i in range(pending)]
    entry = subscription_entry(Scenario(scenario.name, "sidecar", "sequence", keys), subscription)
    # No app drains the backlog: without this the sidecar would (rightly) stop pulling at
    # 10,000 undelivered messages and leave the rest in Pub/Sub.
    entry["flow_control"] = {"max_undelivered_messages": None}
    # Every message stored: in order, with no app, the fast path would leave them in Pub/Sub
    # (unacked, up to max_outstanding_messages) instead of in Firestore, where recovery reads.
    entry["ordering"]["fast_path"] = False
    config = write_sidecar_config(
        context.workdir / f"{scenario.name}.yaml",
        root=f"bench-{scenario.name}-{uuid.uuid4().hex[:6]}",
        subscription=entry,
    )
    sidecar = Sidecar(config, context.emulators.env)
    sidecar.start()
    try:
        await asyncio.to_thread(sidecar.wait_ready)
        fill_started = time.monotonic()
        await asyncio.to_thread(context.pubsub.publish, subscription, stream)
        await until_holding(sidecar, pending, f"the sidecar to store {pending} messages", 0.5)
        fill_seconds = time.monotonic() - fill_started
        await asyncio.to_thread(sidecar.stop)
        context.emulators.reset_firestore_counters()
        restart_at = time.monotonic()
        sidecar.start()
        await asyncio.to_thread(sidecar.wait_ready, 600.0, 0.02)
        ready_seconds = time.monotonic() - restart_at
        cpu_to_ready = cpu_seconds(sidecar.pid)
        # Ready once every shard's cursors are read; its pending messages are read after, page
        # by page, while the keys already deliver: the run times that too, and checks them all.
        await until_holding(sidecar, pending, f"the restarted sidecar to hold its {pending} messages", 0.25)
        loaded_seconds = time.monotonic() - restart_at
        rss = peak_rss_mb(sidecar.pid)
        cpu_used = cpu_seconds(sidecar.pid)
        counters = context.emulators.firestore_counters()
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


async def run_held_gap(context: RunContext, scenario: Scenario) -> Result:
    """One key: N 1 KB messages held behind a missing sequence 1, then 1 is published. Peak RSS must
    stay within the held-bytes budget plus a fixed overhead, and all N+1 arrive in order."""
    sizes = context.sizes
    count = sizes.held_messages
    subscription = context.new_subscription(scenario.name)
    entry = subscription_entry(scenario, subscription)
    entry["flow_control"] = {"max_held_bytes": f"{sizes.held_budget_mib:g}MiB"}
    # A window of 32: the drain is limited by the app, not by one ack commit per message (one key).
    entry["delivery"] = {"max_in_flight_per_key": 32}
    config = write_sidecar_config(
        context.workdir / f"{scenario.name}.yaml",
        root=f"bench-{scenario.name}-{uuid.uuid4().hex[:6]}",
        subscription=entry,
    )
    sidecar = Sidecar(config, context.emulators.env)
    sidecar.start()
    app: BenchApp | None = None
    try:
        await asyncio.to_thread(sidecar.wait_ready)
        context.emulators.reset_firestore_counters()
        app = BenchApp(sidecar.grpc)
        app.start()
        held = [Outgoing("held", seq, "throughput") for seq in range(2, count + 2)]
        fill_started = time.monotonic()
        await asyncio.to_thread(context.pubsub.publish, subscription, held, None, 1_000)
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
        await asyncio.to_thread(context.pubsub.publish, subscription, [Outgoing("held", 1, "throughput")], None, 1_000)
        await app.wait_for(count + 1, phase_timeout(count))
        drain_seconds = time.monotonic() - drain_started
        rss = peak_rss_mb(sidecar.pid)
        in_order = app.sequences == list(range(1, count + 2))
        counters = context.emulators.firestore_counters()
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
