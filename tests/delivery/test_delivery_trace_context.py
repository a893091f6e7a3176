"""OrderedMessage.traceparent over a real gRPC stream, and the message spans behind it.

Tracing off: the app gets the context the message carries (``googclient_traceparent`` first, then
``traceparent``), a malformed one is ignored and counted once. Tracing on (an SDK tracer recording
into memory): one span per message from its persist to its confirmed ack, a child of and linked to
the creation context, and the app gets the span's own context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from delivery_harness import Harness, incoming_message, sequence_config
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sidecar.engine.types import Message
from sidecar.ops.tracing import TraceCounters
from sidecar.pipeline.runtime import wall_clock_ms
from sidecar.store.api import PersistOutcome

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
PLAIN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-11111111111111111111111111111111-2222222222222222-00"


async def publish(harness: Harness, items: list[tuple[str, int, dict[str, str]]]) -> list[Message]:
    """Persist messages with these attributes and hand them to the runtime, as ingest does."""
    incoming = [dataclasses.replace(incoming_message(key, seq), attributes=attrs) for key, seq, attrs in items]
    results = await harness.store.persist("orders", incoming, wall_clock_ms())
    stored = [r.message for r in results if r.outcome is PersistOutcome.STORED]
    harness.runtimes["orders"].on_stored(stored)
    return stored


async def test_tracing_off_the_app_gets_the_context_the_message_carries(
    make_harness: Callable[..., Harness],
) -> None:
    harness = await make_harness().start()
    counters = TraceCounters()
    harness.runtimes["orders"].traces.configure(counters, None, 10)
    subscriber = await harness.subscribe("orders")

    await publish(
        harness,
        [
            ("a", 1, {"googclient_traceparent": PARENT, "traceparent": PLAIN}),
            ("b", 1, {"traceparent": PLAIN, "tracestate": "rojo=1"}),
            ("c", 1, {"traceparent": "01-" + PARENT[3:]}),  # another version: malformed
            ("d", 1, {"traceparent": PARENT, "tracestate": "x" * 600}),  # over-long tracestate
            ("e", 1, {}),
        ],
    )
    messages = {m.key: m for m in await subscriber.next_messages(5)}

    assert messages["a"].traceparent == PARENT
    assert messages["b"].traceparent == PLAIN
    assert messages["c"].traceparent == ""
    assert messages["d"].traceparent == PARENT  # the tracestate alone is dropped
    assert messages["e"].traceparent == ""
    assert counters.context_invalid == {("orders", "traceparent"): 1, ("orders", "tracestate"): 1}

    # A redelivery is not counted again.
    await subscriber.nack([messages["c"].delivery_id], retry_after_ms=0)
    (again,) = await subscriber.next_messages(1)
    assert again.delivery_attempt == 2 and again.traceparent == ""
    assert counters.context_invalid[("orders", "traceparent")] == 1


async def test_tracing_on_one_span_per_message_from_its_persist_to_its_confirmed_ack(
    make_harness: Callable[..., Harness],
) -> None:
    harness = await make_harness({"orders": sequence_config(backoff_initial_ms=0, backoff_maximum_ms=0)}).start()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    counters = TraceCounters()
    harness.runtimes["orders"].traces.configure(counters, provider.get_tracer("test"), 10)
    subscriber = await harness.subscribe("orders")

    # k#2 first: it waits on the gap until k#1 comes.
    await publish(harness, [("k", 2, {"googclient_traceparent": PARENT})])
    await publish(harness, [("k", 1, {"traceparent": PLAIN})])
    (first,) = await subscriber.next_messages(1)
    await subscriber.nack([first.delivery_id], retry_after_ms=0)  # waits on a backoff, then comes again
    (first_again,) = await subscriber.next_messages(1)
    await subscriber.ack([first_again.delivery_id])
    (second,) = await subscriber.next_messages(1)
    await subscriber.ack([second.delivery_id])
    await subscriber.wait_confirmed([first_again.delivery_id, second.delivery_id])
    # A publisher that did not sample: no span is recorded, the app still gets the trace to continue.
    await publish(harness, [("u", 1, {"traceparent": UNSAMPLED})])
    (unsampled,) = await subscriber.next_messages(1)
    await subscriber.ack([unsampled.delivery_id])
    await subscriber.wait_confirmed([unsampled.delivery_id])
    _, trace_id, span_id, flags = unsampled.traceparent.split("-")
    assert (trace_id, flags) == ("1" * 32, "00") and span_id != "2" * 16

    spans = {span.attributes["sidecar.sequence"]: span for span in exporter.get_finished_spans()}  # type: ignore[index]
    assert sorted(spans) == [1, 2]
    held = spans[2]
    assert held.context is not None and held.parent is not None
    assert held.name == "process orders" and held.kind is SpanKind.CONSUMER
    assert f"{held.context.trace_id:032x}" == TRACE_ID, "a child of the creation context: the same trace"
    assert f"{held.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in held.links] == [
        (TRACE_ID, "00f067aa0ba902b7")
    ]
    assert [event.name for event in held.events] == [
        "received",
        "durable",
        "held",
        "released",
        "delivered",
        "acked",
        "confirmed",
    ]
    assert dict(held.attributes or {}) | {} == {
        "messaging.system": "gcp_pubsub",
        "messaging.operation.type": "process",
        "messaging.message.id": "m-k-2",
        "sidecar.subscription": "orders",
        "sidecar.key": "k",
        "sidecar.dedup_id": "k/2",
        "sidecar.shard": 0,
        "sidecar.epoch": 0,
        "sidecar.sequence": 2,
        "sidecar.outcome": "acked",
        "sidecar.waited_for": ("gap",),
        "sidecar.delivery_attempts": 1,
    }
    # The app got each span's own context.
    assert second.traceparent == f"00-{TRACE_ID}-{held.context.span_id:016x}-01"

    redelivered = spans[1]
    assert redelivered.attributes is not None and redelivered.context is not None
    assert redelivered.attributes["sidecar.waited_for"] == ("backoff",)
    assert redelivered.attributes["sidecar.delivery_attempts"] == 2
    assert [e.name for e in redelivered.events].count("delivered") == 2
    assert first.traceparent == first_again.traceparent
    assert first.traceparent.split("-")[1:3] == [
        f"{redelivered.context.trace_id:032x}",
        f"{redelivered.context.span_id:016x}",
    ]
    assert first.traceparent.split("-")[1] == PLAIN.split("-")[1]
    assert harness.runtimes["orders"].traces.open_spans == 0
