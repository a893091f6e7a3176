"""`pubsub-sidecar status --target ADDR [--json]`: what GetStatus says, for operators and scripts.

Rules this module keeps:
- Rendering is pure: ``status_to_dict`` and ``format_table`` take the GetStatusResponse and the
  instant to measure ages against (``now``), and read no clock, socket or environment. Only
  ``run_command`` / ``fetch_and_render`` talk to the sidecar.
- The JSON document is for scripts: its field names are stable (snake_case, units in the name,
  instants as RFC 3339 UTC strings, absent values as ``null``, never left out).
- The table is for people at 3 a.m.: one row per subscription, then for each subscription the keys
  that wait, with what they wait for, since when and for how long (G4: nothing waits silently).
  When the sidecar's per-key detail is cut at ``max_keys``, the table says how many waiting keys it
  does not show.
- Every stuck key comes with the command that frees it (``free_with``), built from the target and
  the subscription the report is about: a key stopped at a dead letter gets ``pubsub-sidecar
  unblock`` (refused, saying so, while its dead letter is still being published); a key waiting on
  a gap gets ``pubsub-sidecar skip-gap`` with ``--through`` its last missing sequence. Other keys
  free themselves (``null``). The table lists these commands under the waiting keys.
- Any failure to get an answer (sidecar unreachable, timeout, unknown subscription) is one line on
  stderr and exit code 1, never a traceback.
- Numbers say what they are: ``counts`` are running totals since the sidecar process started
  (they never fall, whatever shards move); the few values GetStatus's map carries that go up and
  down (``CURRENT_VALUES``) are under ``current``, and the table labels both.
- Lost leases are said plainly, with the cause (``lease_problem``: "Firestore unavailable since
  T"), above the shard line; a pod that owns no shard says so in words, not only "owns 0".
- Capacity: intake rate against delivery rate over the last minute, and when the backlog grows,
  for how long, in words ("BACKLOG GROWING for 5m02s: 20.0 msg/s more in than out").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import grpc

from pubsub_sidecar.v1 import sidecar_pb2
from pubsub_sidecar_client import get_status
from sidecar.commands.exit_codes import EXIT_FAILED, EXIT_OK

DEFAULT_MAX_KEYS = 50
"""Per-key detail asked for: the longest-waiting keys come first, and 50 rows still fit a screen's scroll."""

DEFAULT_TIMEOUT_SECONDS = 10.0
"""A healthy sidecar answers in milliseconds; ten seconds covers a busy event loop, not a hung one."""

WAITING_STATES = ("waiting_sequence", "waiting_watermark", "blocked_dead_letter", "backoff")
"""KeyStatus states in which a key holds messages back; the table lists these keys."""

CURRENT_VALUES = ("dead_letters_pending", "shards_loading", "lease_pods")
"""Values of GetStatus's ``counts`` map that are current figures (they go up and down), not running totals."""

_COUNT_ORDER = ("stored", "delivered", "acked", "nacked", "expired", "duplicates", "dead_lettered", "late", "skipped")
"""Counters shown first, in the order a message meets them; any others follow alphabetically."""


# ---- pure conversions ------------------------------------------------------------------------


