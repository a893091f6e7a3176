"""The cost scenario: billed Firestore operations per message, TTL deletes included, and index hotspots.

    python -m bench --quick --scenario cost
    python -m bench --quick --scenario cost --compare bench/results/cost-before.json

Five runs, each with its own subscription, Firestore root and one sidecar process (one pod, default
sharding) and the no-op app, in turn on the run's one emulators process:

- ``seq-100keys-inorder``: sequence mode, 100 keys, in-order traffic (nothing swapped or duplicated);
- ``seq-100keys``, ``watermark-100keys``, ``dedup-100keys``: the usual shuffled stream (10% swapped
  with their key's next message, 1% published twice);
- ``seq-10000keys``: sequence mode over 10,000 keys, with more than one message per key (with one, a
  round-robin stream has nothing to swap) and the swap probability raised so that a tenth of the
  stream's positions start a swap (``CostRun.rescaled_shuffle``).

Per run: a TTL sweep first clears what earlier scenarios left (the sweep acts on every root); the
counters are reset once the sidecar is ready; the app connects and an ``IDLE_SECONDS`` idle window
gives the upkeep rate (leases and cursors with no traffic), reported on its own; a second counters
reset opens the stream's window, and the stream is published as fast as the official publisher goes;
the bench waits until every distinct message reached the app and every app ack is durable
(``pubsub_sidecar_acked_total``), stops the app and SIGTERMs the sidecar (deferred cursor writes
happen on the way out), then asks the emulator's TTL sweep to act as of now + the dedup TTL + 1 day,
so every document the TTL policy will ever delete is deleted and billed now, and reads the counters.
The per-message figures are the counters from that reset (just before the first publish) to after
the sweep: the idle window is not in them, but the upkeep that runs during the stream is (it is part
of what production pays for the stream); ``upkeep_estimate_per_message`` is its estimate, the idle
rate times the stream window, per message. Hotspots are the stream window's too (the idle window's
are under ``idle.hotspots``).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from bench.app import BenchApp, wait_acks_durable
from bench.cost_report import HOTSPOT_LIMIT_PER_SECOND, LIST_PRICES, peak_hotspot, price_per_million, report
from bench.emulators_process import billed_operations, numeric_counters
from bench.harness import cpu_seconds
from bench.pubsub_clients import Outgoing
from bench.run_context import RunContext
from bench.scenarios import Result, Scenario
from bench.sidecar_process import Sidecar, write_sidecar_config
from bench.workload import SHUFFLED_FRACTION, build_stream, phase_timeout, subscription_entry

IDLE_SECONDS = 10.0
DEDUP_TTL = "7d"
"""The production default (docs/config.md): the TTL deletes counted are the ones it causes."""
DEDUP_TTL_MS = 7 * 86_400_000
SWEEP_MARGIN_MS = 86_400_000
"""The sweep runs as of now + TTL + 1 day: past every ``expire_at`` the run wrote."""


@dataclass(frozen=True, slots=True)
class CostRun:
    name: str
    mode: str
    keys: int
    in_order: bool = False
    rescaled_shuffle: bool = False
    """Raise the swap probability so that a tenth of all positions start a swap: with a few messages
    per key, most positions have no later message of their key to swap with (the last ``keys`` never
    do), and the stream would be nearly in order. On 100 keys the usual stream is used as it is."""


RUNS = (
    CostRun("seq-100keys-inorder", "sequence", 100, in_order=True),
    CostRun("seq-100keys", "sequence", 100),
    CostRun("seq-10000keys", "sequence", 10_000, rescaled_shuffle=True),
    CostRun("watermark-100keys", "watermark", 100),
    CostRun("dedup-100keys", "none", 100),
)


def stream_for(run: CostRun, count: int) -> tuple[list[Outgoing], int, float]:
    """The run's publish order, distinct count and swap probability."""
    if run.in_order:
        stream, distinct = build_stream(count, run.keys, "throughput", "k-", seed=1, shuffled=0.0, duplicated=0.0)
        return stream, distinct, 0.0
    shuffled = SHUFFLED_FRACTION
    if run.rescaled_shuffle:
        shuffled = min(1.0, SHUFFLED_FRACTION * count / max(1, count - run.keys))
    stream, distinct = build_stream(count, run.keys, "throughput", "k-", seed=1, shuffled=shuffled)
    return stream, distinct, shuffled


