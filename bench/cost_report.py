"""What the cost scenario's figures are worth and how they print: list prices, the per-message
table, the hotspots, the goals and the side-by-side comparison with an earlier ``cost.json``.

A figure the emulator does not count yet (``ttl_deletes``, ``hotspots``) is None and prints "n/a".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import BenchError
from bench.tables import render_table


@dataclass(frozen=True, slots=True)
class Prices:
    """US dollars per 100,000 documents."""

    reads: float
    writes: float
    deletes: float


@dataclass(frozen=True, slots=True)
class PriceList:
    as_of: str
    source: str
    regional: Prices
    multi_region: Prices


LIST_PRICES = PriceList(
    # Firestore (Standard edition) list prices beyond the free quota, checked on this date against
    # the "Pricing by location" table of the Firestore pricing page: the cheapest regional tier
    # (e.g. us-west1 Oregon, us-central1 Iowa; some regions cost up to about 20% more) and the US
    # multi-region (nam5). TTL deletes are billed as deletes and have no free quota.
    as_of="2026-12-01",
    source="https://firebase.google.com/docs/firestore/pricing (https://cloud.google.com/firestore/pricing)",
    regional=Prices(reads=0.03, writes=0.09, deletes=0.01),
    multi_region=Prices(reads=0.06, writes=0.18, deletes=0.02),
)

HOTSPOT_LIMIT_PER_SECOND = 500.0
"""Production's sustained write rate to a collection whose indexed field grows monotonically."""


def price_per_million(per_message: Mapping[str, float], prices: Prices) -> float:
    """US dollars per million messages: ``per_message`` reads/writes/deletes at ``prices``."""
    per_100k_messages = (
        per_message["reads"] * prices.reads
        + per_message["writes"] * prices.writes
        + per_message["deletes"] * prices.deletes
    )
    return per_100k_messages * 10.0


def _fmt(value: float | None, spec: str = "{:.2f}") -> str:
    return "n/a" if value is None else spec.format(value)


def peak_hotspot(run: Mapping[str, Any]) -> float | None:
    """The run's largest appends/s over every (group, field); None when the emulator has no counter."""
    hotspots = run.get("hotspots")
    if hotspots is None:
        return None
    return max((h["peak_per_s"] for h in hotspots), default=0.0)


_HEADER = (
    "run", "msgs", "msg/s", "rd/msg", "wr/msg", "del/msg", "ttl/msg", "billed/msg", "upkeep/msg",
    "$/M reg", "$/M multi", "hot peak/s",
)  # fmt: skip


def _cells(run: Mapping[str, Any]) -> list[str]:
    if run.get("error"):
        return [run["run"], "FAILED", *["-"] * (len(_HEADER) - 2)]
    per = run["per_message"]
    return [
        run["run"],
        f"{run['messages']:,}",
        f"{run['messages_per_second']:,.0f}",
        _fmt(per["reads"]),
        _fmt(per["writes"]),
        _fmt(per["deletes"]),
        _fmt(per["ttl_deletes"]),
        _fmt(per["billed"]),
        _fmt(run["upkeep_estimate_per_message"]),
        _fmt(run["price_per_million"]["regional"]),
        _fmt(run["price_per_million"]["multi_region"]),
        _fmt(peak_hotspot(run), "{:,.0f}"),
    ]


def cost_table(runs: Sequence[Mapping[str, Any]]) -> str:
    return render_table([list(_HEADER), *(_cells(run) for run in runs)])


_HOTSPOTS_SHOWN = 5


