"""W3C trace context (https://www.w3.org/TR/trace-context/) read from a message's attributes. Pure.

Rules:

- **Where.** The ``googclient_traceparent`` / ``googclient_tracestate`` pair (the official Pub/Sub
  clients with OpenTelemetry tracing on) when ``googclient_traceparent`` is present, else the plain
  ``traceparent`` / ``tracestate`` pair (publishers that propagate W3C context as attributes). A tracestate
  is read only beside the traceparent of its own pair.
- **traceparent**, strictly: version ``00`` only, exactly ``00-<32 hex>-<16 hex>-<2 hex>`` in
  lowercase, a trace id and a parent id that are not all zeros. Anything else (another version, an
  uppercase or short id, spaces, a suffix) is invalid: the message is delivered as if it carried no
  context, and the caller counts it (``Reading.invalid``). Never an error, never a dead letter.
- **tracestate**: at most ``MAX_TRACESTATE_CHARS`` characters and ``MAX_TRACESTATE_MEMBERS``
  list members; each member ``key=value`` with the key and value grammar of the specification and
  no key twice (empty members between commas are allowed). An invalid tracestate is dropped alone:
  the traceparent still holds.
- ``format_traceparent`` writes the same format back (version 00), for the app.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

GOOGCLIENT_PREFIX = "googclient_"
"""The official Pub/Sub clients' prefix for trace context attributes (google-cloud-pubsub's
``open_telemetry/context_propagation.py``)."""

MAX_TRACESTATE_CHARS = 512
"""The specification's size every vendor must propagate; a longer header may be dropped whole."""

MAX_TRACESTATE_MEMBERS = 32
"""The specification's limit on list members."""

_TRACEPARENT_RE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_SIMPLE_KEY = r"[a-z][_0-9a-z\-*/]{0,255}"
_MULTI_TENANT_KEY = r"[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER_RE = re.compile(rf"({_SIMPLE_KEY}|{_MULTI_TENANT_KEY})=({_VALUE})")

InvalidPart = Literal["traceparent", "tracestate"]


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A valid W3C trace context: the creation context of a message."""

    trace_id: int
    span_id: int
    flags: int
    tracestate: tuple[tuple[str, str], ...] = ()
    """The list members in order (the left-most is the most recent vendor's)."""

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 0x01)


@dataclass(frozen=True, slots=True)
class Reading:
    """What a message's attributes say: its context (None: none, or none valid) and what was invalid."""

    context: TraceContext | None
    invalid: InvalidPart | None = None
    """The part found and refused (the traceparent wins when both are bad): what the counter counts."""


NO_CONTEXT = Reading(None)


def read_trace_context(attributes: Mapping[str, str]) -> Reading:
    """The trace context ``attributes`` carry (rules in the module docstring); never raises."""
    traceparent = attributes.get(GOOGCLIENT_PREFIX + "traceparent")
    if traceparent is not None:
        tracestate = attributes.get(GOOGCLIENT_PREFIX + "tracestate")
    else:
        traceparent = attributes.get("traceparent")
        if traceparent is None:
            return NO_CONTEXT
        tracestate = attributes.get("tracestate")
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return Reading(None, "traceparent")
    trace_id, span_id, flags = parsed
    if tracestate is None or tracestate.strip(" \t") == "":
        return Reading(TraceContext(trace_id, span_id, flags))
    members = parse_tracestate(tracestate)
    if members is None:
        return Reading(TraceContext(trace_id, span_id, flags), "tracestate")
    return Reading(TraceContext(trace_id, span_id, flags, members))


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, parent id, flags) of a version-00 traceparent, or None when it is not one."""
    match = _TRACEPARENT_RE.fullmatch(value)
    if match is None:
        return None
    trace_id, span_id, flags = int(match[1], 16), int(match[2], 16), int(match[3], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, flags


def parse_tracestate(value: str) -> tuple[tuple[str, str], ...] | None:
    """The list members of a tracestate, or None when it breaks a rule of the module docstring."""
    if len(value) > MAX_TRACESTATE_CHARS:
        return None
    members: list[tuple[str, str]] = []
    seen: set[str] = set()
    for raw in value.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        match = _MEMBER_RE.fullmatch(member)
        if match is None or match[1] in seen:
            return None
        seen.add(match[1])
        members.append((match[1], match[2]))
    if len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    return tuple(members)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The version-00 traceparent of these ids, as the app receives it."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def format_tracestate(members: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{key}={value}" for key, value in members)