async def _one_run(context: RunContext, scenario: Scenario, run: CostRun) -> dict[str, Any]:
    sizes = context.sizes
    count = sizes.cost_many_keys_messages if run.keys >= 10_000 else sizes.cost_messages
    stream, distinct, shuffled = stream_for(run, count)
    subscription = context.pubsub.create(f"{scenario.name}-{run.name}-{uuid.uuid4().hex[:8]}")
    entry = subscription_entry(Scenario(run.name, "sidecar", run.mode, run.keys), subscription)
    entry["dedup"]["ttl"] = DEDUP_TTL
    config = write_sidecar_config(
        context.workdir / f"{scenario.name}-{run.name}.yaml",
        root=f"bench-{scenario.name}-{run.name}-{uuid.uuid4().hex[:6]}",
        subscription=entry,
    )
    emulators = context.emulators
    # The sweep acts on the whole emulator: sweep what earlier scenarios and runs left (their TTL
    # documents), before this run's sidecar exists, so that the closing sweep deletes, and the
    # counters bill, this run's documents only.
    swept_before = emulators.firestore_ttl_sweep(_sweep_as_of_ms())
    sidecar = Sidecar(config, emulators.env)
    sidecar.start()
    app: BenchApp | None = None
    try:
        await asyncio.to_thread(sidecar.wait_ready)
        emulators.reset_firestore_counters()
        window_started = time.monotonic()  # the idle window's start
        app = BenchApp(sidecar.grpc)
        app.start()
        await asyncio.sleep(IDLE_SECONDS)  # the measured idle window itself, not a synchronisation
        idle_snapshot = emulators.firestore_snapshot()
        # A reset, not a difference of snapshots, opens the stream's window: a hotspot's peak per
        # second cannot be subtracted. What lands between the two calls (one local HTTP round trip
        # of idle upkeep, ~17 ops/s) is in neither window.
        emulators.reset_firestore_counters()
        stream_started = time.monotonic()
        idle_seconds = stream_started - window_started
        cpu_before = cpu_seconds(sidecar.pid)
        started = await asyncio.to_thread(context.pubsub.publish, subscription, stream)
        await app.wait_for(distinct, phase_timeout(count))
        elapsed = app.last_at - started
        await wait_acks_durable(sidecar, distinct)
        cpu_used = cpu_seconds(sidecar.pid) - cpu_before
        duplicates_dropped = sidecar.metric("pubsub_sidecar_duplicates_total")
        stored = sidecar.metric("pubsub_sidecar_stored_total")
        fast_path = sidecar.metric("pubsub_sidecar_fast_path_total")
        error_logs = sidecar.error_log_lines()
    finally:
        if app is not None:
            await app.stop()
        exit_code = await asyncio.to_thread(sidecar.stop)
    notes: list[str] = []
    as_of_ms = _sweep_as_of_ms()
    swept = emulators.firestore_ttl_sweep(as_of_ms)
    if swept is None:
        notes.append("the emulator has no TTL sweep (POST /firestore/ttl/sweep: 404): TTL deletes not counted")
    snapshot = emulators.firestore_snapshot()
    window_seconds = time.monotonic() - stream_started
    idle_counters = numeric_counters(idle_snapshot)
    counters = numeric_counters(snapshot)
    idle_rate = billed_operations(idle_counters) / idle_seconds
    per_message: dict[str, float | None] = {
        "reads": counters["reads"] / distinct,
        "writes": counters["writes"] / distinct,
        "deletes": counters["deletes"] / distinct,
        "ttl_deletes": counters["ttl_deletes"] / distinct if "ttl_deletes" in counters else None,
        "billed": billed_operations(counters) / distinct,
    }
    priced = {name: value for name, value in per_message.items() if value is not None}
    return {
        "run": run.name,
        "mode": run.mode,
        "keys": run.keys,
        "in_order": run.in_order,
        "shuffled_probability": shuffled,
        "messages": distinct,
        "published": len(stream),
        "messages_per_second": distinct / elapsed,
        "window_seconds": window_seconds,
        "counters": counters,
        "per_message": per_message,
        "price_per_million": {
            "regional": price_per_million(priced, LIST_PRICES.regional),
            "multi_region": price_per_million(priced, LIST_PRICES.multi_region),
        },
        "idle": {
            "seconds": idle_seconds,
            "counters": idle_counters,
            "billed_per_second": idle_rate,
            "hotspots": _hotspots(idle_snapshot),
        },
        "upkeep_estimate_per_message": idle_rate * window_seconds / distinct,
        "hotspots": _hotspots(snapshot),
        "ttl_sweep": None if swept is None else {"as_of_ms": as_of_ms, "deleted": swept},
        "ttl_swept_before_run": swept_before,
        "dedup_ttl": DEDUP_TTL,
        "cpu_seconds_per_10k": cpu_used / distinct * 10_000,
        "duplicates_dropped": duplicates_dropped,
        "stored": stored,
        "fast_path": fast_path,
        "redeliveries_to_app": app.redeliveries,
        "sidecar_exit_code": exit_code,
        "sidecar_error_log_lines": len(error_logs),
        "first_sidecar_error": error_logs[0] if error_logs else None,
        "notes": notes,
    }