def hotspot_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per run: the (group, field)s with the highest peak appends/s, the largest first."""
    lines = []
    for run in runs:
        hotspots = run.get("hotspots")
        if run.get("error"):
            continue
        if hotspots is None:
            lines.append(f"  {run['run']}: n/a (the emulator has no hotspot counter)")
        elif not hotspots:
            lines.append(f"  {run['run']}: no appends to any indexed field")
        else:
            top = hotspots[:_HOTSPOTS_SHOWN]
            cells = ", ".join(f"{h['field']} {h['peak_per_s']:,.0f}/s ({h['appends']:,})" for h in top)
            if len(hotspots) > len(top):
                cells += f", and {len(hotspots) - len(top)} more (the JSON has them all)"
            lines.append(f"  {run['run']}: {cells}")
    return lines


def report(extra: Mapping[str, Any]) -> str:
    """The scenario's printed summary: notes, the table, hotspots, idle upkeep and goals."""
    runs = extra["runs"]
    lines = [f"bench: cost: {note}" for note in extra["notes"]]
    lines += ["", cost_table(runs), ""]
    lines.append(
        "billed = reads + writes + deletes per distinct delivered message, counted from the first publish "
        "to after the TTL sweep (the idle window not included), TTL deletes (ttl) included in del, the "
        "upkeep during the stream included (upkeep: its estimate, the idle rate times that window); $/M: "
        f"US dollars per million messages at list prices of {LIST_PRICES.as_of} (regional, multi-region)"
    )
    lines.append("hotspots, peak appends/s (appends in the window), largest first:")
    lines += hotspot_lines(runs)
    lines.append("idle upkeep (app connected, before publishing; not in the figures per message):")
    for run in runs:
        if not run.get("error"):
            idle = run["idle"]
            lines.append(
                f"  {run['run']}: {idle['billed_per_second']:.1f} billed ops/s over {idle['seconds']:.0f} s "
                f"({_counter_text(idle['counters'])})"
            )
    lines.append("goals:")
    lines += [f"  {g['status']:>6}  {g['goal']}: {g['figure']}" for g in extra["goals"]]
    return "\n".join(lines)


def _counter_text(counters: Mapping[str, int]) -> str:
    return ", ".join(f"{counters[name]} {name}" for name in ("reads", "writes", "deletes") if name in counters)


# ---- side by side with an earlier run --------------------------------------------------------------


def load_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of an earlier ``cost.json`` (as ``write_json`` writes it)."""
    try:
        body = json.loads(path.read_text())
        runs: list[dict[str, Any]] = body["result"]["extra"]["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"--compare {path}: not a cost.json of this benchmark ({exc!r})") from None
    return runs


def _figures(run: Mapping[str, Any] | None) -> dict[str, float | None]:
    if run is None or run.get("error"):
        return {}
    per = run["per_message"]
    return {
        "msg/s": run["messages_per_second"],
        "rd/msg": per["reads"],
        "wr/msg": per["writes"],
        "del/msg": per["deletes"],
        "ttl/msg": per["ttl_deletes"],
        "billed/msg": per["billed"],
        "$/M reg": run["price_per_million"]["regional"],
        "hot peak/s": peak_hotspot(run),
    }


_COMPARED = ("msg/s", "rd/msg", "wr/msg", "del/msg", "ttl/msg", "billed/msg", "$/M reg", "hot peak/s")


def compare_table(now: Sequence[Mapping[str, Any]], before: Sequence[Mapping[str, Any]]) -> str:
    """One row per run of ``now`` (then any run only ``before`` has); each cell "before -> now"."""
    earlier = {run["run"]: run for run in before}
    names = [run["run"] for run in now] + [name for name in earlier if name not in {r["run"] for r in now}]
    current = {run["run"]: run for run in now}
    rows = [["run", *_COMPARED]]
    for name in names:
        was, is_ = _figures(earlier.get(name)), _figures(current.get(name))
        row = [name]
        for column in _COMPARED:
            spec = "{:,.0f}" if column in ("msg/s", "hot peak/s") else "{:.2f}"
            old = _fmt(was.get(column), spec) if was else "-"
            new = _fmt(is_.get(column), spec) if is_ else "-"
            row.append(f"{old} -> {new}")
        rows.append(row)
    return render_table(rows)
