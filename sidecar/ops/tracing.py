"""The OpenTelemetry SDK in the sidecar: a tracer provider, its exporter, a bounded export queue, counters.

The only module that imports the OpenTelemetry SDK and its exporters (spans themselves are made
through the API, ``opentelemetry.trace``, by ``sidecar.pipeline.message_traces``). Rules:

- **Off by default**: nothing here runs unless the config says ``tracing: {enabled: true}``.
- **The standard environment chooses** (as any OpenTelemetry SDK): ``OTEL_TRACES_EXPORTER`` is
  ``otlp`` (default: OTLP over gRPC, configured by ``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_TRACES_*``, headers, certificates, timeout), ``console`` or ``none``;
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` must be ``grpc`` when set
  (the one OTLP transport shipped); ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name the
  resource (service name ``pubsub-sidecar`` by default), ``OTEL_TRACES_SAMPLER`` samples. Anything
  else is a ``TracingConfigError`` (one line; the ``run`` command exits 2).
- **An exporter never slows delivery.** Spans end on the event loop and are queued; one worker
  thread exports them (``BatchSpanProcessor``). At most ``max_queue_size`` ended spans wait: past
  that a span is dropped and counted (``TraceCounters.spans_dropped``), never waited for. An export
  that fails (receiver down, after the exporter's own retries) counts its spans in
  ``spans_export_failed``. The SDK's per-span "queue full" warnings are silenced: the counter says it.
  Batches are small and frequent (``SCHEDULE_DELAY_MS``, ``MAX_EXPORT_BATCH_SIZE``) unless the
  ``OTEL_BSP_*`` variables say otherwise.
- **Shutdown is bounded**: ``Tracing.aclose`` flushes for at most ``SHUTDOWN_SECONDS`` in a thread;
  what is left then is lost (the worker is a daemon thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

_LOGGER = logging.getLogger(__name__)

PREFIX = "pubsub_sidecar"

SHUTDOWN_SECONDS = 2.0
"""The stop sequence's share for the last export: a receiver that is down must not eat the pod's grace."""

DEFAULT_SERVICE_NAME = "pubsub-sidecar"

SCHEDULE_DELAY_MS = 500
"""Export every half second, not the SDK's 5 s: encoding a span costs the export thread about as
much CPU as recording it, and a few large batches at once take the interpreter from the event
loop long enough to show in delivery latency; small, frequent ones spread that cost."""

MAX_EXPORT_BATCH_SIZE = 128
"""Spans per export request (the SDK's default is 512), for the same reason."""

_QUIET_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")
"""The SDK logs a WARNING per span dropped on a full queue: thousands a second while a receiver is down."""


class TracingConfigError(ValueError):
    """The ``OTEL_*`` environment asks for what the sidecar cannot do: one line naming the variable."""


@dataclass(slots=True)
class TraceCounters:
    """Counted as it happens, read at scrape time (``TracingCollector``). Spans counters are touched by
    the export thread too: under ``lock``."""

    spans_ended: int = 0
    spans_exported: int = 0
    spans_dropped: int = 0
    spans_export_failed: int = 0
    spans_not_recorded: int = 0
    """Messages not traced: ``max_open_spans`` were open (event loop only)."""
    context_invalid: dict[tuple[str, str], int] = field(default_factory=dict)
    """(subscription, part) -> messages whose trace context part was malformed (ignored)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count_invalid(self, subscription: str, part: str) -> None:
        key = (subscription, part)
        self.context_invalid[key] = self.context_invalid.get(key, 0) + 1


class _BoundedExport(SpanProcessor):
    """Queues ended spans for the batch processor, at most ``max_queue_size`` at once; drops (and
    counts) past it. Its count of waiting spans goes down when the exporter takes a batch
    (``_CountingExporter``), so it is never below the batch processor's own queue: that queue,
    of the same size, never drops a span silently."""

    def __init__(
        self, exporter: SpanExporter, max_queue_size: int, counters: TraceCounters, env: Mapping[str, str]
    ) -> None:
        self._counters = counters
        self._max = max_queue_size
        self._waiting = 0
        # The SDK reads OTEL_BSP_SCHEDULE_DELAY and OTEL_BSP_MAX_EXPORT_BATCH_SIZE itself when they
        # are set; otherwise the sidecar's smaller, more frequent batches (see the constants).
        self._batch = BatchSpanProcessor(
            _CountingExporter(exporter, self._taken, counters),
            max_queue_size=max_queue_size,
            schedule_delay_millis=None if "OTEL_BSP_SCHEDULE_DELAY" in env else SCHEDULE_DELAY_MS,
            max_export_batch_size=min(_batch_size(env), max_queue_size),
        )

    def _taken(self, count: int) -> None:
        with self._counters.lock:
            self._waiting -= count

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        counters = self._counters
        with counters.lock:
            counters.spans_ended += 1
            if self._waiting >= self._max:
                counters.spans_dropped += 1
                return
            self._waiting += 1
        self._batch.on_end(span)

    def shutdown(self) -> None:
        self._batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


def _batch_size(env: Mapping[str, str]) -> int:
    """``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` when it is a positive integer (the SDK ignores a bad one
    too), else ``MAX_EXPORT_BATCH_SIZE``."""
    try:
        size = int(env.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", MAX_EXPORT_BATCH_SIZE))
    except ValueError:
        return MAX_EXPORT_BATCH_SIZE
    return size if size > 0 else MAX_EXPORT_BATCH_SIZE


class _CountingExporter(SpanExporter):
    def __init__(self, exporter: SpanExporter, taken: Callable[[int], None], counters: TraceCounters) -> None:
        self._exporter = exporter
        self._taken = taken
        self._counters = counters

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._taken(len(spans))
        try:
            result = self._exporter.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        with self._counters.lock:
            if result is SpanExportResult.SUCCESS:
                self._counters.spans_exported += len(spans)
            else:
                self._counters.spans_export_failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


def exporter_name(env: Mapping[str, str]) -> str:
    """``otlp``, ``console`` or ``none``, as the environment says; raises ``TracingConfigError``
    (the ``run`` command checks it before anything starts)."""
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()] or ["otlp"]
    if len(names) > 1:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: name one exporter")
    name = names[0]
    if name not in ("otlp", "console", "none"):
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={name!r}: the sidecar ships otlp, console and none")
    if name == "otlp":
        for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = env.get(variable)
            if protocol is not None:
                if protocol != "grpc":
                    raise TracingConfigError(f"{variable}={protocol!r}: the sidecar exports OTLP over grpc only")
                break
    return name


def make_exporter(env: Mapping[str, str]) -> SpanExporter | None:
    """The exporter ``OTEL_TRACES_EXPORTER`` names (None: ``none``); raises ``TracingConfigError``."""
    name = exporter_name(env)
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    # Imported here: the gRPC exporter costs its import only where it is used.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


@dataclass(slots=True)
class Tracing:
    """The running SDK: hand ``tracer`` to whoever records spans; ``aclose`` at the end."""

    provider: TracerProvider
    counters: TraceCounters

    @property
    def tracer(self) -> trace.Tracer:
        return self.provider.get_tracer("pubsub-sidecar")

    async def aclose(self) -> None:
        """Flush and stop the export, for at most ``SHUTDOWN_SECONDS``."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def shut() -> None:
            try:
                self.provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(finish)

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        # A daemon thread, not the loop's executor: asyncio.run joins that one at exit, however long
        # an exporter that cannot connect keeps retrying.
        threading.Thread(target=shut, name="tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, SHUTDOWN_SECONDS)
        except TimeoutError:
            _LOGGER.info("tracing: spans not exported within %.1fs of stop were dropped", SHUTDOWN_SECONDS)


def start_tracing(
    max_queue_size: int,
    counters: TraceCounters | None = None,
    env: Mapping[str, str] | None = None,
    exporter: SpanExporter | None = None,
) -> Tracing:
    """A tracer provider exporting as the environment says (``exporter`` overrides it: tests, bench).
    The provider is the sidecar's own, not the process-global one."""
    environment = os.environ if env is None else env
    chosen = exporter if exporter is not None else make_exporter(environment)
    counters = counters if counters is not None else TraceCounters()
    attributes: dict[str, str] = {}
    if "OTEL_SERVICE_NAME" not in environment and SERVICE_NAME not in environment.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create(attributes))
    if chosen is not None:
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        provider.add_span_processor(_BoundedExport(chosen, max_queue_size, counters, environment))
    return Tracing(provider, counters)


class TracingCollector(Collector):
    """The tracing counters as Prometheus families (registered by the wiring, tracing on or off)."""

    def __init__(self, counters: TraceCounters, subscriptions: Iterable[str]) -> None:
        self._counters = counters
        self._subscriptions = tuple(subscriptions)

    def collect(self) -> Iterator[Metric]:
        counters = self._counters
        invalid = CounterMetricFamily(
            f"{PREFIX}_trace_context_invalid",
            "Messages delivered with a malformed traceparent or tracestate attribute (ignored).",
            labels=["subscription", "part"],
        )
        for subscription in self._subscriptions:
            for part in ("traceparent", "tracestate"):
                invalid.add_metric([subscription, part], counters.context_invalid.get((subscription, part), 0))
        yield invalid
        with counters.lock:
            figures = {
                "spans_exported": (counters.spans_exported, "Message spans the exporter delivered."),
                "spans_dropped": (counters.spans_dropped, "Message spans dropped: the export queue was full."),
                "spans_export_failed": (counters.spans_export_failed, "Message spans whose export failed."),
                "spans_not_recorded": (
                    counters.spans_not_recorded,
                    "Messages not traced: tracing.max_open_spans spans were open.",
                ),
            }
        for name, (value, doc) in figures.items():
            family = CounterMetricFamily(f"{PREFIX}_trace_{name}", doc)
            family.add_metric([], value)
            yield family
