"""WatermarkSource against a scripted Monitoring server: request shape, pages, and every kind of
"no answer" (errors, quota, partial answers, timeouts, no credentials) keeping the watermark frozen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest
from fake_monitoring import Answer, FakeMonitoring, series
from google.cloud.monitoring_v3.types import ListTimeSeriesRequest, ListTimeSeriesResponse

from sidecar.pipeline.watermark_rule import AGE_RESOLUTION_MS
from sidecar.pipeline.watermark_source import METRIC_TYPE, WatermarkSource

NOW = 1_800_000_000_000
MARGIN = 1_000
DELAY = 20_000


@dataclass
class Clock:
    now_ms: int = NOW

    def __call__(self) -> int:
        return self.now_ms


@dataclass
class Recorder:
    """``on_watermark`` that records values and can be told to fail."""

    values: list[int] = field(default_factory=list)
    fail: bool = False

    def __call__(self, watermark_ms: int) -> None:
        if self.fail:
            raise RuntimeError("runtime still recovering")
        self.values.append(watermark_ms)


@dataclass
class Script:
    """The fake's answers: a fixed one, replaceable by the test at any time."""

    answer: Answer | Callable[[ListTimeSeriesRequest], Answer] = field(default_factory=lambda: ListTimeSeriesResponse())

    def __call__(self, request: ListTimeSeriesRequest) -> Answer:
        return self.answer(request) if callable(self.answer) else self.answer


@pytest.fixture
async def fake(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeMonitoring, Script]]:
    script = Script()
    server = FakeMonitoring(script)
    await server.start()
    monkeypatch.setenv("MONITORING_EMULATOR_HOST", server.address)
    try:
        yield server, script
    finally:
        await server.stop()


def make_source(
    clock: Clock, recorder: Recorder, *, poll_interval_s: float = 0.05, skew_ms: int = 0, **kwargs: float
) -> WatermarkSource:
    return WatermarkSource(
        "demo-project",
        "orders",
        poll_interval_s,
        MARGIN,
        skew_ms,
        DELAY,
        recorder,
        clock,
        **kwargs,
    )


async def test_request_names_project_metric_subscription_and_lookback(
    fake: tuple[FakeMonitoring, Script],
) -> None:
    server, _ = fake
    source = make_source(Clock(), Recorder())
    try:
        await source.poll_once()
    finally:
        await source.close()
    (request,) = server.requests
    assert request.name == "projects/demo-project"
    assert f'metric.type = "{METRIC_TYPE}"' in request.filter
    assert 'resource.labels.subscription_id = "orders"' in request.filter
    end_ms = int(request.interval.end_time.timestamp() * 1000)
    start_ms = int(request.interval.start_time.timestamp() * 1000)
    assert end_ms == NOW
    assert end_ms - start_ms >= DELAY  # rule 2 must see any point at or after now - max_metric_delay


async def test_fresh_point_sets_watermark_and_calls_back(fake: tuple[FakeMonitoring, Script]) -> None:
    _, script = fake
    script.answer = ListTimeSeriesResponse(time_series=[series((NOW - 2_000, 5), (NOW - 3_000, 4))])
    recorder = Recorder()
    source = make_source(Clock(), recorder, skew_ms=500)
    try:
        decision = await source.poll_once()
    finally:
        await source.close()
    expected = NOW - 2_000 - 5_000 - AGE_RESOLUTION_MS - MARGIN - 500
    assert decision.rule == "point"
    assert source.watermark_ms == expected
    assert recorder.values == [expected]
    assert source.lag_ms(NOW) == NOW - expected
    assert source.last_error is None
    assert source.last_success_ms == NOW


async def test_newest_point_on_a_later_page_is_used(fake: tuple[FakeMonitoring, Script]) -> None:
    server, script = fake

    def paged(request: ListTimeSeriesRequest) -> Answer:
        if not request.page_token:
            return ListTimeSeriesResponse(time_series=[series((NOW - 9_000, 1))], next_page_token="p2")
        return ListTimeSeriesResponse(time_series=[series((NOW - 1_000, 1), subscription_id="orders")])

    script.answer = paged
    source = make_source(Clock(), Recorder())
    try:
        await source.poll_once()
    finally:
        await source.close()
    assert len(server.requests) == 2
    assert source.watermark_ms == NOW - 1_000 - 1_000 - AGE_RESOLUTION_MS - MARGIN


async def test_empty_answer_applies_missing_point_rule(fake: tuple[FakeMonitoring, Script]) -> None:
    source = make_source(Clock(), Recorder())
    try:
        decision = await source.poll_once()
    finally:
        await source.close()
    assert decision.rule == "missing_point"
    assert source.watermark_ms == NOW - DELAY - MARGIN


