"""The watermark source of watermark mode: Cloud Monitoring's backlog metric -> the engine's watermark.

Polls ``ListTimeSeries`` for ``pubsub.googleapis.com/subscription/oldest_unacked_message_age`` of
one subscription with the official ``google-cloud-monitoring`` async client, hands the newest point
to the pure rule in ``sidecar.pipeline.watermark_rule`` (whose docstring holds the soundness argument) and
calls ``on_watermark`` each time the watermark advances. This is the only module of ours that
imports ``google.cloud.monitoring``.

Rules it keeps:

- The rule sees only complete, successful answers: all pages read, no ``execution_errors``, every
  point parsed. Anything else (an RPC error, RESOURCE_EXHAUSTED, a timeout, a partial answer, no
  credentials) is "no answer", never "no point": the watermark stays where it is, the error is kept
  in ``last_error``, and the next poll is backed off exponentially up to ``max_backoff_s``. An
  outage therefore delays delivery; it never releases early.
- The watermark never moves back, and ``on_watermark`` is called only with increasing values. If
  the callback raises (the runtime may still be recovering), the value is offered again after the
  next poll.
- Endpoint: production by default (Application Default Credentials); with ``MONITORING_EMULATOR_HOST``
  set, an insecure channel to that host (the client library has no emulator switch of its own,
  EMULATOR-NOTES §C). The client is made on first use, inside the event loop.
- The client library's own retry is switched off so that errors show in ``last_error`` at once;
  this loop is the retry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.api_core import exceptions as core_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud.monitoring_v3 import MetricServiceAsyncClient
from google.cloud.monitoring_v3.services.metric_service.transports import MetricServiceGrpcAsyncIOTransport
from google.cloud.monitoring_v3.types import ListTimeSeriesRequest, TimeInterval
from google.protobuf import timestamp_pb2

from sidecar.backoff import backoff_seconds
from sidecar.pipeline.watermark_rule import (
    MetricPoint,
    WatermarkDecision,
    WatermarkParams,
    lookback_ms,
    newest_point,
    next_watermark,
)

_LOGGER = logging.getLogger(__name__)

METRIC_TYPE = "pubsub.googleapis.com/subscription/oldest_unacked_message_age"
EMULATOR_HOST_ENV = "MONITORING_EMULATOR_HOST"

_SUBSCRIPTION_ID = re.compile(r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,254}")
"""Pub/Sub's rule for subscription ids: a typo here would look like an empty backlog forever."""

_PROJECT_ID = re.compile(r"[a-z0-9][a-z0-9\-.:]{0,99}")
"""Project ids and numbers (domain-scoped ids contain ':' and '.')."""

_DEFAULT_MAX_BACKOFF_SECONDS = 60.0
"""Monitoring read quotas are per minute: retrying faster than once a minute after repeated
RESOURCE_EXHAUSTED only burns the next minute's quota."""

_MIN_REQUEST_TIMEOUT_SECONDS = 10.0
"""A Monitoring query normally answers in well under a second; 10 s leaves room for a slow one."""


class MetricResponseError(Exception):
    """Monitoring answered, but not with a complete gauge of integer ages: treated as no answer."""