def _rfc3339(instant: datetime) -> str:
    text = instant.astimezone(UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def _timestamp(holder: Any, field_name: str) -> datetime | None:
    """A Timestamp field as an aware UTC datetime, or None when the field is unset."""
    if not holder.HasField(field_name):
        return None
    moment: datetime = getattr(holder, field_name).ToDatetime(tzinfo=UTC)
    return moment


def _seconds(holder: Any, field_name: str) -> float | None:
    """A Duration field in seconds, or None when the field is unset."""
    if not holder.HasField(field_name):
        return None
    nanoseconds: int = getattr(holder, field_name).ToNanoseconds()
    return nanoseconds / 1e9


def _optional_int(holder: Any, field_name: str) -> int | None:
    return int(getattr(holder, field_name)) if holder.HasField(field_name) else None


def format_age(seconds: float | None) -> str:
    """A duration for people: "850ms", "42s", "5m02s", "3h04m", "2d03h"; "-" when unknown."""
    if seconds is None:
        return "-"
    # A clock a little behind the sidecar's gives a small negative age: it means "just now".
    seconds = max(seconds, 0.0)
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _ordered_counts(counts: dict[str, int]) -> dict[str, int]:
    known = [name for name in _COUNT_ORDER if name in counts]
    others = sorted(name for name in counts if name not in _COUNT_ORDER)
    return {name: counts[name] for name in [*known, *others]}


def free_with(key: sidecar_pb2.KeyStatus, target: str, subscription: str) -> str | None:
    """The command line that frees ``key`` when only an operator can (module docstring), else None."""
    where = ["--target", shlex.quote(target or "ADDR"), "--subscription", shlex.quote(subscription)]
    where += ["--key", shlex.quote(key.key)]
    if key.state == "blocked_dead_letter":
        return " ".join(["pubsub-sidecar", "unblock", *where])
    if key.state == "waiting_sequence" and key.HasField("last_missing_sequence"):
        return " ".join(["pubsub-sidecar", "skip-gap", *where, "--through", str(key.last_missing_sequence)])
    return None


def key_to_dict(key: sidecar_pb2.KeyStatus, now: datetime, target: str = "", subscription: str = "") -> dict[str, Any]:
    since = _timestamp(key, "since")
    return {
        "key": key.key,
        "state": key.state,
        "waiting_for": key.waiting_for,
        "since": _rfc3339(since) if since is not None else None,
        "age_seconds": round((now - since).total_seconds(), 3) if since is not None else None,
        "buffered": key.buffered,
        "in_flight": key.in_flight,
        "next_sequence": _optional_int(key, "next_sequence"),
        "missing_sequence": _optional_int(key, "missing_sequence"),
        "last_missing_sequence": _optional_int(key, "last_missing_sequence"),
        "free_with": free_with(key, target, subscription),
    }


def subscription_to_dict(sub: sidecar_pb2.SubscriptionStatus, now: datetime, target: str = "") -> dict[str, Any]:
    watermark = _timestamp(sub, "watermark")
    return {
        "name": sub.name,
        "mode": sub.mode,
        "buffered": sub.buffered,
        "ready": sub.ready,
        "in_flight": sub.in_flight,
        "keys": sub.keys,
        "keys_blocked": sub.keys_blocked,
        "oldest_undelivered_age_seconds": _seconds(sub, "oldest_undelivered_age"),
        "watermark": _rfc3339(watermark) if watermark is not None else None,
        "watermark_lag_seconds": _seconds(sub, "watermark_lag"),
        "counts": _ordered_counts({name: value for name, value in sub.counts.items() if name not in CURRENT_VALUES}),
        "keys_detail": [key_to_dict(key, now, target, sub.name) for key in sub.keys_detail],
        "pod": sub.pod,
        "shard_count": sub.shard_count,
        "shards": [{"shard": shard.shard, "epoch": shard.epoch} for shard in sub.shards],
        "pull_failure": sub.pull_failure or None,
        "current": {name: sub.counts[name] for name in CURRENT_VALUES if name in sub.counts},
        "capacity": _capacity(sub),
        "lease_problem": sub.lease_problem or None,
    }


def _capacity(sub: sidecar_pb2.SubscriptionStatus) -> dict[str, Any] | None:
    """Intake against delivery over the last minute; None until the sidecar sampled enough of it."""
    if not sub.HasField("capacity"):
        return None
    capacity = sub.capacity
    growing_for = capacity.growing_for.ToNanoseconds() / 1e9
    return {
        "intake_per_second": round(capacity.intake_per_second, 3),
        "delivered_per_second": round(capacity.delivered_per_second, 3),
        "deficit_per_second": round(capacity.deficit_per_second, 3),
        "backlog_growing": growing_for > 0,
        "growing_for_seconds": round(growing_for, 3),
    }


def status_to_dict(response: sidecar_pb2.GetStatusResponse, now: datetime, target: str = "") -> dict[str, Any]:
    """The JSON document ``--json`` prints (stable field names; see the module docstring)."""
    return {
        "target": target,
        "generated_at": _rfc3339(now),
        "subscriptions": [subscription_to_dict(sub, now, target) for sub in response.subscriptions],
        "relays": [relay_to_dict(relay) for relay in response.relays],
    }


def relay_to_dict(relay: sidecar_pb2.RelayStatus) -> dict[str, Any]:
    """One outbox relay: its figures and its waiting room (``pubsub-sidecar outbox`` acts on it)."""
    return {
        "name": relay.name,
        "pending_entries": relay.pending_entries,
        "shards_held": relay.shards_held,
        "waiting_entries": relay.waiting_entries,
        "blocked_keys": relay.blocked_keys,
        "published": relay.published,
        "publish_failures": relay.publish_failures,
        "waiting": [
            {"entry_id": w.entry_id, "key": w.key or None, "reason": w.reason, "retry_helps": w.retry_helps}
            for w in relay.waiting
        ],
    }


def _relay_lines(relays: list[dict[str, Any]]) -> list[str]:
    """The relays' table, then each waiting entry with the command that acts on it."""
    header = ("RELAY", "PENDING", "SHARDS", "WAITING", "BLOCKED KEYS", "PUBLISHED", "PUBLISH FAILURES")
    rows = [
        (r["name"], *(str(r[f]) for f in ("pending_entries", "shards_held", "waiting_entries", "blocked_keys")),
         str(r["published"]), str(r["publish_failures"]))
        for r in relays
    ]  # fmt: skip
    lines = _render_rows(header, rows, numeric=frozenset({1, 2, 3, 4, 5, 6}))
    for relay in relays:
        for w in relay["waiting"]:
            action = "retry or discard" if w["retry_helps"] else "discard"
            lines.append(
                f"  {relay['name']}: entry {w['entry_id']} (key {w['key'] or '-'}) waits: {w['reason']}; "
                f"pubsub-sidecar outbox {action} (see outbox list)"
            )
    return lines


def _render_rows(header: Sequence[str], rows: Sequence[Sequence[str]], numeric: frozenset[int]) -> list[str]:
    """Left-aligned text columns, right-aligned numeric ones, two spaces apart."""
    widths = [
        max(len(header[i]), *(len(row[i]) for row in rows)) if rows else len(header[i]) for i in range(len(header))
    ]

    def line(cells: Sequence[str]) -> str:
        parts = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(cells)]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _watermark_cell(sub: dict[str, Any]) -> str:
    if sub["watermark"] is None:
        return "-"
    return f"{sub['watermark']} (lag {format_age(sub['watermark_lag_seconds'])})"


