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

import pytest

from bench.__main__ import format_table
from bench.harness import BenchError, percentile
from bench.scenarios import Result, build_stream, resolve

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
    # Every delivered message was written at least once to Firestore; the process used CPU and memory.
    assert number(sidecar[7]) >= 1.0
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
    assert cells[0] == "recovery" and cells[1] == "100,000" and cells[-1] == "4.2" and cells[-2] == "120"
    assert cells[2] == "-"


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) is None
