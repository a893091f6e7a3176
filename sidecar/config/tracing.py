"""The ``tracing:`` section (DESIGN §13): a span per message, exported with OpenTelemetry.

Rules (the file's rules of ``sidecar.config.model`` hold here too: unknown fields and wrong YAML
types are errors, one line each):

- ``enabled`` (default false): with tracing off the sidecar records no span, and the app still gets
  each message's trace context (``OrderedMessage.traceparent``) as the message carries it.
- Where spans go is the standard ``OTEL_*`` environment's choice, not this file's
  (``sidecar.ops.tracing``: ``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT``, ...).
- ``max_queue_size``: ended spans waiting for the exporter; past it a span is dropped and counted
  (``pubsub_sidecar_trace_spans_dropped_total``), so that a receiver that is down never slows delivery.
- ``max_open_spans``: messages traced at once in each subscription (a backlog held behind a gap has
  a span per message); a message past it is not traced (``..._trace_spans_not_recorded_total``).

The reference is docs/config.md and docs/observability.md ("Traces").
"""

from __future__ import annotations

from pydantic import Field

from sidecar.config.fields import StrictModel

MAX_QUEUE_SIZE = 1_000_000
"""About 1 KB a span: a queue past a million would be a gigabyte waiting for an exporter."""


class TracingConfig(StrictModel):
    enabled: bool = False
    max_queue_size: int = Field(default=2048, ge=1, le=MAX_QUEUE_SIZE)
    """The OpenTelemetry SDK's default (``OTEL_BSP_MAX_QUEUE_SIZE``)."""
    max_open_spans: int = Field(default=100_000, ge=1, le=10_000_000)