async def test_partial_answer_is_no_answer_and_keeps_watermark(fake: tuple[FakeMonitoring, Script]) -> None:
    _, script = fake
    clock = Clock()
    recorder = Recorder()
    source = make_source(clock, recorder)
    try:
        await source.poll_once()
        before = source.watermark_ms
        # An answer with no points but an execution error: rule 2 would advance if it were trusted.
        script.answer = ListTimeSeriesResponse(execution_errors=[{"code": 14, "message": "shard down"}])
        clock.now_ms += 60_000
        with pytest.raises(Exception, match="partial answer"):
            await source.poll_once()
    finally:
        await source.close()
    assert source.watermark_ms == before
    assert recorder.values == [before]
    assert source.last_error is not None and "shard down" in source.last_error


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
async def test_errors_freeze_watermark_back_off_and_recover(
    fake: tuple[FakeMonitoring, Script], code: grpc.StatusCode
) -> None:
    _, script = fake
    clock = Clock()
    recorder = Recorder()
    source = make_source(clock, recorder, poll_interval_s=0.02, max_backoff_s=0.3)
    task = asyncio.create_task(source.run())
    try:
        await wait_for(lambda: source.watermark_ms is not None, "first watermark")
        frozen = source.watermark_ms
        script.answer = code
        clock.now_ms += 600_000  # time passes: any rule applied now would advance W
        failing_since = time.monotonic()
        await wait_for(lambda: source.status().consecutive_errors >= 6, "six failed polls")
        # Backoff: the sleeps after errors 1..5 are at least half of 20, 40, 80, 160, 300 ms.
        # Without backoff six errors would take about 6 x 20 ms.
        assert time.monotonic() - failing_since >= 0.30
        status = source.status()
        assert status.watermark_ms == frozen
        assert recorder.values == [frozen]
        assert status.last_error is not None and status.last_error.startswith(code.name)
        assert status.last_success_ms == NOW
        script.answer = ListTimeSeriesResponse()
        await wait_for(lambda: source.last_error is None, "recovery")
        assert source.watermark_ms == clock.now_ms - DELAY - MARGIN
        assert recorder.values == [frozen, clock.now_ms - DELAY - MARGIN]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await source.close()


async def test_close_stops_a_running_source(fake: tuple[FakeMonitoring, Script]) -> None:
    server, _ = fake
    source = make_source(Clock(), Recorder())
    task = asyncio.create_task(source.run())
    await wait_for(lambda: len(server.requests) >= 2, "two polls")
    await source.close()
    assert task.cancelled()
    calls = len(server.requests)
    await source.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await source.poll_once()
    assert len(server.requests) == calls


async def test_slow_answer_times_out_and_counts_as_error(fake: tuple[FakeMonitoring, Script]) -> None:
    server, _ = fake
    server.delay_seconds = 2.0
    source = make_source(Clock(), Recorder(), request_timeout_s=0.2)
    try:
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - the library maps the deadline to its own exception type
            await source.poll_once()
        assert time.monotonic() - started < 1.5
    finally:
        await source.close()
    assert source.watermark_ms is None
    assert source.last_error is not None and "DEADLINE_EXCEEDED" in source.last_error


async def test_failed_callback_is_offered_again_after_next_poll(fake: tuple[FakeMonitoring, Script]) -> None:
    clock = Clock()
    recorder = Recorder(fail=True)
    source = make_source(clock, recorder)
    try:
        await source.poll_once()
        assert recorder.values == []
        recorder.fail = False
        await source.poll_once()  # same clock: W unchanged, but still not delivered
        assert recorder.values == [NOW - DELAY - MARGIN]
        await source.poll_once()
        assert recorder.values == [NOW - DELAY - MARGIN]  # never the same value twice
    finally:
        await source.close()


async def test_without_credentials_production_client_reports_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.delenv("MONITORING_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", f"{tmp_path}/missing.json")
    source = make_source(Clock(), Recorder())
    try:
        with pytest.raises(Exception, match=r"missing\.json"):
            await source.poll_once()
    finally:
        await source.close()
    assert source.watermark_ms is None
    assert source.last_error is not None and "DefaultCredentialsError" in source.last_error


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("demo-project", "projects/demo-project/subscriptions/orders", 1.0), "subscription_id"),
        (("Demo Project", "orders", 1.0), "project"),
        (("demo-project", "orders", 0.0), "poll_interval_s"),
    ],
)
def test_bad_arguments_name_the_field(args: tuple[str, str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WatermarkSource(*args, 0, 0, 1000, Recorder())


async def wait_for(predicate: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        await asyncio.sleep(0.01)
