"""Quiet logs (issue 31): an ordinary hand-over is INFO; only a shard lost without a drain is a WARNING."""

from __future__ import annotations

import logging

import pytest
from test_runtime_shards import World

_RUNTIME_LOGGER = "sidecar.pipeline.runtime_shards"


async def test_a_drained_shard_handed_over_is_logged_at_info(world: World, caplog: pytest.LogCaptureFixture) -> None:
    world.hold(0, 3)
    await world.runtime.adopt_shard(0, 3)
    await world.runtime.loaded()
    with caplog.at_level(logging.INFO, logger=_RUNTIME_LOGGER):
        await world.runtime.drain_shard(0, timeout_seconds=5)
        assert world.runtime.drop_shard(0, 3)
    [record] = [r for r in caplog.records if "shard 0 (epoch 3)" in r.getMessage()]
    assert record.levelno == logging.INFO and "handed over" in record.getMessage()


async def test_a_shard_lost_without_a_drain_is_a_warning(world: World, caplog: pytest.LogCaptureFixture) -> None:
    world.hold(1, 4)
    await world.runtime.adopt_shard(1, 4)
    await world.runtime.loaded()
    with caplog.at_level(logging.INFO, logger=_RUNTIME_LOGGER):
        assert world.runtime.drop_shard(1, 4)
    [record] = [r for r in caplog.records if "shard 1 (epoch 4)" in r.getMessage()]
    assert record.levelno == logging.WARNING and "lease was lost or fenced" in record.getMessage()