_POLL_ERRORS: tuple[type[BaseException], ...] = (
    core_exceptions.GoogleAPIError,  # every RPC status, including RESOURCE_EXHAUSTED, and RetryError
    grpc.RpcError,  # a raw channel error the library did not map
    auth_exceptions.GoogleAuthError,  # no Application Default Credentials, token refresh failures
    TimeoutError,
    OSError,
    MetricResponseError,
)
"""Errors that mean "no answer this time": back off and keep the watermark. Anything else is a bug
and ends ``run()``."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class WatermarkStatus:
    """What GetStatus and /metrics show about the source."""

    watermark_ms: int | None
    last_success_ms: int | None
    """When the last complete answer was received (this host's clock)."""
    last_error: str | None
    """The error of the latest poll, None once a poll succeeds again."""
    consecutive_errors: int
    newest_point: MetricPoint | None
    rule: str | None
    """Which rule produced the latest candidate: "point" or "missing_point"."""
    polls: int
    errors: int


class WatermarkSource:
    """Polls the backlog metric of one subscription and advances the watermark through ``on_watermark``."""

    def __init__(
        self,
        project: str,
        subscription_id: str,
        poll_interval_s: float,
        safety_margin_ms: int,
        allowed_skew_ms: int,
        max_metric_delay_ms: int,
        on_watermark: Callable[[int], None],
        clock: Callable[[], int] = wall_clock_ms,
        *,
        max_backoff_s: float = _DEFAULT_MAX_BACKOFF_SECONDS,
        request_timeout_s: float | None = None,
    ) -> None:
        if not _PROJECT_ID.fullmatch(project):
            raise ValueError(f"project: {project!r} is not a Google Cloud project id")
        if not _SUBSCRIPTION_ID.fullmatch(subscription_id):
            raise ValueError(
                f"subscription_id: {subscription_id!r} is not a Pub/Sub subscription id "
                "(pass the last segment of projects/P/subscriptions/ID)"
            )
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s: must be positive, got {poll_interval_s}")
        if not max_backoff_s >= poll_interval_s:
            raise ValueError(
                f"max_backoff_s: must be at least poll_interval_s ({poll_interval_s}), got {max_backoff_s}"
            )
        self._params = WatermarkParams(
            safety_margin_ms=safety_margin_ms,
            max_metric_delay_ms=max_metric_delay_ms,
            allowed_skew_ms=allowed_skew_ms,
        )
        self._project = project
        self._subscription_id = subscription_id
        self._poll_interval_s = poll_interval_s
        self._max_backoff_s = max_backoff_s
        self._request_timeout_s = request_timeout_s or max(_MIN_REQUEST_TIMEOUT_SECONDS, poll_interval_s)
        self._on_watermark = on_watermark
        self._clock = clock
        self._filter = f'metric.type = "{METRIC_TYPE}" AND resource.labels.subscription_id = "{subscription_id}"'
        self._client: MetricServiceAsyncClient | None = None
        self._closed = False
        self._run_task: asyncio.Task[object] | None = None

        self._watermark_ms: int | None = None
        self._delivered_ms: int | None = None
        self._last_success_ms: int | None = None
        self._last_error: str | None = None
        self._consecutive_errors = 0
        self._newest: MetricPoint | None = None
        self._rule: str | None = None
        self._polls = 0
        self._errors = 0

    # ---- what others read ------------------------------------------------------------------

    @property
    def watermark_ms(self) -> int | None:
        """None until the first complete answer; then never decreasing."""
        return self._watermark_ms

    def lag_ms(self, now_ms: int) -> int | None:
        """How far the watermark trails ``now_ms`` (None before the first watermark)."""
        return None if self._watermark_ms is None else now_ms - self._watermark_ms

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @property
    def last_success_ms(self) -> int | None:
        return self._last_success_ms

    def status(self) -> WatermarkStatus:
        return WatermarkStatus(
            watermark_ms=self._watermark_ms,
            last_success_ms=self._last_success_ms,
            last_error=self._last_error,
            consecutive_errors=self._consecutive_errors,
            newest_point=self._newest,
            rule=self._rule,
            polls=self._polls,
            errors=self._errors,
        )

    # ---- polling ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll until cancelled or closed. Poll errors are kept and backed off; only bugs end the loop."""
        if self._run_task is not None:
            raise RuntimeError("WatermarkSource.run() is already running")
        self._run_task = asyncio.current_task()
        try:
            await self._poll_forever()
        finally:
            self._run_task = None

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
                delay = self._poll_interval_s
            except _POLL_ERRORS as exc:
                delay = self._backoff_seconds()
                _LOGGER.warning(
                    "watermark of %s: Monitoring query failed (%s, %d in a row); watermark kept at %s, "
                    "next try in %.2fs",
                    self._subscription_id,
                    self._last_error,
                    self._consecutive_errors,
                    self._watermark_ms,
                    delay,
                    exc_info=not isinstance(exc, core_exceptions.GoogleAPICallError),
                )
            await asyncio.sleep(delay)

    async def poll_once(self) -> WatermarkDecision:
        """One query and, if it was complete, one step of the rule. Raises the query's error."""
        self._polls += 1
        now_ms = self._clock()
        try:
            points = await self._query(now_ms)
        except _POLL_ERRORS as exc:
            self._errors += 1
            self._consecutive_errors += 1
            self._last_error = _describe(exc)
            raise
        newest = newest_point(points)
        decision = next_watermark(newest, now_ms, self._params, self._watermark_ms)
        self._newest = newest
        self._rule = decision.rule
        self._watermark_ms = decision.watermark_ms
        self._last_success_ms = now_ms
        self._last_error = None
        self._consecutive_errors = 0
        self._maybe_notify()
        return decision

    def _maybe_notify(self) -> None:
        watermark = self._watermark_ms
        if watermark is None or (self._delivered_ms is not None and watermark <= self._delivered_ms):
            return
        try:
            self._on_watermark(watermark)
        except Exception:
            # Offered again after the next poll; the engine only ever sees increasing values.
            _LOGGER.warning(
                "watermark of %s: on_watermark(%d) failed; will offer it again",
                self._subscription_id,
                watermark,
                exc_info=True,
            )
            return
        self._delivered_ms = watermark

    async def _query(self, now_ms: int) -> list[MetricPoint]:
        client = self._get_client()
        request = ListTimeSeriesRequest(
            name=f"projects/{self._project}",
            filter=self._filter,
            interval=TimeInterval(
                start_time=_timestamp(now_ms - lookback_ms(round(self._poll_interval_s * 1000), self._params)),
                end_time=_timestamp(now_ms),
            ),
            view=ListTimeSeriesRequest.TimeSeriesView.FULL,
        )
        async with asyncio.timeout(self._request_timeout_s):
            pager = await client.list_time_series(request=request, retry=None, timeout=self._request_timeout_s)
            points: list[MetricPoint] = []
            async for page in pager.pages:
                points.extend(_points_of(page))
        return points

    def _get_client(self) -> MetricServiceAsyncClient:
        if self._closed:
            raise RuntimeError("WatermarkSource is closed")
        if self._client is None:
            host = os.environ.get(EMULATOR_HOST_ENV)
            if host:
                # A channel instance makes the transport skip credentials (EMULATOR-NOTES §C).
                transport = MetricServiceGrpcAsyncIOTransport(channel=grpc.aio.insecure_channel(host))
                self._client = MetricServiceAsyncClient(transport=transport)
            else:
                self._client = MetricServiceAsyncClient()
        return self._client

    def _backoff_seconds(self) -> float:
        """Exponential in the number of consecutive errors, from the poll interval, with jitter."""
        return backoff_seconds(max(0, self._consecutive_errors - 1), self._poll_interval_s, self._max_backoff_s)

    async def close(self) -> None:
        """Stop ``run()`` if it is running, then close the channel. Idempotent."""
        self._closed = True
        task = self._run_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # wait() rather than awaiting the task: its CancelledError is not ours to raise.
            await asyncio.wait({task})
        client, self._client = self._client, None
        if client is not None:
            await client.transport.close()  # type: ignore[no-untyped-call]  # untyped in the GAPIC transport


def _points_of(page: object) -> list[MetricPoint]:
    """The points of one ``ListTimeSeriesResponse`` page; raises MetricResponseError if it is partial."""
    raw = type(page).pb(page)  # type: ignore[attr-defined]  # proto-plus wrapper -> protobuf message
    if raw.execution_errors:
        first = raw.execution_errors[0]
        raise MetricResponseError(
            f"partial answer: {len(raw.execution_errors)} execution error(s), first: {first.code} {first.message}"
        )
    points: list[MetricPoint] = []
    for series in raw.time_series:
        for point in series.points:
            kind = point.value.WhichOneof("value")
            if kind == "int64_value":
                age = point.value.int64_value
            elif kind == "double_value":
                # Round up: a larger age only lowers the watermark.
                age = int(-(-point.value.double_value // 1))
            else:
                raise MetricResponseError(f"unexpected value type {kind!r} for {METRIC_TYPE}")
            if age < 0:
                raise MetricResponseError(f"negative age {age} in {METRIC_TYPE}")
            end = point.interval.end_time
            points.append(MetricPoint(end_time_ms=end.seconds * 1000 + end.nanos // 1_000_000, age_seconds=age))
    return points


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    seconds, millis = divmod(ms, 1000)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=millis * 1_000_000)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, core_exceptions.GoogleAPICallError) and exc.grpc_status_code is not None:
        return f"{exc.grpc_status_code.name}: {exc.message}"
    if isinstance(exc, TimeoutError):
        return "DEADLINE_EXCEEDED: no answer from Monitoring within the request timeout"
    return f"{type(exc).__name__}: {exc}"
