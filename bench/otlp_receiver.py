"""An OTLP/gRPC trace receiver in this process: OpenTelemetry's own ``TraceService`` on a port of its
own, keeping every span it is sent. The end-to-end tracing test checks what the sidecar exported
with it, and ``bench`` gives the sidecar somewhere to export to (tracing on).

Rules: a real gRPC server (``grpc.server`` on ``127.0.0.1:0``) with the generated servicer of the
``opentelemetry-proto`` package; nothing between the exporter and it is ours. It answers every
Export with success, and keeps the spans unless ``keep`` is False (a benchmark's thousands).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span as the receiver got it, with its resource's and scope's attributes."""

    span: trace_pb2.Span
    resource: dict[str, Any]
    scope: str

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes_of(self.span.attributes)

    def event_names(self) -> list[str]:
        return [event.name for event in self.span.events]


def attributes_of(values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in values}


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._receiver._take(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """``start()`` then point ``OTEL_EXPORTER_OTLP_ENDPOINT`` at ``endpoint``; ``stop()`` at the end."""

    def __init__(self, *, keep: bool = True) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.span_count = 0
        self.exports = 0
        self._server: grpc.Server | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to export here (OTLP over gRPC, plaintext)."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        }

    def start(self) -> OtlpReceiver:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)  # type: ignore[no-untyped-call]
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def _take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(span, resource, scope_spans.scope.name))
        with self._lock:
            self.exports += 1
            self.span_count += len(received)
            if self._keep:
                self._spans.extend(received)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)
