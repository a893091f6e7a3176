"""The one backoff helper: exponential from ``initial``, capped at ``maximum``, jittered into [c/2, c]."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.backoff import backoff_seconds


@given(st.integers(min_value=0, max_value=10_000), st.floats(0.001, 10), st.floats(1, 100))
def test_within_half_to_full_ceiling(attempt: int, initial: float, extra: float) -> None:
    maximum = initial * extra
    ceiling = min(maximum, initial * 2 ** min(attempt, 32))
    assert ceiling / 2 <= backoff_seconds(attempt, initial, maximum) <= ceiling


def test_grows_then_caps() -> None:
    assert backoff_seconds(0, 1.0, 60.0) <= 1.0
    assert backoff_seconds(3, 1.0, 60.0) >= 4.0
    assert 30.0 <= backoff_seconds(50, 1.0, 60.0) <= 60.0


def test_jitter_spreads_retries() -> None:
    assert len({backoff_seconds(4, 1.0, 60.0) for _ in range(20)}) > 10


@pytest.mark.parametrize(("attempt", "initial", "maximum"), [(-1, 1.0, 2.0), (0, 0.0, 1.0), (0, 2.0, 1.0)])
def test_bad_arguments(attempt: int, initial: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        backoff_seconds(attempt, initial, maximum)
