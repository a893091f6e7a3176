"""What operators see of a running sidecar: logs, metrics and health over HTTP, listeners.

- ``logs``: one JSON object per line for Cloud Logging, or plain text.
- ``observability``: ``/healthz``, ``/readyz`` and ``/metrics`` (aiohttp, prometheus-client).
- ``listening``: binding the gRPC and HTTP listeners, refusing an address in use.
- ``capacity``: intake against delivery over a sliding minute, how long the backlog has grown, and
  since when lease reads fail. Pure (every instant an argument).
- ``trace_context``: W3C trace context read from a message's attributes. Pure.
- ``tracing``: the OpenTelemetry SDK (tracer provider, bounded export, counters); its only importer.

A leaf: imports nothing of the sidecar (``sidecar.wiring.reporting`` hands it snapshots), so every layer may use it.
"""
