"""``shard_of`` is stable (a fixed table: changing it would move keys between pods) and uniform."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.shards import MAX_SHARDS, shard_of


def test_known_values_never_change() -> None:
    # Pods of different versions must agree on a key's shard: these values are part of the layout.
    assert [shard_of(f"order-{i}", 16) for i in range(8)] == [3, 11, 13, 14, 5, 12, 12, 5]
    assert shard_of("order-1", 1) == 0


@given(st.text(), st.integers(min_value=1, max_value=MAX_SHARDS))
def test_in_range(key: str, count: int) -> None:
    assert 0 <= shard_of(key, count) < count


def test_uniform_enough() -> None:
    counts = collections.Counter(shard_of(f"key-{i}", 16) for i in range(16_000))
    assert len(counts) == 16
    assert min(counts.values()) > 800 and max(counts.values()) < 1200


@pytest.mark.parametrize("count", [0, -1, MAX_SHARDS + 1])
def test_bad_count_refused(count: int) -> None:
    with pytest.raises(ValueError, match="shard count"):
        shard_of("k", count)
