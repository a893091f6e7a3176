"""The OpenTelemetry SDK as the sidecar runs it: the environment's choice of exporter, a bounded export
queue that drops (and counts) rather than waits, a bounded shutdown, the counters as metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.ops.tracing import (
    SHUTDOWN_SECONDS,
    TraceCounters,
    TracingCollector,
    TracingConfigError,
    exporter_name,
    make_exporter,
    start_tracing,
)


class _BlockedExporter(SpanExporter):
    """An exporter stuck in its first export until ``release`` (a receiver that does not answer)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


class _FailingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


async def test_a_stuck_exporter_never_blocks_ending_spans_and_what_does_not_fit_is_dropped_and_counted() -> None:
    exporter = _BlockedExporter()
    counters = TraceCounters()
    tracing = start_tracing(4, counters, env={}, exporter=exporter)
    tracer = tracing.tracer
    for index in range(101):
        tracer.start_span(f"s{index}").end()  # never waits for the exporter, stuck or not
    assert counters.spans_ended == 101
    # At most one batch in the stuck export and a full queue wait: everything else was dropped.
    assert counters.spans_dropped >= 101 - 2 * 4
    exporter.release.set()
    tracing.provider.shutdown()  # type: ignore[no-untyped-call]  # exports what waits, unbounded here
    assert exporter.exported + counters.spans_dropped == 101
    assert counters.spans_exported == exporter.exported


def test_failed_exports_are_counted() -> None:
    counters = TraceCounters()
    tracing = start_tracing(16, counters, env={}, exporter=_FailingExporter())
    for index in range(3):
        tracing.tracer.start_span(f"s{index}").end()
    tracing.provider.shutdown()  # type: ignore[no-untyped-call]
    assert counters.spans_export_failed == 3
    assert counters.spans_exported == 0


async def test_shutdown_gives_up_after_its_bound() -> None:
    exporter = _BlockedExporter()
    tracing = start_tracing(4, TraceCounters(), env={}, exporter=exporter)
    tracing.tracer.start_span("s").end()
    started = time.monotonic()
    flushing = asyncio.create_task(tracing.aclose())
    await asyncio.wait_for(flushing, SHUTDOWN_SECONDS * 10)  # returns though the export never ends
    assert time.monotonic() - started < SHUTDOWN_SECONDS * 10
    exporter.release.set()


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "none"}, "none"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "otlp"),
    ],
)
def test_the_environment_names_the_exporter(env: dict[str, str], name: str) -> None:
    assert exporter_name(env) == name


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ],
)
def test_what_the_sidecar_cannot_do_is_one_line_naming_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(TracingConfigError) as caught:
        exporter_name(env)
    assert variable in str(caught.value) and "\n" not in str(caught.value)


def test_the_exporters_are_the_sdks() -> None:
    assert make_exporter({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert isinstance(make_exporter({"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)
    otlp = make_exporter({"OTEL_TRACES_EXPORTER": "otlp"})
    assert type(otlp).__name__ == "OTLPSpanExporter"
    assert otlp is not None
    otlp.shutdown()


async def test_the_service_name_defaults_to_the_sidecars_and_the_environment_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    default = start_tracing(4, exporter=_FailingExporter())
    assert default.provider.resource.attributes["service.name"] == "pubsub-sidecar"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "orders-sidecar")
    named = start_tracing(4, exporter=_FailingExporter())
    assert named.provider.resource.attributes["service.name"] == "orders-sidecar"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes,team=orders")
    attributed = start_tracing(4, exporter=_FailingExporter())
    assert attributed.provider.resource.attributes["service.name"] == "from-attributes"
    for tracing in (default, named, attributed):
        await tracing.aclose()


def test_the_counters_as_metrics() -> None:
    counters = TraceCounters(spans_exported=5, spans_dropped=2, spans_export_failed=1, spans_not_recorded=3)
    counters.count_invalid("orders", "traceparent")
    registry = CollectorRegistry()
    registry.register(TracingCollector(counters, ["orders", "audit"]))
    text = generate_latest(registry).decode()
    assert 'pubsub_sidecar_trace_context_invalid_total{part="traceparent",subscription="orders"} 1.0' in text
    assert 'pubsub_sidecar_trace_context_invalid_total{part="tracestate",subscription="audit"} 0.0' in text
    assert "pubsub_sidecar_trace_spans_exported_total 5.0" in text
    assert "pubsub_sidecar_trace_spans_dropped_total 2.0" in text
    assert "pubsub_sidecar_trace_spans_export_failed_total 1.0" in text
    assert "pubsub_sidecar_trace_spans_not_recorded_total 3.0" in text


@pytest.mark.parametrize(("value", "size"), [(None, 128), ("64", 64), ("0", 128), ("-3", 128), ("many", 128)])
def test_the_export_batch_is_the_sidecars_unless_the_environment_names_a_valid_one(
    value: str | None, size: int
) -> None:
    from sidecar.ops.tracing import _batch_size

    env = {} if value is None else {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": value}
    assert _batch_size(env) == size
