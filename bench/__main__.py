"""`pubsub-sidecar bench` / `python -m bench`: the sidecar against the raw subscriber, in one run.

    python -m bench                      # full run (about 10-15 minutes on 2 cores)
    python -m bench --quick              # small sizes, under 3 minutes
    python -m bench --scenario seq-100keys --scenario recovery
    python -m bench --scenario smoke     # tiny: baseline + seq-100keys (the smoke test's run)
    python -m bench --quick --scenario scale-out   # 1 vs 3 pods, failover, hand-over (only when named)
    python -m bench --quick --scenario cost --compare bench/results/cost-before.json   # Firestore cost

Starts the emulators and one sidecar per scenario as real processes, prints one table and writes
``bench/results/<scenario>.json`` (with core count and package versions) for each scenario. Ratios
are to the baseline of the same run, since the machines are shared and noisy. Exit code 0 when
every scenario ran, 1 when one failed (its error is printed; the others still run).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import traceback
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.cost_report import compare_table, load_runs
from bench.emulators_process import Emulators
from bench.harness import BenchError
from bench.pubsub_clients import PubSub
from bench.runner import Runner
from bench.scenarios import METRIC_DELAY_SECONDS, METRIC_PERIOD_SECONDS, Result, Sizes, resolve
from bench.sidecar_process import PROFILER
from bench.tables import render_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FIRESTORE_INDEXES = Path(__file__).resolve().parent.parent / "firestore.indexes.json"
"""The index exemptions and TTL policies the repository ships for the sidecar's collections."""

_PACKAGES = (
    "pubsub-sidecar",
    "google-cloud-pubsub",
    "google-cloud-firestore",
    "google-cloud-monitoring",
    "grpcio",
    "protobuf",
)

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # header, Result attribute, format
    ("scenario", "scenario", "{}"),
    ("msgs", "messages", "{:,}"),
    ("msg/s", "messages_per_second", "{:,.0f}"),
    ("x base", "ratio_to_baseline", "{:.2f}"),
    ("p50 ms", "p50_ms", "{:,.0f}"),
    ("p99 ms", "p99_ms", "{:,.0f}"),
    ("rd/msg", "reads_per_message", "{:.2f}"),
    ("w+d/msg", "writes_deletes_per_message", "{:.2f}"),
    ("cpu s/10k", "cpu_seconds_per_10k", "{:.1f}"),
    ("rss MB", "peak_rss_mb", "{:.0f}"),
    ("ready s", "ready_seconds", "{:.1f}"),
    ("cpu x base", "cpu_ratio_to_baseline", "{:.1f}"),
)


def format_table(results: list[Result]) -> str:
    """One row per scenario; '-' where a scenario does not measure that column."""
    rows = [[header for header, _, _ in _COLUMNS]]
    for result in results:
        row = []
        for _, attr, fmt in _COLUMNS:
            value = getattr(result, attr)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    return render_table(rows)


def machine_info() -> dict[str, Any]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
    }


def write_json(results_dir: Path, result: Result, profile: str, sizes: Sizes, started_at: str) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{result.scenario}.json"
    body = {
        "result": asdict(result),
        "profile": profile,
        "sizes": asdict(sizes),
        "metric_period_seconds": METRIC_PERIOD_SECONDS,
        "metric_delay_seconds": METRIC_DELAY_SECONDS,
        "started_at": started_at,
        "machine": machine_info(),
    }
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return path


