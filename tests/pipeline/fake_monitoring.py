"""A scripted ListTimeSeries server on port 0, for answers the Monitoring emulator never gives.

Partial answers (``execution_errors``), several pages, slow answers: the emulator computes real
backlog points, this fake returns exactly what a test scripts. It speaks the real wire protocol,
so the official client in ``sidecar.pipeline.watermark_source`` is exercised unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.cloud.monitoring_v3.types import ListTimeSeriesRequest, ListTimeSeriesResponse

METHOD = "/google.monitoring.v3.MetricService/ListTimeSeries"

Answer = ListTimeSeriesResponse | grpc.StatusCode
"""A response to send, or a status code to fail the call with."""


def series(*points: tuple[int, int], subscription_id: str = "orders") -> dict[str, Any]:
    """One time series of (end_time_ms, age_seconds) points, newest first, as Monitoring sends it."""
    return {
        "metric": {"type": "pubsub.googleapis.com/subscription/oldest_unacked_message_age"},
        "resource": {"type": "pubsub_subscription", "labels": {"subscription_id": subscription_id}},
        "metric_kind": "GAUGE",
        "value_type": "INT64",
        "unit": "s",
        "points": [
            {
                "interval": {"end_time": _ts(end_ms), "start_time": _ts(end_ms)},
                "value": {"int64_value": age},
            }
            for end_ms, age in points
        ],
    }


def _ts(ms: int) -> dict[str, int]:
    return {"seconds": ms // 1000, "nanos": (ms % 1000) * 1_000_000}


@dataclass
class FakeMonitoring:
    """Answers each ListTimeSeries call with ``responder(request)``; records every request."""

    responder: Callable[[ListTimeSeriesRequest], Answer]
    delay_seconds: float = 0.0
    requests: list[ListTimeSeriesRequest] = field(default_factory=list)
    address: str = ""
    _server: grpc.aio.Server | None = None

    async def start(self) -> None:
        async def list_time_series(request: ListTimeSeriesRequest, context: grpc.aio.ServicerContext) -> Any:
            self.requests.append(request)
            if self.delay_seconds:
                await asyncio.sleep(self.delay_seconds)
            answer = self.responder(request)
            if isinstance(answer, grpc.StatusCode):
                await context.abort(answer, f"scripted {answer.name}")
            return answer

        handler = grpc.method_handlers_generic_handler(
            "google.monitoring.v3.MetricService",
            {
                "ListTimeSeries": grpc.unary_unary_rpc_method_handler(
                    list_time_series,
                    request_deserializer=ListTimeSeriesRequest.deserialize,
                    response_serializer=ListTimeSeriesResponse.serialize,
                )
            },
        )
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
