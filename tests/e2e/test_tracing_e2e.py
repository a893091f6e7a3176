"""End to end, tracing: the official Pub/Sub client publishes with OpenTelemetry on, the sidecar (a real
process on the emulators, tracing on) exports its spans over OTLP/gRPC to a receiver this test runs
(``bench.otlp_receiver``: OpenTelemetry's own TraceService), and the app continues the trace.

Nothing is mocked between the sidecar and the receiver: the sidecar's exporter is the SDK's OTLP
exporter, configured by the standard ``OTEL_*`` variables only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import Scenario, Sub
from e2e_config import order_message
from e2e_google import emulator_env
from e2e_processes import SidecarProcess
from e2e_waits import async_wait_until
from google.cloud import pubsub_v1
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.otlp_receiver import OtlpReceiver, ReceivedSpan
from pubsub_sidecar_client import Message

pytestmark = pytest.mark.e2e

PLAIN_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
"""A publisher's own plain ``traceparent`` attribute (W3C context propagated by hand)."""


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def publisher_spans() -> InMemorySpanExporter:
    """The test process's tracer provider, where the Pub/Sub client records its create spans."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "another tracer provider was set in this process"
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def traced_sidecar(scenario: Scenario, receiver: OtlpReceiver) -> SidecarProcess:
    """The scenario's sidecar with ``tracing: {enabled: true}``, exporting to ``receiver``."""
    path = scenario.config_path()
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    body["tracing"] = {"enabled": True}
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    env = {**scenario.emulators.env, **receiver.env(), "OTEL_BSP_SCHEDULE_DELAY": "200"}
    process = SidecarProcess(path, env)
    scenario.sidecars.append(process)
    return process


@pytest.fixture
def traced_publisher(scenario: Scenario) -> Iterator[pubsub_v1.PublisherClient]:
    """The official client with its OpenTelemetry tracing on: it sets ``googclient_traceparent``."""
    with emulator_env(scenario.emulators.env):
        client = pubsub_v1.PublisherClient(
            publisher_options=pubsub_v1.types.PublisherOptions(enable_open_telemetry_tracing=True)
        )
    try:
        yield client
    finally:
        client.stop()


async def publish_traced(client: pubsub_v1.PublisherClient, sub: Sub, message: tuple[bytes, dict[str, str]]) -> None:
    data, attributes = message
    await asyncio.wrap_future(client.publish(sub.topic, data, **attributes))


def sidecar_span(receiver: OtlpReceiver, sub: Sub, key: str, sequence: int) -> ReceivedSpan | None:
    for received in receiver.spans():
        attributes = received.attributes
        if attributes.get("sidecar.key") == key and attributes.get("sidecar.sequence") == sequence:
            return received
    return None


def create_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    """The publisher's create spans, in the order the messages were published."""
    found = [s for s in exporter.get_finished_spans() if s.name.endswith(" create")]
    return sorted(found, key=lambda s: s.start_time or 0)


