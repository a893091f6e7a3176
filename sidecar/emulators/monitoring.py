"""The Cloud Monitoring emulator: ``google.monitoring.v3.MetricService/ListTimeSeries`` for Pub/Sub backlogs.

The only module of ours that imports ``google.cloud.monitoring_v3``. It serves two metrics of
``pubsub_subscription`` resources, computed from the Pub/Sub emulator's real state:

- ``pubsub.googleapis.com/subscription/oldest_unacked_message_age`` (seconds, INT64 GAUGE);
- ``pubsub.googleapis.com/subscription/num_undelivered_messages`` (count, INT64 GAUGE).

Rules, as production behaves:
- a sampler records every subscription's backlog every ``metric_period`` seconds; a sample becomes
  visible only ``metric_delay`` seconds after its end time, so readers meet production's lag;
- a subscription with no unacked messages gets **no point** in that sample;
- the filter is parsed tolerantly (``AND``-joined ``key = "value"`` terms, any spacing, either quote);
  ``metric.type`` is required, ``resource.labels.subscription_id`` / ``project_id`` and
  ``resource.type`` narrow the result; anything else, an unknown metric or a bad interval is
  INVALID_ARGUMENT with a message naming it;
- points lie in ``[interval.start_time, interval.end_time]`` (start defaults to end), newest first;
  one response holds everything (``next_page_token`` is empty); aggregation is not applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.api import metric_pb2
from google.cloud.monitoring_v3 import types

from sidecar.emulators.pubsub_model import Backlog

_LOGGER = logging.getLogger(__name__)

OLDEST_UNACKED_AGE = "pubsub.googleapis.com/subscription/oldest_unacked_message_age"
NUM_UNDELIVERED = "pubsub.googleapis.com/subscription/num_undelivered_messages"
_UNITS = {OLDEST_UNACKED_AGE: "s", NUM_UNDELIVERED: "1"}
RESOURCE_TYPE = "pubsub_subscription"
MAX_SAMPLES = 20_000
"""Enough history for about two weeks at the default 60 s period; bounds memory at short periods."""

_ListTimeSeriesRequest = types.ListTimeSeriesRequest.pb()
_ListTimeSeriesResponse = types.ListTimeSeriesResponse.pb()
_GAUGE = metric_pb2.MetricDescriptor.MetricKind.GAUGE
_INT64 = metric_pb2.MetricDescriptor.ValueType.INT64

_TERM_RE = re.compile(r"""^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*(?:"([^"]*)"|'([^']*)')\s*$""")
_AND_RE = re.compile(r"\s+AND\s+", re.IGNORECASE)
_KEYS = {
    "metric.type": "metric_type",
    "resource.type": "resource_type",
    "resource.labels.subscription_id": "subscription_id",
    "resource.label.subscription_id": "subscription_id",
    "resource.labels.project_id": "project_id",
    "resource.label.project_id": "project_id",
}


class FilterError(ValueError):
    """A ListTimeSeries filter the emulator (and production) refuses."""


@dataclass(frozen=True, slots=True)
class Query:
    metric_type: str
    resource_type: str | None = None
    subscription_id: str | None = None
    project_id: str | None = None


def parse_filter(text: str) -> Query:
    """Parse a Monitoring filter of ``key = "value"`` terms joined by AND; raises FilterError."""
    if not text.strip():
        raise FilterError('filter: must not be empty; it needs at least metric.type = "..."')
    values: dict[str, str] = {}
    for term in _AND_RE.split(text.strip()):
        match = _TERM_RE.match(term)
        if match is None:
            raise FilterError(f'filter: cannot parse term {term.strip()!r}; expected key = "value"')
        key, value = match.group(1), match.group(2) if match.group(2) is not None else match.group(3)
        field_name = _KEYS.get(key)
        if field_name is None:
            raise FilterError(f"filter: unsupported key {key!r}; supported: {', '.join(sorted(_KEYS))}")
        if field_name in values and values[field_name] != value:
            raise FilterError(f"filter: {key} is given twice with different values")
        values[field_name] = value
    if "metric_type" not in values:
        raise FilterError("filter: metric.type is required")
    if values["metric_type"] not in _UNITS:
        raise FilterError(
            f"filter: unknown metric type {values['metric_type']!r}; this emulator serves {', '.join(sorted(_UNITS))}"
        )
    return Query(**values)


