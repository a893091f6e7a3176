"""Config values, durations and byte sizes: what parses, to what, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.durations import MAX_DURATION_MS, format_duration_ms, parse_byte_size, parse_duration_ms


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("0s", 0),
        ("500ms", 500),
        ("30s", 30_000),
        ("5m", 300_000),
        ("2h", 7_200_000),
        ("7d", 604_800_000),
        ("1m30s", 90_000),
        ("1h30m", 5_400_000),
        ("1d2h3m4s5ms", 93_784_005),
        ("3650d", MAX_DURATION_MS),
    ],
)
def test_durations_parse(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize(
    "value",
    [60, 1.5, True, None, "", "60", " 30s", "30s ", "1.5s", "-1s", "30S", "30sec", "30 s", "s", "30s1m", "1s1s",
     "3651d", "99999999999999999999999d", ["30s"]],
)  # fmt: skip
def test_durations_reject(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration_ms(value)


@given(st.integers(min_value=0, max_value=MAX_DURATION_MS))
def test_duration_format_round_trips(ms: int) -> None:
    assert parse_duration_ms(format_duration_ms(ms)) == ms


@pytest.mark.parametrize(
    ("value", "size"),
    [(4096, 4096), ("4096B", 4096), ("10KB", 10_000), ("10KiB", 10_240), ("100MiB", 104_857_600), ("1GB", 10**9)],
)
def test_byte_sizes_parse(value: Any, size: int) -> None:
    assert parse_byte_size(value) == size


@pytest.mark.parametrize("value", ["100 MiB", "100mib", "1.5GB", "-1", True, 1.5, None])
def test_byte_sizes_reject(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(value)
