"""``LeaseBook`` (the stream intake's leases, flow-control load and ack deadline) against a model
written from the official client's rules (``leaser.py``, ``histogram.py``, the streaming pull
manager's ``_obtain_ack_deadline``), under random operations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.pipeline.ingest_leases import MAX_ACK_DEADLINE_SECONDS, MIN_ACK_DEADLINE_SECONDS, AckHistogram, LeaseBook

_IDS = st.sampled_from([f"a{i}" for i in range(12)])
_STEPS = st.sampled_from([0, 0.5, 1, 12, 25, 60, 61, 300, 700])
"""Seconds between operations: whole values (so that a lease exactly at its limit happens) around
the deadline range's edges and the lease limits below."""
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), _IDS, st.integers(1, 5_000), _STEPS),
        st.tuples(st.just("ack"), _IDS, st.just(0), _STEPS),
        st.tuples(st.just("nack"), _IDS, st.just(0), _STEPS),
        st.tuples(st.just("due"), _IDS, st.just(0), _STEPS),
    ),
    max_size=80,
)


def _percentile99(latencies: list[float]) -> int:
    if not latencies:
        return MIN_ACK_DEADLINE_SECONDS
    values = sorted(min(MAX_ACK_DEADLINE_SECONDS, max(MIN_ACK_DEADLINE_SECONDS, math.ceil(v))) for v in latencies)
    target = len(values) * 99 / 100
    return values[max(0, math.ceil(target) - 1)]


@settings(max_examples=500, deadline=None)
@given(ops=_OPS, cap=st.sampled_from([0, 10, 30, 600]), max_lease=st.sampled_from([60.0, 61.0, 3600.0]))
def test_the_lease_book_holds_what_was_received_and_not_settled_and_asks_for_the_p99_deadline(
    ops: list[tuple[str, str, int, float]], cap: int, max_lease: float
) -> None:
    book = LeaseBook(max_messages=5, max_bytes=10_000, max_lease_seconds=max_lease, max_extension_seconds=cap)
    held: dict[str, tuple[int, float]] = {}
    latencies: list[float] = []
    size_at_update = 0
    deadline = MIN_ACK_DEADLINE_SECONDS
    now = 0.0
    for op, ack_id, size, step in ops:
        now += step
        if op == "add":
            book.add(ack_id, size, now)
            held.setdefault(ack_id, (size, now))
        elif op in ("ack", "nack"):
            assert book.release(ack_id, now, acked=op == "ack") == (ack_id in held)
            lease = held.pop(ack_id, None)
            if lease is not None and op == "ack":
                latencies.append(now - lease[1])
        else:
            extend, dropped = book.due(now)
            expected_dropped = {a for a, (_s, t) in held.items() if t < now - max_lease}
            assert set(dropped) == expected_dropped
            for a in expected_dropped:
                del held[a]
            assert set(extend) == set(held)
        # The sticky deadline: computed again once the acks grew past min(2x, +100).
        if len(latencies) > min(size_at_update * 2, size_at_update + 100):
            size_at_update = len(latencies)
            deadline = _percentile99(latencies)
        expected = min(deadline, max(cap, MIN_ACK_DEADLINE_SECONDS)) if cap else deadline
        assert book.deadline() == expected
        assert MIN_ACK_DEADLINE_SECONDS <= book.deadline() <= MAX_ACK_DEADLINE_SECONDS
        assert len(book) == len(held)
        assert book.bytes == sum(s for s, _t in held.values())
        assert book.load() == pytest.approx(max(len(held) / 5, book.bytes / 10_000))
        for on_hold in range(len(held) + 1):
            assert book.has_room(on_hold) == (len(held) - on_hold < 5 and book.bytes < 10_000)


def test_the_histogram_clamps_to_pubsubs_deadline_range() -> None:
    histogram = AckHistogram()
    assert histogram.percentile(99) == MIN_ACK_DEADLINE_SECONDS
    for seconds in (0.2, 3, 11.5, 2_000):
        histogram.add(seconds)
    assert histogram.percentile(50) == 10
    assert histogram.percentile(75) == 12
    assert histogram.percentile(99) == MAX_ACK_DEADLINE_SECONDS


def test_a_cap_below_the_minimum_is_raised_to_it_and_bad_limits_are_refused() -> None:
    book = LeaseBook(max_messages=1, max_bytes=1, max_lease_seconds=60, max_extension_seconds=5)
    assert book.deadline() == MIN_ACK_DEADLINE_SECONDS
    with pytest.raises(ValueError, match="max_messages"):
        LeaseBook(max_messages=0, max_bytes=1, max_lease_seconds=60)
    with pytest.raises(ValueError, match="max_lease_seconds"):
        LeaseBook(max_messages=1, max_bytes=1, max_lease_seconds=0)
