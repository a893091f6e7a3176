"""The watermark rule of watermark mode (DESIGN §4): metric point in, watermark out. Pure.

No I/O, no clock: the newest metric point, ``now_ms`` and the previous watermark are arguments.
``sidecar.pipeline.watermark_source`` does the polling and feeds this module.

**What the metric says.** ``pubsub.googleapis.com/subscription/oldest_unacked_message_age`` is a
gauge: a point with end time ``E`` and value ``A`` (whole seconds) says that at instant ``E`` the
oldest message not yet acked on the subscription was published at ``E - A`` (give or take the
one-second resolution of ``A``). The sidecar acks a message only once Firestore holds it, so at
``E`` every message published before ``E - A`` was acked, hence stored. Acked messages do not come
back, so this stays true after ``E``. Only publish times carry that guarantee; an event-time
attribute is trusted to lag its publish time by at most ``allowed_skew``.

**Rule 1, a point.** From the newest visible point:
``W = E - (A + 1 s) - safety_margin - allowed_skew``. The extra second covers the metric's
resolution: if the age is truncated to whole seconds, the true oldest publish time may be up to
1 s before ``E - A`` (a conservative addition to DESIGN's formula, costing 1 s of latency).
``safety_margin`` covers clock differences between Monitoring, Pub/Sub and this host.

**Rule 2, no fresh point.** An empty backlog reports no point at all, and points are late: sampled
every period ``P`` and visible up to ``V`` later. ``max_metric_delay`` = ``D`` is the operator's
bound ``D >= P + V``. Claim: if no visible point has ``E >= now - D``, every message published at
or before ``now - D`` is already acked. Proof: the sample taken at the last grid instant
``s <= now - V`` is visible by now, and ``s > now - V - P >= now - D``. A message published at
``t <= now - D < s`` and not acked at ``s`` would make the sample at ``s`` non-empty, i.e. a
visible point with ``E = s >= now - D``: contradiction. (A message not acked *now* was not acked
at ``s`` either, since acks are final.) So ``W`` may advance to
``now - D - safety_margin - allowed_skew``. Points older than ``D`` change nothing: their rule 1
value ``E - A - ...`` is below ``now - D - ...`` anyway.

**A fresh point wins.** When a point with ``E >= now - D`` exists, rule 2 does not apply, even
if that point says the backlog is old: the point is evidence of an unacked message, and
``now - D`` could be past it. Only rule 1 applies then.

**"No answer" is not "no point".** Rule 2 needs a complete, successful answer from Monitoring.
A failed or partial query must not reach this module (the caller keeps the last watermark).

**W never moves back:** the result is ``max(previous, candidate)``. A candidate below the
previous watermark (an older point seen after a fresher one, a slower sampling) is ignored.

Assumptions the rule rests on, to be stated to users: only this sidecar acks the subscription,
nobody seeks it back, ``D >= P + V`` (180 s in production: 60 s sampling + 120 s visibility),
``safety_margin`` exceeds the clock offset between this host and Google, and the metric query
targets the right project and subscription (a wrong filter looks exactly like an empty backlog).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

AGE_RESOLUTION_MS = 1000
"""The metric's value is an integer number of seconds: the true age may be up to 1 s larger."""

Rule = Literal["point", "missing_point"]


@dataclass(frozen=True, slots=True)
class MetricPoint:
    """One point of the oldest-unacked-age gauge: at ``end_time_ms`` the oldest unacked message
    was ``age_seconds`` old."""

    end_time_ms: int
    age_seconds: int

    def __post_init__(self) -> None:
        if self.age_seconds < 0:
            raise ValueError(f"age_seconds: must not be negative, got {self.age_seconds}")


@dataclass(frozen=True, slots=True)
class WatermarkParams:
    """The rule's settings, in milliseconds (config: ``ordering.watermark`` and ``timestamp``)."""

    safety_margin_ms: int
    max_metric_delay_ms: int
    allowed_skew_ms: int = 0
    """Non-zero only when timestamps come from an attribute (DESIGN §4)."""

    def __post_init__(self) -> None:
        if self.safety_margin_ms < 0:
            raise ValueError(f"safety_margin_ms: must not be negative, got {self.safety_margin_ms}")
        if self.allowed_skew_ms < 0:
            raise ValueError(f"allowed_skew_ms: must not be negative, got {self.allowed_skew_ms}")
        if self.max_metric_delay_ms <= 0:
            raise ValueError(f"max_metric_delay_ms: must be positive, got {self.max_metric_delay_ms}")

    @property
    def margins_ms(self) -> int:
        return self.safety_margin_ms + self.allowed_skew_ms


@dataclass(frozen=True, slots=True)
class WatermarkDecision:
    """The outcome of one successful poll."""

    watermark_ms: int
    """The new watermark: ``max(previous, candidate_ms)``."""
    candidate_ms: int
    """What this poll's evidence alone allows."""
    rule: Rule
    """Which rule produced the candidate."""
    advanced: bool
    """True when ``watermark_ms`` is above the previous watermark (or there was none)."""


def is_fresh(point: MetricPoint, now_ms: int, params: WatermarkParams) -> bool:
    """A point no older than ``max_metric_delay``: while one exists, rule 2 must not apply."""
    return now_ms - point.end_time_ms <= params.max_metric_delay_ms


def point_bound_ms(point: MetricPoint, params: WatermarkParams) -> int:
    """Rule 1: every message with a timestamp at or below this is stored (module docstring)."""
    return point.end_time_ms - point.age_seconds * 1000 - AGE_RESOLUTION_MS - params.margins_ms


def missing_point_bound_ms(now_ms: int, params: WatermarkParams) -> int:
    """Rule 2, valid only when no fresh point is visible after a complete, successful query."""
    return now_ms - params.max_metric_delay_ms - params.margins_ms


def newest_point(points: Iterable[MetricPoint]) -> MetricPoint | None:
    """The point with the latest end time; among equal end times the oldest age (conservative)."""
    best: MetricPoint | None = None
    for point in points:
        if (
            best is None
            or point.end_time_ms > best.end_time_ms
            or (point.end_time_ms == best.end_time_ms and point.age_seconds > best.age_seconds)
        ):
            best = point
    return best


def next_watermark(
    newest: MetricPoint | None,
    now_ms: int,
    params: WatermarkParams,
    previous_ms: int | None,
) -> WatermarkDecision:
    """Apply rules 1 and 2 to the newest point of a complete answer and keep W monotonic."""
    if newest is not None and is_fresh(newest, now_ms, params):
        candidate = point_bound_ms(newest, params)
        rule: Rule = "point"
    else:
        # A stale point's own bound is below this one, so it needs no separate case.
        candidate = missing_point_bound_ms(now_ms, params)
        rule = "missing_point"
    if previous_ms is None or candidate > previous_ms:
        return WatermarkDecision(watermark_ms=candidate, candidate_ms=candidate, rule=rule, advanced=True)
    return WatermarkDecision(watermark_ms=previous_ms, candidate_ms=candidate, rule=rule, advanced=False)


def lookback_ms(poll_interval_ms: int, params: WatermarkParams) -> int:
    """How far back each query reaches.

    Rule 2 only needs to know whether a point at or after ``now - max_metric_delay`` exists, so the
    window must cover ``max_metric_delay``; a few poll intervals and a minute more tolerate a slow
    poll and clock offsets. Older points never matter (their bound is below rule 2's).
    """
    return max(3 * poll_interval_ms, params.max_metric_delay_ms) + _LOOKBACK_SLACK_MS


_LOOKBACK_SLACK_MS = 60_000
"""One production sampling period of slack on top of the window rule 2 needs."""
