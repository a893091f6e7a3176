"""The Monitoring emulator's filter parser and sampling rules, without a server (pure and fast)."""

from __future__ import annotations

from typing import Any

import pytest
from google.cloud.monitoring_v3 import types

from sidecar.emulators.monitoring import (
    NUM_UNDELIVERED,
    OLDEST_UNACKED_AGE,
    FilterError,
    MonitoringEmulator,
    Query,
    parse_filter,
)
from sidecar.emulators.pubsub_model import Backlog

SECOND = 1_000_000_000


@pytest.mark.parametrize(
    "text",
    [
        f'metric.type="{OLDEST_UNACKED_AGE}" AND resource.labels.subscription_id="s-1"',
        f"  metric.type =  \"{OLDEST_UNACKED_AGE}\"   and   resource.label.subscription_id = 's-1' ",
        f'metric.type = "{OLDEST_UNACKED_AGE}" AND resource.type = "pubsub_subscription" '
        'AND resource.labels.subscription_id = "s-1"',
    ],
)
def test_tolerant_filters_parse_to_the_same_query(text: str) -> None:
    query = parse_filter(text)
    assert (query.metric_type, query.subscription_id) == (OLDEST_UNACKED_AGE, "s-1")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('resource.labels.subscription_id = "s"', "metric.type"),
        ('metric.type = "custom.googleapis.com/x"', "unknown metric"),
        (f'metric.type = "{OLDEST_UNACKED_AGE}" AND metric.labels.x = "y"', "metric.labels.x"),
        (f'metric.type = "{OLDEST_UNACKED_AGE}" OR resource.labels.subscription_id = "s"', "cannot parse"),
    ],
)
def test_bad_filters_name_what_is_wrong(text: str, names: str) -> None:
    with pytest.raises(FilterError, match=names):
        parse_filter(text)


def request(metric: str, start_s: int, end_s: int, subscription_id: str = "s") -> Any:
    pb = types.ListTimeSeriesRequest.pb()(
        name="projects/p", filter=f'metric.type = "{metric}" AND resource.labels.subscription_id = "{subscription_id}"'
    )
    pb.interval.start_time.FromSeconds(start_s)
    pb.interval.end_time.FromSeconds(end_s)
    return pb


def test_samples_appear_after_the_delay_newest_first_and_only_with_a_backlog() -> None:
    now = [100 * SECOND]
    backlog: dict[str, Backlog] = {}
    emulator = MonitoringEmulator(
        lambda: dict(backlog), metric_period=10, metric_delay=20, wall_clock_ns=lambda: now[0]
    )
    emulator.sample_now()  # t=100: empty backlog, so no point
    backlog["projects/p/subscriptions/s"] = Backlog(oldest_publish_time_ns=95 * SECOND, num_undelivered=4)
    for t in (110, 120):
        now[0] = t * SECOND
        emulator.sample_now()
    assert list(emulator.answer(request(OLDEST_UNACKED_AGE, 0, 1000)).time_series) == []  # t=120: nothing visible
    now[0] = 140 * SECOND
    [series] = emulator.answer(request(OLDEST_UNACKED_AGE, 0, 1000)).time_series
    assert [(p.interval.end_time.seconds, p.value.int64_value) for p in series.points] == [(120, 25), (110, 15)]
    [count] = emulator.answer(request(NUM_UNDELIVERED, 0, 1000)).time_series
    assert [p.value.int64_value for p in count.points] == [4, 4]
    assert list(emulator.answer(request(OLDEST_UNACKED_AGE, 0, 1000, "other")).time_series) == []
    [narrow] = emulator.answer(request(OLDEST_UNACKED_AGE, 111, 1000)).time_series
    assert len(narrow.points) == 1


def test_query_defaults_leave_resource_filters_open() -> None:
    assert parse_filter(f'metric.type = "{NUM_UNDELIVERED}"') == Query(NUM_UNDELIVERED)