def format_table(response: sidecar_pb2.GetStatusResponse, now: datetime, target: str = "") -> str:
    """The human-readable report (ends with a newline)."""
    document = status_to_dict(response, now, target)
    lines: list[str] = []
    if target:
        lines.append(f"sidecar {target} at {document['generated_at']}")
        lines.append("")
    subscriptions = document["subscriptions"]
    if document["relays"]:
        lines.extend(_relay_lines(document["relays"]))
        lines.append("")
    if not subscriptions:
        lines.append("no subscriptions")
        return "\n".join(lines) + "\n"

    header = (
        "SUBSCRIPTION", "MODE", "BUFFERED", "READY", "IN FLIGHT", "KEYS", "BLOCKED", "OLDEST UNDELIVERED", "WATERMARK",
    )  # fmt: skip
    rows = [
        (
            sub["name"],
            sub["mode"],
            str(sub["buffered"]),
            str(sub["ready"]),
            str(sub["in_flight"]),
            str(sub["keys"]),
            str(sub["keys_blocked"]),
            format_age(sub["oldest_undelivered_age_seconds"]),
            _watermark_cell(sub),
        )
        for sub in subscriptions
    ]
    lines.extend(_render_rows(header, rows, numeric=frozenset({2, 3, 4, 5, 6, 7})))

    for sub in subscriptions:
        lines.append("")
        lines.extend(_subscription_details(sub))
    return "\n".join(lines) + "\n"


