"""Lag as capacity (``sidecar.ops.capacity``): rates over a sliding minute, growth and its duration.

Pure: every instant is an argument, so nothing here sleeps.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.ops.capacity import MIN_SPAN_SECONDS, WINDOW_SECONDS, CapacityWindow, LeaseHealth


def feed(
    window: CapacityWindow, seconds: int, intake_rate: int, delivered_rate: int, start: tuple[int, int, int]
) -> tuple[int, int, int]:
    """One sample a second for ``seconds`` at steady rates, from (instant, intake, delivered)."""
    at, intake, delivered = start
    for _ in range(seconds):
        at, intake, delivered = at + 1, intake + intake_rate, delivered + delivered_rate
        window.observe(at, intake, delivered)
    return at, intake, delivered


def test_no_rates_until_the_samples_span_enough_time() -> None:
    window = CapacityWindow()
    assert not window.capacity(0).known
    window.observe(0, 0, 0)
    feed(window, int(MIN_SPAN_SECONDS) - 1, 100, 0, (0, 0, 0))
    capacity = window.capacity(MIN_SPAN_SECONDS - 1)
    assert not capacity.known and not capacity.growing


def test_steady_rates_over_the_window_and_a_backlog_that_grows_for_as_long_as_the_deficit_lasts() -> None:
    window = CapacityWindow()
    window.observe(0, 0, 0)
    state = feed(window, 120, 120, 100, (0, 0, 0))
    capacity = window.capacity(state[0])
    assert capacity.known and capacity.span_seconds == WINDOW_SECONDS
    assert (capacity.intake_per_second, capacity.delivered_per_second) == (120, 100)
    assert capacity.deficit_per_second == 20
    # Growth started at the first sample (the lowest backlog of the first window that showed it).
    assert capacity.growing_for_seconds == 120
    # Delivery catches up: once a whole window shows no growth, the duration is back to 0.
    state = feed(window, 30, 100, 100, state)
    assert window.capacity(state[0]).growing  # the window still holds the deficit
    state = feed(window, 40, 100, 100, state)
    assert not window.capacity(state[0]).growing
    assert window.capacity(state[0]).deficit_per_second == 0


def test_growth_counts_from_where_the_backlog_was_lowest() -> None:
    window = CapacityWindow()
    window.observe(0, 0, 0)
    state = feed(window, 100, 50, 50, (0, 0, 0))  # balanced for 100 s
    state = feed(window, 20, 60, 50, state)  # then 10 more in than out each second
    assert window.capacity(state[0]).growing_for_seconds == 20


def test_messages_in_flight_are_not_growth() -> None:
    window = CapacityWindow()
    window.observe(0, 0, 0)
    at, intake, delivered = 0, 0, 0
    for second in range(300):
        at, intake = at + 1, intake + 200
        delivered = intake - (150 if second % 7 else 5)  # up to 150 in flight at any instant
        window.observe(at, intake, delivered)
        assert not window.capacity(at).growing, second


def test_a_total_that_falls_starts_the_window_afresh() -> None:
    window = CapacityWindow()
    window.observe(0, 0, 0)
    feed(window, 30, 100, 0, (0, 0, 0))
    assert window.capacity(30).growing
    window.observe(31, 5, 5)
    assert not window.capacity(31).known and not window.capacity(31).growing


@given(st.lists(st.tuples(st.integers(0, 5_000), st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=200))
def test_rates_are_never_negative_and_growth_never_predates_the_samples(
    steps: list[tuple[int, int, int]],
) -> None:
    window = CapacityWindow()
    at = intake = delivered = 0
    window.observe(0, 0, 0)
    for gap_ms, came_in, finished in steps:
        at, intake = at + gap_ms / 1000, intake + came_in
        delivered = min(intake, delivered + finished)
        window.observe(at, intake, delivered)
        capacity = window.capacity(at)
        assert capacity.intake_per_second >= 0 and capacity.delivered_per_second >= 0
        assert 0 <= capacity.growing_for_seconds <= at
        assert capacity.span_seconds <= max(WINDOW_SECONDS, 0) + 5 or not capacity.known


def test_lease_health_says_since_when_reads_fail_and_clears_when_a_round_reads_again() -> None:
    health = LeaseHealth()
    health.observe(100.0, rounds=10, read_failures=0)
    health.observe(101.0, rounds=11, read_failures=0)
    assert health.failing_since is None
    health.observe(102.0, rounds=12, read_failures=1)
    health.observe(103.0, rounds=12, read_failures=1)  # no round in between: still failing
    health.observe(104.0, rounds=14, read_failures=3)
    assert (health.failing_since, health.failed_reads) == (102.0, 3)
    health.observe(105.0, rounds=15, read_failures=3)
    assert health.failing_since is None and health.failed_reads == 0
