"""MessageTraces on its own: what each engine hold reason counts as, spans of shards this pod no longer
delivers, the bound on open spans, and copies that end only their own span."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sidecar.engine import Engine
from sidecar.engine.recovery import LOADING_HOLD
from sidecar.engine.types import DropDuplicate, EngineConfig, Hold, Message, Payload
from sidecar.ops.tracing import TraceCounters
from sidecar.pipeline.message_traces import MessageTraces, wait_kind

NOW_MS = 1_700_000_000_000


def message(key: str, sequence: int, *, timestamp_ms: int | None = None) -> Message:
    return Message(
        key=key,
        dedup_id=f"{key}/{sequence}",
        message_id=f"m-{key}-{sequence}",
        stored_at_ms=NOW_MS,
        sequence=None if timestamp_ms is not None else sequence,
        timestamp_ms=timestamp_ms,
        payload=Payload(b"x", {}, NOW_MS),
    )


def traces(max_open_spans: int = 100) -> tuple[MessageTraces, InMemorySpanExporter, TraceCounters]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    counters = TraceCounters()
    traced = MessageTraces("orders")
    traced.configure(counters, provider.get_tracer("test"), max_open_spans)
    traced.bind(lambda: NOW_MS, lambda key: int(key.rsplit("-", 1)[-1]))
    return traced, exporter, counters


def only(spans: tuple[ReadableSpan, ...]) -> ReadableSpan:
    (span,) = spans
    return span


def test_every_hold_the_engine_gives_is_named_by_what_it_waits_on() -> None:
    sequence = Engine(EngineConfig(mode="sequence"))
    (gap,) = sequence.on_stored(message("k", 3), NOW_MS)
    watermark = Engine(EngineConfig(mode="watermark"))
    (unknown,) = watermark.on_stored(message("w", 1, timestamp_ms=NOW_MS), NOW_MS)
    watermark.advance_watermark(NOW_MS - 10, NOW_MS)
    (behind,) = watermark.on_stored(message("v", 2, timestamp_ms=NOW_MS), NOW_MS)
    assert isinstance(gap, Hold) and isinstance(unknown, Hold) and isinstance(behind, Hold)
    assert wait_kind(gap.reason) == "gap"
    assert wait_kind(unknown.reason) == "watermark"
    assert wait_kind(behind.reason) == "watermark"
    assert wait_kind(LOADING_HOLD) == "loading"
    assert wait_kind("key blocked by a dead letter at sequence 4") == "dead_letter"
    assert wait_kind("key blocked by a dead letter") == "dead_letter"


def test_spans_of_a_shard_this_pod_no_longer_delivers_end_as_handed_over() -> None:
    traced, exporter, _ = traces()
    kept, gone = message("key-1", 2), message("key-2", 2)
    traced.stored([kept, gone], lambda key: 5)
    traced.decided(2, 5, [Hold(gone, "missing sequence 1")])

    traced.keep_shards({1: 5})

    span = only(exporter.get_finished_spans())
    assert span.attributes is not None
    assert span.attributes["sidecar.key"] == "key-2"
    assert span.attributes["sidecar.outcome"] == "handed_over"
    assert span.attributes["sidecar.waited_for"] == ("gap",)
    assert span.attributes["sidecar.epoch"] == 5
    assert [e.name for e in span.events] == ["received", "durable", "held", "handed_over"]
    assert traced.open_spans == 1


def test_past_max_open_spans_a_message_is_not_traced_and_still_gets_its_context() -> None:
    traced, exporter, counters = traces(max_open_spans=1)
    first, second = message("key-0", 1), message("key-0", 2)
    traced.stored([first, second], lambda key: 0)
    assert traced.open_spans == 1
    assert counters.spans_not_recorded == 1
    traced.keep_shards({})
    assert len(exporter.get_finished_spans()) == 1


def test_a_copy_dropped_beside_its_held_original_ends_nothing_and_one_that_opened_its_span_ends_it() -> None:
    traced, exporter, _ = traces()
    original = message("key-0", 2)
    traced.stored([original], lambda key: 0)
    copy = message("key-0", 2)
    traced.decided(0, 0, [DropDuplicate(copy, "duplicate of a held message")])
    assert exporter.get_finished_spans() == ()
    assert traced.open_spans == 1

    # A copy of a message finished before: stored, its span opened, then dropped.
    late_copy = message("key-0", 1)
    traced.stored([late_copy], lambda key: 0)
    traced.decided(0, 0, [DropDuplicate(late_copy, "below the cursor", finish_record=True)])
    span = only(exporter.get_finished_spans())
    assert span.attributes is not None and span.attributes["sidecar.outcome"] == "duplicate"
    assert traced.open_spans == 1  # the original's span goes on


def test_a_later_copy_is_noted_on_the_original_and_a_stop_ends_every_open_span() -> None:
    traced, exporter, _ = traces()
    original = message("key-0", 2)
    traced.stored([original], lambda key: 0)
    traced.stored([message("key-0", 2)], lambda key: 0)  # Pub/Sub delivered it again

    traced.end_all()

    span = only(exporter.get_finished_spans())
    assert [e.name for e in span.events] == ["received", "durable", "copy_stored"]
    assert span.attributes is not None and span.attributes["sidecar.outcome"] == "stopped"
    assert traced.open_spans == 0