def _subscription_details(sub: dict[str, Any]) -> list[str]:
    lines = [f"{sub['name']}:"]
    if sub["pull_failure"]:
        lines.append(f"  PUB/SUB DELIVERS NOTHING: {sub['pull_failure']}")
    if sub["lease_problem"]:
        lines.append(f"  LEASES LOST: {sub['lease_problem']}")
    if sub["shard_count"]:
        owned = " ".join(f"{s['shard']}@{s['epoch']}" for s in sub["shards"])
        if owned:
            lines.append(
                f"  pod {sub['pod']}: owns {len(sub['shards'])} of {sub['shard_count']} shards (shard@epoch): {owned}"
            )
        else:
            why = "its leases are lost (above)" if sub["lease_problem"] else "other pods own them, or none is taken yet"
            lines.append(f"  pod {sub['pod']}: owns none of {sub['shard_count']} shards: {why}; it delivers no key")
    capacity = sub["capacity"]
    if capacity is not None:
        rates = (
            f"intake {capacity['intake_per_second']:.1f} msg/s, "
            f"delivery {capacity['delivered_per_second']:.1f} msg/s (last minute)"
        )
        if capacity["backlog_growing"]:
            lines.append(
                f"  BACKLOG GROWING for {format_age(capacity['growing_for_seconds'])}: "
                f"{capacity['deficit_per_second']:.1f} msg/s more in than out; {rates}"
            )
        else:
            lines.append(f"  capacity: {rates}; the backlog does not grow")
    if sub["counts"]:
        lines.append(
            "  counts since the process started: "
            + " ".join(f"{name}={value}" for name, value in sub["counts"].items())
        )
    if sub["current"]:
        lines.append("  now: " + " ".join(f"{name}={value}" for name, value in sub["current"].items()))
    waiting = [key for key in sub["keys_detail"] if key["state"] in WAITING_STATES]
    if not waiting:
        if sub["keys_blocked"]:
            # The sidecar cut the per-key detail before reaching any waiting key.
            lines.append(f"  {sub['keys_blocked']} keys wait; none in the per-key detail the sidecar returned")
        else:
            lines.append("  no keys waiting")
        return lines
    header = ("KEY", "STATE", "WAITING FOR", "SINCE", "AGE", "BUFFERED", "IN FLIGHT")
    rows = [
        (
            key["key"],
            key["state"],
            key["waiting_for"] or "-",
            key["since"] or "-",
            format_age(key["age_seconds"]),
            str(key["buffered"]),
            str(key["in_flight"]),
        )
        for key in waiting
    ]
    lines.append(f"  keys waiting ({len(waiting)} of {sub['keys_blocked']}, longest first):")
    lines.extend("    " + row for row in _render_rows(header, rows, numeric=frozenset({4, 5, 6})))
    hidden = sub["keys_blocked"] - len(waiting)
    if hidden > 0:
        lines.append(f"    ... and {hidden} more waiting keys not shown")
    commands = [key["free_with"] for key in waiting if key["free_with"]]
    if commands:
        lines.append("  to free a stuck key:")
        lines.extend(f"    {command}" for command in commands)
    return lines


def format_json(response: sidecar_pb2.GetStatusResponse, now: datetime, target: str = "") -> str:
    return json.dumps(status_to_dict(response, now, target), indent=2) + "\n"


# ---- the command -----------------------------------------------------------------------------


def describe_rpc_error(target: str, error: grpc.RpcError) -> str:
    """One line saying what went wrong, for stderr."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or ""
    name = code.name if isinstance(code, grpc.StatusCode) else "ERROR"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        reason = f"cannot reach the sidecar at {target}"
    else:
        reason = f"the sidecar at {target} refused GetStatus"
    # gRPC details can span lines (a list of addresses tried): keep the report to one line.
    details = " ".join(details.split())
    return f"pubsub-sidecar status: {reason}: {name}" + (f": {details}" if details else "")


async def fetch_and_render(
    target: str,
    *,
    as_json: bool = False,
    max_keys: int = DEFAULT_MAX_KEYS,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Ask the sidecar at ``target`` and print the report; returns the exit code."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        response = await get_status(target, "", max_keys=max_keys, timeout_seconds=timeout_seconds)
    except grpc.RpcError as exc:
        print(describe_rpc_error(target, exc), file=err)
        return EXIT_FAILED
    now = datetime.now(UTC)
    out.write(format_json(response, now, target) if as_json else format_table(response, now, target))
    return EXIT_OK


def run_command(args: argparse.Namespace) -> int:
    """Entry point for ``pubsub-sidecar status``."""
    target = str(args.target).strip()
    if not target:
        print("pubsub-sidecar status: --target must be host:port or unix:///path, got an empty string", file=sys.stderr)
        return EXIT_FAILED
    return asyncio.run(
        fetch_and_render(
            target,
            as_json=bool(args.json),
            max_keys=int(getattr(args, "max_keys", DEFAULT_MAX_KEYS)),
            timeout_seconds=float(getattr(args, "timeout", DEFAULT_TIMEOUT_SECONDS)),
        )
    )
