"""One subscription's message spans: each message's stay in the sidecar, and the context the app gets.

The runtime tells this module what happens to a message (``SubscriptionRuntime`` calls it: stored,
the engine's decisions, released, acked, nacked, confirmed, shards dropped) and the delivery layer
asks it for each delivery's ``traceparent`` (``delivered``). The engine knows nothing of it. Rules:

- **The app always gets the message's context.** Tracing off (no tracer): the traceparent the
  message carries (``sidecar.ops.trace_context``), unchanged, or ``""``. Tracing on: the sidecar's
  span for the message, a child of that context (same trace id; a new trace when it carries none),
  so that the app's spans continue the trace.
- **A malformed trace context is ignored and counted**, once per message delivered at attempt 1
  (``TraceCounters.count_invalid``, by part): never an error, never a dead letter.
- **One span per message and pod** (identity: key, dedup id, replay id), kind CONSUMER, named
  ``process <subscription>``, linked to the message's creation context and a child of it. It starts
  when the message's persist began (``stored_at_ms``: event ``received``) and ends when its ack is
  confirmed (outcome ``acked``), when it is dead-lettered (``dead_lettered``), dropped as a copy of
  nothing held (``duplicate``), when this pod stops delivering its shard (``handed_over``: the
  next owner records its own span) or when the runtime stops (``stopped``). Events on the way:
  ``durable`` (or ``fast_path``: taken in order, not stored; ``copy_stored`` for a later copy),
  ``held`` (with the engine's reason), ``released`` (``by``: ``order`` or ``watermark``),
  ``delivered`` (delivery id, attempt), ``acked``, ``nacked``, ``confirmed``.
- **Attributes**: the key, the position (``sidecar.sequence`` or ``sidecar.event_time_ms``), the
  subscription, the shard and lease epoch, ``sidecar.waited_for`` (what the message waited on:
  ``gap``, ``watermark``, ``dead_letter``, ``backoff``, ``loading``), the attempts and the outcome.
- **Bounded**: at most ``max_open_spans`` open at once (a backlog of millions held behind a gap);
  a message past it is not traced (counted in ``spans_not_recorded``); the app still gets its
  context.
- Every call happens on the event loop thread; times are the runtime's clock (ms since the epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState

from sidecar.engine.types import Action, DeadLetter, Deliver, DropDuplicate, Hold, Message
from sidecar.ops.trace_context import NO_CONTEXT, Reading, format_traceparent, read_trace_context
from sidecar.ops.tracing import TraceCounters

DEFAULT_MAX_OPEN_SPANS = 100_000
"""About 1 KB each (span, events, attributes): 100 MB at most, for a backlog far above the usual."""

_WAIT_KINDS: tuple[tuple[str, str], ...] = (
    ("missing sequence", "gap"),
    ("watermark", "watermark"),
    ("dead letter", "dead_letter"),
    ("recovery", "loading"),
)
"""A ``Hold`` reason's words (``sidecar.engine.sequence``, ``watermark``, ``recovery``) -> what the
message waited on (tests/pipeline/test_message_traces.py holds every reason the engine gives)."""

_Identity = tuple[str, str, str]

_NS_PER_MS = 1_000_000


def wait_kind(reason: str) -> str:
    """What a ``Hold`` with this reason waits on: gap, watermark, dead_letter, loading, or other."""
    for words, kind in _WAIT_KINDS:
        if words in reason:
            return kind
    return "other"


@dataclass(slots=True)
class _Trace:
    span: trace.Span
    shard: int
    epoch: int
    opened_by: Message
    """The Message the span was opened for (kept, so that no other object takes its ``id``): a copy
    dropped later ends only a span it opened itself."""
    reading: Reading
    traceparent: str
    waited: list[str] = field(default_factory=list)
    delivery_ids: list[str] = field(default_factory=list)
    attempts: int = 0
    stored: bool = False
    """``durable`` (or ``fast_path``) recorded: a copy stored later is ``copy_stored``."""


class MessageTraces:
    """Spans of one subscription's messages (rules in the module docstring)."""

    def __init__(
        self,
        subscription: str,
        counters: TraceCounters | None = None,
        tracer: trace.Tracer | None = None,
        *,
        clock: Callable[[], int] | None = None,
        route: Callable[[str], int] = lambda key: 0,
        max_open_spans: int = DEFAULT_MAX_OPEN_SPANS,
    ) -> None:
        self.subscription = subscription
        self.counters = counters if counters is not None else TraceCounters()
        self._tracer = tracer
        self._clock = clock
        self._route = route
        self._max_open = max_open_spans
        self._open: dict[_Identity, _Trace] = {}
        self._by_delivery: dict[str, _Identity] = {}

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @property
    def open_spans(self) -> int:
        return len(self._open)

    def configure(self, counters: TraceCounters, tracer: trace.Tracer | None, max_open_spans: int) -> None:
        """Tracing as the config says (the wiring, before anything is stored or delivered)."""
        assert not self._open, "configure() after spans were opened"
        self.counters = counters
        self._tracer = tracer
        self._max_open = max_open_spans

    def bind(self, clock: Callable[[], int], route: Callable[[str], int]) -> None:
        """The runtime's clock and its key -> shard function (set by the runtime that uses this)."""
        self._clock = clock
        self._route = route

    # ---- what the runtime reports ----------------------------------------------------------

    def stored(self, messages: Iterable[Message], epoch_of: Callable[[str], int | None]) -> None:
        """``messages`` made durable (or taken by the fast path, ``volatile``) at this pod; those
        whose key another pod delivers (``epoch_of`` None: no engine here) are its owner's to trace."""
        if self._tracer is None:
            return
        now_ns = self._now_ns()
        for message in messages:
            epoch = epoch_of(message.key)
            if epoch is None:
                continue
            entry = self._get(message, epoch)
            if entry is None:
                continue
            if entry.stored:
                entry.span.add_event("copy_stored", timestamp=now_ns)
            else:
                entry.stored = True
                entry.span.add_event("fast_path" if message.volatile else "durable", timestamp=now_ns)

    def decided(self, shard: int, epoch: int, actions: Sequence[Action]) -> None:
        """The engine's decisions for messages of ``shard`` (held, dead-lettered, dropped)."""
        if self._tracer is None:
            return
        for action in actions:
            if isinstance(action, Hold):
                entry = self._get(action.message, epoch)
                if entry is not None:
                    kind = wait_kind(action.reason)
                    if kind not in entry.waited:
                        entry.waited.append(kind)
                    entry.span.add_event("held", {"reason": action.reason, "waits_for": kind}, self._now_ns())
            elif isinstance(action, DeadLetter):
                entry = self._get(action.message, epoch)
                if entry is not None:
                    entry.span.add_event("dead_letter", {"reason": action.reason}, self._now_ns())
                    self._end(action.message, "dead_lettered")
            elif isinstance(action, DropDuplicate):
                found = self._open.get(_identity(action.message))
                if found is not None and found.opened_by is action.message:
                    found.span.add_event("duplicate", {"reason": action.reason}, self._now_ns())
                    self._end(action.message, "duplicate")
                elif found is not None:
                    found.span.add_event("copy_dropped", {"reason": action.reason}, self._now_ns())

    def released(self, deliveries: Sequence[Deliver]) -> None:
        """Handed out to a stream: released by its key's order, or by the watermark."""
        if self._tracer is None:
            return
        now_ns = self._now_ns()
        for delivery in deliveries:
            entry = self._open.get(_identity(delivery.message))
            if entry is not None:
                by = "watermark" if "watermark" in entry.waited else "order"
                entry.span.add_event("released", {"by": by}, now_ns)

    def delivered(self, deliveries: Sequence[Deliver]) -> list[str]:
        """The ``traceparent`` of each delivery, for the app (payloads read back already); records
        ``delivered``, and counts a malformed context at attempt 1."""
        out: list[str] = []
        if self._tracer is None:
            return [self._carried(delivery) for delivery in deliveries]
        now_ns = self._now_ns()
        for delivery in deliveries:
            entry = self._get(delivery.message, delivery.epoch)
            if entry is None:  # past max_open_spans: the message's own context
                out.append(self._carried(delivery))
                continue
            self._count(entry.reading, delivery)
            if delivery.epoch != entry.epoch:  # the shard came back at a new epoch meanwhile
                entry.epoch = delivery.epoch
                entry.span.set_attribute("sidecar.epoch", delivery.epoch)
            entry.attempts = max(entry.attempts, delivery.attempt)
            entry.delivery_ids.append(delivery.delivery_id)
            self._by_delivery[delivery.delivery_id] = _identity(delivery.message)
            entry.span.add_event(
                "delivered",
                {"delivery_id": delivery.delivery_id, "attempt": delivery.attempt, "stream": delivery.consumer},
                now_ns,
            )
            out.append(entry.traceparent)
        return out

    def acked(self, delivery_ids: Iterable[str]) -> None:
        self._event(delivery_ids, "acked")

    def nacked(self, delivery_ids: Iterable[str], dead_letter: bool) -> None:
        """Given back by the app: redelivered after a backoff (or dead-lettered at once)."""
        if self._tracer is None:
            return
        for delivery_id in delivery_ids:
            entry = self._by_id(delivery_id)
            if entry is not None:
                if not dead_letter and "backoff" not in entry.waited:
                    entry.waited.append("backoff")
                entry.span.add_event("nacked", {"dead_letter": dead_letter}, self._now_ns())

    def confirmed(self, delivery_ids: Iterable[str]) -> None:
        """Acks made durable: the message is done; its span ends."""
        if self._tracer is None:
            return
        for delivery_id in delivery_ids:
            identity = self._by_delivery.get(delivery_id)
            entry = None if identity is None else self._open.get(identity)
            if identity is not None and entry is not None:
                entry.span.add_event("confirmed", timestamp=self._now_ns())
                self._end_identity(identity, "acked")

    def keep_shards(self, shards: Mapping[int, int]) -> None:
        """This pod delivers only ``shards`` (shard -> epoch) now: the spans of other shards end."""
        if self._tracer is None:
            return
        for identity, entry in list(self._open.items()):
            if entry.shard not in shards:
                entry.span.add_event("handed_over", timestamp=self._now_ns())
                self._end_identity(identity, "handed_over")

    def end_all(self) -> None:
        """The runtime stopped: every open span ends (outcome ``stopped``; the message stays pending,
        and the next process to deliver it records a span of its own)."""
        for identity in list(self._open):
            self._end_identity(identity, "stopped")

    # ---- inside ----------------------------------------------------------------------------

    def _carried(self, delivery: Deliver) -> str:
        """The traceparent the message carries, unchanged ("" when none is valid); counted."""
        reading = _reading(delivery.message)
        self._count(reading, delivery)
        context = reading.context
        return "" if context is None else format_traceparent(context.trace_id, context.span_id, context.flags)

    def _count(self, reading: Reading, delivery: Deliver) -> None:
        if reading.invalid is not None and delivery.attempt == 1:
            self.counters.count_invalid(self.subscription, reading.invalid)

    def _event(self, delivery_ids: Iterable[str], name: str) -> None:
        if self._tracer is None:
            return
        for delivery_id in delivery_ids:
            entry = self._by_id(delivery_id)
            if entry is not None:
                entry.span.add_event(name, timestamp=self._now_ns())

    def _by_id(self, delivery_id: str) -> _Trace | None:
        identity = self._by_delivery.get(delivery_id)
        return None if identity is None else self._open.get(identity)

    def _now_ns(self) -> int:
        assert self._clock is not None, "MessageTraces.bind() was not called"
        return self._clock() * _NS_PER_MS

    def _get(self, message: Message, epoch: int) -> _Trace | None:
        """The message's open span, opened now if it has none (None: past ``max_open_spans``)."""
        identity = _identity(message)
        entry = self._open.get(identity)
        if entry is not None:
            return entry
        if len(self._open) >= self._max_open:
            self.counters.spans_not_recorded += 1
            return None
        assert self._tracer is not None
        reading = _reading(message)
        shard = self._route(message.key)
        attributes: dict[str, str | int] = {
            "messaging.system": "gcp_pubsub",
            "messaging.operation.type": "process",
            "messaging.message.id": message.message_id,
            "sidecar.subscription": self.subscription,
            "sidecar.key": message.key,
            "sidecar.dedup_id": message.dedup_id,
            "sidecar.shard": shard,
            "sidecar.epoch": epoch,
        }
        if message.sequence is not None:
            attributes["sidecar.sequence"] = message.sequence
        if message.timestamp_ms is not None:
            attributes["sidecar.event_time_ms"] = message.timestamp_ms
        links: list[Link] = []
        parent = None
        creation = reading.context
        if creation is not None:
            remote = SpanContext(
                creation.trace_id,
                creation.span_id,
                is_remote=True,
                trace_flags=TraceFlags(creation.flags),
                trace_state=TraceState(list(creation.tracestate)),
            )
            links.append(Link(remote, {"messaging.operation.type": "create"}))
            parent = trace.set_span_in_context(NonRecordingSpan(remote))
        start_ns = message.stored_at_ms * _NS_PER_MS
        span = self._tracer.start_span(
            f"process {self.subscription}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
            start_time=start_ns,
        )
        span.add_event("received", timestamp=start_ns)
        own = span.get_span_context()
        entry = _Trace(
            span,
            shard,
            epoch,
            message,
            reading,
            format_traceparent(own.trace_id, own.span_id, int(own.trace_flags)),
        )
        self._open[identity] = entry
        return entry

    def _end(self, message: Message, outcome: str) -> None:
        self._end_identity(_identity(message), outcome)

    def _end_identity(self, identity: _Identity, outcome: str) -> None:
        entry = self._open.pop(identity, None)
        if entry is None:
            return
        for delivery_id in entry.delivery_ids:
            self._by_delivery.pop(delivery_id, None)
        span = entry.span
        span.set_attributes(
            {
                "sidecar.outcome": outcome,
                "sidecar.waited_for": entry.waited,
                "sidecar.delivery_attempts": entry.attempts,
            }
        )
        span.end(self._now_ns())


def _reading(message: Message) -> Reading:
    payload = message.payload
    return NO_CONTEXT if payload is None else read_trace_context(payload.attributes)


def _identity(message: Message) -> _Identity:
    return (message.key, message.dedup_id, message.replay_id)
