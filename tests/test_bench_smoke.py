"""The benchmark harness starts, runs a tiny configuration and prints its table (not a benchmark).

The smoke run (`python -m bench --scenario smoke`) starts the emulators and a sidecar as real
processes, like the full run, with about 200 messages; the test checks that the table is printed
with numbers where numbers belong and that the JSON results carry the machine's description. The
workload generator and the scenario resolver are checked directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import format_table
from bench.cost import RUNS
from bench.cost import goals as cost_goals
from bench.cost import stream_for as cost_stream
from bench.cost_report import LIST_PRICES, compare_table, load_runs, price_per_million
from bench.emulators_process import billed_operations, numeric_counters
from bench.harness import BenchError, percentile
from bench.scenarios import Result, resolve
from bench.workload import build_stream

_REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_smoke_run_prints_table_with_numeric_columns(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--scenario", "smoke", "--results-dir", str(tmp_path)],
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    header_index = next(i for i, line in enumerate(lines) if line.startswith("scenario "))
    header = lines[header_index].split()
    assert header[:4] == ["scenario", "msgs", "msg/s", "x"], header
    rows = {line.split()[0]: line.split() for line in lines[header_index + 2 :] if line.strip()}
    rows = {name: cells for name, cells in rows.items() if name in ("baseline", "seq-100keys")}
    assert set(rows) == {"baseline", "seq-100keys"}, proc.stdout

    def number(cell: str) -> float:
        return float(cell.replace(",", ""))

    # scenario msgs msg/s x-base p50 p99 rd/msg w+d/msg cpu rss ready
    for cells in rows.values():
        assert number(cells[1]) >= 200
        assert number(cells[2]) > 0
        assert number(cells[4]) > 0 and number(cells[5]) >= number(cells[4])
    assert number(rows["baseline"][3]) == 1.0
    sidecar = rows["seq-100keys"]
    assert number(sidecar[3]) > 0
    # Messages behind a gap (and duplicates) are written to Firestore, the in-order rest takes the
    # fast path (no document): some writes, fewer than one per message. The process used CPU and memory.
    assert 0 < number(sidecar[7]) < 1.0
    assert number(sidecar[8]) > 0 and number(sidecar[9]) > 10

    stored = json.loads((tmp_path / "seq-100keys.json").read_text())
    assert stored["machine"]["cores"] >= 1
    assert stored["machine"]["packages"]["google-cloud-pubsub"]
    assert stored["result"]["extra"]["redeliveries_to_app"] == 0
    assert stored["result"]["extra"]["sidecar_error_log_lines"] == 0, stored["result"]["extra"]["first_sidecar_error"]


def test_stream_holds_every_sequence_once_plus_retries_and_some_out_of_order() -> None:
    stream, distinct = build_stream(10_000, 100, "throughput", "k-", seed=3)
    assert distinct == 10_000
    counts = Counter((m.key, m.sequence) for m in stream)
    assert {(f"k-{k}", s) for k in range(100) for s in range(1, 101)} == set(counts)
    retries = sum(c - 1 for c in counts.values())
    assert 50 <= retries <= 150  # 1% duplicated
    last: dict[str, int] = {}
    out_of_order = 0
    for message in stream:
        if message.sequence < last.get(message.key, 0):
            out_of_order += 1
        last[message.key] = max(last.get(message.key, 0), message.sequence)
    assert 500 <= out_of_order <= 1_500  # about 10% shuffled


def test_one_key_stream_is_still_complete() -> None:
    stream, distinct = build_stream(50, 1, "latency", "lat-", seed=1)
    assert distinct == 50
    assert {m.sequence for m in stream} == set(range(1, 51))
    assert {m.key for m in stream} == {"lat-0"}


def test_resolve_adds_the_baseline_and_rejects_unknown_names() -> None:
    sizes, profile, scenarios = resolve(["seq-1key"], quick=True)
    assert profile == "quick"
    assert [s.name for s in scenarios] == ["baseline", "seq-1key"]
    assert sizes.messages > 0
    _, profile, scenarios = resolve(["smoke"], quick=False)
    assert profile == "smoke"
    assert [s.name for s in scenarios] == ["baseline", "seq-100keys"]
    with pytest.raises(BenchError, match="unknown scenario 'nope'"):
        resolve(["nope"], quick=True)


def test_scale_out_runs_only_when_named_and_without_the_baseline() -> None:
    _, profile, scenarios = resolve(["scale-out"], quick=True)
    assert profile == "quick"
    assert [s.name for s in scenarios] == ["scale-out"]
    _, _, default = resolve(None, quick=False)
    assert "scale-out" not in [s.name for s in default] and "baseline" in [s.name for s in default]


def test_table_shows_dash_for_columns_a_scenario_does_not_measure() -> None:
    table = format_table([Result("recovery", "r", messages=100_000, ready_seconds=4.25, peak_rss_mb=120.4)])
    header, rule, row = table.splitlines()
    assert header.split()[0] == "scenario" and set(rule) <= {"-", " "}
    cells = row.split()
    assert cells[0] == "recovery" and cells[1] == "100,000" and cells[-2] == "4.2" and cells[-3] == "120"
    assert cells[2] == "-" and cells[-1] == "-"  # no msg/s, no CPU ratio


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) is None


# ---- the cost scenario's pieces (its run needs minutes: `python -m bench --quick --scenario cost`) ----


def test_cost_runs_by_default_but_not_in_the_smoke_preset_and_needs_no_baseline() -> None:
    _, _, default = resolve(None, quick=True)
    assert "cost" in [s.name for s in default]
    _, _, smoke = resolve(["smoke"], quick=False)
    assert "cost" not in [s.name for s in smoke]
    _, _, alone = resolve(["cost"], quick=True)
    assert [s.name for s in alone] == ["cost"]


def test_cost_streams_in_order_and_on_10000_keys_shuffled_like_100_keys() -> None:
    in_order, distinct, _ = cost_stream(RUNS[0], 3_000)
    assert RUNS[0].name == "seq-100keys-inorder" and distinct == 3_000 and len(in_order) == 3_000
    last: dict[str, int] = {}
    for message in in_order:
        assert message.sequence == last.get(message.key, 0) + 1
        last[message.key] = message.sequence
    many_keys = next(run for run in RUNS if run.keys == 10_000)
    stream, distinct, probability = cost_stream(many_keys, 20_000)
    assert distinct == 20_000 and probability > 0.1
    seen: dict[str, int] = {}
    out_of_order = 0
    for message in stream:
        if message.sequence < seen.get(message.key, 0):
            out_of_order += 1
        seen[message.key] = max(seen.get(message.key, 0), message.sequence)
    # A tenth of the positions start a swap, as on 100 keys (where 10,000 give 500-1,500).
    assert 1_500 <= out_of_order <= 2_500


def test_price_per_million_messages_at_list_prices() -> None:
    # Today's store: a create, a tombstone update, a TTL delete per message (the issue's $1.9).
    today = {"reads": 0.0, "writes": 2.0, "deletes": 1.0}
    assert price_per_million(today, LIST_PRICES.regional) == pytest.approx(1.90)
    assert price_per_million(today, LIST_PRICES.multi_region) == pytest.approx(3.80)
    assert price_per_million({"reads": 1.0, "writes": 0.0, "deletes": 0.0}, LIST_PRICES.regional) == pytest.approx(0.3)


def test_counters_keep_numbers_only_and_billed_does_not_count_ttl_deletes_twice() -> None:
    snapshot = {
        "reads": 10,
        "writes": 20,
        "deletes": 5,
        "ttl_deletes": 4,
        "hotspots": {"messages.stored_ms": {"appends": 3, "peak_per_s": 2.0}},
    }
    counters = numeric_counters(snapshot)
    assert counters == {"reads": 10, "writes": 20, "deletes": 5, "ttl_deletes": 4}
    assert billed_operations(counters) == 35


def _cost_run(name: str, billed: float, ttl: float | None = 1.0, peak: float | None = 100.0) -> dict[str, Any]:
    hotspots = None if peak is None else [{"field": "messages.stored_ms", "appends": 10, "peak_per_s": peak}]
    return {
        "run": name,
        "messages": 3_000,
        "messages_per_second": 500.0,
        "per_message": {"reads": 0.0, "writes": billed, "deletes": 0.0, "ttl_deletes": ttl, "billed": billed},
        "price_per_million": {"regional": billed * 0.9, "multi_region": billed * 1.8},
        "hotspots": hotspots,
    }


def test_cost_goals_met_missed_and_not_available() -> None:
    runs = [
        _cost_run("seq-100keys-inorder", 0.1),
        _cost_run("seq-100keys", 2.3),
        _cost_run("seq-10000keys", 2.2),
        _cost_run("watermark-100keys", 3.2, peak=500.0),
        {"run": "dedup-100keys", "error": "timed out"},
    ]
    status = {g["goal"].split(":")[0]: g["status"] for g in cost_goals(runs)}
    assert status == {
        "in-order, seq-100keys-inorder": "met",
        "shuffled, seq-100keys": "missed",
        "shuffled, seq-10000keys": "met",
        "watermark-100keys": "met",
        "dedup-100keys": "n/a",
        "seq-10000keys - seq-100keys <= +0.2": "met",
        "every hotspot peak < 500 appends/s": "missed",  # 500/s itself is over the limit
    }
    without_counters = cost_goals([_cost_run("seq-100keys", 2.0, ttl=None, peak=None)])
    shuffled = next(g for g in without_counters if g["goal"].startswith("shuffled, seq-100keys"))
    assert shuffled["status"] == "met" and shuffled["figure"] == "2.00 (TTL deletes not counted)"
    assert next(g for g in without_counters if "hotspot" in g["goal"])["status"] == "n/a"


def test_compare_puts_each_run_next_to_the_same_run_before() -> None:
    before = [_cost_run("seq-100keys", 2.59, ttl=None, peak=None), _cost_run("dedup-100keys", 2.15)]
    now = [_cost_run("seq-100keys-inorder", 0.05), _cost_run("seq-100keys", 1.8, peak=120.0)]
    header, _, *rows = compare_table(now, before).splitlines()
    assert header.split()[:2] == ["run", "msg/s"]
    cells = {row.split()[0]: row for row in rows}
    assert list(cells) == ["seq-100keys-inorder", "seq-100keys", "dedup-100keys"]
    assert "2.59 -> 1.80" in cells["seq-100keys"] and "n/a -> 120" in cells["seq-100keys"]
    assert "- -> 0.05" in cells["seq-100keys-inorder"]
    assert "2.15 -> -" in cells["dedup-100keys"]
    with pytest.raises(BenchError, match=r"not a cost\.json"):
        load_runs(Path(__file__))


def test_engine_bench_runs_a_tiny_stream(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.engine_bench`` builds its messages as the engine takes them and acks them all."""
    from bench import engine_bench

    stream, distinct = engine_bench.build_stream(2_000, 20)
    assert distinct == 2_000 and len(stream) >= distinct
    engine_bench.run(2_000, 20, freeze_input=False)
    out = capsys.readouterr().out
    assert "acked:                     2,000 (buffered left: 0)" in out