async def test_spans_link_to_the_publishers_context_and_the_app_continues_the_trace(
    scenario: Scenario,
    receiver: OtlpReceiver,
    publisher_spans: InMemorySpanExporter,
    traced_publisher: pubsub_v1.PublisherClient,
) -> None:
    publisher_spans.clear()
    sub = scenario.add_subscription("traced")
    sidecar = traced_sidecar(scenario, receiver)
    sidecar.start(wait_ready=False)
    await sidecar.async_wait_ready()
    contexts: dict[tuple[str, int], dict[str, str]] = {}

    def decide(message: Message) -> str:
        contexts[(message.key, message.sequence)] = dict(message.trace_context)
        return "ack"

    app = scenario.app(sub, decide)

    # Sequence 2 first, alone: it waits on the gap (1 is missing) until 1 comes.
    await publish_traced(traced_publisher, sub, order_message("t", 2))
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_keys_blocked", subscription=sub.name) == 1, "t#2 held on the gap"
    )
    await publish_traced(traced_publisher, sub, order_message("t", 1))
    # A plain W3C attribute, and a malformed one: delivered all the same.
    plain = f"00-{PLAIN_TRACE_ID}-b7ad6b7169203331-01"
    await scenario.pubsub.publish_all(
        sub.topic, [order_message("p", 1, traceparent=plain), order_message("m", 1, traceparent="00-garbage-01")]
    )
    await async_wait_until(lambda: len(app.confirmed_at) >= 4, "every message acked and confirmed")

    await async_wait_until(lambda: len(create_spans(publisher_spans)) == 2, "the publisher's two create spans")
    held, first = create_spans(publisher_spans)  # t#2 was published first

    await async_wait_until(
        lambda: sidecar_span(receiver, sub, "t", 2) is not None and sidecar_span(receiver, sub, "t", 1) is not None,
        "the sidecar's spans of t#1 and t#2 at the receiver",
    )
    for sequence, creation in ((2, held), (1, first)):
        received = sidecar_span(receiver, sub, "t", sequence)
        assert received is not None
        span = received.span
        assert creation.context is not None
        # Linked to the creation context, and in its trace as its child.
        assert [(link.trace_id.hex(), link.span_id.hex()) for link in span.links] == [
            (f"{creation.context.trace_id:032x}", f"{creation.context.span_id:016x}")
        ]
        assert span.trace_id.hex() == f"{creation.context.trace_id:032x}"
        assert span.parent_span_id.hex() == f"{creation.context.span_id:016x}"
        assert span.name == f"process {sub.name}"
        assert span.kind == span.SPAN_KIND_CONSUMER
        attributes = received.attributes
        assert attributes["sidecar.subscription"] == sub.name
        assert attributes["sidecar.key"] == "t"
        assert isinstance(attributes["sidecar.shard"], int)
        assert attributes["sidecar.epoch"] >= 1
        assert attributes["sidecar.outcome"] == "acked"
        assert attributes["sidecar.delivery_attempts"] == 1
        assert received.resource["service.name"] == "pubsub-sidecar"
        events = received.event_names()
        assert events[0] == "received"
        assert events[-4:] == ["released", "delivered", "acked", "confirmed"]
        assert "durable" in events or "fast_path" in events
        # The app got the sidecar's span as its parent: same trace, the sidecar's span id.
        traceparent = contexts[("t", sequence)]["traceparent"]
        assert traceparent.startswith(f"00-{span.trace_id.hex()}-{span.span_id.hex()}-")
        assert int(traceparent[-2:], 16) == int(creation.context.trace_flags), "the publisher's flags (sampled)"

    waited = sidecar_span(receiver, sub, "t", 2)
    assert waited is not None
    assert waited.attributes["sidecar.waited_for"] == ["gap"]
    held_events = [e for e in waited.span.events if e.name == "held"]
    assert held_events and "missing sequence 1" in str(held_events[0].attributes)
    released = [e for e in waited.span.events if e.name == "released"]
    assert str(released[0].attributes).count("order") == 1

    # The plain attribute's trace is continued too. The malformed one is ignored and counted: the
    # message is delivered, its span starts a trace of its own, with no link.
    assert contexts[("p", 1)]["traceparent"].split("-")[1] == PLAIN_TRACE_ID
    await async_wait_until(lambda: sidecar_span(receiver, sub, "m", 1) is not None, "the span of m#1")
    malformed = sidecar_span(receiver, sub, "m", 1)
    assert malformed is not None and list(malformed.span.links) == []
    assert contexts[("m", 1)]["traceparent"].split("-")[1:3] == [
        malformed.span.trace_id.hex(),
        malformed.span.span_id.hex(),
    ]
    invalid = sidecar.metric("pubsub_sidecar_trace_context_invalid_total", subscription=sub.name, part="traceparent")
    assert invalid == 1
    await async_wait_until(
        lambda: sidecar.metric("pubsub_sidecar_trace_spans_exported_total") >= 4, "four spans counted as exported"
    )
    assert sidecar.metric("pubsub_sidecar_trace_spans_dropped_total") == 0
    assert sidecar.terminate() == 0


async def test_an_exporter_that_cannot_connect_never_holds_delivery_back(scenario: Scenario) -> None:
    """Tracing on, the OTLP endpoint a port nobody listens on, a queue of 4: every message is
    delivered and confirmed, and every span is counted: dropped (the queue was full) or failed.
    (That a full queue drops rather than waits is shown exactly in tests/ops/test_tracing.py.)"""
    sub = scenario.add_subscription("untraced")
    closed = OtlpReceiver().start()
    closed.stop()  # the port was ours a moment ago: nothing listens there now
    path = scenario.config_path()
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    body["tracing"] = {"enabled": True, "max_queue_size": 4}
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    env = {
        **scenario.emulators.env,
        **closed.env(),
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    sidecar = SidecarProcess(path, env)
    scenario.sidecars.append(sidecar)
    sidecar.start(wait_ready=False)
    await sidecar.async_wait_ready()
    app = scenario.app(sub)

    await scenario.pubsub.publish_all(sub.topic, [order_message(f"k{i % 10}", i // 10 + 1) for i in range(40)])

    await async_wait_until(lambda: len(app.confirmed_at) >= 40, "all 40 messages acked and confirmed")
    await async_wait_until(
        lambda: (
            sidecar.metric("pubsub_sidecar_trace_spans_dropped_total")
            + sidecar.metric("pubsub_sidecar_trace_spans_export_failed_total")
            >= 40  # a copy Pub/Sub delivers again after its original finished has a span of its own
        ),
        "every span dropped or counted as failed",
    )
    assert sidecar.metric("pubsub_sidecar_trace_spans_exported_total") == 0
    assert sidecar.terminate() == 0
