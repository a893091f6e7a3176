"""W3C trace context read from a message's attributes: strict traceparent, bounded tracestate, never raising."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.ops.trace_context import (
    MAX_TRACESTATE_CHARS,
    MAX_TRACESTATE_MEMBERS,
    NO_CONTEXT,
    TraceContext,
    format_traceparent,
    format_tracestate,
    parse_traceparent,
    read_trace_context,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{SPAN_ID}-01"


def test_the_official_clients_attributes_are_read_first() -> None:
    other = f"00-{'1' * 32}-{'2' * 16}-00"
    reading = read_trace_context(
        {"googclient_traceparent": VALID, "googclient_tracestate": "congo=t61rcWkgMzE", "traceparent": other}
    )
    assert reading.invalid is None
    assert reading.context == TraceContext(int(TRACE_ID, 16), int(SPAN_ID, 16), 1, (("congo", "t61rcWkgMzE"),))
    assert reading.context.sampled


def test_the_plain_attributes_are_read_when_the_official_ones_are_absent() -> None:
    reading = read_trace_context({"traceparent": VALID, "tracestate": "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE"})
    assert reading.context is not None
    assert reading.context.tracestate == (("rojo", "00f067aa0ba902b7"), ("congo", "t61rcWkgMzE"))
    # A tracestate of the other pair is not read beside a traceparent.
    mixed = read_trace_context({"googclient_traceparent": VALID, "tracestate": "rojo=1"})
    assert mixed.context is not None and mixed.context.tracestate == ()


def test_no_attributes_no_context() -> None:
    assert read_trace_context({}) is NO_CONTEXT
    assert read_trace_context({"tracestate": "rojo=1"}) is NO_CONTEXT


@pytest.mark.parametrize(
    "value",
    [
        f"01-{TRACE_ID}-{SPAN_ID}-01",  # another version
        f"ff-{TRACE_ID}-{SPAN_ID}-01",  # the forbidden version
        f"00-{TRACE_ID.upper()}-{SPAN_ID}-01",  # uppercase
        f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01",  # a short trace id
        f"00-{TRACE_ID}-{SPAN_ID}0-01",  # a long parent id
        f"00-{'0' * 32}-{SPAN_ID}-01",  # an all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # an all-zero parent id
        f"00-{TRACE_ID}-{SPAN_ID}-1",  # one flag digit
        f"00-{TRACE_ID}-{SPAN_ID}-0g",  # not hex
        f" {VALID}",  # a space
        f"{VALID}-extra",  # a suffix (version 00 has none)
        f"00_{TRACE_ID}_{SPAN_ID}_01",
        "",
        "garbage",
        "00-" + "é" * 32 + f"-{SPAN_ID}-01",
    ],
)
def test_a_malformed_traceparent_is_ignored_and_named(value: str) -> None:
    assert read_trace_context({"googclient_traceparent": value}).invalid == "traceparent"
    assert read_trace_context({"traceparent": value, "tracestate": "rojo=1"}) == read_trace_context(
        {"traceparent": value}
    )
    assert read_trace_context({"traceparent": value}).context is None


@pytest.mark.parametrize(
    "value",
    [
        "x" * (MAX_TRACESTATE_CHARS + 1),  # over-long
        ",".join(f"k{i}=v" for i in range(MAX_TRACESTATE_MEMBERS + 1)),  # too many members
        "Upper=1",  # keys are lowercase
        "rojo=1,rojo=2",  # a key twice
        "rojo",  # no value
        "rojo=a,b",  # a comma inside a value
        "rojo=a=b",  # an equals sign inside a value
        "rojo= ",  # a value that ends in a space
        "rojo=\u00e9",  # not printable ASCII
        "1abc=1",  # a simple key starts with a letter
        "tenant@SYSTEM=1",
    ],
)
def test_a_malformed_tracestate_is_dropped_alone(value: str) -> None:
    reading = read_trace_context({"traceparent": VALID, "tracestate": value})
    assert reading.invalid == "tracestate"
    assert reading.context == TraceContext(int(TRACE_ID, 16), int(SPAN_ID, 16), 1)


def test_tracestate_limits_hold_at_the_limit() -> None:
    members = ",".join(f"k{i}=v" for i in range(MAX_TRACESTATE_MEMBERS))
    assert read_trace_context({"traceparent": VALID, "tracestate": members}).invalid is None
    # A value of 256 characters (the most), and the whole header exactly at its limit.
    head = f"{'a' * 10}={'w' * 256},b="
    long_one = head + "v" * (MAX_TRACESTATE_CHARS - len(head))
    assert len(long_one) == MAX_TRACESTATE_CHARS
    assert read_trace_context({"traceparent": VALID, "tracestate": long_one}).invalid is None
    assert read_trace_context({"traceparent": VALID, "tracestate": "t1-x@sys=1, ,b=2"}).invalid is None


ids = st.integers(min_value=1, max_value=2**128 - 1)


@given(trace_id=ids, span_id=st.integers(min_value=1, max_value=2**64 - 1), flags=st.integers(0, 255))
def test_format_and_parse_agree(trace_id: int, span_id: int, flags: int) -> None:
    text = format_traceparent(trace_id, span_id, flags)
    assert len(text) == 55
    assert parse_traceparent(text) == (trace_id, span_id, flags)


@given(st.dictionaries(st.text(max_size=30), st.text(max_size=80), max_size=6))
def test_any_attributes_never_raise(attributes: dict[str, str]) -> None:
    reading = read_trace_context(attributes)
    assert reading.context is None or reading.invalid in (None, "tracestate")


@given(st.text(max_size=600))
def test_any_tracestate_is_read_or_refused_never_raises(value: str) -> None:
    reading = read_trace_context({"traceparent": VALID, "tracestate": value})
    assert reading.context is not None
    if reading.invalid is None:
        members = reading.context.tracestate
        assert len(members) <= MAX_TRACESTATE_MEMBERS
        assert len(format_tracestate(members)) <= MAX_TRACESTATE_CHARS
