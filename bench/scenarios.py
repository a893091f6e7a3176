"""The benchmark's scenarios: their names and sizes, which run by default, and the row each reports.

Every scenario runs against one shared emulators process, on its own topic, subscription and
Firestore root, and (except the baseline) with its own sidecar process, so CPU and peak RSS belong
to that scenario alone. ``bench.runner`` runs a scenario by its kind: ``baseline`` and ``sidecar`` in
``bench.throughput`` (a throughput phase, then a latency phase), ``recovery`` and ``held`` in
``bench.backlog``, ``cost`` in ``bench.cost``, ``scale-out`` in ``bench.scale_out``; what each
publishes is ``bench.workload``'s stream.

Rules this module keeps:
- Every ratio is to the baseline of the same run (the machines are shared and noisy): ``resolve``
  puts the baseline first whenever a sidecar scenario runs.
- An opt-in scenario (``Scenario.opt_in``) runs only when named; a preset name stands for a size
  profile and a list of scenarios.
- It is data only: of the bench it imports ``BenchError`` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness import BenchError

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
    """"baseline", "sidecar", "recovery", "held", "scale-out", "cost" or "relay"."""
    mode: str = "sequence"
    keys: int = 100
    description: str = ""
    opt_in: bool = False
    """Runs only when named: not part of the default run (its minutes go to pod start-ups and waits)."""
    window: int = 1
    """``delivery.max_in_flight_per_key``: messages of one key in flight at once."""
    tracing: bool = False
    """``tracing: {enabled: true}``, exporting over OTLP/gRPC to a receiver in the bench process."""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("baseline", "baseline", "raw", 100, "official subscriber, no-op callback"),
        Scenario("seq-1key", "sidecar", "sequence", 1, "sequence mode, one hot key"),
        Scenario("seq-1key-w32", "sidecar", "sequence", 1, "sequence mode, one hot key, window 32", window=32),
        Scenario("seq-100keys", "sidecar", "sequence", 100, "sequence mode, 100 keys"),
        Scenario(
            "seq-100keys-traced",
            "sidecar",
            "sequence",
            100,
            "seq-100keys with tracing on (OTLP to a local receiver)",
            opt_in=True,
            tracing=True,
        ),
        Scenario("seq-10000keys", "sidecar", "sequence", 10_000, "sequence mode, 10,000 keys"),
        Scenario("dedup-100keys", "sidecar", "none", 100, "dedup only (mode none), 100 keys"),
        Scenario("watermark-100keys", "sidecar", "watermark", 100, "watermark mode, 100 keys"),
        Scenario("recovery", "recovery", "sequence", 0, "start to /readyz with N pending"),
        Scenario("held-gap", "held", "sequence", 1, "one key held behind a gap, then filled"),
        Scenario("cost", "cost", "sequence", 100, "billed Firestore operations per message, TTL deletes, hotspots"),
        Scenario("scale-out", "scale-out", "sequence", 100, "1 vs 3 pods, failover, handover, lease upkeep", True),
        Scenario("relay", "relay", "sequence", 100, "outbox relay: 100 keys, a hot key, commit to publish, cost", True),
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