async def run_bench(
    names: list[str] | None,
    quick: bool,
    results_dir: Path,
    compare: Path | None = None,
    firestore_indexes: Path = FIRESTORE_INDEXES,
) -> int:
    sizes, profile, scenarios = resolve(names, quick)
    # Read before the run: a wrong path should not cost the run's minutes.
    before = load_runs(compare) if compare is not None else None
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    print(f"bench: profile {profile}, scenarios {', '.join(s.name for s in scenarios)}", flush=True)
    emulators = Emulators(METRIC_PERIOD_SECONDS, METRIC_DELAY_SECONDS, firestore_indexes=firestore_indexes)
    await asyncio.to_thread(emulators.start)
    for note in emulators.notes:
        print(f"bench: {note}", flush=True)
    results: list[Result] = []
    failures = 0
    pubsub = PubSub(emulators.env)
    try:
        with tempfile.TemporaryDirectory(prefix="pubsub-sidecar-bench-") as workdir:
            runner = Runner(emulators, pubsub, sizes, Path(workdir))
            for scenario in scenarios:
                print(f"bench: running {scenario.name} ({scenario.description})", flush=True)
                try:
                    result = await runner.run(scenario)
                except Exception as exc:
                    failures += 1
                    print(f"bench: {scenario.name} FAILED: {exc}", file=sys.stderr, flush=True)
                    if not isinstance(exc, BenchError):
                        traceback.print_exc()
                    continue
                results.append(result)
                failures += bool(result.extra.get("failed_runs"))
    finally:
        pubsub.close()
        emulators.stop()
    baseline = next((r for r in results if r.scenario == "baseline"), None)
    for result in results:
        if baseline and baseline.messages_per_second and result.messages_per_second is not None:
            result.ratio_to_baseline = result.messages_per_second / baseline.messages_per_second
        if (
            baseline
            and baseline.cpu_seconds_per_10k
            and result.cpu_seconds_per_10k is not None
            and result.scenario != "recovery"  # its CPU is a load's, not per delivered message
        ):
            result.cpu_ratio_to_baseline = result.cpu_seconds_per_10k / baseline.cpu_seconds_per_10k
        write_json(results_dir, result, profile, sizes, started_at)
    print()
    print(format_table(results))
    print(
        f"\ncores {os.cpu_count()}; latency phases at {sizes.latency_rate_per_second:g} msg/s; watermark "
        f"metric period {METRIC_PERIOD_SECONDS:g} s + delay {METRIC_DELAY_SECONDS:g} s; JSON in {results_dir}"
    )
    cost = next((r for r in results if r.scenario == "cost"), None)
    if before is not None:
        if cost is None:
            print(f"\nbench: --compare {compare}: the cost scenario did not run; nothing to compare", flush=True)
        else:
            print(f"\ncost, before ({compare}) -> now:\n{compare_table(cost.extra['runs'], before)}")
    return 1 if failures else 0


def run_command(args: argparse.Namespace) -> int:
    """Entry point for ``pubsub-sidecar bench`` (``sidecar.commands.main``) and ``python -m bench``."""
    results_dir = Path(getattr(args, "results_dir", None) or RESULTS_DIR)
    if getattr(args, "py_spy", None):
        PROFILER.directory = Path(args.py_spy)
    try:
        compare = getattr(args, "compare", None)
        indexes = Path(getattr(args, "firestore_indexes", None) or FIRESTORE_INDEXES)
        return asyncio.run(
            run_bench(args.scenario, bool(args.quick), results_dir, Path(compare) if compare else None, indexes)
        )
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under 3 minutes")
    parser.add_argument("--scenario", action="append", help="run only these scenarios (repeatable)")
    parser.add_argument("--results-dir", help=f"where the JSON goes (default {RESULTS_DIR})")
    parser.add_argument(
        "--py-spy",
        metavar="DIR",
        help="run every sidecar under py-spy record --gil; collapsed stacks in DIR (bench/profile_report.py)",
    )
    parser.add_argument(
        "--compare",
        metavar="PATH",
        help="print the cost scenario's rows next to an earlier cost.json's (bench/results/cost-before.json)",
    )
    parser.add_argument(
        "--firestore-indexes",
        metavar="PATH",
        help=f"the Firestore emulator's index config (default {FIRESTORE_INDEXES.name} at the repository root; "
        "a store that queries an exempted field needs one without that exemption)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(run_command(build_parser().parse_args()))