def _sweep_as_of_ms() -> int:
    return time.time_ns() // 1_000_000 + DEDUP_TTL_MS + SWEEP_MARGIN_MS


def _hotspots(snapshot: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every (group, field) of the emulator's hotspot counter, the largest peak first."""
    raw = snapshot.get("hotspots")
    if raw is None:
        return None
    rows = [
        {"field": name, "appends": int(v["appends"]), "peak_per_s": float(v["peak_per_s"])} for name, v in raw.items()
    ]
    return sorted(rows, key=lambda row: (-row["peak_per_s"], row["field"]))


def _goal(
    goal: str, value: float | None, limit: float, figure: str | None = None, strict: bool = False
) -> dict[str, Any]:
    within = value is not None and (value < limit if strict else value <= limit)
    status = "n/a" if value is None else ("met" if within else "missed")
    return {"goal": goal, "value": value, "limit": limit, "status": status, "figure": figure or _or_na(value)}


def _or_na(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def goals(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, met/missed, or n/a when a figure is missing (a run failed, or the
    emulator does not count it)."""
    billed = {run["run"]: run["per_message"]["billed"] for run in runs if not run.get("error")}
    listed = [
        _goal("in-order, seq-100keys-inorder: billed ops/msg <= 0.1", billed.get("seq-100keys-inorder"), 0.1),
        _goal("shuffled, seq-100keys: billed ops/msg <= 2.2", billed.get("seq-100keys"), 2.2),
        _goal("shuffled, seq-10000keys: billed ops/msg <= 2.2", billed.get("seq-10000keys"), 2.2),
        _goal("watermark-100keys: billed ops/msg <= 3.2", billed.get("watermark-100keys"), 3.2),
        _goal("dedup-100keys: billed ops/msg <= 3.2", billed.get("dedup-100keys"), 3.2),
    ]
    many, few = billed.get("seq-10000keys"), billed.get("seq-100keys")
    difference = None if many is None or few is None else many - few
    listed.append(_goal("seq-10000keys - seq-100keys <= +0.2", difference, 0.2, None if difference is None
                        else f"{difference:+.2f}"))  # fmt: skip
    if any(run["per_message"]["ttl_deletes"] is None for run in runs if not run.get("error")):
        # Without the TTL sweep a figure is short of the deletes production will bill: say so.
        for goal in listed:
            goal["figure"] += " (TTL deletes not counted)"
    peaks = [peak_hotspot(run) for run in runs if not run.get("error")]
    worst = None if not peaks or any(p is None for p in peaks) else max(p for p in peaks if p is not None)
    figure = None if worst is None else f"{worst:,.0f}/s"
    limit = HOTSPOT_LIMIT_PER_SECOND
    listed.append(_goal(f"every hotspot peak < {limit:.0f} appends/s", worst, limit, figure, strict=True))
    return listed


async def run_cost(context: RunContext, scenario: Scenario) -> Result:
    runs: list[dict[str, Any]] = []
    for run in RUNS:
        print(f"bench: cost: {run.name}", flush=True)
        try:
            runs.append(await _one_run(context, scenario, run))
        except Exception as exc:
            # The other runs still tell something; the scenario reports the failure at the end.
            print(f"bench: cost: {run.name} FAILED: {exc}", file=sys.stderr, flush=True)
            runs.append({"run": run.name, "mode": run.mode, "keys": run.keys, "error": str(exc)})
    notes = list(context.emulators.notes)
    notes += sorted({note for run in runs for note in run.get("notes", [])})
    extra: dict[str, Any] = {
        "runs": runs,
        "goals": goals(runs),
        "notes": notes,
        "firestore_indexes": context.emulators.firestore_indexes_used,
        "idle_seconds": IDLE_SECONDS,
        "list_prices": {
            "as_of": LIST_PRICES.as_of,
            "source": LIST_PRICES.source,
            "usd_per_100k_regional": asdict(LIST_PRICES.regional),
            "usd_per_100k_multi_region": asdict(LIST_PRICES.multi_region),
        },
        "failed_runs": [run["run"] for run in runs if run.get("error")],
    }
    print(report(extra), flush=True)
    result = Result(
        scenario.name, "seq-100keys of the cost runs (all five: the cost table, bench/results/cost.json)", extra=extra
    )
    # The main table's row is the shuffled 100-key run (the reference traffic).
    row = next((run for run in runs if run["run"] == "seq-100keys" and not run.get("error")), None)
    if row is not None:
        per = row["per_message"]
        result.messages = row["messages"]
        result.messages_per_second = row["messages_per_second"]
        result.reads_per_message = per["reads"]
        result.writes_deletes_per_message = per["writes"] + per["deletes"]
        result.cpu_seconds_per_10k = row["cpu_seconds_per_10k"]
    return result
