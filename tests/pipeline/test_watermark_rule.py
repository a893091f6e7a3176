"""The pure watermark rule: examples, invariants, and soundness against a simulated subscription."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.pipeline.watermark_rule import (
    AGE_RESOLUTION_MS,
    MetricPoint,
    WatermarkParams,
    lookback_ms,
    newest_point,
    next_watermark,
)

PARAMS = WatermarkParams(safety_margin_ms=10_000, max_metric_delay_ms=180_000)
NOW = 1_800_000_000_000

# ---- examples ------------------------------------------------------------------------------


def test_fresh_point_gives_end_minus_age_minus_resolution_and_margin() -> None:
    point = MetricPoint(end_time_ms=NOW - 90_000, age_seconds=30)
    decision = next_watermark(point, NOW, PARAMS, previous_ms=None)
    assert decision.rule == "point"
    assert decision.advanced
    assert decision.watermark_ms == NOW - 90_000 - 30_000 - AGE_RESOLUTION_MS - 10_000


def test_attribute_timestamps_subtract_allowed_skew() -> None:
    params = WatermarkParams(safety_margin_ms=10_000, max_metric_delay_ms=180_000, allowed_skew_ms=2_000)
    point = MetricPoint(end_time_ms=NOW - 90_000, age_seconds=30)
    plain = next_watermark(point, NOW, PARAMS, None).watermark_ms
    assert next_watermark(point, NOW, params, None).watermark_ms == plain - 2_000


def test_no_point_advances_to_now_minus_max_metric_delay_and_margins() -> None:
    decision = next_watermark(None, NOW, PARAMS, previous_ms=NOW - 1_000_000)
    assert decision.rule == "missing_point"
    assert decision.watermark_ms == NOW - 180_000 - 10_000


def test_stale_point_falls_back_to_missing_point_rule() -> None:
    stale = MetricPoint(end_time_ms=NOW - 180_001, age_seconds=0)
    decision = next_watermark(stale, NOW, PARAMS, previous_ms=None)
    assert decision.rule == "missing_point"
    assert decision.watermark_ms == NOW - 180_000 - 10_000


def test_point_exactly_max_metric_delay_old_is_still_fresh() -> None:
    point = MetricPoint(end_time_ms=NOW - 180_000, age_seconds=0)
    assert next_watermark(point, NOW, PARAMS, None).rule == "point"


def test_fresh_point_with_old_backlog_wins_over_missing_point_rule() -> None:
    # The point says a message from an hour ago is still unacked: now - 190 s would release past it.
    point = MetricPoint(end_time_ms=NOW - 5_000, age_seconds=3600)
    decision = next_watermark(point, NOW, PARAMS, previous_ms=None)
    assert decision.rule == "point"
    assert decision.watermark_ms == NOW - 5_000 - 3_600_000 - AGE_RESOLUTION_MS - 10_000
    assert decision.watermark_ms < NOW - 180_000 - 10_000


def test_watermark_does_not_move_back_after_older_evidence() -> None:
    decision = next_watermark(MetricPoint(NOW - 1_000, 500), NOW, PARAMS, previous_ms=NOW - 60_000)
    assert not decision.advanced
    assert decision.watermark_ms == NOW - 60_000
    assert decision.candidate_ms < NOW - 60_000


def test_newest_point_prefers_latest_end_then_oldest_age() -> None:
    points = [MetricPoint(10_000, 3), MetricPoint(30_000, 1), MetricPoint(30_000, 7), MetricPoint(20_000, 0)]
    assert newest_point(points) == MetricPoint(30_000, 7)
    assert newest_point([]) is None


def test_lookback_covers_max_metric_delay_and_several_polls() -> None:
    assert lookback_ms(30_000, PARAMS) >= 180_000
    assert lookback_ms(120_000, PARAMS) >= 3 * 120_000


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"safety_margin_ms": -1, "max_metric_delay_ms": 1}, "safety_margin_ms"),
        ({"safety_margin_ms": 0, "max_metric_delay_ms": 0}, "max_metric_delay_ms"),
        ({"safety_margin_ms": 0, "max_metric_delay_ms": 1, "allowed_skew_ms": -5}, "allowed_skew_ms"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WatermarkParams(**kwargs)


def test_negative_age_is_rejected() -> None:
    with pytest.raises(ValueError, match="age_seconds"):
        MetricPoint(end_time_ms=0, age_seconds=-1)


# ---- invariants ----------------------------------------------------------------------------

params_st = st.builds(
    WatermarkParams,
    safety_margin_ms=st.integers(0, 60_000),
    max_metric_delay_ms=st.integers(1, 600_000),
    allowed_skew_ms=st.integers(0, 10_000),
)
points_st = st.one_of(
    st.none(),
    st.builds(MetricPoint, end_time_ms=st.integers(NOW - 3_600_000, NOW + 5_000), age_seconds=st.integers(0, 7200)),
)
previous_st = st.one_of(st.none(), st.integers(NOW - 7_200_000, NOW))


@given(point=points_st, params=params_st, previous=previous_st)
def test_watermark_never_moves_back(point: MetricPoint | None, params: WatermarkParams, previous: int | None) -> None:
    decision = next_watermark(point, NOW, params, previous)
    if previous is not None:
        assert decision.watermark_ms >= previous
        assert decision.advanced == (decision.watermark_ms > previous)
    assert decision.watermark_ms == max(
        decision.candidate_ms, previous if previous is not None else decision.candidate_ms
    )


@given(point=points_st, params=params_st, previous=previous_st)
def test_fresh_point_bounds_the_candidate(
    point: MetricPoint | None, params: WatermarkParams, previous: int | None
) -> None:
    decision = next_watermark(point, NOW, params, previous)
    if point is not None and NOW - point.end_time_ms <= params.max_metric_delay_ms:
        bound = point.end_time_ms - point.age_seconds * 1000 - params.safety_margin_ms - params.allowed_skew_ms
        assert decision.rule == "point"
        assert decision.candidate_ms <= bound
        assert decision.watermark_ms <= max(bound, previous if previous is not None else bound)


@given(point=points_st, params=params_st, previous=previous_st)
def test_missing_or_stale_point_advances_to_now_minus_delay(
    point: MetricPoint | None, params: WatermarkParams, previous: int | None
) -> None:
    if point is not None and NOW - point.end_time_ms <= params.max_metric_delay_ms:
        return  # a fresh point: the other property
    decision = next_watermark(point, NOW, params, previous)
    expected = NOW - params.max_metric_delay_ms - params.safety_margin_ms - params.allowed_skew_ms
    assert decision.rule == "missing_point"
    assert decision.candidate_ms == expected
    assert decision.watermark_ms == max(expected, previous if previous is not None else expected)


# ---- soundness against a simulated subscription ----------------------------------------------


@dataclass(frozen=True)
class SimMessage:
    publish_ms: int
    ack_ms: int | None
    """When the sidecar acked it (i.e. after storing it); None: still unacked at the end."""
    event_offset_ms: int
    """event time = publish time - offset; 0 <= offset <= allowed_skew."""


@st.composite
def worlds(draw: st.DrawFn) -> tuple[int, int, int, WatermarkParams, list[SimMessage], list[int], list[int]]:
    period = draw(st.integers(1_000, 60_000))
    visibility = draw(st.integers(0, 2 * period))
    params = WatermarkParams(
        # Zero margins are the edge where the rule itself must be exact.
        safety_margin_ms=draw(st.one_of(st.just(0), st.integers(0, 5_000))),
        # The operator's bound: at least period + visibility (DESIGN §4).
        max_metric_delay_ms=period + visibility + draw(st.integers(0, 30_000)),
        allowed_skew_ms=draw(st.one_of(st.just(0), st.integers(0, 5_000))),
    )
    horizon = 12 * period + visibility
    messages = []
    for _ in range(draw(st.integers(0, 12))):
        publish = draw(st.integers(0, horizon))
        ack = draw(st.one_of(st.none(), st.integers(publish, horizon + period)))
        messages.append(
            SimMessage(
                publish,
                ack,
                draw(st.sampled_from([0, params.allowed_skew_ms]) | st.integers(0, params.allowed_skew_ms)),
            )
        )
    grid_offset = draw(st.integers(-period, 0))
    # Each sample becomes visible some time within the visibility delay.
    sample_count = horizon // period + 4
    delays = draw(st.lists(st.integers(0, visibility), min_size=sample_count, max_size=sample_count))
    polls = sorted(draw(st.lists(st.integers(0, horizon + period), min_size=1, max_size=15)))
    return period, visibility, grid_offset, params, messages, delays, polls


def _unacked_at(messages: list[SimMessage], instant: int) -> list[SimMessage]:
    return [m for m in messages if m.publish_ms <= instant and (m.ack_ms is None or m.ack_ms > instant)]


@settings(max_examples=300, deadline=None)
@given(world=worlds())
def test_nothing_unstored_is_ever_at_or_below_the_watermark(
    world: tuple[int, int, int, WatermarkParams, list[SimMessage], list[int], list[int]],
) -> None:
    """Whatever the acks and metric delays, W never passes a message that is not stored yet."""
    period, _visibility, grid_offset, params, messages, delays, polls = world
    samples: list[tuple[int, int, MetricPoint]] = []  # (sample time, visible from, point)
    for k, delay in enumerate(delays):
        instant = grid_offset + k * period
        backlog = _unacked_at(messages, instant)
        if backlog:  # an empty backlog reports no point at all
            oldest = min(m.publish_ms for m in backlog)
            samples.append((instant, instant + delay, MetricPoint(instant, (instant - oldest) // 1000)))
    watermark: int | None = None
    for now in polls:
        visible = [point for _, visible_from, point in samples if visible_from <= now]
        watermark = next_watermark(newest_point(visible), now, params, watermark).watermark_ms
        for message in messages:
            event_time = message.publish_ms - message.event_offset_ms
            if event_time <= watermark:
                assert message.ack_ms is not None and message.ack_ms <= now, (
                    f"released {message} at now={now} with watermark {watermark} before it was stored"
                )