@dataclass(frozen=True, slots=True)
class Sample:
    end_time_ns: int
    backlogs: dict[str, Backlog]


class MonitoringEmulator:
    """Samples backlogs periodically and answers ListTimeSeries from the visible samples."""

    def __init__(
        self,
        backlogs: Callable[[], dict[str, Backlog]],
        metric_period: float = 60.0,
        metric_delay: float = 120.0,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        if metric_period <= 0:
            raise ValueError("metric_period: must be positive")
        if metric_delay < 0:
            raise ValueError("metric_delay: must not be negative")
        self._backlogs = backlogs
        self._period = metric_period
        self._delay_ns = int(metric_delay * 1e9)
        self._clock = wall_clock_ns
        self._samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self._task: asyncio.Task[None] | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            self.list_time_series, _ListTimeSeriesRequest.FromString, _ListTimeSeriesResponse.SerializeToString
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("google.monitoring.v3.MetricService", {"ListTimeSeries": handler}),)
        )

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sample_forever(), name="metric-sampler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def sample_now(self) -> Sample:
        """Record the current backlogs as one sample ending now."""
        sample = Sample(self._clock(), self._backlogs())
        self._samples.append(sample)
        return sample

    async def _sample_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                self.sample_now()
            except Exception:  # a sampling bug must not stop the metric for good
                _LOGGER.exception("monitoring emulator: sampling failed")
            # Schedule on a fixed grid so samples stay one period apart even when a tick runs late.
            next_at += self._period
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    async def list_time_series(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return self.answer(request)
        except FilterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            _LOGGER.exception("monitoring emulator: unexpected error in ListTimeSeries")
            await context.abort(grpc.StatusCode.INTERNAL, "emulator error in ListTimeSeries")

    def answer(self, request: Any) -> Any:
        """The ListTimeSeries response for a raw request; raises FilterError on bad input."""
        parts = request.name.split("/")
        if len(parts) != 2 or parts[0] != "projects" or not parts[1]:
            raise FilterError(f"name: expected projects/PROJECT, got {request.name!r}")
        project = parts[1]
        query = parse_filter(request.filter)
        if not request.HasField("interval") or not request.interval.HasField("end_time"):
            raise FilterError("interval.end_time: is required")
        end_ns = request.interval.end_time.ToNanoseconds()
        start_ns = request.interval.start_time.ToNanoseconds() if request.interval.HasField("start_time") else end_ns
        if start_ns > end_ns:
            raise FilterError("interval: start_time is after end_time")
        if request.page_size < 0:
            raise FilterError("page_size: must not be negative")
        response = _ListTimeSeriesResponse()
        if query.resource_type not in (None, RESOURCE_TYPE) or query.project_id not in (None, project):
            return response
        visible_before = self._clock() - self._delay_ns
        series: dict[str, list[tuple[int, int]]] = {}
        for sample in reversed(self._samples):  # newest first, as production orders points
            if sample.end_time_ns > visible_before or sample.end_time_ns > end_ns:
                continue
            if sample.end_time_ns < start_ns:
                break
            for name, backlog in sample.backlogs.items():
                _, sub_project, _, sub_id = name.split("/")
                if sub_project != project or query.subscription_id not in (None, sub_id):
                    continue
                if query.metric_type == OLDEST_UNACKED_AGE:
                    value = max(0, (sample.end_time_ns - backlog.oldest_publish_time_ns) // 1_000_000_000)
                else:
                    value = backlog.num_undelivered
                series.setdefault(name, []).append((sample.end_time_ns, value))
        for name in sorted(series):
            _, sub_project, _, sub_id = name.split("/")
            ts = response.time_series.add()
            ts.metric.type = query.metric_type
            ts.resource.type = RESOURCE_TYPE
            ts.resource.labels["project_id"] = sub_project
            ts.resource.labels["subscription_id"] = sub_id
            ts.metric_kind = _GAUGE
            ts.value_type = _INT64
            ts.unit = _UNITS[query.metric_type]
            for end_time_ns, value in series[name]:
                point = ts.points.add()
                point.interval.end_time.FromNanoseconds(end_time_ns)
                point.interval.start_time.FromNanoseconds(end_time_ns)
                point.value.int64_value = value
        return response
